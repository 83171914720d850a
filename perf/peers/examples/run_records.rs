//! The run-record layout (perf/runs/2026-12-07-run-census.md), measured beside ours and
//! kv-index on the same streams: `inferencecache_index::runstore::RunStore` (the store the
//! index keeps its prefix map in, here without the index around it) holds the events, and this
//! example computes ours' chain answer from its walk. Only what this trace's events carry (one
//! tenant, model and keyspace; no TTL sweep, cap, quota, LFU, persistence or stats).
//!
//! The layout: a held chain's blocks are appended to one *run*, a vector of their 8-byte chain
//! hashes, as long as each new block follows the run's last one; a block whose predecessor is
//! not a run's last block goes to a short run shared by such blocks, or starts a new run. A holder is an *extent* of a run: a replica, the
//! offsets it holds (one stretch from one store event), its tier and its `last_seen`. A table maps
//! each held chain hash to its (run, offset). A lookup finds its first block in the table and
//! compares the request's hashes along the run; only where the run ends or the request leaves it
//! does it probe the table again, and the holders are visited once per run, as extents, not per
//! block. A removal shrinks or splits its holder's extent, and a run's tail that no extent
//! covers any more is cut off.
//!
//! The answer is ours' chain answer computed from the extents: per replica its matched blocks
//! (contiguous from block 0), the request's tokens over them, the oldest `last_seen` and the
//! worst tier; the §9 score with freshness, depth-aware distinguishing power over the replicas
//! serving, ordered by score then replica name. `VERIFY=1` runs ours beside it over the mixed
//! stream and compares every answer in full (replicas in order, score bits, matched tokens).
//!
//!     cargo run --release --example run_records -- TRACE [ROUNDS=3]
//!
//! `WORKERS=n` and `EXPAND=e` change the fleet (speed: workers / 64, as run.sh's default);
//! `WARM=1` times each lookup after an untimed run of the same lookup. Each
//! round runs the run store, ours and kv-index one after another (events alone, then the mixed
//! stream) on the pinned core; medians over rounds.
#[allow(dead_code)]
#[path = "../src/adapters.rs"]
mod adapters;
#[allow(dead_code)]
#[path = "../src/alloc.rs"]
mod alloc;
#[path = "../src/fleet_env.rs"]
mod fleet_env;
#[path = "../src/server_alloc.rs"]
mod server_alloc;

/// Counting, on top of the server's allocator (see `alloc`).
#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

use fleetsim::{Adapter, Block, Op, Simulation, parse_trace, simulate};
use inferencecache_index::index::ranking::{self, RankerConfig};
use inferencecache_index::runstore::{Entry, Hint, RunStore, Upserted, WalkScratch};
use std::time::Instant;

/// The simulation's time 0 and the TTL, as ours' adapter has them.
const EPOCH_NS: i64 = 1_800_000_000_000_000_000;
const TTL_NS: i64 = 24 * 3600 * 1_000_000_000;

/// How many blocks ahead of the one it works on a store or removal starts loading buckets.
const AHEAD: usize = 16;

/// The one keyspace this harness stores in.
const KS: u32 = 0;

/// One answered replica.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Answer {
    replica: u32,
    score: f32,
    matched_tokens: i32,
}

struct RunIndex {
    store: RunStore,
    /// Entries per replica (a replica with any serves in the scope: the depth power's total).
    entries_of: Vec<u32>,
    serving: usize,
    /// replica → its name's rank among all replicas' names ("w0" < "w1" < "w10" …).
    rank: Vec<u32>,
    tokens_per_block: i32,
    now: i64,
    ranker: RankerConfig,
    walk: WalkScratch,
    answer: Vec<Answer>,
    groups: Vec<(i32, u32)>,
    /// [`RunIndex::order`]: (descending score key, count then stretch start) per class, each
    /// answer's class, a bit per name rank, each replica's answer, the ordered answer.
    keys: Vec<u64>,
    index_of: Vec<u32>,
    ordered: Vec<Answer>,
    /// rank → replica.
    by_rank: Vec<u32>,
}

