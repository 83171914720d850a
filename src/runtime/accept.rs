//! Connections: core 0 accepts and deals them to the cores — round-robin on the gRPC listener
//! (evenly, instead of by the kernel's SO_REUSEPORT hash), by the client's source port on the
//! shard-aware listener; each core serves its own with the start-up handler, up to a bound,
//! past which a new connection is closed at once.

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

/// How a listener picks the core that serves a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dealing {
    /// Each core in turn.
    RoundRobin,
    /// Core `client source port mod cores`: the shard-aware listener, where the client chooses
    /// the core by choosing its source port.
    SourcePort,
}

/// The core `dealing` picks for a connection from `peer` (`None` when the peer address is
/// unknown, which the caller deals round-robin).
fn source_port_core(peer: Option<std::net::SocketAddr>, cores: usize) -> Option<usize> {
    peer.map(|p| usize::from(p.port()) % cores)
}

/// Core 0's accept loop: deals accepted connections over all cores.
pub(super) async fn accept_loop(listener: TcpListener, dealing: Dealing) {
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
        let by_port = match dealing {
            Dealing::SourcePort => source_port_core(stream.peer_addr().ok(), cores),
            Dealing::RoundRobin => None,
        };
        let target = by_port.unwrap_or_else(|| {
            next = next.wrapping_add(1);
            next.wrapping_sub(1) % cores
        });
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

#[cfg(test)]
mod tests {
    use super::source_port_core;

    #[test]
    fn the_source_port_names_the_core() {
        let peer = |port| Some(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
        assert_eq!(source_port_core(peer(40_001), 2), Some(1));
        assert_eq!(source_port_core(peer(40_002), 2), Some(0));
        assert_eq!(source_port_core(peer(40_003), 4), Some(3));
        assert_eq!(source_port_core(peer(40_003), 1), Some(0));
        assert_eq!(source_port_core(None, 4), None);
    }
}
