//! StreamMetrics: the requested series at a fixed interval, from the same registry as
//! `/metrics`.
//!
//! Each subscription runs one task on the admin thread: every [`METRIC_STREAM_INTERVAL`] it
//! takes a full scrape (the function the admin layer installs with [`set_scraper`], i.e. exactly
//! what `/metrics` serves), keeps the series whose name — or whose family name, so
//! `inferencecache_lookup_route_latency_seconds` selects its `_bucket`, `_sum` and `_count` —
//! is among the requested names (all series when none is named), and sends them, at most
//! [`MAX_METRIC_STREAM_SERIES`] per interval, into a bounded channel. A subscriber that does not
//! keep up (the channel is full) gets the series already queued and then `RESOURCE_EXHAUSTED`.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use futures_util::Stream;
use inferencecache_proto::v1alpha1 as pb;
use tonic::Status;

use crate::limits::{
    MAX_METRIC_STREAM_NAMES, MAX_METRIC_STREAM_SERIES, METRIC_STREAM_BUFFER, METRIC_STREAM_INTERVAL,
};

/// The `rpc` label of `inferencecache_rpc_calls_total`.
const RPC: &str = "StreamMetrics";

/// A full scrape, rendered as `/metrics` renders it.
pub type Scraper = fn() -> Pin<Box<dyn Future<Output = String> + Send>>;

static SCRAPER: OnceLock<Scraper> = OnceLock::new();
/// Subscriptions open now.
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Installs the scrape function (at start-up; the admin layer owns the gather).
pub fn set_scraper(f: Scraper) {
    let _ = SCRAPER.set(f);
}

/// A boxed stream of series (or the final status).
pub type MetricStream = Pin<Box<dyn Stream<Item = Result<pb::Metric, Status>> + Send>>;

fn refused(status: Status) -> MetricStream {
    Box::pin(futures_util::stream::once(async move { Err(status) }))
}

/// Decrements [`OPEN`] when the subscription's task ends.
struct Slot;

