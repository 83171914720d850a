//! The ZMQ side: the SUB reader, the replay (DEALER) client, and the processor that ties frame
//! decoding, per-publisher seq tracking and mapping together.
//!
//! A publisher is identified by `(topic, dp_rank)`: one engine process publishes one seq
//! sequence per data-parallel rank, and a SUB socket does not expose which peer a message came
//! from. Each publisher has its own seq tracker and reverse map.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout, timeout_at};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::decode::{decode_batch, split_frames};
use crate::mapping::{Mapper, Op, PublisherState, ts_to_us};
use crate::metrics::Metrics;
use crate::seq::{SeqTracker, SeqVerdict};

/// ZMQ endpoints use `*` for "all interfaces"; the socket library wants an address.
pub fn bind_address(endpoint: &str) -> String {
    endpoint.replace("://*:", "://0.0.0.0:")
}

/// First pause between failed SUB connect attempts.
pub const CONNECT_RETRY_MIN: Duration = Duration::from_millis(100);
/// Longest pause between failed SUB connect attempts.
pub const CONNECT_RETRY_MAX: Duration = Duration::from_secs(5);

/// Opens the SUB socket: binds when the endpoint contains `*`, otherwise connects (retrying
/// until the engine is up; the library then reconnects by itself after engine restarts).
pub async fn open_sub(endpoint: &str, topic: &str) -> anyhow::Result<SubSocket> {
    let mut sock = SubSocket::new();
    // Subscribing first makes the library send the subscription on every (re)connect.
    sock.subscribe(topic).await?;
    if endpoint.contains('*') {
        let bound = sock.bind(&bind_address(endpoint)).await?;
        tracing::info!(endpoint = %bound, "SUB bound");
    } else {
        // The library retries refused connections itself; any other failure (unresolvable
        // host, unreachable network, ...) returns at once, so this loop waits between attempts
        // (100 ms doubling to 5 s) and stays cancellable by shutdown.
        let mut delay = CONNECT_RETRY_MIN;
        loop {
            match sock.connect(endpoint).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(%endpoint, error = %e, retry_in_ms = delay.as_millis() as u64, "engine publisher not reachable yet; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(CONNECT_RETRY_MAX);
                }
            }
        }
        tracing::info!(%endpoint, "SUB connected");
    }
    Ok(sock)
}

/// Reads multipart messages into the bounded queue. When the queue is full the reader waits
/// (counted), which stops reading the socket and lets the engine's PUB high-water mark apply;
/// batches the engine drops then show up as seq gaps (and are replayed when configured).
pub async fn read_loop(mut sock: SubSocket, tx: mpsc::Sender<Vec<Bytes>>, metrics: Arc<Metrics>) {
    loop {
        match sock.recv().await {
            Ok(msg) => match tx.try_send(msg.into_vec()) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(frames)) => {
                    metrics.backpressure_waits.inc();
                    if tx.send(frames).await.is_err() {
                        return;
                    }
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            },
            Err(e) => {
                tracing::debug!(error = %e, "SUB receive error");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Asks the engine's replay socket for batches `[from, to)`. Sends `["", be8(from)]` (a
/// REQ-compatible envelope from a DEALER), then reads `[seq, payload]` / `[topic, seq, payload]`
/// replies until the end marker (seq = -1), a seq ≥ `to`, or the timeout. A fresh socket per
/// replay means leftovers of an abandoned replay can never be mistaken for a later one.
pub async fn fetch_replay(
    endpoint: &str,
    from: u64,
    to: u64,
    limit: Duration,
) -> anyhow::Result<Vec<(u64, Bytes)>> {
    let deadline = Instant::now() + limit;
    let mut sock = DealerSocket::new();
    timeout(limit, sock.connect(endpoint))
        .await
        .map_err(|_| anyhow::anyhow!("replay connect timed out"))??;
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from.to_be_bytes()),
    ])
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    timeout_at(deadline, sock.send(req))
        .await
        .map_err(|_| anyhow::anyhow!("replay request timed out"))??;
    let mut out = Vec::new();
    while let Ok(msg) = timeout_at(deadline, sock.recv()).await {
        let frames = msg?.into_vec();
        let Ok(raw) = split_frames(&frames) else {
            continue;
        };
        match raw.seq {
            None => break,
            Some(s) if s >= to => break,
            Some(s) => out.push((s, raw.payload)),
        }
    }
    Ok(out)
}

/// Replay settings.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Engine ROUTER endpoint.
    pub endpoint: String,
    /// Time budget of one replay.
    pub timeout: Duration,
}

struct Publisher {
    seq: SeqTracker,
    state: PublisherState,
}

type PublisherKey = (Bytes, Option<i64>);

/// Turns raw ZMQ messages into index operations.
pub struct Processor {
    mapper: Mapper,
    replay: Option<ReplayConfig>,
    metrics: Arc<Metrics>,
    publishers: HashMap<PublisherKey, Publisher>,
    replicas: Arc<Mutex<BTreeSet<String>>>,
    max_publishers: usize,
}

/// Default bound on distinct publishers (`(topic, dp_rank)` pairs) one subscriber tracks.
pub const DEFAULT_MAX_PUBLISHERS: usize = 64;

impl Processor {
    /// A processor; `replicas` collects every replica id seen (the stats task reports to them).
    pub fn new(
        mapper: Mapper,
        replay: Option<ReplayConfig>,
        metrics: Arc<Metrics>,
        replicas: Arc<Mutex<BTreeSet<String>>>,
    ) -> Self {
        Self {
            mapper,
            replay,
            metrics,
            publishers: HashMap::new(),
            replicas,
            max_publishers: DEFAULT_MAX_PUBLISHERS,
        }
    }

