//! The state one executor owns, in a thread-local: handlers reach it between awaits without
//! locks, and no other thread can.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use inferencecache_index::index::{
    Admission, CapBuildStep, CapSlice, CapVictim, EvictionCounts, Index, IndexConfig, PartBudget,
    QuotaVictim, RemovalSink, SweepBudget,
};
use inferencecache_index::policy::PolicyStore;
use inferencecache_proto::v1alpha1 as pb;

use crate::limits::{
    CAP_BUILD_SLICE_BUDGET, CAP_BUILD_SLICE_MAX_ENTRIES, CAP_ENFORCE_SLICE_MAX_EVICTIONS,
    CAP_ROUND_MAX_EVICTIONS, INGEST_PART_BLOCKS, INGEST_PART_BLOCKS_PER_CREATED,
    INGEST_PART_BUDGET, MAX_ID_BYTES, SWEEP_SLICE_BUDGET, SWEEP_SLICE_MAX_ENTRIES,
};
use crate::metrics;
use crate::sys::clock::unix_now_ns;

/// Why an ingest message was not applied, or not in full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IngestRefused {
    /// The core's string table cannot take the message's new names (in number or in bytes);
    /// nothing of the message was applied.
    StringTableFull,
    /// A name (tenant, model, replica, scheme, adapter) is longer than [`MAX_ID_BYTES`];
    /// nothing of the message was applied.
    IdTooLong,
    /// The message would create a keyspace (a new adapter of its scope) beyond the bound per
    /// `(tenant, model)` or per core; nothing of the message was applied.
    KeyspacesFull,
    /// The message's replica does not serve in its scope `(tenant, model, hash scheme)` yet
    /// and the scope already has the maximum number of serving replicas; nothing of the
    /// message was applied.
    ScopeReplicasFull,
    /// Some prefix key of the message already had the maximum number of holders, so this
    /// replica was not added to it; the rest of the message was applied.
    KeyHoldersFull,
    /// Some new prefix key of the message did not fit the core's key table (~100M keys, past
    /// any core's memory); the rest of the message was applied.
    IndexKeysFull,
    /// Some block of the message would have given its replica more than the most separate
    /// stretches of one run of chain blocks (`runstore::MAX_REPLICA_EXTENTS`); that block was
    /// not applied, the rest of the message was.
    RunExtentsFull,
    /// The message's stats would have been one stats row too many (per model or per core) and
    /// were not stored; the rest of the message was applied.
    StatsRowsFull,
}

impl IngestRefused {
    /// Whether nothing of the message was applied (as opposed to a full key or stats table,
    /// where the rest was).
    pub fn is_whole(self) -> bool {
        matches!(
            self,
            Self::StringTableFull | Self::IdTooLong | Self::KeyspacesFull | Self::ScopeReplicasFull
        )
    }

    /// The `Ack.reason_code` of a stream with a refused message.
    pub fn reason_code(self) -> &'static str {
        match self {
            Self::StringTableFull => "STRING_TABLE_FULL",
            Self::IdTooLong => "ID_TOO_LONG",
            Self::KeyspacesFull => "KEYSPACES_FULL",
            Self::ScopeReplicasFull => "SCOPE_REPLICAS_FULL",
            Self::KeyHoldersFull => "KEY_HOLDERS_FULL",
            Self::IndexKeysFull => "INDEX_KEYS_FULL",
            Self::RunExtentsFull => "RUN_EXTENTS_FULL",
            Self::StatsRowsFull => "STATS_ROWS_FULL",
        }
    }

    /// The `reason` label of `inferencecache_ingest_refused_total`.
    pub fn metric_label(self) -> &'static str {
        match self {
            Self::StringTableFull => "string_table_full",
            Self::IdTooLong => "id_too_long",
            Self::KeyspacesFull => "keyspaces_full",
            Self::ScopeReplicasFull => "scope_replicas_full",
            Self::KeyHoldersFull => "key_holders_full",
            Self::IndexKeysFull => "index_keys_full",
            Self::RunExtentsFull => "run_extents_full",
            Self::StatsRowsFull => "stats_rows_full",
        }
    }

    /// Checks the names an update would intern against [`MAX_ID_BYTES`].
    pub fn check_ids(u: &pb::CacheStateUpdate) -> Result<(), IngestRefused> {
        let names = [
            &u.tenant_id,
            &u.model_id,
            &u.replica_id,
            &u.hash_scheme,
            &u.adapter_id,
        ];
        let too_long = names.iter().any(|n| n.len() > MAX_ID_BYTES)
            || u.prefixes.iter().any(|p| p.adapter_id.len() > MAX_ID_BYTES);
        if too_long {
            Err(IngestRefused::IdTooLong)
        } else {
            Ok(())
        }
    }
}

