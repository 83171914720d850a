//! A chain lookup's answer built straight from its runs (docs/BEHAVIOUR.md §8.3, §9): scores,
//! depth-aware distinguishing power and the answer's order in three passes over the runs, each
//! score written once, in its final place.
//!
//! Why: with many replicas holding a shared prefix, a lookup's cost is per holder, not per block
//! (the Mooncake trace's median lookup: ~40 holders of a 32-block system prompt). The general path
//! ([`Index::score_runs`], then `depth_power_by_block`, then `order_by_walk`) writes every score
//! three times and walks its arrays four times. This path takes the usual shape only: the
//! scored runs end at no more than [`FEW_GROUPS`] blocks, the request's counts make matched tokens
//! grow with the block (so a group is a block) and the scope is small enough for the name walk.
//! The runs may take any number of distinct scores (holders stored at different times have
//! different freshness): the distinct values are sorted, not the runs (at 1,024 workers on the
//! Mooncake trace's clock, −36% of a lookup's instructions against sorting every score:
//! perf/runs/2026-12-07-layout-bound.md). Anything else returns `false` with nothing written,
//! and the general path answers; both give the same answer, which the index tests check against
//! the reference model.

use super::{
    FEW_GROUPS, MIN_WALK_SCORES, Score, WALK_STEPS_PER_COMPARE, descending, distinguishing_power,
    freshness, ranking,
};
use crate::index::Index;

/// What a chain answer needs besides the runs.
pub(super) struct AnswerInputs {
    /// The scope every run's replica serves in (its name order is the tie-break).
    pub scope: u32,
    /// The model scope (stats rows for pressure).
    pub mscope: u32,
    /// Serving replicas in the scope (`total` of §9.4).
    pub total: usize,
    pub ttft_ms: i32,
    pub now: i64,
    pub ttl: i64,
}

/// The groups of scored runs by their last block (at most [`FEW_GROUPS`]).
#[derive(Default)]
pub(super) struct Groups {
    blocks: [u32; FEW_GROUPS],
    /// The matched tokens of the group's runs (equal: the sum of the request's counts up to
    /// its block).
    matched: [i32; FEW_GROUPS],
    sizes: [i64; FEW_GROUPS],
    len: usize,
}

impl Groups {
    /// The group of runs ending at `block`, added if new; `None` when there would be too many.
    #[inline]
    pub(super) fn of(&mut self, block: u32, matched: i32) -> Option<u8> {
        if let Some(g) = self.find(block) {
            // Runs reaching one block matched the same tokens; were it not so, the general
            // path groups them by tokens.
            if self.matched[g] != matched {
                return None;
            }
            self.sizes[g] += 1;
            return Some(g as u8);
        }
        if self.len == FEW_GROUPS {
            return None;
        }
        self.blocks[self.len] = block;
        self.matched[self.len] = matched;
        self.sizes[self.len] = 1;
        self.len += 1;
        Some((self.len - 1) as u8)
    }

    /// §9.5: a group's factor is the distinguishing power of the runs matching at least as
    /// much, that is of the groups ending at or after its block (as `depth_power_few_blocks`).
    pub(super) fn factors(&self, total: usize) -> [f32; FEW_GROUPS] {
        let mut factors = [1.0f32; FEW_GROUPS];
        for (g, factor) in factors[..self.len].iter_mut().enumerate() {
            let right: i64 = (0..self.len)
                .filter(|&h| self.blocks[h] >= self.blocks[g])
                .map(|h| self.sizes[h])
                .sum();
            *factor = distinguishing_power(right, total as i64) as f32;
        }
        factors
    }

    /// One more run in group `g` (found by [`Groups::of`] for an equal run).
    #[inline]
    fn count_again(&mut self, g: u8) {
        self.sizes[g as usize] += 1;
    }

    /// The group of runs ending at `block`, if there is one.
    #[inline]
    pub(super) fn find(&self, block: u32) -> Option<usize> {
        self.blocks[..self.len].iter().position(|&b| b == block)
    }

    /// Whether a group ending at a later block always matched more tokens. §9.5 groups scores
    /// by equal matched tokens and counts, for each, the scores matching at least as much;
    /// [`Groups::factors`] groups by block and counts the runs ending at or after it. The two
    /// agree exactly when matched tokens grow strictly with the block (not so when the request
    /// has blocks of zero or negative tokens, or its sums wrap around).
    fn matched_grow_with_block(&self) -> bool {
        let n = self.len;
        (0..n).all(|g| {
            (0..n).all(|h| self.blocks[g] >= self.blocks[h] || self.matched[g] < self.matched[h])
        })
    }
}

