//! Eviction (docs/BEHAVIOUR.md §6 sweep, §7.1 tenant quota, §7.2 global cap).
//!
//! Cap and quota victims must follow the reference's total orders exactly (tie-breaks by
//! strings), without sorting every entry on every ingest. Both use a *lazily rebuilt candidate
//! heap*:
//!
//! * Build: scan the relevant entries once and keep the `K` smallest sort keys (bounded max-heap,
//!   `K = max(MIN_CANDIDATES, entries still to evict, entries / 32)`); the largest kept key is the
//!   `threshold`
//!   (no threshold when everything fit, i.e. every entry is a candidate).
//! * Invariant: every entry whose *current* sort key is `<= threshold` is in the heap under that
//!   key. So every mutation that gives an entry a key `<= threshold` (new entry, refresh, LFU
//!   credit, a quota key losing its newest holder) pushes a snapshot.
//! * Pop: a snapshot that no longer matches the entry's current key is stale and dropped (its
//!   current key, if still `<= threshold`, was pushed separately). A matching one is the global
//!   minimum (any smaller entry would be in the heap with a smaller snapshot).
//! * Empty heap with a threshold → rebuild. Too many stale snapshots (refresh-heavy workloads)
//!   → drop the heap; it is rebuilt on the next need.
//! * Build ahead of need (cap only): a build is O(entries) (≈ 1 s at 10M entries when the sort
//!   keys tie), so the server runs the next one in time-budgeted slices before the live heap
//!   runs out ([`Index::cap_prebuild_step`], from the same per-core maintenance task that drives
//!   the sliced TTL sweep). Between two slices every mutation offers its new snapshot to the
//!   build unless its key is still to be visited by the build's scan (see [`CapBuild`]); the
//!   completed build replaces the live heap. The selection is exact either way (any candidate
//!   set that keeps the invariant pops the same global minimum), so the victims and their order
//!   do not depend on when or in how many slices a build ran. An ingest that needs a victim
//!   before the build completed finishes it itself (correctness over latency; counted by
//!   [`Index::take_cap_sync_builds`]).
//! * The cap order depends on each tenant's eviction algorithm: the heap is dropped whenever a
//!   tenant's resolved algorithm changes (checked before every enforcement, or via
//!   [`Index::rules_changed`]).
//!
//! Snapshots of blob-hash keys (heap entries and thresholds) hold a blob reference, so their
//! bytes stay valid for comparisons and a freed blob id is never reused under them.
//!
//! Multi-core: the cap bounds the directory's global non-reserved count and the quota the
//! directory's per-tenant key count. With [`IndexConfig::cross_core_eviction`] (the server with
//! several cores) ingest does not evict; the caller gathers every core's first candidates
//! ([`Index::cap_candidates`], [`Index::quota_candidates`]: popped from the heap above and
//! pushed back, with their names so they compare across cores), picks the globally first with
//! [`select_victims`] and has each core evict its share ([`Index::evict_cap_victims`],
//! [`Index::evict_quota_victims`]): exactly the victims of one global index. Without it (one
//! core, or the crate used on its own) the ingesting core evicts from its own entries, which
//! with one core are all of them.
//!
//! [`IndexConfig::cross_core_eviction`]: super::IndexConfig::cross_core_eviction

use super::store::{FIRST, Holder, KeyId, Loc, PLACES_PER_STEP, Scan, Store};
use super::{Catalog, EvictionCounts, Index, RemovalReason, SweepOutcome};
use crate::rules::{Eviction, TenantRules};
use std::cmp::Ordering;

/// Minimum candidate-set size of a rebuild (amortises the O(n) scan over many evictions).
pub(crate) const MIN_CANDIDATES: usize = 1024;
/// A rebuild keeps at least `entries / SCAN_AMORTISATION` candidates, so the O(n) scan is paid
/// at most once per `n / SCAN_AMORTISATION` evictions (≈ 32 entries scanned per eviction) at a
/// memory cost of ≈ 1 byte per entry while the heap is live.
const SCAN_AMORTISATION: usize = 32;
/// A cap build ahead of need ([`Index::cap_prebuild_step`]) keeps at least
/// `entries / PREBUILD_AMORTISATION` candidates. It starts while the live heap still holds about
/// half of its candidates (see [`PREBUILD_LOW_WATER`]), which the new one includes, so twice
/// [`SCAN_AMORTISATION`]'s share keeps ≈ 32 entries scanned per eviction. Memory: a candidate
/// snapshot is 32 bytes, so a heap of them is ≈ 2 bytes per entry, and two are allocated while
/// a build runs (the live heap and the selection, reordered into the next heap in place):
/// ≈ 4 bytes per entry at the peak (≈ 40 MB at 10M entries), against ≈ 2 for the one-go build.
/// The retired heap's buffer is kept for the next build ([`CapState::spare`]), so that peak is
/// held while the cap keeps evicting.
const PREBUILD_AMORTISATION: usize = 16;
/// The next cap build ahead of need starts once the live heap holds at most
/// `1 / PREBUILD_LOW_WATER` of the candidates it was built with (stale snapshots included), so
/// the build has that many evictions' time to finish before an ingest must finish it itself.
const PREBUILD_LOW_WATER: usize = 2;
/// Cap builds ahead of need run only while the directory's non-reserved count is within
/// `max_entries / PREBUILD_NEAR_CAP` of the global cap (below it no ingest evicts soon).
const PREBUILD_NEAR_CAP: usize = 8;

/// A binary heap ordered by an external comparator (the order needs the catalog's strings).
pub(crate) struct Heap<T> {
    v: Vec<T>,
}

impl<T> Default for Heap<T> {
    fn default() -> Self {
        Heap { v: Vec::new() }
    }
}

impl<T: Copy> Heap<T> {
    fn len(&self) -> usize {
        self.v.len()
    }
    fn peek(&self) -> Option<&T> {
        self.v.first()
    }
    /// Pushes with `less(a, b)` meaning "a pops before b".
    fn push(&mut self, x: T, less: &impl Fn(&T, &T) -> bool) {
        self.v.push(x);
        let mut i = self.v.len() - 1;
        while i > 0 {
            let p = (i - 1) / 2;
            if less(&self.v[i], &self.v[p]) {
                self.v.swap(i, p);
                i = p;
            } else {
                break;
            }
        }
    }
    fn pop(&mut self, less: &impl Fn(&T, &T) -> bool) -> Option<T> {
        if self.v.is_empty() {
            return None;
        }
        let top = self.v.swap_remove(0);
        self.sift_down(0, less);
        Some(top)
    }
    /// Replaces the top with `x` and restores the order: one sift down, where a pop and a push
    /// would take two passes (and twice the comparisons that tie down to the names).
    fn replace_top(&mut self, x: T, less: &impl Fn(&T, &T) -> bool) -> T {
        let top = std::mem::replace(&mut self.v[0], x);
        self.sift_down(0, less);
        top
    }
    /// Moves `v[i]` down until neither child pops before it.
    fn sift_down(&mut self, mut i: usize, less: &impl Fn(&T, &T) -> bool) {
        let n = self.v.len();
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut m = i;
            if l < n && less(&self.v[l], &self.v[m]) {
                m = l;
            }
            if r < n && less(&self.v[r], &self.v[m]) {
                m = r;
            }
            if m == i {
                break;
            }
            self.v.swap(i, m);
            i = m;
        }
    }
    fn drain(&mut self) -> std::vec::Drain<'_, T> {
        self.v.drain(..)
    }
}

/// Cap sort key snapshot of one storage entry (§7.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CapCand {
    eff: u32,
    last_seen: i64,
    key: KeyId,
    replica: u32,
}

/// Quota sort key snapshot of one prefix key (§7.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QuotaCand {
    newest: i64,
    key: KeyId,
}

/// A snapshot a build selects from: its key (blob references are taken for kept ones) and
/// its order among the build's candidates.
trait Candidate: Copy {
    fn key(&self) -> KeyId;
    /// The build's total order (§7.1 for quota snapshots, §7.2 for cap snapshots).
    fn order(cat: &Catalog, a: &Self, b: &Self) -> Ordering;
    /// Whether `self` sorts after `top` on its numbers alone, before the full (string)
    /// comparison: a cheap rejection for a full selection.
    fn after_on_numbers(&self, _top: &Self) -> bool {
        false
    }
}

impl Candidate for CapCand {
    fn key(&self) -> KeyId {
        self.key
    }
    fn order(cat: &Catalog, a: &Self, b: &Self) -> Ordering {
        cap_cmp(cat, a, b)
    }
    fn after_on_numbers(&self, top: &Self) -> bool {
        (self.eff, self.last_seen) > (top.eff, top.last_seen)
    }
}

impl Candidate for QuotaCand {
    fn key(&self) -> KeyId {
        self.key
    }
    fn order(cat: &Catalog, a: &Self, b: &Self) -> Ordering {
        quota_cmp(cat, a, b)
    }
}

/// The selection state a build offers snapshots into ([`CapBuild`], [`QuotaBuild`]): during
/// the scan the `k` smallest offered are kept (a max-heap); once the scan ended (`threshold`
/// set), a snapshot `<=` the threshold joins `late`. Kept snapshots hold a blob reference.
struct Selection<'a, C> {
    sel: &'a mut Heap<C>,
    k: usize,
    dropped: &'a mut bool,
    threshold: Option<Option<C>>,
    late: &'a mut Vec<C>,
}

impl<C: Candidate> Selection<'_, C> {
    fn offer(self, cat: &mut Catalog, c: C) {
        if let Some(t) = self.threshold {
            if let Some(t) = &t
                && C::order(cat, &c, t) == Ordering::Greater
            {
                return;
            }
            self.late.push(c);
            retain_blob(cat, c.key());
            return;
        }
        let out = {
            let cat = &*cat;
            let greater = |a: &C, b: &C| C::order(cat, a, b) == Ordering::Greater;
            if self.sel.len() < self.k {
                self.sel.push(c, &greater);
                None
            } else {
                *self.dropped = true;
                let top = *self.sel.peek().expect("non-empty");
                if c.after_on_numbers(&top) || !greater(&top, &c) {
                    return;
                }
                Some(self.sel.replace_top(c, &greater))
            }
        };
        retain_blob(cat, c.key());
        if let Some(o) = out {
            release_blob(cat, o.key());
        }
    }
}

/// Compares two keys' `(model, scheme, adapter, hash bytes)`, optionally tenant first.
fn key_cmp(cat: &Catalog, a: KeyId, b: KeyId, with_tenant: bool) -> Ordering {
    if a.ks != b.ks {
        let ka = &cat.keyspaces[a.keyspace() as usize];
        let kb = &cat.keyspaces[b.keyspace() as usize];
        if ka.scope != kb.scope {
            let sa = &cat.scopes[ka.scope as usize];
            let sb = &cat.scopes[kb.scope as usize];
            let name = |x: u32, y: u32| {
                if x == y {
                    Ordering::Equal
                } else {
                    cat.strings.name(x).cmp(cat.strings.name(y))
                }
            };
            let o = if with_tenant {
                name(sa.tenant, sb.tenant)
            } else {
                Ordering::Equal
            }
            .then_with(|| name(sa.model, sb.model))
            .then_with(|| name(sa.scheme, sb.scheme));
            if o != Ordering::Equal {
                return o;
            }
        }
        if ka.adapter != kb.adapter {
            let o = cat
                .strings
                .name(ka.adapter)
                .cmp(cat.strings.name(kb.adapter));
            if o != Ordering::Equal {
                return o;
            }
        }
    }
    if !a.is_blob() && !b.is_blob() {
        return a.h.cmp(&b.h);
    }
    let (mut ba, mut bb) = ([0u8; 8], [0u8; 8]);
    cat.hash_bytes(a, &mut ba).cmp(cat.hash_bytes(b, &mut bb))
}

