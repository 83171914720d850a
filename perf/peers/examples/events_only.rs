//! Events only, ours, stores and removals timed apart (perf/runs/2026-12-06-event-path.md):
//! the peers' `Ours` adapter (the core's entry points) fed the fleet simulation's event stream,
//! 64 workers, `--expand 32`, each event timed; ns per stored and per removed block.
//!
//!     cargo run --release --example events_only -- TRACE [REPETITIONS=5] [FIRST_REQUESTS]
//!
//! `WORKERS=n` and `EXPAND=e` change the fleet (speed: workers / 64, as run.sh's default).
//! `PEER=kv-index` times kv-index's `ChainIndex` on the same events instead of ours.
//! `FIRST_REQUESTS` replays only the trace's first requests (for callgrind:
//! `--toggle-collect='inferencecache_index::index::Index::ingest'
//! --toggle-collect='inferencecache_index::index::Index::apply_event'`).
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
use fleetsim::{Adapter, Event, parse_trace, simulate};
use std::time::Instant;
fn main() {
    server_alloc::configure();
    let a: Vec<String> = std::env::args().collect();
    let text = std::fs::read_to_string(&a[1]).unwrap();
    let reps: usize = a.get(2).map_or(5, |s| s.parse().unwrap());
    let limit: usize = a.get(3).map_or(usize::MAX, |s| s.parse().unwrap());
    let mut trace = parse_trace(&text).unwrap();
    trace.truncate(limit);
    let config = fleet_env::config();
    let (workers, expand) = (config.workers, config.expand);
    let sim = simulate(&trace, config).unwrap();
    let (mut st, mut rm) = (0u64, 0u64);
    for e in &sim.events {
        match e {
            Event::Stored { blocks, .. } => st += blocks.len() as u64,
            Event::Removed { blocks, .. } => rm += blocks.len() as u64,
            _ => {}
        }
    }
    let mut res = Vec::new();
    for _ in 0..reps {
        let mut index: Box<dyn Adapter> = match std::env::var("PEER").as_deref() {
            Ok("kv-index") => Box::new(adapters::KvIndexChain::new(workers).expect("<= 1,024")),
            Ok(other) => panic!("PEER={other}: only kv-index"),
            Err(_) => Box::new(adapters::Ours::new(workers, 512 / expand)),
        };
        let (mut ts, mut tr) = (0f64, 0f64);
        for (e, &at_us) in sim.events.iter().zip(&sim.event_at_us) {
            index.clock(at_us);
            let t = Instant::now();
            index.apply(e);
            let d = t.elapsed().as_secs_f64();
            match e {
                Event::Stored { .. } => ts += d,
                _ => tr += d,
            }
        }
        println!(
            "store {:.1} ns/block  remove {:.1} ns/block  total {:.3} s",
            ts * 1e9 / st as f64,
            tr * 1e9 / rm as f64,
            ts + tr
        );
        res.push((ts * 1e9 / st as f64, tr * 1e9 / rm as f64));
        drop(index);
    }
    let mut s: Vec<f64> = res.iter().map(|r| r.0).collect();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mut r: Vec<f64> = res.iter().map(|r| r.1).collect();
    r.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "MEDIAN store {:.1} remove {:.1} ns/block",
        s[s.len() / 2],
        r[r.len() / 2]
    );
}
