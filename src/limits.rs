//! Every limit the server puts on a resource, in one place, with the relations between them
//! checked at compile time. A limit bounds memory, time or work a peer can make the server
//! spend; each module takes its limits from here, so a reader sees the whole budget at once.
//!
//! The index crate's own limits (the global entry cap, the policy body size, the prompt-text
//! size the resolver accepts) are re-exported here so this file stays the one list.

use std::time::Duration;

pub use inferencecache_index::index::{
    DEFAULT_MAX_ENTRIES, DEFAULT_MAX_FUTURE_SKEW_NS, DEFAULT_MAX_HOLDERS_PER_KEY,
    DEFAULT_MAX_KEYSPACES, DEFAULT_MAX_KEYSPACES_PER_MODEL, DEFAULT_MAX_REPLICAS_PER_SCOPE,
    DEFAULT_MAX_STATS_ROWS, DEFAULT_MAX_STATS_ROWS_PER_MODEL, DEFAULT_MAX_STRING_BYTES,
    MAX_STRINGS, RECLAIM_ON_FULL_BUDGET, RECLAIM_ON_FULL_INTERVAL_NS,
};
pub use inferencecache_index::policy::MAX_POLICY_BODY_BYTES;
pub use inferencecache_index::resolve::MAX_PROMPT_TEXT_BYTES;

/// Default `--max-timestamp-skew-ms`: how far ahead of the server's clock a producer timestamp
/// may be before it is clamped.
pub const DEFAULT_MAX_TIMESTAMP_SKEW_MS: u64 = (DEFAULT_MAX_FUTURE_SKEW_NS / 1_000_000) as u64;

/// Longest name (tenant, model, replica, hash scheme, adapter) the index accepts; an update
/// with a longer one is refused (`ID_TOO_LONG`), a lookup with one fails open.
pub const MAX_ID_BYTES: usize = 1024;

// ---- The index (per core; defaults of the `inferencecache-index` crate, re-exported above) ----
//
// * [`MAX_STRINGS`] (`--index-max-strings` lowers it) and [`DEFAULT_MAX_STRING_BYTES`]
//   (`--index-max-string-bytes`): distinct names a core holds at once, in number and in bytes.
//   Names are freed by the reclaim pass after every sweep (and at once, at most every
//   [`RECLAIM_ON_FULL_INTERVAL_NS`], when the table is full) once nothing refers to them. An
//   update whose new names do not fit is refused whole: `STRING_TABLE_FULL`.
// * [`DEFAULT_MAX_HOLDERS_PER_KEY`] (`--index-max-holders-per-key`): replicas holding one prefix
//   key; a further replica's upsert of a full key is refused, the rest of its update applied:
//   `KEY_HOLDERS_FULL`.
// * `inferencecache_index::runstore::MAX_KEYS` (~100M): prefix keys of one core's store; a new
//   key past it is refused, the rest of its update applied: `INDEX_KEYS_FULL`
//   (`inferencecache_limit_hits_total{limit="index_keys"}`).
// * `inferencecache_index::runstore::MAX_REPLICA_EXTENTS` (32) and `RUN_LEN_LIMIT` (4,096):
//   separate stretches of one replica in one run, and blocks in a run. An upsert needing a 33rd
//   stretch is refused, the rest of its update applied: `RUN_EXTENTS_FULL`; a cut from the middle
//   of a stretch at the bound removes the stretch's rest
//   (`inferencecache_limit_hits_total{limit="index_run_extents"}` for both). Keeps every upsert
//   and removal on a run within moving 32 × 1,024 extents.
// * [`DEFAULT_MAX_REPLICAS_PER_SCOPE`] (`--index-max-replicas-per-scope`): replicas serving in
//   one scope `(tenant, model, hash scheme)`. An update of a replica not serving there yet that
//   would be one more is refused whole: `SCOPE_REPLICAS_FULL`
//   (`inferencecache_limit_hits_total{limit="index_scope_replicas"}`). Keeps the scope's sorted
//   replica list (an insert is a memmove of it) and the reclaim pass's marking of its replicas
//   (one step) within a maintenance slice.
// * [`DEFAULT_MAX_STATS_ROWS_PER_MODEL`] and [`DEFAULT_MAX_STATS_ROWS`]: stats rows of one
//   `(tenant, model)` and of one core; a new row beyond either is refused: `STATS_ROWS_FULL`.
// * [`DEFAULT_MAX_KEYSPACES_PER_MODEL`] (`--index-max-keyspaces-per-model`) and
//   [`DEFAULT_MAX_KEYSPACES`] (`--index-max-keyspaces`): distinct keyspaces (adapters, across
//   hash schemes) of one `(tenant, model)` and of one core. An update that would create one
//   more is refused whole: `KEYSPACES_FULL` (`inferencecache_limit_hits_total{limit="index_keyspaces"}`).
//   Keyspaces without keys are freed by the reclaim pass (sliced, after every sweep, and at
//   once when the table is full, like names). The per-model bound keeps the loops over one
//   model's keyspaces (a `PREFIX_EVICTED` event without an adapter probes each) within a slice.
// * The reclaim pass runs in the sweep's slices ([`SWEEP_SLICE_BUDGET`]); an ingest that finds
//   a table full spends at most [`RECLAIM_ON_FULL_BUDGET`] on it.

/// Replica scores in one LookupRoute answer: the top-ranked ones are kept (docs/BEHAVIOUR.md
/// §9.6 order). Never reached with the default holder and stats-row bounds (see below).
pub const MAX_SCORES_PER_ANSWER: usize = 1024;

