//! Maintenance under the worst shapes a client can make (issue 30): 10M entries; 1M keyspaces
//! in one scope; 1M names; 1,024 holders on each of 10,000 keys; clears and policy churn
//! between slices; a tenant at its quota among 10M entries. Runs the TTL sweep, the reclaim
//! pass, the cap candidate build, the quota heap build, the snapshot export and the restore in
//! the server's slices and fails if any slice used more than 1 ms of
//! thread CPU.
//!
//! `cargo run --release -p inferencecache-index --example maintenance_stress [-- [small] [SHAPE…]]`
//! (shapes: `plain`, `keyspaces`, `names`, `held`, `quota`; all by default)
//! (the small scale is what `tests/maintenance_stress_small.rs` runs in the default test run).

mod harness;

/// The server's allocator (src/main.rs), so the slices pay what they pay in the server.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::Duration;

fn main() {
    harness::no_transparent_huge_pages();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let small = args.iter().any(|a| a == "small");
    let shapes: Vec<&String> = args.iter().filter(|a| *a != "small").collect();
    let scale = if small {
        harness::Scale::small()
    } else {
        harness::Scale::full()
    };
    let started = std::time::Instant::now();
    let only = |shape: &str| shapes.is_empty() || shapes.iter().any(|s| *s == shape);
    let report = harness::run(scale, only, |what| {
        eprintln!("[{:>6.1} s] {what}", started.elapsed().as_secs_f64())
    });
    println!("| task | slices | longest slice, thread CPU | longest slice, wall |");
    println!("|---|---:|---:|---:|");
    for (task, (cpu, wall, n)) in &report.tasks {
        println!(
            "| {task} | {n} | {:.3} ms | {:.3} ms |",
            cpu.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e3
        );
    }
    println!();
    println!("| shape/task | slices | longest slice, thread CPU | longest slice, wall |");
    println!("|---|---:|---:|---:|");
    for (task, (cpu, wall, n)) in &report.by_shape {
        println!(
            "| {task} | {n} | {:.3} ms | {:.3} ms |",
            cpu.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e3
        );
    }
    println!();
    println!(
        "slices over {:?} of thread CPU (getrusage(RUSAGE_THREAD) over the slice):",
        harness::SLOW_SLICE
    );
    println!(
        "| shape/task | slice # | CPU | wall | user | sys | minflt | majflt | nvcsw | nivcsw |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in &report.slow {
        println!(
            "| {} | {} | {:.3} ms | {:.3} ms | {:.3} ms | {:.3} ms | {} | {} | {} | {} |",
            s.task,
            s.nth,
            s.cpu.as_secs_f64() * 1e3,
            s.wall.as_secs_f64() * 1e3,
            s.user.as_secs_f64() * 1e3,
            s.sys.as_secs_f64() * 1e3,
            s.minflt,
            s.majflt,
            s.nvcsw,
            s.nivcsw
        );
    }
    for (what, cpu) in &report.notes {
        println!("{what}: {:.3} ms of thread CPU", cpu.as_secs_f64() * 1e3);
    }
    let (task, worst) = report.worst().expect("slices ran");
    assert!(
        worst <= Duration::from_millis(1),
        "a {task} slice used {worst:?} of thread CPU"
    );
}