fn cap_cmp(cat: &Catalog, a: &CapCand, b: &CapCand) -> Ordering {
    a.eff
        .cmp(&b.eff)
        .then(a.last_seen.cmp(&b.last_seen))
        .then_with(|| key_cmp(cat, a.key, b.key, true))
        .then_with(|| {
            if a.replica == b.replica {
                Ordering::Equal
            } else {
                cat.strings.name(a.replica).cmp(cat.strings.name(b.replica))
            }
        })
}

fn quota_cmp(cat: &Catalog, a: &QuotaCand, b: &QuotaCand) -> Ordering {
    a.newest
        .cmp(&b.newest)
        .then_with(|| key_cmp(cat, a.key, b.key, false))
}

/// Global-cap candidate heap.
#[derive(Default)]
pub(crate) struct CapState {
    active: bool,
    heap: Heap<CapCand>,
    threshold: Option<CapCand>,
    built: usize,
    /// The next candidate selection, built ahead of need in slices ([`Index::cap_prebuild_step`]);
    /// installed in place of `heap` when complete (or finished in one go by the first pop that
    /// finds `heap` empty before then).
    next: Option<CapBuild>,
    /// Snapshots of a replaced (or oversized) heap whose blob references are still to be given
    /// back: released a slice at the time ([`Index::cap_prebuild_step`]), since reading and
    /// freeing a heap of `entries / 16` snapshots takes ≈ 20 ms at 10M entries.
    retired: Vec<CapCand>,
    /// Further snapshot lists waiting for their release after `retired` (a heap retired while
    /// another still was, a build dropped by [`Index::cap_forget`]): queued, not released in
    /// one step.
    retired_queue: Vec<Vec<CapCand>>,
    /// The emptied buffer of the last retired heap, kept for the next build's selection: freeing
    /// or shrinking it unmapped ≈ 20 MB of touched pages at 10M entries (1–5 ms in one slice
    /// with the system allocator), and the next build faulted them in again.
    spare: Vec<CapCand>,
}

/// Quota heaps dropped by the reclaim pass, whose blob references are still to be given back:
/// released in the cap build's slices ([`Index::cap_prebuild_step`]), since one reclaim slice
/// cannot visit every snapshot of every tenant's heap (a client decides how many tenants and
/// keys there are).
#[derive(Default)]
pub(crate) struct QuotaRetired {
    /// Whole tables of heaps, taken off the index in one move each.
    tables: Vec<hashbrown::HashMap<u32, QuotaState>>,
    /// The snapshots of the heap being released (taken from the end).
    current: Vec<QuotaCand>,
    /// Snapshot lists of single heaps or builds, released after `current`.
    lists: Vec<Vec<QuotaCand>>,
}

impl QuotaRetired {
    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty() && self.current.is_empty() && self.lists.is_empty()
    }

    /// Queues one heap's (or build's) snapshots for their release.
    fn push(&mut self, v: Vec<QuotaCand>) {
        if !v.is_empty() {
            self.lists.push(v);
        }
    }
}

/// A tenant's quota candidate selection built in slices ([`Index::quota_victims_step`]) before
/// the ingest (or cross-core candidate request) that needs it, instead of in one O(keys of the
/// core) scan inside it ([`Index::quota_build`]). The same phases as a cap build ([`CapBuild`]):
/// a scan of places up to `cursor` (`Store::scan`), a mutation of a key of the tenant not yet
/// visited offering its new snapshot; then `sel` reordered into a min-heap in place, a
/// mutation meanwhile adding its snapshot to `late` when `<=` the threshold. When complete,
/// every key of the tenant whose current snapshot is `<=` the threshold is in the heap under it:
/// the candidate-heap invariant, so the victims are those of the one-go build.
pub(crate) struct QuotaBuild {
    tenant: u32,
    /// The `k` smallest snapshots offered so far, as a max-heap.
    sel: Heap<QuotaCand>,
    k: usize,
    /// Some offered snapshot was not kept: the selection has a threshold.
    dropped: bool,
    /// Scan phase: the places before `cursor` were visited.
    cursor: Loc,
    /// Reorder phase: `Some(threshold)` (`None` inside: everything offered was kept).
    threshold: Option<Option<QuotaCand>>,
    /// Reorder phase: the subtrees of `sel` rooted at `heapify..` are min-heaps already.
    heapify: usize,
    /// Reorder phase: snapshots offered since the scan ended.
    late: Vec<QuotaCand>,
}

impl QuotaBuild {
    /// Offers a snapshot (see [`CapBuild::offer`]); kept snapshots hold a blob reference.
    fn offer(&mut self, cat: &mut Catalog, c: QuotaCand) {
        let sel = Selection {
            sel: &mut self.sel,
            k: self.k,
            dropped: &mut self.dropped,
            threshold: self.threshold,
            late: &mut self.late,
        };
        sel.offer(cat, c);
    }

    /// Every snapshot this build holds a blob reference for.
    fn into_snapshots(mut self) -> Vec<QuotaCand> {
        let mut v = std::mem::take(&mut self.sel.v);
        v.append(&mut self.late);
        v.extend(self.threshold.flatten());
        v
    }
}

/// Re-resolving the tenants' eviction algorithms after a rules change
/// ([`Index::algorithms_step`]): model scope records `cursor..end` are still to be visited.
pub(crate) struct AlgoRefresh {
    pub(crate) cursor: usize,
    pub(crate) end: usize,
}

/// One tenant's quota candidate heap.
#[derive(Default)]
pub(crate) struct QuotaState {
    heap: Heap<QuotaCand>,
    threshold: Option<QuotaCand>,
    built: usize,
}

/// A cap candidate selection in progress: the same selection as the one-step build, spread over
/// slices, with the mutations between two slices offered to it.
///
/// * Scan phase: the store's keys are visited in place order ([`Store::scan`]) from the first
///   to the last. A held key keeps its place, so every key held throughout is visited once.
///   A mutation of an entry at a place the scan passed (visited, or a new key placed there)
///   offers its new snapshot; one at a place still ahead is left to the scan, which reads the
///   entry when it gets there. A key of many holders may be visited over several slices
///   ([`Index::cap_scan_key`]): it is then at the cursor, and its mutations are offered
///   meanwhile (an entry offered twice is a duplicate snapshot, harmless).
/// * Reorder phase (`threshold` set): `sel` is turned into a min-heap in place (bottom-up, a few
///   subtrees per slice), then `late` is pushed into it; a mutation adds its snapshot to `late`
///   when it is `<=` the threshold.
/// * Prune (end of the reorder phase): stale snapshots are popped off the top of `sel` until the
///   top is live. The live heap evicts the smallest entries while the build runs, and those are
///   the build's smallest snapshots: without this, the first pop after the install dropped them
///   all on the ingest path (≈ 100K snapshots, 60–240 ms at 10M entries).
///
/// So when `late` is empty, every entry whose current key is `<=` the threshold is in `sel`
/// under that key: the candidate-heap invariant, as after a one-step build.
pub(crate) struct CapBuild {
    /// The `k` smallest snapshots offered so far, as a max-heap (the top is the largest kept).
    sel: Heap<CapCand>,
    k: usize,
    /// Some offered snapshot was not kept (rejected, or pushed out by a smaller one): the
    /// selection has a threshold.
    dropped: bool,
    /// Scan phase: the places before `cursor` were visited.
    cursor: Loc,
    /// Scan phase: `Some(r)` when the key at `cursor` is visited in part (see
    /// [`Index::cap_scan_key`]): its holders of replicas `r` and up are still to be offered.
    /// Mutations of that key are offered meanwhile.
    partial: Option<u32>,
    /// Per-keyspace policy bits of the current slice ([`KS_UNKNOWN`] until looked up).
    bits: Vec<u8>,
    /// Reorder phase: `Some(threshold)` (`None` inside: everything offered was kept).
    threshold: Option<Option<CapCand>>,
    /// Reorder phase: the subtrees of `sel` rooted at `heapify..` are min-heaps already.
    heapify: usize,
    /// Reorder phase: snapshots offered since the scan ended, pushed into `sel` once it is a
    /// min-heap.
    late: Vec<CapCand>,
}

/// A sliced cap build offers a wide key's holders this many at a time and checks its budget
/// (reading the clock) between two such chunks: one key's 1,024 holders were 1–1.5 ms of heap
/// work at the `held` shape of `maintenance_stress` (10M entries), more than a slice. An offer
/// late in a build (a walk down a selection of `entries / 16` snapshots, ties falling through
/// to the names) costs microseconds: chunks of 32 still overran the 250 µs budget to ≈ 0.5 ms
/// of thread CPU, chunks of 8 to ≈ 0.3–0.4 ms (perf/runs/2026-12-06-h30i.md).
pub(crate) const CAP_SCAN_HOLDER_CHUNK: usize = 8;

/// A spare selection buffer is reused for a build that needs at most this many times less.
const SPARE_SLACK: usize = 2;

/// Snapshots a selection of `k` needs room for: the live heap it becomes may grow to
/// `2 k + min_candidates` before it is dropped (see [`CapBuild::new`]).
fn selection_capacity(k: usize, min_candidates: usize) -> usize {
    2 * k.max(1) + min_candidates + 1
}

/// An empty buffer for `capacity` snapshots, whose range goes to `hook` before its first write
/// ([`IndexConfig::gradual_buffer_hook`](super::IndexConfig::gradual_buffer_hook)).
fn fresh_buffer(capacity: usize, hook: Option<fn(usize, usize)>) -> Vec<CapCand> {
    let v = Vec::with_capacity(capacity);
    if let Some(hook) = hook {
        hook(
            v.as_ptr() as usize,
            v.capacity() * std::mem::size_of::<CapCand>(),
        );
    }
    v
}

/// [`CapBuild::bits`]: not looked up yet in this slice.
const KS_UNKNOWN: u8 = 0xff;
/// [`CapBuild::bits`]: no candidate in this keyspace (reserved tenant, or no keys).
const KS_SKIP: u8 = 1;
/// [`CapBuild::bits`]: the tenant's algorithm is LFU.
const KS_LFU: u8 = 2;

/// What one [`Index::cap_prebuild_step`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CapBuildStep {
    /// Storage entries visited plus candidate reorder steps.
    pub entries: usize,
    /// This step started a build.
    pub started: bool,
    /// This step completed the build and installed its candidates.
    pub finished: bool,
    /// A build is still in progress after this step.
    pub in_progress: bool,
}

/// A finished scan's threshold: the selection's top when the scan dropped snapshots (a
/// snapshot taken later is kept only if it does not sort after it), else none (every later snapshot
/// is kept). The threshold snapshot holds its own blob reference.
fn scan_threshold<C: Candidate>(cat: &mut Catalog, sel: &Heap<C>, dropped: bool) -> Option<C> {
    let threshold = if dropped { sel.peek().copied() } else { None };
    if let Some(t) = &threshold {
        retain_blob(cat, t.key());
    }
    threshold
}

fn retain_blob(cat: &mut Catalog, key: KeyId) {
    if key.is_blob() {
        cat.blobs.retain(key.h as u32);
    }
}

fn release_blob(cat: &mut Catalog, key: KeyId) {
    if key.is_blob() {
        cat.blobs.release(key.h as u32);
    }
}

/// Offers one holder of `key` to a build (`lfu`: its tenant's algorithm is LFU).
#[inline]
fn cap_offer_holder(b: &mut CapBuild, cat: &mut Catalog, key: KeyId, lfu: bool, h: &Holder) {
    let c = CapCand {
        eff: if lfu { h.access } else { 0 },
        last_seen: h.last_seen(),
        key,
        replica: h.replica(),
    };
    if !b.rejects_at_once(&c) {
        b.offer(cat, c);
    }
}

