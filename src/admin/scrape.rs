//! `/metrics`: gathers every core's series over the hop, merges them with the off-core fallback
//! and renders the exposition. Each core is asked with a deadline, so a stuck core is left out of
//! one scrape instead of hanging it.

use std::sync::atomic::Ordering;

use crate::limits::GATHER_TIMEOUT;
use crate::metrics::{self, CoreMetrics, CoreView, Scrape};
use crate::runtime::mailbox;
use crate::shard::CoreState;

/// The calling core's series with its index sizes (runs on each core).
fn core_series(st: &mut CoreState) -> CoreMetrics {
    let mut m = metrics::core_snapshot();
    m.core_entries = st.index.entry_count() as i64;
    m.core_bytes = st.index.approx_heap_bytes() as i64;
    let (strings, string_bytes) = st.index.string_usage();
    m.core_strings = strings as i64;
    m.core_string_bytes = string_bytes as i64;
    m
}

/// Gathers and renders one scrape.
pub async fn render() -> String {
    let mut scrape = Scrape::default();
    let deadline = tokio::time::Instant::now() + GATHER_TIMEOUT;
    for core in 0..mailbox::cores() {
        // The entries gauge counts keys a pending ALL_CLEARED is still removing: after it.
        let series = mailbox::call_after_clear(core, core_series);
        let got = tokio::time::timeout_at(deadline, series).await;
        let Ok(Ok(series)) = got else { continue };
        scrape.total.merge(&series);
        scrape.cores.push(CoreView {
            core,
            metrics: series,
            mailbox_depth: mailbox::depth(core) as u64,
            hopped_in: mailbox::inbox(core).hopped_in.load(Ordering::Relaxed),
        });
    }
    scrape.total.merge(&metrics::fallback_snapshot());
    scrape.tokenizer_in_flight = crate::tokenizer::global().in_flight() as i64;
    // Reading /proc and encoding run off the admin thread, so /healthz never waits on a scrape.
    let encoded = tokio::task::spawn_blocking(move || {
        scrape.process = metrics::process::read();
        metrics::encode(scrape)
    });
    encoded.await.unwrap_or_default()
}
