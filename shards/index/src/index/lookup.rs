//! Lookups (docs/BEHAVIOUR.md §8): exact match, chain match, TENANT_HOT, the miss classifier, the
//! orchestrator, the affinity pick and LFU crediting (§7.4).
//!
//! A steady-state lookup does not allocate: scores, LFU hits and chain-run state live in
//! buffers owned by the index and reused; the result is returned as a view borrowing them.

use super::ranking::{self, Tier, distinguishing_power, freshness, recency};
use super::store::KeyId;
use super::{Catalog, DEAD, Index};
use crate::rules::{Eviction, TenantRules};
use crate::runstore::{Extent, WalkScratch};
use sha2::{Digest, Sha256};
use std::cmp::Ordering;

mod answer;

/// Lookup strategy (§8.1). `None` maps to the `NO_HINT` reason code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Strategy {
    /// No hint (`NO_HINT`), or a miss the server may turn into an affinity pick.
    #[default]
    None,
    /// Prefix match scores (`PREFIX_MATCH`).
    PrefixMatch,
    /// Warm replicas of the tenant (`TENANT_HOT`).
    TenantHot,
    /// Tenant has no prefix key anywhere (`UNKNOWN_TENANT`).
    UnknownTenant,
    /// `(tenant, model)` has no prefix key (`UNKNOWN_MODEL`).
    UnknownModel,
    /// No replica serves `(tenant, model, scheme)` (`UNKNOWN_HASH_SCHEME`).
    UnknownHashScheme,
}

impl Score {
    /// A value to size an answer with before its scores are written in place.
    const PLACEHOLDER: Score = Score {
        replica: 0,
        score: 0.0,
        matched_tokens: 0,
        estimated_cache_hit_prob: 0.0,
        tier: 0,
    };
}

impl Strategy {
    /// The wire reason code of this strategy.
    pub fn reason_code(self) -> &'static str {
        match self {
            Strategy::None => "NO_HINT",
            Strategy::PrefixMatch => "PREFIX_MATCH",
            Strategy::TenantHot => "TENANT_HOT",
            Strategy::UnknownTenant => "UNKNOWN_TENANT",
            Strategy::UnknownModel => "UNKNOWN_MODEL",
            Strategy::UnknownHashScheme => "UNKNOWN_HASH_SCHEME",
        }
    }
}

/// One replica's score (§9.7). The replica is an index-local id; resolve it with
/// [`LookupView::replica_id`] or [`Index::replica_name`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Score {
    /// Interned replica id (core-local).
    pub replica: u32,
    /// §9.2 score (float32).
    pub score: f32,
    /// Stored count (exact), request run sum (chain), 0 (TENANT_HOT).
    pub matched_tokens: i32,
    /// Freshness (prefix paths) or hit rate (TENANT_HOT).
    pub estimated_cache_hit_prob: f32,
    /// Wire tier 0..=3.
    pub tier: i32,
}

/// An entry that contributed to a delivered prefix match and is credited for LFU (§7.4).
/// Identifies the entry by key and replica, so it stays valid across index mutations (a key
/// removed and re-created with a reused blob id in between, or a keyspace or replica id reused
/// after a reclaim pass, could be credited instead; this needs a same-core mutation between
/// lookup and credit and only affects LFU order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LfuHit {
    key: KeyId,
    replica: u32,
}

impl LfuHit {
    /// The credited replica (same id space as [`Score::replica`]).
    pub fn replica(&self) -> u32 {
        self.replica
    }
}

/// A lookup request (§8.1 inputs). Borrowed so the gRPC request is not copied.
#[derive(Clone, Copy, Debug, Default)]
pub struct LookupQuery<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Model id.
    pub model: &'a str,
    /// Hash scheme.
    pub hash_scheme: &'a str,
    /// Adapter id ("" = default); with the scope it names the keyspace.
    pub adapter: &'a str,
    /// Exact-match key.
    pub prefix_hash: &'a [u8],
    /// Exact-match token count (carried; the exact path reports stored counts).
    pub token_count: i32,
    /// Chain block hashes.
    pub block_hashes: BlockHashes<'a>,
    /// Chain per-block token counts.
    pub block_token_counts: &'a [i32],
    /// SLO time-to-first-token budget.
    pub ttft_ms: i32,
    /// SLO time-between-tokens budget (unused by the ranker).
    pub tbt_ms: i32,
}

