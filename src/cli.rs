//! Command-line flags, compatible with the reference server (docs/BEHAVIOUR.md §1.1) so existing
//! deployments keep their manifests: same names, defaults and fail-closed start-up rules.

use clap::{ArgAction, Parser};

use crate::limits::{
    DEFAULT_BUSY_POLL, DEFAULT_MAX_CONNECTIONS_PER_CORE, DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_HOLDERS_PER_KEY, DEFAULT_MAX_KEYSPACES, DEFAULT_MAX_KEYSPACES_PER_MODEL,
    DEFAULT_MAX_REPLICAS_PER_SCOPE, DEFAULT_MAX_SHARDS, DEFAULT_MAX_STRING_BYTES,
    DEFAULT_MAX_TIMESTAMP_SKEW_MS, DEFAULT_NATS_READY_MAX_LAG, DEFAULT_SNAPSHOT_INTERVAL_MS,
    MAX_BUSY_POLL, MAX_SHARDS, MESSAGE_RECEIVE_TIMEOUT, MIN_SNAPSHOT_INTERVAL_MS,
};

/// Flags of `inference-cache-server`. Go-style single-dash spellings (`-grpc-bind-address`) are
/// accepted too, see [`normalize_args`].
#[derive(Debug, Clone, Parser)]
#[command(
    name = "inference-cache-server",
    version,
    about = "KV-cache-aware routing index for LLM inference"
)]
pub struct Cli {
    /// Log format: `json` (default) or `text`.
    #[arg(long, default_value = "json")]
    pub log_format: String,
    /// Log level: debug, info, warn (warning), error.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// gRPC listener (`:9090` = all interfaces).
    #[arg(long, default_value = ":9090")]
    pub grpc_bind_address: String,
    /// Public HTTP listener: /healthz, /readyz, /metrics.
    #[arg(long, default_value = ":8080")]
    pub http_bind_address: String,
    /// Controller-facing HTTP listener: /snapshot, /policy, /probe.
    #[arg(long, default_value = ":8081")]
    pub snapshot_bind_address: String,
    /// Exact Kubernetes service-account username allowed on the controller-facing listener.
    #[arg(long, default_value = "")]
    pub allowed_controller_sa: String,
    /// Development escape hatch: serve controller-facing endpoints without authentication.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub insecure_disable_auth: bool,
    /// TokenReview audience for /snapshot and /probe.
    #[arg(long, default_value = "inferencecache.io/controller")]
    pub controller_audience: String,
    /// TokenReview audience for /policy.
    #[arg(long, default_value = "inferencecache.io/policy")]
    pub policy_audience: String,
    /// PEM certificate for the gRPC port (requires --tls-key-file).
    #[arg(long, default_value = "")]
    pub tls_cert_file: String,
    /// PEM private key for the gRPC port (requires --tls-cert-file).
    #[arg(long, default_value = "")]
    pub tls_key_file: String,
    /// PEM CA bundle for producer client certificates on the gRPC port (requires
    /// --tls-cert-file; re-read when it changes). A client may present a certificate signed by
    /// it (its SAN URI/DNS names are the producer identity) or none at all (gateways).
    #[arg(long, default_value = "")]
    pub client_ca_file: String,
    /// TokenReview audience of producer bearer tokens on the ingest RPCs (empty = tokens are
    /// not reviewed); uses the --kube-* review client.
    #[arg(long, default_value = "")]
    pub producer_token_audience: String,
    /// YAML or JSON file binding producer identities to the replicas and tenants they may
    /// report for (re-read when it changes; a bad file keeps the last good one).
    #[arg(long, default_value = "")]
    pub producer_policy: String,
    /// Refuse ReportCacheState/PublishEvent messages from callers without a producer identity.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value = "false", default_missing_value = "true")]
    pub require_producer_auth: bool,
    /// Directory of per-model tokenizer artifacts for LookupRoute.prompt_text.
    #[arg(long, default_value = "")]
    pub tokenizer_models_dir: String,
    /// Tokens per KV block used to fingerprint token_ids / prompt_text (non-positive keeps 16).
    #[arg(long, default_value_t = 16, allow_negative_numbers = true)]
    pub engine_block_size: i64,
    /// Number of pinned per-core executors (index shards). Default: 1 on machines with two or
    /// fewer CPUs (a cross-core hop costs more than it buys there), else one per CPU up to 8.
    #[arg(long)]
    pub shards: Option<usize>,
    /// Shard-aware gRPC listener (e.g. `:19090`; empty = off): a connection to it is served by
    /// core `client source port mod shards`, so a client that opens one connection per core
    /// (the `inferencecache-gateway` crate) sends each request to the core owning its
    /// partition and never causes a cross-core hop. Same services, TLS and limits as
    /// `--grpc-bind-address`.
    #[arg(long, default_value = "")]
    pub shard_aware_grpc_bind_address: String,
    /// Microseconds each core spins looking for work after its last before it parks (0 = park
    /// at once; at most 1,000). Default: 200 when every core has a CPU of its own, else 0. A
    /// spinning core catches a client's next request without the sleep and wake-up that
    /// otherwise cost most of a lone call's latency; an idle core parks after the spin, so it
    /// costs CPU only while requests keep coming. Set 0 on CPU-quota'd or shared hosts.
    #[arg(long)]
    pub busy_poll_us: Option<u64>,
    /// Global cap on storage entries (the reference's compile-time 1,000,000; 0 = unbounded).
    /// Hidden: an operations/test knob, not part of the reference's flag set.
    #[arg(long, default_value_t = DEFAULT_MAX_ENTRIES, hide = true)]
    pub index_max_entries: u64,
    /// gRPC connections each core serves at once; further connections are closed.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS_PER_CORE)]
    pub max_connections_per_core: usize,
    /// Distinct strings (tenant, model, replica, scheme, adapter names) one core's index can
    /// hold at once, for tests of the full-table path (default: the index's compile-time
    /// maximum, 2^24). Hidden test knob.
    #[arg(long, hide = true)]
    pub index_max_strings: Option<usize>,
    /// Bytes of the names one core's index can hold at once.
    /// Hidden: an operations/test knob.
    #[arg(long, default_value_t = DEFAULT_MAX_STRING_BYTES, hide = true)]
    pub index_max_string_bytes: usize,
    /// Replicas that may hold one prefix key (at least 1).
    /// Hidden: an operations/test knob.
    #[arg(long, default_value_t = DEFAULT_MAX_HOLDERS_PER_KEY, hide = true)]
    pub index_max_holders_per_key: usize,
    /// Replicas that may serve in one scope `(tenant, model, hash scheme)` (at least 1); a
    /// message of one more is refused (`SCOPE_REPLICAS_FULL`).
    /// Hidden: an operations/test knob.
    #[arg(long, default_value_t = DEFAULT_MAX_REPLICAS_PER_SCOPE, hide = true)]
    pub index_max_replicas_per_scope: usize,
    /// Distinct keyspaces (adapters, across hash schemes) of one `(tenant, model)` on its core;
    /// a message that would create one more is refused (`KEYSPACES_FULL`).
    /// Hidden: an operations/test knob.
    #[arg(long, default_value_t = DEFAULT_MAX_KEYSPACES_PER_MODEL, hide = true)]
    pub index_max_keyspaces_per_model: usize,
    /// Keyspaces of one core, all `(tenant, model)`s together (`KEYSPACES_FULL`).
    /// Hidden: an operations/test knob.
    #[arg(long, default_value_t = DEFAULT_MAX_KEYSPACES, hide = true)]
    pub index_max_keyspaces: usize,
    /// Producer timestamps later than the server's clock plus this are clamped to it.
    /// Hidden: an operations/test knob.
    #[arg(long, default_value_t = DEFAULT_MAX_TIMESTAMP_SKEW_MS, hide = true)]
    pub max_timestamp_skew_ms: u64,
    /// Longest a gRPC request message may take to arrive once its first byte did. Hidden: an
    /// operations/test knob.
    #[arg(long, default_value_t = MESSAGE_RECEIVE_TIMEOUT.as_millis() as u64, hide = true)]
    pub grpc_message_timeout_ms: u64,
    /// TTL sweep interval in milliseconds (the reference's fixed 1 min). Hidden test knob.
    #[arg(long, default_value_t = 60_000, hide = true)]
    pub sweep_interval_ms: u64,
    /// Directory for warm-restart snapshots: each core's partitions (and the last `/policy`
    /// body) are written there periodically and at SIGTERM, and restored at start before
    /// `/readyz` turns 200. Empty (the default): no snapshots, no files.
    #[arg(long, default_value = "")]
    pub state_dir: String,
    /// Period of the snapshots under --state-dir, in milliseconds (at least 100).
    #[arg(long, default_value_t = DEFAULT_SNAPSHOT_INTERVAL_MS)]
    pub snapshot_interval_ms: u64,
    /// Concurrent StreamCacheEvents subscribers (at most 256); 0 keeps the reference's stub
    /// (the stream closes at once).
    #[arg(long, default_value_t = 0)]
    pub max_event_subscribers: usize,
    /// Concurrent StreamMetrics subscribers (at most 64); 0 keeps the reference's stub.
    #[arg(long, default_value_t = 0)]
    pub max_metric_subscribers: usize,
    /// File holding a static bearer token accepted on the controller-facing listener, for
    /// deployments without Kubernetes TokenReview. Counts as "auth configured"; may be combined
    /// with --allowed-controller-sa (either source of trust is accepted).
    #[arg(long, default_value = "", env = "INFERENCECACHE_CONTROLLER_TOKEN_FILE")]
    pub controller_token_file: String,
    /// Kubernetes API server URL for TokenReview (default: in-cluster from
    /// KUBERNETES_SERVICE_HOST/PORT).
    #[arg(long, default_value = "", env = "INFERENCECACHE_KUBE_API_SERVER")]
    pub kube_api_server: String,
    /// CA bundle for the Kubernetes API server (default: the service-account mount).
    #[arg(long, default_value = "", env = "INFERENCECACHE_KUBE_CA_FILE")]
    pub kube_ca_file: String,
    /// Bearer token file used to call TokenReview (default: the service-account mount).
    #[arg(long, default_value = "", env = "INFERENCECACHE_KUBE_TOKEN_FILE")]
    pub kube_token_file: String,
    /// NATS server URL of the replicated event log (e.g. `nats://nats:4222`). Empty (the
    /// default): no NATS at all. Set: this replica consumes the JetStream stream
    /// `--nats-stream` and applies it in order (docs/ARCHITECTURE.md "Replicas").
    #[arg(long, default_value = "")]
    pub nats_url: String,
    /// JetStream stream of the event log; created with subjects `<--nats-subject>.>` if missing.
    #[arg(long, default_value = "INFERENCECACHE")]
    pub nats_stream: String,
    /// Subject prefix of the event log: `<prefix>.update` carries a protobuf CacheStateUpdate,
    /// `<prefix>.event` a protobuf CacheEvent.
    #[arg(long, default_value = "inferencecache")]
    pub nats_subject: String,
    /// `/readyz` answers 503 after start until the stream's last sequence is at most this many
    /// messages ahead of the last one applied.
    #[arg(long, default_value_t = DEFAULT_NATS_READY_MAX_LAG)]
    pub nats_ready_max_lag: u64,
    /// PEM CA bundle verifying the NATS server's certificate; makes TLS to NATS required.
    #[arg(long, default_value = "")]
    pub nats_ca_file: String,
    /// PEM client certificate for TLS to NATS (with `--nats-client-key-file`).
    #[arg(long, default_value = "")]
    pub nats_client_cert_file: String,
    /// PEM private key of `--nats-client-cert-file`.
    #[arg(long, default_value = "")]
    pub nats_client_key_file: String,
    /// NATS credentials file (user JWT and nkey seed, as `nsc` writes it).
    #[arg(long, default_value = "")]
    pub nats_creds_file: String,
    /// NATS user name; the password comes from `--nats-password-file`, else from the
    /// `NATS_PASSWORD` environment variable (never from a flag, never logged).
    #[arg(long, default_value = "")]
    pub nats_user: String,
    /// File holding the password of `--nats-user` (surrounding whitespace trimmed).
    #[arg(long, default_value = "")]
    pub nats_password_file: String,
    /// Make this server a writer of the event log: ReportCacheState/PublishEvent messages that
    /// pass the producer checks are published to the stream (on `<subject>.admitted.*`) and
    /// acknowledged once JetStream acknowledged them, instead of being applied here directly;
    /// every replica, this one included, applies them from the log (docs/BEHAVIOUR.md §4.3).
    #[arg(long)]
    pub nats_log_writer: bool,
}

