//! Per-publisher sequence tracking (docs/KV-EVENTS.md §1, §4). The engine numbers batches 0, 1, 2, …
//! per publisher and restarts at 0 when it restarts. A restarted engine has an empty cache, so
//! the index must forget the replica; a gap means lost batches, which the replay socket can
//! recover. Pure state machine: no I/O, tested in isolation.

/// What one observed sequence number means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// First batch seen from this publisher (no expectation yet).
    First,
    /// The expected next batch.
    InOrder,
    /// The seq went backwards: the engine restarted (its cache is empty).
    Restart,
    /// Batches `[from, to)` were never received; this batch is `to`.
    Gap {
        /// First missing seq.
        from: u64,
        /// This batch's seq (exclusive end of the missing range).
        to: u64,
    },
}

/// Tracks the next expected seq of one publisher.
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    next: Option<u64>,
}

impl SeqTracker {
    /// A tracker that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The seq expected next, if any batch was seen.
    pub fn expected(&self) -> Option<u64> {
        self.next
    }

    /// Classifies `seq` and advances the expectation past it.
    pub fn observe(&mut self, seq: u64) -> SeqVerdict {
        let verdict = match self.next {
            None => SeqVerdict::First,
            Some(n) if seq == n => SeqVerdict::InOrder,
            Some(n) if seq < n => SeqVerdict::Restart,
            Some(n) => SeqVerdict::Gap { from: n, to: seq },
        };
        self.next = Some(seq.wrapping_add(1));
        verdict
    }

    /// Marks `seq` (a replayed batch) as received when it is the expected one; returns whether
    /// it was, so replayed duplicates or out-of-range batches are skipped.
    pub fn accept_replayed(&mut self, seq: u64) -> bool {
        if self.next == Some(seq) {
            self.next = Some(seq.wrapping_add(1));
            true
        } else {
            false
        }
    }

    /// Sets the expectation (used around a replay: rewound to the gap start, then restored).
    pub fn set_expected(&mut self, next: u64) {
        self.next = Some(next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_stream() {
        let mut t = SeqTracker::new();
        assert_eq!(t.observe(0), SeqVerdict::First);
        assert_eq!(t.observe(1), SeqVerdict::InOrder);
        assert_eq!(t.observe(2), SeqVerdict::InOrder);
        assert_eq!(t.expected(), Some(3));
    }

    #[test]
    fn joining_mid_stream_is_not_a_gap() {
        let mut t = SeqTracker::new();
        assert_eq!(t.observe(41), SeqVerdict::First);
        assert_eq!(t.observe(42), SeqVerdict::InOrder);
    }

    #[test]
    fn seq_back_to_zero_is_a_restart() {
        let mut t = SeqTracker::new();
        t.observe(5);
        t.observe(6);
        assert_eq!(t.observe(0), SeqVerdict::Restart);
        assert_eq!(t.observe(1), SeqVerdict::InOrder);
    }

    #[test]
    fn any_step_back_is_a_restart() {
        let mut t = SeqTracker::new();
        t.observe(10);
        assert_eq!(t.observe(3), SeqVerdict::Restart);
        // A repeat of the last seq also goes back relative to the expectation.
        assert_eq!(t.observe(3), SeqVerdict::Restart);
    }

    #[test]
    fn gap_reports_missing_range() {
        let mut t = SeqTracker::new();
        t.observe(0);
        assert_eq!(t.observe(4), SeqVerdict::Gap { from: 1, to: 4 });
        assert_eq!(t.observe(5), SeqVerdict::InOrder);
    }

    #[test]
    fn replay_fills_gap_in_order() {
        let mut t = SeqTracker::new();
        t.observe(0);
        let SeqVerdict::Gap { from, to } = t.observe(3) else {
            panic!()
        };
        t.set_expected(from);
        assert!(!t.accept_replayed(0), "already applied");
        assert!(t.accept_replayed(1));
        assert!(!t.accept_replayed(1), "duplicate");
        assert!(t.accept_replayed(2));
        assert_eq!(t.expected(), Some(to));
        t.set_expected(to + 1);
        assert_eq!(t.observe(4), SeqVerdict::InOrder);
    }
}
