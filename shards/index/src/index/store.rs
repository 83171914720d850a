//! The prefix map's storage: one compact record per prefix key with its first holder inline,
//! further holders in an overflow slab, and an index-only hash table over the key records.
//! A key with more than [`CHAIN_MAX`] overflow holders (a hot key held by many replicas) keeps
//! them in a *wide set* instead: a vector plus a replica → slot map, so finding, adding and
//! removing one holder is O(1) whatever the number of holders (the chain is a linear walk).
//!
//! Layout (the memory target is < 48 bytes per storage entry, docs/ARCHITECTURE.md §3):
//! * a key record, 36 bytes in two columns of the [`KeySlab`]: [`KeyWords`] (12 bytes), its `ks`
//!   word, the keyspace id (`(scope, adapter)`, top bit = "hash is a blob id"; bits 30 and 29
//!   are the run bits the chain walk uses, see [`RUN_FLAG`]), and the key's 8-byte hash (or
//!   blob id); and `KeyRec` (24 bytes), the first holder and the head of the overflow chain.
//! * `OverRec` (24 bytes): a further holder and the next link.
//! * [`PosTable`] × [`SEGMENTS`]: slab positions with a hash tag, 4 bytes per bucket, split by
//!   hash bits so that no table grows or rehashes more than a small share of the keys at once.
//!
//! Key records live in a chunked slab (no doubling slack) and never move: a removed key's slot
//! joins a free list and is reused by a later key (trailing free slots are given back), so a
//! position names its key until that key is removed, and a removal costs no table update for a
//! moved record. A chain stored later reuses free slots side by side where it can
//! ([`Store::find_or_insert`] takes the slot after the previous block's when it is free), so
//! its blocks still form runs. Everything that must survive the key's removal identifies it by
//! its [`KeyId`].

use super::postable::{MAX_POSITIONS, PosTable};
use crate::keyhash::KeyHasher;

/// "No link" marker for slab links.
pub(crate) const NIL: u32 = u32::MAX;
/// Top bit of [`KeyId::ks`]: the hash word is a blob id, not an inline 8-byte hash.
pub(crate) const BLOB_FLAG: u32 = 1 << 31;
/// Bit 30 of a key record's `ks` word (never part of a [`KeyId`]): the record *continues a
/// run*: every holder of the record before it in the slab holds this record too, with the same
/// tier and a `last_seen` at least as recent (token counts and LFU counters may differ); this
/// record may have more holders. A chain walk only extends runs that reached the previous block,
/// and a run keeps its oldest time and worst tier, so the runs that reached the predecessor all
/// reach this record, unchanged and still live; extra holders (replicas that evicted an earlier
/// block of the chain and kept this one: engines often evict a chain root first) never matter to
/// it, nor do later times (a chain's continuation stored after its prefix). A chain stored in one update is appended to the slab in
/// order, so its blocks form such runs, and the chain walk of a lookup consumes a run with one
/// key comparison per block instead of a visit per (block, holder). Kept true: an upsert clears
/// the bits it may falsify (its record's and its successor's) unless a chain's upserts of one
/// (replica, tier, time) to consecutive records keep or set them (the ingest's [`RunCursor`]),
/// and a chain's first upsert sets its record's bit when the record continues the one before
/// (the chain's parent, already held: [`Store::continues_predecessor`]);
/// a removal clears only its record's bit, and only when the removed replica also holds the
/// predecessor (the successor's stays: the record's holders only shrink), or its successor's
/// when the record itself goes.
const RUN_FLAG: u32 = 1 << 30;
/// Bit 29 of a key record's `ks` word: the *next* record may continue a run (set whenever its
/// [`RUN_FLAG`] is; may stay set after that is cleared). A change to a record's holders must
/// clear its successor's run bit: the hint spares reading the successor (another cache line,
/// often a miss on a large index) when it cannot be set, as in most of a slab reordered by
/// removals.
const NEXT_RUN_FLAG: u32 = 1 << 29;
/// Both run bits.
const RUN_BITS: u32 = RUN_FLAG | NEXT_RUN_FLAG;
/// Keyspace ids stay below this: bits 29–31 of a record's `ks` word are flags, and the largest
/// keyspace number below them is [`FREE_KS`]'s.
pub(crate) const KEYSPACE_LIMIT: u32 = NEXT_RUN_FLAG - 1;
/// The `ks` word of a free key record: a blob key of keyspace [`KEYSPACE_LIMIT`], which no key
/// has, without run bits, so a free record never compares equal to a key (with or without
/// [`RUN_FLAG`]) and never continues a run. Its hash words are the free list's links.
const FREE_KS: u32 = BLOB_FLAG | KEYSPACE_LIMIT;
/// How many free slots below the newest freed one [`Store::find_or_insert`] looks through for
/// the start of their free range when a chain begins a new run: chains removed root first free
/// their slots upwards, and the run is rebuilt upwards from the lowest of them.
const RUN_START_SEARCH: usize = 64;
/// Top bit of a key record's `next` link: the rest is a wide-set id, not an overflow position.
const WIDE_FLAG: u32 = 1 << 31;
/// Overflow holders a key keeps in its chain; one more converts the chain into a wide set.
pub(crate) const CHAIN_MAX: usize = 8;
/// Replica ids are stored in 24 bits next to the tier byte.
pub(crate) const REPLICA_MASK: u32 = (1 << 24) - 1;
/// log2 of [`SEGMENTS`].
const SEGMENT_BITS: u32 = 12;
/// Independent hash tables the key positions are split into. A table grows, or rehashes away
/// its tombstones, by moving every entry in one insert: O(keys), measured at 115 ms (1.8M keys)
/// to 1.5 s (7.3M keys) in one ingest with a single (hashbrown) table. A segment holds
/// 1/4096 of the keys (≈ 2.4K at 10M keys). Keys spread evenly, so the segments reach their
/// growth points together and one 64-key ingest may grow several: the longest filling ingest
/// at 10M measured 2.7–3.4 ms on-CPU with 1024 segments, 0.9–1.7 ms with 4096. Cost: a 32-byte
/// header per segment (128 KiB per core) and a shift and mask per probe; bytes per bucket are
/// unchanged.
pub(crate) const SEGMENTS: usize = 1 << SEGMENT_BITS;
/// First hash bit of the segment number: above the bits a segment's [`PosTable`] takes for the
/// bucket (the low log2(buckets) bits) and below its 6-bit tag (the top bits), so neither loses
/// entropy.
const SEGMENT_SHIFT: u32 = 40;

impl KeyHasher {
    /// The keyed hash of key `k` (see [`KeyHasher`]).
    #[inline(always)]
    fn hash_key(&self, k: KeyId) -> u64 {
        self.hash(k.ks, k.h)
    }
}

/// Stable identity of a prefix key on one core: keyspace (scope + adapter) and hash word.
/// Inline hashes are the big-endian u64 of the 8 wire bytes, so their numeric order is the
/// bytewise order the eviction tie-breaks need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct KeyId {
    /// Keyspace id; the top bit is [`BLOB_FLAG`].
    pub ks: u32,
    pub h: u64,
}

impl KeyId {
    /// The keyspace id without the blob flag.
    pub fn keyspace(&self) -> u32 {
        self.ks & !BLOB_FLAG
    }
    /// Whether `h` is a blob id.
    pub fn is_blob(&self) -> bool {
        self.ks & BLOB_FLAG != 0
    }
}

/// One (key, replica) entry's payload: 20 bytes, align 4.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct Holder {
    ls: [u32; 2],
    rep_tier: u32,
    /// Stored token count (cumulative for chain blocks).
    pub tokens: i32,
    /// LFU delivered-lookup counter (saturating; never reset by a refresh).
    pub access: u32,
}

impl Holder {
    /// A fresh entry with access count 0.
    pub fn new(replica: u32, tier: u8, tokens: i32, last_seen: i64) -> Holder {
        debug_assert!(replica <= REPLICA_MASK);
        let mut h = Holder {
            ls: [0; 2],
            rep_tier: replica | (tier as u32) << 24,
            tokens,
            access: 0,
        };
        h.set_last_seen(last_seen);
        h
    }
    /// Replica id.
    pub fn replica(&self) -> u32 {
        self.rep_tier & REPLICA_MASK
    }
    /// Stored tier.
    pub fn tier(&self) -> u8 {
        (self.rep_tier >> 24) as u8
    }
    /// Overwrites the tier.
    pub fn set_tier(&mut self, tier: u8) {
        self.rep_tier = (self.rep_tier & REPLICA_MASK) | (tier as u32) << 24;
    }
    /// `last_seen` in unix ns.
    pub fn last_seen(&self) -> i64 {
        ((self.ls[1] as u64) << 32 | self.ls[0] as u64) as i64
    }
    /// Overwrites `last_seen`.
    pub fn set_last_seen(&mut self, ts: i64) {
        let u = ts as u64;
        self.ls = [u as u32, (u >> 32) as u32];
    }
}

/// A key record's holder part (its hash and `ks` words live in their own columns of the
/// [`KeySlab`], which the chain walk streams without this part).
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct KeyRec {
    first: Holder,
    next: u32,
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct OverRec {
    holder: Holder,
    next: u32,
}

const _: () = assert!(std::mem::size_of::<KeyRec>() == 24);
const _: () = assert!(FREE_KS & RUN_BITS == 0 && FREE_KS & !BLOB_FLAG == KEYSPACE_LIMIT);
const _: () = assert!(std::mem::size_of::<OverRec>() == 24);

const CHUNK_SHIFT: u32 = 14;
const CHUNK: usize = 1 << CHUNK_SHIFT;
/// Removed key records whose table entries [`Store::finish_table_removals`] takes out together
/// (see [`Store::table_removals`]). Measured on the Mooncake trace
/// (perf/runs/2026-12-07-table-removals.md): a removed block 99 → 71 ns against one table
/// update per removal with the next removals' buckets prefetched.
const TABLE_REMOVAL_BATCH: usize = 64;
/// Key records from a found position on whose key parts [`Store::prefetch_found`] loads: the
/// first lines of the stored run a long lookup jumps to. Measured on the Mooncake trace
/// (perf/runs/2026-12-07-jump-window.md): 64 cut the p99 lookup by ~10%; 32 and 96 did less,
/// 256 was slower than none.
const FOUND_WINDOW: usize = 64;
/// Key parts ([`KeyWords`], 12 bytes) one step of that prefetch moves: every 64-byte line is
/// touched at least once.
const KEY_PARTS_PER_LINE: usize = 64 / std::mem::size_of::<KeyWords>();

/// A vector in fixed 16 Ki-element chunks: growth never copies and never over-allocates by
/// more than one chunk. A chunk is a fixed-size array, so an index masked into it needs no
/// bounds check (one check per access, on the chunk number, instead of two: ~70 instructions
/// of a removal event were such checks). The elements past `len` in the last chunk hold
/// defaults or popped values; they are never read (debug builds check).
struct Chunked<T> {
    chunks: Vec<Box<[T; CHUNK]>>,
    len: usize,
}

impl<T: Copy + Default> Chunked<T> {
    fn new() -> Self {
        Chunked {
            chunks: Vec::new(),
            len: 0,
        }
    }
    fn push(&mut self, v: T) -> u32 {
        assert!(self.len < NIL as usize, "slab full");
        if self.len == self.chunks.len() * CHUNK {
            let chunk: Box<[T; CHUNK]> = vec![T::default(); CHUNK]
                .into_boxed_slice()
                .try_into()
                .unwrap_or_else(|_| unreachable!("a chunk has CHUNK elements"));
            self.chunks.push(chunk);
        }
        let i = self.len;
        self.chunks[i >> CHUNK_SHIFT][i & (CHUNK - 1)] = v;
        self.len += 1;
        i as u32
    }
    #[inline(always)]
    fn get(&self, i: u32) -> &T {
        debug_assert!((i as usize) < self.len, "read past the slab's end");
        &self.chunks[(i >> CHUNK_SHIFT) as usize][(i as usize) & (CHUNK - 1)]
    }
    #[inline(always)]
    fn get_mut(&mut self, i: u32) -> &mut T {
        debug_assert!((i as usize) < self.len, "write past the slab's end");
        &mut self.chunks[(i >> CHUNK_SHIFT) as usize][(i as usize) & (CHUNK - 1)]
    }
    /// The filled part of chunk `c`.
    #[inline(always)]
    fn chunk(&self, c: usize) -> &[T] {
        let filled = (self.len - c * CHUNK).min(CHUNK);
        &self.chunks[c][..filled]
    }
    fn pop(&mut self) -> T {
        assert!(self.len > 0, "pop from empty");
        let i = self.len - 1;
        let v = self.chunks[i >> CHUNK_SHIFT][i & (CHUNK - 1)];
        self.len = i;
        if i & (CHUNK - 1) == 0 {
            self.chunks.pop();
        }
        v
    }
    fn bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<T>()
    }
}