/// Replica-id buffers (of at most [`MAX_ID_BYTES`] each), and room in one score list, that a
/// core keeps from its encoded inline LookupRoute answers for its next ones
/// (`lookup::recycle`), so answers of up to this many scores allocate nothing: at most 64 KiB
/// per core.
pub const LOOKUP_SPARE_SCORES: usize = 64;

// ---- Cores and partitions -------------------------------------------------------------------

/// Fixed number of index partitions; larger than any core count so `--shards` never rehashes.
/// Defined with the partition function in the `inferencecache-partition` crate, which
/// shard-aware clients share.
pub const PARTITIONS: u32 = inferencecache_partition::PARTITIONS;
/// Upper bound on `--shards`: partitions are spread over at most this many cores.
pub const MAX_SHARDS: usize = 64;
/// Default `--busy-poll-us` on cores with a CPU each: long enough to catch a client's next call
/// after an answer over loopback at the 99th percentile (one call in flight, 100 µs caught the
/// median but not the tail; perf/RESULTS.md). The price is spin time while requests keep
/// coming: at 1,000 req/s a core uses about a third of its CPU instead of 9% (33–34% with the
/// watcher, 28–29% before it).
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(200);
/// Quiet connections one core watches while it spins (`runtime::watch`): each slice peeks at
/// every one of them with a `recv` call, so the list stays short; further quiet connections are
/// polled through io_uring as when the core does not spin.
pub const SPIN_WATCH_MAX_CONNECTIONS: usize = 64;
/// Longest stretch a spinning core's watcher peeks before it lets the reactor turn: what timers,
/// hops and unwatched connections may wait behind it (the clock is read every few peeks, each a
/// `recv` call, so a slice overruns by at most those).
pub const SPIN_WATCH_SLICE: Duration = Duration::from_micros(5);
/// glommio's own spin before parking on a core that spins (`--busy-poll-us`): the core's spin
/// is its watcher's, which waits a microsecond timer between slices; this bridges those waits so
/// the core does not park in them, and is all the core spins after the watcher stops.
pub const GLOMMIO_SPIN_UNDER_WATCH: Duration = Duration::from_micros(20);
/// glommio's preemption timer on every core: the longest a core runs tasks without polling its
/// I/O while tasks stay runnable. The executor polls I/O only once no task is runnable or this
/// timer fires (glommio's default: 100 ms); a busy gRPC connection (a flood, or a client
/// pipelining as fast as the core answers) stays runnable turn after turn, and the requests of
/// the core's other connections waited unseen in the kernel that long.
pub const CORE_PREEMPT_TIMER: Duration = Duration::from_millis(1);
/// Longest `--busy-poll-us` spin: past a millisecond a parked core's wake-up no longer matters.
pub const MAX_BUSY_POLL: Duration = Duration::from_millis(1);
/// Default `--shards` on machines with more than two CPUs is one per CPU, at most this many.
pub const DEFAULT_MAX_SHARDS: usize = 8;
/// io_uring registered memory per executor: small, since the cores do no file I/O and this
/// lets the server start without CAP_IPC_LOCK under the default 8 MiB `ulimit -l`.
pub const IO_MEMORY_BYTES: usize = 512 * 1024;
/// How long start-up waits for every executor to report that it runs.
pub const EXECUTOR_START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long start-up waits for an executor's report before it wakes the process's eventfds
/// (an executor parked before its first task: `sys::eventfd_kick`), then again at each such
/// interval. A core reports within milliseconds of its thread starting.
pub const EXECUTOR_START_KICK: Duration = Duration::from_millis(250);

/// How often each core stamps its heartbeat.
pub const CORE_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(250);
/// A core whose heartbeat is older than this is stalled: `/readyz` answers 503 and new work for
/// it fails at once.
pub const CORE_STALL_AFTER: Duration = Duration::from_secs(5);

// ---- The cross-core hop ---------------------------------------------------------------------

/// Operations in flight to one owner core from one sender, before senders see "full".
pub const MAILBOX_CAPACITY: usize = 1024;
/// Operations an owner executes per drain pass before yielding to its other tasks.
pub const MAILBOX_DRAIN_BATCH: usize = 64;
/// First and longest back-off of an ingest waiting for room in a full mailbox.
pub const MAILBOX_BACKOFF_MIN: Duration = Duration::from_micros(20);
/// See [`MAILBOX_BACKOFF_MIN`].
pub const MAILBOX_BACKOFF_MAX: Duration = Duration::from_millis(5);

// ---- gRPC connections -----------------------------------------------------------------------

