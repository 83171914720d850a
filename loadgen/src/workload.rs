//! Deterministic workload generation: the prompts gateways look up and the KV blocks producers
//! report. Everything here is a pure function of [`WorkloadConfig`] (including its seed), so a
//! fixed `--seed` reproduces the exact request sequence, the preload population and the blocks
//! each replica stores, independent of timing or of the server under test.
//!
//! Token sequences are fingerprinted with the contract's block fingerprint
//! (`inferencecache_fingerprint`, docs/BEHAVIOUR.md §17), so the chain a gateway sends and the
//! per-block legacy entries a producer reports (docs/CONFORMANCE.md §Q) use identical keys.

use std::collections::HashMap;
use std::sync::Arc;

use inferencecache_fingerprint as fingerprint;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde::Serialize;

use crate::error::ConfigError;

/// Workload shapes: they differ in how much prompt prefix is shared and with whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// Shared system prompts followed by multi-turn conversations that grow turn by turn and stay
    /// on one replica: long shared prefixes, high hit potential.
    Chat,
    /// Shared instruction prompt, then a few corpus chunks picked by popularity, then a unique
    /// question: hits only as deep as the leading chunk order is shared.
    Rag,
    /// Independent single-turn prompts drawn uniformly from a population: little sharing.
    Diffuse,
}

/// Every knob of the generated workload. Serialized into the report so a result always records
/// what produced it.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadConfig {
    /// Shape of the prompts.
    pub kind: WorkloadKind,
    /// RNG seed: the only source of randomness in the workload.
    pub seed: u64,
    /// Number of engine replicas (producers); replica `r` serves model `r % models`.
    pub replicas: u32,
    /// Number of tenants (`tenant-0` …).
    pub tenants: u32,
    /// Number of models (`model-0` …).
    pub models: u32,
    /// Number of LoRA adapters besides the base partition (`adapter-1` …); 0 = base only.
    pub adapters: u32,
    /// `hash_scheme` sent on every update and lookup (the engine domain).
    pub hash_scheme: String,
    /// Tokens per KV block; must equal the server's `--engine-block-size` for `token_ids` lookups.
    pub block_size: u32,
    /// Lower bound of the per-prompt unique token count.
    pub min_tokens: u32,
    /// Mean of the per-prompt unique token count (shifted exponential, truncated at max).
    pub mean_tokens: u32,
    /// Upper bound of the per-prompt unique token count.
    pub max_tokens: u32,
    /// Population size: chat conversations in flight, RAG corpus chunks, diffuse prompts.
    pub population: u32,
    /// Shared system/instruction prompts per (tenant, model).
    pub system_prompts: u32,
    /// Length of each shared system/instruction prompt in tokens.
    pub system_prompt_tokens: u32,
    /// Chat: turns per conversation before it is replaced by a fresh one.
    pub turns: u32,
    /// RAG: tokens per corpus chunk.
    pub chunk_tokens: u32,
    /// RAG: chunks per prompt.
    pub chunks_per_prompt: u32,
    /// Popularity skew (Zipf exponent) for picking conversations, system prompts and chunks;
    /// 0 = uniform.
    pub zipf: f64,
    /// Token ids are drawn from `0..vocab`.
    pub vocab: u32,
}

