//! The gRPC port's HTTP/2 server (RFC 9113), written for this server's traffic: many small
//! unary calls per connection, answered on the core that reads them.
//!
//! Why not the `h2` crate: at saturation h2 with HPACK, `http` and `bytes` was a third of the
//! CPU of a LookupRoute, more than the index walk (perf/runs/2026-12-03-the-grpc-port-s-own-http-2-layer.md): a `HeaderMap`
//! and `Uri` per request, a stream slab behind a mutex, three queued frames per answer. Here a
//! plain call is decoded into one reused buffer, answered in the turn that read it, and its
//! answer framed straight into the connection's output.
//!
//! * [`frame`]: frame headers and writers.
//! * [`hpack`]: HPACK decoding (RFC 7541).
//! * [`headers`]: decoded blocks as checked header lists, and response encoding.
//! * [`state`]: stream states and their transitions (RFC 9113 §5.1), the record of closed
//!   streams, `content-length` accounting.
//! * [`stream`]: what a general-path stream's task shares with its connection.
//! * [`guard`]: per-connection bounds on floods and provoked stream errors (the
//!   denial-of-service families).
//! * [`connection`]: the connection itself, and the [`Service`] it serves.

mod connection;
pub mod frame;
#[cfg(test)]
mod fuzz_hpack;
mod guard;
pub mod headers;
mod hpack;
mod hpack_tables;
mod state;
mod stream;

pub use connection::{Inline, Service, serve};
pub use frame::Reason;
pub use headers::HeaderList;
pub use stream::{RecvHalf, Responder, StreamError};
