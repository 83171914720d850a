//! Per-core interning: tenant/model/scheme/adapter/replica strings become small `u32` ids, and
//! prefix hashes that are not exactly 8 bytes wide live out of line as reference-counted blobs.
//!
//! Strings are bounded in number ([`MAX_STRINGS`], lowered by `IndexConfig::max_strings`) and in
//! bytes (`IndexConfig::max_string_bytes`). They are freed by the index's reclaim pass
//! (`Index::reclaim`, run after every sweep and when the table is full) once no record, entry,
//! stats row or gauge refers to them; a freed id is reused only by a later `intern`, after the
//! pass has dropped every cached snapshot that could still name it.
//! Blobs are reclaimed when their last reference (a key or an eviction candidate) goes away.

use hashbrown::{DefaultHashBuilder, HashTable};
use std::cell::Cell;
use std::hash::BuildHasher;

/// Upper bound on interned strings per core; replica ids must fit 24 bits (see `Holder`).
pub const MAX_STRINGS: usize = 1 << 24;

/// String ↔ id table. An id is stable while the string is live; freed ids are reused.
pub(crate) struct Strings {
    /// Slot per id; a freed slot holds the empty string and is on `free`.
    names: Vec<Box<str>>,
    /// Whether a slot is live (freed slots are not).
    live: Vec<bool>,
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
    free: Vec<u32>,
    /// Sum of the live names' lengths.
    bytes: usize,
    /// Capacity in strings (at most [`MAX_STRINGS`]).
    max_count: usize,
    /// Capacity in name bytes.
    max_bytes: usize,
    /// While the reclaim pass marks the names still referred to: one bit per id. Every
    /// `intern` marks the id it returns, so a name that gains a reference while the pass runs
    /// is never taken for unreferenced.
    marks: Option<Vec<u64>>,
}

impl Default for Strings {
    fn default() -> Self {
        Strings::new(MAX_STRINGS, usize::MAX)
    }
}

impl Strings {
    /// An empty table holding at most `max_count` strings of `max_bytes` bytes in total.
    pub fn new(max_count: usize, max_bytes: usize) -> Strings {
        Strings {
            names: Vec::new(),
            live: Vec::new(),
            table: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
            free: Vec::new(),
            bytes: 0,
            max_count: max_count.min(MAX_STRINGS),
            max_bytes,
            marks: None,
        }
    }

    /// Starts marking (see [`Strings::marks`]): every id unmarked. The bitmap is one bit per
    /// slot, allocated zeroed (the allocator maps fresh zero pages for a large one).
    pub fn begin_marking(&mut self) {
        self.marks = Some(vec![0u64; self.names.len().div_ceil(64)]);
    }

    /// Marks `id` as referred to (while marking; otherwise nothing).
    #[inline]
    pub fn mark(&mut self, id: u32) {
        if let Some(m) = &mut self.marks {
            let (w, b) = (id as usize / 64, id as usize % 64);
            if w >= m.len() {
                m.resize(w + 1, 0);
            }
            m[w] |= 1 << b;
        }
    }

    /// Whether `id` was marked since [`Strings::begin_marking`] (ids past the bitmap were
    /// created since, and so marked by `intern`).
    pub fn is_marked(&self, id: u32) -> bool {
        self.marks.as_ref().is_none_or(|m| {
            let (w, b) = (id as usize / 64, id as usize % 64);
            m.get(w).is_none_or(|x| x & (1 << b) != 0)
        })
    }

    /// Stops marking.
    pub fn end_marking(&mut self) {
        self.marks = None;
    }

    /// Id of `s` if it is interned (no allocation).
    pub fn get(&self, s: &str) -> Option<u32> {
        let h = self.hasher.hash_one(s);
        self.table
            .find(h, |&id| &*self.names[id as usize] == s)
            .copied()
    }

    /// Id of `s`, trying `hint` first: the id the same role (a query's tenant, its model...)
    /// resolved to last time. Most queries repeat their names, and a checked slot costs one
    /// comparison instead of a hash and a probe. A freed or reused slot fails the check, so a
    /// stale hint only costs that comparison.
    pub fn get_hinted(&self, s: &str, hint: &Cell<u32>) -> Option<u32> {
        let h = hint.get() as usize;
        if h < self.names.len() && self.live[h] && *self.names[h] == *s {
            return Some(h as u32);
        }
        let id = self.get(s)?;
        hint.set(id);
        Some(id)
    }

