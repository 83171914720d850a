//! Test-only hooks, read once from the environment, that let the end-to-end tests drive fault
//! paths of the real binary deterministically. Unset in production; each costs one load of a
//! cached value where it is checked, never on the lookup path.

use std::sync::OnceLock;
use std::time::Duration;

/// A fault injected into one core's TTL sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SweepFault {
    /// The core panics at its first sweep.
    Panic,
    /// The core blocks its thread for this long at its first sweep (a stuck core).
    Stall(Duration),
}

/// `INFERENCECACHE_TEST_SWEEP_FAULT=panic:<core>` or `stall:<core>:<ms>`: the fault for
/// `core`'s first sweep, if any.
pub fn sweep_fault(core: usize) -> Option<SweepFault> {
    static FAULT: OnceLock<Option<(usize, SweepFault)>> = OnceLock::new();
    let parsed = FAULT.get_or_init(|| {
        let v = std::env::var("INFERENCECACHE_TEST_SWEEP_FAULT").ok()?;
        parse(&v)
    });
    parsed.and_then(|(c, f)| (c == core).then_some(f))
}

fn parse(v: &str) -> Option<(usize, SweepFault)> {
    let mut parts = v.split(':');
    let kind = parts.next()?;
    let core = parts.next()?.parse().ok()?;
    let fault = match kind {
        "panic" => SweepFault::Panic,
        "stall" => SweepFault::Stall(Duration::from_millis(parts.next()?.parse().ok()?)),
        _ => return None,
    };
    Some((core, fault))
}

/// `INFERENCECACHE_TEST_RESTORE_DELAY_MS=<ms>`: the start-up restore first sleeps this long, so
/// a test can observe `/readyz` answering 503 while a restore runs.
pub fn restore_delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        let v = std::env::var("INFERENCECACHE_TEST_RESTORE_DELAY_MS").ok()?;
        Some(Duration::from_millis(v.parse().ok()?))
    })
}

/// `INFERENCECACHE_TEST_SWEEP_SLICE_ENTRIES=<n>`: sweep slices examine at most `n` entries
/// instead of `SWEEP_SLICE_MAX_ENTRIES`, so the end-to-end tests' small indexes are swept in many
/// slices with requests served between them.
pub fn sweep_slice_entries() -> Option<usize> {
    static ENTRIES: OnceLock<Option<usize>> = OnceLock::new();
    *ENTRIES.get_or_init(|| {
        std::env::var("INFERENCECACHE_TEST_SWEEP_SLICE_ENTRIES")
            .ok()?
            .parse()
            .ok()
    })
}

/// `INFERENCECACHE_TEST_MIN_CANDIDATES=<n>`: every core's cap and quota candidate heaps keep at
/// least `n` candidates instead of 1024 (`Index::set_min_candidates`), so the end-to-end tests'
/// small indexes exercise candidate thresholds, rebuilds and builds ahead of need.
pub fn min_candidates() -> Option<usize> {
    static K: OnceLock<Option<usize>> = OnceLock::new();
    *K.get_or_init(|| {
        std::env::var("INFERENCECACHE_TEST_MIN_CANDIDATES")
            .ok()?
            .parse()
            .ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_faults() {
        assert_eq!(parse("panic:1"), Some((1, SweepFault::Panic)));
        assert_eq!(
            parse("stall:0:250"),
            Some((0, SweepFault::Stall(Duration::from_millis(250))))
        );
        assert_eq!(parse("stall:0"), None);
        assert_eq!(parse("boom:0"), None);
    }
}
