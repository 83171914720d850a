//! The cross-core hop (src/runtime/mailbox.rs) between two OS threads pinned to CPUs 0 and 1
//! (`HOP_SAME_CPU=1`: both on CPU 0). The bench prints each thread's CPU and how often the owner
//! really slept (voluntary context switches per op).
//!
//! Same parts as the server: a bounded `crossbeam_queue::ArrayQueue` of boxed closures per
//! owner, a `futures_util::task::AtomicWaker` the owner's drain task registers before sleeping,
//! and the reply on a `tokio::sync::oneshot` (no tokio runtime). The `park_*` and `spin_*`
//! benches run both sides on plain OS threads: `futures_lite::future::block_on` loops that sleep
//! in a futex (`thread::park`) and are woken by `unpark`, where the server's glommio executors
//! sleep in `io_uring_enter` and are woken remotely by glommio. Both are one kernel-level wake-up
//! per direction, so a round trip is two wake-ups, like a hop to an idle core in the server.
//! The `glommio_*` benches run the same parts between two real glommio executors.
//!
//! Benches (`cargo bench --bench hop`):
//! - `hop/local`: the closure run on the caller (the `N=1` / local-partition path).
//! - `hop/park_round_trip`: one op in flight, both sides sleep when idle (the server's case).
//! - `hop/park_16_in_flight`: 16 ops pushed back to back (the sleeping owner is woken once),
//!   16 replies awaited; criterion's per-element throughput gives the per-op time.
//! - `hop/spin_round_trip`: both sides busy-poll (queue + oneshot + cache-line transfer, no
//!   wake-up): the floor a spin window could reach on dedicated cores.
//! - `hop/glommio_round_trip`, `hop/glommio_16_in_flight`: the same parts between two real
//!   glommio executors (the server's wake-up path; skipped if io_uring is unavailable).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use crossbeam_queue::ArrayQueue;
use futures_util::task::AtomicWaker;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

/// The owner's state the closures run against (stands in for `CoreState`).
struct State {
    counter: u64,
}

type Op = Box<dyn FnOnce(&mut State) + Send>;

/// Same capacity as the server's `MAILBOX_CAPACITY`.
const CAPACITY: usize = 1024;

struct Inbox {
    queue: ArrayQueue<Op>,
    waker: AtomicWaker,
    stop: AtomicBool,
}

fn pin(cpu: usize) {
    // Online CPUs, not `available_parallelism` (which follows this thread's current mask, and a
    // thread spawned by the pinned caller starts with the caller's single CPU).
    // SAFETY: sysconf has no preconditions.
    if unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } < 2 {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls only read/write it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The owner's CPU: 1, or 0 with `HOP_SAME_CPU=1` (both threads share one CPU, the case of
/// `--shards 2` when the other vCPU is busy with something else).
fn owner_cpu() -> usize {
    if std::env::var_os("HOP_SAME_CPU").is_some_and(|v| v != "0") {
        0
    } else {
        1
    }
}

/// This thread's voluntary context switches (times it went to sleep).
fn voluntary_switches() -> u64 {
    std::fs::read_to_string("/proc/thread-self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The owner thread: drains the queue like `mailbox::drain_loop` (register the waker, re-check,
/// sleep) or, with `spin`, polls without ever sleeping.
fn owner(inbox: Arc<Inbox>, spin: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        pin(owner_cpu());
        // SAFETY: sched_getcpu has no preconditions.
        eprintln!("owner thread on cpu {}", unsafe { libc::sched_getcpu() });
        let mut st = State { counter: 0 };
        let mut ops = 0u64;
        let switches0 = voluntary_switches();
        futures_lite::future::block_on(async {
            loop {
                let mut done = 0;
                while let Some(op) = inbox.queue.pop() {
                    op(&mut st);
                    done += 1;
                }
                ops += done;
                if inbox.stop.load(Ordering::Acquire) {
                    // What was measured: how often the owner really went to sleep per op.
                    let sleeps = voluntary_switches() - switches0;
                    eprintln!(
                        "owner ({}): {ops} ops, {sleeps} voluntary context switches ({:.2} per op)",
                        if spin { "spin" } else { "park" },
                        sleeps as f64 / ops.max(1) as f64
                    );
                    return;
                }
                if done > 0 {
                    continue;
                }
                if spin {
                    std::hint::spin_loop();
                    continue;
                }
                std::future::poll_fn(|cx| {
                    inbox.waker.register(cx.waker());
                    if !inbox.queue.is_empty() || inbox.stop.load(Ordering::Acquire) {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    }
                })
                .await;
            }
        });
    })
}

/// `mailbox::try_call` without the runtime: box the op, push, wake, return the reply receiver.
fn send(inbox: &Inbox, x: u64) -> tokio::sync::oneshot::Receiver<u64> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let op: Op = Box::new(move |st: &mut State| {
        st.counter += x;
        let _ = tx.send(st.counter);
    });
    assert!(inbox.queue.push(op).is_ok(), "queue full");
    inbox.waker.wake();
    rx
}

fn stop(inbox: &Inbox, h: std::thread::JoinHandle<()>) {
    inbox.stop.store(true, Ordering::Release);
    inbox.waker.wake();
    h.join().unwrap();
}

fn new_inbox() -> Arc<Inbox> {
    Arc::new(Inbox {
        queue: ArrayQueue::new(CAPACITY),
        waker: AtomicWaker::new(),
        stop: AtomicBool::new(false),
    })
}

