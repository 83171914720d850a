//! The decode pool: a few std threads that decode large client messages (ReportCacheState,
//! PublishEvent) off the serving cores, behind the same non-blocking admission gate as the
//! tokenizer pool.
//!
//! Why: prost decodes a message in one call, so a 4 MiB ReportCacheState of 250,000 prefixes
//! held its core for tens of ms in one poll, every request queued on that core waiting behind
//! it (docs/ARCHITECTURE.md §8). A core hands such a message here and awaits the answer without
//! blocking; it only ever takes a slot (one CAS), pushes onto a bounded lock-free queue and
//! unparks the workers. A full pool refuses the job at once: it never grows.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;

use bytes::Bytes;
use crossbeam_queue::ArrayQueue;
use tokio::sync::oneshot;

use crate::limits::{DECODE_WORKERS, MAX_OFFCORE_DECODES};
use crate::sys::worker_threads::{Permit, place_current_thread, spare_cpus};

/// The prefix of the decode workers' thread names.
pub const WORKER_THREAD_PREFIX: &str = "decode-";

/// Why a message could not be handed to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// [`MAX_OFFCORE_DECODES`] messages are already admitted.
    Full,
    /// No worker thread could be spawned (or the pool is shutting down).
    Unavailable,
}

/// One admitted job: the work, and the slot it holds until it is done or dropped.
struct Job {
    work: Box<dyn FnOnce() + Send>,
    _permit: Permit,
}

/// The workers and their admission gate.
struct Pool {
    /// Admitted jobs; its capacity is the admission limit, so a push after a successful permit
    /// acquire cannot fail.
    jobs: ArrayQueue<Job>,
    in_flight: Arc<AtomicUsize>,
    shutdown: AtomicBool,
    /// Worker handles to unpark after a push (set once the workers are spawned).
    workers: OnceLock<Vec<Thread>>,
    /// Per worker: parked or about to park (set before its last look at the queue).
    idle: [AtomicBool; DECODE_WORKERS],
    /// The worker a push unparks when none is idle (round robin).
    next_worker: AtomicUsize,
    /// Times a worker came back from `park` (one relaxed add per wake-up; tests read it).
    wakeups: AtomicUsize,
}

static POOL: OnceLock<Arc<Pool>> = OnceLock::new();

/// Starts the pool's workers on the CPUs the first `shards` serving cores leave (else unpinned
/// at a lower priority). Start-up calls it before the cores serve; a pool not started by then is
/// started by its first job (tests and examples that build cores directly).
pub fn start(shards: usize) {
    POOL.get_or_init(|| Pool::start(spare_cpus(shards)));
}

fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool::start(spare_cpus(crate::shard::cores())))
}

/// Decodes `raw` as an `M` on the pool. The receiver answers once a worker decoded it, or fails
/// if the job was dropped (shutdown).
pub fn decode<M>(raw: Bytes) -> Result<oneshot::Receiver<Result<M, prost::DecodeError>>, Refused>
where
    M: prost::Message + Default + Send + 'static,
{
    let (reply, rx) = oneshot::channel();
    pool().submit(Box::new(move || {
        // The caller stopped waiting (its stream was reset) before we started: skip the work.
        if !reply.is_closed() {
            let _ = reply.send(M::decode(raw));
        }
    }))?;
    Ok(rx)
}

impl Pool {
    fn start(cpus: Option<Vec<usize>>) -> Arc<Self> {
        let pool = Arc::new(Self {
            jobs: ArrayQueue::new(MAX_OFFCORE_DECODES),
            in_flight: Arc::new(AtomicUsize::new(0)),
            shutdown: AtomicBool::new(false),
            workers: OnceLock::new(),
            idle: std::array::from_fn(|_| AtomicBool::new(false)),
            next_worker: AtomicUsize::new(0),
            wakeups: AtomicUsize::new(0),
        });
        let mut handles = Vec::with_capacity(DECODE_WORKERS);
        for i in 0..DECODE_WORKERS {
            let worker = pool.clone();
            let cpus = cpus.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{WORKER_THREAD_PREFIX}{i}"))
                .spawn(move || {
                    place_current_thread(cpus.as_deref());
                    worker.work(i);
                });
            match spawned {
                Ok(h) => handles.push(h.thread().clone()),
                Err(e) => tracing::error!(error = %e, worker = i, "decode_worker_spawn_failed"),
            }
        }
        if handles.is_empty() {
            pool.shutdown.store(true, Ordering::Release);
        }
        let _ = pool.workers.set(handles);
        pool
    }

