//! Byte-level payload fixtures in every form docs/KV-EVENTS.md §1–§2 allows, built with the rmpv
//! encoder plus one hand-written hex fixture, decoded by the production decoder.

use bytes::Bytes;
use kvevent_subscriber::decode::{
    BlockRemoved, BlockStored, EngineHash, Event, decode_batch, split_frames,
};
use rmpv::Value;

/// A hash ≥ 2^63: arrives as uint64 or as the negative int64 with the same bits.
const BIG: u64 = 15_760_518_052_499_183_552;
const BIG_AS_I64: i64 = -2_686_226_021_210_368_064;

fn enc(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn ints(xs: impl IntoIterator<Item = u32>) -> Value {
    Value::Array(xs.into_iter().map(Value::from).collect())
}

/// The vLLM example of docs/KV-EVENTS.md §2, map form.
fn vllm_stored_map() -> Value {
    map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(BIG)])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(1..=16)),
        ("block_size", Value::from(16)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
        ("extra_keys", Value::Array(vec![Value::Nil])),
        ("group_idx", Value::from(0)),
        ("kv_cache_spec_kind", s("full_attention")),
    ])
}

fn expected_stored() -> BlockStored {
    BlockStored {
        block_hashes: vec![EngineHash::Int(BIG)],
        parent_block_hash: None,
        token_ids: (1..=16).collect(),
        block_size: Some(16),
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: vec![None],
        group_idx: Some(0),
        cache_salt: None,
        kv_cache_spec_kind: Some("full_attention".into()),
    }
}

#[test]
fn array_batch_with_map_events() {
    let payload = enc(&Value::Array(vec![
        Value::F64(1_789_095_808.83),
        Value::Array(vec![vllm_stored_map()]),
        Value::from(0),
    ]));
    let b = decode_batch(&payload).unwrap();
    assert_eq!(b.ts, 1_789_095_808.83);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![Event::BlockStored(expected_stored())]);
}

#[test]
fn array_events_in_declaration_order_with_negative_int64_hash() {
    let ev = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(BIG_AS_I64)]),
        Value::Nil,
        ints(1..=16),
        Value::from(16),
        Value::Nil,
        s("GPU"),
        Value::Nil,
        Value::Array(vec![Value::Nil]),
        Value::from(0),
        s("full_attention"),
        Value::Nil,
    ]);
    let bytes = enc(&Value::Array(vec![
        Value::F64(1_789_095_808.83),
        Value::Array(vec![ev]),
        Value::Nil,
    ]));
    // The int64 really is on the wire as int64 (0xd3), not uint64.
    assert!(
        bytes
            .windows(9)
            .any(|w| w[0] == 0xd3 && w[1..] == BIG.to_be_bytes())
    );
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.dp_rank, None);
    assert_eq!(b.events, vec![Event::BlockStored(expected_stored())]);
}

#[test]
fn legacy_array_with_missing_trailing_fields() {
    let ev = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(7u64), Value::from(8u64)]),
        Value::from(6u64),
        ints(0..8),
        Value::from(4),
    ]);
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(7u64)]),
    ]);
    let b = decode_batch(&enc(&Value::Array(vec![
        Value::F64(2.0),
        Value::Array(vec![ev, removed, Value::Array(vec![s("AllBlocksCleared")])]),
    ])))
    .unwrap();
    assert_eq!(b.dp_rank, None, "absent dp_rank");
    assert_eq!(
        b.events,
        vec![
            Event::BlockStored(BlockStored {
                block_hashes: vec![EngineHash::Int(7), EngineHash::Int(8)],
                parent_block_hash: Some(EngineHash::Int(6)),
                token_ids: (0..8).collect(),
                block_size: Some(4),
                ..Default::default()
            }),
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash::Int(7)],
                medium: None,
                group_idx: None,
            }),
            Event::AllBlocksCleared,
        ]
    );
}

#[test]
fn bytes_hashes_and_empty_token_ids() {
    let h = vec![0xABu8; 32];
    let p = vec![0x01u8; 32];
    let ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::Binary(h.clone())])),
        ("parent_block_hash", Value::Binary(p.clone())),
        ("token_ids", Value::Array(vec![])),
        ("block_size", Value::from(16)),
        ("medium", s("CPU")),
    ]);
    let b = decode_batch(&enc(&Value::Array(vec![
        Value::F64(3.0),
        Value::Array(vec![ev]),
    ])))
    .unwrap();
    let Event::BlockStored(e) = &b.events[0] else {
        panic!("{:?}", b.events)
    };
    assert_eq!(e.block_hashes, vec![EngineHash::Bytes(h.into())]);
    assert_eq!(e.parent_block_hash, Some(EngineHash::Bytes(p.into())));
    assert!(e.token_ids.is_empty());
    assert_eq!(e.medium.as_deref(), Some("CPU"));
}

