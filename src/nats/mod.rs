//! The replicated event log: each replica consumes a NATS JetStream stream of index updates and
//! applies it in stream order through the same entry points as the gRPC ingest path
//! (`CoreState::ingest` / `CoreState::apply_event` on the owner core, then the change feed), so
//! every replica consuming the stream holds the same index (docs/ARCHITECTURE.md "Replicas",
//! docs/KV-EVENTS.md "Publishing through JetStream").
//!
//! Message encoding: subject `<subject>.update` carries one protobuf `CacheStateUpdate`,
//! `<subject>.event` one protobuf `CacheEvent` (the gRPC messages, unchanged). Anything else is
//! a decode error: counted, skipped, never fatal.
//!
//! Producer checks: a message goes through the same producer policy and fencing as gRPC ingest
//! (`producer::Caller::admit`) before it is applied. Its identity is the producer token of its
//! subject, `<subject>.update.<producer>` / `<subject>.event.<producer>` → `nats:<producer>`
//! (the plain subjects carry none), which NATS publish permissions bind to the users allowed to
//! publish it; its epoch is its `x-producer-epoch` header. A refused message is skipped (counted
//! in `inferencecache_producer_refused_total{identity="nats"|"none"}`) by every replica alike.
//! A message on `<subject>.admitted.update` / `<subject>.admitted.event` was published by a log
//! writer ([`writer`], `--nats-log-writer`) after its own producer checks: only its epoch is
//! checked again (`producer::admitted_caller`), in stream order, so every replica's epoch table
//! moves alike; NATS permissions let only the servers' user publish those subjects.
//!
//! The consumer runs on the admin thread's tokio runtime, never on a serving core: it reaches
//! the owner core over the bounded mailbox (`mailbox::call` backs off while a queue is full).
//! It uses an ordered pull consumer (ephemeral, no acks) from a given stream sequence, with at
//! most [`NATS_MAX_IN_FLIGHT`] messages delivered and not yet applied; each message is applied
//! before the next one is taken and before [`applied_sequence`] moves past it. Any error (NATS
//! down, stream missing, consumer lost) drops the consumer and recreates it from the next
//! unapplied sequence after a back-off; nothing here panics or exits.

pub mod writer;

use std::time::Duration;

use inferencecache_nats_auth as auth;
pub use inferencecache_nats_auth::{Flags as AuthFlags, NatsAuth, PASSWORD_ENV};

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use inferencecache_proto::v1alpha1 as pb;
use prost::Message;

use crate::ingest;
use crate::limits::{
    NATS_BACKOFF_MAX, NATS_BACKOFF_MIN, NATS_LAG_POLL_INTERVAL, NATS_MAX_IN_FLIGHT,
    NATS_REQUEST_TIMEOUT,
};
use crate::metrics::nats as m;
use crate::producer::{self, epochs};
use crate::runtime::shutting_down;

/// Where and what to consume (from `--nats-url`, `--nats-stream`, `--nats-subject`).
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// NATS server URL(s), comma-separated.
    pub url: String,
    /// JetStream stream name; created with subjects `<subject>.>` when it does not exist.
    pub stream: String,
    /// Subject prefix: updates on `<subject>.update`, events on `<subject>.event`.
    pub subject: String,
    /// First stream sequence to apply (1 = the whole stream). A snapshot restore passes the
    /// snapshot's recorded [`applied_sequence`] + 1 here, so only the rest is replayed.
    pub start_sequence: u64,
    /// `/readyz` stays 503 until the lag is at most this, once after start.
    pub ready_max_lag: u64,
    /// TLS and credentials of the connection.
    pub auth: NatsAuth,
}

/// The highest stream sequence applied on this replica (0 before the first). Every message up
/// to it is applied, or was lost in a counted gap (`inferencecache_nats_gap_messages_total`).
/// A snapshot writer reads it *before* copying the partitions: the copy then includes at least
/// that much, and replaying from it + 1 re-applies at most a few messages, which is harmless
/// (upserts and evictions are idempotent in stream order).
pub fn applied_sequence() -> u64 {
    m::applied_sequence()
}

/// Starts the consumer on the admin runtime `rt`.
pub fn spawn(rt: &tokio::runtime::Handle, cfg: NatsConfig) {
    m::enable(cfg.start_sequence.saturating_sub(1));
    rt.spawn(run(cfg));
}

/// Parses `--nats-url`: one or more comma-separated `nats://HOST:PORT` (or `HOST:PORT`).
pub fn parse_urls(url: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    url.split(',')
        .map(|u| {
            u.trim()
                .parse::<async_nats::ServerAddr>()
                .map_err(|e| format!("--nats-url {u:?}: {e}"))
        })
        .collect()
}

fn filter(subject: &str) -> String {
    format!("{subject}.>")
}

