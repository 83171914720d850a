//! Mapping (docs/KV-EVENTS.md §3) and seq handling, without sockets: events in, operations out.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use inferencecache_fingerprint::prefix_hashes;
use inferencecache_proto::v1alpha1::{CacheTier, PrefixEntry};
use kvevent_subscriber::decode::{Batch, BlockRemoved, BlockStored, EngineHash, Event, ExtraKey};
use kvevent_subscriber::ingest::Processor;
use kvevent_subscriber::mapping::{Mapper, MappingConfig, Op, PublisherState, ts_to_us};
use kvevent_subscriber::metrics::Metrics;
use rmpv::Value;

const BS: i64 = 16;

fn cfg() -> MappingConfig {
    MappingConfig {
        replica_id: "r1".into(),
        replica_per_dp_rank: false,
        adapters: HashMap::from([(1, "sql-lora".to_string()), (2, "chat-lora".to_string())]),
        use_lora_name: false,
        block_size_override: None,
        offload_keeps_blocks: false,
        kv_cache_group: 0,
        reverse_map_capacity: 1000,
    }
}

fn setup(c: MappingConfig) -> (Mapper, PublisherState, Arc<Metrics>) {
    let m = Metrics::new();
    let st = PublisherState::new(&c, None);
    (Mapper::new(c, m.clone()), st, m)
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, toks: Vec<u32>) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
        parent_block_hash: parent.map(EngineHash::Int),
        token_ids: toks,
        block_size: Some(BS),
        medium: Some("GPU".into()),
        ..Default::default()
    }
}

fn removed(hashes: &[u64], medium: &str) -> BlockRemoved {
    BlockRemoved {
        block_hashes: hashes.iter().map(|h| EngineHash::Int(*h)).collect(),
        medium: Some(medium.into()),
        group_idx: None,
    }
}

fn run(mapper: &Mapper, st: &mut PublisherState, ts: f64, events: Vec<Event>) -> Vec<Op> {
    let mut out = Vec::new();
    let batch = Batch {
        ts,
        events,
        dp_rank: None,
    };
    mapper.apply_batch(st, &batch, &mut out);
    out
}

fn entry(prefix: u64, count: i32, tier: CacheTier, adapter: &str) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: prefix.to_be_bytes().to_vec(),
        token_count: count,
        block_hashes: vec![],
        block_token_counts: vec![],
        tier: tier as i32,
        adapter_id: adapter.into(),
    }
}

fn add(ts_us: i64, entries: Vec<PrefixEntry>) -> Op {
    Op::Add {
        replica: "r1".into(),
        ts_us,
        entries,
    }
}

#[test]
fn parent_chaining_equals_fingerprint_of_concatenated_tokens() {
    let (m, mut st, _) = setup(cfg());
    let all = tokens(0..64);
    let want = prefix_hashes(&all, BS as i32, None);
    let ops1 = run(
        &m,
        &mut st,
        1.5,
        vec![Event::BlockStored(stored(
            &[10, 11],
            None,
            all[..32].to_vec(),
        ))],
    );
    let ops2 = run(
        &m,
        &mut st,
        1.5,
        vec![Event::BlockStored(stored(
            &[12, 13],
            Some(11),
            all[32..].to_vec(),
        ))],
    );
    assert_eq!(
        ops1,
        vec![add(
            1_500_000,
            vec![
                entry(want[0], 16, CacheTier::T1, ""),
                entry(want[1], 32, CacheTier::T1, "")
            ]
        )]
    );
    assert_eq!(
        ops2,
        vec![add(
            1_500_000,
            vec![
                entry(want[2], 48, CacheTier::T1, ""),
                entry(want[3], 64, CacheTier::T1, "")
            ]
        )]
    );
    // Same as the explicit-parent form of §17.
    assert_eq!(
        prefix_hashes(&all[32..], BS as i32, Some(want[1])),
        want[2..].to_vec()
    );
}

#[test]
fn unknown_parent_starts_a_new_root() {
    let (m, mut st, _) = setup(cfg());
    let t = tokens(100..116);
    let ops = run(
        &m,
        &mut st,
        0.0,
        vec![Event::BlockStored(stored(&[5], Some(999), t.clone()))],
    );
    let root = prefix_hashes(&t, 16, None)[0];
    assert_eq!(ops, vec![add(0, vec![entry(root, 16, CacheTier::T1, "")])]);
}

