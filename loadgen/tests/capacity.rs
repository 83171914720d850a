//! Capacity search logic against simulated latency curves (pure, no I/O).

use loadgen::capacity::{Measurement, SearchConfig, search_with};

fn cfg() -> SearchConfig {
    SearchConfig {
        p99_budget_ms: 5.0,
        max_error_rate: 0.001,
        min_achieved_share: 0.9,
        start_rate: 100.0,
        max_rate: 1_000_000.0,
        min_rate: 1.0,
        growth: 2.0,
        tolerance: 0.05,
        max_steps: 30,
    }
}

/// A server with a knee: flat 1 ms p99 up to 5000 req/s, then +1 ms per 100 req/s, so the p99
/// budget of 5 ms is crossed at exactly 5400 req/s.
fn knee(rate: f64) -> Measurement {
    Measurement {
        achieved_rate: rate,
        p99_ms: 1.0 + ((rate - 5000.0).max(0.0) / 100.0),
        error_rate: 0.0,
    }
}

#[test]
fn finds_the_knee_within_tolerance() {
    let out = search_with(cfg(), knee);
    let cap = out.capacity_rate.expect("some rate passes");
    assert!(cap <= 5400.0, "never above the true capacity: {cap}");
    assert!(cap >= 5400.0 * 0.95, "within 5%: {cap}");
    let hi = out.first_failing_rate.unwrap();
    assert!((hi - cap) / hi <= 0.05);
    assert!(out.stopped.starts_with("converged"), "{}", out.stopped);
    // Exponential phase 100, 200, …, 6400, then bisection.
    let rates: Vec<f64> = out.steps.iter().map(|s| s.rate).collect();
    assert_eq!(
        &rates[..7],
        &[100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0, 6400.0]
    );
    assert!(out.steps.len() <= 30);
    // Every verdict agrees with the curve.
    for s in &out.steps {
        assert_eq!(s.pass, knee(s.rate).p99_ms <= 5.0, "{s:?}");
        assert_eq!(s.pass, s.reason.is_empty());
    }
}

#[test]
fn backs_off_when_the_first_step_fails() {
    let mut c = cfg();
    c.start_rate = 100_000.0;
    let out = search_with(c, knee);
    let cap = out.capacity_rate.unwrap();
    assert!((5400.0 * 0.95..=5400.0).contains(&cap), "{cap}");
    assert!(!out.steps[0].pass);
    assert_eq!(out.steps[1].rate, 50_000.0);
}

#[test]
fn errors_fail_a_step_even_with_good_latency() {
    // Errors start at 2000 req/s (load shedding) while latency stays flat.
    let out = search_with(cfg(), |r| Measurement {
        achieved_rate: r,
        p99_ms: 0.5,
        error_rate: if r > 2000.0 { 0.01 } else { 0.0 },
    });
    let cap = out.capacity_rate.unwrap();
    assert!((1900.0..=2000.0).contains(&cap), "{cap}");
    let failed = out.steps.iter().find(|s| !s.pass).unwrap();
    assert!(failed.reason.contains("error rate"), "{}", failed.reason);
}

#[test]
fn a_client_that_cannot_keep_up_does_not_pass() {
    // The generator saturates at 3000 req/s achieved.
    let out = search_with(cfg(), |r| Measurement {
        achieved_rate: r.min(3000.0),
        p99_ms: 0.5,
        error_rate: 0.0,
    });
    let cap = out.capacity_rate.unwrap();
    assert!((3000.0 * 0.95..=3000.0 / 0.9).contains(&cap), "{cap}");
}

#[test]
fn stops_at_max_rate_and_max_steps() {
    let mut c = cfg();
    c.max_rate = 1000.0;
    let out = search_with(c.clone(), |r| Measurement {
        achieved_rate: r,
        p99_ms: 0.1,
        error_rate: 0.0,
    });
    assert_eq!(out.capacity_rate, Some(1000.0));
    assert!(out.stopped.contains("max rate"), "{}", out.stopped);

    c.max_rate = 1e12;
    c.max_steps = 5;
    let out = search_with(c, |r| Measurement {
        achieved_rate: r,
        p99_ms: 0.1,
        error_rate: 0.0,
    });
    assert_eq!(out.steps.len(), 5);
    assert_eq!(out.capacity_rate, Some(1600.0));
    assert!(out.stopped.contains("max steps"));
}

#[test]
fn nothing_passes() {
    let out = search_with(cfg(), |r| Measurement {
        achieved_rate: r,
        p99_ms: 50.0,
        error_rate: 0.0,
    });
    assert_eq!(out.capacity_rate, None);
    assert!(out.stopped.contains("min rate"), "{}", out.stopped);
    // 100, 50, 25, …, ≥ 1: bounded.
    assert!(out.steps.len() <= 8);
}

#[test]
fn nan_latency_fails_and_config_is_validated() {
    let out = search_with(cfg(), |r| Measurement {
        achieved_rate: r,
        p99_ms: f64::NAN,
        error_rate: 0.0,
    });
    assert_eq!(out.capacity_rate, None);
    let mut c = cfg();
    c.growth = 1.0;
    assert!(c.validate().is_err());
    let mut c = cfg();
    c.start_rate = 0.5;
    assert!(c.validate().is_err());
    assert!(cfg().validate().is_ok());
}
