// The same nats-server check as the server's: one build script for both crates.
include!("../build.rs");
