//! The in-process front end shared by the CI gate's front-end workloads
//! (`examples/perf_gate_frontend.rs`) and the inline path's allocation test
//! (`tests/inline_allocations.rs`).
//!
//! One glommio executor on this thread is set up as core 0 of a `--shards 1` server by the
//! server's own start-up code (`inference_cache::perf_harness`), the index is preloaded through
//! the ingest path, and the real connection code (`serve_http2`: the HTTP/2 layer, the inline
//! LookupRoute path, handler, index, response encoding) serves one connection over an
//! in-memory duplex. A scripted raw HTTP/2 client writes fixed bytes: the preface, SETTINGS
//! with a large initial window and a connection WINDOW_UPDATE once; then per request a HEADERS
//! frame (HPACK literals without indexing, so every request's header block is the same) on a
//! fresh odd stream and one DATA frame with END_STREAM carrying the gRPC-framed
//! LookupRouteRequest (a 32-block chain held by several replicas, as perf/grpc_bodies.py
//! builds). It reads and discards the server's bytes until each request's trailers (HEADERS
//! with END_STREAM on that stream) are in. Once warm, the client allocates nothing.

#![allow(dead_code)]

use glommio::{LocalExecutor, LocalExecutorBuilder, Placement};
use inference_cache::perf_harness;
use inferencecache_proto::v1alpha1 as pb;
use prost::Message;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf};

/// Blocks of the looked-up chain.
pub const BLOCKS: usize = 32;
/// Replicas holding (a prefix of) the looked-up chain.
pub const REPLICAS: usize = 4;
/// Other chains in the index, held by other replicas (so the index is not trivially small).
pub const OTHER_CHAINS: u64 = 256;
/// A chain no replica holds.
pub const UNHELD_CHAIN: u64 = 1 << 40;
pub const TENANT: &str = "t";
pub const MODEL: &str = "m";
pub const SCHEME: &str = "vllm-sha256-v1";
pub const PATH: &str = "/inferencecache.v1alpha1.InferenceCache/LookupRoute";

/// The server's per-core io_uring memory (src/limits.rs `IO_MEMORY_BYTES`).
pub const IO_MEMORY_BYTES: usize = 512 * 1024;
/// In-memory connection buffer in each direction: larger than a pipelined batch.
pub const DUPLEX_BYTES: usize = 1 << 20;

/// HTTP/2 frame types and flags the client uses.
pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const SETTINGS: u8 = 0x4;
pub const WINDOW_UPDATE: u8 = 0x8;
pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const FRAME_HEADER: usize = 9;

