//! The harness without any peer: a synthetic trace through the simulator, replayed into the
//! reference index and checked against the ground truth; an index that ignores removals is caught.

use fleetsim::synth::synthetic_trace;
use fleetsim::{Adapter, Block, ReferenceIndex, SimConfig, check_stream, parse_trace, simulate};

fn small_fleet(expand: u32) -> SimConfig {
    SimConfig {
        workers: 8,
        worker_blocks: 40 * expand,
        expand,
        speed: 1,
    }
}

#[test]
fn reference_index_matches_the_ground_truth_native_and_expanded() {
    let trace = parse_trace(&synthetic_trace(400, 7)).unwrap();
    for expand in [1, 32] {
        let sim = simulate(&trace, small_fleet(expand)).unwrap();
        assert!(sim.removed_blocks > 0, "the small fleet must evict");
        assert!(sim.lookups.iter().filter(|l| !l.truth.is_empty()).count() > 100);
        let report = check_stream(&sim, &mut ReferenceIndex::default(), 3);
        assert_eq!(report.mismatches, 0, "{:?}", report.first);
        assert_eq!(report.lookups, sim.lookups.len() as u64 + 16);
    }
}

/// Forgets removals: its answers go stale once workers evict.
#[derive(Default)]
struct NoRemovals(ReferenceIndex);

impl Adapter for NoRemovals {
    fn name(&self) -> String {
        "no removals".into()
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        self.0.store(worker, parent, blocks)
    }
    fn remove(&mut self, _worker: u32, _chain_hashes: &[u64]) {}
    fn clear(&mut self, worker: u32) {
        self.0.clear(worker)
    }
    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        self.0.lookup(blocks, out)
    }
}

#[test]
fn an_index_that_ignores_removals_is_caught() {
    let trace = parse_trace(&synthetic_trace(400, 7)).unwrap();
    let sim = simulate(&trace, small_fleet(1)).unwrap();
    let report = check_stream(&sim, &mut NoRemovals::default(), 2);
    assert!(report.mismatches > 0);
    assert_eq!(report.first.len(), 2);
    assert!(report.first[0].describe(4).contains("truth"));
}
