//! The run-record store (issue 31): the prefix map as *runs* of chain blocks with their holders
//! as *extents*, the layout that perf/runs/2026-12-07-run-census.md priced on the Mooncake trace
//! (a long match crosses 2–3 runs instead of ~30 pieces; ~45% less memory than per-key
//! records). [`Index`](crate::index::Index) keeps its prefix map here (`index::store` maps its
//! key ids and holders onto it); the peer benchmark also drives it alone, and its tests hold it
//! to a model of per-entry records.
//!
//! * A *run* is a vector of 8-byte key hashes of one keyspace. A new key is appended to the
//!   run of the key it follows (the caller's `after`, its chain's previous block) when that key
//!   is its run's last; it goes back into its old place when that place is a hole right after
//!   `after`; else it goes at the end of its keyspace's *open* run, a short run shared by such
//!   keys (a prefix-only report's, a branch's first block), or starts a run (then the open one).
//! * An *extent* is one replica's stretch of a run, `lo..hi`, with one tier and one
//!   `last_seen`: an upsert grows the extent that ends right before it, a refresh with other
//!   values splits its extent, a release shrinks or splits it. An extent's stored token counts
//!   are a start and a step (one event's cumulative counts over blocks of one size): a count
//!   off that step starts another extent.
//! * The table maps each held key to its (run, offset): 8-byte buckets (a 15-bit tag and its
//!   mark, a 28-bit run and a 20-bit offset), probed linearly, at most 3/4 full, in
//!   [`SEGMENTS`] tables that grow apart; a tag match is confirmed against the run. A key's
//!   home bucket is its tag's top bits, so a segment grows without reading keys back.
//! * A key no extent covers any more leaves the table. At its run's end it is cut off (with any
//!   uncovered blocks before it); elsewhere it stays as a *hole*, which bounds every walk
//!   along the run ([`RunStore::along`]): the key may come back elsewhere.

use crate::keyhash::KeyHasher;
use crate::prefetch::prefetch;
use crate::segmap::SegMap;

/// Bits of a table bucket naming a key's run, and its offset in the run.
const RUN_BITS: u32 = 28;
const OFF_BITS: u32 = 20;
/// Run ids stay below this. Never reached: every run in use holds a key in the table (a run's
/// last block is held, or it is cut off), so there are never more runs than
/// [`MAX_KEYS`] (asserted below).
pub const MAX_RUNS: u32 = 1 << RUN_BITS;
/// The most blocks a table bucket's offset can name.
pub const MAX_RUN_LEN: u32 = 1 << OFF_BITS;
/// The most blocks one run holds; a chain past it continues in a new run. It bounds what a
/// release that drops an extent's tail ([`MAX_REPLICA_EXTENTS`]) takes out in one step.
pub const RUN_LEN_LIMIT: u32 = 4096;
const _: () = assert!(RUN_LEN_LIMIT <= MAX_RUN_LEN);
/// The most extents one replica has in one run. A run's extents are one sorted vector, so
/// inserting or removing one moves those after it, and a release or a holder count reads
/// them: with at most [`MAX_REPLICA_EXTENTS`] per replica and at most the key's holders
/// (1,024 by default) replicas, a run has at most 32,768 extents (1 MiB) and no step on it
/// costs more than moving those. Without it a producer cutting a long chain's blocks out one
/// in two fragments its extents into one per block, and each further cut moves all of them.
/// A replica's stretch splits only where its tier or time changes, or where it lost a block
/// (counts off the step do not split it: [`RunStore::odd_tokens`]).
/// At the bound: an upsert that needs a new extent of the replica is refused
/// ([`Refused::ExtentsFull`]); a new key goes to another run; a release in the middle of
/// an extent takes the extent's tail out with it ([`RunStore::take_dropped`]): in a chain
/// run, the blocks after a block the replica lost are no prefix it holds.
pub const MAX_REPLICA_EXTENTS: usize = 32;

/// Why [`RunStore::upsert`] refused an entry. Nothing changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A new key's table segment holds its most keys ([`MAX_KEYS`] spread evenly, ~100M
    /// keys, past the memory of any core). Counted ([`RunStore::refusals`]).
    TableFull,
    /// The key has the caller's most holders already.
    HoldersFull,
    /// The replica has [`MAX_REPLICA_EXTENTS`] extents in the key's run and the upsert needs
    /// another.
    ExtentsFull,
}

/// Where a held key lies. Places are ordered by run, then offset: the order of
/// [`RunStore::scan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Loc {
    pub run: u32,
    pub off: u32,
}

/// One (key, replica) entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub replica: u32,
    pub tier: u8,
    pub last_seen: i64,
    /// Stored token count (cumulative for chain blocks).
    pub tokens: i32,
}

/// One replica's entries at offsets `lo..hi` of a run, all with this tier and `last_seen`, and
/// stored token counts that step by `tokens_step` from `tokens_at_lo` (one store event's
/// cumulative counts over blocks of one size). An entry whose count is off that step keeps it
/// in the store's side table ([`RunStore::odd_tokens`]) and the extent is marked `odd`: blocks
/// of irregular sizes do not split a replica's stretch into one extent per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub replica: u32,
    pub lo: u32,
    pub hi: u32,
    pub tier: u8,
    /// Some entry of the extent may have an LFU count in the store's side table (set by
    /// [`RunStore::set_access`]; kept by both parts of a split): a release looks there only
    /// then, so a store without LFU tenants never does.
    counted: bool,
    /// Some entry of the extent may have a count off the step in the store's side table
    /// ([`RunStore::odd_tokens`]; kept by both parts of a split).
    odd: bool,
    pub last_seen: i64,
    tokens_at_lo: i32,
    tokens_step: i32,
}

const _: () = assert!(std::mem::size_of::<Extent>() == 32, "an extent is 32 bytes");

impl Extent {
    fn covers(&self, off: u32) -> bool {
        self.lo <= off && off < self.hi
    }
    /// The token count the step gives at offset `off` (wrapping, as the counts' sums do): the
    /// stored one unless the entry's is odd ([`RunStore::tokens_of`]).
    fn tokens_at(&self, off: u32) -> i32 {
        let steps = off.wrapping_sub(self.lo) as i32;
        self.tokens_at_lo
            .wrapping_add(steps.wrapping_mul(self.tokens_step))
    }
    /// This extent from offset `lo` on (its counts rebased).
    fn from(&self, lo: u32) -> Extent {
        Extent {
            lo,
            tokens_at_lo: self.tokens_at(lo),
            ..*self
        }
    }
    /// Whether entry `e` at offset `self.hi` continues the extent: same replica, tier and
    /// time (a count off the step is kept aside, [`RunStore::grow`]).
    fn continued_by(&self, e: &Entry, off: u32) -> bool {
        self.replica == e.replica
            && self.hi == off
            && self.tier == e.tier
            && self.last_seen == e.last_seen
    }
}

/// A run: its keyspace, its keys' hashes, its extents and holes. One cache line: a store, a
/// release and a walk read its hashes' and extents' places and its keyspace together; the
/// holes, rare, are boxed apart.
#[derive(Default)]
#[repr(C, align(64))]
pub struct Run {
    hashes: Vec<u64>,
    extents: Vec<Extent>,
    ks: u32,
    /// Offsets no extent covers below the run's end, ascending (None: no hole).
    holes: Option<Box<Holes>>,
}

/// A run's holes, behind one pointer so that a run without any (almost all) stays one line.
#[derive(Default)]
struct Holes(Vec<u32>);

const _: () = assert!(
    std::mem::size_of::<Run>() == 64,
    "a run record is one cache line"
);

