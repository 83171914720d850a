//! The event log writer (`--nats-log-writer`): the server, not the producers, writes the
//! JetStream log, so nothing a producer check refused ever reaches it (docs/BEHAVIOUR.md §4.3,
//! docs/ARCHITECTURE.md §7 "Log writers").
//!
//! A ReportCacheState/PublishEvent message that passes the producer checks
//! (`producer::Caller::admit_for_log`: identity, policy, fencing compared but not recorded) is
//! published on `<subject>.admitted.update` / `<subject>.admitted.event` (the protobuf, unchanged)
//! with the call's `x-producer-epoch` as a NATS header, and the call is answered only once
//! JetStream acknowledged the publish (the message is then stored in the stream). It is not
//! applied here directly: every replica, this one included, applies it from the log through the
//! consumer, in stream order, re-checking its epoch there (`producer::admitted_caller`), so the
//! replicas' indexes and epoch tables stay identical.
//!
//! Bounded: at most [`NATS_WRITER_MAX_IN_FLIGHT`] publishes await their acknowledgement, all
//! calls together; one more fails its call at once with `UNAVAILABLE` ("event log writer
//! saturated"): transient, so producers retry it with back-off (kvevent-subscriber counts a
//! `RESOURCE_EXHAUSTED` as a refusal of the content and drops it after a few). A publish takes at
//! most [`NATS_REQUEST_TIMEOUT`], then its call fails `UNAVAILABLE`. The publishes run on the
//! admin thread's tokio runtime over the consumer's connection; a serving core only awaits them.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use async_nats::jetstream;
use tonic::Status;

use crate::limits::{NATS_REQUEST_TIMEOUT, NATS_WRITER_MAX_IN_FLIGHT};
use crate::metrics::nats as m;
use crate::producer::epochs;

/// The subject token between the prefix and the kind of a writer's messages.
pub const ADMITTED: &str = "admitted";

/// What one published message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A protobuf `CacheStateUpdate`.
    Update,
    /// A protobuf `CacheEvent`.
    Event,
}

impl Kind {
    fn token(self) -> &'static str {
        match self {
            Self::Update => "update",
            Self::Event => "event",
        }
    }
}

/// `<prefix>.admitted.<kind>`.
pub fn subject(prefix: &str, kind: Kind) -> String {
    format!("{prefix}.{ADMITTED}.{}", kind.token())
}

/// Whether `--nats-log-writer` is on (set once at start-up, before serving).
static ENABLED: AtomicBool = AtomicBool::new(false);
/// The connection to publish on, once the consumer connected.
static LOG: OnceLock<(jetstream::Context, String)> = OnceLock::new();
/// Publishes awaiting their acknowledgement.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Turns the writer on: from here on the ingest handlers publish instead of applying.
pub fn enable() {
    ENABLED.store(true, Ordering::SeqCst);
    m::enable_writer();
}

/// Whether the ingest handlers publish to the log (`--nats-log-writer`).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Hands the writer the consumer's JetStream context and the subject prefix (once connected).
pub(super) fn install(js: jetstream::Context, prefix: &str) {
    let _ = LOG.set((js, prefix.to_string()));
}

/// Why a publish stored nothing.
enum Failure {
    /// The message is larger than the NATS server's `max_payload`: it never will be stored, so
    /// its call fails `RESOURCE_EXHAUSTED` (a refusal of the content, not retried forever).
    TooLarge(String),
    /// Not connected, refused, or not acknowledged in time: worth a retry.
    Unavailable(String),
}

impl Failure {
    fn of_publish(e: jetstream::context::PublishError) -> Self {
        match e.kind() {
            jetstream::context::PublishErrorKind::MaxPayloadExceeded => {
                Self::TooLarge(e.to_string())
            }
            _ => Self::Unavailable(e.to_string()),
        }
    }
}

/// One of the [`NATS_WRITER_MAX_IN_FLIGHT`] publish slots; freed when dropped.
struct Slot;

