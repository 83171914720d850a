//! The gRPC front of each core: serves a connection dealt to the core (TLS, HTTP/2 via `http2`),
//! dispatches each request by path to the InferenceCache service, health or reflection, and maps
//! statuses the way grpc-go clients expect.

mod body;
mod connection;
pub mod deadline;
mod dispatch;
mod ingest_rpc;
mod lookup_wire;
mod respond;
pub mod service;
mod status;
pub mod tls;
mod unary;

pub use body::set_message_receive_timeout;
pub use connection::{serve_connection, serve_http2};
pub use dispatch::install_services;
