//! Maintenance under the worst shapes a client can make (issue 30): 10M entries; 1M keyspaces
//! in one scope; 1M names; 1,024 holders on each of 10,000 keys; clears and policy churn
//! between slices. Runs the TTL sweep, the reclaim pass, the cap candidate build, the snapshot
//! export and the restore in the server's slices and fails if any slice used more than 1 ms of
//! thread CPU.
//!
//! `cargo run --release -p inferencecache-index --example maintenance_stress [-- small]`
//! (the small scale is what `tests/maintenance_stress_small.rs` runs in the default test run).

mod harness;

use std::time::Duration;

fn main() {
    let small = std::env::args().nth(1).as_deref() == Some("small");
    let scale = if small {
        harness::Scale::small()
    } else {
        harness::Scale::full()
    };
    let started = std::time::Instant::now();
    let report = harness::run(scale, |what| {
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
    let (task, worst) = report.worst().expect("slices ran");
    assert!(
        worst <= Duration::from_millis(1),
        "a {task} slice used {worst:?} of thread CPU"
    );
}