impl Run {
    /// The run's keyspace.
    pub fn keyspace(&self) -> u32 {
        self.ks
    }
    /// Every extent of the run, by replica, then by first offset (a replica's are disjoint).
    pub fn extents(&self) -> &[Extent] {
        &self.extents
    }
    /// The hash of the key at offset `off` (a hole's too).
    pub fn hash_at(&self, off: u32) -> u64 {
        self.hashes[off as usize]
    }
    fn covered(&self, off: u32) -> bool {
        self.extents.iter().any(|x| x.covers(off))
    }
    /// Whether at least `n` extents cover `off`: without counting while the run has fewer
    /// extents than that (every upsert of a new holder asks).
    #[inline]
    fn holders_at_least(&self, off: u32, n: usize) -> bool {
        self.extents.len() >= n && self.extents.iter().filter(|x| x.covers(off)).count() >= n
    }
    /// Where an extent of `replica` starting at `lo` goes: the extents are kept sorted by
    /// (replica, first offset), so finding a replica's extent is a binary search even in the
    /// run of a prefix that hundreds of replicas hold.
    fn slot(&self, replica: u32, lo: u32) -> usize {
        (self.extents).partition_point(|x| (x.replica, x.lo) < (replica, lo))
    }
    /// The extent of `replica` covering `off`: a replica's extents are disjoint, so it is the
    /// last one starting at or before `off`.
    fn extent_of(&self, replica: u32, off: u32) -> Option<usize> {
        let i = self.slot(replica, off.wrapping_add(1)).checked_sub(1)?;
        let x = &self.extents[i];
        (x.replica == replica && x.covers(off)).then_some(i)
    }
    /// Number of `replica`'s extents.
    fn replica_extents(&self, replica: u32) -> usize {
        self.slot(replica.wrapping_add(1), 0) - self.slot(replica, 0)
    }
    /// Whether entry `e` may be added at offset `off`: its replica has fewer than
    /// [`MAX_REPLICA_EXTENTS`] extents here, or `e` continues the one ending at `off`.
    fn has_room_for(&self, e: &Entry, off: u32) -> bool {
        self.extents.len() < MAX_REPLICA_EXTENTS
            || self.replica_extents(e.replica) < MAX_REPLICA_EXTENTS
            || (self.slot(e.replica, off).checked_sub(1))
                .is_some_and(|i| self.extents[i].continued_by(e, off))
    }
    /// Inserts `x` in its place; returns its index.
    fn insert_extent(&mut self, x: Extent) -> usize {
        let i = self.slot(x.replica, x.lo);
        self.extents.insert(i, x);
        i
    }
    fn bytes(&self) -> usize {
        self.hashes.capacity() * 8
            + self.extents.capacity() * std::mem::size_of::<Extent>()
            + self.holes.as_ref().map_or(0, |h| 24 + h.0.capacity() * 4)
    }
    fn holes(&self) -> &[u32] {
        self.holes.as_deref().map_or(&[], |h| h.0.as_slice())
    }
    fn add_hole(&mut self, off: u32) {
        let holes = &mut self.holes.get_or_insert_with(Box::default).0;
        let i = holes
            .binary_search(&off)
            .expect_err("a held key is no hole");
        holes.insert(i, off);
    }
    fn remove_hole(&mut self, i: usize) {
        if let Some(holes) = &mut self.holes {
            holes.0.remove(i);
            if holes.0.is_empty() {
                self.holes = None;
            }
        }
    }
}

/// What [`RunStore::release_at`] took out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    pub entry: Entry,
    /// Its LFU count.
    pub access: u32,
    /// It was the key's last entry: the key is gone.
    pub key_gone: bool,
}

/// An entry a release took out with another ([`MAX_REPLICA_EXTENTS`]), for the caller to
/// count and report ([`RunStore::take_dropped`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dropped {
    /// The key's keyspace word and hash.
    pub ks: u32,
    pub h: u64,
    pub released: Released,
}

/// Where [`RunStore::scan`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scan {
    /// At this held key.
    Held(Loc),
    /// Out of steps before a held key: resume from here.
    Paused(Loc),
    /// No held key is left.
    End,
}

/// What [`RunStore::upsert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upserted {
    /// The key was created, with this entry its only holder.
    CreatedKey,
    /// The replica did not hold the key; now it does.
    AddedEntry,
    /// The replica's entry was overwritten.
    Refreshed,
}

/// The extent the last upsert of a chain wrote (its run and index): the next block's upsert
/// tries it first, so a chain stored or refreshed block by block grows one extent per run
/// without searching the run's extents.
#[derive(Clone, Copy, Debug, Default)]
pub struct Hint(Option<(u32, u32)>);

/// The run-record store (see the module docs).
pub struct RunStore {
    table: LocTable,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    keys: usize,
    entries: usize,
    /// LFU counts, (place, replica) → count, of the entries that have one (only LFU tenants'
    /// entries are ever counted); an entry's extent is marked ([`Extent::counted`]) so that a
    /// release of an uncounted entry does not look here. At most one per entry.
    access: SegMap<u32>,
    /// New keys refused because their table segment was full ([`TableFull`]).
    refusals: u64,
    /// Entries releases took out with the ones asked for, not yet taken by the caller: at
    /// most an extent's tail ([`RUN_LEN_LIMIT`]) per release.
    dropped: Vec<Dropped>,
    /// Token counts off their extent's step, (place, replica) → count; their extents are
    /// marked ([`Extent::odd`]). At most one per entry. Empty while producers report blocks of
    /// one size (a chain's last, partial block is another size: counted here).
    odd_tokens: SegMap<i32>,
    /// Per keyspace (by its word modulo [`OPEN_SLOTS`]), the run a key that follows no run's
    /// last block is appended to ([`RunStore::create`]): the keys of a prefix-only report, or
    /// a chain's first blocks after a branch, share a run instead of each paying a run's record
    /// and buffers (~240 bytes for a one-key run against ~50 for a key in a shared one). A slot
    /// names a run of another keyspace, or a freed one, only until its next use: the run is
    /// checked before it is taken.
    open: [u32; OPEN_SLOTS],
}

/// Slots of [`RunStore::open`]: keyspaces interleaving their new chains keep their own open
/// runs up to this many.
const OPEN_SLOTS: usize = 64;
/// A shared run takes a new chain's first block while it is shorter than this and has fewer
/// extents than [`OPEN_RUN_EXTENTS`]. The first bounds the blocks a live key at the run's end
/// keeps from being cut off after the keys before it went (holes, 12 bytes each: at 128 the
/// trace's held blocks cost 6% more, at 16 nothing); the second bounds the extents a lookup
/// entering the run, or a pass visiting one of its keys, looks at (at 64 a cap build of
/// one-key chains ran 2.5× slower).
const OPEN_RUN_LEN: usize = 16;
const OPEN_RUN_EXTENTS: usize = 8;

impl Default for RunStore {
    fn default() -> Self {
        RunStore::new()
    }
}

impl RunStore {
    pub fn new() -> RunStore {
        RunStore {
            table: LocTable::new(),
            runs: Vec::new(),
            free_runs: Vec::new(),
            keys: 0,
            entries: 0,
            access: SegMap::default(),
            refusals: 0,
            dropped: Vec::new(),
            odd_tokens: SegMap::default(),
            open: [u32::MAX; OPEN_SLOTS],
        }
    }

    /// A store whose table segments hold at most `n` keys each (at most [`MAX_SEGMENT_KEYS`]),
    /// for tests of the full table.
    #[doc(hidden)]
    pub fn with_segment_keys(n: usize) -> RunStore {
        let mut store = RunStore::new();
        store.table.max_segment_keys = n.min(MAX_SEGMENT_KEYS);
        store
    }

    /// New keys refused so far because their table segment was full ([`TableFull`]).
    pub fn refusals(&self) -> u64 {
        self.refusals
    }

    /// Whether releases took out entries the caller has not taken yet.
    #[inline(always)]
    pub fn has_dropped(&self) -> bool {
        !self.dropped.is_empty()
    }

