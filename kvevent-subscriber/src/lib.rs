//! `kvevent-subscriber`: turns an inference engine's KV-cache events (vLLM / SGLang over ZMQ,
//! docs/KV-EVENTS.md) into InferenceCache index updates. A library so the integration tests can drive
//! the same pipeline the binary runs.
//!
//! Data flow: [`ingest::read_loop`] (ZMQ SUB) → bounded queue → [`ingest::Processor`] (decode,
//! seq tracking, [`mapping`]) → bounded queue → [`sender::Sender`] (one long-lived gRPC stream)
//! ← [`stats::run`] (periodic engine scrape).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod app;
pub mod auth;
pub mod cli;
pub mod decode;
pub mod ingest;
pub mod mapping;
pub mod metrics;
pub mod nats;
pub mod sender;
pub mod seq;
pub mod state;
pub mod stats;
pub mod tls;
