//! Warm restart on one machine (`--state-dir`, docs/ARCHITECTURE.md §6): every core's
//! partitions are written to a versioned, checksummed snapshot file periodically and at
//! SIGTERM, and restored at start-up before `/readyz` turns 200.
//!
//! * [`format`] — the file format (pure encoding/decoding, unit-tested);
//! * `writer` — the snapshot thread: asks each core for its records in bounded slices over the
//!   mailbox (the core serves requests between slices) and does all file I/O itself, off the
//!   serving cores, writing each file to a temporary name, fsyncing it and renaming it into
//!   place, then the manifest the same way;
//! * `restore` — at start-up, before the runtime starts: reads the manifest's generation, checks
//!   every file and routes every record to the core owning its `(tenant, model)` under the new
//!   `--shards`; anything missing, truncated, corrupt or incompatible is logged once and the
//!   server starts empty.
//!
//! The last installed `/policy` body is kept in its own file ([`save_policy`]) and installed on
//! every core before the entries are restored (the TTL filter and eviction order use it).

pub mod format;
mod restore;
mod writer;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use restore::{Restored, restore};
pub use writer::{Writer, start_writer};

use crate::sys::clock::unix_now_ns;
use format::{FileKind, Header, SectionKind};

/// The manifest: names the generation whose core files are complete.
pub const MANIFEST_FILE: &str = "manifest.icsnap";
/// The last installed `/policy` body.
pub const POLICY_FILE: &str = "policy.icsnap";
/// The producer epoch table (fencing survives a restart).
pub const PRODUCERS_FILE: &str = "producers.icsnap";
/// Suffix of files being written (removed at start-up; never read).
const TMP_SUFFIX: &str = ".tmp";

/// The file of `core`'s partitions in snapshot `generation`.
pub fn core_file(core: usize, generation: u64) -> String {
    format!("core-{core}-gen-{generation}.icsnap")
}

/// The generation a core file name belongs to.
fn generation_of(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("core-")?.strip_suffix(".icsnap")?;
    let (_, generation) = rest.split_once("-gen-")?;
    generation.parse().ok()
}

static STATE_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Records the state directory (once, at start-up); [`save_policy`] is a no-op without it.
pub fn set_state_dir(dir: PathBuf) {
    let _ = STATE_DIR.set(dir);
}

/// Creates the state directory if needed and removes leftovers of interrupted writes.
pub fn prepare_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().ends_with(TMP_SUFFIX) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// fsyncs a directory, so a rename inside it survives a crash.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Writes `bytes` to `dir/name` so that a crash leaves either the old file or the new one,
/// never a partial one: a temporary file, fsync, rename over the old name, fsync of the
/// directory.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}{TMP_SUFFIX}"));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Persists the `/policy` body just installed on every core (admin thread, under the policy
/// install lock, so the file follows the install order). Small (at most the policy body bound)
/// and rare; a failure is logged and counted, the install itself stands.
pub fn save_policy(body: &[u8]) {
    let Some(dir) = STATE_DIR.get() else { return };
    let header = Header {
        kind: FileKind::Policy,
        generation: 0,
        created_unix_ns: unix_now_ns(),
        core: 0,
        cores: 0,
    };
    let bytes = format::encode_file(&header, SectionKind::Policy, 1, body);
    if let Err(e) = write_atomic(dir, POLICY_FILE, &bytes) {
        crate::metrics::snapshot::record_write_failure("policy_io_error");
        tracing::error!(error = %e, file = POLICY_FILE, "snapshot_policy_write_failed");
    }
}

/// Writes the producer epoch table (snapshot thread, with every generation). Small (at most
/// `MAX_PRODUCER_EPOCHS` rows of 32 bytes).
fn save_producers(dir: &Path, generation: u64) -> std::io::Result<u64> {
    let rows = crate::producer::epochs::rows();
    let header = Header {
        kind: FileKind::Producers,
        generation,
        created_unix_ns: unix_now_ns(),
        core: 0,
        cores: 0,
    };
    let body = crate::producer::epochs::encode(&rows);
    let bytes = format::encode_file(&header, SectionKind::Epochs, rows.len() as u32, &body);
    write_atomic(dir, PRODUCERS_FILE, &bytes)?;
    Ok(bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_file_names_carry_their_generation() {
        assert_eq!(generation_of(&core_file(3, 17)), Some(17));
        assert_eq!(generation_of("core-3-gen-17.icsnap.tmp"), None);
        assert_eq!(generation_of(MANIFEST_FILE), None);
    }
}
