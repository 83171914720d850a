//! The maintenance stress harness at a small scale (the `maintenance_stress` example runs it at
//! the scale in a release build): every task runs in more than one slice, and with
//! optimizations no slice uses more than 1 ms of thread CPU (a debug build, about 10× slower
//! per step, gets 10 ms).

#[path = "../examples/maintenance_stress/harness.rs"]
mod harness;

use std::time::Duration;

/// The server's allocator (src/main.rs), as in the example: glibc's `malloc_consolidate` walks
/// every small chunk freed since the last large request, so after a slice that freed thousands
/// of run buffers the next slice's first allocation took 1–2 ms here under glibc; mimalloc
/// frees into per-page lists and has no such step.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[test]
fn every_maintenance_task_runs_in_bounded_slices() {
    harness::no_transparent_huge_pages();
    let report = harness::run(harness::Scale::small(), |_| true, |_| {});
    for task in [
        "sweep",
        "reclaim",
        "cap_build",
        "snapshot_slice",
        "restore_slice",
        "clear_slice",
        "snapshot_part_slice",
        "quota_build",
    ] {
        let (_, _, slices) = report.tasks.get(task).copied().unwrap_or_default();
        assert!(slices > 1, "{task} ran in {slices} slice(s): {report:?}");
    }
    let bound = if cfg!(debug_assertions) {
        Duration::from_millis(10)
    } else {
        Duration::from_millis(1)
    };
    let (task, worst) = report.worst().unwrap();
    assert!(
        worst <= bound,
        "a {task} slice used {worst:?} of thread CPU: {report:?}"
    );
}
