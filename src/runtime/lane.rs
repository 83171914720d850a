//! The maintenance lane: at most one maintenance piece per reactor turn on a core.
//!
//! A maintenance piece is one bounded step of work that is not a request's own: a TTL sweep
//! slice, a cap candidate build slice, the cap victims readied before an operation, a cap
//! eviction step, an ingest part (a slice of a producer message, `ingest::apply_update`), an
//! `ALL_CLEARED` slice run before an ingest. Each is bounded (≈ 250 µs), but they pause on the
//! same short timers, so all that paused in one turn become runnable in the next, and glommio
//! then runs every runnable task before it polls I/O again: 3–10 pieces back to back, 0.5–0.9 ms
//! during which a lookup that arrived waits unseen (perf/runs/2026-12-06-hostile-volume.md).
//!
//! Why this works, from glommio 0.9's executor (`LocalExecutor::run`): each turn is one
//! `poll_io` (the reactor: timers, foreign wakes, io_uring submissions and completions) followed
//! by `run_task_queues`, which runs runnable tasks until none is left or `need_preempt()` (a
//! completion on the latency ring: the 1 ms preemption timer or a foreign wake) says stop. Task
//! queues, shares and `Latency::Matters` only order the queues *within* that pass and shorten the
//! preemption timer; `yield_if_needed` yields only once the timer fired; `yield_now` and
//! `yield_task_queue_now` put the task back in the same pass. None of them ends a turn early or
//! counts turns. What glommio does guarantee is that an io_uring completion of the main ring
//! wakes its task only inside the reactor's poll (`Reactor::react` / `spin_poll_io`: the main
//! ring never "rushes" its completions in the middle of a pass), and that a submission made
//! during a pass reaches the kernel only at the next poll. So a piece takes the lane; the lane's
//! beacon task then issues one 1-byte read of `/dev/zero` (completed inline by the kernel when
//! that poll submits it) and frees the lane when the read completes: necessarily after the core
//! polled I/O again. The next waiting piece is woken by the beacon from inside that later pass,
//! so it runs after the requests that poll woke, and never in the turn of the previous piece.
//! No timer is involved (glommio's short timers lose wake-ups on this VM, DataDog/glommio#547).
//!
//! Pieces take the lane in the order they asked (FIFO): a sweep or cap build waiting behind
//! ingest parts gets its turn after those ahead of it, so nothing is starved, and requests never
//! wait for the lane. A piece that runs on another core's behalf in the mailbox drain task
//! (`--shards 2` and up) must not wait there ([`take_on_hop`]): it runs at once and holds the
//! lane for the rest of the turn, so the turn's other pieces wait (a hop piece in a turn
//! already used counts `inferencecache_core_lane_hop_overruns`). At most
//! [`MAINTENANCE_LANE_MAX_WAITERS`] pieces wait on one core; past that a piece runs without
//! waiting (`inferencecache_limit_hits_total{limit="maintenance_lane_waiters"}`).
//!
//! A core without the beacon (the in-process perf harness, unit tests of `CoreState`) has no
//! lane: every piece runs at once.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::limits::MAINTENANCE_LANE_MAX_WAITERS;

/// One core's lane.
struct Lane {
    /// Whether this core's beacon runs (it frees the lane); without it nothing waits.
    installed: bool,
    /// A piece ran since the core last polled I/O: the pieces that ask now wait.
    taken: bool,
    /// The pieces waiting, in the order they asked: (ticket, waker).
    waiters: VecDeque<(u64, Waker)>,
    /// The next waiter's ticket.
    next_ticket: u64,
    /// The beacon, waiting for the lane to be taken.
    beacon: Option<Waker>,
    /// Pieces that took the lane so far (wrapping): the beacon frees the lane only after a poll
    /// that followed the last of them.
    takes: u64,
}

thread_local! {
    static LANE: RefCell<Lane> = const {
        RefCell::new(Lane {
            installed: false,
            taken: false,
            waiters: VecDeque::new(),
            next_ticket: 0,
            beacon: None,
            takes: 0,
        })
    };
}