impl CapBuild {
    /// A build of `k` candidates over the store's keys. The selection becomes the next
    /// live heap, which mutations may grow to `2 k + min_candidates` before it is dropped: that
    /// capacity is reserved now (address space; pages are touched only as used), so no push
    /// ever copies the heap to grow it (≈ 10 ms per copy at 10M entries, on a slice or ingest).
    /// `spare` is an empty buffer to reuse when its capacity fits (within [`SPARE_SLACK`]).
    /// A fresh buffer's range goes to `fresh_hook` before its first write.
    fn new(
        k: usize,
        min_candidates: usize,
        spare: Vec<CapCand>,
        fresh_hook: Option<fn(usize, usize)>,
    ) -> CapBuild {
        let k = k.max(1);
        let want = selection_capacity(k, min_candidates);
        let mut v = spare;
        v.clear();
        if v.capacity() < want || v.capacity() > want * SPARE_SLACK {
            v = fresh_buffer(want, fresh_hook);
        }
        CapBuild {
            sel: Heap { v },
            k,
            dropped: false,
            cursor: FIRST,
            partial: None,
            bits: Vec::new(),
            threshold: None,
            heapify: 0,
            late: Vec::new(),
        }
    }

    /// Whether the scan passed place `pos`: a mutation there offers its snapshot.
    fn visited(&self, pos: Loc) -> bool {
        pos < self.cursor || (self.partial.is_some() && pos == self.cursor)
    }

    /// Offers a snapshot: kept while among the `k` smallest offered (scan phase), or added to
    /// `late` when `<=` the threshold (reorder phase). Kept snapshots hold a blob reference.
    /// The common case of a scan, decided without a call: the selection is full and `c` sorts
    /// after its maximum on the numbers alone (what [`CapBuild::offer`] would find first).
    #[inline]
    fn rejects_at_once(&mut self, c: &CapCand) -> bool {
        if self.threshold.is_some() || self.sel.len() < self.k {
            return false;
        }
        let top = self.sel.peek().expect("full");
        if (c.eff, c.last_seen) > (top.eff, top.last_seen) {
            self.dropped = true;
            return true;
        }
        false
    }

    fn offer(&mut self, cat: &mut Catalog, c: CapCand) {
        let sel = Selection {
            sel: &mut self.sel,
            k: self.k,
            dropped: &mut self.dropped,
            threshold: self.threshold,
            late: &mut self.late,
        };
        sel.offer(cat, c);
    }

    /// Gives back every blob reference this build holds.
    fn release_all(mut self, cat: &mut Catalog) {
        let keys: Vec<KeyId> = self
            .sel
            .drain()
            .chain(self.late.drain(..))
            .chain(self.threshold.flatten())
            .map(|c| c.key)
            .collect();
        for k in keys {
            release_blob(cat, k);
        }
    }
}

impl Index {
    fn retain_key(&mut self, key: KeyId) {
        retain_blob(&mut self.cat, key);
    }

    fn release_key(&mut self, key: KeyId) {
        release_blob(&mut self.cat, key);
    }

    /// The current cap snapshot of an entry, if it exists and is not reserved. `pos` is the
    /// key's place when the caller already knows it (saves a table probe).
    /// A stale snapshot's key may belong to a tenant whose record the reclaim pass already
    /// unlinked (its keys are gone; the snapshots are dropped only at the pass's release stage):
    /// no record, no entry.
    fn cap_cand(&self, key: KeyId, replica: u32, pos: Option<Loc>) -> Option<CapCand> {
        let t = self.cat.tenants.get(&self.cat.tenant_of(key))?;
        if t.reserved {
            return None;
        }
        let pos = match pos {
            Some(p) => p,
            None => self.store.find(key)?,
        };
        debug_assert_eq!(self.store.key_at(pos), key);
        let h = self.store.holder_of(pos, replica)?;
        let eff = if t.algo == Eviction::Lfu { h.access } else { 0 };
        Some(CapCand {
            eff,
            last_seen: h.last_seen(),
            key,
            replica,
        })
    }

    /// Drops the live cap heap (too many stale snapshots), keeping a build in progress.
    fn cap_drop_heap(&mut self) {
        // Only blob-hash keys hold a reference (no copy of the heap: it may be large).
        for c in self.cap.heap.v.iter().chain(self.cap.threshold.iter()) {
            if c.key.is_blob() {
                self.cat.blobs.release(c.key.h as u32);
            }
        }
        self.cap.threshold = None;
        self.cap.active = false;
        self.cap.built = 0;
        self.cap.heap = Heap::default();
    }

    /// Retires the live heap (its snapshots' blob references are given back later, in slices,
    /// by [`Index::cap_prebuild_step`]), keeping a build in progress.
    fn cap_retire_heap(&mut self) {
        let mut v = std::mem::take(&mut self.cap.heap.v);
        v.extend(self.cap.threshold.take());
        if !v.is_empty() && !self.cap.retired.is_empty() {
            self.cap.retired_queue.push(v);
        } else if v.is_empty() {
            // Nothing to give back (a heap reserved before any build): a spare at once.
            if v.capacity() > self.cap.spare.capacity() {
                self.cap.spare = v;
            }
        } else {
            self.cap.retired = v;
        }
        self.cap.active = false;
        self.cap.built = 0;
    }

    /// Allocates, before the core serves, the two selection buffers builds ahead of need
    /// alternate between (the spare, and the live heap's when it has none), sized for this
    /// core's entries or its share of the cap over `shards` cores, whichever is larger: address
    /// space only, each range given to the hook. A build that allocated one while serving took
    /// a page fault the hook cannot prevent, the allocator's own first write into the block
    /// (≈ 25 ms in one slice on this project's VM with huge pages). Without a cap, nothing.
    pub fn reserve_cap_buffers(&mut self, shards: usize) {
        if self.cfg.max_entries == 0 {
            return;
        }
        let share = usize::try_from(self.cfg.max_entries).unwrap_or(usize::MAX) / shards.max(1);
        let entries = share.max(self.store.entry_count());
        let k = self.min_candidates.max(entries / PREBUILD_AMORTISATION);
        let want = selection_capacity(k, self.min_candidates);
        let hook = self.cfg.gradual_buffer_hook;
        if self.cap.spare.capacity() < want {
            self.cap.spare = fresh_buffer(want, hook);
        }
        if self.cap.heap.v.capacity() == 0 {
            self.cap.heap.v = fresh_buffer(want, hook);
        }
    }

    /// Gives back the blob references of up to `max` retired snapshots; the emptied buffer
    /// becomes the spare (never shrunk or freed here). Returns how many were handled.
    fn cap_release_retired(&mut self, max: usize) -> usize {
        let r = &mut self.cap.retired;
        let n = r.len().min(max);
        for c in r.drain(r.len() - n..) {
            if c.key.is_blob() {
                self.cat.blobs.release(c.key.h as u32);
            }
        }
        if r.is_empty() {
            match self.cap.retired_queue.pop() {
                Some(next) => *r = next,
                None => self.cap.spare = std::mem::take(r),
            }
        }
        n
    }

    /// Drops the cap heap and any build in progress (policy change, reclaim, restore).
    pub(crate) fn cap_clear(&mut self) {
        while !self.cap.retired.is_empty() {
            self.cap_release_retired(usize::MAX);
        }
        self.cap_drop_heap();
        if let Some(b) = self.cap.next.take() {
            b.release_all(&mut self.cat);
        }
        self.cap = CapState::default();
    }

    /// Drops the cap heap and any build in progress (reclaim pass, policy change), like
    /// [`Index::cap_clear`] but retiring the live heap: its blob references are given back in
    /// the cap build's slices, not in the reclaim slice (a heap of `entries / 16` snapshots).
    pub(crate) fn cap_forget(&mut self) {
        self.cap_retire_heap();
        if let Some(b) = self.cap.next.take() {
            let mut queue = [b.sel.v, b.late, b.threshold.flatten().into_iter().collect()];
            for v in queue.iter_mut().filter(|v| !v.is_empty()) {
                let v = std::mem::take(v);
                if self.cap.retired.is_empty() {
                    self.cap.retired = v;
                } else {
                    self.cap.retired_queue.push(v);
                }
            }
        }
    }

    /// Mutation hook: keeps the cap-heap invariant (and a build's) after an entry's sort key
    /// changed.
    #[inline]
    pub(crate) fn cap_touch(&mut self, key: KeyId, replica: u32, pos: Option<Loc>) {
        // Inlined into every upsert: without a cap heap or a build, a touch is this test.
        if !self.cap.active && self.cap.next.is_none() {
            return;
        }
        self.cap_touch_tracked(key, replica, pos);
    }

    /// [`Index::cap_touch`] with a heap or a build to keep up to date.
    #[inline(never)]
    fn cap_touch_tracked(&mut self, key: KeyId, replica: u32, pos: Option<Loc>) {
        let pos = match pos {
            Some(p) => p,
            None => match self.store.find(key) {
                Some(p) => p,
                None => return,
            },
        };
        let Some(c) = self.cap_cand(key, replica, Some(pos)) else {
            return;
        };
        if let Some(b) = self.cap.next.as_mut()
            && (b.threshold.is_some() || b.visited(pos))
        {
            b.offer(&mut self.cat, c);
        }
        if !self.cap.active {
            return;
        }
        let cat = &self.cat;
        if let Some(t) = &self.cap.threshold
            && cap_cmp(cat, &c, t) == Ordering::Greater
        {
            return;
        }
        self.cap
            .heap
            .push(c, &|a, b| cap_cmp(cat, a, b) == Ordering::Less);
        self.retain_key(key);
        if self.cap.heap.len() > 2 * self.cap.built + self.min_candidates {
            self.cap_retire_heap();
        }
    }

    /// Starts a cap candidate build of `k` candidates (abandoning one in progress).
    fn cap_build_begin(&mut self, k: usize) {
        if let Some(b) = self.cap.next.take() {
            b.release_all(&mut self.cat);
        }
        let spare = std::mem::take(&mut self.cap.spare);
        self.cap.next = Some(CapBuild::new(
            k,
            self.min_candidates,
            spare,
            self.cfg.gradual_buffer_hook,
        ));
    }

    /// Whether a build offers the holders of keyspace `ks` and, if so, whether its tenant is
    /// LFU (looked up once per keyspace and slice, in [`CapBuild::bits`]).
    fn cap_build_lfu(&self, b: &mut CapBuild, ks: usize) -> Option<bool> {
        if b.bits[ks] == KS_UNKNOWN {
            let p = &self.cat.keyspaces[ks];
            b.bits[ks] = if p.keys == 0 {
                KS_SKIP // freed records included (none of their keys is in the store)
            } else {
                let t = &self.cat.tenants[&self.cat.scopes[p.scope as usize].tenant];
                if t.reserved {
                    KS_SKIP
                } else if t.algo == Eviction::Lfu {
                    KS_LFU
                } else {
                    0
                }
            };
        }
        let bits = b.bits[ks];
        (bits & KS_SKIP == 0).then_some(bits & KS_LFU != 0)
    }

