//! The simulation: requests in trace order, each one looked up against the fleet's current state
//! (its ground truth), routed by it, and stored on the chosen worker, whose LRU evicts what no
//! longer fits.
//!
//! Routing is by the ground truth, net of load, as Dynamo's KV router scores workers: the cost of
//! a worker is the blocks it would have to prefill (the request's blocks past its cached prefix)
//! plus its load (the blocks of its requests still decoding); the lowest cost wins, ties by least
//! load, then lowest worker id. With no load this is the longest cached prefix. Strict
//! longest-prefix routing is useless on the Mooncake conversation trace: every one of its 12,031
//! requests starts with block id 0, so all of them would go to the one worker holding it (measured:
//! 16,384 blocks held in a fleet of 64).
//!
//! A request decodes for [`DECODE_MS_PER_TOKEN`] per output token from its arrival (the trace's
//! timestamp); its prompt blocks count as its worker's load until then.
//!
//! Workers stay prefix-closed (a worker holding a block holds its whole prefix), as an engine's
//! cache does: a request refreshes its blocks from the last to the first, so a parent is always
//! more recent than its children and LRU evicts leaves first (as vLLM frees a finished request's
//! blocks tail first). The matched prefix of a worker is therefore the number of the request's
//! leading blocks it holds.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use crate::hashes::{Block, TRACE_BLOCK_TOKENS, chain_hash, id_contents};
use crate::trace::TraceRequest;

/// Workers by default (issue 31).
pub const DEFAULT_WORKERS: u32 = 64;
/// Blocks one worker holds by default.
pub const DEFAULT_WORKER_BLOCKS: u32 = 16_384;

/// Decode time per output token that keeps a request's blocks on its worker's load (a typical
/// inter-token latency).
pub const DECODE_MS_PER_TOKEN: f64 = 20.0;

/// The fleet and the block shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// Simulated workers (ids 0..workers).
    pub workers: u32,
    /// Blocks one worker holds before LRU eviction.
    pub worker_blocks: u32,
    /// Engine blocks per 512-token trace id (1 = native; 32 = 16-token blocks). Divides 512.
    pub expand: u32,
    /// Time compression of the trace (arrival times divided by it, decode times kept): a larger
    /// fleet needs more concurrent load to use its workers. 1 = the trace's own timestamps.
    pub speed: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: DEFAULT_WORKERS,
            worker_blocks: DEFAULT_WORKER_BLOCKS,
            expand: 1,
            speed: 1,
        }
    }
}

impl SimConfig {
    /// The time compression both the peer benchmark and loadgen's trace replay use unless told
    /// otherwise: `workers / 64` (at least 1). At the trace's own pace only about 44 workers'
    /// worth of blocks is ever held, so a larger fleet would simulate the same as 64 workers.
    pub fn default_speed(workers: u32) -> u32 {
        (workers / 64).max(1)
    }

    /// Tokens per engine block.
    pub fn tokens_per_block(&self) -> u32 {
        TRACE_BLOCK_TOKENS / self.expand
    }

    fn validate(&self) -> Result<(), String> {
        if self.workers == 0 || self.worker_blocks == 0 || self.speed == 0 {
            return Err("workers, worker blocks and speed must be positive".into());
        }
        if self.expand == 0 || !TRACE_BLOCK_TOKENS.is_multiple_of(self.expand) {
            return Err(format!("--expand {} does not divide 512", self.expand));
        }
        Ok(())
    }
}

/// One KV event, as an engine publishes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// `blocks` were stored on `worker` after `parent` (the chain hash of the block before the
    /// first one; None: they start at the root).
    Stored {
        worker: u32,
        parent: Option<u64>,
        blocks: Vec<Block>,
    },
    /// The blocks with these chain hashes fell out of `worker` (leaves first).
    Removed { worker: u32, blocks: Vec<u64> },
    /// Everything `worker` held is gone (the simulator emits none; adapters support it).
    Cleared { worker: u32 },
}

/// One lookup: the request's blocks and, per worker holding a prefix of them, how many leading
/// blocks it holds (sorted by worker id; workers matching nothing are absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lookup {
    pub blocks: Vec<Block>,
    pub truth: Vec<(u32, u32)>,
    /// When the request arrived, in µs of the simulation's clock (the trace's timestamps
    /// compressed by the speed factor); its store and removals happen at the same time.
    pub at_us: u64,
}

/// One step of the mixed stream, in trace order: an index into `events` or `lookups`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Event(u32),
    Lookup(u32),
}

