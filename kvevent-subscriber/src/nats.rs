//! Publishing index operations to a NATS JetStream stream (`--nats-url`), instead of or as well
//! as calling the server directly; every server replica consuming the stream then applies them
//! (docs/KV-EVENTS.md "Publishing through JetStream").
//!
//! Encoding: a `CacheStateUpdate` is published on `<subject>.update`, a `CacheEvent` on
//! `<subject>.event`, each as its protobuf bytes (the gRPC messages, unchanged); with
//! `--nats-producer NAME` on `<subject>.update.NAME` / `<subject>.event.NAME`, which the servers
//! check as producer identity `nats:NAME`. Every message carries this process's
//! `x-producer-epoch` as a NATS header, so the servers fence a zombie's log messages as they
//! fence its gRPC calls.
//!
//! A message counts as sent only once JetStream acknowledged it (stored in the stream). At most
//! `max_in_flight` publishes wait for their acknowledgement; a new publish first waits for the
//! oldest. A failed acknowledgement (NATS down, no stream, timeout) re-publishes that message and
//! every later unacknowledged one, in their original order, after a back-off: the stream may
//! then hold a duplicate, but never a message out of order with respect to the ones after it, so
//! a replica applying it ends in the same state (an upsert or eviction applied again is
//! harmless, one applied before an older one would not be).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

use async_nats::jetstream::{self, context::PublishAckFuture};
use bytes::Bytes;
use inferencecache_proto::v1alpha1::{CacheEvent, CacheStateUpdate};
use prost::Message;
use tokio::time::sleep;

use crate::cli::Args;
use crate::metrics::Metrics;
use crate::sender::Backoff;

pub use inferencecache_nats_auth::{NatsAuth, PASSWORD_ENV};

/// The `--nats-*` TLS and credential flags as the shared [`NatsAuth`] (which checks every file
/// now, so a mistake is a start-up error naming its flag), the password from
/// `--nats-password-file` or [`PASSWORD_ENV`].
pub fn auth_from_args(args: &Args) -> Result<NatsAuth, String> {
    let path = |flag: &str, p: &Option<PathBuf>| -> Result<String, String> {
        match p {
            None => Ok(String::new()),
            Some(p) => p
                .to_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{flag} {}: not a UTF-8 path", p.display())),
        }
    };
    let ca = path("--nats-ca-file", &args.nats_ca_file)?;
    let cert = path("--nats-client-cert-file", &args.nats_client_cert_file)?;
    let key = path("--nats-client-key-file", &args.nats_client_key_file)?;
    let creds = path("--nats-creds-file", &args.nats_creds_file)?;
    let password = path("--nats-password-file", &args.nats_password_file)?;
    let flags = inferencecache_nats_auth::Flags {
        url: args.nats_url.as_deref().unwrap_or(""),
        ca_file: &ca,
        client_cert_file: &cert,
        client_key_file: &key,
        creds_file: &creds,
        user: args.nats_user.as_deref().unwrap_or(""),
        password_file: &password,
    };
    NatsAuth::from_flags(flags, std::env::var(PASSWORD_ENV).ok())
}

/// Counts and logs the refusals a background (re)connect reports through the client's events
/// (the client keeps retrying them, so they would be silent otherwise).
fn count_refusals(ev: &async_nats::Event, metrics: &Metrics) {
    let Some(why) = inferencecache_nats_auth::event_refusal(ev) else {
        return;
    };
    let reason = why.label();
    metrics
        .nats_connect_errors
        .get_or_create(&[("reason", reason)])
        .inc();
    tracing::error!(reason, event = %ev, "NATS refused the connection; check --nats-* credentials");
}

/// Default `--nats-max-in-flight`.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;

struct InFlight {
    subject: String,
    payload: Bytes,
    ack: PublishAckFuture,
}

/// Where this publisher's messages go and what they say about their producer.
#[derive(Debug, Clone)]
pub struct LogProducer {
    /// `--nats-subject`.
    pub subject: String,
    /// `--nats-producer`: appended to the subjects as the producer token.
    pub name: Option<String>,
    /// This process's producer epoch (`x-producer-epoch` header of every message).
    pub epoch: String,
}

impl LogProducer {
    fn subject_of(&self, kind: &str) -> String {
        match &self.name {
            Some(n) => format!("{}.{kind}.{n}", self.subject),
            None => format!("{}.{kind}", self.subject),
        }
    }
}

/// The JetStream publisher of one subscriber.
pub struct NatsPublisher {
    js: jetstream::Context,
    update_subject: String,
    event_subject: String,
    headers: async_nats::HeaderMap,
    max_in_flight: usize,
    in_flight: VecDeque<InFlight>,
    backoff: Backoff,
    metrics: Arc<Metrics>,
}

