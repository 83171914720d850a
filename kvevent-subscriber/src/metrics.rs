//! The subscriber's own Prometheus metrics and the HTTP endpoint serving them. Operators need to
//! see drops, gaps, restarts and lag to trust the index a subscriber feeds, so every lossy or
//! recovering path increments a counter here.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// A single-label set; label values are static strings so cardinality stays bounded.
pub type Label = [(&'static str, &'static str); 1];

/// All metrics of one subscriber process.
pub struct Metrics {
    registry: Registry,
    /// ZMQ batches decoded (live and replayed).
    pub batches: Counter,
    /// Engine events by `type` (BlockStored, BlockRemoved, AllBlocksCleared, unknown, invalid).
    pub events: Family<Label, Counter>,
    /// Prefix entries written to a `ReportCacheState` stream (counted when sent; re-sends after
    /// a failed stream are counted in `resent` instead).
    pub entries_sent: Counter,
    /// `ReportCacheState` messages written to a stream (entries and stats-only), when sent.
    pub updates_sent: Counter,
    /// Prefix entries of streams the server acknowledged.
    pub entries_acked: Counter,
    /// `ReportCacheState` messages of streams the server acknowledged.
    pub updates_acked: Counter,
    /// Acknowledgements with `accepted = false` (the server refused the stream's content;
    /// re-sending would not help, so it is not re-sent).
    pub streams_refused: Counter,
    /// `PublishEvent` calls delivered by `type`.
    pub cache_events_sent: Family<Label, Counter>,
    /// Data dropped by `reason`; each is an index entry or batch that will be missing.
    pub drops: Family<Label, Counter>,
    /// Seq gaps detected.
    pub gaps: Counter,
    /// Batches missing across all gaps and not recovered by a replay.
    pub missing_batches: Counter,
    /// Engine restarts detected (seq went back).
    pub restarts: Counter,
    /// Replay attempts by `result` (complete, partial, failed).
    pub replays: Family<Label, Counter>,
    /// Batches applied from replay replies.
    pub replayed_batches: Counter,
    /// Seconds between the engine's batch timestamp and its processing here.
    pub lag_seconds: Gauge<f64, AtomicU64>,
    /// gRPC stream / call failures followed by a reconnect.
    pub reconnects: Counter,
    /// Messages re-sent on a new stream after the previous stream failed unacknowledged.
    pub resent: Counter,
    /// Engine-hash reverse-map entries across publishers.
    pub reverse_map_entries: Gauge,
    /// Engine stats scrapes by `result`.
    pub scrapes: Family<Label, Counter>,
    /// Times the ZMQ reader had to wait for a full queue (back-pressure engaged).
    pub backpressure_waits: Counter,
    /// Batches the engine published after the last one received here, found by the replay
    /// probe of a quiet publisher (a lost tail) and applied.
    pub lost_tail_batches: Counter,
    /// Failed writes of `--state-file`.
    pub state_write_errors: Counter,
    /// Messages published to the JetStream stream (`--nats-url`), first publishes only.
    pub nats_published: Counter,
    /// Publishes the stream acknowledged (stored).
    pub nats_acked: Counter,
    /// Messages re-published after an acknowledgement failed (NATS down, no stream, timeout).
    pub nats_republished: Counter,
    /// Failed re-reads of a rotated credential file by `file` (`token`, `client_cert`); the
    /// last good credential stays in use.
    pub credential_reload_errors: Family<Label, Counter>,
    /// NATS connection attempts refused by `reason` (`auth`: wrong user/password or creds,
    /// `tls`: certificate or TLS setup, `other`).
    pub nats_connect_errors: Family<Label, Counter>,
    /// 1 once the server fenced this process (a newer producer epoch reported for its replica):
    /// from then on it sends nothing (module docs of `sender`).
    pub fenced: Gauge,
}

