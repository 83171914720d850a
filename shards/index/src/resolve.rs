//! Request-side logic of `LookupRoute` that never touches the index (docs/BEHAVIOUR.md §10.1–§10.3,
//! §10.7): which fingerprint a request resolves to, the gates evaluated on the raw request, the
//! effective prefix length and the affinity seed.
//!
//! Tokenizing `prompt_text` is I/O-bound and belongs to the server, so that path is split:
//! [`resolve_inputs`] answers [`Resolution::Tokenize`] and the server feeds the tokenizer's output
//! to [`resolve_tokenized`]. Explicit wire fingerprints are borrowed from the request, never
//! copied.

use std::borrow::Cow;
use std::time::Duration;

use inferencecache_proto::v1alpha1::{LookupRouteRequest, Slo};

use crate::fingerprint;
use crate::index::BlockHashes;

pub use crate::policy::{
    DEFAULT_AFFINITY_ROUTING, DEFAULT_ENABLE_CHAIN_MATCHING, DEFAULT_ENABLE_TENANT_HOT,
    DEFAULT_MINIMUM_MATCHED_TOKENS, DEFAULT_REQUIRE_CHAIN, DEFAULT_ROUTING_FLOOR_SCORE,
};

/// Block size for fingerprinting `token_ids` / tokenized `prompt_text` unless the flag overrides
/// it; must match the engines' KV block size or token-derived keys never hit.
pub const DEFAULT_ENGINE_BLOCK_SIZE: i32 = 16;

/// Safety deadline when `prompt_text` will be tokenized and nothing else bounds the call.
pub const DEFAULT_TOKENIZE_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest accepted `token_ids` length and tokenizer output length; beyond it → fail open.
pub const MAX_LOOKUP_TOKENS: usize = 1 << 20;

/// Largest accepted `prompt_text` in bytes; beyond it → fail open without tokenizing.
pub const MAX_PROMPT_TEXT_BYTES: usize = 1 << 20;

/// Concurrent `prompt_text` tokenizations; the acquire is non-blocking and a saturated pool
/// fails open, so tokenizer load can never queue lookups.
pub const MAX_CONCURRENT_TOKENIZE: usize = 64;

/// A LookupRoute request as resolution and the lookup read it, every field borrowed: from a
/// decoded [`LookupRouteRequest`] (`From`), or straight from the received bytes by the server's
/// inline path, which then allocates nothing per block hash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LookupRouteView<'a> {
    /// `model_id`.
    pub model_id: &'a str,
    /// `tenant_id`.
    pub tenant_id: &'a str,
    /// `prefix_hash`.
    pub prefix_hash: &'a [u8],
    /// `prefix_token_count`.
    pub prefix_token_count: i32,
    /// `hash_scheme`.
    pub hash_scheme: &'a str,
    /// `slo`.
    pub slo: Option<Slo>,
    /// `block_hashes`.
    pub block_hashes: BlockHashes<'a>,
    /// `block_token_counts`.
    pub block_token_counts: &'a [i32],
    /// `token_ids`.
    pub token_ids: &'a [u32],
    /// `prompt_text`.
    pub prompt_text: &'a str,
    /// `adapter_id`.
    pub adapter_id: &'a str,
}

impl<'a> From<&'a LookupRouteRequest> for LookupRouteView<'a> {
    fn from(r: &'a LookupRouteRequest) -> Self {
        LookupRouteView {
            model_id: &r.model_id,
            tenant_id: &r.tenant_id,
            prefix_hash: &r.prefix_hash,
            prefix_token_count: r.prefix_token_count,
            hash_scheme: &r.hash_scheme,
            slo: r.slo,
            block_hashes: BlockHashes::Bytes(&r.block_hashes),
            block_token_counts: &r.block_token_counts,
            token_ids: &r.token_ids,
            prompt_text: &r.prompt_text,
            adapter_id: &r.adapter_id,
        }
    }
}

