//! The producer policy (`--producer-policy FILE`, docs/OPERATIONS.md "Hardened setup"): which
//! identities may report for which replicas of which tenants. YAML or JSON:
//!
//! ```yaml
//! bindings:
//!   - identities: ["spiffe://cluster.local/ns/llm/sa/vllm", "system:serviceaccount:llm:vllm"]
//!     replicas: ["decode-*"]      # exact, or a prefix ending in `*` (`*` alone: any)
//!     tenants: ["team-a"]
//! ```
//!
//! A message is allowed when one binding names one of the caller's identities (a certificate
//! SAN URI or DNS name, or a TokenReview username `system:serviceaccount:<ns>:<name>`) and
//! matches both its replica and its tenant. The file is polled by the admin thread; a changed
//! file that does not parse is logged (`producer_policy_reload`), counted and ignored: the last
//! good policy stays in force.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use serde::Deserialize;

use crate::limits::{MAX_PRODUCER_BINDINGS, MAX_PRODUCER_POLICY_BYTES};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    bindings: Vec<Binding>,
}

/// One binding: identities → replicas and tenants (patterns).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Binding {
    identities: Vec<String>,
    replicas: Vec<String>,
    tenants: Vec<String>,
}

/// A parsed policy.
#[derive(Debug)]
pub struct Policy {
    bindings: Vec<Binding>,
}

/// An exact name, or a prefix ending in `*`.
fn matches(pattern: &str, value: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => value.starts_with(prefix),
        None => pattern == value,
    }
}

fn valid_patterns(what: &str, i: usize, patterns: &[String]) -> Result<(), String> {
    if patterns.is_empty() {
        return Err(format!("binding {i}: {what} is empty"));
    }
    match patterns
        .iter()
        .find(|p| p.is_empty() || p.trim_end_matches('*').contains('*'))
    {
        Some(p) => Err(format!(
            "binding {i}: {what} pattern {p:?} (exact, or one trailing '*')"
        )),
        None => Ok(()),
    }
}

impl Policy {
    /// Parses and checks a policy (JSON when it starts with `{`, else YAML).
    pub fn parse(text: &str) -> Result<Policy, String> {
        let file: PolicyFile = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| e.to_string())?
        } else {
            serde_yaml::from_str(text).map_err(|e| e.to_string())?
        };
        if file.bindings.len() > MAX_PRODUCER_BINDINGS {
            return Err(format!(
                "{} bindings (at most {MAX_PRODUCER_BINDINGS})",
                file.bindings.len()
            ));
        }
        for (i, b) in file.bindings.iter().enumerate() {
            valid_patterns("identities", i, &b.identities)?;
            valid_patterns("replicas", i, &b.replicas)?;
            valid_patterns("tenants", i, &b.tenants)?;
        }
        Ok(Policy {
            bindings: file.bindings,
        })
    }

    /// Whether one of `names` may report for `replica` of `tenant`.
    pub fn allows(&self, names: &[String], tenant: &str, replica: &str) -> bool {
        self.bindings.iter().any(|b| {
            b.identities
                .iter()
                .any(|p| names.iter().any(|n| matches(p, n)))
                && b.replicas.iter().any(|p| matches(p, replica))
                && b.tenants.iter().any(|p| matches(p, tenant))
        })
    }
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Reads and parses the file (bounded by [`MAX_PRODUCER_POLICY_BYTES`]).
fn load(path: &Path) -> Result<Policy, String> {
    let len = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
    if len > MAX_PRODUCER_POLICY_BYTES {
        return Err(format!("{len} bytes (at most {MAX_PRODUCER_POLICY_BYTES})"));
    }
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    Policy::parse(&text)
}

/// The policy in force and the file it is reloaded from.
#[derive(Debug)]
pub struct Watched {
    path: PathBuf,
    /// (mtime of the last load attempt, policy in force).
    state: RwLock<(Option<SystemTime>, Arc<Policy>)>,
}

impl Watched {
    /// Loads the file; an error here fails start-up.
    pub fn load(path: &str) -> Result<Watched, String> {
        let path = PathBuf::from(path);
        let mt = mtime(&path);
        let policy = load(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Watched {
            path,
            state: RwLock::new((mt, Arc::new(policy))),
        })
    }

    /// The policy in force.
    pub fn current(&self) -> Arc<Policy> {
        self.state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone()
    }

    /// Reloads the file if its mtime changed; a bad file keeps the last good policy (logged and
    /// counted once per change).
    pub fn poll(&self) {
        let now = mtime(&self.path);
        if now == self.state.read().unwrap_or_else(|e| e.into_inner()).0 {
            return;
        }
        let loaded = load(&self.path);
        let mut st = self.state.write().unwrap_or_else(|e| e.into_inner());
        st.0 = now;
        match loaded {
            Ok(p) => {
                st.1 = Arc::new(p);
                tracing::info!(file = %self.path.display(), "producer_policy_reloaded");
            }
            Err(e) => {
                crate::metrics::producer::record_policy_reload_error();
                tracing::error!(file = %self.path.display(), error = %e, "producer_policy_reload");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn yaml_and_json_bind_identities_to_replicas_and_tenants() {
        let yaml = "bindings:\n  - identities: [\"spiffe://c/ns/a/sa/e\"]\n    replicas: [\"decode-*\", \"p0\"]\n    tenants: [\"team-a\"]\n";
        let json = r#"{"bindings":[{"identities":["spiffe://c/ns/a/sa/e"],"replicas":["decode-*","p0"],"tenants":["team-a"]}]}"#;
        for text in [yaml, json] {
            let p = Policy::parse(text).unwrap();
            let me = names(&["e.svc", "spiffe://c/ns/a/sa/e"]);
            assert!(p.allows(&me, "team-a", "decode-7"));
            assert!(p.allows(&me, "team-a", "p0"));
            assert!(!p.allows(&me, "team-a", "p01"), "exact");
            assert!(!p.allows(&me, "team-b", "decode-7"), "tenant");
            assert!(
                !p.allows(&names(&["other"]), "team-a", "decode-7"),
                "identity"
            );
            assert!(!p.allows(&[], "team-a", "decode-7"), "anonymous");
        }
    }

    #[test]
    fn malformed_policies_are_refused() {
        for bad in [
            "",
            "bindings: 3",
            "{\"bindings\":[{\"identities\":[],\"replicas\":[\"r\"],\"tenants\":[\"t\"]}]}",
            "{\"bindings\":[{\"identities\":[\"a*b\"],\"replicas\":[\"r\"],\"tenants\":[\"t\"]}]}",
            "{\"bindings\":[{\"identities\":[\"a\"],\"replicas\":[\"r\"],\"tenants\":[\"t\"],\"x\":1}]}",
        ] {
            assert!(Policy::parse(bad).is_err(), "{bad:?}");
        }
        let star = Policy::parse(
            "{\"bindings\":[{\"identities\":[\"*\"],\"replicas\":[\"*\"],\"tenants\":[\"*\"]}]}",
        )
        .unwrap();
        assert!(star.allows(&names(&["x"]), "t", "r"));
        assert!(
            !star.allows(&[], "t", "r"),
            "a binding never matches no identity"
        );
    }
}
