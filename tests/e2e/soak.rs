//! The seeded adversarial soak (issue 30, item 5): against the real server, a hostile producer
//! mixes the shapes that once wedged a core or could (many adapters, hence keyspaces; many
//! names; many holders per key; ALL_CLEARED; policy churn) with a well-behaved client's normal
//! traffic, for a bounded time. Quiet windows (the well-behaved client alone) and hostile
//! windows (the producer beside it) alternate, so that both kinds see the same machine. Asserts:
//!
//! * no core's heartbeat tick ever came more than [`Bounds::heartbeat`] late
//!   (`inferencecache_core_heartbeat_max_lag_seconds`);
//! * the well-behaved client's LookupRoute p99 in the hostile windows stayed within
//!   [`Bounds::p99_ratio`] of its p99 in the quiet ones ([`assert_p99_bound`]: the strict bar
//!   where the test's threads are isolated from the server's, else at least a floor, and the
//!   test prints that the strict bar was skipped);
//! * the server's RSS stayed under [`Bounds::rss`];
//! * nothing acknowledged was lost: every key the well-behaved client reported (accepted) is
//!   still answered by a lookup at the end (the well-behaved entries are stamped as far ahead
//!   as the server accepts, two minutes, and the hostile ones a minute ago, so for three minutes
//!   the global cap legitimately evicts hostile entries first; nothing expires).
//!
//! The small version runs in the default `cargo test` (`--shards 1` and `2`, a few seconds
//! each); the long one is `#[ignore]`d and asserts the strict bar when isolated:
//! `perf/soak_isolated.sh` runs it with the server alone on CPU 0 and the test on CPU 1 (its
//! numbers: perf/runs/2026-12-07-soak-windows.md).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::*;

type Client = pb::inference_cache_client::InferenceCacheClient<tonic::transport::Channel>;

/// How long each window runs, the seed of the hostile mix, and the bounds asserted.
struct Soak {
    /// Quiet windows (the well-behaved client alone), each followed by a hostile window: the
    /// two kinds alternate so that both see the same machine (a single quiet run's p99 moved
    /// 0.21–0.61 ms from run to run on an isolated CPU; perf/runs/2026-12-07-maintenance-lane.md).
    pairs: usize,
    quiet: Duration,
    hostile: Duration,
    /// What [`by_window`] leaves out after each switch.
    settle: Duration,
    seed: u64,
    /// Distinct adapters per hostile message (its ingest is one step on the core, bounded by
    /// the message size, not sliced).
    adapters_per_message: u64,
    /// The global cap (`--index-max-entries`): the hostile producer keeps the index at it, so
    /// the cap evicts throughout.
    cap: &'static str,
    /// Where the producer runs when the test cannot keep it off the client's and the server's
    /// CPUs ([`Producer::choose`]).
    shared_producer: Producer,
    bounds: Bounds,
}

struct Bounds {
    heartbeat: Duration,
    p99_ratio: f64,
    /// The least p99 bound where the strict ratio is not asserted ([`assert_p99_bound`]).
    p99_floor: Duration,
    /// Whether the ratio alone is asserted when the test runs isolated from the server.
    strict_when_isolated: bool,
    rss: u64,
}

/// A small deterministic generator (xorshift64*), so a failing mix reproduces from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The well-behaved tenant's keys (one tenant per core, so every core serves some).
const GOOD_KEYS: usize = 64;
/// Tokens of each well-behaved prefix (at least the default floor a match must reach).
const GOOD_TOKENS: i32 = 64;
/// The global cap of the long version.
const CAP: &str = "20000";
/// The small version's cap: a debug build's producer sent 40–65 messages in 6 s (about
/// 450 entries each), which reached 20,000 entries only from about 45 sends (it failed at 40 and
/// 42, on a loaded machine); 10,000 is reached from about 22, and from about 5 once the index
/// is filled to [`PREFILL_HEADROOM`] below it (it failed once more at 4 test threads).
const SMALL_CAP: &str = "10000";

