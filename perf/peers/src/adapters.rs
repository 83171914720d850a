//! One [`Adapter`] per index. Each converts the simulator's events and lookups into the index's
//! own input inside the call, into reused buffers wherever the index's API takes borrowed input
//! (Dynamo's events and RadixTree lookups are taken by value: a fresh allocation each is its API).

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use dynamo_kv_router::indexer::concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::positional::{LevelIndex, PositionalIndexer};
use dynamo_kv_router::indexer::{RadixTree, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent, WorkerWithDpRank,
};
use fleetsim::{Adapter, Block};
use inferencecache_index::index::{
    BlockHashes, Index, IndexConfig, LookupQuery, Score, StridedHashes,
};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1 as pb;
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};

// ---------------------------------------------------------------------------------------------
// Ours
// ---------------------------------------------------------------------------------------------

const TENANT: &str = "bench";
const MODEL: &str = "model";
const SCHEME: &str = "xxh3-chain";
/// The simulation's time 0 in unix ns. Each call happens at its request's arrival
/// ([`Adapter::clock`]): producer timestamps of 0 mean "now" (§4.1), so an entry's `last_seen`
/// is when it was stored, and holders stored at different times score with different
/// freshness, as in a fleet (until 2026-12-07 every call used this one instant, every entry
/// had freshness 1, and an answer's replicas all scored alike: perf/runs/2026-12-07-layout-bound.md).
const EPOCH_NS: i64 = 1_800_000_000_000_000_000;
/// The tenants' TTL: longer than the trace (the Mooncake conversation trace spans 59 minutes),
/// so that the TTL never decides an answer (the ground truth knows no TTL) while an entry's
/// freshness still falls with its age (1 − age / TTL).
const TTL_NS: i64 = 24 * 3600 * 1_000_000_000;

/// Ours: `inferencecache_index::Index` through the calls a core makes
/// (`CoreState::ingest` → `Index::ingest` of a CacheStateUpdate whose one PrefixEntry is the
/// stored chain; `CoreState::apply_event` → `Index::apply_event` with PREFIX_EVICTED per removed
/// block and ALL_CLEARED; the lookup owner → `Index::lookup_route` with the chain as borrowed
/// 8-byte big-endian hashes and per-block token counts). Our contract keys blocks by the engine's
/// prefix (chain) hash on both sides — the gateway derives the same rolling hashes — so ours is
/// queried with the chain hashes where the peers take content hashes. The global cap is off
/// (`max_entries: 0`): the simulated workers evict, and their removals reach every index alike.
pub struct Ours {
    index: Index,
    tokens_per_block: i32,
    names: Vec<String>,
    counts: Vec<i32>,
    /// The messages handed to the index, reused (as a decoder's buffers would be) so that the
    /// measured time is the index's, not this adapter's allocations.
    update: pb::CacheStateUpdate,
    event: pb::CacheEvent,
    spare_hashes: Vec<Vec<u8>>,
    /// The worker of each interned replica id an answer has named (`u32::MAX`: not yet seen),
    /// so an answer's replicas map to workers by an array read, as kv-index's adapter maps its
    /// slots (`workers_of_slot`), not by parsing each name. An id names one string while that
    /// string is live; this harness never runs the reclaim pass that frees names (no sweep, far
    /// from the table's limit), so an id keeps its name for the whole run (checked in debug
    /// builds, and the ground-truth pass would see a wrong worker).
    worker_of_replica: Vec<u32>,
    /// The current call's time (unix ns; see [`EPOCH_NS`]).
    now: i64,
}