/// Block hash `j` of chain `chain` (8 bytes, as the h2load bodies).
fn block_hash(chain: u64, j: usize) -> Vec<u8> {
    (chain.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (j as u64 + 1).wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        .to_be_bytes()
        .to_vec()
}

/// A producer message: `replica` holds the first `blocks` blocks of `chain`.
fn update(replica: &str, chain: u64, blocks: usize) -> pb::CacheStateUpdate {
    pb::CacheStateUpdate {
        replica_id: replica.to_string(),
        model_id: MODEL.to_string(),
        tenant_id: TENANT.to_string(),
        hash_scheme: SCHEME.to_string(),
        prefixes: vec![pb::PrefixEntry {
            block_hashes: (0..blocks).map(|j| block_hash(chain, j)).collect(),
            block_token_counts: vec![16; blocks],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The index: replica r holds the first `BLOCKS - 4r` blocks of chain 0 (so the ranking is not a
/// tie, as perf/grpc_bodies.py), and 16 other replicas hold the other chains.
fn preload_updates() -> Vec<pb::CacheStateUpdate> {
    let mut ups: Vec<_> = (0..REPLICAS)
        .map(|r| update(&format!("replica-{r}"), 0, (BLOCKS - 4 * r).max(1)))
        .collect();
    ups.extend((1..=OTHER_CHAINS).map(|c| update(&format!("other-{}", c % 16), c, BLOCKS)));
    ups
}

/// The gRPC-framed LookupRouteRequest for chain 0.
pub fn lookup_body() -> Vec<u8> {
    lookup_body_for(0)
}

/// The gRPC-framed LookupRouteRequest for chain `chain` (one no replica holds, such as
/// [`UNHELD_CHAIN`], is answered by affinity).
pub fn lookup_body_for(chain: u64) -> Vec<u8> {
    let req = pb::LookupRouteRequest {
        model_id: MODEL.to_string(),
        tenant_id: TENANT.to_string(),
        hash_scheme: SCHEME.to_string(),
        block_hashes: (0..BLOCKS).map(|j| block_hash(chain, j).into()).collect(),
        block_token_counts: vec![16; BLOCKS],
        ..Default::default()
    };
    let msg = req.encode_to_vec();
    let mut body = vec![0];
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(&msg);
    body
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// The request header block: every field a literal without indexing with a literal name, so
/// the server's HPACK table never changes and every request decodes the same bytes.
pub fn header_block() -> Vec<u8> {
    let fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PATH),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    let mut block = Vec::new();
    for (name, value) in fields {
        assert!(name.len() < 127 && value.len() < 127);
        block.push(0x00);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

/// The server's end of the duplex as the futures-io stream `serve_http2` takes.
struct ServerEnd(DuplexStream);

impl futures_lite::AsyncRead for ServerEnd {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        let mut rb = ReadBuf::new(buf);
        match Pin::new(&mut self.0).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(rb.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl futures_lite::AsyncWrite for ServerEnd {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The scripted HTTP/2 client on the other end of the duplex.
pub struct Client {
    io: DuplexStream,
    headers: Vec<u8>,
    body: Vec<u8>,
    next_stream: u32,
    /// Bytes read and not yet parsed.
    buf: Vec<u8>,
    out: Vec<u8>,
    /// Responses complete (trailers seen), and DATA frames seen (one per successful answer).
    pub answered: usize,
    pub data_frames: usize,
    /// The last DATA payload (the warm-up's answer is checked).
    pub last_data: Vec<u8>,
}

impl Client {
    fn new(io: DuplexStream) -> Client {
        Client {
            io,
            headers: header_block(),
            body: lookup_body(),
            next_stream: 1,
            buf: Vec::with_capacity(64 * 1024),
            out: Vec::with_capacity(64 * 1024),
            answered: 0,
            data_frames: 0,
            last_data: Vec::with_capacity(64 * 1024),
        }
    }

    /// Preface, SETTINGS (initial window 2^31-1), connection WINDOW_UPDATE; then the SETTINGS
    /// ACK once the server's SETTINGS arrived.
    async fn handshake(&mut self) {
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let mut settings = vec![0x00, 0x04];
        settings.extend_from_slice(&0x7fff_ffffu32.to_be_bytes());
        frame(&mut out, SETTINGS, 0, 0, &settings);
        frame(
            &mut out,
            WINDOW_UPDATE,
            0,
            0,
            &(0x7fff_ffffu32 - 65_535).to_be_bytes(),
        );
        self.io.write_all(&out).await.expect("write preface");
        let mut server_settings = false;
        while !server_settings {
            self.fill().await;
            while let Some((kind, flags, _, len)) = self.next_frame() {
                server_settings |= kind == SETTINGS && flags & ACK == 0;
                self.buf.drain(..FRAME_HEADER + len);
            }
        }
        let mut ack = Vec::new();
        frame(&mut ack, SETTINGS, ACK, 0, &[]);
        self.io.write_all(&ack).await.expect("write settings ack");
    }

    /// Sends `body` (a gRPC-framed LookupRouteRequest) from now on.
    pub fn set_body(&mut self, body: Vec<u8>) {
        self.body = body;
    }

    /// Writes `n` requests (each on a fresh stream) in one write.
    pub async fn send(&mut self, n: usize) {
        self.out.clear();
        for _ in 0..n {
            let id = self.next_stream;
            self.next_stream += 2;
            frame(&mut self.out, HEADERS, END_HEADERS, id, &self.headers);
            frame(&mut self.out, DATA, END_STREAM, id, &self.body);
        }
        self.io.write_all(&self.out).await.expect("write requests");
    }

    /// Reads until `n` more responses have ended.
    pub async fn answers(&mut self, n: usize) {
        let goal = self.answered + n;
        loop {
            while let Some((kind, flags, stream, len)) = self.next_frame() {
                if stream % 2 == 1 && kind == HEADERS && flags & END_STREAM != 0 {
                    self.answered += 1;
                } else if kind == DATA && len > 0 {
                    self.data_frames += 1;
                    self.last_data.clear();
                    self.last_data
                        .extend_from_slice(&self.buf[FRAME_HEADER..FRAME_HEADER + len]);
                }
                self.buf.drain(..FRAME_HEADER + len);
            }
            if self.answered >= goal {
                return;
            }
            self.fill().await;
        }
    }

    /// Reads what the server wrote into `buf`'s spare capacity (not zeroed: the client's own
    /// cost stays small next to the server's).
    async fn fill(&mut self) {
        if self.buf.capacity() - self.buf.len() < 16 * 1024 {
            self.buf.reserve(16 * 1024);
        }
        let n = self.io.read_buf(&mut self.buf).await.expect("read");
        assert!(n > 0, "server closed the connection");
    }

    /// The next whole frame at the front of `buf`: type, flags, stream id and payload length
    /// (the caller drains it).
    fn next_frame(&self) -> Option<(u8, u8, u32, usize)> {
        if self.buf.len() < FRAME_HEADER {
            return None;
        }
        let len = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
        if self.buf.len() < FRAME_HEADER + len {
            return None;
        }
        let (kind, flags) = (self.buf[3], self.buf[4]);
        let stream = u32::from_be_bytes(self.buf[5..9].try_into().expect("4 bytes")) & 0x7fff_ffff;
        Some((kind, flags, stream, len))
    }
}

/// Executor and core, preloaded, with no connection yet (once per process). The core is
/// started with the server flags in `PERF_GATE_CORE_FLAGS` (whitespace-separated; none by
/// default), e.g. the producer auth flags to measure that lookups do not pay for them
/// (perf/runs/2026-12-06-producer-auth-cost.md).
pub fn setup_core() -> LocalExecutor {
    let ex = LocalExecutorBuilder::new(Placement::Unbound)
        .io_memory(IO_MEMORY_BYTES)
        .make()
        .expect("glommio executor (io_uring available? locked memory large enough?)");
    let flags = std::env::var("PERF_GATE_CORE_FLAGS").unwrap_or_default();
    let flags: Vec<&str> = flags.split_whitespace().collect();
    ex.run(async {
        perf_harness::install_core(&flags).expect("install core");
    });
    refresh_preload(&ex);
    ex
}

/// Applies the preload (again): its entries' TTL (the index default, 30 minutes) starts over, so
/// a run longer than that (the long fuzz run) keeps getting the same ranking.
pub fn refresh_preload(ex: &LocalExecutor) {
    ex.run(async {
        for u in preload_updates() {
            perf_harness::apply_update(u).await.expect("preload");
        }
    });
}

/// A new in-memory connection (`buffer` bytes each way) served by the real front end, inside
/// the executor of [`setup_core`]: the client's end, and the connection's task (it ends when
/// the connection does).
pub fn connect(buffer: usize) -> (DuplexStream, glommio::Task<()>) {
    let (client_io, server_io) = tokio::io::duplex(buffer);
    let task = glommio::spawn_local(perf_harness::serve_http2(ServerEnd(server_io)));
    (client_io, task)
}

/// Executor, core, preload, connection and one checked warm-up request.
pub fn setup() -> (LocalExecutor, Client) {
    let ex = setup_core();
    let mut client = None;
    ex.run(async {
        let (client_io, task) = connect(DUPLEX_BYTES);
        task.detach();
        let client = client.insert(Client::new(client_io));
        client.handshake().await;
        client.send(1).await;
        client.answers(1).await;
    });
    let client = client.expect("set up in the run");
    let data = &client.last_data;
    assert!(
        client.data_frames == 1 && data.len() > 5,
        "warm-up: no answer"
    );
    let resp = pb::LookupRouteResponse::decode(&data[5..]).expect("warm-up answer decodes");
    assert_eq!(
        resp.replica_scores.len(),
        REPLICAS,
        "warm-up answer ranks every replica holding the chain: {resp:?}"
    );
    (ex, client)
}
