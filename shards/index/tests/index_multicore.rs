//! Several cores' indexes sharing one `Directory`: UNKNOWN_TENANT and the cold-start carve-out
//! are answered globally, the global cap and tenant quotas hold across cores, and the directory
//! reclaims tenants that left every core.

mod index_support;

use index_support::*;
use inferencecache_index::PROBE_TENANT;
use inferencecache_index::directory::Directory;
use inferencecache_index::index::{Index, IndexConfig, LookupQuery, Strategy};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1::cache_event::Type;
use std::sync::Arc;

fn cores(n: usize, cap: u64) -> (Arc<Directory>, Vec<Index>) {
    let dir = Arc::new(Directory::default());
    let ix = (0..n)
        .map(|core_id| {
            Index::new(IndexConfig {
                max_entries: cap,
                directory: dir.clone(),
                core_id,
                ..IndexConfig::default()
            })
        })
        .collect();
    (dir, ix)
}

fn q<'a>(t: &'a str, m: &'a str, h: &'a [u8]) -> LookupQuery<'a> {
    LookupQuery {
        tenant: t,
        model: m,
        hash_scheme: "vllm",
        prefix_hash: h,
        ..Default::default()
    }
}

#[test]
fn unknown_tenant_and_cold_start_are_global() {
    let (dir, mut ix) = cores(2, 0);
    // Cold start on both cores.
    for c in ix.iter_mut() {
        assert_eq!(
            c.lookup_route(&q("x", "m", b"p"), T0, &NoRules).strategy,
            Strategy::None
        );
    }
    // Only a reserved (probe) entry on core 0: core 1 is no longer "cold" (§8.5 step 1, §19.15).
    ix[0].ingest(
        &upd(
            PROBE_TENANT,
            "m",
            "vllm",
            "__probe-b",
            vec![legacy(b"probe", 16)],
        ),
        T0,
        &NoRules,
    );
    assert_eq!(
        ix[1]
            .lookup_route(&q("x", "m", b"p"), T0, &NoRules)
            .strategy,
        Strategy::UnknownTenant
    );
    ix[0].apply_event(
        &event(Type::AllCleared, PROBE_TENANT, "m", "__probe-b", b""),
        T0,
        &NoRules,
    );
    assert_eq!(dir.total_entries(), 0);
    assert_eq!(
        ix[1]
            .lookup_route(&q("x", "m", b"p"), T0, &NoRules)
            .strategy,
        Strategy::None
    );

    // Tenant "t" has (t, m1) on core 0; (t, m2) lives on core 1 and has nothing.
    ix[0].ingest(
        &upd("t", "m1", "vllm", "r", vec![legacy(b"p", 16)]),
        T0,
        &NoRules,
    );
    assert_eq!(
        ix[1]
            .lookup_route(&q("t", "m2", b"p"), T0, &NoRules)
            .strategy,
        Strategy::UnknownModel
    );
    assert_eq!(
        ix[1]
            .lookup_route(&q("u", "m2", b"p"), T0, &NoRules)
            .strategy,
        Strategy::UnknownTenant
    );
    assert!(ix[1].has_tenant("t"));
    assert_eq!(
        ix[0]
            .lookup_route(&q("t", "m1", b"p"), T0, &NoRules)
            .strategy,
        Strategy::PrefixMatch
    );

    // The tenant leaves core 0: unknown everywhere, and its directory slot is reclaimed.
    assert_eq!(dir.live_tenants(), 1);
    ix[0].apply_event(&event(Type::AllCleared, "t", "m1", "r", b""), T0, &NoRules);
    assert_eq!(dir.live_tenants(), 0);
    ix[1].ingest(
        &upd("other", "m", "vllm", "r", vec![legacy(b"z", 16)]),
        T0,
        &NoRules,
    );
    assert_eq!(
        ix[1]
            .lookup_route(&q("t", "m2", b"p"), T0, &NoRules)
            .strategy,
        Strategy::UnknownTenant
    );
}

