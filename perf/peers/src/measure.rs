//! One measured round of one index: the events alone (events/s, heap per held block), then the
//! mixed stream in trace order (ops/s, lookups/s, per-lookup latency by chain length).

use std::time::Instant;

use fleetsim::{Adapter, Op, SimConfig, Simulation};

use crate::adapters::{DynamoPositional, DynamoRadix, DynamoThreadPool, KvIndexChain, Ours};
use crate::alloc;

/// The indexes compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Ours,
    DynamoThreadPool1,
    DynamoRadix,
    DynamoPositional,
    KvIndex,
    /// Dynamo's default indexer with 2 writer threads on both cores: not a one-core figure.
    DynamoThreadPool2,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::Ours,
        Kind::DynamoThreadPool1,
        Kind::DynamoRadix,
        Kind::DynamoPositional,
        Kind::KvIndex,
        Kind::DynamoThreadPool2,
    ];

    /// The name `--only` takes.
    pub fn key(self) -> &'static str {
        match self {
            Kind::Ours => "ours",
            Kind::DynamoThreadPool1 => "dynamo-default",
            Kind::DynamoRadix => "dynamo-radix",
            Kind::DynamoPositional => "dynamo-positional",
            Kind::KvIndex => "kv-index",
            Kind::DynamoThreadPool2 => "dynamo-default-2t",
        }
    }

    /// The table's label.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Ours => "ours (Index::lookup_route)",
            Kind::DynamoThreadPool1 => "Dynamo ThreadPool<CRTC>, 1 thread",
            Kind::DynamoRadix => "Dynamo RadixTree",
            Kind::DynamoPositional => "Dynamo PositionalIndexer j64",
            Kind::KvIndex => "kv-index ChainIndex",
            Kind::DynamoThreadPool2 => "Dynamo ThreadPool<CRTC>, 2 threads, 2 cores†",
        }
    }

    /// Whether it runs on the one pinned core (the others are labelled).
    pub fn one_core(self) -> bool {
        self != Kind::DynamoThreadPool2
    }
}

/// A fresh index of `kind` for the fleet of `config` (None: the index cannot hold that many
/// workers). Multi-threaded ones spawn their threads here, under the affinity set for them.
pub fn make(kind: Kind, config: &SimConfig) -> Option<Box<dyn Adapter>> {
    let tpb = config.tokens_per_block();
    Some(match kind {
        Kind::Ours => Box::new(Ours::new(config.workers, tpb)),
        Kind::DynamoThreadPool1 => Box::new(DynamoThreadPool::new(1, tpb)),
        Kind::DynamoThreadPool2 => {
            set_affinity(&all_cores());
            let pool = DynamoThreadPool::new(2, tpb);
            pin_to_one_core();
            Box::new(pool)
        }
        Kind::DynamoRadix => Box::new(DynamoRadix::new()),
        Kind::DynamoPositional => Box::new(DynamoPositional::new()),
        Kind::KvIndex => Box::new(KvIndexChain::new(config.workers)?),
    })
}

fn all_cores() -> Vec<usize> {
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
}

/// The core every one-core measurement runs on: `PEERS_CORE` when set (to keep a profiler's run
/// off a measurement's core), else the last one.
pub fn pinned_core() -> usize {
    std::env::var("PEERS_CORE")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| *all_cores().last().unwrap_or(&0))
}

pub fn pin_to_one_core() {
    set_affinity(&[pinned_core()]);
}

