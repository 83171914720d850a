//! One core's KV-cache routing index (docs/BEHAVIOUR.md §3–§9, §11, §14, §16).
//!
//! The server owns one [`Index`] per core and routes every request of a `(tenant, model)` pair to
//! the same core, so every per-(tenant, model) and per-scope structure here is core-local. The
//! index is single-threaded (`&mut self`, no locks); time is always passed in (`now`, unix ns)
//! so tests inject the clock. The few facts that span cores (is a tenant known anywhere, is the
//! whole index empty, global entry count, per-tenant key count) live in the shared
//! [`Directory`](crate::directory::Directory).
//!
//! Module map:
//! * [`ranking`] — pure float32 formulas (freshness, distinguishing power, scores, tiers);
//! * `intern` — string ids and out-of-line hash blobs;
//! * `store` — the prefix map: the run store ([`crate::runstore`]) behind the index's key ids;
//! * this file — the catalog (scopes, keyspaces, model scopes, tenants), the upsert/remove
//!   primitives with their secondary counters, ingest (§4) and events (§5);
//! * `lookup` — exact, chain, TENANT_HOT, miss classifier, orchestrator, affinity, LFU credit;
//! * `eviction` — TTL sweep, tenant quota, global cap (candidate heaps);
//! * `removal` — the optional sink told of every entry the index removes on its own;
//! * `aggregate` — GetCacheState, `/snapshot` parts and their merge, the entries gauge;
//! * `persist` — warm restart: sliced export and record-by-record restore;
//! * `reclaim` — the sliced pass that frees records and names nothing refers to any more;
//! * `clear` — `ALL_CLEARED` in slices.

mod admission;
mod aggregate;
mod clear;
mod eviction;
mod intern;
mod lookup;
mod persist;
pub mod ranking;
mod reclaim;
mod removal;
mod slotmap;
mod store;

use admission::Admit;
pub use admission::{ADMISSION_STEP_PREFIXES, Admission};
pub use aggregate::{
    CacheState, EntriesGauge, PartReplica, PartStats, ReplicaRow, SnapshotPart,
    SnapshotPartBuilder, SnapshotRows, TenantRow, merge_snapshot_parts,
};
pub use eviction::{
    CapBuildStep, CapSlice, CapVictim, QuotaVictim, SweepBudget, SweepStep, select_victims,
};
pub use lookup::{BlockHashes, LfuHit, LookupQuery, LookupView, Score, Strategy, StridedHashes};
pub use persist::{EntryCursor, PersistEntry, PersistStats, RestoreCache, RestoreOutcome};
pub use ranking::RankerConfig;
pub use removal::{RemovalReason, RemovalSink, Removed};

use crate::PROBE_TENANT;
use crate::directory::{Directory, EntryCounter, TenantFp, TenantSlotHint};
use crate::rules::{Eviction, TenantRules};
use eviction::{CapState, QuotaState};
use hashbrown::HashMap;
use inferencecache_proto::v1alpha1::{
    CacheEvent, CacheStateUpdate, PrefixEntry, ReplicaStats, cache_event,
};
use intern::{Blobs, Strings};
use slotmap::{NO_SLOT, SlotMap};
use std::cell::Cell;
use std::sync::Arc;
use store::{BLOB_FLAG, ChainCursor, Holder, HolderUpsert, KEYSPACE_LIMIT, KeyId, Store};

pub use intern::MAX_STRINGS;

/// Default TTL (§3.1): 30 minutes in ns.
pub const DEFAULT_TTL_NS: i64 = 30 * 60 * 1_000_000_000;
/// Default global cap (§3.1) in storage entries; 0 = unbounded.
pub const DEFAULT_MAX_ENTRIES: u64 = 1_000_000;

/// How far ahead of the server's clock a producer timestamp may be. Later stamps are taken as
/// `now + skew`, so an entry stamped in the future (a wrong clock, year 2300, `i64::MAX`)
/// expires at most `skew` after a correctly stamped one instead of never.
pub const DEFAULT_MAX_FUTURE_SKEW_NS: i64 = 2 * 60 * 1_000_000_000;

/// Default bound on the bytes of the names (tenant, model, replica, scheme, adapter) one core
/// interns; an update whose new names would exceed it is refused (`STRING_TABLE_FULL`).
pub const DEFAULT_MAX_STRING_BYTES: usize = 256 << 20;

/// Default bound on the replicas holding one prefix key; a further replica's upsert of that key
/// is refused (the rest of the update is applied, the stream's Ack says `KEY_HOLDERS_FULL`).
pub const DEFAULT_MAX_HOLDERS_PER_KEY: usize = 1024;

/// Default bound on the replicas serving in one scope `(tenant, model, hash scheme)` (holding
/// at least one of its prefix keys): an update of a replica not serving there yet that would be
/// one more is refused whole (`SCOPE_REPLICAS_FULL`). A scope keeps its serving replicas in a
/// table and a name-sorted list (the affinity candidates): a new one is inserted into the list
/// (a memmove of the list), one that stops serving is taken out of it, and the reclaim pass
/// marks all of them in one step; the bound keeps each of those within a maintenance slice.
pub const DEFAULT_MAX_REPLICAS_PER_SCOPE: usize = 16_384;

/// Default bound on the stats rows (replicas) of one `(tenant, model)`; a further replica's
/// stats are refused (`STATS_ROWS_FULL`).
pub const DEFAULT_MAX_STATS_ROWS_PER_MODEL: usize = 1024;

/// Default bound on the stats rows of one core, all models together (`STATS_ROWS_FULL`).
pub const DEFAULT_MAX_STATS_ROWS: usize = 1 << 20;

/// Default bound on the distinct keyspaces (adapters, across hash schemes) of one
/// `(tenant, model)`: an update that would create one more is refused whole (`KEYSPACES_FULL`).
/// Small enough that the loops over one model's keyspaces (a `PREFIX_EVICTED` event without an
/// adapter probes every one of them) finish well within a maintenance slice.
pub const DEFAULT_MAX_KEYSPACES_PER_MODEL: usize = 4096;

/// Default bound on the keyspaces of one core, all `(tenant, model)`s together
/// (`KEYSPACES_FULL`).
pub const DEFAULT_MAX_KEYSPACES: usize = 1 << 20;

/// How long an ingest that found the string table or the keyspace table full may spend on the
/// reclaim pass before it gives up and refuses (the maintenance task finishes the pass in its
/// own slices).
pub const RECLAIM_ON_FULL_BUDGET: std::time::Duration = std::time::Duration::from_micros(250);

/// When the string table is full, the reclaim pass runs at once (instead of waiting for the
/// next sweep) at most this often per core, so a full table of live names cannot make every
/// refused update pay a pass.
pub const RECLAIM_ON_FULL_INTERVAL_NS: i64 = 1_000_000_000;

/// Marks a freed scope, keyspace or model-scope record.
const DEAD: u32 = u32::MAX;

/// Construction parameters of one core's index.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// TTL for tenants whose policy gives none; non-positive → [`DEFAULT_TTL_NS`].
    pub default_ttl_ns: i64,
    /// Global cap on non-reserved storage entries across all cores; 0 = unbounded. Enforced at
    /// ingest against the directory's global count; victims come from this core's entries,
    /// unless [`IndexConfig::cross_core_eviction`] defers the choice to a cross-core selection
    /// (see the `eviction` module docs).
    pub max_entries: u64,
    /// Ranker knobs (§9.1).
    pub ranker: RankerConfig,
    /// Cross-core counters, shared by every core's index.
    pub directory: Arc<Directory>,
    /// This core's number (diagnostics only).
    pub core_id: usize,
    /// Producer timestamps later than `now` plus this are clamped to it; negative → 0.
    pub max_future_skew_ns: i64,
    /// Distinct names this core may hold at once (at most [`MAX_STRINGS`]).
    pub max_strings: usize,
    /// Bytes of the names this core may hold at once.
    pub max_string_bytes: usize,
    /// Replicas that may hold one prefix key (at least 1).
    pub max_holders_per_key: usize,
    /// Replicas that may serve in one scope `(tenant, model, hash scheme)` (at least 1).
    pub max_replicas_per_scope: usize,
    /// Stats rows of one `(tenant, model)`.
    pub max_stats_rows_per_model: usize,
    /// Stats rows of this core.
    pub max_stats_rows: usize,
    /// Keyspaces (distinct adapters) of one `(tenant, model)`.
    pub max_keyspaces_per_model: usize,
    /// Keyspaces of this core.
    pub max_keyspaces: usize,
    /// Several cores: [`Index::ingest`] does not enforce the tenant quota and the global cap
    /// itself; the caller runs the cross-core victim selection afterwards
    /// ([`Index::quota_candidates`], [`Index::cap_candidates`], [`select_victims`]), so the
    /// victims are the globally first ones in the reference's order (docs/BEHAVIOUR.md §7.1,
    /// §7.2). False (one core): ingest evicts from this core's entries, which are all of them.
    pub cross_core_eviction: bool,
    /// Called with the address and byte length of each large buffer the index allocates to
    /// fill a little at a time over many maintenance slices (a cap candidate selection, up to
    /// `entries / 8` snapshots), before anything is written to it. The server keeps transparent
    /// huge pages off that range: the allocator asks for them, and each 2 MiB first-touch fault
    /// (≈ 20 ms on this project's VM, perf/RESULTS.md) would land whole in one slice, where 4 KiB
    /// faults spread over many. `None`: nothing is called.
    pub gradual_buffer_hook: Option<fn(usize, usize)>,
    /// The caller calls [`Index::rules_changed`] whenever the rules' eviction algorithms may
    /// have changed (the server does, on every policy install). Then the index re-resolves its
    /// tenants' algorithms only after such a call, in slices ([`Index::algorithms_step`]),
    /// instead of visiting every tenant before every cap enforcement. False: the index checks
    /// every tenant before every cap enforcement itself.
    pub rules_change_notified: bool,
    /// Time an ingest that found its core's tables full may spend reclaiming before it is
    /// refused ([`RECLAIM_ON_FULL_BUDGET`]); tests that assert what the reclaim frees set more,
    /// so a preempted thread does not turn it into a refusal.
    pub reclaim_on_full_budget: std::time::Duration,
}

impl Default for IndexConfig {
    /// A single-core configuration with its own directory and the spec defaults.
    fn default() -> Self {
        IndexConfig {
            default_ttl_ns: DEFAULT_TTL_NS,
            max_entries: DEFAULT_MAX_ENTRIES,
            ranker: RankerConfig::default(),
            directory: Arc::new(Directory::default()),
            core_id: 0,
            max_future_skew_ns: DEFAULT_MAX_FUTURE_SKEW_NS,
            max_strings: MAX_STRINGS,
            max_string_bytes: DEFAULT_MAX_STRING_BYTES,
            max_holders_per_key: DEFAULT_MAX_HOLDERS_PER_KEY,
            max_replicas_per_scope: DEFAULT_MAX_REPLICAS_PER_SCOPE,
            max_stats_rows_per_model: DEFAULT_MAX_STATS_ROWS_PER_MODEL,
            max_stats_rows: DEFAULT_MAX_STATS_ROWS,
            max_keyspaces_per_model: DEFAULT_MAX_KEYSPACES_PER_MODEL,
            max_keyspaces: DEFAULT_MAX_KEYSPACES,
            cross_core_eviction: false,
            gradual_buffer_hook: None,
            rules_change_notified: false,
            reclaim_on_full_budget: RECLAIM_ON_FULL_BUDGET,
        }
    }
}