impl Ours {
    pub fn new(workers: u32, tokens_per_block: u32) -> Self {
        let config = IndexConfig {
            max_entries: 0,
            max_holders_per_key: (workers as usize).max(1024),
            default_ttl_ns: TTL_NS,
            ..IndexConfig::default()
        };
        Ours {
            index: Index::new(config),
            tokens_per_block: tokens_per_block as i32,
            names: (0..workers).map(|w| format!("w{w}")).collect(),
            counts: Vec::new(),
            update: pb::CacheStateUpdate {
                model_id: MODEL.into(),
                tenant_id: TENANT.into(),
                hash_scheme: SCHEME.into(),
                timestamp_us: 0,
                prefixes: vec![pb::PrefixEntry::default()],
                ..Default::default()
            },
            event: pb::CacheEvent {
                model_id: MODEL.into(),
                tenant_id: TENANT.into(),
                ..Default::default()
            },
            spare_hashes: Vec::new(),
            worker_of_replica: Vec::new(),
            now: EPOCH_NS,
        }
    }

    fn event(&mut self, worker: u32, kind: pb::cache_event::Type, hash: Option<u64>) {
        let e = &mut self.event;
        e.r#type = kind as i32;
        e.replica_id.clear();
        e.replica_id.push_str(&self.names[worker as usize]);
        e.prefix_hash.clear();
        if let Some(h) = hash {
            e.prefix_hash.extend_from_slice(&h.to_le_bytes());
        }
        self.index.apply_event(e, self.now, &NoRules);
    }
}

/// The chain hashes of `blocks` as the index's strided input, borrowed, not copied: each
/// block's `chain` word in memory order (little-endian), which is the byte string this adapter
/// stores and removes it under (hashes are opaque bytes to the index). The server hands the
/// index a received message's hashes the same way.
fn chain_hashes(blocks: &[Block]) -> StridedHashes<'_> {
    const STRIDE: usize = std::mem::size_of::<Block>();
    const CHAIN_AT: usize = std::mem::offset_of!(Block, chain);
    const _: () = assert!(
        STRIDE == 16 && CHAIN_AT == 8,
        "Block is repr(C): content, chain"
    );
    // SAFETY: `Block` is `repr(C)` of two u64 (asserted above): no padding, every byte
    // initialised, so its slice's memory is a valid `[u8]` for the slice's lifetime.
    let bytes = unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    };
    let chain = bytes.get(CHAIN_AT..).unwrap_or_default();
    StridedHashes::new(chain, STRIDE, blocks.len()).expect("whole blocks")
}

impl Adapter for Ours {
    fn name(&self) -> String {
        "ours (inferencecache-index Index)".into()
    }

    fn clock(&mut self, at_us: u64) {
        self.now = EPOCH_NS + at_us as i64 * 1000;
    }

    fn store(&mut self, worker: u32, _parent: Option<u64>, blocks: &[Block]) {
        let u = &mut self.update;
        u.replica_id.clear();
        u.replica_id.push_str(&self.names[worker as usize]);
        let p = &mut u.prefixes[0];
        while p.block_hashes.len() > blocks.len() {
            self.spare_hashes.extend(p.block_hashes.pop());
        }
        while p.block_hashes.len() < blocks.len() {
            p.block_hashes
                .push(self.spare_hashes.pop().unwrap_or_default());
        }
        for (h, b) in p.block_hashes.iter_mut().zip(blocks) {
            h.clear();
            h.extend_from_slice(&b.chain.to_le_bytes());
        }
        p.block_token_counts.clear();
        p.block_token_counts
            .resize(blocks.len(), self.tokens_per_block);
        self.index.ingest(u, self.now, &NoRules);
    }

    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        for &h in chain_hashes {
            self.event(worker, pb::cache_event::Type::PrefixEvicted, Some(h));
        }
    }

    fn clear(&mut self, worker: u32) {
        self.event(worker, pb::cache_event::Type::AllCleared, None);
    }

    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        out.clear();
        // An answer's matched tokens in whole blocks, as the ground truth counts them: a shift
        // when the block size is a power of two (every `--expand` that divides 512). This is
        // the harness's conversion, not the index's work; a division per answered replica was
        // 2-3% of the measured lookup at 1,024 workers (perf/runs/2026-12-07-table-removals.md).
        let per_block = self.tokens_per_block;
        let blocks_of = move |tokens: i32| {
            if per_block.count_ones() == 1 {
                (tokens >> per_block.trailing_zeros()) as u32
            } else {
                (tokens / per_block) as u32
            }
        };
        self.with_answer(blocks, |worker, s| {
            out.push((worker, blocks_of(s.matched_tokens)))
        });
    }
}

