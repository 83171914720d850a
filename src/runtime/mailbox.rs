//! The cross-core hop: one bounded lock-free queue per (sender, owner core) pair, drained by a
//! task on the owner, with replies on a oneshot (docs/ARCHITECTURE.md §1, §5).
//!
//! Bounded everywhere: a full queue is reported to the caller, which either fails open (lookups)
//! or backs off and retries (ingest, so acknowledged data is never dropped and memory never grows).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use futures_util::task::AtomicWaker;

use crate::limits::{
    CORE_HEARTBEAT_INTERVAL, MAILBOX_BACKOFF_MAX, MAILBOX_BACKOFF_MIN, MAILBOX_CAPACITY,
    MAILBOX_DRAIN_BATCH, MAX_CAP_SLICES_BEFORE_INGEST, SWEEP_SLICE_PAUSE,
};
use crate::shard::{self, CapNeed, CoreState};

/// Work shipped to the core that owns it.
pub enum Op {
    /// Run a closure against the owner's state (index operations, admin gathers).
    Run(Box<dyn FnOnce(&mut CoreState) + Send>),
    /// A gRPC connection accepted elsewhere, to be served by this core.
    Connection(glommio::net::AcceptedTcpStream),
}

/// Why a hop could not be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HopError {
    /// The owner's queue from this sender is full (back-pressure).
    Full,
    /// The owner dropped the reply (it is shutting down).
    Gone,
}

/// Inbound queues of one core: one per sender (each core, plus one slot for non-core threads).
pub struct Inbox {
    queues: Vec<ArrayQueue<Op>>,
    waker: AtomicWaker,
    /// Ops executed by this core on behalf of other senders (a metrics input).
    pub hopped_in: AtomicU64,
}

/// All inboxes of the process, indexed by owner core.
pub struct Mesh {
    inboxes: Vec<Inbox>,
}

static MESH: OnceLock<Mesh> = OnceLock::new();

/// Creates the mesh for `cores` executors. Must run once, before any executor starts.
pub(super) fn init(cores: usize) {
    assert!(cores >= 1);
    let senders = cores + 1; // the extra slot is shared by non-core threads (admin, signals)
    let inboxes = (0..cores)
        .map(|_| Inbox {
            queues: (0..senders)
                .map(|_| ArrayQueue::new(MAILBOX_CAPACITY))
                .collect(),
            waker: AtomicWaker::new(),
            hopped_in: AtomicU64::new(0),
        })
        .collect();
    assert!(
        MESH.set(Mesh { inboxes }).is_ok(),
        "mailbox mesh initialised twice"
    );
}

/// Number of cores in the mesh.
pub fn cores() -> usize {
    MESH.get().map(|m| m.inboxes.len()).unwrap_or(0)
}

/// The inbox of `core` (for metrics).
pub fn inbox(core: usize) -> &'static Inbox {
    &MESH.get().expect("mesh").inboxes[core]
}

/// Queue depth of `core`'s inbox summed over senders.
pub fn depth(core: usize) -> usize {
    inbox(core).queues.iter().map(|q| q.len()).sum()
}

/// Pushes `op` to `owner`'s queue from the calling thread's slot, waking the owner. A stalled
/// owner refuses new work (see [`super::health`]).
pub fn try_push(owner: usize, op: Op) -> Result<(), Op> {
    if super::health::is_stalled(owner) {
        return Err(op);
    }
    let mesh = MESH.get().expect("mesh");
    let slot = shard::current_core().unwrap_or(mesh.inboxes.len());
    let inbox = &mesh.inboxes[owner];
    inbox.queues[slot].push(op)?;
    inbox.waker.wake();
    Ok(())
}

