//! What every ingest call carries besides its message: the producer epoch (always) and, with
//! `--token-file`, a bearer token (README "Authenticated ingest").
//!
//! * `x-producer-epoch: <unix_ms>-<16 hex>` — generated once when the process starts: the start
//!   time in Unix milliseconds, a dash, and 64 random bits as 16 lowercase hex digits (e.g.
//!   `1765000000000-9f2c4e01b7d3a855`). The server keeps the newest epoch per replica and refuses
//!   an older one, so a restarted subscriber (newer start time) fences a zombie one, and two
//!   started in the same millisecond still differ by the random part.
//! * `authorization: Bearer <token>` — the token file's content (surrounding whitespace
//!   trimmed), re-read when the file changes (Kubernetes rotates projected service-account
//!   tokens by swapping the file); a failed re-read keeps the last good token and is counted.
//!   The token is never logged.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;

use crate::metrics::Metrics;

/// Call metadata key of the producer epoch (the server reads exactly this name).
pub const EPOCH_HEADER: &str = "x-producer-epoch";

/// A fresh producer epoch, `<unix_ms>-<16 hex chars>` (module docs).
pub fn new_epoch() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    format!(
        "{}-{:016x}",
        now.as_millis(),
        random_u64(now.subsec_nanos())
    )
}

/// 64 random bits: the OS-seeded keys of std's `RandomState` hashing the pid and a time.
/// Not a secret (the epoch is an ordering token), only unlikely to repeat.
fn random_u64(nanos: u32) -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u32(nanos);
    h.finish()
}

/// Splits an epoch into (unix ms, random part); `None` when it is not in the documented format.
pub fn parse_epoch(s: &str) -> Option<(u64, u64)> {
    let (ms, id) = s.split_once('-')?;
    if id.len() != 16
        || !id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    if ms.is_empty() || !ms.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((ms.parse().ok()?, u64::from_str_radix(id, 16).ok()?))
}

/// What identifies one version of a file: modification time and length.
type Stamp = (Option<SystemTime>, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok(), m.len()))
}

/// A token could not be read or is not a valid header value.
#[derive(Debug)]
pub struct TokenError(String);

impl std::fmt::Display for TokenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TokenError {}

/// Reads the token file into an `authorization` header value (never logged: the error names
/// only the file and what was wrong).
fn read_token(path: &Path) -> Result<AsciiMetadataValue, TokenError> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| TokenError(format!("{shown}: cannot read: {e}")))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenError(format!("{shown}: empty")));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError(format!(
            "{shown}: not a bearer token (whitespace or non-ASCII inside)"
        )));
    }
    MetadataValue::try_from(format!("Bearer {token}"))
        .map_err(|_| TokenError(format!("{shown}: not a valid header value")))
}

struct TokenState {
    stamp: Option<Stamp>,
    value: AsciiMetadataValue,
    /// Stamp of the last failed re-read, so each bad version is logged and counted once.
    failed: Option<Stamp>,
}

/// `--token-file`: the bearer token, re-read when the file's stamp changes.
pub struct TokenFile {
    path: PathBuf,
    state: Mutex<TokenState>,
    metrics: Arc<Metrics>,
}

impl TokenFile {
    /// Reads the token once; a missing, empty or malformed file is an error (start-up).
    pub fn open(path: PathBuf, metrics: Arc<Metrics>) -> Result<Self, TokenError> {
        let st = stamp(&path);
        let value = read_token(&path)?;
        Ok(Self {
            path,
            state: Mutex::new(TokenState {
                stamp: st,
                value,
                failed: None,
            }),
            metrics,
        })
    }

    /// The header value to send now: re-read first when the file changed since the last read.
    pub fn current(&self) -> AsciiMetadataValue {
        let now = stamp(&self.path);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now.is_none() || now == st.stamp || now == st.failed {
            return st.value.clone();
        }
        match read_token(&self.path) {
            Ok(v) => {
                st.value = v;
                st.stamp = now;
                st.failed = None;
                tracing::info!(token_file = %self.path.display(), "token file re-read");
            }
            Err(e) => {
                st.failed = now;
                self.metrics
                    .credential_reload_errors
                    .get_or_create(&[("file", "token")])
                    .inc();
                tracing::error!(error = %e, "token file re-read failed; keeping the last token");
            }
        }
        st.value.clone()
    }
}

