//! Command-line flags. Every knob of the subscriber is a flag (no config file) so that it can run
//! as a sidecar next to an engine with its whole configuration visible in the pod spec.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::{ParseFloatError, ParseIntError};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Flags of the `kvevent-subscriber` binary (see README.md for a vLLM / SGLang walk-through).
#[derive(Debug, Clone, Parser)]
#[command(name = "kvevent-subscriber", version, about)]
pub struct Args {
    /// Engine ZMQ PUB endpoint, `tcp://HOST:PORT` (or `ipc://PATH`). An endpoint containing `*`
    /// is bound (the engine connects to us), anything else is connected to (the engine binds,
    /// vLLM's default `tcp://*:5557`).
    #[arg(long, default_value = "tcp://127.0.0.1:5557", value_parser = parse_sub_endpoint)]
    pub endpoint: String,

    /// SUB topic prefix filter; empty subscribes to everything.
    #[arg(long, default_value = "")]
    pub topic: String,

    /// File remembering the last acknowledged seq per publisher. On start-up the subscriber
    /// resumes from it: batches published while it was down are fetched from the replay
    /// socket (or counted as missing without one), and an engine that restarted meanwhile is
    /// cleared. Written atomically after acknowledgements (at most every 250 ms).
    #[arg(long)]
    pub state_file: Option<std::path::PathBuf>,

    /// With `--replay-endpoint`: a publisher quiet for this long is asked for batches past the
    /// last one received, so a lost tail (or batches sent while the subscriber was down) is
    /// recovered even if the engine publishes nothing more.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub tail_probe_interval: Duration,

    /// Close and acknowledge the gRPC stream once its oldest unacknowledged message is this
    /// old (bounds how far acknowledgements and the state file lag behind).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub ack_interval: Duration,

    /// Engine replay (ROUTER) endpoint, `tcp://HOST:PORT`; when set, a seq gap triggers a
    /// replay request.
    #[arg(long, value_parser = parse_connect_endpoint)]
    pub replay_endpoint: Option<String>,

    /// How long one replay may take before the gap is counted as unrecovered.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub replay_timeout: Duration,

    /// InferenceCache gRPC server: `http://HOST:PORT` or just `HOST:PORT` (plain-text gRPC), or
    /// `https://HOST:PORT` (TLS, with `--server-ca-file`).
    #[arg(long, default_value = "http://127.0.0.1:9090", value_parser = parse_server)]
    pub server: String,

    /// PEM CA bundle that verifies the server's certificate (required by an `https://`
    /// `--server`); the certificate must name `--server`'s host.
    #[arg(long)]
    pub server_ca_file: Option<PathBuf>,

    /// PEM client certificate (chain) presented to an `https://` `--server` for mutual TLS
    /// (with `--client-key-file`). Re-read when it or the key changes, for new connections.
    #[arg(long, requires = "client_key_file")]
    pub client_cert_file: Option<PathBuf>,

    /// PEM private key of `--client-cert-file`.
    #[arg(long, requires = "client_cert_file")]
    pub client_key_file: Option<PathBuf>,

    /// File holding a bearer token (e.g. a projected service-account token with the server's
    /// producer audience) sent as `authorization: Bearer <token>` on every ingest call; re-read
    /// when the file changes. Never logged.
    #[arg(long)]
    pub token_file: Option<PathBuf>,

    /// NATS server URL (e.g. `nats://nats:4222`): every update and event is also published to
    /// the JetStream stream that server replicas consume (docs/KV-EVENTS.md "Publishing through
    /// JetStream"); with `--nats-only`, only there.
    #[arg(long)]
    pub nats_url: Option<String>,

    /// Subject prefix of the event log: updates go to `<prefix>.update`, events to
    /// `<prefix>.event` (the servers' `--nats-subject`).
    #[arg(long, default_value = "inferencecache")]
    pub nats_subject: String,

    /// Publishes waiting for their JetStream acknowledgement at once.
    #[arg(long, default_value_t = crate::nats::DEFAULT_MAX_IN_FLIGHT)]
    pub nats_max_in_flight: usize,

    /// With `--nats-url`: publish only to JetStream, never call `--server` directly.
    #[arg(long, requires = "nats_url")]
    pub nats_only: bool,

    /// Producer name on the event log: publish to `<prefix>.update.<NAME>` and
    /// `<prefix>.event.<NAME>`, which the servers check as identity `nats:<NAME>` against their
    /// `--producer-policy`; NATS publish permissions decide who may use the name
    /// (docs/OPERATIONS.md "Securing the event log"). One subject token: no `.`, `*`, `>` or
    /// whitespace.
    #[arg(long, requires = "nats_url", value_parser = parse_nats_producer)]
    pub nats_producer: Option<String>,

