//! `/probe`: the controller's functional self-test of the routing path (docs/BEHAVIOUR.md §15).
//!
//! A run ingests one synthetic chain for a reserved tenant and replica, checks that the plain
//! prefix lookup and the orchestrated lookup both find it, and always cleans up with an
//! in-process `ALL_CLEARED`. Everything happens on the core that owns
//! `(inferencecache.io/probe, model)`, directly against the index: the gRPC handler (which
//! refuses the probe tenant), the server floors and the policy gates are bypassed on purpose.
//! Runs for the same `(backend, model)` are serialised; different pairs run in parallel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::{LookupQuery, Strategy};
use inferencecache_proto::v1alpha1 as pb;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::gojson::push_str;
use crate::limits::{MAX_PROBE_BODY_BYTES, PROBE_TIMEOUT};
use crate::runtime::mailbox;
use crate::shard::CoreState;
use crate::sys::clock::unix_now_ns;

/// Tokens of the single synthetic block.
pub const PROBE_BLOCK_TOKENS: i32 = 16;
/// Domain separator of the probe hash (versioned so a future scheme cannot collide).
pub const PROBE_HASH_DOMAIN: &[u8] = b"inferencecache.io/probe/v1\n";
/// Prefix of the synthetic replica id.
pub const PROBE_REPLICA_PREFIX: &str = "__probe-";
/// Message of a request missing a required field (400 body without the newline).
pub const MISSING_FIELD: &str = "probe request missing required field (backend, model, hashScheme)";

/// The request body.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    /// Backend name (the CacheBackend the controller is checking).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub backend: String,
    /// Model id.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub model: String,
    /// Hash scheme.
    #[serde(default, rename = "hashScheme", deserialize_with = "null_as_empty")]
    pub hash_scheme: String,
    /// `LMCache` or empty enables the T2 stage (when a T2 prober is wired; none is).
    #[serde(default, rename = "backendType", deserialize_with = "null_as_empty")]
    pub backend_type: String,
}

/// Go decodes a JSON `null` into a string field as "leave it empty".
fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// Decodes and validates a body; `Err` is the complete 400 body (with trailing newline).
pub fn parse_request(body: &[u8]) -> Result<ProbeRequest, String> {
    if body.len() > MAX_PROBE_BODY_BYTES {
        return Err("decode probe request: http: request body too large\n".into());
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let req =
        ProbeRequest::deserialize(&mut de).map_err(|e| format!("decode probe request: {e}\n"))?;
    // Exactly one JSON value: anything but whitespace after it is refused.
    if de.end().is_err() {
        return Err("decode probe request: request body must contain a single JSON value\n".into());
    }
    if req.backend.is_empty() || req.model.is_empty() || req.hash_scheme.is_empty() {
        return Err(format!("{MISSING_FIELD}\n"));
    }
    Ok(req)
}

fn lp(h: &mut Sha256, s: &str) {
    h.update((s.len() as u32).to_be_bytes());
    h.update(s.as_bytes());
}

/// `SHA-256(domain ‖ lp(hashScheme) ‖ lp(model) ‖ lp(backend))`, `lp(s) = u32_be(len) ‖ s`:
/// deterministic and injective under field-boundary shifts.
pub fn probe_hash(hash_scheme: &str, model: &str, backend: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(PROBE_HASH_DOMAIN);
    lp(&mut h, hash_scheme);
    lp(&mut h, model);
    lp(&mut h, backend);
    h.finalize().into()
}

/// The synthetic replica id of `backend`.
pub fn replica_id(backend: &str) -> String {
    format!("{PROBE_REPLICA_PREFIX}{backend}")
}

/// Outcome of one stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stage {
    /// Not run (a zero value: never counts as passed).
    #[default]
    Unset,
    /// Passed.
    Ok,
    /// Failed (see `errors`).
    Failed,
    /// Not applicable or blocked by an earlier failure.
    Skipped,
}

impl Stage {
    fn as_str(self) -> &'static str {
        match self {
            Stage::Unset => "",
            Stage::Ok => "ok",
            Stage::Failed => "failed",
            Stage::Skipped => "skipped",
        }
    }
}

/// The response body.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProbeResult {
    /// Echo of the request's backend.
    pub backend: String,
    /// Stage A.
    pub ingest: Stage,
    /// Stage B.
    pub routing: Stage,
    /// Stage C.
    pub t2: Stage,
    /// `(stage, message)` per failure.
    pub errors: Vec<(&'static str, String)>,
}

impl ProbeResult {
    /// Whether the run passed: ingest and routing ok, t2 ok or skipped (never unset), no errors.
    pub fn passed(&self) -> bool {
        self.ingest == Stage::Ok
            && self.routing == Stage::Ok
            && matches!(self.t2, Stage::Ok | Stage::Skipped)
            && self.errors.is_empty()
    }