impl Ours {
    /// Looks `blocks` up as one chain and hands each answered replica's worker and score to
    /// `each`, in the answer's order.
    fn with_answer(&mut self, blocks: &[Block], mut each: impl FnMut(u32, &Score)) {
        self.counts.resize(blocks.len(), self.tokens_per_block);
        let query = LookupQuery {
            tenant: TENANT,
            model: MODEL,
            hash_scheme: SCHEME,
            adapter: "",
            prefix_hash: &[],
            token_count: 0,
            block_hashes: BlockHashes::Strided(chain_hashes(blocks)),
            block_token_counts: &self.counts[..blocks.len()],
            ttft_ms: 0,
            tbt_ms: 0,
        };
        let view = self.index.lookup_route(&query, self.now, &NoRules);
        let worker_of = &mut self.worker_of_replica;
        for s in view.scores {
            let id = s.replica as usize;
            if id >= worker_of.len() {
                worker_of.resize(id + 1, u32::MAX);
            }
            if worker_of[id] == u32::MAX {
                worker_of[id] = view.replica_id(s)[1..]
                    .parse()
                    .expect("replica ids are w<n>");
            }
            let worker = worker_of[id];
            debug_assert_eq!(view.replica_id(s), format!("w{worker}"));
            each(worker, s);
        }
    }

    /// The whole answer for `blocks` as (worker, score bits, matched tokens), in its order:
    /// what `examples/run_records.rs` compares its prototype's answers with.
    #[allow(dead_code)]
    pub fn lookup_scores(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32, i32)>) {
        out.clear();
        self.with_answer(blocks, |worker, s| {
            out.push((worker, s.score.to_bits(), s.matched_tokens))
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamo (dynamo-kv-router 1.6.1)
// ---------------------------------------------------------------------------------------------

/// A Dynamo event as its publishers build one (cf. its `test_utils::router_event`): the engine's
/// block hash as `ExternalSequenceBlockHash`, the content hash as `LocalBlockHash`, dp rank 0.
fn dynamo_event(worker: u32, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent::new(
        worker as u64,
        KvCacheEvent {
            event_id: id,
            data,
            dp_rank: 0,
        },
    )
}

fn dynamo_store(parent: Option<u64>, blocks: &[Block]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalSequenceBlockHash),
        start_position: None,
        blocks: blocks
            .iter()
            .map(|b| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(b.chain),
                tokens_hash: LocalBlockHash(b.content),
                mm_extra_info: None,
            })
            .collect(),
    })
}

fn dynamo_remove(chain_hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: chain_hashes
            .iter()
            .map(|&h| ExternalSequenceBlockHash(h))
            .collect(),
    })
}

fn dynamo_scores(scores: &OverlapScores, out: &mut Vec<(u32, u32)>) {
    out.clear();
    out.extend(scores.scores.iter().map(|(w, &s)| (w.worker_id as u32, s)));
}

/// RadixTree::find_matches takes the sequence by value: a fresh vector per lookup is its API.
fn local_hashes(blocks: &[Block]) -> Vec<LocalBlockHash> {
    blocks.iter().map(|b| LocalBlockHash(b.content)).collect()
}

/// The slice-taking lookups reuse one buffer.
fn fill_local_hashes(buf: &mut Vec<LocalBlockHash>, blocks: &[Block]) {
    buf.clear();
    buf.extend(blocks.iter().map(|b| LocalBlockHash(b.content)));
}

/// Dynamo's single-threaded `RadixTree`, driven synchronously: `apply_event(RouterEvent)` and
/// `find_matches(Vec<LocalBlockHash>, early_exit = false)` (full per-worker depths), as its
/// `KvIndexer` task does.
pub struct DynamoRadix {
    tree: RadixTree,
    next_id: u64,
}