    /// PEM CA bundle that verifies the NATS server's certificate; makes TLS required.
    #[arg(long, requires = "nats_url")]
    pub nats_ca_file: Option<PathBuf>,

    /// PEM client certificate for TLS to NATS (with `--nats-client-key-file`).
    #[arg(long, requires_all = ["nats_url", "nats_client_key_file"])]
    pub nats_client_cert_file: Option<PathBuf>,

    /// PEM private key of `--nats-client-cert-file`.
    #[arg(long, requires = "nats_client_cert_file")]
    pub nats_client_key_file: Option<PathBuf>,

    /// NATS credentials file (user JWT and nkey seed, as `nsc` writes it).
    #[arg(long, requires = "nats_url", conflicts_with = "nats_user")]
    pub nats_creds_file: Option<PathBuf>,

    /// NATS user name; the password comes from `--nats-password-file`, else from the
    /// `NATS_PASSWORD` environment variable (never from a flag, never logged).
    #[arg(long, requires = "nats_url")]
    pub nats_user: Option<String>,

    /// File holding the password of `--nats-user` (surrounding whitespace trimmed).
    #[arg(long, requires = "nats_user")]
    pub nats_password_file: Option<PathBuf>,

    /// Replica id reported to the server (the routing target, e.g. the pod's address).
    #[arg(long)]
    pub replica_id: String,

    /// When set, a batch carrying a `dp_rank` is reported as replica `<replica-id>-dp<rank>`:
    /// each data-parallel rank has its own KV cache, so it is its own routing target.
    #[arg(long)]
    pub replica_per_dp_rank: bool,

    /// Model id the entries are indexed under.
    #[arg(long)]
    pub model_id: String,

    /// Tenant id the entries are indexed under (empty = untenanted).
    #[arg(long, default_value = "")]
    pub tenant_id: String,

    /// Hash scheme name reported with every update.
    #[arg(long, default_value = "vllm")]
    pub hash_scheme: String,

    /// Engine LoRA number → adapter name, e.g. `1=sql-lora,2=chat-lora`. Engine numbers are
    /// replica-local, so an unmapped number is dropped (fail-closed).
    #[arg(long, default_value = "", value_parser = parse_adapter_map)]
    pub lora_adapter_names: AdapterMap,

    /// Use the event's `lora_name` as the adapter id when `lora_id` is not mapped by
    /// `--lora-adapter-names` (on by default; `--use-lora-name=false` turns it off, and then an
    /// adapter event without a mapped number is dropped). Names are what operators load
    /// adapters as, so they agree across replicas, unlike the numbers; SGLang sends only the
    /// name.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub use_lora_name: bool,

    /// Tokens per block; overrides the event's `block_size` (used when an engine omits it).
    #[arg(long)]
    pub block_size: Option<i32>,

    /// The engine has an offload tier that keeps a block evicted from GPU: a GPU
    /// `BlockRemoved` re-reports the block as tier T2 instead of evicting it.
    #[arg(long)]
    pub offload_keeps_blocks: bool,

    /// Only events of this KV-cache group (hybrid models) are indexed; events with no group are
    /// always indexed.
    #[arg(long, default_value_t = 0)]
    pub kv_cache_group: i64,

    /// Engine Prometheus endpoint scraped for stats, e.g. `http://127.0.0.1:8000/metrics`.
    #[arg(long, value_parser = parse_metrics_url)]
    pub metrics_url: Option<String>,

    /// Stats scrape / report period.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub stats_interval: Duration,

    /// KV-cache size of the engine in bytes; `cache_memory_bytes = usage × this`.
    #[arg(long, default_value_t = 0)]
    pub cache_size_bytes: i64,

    /// Running + waiting requests at which pressure reaches 1.0.
    #[arg(long, default_value_t = 256.0)]
    pub pressure_ceiling: f64,

    /// Flush pending entries once this many are buffered.
    #[arg(long, default_value_t = 512)]
    pub max_batch: usize,

    /// Flush pending entries at least this often.
    #[arg(long, default_value = "50ms", value_parser = parse_duration)]
    pub flush_interval: Duration,

    /// Capacity of the engine-hash reverse map (per publisher); least recently used entries
    /// are forgotten beyond it.
    #[arg(long, default_value_t = 1_000_000)]
    pub reverse_map_capacity: usize,