/// What one stream message carries.
enum Decoded {
    Update(pb::CacheStateUpdate),
    Event(pb::CacheEvent),
}

impl Decoded {
    /// The `(tenant, replica)` the message writes, for the producer checks.
    fn target(&self) -> (&str, &str) {
        match self {
            Self::Update(u) => (&u.tenant_id, &u.replica_id),
            Self::Event(e) => (&e.tenant_id, &e.replica_id),
        }
    }
}

/// Who a message's subject says published it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin<'s> {
    /// `<prefix>.<kind>`: no identity.
    Anonymous,
    /// `<prefix>.<kind>.<producer>`: the producer NATS let publish it.
    Producer(&'s str),
    /// `<prefix>.admitted.<kind>`: a log-writing server, after its producer checks ([`writer`]).
    Admitted,
}

/// The message and its origin, from its subject: `<prefix>.<kind>[.<producer>]` or
/// `<prefix>.admitted.<kind>`.
fn decode<'s>(prefix: &str, subject: &'s str, payload: &[u8]) -> Option<(Decoded, Origin<'s>)> {
    let rest = subject.strip_prefix(prefix)?.strip_prefix('.')?;
    let (kind, origin) = match rest.split_once('.') {
        Some((writer::ADMITTED, kind)) => (kind, Origin::Admitted),
        Some((kind, p)) if !p.is_empty() && !p.contains('.') => (kind, Origin::Producer(p)),
        Some(_) => return None,
        None => (rest, Origin::Anonymous),
    };
    let decoded = match kind {
        "update" => Decoded::Update(pb::CacheStateUpdate::decode(payload).ok()?),
        "event" => Decoded::Event(pb::CacheEvent::decode(payload).ok()?),
        _ => return None,
    };
    Some((decoded, origin))
}

/// The producer epoch a message's `x-producer-epoch` header names: `Ok(None)` without one,
/// `Err` when it is malformed (the message is then a decode error, as a gRPC call with a
/// malformed epoch is INVALID_ARGUMENT).
fn epoch_of(headers: Option<&async_nats::HeaderMap>) -> Result<Option<epochs::Epoch>, ()> {
    match headers.and_then(|h| h.get(epochs::EPOCH_HEADER)) {
        None => Ok(None),
        Some(v) => epochs::parse(v.as_str()).map(Some).map_err(|_| ()),
    }
}

/// Whether the producer checks admit a decoded message (a refusal is counted by `admit`).
fn admitted(d: &Decoded, origin: Origin<'_>, epoch: Option<epochs::Epoch>) -> bool {
    let (tenant, replica) = d.target();
    let caller = match origin {
        Origin::Anonymous => producer::log_caller(None, epoch),
        Origin::Producer(p) => producer::log_caller(Some(p), epoch),
        Origin::Admitted => producer::admitted_caller(epoch),
    };
    caller.admit(tenant, replica).is_ok()
}

/// Exponential back-off between recreations.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Self(NATS_BACKOFF_MIN)
    }
    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(NATS_BACKOFF_MAX);
    }
    fn reset(&mut self) {
        self.0 = NATS_BACKOFF_MIN;
    }
}

async fn run(cfg: NatsConfig) {
    tracing::info!(
        stream = %cfg.stream,
        subject = %cfg.subject,
        start_sequence = cfg.start_sequence,
        "nats_consumer_starting"
    );
    let addrs = match parse_urls(&cfg.url) {
        Ok(a) => a,
        Err(e) => {
            // Checked at start-up already (exit 2); kept so this task can never panic.
            tracing::error!(error = %e, "nats_url_invalid");
            return;
        }
    };
    let Some(client) = connect(addrs, &cfg.auth).await else {
        return;
    };
    let js = jetstream::new(client);
    if writer::enabled() {
        writer::install(js.clone(), &cfg.subject);
    }
    tokio::spawn(poll_lag(js.clone(), cfg.clone()));
    let mut backoff = Backoff::new();
    while !shutting_down() {
        match consume(&js, &cfg, &mut backoff).await {
            Ok(()) => return,
            Err(e) => {
                m::record_restart();
                tracing::warn!(
                    error = %e,
                    applied_sequence = applied_sequence(),
                    "nats_consumer_restart"
                );
                backoff.wait().await;
            }
        }
    }
}