/// Removals counted per resolved eviction algorithm (the `algorithm` label of
/// `inferencecache_index_evictions_total`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictionCounts {
    /// Entries of LRU tenants.
    pub lru: u64,
    /// Entries of LFU tenants.
    pub lfu: u64,
}

impl EvictionCounts {
    fn add(&mut self, algo: Eviction) {
        match algo {
            Eviction::Lru => self.lru += 1,
            Eviction::Lfu => self.lfu += 1,
        }
    }
    /// Total removals.
    pub fn total(&self) -> u64 {
        self.lru + self.lfu
    }
}

/// What one ingest did, so the server can count metrics (§4.2 step 6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// Upserts performed (chain blocks + legacy keys).
    pub upserts: u64,
    /// `PrefixEntry`s dropped because their chain arrays had different lengths.
    pub malformed_dropped: u64,
    /// Distinct prefix keys of the update's tenant evicted by its quota
    /// (`inferencecache_tenant_evictions_total{tenant_id, reason="over_entries"}`).
    pub quota_evicted_keys: u64,
    /// Storage entries evicted by the global cap (`index_evictions_total{algorithm, reason="cap"}`).
    pub cap_evicted: EvictionCounts,
    /// The whole update was refused because this core's string table is full (in names or in
    /// bytes); nothing of it was applied.
    pub rejected_string_table_full: bool,
    /// The whole update was refused because it would have created a keyspace beyond
    /// [`IndexConfig::max_keyspaces_per_model`] or [`IndexConfig::max_keyspaces`]; nothing of
    /// it was applied.
    pub rejected_keyspaces_full: bool,
    /// The update (or, for a later part of one applied in parts, that part) was refused because
    /// its replica does not serve in its scope yet and the scope already has
    /// [`IndexConfig::max_replicas_per_scope`] serving replicas; nothing of it was applied.
    pub rejected_scope_replicas_full: bool,
    /// Upserts not applied because their key already had the maximum number of holders (the
    /// rest of the update was applied).
    pub holders_refused: u64,
    /// Upserts of new keys not applied because the store's table was full
    /// (`runstore::MAX_KEYS`, ~100M keys per core; the rest of the update was applied).
    pub keys_refused: u64,
    /// Upserts not applied because their replica had its most extents in the key's run
    /// (`runstore::MAX_REPLICA_EXTENTS`: a replica holding that run's blocks in that many
    /// separate stretches; the rest of the update was applied).
    pub extents_refused: u64,
    /// The update's stats were not stored: its replica would have been one stats row too many
    /// (per model or per core). The rest of the update was applied.
    pub stats_refused: bool,
    /// The producer's timestamp was later than the allowed skew and was clamped.
    pub timestamp_clamped: bool,
    /// With [`IndexConfig::cross_core_eviction`]: the tenant's quota, which the caller must
    /// enforce across cores (`None`: no quota, or nothing of the tenant was stored).
    pub deferred_quota: Option<u64>,
    /// Nothing was applied yet: the check that the update's names and keyspaces fit took this
    /// step ([`Index::ingest_part_admitted`]); the caller tries the same range again.
    pub admission_pending: bool,
}

/// What one part of an update may do in one step ([`Index::ingest_part_within`]): about
/// `blocks` blocks (a legacy prefix counts one, a chain entry its blocks; one entry is never
/// split), each name or keyspace the part creates counting `blocks_per_created` more, and no
/// more entries once `deadline` passed. A part always applies at least one entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartBudget {
    /// Blocks one part applies at most (about: it ends after the entry that reaches it).
    pub blocks: usize,
    /// Blocks each name or keyspace the part creates counts as.
    pub blocks_per_created: usize,
    /// When the part ends whatever it applied (the clock is read every
    /// [`PART_CLOCK_EVERY`] entries).
    pub deadline: Option<std::time::Instant>,
}

/// Entries a part applies between two reads of the clock ([`PartBudget::deadline`]).
pub const PART_CLOCK_EVERY: usize = 32;

impl PartBudget {
    /// No bound: the whole range in one part.
    pub const UNBOUNDED: Self = Self {
        blocks: usize::MAX,
        blocks_per_created: 0,
        deadline: None,
    };

    /// Whether a part that applied `blocks` blocks, created `created` names and keyspaces and
    /// went through `entries` entries is done.
    fn spent(&self, blocks: usize, created: usize, entries: usize) -> bool {
        let cost = blocks.saturating_add(created.saturating_mul(self.blocks_per_created));
        cost >= self.blocks
            || self.deadline.is_some_and(|d| {
                entries.is_multiple_of(PART_CLOCK_EVERY) && std::time::Instant::now() >= d
            })
    }
}

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepOutcome {
    /// Entries removed by TTL (`index_evictions_total{algorithm, reason="ttl"}`).
    pub ttl_evicted: EvictionCounts,
    /// Stats rows deleted by TTL.
    pub stats_rows_removed: u64,
    /// Interned names freed by the reclaim pass that followed.
    pub strings_freed: u64,
}

/// What one event did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventOutcome {
    /// Storage entries removed.
    pub entries_removed: u64,
    /// Whether a stats row was touched (REPLICA_UPDATED) or deleted (ALL_CLEARED).
    pub stats_changed: bool,
    /// The producer's timestamp was later than the allowed skew and was clamped.
    pub timestamp_clamped: bool,
}

/// One stats row (§3.2 store 2). `client_version` is never stored.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct StatsRow {
    pub cache_memory_bytes: i64,
    pub hit_rate: f32,
    pub pressure: f32,
    pub t2_hit_tokens: i64,
    pub t2_query_tokens: i64,
    /// Liveness (REPLICA_UPDATED advances it).
    pub last_seen: i64,
    /// Time of the last stats payload (drives pressure freshness and TENANT_HOT).
    pub stats_reported: i64,
}

/// `(tenant, model, scheme)`: serving membership lives here.
pub(crate) struct ScopeRec {
    /// Tenant string id, [`DEAD`] for a freed record.
    pub tenant: u32,
    pub model: u32,
    pub scheme: u32,
    pub mscope: u32,
    /// replica → number of prefix keys it holds in the scope (`serving_by_scope`); by slot
    /// from the event memo.
    pub serving: SlotMap<u32>,
    /// The serving replicas sorted by name (affinity candidates), kept in lock-step.
    pub sorted: Vec<u32>,
    /// Keyspace ids `(scope, adapter)` of this scope.
    pub keyspaces: Vec<u32>,
    /// This scope's position in its model scope's `scopes` list; [`DEAD`] once the reclaim
    /// pass unlinked it (its names stay readable until the pass releases the id).
    pub slot: u32,
}

/// A keyspace, `(scope, adapter)`: the namespace of prefix hashes. Two producers' keys are the
/// same key only within one keyspace. (Not to be confused with the server's partitions, the 256
/// hash buckets of `(tenant, model)` that decide which core owns a request.)
pub(crate) struct KeyspaceRec {
    /// Scope id, [`DEAD`] for a freed record.
    pub scope: u32,
    pub adapter: u32,
    /// Prefix keys in this keyspace (0 → reclaimable).
    pub keys: u64,
    /// This keyspace's position in its scope's `keyspaces` list; [`DEAD`] once the reclaim pass
    /// unlinked it (scope and adapter stay readable until the pass releases the id).
    pub slot: u32,
}

/// `(tenant, model)`: stats rows and the per-model-scope key count.
pub(crate) struct ModelRec {
    /// Tenant string id, [`DEAD`] for a freed record.
    pub tenant: u32,
    pub model: u32,
    /// `prefixes_by_tenant_model`.
    pub prefixes: u64,
    /// `stats` rows; their keys are `replicas_by_model`.
    pub stats: HashMap<u32, StatsRow>,
    pub scopes: Vec<u32>,
    /// Linked keyspaces of all this model scope's scopes (bounded by
    /// [`IndexConfig::max_keyspaces_per_model`]).
    pub keyspaces: u32,
}

/// Per-tenant state on this core.
pub(crate) struct TenantRec {
    /// Distinct prefix keys on this core (`prefixes_by_tenant`, local part).
    pub prefixes: u64,
    /// Storage entries on this core.
    pub entries: u64,
    pub reserved: bool,
    pub fp: TenantFp,
    /// The directory slot of the tenant's key count while `prefixes`, as last pushed, is above
    /// zero (see [`Directory::add_tenant_keys_at`]); None until a push finds it.
    pub dir_slot: Option<TenantSlotHint>,
    /// Eviction algorithm as last resolved; the cap candidate heap is keyed on it.
    pub algo: Eviction,
    /// Linked model scopes of this tenant on this core (the record goes with the last).
    pub models: u32,
}

/// Interned names and the scope/keyspace/model-scope/tenant records. Split from the rest of
/// [`Index`] so eviction comparators can borrow it while heaps are mutated.
#[derive(Default)]
pub(crate) struct Catalog {
    pub strings: Strings,
    pub blobs: Blobs,
    pub scopes: Vec<ScopeRec>,
    pub scope_ids: HashMap<(u32, u32, u32), u32>,
    pub keyspaces: Vec<KeyspaceRec>,
    pub keyspace_ids: HashMap<(u32, u32), u32>,
    pub models: Vec<ModelRec>,
    pub model_ids: HashMap<(u32, u32), u32>,
    /// By tenant string id; by slot from the event memo.
    pub tenants: SlotMap<TenantRec>,
    /// Linked keyspaces on this core (bounded by [`IndexConfig::max_keyspaces`]).
    pub live_keyspaces: usize,
    /// Freed record ids, reused by the next creation.
    scope_free: Vec<u32>,
    keyspace_free: Vec<u32>,
    model_free: Vec<u32>,
    /// The string ids the lookups' names resolved to last ([`Strings::get_hinted`]).
    hints: NameHints,
    /// Bumped whenever a name → id mapping, a `(tenant, model)` → model scope mapping or a
    /// model scope's list of scopes or keyspaces may have changed: a record created or
    /// unlinked, a name unlinked. [`EventMemo`] is valid only at the epoch it was filled in.
    epoch: u64,
    /// What the last `PREFIX_EVICTED` event's names resolved to (see [`EventMemo`]).
    event_memo: Option<EventMemo>,
}

/// The ids the last `PREFIX_EVICTED` event's names resolved to, and the keyspaces its hash is
/// removed from. Producers send long series of evictions of one `(tenant, model, replica,
/// adapter)`; the next event with the same name bytes reuses this resolution (four name
/// comparisons instead of four hashed lookups, a map probe and a walk of the model scope's
/// keyspaces). Exact: it is filled only when every name resolved, and used only while the
/// catalog's epoch is unchanged, so every id it holds still names the same string or record
/// and the keyspace lists it summarises are the same.
#[derive(Clone, Copy, Debug)]
struct EventMemo {
    epoch: u64,
    /// The event's tenant, model, replica and adapter (empty for none), as compared.
    names: [MemoName; 4],
    evict: EvictPlan,
}

/// What a `PREFIX_EVICTED` event removes its hash from: the replica's entries in the keyspaces
/// of a model scope (small: copied out of the memo per event).
#[derive(Clone, Copy, Debug)]
struct EvictPlan {
    replica: u32,
    /// [`DEAD`]: the event named no adapter (every keyspace of the model scope).
    adapter: u32,
    mscope: u32,
    targets: EvictTargets,
    /// Where a removal from the one target keyspace counts, when there is one.
    counts: CountSlots,
}

