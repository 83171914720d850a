//! Lookups only, ours (perf/runs/2026-12-06-fixed-costs.md): the peers' `Ours` adapter (the
//! core's entry points) fed the fleet simulation's mixed stream, 64 workers, `--expand 32`;
//! each lookup of at most `MAX_BLOCKS` blocks is repeated `REPEAT` times in a row (the index
//! as the trace left it) and timed, so a profile or callgrind run sees mostly lookups. Prints
//! the median and mean ns per lookup; the answers are checked against the ground truth.
//!
//!     cargo run --release --example lookups_only -- TRACE [REPEAT=20] [MAX_BLOCKS=512] [FIRST_REQUESTS]
//!
//! For callgrind: `--toggle-collect='*Index*lookup_route*'`. `DIST=1` prints each timed
//! lookup's answer size, number of distinct matched lengths and fastest repetition's time to stderr. `MIN_BLOCKS=n`
//! skips the lookups of fewer than n blocks (to profile the long chains alone). `WORKERS=n`
//! and `EXPAND=e` change the fleet (speed: workers / 64, as run.sh's default). `PEER=kv-index`
//! times kv-index's index on the same lookups (to compare per-block costs); `FLUSH=1` evicts
//! the caches before every lookup (perf/runs/2026-12-06-lookup-memory.md). `WARM=` runs one
//! untimed lookup before each timed one, to tell what a cold lookup waits for
//! (perf/runs/2026-12-07-cold-lookups.md): `miss` (a one-block chain no index holds: the probe
//! path's code), `other` (the previous lookup of the stream: the hit path's code, the scratch
//! buffers and whatever records the two share), `prefix` (this lookup's own first 32 blocks:
//! all of that and the records and holders of its shared prefix), `code` (the previous lookup
//! on a second, small index of ours: the hit path's code alone) or `request` (the request's
//! blocks read: what a cold request costs, perf/runs/2026-12-07-layout-bound.md; works with
//! `PEER=kv-index` too).
#[allow(dead_code)]
#[path = "../src/adapters.rs"]
mod adapters;
#[path = "../src/fleet_env.rs"]
mod fleet_env;
#[path = "../src/server_alloc.rs"]
mod server_alloc;

/// The server's allocator (see `server_alloc`).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
use fleetsim::{Adapter, Op, parse_trace, simulate};
use std::time::Instant;
fn main() {
    server_alloc::configure();
    let a: Vec<String> = std::env::args().collect();
    let text = std::fs::read_to_string(&a[1]).unwrap();
    let repeat: usize = a.get(2).map_or(20, |s| s.parse().unwrap());
    let max_blocks: usize = a.get(3).map_or(512, |s| s.parse().unwrap());
    let limit: usize = a.get(4).map_or(usize::MAX, |s| s.parse().unwrap());
    let min_blocks: usize = std::env::var("MIN_BLOCKS").map_or(0, |s| s.parse().unwrap());
    let mut trace = parse_trace(&text).unwrap();
    trace.truncate(limit);
    let config = fleet_env::config();
    let (workers, expand) = (config.workers, config.expand);
    let sim = simulate(&trace, config).unwrap();
    // `PEER=kv-index` times kv-index's `ChainIndex` on the same lookups instead of ours.
    let mut index: Box<dyn Adapter> = match std::env::var("PEER").as_deref() {
        Ok("kv-index") => Box::new(adapters::KvIndexChain::new(workers).expect("kv-index")),
        _ => Box::new(adapters::Ours::new(workers, 512 / expand)),
    };
    // `FLUSH=1`: every lookup starts with cold caches (a 64 MiB buffer written first).
    let mut flush = std::env::var("FLUSH").is_ok().then(|| vec![1u64; 8 << 20]);
    let mut out = Vec::new();
    let mut times = Vec::new();
    let mut mismatches = 0;
    let warm = std::env::var("WARM").ok();
    // `WARM=code`: a second index of ours, fed the stream's first 2,000 operations' events,
    // runs the previous lookup: the hit path's code and branch history warm, while this
    // index's data and scratch buffers stay as the stream left them.
    let mut side = (warm.as_deref() == Some("code")).then(|| {
        let mut side: Box<dyn Adapter> = Box::new(adapters::Ours::new(workers, 512 / expand));
        for op in sim.ops.iter().take(2_000) {
            if let Op::Event(i) = *op {
                side.apply(&sim.events[i as usize]);
            }
        }
        side
    });
    let mut previous: Option<usize> = None;
    for op in &sim.ops {
        match *op {
            Op::Event(i) => index.apply(&sim.events[i as usize]),
            Op::Lookup(i) => {
                let l = &sim.lookups[i as usize];
                // The request's clock, for its lookup and the events that follow it.
                index.clock(l.at_us);
                if let Some(side) = side.as_mut() {
                    side.clock(l.at_us);
                }
                let before = previous.replace(i as usize);
                if l.blocks.len() > max_blocks || l.blocks.len() < min_blocks {
                    continue;
                }
                match warm.as_deref() {
                    None => {}
                    Some("miss") => {
                        let nowhere = fleetsim::Block {
                            content: u64::from(i),
                            chain: u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                        };
                        index.lookup(&[nowhere], &mut out);
                    }
                    Some("other") => {
                        if let Some(b) = before {
                            index.lookup(&sim.lookups[b].blocks, &mut out);
                        }
                    }
                    Some("prefix") => index.lookup(&l.blocks[..l.blocks.len().min(32)], &mut out),
                    Some("code") => {
                        if let (Some(side), Some(b)) = (side.as_mut(), before) {
                            side.lookup(&sim.lookups[b].blocks, &mut out);
                        }
                    }
                    Some("request") => {
                        let sum = l.blocks.iter().fold(0u64, |a, b| a ^ b.content ^ b.chain);
                        std::hint::black_box(sum);
                    }
                    Some(other) => panic!("WARM={other}: miss, other, prefix, code or request"),
                }
                if let Some(buffer) = flush.as_mut() {
                    evict_caches(buffer);
                }
                let t = Instant::now();
                let mut fastest = f64::MAX;
                for _ in 0..repeat {
                    let one = Instant::now();
                    index.lookup(&l.blocks, &mut out);
                    fastest = fastest.min(one.elapsed().as_secs_f64() * 1e9);
                }
                times.push(t.elapsed().as_secs_f64() * 1e9 / repeat as f64);
                // The fastest repetition: what the lookup costs without preemption on a busy machine.
                let ns = fastest;
                fleetsim::check::normalise(&mut out);
                if std::env::var("DIST").is_ok() {
                    let mut m: Vec<u32> = out.iter().map(|x| x.1).collect();
                    m.sort();
                    m.dedup();
                    eprintln!(
                        "k={} d={} blocks={} matched={} ns={ns:.0}",
                        out.len(),
                        m.len(),
                        l.blocks.len(),
                        m.last().copied().unwrap_or(0)
                    );
                }
                if out != l.truth {
                    mismatches += 1;
                }
            }
        }
    }
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{} lookups of <= {max_blocks} blocks, x{repeat}: median {:.0} ns, mean {:.0} ns per lookup; ground-truth mismatches {mismatches}",
        times.len(),
        times[times.len() / 2],
        mean
    );
}

/// Writes the whole buffer (larger than the last-level cache), evicting what a lookup would
/// otherwise find cached.
fn evict_caches(buffer: &mut [u64]) {
    let mut sum = 0u64;
    for x in buffer.iter_mut() {
        sum = sum.wrapping_add(*x);
        *x = sum;
    }
    std::hint::black_box(sum);
}
