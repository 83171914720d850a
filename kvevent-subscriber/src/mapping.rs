//! Engine events → index operations (docs/KV-EVENTS.md §3).
//!
//! The index is keyed by the *content* fingerprint of the tokens (docs/BEHAVIOUR.md §17), because
//! engine hashes are seeded per process and differ between replicas. Engine hashes therefore
//! live only in a bounded per-publisher reverse map (engine hash → prefix hash, cumulative
//! tokens, adapter, media holding the block), which is what lets a child block continue its
//! parent's chain and a `BlockRemoved` name the index key to evict.

use std::sync::Arc;

use inferencecache_fingerprint::for_each_prefix_hash;
use inferencecache_proto::v1alpha1::{CacheTier, PrefixEntry, ReplicaStats};
use lru::LruCache;

use crate::cli::AdapterMap;
use crate::decode::{Batch, BlockRemoved, BlockStored, EngineHash, Event, ExtraKey};
use crate::metrics::Metrics;
use crate::state::PublisherKey;

/// Where the index should learn something; the sender turns these into gRPC traffic.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Upsert entries for `replica` (batched with other adds by the sender).
    Add {
        /// Replica the entries belong to.
        replica: String,
        /// Batch timestamp in µs (0 = server "now").
        ts_us: i64,
        /// One entry per block.
        entries: Vec<PrefixEntry>,
    },
    /// Evict keys of `replica`; pending adds are flushed before it (ordering barrier).
    Evict {
        /// Replica losing the keys.
        replica: String,
        /// Batch timestamp in µs.
        ts_us: i64,
        /// `(8-byte BE prefix hash, adapter)` per evicted block.
        keys: Vec<(Vec<u8>, String)>,
    },
    /// Forget everything of `replica`; pending adds of the replica are dropped first.
    Clear {
        /// Replica whose cache was emptied.
        replica: String,
        /// Batch timestamp in µs.
        ts_us: i64,
    },
    /// Every operation before this one covers the publisher's batches up to `seq`: once they
    /// are acknowledged, `seq` is what the state file remembers (`--state-file`).
    Checkpoint {
        /// The publisher.
        key: PublisherKey,
        /// Its last applied batch.
        seq: u64,
    },
    /// Stats-only update for `replica`.
    Stats {
        /// Replica the stats describe.
        replica: String,
        /// Engine stats.
        stats: ReplicaStats,
    },
}

/// `kv_cache_spec_kind` values whose groups hold every block of a cached prefix (vLLM's
/// `KVCacheSpecKind`); stores of other kinds are not indexed (docs/KV-EVENTS.md §5).
pub const FULL_PREFIX_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// Longest adapter id the server accepts (longer names are refused with `ID_TOO_LONG`,
/// docs/BEHAVIOUR.md).
pub const MAX_ADAPTER_BYTES: usize = 1024;

/// Mapping knobs, from the flags.
#[derive(Debug, Clone)]
pub struct MappingConfig {
    /// Base replica id.
    pub replica_id: String,
    /// Suffix the replica id with `-dp<rank>` when the batch carries a dp rank.
    pub replica_per_dp_rank: bool,
    /// Engine LoRA number → adapter name.
    pub adapters: AdapterMap,
    /// Fall back to the event's `lora_name` for unmapped numbers.
    pub use_lora_name: bool,
    /// Overrides the events' `block_size`.
    pub block_size_override: Option<i32>,
    /// A GPU removal leaves the block in an offload tier (re-reported as T2).
    pub offload_keeps_blocks: bool,
    /// Only this KV-cache group is indexed (events without a group always are).
    pub kv_cache_group: i64,
    /// Reverse-map capacity per publisher.
    pub reverse_map_capacity: usize,
}

/// Bit set of cache media holding a block; the hottest present medium decides the tier.
type Media = u8;
const GPU: Media = 1;
const CPU: Media = 2;
const COLD: Media = 4;

/// Classifies an event's `medium`: nil/GPU → T1, CPU variants → T2, anything else that is an
/// offload tier (DISK, EXTERNAL, unknown names) → T3.
fn medium_bit(medium: Option<&str>) -> Media {
    match medium {
        None => GPU,
        Some(m) if m.eq_ignore_ascii_case("gpu") || m.is_empty() => GPU,
        Some(m) if m.to_ascii_uppercase().starts_with("CPU") => CPU,
        Some(_) => COLD,
    }
}

