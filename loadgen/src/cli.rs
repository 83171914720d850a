//! Command line: `loadgen run`, `loadgen capacity`, `loadgen preload`. Flags map 1:1 onto the
//! config structs of the other modules so the CLI stays a thin, documented shell.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::capacity::SearchConfig;
use crate::driver::Bounds;
use crate::error::ConfigError;
use crate::gateway::LookupInput;
use crate::producer::ProducerConfig;
use crate::workload::{WorkloadConfig, WorkloadKind};

/// Load generator and capacity planner for InferenceCache servers (any server speaking the
/// `inferencecache.v1alpha1.InferenceCache` contract).
#[derive(Parser, Debug)]
#[command(name = "loadgen", version, about)]
pub struct Cli {
    /// Client threads (tokio workers); 0 = one per CPU. One call in flight is measured best
    /// with 1: a second thread only adds a cross-thread wake-up to every answer.
    #[arg(long, global = true, default_value_t = 0)]
    pub threads: usize,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Drive lookups (open loop with --rate, closed loop with --concurrency) while producers
    /// ingest, then print the report.
    Run(RunArgs),
    /// Search for the highest open-loop rate whose p99 stays within --p99-budget-ms.
    Capacity(CapacityArgs),
    /// Only ingest the workload's initial population, then exit.
    Preload(PreloadArgs),
}

/// Where to connect.
#[derive(Args, Debug, Clone)]
pub struct ConnArgs {
    /// gRPC address of the server; the only address loadgen ever sends to.
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub addr: String,
    /// HTTP/2 connections, spread round-robin over gateways and producers.
    #[arg(long, default_value_t = 2)]
    pub connections: u32,
    /// Deadline of each unary call (sent as grpc-timeout and enforced client-side), ms.
    #[arg(long, default_value_t = 5000)]
    pub rpc_timeout_ms: u64,
    /// The server's shard-aware listener (`host:port`, its `--shard-aware-grpc-bind-address`).
    /// When set, lookups go through the gateway SDK: one connection per server core, each
    /// request on the connection of the core owning it (no cross-core hop). Producers keep
    /// using `--addr`. Compare against a run without it to see what the hops cost.
    #[arg(long)]
    pub shard_aware_addr: Option<std::net::SocketAddr>,
    /// How LookupRoute calls are sent: `lean` (the gateway SDK's HTTP/2 client, one write per
    /// call) or `tonic` (tonic's channel, three writes per call). Other RPCs always use tonic.
    #[arg(long, value_enum, default_value_t = LookupClient::Lean)]
    pub lookup_client: LookupClient,
}

/// The client `LookupRoute` calls go through (`--lookup-client`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LookupClient {
    /// `inferencecache_gateway::LookupConnection`: h2 directly, request in one write.
    Lean,
    /// tonic's generated client over a tonic channel.
    Tonic,
}

/// What `--workload` names: a generated shape, or a trace file replayed through the fleet
/// simulator (`trace:<file>`, `loadgen run` only; see crate::trace).
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadChoice {
    /// A generated workload (`chat`, `rag`, `diffuse`).
    Generated(WorkloadKind),
    /// `trace:<file>`: a Mooncake-format trace.
    Trace(PathBuf),
}

impl std::str::FromStr for WorkloadChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix(crate::trace::TRACE_PREFIX) {
            if path.is_empty() {
                return Err("trace:<file> needs a file".into());
            }
            return Ok(WorkloadChoice::Trace(PathBuf::from(path)));
        }
        WorkloadKind::from_str(s, true)
            .map(WorkloadChoice::Generated)
            .map_err(|_| format!("{s:?}: expected chat, rag, diffuse or trace:<file>"))
    }
}

