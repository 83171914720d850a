//! The KV-cache routing index, free of I/O and of any runtime so it can be unit-tested, property-
//! tested against a reference model and benched directly. The server owns one [`index::Index`]
//! per core; a request reaches the core that owns its `(tenant, model)` partition.

#![deny(unsafe_code)]

pub mod directory;
pub mod index;
mod keyhash;
pub mod policy;
mod prefetch;
pub mod resolve;
pub mod rules;
pub mod runstore;
mod segmap;

/// The block content fingerprint (docs/BEHAVIOUR.md §17), re-exported so `inferencecache_index::fingerprint`
/// paths keep working; code that needs only the fingerprint depends on that small crate directly.
pub use inferencecache_fingerprint as fingerprint;

/// The reserved tenant used by `/probe`; the gRPC handlers never index or answer for it.
pub const PROBE_TENANT: &str = "inferencecache.io/probe";
