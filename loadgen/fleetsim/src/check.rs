//! The one interface every index is driven through, and the ground-truth check of an index
//! against a simulation.

use std::collections::{HashMap, HashSet};

use crate::hashes::Block;
use crate::sim::{Event, Op, Simulation};

/// An index under test, driven in-process with the simulator's events and lookups.
pub trait Adapter {
    /// A label for the table (says what it is: structure, threads).
    fn name(&self) -> String;
    /// `blocks` were stored on `worker` after the block whose chain hash is `parent`.
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]);
    /// The blocks with these chain hashes left `worker`.
    fn remove(&mut self, worker: u32, chain_hashes: &[u64]);
    /// Everything `worker` held is gone.
    fn clear(&mut self, worker: u32);
    /// Makes every event applied so far visible to lookups (a threaded indexer's flush); a no-op
    /// for synchronous indexes.
    fn settle(&mut self) {}
    /// The simulation's clock (µs) for the calls that follow: the arrival of the request whose
    /// lookup or events come next. A no-op for indexes that keep no time.
    fn clock(&mut self, _at_us: u64) {}
    /// Leading blocks of `blocks` each worker holds, into `out` (cleared first); any order, zero
    /// counts allowed (the check normalises).
    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>);

    /// Applies one event.
    fn apply(&mut self, event: &Event) {
        match event {
            Event::Stored {
                worker,
                parent,
                blocks,
            } => self.store(*worker, *parent, blocks),
            Event::Removed { worker, blocks } => self.remove(*worker, blocks),
            Event::Cleared { worker } => self.clear(*worker),
        }
    }
}

/// An index's answer that differs from the ground truth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Index of the lookup in the simulation.
    pub lookup: u32,
    /// Its chain length in blocks.
    pub blocks: usize,
    pub expected: Vec<(u32, u32)>,
    pub got: Vec<(u32, u32)>,
}

impl Mismatch {
    /// One line: the lookup, and the workers whose counts differ (at most `max` of them).
    pub fn describe(&self, max: usize) -> String {
        let exp: HashMap<u32, u32> = self.expected.iter().copied().collect();
        let got: HashMap<u32, u32> = self.got.iter().copied().collect();
        let mut workers: Vec<u32> = exp.keys().chain(got.keys()).copied().collect();
        workers.sort_unstable();
        workers.dedup();
        let diffs: Vec<String> = workers
            .into_iter()
            .filter(|w| exp.get(w) != got.get(w))
            .take(max)
            .map(|w| {
                let e = exp.get(&w).copied().unwrap_or(0);
                let g = got.get(&w).copied().unwrap_or(0);
                format!("w{w}: truth {e} got {g}")
            })
            .collect();
        format!(
            "lookup #{} ({} blocks, {} workers match): {}",
            self.lookup,
            self.blocks,
            self.expected.len(),
            diffs.join(", ")
        )
    }
}

/// The result of checking one index.
#[derive(Clone, Debug, Default)]
pub struct CheckReport {
    /// Lookups whose answer differed from the ground truth.
    pub mismatches: u64,
    /// The first ones, in stream order.
    pub first: Vec<Mismatch>,
    /// Lookups compared.
    pub lookups: u64,
}

/// Sorts by worker and drops zero counts (workers that match nothing).
pub fn normalise(answer: &mut Vec<(u32, u32)>) {
    answer.retain(|&(_, m)| m > 0);
    answer.sort_unstable();
}

/// Replays the whole mixed stream of `sim` into `index` and compares every lookup's answer with
/// the ground truth; keeps the first `keep` mismatches. Then clears every worker and checks that
/// the first lookups match nothing.
pub fn check_stream(sim: &Simulation, index: &mut dyn Adapter, keep: usize) -> CheckReport {
    let mut report = CheckReport::default();
    let mut got = Vec::new();
    let record = |report: &mut CheckReport, i: u32, expected: &[(u32, u32)], got: &[(u32, u32)]| {
        report.lookups += 1;
        if got != expected {
            report.mismatches += 1;
            if report.first.len() < keep {
                report.first.push(Mismatch {
                    lookup: i,
                    blocks: sim.lookups[i as usize].blocks.len(),
                    expected: expected.to_vec(),
                    got: got.to_vec(),
                });
            }
        }
    };
    for op in &sim.ops {
        match *op {
            Op::Event(e) => index.apply(&sim.events[e as usize]),
            Op::Lookup(l) => {
                let lookup = &sim.lookups[l as usize];
                // The request's clock, for its lookup and the events that follow it.
                index.clock(lookup.at_us);
                index.settle();
                index.lookup(&lookup.blocks, &mut got);
                normalise(&mut got);
                record(&mut report, l, &lookup.truth, &got);
            }
        }
    }
    for w in 0..sim.config.workers {
        index.clear(w);
    }
    index.settle();
    for (l, lookup) in sim.lookups.iter().enumerate().take(16) {
        index.lookup(&lookup.blocks, &mut got);
        normalise(&mut got);
        record(&mut report, l as u32, &[], &got);
    }
    report
}

/// A plain reference index (sets of chain hashes per worker, walked block by block), independent
/// of the simulator's own bookkeeping: the harness's self-check and a smoke-test subject.
#[derive(Default)]
pub struct ReferenceIndex {
    held: HashMap<u32, HashSet<u64>>,
}

impl Adapter for ReferenceIndex {
    fn name(&self) -> String {
        "reference (hash sets)".into()
    }

    fn store(&mut self, worker: u32, _parent: Option<u64>, blocks: &[Block]) {
        let set = self.held.entry(worker).or_default();
        set.extend(blocks.iter().map(|b| b.chain));
    }

    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        if let Some(set) = self.held.get_mut(&worker) {
            for h in chain_hashes {
                set.remove(h);
            }
        }
    }

    fn clear(&mut self, worker: u32) {
        self.held.remove(&worker);
    }

    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        out.clear();
        for (&w, set) in &self.held {
            let n = blocks.iter().take_while(|b| set.contains(&b.chain)).count();
            out.push((w, n as u32));
        }
    }
}