/// A flag combination the server refuses to start with (exit 2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlagError {
    /// Two flags that exclude each other.
    MutuallyExclusive(&'static str, &'static str),
    /// No controller authentication chosen.
    MissingAuth,
    /// A value with leading or trailing whitespace.
    Whitespace(&'static str),
    /// An audience left empty while TokenReview is on.
    EmptyAudience(&'static str),
    /// Only one of the TLS pair.
    TlsPair,
    /// `--shards` outside 1..=MAX_SHARDS.
    Shards,
    /// `--snapshot-interval-ms` below its minimum.
    SnapshotInterval,
    /// `--busy-poll-us` over MAX_BUSY_POLL.
    BusyPoll,
    /// A flag that needs another one.
    Requires(&'static str, &'static str),
}

impl std::fmt::Display for FlagError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::MutuallyExclusive(a, b) => write!(f, "{a} and {b} are mutually exclusive"),
            Self::MissingAuth => f.write_str("missing --allowed-controller-sa: refusing to serve the controller-facing endpoints unauthenticated (use --insecure-disable-auth for development)"),
            Self::Whitespace(flag) => {
                write!(f, "{flag} must not have leading or trailing whitespace")
            }
            Self::EmptyAudience(flag) => {
                write!(f, "{flag} must not be empty when --allowed-controller-sa is set")
            }
            Self::TlsPair => f.write_str("--tls-cert-file and --tls-key-file must be set together"),
            Self::Shards => write!(f, "--shards must be between 1 and {MAX_SHARDS}"),
            Self::SnapshotInterval => write!(
                f,
                "--snapshot-interval-ms must be at least {MIN_SNAPSHOT_INTERVAL_MS}"
            ),
            Self::Requires(a, b) => write!(f, "{a} requires {b}"),
            Self::BusyPoll => write!(
                f,
                "--busy-poll-us must be at most {}",
                MAX_BUSY_POLL.as_micros()
            ),
        }
    }
}