    /// How many more distinct strings fit.
    pub fn room(&self) -> usize {
        self.max_count.saturating_sub(self.count())
    }

    /// How many more name bytes fit.
    pub fn room_bytes(&self) -> usize {
        self.max_bytes.saturating_sub(self.bytes)
    }

    /// Lowers the capacity in strings (tests reach the full-table path this way).
    pub fn set_limit(&mut self, limit: usize) {
        self.max_count = limit.min(MAX_STRINGS);
    }

    /// Sets the capacity in name bytes.
    pub fn set_byte_limit(&mut self, limit: usize) {
        self.max_bytes = limit;
    }

    /// Id of `s`, interning it on first sight. Callers check [`Strings::room`] and
    /// [`Strings::room_bytes`] first (ingest refuses updates that would not fit), so the
    /// assertion below is an invariant, not a reachable input check.
    pub fn intern(&mut self, s: &str) -> u32 {
        let id = self.intern_unmarked(s);
        self.mark(id);
        id
    }

    fn intern_unmarked(&mut self, s: &str) -> u32 {
        if let Some(id) = self.get(s) {
            return id;
        }
        assert!(
            self.count() < MAX_STRINGS,
            "too many distinct strings on one core"
        );
        let id = match self.free.pop() {
            Some(id) => {
                self.names[id as usize] = s.into();
                self.live[id as usize] = true;
                id
            }
            None => {
                self.names.push(s.into());
                self.live.push(true);
                (self.names.len() - 1) as u32
            }
        };
        self.bytes += s.len();
        let h = self.hasher.hash_one(s);
        let names = &self.names;
        let hasher = &self.hasher;
        self.table
            .insert_unique(h, id, |&i| hasher.hash_one(&*names[i as usize]));
        id
    }

    /// First half of freeing a live id nothing refers to: `get` and `intern` no longer find
    /// it (a later `intern` of the same name makes a new id), but [`Strings::name`] still reads
    /// it and the id is not reused until [`Strings::release`], so a cached snapshot that names
    /// it still compares correctly until the reclaim pass has dropped those snapshots.
    pub fn unlink(&mut self, id: u32) {
        debug_assert!(self.live[id as usize], "unlink of a dead string");
        let h = self.hasher.hash_one(&*self.names[id as usize]);
        match self.table.find_entry(h, |&i| i == id) {
            Ok(e) => {
                e.remove();
            }
            Err(_) => panic!("string missing from its table"),
        }
        self.live[id as usize] = false;
    }

    /// Room on the free list for `n` more ids (see [`Strings::release`]).
    pub fn reserve_free(&mut self, n: usize) {
        self.free.reserve(n);
    }

    /// Second half of freeing: gives back an unlinked id's bytes and slot.
    pub fn release(&mut self, id: u32) {
        debug_assert!(!self.live[id as usize], "release of a linked string");
        self.bytes -= self.names[id as usize].len();
        self.names[id as usize] = "".into();
        self.free.push(id);
    }

    /// Frees a live id at once (unlink and release).
    #[cfg(test)]
    pub fn free(&mut self, id: u32) {
        self.unlink(id);
        self.release(id);
    }

    /// Whether `id` names a live string.
    pub fn is_live(&self, id: u32) -> bool {
        self.live.get(id as usize).copied().unwrap_or(false)
    }

    /// The string behind an id.
    pub fn name(&self, id: u32) -> &str {
        &self.names[id as usize]
    }

    /// Number of id slots (ids are `0..slots()`, live or free).
    pub fn slots(&self) -> usize {
        self.names.len()
    }

    /// Number of live strings.
    pub fn count(&self) -> usize {
        self.names.len() - self.free.len()
    }

    /// Sum of the live names' lengths.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Approximate heap bytes (for the memory report): the names, one slot and one table bucket
    /// per id.
    pub fn heap_bytes(&self) -> usize {
        self.bytes
            + self.names.capacity() * (std::mem::size_of::<Box<str>>() + 1)
            + self.table.capacity() * 5
            + self.free.capacity() * 4
    }
}

struct BlobRec {
    bytes: Box<[u8]>,
    refs: u32,
}

/// Reference-counted out-of-line prefix hashes (any width other than 8 bytes, including empty).
pub(crate) struct Blobs {
    recs: Vec<BlobRec>,
    table: HashTable<u32>,
    free: Vec<u32>,
    hasher: DefaultHashBuilder,
}

