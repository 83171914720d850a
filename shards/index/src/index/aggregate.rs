//! Read-side aggregates: GetCacheState (§11), the `/snapshot` computation (§14) as per-core
//! parts plus a merge, and the `inferencecache_index_entries{model}` gauge (§16). These run on
//! the admin path and may allocate. Reserved (probe) tenants are excluded from snapshot rows and
//! the gauge.

use super::Index;
use super::store::{FIRST, Loc, PLACES_PER_STEP, Scan, Store};
use inferencecache_proto::v1alpha1::ReplicaStats;
use std::collections::{BTreeMap, HashMap};

/// GetCacheState's answer for one `(tenant, model)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheState {
    /// Stats rows of the model scope sorted by replica id (`client_version` always empty).
    pub replicas: Vec<ReplicaStats>,
    /// Prefix keys of exactly that tenant and model (any scheme/adapter).
    pub total_prefixes: i64,
}

/// Stats part of a replica row as seen by one core (before the cross-model/core merge).
#[derive(Clone, Debug, PartialEq)]
pub struct PartStats {
    /// Model of the row (tie-break when two rows share `last_seen`: smaller model wins).
    pub model: String,
    /// Reported cache memory.
    pub cache_memory_bytes: i64,
    /// Sanitised hit rate.
    pub hit_rate: f32,
    /// Sanitised pressure.
    pub pressure: f32,
    /// T2 hit tokens.
    pub t2_hit_tokens: i64,
    /// T2 query tokens.
    pub t2_query_tokens: i64,
    /// Liveness time (ns) — `lastUpdate`.
    pub last_seen: i64,
}

/// One `(tenant, replica)` as seen by one core.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PartReplica {
    /// Tenant ("" = untenanted).
    pub tenant: String,
    /// Replica id.
    pub replica: String,
    /// The latest stats row of this replica on this core, if any.
    pub stats: Option<PartStats>,
    /// Prefix keys this replica holds in the tenant on this core.
    pub prefix_count: u64,
    /// Max entry `last_seen` (ns) on this core; `None` when it holds nothing.
    pub last_event_at: Option<i64>,
}

/// Where a sliced `/snapshot` part stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PartCursor {
    /// The next key's place.
    Keys(Loc),
    /// The next model scope record.
    Stats(u32),
    Done,
}

impl Default for PartCursor {
    fn default() -> Self {
        PartCursor::Keys(FIRST)
    }
}

/// A `/snapshot` part being built in slices ([`Index::snapshot_part_step`]), keyed by names so
/// it outlives the ids of one slice. Bounded like the part itself: one row per `(tenant,
/// replica)` and per tenant of the core.
#[derive(Debug, Default)]
pub struct SnapshotPartBuilder {
    reps: HashMap<(String, String), PartReplica>,
    tenants: HashMap<String, u64>,
    cursor: PartCursor,
}

impl SnapshotPartBuilder {
    /// The part built (complete once the last step said so).
    pub fn finish(self) -> SnapshotPart {
        let replicas = self
            .reps
            .into_iter()
            .map(|((tenant, replica), p)| PartReplica {
                tenant,
                replica,
                ..p
            })
            .collect();
        SnapshotPart {
            replicas,
            tenant_entries: self.tenants.into_iter().collect(),
        }
    }
}

/// One slice's counts by string ids (valid within the slice).
#[derive(Default)]
struct SliceRows {
    reps: HashMap<(u32, u32), PartReplica>,
    tenants: HashMap<u32, u64>,
}

/// One core's contribution to `/snapshot`; merge with [`merge_snapshot_parts`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapshotPart {
    /// Replica rows of this core.
    pub replicas: Vec<PartReplica>,
    /// `(tenant, distinct non-reserved prefix keys)` of this core.
    pub tenant_entries: Vec<(String, u64)>,
}

/// A final `/snapshot` replica row (§14). Times are unix ns; `None` renders as the zero-time
/// sentinel `"0001-01-01T00:00:00Z"`.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaRow {
    /// `replicaId`.
    pub replica_id: String,
    /// `tenant` (omit when empty).
    pub tenant: String,
    /// `cacheMemoryBytes`.
    pub cache_memory_bytes: i64,
    /// `hitRate`.
    pub hit_rate: f32,
    /// `pressure`.
    pub pressure: f32,
    /// `lastUpdate` (stats liveness); `None` = zero time.
    pub last_update: Option<i64>,
    /// `prefixCount`.
    pub prefix_count: u64,
    /// `lastEventAt` (always rendered); `None` = zero time.
    pub last_event_at: Option<i64>,
    /// `statsReported` (omit when false).
    pub stats_reported: bool,
    /// `t2HitTokens` (omit when 0).
    pub t2_hit_tokens: i64,
    /// `t2QueryTokens` (omit when 0).
    pub t2_query_tokens: i64,
}