    /// The JSON body (Go encoder shape, trailing newline; `errors` omitted when empty).
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"backend\":");
        push_str(&mut out, &self.backend);
        for (k, v) in [
            ("ingest", self.ingest),
            ("routing", self.routing),
            ("t2", self.t2),
        ] {
            out.push_str(&format!(",\"{k}\":"));
            push_str(&mut out, v.as_str());
        }
        if !self.errors.is_empty() {
            out.push_str(",\"errors\":[");
            for (i, (stage, msg)) in self.errors.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str("{\"stage\":");
                push_str(&mut out, stage);
                out.push_str(",\"message\":");
                push_str(&mut out, msg);
                out.push('}');
            }
            out.push(']');
        }
        out.push_str("}\n");
        out
    }
}

/// Runs the three stages and the cleanup on the current core's index (synchronously, so the
/// run is atomic with respect to every other operation on that core).
pub fn run_on_core(st: &mut CoreState, req: &ProbeRequest) -> ProbeResult {
    let rid = replica_id(&req.backend);
    let block_hashes = vec![probe_hash(&req.hash_scheme, &req.model, &req.backend).to_vec()];
    let counts = [PROBE_BLOCK_TOKENS];
    let mut res = ProbeResult {
        backend: req.backend.clone(),
        ..Default::default()
    };
    let now = unix_now_ns();
    let policy = st.policy.clone();
    let _ = st
        .index
        .ingest(&probe_update(req, &rid, &block_hashes), now, &*policy);
    let q = LookupQuery {
        tenant: PROBE_TENANT,
        model: &req.model,
        hash_scheme: &req.hash_scheme,
        block_hashes: (&block_hashes).into(),
        block_token_counts: &counts,
        ..Default::default()
    };
    // Stage A: the plain prefix lookup must return the probe replica.
    let found = {
        let view = st.index.lookup(&q, now, &*policy);
        view.scores.iter().any(|s| view.replica_id(s) == rid)
    };
    if found {
        res.ingest = Stage::Ok;
        routing_stage(st, &q, now, &rid, &mut res);
    } else {
        res.ingest = Stage::Failed;
        res.errors.push((
            "ingest",
            format!("prefix lookup after ingest did not return probe replica {rid}"),
        ));
        res.routing = Stage::Skipped;
    }
    // Stage C: no T2 prober is wired in this server, so it is always skipped.
    res.t2 = Stage::Skipped;
    // Cleanup, always: the probe block by PREFIX_EVICTED (one key), then ALL_CLEARED for
    // (probe tenant, model, probe replica), which then has nothing left to find in the store
    // (a clear that does leaves a pending clear the next operation on the core finishes).
    let evicted = pb::CacheEvent {
        r#type: pb::cache_event::Type::PrefixEvicted as i32,
        replica_id: rid.clone(),
        model_id: req.model.clone(),
        tenant_id: PROBE_TENANT.into(),
        prefix_hash: block_hashes[0].clone(),
        ..Default::default()
    };
    let _ = st.index.apply_event(&evicted, now, &*policy);
    let clear = pb::CacheEvent {
        r#type: pb::cache_event::Type::AllCleared as i32,
        replica_id: rid,
        model_id: req.model.clone(),
        tenant_id: PROBE_TENANT.into(),
        ..Default::default()
    };
    let _ = st.index.apply_event(&clear, now, &*policy);
    res
}

/// The synthetic report: one block of the probe chain held by the probe replica.
fn probe_update(req: &ProbeRequest, rid: &str, block_hashes: &[Vec<u8>]) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: rid.to_string(),
        model_id: req.model.clone(),
        tenant_id: PROBE_TENANT.into(),
        hash_scheme: req.hash_scheme.clone(),
        timestamp_us: 0,
        prefixes: vec![pb::PrefixEntry {
            block_hashes: block_hashes.to_vec(),
            block_token_counts: vec![PROBE_BLOCK_TOKENS],
            ..Default::default()
        }],
        stats: Some(pb::ReplicaStats {
            replica_id: rid.to_string(),
            hit_rate: 1.0,
            ..Default::default()
        }),
        adapter_id: String::new(),
    }
}

/// Stage B: the orchestrated lookup must answer PREFIX_MATCH including the probe replica.
fn routing_stage(
    st: &mut CoreState,
    q: &LookupQuery<'_>,
    now: i64,
    rid: &str,
    res: &mut ProbeResult,
) {
    let policy = st.policy.clone();
    let view = st.index.lookup_route(q, now, &*policy);
    let has = view.scores.iter().any(|s| view.replica_id(s) == rid);
    let failure = if view.strategy != Strategy::PrefixMatch {
        Some(format!(
            "routing lookup returned strategy {}, want PREFIX_MATCH",
            view.strategy.reason_code()
        ))
    } else if !has {
        Some(format!(
            "routing lookup returned PREFIX_MATCH without probe replica {rid}"
        ))
    } else {
        None
    };
    match failure {
        None => res.routing = Stage::Ok,
        Some(msg) => {
            res.routing = Stage::Failed;
            res.errors.push(("routing", msg));
        }
    }
}

