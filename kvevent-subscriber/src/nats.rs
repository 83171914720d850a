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

/// Environment variable holding the `--nats-user` password when `--nats-password-file` is not
/// given.
pub const PASSWORD_ENV: &str = "NATS_PASSWORD";

/// TLS and credentials of the NATS connection (the `--nats-*` flags). Its `Debug` never shows
/// the password.
#[derive(Default, Clone)]
pub struct NatsAuth {
    /// CA bundle verifying the NATS server (TLS required when set).
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key for TLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// NATS credentials file (JWT + nkey seed).
    pub creds_file: Option<PathBuf>,
    /// User name and password.
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsAuth")
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("creds_file", &self.creds_file)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl NatsAuth {
    /// From the flags: reads the password (file, else [`PASSWORD_ENV`]) and checks that every
    /// named file is readable PEM, so a mistake is a start-up error naming its flag.
    pub fn from_args(args: &Args) -> Result<Self, String> {
        let env = std::env::var(PASSWORD_ENV).ok();
        let user = match &args.nats_user {
            None => None,
            Some(u) => Some((
                u.clone(),
                read_password(args.nats_password_file.as_deref(), env)?,
            )),
        };
        if let Some(ca) = &args.nats_ca_file {
            crate::tls::client_config(ca, None).map_err(|e| format!("--nats-ca-file: {e}"))?;
        }
        let client_cert = match (&args.nats_client_cert_file, &args.nats_client_key_file) {
            (Some(c), Some(k)) => {
                crate::tls::load_pair(c, k)
                    .map_err(|e| format!("--nats-client-cert-file/--nats-client-key-file: {e}"))?;
                Some((c.clone(), k.clone()))
            }
            _ => None,
        };
        Ok(Self {
            ca_file: args.nats_ca_file.clone(),
            client_cert,
            creds_file: args.nats_creds_file.clone(),
            user,
        })
    }

    /// `opts` with this TLS and these credentials.
    pub async fn apply(
        &self,
        mut opts: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, String> {
        if let Some(ca) = &self.ca_file {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((c, k)) = &self.client_cert {
            opts = opts.add_client_certificate(c.clone(), k.clone());
        }
        if let Some(path) = &self.creds_file {
            opts = opts
                .credentials_file(path)
                .await
                .map_err(|e| format!("--nats-creds-file {}: {e}", path.display()))?;
        }
        if let Some((u, p)) = &self.user {
            opts = opts.user_and_password(u.clone(), p.clone());
        }
        Ok(opts)
    }
}

/// The `--nats-user` password: the file's content (trimmed) or else `env`.
fn read_password(file: Option<&std::path::Path>, env: Option<String>) -> Result<String, String> {
    let pass = match file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("--nats-password-file {}: cannot read: {e}", path.display()))?
            .trim()
            .to_string(),
        None => env.ok_or_else(|| {
            format!(
                "--nats-user needs --nats-password-file or the {PASSWORD_ENV} environment variable"
            )
        })?,
    };
    if pass.is_empty() {
        return Err("--nats-user: the password is empty".into());
    }
    Ok(pass)
}

/// Whether a connection failure is a configuration problem that retrying cannot fix (refused
/// credentials, TLS setup) rather than an unreachable server; also its metric label. A TLS
/// alert from the server (`bad_certificate` when it requires a client certificate) or a
/// rejected server certificate arrives as an IO error wrapping rustls' error: `tls` too.
pub fn refusal_reason(e: &async_nats::ConnectError) -> Option<&'static str> {
    use async_nats::ConnectErrorKind as K;
    match e.kind() {
        K::AuthorizationViolation | K::Authentication => Some("auth"),
        K::Tls => Some("tls"),
        _ => tls_in_chain(e).then_some("tls"),
    }
}

/// Whether a rustls error is somewhere in `e`'s source chain (directly or inside an IO error).
fn tls_in_chain(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Counts and logs the refusals a background (re)connect reports through the client's events
/// (the client keeps retrying them, so they would be silent otherwise).
fn count_refusals(ev: &async_nats::Event, metrics: &Metrics) {
    use async_nats::ConnectErrorKind as K;
    let reason = match ev {
        async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => "auth",
        async_nats::Event::ClientError(async_nats::ClientError::Other(text)) => {
            let is = |k: K| *text == k.to_string();
            if is(K::AuthorizationViolation) || is(K::Authentication) {
                "auth"
            } else if is(K::Tls) {
                "tls"
            } else {
                return;
            }
        }
        _ => return,
    };
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
                if let Some(reason) = refusal_reason(&e) {
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
    use async_nats::{ConnectError, ConnectErrorKind as K};

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

    #[test]
    fn refusals_are_told_apart_from_an_unreachable_server() {
        let r = |e: ConnectError| refusal_reason(&e);
        assert_eq!(
            r(ConnectError::new(K::AuthorizationViolation)),
            Some("auth")
        );
        assert_eq!(r(ConnectError::new(K::Tls)), Some("tls"));
        assert_eq!(r(ConnectError::new(K::TimedOut)), None);
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(r(ConnectError::with_source(K::Io, refused)), None);
        let alert = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::AlertReceived(rustls::AlertDescription::BadCertificate),
        );
        assert_eq!(r(ConnectError::with_source(K::Io, alert)), Some("tls"));
    }
}