/// The classes of scored runs: runs with the same score before distinguishing power and the
/// same group get the same final score, so pass 2 works per class, not per run. Kept in the
/// lookup's scratch and reused: no allocation once it has grown to the largest answer.
#[derive(Default)]
pub(super) struct Classes {
    /// Classes in this lookup: the first `len` entries of the columns below, which only grow
    /// (to the most runs a lookup had), so adding a class is a write, not a push.
    len: usize,
    /// The class's score before its group's factor.
    score: Vec<f32>,
    group: Vec<u8>,
    count: Vec<u32>,
    /// Pass 2: the class's final score and its rank among the answer's distinct final scores
    /// (read together for each run placed).
    placed: Vec<(f32, u32)>,
    /// Classes by (score bits, group), open addressing: `(epoch, class, key)`; an entry of
    /// another epoch is empty, so the table is never cleared.
    table: Vec<(u32, u32, u64)>,
    epoch: u32,
    /// Pass 2: `descending final score << 32 | class` for the first `len` classes, sorted (one
    /// integer a comparison, not a pair).
    order: Vec<u64>,
    /// Pass 2 and 3: where each distinct value's stretch of the answer starts, then the next
    /// free place in it (one per distinct value, at most `len`).
    next: Vec<u32>,
}

impl Classes {
    /// Empties the classes for a lookup of at most `runs` scored runs.
    fn reset(&mut self, runs: usize) {
        self.len = 0;
        if self.score.len() < runs {
            self.score.resize(runs, 0.0);
            self.group.resize(runs, 0);
            self.count.resize(runs, 0);
            self.placed.resize(runs, (0.0, 0));
            self.order.resize(runs, 0);
            self.next.resize(runs, 0);
        }
        // At most half full: a probe ends within a few entries.
        let size = (2 * runs).next_power_of_two().max(16);
        if self.table.len() < size {
            self.table.resize(size, (0, 0, 0));
        }
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.table.iter_mut().for_each(|e| e.0 = 0);
            self.epoch = 1;
        }
    }

    /// The class of a run scoring `score` in `group` (counted), added if new. Scores are
    /// compared by their bits, as equal runs compute them.
    fn of(&mut self, score: f32, group: u8) -> u32 {
        let key = u64::from(score.to_bits()) | u64::from(group) << 32;
        let mask = self.table.len() - 1;
        let mut i = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize & mask;
        loop {
            let (epoch, class, k) = self.table[i];
            if epoch != self.epoch {
                // A new class: at most one per scored run, and `reset` made room for them all.
                let c = self.len;
                self.table[i] = (self.epoch, c as u32, key);
                self.score[c] = score;
                self.group[c] = group;
                self.count[c] = 1;
                self.len += 1;
                return c as u32;
            }
            if k == key {
                self.count_again(class);
                return class;
            }
            i = (i + 1) & mask;
        }
    }

    /// One more run in class `class` (found by [`Classes::of`] for an equal run).
    #[inline]
    fn count_again(&mut self, class: u32) {
        self.count[class as usize] += 1;
    }

    /// Pass 2: each class's final score (its group's factor applied, as `depth_power_by_block`
    /// does when `total > 1`), its rank among the distinct final values, and in `next` where
    /// each value's stretch of the answer starts (the larger values first). Sorts the classes,
    /// not the runs. Returns false for a NaN.
    fn final_scores(&mut self, groups: &Groups, total: usize) -> bool {
        let factors = if total > 1 {
            groups.factors(total)
        } else {
            [1.0; FEW_GROUPS]
        };
        let n = self.len;
        let columns = (self.score[..n].iter().zip(&self.group[..n]))
            .zip(self.placed[..n].iter_mut().zip(&mut self.order[..n]));
        for (c, ((&score, &group), (placed, order))) in columns.enumerate() {
            let score = score * factors[usize::from(group) % FEW_GROUPS];
            if score.is_nan() {
                return false;
            }
            placed.0 = score;
            *order = u64::from(descending(score)) << 32 | c as u64;
        }
        let order = &mut self.order[..n];
        order.sort_unstable();
        // Value `v`'s stretch starts after the scores of the larger values.
        let (mut at, mut values, mut last) = (0u32, 0usize, None);
        for &entry in order.iter() {
            let (key, c) = (entry >> 32, entry as u32);
            if last != Some(key) {
                last = Some(key);
                self.next[values] = at;
                values += 1;
            }
            self.placed[c as usize].1 = (values - 1) as u32;
            at += self.count[c as usize];
        }
        true
    }
}

/// What a run's score, freshness and group depend on when no stats row gives its replica a
/// pressure: two runs with equal inputs score the same.
#[derive(Clone, Copy, PartialEq, Eq)]
struct RunInputs {
    matched: i32,
    oldest: i64,
    last_block: u32,
}

impl RunInputs {
    fn of(run: &super::Run) -> RunInputs {
        RunInputs {
            matched: run.matched,
            oldest: run.oldest,
            last_block: run.last_block,
        }
    }
}

