//! The admin thread: one small tokio runtime off the serving cores for everything that is not
//! the request path — the HTTP listeners, signal handling and the tasks tonic's reflection
//! service spawns (it calls `tokio::spawn`, which needs a runtime the glommio cores don't have).

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

static HANDLE: OnceLock<tokio::runtime::Handle> = OnceLock::new();

/// Starts the admin runtime on its own thread and returns its handle.
pub fn start() -> tokio::runtime::Handle {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("admin tokio runtime");
            let _ = tx.send(rt.handle().clone());
            rt.block_on(std::future::pending::<()>());
        })
        .expect("spawn admin thread");
    let handle = rx.recv().expect("admin runtime handle");
    let _ = HANDLE.set(handle.clone());
    handle
}

/// The admin runtime's handle, once started (for tasks that belong off the cores, e.g. the
/// StreamMetrics scrapes).
pub fn handle() -> Option<&'static tokio::runtime::Handle> {
    HANDLE.get()
}

/// Polls a future with the admin runtime entered, so `tokio::spawn` inside it lands on the
/// admin thread instead of panicking on a glommio core.
pub struct InAdminRuntime<F> {
    inner: Pin<Box<F>>,
}

impl<F> InAdminRuntime<F> {
    /// Wraps `inner`.
    pub fn new(inner: F) -> Self {
        Self {
            inner: Box::pin(inner),
        }
    }
}

impl<F: Future> Future for InAdminRuntime<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _guard = HANDLE.get().map(|h| h.enter());
        self.inner.as_mut().poll(cx)
    }
}