/// Default bound on gRPC connections one core serves at once (`--max-connections-per-core`);
/// beyond it new connections are closed.
pub const DEFAULT_MAX_CONNECTIONS_PER_CORE: usize = 16_384;
/// Pending connections the kernel queues on the gRPC listener.
pub const LISTEN_BACKLOG: i32 = 1024;
/// Concurrent HTTP/2 streams allowed per gRPC connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;
/// gRPC's 4 MiB default receive limit, as in the reference (grpc-go defaults).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// Bytes above which a ReportCacheState or PublishEvent message is decoded on the decode pool
/// instead of on the serving core, which awaits it (`runtime::decode_pool`): decoding a 4 MiB
/// message of 250,000 prefixes took the core tens of ms in one poll. A message this size decodes
/// in well under a slice, so the common small message keeps its inline decode.
pub const OFFCORE_DECODE_MIN_BYTES: usize = 64 * 1024;
/// Threads of the decode pool (placed like the tokenizer's: on CPUs no serving core is pinned
/// to, else unpinned at a lower priority).
pub const DECODE_WORKERS: usize = 2;
/// Large messages admitted to the decode pool at once (queued or being decoded), all cores
/// together: one more fails its call at once with UNAVAILABLE ("decode pool saturated") and
/// `inferencecache_limit_hits_total{limit="offcore_decodes"}`, instead of queueing. Each holds its
/// message (at most `MAX_MESSAGE_BYTES`) and its decoded form until the worker is done.
pub const MAX_OFFCORE_DECODES: usize = 8;
/// Entries each of a core's inline LookupRoute decode buffers keeps between requests (block
/// hashes, token counts, token ids); a longer request's extra capacity is released after it.
pub const INLINE_DECODE_KEEP_ENTRIES: usize = 4096;
/// Bytes of incomplete request messages one gRPC connection may hold (a message is handed to
/// tonic only once whole); beyond it the stream fails with RESOURCE_EXHAUSTED.
pub const MAX_HELD_MESSAGE_BYTES_PER_CONNECTION: usize = 4 * (MAX_MESSAGE_BYTES + 5);
/// Bytes of incomplete request messages all connections of one core may hold.
pub const MAX_HELD_MESSAGE_BYTES_PER_CORE: usize = 256 * 1024 * 1024;
/// Longest a request message may take to arrive once its first byte did; a slower one fails
/// its stream with DEADLINE_EXCEEDED.
pub const MESSAGE_RECEIVE_TIMEOUT: Duration = Duration::from_secs(30);
/// HTTP/2 flow-control window of one gRPC stream and of one connection (hyper's defaults,
/// which the server used before it spoke h2 directly).
pub const HTTP2_STREAM_WINDOW_BYTES: u32 = 1024 * 1024;
/// See [`HTTP2_STREAM_WINDOW_BYTES`].
pub const HTTP2_CONNECTION_WINDOW_BYTES: u32 = 1024 * 1024;
/// Largest request header block (HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE; hyper's default).
pub const HTTP2_MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;
/// Largest HPACK-encoded header block (HEADERS plus CONTINUATION frames) a peer may send; past
/// it the connection is closed (GOAWAY ENHANCE_YOUR_CALM). Twice the list bound, since an
/// encoded block can exceed its decoded list only through padding-free literals.
pub const HTTP2_MAX_HEADER_BLOCK_BYTES: usize = 2 * HTTP2_MAX_HEADER_LIST_BYTES as usize;
/// Output bytes one gRPC connection buffers; past it the connection reads no more input until
/// the peer reads, so a peer that never reads cannot grow the server's memory.
pub const HTTP2_WRITE_BUFFER_BYTES: usize = 256 * 1024;
/// Streams a connection remembers having closed (and how: END_STREAM, the peer's reset or
/// ours), so a late frame on one gets the reaction RFC 9113 §5.1 gives its closed state: frames
/// in flight after this server's reset are dropped, HEADERS or DATA after the peer ended its
/// side is a stream error STREAM_CLOSED. Past it a stream is forgotten: DATA on it is
/// STREAM_CLOSED, HEADERS a connection error PROTOCOL_ERROR (an id below the highest, §5.1.1).
/// 8 bytes each, allocated as the connection closes streams.
pub const HTTP2_RECENT_CLOSED_STREAMS: usize = 128;
/// Decoded request-head bytes of the streams open on one core's gRPC connections: streams that
/// send a head and then nothing (up to 16 KiB each, a few bytes on the wire with HPACK) cannot
/// pin more than this; past it new streams are refused with REFUSED_STREAM
/// (`inferencecache_limit_hits_total{limit="http2_header_bytes_per_core"}`). A general-path
/// stream's head costs about twice its decoded size in memory (the `http` request built from
/// it), so this bounds such heads to roughly 70 MB per core. Typical heads are a few hundred
/// bytes: tens of thousands of concurrent calls per core fit.
pub const HTTP2_MAX_HEADER_BYTES_PER_CORE: usize = 32 * 1024 * 1024;
/// Response body bytes one gRPC connection may hold queued on its streams (answers waiting for
/// the peer's flow-control window); past it the connection refuses new streams with
/// REFUSED_STREAM until they drain, so a peer that never reads cannot make the server hold
/// answer after answer (`inferencecache_limit_hits_total{limit="http2_queued_response_bytes"}`).
pub const HTTP2_MAX_QUEUED_RESPONSE_BYTES: usize = 16 * 1024 * 1024;
/// Response bytes the HTTP/2 layer queues per general-path stream before the handler waits for the
/// peer's window (hyper's default).
pub const HTTP2_MAX_SEND_BUFFER_BYTES: usize = 400 * 1024;
/// Frames one gRPC connection handles in a turn before it yields to the core's other tasks
/// (the rest stay in its read buffer, which is not read further until they are handled): a
/// flooding connection delays the other connections on its core by at most one such turn
/// (`inferencecache_limit_hits_total{limit="http2_frames_per_turn"}` counts the cut turns).
/// About a hundred pipelined unary calls.
pub const HTTP2_FRAMES_PER_TURN: usize = 256;
/// How long one gRPC connection's turn may handle frames, once it has handled
/// [`HTTP2_TURN_MIN_FRAMES`] (from there the clock is read every [`HTTP2_TURN_CLOCK_EVERY`]
/// frames, so a turn of a few frames, a unary call, never reads it): frames that cost more than others (header blocks
/// decoded to the list bound, an HPACK bomb) would hold the core for milliseconds within the
/// frame budget. The rest wait for the connection's next turn, behind the core's other runnable
/// tasks (`inferencecache_limit_hits_total{limit="http2_turn_time"}` counts the turns cut short).
pub const HTTP2_TURN_TIME: Duration = Duration::from_micros(200);
/// See [`HTTP2_TURN_TIME`].
pub const HTTP2_TURN_CLOCK_EVERY: usize = 4;
/// Frames a turn handles before [`HTTP2_TURN_TIME`] applies: the time is wall time, so on a
/// loaded machine (a slow debug build, the thread preempted) a turn cut after a handful of
/// frames would spend more on the turn itself than on frames.
pub const HTTP2_TURN_MIN_FRAMES: usize = 32;
/// Stream errors (RST_STREAM other than REFUSED_STREAM, CANCEL or NO_ERROR) a peer may cause on
/// one connection; past it the connection is closed with GOAWAY ENHANCE_YOUR_CALM
/// (`limit="http2_stream_error_resets"`): server-induced resets ("MadeYouReset",
/// CVE-2025-8671) make the server reset streams it may already be serving. h2's default.
pub const HTTP2_MAX_STREAM_ERROR_RESETS: u32 = 1024;
/// Streams a peer may reset before ending its request (RST_STREAM on a stream open on its
/// side) in one second on one connection; past it GOAWAY ENHANCE_YOUR_CALM
/// (`limit="http2_peer_resets"`): rapid reset (CVE-2023-44487). A call cancelled after its
/// request was sent whole (a deadline) is not counted; twice the streams a peer may have
/// open, so a client abandoning everything it is still sending is not cut off.
pub const HTTP2_MAX_PEER_RESETS_PER_SECOND: u32 = 2 * MAX_CONCURRENT_STREAMS;
/// SETTINGS frames (not ACKs) a peer may send in one second on one connection; past it GOAWAY
/// ENHANCE_YOUR_CALM (`limit="http2_settings_frames"`). A client sends a handful in a
/// connection's life.
pub const HTTP2_MAX_SETTINGS_PER_SECOND: u32 = 100;
/// PING frames (not ACKs) a peer may send in one second on one connection, not counting one
/// after the server sent DATA (a BDP probe, one per round trip while a client receives);
/// past it GOAWAY ENHANCE_YOUR_CALM (`limit="http2_ping_frames"`). Keep-alive pings come
/// every few seconds at most.
pub const HTTP2_MAX_PINGS_PER_SECOND: u32 = 1000;
/// PRIORITY frames a peer may send per stream it opened (plus one stream's worth), on one
/// connection; past it GOAWAY ENHANCE_YOUR_CALM (`limit="http2_priority_frames"`). Priorities
/// are not used; Envoy's default.
pub const HTTP2_MAX_PRIORITY_FRAMES_PER_STREAM: u64 = 100;
/// WINDOW_UPDATE frames a peer may send per DATA frame this server sent it (plus 100), on one
/// connection; past it GOAWAY ENHANCE_YOUR_CALM (`limit="http2_window_update_frames"`). A
/// client returns window for what it received, at most a connection and a stream update per
/// frame; Envoy's default ratio.
pub const HTTP2_MAX_WINDOW_UPDATES_PER_DATA_FRAME: u64 = 10;
/// Frames in a row with an empty payload that end nothing (DATA without END_STREAM,
/// HEADERS or CONTINUATION without END_HEADERS) a peer may send; past it GOAWAY
/// ENHANCE_YOUR_CALM (`limit="http2_empty_frames"`): they cost the server a frame each and
/// move nothing forward (an empty-DATA flood, a header block held open by empty CONTINUATION
/// frames, which the block's byte bound does not see).
pub const HTTP2_MAX_CONSECUTIVE_EMPTY_FRAMES: u32 = 64;
/// Longest a client may take to send the HTTP/2 preface after connecting (or after the TLS
/// handshake); a connection that stays silent is closed.
pub const HTTP2_PREFACE_TIMEOUT: Duration = Duration::from_secs(10);
/// Interval of HTTP/2 keep-alive pings on a gRPC connection.
pub const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);
/// A peer that does not answer a keep-alive ping within this is disconnected.
pub const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest a client may take to complete the TLS handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest graceful drain of gRPC connections after SIGTERM.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