/// A key record's key part: its `ks` word and its 8-byte hash (or blob id) as two words (12
/// bytes, align 4).
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct KeyWords {
    ks: u32,
    h: [u32; 2],
}

const _: () = assert!(std::mem::size_of::<KeyWords>() == 12);

impl KeyWords {
    #[inline(always)]
    fn hash(&self) -> u64 {
        (self.h[1] as u64) << 32 | self.h[0] as u64
    }
    #[inline(always)]
    fn new(hash: u64, ks: u32) -> KeyWords {
        KeyWords {
            ks,
            h: [hash as u32, (hash >> 32) as u32],
        }
    }
}

/// The key records as two columns in step: key parts ([`KeyWords`]: `ks` word and hash) and
/// holder parts ([`KeyRec`]), 36 bytes per key in all, as one record was. A lookup's chain walk
/// compares a run's keys along the slab: it streams the 12-byte key parts, not the whole 36, so
/// a long chain costs a third of the memory traffic. A free slot's hash words hold the free
/// list's links ([`FreeSlots`]).
struct KeySlab {
    key: Chunked<KeyWords>,
    rec: Chunked<KeyRec>,
}

impl KeySlab {
    fn new() -> KeySlab {
        KeySlab {
            key: Chunked::new(),
            rec: Chunked::new(),
        }
    }
    #[inline(always)]
    fn len(&self) -> usize {
        self.key.len
    }
    fn push(&mut self, hash: u64, ks: u32, rec: KeyRec) -> u32 {
        self.key.push(KeyWords::new(hash, ks));
        self.rec.push(rec)
    }
    fn set(&mut self, pos: u32, hash: u64, ks: u32, rec: KeyRec) {
        *self.key.get_mut(pos) = KeyWords::new(hash, ks);
        *self.rec.get_mut(pos) = rec;
    }
    fn pop(&mut self) {
        self.key.pop();
        self.rec.pop();
    }
    #[inline(always)]
    fn hash(&self, pos: u32) -> u64 {
        self.key.get(pos).hash()
    }
    #[inline(always)]
    fn set_hash(&mut self, pos: u32, hash: u64) {
        let k = self.key.get_mut(pos);
        k.h = [hash as u32, (hash >> 32) as u32];
    }
    #[inline(always)]
    fn ks(&self, pos: u32) -> u32 {
        self.key.get(pos).ks
    }
    #[inline(always)]
    fn ks_mut(&mut self, pos: u32) -> &mut u32 {
        &mut self.key.get_mut(pos).ks
    }
    /// Sets `here` in the `ks` word at `pos` and `before` in the one at `pos - 1` (`pos > 0`):
    /// one chunk access when both are in one chunk (a run's two records, mostly).
    #[inline(always)]
    fn or_ks_pair(&mut self, pos: u32, here: u32, before: u32) {
        let i = pos as usize & (CHUNK - 1);
        if i > 0 {
            let chunk = &mut self.key.chunks[(pos >> CHUNK_SHIFT) as usize][i - 1..=i];
            chunk[1].ks |= here;
            chunk[0].ks |= before;
        } else {
            *self.ks_mut(pos) |= here;
            *self.ks_mut(pos - 1) |= before;
        }
    }
    #[inline(always)]
    fn rec(&self, pos: u32) -> &KeyRec {
        self.rec.get(pos)
    }
    #[inline(always)]
    fn rec_mut(&mut self, pos: u32) -> &mut KeyRec {
        self.rec.get_mut(pos)
    }
    /// The key at `pos` (its `ks` word without the run bits).
    #[inline(always)]
    fn key(&self, pos: u32) -> KeyId {
        let k = self.key.get(pos);
        KeyId {
            ks: k.ks & !RUN_BITS,
            h: k.hash(),
        }
    }
    fn bytes(&self) -> usize {
        self.key.bytes() + self.rec.bytes()
    }
}

/// How many of `recs` from the first on have the `ks` word `want` (ignoring
/// [`NEXT_RUN_FLAG`]). Four records per step with one branch: the scan runs ahead of every
/// stored run a lookup follows, so its cost is paid per matched block.
#[inline(always)]
fn run_prefix(recs: &[KeyWords], want: u32) -> usize {
    let differs = |r: &KeyWords| (r.ks ^ want) & !NEXT_RUN_FLAG;
    let mut quads = recs.chunks_exact(4);
    let mut n = 0;
    for q in &mut quads {
        if differs(&q[0]) | differs(&q[1]) | differs(&q[2]) | differs(&q[3]) != 0 {
            return n + q.iter().take_while(|r| differs(r) == 0).count();
        }
        n += 4;
    }
    n + quads
        .remainder()
        .iter()
        .take_while(|r| differs(r) == 0)
        .count()
}

/// A free slot's hash word: its links to the next older and the next newer free slot.
fn links(older: u32, newer: u32) -> u64 {
    (newer as u64) << 32 | older as u64
}

/// The links of a free slot's hash word: `(older, newer)`.
fn unlinks(h: u64) -> (u32, u32) {
    (h as u32, (h >> 32) as u32)
}

/// The free key record slots: a doubly linked list through the free records themselves
/// (the low half of a free slot's hash word links to the next older free slot, the high half
/// to the next newer one), so it costs no memory of its own.
struct FreeSlots {
    oldest: u32,
    newest: u32,
    count: usize,
}

impl FreeSlots {
    fn new() -> FreeSlots {
        FreeSlots {
            oldest: NIL,
            newest: NIL,
            count: 0,
        }
    }

    /// Makes the record at `pos` a free slot, the newest.
    /// The record has no overflow holders (its `next` is [`NIL`], as a free record's stays).
    /// One write of its key words and one update of the previous newest's (a removal frees a
    /// slot after almost every event).
    #[inline(always)]
    fn push(&mut self, keys: &mut KeySlab, pos: u32) {
        debug_assert_eq!(keys.rec(pos).next, NIL, "a freed record keeps no holders");
        *keys.key.get_mut(pos) = KeyWords::new(links(self.newest, NIL), FREE_KS);
        if self.newest == NIL {
            self.oldest = pos;
        } else {
            let newest = keys.key.get_mut(self.newest);
            let older = newest.hash() as u32;
            *newest = KeyWords::new(links(older, pos), newest.ks);
        }
        self.newest = pos;
        self.count += 1;
    }

    /// Takes the free slot at `pos` out of the list (its record is then the caller's).
    #[inline(always)]
    fn unlink(&mut self, keys: &mut KeySlab, pos: u32) {
        debug_assert_eq!(keys.ks(pos), FREE_KS);
        let (older, newer) = unlinks(keys.hash(pos));
        if older == NIL {
            self.oldest = newer;
        } else {
            let h = keys.hash(older);
            keys.set_hash(older, links(h as u32, newer));
        }
        if newer == NIL {
            self.newest = older;
        } else {
            let h = keys.hash(newer);
            keys.set_hash(newer, links(older, (h >> 32) as u32));
        }
        self.count -= 1;
    }

    /// A free slot for a new key whose chain predecessor is at `after` ([`NIL`]: none), taken
    /// out of the list: the slot right after `after` when free (the run goes on), else the
    /// lowest free slot of the range below the newest freed one (at most [`RUN_START_SEARCH`]
    /// down), so that the chain's next blocks find their slots free after it. None when no slot
    /// is free.
    fn take(&mut self, keys: &mut KeySlab, after: u32) -> Option<u32> {
        if self.count == 0 {
            return None;
        }
        let next = after.wrapping_add(1);
        let pos = if after != NIL && (next as usize) < keys.len() && keys.ks(next) == FREE_KS {
            next
        } else {
            let mut p = self.newest;
            for _ in 0..RUN_START_SEARCH {
                if p == 0 || keys.ks(p - 1) != FREE_KS {
                    break;
                }
                p -= 1;
            }
            p
        };
        self.unlink(keys, pos);
        Some(pos)
    }
}

/// Where a holder lives: inline in its key record, at an overflow position, or at a slot of a
/// wide set (valid until the next removal from that set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HolderPos {
    Inline(u32),
    Over(u32),
    Wide(u32, u32),
}

/// The holders of a hot key beyond the inline one, with O(1) access by replica. Never empty
/// while linked from a key record.
#[derive(Default)]
struct Wide {
    holders: Vec<Holder>,
    slot_of: hashbrown::HashMap<u32, u32>,
}

/// What [`Store::find_or_add_holder`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HolderUpsert {
    /// The replica already holds the key, here.
    Existing(HolderPos),
    /// The holder was added.
    Added,
    /// The key already has the maximum number of holders; nothing changed.
    Full,
}

/// A key's holders after the inline one (see [`Store::holder_parts`]).
pub(crate) enum MoreHolders<'a> {
    /// The inline holder is the only one.
    None,
    /// An overflow chain from this position (walk it with [`Store::over_holder`]).
    Chain(u32),
    /// A wide set's holders.
    Wide(&'a [Holder]),
}

/// Decodes a `next` link.
fn link(next: u32) -> Option<HolderPos> {
    if next == NIL {
        None
    } else if next & WIDE_FLAG != 0 {
        Some(HolderPos::Wide(next & !WIDE_FLAG, 0))
    } else {
        Some(HolderPos::Over(next))
    }
}

/// The prefix map.
pub(crate) struct Store {
    keys: KeySlab,
    over: Chunked<OverRec>,
    over_free: u32,
    over_live: usize,
    wides: Vec<Wide>,
    wide_free: Vec<u32>,
    wide_holders: usize,
    /// Holders examined by holder searches (tests of the per-key bound on work).
    #[cfg(test)]
    probes: std::cell::Cell<u64>,
    /// Slab positions by key, in [`SEGMENTS`] tables chosen by [`Store::segment`].
    /// A fixed-size array: the masked segment number needs no bounds check on a probe.
    table: Box<[PosTable; SEGMENTS]>,
    hasher: KeyHasher,
    entries: usize,
    /// Free key record slots.
    free: FreeSlots,
    /// Where the sliced scan in progress (the TTL sweep) continues: slab positions below it
    /// were visited; 0 when no scan is in progress. Records never move, so the keys present
    /// throughout a scan are visited exactly once; a key created in a free slot below it
    /// after its position was passed is left for the next scan.
    visited: u32,
    /// The slab position of the last holder removal ([`NIL`]: none yet): where
    /// [`Store::find_near`] looks first. Only a guess, checked against the key.
    near: u32,
    /// The run bit the last change to the store cleared, as `(pos, replica)` ([`NIL`]: none):
    /// the record at `pos` continued its predecessor and stopped only because `replica` left it
    /// while still holding the predecessor. If the very next change removes `replica` from
    /// `pos - 1` (an engine evicting a chain leaves first, one block after the other), `pos`
    /// continues its predecessor again and gets its bit back; any other change forgets it.
    run_cleared: (u32, u32),
    /// Key records removed so far (wrapping; debug builds check that none is removed while a
    /// [`RunCursor`] is in use).
    moves: u32,
    /// Removed key records whose table entries are still in the table, as (the key's table
    /// hash, slot): at most [`TABLE_REMOVAL_BATCH`]. A removal frees its slot at once but
    /// leaves its table entry for [`Store::finish_table_removals`], which loads the batch's
    /// buckets together (the misses overlap) and then takes the entries out: one random bucket
    /// per removed key was a third of a removal's time. Exact meanwhile: a probe that reaches
    /// such an entry compares its key against a free record, which matches no key; no slot of
    /// the batch is reused, no table is resized and the slab keeps its length (its trailing
    /// free slots are given back by the batch) until the batch is done, as
    /// [`Store::find_or_insert`], the one insertion, finishes it first.
    table_removals: Vec<(u64, u32)>,
}