/// One registered metric of [`Metrics`], by kind.
enum Registered<'a> {
    Counter(&'a Counter),
    Family(&'a Family<Label, Counter>),
    Gauge(&'a Gauge),
    Seconds(&'a Gauge<f64, AtomicU64>),
}

/// Every metric the subscriber exposes (under the `kvevent_` prefix), in exposition order:
/// name, help, field.
type MetricRow = (&'static str, &'static str, fn(&Metrics) -> Registered<'_>);
const METRICS: [MetricRow; 28] = [
    ("batches", "ZMQ event batches decoded", |m| {
        Registered::Counter(&m.batches)
    }),
    ("events", "Engine events by type", |m| {
        Registered::Family(&m.events)
    }),
    (
        "entries_sent",
        "Prefix entries sent via ReportCacheState",
        |m| Registered::Counter(&m.entries_sent),
    ),
    ("updates_sent", "ReportCacheState messages sent", |m| {
        Registered::Counter(&m.updates_sent)
    }),
    (
        "entries_acked",
        "Prefix entries of acknowledged ReportCacheState streams",
        |m| Registered::Counter(&m.entries_acked),
    ),
    (
        "updates_acked",
        "ReportCacheState messages of acknowledged streams",
        |m| Registered::Counter(&m.updates_acked),
    ),
    (
        "streams_refused",
        "ReportCacheState streams acknowledged with accepted=false",
        |m| Registered::Counter(&m.streams_refused),
    ),
    (
        "cache_events_sent",
        "PublishEvent calls sent by type",
        |m| Registered::Family(&m.cache_events_sent),
    ),
    ("dropped", "Data dropped by reason", |m| {
        Registered::Family(&m.drops)
    }),
    ("seq_gaps", "Sequence gaps detected", |m| {
        Registered::Counter(&m.gaps)
    }),
    (
        "missing_batches",
        "Batches lost in gaps and not replayed",
        |m| Registered::Counter(&m.missing_batches),
    ),
    (
        "engine_restarts",
        "Engine restarts detected (seq went back)",
        |m| Registered::Counter(&m.restarts),
    ),
    ("replays", "Replay attempts by result", |m| {
        Registered::Family(&m.replays)
    }),
    ("replayed_batches", "Batches applied from replay", |m| {
        Registered::Counter(&m.replayed_batches)
    }),
    (
        "lag_seconds",
        "Engine batch timestamp to processing delay",
        |m| Registered::Seconds(&m.lag_seconds),
    ),
    ("reconnects", "gRPC failures followed by reconnect", |m| {
        Registered::Counter(&m.reconnects)
    }),
    (
        "resent_messages",
        "Unacknowledged messages re-sent after a stream failure",
        |m| Registered::Counter(&m.resent),
    ),
    ("reverse_map_entries", "Engine-hash reverse map size", |m| {
        Registered::Gauge(&m.reverse_map_entries)
    }),
    ("scrapes", "Engine stats scrapes by result", |m| {
        Registered::Family(&m.scrapes)
    }),
    (
        "backpressure_waits",
        "Times the ZMQ reader waited on a full queue",
        |m| Registered::Counter(&m.backpressure_waits),
    ),
    (
        "lost_tail_batches",
        "Batches recovered by the replay probe of a quiet publisher",
        |m| Registered::Counter(&m.lost_tail_batches),
    ),
    (
        "state_write_errors",
        "Failed writes of the state file",
        |m| Registered::Counter(&m.state_write_errors),
    ),
    (
        "nats_published",
        "Messages published to the JetStream stream",
        |m| Registered::Counter(&m.nats_published),
    ),
    (
        "nats_acked",
        "JetStream publishes acknowledged by the stream",
        |m| Registered::Counter(&m.nats_acked),
    ),
    (
        "nats_republished",
        "Messages re-published after a JetStream acknowledgement failed",
        |m| Registered::Counter(&m.nats_republished),
    ),
    (
        "credential_reload_errors",
        "Failed re-reads of a rotated credential file by file",
        |m| Registered::Family(&m.credential_reload_errors),
    ),
    (
        "nats_connect_errors",
        "NATS connection attempts refused by reason",
        |m| Registered::Family(&m.nats_connect_errors),
    ),
    (
        "fenced",
        "1 once the server fenced this producer (a newer epoch for its replica); it then sends nothing",
        |m| Registered::Gauge(&m.fenced),
    ),
];

impl Metrics {
    /// Creates and registers every metric under the `kvevent_` prefix.
    pub fn new() -> Arc<Self> {
        let m = Metrics {
            batches: Counter::default(),
            events: Family::default(),
            entries_sent: Counter::default(),
            updates_sent: Counter::default(),
            entries_acked: Counter::default(),
            updates_acked: Counter::default(),
            streams_refused: Counter::default(),
            cache_events_sent: Family::default(),
            drops: Family::default(),
            gaps: Counter::default(),
            missing_batches: Counter::default(),
            restarts: Counter::default(),
            replays: Family::default(),
            replayed_batches: Counter::default(),
            lag_seconds: Gauge::default(),
            reconnects: Counter::default(),
            resent: Counter::default(),
            reverse_map_entries: Gauge::default(),
            scrapes: Family::default(),
            backpressure_waits: Counter::default(),
            lost_tail_batches: Counter::default(),
            state_write_errors: Counter::default(),
            nats_published: Counter::default(),
            nats_acked: Counter::default(),
            nats_republished: Counter::default(),
            credential_reload_errors: Family::default(),
            nats_connect_errors: Family::default(),
            fenced: Gauge::default(),
            registry: Registry::default(),
        };
        let mut registry = Registry::with_prefix("kvevent");
        m.register_into(&mut registry);
        Arc::new(Metrics { registry, ..m })
    }

    /// Registers every metric of [`METRICS`] (names and help texts) into `r`, in table order.
    fn register_into(&self, r: &mut Registry) {
        for (name, help, metric) in METRICS {
            match metric(self) {
                Registered::Counter(c) => r.register(name, help, c.clone()),
                Registered::Family(f) => r.register(name, help, f.clone()),
                Registered::Gauge(g) => r.register(name, help, g.clone()),
                Registered::Seconds(g) => r.register(name, help, g.clone()),
            }
        }
    }

    /// Counts one dropped item under `reason`.
    pub fn drop_n(&self, reason: &'static str, n: u64) {
        self.drops.get_or_create(&[("reason", reason)]).inc_by(n);
    }

    /// Current value of a drop counter (tests and logs).
    pub fn dropped(&self, reason: &'static str) -> u64 {
        self.drops.get_or_create(&[("reason", reason)]).get()
    }

    /// Counts one engine event of `kind`.
    pub fn event(&self, kind: &'static str) {
        self.events.get_or_create(&[("type", kind)]).inc();
    }

    /// Renders the registry in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// How long a metrics client may take to send its request headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest life of one metrics connection (a scrape takes milliseconds).
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Metrics connections served at once; further ones wait in the kernel's accept queue.
pub const MAX_CONNECTIONS: usize = 64;
/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
pub const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Serves `GET /metrics` (anything else is 404) on `listener` until the process exits. Each
/// connection has a header timeout and a lifetime bound, at most [`MAX_CONNECTIONS`] are
/// served at once, and an accept error pauses the loop instead of spinning.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    accept_loop(
        || async { listener.accept().await.map(|(s, _)| s) },
        move |stream| serve_connection(stream, metrics.clone()),
    )
    .await;
}

/// The accept loop of [`serve`], generic over the accept call so its error handling is tested:
/// at most [`MAX_CONNECTIONS`] handlers at once, and a pause after every accept error.
pub async fn accept_loop<S, A, AF, H, HF>(mut accept: A, handle: H)
where
    A: FnMut() -> AF,
    AF: Future<Output = std::io::Result<S>>,
    H: Fn(S) -> HF,
    HF: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let stream = match accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let conn = handle(stream);
        tokio::spawn(async move {
            let _permit = permit;
            conn.await;
        });
    }
}

/// One metrics connection: a header timeout, no keep-alive, and a lifetime bound.
async fn serve_connection(stream: tokio::net::TcpStream, metrics: Arc<Metrics>) {
    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
        let metrics = metrics.clone();
        async move {
            let resp = if req.uri().path() == "/metrics" {
                Response::builder()
                    .header(
                        "content-type",
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )
                    .body(Full::new(Bytes::from(metrics.render())))
            } else {
                Response::builder()
                    .status(StatusCode::NOT_FOUND)
                    .body(Full::new(Bytes::from_static(b"not found\n")))
            };
            Ok::<_, Infallible>(resp.expect("static response parts are valid"))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), svc);
    let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn accept_errors_pause_instead_of_spinning() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let looping = accept_loop(
            move || {
                c.fetch_add(1, Ordering::SeqCst);
                async { Err::<(), _>(std::io::Error::other("EMFILE")) }
            },
            |()| async {},
        );
        let _ = tokio::time::timeout(Duration::from_millis(550), looping).await;
        let n = calls.load(Ordering::SeqCst);
        assert!((1..=7).contains(&n), "{n} accept calls in 550 ms");
    }

    #[tokio::test]
    async fn a_silent_client_is_disconnected_after_the_header_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, Metrics::new()));
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 256];
        let closed = tokio::time::timeout(HEADER_TIMEOUT + Duration::from_secs(3), async {
            // Hyper may answer 408 before closing; read until EOF.
            while c.read(&mut buf).await.map(|n| n > 0).unwrap_or(false) {}
        })
        .await;
        assert!(
            closed.is_ok(),
            "connection still open after the header timeout"
        );
    }
}