impl Slot {
    /// A free slot, or `None` (counted) when all are taken.
    fn take() -> Option<Slot> {
        let before = IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        if before >= NATS_WRITER_MAX_IN_FLIGHT {
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            crate::metrics::record_limit_hit("nats_writer_in_flight");
            m::record_write_failed(m::WriteFailure::Saturated);
            return None;
        }
        m::writer_in_flight(true);
        Some(Slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        m::writer_in_flight(false);
    }
}

/// Publishes one admitted message and waits for JetStream's acknowledgement: `Ok(sequence)`
/// once it is stored, else the status its call fails with (`UNAVAILABLE` "saturated" when
/// [`NATS_WRITER_MAX_IN_FLIGHT`] publishes are in flight, and when the log is not connected,
/// refused the publish or did not answer within [`NATS_REQUEST_TIMEOUT`]; `RESOURCE_EXHAUSTED`
/// when the message is larger than the NATS server's `max_payload`).
pub async fn publish(kind: Kind, body: Vec<u8>, epoch: Option<&str>) -> Result<u64, Status> {
    let slot = Slot::take().ok_or_else(|| {
        Status::unavailable(format!(
            "event log writer saturated: {NATS_WRITER_MAX_IN_FLIGHT} publishes awaiting \
             JetStream; retry"
        ))
    })?;
    let (Some((js, prefix)), Some(rt)) = (LOG.get(), crate::runtime::admin_thread::handle()) else {
        m::record_write_failed(m::WriteFailure::Unavailable);
        return Err(Status::unavailable("event log not connected yet; retry"));
    };
    let mut headers = async_nats::HeaderMap::new();
    if let Some(e) = epoch {
        headers.insert(epochs::EPOCH_HEADER, e);
    }
    let bytes = body.len();
    let message = (subject(prefix, kind), headers, body);
    // The slot travels with the publish: a call that goes away (client cancel) does not free it
    // before JetStream answered or the time limit passed.
    let outcome = rt
        .spawn(publish_on_admin(js.clone(), message, slot))
        .await
        .unwrap_or_else(|_| Err(Failure::Unavailable("publish task failed".into())));
    match outcome {
        Ok(ack) => {
            m::record_written();
            Ok(ack.sequence)
        }
        Err(Failure::TooLarge(why)) => {
            m::record_write_failed(m::WriteFailure::TooLarge);
            Err(Status::resource_exhausted(format!(
                "message of {bytes} bytes refused by the event log: {why}"
            )))
        }
        Err(Failure::Unavailable(why)) => {
            m::record_write_failed(m::WriteFailure::Unavailable);
            tracing::warn!(error = %why, "nats_log_publish_failed");
            Err(Status::unavailable(format!(
                "event log publish failed: {why}; retry"
            )))
        }
    }
}

/// One message to publish: subject, headers, body.
type Outbound = (String, async_nats::HeaderMap, Vec<u8>);

/// The publish and its acknowledgement, on the admin runtime, holding `slot` until done.
async fn publish_on_admin(
    js: jetstream::Context,
    (subject, headers, body): Outbound,
    slot: Slot,
) -> Result<jetstream::publish::PublishAck, Failure> {
    let _slot = slot;
    let publish = async {
        js.publish_with_headers(subject, headers, body.into())
            .await
            .map_err(Failure::of_publish)?
            .await
            .map_err(|e| Failure::Unavailable(e.to_string()))
    };
    tokio::time::timeout(NATS_REQUEST_TIMEOUT, publish)
        .await
        .unwrap_or_else(|_| {
            Err(Failure::Unavailable(format!(
                "no acknowledgement within {NATS_REQUEST_TIMEOUT:?}"
            )))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_name_the_writer_and_the_kind() {
        assert_eq!(subject("ic", Kind::Update), "ic.admitted.update");
        assert_eq!(subject("ic", Kind::Event), "ic.admitted.event");
    }

    #[test]
    fn slots_are_bounded_and_freed_on_drop() {
        let held: Vec<Slot> = (0..NATS_WRITER_MAX_IN_FLIGHT)
            .map_while(|_| Slot::take())
            .collect();
        assert_eq!(held.len(), NATS_WRITER_MAX_IN_FLIGHT);
        assert!(Slot::take().is_none(), "one more is refused");
        assert_eq!(IN_FLIGHT.load(Ordering::SeqCst), NATS_WRITER_MAX_IN_FLIGHT);
        drop(held);
        assert_eq!(IN_FLIGHT.load(Ordering::SeqCst), 0);
        assert!(Slot::take().is_some());
    }
}
