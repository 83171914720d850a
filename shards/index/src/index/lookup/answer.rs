//! A chain lookup's answer built straight from its runs (docs/BEHAVIOUR.md §8.3, §9): scores,
//! depth-aware distinguishing power and the answer's order in three passes over the runs, each
//! score written once, in its final place.
//!
//! Why: with many replicas holding a shared prefix, a lookup's cost is per holder, not per block
//! (the Mooncake trace's median lookup: ~40 holders of a 32-block system prompt). The general path
//! ([`Index::score_runs`], then `depth_power_by_block`, then `order_by_walk`) writes every score
//! three times and walks its arrays four times. This path takes the usual shape only: the
//! scored runs end at no more than [`FEW_GROUPS`] blocks, the request's counts make matched tokens
//! grow with the block (so a group is a block), the final scores take at most [`FEW_SCORES`]
//! values and the scope is small enough for the name walk. Anything else returns `false` with
//! nothing written, and the general path answers; both give the same answer, which the index
//! tests check against the reference model.

use super::{
    FEW_GROUPS, MIN_WALK_SCORES, Score, WALK_STEPS_PER_COMPARE, descending, distinguishing_power,
    freshness, ranking,
};
use crate::index::Index;

/// Most distinct final scores this path places without sorting: each distinct value gets its
/// stretch of the answer and the name walk fills the stretches, so ties come out by name.
const FEW_SCORES: usize = 8;

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

/// Most classes of scored runs (distinct pairs of a score before distinguishing power and a
/// group) this path takes; more go the general way.
const FEW_CLASSES: usize = 16;

/// The classes of scored runs: runs with the same score before distinguishing power and the
/// same group get the same final score, so pass 2 works per class, not per run.
#[derive(Default)]
pub(super) struct Classes {
    /// The class's score before its group's factor, then (after pass 2) its final score.
    score: [f32; FEW_CLASSES],
    group: [u8; FEW_CLASSES],
    count: [u32; FEW_CLASSES],
    /// The class's rank among the answer's distinct final scores (pass 2).
    value: [u8; FEW_CLASSES],
    len: usize,
}

impl Classes {
    /// The class of a run scoring `score` in `group` (counted), added if new; `None` when there
    /// would be too many. Scores are compared by their bits, as equal runs compute them.
    fn of(&mut self, score: f32, group: u8) -> Option<u8> {
        let bits = score.to_bits();
        let found =
            (0..self.len).find(|&c| self.score[c].to_bits() == bits && self.group[c] == group);
        let c = match found {
            Some(c) => c,
            None if self.len == FEW_CLASSES => return None,
            None => {
                self.score[self.len] = score;
                self.group[self.len] = group;
                self.count[self.len] = 0;
                self.len += 1;
                self.len - 1
            }
        };
        self.count[c] += 1;
        Some(c as u8)
    }

    /// Pass 2: each class's final score (its group's factor applied, as `depth_power_by_block`
    /// does when `total > 1`) and its rank among the distinct final values. Returns where each
    /// value's stretch of the answer starts, or `None` for a NaN or more than [`FEW_SCORES`]
    /// distinct values.
    fn final_scores(&mut self, groups: &Groups, total: usize) -> Option<[u32; FEW_SCORES]> {
        let factors = if total > 1 {
            groups.factors(total)
        } else {
            [1.0; FEW_GROUPS]
        };
        let mut values = [0u32; FEW_SCORES];
        let mut counts = [0u32; FEW_SCORES];
        let mut distinct = 0;
        for c in 0..self.len {
            let score = self.score[c] * factors[self.group[c] as usize];
            if score.is_nan() {
                return None;
            }
            self.score[c] = score;
            let key = descending(score);
            let v = match values[..distinct].iter().position(|&x| x == key) {
                Some(v) => v,
                None if distinct == FEW_SCORES => return None,
                None => {
                    values[distinct] = key;
                    distinct += 1;
                    distinct - 1
                }
            };
            counts[v] += self.count[c];
            self.value[c] = v as u8;
        }
        // A value's stretch starts after the scores of the larger values.
        let mut starts = [0u32; FEW_SCORES];
        for v in 0..distinct {
            starts[v] = (0..distinct)
                .filter(|&w| values[w] < values[v])
                .map(|w| counts[w])
                .sum();
        }
        Some(starts)
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
        let Some((groups, mut classes, scored)) = self.score_runs_grouped(a) else {
            return false;
        };
        if scored == 0 {
            return true;
        }
        if a.total > 1 && !groups.matched_grow_with_block() {
            return false;
        }
        let Some(stretches) = classes.final_scores(&groups, a.total) else {
            return false;
        };
        self.place_by_name(a.scope, scored, &classes, &stretches)
    }

