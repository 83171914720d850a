//! Which core of an InferenceCache server owns a `(tenant_id, model_id)`.
//!
//! The server splits its index into [`PARTITIONS`] fixed partitions and deals them to its cores
//! with a balanced consistent assignment ([`owner_of_partition`]). Everything a `LookupRoute`
//! reads is scoped to one `(tenant, model)`, so a client that sends each request over a
//! connection served by the owning core (the server's shard-aware port) never causes a
//! cross-core hop.
//!
//! ```
//! use inferencecache_partition::{owner, owner_of_partition, partition, PARTITIONS};
//! let p = partition("team-a", "llama-8b");
//! assert!(p < PARTITIONS);
//! assert_eq!(owner("team-a", "llama-8b", 4), owner_of_partition(p, 4));
//! ```
//!
//! The function is part of the server's contract with shard-aware clients: the server names it
//! [`PARTITION_FUNCTION`] in the `inferencecache-partition-function` header of its health
//! answers, and a change gets a new name.

#![forbid(unsafe_code)]

use std::sync::OnceLock;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Number of partitions: fixed, more than any core count, so `--shards` never rehashes keys.
pub const PARTITIONS: u32 = 256;

/// Largest core count the assignment is defined for (the server's `--shards` bound).
pub const MAX_CORES: usize = 64;

/// Name of this partition function, as the server reports it.
pub const PARTITION_FUNCTION: &str = "xxh3-tenant-seeded-model-mod-256-balanced-consistent";

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
/// The assignment is consistent and balanced:
/// * going from `n` to `n + 1` cores moves only the partitions the new core takes, so a
///   snapshot restored into another `--shards`, or a shard-aware client learning a new core
///   count, moves only what must move (in both directions: a partition on core `c < m` at `n`
///   cores is on the same core at every `m` between);
/// * every core owns `256 / n` partitions, rounded down or up (jump consistent hash, the usual
///   choice, leaves cores with no partition at all at 64 cores over 256 keys).
///
/// It is built once, incrementally: one core owns everything; core `n` then takes
/// `256 / (n + 1)` partitions, one at a time from the core owning the most (the lowest id on a
/// tie), each time the donor's partition that ranks first in a fixed pseudo-random order for
/// step `n`. A table lookup afterwards.
///
/// # Panics
/// If `shards` is 0 or above [`MAX_CORES`].
#[inline]
pub fn owner_of_partition(partition: u32, shards: usize) -> usize {
    assert!(
        (1..=MAX_CORES).contains(&shards),
        "a server runs 1 to {MAX_CORES} cores"
    );
    usize::from(assignments()[shards - 1][partition as usize % PARTITIONS as usize])
}

/// The core owning `(tenant, model)` on a server running `shards` cores.
#[inline]
pub fn owner(tenant: &str, model: &str, shards: usize) -> usize {
    owner_of_partition(partition(tenant, model), shards)
}

/// `assignments()[n - 1][p]`: the core owning partition `p` at `n` cores (16 KiB, built once).
fn assignments() -> &'static [[u8; PARTITIONS as usize]; MAX_CORES] {
    static TABLE: OnceLock<Box<[[u8; PARTITIONS as usize]; MAX_CORES]>> = OnceLock::new();
    TABLE.get_or_init(build_assignments)
}

fn build_assignments() -> Box<[[u8; PARTITIONS as usize]; MAX_CORES]> {
    let mut table = Box::new([[0u8; PARTITIONS as usize]; MAX_CORES]);
    let mut owners = [0u8; PARTITIONS as usize];
    let mut counts = [0usize; MAX_CORES];
    counts[0] = PARTITIONS as usize;
    table[0] = owners;
    for new_core in 1..MAX_CORES {
        let share = PARTITIONS as usize / (new_core + 1);
        for _ in 0..share {
            let donor = (0..new_core)
                .max_by_key(|&c| (counts[c], std::cmp::Reverse(c)))
                .expect("at least one core");
            let taken = (0..PARTITIONS as usize)
                .filter(|&p| usize::from(owners[p]) == donor)
                .min_by_key(|&p| rank(p as u64, new_core as u64))
                .expect("the donor owns the most partitions, so at least one");
            owners[taken] = new_core as u8;
            counts[donor] -= 1;
            counts[new_core] += 1;
        }
        table[new_core] = owners;
    }
    table
}

/// The order in which a donor gives up partitions to core `new_core` (splitmix64's finaliser:
/// a fixed, well-spread permutation, so the partitions a core takes are not a contiguous range).
fn rank(partition: u64, new_core: u64) -> u64 {
    let mut z = partition ^ (new_core << 32) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
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

    /// Every core owns `256 / n` partitions rounded down or up, at every core count.
    #[test]
    fn every_core_count_is_balanced() {
        for shards in 1..=MAX_CORES {
            let mut counts = vec![0usize; shards];
            for p in 0..PARTITIONS {
                counts[owner_of_partition(p, shards)] += 1;
            }
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(max - min <= 1, "{shards} cores: {counts:?}");
            assert!(
                *min >= PARTITIONS as usize / shards,
                "{shards} cores: {counts:?}"
            );
        }
    }

    /// Growing by one core moves only the partitions the new core takes; between any two core
    /// counts `m < n`, a partition owned by a core below `m` at `n` cores has that owner at `m`.
    #[test]
    fn only_what_must_move_moves() {
        for n in 2..=MAX_CORES {
            let moved = (0..PARTITIONS)
                .filter(|&p| owner_of_partition(p, n) != owner_of_partition(p, n - 1))
                .collect::<Vec<_>>();
            assert_eq!(moved.len(), PARTITIONS as usize / n, "{n} cores");
            assert!(moved.iter().all(|&p| owner_of_partition(p, n) == n - 1));
            for m in 1..n {
                for p in 0..PARTITIONS {
                    let at_n = owner_of_partition(p, n);
                    if at_n < m {
                        assert_eq!(owner_of_partition(p, m), at_n, "p {p}, {m} < {n} cores");
                    }
                }
            }
        }
    }

    /// Pinned owners: the assignment is part of the shard-aware clients' contract too.
    #[test]
    fn the_assignment_is_pinned() {
        let at_2: Vec<usize> = (0..8).map(|p| owner_of_partition(p, 2)).collect();
        let at_4: Vec<usize> = (0..8).map(|p| owner_of_partition(p, 4)).collect();
        assert_eq!((at_2, at_4), (PINNED_2.to_vec(), PINNED_4.to_vec()));
    }

    const PINNED_2: [usize; 8] = [1, 1, 0, 1, 0, 1, 0, 1];
    const PINNED_4: [usize; 8] = [1, 1, 0, 3, 0, 3, 3, 1];

    #[test]
    #[should_panic(expected = "a server runs 1 to 64 cores")]
    fn zero_cores_is_refused() {
        owner_of_partition(0, 0);
    }
}