fn set_affinity(cores: &[usize]) {
    // SAFETY: `set` is a plain bit set on the stack, initialised by CPU_ZERO before use, and
    // sched_setaffinity(0, ..) only reads it (for the calling thread).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// What one round measured of one index.
#[derive(Clone, Debug, Default)]
pub struct RoundResult {
    /// Events applied per second (events only, then settled).
    pub events_per_s: f64,
    /// Blocks stored or removed per second, same pass.
    pub event_blocks_per_s: f64,
    /// Peak and retained heap growth over the events-only pass, per held block.
    pub peak_bytes_per_block: f64,
    pub retained_bytes_per_block: f64,
    /// Mixed stream: events + lookups per second, wall time of the whole stream.
    pub mixed_ops_per_s: f64,
    /// Lookups per second of lookup time within the mixed stream.
    pub lookups_per_s: f64,
    /// (chain length, latency ns) of every lookup of the mixed stream.
    pub latencies: Vec<(u32, u64)>,
}

/// One round of `kind` over `sim`.
pub fn round(kind: Kind, sim: &Simulation) -> RoundResult {
    let mut r = RoundResult::default();
    events_only(kind, sim, &mut r);
    mixed(kind, sim, &mut r);
    r
}

/// A phase's clock: wall time, or with `PEERS_CPU_CLOCK=1` this thread's CPU time, which leaves
/// out the time other processes held the pinned core (a shared machine: every engineer's build
/// preempts the run). The CPU clock is read at phase boundaries only (a system call), never per
/// lookup, so the latency figures stay wall-clock either way.
struct PhaseClock {
    wall: Instant,
    cpu: Option<f64>,
}

impl PhaseClock {
    fn start() -> PhaseClock {
        let cpu = std::env::var_os("PEERS_CPU_CLOCK")
            .is_some_and(|v| v == "1")
            .then(thread_cpu_secs);
        PhaseClock {
            wall: Instant::now(),
            cpu,
        }
    }
    fn secs(&self) -> f64 {
        match self.cpu {
            Some(c) => thread_cpu_secs() - c,
            None => self.wall.elapsed().as_secs_f64(),
        }
    }
}

/// This thread's CPU time in seconds.
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn events_only(kind: Kind, sim: &Simulation, r: &mut RoundResult) {
    let base = alloc::current();
    alloc::reset_peak();
    let mut index = make(kind, &sim.config).expect("checked by the caller");
    let t = PhaseClock::start();
    let mut at = None;
    for (e, &at_us) in sim.events.iter().zip(&sim.event_at_us) {
        if at != Some(at_us) {
            index.clock(at_us);
            at = Some(at_us);
        }
        index.apply(e);
    }
    index.settle();
    let secs = t.secs();
    let peak = alloc::peak().saturating_sub(base) as f64;
    let retained = alloc::current().saturating_sub(base) as f64;
    drop(index);
    r.events_per_s = sim.events.len() as f64 / secs;
    r.event_blocks_per_s = sim.event_blocks() as f64 / secs;
    r.peak_bytes_per_block = peak / sim.peak_holds.max(1) as f64;
    r.retained_bytes_per_block = retained / sim.final_holds.max(1) as f64;
}

/// `PEERS_SLOW_US=N`: every lookup of the mixed stream slower than N µs is printed to stderr
/// with its position, so outliers can be told from noise (what precedes them, how long).
fn slow_threshold_ns() -> u64 {
    std::env::var("PEERS_SLOW_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(u64::MAX, |us| us * 1000)
}

fn mixed(kind: Kind, sim: &Simulation, r: &mut RoundResult) {
    let slow = slow_threshold_ns();
    let mut index = make(kind, &sim.config).expect("checked by the caller");
    let mut out = Vec::new();
    let mut lookup_ns = 0u64;
    r.latencies.reserve(sim.lookups.len());
    let t = PhaseClock::start();
    for op in &sim.ops {
        match *op {
            Op::Event(e) => index.apply(&sim.events[e as usize]),
            Op::Lookup(l) => {
                // The request's clock, for its lookup and the events that follow it.
                index.clock(sim.lookups[l as usize].at_us);
                // A threaded indexer's flush counts in the stream's time, not the lookup's.
                index.settle();
                let blocks = &sim.lookups[l as usize].blocks;
                let s = Instant::now();
                index.lookup(blocks, &mut out);
                let ns = s.elapsed().as_nanos() as u64;
                std::hint::black_box(&out);
                lookup_ns += ns;
                if ns > slow {
                    let matched = sim.lookups[l as usize].truth.iter().map(|t| t.1).max();
                    eprintln!(
                        "slow lookup: {} #{l} {} blocks, best match {:?}, {} µs",
                        kind.key(),
                        blocks.len(),
                        matched,
                        ns / 1000
                    );
                }
                r.latencies.push((blocks.len() as u32, ns));
            }
        }
    }
    index.settle();
    let secs = t.secs();
    drop(index);
    r.mixed_ops_per_s = sim.ops.len() as f64 / secs;
    r.lookups_per_s = sim.lookups.len() as f64 / (lookup_ns.max(1) as f64 / 1e9);
}
