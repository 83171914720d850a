// Tells the tests whether `nats-server` is on PATH: the JetStream event log scenarios
// (tests/e2e/replicas.rs here, the `--nats-url` scenario of kvevent-subscriber, whose build.rs
// includes this file) are compiled `#[ignore]`d without it, so the test runner reports them as
// ignored instead of passing them unrun. The cfg changes only when PATH or the found binary
// does; after installing nats-server into an unchanged PATH, `touch build.rs` to rebuild.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(has_nats_server)");
    println!("cargo:rerun-if-env-changed=PATH");
    println!("cargo:rerun-if-changed=build.rs");
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|p| p.is_file())
    });
    if let Some(path) = found {
        println!("cargo:rerun-if-changed={}", path.display());
        println!("cargo:rustc-cfg=has_nats_server");
    }
}