impl NatsPublisher {
    /// Connects to `url` with `auth`. A first attempt that NATS refuses for its credentials or
    /// TLS (or a malformed URL) fails here; an unreachable server is retried in the background,
    /// forever, and so is every later reconnect (refusals then counted in
    /// `kvevent_nats_connect_errors_total{reason}` and logged).
    pub async fn connect(
        url: &str,
        producer: &LogProducer,
        max_in_flight: usize,
        auth: &NatsAuth,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        let m = metrics.clone();
        let opts = async_nats::ConnectOptions::new()
            .name("kvevent-subscriber")
            .max_reconnects(None)
            .event_callback(move |ev| {
                let m = m.clone();
                async move { count_refusals(&ev, &m) }
            });
        let opts = auth.apply(opts).await.map_err(anyhow::Error::msg)?;
        let client = match opts.clone().connect(url).await {
            Ok(c) => c,
            Err(e) => {
                if let Some(reason) = inferencecache_nats_auth::refusal(&e).map(|r| r.label()) {
                    metrics
                        .nats_connect_errors
                        .get_or_create(&[("reason", reason)])
                        .inc();
                    anyhow::bail!("NATS refused the connection ({reason}): {e}");
                }
                if e.kind() == async_nats::ConnectErrorKind::ServerParse {
                    anyhow::bail!("{e}");
                }
                tracing::warn!(error = %e, "NATS not reachable yet; connecting in the background");
                opts.retry_on_initial_connect().connect(url).await?
            }
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(crate::auth::EPOCH_HEADER, producer.epoch.as_str());
        Ok(Self {
            js: jetstream::new(client),
            update_subject: producer.subject_of("update"),
            event_subject: producer.subject_of("event"),
            headers,
            max_in_flight: max_in_flight.max(1),
            in_flight: VecDeque::new(),
            backoff: Backoff::new(),
            metrics,
        })
    }

    /// Publishes one update (returns once it is handed to the connection; see [`Self::flush`]).
    pub async fn update(&mut self, u: &CacheStateUpdate) {
        let subject = self.update_subject.clone();
        self.publish(subject, u.encode_to_vec().into()).await;
    }

    /// Publishes one event.
    pub async fn event(&mut self, e: &CacheEvent) {
        let subject = self.event_subject.clone();
        self.publish(subject, e.encode_to_vec().into()).await;
    }

    /// Waits until every published message is acknowledged by the stream.
    pub async fn flush(&mut self) {
        while !self.in_flight.is_empty() {
            self.settle_oldest().await;
        }
    }

    /// Messages published and not yet acknowledged.
    pub fn unacknowledged(&self) -> usize {
        self.in_flight.len()
    }

    async fn publish(&mut self, subject: String, payload: Bytes) {
        while self.in_flight.len() >= self.max_in_flight {
            self.settle_oldest().await;
        }
        self.send(subject, payload).await;
        self.metrics.nats_published.inc();
    }

    /// Hands one message to the connection (retried with back-off until it is taken).
    async fn send(&mut self, subject: String, payload: Bytes) {
        loop {
            let sent = self
                .js
                .publish_with_headers(subject.clone(), self.headers.clone(), payload.clone())
                .await;
            match sent {
                Ok(ack) => {
                    self.in_flight.push_back(InFlight {
                        subject,
                        payload,
                        ack,
                    });
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "JetStream publish failed; retrying");
                    sleep(self.backoff.step()).await;
                }
            }
        }
    }

    /// Waits for the oldest acknowledgement; on failure re-publishes it and everything after it,
    /// in order.
    async fn settle_oldest(&mut self) {
        let Some(first) = self.in_flight.pop_front() else {
            return;
        };
        match first.ack.await {
            Ok(_) => {
                self.metrics.nats_acked.inc();
                self.backoff.reset();
            }
            Err(e) => {
                let redo: Vec<(String, Bytes)> = std::iter::once((first.subject, first.payload))
                    .chain(self.in_flight.drain(..).map(|m| (m.subject, m.payload)))
                    .collect();
                tracing::warn!(
                    error = %e,
                    messages = redo.len(),
                    "JetStream did not acknowledge; re-publishing in order"
                );
                self.metrics.nats_republished.inc_by(redo.len() as u64);
                sleep(self.backoff.step()).await;
                for (subject, payload) in redo {
                    self.send(subject, payload).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_producer_name_is_the_subjects_last_token() {
        let mut p = LogProducer {
            subject: "ic".into(),
            name: None,
            epoch: "1-a".into(),
        };
        assert_eq!(p.subject_of("update"), "ic.update");
        p.name = Some("pool-a".into());
        assert_eq!(p.subject_of("update"), "ic.update.pool-a");
        assert_eq!(p.subject_of("event"), "ic.event.pool-a");
    }
}
