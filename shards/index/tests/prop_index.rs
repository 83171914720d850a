//! Property test: random operation sequences are driven through the real [`Index`] and through a
//! plain reference model written here straight from docs/BEHAVIOUR.md (ordered maps, full scans and
//! full sorts, no incremental structures). Lookup outcomes (strategy, scores bit-exact, order),
//! cache_state, eviction outcomes and the full entry set must be identical after every step.

mod index_support;

use index_support::Rules;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::{
    DEFAULT_MAX_FUTURE_SKEW_NS, EntryDump, Index, IndexConfig, LookupQuery, RankerConfig,
    Strategy as S, SweepBudget,
};
use inferencecache_index::rules::{Eviction, TenantRules};
use inferencecache_proto::v1alpha1::{CacheEvent, CacheStateUpdate, PrefixEntry, ReplicaStats};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const SEC: i64 = 1_000_000_000;
const MIN: i64 = 60 * SEC;
const T0: i64 = 1_700_000_000_000_000_000;
const DEFAULT_TTL: i64 = 20 * MIN;

const TENANTS: [&str; 4] = ["t1", "t2", "", PROBE_TENANT];
const MODELS: [&str; 2] = ["m1", "m2"];
const SCHEMES: [&str; 3] = ["s1", "s2", ""];
const ADAPTERS: [&str; 3] = ["", "a1", "a2"];
/// More replicas than a key keeps in its overflow chain (8), so hot keys move to the store's
/// wide sets and back.
const REPLICAS: [&str; 14] = [
    "r1", "r2", "r3", "r10", "r4", "r5", "r6", "r7", "r8", "r9", "r11", "r12", "r13", "r0",
];
const HASHES: [&[u8]; 7] = [
    b"",
    b"x",
    b"xy",
    &[0x78, 0, 0, 0, 0, 0, 0, 1],
    &[0x78, 0, 0, 0, 0, 0, 0, 2],
    &[0x01, 2, 3, 4, 5, 6, 7, 8],
    &[0xff, 0xfe, 0, 0, 0, 0, 0, 0],
];

// ---- the reference model ---------------------------------------------------------------------

type Key = (String, String, String, String, Vec<u8>);

#[derive(Clone, Debug)]
struct REntry {
    tokens: i32,
    last_seen: i64,
    tier: i32,
    access: u64,
}

#[derive(Clone, Debug)]
struct RStats {
    mem: i64,
    hit: f32,
    pressure: f32,
    t2h: i64,
    t2q: i64,
    last_seen: i64,
    reported: i64,
}

struct Model {
    default_ttl: i64,
    max_entries: u64,
    ranker: RankerConfig,
    prefix: BTreeMap<Key, BTreeMap<String, REntry>>,
    stats: BTreeMap<(String, String, String), RStats>,
}

type Out = (S, Vec<(String, u32, i32, u32, i32)>);

fn fresh(now: i64, ls: i64, ttl: i64) -> f32 {
    if ttl <= 0 {
        return 0.0;
    }
    let age = now.saturating_sub(ls);
    if age <= 0 {
        1.0
    } else if age >= ttl {
        0.0
    } else {
        (1.0 - age as f64 / ttl as f64) as f32
    }
}

fn dp(m: i64, t: i64) -> f64 {
    if t <= 1 || m < 0 {
        1.0
    } else if m >= t {
        0.0
    } else {
        1.0 - m as f64 / t as f64
    }
}

fn tier_in(w: i32) -> i32 {
    if w == 0 {
        1
    } else if w < 0 {
        i32::MAX
    } else {
        w
    }
}

fn tier_out(t: i32) -> i32 {
    if (1..=3).contains(&t) { t } else { 0 }
}

fn worst(a: i32, b: i32) -> i32 {
    if a == 0 || b == 0 { 0 } else { a.max(b) }
}

struct Sc {
    replica: String,
    score: f32,
    matched: i32,
    prob: f32,
    tier: i32,
}

impl Model {
    fn ttl(&self, rules: &Rules, t: &str) -> i64 {
        let x = rules.ttl_ns(t);
        if x > 0 { x } else { self.default_ttl }
    }

    fn upsert(&mut self, k: Key, r: &str, tokens: i32, tier: i32, ts: i64) {
        let holders = self.prefix.entry(k).or_default();
        let e = holders.entry(r.to_string()).or_insert(REntry {
            tokens,
            last_seen: ts,
            tier,
            access: 0,
        });
        e.tokens = tokens;
        e.last_seen = ts;
        e.tier = tier;
    }

    fn remove(&mut self, k: &Key, r: &str) -> bool {
        let Some(h) = self.prefix.get_mut(k) else {
            return false;
        };
        let gone = h.remove(r).is_some();
        if h.is_empty() {
            self.prefix.remove(k);
        }
        gone
    }

    fn serving(&self, t: &str, m: &str, s: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for (k, h) in &self.prefix {
            if k.0 == t && k.1 == m && k.2 == s {
                out.extend(h.keys().cloned());
            }
        }
        out
    }