/// The owner-side task: executes queued ops forever (until the executor stops).
pub async fn drain_loop(core: usize) {
    let inbox = inbox(core);
    loop {
        let mut done = 0usize;
        for q in &inbox.queues {
            while done < MAILBOX_DRAIN_BATCH {
                let Some(op) = q.pop() else { break };
                done += 1;
                match op {
                    Op::Run(f) => shard::with_core(f),
                    Op::Connection(s) => super::accept::serve(s.bind_to_executor()),
                }
            }
        }
        if done > 0 {
            inbox.hopped_in.fetch_add(done as u64, Ordering::Relaxed);
            super::watch::note_activity();
            futures_lite::future::yield_now().await;
            continue;
        }
        std::future::poll_fn(|cx| {
            inbox.waker.register(cx.waker());
            if inbox.queues.iter().any(|q| !q.is_empty()) {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
    }
}

/// Runs `f` on `owner`: locally when the caller is that core, else over the hop. Fails with
/// [`HopError::Full`] instead of waiting when the queue is full (the lookup path fails open).
pub async fn try_call<R, F>(owner: usize, f: F) -> Result<R, HopError>
where
    R: Send + 'static,
    F: FnOnce(&mut CoreState) -> R + Send + 'static,
{
    if shard::current_core() == Some(owner) {
        crate::metrics::record_hop(true);
        return Ok(shard::with_core(f));
    }
    crate::metrics::record_hop(false);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let op = Op::Run(Box::new(move |st| {
        let _ = tx.send(f(st));
    }));
    if try_push(owner, op).is_err() {
        return Err(HopError::Full);
    }
    rx.await.map_err(|_| HopError::Gone)
}

/// Runs `f` on `owner`, waiting (with bounded back-off sleeps) while the queue is full, so an
/// acknowledged ingest is never dropped and the producer feels back-pressure through HTTP/2.
/// Off the cores it must run on the admin runtime: the back-off is a timer there too, so a full
/// queue never blocks the admin thread.
pub async fn call<R, F>(owner: usize, f: F) -> Result<R, HopError>
where
    R: Send + 'static,
    F: FnOnce(&mut CoreState) -> R + Send + 'static,
{
    if shard::current_core() == Some(owner) {
        return Ok(shard::with_core(f));
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut op = Op::Run(Box::new(move |st| {
        let _ = tx.send(f(st));
    }));
    let mut backoff = MAILBOX_BACKOFF_MIN;
    loop {
        match try_push(owner, op) {
            Ok(()) => break,
            Err(_) if super::health::is_stalled(owner) => return Err(HopError::Gone),
            Err(back) => {
                op = back;
                backoff_sleep(backoff).await;
                backoff = (backoff * 2).min(MAILBOX_BACKOFF_MAX);
            }
        }
    }
    // Work queued just before its owner stalled fails once the watchdog marks the stall, instead
    // of waiting for the core to come back (it may still run then; ingest is idempotent).
    let reply = async { rx.await.map_err(|_| HopError::Gone) };
    let stalled = async {
        while !super::health::is_stalled(owner) {
            backoff_sleep(CORE_HEARTBEAT_INTERVAL).await;
        }
        Err(HopError::Gone)
    };
    futures_lite::future::or(reply, stalled).await
}

/// [`call`] once no `ALL_CLEARED` is pending on `owner` (the index `clear` module): for
/// operations that need its store after the clear (events, evictions, GetCacheState, scrapes).
/// See [`call_after_maintenance`].
pub async fn call_after_clear<R, F>(owner: usize, f: F) -> Result<R, HopError>
where
    R: Send + 'static,
    F: FnOnce(&mut CoreState) -> R + Send + 'static,
{
    call_after_maintenance(owner, CapNeed::Nothing, f).await
}

/// [`call`] once `owner` has no maintenance pending that `f` would otherwise finish in one step:
/// a pending `ALL_CLEARED`, and the global-cap victims it may take there (`need`,
/// `CoreState::cap_slice_before`). While one is pending, each attempt runs one slice of it
/// there instead (as the sweep does) and the caller pauses [`SWEEP_SLICE_PAUSE`] before the
/// next, so the core serves whatever else arrived in between and nothing waits behind more than
/// one slice. The cap's slices are bounded per call by [`MAX_CAP_SLICES_BEFORE_INGEST`]: past
/// it (policy pushes restarting every build), `f` builds what it needs itself, counted as a
/// build on the ingest. For a request's own work (`f` small: GetCacheState, an event, a scrape):
/// see [`call_piece`] for `f` that is itself a maintenance piece.
pub async fn call_after_maintenance<R, F>(owner: usize, need: CapNeed, f: F) -> Result<R, HopError>
where
    R: Send + 'static,
    F: FnOnce(&mut CoreState) -> R + Send + 'static,
{
    attempts_after_maintenance(owner, need, f, false).await
}

/// [`call_after_maintenance`] for `f` that is a maintenance piece itself (an ingest part, a cap
/// eviction step, a cross-core cap round): each attempt (`f`, or the slice run instead) takes
/// `owner`'s maintenance lane first, so no two pieces run in one reactor turn there
/// ([`super::lane`]). On `owner` it waits for the lane; over the hop it runs in the drain task,
/// which must not wait, and takes the lane for the rest of that turn.
pub async fn call_piece<R, F>(owner: usize, need: CapNeed, f: F) -> Result<R, HopError>
where
    R: Send + 'static,
    F: FnOnce(&mut CoreState) -> R + Send + 'static,
{
    attempts_after_maintenance(owner, need, f, true).await
}

/// The attempts of [`call_after_maintenance`] and [`call_piece`] (`piece`).
async fn attempts_after_maintenance<R, F>(
    owner: usize,
    need: CapNeed,
    f: F,
    piece: bool,
) -> Result<R, HopError>
where
    R: Send + 'static,
    F: FnOnce(&mut CoreState) -> R + Send + 'static,
{
    let mut f = f;
    let mut cap_slices = 0;
    let on_hop = shard::current_core() != Some(owner);
    loop {
        let wait_for = if cap_slices < MAX_CAP_SLICES_BEFORE_INGEST {
            need.clone()
        } else {
            CapNeed::Nothing
        };
        if piece && !on_hop {
            // No await between this and the attempt, which runs inline (`call` on its owner).
            super::lane::take().await;
        }
        let attempt = call(owner, move |st| {
            if piece && on_hop {
                super::lane::take_on_hop();
            }
            if st.clear_slice_if_pending() {
                Err((f, 0))
            } else if st.cap_slice_before(&wait_for) {
                Err((f, 1))
            } else {
                Ok(f(st))
            }
        });
        match attempt.await? {
            Ok(r) => return Ok(r),
            Err((back, cap)) => {
                f = back;
                cap_slices += cap;
                backoff_sleep(SWEEP_SLICE_PAUSE).await;
            }
        }
    }
}

/// Sleeps `d` on the calling thread's timer (the core's, or the admin runtime's): the pause
/// between two slices of work a caller drives on a core.
pub async fn pause(d: Duration) {
    backoff_sleep(d).await
}

/// Sleeps on the calling thread's timer: the core's, or the admin runtime's.
async fn backoff_sleep(d: Duration) {
    if shard::current_core().is_some() {
        super::io::sleep(d).await;
    } else {
        tokio::time::sleep(d).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full queue must not block the admin thread: its other tasks keep running while an
    /// ingest-style `call` waits for room.
    #[test]
    fn full_queue_backs_off_on_the_admin_timer_without_blocking_it() {
        init(1);
        let fill = || Op::Run(Box::new(|_: &mut CoreState| {}));
        while try_push(0, fill()).is_ok() {}
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let waiting = tokio::spawn(call(0, |_| ()));
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = done_tx.send(());
                waiting.abort();
            });
        });
        let progressed = done_rx.recv_timeout(Duration::from_secs(10));
        assert!(
            progressed.is_ok(),
            "the admin runtime froze behind a full mailbox"
        );
    }
}
