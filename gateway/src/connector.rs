//! Opens TCP connections from a source port that names a server core: the server's
//! shard-aware listener serves a connection on core `source port mod shards`.

use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::net::{TcpSocket, TcpStream};

/// Source ports are chosen in this range: above the well-known and registered ports most
/// services listen on. Linux's ephemeral range overlaps it; a port in use is skipped.
const SOURCE_PORTS: std::ops::Range<u16> = 20_000..60_000;
/// Ports tried per connection before giving up (each a failed bind or connect).
const MAX_PORT_ATTEMPTS: usize = 64;

/// A tonic connector whose connections leave from a port `p` with `p mod shards == core`.
#[derive(Clone, Debug)]
pub struct SourcePortConnector {
    addr: SocketAddr,
    core: usize,
    shards: usize,
}

impl SourcePortConnector {
    /// Connections to `addr`, to be served by `core` of `shards`.
    ///
    /// # Panics
    /// If `core >= shards`.
    pub fn new(addr: SocketAddr, core: usize, shards: usize) -> Self {
        assert!(core < shards, "core {core} of {shards}");
        Self { addr, core, shards }
    }

    /// Connects from the first free port of a pseudo-random sequence of ports naming the core.
    pub async fn connect(&self) -> io::Result<TcpStream> {
        let mut last = io::Error::new(io::ErrorKind::AddrInUse, "no source port tried");
        for port in candidate_ports(
            self.core,
            self.shards,
            RandomState::new().hash_one(self.core),
        )
        .take(MAX_PORT_ATTEMPTS)
        {
            match connect_from(self.addr, port).await {
                Ok(s) => return Ok(s),
                // Taken locally, or the (source, destination) pair is still in TIME_WAIT.
                Err(e) if is_port_taken(&e) => last = e,
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }
}

/// Whether a bind or connect failed only because of the chosen source port.
fn is_port_taken(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::AddrInUse | io::ErrorKind::AddrNotAvailable
    )
}

/// Ports in [`SOURCE_PORTS`] with `port mod shards == core`, starting at a point `seed` picks.
fn candidate_ports(core: usize, shards: usize, seed: u64) -> impl Iterator<Item = u16> {
    let (lo, hi) = (
        usize::from(SOURCE_PORTS.start),
        usize::from(SOURCE_PORTS.end),
    );
    let first = lo.div_ceil(shards) * shards + core;
    let count = (hi - first).div_ceil(shards);
    let start = (seed % count as u64) as usize;
    (0..count).map(move |i| (first + ((start + i) % count) * shards) as u16)
}

async fn connect_from(addr: SocketAddr, port: u16) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    let local: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, port).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, port).into()
    };
    socket.bind(local)?;
    let stream = socket.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

impl tower_service::Service<http::Uri> for SourcePortConnector {
    type Response = TokioIo<TcpStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        let me = self.clone();
        Box::pin(async move { me.connect().await.map(TokioIo::new) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_name_the_core_and_stay_in_range() {
        for shards in [1, 2, 3, 4, 7, 64] {
            for core in 0..shards {
                for seed in [0, 1, 12_345, u64::MAX] {
                    let ports: Vec<u16> = candidate_ports(core, shards, seed).take(200).collect();
                    assert_eq!(ports.len(), 200);
                    for p in &ports {
                        assert_eq!(usize::from(*p) % shards, core);
                        assert!(SOURCE_PORTS.contains(p), "{p}");
                    }
                    let distinct: std::collections::HashSet<_> = ports.iter().collect();
                    assert_eq!(distinct.len(), 200, "no port repeats");
                }
            }
        }
    }

    #[tokio::test]
    async fn connections_leave_from_a_port_naming_the_core() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        for core in 0..3 {
            let c = SourcePortConnector::new(addr, core, 3);
            let stream = c.connect().await.unwrap();
            let (_, peer) = listener.accept().await.unwrap();
            assert_eq!(usize::from(peer.port()) % 3, core);
            assert_eq!(stream.local_addr().unwrap().port(), peer.port());
        }
    }
}