/// A chain's block hashes, however the caller holds them: the server's decoded request holds
/// `Bytes` slices of the received buffer, token-derived chains hold `[u8; 8]`, tests and tools
/// `Vec<u8>`. An enum rather than a type parameter so the lookup code is compiled once, here
/// (a generic one was instantiated in each caller and measured 5–9% more instructions in the
/// perf gate).
#[derive(Clone, Copy, Debug)]
pub enum BlockHashes<'a> {
    /// Owned byte vectors.
    Vecs(&'a [Vec<u8>]),
    /// Slices of a received buffer.
    Bytes(&'a [bytes::Bytes]),
    /// Fixed 8-byte (big-endian u64) hashes.
    Fixed(&'a [[u8; 8]]),
    /// Borrowed slices (hashes of other lengths decoded straight from the wire).
    Slices(&'a [&'a [u8]]),
    /// 8-byte hashes at a fixed stride in one borrowed buffer (a received message's repeated
    /// field, or a caller's array of records), read where the walk needs them: nothing is
    /// copied per block, so a lookup reads only the blocks it matches.
    Strided(StridedHashes<'a>),
}

/// `len` 8-byte hashes in `bytes`, hash `i` at `i * stride` (see [`BlockHashes::Strided`]).
#[derive(Clone, Copy, Debug)]
pub struct StridedHashes<'a> {
    bytes: &'a [u8],
    stride: usize,
    len: usize,
}

impl<'a> StridedHashes<'a> {
    /// Hash length of a strided run.
    pub const HASH_BYTES: usize = 8;

    /// `len` hashes of 8 bytes, hash `i` at `bytes[i * stride..]`; `None` when `stride` is under
    /// 8 or `bytes` is too short to hold them all.
    pub fn new(bytes: &'a [u8], stride: usize, len: usize) -> Option<Self> {
        let need = match len {
            0 => 0,
            n => (n - 1).checked_mul(stride)?.checked_add(Self::HASH_BYTES)?,
        };
        (stride >= Self::HASH_BYTES && bytes.len() >= need).then_some(StridedHashes {
            bytes,
            stride,
            len,
        })
    }

    /// Number of hashes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer the hashes are read from (hash 0 at its start).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Bytes from one hash to the next.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Hash `i` (`i < len`).
    #[inline]
    pub fn get(&self, i: usize) -> &'a [u8] {
        debug_assert!(i < self.len);
        let at = i * self.stride;
        &self.bytes[at..at + Self::HASH_BYTES]
    }
}

/// The request's hashes as one representation of [`BlockHashes`], for a walk compiled per
/// representation.
trait HashRun: Copy {
    fn len(&self) -> usize;
    fn at(&self, i: usize) -> &[u8];
    /// Hash `i` as an inline key's hash word (the big-endian u64 of its 8 bytes); None for a
    /// hash of another length (a blob).
    #[inline(always)]
    fn word(&self, i: usize) -> Option<u64> {
        self.at(i).try_into().ok().map(u64::from_be_bytes)
    }
}

impl<H: AsRef<[u8]>> HashRun for &[H] {
    #[inline(always)]
    fn len(&self) -> usize {
        <[H]>::len(self)
    }
    #[inline(always)]
    fn at(&self, i: usize) -> &[u8] {
        self[i].as_ref()
    }
}

impl HashRun for StridedHashes<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.len
    }
    #[inline(always)]
    fn at(&self, i: usize) -> &[u8] {
        self.get(i)
    }
}

/// Equal when they hold the same hashes in the same order, however each side holds them.
impl PartialEq for BlockHashes<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && (0..self.len()).all(|i| self.get(i) == other.get(i))
    }
}

impl Eq for BlockHashes<'_> {}

impl Default for BlockHashes<'_> {
    fn default() -> Self {
        Self::Vecs(&[])
    }
}

impl<'a> BlockHashes<'a> {
    /// Number of blocks.
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Self::Vecs(h) => h.len(),
            Self::Bytes(h) => h.len(),
            Self::Fixed(h) => h.len(),
            Self::Slices(h) => h.len(),
            Self::Strided(h) => h.len(),
        }
    }

    /// Whether there are no blocks.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Block `i`'s hash bytes.
    #[inline]
    pub fn get(&self, i: usize) -> &'a [u8] {
        match self {
            Self::Vecs(h) => &h[i],
            Self::Bytes(h) => &h[i],
            Self::Fixed(h) => &h[i],
            Self::Slices(h) => h[i],
            Self::Strided(h) => h.get(i),
        }
    }
}

impl<'a> From<&'a [Vec<u8>]> for BlockHashes<'a> {
    fn from(h: &'a [Vec<u8>]) -> Self {
        Self::Vecs(h)
    }
}

impl<'a> From<&'a Vec<Vec<u8>>> for BlockHashes<'a> {
    fn from(h: &'a Vec<Vec<u8>>) -> Self {
        Self::Vecs(h)
    }
}

impl<'a> From<&'a [bytes::Bytes]> for BlockHashes<'a> {
    fn from(h: &'a [bytes::Bytes]) -> Self {
        Self::Bytes(h)
    }
}

impl<'a> From<&'a Vec<bytes::Bytes>> for BlockHashes<'a> {
    fn from(h: &'a Vec<bytes::Bytes>) -> Self {
        Self::Bytes(h)
    }
}

impl<'a> From<&'a [[u8; 8]]> for BlockHashes<'a> {
    fn from(h: &'a [[u8; 8]]) -> Self {
        Self::Fixed(h)
    }
}

/// The result of a lookup: borrows the index's reusable buffers until the next lookup.
#[derive(Clone, Copy)]
pub struct LookupView<'a> {
    /// Strategy.
    pub strategy: Strategy,
    /// Scores in final order (score desc, replica id asc).
    pub scores: &'a [Score],
    /// LFU hits of all scored replicas (filter by replica before crediting). Empty unless the
    /// tenant's policy resolved to LFU at lookup time: only LFU tenants are ever credited, and
    /// collecting a hit per (block, holder) cost ~20% of a long chain's lookup.
    pub lfu_hits: &'a [LfuHit],
    cat: &'a Catalog,
}

