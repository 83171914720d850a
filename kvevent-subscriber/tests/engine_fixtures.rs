//! Byte-exact messages from the engines' own publishers (vLLM 0.34.0 and 0.9.0, SGLang 0.5.23; see
//! tests/data/engines/gen_fixtures.py) through the processor, checked operation by operation
//! against docs/KV-EVENTS.md §5: LoRA by number and by name, salts, multimodal blocks, offload
//! media, hybrid groups, 32-byte and signed hashes, AllBlocksCleared and the dp rank.
//! The same files drive the real server in the root crate's tests/e2e/kvevents.rs.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use inferencecache_fingerprint::prefix_hashes;
use inferencecache_proto::v1alpha1::{CacheTier, PrefixEntry};
use kvevent_subscriber::ingest::Processor;
use kvevent_subscriber::mapping::{Mapper, MappingConfig, Op};
use kvevent_subscriber::metrics::Metrics;

/// Parses a `.frames` fixture: `[topic, seq, payload]` per message.
pub fn parse_frames(text: &str) -> Vec<Vec<Bytes>> {
    fn unhex(s: &str) -> Bytes {
        assert!(s.len().is_multiple_of(2), "odd hex length");
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect::<Vec<u8>>()
            .into()
    }
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split(' ').map(unhex).collect())
        .collect()
}

const VLLM: &str = include_str!("data/engines/vllm-0.34.0.frames");
const SGLANG: &str = include_str!("data/engines/sglang-0.5.23.frames");

fn toks(start: u32, blocks: u32) -> Vec<u32> {
    (start..start + blocks * 16).collect()
}

fn entries(start: u32, blocks: u32, tier: CacheTier, adapter: &str) -> Vec<PrefixEntry> {
    prefix_hashes(&toks(start, blocks), 16, None)
        .into_iter()
        .enumerate()
        .map(|(i, h)| entry(h, 16 * (i as i32 + 1), tier, adapter))
        .collect()
}

fn entry(h: u64, count: i32, tier: CacheTier, adapter: &str) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: h.to_be_bytes().to_vec(),
        token_count: count,
        block_hashes: vec![],
        block_token_counts: vec![],
        tier: tier as i32,
        adapter_id: adapter.into(),
    }
}

fn processor(replica_per_dp_rank: bool) -> (Processor, Arc<Metrics>) {
    let metrics = Metrics::new();
    let cfg = MappingConfig {
        replica_id: "r1".into(),
        replica_per_dp_rank,
        adapters: HashMap::from([(1, "sql-lora".to_string())]),
        use_lora_name: true,
        block_size_override: None,
        offload_keeps_blocks: false,
        kv_cache_group: 0,
        reverse_map_capacity: 1000,
    };
    let p = Processor::new(
        Mapper::new(cfg, metrics.clone()),
        None,
        metrics.clone(),
        Arc::new(Mutex::new(BTreeSet::new())),
    );
    (p, metrics)
}

fn add(replica: &str, ts: i64, entries: Vec<PrefixEntry>) -> Op {
    Op::Add {
        replica: replica.into(),
        ts_us: ts * 1_000_000,
        entries,
    }
}

#[tokio::test]
async fn vllm_0_34_messages_map_by_the_written_rule() {
    let frames = parse_frames(VLLM);
    assert_eq!(frames.len(), 12);
    let (mut p, metrics) = processor(false);
    let mut ops: Vec<Vec<Op>> = Vec::new();
    for f in &frames {
        let mut out = Vec::new();
        p.handle_frames(f, &mut out).await;
        ops.push(out);
    }
    let t0 = 1_789_095_808;
    let base = entries(1000, 4, CacheTier::T1, "");
    let lora = entries(2000, 4, CacheTier::T1, "sql-lora");
    let lora_t2: Vec<PrefixEntry> = entries(2000, 4, CacheTier::T2, "sql-lora")[2..].to_vec();
    let mm = entries(5000, 1, CacheTier::T1, "");
    let h32 = entries(7000, 4, CacheTier::T1, "");
    let want: Vec<Vec<Op>> = vec![
        // 0: base blocks, default partition.
        vec![add("r1", t0, base.clone())],
        // 1: LoRA number 1 mapped to sql-lora; the name in extra_keys is the adapter, not a salt.
        vec![add("r1", t0 + 1, lora)],
        // 2: unmapped number 7, partition from lora_name.
        vec![add(
            "r1",
            t0 + 2,
            entries(2500, 4, CacheTier::T1, "chat-lora"),
        )],
        // 3, 4: salted (alone, and after the LoRA name): nothing.
        vec![],
        vec![],
        // 5: block 0 is plain; the multimodal block 1 and its descendants are not indexed.
        vec![add("r1", t0 + 5, mm)],
        // 6: sliding-window group: ignored, including its removal of the base blocks.
        vec![],
        // 7: CPU copies keep the LoRA tail after the GPU removal: re-reported as T2.
        vec![add("r1", t0 + 7, lora_t2)],
        // 8, 9: 32-byte hashes, the second event chained on the first's last block.
        vec![add("r1", t0 + 8, h32[..2].to_vec())],
        vec![add("r1", t0 + 9, h32[2..].to_vec())],
        // 10: GPU removal of the base prompt's last block (group 0).
        vec![Op::Evict {
            replica: "r1".into(),
            ts_us: (t0 + 10) * 1_000_000,
            keys: vec![(base[3].prefix_hash.clone(), String::new())],
        }],
        vec![Op::Clear {
            replica: "r1".into(),
            ts_us: (t0 + 11) * 1_000_000,
        }],
    ];
    for (i, (got, want)) in ops.iter().zip(&want).enumerate() {
        assert_eq!(got, want, "message {i}");
    }
    assert_eq!(metrics.dropped("cache_salt"), 8);
    assert_eq!(metrics.dropped("multimodal"), 3);
    assert_eq!(metrics.dropped("other_kv_group"), 6);
    assert_eq!(metrics.dropped("unmapped_adapter"), 0);
    assert_eq!(metrics.dropped("extra_keys"), 0);
}