/// The slots of the records a removed entry of one keyspace and replica is counted in: its
/// tenant's record, the replica's serving count in the scope, the model's gauge count (each
/// [`NO_SLOT`] when unknown). Hints: each is checked against its id, and a stale one falls back
/// to the lookup by id.
#[derive(Clone, Copy, Debug)]
struct CountSlots {
    tenant: u32,
    serving: u32,
    gauge: u32,
}

impl CountSlots {
    const NONE: CountSlots = CountSlots {
        tenant: NO_SLOT,
        serving: NO_SLOT,
        gauge: NO_SLOT,
    };
}

/// A name of at most 16 bytes as its length and two words that determine its bytes: the first
/// and last 8 (or 4) bytes, overlapping; of 1 to 3 bytes, the first, middle and last byte. Two
/// such names are equal exactly when their signatures are. The event memo keeps its names'
/// signatures, so a `PREFIX_EVICTED` event's names are compared without reading the string
/// table or calling `memcmp` (~60 instructions of an event's ~900 did both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct NameSig {
    len: usize,
    words: (u64, u64),
}

impl NameSig {
    /// The signature of `s`, None when it is longer than 16 bytes.
    #[inline(always)]
    fn of(s: &str) -> Option<NameSig> {
        let s = s.as_bytes();
        let n = s.len();
        let u64_at = |i: usize| u64::from_le_bytes(s[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(s[i..i + 4].try_into().expect("4 bytes"));
        let words = match n {
            0 => (0, 0),
            1..=3 => (
                s[0] as u64 | (s[n / 2] as u64) << 8 | (s[n - 1] as u64) << 16,
                0,
            ),
            4..=7 => (u32_at(0) as u64, u32_at(n - 4) as u64),
            8..=16 => (u64_at(0), u64_at(n - 8)),
            _ => return None,
        };
        Some(NameSig { len: n, words })
    }
}

/// How the event memo recognises one of its names: by signature, or (a name longer than 16
/// bytes) by the string table's bytes of its id.
#[derive(Clone, Copy, Debug)]
enum MemoName {
    Sig(NameSig),
    Id(u32),
}

impl MemoName {
    fn new(name: &str, id: u32) -> MemoName {
        NameSig::of(name).map_or(MemoName::Id(id), MemoName::Sig)
    }

    /// Whether `s` is this name.
    #[inline(always)]
    fn is(&self, s: &str, names: &Strings) -> bool {
        match self {
            MemoName::Sig(sig) => s.len() == sig.len && NameSig::of(s).is_some_and(|g| g == *sig),
            MemoName::Id(id) => names.name(*id) == s,
        }
    }
}

/// The keyspaces of a model scope a `PREFIX_EVICTED` event's hash may be removed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EvictTargets {
    None,
    One(u32),
    /// More than one: walk the model scope's lists.
    Many,
}

/// Per role, the string id a lookup's name resolved to last (`u32::MAX`: none yet).
struct NameHints {
    tenant: Cell<u32>,
    model: Cell<u32>,
    scheme: Cell<u32>,
    adapter: Cell<u32>,
    /// An event's replica (an engine evicts a run of blocks as consecutive events of one
    /// replica).
    event_replica: Cell<u32>,
}

impl Default for NameHints {
    fn default() -> Self {
        NameHints {
            tenant: Cell::new(u32::MAX),
            model: Cell::new(u32::MAX),
            scheme: Cell::new(u32::MAX),
            adapter: Cell::new(u32::MAX),
            event_replica: Cell::new(u32::MAX),
        }
    }
}

impl Catalog {
    /// The scope record of a key.
    pub fn scope_of(&self, k: KeyId) -> &ScopeRec {
        &self.scopes[self.keyspaces[k.keyspace() as usize].scope as usize]
    }
    /// Tenant string id of a key.
    pub fn tenant_of(&self, k: KeyId) -> u32 {
        self.scope_of(k).tenant
    }
    /// The wire bytes of a key's hash, without allocating (8-byte hashes are materialised in
    /// `buf`).
    pub fn hash_bytes<'a>(&'a self, k: KeyId, buf: &'a mut [u8; 8]) -> &'a [u8] {
        if k.is_blob() {
            self.blobs.bytes(k.h as u32)
        } else {
            *buf = k.h.to_be_bytes();
            &buf[..]
        }
    }
    /// Resolves an existing key id from a keyspace and wire bytes (no allocation).
    pub fn key_for(&self, ks: u32, bytes: &[u8]) -> Option<KeyId> {
        if bytes.len() == 8 {
            let mut b = [0u8; 8];
            b.copy_from_slice(bytes);
            Some(KeyId {
                ks,
                h: u64::from_be_bytes(b),
            })
        } else {
            self.blobs.get(bytes).map(|id| KeyId {
                ks: ks | BLOB_FLAG,
                h: id as u64,
            })
        }
    }
    /// Existing scope id for strings (no allocation, no interning).
    pub fn find_scope(&self, tenant: &str, model: &str, scheme: &str) -> Option<u32> {
        let t = self.find_tenant(tenant)?;
        let m = self.strings.get_hinted(model, &self.hints.model)?;
        let s = self.strings.get_hinted(scheme, &self.hints.scheme)?;
        self.scope_ids.get(&(t, m, s)).copied()
    }
    /// Existing model-scope id for strings.
    pub fn find_model(&self, tenant: &str, model: &str) -> Option<u32> {
        let t = self.find_tenant(tenant)?;
        let m = self.strings.get_hinted(model, &self.hints.model)?;
        self.model_ids.get(&(t, m)).copied()
    }
    /// Existing keyspace id of a scope and adapter string.
    pub fn find_keyspace(&self, scope: u32, adapter: &str) -> Option<u32> {
        let a = self.strings.get_hinted(adapter, &self.hints.adapter)?;
        self.keyspace_ids.get(&(scope, a)).copied()
    }
    /// String id of a tenant name, if interned.
    pub fn find_tenant(&self, tenant: &str) -> Option<u32> {
        self.strings.get_hinted(tenant, &self.hints.tenant)
    }

    /// Invalidates [`EventMemo`]: a name, a model scope or a model scope's scope or keyspace
    /// list is about to change.
    pub fn bump_epoch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// Unlinks a name (the reclaim pass): it is no longer found, and the event memo may name it.
    pub fn unlink_string(&mut self, id: u32) {
        self.bump_epoch();
        self.strings.unlink(id);
    }

    /// The memo of the last `PREFIX_EVICTED` event if `e` names the same tenant, model, replica
    /// and adapter, byte for byte, and nothing it resolved may have changed since.
    fn event_memo_for(&self, e: &CacheEvent) -> Option<&EvictPlan> {
        let m = self.event_memo.as_ref()?;
        if m.epoch != self.epoch {
            return None;
        }
        let names = &self.strings;
        let [tenant, model, replica, adapter] = &m.names;
        // The replica first: consecutive events of one model most often differ in it.
        (replica.is(&e.replica_id, names)
            && adapter.is(&e.adapter_id, names)
            && model.is(&e.model_id, names)
            && tenant.is(&e.tenant_id, names))
        .then_some(&m.evict)
    }

    /// The keyspaces of model scope `mscope` matching `adapter` ([`DEAD`]: any).
    fn evict_targets(&self, mscope: u32, adapter: u32) -> EvictTargets {
        let mut found = EvictTargets::None;
        for &s in &self.models[mscope as usize].scopes {
            for &ks in &self.scopes[s as usize].keyspaces {
                if adapter != DEAD && self.keyspaces[ks as usize].adapter != adapter {
                    continue;
                }
                found = match found {
                    EvictTargets::None => EvictTargets::One(ks),
                    _ => return EvictTargets::Many,
                };
            }
        }
        found
    }
}

/// Counter deltas not yet pushed to the directory (flushed at the end of every operation and
/// before every cross-core read that must include them).
struct Pending {
    total: i64,
    non_reserved: i64,
    /// The first tenant whose key count changed ([`NO_TENANT`]: none). Not an `Option`: its
    /// fields are written and read one by one, in place. Written whole, it went through a copy
    /// on the stack that the flush then read with wider loads than the copy's stores, which
    /// stalls store-to-load forwarding on every removal event.
    tenant: PendingTenant,
    /// Any others.
    more: Vec<PendingTenant>,
}

/// [`Pending::tenant`] when no tenant's key count changed (string ids stay far below it).
const NO_TENANT: u32 = u32::MAX;

impl Default for Pending {
    fn default() -> Self {
        Pending {
            total: 0,
            non_reserved: 0,
            tenant: PendingTenant {
                tenant: NO_TENANT,
                ..PendingTenant::default()
            },
            more: Vec::new(),
        }
    }
}

/// A tenant's key count delta not yet pushed to the directory, with what the flush needs to
/// push it without a record lookup.
#[derive(Clone, Copy, Default)]
struct PendingTenant {
    tenant: u32,
    delta: i64,
    keys: TenantKeys,
}

/// What a change to a tenant's key count on this core tells the directory: its fingerprint,
/// its directory slot hint, and its key count on this core after the change.
#[derive(Clone, Copy, Default)]
struct TenantKeys {
    fp: TenantFp,
    dir_slot: Option<TenantSlotHint>,
    after: u64,
}

impl TenantRec {
    /// The tenant's [`TenantKeys`] as the record stands (after a change to `prefixes`).
    #[inline(always)]
    fn keys(&self) -> TenantKeys {
        TenantKeys {
            fp: self.fp,
            dir_slot: self.dir_slot,
            after: self.prefixes,
        }
    }
}

/// Per-model non-reserved key counts for the entries gauge.
#[derive(Default)]
struct ModelGauge {
    /// model string id → (count, dirty, queued in `zeros`); by slot from the event memo.
    counts: SlotMap<(u64, bool, bool)>,
    dirty: Vec<u32>,
    /// Models whose 0 was published: the reclaim pass drops their entries (if still 0 and
    /// published), so their names may be freed.
    zeros: Vec<u32>,
}

impl ModelGauge {
    /// Inlined (a removal's key going is counted here after every event): one probe for a
    /// model already counted, dirty or not (the server drains the dirty list after every
    /// event); a model's first count takes the out-of-line insert.
    #[inline(always)]
    fn add(&mut self, model: u32, delta: i64) {
        self.add_at(NO_SLOT, model, delta);
    }

    /// [`ModelGauge::add`] with the model's count found at `slot` when it is there.
    #[inline(always)]
    fn add_at(&mut self, slot: u32, model: u32, delta: i64) {
        let Some(e) = self.counts.get_mut_hinted(slot, model) else {
            self.add_new(model, delta);
            return;
        };
        e.0 = (e.0 as i64 + delta) as u64;
        if !e.1 {
            e.1 = true;
            self.dirty.push(model);
        }
    }

    /// [`ModelGauge::add`] for a model not counted yet.
    #[inline(never)]
    fn add_new(&mut self, model: u32, delta: i64) {
        self.counts.insert(model, (delta as u64, true, false));
        self.dirty.push(model);
    }
}

/// Chain blocks whose table buckets [`Index::upsert_chain`] loads together before it upserts
/// them: enough loads in flight to overlap their cache misses, few enough that the buckets are
/// still cached when the upserts reach them.
const PROBE_BATCH: usize = 16;

/// What one upsert did ([`Index::upsert`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Upserted {
    Applied,
    /// Refused: the key has the maximum number of holders.
    HoldersFull,
    /// Refused: a new key did not fit the store's table.
    KeysFull,
    /// Refused: the replica has its most extents in the key's run.
    ExtentsFull,
}

