//! Periodic engine stats (docs/KV-EVENTS.md §3 "Stats"): scrape the engine's Prometheus `/metrics`,
//! turn vLLM or SGLang metric names into a `ReplicaStats`, send it as a stats-only update. The
//! server ranks replicas by these (pressure, hit rate), so a subscriber without them would make
//! every replica look idle.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Uri;
use hyper_util::rt::TokioIo;
use inferencecache_proto::v1alpha1::ReplicaStats;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::mapping::Op;
use crate::metrics::Metrics;

/// Largest `/metrics` body accepted (engines with many label sets stay well below).
const MAX_BODY: usize = 16 << 20;

/// Per-metric-name aggregate of one scrape: sum and number of series.
#[derive(Debug, Default, Clone)]
pub struct Samples(HashMap<String, (f64, u32)>);

impl Samples {
    /// Sum over all label sets (counters and request gauges of several engines add up).
    pub fn sum(&self, name: &str) -> Option<f64> {
        self.0.get(name).map(|(s, _)| *s)
    }

    /// Mean over all label sets (a usage fraction of several engines averages).
    pub fn mean(&self, name: &str) -> Option<f64> {
        self.0.get(name).map(|(s, n)| s / f64::from((*n).max(1)))
    }

    fn first_sum(&self, names: &[&str]) -> Option<f64> {
        names.iter().find_map(|n| self.sum(n))
    }

    fn first_mean(&self, names: &[&str]) -> Option<f64> {
        names.iter().find_map(|n| self.mean(n))
    }
}

/// Parses the Prometheus text exposition format; comments, malformed lines and non-finite
/// values are skipped.
pub fn parse_exposition(text: &str) -> Samples {
    let mut out: HashMap<String, (f64, u32)> = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_whitespace())
            .unwrap_or(line.len());
        let name = &line[..name_end];
        let mut rest = &line[name_end..];
        if rest.starts_with('{') {
            // Skip the label set, honouring quoted values that may contain '}'.
            let mut in_quotes = false;
            let mut escaped = false;
            let mut end = None;
            for (i, c) in rest.char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' if in_quotes => escaped = true,
                    '"' => in_quotes = !in_quotes,
                    '}' if !in_quotes => {
                        end = Some(i);
                        break;
                    }
                    _ => {}
                }
            }
            let Some(end) = end else { continue };
            rest = &rest[end + 1..];
        }
        let Some(value) = rest.split_whitespace().next() else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        if !v.is_finite() || name.is_empty() {
            continue;
        }
        let e = out.entry(name.to_string()).or_default();
        e.0 += v;
        e.1 += 1;
    }
    Samples(out)
}

/// Stats knobs, from the flags.
#[derive(Debug, Clone)]
pub struct StatsConfig {
    /// Engine KV-cache size in bytes.
    pub cache_size_bytes: i64,
    /// Running + waiting requests at which pressure is 1.0.
    pub pressure_ceiling: f64,
}

#[derive(Debug, Clone, Copy)]
struct Counters {
    hits: f64,
    queries: f64,
    ext_hits: f64,
    ext_queries: f64,
}

/// Scrape-to-scrape state: rates come from counter deltas.
#[derive(Debug, Default)]
pub struct StatsState {
    prev: Option<Counters>,
    last_hit_rate: f32,
}

const USAGE: [&str; 3] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];
const HITS: [&str; 2] = [
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
];
const QUERIES: [&str; 2] = [
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
];
const EXT_HITS: [&str; 1] = ["vllm:external_prefix_cache_hits_total"];
const EXT_QUERIES: [&str; 1] = ["vllm:external_prefix_cache_queries_total"];
const RUNNING: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];
const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];

/// `max(0, cur - prev)` unless the counter went back (engine restart), then `cur`.
fn delta(cur: f64, prev: f64) -> f64 {
    if cur >= prev { cur - prev } else { cur }
}

impl StatsState {
    /// Turns one scrape into `ReplicaStats` (replica id is filled by the sender's update).
    pub fn compute(&mut self, s: &Samples, cfg: &StatsConfig) -> ReplicaStats {
        let usage = s.first_mean(&USAGE).unwrap_or(0.0).clamp(0.0, 1.0);
        let cur = Counters {
            hits: s.first_sum(&HITS).unwrap_or(0.0),
            queries: s.first_sum(&QUERIES).unwrap_or(0.0),
            ext_hits: s.first_sum(&EXT_HITS).unwrap_or(0.0),
            ext_queries: s.first_sum(&EXT_QUERIES).unwrap_or(0.0),
        };
        let (mut t2_hits, mut t2_queries) = (0.0, 0.0);
        if let Some(rate) = s.sum("sglang:cache_hit_rate") {
            // SGLang exports a rate already.
            self.last_hit_rate = rate.clamp(0.0, 1.0) as f32;
        } else if let Some(prev) = self.prev {
            let dq = delta(cur.queries, prev.queries);
            let dh = delta(cur.hits, prev.hits);
            if dq > 0.0 {
                self.last_hit_rate = (dh / dq).clamp(0.0, 1.0) as f32;
            }
            t2_hits = delta(cur.ext_hits, prev.ext_hits);
            t2_queries = delta(cur.ext_queries, prev.ext_queries);
        }
        self.prev = Some(cur);
        let load = s.first_sum(&RUNNING).unwrap_or(0.0) + s.first_sum(&WAITING).unwrap_or(0.0);
        let pressure = if cfg.pressure_ceiling > 0.0 {
            (load / cfg.pressure_ceiling).clamp(0.0, 1.0)
        } else {
            0.0
        };
        ReplicaStats {
            replica_id: String::new(),
            cache_memory_bytes: (usage * cfg.cache_size_bytes as f64) as i64,
            hit_rate: self.last_hit_rate,
            pressure: pressure as f32,
            client_version: concat!("kvevent-subscriber/", env!("CARGO_PKG_VERSION")).to_string(),
            t2_hit_tokens: t2_hits as i64,
            t2_query_tokens: t2_queries as i64,
        }
    }
}

