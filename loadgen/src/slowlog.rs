//! `--slow-log`: the wall-clock time and latency of every lookup slower than a threshold, so a
//! slow lookup can be lined up with what the server was doing then (a TTL sweep pass, a cap
//! build; `perf/sweep_stall.sh`).

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Most slow lookups one log keeps; later ones are only counted (`dropped`).
pub const SLOW_LOG_MAX_ENTRIES: usize = 1_000_000;

/// One slow lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlowLookup {
    /// When the lookup was due (its ticket's intended time), µs since the Unix epoch.
    pub due_unix_us: u64,
    /// From due to answered (or failed), µs.
    pub latency_us: u64,
    /// From due to when the client began the call, µs: the generator's own lateness (its
    /// dispatcher or runtime thread descheduled), which is part of `latency_us` but happened
    /// before the request left.
    pub start_lag_us: u64,
    /// Whether it failed (timeout or error status).
    pub failed: bool,
}

/// The slow lookups of one measurement window.
#[derive(Debug)]
pub struct SlowLog {
    threshold: Duration,
    /// The same moment on both clocks: turns an `Instant` into Unix time.
    origin: (Instant, SystemTime),
    kept: Mutex<(Vec<SlowLookup>, u64)>,
}

impl SlowLog {
    /// A log of lookups slower than `threshold`.
    pub fn new(threshold: Duration) -> Self {
        SlowLog {
            threshold,
            origin: (Instant::now(), SystemTime::now()),
            kept: Mutex::new((Vec::new(), 0)),
        }
    }

    /// Notes a lookup due at `due`, begun at `started`, that ended `latency` after `due`, if that
    /// is over the threshold.
    pub fn note(&self, due: Instant, started: Instant, latency: Duration, failed: bool) {
        if latency <= self.threshold {
            return;
        }
        let wall = match due.checked_duration_since(self.origin.0) {
            Some(after) => self.origin.1 + after,
            None => self.origin.1 - self.origin.0.duration_since(due),
        };
        let due_unix_us = wall
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let entry = SlowLookup {
            due_unix_us,
            latency_us: latency.as_micros() as u64,
            start_lag_us: started.saturating_duration_since(due).as_micros() as u64,
            failed,
        };
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if kept.0.len() < SLOW_LOG_MAX_ENTRIES {
            kept.0.push(entry);
        } else {
            kept.1 += 1;
        }
    }

    /// The lookups kept, in the order they ended, and how many were dropped past the limit.
    pub fn entries(&self) -> (Vec<SlowLookup>, u64) {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Writes the log: a header line, then `due_unix_us latency_us ok|failed start_lag_us` per
    /// lookup.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let (entries, dropped) = self.entries();
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        writeln!(
            out,
            "# lookups slower than {} us; dropped past {SLOW_LOG_MAX_ENTRIES}: {dropped}",
            self.threshold.as_micros()
        )?;
        for e in entries {
            let outcome = if e.failed { "failed" } else { "ok" };
            writeln!(
                out,
                "{} {} {outcome} {}",
                e.due_unix_us, e.latency_us, e.start_lag_us
            )?;
        }
        out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lookups_over_the_threshold_are_kept_with_their_wall_time() {
        let log = SlowLog::new(Duration::from_millis(1));
        let due = Instant::now();
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        log.note(due, due, Duration::from_micros(1_000), false);
        log.note(
            due,
            due + Duration::from_micros(700),
            Duration::from_micros(1_500),
            true,
        );
        let (kept, dropped) = log.entries();
        assert_eq!(dropped, 0);
        assert_eq!(kept.len(), 1, "exactly the threshold is not slow");
        assert_eq!(kept[0].latency_us, 1_500);
        assert_eq!(kept[0].start_lag_us, 700);
        assert!(kept[0].failed);
        let skew = kept[0].due_unix_us.abs_diff(before.as_micros() as u64);
        assert!(
            skew < 1_000_000,
            "due time is wall-clock now: {skew} us off"
        );
    }

    #[test]
    fn the_log_is_bounded() {
        let log = SlowLog::new(Duration::ZERO);
        let due = Instant::now();
        for _ in 0..SLOW_LOG_MAX_ENTRIES + 3 {
            log.note(due, due, Duration::from_micros(5), false);
        }
        let (kept, dropped) = log.entries();
        assert_eq!((kept.len(), dropped), (SLOW_LOG_MAX_ENTRIES, 3));
    }
}