    /// Admits and queues one job without blocking.
    fn submit(&self, work: Box<dyn FnOnce() + Send>) -> Result<(), Refused> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(Refused::Unavailable);
        }
        let permit =
            Permit::try_acquire(&self.in_flight, MAX_OFFCORE_DECODES).ok_or(Refused::Full)?;
        // Every queued job holds a permit and the queue's capacity is the permit limit, so this
        // cannot fail; if it ever did, the job (and its permit) is dropped and the call refused.
        self.jobs
            .push(Job {
                work,
                _permit: permit,
            })
            .map_err(|_| Refused::Full)?;
        self.wake_one_worker();
        Ok(())
    }

    /// Wakes one worker: an idle one if any, else the next in turn (it is busy, and its
    /// `unpark` makes its next `park` return at once, so it takes the job then). A worker marks
    /// itself idle before its last look at the queue, so a job pushed before that look is
    /// taken by it, and one pushed after it finds the worker idle here. Waking every worker
    /// made each job wake them all, and on a CPU shared with a serving core each wake-up could
    /// switch the core out (perf/runs/2026-12-06-hostile-volume.md).
    fn wake_one_worker(&self) {
        let workers = self.workers.get().map(Vec::as_slice).unwrap_or_default();
        if workers.is_empty() {
            return;
        }
        let idle = (0..workers.len()).find(|&i| self.idle[i].swap(false, Ordering::SeqCst));
        let i = idle
            .unwrap_or_else(|| self.next_worker.fetch_add(1, Ordering::Relaxed) % workers.len());
        workers[i].unpark();
    }

    /// Wakes every worker (shutdown); `unpark` before `park` makes that `park` return at once,
    /// so a worker between its shutdown check and its park still sees it.
    #[cfg(test)]
    fn wake_workers(&self) {
        for w in self.workers.get().into_iter().flatten() {
            w.unpark();
        }
    }

    fn work(&self, index: usize) {
        while !self.shutdown.load(Ordering::Acquire) {
            if let Some(job) = self.jobs.pop() {
                // prost reports a malformed message as an error; a panic here is a bug, and the
                // server's panic hook aborts on it as on a core.
                (job.work)();
                continue;
            }
            self.idle[index].store(true, Ordering::SeqCst);
            match self.jobs.pop() {
                Some(job) => {
                    self.idle[index].store(false, Ordering::SeqCst);
                    (job.work)();
                }
                None => {
                    std::thread::park();
                    self.wakeups.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferencecache_proto::v1alpha1 as pb;
    use prost::Message;

    #[test]
    fn a_message_decodes_off_the_calling_thread() {
        let event = pb::CacheEvent {
            tenant_id: "t".into(),
            model_id: "m".into(),
            ..Default::default()
        };
        let rx = decode::<pb::CacheEvent>(event.encode_to_vec().into()).expect("admitted");
        let decoded = rx.blocking_recv().expect("answered").expect("decodes");
        assert_eq!(decoded, event);
        let bad = decode::<pb::CacheEvent>(Bytes::from_static(&[0xff, 0xff]))
            .expect("admitted")
            .blocking_recv()
            .expect("answered");
        assert!(bad.is_err(), "a malformed message is a decode error");
    }

    /// Waits (bounded) until every worker of `pool` is parked or about to park.
    fn all_idle(pool: &Pool) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if pool.idle.iter().all(|i| i.load(Ordering::SeqCst)) {
                std::thread::sleep(std::time::Duration::from_millis(20));
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        false
    }

    #[test]
    fn a_job_wakes_one_worker() {
        let pool = Pool::start(None);
        assert!(all_idle(&pool), "the workers park");
        let before = pool.wakeups.load(Ordering::SeqCst);
        let (done, finished) = std::sync::mpsc::channel();
        pool.submit(Box::new(move || done.send(()).unwrap()))
            .expect("admitted");
        finished
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the job ran");
        assert!(all_idle(&pool), "the workers park again");
        assert_eq!(
            pool.wakeups.load(Ordering::SeqCst) - before,
            1,
            "one job, one worker woken"
        );
        pool.shutdown.store(true, Ordering::Release);
        pool.wake_workers();
    }

    #[test]
    fn a_full_pool_refuses_instead_of_growing() {
        let pool = Pool::start(None);
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(std::sync::Mutex::new(gate));
        let mut admitted = 0;
        for _ in 0..MAX_OFFCORE_DECODES {
            let gate = gate.clone();
            let held = pool.submit(Box::new(move || {
                let _ = gate.lock().unwrap().recv();
            }));
            admitted += usize::from(held.is_ok());
        }
        assert_eq!(admitted, MAX_OFFCORE_DECODES);
        assert_eq!(pool.submit(Box::new(|| {})), Err(Refused::Full));
        for _ in 0..MAX_OFFCORE_DECODES {
            release.send(()).unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pool.in_flight.load(Ordering::Acquire) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(pool.submit(Box::new(|| {})), Ok(()), "slots come back");
        pool.shutdown.store(true, Ordering::Release);
        pool.wake_workers();
    }
}
