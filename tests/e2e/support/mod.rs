//! Shared helpers of the end-to-end suite. Every module does `use crate::support::*;` and gets
//! the server harness ([`server`]), raw HTTP and the HTTP endpoints ([`http`]), gRPC request
//! builders and response assertions ([`grpc`]), hand-framed HTTP/2 calls ([`h2raw`]), partition placement ([`cores`]), the token
//! fingerprint ([`fingerprint`]), condition waits ([`wait`]) and TLS material ([`pki`]);
//! `frames` (a frame-level HTTP/2 client) is imported explicitly by the wire scenarios;
//! `tiny_model` is imported explicitly by the prompt_text scenarios.
#![allow(dead_code)]

mod background;
mod cores;
mod fingerprint;
pub mod frames;
mod grpc;
mod h2raw;
mod http;
mod nats;
mod pki;
mod server;
pub mod tiny_model;
mod tokenreview;
mod wait;

pub use background::*;
pub use cores::*;
pub use fingerprint::*;
pub use grpc::*;
pub use h2raw::*;
pub use http::*;
pub use inferencecache_proto::v1alpha1 as pb;
pub use nats::*;
pub use pki::*;
pub use server::*;
pub use tokenreview::*;
pub use wait::*;

/// `shards_1_and_2!(name);` turns the scenario `async fn name(shards: usize)` into a module
/// `name` with the two tests `name::shards_1` and `name::shards_2`, running it against a server
/// with `--shards 1` (everything inline on one core) and `--shards 2` (cross-core hops), so
/// `cargo test name` runs both. `shards_1_and_2!(blocking name);` does the same for a plain
/// `fn name(shards: usize)`.
macro_rules! shards_1_and_2 {
    ($f:ident) => {
        mod $f {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shards_1() {
                super::$f(1).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shards_2() {
                super::$f(2).await
            }
        }
    };
    (blocking $f:ident) => {
        mod $f {
            #[test]
            fn shards_1() {
                super::$f(1)
            }
            #[test]
            fn shards_2() {
                super::$f(2)
            }
        }
    };
}
