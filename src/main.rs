//! `inference-cache-server`: the InferenceCache gRPC server and its HTTP listeners. Everything
//! lives in the library (src/lib.rs); the binary adds the allocator.

/// mimalloc: per-thread heaps for the per-request prost/h2 allocations (see Cargo.toml).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(inference_cache::run());
}
