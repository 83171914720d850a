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