impl DynamoRadix {
    pub fn new() -> Self {
        DynamoRadix {
            tree: RadixTree::new(),
            next_id: 0,
        }
    }

    fn apply_data(&mut self, worker: u32, data: KvCacheEventData) {
        self.next_id += 1;
        let _ = self
            .tree
            .apply_event(dynamo_event(worker, self.next_id, data));
    }
}

impl Adapter for DynamoRadix {
    fn name(&self) -> String {
        "Dynamo RadixTree (sync)".into()
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        self.apply_data(worker, dynamo_store(parent, blocks));
    }
    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        self.apply_data(worker, dynamo_remove(chain_hashes));
    }
    fn clear(&mut self, worker: u32) {
        self.apply_data(worker, KvCacheEventData::Cleared);
    }
    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        let scores = self.tree.find_matches(local_hashes(blocks), false);
        dynamo_scores(&scores, out);
    }
}

/// Dynamo's `PositionalIndexer` (jump size 64), driven synchronously: its `apply_event` with the
/// per-worker level maps its thread-pool lanes own (held here, since one caller applies every
/// event), and `SyncIndexer::find_matches` (full depths).
pub struct DynamoPositional {
    index: PositionalIndexer,
    hashes: Vec<LocalBlockHash>,
    worker_blocks: rustc_hash::FxHashMap<WorkerWithDpRank, LevelIndex>,
    next_id: u64,
}

/// The jump size of Dynamo's own benchmarks and docs ("e.g., 32" in its constructor docs; the
/// issue's first measurement used 64).
pub const POSITIONAL_JUMP: usize = 64;

impl DynamoPositional {
    pub fn new() -> Self {
        DynamoPositional {
            index: PositionalIndexer::new(POSITIONAL_JUMP),
            hashes: Vec::new(),
            worker_blocks: Default::default(),
            next_id: 0,
        }
    }

    fn apply_data(&mut self, worker: u32, data: KvCacheEventData) {
        self.next_id += 1;
        let event = dynamo_event(worker, self.next_id, data);
        let _ = self.index.apply_event(&mut self.worker_blocks, event, None);
    }
}

impl Adapter for DynamoPositional {
    fn name(&self) -> String {
        format!("Dynamo PositionalIndexer jump {POSITIONAL_JUMP} (sync)")
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        self.apply_data(worker, dynamo_store(parent, blocks));
    }
    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        self.apply_data(worker, dynamo_remove(chain_hashes));
    }
    fn clear(&mut self, worker: u32) {
        self.apply_data(worker, KvCacheEventData::Cleared);
    }
    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        fill_local_hashes(&mut self.hashes, blocks);
        let scores = SyncIndexer::find_matches(&self.index, &self.hashes, false);
        dynamo_scores(&scores, out);
    }
}

/// Dynamo's default indexer: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with `threads`
/// writer threads. Events go through its thread pool (`enqueue_event`, sticky per worker); reads
/// run inline on the caller (`find_matches` on the shared tree, as its `KvIndexerInterface` does)
/// after `flush()`, the barrier its docs give for benchmarks and tests to see every event.
pub struct DynamoThreadPool {
    pool: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    hashes: Vec<LocalBlockHash>,
    threads: usize,
    next_id: u64,
    pending: bool,
}

impl DynamoThreadPool {
    pub fn new(threads: usize, tokens_per_block: u32) -> Self {
        DynamoThreadPool {
            pool: ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                threads,
                tokens_per_block,
            ),
            hashes: Vec::new(),
            threads,
            next_id: 0,
            pending: false,
        }
    }

    fn enqueue(&mut self, worker: u32, data: KvCacheEventData) {
        self.next_id += 1;
        self.pool
            .enqueue_event(dynamo_event(worker, self.next_id, data))
            .expect("thread pool accepts events");
        self.pending = true;
    }
}

