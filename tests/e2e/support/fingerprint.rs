//! The token fingerprint of docs/BEHAVIOUR.md §17, computed independently of the server.

/// `Chain(tokens, bs)` of docs/BEHAVIOUR.md §17: per-block big-endian 8-byte rolling XXH3 (seed 1337)
/// prefix hashes and the per-block counts (all `bs`).
pub fn fingerprint_chain(tokens: &[u32], bs: usize) -> (Vec<Vec<u8>>, Vec<i32>) {
    use xxhash_rust::xxh3::xxh3_64_with_seed;
    let mut hashes = Vec::new();
    let mut counts = Vec::new();
    if bs == 0 {
        return (hashes, counts);
    }
    let mut prev: Option<u64> = None;
    for block in tokens.chunks_exact(bs) {
        let mut buf = Vec::with_capacity(bs * 4);
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let content = xxh3_64_with_seed(&buf, 1337);
        let p = match prev {
            None => content,
            Some(parent) => {
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&parent.to_le_bytes());
                b[8..].copy_from_slice(&content.to_le_bytes());
                xxh3_64_with_seed(&b, 1337)
            }
        };
        hashes.push(p.to_be_bytes().to_vec());
        counts.push(bs as i32);
        prev = Some(p);
    }
    (hashes, counts)
}