/// A final `/snapshot` tenant row (§14).
#[derive(Clone, Debug, PartialEq)]
pub struct TenantRow {
    /// `tenantId` (always present, even "").
    pub tenant_id: String,
    /// `indexEntries`.
    pub index_entries: u64,
    /// `hitRate`: f32 of the f64 mean over the tenant's stats-bearing replicas.
    pub hit_rate: f32,
    /// `hitRateReported` (omit when false).
    pub hit_rate_reported: bool,
    /// `memoryUsed`: always 0 (deprecated).
    pub memory_used: i64,
}

/// The merged `/snapshot` content; render empty arrays as `null`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SnapshotRows {
    /// Sorted by tenant then replica id.
    pub replicas: Vec<ReplicaRow>,
    /// Sorted by tenant id.
    pub tenants: Vec<TenantRow>,
    /// `totalPrefixes` = Σ tenants.index_entries.
    pub total_prefixes: u64,
    /// `hotPrefixes`: always 0.
    pub hot_prefixes: u64,
}

fn newer(a: &PartStats, b: &PartStats) -> bool {
    a.last_seen > b.last_seen || (a.last_seen == b.last_seen && a.model < b.model)
}

/// Merges per-core parts into the final rows (also correct for a single part).
pub fn merge_snapshot_parts(parts: &[SnapshotPart]) -> SnapshotRows {
    let mut reps: BTreeMap<(String, String), PartReplica> = BTreeMap::new();
    let mut tenants: BTreeMap<String, u64> = BTreeMap::new();
    for part in parts {
        for r in &part.replicas {
            let e = reps
                .entry((r.tenant.clone(), r.replica.clone()))
                .or_insert_with(|| PartReplica {
                    tenant: r.tenant.clone(),
                    replica: r.replica.clone(),
                    ..Default::default()
                });
            e.prefix_count += r.prefix_count;
            e.last_event_at = match (e.last_event_at, r.last_event_at) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            if let Some(s) = &r.stats {
                match &e.stats {
                    Some(cur) if !newer(s, cur) => {}
                    _ => e.stats = Some(s.clone()),
                }
            }
            tenants.entry(r.tenant.clone()).or_insert(0);
        }
        for (t, n) in &part.tenant_entries {
            *tenants.entry(t.clone()).or_insert(0) += n;
        }
    }
    let mut out = SnapshotRows::default();
    let mut hit: HashMap<String, (f64, u64)> = HashMap::new();
    for ((tenant, replica), r) in reps {
        let s = r.stats.as_ref();
        if let Some(s) = s {
            let e = hit.entry(tenant.clone()).or_insert((0.0, 0));
            e.0 += s.hit_rate as f64;
            e.1 += 1;
        }
        out.replicas.push(ReplicaRow {
            replica_id: replica,
            tenant,
            cache_memory_bytes: s.map_or(0, |s| s.cache_memory_bytes),
            hit_rate: s.map_or(0.0, |s| s.hit_rate),
            pressure: s.map_or(0.0, |s| s.pressure),
            last_update: s.map(|s| s.last_seen),
            prefix_count: r.prefix_count,
            last_event_at: r.last_event_at,
            stats_reported: s.is_some(),
            t2_hit_tokens: s.map_or(0, |s| s.t2_hit_tokens),
            t2_query_tokens: s.map_or(0, |s| s.t2_query_tokens),
        });
    }
    for (tenant, entries) in tenants {
        let (sum, n) = hit.get(&tenant).copied().unwrap_or((0.0, 0));
        out.total_prefixes += entries;
        out.tenants.push(TenantRow {
            tenant_id: tenant,
            index_entries: entries,
            hit_rate: if n > 0 { (sum / n as f64) as f32 } else { 0.0 },
            hit_rate_reported: n > 0,
            memory_used: 0,
        });
    }
    out
}

/// Cross-core sum of the per-model entries gauge: the server feeds every core's
/// [`Index::drain_gauge_updates`] into it and publishes the returned global value.
#[derive(Debug, Default)]
pub struct EntriesGauge {
    per_model: HashMap<String, HashMap<usize, u64>>,
}

impl EntriesGauge {
    /// Records core `core`'s count for `model`; returns the global count to publish.
    pub fn update(&mut self, core: usize, model: &str, count: u64) -> u64 {
        let m = self.per_model.entry(model.to_string()).or_default();
        m.insert(core, count);
        m.values().sum()
    }
}

