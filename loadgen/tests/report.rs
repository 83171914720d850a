//! The JSON report's shape (what CI and dashboards parse) and its numbers.

use std::time::Duration;

use loadgen::histogram::{LookupOutcome, Recorder, Rpc};
use loadgen::report::{Report, RunFacts};
use loadgen::workload::{WorkloadConfig, WorkloadKind};
use serde_json::Value;

fn workload() -> WorkloadConfig {
    WorkloadConfig {
        kind: WorkloadKind::Rag,
        seed: 3,
        replicas: 2,
        tenants: 1,
        models: 1,
        adapters: 0,
        hash_scheme: "vllm".into(),
        block_size: 16,
        min_tokens: 16,
        mean_tokens: 64,
        max_tokens: 128,
        population: 8,
        system_prompts: 1,
        system_prompt_tokens: 32,
        turns: 2,
        chunk_tokens: 32,
        chunks_per_prompt: 2,
        zipf: 1.0,
        vocab: 1000,
    }
}

fn report() -> Report {
    let rec = Recorder::new(&[Duration::from_millis(1), Duration::from_millis(5)]);
    // 100 lookups: 1..=100 × 0.1 ms; 60 PREFIX_MATCH (64 matched of 128), 40 NO_HINT.
    for i in 1..=100u64 {
        rec.record_ok_latency(Rpc::LookupRoute, Duration::from_micros(100 * i));
        let pm = i <= 60;
        rec.record_lookup(LookupOutcome {
            reason: if pm { "PREFIX_MATCH" } else { "NO_HINT" },
            scores: pm as usize,
            top_matched_tokens: if pm { 64 } else { 0 },
            prompt_tokens: 128,
        });
    }
    rec.record_error(Rpc::LookupRoute, tonic::Code::Unavailable);
    rec.record_error(Rpc::PublishEvent, tonic::Code::DeadlineExceeded);
    rec.record_ok_latency(Rpc::ReportCacheState, Duration::from_millis(2));
    rec.record_send_lag(Duration::from_micros(50));
    Report::build(
        &rec.snapshot(),
        RunFacts {
            target: "http://127.0.0.1:9090".into(),
            rate: Some(50.0),
            concurrency: None,
            connections: 2,
            lookup_input: "chain".into(),
            workload: workload(),
            producer: None,
            elapsed_s: 2.0,
            started: 101,
            abandoned: 0,
            ingest: None,
            preload: None,
        },
    )
}

#[test]
fn json_has_the_documented_shape() {
    let v: Value = serde_json::from_str(&report().to_json()).unwrap();
    for key in [
        "tool",
        "version",
        "target",
        "mode",
        "target_rate",
        "concurrency",
        "connections",
        "lookup_input",
        "workload",
        "producer",
        "elapsed_s",
        "lookups_started",
        "lookups_abandoned",
        "achieved_rate",
        "rpcs",
        "reason_codes",
        "errors_by_code",
        "budgets",
        "hits",
        "send_lag",
        "ingest",
        "preload",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    assert_eq!(v["tool"], "loadgen");
    assert_eq!(v["mode"], "open-loop");
    assert_eq!(v["workload"]["kind"], "rag");
    assert_eq!(v["workload"]["hash_scheme"], "vllm");
    for rpc in ["LookupRoute", "PublishEvent", "ReportCacheState"] {
        let r = &v["rpcs"][rpc];
        for k in [
            "count",
            "ok",
            "errors",
            "errors_by_code",
            "p50_ms",
            "p90_ms",
            "p99_ms",
            "p999_ms",
            "max_ms",
            "mean_ms",
        ] {
            assert!(r.get(k).is_some(), "rpcs.{rpc}.{k}");
        }
    }
    for k in ["budget_ms", "over", "share_over"] {
        assert!(v["budgets"][0].get(k).is_some(), "budgets[].{k}");
    }
    for k in [
        "with_scores",
        "share_with_scores",
        "prefix_match_share",
        "mean_top_matched_tokens",
        "token_hit_ratio",
    ] {
        assert!(v["hits"].get(k).is_some(), "hits.{k}");
    }
}

#[test]
fn numbers_are_right() {
    let r = report();
    let lk = &r.rpcs["LookupRoute"];
    assert_eq!((lk.count, lk.ok, lk.errors), (101, 100, 1));
    assert_eq!(lk.errors_by_code["UNAVAILABLE"], 1);
    assert!((lk.p50_ms - 5.0).abs() < 0.01, "{}", lk.p50_ms);
    assert!((lk.p90_ms - 9.0).abs() < 0.01, "{}", lk.p90_ms);
    assert!((lk.p99_ms - 9.9).abs() < 0.01, "{}", lk.p99_ms);
    assert!((lk.max_ms - 10.0).abs() < 0.01, "{}", lk.max_ms);
    assert_eq!(r.reason_codes["PREFIX_MATCH"], 60);
    assert_eq!(r.reason_codes["NO_HINT"], 40);
    assert_eq!(r.errors_by_code["UNAVAILABLE"], 1);
    assert_eq!(r.errors_by_code["DEADLINE_EXCEEDED"], 1);
    assert_eq!(r.total_errors(), 2);
    // Strictly over 1 ms: 1.1 … 10.0 ms → 90; over 5 ms: 5.1 … → 50.
    assert_eq!((r.budgets[0].over, r.budgets[1].over), (90, 50));
    assert!((r.budgets[0].share_over - 0.9).abs() < 1e-9);
    assert!((r.achieved_rate - 50.5).abs() < 1e-9);
    assert!((r.hits.prefix_match_share - 0.6).abs() < 1e-9);
    assert!((r.hits.mean_top_matched_tokens - 64.0).abs() < 1e-9);
    assert!((r.hits.token_hit_ratio - 0.3).abs() < 1e-9);
    assert!((r.lookup_error_rate() - 1.0 / 101.0).abs() < 1e-12);
    let t = r.to_table();
    for s in [
        "LookupRoute",
        "PREFIX_MATCH",
        "UNAVAILABLE",
        "lookups over budget",
        "p99.9 ms",
    ] {
        assert!(t.contains(s), "table lacks {s}:\n{t}");
    }
}