#[test]
fn global_cap_holds_across_cores() {
    let cap = 10;
    let (dir, mut ix) = cores(2, cap);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for i in 0..400u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let core = (x % 2) as usize;
        let model = if core == 0 { "m0" } else { "m1" };
        let n = 1 + (x >> 8) % 3;
        let prefixes = (0..n)
            .map(|j| legacy(&(i * 8 + j).to_be_bytes(), 16))
            .collect();
        let out = ix[core].ingest(
            &upd("t", model, "vllm", "r", prefixes),
            T0 + i as i64 * SEC,
            &NoRules,
        );
        // The ingesting core always has evictable entries here (it just added some).
        assert!(
            dir.non_reserved_entries() <= cap as i64,
            "step {i}: {}",
            dir.non_reserved_entries()
        );
        assert_eq!(
            dir.non_reserved_entries(),
            (ix[0].non_reserved_entry_count() + ix[1].non_reserved_entry_count()) as i64
        );
        assert!(out.cap_evicted.lru <= n + cap);
    }
    // Reserved entries do not count and are never victims.
    ix[1].ingest(
        &upd(
            PROBE_TENANT,
            "m1",
            "vllm",
            "__probe-x",
            vec![legacy(b"probe", 16)],
        ),
        T0 + 500 * SEC,
        &NoRules,
    );
    ix[1].ingest(
        &upd("t", "m1", "vllm", "r", vec![legacy(b"late", 16)]),
        T0 + 501 * SEC,
        &NoRules,
    );
    assert_eq!(dir.non_reserved_entries(), cap as i64);
    assert_eq!(dir.total_entries(), cap as i64 + 1);
}

#[test]
fn tenant_quota_holds_across_cores() {
    let rules = Rules::quota("team", 3);
    let (dir, mut ix) = cores(2, 0);
    for i in 0..20u32 {
        let core = (i % 2) as usize;
        let model = if core == 0 { "m0" } else { "m1" };
        ix[core].ingest(
            &upd(
                "team",
                model,
                "vllm",
                "r",
                vec![legacy(&i.to_be_bytes(), 16)],
            ),
            T0 + i as i64 * SEC,
            &rules,
        );
        let total = ix[0].tenant_prefix_count("team") + ix[1].tenant_prefix_count("team");
        assert!(total <= 3, "step {i}: {total}");
        assert_eq!(dir.tenant_keys(Directory::fingerprint("team")), total);
    }
}

#[test]
fn concurrent_cores_keep_directory_exact() {
    let (dir, ix) = cores(2, 0);
    let handles: Vec<_> = ix
        .into_iter()
        .enumerate()
        .map(|(c, mut ix)| {
            std::thread::spawn(move || {
                let model = format!("m{c}");
                for i in 0..2000u32 {
                    let t = format!("t{}", i % 7);
                    ix.ingest(
                        &upd(&t, &model, "vllm", "r", vec![legacy(&i.to_be_bytes(), 16)]),
                        T0,
                        &NoRules,
                    );
                    if i % 5 == 0 {
                        ix.apply_event(
                            &event(Type::AllCleared, &t, &model, "r", b""),
                            T0,
                            &NoRules,
                        );
                    }
                }
                ix
            })
        })
        .collect();
    let ix: Vec<Index> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let total: u64 = ix.iter().map(|i| i.entry_count()).sum();
    assert_eq!(dir.total_entries(), total as i64);
    for t in 0..7 {
        let name = format!("t{t}");
        let sum: u64 = ix.iter().map(|i| i.tenant_prefix_count(&name)).sum();
        assert_eq!(
            dir.tenant_keys(Directory::fingerprint(&name)),
            sum,
            "{name}"
        );
    }
}

/// A core pushes a tenant's key count changes to the directory slot it found last while its own
/// part of the count stays above zero (the slot cannot be retired then), and searches again once
/// its part went to zero: here core 0's part of `a` goes to zero while core 1 keeps the slot
/// live, then core 1's goes too, the slot is retired and taken by another tenant (eight tenants
/// fill the eight slots), and core 0's next key of `a` must not land in that tenant's slot.
#[test]
fn a_core_forgets_a_tenant_slot_once_its_keys_are_gone() {
    let dir = Arc::new(Directory::new(8));
    let mut ix: Vec<Index> = (0..2)
        .map(|core_id| {
            Index::new(IndexConfig {
                directory: dir.clone(),
                core_id,
                ..IndexConfig::default()
            })
        })
        .collect();
    let store = |ix: &mut Index, t: &str, h: &[u8]| {
        ix.ingest(&upd(t, "m", "vllm", "r", vec![legacy(h, 16)]), T0, &NoRules);
    };
    let evict = |ix: &mut Index, t: &str, h: &[u8]| {
        let e = event(Type::PrefixEvicted, t, "m", "r", h);
        assert_eq!(ix.apply_event(&e, T0, &NoRules).entries_removed, 1);
    };
    let keys = |t: &str| dir.tenant_keys_exact(Directory::fingerprint(t));
    store(&mut ix[0], "a", b"k0");
    store(&mut ix[0], "a", b"k1");
    store(&mut ix[1], "a", b"k2");
    assert_eq!(keys("a"), 3);
    evict(&mut ix[0], "a", b"k1");
    evict(&mut ix[0], "a", b"k0");
    assert_eq!(keys("a"), 1);
    evict(&mut ix[1], "a", b"k2");
    assert_eq!(keys("a"), 0);
    let others: Vec<String> = (0..8).map(|i| format!("other{i}")).collect();
    for t in &others {
        store(&mut ix[1], t, b"x");
    }
    assert_eq!(dir.live_tenants(), 8);
    store(&mut ix[0], "a", b"k3");
    store(&mut ix[0], "a", b"k4");
    assert_eq!(keys("a"), 2);
    for t in &others {
        assert_eq!(keys(t), 1, "{t}");
    }
    evict(&mut ix[0], "a", b"k3");
    assert_eq!(keys("a"), 1);
    for t in &others {
        assert_eq!(keys(t), 1, "{t}");
    }
}