    /// Bounds the publishers tracked at once (`--max-publishers`): each has a seq tracker and a
    /// reverse map, so batches from further unknown `(topic, dp_rank)` pairs (a misconfigured
    /// topic filter, garbage ranks) are dropped and counted instead of growing memory.
    pub fn with_max_publishers(mut self, n: usize) -> Self {
        self.max_publishers = n.max(1);
        self
    }

    /// Consumes the frame queue, forwarding operations to the sender (waiting when its queue
    /// is full, which propagates back-pressure to the reader).
    pub async fn run(mut self, mut rx: mpsc::Receiver<Vec<Bytes>>, ops: mpsc::Sender<Op>) {
        let mut out = Vec::new();
        while let Some(frames) = rx.recv().await {
            self.handle_frames(&frames, &mut out).await;
            for op in out.drain(..) {
                if ops.send(op).await.is_err() {
                    return;
                }
            }
        }
    }

    /// Handles one multipart message: decode, seq check (restart / gap + replay), mapping.
    pub async fn handle_frames(&mut self, frames: &[Bytes], out: &mut Vec<Op>) {
        let raw = match split_frames(frames) {
            Ok(r) => r,
            Err(e) => {
                self.metrics.drop_n("bad_frames", 1);
                tracing::warn!(error = %e, frames = frames.len(), "dropping malformed ZMQ message");
                return;
            }
        };
        let Some(seq) = raw.seq else {
            return; // a stray end marker
        };
        let batch = match decode_batch(&raw.payload) {
            Ok(b) => b,
            Err(e) => {
                self.metrics.drop_n("undecodable_batch", 1);
                tracing::warn!(error = %e, seq, "dropping undecodable batch");
                return;
            }
        };
        let key = (raw.topic.clone(), batch.dp_rank);
        if !self.publishers.contains_key(&key) && self.publishers.len() >= self.max_publishers {
            self.metrics.drop_n("too_many_publishers", 1);
            tracing::warn!(dp_rank = ?batch.dp_rank, limit = self.max_publishers, "batch from one publisher too many; dropped");
            return;
        }
        let verdict = self.publisher(&key).seq.observe(seq);
        match verdict {
            SeqVerdict::Restart => {
                self.metrics.restarts.inc();
                let p = self.publisher(&key);
                tracing::warn!(replica = %p.state.replica(), seq, "engine restart detected (seq went back); clearing replica");
                p.state.clear(ts_to_us(batch.ts), out);
            }
            SeqVerdict::Gap { from, to } => {
                self.metrics.gaps.inc();
                self.fill_gap(&key, from, to, out).await;
            }
            SeqVerdict::First | SeqVerdict::InOrder => {}
        }
        if batch.ts > 0.0 {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.metrics.lag_seconds.set((now - batch.ts).max(0.0));
        }
        let p = self
            .publishers
            .get_mut(&key)
            .expect("publisher inserted above");
        self.mapper.apply_batch(&mut p.state, &batch, out);
        self.metrics.batches.inc();
        let known: usize = self
            .publishers
            .values()
            .map(|p| p.state.known_blocks())
            .sum();
        self.metrics.reverse_map_entries.set(known as i64);
    }

    fn publisher(&mut self, key: &PublisherKey) -> &mut Publisher {
        if !self.publishers.contains_key(key) {
            let state = PublisherState::new(self.mapper.config(), key.1);
            if let Ok(mut r) = self.replicas.lock() {
                r.insert(state.replica().to_string());
            }
            self.publishers.insert(
                key.clone(),
                Publisher {
                    seq: SeqTracker::new(),
                    state,
                },
            );
        }
        self.publishers.get_mut(key).expect("inserted above")
    }

    /// Recovers batches `[from, to)` through the replay socket when configured; whatever is
    /// not recovered is counted as missing.
    async fn fill_gap(&mut self, key: &PublisherKey, from: u64, to: u64, out: &mut Vec<Op>) {
        let Some(rc) = self.replay.clone() else {
            self.metrics.missing_batches.inc_by(to - from);
            tracing::warn!(from, to, "seq gap and no replay endpoint; batches lost");
            return;
        };
        let replies = match fetch_replay(&rc.endpoint, from, to, rc.timeout).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, from, to, "replay failed");
                Vec::new()
            }
        };
        let metrics = self.metrics.clone();
        let p = self.publishers.get_mut(key).expect("publisher exists");
        p.seq.set_expected(from);
        for (seq, payload) in replies {
            let Ok(batch) = decode_batch(&payload) else {
                metrics.drop_n("undecodable_batch", 1);
                continue;
            };
            if batch.dp_rank != key.1 || !p.seq.accept_replayed(seq) {
                continue;
            }
            self.mapper.apply_batch(&mut p.state, &batch, out);
            metrics.replayed_batches.inc();
            metrics.batches.inc();
        }
        let reached = p.seq.expected().unwrap_or(from);
        p.seq.set_expected(to.wrapping_add(1));
        let missing = to.saturating_sub(reached);
        let result = if missing == 0 {
            "complete"
        } else if reached > from {
            "partial"
        } else {
            "failed"
        };
        metrics.replays.get_or_create(&[("result", result)]).inc();
        metrics.missing_batches.inc_by(missing);
        tracing::info!(from, to, missing, result, "seq gap replay");
    }
}

#[cfg(test)]
mod tests {
    use super::bind_address;

    #[test]
    fn star_means_all_interfaces() {
        assert_eq!(bind_address("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(bind_address("tcp://10.0.0.1:5557"), "tcp://10.0.0.1:5557");
    }
}
