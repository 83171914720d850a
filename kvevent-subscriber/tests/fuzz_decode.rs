//! Fuzzing of the engine-event decoder (the bytes a ZMQ publisher sends) with proptest:
//! arbitrary and mutated payloads must be refused cleanly, never panic or allocate without
//! bound. CI runs the default case count; a longer run is
//! `PROPTEST_CASES=1000000 cargo test -p kvevent-subscriber --test fuzz_decode`.

use bytes::Bytes;
use kvevent_subscriber::decode::{decode_batch, split_frames};
use proptest::prelude::*;
use rmpv::Value;

/// A valid batch in both event forms, to mutate from.
fn seed() -> &'static [u8] {
    let stored_array = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(7u64), Value::from(-3i64)]),
        Value::Nil,
        Value::Array((1..=16).map(Value::from).collect()),
        Value::from(16),
        Value::Nil,
        Value::from("GPU"),
    ]);
    let removed_map = Value::Map(vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (
            Value::from("block_hashes"),
            Value::Array(vec![Value::from(7u64)]),
        ),
    ]);
    let cleared = Value::Array(vec![Value::from("AllBlocksCleared")]);
    let batch = Value::Array(vec![
        Value::from(1.5f64),
        Value::Array(vec![stored_array, removed_map, cleared]),
        Value::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("encode");
    Box::leak(out.into_boxed_slice())
}

fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let edits = prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8);
    edits.prop_map(|edits| {
        let mut b = seed().to_vec();
        for (at, byte, kind) in edits {
            let at = at % (b.len() + 1);
            match kind {
                0 if at < b.len() => b[at] = byte,
                1 => b.insert(at, byte),
                _ => b.truncate(at),
            }
        }
        b
    })
}

proptest! {
    #[test]
    fn fuzz_batch_payloads(
        payload in prop_oneof![prop::collection::vec(any::<u8>(), 0..512), mutated()]
    ) {
        let _ = decode_batch(&payload);
    }

    #[test]
    fn fuzz_multipart_frames(
        frames in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..5)
    ) {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        let _ = split_frames(&frames);
    }
}

#[test]
fn the_seed_decodes() {
    let b = decode_batch(seed()).expect("seed is valid");
    assert_eq!(b.events.len(), 3);
}
