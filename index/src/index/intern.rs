//! Per-core interning: tenant/model/scheme/adapter/replica strings become small `u32` ids, and
//! prefix hashes that are not exactly 8 bytes wide live out of line as reference-counted blobs.
//!
//! Strings are never reclaimed: their number is bounded by the distinct ids a core has ever seen
//! (tenants, models, schemes, adapters, replica names), which is tiny next to the entry count.
//! Blobs are reclaimed when their last reference (a key or an eviction candidate) goes away.

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use std::hash::BuildHasher;

/// Upper bound on interned strings per core; replica ids must fit 24 bits (see `Holder`).
pub(crate) const MAX_STRINGS: usize = 1 << 24;

/// String ↔ id table. Ids are dense and stable for the life of the core.
#[derive(Default)]
pub(crate) struct Strings {
    ids: HashMap<Box<str>, u32>,
    names: Vec<Box<str>>,
    /// Lower capacity than [`MAX_STRINGS`] when set (tests of the full-table path).
    limit: Option<usize>,
}

impl Strings {
    /// Id of `s` if it was ever interned (no allocation).
    pub fn get(&self, s: &str) -> Option<u32> {
        self.ids.get(s).copied()
    }

    /// How many more distinct strings fit.
    pub fn room(&self) -> usize {
        self.limit
            .unwrap_or(MAX_STRINGS)
            .min(MAX_STRINGS)
            .saturating_sub(self.names.len())
    }

    /// Lowers the capacity (tests only reach the full-table path this way).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = Some(limit);
    }

    /// Id of `s`, interning it on first sight. Callers check [`Strings::room`] first (ingest
    /// refuses updates that would not fit), so the assertion below is an invariant, not a
    /// reachable input check.
    pub fn intern(&mut self, s: &str) -> u32 {
        if let Some(id) = self.ids.get(s) {
            return *id;
        }
        assert!(
            self.names.len() < MAX_STRINGS,
            "too many distinct strings on one core"
        );
        let id = self.names.len() as u32;
        self.names.push(s.into());
        self.ids.insert(s.into(), id);
        id
    }

    /// The string behind an id.
    pub fn name(&self, id: u32) -> &str {
        &self.names[id as usize]
    }

    /// Number of interned strings (ids are `0..len`).
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Approximate heap bytes (for the memory report).
    pub fn heap_bytes(&self) -> usize {
        self.names.iter().map(|n| 2 * n.len() + 32).sum::<usize>()
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