impl std::error::Error for FlagError {}

/// Rewrites Go-style `-flag` / `-flag=value` arguments to `--flag`, because the reference's Go
/// `flag` package accepts both spellings and manifests in the field use either.
pub fn normalize_args(args: impl IntoIterator<Item = String>) -> Vec<String> {
    args.into_iter()
        .enumerate()
        .map(|(i, a)| {
            if i > 0 && a.starts_with('-') && !a.starts_with("--") && a.len() > 2 {
                format!("-{a}")
            } else {
                a
            }
        })
        .collect()
}

/// Start-up validation of the auth flags (docs/BEHAVIOUR.md §1.1): the first failing rule.
pub fn validate_auth(cli: &Cli) -> Result<(), FlagError> {
    let sa = &cli.allowed_controller_sa;
    if !sa.is_empty() && cli.insecure_disable_auth {
        return Err(FlagError::MutuallyExclusive(
            "--allowed-controller-sa",
            "--insecure-disable-auth",
        ));
    }
    if !cli.controller_token_file.is_empty() && cli.insecure_disable_auth {
        return Err(FlagError::MutuallyExclusive(
            "--controller-token-file",
            "--insecure-disable-auth",
        ));
    }
    if sa.is_empty() && cli.controller_token_file.is_empty() && !cli.insecure_disable_auth {
        return Err(FlagError::MissingAuth);
    }
    if sa.is_empty() {
        return Ok(());
    }
    if sa.trim() != sa {
        return Err(FlagError::Whitespace("--allowed-controller-sa"));
    }
    for (flag, aud) in [
        ("--controller-audience", &cli.controller_audience),
        ("--policy-audience", &cli.policy_audience),
    ] {
        if aud.trim().is_empty() {
            return Err(FlagError::EmptyAudience(flag));
        }
        if aud.trim() != aud.as_str() {
            return Err(FlagError::Whitespace(flag));
        }
    }
    Ok(())
}

