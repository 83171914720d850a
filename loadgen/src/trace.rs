//! `--workload trace:<file>`: the fleet simulator of issue 31 (`fleetsim`) replayed against a
//! live server. The simulator turns a Mooncake-format trace into an event stream (blocks stored
//! with their parent, blocks removed) on W simulated workers and a lookup stream with the
//! ground-truth answer of every lookup; here each worker is a replica id (`worker-<n>`), each
//! stored run one `ReportCacheState` message (a legacy per-block entry per block, as an event
//! subscriber reports them: docs/KV-EVENTS.md §3), each removed block one
//! `PublishEvent{PREFIX_EVICTED}`, and each lookup one `LookupRoute` with `block_hashes`.
//!
//! **Exactness.** A lookup's answer depends on the events applied before it, so the replay is
//! ordered: a lookup is sent only once every event before it in trace order is acknowledged
//! (the stream's Ack, the PublishEvent answer), and the events after it only once it is
//! answered. Events between two lookups go concurrently (at most `inflight` calls), lookups with
//! no event between them too. Every answer's matched blocks per replica are then compared with
//! the ground truth.
//!
//! **Policy.** The server's default floors would hide some of the answer (a replica matching
//! fewer than 64 tokens is dropped; a top score under 0.1, e.g. when every replica holds the
//! same prefix and the distinguishing power is 0, turns the answer into an affinity pick), so
//! the replay first installs a policy for its own tenant with both floors off, affinity off and
//! a TTL longer than the replay (`POST /policy`, which replaces the server's whole policy state:
//! meant for a test server).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use fleetsim::{Block, Event, Op, SimConfig, Simulation, TraceRequest};
use inferencecache_gateway::LookupConnection;
use inferencecache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, CacheTier, LookupRouteRequest, LookupRouteResponse, PrefixEntry,
    cache_event,
};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::{ConfigError, Error};
use crate::gateway::{self, LookupVia};
use crate::histogram::{Recorder, Rpc};
use crate::report::{BudgetReport, RpcReport};
use crate::run::Client;

/// The prefix of `--workload trace:<file>`.
pub const TRACE_PREFIX: &str = "trace:";

/// Tenant of every message of a trace replay (its policy is installed for it alone).
pub const TRACE_TENANT: &str = "loadgen-trace";

/// Model of every message of a trace replay.
pub const TRACE_MODEL: &str = "trace-model";

/// Most simulated workers a replay can check exactly: the server keeps at most 1,024 holders
/// per key and 1,024 scores per answer (docs/BEHAVIOUR.md §4.1, §9.6).
pub const MAX_TRACE_WORKERS: u32 = 1024;

/// The TTL the replay's policy sets: longer than any replay, so no entry goes stale mid-run.
pub const TRACE_POLICY_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// The server's default global entry cap (docs/BEHAVIOUR.md §7.2): a fleet holding more at
/// once is evicted by the server too, unless it runs with `--index-max-entries 0`.
pub const SERVER_DEFAULT_MAX_ENTRIES: u64 = 1_000_000;

/// Mismatches kept (and printed) in full.
pub const MISMATCHES_SHOWN: usize = 5;

/// Deadline of the policy push (the controller's own HTTP timeout, docs/BEHAVIOUR.md §12.3).
const POLICY_TIMEOUT: Duration = Duration::from_secs(5);

/// The replica id of simulated worker `w`.
pub fn replica_id(worker: u32) -> String {
    format!("worker-{worker}")
}

/// The worker a replica id names (None: not one of the replay's).
pub fn worker_of(replica: &str) -> Option<u32> {
    replica.strip_prefix("worker-")?.parse().ok()
}

/// The names every message of the replay carries.
#[derive(Clone, Debug)]
pub struct TraceScope {
    pub tenant: String,
    pub model: String,
    pub hash_scheme: String,
    /// Tokens per engine block (512 / expand).
    pub tokens_per_block: u32,
}

impl TraceScope {
    /// The replay's scope for blocks of `tokens_per_block` tokens.
    pub fn new(hash_scheme: &str, tokens_per_block: u32) -> Self {
        TraceScope {
            tenant: TRACE_TENANT.into(),
            model: TRACE_MODEL.into(),
            hash_scheme: hash_scheme.into(),
            tokens_per_block,
        }
    }

