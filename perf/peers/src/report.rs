//! The tables and the summary line.

use fleetsim::Simulation;

use crate::measure::{Kind, RoundResult};

/// The headline figures of one configuration.
#[derive(Clone, Debug)]
struct Headline {
    workers: u32,
    expand: u32,
    /// ours / best one-core peer (higher is better for ours).
    mixed_ratio: f64,
    /// best one-core peer's p99 / ours (higher is better for ours).
    p99_ratio: f64,
    /// best one-core peer's bytes per held block / ours (higher is better for ours).
    bytes_ratio: f64,
}

/// Collected over every configuration, for the last line.
#[derive(Default)]
pub struct Summary {
    headlines: Vec<Headline>,
    ours_mismatches: u64,
}

impl Summary {
    /// The last line: the headline configuration is 64 workers `--expand 32` when measured (the
    /// issue's target shape), otherwise the first measured.
    pub fn last_line(&self) -> String {
        let h = self
            .headlines
            .iter()
            .find(|h| h.workers == 64 && h.expand == 32)
            .or(self.headlines.first());
        let f = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.3}"));
        format!(
            "peers: mixed ops/s ours/best={}; p99 best/ours={}; bytes/block best/ours={}; ground-truth mismatches ours={}",
            f(h.map(|h| h.mixed_ratio)),
            f(h.map(|h| h.p99_ratio)),
            f(h.map(|h| h.bytes_ratio)),
            self.ours_mismatches
        )
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median and the spread (max − min) / median, in percent.
fn med_spread(v: Vec<f64>) -> (f64, f64) {
    let m = median(v.clone());
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (m, if m > 0.0 { (hi - lo) / m * 100.0 } else { 0.0 })
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1000.0
}

/// p50, p99, p99.9 in µs of the lookups whose chain length is in `range`, median over rounds.
fn latency(rounds: &[RoundResult], range: std::ops::RangeInclusive<u32>) -> ([f64; 3], usize) {
    let mut per = [Vec::new(), Vec::new(), Vec::new()];
    let mut n = 0;
    for r in rounds {
        let mut v: Vec<u64> = r
            .latencies
            .iter()
            .filter(|(len, _)| range.contains(len))
            .map(|&(_, ns)| ns)
            .collect();
        v.sort_unstable();
        n = v.len();
        for (i, p) in [0.5, 0.99, 0.999].into_iter().enumerate() {
            per[i].push(percentile(&v, p));
        }
    }
    let [a, b, c] = per;
    ([median(a), median(b), median(c)], n)
}

fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// Prints one configuration's tables and records its headline.
pub fn print_config(
    sim: &Simulation,
    kinds: &[Kind],
    mismatches: &[u64],
    results: &[Vec<RoundResult>],
    summary: &mut Summary,
) {
    let rounds = results.first().map_or(0, Vec::len);
    println!(
        "\n| index | ground-truth mismatches | events/s (blocks/s) | lookups/s | mixed ops/s | lookup p50 / p99 / p99.9 µs | peak heap B per held block (retained) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (i, &k) in kinds.iter().enumerate() {
        let rs = &results[i];
        let (ev, ev_sp) = med_spread(rs.iter().map(|r| r.events_per_s).collect());
        let evb = median(rs.iter().map(|r| r.event_blocks_per_s).collect());
        let (lk, lk_sp) = med_spread(rs.iter().map(|r| r.lookups_per_s).collect());
        let (mx, mx_sp) = med_spread(rs.iter().map(|r| r.mixed_ops_per_s).collect());
        let peak = median(rs.iter().map(|r| r.peak_bytes_per_block).collect());
        let kept = median(rs.iter().map(|r| r.retained_bytes_per_block).collect());
        let (lat, _) = latency(rs, 0..=u32::MAX);
        println!(
            "| {} | {} | {} ±{:.0}% ({}) | {} ±{:.0}% | {} ±{:.0}% | {:.2} / {:.2} / {:.2} | {:.1} ({:.1}) |",
            k.label(),
            mismatches[i],
            si(ev),
            ev_sp,
            si(evb),
            si(lk),
            lk_sp,
            si(mx),
            mx_sp,
            lat[0],
            lat[1],
            lat[2],
            peak,
            kept
        );
        rows.push((k, mx, lat[1], peak));
    }
    let e = sim.config.expand;
    let buckets = [(1, 16 * e), (16 * e + 1, 64 * e), (64 * e + 1, u32::MAX)];
    println!(
        "\nLookup latency by chain length (blocks), p50 / p99 / p99.9 µs, median of {rounds} rounds:\n"
    );
    let head: Vec<String> = buckets
        .iter()
        .map(|&(lo, hi)| {
            if hi == u32::MAX {
                format!("> {}", lo - 1)
            } else {
                format!("{lo}–{hi}")
            }
        })
        .collect();
    println!("| index | {} |", head.join(" | "));
    println!("|---|---|---|---|");
    for (i, &k) in kinds.iter().enumerate() {
        let cells: Vec<String> = buckets
            .iter()
            .map(|&(lo, hi)| {
                let (l, n) = latency(&results[i], lo..=hi);
                format!("{:.2} / {:.2} / {:.2} (n={n})", l[0], l[1], l[2])
            })
            .collect();
        println!("| {} | {} |", k.label(), cells.join(" | "));
    }
    println!(
        "\nMedians of {rounds} interleaved rounds, ± = (max − min) / median. One pinned core each; † uses both cores (its 2 writer threads), not a one-core figure. Lookup latency excludes the threaded indexer's flush; its mixed ops/s includes it."
    );
    let ours = rows.iter().find(|r| r.0 == Kind::Ours);
    let peers: Vec<_> = rows
        .iter()
        .filter(|r| r.0 != Kind::Ours && r.0.one_core())
        .collect();
    if let (Some(o), false) = (ours, peers.is_empty()) {
        let best_mixed = peers.iter().map(|r| r.1).fold(0.0, f64::max);
        let best_p99 = peers.iter().map(|r| r.2).fold(f64::INFINITY, f64::min);
        let best_bytes = peers.iter().map(|r| r.3).fold(f64::INFINITY, f64::min);
        summary.headlines.push(Headline {
            workers: sim.config.workers,
            expand: sim.config.expand,
            mixed_ratio: o.1 / best_mixed,
            p99_ratio: best_p99 / o.2,
            bytes_ratio: best_bytes / o.3,
        });
    }
    if let Some(i) = kinds.iter().position(|&k| k == Kind::Ours) {
        summary.ours_mismatches += mismatches[i];
    }
}
