//! Waiting on observable conditions with a deadline (never a fixed sleep before asserting), and
//! per-test scratch directories.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A path under the temp dir unique to this test process and call (every test runs in the
/// same process, often at the same instant, so neither the pid nor a clock is enough).
pub fn unique_temp_path(prefix: &str) -> std::path::PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A fresh, empty scratch directory unique to this call (`name` for readability), removed with
/// everything in it when the returned guard drops, so a passing or failing test leaves no keys,
/// tokens or snapshots behind.
pub fn scratch_dir(name: &str) -> ScratchDir {
    let d = unique_temp_path(&format!("ic-test-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    ScratchDir(d)
}

/// A test's scratch directory; see [`scratch_dir`]. Declare it before the servers that write
/// into it, so they are dropped (stopped) first.
pub struct ScratchDir(std::path::PathBuf);

impl std::ops::Deref for ScratchDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for ScratchDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls the async condition `f` every 20 ms until it returns true; panics with `what` after
/// `timeout`.
pub async fn poll_until<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The text of the log file `path` once it contains `needle`, waiting up to 10 s. A server's
/// stderr reaches the file through the test's log-copying thread, so a line the server wrote
/// before answering `/readyz` (or before exiting) may land in the file a moment later: read
/// logs through this, never straight after the event that caused them.
pub fn log_text_with(path: &std::path::Path, needle: &str) -> String {
    let mut text = String::new();
    let found = wait_until(Duration::from_secs(10), || {
        text = std::fs::read_to_string(path).unwrap_or_default();
        text.contains(needle)
    });
    assert!(found, "no `{needle}` in the log after 10 s:\n{text}");
    text
}
