//! The block content fingerprint (docs/BEHAVIOUR.md §17): how `token_ids` become the same block-hash
//! chain an engine-event subscriber reports, so a gateway holding tokens and a producer holding
//! blocks agree on keys. Byte-exact against the golden vectors in
//! `fingerprint/tests/data/golden_vectors.json` (checked by `tests/fingerprint_golden.rs`).
//!
//! A crate of its own, with one dependency, so producers, load generators and client SDKs can
//! compute keys without pulling in the index.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every XXH3-64 call in the fingerprint; fixed by the contract.
pub const SEED: u64 = 1337;

/// XXH3-64(seed 1337) over the block's token ids as little-endian u32.
pub fn content_hash(block: &[u32]) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // The in-memory bytes of a little-endian `[u32]` are exactly the wire encoding, so the
        // block is hashed in place: no copy, no buffer to clear.
        // SAFETY: u32 has no padding and u8 has alignment 1; the length covers the same bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(block.as_ptr().cast::<u8>(), std::mem::size_of_val(block))
        };
        xxh3_64_with_seed(bytes, SEED)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, SEED)
    }
}

/// Rolls one block onto a parent prefix hash: XXH3(le_u64(parent) ‖ le_u64(content)).
pub fn roll(parent: u64, content: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&content.to_le_bytes());
    xxh3_64_with_seed(&buf, SEED)
}

/// Rolling prefix hashes of every full block of `tokens`; a trailing partial block is dropped,
/// and `block_size <= 0` yields nothing. With `parent`, block 0 is rolled onto it.
pub fn prefix_hashes(tokens: &[u32], block_size: i32, parent: Option<u64>) -> Vec<u64> {
    let mut out = Vec::new();
    for_each_prefix_hash(tokens, block_size, parent, |h| out.push(h));
    out
}

/// Allocation-free form of [`prefix_hashes`]: calls `sink` with each prefix hash in order.
pub fn for_each_prefix_hash(
    tokens: &[u32],
    block_size: i32,
    parent: Option<u64>,
    mut sink: impl FnMut(u64),
) {
    if block_size <= 0 {
        return;
    }
    let bs = block_size as usize;
    let mut prev = parent;
    for block in tokens.chunks_exact(bs) {
        let content = content_hash(block);
        let h = match prev {
            None => content,
            Some(p) => roll(p, content),
        };
        sink(h);
        prev = Some(h);
    }
}

/// The wire chain for `tokens`: 8-byte big-endian prefix hashes and a count of `block_size` per
/// block, exactly what a per-block producer reports. Empty when there is no full block.
pub fn chain(tokens: &[u32], block_size: i32) -> (Vec<Vec<u8>>, Vec<i32>) {
    let mut hashes = Vec::new();
    for_each_prefix_hash(tokens, block_size, None, |h| {
        hashes.push(h.to_be_bytes().to_vec())
    });
    let counts = vec![block_size; hashes.len()];
    (hashes, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_block_prefix_equals_content() {
        let t: Vec<u32> = (1..=16).collect();
        assert_eq!(content_hash(&t), 16863443419780771464);
        assert_eq!(prefix_hashes(&t, 16, None), vec![16863443419780771464]);
    }

    #[test]
    fn hashes_the_little_endian_encoding() {
        let t: Vec<u32> = (0..2048).collect();
        let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(content_hash(&t), xxh3_64_with_seed(&bytes, SEED));
    }
}