impl Adapter for DynamoThreadPool {
    fn name(&self) -> String {
        format!(
            "Dynamo ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, {} thread{}",
            self.threads,
            if self.threads == 1 { "" } else { "s" }
        )
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        self.enqueue(worker, dynamo_store(parent, blocks));
    }
    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        self.enqueue(worker, dynamo_remove(chain_hashes));
    }
    fn clear(&mut self, worker: u32) {
        self.enqueue(worker, KvCacheEventData::Cleared);
    }
    fn settle(&mut self) {
        if std::mem::take(&mut self.pending) {
            block_on(self.pool.flush());
        }
    }
    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        fill_local_hashes(&mut self.hashes, blocks);
        let scores = self.pool.backend().find_matches(&self.hashes, false);
        dynamo_scores(&scores, out);
    }
}

// ---------------------------------------------------------------------------------------------
// kv-index 2.0.0 (SGLang / Shepherd model gateway)
// ---------------------------------------------------------------------------------------------

/// kv-index's `ChainIndex` as its README and `tests/exactness_chain.rs` drive it: workers interned
/// by name (`intern_worker`, at most 1,024 slots: `with_max_workers`), one `ChainBlockMap` per
/// worker owned by the caller's lane, `apply_stored(worker, blocks, parent, map)`,
/// `apply_removed`, `apply_cleared`, and lookups through `score_into` (nothing allocated) over the
/// request's content hashes, full depths (`early_exit = false`).
pub struct KvIndexChain {
    index: ChainIndex,
    slots: Vec<u32>,
    /// slot → simulator worker.
    workers_of_slot: Vec<u32>,
    maps: Vec<ChainBlockMap>,
    stored: Vec<StoredBlock>,
    removed: Vec<SequenceHash>,
}

impl KvIndexChain {
    /// None when the fleet has more workers than kv-index's 1,024 slots.
    pub fn new(workers: u32) -> Option<Self> {
        let index = ChainIndex::with_max_workers(workers as usize);
        let mut slots = Vec::new();
        let mut workers_of_slot = Vec::new();
        for w in 0..workers {
            let slot = index
                .intern_worker(&format!("http://worker-{w}:8000"))
                .ok()?;
            slots.push(slot);
            if workers_of_slot.len() <= slot as usize {
                workers_of_slot.resize(slot as usize + 1, u32::MAX);
            }
            workers_of_slot[slot as usize] = w;
        }
        Some(KvIndexChain {
            index,
            slots,
            workers_of_slot,
            maps: (0..workers).map(|_| ChainBlockMap::default()).collect(),
            stored: Vec::new(),
            removed: Vec::new(),
        })
    }
}

impl Adapter for KvIndexChain {
    fn name(&self) -> String {
        "kv-index ChainIndex".into()
    }
    fn store(&mut self, worker: u32, parent: Option<u64>, blocks: &[Block]) {
        self.stored.clear();
        self.stored.extend(blocks.iter().map(|b| StoredBlock {
            seq_hash: SequenceHash(b.chain),
            content_hash: ContentHash(b.content),
        }));
        let slot = self.slots[worker as usize];
        let _ = self.index.apply_stored(
            slot,
            &self.stored,
            parent.map(SequenceHash),
            &mut self.maps[worker as usize],
        );
    }
    fn remove(&mut self, worker: u32, chain_hashes: &[u64]) {
        self.removed.clear();
        self.removed
            .extend(chain_hashes.iter().map(|&h| SequenceHash(h)));
        let slot = self.slots[worker as usize];
        self.index
            .apply_removed(slot, &self.removed, &mut self.maps[worker as usize]);
    }
    fn clear(&mut self, worker: u32) {
        let slot = self.slots[worker as usize];
        self.index
            .apply_cleared(slot, &mut self.maps[worker as usize]);
    }
    fn lookup(&mut self, blocks: &[Block], out: &mut Vec<(u32, u32)>) {
        out.clear();
        let workers = &self.workers_of_slot;
        self.index.score_into(
            blocks,
            |b| b.content,
            false,
            |slot, score| {
                out.push((workers[slot as usize], score));
            },
        );
    }
}

// ---------------------------------------------------------------------------------------------

/// Runs a future to completion on this thread (Dynamo's flush is async; its oneshot channels
/// need no runtime).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}
