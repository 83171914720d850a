//! Generates the InferenceCache messages, client and server from the checked-in proto, with a
//! vendored `protoc` so no system package is needed, plus the encoded file descriptor set that
//! server reflection serves.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: `set_var` is unsafe only because another thread could read the environment at
    // the same time; this build script has no other threads, and the generator called below
    // reads PROTOC from it.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .build_transport(false)
        // A lookup's block hashes decode as slices of the received buffer instead of one
        // allocation each (the request path's largest decode cost, perf/RESULTS.md).
        .bytes(".inferencecache.v1alpha1.LookupRouteRequest.block_hashes")
        .file_descriptor_set_path(out.join("inferencecache_descriptor.bin"))
        .compile_protos(&["inferencecache/v1alpha1/inferencecache.proto"], &["."])?;
    println!("cargo:rerun-if-changed=inferencecache/v1alpha1/inferencecache.proto");
    Ok(())
}