/// Why resolution gave up; every cause answers `NO_HINT` (fail open). Kept for logs/debugging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailOpenCause {
    /// `len(block_hashes) != len(block_token_counts)` with chain matching on.
    MalformedChain,
    /// Chain matching off dropped the only fingerprint the request carried.
    ChainIgnored,
    /// `token_ids` longer than [`MAX_LOOKUP_TOKENS`].
    TooManyTokens,
    /// `token_ids` shorter than one block (or a non-positive block size).
    SubBlockTokens,
    /// `prompt_text` longer than [`MAX_PROMPT_TEXT_BYTES`].
    PromptTooLarge,
    /// No tokenize slot free (server side).
    TokenizerBusy,
    /// Tokenizer unavailable or returned an error (server side).
    TokenizerFailed,
    /// Tokenizer returned no tokens.
    TokenizerEmpty,
    /// Tokenizer returned more than [`MAX_LOOKUP_TOKENS`] tokens.
    TokenizerOutputTooLong,
    /// Tokenized prompt shorter than one block; the tokens are still echoed.
    SubBlockPrompt,
}

/// The chain handed to the index. Wire chains are borrowed; token-derived chains own their
/// 8-byte big-endian hashes and have a uniform per-block count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResolvedChain<'a> {
    /// No chain: exact lookup only (chain matching off, or no chain was sent).
    None,
    /// The request's own `block_hashes` / `block_token_counts` (equal, non-zero length).
    Wire {
        /// Opaque wire hashes.
        hashes: BlockHashes<'a>,
        /// Per-block token counts, same length as `hashes`.
        counts: &'a [i32],
    },
    /// Fingerprinted from tokens (§17): every block counts `block_size` tokens.
    Derived {
        /// Big-endian prefix hashes, one per full block.
        hashes: Vec<[u8; 8]>,
        /// Tokens per block.
        block_size: i32,
    },
}

impl ResolvedChain<'_> {
    /// Number of blocks.
    pub fn len(&self) -> usize {
        match self {
            ResolvedChain::None => 0,
            ResolvedChain::Wire { hashes, .. } => hashes.len(),
            ResolvedChain::Derived { hashes, .. } => hashes.len(),
        }
    }

    /// Whether the index should skip chain matching.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hash of block `i`. Panics when `i >= len()`, like slice indexing.
    pub fn hash(&self, i: usize) -> &[u8] {
        match self {
            ResolvedChain::None => panic!("block {i} of an empty chain"),
            ResolvedChain::Wire { hashes, .. } => hashes.get(i),
            ResolvedChain::Derived { hashes, .. } => &hashes[i],
        }
    }

    /// Token count of block `i`. Panics when `i >= len()`.
    pub fn count(&self, i: usize) -> i32 {
        match self {
            ResolvedChain::None => panic!("block {i} of an empty chain"),
            ResolvedChain::Wire { counts, .. } => counts[i],
            ResolvedChain::Derived { hashes, block_size } => {
                assert!(
                    i < hashes.len(),
                    "block {i} of a {}-block chain",
                    hashes.len()
                );
                *block_size
            }
        }
    }

    /// `(hash, count)` per block, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&[u8], i32)> + '_ {
        (0..self.len()).map(move |i| (self.hash(i), self.count(i)))
    }

    /// Sum of the per-block counts, in i64 so hostile wire counts cannot overflow.
    pub fn token_sum(&self) -> i64 {
        match self {
            ResolvedChain::None => 0,
            ResolvedChain::Wire { counts, .. } => counts.iter().map(|&c| i64::from(c)).sum(),
            ResolvedChain::Derived { hashes, block_size } => {
                hashes.len() as i64 * i64::from(*block_size)
            }
        }
    }
}

/// The exact-match key: the request's `prefix_hash` (borrowed, possibly empty) or the last
/// token-derived block hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExactHash<'a> {
    /// From the wire; empty is a valid (odd) key, §19.11.
    Wire(&'a [u8]),
    /// Last block's big-endian prefix hash.
    Derived([u8; 8]),
}