fn tier_of(media: Media) -> Option<CacheTier> {
    if media & GPU != 0 {
        Some(CacheTier::T1)
    } else if media & CPU != 0 {
        Some(CacheTier::T2)
    } else if media & COLD != 0 {
        Some(CacheTier::T3)
    } else {
        None
    }
}

/// What the reverse map remembers of one engine block.
#[derive(Debug, Clone)]
struct BlockInfo {
    prefix: u64,
    tokens: i64,
    adapter: Arc<str>,
    media: Media,
    /// Why the block is not indexed, when it (or an ancestor) is more than its tokens (cache
    /// salt, multimodal input, prompt embeddings): a token fingerprint would alias other
    /// content (docs/KV-EVENTS.md §5).
    skip: Option<&'static str>,
}

impl BlockInfo {
    fn reportable(&self) -> bool {
        self.skip.is_none()
    }
}

/// Per-publisher mapping state: the bounded reverse map. The seq tracker lives beside it in the
/// pipeline.
pub struct PublisherState {
    /// Unbounded in the type (so a new publisher allocates nothing up front), bounded by
    /// `capacity` on every insert.
    blocks: LruCache<EngineHash, BlockInfo>,
    capacity: usize,
    replica: String,
}

impl PublisherState {
    /// Fresh state for the publisher of `dp_rank`.
    pub fn new(cfg: &MappingConfig, dp_rank: Option<i64>) -> Self {
        Self {
            blocks: LruCache::unbounded(),
            capacity: cfg.reverse_map_capacity.max(1),
            replica: replica_for(cfg, dp_rank),
        }
    }

    /// Replica id this publisher reports as.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// Engine blocks remembered.
    pub fn known_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Forgets every block and tells the index to forget the replica (engine restart or
    /// `AllBlocksCleared`).
    pub fn clear(&mut self, ts_us: i64, out: &mut Vec<Op>) {
        self.blocks.clear();
        out.push(Op::Clear {
            replica: self.replica.clone(),
            ts_us,
        });
    }
}

/// Replica id for a publisher: `<id>-dp<rank>` when configured and the rank is known.
pub fn replica_for(cfg: &MappingConfig, dp_rank: Option<i64>) -> String {
    match dp_rank {
        Some(r) if cfg.replica_per_dp_rank => format!("{}-dp{r}", cfg.replica_id),
        _ => cfg.replica_id.clone(),
    }
}

/// `ts × 1e6` rounded, 0 when `ts <= 0` (server treats 0 as "now").
pub fn ts_to_us(ts: f64) -> i64 {
    if ts > 0.0 && ts.is_finite() {
        (ts * 1e6).round() as i64
    } else {
        0
    }
}

/// Stateless mapping logic applied to a publisher's state.
pub struct Mapper {
    cfg: MappingConfig,
    metrics: Arc<Metrics>,
}

impl Mapper {
    /// Builds a mapper.
    pub fn new(cfg: MappingConfig, metrics: Arc<Metrics>) -> Self {
        Self { cfg, metrics }
    }

    /// The mapping configuration.
    pub fn config(&self) -> &MappingConfig {
        &self.cfg
    }

    /// Maps every event of `batch` in order, appending operations to `out`.
    pub fn apply_batch(&self, st: &mut PublisherState, batch: &Batch, out: &mut Vec<Op>) {
        let ts_us = ts_to_us(batch.ts);
        for ev in &batch.events {
            match ev {
                Event::BlockStored(e) => {
                    self.metrics.event("BlockStored");
                    self.stored(st, e, ts_us, out);
                }
                Event::BlockRemoved(e) => {
                    self.metrics.event("BlockRemoved");
                    self.removed(st, e, ts_us, out);
                }
                Event::AllBlocksCleared => {
                    self.metrics.event("AllBlocksCleared");
                    st.clear(ts_us, out);
                }
                Event::Unknown => self.metrics.event("unknown"),
                Event::Invalid(err) => {
                    self.metrics.event("invalid");
                    self.metrics.drop_n("invalid_event", 1);
                    tracing::warn!(error = %err, replica = %st.replica, "skipping invalid event");
                }
            }
        }
    }

    fn in_group(&self, group: Option<i64>) -> bool {
        group.is_none_or(|g| g == self.cfg.kv_cache_group)
    }

