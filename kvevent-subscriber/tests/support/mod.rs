//! A stand-in inference-cache server for the subscriber's tests: only the two ingest RPCs the
//! subscriber calls are the test's own ([`IngestDouble`]); [`Ingest`] answers the other six
//! UNIMPLEMENTED, so each test file writes what it checks and nothing else.

use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCache;
use inferencecache_proto::v1alpha1::*;
use tonic::{Request, Response, Status, Streaming};

/// What a test double does with the subscriber's calls.
#[tonic::async_trait]
pub trait IngestDouble: Send + Sync + 'static {
    async fn report_cache_state(
        &self,
        req: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status>;
    async fn publish_event(&self, req: Request<CacheEvent>) -> Result<Response<Ack>, Status>;
}

/// The full service around an [`IngestDouble`].
#[derive(Clone, Default)]
pub struct Ingest<D>(pub D);

fn not_the_subscribers<T>() -> Result<T, Status> {
    Err(Status::unimplemented("double"))
}

#[tonic::async_trait]
impl<D: IngestDouble> InferenceCache for Ingest<D> {
    async fn render_template(
        &self,
        _: Request<RenderTemplateRequest>,
    ) -> Result<Response<RenderTemplateResponse>, Status> {
        not_the_subscribers()
    }
    async fn lookup_route(
        &self,
        _: Request<LookupRouteRequest>,
    ) -> Result<Response<LookupRouteResponse>, Status> {
        not_the_subscribers()
    }
    async fn lookup_pd_route(
        &self,
        _: Request<LookupPdRouteRequest>,
    ) -> Result<Response<LookupPdRouteResponse>, Status> {
        not_the_subscribers()
    }
    async fn get_cache_state(
        &self,
        _: Request<GetCacheStateRequest>,
    ) -> Result<Response<GetCacheStateResponse>, Status> {
        not_the_subscribers()
    }
    async fn report_cache_state(
        &self,
        req: Request<Streaming<CacheStateUpdate>>,
    ) -> Result<Response<Ack>, Status> {
        self.0.report_cache_state(req).await
    }
    async fn publish_event(&self, req: Request<CacheEvent>) -> Result<Response<Ack>, Status> {
        self.0.publish_event(req).await
    }
    type StreamCacheEventsStream = tokio_stream::Empty<Result<CacheEvent, Status>>;
    async fn stream_cache_events(
        &self,
        _: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        not_the_subscribers()
    }
    type StreamMetricsStream = tokio_stream::Empty<Result<Metric, Status>>;
    async fn stream_metrics(
        &self,
        _: Request<StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        not_the_subscribers()
    }
}