/// Fetches `url` (plain `http://` only) and returns the body as text.
pub async fn fetch(url: &str, limit: Duration) -> anyhow::Result<String> {
    let uri: Uri = url.parse()?;
    anyhow::ensure!(
        uri.scheme_str() == Some("http"),
        "only http:// metrics URLs are supported"
    );
    let host = uri
        .host()
        .ok_or_else(|| anyhow::anyhow!("metrics URL has no host"))?
        .to_string();
    let port = uri.port_u16().unwrap_or(80);
    let authority = uri
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_else(|| host.clone());
    let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    tokio::time::timeout(limit, async move {
        let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header("host", authority)
            .header("accept", "text/plain")
            .body(Empty::<Bytes>::new())?;
        let resp = send.send_request(req).await?;
        anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
        let body = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading body: {e}"))?
            .to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    })
    .await
    .map_err(|_| anyhow::anyhow!("scrape timed out"))?
}

/// Every `interval`: scrape, compute, and queue one stats-only update per known replica (the
/// base replica id when none was seen yet). Stale stats are worthless, so a full queue drops
/// them (counted) instead of waiting.
pub async fn run(
    url: String,
    interval: Duration,
    cfg: StatsConfig,
    base_replica: String,
    replicas: Arc<Mutex<BTreeSet<String>>>,
    ops: mpsc::Sender<Op>,
    metrics: Arc<Metrics>,
) {
    let mut state = StatsState::default();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let text = match fetch(&url, interval.min(Duration::from_secs(5))).await {
            Ok(t) => t,
            Err(e) => {
                metrics.scrapes.get_or_create(&[("result", "error")]).inc();
                tracing::warn!(error = %e, "engine metrics scrape failed");
                continue;
            }
        };
        metrics.scrapes.get_or_create(&[("result", "ok")]).inc();
        let stats = state.compute(&parse_exposition(&text), &cfg);
        let mut targets: Vec<String> = replicas
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default();
        if targets.is_empty() {
            targets.push(base_replica.clone());
        }
        for replica in targets {
            let op = Op::Stats {
                replica,
                stats: stats.clone(),
            };
            if ops.try_send(op).is_err() {
                metrics.drop_n("stats_queue_full", 1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 10.0
vllm:num_requests_waiting{engine="0",model_name="m"} 54.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 10.0
weird{label="with } brace"} 3
"#;

    fn cfg() -> StatsConfig {
        StatsConfig {
            cache_size_bytes: 1000,
            pressure_ceiling: 256.0,
        }
    }

    #[test]
    fn parses_labels_and_values() {
        let s = parse_exposition(VLLM);
        assert_eq!(s.sum("vllm:num_requests_waiting"), Some(54.0));
        assert_eq!(s.sum("weird"), Some(3.0));
        assert_eq!(s.sum("absent"), None);
    }

    #[test]
    fn vllm_rates_come_from_deltas() {
        let mut st = StatsState::default();
        let first = st.compute(&parse_exposition(VLLM), &cfg());
        assert_eq!(first.cache_memory_bytes, 250);
        assert_eq!(first.hit_rate, 0.0, "no delta on the first scrape");
        assert_eq!(first.pressure, 0.25);
        let second_text = VLLM
            .replace("} 1000.0", "} 1100.0")
            .replace("} 400.0", "} 480.0")
            .replace("} 100.0", "} 150.0")
            .replace("} 10.0\n", "} 30.0\n");
        let second = st.compute(&parse_exposition(&second_text), &cfg());
        assert!((second.hit_rate - 0.8).abs() < 1e-6);
        assert_eq!(second.t2_query_tokens, 50);
        assert_eq!(second.t2_hit_tokens, 20);
        // No new queries: the last rate is kept.
        let third = st.compute(&parse_exposition(&second_text), &cfg());
        assert!((third.hit_rate - 0.8).abs() < 1e-6);
    }

    #[test]
    fn sglang_names_and_pressure_clamp() {
        let text = "sglang:token_usage{x=\"1\"} 0.5\nsglang:cache_hit_rate 0.3\n\
                    sglang:num_running_reqs 300\nsglang:num_queue_reqs 10\n";
        let s = StatsState::default().compute(&parse_exposition(text), &cfg());
        assert_eq!(s.cache_memory_bytes, 500);
        assert!((s.hit_rate - 0.3).abs() < 1e-6);
        assert_eq!(s.pressure, 1.0);
    }
}
