//! `loadgen`: load generator and capacity planner for InferenceCache servers.
//!
//! It drives any server speaking `inferencecache.v1alpha1.InferenceCache` at a given address
//! with realistic traffic on both sides of the index: producers stream KV-block reports like
//! engine event subscribers, gateways ask `LookupRoute` where to send prompts built from the same
//! seeded workload, so hits happen the way they would in production. Latency is measured
//! coordinated-omission-correct in open loop and summarised with HDR histograms.
//!
//! Modules follow the concepts: [`cli`] (flags), [`workload`] (seeded prompts and blocks),
//! [`producer`] (ingest side), [`gateway`] (lookup side), [`driver`] (open/closed loop),
//! [`histogram`] (recording), [`report`] (table/JSON), [`capacity`] (rate search), [`run`]
//! (orchestration), [`trace`] (a trace replayed through the fleet simulator) and [`error`] (what a subcommand reports when it cannot run).

#![forbid(unsafe_code)]

pub mod capacity;
pub mod cli;
pub mod driver;
pub mod error;
pub mod gateway;
pub mod histogram;
pub mod producer;
pub mod report;
pub mod run;
pub mod slowlog;
pub mod trace;
pub mod workload;