    fn ingest(&mut self, u: &CacheStateUpdate, now: i64, rules: &Rules) -> (u64, u64, u64) {
        let ts = if u.timestamp_us == 0 {
            now
        } else {
            (u.timestamp_us * 1000).min(now + DEFAULT_MAX_FUTURE_SKEW_NS)
        };
        let t = &u.tenant_id;
        if !u.hash_scheme.is_empty() {
            for p in &u.prefixes {
                let tier = tier_in(p.tier);
                let a = if p.adapter_id.is_empty() {
                    &u.adapter_id
                } else {
                    &p.adapter_id
                };
                let key = |h: &[u8]| {
                    (
                        t.clone(),
                        u.model_id.clone(),
                        u.hash_scheme.clone(),
                        a.clone(),
                        h.to_vec(),
                    )
                };
                if !p.block_hashes.is_empty() || !p.block_token_counts.is_empty() {
                    if p.block_hashes.len() != p.block_token_counts.len() {
                        continue;
                    }
                    let mut cum = 0i32;
                    for (h, c) in p.block_hashes.iter().zip(&p.block_token_counts) {
                        cum = cum.wrapping_add(*c);
                        self.upsert(key(h), &u.replica_id, cum, tier, ts);
                    }
                    if !p.prefix_hash.is_empty() {
                        self.upsert(key(&p.prefix_hash), &u.replica_id, p.token_count, tier, ts);
                    }
                } else {
                    self.upsert(key(&p.prefix_hash), &u.replica_id, p.token_count, tier, ts);
                }
            }
        }
        if let Some(s) = &u.stats {
            let san = |v: f32| if v.is_finite() { v } else { 0.0 };
            self.stats.insert(
                (t.clone(), u.model_id.clone(), u.replica_id.clone()),
                RStats {
                    mem: s.cache_memory_bytes,
                    hit: san(s.hit_rate),
                    pressure: san(s.pressure),
                    t2h: s.t2_hit_tokens,
                    t2q: s.t2_query_tokens,
                    last_seen: ts,
                    reported: ts,
                },
            );
        }
        let mut quota = 0;
        if t != PROBE_TENANT
            && let Some(b) = rules.quota(t)
        {
            loop {
                let mut keys: Vec<(i64, Key)> = self
                    .prefix
                    .iter()
                    .filter(|(k, _)| &k.0 == t)
                    .map(|(k, h)| (h.values().map(|e| e.last_seen).max().unwrap(), k.clone()))
                    .collect();
                if keys.len() as u64 <= b {
                    break;
                }
                keys.sort_by(|a, b| {
                    a.0.cmp(&b.0).then(
                        (&a.1.1, &a.1.2, &a.1.3, &a.1.4).cmp(&(&b.1.1, &b.1.2, &b.1.3, &b.1.4)),
                    )
                });
                self.prefix.remove(&keys[0].1);
                quota += 1;
            }
        }
        let (mut lru, mut lfu) = (0, 0);
        if self.max_entries > 0 {
            loop {
                let mut all: Vec<(u64, i64, Key, String, Eviction)> = Vec::new();
                for (k, h) in &self.prefix {
                    if k.0 == PROBE_TENANT {
                        continue;
                    }
                    let algo = rules.eviction(&k.0);
                    for (r, e) in h {
                        let eff = if algo == Eviction::Lfu { e.access } else { 0 };
                        all.push((eff, e.last_seen, k.clone(), r.clone(), algo));
                    }
                }
                if all.len() as u64 <= self.max_entries {
                    break;
                }
                all.sort_by(|a, b| (a.0, a.1, &a.2, &a.3).cmp(&(b.0, b.1, &b.2, &b.3)));
                let v = &all[0];
                self.remove(&v.2.clone(), &v.3.clone());
                match v.4 {
                    Eviction::Lru => lru += 1,
                    Eviction::Lfu => lfu += 1,
                }
            }
        }
        (quota, lru, lfu)
    }