    /// Offers the key at place `pos` (the scan's `cursor`) to a sliced build: its holders by
    /// replica, [`CAP_SCAN_HOLDER_CHUNK`] at a time, stopping between two chunks once `meter`
    /// says the slice is spent (`b.partial` then names the replica to resume at; returns
    /// false).
    ///
    /// Why a key visited in part loses none of its holders: mutations of it are offered (its
    /// place is the cursor); the holders still to be offered are those of replicas from
    /// `b.partial` up, found again by replica whatever was added or removed in between.
    fn cap_scan_key(
        &mut self,
        b: &mut CapBuild,
        pos: Loc,
        work: &mut usize,
        meter: &mut BudgetMeter,
    ) -> bool {
        let resume = b.partial.take();
        let key = self.store.key_at(pos);
        let Some(lfu) = self.cap_build_lfu(b, key.keyspace() as usize) else {
            return true;
        };
        let mut from = resume.unwrap_or(0);
        let mut first_chunk = resume.is_none();
        loop {
            // Never before a key's first chunk: each slice makes progress.
            if !first_chunk && *work > 0 && meter.spent_each(*work) {
                b.partial = Some(from);
                return false;
            }
            first_chunk = false;
            let mut offered = 0;
            let mut next = None;
            for h in self.store.holders_from(pos, from) {
                if offered == CAP_SCAN_HOLDER_CHUNK {
                    next = Some(h.replica());
                    break;
                }
                cap_offer_holder(b, &mut self.cat, key, lfu, &h);
                offered += 1;
            }
            meter.charge_entries(offered);
            *work += offered;
            match next {
                Some(r) => from = r,
                None => return true,
            }
        }
    }

    /// Runs the build in progress within `budget` (storage entries visited plus candidate
    /// reorder steps; the clock is read every few keys). Installs its candidates in place of the
    /// live heap when it completes. Returns the work done and whether it completed.
    fn cap_build_run(&mut self, budget: SweepBudget) -> (usize, bool) {
        let mut b = self.cap.next.take().expect("cap build in progress");
        let mut work = 0usize;
        let mut meter = budget.meter();
        if b.threshold.is_none() {
            // Scan phase.
            b.bits.clear();
            b.bits.resize(self.cat.keyspaces.len(), KS_UNKNOWN);
            let mut cut = false;
            if b.partial.is_some() && self.store.scan(b.cursor, 1) != Scan::Held(b.cursor) {
                // The key visited in part is gone: its place holds none now.
                b.partial = None;
            }
            while !cut {
                if b.partial.is_none() && meter.spent(work) {
                    cut = true;
                    break;
                }
                match self.store.scan(b.cursor, PLACES_PER_STEP) {
                    Scan::End => break,
                    Scan::Paused(at) => {
                        // Places without a key count as work too: a slice over a store of
                        // mostly empty places stays bounded.
                        b.cursor = at;
                        work += PLACES_PER_STEP;
                    }
                    Scan::Held(pos) => {
                        b.cursor = pos;
                        cut = !self.cap_scan_key(&mut b, pos, &mut work, &mut meter);
                        if !cut {
                            b.cursor = Store::after(pos);
                        }
                    }
                }
            }
            if cut {
                self.cap.next = Some(b);
                return (work, false);
            }
            b.threshold = Some(scan_threshold(&mut self.cat, &b.sel, b.dropped));
            b.heapify = b.sel.len() / 2;
        }
        // Reorder phase: `sel` becomes a min-heap in place (bottom-up), then takes `late`.
        let mut cut = false;
        {
            let cat = &self.cat;
            let less = |a: &CapCand, b: &CapCand| cap_cmp(cat, a, b) == Ordering::Less;
            while b.heapify > 0 || !b.late.is_empty() {
                if meter.spent_each(work) {
                    cut = true;
                    break;
                }
                if b.heapify > 0 {
                    b.heapify -= 1;
                    b.sel.sift_down(b.heapify, &less);
                } else {
                    let c = b.late.pop().expect("non-empty");
                    b.sel.push(c, &less);
                }
                work += 1;
            }
        }
        if !cut {
            cut = self.cap_prune_stale(&mut b, &mut work, &mut meter);
        }
        if cut {
            self.cap.next = Some(b);
            return (work, false);
        }
        self.cap_retire_heap();
        self.cap.heap = std::mem::take(&mut b.sel);
        self.cap.threshold = b.threshold.flatten();
        self.cap.built = b.k;
        self.cap.active = true;
        (work, true)
    }

    /// Prune phase of a build (see [`CapBuild`]): pops stale snapshots off the top of the
    /// reordered selection until the top is live or the budget is spent (returns true then).
    /// Dropping a stale snapshot keeps the heap invariant, as a pop would.
    fn cap_prune_stale(
        &mut self,
        b: &mut CapBuild,
        work: &mut usize,
        meter: &mut BudgetMeter,
    ) -> bool {
        while let Some(&top) = b.sel.peek() {
            if self.cap_cand(top.key, top.replica, None) == Some(top) {
                return false;
            }
            if meter.spent_each(*work) {
                return true;
            }
            let cat = &self.cat;
            b.sel.pop(&|x, y| cap_cmp(cat, x, y) == Ordering::Less);
            self.release_key(top.key);
            *work += 1;
        }
        false
    }

    /// Builds the cap heap now, on the path that needs a victim: finishes the build in progress
    /// if there is one, else runs a whole build of `max(need, MIN_CANDIDATES, entries / 32)`
    /// candidates. Counted in [`Index::take_cap_sync_builds`].
    /// Returns whether the build was a whole one (not the end of one in progress, whose
    /// candidates may all have gone stale since they were offered).
    fn cap_build(&mut self, need: usize) -> bool {
        let whole = self.cap.next.is_none();
        if whole {
            let k = need
                .max(self.min_candidates)
                .max(self.store.entry_count() / SCAN_AMORTISATION);
            self.cap_build_begin(k);
        }
        let (_, done) = self.cap_build_run(SweepBudget::UNBOUNDED);
        debug_assert!(done);
        self.cap_sync_builds += 1;
        whole
    }

    /// Whether a cap candidate build ahead of need is in progress or should start: a global cap
    /// is set, the directory's non-reserved count is within `max_entries / PREBUILD_NEAR_CAP` of
    /// it, this core has non-reserved entries, and the live heap is missing, or has a threshold
    /// and holds at most `1 / PREBUILD_LOW_WATER` of the candidates it was built with.
    /// (Or a replaced heap's snapshots are still to be released.)
    pub fn cap_prebuild_wanted(&self) -> bool {
        self.algo_refresh.is_some()
            || self.cap.next.is_some()
            || !self.cap.retired.is_empty()
            || !self.quota_retired.is_empty()
            || self.cap_build_due()
    }

    /// How many global-cap victims this core's ingest of `new_entries` entries may take in the
    /// ingest itself: none with [`IndexConfig::cross_core_eviction`] (a cross-core selection
    /// asks each core for candidates after it, [`Index::cap_candidates`]), none below the cap.
    ///
    /// [`IndexConfig::cross_core_eviction`]: super::IndexConfig::cross_core_eviction
    pub fn cap_victims_for_ingest(&self, new_entries: usize) -> usize {
        let max = self.cfg.max_entries;
        if max == 0 || self.cfg.cross_core_eviction {
            return 0;
        }
        let over = self.dir.non_reserved_entries() + new_entries as i64 - max as i64;
        usize::try_from(over).unwrap_or(0).min(new_entries)
    }

    /// Whether taking `need` global-cap victims (or candidates) on this core would build them in
    /// one O(entries) step because they are not ready: the tenants' algorithms are being
    /// re-resolved after a policy change, there is no live candidate heap, or it holds fewer
    /// than `need` and not every entry. [`Index::cap_victims_step`] does that work in slices
    /// instead; each makes progress while this holds.
    pub fn cap_victims_pending(&self, need: usize) -> bool {
        if need == 0 || self.cfg.max_entries == 0 || self.non_reserved_entry_count() == 0 {
            return false;
        }
        self.algo_refresh.is_some()
            || !self.cap.active
            || (self.cap.threshold.is_some() && self.cap.heap.len() < need)
    }

    /// One slice of readying `need` cap victims (see [`Index::cap_victims_pending`]): the
    /// tenants' algorithms first, then a build of at least that many candidates (a build in
    /// progress for fewer starts over). Returns the work done. Like a build ahead of need, it
    /// changes nothing observable.
    pub fn cap_victims_step(
        &mut self,
        need: usize,
        rules: &dyn TenantRules,
        budget: SweepBudget,
    ) -> usize {
        if self.algo_refresh.is_some() {
            return self.algorithms_step(rules, budget);
        }
        let need = need
            .max(self.min_candidates)
            .max(self.store.entry_count() / PREBUILD_AMORTISATION);
        if self.cap.next.as_ref().is_none_or(|b| b.k < need) {
            self.cap_build_begin(need);
        }
        self.cap_build_run(budget).0
    }

    /// Whether a new cap build ahead of need should start (see [`Index::cap_prebuild_wanted`]).
    fn cap_build_due(&self) -> bool {
        let max = self.cfg.max_entries;
        if max == 0 || self.non_reserved_entry_count() == 0 {
            return false;
        }
        let near = max / PREBUILD_NEAR_CAP as u64;
        if self.dir.non_reserved_entries() + (near as i64) < max as i64 {
            return false;
        }
        !self.cap.active
            || (self.cap.threshold.is_some()
                && self.cap.heap.len() * PREBUILD_LOW_WATER <= self.cap.built)
    }

    /// One slice of the cap candidate build ahead of need: starts one when
    /// [`Index::cap_prebuild_wanted`] (of `max(MIN_CANDIDATES, entries / PREBUILD_AMORTISATION)`
    /// candidates), then visits entries (and then reorders the kept candidates into the new
    /// heap) until `budget` is spent; installs the new heap when complete. Before that, slices
    /// give back what a replaced heap still holds. Changes nothing observable: the
    /// victims are those of the one-step build, only the work moves out of the ingest that
    /// needs them.
    pub fn cap_prebuild_step(&mut self, budget: SweepBudget) -> CapBuildStep {
        self.finish_clear();
        let mut step = CapBuildStep::default();
        if !self.quota_retired.is_empty() {
            // A slice of its own (of the same budget).
            step.entries = self.quota_release_retired(budget.max_entries);
            step.in_progress = self.cap_prebuild_wanted();
            return step;
        }
        if !self.cap.retired.is_empty() {
            // A slice of its own (of the same budget).
            step.entries = self.cap_release_retired(budget.max_entries);
            step.in_progress = self.cap_prebuild_wanted();
            return step;
        }
        if self.algo_refresh.is_some() {
            // No build on algorithms not yet re-resolved ([`Index::algorithms_step`] first).
            step.in_progress = true;
            return step;
        }
        if self.cap.next.is_none() && !self.cap_build_due() {
            return step;
        }
        if self.cap.next.is_none() {
            let k = self
                .min_candidates
                .max(self.store.entry_count() / PREBUILD_AMORTISATION);
            self.cap_build_begin(k);
            step.started = true;
        }
        let (work, done) = self.cap_build_run(budget);
        step.entries = work;
        step.finished = done;
        step.in_progress = !done;
        step
    }

    /// Cap candidate builds run (or finished) in one go on the path that needed a victim since
    /// the last call: each is an O(entries) step the core spent on one ingest (or one
    /// cross-core candidate request).
    pub fn take_cap_sync_builds(&mut self) -> u64 {
        std::mem::take(&mut self.cap_sync_builds)
    }

    /// The most stale snapshots one cap pop dropped on the path that needed a victim since the
    /// last call (each costs a table probe and a heap pop on that path).
    pub fn take_cap_max_stale_pops(&mut self) -> u64 {
        std::mem::take(&mut self.cap_max_stale_pops)
    }