impl Drop for Slot {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Answers one StreamMetrics call: the reference's stub while the feed is off, otherwise a
/// subscription (refused past the subscriber cap or the name bound).
pub fn subscribe(req: pb::StreamMetricsRequest) -> MetricStream {
    let cap = super::metric_cap();
    let (Some(scrape), Some(admin)) = (
        SCRAPER.get().copied(),
        crate::runtime::admin_thread::handle(),
    ) else {
        return Box::pin(futures_util::stream::empty());
    };
    if cap == 0 {
        return Box::pin(futures_util::stream::empty());
    }
    if req.names.len() > MAX_METRIC_STREAM_NAMES {
        crate::metrics::record_limit_hit("metric_stream_names");
        crate::metrics::record_rpc(RPC, "INVALID_ARGUMENT");
        return refused(Status::invalid_argument(format!(
            "at most {MAX_METRIC_STREAM_NAMES} names"
        )));
    }
    if OPEN.fetch_add(1, Ordering::SeqCst) >= cap {
        OPEN.fetch_sub(1, Ordering::SeqCst);
        crate::metrics::record_limit_hit("metric_subscribers");
        crate::metrics::record_rpc(RPC, "TOO_MANY_SUBSCRIBERS");
        return refused(Status::resource_exhausted(format!(
            "at most {cap} StreamMetrics subscribers"
        )));
    }
    crate::metrics::record_rpc(RPC, "SUBSCRIBED");
    let slot = Slot;
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::Metric>(METRIC_STREAM_BUFFER);
    let lagged = Arc::new(AtomicBool::new(false));
    let lag = lagged.clone();
    let names = req.names;
    admin.spawn(async move {
        let _slot = slot;
        let mut tick = tokio::time::interval(METRIC_STREAM_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let due = tokio::select! {
                due = tick.tick() => due,
                _ = tx.closed() => return,
            };
            if crate::runtime::shutting_down() {
                return;
            }
            let stamp_us = interval_stamp_us(due);
            let text = scrape().await;
            let series = select(&text, &names, stamp_us);
            for m in series {
                match tx.try_send(m) {
                    Ok(()) => {}
                    Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                        crate::metrics::record_limit_hit("metric_subscriber_buffer");
                        lag.store(true, Ordering::SeqCst);
                        return;
                    }
                    Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
        }
    });
    Box::pin(futures_util::stream::unfold(
        (rx, lagged, false),
        |(mut rx, lagged, finished)| async move {
            if finished {
                return None;
            }
            let got = futures_lite::future::or(async { Some(rx.recv().await) }, async {
                crate::runtime::shutdown_requested().await;
                None
            })
            .await?;
            match got {
                Some(m) => Some((Ok(m), (rx, lagged, false))),
                None if lagged.load(Ordering::SeqCst) => {
                    crate::metrics::record_rpc(RPC, "LAGGED");
                    let status = Status::resource_exhausted(format!(
                        "subscriber fell behind (buffer {METRIC_STREAM_BUFFER} series); resubscribe"
                    ));
                    Some((Err(status), (rx, lagged, true)))
                }
                None => None,
            }
        },
    ))
}

/// The wall-clock time, in µs, of the interval tick that was `due` (the instant the stream's
/// timer scheduled it, which a busy admin thread may reach late): a batch is stamped with its
/// interval, not with when its scrape across the cores finished, so consecutive batches are
/// stamped at least one interval apart however long each scrape or wake-up took.
fn interval_stamp_us(due: tokio::time::Instant) -> i64 {
    let late = i64::try_from(due.elapsed().as_nanos()).unwrap_or(i64::MAX);
    crate::sys::clock::unix_now_ns().saturating_sub(late) / 1_000
}

/// The series of `text` (Prometheus text format) selected by `names`, at most
/// [`MAX_METRIC_STREAM_SERIES`] (a hit of that bound is counted), stamped `now_us`.
pub fn select(text: &str, names: &[String], now_us: i64) -> Vec<pb::Metric> {
    let mut out = Vec::new();
    let (mut family, mut kind) = ("", "");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            family = parts.next().unwrap_or("");
            kind = parts.next().unwrap_or("");
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some(m) = parse_series(line) else {
            continue;
        };
        let wanted = names.is_empty() || names.iter().any(|n| *n == m.0 || *n == family);
        if !wanted {
            continue;
        }
        if out.len() == MAX_METRIC_STREAM_SERIES {
            crate::metrics::record_limit_hit("metric_stream_series");
            break;
        }
        out.push(pb::Metric {
            name: m.0.to_string(),
            r#type: kind.to_string(),
            labels: m.1,
            value: m.2,
            timestamp_us: now_us,
        });
    }
    out
}

/// `name{k="v",…} value` → (name, labels, value).
fn parse_series(line: &str) -> Option<(&str, HashMap<String, String>, f64)> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut labels = HashMap::new();
    let mut rest = &line[name_end..];
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices();
        let mut key = String::new();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => break i,
                ',' | ' ' => {}
                '=' => {
                    let (_, q) = chars.next()?;
                    if q != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        let (_, c) = chars.next()?;
                        match c {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            c => value.push(c),
                        }
                    }
                    labels.insert(std::mem::take(&mut key), value);
                }
                c => key.push(c),
            }
        };
        rest = &body[end + 1..];
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP inferencecache_rpc_calls Calls.\n\
# TYPE inferencecache_rpc_calls counter\n\
inferencecache_rpc_calls_total{reason_code=\"OK\",rpc=\"RenderTemplate\"} 3\n\
# TYPE inferencecache_server_up gauge\n\
inferencecache_server_up 1\n\
# TYPE inferencecache_lookup_route_latency_seconds histogram\n\
inferencecache_lookup_route_latency_seconds_bucket{model=\"a \\\"q\\\" b\",le=\"+Inf\"} 2\n\
inferencecache_lookup_route_latency_seconds_sum{model=\"m\"} 0.5\n\
# EOF\n";

    #[test]
    fn selects_series_by_name_or_family() {
        let up = select(TEXT, &["inferencecache_server_up".into()], 1);
        assert_eq!(up.len(), 1);
        assert_eq!((up[0].value, up[0].r#type.as_str()), (1.0, "gauge"));
        let calls = select(TEXT, &["inferencecache_rpc_calls_total".into()], 1);
        assert_eq!(calls[0].labels["rpc"], "RenderTemplate");
        assert_eq!(calls[0].r#type, "counter");
        let hist = select(
            TEXT,
            &["inferencecache_lookup_route_latency_seconds".into()],
            1,
        );
        assert_eq!(hist.len(), 2);
        assert_eq!(hist[0].labels["model"], "a \"q\" b");
        assert_eq!(hist[0].labels["le"], "+Inf");
        assert_eq!(select(TEXT, &[], 1).len(), 4);
        assert!(select(TEXT, &["nothing".into()], 1).is_empty());
    }

    #[test]
    fn the_series_per_interval_are_bounded() {
        let mut text = String::from("# TYPE x gauge\n");
        for i in 0..MAX_METRIC_STREAM_SERIES + 5 {
            text.push_str(&format!("x{{i=\"{i}\"}} 1\n"));
        }
        assert_eq!(select(&text, &[], 1).len(), MAX_METRIC_STREAM_SERIES);
    }
}
