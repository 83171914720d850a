//! The key table of one store segment: slab positions by key hash, in one array of 4-byte
//! entries (a 6-bit hash tag beside a 26-bit position), probed linearly.
//!
//! Why not hashbrown's `HashTable<u32>`: a SwissTable keeps its control bytes and its slots at
//! opposite ends of one allocation, so every probe is two dependent cache misses (the control
//! group, then the slot) before the key record's own, and removing a key (found without a probe
//! beside the previous removal) is those two misses alone: 26% of the event path's time on the
//! Mooncake trace (perf/runs/2026-12-06-pos-table.md). Here the tag and the position share the
//! entry: a removal is one line, a lookup one line and the record. Memory per key is about the
//! same (4 bytes per bucket at most 3/4 full, against 5 bytes at most 7/8).
//!
//! Removal leaves a tombstone unless the next bucket is empty (then the run of tombstones
//! before it empties too); tombstones count towards the load, and a table that reaches it
//! rehashes in place (or doubles when half its buckets are live), reading each live entry's
//! key record for its hash: the store's segments keep that to a small share of the keys.

/// Bits of an entry holding the slab position.
const POS_BITS: u32 = 26;
const POS_MASK: u32 = (1 << POS_BITS) - 1;
/// An empty bucket (tag 63, position `POS_MASK`).
const EMPTY: u32 = u32::MAX;
/// A bucket whose entry was removed (tag 63, position `POS_MASK - 1`).
const TOMB: u32 = u32::MAX - 1;
/// Positions stay below this: the two largest, under the largest tag, mark empty and removed
/// buckets. 67,108,862 key records per core (2.4 GB of records).
pub(crate) const MAX_POSITIONS: u32 = POS_MASK - 1;
/// Buckets of a table's first allocation.
const MIN_BUCKETS: usize = 16;
/// Below this many buckets a full table grows fourfold, not twofold: a filling index rehashes
/// each of its keys about once while its segments double from [`MIN_BUCKETS`] (reading every
/// key record back for its hash: ~10% of a stored block's instructions on the Mooncake
/// trace), and fourfold growth skips every other step of that (16 → 64 → 256 buckets). The
/// memory it costs is bounded: a table of 13–24 keys holds 64 buckets instead of 32, one of
/// 49–96 keys 256 instead of 128, any other as many as with doubling; at most 512 bytes more
/// per table (2 MiB per core over the store's 4,096 segments), none from 97 keys per table on.
const SMALL_TABLE_BUCKETS: usize = 256;

/// The 6-bit tag of a hash (its top bits; the bucket comes from the low bits, the store's
/// segment from bits in between).
#[inline(always)]
fn tag(h: u64) -> u32 {
    (h >> 58) as u32
}

#[inline(always)]
fn entry(h: u64, pos: u32) -> u32 {
    debug_assert!(pos < MAX_POSITIONS);
    tag(h) << POS_BITS | pos
}

/// Where a new entry goes ([`PosTable::find_or_vacant`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Vacant {
    at: usize,
    tomb: bool,
}

/// Slab positions by key hash (see the module docs).
#[derive(Default)]
pub(crate) struct PosTable {
    buckets: Vec<u32>,
    live: usize,
    tombs: usize,
}

