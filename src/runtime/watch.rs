//! Quiet connections polled by the spinning core instead of through io_uring.
//!
//! A read that would block normally arms an io_uring poll on the socket. When the request then
//! arrives while the core is spinning before it parks (`--busy-poll-us`), the completion reaches
//! the core as task work the kernel delivers with an inter-processor interrupt, then a reactor
//! turn (four `io_uring_enter` calls) before the connection runs: on this VM about half of a lone
//! call's latency (perf/runs/2026-12-05-quiet-connections-watched-by-the-spinning-core.md). So while
//! the core spins, the sockets of its quiet connections are instead watched: the core's watcher
//! task peeks at each with a non-blocking `recv` and wakes the connection whose bytes arrived.
//! When the core has spun its budget with nothing arriving, every watched connection is handed
//! back to glommio's poll and the core parks as before.
//!
//! Bounded: at most [`SPIN_WATCH_MAX_CONNECTIONS`] connections per core are watched (the others
//! use glommio's poll; `inferencecache_limit_hits_total{limit="spin_watch_connections"}`), and
//! the watcher spins at most [`SPIN_WATCH_SLICE`] before it lets the reactor turn, so timers,
//! hops and the unwatched connections wait at most that long behind it.

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::{AsyncRead, AsyncWrite};
use glommio::net::TcpStream;

use crate::limits::{SPIN_WATCH_MAX_CONNECTIONS, SPIN_WATCH_SLICE};

/// A connection's socket whose reads, while the core spins, are watched instead of polled
/// through io_uring. Writes go to glommio's stream unchanged.
pub struct WatchedStream {
    inner: TcpStream,
    fd: RawFd,
    /// Whether this core watches at all (it spins); if not, reads are glommio's alone.
    watching: bool,
    /// What a read that would block waits on.
    wait: ReadWait,
}

/// What a [`WatchedStream`]'s blocked read waits on until bytes arrive.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ReadWait {
    /// Nothing yet: the next blocked read asks for a place in the watch list.
    Nothing,
    /// Its entry (token) in the core's watch list.
    Watched(u64),
    /// glommio's io_uring poll: the list was full, or the watcher handed the entry back
    /// when the core stopped spinning.
    Glommio,
}

impl WatchedStream {
    /// Wraps a connection's socket on the core that serves it.
    pub fn new(inner: TcpStream) -> Self {
        let fd = inner.as_raw_fd();
        Self {
            inner,
            fd,
            watching: WATCH.with_borrow(|w| w.budget.is_some()),
            wait: ReadWait::Nothing,
        }
    }

    /// Registers (or refreshes) this stream's watch; whether it is watched. Once refused or
    /// handed back, it is not asked again until bytes arrive.
    fn watch(&mut self, waker: &Waker) -> bool {
        self.wait = WATCH.with_borrow_mut(|w| match self.wait {
            ReadWait::Nothing => w
                .add(self.fd, waker)
                .map_or(ReadWait::Glommio, ReadWait::Watched),
            ReadWait::Watched(token) if w.refresh(token, waker) => ReadWait::Watched(token),
            _ => ReadWait::Glommio,
        });
        matches!(self.wait, ReadWait::Watched(_))
    }

    /// Bytes arrived (or the socket failed or closed): drops the watch, if any.
    fn arrived(&mut self) {
        if let ReadWait::Watched(token) = self.wait {
            WATCH.with_borrow_mut(|w| w.remove(token));
        }
        self.wait = ReadWait::Nothing;
    }
}

impl Drop for WatchedStream {
    fn drop(&mut self) {
        // The fd is about to be closed and may be reused: no entry may outlive it.
        self.arrived();
    }
}

impl AsyncRead for WatchedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        if !self.watching {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        match recv(self.fd, buf, 0) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            done => {
                self.arrived();
                return Poll::Ready(done);
            }
        }
        if self.watch(cx.waker()) {
            return Poll::Pending;
        }
        // glommio's own poll, which also retries the read once.
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if read.is_ready() {
            self.arrived();
        }
        read
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