    /// The `ReportCacheState` message of a stored run: one legacy entry per block, keyed by its
    /// chain hash (the contract's rolling prefix hash, 8 bytes big-endian) with its cumulative
    /// token count, `first_depth` being the position of `blocks[0]` in its request.
    pub fn stored_update(
        &self,
        worker: u32,
        first_depth: u32,
        blocks: &[Block],
    ) -> CacheStateUpdate {
        let tpb = i64::from(self.tokens_per_block);
        let prefixes = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| PrefixEntry {
                prefix_hash: b.chain.to_be_bytes().to_vec(),
                token_count: ((i64::from(first_depth) + i as i64 + 1) * tpb) as i32,
                tier: CacheTier::T1 as i32,
                ..Default::default()
            })
            .collect();
        CacheStateUpdate {
            replica_id: replica_id(worker),
            model_id: self.model.clone(),
            tenant_id: self.tenant.clone(),
            hash_scheme: self.hash_scheme.clone(),
            prefixes,
            ..Default::default()
        }
    }

    /// One `PublishEvent{PREFIX_EVICTED}` per removed block (all adapters: the replay uses the
    /// default partition only).
    pub fn removal_events(&self, worker: u32, chains: &[u64]) -> Vec<CacheEvent> {
        chains
            .iter()
            .map(|c| CacheEvent {
                r#type: cache_event::Type::PrefixEvicted as i32,
                replica_id: replica_id(worker),
                model_id: self.model.clone(),
                tenant_id: self.tenant.clone(),
                prefix_hash: c.to_be_bytes().to_vec(),
                ..Default::default()
            })
            .collect()
    }

    /// The `LookupRoute` of a request's blocks: `block_hashes` = the chain hashes,
    /// `block_token_counts` = the block size each.
    pub fn lookup_request(&self, blocks: &[Block]) -> LookupRouteRequest {
        LookupRouteRequest {
            model_id: self.model.clone(),
            tenant_id: self.tenant.clone(),
            hash_scheme: self.hash_scheme.clone(),
            block_hashes: blocks
                .iter()
                .map(|b| b.chain.to_be_bytes().to_vec().into())
                .collect(),
            block_token_counts: vec![self.tokens_per_block as i32; blocks.len()],
            ..Default::default()
        }
    }

    /// The matched blocks per worker an answer carries (sorted by worker, zero counts dropped):
    /// each replica score's `matched_tokens` (the request's counts summed over its run,
    /// docs/BEHAVIOUR.md §8.3) divided by the block size. An answer that cannot be read that way
    /// (a foreign replica id, a count that is not whole blocks, a replica twice) is an error.
    pub fn matched_blocks(&self, resp: &LookupRouteResponse) -> Result<Vec<(u32, u32)>, String> {
        let tpb = self.tokens_per_block as i32;
        let mut out = Vec::with_capacity(resp.replica_scores.len());
        for s in &resp.replica_scores {
            let w = worker_of(&s.replica_id)
                .ok_or_else(|| format!("answer names replica {:?}", s.replica_id))?;
            if s.matched_tokens < 0 || s.matched_tokens % tpb != 0 {
                return Err(format!(
                    "{}: matched_tokens {} is not whole {tpb}-token blocks",
                    s.replica_id, s.matched_tokens
                ));
            }
            out.push((w, (s.matched_tokens / tpb) as u32));
        }
        fleetsim::check::normalise(&mut out);
        if out.windows(2).any(|p| p[0].0 == p[1].0) {
            return Err("a replica is scored twice".into());
        }
        Ok(out)
    }
}

/// The position of a stored run's first block in its request's `blocks`: 0 at the root, else
/// one past its parent's (None: the parent is not in the request).
pub fn first_depth(request: &[Block], parent: Option<u64>) -> Option<u32> {
    match parent {
        None => Some(0),
        Some(p) => request
            .iter()
            .position(|b| b.chain == p)
            .map(|i| i as u32 + 1),
    }
}

/// One step of the ordered replay: consecutive lookups, or consecutive events, of `ops`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Lookups(Range<usize>),
    Events(Range<usize>),
}

/// Groups `ops` into maximal runs of lookups and of events, in order.
pub fn steps(ops: &[Op]) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match (op, out.last_mut()) {
            (Op::Lookup(_), Some(Step::Lookups(r))) | (Op::Event(_), Some(Step::Events(r))) => {
                r.end = i + 1
            }
            (Op::Lookup(_), _) => out.push(Step::Lookups(i..i + 1)),
            (Op::Event(_), _) => out.push(Step::Events(i..i + 1)),
        }
    }
    out
}

/// The arrival time (ms) of each lookup of a simulation of `trace`: the simulator skips
/// requests without blocks, so the lookups are the requests with hash ids, in order.
pub fn lookup_times(trace: &[TraceRequest]) -> Vec<f64> {
    trace
        .iter()
        .filter(|r| !r.hash_ids.is_empty())
        .map(|r| r.timestamp_ms)
        .collect()
}

/// The JSON body of the replay's policy (docs/BEHAVIOUR.md §12.3, version 7): for `tenant`,
/// `ttl`, no matched-tokens floor (omitted = 0 once a policy exists), routing floor 0, no
/// affinity and no TENANT_HOT, so an answer carries every replica's run.
pub fn policy_body(tenant: &str, ttl: Duration) -> String {
    serde_json::json!({
        "version": 7,
        "policies": [{
            "namespace": tenant,
            "evictionTTL": ttl.as_nanos() as i64,
            "routingFloorScore": 0,
            "affinityRouting": false,
            "strategy": {
                "enableChainMatching": true,
                "requireChain": false,
                "enableTenantHot": false
            }
        }]
    })
    .to_string()
}

/// `POST /policy` of `body` to the controller-facing listener at `addr` (`http://host:port` or
/// `host:port`), with `token` as the bearer token when given; Ok on a 2xx answer.
pub async fn push_policy(addr: &str, token: Option<&str>, body: &str) -> Result<(), String> {
    let authority = addr
        .strip_prefix("http://")
        .unwrap_or(addr)
        .trim_end_matches('/')
        .to_string();
    let auth = token
        .map(|t| format!("Authorization: Bearer {}\r\n", t.trim()))
        .unwrap_or_default();
    let request = format!(
        "POST /policy HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n{auth}\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(&authority).await?;
        s.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(POLICY_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("POST {authority}/policy timed out"))?
        .map_err(|e| format!("POST {authority}/policy: {e}"))?;
    let text = String::from_utf8_lossy(&answer);
    let status = text.lines().next().unwrap_or("");
    match status.split_whitespace().nth(1) {
        Some(code) if code.starts_with('2') => Ok(()),
        _ => Err(format!(
            "POST {authority}/policy answered {status:?}: {}",
            text.lines().last().unwrap_or("")
        )),
    }
}

/// When lookups are sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pace {
    /// At the trace's timestamps divided by this factor (1 = the trace's own pace).
    Speed(f64),
    /// As fast as the ordering allows.
    AsFastAsPossible,
}