impl Lane {
    /// Marks the lane taken for this turn and wakes the beacon, which frees it after the next
    /// I/O poll.
    fn take_now(&mut self) {
        self.taken = true;
        self.takes = self.takes.wrapping_add(1);
        if let Some(b) = self.beacon.take() {
            b.wake();
        }
    }

    /// Whether `ticket` is the first waiter (or, for a piece not queued yet, nobody waits).
    fn is_first(&self, ticket: Option<u64>) -> bool {
        match ticket {
            None => self.waiters.is_empty(),
            Some(t) => self.waiters.front().is_some_and(|(f, _)| *f == t),
        }
    }

    /// Wakes the first waiter if the lane is free.
    fn wake_first_if_free(&self) {
        if !self.taken
            && let Some((_, w)) = self.waiters.front()
        {
            w.wake_by_ref();
        }
    }
}

/// Starts this core's beacon: from then on, maintenance pieces take the lane ([`take`]). Runs
/// on the core, once, before it serves.
pub fn install() {
    LANE.with_borrow_mut(|l| l.waiters.reserve(MAINTENANCE_LANE_MAX_WAITERS));
    glommio::spawn_local(beacon_loop()).detach();
}

/// The beacon: each time the lane is taken, one read that completes only once the core polled
/// I/O again, then frees the lane and wakes the first waiter (module docs).
async fn beacon_loop() {
    let file = match glommio::io::BufferedFile::open("/dev/zero").await {
        Ok(f) => f,
        Err(e) => {
            // No lane then: every piece runs at once, as before the lane existed.
            tracing::warn!(error = %e, "maintenance_lane_unavailable");
            return;
        }
    };
    LANE.with_borrow_mut(|l| l.installed = true);
    loop {
        std::future::poll_fn(|cx| {
            LANE.with_borrow_mut(|l| {
                if l.taken {
                    Poll::Ready(())
                } else {
                    l.beacon = Some(cx.waker().clone());
                    Poll::Pending
                }
            })
        })
        .await;
        // Submitted at the next poll, completed there (an error completes there too). A piece
        // run on a hop after that poll but before this task ran again took the lane in the new
        // turn: then one more poll.
        loop {
            let takes = LANE.with_borrow(|l| l.takes);
            let _ = file.read_at(0, 1).await;
            if LANE.with_borrow(|l| l.takes) == takes {
                break;
            }
        }
        LANE.with_borrow_mut(|l| {
            l.taken = false;
            l.wake_first_if_free();
        });
    }
}

/// Waits until this core's lane is free in the current reactor turn, and takes it: the caller
/// then runs one maintenance piece at once (no await in between).
pub fn take() -> Take {
    Take { ticket: None }
}

/// The future of [`take`].
pub struct Take {
    /// Its place among the waiters, once it waits.
    ticket: Option<u64>,
}

impl Future for Take {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        LANE.with_borrow_mut(|l| {
            if !l.installed {
                return Poll::Ready(());
            }
            if !l.taken && l.is_first(self.ticket) {
                if self.ticket.take().is_some() {
                    l.waiters.pop_front();
                }
                l.take_now();
                return Poll::Ready(());
            }
            match self.ticket {
                Some(t) => {
                    if let Some((_, w)) = l.waiters.iter_mut().find(|(x, _)| *x == t) {
                        w.clone_from(cx.waker());
                    }
                }
                None if l.waiters.len() >= MAINTENANCE_LANE_MAX_WAITERS => {
                    crate::metrics::record_limit_hit("maintenance_lane_waiters");
                    l.take_now();
                    return Poll::Ready(());
                }
                None => {
                    let t = l.next_ticket;
                    l.next_ticket += 1;
                    l.waiters.push_back((t, cx.waker().clone()));
                    self.ticket = Some(t);
                    crate::metrics::record_lane_wait();
                }
            }
            Poll::Pending
        })
    }
}