// ---- TTL sweep (docs/BEHAVIOUR.md §6, docs/ARCHITECTURE.md §1) -----------------------------

/// Core time one TTL sweep slice may take before the core returns to serving; a lookup queued
/// behind the sweep waits at most about this long (plus one key's removals). A quarter of the
/// 1 ms bound on that wait: the trace of the 10M-entry probe showed a few requests waiting
/// across two slices, and slices stretched by the kernel (perf/RESULTS.md).
pub const SWEEP_SLICE_BUDGET: Duration = Duration::from_micros(250);
/// Storage entries (plus stats rows) one sweep slice examines at most; a slice stops at
/// whichever of this and the time budget comes first.
pub const SWEEP_SLICE_MAX_ENTRIES: usize = 16_384;
/// Least time one TTL sweep pass waits, in all, for ingests between their apply and their
/// evictions before it runs anyway (`runtime::sweep_pass`; the pass's budget is its interval
/// when that is longer). A sweep slice run inside an ingest could expire an entry the ingest's
/// cap eviction would have taken, so the outcome would depend on timing; the bound keeps a
/// stream of ingests from holding the sweep off forever. With a short interval (tests use
/// 20 ms) the interval alone ran out on a loaded machine and `--shards 2` counted TTL evictions
/// where `--shards 1` counted cap evictions (perf/runs/2026-12-07-maintenance-lane.md).
pub const SWEEP_INGEST_WAIT_MIN: Duration = Duration::from_secs(2);
/// Pause between two sweep slices: a timer, so the core polls its sockets and runs whatever
/// arrived (a bare task yield would not reach the socket poll while the sweep stays runnable).
pub const SWEEP_SLICE_PAUSE: Duration = Duration::from_micros(20);
/// Maintenance pieces (sweep, cap and ingest slices) one core holds waiting for its
/// maintenance lane, which lets one run per reactor turn (`runtime::lane`): one per ingest
/// stream in a slice on the core, plus the sweep and the cap build. Reserved at start; past it a
/// piece runs without waiting (`inferencecache_limit_hits_total{limit="maintenance_lane_waiters"}`).
pub const MAINTENANCE_LANE_MAX_WAITERS: usize = 1_024;