impl Index {
    /// Builds the chain answer from `self.scratch.runs` into `self.last.scores` when the lookup
    /// has the usual shape (see the module doc), marking the scored runs. Returns false, with
    /// `self.last.scores` untouched, otherwise.
    pub(super) fn answer_from_runs(&mut self, a: &AnswerInputs) -> bool {
        // Fewer runs than this are ordered by comparing names (see `order_by_walk`).
        if self.scratch.runs.len() < MIN_WALK_SCORES {
            return false;
        }
        let mut classes = std::mem::take(&mut self.scratch.classes);
        let answered = self.answer_by_class(a, &mut classes);
        self.scratch.classes = classes;
        answered
    }

    /// [`Index::answer_from_runs`] with the classes' storage taken out of the scratch.
    fn answer_by_class(&mut self, a: &AnswerInputs, classes: &mut Classes) -> bool {
        let Some((groups, scored)) = self.score_runs_grouped(a, classes) else {
            return false;
        };
        if scored == 0 {
            return true;
        }
        if a.total > 1 && !groups.matched_grow_with_block() {
            return false;
        }
        if !classes.final_scores(&groups, a.total) {
            return false;
        }
        self.place_by_name(a.scope, scored, classes)
    }

    /// Pass 1: each run's freshness and class (its score before distinguishing power and its
    /// group, kept in the run's `value` until pass 3); marks the scored runs (positive matched
    /// sum, fresh oldest entry) as [`Index::score_runs`] does. Returns the groups and the
    /// number of scored runs, the classes in `classes`, or `None` when the runs end at more
    /// than [`FEW_GROUPS`] blocks.
    fn score_runs_grouped(
        &mut self,
        a: &AnswerInputs,
        classes: &mut Classes,
    ) -> Option<(Groups, usize)> {
        let coeff = self.cfg.ranker.slo_coeff(a.ttft_ms);
        let no_stats = self.cat.models[a.mscope as usize].stats.is_empty();
        let mut groups = Groups::default();
        classes.reset(self.scratch.runs.len());
        let mut scored = 0;
        // The last scored run's inputs and results: the holders of a shared prefix are mostly
        // equally fresh and end together, so without stats rows (no pressure per replica) the
        // next run usually scores the same, computed once.
        let mut last: Option<(RunInputs, f32, u32, u8)> = None;
        for i in 0..self.scratch.runs.len() {
            let run = self.scratch.runs[i];
            if run.matched <= 0 {
                continue;
            }
            let inputs = RunInputs::of(&run);
            let (fresh, class, group) = match last {
                Some((l, fresh, class, group)) if no_stats && l == inputs => {
                    groups.count_again(group);
                    classes.count_again(class);
                    (fresh, class, group)
                }
                _ => {
                    let fresh = freshness(a.now, run.oldest, a.ttl);
                    if fresh <= 0.0 {
                        continue;
                    }
                    let group = groups.of(run.last_block, run.matched)?;
                    let pressure = if no_stats {
                        0.0
                    } else {
                        self.prefix_pressure(a.mscope, run.replica, a.now, a.ttl)
                    };
                    let score = self.cfg.ranker.prefix_score(
                        i64::from(run.matched),
                        fresh,
                        pressure,
                        coeff,
                    );
                    (fresh, classes.of(score, group), group)
                }
            };
            last = Some((inputs, fresh, class, group));
            let run = &mut self.scratch.runs[i];
            run.scored = true;
            run.fresh = fresh;
            run.value = class;
            scored += 1;
        }
        Some((groups, scored))
    }

    /// Pass 3: writes each scored run's final score (its class's) into its place: its value's stretch, in the
    /// order of the scope's replicas by name (`ScopeRec::sorted`; the run of a replica is found
    /// through the slots the walk set). Returns false, writing nothing, when the walk would
    /// cost more than a sort (as `order_by_walk` decides) or does not find every scored run.
    fn place_by_name(&mut self, scope: u32, scored: usize, classes: &mut Classes) -> bool {
        let by_name = &self.cat.scopes[scope as usize].sorted;
        let log2 = (usize::BITS - scored.leading_zeros()) as usize;
        if scored < MIN_WALK_SCORES || by_name.len() > scored * log2 * WALK_STEPS_PER_COMPARE {
            return false;
        }
        let sc = &mut self.scratch;
        let next = &mut classes.next;
        let mut out = std::mem::take(&mut self.last.scores);
        out.clear();
        out.resize(scored, Score::PLACEHOLDER);
        let mut placed = 0;
        for &r in by_name {
            let Some(at) = sc.walk.index_of(r) else {
                continue;
            };
            let run = &sc.runs[at];
            if !run.scored {
                continue;
            }
            let (score, value) = classes.placed[run.value as usize];
            let at = &mut next[value as usize];
            out[*at as usize] = Score {
                replica: run.replica,
                score,
                matched_tokens: run.matched,
                estimated_cache_hit_prob: run.fresh,
                tier: ranking::tier_to_wire(run.tier),
            };
            *at += 1;
            placed += 1;
        }
        if placed != scored {
            debug_assert!(
                false,
                "a scored replica missing from its scope's name order"
            );
            out.clear();
            self.last.scores = out;
            return false;
        }
        self.last.scores = out;
        true
    }
}