#[test]
fn adapters_nil_mapped_unmapped_and_lora_name() {
    let (m, mut st, metrics) = setup(cfg());
    let t = tokens(0..16);
    let h = prefix_hashes(&t, 16, None)[0];
    let mut e = stored(&[1], None, t.clone());
    e.lora_id = Some(2);
    let ops = run(&m, &mut st, 1.0, vec![Event::BlockStored(e.clone())]);
    assert_eq!(
        ops,
        vec![add(
            1_000_000,
            vec![entry(h, 16, CacheTier::T1, "chat-lora")]
        )]
    );

    e.lora_id = Some(7);
    e.lora_name = Some("named-lora".into());
    assert!(run(&m, &mut st, 1.0, vec![Event::BlockStored(e.clone())]).is_empty());
    assert_eq!(metrics.dropped("unmapped_adapter"), 1);

    let mut c = cfg();
    c.use_lora_name = true;
    let (m2, mut st2, _) = setup(c);
    let ops = run(&m2, &mut st2, 1.0, vec![Event::BlockStored(e)]);
    assert_eq!(
        ops,
        vec![add(
            1_000_000,
            vec![entry(h, 16, CacheTier::T1, "named-lora")]
        )]
    );
}

#[test]
fn token_ids_not_matching_blocks_yield_nothing() {
    let (m, mut st, metrics) = setup(cfg());
    let ops = run(
        &m,
        &mut st,
        1.0,
        vec![Event::BlockStored(stored(&[1, 2], None, tokens(0..20)))],
    );
    assert!(ops.is_empty());
    assert_eq!(metrics.dropped("token_count_mismatch"), 2);
    assert_eq!(st.known_blocks(), 0);

    let mut no_bs = stored(&[1], None, tokens(0..16));
    no_bs.block_size = None;
    assert!(run(&m, &mut st, 1.0, vec![Event::BlockStored(no_bs.clone())]).is_empty());
    assert_eq!(metrics.dropped("bad_block_size"), 1);

    let mut c = cfg();
    c.block_size_override = Some(16);
    let (m2, mut st2, _) = setup(c);
    assert_eq!(
        run(&m2, &mut st2, 1.0, vec![Event::BlockStored(no_bs)]).len(),
        1
    );
}

#[test]
fn removal_evicts_known_blocks_with_their_adapter() {
    let (m, mut st, metrics) = setup(cfg());
    let t = tokens(0..32);
    let want = prefix_hashes(&t, 16, None);
    let mut e = stored(&[1, 2], None, t);
    e.lora_id = Some(1);
    run(&m, &mut st, 1.0, vec![Event::BlockStored(e)]);
    let ops = run(
        &m,
        &mut st,
        2.0,
        vec![Event::BlockRemoved(removed(&[2, 77], "GPU"))],
    );
    assert_eq!(
        ops,
        vec![Op::Evict {
            replica: "r1".into(),
            ts_us: 2_000_000,
            keys: vec![(want[1].to_be_bytes().to_vec(), "sql-lora".into())],
        }]
    );
    assert_eq!(metrics.dropped("unknown_block"), 1);
    // A second removal of the same block is a no-op.
    assert!(
        run(
            &m,
            &mut st,
            2.0,
            vec![Event::BlockRemoved(removed(&[2], "GPU"))]
        )
        .is_empty()
    );
}

#[test]
fn offload_copies_and_media() {
    let (m, mut st, _) = setup(cfg());
    let t = tokens(0..16);
    let h = prefix_hashes(&t, 16, None)[0];
    run(
        &m,
        &mut st,
        1.0,
        vec![Event::BlockStored(stored(&[1], None, t))],
    );
    // Empty token_ids: a CPU copy of a known block; still on GPU, so the tier does not change.
    let mut copy = stored(&[1, 99], None, vec![]);
    copy.medium = Some("CPU".into());
    assert!(run(&m, &mut st, 1.0, vec![Event::BlockStored(copy)]).is_empty());
    // Leaving the GPU while the CPU copy remains → re-reported as T2, not evicted.
    let ops = run(
        &m,
        &mut st,
        2.0,
        vec![Event::BlockRemoved(removed(&[1], "GPU"))],
    );
    assert_eq!(
        ops,
        vec![add(2_000_000, vec![entry(h, 16, CacheTier::T2, "")])]
    );
    // Leaving the CPU too → evicted.
    let ops = run(
        &m,
        &mut st,
        3.0,
        vec![Event::BlockRemoved(removed(&[1], "CPU"))],
    );
    assert!(matches!(&ops[..], [Op::Evict { keys, .. }] if keys.len() == 1));
    // An offload copy of an evicted (but still chained) block brings it back as T3 (DISK).
    let mut disk = stored(&[1], None, vec![]);
    disk.medium = Some("DISK".into());
    let ops = run(&m, &mut st, 4.0, vec![Event::BlockStored(disk)]);
    assert_eq!(
        ops,
        vec![add(4_000_000, vec![entry(h, 16, CacheTier::T3, "")])]
    );
}