impl IngestOutcome {
    /// Counts one upsert of the update.
    fn count(&mut self, upserted: Upserted) {
        match upserted {
            Upserted::Applied => self.upserts += 1,
            Upserted::HoldersFull => self.holders_refused += 1,
            Upserted::KeysFull => self.keys_refused += 1,
            Upserted::ExtentsFull => self.extents_refused += 1,
        }
    }
}

/// Keys and entries created by upserts not yet counted ([`Index::on_created`]).
#[derive(Clone, Copy, Default)]
struct Created {
    keys: u64,
    entries: u64,
}

/// The entry an upsert writes: its replica, stored token count, tier and time.
#[derive(Clone, Copy)]
struct EntryUpsert {
    replica: u32,
    tokens: i32,
    tier: u8,
    ts: i64,
}

/// One core's index. See the module docs.
pub struct Index {
    cfg: IndexConfig,
    dir: Arc<Directory>,
    /// This index's slot of the directory's entry counts.
    entry_counter: EntryCounter,
    pub(crate) cat: Catalog,
    pub(crate) store: Store,
    reserved_entries: u64,
    pending: Pending,
    gauge: ModelGauge,
    cap: CapState,
    quotas: HashMap<u32, QuotaState>,
    /// Quota heaps dropped by the reclaim pass, released in the cap build's slices.
    quota_retired: eviction::QuotaRetired,
    /// A tenant's quota candidate build in slices ([`Index::quota_victims_step`]).
    quota_next: Option<eviction::QuotaBuild>,
    /// [`Index::take_quota_sync_builds`].
    quota_sync_builds: u64,
    scratch: lookup::Scratch,
    last: lookup::LastLookup,
    min_candidates: usize,
    /// Stats rows on this core (all models).
    stats_rows: usize,
    /// Removals since the last reclaim pass that may have left records or names unreferenced
    /// (a hint: 0 means the pass would free nothing).
    reclaimable: u64,
    /// The restore's last upsert: the next restored key is placed after it.
    restore_chain: ChainCursor,
    /// `now` of the last reclaim pass run because the string table was full.
    last_full_reclaim: i64,
    /// Extent tails the store cut off since the server last took the count
    /// ([`Index::take_extent_tails_dropped`]).
    extent_tails_dropped: u64,
    /// Told of every entry the sweep, the cap or a quota removes (none by default).
    removal_sink: Option<RemovalSink>,
    /// The sliced TTL sweep pass in progress, if any.
    sweep_pass: Option<eviction::SweepPass>,
    /// The sliced reclaim pass in progress, if any (run by sweep slices, or begun by an ingest
    /// that found a table full).
    reclaim_pass: Option<reclaim::ReclaimPass>,
    /// With [`IndexConfig::rules_change_notified`]: the tenants' eviction algorithms are being
    /// re-resolved after [`Index::rules_changed`] (see [`Index::algorithms_step`]).
    algo_refresh: Option<eviction::AlgoRefresh>,
    /// The algorithm a tenant record created by the current ingest or restore gets (resolved
    /// from the rules before anything is stored).
    new_tenant_algo: Eviction,
    /// Cap candidate builds run in one go on a path that needed a victim, not yet taken by
    /// [`Index::take_cap_sync_builds`].
    cap_sync_builds: u64,
    /// Most stale snapshots one cap pop dropped on a path that needed a victim, not yet taken
    /// by [`Index::take_cap_max_stale_pops`].
    cap_max_stale_pops: u64,
    /// `ALL_CLEARED` leaves its removals to [`Index::clear_step`] (see the `clear` module).
    sliced_clears: bool,
    /// With `Some`, an ingest runs at most this much of the global cap's evictions itself and
    /// owes the rest to [`Index::cap_enforce_step`] ([`Index::set_sliced_cap`]).
    sliced_cap: Option<eviction::CapSlice>,
    /// The `ALL_CLEARED` whose holders are still being removed, if any.
    clear: Option<clear::PendingClear>,
    /// Pending clears finished in one go by an entry point, not yet taken by
    /// [`Index::take_clear_sync_finishes`].
    clear_sync_finishes: u64,
}

impl Default for Index {
    fn default() -> Self {
        Index::new(IndexConfig::default())
    }
}

impl Index {
    /// An empty index whose key table takes at most `n` keys per segment (of
    /// `runstore::SEGMENTS`): a test's way to a full table without ~100M keys.
    #[doc(hidden)]
    pub fn with_key_table_segment_keys(config: IndexConfig, n: usize) -> Index {
        let mut ix = Index::new(config);
        ix.store = Store::with_segment_keys(n);
        ix
    }

