//! A prototype of the run-record layout (perf/runs/2026-12-07-run-census.md), measured beside
//! ours and kv-index on the same streams. **Not the product**: it holds only what this trace's
//! events carry (one tenant, model and keyspace; no TTL sweep, cap, quota, LFU, persistence or
//! stats) so that it can say what the layout costs and gives before the store is rebuilt on it.
//!
//! The layout: a held chain's blocks are appended to one *run*, a vector of their 8-byte chain
//! hashes, as long as each new block follows the run's last one; a block whose predecessor is
//! not a run's last block starts a new run. A holder is an *extent* of a run: a replica, the
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
//! round runs the prototype, ours and kv-index one after another (events alone, then the mixed
//! stream) on the pinned core; medians over rounds.
#[allow(dead_code)]
#[path = "../src/adapters.rs"]
mod adapters;
#[allow(dead_code)]
#[path = "../src/alloc.rs"]
mod alloc;
#[path = "../src/server_alloc.rs"]
mod server_alloc;

/// Counting, on top of the server's allocator (see `alloc`).
#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

use fleetsim::{Adapter, Block, Op, SimConfig, Simulation, parse_trace, simulate};
use inferencecache_index::index::ranking::{self, RankerConfig, Tier};
use std::hash::BuildHasher;
use std::time::Instant;

/// The simulation's time 0 and the TTL, as ours' adapter has them.
const EPOCH_NS: i64 = 1_800_000_000_000_000_000;
const TTL_NS: i64 = 24 * 3600 * 1_000_000_000;

/// The table: held chain hash → (run, offset), 8 bytes per bucket (a 16-bit tag beside a
/// 24-bit run and a 24-bit offset), probed linearly, at most 3/4 full, split into
/// [`SEGMENTS`] tables that grow apart (as ours' key table is, for the same reason: no insert
/// rehashes more than a small share of the keys). A tag match is confirmed by the run's hash at
/// the offset, which a lookup and a store read next anyway; a removal leaves a tombstone.
struct LocTable {
    seed: u64,
    segments: Vec<Segment>,
}

#[derive(Default)]
struct Segment {
    buckets: Vec<u64>,
    live: usize,
    tombs: usize,
}

const SEGMENT_BITS: u32 = 8;
const SEGMENTS: usize = 1 << SEGMENT_BITS;
const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const FIELD: u32 = 24;
const FIELD_MASK: u64 = (1 << FIELD) - 1;

impl LocTable {
    fn new(seed: u64) -> LocTable {
        LocTable {
            seed: seed | 1,
            segments: (0..SEGMENTS).map(|_| Segment::default()).collect(),
        }
    }

    #[inline(always)]
    fn hash(&self, key: u64) -> u64 {
        let p = (key ^ 0x9e37_79b9_7f4a_7c15) as u128 * self.seed as u128;
        p as u64 ^ (p >> 64) as u64
    }

    #[inline(always)]
    fn entry(h: u64, loc: Loc) -> u64 {
        debug_assert!(u64::from(loc.run) <= FIELD_MASK && u64::from(loc.off) <= FIELD_MASK);
        ((h >> 48) | 0x8000) << 48 | u64::from(loc.run) << FIELD | u64::from(loc.off)
    }

    #[inline(always)]
    fn loc(e: u64) -> Loc {
        Loc {
            run: ((e >> FIELD) & FIELD_MASK) as u32,
            off: (e & FIELD_MASK) as u32,
        }
    }

    #[inline(always)]
    fn segment(h: u64) -> usize {
        (h >> 32) as usize & (SEGMENTS - 1)
    }

    fn get(&self, key: u64, runs: &[Run]) -> Option<Loc> {
        let h = self.hash(key);
        let seg = &self.segments[Self::segment(h)];
        if seg.buckets.is_empty() {
            return None;
        }
        let (mask, tag) = (seg.buckets.len() - 1, (h >> 48) | 0x8000);
        let mut i = h as usize & mask;
        loop {
            let e = seg.buckets[i];
            if e == EMPTY {
                return None;
            }
            if e >> 48 == tag {
                let loc = Self::loc(e);
                if runs[loc.run as usize].hashes[loc.off as usize] == key {
                    return Some(loc);
                }
            }
            i = (i + 1) & mask;
        }
    }

