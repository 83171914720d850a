//! What a contiguous slab layout would give ours' lookups (perf/runs/2026-12-07-layout-bound.md).
//! The fleet simulation's stream up to a point (`AT_PERCENT` of its operations) either goes into
//! the index (`replayed`: ours as it is; `kv-index`), or only into the fleet's state, from which
//! `ideal` builds ours with every worker's held chains stored root to leaf, one event per chain,
//! into an empty slab: each chain then lies in one stretch, apart from the prefixes it shares.
//! The rest of the stream follows as in the mixed stream (events applied, each lookup timed,
//! every answer checked against the ground truth), up to `LOOKUPS` lookups. One index per
//! process: a lookup never runs after another index's lookup of the same request, whose code and
//! request it would find warm. `REBUILD_EVERY=k` builds `ideal` again from the fleet's state
//! every k lookups and reports the time it took per event applied: what keeping the layout
//! would cost if every held block were moved once per k lookups. Every call here runs at one
//! instant (no [`Adapter::clock`]), as the benchmark did until 2026-12-07: the built index's
//! chains are stored at once, and a clock would make them fresher than the replayed index's.
//!
//!     cargo run --release --example ideal_layout -- TRACE [replayed|ideal|kv-index] [AT_PERCENT=50] [LOOKUPS]
#[allow(dead_code)]
#[path = "../src/adapters.rs"]
mod adapters;
#[path = "../src/server_alloc.rs"]
mod server_alloc;

/// The server's allocator (see `server_alloc`).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
use fleetsim::{Adapter, Block, Event, Op, SimConfig, parse_trace, simulate};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// A worker's held blocks: chain hash → (parent chain hash, block).
type Held = HashMap<u64, (Option<u64>, Block)>;

fn main() {
    server_alloc::configure();
    let a: Vec<String> = std::env::args().collect();
    let text = std::fs::read_to_string(&a[1]).unwrap();
    let which = a.get(2).map_or("ideal", String::as_str);
    let at_percent: usize = a.get(3).map_or(50, |s| s.parse().unwrap());
    let max_lookups: usize = a.get(4).map_or(usize::MAX, |s| s.parse().unwrap());
    // Every k lookups the ideal index is built again from the fleet's state (0: never).
    let rebuild_every: usize = std::env::var("REBUILD_EVERY").map_or(0, |s| s.parse().unwrap());
    let trace = parse_trace(&text).unwrap();
    let (workers, expand) = (64, 32);
    let config = SimConfig {
        workers,
        worker_blocks: fleetsim::sim::DEFAULT_WORKER_BLOCKS,
        expand,
        speed: 1,
    };
    let sim = simulate(&trace, config).unwrap();
    let at = sim.ops.len() * at_percent / 100;
    let mut held: Vec<Held> = vec![HashMap::new(); workers as usize];
    let mut index: Box<dyn Adapter> = match which {
        "replayed" => Box::new(adapters::Ours::new(workers, 512 / expand)),
        "kv-index" => Box::new(adapters::KvIndexChain::new(workers).expect("kv-index")),
        "ideal" => Box::new(adapters::Ours::new(workers, 512 / expand)),
        other => panic!("{other}: replayed, ideal or kv-index"),
    };
    for op in &sim.ops[..at] {
        let Op::Event(i) = *op else { continue };
        let event = &sim.events[i as usize];
        if which != "ideal" {
            index.apply(event);
        }
        track(&mut held, event);
    }
    let build = |held: &[Held]| {
        let mut ideal = adapters::Ours::new(workers, 512 / expand);
        for (w, blocks) in held.iter().enumerate() {
            for (parent, path) in paths(blocks) {
                ideal.store(w as u32, parent, &path);
            }
        }
        ideal
    };
    if which == "ideal" {
        index = Box::new(build(&held));
    }
    let (mut rebuild_ns, mut rebuilds, mut events_ns, mut events_after) = (0.0, 0, 0.0, 0u64);
    let mut times: Vec<(f64, u32)> = Vec::new();
    let (mut out, mut mismatches) = (Vec::new(), 0);
    for op in &sim.ops[at..] {
        let l = match *op {
            Op::Lookup(i) => &sim.lookups[i as usize],
            Op::Event(i) => {
                let event = &sim.events[i as usize];
                let t = Instant::now();
                index.apply(event);
                events_ns += t.elapsed().as_secs_f64() * 1e9;
                track(&mut held, event);
                events_after += 1;
                continue;
            }
        };
        if times.len() == max_lookups {
            break;
        }
        let rebuild_now = rebuild_every > 0 && times.len().is_multiple_of(rebuild_every);
        if which == "ideal" && rebuild_now && !times.is_empty() {
            let t = Instant::now();
            index = Box::new(build(&held));
            rebuild_ns += t.elapsed().as_secs_f64() * 1e9;
            rebuilds += 1;
        }
        let t = Instant::now();
        index.lookup(&l.blocks, &mut out);
        let ns = t.elapsed().as_secs_f64() * 1e9;
        fleetsim::check::normalise(&mut out);
        mismatches += usize::from(out != l.truth);
        times.push((ns, out.iter().map(|x| x.1).max().unwrap_or(0)));
    }
    println!(
        "{which} from {at_percent}% of the stream: {} events applied, {:.0} ns each; ground-truth mismatches {mismatches}",
        events_after,
        events_ns / events_after.max(1) as f64
    );
    if rebuilds > 0 {
        println!(
            "{rebuilds} rebuilds, {:.1} ms each: {:.0} ns per event applied",
            rebuild_ns / rebuilds as f64 / 1e6,
            rebuild_ns / events_after.max(1) as f64
        );
    }
    report(which, &mut times);
}

