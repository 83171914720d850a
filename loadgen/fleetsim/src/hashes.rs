//! The caller-computed block hashes. Routers take hashes, not tokens: a **content hash** per block
//! (XXH3-64 of the block's little-endian u32 token ids, seed 1337, as Dynamo's and SGLang's
//! routers compute the query side) and an **engine chain hash** that also covers the parent, as
//! an engine reports stored and removed blocks. The trace gives block ids, not tokens, so each
//! block's tokens are synthesized deterministically from its id.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The seed routers use for the content hash.
pub const CONTENT_HASH_SEED: u64 = 1337;

/// Tokens in one trace block id (Mooncake's block size).
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// One engine block: its content hash (queries) and its chain hash (stores and removals).
/// `repr(C)`, two words and no padding, so an index that reads hashes at a stride can borrow a
/// request's blocks as they are (the peers benchmark's adapter of ours does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct Block {
    /// XXH3-64 (seed 1337) of the block's tokens; depends on the tokens only.
    pub content: u64,
    /// Hash of the parent's chain hash and this block's content: identifies the whole prefix.
    pub chain: u64,
}

/// The synthesized token ids of sub-block `part` of trace block `id`: distinct ids get distinct
/// tokens, and the same id always the same tokens.
pub fn block_tokens(id: u64, part: u32, tokens: u32) -> Vec<u32> {
    let mut seed = [0u8; 12];
    seed[..8].copy_from_slice(&id.to_le_bytes());
    seed[8..].copy_from_slice(&part.to_le_bytes());
    let mut state = xxh3_64(&seed);
    (0..tokens)
        .map(|_| (splitmix64(&mut state) as u32) & 0x7fff_ffff)
        .collect()
}

/// One step of SplitMix64: a cheap deterministic stream of token ids.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// XXH3-64 of the little-endian u32 tokens, seed 1337.
pub fn content_hash(tokens: &[u32]) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, CONTENT_HASH_SEED)
}

/// The chain hash of a block after `parent` (None: the first block, whose chain hash is its
/// content hash).
pub fn chain_hash(parent: Option<u64>, content: u64) -> u64 {
    match parent {
        None => content,
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.to_le_bytes());
            buf[8..].copy_from_slice(&content.to_le_bytes());
            xxh3_64_with_seed(&buf, CONTENT_HASH_SEED)
        }
    }
}

/// The engine blocks of one request: each trace id becomes `expand` consecutive blocks of
/// `512 / expand` tokens, chained from the first.
pub fn request_blocks(hash_ids: &[u64], expand: u32) -> Vec<Block> {
    let mut parent = None;
    let mut out = Vec::with_capacity(hash_ids.len() * expand as usize);
    for &id in hash_ids {
        for content in id_contents(id, expand) {
            let chain = chain_hash(parent, content);
            out.push(Block { content, chain });
            parent = Some(chain);
        }
    }
    out
}

/// The content hashes of the `expand` engine blocks of trace block `id`.
pub fn id_contents(id: u64, expand: u32) -> Vec<u64> {
    let tokens = TRACE_BLOCK_TOKENS / expand;
    (0..expand)
        .map(|part| content_hash(&block_tokens(id, part, tokens)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_hash_is_xxh3_of_le_tokens_seed_1337() {
        let bytes = [1u8, 0, 0, 0, 2, 0, 0, 0];
        assert_eq!(content_hash(&[1, 2]), xxh3_64_with_seed(&bytes, 1337));
    }

    #[test]
    fn expansion_gives_k_blocks_per_id_and_chains_cover_the_prefix() {
        let a = request_blocks(&[7, 8], 32);
        assert_eq!(a.len(), 64);
        assert_eq!(block_tokens(7, 0, 16).len(), 16);
        // A shared leading id gives the same blocks; a different first id changes every chain
        // hash after it but not the content of the shared second id.
        let b = request_blocks(&[7, 9], 32);
        assert_eq!(a[..32], b[..32]);
        assert_ne!(a[32], b[32]);
        let c = request_blocks(&[6, 8], 32);
        assert_eq!(a[32].content, c[32].content);
        assert_ne!(a[32].chain, c[32].chain);
        // Native: one 512-token block per id.
        assert_eq!(request_blocks(&[7, 8], 1).len(), 2);
        assert_eq!(a[0].chain, a[0].content);
    }
}