    fn event(&mut self, e: &CacheEvent, now: i64) {
        let ts = if e.timestamp_us == 0 {
            now
        } else {
            (e.timestamp_us * 1000).min(now + DEFAULT_MAX_FUTURE_SKEW_NS)
        };
        match e.r#type {
            2 => {
                let keys: Vec<Key> = self
                    .prefix
                    .keys()
                    .filter(|k| {
                        k.0 == e.tenant_id
                            && k.1 == e.model_id
                            && k.4 == e.prefix_hash
                            && (e.adapter_id.is_empty() || k.3 == e.adapter_id)
                    })
                    .cloned()
                    .collect();
                for k in keys {
                    self.remove(&k, &e.replica_id);
                }
            }
            3 => {
                if let Some(s) = self.stats.get_mut(&(
                    e.tenant_id.clone(),
                    e.model_id.clone(),
                    e.replica_id.clone(),
                )) {
                    s.last_seen = ts;
                }
            }
            4 => {
                let keys: Vec<Key> = self
                    .prefix
                    .keys()
                    .filter(|k| k.0 == e.tenant_id && k.1 == e.model_id)
                    .cloned()
                    .collect();
                for k in keys {
                    self.remove(&k, &e.replica_id);
                }
                self.stats.remove(&(
                    e.tenant_id.clone(),
                    e.model_id.clone(),
                    e.replica_id.clone(),
                ));
            }
            _ => {}
        }
    }

    fn sweep(&mut self, now: i64, rules: &Rules) -> (u64, u64, u64) {
        let (mut lru, mut lfu) = (0, 0);
        let keys: Vec<Key> = self.prefix.keys().cloned().collect();
        for k in keys {
            let ttl = self.ttl(rules, &k.0);
            let stale: Vec<String> = self.prefix[&k]
                .iter()
                .filter(|(_, e)| now.saturating_sub(e.last_seen) >= ttl)
                .map(|(r, _)| r.clone())
                .collect();
            for r in stale {
                self.remove(&k, &r);
                match rules.eviction(&k.0) {
                    Eviction::Lru => lru += 1,
                    Eviction::Lfu => lfu += 1,
                }
            }
        }
        let before = self.stats.len();
        let ttls: Vec<_> = self.stats.keys().map(|k| self.ttl(rules, &k.0)).collect();
        let mut i = 0;
        self.stats.retain(|_, s| {
            let keep = now.saturating_sub(s.last_seen) < ttls[i];
            i += 1;
            keep
        });
        (lru, lfu, (before - self.stats.len()) as u64)
    }

    fn pressure(&self, t: &str, m: &str, r: &str, now: i64, ttl: i64) -> f32 {
        match self
            .stats
            .get(&(t.to_string(), m.to_string(), r.to_string()))
        {
            Some(s) if fresh(now, s.reported, ttl) > 0.0 => s.pressure,
            _ => 0.0,
        }
    }

    fn score(&self, tokens: i64, f: f32, p: f32, coeff: f32) -> f32 {
        let pf = (1.0 - self.ranker.pressure_weight * p).clamp(0.0, 1.0);
        let sb = 1.0 + f * coeff;
        tokens as f32 * f * pf * sb
    }

    fn coeff(&self, ttft: i32) -> f32 {
        let r = &self.ranker;
        if r.slo_tight_ttft_ms <= 0
            || r.slo_tight_bias <= 0.0
            || ttft <= 0
            || ttft >= r.slo_tight_ttft_ms
        {
            0.0
        } else {
            r.slo_tight_bias
        }
    }

    fn sort(v: &mut [Sc]) {
        v.sort_by(|a, b| match b.score.partial_cmp(&a.score).unwrap() {
            std::cmp::Ordering::Equal => a.replica.cmp(&b.replica),
            o => o,
        });
    }

    /// Exact match; returns scores and LFU hits.
    fn exact(&self, q: &LookupQuery<'_>, now: i64, rules: &Rules) -> (Vec<Sc>, Vec<(Key, String)>) {
        let key: Key = (
            q.tenant.into(),
            q.model.into(),
            q.hash_scheme.into(),
            q.adapter.into(),
            q.prefix_hash.to_vec(),
        );
        let total = self.serving(q.tenant, q.model, q.hash_scheme).len() as i64;
        let ttl = self.ttl(rules, q.tenant);
        let mut v = Vec::new();
        let mut hits = Vec::new();
        if let Some(h) = self.prefix.get(&key) {
            for (r, e) in h {
                let f = fresh(now, e.last_seen, ttl);
                if f <= 0.0 {
                    continue;
                }
                let p = self.pressure(q.tenant, q.model, r, now, ttl);
                v.push(Sc {
                    replica: r.clone(),
                    score: self.score(e.tokens as i64, f, p, self.coeff(q.ttft_ms)),
                    matched: e.tokens,
                    prob: f,
                    tier: tier_out(e.tier),
                });
                if e.tokens > 0 {
                    hits.push((key.clone(), r.clone()));
                }
            }
        }
        let d = dp(v.len() as i64, total);
        if d != 1.0 {
            for s in &mut v {
                s.score *= d as f32;
            }
        }
        Self::sort(&mut v);
        (v, hits)
    }

    fn chain(&self, q: &LookupQuery<'_>, now: i64, rules: &Rules) -> (Vec<Sc>, Vec<(Key, String)>) {
        let ttl = self.ttl(rules, q.tenant);
        let total = self.serving(q.tenant, q.model, q.hash_scheme).len() as i64;
        // replica -> (matched, oldest, tier, blocks, running)
        let mut runs: BTreeMap<String, (i64, i64, i32, Vec<Key>, bool)> = BTreeMap::new();
        for (i, c) in q
            .block_token_counts
            .iter()
            .enumerate()
            .take(q.block_hashes.len())
        {
            let h = q.block_hashes.get(i);
            let key: Key = (
                q.tenant.into(),
                q.model.into(),
                q.hash_scheme.into(),
                q.adapter.into(),
                h.to_vec(),
            );
            let holders = self.prefix.get(&key);
            let mut any = false;
            if i == 0 {
                if let Some(hs) = holders {
                    for (r, e) in hs {
                        if fresh(now, e.last_seen, ttl) > 0.0 {
                            runs.insert(
                                r.clone(),
                                (*c as i64, e.last_seen, e.tier, vec![key.clone()], true),
                            );
                            any = true;
                        }
                    }
                }
            } else {
                for (r, run) in runs.iter_mut() {
                    if !run.4 {
                        continue;
                    }
                    match holders.and_then(|hs| hs.get(r)) {
                        Some(e) if fresh(now, e.last_seen, ttl) > 0.0 => {
                            run.0 += *c as i64;
                            run.1 = run.1.min(e.last_seen);
                            run.2 = worst(run.2, e.tier);
                            run.3.push(key.clone());
                            any = true;
                        }
                        _ => run.4 = false,
                    }
                }
            }
            if !any {
                break;
            }
        }
        let mut v = Vec::new();
        let mut hits = Vec::new();
        for (r, run) in &runs {
            if run.0 <= 0 {
                continue;
            }
            let f = fresh(now, run.1, ttl);
            if f <= 0.0 {
                continue;
            }
            let p = self.pressure(q.tenant, q.model, r, now, ttl);
            v.push(Sc {
                replica: r.clone(),
                score: self.score(run.0, f, p, self.coeff(q.ttft_ms)),
                matched: run.0 as i32,
                prob: f,
                tier: tier_out(run.2),
            });
            for k in &run.3 {
                hits.push((k.clone(), r.clone()));
            }
        }
        if total > 1 && !v.is_empty() {
            v.sort_by(|a, b| b.matched.cmp(&a.matched).then(a.replica.cmp(&b.replica)));
            let mut i = 0;
            while i < v.len() {
                let m = v[i].matched;
                let mut j = i;
                while j < v.len() && v[j].matched == m {
                    j += 1;
                }
                let d = dp(j as i64, total);
                if d != 1.0 {
                    for s in &mut v[i..j] {
                        s.score *= d as f32;
                    }
                }
                i = j;
            }
        }
        Self::sort(&mut v);
        (v, hits)
    }

    fn hot(&self, q: &LookupQuery<'_>, now: i64) -> Vec<Sc> {
        let r = &self.ranker;
        if r.tenant_hot_max_age_ns <= 0 {
            return vec![];
        }
        let serving = self.serving(q.tenant, q.model, q.hash_scheme);
        let mut v = Vec::new();
        for ((t, m, rep), s) in &self.stats {
            if t != q.tenant || m != q.model {
                continue;
            }
            let age = now.saturating_sub(s.reported);
            if age >= r.tenant_hot_max_age_ns
                || s.hit < r.tenant_hot_min_hit_rate
                || !serving.contains(rep)
            {
                continue;
            }
            let rec = if age <= 0 {
                1.0
            } else {
                1.0 - age as f32 / r.tenant_hot_max_age_ns as f32
            };
            let pf = (1.0 - r.pressure_weight * s.pressure).clamp(0.0, 1.0);
            let sb = 1.0 + rec * self.coeff(q.ttft_ms);
            v.push(Sc {
                replica: rep.clone(),
                score: s.hit * rec * pf * sb,
                matched: 0,
                prob: s.hit,
                tier: 0,
            });
        }
        Self::sort(&mut v);
        v
    }

    fn classify(&self, q: &LookupQuery<'_>) -> S {
        if self.prefix.is_empty() {
            return S::None;
        }
        if !self.prefix.keys().any(|k| k.0 == q.tenant) {
            return S::UnknownTenant;
        }
        if !self
            .prefix
            .keys()
            .any(|k| k.0 == q.tenant && k.1 == q.model)
        {
            return S::UnknownModel;
        }
        if self.serving(q.tenant, q.model, q.hash_scheme).is_empty() {
            return S::UnknownHashScheme;
        }
        S::None
    }

    fn route(
        &self,
        q: &LookupQuery<'_>,
        now: i64,
        rules: &Rules,
    ) -> (S, Vec<Sc>, Vec<(Key, String)>) {
        if q.tenant.is_empty() || q.model.is_empty() || q.hash_scheme.is_empty() {
            return (S::None, vec![], vec![]);
        }
        if !q.block_hashes.is_empty() || !q.block_token_counts.is_empty() {
            if q.block_hashes.len() != q.block_token_counts.len() {
                return (S::None, vec![], vec![]);
            }
            let (v, h) = self.chain(q, now, rules);
            if !v.is_empty() {
                return (S::PrefixMatch, v, h);
            }
            return (self.classify(q), vec![], vec![]);
        }
        let (v, h) = self.exact(q, now, rules);
        if !v.is_empty() {
            return (S::PrefixMatch, v, h);
        }
        let v = self.hot(q, now);
        if !v.is_empty() {
            return (S::TenantHot, v, vec![]);
        }
        (self.classify(q), vec![], vec![])
    }

    fn credit(
        &mut self,
        hits: &[(Key, String)],
        tenant: &str,
        keep: &dyn Fn(&str) -> bool,
        rules: &Rules,
    ) {
        if rules.eviction(tenant) != Eviction::Lfu {
            return;
        }
        for (k, r) in hits {
            if !keep(r) {
                continue;
            }
            if let Some(e) = self.prefix.get_mut(k).and_then(|h| h.get_mut(r)) {
                e.access += 1;
            }
        }
    }

    fn dump(&self) -> Vec<EntryDump> {
        let mut v = Vec::new();
        for (k, h) in &self.prefix {
            for (r, e) in h {
                v.push(EntryDump {
                    tenant: k.0.clone(),
                    model: k.1.clone(),
                    scheme: k.2.clone(),
                    adapter: k.3.clone(),
                    hash: k.4.clone(),
                    replica: r.clone(),
                    token_count: e.tokens,
                    last_seen: e.last_seen,
                    tier: tier_out(e.tier),
                    access_count: e.access,
                });
            }
        }
        v.sort();
        v
    }
}

