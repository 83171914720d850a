//! Wiring of the whole subscriber from its flags: tasks, queues, and orderly shutdown (the
//! sender drains and acknowledges what it holds before the process exits).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

use crate::auth;
use crate::cli::{Args, DEFAULT_METRICS_BIND, DEFAULT_METRICS_PORTS, MetricsBind};
use crate::ingest::{self, Processor, ReplayConfig};
use crate::mapping::{Mapper, MappingConfig, Op};
use crate::metrics::{self, Metrics};
use crate::nats::{LogProducer, NatsPublisher};
use crate::sender::{Sender, SenderConfig};
use crate::state::{self, Resume};
use crate::stats::{self, StatsConfig};
use crate::tls;

/// How long shutdown waits for the sender to flush and be acknowledged.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A configuration problem found at start-up (an address that cannot be bound); the binary
/// prints it and exits 2, like a flag that does not parse.
#[derive(Debug)]
pub struct StartupError(pub String);

impl std::fmt::Display for StartupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartupError {}

/// Runs until `shutdown` resolves (or the SUB side fails to open).
pub async fn run(args: Args, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    if let Some(listener) = bind_metrics(args.metrics_bind).await? {
        tokio::spawn(metrics::serve(listener, metrics.clone()));
    }
    let cap = args.queue_capacity.max(1);
    let (ops_tx, ops_rx) = mpsc::channel(cap);
    let epoch = auth::new_epoch();
    tracing::info!(producer_epoch = %epoch, "producer epoch of this process");
    let mut sender = new_sender(&args, &epoch, &metrics)?;
    if let Some(url) = &args.nats_url {
        let auth = crate::nats::auth_from_args(&args).map_err(StartupError)?;
        let producer = LogProducer {
            subject: args.nats_subject.clone(),
            name: args.nats_producer.clone(),
            epoch,
        };
        let nats = NatsPublisher::connect(
            url,
            &producer,
            args.nats_max_in_flight,
            &auth,
            metrics.clone(),
        )
        .await
        .map_err(|e| StartupError(format!("--nats-url {url}: {e}")))?;
        sender = sender.with_nats(nats, !args.nats_only);
    }
    let sender_task = tokio::spawn(sender.run(ops_rx));
    let replicas = Arc::new(Mutex::new(BTreeSet::new()));
    let stats_task = spawn_stats(&args, &replicas, &ops_tx, &metrics);
    let resume = load_state(&args)?;
    let processor = new_processor(&args, &metrics, replicas, resume);
    let (frames_tx, frames_rx) = mpsc::channel(cap);

    tracing::info!(
        endpoint = %args.endpoint,
        topic = %args.topic,
        server = %args.server,
        nats = args.nats_url.as_deref().unwrap_or(""),
        nats_only = args.nats_only,
        replica = %args.replica_id,
        model = %args.model_id,
        "kvevent-subscriber starting"
    );
    let ingest = async {
        let sock = ingest::open_sub(&args.endpoint, &args.topic).await?;
        let reader = tokio::spawn(ingest::read_loop(sock, frames_tx, metrics.clone()));
        processor.run(frames_rx, ops_tx).await;
        reader.abort();
        anyhow::Ok(())
    };
    let result = tokio::select! {
        r = ingest => r,
        () = shutdown => {
            tracing::info!("shutting down");
            Ok(())
        }
    };
    // The processor (and its ops sender) is gone: stop stats so the queue closes, then drain.
    if let Some(t) = stats_task {
        t.abort();
        let _ = t.await;
    }
    match tokio::time::timeout(DRAIN_TIMEOUT, sender_task).await {
        Ok(_) => {}
        Err(_) => tracing::warn!("sender did not drain in time"),
    }
    result
}