impl ExactHash<'_> {
    /// The key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            ExactHash::Wire(b) => b,
            ExactHash::Derived(b) => b,
        }
    }
}

/// A successfully resolved request: what the index is asked (§10.2 step 11) plus what the
/// response echoes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedInputs<'a> {
    /// Chain for the chain matcher; [`ResolvedChain::None`] whenever chain matching is off.
    pub chain: ResolvedChain<'a>,
    /// Exact key.
    pub exact_hash: ExactHash<'a>,
    /// Token count of the exact key (`prefix_token_count`, or `n_blocks × block_size`).
    pub exact_tokens: i32,
    /// Chain fields were present but dropped because chain matching is off (diagnostics only).
    pub chain_ignored: bool,
    /// Tokens to echo in `token_ids` on every later response; only the `prompt_text` path
    /// fills it.
    pub echo: Vec<u32>,
}

impl ResolvedInputs<'_> {
    /// §10.2 step 9: the resolved chain's token sum if it has blocks, else the exact count.
    pub fn effective_prefix_tokens(&self) -> i64 {
        if self.chain.is_empty() {
            i64::from(self.exact_tokens)
        } else {
            self.chain.token_sum()
        }
    }

    /// The §10.7 affinity seed: `u32_be(len) ‖ hash` per block of a non-empty resolved chain,
    /// else the raw exact hash, else `None` (no affinity). Borrows in the exact case.
    pub fn affinity_seed(&self) -> Option<Cow<'_, [u8]>> {
        if self.chain.is_empty() {
            let exact = self.exact_hash.as_bytes();
            return (!exact.is_empty()).then_some(Cow::Borrowed(exact));
        }
        let mut seed = Vec::with_capacity(self.chain.iter().map(|(h, _)| 4 + h.len()).sum());
        self.feed_affinity_seed(|part| seed.extend_from_slice(part));
        Some(Cow::Owned(seed))
    }

    /// Allocation-free form of [`ResolvedInputs::affinity_seed`]: streams the seed bytes into
    /// `sink` (e.g. a SHA-256 hasher) and returns whether there was any seed.
    pub fn feed_affinity_seed(&self, mut sink: impl FnMut(&[u8])) -> bool {
        if self.chain.is_empty() {
            let exact = self.exact_hash.as_bytes();
            if exact.is_empty() {
                return false;
            }
            sink(exact);
            return true;
        }
        for (hash, _) in self.chain.iter() {
            // Wire hashes are bounded by the gRPC message size (< 4 GiB), so the cast is exact.
            sink(&(hash.len() as u32).to_be_bytes());
            sink(hash);
        }
        true
    }
}

/// Outcome of [`resolve_inputs`] / [`resolve_tokenized`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution<'a> {
    /// Look up these inputs.
    Resolved(ResolvedInputs<'a>),
    /// Answer `NO_HINT` without touching the index, echoing `echo` if non-empty.
    FailOpen {
        /// Why (for logs).
        cause: FailOpenCause,
        /// Tokens to echo (only a sub-block tokenized prompt has any).
        echo: Vec<u32>,
    },
    /// The effective input is `prompt_text` (already size-checked): acquire a tokenize slot
    /// (none free → [`FailOpenCause::TokenizerBusy`]), tokenize with the chat template and the
    /// generation prompt, then call [`resolve_tokenized`].
    Tokenize {
        /// The text to tokenize as one `user` message.
        prompt_text: &'a str,
    },
}

impl Resolution<'_> {
    /// A fail-open without echo, for the server-side causes (busy / failed tokenizer).
    pub fn fail_open(cause: FailOpenCause) -> Resolution<'static> {
        Resolution::FailOpen {
            cause,
            echo: Vec::new(),
        }
    }
}

