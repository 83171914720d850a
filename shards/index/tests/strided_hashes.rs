//! Block hashes handed to a lookup where they lie, at a stride (`BlockHashes::Strided`: the
//! server's received message, a caller's array of records), answer exactly as the same hashes
//! copied out one by one, and a strided run is only built over a buffer that holds it.

mod index_support;

use index_support::*;
use inferencecache_index::index::{BlockHashes, LookupQuery, StridedHashes};
use inferencecache_index::rules::NoRules;

const NR: NoRules = NoRules;

/// Block `b` of chain `c`: an 8-byte hash.
fn hash(c: u8, b: u8) -> [u8; 8] {
    [c, b, 0xa5, 0, 0, 0, 0, b]
}

#[test]
fn a_strided_chain_answers_as_the_same_hashes_copied() {
    let mut ix = index();
    let chain: Vec<[u8; 8]> = (0..40).map(|b| hash(1, b)).collect();
    // Replicas holding prefixes of every length (runs that stop inside and at the end), plus
    // enough of them for the answer built straight from the runs.
    for r in 0..24u8 {
        let depth = 1 + (r as usize * 7) % 40;
        let hashes: Vec<&[u8]> = chain[..depth].iter().map(|h| &h[..]).collect();
        ix.ingest(
            &upd_r(&format!("r{r:02}"), vec![chain_entry(&hashes, 16)]),
            T0,
            &NR,
        );
    }
    // The hashes as a message holds them: a 2-byte header before each (stride 10).
    let mut wire = Vec::new();
    for h in &chain {
        wire.extend_from_slice(&[0x3a, 0x08]);
        wire.extend_from_slice(h);
    }
    let counts = vec![16; chain.len()];
    for len in [1, 2, 7, 8, 9, 33, 40] {
        let query = |block_hashes| LookupQuery {
            tenant: "t",
            model: "m",
            hash_scheme: "vllm",
            block_hashes,
            block_token_counts: &counts[..len],
            ..Default::default()
        };
        let strided = StridedHashes::new(&wire[2..], 10, len).expect("fits");
        let (s1, by_stride) = route(&mut ix, &query(BlockHashes::Strided(strided)), T0, &NR);
        let (s2, by_copy) = route(&mut ix, &query(BlockHashes::Fixed(&chain[..len])), T0, &NR);
        assert_eq!((s1, &by_stride), (s2, &by_copy), "{len} blocks");
        assert!(!by_copy.is_empty());
    }
}

#[test]
fn a_strided_run_must_fit_its_buffer() {
    let bytes = [0u8; 28];
    assert!(
        StridedHashes::new(&bytes, 10, 3).is_some(),
        "2 strides + 8 bytes = 28"
    );
    assert!(
        StridedHashes::new(&bytes[1..], 10, 3).is_none(),
        "one byte short"
    );
    assert!(StridedHashes::new(&bytes, 7, 2).is_none(), "hashes overlap");
    assert!(
        StridedHashes::new(&bytes, usize::MAX, 2).is_none(),
        "stride overflows"
    );
    assert!(StridedHashes::new(&[], 10, 0).is_some_and(|h| h.is_empty()));
    let h = StridedHashes::new(&bytes, 10, 3).unwrap();
    assert_eq!((h.len(), h.stride(), h.get(2).len()), (3, 10, 8));
}
