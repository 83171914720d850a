//! Which core of an InferenceCache server owns a `(tenant_id, model_id)`.
//!
//! The server splits its index into [`PARTITIONS`] fixed partitions; partition `p` is served by
//! core `p mod shards` for the life of the process. Everything a `LookupRoute` reads is scoped
//! to one `(tenant, model)`, so a client that sends each request over a connection served by
//! the owning core (the server's shard-aware port) never causes a cross-core hop.
//!
//! ```
//! use inferencecache_partition::{owner, partition, PARTITIONS};
//! let p = partition("team-a", "llama-8b");
//! assert!(p < PARTITIONS);
//! assert_eq!(owner("team-a", "llama-8b", 4), p as usize % 4);
//! ```
//!
//! The function is part of the server's contract with shard-aware clients: the server reports
//! it as [`PARTITION_FUNCTION`] (on `GET /shards`), and a change gets a new name.

#![forbid(unsafe_code)]

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Number of partitions: fixed, more than any core count, so `--shards` never rehashes keys.
pub const PARTITIONS: u32 = 256;

/// Name of this partition function, as the server reports it.
pub const PARTITION_FUNCTION: &str = "xxh3-tenant-seeded-model-mod-256";

/// The partition of a `(tenant, model)` pair: `xxh3_64_with_seed(model, xxh3_64(tenant)) mod
/// 256`. The tenant's hash seeds the model's, so `("ab", "c")` and `("a", "bc")` differ, with
/// no allocation.
#[inline]
pub fn partition(tenant: &str, model: &str) -> u32 {
    let h = xxh3_64_with_seed(model.as_bytes(), xxh3_64(tenant.as_bytes()));
    (h % u64::from(PARTITIONS)) as u32
}

/// The core serving `partition` on a server running `shards` cores.
///
/// # Panics
/// If `shards` is 0.
#[inline]
pub fn owner_of_partition(partition: u32, shards: usize) -> usize {
    assert!(shards >= 1, "a server runs at least one core");
    partition as usize % shards
}

/// The core owning `(tenant, model)` on a server running `shards` cores.
#[inline]
pub fn owner(tenant: &str, model: &str, shards: usize) -> usize {
    owner_of_partition(partition(tenant, model), shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_stable_and_spreads() {
        assert_eq!(partition("t", "m"), partition("t", "m"));
        assert_ne!(partition("ab", "c"), partition("a", "bc"));
        let many: std::collections::HashSet<u32> = (0..1000)
            .map(|i| partition("t", &format!("m{i}")))
            .collect();
        assert!(many.len() > 200, "partitions should spread: {}", many.len());
    }

    /// Pinned values: a change of the function breaks every deployed shard-aware client, so it
    /// must be deliberate (and renamed).
    #[test]
    fn the_function_is_pinned() {
        assert_eq!(
            partition("", ""),
            (xxh3_64_with_seed(b"", xxh3_64(b"")) % 256) as u32
        );
        let pinned: Vec<u32> = [("team-a", "llama-8b"), ("", "m"), ("t", "")]
            .iter()
            .map(|(t, m)| partition(t, m))
            .collect();
        assert_eq!(pinned, PINNED.to_vec());
    }

    const PINNED: [u32; 3] = [159, 76, 79];

    #[test]
    fn owners_cover_all_cores() {
        for shards in 1..=8 {
            let owners: std::collections::HashSet<usize> = (0..PARTITIONS)
                .map(|p| owner_of_partition(p, shards))
                .collect();
            assert_eq!(owners.len(), shards);
        }
    }
}
