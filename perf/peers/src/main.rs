//! `peers-bench TRACE [--workers 64,1024] [--expand 1,32] [--rounds N] [--only a,b] [--quick]`:
//! simulates the trace's fleet once per (workers, expand), checks every index against the
//! ground truth on every lookup, then measures each index on one pinned core in interleaved
//! rounds and prints the tables and, last, the summary line (perf/peers/README.md).

mod adapters;
mod alloc;
mod measure;
mod report;
mod server_alloc;

use fleetsim::{Adapter, SimConfig, check_stream, parse_trace, simulate};

use crate::measure::{Kind, RoundResult};

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

struct Args {
    trace: String,
    workers: Vec<u32>,
    expands: Vec<u32>,
    rounds: usize,
    only: Option<Vec<String>>,
    worker_blocks: u32,
    /// None: the fleet's workers / 64 (each worker sees the load the 64-worker fleet sees at 1×).
    speed: Option<u32>,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut args = Args {
        trace: String::new(),
        workers: vec![64, 1024],
        expands: vec![1, 32],
        rounds: 5,
        only: None,
        worker_blocks: fleetsim::sim::DEFAULT_WORKER_BLOCKS,
        speed: None,
    };
    let list = |v: Option<String>| -> Result<Vec<u32>, String> {
        v.ok_or("missing value")?
            .split(',')
            .map(|s| s.parse().map_err(|_| format!("bad number {s}")))
            .collect()
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "--workers" => args.workers = list(it.next())?,
            "--expand" => args.expands = list(it.next())?,
            "--rounds" => args.rounds = list(it.next())?[0] as usize,
            "--worker-blocks" => args.worker_blocks = list(it.next())?[0],
            "--speed" => args.speed = Some(list(it.next())?[0]),
            "--only" => {
                args.only = Some(
                    it.next()
                        .ok_or("--only needs a list")?
                        .split(',')
                        .map(String::from)
                        .collect(),
                )
            }
            "--quick" => {
                args.workers = vec![64];
                args.rounds = 3;
            }
            _ if args.trace.is_empty() && !a.starts_with("--") => args.trace = a,
            _ => return Err(format!("unknown argument {a}")),
        }
    }
    if args.trace.is_empty() {
        return Err("usage: peers-bench TRACE [--workers 64,1024] [--expand 1,32] [--rounds N] [--speed S] [--only ours,kv-index,...] [--quick]".into());
    }
    Ok(args)
}

fn main() {
    server_alloc::configure();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("peers-bench: {e}");
            std::process::exit(2);
        }
    };
    let text = std::fs::read_to_string(&args.trace).unwrap_or_else(|e| {
        eprintln!("peers-bench: {}: {e}", args.trace);
        std::process::exit(2);
    });
    let trace = parse_trace(&text).unwrap_or_else(|e| {
        eprintln!("peers-bench: {e}");
        std::process::exit(2);
    });
    let kinds: Vec<Kind> = Kind::ALL
        .iter()
        .copied()
        .filter(|k| {
            args.only
                .as_ref()
                .is_none_or(|o| o.iter().any(|n| n == k.key()))
        })
        .collect();
    measure::pin_to_one_core();
    let mut summary = report::Summary::default();
    for &workers in &args.workers {
        for &expand in &args.expands {
            let config = SimConfig {
                workers,
                worker_blocks: args.worker_blocks,
                expand,
                speed: args.speed.unwrap_or(SimConfig::default_speed(workers)),
            };
            run_config(&trace, config, &kinds, args.rounds, &mut summary);
        }
    }
    println!("{}", summary.last_line());
}

fn run_config(
    trace: &[fleetsim::TraceRequest],
    config: SimConfig,
    kinds: &[Kind],
    rounds: usize,
    summary: &mut report::Summary,
) {
    let t0 = std::time::Instant::now();
    let sim = match simulate(trace, config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("peers-bench: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "\n## {} workers × {} blocks, --expand {} ({} tokens/block), trace speed ×{}: {} lookups, {} events ({} blocks stored, {} removed), peak holds {} (simulated in {:.1} s)",
        config.workers,
        config.worker_blocks,
        config.expand,
        config.tokens_per_block(),
        config.speed,
        sim.lookups.len(),
        sim.events.len(),
        sim.stored_blocks,
        sim.removed_blocks,
        sim.peak_holds,
        t0.elapsed().as_secs_f64()
    );
    let kinds: Vec<Kind> = kinds
        .iter()
        .copied()
        .filter(|k| measure::make(*k, &config).is_some())
        .collect();
    let mut mismatches = Vec::new();
    for &k in &kinds {
        let mut index: Box<dyn Adapter> = measure::make(k, &config).expect("filtered");
        let report = check_stream(&sim, index.as_mut(), 3);
        drop(index);
        if report.mismatches > 0 {
            println!(
                "ground truth: {} disagrees on {} of {} lookups; first cases:",
                k.label(),
                report.mismatches,
                report.lookups
            );
            for m in &report.first {
                println!("  {}", m.describe(4));
            }
        }
        mismatches.push(report.mismatches);
    }
    let mut results: Vec<Vec<RoundResult>> = vec![Vec::new(); kinds.len()];
    for round in 0..rounds {
        for i in 0..kinds.len() {
            let j = (i + round) % kinds.len();
            results[j].push(measure::round(kinds[j], &sim));
        }
    }
    report::print_config(&sim, &kinds, &mismatches, &results, summary);
}
