//! A raw HTTP/2 gRPC client for abuse scenarios: every `send` is its own DATA frame, and a
//! message can be left incomplete, which generated clients never do.

use std::future::poll_fn;

use bytes::Bytes;

/// One gRPC call whose request body is written by hand.
pub struct RawCall {
    send: h2::SendStream<Bytes>,
    response: h2::client::ResponseFuture,
}

/// How a raw call ended: the grpc-status (headers or trailers), its message and the body, or
/// the HTTP/2 error that ended it (e.g. a GOAWAY).
#[derive(Debug)]
pub struct RawEnd {
    pub grpc_status: Option<String>,
    pub grpc_message: Option<String>,
    pub body: Vec<u8>,
}

/// Opens an HTTP/2 connection to the server's gRPC port; the returned handle opens calls.
pub async fn raw_connection(port: u16) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (send, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    send
}

/// Starts a call to `path` on `conn`.
pub async fn raw_call(conn: &mut h2::client::SendRequest<Bytes>, path: &str) -> RawCall {
    raw_call_with(conn, path, &[]).await
}

/// Starts a call to `path` on `conn` with extra request headers.
pub async fn raw_call_with(
    conn: &mut h2::client::SendRequest<Bytes>,
    path: &str,
    headers: &[(&str, &str)],
) -> RawCall {
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("http://127.0.0.1{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(()).unwrap();
    poll_fn(|cx| conn.poll_ready(cx)).await.expect("ready");
    let (response, send) = conn.send_request(req, false).expect("send_request");
    RawCall { send, response }
}

/// A gRPC length-prefixed frame of `payload` (uncompressed).
pub fn grpc_message(payload: &[u8]) -> Bytes {
    let mut f = Vec::with_capacity(payload.len() + 5);
    f.push(0);
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.into()
}

impl RawCall {
    /// Sends `data` as one DATA frame (or, past 16 KiB, frames of 16 KiB), waiting for
    /// flow-control window as needed.
    pub async fn send(&mut self, mut data: Bytes) -> Result<(), h2::Error> {
        const FRAME: usize = 16 * 1024;
        while data.len() > FRAME {
            let head = data.split_to(FRAME);
            self.send_frame(head, false).await?;
        }
        self.send_frame(data, false).await
    }

    /// Sends `data` as one DATA frame carrying END_STREAM (how most clients end a unary
    /// request), then waits for the answer. A server that answered from the headers alone and
    /// closed the stream before the data went out still yields its answer.
    pub async fn finish_with(mut self, data: Bytes) -> Result<RawEnd, h2::Error> {
        let sent = self.send_frame(data, true).await;
        match self.open(false).await {
            Ok(resp) => resp.read_to_end().await,
            Err(e) => Err(sent.err().unwrap_or(e)),
        }
    }

    /// Ends the request with trailers instead of an END_STREAM DATA frame, then waits for the
    /// answer.
    pub async fn finish_with_trailers(
        mut self,
        trailers: http::HeaderMap,
    ) -> Result<RawEnd, h2::Error> {
        self.send.send_trailers(trailers)?;
        self.open(false).await?.read_to_end().await
    }

    /// Resets the stream (CANCEL) before it is answered.
    pub fn cancel(mut self) {
        self.send.send_reset(h2::Reason::CANCEL);
    }

    /// Sends `data` as one DATA frame (with END_STREAM if `end`) once the window allows it.
    async fn send_frame(&mut self, data: Bytes, end: bool) -> Result<(), h2::Error> {
        self.send.reserve_capacity(data.len());
        while self.send.capacity() < data.len() {
            match poll_fn(|cx| self.send.poll_capacity(cx)).await {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => return Err(h2::Error::from(h2::Reason::STREAM_CLOSED)),
            }
        }
        self.send.send_data(data, end)
    }

    /// Ends the request body (if `end`) and waits for the answer.
    pub async fn finish(self, end: bool) -> Result<RawEnd, h2::Error> {
        self.open(end).await?.read_to_end().await
    }

    /// Ends the request body (if `end`) and waits for the response head only. The body is left
    /// unread until [`RawResponse::read_to_end`]: its flow-control window is not released, so
    /// a server-streaming answer stalls once the window is full (a subscriber that does not
    /// read).
    pub async fn open(mut self, end: bool) -> Result<RawResponse, h2::Error> {
        if end {
            self.send.send_data(Bytes::new(), true)?;
        }
        let resp = self.response.await?;
        let (parts, body) = resp.into_parts();
        Ok(RawResponse {
            headers: parts.headers,
            body,
        })
    }
}

/// A response whose head arrived and whose body is not read yet.
pub struct RawResponse {
    pub headers: http::HeaderMap,
    body: h2::RecvStream,
}

impl RawResponse {
    /// Reads the body to its end (releasing its window as it goes) and the trailers.
    pub async fn read_to_end(self) -> Result<RawEnd, h2::Error> {
        let header = |h: &http::HeaderMap, k: &str| {
            h.get(k)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).to_string())
        };
        let mut grpc_status = header(&self.headers, "grpc-status");
        let mut grpc_message = header(&self.headers, "grpc-message");
        let mut body = self.body;
        let mut bytes = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk?;
            let _ = body.flow_control().release_capacity(chunk.len());
            bytes.extend_from_slice(&chunk);
        }
        if let Some(t) = body.trailers().await? {
            grpc_status = grpc_status.or_else(|| header(&t, "grpc-status"));
            grpc_message = grpc_message.or_else(|| header(&t, "grpc-message"));
        }
        Ok(RawEnd {
            grpc_status,
            grpc_message,
            body: bytes,
        })
    }
}

/// The payloads of the gRPC length-prefixed messages in `body` (uncompressed).
pub fn grpc_messages(mut body: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        assert!(body.len() >= 5 + len, "truncated gRPC message");
        out.push(&body[5..5 + len]);
        body = &body[5 + len..];
    }
    assert!(
        body.is_empty(),
        "trailing bytes after the last gRPC message"
    );
    out
}