    /// The adapter partition of a stored event (docs/KV-EVENTS.md §5): a `lora_id` mapped by
    /// `--lora-adapter-names` → that name; else a non-empty `lora_name` (unless
    /// `--use-lora-name=false`); else, when neither `lora_id` nor `lora_name` is set, the base
    /// model `""`. An event that names an adapter in any way but resolves to no name is `None`
    /// (dropped): adapter KV must never be filed under the base model.
    ///
    /// A name longer than the server accepts ([`MAX_ADAPTER_BYTES`]) drops the event too (the
    /// server would refuse the whole message).
    fn adapter(&self, e: &BlockStored) -> Result<Arc<str>, &'static str> {
        let name = e.lora_name.as_deref().filter(|n| !n.is_empty());
        let resolved = if let Some(mapped) = e.lora_id.and_then(|id| self.cfg.adapters.get(&id)) {
            mapped.as_str()
        } else if e.lora_id.is_none() && name.is_none() {
            ""
        } else {
            name.filter(|_| self.cfg.use_lora_name)
                .ok_or("unmapped_adapter")?
        };
        if resolved.len() > MAX_ADAPTER_BYTES {
            return Err("adapter_name_too_long");
        }
        Ok(Arc::from(resolved))
    }

    /// Why block `i` of `e` must not be indexed, from the event's cache salt (SGLang) or the
    /// block's extra keys (vLLM) once a leading LoRA name equal to `lora_name` is set aside
    /// (the adapter partition carries it).
    fn block_skip(e: &BlockStored, i: usize) -> Option<&'static str> {
        if e.cache_salt.as_deref().is_some_and(|s| !s.is_empty()) {
            return Some("cache_salt");
        }
        let Some(Some(keys)) = e.extra_keys.get(i) else {
            return None;
        };
        let mut rest = keys.as_slice();
        if let (Some(ExtraKey::Str(first)), Some(name)) = (rest.first(), e.lora_name.as_deref())
            && first == name
        {
            rest = &rest[1..];
        }
        rest.first().map(|k| match k {
            ExtraKey::Str(_) => "cache_salt",
            ExtraKey::Multimodal => "multimodal",
            ExtraKey::Binary => "prompt_embeds",
            ExtraKey::Other => "extra_keys",
        })
    }

    fn stored(&self, st: &mut PublisherState, e: &BlockStored, ts_us: i64, out: &mut Vec<Op>) {
        let n = e.block_hashes.len();
        if n == 0 {
            return;
        }
        if !self.in_group(e.group_idx) {
            self.metrics.drop_n("other_kv_group", n as u64);
            return;
        }
        if e.kv_cache_spec_kind
            .as_deref()
            .is_some_and(|k| !FULL_PREFIX_KINDS.contains(&k))
        {
            // A sliding-window / chunked-local / state-space group keeps only part of a
            // prefix: its blocks say nothing about a full prefix match, even when
            // `--kv-cache-group` names it.
            self.metrics.drop_n("not_full_attention", n as u64);
            return;
        }
        let bit = medium_bit(e.medium.as_deref());
        if e.token_ids.is_empty() {
            let entries = self.stored_copy(st, e, bit);
            self.push_add(st, ts_us, entries, out);
            return;
        }
        let adapter = match self.adapter(e) {
            Ok(a) => a,
            Err(reason) => {
                self.metrics.drop_n(reason, n as u64);
                return;
            }
        };
        let Some(bs) = self.stored_block_size(e) else {
            return;
        };
        let entries = self.stored_blocks(st, e, adapter, bs, bit);
        self.push_add(st, ts_us, entries, out);
    }

    /// A copy of already-known blocks into another medium (e.g. CPU offload): no tokens, so only
    /// blocks in the reverse map can be (re-)reported, and only when their tier changes.
    fn stored_copy(
        &self,
        st: &mut PublisherState,
        e: &BlockStored,
        bit: Media,
    ) -> Vec<PrefixEntry> {
        let mut entries = Vec::new();
        for h in &e.block_hashes {
            let Some(info) = st.blocks.get_mut(h) else {
                self.metrics.drop_n("unknown_block", 1);
                continue;
            };
            let before = tier_of(info.media);
            info.media |= bit;
            let after = tier_of(info.media);
            if info.reportable() && after != before {
                entries.push(entry(info, after.unwrap_or(CacheTier::T1)));
            }
        }
        entries
    }

    /// The block size of a stored event with tokens (the override, else the event's), or None
    /// (counted as dropped) when it is out of range or the tokens do not split into the blocks.
    fn stored_block_size(&self, e: &BlockStored) -> Option<i64> {
        let n = e.block_hashes.len();
        let bs = match self.cfg.block_size_override.map(i64::from).or(e.block_size) {
            Some(bs) if bs > 0 && bs <= i64::from(i32::MAX) => bs,
            _ => {
                self.metrics.drop_n("bad_block_size", n as u64);
                return None;
            }
        };
        if e.token_ids.len() as u64 != n as u64 * bs as u64 {
            self.metrics.drop_n("token_count_mismatch", n as u64);
            tracing::debug!(
                blocks = n,
                tokens = e.token_ids.len(),
                block_size = bs,
                "token_ids do not split into the stored blocks"
            );
            return None;
        }
        Some(bs)
    }

    /// Fingerprints the stored blocks' tokens onto their parent's prefix and records each block
    /// in the reverse map; returns the entries to report. A salted / multimodal block (and every
    /// block after it) is remembered but not reported (counted under its reason).
    fn stored_blocks(
        &self,
        st: &mut PublisherState,
        e: &BlockStored,
        adapter: Arc<str>,
        bs: i64,
        bit: Media,
    ) -> Vec<PrefixEntry> {
        let mut entries = Vec::new();
        let (parent, base_tokens, mut skip) =
            match e.parent_block_hash.as_ref().and_then(|p| st.blocks.get(p)) {
                Some(p) => (Some(p.prefix), p.tokens, p.skip),
                None => (None, 0, None),
            };
        let mut i = 0usize;
        for_each_prefix_hash(&e.token_ids, bs as i32, parent, |prefix| {
            skip = skip.or_else(|| Self::block_skip(e, i));
            let tokens = base_tokens + (i as i64 + 1) * bs;
            let key = e.block_hashes[i].clone();
            let media = st.blocks.peek(&key).map_or(0, |b| b.media) | bit;
            let info = BlockInfo {
                prefix,
                tokens,
                adapter: adapter.clone(),
                media,
                skip,
            };
            match skip {
                None => entries.push(entry(&info, tier_of(media).unwrap_or(CacheTier::T1))),
                Some(reason) => self.metrics.drop_n(reason, 1),
            }
            st.blocks.put(key, info);
            while st.blocks.len() > st.capacity {
                st.blocks.pop_lru();
            }
            i += 1;
        });
        entries
    }

    fn removed(&self, st: &mut PublisherState, e: &BlockRemoved, ts_us: i64, out: &mut Vec<Op>) {
        if !self.in_group(e.group_idx) {
            self.metrics
                .drop_n("other_kv_group", e.block_hashes.len() as u64);
            return;
        }
        let bit = medium_bit(e.medium.as_deref());
        let kept_by_offload = self.cfg.offload_keeps_blocks && bit == GPU;
        let mut keys = Vec::new();
        let mut rereport = Vec::new();
        for h in &e.block_hashes {
            // `peek_mut`-style access without promoting: a removed block is not "recently used".
            let Some(info) = st.blocks.peek_mut(h) else {
                self.metrics.drop_n("unknown_block", 1);
                continue;
            };
            let before = tier_of(info.media);
            info.media &= !bit;
            if kept_by_offload {
                info.media |= CPU;
            }
            let after = tier_of(info.media);
            if !info.reportable() || before == after {
                continue;
            }
            match after {
                // Kept in the map (media empty) so descendants stored later still chain.
                None => keys.push((info.prefix.to_be_bytes().to_vec(), info.adapter.to_string())),
                Some(t) => rereport.push(entry(info, t)),
            }
        }
        if !keys.is_empty() {
            out.push(Op::Evict {
                replica: st.replica.clone(),
                ts_us,
                keys,
            });
        }
        self.push_add(st, ts_us, rereport, out);
    }

    fn push_add(
        &self,
        st: &PublisherState,
        ts_us: i64,
        entries: Vec<PrefixEntry>,
        out: &mut Vec<Op>,
    ) {
        if !entries.is_empty() {
            out.push(Op::Add {
                replica: st.replica.clone(),
                ts_us,
                entries,
            });
        }
    }
}

fn entry(info: &BlockInfo, tier: CacheTier) -> PrefixEntry {
    PrefixEntry {
        prefix_hash: info.prefix.to_be_bytes().to_vec(),
        token_count: i32::try_from(info.tokens).unwrap_or(i32::MAX),
        block_hashes: Vec::new(),
        block_token_counts: Vec::new(),
        tier: tier as i32,
        adapter_id: info.adapter.to_string(),
    }
}
