//! The tokenizer worker pool: a few dedicated std threads behind a bounded, non-blocking
//! admission gate.
//!
//! The serving cores only ever take a slot (one atomic CAS), push onto a bounded lock-free
//! queue and unpark the workers: no lock is taken on the lookup path. The CPU work happens here.
//! A slot is held by the job itself, so it is released when a worker is done with the job,
//! whether or not anyone still waits for the answer.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use tokio::sync::oneshot;

use super::TokenizeError;
use super::load::Model;

use crate::limits::{DEFAULT_TOKENIZER_WORKERS, MAX_TOKENIZER_WORKERS};
use crate::sys::worker_threads::{Permit, place_current_thread};

/// **Test-only hook, not a configuration option.** When this environment variable names a file
/// path, every tokenizer worker holds each job it takes until that file exists, so end-to-end
/// tests can keep tokenizations admitted (saturation, deadlines during tokenization) without
/// relying on slow prompts. The wait polls every [`TEST_GATE_POLL`] and gives up after
/// [`TEST_GATE_MAX_WAIT`] (the job then runs normally), so nothing can hang forever. Read once
/// per pool, here only; unset (the normal case) it costs nothing.
const TEST_TOKENIZE_GATE_ENV: &str = "INFERENCECACHE_TEST_TOKENIZE_GATE";

/// Poll interval of the [`TEST_TOKENIZE_GATE_ENV`] hook.
const TEST_GATE_POLL: Duration = Duration::from_millis(5);

/// Longest a worker waits for the [`TEST_TOKENIZE_GATE_ENV`] file before running the job anyway.
const TEST_GATE_MAX_WAIT: Duration = Duration::from_secs(120);

/// The gate file of the [`TEST_TOKENIZE_GATE_ENV`] hook, if the variable is set and non-empty.
fn test_gate_from_env() -> Option<PathBuf> {
    let gate = std::env::var_os(TEST_TOKENIZE_GATE_ENV).filter(|v| !v.is_empty())?;
    tracing::warn!(
        gate = %Path::new(&gate).display(),
        "tokenizer_test_gate_enabled"
    );
    Some(PathBuf::from(gate))
}

/// Test hook: blocks the calling worker until `gate` exists, the pool shuts down or
/// [`TEST_GATE_MAX_WAIT`] passes.
fn wait_for_test_gate(gate: &Path, shutdown: &AtomicBool) {
    let deadline = Instant::now() + TEST_GATE_MAX_WAIT;
    while !gate.exists() && !shutdown.load(Ordering::Acquire) && Instant::now() < deadline {
        std::thread::sleep(TEST_GATE_POLL);
    }
}

/// Where and how many tokenizer workers run.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Worker threads (clamped to `1..=MAX_TOKENIZER_WORKERS`).
    pub workers: usize,
    /// CPUs the workers are pinned to; `None` = unpinned (they then run at a lower priority,
    /// since they share CPUs with the serving cores).
    pub cpus: Option<Vec<usize>>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            workers: DEFAULT_TOKENIZER_WORKERS,
            cpus: None,
        }
    }
}

impl PoolConfig {
    /// A configuration that keeps the workers off the CPUs the per-core runtime pins its first
    /// `shards` executors to (the runtime takes the allowed CPUs in order). When every allowed CPU
    /// serves, the workers stay unpinned and deprioritised instead.
    pub fn sparing_serving_cores(shards: usize) -> Self {
        Self {
            workers: DEFAULT_TOKENIZER_WORKERS,
            cpus: crate::sys::worker_threads::spare_cpus(shards),
        }
    }
}

type Reply = oneshot::Sender<Result<Vec<u32>, TokenizeError>>;

struct Job {
    model: Arc<Model>,
    text: String,
    reply: Reply,
    _permit: Permit,
}

/// State shared by the submitters (serving cores) and the workers.
struct Shared {
    /// Admitted jobs; its capacity is the admission limit, so a push after a successful
    /// permit acquire cannot fail.
    jobs: ArrayQueue<Job>,
    shutdown: AtomicBool,
    /// Worker handles to unpark after a push (set once the workers are spawned).
    workers: OnceLock<Vec<Thread>>,
    /// The [`TEST_TOKENIZE_GATE_ENV`] file workers wait for before each job (tests only).
    test_gate: Option<PathBuf>,
}