// ---- Cap candidates built ahead of need (docs/ARCHITECTURE.md §3, index eviction docs) -----

/// How often each core checks, unprompted, whether to build its next global-cap candidate heap
/// ahead of need (only with `--index-max-entries` set, near the cap, and the live heap missing
/// or half used). The operations that can make one wanted (ingests, evictions, policy
/// changes) wake the check at once; this poll is a safety net, long so an idle core sleeps.
pub const CAP_PREBUILD_POLL: Duration = Duration::from_secs(1);
/// Core time one slice of a cap candidate build may take before the core returns to serving
/// (a lookup queued behind it waits at most about this long); slices are
/// [`SWEEP_SLICE_PAUSE`] apart, like the sweep's.
pub const CAP_BUILD_SLICE_BUDGET: Duration = Duration::from_micros(250);
/// Blocks (legacy prefixes count one, a chain entry its blocks) of one ReportCacheState
/// message applied in one step on its owner core: a larger message is applied in parts of about
/// this many, 20 µs apart, the core serving requests between two (`ingest::apply_update`). A
/// 4 MiB message of 250,000 legacy prefixes took its core 125 ms in one step before.
pub const INGEST_PART_BLOCKS: usize = 4_096;
/// Blocks each name or keyspace a part of a ReportCacheState message creates counts as, toward
/// its [`INGEST_PART_BLOCKS`]: a part of new adapters (a keyspace and often a name each) ends
/// after 241–455 of them, ≈ 0.13 ms of core time, where 4,096 took ≈ 1.1 ms in one part
/// (perf/runs/2026-12-06-h30d.md). Deterministic, unlike [`INGEST_PART_BUDGET`].
pub const INGEST_PART_BLOCKS_PER_CREATED: usize = 8;
/// Core time one part of a ReportCacheState message may take: the part ends after the entry
/// that finds it spent (the clock is read every 32 entries; a part applies at least one), and
/// the rest follows in later parts. Whatever the shape: 4,096 new keys in one adapter took
/// ≈ 0.8–0.9 ms in one part (perf/runs/2026-12-06-h30d.md).
pub const INGEST_PART_BUDGET: Duration = Duration::from_micros(250);
/// Global-cap evictions one step runs at most when an ingest took the index over the cap (one
/// core; also bounded by [`CAP_BUILD_SLICE_BUDGET`] of time): the ingest's own step evicts this
/// many, the rest run in later slices the ingest waits for before it is acknowledged
/// (`evict::Pending`). A message of 4,096 new entries at the cap used to evict all of them in
/// its own step, ≈ 4 ms of core time.
pub const CAP_ENFORCE_SLICE_MAX_EVICTIONS: usize = 1_024;
/// Global-cap evictions one cross-core round takes at most (several cores): each core's
/// candidate request and its share of the evictions are one piece each, and both name every
/// entry by its strings (the cores intern names apart): rounds of
/// [`CAP_ENFORCE_SLICE_MAX_EVICTIONS`] made 0.76 ms candidate pieces and 0.94 ms eviction pieces
/// in the adversarial soak at `--shards 2`, rounds of 256 0.35–0.40 and 0.26–0.31 ms, rounds of
/// 128 0.17–0.37 and 0.12–0.31 ms, with no fewer evictions per second
/// (perf/runs/2026-12-07-soak-windows.md). The globally first victims in rounds are the same
/// set whatever the round size.
pub const CAP_ROUND_MAX_EVICTIONS: usize = 128;
/// Times a cross-core cap round asks every core for its candidates when one ran out of live
/// ones (stale snapshots) and readied more in slices instead of building them in one go
/// (`evict::cap_candidates_everywhere`, counted in
/// `inferencecache_core_cap_candidate_retries_total`); the last time a core may build in one go.
pub const MAX_CAP_CANDIDATE_ROUNDS: usize = 8;
/// Cap build slices one ingest runs at most before it is applied, when it may evict at the cap
/// and the victims are not ready (`mailbox::call_after_maintenance`): about a second of slices,
/// more than a build over the largest per-core index takes. Past it (policy pushes restarting
/// every build), the ingest builds its victims itself, counted in
/// `inferencecache_core_cap_builds_sync_total`, rather than wait without end. Slices of its
/// tenant's quota heap build (`CoreState::cap_slice_before`) count towards the same bound
/// (past it: `inferencecache_core_quota_builds_sync_total`).
pub const MAX_CAP_SLICES_BEFORE_INGEST: usize = 4_096;
/// Storage entries (plus candidate reorder steps) one cap build slice handles at
/// most; a slice stops at whichever of this and the time budget comes first.
pub const CAP_BUILD_SLICE_MAX_ENTRIES: usize = 16_384;

// ---- Warm-restart snapshots (`--state-dir`, docs/ARCHITECTURE.md §6) ------------------------