/// The streams of one simulation, produced once and replayed into every index.
#[derive(Clone, Debug, Default)]
pub struct Simulation {
    pub config: SimConfig,
    pub events: Vec<Event>,
    /// When each event happened (µs, as [`Lookup::at_us`]): at its request's arrival.
    pub event_at_us: Vec<u64>,
    pub lookups: Vec<Lookup>,
    pub ops: Vec<Op>,
    /// Most (worker, block) pairs held at once over the run.
    pub peak_holds: u64,
    /// (worker, block) pairs held at the end.
    pub final_holds: u64,
    /// Blocks stored and removed in all events.
    pub stored_blocks: u64,
    pub removed_blocks: u64,
}

impl Simulation {
    /// Events that are stores or removals, and the blocks they carry.
    pub fn event_blocks(&self) -> u64 {
        self.stored_blocks + self.removed_blocks
    }
}

/// One worker's LRU cache: chain hash → stamp, and stamp → chain hash (oldest first).
#[derive(Default)]
struct Worker {
    stamps: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    /// Blocks of this worker's requests still decoding.
    load: u64,
}

impl Worker {
    fn touch(&mut self, chain: u64, stamp: u64) -> bool {
        let old = self.stamps.insert(chain, stamp);
        if let Some(old) = old {
            self.by_age.remove(&old);
        }
        self.by_age.insert(stamp, chain);
        old.is_none()
    }

    fn evict_oldest(&mut self) -> Option<u64> {
        let (_, chain) = self.by_age.pop_first()?;
        self.stamps.remove(&chain);
        Some(chain)
    }
}

/// The fleet while the trace replays.
struct Fleet {
    config: SimConfig,
    workers: Vec<Worker>,
    /// chain hash → the workers holding it.
    holders: HashMap<u64, Vec<u32>>,
    stamp: u64,
    holds: u64,
    /// Scratch of [`Fleet::ground_truth`]: matched blocks per worker.
    matched: Vec<u32>,
    /// Requests still decoding: (end in µs, worker, blocks), earliest end first.
    decoding: BinaryHeap<Reverse<(u64, u32, u64)>>,
}

impl Fleet {
    fn new(config: SimConfig) -> Fleet {
        Fleet {
            config,
            workers: (0..config.workers).map(|_| Worker::default()).collect(),
            holders: HashMap::new(),
            stamp: 0,
            holds: 0,
            matched: vec![0; config.workers as usize],
            decoding: BinaryHeap::new(),
        }
    }