fn to_out(s: S, v: &[Sc]) -> Out {
    (
        s,
        v.iter()
            .map(|x| {
                (
                    x.replica.clone(),
                    x.score.to_bits(),
                    x.matched,
                    x.prob.to_bits(),
                    x.tier,
                )
            })
            .collect(),
    )
}

// ---- operations --------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum PE {
    Legacy {
        hash: usize,
        tokens: i32,
        tier: i32,
        adapter: Option<usize>,
    },
    Chain {
        hashes: Vec<usize>,
        counts: Vec<i32>,
        coset: Option<usize>,
        tier: i32,
        adapter: Option<usize>,
    },
}

#[derive(Clone, Debug)]
enum Op {
    Ingest {
        tenant: usize,
        model: usize,
        scheme: usize,
        replica: usize,
        adapter: usize,
        ts: Option<i64>,
        prefixes: Vec<PE>,
        stats: Option<(f32, f32)>,
    },
    Event {
        ty: i32,
        tenant: usize,
        model: usize,
        replica: usize,
        hash: usize,
        adapter: usize,
        ts: Option<i64>,
    },
    Sweep,
    Advance(i64),
    Lookup {
        tenant: usize,
        model: usize,
        scheme: usize,
        adapter: usize,
        hash: usize,
        chain: Option<(Vec<usize>, Vec<i32>)>,
        ttft: i32,
        keep: u16,
        plain: bool,
    },
    Rules {
        lfu: u8,
        quota: Option<u64>,
        ttl: Option<i64>,
    },
    Cap(u64),
    /// One slice of the cap candidate build ahead of need, of at most this many entries
    /// (changes nothing observable).
    Prebuild(usize),
    /// One slice of a pending `ALL_CLEARED` (sliced clears), of at most this many keys visited
    /// (changes nothing observable).
    ClearSlice(usize),
}