    /// The entries releases took out besides the ones asked for (an extent's tail cut off at
    /// [`MAX_REPLICA_EXTENTS`]), oldest first; the caller counts each as removed.
    pub fn take_dropped(&mut self) -> std::vec::Drain<'_, Dropped> {
        self.dropped.drain(..)
    }

    /// The key at `loc` (a held key's place, or a hole's): its keyspace word and hash.
    pub fn key_at(&self, loc: Loc) -> (u32, u64) {
        let run = &self.runs[loc.run as usize];
        (run.ks, run.hashes[loc.off as usize])
    }

    /// The next held key at or after `from`, in (run, offset) order: the cursor of a pass
    /// over every key in slices. A held key keeps its place while it is held, so a pass
    /// resumed at the place after the last key it visited sees every key held throughout
    /// once (keys stored meanwhile behind the cursor are missed, as in any sliced pass). At
    /// most `max_steps` places (offsets, holes and free runs) are looked at: a pass over a
    /// store emptied of millions of runs still moves in bounded slices.
    pub fn scan(&self, from: Loc, max_steps: usize) -> Scan {
        let mut at = from;
        for _ in 0..max_steps {
            let Some(run) = self.runs.get(at.run as usize) else {
                return Scan::End;
            };
            if (at.off as usize) < run.hashes.len() {
                if run.holes().binary_search(&at.off).is_err() {
                    return Scan::Held(at);
                }
                at.off += 1;
            } else {
                at = Loc {
                    run: at.run + 1,
                    off: 0,
                };
            }
        }
        Scan::Paused(at)
    }

    /// The place right after `loc` in the order of [`RunStore::scan`].
    pub fn after(loc: Loc) -> Loc {
        Loc {
            run: loc.run,
            off: loc.off + 1,
        }
    }

    fn access_key(loc: Loc) -> u64 {
        u64::from(loc.run) << 32 | u64::from(loc.off)
    }

    /// The LFU count of `replica`'s entry at `loc` (0 when it has none, or no entry).
    pub fn access(&self, loc: Loc, replica: u32) -> u32 {
        let run = &self.runs[loc.run as usize];
        match run.extent_of(replica, loc.off) {
            Some(i) if run.extents[i].counted => {
                let key = (Self::access_key(loc), replica);
                self.access.get(&key).copied().unwrap_or(0)
            }
            _ => 0,
        }
    }

    /// Sets the LFU count of `replica`'s entry at `loc`; false (and nothing changed) when the
    /// replica holds no entry there. A count survives refreshes and goes with its entry.
    pub fn set_access(&mut self, loc: Loc, replica: u32, count: u32) -> bool {
        let run = &mut self.runs[loc.run as usize];
        let Some(i) = run.extent_of(replica, loc.off) else {
            return false;
        };
        let key = (Self::access_key(loc), replica);
        if count == 0 {
            if run.extents[i].counted {
                self.access.remove(&key);
            }
        } else {
            run.extents[i].counted = true;
            self.access.insert(key, count);
        }
        true
    }

    /// Entries with an LFU count.
    pub fn counted_entries(&self) -> usize {
        self.access.len()
    }

    /// Number of held keys.
    pub fn key_count(&self) -> usize {
        self.keys
    }

    /// Number of (key, replica) entries.
    pub fn entry_count(&self) -> usize {
        self.entries
    }

    /// Heap bytes of the runs, the table and the LFU counts.
    pub fn heap_bytes(&self) -> usize {
        self.table.bytes()
            + self.access.heap_bytes()
            + self.odd_tokens.heap_bytes()
            + self.dropped.capacity() * std::mem::size_of::<Dropped>()
            + self.runs.iter().map(Run::bytes).sum::<usize>()
            + self.runs.capacity() * std::mem::size_of::<Run>()
    }

    /// The run `id` (a [`Loc::run`] the store gave; ids below [`RunStore::run_slots`] name
    /// runs, empty ones among them).
    pub fn run(&self, id: u32) -> &Run {
        &self.runs[id as usize]
    }

    /// Test aid: panics unless every invariant of the store holds. Each run in use ends in a
    /// held key; its extents are sorted by (replica, first offset), a replica's disjoint, all
    /// inside the run; its holes are ascending, below its end and covered by no extent; every
    /// other offset is covered and the table finds its key there; the counts agree; every LFU
    /// count belongs to an entry of a counted extent. O(entries).
    #[doc(hidden)]
    pub fn check(&self) {
        let (mut keys, mut entries) = (0, 0);
        let free: std::collections::HashSet<u32> = self.free_runs.iter().copied().collect();
        for (id, run) in self.runs.iter().enumerate() {
            if free.contains(&(id as u32)) {
                assert!(
                    run.hashes.is_empty() && run.extents.is_empty(),
                    "free run {id}"
                );
                continue;
            }
            let len = run.hashes.len() as u32;
            assert!(len > 0, "run {id} in use is empty");
            for pair in run.extents.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                assert!((a.replica, a.lo) < (b.replica, b.lo), "run {id}: {pair:?}");
                assert!(a.replica != b.replica || a.hi <= b.lo, "run {id}: {pair:?}");
            }
            for x in &run.extents {
                assert!(x.lo < x.hi && x.hi <= len, "run {id}: {x:?}");
                entries += (x.hi - x.lo) as usize;
            }
            let holes = run.holes();
            assert!(
                holes.windows(2).all(|w| w[0] < w[1]),
                "run {id}: holes {holes:?}"
            );
            assert!(
                holes.last().is_none_or(|&h| h + 1 < len),
                "run {id} ends in a hole"
            );
            for off in 0..len {
                let hole = holes.binary_search(&off).is_ok();
                assert_eq!(run.covered(off), !hole, "run {id} offset {off}");
                if !hole {
                    keys += 1;
                    let loc = Loc {
                        run: id as u32,
                        off,
                    };
                    assert_eq!(self.find(run.ks, run.hashes[off as usize]), Some(loc));
                }
            }
        }
        assert_eq!((keys, entries), (self.keys, self.entries), "counts");
        for &(at, replica) in self.access.keys() {
            let loc = Loc {
                run: (at >> 32) as u32,
                off: at as u32,
            };
            let run = &self.runs[loc.run as usize];
            let i = run.extent_of(replica, loc.off).expect("a count's entry");
            assert!(run.extents[i].counted, "a count in an uncounted extent");
        }
        for &(at, replica) in self.odd_tokens.keys() {
            let run = &self.runs[(at >> 32) as usize];
            let i = (run.extent_of(replica, at as u32)).expect("an odd count's entry");
            assert!(
                run.extents[i].odd,
                "an odd count in an extent not marked odd"
            );
        }
        for run in &self.runs {
            let mut per_replica = std::collections::HashMap::<u32, usize>::new();
            for x in &run.extents {
                *per_replica.entry(x.replica).or_default() += 1;
            }
            assert!(per_replica.values().all(|&n| n <= MAX_REPLICA_EXTENTS));
            assert!(run.hashes.len() <= RUN_LEN_LIMIT as usize);
        }
        assert!(self.dropped.is_empty(), "dropped entries not taken");
    }

    /// Runs holding keys.
    pub fn live_runs(&self) -> usize {
        self.runs.len() - self.free_runs.len()
    }

    /// Run ids in use or free: every run is `0..run_slots()`.
    pub fn run_slots(&self) -> u32 {
        self.runs.len() as u32
    }

    /// Where key `(ks, h)` lies, if held.
    #[inline]
    pub fn find(&self, ks: u32, h: u64) -> Option<Loc> {
        self.table.find(self.table.hash(ks, h), ks, h, &self.runs)
    }

    /// Starts loading the table bucket [`RunStore::find`] of `(ks, h)` reads first.
    #[inline]
    pub fn prefetch(&self, ks: u32, h: u64) {
        self.table.prefetch(ks, h);
    }

    /// The hashes of the run from `loc` on, up to its end or its first hole: the blocks a walk
    /// may consume along the run before it must look the next key up again.
    #[inline]
    pub fn along(&self, loc: Loc) -> &[u64] {
        let run = &self.runs[loc.run as usize];
        let holes = run.holes();
        let end = match holes.binary_search(&loc.off) {
            Ok(i) | Err(i) => holes.get(i).map_or(run.hashes.len(), |&h| h as usize),
        };
        &run.hashes[loc.off as usize..end]
    }

    /// The entries of the key at `loc`, by replica.
    pub fn entries_at(&self, loc: Loc) -> impl Iterator<Item = Entry> + '_ {
        let run = &self.runs[loc.run as usize];
        (run.extents.iter())
            .filter(move |x| x.covers(loc.off))
            .map(move |x| Entry {
                replica: x.replica,
                tier: x.tier,
                last_seen: x.last_seen,
                tokens: self.tokens_of(x, loc),
            })
    }

    /// The stored token count of extent `x`'s entry at `loc`.
    #[inline]
    fn tokens_of(&self, x: &Extent, loc: Loc) -> i32 {
        if x.odd {
            return self.odd_tokens_of(x, loc);
        }
        x.tokens_at(loc.off)
    }

    /// [`RunStore::tokens_of`] of an extent marked odd (apart: rare, and kept out of the
    /// callers' loops).
    #[inline(never)]
    fn odd_tokens_of(&self, x: &Extent, loc: Loc) -> i32 {
        let odd = self.odd_tokens.get(&(Self::access_key(loc), x.replica));
        odd.copied().unwrap_or_else(|| x.tokens_at(loc.off))
    }

    /// The LFU count of `replica`'s entry at `loc` in a counted extent (apart, as above).
    #[inline(never)]
    fn count_of(&self, loc: Loc, replica: u32) -> u32 {
        let count = self.access.get(&(Self::access_key(loc), replica));
        count.copied().unwrap_or(0)
    }

    /// Forgets the odd count of extent `x`'s entry at `loc`, if any.
    #[inline(always)]
    fn forget_odd(&mut self, x: &Extent, loc: Loc) {
        if x.odd {
            self.odd_tokens.remove(&(Self::access_key(loc), x.replica));
        }
    }

    /// Grows extent `at` of run `loc.run` by the entry `e` at `loc` (its end): a one-block
    /// extent takes its step from `e`; a count off the step is kept aside.
    #[inline(always)]
    fn grow(&mut self, loc: Loc, at: usize, e: &Entry) {
        let x = &mut self.runs[loc.run as usize].extents[at];
        debug_assert!(x.hi == loc.off && x.replica == e.replica);
        let odd = match x.hi - x.lo {
            0 => false,
            1 => {
                x.tokens_step = e.tokens.wrapping_sub(x.tokens_at_lo);
                false
            }
            _ => x.tokens_at(loc.off) != e.tokens,
        };
        x.hi += 1;
        if odd {
            x.odd = true;
            self.keep_odd(loc, e);
        }
    }

    /// Keeps `e`'s count at `loc` aside: it is off its extent's step.
    #[cold]
    fn keep_odd(&mut self, loc: Loc, e: &Entry) {
        (self.odd_tokens).insert((Self::access_key(loc), e.replica), e.tokens);
    }

    /// The entries of the key at `loc` of replicas `first_replica` and up, by replica, each
    /// with its LFU count: a pass that offers a key's many holders over several slices resumes
    /// by replica (the extents are sorted by replica, so the rest is found by a binary search
    /// whatever changed in between).
    pub fn counted_entries_from(
        &self,
        loc: Loc,
        first_replica: u32,
    ) -> impl Iterator<Item = (Entry, u32)> + '_ {
        let run = &self.runs[loc.run as usize];
        let from = run.slot(first_replica, 0);
        (run.extents[from..].iter())
            .filter(move |x| x.covers(loc.off))
            .map(move |x| {
                let e = Entry {
                    replica: x.replica,
                    tier: x.tier,
                    last_seen: x.last_seen,
                    tokens: self.tokens_of(x, loc),
                };
                let access = if x.counted {
                    self.count_of(loc, x.replica)
                } else {
                    0
                };
                (e, access)
            })
    }

    /// Upserts `e` for key `(ks, h)`, which follows the key at `after` in its chain (None: a
    /// chain's first block, or a key of no chain). `hint` carries the extent of the chain's
    /// previous upsert; start a chain with `Hint::default()`.
    #[inline]
    pub fn upsert(
        &mut self,
        ks: u32,
        h: u64,
        after: Option<Loc>,
        e: Entry,
        hint: &mut Hint,
    ) -> Result<(Loc, Upserted), Refused> {
        self.upsert_bounded(ks, h, after, e, usize::MAX, hint)
    }

    /// [`RunStore::upsert`] of a replica's entry, refused when the key has `max_holders`
    /// holders already and the replica is not one of them.
    #[inline]
    pub fn upsert_bounded(
        &mut self,
        ks: u32,
        h: u64,
        after: Option<Loc>,
        e: Entry,
        max_holders: usize,
        hint: &mut Hint,
    ) -> Result<(Loc, Upserted), Refused> {
        // A chain stored again: its next block is the key after its previous one, found
        // without hashing or probing the table.
        if let Some(loc) = after.and_then(|a| self.next_held(a, ks, h)) {
            return self.upsert_held(loc, e, max_holders, hint);
        }
        let hash = self.table.hash(ks, h);
        let Some(loc) = self.table.find(hash, ks, h, &self.runs) else {
            if !self.table.has_room(hash) {
                // Entries of removed keys still in the table take room: out with them first.
                self.table.finish_removals();
                if !self.table.has_room(hash) {
                    self.refusals += 1;
                    return Err(Refused::TableFull);
                }
            }
            let loc = self.create(hash, ks, h, after, &e);
            self.add(loc, e, false, hint)
                .expect("a new key's run has room for its replica");
            self.keys += 1;
            return Ok((loc, Upserted::CreatedKey));
        };
        self.upsert_held(loc, e, max_holders, hint)
    }

    /// The held key `(ks, h)` when it is the one right after `a` in `a`'s run.
    #[inline(always)]
    fn next_held(&self, a: Loc, ks: u32, h: u64) -> Option<Loc> {
        self.held_at(RunStore::after(a), ks, h)
    }

    /// `at` when the held key `(ks, h)` is there (any place may be asked: a place of no run,
    /// past a run's end or at a hole holds no key). No table probe: for callers that know
    /// where a key likely is.
    #[inline(always)]
    pub fn held_at(&self, at: Loc, ks: u32, h: u64) -> Option<Loc> {
        let run = self.runs.get(at.run as usize)?;
        let held = run.ks == ks
            && run.hashes.get(at.off as usize) == Some(&h)
            && (run.holes.is_none() || run.holes().binary_search(&at.off).is_err());
        held.then_some(at)
    }

    /// [`RunStore::upsert_bounded`] of the held key at `loc`.
    #[inline(always)]
    fn upsert_held(
        &mut self,
        loc: Loc,
        e: Entry,
        max_holders: usize,
        hint: &mut Hint,
    ) -> Result<(Loc, Upserted), Refused> {
        let run = &self.runs[loc.run as usize];
        // A chain stored again meets its replica's extent at the hinted one (the same
        // values) or the one after it (a refresh with new values): no search.
        let hinted = match hint.0 {
            Some((r, at)) if r == loc.run => (at as usize..at as usize + 2).find(|&i| {
                (run.extents.get(i)).is_some_and(|x| x.replica == e.replica && x.covers(loc.off))
            }),
            _ => None,
        };
        Ok(match hinted.or_else(|| run.extent_of(e.replica, loc.off)) {
            Some(i) => {
                // The same values again (a chain stored again at its time): nothing to write.
                let x = &run.extents[i];
                let same = x.tier == e.tier && x.last_seen == e.last_seen && !x.odd;
                if same && x.tokens_at(loc.off) == e.tokens {
                    *hint = Hint(Some((loc.run, i as u32)));
                } else {
                    self.refresh(loc, i, e, hint)?;
                }
                (loc, Upserted::Refreshed)
            }
            None => {
                if self.runs[loc.run as usize].holders_at_least(loc.off, max_holders) {
                    return Err(Refused::HoldersFull);
                }
                self.add(loc, e, false, hint)?;
                (loc, Upserted::AddedEntry)
            }
        })
    }

    /// Number of holders of the key at `loc`.
    pub fn holder_count(&self, loc: Loc) -> usize {
        let run = &self.runs[loc.run as usize];
        run.extents.iter().filter(|x| x.covers(loc.off)).count()
    }

    /// A place for new key `(ks, h)`, to be held by `e`: the hole right after `after` when it
    /// was this key's, else the end of `after`'s run when `after` is its last block, else the
    /// end of the keyspace's open run ([`RunStore::append_to_open`]), else a new run; never
    /// `after`'s run when `e` would need one more extent there than its replica may have.
    #[inline]
    fn create(&mut self, hash: u64, ks: u32, h: u64, after: Option<Loc>, e: &Entry) -> Loc {
        if let Some(a) = after
            && let Some(run) = self.runs.get_mut(a.run as usize)
            && run.ks == ks
            && (a.off as usize) < run.hashes.len()
            && run.has_room_for(e, a.off + 1)
        {
            let next = a.off + 1;
            let at = Loc {
                run: a.run,
                off: next,
            };
            if next as usize == run.hashes.len() && next < RUN_LEN_LIMIT {
                run.hashes.push(h);
                self.table.insert(hash, at);
                return at;
            }
            if run.holes.is_some()
                && run.hashes.get(next as usize) == Some(&h)
                && let Ok(i) = run.holes().binary_search(&next)
            {
                run.remove_hole(i);
                self.table.insert(hash, at);
                return at;
            }
        }
        if let Some(at) = self.append_to_open(hash, ks, h) {
            return at;
        }
        let id = match self.free_runs.pop() {
            Some(id) => id,
            None => {
                debug_assert!(
                    (self.runs.len() as u32) < MAX_RUNS,
                    "runs ≤ keys < MAX_RUNS"
                );
                self.runs.push(Run::default());
                self.runs.len() as u32 - 1
            }
        };
        let run = &mut self.runs[id as usize];
        debug_assert!(run.hashes.is_empty() && run.extents.is_empty());
        run.ks = ks;
        run.hashes.push(h);
        self.open[ks as usize % OPEN_SLOTS] = id;
        let at = Loc { run: id, off: 0 };
        self.table.insert(hash, at);
        at
    }

    /// Appends new key `(ks, h)` to its keyspace's open run when that run is still short and
    /// narrow ([`OPEN_RUN_LEN`], [`OPEN_RUN_EXTENTS`]). Any run of the keyspace may take it:
    /// what lies next to a key in a run is only where a walk looks first (it compares the
    /// hashes), and an extent only ever covers the offsets its replica holds.
    #[inline]
    fn append_to_open(&mut self, hash: u64, ks: u32, h: u64) -> Option<Loc> {
        let id = self.open[ks as usize % OPEN_SLOTS];
        let run = self.runs.get_mut(id as usize)?;
        let fits = run.ks == ks
            && !run.hashes.is_empty()
            && run.hashes.len() < OPEN_RUN_LEN
            && run.extents.len() < OPEN_RUN_EXTENTS;
        if !fits {
            return None;
        }
        let at = Loc {
            run: id,
            off: run.hashes.len() as u32,
        };
        run.hashes.push(h);
        self.table.insert(hash, at);
        Some(at)
    }

    /// Adds `e` at `loc` (the replica holds no entry there): grows the hinted extent, or
    /// another of the replica's that `e` continues ([`Extent::continued_by`]), else a new one,
    /// refused when the replica has [`MAX_REPLICA_EXTENTS`] in the run already.
    /// `counted`: the entry may have an LFU count (a refreshed entry keeps its count).
    #[inline(always)]
    fn add(&mut self, loc: Loc, e: Entry, counted: bool, hint: &mut Hint) -> Result<(), Refused> {
        let run = &mut self.runs[loc.run as usize];
        let grows = |x: &Extent| x.continued_by(&e, loc.off);
        let hinted = match hint.0 {
            Some((r, i)) if r == loc.run => run.extents.get(i as usize).filter(|x| grows(x)),
            _ => None,
        }
        .is_some();
        // Else the replica's extent ending right before `loc`: the last one starting before it.
        let before = || run.slot(e.replica, loc.off).checked_sub(1);
        let at = if hinted {
            hint.0.expect("hinted").1 as usize
        } else if let Some(i) = before().filter(|&i| grows(&run.extents[i])) {
            i
        } else {
            if run.extents.len() >= MAX_REPLICA_EXTENTS
                && run.replica_extents(e.replica) >= MAX_REPLICA_EXTENTS
            {
                return Err(Refused::ExtentsFull);
            }
            run.insert_extent(Extent {
                replica: e.replica,
                lo: loc.off,
                hi: loc.off,
                tier: e.tier,
                counted,
                odd: false,
                last_seen: e.last_seen,
                tokens_at_lo: e.tokens,
                tokens_step: 0,
            })
        };
        run.extents[at].counted |= counted;
        self.grow(loc, at, &e);
        *hint = Hint(Some((loc.run, at as u32)));
        self.entries += 1;
        Ok(())
    }

    /// Overwrites the tier, `last_seen` and token count of the entry at `loc` in extent `i`:
    /// nothing when they are unchanged; else the entry leaves its extent (which splits around
    /// it) and joins the hinted extent when `e` continues that one. Refused (nothing changed)
    /// when the split could leave the replica more than [`MAX_REPLICA_EXTENTS`] in the run.
    fn refresh(&mut self, loc: Loc, i: usize, e: Entry, hint: &mut Hint) -> Result<(), Refused> {
        let x = self.runs[loc.run as usize].extents[i];
        if x.tier == e.tier && x.last_seen == e.last_seen {
            // The same stretch: at most the count changes, kept aside when off the step.
            if self.tokens_of(&x, loc) != e.tokens {
                self.forget_odd(&x, loc);
                if x.tokens_at(loc.off) != e.tokens {
                    self.runs[loc.run as usize].extents[i].odd = true;
                    self.keep_odd(loc, &e);
                }
            }
            *hint = Hint(Some((loc.run, i as u32)));
            return Ok(());
        }
        // The entry leaves its extent (its odd count, if any, goes with it).
        let run = &mut self.runs[loc.run as usize];
        // A chain refreshed block by block with new values: the entry moves from the front of
        // its old extent to the end of the hinted one (the chain's previous block, with the
        // new values), both the replica's and adjacent, so their order stays as it is.
        if loc.off == x.lo
            && let Some((r, at)) = hint.0
            && r == loc.run
            && let Some(prev) = run.extents.get(at as usize)
            && prev.continued_by(&e, loc.off)
        {
            run.extents[at as usize].counted |= x.counted;
            if x.hi - x.lo == 1 {
                // After the hinted extent in the order: its index does not move.
                run.extents.remove(i);
            } else {
                run.extents[i] = x.from(loc.off + 1);
            }
            self.forget_odd(&x, loc);
            self.grow(loc, at as usize, &e);
            return Ok(());
        }
        // The extent keeps its part before `loc`; the part after goes to a new extent, and the
        // entry to the extent `add` finds or a new one: at most two more.
        let grown = usize::from(loc.off > x.lo) + usize::from(loc.off + 1 < x.hi);
        if run.extents.len() + grown > MAX_REPLICA_EXTENTS
            && run.replica_extents(e.replica) + grown > MAX_REPLICA_EXTENTS
        {
            return Err(Refused::ExtentsFull);
        }
        let after = x.from(loc.off + 1);
        // Indices shift below: a stale hint fails `add`'s check and is searched for again.
        if loc.off == x.lo {
            run.extents.remove(i);
        } else {
            run.extents[i].hi = loc.off;
        }
        if after.lo < after.hi {
            run.insert_extent(after);
        }
        self.forget_odd(&x, loc);
        self.entries -= 1;
        self.add(loc, e, x.counted, hint)
            .expect("room checked before the split");
        Ok(())
    }

    /// Takes `replica`'s entry of key `(ks, h)` out. Returns it, or None when the replica held
    /// no entry there. A key left without holders leaves the table (its block is cut off at the
    /// run's end, or stays as a hole).
    #[inline]
    pub fn release(&mut self, ks: u32, h: u64, replica: u32) -> Option<Entry> {
        let hash = self.table.hash(ks, h);
        let loc = self.table.find(hash, ks, h, &self.runs)?;
        self.release_found(hash, loc, replica).map(|r| r.entry)
    }

    /// [`RunStore::release`] of the key at `loc` (a held key's place, as [`RunStore::find`]
    /// or [`RunStore::scan`] gave it).
    pub fn release_at(&mut self, loc: Loc, replica: u32) -> Option<Released> {
        let (ks, h) = self.key_at(loc);
        self.release_found(self.table.hash(ks, h), loc, replica)
    }

    #[inline]
    fn release_found(&mut self, hash: u64, loc: Loc, replica: u32) -> Option<Released> {
        let run = &mut self.runs[loc.run as usize];
        let i = run.extent_of(replica, loc.off)?;
        let mut x = run.extents[i];
        if loc.off > x.lo
            && loc.off + 1 < x.hi
            && run.extents.len() >= MAX_REPLICA_EXTENTS
            && run.replica_extents(replica) >= MAX_REPLICA_EXTENTS
        {
            // A split would give the replica one extent too many: the tail goes too.
            self.drop_tail(loc, i);
            x = self.runs[loc.run as usize].extents[i];
        }
        let run = &mut self.runs[loc.run as usize];
        if x.hi - x.lo == 1 {
            run.extents.remove(i);
        } else if loc.off + 1 == x.hi {
            run.extents[i].hi -= 1;
        } else if loc.off == x.lo {
            run.extents[i] = x.from(loc.off + 1);
        } else {
            run.extents[i].hi = loc.off;
            run.insert_extent(x.from(loc.off + 1));
        }
        let covered = run.covered(loc.off);
        Some(self.take_entry(loc, &x, hash, covered))
    }

    /// The entry of extent `x` at `loc`, which no extent covers for `x`'s replica any more:
    /// its values, its LFU and odd counts taken out, and its key out of the table (table hash
    /// `hash`) when no other extent covers it (`covered`).
    #[inline(always)]
    fn take_entry(&mut self, loc: Loc, x: &Extent, hash: u64, covered: bool) -> Released {
        let entry = Entry {
            replica: x.replica,
            tier: x.tier,
            last_seen: x.last_seen,
            tokens: self.tokens_of(x, loc),
        };
        self.forget_odd(x, loc);
        self.entries -= 1;
        let access = if x.counted {
            (self.access.remove(&(Self::access_key(loc), x.replica))).unwrap_or(0)
        } else {
            0
        };
        if !covered {
            self.table.remove_later(hash, loc);
            self.keys -= 1;
            self.uncover(loc);
        }
        Released {
            entry,
            access,
            key_gone: !covered,
        }
    }

    /// Takes the entries of extent `i` after `loc` out, last first, each into
    /// [`RunStore::dropped`]: the extent then ends at `loc`. One pass over the run's extents
    /// finds which of those blocks other extents cover: O(extents + blocks dropped).
    #[cold]
    fn drop_tail(&mut self, loc: Loc, i: usize) {
        let run = &self.runs[loc.run as usize];
        let x = run.extents[i];
        debug_assert!(x.covers(loc.off) && loc.off + 1 < x.hi);
        let first = loc.off + 1;
        // Other extents' starts and ends over the tail, then their running sum: the holders
        // other than this extent's at each of its blocks.
        let n = (x.hi - first) as usize;
        let mut others = vec![0i32; n + 1];
        for (j, y) in run.extents.iter().enumerate() {
            let (lo, hi) = (y.lo.max(first), y.hi.min(x.hi));
            if j != i && lo < hi {
                others[(lo - first) as usize] += 1;
                others[(hi - first) as usize] -= 1;
            }
        }
        let mut sum = 0;
        let held_by_others: Vec<bool> = (others[..n].iter())
            .map(|d| {
                sum += d;
                sum > 0
            })
            .collect();
        for off in (first..x.hi).rev() {
            let at = Loc { run: loc.run, off };
            let (ks, h) = self.key_at(at);
            self.runs[loc.run as usize].extents[i].hi = off;
            let covered = held_by_others[(off - first) as usize];
            let released = self.take_entry(at, &x, self.table.hash(ks, h), covered);
            self.dropped.push(Dropped { ks, h, released });
        }
    }

    /// The key at `loc` lost its last holder: cut the run's uncovered tail off when `loc` is
    /// its last block, else record the hole. A run left empty is freed.
    fn uncover(&mut self, loc: Loc) {
        let run = &mut self.runs[loc.run as usize];
        if loc.off as usize + 1 < run.hashes.len() {
            run.add_hole(loc.off);
            return;
        }
        run.hashes.pop();
        // Holes right before the end go with it (their keys left the table already).
        while let Some(&last) = run.holes().last()
            && last as usize + 1 == run.hashes.len()
        {
            run.remove_hole(run.holes().len() - 1);
            run.hashes.pop();
        }
        if run.hashes.is_empty() {
            debug_assert!(run.extents.is_empty() && run.holes.is_none());
            *run = Run::default();
            self.free_runs.push(loc.run);
        }
    }
}