impl Shared {
    /// Wakes every worker; `unpark` before `park` makes that `park` return at once, so a job
    /// pushed between a worker's empty check and its park is never missed.
    fn wake_workers(&self) {
        if let Some(ws) = self.workers.get() {
            for w in ws {
                w.unpark();
            }
        }
    }
}

/// The worker threads and their admission gate. Dropping it stops the workers once they finish
/// the job at hand; queued jobs are dropped, which their callers observe as a failure.
pub struct Pool {
    shared: Arc<Shared>,
    in_flight: Arc<AtomicUsize>,
    limit: usize,
    /// False when no worker thread could be spawned: jobs would never run, so none are admitted.
    has_workers: bool,
}

impl Pool {
    /// Spawns the workers; `limit` concurrent jobs, outputs above `max_tokens` refused.
    pub(super) fn start_with_limits(cfg: PoolConfig, limit: usize, max_tokens: usize) -> Self {
        let shared = Arc::new(Shared {
            jobs: ArrayQueue::new(limit.max(1)),
            shutdown: AtomicBool::new(false),
            workers: OnceLock::new(),
            test_gate: test_gate_from_env(),
        });
        let workers = cfg.workers.clamp(1, MAX_TOKENIZER_WORKERS);
        let mut handles = Vec::with_capacity(workers);
        for i in 0..workers {
            let shared = shared.clone();
            let cpus = cfg.cpus.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{}{i}", super::WORKER_THREAD_PREFIX))
                .spawn(move || {
                    place_current_thread(cpus.as_deref());
                    worker_loop(&shared, max_tokens);
                });
            match spawned {
                Ok(h) => handles.push(h.thread().clone()),
                Err(e) => tracing::error!(error = %e, worker = i, "tokenizer_worker_spawn_failed"),
            }
        }
        let has_workers = !handles.is_empty();
        let _ = shared.workers.set(handles);
        shared.wake_workers();
        Self {
            shared,
            in_flight: Arc::new(AtomicUsize::new(0)),
            limit,
            has_workers,
        }
    }

    /// Jobs admitted and not yet finished or discarded.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Admits and queues one job without blocking; `Saturated` when every slot is taken.
    pub fn submit(
        &self,
        model: Arc<Model>,
        text: String,
    ) -> Result<oneshot::Receiver<Result<Vec<u32>, TokenizeError>>, TokenizeError> {
        if !self.has_workers {
            return Err(TokenizeError::Unavailable);
        }
        let permit =
            Permit::try_acquire(&self.in_flight, self.limit).ok_or(TokenizeError::Saturated)?;
        let (reply, rx) = oneshot::channel();
        let job = Job {
            model,
            text,
            reply,
            _permit: permit,
        };
        if self.shared.shutdown.load(Ordering::Acquire) {
            return Err(TokenizeError::Unavailable);
        }
        // Every queued job holds a permit and the queue's capacity is the permit limit, so this
        // cannot fail; if it ever did, the job (and its permit) is dropped and the caller sheds.
        if self.shared.jobs.push(job).is_err() {
            return Err(TokenizeError::Saturated);
        }
        self.shared.wake_workers();
        Ok(rx)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        // Dropping queued jobs releases their permits and fails their waiting callers.
        while self.shared.jobs.pop().is_some() {}
        self.shared.wake_workers();
    }
}

fn worker_loop(shared: &Shared, max_tokens: usize) {
    loop {
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        match shared.jobs.pop() {
            Some(job) => {
                if let Some(gate) = &shared.test_gate {
                    wait_for_test_gate(gate, &shared.shutdown);
                    if shared.shutdown.load(Ordering::Acquire) {
                        return; // the job is dropped: its caller observes a failure
                    }
                }
                run_job(job, max_tokens)
            }
            // Empty: sleep until a submitter (or shutdown) unparks this thread.
            None => std::thread::park(),
        }
    }
}

/// Runs one job; the permit is released when `job` goes out of scope at the end.
fn run_job(job: Job, max_tokens: usize) {
    // The caller stopped waiting (deadline, cancellation) before we started: skip the work.
    if job.reply.is_closed() {
        return;
    }
    let result = catch_unwind(AssertUnwindSafe(|| job.model.encode_chat(&job.text)))
        .unwrap_or_else(|_| Err(TokenizeError::Failed("tokenizer panicked".into())))
        .and_then(|ids| {
            if ids.len() > max_tokens {
                Err(TokenizeError::TooLong)
            } else {
                Ok(ids)
            }
        });
    // A dropped receiver means nobody waits any more: the result is discarded.
    let _ = job.reply.send(result);
}