    /// Stores `loc` under `key`, which must be absent.
    fn insert(&mut self, key: u64, loc: Loc, runs: &[Run]) {
        let h = self.hash(key);
        let seed = self.seed;
        let seg = &mut self.segments[Self::segment(h)];
        if (seg.live + seg.tombs + 1) * 4 > seg.buckets.len() * 3 {
            seg.grow(seed, runs);
        }
        let mask = seg.buckets.len() - 1;
        let mut i = h as usize & mask;
        while seg.buckets[i] > TOMB {
            i = (i + 1) & mask;
        }
        if seg.buckets[i] == TOMB {
            seg.tombs -= 1;
        }
        seg.buckets[i] = Self::entry(h, loc);
        seg.live += 1;
    }

    /// Removes the entry of `key` at `loc`.
    fn remove(&mut self, key: u64, loc: Loc) {
        let h = self.hash(key);
        let want = Self::entry(h, loc);
        let seg = &mut self.segments[Self::segment(h)];
        let mask = seg.buckets.len() - 1;
        let mut i = h as usize & mask;
        while seg.buckets[i] != want {
            debug_assert_ne!(seg.buckets[i], EMPTY, "a held key is in the table");
            i = (i + 1) & mask;
        }
        seg.live -= 1;
        if seg.buckets[(i + 1) & mask] == EMPTY {
            seg.buckets[i] = EMPTY;
            let mut j = i.wrapping_sub(1) & mask;
            while seg.buckets[j] == TOMB {
                seg.buckets[j] = EMPTY;
                seg.tombs -= 1;
                j = j.wrapping_sub(1) & mask;
            }
        } else {
            seg.buckets[i] = TOMB;
            seg.tombs += 1;
        }
    }

    /// Starts loading the bucket a probe for `key` reads first.
    #[inline(always)]
    fn prefetch(&self, key: u64) {
        let h = self.hash(key);
        let seg = &self.segments[Self::segment(h)];
        if let Some(b) = seg
            .buckets
            .get(h as usize & seg.buckets.len().wrapping_sub(1))
        {
            // SAFETY: PREFETCHT0 is a hint: it never faults; `b` is a valid reference.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    (b as *const u64).cast(),
                )
            };
        }
    }

    fn bytes(&self) -> usize {
        self.segments.iter().map(|s| s.buckets.capacity() * 8).sum()
    }
}

impl Segment {
    /// Twice the buckets when at least half are live, else as many (the tombstones go); each
    /// entry's hash is its key's, read from its run.
    #[cold]
    fn grow(&mut self, seed: u64, runs: &[Run]) {
        let n = self.buckets.len();
        let size = if n == 0 {
            64
        } else if self.live * 2 >= n {
            n * 2
        } else {
            n
        };
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY; size]);
        let mask = size - 1;
        let hasher = LocTable {
            seed,
            segments: Vec::new(),
        };
        for e in old.into_iter().filter(|&e| e > TOMB) {
            let loc = LocTable::loc(e);
            let h = hasher.hash(runs[loc.run as usize].hashes[loc.off as usize]);
            let mut i = h as usize & mask;
            while self.buckets[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.buckets[i] = e;
        }
        self.tombs = 0;
    }
}

/// How many blocks ahead of the one it works on a store or removal starts loading buckets.
const AHEAD: usize = 16;

/// Where a held block lies.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Loc {
    run: u32,
    off: u32,
}

/// One holder's stretch of a run: offsets `lo..hi`, stored by one event.
#[derive(Clone, Copy, Debug)]
struct Extent {
    replica: u32,
    lo: u32,
    hi: u32,
    tier: Tier,
    last_seen: i64,
}

#[derive(Default)]
struct Run {
    hashes: Vec<u64>,
    holders: Vec<Extent>,
}

impl Run {
    fn covered(&self, off: u32) -> bool {
        self.holders.iter().any(|e| e.lo <= off && off < e.hi)
    }
}

/// A replica's state in the current lookup.
#[derive(Clone, Copy, Default)]
struct Match {
    epoch: u32,
    /// Blocks matched from block 0.
    blocks: u32,
    oldest: i64,
    tier: Tier,
}

