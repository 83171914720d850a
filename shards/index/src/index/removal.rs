//! The removal hook: tells the owner of an [`Index`] which entries the index removed **on its
//! own** — TTL sweep (§6), global cap (§7.2), tenant quota (§7.1) — so it can publish them
//! (the server's StreamCacheEvents feed). Removals a producer asked for (PublishEvent's
//! `PREFIX_EVICTED` / `ALL_CLEARED`) are not reported: the producer's call is published as it is.
//!
//! Bounded and allocation-free on the index side: no sink installed (the default) costs one
//! `Option` test per removal; with a sink, each removal is one call with a borrowed view
//! ([`Removed`]) whose names and hash bytes are resolved only if the sink asks for them, so a
//! sink that finds nobody listening returns after one load. The view is handed out *before* the
//! entry is removed, while its names and hash blob are still live.

use super::store::KeyId;
use super::{Catalog, Index};
use crate::rules::Eviction;

/// Why the index removed an entry on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RemovalReason {
    /// The TTL sweep: `now − last_seen ≥ ttl(tenant)` (§6).
    Ttl,
    /// The global cap `--index-max-entries` (§7.2), in the LRU/LFU victim order.
    Cap,
    /// The tenant's entry quota (§7.1): a whole prefix key, one report per holder.
    Quota,
    /// The rest of a replica's stretch of a run, cut off with a block removed from its
    /// middle when the replica has the most stretches of that run
    /// (`runstore::MAX_REPLICA_EXTENTS`). Reported right after the store took the entries
    /// out with the removed one, before they leave the counts (names and hash still live).
    RunExtents,
}

impl RemovalReason {
    /// The `reason` label the server's eviction counters use for it (`ttl`, `cap`,
    /// `over_entries`).
    pub fn label(self) -> &'static str {
        match self {
            RemovalReason::Ttl => "ttl",
            RemovalReason::Cap => "cap",
            RemovalReason::Quota => "over_entries",
            RemovalReason::RunExtents => "run_extents",
        }
    }
}

/// One entry the index is about to remove on its own: a borrowed view, valid only for the
/// duration of the sink call. Names are resolved on demand (no allocation).
pub struct Removed<'a> {
    cat: &'a Catalog,
    key: KeyId,
    replica: u32,
    reason: RemovalReason,
    algorithm: Eviction,
    at_ns: i64,
}

impl Removed<'_> {
    /// Why it was removed.
    pub fn reason(&self) -> RemovalReason {
        self.reason
    }
    /// The tenant's resolved eviction algorithm (the `algorithm` label of the counters).
    pub fn algorithm(&self) -> Eviction {
        self.algorithm
    }
    /// The `now` of the operation that removed it (unix ns): the sweep's or the ingest's.
    pub fn at_ns(&self) -> i64 {
        self.at_ns
    }
    /// Whether the entry belongs to a reserved tenant (the probe's).
    pub fn reserved(&self) -> bool {
        self.cat
            .tenants
            .get(&self.cat.tenant_of(self.key))
            .is_some_and(|t| t.reserved)
    }
    /// Tenant id.
    pub fn tenant(&self) -> &str {
        self.cat.strings.name(self.cat.scope_of(self.key).tenant)
    }
    /// Model id.
    pub fn model(&self) -> &str {
        self.cat.strings.name(self.cat.scope_of(self.key).model)
    }
    /// Hash scheme.
    pub fn hash_scheme(&self) -> &str {
        self.cat.strings.name(self.cat.scope_of(self.key).scheme)
    }
    /// Adapter id ("" = the base model).
    pub fn adapter(&self) -> &str {
        let ks = &self.cat.keyspaces[self.key.keyspace() as usize];
        self.cat.strings.name(ks.adapter)
    }
    /// The replica whose entry it is.
    pub fn replica(&self) -> &str {
        self.cat.strings.name(self.replica)
    }
    /// The prefix hash's wire bytes (8-byte hashes are materialised in `buf`).
    pub fn prefix_hash<'b>(&'b self, buf: &'b mut [u8; 8]) -> &'b [u8] {
        self.cat.hash_bytes(self.key, buf)
    }
}

/// Receives every entry the index removes on its own (see the module docs). Called on the
/// index's thread, synchronously, before the removal; it must not block.
pub type RemovalSink = Box<dyn FnMut(&Removed<'_>) + Send>;

impl Index {
    /// Installs (or, with `None`, removes) the removal sink. Without one (the default) the
    /// index reports nothing and pays one branch per removal.
    pub fn set_removal_sink(&mut self, sink: Option<RemovalSink>) {
        self.removal_sink = sink;
    }

    /// Reports `(key, replica)` to the sink, if any, before it is removed.
    #[inline]
    pub(crate) fn report_removal(
        &mut self,
        key: KeyId,
        replica: u32,
        reason: RemovalReason,
        algorithm: Eviction,
        at_ns: i64,
    ) {
        if let Some(sink) = self.removal_sink.as_mut() {
            sink(&Removed {
                cat: &self.cat,
                key,
                replica,
                reason,
                algorithm,
                at_ns,
            });
        }
    }
}
