//! Front-end workloads of the CI instruction-count gate (`perf/gate.sh`): whole LookupRoute
//! requests through the real server front end, in one process.
//!
//! The front end, its scripted client and the set-up are in `frontend_harness/` (shared with
//! `tests/inline_allocations.rs`).
//!
//! `perf_gate_frontend <workload>` does the set-up (executor, core, preload, connection
//! preface, one warm-up request whose answer is checked), then runs the counted loop inside the
//! function `gate_w_<workload>`, which drives the executor: everything the executor runs meanwhile
//! (client, HTTP/2 layer, handler, index, encoding, the executor's own loop) is counted.
//! `perf_gate_frontend list` prints the workload names and their request counts.
//!
//! `PERF_GATE_INJECT=<workload>` adds a `black_box` spin of `PERF_GATE_INJECT_ITERS` (default
//! 2000) iterations per request of that workload: a deliberate slowdown used only to prove that
//! the gate fails (perf/RESULTS.md). Product code is never touched.

use std::hint::black_box;

use glommio::LocalExecutor;

#[path = "frontend_harness/mod.rs"]
mod frontend_harness;
use frontend_harness::{Client, setup};

/// The server's allocator (src/main.rs), so allocation costs are the server's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Requests of the serial workload (one in flight).
const SERIAL: usize = 200;
/// Requests written at once in the pipelined workload.
const PIPELINE: usize = 32;
/// Batches of the pipelined workload.
const BATCHES: usize = 10;

/// Workload names and their request counts (`perf_gate_frontend list`).
const WORKLOADS: &[(&str, usize)] = &[
    ("frontend_lookup_serial", SERIAL),
    ("frontend_lookup_pipelined_32", PIPELINE * BATCHES),
];

/// Extra work per request when `PERF_GATE_INJECT` names the running workload.
struct Inject(u64);

impl Inject {
    fn for_workload(name: &str) -> Inject {
        let on = std::env::var("PERF_GATE_INJECT").is_ok_and(|w| w == name);
        let iters = std::env::var("PERF_GATE_INJECT_ITERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000);
        Inject(if on { iters } else { 0 })
    }

    #[inline(always)]
    fn apply(&self) {
        for i in 0..self.0 {
            black_box(i);
        }
    }
}

#[inline(never)]
fn gate_w_frontend_lookup_serial(ex: &LocalExecutor, c: &mut Client, inj: &Inject) -> usize {
    ex.run(async {
        for _ in 0..SERIAL {
            c.send(1).await;
            c.answers(1).await;
            inj.apply();
        }
    });
    c.answered
}

#[inline(never)]
fn gate_w_frontend_lookup_pipelined_32(ex: &LocalExecutor, c: &mut Client, inj: &Inject) -> usize {
    ex.run(async {
        for _ in 0..BATCHES {
            c.send(PIPELINE).await;
            c.answers(PIPELINE).await;
            for _ in 0..PIPELINE {
                inj.apply();
            }
        }
    });
    c.answered
}

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    if name == "list" {
        for (w, n) in WORKLOADS {
            println!("{w} {n}");
        }
        return;
    }
    let Some(&(_, requests)) = WORKLOADS.iter().find(|w| w.0 == name) else {
        eprintln!(
            "usage: perf_gate_frontend <workload>|list  (workloads: {})",
            WORKLOADS.iter().map(|w| w.0).collect::<Vec<_>>().join(", ")
        );
        std::process::exit(2);
    };
    let inj = Inject::for_workload(&name);
    let (ex, mut client) = setup();
    let before = (client.answered, client.data_frames);
    let answered = match name.as_str() {
        "frontend_lookup_serial" => gate_w_frontend_lookup_serial(&ex, &mut client, &inj),
        _ => gate_w_frontend_lookup_pipelined_32(&ex, &mut client, &inj),
    };
    assert_eq!(answered - before.0, requests, "every request answered");
    assert_eq!(
        client.data_frames - before.1,
        requests,
        "every request answered with a message"
    );
    println!("{name}: {requests} requests answered");
}