/// One answered replica.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Answer {
    replica: u32,
    score: f32,
    matched_tokens: i32,
}

struct RunIndex {
    table: LocTable,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    /// Extents per replica (a replica with any serves in the scope: the depth power's total).
    extents_of: Vec<u32>,
    serving: usize,
    /// replica → its name's rank among all replicas' names ("w0" < "w1" < "w10" …).
    rank: Vec<u32>,
    tokens_per_block: i32,
    now: i64,
    ranker: RankerConfig,
    // Per-lookup scratch.
    epoch: u32,
    matches: Vec<Match>,
    touched: Vec<u32>,
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
        let seed = std::collections::hash_map::RandomState::new().hash_one(0u64);
        RunIndex {
            table: LocTable::new(seed),
            runs: Vec::new(),
            free_runs: Vec::new(),
            extents_of: vec![0; workers as usize],
            serving: 0,
            rank,
            tokens_per_block: tokens_per_block as i32,
            now: EPOCH_NS,
            ranker: RankerConfig::default(),
            epoch: 0,
            matches: vec![Match::default(); workers as usize],
            touched: Vec::new(),
            answer: Vec::new(),
            groups: Vec::new(),
            keys: Vec::new(),
            index_of: vec![0; workers as usize],
            ordered: Vec::new(),
            by_rank: names.iter().map(|(_, w)| *w).collect(),
        }
    }

    /// Heap bytes of the table, the runs' hash vectors and their extent vectors, and the
    /// number of runs in use.
    fn memory(&self) -> (usize, usize, usize, usize) {
        let hashes = self.runs.iter().map(|r| r.hashes.capacity() * 8).sum();
        let holders = (self.runs.iter())
            .map(|r| r.holders.capacity() * std::mem::size_of::<Extent>())
            .sum();
        let runs = self.runs.len() - self.free_runs.len();
        (self.table.bytes(), hashes, holders, runs)
    }

    fn new_run(&mut self, hash: u64) -> Loc {
        let run = match self.free_runs.pop() {
            Some(r) => r,
            None => {
                self.runs.push(Run::default());
                self.runs.len() as u32 - 1
            }
        };
        self.runs[run as usize].hashes.push(hash);
        Loc { run, off: 0 }
    }

    fn count_extent(&mut self, replica: u32, delta: i32) {
        let n = &mut self.extents_of[replica as usize];
        let before = *n;
        *n = (*n as i32 + delta) as u32;
        match (before, *n) {
            (0, 1..) => self.serving += 1,
            (1.., 0) => self.serving -= 1,
            _ => {}
        }
    }

    /// Adds `replica`'s entry at `loc` (stored at `self.now`, tier T1), extending the extent
    /// `cursor` names when it ends right before `loc` with the same time.
    fn hold(&mut self, loc: Loc, replica: u32, cursor: &mut Option<(u32, usize)>) {
        let now = self.now;
        let run = &mut self.runs[loc.run as usize];
        if let Some((r, i)) = *cursor
            && r == loc.run
            && let Some(e) = run.holders.get_mut(i)
            && e.replica == replica
            && e.hi == loc.off
            && e.last_seen == now
        {
            e.hi += 1;
            return;
        }
        let held = run
            .holders
            .iter()
            .position(|e| e.replica == replica && e.lo <= loc.off && loc.off < e.hi);
        if let Some(i) = held {
            // A refresh: the simulator never stores a block its worker holds.
            *cursor = Some((loc.run, i));
            return;
        }
        run.holders.push(Extent {
            replica,
            lo: loc.off,
            hi: loc.off + 1,
            tier: ranking::TIER_T1,
            last_seen: now,
        });
        *cursor = Some((loc.run, run.holders.len() - 1));
        self.count_extent(replica, 1);
    }

    /// Takes `replica`'s entry at `loc` out of its extent. Returns whether any extent still
    /// covers the block.
    fn release(&mut self, loc: Loc, replica: u32) -> bool {
        let run = &mut self.runs[loc.run as usize];
        let Some(i) = run
            .holders
            .iter()
            .position(|e| e.replica == replica && e.lo <= loc.off && loc.off < e.hi)
        else {
            return run.covered(loc.off);
        };
        let e = run.holders[i];
        let mut delta = 0;
        if e.hi - e.lo == 1 {
            run.holders.swap_remove(i);
            delta = -1;
        } else if loc.off + 1 == e.hi {
            run.holders[i].hi -= 1;
        } else if loc.off == e.lo {
            run.holders[i].lo += 1;
        } else {
            run.holders[i].hi = loc.off;
            run.holders.push(Extent {
                lo: loc.off + 1,
                ..e
            });
            delta = 1;
        }
        let covered = run.covered(loc.off);
        if delta != 0 {
            self.count_extent(replica, delta);
        }
        covered
    }

    /// Cuts off the run's tail that no extent covers (its table entries are gone already); a
    /// run left empty is freed.
    fn trim(&mut self, run_id: u32) {
        let run = &mut self.runs[run_id as usize];
        while let Some(last) = run.hashes.len().checked_sub(1) {
            if run.covered(last as u32) {
                break;
            }
            run.hashes.pop();
        }
        if run.hashes.is_empty() {
            debug_assert!(run.holders.is_empty());
            run.hashes = Vec::new();
            run.holders = Vec::new();
            self.free_runs.push(run_id);
        }
    }

    /// The chain answer for `blocks` into `self.answer`.
    #[inline(never)]
    fn lookup_answer(&mut self, blocks: &[Block], tokens_per_block: i32) {
        self.answer.clear();
        self.touched.clear();
        self.epoch = self.epoch.wrapping_add(1);
        let epoch = self.epoch;
        let mut i = 0usize;
        while i < blocks.len() {
            let Some(loc) = self.table.get(blocks[i].chain, &self.runs) else {
                break;
            };
            let run = &self.runs[loc.run as usize];
            let avail = (run.hashes.len() - loc.off as usize).min(blocks.len() - i);
            let along = &run.hashes[loc.off as usize..][..avail];
            let n = along
                .iter()
                .zip(&blocks[i..])
                .take_while(|(h, b)| **h == b.chain)
                .count();
            let (start, end) = (loc.off, loc.off + n as u32);
            // Each replica that matched blocks 0..i (every replica, at block 0) goes on along
            // the run through its extent covering the offset it reached, and on through the
            // next of its extents when one ends inside the piece (another pass, rarely).
            let mut any_to_end = false;
            loop {
                // Whether an extent ended inside the piece after extending its replica (another
                // of the replica's extents may go on from there, earlier in the list).
                let mut again = false;
                for e in &run.holders {
                    let m = &mut self.matches[e.replica as usize];
                    let matched = if m.epoch == epoch {
                        m.blocks as usize
                    } else if i == 0 {
                        0
                    } else {
                        continue;
                    };
                    if matched < i {
                        continue;
                    }
                    let reach = start + (matched - i) as u32;
                    if reach >= end || e.lo > reach || e.hi <= reach {
                        continue;
                    }
                    let upto = e.hi.min(end);
                    if m.epoch != epoch {
                        *m = Match {
                            epoch,
                            blocks: 0,
                            oldest: e.last_seen,
                            tier: e.tier,
                        };
                        self.touched.push(e.replica);
                    }
                    m.blocks = (i + (upto - start) as usize) as u32;
                    m.oldest = m.oldest.min(e.last_seen);
                    m.tier = ranking::worst_tier(m.tier, e.tier);
                    any_to_end |= upto == end;
                    again |= upto < end;
                }
                // A pass extends a replica only past where the last one left it, so the passes
                // end once no extent ends inside the piece after extending.
                if !again {
                    break;
                }
            }
            i += n;
            if !any_to_end {
                break;
            }
        }
        self.score(tokens_per_block);
    }

    /// The §9 scores of the touched replicas, depth power, then score order (ties by name).
    #[inline(never)]
    fn score(&mut self, tokens_per_block: i32) {
        let coeff = self.ranker.slo_coeff(0);
        // The last (blocks, oldest) scored and its score: a shared prefix's holders mostly
        // match as far and were stored at few moments.
        let mut last: Option<(u32, i64, f32)> = None;
        for &r in &self.touched {
            let m = self.matches[r as usize];
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
        "run records (prototype)".into()
    }
    fn clock(&mut self, at_us: u64) {
        self.now = EPOCH_NS + at_us as i64 * 1000;
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        let mut prev = parent.and_then(|p| self.table.get(p, &self.runs));
        let mut cursor = None;
        for b in blocks.iter().take(AHEAD) {
            self.table.prefetch(b.chain);
        }
        for (j, b) in blocks.iter().enumerate() {
            if let Some(ahead) = blocks.get(j + AHEAD) {
                self.table.prefetch(ahead.chain);
            }
            let loc = match self.table.get(b.chain, &self.runs) {
                Some(loc) => loc,
                None => {
                    let loc = match prev {
                        Some(p) if p.off as usize + 1 == self.runs[p.run as usize].hashes.len() => {
                            self.runs[p.run as usize].hashes.push(b.chain);
                            Loc {
                                run: p.run,
                                off: p.off + 1,
                            }
                        }
                        _ => self.new_run(b.chain),
                    };
                    self.table.insert(b.chain, loc, &self.runs);
                    loc
                }
            };
            self.hold(loc, worker, &mut cursor);
            prev = Some(loc);
        }
    }
    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        for h in chain_hashes.iter().take(AHEAD) {
            self.table.prefetch(*h);
        }
        for (j, h) in chain_hashes.iter().enumerate() {
            if let Some(&ahead) = chain_hashes.get(j + AHEAD) {
                self.table.prefetch(ahead);
            }
            let Some(loc) = self.table.get(*h, &self.runs) else {
                continue;
            };
            if !self.release(loc, worker) {
                self.table.remove(*h, loc);
                if loc.off as usize + 1 == self.runs[loc.run as usize].hashes.len() {
                    self.trim(loc.run);
                }
            }
        }
    }
    fn clear(&mut self, worker: u32) {
        // Not on this trace's path (the simulator emits no clears; the check asks for it once):
        // every run's extents of the worker go, then each block they leave uncovered.
        for run_id in 0..self.runs.len() as u32 {
            let run = &self.runs[run_id as usize];
            let offs: Vec<u32> = (run.holders.iter())
                .filter(|e| e.replica == worker)
                .flat_map(|e| e.lo..e.hi)
                .collect();
            for off in offs {
                let h = self.runs[run_id as usize].hashes[off as usize];
                self.remove(worker, &[h]);
            }
        }
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

/// `VERIFY=1`: ours and the prototype over the mixed stream in lockstep, every answer compared
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
                        eprintln!("lookup {l}: ours {:?}\n  prototype {:?}", a, b);
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
    let env =
        |name: &str, default: u32| std::env::var(name).map_or(default, |s| s.parse().unwrap());
    let (workers, expand) = (env("WORKERS", 64), env("EXPAND", 32));
    let config = SimConfig {
        workers,
        worker_blocks: fleetsim::sim::DEFAULT_WORKER_BLOCKS,
        expand,
        speed: (workers / 64).max(1),
    };
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
    let (table, hashes, holders, runs) = proto.memory();
    let holds = sim.final_holds.max(1) as f64;
    println!(
        "prototype after the events: {runs} runs; bytes per held block: table {:.1}, run hashes {:.1}, extents {:.1}, run headers {:.1}",
        table as f64 / holds,
        hashes as f64 / holds,
        holders as f64 / holds,
        (proto.runs.capacity() * std::mem::size_of::<Run>()) as f64 / holds,
    );
    let mut proto = RunIndex::new(workers, tpb);
    let report = fleetsim::check_stream(&sim, &mut proto, 3);
    println!(
        "prototype: {} ground-truth mismatches of {} lookups {:?}",
        report.mismatches, report.lookups, report.first
    );
    if rounds == 0 {
        return;
    }
    adapters_pin();
    type Make = Box<dyn Fn() -> Box<dyn Adapter>>;
    let makes: [(&str, Make); 3] = [
        (
            "run records (prototype)",
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
    let mut all: Vec<Vec<Figures>> = vec![Vec::new(); makes.len()];
    for _ in 0..rounds {
        for (i, (_, make)) in makes.iter().enumerate() {
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
