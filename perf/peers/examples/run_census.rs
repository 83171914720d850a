//! The shape a run-record store would have on a trace (perf/runs/2026-12-07-run-census.md): the
//! fleet simulation's events replayed into an exact model of what is held (each held block's
//! parent, its holders and the store event each holder's entry came from), and at checkpoints
//! the census of that state as *runs*: maximal unbranched stretches of the held prefix tree
//! (a block starts a run when its parent is not held or has other children), each with its
//! holders' *extents* (a holder's consecutive blocks of the run stored by one event, so one
//! `last_seen` and one tier each). Those counts price the layout issue 31 asks for (hashes in
//! one array per run, holder sets per run) against today's per-key records, and the lookups
//! are counted in the runs they cross.
//!
//!     cargo run --release --example run_census -- TRACE [CHECKPOINTS=4]
//!
//! `WORKERS=n` and `EXPAND=e` change the fleet (speed: workers / 64, as run.sh's default).
//! No index is measured here: this is the model's census, not a benchmark.
#[path = "../src/fleet_env.rs"]
mod fleet_env;
use fleetsim::{Event, Op, parse_trace, simulate};
use std::collections::HashMap;

/// The root's "hash": the parent of a chain's first block.
const ROOT: u64 = 0;

/// One held block.
struct Node {
    parent: u64,
    /// (worker, store event that stored its entry), unordered.
    holders: Vec<(u32, u32)>,
}

#[derive(Default)]
struct Model {
    nodes: HashMap<u64, Node>,
    /// parent hash → its held children (whether or not the parent itself is held).
    kids: HashMap<u64, Vec<u64>>,
    holds: u64,
}

impl Model {
    fn store(&mut self, worker: u32, event: u32, parent: Option<u64>, chain: &[u64]) {
        let mut parent = parent.unwrap_or(ROOT);
        for &h in chain {
            let node = self.nodes.entry(h).or_insert_with(|| {
                self.kids.entry(parent).or_default().push(h);
                Node {
                    parent,
                    holders: Vec::new(),
                }
            });
            match node.holders.iter_mut().find(|(w, _)| *w == worker) {
                Some(entry) => entry.1 = event,
                None => {
                    node.holders.push((worker, event));
                    self.holds += 1;
                }
            }
            parent = h;
        }
    }

    fn remove(&mut self, worker: u32, chain: &[u64]) {
        for h in chain {
            let Some(node) = self.nodes.get_mut(h) else {
                continue;
            };
            let Some(i) = node.holders.iter().position(|(w, _)| *w == worker) else {
                continue;
            };
            node.holders.swap_remove(i);
            self.holds -= 1;
            if node.holders.is_empty() {
                let parent = node.parent;
                self.nodes.remove(h);
                let kids = self.kids.get_mut(&parent).expect("a held child is listed");
                kids.retain(|k| k != h);
                if kids.is_empty() {
                    self.kids.remove(&parent);
                }
            }
        }
    }

    /// Whether held block `h` starts a run: its parent is not held, or has other held children.
    fn starts_run(&self, h: u64) -> bool {
        let parent = self.nodes[&h].parent;
        !self.nodes.contains_key(&parent) || self.kids[&parent].len() != 1
    }

    /// The run's next block after `h`: its only held child, if that child continues the run.
    fn next_in_run(&self, h: u64) -> Option<u64> {
        match self.kids.get(&h).map(Vec::as_slice) {
            Some([only]) => Some(*only),
            _ => None,
        }
    }

    fn census(&self) -> Census {
        let mut c = Census {
            keys: self.nodes.len() as u64,
            holds: self.holds,
            ..Census::default()
        };
        // A holder's extent goes on while it holds the next block from the same event.
        let mut open: HashMap<u32, u32> = HashMap::new();
        let mut seen: HashMap<u32, ()> = HashMap::new();
        let mut lengths = Vec::new();
        for &start in self.nodes.keys().filter(|h| self.starts_run(**h)) {
            c.runs += 1;
            open.clear();
            seen.clear();
            let mut len = 0u64;
            let mut at = Some(start);
            while let Some(h) = at {
                len += 1;
                let node = &self.nodes[&h];
                let mut next_open: HashMap<u32, u32> = HashMap::with_capacity(node.holders.len());
                for &(w, e) in &node.holders {
                    if open.get(&w) != Some(&e) {
                        c.extents += 1;
                    }
                    next_open.insert(w, e);
                    seen.insert(w, ());
                }
                open = next_open;
                at = self.next_in_run(h);
            }
            c.run_holders += seen.len() as u64;
            lengths.push(len);
        }
        lengths.sort_unstable();
        c.run_len_p50 = percentile(&lengths, 0.5);
        c.run_len_p99 = percentile(&lengths, 0.99);
        c
    }

    /// How many runs the longest held prefix of `chain` crosses (0: nothing held), and its
    /// length in blocks.
    fn pieces(&self, chain: impl Iterator<Item = u64>) -> (u32, u32) {
        let (mut pieces, mut matched) = (0, 0);
        let mut prev = None;
        for h in chain {
            if !self.nodes.contains_key(&h) {
                break;
            }
            if prev.is_none_or(|p| self.next_in_run(p) != Some(h)) {
                pieces += 1;
            }
            prev = Some(h);
            matched += 1;
        }
        (pieces, matched)
    }
}

