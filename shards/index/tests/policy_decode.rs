//! `/policy` body decoding and wire shape (docs/BEHAVIOUR.md §12.3; conformance C142, C144, C145 and
//! the decode error cases of the HTTP contract).

use inferencecache_index::policy::{
    MAX_POLICY_BODY_BYTES, PolicyError, PolicySnapshot, PolicySpec, StrategySpec, TenantSpec,
    decode_snapshot, go_json_f32, parse_policy_body,
};

fn err(body: &str) -> String {
    parse_policy_body(body.as_bytes()).unwrap_err().to_string()
}

fn decode_err(body: &str) -> String {
    let e = err(body);
    assert!(e.starts_with("decode policy snapshot: "), "{body} → {e}");
    e
}

#[test]
fn c142_v7_body_decodes_and_stores() {
    let store = parse_policy_body(
        br#"{"version":7,"policies":[{"namespace":"team-a","evictionTTL":420000000000,"minimumPrefixTokens":16}]}"#,
    )
    .unwrap();
    let p = store.policy("team-a").unwrap();
    assert_eq!(p.eviction_ttl_ns, 420_000_000_000);
    assert_eq!(p.minimum_prefix_tokens, 16);
    // v7 is stored as written: nothing filled in.
    assert_eq!(p.routing_floor_score, None);
    assert_eq!(p.strategy, None);
    assert_eq!(p.affinity_routing, None);
    assert_eq!(p.minimum_matched_tokens, 0);
}