/// With `cross_core_eviction`, a caller that gathers every core's first candidates, picks the
/// globally first ones ([`select_victims`]) and has each core evict its share reproduces one
/// index exactly: same entries left, after every ingest, for the tenant quota (§7.1) and the
/// global cap (§7.2) with LRU and LFU tenants, ties, and keys spread over cores.
#[test]
fn cross_core_victims_equal_one_index() {
    use inferencecache_index::index::select_victims;
    let mut rules = Rules::quota("ta", 7);
    rules.quota.insert("tb".into(), 5);
    rules.lfu.push("tb".into());
    rules.lfu.push("tc".into());
    let cap = 20;
    let mut one = index_with(HOUR, cap);
    let dir = Arc::new(Directory::default());
    let mut many: Vec<Index> = (0..3)
        .map(|core_id| {
            Index::new(IndexConfig {
                default_ttl_ns: HOUR,
                max_entries: cap,
                directory: dir.clone(),
                core_id,
                cross_core_eviction: true,
                ..IndexConfig::default()
            })
        })
        .collect();
    // Tiny candidate heaps: thresholds, stale snapshots and rebuilds all run.
    one.set_min_candidates(2);
    for ix in many.iter_mut() {
        ix.set_min_candidates(2);
    }
    let owner =
        |t: &str, m: &str| (t.len() * 7 + m.as_bytes()[1] as usize + t.as_bytes()[1] as usize) % 3;
    let mut seed = 0x5eed_u64;
    let mut next = |n: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    for step in 0..600 {
        let t = ["ta", "tb", "tc"][next(3) as usize];
        let m = ["m0", "m1", "m2", "m3"][next(4) as usize];
        let r = ["r0", "r1", "r2"][next(3) as usize];
        let h = [next(12) as u8 + b'a'];
        let mut u = upd(t, m, "vllm", r, vec![legacy(&h, 16)]);
        // Few distinct times: ties are frequent and broken by names.
        u.timestamp_us = (T0 + next(6) as i64 * SEC) / 1000;
        one.ingest(&u, T0, &rules);
        let c = owner(t, m);
        many[c].ingest(&u, T0, &rules);
        if let Some(budget) = inferencecache_index::rules::TenantRules::quota(&rules, t) {
            let fp = Directory::fingerprint(t);
            while dir.tenant_keys_exact(fp) > budget {
                let over = (dir.tenant_keys_exact(fp) - budget) as usize;
                let parts: Vec<_> = many
                    .iter_mut()
                    .map(|ix| ix.quota_candidates(t, over))
                    .collect();
                let picks = select_victims(&parts, over);
                for (ix, v) in many.iter_mut().zip(&picks) {
                    ix.evict_quota_victims(t, v, T0);
                }
            }
        }
        while dir.non_reserved_entries() > cap as i64 {
            let over = (dir.non_reserved_entries() - cap as i64) as usize;
            let parts: Vec<_> = many
                .iter_mut()
                .map(|ix| ix.cap_candidates(over, &rules))
                .collect();
            let picks = select_victims(&parts, over);
            for (ix, v) in many.iter_mut().zip(&picks) {
                ix.evict_cap_victims(v, T0);
            }
        }
        // LFU credit through lookups on the owner (and the same on the single index).
        if next(3) == 0 {
            let q = LookupQuery {
                tenant: t,
                model: m,
                hash_scheme: "vllm",
                prefix_hash: &h,
                ..Default::default()
            };
            let a = one.lookup_route(&q, T0, &rules).scores.len();
            let b = many[c].lookup_route(&q, T0, &rules).scores.len();
            assert_eq!(a, b, "step {step}: lookup");
        }
        let mut got: Vec<_> = many.iter().flat_map(|ix| ix.dump_entries()).collect();
        got.sort();
        assert_eq!(
            got,
            one.dump_entries(),
            "step {step}: entries differ from one index"
        );
    }
}
