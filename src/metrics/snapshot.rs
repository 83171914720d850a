//! The warm-restart series (`--state-dir`, docs/ARCHITECTURE.md §6): process-wide atomics set
//! by the snapshot writer thread and the start-up restore, never by the request path. Emitted
//! only when snapshots are enabled.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use prometheus_client::metrics::MetricType;

use super::exposition::{Family, counter, gauge};
use crate::sys::clock::unix_now_ns;

static ENABLED: AtomicBool = AtomicBool::new(false);
/// Creation time (unix ns) of the newest complete snapshot on disk (written or restored); 0 =
/// none.
static LAST_SNAPSHOT_NS: AtomicI64 = AtomicI64::new(0);
static SIZE_BYTES: AtomicU64 = AtomicU64::new(0);
static ENTRIES: AtomicU64 = AtomicU64::new(0);
/// Microseconds.
static WRITE_DURATION_US: AtomicU64 = AtomicU64::new(0);
static RESTORED_ENTRIES: AtomicU64 = AtomicU64::new(0);
/// Microseconds.
static RESTORE_DURATION_US: AtomicU64 = AtomicU64::new(0);

/// `reason` labels of `inferencecache_snapshot_write_failures_total`.
pub const WRITE_FAILURE_REASONS: [&str; 4] = [
    "io_error",
    "core_unreachable",
    "shutdown_budget",
    "policy_io_error",
];
static WRITE_FAILURES: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// `reason` labels of `inferencecache_snapshot_restore_skipped_total`.
pub const RESTORE_SKIP_REASONS: [&str; 7] = [
    "missing",
    "truncated",
    "corrupt",
    "incompatible",
    "too_large",
    "io_error",
    "mismatch",
];
static RESTORE_SKIPS: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];

/// Turns the snapshot families on (at start-up, with `--state-dir`).
pub fn set_snapshots_enabled() {
    ENABLED.store(true, Ordering::SeqCst);
}

/// A snapshot was completed (or restored: `duration` and `bytes` are then those read).
pub fn record_snapshot_written(created_unix_ns: i64, bytes: u64, entries: u64, duration_us: u64) {
    LAST_SNAPSHOT_NS.store(created_unix_ns, Ordering::Relaxed);
    SIZE_BYTES.store(bytes, Ordering::Relaxed);
    ENTRIES.store(entries, Ordering::Relaxed);
    WRITE_DURATION_US.store(duration_us, Ordering::Relaxed);
}

/// The snapshot found at start-up (its age and size count from its creation).
pub fn record_snapshot_found(created_unix_ns: i64, bytes: u64, entries: u64) {
    LAST_SNAPSHOT_NS.store(created_unix_ns, Ordering::Relaxed);
    SIZE_BYTES.store(bytes, Ordering::Relaxed);
    ENTRIES.store(entries, Ordering::Relaxed);
}

/// The start-up restore finished with `entries` restored.
pub fn record_restore(entries: u64, duration_us: u64) {
    RESTORED_ENTRIES.store(entries, Ordering::Relaxed);
    RESTORE_DURATION_US.store(duration_us, Ordering::Relaxed);
}

/// A snapshot write failed for `reason` (one of [`WRITE_FAILURE_REASONS`]).
pub fn record_write_failure(reason: &str) {
    if let Some(i) = WRITE_FAILURE_REASONS.iter().position(|r| *r == reason) {
        WRITE_FAILURES[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// A restore was skipped for `reason` (one of [`RESTORE_SKIP_REASONS`]).
pub fn record_restore_skipped(reason: &str) {
    if let Some(i) = RESTORE_SKIP_REASONS.iter().position(|r| *r == reason) {
        RESTORE_SKIPS[i].fetch_add(1, Ordering::Relaxed);
    }
}

fn secs(us: &AtomicU64) -> f64 {
    us.load(Ordering::Relaxed) as f64 / 1e6
}

pub(super) fn families(fams: &mut Vec<Family<'_>>) {
    if !ENABLED.load(Ordering::SeqCst) {
        return;
    }
    let last = LAST_SNAPSHOT_NS.load(Ordering::Relaxed);
    if last > 0 {
        let age = (unix_now_ns().saturating_sub(last)).max(0) as f64 / 1e9;
        fams.push((
            "inferencecache_snapshot_age_seconds",
            "Seconds since the newest complete snapshot on disk was started (written by this process or restored at start-up).",
            MetricType::Gauge,
            Box::new(move |e| gauge(e, &[], age)),
        ));
    }
    fams.push((
        "inferencecache_snapshot_size_bytes",
        "Bytes of the newest complete snapshot (all core files and the manifest).",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], SIZE_BYTES.load(Ordering::Relaxed) as i64)),
    ));
    fams.push((
        "inferencecache_snapshot_entries",
        "Storage entries in the newest complete snapshot.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], ENTRIES.load(Ordering::Relaxed) as i64)),
    ));
    fams.push((
        "inferencecache_snapshot_write_duration_seconds",
        "Wall time of the last completed snapshot write, from the first slice to the manifest rename.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], secs(&WRITE_DURATION_US))),
    ));
    fams.push((
        "inferencecache_snapshot_restored_entries",
        "Storage entries restored from the snapshot at start-up.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], RESTORED_ENTRIES.load(Ordering::Relaxed) as i64)),
    ));
    fams.push((
        "inferencecache_snapshot_restore_duration_seconds",
        "Wall time of the start-up restore (reading, checking and indexing the snapshot).",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], secs(&RESTORE_DURATION_US))),
    ));
    fams.push((
        "inferencecache_snapshot_write_failures",
        "Snapshot writes that failed or were abandoned, by reason.",
        MetricType::Counter,
        Box::new(|e| {
            for (i, r) in WRITE_FAILURE_REASONS.iter().enumerate() {
                counter(
                    e,
                    &[("reason", r)],
                    WRITE_FAILURES[i].load(Ordering::Relaxed),
                )?;
            }
            Ok(())
        }),
    ));
    fams.push((
        "inferencecache_snapshot_restore_skipped",
        "Start-up restores skipped (the server started empty), by reason.",
        MetricType::Counter,
        Box::new(|e| {
            for (i, r) in RESTORE_SKIP_REASONS.iter().enumerate() {
                counter(
                    e,
                    &[("reason", r)],
                    RESTORE_SKIPS[i].load(Ordering::Relaxed),
                )?;
            }
            Ok(())
        }),
    ));
}