#[test]
fn c145_controller_wire_shape_exact() {
    let snap = PolicySnapshot {
        version: 7,
        policies: vec![PolicySpec {
            namespace: "team-a".into(),
            routing_floor_score: Some(0.0),
            ..Default::default()
        }],
        tenants: vec![TenantSpec {
            tenant_id: "tenant-a".into(),
            max_index_entries: 10,
            isolation_mode: String::new(),
        }],
    };
    assert_eq!(
        snap.to_json().unwrap(),
        r#"{"version":7,"policies":[{"namespace":"team-a","routingFloorScore":0}],"tenants":[{"tenantID":"tenant-a","maxIndexEntries":10}]}"#
    );
    // maxIndexEntries is always present, even at 0; empty tenants are omitted.
    let zero = PolicySnapshot {
        version: 7,
        policies: vec![],
        tenants: vec![TenantSpec {
            tenant_id: "t".into(),
            ..Default::default()
        }],
    };
    assert_eq!(
        zero.to_json().unwrap(),
        r#"{"version":7,"policies":[],"tenants":[{"tenantID":"t","maxIndexEntries":0}]}"#
    );
    let bare = PolicySnapshot {
        version: 7,
        ..Default::default()
    };
    assert_eq!(bare.to_json().unwrap(), r#"{"version":7,"policies":[]}"#);
}

#[test]
fn c145_full_policy_round_trips_in_controller_key_order() {
    let body = r#"{"version":7,"policies":[{"namespace":"team-a","evictionTTL":900000000000,"minimumPrefixTokens":32,"minimumMatchedTokens":128,"routingFloorScore":5,"lookupTimeoutMs":25,"affinityRouting":true,"eviction":"lfu","strategy":{"enableChainMatching":true,"requireChain":false,"enableTenantHot":true}}],"tenants":[{"tenantID":"team-a","maxIndexEntries":100000,"isolationMode":"Fairness"}]}"#;
    let snap = decode_snapshot(body.as_bytes()).unwrap();
    assert_eq!(snap.to_json().unwrap(), body);
    assert_eq!(
        snap.policies[0].strategy,
        Some(StrategySpec {
            enable_chain_matching: Some(true),
            require_chain: Some(false),
            enable_tenant_hot: Some(true),
        })
    );
    // The store re-emits an equivalent body.
    let store = parse_policy_body(body.as_bytes()).unwrap();
    assert_eq!(
        store
            .to_snapshot()
            .to_json()
            .unwrap()
            .replace(r#","isolationMode":"Fairness""#, ""),
        body.replace(r#","isolationMode":"Fairness""#, "")
    );
}

#[test]
fn go_float32_rendering() {
    let cases: [(f32, &str); 10] = [
        (0.0, "0"),
        (5.0, "5"),
        (0.1, "0.1"),
        (0.000001, "0.000001"),
        (1e-7, "1e-7"),
        (1.5e-10, "1.5e-10"),
        (99999999.999999, "100000000"),
        (123.456, "123.456"),
        (-2.5, "-2.5"),
        (1e21, "1e+21"),
    ];
    for (v, want) in cases {
        assert_eq!(go_json_f32(v).as_deref(), Some(want), "{v}");
    }
    assert_eq!(go_json_f32(f32::NAN), None);
    assert_eq!(go_json_f32(f32::INFINITY), None);
    let nan = PolicySnapshot {
        version: 7,
        policies: vec![PolicySpec {
            namespace: "a".into(),
            routing_floor_score: Some(f32::NAN),
            ..Default::default()
        }],
        tenants: vec![],
    };
    assert!(nan.to_json().is_err());
}

#[test]
fn decode_rejects_unknown_fields_at_every_level() {
    assert!(decode_err(r#"{"version":7,"bogus":1}"#).contains("bogus"));
    assert!(
        decode_err(r#"{"version":7,"policies":[{"namespace":"a","bogus":1}]}"#).contains("bogus")
    );
    assert!(
        decode_err(r#"{"version":7,"policies":[{"namespace":"a","strategy":{"bogus":true}}]}"#)
            .contains("bogus")
    );
    assert!(
        decode_err(r#"{"version":7,"tenants":[{"tenantID":"a","maxIndexEntries":1,"bogus":""}]}"#)
            .contains("bogus")
    );
}

#[test]
fn decode_rejects_wrong_types() {
    decode_err(r#"{"version":"7"}"#);
    decode_err(r#"{"version":7,"policies":{}}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":1}]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","affinityRouting":"true"}]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","routingFloorScore":"0.1"}]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","strategy":true}]}"#);
    decode_err(r#"{"version":7,"tenants":[{"tenantID":"a","maxIndexEntries":"5"}]}"#);
    // Arrays are never accepted positionally where an object is expected.
    decode_err(r#"[]"#);
    decode_err(r#"[7]"#);
    decode_err(r#"{"version":7,"policies":[["a"]]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","strategy":[true]}]}"#);
    decode_err(r#"{"version":7,"tenants":[["a",1]]}"#);
    decode_err(r#"{"version":7,"tenants":[5]}"#);
}

#[test]
fn decode_rejects_float_or_out_of_range_where_int_expected() {
    decode_err(r#"{"version":7.0}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","minimumPrefixTokens":1.5}]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","lookupTimeoutMs":1e3}]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","minimumMatchedTokens":2147483648}]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","evictionTTL":9223372036854775808}]}"#);
    decode_err(r#"{"version":7,"tenants":[{"tenantID":"a","maxIndexEntries":0.5}]}"#);
    decode_err(r#"{"version":7,"policies":[{"namespace":"a","routingFloorScore":1e39}]}"#);
    // In range: int32 extremes and int64 nanoseconds are fine.
    parse_policy_body(
        br#"{"version":7,"policies":[{"namespace":"a","minimumMatchedTokens":-2147483648,"lookupTimeoutMs":2147483647,"evictionTTL":9223372036854775807}]}"#,
    )
    .unwrap();
}

#[test]
fn decode_rejects_malformed_json_and_empty_body() {
    decode_err("");
    decode_err("{");
    decode_err(r#"{"version":7,}"#);
}

#[test]
fn version_out_of_range_or_missing_is_unsupported() {
    for body in [
        r#"{"version":2}"#,
        r#"{"version":8}"#,
        r#"{}"#,
        r#"{"policies":[]}"#,
        r#"{"version":-1}"#,
        "null",
    ] {
        assert_eq!(
            parse_policy_body(body.as_bytes()).unwrap_err(),
            PolicyError::UnsupportedVersion,
            "{body}"
        );
        assert_eq!(err(body), "unsupported policy snapshot version");
    }
    for v in 3..=7 {
        parse_policy_body(format!(r#"{{"version":{v}}}"#).as_bytes()).unwrap();
    }
}

#[test]
fn decode_errors_take_precedence_over_version() {
    assert!(err(r#"{"version":2,"bogus":1}"#).starts_with("decode policy snapshot: "));
}

#[test]
fn trailing_bytes_after_first_value_are_ignored() {
    let store =
        parse_policy_body(br#"{"version":7,"policies":[{"namespace":"a"}]} garbage {"#).unwrap();
    assert!(store.policy("a").is_some());
    parse_policy_body(br#"{"version":7}{"version":2}"#).unwrap();
    parse_policy_body(b"  \n{\"version\":7}]").unwrap();
}

#[test]
fn null_members_behave_like_absent_keys() {
    let store = parse_policy_body(
        br#"{"version":7,"policies":[{"namespace":"a","routingFloorScore":null,"strategy":null,"evictionTTL":null},null],"tenants":null}"#,
    )
    .unwrap();
    let p = store.policy("a").unwrap();
    assert_eq!(p.routing_floor_score, None);
    assert_eq!(p.strategy, None);
    assert_eq!(store.namespaces(), ["a"]);
}

#[test]
fn keys_match_case_insensitively_like_go() {
    let store = parse_policy_body(
        br#"{"Version":7,"POLICIES":[{"Namespace":"a","evictionttl":5,"Strategy":{"requirechain":true}}],"Tenants":[{"tenantid":"a","MaxIndexEntries":3}]}"#,
    )
    .unwrap();
    let p = store.policy("a").unwrap();
    assert_eq!(p.eviction_ttl_ns, 5);
    assert_eq!(p.strategy.unwrap().require_chain, Some(true));
    assert_eq!(store.quota("a"), Some(3));
}

#[test]
fn duplicate_keys_keep_the_last_value() {
    let store = parse_policy_body(br#"{"version":2,"version":7,"policies":[{"namespace":"a","lookupTimeoutMs":1,"lookupTimeoutMs":9}]}"#).unwrap();
    assert_eq!(store.policy("a").unwrap().lookup_timeout_ms, 9);
}

#[test]
fn oversize_body_is_a_decode_error_unless_the_value_ends_within_the_limit() {
    let mut big = br#"{"version":7,"policies":[{"namespace":""#.to_vec();
    big.resize(MAX_POLICY_BODY_BYTES + 10, b'a');
    big.extend_from_slice(br#""}]}"#);
    assert_eq!(
        err(std::str::from_utf8(&big).unwrap()),
        "decode policy snapshot: http: request body too large"
    );
    let mut ok = br#"{"version":7}"#.to_vec();
    ok.resize(MAX_POLICY_BODY_BYTES + 10, b' ');
    parse_policy_body(&ok).unwrap();
}
