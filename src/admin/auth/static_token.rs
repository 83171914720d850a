//! The static bearer token of `--controller-token-file`: for deployments without Kubernetes,
//! the controller (or an operator's script) presents the file's content as `Bearer <token>`.
//!
//! The file is re-read whenever its mtime changes, so the token can be rotated in place without
//! a restart; if a re-read fails, the last good token stays in force. Comparison is constant
//! time in the token length.

use std::path::PathBuf;
use std::sync::RwLock;
use std::time::SystemTime;

use crate::limits::MIN_STATIC_TOKEN_BYTES;

/// The loaded token and the file mtime it was read at.
#[derive(Debug)]
struct Loaded {
    token: String,
    mtime: Option<SystemTime>,
}

/// A bearer token read from a file.
#[derive(Debug)]
pub struct StaticToken {
    path: PathBuf,
    state: RwLock<Loaded>,
}

/// Why the token file cannot be used (start-up: exit 1; rotation: the old token stays).
#[derive(Debug)]
pub enum TokenFileError {
    /// The file cannot be read.
    Read(PathBuf, std::io::Error),
    /// The trimmed content is shorter than [`MIN_STATIC_TOKEN_BYTES`].
    TooShort(PathBuf),
}

impl std::fmt::Display for TokenFileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Read(p, e) => write!(f, "read controller token file {}: {e}", p.display()),
            Self::TooShort(p) => write!(
                f,
                "controller token file {} must hold a token of at least {MIN_STATIC_TOKEN_BYTES} bytes",
                p.display()
            ),
        }
    }
}

impl std::error::Error for TokenFileError {}

fn read(path: &PathBuf) -> Result<String, TokenFileError> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenFileError::Read(path.clone(), e))?;
    let token = text.trim().to_string();
    if token.len() < MIN_STATIC_TOKEN_BYTES {
        return Err(TokenFileError::TooShort(path.clone()));
    }
    Ok(token)
}

fn mtime(path: &PathBuf) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Constant-time equality (no early exit on the first differing byte).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl StaticToken {
    /// Loads the file (start-up: failure → log + exit 1).
    pub fn load(path: &str) -> Result<StaticToken, TokenFileError> {
        let path = PathBuf::from(path);
        let mt = mtime(&path);
        let token = read(&path)?;
        Ok(StaticToken {
            path,
            state: RwLock::new(Loaded { token, mtime: mt }),
        })
    }

    /// Whether `presented` equals the current token (re-reading a rotated file first).
    pub fn matches(&self, presented: &str) -> bool {
        let now = mtime(&self.path);
        let stale = self.state.read().map(|s| s.mtime != now).unwrap_or(true);
        if stale {
            let mut st = self.state.write().unwrap_or_else(|e| e.into_inner());
            if st.mtime != now {
                match read(&self.path) {
                    Ok(t) => {
                        st.token = t;
                        st.mtime = now;
                    }
                    Err(e) => tracing::error!(error = %e, "controller_token_reload"),
                }
            }
        }
        let st = self.state.read().unwrap_or_else(|e| e.into_inner());
        ct_eq(st.token.as_bytes(), presented.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_match_and_rotate() {
        let dir = std::env::temp_dir().join(format!("ictok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "short").unwrap();
        assert!(StaticToken::load(f.to_str().unwrap()).is_err());
        std::fs::write(&f, "0123456789abcdef-one\n").unwrap();
        let t = StaticToken::load(f.to_str().unwrap()).unwrap();
        assert!(t.matches("0123456789abcdef-one"));
        assert!(!t.matches("0123456789abcdef-two"));
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&f, "0123456789abcdef-two").unwrap();
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        let _ = std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(later);
        assert!(t.matches("0123456789abcdef-two"));
        assert!(!t.matches("0123456789abcdef-one"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