/// The last upsert of a chain being ingested, for the run bits ([`RUN_FLAG`]): the record it
/// changed (or created) at `pos` ([`NIL`]: none yet). Every upsert of one cursor is by the same
/// holder data (replica, tier, `last_seen`: one `PrefixEntry` of one update). The successor's
/// bit was left as it was: the next upsert either gives the successor the same holder (then the
/// two records changed alike and the bit stays true to them) or the bit is cleared
/// ([`Store::end_run`]). No key record moves while a cursor is in use: upserts never remove.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunCursor {
    pos: u32,
    created: bool,
    /// [`Store::moves`] when the cursor was last updated (checked in debug builds).
    #[cfg(debug_assertions)]
    moves: u32,
}

impl RunCursor {
    /// The slab position of the chain's last upsert ([`NIL`]: none yet): where its next new
    /// key is best placed after (see [`Store::find_or_insert`]).
    pub fn last(&self) -> u32 {
        self.pos
    }

    /// A cursor before a chain's first upsert.
    pub fn new() -> RunCursor {
        RunCursor {
            pos: NIL,
            created: false,
            #[cfg(debug_assertions)]
            moves: 0,
        }
    }
}

impl Store {
    pub fn new() -> Store {
        Store {
            keys: KeySlab::new(),
            over: Chunked::new(),
            over_free: NIL,
            over_live: 0,
            wides: Vec::new(),
            wide_free: Vec::new(),
            wide_holders: 0,
            #[cfg(test)]
            probes: std::cell::Cell::new(0),
            table: Self::empty_tables(),
            hasher: KeyHasher::new(),
            entries: 0,
            free: FreeSlots::new(),
            visited: 0,
            near: NIL,
            run_cleared: (NIL, NIL),
            moves: 0,
            table_removals: Vec::with_capacity(TABLE_REMOVAL_BATCH),
        }
    }

    /// Takes the table entries of the removed key records out (see [`Store::table_removals`])
    /// and gives the slab's trailing free slots back. Bounded: [`TABLE_REMOVAL_BATCH`] entries.
    #[inline]
    pub fn finish_table_removals(&mut self) {
        if !self.table_removals.is_empty() {
            self.finish_table_removals_now();
        }
    }

    #[inline(never)]
    fn finish_table_removals_now(&mut self) {
        for &(h, _) in &self.table_removals {
            self.prefetch_bucket(h);
        }
        for &(h, pos) in &self.table_removals {
            let found = self.table[Self::segment(h)].remove(h, pos);
            assert!(found, "key record missing from the table");
        }
        self.table_removals.clear();
        while self.keys.len() > 0 && self.is_free(self.keys.len() as u32 - 1) {
            let last = self.keys.len() as u32 - 1;
            self.free.unlink(&mut self.keys, last);
            self.keys.pop();
        }
    }

    /// [`SEGMENTS`] empty tables, built on the heap (no allocation per table until used).
    fn empty_tables() -> Box<[PosTable; SEGMENTS]> {
        let v: Vec<PosTable> = (0..SEGMENTS).map(|_| PosTable::default()).collect();
        match v.into_boxed_slice().try_into() {
            Ok(a) => a,
            Err(_) => unreachable!("exactly SEGMENTS tables"),
        }
    }

    /// The segment of a key's hash.
    #[inline]
    fn segment(h: u64) -> usize {
        (h >> SEGMENT_SHIFT) as usize & (SEGMENTS - 1)
    }

    /// Number of prefix keys.
    pub fn key_count(&self) -> usize {
        self.keys.len() - self.free.count
    }

    /// Number of key record slots, free ones included: positions run `0..slots()`.
    pub fn slots(&self) -> u32 {
        self.keys.len() as u32
    }

    /// The key at slab position `pos < slots()`, or None when the slot is free.
    #[inline]
    pub fn live_key_at(&self, pos: u32) -> Option<KeyId> {
        (self.keys.ks(pos) != FREE_KS).then(|| self.keys.key(pos))
    }

    /// Whether the slot at `pos < slots()` is free.
    #[inline]
    fn is_free(&self, pos: u32) -> bool {
        self.keys.ks(pos) == FREE_KS
    }

    /// Number of storage entries (key, replica).
    pub fn entry_count(&self) -> usize {
        self.entries
    }

    /// Where the sliced scan in progress continues: positions below it were visited (0 when no
    /// scan is in progress).
    pub fn visited(&self) -> u32 {
        self.visited
    }

    /// Marks positions `0..pos` visited by the sliced scan (0 ends it). Records never move, so
    /// a scan that resumes at [`Store::visited`] visits every key present throughout exactly
    /// once (the slab may have shrunk below `pos` in between: the scan is then done).
    pub fn set_visited(&mut self, pos: u32) {
        self.visited = pos;
    }

    /// Slab position of a key.
    #[inline]
    pub fn find(&self, k: KeyId) -> Option<u32> {
        let h = self.hasher.hash_key(k);
        self.table[Self::segment(h)].find(h, |i| self.keys.key(i) == k)
    }

    /// Slab position of a key that probably sits right after position `prev` (the previous
    /// block of a chain: a chain's new keys are appended to the slab in order, so its blocks
    /// usually stay neighbours). One comparison against the next record, which the walk along
    /// the slab finds in cache, instead of a table probe (a cache miss or two per block on a
    /// large index); the table when the neighbour is another key. `prev` may be [`NIL`].
    #[inline]
    pub fn find_after(&self, prev: u32, k: KeyId) -> Option<u32> {
        self.next_is(prev, k).or_else(|| self.find(k))
    }

    /// `prev + 1` when the key record there is `k` (`prev` may be [`NIL`]); no table probe.
    #[inline]
    pub fn next_is(&self, prev: u32, k: KeyId) -> Option<u32> {
        let next = prev.wrapping_add(1);
        (prev != NIL && (next as usize) < self.keys.len() && self.keys.key(next) == k)
            .then_some(next)
    }

    /// Slab position of a key about to lose a holder: first the neighbours of the last removal's
    /// position, then the table. Engines evict a chain leaves first, one event per block, and a
    /// chain's keys sit side by side in the slab (created in order; records never move), so the
    /// next key removed is usually at `p - 1`: one comparison against a record in cache instead of a table probe (two or
    /// three cache misses on a large index). The key is compared whole, so the answer is
    /// exactly [`Store::find`]'s.
    #[inline(always)]
    pub fn find_near(&self, k: KeyId) -> Option<u32> {
        let n = self.near;
        for c in [n.wrapping_sub(1), n.wrapping_add(1)] {
            if (c as usize) < self.keys.len() && self.keys.key(c) == k {
                return Some(c);
            }
        }
        self.find(k)
    }

    /// How many key records from `prev + 1` on continue a run and hold, in order, the keys
    /// `key(0)`, `key(1)`, … (at most `max`; `key` returns None for a key the index cannot
    /// hold, which ends the match): the blocks of a chain that follow block `prev`'s stored run.
    /// No table probe: the key column is compared along the slab, chunk by chunk (12 bytes read
    /// per record, not the record's 36); the key and the run bit are compared in one step (the
    /// record's `ks` word is the key's with the bit set). For short runs; a long one is
    /// followed in two steps, [`Store::run_extent`] then [`Store::run_hashes_match`], so that
    /// what is read where it ends can be loaded early.
    #[inline]
    pub fn run_matches(
        &self,
        prev: u32,
        max: usize,
        mut key: impl FnMut(usize) -> Option<KeyId>,
    ) -> usize {
        let mut m = 0;
        let mut pos = prev as usize + 1;
        while m < max && pos < self.keys.len() {
            let c = pos >> CHUNK_SHIFT;
            let chunk = self.keys.key.chunk(c);
            let from = pos & (CHUNK - 1);
            let take = (chunk.len() - from).min(max - m);
            for rec in &chunk[from..from + take] {
                let Some(k) = key(m) else {
                    return m;
                };
                if rec.ks & !NEXT_RUN_FLAG != k.ks | RUN_FLAG || rec.hash() != k.h {
                    return m;
                }
                m += 1;
            }
            pos += take;
        }
        m
    }

    /// Whether the key record `d` places after `prev` continues a run in keyspace `ks` (a
    /// run from `prev + 1` may reach it; one that stops before it certainly does not).
    #[inline(always)]
    pub fn run_may_reach(&self, prev: u32, ks: u32, d: usize) -> bool {
        let pos = prev as usize + d;
        pos < self.keys.len() && self.keys.ks(pos as u32) & !NEXT_RUN_FLAG == ks | RUN_FLAG
    }

    /// How many key records from `prev + 1` on (at most `max`) continue a run in keyspace `ks`
    /// (with its blob flag): where the stored run that follows block `prev`'s ends in the
    /// slab, read from the `ks` words alone, before the keys are compared. A walk that knows
    /// where its stored run ends can start loading what it reads there early.
    #[inline]
    pub fn run_extent(&self, prev: u32, ks: u32, max: usize) -> usize {
        let want = ks | RUN_FLAG;
        let mut m = 0;
        let mut pos = prev as usize + 1;
        while m < max && pos < self.keys.len() {
            let chunk = self.keys.key.chunk(pos >> CHUNK_SHIFT);
            let from = pos & (CHUNK - 1);
            let take = (chunk.len() - from).min(max - m);
            let n = run_prefix(&chunk[from..from + take], want);
            m += n;
            if n < take {
                break;
            }
            pos += take;
        }
        m
    }

    /// How many of the `extent` key records from `prev + 1` on, which [`Store::run_extent`]
    /// found continuing a run in an inline keyspace, hold in order the hash words `word(0)`,
    /// `word(1)`, … (None, a blob's hash, matches no inline key): [`Store::run_matches`] with
    /// the run bits already read. Four records per step with one branch: this is
    /// the per-block cost of a long lookup.
    #[inline]
    pub fn run_hashes_match(
        &self,
        prev: u32,
        extent: usize,
        word: impl Fn(usize) -> Option<u64>,
    ) -> usize {
        let mut m = 0;
        let mut pos = prev as usize + 1;
        while m < extent {
            let chunk = self.keys.key.chunk(pos >> CHUNK_SHIFT);
            let from = pos & (CHUNK - 1);
            let take = (chunk.len() - from).min(extent - m);
            let recs = &chunk[from..from + take];
            // Nonzero when record `i` of `recs` does not hold block `m + i`'s hash.
            let differs = |i: usize, r: &KeyWords| word(m + i).map_or(1, |w| w ^ r.hash());
            let mut quads = recs.chunks_exact(4);
            let mut i = 0;
            for q in &mut quads {
                let d = differs(i, &q[0])
                    | differs(i + 1, &q[1])
                    | differs(i + 2, &q[2])
                    | differs(i + 3, &q[3]);
                if d != 0 {
                    let same = q
                        .iter()
                        .enumerate()
                        .take_while(|(j, r)| differs(i + j, r) == 0);
                    return m + i + same.count();
                }
                i += 4;
            }
            for r in quads.remainder() {
                if differs(i, r) != 0 {
                    return m + i;
                }
                i += 1;
            }
            m += take;
            pos += take;
        }
        m
    }