/// §10.3 input resolution over the raw request. Precedence: explicit fingerprint, then
/// `token_ids`, then `prompt_text`, then the empty exact key. With chain matching off a
/// `prefix_hash` wins outright and any chain fields are dropped.
pub fn resolve_inputs<'a>(
    req: &LookupRouteView<'a>,
    enable_chain_matching: bool,
    engine_block_size: i32,
) -> Resolution<'a> {
    #[cfg(debug_assertions)]
    calls::count(|c| c.resolutions += 1);
    let has_chain_fields = !req.block_hashes.is_empty() || !req.block_token_counts.is_empty();
    let has_exact = !req.prefix_hash.is_empty();
    if enable_chain_matching && (has_chain_fields || has_exact) {
        return resolve_wire_chain(req);
    }
    if !enable_chain_matching && has_exact {
        return Resolution::Resolved(wire_exact(req, has_chain_fields));
    }
    let chain_ignored = !enable_chain_matching && has_chain_fields;

    if !req.token_ids.is_empty() {
        return resolve_token_ids(req, enable_chain_matching, engine_block_size, chain_ignored);
    }

    if !req.prompt_text.is_empty() {
        if req.prompt_text.len() > MAX_PROMPT_TEXT_BYTES {
            return Resolution::fail_open(FailOpenCause::PromptTooLarge);
        }
        return Resolution::Tokenize {
            prompt_text: req.prompt_text,
        };
    }

    if chain_ignored {
        return Resolution::fail_open(FailOpenCause::ChainIgnored);
    }
    Resolution::Resolved(wire_exact(req, false))
}

/// The request's own exact key (`prefix_hash`, possibly empty) and no chain.
fn wire_exact<'a>(req: &LookupRouteView<'a>, chain_ignored: bool) -> ResolvedInputs<'a> {
    ResolvedInputs {
        chain: ResolvedChain::None,
        exact_hash: ExactHash::Wire(req.prefix_hash),
        exact_tokens: req.prefix_token_count,
        chain_ignored,
        echo: Vec::new(),
    }
}

/// The explicit wire fingerprint with chain matching on: the chain (if any) plus the exact key;
/// chain arrays of different lengths fail open.
fn resolve_wire_chain<'a>(req: &LookupRouteView<'a>) -> Resolution<'a> {
    let (bh, btc) = (req.block_hashes, req.block_token_counts);
    if bh.len() != btc.len() {
        return Resolution::fail_open(FailOpenCause::MalformedChain);
    }
    let chain = if bh.is_empty() {
        ResolvedChain::None
    } else {
        ResolvedChain::Wire {
            hashes: bh,
            counts: btc,
        }
    };
    Resolution::Resolved(ResolvedInputs {
        chain,
        ..wire_exact(req, false)
    })
}

/// `token_ids` fingerprinted here: over-long input and input shorter than one block fail open.
fn resolve_token_ids<'a>(
    req: &LookupRouteView<'a>,
    enable_chain_matching: bool,
    engine_block_size: i32,
    chain_ignored: bool,
) -> Resolution<'a> {
    if req.token_ids.len() > MAX_LOOKUP_TOKENS {
        return Resolution::fail_open(FailOpenCause::TooManyTokens);
    }
    match derive(req.token_ids, enable_chain_matching, engine_block_size) {
        Some((chain, exact_hash, exact_tokens)) => Resolution::Resolved(ResolvedInputs {
            chain,
            exact_hash,
            exact_tokens,
            chain_ignored,
            echo: Vec::new(),
        }),
        None => Resolution::fail_open(FailOpenCause::SubBlockTokens),
    }
}

/// Second half of the `prompt_text` path: turns the tokenizer's output into resolved inputs that
/// echo the tokens. Empty or over-long output fails open without echo; a sub-block output fails
/// open but still echoes.
pub fn resolve_tokenized(
    tokens: Vec<u32>,
    enable_chain_matching: bool,
    engine_block_size: i32,
) -> Resolution<'static> {
    #[cfg(debug_assertions)]
    calls::count(|c| c.resolutions += 1);
    if tokens.is_empty() {
        return Resolution::fail_open(FailOpenCause::TokenizerEmpty);
    }
    if tokens.len() > MAX_LOOKUP_TOKENS {
        return Resolution::fail_open(FailOpenCause::TokenizerOutputTooLong);
    }
    match derive(&tokens, enable_chain_matching, engine_block_size) {
        Some((chain, exact_hash, exact_tokens)) => Resolution::Resolved(ResolvedInputs {
            chain,
            exact_hash,
            exact_tokens,
            chain_ignored: false,
            echo: tokens,
        }),
        None => Resolution::FailOpen {
            cause: FailOpenCause::SubBlockPrompt,
            echo: tokens,
        },
    }
}