fn tier() -> impl proptest::strategy::Strategy<Value = i32> {
    prop_oneof![Just(0), Just(1), Just(2), Just(3), Just(7), Just(-1)]
}

fn pe() -> impl proptest::strategy::Strategy<Value = PE> {
    prop_oneof![
        (
            0..HASHES.len(),
            -2..40i32,
            tier(),
            proptest::option::of(0..ADAPTERS.len())
        )
            .prop_map(|(hash, tokens, tier, adapter)| PE::Legacy {
                hash,
                tokens,
                tier,
                adapter
            }),
        (
            proptest::collection::vec(0..HASHES.len(), 0..4),
            proptest::collection::vec(prop_oneof![Just(16), Just(8), Just(0), Just(-4)], 0..4),
            proptest::option::of(0..HASHES.len()),
            tier(),
            proptest::option::of(0..ADAPTERS.len()),
        )
            .prop_map(|(hashes, mut counts, coset, tier, adapter)| {
                // Mostly well-formed; sometimes malformed.
                if counts.len() != hashes.len() && hashes.len() % 2 == 0 {
                    counts.resize(hashes.len(), 16);
                }
                PE::Chain {
                    hashes,
                    counts,
                    coset,
                    tier,
                    adapter,
                }
            }),
    ]
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    let ts = proptest::option::of(-25 * MIN..4 * MIN);
    prop_oneof![
        6 => (0..TENANTS.len(), 0..MODELS.len(), 0..SCHEMES.len(), 0..REPLICAS.len(), 0..ADAPTERS.len(), ts.clone(),
              proptest::collection::vec(pe(), 0..4),
              proptest::option::of((prop_oneof![Just(0.0f32), Just(0.1), Just(0.5), Just(0.9), Just(f32::NAN)],
                                    prop_oneof![Just(0.0f32), Just(0.3), Just(1.5), Just(f32::INFINITY)])),
        )
            .prop_map(|(tenant, model, scheme, replica, adapter, ts, prefixes, stats)| Op::Ingest {
                tenant, model, scheme, replica, adapter, ts, prefixes, stats
            }),
        1 => (0..6i32, 0..TENANTS.len(), 0..MODELS.len(), 0..REPLICAS.len(), 0..HASHES.len(), 0..ADAPTERS.len(), ts)
            .prop_map(|(ty, tenant, model, replica, hash, adapter, ts)| Op::Event { ty, tenant, model, replica, hash, adapter, ts }),
        1 => Just(Op::Sweep),
        2 => prop_oneof![Just(SEC), Just(MIN), Just(7 * MIN), Just(0)].prop_map(Op::Advance),
        6 => (0..3usize, 0..MODELS.len(), 0..SCHEMES.len(), 0..ADAPTERS.len(), 0..HASHES.len(),
              proptest::option::of((proptest::collection::vec(0..HASHES.len(), 0..4),
                                    proptest::collection::vec(prop_oneof![Just(16), Just(8), Just(0)], 0..4))),
              prop_oneof![Just(0), Just(50), Just(500)], any::<u16>(), any::<bool>())
            .prop_map(|(tenant, model, scheme, adapter, hash, chain, ttft, keep, plain)| Op::Lookup {
                tenant, model, scheme, adapter, hash, chain, ttft, keep, plain
            }),
        1 => (any::<u8>(), proptest::option::of(0..4u64), proptest::option::of(prop_oneof![Just(5 * MIN), Just(40 * MIN)]))
            .prop_map(|(lfu, quota, ttl)| Op::Rules { lfu, quota, ttl }),
        1 => prop_oneof![Just(0u64), Just(2), Just(4), Just(7)].prop_map(Op::Cap),
        2 => prop_oneof![Just(1usize), Just(2), Just(5), Just(1000)].prop_map(Op::Prebuild),
        1 => prop_oneof![Just(1usize), Just(3), Just(1000)].prop_map(Op::ClearSlice),
    ]
}