    /// Builds an empty index. A non-positive default TTL is clamped back to 30 min (§3.1);
    /// the keyspace bound to the ids a key record can hold (2^29: the bits above carry flags).
    pub fn new(mut config: IndexConfig) -> Index {
        if config.default_ttl_ns <= 0 {
            config.default_ttl_ns = DEFAULT_TTL_NS;
        }
        config.max_holders_per_key = config.max_holders_per_key.max(1);
        config.max_replicas_per_scope = config.max_replicas_per_scope.max(1);
        config.max_keyspaces = config.max_keyspaces.min(KEYSPACE_LIMIT as usize);
        let dir = config.directory.clone();
        let cat = Catalog {
            strings: Strings::new(config.max_strings, config.max_string_bytes),
            ..Default::default()
        };
        Index {
            cfg: config,
            entry_counter: dir.entry_counter(),
            dir,
            cat,
            store: Store::new(),
            reserved_entries: 0,
            pending: Pending::default(),
            gauge: ModelGauge::default(),
            cap: CapState::default(),
            quotas: HashMap::new(),
            quota_retired: eviction::QuotaRetired::default(),
            quota_next: None,
            quota_sync_builds: 0,
            scratch: lookup::Scratch::default(),
            last: lookup::LastLookup::default(),
            min_candidates: eviction::MIN_CANDIDATES,
            stats_rows: 0,
            reclaimable: 0,
            restore_chain: ChainCursor::new(),
            last_full_reclaim: i64::MIN,
            extent_tails_dropped: 0,
            removal_sink: None,
            sweep_pass: None,
            reclaim_pass: None,
            algo_refresh: None,
            new_tenant_algo: Eviction::Lru,
            cap_sync_builds: 0,
            cap_max_stale_pops: 0,
            sliced_clears: false,
            sliced_cap: None,
            clear: None,
            clear_sync_finishes: 0,
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    /// The shared directory.
    pub fn directory(&self) -> &Arc<Directory> {
        &self.dir
    }

    /// Changes the global cap (tests and the server's flag); takes effect at the next ingest.
    pub fn set_max_entries(&mut self, max: u64) {
        self.cfg.max_entries = max;
    }

    /// Changes the ranker knobs (tests).
    pub fn set_ranker(&mut self, ranker: RankerConfig) {
        self.cfg.ranker = ranker;
    }

    /// Test knob: lowers this core's string-table capacity so the "table full" refusal of
    /// [`Index::ingest`] can be exercised without interning 2^24 strings.
    #[doc(hidden)]
    pub fn set_string_capacity(&mut self, n: usize) {
        self.cfg.max_strings = n;
        self.cat.strings.set_limit(n);
    }

    /// Test knob: sets this core's string-table capacity in name bytes.
    #[doc(hidden)]
    pub fn set_string_bytes_capacity(&mut self, n: usize) {
        self.cfg.max_string_bytes = n;
        self.cat.strings.set_byte_limit(n);
    }

    /// Live interned names on this core and their total bytes.
    pub fn string_usage(&self) -> (usize, usize) {
        (self.cat.strings.count(), self.cat.strings.bytes())
    }

    /// Stats rows on this core.
    pub fn stats_row_count(&self) -> usize {
        self.stats_rows
    }

    /// Test knob: minimum candidate-set size of the cap/quota heaps (default 1024). Tiny values
    /// exercise the threshold, stale-snapshot and rebuild paths with few entries.
    #[doc(hidden)]
    pub fn set_min_candidates(&mut self, k: usize) {
        self.cap_clear();
        self.quota_clear_all();
        self.min_candidates = k.max(1);
    }

    /// Tells the index that tenant policies changed (eviction algorithm switch). Optional: the
    /// index also detects algorithm changes itself before every cap enforcement.
    /// The cap heap is retired, not freed here: its snapshots are given back in the cap
    /// build's slices (a policy install must not cost one step of O(cap heap) on every core).
    ///
    /// With [`IndexConfig::rules_change_notified`], this is the only way the index learns of a
    /// change: it begins re-resolving every tenant's algorithm in slices
    /// ([`Index::algorithms_step`]); no cap candidate build starts before that ends, and a cap
    /// enforcement that comes first finishes it itself (counted like a cap build on that path).
    pub fn rules_changed(&mut self) {
        self.cap_forget();
        if self.cfg.rules_change_notified {
            self.algo_refresh = Some(eviction::AlgoRefresh {
                cursor: 0,
                end: self.cat.models.len(),
            });
        }
    }

    /// Number of storage entries on this core (reserved included).
    pub fn entry_count(&self) -> u64 {
        self.store.entry_count() as u64 - self.cleared_holders_left()
    }

    /// Number of distinct prefix keys on this core (reserved included).
    pub fn key_count(&self) -> u64 {
        self.store.key_count() as u64
    }

    /// Non-reserved storage entries on this core (what this core contributes to the cap).
    pub fn non_reserved_entry_count(&self) -> u64 {
        self.entry_count() - self.reserved_entries
    }

    /// Resolved TTL of a tenant: its policy TTL if positive, else the index default (§6).
    pub fn ttl_for(&self, rules: &dyn TenantRules, tenant: &str) -> i64 {
        let t = rules.ttl_ns(tenant);
        if t > 0 { t } else { self.cfg.default_ttl_ns }
    }

    // ---- catalog helpers -------------------------------------------------------------------

    fn ensure_tenant(&mut self, tenant: u32) {
        if !self.cat.tenants.contains_key(&tenant) {
            let name = self.cat.strings.name(tenant);
            let rec = TenantRec {
                prefixes: 0,
                entries: 0,
                reserved: name == PROBE_TENANT,
                fp: Directory::fingerprint(name),
                dir_slot: None,
                algo: self.new_tenant_algo,
                models: 0,
            };
            self.cat.tenants.insert(tenant, rec);
        }
    }

    fn ensure_model(&mut self, tenant: u32, model: u32) -> u32 {
        if let Some(id) = self.cat.model_ids.get(&(tenant, model)) {
            return *id;
        }
        self.ensure_tenant(tenant);
        self.cat
            .tenants
            .get_mut(&tenant)
            .expect("tenant record")
            .models += 1;
        let rec = ModelRec {
            tenant,
            model,
            prefixes: 0,
            stats: HashMap::new(),
            scopes: Vec::new(),
            keyspaces: 0,
        };
        let id = match self.cat.model_free.pop() {
            Some(id) => {
                self.cat.models[id as usize] = rec;
                id
            }
            None => {
                self.cat.models.push(rec);
                (self.cat.models.len() - 1) as u32
            }
        };
        self.cat.model_ids.insert((tenant, model), id);
        self.cat.bump_epoch();
        // Reclaimable until something is stored under it.
        self.reclaimable += 1;
        id
    }

    fn ensure_scope(&mut self, tenant: u32, model: u32, scheme: u32) -> u32 {
        if let Some(id) = self.cat.scope_ids.get(&(tenant, model, scheme)) {
            return *id;
        }
        let mscope = self.ensure_model(tenant, model);
        let rec = ScopeRec {
            tenant,
            model,
            scheme,
            mscope,
            serving: SlotMap::default(),
            sorted: Vec::new(),
            keyspaces: Vec::new(),
            slot: self.cat.models[mscope as usize].scopes.len() as u32,
        };
        let id = match self.cat.scope_free.pop() {
            Some(id) => {
                self.cat.scopes[id as usize] = rec;
                id
            }
            None => {
                self.cat.scopes.push(rec);
                (self.cat.scopes.len() - 1) as u32
            }
        };
        self.cat.scope_ids.insert((tenant, model, scheme), id);
        self.cat.bump_epoch();
        self.cat.models[mscope as usize].scopes.push(id);
        id
    }

    fn ensure_keyspace(&mut self, scope: u32, adapter: u32) -> u32 {
        if let Some(id) = self.cat.keyspace_ids.get(&(scope, adapter)) {
            return *id;
        }
        let rec = KeyspaceRec {
            scope,
            adapter,
            keys: 0,
            slot: self.cat.scopes[scope as usize].keyspaces.len() as u32,
        };
        let id = match self.cat.keyspace_free.pop() {
            Some(id) => {
                self.cat.keyspaces[id as usize] = rec;
                id
            }
            None => {
                self.cat.keyspaces.push(rec);
                (self.cat.keyspaces.len() - 1) as u32
            }
        };
        assert!(id < KEYSPACE_LIMIT, "too many keyspaces");
        self.reclaimable += 1;
        self.cat.keyspace_ids.insert((scope, adapter), id);
        self.cat.bump_epoch();
        self.cat.scopes[scope as usize].keyspaces.push(id);
        let mscope = self.cat.scopes[scope as usize].mscope;
        self.cat.models[mscope as usize].keyspaces += 1;
        self.cat.live_keyspaces += 1;
        id
    }

    /// Adds `delta` to the tenant's pending key count (`keys`: as its record stands after it).
    /// The first tenant of an operation (most often its only one) is kept inline.
    #[inline(always)]
    fn pending_tenant(&mut self, tenant: u32, keys: TenantKeys, delta: i64) {
        debug_assert_ne!(tenant, NO_TENANT);
        let first = &mut self.pending.tenant;
        if first.tenant == tenant {
            first.delta += delta;
        } else if first.tenant == NO_TENANT {
            first.tenant = tenant;
            first.delta = delta;
        } else {
            self.pending_more_tenant(tenant, keys, delta);
            return;
        }
        first.keys.fp = keys.fp;
        first.keys.dir_slot = keys.dir_slot;
        first.keys.after = keys.after;
    }

    /// [`Index::pending_tenant`] for a tenant other than the operation's first.
    #[inline(never)]
    fn pending_more_tenant(&mut self, tenant: u32, keys: TenantKeys, delta: i64) {
        if let Some(e) = self.pending.more.iter_mut().find(|e| e.tenant == tenant) {
            e.delta += delta;
            e.keys = keys;
        } else {
            self.pending.more.push(PendingTenant {
                tenant,
                delta,
                keys,
            });
        }
    }

    /// Pushes pending counter deltas to the directory.
    fn flush(&mut self) {
        self.flush_inline();
    }

    /// [`Index::flush`], inlined into the event memo's removal (a flush per event).
    #[inline(always)]
    fn flush_inline(&mut self) {
        self.dir.add_entries(
            &mut self.entry_counter,
            self.pending.total,
            self.pending.non_reserved,
        );
        self.pending.total = 0;
        self.pending.non_reserved = 0;
        let first = &mut self.pending.tenant;
        if first.tenant != NO_TENANT {
            let (tenant, delta) = (first.tenant, first.delta);
            // Field by field (see `Pending::tenant`).
            let keys = TenantKeys {
                fp: first.keys.fp,
                dir_slot: first.keys.dir_slot,
                after: first.keys.after,
            };
            first.tenant = NO_TENANT;
            if delta != 0 {
                self.push_tenant_keys(tenant, delta, keys);
            }
        }
        if !self.pending.more.is_empty() {
            self.flush_more_tenants();
        }
    }

    /// [`Index::flush`] of the tenants after an operation's first.
    #[inline(never)]
    fn flush_more_tenants(&mut self) {
        // Indexed, then cleared: no `Drain` to keep across the pushes.
        for i in 0..self.pending.more.len() {
            let PendingTenant {
                tenant,
                delta,
                keys,
            } = self.pending.more[i];
            if delta != 0 {
                self.push_tenant_keys(tenant, delta, keys);
            }
        }
        self.pending.more.clear();
    }

    /// Pushes a tenant's key count delta to the directory. Every change of a tenant's key count
    /// on this core is pushed by a flush, so the directory's count includes this core's part as
    /// last pushed; while that part stays above zero, the tenant's slot cannot be retired, and
    /// the slot found by a push is kept in its record (`dir_slot`) for the next ones, which
    /// then add to it directly (a removal event's push: one atomic add instead of the slot's
    /// search). A push that leaves this core's part at zero forgets the slot.
    #[inline(always)]
    fn push_tenant_keys(&mut self, tenant: u32, delta: i64, keys: TenantKeys) {
        if keys.after > 0
            && let Some(hint) = keys.dir_slot
        {
            self.dir.add_tenant_keys_at(hint, delta);
            return;
        }
        self.push_tenant_keys_cold(tenant, delta, keys);
    }

    /// [`Index::push_tenant_keys`] through the slot's search: this core's first keys of the
    /// tenant since its part was zero, or its last ones going.
    #[inline(never)]
    fn push_tenant_keys_cold(&mut self, tenant: u32, delta: i64, keys: TenantKeys) {
        let found = self.dir.add_tenant_keys_found(keys.fp, delta);
        let hint = if keys.after > 0 { found } else { None };
        if hint != keys.dir_slot
            && let Some(t) = self.cat.tenants.get_mut(&tenant)
        {
            t.dir_slot = hint;
        }
    }

    // ---- primitives (§3.3) ------------------------------------------------------------------

    /// *Upsert(key, replica, token_count, tier, ts)* of §3.3 for a key given as wire bytes.
    /// Refused (changing nothing) when the key is new to the replica but already has the
    /// maximum number of holders, or a new key does not fit the store's table.
    /// `cursor` carries the previous upsert of the same chain ([`ChainCursor::new`] before its
    /// first block): a new key is placed after it.
    #[allow(clippy::too_many_arguments)]
    fn upsert(
        &mut self,
        cursor: &mut ChainCursor,
        ks: u32,
        bytes: &[u8],
        replica: u32,
        tokens: i32,
        tier: u8,
        ts: i64,
    ) -> Upserted {
        let mut created = Created::default();
        let entry = EntryUpsert {
            replica,
            tokens,
            tier,
            ts,
        };
        let applied = self.upsert_at(cursor, ks, bytes, entry, &mut created);
        self.on_created(ks, replica, created);
        applied
    }

    /// [`Index::upsert`] without its counters: the keys and entries it creates are added to
    /// `created`, for [`Index::on_created`] to count once per call.
    #[inline]
    fn upsert_at(
        &mut self,
        cursor: &mut ChainCursor,
        ks: u32,
        bytes: &[u8],
        e: EntryUpsert,
        created: &mut Created,
    ) -> Upserted {
        let (key, fresh_blob) = match self.cat.key_for(ks, bytes) {
            Some(k) => (k, false),
            None => {
                let id = self.cat.blobs.acquire(bytes);
                let k = KeyId {
                    ks: ks | BLOB_FLAG,
                    h: id as u64,
                };
                (k, true)
            }
        };
        debug_assert_eq!(key.keyspace(), ks);
        let holder = Holder::new(e.replica, e.tier, e.tokens, e.ts);
        let max = self.cfg.max_holders_per_key;
        let loc = match self.store.upsert(cursor, key, holder, max) {
            HolderUpsert::Created(loc) => {
                // A new key holds a reference to its blob: the one just acquired, or another.
                if key.is_blob() && !fresh_blob {
                    self.cat.blobs.retain(key.h as u32);
                }
                created.keys += 1;
                created.entries += 1;
                loc
            }
            HolderUpsert::Added(loc) => {
                debug_assert!(!fresh_blob, "a new blob names no existing key");
                created.entries += 1;
                loc
            }
            HolderUpsert::Refreshed(loc) => loc,
            HolderUpsert::Full => return Upserted::HoldersFull,
            HolderUpsert::ExtentsFull => return Upserted::ExtentsFull,
            HolderUpsert::TableFull => {
                if fresh_blob {
                    self.cat.blobs.release(key.h as u32);
                }
                return Upserted::KeysFull;
            }
        };
        self.cap_touch(key, e.replica, Some(loc));
        self.quota_touch(key);
        Upserted::Applied
    }

    /// Upserts a chain's blocks (cumulative token counts) for one replica in chain order,
    /// counting each in `out`: each new block is placed after the one before it, so a chain
    /// stored in one update is one run of the store. The keyspace's, tenant's, model's and
    /// scope's counters are updated once for the chain.
    #[allow(clippy::too_many_arguments)]
    fn upsert_chain(
        &mut self,
        cursor: &mut ChainCursor,
        ks: u32,
        p: &PrefixEntry,
        replica: u32,
        tier: u8,
        ts: i64,
        out: &mut IngestOutcome,
    ) {
        let mut created = Created::default();
        let mut cum: i32 = 0;
        let counts = p.block_token_counts.chunks(PROBE_BATCH);
        for (i, (hashes, counts)) in p.block_hashes.chunks(PROBE_BATCH).zip(counts).enumerate() {
            // New blocks (a chain's first store, or its growth) each probe the table, a cache
            // miss on a large index: their buckets are loaded together first, so the misses
            // overlap. A chain stored again finds each block beside the one before it, and
            // after its first batch loads nothing ahead.
            if i == 0 || created.keys > 0 {
                for h in hashes {
                    if let Some(k) = self.cat.key_for(ks, h) {
                        self.store.prefetch(k);
                    }
                }
            }
            for (h, c) in hashes.iter().zip(counts) {
                cum = cum.wrapping_add(*c);
                let entry = EntryUpsert {
                    replica,
                    tokens: cum,
                    tier,
                    ts,
                };
                out.count(self.upsert_at(cursor, ks, h, entry, &mut created));
            }
        }
        self.on_created(ks, replica, created);
    }

    /// Counts what upserts in keyspace `ks` for `replica` created.
    fn on_created(&mut self, ks: u32, replica: u32, created: Created) {
        if created.keys > 0 {
            self.on_keys_created(ks, created.keys);
        }
        if created.entries > 0 {
            self.on_entries_created(ks, replica, created.entries);
        }
    }

    /// `n` keys were created in keyspace `ks`.
    fn on_keys_created(&mut self, ks: u32, n: u64) {
        let rec = &mut self.cat.keyspaces[ks as usize];
        rec.keys += n;
        let scope = &self.cat.scopes[rec.scope as usize];
        let (tenant, model, mscope) = (scope.tenant, scope.model, scope.mscope);
        let t = self.cat.tenants.get_mut(&tenant).expect("tenant record");
        t.prefixes += n;
        let (reserved, keys) = (t.reserved, t.keys());
        self.cat.models[mscope as usize].prefixes += n;
        self.pending_tenant(tenant, keys, n as i64);
        if !reserved {
            self.gauge.add(model, n as i64);
        }
    }

    /// `n` entries of `replica` were created in keyspace `ks`.
    fn on_entries_created(&mut self, ks: u32, replica: u32, n: u64) {
        let scope_id = self.cat.keyspaces[ks as usize].scope;
        let tenant = self.cat.scopes[scope_id as usize].tenant;
        let t = self.cat.tenants.get_mut(&tenant).expect("tenant record");
        t.entries += n;
        self.pending.total += n as i64;
        if t.reserved {
            self.reserved_entries += n;
        } else {
            self.pending.non_reserved += n as i64;
        }
        let strings = &self.cat.strings;
        let scope = &mut self.cat.scopes[scope_id as usize];
        let c = scope.serving.get_or_insert_with(replica, || 0);
        let was = *c;
        *c = was + u32::try_from(n).expect("entries of one upsert call");
        if was == 0 {
            let name = strings.name(replica);
            let at = scope
                .sorted
                .binary_search_by(|r| strings.name(*r).cmp(name))
                .expect_err("replica already serving");
            scope.sorted.insert(at, replica);
        }
    }

    /// The entry `(key, replica)` was removed, and with it the key when `key_gone`. Resolves
    /// the keyspace's scope and model scope once for every count (this runs once per removed
    /// entry: a `PREFIX_EVICTED` event's whole work besides the store), and finds the records it
    /// counts in at `slots` where they are there (the event memo's: no hashed lookup per event;
    /// [`CountSlots::NONE`] otherwise).
    #[inline(always)]
    fn on_entry_removed_at(&mut self, key: KeyId, replica: u32, key_gone: bool, slots: CountSlots) {
        let ks = &mut self.cat.keyspaces[key.keyspace() as usize];
        let scope_id = ks.scope;
        if key_gone {
            ks.keys -= 1;
            if ks.keys == 0 {
                self.reclaimable += 1;
            }
        }
        let scope = &self.cat.scopes[scope_id as usize];
        let (tenant, model, mscope) = (scope.tenant, scope.model, scope.mscope);
        // One tenant record lookup for both counts.
        let t = (self.cat.tenants)
            .get_mut_hinted(slots.tenant, tenant)
            .expect("tenant record");
        debug_assert!(t.entries >= 1);
        t.entries -= 1;
        if key_gone {
            debug_assert!(t.prefixes > 0);
            t.prefixes -= 1;
        }
        let (reserved, keys) = (t.reserved, t.keys());
        self.count_core_entries_removed(reserved, 1);
        if key_gone {
            let models = (model, mscope);
            self.count_key_gone_at(key, models, tenant, keys, reserved, slots.gauge);
        }
        let scope = &mut self.cat.scopes[scope_id as usize];
        let c = (scope.serving)
            .get_mut_hinted(slots.serving, replica)
            .expect("serving count");
        *c -= 1;
        if *c == 0 {
            self.stop_serving(scope_id, replica);
        }
    }

    /// `n` storage entries of `tenant` are gone: its entry counts and this core's.
    fn count_entries_removed(&mut self, tenant: u32, n: u64) {
        let t = self.cat.tenants.get_mut(&tenant).expect("tenant record");
        debug_assert!(t.entries >= n);
        t.entries -= n;
        let reserved = t.reserved;
        self.count_core_entries_removed(reserved, n);
    }

    /// `n` storage entries of a tenant (`reserved` or not) are gone: this core's counts.
    fn count_core_entries_removed(&mut self, reserved: bool, n: u64) {
        self.pending.total -= n as i64;
        if reserved {
            self.reserved_entries -= n;
        } else {
            self.pending.non_reserved -= n as i64;
        }
    }

    /// The last holder of `key` was removed: the key counts of its keyspace, model scope and
    /// tenant, the entries gauge, its blob.
    fn on_key_gone(&mut self, key: KeyId) {
        let scope_id = self.cat.keyspaces[key.keyspace() as usize].scope;
        let tenant = self.cat.scopes[scope_id as usize].tenant;
        let t = self.cat.tenants.get_mut(&tenant).expect("tenant record");
        debug_assert!(t.prefixes > 0);
        t.prefixes -= 1;
        let (reserved, keys) = (t.reserved, t.keys());
        self.count_key_gone(key, tenant, keys, reserved);
    }

    /// The key counts [`Index::on_key_gone`] keeps besides the tenant record's (which the
    /// caller has counted): keyspace, model scope, the directory's tenant count, the entries
    /// gauge, the key's blob ([`Index::on_entry_removed_at`] counts the same inline).
    fn count_key_gone(&mut self, key: KeyId, tenant: u32, keys: TenantKeys, reserved: bool) {
        let ks = &mut self.cat.keyspaces[key.keyspace() as usize];
        let scope_id = ks.scope;
        ks.keys -= 1;
        if ks.keys == 0 {
            self.reclaimable += 1;
        }
        let scope = &self.cat.scopes[scope_id as usize];
        let models = (scope.model, scope.mscope);
        self.count_key_gone_at(key, models, tenant, keys, reserved, NO_SLOT);
    }

    /// The counts of a key gone above its keyspace's: its model scope's (`models`: the model's
    /// string id and the model scope), the directory's tenant count, the entries gauge (not
    /// for a reserved tenant; its count found at `gauge_slot` when it is there, [`NO_SLOT`]
    /// when not known), and its blob. Shared by [`Index::on_entry_removed_at`] and
    /// [`Index::count_key_gone`].
    #[inline(always)]
    fn count_key_gone_at(
        &mut self,
        key: KeyId,
        (model, mscope): (u32, u32),
        tenant: u32,
        keys: TenantKeys,
        reserved: bool,
        gauge_slot: u32,
    ) {
        let m = &mut self.cat.models[mscope as usize];
        debug_assert!(m.prefixes > 0);
        m.prefixes -= 1;
        self.pending_tenant(tenant, keys, -1);
        if !reserved {
            self.gauge.add_at(gauge_slot, model, -1);
        }
        if key.is_blob() {
            self.cat.blobs.release(key.h as u32);
        }
    }

    /// `replica` serves nothing more in the scope: out of its serving map and sorted list.
    fn stop_serving(&mut self, scope_id: u32, replica: u32) {
        self.reclaimable += 1;
        let strings = &self.cat.strings;
        let scope = &mut self.cat.scopes[scope_id as usize];
        scope.serving.remove(&replica);
        let name = strings.name(replica);
        let at = scope
            .sorted
            .binary_search_by(|r| strings.name(*r).cmp(name))
            .expect("serving replica in sorted list");
        scope.sorted.remove(at);
    }

    /// *Remove(key, replica)* of §3.3. Returns whether there was such an entry.
    fn remove_entry(&mut self, key: KeyId, replica: u32, now: i64) -> bool {
        self.remove_entry_at(key, replica, CountSlots::NONE, now)
    }

    /// [`Index::remove_entry`] counted through `slots` (see [`Index::on_entry_removed_at`]).
    #[inline(always)]
    fn remove_entry_at(&mut self, key: KeyId, replica: u32, slots: CountSlots, now: i64) -> bool {
        let Some(pos) = self.store.find_near(key) else {
            return false;
        };
        let Some((_, key_gone)) = self.store.remove_holder(pos, replica) else {
            return false;
        };
        if self.store.has_dropped() {
            self.count_dropped(now);
        }
        self.on_entry_removed_at(key, replica, key_gone, slots);
        if !key_gone {
            self.quota_touch(key);
        }
        true
    }

    /// Counts and reports the entries the store took out besides one a caller removed: an
    /// extent's tail cut off at `runstore::MAX_REPLICA_EXTENTS` (`RemovalReason::RunExtents`).
    #[cold]
    fn count_dropped(&mut self, now: i64) {
        let dropped: Vec<_> = self.store.take_dropped().collect();
        self.extent_tails_dropped += 1;
        for d in dropped {
            let key = KeyId { ks: d.ks, h: d.h };
            let replica = d.released.entry.replica;
            let algo = self.cat.tenants[&self.cat.tenant_of(key)].algo;
            self.report_removal(key, replica, RemovalReason::RunExtents, algo, now);
            self.on_entry_removed_at(key, replica, d.released.key_gone, CountSlots::NONE);
            if !d.released.key_gone {
                self.quota_touch(key);
            }
        }
    }

    /// Extent tails cut off since the last call ([`Index::count_dropped`]): each a hit of the
    /// `runstore::MAX_REPLICA_EXTENTS` bound, for the server's limit counter.
    pub fn take_extent_tails_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.extent_tails_dropped)
    }

