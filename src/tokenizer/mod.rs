//! Server-side tokenization for `LookupRoute.prompt_text` (docs/BEHAVIOUR.md §10.3, §18).
//!
//! A lookup that carries only `prompt_text` needs the same token ids the engine will compute, so
//! the server renders the model's chat template around one user message and tokenizes the result
//! exactly like the engine's chat path (HF `apply_chat_template(add_generation_prompt=True)` then
//! `encode(add_special_tokens=False)`).
//!
//! Tokenization is CPU-heavy (milliseconds for long prompts) and must never run on the glommio
//! cores that serve lookups: [`Tokenizers::submit`] only does a non-blocking admission check and
//! a queue push on the caller's thread; the work runs on a small pool of dedicated std threads
//! ([`pool`]) and the answer comes back through a `tokio::sync::oneshot` channel, which needs no
//! tokio runtime. Every failure is a [`TokenizeError`] the handler turns into a fail-open answer.
//!
//! Models are loaded once, eagerly, at start-up ([`Tokenizers::load`]); a request's `model_id` is
//! only ever a key into the loaded set, never a path.

mod load;
mod pool;
mod template;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

pub use crate::limits::{MAX_CONCURRENT_TOKENIZE, MAX_PROMPT_TEXT_BYTES, MAX_TOKENS};
pub use pool::PoolConfig;
pub use template::hf_environment;

/// Name prefix of the tokenizer worker threads, which catch a tokenizer's panic and answer the
/// call as failed (the pool survives).
pub const WORKER_THREAD_PREFIX: &str = "tokenizer-";

/// Whether the calling thread catches panics itself (a tokenizer worker).
pub fn contains_panics_on_this_thread() -> bool {
    std::thread::current()
        .name()
        .is_some_and(|n| n.starts_with(WORKER_THREAD_PREFIX))
}

/// Why a prompt could not be tokenized. Every variant is a fail-open (`NO_HINT`, no token echo)
/// for the lookup handler; none of them carries prompt text, so they are safe to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// No tokenizer directory was configured (or this handle was built disabled).
    Unavailable,
    /// The request's `model_id` is not among the models loaded at start-up.
    UnknownModel,
    /// All [`MAX_CONCURRENT_TOKENIZE`] slots are taken; the request was shed without queueing.
    Saturated,
    /// `prompt_text` is longer than [`MAX_PROMPT_TEXT_BYTES`]; nothing was queued.
    Oversize,
    /// The tokenizer produced more than [`MAX_TOKENS`] tokens.
    TooLong,
    /// Template rendering or encoding failed; the message describes the failure, never the text.
    Failed(String),
}

impl fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unavailable => f.write_str("tokenizer unavailable"),
            Self::UnknownModel => f.write_str("unknown tokenizer model"),
            Self::Saturated => f.write_str("tokenizer saturated"),
            Self::Oversize => f.write_str("prompt text too large"),
            Self::TooLong => f.write_str("tokenizer output too long"),
            Self::Failed(msg) => write!(f, "tokenization failed: {msg}"),
        }
    }
}

impl std::error::Error for TokenizeError {}

impl TokenizeError {
    /// A short stable label, so callers can log or count failures by kind without formatting.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Unavailable => "unavailable",
            Self::UnknownModel => "unknown_model",
            Self::Saturated => "saturated",
            Self::Oversize => "oversize",
            Self::TooLong => "too_long",
            Self::Failed(_) => "failed",
        }
    }
}

/// The pending result of one admitted tokenization.
///
/// Dropping it (e.g. because the lookup deadline fired) is always safe: the worker skips the job
/// if it has not started yet, otherwise finishes it and discards the result; either way the
/// concurrency slot is released when the worker is done with the job, not when this is dropped.
/// Polling needs no tokio runtime.
#[derive(Debug)]
#[must_use = "a tokenization result is only observed by awaiting the future"]
pub struct TokenizeFuture {
    rx: tokio::sync::oneshot::Receiver<Result<Vec<u32>, TokenizeError>>,
}

impl Future for TokenizeFuture {
    type Output = Result<Vec<u32>, TokenizeError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.rx).poll(cx).map(|r| {
            r.unwrap_or_else(|_| Err(TokenizeError::Failed("tokenizer worker stopped".into())))
        })
    }
}

