//! The `inferencecache.v1alpha1.InferenceCache` handlers. Each handler finds the core owning the
//! request's `(tenant, model)` partition and runs the index operation there: locally when that is
//! the current core, over the bounded hop otherwise. Every LookupRoute path fails open.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures_util::Stream;
use inferencecache_index::PROBE_TENANT;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCache;
use tonic::{Request, Response, Status, Streaming};

use crate::ingest;
use crate::lookup::LookupConfig;
use crate::nats::writer;
use crate::producer;
use crate::runtime::mailbox;
use crate::shard::{IngestRefused, owner};
use prost::Message;

use super::status::receive_status;

/// The InferenceCache service; one cheap instance per core.
#[derive(Debug, Clone)]
pub struct CacheService {
    cfg: Arc<LookupConfig>,
}

impl CacheService {
    /// Creates the handler set over shared configuration.
    pub fn new(cfg: Arc<LookupConfig>) -> Self {
        Self { cfg }
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn ack() -> Response<pb::Ack> {
    Response::new(pb::Ack {
        accepted: true,
        reason_code: String::new(),
    })
}

/// The Ack of a ReportCacheState stream: accepted, or the first refusal's code.
fn ack_of(refused: Option<&'static str>) -> Response<pb::Ack> {
    match refused {
        None => ack(),
        Some(why) => Response::new(pb::Ack {
            accepted: false,
            reason_code: why.to_string(),
        }),
    }
}

/// ReportCacheState on a log writer (`--nats-log-writer`): each message the producer checks
/// admit is published to the event log, and the next is read only once JetStream stored it (so
/// the stream's messages keep the stream's order, and a slow log slows the producer through
/// HTTP/2 flow control); a refused one is never published. The index is not touched here:
/// every replica, this one too, applies the message from the log. A publish that fails ends the
/// call with its status (what was published before it stays published).
async fn report_through_log(
    caller: &producer::Caller,
    updates: &mut impl Updates,
) -> Result<Response<pb::Ack>, Status> {
    let mut refused: Option<&'static str> = None;
    while let Some(update) = updates.next().await? {
        if let Err(why) = caller.admit_for_log(&update.tenant_id, &update.replica_id) {
            refused.get_or_insert(why.reason_code());
            continue;
        }
        // As on the direct path: checked, then skipped silently (§4.1); never in the log.
        if update.tenant_id == PROBE_TENANT {
            continue;
        }
        // Names no replica would store are refused here, before they take room in the log.
        if let Err(why) = IngestRefused::check_ids(&update) {
            crate::metrics::record_ingest_refused(why.metric_label());
            refused.get_or_insert(why.reason_code());
            continue;
        }
        writer::publish(
            writer::Kind::Update,
            update.encode_to_vec(),
            caller.epoch_text(),
        )
        .await?;
        caller.note_published(&update.tenant_id, &update.replica_id);
    }
    Ok(ack_of(refused))
}

/// PublishEvent on a log writer: published once the producer checks admit it, acknowledged
/// once JetStream stored it; a refusal or a failed publish is the call's status.
async fn publish_through_log(
    caller: &producer::Caller,
    event: pb::CacheEvent,
) -> Result<Response<pb::Ack>, Status> {
    caller
        .admit_for_log(&event.tenant_id, &event.replica_id)
        .map_err(|why| why.status())?;
    if event.tenant_id == PROBE_TENANT {
        return Ok(ack());
    }
    writer::publish(
        writer::Kind::Event,
        event.encode_to_vec(),
        caller.epoch_text(),
    )
    .await?;
    caller.note_published(&event.tenant_id, &event.replica_id);
    Ok(ack())
}

/// The messages of one ReportCacheState stream, however they are decoded: by tonic (this
/// service's own method) or on the decode pool when large (`super::ingest_rpc`, which serves the
/// path).
pub(super) trait Updates: Send {
    /// The next message; `None` at the end of the stream.
    fn next(
        &mut self,
    ) -> impl std::future::Future<Output = Result<Option<pb::CacheStateUpdate>, Status>> + Send;
}

impl Updates for Streaming<pb::CacheStateUpdate> {
    async fn next(&mut self) -> Result<Option<pb::CacheStateUpdate>, Status> {
        self.message().await.map_err(receive_status)
    }
}

/// ReportCacheState of an admitted `caller`, its messages from `updates`.
pub(super) async fn report_cache_state(
    caller: &producer::Caller,
    updates: &mut impl Updates,
) -> Result<Response<pb::Ack>, Status> {
    if writer::enabled() {
        return report_through_log(caller, updates).await;
    }
    let mut refused: Option<&'static str> = None;
    // Each message is applied as soon as it is received (docs/BEHAVIOUR.md §4.1); the await on
    // the owner's reply bounds this stream to one message in flight, so a slow owner slows
    // the producer through HTTP/2 flow control instead of growing a queue. A refused message
    // does not stop the stream, but the Ack then says so: nothing unapplied is acknowledged.
    while let Some(update) = updates.next().await? {
        // Producer checks first: nothing of a refused message reaches the index or a feed.
        if let Err(why) = caller.admit(&update.tenant_id, &update.replica_id) {
            refused.get_or_insert(why.reason_code());
            continue;
        }
        let applied = ingest::apply_update(update).await.map_err(|_| {
            Status::unavailable("owner core unavailable (stalled or shutting down)")
        })?;
        if let Err(why) = applied {
            refused.get_or_insert(why.reason_code());
        }
    }
    Ok(ack_of(refused))
}

/// PublishEvent of `caller`, its event decoded.
pub(super) async fn publish_event(
    caller: &producer::Caller,
    event: pb::CacheEvent,
) -> Result<Response<pb::Ack>, Status> {
    if writer::enabled() {
        return publish_through_log(caller, event).await;
    }
    caller
        .admit(&event.tenant_id, &event.replica_id)
        .map_err(|why| why.status())?;
    // An event that cannot be delivered (shutdown) is still acknowledged: PublishEvent never
    // returns another error in the contract.
    let _ = ingest::apply_event(event).await;
    Ok(ack())
}

#[tonic::async_trait]
impl InferenceCache for CacheService {
    async fn render_template(
        &self,
        request: Request<pb::RenderTemplateRequest>,
    ) -> Result<Response<pb::RenderTemplateResponse>, Status> {
        Ok(Response::new(crate::templates::render(
            request.into_inner(),
        )))
    }

    async fn lookup_route(
        &self,
        request: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        let start = Instant::now();
        let deadline = super::deadline::from_metadata(request.metadata(), start);
        let req = request.into_inner();
        let resp = crate::lookup::answer_request(&self.cfg, req, start, deadline).await;
        Ok(Response::new(resp))
    }

    async fn lookup_pd_route(
        &self,
        request: Request<pb::LookupPdRouteRequest>,
    ) -> Result<Response<pb::LookupPdRouteResponse>, Status> {
        let start = Instant::now();
        let deadline = super::deadline::from_metadata(request.metadata(), start);
        let block_size = self.cfg.engine_block_size;
        let req = request.into_inner();
        Ok(Response::new(
            crate::pd::lookup_pd_route(req, start, deadline, block_size).await,
        ))
    }

    async fn get_cache_state(
        &self,
        request: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        let req = request.into_inner();
        if req.tenant_id == PROBE_TENANT {
            return Ok(Response::new(pb::GetCacheStateResponse {
                replicas: Vec::new(),
                summary: Some(pb::CacheSummary::default()),
            }));
        }
        let core = owner(&req.tenant_id, &req.model_id);
        // Its prefix count is final once a pending ALL_CLEARED's removals are done.
        let resp = mailbox::call_after_clear(core, move |st| {
            st.cache_state(&req.tenant_id, &req.model_id)
        })
        .await
        .unwrap_or_else(|_| pb::GetCacheStateResponse {
            replicas: Vec::new(),
            summary: Some(pb::CacheSummary::default()),
        });
        Ok(Response::new(resp))
    }

    async fn report_cache_state(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        let caller = producer::caller(&request).await?;
        report_cache_state(&caller, &mut request.into_inner()).await
    }

    async fn publish_event(
        &self,
        request: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        // A refused producer is answered with the refusal's status (docs/BEHAVIOUR.md §4.3),
        // before anything of the event is applied or published.
        let caller = producer::caller(&request).await?;
        publish_event(&caller, request.into_inner()).await
    }

    type StreamCacheEventsStream = BoxStream<pb::CacheEvent>;

    async fn stream_cache_events(
        &self,
        request: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        Ok(Response::new(crate::feeds::events::subscribe(
            request.into_inner(),
        )))
    }

    type StreamMetricsStream = BoxStream<pb::Metric>;

    async fn stream_metrics(
        &self,
        request: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        Ok(Response::new(crate::feeds::metrics::subscribe(
            request.into_inner(),
        )))
    }
}
