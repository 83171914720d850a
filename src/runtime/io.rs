//! Adapters for serving on glommio cores with no tokio runtime on them (docs/ARCHITECTURE.md
//! §5): core-local futures inside tonic's `Send` handlers, timers, and a byte-counting stream.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_lite::{AsyncRead, AsyncWrite};

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

/// A stream that counts the bytes read from it, so a watchdog can tell whether the peer ever
/// spoke (see `grpc::connection`), and that h2 reads through tokio's I/O traits.
///
/// Why not `tokio_util::compat`: its read adapter zeroes all of h2's unfilled read buffer
/// before every read (a futures-io read needs initialised bytes), several KiB per read and
/// the largest single item of a one-at-a-time LookupRoute's profile. Here a read lands in a
/// per-core scratch buffer, zeroed once, and only the bytes received are copied on.
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

/// Largest read of one call (and the size of each core's scratch buffer).
const READ_SCRATCH_BYTES: usize = 64 * 1024;

thread_local! {
    /// This core's read scratch; borrowed only inside one `poll_read` call.
    static READ_SCRATCH: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0u8; READ_SCRATCH_BYTES].into_boxed_slice());
}

impl<S: AsyncRead + Unpin> tokio::io::AsyncRead for CountingIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let want = buf.remaining().min(READ_SCRATCH_BYTES);
        READ_SCRATCH.with_borrow_mut(|scratch| {
            let polled = AsyncRead::poll_read(self.as_mut(), cx, &mut scratch[..want]);
            if let Poll::Ready(Ok(n)) = polled {
                buf.put_slice(&scratch[..n]);
            }
            polled.map_ok(|_| ())
        })
    }
}

impl<S: AsyncWrite + Unpin> tokio::io::AsyncWrite for CountingIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(self, cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(self, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_close(self, cx)
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