#[test]
fn unknown_tags_and_fields_are_ignored() {
    let mut stored = vllm_stored_map();
    if let Value::Map(m) = &mut stored {
        m.push((s("locality"), s("local")));
        m.push((s("some_future_field"), Value::Array(vec![Value::from(1)])));
    }
    let removed = map(vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", Value::Array(vec![Value::from(BIG)])),
        ("medium", s("GPU")),
        ("group_idx", Value::Nil),
        ("locality", s("local")),
        ("remaining_copy_counts", Value::Array(vec![Value::from(0)])),
    ]);
    let b = decode_batch(&enc(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![
            map(vec![("type", s("SomeNewEvent")), ("x", Value::from(1))]),
            Value::Array(vec![s("AnotherNewEvent"), Value::from(3)]),
            stored,
            removed,
        ]),
        Value::from(2),
    ])))
    .unwrap();
    assert_eq!(
        b.events,
        vec![
            Event::Unknown,
            Event::Unknown,
            Event::BlockStored(expected_stored()),
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash::Int(BIG)],
                medium: Some("GPU".into()),
                group_idx: None,
            }),
        ]
    );
}

#[test]
fn map_batches_with_either_dp_rank_name() {
    for key in ["data_parallel_rank", "attn_dp_rank"] {
        let b = decode_batch(&enc(&map(vec![
            ("ts", Value::F64(5.5)),
            ("events", Value::Array(vec![vllm_stored_map()])),
            (key, Value::from(3)),
        ])))
        .unwrap();
        assert_eq!(b.ts, 5.5);
        assert_eq!(b.dp_rank, Some(3), "{key}");
        assert_eq!(b.events.len(), 1);
    }
}

#[test]
fn invalid_event_does_not_spoil_the_batch() {
    let bad = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", s("not-a-list")),
    ]);
    let bad_token = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(1)])),
        ("token_ids", Value::Array(vec![Value::from(-1)])),
    ]);
    let b = decode_batch(&enc(&Value::Array(vec![
        Value::from(0),
        Value::Array(vec![
            bad,
            bad_token,
            Value::Array(vec![s("AllBlocksCleared")]),
        ]),
    ])))
    .unwrap();
    assert!(matches!(b.events[0], Event::Invalid(_)));
    assert!(matches!(b.events[1], Event::Invalid(_)));
    assert_eq!(b.events[2], Event::AllBlocksCleared);
    assert!(
        decode_batch(b"\xc1").is_err(),
        "reserved byte is not msgpack"
    );
    assert!(decode_batch(&enc(&s("x"))).is_err());
}

/// Hand-written bytes (no encoder involved), docs/KV-EVENTS.md layouts.
#[test]
fn hand_written_hex_fixture() {
    let hex = concat!(
        "93",                                   // batch array(3)
        "cb3ff8000000000000",                   // ts = 1.5 (float64)
        "93",                                   // events array(3)
        "83",                                   //  map(3): BlockStored, other fields omitted
        "a474797065",                           //   "type"
        "ab426c6f636b53746f726564",             //   "BlockStored"
        "ac626c6f636b5f686173686573",           //   "block_hashes"
        "91cfdab89baa7b5857c0",                 //   [uint64 15760518052499183552]
        "a9746f6b656e5f696473",                 //   "token_ids"
        "920102",                               //   [1, 2]
        "93",                                   //  array(3): legacy BlockRemoved
        "ac426c6f636b52656d6f766564",           //   "BlockRemoved"
        "91d3dab89baa7b5857c0",                 //   [int64 -2686226021210368064]
        "a3435055",                             //   "CPU"
        "91b0416c6c426c6f636b73436c6561726564", // ["AllBlocksCleared"]
        "01",                                   // dp_rank 1
    );
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let b = decode_batch(&bytes).unwrap();
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.dp_rank, Some(1));
    assert_eq!(
        b.events,
        vec![
            Event::BlockStored(BlockStored {
                block_hashes: vec![EngineHash::Int(BIG)],
                token_ids: vec![1, 2],
                ..Default::default()
            }),
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash::Int(BIG)],
                medium: Some("CPU".into()),
                group_idx: None,
            }),
            Event::AllBlocksCleared,
        ]
    );
}

#[test]
fn frames_live_replay_and_end_marker() {
    let payload = Bytes::from_static(b"\x90");
    let live = split_frames(&[
        Bytes::from_static(b"kv-events"),
        Bytes::copy_from_slice(&7u64.to_be_bytes()),
        payload.clone(),
    ])
    .unwrap();
    assert_eq!(&live.topic[..], b"kv-events");
    assert_eq!(live.seq, Some(7));
    assert_eq!(live.payload, payload);

    let old_replay =
        split_frames(&[Bytes::copy_from_slice(&9u64.to_be_bytes()), payload.clone()]).unwrap();
    assert_eq!(old_replay.seq, Some(9));
    assert!(old_replay.topic.is_empty());

    let delimited = split_frames(&[
        Bytes::new(),
        Bytes::from_static(b"t"),
        Bytes::copy_from_slice(&(1u64 << 63).to_be_bytes()),
        payload.clone(),
    ])
    .unwrap();
    assert_eq!(delimited.seq, Some(1u64 << 63));
    assert_eq!(&delimited.topic[..], b"t");

    let end = split_frames(&[Bytes::from_static(&[0xFF; 8]), Bytes::new()]).unwrap();
    assert_eq!(end.seq, None);

    assert!(split_frames(std::slice::from_ref(&payload)).is_err());
    assert!(split_frames(&[Bytes::from_static(b"short"), payload]).is_err());
}
