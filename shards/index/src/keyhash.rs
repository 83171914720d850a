//! The keyed hash of the index's key tables. Producers choose the keys, so the hash is seeded
//! per table at random; see [`KeyHasher`].

use hashbrown::DefaultHashBuilder;
use std::hash::BuildHasher;

/// The keyed hash of the run store's key table (a key's keyspace and hash words): the two
/// words, each mixed with a seed drawn per store, multiplied into 128 bits and folded (high
/// half XOR low half), then folded once more with a third seed (foldhash's construction, the
/// workspace's map hasher, without its generic `Hasher` plumbing, which cost ~10 more
/// instructions per hash on the store's event path). Keys are chosen by producers, so the
/// seeds are random. The second fold was needed by the per-key store's table (keys differing
/// only in their high bits clustered with one); the run store's table takes its segment and
/// home bucket from other bits and spreads such keys with one fold too, and keeps the second
/// as margin (`runstore::tests::low_entropy_keys_spread_over_segments_and_buckets`).
#[derive(Clone, Copy)]
pub(crate) struct KeyHasher {
    seeds: [u64; 3],
}

/// The high and low halves of the 128-bit product of `a` and `b`, XORed.
#[inline(always)]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let product = a as u128 * b as u128;
    product as u64 ^ (product >> 64) as u64
}

impl KeyHasher {
    pub(crate) fn new() -> KeyHasher {
        let random = DefaultHashBuilder::default();
        // The multipliers keep their top bit, so neither is ever zero: a zero `ks ^ seed`
        // (ks < 2^32) would give every key of that keyspace one hash.
        KeyHasher {
            seeds: [
                random.hash_one(0u64),
                random.hash_one(1u64) | 1 << 63,
                random.hash_one(2u64) | 1 << 63,
            ],
        }
    }

    /// The keyed hash of the key with keyspace word `ks` and hash word `h`.
    #[inline(always)]
    pub(crate) fn hash(&self, ks: u32, h: u64) -> u64 {
        let [s0, s1, s2] = self.seeds;
        folded_multiply(folded_multiply(h ^ s0, ks as u64 ^ s1), s2)
    }
}
