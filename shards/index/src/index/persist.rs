//! Warm-restart support (docs/ARCHITECTURE.md §6): exporting this core's entries and stats rows
//! in bounded slices, and restoring them one record at a time into a fresh index.
//!
//! Every exported record names its tenant, model, scheme, adapter and replica by string (never
//! by this core's interned ids), so a record can be routed to whichever core owns its
//! `(tenant, model)` after a restart with another core count. A restored entry keeps its
//! `last_seen`, tier, token count and LFU counter: lookups rank it the same, the TTL sweep
//! expires it when it would have expired anyway, and the cap / quota orders (which compare
//! those values and names, never ids) pick the same victims.

use super::ranking::{TIER_NEGATIVE, TIER_RAW_COLD};
use super::store::{ChainCursor, FIRST, Loc, Scan, Store};
use super::{Index, StatsRow};
use crate::rules::TenantRules;

/// Where [`Index::export_entries`] continues: a place in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryCursor(Loc);

impl EntryCursor {
    /// The first place: an export of every entry starts here.
    pub const START: EntryCursor = EntryCursor(FIRST);
}

/// One storage entry as a snapshot carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PersistEntry<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Model id.
    pub model: &'a str,
    /// Hash scheme.
    pub scheme: &'a str,
    /// Adapter id ("" = none).
    pub adapter: &'a str,
    /// Prefix hash bytes (wire form).
    pub hash: &'a [u8],
    /// Holder replica.
    pub replica: &'a str,
    /// Stored token count.
    pub tokens: i32,
    /// Last seen, unix ns (the producer's stamp, kept across restarts).
    pub last_seen: i64,
    /// Stored tier (the index's internal code, not the wire tier).
    pub tier: u8,
    /// LFU counter.
    pub access: u32,
}

/// One replica stats row as a snapshot carries it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PersistStats<'a> {
    /// Tenant id.
    pub tenant: &'a str,
    /// Model id.
    pub model: &'a str,
    /// Replica id.
    pub replica: &'a str,
    /// `cache_memory_bytes`.
    pub cache_memory_bytes: i64,
    /// `hit_rate`.
    pub hit_rate: f32,
    /// `pressure`.
    pub pressure: f32,
    /// `t2_hit_tokens`.
    pub t2_hit_tokens: i64,
    /// `t2_query_tokens`.
    pub t2_query_tokens: i64,
    /// Liveness stamp, unix ns.
    pub last_seen: i64,
    /// Time of the last stats payload, unix ns.
    pub stats_reported: i64,
}

/// Ids resolved for the previous restored entry of one index, so a run of entries of the same
/// keyspace (a key's holders, a chain's blocks) skips the name and catalog lookups. Ids stay
/// valid for the whole restore (nothing is reclaimed while restoring). One per index; start
/// each restore with [`RestoreCache::default`].
#[derive(Default)]
pub struct RestoreCache {
    /// tenant, model, scheme, adapter of the last keyspace; its id; the tenant's TTL.
    keyspace: Option<([String; 4], u32, i64)>,
    /// The last replica name and id.
    replica: Option<(String, u32)>,
}

/// What restoring one record did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreOutcome {
    /// The record is in the index.
    Restored,
    /// Older than its tenant's TTL at `now`: the sweep would remove it, so it is not restored.
    Expired,
    /// Not restored: a bound of this index (names, holders per key, replicas per scope, stats
    /// rows) or an invalid
    /// field (unknown tier).
    Refused,
}

