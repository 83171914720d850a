//! The JetStream event log consumer's series (`inferencecache_nats_*`, docs/ARCHITECTURE.md
//! "Replicas"): process-wide atomics written by the one consumer task on the admin thread and
//! read by scrapes, `/readyz` and (through `nats::applied_sequence`) a snapshot writer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use prometheus_client::metrics::MetricType;

use super::exposition::{Family, counter, gauge};

/// Whether a consumer is configured (`--nats-url`); the families are emitted only then.
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Highest stream sequence applied (or skipped as lost, see [`record_gap`]); 0 = none yet.
static APPLIED_SEQUENCE: AtomicU64 = AtomicU64::new(0);
/// Stream messages applied through the ingest/event entry points.
static APPLIED: AtomicU64 = AtomicU64::new(0);
/// The stream's last sequence minus [`APPLIED_SEQUENCE`], as of the last poll.
static LAG: AtomicU64 = AtomicU64::new(0);
/// Times the consumer found the stream expired past the sequence it needed next.
static GAPS: AtomicU64 = AtomicU64::new(0);
/// Stream sequences lost in those gaps.
static GAP_MESSAGES: AtomicU64 = AtomicU64::new(0);
/// Messages whose subject or protobuf body could not be decoded (skipped).
static DECODE_ERRORS: AtomicU64 = AtomicU64::new(0);
/// Times the consumer was (re)created after an error (NATS down, stream missing, ...).
static RESTARTS: AtomicU64 = AtomicU64::new(0);
/// Connection attempts NATS refused for their credentials (`reason="auth"`) or TLS
/// (`reason="tls"`).
static REFUSED_AUTH: AtomicU64 = AtomicU64::new(0);
static REFUSED_TLS: AtomicU64 = AtomicU64::new(0);
/// Set once, after start, the first time the lag is within `--nats-ready-max-lag`.
static CAUGHT_UP: AtomicBool = AtomicBool::new(false);
/// Whether this server writes the log (`--nats-log-writer`); the writer families only then.
static WRITER: AtomicBool = AtomicBool::new(false);
/// Admitted ingest messages JetStream acknowledged (stored in the stream).
static WRITTEN: AtomicU64 = AtomicU64::new(0);
/// Publishes awaiting their acknowledgement (kept by the writer as its slots change).
static WRITER_IN_FLIGHT: AtomicU64 = AtomicU64::new(0);
/// Ingest calls failed because every publish slot was taken.
static WRITE_SATURATED: AtomicU64 = AtomicU64::new(0);
/// Ingest calls failed because the log did not store their message (not connected, refused,
/// no acknowledgement in time).
static WRITE_UNAVAILABLE: AtomicU64 = AtomicU64::new(0);
/// Ingest calls failed because their message exceeds the NATS server's `max_payload`.
static WRITE_TOO_LARGE: AtomicU64 = AtomicU64::new(0);

/// Why a log writer's publish failed its call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteFailure {
    /// `NATS_WRITER_MAX_IN_FLIGHT` publishes were awaiting their acknowledgement.
    Saturated,
    /// Not connected, refused, or not acknowledged in time.
    Unavailable,
    /// Larger than the NATS server's `max_payload`.
    TooLarge,
}

/// Marks this server a log writer.
pub fn enable_writer() {
    WRITER.store(true, Ordering::SeqCst);
}

/// One more (`true`) or one fewer of the writer's publishes awaits its acknowledgement.
pub fn writer_in_flight(more: bool) {
    if more {
        WRITER_IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
    } else {
        WRITER_IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One admitted message stored in the stream.
pub fn record_written() {
    WRITTEN.fetch_add(1, Ordering::Relaxed);
}

/// One ingest call failed by its publish.
pub fn record_write_failed(why: WriteFailure) {
    let c = match why {
        WriteFailure::Saturated => &WRITE_SATURATED,
        WriteFailure::Unavailable => &WRITE_UNAVAILABLE,
        WriteFailure::TooLarge => &WRITE_TOO_LARGE,
    };
    c.fetch_add(1, Ordering::Relaxed);
}

/// Marks the consumer configured, starting after stream sequence `start_after`.
pub fn enable(start_after: u64) {
    APPLIED_SEQUENCE.store(start_after, Ordering::SeqCst);
    ENABLED.store(true, Ordering::SeqCst);
}

/// Whether a consumer is configured.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::SeqCst)
}

/// The highest stream sequence whose message is applied (or was lost in a counted gap).
pub fn applied_sequence() -> u64 {
    APPLIED_SEQUENCE.load(Ordering::SeqCst)
}

/// What became of one stream message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Applied to the index.
    Applied,
    /// Skipped: it did not decode.
    Undecodable,
    /// Skipped: the producer checks refused it (counted in the producer families).
    Refused,
}

/// The message at stream sequence `seq` is done with (applied or skipped).
pub fn record_applied(seq: u64, outcome: Outcome) {
    match outcome {
        Outcome::Applied => APPLIED.fetch_add(1, Ordering::Relaxed),
        Outcome::Undecodable => DECODE_ERRORS.fetch_add(1, Ordering::Relaxed),
        Outcome::Refused => 0,
    };
    APPLIED_SEQUENCE.fetch_max(seq, Ordering::SeqCst);
}