impl Index {
    /// GetCacheState for `(tenant, model)` (§11). The handler answers the probe tenant itself.
    pub fn cache_state(&self, tenant: &str, model: &str) -> CacheState {
        let Some(m) = self.cat.find_model(tenant, model) else {
            return CacheState::default();
        };
        let rec = &self.cat.models[m as usize];
        let mut replicas: Vec<ReplicaStats> = rec
            .stats
            .iter()
            .map(|(r, row)| ReplicaStats {
                replica_id: self.cat.strings.name(*r).to_string(),
                cache_memory_bytes: row.cache_memory_bytes,
                hit_rate: row.hit_rate,
                pressure: row.pressure,
                client_version: String::new(),
                t2_hit_tokens: row.t2_hit_tokens,
                t2_query_tokens: row.t2_query_tokens,
            })
            .collect();
        replicas.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        CacheState {
            replicas,
            total_prefixes: rec.prefixes as i64,
        }
    }

    /// This core's `/snapshot` part in one call (tests, tools): [`Index::snapshot_part_step`]
    /// to the end. The server builds it in slices.
    pub fn snapshot_part(&self) -> SnapshotPart {
        let mut b = SnapshotPartBuilder::default();
        while !self.snapshot_part_step(&mut b, usize::MAX, None) {}
        b.finish()
    }

    /// One slice of this core's `/snapshot` part into `b`: keys from where it stopped, then the
    /// model scopes' stats rows, until `max_entries` entries (a key's holders are never split; a
    /// key or a model scope without rows counts as one) or `deadline` (read every few keys).
    /// Returns whether the part is complete. What `b` holds is keyed by names, so the reclaim
    /// pass may run between two slices; a held key never moves, so a part built across
    /// mutations counts every key present throughout once (docs/ARCHITECTURE.md §6).
    pub fn snapshot_part_step(
        &self,
        b: &mut SnapshotPartBuilder,
        max_entries: usize,
        deadline: Option<std::time::Instant>,
    ) -> bool {
        /// Keys or model scopes between two clock reads.
        const CLOCK_EVERY: usize = 64;
        let mut slice = SliceRows::default();
        let mut n = 0usize;
        let mut since_clock = 0usize;
        let spent = |n: usize, since: &mut usize| {
            if n >= max_entries {
                return true;
            }
            *since += 1;
            if *since < CLOCK_EVERY {
                return false;
            }
            *since = 0;
            deadline.is_some_and(|d| std::time::Instant::now() >= d)
        };
        while let PartCursor::Keys(at) = b.cursor {
            if n > 0 && spent(n, &mut since_clock) {
                break;
            }
            match self.store.scan(at, PLACES_PER_STEP) {
                Scan::End => b.cursor = PartCursor::Stats(0),
                Scan::Paused(next) => {
                    // Places without a key count too: a slice stays bounded.
                    n += PLACES_PER_STEP;
                    b.cursor = PartCursor::Keys(next);
                }
                Scan::Held(pos) => {
                    n += self.part_key(pos, &mut slice).max(1);
                    b.cursor = PartCursor::Keys(Store::after(pos));
                }
            }
        }
        self.merge_slice(b, slice);
        while let PartCursor::Stats(pos) = b.cursor {
            if pos as usize >= self.cat.models.len() {
                b.cursor = PartCursor::Done;
                break;
            }
            if n > 0 && spent(n, &mut since_clock) {
                break;
            }
            n += self.part_stats(pos, b).max(1);
            b.cursor = PartCursor::Stats(pos + 1);
        }
        b.cursor == PartCursor::Done
    }

    /// Counts the key at place `pos` into `slice`; returns its entries counted.
    fn part_key(&self, pos: Loc, slice: &mut SliceRows) -> usize {
        let key = self.store.key_at(pos);
        let tenant = self.cat.tenant_of(key);
        if self.cat.tenants.get(&tenant).is_some_and(|r| r.reserved) {
            return 0;
        }
        let cleared = self.cleared_replica(self.cat.scope_of(key).mscope);
        let mut held = 0;
        for h in self.store.holders_uncounted(pos) {
            if h.replica() == cleared {
                continue;
            }
            held += 1;
            let e = slice.reps.entry((tenant, h.replica())).or_default();
            e.prefix_count += 1;
            e.last_event_at = Some(
                e.last_event_at
                    .map_or(h.last_seen(), |x| x.max(h.last_seen())),
            );
        }
        if held > 0 {
            *slice.tenants.entry(tenant).or_insert(0) += 1;
        }
        held
    }

    /// Adds one slice's counts (by ids, valid within the slice) to `b` (by names).
    fn merge_slice(&self, b: &mut SnapshotPartBuilder, slice: SliceRows) {
        let s = &self.cat.strings;
        for ((t, r), p) in slice.reps {
            let e = b
                .reps
                .entry((s.name(t).to_string(), s.name(r).to_string()))
                .or_default();
            e.prefix_count += p.prefix_count;
            e.last_event_at = match (e.last_event_at, p.last_event_at) {
                (Some(a), Some(c)) => Some(a.max(c)),
                (a, c) => a.or(c),
            };
        }
        for (t, n) in slice.tenants {
            *b.tenants.entry(s.name(t).to_string()).or_insert(0) += n;
        }
    }