    /// Starts loading the table bucket a probe for `k` reads first (a probe expected later).
    #[inline(always)]
    pub fn prefetch_probe(&self, k: KeyId) {
        self.prefetch_bucket(self.hasher.hash_key(k));
    }

    /// [`Store::prefetch_probe`] of a key whose table hash is `h`.
    #[inline(always)]
    fn prefetch_bucket(&self, h: u64) {
        self.table[Self::segment(h)].prefetch(h);
    }

    /// Starts loading the key record (key and holder parts) a probe for `k` would find first,
    /// reading the table bucket (prefetched earlier by [`Store::prefetch_probe`]), and the key
    /// parts of the [`FOUND_WINDOW`] records after it: a lookup that jumps there goes on along
    /// the slab, and the hardware prefetcher streams a stored run only after a few of its lines
    /// have missed.
    #[inline]
    pub fn prefetch_found(&self, k: KeyId) {
        let h = self.hasher.hash_key(k);
        if let Some(pos) = self.table[Self::segment(h)].find(h, |_| true)
            && (pos as usize) < self.keys.len()
        {
            crate::prefetch::prefetch(self.keys.key.get(pos));
            crate::prefetch::prefetch(self.keys.rec.get(pos));
            self.prefetch_window(pos);
        }
    }

    /// Starts loading the key parts of the [`FOUND_WINDOW`] records after `pos` (the line of
    /// `pos` itself is the caller's).
    #[inline]
    fn prefetch_window(&self, pos: u32) {
        let chunk = self.keys.key.chunk(pos as usize >> CHUNK_SHIFT);
        let from = pos as usize & (CHUNK - 1);
        let window = &chunk[from..(from + FOUND_WINDOW).min(chunk.len())];
        let mut at = KEY_PARTS_PER_LINE;
        while let Some(r) = window.get(at) {
            crate::prefetch::prefetch(r);
            at += KEY_PARTS_PER_LINE;
        }
    }

    /// Whether the key record at `pos` continues a run: its holders equal those of the record
    /// at `pos - 1` in replica, tier and `last_seen` (see [`RUN_FLAG`]).
    #[inline(always)]
    pub fn continues_run(&self, pos: u32) -> bool {
        self.keys.ks(pos) & RUN_FLAG != 0
    }

    /// Clears the run bit of the record at `pos`, if there is one.
    #[inline(always)]
    fn clear_run(&mut self, pos: u32) {
        if (pos as usize) < self.keys.len() {
            *self.keys.ks_mut(pos) &= !RUN_FLAG;
        }
    }

    /// The record at `pos` no longer continues a run (its holders changed, or it leaves).
    fn leave_run(&mut self, pos: u32) {
        *self.keys.ks_mut(pos) &= !RUN_FLAG;
    }

    /// The successor of the record at `pos` no longer continues it (the record's holders
    /// changed, or it leaves its place): clears the successor's run bit, reading it only when
    /// the record's hint says it may be set.
    #[inline]
    fn detach_next(&mut self, pos: u32) {
        let ks = self.keys.ks_mut(pos);
        if *ks & NEXT_RUN_FLAG != 0 {
            *ks &= !NEXT_RUN_FLAG;
            self.clear_run(pos.wrapping_add(1));
        }
    }

    /// Records an upsert at `pos` (a record created by it when `created`, else changed by it
    /// unless `applied` is false: the key was full) made after the upserts of `cursor`, all by
    /// the same holder data. Keeps the run bits exact: a record changed right after its
    /// predecessor was changed alike keeps its bit (a created one gets it when its predecessor
    /// was created alike: both hold exactly that holder); any other change clears the bits
    /// that depended on the old holders. Inlined: the common case (the next record of a stored
    /// chain refreshed) is a few comparisons.
    #[inline(always)]
    pub fn note_upsert(
        &mut self,
        cursor: &mut RunCursor,
        pos: u32,
        replica: u32,
        created: bool,
        applied: bool,
    ) {
        #[cfg(debug_assertions)]
        debug_assert!(
            cursor.pos == NIL || cursor.moves == self.moves,
            "a record moved"
        );
        // A fresh cursor (NIL) "follows" into position 0: harmless, as the first record never
        // has its run bit set, so keeping it is clearing it.
        self.run_cleared.0 = NIL;
        let follows = cursor.pos.wrapping_add(1) == pos && applied;
        if follows {
            // Created right after its predecessor (the common case of a new chain: inlined
            // too): continues it if the predecessor's only holder is this chain's (created by
            // it, or held by no other replica).
            if created
                && cursor.pos != NIL
                && (cursor.created || self.keys.rec(cursor.pos).next == NIL)
            {
                self.keys.or_ks_pair(pos, RUN_FLAG, NEXT_RUN_FLAG);
            }
            cursor.pos = pos;
            cursor.created = created;
            #[cfg(debug_assertions)]
            {
                cursor.moves = self.moves;
            }
        } else {
            self.note_upsert_cold(cursor, pos, replica, created, applied);
        }
    }

    /// [`Store::note_upsert`] of each of a chain's upserts that created the records at
    /// `placed` (in chain order) with the chain's holder as their only holder: the same notes,
    /// the forgotten clear ([`Store::run_cleared`]) once for all.
    #[inline]
    pub fn note_created(&mut self, cursor: &mut RunCursor, placed: &[(u32, bool)], replica: u32) {
        self.run_cleared.0 = NIL;
        for &(pos, created) in placed {
            debug_assert!(created);
            #[cfg(debug_assertions)]
            debug_assert!(
                cursor.pos == NIL || cursor.moves == self.moves,
                "a record moved"
            );
            if cursor.pos.wrapping_add(1) != pos {
                self.note_upsert_cold(cursor, pos, replica, true, true);
                continue;
            }
            if cursor.pos != NIL && (cursor.created || self.keys.rec(cursor.pos).next == NIL) {
                self.keys.or_ks_pair(pos, RUN_FLAG, NEXT_RUN_FLAG);
            }
            cursor.pos = pos;
            cursor.created = true;
            #[cfg(debug_assertions)]
            {
                cursor.moves = self.moves;
            }
        }
    }

    /// [`Store::note_upsert`] when the upsert does not follow the cursor's.
    #[inline(never)]
    fn note_upsert_cold(
        &mut self,
        cursor: &mut RunCursor,
        pos: u32,
        replica: u32,
        created: bool,
        applied: bool,
    ) {
        self.end_run(*cursor);
        if applied {
            self.rejoin_run(pos, replica);
        }
        *cursor = if applied {
            RunCursor {
                pos,
                created,
                #[cfg(debug_assertions)]
                moves: self.moves,
            }
        } else {
            RunCursor::new()
        };
    }

    /// The run bit of the record at `pos` after `replica`'s upsert there that does not follow
    /// an upsert of the same chain at `pos - 1` (a chain's first block, or one past a gap).
    /// The replica's holder of the predecessor decides: none, and the bit stays true (the
    /// record only gained a holder or a later time); one with the same tier and an earlier or
    /// equal time, and the record continues the predecessor if every other holder of it is
    /// here too (checked, O(holders), bounded by the holders per key: most often the chain's
    /// parent, which the replica already held); any other, and the bit goes.
    fn rejoin_run(&mut self, pos: u32, replica: u32) {
        if pos == 0 || self.is_free(pos - 1) {
            return;
        }
        let Some(here) = self.find_holder(pos, replica).map(|at| *self.holder(at)) else {
            return;
        };
        let Some(before) = self
            .find_holder(pos - 1, replica)
            .map(|at| *self.holder(at))
        else {
            return;
        };
        if !Self::continues_holder(&before, &here) {
            self.leave_run(pos);
        } else if !self.continues_run(pos) && self.continues_predecessor(pos) {
            *self.keys.ks_mut(pos) |= RUN_FLAG;
            *self.keys.ks_mut(pos - 1) |= NEXT_RUN_FLAG;
        }
    }

    /// Whether holder `here` (of one record) continues holder `before` (of the record before
    /// it) for a chain walk: same tier, a time at least as recent (see [`RUN_FLAG`]).
    #[inline]
    fn continues_holder(before: &Holder, here: &Holder) -> bool {
        here.tier() == before.tier() && here.last_seen() >= before.last_seen()
    }

    /// Whether the record at `pos` continues the live record before it (see [`RUN_FLAG`]): each
    /// holder there holds `pos` too, continued. O(holders of `pos - 1`).
    pub fn continues_predecessor(&self, pos: u32) -> bool {
        self.holders(pos - 1).all(|(_, before)| {
            self.find_holder(pos, before.replica())
                .is_some_and(|at| Self::continues_holder(before, self.holder(at)))
        })
    }

    /// Ends a chain's upserts: the successor of the last changed record no longer continues it.
    pub fn end_run(&mut self, cursor: RunCursor) {
        // After a removal, `pos` may name a free slot or another key: clearing its successor's
        // bit is then merely unneeded (the removal cleared the bits that depended on it).
        if (cursor.pos as usize) < self.keys.len() && !self.is_free(cursor.pos) {
            self.detach_next(cursor.pos);
        }
    }

    /// Sets the run bit of the key record at `pos` if it continues its predecessor (see
    /// [`RUN_FLAG`]): for records filled one holder at a time rather than chain by chain (a
    /// restore), once `pos`'s holders are complete. A bit is set only where that holds, as
    /// [`Store::check_runs`] verifies. O(holders of both).
    pub fn mark_run_at(&mut self, pos: u32) {
        if pos == 0 || pos as usize >= self.keys.len() || self.is_free(pos) || self.is_free(pos - 1)
        {
            return;
        }
        if self.continues_predecessor(pos) {
            *self.keys.ks_mut(pos) |= RUN_FLAG;
            *self.keys.ks_mut(pos - 1) |= NEXT_RUN_FLAG;
        }
    }

    /// Each key record's key and run bits, in slab order (tests).
    #[cfg(test)]
    pub fn run_bits(&self) -> Vec<(KeyId, u32)> {
        (0..self.keys.len() as u32)
            .filter(|&p| !self.is_free(p))
            .map(|p| (self.key_at(p), self.keys.ks(p) & RUN_BITS))
            .collect()
    }

    /// How many key records continue a run (tests).
    #[cfg(test)]
    pub fn runs(&self) -> usize {
        (0..self.keys.len() as u32)
            .filter(|&p| !self.is_free(p) && self.continues_run(p))
            .count()
    }

    /// Checks every run bit against the holders (tests: panics on a stale bit).
    pub fn check_runs(&self) {
        let data = |pos: u32| {
            let mut v: Vec<(u32, u8, i64)> = self
                .holders(pos)
                .map(|(_, h)| (h.replica(), h.tier(), h.last_seen()))
                .collect();
            v.sort_unstable();
            v
        };
        let mut free = 0;
        for pos in 0..self.keys.len() as u32 {
            if self.is_free(pos) {
                free += 1;
                continue;
            }
            if self.continues_run(pos) {
                assert!(pos > 0, "the first record continues a run");
                assert!(!self.is_free(pos - 1), "record {pos} continues a free slot");
                assert!(
                    self.continues_predecessor(pos),
                    "stale run bit at {pos}: {:?} not all continued in {:?}",
                    data(pos - 1),
                    data(pos)
                );
                let hint = self.keys.ks(pos - 1) & NEXT_RUN_FLAG != 0;
                assert!(
                    hint,
                    "record {pos} continues a run its predecessor does not hint at"
                );
            }
        }
        assert_eq!(free, self.free.count, "free slots off the free list");
        let mut listed = 0;
        let mut at = self.free.oldest;
        while at != NIL {
            assert!(self.is_free(at), "a live record on the free list");
            listed += 1;
            at = unlinks(self.keys.hash(at)).1;
        }
        assert_eq!(listed, self.free.count, "free list length");
    }

    /// The key at a slab position that holds one (not a free slot).
    pub fn key_at(&self, pos: u32) -> KeyId {
        debug_assert!(!self.is_free(pos), "key_at of a free slot");
        self.keys.key(pos)
    }

