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
use crate::state::{PublisherKey, Resume};

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

/// Asks the engine's replay socket for batches `[from, to)` of `topic`. Sends `["", be8(from)]` (a
/// REQ-compatible envelope from a DEALER), then reads `[seq, payload]` / `[topic, seq, payload]`
/// replies until the end marker (seq = -1), a seq ≥ `to`, or the timeout. A fresh socket per
/// replay means leftovers of an abandoned replay can never be mistaken for a later one.
pub async fn fetch_replay(
    endpoint: &str,
    topic: &[u8],
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
            // A reply naming another topic belongs to another publisher on the same socket.
            Some(_) if !raw.topic.is_empty() && raw.topic != topic => {}
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
    /// When this publisher's last batch arrived (live or replayed).
    last_seen: Instant,
    /// Seqs `[lo, hi)` applied by the last tail probe: their live copies may still arrive and
    /// are duplicates, not an engine restart.
    probed: Option<(u64, u64)>,
    /// Resumed from the state file with this last acknowledged seq: the first probe asks the
    /// replay socket from 0 and replays batches up to it into the reverse map only (their
    /// operations were delivered before the restart), so later blocks chain onto them.
    rebuild_upto: Option<u64>,
}

/// A publisher resumed up to `rebuild_upto` whose engine buffer (`replies`) ends below it: the
/// engine restarted while the subscriber was down, so its buffer is all new and the index holds
/// the old engine's blocks. Clears the replica and restarts the seq at the buffer's first batch;
/// returns what is left to rebuild (nothing after a restart).
fn restarted_meanwhile(
    p: &mut Publisher,
    rebuild_upto: Option<u64>,
    replies: &[(u64, Bytes)],
    metrics: &Metrics,
    out: &mut Vec<Op>,
) -> Option<u64> {
    let newest = replies.iter().map(|(s, _)| *s).max();
    if let (Some(upto), Some(newest)) = (rebuild_upto, newest)
        && newest < upto
    {
        metrics.restarts.inc();
        tracing::warn!(replica = %p.state.replica(), "engine restarted while the subscriber was down; clearing replica");
        p.state.clear(0, out);
        p.seq.set_expected(replies.first().map_or(0, |(s, _)| *s));
        return None;
    }
    rebuild_upto
}