    /// Removes every holder of a key (quota victim), reporting each to the removal sink.
    /// Returns the number of entries removed.
    fn remove_key(&mut self, key: KeyId, now: i64) -> u64 {
        let mut n = 0;
        while let Some(pos) = self.store.find(key) {
            let replica = (self.store.holders_uncounted(pos).next())
                .expect("key without holder")
                .replica();
            let algo = self.cat.tenants[&self.cat.tenant_of(key)].algo;
            self.report_removal(key, replica, RemovalReason::Quota, algo, now);
            let removed = self.remove_entry(key, replica, now);
            debug_assert!(removed);
            n += 1;
        }
        n
    }

    // ---- ingest (§4.2) -----------------------------------------------------------------------

    /// A producer's `timestamp_us` in index nanoseconds: 0 is `now`; anything later than `now`
    /// plus the allowed skew is clamped to that (and reported), earlier values are kept.
    fn producer_ts(&self, timestamp_us: i64, now: i64) -> (i64, bool) {
        if timestamp_us == 0 {
            return (now, false);
        }
        let ts = timestamp_us.saturating_mul(1000);
        let latest = now.saturating_add(self.cfg.max_future_skew_ns.max(0));
        if ts > latest {
            (latest, true)
        } else {
            (ts, false)
        }
    }

    /// Whether a `PrefixEntry` is applied (upserts at least one key): only a chain whose two
    /// arrays differ in length is dropped (§4.2).
    fn prefix_applies(p: &PrefixEntry) -> bool {
        p.block_hashes.len() == p.block_token_counts.len()
    }

    /// Whether `u`'s replica may store entries in `u`'s scope: it serves there already, or the
    /// scope has fewer than [`IndexConfig::max_replicas_per_scope`] serving replicas (a new
    /// scope has none). O(1). Nothing frees room here but the replicas' own entries leaving
    /// (a replica stops serving with its last entry in the scope), so no reclaim runs for it.
    fn replicas_fit(&self, u: &CacheStateUpdate) -> bool {
        let Some(scope) = self
            .cat
            .find_scope(&u.tenant_id, &u.model_id, &u.hash_scheme)
        else {
            return true;
        };
        let serving = &self.cat.scopes[scope as usize].serving;
        serving.len() < self.cfg.max_replicas_per_scope
            || self
                .cat
                .strings
                .get(&u.replica_id)
                .is_some_and(|r| serving.contains_key(&r))
    }

