//! The prefix map's storage, seen as (key, replica) entries: the run store
//! ([`crate::runstore`]) under the index's key identities, holder values and limits.
//!
//! Chains are kept as *runs* of consecutive blocks with each replica's stretch of a run as one
//! *extent* (one tier, one `last_seen`, token counts as a start and a step): a long chain held
//! by many replicas costs a few records, not one per (block, holder), and a lookup walks it one
//! extent per run (perf/runs/2026-12-07-run-census.md). A held key keeps its place ([`Loc`])
//! while it is held, so a place names its key until the key's last entry goes; everything
//! that must survive a key's removal names it by its [`KeyId`].
//!
//! LFU counts live in a side table filled only for LFU tenants' entries (docs/BEHAVIOUR.md
//! §7.4): a store without LFU tenants does no LFU work.

use crate::runstore::{Entry, Hint, Refused, RunStore, Upserted};

pub(crate) use crate::runstore::{Loc, Scan};

/// "No id" marker for replica and link fields.
pub(crate) const NIL: u32 = u32::MAX;
/// Top bit of [`KeyId::ks`]: the hash word is a blob id, not an inline 8-byte hash.
pub(crate) const BLOB_FLAG: u32 = 1 << 31;
/// Keyspace ids stay below this (bits 29 and 30 of a key's `ks` word are kept free, as the
/// keyspace table's limit has always been).
pub(crate) const KEYSPACE_LIMIT: u32 = (1 << 29) - 1;
/// Replica ids fit 24 bits (interned names, `intern::MAX_STRINGS`).
pub(crate) const REPLICA_MASK: u32 = (1 << 24) - 1;

/// Places a sliced pass looks at in one [`Store::scan`] before it checks its budget again; a
/// stretch of places without a key is charged as this much work, so a slice over a store of
/// mostly empty places stays bounded too.
pub(crate) const PLACES_PER_STEP: usize = 64;

/// The place before every key: where a pass over every key starts.
pub(crate) const FIRST: Loc = Loc { run: 0, off: 0 };

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

/// One (key, replica) entry's values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Holder {
    replica: u32,
    tier: u8,
    last_seen: i64,
    /// Stored token count (cumulative for chain blocks).
    pub tokens: i32,
    /// LFU delivered-lookup counter (saturating; never reset by a refresh).
    pub access: u32,
}

impl Holder {
    /// A fresh entry with access count 0.
    pub fn new(replica: u32, tier: u8, tokens: i32, last_seen: i64) -> Holder {
        debug_assert!(replica <= REPLICA_MASK);
        Holder {
            replica,
            tier,
            last_seen,
            tokens,
            access: 0,
        }
    }
    /// Replica id.
    pub fn replica(&self) -> u32 {
        self.replica
    }
    /// Stored tier.
    pub fn tier(&self) -> u8 {
        self.tier
    }
    /// `last_seen` in unix ns.
    pub fn last_seen(&self) -> i64 {
        self.last_seen
    }
    fn entry(&self) -> Entry {
        Entry {
            replica: self.replica,
            tier: self.tier,
            last_seen: self.last_seen,
            tokens: self.tokens,
        }
    }
    fn of(e: Entry, access: u32) -> Holder {
        Holder {
            replica: e.replica,
            tier: e.tier,
            last_seen: e.last_seen,
            tokens: e.tokens,
            access,
        }
    }
}

/// What [`Store::upsert`] did with an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HolderUpsert {
    /// The key was created with this entry as its only holder.
    Created(Loc),
    /// The replica held the key already; its entry was overwritten (its LFU count kept).
    Refreshed(Loc),
    /// The entry was added to a key held by other replicas.
    Added(Loc),
    /// The key already has the maximum number of holders; nothing changed.
    Full,
    /// A new key did not fit the store's table ([`crate::runstore::MAX_KEYS`]); nothing changed.
    TableFull,
    /// The replica has its most extents in the key's run
    /// ([`crate::runstore::MAX_REPLICA_EXTENTS`]) and the upsert needed another; nothing
    /// changed.
    ExtentsFull,
}

/// A chain's upserts in order: the place of its last block (a new block is placed after it,
/// extending its run) and the extent it wrote (the next block's upsert tries it first).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ChainCursor {
    last: Option<Loc>,
    hint: Hint,
}

impl ChainCursor {
    /// A cursor before a chain's first upsert.
    pub fn new() -> ChainCursor {
        ChainCursor::default()
    }
}

/// The storage (see the module docs).
pub(crate) struct Store {
    runs: RunStore,
    /// The place of the last removal, where [`Store::find_near`] looks first.
    near: Loc,
    /// Where the sliced sweep in progress continues ([`FIRST`] when none is in progress).
    sweep: Loc,
}

impl Store {
    pub fn new() -> Store {
        Store::with_runs(RunStore::new())
    }

    /// A store whose table segments hold at most `n` keys each (tests of the full table).
    pub fn with_segment_keys(n: usize) -> Store {
        Store::with_runs(RunStore::with_segment_keys(n))
    }