    /// Most publishers (`(topic, dp_rank)` pairs) tracked at once, each with its own seq state
    /// and reverse map; batches of further ones are dropped (`reason="too_many_publishers"`).
    #[arg(long, default_value_t = 64)]
    pub max_publishers: usize,

    /// Capacity of the in-process queues (batches from ZMQ, operations to the sender). When
    /// they are full the ZMQ reader stops reading (back-pressure to the engine's PUB socket).
    #[arg(long, default_value_t = 1024)]
    pub queue_capacity: usize,

    /// Messages sent on one `ReportCacheState` stream before it is closed and acknowledged;
    /// bounds what must be kept for re-sending after a failure.
    #[arg(long, default_value_t = 256)]
    pub max_unacked: usize,

    /// Address (`IP:PORT`) of this process's own Prometheus `/metrics` endpoint; empty
    /// disables it. When not given, `0.0.0.0:9102` is tried first and, if that port is taken
    /// (a second subscriber on the host, e.g. one per data-parallel rank), the next ports up
    /// to 9102 + 63; the bound address is logged. A given address that cannot be bound is a
    /// start-up error.
    #[arg(long, value_parser = parse_metrics_bind)]
    pub metrics_bind: Option<MetricsBind>,
}

/// `--metrics-bind`: an address, or disabled (empty value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsBind {
    /// Serve on exactly this address.
    At(SocketAddr),
    /// No metrics endpoint.
    Disabled,
}

/// The default metrics address and how many ports after it are tried when it is taken.
pub const DEFAULT_METRICS_BIND: &str = "0.0.0.0:9102";
/// Ports tried from the default metrics port on (9102 … 9165).
pub const DEFAULT_METRICS_PORTS: u16 = 64;

/// `--nats-producer`: one NATS subject token (1-64 bytes, no `.`, `*`, `>` or whitespace), and
/// not `update` or `event`: a NATS permission `<subject>.*.update` written for such a name would
/// also let its user publish `<subject>.admitted.update`, the subject only a log-writing server
/// may publish (the replicas apply it without a policy check, docs/BEHAVIOUR.md §4.3).
pub fn parse_nats_producer(s: &str) -> Result<String, String> {
    if matches!(s, "update" | "event") {
        return Err(format!(
            "'{s}' is reserved: a permission for <subject>.*.{s} would cover <subject>.admitted.{s}"
        ));
    }
    let ok = (1..=64).contains(&s.len())
        && !s
            .chars()
            .any(|c| matches!(c, '.' | '*' | '>') || c.is_whitespace() || c.is_control());
    if ok {
        Ok(s.to_string())
    } else {
        Err("one NATS subject token: 1-64 bytes, no '.', '*', '>' or whitespace".into())
    }
}

/// Parses `--metrics-bind`: `IP:PORT`, or empty to disable.
pub fn parse_metrics_bind(s: &str) -> Result<MetricsBind, String> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(MetricsBind::Disabled);
    }
    s.parse::<SocketAddr>()
        .map(MetricsBind::At)
        .map_err(|_| format!("expected IP:PORT (e.g. 0.0.0.0:9102) or an empty value, got {s:?}"))
}

/// Parses a ZMQ endpoint the subscriber connects to or binds (`*` host = bind).
pub fn parse_sub_endpoint(s: &str) -> Result<String, String> {
    parse_zmq_endpoint(s, true)
}

/// Parses a ZMQ endpoint the subscriber connects to (no `*`, port 1..65535).
pub fn parse_connect_endpoint(s: &str) -> Result<String, String> {
    parse_zmq_endpoint(s, false)
}

fn parse_zmq_endpoint(s: &str, may_bind: bool) -> Result<String, String> {
    let s = s.trim();
    let ep: zeromq::Endpoint = s
        .parse()
        .map_err(|e| format!("expected tcp://HOST:PORT (or ipc://PATH), got {s:?}: {e}"))?;
    match &ep {
        zeromq::Endpoint::Tcp(host, port) => {
            let binds = host.to_string().contains('*');
            if binds && !may_bind {
                return Err(format!(
                    "{s:?}: `*` (bind) is not allowed here; give the engine's address"
                ));
            }
            if *port == 0 && !binds {
                return Err(format!("{s:?}: port 0 cannot be connected to"));
            }
        }
        zeromq::Endpoint::Ipc(path) => {
            if path.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                return Err(format!("{s:?}: ipc:// needs a path"));
            }
        }
        _ => {
            return Err(format!(
                "{s:?}: unsupported transport (use tcp:// or ipc://)"
            ));
        }
    }
    Ok(s.to_string())
}