    /// An ingest found a table (names or keyspaces) full: continues the reclaim pass in
    /// progress, or begins one (at most once per [`RECLAIM_ON_FULL_INTERVAL_NS`], and only when
    /// a removal may have left something to free), for at most [`RECLAIM_ON_FULL_BUDGET`]. A
    /// pass that does not finish in that time is finished by the maintenance task's slices.
    /// Whether it ran a step.
    fn reclaim_on_full(&mut self, now: i64) -> bool {
        if self.reclaim_pass.is_none() {
            let due = now
                >= self
                    .last_full_reclaim
                    .saturating_add(RECLAIM_ON_FULL_INTERVAL_NS);
            if self.reclaimable == 0 || !due {
                return false;
            }
            self.last_full_reclaim = now;
        }
        let budget = SweepBudget {
            max_entries: usize::MAX,
            deadline: Some(std::time::Instant::now() + self.cfg.reclaim_on_full_budget),
        };
        self.reclaim_step(budget);
        true
    }

    /// Applies one `CacheStateUpdate` (§4.2): prefixes (chain and legacy forms), stats, then the
    /// tenant quota and the global cap. The gRPC handler skips the probe tenant; `/probe` ingests
    /// under it directly, and its entries are reserved (never counted toward or evicted by the
    /// cap, excluded from aggregates).
    ///
    /// Names are interned only when something is stored under them (an applied prefix or a
    /// stats row). When they do not fit the string table, a reclaim pass runs first (at most
    /// once per [`RECLAIM_ON_FULL_INTERVAL_NS`]) and the update is refused whole only if they
    /// still do not fit.
    pub fn ingest(
        &mut self,
        u: &CacheStateUpdate,
        now: i64,
        rules: &dyn TenantRules,
    ) -> IngestOutcome {
        self.ingest_part(u, 0..u.prefixes.len(), now, rules)
    }

    /// One part of [`Index::ingest`]: the prefixes `u.prefixes[range]`, so that a caller can
    /// apply a large update in bounded steps (the server, `ingest::apply_update`). The first part
    /// (`range.start == 0`) checks that the whole update's names and keyspaces fit and refuses it
    /// whole if not; a later part that no longer fits (another update took the room meanwhile)
    /// is refused alone. Only the last part (`range.end >= u.prefixes.len()`) stores the stats
    /// and enforces the tenant quota and the global cap, as one `ingest` of the whole update
    /// does after all its prefixes.
    pub fn ingest_part(
        &mut self,
        u: &CacheStateUpdate,
        range: std::ops::Range<usize>,
        now: i64,
        rules: &dyn TenantRules,
    ) -> IngestOutcome {
        self.ingest_part_within(u, range, PartBudget::UNBOUNDED, now, rules)
            .0
    }

    /// [`Index::ingest_part`] within `budget`: the part ends once it applied the budget's
    /// blocks, counting what it created (names, keyspaces), or its deadline passed, even before
    /// `range.end`. Returns the outcome and where the part ended (`range.end`, or the end of the
    /// entries it applied); the caller applies the rest (from there) in a later part. Only a part
    /// that reaches the update's end is its last.
    pub fn ingest_part_within(
        &mut self,
        u: &CacheStateUpdate,
        range: std::ops::Range<usize>,
        budget: PartBudget,
        now: i64,
        rules: &dyn TenantRules,
    ) -> (IngestOutcome, usize) {
        let mut admission = Admission::default();
        loop {
            let (out, end) =
                self.ingest_part_admitted(u, range.clone(), budget, &mut admission, now, rules);
            if !out.admission_pending {
                return (out, end);
            }
        }
    }

    /// [`Index::ingest_part_within`] with its check of names and keyspaces in steps too
    /// (`admission`, kept by the caller across the part's attempts): an attempt that only
    /// advanced the check answers [`IngestOutcome::admission_pending`] and applies nothing
    /// (the caller tries the same range again in a later step).
    pub fn ingest_part_admitted(
        &mut self,
        u: &CacheStateUpdate,
        range: std::ops::Range<usize>,
        budget: PartBudget,
        admission: &mut Admission,
        now: i64,
        rules: &dyn TenantRules,
    ) -> (IngestOutcome, usize) {
        self.finish_clear();
        let mut out = IngestOutcome::default();
        let len = u.prefixes.len();
        let last = range.end >= len;
        let part = &u.prefixes[range.start.min(len)..range.end.min(len)];
        let checked = if range.start == 0 {
            &u.prefixes[..]
        } else {
            part
        };
        let applies =
            |ps: &[PrefixEntry]| !u.hash_scheme.is_empty() && ps.iter().any(Self::prefix_applies);
        let check = applies(checked);
        let at = (range.start.min(len), budget.deadline);
        match self.admit(u, checked, check, at, admission, now) {
            Admit::Fits => {}
            Admit::Pending => {
                out.admission_pending = true;
                return (out, range.start.min(len));
            }
            Admit::Refused { strings_full } => {
                out.rejected_string_table_full = strings_full;
                out.rejected_keyspaces_full = !strings_full;
                // Refused: done with its range.
                return (out, range.end.min(len));
            }
        }
        if applies(part) && !self.replicas_fit(u) {
            out.rejected_scope_replicas_full = true;
            return (out, range.end.min(len));
        }
        let prefixes = applies(part);
        let (ts, clamped) = self.producer_ts(u.timestamp_us, now);
        out.timestamp_clamped = clamped;
        self.resolve_update_tenant(&u.tenant_id, rules);
        let applied = if prefixes {
            self.ingest_prefixes(u, part, ts, budget, &mut out)
        } else {
            part.len()
        };
        let part = &part[..applied];
        let applied_to = range.start.min(len) + applied;
        let last = last && applied_to >= len;
        if !u.hash_scheme.is_empty() {
            out.malformed_dropped = part.iter().filter(|p| !Self::prefix_applies(p)).count() as u64;
        }
        if last {
            self.finish_ingest(u, (ts, now), rules, budget.deadline, &mut out);
        }
        self.flush();
        (out, applied_to)
    }

    /// What an update does after all its prefixes: its stats, then the tenant quota and the
    /// global cap (§4.2 steps 4–5). With sliced cap enforcement the cap's step here ends by the
    /// part's `deadline` too (after one eviction at least): the last part and its evictions stay
    /// within one part's time, the rest following in the cap's later slices (an eviction step
    /// of its own after a part used its budget had made the last part last twice as long,
    /// perf/runs/2026-12-07-maintenance-lane.md).
    fn finish_ingest(
        &mut self,
        u: &CacheStateUpdate,
        (ts, now): (i64, i64),
        rules: &dyn TenantRules,
        deadline: Option<std::time::Instant>,
        out: &mut IngestOutcome,
    ) {
        if let Some(s) = &u.stats {
            self.ingest_stats(u, s, ts, out);
        }
        let budget = if u.tenant_id == PROBE_TENANT {
            None
        } else {
            rules.quota(&u.tenant_id)
        };
        if let Some(b) = budget
            && let Some(tenant) = self.cat.strings.get(&u.tenant_id)
            && self.cat.tenants.contains_key(&tenant)
        {
            if self.cfg.cross_core_eviction {
                out.deferred_quota = Some(b);
            } else {
                out.quota_evicted_keys = self.enforce_quota(tenant, b, now);
            }
        }
        if !self.cfg.cross_core_eviction {
            let budget = self.sliced_cap.map_or(SweepBudget::UNBOUNDED, |s| {
                let mut budget = s.budget();
                budget.deadline = budget.deadline.min(deadline).or(budget.deadline);
                budget
            });
            self.enforce_cap(rules, &mut out.cap_evicted, now, budget);
        }
    }

    /// Upserts the applied prefixes of `part` (chain blocks and legacy keys) at time `ts`, each
    /// in the keyspace of its own adapter or else the update's, until `budget` is spent; returns
    /// how many entries of `part` it went through (all of them unless the budget ran out). The
    /// caller checked that at least one prefix applies.
    fn ingest_prefixes(
        &mut self,
        u: &CacheStateUpdate,
        part: &[PrefixEntry],
        ts: i64,
        budget: PartBudget,
        out: &mut IngestOutcome,
    ) -> usize {
        // Counted only when creations cost something (not in a whole `ingest`).
        let counting = budget.blocks_per_created > 0;
        let created_count = |ix: &Self| if counting { ix.created_count() } else { 0 };
        let created_before = created_count(self);
        let tenant = self.cat.strings.intern(&u.tenant_id);
        let model = self.cat.strings.intern(&u.model_id);
        let scheme = self.cat.strings.intern(&u.hash_scheme);
        let replica = self.cat.strings.intern(&u.replica_id);
        let scope = self.ensure_scope(tenant, model, scheme);
        let mut created = created_count(self) - created_before;
        let mut blocks = 0usize;
        for (i, p) in part.iter().enumerate() {
            if !Self::prefix_applies(p) {
                continue;
            }
            let adapter = if p.adapter_id.is_empty() {
                &u.adapter_id
            } else {
                &p.adapter_id
            };
            let before = created_count(self);
            let adapter = self.cat.strings.intern(adapter);
            let ks = self.ensure_keyspace(scope, adapter);
            created += created_count(self) - before;
            self.ingest_prefix(ks, p, replica, ts, out);
            blocks += p.block_hashes.len().max(1);
            if i + 1 < part.len() && budget.spent(blocks, created, i + 1) {
                return i + 1;
            }
        }
        part.len()
    }

    /// Names and keyspaces this core holds: what an ingest created is the difference.
    fn created_count(&self) -> usize {
        self.cat.strings.count() + self.cat.keyspace_ids.len()
    }

    /// Upserts one applied `PrefixEntry`: its chain blocks with cumulative token counts, then
    /// its `prefix_hash` if set; or, without a chain, its `prefix_hash` alone. An upsert refused
    /// because its key is full is counted in `out.holders_refused`.
    fn ingest_prefix(
        &mut self,
        ks: u32,
        p: &PrefixEntry,
        replica: u32,
        ts: i64,
        out: &mut IngestOutcome,
    ) {
        let tier = ranking::tier_from_wire(p.tier);
        if !p.block_hashes.is_empty() {
            self.upsert_chain(&mut ChainCursor::new(), ks, p, replica, tier, ts, out);
        }
        // The prefix hash is no block of the chain: it is placed on its own.
        if p.block_hashes.is_empty() || !p.prefix_hash.is_empty() {
            let (h, n) = (&p.prefix_hash, p.token_count);
            let applied = self.upsert(&mut ChainCursor::new(), ks, h, replica, n, tier, ts);
            out.count(applied);
        }
        if out.holders_refused > 0 || out.keys_refused > 0 || out.extents_refused > 0 {
            self.reclaimable += 1;
        }
    }

    /// Replaces the replica's stats row of `(tenant, model)`; non-finite floats are stored as 0.
    /// A new row beyond the per-model or per-core bound is refused (`out.stats_refused`).
    fn ingest_stats(
        &mut self,
        u: &CacheStateUpdate,
        s: &ReplicaStats,
        ts: i64,
        out: &mut IngestOutcome,
    ) {
        let tenant = self.cat.strings.intern(&u.tenant_id);
        let model = self.cat.strings.intern(&u.model_id);
        let replica = self.cat.strings.intern(&u.replica_id);
        let mscope = self.ensure_model(tenant, model);
        let sanitize = |v: f32| if v.is_finite() { v } else { 0.0 };
        let row = StatsRow {
            cache_memory_bytes: s.cache_memory_bytes,
            hit_rate: sanitize(s.hit_rate),
            pressure: sanitize(s.pressure),
            t2_hit_tokens: s.t2_hit_tokens,
            t2_query_tokens: s.t2_query_tokens,
            last_seen: ts,
            stats_reported: ts,
        };
        let stats = &mut self.cat.models[mscope as usize].stats;
        if let Some(cur) = stats.get_mut(&replica) {
            *cur = row;
            return;
        }
        if stats.len() >= self.cfg.max_stats_rows_per_model
            || self.stats_rows >= self.cfg.max_stats_rows
        {
            out.stats_refused = true;
            self.reclaimable += 1;
            return;
        }
        stats.insert(replica, row);
        self.stats_rows += 1;
    }

