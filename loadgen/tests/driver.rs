//! Coordinated-omission correctness of the open-loop driver and bounds of both drivers, with
//! fake "servers" (plain futures), in real time but a fraction of a second each.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use loadgen::driver::{Bounds, closed_loop, due_time, open_loop};
use loadgen::histogram::{Recorder, Rpc, quantile_ms};
use tokio::time::Instant;

#[test]
fn due_times_are_evenly_spaced_from_start() {
    let t0 = Instant::now();
    assert_eq!(due_time(t0, 0, 1000.0), t0);
    assert_eq!(due_time(t0, 1, 1000.0) - t0, Duration::from_millis(1));
    assert_eq!(due_time(t0, 2500, 1000.0) - t0, Duration::from_millis(2500));
    assert_eq!(due_time(t0, 3, 4.0) - t0, Duration::from_millis(750));
}

/// One server that can serve one request at a time (in-flight cap 1, like a single blocking
/// connection) and stalls for 300 ms on request 100, at 1000 req/s for 0.6 s. Requests due
/// during the stall cannot be sent; measured from their due time they carry the stall
/// (≈300 → 0 ms, linearly), measured from their actual send they look instant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_is_charged_to_the_requests_queued_behind_it() {
    let co = Arc::new(Recorder::new(&[Duration::from_millis(100)]));
    let naive = Arc::new(Recorder::new(&[Duration::from_millis(100)]));
    let (co2, naive2) = (co.clone(), naive.clone());
    let bounds = Bounds {
        requests: Some(600),
        duration: Some(Duration::from_secs(5)),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stats = open_loop(1000.0, bounds, 1, Duration::from_secs(2), stop, move |t| {
        let (co, naive) = (co2.clone(), naive2.clone());
        async move {
            let sent = Instant::now();
            if t.index == 100 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            co.record_ok(Rpc::LookupRoute, t.intended);
            naive.record_ok(Rpc::LookupRoute, sent);
        }
    })
    .await;
    assert_eq!(stats.started, 600);
    assert_eq!(stats.abandoned, 0);

    let co_s = co.snapshot();
    let naive_s = naive.snapshot();
    let h = &co_s.rpcs[Rpc::LookupRoute as usize].hist;
    assert_eq!(h.len(), 600);
    // ~300 requests were due during the stall; those due in its first 200 ms waited > 100 ms.
    let over = co_s.lookup.over_budget[0];
    eprintln!(
        "over 100 ms: {over}, p90 {:.1} ms, p99 {:.1} ms",
        quantile_ms(h, 0.9),
        quantile_ms(h, 0.99)
    );
    // Tolerant upper bounds: on a loaded machine the post-stall catch-up is slower.
    assert!(
        (170..=300).contains(&over),
        "CO-correct: {over} requests over 100 ms"
    );
    // Linear 300 → 0 ms over 300 of 600 samples: p90 ≈ 240 ms, p99 ≈ 290 ms, max ≈ 300 ms.
    let p90 = quantile_ms(h, 0.90);
    let p99 = quantile_ms(h, 0.99);
    assert!((180.0..=300.0).contains(&p90), "p90 {p90}");
    assert!((260.0..=400.0).contains(&p99), "p99 {p99}");
    assert!(h.max() >= 290_000, "max {} us", h.max());
    // The naive measurement sees only the one stalled request.
    let naive_over = naive_s.lookup.over_budget[0];
    assert!(naive_over <= 2, "naive: {naive_over} requests over 100 ms");
    assert!(quantile_ms(&naive_s.rpcs[0].hist, 0.99) < 50.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_stops_at_the_duration_bound() {
    let n = Arc::new(Mutex::new(0u64));
    let n2 = n.clone();
    let bounds = Bounds {
        requests: None,
        duration: Some(Duration::from_millis(300)),
    };
    let stats = open_loop(
        200.0,
        bounds,
        64,
        Duration::from_secs(1),
        Arc::new(AtomicBool::new(false)),
        move |_| {
            *n2.lock().unwrap() += 1;
            async {}
        },
    )
    .await;
    // Due times 0, 5, …, 295 ms → exactly 60 requests.
    assert_eq!(stats.started, 60);
    assert_eq!(*n.lock().unwrap(), 60);
    assert!(
        stats.elapsed < Duration::from_millis(600),
        "{:?}",
        stats.elapsed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_honours_stop() {
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let bounds = Bounds {
        requests: Some(1_000_000),
        duration: Some(Duration::from_secs(30)),
    };
    let t0 = Instant::now();
    let stats = open_loop(100.0, bounds, 8, Duration::from_secs(1), stop, move |t| {
        if t.index == 10 {
            s2.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        async {}
    })
    .await;
    assert_eq!(stats.started, 11);
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_runs_exactly_n_in_index_order() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let bounds = Bounds {
        requests: Some(257),
        duration: Some(Duration::from_secs(10)),
    };
    let stats = closed_loop(7, bounds, Arc::new(AtomicBool::new(false)), move |t| {
        // Called under the driver's lock: indices arrive in order.
        s2.lock().unwrap().push(t.index);
        async { tokio::time::sleep(Duration::from_millis(1)).await }
    })
    .await;
    assert_eq!(stats.started, 257);
    let seen = seen.lock().unwrap();
    assert_eq!(*seen, (0..257).collect::<Vec<u64>>());
}