/// The connection: a first attempt that NATS refuses (credentials, TLS) is logged
/// (`nats_connect_refused`), counted (`inferencecache_nats_connect_refused_total{reason}`) and
/// retried after the longest back-off (a rotated Secret may fix it; `/readyz` stays 503
/// meanwhile); an unreachable server is left to the client's own background reconnects, whose
/// refusals are counted and logged the same way. `None` only at shutdown.
async fn connect(
    addrs: Vec<async_nats::ServerAddr>,
    auth: &NatsAuth,
) -> Option<async_nats::Client> {
    let base = async_nats::ConnectOptions::new()
        .name("inference-cache-server")
        .max_reconnects(None)
        .connection_timeout(NATS_REQUEST_TIMEOUT)
        .request_timeout(Some(NATS_REQUEST_TIMEOUT))
        .event_callback(|ev| async move {
            if let Some(why) = auth::event_refusal(&ev) {
                m::record_refused(why == auth::Refusal::Tls);
                tracing::error!(event = %ev, "nats_connect_refused");
            }
        });
    let options = match auth.apply(base).await {
        Ok(o) => o,
        Err(e) => {
            // The files were checked at start-up; one that went bad since is retried.
            tracing::error!(error = %e, "nats_credentials_unreadable");
            return None;
        }
    };
    while !shutting_down() {
        match async_nats::connect_with_options(addrs.clone(), options.clone()).await {
            Ok(c) => return Some(c),
            Err(e) => match auth::refusal(&e) {
                Some(why) => {
                    m::record_refused(why == auth::Refusal::Tls);
                    tracing::error!(error = %e, "nats_connect_refused");
                    tokio::time::sleep(NATS_BACKOFF_MAX).await;
                }
                None => {
                    tracing::warn!(error = %e, "nats_unreachable_retrying_in_background");
                    let retrying = options.clone().retry_on_initial_connect();
                    match async_nats::connect_with_options(addrs.clone(), retrying).await {
                        Ok(c) => return Some(c),
                        Err(e) => {
                            tracing::error!(error = %e, "nats_connect_failed");
                            tokio::time::sleep(NATS_BACKOFF_MAX).await;
                        }
                    }
                }
            },
        }
    }
    None
}

/// The stream, created (file storage, subjects `<subject>.>`, no limits) when missing.
async fn stream(js: &jetstream::Context, cfg: &NatsConfig) -> Result<stream::Stream, String> {
    js.get_or_create_stream(stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![filter(&cfg.subject)],
        ..Default::default()
    })
    .await
    .map_err(|e| format!("stream {}: {e}", cfg.stream))
}

