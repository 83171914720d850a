//! The per-tenant knobs the index itself needs (TTL, eviction algorithm, quota), as a trait so
//! the index stays independent of how policies are pushed and parsed (`policy` implements it).

/// Cap-victim order of a tenant's entries (docs/BEHAVIOUR.md §7.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Eviction {
    /// Oldest `last_seen` first.
    Lru,
    /// Lowest delivered-lookup count first, oldest as tie-break.
    Lfu,
}

/// Per-tenant resolution of the policy fields the index consults at ingest, lookup and sweep.
pub trait TenantRules {
    /// The tenant's TTL in nanoseconds; `<= 0` means "use the index default" (30 min).
    fn ttl_ns(&self, tenant: &str) -> i64;
    /// The tenant's eviction algorithm (LRU unless the policy says exactly `lfu`).
    fn eviction(&self, tenant: &str) -> Eviction;
    /// Distinct-prefix-key budget; `None` = unbounded. Never set for the probe tenant.
    fn quota(&self, tenant: &str) -> Option<u64>;
}

/// No policies installed: default TTL, LRU, no quotas.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoRules;

impl TenantRules for NoRules {
    fn ttl_ns(&self, _tenant: &str) -> i64 {
        0
    }
    fn eviction(&self, _tenant: &str) -> Eviction {
        Eviction::Lru
    }
    fn quota(&self, _tenant: &str) -> Option<u64> {
        None
    }
}
