//! The inline LookupRoute path (src/grpc/unary.rs): a plain LookupRoute is answered in the
//! connection's own task, anything else is handed to the general path with the bytes already
//! read. Every request shape must get the same answer either way.

use std::time::Duration;

use bytes::Bytes;

use crate::support::*;

const LOOKUP_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/LookupRoute";
const STATE_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/GetCacheState";
/// Models whose partitions land on both cores at `--shards 2` (asserted below), so both the
/// inline answer and the call sent on to another core are exercised.
const MODELS: [&str; 6] = ["m0", "m1", "m2", "m6", "m7", "m8"];
const HASHES: [&[u8]; 4] = [b"b0", b"b1", b"b2", b"b3"];
const COUNTS: [i32; 4] = [16, 16, 16, 16];

/// Replicas r0..r2 hold 4, 3 and 2 blocks of the chain under every model.
async fn ingest_chains(srv: &Server) {
    let mut c = srv.client().await;
    let mut updates = Vec::new();
    for model in MODELS {
        for (r, held) in [("r0", 4), ("r1", 3), ("r2", 2)] {
            updates.push(chain_update(
                r,
                "t",
                model,
                "vllm",
                &HASHES[..held],
                &COUNTS[..held],
            ));
        }
    }
    assert!(report(&mut c, updates).await.accepted);
}

fn lookup_message(model: &str) -> Bytes {
    let req = chain_lookup("t", model, "vllm", &HASHES, &COUNTS);
    grpc_message(&prost::Message::encode_to_vec(&req))
}

/// The fields of an answer that do not depend on when it was computed.
fn stable(end: &RawEnd) -> (String, Vec<(String, i32, i32)>) {
    assert_eq!(end.grpc_status.as_deref(), Some("0"), "{end:?}");
    let messages = grpc_messages(&end.body);
    assert_eq!(messages.len(), 1, "{end:?}");
    let r: pb::LookupRouteResponse = prost::Message::decode(messages[0]).expect("a response");
    let scores = r
        .replica_scores
        .iter()
        .map(|s| (s.replica_id.clone(), s.matched_tokens, s.tier))
        .collect();
    (r.reason_code, scores)
}