/// Everything a replay needs besides the simulation.
pub struct ReplayConfig {
    pub scope: TraceScope,
    pub pace: Pace,
    /// Calls in flight at once within a step.
    pub inflight: usize,
    /// Deadline of each call.
    pub rpc_timeout: Duration,
    /// Lookups slower than each are counted.
    pub budgets: Vec<Duration>,
    /// Stop after this long (None: the whole trace).
    pub duration: Option<Duration>,
    /// Print a progress line every second.
    pub progress: bool,
}

/// One answer that differs from the ground truth (or could not be read).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TraceMismatch {
    /// Index of the lookup in the simulation.
    pub lookup: u32,
    /// Its chain length in blocks.
    pub blocks: usize,
    /// What differs, one line.
    pub detail: String,
}

/// The result of one replay.
#[derive(Clone, Debug, Serialize)]
pub struct TraceReport {
    pub tool: &'static str,
    pub version: &'static str,
    pub target: String,
    pub trace: String,
    pub workers: u32,
    pub worker_blocks: u32,
    pub expand: u32,
    /// `speed <x>` or `as fast as possible`.
    pub pace: String,
    /// Trace requests replayed (lookups), and those sent and answered.
    pub lookups: u64,
    pub lookups_sent: u64,
    /// Simulator events (stored runs, removals) and those sent; the blocks all of them carry.
    pub events: u64,
    pub events_sent: u64,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Stores the server did not acknowledge in full (`Ack.accepted == false`).
    pub refused_stores: u64,
    pub elapsed_s: f64,
    /// Events, blocks and lookups acknowledged per second of the whole replay.
    pub events_per_s: f64,
    pub blocks_per_s: f64,
    pub lookups_per_s: f64,
    /// Per-RPC latencies: LookupRoute from send to answer, ReportCacheState from open to Ack.
    pub rpcs: std::collections::BTreeMap<String, RpcReport>,
    pub budgets: Vec<BudgetReport>,
    pub reason_codes: std::collections::BTreeMap<String, u64>,
    /// How late lookups left versus the trace's schedule (paced replays), ms.
    pub send_lag_p99_ms: Option<f64>,
    /// Lookups compared with the ground truth, and those that differed.
    pub checked: u64,
    pub mismatches: u64,
    pub first_mismatches: Vec<TraceMismatch>,
    /// The replay stopped early (`--duration`, Ctrl-C, or a failed call).
    pub stopped_early: Option<String>,
}

impl TraceReport {
    /// The human table.
    pub fn to_table(&self) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "loadgen {} → {}  (trace {}, {} workers × {} blocks, expand {}, {})",
            self.version,
            self.target,
            self.trace,
            self.workers,
            self.worker_blocks,
            self.expand,
            self.pace
        );
        let _ = writeln!(
            o,
            "elapsed {:.2} s: {} / {} events sent, {} / {} lookups answered (the whole trace: {} blocks stored, {} removed)",
            self.elapsed_s,
            self.events_sent,
            self.events,
            self.lookups_sent,
            self.lookups,
            self.stored_blocks,
            self.removed_blocks
        );
        let _ = writeln!(
            o,
            "throughput: {:.0} events/s ({:.0} blocks/s), {:.0} lookups/s",
            self.events_per_s, self.blocks_per_s, self.lookups_per_s
        );
        let _ = writeln!(
            o,
            "\n{:<18} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "rpc", "ok", "errors", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms"
        );
        for (name, r) in &self.rpcs {
            let _ = writeln!(
                o,
                "{:<18} {:>9} {:>7} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}",
                name, r.ok, r.errors, r.p50_ms, r.p90_ms, r.p99_ms, r.p999_ms, r.max_ms
            );
        }
        let codes: Vec<String> = self
            .reason_codes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let _ = writeln!(o, "reason codes: {}", codes.join(", "));
        for b in &self.budgets {
            let _ = writeln!(
                o,
                "lookups over {:.3} ms: {} ({:.4}%)",
                b.budget_ms,
                b.over,
                100.0 * b.share_over
            );
        }
        if let Some(lag) = self.send_lag_p99_ms {
            let _ = writeln!(o, "lookup send lag behind the trace: p99 {lag:.3} ms");
        }
        if self.refused_stores > 0 {
            let _ = writeln!(
                o,
                "stores not acknowledged in full: {}",
                self.refused_stores
            );
        }
        let _ = writeln!(
            o,
            "ground truth: {} lookups checked, {} mismatches",
            self.checked, self.mismatches
        );
        for m in &self.first_mismatches {
            let _ = writeln!(
                o,
                "  lookup #{} ({} blocks): {}",
                m.lookup, m.blocks, m.detail
            );
        }
        if let Some(why) = &self.stopped_early {
            let _ = writeln!(o, "stopped early: {why}");
        }
        o
    }

    /// Whether every event and lookup was sent and answered, and every answer was right.
    pub fn complete_and_exact(&self) -> bool {
        self.stopped_early.is_none()
            && self.events_sent == self.events
            && self.lookups_sent == self.lookups
            && self.checked == self.lookups
            && self.mismatches == 0
            && self.refused_stores == 0
    }
}

/// The connections a replay sends over.
pub struct Connections {
    /// ReportCacheState and PublishEvent (and LookupRoute when `lean` is empty).
    pub clients: Vec<Client>,
    /// LookupRoute over the gateway SDK's lean client (`--lookup-client lean`).
    pub lean: Vec<LookupConnection>,
}

