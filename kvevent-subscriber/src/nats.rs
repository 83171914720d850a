//! Publishing index operations to a NATS JetStream stream (`--nats-url`), instead of or as well
//! as calling the server directly; every server replica consuming the stream then applies them
//! (docs/KV-EVENTS.md "Publishing through JetStream").
//!
//! Encoding: a `CacheStateUpdate` is published on `<subject>.update`, a `CacheEvent` on
//! `<subject>.event`, each as its protobuf bytes (the gRPC messages, unchanged).
//!
//! A message counts as sent only once JetStream acknowledged it (stored in the stream). At most
//! `max_in_flight` publishes wait for their acknowledgement; a new publish first waits for the
//! oldest. A failed acknowledgement (NATS down, no stream, timeout) re-publishes that message and
//! every later unacknowledged one, in their original order, after a back-off: the stream may
//! then hold a duplicate, but never a message out of order with respect to the ones after it, so
//! a replica applying it ends in the same state (an upsert or eviction applied again is
//! harmless, one applied before an older one would not be).

use std::collections::VecDeque;
use std::sync::Arc;

use async_nats::jetstream::{self, context::PublishAckFuture};
use bytes::Bytes;
use inferencecache_proto::v1alpha1::{CacheEvent, CacheStateUpdate};
use prost::Message;
use tokio::time::sleep;

use crate::metrics::Metrics;
use crate::sender::Backoff;

/// Default `--nats-max-in-flight`.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;

struct InFlight {
    subject: String,
    payload: Bytes,
    ack: PublishAckFuture,
}

/// The JetStream publisher of one subscriber.
pub struct NatsPublisher {
    js: jetstream::Context,
    subject: String,
    max_in_flight: usize,
    in_flight: VecDeque<InFlight>,
    backoff: Backoff,
    metrics: Arc<Metrics>,
}

impl NatsPublisher {
    /// Connects to `url` (reconnecting in the background, forever, if it is down: only a
    /// malformed URL fails here).
    pub async fn connect(
        url: &str,
        subject: &str,
        max_in_flight: usize,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        let client = async_nats::ConnectOptions::new()
            .name("kvevent-subscriber")
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connect(url)
            .await?;
        Ok(Self {
            js: jetstream::new(client),
            subject: subject.to_string(),
            max_in_flight: max_in_flight.max(1),
            in_flight: VecDeque::new(),
            backoff: Backoff::new(),
            metrics,
        })
    }

    /// Publishes one update (returns once it is handed to the connection; see [`Self::flush`]).
    pub async fn update(&mut self, u: &CacheStateUpdate) {
        let subject = format!("{}.update", self.subject);
        self.publish(subject, u.encode_to_vec().into()).await;
    }

    /// Publishes one event.
    pub async fn event(&mut self, e: &CacheEvent) {
        let subject = format!("{}.event", self.subject);
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
            match self.js.publish(subject.clone(), payload.clone()).await {
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