#[tokio::test]
async fn sglang_0_5_23_messages_map_by_the_written_rule() {
    let frames = parse_frames(SGLANG);
    assert_eq!(frames.len(), 6);
    let (mut p, metrics) = processor(true);
    let mut ops: Vec<Vec<Op>> = Vec::new();
    for f in &frames {
        let mut out = Vec::new();
        p.handle_frames(f, &mut out).await;
        ops.push(out);
    }
    let t0 = 1_789_095_900;
    let r = "r1-dp1"; // attn_dp_rank 1
    let base = entries(11000, 4, CacheTier::T1, "");
    let base_t2 = entries(11000, 4, CacheTier::T2, "");
    let want: Vec<Vec<Op>> = vec![
        vec![add(r, t0, base.clone())],
        // lora_id null + lora_name: the adapter's partition, never the base model's.
        vec![add(r, t0 + 1, entries(12000, 4, CacheTier::T1, "sql-lora"))],
        // cache_salt: not indexed.
        vec![],
        // CPU_PINNED copy (GPU still holds it: T1), then the GPU removal: T2.
        vec![
            add(r, t0 + 3, base[2..].to_vec()),
            add(r, t0 + 3, base_t2[2..].to_vec()),
        ],
        // DISK only: T3.
        vec![add(r, t0 + 4, entries(14000, 4, CacheTier::T3, ""))],
        vec![Op::Clear {
            replica: r.into(),
            ts_us: (t0 + 5) * 1_000_000,
        }],
    ];
    for (i, (got, want)) in ops.iter().zip(&want).enumerate() {
        assert_eq!(got, want, "message {i}");
    }
    assert_eq!(metrics.dropped("cache_salt"), 4);
    assert_eq!(metrics.dropped("unmapped_adapter"), 0);
}

/// With `--use-lora-name=false` and no number mapping, adapter KV is dropped, never filed
/// under the base model (SGLang sends `lora_id: null`).
#[tokio::test]
async fn adapter_without_a_resolvable_name_is_dropped_not_filed_as_base() {
    let metrics = Metrics::new();
    let cfg = MappingConfig {
        replica_id: "r1".into(),
        replica_per_dp_rank: false,
        adapters: HashMap::new(),
        use_lora_name: false,
        block_size_override: None,
        offload_keeps_blocks: false,
        kv_cache_group: 0,
        reverse_map_capacity: 1000,
    };
    let mut p = Processor::new(
        Mapper::new(cfg, metrics.clone()),
        None,
        metrics.clone(),
        Arc::new(Mutex::new(BTreeSet::new())),
    );
    let frames = parse_frames(SGLANG);
    let mut out = Vec::new();
    p.handle_frames(&frames[1], &mut out).await;
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(metrics.dropped("unmapped_adapter"), 4);
}

const VLLM_LEGACY: &str = include_str!("data/engines/vllm-0.9.0.frames");

/// vLLM 0.9.0's legacy form: `[ts, events]` batches of positional `["BlockStored", hashes,
/// parent, tokens, block_size, lora_id]` events, no dp rank, no medium, no name.
#[tokio::test]
async fn vllm_0_9_legacy_array_messages_map_by_the_written_rule() {
    let frames = parse_frames(VLLM_LEGACY);
    assert_eq!(frames.len(), 5);
    let (mut p, metrics) = processor(false);
    let mut ops: Vec<Vec<Op>> = Vec::new();
    for f in &frames {
        let mut out = Vec::new();
        p.handle_frames(f, &mut out).await;
        ops.push(out);
    }
    let t0 = 1_789_095_700;
    let five = entries(1000, 5, CacheTier::T1, "");
    let want: Vec<Vec<Op>> = vec![
        vec![add("r1", t0, five[..4].to_vec())],
        // Chained through the parent given as the uint64 ≥ 2^63.
        vec![add("r1", t0 + 1, five[4..].to_vec())],
        // LoRA by number only, mapped by --lora-adapter-names.
        vec![add(
            "r1",
            t0 + 2,
            entries(2000, 4, CacheTier::T1, "sql-lora"),
        )],
        vec![Op::Evict {
            replica: "r1".into(),
            ts_us: (t0 + 3) * 1_000_000,
            keys: vec![(five[4].prefix_hash.clone(), String::new())],
        }],
        vec![Op::Clear {
            replica: "r1".into(),
            ts_us: (t0 + 4) * 1_000_000,
        }],
    ];
    for (i, (got, want)) in ops.iter().zip(&want).enumerate() {
        assert_eq!(got, want, "message {i}");
    }
    assert_eq!(metrics.dropped("invalid_event"), 0);
}