/// The interceptor of every ingest call: adds the epoch and, with a token file, the token.
#[derive(Clone)]
pub struct CallCredentials {
    epoch: AsciiMetadataValue,
    token: Option<Arc<TokenFile>>,
}

impl CallCredentials {
    /// Credentials sending `epoch` (see [`new_epoch`]) and, when given, the token.
    pub fn new(epoch: &str, token: Option<Arc<TokenFile>>) -> Self {
        Self {
            epoch: MetadataValue::try_from(epoch).expect("an epoch is ASCII digits, '-' and hex"),
            token,
        }
    }
}

impl Interceptor for CallCredentials {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let md = req.metadata_mut();
        md.insert(EPOCH_HEADER, self.epoch.clone());
        if let Some(t) = &self.token {
            md.insert("authorization", t.current());
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_has_the_documented_format_and_differs_per_start() {
        let a = new_epoch();
        let b = new_epoch();
        let (ms, _) = parse_epoch(&a).expect("documented format");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        assert!(ms <= now && now - ms < 60_000, "{a}: start time in unix ms");
        assert_eq!(a.split_once('-').unwrap().1.len(), 16);
        assert_ne!(a, b, "two starts draw different random parts");
        assert_eq!(
            parse_epoch("12-0123456789abcdeF"),
            None,
            "lowercase hex only"
        );
        assert_eq!(parse_epoch("12-0123456789abcde"), None, "16 hex chars");
        assert_eq!(parse_epoch("-0123456789abcdef"), None);
        assert_eq!(
            parse_epoch("12-0123456789abcdef"),
            Some((12, 0x0123456789abcdef))
        );
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvevent-auth-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("token")
    }

    #[test]
    fn token_is_re_read_when_the_file_changes_and_a_bad_version_keeps_the_last() {
        let path = temp("reread");
        std::fs::write(&path, "first-token\n").unwrap();
        let metrics = Metrics::new();
        let t = TokenFile::open(path.clone(), metrics.clone()).unwrap();
        assert_eq!(t.current(), "Bearer first-token");
        // A different length changes the stamp even within one mtime tick.
        std::fs::write(&path, "second-token-longer").unwrap();
        assert_eq!(t.current(), "Bearer second-token-longer");
        std::fs::write(&path, "   \n").unwrap();
        assert_eq!(
            t.current(),
            "Bearer second-token-longer",
            "empty: keep the last"
        );
        assert_eq!(t.current(), "Bearer second-token-longer");
        let errs = metrics
            .credential_reload_errors
            .get_or_create(&[("file", "token")])
            .get();
        assert_eq!(errs, 1, "one bad version is counted once");
        std::fs::write(&path, "third").unwrap();
        assert_eq!(t.current(), "Bearer third");
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn bad_token_files_are_refused_at_open_without_echoing_the_content() {
        let path = temp("bad");
        let metrics = Metrics::new();
        std::fs::write(&path, "two words").unwrap();
        let e = TokenFile::open(path.clone(), metrics.clone())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("not a bearer token") && !e.contains("words"),
            "{e}"
        );
        std::fs::write(&path, "").unwrap();
        assert!(TokenFile::open(path.clone(), metrics.clone()).is_err());
        std::fs::remove_file(&path).unwrap();
        assert!(TokenFile::open(path.clone(), metrics).is_err());
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn interceptor_sets_epoch_and_token() {
        let path = temp("icpt");
        std::fs::write(&path, "tok").unwrap();
        let metrics = Metrics::new();
        let t = Arc::new(TokenFile::open(path.clone(), metrics).unwrap());
        let mut c = CallCredentials::new("5-00000000000000ff", Some(t));
        let r = c.call(tonic::Request::new(())).unwrap();
        assert_eq!(
            r.metadata().get(EPOCH_HEADER).unwrap(),
            "5-00000000000000ff"
        );
        assert_eq!(r.metadata().get("authorization").unwrap(), "Bearer tok");
        let mut none = CallCredentials::new("5-00000000000000ff", None);
        let r = none.call(tonic::Request::new(())).unwrap();
        assert!(r.metadata().get("authorization").is_none());
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