    /// Leading blocks of `blocks` each worker holds, sorted by worker id.
    fn ground_truth(&mut self, blocks: &[Block]) -> Vec<(u32, u32)> {
        let mut touched = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            let Some(hs) = self.holders.get(&b.chain) else {
                break;
            };
            let mut extended = false;
            for &w in hs {
                let m = &mut self.matched[w as usize];
                if *m == i as u32 {
                    if i == 0 {
                        touched.push(w);
                    }
                    *m += 1;
                    extended = true;
                }
            }
            if !extended {
                break;
            }
        }
        touched.sort_unstable();
        touched
            .into_iter()
            .map(|w| (w, std::mem::take(&mut self.matched[w as usize])))
            .collect()
    }

    /// Ends the decoding of every request finished by `now_us`.
    fn advance(&mut self, now_us: u64) {
        while let Some(&Reverse((end, w, blocks))) = self.decoding.peek() {
            if end > now_us {
                break;
            }
            self.decoding.pop();
            self.workers[w as usize].load -= blocks;
        }
    }

    /// The worker of least cost (blocks to prefill + load), ties by least load, then lowest id;
    /// returns it and its cached prefix.
    fn route(&mut self, truth: &[(u32, u32)], blocks: usize) -> (u32, u32) {
        for &(w, m) in truth {
            self.matched[w as usize] = m;
        }
        let cost = |w: u32| {
            let prefill = blocks as u64 - u64::from(self.matched[w as usize]);
            let load = self.workers[w as usize].load;
            (prefill + load, load, w)
        };
        let w = (0..self.config.workers)
            .min_by_key(|&w| cost(w))
            .expect("at least one worker");
        let held = self.matched[w as usize];
        for &(w, _) in truth {
            self.matched[w as usize] = 0;
        }
        (w, held)
    }

    /// Counts the request's blocks on `w`'s load until it has decoded `output_tokens`.
    fn start_decoding(&mut self, w: u32, blocks: usize, now_us: u64, output_tokens: u64) {
        let end = now_us + (output_tokens as f64 * DECODE_MS_PER_TOKEN * 1000.0) as u64;
        self.workers[w as usize].load += blocks as u64;
        self.decoding.push(Reverse((end, w, blocks as u64)));
    }

    /// Stores the request's blocks on `w` (those past its `held` prefix are new), refreshing
    /// them last to first, then evicts; returns the events.
    fn store(&mut self, w: u32, held: u32, blocks: &[Block]) -> Vec<Event> {
        let kept = blocks.len().min(self.config.worker_blocks as usize);
        let held = (held as usize).min(kept);
        let worker = &mut self.workers[w as usize];
        for b in blocks[..kept].iter().rev() {
            self.stamp += 1;
            if worker.touch(b.chain, self.stamp) {
                self.holders.entry(b.chain).or_default().push(w);
                self.holds += 1;
            }
        }
        let mut events = Vec::new();
        if kept > held {
            events.push(Event::Stored {
                worker: w,
                parent: held.checked_sub(1).map(|i| blocks[i].chain),
                blocks: blocks[held..kept].to_vec(),
            });
        }
        let removed = self.evict(w);
        if !removed.is_empty() {
            events.push(Event::Removed {
                worker: w,
                blocks: removed,
            });
        }
        events
    }

    fn evict(&mut self, w: u32) -> Vec<u64> {
        let worker = &mut self.workers[w as usize];
        let mut removed = Vec::new();
        while worker.stamps.len() > self.config.worker_blocks as usize {
            let chain = worker
                .evict_oldest()
                .expect("over capacity means non-empty");
            let hs = self
                .holders
                .get_mut(&chain)
                .expect("held blocks have holders");
            hs.retain(|&h| h != w);
            if hs.is_empty() {
                self.holders.remove(&chain);
            }
            self.holds -= 1;
            removed.push(chain);
        }
        removed
    }
}

/// Caches the content hashes of each trace id (a shared prefix recurs in many requests).
#[derive(Default)]
struct BlockMaker {
    contents: HashMap<u64, Vec<u64>>,
}

impl BlockMaker {
    fn blocks(&mut self, hash_ids: &[u64], expand: u32) -> Vec<Block> {
        let mut parent = None;
        let mut out = Vec::with_capacity(hash_ids.len() * expand as usize);
        for &id in hash_ids {
            let contents = self
                .contents
                .entry(id)
                .or_insert_with(|| id_contents(id, expand));
            for &content in contents.iter() {
                let chain = chain_hash(parent, content);
                out.push(Block { content, chain });
                parent = Some(chain);
            }
        }
        out
    }
}

