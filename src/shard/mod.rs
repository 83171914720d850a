//! Which core owns what: the partition function over `(tenant, model)` and the per-core state
//! each executor owns. Everything scoped to one `(tenant, model)` is answered by exactly one
//! core (docs/ARCHITECTURE.md §1), so the index on that core needs no lock.

mod core_state;

use std::sync::OnceLock;

pub use crate::limits::PARTITIONS;
pub use core_state::{
    CapNeed, CoreState, IngestRefused, cap_round_max_evictions, current_core, install, with_core,
};

/// Number of cores serving, fixed once at start-up.
static CORES: OnceLock<usize> = OnceLock::new();

/// Records the number of cores; must run once, before any request is routed.
pub fn set_cores(cores: usize) {
    assert!((1..=crate::limits::MAX_SHARDS).contains(&cores));
    assert!(CORES.set(cores).is_ok(), "core count set twice");
    // Builds the partition-to-core table now, not on the first request.
    owner_of_partition(0, cores);
}

const _: () = assert!(crate::limits::MAX_SHARDS <= inferencecache_partition::MAX_CORES);

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

    /// The function itself is tested in its crate; here, that the server's view of it is the
    /// crate's (with one core everything is owned by core 0).
    #[test]
    fn the_server_routes_by_the_shared_partition_function() {
        assert_eq!(
            partition("t", "m"),
            inferencecache_partition::partition("t", "m")
        );
        assert_eq!(owner("t", "m"), 0);
    }
}