/// The lookups' runs crossed, sorted; and over the longest 2% of matches (by matched blocks,
/// as perf/runs/2026-12-07-layout-bound.md counts ours' pieces) the median matched blocks and
/// runs crossed.
fn piece_counts(lookups: &mut [(u64, u64)]) -> (Vec<u64>, (u64, u64)) {
    let mut counts: Vec<u64> = lookups.iter().map(|l| l.1).collect();
    counts.sort_unstable();
    lookups.sort_unstable();
    let top = &lookups[lookups.len() - lookups.len().div_ceil(50)..];
    let mut blocks: Vec<u64> = top.iter().map(|l| l.0).collect();
    let mut crossed: Vec<u64> = top.iter().map(|l| l.1).collect();
    blocks.sort_unstable();
    crossed.sort_unstable();
    (
        counts,
        (percentile(&blocks, 0.5), percentile(&crossed, 0.5)),
    )
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[derive(Default)]
struct Census {
    keys: u64,
    holds: u64,
    runs: u64,
    /// Σ over runs of the distinct workers holding any of its blocks.
    run_holders: u64,
    /// Holder extents: a holder's consecutive blocks of a run from one store event.
    extents: u64,
    run_len_p50: u64,
    run_len_p99: u64,
}

/// Bytes of the layouts compared, per held block, from the census's counts. Today's: the
/// measured figure is printed by peers-bench; this is the model of the records only (a key
/// record 36 B with its first holder, 24 B per further holder, ~5.3 B of table per key).
/// Run records: per key its 8-byte hash and 4-byte cumulative token count in the run's arrays
/// and ~10.7 B of an 8-byte-entry table at 3/4 load (a key's run and offset beside its tag);
/// per run a 24-byte header; per extent 24 bytes (replica, first and last offset, tier,
/// last_seen). LFU counters are left out (only an LFU tenant's keys would carry them).
fn bytes_per_hold(c: &Census) -> (f64, f64) {
    let holds = c.holds.max(1) as f64;
    let today = c.keys as f64 * (36.0 + 5.3) + (c.holds - c.keys) as f64 * 24.0;
    let runs = c.keys as f64 * (8.0 + 4.0 + 10.7) + c.runs as f64 * 24.0 + c.extents as f64 * 24.0;
    (today / holds, runs / holds)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let text = std::fs::read_to_string(&a[1]).expect("TRACE");
    let checkpoints: usize = a.get(2).map_or(4, |s| s.parse().expect("CHECKPOINTS"));
    let config = fleet_env::config();
    let (workers, expand) = (config.workers, config.expand);
    let sim = simulate(&parse_trace(&text).expect("trace"), config).expect("simulation");
    println!(
        "# run census: {workers} workers × {} blocks, --expand {expand}, {} events, {} lookups",
        config.worker_blocks,
        sim.events.len(),
        sim.lookups.len()
    );
    println!(
        "| events applied | keys | holds | holds/key | runs | run length p50 / p99 | holders per run | extents | extents per run | model B/hold today | model B/hold run records | lookups since | runs crossed p50 / p99 / max (matched > 0) | longest 2% of matches: blocks p50, runs crossed p50 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut model = Model::default();
    let mut chain = Vec::new();
    let mut applied = 0usize;
    let every = sim.events.len().div_ceil(checkpoints.max(1));
    let mut pieces = Vec::new();
    for op in &sim.ops {
        match *op {
            Op::Lookup(l) => {
                let blocks = &sim.lookups[l as usize].blocks;
                let (p, matched) = model.pieces(blocks.iter().map(|b| b.chain));
                if matched > 0 {
                    pieces.push((u64::from(matched), u64::from(p)));
                }
            }
            Op::Event(e) => {
                match &sim.events[e as usize] {
                    Event::Stored {
                        worker,
                        parent,
                        blocks,
                    } => {
                        chain.clear();
                        chain.extend(blocks.iter().map(|b| b.chain));
                        model.store(*worker, e, *parent, &chain);
                    }
                    Event::Removed { worker, blocks } => model.remove(*worker, blocks),
                    Event::Cleared { .. } => unreachable!("the simulator emits no clears"),
                }
                applied += 1;
                if applied.is_multiple_of(every) || applied == sim.events.len() {
                    let c = model.census();
                    let (today, runs) = bytes_per_hold(&c);
                    let (counts, longest) = piece_counts(&mut pieces);
                    println!(
                        "| {applied} | {} | {} | {:.2} | {} | {} / {} | {:.2} | {} | {:.2} | {today:.1} | {runs:.1} | {} | {} / {} / {} | {} / {} |",
                        c.keys,
                        c.holds,
                        c.holds as f64 / c.keys.max(1) as f64,
                        c.runs,
                        c.run_len_p50,
                        c.run_len_p99,
                        c.run_holders as f64 / c.runs.max(1) as f64,
                        c.extents,
                        c.extents as f64 / c.runs.max(1) as f64,
                        pieces.len(),
                        percentile(&counts, 0.5),
                        percentile(&counts, 0.99),
                        counts.last().copied().unwrap_or(0),
                        longest.0,
                        longest.1,
                    );
                    pieces.clear();
                }
            }
        }
    }
    // The model holds what the simulated workers hold: the census counts the right state.
    assert_eq!(
        model.holds, sim.final_holds,
        "the model's holds against the simulation's"
    );
    println!(
        "model holds = the simulation's final holds ({})",
        sim.final_holds
    );
}