type PairLocks = HashMap<(String, String), Arc<tokio::sync::Mutex<()>>>;

/// One lock per `(backend, model)`; entries nobody holds are dropped on the next acquisition.
static LOCKS: Mutex<Option<PairLocks>> = Mutex::new(None);

fn pair_lock(backend: &str, model: &str) -> Arc<tokio::sync::Mutex<()>> {
    let mut g = LOCKS.lock().unwrap_or_else(|e| e.into_inner());
    let map = g.get_or_insert_with(HashMap::new);
    map.retain(|_, l| Arc::strong_count(l) > 1);
    map.entry((backend.to_string(), model.to_string()))
        .or_default()
        .clone()
}

/// Runs a probe on the owner core of `(probe tenant, model)`, serialised per (backend, model).
pub async fn run(req: ProbeRequest) -> ProbeResult {
    let lock = pair_lock(&req.backend, &req.model);
    let _held = lock.lock().await;
    let owner = crate::shard::owner(PROBE_TENANT, &req.model);
    let backend = req.backend.clone();
    let call = mailbox::call(owner, move |st| run_on_core(st, &req));
    match tokio::time::timeout(PROBE_TIMEOUT, call)
        .await
        .unwrap_or(Err(mailbox::HopError::Gone))
    {
        Ok(r) => {
            tracing::debug!(backend = %r.backend, passed = r.passed(), "probe_run");
            r
        }
        Err(e) => ProbeResult {
            backend,
            ingest: Stage::Failed,
            routing: Stage::Skipped,
            t2: Stage::Skipped,
            errors: vec![("ingest", format!("owner core unavailable: {e:?}"))],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::strategy::Strategy as _;

    proptest! {
        /// Fuzzing of the `/probe` body decoder: arbitrary and mutated bodies are refused with
        /// a 400 body or accepted with the required fields, never a panic.
        #[test]
        fn fuzz_probe_body(body in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..600),
            proptest::string::string_regex("[ -~]{0,80}").expect("regex").prop_map(|tail| format!(r#"{{"backend":"b","model":"m","hashScheme":"vllm"{tail}"#).into_bytes()),
        ]) {
            match parse_request(&body) {
                Ok(req) => prop_assert!(!req.backend.is_empty() && !req.model.is_empty()),
                Err(msg) => prop_assert!(msg.ends_with('\n')),
            }
        }
    }

    #[test]
    fn hash_is_deterministic_and_boundary_injective() {
        let a = probe_hash("vllm", "m", "b");
        assert_eq!(a, probe_hash("vllm", "m", "b"));
        assert_eq!(a.len(), 32);
        assert_ne!(a, probe_hash("vllm", "m", "c"));
        assert_ne!(a, probe_hash("vllm", "n", "b"));
        assert_ne!(a, probe_hash("sglang", "m", "b"));
        assert_ne!(probe_hash("x", "abc", "d"), probe_hash("x", "ab", "cd"));
        assert_ne!(probe_hash("x", "", "m"), probe_hash("x", "m", ""));
        assert_eq!(replica_id("cb"), "__probe-cb");
    }

    #[test]
    fn request_validation() {
        let ok = parse_request(br#"{"backend":"b","model":"m","hashScheme":"vllm"}"#).unwrap();
        assert_eq!(ok.backend, "b");
        let e = parse_request(br#"{"backend":"b","model":"m"}"#).unwrap_err();
        assert_eq!(e, format!("{MISSING_FIELD}\n"));
        let e =
            parse_request(br#"{"backend":"b","model":"m","hashScheme":"v","x":1}"#).unwrap_err();
        assert!(e.starts_with("decode probe request: unknown field"), "{e}");
        for trailing in ["{}", "]", "garbage"] {
            let body = format!(r#"{{"backend":"b","model":"m","hashScheme":"v"}} {trailing}"#);
            assert!(parse_request(body.as_bytes()).is_err(), "{trailing}");
        }
        assert!(
            parse_request(b"{\"backend\":\"b\",\"model\":\"m\",\"hashScheme\":\"v\"}\n").is_ok()
        );
        assert!(
            parse_request(b"not json")
                .unwrap_err()
                .starts_with("decode probe request: ")
        );
        assert!(parse_request(&vec![b' '; MAX_PROBE_BODY_BYTES + 1]).is_err());
    }

    #[test]
    fn zero_or_unset_results_do_not_pass() {
        assert!(!ProbeResult::default().passed());
        let mut r = ProbeResult {
            backend: "b".into(),
            ingest: Stage::Ok,
            routing: Stage::Ok,
            t2: Stage::Unset,
            errors: vec![],
        };
        assert!(!r.passed());
        r.t2 = Stage::Skipped;
        assert!(r.passed());
        assert_eq!(
            r.to_json(),
            "{\"backend\":\"b\",\"ingest\":\"ok\",\"routing\":\"ok\",\"t2\":\"skipped\"}\n"
        );
    }
}