/// Applies `event` to the fleet's held state.
fn track(held: &mut [Held], event: &Event) {
    match event {
        Event::Stored {
            worker,
            parent,
            blocks,
        } => {
            let mine = &mut held[*worker as usize];
            let mut up = *parent;
            for b in blocks {
                mine.insert(b.chain, (up, *b));
                up = Some(b.chain);
            }
        }
        Event::Removed { worker, blocks } => {
            for h in blocks {
                held[*worker as usize].remove(h);
            }
        }
        Event::Cleared { worker } => held[*worker as usize].clear(),
    }
}

/// Every root-to-leaf path of a worker's held blocks (from the highest held ancestor), with the
/// parent of its first block, in a fixed order.
fn paths(held: &Held) -> Vec<(Option<u64>, Vec<Block>)> {
    let parents: HashSet<u64> = held.values().filter_map(|(p, _)| *p).collect();
    let mut leaves: Vec<u64> = held
        .keys()
        .filter(|h| !parents.contains(h))
        .copied()
        .collect();
    leaves.sort_unstable();
    leaves
        .into_iter()
        .map(|leaf| {
            let mut path = Vec::new();
            let mut at = Some(leaf);
            let mut top_parent = None;
            while let Some(h) = at {
                let Some((p, b)) = held.get(&h) else { break };
                path.push(*b);
                top_parent = *p;
                at = *p;
            }
            path.reverse();
            (top_parent, path)
        })
        .collect()
}

/// Percentiles and ns per matched block (least squares over lookups matching > 100 blocks).
fn report(name: &str, t: &mut [(f64, u32)]) {
    let long: Vec<(f64, f64)> = t
        .iter()
        .filter(|x| x.1 > 100)
        .map(|x| (f64::from(x.1), x.0))
        .collect();
    let n = long.len() as f64;
    let (mx, my) = (
        long.iter().map(|x| x.0).sum::<f64>() / n,
        long.iter().map(|x| x.1).sum::<f64>() / n,
    );
    let slope = long.iter().map(|x| (x.0 - mx) * (x.1 - my)).sum::<f64>()
        / long.iter().map(|x| (x.0 - mx).powi(2)).sum::<f64>();
    t.sort_by(|a, b| a.0.total_cmp(&b.0));
    let p = |q: f64| t[((t.len() as f64 * q) as usize).min(t.len() - 1)].0 / 1e3;
    println!(
        "{name}: {} lookups, p50 {:.2} p90 {:.2} p99 {:.2} µs; {slope:.2} ns per matched block ({} long)",
        t.len(),
        p(0.5),
        p(0.9),
        p(0.99),
        long.len()
    );
}
