//! Adapters that let hyper 1.x serve HTTP/2 over glommio sockets on a glommio executor, with no
//! tokio runtime on the serving cores (docs/ARCHITECTURE.md §5).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_lite::{AsyncRead, AsyncWrite};
use glommio::net::TcpStream;

/// A futures-io stream (a glommio TCP stream, or a TLS stream over one) speaking hyper's
/// `Read`/`Write` traits.
pub struct GlommioIo<S = TcpStream>(pub S);

impl<S: AsyncRead + Unpin> hyper::rt::Read for GlommioIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        // hyper hands out uninitialised memory while futures-io wants `&mut [u8]`: zero it first.
        // SAFETY: every byte is written before the slice is viewed as initialised, and `advance`
        // is only called with the count the socket reported as filled.
        let slice = unsafe {
            let uninit = buf.as_mut();
            for b in uninit.iter_mut() {
                b.write(0);
            }
            &mut *(uninit as *mut [std::mem::MaybeUninit<u8>] as *mut [u8])
        };
        match Pin::new(&mut self.0).poll_read(cx, slice) {
            Poll::Ready(Ok(n)) => {
                // SAFETY: the socket filled `n` bytes of the slice, which was fully initialised
                // above, so advancing by `n` never exposes uninitialised memory.
                unsafe { buf.advance(n) };
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> hyper::rt::Write for GlommioIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_close(cx)
    }
}

/// Spawns hyper's per-stream HTTP/2 tasks on the current glommio executor: they stay on the
/// core that terminates the connection.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future + 'static,
{
    fn execute(&self, fut: F) {
        glommio::spawn_local(async move {
            fut.await;
        })
        .detach();
    }
}

/// Makes a core-local future `Send` so it can live inside tonic's `Send` handler futures.
///
/// Handler futures only ever run on the executor that spawned them (glommio never migrates
/// tasks), so the wrapped value never crosses a thread; the assertion in `poll` and `drop`
/// turns any violation into a panic instead of undefined behaviour.
pub struct LocalOnly<F> {
    inner: F,
    owner: std::thread::ThreadId,
}

impl<F> LocalOnly<F> {
    /// Wraps `inner`, recording the current thread as its owner.
    pub fn new(inner: F) -> Self {
        Self {
            inner,
            owner: std::thread::current().id(),
        }
    }
}

// SAFETY: see the type's documentation; access from another thread panics.
unsafe impl<F> Send for LocalOnly<F> {}

impl<F: Future> Future for LocalOnly<F> {
    type Output = F::Output;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        assert_eq!(
            std::thread::current().id(),
            self.owner,
            "LocalOnly polled off its core"
        );
        // SAFETY: structural pinning of `inner`; it is never moved out.
        unsafe { self.map_unchecked_mut(|s| &mut s.inner) }.poll(cx)
    }
}

impl<F> Drop for LocalOnly<F> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert_eq!(
                std::thread::current().id(),
                self.owner,
                "LocalOnly dropped off its core"
            );
        }
    }
}

/// Sleeps on the current core's timer from inside a `Send` handler future.
pub fn sleep(d: std::time::Duration) -> impl Future<Output = ()> + Send {
    LocalOnly::new(async move {
        glommio::timer::sleep(d).await;
    })
}

/// hyper's timer on the current core's glommio timers (HTTP/2 keep-alive pings).
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalTimer;

/// One glommio timer handed to hyper.
struct LocalSleep(LocalOnly<glommio::timer::Timer>);

// SAFETY: the timer is only reachable through `poll` (which takes `Pin<&mut Self>`) and `drop`,
// and `LocalOnly` asserts both happen on the owning core; `&LocalSleep` exposes nothing.
unsafe impl Sync for LocalSleep {}

impl Future for LocalSleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.0).poll(cx).map(|_| ())
    }
}

impl hyper::rt::Sleep for LocalSleep {}

impl hyper::rt::Timer for LocalTimer {
    fn sleep(&self, duration: std::time::Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(LocalSleep(LocalOnly::new(glommio::timer::Timer::new(
            duration,
        ))))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep(deadline.saturating_duration_since(std::time::Instant::now()))
    }
}

/// A stream that counts the bytes read from it, so a watchdog can tell whether the peer ever
/// spoke (see `grpc::connection`).
pub struct CountingIo<S> {
    inner: S,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<S> CountingIo<S> {
    /// Wraps `inner`; the returned cell holds the bytes read so far.
    pub fn new(inner: S) -> (Self, std::rc::Rc<std::cell::Cell<u64>>) {
        let read = std::rc::Rc::new(std::cell::Cell::new(0));
        (
            Self {
                inner,
                read: read.clone(),
            },
            read,
        )
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for CountingIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.read.set(self.read.get() + n as u64);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for CountingIo<S> {
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