/// The global-cap (and tenant quota) victims an operation may take on a core
/// ([`CoreState::cap_slice_before`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CapNeed {
    /// None (events, GetCacheState, evictions of victims already chosen).
    Nothing,
    /// An ingest of this many entries for `tenant`: cap and quota victims on this core when it
    /// evicts by itself (one core).
    Ingest {
        new_entries: usize,
        tenant: Arc<str>,
    },
    /// This many candidates for a cross-core selection (`CoreState::cap_candidates`).
    Candidates(usize),
    /// This many of `tenant`'s quota candidates for a cross-core selection
    /// (`Index::quota_candidates`).
    QuotaCandidates { tenant: Arc<str>, k: usize },
    /// The evictions an ingest left owed on this core (`CoreState::cap_enforce_slice`).
    Owed,
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
    /// Whether `index_keyspaces_full` was already logged on this core.
    warned_keyspaces_full: bool,
    /// The waiting cap prebuild loop (runtime), woken when an operation may have made a
    /// build ahead of need wanted, so an idle core need not poll for it.
    cap_prebuild_waker: Option<Waker>,
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
        let mut index = Index::new(config);
        // ALL_CLEARED leaves its removals to slices the runtime drives (`clear_slice_if_pending`),
        // and an ingest over the global cap most of its evictions (`cap_enforce_slice`).
        index.set_sliced_clears(true);
        index.set_sliced_cap(Some(cap_enforce_budget()));
        Self {
            core,
            ingested: 0,
            policy: Arc::new(PolicyStore::empty()),
            index,
            warned_string_table_full: false,
            warned_keyspaces_full: false,
            cap_prebuild_waker: None,
        }
    }

    /// Installs the index's removal hook: `sink` is told of every entry the TTL sweep
    /// ([`Self::sweep`]), the global cap or a tenant quota ([`Self::ingest`]) removes, before it
    /// goes. `None` (the default) reports nothing.
    pub fn with_removal_sink(mut self, sink: Option<RemovalSink>) -> Self {
        self.index.set_removal_sink(sink);
        self
    }

    /// Replaces this core's policy snapshot. The eviction order may depend on it, so the index
    /// is told to drop cached victim candidates.
    pub fn set_policy(&mut self, policy: Arc<PolicyStore>) {
        self.policy = policy;
        self.index.rules_changed();
        self.nudge_cap_prebuild();
    }

    #[cfg(test)]
    /// Applies one ReportCacheState message (in as many parts as its budget needs); `Err` when
    /// it was refused whole (nothing of it was applied) or applied only in part (a full key, a
    /// full stats table), so the stream's Ack must not claim it.
    pub fn ingest(&mut self, update: &pb::CacheStateUpdate) -> Result<(), IngestRefused> {
        let (mut start, mut partial) = (0, None);
        let mut admission = Admission::default();
        loop {
            let (applied, end) =
                self.ingest_part(update, start..update.prefixes.len(), &mut admission);
            match applied {
                Err(why) if why.is_whole() => return Err(why),
                Err(why) => partial = partial.or(Some(why)),
                Ok(()) => {}
            }
            if end >= update.prefixes.len() {
                return partial.map_or(Ok(()), Err);
            }
            start = end;
        }
    }

    /// One part of [`Self::ingest`]: the prefixes `update.prefixes[range]`, or fewer when they
    /// would take the core longer than one step should (the index's `ingest_part_within`:
    /// [`INGEST_PART_BLOCKS`] with each name or keyspace created counting
    /// [`INGEST_PART_BLOCKS_PER_CREATED`], and at most [`INGEST_PART_BUDGET`]; the first part
    /// checks the whole update's fit, the last stores its stats and enforces quota and cap). Returns the outcome and the end of
    /// what it applied: the caller applies the rest from there. `ingest::apply_update` applies
    /// a large update in parts. An attempt may only advance the check that the part's names
    /// and keyspaces fit (`admission`, the caller's across attempts): it then applies nothing
    /// and returns `range.start`.
    pub fn ingest_part(
        &mut self,
        update: &pb::CacheStateUpdate,
        range: std::ops::Range<usize>,
        admission: &mut Admission,
    ) -> (Result<(), IngestRefused>, usize) {
        let budget = PartBudget {
            blocks: INGEST_PART_BLOCKS,
            blocks_per_created: INGEST_PART_BLOCKS_PER_CREATED,
            deadline: Some(Instant::now() + INGEST_PART_BUDGET),
        };
        let (out, applied_to) = self.index.ingest_part_admitted(
            update,
            range.clone(),
            budget,
            admission,
            unix_now_ns(),
            &*self.policy,
        );
        if out.admission_pending {
            metrics::record_admission_step();
            return (Ok(()), applied_to);
        }
        let whole = range.start == 0 && applied_to >= update.prefixes.len();
        if applied_to >= update.prefixes.len() {
            self.ingested += 1;
        }
        if !whole {
            metrics::record_ingest_part();
        }
        (self.record_ingest_outcome(update, out), applied_to)
    }

    /// Counts one part's outcome; `Err` when it was refused whole or applied only in part.
    fn record_ingest_outcome(
        &mut self,
        update: &pb::CacheStateUpdate,
        out: inferencecache_index::index::IngestOutcome,
    ) -> Result<(), IngestRefused> {
        metrics::record_cap_builds_sync(self.index.take_cap_sync_builds());
        metrics::record_quota_builds_sync(self.index.take_quota_sync_builds());
        metrics::record_clears_sync(self.index.take_clear_sync_finishes());
        self.nudge_cap_prebuild();
        if out.rejected_string_table_full {
            if !self.warned_string_table_full {
                // Logged once per core: every later refusal has the same cause; the metric
                // counts each one.
                self.warned_string_table_full = true;
                tracing::warn!(core = self.core, "index_string_table_full");
            }
            metrics::record_ingest_refused(IngestRefused::StringTableFull.metric_label());
            return Err(IngestRefused::StringTableFull);
        }
        if out.rejected_keyspaces_full {
            if !self.warned_keyspaces_full {
                self.warned_keyspaces_full = true;
                tracing::warn!(core = self.core, "index_keyspaces_full");
            }
            metrics::record_limit_hit("index_keyspaces");
            metrics::record_ingest_refused(IngestRefused::KeyspacesFull.metric_label());
            return Err(IngestRefused::KeyspacesFull);
        }
        if out.rejected_scope_replicas_full {
            metrics::record_limit_hit("index_scope_replicas");
            metrics::record_ingest_refused(IngestRefused::ScopeReplicasFull.metric_label());
            return Err(IngestRefused::ScopeReplicasFull);
        }
        metrics::record_ingest(out.upserts);
        if out.timestamp_clamped {
            metrics::record_timestamp_clamped();
        }
        if out.quota_evicted_keys > 0 {
            metrics::record_tenant_evictions(&update.tenant_id, out.quota_evicted_keys);
        }
        record_evictions(out.cap_evicted, "cap");
        self.publish_gauge();
        let partial = if out.keys_refused > 0 {
            metrics::record_limit_hit("index_keys");
            Some(IngestRefused::IndexKeysFull)
        } else if out.holders_refused > 0 {
            Some(IngestRefused::KeyHoldersFull)
        } else if out.extents_refused > 0 {
            metrics::record_limit_hit("index_run_extents");
            Some(IngestRefused::RunExtentsFull)
        } else if out.stats_refused {
            Some(IngestRefused::StatsRowsFull)
        } else {
            None
        };
        match partial {
            Some(why) => {
                metrics::record_ingest_refused(why.metric_label());
                Err(why)
            }
            None => Ok(()),
        }
    }

    /// The tenant quota in force for `tenant` (§7.1), `None` when unbounded.
    pub fn quota_for(&self, tenant: &str) -> Option<u64> {
        if tenant == inferencecache_index::PROBE_TENANT {
            return None;
        }
        self.policy.quota(tenant)
    }

    /// This core's `k` first global-cap candidates (§7.2), for a cross-core victim selection.
    /// Without `build`, `None` where they would be built in one go (stale snapshots used the
    /// heap up): the caller readies them in slices and asks again (`evict::Pending`).
    pub fn cap_candidates(&mut self, k: usize, build: bool) -> Option<Vec<CapVictim>> {
        let c = if build {
            Some(self.index.cap_candidates(k, &*self.policy))
        } else {
            self.index.cap_candidates_ready(k, &*self.policy)
        };
        metrics::record_cap_builds_sync(self.index.take_cap_sync_builds());
        metrics::record_clears_sync(self.index.take_clear_sync_finishes());
        self.nudge_cap_prebuild();
        c
    }

    /// This core's `k` first quota candidates of `tenant` (§7.1), for a cross-core victim
    /// selection (readied in slices first: `CapNeed::QuotaCandidates`).
    pub fn quota_candidates(&mut self, tenant: &str, k: usize) -> Vec<QuotaVictim> {
        let c = self.index.quota_candidates(tenant, k);
        metrics::record_quota_builds_sync(self.index.take_quota_sync_builds());
        metrics::record_clears_sync(self.index.take_clear_sync_finishes());
        c
    }

    /// Evicts the given global-cap victims held by this core (chosen across cores); counts
    /// them and re-publishes the entries gauge. Returns the number removed.
    pub fn evict_cap(&mut self, victims: &[CapVictim]) -> u64 {
        let c = self.index.evict_cap_victims(victims, unix_now_ns());
        record_evictions(c, "cap");
        metrics::record_cap_enforce_slice();
        self.publish_gauge();
        self.nudge_cap_prebuild();
        c.total()
    }

    /// Evicts the given quota victims of `tenant` held by this core (chosen across cores);
    /// counts them and re-publishes the entries gauge. Returns the number of keys removed.
    pub fn evict_quota(&mut self, tenant: &str, victims: &[QuotaVictim]) -> u64 {
        let n = self
            .index
            .evict_quota_victims(tenant, victims, unix_now_ns());
        metrics::record_tenant_evictions(tenant, n);
        self.publish_gauge();
        self.nudge_cap_prebuild();
        n
    }

    /// Applies one PublishEvent.
    pub fn apply_event(&mut self, event: &pb::CacheEvent) {
        let out = self.index.apply_event(event, unix_now_ns(), &*self.policy);
        metrics::record_clears_sync(self.index.take_clear_sync_finishes());
        if out.timestamp_clamped {
            metrics::record_timestamp_clamped();
        }
        self.publish_gauge();
        self.nudge_cap_prebuild();
    }

    /// Begins a TTL sweep pass (§6) at the current time; [`Self::sweep_slice`] runs it.
    pub fn sweep_begin(&mut self) {
        self.index.sweep_begin(unix_now_ns());
    }

    /// One slice of a pending `ALL_CLEARED`'s removals (index `clear` module), within
    /// [`SWEEP_SLICE_BUDGET`] and [`SWEEP_SLICE_MAX_ENTRIES`] (the sweep's test hook bounds it
    /// too). Returns whether one was pending: an operation that needs the store after the clear
    /// waits for it instead of running (`mailbox::call_after_clear`), and the sweep and cap
    /// build loops run these slices before their own.
    pub fn clear_slice_if_pending(&mut self) -> bool {
        if !self.index.clear_pending() {
            return false;
        }
        self.index.clear_step(sweep_budget());
        metrics::record_clear_slice();
        self.publish_gauge();
        self.nudge_cap_prebuild();
        true
    }

    /// Runs one slice of the sweep pass in progress, within [`SWEEP_SLICE_BUDGET`] and
    /// [`SWEEP_SLICE_MAX_ENTRIES`]; re-publishes the entries gauge, and once the pass finished
    /// records its TTL evictions. Returns whether the pass finished. A pending `ALL_CLEARED`
    /// takes the slice instead (the pass goes on after it).
    pub fn sweep_slice(&mut self) -> bool {
        if self.clear_slice_if_pending() {
            return false;
        }
        let budget = sweep_budget();
        let step = self.index.sweep_step(&*self.policy, budget);
        self.publish_gauge();
        self.nudge_cap_prebuild();
        match step.finished {
            Some(out) => {
                record_evictions(out.ttl_evicted, "ttl");
                true
            }
            None => !self.index.sweep_in_progress(),
        }
    }

    /// Before an operation that may take global-cap victims on this core while they are not
    /// ready (a policy change, a heap used up): one slice of building them (or of re-resolving
    /// the algorithms) instead, so the operation does not build them in one O(entries) step
    /// while lookups wait. Returns whether it ran one; the caller retries the operation after a
    /// pause (`mailbox::call_after_maintenance`).
    /// The same for the tenant quota: an ingest (or a cross-core quota candidate request) whose
    /// tenant's quota heap is not ready first runs slices of its build, instead of one scan of
    /// every key of the core inside the ingest.
    pub fn cap_slice_before(&mut self, need: &CapNeed) -> bool {
        if self.quota_slice_before(need) {
            return true;
        }
        let victims = match *need {
            CapNeed::Nothing | CapNeed::QuotaCandidates { .. } => 0,
            CapNeed::Ingest { new_entries, .. } => self.index.cap_victims_for_ingest(new_entries),
            CapNeed::Candidates(k) => k,
            CapNeed::Owed => self.index.cap_victims_owed(),
        };
        if !self.index.cap_victims_pending(victims) {
            return false;
        }
        self.index
            .cap_victims_step(victims, &*self.policy, cap_build_budget());
        metrics::record_cap_slice_on_demand();
        true
    }

    /// [`Self::cap_slice_before`] for the tenant quota: one slice of readying the quota victims
    /// `need` takes on this core, when they are not ready. Returns whether it ran one.
    fn quota_slice_before(&mut self, need: &CapNeed) -> bool {
        let (tenant, victims) = match need {
            CapNeed::Ingest {
                new_entries,
                tenant,
            } => match self.quota_for(tenant) {
                Some(budget) => (
                    tenant,
                    self.index
                        .quota_victims_for_ingest(tenant, budget, *new_entries),
                ),
                None => return false,
            },
            CapNeed::QuotaCandidates { tenant, k } => (tenant, *k),
            _ => return false,
        };
        if !self.index.quota_victims_pending(tenant, victims) {
            return false;
        }
        self.index
            .quota_victims_step(tenant, victims, cap_build_budget());
        metrics::record_quota_slice_on_demand();
        true
    }

    /// One slice of the global-cap evictions an ingest left owed on this core (one core: the
    /// ingest evicted one slice's worth itself, `evict::pending`), within the cap build's slice
    /// budget. Returns whether none are owed any more.
    pub fn cap_enforce_slice(&mut self) -> bool {
        let mut counts = EvictionCounts::default();
        let done = self.index.cap_enforce_step(
            &*self.policy,
            &mut counts,
            unix_now_ns(),
            cap_enforce_budget().budget(),
        );
        record_evictions(counts, "cap");
        metrics::record_cap_enforce_slice();
        self.publish_gauge();
        self.nudge_cap_prebuild();
        done
    }

    /// Whether this core should build its next global-cap candidate heap ahead of need (or is
    /// building it): [`Self::cap_build_slice`] does the work.
    pub fn cap_prebuild_wanted(&self) -> bool {
        self.index.cap_prebuild_wanted()
    }

    /// One slice of the cap candidate build ahead of need, within [`CAP_BUILD_SLICE_BUDGET`]
    /// and [`CAP_BUILD_SLICE_MAX_ENTRIES`] (the sweep's test hook bounds it too): whether it
    /// started, finished (and installed) a build, or left one in progress.
    pub fn cap_build_slice(&mut self) -> CapBuildStep {
        if self.clear_slice_if_pending() {
            // The build reads the store: after the clear.
            return CapBuildStep {
                in_progress: true,
                ..CapBuildStep::default()
            };
        }
        let budget = cap_build_budget();
        if self.index.algorithms_pending() {
            // After a policy install: the tenants' eviction algorithms first, in slices.
            let entries = self.index.algorithms_step(&*self.policy, budget);
            return CapBuildStep {
                entries,
                in_progress: self.index.cap_prebuild_wanted(),
                ..CapBuildStep::default()
            };
        }
        self.index.cap_prebuild_step(budget)
    }

    /// `Ready` when a cap candidate build ahead of need is wanted; otherwise registers `cx`'s
    /// waker, which the next operation that may want one wakes.
    pub fn poll_cap_prebuild_wanted(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.index.cap_prebuild_wanted() {
            self.cap_prebuild_waker = None;
            return Poll::Ready(());
        }
        self.cap_prebuild_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Wakes the waiting cap prebuild loop if a build ahead of need is wanted now (a few
    /// comparisons; the loop itself runs later, between requests).
    fn nudge_cap_prebuild(&mut self) {
        if self.cap_prebuild_waker.is_some()
            && self.index.cap_prebuild_wanted()
            && let Some(w) = self.cap_prebuild_waker.take()
        {
            w.wake();
        }
    }

    /// At start (before serving), after [`Self::build_cap_candidates_at_start`]: allocates the
    /// buffers builds ahead of need use, for this core's share of the cap over `shards` cores.
    pub fn reserve_cap_buffers(&mut self, shards: usize) {
        self.index.reserve_cap_buffers(shards);
    }

    /// At start (before serving): builds the cap candidates in one go when a build ahead of need
    /// is wanted (a restored index near the cap), so the first ingests find them ready.
    pub fn build_cap_candidates_at_start(&mut self) {
        self.index
            .algorithms_step(&*self.policy, SweepBudget::UNBOUNDED);
        if self.index.cap_prebuild_wanted() {
            self.index.cap_prebuild_step(SweepBudget::UNBOUNDED);
        }
    }

    /// GetCacheState for `(tenant, model)`. Its prefix count includes keys a pending
    /// `ALL_CLEARED` is still removing: the gRPC handler waits for the clear
    /// (`mailbox::call_after_clear`); the stats rows (all the PD route reads) are final at once.
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

    /// Publishes the per-model entries gauge of what was restored before this core started
    /// (called on the core, once its metrics are registered).
    pub fn publish_restored_gauge(&mut self) {
        self.publish_gauge();
    }

    /// Re-publishes the per-model entries gauge for models whose count changed on this core.
    fn publish_gauge(&mut self) {
        self.index.drain_gauge_updates(|model, count| {
            metrics::publish_index_entries(model, count as i64)
        });
        for _ in 0..self.index.take_extent_tails_dropped() {
            metrics::record_limit_hit("index_run_extents");
        }
    }
}

/// A cap build slice's budget: [`CAP_BUILD_SLICE_BUDGET`] from now,
/// [`CAP_BUILD_SLICE_MAX_ENTRIES`] (or the sweep's test hook bound).
fn cap_build_budget() -> SweepBudget {
    SweepBudget {
        max_entries: crate::sys::test_hooks::sweep_slice_entries()
            .unwrap_or(CAP_BUILD_SLICE_MAX_ENTRIES),
        deadline: Some(Instant::now() + CAP_BUILD_SLICE_BUDGET),
    }
}

/// How much of the global cap's evictions one step runs on a core when an ingest took the
/// index over it: [`CAP_BUILD_SLICE_BUDGET`], [`cap_enforce_max_evictions`].
fn cap_enforce_budget() -> CapSlice {
    CapSlice {
        max_evictions: cap_enforce_max_evictions(),
        time: CAP_BUILD_SLICE_BUDGET,
    }
}

/// Global-cap evictions one step runs at most: [`CAP_ENFORCE_SLICE_MAX_EVICTIONS`], or the
/// sweep's test hook bound (so the end-to-end tests' small indexes evict in many steps).
pub fn cap_enforce_max_evictions() -> usize {
    crate::sys::test_hooks::sweep_slice_entries().unwrap_or(CAP_ENFORCE_SLICE_MAX_EVICTIONS)
}

/// Global-cap evictions one cross-core round takes at most: [`CAP_ROUND_MAX_EVICTIONS`], or
/// the test hook's bound.
pub fn cap_round_max_evictions() -> usize {
    crate::sys::test_hooks::sweep_slice_entries().unwrap_or(CAP_ROUND_MAX_EVICTIONS)
}

/// A sweep slice's budget: [`SWEEP_SLICE_BUDGET`] from now, [`SWEEP_SLICE_MAX_ENTRIES`] (or the
/// test hook's bound).
fn sweep_budget() -> SweepBudget {
    SweepBudget {
        max_entries: crate::sys::test_hooks::sweep_slice_entries()
            .unwrap_or(SWEEP_SLICE_MAX_ENTRIES),
        deadline: Some(Instant::now() + SWEEP_SLICE_BUDGET),
    }
}

fn record_evictions(c: EvictionCounts, reason: &'static str) {
    if c.lru > 0 {
        metrics::record_index_evictions("lru", reason, c.lru);
    }
    if c.lfu > 0 {
        metrics::record_index_evictions("lfu", reason, c.lfu);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn update(keys: std::ops::Range<u32>) -> pb::CacheStateUpdate {
        pb::CacheStateUpdate {
            replica_id: "r".into(),
            tenant_id: "t".into(),
            model_id: "m".into(),
            hash_scheme: "vllm".into(),
            timestamp_us: unix_now_ns() / 1000,
            prefixes: keys
                .map(|k| pb::PrefixEntry {
                    prefix_hash: k.to_be_bytes().to_vec(),
                    token_count: 16,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    /// The need of an ingest of `new_entries` entries of tenant `t`.
    fn ingest(new_entries: usize) -> CapNeed {
        CapNeed::Ingest {
            new_entries,
            tenant: "t".into(),
        }
    }

    /// Runs the cap's owed slices and eviction steps until none is left, as `evict::Pending`
    /// runs them between reactor turns.
    fn drain_cap_steps(st: &mut CoreState) {
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(steps < 10_000, "the steps make progress");
            if st.cap_slice_before(&CapNeed::Owed) {
                continue;
            }
            if st.cap_enforce_slice() {
                break;
            }
        }
    }

    /// After a policy change (or with a heap too small for the message), an ingest that would
    /// evict at the cap first runs the cap build in slices (each bounded, the core free between
    /// two) instead of building its victims in one go: no build on the ingest.
    #[test]
    fn an_ingest_at_the_cap_waits_for_its_victims_in_slices() {
        let config = IndexConfig {
            max_entries: 40_000,
            rules_change_notified: true,
            ..Default::default()
        };
        let mut st = CoreState::new(0, config);
        for part in 0..10 {
            st.ingest(&update(part * 4_000..(part + 1) * 4_000))
                .unwrap();
        }
        st.build_cap_candidates_at_start();
        st.set_policy(Arc::new(PolicyStore::empty()));
        assert!(!st.cap_slice_before(&ingest(0)), "nothing new: no wait");
        let mut slices = 0;
        while st.cap_slice_before(&ingest(16)) {
            slices += 1;
            assert!(slices < 10_000, "the slices make progress");
        }
        // The algorithms, then at least 40,000 / CAP_BUILD_SLICE_MAX_ENTRIES build slices.
        assert!(slices >= 4, "{slices} slices");
        st.ingest(&update(40_000..40_016)).unwrap();
        assert_eq!(st.index.take_cap_sync_builds(), 0, "no build on the ingest");
        // The ingest's cap step ends by its part's deadline (after one eviction at least): on
        // a loaded machine (a debug build, the other tests on the same cores) some of the 16
        // evictions are left to the steps that follow, as `evict::Pending` runs them.
        drain_cap_steps(&mut st);
        assert_eq!(st.index.entry_count(), 40_000);
        // A message that evicts more than the live heap holds: a bigger build, in slices.
        assert!(st.cap_slice_before(&ingest(8_000)), "the heap holds fewer");
        while st.cap_slice_before(&ingest(8_000)) {}
        st.ingest(&update(50_000..58_000)).unwrap();
        // The ingest evicted one step's worth; the rest in steps, as `evict::Pending` runs them.
        assert!(st.index.entry_count() > 40_000);
        drain_cap_steps(&mut st);
        assert_eq!(st.index.take_cap_sync_builds(), 0, "no build on the ingest");
        assert_eq!(st.index.entry_count(), 40_000);
        assert!(!st.cap_slice_before(&ingest(0)), "nothing new: no wait");
    }

    /// A tenant at its quota on a core of many keys (most of another tenant): its ingest first
    /// runs the quota heap build in slices (each bounded), not one scan of every key of the
    /// core inside the ingest.
    #[test]
    fn an_ingest_at_the_quota_waits_for_its_victims_in_slices() {
        let mut st = CoreState::new(0, IndexConfig::default());
        let body = br#"{"version":7,"tenants":[{"tenantID":"t","maxIndexEntries":1000}]}"#;
        let policy = inferencecache_index::policy::parse_policy_body(body).expect("policy");
        st.set_policy(Arc::new(policy));
        for part in 0..10 {
            let mut u = update(part * 4_000..(part + 1) * 4_000);
            u.tenant_id = "other".into();
            st.ingest(&u).unwrap();
        }
        st.ingest(&update(0..1_000)).unwrap();
        assert!(!st.cap_slice_before(&ingest(0)), "at the quota: no wait");
        let mut slices = 0;
        while st.cap_slice_before(&ingest(16)) {
            slices += 1;
            assert!(slices < 10_000, "the slices make progress");
        }
        // 41,000 key records, at most CAP_BUILD_SLICE_MAX_ENTRIES a slice.
        assert!(slices >= 3, "{slices} slices");
        st.ingest(&update(50_000..50_016)).unwrap();
        assert_eq!(
            st.index.take_quota_sync_builds(),
            0,
            "no build on the ingest"
        );
        assert_eq!(st.index.entry_count(), 41_000);
        assert!(!st.cap_slice_before(&ingest(16)), "the heap is ready");
    }

    /// An idle core sleeps until an ingest brings the index near the cap, and that ingest
    /// wakes the prebuild loop at once (not at the next safety-net poll).
    #[test]
    fn an_ingest_near_the_cap_wakes_the_prebuild_loop() {
        let mut st = CoreState::new(
            0,
            IndexConfig {
                max_entries: 16,
                ..Default::default()
            },
        );
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(st.poll_cap_prebuild_wanted(&mut cx).is_pending(), "empty");
        st.ingest(&update(0..4)).unwrap();
        assert_eq!(counter.0.load(Ordering::SeqCst), 0, "far from the cap");
        st.ingest(&update(4..14)).unwrap();
        assert_eq!(counter.0.load(Ordering::SeqCst), 1, "near the cap");
        assert!(st.poll_cap_prebuild_wanted(&mut cx).is_ready());
    }
}