/// Parses `--server`: `http://HOST:PORT`, or `HOST:PORT` (taken as `http://`). Returns the URL.
pub fn parse_server(s: &str) -> Result<String, String> {
    let s = s.trim();
    let url = if s.contains("://") {
        s.to_string()
    } else {
        format!("http://{s}")
    };
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| format!("expected http://HOST:PORT or HOST:PORT, got {s:?}: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(format!("{s:?}: the scheme must be http:// or https://")),
    }
    let host = uri.host().unwrap_or("");
    if host.is_empty() {
        return Err(format!("{s:?}: no host"));
    }
    // The URI parser accepts any text after the host's colon; the port must be 1..65535.
    let authority = uri.authority().map_or("", |a| a.as_str());
    let after_host = authority.rsplit_once(']').map_or(authority, |(_, r)| r);
    if let Some((_, port)) = after_host.rsplit_once(':') {
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return Err(format!("{s:?}: the port must be a number in 1..65535")),
        }
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err(format!("{s:?}: a gRPC server address has no path"));
    }
    tonic::transport::Endpoint::from_shared(url.clone()).map_err(|e| format!("{s:?}: {e}"))?;
    Ok(url)
}

/// Parses `--metrics-url`: an `http://HOST[:PORT]/PATH` URL.
pub fn parse_metrics_url(s: &str) -> Result<String, String> {
    let s = s.trim();
    let uri: hyper::Uri = s
        .parse()
        .map_err(|e| format!("expected http://HOST:PORT/metrics, got {s:?}: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.host().is_none_or(str::is_empty) {
        return Err(format!(
            "expected http://HOST:PORT/metrics (plain HTTP), got {s:?}"
        ));
    }
    Ok(s.to_string())
}

/// Engine LoRA number → adapter name.
pub type AdapterMap = HashMap<i64, String>;

/// A malformed `--lora-adapter-names` value.
#[derive(Clone, Debug, PartialEq)]
pub enum AdapterMapError {
    /// An item without `=`.
    NotIdEqualsName(String),
    /// An adapter number that is not an integer (the item's text before `=`).
    BadNumber(String, ParseIntError),
    /// `N=` with no name.
    EmptyName(i64),
    /// The same number twice.
    Duplicate(i64),
}

impl fmt::Display for AdapterMapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdapterMapError::NotIdEqualsName(item) => write!(f, "expected ID=NAME, got {item:?}"),
            AdapterMapError::BadNumber(id, e) => write!(f, "bad adapter number {id:?}: {e}"),
            AdapterMapError::EmptyName(id) => write!(f, "empty adapter name for {id}"),
            AdapterMapError::Duplicate(id) => write!(f, "adapter number {id} given twice"),
        }
    }
}

impl std::error::Error for AdapterMapError {}

/// Parses `1=sql-lora,2=chat-lora` (empty string = no mapping).
pub fn parse_adapter_map(s: &str) -> Result<AdapterMap, AdapterMapError> {
    let mut out = HashMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, name) = part
            .split_once('=')
            .ok_or_else(|| AdapterMapError::NotIdEqualsName(part.to_string()))?;
        let id: i64 = id
            .trim()
            .parse()
            .map_err(|e| AdapterMapError::BadNumber(id.to_string(), e))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(AdapterMapError::EmptyName(id));
        }
        if out.insert(id, name.to_string()).is_some() {
            return Err(AdapterMapError::Duplicate(id));
        }
    }
    Ok(out)
}

/// A malformed duration flag; each variant holds the flag's (trimmed) text.
#[derive(Clone, Debug, PartialEq)]
pub enum DurationError {
    /// The number part does not parse.
    BadNumber(String, ParseFloatError),
    /// A unit other than `ms`, `s` or `m`.
    BadUnit(String),
    /// Zero, negative or not finite.
    NotPositive(String),
}

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DurationError::BadNumber(s, e) => write!(f, "bad duration {s:?}: {e}"),
            DurationError::BadUnit(s) => write!(f, "bad duration unit in {s:?} (use ms, s or m)"),
            DurationError::NotPositive(s) => write!(f, "duration must be positive: {s:?}"),
        }
    }
}

impl std::error::Error for DurationError {}