fn hop(c: &mut Criterion) {
    pin(0);
    // SAFETY: sched_getcpu has no preconditions.
    eprintln!("caller thread on cpu {}", unsafe { libc::sched_getcpu() });
    let mut g = c.benchmark_group("hop");
    g.sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(1));

    let mut st = State { counter: 0 };
    g.bench_function("local", |b| {
        b.iter(|| {
            let op: Op = Box::new(|st: &mut State| st.counter += black_box(1));
            op(&mut st);
            black_box(st.counter)
        })
    });

    let inbox = new_inbox();
    let h = owner(inbox.clone(), false);
    g.bench_function("park_round_trip", |b| {
        b.iter(|| futures_lite::future::block_on(send(&inbox, 1)).unwrap())
    });
    g.throughput(Throughput::Elements(16));
    g.bench_function("park_16_in_flight", |b| {
        b.iter(|| {
            let rxs: Vec<_> = (0..16).map(|i| send(&inbox, i)).collect();
            futures_lite::future::block_on(async {
                let mut last = 0;
                for rx in rxs {
                    last = rx.await.unwrap();
                }
                last
            })
        })
    });
    stop(&inbox, h);

    g.throughput(Throughput::Elements(1));
    let inbox = new_inbox();
    let h = owner(inbox.clone(), true);
    g.bench_function("spin_round_trip", |b| {
        b.iter(|| {
            let mut rx = send(&inbox, 1);
            loop {
                match rx.try_recv() {
                    Ok(v) => break v,
                    Err(tokio::sync::oneshot::error::TryRecvError::Empty) => std::hint::spin_loop(),
                    Err(e) => panic!("{e}"),
                }
            }
        })
    });
    stop(&inbox, h);
    g.finish();
}

/// The same hop between two glommio executors pinned to CPUs 0 and 1 (`Placement::Fixed`,
/// 512 KiB io_memory as in the server): the caller executor pushes, wakes the owner's
/// `AtomicWaker` and awaits the oneshot; the owner runs the server's drain loop (batch, then
/// `yield_now`, else register and sleep). Both sleep in io_uring and are woken remotely by
/// glommio, exactly the server's wake-up path. Criterion's thread hands each batch size to the
/// caller executor over a std channel and gets the elapsed time back (`iter_custom`).
fn hop_glommio(c: &mut Criterion) {
    use glommio::{LocalExecutorBuilder, Placement};
    let inbox = new_inbox();
    let owner_inbox = inbox.clone();
    let owner = LocalExecutorBuilder::new(Placement::Fixed(owner_cpu()))
        .io_memory(512 * 1024)
        .spawn(move || glommio_owner_loop(owner_inbox));
    let owner = match owner {
        Ok(h) => h,
        Err(e) => {
            eprintln!("glommio executor unavailable ({e}); skipping hop_glommio");
            return;
        }
    };
    // (batch of round trips, ops in flight per round trip) -> elapsed
    let (cmd_tx, cmd_rx) = std::sync::mpsc::channel::<(u64, u64)>();
    let (res_tx, res_rx) = std::sync::mpsc::channel::<Duration>();
    let caller_inbox = inbox.clone();
    let caller = LocalExecutorBuilder::new(Placement::Fixed(0))
        .io_memory(512 * 1024)
        .spawn(move || glommio_caller_loop(caller_inbox, cmd_rx, res_tx))
        .expect("caller executor");

    let mut g = c.benchmark_group("hop");
    g.sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for (name, in_flight) in [("glommio_round_trip", 1u64), ("glommio_16_in_flight", 16)] {
        g.throughput(Throughput::Elements(in_flight));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                cmd_tx.send((iters, in_flight)).unwrap();
                res_rx.recv().unwrap()
            })
        });
    }
    g.finish();
    drop(cmd_tx);
    caller.join().unwrap();
    inbox.stop.store(true, Ordering::Release);
    inbox.waker.wake();
    owner.join().unwrap();
}

/// The owner executor's drain loop, as the server's: run a batch, yield if there was one, else
/// register the waker, re-check and sleep; returns once `stop` is set.
async fn glommio_owner_loop(inbox: Arc<Inbox>) {
    let mut st = State { counter: 0 };
    loop {
        let mut done = 0;
        while let Some(op) = inbox.queue.pop() {
            op(&mut st);
            done += 1;
        }
        if inbox.stop.load(Ordering::Acquire) {
            return;
        }
        if done > 0 {
            futures_lite::future::yield_now().await;
            continue;
        }
        std::future::poll_fn(|cx| {
            inbox.waker.register(cx.waker());
            if !inbox.queue.is_empty() || inbox.stop.load(Ordering::Acquire) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
}

/// The caller executor: for each `(iterations, ops in flight)` command, runs that many round
/// trips of `in_flight` ops each and sends back the elapsed time; returns when the command
/// channel closes.
async fn glommio_caller_loop(
    inbox: Arc<Inbox>,
    cmd_rx: std::sync::mpsc::Receiver<(u64, u64)>,
    res_tx: std::sync::mpsc::Sender<Duration>,
) {
    // Blocking on the command channel between batches is fine: nothing else runs here.
    while let Ok((iters, in_flight)) = cmd_rx.recv() {
        let t = std::time::Instant::now();
        for i in 0..iters {
            let rxs: Vec<_> = (0..in_flight).map(|k| send(&inbox, i + k)).collect();
            for rx in rxs {
                black_box(rx.await.unwrap());
            }
        }
        let _ = res_tx.send(t.elapsed());
    }
}

criterion_group!(benches, hop, hop_glommio);
criterion_main!(benches);