/// Sequences `from..to` (exclusive) are gone from the stream: counted, and the applied sequence
/// moves past them.
pub fn record_gap(from: u64, to: u64) {
    GAPS.fetch_add(1, Ordering::Relaxed);
    GAP_MESSAGES.fetch_add(to.saturating_sub(from), Ordering::Relaxed);
    APPLIED_SEQUENCE.fetch_max(to.saturating_sub(1), Ordering::SeqCst);
}

/// The consumer was (re)created after an error.
pub fn record_restart() {
    RESTARTS.fetch_add(1, Ordering::Relaxed);
}

/// Records the lag against the stream's `last_sequence`; latches caught-up once within
/// `ready_max_lag`. Returns the lag.
pub fn record_stream_last(last_sequence: u64, ready_max_lag: u64) -> u64 {
    let lag = last_sequence.saturating_sub(applied_sequence());
    LAG.store(lag, Ordering::Relaxed);
    if lag <= ready_max_lag && !CAUGHT_UP.swap(true, Ordering::SeqCst) {
        tracing::info!(
            applied_sequence = applied_sequence(),
            last_sequence,
            "nats_caught_up"
        );
    }
    lag
}

/// Whether `/readyz` may answer 200 as far as the event log is concerned: no consumer
/// configured, or it caught up once since start.
pub fn caught_up() -> bool {
    !enabled() || CAUGHT_UP.load(Ordering::SeqCst)
}

/// Counts one connection attempt NATS refused: `tls` for a TLS failure, else credentials.
pub fn record_refused(tls: bool) {
    let c = if tls { &REFUSED_TLS } else { &REFUSED_AUTH };
    c.fetch_add(1, Ordering::Relaxed);
}

/// The `inferencecache_nats_*` families, when a consumer is configured.
pub(super) fn families(fams: &mut Vec<Family>) {
    if !enabled() {
        return;
    }
    if WRITER.load(Ordering::SeqCst) {
        writer_families(fams);
    }
    let counters: [(&'static str, &'static str, &'static AtomicU64); 5] = [
        (
            "inferencecache_nats_messages_applied",
            "Event log messages applied through the ingest/event entry points.",
            &APPLIED,
        ),
        (
            "inferencecache_nats_decode_errors",
            "Event log messages skipped: unknown subject suffix or undecodable protobuf body.",
            &DECODE_ERRORS,
        ),
        (
            "inferencecache_nats_gaps",
            "Times the stream had expired past the sequence the replica needed next.",
            &GAPS,
        ),
        (
            "inferencecache_nats_gap_messages",
            "Stream sequences lost in those gaps (never applied on this replica).",
            &GAP_MESSAGES,
        ),
        (
            "inferencecache_nats_consumer_restarts",
            "Times the event log consumer was recreated after an error (NATS down, no stream).",
            &RESTARTS,
        ),
    ];
    for (name, help, v) in counters {
        fams.push((
            name,
            help,
            MetricType::Counter,
            Box::new(move |e| counter(e, &[], v.load(Ordering::Relaxed))),
        ));
    }
    fams.push((
        "inferencecache_nats_connect_refused",
        "NATS connection attempts refused: reason=auth (credentials) or tls (certificates).",
        MetricType::Counter,
        Box::new(|e| {
            counter(
                e,
                &[("reason", "auth")],
                REFUSED_AUTH.load(Ordering::Relaxed),
            )?;
            counter(e, &[("reason", "tls")], REFUSED_TLS.load(Ordering::Relaxed))
        }),
    ));
    fams.push((
        "inferencecache_nats_applied_sequence",
        "Highest event log stream sequence applied (or skipped as lost) on this replica.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], applied_sequence() as i64)),
    ));
    fams.push((
        "inferencecache_nats_stream_lag",
        "Stream last sequence minus the applied sequence, as of the last poll.",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], LAG.load(Ordering::Relaxed) as i64)),
    ));
    fams.push((
        "inferencecache_nats_caught_up",
        "1 once the replica caught up with the event log after start (gates /readyz).",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], i64::from(CAUGHT_UP.load(Ordering::SeqCst)))),
    ));
}

/// The `inferencecache_nats_writer_*` families (`--nats-log-writer`).
fn writer_families(fams: &mut Vec<Family>) {
    fams.push((
        "inferencecache_nats_writer_published",
        "Admitted ingest messages this server published to the event log and JetStream stored.",
        MetricType::Counter,
        Box::new(|e| counter(e, &[], WRITTEN.load(Ordering::Relaxed))),
    ));
    fams.push((
        "inferencecache_nats_writer_failed",
        "Ingest calls failed by their publish: reason=saturated (every publish slot taken) or \
         unavailable (not stored), both UNAVAILABLE; too_large (over NATS max_payload, \
         RESOURCE_EXHAUSTED).",
        MetricType::Counter,
        Box::new(|e| {
            counter(
                e,
                &[("reason", "saturated")],
                WRITE_SATURATED.load(Ordering::Relaxed),
            )?;
            counter(
                e,
                &[("reason", "unavailable")],
                WRITE_UNAVAILABLE.load(Ordering::Relaxed),
            )?;
            counter(
                e,
                &[("reason", "too_large")],
                WRITE_TOO_LARGE.load(Ordering::Relaxed),
            )
        }),
    ));
    fams.push((
        "inferencecache_nats_writer_in_flight",
        "Event log publishes awaiting JetStream's acknowledgement (at most 64).",
        MetricType::Gauge,
        Box::new(|e| gauge(e, &[], WRITER_IN_FLIGHT.load(Ordering::Relaxed) as i64)),
    ));
}