    fn with_runs(runs: RunStore) -> Store {
        Store {
            runs,
            near: FIRST,
            sweep: FIRST,
        }
    }

    /// Number of prefix keys.
    pub fn key_count(&self) -> usize {
        self.runs.key_count()
    }

    /// Number of storage entries (key, replica).
    pub fn entry_count(&self) -> usize {
        self.runs.entry_count()
    }

    /// Heap bytes of the storage.
    pub fn heap_bytes(&self) -> usize {
        self.runs.heap_bytes()
    }

    /// Where the sliced sweep in progress continues: keys before it were visited ([`FIRST`]
    /// when no sweep is in progress).
    pub fn sweep_cursor(&self) -> Loc {
        self.sweep
    }

    /// Marks the keys before `loc` visited by the sliced sweep ([`FIRST`] ends it). A held key
    /// keeps its place, so a sweep that resumes there visits every key held throughout once.
    pub fn set_sweep_cursor(&mut self, loc: Loc) {
        self.sweep = loc;
    }

    /// The next held key at or after `from`, looking at most at `max_steps` places (see
    /// [`RunStore::scan`]).
    #[inline]
    pub fn scan(&self, from: Loc, max_steps: usize) -> Scan {
        self.runs.scan(from, max_steps)
    }

    /// The place right after `loc` in the order of [`Store::scan`].
    #[inline]
    pub fn after(loc: Loc) -> Loc {
        RunStore::after(loc)
    }

