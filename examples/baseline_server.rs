//! A plain single-threaded baseline for perf comparisons (perf/RESULTS.md): one tokio
//! `current_thread` runtime, tonic's own transport, and the same `shards` index behind a
//! `RefCell`-like uncontended mutex. It answers ReportCacheState and LookupRoute (index
//! orchestrator only: no policy floors, no affinity), so it measures the cost of the transport
//! and the index without the per-core runtime. Not a product: no flags beyond the address.
//!
//! Run: `cargo run --release --example baseline_server -- 127.0.0.1:9190`

use std::pin::Pin;
use std::sync::Mutex;
use std::time::Instant;

use inferencecache_index::index::{Index, LookupQuery};
use inferencecache_index::rules::NoRules;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::{
    InferenceCache, InferenceCacheServer,
};
use tonic::{Request, Response, Status, Streaming};

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64
}

struct Baseline {
    index: Mutex<Index>,
}

type Empty<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl InferenceCache for Baseline {
    async fn render_template(
        &self,
        _r: Request<pb::RenderTemplateRequest>,
    ) -> Result<Response<pb::RenderTemplateResponse>, Status> {
        Ok(Response::new(pb::RenderTemplateResponse {
            reason_code: "OK".into(),
            ..Default::default()
        }))
    }

    async fn lookup_route(
        &self,
        r: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        let start = Instant::now();
        let req = r.into_inner();
        let mut index = self.index.lock().unwrap();
        let q = LookupQuery {
            tenant: &req.tenant_id,
            model: &req.model_id,
            hash_scheme: &req.hash_scheme,
            adapter: &req.adapter_id,
            prefix_hash: &req.prefix_hash,
            token_count: req.prefix_token_count,
            block_hashes: (&req.block_hashes).into(),
            block_token_counts: &req.block_token_counts,
            ttft_ms: 0,
            tbt_ms: 0,
        };
        let view = index.lookup_route(&q, now_ns(), &NoRules);
        let scores = view
            .scores
            .iter()
            .map(|s| pb::ReplicaScore {
                replica_id: view.replica_id(s).to_string(),
                score: s.score,
                matched_tokens: s.matched_tokens,
                estimated_cache_hit_prob: s.estimated_cache_hit_prob,
                tier: s.tier,
            })
            .collect();
        Ok(Response::new(pb::LookupRouteResponse {
            replica_scores: scores,
            reason_code: view.strategy.reason_code().into(),
            lookup_latency_us: start.elapsed().as_micros() as i64,
            ..Default::default()
        }))
    }

    async fn lookup_pd_route(
        &self,
        _r: Request<pb::LookupPdRouteRequest>,
    ) -> Result<Response<pb::LookupPdRouteResponse>, Status> {
        Ok(Response::new(pb::LookupPdRouteResponse {
            reason_code: "NO_HINT".into(),
            ..Default::default()
        }))
    }

    async fn get_cache_state(
        &self,
        r: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        let r = r.into_inner();
        let st = self
            .index
            .lock()
            .unwrap()
            .cache_state(&r.tenant_id, &r.model_id);
        Ok(Response::new(pb::GetCacheStateResponse {
            replicas: st.replicas,
            summary: Some(pb::CacheSummary {
                total_prefixes: st.total_prefixes,
                hot_prefixes: 0,
            }),
        }))
    }

    async fn report_cache_state(
        &self,
        r: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        let mut s = r.into_inner();
        while let Some(u) = s.message().await? {
            self.index.lock().unwrap().ingest(&u, now_ns(), &NoRules);
        }
        Ok(Response::new(pb::Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }

    async fn publish_event(&self, r: Request<pb::CacheEvent>) -> Result<Response<pb::Ack>, Status> {
        self.index
            .lock()
            .unwrap()
            .apply_event(&r.into_inner(), now_ns(), &NoRules);
        Ok(Response::new(pb::Ack {
            accepted: true,
            reason_code: String::new(),
        }))
    }

    type StreamCacheEventsStream = Empty<pb::CacheEvent>;
    async fn stream_cache_events(
        &self,
        _r: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::empty())))
    }

    type StreamMetricsStream = Empty<pb::Metric>;
    async fn stream_metrics(
        &self,
        _r: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Ok(Response::new(Box::pin(tokio_stream::empty())))
    }
}

fn main() {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:9190".into());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let svc = Baseline {
            index: Mutex::new(Index::default()),
        };
        eprintln!("baseline_server listening on {addr}");
        tonic::transport::Server::builder()
            .add_service(InferenceCacheServer::new(svc))
            .serve(addr.parse().unwrap())
            .await
            .unwrap();
    });
}