/// Replays `trace` onto the fleet of `config`: per request, in trace order, its lookup (with the
/// ground truth before it is served), then its store and the removals it causes.
pub fn simulate(trace: &[TraceRequest], config: SimConfig) -> Result<Simulation, String> {
    config.validate()?;
    let mut fleet = Fleet::new(config);
    let mut maker = BlockMaker::default();
    let mut sim = Simulation {
        config,
        ..Simulation::default()
    };
    for req in trace {
        let blocks = maker.blocks(&req.hash_ids, config.expand);
        if blocks.is_empty() {
            continue;
        }
        let now_us = (req.timestamp_ms.max(0.0) * 1000.0 / f64::from(config.speed)) as u64;
        fleet.advance(now_us);
        let truth = fleet.ground_truth(&blocks);
        let (w, held) = fleet.route(&truth, blocks.len());
        fleet.start_decoding(w, blocks.len(), now_us, req.output_length);
        sim.ops.push(Op::Lookup(sim.lookups.len() as u32));
        for event in fleet.store(w, held, &blocks) {
            match &event {
                Event::Stored { blocks, .. } => sim.stored_blocks += blocks.len() as u64,
                Event::Removed { blocks, .. } => sim.removed_blocks += blocks.len() as u64,
                Event::Cleared { .. } => {}
            }
            sim.ops.push(Op::Event(sim.events.len() as u32));
            sim.events.push(event);
            sim.event_at_us.push(now_us);
        }
        sim.peak_holds = sim.peak_holds.max(fleet.holds);
        sim.lookups.push(Lookup {
            blocks,
            truth,
            at_us: now_us,
        });
    }
    sim.final_holds = fleet.holds;
    Ok(sim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashes::request_blocks;

    /// A request arriving long after the previous ones finished (no load), decoding one token.
    fn req(ids: &[u64]) -> TraceRequest {
        timed(ids, 0.0, 1)
    }

    fn timed(ids: &[u64], timestamp_ms: f64, output_length: u64) -> TraceRequest {
        TraceRequest {
            timestamp_ms,
            input_length: ids.len() as u64 * 512,
            output_length,
            hash_ids: ids.to_vec(),
        }
    }

    /// Spreads `reqs` 1,000 s apart, so each arrives on an idle fleet.
    fn idle(mut reqs: Vec<TraceRequest>) -> Vec<TraceRequest> {
        for (i, r) in reqs.iter_mut().enumerate() {
            r.timestamp_ms = i as f64 * 1e6;
        }
        reqs
    }

    fn config(workers: u32, worker_blocks: u32) -> SimConfig {
        SimConfig {
            workers,
            worker_blocks,
            ..SimConfig::default()
        }
    }

    fn chains(ids: &[u64]) -> Vec<u64> {
        request_blocks(ids, 1).iter().map(|b| b.chain).collect()
    }

    #[test]
    fn ground_truth_and_routing_on_a_hand_made_trace() {
        // On an idle fleet the longest cached prefix wins, ties by lowest id:
        // r0 [0,1,2] → w0; r1 [0,1,5] matches w0 for 2 → w0; r2 [7] matches nobody → w0 (tie);
        // r3 [0,9] → w0 (prefix 1); r4 [7,8] → w0 (prefix 1).
        let trace = idle(vec![
            req(&[0, 1, 2]),
            req(&[0, 1, 5]),
            req(&[7]),
            req(&[0, 9]),
            req(&[7, 8]),
        ]);
        let sim = simulate(&trace, config(2, 100)).unwrap();
        let truths: Vec<_> = sim.lookups.iter().map(|l| l.truth.clone()).collect();
        assert_eq!(
            truths,
            vec![vec![], vec![(0, 2)], vec![], vec![(0, 1)], vec![(0, 1)]]
        );
        let stores: Vec<_> = sim
            .events
            .iter()
            .map(|e| match e {
                Event::Stored {
                    worker,
                    parent,
                    blocks,
                } => (*worker, *parent, blocks.len()),
                other => panic!("no removals expected: {other:?}"),
            })
            .collect();
        let c012 = chains(&[0, 1, 2]);
        assert_eq!(
            stores,
            vec![
                (0, None, 3),
                (0, Some(c012[1]), 1),
                (0, None, 1),
                (0, Some(c012[0]), 1),
                (0, Some(chains(&[7])[0]), 1),
            ]
        );
        // Each request: its lookup first, then its events.
        assert_eq!(sim.ops[0], Op::Lookup(0));
        assert_eq!(sim.ops[1], Op::Event(0));
        assert_eq!(sim.final_holds, 7);
    }

    #[test]
    fn load_moves_a_request_off_its_prefix_holder_and_ties_go_to_least_load_then_id() {
        // All at t=0, decoding 1,000 tokens (20 s). r0 [0,1,2] → w0 (load 3).
        // r1 [0,5]: w0 costs 1 + 3, w1 and w2 cost 2 + 0 → w1 (lower id): block 0 now on two.
        // r2 [6]: w0 1 + 3, w1 1 + 2, w2 1 + 0 → w2.
        // r3 [0,5,7] at 30 s, all idle again: w1 holds [0,5] → w1 (truth w0: 1, w1: 2).
        // r4 [9] at 30 s: w0 1 + 0, w1 1 + 3, w2 1 + 0 → w0 (tie with w2 on cost and load).
        let trace = vec![
            timed(&[0, 1, 2], 0.0, 1000),
            timed(&[0, 5], 0.0, 1000),
            timed(&[6], 0.0, 1000),
            timed(&[0, 5, 7], 30_000.0, 1000),
            timed(&[9], 30_000.0, 1000),
        ];
        let sim = simulate(&trace, config(3, 100)).unwrap();
        let workers: Vec<u32> = sim
            .events
            .iter()
            .map(|e| match e {
                Event::Stored { worker, .. } => *worker,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(workers, vec![0, 1, 2, 1, 0]);
        assert_eq!(sim.lookups[3].truth, vec![(0, 1), (1, 2)]);
    }

    #[test]
    fn lookups_and_their_events_carry_the_request_s_arrival() {
        // Two requests 4 s apart at speed 2: their lookups at 0 and 2 s of the simulation's
        // clock; the second stores a block and evicts one (one block per worker), both then.
        let trace = vec![timed(&[0], 0.0, 1), timed(&[1], 4_000.0, 1)];
        let sim = simulate(
            &trace,
            SimConfig {
                speed: 2,
                ..config(1, 1)
            },
        )
        .unwrap();
        let at: Vec<u64> = sim.lookups.iter().map(|l| l.at_us).collect();
        assert_eq!(at, [0, 2_000_000]);
        assert_eq!(sim.event_at_us.len(), sim.events.len());
        assert_eq!(sim.event_at_us, [0, 2_000_000, 2_000_000]);
    }

    #[test]
    fn speed_compresses_arrivals_so_requests_overlap() {
        // r0 decodes 100 tokens (2 s); r1 arrives 4 s later: after r0 at speed 1 (idle fleet →
        // w0), during it at speed 4 (1 s later → w0 is loaded → w1).
        let trace = vec![timed(&[0], 0.0, 100), timed(&[1], 4_000.0, 100)];
        let worker_of_r1 = |speed| {
            let sim = simulate(
                &trace,
                SimConfig {
                    speed,
                    ..config(2, 100)
                },
            )
            .unwrap();
            match sim.events[1] {
                Event::Stored { worker, .. } => worker,
                _ => unreachable!(),
            }
        };
        assert_eq!(worker_of_r1(1), 0);
        assert_eq!(worker_of_r1(4), 1);
        assert!(
            simulate(
                &trace,
                SimConfig {
                    speed: 0,
                    ..config(2, 100)
                }
            )
            .is_err()
        );
    }

    #[test]
    fn lru_evicts_the_least_recent_leaves_first() {
        // One worker of 4 blocks. r0 [0,1,2] holds 3; r1 [5,6] adds 2 → 5 > 4: the oldest is
        // r0's tail (block 2), since a request refreshes last to first.
        let trace = idle(vec![req(&[0, 1, 2]), req(&[5, 6]), req(&[0, 1, 2])]);
        let sim = simulate(&trace, config(1, 4)).unwrap();
        let c = chains(&[0, 1, 2]);
        assert_eq!(
            sim.events[2],
            Event::Removed {
                worker: 0,
                blocks: vec![c[2]]
            }
        );
        // r2 finds the prefix [0,1] still held and stores block 2 again after block 1.
        assert_eq!(sim.lookups[2].truth, vec![(0, 2)]);
        match &sim.events[3] {
            Event::Stored { parent, blocks, .. } => {
                assert_eq!(*parent, Some(c[1]));
                assert_eq!(
                    blocks.iter().map(|b| b.chain).collect::<Vec<_>>(),
                    vec![c[2]]
                );
            }
            other => panic!("{other:?}"),
        }
        // Holding [0,1,5,6] + 2 → evict the least recent: 0 and 1 were refreshed by r2 just
        // before, so r1's tail 6 goes.
        let c56 = chains(&[5, 6]);
        assert_eq!(
            sim.events[4],
            Event::Removed {
                worker: 0,
                blocks: vec![c56[1]]
            }
        );
        assert_eq!(sim.final_holds, 4);
        assert_eq!(sim.peak_holds, 4);
        assert_eq!(sim.removed_blocks, 2);
    }

    #[test]
    fn expansion_multiplies_blocks_and_matched_counts() {
        let trace = idle(vec![req(&[0, 1]), req(&[0, 2])]);
        let sim = simulate(
            &trace,
            SimConfig {
                expand: 32,
                ..config(2, 1000)
            },
        )
        .unwrap();
        assert_eq!(sim.lookups[0].blocks.len(), 64);
        assert_eq!(sim.lookups[1].truth, vec![(0, 32)]);
        assert_eq!(sim.stored_blocks, 96);
        assert_eq!(sim.config.tokens_per_block(), 16);
        assert!(
            simulate(
                &trace,
                SimConfig {
                    expand: 3,
                    ..config(2, 10)
                }
            )
            .is_err()
        );
    }

    #[test]
    fn a_request_longer_than_a_worker_keeps_its_leading_blocks() {
        let trace = idle(vec![req(&[0, 1, 2, 3, 4]), req(&[0, 1, 2, 3, 4])]);
        let sim = simulate(&trace, config(1, 3)).unwrap();
        assert_eq!(sim.lookups[1].truth, vec![(0, 3)]);
        assert_eq!(sim.final_holds, 3);
    }
}