/// Fingerprints `tokens` (§17): the chain (only kept with chain matching on) and the exact key
/// `(last block hash, n_blocks × block_size)`. `None` when there is no full block.
fn derive(
    tokens: &[u32],
    keep_chain: bool,
    block_size: i32,
) -> Option<(ResolvedChain<'static>, ExactHash<'static>, i32)> {
    #[cfg(debug_assertions)]
    calls::count(|c| c.fingerprints += 1);
    let mut hashes = Vec::new();
    let mut last = None;
    let mut blocks: usize = 0;
    if keep_chain && block_size > 0 {
        hashes.reserve_exact(tokens.len() / block_size as usize);
    }
    fingerprint::for_each_prefix_hash(tokens, block_size, None, |h| {
        let be = h.to_be_bytes();
        if keep_chain {
            hashes.push(be);
        }
        last = Some(be);
        blocks += 1;
    });
    let last = last?;
    // blocks × block_size <= tokens.len() <= MAX_LOOKUP_TOKENS, so it fits an i32.
    let exact_tokens = (blocks * block_size as usize) as i32;
    let chain = if keep_chain {
        ResolvedChain::Derived { hashes, block_size }
    } else {
        ResolvedChain::None
    };
    Some((chain, ExactHash::Derived(last), exact_tokens))
}

/// §10.2 step 3: whether `prompt_text` is the effective input, i.e. whether the default 5 s
/// tokenize deadline applies when nothing else bounds the call.
pub fn will_tokenize(req: &LookupRouteView<'_>, enable_chain_matching: bool) -> bool {
    !req.prompt_text.is_empty()
        && (!enable_chain_matching
            || (req.block_hashes.is_empty() && req.block_token_counts.is_empty()))
        && req.prefix_hash.is_empty()
        && req.token_ids.is_empty()
}

/// §10.2 step 5: the only thing that satisfies `requireChain` — a non-empty, balanced wire
/// chain. `token_ids` / `prompt_text` never do.
pub fn has_valid_wire_chain(req: &LookupRouteView<'_>) -> bool {
    !req.block_hashes.is_empty() && req.block_hashes.len() == req.block_token_counts.len()
}

/// §10.2 step 9 on plain values: the chain's token sum if it has blocks, else the exact count
/// (so a legacy `prefix_token_count` of 0 gives 0, §19.10).
pub fn effective_prefix_tokens(chain_counts: &[i32], exact_tokens: i32) -> i64 {
    if chain_counts.is_empty() {
        i64::from(exact_tokens)
    } else {
        chain_counts.iter().map(|&c| i64::from(c)).sum()
    }
}

/// §10.7 eligibility on the **raw** request: tenant, model and scheme set, and the chain arrays
/// both empty or of equal length (a malformed chain never gets an affinity pick, even when chain
/// matching off ignored it).
pub fn affinity_eligible(req: &LookupRouteView<'_>) -> bool {
    !req.tenant_id.is_empty()
        && !req.model_id.is_empty()
        && !req.hash_scheme.is_empty()
        && req.block_hashes.len() == req.block_token_counts.len()
}

