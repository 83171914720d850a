//! Adapters for serving on glommio cores with no tokio runtime on them (docs/ARCHITECTURE.md
//! §5): core-local futures inside tonic's `Send` handlers, and timers.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

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