impl<'a> LookupView<'a> {
    /// The replica id string of a score.
    pub fn replica_id(&self, s: &Score) -> &'a str {
        self.cat.strings.name(s.replica)
    }
}

impl std::fmt::Debug for LookupView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scores: Vec<_> = self
            .scores
            .iter()
            .map(|s| {
                (
                    self.replica_id(s),
                    s.score,
                    s.matched_tokens,
                    s.estimated_cache_hit_prob,
                    s.tier,
                )
            })
            .collect();
        f.debug_struct("LookupView")
            .field("strategy", &self.strategy)
            .field("scores", &scores)
            .finish()
    }
}

#[derive(Clone, Copy, Default)]
struct Run {
    replica: u32,
    /// Sum of the request's block counts over the run, in the wire's int32 with wrap-around
    /// (as the stored cumulative counts), so an overflowing sum is a non-positive run and dropped.
    matched: i32,
    oldest: i64,
    tier: Tier,
    last_block: u32,
    scored: bool,
    /// [`Index::answer_from_runs`]: the entry's freshness and the run's class (its score
    /// before distinguishing power and its group, `answer::Classes`).
    fresh: f32,
    value: u32,
}

/// A replica's score in the current ordering ([`Scratch::order_by_walk`]): `scores[run]`,
/// valid when `epoch` is the ordering's.
#[derive(Clone, Copy, Default)]
struct RunSlot {
    epoch: u32,
    run: u32,
}

/// Reusable per-lookup buffers.
#[derive(Default)]
pub(crate) struct Scratch {
    runs: Vec<Run>,
    /// replica id → its score in [`Scratch::order_by_walk`].
    slots: Vec<RunSlot>,
    epoch: u32,
    run_hits: Vec<(u32, LfuHit)>, // (run index, hit)
    /// [`Scratch::order_by_walk`]: one sort key per score, (descending score, name rank).
    keys: Vec<u64>,
    /// [`Scratch::order_by_walk`]: the scores in replica name order.
    named: Vec<Score>,
    /// The last block of each chain score's run (parallel to the scores).
    score_blocks: Vec<u32>,
    /// [`Scratch::depth_power_by_block`]: per block of the request, the scores whose run ends
    /// there, then the factor of their group (at most one per request block).
    per_block: Vec<u32>,
    factors: Vec<f32>,
    /// [`Index::answer_from_runs`]: the answer's classes of scored runs.
    classes: answer::Classes,
    /// The run store's walk: each replica's leading stretch of the request.
    walk: WalkScratch,
    /// The request's token counts summed from block 0, up to the longest stretch.
    token_sums: Vec<i32>,
}

impl Scratch {
    fn next_epoch(&mut self, replicas: usize) {
        if self.slots.len() < replicas {
            self.slots.resize(replicas, RunSlot::default());
        }
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slots.iter_mut().for_each(|s| s.epoch = 0);
            self.epoch = 1;
        }
    }
}

/// Depth-aware distinguishing power (§9.5): scales each group of scores with equal matched
/// tokens by the power of its size among `total` serving replicas. Reorders `scores` by
/// matched tokens desc only: the groups are all it needs, and the caller's [`sort_scores`] is a
/// total order (score, then the replica's unique name), so the order within a group never
/// reaches the answer. (Ordering the groups by name too cost one string comparison per step of
/// the sort: with hundreds of holders per answer, as at 1,024 workers, most of the lookup.)
fn apply_depth_power(scores: &mut [Score], total: usize) {
    scores.sort_unstable_by_key(|s| std::cmp::Reverse(s.matched_tokens));
    let mut start = 0;
    while start < scores.len() {
        let m = scores[start].matched_tokens;
        let mut end = start;
        while end < scores.len() && scores[end].matched_tokens == m {
            end += 1;
        }
        let dp = distinguishing_power(end as i64, total as i64);
        if dp != 1.0 {
            for s in &mut scores[start..end] {
                s.score *= dp as f32;
            }
        }
        start = end;
    }
}