/// A [`Resolution`] that no longer borrows its request, so it can cross to the owner core with
/// the request instead of being worked out again there. Token-derived inputs travel as they are
/// (they own their hashes); the request's own wire fingerprint is a marker, borrowed again from
/// the request on arrival by [`Detached::attach`] in O(1), without copying a hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Detached {
    /// Inputs that own everything they hold (fingerprinted from tokens).
    Owned(ResolvedInputs<'static>),
    /// The request's `prefix_hash` / `prefix_token_count`, with its wire chain when `chain`.
    Wire {
        /// Whether the request's `block_hashes` / `block_token_counts` are the chain.
        chain: bool,
        /// [`ResolvedInputs::chain_ignored`].
        chain_ignored: bool,
    },
    /// Answer `NO_HINT` (see [`Resolution::FailOpen`]).
    FailOpen {
        /// Why (for logs).
        cause: FailOpenCause,
        /// Tokens to echo.
        echo: Vec<u32>,
    },
    /// The prompt must be tokenized first (see [`Resolution::Tokenize`]).
    Tokenize,
}

impl Resolution<'_> {
    /// This resolution without its borrows of the request (see [`Detached`]).
    pub fn detach(self) -> Detached {
        let inputs = match self {
            Resolution::Resolved(inputs) => inputs,
            Resolution::FailOpen { cause, echo } => return Detached::FailOpen { cause, echo },
            Resolution::Tokenize { .. } => return Detached::Tokenize,
        };
        let ResolvedInputs {
            chain,
            exact_hash,
            exact_tokens,
            chain_ignored,
            echo,
        } = inputs;
        // The wire path's exact key is always the request's own (`wire_exact`), and a wire
        // chain always comes with it; token-derived inputs never borrow.
        let chain = match (chain, exact_hash) {
            (ResolvedChain::Wire { .. }, _) => {
                return Detached::Wire {
                    chain: true,
                    chain_ignored,
                };
            }
            (_, ExactHash::Wire(_)) => {
                return Detached::Wire {
                    chain: false,
                    chain_ignored,
                };
            }
            (ResolvedChain::Derived { hashes, block_size }, _) => {
                ResolvedChain::Derived { hashes, block_size }
            }
            (ResolvedChain::None, _) => ResolvedChain::None,
        };
        let ExactHash::Derived(exact) = exact_hash else {
            unreachable!("wire keys returned above")
        };
        Detached::Owned(ResolvedInputs {
            chain,
            exact_hash: ExactHash::Derived(exact),
            exact_tokens,
            chain_ignored,
            echo,
        })
    }
}

impl Detached {
    /// The resolution again, borrowing `req`, the request it was detached from.
    pub fn attach<'a>(self, req: &LookupRouteView<'a>) -> Resolution<'a> {
        match self {
            Detached::Owned(inputs) => Resolution::Resolved(inputs),
            Detached::Wire {
                chain,
                chain_ignored,
            } => {
                let mut inputs = wire_exact(req, chain_ignored);
                if chain {
                    inputs.chain = ResolvedChain::Wire {
                        hashes: req.block_hashes,
                        counts: req.block_token_counts,
                    };
                }
                Resolution::Resolved(inputs)
            }
            Detached::FailOpen { cause, echo } => Resolution::FailOpen { cause, echo },
            Detached::Tokenize => Resolution::Tokenize {
                prompt_text: req.prompt_text,
            },
        }
    }
}

/// Debug builds count the resolutions and fingerprints made on each thread, so a test can
/// check that a request is resolved once however many cores it crosses.
#[cfg(debug_assertions)]
pub mod calls {
    use std::cell::Cell;

    /// Calls made on one thread.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Calls {
        /// [`super::resolve_inputs`] and [`super::resolve_tokenized`].
        pub resolutions: u64,
        /// Token lists fingerprinted.
        pub fingerprints: u64,
    }

    thread_local! {
        static CALLS: Cell<Calls> = const {
            Cell::new(Calls { resolutions: 0, fingerprints: 0 })
        };
    }

    pub(super) fn count(f: impl FnOnce(&mut Calls)) {
        let mut c = CALLS.get();
        f(&mut c);
        CALLS.set(c);
    }

    /// The calls made on this thread so far.
    pub fn on_this_thread() -> Calls {
        CALLS.get()
    }
}