impl WorkloadConfig {
    /// Rejects configurations that cannot generate a meaningful workload, with a message that
    /// names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("--replicas", self.replicas),
            ("--tenants", self.tenants),
            ("--models", self.models),
            ("--block-size", self.block_size),
            ("--population", self.population),
            ("--system-prompts", self.system_prompts),
            ("--turns", self.turns),
            ("--vocab", self.vocab),
        ];
        for (flag, v) in positive {
            if v == 0 {
                return Err(ConfigError::NotPositive(flag));
            }
        }
        if self.models > self.replicas {
            return Err(ConfigError::Rule(
                "--models must be <= --replicas (every model needs a replica)",
            ));
        }
        if !(self.min_tokens <= self.mean_tokens && self.mean_tokens <= self.max_tokens) {
            return Err(ConfigError::Rule(
                "need --min-tokens <= --mean-tokens <= --max-tokens",
            ));
        }
        if self.max_tokens > 1 << 20 {
            return Err(ConfigError::Rule(
                "--max-tokens must be <= 1048576 (the server's MaxLookupTokens)",
            ));
        }
        if !self.zipf.is_finite() || self.zipf < 0.0 {
            return Err(ConfigError::Negative("--zipf"));
        }
        if self.block_size > i32::MAX as u32 {
            return Err(ConfigError::Rule("--block-size too large"));
        }
        Ok(())
    }

    /// Wire name of tenant `t`.
    pub fn tenant_name(t: u32) -> String {
        format!("tenant-{t}")
    }

    /// Wire name of model `m`.
    pub fn model_name(m: u32) -> String {
        format!("model-{m}")
    }

    /// Wire name of adapter `a`; adapter 0 is the base (default, empty) partition.
    pub fn adapter_name(a: u32) -> String {
        if a == 0 {
            String::new()
        } else {
            format!("adapter-{a}")
        }
    }

    /// Wire id of replica `r`, zero-padded so byte order equals numeric order.
    pub fn replica_name(r: u32) -> String {
        format!("replica-{r:04}")
    }

    /// Replicas serving model `m` (replica `r` serves model `r % models`).
    pub fn replicas_of_model(&self, m: u32) -> Vec<u32> {
        (0..self.replicas)
            .filter(|r| r % self.models == m)
            .collect()
    }
}

/// Precomputed wire strings, so the hot path never formats names.
#[derive(Clone, Debug)]
pub struct Names {
    /// `tenant-{t}` by index.
    pub tenants: Vec<String>,
    /// `model-{m}` by index.
    pub models: Vec<String>,
    /// Adapter names by index (index 0 = "").
    pub adapters: Vec<String>,
    /// Replica ids by index.
    pub replicas: Vec<String>,
}

impl Names {
    /// All names of `cfg`'s population.
    pub fn new(cfg: &WorkloadConfig) -> Self {
        Names {
            tenants: (0..cfg.tenants).map(WorkloadConfig::tenant_name).collect(),
            models: (0..cfg.models).map(WorkloadConfig::model_name).collect(),
            adapters: (0..=cfg.adapters)
                .map(WorkloadConfig::adapter_name)
                .collect(),
            replicas: (0..cfg.replicas)
                .map(WorkloadConfig::replica_name)
                .collect(),
        }
    }
}

/// Which (tenant, model, adapter) partition a prompt belongs to; the hash scheme is global.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope {
    /// Tenant index.
    pub tenant: u32,
    /// Model index.
    pub model: u32,
    /// Adapter index (0 = base partition).
    pub adapter: u32,
}

/// One prompt to route and then "execute": the gateway looks up its first `n_blocks` blocks, and
/// afterwards the executing replica stores them (its producer reports the new ones).
#[derive(Clone, Debug)]
pub struct RequestSpec {
    /// Position in the request sequence (0-based); equal seeds give equal specs per index.
    pub index: u64,
    /// Partition of the prompt.
    pub scope: Scope,
    /// Prompt tokens (may be longer than the prompt; only `..n_tokens` belongs to it).
    pub tokens: Arc<[u32]>,
    /// Prompt length in tokens.
    pub n_tokens: usize,
    /// Rolling prefix hashes of the full blocks of `tokens` (may be longer than the prompt).
    pub hashes: Arc<[u64]>,
    /// Full blocks of the prompt (`n_tokens / block_size`).
    pub n_blocks: usize,
    /// Replica that executes the prompt and therefore caches its blocks.
    pub replica: u32,
}

/// Blocks a replica stores: the first `n_blocks` prefix hashes of `hashes` in `scope`.
#[derive(Clone, Debug)]
pub struct StoreOp {
    /// Partition the blocks belong to.
    pub scope: Scope,
    /// Rolling prefix hashes (block j covers `(j + 1) * block_size` tokens).
    pub hashes: Arc<[u64]>,
    /// Number of leading blocks stored.
    pub n_blocks: usize,
}

impl RequestSpec {
    /// The store operation that executing this prompt causes on its replica.
    pub fn store_op(&self) -> StoreOp {
        StoreOp {
            scope: self.scope,
            hashes: self.hashes.clone(),
            n_blocks: self.n_blocks,
        }
    }
}