/// Ordinary ops with many `ALL_CLEARED` events and slices of the clears they leave pending.
fn ops_with_clears() -> impl proptest::strategy::Strategy<Value = Vec<Op>> {
    let clear = (0..TENANTS.len(), 0..MODELS.len(), 0..REPLICAS.len()).prop_map(
        |(tenant, model, replica)| Op::Event {
            ty: inferencecache_proto::v1alpha1::cache_event::Type::AllCleared as i32,
            tenant,
            model,
            replica,
            hash: 0,
            adapter: 0,
            ts: None,
        },
    );
    let slice = prop_oneof![Just(1usize), Just(2), Just(4)].prop_map(Op::ClearSlice);
    let focused = op().prop_map(focus);
    proptest::collection::vec(
        prop_oneof![3 => op(), 6 => focused, 2 => clear.prop_map(focus), 2 => slice],
        1..100,
    )
}

/// `op` moved into tenant `t1`, model `m1`, scheme `s1`, so that clears, ingests and lookups
/// meet on the same keys.
fn focus(mut op: Op) -> Op {
    match &mut op {
        Op::Ingest {
            tenant,
            model,
            scheme,
            ..
        }
        | Op::Lookup {
            tenant,
            model,
            scheme,
            ..
        } => (*tenant, *model, *scheme) = (0, 0, 0),
        Op::Event { tenant, model, .. } => (*tenant, *model) = (0, 0),
        _ => {}
    }
    op
}

#[allow(clippy::too_many_arguments)] // mirrors the Op::Ingest fields one to one
fn build_update(
    tenant: usize,
    model: usize,
    scheme: usize,
    replica: usize,
    adapter: usize,
    ts: Option<i64>,
    prefixes: &[PE],
    stats: Option<(f32, f32)>,
    now: i64,
) -> CacheStateUpdate {
    let ad = |a: &Option<usize>| a.map(|i| ADAPTERS[i].to_string()).unwrap_or_default();
    CacheStateUpdate {
        replica_id: REPLICAS[replica].into(),
        model_id: MODELS[model].into(),
        tenant_id: TENANTS[tenant].into(),
        hash_scheme: SCHEMES[scheme].into(),
        timestamp_us: ts.map_or(0, |d| (now + d) / 1000),
        adapter_id: ADAPTERS[adapter].into(),
        stats: stats.map(|(h, p)| ReplicaStats {
            replica_id: "ignored".into(),
            cache_memory_bytes: 7,
            hit_rate: h,
            pressure: p,
            client_version: "v".into(),
            t2_hit_tokens: 1,
            t2_query_tokens: 2,
        }),
        prefixes: prefixes
            .iter()
            .map(|p| match p {
                PE::Legacy {
                    hash,
                    tokens,
                    tier,
                    adapter,
                } => PrefixEntry {
                    prefix_hash: HASHES[*hash].to_vec(),
                    token_count: *tokens,
                    tier: *tier,
                    adapter_id: ad(adapter),
                    ..Default::default()
                },
                PE::Chain {
                    hashes,
                    counts,
                    coset,
                    tier,
                    adapter,
                } => PrefixEntry {
                    prefix_hash: coset.map(|c| HASHES[c].to_vec()).unwrap_or_default(),
                    token_count: 99,
                    block_hashes: hashes.iter().map(|h| HASHES[*h].to_vec()).collect(),
                    block_token_counts: counts.clone(),
                    tier: *tier,
                    adapter_id: ad(adapter),
                },
            })
            .collect(),
    }
}