    /// Iterates the holders of the key at `pos`.
    pub fn holders(&self, pos: u32) -> Holders<'_> {
        Holders {
            store: self,
            at: Some(HolderPos::Inline(pos)),
        }
    }

    /// The holders of the key at `pos` as its inline holder and the rest, for loops that walk
    /// them per form (the chain walk of a lookup visits every block's holders, and the shared
    /// blocks of a fleet are held by every replica): the same order as [`Store::holders`]
    /// without the iterator's state machine per holder.
    #[inline]
    pub fn holder_parts(&self, pos: u32) -> (&Holder, MoreHolders<'_>) {
        let rec = self.keys.rec(pos);
        let more = if rec.next == NIL {
            MoreHolders::None
        } else if rec.next & WIDE_FLAG != 0 {
            MoreHolders::Wide(&self.wides[(rec.next & !WIDE_FLAG) as usize].holders)
        } else {
            MoreHolders::Chain(rec.next)
        };
        (&rec.first, more)
    }

    /// The overflow holder at `o` and the next link of its chain ([`NIL`] at the end).
    #[inline]
    pub fn over_holder(&self, o: u32) -> (&Holder, u32) {
        let rec = self.over.get(o);
        (&rec.holder, rec.next)
    }

    /// The holder of `replica` in the key at `pos` (O(1) for wide keys, a walk of at most
    /// [`CHAIN_MAX`] overflow holders otherwise).
    pub fn find_holder(&self, pos: u32, replica: u32) -> Option<HolderPos> {
        let rec = self.keys.rec(pos);
        if rec.first.replica() == replica {
            return Some(HolderPos::Inline(pos));
        }
        if rec.next != NIL && rec.next & WIDE_FLAG != 0 {
            let w = rec.next & !WIDE_FLAG;
            return self.wides[w as usize]
                .slot_of
                .get(&replica)
                .map(|&i| HolderPos::Wide(w, i));
        }
        let mut cur = rec.next;
        while cur != NIL {
            #[cfg(test)]
            self.probes.set(self.probes.get() + 1);
            let o = self.over.get(cur);
            if o.holder.replica() == replica {
                return Some(HolderPos::Over(cur));
            }
            cur = o.next;
        }
        None
    }

    /// Number of holders of the key at `pos`.
    #[cfg(test)]
    pub fn holder_count(&self, pos: u32) -> usize {
        let next = self.keys.rec(pos).next;
        if next != NIL && next & WIDE_FLAG != 0 {
            return 1 + self.wides[(next & !WIDE_FLAG) as usize].holders.len();
        }
        self.holders(pos).count()
    }

    /// The holder of `holder.replica()` in the key at `pos` if there is one; otherwise adds
    /// `holder` unless the key already has `max` holders. O(1) for wide keys.
    pub fn find_or_add_holder(&mut self, pos: u32, holder: Holder, max: usize) -> HolderUpsert {
        let replica = holder.replica();
        let rec = self.keys.rec(pos);
        if rec.first.replica() == replica {
            return HolderUpsert::Existing(HolderPos::Inline(pos));
        }
        let next = rec.next;
        if next != NIL && next & WIDE_FLAG != 0 {
            let w = next & !WIDE_FLAG;
            let set = &mut self.wides[w as usize];
            if let Some(&i) = set.slot_of.get(&replica) {
                return HolderUpsert::Existing(HolderPos::Wide(w, i));
            }
            if 1 + set.holders.len() >= max {
                return HolderUpsert::Full;
            }
            set.slot_of.insert(replica, set.holders.len() as u32);
            set.holders.push(holder);
            self.wide_holders += 1;
            self.entries += 1;
            return HolderUpsert::Added;
        }
        let mut chain = 0usize;
        let mut cur = next;
        while cur != NIL {
            #[cfg(test)]
            self.probes.set(self.probes.get() + 1);
            let o = self.over.get(cur);
            if o.holder.replica() == replica {
                return HolderUpsert::Existing(HolderPos::Over(cur));
            }
            chain += 1;
            cur = o.next;
        }
        if 1 + chain >= max {
            return HolderUpsert::Full;
        }
        if chain >= CHAIN_MAX {
            self.widen(pos, holder);
        } else {
            self.push_over(pos, holder);
        }
        HolderUpsert::Added
    }

    /// Moves the key's overflow chain into a new wide set together with `holder`.
    fn widen(&mut self, pos: u32, holder: Holder) {
        let mut set = Wide::default();
        let mut cur = self.keys.rec(pos).next;
        while cur != NIL {
            let o = self.over.get(cur);
            let (h, n) = (o.holder, o.next);
            set.slot_of.insert(h.replica(), set.holders.len() as u32);
            set.holders.push(h);
            self.free_over(cur);
            cur = n;
        }
        set.slot_of
            .insert(holder.replica(), set.holders.len() as u32);
        set.holders.push(holder);
        self.wide_holders += set.holders.len();
        let w = match self.wide_free.pop() {
            Some(w) => {
                self.wides[w as usize] = set;
                w
            }
            None => {
                self.wides.push(set);
                (self.wides.len() - 1) as u32
            }
        };
        assert!(w < WIDE_FLAG - 1, "too many wide keys");
        self.keys.rec_mut(pos).next = WIDE_FLAG | w;
        self.entries += 1;
    }

    /// Frees an emptied wide set.
    fn free_wide(&mut self, w: u32) {
        self.wides[w as usize] = Wide::default();
        self.wide_free.push(w);
    }

    /// Read access to one holder.
    pub fn holder(&self, at: HolderPos) -> &Holder {
        match at {
            HolderPos::Inline(p) => &self.keys.rec(p).first,
            HolderPos::Over(o) => &self.over.get(o).holder,
            HolderPos::Wide(w, i) => &self.wides[w as usize].holders[i as usize],
        }
    }

    /// Write access to one holder.
    pub fn holder_mut(&mut self, at: HolderPos) -> &mut Holder {
        match at {
            HolderPos::Inline(p) => &mut self.keys.rec_mut(p).first,
            HolderPos::Over(o) => &mut self.over.get_mut(o).holder,
            HolderPos::Wide(w, i) => &mut self.wides[w as usize].holders[i as usize],
        }
    }

    /// Creates a key with its first holder; the key must be absent (tests; ingest uses
    /// [`Store::find_or_insert`]).
    #[cfg(test)]
    pub fn insert_key(&mut self, k: KeyId, first: Holder) -> u32 {
        debug_assert!(self.find(k).is_none());
        let (pos, created) = self.find_or_insert(k, first, NIL);
        debug_assert!(created);
        pos
    }

    /// Finds the key or creates it with `first` as its only holder, in one table probe.
    /// Returns `(slab position, created)`. A new key takes the slot after `after` (the previous
    /// block of its chain, or [`NIL`]) when that slot is free, so a chain stored into free
    /// slots stays in order; else the start of the newest freed range; else a new slot.
    pub fn find_or_insert(&mut self, k: KeyId, first: Holder, after: u32) -> (u32, bool) {
        debug_assert!(k.keyspace() < KEYSPACE_LIMIT);
        // No slot is reused and no table resized while removed entries are still in a table.
        self.finish_table_removals();
        let h = self.hasher.hash_key(k);
        let (keys, hasher) = (&self.keys, &self.hasher);
        let table = &mut self.table[Self::segment(h)];
        table.reserve_one(|i| hasher.hash_key(keys.key(i)));
        let vacant = match table.find_or_vacant(h, |i| keys.key(i) == k) {
            Ok(pos) => return (pos, false),
            Err(v) => v,
        };
        let rec = KeyRec { first, next: NIL };
        let pos = match self.free.take(&mut self.keys, after) {
            Some(pos) => {
                self.keys.set(pos, k.h, k.ks, rec);
                pos
            }
            None => self.keys.push(k.h, k.ks, rec),
        };
        assert!(pos < MAX_POSITIONS, "key record slab full");
        self.table[Self::segment(h)].fill(vacant, h, pos);
        self.entries += 1;
        (pos, true)
    }

    /// Adds a holder to an existing key (the replica must not hold it yet; no bound).
    #[cfg(test)]
    pub fn add_holder(&mut self, pos: u32, holder: Holder) {
        let r = self.find_or_add_holder(pos, holder, usize::MAX);
        debug_assert_eq!(r, HolderUpsert::Added);
    }

    /// Links a new overflow holder at the head of the key's chain.
    fn push_over(&mut self, pos: u32, holder: Holder) {
        let next = self.keys.rec(pos).next;
        let rec = OverRec { holder, next };
        let o = if self.over_free != NIL {
            let o = self.over_free;
            let slot = self.over.get_mut(o);
            self.over_free = slot.next;
            *slot = rec;
            o
        } else {
            self.over.push(rec)
        };
        assert!(o & WIDE_FLAG == 0, "overflow slab full");
        self.keys.rec_mut(pos).next = o;
        self.over_live += 1;
        self.entries += 1;
    }

    fn free_over(&mut self, o: u32) {
        let slot = self.over.get_mut(o);
        slot.next = self.over_free;
        self.over_free = o;
        self.over_live -= 1;
    }

    /// Removes `replica`'s holder from the key at `pos`. Returns the removed holder and whether
    /// the key itself was removed (it had no other holder; its slot is then free, and no other
    /// record moves).
    #[inline(always)]
    pub fn remove_holder(&mut self, pos: u32, replica: u32) -> Option<(Holder, bool)> {
        let rec = self.keys.rec(pos);
        if rec.next == NIL && rec.first.replica() == replica {
            // The replica is the key's only holder (95% of a fleet's removals): the record goes.
            // What the general path below does for it, without its holder search and match.
            let removed = rec.first;
            self.entries -= 1;
            self.near = pos;
            self.run_cleared.0 = NIL;
            // One read of the key words for the successor's hint and the table removal (the
            // record's own hint goes with it: its slot is freed or given back).
            let words = *self.keys.key.get(pos);
            if words.ks & NEXT_RUN_FLAG != 0 {
                self.clear_run(pos.wrapping_add(1));
            }
            let key = KeyId {
                ks: words.ks & !RUN_BITS,
                h: words.hash(),
            };
            self.remove_record_of(pos, key);
            return Some((removed, true));
        }
        self.remove_holder_general(pos, replica)
    }

    /// [`Store::remove_holder`] when the key has other holders than `replica` (or `replica`
    /// does not hold it): kept out of line so the common case inlines into the removal.
    #[inline(never)]
    fn remove_holder_general(&mut self, pos: u32, replica: u32) -> Option<(Holder, bool)> {
        let at = self.find_holder(pos, replica)?;
        self.entries -= 1;
        self.near = pos;
        // The replica leaves this record after leaving the next one: the next one continues
        // this one again (see `run_cleared`).
        let rejoined = self.run_cleared == (pos.wrapping_add(1), replica);
        self.run_cleared.0 = NIL;
        let (removed, key_gone) = self.take_holder(pos, replica, at);
        if !key_gone {
            self.leave_run_without(pos, replica);
            if rejoined {
                *self.keys.ks_mut(pos) |= NEXT_RUN_FLAG;
                *self.keys.ks_mut(pos + 1) |= RUN_FLAG;
            }
        }
        Some((removed, key_gone))
    }

    /// Takes `replica`'s holder (found at `at`) out of the key record at `pos`; the record goes
    /// when that was its last holder (`true`).
    fn take_holder(&mut self, pos: u32, replica: u32, at: HolderPos) -> (Holder, bool) {
        match at {
            HolderPos::Inline(_) => {
                let rec = self.keys.rec(pos);
                let removed = rec.first;
                let next = rec.next;
                if next == NIL {
                    // The slot goes (and may hold another key later): its successor no longer
                    // continues it.
                    self.detach_next(pos);
                    self.remove_key_record(pos);
                    return (removed, true);
                }
                if next & WIDE_FLAG != 0 {
                    // Promote the wide set's last holder (no other slot moves).
                    let w = next & !WIDE_FLAG;
                    let set = &mut self.wides[w as usize];
                    let promoted = set.holders.pop().expect("wide set never empty");
                    set.slot_of.remove(&promoted.replica());
                    let emptied = set.holders.is_empty();
                    self.wide_holders -= 1;
                    let rec = self.keys.rec_mut(pos);
                    rec.first = promoted;
                    if emptied {
                        rec.next = NIL;
                        self.free_wide(w);
                    }
                    return (removed, false);
                }
                let o = self.over.get(next);
                let (promoted, after) = (o.holder, o.next);
                let rec = self.keys.rec_mut(pos);
                rec.first = promoted;
                rec.next = after;
                self.free_over(next);
                (removed, false)
            }
            HolderPos::Over(o) => {
                // Unlink o from the chain starting at keys[pos].next.
                let removed = self.over.get(o).holder;
                let after = self.over.get(o).next;
                let head = self.keys.rec(pos).next;
                if head == o {
                    self.keys.rec_mut(pos).next = after;
                } else {
                    let mut cur = head;
                    loop {
                        debug_assert!(cur != NIL, "overflow holder not in its chain");
                        let n = self.over.get(cur).next;
                        if n == o {
                            self.over.get_mut(cur).next = after;
                            break;
                        }
                        cur = n;
                    }
                }
                self.free_over(o);
                (removed, false)
            }
            HolderPos::Wide(w, i) => {
                let set = &mut self.wides[w as usize];
                let removed = set.holders.swap_remove(i as usize);
                set.slot_of.remove(&replica);
                if let Some(moved) = set.holders.get(i as usize) {
                    set.slot_of.insert(moved.replica(), i);
                }
                let emptied = set.holders.is_empty();
                self.wide_holders -= 1;
                if emptied {
                    self.keys.rec_mut(pos).next = NIL;
                    self.free_wide(w);
                }
                (removed, false)
            }
        }
    }

    /// The run bits when `replica` leaves the record at `pos` (see [`RUN_FLAG`]): the record
    /// still continues its predecessor unless the replica holds the predecessor too (its run
    /// now ends there). The successor's bit is unaffected: this record's holders only shrink.
    /// Reads the predecessor only when the bit is set (it is then a live record, usually the
    /// last removal's when a chain is evicted root first).
    fn leave_run_without(&mut self, pos: u32, replica: u32) {
        if self.continues_run(pos) && self.find_holder(pos - 1, replica).is_some() {
            self.leave_run(pos);
            self.run_cleared = (pos, replica);
        }
    }

    /// Frees the key record at `pos`, its table entry taken out with the batch (see
    /// [`Store::table_removals`]); no other record moves. Trailing free slots are given back
    /// to the slab with the batch.
    fn remove_key_record(&mut self, pos: u32) {
        self.remove_record_of(pos, self.key_at(pos));
    }

    /// [`Store::remove_key_record`] of the record at `pos`, whose key is `k`.
    #[inline(always)]
    fn remove_record_of(&mut self, pos: u32, k: KeyId) {
        debug_assert_eq!(self.key_at(pos), k);
        debug_assert!(self.keys.rec(pos).next == NIL);
        // The removed record's successor lost its predecessor (remove_holder detached it).
        // Its table entry goes with the batch (see `table_removals`).
        self.free.push(&mut self.keys, pos);
        self.table_removals.push((self.hasher.hash_key(k), pos));
        if self.table_removals.len() == TABLE_REMOVAL_BATCH {
            self.finish_table_removals_now();
        }
        self.moves = self.moves.wrapping_add(1);
    }

    /// Approximate heap bytes held by the store (for the memory report).
    pub fn heap_bytes(&self) -> usize {
        let wide: usize = self
            .wides
            .iter()
            .map(|w| {
                w.holders.capacity() * std::mem::size_of::<Holder>() + w.slot_of.capacity() * 9
            })
            .sum();
        self.keys.bytes()
            + self.over.bytes()
            + self
                .table
                .iter()
                .map(PosTable::allocation_size)
                .sum::<usize>()
            + self.table.len() * std::mem::size_of::<PosTable>()
            + wide
            + self.wides.capacity() * std::mem::size_of::<Wide>()
    }

    /// Number of overflow holders in use.
    #[allow(dead_code)]
    pub fn overflow_holders(&self) -> usize {
        self.over_live + self.wide_holders
    }
}

