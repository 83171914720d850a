//! The fleet the `examples/` simulate, from the environment: `WORKERS` workers (64) holding
//! the default blocks each, `EXPAND` engine blocks per trace block (32), arrivals sped up by
//! workers / 64 as `run.sh`'s default.

use fleetsim::SimConfig;

/// The fleet of `WORKERS` and `EXPAND` (see the module docs).
pub fn config() -> SimConfig {
    let env =
        |name: &str, default: u32| std::env::var(name).map_or(default, |s| s.parse().unwrap());
    let (workers, expand) = (env("WORKERS", 64), env("EXPAND", 32));
    SimConfig {
        workers,
        worker_blocks: fleetsim::sim::DEFAULT_WORKER_BLOCKS,
        expand,
        speed: (workers / 64).max(1),
    }
}
