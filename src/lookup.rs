//! The LookupRoute handler algorithm (BEHAVIOUR.md §10.2).

use std::time::Instant;

use inferencecache_proto::v1alpha1 as pb;

use crate::grpc::service::ServiceConfig;

/// Answers one LookupRoute; never fails (every path is fail-open).
pub async fn lookup_route(
    _cfg: &ServiceConfig,
    _req: pb::LookupRouteRequest,
    start: Instant,
    _deadline: Option<Instant>,
) -> pb::LookupRouteResponse {
    pb::LookupRouteResponse {
        reason_code: "NO_HINT".into(),
        lookup_latency_us: start.elapsed().as_micros() as i64,
        ..Default::default()
    }
}
