//! A shard-aware InferenceCache client for gateways.
//!
//! An InferenceCache server runs `--shards N` cores; each `(tenant, model)` is owned by one of
//! them ([`inferencecache_partition`]). A request that arrives on another core hops to the
//! owner, which costs a cross-core wake-up. The server's shard-aware listener
//! (`--shard-aware-grpc-bind-address`) serves each connection on the core named by the
//! client's source port modulo N. [`ShardAwareClient`] uses it: it learns N from the server,
//! opens one connection per core from a source port that names that core, and sends each
//! `LookupRoute` over the connection of the owning core, so no request hops.
//!
//! Every lookup fails open: an error, a timeout or an unreachable server gives the contract's
//! `NO_HINT` answer, and the gateway routes as if there were no cache.
//!
//! ```no_run
//! # async fn example() -> Result<(), inferencecache_gateway::ConnectError> {
//! use std::time::Duration;
//! use inferencecache_gateway::{ShardAwareClient, request_from_tokens};
//!
//! let client = ShardAwareClient::connect("127.0.0.1:19090".parse().unwrap()).await?;
//! let req = request_from_tokens("team-a", "llama-8b", "vllm", &[1, 2, 3, 4], 16);
//! let answer = client.lookup_route(req, Duration::from_millis(5)).await;
//! println!("{} {:?}", answer.reason_code, answer.replica_scores.first());
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod connector;
mod lookup;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inferencecache_proto::v1alpha1::inference_cache_client::InferenceCacheClient;
use inferencecache_proto::v1alpha1::{LookupRouteRequest, LookupRouteResponse};
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

pub use connector::SourcePortConnector;
pub use inferencecache_partition::{PARTITION_FUNCTION, PARTITIONS, owner, partition};
pub use lookup::{Dial, DialFuture, LookupConnection, MAX_RESPONSE_BYTES};

/// Response header of the server's health answers: the number of cores it runs.
pub const SHARDS_HEADER: &str = "inferencecache-shards";
/// Response header of the server's health answers: the core serving this connection.
pub const SHARD_HEADER: &str = "inferencecache-shard";
/// Response header of the server's health answers: the partition function's name.
pub const PARTITION_FUNCTION_HEADER: &str = "inferencecache-partition-function";
/// The reason code of the fail-open answer.
pub const NO_HINT: &str = "NO_HINT";
/// Most cores a server reports that this client accepts (the server's own `--shards` limit).
pub const MAX_SHARDS: usize = 64;
/// Default time to open one connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why [`ShardAwareClient::connect`] failed.
#[derive(Debug)]
pub enum ConnectError {
    /// A connection could not be opened or the health call failed.
    Transport(String),
    /// The server's answer lacks the sharding headers (not a shard-aware listener, or an
    /// older server), or they are out of range.
    NotShardAware(String),
    /// The server uses a partition function this client does not know.
    PartitionFunction(String),
    /// A connection opened for core `wanted` is served by core `got`: something between
    /// client and server rewrites source ports (NAT, a proxy), so shard-aware routing cannot
    /// work on this path. Use plain connections instead.
    Misrouted { wanted: usize, got: usize },
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Transport(e) => write!(f, "cannot reach the shard-aware listener: {e}"),
            Self::NotShardAware(e) => write!(f, "not a shard-aware InferenceCache listener: {e}"),
            Self::PartitionFunction(name) => {
                write!(
                    f,
                    "unknown partition function {name:?} (this client knows {PARTITION_FUNCTION:?})"
                )
            }
            Self::Misrouted { wanted, got } => write!(
                f,
                "the connection for core {wanted} is served by core {got}: source ports are rewritten on the way"
            ),
        }
    }
}

impl std::error::Error for ConnectError {}

/// One connection per server core; each lookup goes to the core owning its `(tenant, model)`.
/// Cheap to clone (the connections are shared).
#[derive(Clone, Debug)]
pub struct ShardAwareClient {
    /// A tonic client per core, for every RPC ([`client_for`](Self::client_for)).
    cores: Vec<InferenceCacheClient<Channel>>,
    /// A lean `LookupRoute` connection per core, from a source port naming that core.
    lookups: Vec<LookupConnection>,
}

impl ShardAwareClient {
    /// Connects to the shard-aware listener at `addr` with [`DEFAULT_CONNECT_TIMEOUT`].
    pub async fn connect(addr: SocketAddr) -> Result<Self, ConnectError> {
        Self::connect_with_timeout(addr, DEFAULT_CONNECT_TIMEOUT).await
    }