/// Default period of the per-core snapshots (`--snapshot-interval-ms`).
pub const DEFAULT_SNAPSHOT_INTERVAL_MS: u64 = 60_000;
/// Shortest accepted `--snapshot-interval-ms`.
pub const MIN_SNAPSHOT_INTERVAL_MS: u64 = 100;
/// Core time one snapshot slice may take before the core returns to serving; a lookup queued
/// behind snapshot work waits at most about this long.
pub const SNAPSHOT_SLICE_BUDGET: Duration = Duration::from_micros(500);
/// Entries one snapshot slice encodes at most (bounds the slice's buffer, about 40 B per entry
/// plus names); a slice stops at whichever of this and the time budget comes first.
pub const SNAPSHOT_SLICE_MAX_ENTRIES: usize = 16_384;
/// Largest section body a snapshot may hold; longer sections are refused at restore before
/// they are read, so one section is all a restore holds in memory at a time.
pub const MAX_SNAPSHOT_SECTION_BYTES: usize = 16 * 1024 * 1024;
/// Largest snapshot file accepted at restore (a larger or longer one is skipped as
/// `too_large`). Far above a full 10M-entry core file (about 400 MB).
pub const MAX_SNAPSHOT_FILE_BYTES: u64 = 16 * 1024 * 1024 * 1024;
/// Longest the final snapshot at SIGTERM may take (after the gRPC drain); past it the write is
/// abandoned, the previous complete snapshot stays in place and the process exits.
pub const SNAPSHOT_SHUTDOWN_BUDGET: Duration = Duration::from_secs(15);

// ---- Metrics ---------------------------------------------------------------------------------

/// Distinct values one label of one family keeps; further values share one overflow series.
pub const MAX_LABEL_VALUES: usize = 1024;
/// Longest label value kept as is; longer values share the overflow series.
pub const MAX_LABEL_VALUE_BYTES: usize = 256;

// ---- Admin HTTP listeners -------------------------------------------------------------------

/// hyper's header-read timeout on the HTTP listeners (the reference's `ReadHeaderTimeout`).
pub const HTTP_READ_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a request body (`/policy`, `/probe`) may take to arrive.
pub const HTTP_BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Open connections across both admin HTTP listeners; further ones are closed at once.
pub const MAX_HTTP_CONNECTIONS: usize = 512;
/// How long shutdown waits for in-flight HTTP requests (the reference's 5 s budget).
pub const HTTP_SHUTDOWN_BUDGET: Duration = Duration::from_secs(5);
/// Longest a `/metrics` scrape or `/snapshot` waits for one core's copy; a core that does not
/// answer in time is left out instead of hanging the request.
pub const GATHER_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest `/probe` request body.
pub const MAX_PROBE_BODY_BYTES: usize = 4 * 1024;
/// Longest a probe run waits for the owner core.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

// ---- Controller authentication --------------------------------------------------------------

/// How long a successful TokenReview is trusted.
pub const AUTH_CACHE_TTL: Duration = Duration::from_secs(30);
/// Tokens remembered per endpoint.
pub const AUTH_CACHE_CAPACITY: usize = 32;
/// How long a denied token (401/403) is remembered, so repeating it costs no review.
pub const AUTH_NEGATIVE_CACHE_TTL: Duration = Duration::from_secs(5);
/// Denied tokens remembered per endpoint.
pub const AUTH_NEGATIVE_CACHE_CAPACITY: usize = 1024;
/// TokenReview calls in flight in the whole process; further requests get 503 at once.
pub const MAX_CONCURRENT_TOKEN_REVIEWS: usize = 8;
/// Longest a TokenReview call may take.
pub const TOKEN_REVIEW_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest TokenReview response body read.
pub const MAX_TOKEN_REVIEW_RESPONSE_BYTES: usize = 1 << 20;
/// Shortest static controller token accepted (`--controller-token-file`).
pub const MIN_STATIC_TOKEN_BYTES: usize = 16;

// ---- Producer identity, authorization and fencing (docs/OPERATIONS.md "Hardened setup") ----

/// Producer tokens whose successful TokenReview is remembered (for [`AUTH_CACHE_TTL`]); one per
/// engine sidecar in a large fleet, so far more than the controller endpoints' 32.
pub const PRODUCER_TOKEN_CACHE_CAPACITY: usize = 4096;
/// Certificate SANs (URI and DNS names) kept as a producer's identity; further names are ignored.
pub const MAX_PRODUCER_IDENTITY_NAMES: usize = 16;
/// Largest `--producer-policy` file read; a larger one is refused like a malformed one.
pub const MAX_PRODUCER_POLICY_BYTES: u64 = 1 << 20;
/// Bindings of one producer policy file.
pub const MAX_PRODUCER_BINDINGS: usize = 4096;
/// How often the admin thread checks `--producer-policy` for a change.
pub const PRODUCER_POLICY_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// `(tenant, replica)` producer epochs the server remembers for fencing; past it a new replica's
/// epoch is not recorded (its messages are accepted unfenced, counted in
/// `inferencecache_limit_hits_total{limit="producer_epochs"}`).
pub const MAX_PRODUCER_EPOCHS: usize = 65_536;
/// Longest random part of an `x-producer-epoch` value.
pub const MAX_PRODUCER_EPOCH_ID_BYTES: usize = 64;

// ---- prompt_text tokenization ---------------------------------------------------------------

/// Default tokenizer worker threads: tokenization is a side path, and on small machines every
/// extra thread competes with the serving cores, so a couple of workers is enough to hide one
/// slow prompt behind another.
pub const DEFAULT_TOKENIZER_WORKERS: usize = 2;
/// Upper bound on tokenizer worker threads, whatever the configuration says.
pub const MAX_TOKENIZER_WORKERS: usize = 16;
/// Most tokens one tokenization may produce.
pub const MAX_TOKENS: usize = 1 << 20;
/// Tokenizations admitted at once; the next call fails open at once.
pub const MAX_CONCURRENT_TOKENIZE: usize = 64;
/// Largest `tokenizer.json` / `*.tiktoken` file loaded.
pub const MAX_TOKENIZER_FILE_BYTES: u64 = 256 << 20;
/// Largest `tokenizer_config.json` loaded.
pub const MAX_TOKENIZER_CONFIG_FILE_BYTES: u64 = 16 << 20;
/// Largest chat template file loaded.
pub const MAX_TEMPLATE_FILE_BYTES: u64 = 1 << 20;
/// Deepest directory level searched for models.
pub const MAX_MODEL_DIR_DEPTH: usize = 16;
/// Most tokenizer models loaded.
pub const MAX_TOKENIZER_MODELS: usize = 256;