/// What a replay has sent, checked and hit so far (kept by its driver, fed by finished tasks).
#[derive(Default)]
struct Tally {
    events_sent: u64,
    lookups_sent: u64,
    refused_stores: u64,
    checked: u64,
    mismatches: u64,
    first: Vec<TraceMismatch>,
    failure: Option<String>,
}

/// The outcome of one task of a step.
enum Done {
    Event { refused: bool },
    Lookup(u32, Result<(), String>),
    Failed(String),
}

/// One call of an event, ready to spawn.
type Call = std::pin::Pin<Box<dyn Future<Output = Done> + Send>>;

/// The replay of one simulation.
pub struct Replay<'a> {
    sim: &'a Simulation,
    times_ms: &'a [f64],
    cfg: &'a ReplayConfig,
    conns: &'a Connections,
    rec: Arc<Recorder>,
    next_conn: usize,
}

impl<'a> Replay<'a> {
    /// A replay of `sim`, whose lookups arrive at `times_ms`.
    pub fn new(
        sim: &'a Simulation,
        times_ms: &'a [f64],
        cfg: &'a ReplayConfig,
        conns: &'a Connections,
    ) -> Self {
        Replay {
            sim,
            times_ms,
            cfg,
            conns,
            rec: Arc::new(Recorder::new(&cfg.budgets)),
            next_conn: 0,
        }
    }

    /// Runs the whole ordered replay (or until `stop`, `--duration` or a failed call).
    pub async fn run(mut self, stop: Arc<std::sync::atomic::AtomicBool>) -> Finished {
        let start = Instant::now();
        let mut tally = Tally::default();
        let progress = self.cfg.progress.then(|| spawn_progress(self.rec.clone()));
        let mut last_lookup = None;
        for step in steps(&self.sim.ops) {
            if let Some(why) = self.stop_reason(start, &stop, &tally) {
                tally.failure.get_or_insert(why);
                break;
            }
            let mut tasks = JoinSet::new();
            let range = match &step {
                Step::Lookups(r) | Step::Events(r) => r.clone(),
            };
            for op in &self.sim.ops[range] {
                while tasks.len() >= self.cfg.inflight.max(1) {
                    self.collect(&mut tasks, &mut tally).await;
                }
                match *op {
                    Op::Lookup(l) => {
                        last_lookup = Some(l);
                        self.wait_due(start, l).await;
                        tasks.spawn(self.lookup_task(l));
                    }
                    Op::Event(e) => match self.event_tasks(e, last_lookup) {
                        Ok(futs) => {
                            for f in futs {
                                while tasks.len() >= self.cfg.inflight.max(1) {
                                    self.collect(&mut tasks, &mut tally).await;
                                }
                                tasks.spawn(f);
                            }
                            tally.events_sent += 1;
                        }
                        Err(why) => {
                            tally.failure.get_or_insert(why);
                        }
                    },
                }
            }
            while !tasks.is_empty() {
                self.collect(&mut tasks, &mut tally).await;
            }
        }
        if let Some(p) = progress {
            p.abort();
        }
        Finished {
            tally,
            elapsed: start.elapsed(),
            rec: self.rec,
        }
    }