    /// Learns the server's core count, then opens and checks one connection per core.
    pub async fn connect_with_timeout(
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<Self, ConnectError> {
        let (shards, _) = sharding(channel(addr, None, timeout).await?).await?;
        let mut cores = Vec::with_capacity(shards);
        for core in 0..shards {
            let ch = channel(addr, Some((core, shards)), timeout).await?;
            let (_, serving) = sharding(ch.clone()).await?;
            if serving != core {
                return Err(ConnectError::Misrouted {
                    wanted: core,
                    got: serving,
                });
            }
            cores.push(InferenceCacheClient::new(ch).max_decoding_message_size(64 << 20));
        }
        let mut lookups = Vec::with_capacity(shards);
        for core in 0..shards {
            let connector = SourcePortConnector::new(addr, core, shards);
            let dial: Dial = Arc::new(move || {
                let connector = connector.clone();
                Box::pin(async move { connector.connect().await })
            });
            let conn = LookupConnection::new(&addr.to_string(), dial)
                .map_err(|e| ConnectError::Transport(e.message().to_string()))?;
            conn.connect(timeout)
                .await
                .map_err(|e| ConnectError::Transport(e.message().to_string()))?;
            lookups.push(conn);
        }
        Ok(Self { cores, lookups })
    }

    /// Number of cores the server runs.
    pub fn shards(&self) -> usize {
        self.cores.len()
    }

    /// The client whose connection is served by the core owning `(tenant, model)`, for any
    /// RPC scoped to one `(tenant, model)`.
    pub fn client_for(&self, tenant: &str, model: &str) -> InferenceCacheClient<Channel> {
        self.cores[owner(tenant, model, self.cores.len())].clone()
    }

    /// `LookupRoute` on the owning core, bounded by `timeout` (also sent as the gRPC
    /// deadline). Fails open: any error or timeout gives [`no_hint`].
    pub async fn lookup_route(
        &self,
        req: LookupRouteRequest,
        timeout: Duration,
    ) -> LookupRouteResponse {
        self.try_lookup_route(req, timeout)
            .await
            .unwrap_or_else(|_| no_hint())
    }

    /// [`lookup_route`](Self::lookup_route) with the error instead of the fail-open answer.
    pub async fn try_lookup_route(
        &self,
        req: LookupRouteRequest,
        timeout: Duration,
    ) -> Result<LookupRouteResponse, tonic::Status> {
        self.lookup_connection_for(&req.tenant_id, &req.model_id)
            .lookup_route(&req, timeout)
            .await
    }

    /// The lean `LookupRoute` connection of the core owning `(tenant, model)`.
    pub fn lookup_connection_for(&self, tenant: &str, model: &str) -> &LookupConnection {
        &self.lookups[owner(tenant, model, self.lookups.len())]
    }
}

/// The fail-open answer: no replica scores, reason `NO_HINT`.
pub fn no_hint() -> LookupRouteResponse {
    LookupRouteResponse {
        reason_code: NO_HINT.to_string(),
        ..Default::default()
    }
}

/// A `LookupRoute` request for `tokens` under `hash_scheme` (the scheme the producers report,
/// e.g. `vllm`), fingerprinted here exactly as the server fingerprints
/// `token_ids` (whole blocks of `block_size` tokens; the tail is not part of any block), so
/// the server does no hashing.
pub fn request_from_tokens(
    tenant: &str,
    model: &str,
    hash_scheme: &str,
    tokens: &[u32],
    block_size: i32,
) -> LookupRouteRequest {
    let (block_hashes, block_token_counts) = inferencecache_fingerprint::chain(tokens, block_size);
    LookupRouteRequest {
        tenant_id: tenant.to_string(),
        model_id: model.to_string(),
        hash_scheme: hash_scheme.to_string(),
        block_hashes: block_hashes.into_iter().map(Into::into).collect(),
        block_token_counts,
        ..Default::default()
    }
}

/// A connection to `addr`; with `Some((core, shards))` from a source port naming `core`.
async fn channel(
    addr: SocketAddr,
    core: Option<(usize, usize)>,
    timeout: Duration,
) -> Result<Channel, ConnectError> {
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| ConnectError::Transport(e.to_string()))?
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true);
    let (core, shards) = core.unwrap_or((0, 1));
    ep.connect_with_connector(SourcePortConnector::new(addr, core, shards))
        .await
        .map_err(|e| ConnectError::Transport(e.to_string()))
}

/// The server's core count and the core serving `ch`, from a health call's headers.
async fn sharding(ch: Channel) -> Result<(usize, usize), ConnectError> {
    let answer = HealthClient::new(ch)
        .check(HealthCheckRequest::default())
        .await
        .map_err(|e| ConnectError::Transport(e.to_string()))?;
    let headers = answer.metadata();
    let number = |name: &str| -> Result<usize, ConnectError> {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| ConnectError::NotShardAware(format!("no {name} header")))
    };
    let function = headers
        .get(PARTITION_FUNCTION_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if function != PARTITION_FUNCTION {
        return Err(ConnectError::PartitionFunction(function.to_string()));
    }
    let (shards, serving) = (number(SHARDS_HEADER)?, number(SHARD_HEADER)?);
    if !(1..=MAX_SHARDS).contains(&shards) || serving >= shards {
        return Err(ConnectError::NotShardAware(format!(
            "core {serving} of {shards}"
        )));
    }
    Ok((shards, serving))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fail_open_answer_is_no_hint() {
        let a = no_hint();
        assert_eq!(a.reason_code, "NO_HINT");
        assert!(a.replica_scores.is_empty());
    }

    #[test]
    fn requests_carry_the_servers_fingerprint() {
        let tokens: Vec<u32> = (0..40).collect();
        let req = request_from_tokens("t", "m", "vllm", &tokens, 16);
        assert_eq!(req.block_token_counts, vec![16, 16]);
        let (hashes, _) = inferencecache_fingerprint::chain(&tokens, 16);
        assert_eq!(req.block_hashes, hashes);
        assert_eq!((req.tenant_id.as_str(), req.model_id.as_str()), ("t", "m"));
        assert_eq!(req.hash_scheme, "vllm");
    }

    #[tokio::test]
    async fn connecting_to_nothing_is_a_transport_error() {
        // A port nothing listens on (bound, then released).
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = ShardAwareClient::connect_with_timeout(addr, Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(matches!(err, ConnectError::Transport(_)), "{err}");
    }
}