impl RunIndex {
    fn new(workers: u32, tokens_per_block: u32) -> RunIndex {
        let mut names: Vec<(String, u32)> = (0..workers).map(|w| (format!("w{w}"), w)).collect();
        names.sort();
        let mut rank = vec![0; workers as usize];
        for (i, (_, w)) in names.iter().enumerate() {
            rank[*w as usize] = i as u32;
        }
        RunIndex {
            store: RunStore::new(),
            entries_of: vec![0; workers as usize],
            serving: 0,
            rank,
            tokens_per_block: tokens_per_block as i32,
            now: EPOCH_NS,
            ranker: RankerConfig::default(),
            walk: WalkScratch::default(),
            answer: Vec::new(),
            groups: Vec::new(),
            keys: Vec::new(),
            index_of: vec![0; workers as usize],
            ordered: Vec::new(),
            by_rank: names.iter().map(|(_, w)| *w).collect(),
        }
    }

    /// One entry more (`delta` 1) or less (-1) for `replica`.
    fn count_entry(&mut self, replica: u32, delta: i32) {
        let n = &mut self.entries_of[replica as usize];
        let before = *n;
        *n = (*n as i32 + delta) as u32;
        match (before, *n) {
            (0, 1..) => self.serving += 1,
            (1.., 0) => self.serving -= 1,
            _ => {}
        }
    }

    /// The chain answer for `blocks` into `self.answer`.
    #[inline(never)]
    fn lookup_answer(&mut self, blocks: &[Block], tokens_per_block: i32) {
        self.answer.clear();
        self.store.walk(
            KS,
            chain_words(blocks),
            1,
            2,
            ranking::worst_tier,
            &mut self.walk,
        );
        self.score(tokens_per_block);
    }

    /// The §9 scores of the touched replicas, depth power, then score order (ties by name).
    #[inline(never)]
    fn score(&mut self, tokens_per_block: i32) {
        let coeff = self.ranker.slo_coeff(0);
        // The last (blocks, oldest) scored and its score: a shared prefix's holders mostly
        // match as far and were stored at few moments.
        let mut last: Option<(u32, i64, f32)> = None;
        for m in &self.walk.matched {
            let r = m.replica;
            if m.blocks == 0 {
                continue;
            }
            let tokens = (m.blocks as i32).wrapping_mul(tokens_per_block);
            if tokens <= 0 {
                continue;
            }
            let score = match last {
                Some((b, o, score)) if b == m.blocks && o == m.oldest => score,
                _ => {
                    let fresh = ranking::freshness(self.now, m.oldest, TTL_NS);
                    if fresh <= 0.0 {
                        continue;
                    }
                    let score = self
                        .ranker
                        .prefix_score(i64::from(tokens), fresh, 0.0, coeff);
                    last = Some((m.blocks, m.oldest, score));
                    score
                }
            };
            self.answer.push(Answer {
                replica: r,
                score,
                matched_tokens: tokens,
            });
        }
        // Depth power (§9.5): each group of equal matched tokens by the number of replicas
        // matching at least as much (`right`) among those serving.
        self.groups.clear();
        for a in &self.answer {
            match self.groups.iter_mut().find(|g| g.0 == a.matched_tokens) {
                Some(g) => g.1 += 1,
                None => self.groups.push((a.matched_tokens, 1)),
            }
        }
        self.groups.sort_unstable_by_key(|g| std::cmp::Reverse(g.0));
        let total = self.serving as i64;
        let mut right = 0;
        for g in &mut self.groups {
            right += g.1;
            g.1 = (ranking::distinguishing_power(i64::from(right), total) as f32).to_bits();
        }
        for a in &mut self.answer {
            let factor = self
                .groups
                .iter()
                .find(|g| g.0 == a.matched_tokens)
                .unwrap()
                .1;
            let factor = f32::from_bits(factor);
            if factor != 1.0 {
                a.score *= factor;
            }
        }
        self.order();
    }