// ---- Tenant templates (RenderTemplate) -------------------------------------------------------

/// Largest template source accepted by `PUT /templates/{tenant}/{ref}`.
pub const MAX_TEMPLATE_BYTES: usize = 64 * 1024;
/// Largest `PUT /templates/...` body: the source JSON-escaped (at most 6 bytes per byte for
/// `\u00XX`) plus the envelope.
pub const MAX_TEMPLATE_BODY_BYTES: usize = 6 * MAX_TEMPLATE_BYTES + 4096;
/// Longest template revision (and tokenizer model id) in a registration.
pub const MAX_TEMPLATE_REVISION_BYTES: usize = 256;
/// Templates one tenant may register.
pub const MAX_TEMPLATES_PER_TENANT: usize = 256;
/// Templates registered in the whole process.
pub const MAX_TEMPLATES: usize = 4096;
/// Work budget of one render (minijinja fuel: about one unit per instruction and per 64 bytes
/// created); bounds both the time a render takes on a serving core and the memory it allocates.
pub const TEMPLATE_RENDER_FUEL: u64 = 50_000;
/// Largest rendered prompt: the `prompt_text` limit, so a rendered prompt can be sent as is.
pub const MAX_RENDERED_PROMPT_BYTES: usize = MAX_PROMPT_TEXT_BYTES;

// ---- Prefill/decode topologies (LookupPDRoute) ------------------------------------------------

/// Topologies registered in the whole process (`PUT /pd-topologies/{tenant}/{ref}`).
pub const MAX_PD_TOPOLOGIES: usize = 1024;
/// Replicas one pool (prefill or decode) of a topology may list.
pub const MAX_PD_POOL_REPLICAS: usize = 256;
/// Largest `PUT /pd-topologies/...` body (two full pools of the longest names fit).
pub const MAX_PD_TOPOLOGY_BODY_BYTES: usize = 1 << 20;
/// How much less loaded (in reported `pressure`, 0..1) a decode replica that holds the request's
/// prefix counts when the decode replica is picked. A tuning constant, not a resource bound.
pub const PD_DECODE_AFFINITY_BONUS: f32 = 0.1;

// ---- Streams (StreamCacheEvents, StreamMetrics) -----------------------------------------------

/// Upper bound on `--max-event-subscribers` (concurrent StreamCacheEvents subscribers).
pub const MAX_EVENT_SUBSCRIBERS: usize = 256;
/// Changes queued per StreamCacheEvents subscriber; past it the subscriber is lagging: it gets
/// what is queued and then `RESOURCE_EXHAUSTED`, and publishing never waits for it.
pub const EVENT_SUBSCRIBER_BUFFER: usize = 4096;
/// `PREFIX_EVICTED` changes one ingest's cap or quota evictions may hold back on the owner core
/// until that ingest's own changes are published (so a subscriber never sees an entry evicted
/// before it was added); past it the rest are dropped and every subscriber that wants evictions
/// is told it fell behind (`limit="event_removal_burst"`). A subscriber's queue holds no more.
pub const EVENT_REMOVAL_BURST: usize = EVENT_SUBSCRIBER_BUFFER;
/// Upper bound on `--max-metric-subscribers` (concurrent StreamMetrics subscribers).
pub const MAX_METRIC_SUBSCRIBERS: usize = 64;
/// How often StreamMetrics sends the requested series.
pub const METRIC_STREAM_INTERVAL: Duration = Duration::from_secs(1);
/// Names one StreamMetrics request may list.
pub const MAX_METRIC_STREAM_NAMES: usize = 64;
/// Series one StreamMetrics subscriber gets per interval.
pub const MAX_METRIC_STREAM_SERIES: usize = 4096;
/// Series queued per StreamMetrics subscriber (two intervals' worth).
pub const METRIC_STREAM_BUFFER: usize = 2 * MAX_METRIC_STREAM_SERIES;

// ---- The JetStream event log consumer (src/nats/, one per replica, on the admin thread) ----

/// Stream messages the replica's consumer holds delivered and not yet applied: the pull batch
/// of its ordered consumer (each message is applied, in stream order, before the next).
pub const NATS_MAX_IN_FLIGHT: usize = 256;
/// How often the consumer reads the stream's last sequence to compute the lag.
pub const NATS_LAG_POLL_INTERVAL: Duration = Duration::from_millis(250);
/// Back-off between attempts to (re)connect, find the stream and (re)create the consumer.
pub const NATS_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest back-off between those attempts.
pub const NATS_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Time limit of one JetStream API request (stream info, consumer create).
pub const NATS_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Default `--nats-ready-max-lag`: `/readyz` answers 503 until, once after start, the stream's
/// last sequence is at most this many messages ahead of the last applied one.
pub const DEFAULT_NATS_READY_MAX_LAG: u64 = 100;
/// With `--nats-log-writer`: ingest messages this server has handed to JetStream and whose
/// publish acknowledgement it still awaits, all calls together. One more fails its call at once
/// with `UNAVAILABLE` ("event log writer saturated"; the producer retries) instead of queueing:
/// each in-flight publish holds its message (at most `MAX_MESSAGE_BYTES`) until JetStream answers or
/// [`NATS_REQUEST_TIMEOUT`] passes.
pub const NATS_WRITER_MAX_IN_FLIGHT: usize = 64;

// ---- How the limits relate ------------------------------------------------------------------