/// A replica's match in a [`RunStore::walk`]: the leading blocks of the request it holds, the
/// oldest `last_seen` and the worst tier over them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Matched {
    pub replica: u32,
    pub blocks: u32,
    pub oldest: i64,
    pub tier: u8,
}

/// A walk's reusable buffers: the matches, and each replica's match in the current walk.
#[derive(Default)]
pub struct WalkScratch {
    pub matched: Vec<Matched>,
    /// replica → (walk epoch, index into `matched`).
    slots: Vec<(u32, u32)>,
    epoch: u32,
}

impl WalkScratch {
    /// Where `replica`'s match is in `matched`, if the last walk matched it.
    #[inline]
    pub fn index_of(&self, replica: u32) -> Option<usize> {
        match self.slots.get(replica as usize) {
            Some(&(epoch, at)) if epoch == self.epoch => Some(at as usize),
            _ => None,
        }
    }

    fn next_epoch(&mut self) {
        self.matched.clear();
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.slots.iter_mut().for_each(|s| s.0 = 0);
            self.epoch = 1;
        }
    }
}

impl RunStore {
    /// Walks the request's keys (in keyspace `ks`; the `i`-th is word `first` of the `i`-th
    /// chunk of `stride` words: a request's hashes where they lie, in records of `stride`
    /// words) from the first, every extent live: see [`RunStore::walk_keys`].
    pub fn walk(
        &self,
        ks: u32,
        words: &[u64],
        first: usize,
        stride: usize,
        worst: impl Fn(u8, u8) -> u8,
        scratch: &mut WalkScratch,
    ) {
        assert!(first < stride, "word {first} of records of {stride} words");
        assert_eq!(words.len() % stride, 0, "whole records of {stride} words");
        let key = |i: usize| Some((ks, words[i * stride + first]));
        self.walk_keys(words.len() / stride, key, |_| true, worst, scratch);
    }