    /// Orders the answer by score, descending, then by replica name: one sort of u64 keys
    /// (descending score, name rank). Tried first: the distinct scores as classes, placed by a
    /// bit set over the name ranks; on this trace's clock nearly every holder of a shared
    /// prefix has a score of its own, and that was slower (warm p50 1.22 against 1.01 µs).
    #[inline(never)]
    fn order(&mut self) {
        let descending = |score: f32| {
            let b = score.to_bits();
            !(if b >> 31 == 1 { !b } else { b | 1 << 31 })
        };
        // One u64 per answer, (descending score, name rank): sorting them is the order.
        self.keys.clear();
        for a in &self.answer {
            let rank = self.rank[a.replica as usize];
            self.keys
                .push(u64::from(descending(a.score)) << 32 | u64::from(rank));
        }
        self.keys.sort_unstable();
        for (k, a) in self.answer.iter().enumerate() {
            self.index_of[a.replica as usize] = k as u32;
        }
        self.ordered.clear();
        for &key in &self.keys {
            let replica = self.by_rank[(key as u32) as usize];
            self.ordered
                .push(self.answer[self.index_of[replica as usize] as usize]);
        }
        std::mem::swap(&mut self.answer, &mut self.ordered);
    }
}

impl Adapter for RunIndex {
    fn name(&self) -> String {
        "run records (runstore)".into()
    }
    fn clock(&mut self, at_us: u64) {
        self.now = EPOCH_NS + at_us as i64 * 1000;
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        let mut after = parent.and_then(|p| self.store.find(KS, p));
        let mut hint = Hint::default();
        for b in blocks.iter().take(AHEAD) {
            self.store.prefetch(KS, b.chain);
        }
        for (j, b) in blocks.iter().enumerate() {
            if let Some(ahead) = blocks.get(j + AHEAD) {
                self.store.prefetch(KS, ahead.chain);
            }
            let e = Entry {
                replica: worker,
                tier: ranking::TIER_T1,
                last_seen: self.now,
                tokens: (j as i32 + 1) * self.tokens_per_block,
            };
            let (loc, upserted) = (self.store.upsert(KS, b.chain, after, e, &mut hint))
                .expect("the trace fits the table");
            if upserted != Upserted::Refreshed {
                self.count_entry(worker, 1);
            }
            after = Some(loc);
        }
    }
    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        for h in chain_hashes.iter().take(AHEAD) {
            self.store.prefetch(KS, *h);
        }
        for (j, h) in chain_hashes.iter().enumerate() {
            if let Some(&ahead) = chain_hashes.get(j + AHEAD) {
                self.store.prefetch(KS, ahead);
            }
            if self.store.release(KS, *h, worker).is_some() {
                self.count_entry(worker, -1);
            }
        }
    }
    fn clear(&mut self, worker: u32) {
        // Not on this trace's path (the simulator emits no clears; the check asks for it once):
        // every key the worker holds, found through the runs' extents.
        let mut held = Vec::new();
        for id in 0..self.store.run_slots() {
            let run = self.store.run(id);
            for x in run.extents().iter().filter(|x| x.replica == worker) {
                held.extend((x.lo..x.hi).map(|off| run.hash_at(off)));
            }
        }
        self.remove(worker, &held);
    }
    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        out.clear();
        self.lookup_answer(blocks, self.tokens_per_block);
        let tpb = self.tokens_per_block;
        out.extend(
            self.answer
                .iter()
                .map(|a| (a.replica, (a.matched_tokens / tpb) as u32)),
        );
    }
}

/// The blocks as words: each block is two, `content` then `chain` (`Block` is `repr(C)`).
fn chain_words(blocks: &[Block]) -> &[u64] {
    const _: () = assert!(std::mem::size_of::<Block>() == 16);
    const _: () = assert!(std::mem::offset_of!(Block, chain) == 8);
    // SAFETY: `Block` is `repr(C)` of two u64 (asserted above): its slice is a valid `[u64]` of
    // twice the length, aligned, for the slice's lifetime.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u64>(), blocks.len() * 2) }
}