    /// Adds the stats rows of model scope record `pos` to `b`; returns how many.
    fn part_stats(&self, pos: u32, b: &mut SnapshotPartBuilder) -> usize {
        let m = &self.cat.models[pos as usize];
        let reserved = self.cat.tenants.get(&m.tenant).is_some_and(|r| r.reserved);
        if m.stats.is_empty() || reserved {
            return 0; // freed records have no stats
        }
        let names = &self.cat.strings;
        for (r, row) in &m.stats {
            let s = PartStats {
                model: names.name(m.model).to_string(),
                cache_memory_bytes: row.cache_memory_bytes,
                hit_rate: row.hit_rate,
                pressure: row.pressure,
                t2_hit_tokens: row.t2_hit_tokens,
                t2_query_tokens: row.t2_query_tokens,
                last_seen: row.last_seen,
            };
            let key = (names.name(m.tenant).to_string(), names.name(*r).to_string());
            let e = b.reps.entry(key).or_default();
            match &e.stats {
                Some(cur) if !newer(&s, cur) => {}
                _ => e.stats = Some(s),
            }
        }
        m.stats.len()
    }

    /// Convenience for one core: this core's part merged on its own.
    pub fn snapshot(&self) -> SnapshotRows {
        merge_snapshot_parts(&[self.snapshot_part()])
    }

    /// Calls `f(model, count)` for every model whose non-reserved key count on this core changed
    /// since the last call (including models that drained to 0, reported once). The server calls
    /// it after every ingest, event and sweep and publishes the values (summed across cores via
    /// [`EntriesGauge`]). Does not allocate.
    pub fn drain_gauge_updates(&mut self, mut f: impl FnMut(&str, u64)) {
        for m in self.gauge.dirty.drain(..) {
            let e = self.gauge.counts.get_mut(&m).expect("dirty model");
            e.1 = false;
            if e.0 == 0 {
                // Its 0 is published: the next reclaim pass may free the model's name.
                self.reclaimable += 1;
                if !e.2 {
                    e.2 = true;
                    self.gauge.zeros.push(m);
                }
            }
            f(self.cat.strings.name(m), e.0);
        }
    }

    /// Current non-reserved key count of every model this core knows: models with keys, and
    /// models that drained to 0 until the reclaim pass after their 0 was published.
    pub fn model_entry_counts(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self
            .gauge
            .counts
            .iter()
            .map(|(m, (c, _, _))| (self.cat.strings.name(*m).to_string(), *c))
            .collect();
        v.sort();
        v
    }

    /// Non-reserved distinct prefix keys of one model on this core.
    pub fn model_entry_count(&self, model: &str) -> u64 {
        self.cat
            .strings
            .get(model)
            .and_then(|m| self.gauge.counts.get(&m))
            .map_or(0, |e| e.0)
    }
}

#[cfg(test)]
mod tests {
    use crate::index::{Index, merge_snapshot_parts};
    use crate::rules::NoRules;
    use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry, ReplicaStats};

    const NOW: i64 = 1_700_000_000_000_000_000;

    fn update(
        tenant: &str,
        model: &str,
        replica: &str,
        keys: std::ops::Range<u64>,
    ) -> CacheStateUpdate {
        CacheStateUpdate {
            tenant_id: tenant.into(),
            model_id: model.into(),
            replica_id: replica.into(),
            hash_scheme: "s".into(),
            prefixes: keys
                .map(|k| PrefixEntry {
                    prefix_hash: k.to_be_bytes().to_vec(),
                    token_count: 16,
                    ..Default::default()
                })
                .collect(),
            stats: Some(ReplicaStats {
                hit_rate: 0.5,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A part built in slices of 10 entries is the part built in one call.
    #[test]
    fn a_snapshot_part_built_in_slices_is_the_part_built_at_once() {
        let mut ix = Index::default();
        for i in 0..40 {
            let (t, m, r) = (
                format!("t{}", i % 3),
                format!("m{}", i % 5),
                format!("r{i}"),
            );
            ix.ingest(&update(&t, &m, &r, i * 7..i * 7 + 20), NOW, &NoRules);
        }
        let whole = merge_snapshot_parts(&[ix.snapshot_part()]);
        let mut b = super::SnapshotPartBuilder::default();
        let mut slices = 1;
        while !ix.snapshot_part_step(&mut b, 10, None) {
            slices += 1;
        }
        // 40 × 20 entries (some keys shared) and 40 stats rows, 10 per slice.
        assert!(slices >= 60, "{slices} slices");
        assert_eq!(merge_snapshot_parts(&[b.finish()]), whole);
    }
}