    fn stop_reason(
        &self,
        start: Instant,
        stop: &std::sync::atomic::AtomicBool,
        tally: &Tally,
    ) -> Option<String> {
        if let Some(f) = &tally.failure {
            return Some(f.clone());
        }
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            return Some("interrupted".into());
        }
        match self.cfg.duration {
            Some(d) if start.elapsed() >= d => Some(format!("--duration {} s", d.as_secs_f64())),
            _ => None,
        }
    }

    /// Sleeps until lookup `l` is due (paced replays), recording how late it leaves.
    async fn wait_due(&self, start: Instant, l: u32) {
        let Pace::Speed(speed) = self.cfg.pace else {
            return;
        };
        let first = self.times_ms.first().copied().unwrap_or(0.0);
        let offset_ms = (self.times_ms[l as usize] - first).max(0.0) / speed;
        let due = start + Duration::from_secs_f64(offset_ms / 1000.0);
        tokio::time::sleep_until(due).await;
        self.rec.record_send_lag(due.elapsed());
    }

    fn client(&mut self) -> Client {
        self.next_conn = self.next_conn.wrapping_add(1);
        self.conns.clients[self.next_conn % self.conns.clients.len()].clone()
    }

    fn lookup_via(&mut self) -> LookupVia {
        if self.conns.lean.is_empty() {
            return LookupVia::Tonic(self.client());
        }
        self.next_conn = self.next_conn.wrapping_add(1);
        LookupVia::Lean(self.conns.lean[self.next_conn % self.conns.lean.len()].clone())
    }

    /// Lookup `l`: sent, answered, compared with its ground truth.
    fn lookup_task(&mut self, l: u32) -> impl Future<Output = Done> + Send + use<> {
        let sim = self.sim;
        let lookup = &sim.lookups[l as usize];
        let req = self.cfg.scope.lookup_request(&lookup.blocks);
        let prompt_tokens = lookup.blocks.len() as u64 * u64::from(self.cfg.scope.tokens_per_block);
        let truth = lookup.truth.clone();
        let blocks = lookup.blocks.len();
        let scope = self.cfg.scope.clone();
        let (via, rec, timeout) = (self.lookup_via(), self.rec.clone(), self.cfg.rpc_timeout);
        async move {
            let sent = Instant::now();
            match gateway::lookup(via, req, prompt_tokens, timeout, sent, &rec).await {
                None => Done::Failed(format!("lookup #{l} failed")),
                Some(resp) => Done::Lookup(l, compare(&scope, &resp, &truth, blocks)),
            }
        }
    }

    /// The calls of event `e`: one stream for a stored run, one PublishEvent per removed block.
    fn event_tasks(&mut self, e: u32, last_lookup: Option<u32>) -> Result<Vec<Call>, String> {
        let (rec, timeout, sim) = (self.rec.clone(), self.cfg.rpc_timeout, self.sim);
        match &sim.events[e as usize] {
            Event::Stored {
                worker,
                parent,
                blocks,
            } => {
                let request = last_lookup
                    .map(|l| sim.lookups[l as usize].blocks.as_slice())
                    .unwrap_or(&[]);
                let depth = first_depth(request, *parent)
                    .ok_or_else(|| format!("event #{e}: its parent is not in its request"))?;
                let msg = self.cfg.scope.stored_update(*worker, depth, blocks);
                Ok(vec![Box::pin(store(self.client(), msg, timeout, rec))])
            }
            Event::Removed { worker, blocks } => {
                let events = self.cfg.scope.removal_events(*worker, blocks);
                Ok(events
                    .into_iter()
                    .map(|ev| {
                        let call: Call = Box::pin(evict(self.client(), ev, timeout, rec.clone()));
                        call
                    })
                    .collect())
            }
            Event::Cleared { .. } => Err(format!("event #{e}: the simulator emits no clears")),
        }
    }

    async fn collect(&self, tasks: &mut JoinSet<Done>, tally: &mut Tally) {
        let Some(done) = tasks.join_next().await else {
            return;
        };
        match done {
            Ok(Done::Event { refused }) => tally.refused_stores += u64::from(refused),
            Ok(Done::Lookup(l, verdict)) => {
                tally.lookups_sent += 1;
                tally.checked += 1;
                if let Err(detail) = verdict {
                    tally.mismatches += 1;
                    if tally.first.len() < MISMATCHES_SHOWN {
                        tally.first.push(TraceMismatch {
                            lookup: l,
                            blocks: self.sim.lookups[l as usize].blocks.len(),
                            detail,
                        });
                    }
                }
            }
            Ok(Done::Failed(why)) => {
                tally.failure.get_or_insert(why);
            }
            Err(e) => {
                tally.failure.get_or_insert(format!("task failed: {e}"));
            }
        }
    }
}

/// A finished replay: its counters, duration and recorded latencies.
pub struct Finished {
    tally: Tally,
    elapsed: Duration,
    rec: Arc<Recorder>,
}

/// Compares an answer with the ground truth: Err describes the difference.
pub fn compare(
    scope: &TraceScope,
    resp: &LookupRouteResponse,
    truth: &[(u32, u32)],
    blocks: usize,
) -> Result<(), String> {
    let got = scope.matched_blocks(resp)?;
    if got == truth {
        return Ok(());
    }
    let m = fleetsim::Mismatch {
        lookup: 0,
        blocks,
        expected: truth.to_vec(),
        got,
    };
    let line = m.describe(4);
    // `describe` starts with the lookup; the caller prints its own.
    let diffs = line.split_once(": ").map_or(line.as_str(), |(_, d)| d);
    Err(format!("{} ({})", diffs, resp.reason_code))
}

/// One stored run: a stream with one message, closed, its Ack awaited.
async fn store(
    mut client: Client,
    msg: CacheStateUpdate,
    timeout: Duration,
    rec: Arc<Recorder>,
) -> Done {
    let t0 = Instant::now();
    let call = client.report_cache_state(tokio_stream::iter([msg]));
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(ack)) => {
            rec.record_ok(Rpc::ReportCacheState, t0);
            Done::Event {
                refused: !ack.into_inner().accepted,
            }
        }
        Ok(Err(st)) => {
            rec.record_error(Rpc::ReportCacheState, st.code());
            Done::Failed(format!("ReportCacheState: {}", st.message()))
        }
        Err(_) => {
            rec.record_error(Rpc::ReportCacheState, tonic::Code::DeadlineExceeded);
            Done::Failed("ReportCacheState timed out".into())
        }
    }
}

/// One removed block: a PublishEvent, its answer awaited.
async fn evict(mut client: Client, ev: CacheEvent, timeout: Duration, rec: Arc<Recorder>) -> Done {
    let t0 = Instant::now();
    match tokio::time::timeout(timeout, client.publish_event(ev)).await {
        Ok(Ok(_)) => {
            rec.record_ok(Rpc::PublishEvent, t0);
            Done::Event { refused: false }
        }
        Ok(Err(st)) => {
            rec.record_error(Rpc::PublishEvent, st.code());
            Done::Failed(format!("PublishEvent: {}", st.message()))
        }
        Err(_) => {
            rec.record_error(Rpc::PublishEvent, tonic::Code::DeadlineExceeded);
            Done::Failed("PublishEvent timed out".into())
        }
    }
}

/// One progress line per second on stderr: calls answered so far.
fn spawn_progress(rec: Arc<Recorder>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        for _ in 0..86_400 {
            tick.tick().await;
            let (lookups, _) = rec.counts(Rpc::LookupRoute);
            let (stores, _) = rec.counts(Rpc::ReportCacheState);
            let (evictions, _) = rec.counts(Rpc::PublishEvent);
            eprintln!(
                "[{:>5.0}s] lookups {lookups}, stored runs {stores}, removed blocks {evictions}",
                start.elapsed().as_secs_f64()
            );
        }
    })
}