/// Shared, cheaply clonable handle to the loaded tokenizers and their worker pool.
///
/// Built once at start-up and shared by every core (it is `Send + Sync`); all clones use the same
/// models, pool and concurrency budget. The pool threads stop once the last clone is dropped.
#[derive(Clone)]
pub struct Tokenizers {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None` = tokenization disabled (no `--tokenizer-models-dir`).
    models: Option<HashMap<String, Arc<load::Model>>>,
    /// Started only when at least one model loaded.
    pool: Option<pool::Pool>,
}

impl fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizers")
            .field("enabled", &self.inner.models.is_some())
            .field("models", &self.models())
            .finish()
    }
}

impl Tokenizers {
    /// A handle for a server started without `--tokenizer-models-dir`: every submit answers
    /// [`TokenizeError::Unavailable`], so `prompt_text` lookups fail open.
    pub fn disabled() -> Self {
        Self {
            inner: Arc::new(Inner {
                models: None,
                pool: None,
            }),
        }
    }

    /// Walks `dir` once, loads every model found (failures are logged and skipped, never fatal)
    /// and starts the default worker pool. Call it from the main thread before the per-core
    /// runtime starts, so the workers do not inherit a serving core's CPU pinning.
    #[cfg(test)]
    pub fn load(dir: &Path) -> Self {
        Self::load_with(dir, PoolConfig::default())
    }

    /// Like [`Tokenizers::load`], with explicit worker count and CPU placement (see
    /// [`PoolConfig::sparing_serving_cores`]).
    pub fn load_with(dir: &Path, cfg: PoolConfig) -> Self {
        let models = load::load_models_dir(dir);
        Self::from_models(models, cfg)
    }

    fn from_models(models: HashMap<String, Arc<load::Model>>, cfg: PoolConfig) -> Self {
        Self::from_models_with_limits(models, cfg, MAX_CONCURRENT_TOKENIZE, MAX_TOKENS)
    }

    /// Test seam: the production limits are the constants; tests may shrink the token limit
    /// to exercise the real encode path without megabyte prompts.
    fn from_models_with_limits(
        models: HashMap<String, Arc<load::Model>>,
        cfg: PoolConfig,
        limit: usize,
        max_tokens: usize,
    ) -> Self {
        let pool =
            (!models.is_empty()).then(|| pool::Pool::start_with_limits(cfg, limit, max_tokens));
        Self {
            inner: Arc::new(Inner {
                models: Some(models),
                pool,
            }),
        }
    }

    /// Whether a `--tokenizer-models-dir` was configured, even if it yielded no model.
    #[cfg(test)]
    pub fn is_enabled(&self) -> bool {
        self.inner.models.is_some()
    }

    /// Whether `model` was loaded at start-up, i.e. whether [`Tokenizers::submit`] can serve it.
    #[cfg(test)]
    pub fn is_loaded(&self, model: &str) -> bool {
        self.inner
            .models
            .as_ref()
            .is_some_and(|m| m.contains_key(model))
    }

    /// The loaded model ids, sorted, for start-up logs and diagnostics.
    pub fn models(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .inner
            .models
            .as_ref()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        ids.sort();
        ids
    }

    /// Tokenizations currently admitted (queued or running); for gauges and tests.
    pub fn in_flight(&self) -> usize {
        self.inner.pool.as_ref().map_or(0, |p| p.in_flight())
    }

    /// Admits one tokenization of `text` as the single user message of `model`'s chat template
    /// (with the generation prompt, without added special tokens).
    ///
    /// Never blocks and never tokenizes on the calling thread: it checks the limits, takes one of
    /// the [`MAX_CONCURRENT_TOKENIZE`] slots or fails with [`TokenizeError::Saturated`], queues
    /// the job and returns. An `Ok` future may still resolve to an error (render/encode failure,
    /// [`TokenizeError::TooLong`]); it resolves to `Ok(vec![])` only if the rendered prompt
    /// tokenizes to nothing, which the caller treats as a fail-open like any error.
    pub fn submit(&self, model: &str, text: String) -> Result<TokenizeFuture, TokenizeError> {
        let models = self
            .inner
            .models
            .as_ref()
            .ok_or(TokenizeError::Unavailable)?;
        if text.len() > MAX_PROMPT_TEXT_BYTES {
            return Err(TokenizeError::Oversize);
        }
        let model = models.get(model).ok_or(TokenizeError::UnknownModel)?;
        let pool = self.inner.pool.as_ref().ok_or(TokenizeError::Unavailable)?;
        let rx = pool.submit(model.clone(), text)?;
        Ok(TokenizeFuture { rx })
    }
}

impl Tokenizers {
    /// Tokenizes `text` as is (no chat template, no added special tokens) with `model`, on the
    /// calling thread. For the admin thread only (template registration, whose text is bounded
    /// by `MAX_TEMPLATE_BYTES`); never call it on a serving core.
    pub fn encode_text_here(&self, model: &str, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let models = self
            .inner
            .models
            .as_ref()
            .ok_or(TokenizeError::Unavailable)?;
        let model = models.get(model).ok_or(TokenizeError::UnknownModel)?;
        if text.len() > MAX_PROMPT_TEXT_BYTES {
            return Err(TokenizeError::Oversize);
        }
        model.encode_text(text)
    }

    /// The LookupRoute `prompt_text` step (§10.3) in one call: admits the work now (on the
    /// caller's thread, non-blocking) and returns a `'static` future that yields the tokens, or
    /// `None` for every fail-open outcome — unavailable, unknown model, oversize, saturated,
    /// render/encode failure, more than [`MAX_TOKENS`] tokens, or empty output — none of which
    /// echo tokens. Dropping the future (deadline fired) discards the result.
    pub fn tokenize_for_lookup(
        &self,
        model: &str,
        text: String,
    ) -> impl Future<Output = Option<Vec<u32>>> + Send + 'static {
        let admitted = self.submit(model, text);
        if let Err(e) = &admitted {
            tracing::debug!(model, error = e.kind(), "tokenize_not_admitted");
        }
        async move {
            match admitted.ok()?.await {
                Ok(tokens) if !tokens.is_empty() => Some(tokens),
                Ok(_) => None,
                Err(e) => {
                    tracing::debug!(error = e.kind(), "tokenize_failed");
                    None
                }
            }
        }
    }
}

static GLOBAL: OnceLock<Tokenizers> = OnceLock::new();
static DISABLED: OnceLock<Tokenizers> = OnceLock::new();

/// Installs the process-wide handle once at start-up; a second call is refused and hands the
/// value back, so the handle seen by the handlers can never change while serving.
pub fn install_global(tokenizers: Tokenizers) -> Result<(), Tokenizers> {
    GLOBAL.set(tokenizers)
}

/// The process-wide handle; a disabled one until [`install_global`] ran, so a handler reached
/// before installation fails open instead of panicking (and installation still succeeds later).
pub fn global() -> &'static Tokenizers {
    GLOBAL
        .get()
        .unwrap_or_else(|| DISABLED.get_or_init(Tokenizers::disabled))
}
