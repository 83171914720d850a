//! The maintenance lane (src/runtime/lane.rs: at most one maintenance piece per reactor turn)
//! must not starve maintenance: under a flood of lookups and of large ingests, each of which
//! keeps its core busy every turn, the TTL sweep still completes its passes and the ingests
//! (their parts and cap evictions, pieces too) are still acknowledged.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::*;

/// `prefixes` distinct legacy prefixes of `tenant`, numbered from `first`.
fn update(tenant: &str, first: u64, prefixes: u64) -> pb::CacheStateUpdate {
    let mut u = legacy_update("r1", tenant, "m", "vllm", b"x", 16);
    u.prefixes = (first..first + prefixes)
        .map(|i| pb::PrefixEntry {
            prefix_hash: i.to_be_bytes().to_vec(),
            token_count: 16,
            ..Default::default()
        })
        .collect();
    u.timestamp_us = now_us();
    u
}

/// Back-to-back lookups on their own connection until `stop`; returns how many were answered.
async fn flood_lookups(srv_url: String, tenant: String, stop: Arc<AtomicBool>) -> u64 {
    let channel = tonic::transport::Channel::from_shared(srv_url)
        .unwrap()
        .connect()
        .await
        .expect("connect");
    let mut c = pb::inference_cache_client::InferenceCacheClient::new(channel);
    let mut answered = 0;
    while !stop.load(Ordering::Relaxed) {
        let mut req =
            tonic::Request::new(exact_lookup(&tenant, "m", "vllm", &7u64.to_be_bytes(), 16));
        req.set_timeout(Duration::from_secs(2));
        if c.lookup_route(req).await.is_ok() {
            answered += 1;
        }
    }
    answered
}

/// Each core's value of the per-core counter `name`.
fn per_core(srv: &Server, name: &str) -> Vec<f64> {
    let text = metrics_text(srv);
    (0..srv.shards)
        .map(|core| {
            let series = format!("{name}{{core=\"{core}\"}}");
            metric_value(&text, &series).unwrap_or_else(|| panic!("core {core} answers"))
        })
        .collect()
}

/// Maintenance pieces that waited for a later turn, all cores.
fn lane_waits(srv: &Server) -> f64 {
    let text = metrics_text(srv);
    (0..srv.shards)
        .filter_map(|core| {
            let series = format!("inferencecache_core_lane_waits_total{{core=\"{core}\"}}");
            metric_value(&text, &series)
        })
        .sum()
}

/// A 10,000-entry cap kept full by a producer sending 2,000-prefix messages (each applied in
/// parts, with cap evictions after it), eight connections of back-to-back lookups, a sweep every
/// 200 ms in slices of 128 entries (about 80 pieces a pass): for 6 s every core keeps sweeping
/// (at least one pass completed and 40 slices run: a lane that starved the sweep behind the
/// flood would run none), the producer's messages are acknowledged throughout, and the lane held
/// pieces back (so the flood did exercise it). Release builds, for scale: 22 passes at
/// `--shards 1`, 7 and 4 at `--shards 2`, as many as without the lane (24; 7 and 4).
async fn maintenance_progresses_under_a_flood(shards: usize) {
    let srv = Server::start_opts(
        shards,
        StartOpts {
            flags: &["--index-max-entries", "10000", "--sweep-interval-ms", "200"],
            env: &[("INFERENCECACHE_TEST_SWEEP_SLICE_ENTRIES", "128")],
            ..Default::default()
        },
    );
    let tenants = tenants_per_core("flood", "m", shards);
    let mut c = srv.client().await;
    for (i, t) in tenants.iter().enumerate() {
        let ack = report(&mut c, vec![update(t, i as u64 * 1_000_000, 6_000)]).await;
        assert!(ack.accepted, "{ack:?}");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let mut lookups = Vec::new();
    for i in 0..8 {
        let t = tenants[i % tenants.len()].clone();
        lookups.push(tokio::spawn(flood_lookups(srv.grpc_url(), t, stop.clone())));
    }
    let producer = {
        let (stop, acked, tenants) = (stop.clone(), acked.clone(), tenants.clone());
        let mut c = srv.client().await;
        tokio::spawn(async move {
            let mut next = 10_000_000;
            while !stop.load(Ordering::Relaxed) {
                let t = &tenants[(next as usize / 2_000) % tenants.len()];
                let ack = report(&mut c, vec![update(t, next, 2_000)]).await;
                assert!(ack.accepted, "{ack:?}");
                acked.fetch_add(1, Ordering::Relaxed);
                next += 2_000;
            }
        })
    };
    let passes = |srv: &Server| per_core(srv, "inferencecache_core_sweeps_total");
    let slices = |srv: &Server| per_core(srv, "inferencecache_core_sweep_slices_total");
    let (before, slices_before, waits_before) = (passes(&srv), slices(&srv), lane_waits(&srv));
    let until = Instant::now() + Duration::from_secs(6);
    let mut acked_at_half = 0;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if acked_at_half == 0
            && until.saturating_duration_since(Instant::now()) < Duration::from_secs(3)
        {
            acked_at_half = acked.load(Ordering::Relaxed).max(1);
        }
    }
    let (after, slices_after, waits_after) = (passes(&srv), slices(&srv), lane_waits(&srv));
    stop.store(true, Ordering::Relaxed);
    let mut answered = 0;
    for l in lookups {
        answered += l.await.expect("lookup flood");
    }
    producer.await.expect("producer");
    let acked = acked.load(Ordering::Relaxed);
    eprintln!(
        "maintenance under a flood: sweep passes {before:?} -> {after:?}, slices \
         {slices_before:?} -> {slices_after:?}, {answered} lookups, {acked} messages acked \
         ({acked_at_half} by half-time), lane waits {}",
        waits_after - waits_before
    );
    for core in 0..shards {
        let passes = after[core] - before[core];
        let slices = slices_after[core] - slices_before[core];
        assert!(
            passes >= 1.0 && slices >= 40.0,
            "core {core}: {passes} sweep passes, {slices} slices in 6 s of flood"
        );
    }
    assert!(
        acked > acked_at_half,
        "messages acknowledged in the second half too"
    );
    if std::env::var("INFERENCECACHE_TEST_SERVER_BIN").is_err() {
        assert!(
            waits_after > waits_before,
            "the flood held pieces back in the lane"
        );
    }
}

shards_1_and_2!(maintenance_progresses_under_a_flood);