/// Iterator over a key's holders: the inline one, then the overflow chain.
pub(crate) struct Holders<'a> {
    store: &'a Store,
    at: Option<HolderPos>,
}

impl<'a> Iterator for Holders<'a> {
    type Item = (HolderPos, &'a Holder);
    fn next(&mut self) -> Option<Self::Item> {
        let at = self.at?;
        let h = match at {
            HolderPos::Inline(p) => {
                let r = self.store.keys.rec(p);
                self.at = link(r.next);
                &r.first
            }
            HolderPos::Over(o) => {
                let r = self.store.over.get(o);
                self.at = link(r.next);
                &r.holder
            }
            HolderPos::Wide(w, i) => {
                let set = &self.store.wides[w as usize].holders;
                self.at = if (i as usize) + 1 < set.len() {
                    Some(HolderPos::Wide(w, i + 1))
                } else {
                    None
                };
                &set[i as usize]
            }
        };
        Some((at, h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_swap_keeps_table_consistent() {
        let mut s = Store::new();
        let ks: Vec<KeyId> = (0..100u64)
            .map(|i| KeyId {
                ks: (i % 3) as u32,
                h: i * 7,
            })
            .collect();
        for (i, k) in ks.iter().enumerate() {
            let p = s.insert_key(*k, Holder::new(1, 1, i as i32, i as i64));
            s.add_holder(p, Holder::new(2, 2, 5, 5));
            s.add_holder(p, Holder::new(3, 3, 6, 6));
        }
        assert_eq!(s.entry_count(), 300);
        for k in ks.iter().step_by(2) {
            let p = s.find(*k).unwrap();
            assert!(!s.remove_holder(p, 2).unwrap().1);
            assert!(!s.remove_holder(p, 1).unwrap().1);
            assert!(s.remove_holder(p, 1).is_none());
            assert!(s.remove_holder(p, 3).unwrap().1);
        }
        assert_eq!(s.key_count(), 50);
        assert_eq!(s.entry_count(), 150);
        for (i, k) in ks.iter().enumerate() {
            match s.find(*k) {
                Some(p) => {
                    assert_eq!(i % 2, 1);
                    assert_eq!(s.key_at(p), *k);
                    let reps: Vec<u32> = s.holders(p).map(|(_, h)| h.replica()).collect();
                    assert_eq!(reps.len(), 3);
                }
                None => assert_eq!(i % 2, 0),
            }
        }
    }

    /// `run_matches` stops exactly at the first record that differs (another hash, a key the
    /// index cannot hold, the end of the run or of `max`), wherever that falls in the records
    /// it compares in one step.
    #[test]
    fn run_matches_stops_at_the_first_difference() {
        // The one-step match, checked against the two steps a long run is followed in.
        fn both(s: &Store, first: u32, max: usize, key: impl Fn(usize) -> Option<KeyId>) -> usize {
            let one = s.run_matches(first, max, &key);
            let extent = s.run_extent(first, 1, max);
            let word = |j: usize| key(j).filter(|k| k.ks == 1).map(|k| k.h);
            assert_eq!(s.run_hashes_match(first, extent, word), one, "two steps");
            one
        }
        let mut s = Store::new();
        store_chain(&mut s, 1, 40, 7, 10);
        let first = s.find(KeyId { ks: 1, h: 1 << 32 }).unwrap();
        let k = |b: usize| KeyId {
            ks: 1,
            h: 1 << 32 | (b as u64 + 1),
        };
        assert_eq!(both(&s, first, 39, |j| Some(k(j))), 39);
        assert_eq!(both(&s, first, 100, |j| Some(k(j))), 39);
        // The run's extent comes from the run bits alone: the slab ends it here.
        assert_eq!(s.run_extent(first, 1, 100), 39);
        assert_eq!(s.run_extent(first, 1, 20), 20);
        assert_eq!(s.run_extent(first, 2, 39), 0, "another keyspace's run");
        for cut in 0..39 {
            let wrong = |j: usize| {
                Some(if j == cut {
                    KeyId { ks: 1, h: 99 }
                } else {
                    k(j)
                })
            };
            assert_eq!(both(&s, first, 39, wrong), cut, "hash differs at {cut}");
            let none = |j: usize| (j != cut).then(|| k(j));
            assert_eq!(both(&s, first, 39, none), cut, "no key at {cut}");
            let other_ks = |j: usize| {
                Some(KeyId {
                    ks: if j == cut { 2 } else { 1 },
                    ..k(j)
                })
            };
            assert_eq!(
                both(&s, first, 39, other_ks),
                cut,
                "keyspace differs at {cut}"
            );
            assert_eq!(both(&s, first, cut, |j| Some(k(j))), cut, "max {cut}");
        }
        // A record that stops continuing the run (its holders changed) ends the match there.
        for cut in [5usize, 8, 17, 31] {
            let mut t = Store::new();
            store_chain(&mut t, 1, 40, 7, 10);
            let at = t.find(k(cut)).unwrap();
            t.find_or_add_holder(at, Holder::new(9, 1, 1, 10), usize::MAX);
            t.leave_run(at);
            t.detach_next(at);
            let first = t.find(KeyId { ks: 1, h: 1 << 32 }).unwrap();
            assert_eq!(
                both(&t, first, 39, |j| Some(k(j))),
                cut,
                "run ends at {cut}"
            );
            assert_eq!(t.run_extent(first, 1, 39), cut, "extent ends at {cut}");
        }
    }

    /// Records created one holder at a time (as a restore does) get the run bits their chains
    /// had: exactly where a record's holders equal its predecessor's.
    #[test]
    fn mark_run_at_finds_the_runs_of_records_restored_one_by_one() {
        let mut a = Store::new();
        store_chain(&mut a, 1, 30, 7, 10);
        store_chain(&mut a, 1, 30, 8, 10);
        store_chain(&mut a, 2, 20, 7, 10);
        store_chain(&mut a, 2, 10, 9, 11);
        let want = a.run_bits();
        let mut b = Store::new();
        for pos in 0..a.slots() {
            let k = a.key_at(pos);
            let mut holders: Vec<Holder> = a.holders(pos).map(|(_, h)| *h).collect();
            holders.reverse(); // another holder order: the bits compare holder sets
            let p = b.insert_key(k, holders[0]);
            for h in &holders[1..] {
                b.add_holder(p, *h);
            }
        }
        assert_eq!(b.runs(), 0);
        for pos in 0..b.slots() {
            b.mark_run_at(pos);
        }
        b.check_runs();
        // Every run the chains' upserts marked is found (and no more here: no two neighbours
        // outside a chain hold the same data). Chain 1: 29; chain 2: its first 10 blocks
        // ({7, 9}) and its last 10 ({7}), 9 each.
        let runs = |v: Vec<(KeyId, u32)>| -> Vec<(KeyId, bool)> {
            v.into_iter()
                .map(|(k, bits)| (k, bits & RUN_FLAG != 0))
                .collect()
        };
        assert_eq!(runs(b.run_bits()), runs(want));
        assert_eq!(b.runs(), 29 + 9 + 9);
    }

    /// Removing a key moves no other record: every key stays at the position it was created
    /// at, the table finds it there, freed slots are reused before the slab grows, and trailing
    /// free slots are given back.
    #[test]
    fn removals_move_no_record() {
        let mut s = Store::new();
        let key = |i: u64| KeyId { ks: 0, h: i };
        let mut at: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
        for i in 0..300u64 {
            at.insert(i, s.insert_key(key(i), Holder::new(1, 1, 1, 1)));
        }
        let mut x = 7u64;
        for round in 0..400u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let i = (x >> 33) % 300;
            if let Some(p) = s.find(key(i)) {
                assert!(s.remove_holder(p, 1).unwrap().1);
                assert_eq!(at.remove(&i), Some(p));
            }
            if round % 3 == 0 {
                let k = 1000 + round;
                // The removals' table entries are taken out (and trailing slots given back)
                // before the insert reuses a slot.
                s.finish_table_removals();
                let free_before = s.free.count;
                let slots_before = s.slots();
                let p = s.insert_key(key(k), Holder::new(1, 1, 1, 1));
                if free_before > 0 {
                    assert!(
                        p < slots_before,
                        "a free slot is reused before the slab grows"
                    );
                    assert_eq!(s.free.count, free_before - 1);
                }
                at.insert(k, p);
            }
            for (k, p) in &at {
                assert_eq!(s.find(key(*k)), Some(*p), "key {k} moved");
            }
            assert_eq!(s.key_count(), at.len());
            s.check_runs();
        }
        // Removing every key from the top down gives every slot back.
        let mut keys: Vec<(u32, u64)> = at.iter().map(|(k, p)| (*p, *k)).collect();
        keys.sort_unstable();
        for (i, (p, _)) in keys.iter().enumerate().rev() {
            assert!(s.remove_holder(*p, 1).unwrap().1);
            s.finish_table_removals();
            assert!(s.slots() <= *p, "trailing free slots given back");
            assert!(s.slots() as usize >= i, "live keys stay");
        }
        assert_eq!((s.key_count(), s.slots(), s.free.count), (0, 0, 0));
    }

    /// A chain stored after another chain was removed takes the freed slots side by side, in
    /// chain order, whichever order the removed chain's blocks were freed in: its blocks form
    /// one run again.
    #[test]
    fn a_chain_stored_into_freed_slots_forms_one_run() {
        for leaves_first in [true, false] {
            let mut s = Store::new();
            store_chain(&mut s, 1, 100, 7, 10);
            store_chain(&mut s, 2, 100, 7, 10);
            // Chain 2's first record also continues chain 1's last (same holder and time), which
            // no walk can tell from a run: their keys differ.
            assert_eq!(s.runs(), 2 * 99 + 1);
            let blocks: Vec<u64> = if leaves_first {
                (0..100).rev().collect()
            } else {
                (0..100).collect()
            };
            for b in blocks {
                let p = s
                    .find(KeyId {
                        ks: 1,
                        h: 1 << 32 | b,
                    })
                    .unwrap();
                assert!(s.remove_holder(p, 7).unwrap().1);
            }
            assert_eq!((s.free.count, s.slots()), (100, 200));
            store_chain(&mut s, 3, 100, 8, 20);
            assert_eq!(s.free.count, 0, "leaves first: {leaves_first}");
            assert_eq!(s.slots(), 200);
            // Freed leaves first, the slots are taken upwards from the lowest: one run. Freed
            // root first, the search for the lowest free slot stops RUN_START_SEARCH below the
            // newest: two runs.
            let runs = if leaves_first { 2 * 99 } else { 2 * 99 - 1 };
            assert_eq!(s.runs(), runs, "leaves first: {leaves_first}");
            s.check_runs();
        }
    }

    /// Whether the walk consumes chain `c`'s blocks 1..n as one run from its first record.
    fn one_run(s: &Store, c: u64, n: u64) -> bool {
        let key = |b: u64| KeyId {
            ks: 1,
            h: c << 32 | b,
        };
        let first = s.find(key(0)).expect("block 0");
        s.run_matches(first, n as usize - 1, |j| Some(key(j as u64 + 1))) == n as usize - 1
    }

    /// A holder that evicts the tail of a shared chain leaves first (as vLLM frees a request's
    /// blocks) breaks the run only where its own run now ends: each record it left continues
    /// its predecessor again once it has left that one too.
    #[test]
    fn a_tail_evicted_leaves_first_keeps_the_shared_run() {
        let mut s = Store::new();
        store_chain(&mut s, 1, 50, 7, 10);
        store_chain(&mut s, 1, 50, 8, 10);
        assert_eq!(s.runs(), 49);
        for b in (20..50u64).rev() {
            let p = s
                .find(KeyId {
                    ks: 1,
                    h: 1 << 32 | b,
                })
                .expect("block");
            assert!(!s.remove_holder(p, 8).expect("held").1);
            s.check_runs();
        }
        // Block 20 no longer continues block 19 (replica 8's run ends at 19); the rest do.
        assert_eq!(s.runs(), 48);
        assert!(!one_run(&s, 1, 50));
        assert!(one_run(&s, 1, 20));
    }

    /// A holder that evicts the head of a shared chain root first leaves records with an
    /// extra holder, which no walk from block 0 can reach: the run stays whole.
    #[test]
    fn a_head_evicted_root_first_keeps_the_shared_run() {
        let mut s = Store::new();
        store_chain(&mut s, 1, 50, 7, 10);
        store_chain(&mut s, 1, 50, 8, 10);
        for b in 0..20u64 {
            let p = s
                .find(KeyId {
                    ks: 1,
                    h: 1 << 32 | b,
                })
                .expect("block");
            assert!(!s.remove_holder(p, 8).expect("held").1);
            s.check_runs();
        }
        assert_eq!(s.runs(), 49);
        assert!(one_run(&s, 1, 50));
    }

    /// A chain's continuation stored from its parent (the blocks after those the replica
    /// holds, in an update of their own) continues the parent's record when the replica's
    /// holder there has the same tier and a time no later, and not otherwise.
    #[test]
    fn a_continuation_stored_from_its_parent_continues_it() {
        for (later_ts, joins) in [(10, true), (20, true), (5, false)] {
            let mut s = Store::new();
            store_chain(&mut s, 1, 20, 7, 10);
            store_blocks(&mut s, 1, 20..40, 7, later_ts);
            s.check_runs();
            assert_eq!(one_run(&s, 1, 40), joins, "continuation at {later_ts}");
            assert_eq!(s.runs(), if joins { 39 } else { 38 });
        }
        // Another holder of the parent that does not hold the continuation: no run.
        let mut s = Store::new();
        store_chain(&mut s, 1, 20, 7, 10);
        store_chain(&mut s, 1, 20, 8, 10);
        store_blocks(&mut s, 1, 20..40, 7, 10);
        s.check_runs();
        assert!(!one_run(&s, 1, 40));
        // It stores the continuation too: now it does.
        store_blocks(&mut s, 1, 20..40, 8, 10);
        s.check_runs();
        assert!(one_run(&s, 1, 40));
    }

    /// Stores chain `c` of `n` blocks for `replica` at time `ts` as the ingest does (one
    /// cursor over the chain's upserts).
    fn store_chain(s: &mut Store, c: u64, n: u64, replica: u32, ts: i64) {
        store_blocks(s, c, 0..n, replica, ts);
    }

    /// The jump window a lookup prefetches ends at its chunk's and the slab's last record: found
    /// positions right before a chunk boundary and at the slab's end read nothing past them
    /// (debug builds check every slab read).
    #[test]
    fn prefetch_found_reads_only_filled_records() {
        let mut s = Store::new();
        let n = CHUNK as u64 + 10;
        store_chain(&mut s, 7, n, 1, 1);
        let key = |b: u64| KeyId {
            ks: 1,
            h: 7 << 32 | b,
        };
        for b in [
            0,
            CHUNK as u64 - 2,
            CHUNK as u64 - 1,
            CHUNK as u64,
            n - 2,
            n - 1,
        ] {
            assert_eq!(
                s.find(key(b)),
                Some(b as u32),
                "a chain fills the slab in order"
            );
            s.prefetch_probe(key(b));
            s.prefetch_found(key(b));
        }
        assert_eq!(s.key_count(), n as usize);
    }

    /// Stores blocks `blocks` of chain `c` for `replica` at time `ts` in one update, as an
    /// engine reports a continuation of a chain whose prefix it already holds.
    fn store_blocks(s: &mut Store, c: u64, blocks: std::ops::Range<u64>, replica: u32, ts: i64) {
        let mut run = RunCursor::new();
        for b in blocks {
            let k = KeyId {
                ks: 1,
                h: c << 32 | b,
            };
            let h = Holder::new(replica, 1, b as i32, ts);
            let (pos, created) = s.find_or_insert(k, h, run.last());
            if !created {
                match s.find_or_add_holder(pos, h, usize::MAX) {
                    HolderUpsert::Existing(at) => s.holder_mut(at).set_last_seen(ts),
                    HolderUpsert::Added => {}
                    HolderUpsert::Full => unreachable!("no bound"),
                }
            }
            s.note_upsert(&mut run, pos, replica, created, true);
        }
        s.end_run(run);
    }

    /// The run bits stay exact through removals, chains stored over each other and into freed
    /// slots, and partial re-stores; the chains of one holder set are runs.
    #[test]
    fn run_bits_stay_exact_through_removals_and_reuse() {
        let mut s = Store::new();
        // Each chain at its own time: a record moved next to another chain differs from it.
        for c in 0..6u64 {
            store_chain(&mut s, c, 30, 1, 10 * c as i64);
            store_chain(&mut s, c, 30, 2, 10 * c as i64);
        }
        s.check_runs();
        // Each chain's first record also continues the chain stored before it in the slab (the
        // same holders at a later time), which no walk can tell from a run: their keys differ.
        assert_eq!(
            s.runs(),
            6 * 29 + 5,
            "each chain is one run after its first block"
        );
        // A key inside chain 0's run goes: its successor no longer continues anything.
        for r in [1, 2] {
            s.remove_holder(s.find(KeyId { ks: 1, h: 10 }).expect("key"), r);
        }
        s.check_runs();
        let mut x = 11u64;
        for round in 0..300u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (c, b, r) = ((x >> 33) % 8, (x >> 40) % 30, 1 + (x >> 50) % 3);
            if round % 7 == 0 {
                store_chain(&mut s, c, b + 1, r as u32, 10 + round as i64 % 3);
            } else if let Some(p) = s.find(KeyId {
                ks: 1,
                h: c << 32 | b,
            }) {
                s.remove_holder(p, r as u32);
            }
            s.check_runs();
        }
        assert!(s.free.count > 0, "no freed slot was left to reuse");
    }

    /// Removed keys' table entries wait for their batch (`table_removals`): meanwhile no probe
    /// finds them, and a table that must grow first takes them out. Here one segment's table
    /// grows while two of its keys are removed: growing reads every entry's key from the slab,
    /// and a waiting entry's slot is free, so without the batch finished first the table would
    /// keep an entry under a free record's words and the batch would then miss it.
    #[test]
    fn a_table_grows_only_after_the_removals_waiting_for_it() {
        let mut s = Store::new();
        // Keys of one segment, so that its table is the one that fills.
        let hasher = s.hasher;
        let segment = |h: u64| Store::segment(hasher.hash_key(KeyId { ks: 3, h }));
        let target = segment(0);
        let mut ours = (0u64..).filter(|&h| segment(h) == target);
        let mut held: Vec<(u64, u32)> = Vec::new();
        for _ in 0..11 {
            let h = ours.next().expect("unbounded");
            held.push((h, s.insert_key(KeyId { ks: 3, h }, Holder::new(1, 1, 1, 1))));
        }
        let capacity = s.table[target].capacity();
        for _ in 0..2 {
            let (h, p) = held.remove(0);
            assert!(s.remove_holder(p, 1).expect("held").1);
            assert_eq!(
                s.find(KeyId { ks: 3, h }),
                None,
                "a removed key is not found"
            );
        }
        assert_eq!(
            s.table_removals.len(),
            2,
            "the removals wait for their batch"
        );
        // Fill the table past its growth point.
        while s.table[target].capacity() == capacity {
            let h = ours.next().expect("unbounded");
            held.push((h, s.insert_key(KeyId { ks: 3, h }, Holder::new(1, 1, 1, 1))));
        }
        assert!(s.table_removals.is_empty());
        assert_eq!(s.table[target].len(), held.len(), "no entry of a free slot");
        for &(h, p) in &held {
            assert_eq!(s.find(KeyId { ks: 3, h }), Some(p));
        }
        // A full batch is taken out by the removal that fills it.
        for (h, p) in held {
            assert!(s.remove_holder(p, 1).expect("held").1);
            assert_eq!(s.find(KeyId { ks: 3, h }), None);
            assert!(s.table_removals.len() < TABLE_REMOVAL_BATCH);
        }
        s.finish_table_removals();
        assert_eq!((s.table[target].len(), s.key_count(), s.slots()), (0, 0, 0));
    }

    /// Keys with little entropy, or all of it in a few bits (a producer's sequential ids, hashes
    /// truncated and shifted), still spread evenly over the segments and over each table's
    /// buckets: the keyed hash mixes every key bit into every bit the tables use. An identity
    /// hash fails each pattern: sequential words and words whose middle bits vary share one
    /// segment, words shifted left share one bucket, and one hash word in many keyspaces both.
    #[test]
    fn low_entropy_keys_spread_over_segments_and_buckets() {
        let n = 50_000u64;
        type Pattern = (&'static str, fn(u64) -> KeyId);
        let patterns: [Pattern; 4] = [
            ("sequential", |i| KeyId { ks: 1, h: i }),
            ("shifted left", |i| KeyId { ks: 1, h: i << 44 }),
            ("middle bits", |i| KeyId { ks: 1, h: i << 20 }),
            ("one hash, many keyspaces", |i| KeyId {
                ks: i as u32,
                h: 42,
            }),
        ];
        // Each store draws its own seeds: several, so that a hash weak for some seeds fails.
        for (name, key) in patterns.into_iter().flat_map(|p| [p; 8]) {
            let mut s = Store::new();
            for i in 0..n {
                s.insert_key(key(i), Holder::new(1, 1, 1, 1));
            }
            let largest = s.table.iter().map(PosTable::len).max().unwrap_or(0);
            assert!(
                largest <= 4 * n as usize / SEGMENTS,
                "{name}: largest segment {largest} keys"
            );
            let (keys, hasher) = (&s.keys, &s.hasher);
            let displaced: usize = (s.table.iter())
                .map(|t| t.total_displacement(|p| hasher.hash_key(keys.key(p))))
                .sum();
            let mean = displaced as f64 / n as f64;
            // Linear probing at a load of at most 3/4 averages under 1.5 buckets past home.
            assert!(mean < 3.0, "{name}: {mean:.2} buckets past home on average");
        }
    }

    /// Inserts `k`; returns how many keys a grow or tombstone rehash of its table moved (the
    /// table's keys when its capacity rose, else 0).
    fn insert_moved(s: &mut Store, k: KeyId) -> usize {
        let seg = Store::segment(s.hasher.hash_key(k));
        let before = s.table[seg].capacity();
        s.insert_key(k, Holder::new(1, 1, 1, 1));
        if s.table[seg].capacity() > before {
            s.table[seg].len()
        } else {
            0
        }
    }

    /// No insert moves more than a segment's share of the keys (growth while filling, and the
    /// rehash of tombstones under constant insert + remove at a high load), and the hash bits
    /// spread the keys evenly over the segments. With one table, an insert moved every key.
    #[test]
    fn an_insert_moves_at_most_one_segment_of_keys() {
        let mut s = Store::new();
        let n = 150_000u64;
        // Hash-like key words, as block hashes are.
        let key = |i: u64| KeyId {
            ks: 3,
            h: i.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        };
        let mut worst = 0;
        for i in 0..n {
            worst = worst.max(insert_moved(&mut s, key(i)));
        }
        for i in 0..2 * n {
            let p = s.find(key(i)).expect("key");
            assert!(s.remove_holder(p, 1).unwrap().1);
            worst = worst.max(insert_moved(&mut s, key(n + i)));
        }
        // n / SEGMENTS ≈ 37 keys per segment (the fullest of 4096 usually holds 50–70; the
        // hasher's seed is random per process); a single table moved all 150,000.
        let bound = 4 * n as usize / SEGMENTS;
        let largest = s.table.iter().map(PosTable::len).max().unwrap_or(0);
        assert!(largest <= bound, "largest segment {largest} keys");
        assert!(worst <= bound.min(1_000), "one insert moved {worst} keys");
        assert!(worst > 0, "no grow or rehash was exercised");
        for i in 2 * n..3 * n {
            assert_eq!(s.key_at(s.find(key(i)).expect("key")), key(i));
        }
    }

    /// `find_after` answers as `find` does, whether the key is the neighbour of `prev`, elsewhere,
    /// absent, or `prev` is NIL or the last record (also after removals reorder the slab).
    #[test]
    fn find_after_agrees_with_find() {
        let mut s = Store::new();
        let key = |i: u64| KeyId { ks: 1, h: i };
        for i in 0..64u64 {
            s.insert_key(key(i), Holder::new(1, 1, 1, 1));
        }
        for i in (0..64u64).step_by(5) {
            let p = s.find(key(i)).expect("key");
            assert!(s.remove_holder(p, 1).unwrap().1);
        }
        let last = s.key_count() as u32 - 1;
        for i in 0..70u64 {
            let want = s.find(key(i));
            for prev in [NIL, 0, 3, last, want.map_or(NIL, |p| p.wrapping_sub(1))] {
                assert_eq!(s.find_after(prev, key(i)), want, "key {i} after {prev}");
            }
        }
        let p = s.find(key(1)).expect("key");
        assert_eq!(s.find_after(p - 1, key(1)), Some(p));
    }

    /// `find_near` answers as `find` does while chains are removed leaves first (the key is
    /// then next to the last removal), in other orders, under a sliced scan's visited mark
    /// (which changes which record fills a hole), and for absent keys; and every removal keeps
    /// the table pointing at every record (the moved record's slot looked up ahead of time).
    #[test]
    fn find_near_agrees_with_find() {
        let mut s = Store::new();
        let key = |i: u64| KeyId { ks: 2, h: i };
        for i in 0..600u64 {
            let p = s.insert_key(key(i), Holder::new(1, 1, 1, 1));
            if i % 7 == 0 {
                s.add_holder(p, Holder::new(2, 1, 1, 1));
            }
        }
        let check = |s: &Store| {
            for i in 0..610u64 {
                assert_eq!(s.find_near(key(i)), s.find(key(i)), "key {i}");
            }
            for p in 0..s.slots() {
                if let Some(k) = s.live_key_at(p) {
                    assert_eq!(s.find(k), Some(p));
                }
            }
        };
        let mut near_hits = 0;
        // Chains of 20 keys removed leaves first; a visited mark half way through.
        for (round, chain) in (0..600u64).step_by(20).enumerate() {
            if round == 10 {
                s.set_visited(s.key_count() as u32 / 2);
            }
            let order: Vec<u64> = if round % 3 == 2 {
                (chain..chain + 20).collect()
            } else {
                (chain..chain + 20).rev().collect()
            };
            for i in order {
                let want = s.find(key(i));
                let got = s.find_near(key(i));
                assert_eq!(got, want, "key {i}");
                let n = s.near;
                if want.is_some_and(|p| p.wrapping_add(1) == n || p == n.wrapping_add(1)) {
                    near_hits += 1;
                }
                for r in [1, 2] {
                    if let Some(p) = s.find_near(key(i)) {
                        s.remove_holder(p, r);
                    }
                }
            }
            check(&s);
        }
        assert_eq!(s.key_count(), 0);
        assert!(
            near_hits > 300,
            "the neighbour was tried first: {near_hits}"
        );
    }

    fn reps(s: &Store, p: u32) -> Vec<u32> {
        let mut v: Vec<u32> = s.holders(p).map(|(_, h)| h.replica()).collect();
        v.sort();
        v
    }

    /// A key held by many replicas moves to a wide set; every holder stays findable and
    /// removable, whichever position it is removed from.
    #[test]
    fn wide_keys_find_add_and_remove_every_holder() {
        let mut s = Store::new();
        let k = KeyId { ks: 1, h: 9 };
        let p = s.insert_key(k, Holder::new(0, 1, 0, 0));
        let n = 200u32;
        for r in 1..n {
            let got = s.find_or_add_holder(p, Holder::new(r, 1, r as i32, 0), usize::MAX);
            assert_eq!(got, HolderUpsert::Added);
        }
        assert_eq!(s.holder_count(p), n as usize);
        assert_eq!(s.entry_count(), n as usize);
        assert_eq!(s.overflow_holders(), n as usize - 1);
        for r in 0..n {
            let at = s.find_holder(p, r).expect("holder");
            assert_eq!(s.holder(at).replica(), r);
            assert_eq!(s.holder(at).tokens, r as i32);
            let again = s.find_or_add_holder(p, Holder::new(r, 1, 0, 0), usize::MAX);
            assert_eq!(again, HolderUpsert::Existing(at));
        }
        // Remove the inline holder, then from the middle, then everything.
        assert!(!s.remove_holder(p, 0).unwrap().1);
        assert!(s.find_holder(p, 0).is_none());
        assert!(!s.remove_holder(p, 100).unwrap().1);
        assert_eq!(reps(&s, p).len(), n as usize - 2);
        let mut left = reps(&s, p);
        while let Some(r) = left.pop() {
            let (h, gone) = s.remove_holder(p, r).unwrap();
            assert_eq!(h.replica(), r);
            assert_eq!(gone, left.is_empty());
            if !gone {
                assert_eq!(reps(&s, p), left);
            }
        }
        assert_eq!(s.key_count(), 0);
        assert_eq!(s.entry_count(), 0);
        assert_eq!(s.overflow_holders(), 0);
    }

    /// Finding, adding and removing one holder of a key with many holders examines a bounded
    /// number of holders (at most the overflow chain's [`CHAIN_MAX`]), not all of them: ingest
    /// of a hot key costs O(1) per message, not O(holders).
    #[test]
    fn holder_upsert_work_does_not_grow_with_holders() {
        let mut s = Store::new();
        let k = KeyId { ks: 0, h: 7 };
        let p = s.insert_key(k, Holder::new(0, 1, 0, 0));
        let n = 20_000u32;
        let mut worst = 0;
        for r in 1..n {
            let before = s.probes.get();
            s.find_or_add_holder(p, Holder::new(r, 1, 0, 0), usize::MAX);
            assert!(s.find_holder(p, r).is_some());
            assert!(s.find_holder(p, r / 2).is_some());
            worst = worst.max(s.probes.get() - before);
        }
        for r in (1..n).step_by(3) {
            let before = s.probes.get();
            s.remove_holder(p, r).unwrap();
            worst = worst.max(s.probes.get() - before);
        }
        assert!(
            worst <= 3 * CHAIN_MAX as u64,
            "{worst} holders examined by one operation"
        );
    }

    /// A key refuses a new holder at the bound (chain and wide forms alike) and still updates
    /// the holders it has.
    #[test]
    fn holders_per_key_are_bounded() {
        for max in [3usize, CHAIN_MAX + 1, CHAIN_MAX + 2, 50] {
            let mut s = Store::new();
            let k = KeyId { ks: 0, h: 1 };
            let p = s.insert_key(k, Holder::new(0, 1, 0, 0));
            for r in 1..max as u32 {
                let got = s.find_or_add_holder(p, Holder::new(r, 1, 0, 0), max);
                assert_eq!(got, HolderUpsert::Added, "max {max}, replica {r}");
            }
            let full = s.find_or_add_holder(p, Holder::new(max as u32, 1, 0, 0), max);
            assert_eq!(full, HolderUpsert::Full, "max {max}");
            assert_eq!(s.holder_count(p), max);
            let known = s.find_or_add_holder(p, Holder::new(1, 1, 0, 0), max);
            assert!(matches!(known, HolderUpsert::Existing(_)));
            // Room again after a removal.
            s.remove_holder(p, 0).unwrap();
            let got = s.find_or_add_holder(p, Holder::new(max as u32, 1, 0, 0), max);
            assert_eq!(got, HolderUpsert::Added);
        }
    }
}