/// A non-blocking `recv` of `fd` into `buf` with `flags` added.
fn recv(fd: RawFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the duration of the call.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            flags | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Whether `fd` has something for a reader: bytes, the peer's close, or an error.
fn readable(fd: RawFd) -> bool {
    let mut byte = [0u8; 1];
    !matches!(recv(fd, &mut byte, libc::MSG_PEEK), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// One watched connection.
struct Entry {
    token: u64,
    fd: RawFd,
    waker: Waker,
}

/// One core's watch list.
struct Watch {
    /// How long the core spins with nothing arriving before it hands the list back to glommio
    /// (`--busy-poll-us`); `None`: this core does not spin, nothing is watched.
    budget: Option<Duration>,
    entries: Vec<Entry>,
    next_token: u64,
    /// The watcher task, while the core does not spin.
    watcher: Option<Waker>,
    /// Whether the core spins: from its last activity until the budget has passed.
    spinning: bool,
    /// When bytes last arrived on a watched connection or one was added.
    last_activity: Instant,
    /// Where the next pass starts, so a pass cut short by its deadline does not always
    /// favour the first entries.
    cursor: usize,
}

thread_local! {
    static WATCH: RefCell<Watch> = RefCell::new(Watch {
        budget: None,
        entries: Vec::new(),
        next_token: 0,
        watcher: None,
        spinning: false,
        last_activity: Instant::now(),
        cursor: 0,
    });
}

impl Watch {
    /// Adds `fd`; its token, or `None` when nothing is watched or the list is full.
    fn add(&mut self, fd: RawFd, waker: &Waker) -> Option<u64> {
        self.budget?;
        if self.entries.len() >= SPIN_WATCH_MAX_CONNECTIONS {
            crate::metrics::record_limit_hit("spin_watch_connections");
            return None;
        }
        if self.entries.capacity() == 0 {
            self.entries.reserve_exact(SPIN_WATCH_MAX_CONNECTIONS);
        }
        let token = self.next_token;
        self.next_token += 1;
        self.entries.push(Entry {
            token,
            fd,
            waker: waker.clone(),
        });
        self.activity();
        Some(token)
    }

    /// The core did something: it spins (again) for the budget from now.
    fn activity(&mut self) {
        self.last_activity = Instant::now();
        self.spinning = true;
        if let Some(w) = self.watcher.take() {
            w.wake();
        }
    }

    /// Points `token`'s entry at `waker`; false if the watcher has removed it.
    fn refresh(&mut self, token: u64, waker: &Waker) -> bool {
        match self.entries.iter_mut().find(|e| e.token == token) {
            Some(e) => {
                e.waker.clone_from(waker);
                true
            }
            None => false,
        }
    }

    fn remove(&mut self, token: u64) {
        self.entries.retain(|e| e.token != token);
    }

    /// Peeks at the entries, each at most once, from where the last pass stopped, until
    /// `deadline` (checked every [`PEEKS_PER_CLOCK_READ`] peeks), waking (and removing) those
    /// with something to read; how many it woke.
    fn pass(&mut self, deadline: Instant) -> usize {
        let mut woke = 0;
        for peeked in 1..=self.entries.len() {
            if self.cursor >= self.entries.len() {
                self.cursor = 0;
            }
            if readable(self.entries[self.cursor].fd) {
                self.entries.swap_remove(self.cursor).waker.wake();
                woke += 1;
            } else {
                self.cursor += 1;
            }
            if peeked % PEEKS_PER_CLOCK_READ == 0 && Instant::now() >= deadline {
                break;
            }
        }
        if woke > 0 {
            crate::metrics::record_spin_watch(woke as u64, 0);
        }
        woke
    }

    /// Hands every entry back to glommio's poll: the core stops spinning.
    fn release_all(&mut self) {
        self.spinning = false;
        crate::metrics::record_spin_watch(0, self.entries.len() as u64);
        for e in self.entries.drain(..) {
            e.waker.wake();
        }
    }
}

/// Work other than a connection's (a hop run on this core): the core spins for the budget from
/// now, so a next hop soon after is noticed without a wake-up. No-op when the core does not spin.
pub fn note_activity() {
    WATCH.with_borrow_mut(|w| {
        if w.budget.is_some() {
            w.activity();
        }
    });
}

/// Sets this core's spin budget (`--busy-poll-us`; `None`: no watching) and, if it spins,
/// starts its watcher. Called once per core before it serves.
pub fn install(budget: Option<Duration>) {
    WATCH.with_borrow_mut(|w| w.budget = budget.filter(|b| !b.is_zero()));
    if WATCH.with_borrow(|w| w.budget.is_some()) {
        glommio::spawn_local(watcher()).detach();
    }
}

/// The core's watcher, and its spin: from the core's last activity until the budget has passed,
/// peeks at the watched connections in slices of at most [`SPIN_WATCH_SLICE`] and lets the
/// reactor turn between slices; then hands them back and waits for the next activity.
async fn watcher() {
    // One timer for all turns, registered once.
    let mut turn = glommio::timer::Timer::new(REACTOR_TURN);
    loop {
        Spinning.await;
        let (woke, idle_for) = WATCH.with_borrow_mut(spin_slice);
        if woke == 0 {
            let budget = WATCH.with_borrow(|w| w.budget.unwrap_or_default());
            if idle_for >= budget {
                WATCH.with_borrow_mut(Watch::release_all);
                continue;
            }
        }
        // A reactor turn: glommio's completions, timers, and the connections just woken.
        reactor_turn(&mut turn).await;
    }
}

/// The timer the watcher waits on between slices: expired by the next reactor turn.
const REACTOR_TURN: Duration = Duration::from_micros(1);

/// Peeks between two clock reads in a pass: a `recv` costs far more than a clock read, but a
/// pass of a few peeks needs none.
const PEEKS_PER_CLOCK_READ: usize = 4;

/// Waits on `turn` reset to [`REACTOR_TURN`], so the task yields to the reactor: a timer already
/// due when first polled (the thread was descheduled in between) is reset and polled again, a
/// few times at most.
async fn reactor_turn(turn: &mut glommio::timer::Timer) {
    let mut armed = false;
    std::future::poll_fn(|cx| {
        if armed {
            return Pin::new(&mut *turn).poll(cx).map(drop);
        }
        for _ in 0..4 {
            turn.reset(REACTOR_TURN);
            if Pin::new(&mut *turn).poll(cx).is_pending() {
                armed = true;
                return Poll::Pending;
            }
        }
        Poll::Ready(())
    })
    .await
}

/// Peeks until something is woken or the slice ends; how many were woken, and for how long
/// nothing had arrived at the end.
fn spin_slice(w: &mut Watch) -> (usize, Duration) {
    let deadline = Instant::now() + SPIN_WATCH_SLICE;
    loop {
        let woke = w.pass(deadline);
        let now = Instant::now();
        if woke > 0 {
            w.last_activity = now;
            return (woke, Duration::ZERO);
        }
        if w.entries.is_empty() || now >= deadline {
            return (0, now - w.last_activity);
        }
    }
}

/// Ready while the core spins.
struct Spinning;

impl Future for Spinning {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        WATCH.with_borrow_mut(|w| {
            if w.spinning {
                Poll::Ready(())
            } else {
                w.watcher = Some(cx.waker().clone());
                Poll::Pending
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream as StdStream};

    use futures_lite::AsyncReadExt;
    use glommio::{LocalExecutorBuilder, Placement};

    use super::*;
    use crate::limits::IO_MEMORY_BYTES;

    /// Runs `f` on a fresh executor whose watch has `budget`.
    fn on_core<F: Future<Output = ()>>(budget: Duration, f: impl FnOnce() -> F + Send + 'static) {
        LocalExecutorBuilder::new(Placement::Unbound)
            .io_memory(IO_MEMORY_BYTES)
            .spawn(move || async move {
                crate::metrics::register_core_thread();
                install(Some(budget));
                f().await;
            })
            .expect("glommio executor")
            .join()
            .expect("executor thread");
    }

    /// A connected pair: the core's watched end and the peer's blocking end.
    async fn pair(listener: &TcpListener) -> (WatchedStream, StdStream) {
        let ours = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (peer, _) = listener.accept().unwrap();
        (WatchedStream::new(ours), peer)
    }

    fn watched() -> usize {
        WATCH.with_borrow(|w| w.entries.len())
    }

    /// This core's count of connections the watch woke.
    fn woken() -> u64 {
        crate::metrics::core_snapshot().spin_watch_woken
    }

    async fn settle() {
        glommio::timer::sleep(Duration::from_millis(2)).await;
    }

    /// `task`'s output; fails the test (instead of hanging it) after 5 s, as a lost wake-up would.
    async fn within<T>(task: impl Future<Output = T>) -> T {
        futures_lite::future::or(task, async {
            glommio::timer::sleep(Duration::from_secs(5)).await;
            panic!("not woken within 5 s");
        })
        .await
    }

    /// Waits (at most 2 s) until `watched()` is `n`.
    async fn until_watched(n: usize) {
        for _ in 0..2000 {
            if watched() == n {
                return;
            }
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
        panic!("{} watched, expected {n}", watched());
    }

    #[test]
    fn bytes_on_a_quiet_connection_are_noticed_by_the_watch() {
        on_core(Duration::from_secs(5), || async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let (mut ours, mut peer) = pair(&listener).await;
            let reader = glommio::spawn_local(async move {
                let mut buf = [0u8; 16];
                let n = ours.read(&mut buf).await.unwrap();
                buf[..n].to_vec()
            });
            until_watched(1).await;
            let before = woken();
            peer.write_all(b"hello").unwrap();
            assert_eq!(within(reader).await, b"hello");
            assert_eq!(watched(), 0);
            assert_eq!(woken() - before, 1, "the watch woke the reader");
        });
    }

    #[test]
    fn a_core_that_stops_spinning_hands_its_connections_to_glommio() {
        on_core(Duration::from_millis(50), || async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let (mut ours, mut peer) = pair(&listener).await;
            let reader = glommio::spawn_local(async move {
                let mut buf = [0u8; 16];
                let n = ours.read(&mut buf).await.unwrap();
                let first = buf[..n].to_vec();
                // Quiet again: watched again, since bytes arrived in between.
                let n = ours.read(&mut buf).await.unwrap();
                (first, buf[..n].to_vec())
            });
            glommio::timer::sleep(Duration::from_millis(150)).await;
            assert_eq!(watched(), 0, "released after the budget");
            let before = woken();
            peer.write_all(b"late").unwrap();
            // The next quiet read is watched again.
            until_watched(1).await;
            assert_eq!(woken(), before, "noticed by glommio's poll, not the watch");
            peer.write_all(b"next").unwrap();
            let (first, second) = within(reader).await;
            assert_eq!((&first[..], &second[..]), (&b"late"[..], &b"next"[..]));
        });
    }

    #[test]
    fn the_watch_list_is_bounded_and_the_rest_use_glommio() {
        on_core(Duration::from_secs(5), || async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut peers = Vec::new();
            let mut readers = Vec::new();
            for _ in 0..SPIN_WATCH_MAX_CONNECTIONS + 3 {
                let (mut ours, peer) = pair(&listener).await;
                peers.push(peer);
                readers.push(glommio::spawn_local(async move {
                    let mut buf = [0u8; 4];
                    ours.read(&mut buf).await.unwrap()
                }));
            }
            until_watched(SPIN_WATCH_MAX_CONNECTIONS).await;
            settle().await;
            assert_eq!(watched(), SPIN_WATCH_MAX_CONNECTIONS);
            let hits = crate::metrics::core_snapshot().limit_hits["spin_watch_connections"];
            assert!(hits >= 3, "{hits} limit hits");
            for p in &mut peers {
                p.write_all(b"x").unwrap();
            }
            for r in readers {
                assert_eq!(within(r).await, 1, "every connection reads, watched or not");
            }
        });
    }

    #[test]
    fn other_work_keeps_the_core_spinning_for_the_budget() {
        on_core(Duration::from_millis(30), || async {
            let spinning = || WATCH.with_borrow(|w| w.spinning);
            settle().await;
            assert!(!spinning(), "an idle core does not spin");
            note_activity();
            assert!(spinning(), "a hop run here starts the spin");
            glommio::timer::sleep(Duration::from_millis(100)).await;
            assert!(!spinning(), "and the budget ends it");
        });
    }

    #[test]
    fn closed_and_dropped_connections_leave_no_entry() {
        on_core(Duration::from_secs(5), || async {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let (mut ours, peer) = pair(&listener).await;
            let reader = glommio::spawn_local(async move {
                let mut buf = [0u8; 4];
                ours.read(&mut buf).await.unwrap()
            });
            until_watched(1).await;
            drop(peer);
            assert_eq!(within(reader).await, 0, "the peer's close is read");
            assert_eq!(watched(), 0);

            let (mut ours, _peer) = pair(&listener).await;
            let mut buf = [0u8; 4];
            let polled = futures_lite::future::poll_once(ours.read(&mut buf)).await;
            assert!(polled.is_none(), "nothing to read yet");
            assert_eq!(watched(), 1);
            drop(ours);
            // At once: the watcher has not peeked at the closed fd.
            assert_eq!(
                watched(),
                0,
                "a dropped stream takes its entry (its fd may be reused)"
            );
        });
    }
}