/// Validates the snapshot flags.
pub fn validate_snapshots(cli: &Cli) -> Result<(), FlagError> {
    if cli.snapshot_interval_ms < MIN_SNAPSHOT_INTERVAL_MS {
        return Err(FlagError::SnapshotInterval);
    }
    Ok(())
}

/// Validates the TLS flag pair: both or neither.
pub fn validate_tls(cli: &Cli) -> Result<(), FlagError> {
    match (cli.tls_cert_file.is_empty(), cli.tls_key_file.is_empty()) {
        (true, true) | (false, false) => Ok(()),
        _ => Err(FlagError::TlsPair),
    }
}

/// Validates the producer flags: a client CA needs TLS, and requiring an identity (or a policy,
/// which never allows an anonymous caller) needs a way to have one: a client CA, a token
/// audience, or the event log (whose messages name their producer in the subject).
pub fn validate_producer(cli: &Cli) -> Result<(), FlagError> {
    if !cli.client_ca_file.is_empty() && cli.tls_cert_file.is_empty() {
        return Err(FlagError::Requires("--client-ca-file", "--tls-cert-file"));
    }
    if cli.producer_token_audience.trim() != cli.producer_token_audience {
        return Err(FlagError::Whitespace("--producer-token-audience"));
    }
    if cli.nats_log_writer && cli.nats_url.is_empty() {
        return Err(FlagError::Requires("--nats-log-writer", "--nats-url"));
    }
    let identity_source = !cli.client_ca_file.is_empty()
        || !cli.producer_token_audience.is_empty()
        || !cli.nats_url.is_empty();
    if !identity_source {
        if cli.require_producer_auth {
            return Err(FlagError::Requires(
                "--require-producer-auth",
                "--client-ca-file, --producer-token-audience or --nats-url",
            ));
        }
        if !cli.producer_policy.is_empty() {
            return Err(FlagError::Requires(
                "--producer-policy",
                "--client-ca-file, --producer-token-audience or --nats-url",
            ));
        }
    }
    Ok(())
}