impl PosTable {
    /// Number of positions held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.live
    }

    /// Number of buckets.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.buckets.len()
    }

    /// The sum over the live entries of how far each sits past its home bucket (`hash_of`
    /// gives an entry's hash): what a hash that clusters keys makes every probe walk.
    #[cfg(test)]
    pub fn total_displacement(&self, hash_of: impl Fn(u32) -> u64) -> usize {
        let mask = self.buckets.len().wrapping_sub(1);
        (self.buckets.iter().enumerate())
            .filter(|(_, e)| **e != EMPTY && **e != TOMB)
            .map(|(i, e)| i.wrapping_sub(hash_of(e & POS_MASK) as usize) & mask)
            .sum()
    }

    /// Heap bytes.
    pub fn allocation_size(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<u32>()
    }

    #[inline(always)]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    /// Starts loading the bucket a probe for `h` reads first.
    #[inline(always)]
    pub fn prefetch(&self, h: u64) {
        if let Some(b) = self
            .buckets
            .get(h as usize & self.buckets.len().wrapping_sub(1))
        {
            crate::prefetch::prefetch(b);
        }
    }

    /// The position stored under `h` for which `eq` holds.
    #[inline]
    pub fn find(&self, h: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.buckets.is_empty() {
            return None;
        }
        let (mask, t) = (self.mask(), tag(h));
        let mut i = h as usize & mask;
        loop {
            let e = self.buckets[i];
            if e == EMPTY {
                return None;
            }
            if e >> POS_BITS == t && e != TOMB && eq(e & POS_MASK) {
                return Some(e & POS_MASK);
            }
            i = (i + 1) & mask;
        }
    }

    /// Makes room for one more entry (a rehash when the load would pass 3/4): call before
    /// [`PosTable::find_or_vacant`] when it may be followed by [`PosTable::fill`]. `hash_of`
    /// gives the hash of a stored position.
    #[inline]
    pub fn reserve_one(&mut self, hash_of: impl Fn(u32) -> u64) {
        if (self.live + self.tombs + 1) * 4 > self.buckets.len() * 3 {
            self.grow(hash_of);
        }
    }

    /// The position stored under `h` for which `eq` holds, or the bucket a new entry under `h`
    /// goes to (the first removed one on its probe sequence, else the empty one that ends it).
    /// After [`PosTable::reserve_one`].
    #[inline]
    pub fn find_or_vacant(&self, h: u64, mut eq: impl FnMut(u32) -> bool) -> Result<u32, Vacant> {
        debug_assert!(!self.buckets.is_empty(), "reserve_one first");
        let (mask, t) = (self.mask(), tag(h));
        let mut i = h as usize & mask;
        let mut tomb = None;
        loop {
            let e = self.buckets[i];
            if e == EMPTY {
                break;
            }
            if e == TOMB {
                tomb.get_or_insert(i);
            } else if e >> POS_BITS == t && eq(e & POS_MASK) {
                return Ok(e & POS_MASK);
            }
            i = (i + 1) & mask;
        }
        Err(match tomb {
            Some(at) => Vacant { at, tomb: true },
            None => Vacant { at: i, tomb: false },
        })
    }

    /// Stores `pos` under `h` in the bucket [`PosTable::find_or_vacant`] gave, with no change
    /// to the table in between.
    #[inline]
    pub fn fill(&mut self, v: Vacant, h: u64, pos: u32) {
        debug_assert!(matches!(self.buckets[v.at], EMPTY | TOMB));
        self.buckets[v.at] = entry(h, pos);
        self.live += 1;
        if v.tomb {
            self.tombs -= 1;
        }
    }

    /// Stores `pos` under `h` (it must not be stored yet; tests).
    #[cfg(test)]
    pub fn insert(&mut self, h: u64, pos: u32, hash_of: impl Fn(u32) -> u64) {
        self.reserve_one(hash_of);
        let v = self.find_or_vacant(h, |_| false).expect_err("absent");
        self.fill(v, h, pos);
    }

    /// Removes the entry of `pos` stored under `h`. Returns whether there was one.
    #[inline]
    pub fn remove(&mut self, h: u64, pos: u32) -> bool {
        if self.buckets.is_empty() {
            return false;
        }
        let (mask, want) = (self.mask(), entry(h, pos));
        let mut i = h as usize & mask;
        loop {
            let e = self.buckets[i];
            if e == EMPTY {
                return false;
            }
            if e == want {
                break;
            }
            i = (i + 1) & mask;
        }
        self.live -= 1;
        if self.buckets[(i + 1) & mask] != EMPTY {
            self.buckets[i] = TOMB;
            self.tombs += 1;
            return true;
        }
        // The probe sequences that pass `i` end here: it and the tombstones before it empty.
        self.buckets[i] = EMPTY;
        let mut j = i.wrapping_sub(1) & mask;
        while self.buckets[j] == TOMB {
            self.buckets[j] = EMPTY;
            self.tombs -= 1;
            j = j.wrapping_sub(1) & mask;
        }
        true
    }

    /// Rehashes into twice the buckets (four times below [`SMALL_TABLE_BUCKETS`]) when at
    /// least half are live, else into as many (the tombstones go). Reads every live entry's
    /// hash.
    #[cold]
    fn grow(&mut self, hash_of: impl Fn(u32) -> u64) {
        let n = self.buckets.len();
        let size = if n == 0 {
            MIN_BUCKETS
        } else if self.live * 2 >= n {
            if n < SMALL_TABLE_BUCKETS {
                n * 4
            } else {
                n * 2
            }
        } else {
            n
        };
        let old = std::mem::replace(&mut self.buckets, vec![EMPTY; size]);
        let mask = size - 1;
        for e in old {
            if e == EMPTY || e == TOMB {
                continue;
            }
            let pos = e & POS_MASK;
            let h = hash_of(pos);
            debug_assert_eq!(tag(h), e >> POS_BITS, "hash_of disagrees with the entry");
            let mut i = h as usize & mask;
            while self.buckets[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.buckets[i] = e;
        }
        self.tombs = 0;
    }

    /// Every stored position (tests).
    #[cfg(test)]
    pub fn positions(&self) -> Vec<u32> {
        self.buckets
            .iter()
            .filter(|e| **e != EMPTY && **e != TOMB)
            .map(|e| e & POS_MASK)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The probe's first candidate for `h`.
    impl PosTable {
        fn find_any(&self, h: u64) -> Option<u32> {
            self.find(h, |_| true)
        }
    }

    fn mix(x: u64) -> u64 {
        let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    /// Random inserts, finds and removals against a HashMap model, with key hashes that share
    /// buckets and tags often (a small table, few distinct low bits): every answer agrees, the
    /// load stays bounded, and tombstones never outnumber what the load allows.
    #[test]
    fn agrees_with_a_model_under_churn() {
        for seed in 0..20u64 {
            let mut t = PosTable::default();
            // key → (hash, pos); pos → key.
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut key_of: HashMap<u32, u64> = HashMap::new();
            let mut next_pos = 0u32;
            let mut free: Vec<u32> = Vec::new();
            // Few low bits and tags: collisions of both are common.
            let hash = |k: u64| {
                let m = mix(k ^ seed);
                if seed % 2 == 0 {
                    m & 0xfc00_0000_0000_00ff
                } else {
                    m
                }
            };
            let mut x = seed;
            for _ in 0..20_000 {
                x = mix(x + 1);
                let k = x % 600;
                let h = hash(k);
                match x >> 62 {
                    0 | 1 => {
                        t.reserve_one(|p| hash(key_of[&p]));
                        match t.find_or_vacant(h, |p| key_of[&p] == k) {
                            Ok(p) => assert_eq!(model.get(&k), Some(&p)),
                            Err(v) => {
                                assert!(!model.contains_key(&k));
                                let p = free.pop().unwrap_or_else(|| {
                                    next_pos += 1;
                                    next_pos - 1
                                });
                                t.fill(v, h, p);
                                model.insert(k, p);
                                key_of.insert(p, k);
                            }
                        }
                    }
                    2 => {
                        let got = t.find(h, |p| key_of[&p] == k);
                        assert_eq!(got, model.get(&k).copied());
                    }
                    _ => {
                        let want = model.remove(&k);
                        let removed = want.is_some_and(|p| t.remove(h, p));
                        assert_eq!(removed, want.is_some());
                        if let Some(p) = want {
                            key_of.remove(&p);
                            free.push(p);
                        }
                    }
                }
                assert_eq!(t.len(), model.len());
                assert!((t.live + t.tombs) * 4 <= t.capacity() * 3);
            }
            let mut got = t.positions();
            got.sort_unstable();
            let mut want: Vec<u32> = model.values().copied().collect();
            want.sort_unstable();
            assert_eq!(got, want);
        }
    }

    /// A table grows fourfold while small (16 → 64 → 256 buckets), then doubles; always at the
    /// insert that would take its load past 3/4.
    #[test]
    fn small_tables_grow_fourfold_then_double() {
        let mut t = PosTable::default();
        let h = |p: u32| mix(p as u64);
        let mut sizes = vec![];
        for p in 0..700 {
            t.insert(h(p), p, h);
            if sizes.last() != Some(&t.capacity()) {
                sizes.push(t.capacity());
                assert_eq!(t.len(), [1, 13, 49, 193, 385][sizes.len() - 1]);
            }
        }
        assert_eq!(sizes, [16, 64, 256, 512, 1024]);
    }

    /// Removing the last entry of a probe sequence empties it and the tombstones before it, so
    /// a table emptied by removals has no tombstones left.
    #[test]
    fn removals_that_end_a_sequence_leave_no_tombstones() {
        let mut t = PosTable::default();
        let h = |p: u32| (p as u64 % 3) | (7 << 58);
        for p in 0..10 {
            t.insert(h(p), p, h);
        }
        for p in 0..10 {
            assert!(t.remove(h(p), p));
        }
        assert_eq!((t.len(), t.tombs), (0, 0));
        assert!(t.buckets.iter().all(|e| *e == EMPTY));
        assert!(!t.remove(h(3), 3));
    }

    /// The position a prefetch loads ahead of a probe is the probe's first candidate
    /// (`find` accepting any key): the first entry under the hash's tag on its sequence, past
    /// removed ones; none when the sequence ends first (or the table is empty).
    #[test]
    fn first_candidate_is_the_first_tagged_entry() {
        let mut t = PosTable::default();
        assert_eq!(t.find_any(5), None);
        t.prefetch(5);
        let tagged = |tag: u64, low: u64| tag << 58 | low;
        let h = |p: u32| tagged(p as u64 % 2, 3);
        for p in 0..4 {
            t.insert(h(p), p, h);
        }
        assert_eq!(t.find_any(tagged(0, 3)), Some(0));
        assert_eq!(t.find_any(tagged(1, 3)), Some(1));
        assert_eq!(t.find_any(tagged(2, 3)), None);
        assert!(t.remove(h(0), 0));
        assert_eq!(t.find_any(tagged(0, 3)), Some(2), "past a removed entry");
        t.prefetch(tagged(0, 3));
    }
}