    /// Test aid: panics unless the cap-heap invariant holds: every non-reserved entry whose
    /// current sort key is `<=` the threshold (all of them without one) is in the live heap
    /// under that key, and likewise for a build in its reorder phase (`sel` and `late`). O(n log n).
    #[doc(hidden)]
    pub fn cap_check_invariant(&self) {
        let cat = &self.cat;
        let check = |heap: &Heap<CapCand>, threshold: Option<&CapCand>, what: &str| {
            let mut snaps = heap.v.clone();
            snaps.sort_by(|a, b| cap_cmp(cat, a, b));
            for pos in self.store.places() {
                let key = self.store.key_at(pos);
                for h in self.store.holders(pos) {
                    let Some(c) = self.cap_cand(key, h.replica(), Some(pos)) else {
                        continue;
                    };
                    if threshold.is_some_and(|t| cap_cmp(cat, &c, t) == Ordering::Greater) {
                        continue;
                    }
                    assert!(
                        snaps
                            .binary_search_by(|s| cap_cmp(cat, s, &c))
                            .is_ok_and(|i| snaps[i] == c),
                        "{what}: entry {c:?} at {pos:?} (<= threshold {threshold:?}) missing"
                    );
                }
            }
        };
        if self.cap.active {
            check(&self.cap.heap, self.cap.threshold.as_ref(), "live heap");
        }
        if let Some(b) = &self.cap.next
            && let Some(t) = &b.threshold
        {
            let all = Heap {
                v: b.sel.v.iter().chain(&b.late).copied().collect(),
            };
            check(&all, t.as_ref(), "heap being reordered");
        }
    }

    /// Pops the minimum live cap candidate: `(key, replica)`. Without `build`, `None` where it
    /// would build candidates in one go (no live heap, or one run out of live snapshots).
    fn cap_pop(&mut self, need: usize, build: bool) -> Option<(KeyId, u32)> {
        let mut rebuilt = false;
        let mut stale = 0u64;
        if !self.cap.active {
            if !build {
                return None;
            }
            rebuilt = self.cap_build(need);
        }
        loop {
            let cat = &self.cat;
            let popped = self
                .cap
                .heap
                .pop(&|a, b| cap_cmp(cat, a, b) == Ordering::Less);
            let Some(c) = popped else {
                if rebuilt || self.cap.threshold.is_none() || !build {
                    return None;
                }
                // A whole build holds `need` live candidates (or every entry): one is enough.
                rebuilt = self.cap_build(need);
                continue;
            };
            let current = self.cap_cand(c.key, c.replica, None);
            self.release_key(c.key);
            if current == Some(c) {
                return Some((c.key, c.replica));
            }
            stale += 1;
            self.cap_max_stale_pops = self.cap_max_stale_pops.max(stale);
        }
    }
    /// Before a tenant's entries are stored by an ingest or a restore: the algorithm a new
    /// tenant record gets, and with [`IndexConfig::rules_change_notified`] the tenant's own
    /// record brought up to date (one rules lookup, whatever the number of tenants).
    ///
    /// [`IndexConfig::rules_change_notified`]: super::IndexConfig::rules_change_notified
    pub(crate) fn resolve_update_tenant(&mut self, tenant: &str, rules: &dyn TenantRules) {
        let algo = rules.eviction(tenant);
        self.new_tenant_algo = algo;
        if !self.cfg.rules_change_notified {
            return;
        }
        let Some(t) = self.cat.strings.get(tenant) else {
            return;
        };
        let Some(rec) = self.cat.tenants.get_mut(&t) else {
            return;
        };
        if rec.algo != algo {
            rec.algo = algo;
            if self.algo_refresh.is_none() {
                // A change the caller did not announce: the candidates keyed on the old
                // algorithm must go.
                self.cap_forget();
            }
        }
    }

    /// Whether the tenants' eviction algorithms are being re-resolved after
    /// [`Index::rules_changed`] (with `IndexConfig::rules_change_notified`): the server then
    /// runs [`Index::algorithms_step`] in its cap build slices instead of
    /// [`Index::cap_prebuild_step`].
    pub fn algorithms_pending(&self) -> bool {
        self.algo_refresh.is_some()
    }

    /// One slice of re-resolving the tenants' eviction algorithms after
    /// [`Index::rules_changed`]: visits model scope records (each tenant with entries has one)
    /// until `budget` is spent. Returns the records visited; [`Index::algorithms_pending`] says
    /// whether it finished. A tenant that ingests or restores meanwhile is resolved by that
    /// operation; records created after the change began are resolved the same way.
    pub fn algorithms_step(&mut self, rules: &dyn TenantRules, budget: SweepBudget) -> usize {
        let Some(mut r) = self.algo_refresh.take() else {
            return 0;
        };
        let mut meter = budget.meter();
        let mut work = 0;
        r.end = r.end.min(self.cat.models.len());
        while r.cursor < r.end {
            if meter.spent(work) {
                self.algo_refresh = Some(r);
                return work;
            }
            let t = self.cat.models[r.cursor].tenant;
            r.cursor += 1;
            work += 1;
            if t == super::DEAD {
                continue;
            }
            let Some(rec) = self.cat.tenants.get_mut(&t) else {
                continue;
            };
            if !rec.reserved && rec.entries > 0 {
                rec.algo = rules.eviction(self.cat.strings.name(t));
            }
        }
        work
    }

    /// Makes every tenant's algorithm current before cap victims are chosen: finishes a
    /// re-resolution in progress (counted as a build on the path that needed a victim), or,
    /// without `IndexConfig::rules_change_notified`, checks every tenant.
    fn algorithms_current(&mut self, rules: &dyn TenantRules) {
        if !self.cfg.rules_change_notified {
            self.refresh_algorithms(rules);
        } else if self.algo_refresh.is_some() {
            self.algorithms_step(rules, SweepBudget::UNBOUNDED);
            self.cap_sync_builds += 1;
        }
    }

    /// Re-resolves every tenant's eviction algorithm; drops the cap heap if any changed.
    fn refresh_algorithms(&mut self, rules: &dyn TenantRules) {
        let mut changed = false;
        for (t, rec) in self.cat.tenants.iter_mut() {
            if rec.reserved || rec.entries == 0 {
                continue;
            }
            let a = rules.eviction(self.cat.strings.name(*t));
            if a != rec.algo {
                rec.algo = a;
                changed = true;
            }
        }
        if changed {
            self.cap_forget();
        }
    }

    /// Global cap (§7.2): while the global non-reserved count exceeds the cap, evict this core's
    /// minimum entries, until `budget` is spent (evictions; at least one is made when any is
    /// owed). Counts removals per algorithm into `out` and reports each to the removal sink (at
    /// `now`). Returns whether the index is back within the cap (or has nothing left to evict);
    /// if not, the rest is owed ([`Index::cap_enforce_owed`]).
    pub(crate) fn enforce_cap(
        &mut self,
        rules: &dyn TenantRules,
        out: &mut EvictionCounts,
        now: i64,
        budget: SweepBudget,
    ) -> bool {
        let max = self.config().max_entries;
        if max == 0 {
            return true;
        }
        self.flush();
        let mut meter = budget.meter();
        let mut work = 0usize;
        let mut refreshed = false;
        loop {
            let over = self.directory().non_reserved_entries() - max as i64;
            if over <= 0 || self.non_reserved_entry_count() == 0 {
                return true;
            }
            if !refreshed {
                self.algorithms_current(rules);
                refreshed = true;
            }
            let mut evicted = 0i64;
            while evicted < over {
                if work > 0 && meter.spent(work) {
                    self.flush();
                    return false;
                }
                let Some((key, replica)) = self.cap_pop((over - evicted) as usize, true) else {
                    break;
                };
                let algo = self.cat.tenants[&self.cat.tenant_of(key)].algo;
                self.report_removal(key, replica, RemovalReason::Cap, algo, now);
                let removed = self.remove_entry(key, replica, now);
                debug_assert!(removed);
                out.add(algo);
                evicted += 1;
                work += 1;
                meter.charge_removals(1);
            }
            self.flush();
            if evicted == 0 {
                return true;
            }
        }
    }

    /// With sliced cap enforcement ([`Index::set_sliced_cap`], one core): an ingest that took
    /// the index over the global cap evicts at most one slice's worth itself; the server then
    /// runs [`Index::cap_enforce_step`] slices, serving requests between two, before it
    /// acknowledges the ingest.
    pub fn set_sliced_cap(&mut self, slice: Option<CapSlice>) {
        self.sliced_cap = slice;
    }

    /// Whether this core owes global-cap evictions: over the cap, with non-reserved entries of
    /// its own, and evicting by itself (one core).
    pub fn cap_enforce_owed(&self) -> bool {
        let max = self.cfg.max_entries;
        max > 0
            && !self.cfg.cross_core_eviction
            && self.non_reserved_entry_count() > 0
            && self.dir.non_reserved_entries() > max as i64
    }

    /// The evictions this core owes the global cap (see [`Index::cap_enforce_owed`]), 0 if none.
    pub fn cap_victims_owed(&self) -> usize {
        if !self.cap_enforce_owed() {
            return 0;
        }
        usize::try_from(self.dir.non_reserved_entries() - self.cfg.max_entries as i64).unwrap_or(0)
    }

    /// One slice of the global cap's owed evictions, within `budget`. Returns whether none are
    /// owed any more. Counts removals per algorithm into `out`, each reported to the removal sink.
    pub fn cap_enforce_step(
        &mut self,
        rules: &dyn TenantRules,
        out: &mut EvictionCounts,
        now: i64,
        budget: SweepBudget,
    ) -> bool {
        self.finish_clear();
        if !self.cap_enforce_owed() {
            return true;
        }
        self.enforce_cap(rules, out, now, budget) || !self.cap_enforce_owed()
    }

    // ---- quota ------------------------------------------------------------------------------

    fn quota_cand(&self, key: KeyId) -> Option<QuotaCand> {
        let pos = self.store.find(key)?;
        let newest = self.key_newest(pos)?;
        Some(QuotaCand { newest, key })
    }

    /// Mutation hook: keeps a tenant's quota-heap invariant after a key's newest time changed.
    #[inline(always)]
    pub(crate) fn quota_touch(&mut self, key: KeyId) {
        // Inlined into every upsert and removal: without a quota heap or a build, a touch is
        // this test (a call per block was ~20 instructions of the event path).
        if self.quotas.is_empty() && self.quota_next.is_none() {
            return;
        }
        self.quota_touch_tracked(key);
    }

    /// [`Index::quota_touch`] with a heap or a build to keep up to date.
    #[inline(never)]
    fn quota_touch_tracked(&mut self, key: KeyId) {
        let tenant = self.cat.tenant_of(key);
        if self.quota_next.as_ref().is_some_and(|b| b.tenant == tenant) {
            self.quota_touch_build(key);
        }
        let Some(q) = self.quotas.get(&tenant) else {
            return;
        };
        let Some(c) = self.quota_cand(key) else {
            return;
        };
        let cat = &self.cat;
        if let Some(t) = &q.threshold
            && quota_cmp(cat, &c, t) == Ordering::Greater
        {
            return;
        }
        let q = self.quotas.get_mut(&tenant).expect("quota state");
        q.heap
            .push(c, &|a, b| quota_cmp(cat, a, b) == Ordering::Less);
        let too_big = q.heap.len() > 2 * q.built + self.min_candidates;
        self.retain_key(key);
        if too_big {
            self.quota_clear(tenant);
        }
    }

    /// [`Index::quota_touch`] for the tenant's build in progress: offers the key's new
    /// snapshot unless the scan is still to visit it.
    fn quota_touch_build(&mut self, key: KeyId) {
        let Some(pos) = self.store.find(key) else {
            return;
        };
        let Some(newest) = self.key_newest(pos) else {
            return;
        };
        let b = self.quota_next.as_mut().expect("quota build");
        if b.threshold.is_some() || pos < b.cursor {
            b.offer(&mut self.cat, QuotaCand { newest, key });
        }
    }

