//! Per-core state and partition ownership. Each executor thread owns one [`CoreState`] in a
//! thread-local: handlers reach it between awaits without locks, and nothing else can.

use std::cell::{Cell, RefCell};

use std::sync::Arc;

use inferencecache_proto::v1alpha1 as pb;
use inferencecache_index::index::{Index, IndexConfig};
use inferencecache_index::policy::PolicyStore;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Fixed number of index partitions; larger than any core count so `--shards` never rehashes keys.
pub const PARTITIONS: u32 = 256;

/// The partition of a `(tenant, model)` pair: every request of that model scope is answered by
/// exactly one core (ARCHITECTURE.md §1). The tenant's hash seeds the model's, so
/// ("ab","c") and ("a","bc") differ, with no allocation.
pub fn partition(tenant: &str, model: &str) -> u32 {
    let h = xxh3_64_with_seed(model.as_bytes(), xxh3_64(tenant.as_bytes()));
    (h % PARTITIONS as u64) as u32
}

/// The core owning `partition` when `cores` executors run: fixed for the process lifetime.
pub fn owner_of_partition(partition: u32, cores: usize) -> usize {
    debug_assert!(cores >= 1);
    partition as usize % cores
}

/// The core owning `(tenant, model)`.
pub fn owner(tenant: &str, model: &str) -> usize {
    owner_of_partition(
        partition(tenant, model),
        crate::runtime::mailbox::cores().max(1),
    )
}

/// Everything one core owns.
pub struct CoreState {
    /// This core's id (0-based).
    pub core: usize,
    /// Ingest messages applied on this core (routing is observable in tests through the index).
    pub ingested: u64,
    /// This core's copy of the current policy snapshot (swapped whole by `/policy`).
    pub policy: Arc<PolicyStore>,
    /// The index partitions this core owns (one index holds all of them).
    pub index: Index,
    /// Whether `index_string_table_full` was already logged on this core.
    warned_string_table_full: bool,
}

thread_local! {
    static CORE_ID: Cell<Option<usize>> = const { Cell::new(None) };
    static CORE: RefCell<Option<CoreState>> = const { RefCell::new(None) };
}

/// Installs this thread's core state; called once by each executor at start.
pub fn install(state: CoreState) {
    CORE_ID.with(|c| c.set(Some(state.core)));
    CORE.with(|c| *c.borrow_mut() = Some(state));
}

/// The current thread's core id, or `None` on non-core threads.
pub fn current_core() -> Option<usize> {
    CORE_ID.with(|c| c.get())
}

/// Runs `f` against this core's state. Panics off a core thread (a routing bug).
pub fn with_core<R>(f: impl FnOnce(&mut CoreState) -> R) -> R {
    CORE.with(|c| {
        let mut guard = c.borrow_mut();
        f(guard.as_mut().expect("with_core called off a core thread"))
    })
}

impl CoreState {
    /// Fresh state for `core` with an empty index configured by `config`.
    pub fn new(core: usize, config: IndexConfig) -> Self {
        let config = IndexConfig {
            core_id: core,
            ..config
        };
        Self {
            core,
            ingested: 0,
            policy: Arc::new(PolicyStore::empty()),
            index: Index::new(config),
            warned_string_table_full: false,
        }
    }

    /// Replaces this core's policy snapshot. The eviction order may depend on it, so the index
    /// is told to drop cached victim candidates.
    pub fn set_policy(&mut self, policy: Arc<PolicyStore>) {
        self.policy = policy;
        self.index.rules_changed();
    }

    /// Applies one ReportCacheState message.
    pub fn ingest(&mut self, update: &pb::CacheStateUpdate) {
        self.ingested += 1;
        let out = self
            .index
            .ingest(update, crate::route::unix_now_ns(), &*self.policy);
        if out.rejected_string_table_full && !self.warned_string_table_full {
            // Once per core: every later refusal has the same cause.
            self.warned_string_table_full = true;
            tracing::warn!(core = self.core, "index_string_table_full");
        }
        crate::metrics::record_ingest(out.upserts);
        if out.quota_evicted_keys > 0 {
            crate::metrics::record_tenant_evictions(&update.tenant_id, out.quota_evicted_keys);
        }
        record_evictions(out.cap_evicted, "cap");
        self.publish_gauge();
    }

    /// Applies one PublishEvent.
    pub fn apply_event(&mut self, event: &pb::CacheEvent) {
        self.index
            .apply_event(event, crate::route::unix_now_ns(), &*self.policy);
        self.publish_gauge();
    }

    /// Runs the TTL sweep (§6).
    pub fn sweep(&mut self) {
        let out = self.index.sweep(crate::route::unix_now_ns(), &*self.policy);
        record_evictions(out.ttl_evicted, "ttl");
        self.publish_gauge();
    }

    /// GetCacheState for `(tenant, model)`.
    pub fn cache_state(&mut self, tenant: &str, model: &str) -> pb::GetCacheStateResponse {
        let st = self.index.cache_state(tenant, model);
        pb::GetCacheStateResponse {
            replicas: st.replicas,
            summary: Some(pb::CacheSummary {
                total_prefixes: st.total_prefixes,
                hot_prefixes: 0,
            }),
        }
    }

    /// Re-publishes the per-model entries gauge for models whose count changed on this core.
    fn publish_gauge(&mut self) {
        self.index.drain_gauge_updates(|model, count| {
            crate::metrics::publish_index_entries(model, count as i64)
        });
    }
}

fn record_evictions(c: inferencecache_index::index::EvictionCounts, reason: &'static str) {
    if c.lru > 0 {
        crate::metrics::record_index_evictions("lru", reason, c.lru);
    }
    if c.lfu > 0 {
        crate::metrics::record_index_evictions("lfu", reason, c.lfu);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_stable_and_length_prefixed() {
        assert_eq!(partition("t", "m"), partition("t", "m"));
        assert!(partition("t", "m") < PARTITIONS);
        // Not a proof of inequality for all inputs, but the boundary shift must change the input.
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
