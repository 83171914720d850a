//! `fleetsim synth N [SEED]`: prints a synthetic Mooncake-format trace of N requests.
//! `fleetsim summary TRACE [--workers W] [--worker-blocks B] [--expand K] [--speed S]`: simulates the trace
//! and prints the size of its streams and the ground truth's shape.

use fleetsim::{SimConfig, parse_trace, simulate, synth::synthetic_trace};

fn main() {
    if let Err(e) = run(std::env::args().skip(1).collect()) {
        eprintln!("fleetsim: {e}");
        std::process::exit(2);
    }
}

fn run(args: Vec<String>) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("synth") => {
            let n = arg_num(args.get(1), "N")?;
            let seed = args.get(2).map(|s| s.parse().map_err(|_| "bad SEED")).transpose()?;
            print!("{}", synthetic_trace(n as usize, seed.unwrap_or(1)));
            Ok(())
        }
        Some("summary") => summary(&args[1..]),
        _ => Err("usage: fleetsim synth N [SEED] | fleetsim summary TRACE [--workers W] [--worker-blocks B] [--expand K] [--speed S]".into()),
    }
}

fn arg_num(v: Option<&String>, what: &str) -> Result<u64, String> {
    v.ok_or(format!("{what} missing"))?
        .parse()
        .map_err(|_| format!("{what} is not a number"))
}

fn summary(args: &[String]) -> Result<(), String> {
    let path = args.first().ok_or("TRACE missing")?;
    let mut config = SimConfig::default();
    let mut rest = args[1..].iter();
    while let Some(flag) = rest.next() {
        let v = arg_num(rest.next(), flag)? as u32;
        match flag.as_str() {
            "--workers" => config.workers = v,
            "--worker-blocks" => config.worker_blocks = v,
            "--expand" => config.expand = v,
            "--speed" => config.speed = v,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let trace = parse_trace(&text)?;
    let sim = simulate(&trace, config)?;
    let lookup_blocks: usize = sim.lookups.iter().map(|l| l.blocks.len()).sum();
    let matched: u64 = sim
        .lookups
        .iter()
        .map(|l| l.truth.iter().map(|&(_, m)| m as u64).max().unwrap_or(0))
        .sum();
    println!(
        "requests {} lookups {} (blocks {lookup_blocks}, best-matched blocks {matched}) events {} (stored blocks {}, removed {}) peak holds {} final holds {}",
        trace.len(),
        sim.lookups.len(),
        sim.events.len(),
        sim.stored_blocks,
        sim.removed_blocks,
        sim.peak_holds,
        sim.final_holds
    );
    Ok(())
}