/// Builds the report of a finished replay.
pub fn build_report(sim: &Simulation, facts: ReportFacts, done: Finished) -> TraceReport {
    let Finished {
        tally,
        elapsed,
        rec,
    } = done;
    let snap = rec.snapshot();
    let secs = elapsed.as_secs_f64().max(1e-9);
    let rpcs: std::collections::BTreeMap<String, RpcReport> = Rpc::ALL
        .iter()
        .map(|r| {
            (
                r.name().to_string(),
                RpcReport::from_stats(&snap.rpcs[*r as usize]),
            )
        })
        .collect();
    let lookups_ok = rpcs[Rpc::LookupRoute.name()].ok;
    let budgets = snap
        .budgets_us
        .iter()
        .zip(&snap.lookup.over_budget)
        .map(|(&b, &over)| BudgetReport {
            budget_ms: b as f64 / 1000.0,
            over,
            share_over: if lookups_ok == 0 {
                0.0
            } else {
                over as f64 / lookups_ok as f64
            },
        })
        .collect();
    let sent_blocks = sent_blocks(sim, tally.events_sent);
    TraceReport {
        tool: "loadgen",
        version: env!("CARGO_PKG_VERSION"),
        target: facts.target,
        trace: facts.trace,
        workers: sim.config.workers,
        worker_blocks: sim.config.worker_blocks,
        expand: sim.config.expand,
        pace: facts.pace,
        lookups: sim.lookups.len() as u64,
        lookups_sent: tally.lookups_sent,
        events: sim.events.len() as u64,
        events_sent: tally.events_sent,
        stored_blocks: sim.stored_blocks,
        removed_blocks: sim.removed_blocks,
        refused_stores: tally.refused_stores,
        elapsed_s: elapsed.as_secs_f64(),
        events_per_s: tally.events_sent as f64 / secs,
        blocks_per_s: sent_blocks as f64 / secs,
        lookups_per_s: tally.lookups_sent as f64 / secs,
        rpcs,
        budgets,
        reason_codes: snap.lookup.reasons.clone(),
        send_lag_p99_ms: facts
            .paced
            .then(|| crate::histogram::quantile_ms(&snap.send_lag, 0.99)),
        checked: tally.checked,
        mismatches: tally.mismatches,
        first_mismatches: tally.first,
        stopped_early: tally.failure,
    }
}

/// Blocks carried by the first `n` events of `sim` (events go out in order).
fn sent_blocks(sim: &Simulation, n: u64) -> u64 {
    sim.events
        .iter()
        .take(n as usize)
        .map(|e| match e {
            Event::Stored { blocks, .. } => blocks.len() as u64,
            Event::Removed { blocks, .. } => blocks.len() as u64,
            Event::Cleared { .. } => 0,
        })
        .sum()
}

/// What the report says about the run besides the simulation.
pub struct ReportFacts {
    pub target: String,
    pub trace: String,
    pub pace: String,
    pub paced: bool,
}

/// The simulator's config for the trace flags, validated against what the server can answer
/// exactly.
pub fn sim_config(workers: u32, worker_blocks: u32, expand: u32) -> Result<SimConfig, String> {
    if workers == 0 || workers > MAX_TRACE_WORKERS {
        return Err(format!(
            "--workers must be within 1..={MAX_TRACE_WORKERS} (the server's holders per key and scores per answer)"
        ));
    }
    Ok(SimConfig {
        workers,
        worker_blocks,
        expand,
        // The same simulation as perf/peers for the same fleet (routing by arrival time
        // compressed by workers / 64); `--speed` paces the replay, not the simulation.
        speed: SimConfig::default_speed(workers),
    })
}

/// In-flight calls within one step when `--concurrency` is not given.
pub const DEFAULT_TRACE_INFLIGHT: usize = 64;

/// `loadgen run --workload trace:<file>`: simulate, install the policy, replay, check, report.
/// Fails (after printing the report) unless every event and lookup went out and every answer
/// equals the ground truth.
pub async fn cmd_trace(a: &crate::cli::RunArgs, path: &std::path::Path) -> Result<(), Error> {
    let t = &a.trace;
    let pace = trace_pace(t.speed)?;
    if a.rate.is_some() || a.conn.shard_aware_addr.is_some() {
        return Err(ConfigError::Rule(
            "--workload trace:<file> takes --speed or --concurrency, not --rate or --shard-aware-addr",
        )
        .into());
    }
    let inflight = match a.concurrency {
        Some(0) => return Err(ConfigError::NotPositive("--concurrency").into()),
        Some(c) => c as usize,
        None => DEFAULT_TRACE_INFLIGHT,
    };
    let duration = match a.duration {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            return Err(ConfigError::NotPositive("--duration").into());
        }
        d => d.map(Duration::from_secs_f64),
    };
    let config = sim_config(t.workers, t.worker_blocks, t.expand).map_err(Error::Trace)?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Trace(format!("cannot read {}: {e}", path.display())))?;
    let mut trace = fleetsim::parse_trace(&text).map_err(Error::Trace)?;
    if let Some(n) = a.requests {
        trace.truncate(n as usize);
    }
    let sim = simulate_and_tell(&trace, config, a.measure.quiet)?;
    let times = lookup_times(&trace);
    let conns = trace_connections(&a.conn).await?;
    if !t.no_policy {
        install_trace_policy(t).await?;
    }
    let cfg = ReplayConfig {
        scope: TraceScope::new(&a.workload.hash_scheme, config.tokens_per_block()),
        pace,
        inflight,
        rpc_timeout: Duration::from_millis(a.conn.rpc_timeout_ms.max(1)),
        budgets: a.measure.budgets()?,
        duration,
        progress: !a.measure.quiet,
    };
    let done = Replay::new(&sim, &times, &cfg, &conns)
        .run(crate::run::ctrl_c_flag())
        .await;
    let facts = ReportFacts {
        target: crate::run::normalize_addr(&a.conn.addr),
        trace: path.display().to_string(),
        pace: match pace {
            Pace::Speed(s) => format!("speed {s}"),
            Pace::AsFastAsPossible => format!("as fast as possible, {inflight} in flight"),
        },
        paced: matches!(pace, Pace::Speed(_)),
    };
    let report = build_report(&sim, facts, done);
    let json = serde_json::to_string_pretty(&report).expect("the trace report is serializable");
    crate::run::emit(&a.measure, &json, || report.to_table())?;
    if report.complete_and_exact() {
        Ok(())
    } else {
        Err(Error::Trace(format!(
            "{} mismatches, {} / {} events and {} / {} lookups answered{}",
            report.mismatches,
            report.events_sent,
            report.events,
            report.lookups_sent,
            report.lookups,
            report
                .stopped_early
                .as_ref()
                .map(|w| format!(", stopped early: {w}"))
                .unwrap_or_default()
        )))
    }
}

