//! Raw HTTP/1.1 over loopback sockets (no client library, so malformed and slow requests can be
//! sent too) and the helpers for the server's HTTP endpoints (`/metrics`, `/snapshot`, `/policy`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::server::Server;

/// A minimal HTTP/1.1 request over a raw socket: (status, body).
pub fn http_request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    http_full(port, method, path, headers, body).map(|r| (r.status, r.body))
}

/// GET `path` on `port`.
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    http_request(port, "GET", path, &[], b"")
}

/// A full HTTP/1.1 response: status, lower-cased headers, body.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request over a raw socket (`Connection: close`), returning status, headers and
/// body (de-chunked if needed).
pub fn http_full(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<HttpResponse> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    // The server may answer before reading a large body; ignore a reset while writing.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        let mut body = String::new();
        let mut rest = rest;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            body.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        body
    } else {
        rest.to_string()
    };
    Ok(HttpResponse {
        status,
        headers,
        body,
    })
}

/// POSTs a JSON body to `path` on `port`.
pub fn http_post_json(port: u16, path: &str, body: &str) -> HttpResponse {
    http_full(
        port,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    )
    .expect("http post")
}

/// Scrapes `/metrics` and returns the exposition text.
pub fn scrape(srv: &Server) -> String {
    let r = http_full(srv.http_port, "GET", "/metrics", &[], b"").expect("scrape");
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// POSTs `body` to `/policy` on the controller-facing port and asserts `204`.
pub fn install_policy(srv: &Server, body: &str) {
    let (st, b) = http_request(
        srv.admin_port,
        "POST",
        "/policy",
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    )
    .expect("POST /policy");
    assert_eq!(st, 204, "POST /policy {body} -> {st} {b:?}");
}

/// The public `/metrics` text.
pub fn metrics_text(srv: &Server) -> String {
    let (st, body) = http_get(srv.http_port, "/metrics").expect("GET /metrics");
    assert_eq!(st, 200, "GET /metrics -> {st}");
    body
}

/// The `/snapshot` JSON (controller-facing port) parsed with serde_json.
pub fn snapshot_json(srv: &Server) -> serde_json::Value {
    let (st, body) = http_get(srv.admin_port, "/snapshot").expect("GET /snapshot");
    assert_eq!(st, 200, "GET /snapshot -> {st} {body}");
    serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("snapshot JSON {e}: {body}"))
}

/// Asserts that `/metrics` carries exactly the line `line` (e.g.
/// `inferencecache_lookup_route_calls_total{hint_used="false",model="m",reason_code="NO_HINT"} 1`).
pub fn assert_metric_line(text: &str, line: &str) {
    if text.lines().any(|l| l.trim_end() == line) {
        return;
    }
    let name = line.split(['{', ' ']).next().unwrap_or(line);
    let related: Vec<&str> = text.lines().filter(|l| l.starts_with(name)).collect();
    panic!(
        "metric line {line:?} not found; lines for {name}:\n{}",
        related.join("\n")
    );
}

/// The numeric value of the series written exactly as `series` (`name{labels}`), if present.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        let v = rest.strip_prefix(' ')?;
        v.split_whitespace().next()?.parse().ok()
    })
}