/// The generated workload.
#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// Workload shape: chat, rag, diffuse, or trace:<file> (a Mooncake-format trace replayed
    /// through the fleet simulator with ground-truth checks; `run` only, see --workers).
    #[arg(long, default_value = "chat")]
    pub workload: WorkloadChoice,
    /// RNG seed; the same seed reproduces the same requests and reports.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Engine replicas (one producer each).
    #[arg(long, default_value_t = 8)]
    pub replicas: u32,
    /// Tenants.
    #[arg(long, default_value_t = 4)]
    pub tenants: u32,
    /// Models (replica r serves model r % models).
    #[arg(long, default_value_t = 1)]
    pub models: u32,
    /// LoRA adapters besides the base partition.
    #[arg(long, default_value_t = 0)]
    pub adapters: u32,
    /// hash_scheme of every update and lookup.
    #[arg(long, default_value = "vllm")]
    pub hash_scheme: String,
    /// Tokens per block (must match the server's --engine-block-size for --lookup-input tokens).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Minimum unique tokens per prompt (chat: conversation body; rag: question; diffuse: prompt).
    #[arg(long, default_value_t = 64)]
    pub min_tokens: u32,
    /// Mean unique tokens per prompt.
    #[arg(long, default_value_t = 512)]
    pub mean_tokens: u32,
    /// Maximum unique tokens per prompt.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens: u32,
    /// Population: chat conversations, RAG corpus chunks, diffuse prompts.
    #[arg(long, default_value_t = 1024)]
    pub population: u32,
    /// Shared system/instruction prompts per (tenant, model).
    #[arg(long, default_value_t = 4)]
    pub system_prompts: u32,
    /// Tokens per system/instruction prompt.
    #[arg(long, default_value_t = 256)]
    pub system_prompt_tokens: u32,
    /// Chat: turns per conversation.
    #[arg(long, default_value_t = 6)]
    pub turns: u32,
    /// RAG: tokens per corpus chunk.
    #[arg(long, default_value_t = 256)]
    pub chunk_tokens: u32,
    /// RAG: chunks per prompt.
    #[arg(long, default_value_t = 4)]
    pub chunks_per_prompt: u32,
    /// Popularity skew (Zipf exponent); 0 = uniform.
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Token ids are drawn from 0..vocab.
    #[arg(long, default_value_t = 32000)]
    pub vocab: u32,
}

impl WorkloadArgs {
    /// The validated workload config.
    pub fn config(&self) -> Result<WorkloadConfig, ConfigError> {
        let WorkloadChoice::Generated(kind) = self.workload else {
            return Err(ConfigError::Rule(
                "--workload trace:<file> runs only with `loadgen run`",
            ));
        };
        let c = WorkloadConfig {
            kind,
            seed: self.seed,
            replicas: self.replicas,
            tenants: self.tenants,
            models: self.models,
            adapters: self.adapters,
            hash_scheme: self.hash_scheme.clone(),
            block_size: self.block_size,
            min_tokens: self.min_tokens,
            mean_tokens: self.mean_tokens,
            max_tokens: self.max_tokens,
            population: self.population,
            system_prompts: self.system_prompts,
            system_prompt_tokens: self.system_prompt_tokens,
            turns: self.turns,
            chunk_tokens: self.chunk_tokens,
            chunks_per_prompt: self.chunks_per_prompt,
            zipf: self.zipf,
            vocab: self.vocab,
        };
        c.validate()?;
        Ok(c)
    }
}

/// Producer (ingest side) behaviour.
#[derive(Args, Debug, Clone)]
pub struct ProducerArgs {
    /// Flush pending block entries at least every N ms.
    #[arg(long, default_value_t = 20)]
    pub flush_ms: u64,
    /// Flush when this many entries are pending.
    #[arg(long, default_value_t = 512)]
    pub max_batch: usize,
    /// Rotate a ReportCacheState stream after this many messages.
    #[arg(long, default_value_t = 10_000)]
    pub stream_max_messages: u64,
    /// Rotate a ReportCacheState stream after this many seconds.
    #[arg(long, default_value_t = 30)]
    pub stream_max_secs: u64,
    /// Blocks each replica holds before evicting (LRU) with PublishEvent PREFIX_EVICTED.
    #[arg(long, default_value_t = 65_536)]
    pub capacity_blocks: usize,
    /// Churn: re-reports of held blocks per replica per second.
    #[arg(long, default_value_t = 50.0)]
    pub churn_per_sec: f64,
    /// Stats-only update period per replica, ms (0 = none).
    #[arg(long, default_value_t = 1000)]
    pub stats_interval_ms: u64,
    /// Store operations queued per replica before dropping (run phase).
    #[arg(long, default_value_t = 4096)]
    pub producer_queue: usize,
}

impl ProducerArgs {
    /// The producer config.
    pub fn config(&self, seed: u64, rpc_timeout: Duration) -> Result<ProducerConfig, ConfigError> {
        if !self.churn_per_sec.is_finite() || self.churn_per_sec < 0.0 {
            return Err(ConfigError::Negative("--churn-per-sec"));
        }
        Ok(ProducerConfig {
            flush: Duration::from_millis(self.flush_ms.max(1)),
            max_batch: self.max_batch.max(1),
            stream_max_messages: self.stream_max_messages.max(1),
            stream_max_age: Duration::from_secs(self.stream_max_secs.max(1)),
            capacity_blocks: self.capacity_blocks.max(1),
            churn_per_sec: self.churn_per_sec,
            stats_interval: (self.stats_interval_ms > 0)
                .then(|| Duration::from_millis(self.stats_interval_ms)),
            rpc_timeout,
            queue: self.producer_queue.max(1),
            seed,
        })
    }
}