/// Turns raw ZMQ messages into index operations.
pub struct Processor {
    mapper: Mapper,
    replay: Option<ReplayConfig>,
    metrics: Arc<Metrics>,
    publishers: HashMap<PublisherKey, Publisher>,
    replicas: Arc<Mutex<BTreeSet<String>>>,
    max_publishers: usize,
    /// Emit `Op::Checkpoint` after every batch (`--state-file`).
    checkpoints: bool,
    /// Probe quiet publishers' replay sockets this often (needs a replay endpoint).
    tail_probe: Option<Duration>,
    /// Back-off of the probe after a failed replay request.
    probe_pause: Duration,
    probe_paused_until: Option<Instant>,
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
            checkpoints: false,
            tail_probe: None,
            probe_pause: Duration::ZERO,
            probe_paused_until: None,
        }
    }

    /// Resumes from a state file: each remembered publisher expects `last + 1` next, so its
    /// first batch after the restart is in order, a gap (replayed), or a restart of the engine
    /// (cleared); and operations are followed by checkpoints for the sender to persist.
    pub fn with_resume(mut self, resume: Resume) -> Self {
        self.checkpoints = true;
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(3600))
            .unwrap_or_else(Instant::now);
        for (key, last) in resume {
            if self.publishers.len() >= self.max_publishers {
                break;
            }
            let p = self.publisher(&key);
            p.seq.set_expected(last.wrapping_add(1));
            p.rebuild_upto = Some(last);
            // Probed at the first tick: batches published while the subscriber was down are
            // fetched even if the engine stays quiet.
            p.last_seen = long_ago;
        }
        self
    }

    /// Asks the replay socket of every publisher quiet for `every` whether it published past
    /// what was received (a lost tail); see [`Processor::probe_tails`].
    pub fn with_tail_probe(mut self, every: Duration) -> Self {
        self.tail_probe = Some(every);
        self
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
        let probe_every = self
            .tail_probe
            .filter(|_| self.replay.is_some())
            .unwrap_or(Duration::from_secs(3600));
        let mut probe = tokio::time::interval(probe_every);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let probing = self.tail_probe.is_some() && self.replay.is_some();
        // Publishers resumed from the state file catch up (and rebuild their reverse maps)
        // before the first live batch is handled.
        self.probe_tails(Duration::ZERO, &mut out).await;
        for op in out.drain(..) {
            if ops.send(op).await.is_err() {
                return;
            }
        }
        loop {
            tokio::select! {
                frames = rx.recv() => match frames {
                    Some(frames) => self.handle_frames(&frames, &mut out).await,
                    None => return,
                },
                _ = probe.tick(), if probing => self.probe_tails(probe_every, &mut out).await,
            }
            for op in out.drain(..) {
                if ops.send(op).await.is_err() {
                    return;
                }
            }
        }
    }

    /// For every publisher that sent nothing for `quiet`, asks its replay socket for batches
    /// from the next expected seq on: any that come back were published but never received
    /// (dropped by the PUB high-water mark, or sent while this subscriber was down), and are
    /// applied in order and counted (`kvevent_lost_tail_batches_total`). Without it a lost tail
    /// would only be noticed when the engine publishes again.
    pub async fn probe_tails(&mut self, quiet: Duration, out: &mut Vec<Op>) {
        let Some(rc) = self.replay.clone() else {
            return;
        };
        for key in self.quiet_publishers(quiet) {
            let from = self.publishers[&key].seq.expected().expect("filtered");
            let rebuild_upto = self.publishers[&key].rebuild_upto;
            let ask = if rebuild_upto.is_some() { 0 } else { from };
            if self.probe_paused_until.is_some_and(|t| Instant::now() < t) {
                return;
            }
            let Some(replies) = self.fetch_tail(&rc, &key.0, ask, from, quiet).await else {
                return;
            };
            self.apply_tail(&key, from, rebuild_upto, replies, out);
        }
    }

    /// The publishers that sent nothing for `quiet` and expect a next seq.
    fn quiet_publishers(&self, quiet: Duration) -> Vec<PublisherKey> {
        self.publishers
            .iter()
            .filter(|(_, p)| p.last_seen.elapsed() >= quiet && p.seq.expected().is_some())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The replay socket's batches of `topic` from `ask` on; `None` when it failed, after
    /// pausing the probe (an unreachable replay socket must not stall the live stream at every
    /// tick: the pause doubles up to 10 minutes).
    async fn fetch_tail(
        &mut self,
        rc: &ReplayConfig,
        topic: &[u8],
        ask: u64,
        from: u64,
        quiet: Duration,
    ) -> Option<Vec<(u64, Bytes)>> {
        match fetch_replay(&rc.endpoint, topic, ask, u64::MAX, rc.timeout).await {
            Ok(r) => {
                self.probe_pause = Duration::ZERO;
                Some(r)
            }
            Err(e) => {
                self.probe_pause = (self.probe_pause * 2).clamp(quiet, Duration::from_secs(600));
                self.probe_paused_until = Some(Instant::now() + self.probe_pause);
                tracing::warn!(error = %e, from, pause_s = self.probe_pause.as_secs(), "tail probe failed");
                None
            }
        }
    }

    /// Applies a probe's `replies` for publisher `key` (expecting `from`): batches up to
    /// `rebuild_upto` rebuild the reverse map only, later ones are applied in order and counted
    /// as a recovered lost tail.
    fn apply_tail(
        &mut self,
        key: &PublisherKey,
        from: u64,
        rebuild_upto: Option<u64>,
        replies: Vec<(u64, Bytes)>,
        out: &mut Vec<Op>,
    ) {
        let metrics = self.metrics.clone();
        let p = self.publishers.get_mut(key).expect("publisher exists");
        p.last_seen = Instant::now();
        p.rebuild_upto = None;
        let rebuild_upto = restarted_meanwhile(p, rebuild_upto, &replies, &metrics, out);
        let mut recovered = 0u64;
        let mut rebuilt = 0u64;
        let mut applied: Option<(u64, u64)> = None;
        for (seq, payload) in replies {
            let Ok(batch) = decode_batch(&payload) else {
                metrics.drop_n("undecodable_batch", 1);
                continue;
            };
            if batch.dp_rank != key.1 {
                continue;
            }
            if rebuild_upto.is_some_and(|upto| seq <= upto) {
                // Delivered before the restart: reverse map only, operations discarded.
                self.mapper
                    .apply_batch(&mut p.state, &batch, &mut Vec::new());
                rebuilt += 1;
                continue;
            }
            if let Some(want) = p.seq.expected()
                && seq > want
            {
                // The buffer no longer holds [want, seq): lost for good, counted.
                metrics.missing_batches.inc_by(seq - want);
                p.seq.set_expected(seq);
            }
            if !p.seq.accept_replayed(seq) {
                continue;
            }
            self.mapper.apply_batch(&mut p.state, &batch, out);
            recovered += 1;
            applied = Some((applied.map_or(seq, |(lo, _)| lo), seq + 1));
            metrics.replayed_batches.inc();
            metrics.batches.inc();
            if self.checkpoints {
                out.push(Op::Checkpoint {
                    key: key.clone(),
                    seq,
                });
            }
        }
        if rebuilt > 0 {
            tracing::info!(rebuilt, replica = %p.state.replica(), "reverse map rebuilt from the replay buffer");
        }
        if let Some(range) = applied {
            p.probed = Some(range);
            metrics.lost_tail_batches.inc_by(recovered);
            tracing::warn!(from, recovered, replica = %p.state.replica(), "lost tail recovered by the replay probe");
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
        let p = self.publisher(&key);
        if let Some((lo, hi)) = p.probed {
            if (lo..hi).contains(&seq) {
                self.metrics.drop_n("duplicate_batch", 1);
                return;
            }
            if seq >= hi {
                p.probed = None;
            }
        }
        let verdict = p.seq.observe(seq);
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
        p.last_seen = Instant::now();
        self.mapper.apply_batch(&mut p.state, &batch, out);
        if self.checkpoints {
            out.push(Op::Checkpoint {
                key: key.clone(),
                seq,
            });
        }
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
                    last_seen: Instant::now(),
                    probed: None,
                    rebuild_upto: None,
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
        let replies = match fetch_replay(&rc.endpoint, &key.0, from, to, rc.timeout).await {
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