/// The number of executors: `--shards`, else the machine default; within 1..=MAX_SHARDS.
pub fn shards(cli: &Cli, cpus: usize) -> Result<usize, FlagError> {
    let shards = cli.shards.unwrap_or_else(|| default_shards(cpus));
    if shards == 0 || shards > MAX_SHARDS {
        return Err(FlagError::Shards);
    }
    Ok(shards)
}

/// How long each of `shards` cores spins before parking (`--busy-poll-us`), if at all, on a
/// machine that gives this process `cpus` CPUs. Unset, cores spin DEFAULT_BUSY_POLL only when
/// each has a CPU to itself: cores sharing one would spin away each other's turns.
pub fn busy_poll(
    cli: &Cli,
    shards: usize,
    cpus: usize,
) -> Result<Option<std::time::Duration>, FlagError> {
    let spin = match cli.busy_poll_us {
        Some(us) => std::time::Duration::from_micros(us),
        None if shards <= cpus => DEFAULT_BUSY_POLL,
        None => std::time::Duration::ZERO,
    };
    if spin > MAX_BUSY_POLL {
        return Err(FlagError::BusyPoll);
    }
    Ok((!spin.is_zero()).then_some(spin))
}

/// Turns a Go-style listen address (`:9090`, `host:port`) into something `ToSocketAddrs` takes.
pub fn listen_addr(addr: &str) -> String {
    if let Some(port) = addr.strip_prefix(':') {
        format!("0.0.0.0:{port}")
    } else {
        addr.to_string()
    }
}