/// Parses `250ms`, `10s`, `2m` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let v: f64 = num
        .parse()
        .map_err(|e| DurationError::BadNumber(s.to_string(), e))?;
    let secs = match unit {
        "ms" => v / 1000.0,
        "s" => v,
        "m" => v * 60.0,
        _ => return Err(DurationError::BadUnit(s.to_string())),
    };
    if !secs.is_finite() || secs <= 0.0 {
        return Err(DurationError::NotPositive(s.to_string()));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_map_parses() {
        let m = parse_adapter_map("1=sql-lora, 2=chat-lora").unwrap();
        assert_eq!(m[&1], "sql-lora");
        assert_eq!(m[&2], "chat-lora");
        assert!(parse_adapter_map("").unwrap().is_empty());
        assert!(parse_adapter_map("x=y").is_err());
        assert!(parse_adapter_map("1=").is_err());
        assert!(parse_adapter_map("1=a,1=b").is_err());
    }

    #[test]
    fn nats_producer_is_one_subject_token() {
        assert_eq!(parse_nats_producer("pool-a_1").unwrap(), "pool-a_1");
        for bad in [
            "",
            "a.b",
            "a*",
            ">",
            "a b",
            &"x".repeat(65),
            "update",
            "event",
        ] {
            assert!(parse_nats_producer(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("50ms").unwrap(), Duration::from_millis(50));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5h").is_err());
    }

    #[test]
    fn defaults_match_the_contract() {
        let a = Args::parse_from(["x", "--replica-id", "r", "--model-id", "m"]);
        assert_eq!(a.server, "http://127.0.0.1:9090");
        assert_eq!(a.hash_scheme, "vllm");
        assert_eq!(a.stats_interval, Duration::from_secs(10));
        assert_eq!(a.pressure_ceiling, 256.0);
        assert_eq!(a.endpoint, "tcp://127.0.0.1:5557");
        assert_eq!(a.metrics_bind, None);
        assert!(a.use_lora_name);
        let b = Args::parse_from([
            "x",
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--use-lora-name",
        ]);
        assert!(b.use_lora_name);
        let c = Args::parse_from([
            "x",
            "--replica-id",
            "r",
            "--model-id",
            "m",
            "--use-lora-name=false",
        ]);
        assert!(!c.use_lora_name);
    }

    #[test]
    fn endpoints_are_validated() {
        assert!(parse_sub_endpoint("tcp://127.0.0.1:5557").is_ok());
        assert!(parse_sub_endpoint("tcp://*:5557").is_ok());
        assert!(parse_sub_endpoint("tcp://[::1]:5557").is_ok());
        assert!(parse_sub_endpoint("tcp://engine.local:5557").is_ok());
        assert!(parse_sub_endpoint("ipc:///tmp/kv.sock").is_ok());
        for bad in [
            "127.0.0.1:5557",
            "tcp://127.0.0.1:notaport",
            "tcp://127.0.0.1:70000",
            "tcp://127.0.0.1",
            "tcp://127.0.0.1:0",
            "udp://127.0.0.1:5557",
            "",
        ] {
            assert!(parse_sub_endpoint(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_connect_endpoint("tcp://*:5558").is_err());
    }

    #[test]
    fn server_accepts_host_port_and_urls() {
        assert_eq!(
            parse_server("127.0.0.1:9090").unwrap(),
            "http://127.0.0.1:9090"
        );
        assert_eq!(
            parse_server("http://cache.svc:9090").unwrap(),
            "http://cache.svc:9090"
        );
        assert_eq!(parse_server("[::1]:9090").unwrap(), "http://[::1]:9090");
        assert_eq!(
            parse_server("https://cache:9090").unwrap(),
            "https://cache:9090"
        );
        for bad in [
            "not a url",
            "127.0.0.1:notaport",
            "https://cache:notaport",
            "ftp://cache:9090",
            "http://:9090",
            "http://cache:9090/path",
            "cache:0",
            "",
        ] {
            assert!(parse_server(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn metrics_bind_is_an_address_or_empty() {
        assert_eq!(
            parse_metrics_bind("127.0.0.1:9102").unwrap(),
            MetricsBind::At("127.0.0.1:9102".parse().unwrap())
        );
        assert_eq!(parse_metrics_bind("").unwrap(), MetricsBind::Disabled);
        assert!(parse_metrics_bind("localhost").is_err());
        assert!(parse_metrics_bind("0.0.0.0:99999").is_err());
        assert!(parse_metrics_url("http://127.0.0.1:8000/metrics").is_ok());
        assert!(parse_metrics_url("127.0.0.1:8000/metrics").is_err());
    }
}