    /// The newest holder time of the key at place `pos`.
    fn key_newest(&self, pos: Loc) -> Option<i64> {
        self.store
            .holders_uncounted(pos)
            .map(|h| h.last_seen())
            .max()
    }

    /// Drops every tenant's quota heap and any build in progress, their blob references given
    /// back at once (a policy knob of tests, the end of a restore: not on a serving core).
    pub(crate) fn quota_clear_all(&mut self) {
        for t in self.quotas.keys().copied().collect::<Vec<_>>() {
            self.quota_clear(t);
        }
        if let Some(b) = self.quota_next.take() {
            for c in b.into_snapshots() {
                self.release_key(c.key);
            }
        }
    }

    pub(crate) fn quota_clear(&mut self, tenant: u32) {
        if let Some(mut q) = self.quotas.remove(&tenant) {
            let mut keys: Vec<KeyId> = q.heap.drain().map(|c| c.key).collect();
            keys.extend(q.threshold.take().map(|c| c.key));
            for k in keys {
                self.release_key(k);
            }
        }
    }

    /// Drops every tenant's quota heap in one move (the reclaim pass's release stage): their
    /// snapshots' blob references are given back later, in the cap build's slices
    /// ([`Index::quota_release_retired`]). O(1) here, whatever the number of heaps.
    pub(crate) fn quota_retire_all(&mut self) {
        if !self.quotas.is_empty() {
            let table = std::mem::take(&mut self.quotas);
            self.quota_retired.tables.push(table);
        }
        if let Some(b) = self.quota_next.take() {
            self.quota_retired.push(b.into_snapshots());
        }
    }

    /// Gives back the blob references of up to `max` retired quota snapshots (a heap at a time,
    /// from the end of its buffer; `max` also bounds the heaps taken off a retired table).
    /// Returns how many snapshots and heaps were handled.
    fn quota_release_retired(&mut self, max: usize) -> usize {
        let mut work = 0usize;
        while work < max {
            let r = &mut self.quota_retired;
            if !r.current.is_empty() {
                let n = r.current.len().min(max - work);
                let at = r.current.len() - n;
                for c in r.current.drain(at..) {
                    release_blob(&mut self.cat, c.key);
                }
                work += n;
                continue;
            }
            if let Some(v) = r.lists.pop() {
                r.current = v;
                work += 1;
                continue;
            }
            let Some(table) = r.tables.last_mut() else {
                break;
            };
            // One heap off the table: `extract_if` stops where the iterator is dropped.
            let next = table.extract_if(|_, _| true).next();
            work += 1;
            match next {
                Some((_, mut q)) => {
                    let mut v = std::mem::take(&mut q.heap.v);
                    v.extend(q.threshold.take());
                    r.current = v;
                }
                None => {
                    r.tables.pop();
                }
            }
        }
        work
    }

    /// Builds the tenant's quota heap now, on the path that needs a victim (counted in
    /// [`Index::take_quota_sync_builds`]): finishes the tenant's build in progress when it
    /// keeps enough candidates, else scans every key of the core once. Returns whether the
    /// build was a whole one (not the end of one in progress, whose candidates may all have
    /// gone stale since they were offered).
    fn quota_build(&mut self, tenant: u32, need: usize) -> bool {
        self.quota_sync_builds += 1;
        if self
            .quota_next
            .as_ref()
            .is_some_and(|b| b.tenant == tenant && b.k >= need)
        {
            let (_, done) = self.quota_build_run(SweepBudget::UNBOUNDED);
            debug_assert!(done);
            return false;
        }
        self.quota_clear(tenant);
        let local = self.cat.tenants[&tenant].prefixes as usize;
        let k = need.max(self.min_candidates).max(local / SCAN_AMORTISATION);
        let cat = &self.cat;
        let greater = |a: &QuotaCand, b: &QuotaCand| quota_cmp(cat, a, b) == Ordering::Greater;
        let mut sel: Heap<QuotaCand> = Heap::default();
        let mut seen = 0usize;
        for pos in self.store.places() {
            let key = self.store.key_at(pos);
            if cat.tenant_of(key) != tenant {
                continue;
            }
            let newest = (self.store.holders_uncounted(pos).map(|h| h.last_seen()))
                .max()
                .expect("holder");
            let c = QuotaCand { newest, key };
            seen += 1;
            if sel.len() < k {
                sel.push(c, &greater);
            } else if greater(sel.peek().expect("non-empty"), &c) {
                sel.pop(&greater);
                sel.push(c, &greater);
            }
        }
        let threshold = if seen > k { sel.peek().copied() } else { None };
        let less = |a: &QuotaCand, b: &QuotaCand| quota_cmp(cat, a, b) == Ordering::Less;
        let mut heap = Heap::default();
        let cands: Vec<QuotaCand> = sel.drain().collect();
        for c in &cands {
            heap.push(*c, &less);
        }
        // Every snapshot that names a blob-hash key (heap entries and the threshold) holds a
        // blob reference, so a freed key's blob id cannot be reused under it.
        for c in cands.iter().chain(threshold.iter()) {
            self.retain_key(c.key);
        }
        self.quotas.insert(
            tenant,
            QuotaState {
                heap,
                threshold,
                built: k,
            },
        );
        true
    }

    fn quota_pop(&mut self, tenant: u32, need: usize) -> Option<KeyId> {
        if !self.quotas.contains_key(&tenant) {
            self.quota_build(tenant, need);
        }
        let mut rebuilt = false;
        loop {
            let cat = &self.cat;
            let q = self.quotas.get_mut(&tenant).expect("quota state");
            let popped = q.heap.pop(&|a, b| quota_cmp(cat, a, b) == Ordering::Less);
            let Some(c) = popped else {
                if rebuilt || q.threshold.is_none() {
                    return None;
                }
                // A whole build holds `need` live candidates (or every key): one is enough.
                rebuilt = self.quota_build(tenant, need);
                continue;
            };
            let current = self.quota_cand(c.key);
            self.release_key(c.key);
            if current == Some(c) {
                return Some(c.key);
            }
        }
    }

    /// The tenant's distinct key count the quota compares against: the directory's global
    /// count (exact even for tenants in the directory's overflow map).
    fn global_tenant_keys(&self, tenant: u32) -> u64 {
        let rec = &self.cat.tenants[&tenant];
        self.directory().tenant_keys_exact(rec.fp)
    }

    /// How many quota victims of `tenant` this core's ingest of `new_entries` entries may take
    /// in the ingest itself (at most its key count after the ingest less `budget`, which a
    /// lowered quota makes more than the ingest's own keys):
    /// none with [`IndexConfig::cross_core_eviction`] (a cross-core selection asks each core
    /// for candidates after it, [`Index::quota_candidates`]) or for a tenant this core does not
    /// know (it has no keys to evict).
    ///
    /// [`IndexConfig::cross_core_eviction`]: super::IndexConfig::cross_core_eviction
    pub fn quota_victims_for_ingest(&self, tenant: &str, budget: u64, new_entries: usize) -> usize {
        if self.cfg.cross_core_eviction {
            return 0;
        }
        let Some(t) = self.cat.strings.get(tenant) else {
            return 0;
        };
        if !self.cat.tenants.contains_key(&t) {
            return 0;
        }
        let after = self
            .global_tenant_keys(t)
            .saturating_add(new_entries as u64);
        usize::try_from(after.saturating_sub(budget)).unwrap_or(usize::MAX)
    }

    /// Whether taking `need` quota victims (or candidates) of `tenant` on this core would build
    /// its candidate heap in one O(keys) scan because it is not ready: the tenant has keys here
    /// and no heap, or a heap with a threshold holding fewer than `need` snapshots.
    /// [`Index::quota_victims_step`] does that work in slices instead; each makes progress
    /// while this holds.
    pub fn quota_victims_pending(&self, tenant: &str, need: usize) -> bool {
        if need == 0 || self.clear_pending() {
            return false;
        }
        let Some(t) = self.cat.strings.get(tenant) else {
            return false;
        };
        if self.cat.tenants.get(&t).is_none_or(|r| r.prefixes == 0) {
            return false;
        }
        match self.quotas.get(&t) {
            None => true,
            Some(q) => q.threshold.is_some() && q.heap.len() < need,
        }
    }

    /// One slice of readying `need` quota victims of `tenant` (see
    /// [`Index::quota_victims_pending`]): a build of at least that many candidates, installed
    /// as the tenant's heap when complete. A build in progress for another tenant runs first
    /// (its ingest waits too), so two tenants' ingests cannot keep restarting each other's.
    /// Returns the work done. Changes nothing observable.
    pub fn quota_victims_step(&mut self, tenant: &str, need: usize, budget: SweepBudget) -> usize {
        if self.quota_next.is_none() {
            let Some(t) = self.cat.strings.get(tenant) else {
                return 0;
            };
            let Some(rec) = self.cat.tenants.get(&t) else {
                return 0;
            };
            let local = rec.prefixes as usize;
            let k = need.max(self.min_candidates).max(local / SCAN_AMORTISATION);
            // Room for the whole selection now (address space; pages are touched as used), so
            // no slice copies it to grow it.
            let room = k.min(local.saturating_add(self.min_candidates));
            self.quota_next = Some(QuotaBuild {
                tenant: t,
                sel: Heap {
                    v: Vec::with_capacity(room),
                },
                k,
                dropped: false,
                cursor: FIRST,
                threshold: None,
                heapify: 0,
                late: Vec::new(),
            });
        }
        self.quota_build_run(budget).0
    }

    /// Runs the quota build in progress within `budget` (keys visited plus reorder steps);
    /// installs it as its tenant's heap when complete (a heap it replaces is released in the
    /// cap build's slices). Returns the work done and whether it completed.
    fn quota_build_run(&mut self, budget: SweepBudget) -> (usize, bool) {
        let mut b = self.quota_next.take().expect("quota build in progress");
        let mut work = 0usize;
        let mut meter = budget.meter();
        if b.threshold.is_none() {
            loop {
                if meter.spent(work) {
                    self.quota_next = Some(b);
                    return (work, false);
                }
                let pos = match self.store.scan(b.cursor, PLACES_PER_STEP) {
                    Scan::End => break,
                    Scan::Paused(at) => {
                        b.cursor = at;
                        work += PLACES_PER_STEP;
                        continue;
                    }
                    Scan::Held(pos) => pos,
                };
                b.cursor = Store::after(pos);
                work += 1;
                let key = self.store.key_at(pos);
                if self.cat.tenant_of(key) != b.tenant {
                    continue;
                }
                let (mut newest, mut holders) = (i64::MIN, 0);
                for h in self.store.holders_uncounted(pos) {
                    newest = newest.max(h.last_seen());
                    holders += 1;
                }
                meter.charge_entries(holders);
                b.offer(&mut self.cat, QuotaCand { newest, key });
            }
            b.threshold = Some(scan_threshold(&mut self.cat, &b.sel, b.dropped));
            b.heapify = b.sel.len() / 2;
        }
        {
            let cat = &self.cat;
            let less = |a: &QuotaCand, b: &QuotaCand| quota_cmp(cat, a, b) == Ordering::Less;
            while b.heapify > 0 || !b.late.is_empty() {
                if meter.spent_each(work) {
                    self.quota_next = Some(b);
                    return (work, false);
                }
                if b.heapify > 0 {
                    b.heapify -= 1;
                    b.sel.sift_down(b.heapify, &less);
                } else {
                    let c = b.late.pop().expect("non-empty");
                    b.sel.push(c, &less);
                }
                work += 1;
            }
        }
        if let Some(mut old) = self.quotas.remove(&b.tenant) {
            let mut v = std::mem::take(&mut old.heap.v);
            v.extend(old.threshold.take());
            self.quota_retired.push(v);
        }
        self.quotas.insert(
            b.tenant,
            QuotaState {
                heap: std::mem::take(&mut b.sel),
                threshold: b.threshold.flatten(),
                built: b.k,
            },
        );
        (work, true)
    }