/// One index's figures in one round.
#[derive(Default, Clone)]
struct Figures {
    events_s: f64,
    bytes_per_hold: f64,
    mixed_ops_s: f64,
    lookups_s: f64,
    p50_us: f64,
    p99_us: f64,
}

fn measure(make: &dyn Fn() -> Box<dyn Adapter>, sim: &Simulation) -> Figures {
    let mut f = Figures::default();
    let base = alloc::current();
    alloc::reset_peak();
    let mut index = make();
    let t = Instant::now();
    for (e, &at) in sim.events.iter().zip(&sim.event_at_us) {
        index.clock(at);
        index.apply(e);
    }
    f.events_s = sim.events.len() as f64 / t.elapsed().as_secs_f64();
    f.bytes_per_hold = alloc::peak().saturating_sub(base) as f64 / sim.peak_holds.max(1) as f64;
    drop(index);
    let mut index = make();
    let mut out = Vec::new();
    let mut lat = Vec::with_capacity(sim.lookups.len());
    // `WARM=1`: each lookup runs once untimed first (what a lookup costs with its code and
    // data in the caches); the mixed ops/s then include those extra lookups.
    let warm = std::env::var_os("WARM").is_some_and(|v| v == "1");
    let t = Instant::now();
    for op in &sim.ops {
        match *op {
            Op::Event(e) => index.apply(&sim.events[e as usize]),
            Op::Lookup(l) => {
                let lookup = &sim.lookups[l as usize];
                index.clock(lookup.at_us);
                if warm {
                    index.lookup(&lookup.blocks, &mut out);
                }
                let s = Instant::now();
                index.lookup(&lookup.blocks, &mut out);
                lat.push(s.elapsed().as_nanos() as u64);
                std::hint::black_box(&out);
            }
        }
    }
    f.mixed_ops_s = sim.ops.len() as f64 / t.elapsed().as_secs_f64();
    f.lookups_s = lat.len() as f64 / (lat.iter().sum::<u64>().max(1) as f64 / 1e9);
    lat.sort_unstable();
    let q = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
    (f.p50_us, f.p99_us) = (q(0.5), q(0.99));
    f
}