    /// Every held key's place, in scan order (not sliced: tests, debugging and one-go passes).
    pub fn places(&self) -> impl Iterator<Item = Loc> + '_ {
        let mut at = FIRST;
        std::iter::from_fn(move || match self.scan(at, usize::MAX) {
            Scan::Held(loc) => {
                at = Self::after(loc);
                Some(loc)
            }
            Scan::Paused(_) | Scan::End => None,
        })
    }

    /// The place of a key.
    #[inline]
    pub fn find(&self, k: KeyId) -> Option<Loc> {
        self.runs.find(k.ks, k.h)
    }

    /// The place of a key about to lose a holder: first the places beside the last removal's,
    /// then the table. Engines evict a chain leaves first, one event per block, and a chain's
    /// blocks lie side by side in a run, so the next key removed is usually right before the
    /// last: a comparison in cache instead of a table probe (two or three cache misses on a
    /// large index). The key is compared whole, so the answer is exactly [`Store::find`]'s.
    #[inline(always)]
    pub fn find_near(&self, k: KeyId) -> Option<Loc> {
        let n = self.near;
        let before = n.off.checked_sub(1).map(|off| Loc { run: n.run, off });
        (before.and_then(|at| self.runs.held_at(at, k.ks, k.h)))
            .or_else(|| self.runs.held_at(Self::after(n), k.ks, k.h))
            .or_else(|| self.find(k))
    }

    /// Starts loading the table bucket [`Store::find`] of `k` reads first.
    #[inline]
    pub fn prefetch(&self, k: KeyId) {
        self.runs.prefetch(k.ks, k.h);
    }

    /// The key at a held key's place.
    #[inline]
    pub fn key_at(&self, loc: Loc) -> KeyId {
        let (ks, h) = self.runs.key_at(loc);
        KeyId { ks, h }
    }

    /// The holders of the key at `loc`, by replica id.
    #[inline]
    pub fn holders(&self, loc: Loc) -> impl Iterator<Item = Holder> + '_ {
        self.holders_from(loc, 0)
    }

    /// The holders of the key at `loc` without their LFU counts (0): for passes that read
    /// only times, tiers and counts.
    #[inline]
    pub fn holders_uncounted(&self, loc: Loc) -> impl Iterator<Item = Holder> + '_ {
        (self.runs.entries_at(loc)).map(|e| Holder::of(e, 0))
    }

    /// The holders of the key at `loc` of replicas `first_replica` and up, by replica.
    pub fn holders_from(&self, loc: Loc, first_replica: u32) -> impl Iterator<Item = Holder> + '_ {
        (self.runs.counted_entries_from(loc, first_replica)).map(|(e, n)| Holder::of(e, n))
    }

    /// `replica`'s entry of the key at `loc`.
    pub fn holder_of(&self, loc: Loc, replica: u32) -> Option<Holder> {
        let e = self.runs.entries_at(loc).find(|e| e.replica == replica)?;
        Some(Holder::of(e, self.runs.access(loc, replica)))
    }

    /// Number of holders of the key at `loc`.
    #[cfg(test)]
    pub fn holder_count(&self, loc: Loc) -> usize {
        self.runs.holder_count(loc)
    }

    /// Upserts `holder` (its values; a refresh keeps the entry's LFU count) for key `k`, the
    /// block after `chain`'s last upsert in its chain (a new key is placed after it). A
    /// replica's entry added to a key that has `max_holders` holders already is refused.
    #[inline]
    pub fn upsert(
        &mut self,
        chain: &mut ChainCursor,
        k: KeyId,
        holder: Holder,
        max_holders: usize,
    ) -> HolderUpsert {
        let e = holder.entry();
        let upserted =
            (self.runs).upsert_bounded(k.ks, k.h, chain.last, e, max_holders, &mut chain.hint);
        match upserted {
            Ok((loc, how)) => {
                chain.last = Some(loc);
                match how {
                    Upserted::CreatedKey => HolderUpsert::Created(loc),
                    Upserted::AddedEntry => HolderUpsert::Added(loc),
                    Upserted::Refreshed => HolderUpsert::Refreshed(loc),
                }
            }
            Err(why @ (Refused::HoldersFull | Refused::ExtentsFull)) => {
                // The chain goes on after the refused block: it is held.
                chain.last = self.runs.find(k.ks, k.h);
                chain.hint = Hint::default();
                if why == Refused::HoldersFull {
                    HolderUpsert::Full
                } else {
                    HolderUpsert::ExtentsFull
                }
            }
            Err(Refused::TableFull) => {
                chain.last = None;
                chain.hint = Hint::default();
                HolderUpsert::TableFull
            }
        }
    }

    /// Sets the LFU count of `replica`'s entry of the key at `loc`; false when it has none.
    pub fn set_access(&mut self, loc: Loc, replica: u32, count: u32) -> bool {
        self.runs.set_access(loc, replica, count)
    }

    /// Removes `replica`'s entry of the key at `loc`. Returns the entry and whether the key is
    /// gone with it, or None when the replica held no entry there.
    #[inline]
    pub fn remove_holder(&mut self, loc: Loc, replica: u32) -> Option<(Holder, bool)> {
        let r = self.runs.release_at(loc, replica)?;
        self.near = loc;
        Some((Holder::of(r.entry, r.access), r.key_gone))
    }

    /// Whether a removal took out entries besides its own ([`Store::take_dropped`]).
    #[inline(always)]
    pub fn has_dropped(&self) -> bool {
        self.runs.has_dropped()
    }

    /// The entries removals took out besides their own (see
    /// [`crate::runstore::MAX_REPLICA_EXTENTS`]), for the caller to count.
    pub fn take_dropped(&mut self) -> std::vec::Drain<'_, crate::runstore::Dropped> {
        self.runs.take_dropped()
    }

    /// The run store, for the chain walk of a lookup.
    #[inline]
    pub fn runs(&self) -> &RunStore {
        &self.runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(h: u64) -> KeyId {
        KeyId { ks: 3, h }
    }

    /// A refresh overwrites an entry's values and keeps its LFU count; a removal reports the
    /// key gone with its last entry.
    #[test]
    fn refresh_keeps_the_count_and_the_last_removal_takes_the_key() {
        let mut s = Store::new();
        let mut c = ChainCursor::new();
        let HolderUpsert::Created(loc) = s.upsert(&mut c, key(1), Holder::new(4, 1, 16, 10), 8)
        else {
            panic!("created");
        };
        assert!(s.set_access(loc, 4, 7));
        let refreshed = s.upsert(
            &mut ChainCursor::new(),
            key(1),
            Holder::new(4, 2, 16, 20),
            8,
        );
        assert_eq!(refreshed, HolderUpsert::Refreshed(loc));
        let h = s.holder_of(loc, 4).expect("held");
        assert_eq!((h.tier(), h.last_seen(), h.access), (2, 20, 7));
        let added = s.upsert(
            &mut ChainCursor::new(),
            key(1),
            Holder::new(5, 1, 16, 20),
            8,
        );
        assert_eq!(added, HolderUpsert::Added(loc));
        assert_eq!(
            s.remove_holder(loc, 4).map(|(h, gone)| (h.access, gone)),
            Some((7, false))
        );
        assert_eq!(s.remove_holder(loc, 5).map(|(_, gone)| gone), Some(true));
        assert_eq!((s.key_count(), s.entry_count()), (0, 0));
    }

    /// A key with `max` holders refuses another replica, not a refresh of one of them.
    #[test]
    fn a_full_key_refuses_a_new_holder() {
        let mut s = Store::new();
        for r in 0..3 {
            let up = s.upsert(&mut ChainCursor::new(), key(9), Holder::new(r, 1, 16, 5), 3);
            assert!(matches!(
                up,
                HolderUpsert::Created(_) | HolderUpsert::Added(_)
            ));
        }
        let refused = s.upsert(&mut ChainCursor::new(), key(9), Holder::new(7, 1, 16, 5), 3);
        assert_eq!(refused, HolderUpsert::Full);
        let again = s.upsert(&mut ChainCursor::new(), key(9), Holder::new(1, 1, 16, 6), 3);
        assert!(matches!(again, HolderUpsert::Refreshed(_)));
        assert_eq!(s.holder_count(s.find(key(9)).unwrap()), 3);
    }
}