/// Report format on stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Human table.
    Table,
    /// The JSON report.
    Json,
}

/// Measurement settings shared by `run` and `capacity`.
#[derive(Args, Debug, Clone)]
pub struct MeasureArgs {
    /// How lookups identify the prompt.
    #[arg(long, value_enum, default_value_t = LookupInput::Chain)]
    pub lookup_input: LookupInput,
    /// With `--lookup-input pd`: the `pd_topology_ref` of every LookupPDRoute.
    #[arg(long, default_value = "loadgen-pd")]
    pub pd_topology: String,
    /// Count lookups slower than this many ms (repeatable), like lookupTimeoutMs budgets.
    #[arg(long = "budget-ms")]
    pub budget_ms: Vec<f64>,
    /// Open loop: cap on lookups in flight (beyond it, sends queue and the delay is measured).
    #[arg(long, default_value_t = 4096)]
    pub max_inflight: usize,
    /// Do not ingest the initial population before measuring.
    #[arg(long)]
    pub no_preload: bool,
    /// Run no producers during the measurement (lookups only).
    #[arg(long)]
    pub no_producers: bool,
    /// No live progress line on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Write the JSON report to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// `run`: write every lookup slower than `--slow-ms` to this file (when it was due, in µs
    /// since the Unix epoch, and its latency), to line slow lookups up with server events.
    #[arg(long)]
    pub slow_log: Option<PathBuf>,
    /// The `--slow-log` threshold, ms.
    #[arg(long, default_value_t = 1.0)]
    pub slow_ms: f64,
    /// Report format on stdout.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
    /// Keep a client thread polling its sockets during the measurement instead of sleeping
    /// until an answer arrives. Each sleep and wake-up adds tens of microseconds to every
    /// sample on a VM, the same for any server, which hides the server's own share of a
    /// call. Costs a whole CPU; for latency at low concurrency, best with `--threads 1`.
    #[arg(long)]
    pub busy_poll: bool,
}

impl MeasureArgs {
    /// The `--slow-log` threshold, validated.
    pub fn slow_threshold(&self) -> Result<Duration, ConfigError> {
        if self.slow_ms.is_finite() && self.slow_ms >= 0.0 {
            Ok(Duration::from_secs_f64(self.slow_ms / 1000.0))
        } else {
            Err(ConfigError::Rule("--slow-ms must be a number >= 0"))
        }
    }

    /// Budgets as durations, validated.
    pub fn budgets(&self) -> Result<Vec<Duration>, ConfigError> {
        self.budget_ms
            .iter()
            .map(|&b| {
                if b.is_finite() && b > 0.0 {
                    Ok(Duration::from_secs_f64(b / 1000.0))
                } else {
                    Err(ConfigError::Budget(b))
                }
            })
            .collect()
    }
}

/// `loadgen run`.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Connection settings.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Workload.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Producers.
    #[command(flatten)]
    pub producer: ProducerArgs,
    /// Measurement.
    #[command(flatten)]
    pub measure: MeasureArgs,
    /// Open loop at this many lookups per second (coordinated-omission-correct latency).
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop with this many lookups in flight.
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Stop after this many lookups.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Stop after this many seconds (default 10 when --requests is not given).
    #[arg(long)]
    pub duration: Option<f64>,
    /// `--workload trace:<file>` only.
    #[command(flatten)]
    pub trace: TraceArgs,
}

/// The flags of `--workload trace:<file>` (crate::trace). There `--concurrency` bounds the calls
/// in flight within one step of the ordered replay (default 64), `--requests` replays only the
/// trace's first requests and `--duration` stops the replay early.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// Simulated workers, each one replica (`worker-<n>`).
    #[arg(long, default_value_t = fleetsim::sim::DEFAULT_WORKERS)]
    pub workers: u32,
    /// Blocks one simulated worker holds before it evicts (LRU).
    #[arg(long, default_value_t = fleetsim::sim::DEFAULT_WORKER_BLOCKS)]
    pub worker_blocks: u32,
    /// Engine blocks per 512-token trace block (32 = 16-token blocks, as vLLM reports them).
    #[arg(long, default_value_t = 1)]
    pub expand: u32,
    /// Send lookups at the trace's timestamps divided by this factor (1 = the trace's own
    /// pace); without it, as fast as the ordering allows.
    #[arg(long)]
    pub speed: Option<f64>,
    /// The server's controller-facing listener, where the replay installs its tenant's policy
    /// (floors and affinity off, so answers carry every replica's run).
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub policy_addr: String,
    /// Bearer token for `--policy-addr` (a file holding it; none with --insecure-disable-auth).
    #[arg(long)]
    pub policy_token_file: Option<PathBuf>,
    /// Do not install the policy (the server's floors then drop some of what the ground truth
    /// expects, and the check reports those lookups as mismatches).
    #[arg(long)]
    pub no_policy: bool,
}