    /// Walks the request's `len` keys (`key(i)` is the `i`-th key's keyspace word and hash,
    /// None for one no key can have) from the first: per replica holding a leading stretch of
    /// them in `live` extents, into `scratch.matched` (in no particular order), its length,
    /// oldest `last_seen` and worst tier (`worst` combines two tiers). A replica's stretch
    /// ends at the first key it does not hold in a live extent. The table is probed at the
    /// first key and wherever the request leaves a run or meets its end or a hole; along a
    /// run each extent is visited once per piece (again only when one of a replica's extents
    /// ends inside the piece and another of its extents may continue it).
    #[inline]
    pub fn walk_keys(
        &self,
        len: usize,
        key: impl Fn(usize) -> Option<(u32, u64)>,
        live: impl Fn(&Extent) -> bool,
        worst: impl Fn(u8, u8) -> u8,
        scratch: &mut WalkScratch,
    ) {
        scratch.next_epoch();
        let epoch = scratch.epoch;
        let mut i = 0usize;
        while i < len {
            let Some(loc) = key(i).and_then(|(ks, h)| self.find(ks, h)) else {
                break;
            };
            let ks = self.runs[loc.run as usize].ks;
            let along = self.along(loc);
            let most = along.len().min(len - i);
            let mut n = 1; // the key found
            while n < most && key(i + n) == Some((ks, along[n])) {
                n += 1;
            }
            let (start, end) = (loc.off, loc.off + n as u32);
            let run = &self.runs[loc.run as usize];
            let mut any_to_end = false;
            // The request's first piece starts every match: a replica's is its extent covering
            // the piece's start (its extents are disjoint: at most one does). Later pieces only
            // extend matches. Then passes extend them while one may continue inside the piece.
            let mut again = i > 0;
            if i == 0 {
                for x in &run.extents {
                    if !x.covers(start) || !live(x) {
                        continue;
                    }
                    let r = x.replica as usize;
                    if r >= scratch.slots.len() {
                        scratch.slots.resize(r + 1, (0, 0));
                    }
                    debug_assert!(scratch.slots[r].0 != epoch, "disjoint extents");
                    let upto = x.hi.min(end);
                    scratch.slots[r] = (epoch, scratch.matched.len() as u32);
                    scratch.matched.push(Matched {
                        replica: x.replica,
                        blocks: upto - start,
                        oldest: x.last_seen,
                        tier: x.tier,
                    });
                    any_to_end |= upto == end;
                    again |= upto < end;
                }
            }
            while again {
                again = false;
                for x in &run.extents {
                    let Some(&(e, at)) = scratch.slots.get(x.replica as usize) else {
                        continue;
                    };
                    if e != epoch {
                        continue;
                    }
                    let reached = scratch.matched[at as usize].blocks as usize;
                    if reached < i {
                        continue;
                    }
                    let reach = start + (reached - i) as u32;
                    if reach >= end || !x.covers(reach) || !live(x) {
                        continue;
                    }
                    let upto = x.hi.min(end);
                    let m = &mut scratch.matched[at as usize];
                    m.blocks = (i + (upto - start) as usize) as u32;
                    m.oldest = m.oldest.min(x.last_seen);
                    m.tier = worst(m.tier, x.tier);
                    any_to_end |= upto == end;
                    again |= upto < end;
                }
            }
            i += n;
            if !any_to_end {
                break;
            }
        }
    }
}