/// The same lookup sent whole with END_STREAM (inline), split over two DATA frames, ended by
/// trailers, ended by an empty DATA frame, and with its DATA frame sent well after its HEADERS:
/// the same answer every time, for owners on this core and on the other one.
async fn every_request_shape_gets_the_same_answer(shards: usize) {
    if shards == 2 {
        let owners: Vec<usize> = MODELS
            .iter()
            .map(|m| inferencecache_partition::owner("t", m, 2))
            .collect();
        assert!(owners.contains(&0) && owners.contains(&1), "{owners:?}");
    }
    let srv = Server::start(shards, &[]);
    ingest_chains(&srv).await;
    let mut conn = raw_connection(srv.grpc_port).await;
    for model in MODELS {
        let msg = lookup_message(model);
        let whole = raw_call(&mut conn, LOOKUP_PATH)
            .await
            .finish_with(msg.clone())
            .await
            .expect("whole");
        let want = stable(&whole);
        assert_eq!(want.0, "PREFIX_MATCH", "{model}");
        assert_eq!(want.1[0], ("r0".to_string(), 64, 1), "{model}");

        let mut split = raw_call(&mut conn, LOOKUP_PATH).await;
        split.send(msg.slice(..7)).await.expect("first half");
        let split = split.finish_with(msg.slice(7..)).await.expect("split");
        assert_eq!(stable(&split), want, "split over two DATA frames, {model}");

        let mut trailed = raw_call(&mut conn, LOOKUP_PATH).await;
        trailed.send(msg.clone()).await.expect("message");
        let trailed = trailed
            .finish_with_trailers(http::HeaderMap::new())
            .await
            .expect("trailers");
        assert_eq!(stable(&trailed), want, "ended by trailers, {model}");

        let mut empty_end = raw_call(&mut conn, LOOKUP_PATH).await;
        empty_end.send(msg.clone()).await.expect("message");
        let empty_end = empty_end.finish(true).await.expect("empty end");
        assert_eq!(
            stable(&empty_end),
            want,
            "ended by an empty DATA frame, {model}"
        );

        let late = raw_call(&mut conn, LOOKUP_PATH).await;
        // The gap between HEADERS and DATA is the framing under test.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let data_sent = std::time::Instant::now();
        let late = late.finish_with(msg).await.expect("late");
        let since_data = data_sent.elapsed();
        assert_eq!(stable(&late), want, "DATA long after HEADERS, {model}");
        // lookup_latency_us counts from handler entry (the message is in), not from HEADERS:
        // it fits in what the client waited after sending the DATA.
        let r: pb::LookupRouteResponse =
            prost::Message::decode(grpc_messages(&late.body)[0]).expect("a response");
        assert!(
            r.lookup_latency_us as u128 <= since_data.as_micros(),
            "{} us, {since_data:?} after the DATA",
            r.lookup_latency_us
        );
    }
    // Whole and late bodies are answered inline when this core owns the partition; trailed ones
    // are handed on. A split body and one ended by an empty frame go either way, by arrival
    // timing (inline when the end of the stream is in the same read as the message).
    let text = metrics_text(&srv);
    let count = |outcome: &str| {
        let series = format!("inferencecache_grpc_inline_lookups_total{{outcome=\"{outcome}\"}}");
        metric_value(&text, &series).unwrap_or(0.0) as usize
    };
    let (answered, awaited, handed_on) = (count("answered"), count("awaited"), count("handed_on"));
    assert_eq!(answered + awaited + handed_on, 5 * MODELS.len(), "{text}");
    assert!(
        handed_on >= MODELS.len(),
        "{answered} / {awaited} / {handed_on}"
    );
    // Another core's partition is decided in the turn and awaited, never handed on.
    let min_taken = 2 * MODELS.len();
    assert!(
        answered + awaited >= min_taken,
        "{answered} / {awaited} / {handed_on}"
    );
    if shards == 1 {
        assert_eq!(awaited, 0, "one core owns every partition");
    }
}
shards_1_and_2!(every_request_shape_gets_the_same_answer);

/// What the general path answers stays the answer: a compressed message (no compression is
/// enabled), an empty body, and a message that is not a LookupRouteRequest.
async fn unusual_requests_keep_the_general_paths_status(shards: usize) {
    let srv = Server::start(shards, &[]);
    let mut conn = raw_connection(srv.grpc_port).await;
    let msg = lookup_message("m0");

    let mut compressed = msg.to_vec();
    compressed[0] = 1;
    let end = raw_call_with(&mut conn, LOOKUP_PATH, &[("grpc-encoding", "gzip")])
        .await
        .finish_with(compressed.clone().into())
        .await
        .expect("compressed");
    assert_eq!(end.grpc_status.as_deref(), Some("12"), "{end:?}");
    let end = raw_call(&mut conn, LOOKUP_PATH)
        .await
        .finish_with(compressed.into())
        .await
        .expect("flagged without grpc-encoding");
    assert_ne!(end.grpc_status.as_deref(), Some("0"), "{end:?}");

    let end = raw_call(&mut conn, LOOKUP_PATH)
        .await
        .finish(true)
        .await
        .expect("empty body");
    assert_ne!(end.grpc_status.as_deref(), Some("0"), "{end:?}");

    // Field 1 (model_id) declared as a varint where a string is expected.
    let end = raw_call(&mut conn, LOOKUP_PATH)
        .await
        .finish_with(grpc_message(&[0x08, 0x01]))
        .await
        .expect("bad message");
    assert_eq!(end.grpc_status.as_deref(), Some("13"), "{end:?}");

    // The connection still answers plain lookups.
    let ok = raw_call(&mut conn, LOOKUP_PATH)
        .await
        .finish_with(msg)
        .await
        .expect("plain");
    assert_eq!(stable(&ok).0, "NO_HINT", "an empty index");
}
shards_1_and_2!(unusual_requests_keep_the_general_paths_status);