const _: () = assert!(
    MAX_SHARDS <= PARTITIONS as usize,
    "every core owns a partition"
);
const _: () = assert!(DEFAULT_MAX_SHARDS <= MAX_SHARDS);
const _: () = assert!(
    MAX_SHARDS <= inferencecache_index::directory::ENTRY_SLOTS,
    "every core counts its entries in a directory slot of its own"
);
const _: () = assert!(CORE_HEARTBEAT_INTERVAL.as_millis() * 4 <= CORE_STALL_AFTER.as_millis());
const _: () = assert!(MAILBOX_DRAIN_BATCH <= MAILBOX_CAPACITY);
const _: () = assert!(MAILBOX_BACKOFF_MIN.as_nanos() <= MAILBOX_BACKOFF_MAX.as_nanos());
const _: () = assert!(NATS_BACKOFF_MIN.as_nanos() <= NATS_BACKOFF_MAX.as_nanos());
const _: () = assert!(
    MAX_PROMPT_TEXT_BYTES <= MAX_MESSAGE_BYTES,
    "prompt fits a message"
);
const _: () = assert!(
    MAX_HELD_MESSAGE_BYTES_PER_CONNECTION > MAX_MESSAGE_BYTES
        && MAX_HELD_MESSAGE_BYTES_PER_CONNECTION <= MAX_HELD_MESSAGE_BYTES_PER_CORE,
    "a largest message can always be held, and one connection cannot spend a core's budget"
);
const _: () = assert!(
    HTTP2_MAX_HEADER_BLOCK_BYTES >= HTTP2_MAX_HEADER_LIST_BYTES as usize
        && HTTP2_WRITE_BUFFER_BYTES >= 4 * 16_384,
    "a header list within its bound always fits a block; the output holds several frames"
);
const _: () = assert!(MAX_PROBE_BODY_BYTES < MAX_POLICY_BODY_BYTES);
const _: () = assert!(
    MAX_SCORES_PER_ANSWER * (MAX_ID_BYTES + 64) <= MAX_MESSAGE_BYTES / 2,
    "a full answer stays well under the clients' 4 MiB receive limit"
);
const _: () = assert!(
    DEFAULT_MAX_HOLDERS_PER_KEY <= MAX_SCORES_PER_ANSWER
        && DEFAULT_MAX_STATS_ROWS_PER_MODEL <= MAX_SCORES_PER_ANSWER,
    "with the defaults every qualifying replica is returned, as in the reference"
);
const _: () = assert!(DEFAULT_MAX_STATS_ROWS_PER_MODEL <= DEFAULT_MAX_STATS_ROWS);
const _: () = assert!(
    MAX_ID_BYTES <= DEFAULT_MAX_STRING_BYTES,
    "one longest name fits an empty table"
);
const _: () = assert!(MAX_STRINGS <= 1 << 24, "replica ids are stored in 24 bits");
const _: () = assert!(DEFAULT_MAX_KEYSPACES_PER_MODEL <= DEFAULT_MAX_KEYSPACES);
const _: () = assert!(
    DEFAULT_MAX_KEYSPACES_PER_MODEL <= 8192,
    "a PREFIX_EVICTED event without an adapter probes every keyspace of its model"
);
const _: () = assert!(
    RECLAIM_ON_FULL_BUDGET.as_micros() <= SWEEP_SLICE_BUDGET.as_micros(),
    "an ingest that found a table full spends at most a maintenance slice on the reclaim pass"
);
const _: () = assert!(
    RECLAIM_ON_FULL_INTERVAL_NS > 0 && RECLAIM_ON_FULL_INTERVAL_NS <= 60_000_000_000,
    "a full table reclaims more often than the once-a-minute sweep"
);
const _: () = assert!(MAX_TEMPLATES_PER_TENANT <= MAX_TEMPLATES);
const _: () = assert!(
    2 * MAX_PD_POOL_REPLICAS * (MAX_ID_BYTES + 8) < MAX_PD_TOPOLOGY_BODY_BYTES,
    "two full pools of the longest names fit a topology body"
);
const _: () = assert!(MAX_TEMPLATE_BYTES < MAX_TEMPLATE_BODY_BYTES);
const _: () = assert!(
    MAX_RENDERED_PROMPT_BYTES < MAX_MESSAGE_BYTES,
    "a rendered prompt fits the answer"
);
const _: () = assert!(DEFAULT_TOKENIZER_WORKERS <= MAX_TOKENIZER_WORKERS);
const _: () = assert!(
    OFFCORE_DECODE_MIN_BYTES < MAX_MESSAGE_BYTES && DECODE_WORKERS <= MAX_OFFCORE_DECODES,
    "large messages can reach the decode pool, and every worker can have a job"
);
const _: () = assert!(AUTH_NEGATIVE_CACHE_TTL.as_secs() <= AUTH_CACHE_TTL.as_secs());
const _: () = assert!(
    GATHER_TIMEOUT.as_secs() < HTTP_SHUTDOWN_BUDGET.as_secs(),
    "a scrape in flight finishes within the shutdown budget"
);
const _: () = assert!(
    MAX_MESSAGE_BYTES + 64 * 1024 < MAX_SNAPSHOT_SECTION_BYTES,
    "an entry with the longest hash a message can carry fits one section"
);
const _: () = assert!(
    MAX_PRODUCER_EPOCHS * 32 <= MAX_SNAPSHOT_SECTION_BYTES,
    "the producer epoch table fits one snapshot section"
);
const _: () = assert!(
    SNAPSHOT_SLICE_MAX_ENTRIES * 64 <= MAX_SNAPSHOT_SECTION_BYTES,
    "a slice stays well within a few sections"
);
