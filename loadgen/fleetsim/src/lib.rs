//! The fleet simulator (issue 31): replays a request trace in the Mooncake format onto `W`
//! simulated workers, each an LRU cache of `B` blocks, and produces once, in trace order, the KV
//! event stream (blocks stored with their parent, blocks removed) and the lookup stream, each
//! lookup with its ground-truth answer (matched prefix blocks per worker). Every index under test
//! (perf/peers, loadgen) then receives exactly the same streams and is checked against the same
//! answers ([`check`]).
//!
//! Nothing here knows any index: the hashes are caller-computed as routers expect them
//! ([`hashes`]), and [`Adapter`] is the one interface every index is driven through.

pub mod check;
pub mod hashes;
pub mod sim;
pub mod synth;
pub mod trace;

pub use check::{Adapter, Mismatch, ReferenceIndex, check_stream};
pub use hashes::Block;
pub use sim::{Event, Lookup, Op, SimConfig, Simulation, simulate};
pub use trace::{TraceRequest, parse_trace};
