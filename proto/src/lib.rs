//! The `inferencecache.v1alpha1` wire contract as Rust types, generated at build time from
//! `inferencecache/v1alpha1/inferencecache.proto`. Shared by the server, `loadgen` and the
//! KV-event subscriber so that every binary speaks exactly the same messages.

#![forbid(unsafe_code)]

/// Messages, enums, client and server for `inferencecache.v1alpha1`.
pub mod v1alpha1 {
    tonic::include_proto!("inferencecache.v1alpha1");
}

/// Encoded `FileDescriptorSet` of the contract, served by gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("inferencecache_descriptor");