    /// Quota candidate builds run (or finished) in one go on the path that needed a victim
    /// since the last call: each an O(keys) step on one ingest or candidate request.
    pub fn take_quota_sync_builds(&mut self) -> u64 {
        std::mem::take(&mut self.quota_sync_builds)
    }

    /// Tenant quota (§7.1): while the tenant's key count exceeds `budget`, evict its oldest keys
    /// (newest holder time, then model, scheme, adapter, hash) from this core. Returns the
    /// number of keys evicted; each removed entry is reported to the removal sink (at `now`).
    pub(crate) fn enforce_quota(&mut self, tenant: u32, budget: u64, now: i64) -> u64 {
        self.flush();
        let mut total = 0u64;
        loop {
            let global = self.global_tenant_keys(tenant);
            if global <= budget || self.cat.tenants[&tenant].prefixes == 0 {
                break;
            }
            let over = global - budget;
            let mut evicted = 0u64;
            while evicted < over {
                let Some(key) = self.quota_pop(tenant, over as usize) else {
                    break;
                };
                self.remove_key(key, now);
                evicted += 1;
            }
            self.flush();
            total += evicted;
            if evicted == 0 {
                break;
            }
        }
        total
    }

    // ---- TTL sweep (§6) ---------------------------------------------------------------------

    /// The periodic TTL sweep (§6) in one call: [`Index::sweep_begin`] and unbounded
    /// [`Index::sweep_step`]s. Removes every entry with `now − last_seen ≥ ttl(tenant)`
    /// (reserved tenants included) and every stats row with `now − last_seen ≥ ttl(tenant)`,
    /// then runs the reclaim pass when something may have become unreferenced.
    /// O(entries); never enforces the cap.
    pub fn sweep(&mut self, now: i64, rules: &dyn TenantRules) -> SweepOutcome {
        self.sweep_begin(now);
        loop {
            if let Some(out) = self.sweep_step(rules, SweepBudget::UNBOUNDED).finished {
                return out;
            }
        }
    }

    /// Starts a sliced TTL sweep pass at `now` (one `now` for the whole pass); an unfinished
    /// pass is abandoned. Drive it with [`Index::sweep_step`] until it reports `finished`.
    pub fn sweep_begin(&mut self, now: i64) {
        self.store.set_sweep_cursor(FIRST);
        self.sweep_pass = Some(SweepPass {
            now,
            stats_from: None,
            out: SweepOutcome::default(),
            reclaiming: false,
        });
    }

    /// Whether a sweep pass was begun and has not finished.
    pub fn sweep_in_progress(&self) -> bool {
        self.sweep_pass.is_some()
    }

    /// One slice of the sweep pass in progress: visits keys from where the last slice stopped
    /// (in place order, so the removals and their removal-hook reports come in the same order as
    /// the one-call [`Index::sweep`] when nothing changes in between), then the stats rows
    /// model by model, then runs the reclaim pass. Stops once `budget.max_entries` storage
    /// entries plus stats rows were examined (a key's holders and a model's rows are never
    /// split, so a slice examines fewer than `max_entries` plus one key's holders or one model's
    /// rows) or once `budget.deadline` has passed (checked every few keys, after the first). Each tenant's TTL and algorithm are resolved from `rules`
    /// once per slice.
    ///
    /// Between two slices anything may change (ingest, events, evictions): a held key never
    /// moves (see `Store::scan`), so the pass visits every key present throughout exactly
    /// once and judges it at the pass's `now`. A key added (or refreshed) after its position was visited is left for
    /// the next pass, as if the sweep had run before that change.
    pub fn sweep_step(&mut self, rules: &dyn TenantRules, budget: SweepBudget) -> SweepStep {
        self.finish_clear();
        let Some(mut pass) = self.sweep_pass.take() else {
            return SweepStep::default();
        };
        let now = pass.now;
        let mut step = SweepStep::default();
        let mut policy: hashbrown::HashMap<u32, (i64, Eviction)> = hashbrown::HashMap::new();
        let mut resolve = |ix: &Index, t: u32| -> (i64, Eviction) {
            *policy.entry(t).or_insert_with(|| {
                let name = ix.cat.strings.name(t);
                (ix.ttl_for(rules, name), rules.eviction(name))
            })
        };
        let mut meter = budget.meter();
        if pass.reclaiming {
            return self.sweep_reclaim(pass, step, &mut meter);
        }
        if pass.stats_from.is_none() {
            let mut stale: Vec<u32> = Vec::new();
            let mut places = 0usize;
            loop {
                if meter.spent(step.entries + places) {
                    step.cut_short = true;
                    break;
                }
                let pos = match self.store.scan(self.store.sweep_cursor(), PLACES_PER_STEP) {
                    Scan::End => break,
                    Scan::Paused(at) => {
                        // Passed too: a slice cut in a stretch of empty places resumes after it.
                        places += PLACES_PER_STEP;
                        self.store.set_sweep_cursor(at);
                        continue;
                    }
                    Scan::Held(pos) => pos,
                };
                let key = self.store.key_at(pos);
                step.keys += 1;
                let (ttl, algo) = resolve(self, self.cat.tenant_of(key));
                stale.clear();
                let entries_before = step.entries;
                for h in self.store.holders_uncounted(pos) {
                    step.entries += 1;
                    if ttl > 0 && now.saturating_sub(h.last_seen()) >= ttl {
                        stale.push(h.replica());
                    }
                }
                meter.charge_entries(step.entries - entries_before);
                meter.charge_removals(stale.len());
                for r in &stale {
                    self.report_removal(key, *r, RemovalReason::Ttl, algo, now);
                    self.remove_entry(key, *r, now);
                    pass.out.ttl_evicted.add(algo);
                }
                self.store.set_sweep_cursor(Store::after(pos));
            }
            if !step.cut_short {
                self.store.set_sweep_cursor(FIRST);
                pass.stats_from = Some(0);
            }
        }
        if let Some(mut m) = pass.stats_from.filter(|_| !step.cut_short) {
            while (m as usize) < self.cat.models.len() {
                // Every record counts towards the clock, rowless ones too (a core may hold a
                // million model scopes without stats).
                if meter.spent(step.entries) {
                    step.cut_short = true;
                    break;
                }
                let rows = self.cat.models[m as usize].stats.len();
                if rows == 0 {
                    m += 1;
                    continue; // freed records included
                }
                step.entries += rows;
                let (ttl, _) = resolve(self, self.cat.models[m as usize].tenant);
                let stats = &mut self.cat.models[m as usize].stats;
                stats.retain(|_, row| now.saturating_sub(row.last_seen) < ttl);
                let removed = rows - stats.len();
                pass.out.stats_rows_removed += removed as u64;
                self.stats_rows -= removed;
                self.reclaimable += removed as u64;
                m += 1;
            }
            pass.stats_from = Some(m);
        }
        self.flush();
        if step.cut_short {
            self.sweep_pass = Some(pass);
            return step;
        }
        if self.reclaimable > 0 || self.reclaim_pass.is_some() {
            pass.reclaiming = true;
            return self.sweep_reclaim(pass, step, &mut meter);
        }
        step.finished = Some(pass.out);
        step
    }

    /// The sweep pass's last stage: the reclaim pass, in the sweep's slices (the rest of this
    /// slice's budget first).
    fn sweep_reclaim(
        &mut self,
        mut pass: SweepPass,
        mut step: SweepStep,
        meter: &mut BudgetMeter,
    ) -> SweepStep {
        let mut work = step.entries;
        match self.reclaim_slice(meter, &mut work) {
            Some(freed) => {
                pass.out.strings_freed = freed;
                step.finished = Some(pass.out);
            }
            None => {
                step.cut_short = true;
                self.sweep_pass = Some(pass);
            }
        }
        step
    }
}

/// A TTL sweep pass in progress ([`Index::sweep_begin`]).
pub(crate) struct SweepPass {
    /// The pass's one `now`.
    now: i64,
    /// `None` while keys are visited; then the next model record whose stats rows are swept.
    stats_from: Option<u32>,
    /// What the pass did so far.
    out: SweepOutcome,
    /// Keys and stats rows are done; the reclaim pass runs.
    reclaiming: bool,
}

/// How much one [`Index::sweep_step`] may do.
#[derive(Clone, Copy, Debug)]
pub struct SweepBudget {
    /// Storage entries plus stats rows examined, after which the slice stops (a key's holders
    /// and a model's rows are never split, and a slice always makes progress).
    pub max_entries: usize,
    /// Stop once this instant has passed (checked every few keys).
    pub deadline: Option<std::time::Instant>,
}

/// Tells a slice when its [`SweepBudget`] is used up: its entries, or its time, read once per
/// [`BudgetMeter::CLOCK_EVERY`] checks (a removed entry counts as
/// [`BudgetMeter::CHECKS_PER_REMOVAL`] of them).
pub(crate) struct BudgetMeter {
    budget: SweepBudget,
    /// Checks since the clock was last read.
    owed: usize,
}

impl BudgetMeter {
    /// A clock read per this many checks (keys, models, reorder steps) is cheap next to the
    /// work between.
    const CLOCK_EVERY: usize = 64;
    /// A removal relinks the key table and updates the aggregates (several random accesses
    /// into a table of millions of keys): 64 keys' worth of them overran a 0.5 ms slice by
    /// 0.5 ms at 10M entries (perf/RESULTS.md), so the clock is read every 8 removals.
    const CHECKS_PER_REMOVAL: usize = Self::CLOCK_EVERY / 8;
    /// Entries (holders of one key) visited per check.
    const ENTRIES_PER_CHECK: usize = 16;

    /// [`BudgetMeter::spent`] for steps of microseconds each (sifts through a heap of up to
    /// `entries / 16` snapshots, a table probe): reads the clock at every check, so a slice
    /// overruns its deadline by at most one step, not [`BudgetMeter::CLOCK_EVERY`] of them.
    pub(crate) fn spent_each(&mut self, work: usize) -> bool {
        if work > 0 && work >= self.budget.max_entries {
            return true;
        }
        self.budget
            .deadline
            .is_some_and(|d| std::time::Instant::now() >= d)
    }

    /// Whether the slice, having done `work` entries, must stop.
    pub(crate) fn spent(&mut self, work: usize) -> bool {
        if work > 0 && work >= self.budget.max_entries {
            return true;
        }
        self.owed += 1;
        if self.owed < Self::CLOCK_EVERY {
            return false;
        }
        self.owed = 0;
        self.budget
            .deadline
            .is_some_and(|d| std::time::Instant::now() >= d)
    }

    /// Counts the `entries` of one key (its holders) towards the next clock read, one check
    /// per [`BudgetMeter::ENTRIES_PER_CHECK`]: a key of 1,024 holders offered to a cap build is
    /// ≈ 1 ms of heap work, so 64 of them between two clock reads overran a slice 60-fold.
    pub(crate) fn charge_entries(&mut self, entries: usize) {
        self.owed = self.owed.saturating_add(entries / Self::ENTRIES_PER_CHECK);
    }

    /// Counts `removed` entries towards the next clock read.
    pub(crate) fn charge_removals(&mut self, removed: usize) {
        self.owed = self
            .owed
            .saturating_add(removed.saturating_mul(Self::CHECKS_PER_REMOVAL));
    }
}