/// The table: held key → (run, offset) (see the module docs).
struct LocTable {
    hasher: KeyHasher,
    segments: Vec<Segment>,
    /// [`MAX_SEGMENT_KEYS`], or less in a test of the full table.
    max_segment_keys: usize,
    /// Entries of keys that left the store, taken out of the table together
    /// ([`LocTable::remove_later`]): each removal's bucket is a cache miss on a large store,
    /// and loaded together their misses overlap. Until then an entry is *stale*: a find
    /// passes over it, because its place no longer holds its key (a hole, past its run's
    /// end, or another key), or finds its key rightly when the key came back to that place
    /// (the table then holds the entry twice, and the pending removal takes one out).
    pending: Vec<(u64, Loc)>,
}

/// Removed keys' table entries taken out together ([`LocTable::remove_later`]).
const REMOVAL_BATCH: usize = 64;

#[derive(Default)]
struct Segment {
    buckets: Vec<u64>,
    live: usize,
    tombs: usize,
}

/// log2 of [`SEGMENTS`].
const SEGMENT_BITS: u32 = 12;
/// Tables the keys are split into by hash, so that no insert rehashes more than a small share
/// of the keys at once.
pub const SEGMENTS: usize = 1 << SEGMENT_BITS;
/// Buckets of a segment's first allocation.
const MIN_BUCKETS: usize = 16;
/// Below this many buckets a full segment grows fourfold.
const SMALL_SEGMENT_BUCKETS: usize = 256;
/// Hash bits a bucket keeps as its tag; a segment's home buckets are the tag's top bits.
const TAG_BITS: u32 = 15;
/// The most buckets of one segment (a home bucket is at most [`TAG_BITS`] of the tag).
const MAX_SEGMENT_BUCKETS: usize = 1 << TAG_BITS;
/// The most keys one segment holds (its buckets at most 3/4 full): a new key past it is
/// refused ([`TableFull`]).
const MAX_SEGMENT_KEYS: usize = MAX_SEGMENT_BUCKETS / 4 * 3;
/// The most keys a store holds, its segments evenly filled (~100M: more than a core's memory
/// holds; the keyed hash spreads keys evenly whatever producers send).
pub const MAX_KEYS: usize = SEGMENTS * MAX_SEGMENT_KEYS;
const _: () = assert!(
    MAX_KEYS < MAX_RUNS as usize,
    "runs never run out before keys"
);
const _: () = assert!(
    RUN_BITS + OFF_BITS + TAG_BITS + 1 == 64,
    "a bucket is 64 bits"
);
const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const RUN_MASK: u64 = (1 << RUN_BITS) - 1;
const OFF_MASK: u64 = (1 << OFF_BITS) - 1;