impl Default for Blobs {
    fn default() -> Self {
        Blobs {
            recs: Vec::new(),
            table: HashTable::new(),
            free: Vec::new(),
            hasher: DefaultHashBuilder::default(),
        }
    }
}

impl Blobs {
    fn hash(&self, bytes: &[u8]) -> u64 {
        self.hasher.hash_one(bytes)
    }

    /// Id of a live blob with these bytes (no allocation).
    pub fn get(&self, bytes: &[u8]) -> Option<u32> {
        let h = self.hash(bytes);
        self.table
            .find(h, |&id| &*self.recs[id as usize].bytes == bytes)
            .copied()
    }

    /// Id for these bytes with one more reference (creating the blob if needed).
    pub fn acquire(&mut self, bytes: &[u8]) -> u32 {
        if let Some(id) = self.get(bytes) {
            self.recs[id as usize].refs += 1;
            return id;
        }
        let h = self.hash(bytes);
        let rec = BlobRec {
            bytes: bytes.into(),
            refs: 1,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.recs[id as usize] = rec;
                id
            }
            None => {
                self.recs.push(rec);
                (self.recs.len() - 1) as u32
            }
        };
        let recs = &self.recs;
        let hasher = &self.hasher;
        self.table
            .insert_unique(h, id, |&i| hasher.hash_one(&*recs[i as usize].bytes));
        id
    }

    /// One more reference to a live blob.
    pub fn retain(&mut self, id: u32) {
        let r = &mut self.recs[id as usize];
        debug_assert!(r.refs > 0, "retain of a dead blob");
        r.refs += 1;
    }

    /// Drops one reference; the blob is freed at zero.
    pub fn release(&mut self, id: u32) {
        let r = &mut self.recs[id as usize];
        debug_assert!(r.refs > 0, "release of a dead blob");
        r.refs -= 1;
        if r.refs == 0 {
            let h = self.hasher.hash_one(&*r.bytes);
            match self.table.find_entry(h, |&i| i == id) {
                Ok(e) => {
                    e.remove();
                }
                Err(_) => debug_assert!(false, "blob missing from its table"),
            }
            self.recs[id as usize].bytes = Box::new([]);
            self.free.push(id);
        }
    }

    /// The bytes of a live blob.
    pub fn bytes(&self, id: u32) -> &[u8] {
        &self.recs[id as usize].bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_names_leave_the_table_and_their_ids_are_reused() {
        let mut s = Strings::new(3, 10);
        let a = s.intern("aaaa");
        let b = s.intern("bbb");
        assert_eq!((s.count(), s.bytes()), (2, 7));
        assert_eq!((s.room(), s.room_bytes()), (1, 3));
        s.free(a);
        assert_eq!(s.get("aaaa"), None);
        assert!(!s.is_live(a));
        assert_eq!((s.count(), s.bytes()), (1, 3));
        let c = s.intern("cc");
        assert_eq!(c, a, "a freed id is reused");
        assert_eq!(s.name(c), "cc");
        assert_eq!(s.get("bbb"), Some(b));
        assert_eq!(s.slots(), 2);
    }

    #[test]
    fn a_hint_is_used_only_while_its_slot_holds_the_same_live_name() {
        let mut s = Strings::new(8, 100);
        let a = s.intern("tenant-a");
        let b = s.intern("tenant-b");
        let hint = Cell::new(u32::MAX);
        assert_eq!(s.get_hinted("tenant-a", &hint), Some(a));
        assert_eq!(hint.get(), a, "a resolved name becomes the hint");
        assert_eq!(
            s.get_hinted("tenant-b", &hint),
            Some(b),
            "another name misses the hint"
        );
        assert_eq!(hint.get(), b);
        assert_eq!(s.get_hinted("nobody", &hint), None);
        assert_eq!(hint.get(), b, "an unknown name leaves the hint");
        // The hinted slot is freed: its name is gone, and the empty string a freed slot holds
        // is not a live name either.
        s.free(b);
        assert_eq!(s.get_hinted("tenant-b", &hint), None);
        assert_eq!(s.get_hinted("", &hint), None);
        // The slot is reused for another name: the hint now only matches that name.
        let c = s.intern("tenant-c");
        assert_eq!(c, b, "the freed id is reused");
        assert_eq!(s.get_hinted("tenant-b", &hint), None);
        assert_eq!(s.get_hinted("tenant-c", &hint), Some(c));
        // A hint past the table's slots is ignored.
        hint.set(1_000);
        assert_eq!(s.get_hinted("tenant-a", &hint), Some(a));
    }
}