/// Binds the subscriber's own `/metrics` listener (README "Own metrics"): the given
/// `--metrics-bind` address exactly (failure = [`StartupError`]), nothing when disabled, and by
/// default the first free port of 9102 … 9102 + 63 on all interfaces, so several subscribers on
/// one host (one per data-parallel rank) do not collide. The bound address is logged.
pub async fn bind_metrics(bind: Option<MetricsBind>) -> anyhow::Result<Option<TcpListener>> {
    let listener = match bind {
        Some(MetricsBind::Disabled) => return Ok(None),
        Some(MetricsBind::At(addr)) => TcpListener::bind(addr)
            .await
            .map_err(|e| StartupError(format!("--metrics-bind {addr}: cannot listen: {e}")))?,
        None => {
            let first: SocketAddr = DEFAULT_METRICS_BIND.parse().expect("valid default");
            let mut bound = None;
            let mut last_err = None;
            for i in 0..DEFAULT_METRICS_PORTS {
                let addr = SocketAddr::new(first.ip(), first.port() + i);
                match TcpListener::bind(addr).await {
                    Ok(l) => {
                        bound = Some(l);
                        break;
                    }
                    Err(e) => last_err = Some(e),
                }
            }
            bound.ok_or_else(|| {
                StartupError(format!(
                    "--metrics-bind not given and ports {}..{} are all taken ({}); pass \
                     --metrics-bind IP:PORT, or an empty value to disable",
                    first.port(),
                    first.port() + DEFAULT_METRICS_PORTS - 1,
                    last_err.map_or_else(String::new, |e| e.to_string())
                ))
            })?
        }
    };
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "metrics endpoint listening");
    Ok(Some(listener))
}

/// The sender of ReportCacheState streams to `--server` (connected lazily, on first use), with
/// the call credentials (epoch, token) on every call.
fn new_sender(args: &Args, epoch: &str, metrics: &Arc<Metrics>) -> anyhow::Result<Sender> {
    let channel = server_channel(args, metrics)?;
    let token = match &args.token_file {
        Some(path) => Some(Arc::new(
            auth::TokenFile::open(path.clone(), metrics.clone())
                .map_err(|e| StartupError(format!("--token-file {e}")))?,
        )),
        None => None,
    };
    if token.is_some() && !args.server.starts_with("https://") && !args.nats_only {
        tracing::warn!(
            "--token-file with a plain-text http:// --server: the token crosses the network unencrypted"
        );
    }
    Ok(Sender::new(
        SenderConfig {
            model_id: args.model_id.clone(),
            tenant_id: args.tenant_id.clone(),
            hash_scheme: args.hash_scheme.clone(),
            max_batch: args.max_batch.max(1),
            flush_interval: args.flush_interval,
            max_unacked: args.max_unacked.max(1),
            call_timeout: Duration::from_secs(30),
            ack_interval: args.ack_interval,
            state_file: args.state_file.clone(),
        },
        channel,
        auth::CallCredentials::new(epoch, token),
        metrics.clone(),
    ))
}