/// `VERIFY=1`: ours and the run store over the mixed stream in lockstep, every answer compared
/// in full. Returns the number of lookups whose answers differ (the first few printed).
fn verify(sim: &Simulation, workers: u32, tpb: u32) -> usize {
    let mut ours = adapters::Ours::new(workers, tpb);
    let mut proto = RunIndex::new(workers, tpb);
    let mut differ = 0;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for op in &sim.ops {
        match *op {
            Op::Event(e) => {
                ours.apply(&sim.events[e as usize]);
                proto.apply(&sim.events[e as usize]);
            }
            Op::Lookup(l) => {
                let lookup = &sim.lookups[l as usize];
                ours.clock(lookup.at_us);
                proto.clock(lookup.at_us);
                ours.lookup_scores(&lookup.blocks, &mut a);
                proto.lookup_answer(&lookup.blocks, tpb as i32);
                b.clear();
                b.extend(
                    proto
                        .answer
                        .iter()
                        .map(|x| (x.replica, x.score.to_bits(), x.matched_tokens)),
                );
                if a != b {
                    if differ < 3 {
                        eprintln!("lookup {l}: ours {:?}\n  run store {:?}", a, b);
                    }
                    differ += 1;
                }
            }
        }
    }
    differ
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    server_alloc::configure();
    let a: Vec<String> = std::env::args().collect();
    let text = std::fs::read_to_string(&a[1]).expect("TRACE");
    let rounds: usize = a.get(2).map_or(3, |s| s.parse().expect("ROUNDS"));
    let config = fleet_env::config();
    let (workers, expand) = (config.workers, config.expand);
    let mut trace = parse_trace(&text).expect("trace");
    // `FIRST_REQUESTS=n`: the trace's first n requests only (for callgrind, with ROUNDS=0:
    // `--toggle-collect='*RunIndex*lookup_answer*'`).
    if let Ok(n) = std::env::var("FIRST_REQUESTS") {
        trace.truncate(n.parse().expect("FIRST_REQUESTS"));
    }
    let sim = simulate(&trace, config).expect("simulation");
    let tpb = config.tokens_per_block();
    if std::env::var_os("VERIFY").is_some_and(|v| v == "1") {
        let differ = verify(&sim, workers, tpb);
        println!(
            "verify: {differ} of {} answers differ from ours",
            sim.lookups.len()
        );
    }
    let mut proto = RunIndex::new(workers, tpb);
    for (e, &at) in sim.events.iter().zip(&sim.event_at_us) {
        proto.clock(at);
        proto.apply(e);
    }
    let holds = sim.final_holds.max(1) as f64;
    println!(
        "run store after the events: {:.1} heap bytes per held block ({} keys, {} entries)",
        proto.store.heap_bytes() as f64 / holds,
        proto.store.key_count(),
        proto.store.entry_count(),
    );
    let mut proto = RunIndex::new(workers, tpb);
    let report = fleetsim::check_stream(&sim, &mut proto, 3);
    println!(
        "run store: {} ground-truth mismatches of {} lookups {:?}",
        report.mismatches, report.lookups, report.first
    );
    if rounds == 0 {
        return;
    }
    adapters_pin();
    type Make = Box<dyn Fn() -> Box<dyn Adapter>>;
    let makes: [(&str, Make); 3] = [
        (
            "run records (runstore)",
            Box::new(move || Box::new(RunIndex::new(workers, tpb))),
        ),
        (
            "ours (Index)",
            Box::new(move || Box::new(adapters::Ours::new(workers, tpb))),
        ),
        (
            "kv-index ChainIndex",
            Box::new(move || Box::new(adapters::KvIndexChain::new(workers).expect("<= 1,024"))),
        ),
    ];
    // `ONLY=k`: the k-th index alone (0: the run store, 1: ours, 2: kv-index), for a profile.
    let only: Option<usize> = std::env::var("ONLY").ok().map(|k| k.parse().expect("ONLY"));
    let mut all: Vec<Vec<Figures>> = vec![Vec::new(); makes.len()];
    for _ in 0..rounds {
        for (i, (_, make)) in makes.iter().enumerate() {
            if only.is_some_and(|k| k != i) {
                all[i].push(Figures::default());
                continue;
            }
            all[i].push(measure(make.as_ref(), &sim));
        }
    }
    println!(
        "\n{workers} workers, --expand {expand}, medians of {rounds} rounds\n\n| index | events/s | mixed ops/s | lookups/s | lookup p50 / p99 µs | peak B per held block |\n|---|---|---|---|---|---|"
    );
    for ((name, _), figs) in makes.iter().zip(&all) {
        let m = |f: fn(&Figures) -> f64| median(figs.iter().map(f).collect());
        println!(
            "| {name} | {:.1} k | {:.1} k | {:.1} k | {:.2} / {:.2} | {:.1} |",
            m(|f| f.events_s) / 1e3,
            m(|f| f.mixed_ops_s) / 1e3,
            m(|f| f.lookups_s) / 1e3,
            m(|f| f.p50_us),
            m(|f| f.p99_us),
            m(|f| f.bytes_per_hold),
        );
    }
}

/// Pins this thread to the measurement core (`PEERS_CORE`, else the last), as peers-bench does.
fn adapters_pin() {
    let core = std::env::var("PEERS_CORE")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()) - 1);
    // SAFETY: a zeroed cpu_set_t, filled by CPU_SET, read by sched_setaffinity for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}