/// Where the hostile producer runs beside the well-behaved client (both share the test's CPUs).
/// It stands for another machine: it must take neither the measured client's CPU time nor the
/// server's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Producer {
    /// The well-behaved client at `SCHED_FIFO` (`run_ahead_of_normal_threads`) and the test on
    /// CPUs the server does not run on (`taskset`): the producer at the normal policy and full
    /// speed. The client preempts it at once when woken, so the attack keeps its volume and the
    /// client's latency is the server's.
    Normal,
    /// Otherwise (no real-time policy, or CPUs shared with the server): the producer at
    /// `SCHED_IDLE`, yielding after each message it builds, so it sends only what the CPUs
    /// leave. At full speed on the server's CPUs it took them from the server's cores
    /// (`--shards 2` unpinned: heartbeat lag 0.18–0.20 s, p99 68 ms;
    /// perf/runs/2026-12-06-hostile-volume.md).
    Background,
    /// The small version's choice where the long one takes [`Producer::Background`]: the normal
    /// policy, yielding after each message it builds. Its loose bounds (a couple of seconds)
    /// allow it, and at `SCHED_IDLE` a machine busy with other tests left the producer 6 sends
    /// in 6 s, too few for an attack (it failed the volume check 2 of 3 at 4 test threads).
    Shared,
}

impl Producer {
    /// [`Producer::Normal`] only if the well-behaved client got its real-time policy and no CPU
    /// of this test is one the server (`server_pid`) may run on.
    fn choose(client_is_real_time: bool, server_pid: u32, otherwise: Producer) -> Self {
        let server = allowed_cpus_of(server_pid);
        let shared = allowed_cpus_of(0).iter().any(|c| server.contains(c));
        if client_is_real_time && !shared {
            Self::Normal
        } else {
            otherwise
        }
    }

    /// Puts the calling producer thread where this arrangement wants it.
    fn enter(self) {
        match self {
            Self::Normal | Self::Shared => run_at_normal_priority(),
            Self::Background => run_in_background(),
        }
    }

    /// After each message built: gives way to the measured client if it cannot preempt.
    fn give_way(self) {
        if self != Self::Normal {
            give_way();
        }
    }
}

fn good_hash(i: usize) -> Vec<u8> {
    format!("good-{i:04}").into_bytes()
}

/// One LookupRoute of the well-behaved client: when it was sent, and how long its answer took.
type Sample = (Instant, Duration);

/// Lookups of the well-behaved client until `stop`, one every 2 ms, each with a 2 s deadline:
/// when each was sent and its latency (a failed or unanswered lookup fails the test).
async fn well_behaved(mut c: Client, tenants: Vec<String>, stop: Arc<AtomicBool>) -> Vec<Sample> {
    let mut lat = Vec::new();
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) && lat.len() < 1_000_000 {
        let tenant = &tenants[i % tenants.len()];
        let hash = good_hash(i % GOOD_KEYS);
        let mut req = tonic::Request::new(exact_lookup(tenant, "m", "vllm", &hash, GOOD_TOKENS));
        req.set_timeout(Duration::from_secs(2));
        let started = Instant::now();
        let r = c.lookup_route(req).await;
        lat.push((started, started.elapsed()));
        let r = r.unwrap_or_else(|e| panic!("lookup {i}: {e}")).into_inner();
        assert!(
            r.replica_scores
                .iter()
                .any(|s| s.replica_id == "good" && s.matched_tokens == GOOD_TOKENS),
            "lookup {i} of {tenant} after {:?}: {r:?}",
            started.elapsed()
        );
        i += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    lat
}

fn p99(lat: &mut [Duration]) -> Duration {
    lat.sort();
    assert!(
        lat.len() >= 50,
        "{} lookups, p50 {:?}",
        lat.len(),
        lat.get(lat.len() / 2)
    );
    lat[lat.len() * 99 / 100]
}

/// One prefix under its own adapter.
fn adapter_prefix(i: u64) -> pb::PrefixEntry {
    pb::PrefixEntry {
        prefix_hash: i.to_be_bytes().to_vec(),
        token_count: 16,
        adapter_id: format!("adapter-{i:010}"),
        ..Default::default()
    }
}

/// Messages and events the hostile producer sends at least (the last hostile window grows until
/// it has, within bounds): fewer would be no attack. Counted one per message (a stream of four
/// counts four; until 2026-12-07 it counted one, and a debug producer beside three other tests
/// sent 17–23 such streams in 30 s).
const MIN_HOSTILE_SENDS: u64 = 21;