/// The lazily connected channel to `--server`: plain text for `http://`; for `https://` our own
/// TCP + TLS connector (src/tls.rs) with the server verified against `--server-ca-file` and the
/// rotating client certificate. Flag combinations that cannot work are start-up errors.
fn server_channel(args: &Args, metrics: &Arc<Metrics>) -> anyhow::Result<Channel> {
    let uri: http::Uri = args.server.parse()?;
    let https = uri.scheme_str() == Some("https");
    let base = |url: String| -> anyhow::Result<Endpoint> {
        Ok(Endpoint::from_shared(url)?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_while_idle(true))
    };
    if !https {
        for (set, flag) in [
            (args.server_ca_file.is_some(), "--server-ca-file"),
            (args.client_cert_file.is_some(), "--client-cert-file"),
        ] {
            if set {
                return Err(StartupError(format!(
                    "{flag} needs an https:// --server (got {})",
                    args.server
                ))
                .into());
            }
        }
        return Ok(base(args.server.clone())?.connect_lazy());
    }
    let ca = args.server_ca_file.as_ref().ok_or_else(|| {
        StartupError(format!(
            "--server {} is https://: --server-ca-file must name the CA that signed the server's certificate",
            args.server
        ))
    })?;
    let client = match (&args.client_cert_file, &args.client_key_file) {
        (Some(c), Some(k)) => Some(Arc::new(
            tls::ReloadingClientCert::new(c.clone(), k.clone(), metrics.clone())
                .map_err(|e| StartupError(format!("--client-cert-file/--client-key-file: {e}")))?,
        )),
        _ => None,
    };
    let cfg = tls::client_config(ca, client)
        .map_err(|e| StartupError(format!("--server-ca-file: {e}")))?;
    let host = uri.host().unwrap_or_default();
    let port = uri.port_u16().unwrap_or(443);
    let connector =
        tls::Connector::new(cfg, host, port).map_err(|e| StartupError(format!("--server: {e}")))?;
    // The connector makes the TLS connection; tonic sees a plain `http://` endpoint (so its own
    // TLS, when compiled in for another crate, stays out of the way) while requests carry the
    // real `https://` origin.
    let authority = uri.authority().map_or("", |a| a.as_str());
    Ok(base(format!("http://{authority}"))?
        .origin(uri.clone())
        .connect_with_connector_lazy(connector))
}

/// With `--metrics-url`, the task that scrapes the engine and reports stats for every replica
/// in `replicas`.
fn spawn_stats(
    args: &Args,
    replicas: &Arc<Mutex<BTreeSet<String>>>,
    ops_tx: &mpsc::Sender<Op>,
    metrics: &Arc<Metrics>,
) -> Option<JoinHandle<()>> {
    args.metrics_url.clone().map(|url| {
        tokio::spawn(stats::run(
            url,
            args.stats_interval,
            StatsConfig {
                cache_size_bytes: args.cache_size_bytes,
                pressure_ceiling: args.pressure_ceiling,
            },
            args.replica_id.clone(),
            replicas.clone(),
            ops_tx.clone(),
            metrics.clone(),
        ))
    })
}

/// The event processor: engine events mapped to store operations, with replay on gaps.
fn new_processor(
    args: &Args,
    metrics: &Arc<Metrics>,
    replicas: Arc<Mutex<BTreeSet<String>>>,
    resume: Option<Resume>,
) -> Processor {
    let mapper = Mapper::new(
        MappingConfig {
            replica_id: args.replica_id.clone(),
            replica_per_dp_rank: args.replica_per_dp_rank,
            adapters: args.lora_adapter_names.clone(),
            use_lora_name: args.use_lora_name,
            block_size_override: args.block_size,
            offload_keeps_blocks: args.offload_keeps_blocks,
            kv_cache_group: args.kv_cache_group,
            reverse_map_capacity: args.reverse_map_capacity,
        },
        metrics.clone(),
    );
    let replay = args.replay_endpoint.clone().map(|endpoint| ReplayConfig {
        endpoint,
        timeout: args.replay_timeout,
    });
    let p = Processor::new(mapper, replay, metrics.clone(), replicas)
        .with_max_publishers(args.max_publishers)
        .with_tail_probe(args.tail_probe_interval);
    match resume {
        Some(r) => p.with_resume(r),
        None => p,
    }
}

/// Reads `--state-file` and checks that it can be written (a start-up error otherwise).
fn load_state(args: &Args) -> anyhow::Result<Option<Resume>> {
    let Some(path) = &args.state_file else {
        return Ok(None);
    };
    let shown = path.display();
    let resume = state::load(path)
        .map_err(|e| StartupError(format!("--state-file {shown}: cannot read: {e}")))?;
    state::save(path, &resume)
        .map_err(|e| StartupError(format!("--state-file {shown}: cannot write: {e}")))?;
    tracing::info!(publishers = resume.len(), "resuming from the state file");
    Ok(Some(resume))
}