impl SweepBudget {
    /// The meter of one slice under this budget.
    pub(crate) fn meter(self) -> BudgetMeter {
        BudgetMeter {
            budget: self,
            owed: 0,
        }
    }

    /// No bound: the step finishes the pass.
    pub const UNBOUNDED: SweepBudget = SweepBudget {
        max_entries: usize::MAX,
        deadline: None,
    };
}

/// How much of the global cap's evictions one step runs when they are sliced
/// ([`Index::set_sliced_cap`]): an ingest's own share, and each later
/// [`Index::cap_enforce_step`] the server gives the same budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapSlice {
    /// Evictions at most.
    pub max_evictions: usize,
    /// Time at most, from the step's first eviction.
    pub time: std::time::Duration,
}

impl CapSlice {
    /// The budget of one step starting now.
    pub fn budget(self) -> SweepBudget {
        SweepBudget {
            max_entries: self.max_evictions,
            deadline: Some(std::time::Instant::now() + self.time),
        }
    }
}

/// What one [`Index::sweep_step`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepStep {
    /// Prefix keys visited.
    pub keys: usize,
    /// Storage entries plus stats rows examined.
    pub entries: usize,
    /// The budget ended the slice before the pass finished.
    pub cut_short: bool,
    /// The pass's outcome, when this step finished it.
    pub finished: Option<SweepOutcome>,
}

// ---- cross-core victim selection (several cores, docs/BEHAVIOUR.md §7.1, §7.2) ----------------

/// One storage entry's global-cap sort key (§7.2) with its names, comparable across cores: the
/// derived order (fields top to bottom, strings and hash bytes bytewise) is exactly the
/// reference's victim order.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CapVictim {
    /// `access_count` for an LFU tenant, else 0.
    pub eff: u32,
    /// The entry's `last_seen` (unix ns).
    pub last_seen: i64,
    /// Tenant id.
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// Hash scheme.
    pub scheme: String,
    /// Adapter id.
    pub adapter: String,
    /// Prefix hash bytes.
    pub hash: Vec<u8>,
    /// Holder replica.
    pub replica: String,
}

/// One prefix key's tenant-quota sort key (§7.1) within its tenant, comparable across cores.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QuotaVictim {
    /// The newest `last_seen` among the key's holders (unix ns).
    pub newest: i64,
    /// Model id.
    pub model: String,
    /// Hash scheme.
    pub scheme: String,
    /// Adapter id.
    pub adapter: String,
    /// Prefix hash bytes.
    pub hash: Vec<u8>,
}

/// Picks the `n` globally smallest victims from every core's own smallest candidates (each
/// core's list must hold its `n` smallest, in any order) and returns them per core, each core's
/// list in global order. Exact: the `n` smallest of the union are among the `n` smallest of each
/// part.
pub fn select_victims<V: Ord + Clone>(per_core: &[Vec<V>], n: usize) -> Vec<Vec<V>> {
    let mut all: Vec<(&V, usize)> = per_core
        .iter()
        .enumerate()
        .flat_map(|(c, v)| v.iter().map(move |x| (x, c)))
        .collect();
    all.sort();
    let mut out = vec![Vec::new(); per_core.len()];
    for (v, c) in all.into_iter().take(n) {
        out[c].push(v.clone());
    }
    out
}

impl Index {
    /// Resolves an existing key from its names (no interning).
    fn key_by_names(
        &self,
        tenant: &str,
        model: &str,
        scheme: &str,
        adapter: &str,
        hash: &[u8],
    ) -> Option<KeyId> {
        let scope = self.cat.find_scope(tenant, model, scheme)?;
        let ks = self.cat.find_keyspace(scope, adapter)?;
        let key = self.cat.key_for(ks, hash)?;
        self.store.find(key).map(|_| key)
    }

    fn key_names(&self, key: KeyId) -> (String, String, String, String, Vec<u8>) {
        let scope = self.cat.scope_of(key);
        let ks = &self.cat.keyspaces[key.keyspace() as usize];
        let mut buf = [0u8; 8];
        (
            self.cat.strings.name(scope.tenant).to_string(),
            self.cat.strings.name(scope.model).to_string(),
            self.cat.strings.name(scope.scheme).to_string(),
            self.cat.strings.name(ks.adapter).to_string(),
            self.cat.hash_bytes(key, &mut buf).to_vec(),
        )
    }

    /// This core's `k` smallest non-reserved storage entries in the global-cap order (§7.2),
    /// with the eviction algorithms resolved from `rules`. Changes nothing observable (the
    /// candidates stay in the core's candidate heap).
    pub fn cap_candidates(&mut self, k: usize, rules: &dyn TenantRules) -> Vec<CapVictim> {
        self.cap_candidates_within(k, rules, true)
            .expect("a build is allowed")
    }

    /// [`Index::cap_candidates`] without building candidates in one go: `None` (and nothing
    /// changed but stale snapshots dropped) when the live heap runs out of them, or is missing,
    /// before `k` were found. [`Index::cap_victims_pending`] then holds for `k`, and the caller
    /// readies them in slices ([`Index::cap_victims_step`]) before it asks again.
    pub fn cap_candidates_ready(
        &mut self,
        k: usize,
        rules: &dyn TenantRules,
    ) -> Option<Vec<CapVictim>> {
        self.cap_candidates_within(k, rules, false)
    }

    fn cap_candidates_within(
        &mut self,
        k: usize,
        rules: &dyn TenantRules,
        build: bool,
    ) -> Option<Vec<CapVictim>> {
        self.finish_clear();
        if k == 0 || self.non_reserved_entry_count() == 0 {
            return Some(Vec::new());
        }
        if !build && self.cap_victims_pending(k) {
            return None;
        }
        self.algorithms_current(rules);
        let mut popped = Vec::new();
        let mut seen: hashbrown::HashSet<(KeyId, u32)> = hashbrown::HashSet::new();
        while popped.len() < k {
            // A heap rebuilt in this loop holds the candidates popped before it (they are still
            // in the store), so it must hold `k`, not only the `k - popped` still wanted.
            let Some(c) = self.cap_pop(k, build) else {
                if !build && (self.cap.threshold.is_some() || !self.cap.active) {
                    // The heap ran out of live snapshots (it would rebuild in one go): put back
                    // what was popped instead.
                    for (key, replica) in popped {
                        self.cap_touch(key, replica, None);
                    }
                    return None;
                }
                break;
            };
            // An entry can pop twice: the heap may hold its current snapshot twice (a mutation
            // that left its key unchanged; a build's scan and its mutation hook), and a heap
            // rebuilt in this loop holds it again. It is one candidate.
            if seen.insert(c) {
                popped.push(c);
            }
        }
        let mut out = Vec::with_capacity(popped.len());
        for (key, replica) in popped {
            let pos = self.store.find(key).expect("candidate key");
            let h = (self.store.holder_of(pos, replica)).expect("candidate holder");
            let lfu = self.cat.tenants[&self.cat.tenant_of(key)].algo == Eviction::Lfu;
            let (eff, last_seen) = (if lfu { h.access } else { 0 }, h.last_seen());
            let (tenant, model, scheme, adapter, hash) = self.key_names(key);
            out.push(CapVictim {
                eff,
                last_seen,
                tenant,
                model,
                scheme,
                adapter,
                hash,
                replica: self.cat.strings.name(replica).to_string(),
            });
            // Back into the heap: it is still the current minimum.
            self.cap_touch(key, replica, Some(pos));
        }
        Some(out)
    }

    /// Removes the given cap victims held by this core, in order (entries that are gone are
    /// skipped). Returns the removals per algorithm.
    pub fn evict_cap_victims(&mut self, victims: &[CapVictim], now: i64) -> EvictionCounts {
        self.finish_clear();
        let mut out = EvictionCounts::default();
        for v in victims {
            let Some(key) = self.key_by_names(&v.tenant, &v.model, &v.scheme, &v.adapter, &v.hash)
            else {
                continue;
            };
            let Some(replica) = self.cat.strings.get(&v.replica) else {
                continue;
            };
            let algo = self.cat.tenants[&self.cat.tenant_of(key)].algo;
            let held = self
                .store
                .find(key)
                .is_some_and(|pos| self.store.holder_of(pos, replica).is_some());
            if !held {
                continue;
            }
            self.report_removal(key, replica, RemovalReason::Cap, algo, now);
            let removed = self.remove_entry(key, replica, now);
            debug_assert!(removed);
            out.add(algo);
        }
        self.flush();
        out
    }

    /// This core's `k` oldest prefix keys of `tenant` in the quota order (§7.1).
    pub fn quota_candidates(&mut self, tenant: &str, k: usize) -> Vec<QuotaVictim> {
        self.finish_clear();
        let Some(t) = self.cat.strings.get(tenant) else {
            return Vec::new();
        };
        if k == 0 || self.cat.tenants.get(&t).is_none_or(|r| r.prefixes == 0) {
            return Vec::new();
        }
        let mut popped = Vec::new();
        let mut seen: hashbrown::HashSet<KeyId> = hashbrown::HashSet::new();
        while popped.len() < k {
            // As in `cap_candidates`: a heap rebuilt in this loop holds the keys popped before
            // it, and a key can pop twice; it is one candidate.
            let Some(key) = self.quota_pop(t, k) else {
                break;
            };
            if seen.insert(key) {
                popped.push(key);
            }
        }
        let mut out = Vec::with_capacity(popped.len());
        for key in popped {
            let newest = self.quota_cand(key).expect("candidate key").newest;
            let (_, model, scheme, adapter, hash) = self.key_names(key);
            out.push(QuotaVictim {
                newest,
                model,
                scheme,
                adapter,
                hash,
            });
            self.quota_touch(key);
        }
        out
    }

    /// Removes the given prefix keys of `tenant` held by this core (every holder), in order.
    /// Returns the number of keys removed.
    pub fn evict_quota_victims(&mut self, tenant: &str, victims: &[QuotaVictim], now: i64) -> u64 {
        self.finish_clear();
        let mut n = 0;
        for v in victims {
            if let Some(key) = self.key_by_names(tenant, &v.model, &v.scheme, &v.adapter, &v.hash) {
                self.remove_key(key, now);
                n += 1;
            }
        }
        self.flush();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(eff: u32, last_seen: i64, replica: &str) -> CapVictim {
        CapVictim {
            eff,
            last_seen,
            tenant: "t".into(),
            model: "m".into(),
            scheme: "s".into(),
            adapter: String::new(),
            hash: vec![1],
            replica: replica.into(),
        }
    }

    /// The global first `n` come from any core, each core's share keeps the global order, and
    /// ties are broken by names exactly as §7.2 says (LFU count, age, then the key, then the
    /// replica).
    #[test]
    fn select_victims_takes_the_global_first_per_core() {
        let core0 = vec![v(0, 5, "a"), v(0, 9, "a"), v(1, 1, "a")];
        let core1 = vec![v(0, 5, "b"), v(0, 2, "z"), v(2, 0, "b")];
        let picks = select_victims(&[core0, core1], 3);
        assert_eq!(picks[0], vec![v(0, 5, "a")]);
        assert_eq!(picks[1], vec![v(0, 2, "z"), v(0, 5, "b")]);
        assert_eq!(
            select_victims::<CapVictim>(&[vec![], vec![]], 2),
            vec![vec![], vec![]]
        );
        // Hash bytes compare bytewise, shorter prefix first.
        let mut long = v(0, 0, "r");
        long.hash = vec![1, 0];
        let q = select_victims(&[vec![long.clone()], vec![v(0, 0, "r")]], 1);
        assert_eq!(q, vec![vec![], vec![v(0, 0, "r")]]);
    }
}