    /// Pass 1: each run's freshness and class (its score before distinguishing power and its
    /// group, kept in the run's `value` until pass 3); marks the scored runs (positive matched
    /// sum, fresh oldest entry) as [`Index::score_runs`] does. Returns the groups, the classes
    /// and the number of scored runs, or `None` when the runs end at more than [`FEW_GROUPS`]
    /// blocks or take more than [`FEW_CLASSES`] classes.
    fn score_runs_grouped(&mut self, a: &AnswerInputs) -> Option<(Groups, Classes, usize)> {
        let coeff = self.cfg.ranker.slo_coeff(a.ttft_ms);
        let no_stats = self.cat.models[a.mscope as usize].stats.is_empty();
        let mut groups = Groups::default();
        let mut classes = Classes::default();
        let mut scored = 0;
        // The last scored run's inputs and results: the holders of a shared prefix are mostly
        // equally fresh and end together, so without stats rows (no pressure per replica) the
        // next run usually scores the same, computed once.
        let mut last: Option<(RunInputs, f32, u8)> = None;
        for i in 0..self.scratch.runs.len() {
            let run = self.scratch.runs[i];
            if run.matched <= 0 {
                continue;
            }
            let inputs = RunInputs::of(&run);
            let (fresh, class) = match last {
                Some((l, fresh, class)) if no_stats && l == inputs => {
                    groups.count_again(classes.group[class as usize]);
                    classes.count[class as usize] += 1;
                    (fresh, class)
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
                    (fresh, classes.of(score, group)?)
                }
            };
            last = Some((inputs, fresh, class));
            let run = &mut self.scratch.runs[i];
            run.scored = true;
            run.fresh = fresh;
            run.value = class;
            scored += 1;
        }
        Some((groups, classes, scored))
    }

    /// Pass 3: writes each scored run's final score (its class's) into its place: its value's stretch, in the
    /// order of the scope's replicas by name (`ScopeRec::sorted`; the run of a replica is found
    /// through the slots the walk set). Returns false, writing nothing, when the walk would
    /// cost more than a sort (as `order_by_walk` decides) or does not find every scored run.
    fn place_by_name(
        &mut self,
        scope: u32,
        scored: usize,
        classes: &Classes,
        starts: &[u32; FEW_SCORES],
    ) -> bool {
        let by_name = &self.cat.scopes[scope as usize].sorted;
        let log2 = (usize::BITS - scored.leading_zeros()) as usize;
        if scored < MIN_WALK_SCORES || by_name.len() > scored * log2 * WALK_STEPS_PER_COMPARE {
            return false;
        }
        let sc = &mut self.scratch;
        let mut next = *starts;
        let mut out = std::mem::take(&mut self.last.scores);
        out.clear();
        out.resize(scored, Score::PLACEHOLDER);
        let mut placed = 0;
        for &r in by_name {
            let Some(slot) = sc.slots.get(r as usize) else {
                continue;
            };
            if slot.epoch != sc.epoch {
                continue;
            }
            let run = &sc.runs[slot.run as usize];
            if !run.scored {
                continue;
            }
            let class = run.value as usize;
            let at = &mut next[classes.value[class] as usize];
            out[*at as usize] = Score {
                replica: run.replica,
                score: classes.score[class],
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