impl Index {
    /// Calls `f` for every storage entry of the keys from `from` on, in the store's place order,
    /// stopping after the key at which `max_entries` entries were reached (a key's holders are
    /// never split; places without a key, or a key with none to yield, all its holders cleared
    /// by a pending `ALL_CLEARED`, count one each, so a call looks at most at about
    /// `max_entries` places). Returns
    /// where to continue, or `None` when every key was visited. A held key keeps its place, so
    /// a snapshot sliced across mutations carries every key held throughout exactly once (a
    /// key created at a place already passed is left for the next snapshot).
    pub fn export_entries(
        &self,
        from: EntryCursor,
        max_entries: usize,
        mut f: impl FnMut(&PersistEntry<'_>),
    ) -> Option<EntryCursor> {
        let mut at = from.0;
        let mut n = 0usize;
        while n < max_entries {
            let pos = match self.store.scan(at, max_entries - n) {
                Scan::End => return None,
                Scan::Paused(next) => {
                    n = max_entries;
                    at = next;
                    continue;
                }
                Scan::Held(pos) => pos,
            };
            let key = self.store.key_at(pos);
            let scope = self.cat.scope_of(key);
            let ks = &self.cat.keyspaces[key.keyspace() as usize];
            let mut buf = [0u8; 8];
            let hash = self.cat.hash_bytes(key, &mut buf);
            let s = &self.cat.strings;
            let cleared = self.cleared_replica(scope.mscope);
            let before = n;
            for h in self.store.holders(pos) {
                if h.replica() == cleared {
                    continue;
                }
                f(&PersistEntry {
                    tenant: s.name(scope.tenant),
                    model: s.name(scope.model),
                    scheme: s.name(scope.scheme),
                    adapter: s.name(ks.adapter),
                    hash,
                    replica: s.name(h.replica()),
                    tokens: h.tokens,
                    last_seen: h.last_seen(),
                    tier: h.tier(),
                    access: h.access,
                });
                n += 1;
            }
            n = n.max(before + 1);
            at = Store::after(pos);
        }
        Some(EntryCursor(at))
    }

    /// Calls `f` for every stats row of the model scopes at record positions `from..`, stopping
    /// after the model scope at which `max_rows` rows were reached; returns where to continue.
    /// A record without rows counts as one, so a call visits at most `max_rows` records (the
    /// model scopes of a core are bounded only by its keyspaces).
    pub fn export_stats(
        &self,
        from: u32,
        max_rows: usize,
        mut f: impl FnMut(&PersistStats<'_>),
    ) -> Option<u32> {
        let models = self.cat.models.len() as u32;
        let mut pos = from;
        let mut n = 0usize;
        let s = &self.cat.strings;
        while pos < models && n < max_rows {
            let m = &self.cat.models[pos as usize];
            // Freed records have no stats rows.
            n += usize::from(m.stats.is_empty());
            for (replica, row) in &m.stats {
                f(&PersistStats {
                    tenant: s.name(m.tenant),
                    model: s.name(m.model),
                    replica: s.name(*replica),
                    cache_memory_bytes: row.cache_memory_bytes,
                    hit_rate: row.hit_rate,
                    pressure: row.pressure,
                    t2_hit_tokens: row.t2_hit_tokens,
                    t2_query_tokens: row.t2_query_tokens,
                    last_seen: row.last_seen,
                    stats_reported: row.stats_reported,
                });
                n += 1;
            }
            pos += 1;
        }
        (pos < models).then_some(pos)
    }

    /// Whether the names not yet interned among `names` fit this core's string table.
    fn restore_names_fit(&self, names: &[&str]) -> bool {
        let s = &self.cat.strings;
        let (mut n, mut bytes) = (0usize, 0usize);
        for (i, name) in names.iter().enumerate() {
            if s.get(name).is_none() && !names[..i].contains(name) {
                n += 1;
                bytes += name.len();
            }
        }
        n <= s.room() && bytes <= s.room_bytes()
    }

    /// Restores one storage entry with its original stamp, tier, token count and LFU counter.
    /// An entry older than its tenant's TTL at `now` is not restored (the sweep would remove
    /// it). A record naming an entry already present overwrites it (a sliced snapshot may carry
    /// a key twice). No cap or quota enforcement runs: the next ingest enforces them.
    pub fn restore_entry(
        &mut self,
        e: &PersistEntry<'_>,
        now: i64,
        rules: &dyn TenantRules,
        cache: &mut RestoreCache,
    ) -> RestoreOutcome {
        let hit = cache.keyspace.as_ref().filter(|(n, _, _)| {
            n[0] == e.tenant && n[1] == e.model && n[2] == e.scheme && n[3] == e.adapter
        });
        let ttl = match hit {
            Some((_, _, ttl)) => *ttl,
            None => self.ttl_for(rules, e.tenant),
        };
        if now.saturating_sub(e.last_seen) >= ttl {
            return RestoreOutcome::Expired;
        }
        if !(e.tier <= TIER_RAW_COLD || e.tier == TIER_NEGATIVE) {
            return RestoreOutcome::Refused;
        }
        let ks = match hit {
            Some((_, ks, _)) => *ks,
            None => {
                if !self.restore_names_fit(&[e.tenant, e.model, e.scheme, e.adapter, e.replica]) {
                    return RestoreOutcome::Refused;
                }
                self.resolve_update_tenant(e.tenant, rules);
                let tenant = self.cat.strings.intern(e.tenant);
                let model = self.cat.strings.intern(e.model);
                let scheme = self.cat.strings.intern(e.scheme);
                let adapter = self.cat.strings.intern(e.adapter);
                let scope = self.ensure_scope(tenant, model, scheme);
                let ks = self.ensure_keyspace(scope, adapter);
                let names = [e.tenant, e.model, e.scheme, e.adapter].map(String::from);
                cache.keyspace = Some((names, ks, ttl));
                ks
            }
        };
        let replica = match &cache.replica {
            Some((name, id)) if name == e.replica => *id,
            _ => {
                if !self.restore_names_fit(&[e.replica]) {
                    return RestoreOutcome::Refused;
                }
                let id = self.cat.strings.intern(e.replica);
                cache.replica = Some((e.replica.to_string(), id));
                id
            }
        };
        let serving = &self.cat.scopes[self.cat.keyspaces[ks as usize].scope as usize].serving;
        if serving.len() >= self.cfg.max_replicas_per_scope && !serving.contains_key(&replica) {
            return RestoreOutcome::Refused;
        }
        // A snapshot carries the keys in the store's place order, a key's entries together:
        // each new key placed after the one restored before it rebuilds the runs.
        let mut chain = self.restore_chain;
        let applied = self.upsert(
            &mut chain,
            ks,
            e.hash,
            replica,
            e.tokens,
            e.tier,
            e.last_seen,
        );
        self.restore_chain = chain;
        self.flush();
        if applied != super::Upserted::Applied {
            return RestoreOutcome::Refused;
        }
        if e.access > 0 {
            let pos = (self.cat.key_for(ks, e.hash))
                .and_then(|k| self.store.find(k))
                .expect("restored key");
            self.store.set_access(pos, replica, e.access);
        }
        RestoreOutcome::Restored
    }

    /// Restores one replica stats row (expired rows, as the sweep would delete them, are not).
    pub fn restore_stats(
        &mut self,
        r: &PersistStats<'_>,
        now: i64,
        rules: &dyn TenantRules,
    ) -> RestoreOutcome {
        let ttl = self.ttl_for(rules, r.tenant);
        if now.saturating_sub(r.last_seen) >= ttl {
            return RestoreOutcome::Expired;
        }
        if !self.restore_names_fit(&[r.tenant, r.model, r.replica]) {
            return RestoreOutcome::Refused;
        }
        self.resolve_update_tenant(r.tenant, rules);
        let tenant = self.cat.strings.intern(r.tenant);
        let model = self.cat.strings.intern(r.model);
        let replica = self.cat.strings.intern(r.replica);
        let mscope = self.ensure_model(tenant, model);
        let row = StatsRow {
            cache_memory_bytes: r.cache_memory_bytes,
            hit_rate: r.hit_rate,
            pressure: r.pressure,
            t2_hit_tokens: r.t2_hit_tokens,
            t2_query_tokens: r.t2_query_tokens,
            last_seen: r.last_seen,
            stats_reported: r.stats_reported,
        };
        let stats = &mut self.cat.models[mscope as usize].stats;
        if let Some(cur) = stats.get_mut(&replica) {
            *cur = row;
            return RestoreOutcome::Restored;
        }
        if stats.len() >= self.cfg.max_stats_rows_per_model
            || self.stats_rows >= self.cfg.max_stats_rows
        {
            self.reclaimable += 1;
            return RestoreOutcome::Refused;
        }
        stats.insert(replica, row);
        self.stats_rows += 1;
        RestoreOutcome::Restored
    }

    /// Ends a restore: drops the cap and quota candidate heaps (rebuilt from the restored values
    /// on the next need) and the last lookup's buffers, and pushes pending counts.
    pub fn restore_finish(&mut self) {
        self.flush();
        self.restore_chain = ChainCursor::new();
        self.cap_clear();
        self.quota_clear_all();
        self.reset_last();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::IndexConfig;
    use crate::rules::NoRules;
    use inferencecache_proto::v1alpha1::{CacheStateUpdate, PrefixEntry, ReplicaStats};

    const NOW: i64 = 1_700_000_000_000_000_000;

    fn update(tenant: &str, model: &str, replica: &str, hashes: &[u64]) -> CacheStateUpdate {
        CacheStateUpdate {
            tenant_id: tenant.into(),
            model_id: model.into(),
            replica_id: replica.into(),
            hash_scheme: "s".into(),
            timestamp_us: NOW / 1000 - 5_000_000,
            prefixes: vec![PrefixEntry {
                block_hashes: hashes.iter().map(|h| h.to_be_bytes().to_vec()).collect(),
                block_token_counts: (1..=hashes.len() as i32).map(|i| i * 16).collect(),
                tier: 2,
                ..Default::default()
            }],
            stats: Some(ReplicaStats {
                hit_rate: 0.5,
                pressure: 0.25,
                cache_memory_bytes: 77,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn copy(src: &Index, dst: &mut Index) {
        let mut cache = RestoreCache::default();
        let mut from = Some(EntryCursor::START);
        while let Some(f) = from {
            let mut batch = Vec::new();
            from = src.export_entries(f, 3, |e| {
                batch.push((
                    e.tenant.to_string(),
                    e.model.to_string(),
                    e.scheme.to_string(),
                    e.adapter.to_string(),
                    e.hash.to_vec(),
                    e.replica.to_string(),
                    e.tokens,
                    e.last_seen,
                    e.tier,
                    e.access,
                ))
            });
            for b in &batch {
                let e = PersistEntry {
                    tenant: &b.0,
                    model: &b.1,
                    scheme: &b.2,
                    adapter: &b.3,
                    hash: &b.4,
                    replica: &b.5,
                    tokens: b.6,
                    last_seen: b.7,
                    tier: b.8,
                    access: b.9,
                };
                assert_eq!(
                    dst.restore_entry(&e, NOW, &NoRules, &mut cache),
                    RestoreOutcome::Restored
                );
            }
        }
        let mut rows = Vec::new();
        assert_eq!(
            src.export_stats(0, usize::MAX, |r| rows.push((
                r.tenant.to_string(),
                r.model.to_string(),
                r.replica.to_string(),
                PersistStats {
                    tenant: "",
                    model: "",
                    replica: "",
                    ..*r
                }
            ))),
            None
        );
        for (t, m, rep, r) in &rows {
            let r = PersistStats {
                tenant: t,
                model: m,
                replica: rep,
                ..*r
            };
            assert_eq!(
                dst.restore_stats(&r, NOW, &NoRules),
                RestoreOutcome::Restored
            );
        }
        dst.restore_finish();
    }

    #[test]
    fn export_then_restore_gives_the_same_entries_stats_and_counts() {
        let mut a = Index::default();
        a.ingest(&update("t", "m", "r1", &[1, 2, 3, 4]), NOW, &NoRules);
        a.ingest(&update("t", "m", "r2", &[1, 2]), NOW, &NoRules);
        a.ingest(&update("u", "m2", "r1", &[9]), NOW, &NoRules);
        let mut b = Index::new(IndexConfig::default());
        copy(&a, &mut b);
        assert_eq!(a.dump_entries(), b.dump_entries());
        assert_eq!(a.cache_state("t", "m"), b.cache_state("t", "m"));
        assert_eq!(a.stats_row_count(), b.stats_row_count());
        assert_eq!(b.directory().total_entries(), a.entry_count() as i64);
        // The restored chains are runs again: each key restored after the one before it, in
        // the source's place order, so no more runs than the source had.
        let (restored, source) = (b.store.runs().live_runs(), a.store.runs().live_runs());
        assert!(restored <= source, "{restored} runs restored from {source}");
        assert!(source > 0);
    }

    /// Records restored in any order (a fuzzy snapshot may carry a key's holders apart) give
    /// the same entries.
    #[test]
    fn records_restored_in_any_order_give_the_same_entries() {
        let mut a = Index::default();
        a.ingest(&update("t", "m", "r1", &[1, 2, 3, 4, 5, 6]), NOW, &NoRules);
        a.ingest(&update("t", "m", "r2", &[1, 2, 3]), NOW, &NoRules);
        a.ingest(&update("t", "m", "r3", &[1, 2, 3, 4, 5, 6]), NOW, &NoRules);
        let mut rows = Vec::new();
        a.export_entries(EntryCursor::START, usize::MAX, |e| {
            rows.push((
                e.hash.to_vec(),
                e.replica.to_string(),
                e.tokens,
                e.last_seen,
            ))
        });
        for rotate in 0..rows.len() {
            let mut order = rows.clone();
            order.rotate_left(rotate);
            order.swap(0, rotate / 2);
            let mut b = Index::default();
            let mut cache = RestoreCache::default();
            for (hash, replica, tokens, last_seen) in &order {
                let e = PersistEntry {
                    tenant: "t",
                    model: "m",
                    scheme: "s",
                    adapter: "",
                    hash,
                    replica,
                    tokens: *tokens,
                    last_seen: *last_seen,
                    tier: 2,
                    access: 0,
                };
                b.restore_entry(&e, NOW, &NoRules, &mut cache);
            }
            b.restore_finish();
            assert_eq!(a.dump_entries(), b.dump_entries());
        }
    }

    #[test]
    fn expired_entries_are_not_restored() {
        let mut a = Index::default();
        a.ingest(&update("t", "m", "r1", &[1]), NOW, &NoRules);
        let mut b = Index::default();
        let late = NOW + super::super::DEFAULT_TTL_NS;
        a.export_entries(EntryCursor::START, 10, |e| {
            let mut cache = RestoreCache::default();
            assert_eq!(
                b.restore_entry(e, late, &NoRules, &mut cache),
                RestoreOutcome::Expired
            );
        });
        assert_eq!(b.entry_count(), 0);
    }

    /// 5,000 model scopes without stats rows before one with: one call visits at most
    /// `max_rows` records (it walked all of them, one step on the core, before).
    #[test]
    fn a_stats_export_call_visits_at_most_its_rows_in_records() {
        let mut a = Index::default();
        for i in 0..5_000 {
            let mut u = update("t", &format!("m{i}"), "r1", &[1]);
            u.stats = None;
            a.ingest(&u, NOW, &NoRules);
        }
        a.ingest(&update("t", "last", "r1", &[1]), NOW, &NoRules);
        let mut rows = 0;
        let next = a.export_stats(0, 256, |_| rows += 1);
        assert_eq!((next, rows), (Some(256), 0));
        let mut from = next;
        while let Some(f) = from {
            from = a.export_stats(f, 256, |_| rows += 1);
        }
        assert_eq!(rows, 1);
    }

    /// Keys whose holders a pending `ALL_CLEARED` cleared yield nothing but still count: one
    /// call visits at most `max_entries` keys.
    #[test]
    fn an_entries_export_call_visits_at_most_its_entries_in_keys() {
        let mut a = Index::default();
        a.set_sliced_clears(true);
        let hashes: Vec<u64> = (0..5_000).collect();
        a.ingest(&update("t", "m", "rc", &hashes), NOW, &NoRules);
        a.ingest(&update("t", "m", "r1", &[1_000_000]), NOW, &NoRules);
        let clear = inferencecache_proto::v1alpha1::CacheEvent {
            r#type: inferencecache_proto::v1alpha1::cache_event::Type::AllCleared as i32,
            tenant_id: "t".into(),
            model_id: "m".into(),
            replica_id: "rc".into(),
            ..Default::default()
        };
        a.apply_event(&clear, NOW, &NoRules);
        assert!(a.clear_pending());
        let mut entries = 0;
        let next = a.export_entries(EntryCursor::START, 256, |_| entries += 1);
        assert!(next.is_some() && entries == 0, "{next:?} {entries}");
        let mut from = next;
        while let Some(f) = from {
            from = a.export_entries(f, 256, |_| entries += 1);
        }
        assert_eq!(entries, 1);
    }
}