/// The effective engine block size: non-positive values keep the default 16.
pub fn engine_block_size(cli: &Cli) -> i32 {
    if cli.engine_block_size > 0 && cli.engine_block_size <= i32::MAX as i64 {
        cli.engine_block_size as i32
    } else {
        16
    }
}

/// Default shard count for this machine (see [`Cli::shards`]).
pub fn default_shards(cpus: usize) -> usize {
    if cpus <= 2 {
        1
    } else {
        cpus.min(DEFAULT_MAX_SHARDS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        let mut v = vec!["srv".to_string()];
        v.extend(args.iter().map(|s| s.to_string()));
        Cli::try_parse_from(normalize_args(v)).unwrap()
    }

    #[test]
    fn defaults_match_reference() {
        let c = parse(&[]);
        assert_eq!(c.grpc_bind_address, ":9090");
        assert_eq!(c.http_bind_address, ":8080");
        assert_eq!(c.snapshot_bind_address, ":8081");
        assert_eq!(c.engine_block_size, 16);
        assert!(!c.insecure_disable_auth);
    }

    #[test]
    fn busy_poll_defaults_to_a_short_spin_only_on_cores_with_a_cpu_each() {
        let unset = parse(&[]);
        assert_eq!(busy_poll(&unset, 1, 2).unwrap(), Some(DEFAULT_BUSY_POLL));
        assert_eq!(busy_poll(&unset, 2, 2).unwrap(), Some(DEFAULT_BUSY_POLL));
        assert_eq!(busy_poll(&unset, 3, 2).unwrap(), None);
        let off = parse(&["--busy-poll-us", "0"]);
        assert_eq!(busy_poll(&off, 1, 2).unwrap(), None);
        let set = parse(&["--busy-poll-us", "700"]);
        assert_eq!(
            busy_poll(&set, 3, 2).unwrap(),
            Some(std::time::Duration::from_micros(700))
        );
        let over = parse(&["--busy-poll-us", "1001"]);
        assert!(busy_poll(&over, 1, 2).is_err());
    }

    #[test]
    fn go_style_flags_and_bool_values() {
        let c = parse(&["-insecure-disable-auth", "-grpc-bind-address=127.0.0.1:1"]);
        assert!(c.insecure_disable_auth);
        assert_eq!(c.grpc_bind_address, "127.0.0.1:1");
        let c = parse(&["--insecure-disable-auth=false"]);
        assert!(!c.insecure_disable_auth);
    }

    #[test]
    fn auth_rules_in_order() {
        let mut c = parse(&[]);
        assert!(
            validate_auth(&c)
                .unwrap_err()
                .to_string()
                .starts_with("missing --allowed-controller-sa")
        );
        c.allowed_controller_sa = "sa".into();
        c.insecure_disable_auth = true;
        assert!(
            validate_auth(&c)
                .unwrap_err()
                .to_string()
                .contains("mutually exclusive")
        );
        c.insecure_disable_auth = false;
        c.allowed_controller_sa = " sa".into();
        assert!(
            validate_auth(&c)
                .unwrap_err()
                .to_string()
                .contains("whitespace")
        );
        c.allowed_controller_sa = "sa".into();
        c.controller_audience = "  ".into();
        assert!(
            validate_auth(&c)
                .unwrap_err()
                .to_string()
                .contains("--controller-audience")
        );
        c.controller_audience = "a ".into();
        assert!(
            validate_auth(&c)
                .unwrap_err()
                .to_string()
                .contains("--controller-audience")
        );
        c.controller_audience = "a".into();
        c.policy_audience = "".into();
        assert!(
            validate_auth(&c)
                .unwrap_err()
                .to_string()
                .contains("--policy-audience")
        );
        c.policy_audience = "p".into();
        assert!(validate_auth(&c).is_ok());
    }

    #[test]
    fn token_file_counts_as_auth() {
        let mut c = parse(&["--controller-token-file", "/t"]);
        assert!(validate_auth(&c).is_ok());
        c.insecure_disable_auth = true;
        assert!(
            validate_auth(&c)
                .unwrap_err()
                .to_string()
                .contains("mutually exclusive")
        );
        let c = parse(&[
            "--controller-token-file",
            "/t",
            "--allowed-controller-sa",
            "sa",
        ]);
        assert!(validate_auth(&c).is_ok());
    }

    #[test]
    fn producer_flags_need_an_identity_source() {
        let ok = |args: &[&str]| validate_producer(&parse(args));
        assert_eq!(ok(&[]), Ok(()));
        assert_eq!(
            ok(&["--client-ca-file", "/ca"]),
            Err(FlagError::Requires("--client-ca-file", "--tls-cert-file"))
        );
        assert!(ok(&["--require-producer-auth"]).is_err());
        assert!(ok(&["--producer-policy", "/p"]).is_err());
        assert_eq!(
            ok(&[
                "--producer-token-audience",
                "aud",
                "--require-producer-auth",
                "--producer-policy",
                "/p"
            ]),
            Ok(())
        );
        assert_eq!(
            ok(&[
                "--tls-cert-file",
                "/c",
                "--client-ca-file",
                "/ca",
                "--require-producer-auth"
            ]),
            Ok(())
        );
        assert!(ok(&["--producer-token-audience", " aud"]).is_err());
        assert_eq!(
            ok(&["--nats-url", "nats://n:4222", "--producer-policy", "/p"]),
            Ok(()),
            "log producers have an identity"
        );
        assert_eq!(
            ok(&["--nats-log-writer"]),
            Err(FlagError::Requires("--nats-log-writer", "--nats-url"))
        );
        assert_eq!(
            ok(&["--nats-url", "nats://n:4222", "--nats-log-writer"]),
            Ok(())
        );
    }

    #[test]
    fn block_size_and_addresses() {
        let c = parse(&["--engine-block-size", "-3"]);
        assert_eq!(engine_block_size(&c), 16);
        assert_eq!(listen_addr(":9090"), "0.0.0.0:9090");
        assert_eq!(listen_addr("127.0.0.1:5"), "127.0.0.1:5");
        assert_eq!(default_shards(2), 1);
        assert_eq!(default_shards(4), 4);
    }
}

/// docs/OPERATIONS.md is the operator's reference: these tests fail when a flag or a limit is
/// added without a row there, or when a row names one that is gone, so the file cannot drift
/// from `Cli` and `src/limits.rs`.
#[cfg(test)]
mod operations_doc {
    use super::Cli;
    use clap::CommandFactory;

    const OPERATIONS: &str = include_str!("../docs/OPERATIONS.md");
    const LIMITS_SOURCE: &str = include_str!("limits.rs");

    /// The long names of every flag clap knows for the server (hidden ones included).
    fn flags() -> Vec<String> {
        Cli::command()
            .get_arguments()
            .filter_map(|arg| arg.get_long())
            .filter(|long| !matches!(*long, "help" | "version"))
            .map(|long| format!("--{long}"))
            .collect()
    }

    /// The first cell of every table row whose first cell is one backticked flag.
    fn flag_rows(doc: &str) -> Vec<String> {
        doc.lines()
            .filter_map(|line| line.strip_prefix("| `--"))
            .filter_map(|rest| rest.split_once("` |"))
            .map(|(name, _)| name)
            .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
            .map(|name| format!("--{name}"))
            .collect()
    }

    /// Every constant `src/limits.rs` declares or re-exports: `pub const NAME` and the names
    /// in `pub use path::{A, B};` / `pub use path::A;`.
    fn limit_names(source: &str) -> Vec<String> {
        let mut names = Vec::new();
        for (i, _) in source.match_indices("pub const ") {
            let rest = &source[i + "pub const ".len()..];
            names.push(identifier(rest));
        }
        for (i, _) in source.match_indices("pub use ") {
            let statement = &source[i..i + source[i..].find(';').expect("use ends with ;")];
            let list = match statement.split_once('{') {
                Some((_, braced)) => braced.trim_end_matches('}').to_string(),
                None => statement.rsplit("::").next().unwrap_or("").to_string(),
            };
            names.extend(list.split(',').map(|n| identifier(n.trim())));
        }
        names.retain(|n| !n.is_empty());
        names
    }

    fn identifier(text: &str) -> String {
        text.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    }

    /// The backticked constants in the last cell of the rows of the Limits section (its main
    /// table and the tuning constants table): the column that names `src/limits.rs`.
    fn constant_cells(doc: &str) -> Vec<String> {
        let section = doc
            .split("\n## Limits\n")
            .nth(1)
            .expect("docs/OPERATIONS.md has a `## Limits` section");
        let section = section.split("\n## ").next().unwrap_or(section);
        let mut names = Vec::new();
        for row in section.lines().filter(|l| l.starts_with("| ")) {
            let cells: Vec<&str> = row.trim_end_matches('|').rsplitn(2, " | ").collect();
            let last = cells[0];
            for piece in last.split('`').skip(1).step_by(2) {
                if piece
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                {
                    names.push(piece.to_string());
                }
            }
        }
        names
    }

    #[test]
    fn operations_doc_names_every_flag_and_limit() {
        let rows = flag_rows(OPERATIONS);
        let flags = flags();
        let undocumented: Vec<_> = flags.iter().filter(|f| !rows.contains(f)).collect();
        assert!(
            undocumented.is_empty(),
            "flags with no `| `--flag` |` row in docs/OPERATIONS.md's Flags table: {undocumented:?}"
        );
        let gone: Vec<_> = rows.iter().filter(|r| !flags.contains(r)).collect();
        assert!(
            gone.is_empty(),
            "docs/OPERATIONS.md has rows for flags that do not exist: {gone:?}"
        );

        let limits = limit_names(LIMITS_SOURCE);
        assert!(limits.len() > 50, "parsed too few limits: {limits:?}");
        let named = constant_cells(OPERATIONS);
        let unnamed: Vec<_> = limits.iter().filter(|l| !named.contains(l)).collect();
        assert!(
            unnamed.is_empty(),
            "limits of src/limits.rs named in no row of docs/OPERATIONS.md's Limits or Tuning constants table: {unnamed:?}"
        );
        let stale: Vec<_> = named.iter().filter(|n| !limits.contains(n)).collect();
        assert!(
            stale.is_empty(),
            "docs/OPERATIONS.md names constants src/limits.rs does not have: {stale:?}"
        );
    }

    #[test]
    fn the_checks_catch_a_missing_flag_and_a_missing_limit() {
        let without_row: String = OPERATIONS
            .lines()
            .filter(|l| !l.starts_with("| `--nats-url` |"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(!flag_rows(&without_row).contains(&"--nats-url".to_string()));
        assert!(flag_rows(OPERATIONS).contains(&"--nats-url".to_string()));

        let source = format!("{LIMITS_SOURCE}\npub const MAX_SOMETHING_NEW: usize = 1;\n");
        let named = constant_cells(OPERATIONS);
        assert!(limit_names(&source).contains(&"MAX_SOMETHING_NEW".to_string()));
        assert!(!named.contains(&"MAX_SOMETHING_NEW".to_string()));
        assert!(
            limit_names(LIMITS_SOURCE).contains(&"MAX_STRINGS".to_string()),
            "re-exports count"
        );
        assert!(named.contains(&"MAX_STRINGS".to_string()));
    }
}
