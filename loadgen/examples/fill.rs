//! Fills a server with a known number of storage entries, or records the answers to a fixed
//! sample of lookups over them (for the warm-restart measurements in perf/RESULTS.md):
//!
//! ```sh
//! fill --addr http://127.0.0.1:9090 --entries 1000000            # ingest, prints the time taken
//! fill --addr http://127.0.0.1:9090 --entries 1000000 --sample 1000 > answers.txt
//! fill --addr http://127.0.0.1:9090 --entries 1000000 --timestamp-us 1700000000000000  # fixed stamp
//! ```
//!
//! Entries are 64-block chains (8-byte hashes, 16 tokens per block) spread over 8 tenants × 8
//! models × 4 replicas, stamped ahead of the wall clock (see `fill`); `--sample` prints LookupRoute (latency
//! zeroed) and GetCacheState answers, one per line, so two runs compare with `cmp`.

use std::time::Instant;

use inferencecache_proto::v1alpha1 as pb;
use pb::inference_cache_client::InferenceCacheClient;
use tonic::transport::Channel;

const BLOCKS: usize = 64;

struct Args {
    addr: String,
    entries: usize,
    sample: usize,
    /// Every update's `timestamp_us` (default: ten minutes ahead of the wall clock).
    timestamp_us: Option<i64>,
}

fn args() -> Args {
    let mut a = Args {
        addr: "http://127.0.0.1:9090".into(),
        entries: 1_000_000,
        sample: 0,
        timestamp_us: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().expect("flag value");
        match flag.as_str() {
            "--addr" => a.addr = v,
            "--entries" => a.entries = v.parse().expect("--entries"),
            "--sample" => a.sample = v.parse().expect("--sample"),
            "--timestamp-us" => a.timestamp_us = Some(v.parse().expect("--timestamp-us")),
            _ => panic!("unknown flag {flag}"),
        }
    }
    a
}

fn hash(c: usize, b: usize) -> Vec<u8> {
    ((c as u64) << 16 | b as u64).to_be_bytes().to_vec()
}

fn scope(c: usize) -> (String, String) {
    (format!("t{}", c % 8), format!("m{}", (c / 8) % 8))
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as i64
}

async fn send(c: &mut InferenceCacheClient<Channel>, batch: Vec<pb::CacheStateUpdate>) {
    let ack = c
        .report_cache_state(tokio_stream::iter(batch))
        .await
        .expect("ReportCacheState")
        .into_inner();
    assert!(ack.accepted, "{ack:?}");
}

async fn fill(addr: String, chains: usize, stamp: Option<i64>) {
    const STREAMS: usize = 4;
    // Ten minutes ahead (the server clamps it to its skew bound, 2 min): scores keep freshness
    // 1 for the whole measurement, so a sample taken later compares exactly.
    let ts = stamp.unwrap_or_else(|| now_us() + 600_000_000);
    let mut tasks = Vec::new();
    for k in 0..STREAMS {
        let addr = addr.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = InferenceCacheClient::new(
                Channel::from_shared(addr)
                    .unwrap()
                    .connect()
                    .await
                    .expect("connect"),
            )
            .max_decoding_message_size(64 << 20);
            let mut batch = Vec::new();
            for ch in (k..chains).step_by(STREAMS) {
                let (t, m) = scope(ch);
                batch.push(pb::CacheStateUpdate {
                    replica_id: format!("r{}", ch % 4),
                    tenant_id: t,
                    model_id: m,
                    hash_scheme: "vllm".into(),
                    timestamp_us: ts,
                    prefixes: vec![pb::PrefixEntry {
                        block_hashes: (0..BLOCKS).map(|b| hash(ch, b)).collect(),
                        block_token_counts: vec![16; BLOCKS],
                        ..Default::default()
                    }],
                    ..Default::default()
                });
                if batch.len() == 512 {
                    send(&mut c, std::mem::take(&mut batch)).await;
                }
            }
            if !batch.is_empty() {
                send(&mut c, batch).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("stream task");
    }
}

async fn sample(addr: String, chains: usize, n: usize) {
    let mut c = InferenceCacheClient::new(
        Channel::from_shared(addr)
            .unwrap()
            .connect()
            .await
            .expect("connect"),
    );
    for i in 0..n {
        let ch = (i * 7919) % chains;
        let (t, m) = scope(ch);
        let len = 4 + i % (BLOCKS - 3);
        let req = pb::LookupRouteRequest {
            tenant_id: t,
            model_id: m,
            hash_scheme: "vllm".into(),
            block_hashes: (0..len).map(|b| hash(ch, b).into()).collect(),
            block_token_counts: vec![16; len],
            ..Default::default()
        };
        let mut r = c.lookup_route(req).await.expect("LookupRoute").into_inner();
        r.lookup_latency_us = 0;
        println!("{r:?}");
    }
    for ch in 0..64 {
        let (t, m) = scope(ch);
        let mut s = c
            .get_cache_state(pb::GetCacheStateRequest {
                tenant_id: t,
                model_id: m,
            })
            .await
            .expect("GetCacheState")
            .into_inner();
        s.replicas.sort_by(|a, b| a.replica_id.cmp(&b.replica_id));
        println!("{s:?}");
    }
}

#[tokio::main]
async fn main() {
    let a = args();
    let chains = a.entries / BLOCKS;
    if a.sample > 0 {
        sample(a.addr, chains, a.sample).await;
        return;
    }
    let t = Instant::now();
    fill(a.addr, chains, a.timestamp_us).await;
    eprintln!(
        "ingested {} entries in {:.2} s",
        chains * BLOCKS,
        t.elapsed().as_secs_f64()
    );
}