/// Many lookups in flight on one connection, interleaved with general-path calls and with
/// streams the client cancels while the server waits for their message: every completed call
/// gets its own answer.
async fn pipelined_lookups_are_each_answered(shards: usize) {
    const CALLS: usize = 96;
    let srv = Server::start(shards, &[]);
    ingest_chains(&srv).await;
    let mut conn = raw_connection(srv.grpc_port).await;
    let mut pending = Vec::new();
    for i in 0..CALLS {
        let model = MODELS[i % MODELS.len()];
        if i % 8 == 3 {
            raw_call(&mut conn, LOOKUP_PATH).await.cancel();
        }
        let path = if i % 8 == 5 { STATE_PATH } else { LOOKUP_PATH };
        let msg = if path == STATE_PATH {
            let req = pb::GetCacheStateRequest {
                model_id: model.into(),
                tenant_id: "t".into(),
            };
            grpc_message(&prost::Message::encode_to_vec(&req))
        } else {
            lookup_message(model)
        };
        let call = raw_call(&mut conn, path).await;
        pending.push((path, model, tokio::spawn(call.finish_with(msg))));
    }
    for (path, model, call) in pending {
        let end = tokio::time::timeout(Duration::from_secs(20), call)
            .await
            .expect("answered in time")
            .expect("task")
            .expect("answer");
        if path == LOOKUP_PATH {
            let (reason, scores) = stable(&end);
            assert_eq!(reason, "PREFIX_MATCH", "{model}");
            // The default 64-token matched floor keeps only r0's full-chain match.
            assert_eq!(scores, [("r0".to_string(), 64, 1)], "{model}");
        } else {
            assert_eq!(end.grpc_status.as_deref(), Some("0"), "{end:?}");
            let m = grpc_messages(&end.body);
            let state: pb::GetCacheStateResponse = prost::Message::decode(m[0]).unwrap();
            let want = srv
                .client()
                .await
                .get_cache_state(pb::GetCacheStateRequest {
                    model_id: model.into(),
                    tenant_id: "t".into(),
                })
                .await
                .expect("GetCacheState")
                .into_inner();
            assert_eq!(state, want, "{model}");
        }
    }
}
shards_1_and_2!(pipelined_lookups_are_each_answered);

/// While a core spins (`--busy-poll-us`), its quiet connections are watched instead of polled
/// through io_uring (src/runtime/watch.rs): calls one after another on one connection are
/// noticed by the watch, a connection quiet for longer than the spin is handed back to io_uring
/// and still answered, and every answer is the same as without the watch.
async fn quiet_connections_are_watched_while_the_core_spins(shards: usize) {
    let srv = Server::start(shards, &["--busy-poll-us", "1000"]);
    ingest_chains(&srv).await;
    let mut c = srv.client().await;
    let ask = |model: &str| chain_lookup("t", model, "vllm", &HASHES, &COUNTS);
    for round in 0..3 {
        for i in 0..40 {
            let r = c.lookup_route(ask(MODELS[i % MODELS.len()])).await;
            let r = r.expect("answered").into_inner();
            assert_eq!(r.reason_code, "PREFIX_MATCH", "round {round} call {i}");
            assert_eq!(r.replica_scores[0].replica_id, "r0");
        }
        // Longer than the spin: the core releases the connection to io_uring and parks (the
        // idle gap is the behaviour under test).
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = metrics_text(&srv);
    let count = |outcome: &str| {
        let series =
            format!("inferencecache_spin_watch_connections_total{{outcome=\"{outcome}\"}}");
        metric_value(&text, &series).unwrap_or(0.0)
    };
    assert!(count("woken") >= 1.0, "no call noticed by the watch");
    assert!(
        count("released") >= 1.0,
        "no connection released after the spin"
    );
}
shards_1_and_2!(quiet_connections_are_watched_while_the_core_spins);
