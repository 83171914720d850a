//! Connections: core 0 accepts and deals them round-robin to all cores (evenly, instead of by
//! the kernel's SO_REUSEPORT hash); each core serves its own with the start-up handler, up to a
//! bound, past which a new connection is closed at once.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Duration;

use glommio::net::{TcpListener, TcpStream};

use super::{ConnectionHandler, mailbox, shutdown_requested};

/// The handler and the per-core bound, fixed at start.
static SERVE: OnceLock<(ConnectionHandler, usize)> = OnceLock::new();

thread_local! {
    static LIVE_CONNECTIONS: Cell<usize> = const { Cell::new(0) };
}

pub(super) fn init(handler: ConnectionHandler, max_per_core: usize) {
    assert!(
        SERVE.set((handler, max_per_core.max(1))).is_ok(),
        "connection handler set twice"
    );
}

/// Connections this core serves now.
pub(super) fn live_connections() -> usize {
    LIVE_CONNECTIONS.with(|c| c.get())
}

/// Core 0's accept loop: deals accepted connections round-robin over all cores.
pub(super) async fn accept_loop(listener: TcpListener) {
    let cores = mailbox::cores();
    let mut next = 0usize;
    loop {
        let accepted =
            futures_lite::future::or(async { Some(listener.shared_accept().await) }, async {
                shutdown_requested().await;
                None
            })
            .await;
        let Some(accepted) = accepted else { return };
        let stream = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "grpc_accept_error");
                glommio::timer::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let target = next % cores;
        next = next.wrapping_add(1);
        if target == 0 {
            serve(stream.bind_to_executor());
        } else if let Err(mailbox::Op::Connection(back)) =
            mailbox::try_push(target, mailbox::Op::Connection(stream))
        {
            // The target's queue is full: serve here rather than drop the connection.
            serve(back.bind_to_executor());
        }
    }
}

/// Serves one connection on the current core, unless the core is at its bound.
pub(super) fn serve(stream: TcpStream) {
    let (handler, limit) = *SERVE.get().expect("runtime started");
    if live_connections() >= limit {
        tracing::warn!(limit, "grpc_connection_refused");
        drop(stream);
        return;
    }
    LIVE_CONNECTIONS.with(|c| c.set(c.get() + 1));
    glommio::spawn_local(async move {
        handler(stream).await;
        LIVE_CONNECTIONS.with(|c| c.set(c.get() - 1));
    })
    .detach();
}
