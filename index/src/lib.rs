//! The KV-cache routing index, free of I/O and of any runtime so it can be unit-tested, property-
//! tested against a reference model and benched directly. The server owns one [`index::Index`]
//! per core; a request reaches the core that owns its `(tenant, model)` partition.

pub mod fingerprint;
pub mod rules;

/// The reserved tenant used by `/probe`; the gRPC handlers never index or answer for it.
pub const PROBE_TENANT: &str = "inferencecache.io/probe";
pub mod directory;
pub mod index;
pub mod policy;
pub mod resolve;