#[test]
fn offload_keeps_blocks_flag_rereports_t2() {
    let mut c = cfg();
    c.offload_keeps_blocks = true;
    let (m, mut st, _) = setup(c);
    let t = tokens(0..16);
    let h = prefix_hashes(&t, 16, None)[0];
    run(
        &m,
        &mut st,
        1.0,
        vec![Event::BlockStored(stored(&[1], None, t))],
    );
    let ops = run(
        &m,
        &mut st,
        2.0,
        vec![Event::BlockRemoved(removed(&[1], "GPU"))],
    );
    assert_eq!(
        ops,
        vec![add(2_000_000, vec![entry(h, 16, CacheTier::T2, "")])]
    );
}

#[test]
fn clear_forgets_the_reverse_map() {
    let (m, mut st, _) = setup(cfg());
    let all = tokens(0..32);
    run(
        &m,
        &mut st,
        1.0,
        vec![Event::BlockStored(stored(&[1], None, all[..16].to_vec()))],
    );
    let ops = run(&m, &mut st, 2.0, vec![Event::AllBlocksCleared]);
    assert_eq!(
        ops,
        vec![Op::Clear {
            replica: "r1".into(),
            ts_us: 2_000_000
        }]
    );
    assert_eq!(st.known_blocks(), 0);
    // The old parent is gone: the child roots at position 0.
    let ops = run(
        &m,
        &mut st,
        3.0,
        vec![Event::BlockStored(stored(
            &[2],
            Some(1),
            all[16..].to_vec(),
        ))],
    );
    let root = prefix_hashes(&all[16..], 16, None)[0];
    assert_eq!(
        ops,
        vec![add(3_000_000, vec![entry(root, 16, CacheTier::T1, "")])]
    );
}

#[test]
fn reverse_map_is_bounded() {
    let mut c = cfg();
    c.reverse_map_capacity = 2;
    let (m, mut st, _) = setup(c);
    let all = tokens(0..48);
    run(
        &m,
        &mut st,
        1.0,
        vec![Event::BlockStored(stored(&[1, 2, 3], None, all))],
    );
    assert_eq!(st.known_blocks(), 2);
    assert!(
        run(
            &m,
            &mut st,
            1.0,
            vec![Event::BlockRemoved(removed(&[1], "GPU"))]
        )
        .is_empty(),
        "oldest block forgotten"
    );
}

#[test]
fn extra_keys_and_other_groups_are_not_indexed() {
    let (m, mut st, metrics) = setup(cfg());
    let all = tokens(0..48);
    let mut e = stored(&[1, 2, 3], None, all);
    e.extra_keys = vec![None, Some(vec![ExtraKey::Multimodal]), None];
    let ops = run(&m, &mut st, 1.0, vec![Event::BlockStored(e)]);
    // Block 0 is plain; block 1 carries an image hash and block 2 descends from it.
    assert!(matches!(&ops[..], [Op::Add { entries, .. }] if entries.len() == 1));
    assert_eq!(metrics.dropped("multimodal"), 2);

    let mut g = stored(&[9], None, tokens(0..16));
    g.group_idx = Some(1);
    assert!(run(&m, &mut st, 1.0, vec![Event::BlockStored(g)]).is_empty());
    assert_eq!(metrics.dropped("other_kv_group"), 1);

    // The configured group itself is a sliding-window group: not indexed either.
    let mut w = stored(&[10], None, tokens(100..116));
    w.group_idx = Some(0);
    w.kv_cache_spec_kind = Some("sliding_window".into());
    assert!(run(&m, &mut st, 1.0, vec![Event::BlockStored(w)]).is_empty());
    assert_eq!(metrics.dropped("not_full_attention"), 1);
    let mut f = stored(&[11], None, tokens(200..216));
    f.kv_cache_spec_kind = Some("full_attention".into());
    assert_eq!(run(&m, &mut st, 1.0, vec![Event::BlockStored(f)]).len(), 1);
}

