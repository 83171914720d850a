//! Producer authorization series (docs/OPERATIONS.md "Hardened setup"): process-wide atomics,
//! written wherever an ingest call is checked and read by scrapes. Every label is a fixed
//! string, so each family is bounded by construction.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::MetricType;

use super::exposition::{Family, counter, gauge};

/// `reason` label values.
pub const REASONS: [&str; 3] = ["unauthenticated", "permission_denied", "fenced"];
/// `identity` label values.
pub const CLASSES: [&str; 5] = ["none", "certificate", "token", "nats", "writer"];

/// Refused ingest messages by (reason, identity class).
static REFUSED: [[AtomicU64; 5]; 3] = [const { [const { AtomicU64::new(0) }; 5] }; 3];
/// Changed policy files that did not load (the last good policy stayed in force).
static POLICY_RELOAD_ERRORS: AtomicU64 = AtomicU64::new(0);
/// Producer tokens the TokenReview rejected (calls answered UNAUTHENTICATED).
static TOKENS_REJECTED: AtomicU64 = AtomicU64::new(0);
/// Producer calls answered UNAVAILABLE because no review verdict could be had.
static TOKENS_UNAVAILABLE: AtomicU64 = AtomicU64::new(0);

/// Producer epochs remembered now.
static EPOCHS: AtomicU64 = AtomicU64::new(0);

/// One ingest message refused: `reason` indexes [`REASONS`], `class` [`CLASSES`] (the
/// `producer::Refusal` and `producer::IdentityClass` discriminants).
pub fn record_refused(reason: usize, class: usize) {
    REFUSED[reason][class].fetch_add(1, Ordering::Relaxed);
}

/// The producer epoch table now holds `n` entries.
pub fn set_epochs(n: usize) {
    EPOCHS.store(n as u64, Ordering::Relaxed);
}

/// A changed `--producer-policy` file failed to load.
pub fn record_policy_reload_error() {
    POLICY_RELOAD_ERRORS.fetch_add(1, Ordering::Relaxed);
}

/// A producer token was rejected by its review.
pub fn record_token_rejected() {
    TOKENS_REJECTED.fetch_add(1, Ordering::Relaxed);
}

/// A producer call found no review verdict.
pub fn record_token_unavailable() {
    TOKENS_UNAVAILABLE.fetch_add(1, Ordering::Relaxed);
}

/// The families (counters with nothing counted are left out; the epoch gauge always shows).
pub(super) fn families(fams: &mut Vec<Family>) {
    let refused: Vec<(&str, &str, u64)> = REASONS
        .iter()
        .enumerate()
        .flat_map(|(r, reason)| {
            CLASSES
                .iter()
                .enumerate()
                .map(move |(c, class)| (*class, *reason, REFUSED[r][c].load(Ordering::Relaxed)))
        })
        .filter(|(_, _, n)| *n > 0)
        .collect();
    if !refused.is_empty() {
        fams.push((
            "inferencecache_producer_refused",
            "Ingest messages refused by producer authorization or fencing, by reason and identity class.",
            MetricType::Counter,
            Box::new(move |e| {
                let mut rows = refused.clone();
                rows.sort();
                for (class, reason, n) in rows {
                    counter(e, &[("identity", class), ("reason", reason)], n)?;
                }
                Ok(())
            }),
        ));
    }
    let singles = [
        (
            "inferencecache_producer_policy_reload_errors",
            "Changed --producer-policy files that did not load (the last good policy stayed in force).",
            &POLICY_RELOAD_ERRORS,
        ),
        (
            "inferencecache_producer_tokens_rejected",
            "Ingest calls whose bearer token TokenReview rejected (answered UNAUTHENTICATED).",
            &TOKENS_REJECTED,
        ),
        (
            "inferencecache_producer_token_reviews_unavailable",
            "Ingest calls answered UNAVAILABLE because no TokenReview verdict could be had.",
            &TOKENS_UNAVAILABLE,
        ),
    ];
    for (name, help, v) in singles {
        let n = v.load(Ordering::Relaxed);
        if n > 0 {
            fams.push((
                name,
                help,
                MetricType::Counter,
                Box::new(move |e| counter(e, &[], n)),
            ));
        }
    }
    let epochs = EPOCHS.load(Ordering::Relaxed) as i64;
    fams.push((
        "inferencecache_producer_epochs",
        "Producer epochs remembered for fencing, one per (tenant, replica) (at most MAX_PRODUCER_EPOCHS).",
        MetricType::Gauge,
        Box::new(move |e| gauge(e, &[], epochs)),
    ));
}