/// Runs the simulation, says what it produced (unless quiet) and warns when the fleet holds more
/// than the server's default cap.
fn simulate_and_tell(
    trace: &[fleetsim::TraceRequest],
    config: SimConfig,
    quiet: bool,
) -> Result<fleetsim::Simulation, Error> {
    let t0 = Instant::now();
    let sim = fleetsim::simulate(trace, config).map_err(Error::Trace)?;
    if !quiet {
        eprintln!(
            "simulated {} requests in {:.1} s: {} events ({} blocks stored, {} removed), {} lookups, peak {} blocks held",
            trace.len(),
            t0.elapsed().as_secs_f64(),
            sim.events.len(),
            sim.stored_blocks,
            sim.removed_blocks,
            sim.lookups.len(),
            sim.peak_holds
        );
    }
    if sim.peak_holds > SERVER_DEFAULT_MAX_ENTRIES {
        eprintln!(
            "loadgen: warning: the fleet holds up to {} blocks, over the server's default cap of {SERVER_DEFAULT_MAX_ENTRIES} entries: run the server with --index-max-entries 0 or its evictions show as mismatches",
            sim.peak_holds
        );
    }
    Ok(sim)
}

/// Pushes the replay's policy (no floors, no affinity, a long TTL) so answers can be checked
/// exactly.
async fn install_trace_policy(t: &crate::cli::TraceArgs) -> Result<(), Error> {
    let token = match &t.policy_token_file {
        Some(p) => Some(std::fs::read_to_string(p).map_err(|e| {
            Error::Trace(format!(
                "cannot read --policy-token-file {}: {e}",
                p.display()
            ))
        })?),
        None => None,
    };
    push_policy(
        &t.policy_addr,
        token.as_deref(),
        &policy_body(TRACE_TENANT, TRACE_POLICY_TTL),
    )
    .await
    .map_err(Error::Trace)
}

/// `--speed`: paced at that factor, or as fast as possible without it.
pub fn trace_pace(speed: Option<f64>) -> Result<Pace, ConfigError> {
    match speed {
        None => Ok(Pace::AsFastAsPossible),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Pace::Speed(s)),
        Some(_) => Err(ConfigError::NotPositive("--speed")),
    }
}