/// Runs `ops` through the index and the reference; with `sliced_clears`, `ALL_CLEARED` leaves
/// its removals to [`Op::ClearSlice`] (or to the next operation that needs the store), and
/// lookups in between must already answer as after the whole clear.
fn run(
    ops: Vec<Op>,
    ranker: RankerConfig,
    cap: u64,
    k: usize,
    sliced_clears: bool,
) -> Result<(), TestCaseError> {
    let mut ix = Index::new(IndexConfig {
        default_ttl_ns: DEFAULT_TTL,
        max_entries: cap,
        ranker: ranker.clone(),
        ..IndexConfig::default()
    });
    ix.set_min_candidates(k);
    ix.set_sliced_clears(sliced_clears);
    let mut model = Model {
        default_ttl: DEFAULT_TTL,
        max_entries: cap,
        ranker,
        prefix: BTreeMap::new(),
        stats: BTreeMap::new(),
    };
    let mut rules = Rules::default();
    let mut now = T0;
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Ingest {
                tenant,
                model: m,
                scheme,
                replica,
                adapter,
                ts,
                prefixes,
                stats,
            } => {
                let u = build_update(
                    tenant, m, scheme, replica, adapter, ts, &prefixes, stats, now,
                );
                let out = ix.ingest(&u, now, &rules);
                let (q, lru, lfu) = model.ingest(&u, now, &rules);
                prop_assert_eq!(
                    (
                        out.quota_evicted_keys,
                        out.cap_evicted.lru,
                        out.cap_evicted.lfu
                    ),
                    (q, lru, lfu),
                    "step {} ingest outcome",
                    step
                );
            }
            Op::Event {
                ty,
                tenant,
                model: m,
                replica,
                hash,
                adapter,
                ts,
            } => {
                let e = CacheEvent {
                    r#type: ty,
                    replica_id: REPLICAS[replica].into(),
                    model_id: MODELS[m].into(),
                    tenant_id: TENANTS[tenant].into(),
                    prefix_hash: HASHES[hash].to_vec(),
                    timestamp_us: ts.map_or(0, |d| (now + d) / 1000),
                    adapter_id: ADAPTERS[adapter].into(),
                };
                ix.apply_event(&e, now, &rules);
                model.event(&e, now);
            }
            Op::Sweep => {
                let out = ix.sweep(now, &rules);
                let (lru, lfu, st) = model.sweep(now, &rules);
                prop_assert_eq!(
                    (
                        out.ttl_evicted.lru,
                        out.ttl_evicted.lfu,
                        out.stats_rows_removed
                    ),
                    (lru, lfu, st),
                    "step {} sweep",
                    step
                );
            }
            Op::Advance(d) => now += d,
            Op::Lookup {
                tenant,
                model: m,
                scheme,
                adapter,
                hash,
                chain,
                ttft,
                keep,
                plain,
            } => {
                let (bh, bc): (Vec<Vec<u8>>, Vec<i32>) = match &chain {
                    Some((h, c)) => (h.iter().map(|i| HASHES[*i].to_vec()).collect(), c.clone()),
                    None => (vec![], vec![]),
                };
                let q = LookupQuery {
                    tenant: TENANTS[tenant],
                    model: MODELS[m],
                    hash_scheme: SCHEMES[scheme],
                    adapter: ADAPTERS[adapter],
                    prefix_hash: HASHES[hash],
                    token_count: 16,
                    block_hashes: (&bh).into(),
                    block_token_counts: &bc,
                    ttft_ms: ttft,
                    tbt_ms: 0,
                };
                let keep_fn = |r: &str| {
                    let i = REPLICAS.iter().position(|x| *x == r).unwrap();
                    keep & (1 << i) != 0
                };
                if plain {
                    let v = ix.lookup(&q, now, &rules);
                    let got: Out = (
                        v.strategy,
                        v.scores
                            .iter()
                            .map(|s| {
                                (
                                    v.replica_id(s).to_string(),
                                    s.score.to_bits(),
                                    s.matched_tokens,
                                    s.estimated_cache_hit_prob.to_bits(),
                                    s.tier,
                                )
                            })
                            .collect(),
                    );
                    let (sc, _) = if q.hash_scheme.is_empty() {
                        (vec![], vec![])
                    } else if !bh.is_empty() || !bc.is_empty() {
                        if bh.len() != bc.len() {
                            (vec![], vec![])
                        } else {
                            model.chain(&q, now, &rules)
                        }
                    } else {
                        model.exact(&q, now, &rules)
                    };
                    let s = if sc.is_empty() {
                        S::None
                    } else {
                        S::PrefixMatch
                    };
                    prop_assert_eq!(got, to_out(s, &sc), "step {} plain lookup", step);
                } else {
                    let v = ix.lookup_route(&q, now, &rules);
                    let got: Out = (
                        v.strategy,
                        v.scores
                            .iter()
                            .map(|s| {
                                (
                                    v.replica_id(s).to_string(),
                                    s.score.to_bits(),
                                    s.matched_tokens,
                                    s.estimated_cache_hit_prob.to_bits(),
                                    s.tier,
                                )
                            })
                            .collect(),
                    );
                    let (s, sc, hits) = model.route(&q, now, &rules);
                    prop_assert_eq!(got, to_out(s, &sc), "step {} route", step);
                    ix.credit_lfu(keep_fn, &rules);
                    if s == S::PrefixMatch {
                        model.credit(&hits, q.tenant, &keep_fn, &rules);
                    }
                }
            }
            Op::Rules { lfu, quota, ttl } => {
                rules = Rules::default();
                for (i, t) in ["t1", "t2", ""].iter().enumerate() {
                    if lfu & (1 << i) != 0 {
                        rules.lfu.push(t.to_string());
                    }
                }
                if let Some(qv) = quota {
                    rules.quota.insert(
                        if lfu & 8 != 0 {
                            "t1".into()
                        } else {
                            "t2".into()
                        },
                        qv,
                    );
                }
                if let Some(t) = ttl {
                    rules.ttl.insert("t1".into(), t);
                }
            }
            Op::Cap(c) => {
                ix.set_max_entries(c);
                model.max_entries = c;
            }
            Op::Prebuild(max_entries) => {
                ix.cap_prebuild_step(SweepBudget {
                    max_entries,
                    deadline: None,
                });
            }
            Op::ClearSlice(max_entries) => {
                ix.clear_step(SweepBudget {
                    max_entries,
                    deadline: None,
                });
            }
        }
        ix.cap_check_invariant();
        ix.check_store();
        prop_assert_eq!(ix.dump_entries(), model.dump(), "step {} entries", step);
        for t in TENANTS {
            for m in MODELS {
                let cs = ix.cache_state(t, m);
                let want: Vec<(String, i64, u32, u32, i64, i64)> = model
                    .stats
                    .iter()
                    .filter(|(k, _)| k.0 == t && k.1 == m)
                    .map(|(k, s)| {
                        (
                            k.2.clone(),
                            s.mem,
                            s.hit.to_bits(),
                            s.pressure.to_bits(),
                            s.t2h,
                            s.t2q,
                        )
                    })
                    .collect();
                let got: Vec<_> = cs
                    .replicas
                    .iter()
                    .map(|r| {
                        (
                            r.replica_id.clone(),
                            r.cache_memory_bytes,
                            r.hit_rate.to_bits(),
                            r.pressure.to_bits(),
                            r.t2_hit_tokens,
                            r.t2_query_tokens,
                        )
                    })
                    .collect();
                prop_assert_eq!(got, want, "step {} cache_state {}/{}", step, t, m);
                let keys = model.prefix.keys().filter(|k| k.0 == t && k.1 == m).count() as i64;
                // A pending clear's emptied keys are counted until its slices remove them (the
                // server finishes clears before it answers GetCacheState).
                if !ix.clear_pending() {
                    prop_assert_eq!(cs.total_prefixes, keys);
                }
            }
        }
        let non_reserved = model
            .prefix
            .iter()
            .filter(|(k, _)| k.0 != PROBE_TENANT)
            .map(|(_, h)| h.len())
            .sum::<usize>();
        prop_assert_eq!(ix.non_reserved_entry_count(), non_reserved as u64);
        prop_assert_eq!(ix.directory().total_entries(), ix.entry_count() as i64);
    }
    Ok(())
}

