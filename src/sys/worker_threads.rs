//! What the off-core worker pools share (the tokenizer's, `tokenizer::pool`, and the large
//! message decoder's, `runtime::decode_pool`): a non-blocking admission slot and the placement
//! of a worker thread away from the serving cores.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Niceness of workers that share CPUs with the serving cores: under contention the kernel
/// favours the serving cores over the pool's work.
const SHARED_CPU_NICE: libc::c_int = 5;

/// The CPUs left over once the per-core runtime pinned its first `shards` executors (it takes
/// the allowed CPUs in order); `None` when every allowed CPU serves.
pub fn spare_cpus(shards: usize) -> Option<Vec<usize>> {
    let spare: Vec<usize> = super::cpus::allowed_cpus()
        .into_iter()
        .skip(shards)
        .collect();
    (!spare.is_empty()).then_some(spare)
}

/// Best-effort placement of the calling worker thread: pinned to `cpus`, or (`None`) left
/// unpinned at a lower priority, since it then shares CPUs with the serving cores. Failures only
/// cost isolation.
pub fn place_current_thread(cpus: Option<&[usize]>) {
    match cpus {
        Some(cpus) => {
            // SAFETY: plain libc calls on a zeroed cpu_set_t owned by this frame; pid 0 = the
            // calling thread.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
                    libc::CPU_SET(c, &mut set);
                }
                let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
        }
        None => {
            // SAFETY: on Linux PRIO_PROCESS with a thread id sets that thread's nice value.
            unsafe {
                let tid = libc::gettid() as libc::id_t;
                let _ = libc::setpriority(libc::PRIO_PROCESS, tid, SHARED_CPU_NICE);
            }
        }
    }
}

/// One admitted concurrency slot of a pool; released when dropped (i.e. when its job is
/// finished or discarded).
pub struct Permit {
    in_flight: Arc<AtomicUsize>,
}

impl Permit {
    /// Non-blocking acquire (one CAS loop, no lock): fails at once when all `limit` slots are
    /// taken.
    pub fn try_acquire(in_flight: &Arc<AtomicUsize>, limit: usize) -> Option<Self> {
        in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Self {
                in_flight: in_flight.clone(),
            })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}