/// The replay's connections: tonic channels for everything, plus lean ones for lookups with
/// `--lookup-client lean`.
async fn trace_connections(conn: &crate::cli::ConnArgs) -> Result<Connections, Error> {
    let clients = crate::run::connect(&conn.addr, conn.connections).await?;
    let lean = match conn.lookup_client {
        crate::cli::LookupClient::Lean => {
            crate::run::connect_lean(&conn.addr, conn.connections).await?
        }
        crate::cli::LookupClient::Tonic => vec![],
    };
    Ok(Connections { clients, lean })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleetsim::hashes::{block_tokens, request_blocks};
    use inferencecache_proto::v1alpha1::ReplicaScore;

    fn scope(tpb: u32) -> TraceScope {
        TraceScope::new("vllm", tpb)
    }

    fn be(h: u64) -> Vec<u8> {
        h.to_be_bytes().to_vec()
    }

    fn answer(scores: &[(&str, i32)]) -> LookupRouteResponse {
        LookupRouteResponse {
            reason_code: "PREFIX_MATCH".into(),
            replica_scores: scores
                .iter()
                .map(|&(r, m)| ReplicaScore {
                    replica_id: r.into(),
                    matched_tokens: m,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_simulators_chain_hashes_are_the_contracts_rolling_prefix_hashes() {
        // What the server would compute from the blocks' tokens (docs/BEHAVIOUR.md §17) is what
        // the replay sends as keys, natively and expanded.
        for expand in [1, 32] {
            let tpb = 512 / expand;
            let blocks = request_blocks(&[7, 8], expand);
            let tokens: Vec<u32> = [7u64, 8]
                .iter()
                .flat_map(|&id| (0..expand).flat_map(move |p| block_tokens(id, p, tpb)))
                .collect();
            let (hashes, counts) = inferencecache_fingerprint::chain(&tokens, tpb as i32);
            let req = scope(tpb).lookup_request(&blocks);
            let sent: Vec<Vec<u8>> = req.block_hashes.iter().map(|h| h.to_vec()).collect();
            assert_eq!(sent, hashes);
            assert_eq!(req.block_token_counts, counts);
        }
    }

    #[test]
    fn a_stored_run_is_one_message_of_per_block_entries_with_cumulative_counts() {
        let request = request_blocks(&[7, 8, 9], 1);
        let depth = first_depth(&request, Some(request[0].chain)).unwrap();
        assert_eq!(depth, 1);
        let msg = scope(512).stored_update(3, depth, &request[1..]);
        assert_eq!(
            (
                msg.replica_id.as_str(),
                msg.tenant_id.as_str(),
                msg.model_id.as_str()
            ),
            ("worker-3", TRACE_TENANT, TRACE_MODEL)
        );
        assert_eq!(msg.hash_scheme, "vllm");
        let entries: Vec<(Vec<u8>, i32, i32)> = msg
            .prefixes
            .iter()
            .map(|p| (p.prefix_hash.clone(), p.token_count, p.tier))
            .collect();
        let t1 = CacheTier::T1 as i32;
        assert_eq!(
            entries,
            vec![
                (be(request[1].chain), 1024, t1),
                (be(request[2].chain), 1536, t1)
            ]
        );
        // Legacy form: no chain lists (they would restart the cumulative count at 0).
        assert!(msg.prefixes.iter().all(|p| p.block_hashes.is_empty()));
        assert_eq!(first_depth(&request, None), Some(0));
        assert_eq!(first_depth(&request, Some(12345)), None);
    }

    #[test]
    fn a_removal_is_one_prefix_evicted_event_per_block() {
        let evs = scope(16).removal_events(5, &[11, 12]);
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].r#type, cache_event::Type::PrefixEvicted as i32);
        assert_eq!(
            (evs[1].replica_id.as_str(), evs[1].tenant_id.as_str()),
            ("worker-5", TRACE_TENANT)
        );
        assert_eq!(evs[1].prefix_hash, be(12));
        assert_eq!(evs[1].adapter_id, "", "every adapter partition");
    }

    #[test]
    fn an_answer_reads_as_matched_blocks_per_worker() {
        let s = scope(16);
        let got = s
            .matched_blocks(&answer(&[
                ("worker-9", 48),
                ("worker-2", 160),
                ("worker-4", 0),
            ]))
            .unwrap();
        assert_eq!(got, vec![(2, 10), (9, 3)]);
        assert!(s.matched_blocks(&answer(&[("engine-1", 16)])).is_err());
        assert!(s.matched_blocks(&answer(&[("worker-1", 24)])).is_err());
        assert!(
            s.matched_blocks(&answer(&[("worker-1", 16), ("worker-1", 32)]))
                .is_err()
        );
        assert_eq!(worker_of(&replica_id(63)), Some(63));
    }

    #[test]
    fn compare_names_the_workers_that_differ() {
        let s = scope(512);
        let resp = answer(&[("worker-0", 1024), ("worker-1", 512)]);
        assert_eq!(compare(&s, &resp, &[(0, 2), (1, 1)], 2), Ok(()));
        let err = compare(&s, &resp, &[(0, 2), (1, 2), (3, 1)], 2).unwrap_err();
        assert!(
            err.contains("w1: truth 2 got 1") && err.contains("w3: truth 1 got 0"),
            "{err}"
        );
        assert!(!err.contains("w0"), "{err}");
    }

    #[test]
    fn steps_group_consecutive_lookups_and_events_in_order() {
        let ops = [
            Op::Lookup(0),
            Op::Event(0),
            Op::Event(1),
            Op::Lookup(1),
            Op::Lookup(2),
            Op::Event(2),
        ];
        assert_eq!(
            steps(&ops),
            vec![
                Step::Lookups(0..1),
                Step::Events(1..3),
                Step::Lookups(3..5),
                Step::Events(5..6)
            ]
        );
        assert!(steps(&[]).is_empty());
    }

    #[test]
    fn lookup_times_follow_the_simulators_lookups() {
        let text = fleetsim::synth::synthetic_trace(40, 3)
            + "{\"timestamp\": 999, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}\n";
        let trace = fleetsim::parse_trace(&text).unwrap();
        let sim = fleetsim::simulate(&trace, SimConfig::default()).unwrap();
        let times = lookup_times(&trace);
        assert_eq!(times.len(), sim.lookups.len());
        assert_eq!(times.len(), 40);
    }

    #[test]
    fn the_policy_turns_the_floors_and_affinity_off_for_the_trace_tenant() {
        let v: serde_json::Value =
            serde_json::from_str(&policy_body("t", Duration::from_secs(2))).unwrap();
        assert_eq!(v["version"], 7);
        let p = &v["policies"][0];
        assert_eq!(p["namespace"], "t");
        assert_eq!(p["evictionTTL"], 2_000_000_000i64);
        assert_eq!(p["routingFloorScore"], 0);
        assert_eq!(p["affinityRouting"], false);
        // Omitted in a v7 body = no matched-tokens floor once the tenant has a policy.
        assert!(p.get("minimumMatchedTokens").is_none());
    }

    #[test]
    fn pace_and_worker_bounds() {
        assert_eq!(trace_pace(None), Ok(Pace::AsFastAsPossible));
        assert_eq!(trace_pace(Some(2.0)), Ok(Pace::Speed(2.0)));
        assert!(trace_pace(Some(0.0)).is_err());
        assert!(sim_config(MAX_TRACE_WORKERS + 1, 10, 1).is_err());
        assert!(sim_config(0, 10, 1).is_err());
        assert_eq!(sim_config(64, 10, 32).unwrap().tokens_per_block(), 16);
    }
}