/// Stream tags mixed into derived seeds so that independent parts of the workload never share
/// random streams (changing one population size does not reshuffle another).
mod tag {
    pub const SYSTEM: u64 = 1;
    pub const CONV: u64 = 2;
    pub const CHUNK: u64 = 3;
    pub const PROMPT: u64 = 4;
    pub const SEQUENCE: u64 = 5;
    pub const QUESTION: u64 = 6;
    pub const PRELOAD: u64 = 7;
}

/// SplitMix64 finaliser: turns (seed, tag, id…) into well-mixed independent seeds.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Derives a seed for one independent random stream.
fn derive(seed: u64, tag: u64, a: u64, b: u64) -> u64 {
    mix(mix(mix(seed ^ mix(tag)) ^ a) ^ b.rotate_left(17))
}

/// A portable seeded RNG (xoshiro256++ has a fixed, documented output sequence).
pub fn rng_for(seed: u64) -> Xoshiro256PlusPlus {
    Xoshiro256PlusPlus::seed_from_u64(seed)
}

/// `len` token ids from the stream `seed`.
fn gen_tokens(seed: u64, len: usize, vocab: u32, out: &mut Vec<u32>) {
    let mut rng = rng_for(seed);
    out.extend((0..len).map(|_| rng.random_range(0..vocab)));
}

/// Rolling prefix hashes of every full block (docs/BEHAVIOUR.md §17).
pub fn block_hashes(tokens: &[u32], block_size: u32) -> Vec<u64> {
    fingerprint::prefix_hashes(tokens, block_size as i32, None)
}