    // ---- events (§5) -------------------------------------------------------------------------

    /// Applies one `CacheEvent` (§5). `PREFIX_ADDED`, unspecified and unknown types do nothing.
    pub fn apply_event(
        &mut self,
        e: &CacheEvent,
        now: i64,
        _rules: &dyn TenantRules,
    ) -> EventOutcome {
        self.finish_clear();
        let mut out = EventOutcome::default();
        let (ts, clamped) = self.producer_ts(e.timestamp_us, now);
        out.timestamp_clamped = clamped;
        let evicted = e.r#type == cache_event::Type::PrefixEvicted as i32;
        if evicted && let Some(memo) = self.cat.event_memo_for(e) {
            out.entries_removed = match memo.targets {
                // The common case (one keyspace), here rather than through `evict`'s call. Its
                // fields are read one by one, not as a copy of the plan: copying the struct
                // through the stack stalled store-to-load forwarding (~1/4 of this function's
                // samples on the Mooncake trace's removals).
                EvictTargets::One(ks) => {
                    let (replica, counts) = (memo.replica, memo.counts);
                    self.cat
                        .key_for(ks, &e.prefix_hash)
                        .is_some_and(|k| self.remove_entry_at(k, replica, counts, now))
                        as u64
                }
                _ => {
                    let plan = *memo;
                    self.evict(&plan, &e.prefix_hash, now)
                }
            };
            self.flush_inline();
            return out;
        }
        let Some(mscope) = self.cat.find_model(&e.tenant_id, &e.model_id) else {
            return out;
        };
        let Some(replica) =
            (self.cat.strings).get_hinted(&e.replica_id, &self.cat.hints.event_replica)
        else {
            return out;
        };
        match cache_event::Type::try_from(e.r#type) {
            Ok(cache_event::Type::PrefixEvicted) => {
                let adapter = if e.adapter_id.is_empty() {
                    DEAD
                } else {
                    match self.cat.strings.get(&e.adapter_id) {
                        Some(a) => a,
                        None => return out,
                    }
                };
                let (tenant, model) = {
                    let m = &self.cat.models[mscope as usize];
                    (m.tenant, m.model)
                };
                let targets = self.cat.evict_targets(mscope, adapter);
                let plan = EvictPlan {
                    replica,
                    adapter,
                    mscope,
                    targets,
                    counts: self.count_slots(targets, replica),
                };
                let memo = EventMemo {
                    epoch: self.cat.epoch,
                    evict: plan,
                    names: [
                        MemoName::new(&e.tenant_id, tenant),
                        MemoName::new(&e.model_id, model),
                        MemoName::new(&e.replica_id, replica),
                        // The empty name (no adapter) always has a signature.
                        MemoName::new(&e.adapter_id, adapter),
                    ],
                };
                self.cat.event_memo = Some(memo);
                out.entries_removed = self.evict(&plan, &e.prefix_hash, now);
            }
            Ok(cache_event::Type::ReplicaUpdated) => {
                if let Some(row) = self.cat.models[mscope as usize].stats.get_mut(&replica) {
                    row.last_seen = ts;
                    out.stats_changed = true;
                }
            }
            Ok(cache_event::Type::AllCleared) => {
                out.entries_removed = self.begin_clear(mscope, replica);
                out.stats_changed = self.cat.models[mscope as usize]
                    .stats
                    .remove(&replica)
                    .is_some();
                if out.stats_changed {
                    self.stats_rows -= 1;
                    self.reclaimable += 1;
                }
            }
            _ => {}
        }
        self.flush();
        out
    }

    /// Where removals of `replica`'s entries from the one keyspace of `targets` count (see
    /// [`CountSlots`]).
    fn count_slots(&self, targets: EvictTargets, replica: u32) -> CountSlots {
        let EvictTargets::One(ks) = targets else {
            return CountSlots::NONE;
        };
        let scope = &self.cat.scopes[self.cat.keyspaces[ks as usize].scope as usize];
        CountSlots {
            tenant: self.cat.tenants.slot(&scope.tenant),
            serving: scope.serving.slot(&replica),
            gauge: self.gauge.counts.slot(&scope.model),
        }
    }

    /// Removes the memo's replica from the key `hash` in each keyspace the memo's event targets
    /// (`PREFIX_EVICTED`). Returns the entries removed.
    fn evict(&mut self, memo: &EvictPlan, hash: &[u8], now: i64) -> u64 {
        let mut removed = 0;
        match memo.targets {
            EvictTargets::None => {}
            EvictTargets::One(ks) => {
                if let Some(k) = self.cat.key_for(ks, hash)
                    && self.remove_entry(k, memo.replica, now)
                {
                    removed += 1;
                }
            }
            EvictTargets::Many => {
                // Index loops: removals never change the scope/keyspace lists.
                let mscope = memo.mscope as usize;
                for si in 0..self.cat.models[mscope].scopes.len() {
                    let s = self.cat.models[mscope].scopes[si];
                    for ki in 0..self.cat.scopes[s as usize].keyspaces.len() {
                        let ks = self.cat.scopes[s as usize].keyspaces[ki];
                        if memo.adapter != DEAD
                            && self.cat.keyspaces[ks as usize].adapter != memo.adapter
                        {
                            continue;
                        }
                        if let Some(k) = self.cat.key_for(ks, hash)
                            && self.remove_entry(k, memo.replica, now)
                        {
                            removed += 1;
                        }
                    }
                }
            }
        }
        removed
    }

    // ---- reclaiming names and records --------------------------------------------------------

    /// The whole reclaim pass in one call (see the `reclaim` module): frees every record and
    /// name nothing refers to any more. Returns the number of names freed.
    pub fn reclaim(&mut self) -> u64 {
        loop {
            if let Some(freed) = self.reclaim_step(SweepBudget::UNBOUNDED) {
                return freed;
            }
        }
    }

    // ---- presence helpers (C049) -------------------------------------------------------------

    /// Whether the tenant holds any prefix key on any core.
    pub fn has_tenant(&self, tenant: &str) -> bool {
        self.tenant_known(tenant)
    }

    /// Whether `(tenant, model)` holds any prefix key (core-local by routing).
    pub fn has_tenant_model(&self, tenant: &str, model: &str) -> bool {
        self.cat
            .find_model(tenant, model)
            .is_some_and(|m| self.cat.models[m as usize].prefixes > self.keys_going_with_clear(m))
    }

    /// Whether any replica serves `(tenant, model, scheme)`.
    pub fn has_scope(&self, tenant: &str, model: &str, scheme: &str) -> bool {
        self.cat
            .find_scope(tenant, model, scheme)
            .is_some_and(|s| !self.cat.scopes[s as usize].serving.is_empty())
    }

    /// Tenant known anywhere: local keys, else the directory.
    pub(crate) fn tenant_known(&self, tenant: &str) -> bool {
        let (local, fp, going) = match self
            .cat
            .strings
            .get(tenant)
            .and_then(|t| Some((t, self.cat.tenants.get(&t)?)))
        {
            Some((t, rec)) => (rec.prefixes, rec.fp, self.tenant_keys_going_with_clear(t)),
            None => (0, Directory::fingerprint(tenant), 0),
        };
        local > going
            || self.dir.tenant_keys(fp).saturating_sub(going) > 0
            || self.dir.is_saturated()
    }

    /// Distinct prefix keys of a tenant on this core.
    pub fn tenant_prefix_count(&self, tenant: &str) -> u64 {
        self.cat
            .strings
            .get(tenant)
            .and_then(|t| self.cat.tenants.get(&t))
            .map_or(0, |r| r.prefixes)
    }

    /// Every storage entry on this core as `(tenant, model, scheme, adapter, hash, replica,
    /// token_count, last_seen, wire tier, access_count)`, sorted. For tests and debugging
    /// (allocates).
    pub fn dump_entries(&self) -> Vec<EntryDump> {
        let mut out = Vec::with_capacity(self.store.entry_count());
        for pos in self.store.places() {
            let key = self.store.key_at(pos);
            let scope = self.cat.scope_of(key);
            let keyspace = &self.cat.keyspaces[key.keyspace() as usize];
            let mut buf = [0u8; 8];
            let hash = self.cat.hash_bytes(key, &mut buf).to_vec();
            let cleared = self.cleared_replica(scope.mscope);
            for h in self.store.holders(pos) {
                if h.replica() == cleared {
                    continue;
                }
                out.push(EntryDump {
                    tenant: self.cat.strings.name(scope.tenant).to_string(),
                    model: self.cat.strings.name(scope.model).to_string(),
                    scheme: self.cat.strings.name(scope.scheme).to_string(),
                    adapter: self.cat.strings.name(keyspace.adapter).to_string(),
                    hash: hash.clone(),
                    replica: self.cat.strings.name(h.replica()).to_string(),
                    token_count: h.tokens,
                    last_seen: h.last_seen(),
                    tier: ranking::tier_to_wire(h.tier()),
                    access_count: h.access as u64,
                });
            }
        }
        out.sort();
        out
    }

    /// Approximate heap bytes of this core's index structures (the store dominates).
    pub fn approx_heap_bytes(&self) -> usize {
        self.store.heap_bytes() + self.cat.strings.heap_bytes()
    }
}

/// One storage entry, flattened (see [`Index::dump_entries`]).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct EntryDump {
    /// Tenant id.
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// Hash scheme.
    pub scheme: String,
    /// Adapter id ("" = default); with the scope it names the keyspace.
    pub adapter: String,
    /// Prefix hash bytes.
    pub hash: Vec<u8>,
    /// Holder replica.
    pub replica: String,
    /// Stored token count.
    pub token_count: i32,
    /// Last seen, unix ns.
    pub last_seen: i64,
    /// Tier as reported on the wire (0..=3).
    pub tier: i32,
    /// LFU counter.
    pub access_count: u64,
}

#[cfg(test)]
mod name_sig_tests {
    use super::NameSig;

    /// Two names have one signature exactly when they are equal, at every length around the
    /// signature's cases, with the one differing byte anywhere; longer names have none.
    #[test]
    fn equal_signatures_exactly_for_equal_names() {
        for n in 0..=16usize {
            let a: String = (0..n)
                .map(|i| (b'a' + (i * 7 % 26) as u8) as char)
                .collect();
            assert_eq!(NameSig::of(&a), NameSig::of(&a.clone()));
            for at in 0..n {
                let mut b = a.clone().into_bytes();
                b[at] = b'A';
                let b = String::from_utf8(b).unwrap();
                assert_ne!(
                    NameSig::of(&a),
                    NameSig::of(&b),
                    "length {n}, differs at {at}"
                );
            }
            let longer = format!("{a}a");
            assert_ne!(NameSig::of(&a), NameSig::of(&longer));
        }
        assert_eq!(NameSig::of(&"x".repeat(17)), None);
    }
}