/// One consumer's life: from the next unapplied sequence until an error (or shutdown: `Ok`).
async fn consume(
    js: &jetstream::Context,
    cfg: &NatsConfig,
    backoff: &mut Backoff,
) -> Result<(), String> {
    let mut st = stream(js, cfg).await?;
    let next = applied_sequence() + 1;
    let state = st.info().await.map_err(|e| e.to_string())?.state.clone();
    // The stream has expired (limits, purge) past what this replica needs next: the lost
    // sequences are counted and logged, and consumption starts from the first available.
    if state.first_sequence > next {
        tracing::warn!(
            wanted = next,
            first_available = state.first_sequence,
            lost = state.first_sequence - next,
            "nats_stream_gap"
        );
        m::record_gap(next, state.first_sequence);
    }
    let start = applied_sequence() + 1;
    let consumer = st
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: filter(&cfg.subject),
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            max_batch: NATS_MAX_IN_FLIGHT as i64,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("create consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("consume: {e}"))?;
    backoff.reset();
    tracing::info!(start_sequence = start, "nats_consumer_started");
    while let Some(msg) = messages.next().await {
        let msg = msg.map_err(|e| format!("consumer: {e}"))?;
        let seq = msg
            .info()
            .map_err(|e| format!("message info: {e}"))?
            .stream_sequence;
        let expected = applied_sequence() + 1;
        if seq < expected {
            continue; // already applied (a recreated consumer overlapping)
        }
        if seq > expected {
            // Sequences skipped inside the stream: expired or deleted while the consumer was
            // reconnecting (the stream carries only this index's subjects, docs/ARCHITECTURE.md
            // §6), so they are lost to this replica: counted like a gap at start.
            tracing::warn!(
                wanted = expected,
                first_available = seq,
                lost = seq - expected,
                "nats_stream_gap"
            );
            m::record_gap(expected, seq);
        }
        let epoch = epoch_of(msg.headers.as_ref());
        let decoded =
            decode(&cfg.subject, msg.subject.as_str(), &msg.payload).filter(|_| epoch.is_ok());
        let outcome = match decoded {
            Some((d, origin)) if admitted(&d, origin, epoch.unwrap_or(None)) => {
                if !apply(d).await {
                    return Ok(()); // shutting down
                }
                m::Outcome::Applied
            }
            Some(_) => m::Outcome::Refused,
            None => {
                tracing::warn!(
                    sequence = seq,
                    subject = %msg.subject,
                    bytes = msg.payload.len(),
                    "nats_decode_error"
                );
                m::Outcome::Undecodable
            }
        };
        m::record_applied(seq, outcome);
    }
    Err("message stream ended".into())
}

/// Applies one message on its owner core, as the gRPC handlers do; retries (with back-off)
/// while the owner is unavailable, so the stream order is kept and nothing is skipped. Returns
/// false only when the server is shutting down.
async fn apply(d: Decoded) -> bool {
    let mut backoff = Backoff::new();
    loop {
        // A copy per attempt: a hop that fails (owner stalled) drops its closure.
        let done = match &d {
            Decoded::Update(u) => ingest::apply_update(u.clone()).await.is_ok(),
            Decoded::Event(e) => ingest::apply_event(e.clone()).await.is_ok(),
        };
        if done {
            return true;
        }
        if shutting_down() {
            return false;
        }
        backoff.wait().await;
    }
}

/// Polls the stream's last sequence every [`NATS_LAG_POLL_INTERVAL`]: the lag gauge, and the
/// caught-up latch that gates `/readyz`.
async fn poll_lag(js: jetstream::Context, cfg: NatsConfig) {
    let mut st: Option<stream::Stream> = None;
    while !shutting_down() {
        if st.is_none() {
            st = js.get_stream(&cfg.stream).await.ok();
        }
        if let Some(s) = st.as_mut() {
            match s.info().await {
                Ok(info) => {
                    m::record_stream_last(info.state.last_sequence, cfg.ready_max_lag);
                }
                Err(_) => st = None,
            }
        }
        tokio::time::sleep(NATS_LAG_POLL_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_select_the_message_type_and_junk_is_a_decode_error() {
        let u = pb::CacheStateUpdate {
            tenant_id: "t".into(),
            model_id: "m".into(),
            replica_id: "r".into(),
            ..Default::default()
        };
        let e = pb::CacheEvent {
            tenant_id: "t".into(),
            ..Default::default()
        };
        let ub = u.encode_to_vec();
        let eb = e.encode_to_vec();
        assert!(matches!(
            decode("ic", "ic.update", &ub),
            Some((Decoded::Update(x), Origin::Anonymous)) if x == u
        ));
        assert!(matches!(
            decode("ic", "ic.event", &eb),
            Some((Decoded::Event(x), Origin::Anonymous)) if x == e
        ));
        assert!(decode("ic", "ic.other", &ub).is_none());
        assert!(decode("ic", "icx.update", &ub).is_none());
        assert!(decode("ic", "ic.update", &[0xff, 0xff, 0xff]).is_none());
    }

    #[test]
    fn a_subjects_last_token_names_its_producer() {
        let ub = pb::CacheStateUpdate::default().encode_to_vec();
        let eb = pb::CacheEvent::default().encode_to_vec();
        assert!(matches!(
            decode("ic", "ic.update.pool-a", &ub),
            Some((Decoded::Update(_), Origin::Producer("pool-a")))
        ));
        assert!(matches!(
            decode("ic", "ic.event.pool-a", &eb),
            Some((Decoded::Event(_), Origin::Producer("pool-a")))
        ));
        assert!(
            decode("ic", "ic.update.a.b", &ub).is_none(),
            "one token only"
        );
        assert!(decode("ic", "ic.update.", &ub).is_none());
        assert!(decode("ic", "ic.other.pool-a", &ub).is_none());
    }

    #[test]
    fn the_admitted_subjects_are_a_log_writers() {
        let ub = pb::CacheStateUpdate::default().encode_to_vec();
        let eb = pb::CacheEvent::default().encode_to_vec();
        let update = writer::subject("ic", writer::Kind::Update);
        let event = writer::subject("ic", writer::Kind::Event);
        assert!(matches!(
            decode("ic", &update, &ub),
            Some((Decoded::Update(_), Origin::Admitted))
        ));
        assert!(matches!(
            decode("ic", &event, &eb),
            Some((Decoded::Event(_), Origin::Admitted))
        ));
        assert!(decode("ic", "ic.admitted.other", &ub).is_none());
        assert!(decode("ic", "ic.admitted.update.x", &ub).is_none());
        assert!(
            matches!(
                decode("ic", "ic.update.admitted", &ub),
                Some((_, Origin::Producer("admitted")))
            ),
            "a producer named 'admitted' is a producer"
        );
    }

    #[test]
    fn a_malformed_epoch_header_is_an_error_and_none_is_unfenced() {
        let mut h = async_nats::HeaderMap::new();
        assert_eq!(epoch_of(None), Ok(None));
        assert_eq!(epoch_of(Some(&h)), Ok(None));
        h.insert(epochs::EPOCH_HEADER, "1765000000000-9f2c4e01b7d3a855");
        assert_eq!(epoch_of(Some(&h)).unwrap().unwrap().ms, 1_765_000_000_000);
        h.insert(epochs::EPOCH_HEADER, "yesterday");
        assert_eq!(epoch_of(Some(&h)), Err(()));
    }
}
