//! Which core owns what: the partition function over `(tenant, model)` and the per-core state
//! each executor owns. Everything scoped to one `(tenant, model)` is answered by exactly one
//! core (docs/ARCHITECTURE.md §1), so the index on that core needs no lock.

mod core_state;

use std::sync::OnceLock;

pub use crate::limits::PARTITIONS;
pub use core_state::{CoreState, IngestRefused, current_core, install, with_core};

/// Number of cores serving, fixed once at start-up.
static CORES: OnceLock<usize> = OnceLock::new();

/// Records the number of cores; must run once, before any request is routed.
pub fn set_cores(cores: usize) {
    assert!((1..=crate::limits::MAX_SHARDS).contains(&cores));
    assert!(CORES.set(cores).is_ok(), "core count set twice");
}

/// Number of cores serving (1 before start-up finished, e.g. in unit tests).
pub fn cores() -> usize {
    CORES.get().copied().unwrap_or(1)
}

/// The partition function and the core owning a partition (fixed for the process lifetime):
/// the `inferencecache-partition` crate, which shard-aware clients share.
pub use inferencecache_partition::{PARTITION_FUNCTION, owner_of_partition, partition};

/// The core owning `(tenant, model)`.
pub fn owner(tenant: &str, model: &str) -> usize {
    owner_of_partition(partition(tenant, model), cores())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_stable_and_spreads() {
        assert_eq!(partition("t", "m"), partition("t", "m"));
        assert!(partition("t", "m") < PARTITIONS);
        assert_ne!(partition("ab", "c"), partition("a", "bc"));
        let many: std::collections::HashSet<u32> = (0..1000)
            .map(|i| partition("t", &format!("m{i}")))
            .collect();
        assert!(many.len() > 200, "partitions should spread: {}", many.len());
    }

    #[test]
    fn owners_cover_all_cores() {
        let owners: std::collections::HashSet<usize> =
            (0..PARTITIONS).map(|p| owner_of_partition(p, 2)).collect();
        assert_eq!(owners.len(), 2);
    }
}