/// Turns `--requests`/`--duration` into bounds; with neither, 10 s.
pub fn bounds(requests: Option<u64>, duration: Option<f64>) -> Result<Bounds, ConfigError> {
    let duration = match duration {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            return Err(ConfigError::NotPositive("--duration"));
        }
        Some(d) => Some(Duration::from_secs_f64(d)),
        None if requests.is_none() => Some(Duration::from_secs(10)),
        None => None,
    };
    if requests == Some(0) {
        return Err(ConfigError::NotPositive("--requests"));
    }
    Ok(Bounds { requests, duration })
}

/// `loadgen capacity`.
#[derive(Args, Debug, Clone)]
pub struct CapacityArgs {
    /// Connection settings.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Workload.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Producers.
    #[command(flatten)]
    pub producer: ProducerArgs,
    /// Measurement.
    #[command(flatten)]
    pub measure: MeasureArgs,
    /// A step passes when LookupRoute p99 is at most this, ms.
    #[arg(long)]
    pub p99_budget_ms: f64,
    /// ... and the lookup error rate is at most this.
    #[arg(long, default_value_t = 0.001)]
    pub max_error_rate: f64,
    /// ... and the achieved rate is at least this share of the target.
    #[arg(long, default_value_t = 0.9)]
    pub min_achieved_share: f64,
    /// First rate tried, req/s.
    #[arg(long, default_value_t = 100.0)]
    pub start_rate: f64,
    /// Never try more than this, req/s.
    #[arg(long, default_value_t = 1_000_000.0)]
    pub max_rate: f64,
    /// Never report less than this, req/s (below it the search gives up).
    #[arg(long, default_value_t = 1.0)]
    pub min_rate: f64,
    /// Exponential phase growth factor.
    #[arg(long, default_value_t = 2.0)]
    pub growth: f64,
    /// Stop the binary search when (hi - lo) / hi is at most this.
    #[arg(long, default_value_t = 0.05)]
    pub tolerance: f64,
    /// Maximum steps in total.
    #[arg(long, default_value_t = 20)]
    pub max_steps: u32,
    /// Seconds per step.
    #[arg(long, default_value_t = 5.0)]
    pub step_duration: f64,
}

impl CapacityArgs {
    /// The search config, validated.
    pub fn search(&self) -> Result<SearchConfig, ConfigError> {
        let c = SearchConfig {
            p99_budget_ms: self.p99_budget_ms,
            max_error_rate: self.max_error_rate,
            min_achieved_share: self.min_achieved_share,
            start_rate: self.start_rate,
            max_rate: self.max_rate,
            min_rate: self.min_rate,
            growth: self.growth,
            tolerance: self.tolerance,
            max_steps: self.max_steps,
        };
        c.validate()?;
        if !(self.step_duration.is_finite() && self.step_duration > 0.0) {
            return Err(ConfigError::NotPositive("--step-duration"));
        }
        Ok(c)
    }
}

/// `loadgen preload`.
#[derive(Args, Debug, Clone)]
pub struct PreloadArgs {
    /// Connection settings.
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Workload.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Producers.
    #[command(flatten)]
    pub producer: ProducerArgs,
    /// Write the ingest counters as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_names_a_generated_shape_or_a_trace_file() {
        let parse = |s: &str| s.parse::<WorkloadChoice>();
        assert_eq!(
            parse("trace:t.jsonl"),
            Ok(WorkloadChoice::Trace(PathBuf::from("t.jsonl")))
        );
        assert_eq!(
            parse("rag"),
            Ok(WorkloadChoice::Generated(WorkloadKind::Rag))
        );
        assert!(parse("trace:").is_err());
        assert!(parse("tracefile").is_err());
        let cli =
            Cli::try_parse_from(["loadgen", "run", "--workload", "trace:x", "--expand", "32"])
                .unwrap();
        let Command::Run(a) = cli.command else {
            panic!("run expected")
        };
        assert_eq!(a.trace.expand, 32);
        assert!(
            a.workload.config().is_err(),
            "a trace is no generated workload"
        );
    }
}