impl Scratch {
    /// The depth-aware distinguishing power (§9.5) of chain scores without sorting them, when
    /// a run's matched tokens are strictly increasing in its last block: every request count
    /// up to the last block any scored run reached is positive and their sum fits an i32
    /// (no wrap-around). Then the groups of equal matched tokens are the runs ending at one
    /// block, and a group's `right` (the scores matching at least as much) is the number of
    /// runs ending at or after it: a histogram over blocks and a suffix sum, `O(scores +
    /// blocks)` instead of a sort. Each score is multiplied by its group's `f32(dp)`, as
    /// [`apply_depth_power`] does (a factor of 1 leaves a finite score unchanged, so it is
    /// applied unconditionally). Returns false, changing nothing, when the condition fails.
    fn depth_power_by_block(&mut self, scores: &mut [Score], total: usize, counts: &[i32]) -> bool {
        debug_assert_eq!(scores.len(), self.score_blocks.len());
        let Some(&last) = self.score_blocks.iter().max() else {
            return true;
        };
        let last = last as usize;
        // The histogram costs a step per block up to the deepest run, the sort it replaces
        // about k·log2(k) comparisons: a few scores on a long chain are sorted.
        let k = self.score_blocks.len();
        if last >= 2 * k * (usize::BITS - k.leading_zeros()) as usize {
            return false;
        }
        // No early exit: a branch-free minimum and a sum.
        let counts = &counts[..=last];
        let min = counts.iter().fold(i32::MAX, |m, &c| m.min(c));
        let sum: i64 = counts.iter().map(|&c| i64::from(c)).sum();
        if min <= 0 || sum > i64::from(i32::MAX) {
            return false;
        }
        if self.depth_power_few_blocks(scores, total) {
            return true;
        }
        self.per_block.clear();
        self.per_block.resize(last + 1, 0);
        for &b in &self.score_blocks {
            self.per_block[b as usize] += 1;
        }
        self.factors.clear();
        self.factors.resize(last + 1, 1.0);
        let mut right = 0i64;
        for b in (0..=last).rev() {
            let n = self.per_block[b];
            if n > 0 {
                right += i64::from(n);
                self.factors[b] = distinguishing_power(right, total as i64) as f32;
            }
        }
        for (s, &b) in scores.iter_mut().zip(&self.score_blocks) {
            s.score *= self.factors[b as usize];
        }
        true
    }

    /// [`Scratch::depth_power_by_block`] once its condition holds, when the scored runs end at
    /// no more than [`FEW_GROUPS`] distinct blocks (the usual answer: many replicas holding the
    /// same few prefixes): the groups are found by comparing blocks with one another, not with
    /// a histogram over every block of the request. Same factors, applied the same way.
    /// Returns false, changing nothing, when there are more groups.
    fn depth_power_few_blocks(&mut self, scores: &mut [Score], total: usize) -> bool {
        let mut groups = answer::Groups::default();
        for (s, &b) in scores.iter().zip(&self.score_blocks) {
            if groups.of(b, s.matched_tokens).is_none() {
                return false;
            }
        }
        let factors = groups.factors(total);
        for (s, &b) in scores.iter_mut().zip(&self.score_blocks) {
            s.score *= factors[groups.find(b).unwrap_or(0)];
        }
        true
    }
}

/// Most distinct blocks where scored runs end that [`Scratch::depth_power_few_blocks`] compares
/// against one another before the histogram takes over: a score costs at most this many
/// integer comparisons.
const FEW_GROUPS: usize = 8;

/// The last lookup's result buffers.
#[derive(Default)]
pub(crate) struct LastLookup {
    strategy: Strategy,
    tenant: Option<u32>,
    scores: Vec<Score>,
    hits: Vec<LfuHit>,
}

/// A comparison sort by name costs about this many steps of the walk over a scope's
/// name-ordered replicas per comparison (a string comparison against a slot check).
const WALK_STEPS_PER_COMPARE: usize = 4;

/// Fewer scores than this are sorted by comparison: a handful of comparisons, most of them
/// between different scores, cost less than the walk's set-up (the perf gate's two-holder
/// answers measured +7–18% instructions with the walk).
const MIN_WALK_SCORES: usize = 16;

impl Scratch {
    /// Orders `scores` as [`sort_scores`] does (score descending, then replica name ascending)
    /// without comparing names: `by_name` is the scope's serving replicas in name order
    /// (`ScopeRec::sorted`, kept in lock-step with the entries), and every scored replica holds
    /// an entry in the scope, so walking it lists the scores in name order; their position in
    /// that walk is the tie-break of one integer sort key. `replicas` bounds the replica ids.
    /// Returns false, leaving `scores` as they were, when the walk would cost more than a
    /// comparison sort (a scope much larger than the answer) or does not find every scored
    /// replica once (never expected; the caller then sorts by name).
    fn order_by_walk(&mut self, by_name: &[u32], replicas: usize, scores: &mut [Score]) -> bool {
        let k = scores.len();
        let log2 = (usize::BITS - k.leading_zeros()) as usize;
        if k < MIN_WALK_SCORES || by_name.len() > k * log2 * WALK_STEPS_PER_COMPARE {
            return false;
        }
        self.next_epoch(replicas);
        for (i, s) in scores.iter().enumerate() {
            if s.score.is_nan() {
                return false;
            }
            self.slots[s.replica as usize] = RunSlot {
                epoch: self.epoch,
                run: i as u32,
            };
        }
        self.keys.clear();
        self.named.clear();
        for &r in by_name {
            let Some(slot) = self.slots.get(r as usize) else {
                continue;
            };
            if slot.epoch != self.epoch {
                continue;
            }
            let s = scores[slot.run as usize];
            self.keys
                .push(u64::from(descending(s.score)) << 32 | self.named.len() as u64);
            self.named.push(s);
        }
        if self.named.len() != k {
            debug_assert!(
                false,
                "a scored replica missing from its scope's name order"
            );
            return false;
        }
        self.keys.sort_unstable();
        for (out, key) in scores.iter_mut().zip(&self.keys) {
            *out = self.named[*key as u32 as usize];
        }
        true
    }
}