impl LocTable {
    fn new() -> LocTable {
        LocTable {
            hasher: KeyHasher::new(),
            segments: (0..SEGMENTS).map(|_| Segment::default()).collect(),
            max_segment_keys: MAX_SEGMENT_KEYS,
            pending: Vec::with_capacity(REMOVAL_BATCH),
        }
    }

    /// The keyed hash of a key (producers choose keys; see [`KeyHasher`]).
    #[inline(always)]
    fn hash(&self, ks: u32, h: u64) -> u64 {
        self.hasher.hash(ks, h)
    }

    /// A bucket's tag: the hash's top [`TAG_BITS`] bits, marked by the bit above them (so
    /// never [`EMPTY`] or [`TOMB`]).
    #[inline(always)]
    fn tag(hash: u64) -> u64 {
        (hash >> (64 - TAG_BITS)) | 1 << TAG_BITS
    }

    /// The home bucket of a marked tag in a segment of `n` buckets: the tag's top bits. A
    /// segment grows by the tags alone, without reading any key back from its run.
    #[inline(always)]
    fn home(tag: u64, n: usize) -> usize {
        debug_assert!(n.is_power_of_two() && n <= MAX_SEGMENT_BUCKETS);
        let unmarked = (tag & ((1 << TAG_BITS) - 1)) as usize;
        unmarked >> (TAG_BITS - n.trailing_zeros())
    }

    #[inline(always)]
    fn entry(hash: u64, loc: Loc) -> u64 {
        debug_assert!(u64::from(loc.run) <= RUN_MASK && u64::from(loc.off) <= OFF_MASK);
        Self::tag(hash) << (RUN_BITS + OFF_BITS)
            | u64::from(loc.run) << OFF_BITS
            | u64::from(loc.off)
    }