/// Zipf sampler over `0..n` by inverse CDF (precomputed once, O(log n) per draw).
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// Weights `1 / (k + 1)^s`; `s = 0` is uniform.
    pub fn new(n: u32, s: f64) -> Self {
        let n = n.max(1);
        let mut acc = 0.0;
        let mut cdf = Vec::with_capacity(n as usize);
        for k in 0..n {
            acc += 1.0 / ((k + 1) as f64).powf(s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    /// Draws an index; lower indices are more popular.
    pub fn sample(&self, rng: &mut impl RngExt) -> u32 {
        let u: f64 = rng.random();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u32
    }
}

/// Draws a unique-token count: `min + Exp(mean - min)`, redrawn (at most 8 times) above `max`,
/// then clamped. A heavy-ish tail like real prompt lengths, with exact bounds.
pub fn sample_len(cfg: &WorkloadConfig, rng: &mut impl RngExt) -> usize {
    let (lo, mean, hi) = (
        cfg.min_tokens as f64,
        cfg.mean_tokens as f64,
        cfg.max_tokens as f64,
    );
    if hi <= lo || mean <= lo {
        return cfg.min_tokens as usize;
    }
    for _ in 0..8 {
        let u: f64 = rng.random();
        let v = lo - (mean - lo) * (1.0 - u).ln();
        if v <= hi {
            return v.round() as usize;
        }
    }
    cfg.max_tokens as usize
}

/// Draws a (tenant, model, adapter) partition uniformly.
fn scope_from(cfg: &WorkloadConfig, rng: &mut impl RngExt) -> Scope {
    Scope {
        tenant: rng.random_range(0..cfg.tenants),
        model: rng.random_range(0..cfg.models),
        adapter: rng.random_range(0..=cfg.adapters),
    }
}

/// A prompt kept in memory with its fingerprint (computed once).
#[derive(Clone, Debug)]
struct Doc {
    scope: Scope,
    tokens: Arc<[u32]>,
    hashes: Arc<[u64]>,
    replica: u32,
}

/// One chat conversation slot: replaced by a fresh conversation after `turns` turns.
#[derive(Clone, Debug)]
struct ChatSlot {
    epoch: u64,
    turn: u32,
    doc: Doc,
    /// Token offset where the conversation body starts (after the system prompt).
    body_start: usize,
}

/// Deterministic generator of the request sequence and of the preload population.
///
/// Requests are produced strictly in index order by one owner (the run's dispatcher), which is
/// what makes the sequence reproducible: stateful shapes (chat turn counters) advance in that
/// order regardless of how responses interleave.
pub struct Generator {
    cfg: WorkloadConfig,
    rng: Xoshiro256PlusPlus,
    next_index: u64,
    /// System/instruction prompt tokens per (tenant, model, index), generated on demand.
    systems: HashMap<(u32, u32, u32), Arc<[u32]>>,
    sys_zipf: Zipf,
    pop_zipf: Zipf,
    /// Chat slots (chat only).
    slots: Vec<ChatSlot>,
    /// RAG corpus chunk tokens (rag only).
    chunks: Vec<Arc<[u32]>>,
    /// Diffuse prompt population (diffuse only).
    prompts: Vec<Doc>,
}

impl Generator {
    /// Builds the population for `cfg` (must be valid, see [`WorkloadConfig::validate`]).
    pub fn new(cfg: WorkloadConfig) -> Self {
        let mut g = Generator {
            rng: rng_for(derive(cfg.seed, tag::SEQUENCE, 0, 0)),
            next_index: 0,
            systems: HashMap::new(),
            sys_zipf: Zipf::new(cfg.system_prompts, cfg.zipf),
            pop_zipf: Zipf::new(cfg.population, cfg.zipf),
            slots: Vec::new(),
            chunks: Vec::new(),
            prompts: Vec::new(),
            cfg,
        };
        match g.cfg.kind {
            WorkloadKind::Chat => {
                for c in 0..g.cfg.population {
                    let slot = g.new_chat_slot(c, 0);
                    g.slots.push(slot);
                }
            }
            WorkloadKind::Rag => {
                for k in 0..g.cfg.population {
                    let mut t = Vec::new();
                    let seed = derive(g.cfg.seed, tag::CHUNK, k as u64, 0);
                    gen_tokens(seed, g.cfg.chunk_tokens as usize, g.cfg.vocab, &mut t);
                    g.chunks.push(t.into());
                }
            }
            WorkloadKind::Diffuse => {
                for p in 0..g.cfg.population {
                    let mut rng = rng_for(derive(g.cfg.seed, tag::PROMPT, p as u64, 0));
                    let scope = g.pick_scope(&mut rng);
                    let len = sample_len(&g.cfg, &mut rng).max(1);
                    let mut t = Vec::with_capacity(len);
                    gen_tokens(rng.random(), len, g.cfg.vocab, &mut t);
                    let replica = g.pick_replica(scope.model, &mut rng);
                    let hashes = block_hashes(&t, g.cfg.block_size);
                    g.prompts.push(Doc {
                        scope,
                        tokens: t.into(),
                        hashes: hashes.into(),
                        replica,
                    });
                }
            }
        }
        g
    }

    /// The configuration this generator was built from.
    pub fn config(&self) -> &WorkloadConfig {
        &self.cfg
    }

    fn pick_scope(&self, rng: &mut impl RngExt) -> Scope {
        scope_from(&self.cfg, rng)
    }

    fn pick_replica(&self, model: u32, rng: &mut impl RngExt) -> u32 {
        let rs = self.cfg.replicas_of_model(model);
        rs[rng.random_range(0..rs.len())]
    }

    /// Shared system prompt `s` of (tenant, model); adapters share it (same text, different KV).
    fn system(&mut self, tenant: u32, model: u32, s: u32) -> Arc<[u32]> {
        let (seed, len, vocab) = (self.cfg.seed, self.cfg.system_prompt_tokens, self.cfg.vocab);
        self.systems
            .entry((tenant, model, s))
            .or_insert_with(|| {
                let mut t = Vec::new();
                let id = ((tenant as u64) << 40) | ((model as u64) << 20) | s as u64;
                gen_tokens(
                    derive(seed, tag::SYSTEM, id, 0),
                    len as usize,
                    vocab,
                    &mut t,
                );
                t.into()
            })
            .clone()
    }

    /// A fresh conversation for slot `c`, generation `epoch`: system prompt ++ unique body.
    fn new_chat_slot(&mut self, c: u32, epoch: u64) -> ChatSlot {
        let mut rng = rng_for(derive(self.cfg.seed, tag::CONV, c as u64, epoch));
        let scope = self.pick_scope(&mut rng);
        let s = self.sys_zipf.sample(&mut rng);
        let sys = self.system(scope.tenant, scope.model, s);
        let body = sample_len(&self.cfg, &mut rng).max(self.cfg.turns as usize);
        let mut t = Vec::with_capacity(sys.len() + body);
        t.extend_from_slice(&sys);
        gen_tokens(rng.random(), body, self.cfg.vocab, &mut t);
        let replica = self.pick_replica(scope.model, &mut rng);
        let hashes = block_hashes(&t, self.cfg.block_size);
        ChatSlot {
            epoch,
            turn: 0,
            body_start: sys.len(),
            doc: Doc {
                scope,
                tokens: t.into(),
                hashes: hashes.into(),
                replica,
            },
        }
    }

    /// Prompt length of turn `turn` (1-based) of a chat slot: system + `turn / turns` of body.
    fn chat_turn_len(&self, slot: &ChatSlot, turn: u32) -> usize {
        let body = slot.doc.tokens.len() - slot.body_start;
        slot.body_start + (body * turn as usize).div_ceil(self.cfg.turns as usize)
    }

    fn spec(&self, index: u64, doc: &Doc, n_tokens: usize) -> RequestSpec {
        let n_tokens = n_tokens.min(doc.tokens.len());
        RequestSpec {
            index,
            scope: doc.scope,
            tokens: doc.tokens.clone(),
            n_tokens,
            hashes: doc.hashes.clone(),
            n_blocks: n_tokens / self.cfg.block_size as usize,
            replica: doc.replica,
        }
    }

    /// The next request of the sequence. Unbounded by itself: callers bound the run.
    pub fn next_request(&mut self) -> RequestSpec {
        let index = self.next_index;
        self.next_index += 1;
        match self.cfg.kind {
            WorkloadKind::Chat => {
                let c = self.pop_zipf.sample(&mut self.rng) as usize;
                if self.slots[c].turn >= self.cfg.turns {
                    let epoch = self.slots[c].epoch + 1;
                    self.slots[c] = self.new_chat_slot(c as u32, epoch);
                }
                self.slots[c].turn += 1;
                let slot = &self.slots[c];
                let n = self.chat_turn_len(slot, slot.turn);
                self.spec(index, &slot.doc, n)
            }
            WorkloadKind::Rag => {
                let mut rng = rng_for(derive(self.cfg.seed, tag::QUESTION, index, 0));
                let scope = scope_from(&self.cfg, &mut self.rng);
                let s = self.sys_zipf.sample(&mut self.rng);
                let sys = self.system(scope.tenant, scope.model, s);
                let mut t = sys.to_vec();
                let mut first = 0;
                for j in 0..self.cfg.chunks_per_prompt {
                    let k = self.pop_zipf.sample(&mut self.rng);
                    if j == 0 {
                        first = k;
                    }
                    t.extend_from_slice(&self.chunks[k as usize]);
                }
                let q = sample_len(&self.cfg, &mut self.rng);
                gen_tokens(rng.random(), q, self.cfg.vocab, &mut t);
                // Prompts sharing (system prompt, first chunk) execute on the same replica, the
                // way a prefix-aware router would place them, so their blocks accumulate there.
                let replica = self.rag_home(scope, s, first);
                let hashes = block_hashes(&t, self.cfg.block_size);
                let n = t.len();
                let doc = Doc {
                    scope,
                    tokens: t.into(),
                    hashes: hashes.into(),
                    replica,
                };
                self.spec(index, &doc, n)
            }
            WorkloadKind::Diffuse => {
                let p = self.rng.random_range(0..self.prompts.len());
                let doc = self.prompts[p].clone();
                self.spec(index, &doc, doc.tokens.len())
            }
        }
    }

    fn rag_home(&self, scope: Scope, s: u32, first_chunk: u32) -> u32 {
        let rs = self.cfg.replicas_of_model(scope.model);
        let id = ((scope.tenant as u64) << 32) | ((scope.adapter as u64) << 16) | s as u64;
        let h = derive(self.cfg.seed, tag::PRELOAD, id, first_chunk as u64);
        rs[(h % rs.len() as u64) as usize]
    }

    /// The state replicas had before the run: what `preload` ingests. Deterministic per seed and
    /// computed without advancing the request sequence.
    ///
    /// * chat: every conversation slot is already some turns in (0 = only its system prompt
    ///   cached), stored on its replica;
    /// * rag: every (tenant, model, adapter, system prompt, chunk) leading prefix on its home
    ///   replica, bounded to `population` stores per partition;
    /// * diffuse: every population prompt on its replica.
    pub fn preload_ops(&mut self) -> Vec<(u32, StoreOp)> {
        let mut out = Vec::new();
        match self.cfg.kind {
            WorkloadKind::Chat => {
                let mut rng = rng_for(derive(self.cfg.seed, tag::PRELOAD, 0, 0));
                for c in 0..self.slots.len() {
                    let done = rng.random_range(0..self.cfg.turns);
                    let slot = &self.slots[c];
                    let n = if done == 0 {
                        slot.body_start
                    } else {
                        self.chat_turn_len(slot, done)
                    };
                    let spec = self.spec(0, &slot.doc, n);
                    if spec.n_blocks > 0 {
                        out.push((spec.replica, spec.store_op()));
                    }
                    self.slots[c].turn = done;
                }
            }
            WorkloadKind::Rag => {
                let mut rng = rng_for(derive(self.cfg.seed, tag::PRELOAD, 1, 0));
                for tenant in 0..self.cfg.tenants {
                    for model in 0..self.cfg.models {
                        for adapter in 0..=self.cfg.adapters {
                            let scope = Scope {
                                tenant,
                                model,
                                adapter,
                            };
                            for _ in 0..self.cfg.population {
                                let s = self.sys_zipf.sample(&mut rng);
                                let k = self.pop_zipf.sample(&mut rng);
                                let mut t = self.system(tenant, model, s).to_vec();
                                t.extend_from_slice(&self.chunks[k as usize]);
                                let hashes = block_hashes(&t, self.cfg.block_size);
                                let n_blocks = hashes.len();
                                if n_blocks > 0 {
                                    let op = StoreOp {
                                        scope,
                                        hashes: hashes.into(),
                                        n_blocks,
                                    };
                                    out.push((self.rag_home(scope, s, k), op));
                                }
                            }
                        }
                    }
                }
            }
            WorkloadKind::Diffuse => {
                for p in &self.prompts {
                    let n_blocks = p.hashes.len();
                    if n_blocks > 0 {
                        let op = StoreOp {
                            scope: p.scope,
                            hashes: p.hashes.clone(),
                            n_blocks,
                        };
                        out.push((p.replica, op));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn cfg(kind: WorkloadKind) -> WorkloadConfig {
        WorkloadConfig {
            kind,
            seed: 7,
            replicas: 4,
            tenants: 2,
            models: 2,
            adapters: 1,
            hash_scheme: "vllm".into(),
            block_size: 16,
            min_tokens: 16,
            mean_tokens: 128,
            max_tokens: 512,
            population: 16,
            system_prompts: 3,
            system_prompt_tokens: 64,
            turns: 4,
            chunk_tokens: 64,
            chunks_per_prompt: 3,
            zipf: 1.0,
            vocab: 32000,
        }
    }

    #[test]
    fn zipf_is_skewed_and_in_range() {
        let z = Zipf::new(10, 1.2);
        let mut rng = rng_for(1);
        let mut counts = [0u32; 10];
        for _ in 0..10_000 {
            counts[z.sample(&mut rng) as usize] += 1;
        }
        assert!(counts[0] > counts[9] * 5, "{counts:?}");
        let u = Zipf::new(4, 0.0);
        let mut c = [0u32; 4];
        for _ in 0..8000 {
            c[u.sample(&mut rng) as usize] += 1;
        }
        assert!(c.iter().all(|&x| (1700..2300).contains(&x)), "{c:?}");
    }

    #[test]
    fn lengths_respect_bounds() {
        let c = cfg(WorkloadKind::Diffuse);
        let mut rng = rng_for(3);
        let v: Vec<usize> = (0..5000).map(|_| sample_len(&c, &mut rng)).collect();
        assert!(v.iter().all(|&x| (16..=512).contains(&x)));
        let mean = v.iter().sum::<usize>() as f64 / v.len() as f64;
        assert!((100.0..150.0).contains(&mean), "mean {mean}");
    }

    #[test]
    fn chat_turns_grow_and_extend_previous_prefix() {
        let mut g = Generator::new(cfg(WorkloadKind::Chat));
        let mut last: HashMap<*const u32, usize> = HashMap::new();
        let mut grew = 0;
        for _ in 0..200 {
            let r = g.next_request();
            let key = r.tokens.as_ptr();
            if last.get(&key).is_some_and(|&prev| r.n_tokens > prev) {
                grew += 1;
            }
            last.insert(key, r.n_tokens);
            assert_eq!(r.n_blocks, r.n_tokens / 16);
        }
        assert!(grew > 20, "conversations should grow turn by turn ({grew})");
    }
}