/// A sort key of a finite score, smaller for larger scores; -0 and +0 are equal (Go's `>`).
#[inline]
fn descending(score: f32) -> u32 {
    let bits = if score == 0.0 { 0 } else { score.to_bits() };
    let ascending = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    };
    !ascending
}

/// The answer's order (§9.6) by comparison: score descending, ties by replica name ascending.
fn sort_scores(cat: &Catalog, scores: &mut [Score]) {
    scores.sort_unstable_by(|a, b| {
        // Go's `a.Score > b.Score`: -0 == +0, ties by replica id bytewise.
        match b.score.partial_cmp(&a.score) {
            Some(Ordering::Equal) | None => {
                cat.strings.name(a.replica).cmp(cat.strings.name(b.replica))
            }
            Some(o) => o,
        }
    });
}

impl Index {
    /// The replica id string behind a [`Score::replica`].
    pub fn replica_name(&self, replica: u32) -> &str {
        self.cat.strings.name(replica)
    }

    fn view(&self) -> LookupView<'_> {
        LookupView {
            strategy: self.last.strategy,
            scores: &self.last.scores,
            lfu_hits: &self.last.hits,
            cat: &self.cat,
        }
    }

    pub(crate) fn reset_last(&mut self) {
        self.last.strategy = Strategy::None;
        self.last.tenant = None;
        self.last.scores.clear();
        self.last.hits.clear();
    }

    /// Orders a lookup's scores as the answer (§9.6); `scope` is the scope every scored
    /// replica serves in.
    fn order_scores(&mut self, scope: u32, scores: &mut [Score]) {
        if scores.len() < 2 {
            return;
        }
        let by_name = &self.cat.scopes[scope as usize].sorted;
        let replicas = self.cat.strings.slots();
        if !self.scratch.order_by_walk(by_name, replicas, scores) {
            sort_scores(&self.cat, scores);
        }
    }

    /// Pressure of a replica for prefix paths: the stats row's, if its payload is fresh under
    /// the tenant TTL, else 0.
    fn prefix_pressure(&self, mscope: u32, replica: u32, now: i64, ttl: i64) -> f32 {
        match self.cat.models[mscope as usize].stats.get(&replica) {
            Some(row) if freshness(now, row.stats_reported, ttl) > 0.0 => row.pressure,
            _ => 0.0,
        }
    }

    /// Exact match (§8.2) into `self.last`.
    fn exact_into(&mut self, q: &LookupQuery<'_>, now: i64, rules: &dyn TenantRules) {
        let Some(scope) = self.cat.find_scope(q.tenant, q.model, q.hash_scheme) else {
            return;
        };
        let Some(ks) = self.cat.find_keyspace(scope, q.adapter) else {
            return;
        };
        let Some(key) = self.cat.key_for(ks, q.prefix_hash) else {
            return;
        };
        let Some(pos) = self.store.find(key) else {
            return;
        };
        let ttl = self.ttl_for(rules, q.tenant);
        let srec = &self.cat.scopes[scope as usize];
        let (total, mscope) = (srec.serving.len(), srec.mscope);
        let coeff = self.cfg.ranker.slo_coeff(q.ttft_ms);
        let lfu = rules.eviction(q.tenant) == Eviction::Lfu;
        let cleared = self.cleared_replica(mscope);
        let mut scores = std::mem::take(&mut self.last.scores);
        let mut hits = std::mem::take(&mut self.last.hits);
        for h in self.store.holders_uncounted(pos) {
            let f = freshness(now, h.last_seen(), ttl);
            if f <= 0.0 || h.replica() == cleared {
                continue;
            }
            let pressure = self.prefix_pressure(mscope, h.replica(), now, ttl);
            let score = self
                .cfg
                .ranker
                .prefix_score(h.tokens as i64, f, pressure, coeff);
            scores.push(Score {
                replica: h.replica(),
                score,
                matched_tokens: h.tokens,
                estimated_cache_hit_prob: f,
                tier: ranking::tier_to_wire(h.tier()),
            });
            if lfu && h.tokens > 0 {
                hits.push(LfuHit {
                    key,
                    replica: h.replica(),
                });
            }
        }
        let dp = distinguishing_power(scores.len() as i64, total as i64);
        if dp != 1.0 {
            for s in scores.iter_mut() {
                s.score *= dp as f32;
            }
        }
        self.order_scores(scope, &mut scores);
        self.last.scores = scores;
        self.last.hits = hits;
    }

    /// Chain match (§8.3) into `self.last`. The caller checked the lengths are equal.
    fn chain_into(&mut self, q: &LookupQuery<'_>, now: i64, rules: &dyn TenantRules) {
        debug_assert_eq!(q.block_hashes.len(), q.block_token_counts.len());
        if q.block_hashes.is_empty() {
            return;
        }
        let Some(scope) = self.cat.find_scope(q.tenant, q.model, q.hash_scheme) else {
            return;
        };
        let Some(ks) = self.cat.find_keyspace(scope, q.adapter) else {
            return;
        };
        let ttl = self.ttl_for(rules, q.tenant);
        let srec = &self.cat.scopes[scope as usize];
        let (total, mscope) = (srec.serving.len(), srec.mscope);
        debug_assert!(ttl > 0, "resolved TTLs are positive");
        let lfu = rules.eviction(q.tenant) == Eviction::Lfu;
        self.walk_chain(q, ks, now, ttl, lfu);
        let inputs = answer::AnswerInputs {
            scope,
            mscope,
            total,
            ttft_ms: q.ttft_ms,
            now,
            ttl,
        };
        if self.answer_from_runs(&inputs) {
            self.keep_scored_run_hits();
            return;
        }
        let mut scores = std::mem::take(&mut self.last.scores);
        self.score_runs(&mut scores, mscope, q.ttft_ms, now, ttl);
        self.keep_scored_run_hits();
        if total > 1
            && !scores.is_empty()
            && !self
                .scratch
                .depth_power_by_block(&mut scores, total, q.block_token_counts)
        {
            apply_depth_power(&mut scores, total);
        }
        self.order_scores(scope, &mut scores);
        self.last.scores = scores;
    }

    /// Walks the request's blocks in keyspace `ks` and builds one run per replica holding a
    /// live entry for block 0 (`self.scratch`), with LFU hits when `lfu`. Stops at the first
    /// block no live run reaches.
    fn walk_chain(&mut self, q: &LookupQuery<'_>, ks: u32, now: i64, ttl: i64, lfu: bool) {
        let counts = q.block_token_counts;
        // One match per lookup, then a loop compiled for that representation.
        match q.block_hashes {
            BlockHashes::Vecs(h) => self.walk_blocks(h, counts, ks, now, ttl, lfu),
            BlockHashes::Bytes(h) => self.walk_blocks(h, counts, ks, now, ttl, lfu),
            BlockHashes::Fixed(h) => self.walk_blocks(h, counts, ks, now, ttl, lfu),
            BlockHashes::Slices(h) => self.walk_blocks(h, counts, ks, now, ttl, lfu),
            BlockHashes::Strided(h) => self.walk_blocks(h, counts, ks, now, ttl, lfu),
        }
    }

    /// [`Self::walk_chain`] over hashes held as `H`. Not inlined: one compiled copy per
    /// representation.
    ///
    /// Cost per *stored run*, not per (block, holder): the run store walks the request along
    /// each stored run it meets, comparing hashes, and visits each run's extents (a replica's
    /// stretch of one tier and time) once per piece of the request on it; the table is probed
    /// only where the request leaves a run. An extent whose entries are stale, or of the
    /// replica being cleared, holds nothing for the walk: its replica's run freezes there.
    /// LFU tenants get an LFU hit per (block, replica) of every run, from the runs.
    #[inline(never)]
    fn walk_blocks<H: HashRun>(
        &mut self,
        hashes: H,
        counts: &[i32],
        ks: u32,
        now: i64,
        ttl: i64,
        lfu: bool,
    ) {
        let cleared = self.cleared_in_keyspace(ks);
        let sc = &mut self.scratch;
        sc.runs.clear();
        sc.run_hits.clear();
        let cat = &self.cat;
        // An 8-byte hash is its key's word; another width is a blob, looked up.
        let key = |i: usize| match hashes.word(i) {
            Some(w) => Some((ks, w)),
            None => cat.key_for(ks, hashes.at(i)).map(|k| (k.ks, k.h)),
        };
        let live = |x: &Extent| now.saturating_sub(x.last_seen) < ttl && x.replica != cleared;
        (self.store.runs()).walk_keys(hashes.len(), key, live, ranking::worst_tier, &mut sc.walk);
        // Each replica's matched tokens: the request's counts summed over its stretch (int32
        // with wrap-around), from one pass of prefix sums up to the longest stretch.
        let longest = sc.walk.matched.iter().map(|m| m.blocks).max().unwrap_or(0) as usize;
        sc.token_sums.clear();
        let sums = counts[..longest].iter().scan(0i32, |sum, c| {
            *sum = sum.wrapping_add(*c);
            Some(*sum)
        });
        sc.token_sums.extend(sums);
        // One run per match, in the walk's order: a replica's run is found through the walk
        // (`WalkScratch::index_of`).
        let runs = sc.walk.matched.iter().map(|m| Run {
            replica: m.replica,
            matched: sc.token_sums[m.blocks as usize - 1],
            oldest: m.oldest,
            tier: m.tier,
            last_block: m.blocks - 1,
            scored: false,
            fresh: 0.0,
            value: 0,
        });
        sc.runs.extend(runs);
        if lfu {
            for (run, m) in sc.walk.matched.iter().enumerate() {
                let run = run as u32;
                for i in 0..m.blocks as usize {
                    let key = cat.key_for(ks, hashes.at(i)).expect("a held block's key");
                    let hit = LfuHit {
                        key,
                        replica: m.replica,
                    };
                    sc.run_hits.push((run, hit));
                }
            }
        }
    }

    /// Scores every run with a positive matched sum and a fresh oldest entry (marking it
    /// `scored`), appending to `scores`.
    fn score_runs(
        &mut self,
        scores: &mut Vec<Score>,
        mscope: u32,
        ttft_ms: i32,
        now: i64,
        ttl: i64,
    ) {
        let coeff = self.cfg.ranker.slo_coeff(ttft_ms);
        // No stats row in the model scope: every pressure is 0, no lookup per run.
        let no_stats = self.cat.models[mscope as usize].stats.is_empty();
        self.scratch.score_blocks.clear();
        for i in 0..self.scratch.runs.len() {
            let run = self.scratch.runs[i];
            if run.matched <= 0 {
                continue;
            }
            let f = freshness(now, run.oldest, ttl);
            if f <= 0.0 {
                continue;
            }
            self.scratch.runs[i].scored = true;
            self.scratch.score_blocks.push(run.last_block);
            let pressure = if no_stats {
                0.0
            } else {
                self.prefix_pressure(mscope, run.replica, now, ttl)
            };
            scores.push(Score {
                replica: run.replica,
                score: self
                    .cfg
                    .ranker
                    .prefix_score(i64::from(run.matched), f, pressure, coeff),
                matched_tokens: run.matched,
                estimated_cache_hit_prob: f,
                tier: ranking::tier_to_wire(run.tier),
            });
        }
    }

    /// LFU hits only for replicas whose run produced a score.
    fn keep_scored_run_hits(&mut self) {
        for (run_idx, hit) in self.scratch.run_hits.iter() {
            if self.scratch.runs[*run_idx as usize].scored {
                self.last.hits.push(*hit);
            }
        }
    }

    /// TENANT_HOT candidates (§8.4) into `self.last`.
    fn tenant_hot_into(&mut self, q: &LookupQuery<'_>, now: i64) {
        let max_age = self.cfg.ranker.tenant_hot_max_age_ns;
        if max_age <= 0 || q.hash_scheme.is_empty() {
            return;
        }
        let Some(mscope) = self.cat.find_model(q.tenant, q.model) else {
            return;
        };
        let Some(scope) = self.cat.find_scope(q.tenant, q.model, q.hash_scheme) else {
            return;
        };
        let serving = &self.cat.scopes[scope as usize].serving;
        let coeff = self.cfg.ranker.slo_coeff(q.ttft_ms);
        let min_hit = self.cfg.ranker.tenant_hot_min_hit_rate;
        for (replica, row) in self.cat.models[mscope as usize].stats.iter() {
            let age = now.saturating_sub(row.stats_reported);
            if age >= max_age || row.hit_rate < min_hit {
                continue;
            }
            if serving.get(replica).copied().unwrap_or(0) == 0 {
                continue;
            }
            let rec = recency(age, max_age);
            self.last.scores.push(Score {
                replica: *replica,
                score: self
                    .cfg
                    .ranker
                    .hot_score(row.hit_rate, rec, row.pressure, coeff),
                matched_tokens: 0,
                estimated_cache_hit_prob: row.hit_rate,
                tier: 0,
            });
        }
        let mut scores = std::mem::take(&mut self.last.scores);
        self.order_scores(scope, &mut scores);
        self.last.scores = scores;
    }

    /// Miss classifier (§8.5).
    fn classify_miss(&self, q: &LookupQuery<'_>) -> Strategy {
        if self.dir.holds_no_entries() {
            return Strategy::None;
        }
        if !self.tenant_known(q.tenant) {
            return Strategy::UnknownTenant;
        }
        if !self.has_tenant_model(q.tenant, q.model) {
            return Strategy::UnknownModel;
        }
        if !self.has_scope(q.tenant, q.model, q.hash_scheme) {
            return Strategy::UnknownHashScheme;
        }
        Strategy::None
    }

    /// The orchestrator `LookupRoute(req)` (§8.1): exact / chain match, TENANT_HOT for
    /// non-chain misses, then the miss classifier. The result borrows the index until the next
    /// call; [`Index::credit_lfu`] credits it after the server's floors.
    pub fn lookup_route(
        &mut self,
        q: &LookupQuery<'_>,
        now: i64,
        rules: &dyn TenantRules,
    ) -> LookupView<'_> {
        self.reset_last();
        if q.tenant.is_empty() || q.model.is_empty() || q.hash_scheme.is_empty() {
            return self.view();
        }
        self.last.tenant = self.cat.find_tenant(q.tenant);
        let chain = !q.block_hashes.is_empty() || !q.block_token_counts.is_empty();
        if chain {
            if q.block_hashes.len() != q.block_token_counts.len() {
                return self.view();
            }
            self.chain_into(q, now, rules);
            if !self.last.scores.is_empty() {
                self.last.strategy = Strategy::PrefixMatch;
                return self.view();
            }
        } else {
            self.exact_into(q, now, rules);
            if !self.last.scores.is_empty() {
                self.last.strategy = Strategy::PrefixMatch;
                return self.view();
            }
            self.last.hits.clear();
            self.tenant_hot_into(q, now);
            if !self.last.scores.is_empty() {
                self.last.strategy = Strategy::TenantHot;
                return self.view();
            }
        }
        self.last.hits.clear();
        self.last.strategy = self.classify_miss(q);
        self.view()
    }

    /// The lower-level prefix-only `Lookup(req)` (§8.1 last paragraph, used by `/probe`): empty
    /// scheme or malformed chain → empty; chain → chain match; else exact match. Strategy is
    /// `PrefixMatch` when scores are non-empty, else `None`.
    pub fn lookup(
        &mut self,
        q: &LookupQuery<'_>,
        now: i64,
        rules: &dyn TenantRules,
    ) -> LookupView<'_> {
        self.reset_last();
        if q.hash_scheme.is_empty() {
            return self.view();
        }
        self.last.tenant = self.cat.find_tenant(q.tenant);
        if !q.block_hashes.is_empty() || !q.block_token_counts.is_empty() {
            if q.block_hashes.len() != q.block_token_counts.len() {
                return self.view();
            }
            self.chain_into(q, now, rules);
        } else {
            self.exact_into(q, now, rules);
        }
        if !self.last.scores.is_empty() {
            self.last.strategy = Strategy::PrefixMatch;
        }
        self.view()
    }

    /// Credits LFU counters (§7.4) for the **last** lookup's hits of the replicas for which
    /// `keep(replica_id)` is true (the server passes the replicas that survived its floors).
    /// No-op unless the last result was `PrefixMatch` and the tenant resolves to LFU.
    /// Returns the number of entries credited.
    pub fn credit_lfu(&mut self, keep: impl FnMut(&str) -> bool, rules: &dyn TenantRules) -> u64 {
        if self.last.strategy != Strategy::PrefixMatch {
            return 0;
        }
        let Some(tenant) = self.last.tenant else {
            return 0;
        };
        let hits = std::mem::take(&mut self.last.hits);
        let n = self.credit_hits_filtered(tenant, &hits, keep, rules);
        self.last.hits = hits;
        n
    }

    /// Credits an owned hit list (for servers that carry hits across a core hop): `tenant` is
    /// the lookup's tenant; only hits whose replica satisfies `keep` are credited.
    pub fn credit_hits(
        &mut self,
        tenant: &str,
        hits: &[LfuHit],
        keep: impl FnMut(&str) -> bool,
        rules: &dyn TenantRules,
    ) -> u64 {
        let Some(t) = self.cat.strings.get(tenant) else {
            return 0;
        };
        self.credit_hits_filtered(t, hits, keep, rules)
    }

    fn credit_hits_filtered(
        &mut self,
        tenant: u32,
        hits: &[LfuHit],
        mut keep: impl FnMut(&str) -> bool,
        rules: &dyn TenantRules,
    ) -> u64 {
        if rules.eviction(self.cat.strings.name(tenant)) != Eviction::Lfu {
            return 0;
        }
        let mut n = 0;
        let mut last: Option<(u32, bool)> = None;
        for hit in hits {
            let kept = match last {
                Some((r, k)) if r == hit.replica => k,
                _ => {
                    let k = keep(self.cat.strings.name(hit.replica));
                    last = Some((hit.replica, k));
                    k
                }
            };
            if !kept {
                continue;
            }
            // A hit carried across a reclaim pass may name a freed (or reused) keyspace.
            let ks = &self.cat.keyspaces[hit.key.keyspace() as usize];
            if ks.scope == DEAD || self.cat.scopes[ks.scope as usize].tenant != tenant {
                continue;
            }
            let Some(pos) = self.store.find(hit.key) else {
                continue;
            };
            let Some(h) = self.store.holder_of(pos, hit.replica) else {
                continue;
            };
            self.store
                .set_access(pos, hit.replica, h.access.saturating_add(1));
            n += 1;
            self.cap_touch(hit.key, hit.replica, Some(pos));
        }
        n
    }

    /// Test aid: panics unless every invariant of the store holds (see
    /// `runstore::RunStore::check`).
    #[doc(hidden)]
    pub fn check_store(&self) {
        self.store.runs().check();
    }

    /// Affinity pick (§8.6): `sorted(serving replicas)[BE-u64(SHA-256(seed)[..8]) mod n]`.
    pub fn affinity_hint(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        seed: &[u8],
    ) -> Option<&str> {
        self.affinity_hint_fed(tenant, model, scheme, |sink| {
            sink(seed);
            !seed.is_empty()
        })
    }

    /// [`Index::affinity_hint`] with the seed streamed into the digest, so no seed buffer is
    /// built: `feed` passes each part of the seed to its sink and returns whether there was
    /// any (none: no pick), as `ResolvedInputs::feed_affinity_seed` does.
    pub fn affinity_hint_fed(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        feed: impl FnOnce(&mut dyn FnMut(&[u8])) -> bool,
    ) -> Option<&str> {
        if scheme.is_empty() {
            return None;
        }
        let scope = self.cat.find_scope(tenant, model, scheme)?;
        let sorted = &self.cat.scopes[scope as usize].sorted;
        if sorted.is_empty() {
            return None;
        }
        let mut hasher = Sha256::new();
        if !feed(&mut |part| hasher.update(part)) {
            return None;
        }
        let digest = hasher.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&digest[..8]);
        let idx = u64::from_be_bytes(b) % sorted.len() as u64;
        Some(self.cat.strings.name(sorted[idx as usize]))
    }
}
