//! Policy normalisation, store rules and the §12.4 resolution table (docs/BEHAVIOUR.md §12;
//! conformance C082, C110, C142, C144).

use inferencecache_index::PROBE_TENANT;
use inferencecache_index::policy::{
    PolicySnapshot, PolicySpec, PolicyStore, ResolvedPolicy, StrategySpec, parse_policy_body,
};
use inferencecache_index::rules::{Eviction, TenantRules};

fn store(body: &str) -> PolicyStore {
    parse_policy_body(body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"))
}

fn v7(policy: &str) -> PolicyStore {
    store(&format!(r#"{{"version":7,"policies":[{policy}]}}"#))
}

const STRATEGY_DEFAULTS: Option<StrategySpec> = Some(StrategySpec {
    enable_chain_matching: Some(true),
    require_chain: Some(false),
    enable_tenant_hot: Some(true),
});

#[test]
fn c082_quota_table() {
    let s = store(&format!(
        r#"{{"version":7,"tenants":[
            {{"tenantID":"{PROBE_TENANT}","maxIndexEntries":0}},
            {{"tenantID":"","maxIndexEntries":5}},
            {{"tenantID":"team-neg","maxIndexEntries":-3}},
            {{"tenantID":"team-b","maxIndexEntries":0}},
            {{"tenantID":"team-a","maxIndexEntries":1000}}]}}"#
    ));
    assert_eq!(s.quota(PROBE_TENANT), None);
    assert_eq!(TenantRules::quota(&s, PROBE_TENANT), None);
    assert_eq!(s.quota(""), None);
    assert_eq!(s.quota("team-neg"), Some(0));
    assert_eq!(s.quota("team-a"), Some(1000));
    assert_eq!(s.quota("team-b"), Some(0));
    assert_eq!(s.quota("team-z"), None);
    assert_eq!(
        s.quotas(),
        [("team-a", 1000), ("team-b", 0), ("team-neg", 0)]
    );
    // Replace-on-write: the next push without team-a drops its quota.
    let next = store(r#"{"version":7,"tenants":[{"tenantID":"team-b","maxIndexEntries":7}]}"#);
    assert_eq!(next.quota("team-a"), None);
    assert_eq!(next.quota("team-b"), Some(7));
}

#[test]
fn c082_later_duplicate_tenant_wins() {
    let s = store(
        r#"{"version":7,"tenants":[{"tenantID":"t","maxIndexEntries":1},{"tenantID":"t","maxIndexEntries":2}]}"#,
    );
    assert_eq!(s.quota("t"), Some(2));
}

#[test]
fn c110_minimum_matched_tokens_table() {
    let none = PolicyStore::empty();
    assert_eq!(none.resolve("t").minimum_matched_tokens, 64);
    assert_eq!(
        v7(r#"{"namespace":"t","minimumMatchedTokens":256}"#)
            .resolve("t")
            .minimum_matched_tokens,
        256
    );
    assert_eq!(
        v7(r#"{"namespace":"t","minimumMatchedTokens":0}"#)
            .resolve("t")
            .minimum_matched_tokens,
        0
    );
    assert_eq!(
        v7(r#"{"namespace":"t"}"#)
            .resolve("t")
            .minimum_matched_tokens,
        0
    );
    assert_eq!(
        v7(r#"{"namespace":"t","minimumMatchedTokens":-1}"#)
            .resolve("t")
            .minimum_matched_tokens,
        0
    );
    // A different tenant of an installed store still gets the no-policy 64.
    assert_eq!(
        v7(r#"{"namespace":"t"}"#)
            .resolve("other")
            .minimum_matched_tokens,
        64
    );
}

#[test]
fn c110_routing_floor_table() {
    assert_eq!(PolicyStore::empty().resolve("t").routing_floor_score, 0.1);
    assert_eq!(
        v7(r#"{"namespace":"t","routingFloorScore":5}"#)
            .resolve("t")
            .routing_floor_score,
        5.0
    );
    assert_eq!(
        v7(r#"{"namespace":"t","routingFloorScore":0}"#)
            .resolve("t")
            .routing_floor_score,
        0.0
    );
    assert_eq!(
        v7(r#"{"namespace":"t"}"#).resolve("t").routing_floor_score,
        0.1
    );
    assert_eq!(
        v7(r#"{"namespace":"t","routingFloorScore":-1}"#)
            .resolve("t")
            .routing_floor_score,
        0.0
    );
}

#[test]
fn c110_affinity_table() {
    assert!(PolicyStore::empty().resolve("t").affinity_routing);
    assert!(v7(r#"{"namespace":"t"}"#).resolve("t").affinity_routing);
    assert!(
        v7(r#"{"namespace":"t","affinityRouting":true}"#)
            .resolve("t")
            .affinity_routing
    );
    assert!(
        !v7(r#"{"namespace":"t","affinityRouting":false}"#)
            .resolve("t")
            .affinity_routing
    );
}

#[test]
fn c110_missing_tenant_defaults() {
    let s = v7(r#"{"namespace":"x","evictionTTL":5,"minimumPrefixTokens":9,"lookupTimeoutMs":3}"#);
    for r in [
        s.resolve("missing"),
        PolicyStore::empty().resolve("missing"),
    ] {
        assert_eq!(r, ResolvedPolicy::NO_POLICY);
        assert_eq!(r.ttl_ns, 0);
        assert_eq!(r.minimum_prefix_tokens, 0);
        assert_eq!(r.lookup_timeout_ms, 0);
        assert_eq!(r.lookup_budget(), None);
        assert_eq!(r.eviction, Eviction::Lru);
        assert!(r.enable_chain_matching && !r.require_chain && r.enable_tenant_hot);
    }
    assert_eq!(s.ttl_ns("missing"), 0);
    assert_eq!(s.eviction("missing"), Eviction::Lru);
}

#[test]
fn resolution_of_present_values_and_clamps() {
    let s = v7(
        r#"{"namespace":"t","evictionTTL":900000000000,"minimumPrefixTokens":32,"lookupTimeoutMs":25,"eviction":"LFU","strategy":{"enableChainMatching":false,"requireChain":true,"enableTenantHot":false}}"#,
    );
    let r = s.resolve("t");
    assert_eq!(r.ttl_ns, 900_000_000_000);
    assert_eq!(r.eviction, Eviction::Lfu);
    assert_eq!(r.minimum_prefix_tokens, 32);
    assert_eq!(r.lookup_timeout_ms, 25);
    assert_eq!(
        r.lookup_budget(),
        Some(std::time::Duration::from_millis(25))
    );
    assert!(!r.enable_chain_matching && r.require_chain && !r.enable_tenant_hot);
    assert_eq!(s.ttl_ns("t"), 900_000_000_000);
    assert_eq!(s.eviction("t"), Eviction::Lfu);

    let neg = v7(r#"{"namespace":"t","evictionTTL":-5,"minimumPrefixTokens":-1,"lookupTimeoutMs":-7,"eviction":"fifo"}"#)
        .resolve("t");
    assert_eq!(
        (neg.ttl_ns, neg.minimum_prefix_tokens, neg.lookup_timeout_ms),
        (0, 0, 0)
    );
    assert_eq!(neg.eviction, Eviction::Lru);
    // An empty strategy object takes the member defaults.
    let empty = v7(r#"{"namespace":"t","strategy":{}}"#).resolve("t");
    assert!(empty.enable_chain_matching && !empty.require_chain && empty.enable_tenant_hot);
}

#[test]
fn c142_eviction_round_trip_and_store_rules() {
    let s = store(
        r#"{"version":7,"policies":[{"namespace":"a","eviction":"lfu"},{"namespace":"b","eviction":"lru"},{"namespace":"c"},{"namespace":"","eviction":"lfu"}]}"#,
    );
    assert_eq!(s.eviction_name("a"), "lfu");
    assert_eq!(s.eviction_name("b"), "lru");
    assert_eq!(s.eviction_name("c"), "");
    assert_eq!(s.eviction_name("unknown"), "");
    assert_eq!(s.eviction("c"), Eviction::Lru);
    assert_eq!(s.namespaces(), ["a", "b", "c"]);
    assert!(s.policy("").is_none());
    assert_eq!(s.resolve(""), ResolvedPolicy::NO_POLICY);

    // A second snapshot without team-b removes it.
    let first =
        store(r#"{"version":7,"policies":[{"namespace":"team-a"},{"namespace":"team-b"}]}"#);
    assert!(first.policy("team-b").is_some());
    let second = store(r#"{"version":7,"policies":[{"namespace":"team-a"}]}"#);
    assert!(second.policy("team-b").is_none());
    assert_eq!(second.resolve("team-b").minimum_matched_tokens, 64);
}

#[test]
fn c142_later_duplicate_namespace_overwrites() {
    let s = store(
        r#"{"version":7,"policies":[{"namespace":"a","lookupTimeoutMs":1},{"namespace":"a","lookupTimeoutMs":2}]}"#,
    );
    assert_eq!(s.resolve("a").lookup_timeout_ms, 2);
    assert_eq!(s.namespaces(), ["a"]);
}

#[test]
fn c144_v3_body_normalised() {
    let s = store(
        r#"{"version":3,"policies":[
            {"namespace":"team-a","evictionTTL":900000000000,"minimumPrefixTokens":32,"lookupTimeoutMs":25,"eviction":"lfu"},
            {"namespace":"team-b","evictionTTL":3600000000000}],
           "tenants":[{"tenantID":"team-a","maxIndexEntries":100000}]}"#,
    );
    for ns in ["team-a", "team-b"] {
        let p = s.policy(ns).unwrap();
        assert_eq!(p.minimum_matched_tokens, 64, "{ns}");
        assert_eq!(p.routing_floor_score, Some(0.1), "{ns}");
        assert_eq!(p.strategy, STRATEGY_DEFAULTS, "{ns}");
        assert_eq!(p.affinity_routing, Some(true), "{ns}");
    }
    let a = s.policy("team-a").unwrap();
    assert_eq!(
        (
            a.eviction_ttl_ns,
            a.minimum_prefix_tokens,
            a.lookup_timeout_ms,
            a.eviction.as_str()
        ),
        (900_000_000_000, 32, 25, "lfu")
    );
    assert_eq!(
        s.policy("team-b").unwrap().eviction_ttl_ns,
        3_600_000_000_000
    );
    assert_eq!(s.quota("team-a"), Some(100_000));
    let r = s.resolve("team-a");
    assert_eq!((r.minimum_matched_tokens, r.routing_floor_score), (64, 0.1));
}

#[test]
fn c144_v4_to_v7_normalisation() {
    let v4 =
        store(r#"{"version":4,"policies":[{"namespace":"raw-recall","minimumMatchedTokens":0}]}"#);
    let p = v4.policy("raw-recall").unwrap();
    assert_eq!(p.minimum_matched_tokens, 0);
    assert_eq!(p.routing_floor_score, Some(0.1));
    assert_eq!(p.strategy, STRATEGY_DEFAULTS);
    assert_eq!(p.affinity_routing, Some(true));
    assert_eq!(v4.resolve("raw-recall").minimum_matched_tokens, 0);

    let v5 = store(r#"{"version":5,"policies":[{"namespace":"raw","routingFloorScore":0}]}"#);
    assert_eq!(v5.policy("raw").unwrap().routing_floor_score, Some(0.0));
    assert_eq!(v5.resolve("raw").routing_floor_score, 0.0);

    let bare = store(r#"{"version":5,"policies":[{"namespace":"foo"}]}"#);
    assert_eq!(bare.policy("foo").unwrap().affinity_routing, Some(true));
    assert!(bare.resolve("foo").affinity_routing);

    // v5 partial strategy: absent members filled.
    let partial =
        store(r#"{"version":5,"policies":[{"namespace":"p","strategy":{"requireChain":true}}]}"#);
    assert_eq!(
        partial.policy("p").unwrap().strategy,
        Some(StrategySpec {
            enable_chain_matching: Some(true),
            require_chain: Some(true),
            enable_tenant_hot: Some(true),
        })
    );

    // v6: strategy left as written, affinity still filled.
    let v6 = store(r#"{"version":6,"policies":[{"namespace":"s"}]}"#);
    assert_eq!(v6.policy("s").unwrap().strategy, None);
    assert_eq!(v6.policy("s").unwrap().affinity_routing, Some(true));

    let v7s = store(
        r#"{"version":7,"policies":[{"namespace":"s","strategy":{"enableChainMatching":true,"requireChain":true,"enableTenantHot":false}}]}"#,
    );
    assert_eq!(
        v7s.policy("s").unwrap().strategy,
        Some(StrategySpec {
            enable_chain_matching: Some(true),
            require_chain: Some(true),
            enable_tenant_hot: Some(false),
        })
    );
    assert_eq!(v7s.policy("s").unwrap().affinity_routing, None);
    let r = v7s.resolve("s");
    assert!(
        r.enable_chain_matching && r.require_chain && !r.enable_tenant_hot && r.affinity_routing
    );
}

#[test]
fn normalise_is_a_no_op_for_v7() {
    let mut snap = PolicySnapshot {
        version: 7,
        policies: vec![PolicySpec {
            namespace: "a".into(),
            ..Default::default()
        }],
        tenants: vec![],
    };
    let before = snap.clone();
    snap.normalise();
    assert_eq!(snap, before);
}

#[test]
fn store_snapshot_round_trip() {
    let s = store(
        r#"{"version":4,"policies":[{"namespace":"b","eviction":"lfu"},{"namespace":"a","routingFloorScore":0.25}],"tenants":[{"tenantID":"z","maxIndexEntries":-1},{"tenantID":"y","maxIndexEntries":4}]}"#,
    );
    let snap = s.to_snapshot();
    assert_eq!(snap.version, 7);
    let again = store(&snap.to_json().unwrap());
    for ns in ["a", "b", "c"] {
        assert_eq!(again.resolve(ns), s.resolve(ns), "{ns}");
    }
    assert_eq!(again.quotas(), s.quotas());
    assert_eq!(again.quotas(), [("y", 4), ("z", 0)]);
}

#[test]
fn store_is_shareable_across_cores() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<PolicyStore>();
    let shared = std::sync::Arc::new(v7(r#"{"namespace":"t","eviction":"lfu"}"#));
    let rules: &dyn TenantRules = &*shared;
    assert_eq!(rules.eviction("t"), Eviction::Lfu);
    assert!(PolicyStore::empty().is_empty());
}