/// Entries the index is filled to below its cap before the quiet run ([`prefill_below_cap`]).
const PREFILL_HEADROOM: u64 = 2_000;

/// Fills the index to [`PREFILL_HEADROOM`] entries below `cap` with a filler tenant's entries,
/// stamped two minutes ago (the cap evicts them first), in messages of 2,000 prefixes: the
/// hostile producer's first few messages then take the index to its cap however slowly a
/// loaded machine lets the producer send (a debug build's producer once sent too few to reach
/// it in the small version's 6 s).
async fn prefill_below_cap(c: &mut Client, cap: u64) {
    const PER_MESSAGE: u64 = 2_000;
    let ts = now_us() - 120_000_000;
    let total = cap.saturating_sub(PREFILL_HEADROOM);
    for first in (0..total).step_by(PER_MESSAGE as usize) {
        let u = pb::CacheStateUpdate {
            tenant_id: "filler".into(),
            model_id: "m".into(),
            replica_id: "f0".into(),
            hash_scheme: "vllm".into(),
            timestamp_us: ts,
            prefixes: (first..(first + PER_MESSAGE).min(total))
                .map(|i| pb::PrefixEntry {
                    prefix_hash: (u64::MAX - i).to_be_bytes().to_vec(),
                    token_count: 16,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let ack = report(c, vec![u]).await;
        assert!(ack.accepted, "{ack:?}");
    }
}

/// One hostile message: the seed picks among many adapters (`adapters` new keyspaces), a new replica
/// name with new model names, and one of 1,024 replicas holding the same 16 keys. Stamped a
/// minute ago, so the cap evicts these before the well-behaved entries.
fn hostile_update(rng: &mut Rng, n: u64, adapters: u64) -> pb::CacheStateUpdate {
    let ts = now_us() - 60_000_000;
    let mut u = pb::CacheStateUpdate {
        tenant_id: format!("hostile-{}", rng.below(4)),
        model_id: "m".into(),
        replica_id: "r0".into(),
        hash_scheme: "vllm".into(),
        timestamp_us: ts,
        ..Default::default()
    };
    match rng.below(3) {
        0 => {
            // Distinct adapters: keyspaces until KEYSPACES_FULL, then a fresh model.
            u.model_id = format!("m{}", n / 8);
            u.prefixes = (0..adapters)
                .map(|i| adapter_prefix(n * adapters + i))
                .collect();
        }
        1 => {
            // New names: a replica, a model.
            u.replica_id = format!("name-{n:08}");
            u.model_id = format!("model-{n:08}");
            u.prefixes = (0..64)
                .map(|i| pb::PrefixEntry {
                    prefix_hash: (n * 64 + i).to_be_bytes().to_vec(),
                    token_count: 16,
                    ..Default::default()
                })
                .collect();
        }
        _ => {
            // Many holders of the same keys.
            u.replica_id = format!("holder-{}", rng.below(1024));
            u.prefixes = (0..16u64)
                .map(|i| pb::PrefixEntry {
                    prefix_hash: format!("held-{i}").into_bytes(),
                    token_count: 16,
                    ..Default::default()
                })
                .collect();
            u.stats = Some(pb::ReplicaStats {
                hit_rate: 0.5,
                ..Default::default()
            });
        }
    }
    u
}

/// How the test steers the hostile producer from outside its thread.
#[derive(Clone, Default)]
struct Switches {
    /// Set once: the producer returns.
    stop: Arc<AtomicBool>,
    /// Whether the producer sends now (a hostile window) or waits (a quiet one).
    active: Arc<AtomicBool>,
    /// Messages and events sent so far.
    sends: Arc<AtomicU64>,
}

impl Switches {
    /// Until `stop`, whether to send now; waits a little first when not.
    fn sending(&self) -> bool {
        let active = self.active.load(Ordering::Relaxed);
        if !active {
            std::thread::sleep(Duration::from_millis(5));
        }
        active
    }
}

/// The hostile producer until `stop`, sending while `active`: streams of hostile messages,
/// ALL_CLEARED of hostile replicas, and (on a thread of its own) policy pushes flipping the
/// hostile tenants between LRU and LFU. Returns the messages and events sent (also counted in
/// `sends` as it goes).
async fn hostile(
    mut c: Client,
    admin_port: u16,
    (seed, adapters): (u64, u64),
    switches: Switches,
    producer: Producer,
) -> u64 {
    let Switches { stop, sends, .. } = switches.clone();
    let pushes = Arc::new(AtomicU64::new(0));
    let policy = {
        let (switches, pushes) = (switches.clone(), pushes.clone());
        std::thread::spawn(move || {
            producer.enter();
            let mut flip = false;
            while !switches.stop.load(Ordering::Relaxed) && pushes.load(Ordering::Relaxed) < 100_000
            {
                if !switches.sending() {
                    continue;
                }
                flip = !flip;
                let algo = if flip { "lfu" } else { "lru" };
                let body = format!(
                    r#"{{"version":7,"policies":[{}]}}"#,
                    (0..4)
                        .map(|t| format!(r#"{{"namespace":"hostile-{t}","eviction":"{algo}"}}"#))
                        .collect::<Vec<_>>()
                        .join(",")
                );
                let r = http_request(
                    admin_port,
                    "POST",
                    "/policy",
                    &[("Content-Type", "application/json")],
                    body.as_bytes(),
                );
                assert_eq!(r.map(|(s, _)| s).ok(), Some(204), "POST /policy");
                pushes.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let mut rng = Rng(seed);
    // Rounds (an event, or a stream of four messages) and what they sent.
    let (mut n, mut sent) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) && n < 1_000_000 {
        if !switches.active.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        if rng.below(8) == 0 {
            let e = pb::CacheEvent {
                r#type: pb::cache_event::Type::AllCleared as i32,
                tenant_id: format!("hostile-{}", rng.below(4)),
                model_id: "m".into(),
                replica_id: format!("holder-{}", rng.below(1024)),
                timestamp_us: now_us(),
                ..Default::default()
            };
            c.publish_event(e).await.expect("PublishEvent");
            sent += 1;
        } else {
            // Each message built gives way to the well-behaved client if it must (`give_way`).
            let batch: Vec<_> = (0..4)
                .map(|i| {
                    let update = hostile_update(&mut rng, n * 4 + i, adapters);
                    producer.give_way();
                    update
                })
                .collect();
            // Refusals (KEYSPACES_FULL, KEY_HOLDERS_FULL, STATS_ROWS_FULL) are answers too.
            let messages = batch.len() as u64;
            c.report_cache_state(tokio_stream::iter(batch))
                .await
                .expect("ReportCacheState");
            sent += messages;
        }
        producer.give_way();
        n += 1;
        sends.store(sent, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    policy.join().expect("policy thread");
    assert!(pushes.load(Ordering::Relaxed) > 0, "no policy push");
    sent
}

/// [`well_behaved`] on a thread and runtime of its own: one thread, so that its latencies are
/// not its own runtime's threads waiting for each other on a CPU they share (measured: in the
/// test's two-worker runtime under `taskset`, its wake-ups waited up to 4–7 ms behind the other
/// worker; perf/runs/2026-12-06-quiet-client-p99.md). The thread runs at `SCHED_FIFO` if the
/// process may (returned: whether it does), else at the normal policy.
fn well_behaved_on_its_thread(
    url: String,
    tenants: Vec<String>,
    stop: Arc<AtomicBool>,
) -> (std::thread::JoinHandle<Vec<Sample>>, bool) {
    let (granted, policy) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let _ = granted.send(run_ahead_of_normal_threads());
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the well-behaved client's runtime")
            .block_on(async move { well_behaved(connect(url).await, tenants, stop).await })
    });
    let real_time = policy.recv().expect("the well-behaved client's policy");
    (thread, real_time)
}

/// A client of the gRPC port at `url` (one HTTP/2 connection).
async fn connect(url: String) -> Client {
    let channel = tonic::transport::Channel::from_shared(url)
        .expect("grpc url")
        .connect()
        .await
        .expect("connect");
    Client::new(channel)
}

/// Joins a client thread without blocking the test's runtime.
async fn joined<T: Send + 'static>(thread: std::thread::JoinHandle<T>) -> std::thread::Result<T> {
    tokio::task::spawn_blocking(move || thread.join())
        .await
        .expect("joined")
}

/// [`hostile`] on a thread and runtime of its own, placed by `producer` as if on another
/// machine: in the well-behaved client's runtime, or at a nice value beside it at the same
/// policy, the hostile producer's message building delayed the well-behaved client itself,
/// which is not what the soak measures; at `SCHED_IDLE` (no real-time client) it sends only
/// what the machine's other processes leave it (384–762 sends in 60 s instead of ≈ 1,800,
/// perf/runs/2026-12-06-quiet-client-p99.md).
fn hostile_on_its_thread(
    url: String,
    admin_port: u16,
    mix: (u64, u64),
    switches: Switches,
    producer: Producer,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        producer.enter();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the hostile producer's runtime")
            .block_on(async move {
                let c = connect(url).await;
                hostile(c, admin_port, mix, switches, producer).await
            })
    })
}

/// The most any core's heartbeat came late since start, per core.
fn heartbeat_lags(srv: &Server) -> Vec<f64> {
    let text = metrics_text(srv);
    (0..srv.shards)
        .map(|core| {
            let series =
                format!("inferencecache_core_heartbeat_max_lag_seconds{{core=\"{core}\"}}");
            metric_value(&text, &series).unwrap_or_else(|| panic!("{series} missing"))
        })
        .collect()
}

/// Which kind of window a lookup was sent in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Window {
    Quiet,
    Hostile,
}

/// The well-behaved client's latencies, quiet windows' and hostile windows', given when each
/// window started. A lookup sent within `settle` of a window's start counts in neither: a hostile
/// message sent just before a quiet window is still being ingested, and its cap evictions run,
/// at the window's start.
fn by_window(
    samples: &[Sample],
    windows: &[(Instant, Window)],
    settle: Duration,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut quiet, mut hostile) = (Vec::new(), Vec::new());
    for &(sent, latency) in samples {
        let Some(&(start, window)) = windows.iter().rev().find(|(start, _)| *start <= sent) else {
            continue;
        };
        if sent.duration_since(start) < settle {
            continue;
        }
        match window {
            Window::Quiet => quiet.push(latency),
            Window::Hostile => hostile.push(latency),
        }
    }
    (quiet, hostile)
}

/// Sleeps `window` in 100 ms steps, sampling the server's RSS: the highest seen. With
/// `more_sends` (the last hostile window), on until the producer sent [`MIN_HOSTILE_SENDS`] in
/// all, for at most five times all the hostile windows' time: a loaded machine slows its round
/// trips (a debug producer beside three other tests once sent fewer than 21 in 2 × 3 s).
async fn watch(srv: &Server, window: Duration, more_sends: Option<(&AtomicU64, Duration)>) -> u64 {
    let started = Instant::now();
    let mut max_rss = 0;
    let longest = more_sends.map_or(window, |(_, longest)| longest.max(window));
    loop {
        let elapsed = started.elapsed();
        let enough = more_sends.is_none_or(|(s, _)| s.load(Ordering::Relaxed) >= MIN_HOSTILE_SENDS);
        if (elapsed >= window && enough) || elapsed >= longest {
            return max_rss;
        }
        max_rss = max_rss.max(rss_bytes(srv.child.id()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn soak(shards: usize, s: Soak) {
    let srv = Server::start(
        shards,
        &["--index-max-entries", s.cap, "--sweep-interval-ms", "500"],
    );
    // The well-behaved tenant, one per core, all keys acknowledged.
    let tenants = tenants_per_core("good", "m", shards);
    let mut c = srv.client().await;
    for t in &tenants {
        let updates = (0..GOOD_KEYS)
            .map(|i| {
                let mut u = legacy_update("good", t, "m", "vllm", &good_hash(i), GOOD_TOKENS);
                u.timestamp_us = fresh_ts();
                u
            })
            .collect();
        let ack = report(&mut c, updates).await;
        assert!(ack.accepted, "{ack:?}");
    }
    prefill_below_cap(&mut c, s.cap.parse().expect("cap")).await;
    // The well-behaved client throughout; the hostile producer only in the hostile windows.
    let stop = Arc::new(AtomicBool::new(false));
    let (good, real_time) =
        well_behaved_on_its_thread(srv.grpc_url(), tenants.clone(), stop.clone());
    let producer = Producer::choose(real_time, srv.child.id(), s.shared_producer);
    let switches = Switches::default();
    let bad = hostile_on_its_thread(
        srv.grpc_url(),
        srv.admin_port,
        (s.seed, s.adapters_per_message),
        switches.clone(),
        producer,
    );
    let mut windows = Vec::new();
    let mut max_rss = 0;
    let mut quiet_lags = Vec::new();
    // The heartbeat gauge (a maximum since start) after each window: where a late tick was.
    let mut lags_after = Vec::new();
    for pair in 0..s.pairs {
        switches.active.store(false, Ordering::Relaxed);
        windows.push((Instant::now(), Window::Quiet));
        max_rss = max_rss.max(watch(&srv, s.quiet, None).await);
        lags_after.push(heartbeat_lags(&srv));
        if pair == 0 {
            // The heartbeat lag with the well-behaved client alone: what this machine's other
            // processes cost the core thread.
            quiet_lags = heartbeat_lags(&srv);
        }
        switches.active.store(true, Ordering::Relaxed);
        windows.push((Instant::now(), Window::Hostile));
        let last = pair + 1 == s.pairs;
        let longest = s.hostile * 5 * s.pairs as u32;
        let more_sends = last.then_some((&*switches.sends, longest));
        max_rss = max_rss.max(watch(&srv, s.hostile, more_sends).await);
        lags_after.push(heartbeat_lags(&srv));
    }
    switches.stop.store(true, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let samples = joined(good).await.expect("well-behaved client");
    let sent = joined(bad).await.expect("hostile client");
    let (mut quiet, mut loaded) = by_window(&samples, &windows, s.settle);
    let (quiet_p99, loaded_p99) = (p99(&mut quiet), p99(&mut loaded));
    let (quiet_max, loaded_max) = (quiet[quiet.len() - 1], loaded[loaded.len() - 1]);
    max_rss = max_rss.max(rss_bytes(srv.child.id()));
    let lags = heartbeat_lags(&srv);
    let text = metrics_text(&srv);
    let evicted = metric_value(
        &text,
        "inferencecache_index_evictions_total{algorithm=\"lru\",reason=\"cap\"}",
    )
    .unwrap_or(0.0)
        + metric_value(
            &text,
            "inferencecache_index_evictions_total{algorithm=\"lfu\",reason=\"cap\"}",
        )
        .unwrap_or(0.0);
    let sync: f64 = (0..shards)
        .filter_map(|core| {
            let series = format!("inferencecache_core_cap_builds_sync_total{{core=\"{core}\"}}");
            metric_value(&text, &series)
        })
        .sum();
    eprintln!(
        "soak --shards {shards} seed {}: {} quiet and hostile windows, {sent} hostile sends \
         ({producer:?}), {evicted} cap evictions, {sync} cap builds on an ingest; \
         quiet p99 {quiet_p99:?} ({} lookups, max {quiet_max:?}), hostile p99 {loaded_p99:?} \
         ({} lookups, max {loaded_max:?}): {:.2}x; heartbeat max lag per core \
         {quiet_lags:?} s quiet, {lags:?} s in all (after each window: {lags_after:?}); \
         max RSS {} MiB",
        s.seed,
        s.pairs,
        quiet.len(),
        loaded.len(),
        loaded_p99.as_secs_f64() / quiet_p99.as_secs_f64(),
        max_rss >> 20
    );
    assert!(
        sent >= MIN_HOSTILE_SENDS,
        "the hostile producer sent {sent}"
    );
    assert!(evicted > 0.0, "the hostile producer never reached the cap");
    for (core, lag) in lags.iter().enumerate() {
        assert!(
            *lag <= s.bounds.heartbeat.as_secs_f64(),
            "core {core}'s heartbeat came {lag} s late"
        );
    }
    assert_p99_bound(shards, &s.bounds, producer, (quiet_p99, loaded_p99));
    assert!(max_rss <= s.bounds.rss, "RSS {} MiB", max_rss >> 20);
    // Nothing acknowledged was lost.
    for t in &tenants {
        for i in 0..GOOD_KEYS {
            let r = lookup(
                &mut c,
                exact_lookup(t, "m", "vllm", &good_hash(i), GOOD_TOKENS),
            )
            .await;
            assert!(
                r.replica_scores
                    .iter()
                    .any(|s| s.replica_id == "good" && s.matched_tokens == GOOD_TOKENS),
                "{t} key {i} lost: {r:?}"
            );
        }
    }
}

/// The p99 bar: within `p99_ratio` of the quiet windows' p99. Asserted as is only where the
/// measurement is the server's ([`Bounds::strict_when_isolated`] and the producer isolated from
/// the client and the server, [`Producer::Normal`]); elsewhere the test's own threads share the
/// server's CPUs, so it asserts the floor too and says that the strict bar was skipped.
fn assert_p99_bound(
    shards: usize,
    b: &Bounds,
    producer: Producer,
    (quiet, loaded): (Duration, Duration),
) {
    let strict = b.strict_when_isolated && producer == Producer::Normal;
    let ratio_bound = quiet.mul_f64(b.p99_ratio);
    let bound = if strict {
        ratio_bound
    } else {
        ratio_bound.max(b.p99_floor)
    };
    if !strict {
        eprintln!(
            "soak --shards {shards}: SKIPPED the strict p99 bar ({}x the quiet windows' p99): \
             the test's clients share CPUs with the server or may not run at SCHED_FIFO; \
             asserted at least the floor {:?} instead",
            b.p99_ratio, b.p99_floor
        );
    }
    assert!(
        loaded <= bound,
        "p99 {loaded:?} in the hostile windows vs {quiet:?} in the quiet ones (bound {bound:?})"
    );
}

/// The small version (default test run, a debug build on a shared 2-CPU machine): it guards
/// against a wedge (a core stalled for seconds, lookups hanging, lost entries), not the issue's
/// tight bounds. A debug build takes 10–50 ms for one hostile message's ingest (one step, not
/// sliced), and the machine's other processes delay the core thread by as much (measured:
/// heartbeat lag 0.1–0.4 s, p99 0.15–0.8 s under the mix, quiet p99 4–37 ms): so 2 s of
/// heartbeat lag (a stall is 5 s) and a p99 floor of 2 s (the lookups' deadline), never the
/// strict ratio. The long version asserts the issue's bounds.
async fn soak_small(shards: usize) {
    soak(
        shards,
        Soak {
            pairs: 2,
            quiet: Duration::from_secs(1),
            hostile: Duration::from_secs(3),
            settle: Duration::from_millis(250),
            seed: 0x5eed_0030 + shards as u64,
            adapters_per_message: 256,
            cap: SMALL_CAP,
            shared_producer: Producer::Shared,
            bounds: Bounds {
                heartbeat: Duration::from_secs(2),
                p99_ratio: 2.0,
                p99_floor: Duration::from_secs(2),
                strict_when_isolated: false,
                rss: 1 << 30,
            },
        },
    )
    .await
}
shards_1_and_2!(soak_small);

/// The long version: six pairs of a 5 s quiet window and a 10 s hostile one (60 s of the
/// hostile mix), messages of 4,096 adapters (the issue's shape); run against a release build
/// (`INFERENCECACHE_TEST_SERVER_BIN`). Isolated (`perf/soak_isolated.sh`) it asserts the
/// issue's 2×; otherwise a floor of a couple of scheduler quanta of this shared machine, where
/// the test's clients compete with the server for the two CPUs.
async fn soak_long(shards: usize) {
    soak(
        shards,
        Soak {
            pairs: 6,
            quiet: Duration::from_secs(5),
            hostile: Duration::from_secs(10),
            settle: Duration::from_millis(500),
            seed: 0x5eed_1030 + shards as u64,
            adapters_per_message: 4096,
            cap: CAP,
            shared_producer: Producer::Background,
            bounds: Bounds {
                heartbeat: Duration::from_millis(100),
                p99_ratio: 2.0,
                p99_floor: Duration::from_millis(20),
                strict_when_isolated: true,
                rss: 1 << 30,
            },
        },
    )
    .await
}

mod soak_long {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "60 s per shard count: run on a release build (see the module docs)"]
    async fn shards_1() {
        super::soak_long(1).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "60 s per shard count: run on a release build (see the module docs)"]
    async fn shards_2() {
        super::soak_long(2).await
    }
}