#[test]
fn timestamps_and_dp_replicas() {
    assert_eq!(ts_to_us(0.0), 0);
    assert_eq!(ts_to_us(-3.0), 0);
    assert_eq!(ts_to_us(1_789_095_808.83), 1_789_095_808_830_000);
    let mut c = cfg();
    c.replica_per_dp_rank = true;
    assert_eq!(PublisherState::new(&c, Some(2)).replica(), "r1-dp2");
    assert_eq!(PublisherState::new(&c, None).replica(), "r1");
    assert_eq!(PublisherState::new(&cfg(), Some(2)).replica(), "r1");
}

// ---- seq handling through the processor (no sockets: replay is not configured) ----

fn frames(seq: u64, events: Vec<Value>) -> Vec<Bytes> {
    let mut payload = Vec::new();
    rmpv::encode::write_value(
        &mut payload,
        &Value::Array(vec![Value::F64(10.0), Value::Array(events), Value::Nil]),
    )
    .unwrap();
    vec![
        Bytes::from_static(b"kv"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ]
}

fn stored_value(hash: u64, toks: std::ops::Range<u32>) -> Value {
    Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(hash)]),
        Value::Nil,
        Value::Array(toks.map(Value::from).collect()),
        Value::from(16),
    ])
}

#[tokio::test]
async fn processor_restart_clears_and_gap_is_counted() {
    let metrics = Metrics::new();
    let replicas = Arc::new(Mutex::new(BTreeSet::new()));
    let mut p = Processor::new(
        Mapper::new(cfg(), metrics.clone()),
        None,
        metrics.clone(),
        replicas.clone(),
    );
    let mut out = Vec::new();
    p.handle_frames(&frames(0, vec![stored_value(1, 0..16)]), &mut out)
        .await;
    p.handle_frames(&frames(1, vec![]), &mut out).await;
    assert!(matches!(&out[..], [Op::Add { .. }]));
    out.clear();

    // Gap: seq 2..4 missing, no replay endpoint → counted, the batch still applies.
    p.handle_frames(&frames(5, vec![stored_value(2, 16..32)]), &mut out)
        .await;
    assert_eq!(metrics.gaps.get(), 1);
    assert_eq!(metrics.missing_batches.get(), 3);
    assert!(matches!(&out[..], [Op::Add { .. }]));
    out.clear();

    // Restart: seq back to 0 → ALL_CLEARED for the replica before the new batch.
    p.handle_frames(&frames(0, vec![stored_value(3, 0..16)]), &mut out)
        .await;
    assert_eq!(metrics.restarts.get(), 1);
    assert!(
        matches!(&out[..], [Op::Clear { replica, ts_us: 10_000_000 }, Op::Add { .. }] if replica == "r1"),
        "{out:?}"
    );
    assert_eq!(replicas.lock().unwrap().iter().collect::<Vec<_>>(), ["r1"]);

    // Garbage is dropped and counted, not fatal.
    out.clear();
    p.handle_frames(&[Bytes::from_static(b"x")], &mut out).await;
    let mut bad = frames(1, vec![]);
    bad[2] = Bytes::from_static(b"\xc1");
    p.handle_frames(&bad, &mut out).await;
    assert!(out.is_empty());
    assert_eq!(metrics.dropped("bad_frames"), 1);
    assert_eq!(metrics.dropped("undecodable_batch"), 1);
}

/// Memory stays bounded when batches arrive from ever new data-parallel ranks.
#[tokio::test]
async fn unknown_dp_ranks_are_bounded() {
    let metrics = Metrics::new();
    let mut p = Processor::new(
        Mapper::new(cfg(), metrics.clone()),
        None,
        metrics.clone(),
        Arc::new(Mutex::new(BTreeSet::new())),
    )
    .with_max_publishers(2);
    let ranked = |rank: i64| {
        let mut payload = Vec::new();
        rmpv::encode::write_value(
            &mut payload,
            &Value::Array(vec![
                Value::F64(10.0),
                Value::Array(vec![stored_value(rank as u64, 0..16)]),
                Value::from(rank),
            ]),
        )
        .unwrap();
        vec![
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&0u64.to_be_bytes()),
            Bytes::from(payload),
        ]
    };
    let mut out = Vec::new();
    for rank in 0..1000 {
        p.handle_frames(&ranked(rank), &mut out).await;
    }
    assert_eq!(out.len(), 2, "only the first two ranks are tracked");
    assert_eq!(metrics.dropped("too_many_publishers"), 998);
    assert_eq!(metrics.reverse_map_entries.get(), 2);
    // A tracked rank keeps working.
    out.clear();
    p.handle_frames(&ranked(1), &mut out).await;
    assert_eq!(
        out.len(),
        2,
        "restart (seq 0 again) clears, then adds: {out:?}"
    );
}