    #[inline(always)]
    fn loc(e: u64) -> Loc {
        Loc {
            run: ((e >> OFF_BITS) & RUN_MASK) as u32,
            off: (e & OFF_MASK) as u32,
        }
    }

    #[inline(always)]
    fn segment(hash: u64) -> usize {
        (hash >> 32) as usize & (SEGMENTS - 1)
    }

    #[inline]
    fn prefetch(&self, ks: u32, h: u64) {
        let hash = self.hash(ks, h);
        let seg = &self.segments[Self::segment(hash)];
        if !seg.buckets.is_empty() {
            prefetch(&seg.buckets[Self::home(Self::tag(hash), seg.buckets.len())]);
        }
    }

    /// The key `(ks, h)` whose table hash is `hash`.
    #[inline]
    fn find(&self, hash: u64, ks: u32, h: u64, runs: &[Run]) -> Option<Loc> {
        let seg = &self.segments[Self::segment(hash)];
        if seg.buckets.is_empty() {
            return None;
        }
        let (mask, tag) = (seg.buckets.len() - 1, Self::tag(hash));
        let mut i = Self::home(tag, seg.buckets.len());
        loop {
            let e = seg.buckets[i];
            if e == EMPTY {
                return None;
            }
            if e >> (RUN_BITS + OFF_BITS) == tag {
                let loc = Self::loc(e);
                let run = &runs[loc.run as usize];
                // A stale entry's place holds another key, or none (see `pending`).
                if run.hashes.get(loc.off as usize) == Some(&h)
                    && run.ks == ks
                    && (run.holes.is_none() || run.holes().binary_search(&loc.off).is_err())
                {
                    return Some(loc);
                }
            }
            i = (i + 1) & mask;
        }
    }

    /// Whether a new key with table hash `hash` fits ([`MAX_SEGMENT_KEYS`]).
    #[inline(always)]
    fn has_room(&self, hash: u64) -> bool {
        self.segments[Self::segment(hash)].live < self.max_segment_keys
    }

    /// Stores `loc` under the key whose table hash is `hash`, which must be absent (and fit:
    /// [`LocTable::has_room`]).
    #[inline(always)]
    fn insert(&mut self, hash: u64, loc: Loc) {
        let seg_at = Self::segment(hash);
        let seg = &self.segments[seg_at];
        if (seg.live + seg.tombs + 1) * 4 > seg.buckets.len() * 3 {
            self.grow(seg_at);
        }
        let seg = &mut self.segments[seg_at];
        let mask = seg.buckets.len() - 1;
        let mut i = Self::home(Self::tag(hash), seg.buckets.len());
        while seg.buckets[i] > TOMB {
            i = (i + 1) & mask;
        }
        if seg.buckets[i] == TOMB {
            seg.tombs -= 1;
        }
        seg.buckets[i] = Self::entry(hash, loc);
        seg.live += 1;
    }

    /// Removes the entry at `loc` of the key whose table hash is `hash`, with the next
    /// removals (see [`LocTable::pending`]).
    #[inline]
    fn remove_later(&mut self, hash: u64, loc: Loc) {
        self.pending.push((hash, loc));
        if self.pending.len() == REMOVAL_BATCH {
            self.finish_removals();
        }
    }

    /// Takes the pending removals' entries out of the table, their buckets loaded together
    /// first.
    #[cold]
    fn finish_removals(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for &(hash, _) in &pending {
            let seg = &self.segments[Self::segment(hash)];
            prefetch(&seg.buckets[Self::home(Self::tag(hash), seg.buckets.len())]);
        }
        for &(hash, loc) in &pending {
            self.remove(hash, loc);
        }
        self.pending = pending;
        self.pending.clear();
    }

    /// Removes the entry at `loc` of the key whose table hash is `hash` (it must be there).
    #[inline]
    fn remove(&mut self, hash: u64, loc: Loc) {
        let want = Self::entry(hash, loc);
        let seg = &mut self.segments[Self::segment(hash)];
        let mask = seg.buckets.len() - 1;
        let mut i = Self::home(Self::tag(hash), seg.buckets.len());
        while seg.buckets[i] != want {
            assert_ne!(seg.buckets[i], EMPTY, "a held key is in the table");
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

    /// Rehashes segment `at` into twice the buckets when at least half are live, else into as
    /// many (the tombstones go), each entry by its tag.
    #[cold]
    fn grow(&mut self, at: usize) {
        let seg = &self.segments[at];
        let n = seg.buckets.len();
        let size = if n == 0 {
            MIN_BUCKETS
        } else if seg.live * 2 >= n && n < MAX_SEGMENT_BUCKETS {
            // Fourfold while small (fewer rehashes of each key
            // while a filling store's segments grow).
            if n < SMALL_SEGMENT_BUCKETS {
                n * 4
            } else {
                n * 2
            }
        } else {
            n
        };
        debug_assert!(size <= MAX_SEGMENT_BUCKETS && seg.live < MAX_SEGMENT_KEYS);
        let old = std::mem::replace(&mut self.segments[at].buckets, vec![EMPTY; size]);
        let mask = size - 1;
        let buckets = &mut self.segments[at].buckets;
        for e in old.into_iter().filter(|&e| e > TOMB) {
            let mut i = Self::home(e >> (RUN_BITS + OFF_BITS), size);
            while buckets[i] != EMPTY {
                i = (i + 1) & mask;
            }
            buckets[i] = e;
        }
        self.segments[at].tombs = 0;
    }

    fn bytes(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.buckets.capacity() * 8)
            .sum::<usize>()
            + self.segments.capacity() * std::mem::size_of::<Segment>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Producers choose keys: keys that differ only in a few bits (sequential, shifted into the
    /// high or middle bits, one hash in many keyspaces) still spread evenly over the table's
    /// segments and sit near their home buckets, for every seed drawn (the keyed hash's second
    /// fold; with one, high-bit keys cluster).
    #[test]
    fn low_entropy_keys_spread_over_segments_and_buckets() {
        let n = 50_000u64;
        type Pattern = (&'static str, fn(u64) -> (u32, u64));
        let patterns: [Pattern; 4] = [
            ("sequential", |i| (1, i)),
            ("shifted left", |i| (1, i << 44)),
            ("middle bits", |i| (1, i << 20)),
            ("one hash, many keyspaces", |i| (i as u32, 42)),
        ];
        let entry = Entry {
            replica: 1,
            tier: 1,
            last_seen: 1,
            tokens: 1,
        };
        // Each store draws its own seeds: several, so that a hash weak for some seeds fails.
        for (name, key) in patterns.into_iter().flat_map(|p| [p; 8]) {
            let mut s = RunStore::new();
            for i in 0..n {
                let (ks, h) = key(i);
                s.upsert(ks, h, None, entry, &mut Hint::default()).unwrap();
            }
            let segments = &s.table.segments;
            let largest = segments.iter().map(|g| g.live).max().unwrap_or(0);
            assert!(
                largest <= 4 * n as usize / SEGMENTS,
                "{name}: largest segment {largest} keys"
            );
            let displaced: usize = (segments.iter())
                .flat_map(|g| {
                    let len = g.buckets.len();
                    (g.buckets.iter().enumerate())
                        .filter(|(_, e)| **e > TOMB)
                        .map(move |(i, e)| {
                            let home = LocTable::home(e >> (RUN_BITS + OFF_BITS), len);
                            i.wrapping_sub(home) & (len - 1)
                        })
                })
                .sum();
            let mean = displaced as f64 / n as f64;
            // Linear probing at a load of at most 3/4 averages under 1.5 buckets past home.
            assert!(mean < 3.0, "{name}: {mean:.2} buckets past home on average");
        }
    }
}