/// Ordinary ops interleaved with bursts in which many replicas report the same keys (one
/// chain, so exact and chain lookups both hit hot keys): keys go from the overflow chain to a
/// wide set and back as holders expire, are cleared or evicted.
fn ops_with_hot_keys() -> impl proptest::strategy::Strategy<Value = Vec<Op>> {
    let burst = (
        0..2usize,
        0..2usize,
        0..ADAPTERS.len(),
        proptest::collection::vec(0..HASHES.len(), 1..3),
        any::<u16>(),
        proptest::option::of(-25 * MIN..4 * MIN),
    )
        .prop_map(|(tenant, scheme, adapter, hashes, mask, ts)| {
            (0..REPLICAS.len())
                .filter(|r| mask & (1 << r) != 0)
                .map(|replica| Op::Ingest {
                    tenant,
                    model: 0,
                    scheme,
                    replica,
                    adapter,
                    ts,
                    prefixes: vec![PE::Chain {
                        counts: vec![16; hashes.len()],
                        hashes: hashes.clone(),
                        coset: None,
                        tier: 1,
                        adapter: None,
                    }],
                    stats: None,
                })
                .collect::<Vec<_>>()
        });
    let single = op().prop_map(|o| vec![o]);
    proptest::collection::vec(prop_oneof![1 => burst, 3 => single], 1..30)
        .prop_map(|v| v.into_iter().flatten().collect())
}

proptest! {
    // 300 cases by default; `PROPTEST_CASES=N` overrides.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300),
        ..ProptestConfig::default()
    })]

    #[test]
    fn prop_index_matches_reference(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, RankerConfig::default(), 0, 1024, false)?;
    }

    /// `ALL_CLEARED` in slices: lookups while the removals are pending answer as after them.
    #[test]
    fn prop_index_matches_reference_sliced_clears(ops in ops_with_clears(), cap in prop_oneof![Just(0u64), 3..30u64]) {
        run(ops, RankerConfig::default(), cap, 2, true)?;
    }

    #[test]
    fn prop_index_matches_reference_tight_slo(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, RankerConfig { slo_tight_ttft_ms: 100, slo_tight_bias: 2.5, pressure_weight: 0.7,
                                 tenant_hot_min_hit_rate: 0.3, tenant_hot_max_age_ns: 3 * MIN }, 0, 2, false)?;
    }

    /// Hot keys held by up to 14 replicas (the store's wide sets), with and without the cap.
    #[test]
    fn prop_index_matches_reference_hot_keys(ops in ops_with_hot_keys(), cap in prop_oneof![Just(0u64), 5..40u64]) {
        run(ops, RankerConfig::default(), cap, 2, false)?;
    }

    /// Cap pressure from the first step: exercises the candidate heap and its tie-breaks.
    #[test]
    fn prop_index_matches_reference_small_cap(ops in proptest::collection::vec(op(), 1..80), cap in 1..6u64, k in 1..4usize) {
        run(ops, RankerConfig::default(), cap, k, false)?;
    }
}

/// Regression (found by the 40k-case run): the cap threshold named the blob id of a key that was
/// then evicted; the id was reused by the next new blob key, which then compared as "below the
/// threshold" and was evicted instead of the true minimum. Thresholds now hold a blob reference.
#[test]
fn regression_cap_threshold_blob_reuse() {
    let legacy = |hash, adapter| PE::Legacy {
        hash,
        tokens: 0,
        tier: 0,
        adapter,
    };
    let ingest = |tenant, model, replica, adapter, prefixes| Op::Ingest {
        tenant,
        model,
        scheme: 0,
        replica,
        adapter,
        ts: None,
        prefixes,
        stats: None,
    };
    let ops = vec![
        ingest(
            2,
            1,
            1,
            2,
            vec![PE::Chain {
                hashes: vec![0, 1],
                counts: vec![16, 16],
                coset: Some(3),
                tier: 0,
                adapter: None,
            }],
        ),
        ingest(1, 0, 0, 0, vec![legacy(1, None)]),
        ingest(2, 1, 0, 0, vec![legacy(2, Some(2))]),
    ];
    run(ops, RankerConfig::default(), 3, 1, false).unwrap();
}