impl Drop for Take {
    fn drop(&mut self) {
        let Some(t) = self.ticket else { return };
        // A piece given up while waiting (its stream reset, shutdown): its place goes to the
        // next, which is woken if it is now first and the lane is free.
        let _ = LANE.try_with(|l| {
            let mut l = l.borrow_mut();
            let was_first = l.is_first(Some(t));
            l.waiters.retain(|(x, _)| *x != t);
            if was_first {
                l.wake_first_if_free();
            }
        });
    }
}

/// Takes this core's lane for a piece that runs in the mailbox drain task on another core's
/// behalf and must not wait there: the piece runs at once; the turn's other pieces wait.
pub fn take_on_hop() {
    LANE.with_borrow_mut(|l| {
        if !l.installed {
            return;
        }
        if l.taken {
            crate::metrics::record_lane_hop_overrun();
        }
        l.take_now();
    });
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;
    use std::time::{Duration, Instant};

    use crate::runtime::core_executor;

    /// Whether the core completed a reactor turn since the last call on this thread: glommio
    /// adds each turn's run time to `total_runtime` once the pass over the task queues ended,
    /// and `executor_stats` hands the stats over and resets them.
    fn turn_ended_since_last_call() -> bool {
        !glommio::executor()
            .executor_stats()
            .total_runtime()
            .is_zero()
    }

    /// Three maintenance tasks run pieces of 100 µs, each yielding (runnable again at once)
    /// between two, as a flood keeps them: with the lane no two pieces run in one reactor
    /// turn, and every piece runs (nothing starves). Without it they run back to back.
    fn pieces_in_a_shared_turn(with_lane: bool) -> (usize, usize) {
        let cpu = crate::sys::cpus::allowed_cpus()[0];
        core_executor(cpu, 0)
            .spawn(move || async move {
                if with_lane {
                    super::install();
                    // The beacon opens its file first (I/O: done at a later turn).
                    let until = Instant::now() + Duration::from_secs(5);
                    while !super::LANE.with_borrow(|l| l.installed) && Instant::now() < until {
                        futures_lite::future::yield_now().await;
                    }
                    assert!(
                        super::LANE.with_borrow(|l| l.installed),
                        "the beacon started"
                    );
                }
                let shared = Rc::new(Cell::new(0usize));
                let ran = Rc::new(Cell::new(0usize));
                let tasks: Vec<_> = (0..3)
                    .map(|_| {
                        let (shared, ran) = (shared.clone(), ran.clone());
                        glommio::spawn_local(async move {
                            for _ in 0..20 {
                                if with_lane {
                                    super::take().await;
                                }
                                if !turn_ended_since_last_call() {
                                    shared.set(shared.get() + 1);
                                }
                                let until = Instant::now() + Duration::from_micros(100);
                                while Instant::now() < until {}
                                ran.set(ran.get() + 1);
                                futures_lite::future::yield_now().await;
                            }
                        })
                        .detach()
                    })
                    .collect();
                for t in tasks {
                    t.await;
                }
                (shared.get(), ran.get())
            })
            .expect("executor")
            .join()
            .expect("joined")
    }

    #[test]
    fn at_most_one_piece_runs_per_reactor_turn() {
        let (shared, ran) = pieces_in_a_shared_turn(true);
        eprintln!("with the lane: {shared} of {ran} pieces shared a turn");
        assert_eq!(ran, 60, "every piece ran");
        // The first piece may share the turn of the set-up's last task.
        assert!(shared <= 1, "{shared} pieces ran in the turn of another");
    }

    #[test]
    fn without_the_lane_pieces_share_turns() {
        let (shared, ran) = pieces_in_a_shared_turn(false);
        eprintln!("without the lane: {shared} of {ran} pieces shared a turn");
        assert_eq!(ran, 60);
        assert!(
            shared >= 30,
            "only {shared} pieces shared a turn: the test shows nothing"
        );
    }
}
