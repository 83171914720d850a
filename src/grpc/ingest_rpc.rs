//! ReportCacheState and PublishEvent with their messages decoded off the serving core when
//! large.
//!
//! tonic's generated service decodes each message with prost inside the poll that received it,
//! and a message can be 4 MiB (`MAX_MESSAGE_BYTES`): 250,000 prefixes held the core for tens of
//! ms in one poll. These two paths are served here instead, through tonic's own `Grpc` (framing,
//! size limit, statuses as for every method) with a codec that hands each message over as its
//! received bytes. A message of at most [`OFFCORE_DECODE_MIN_BYTES`] is decoded at once, as
//! before; a larger one goes to the decode pool (`runtime::decode_pool`) and the core awaits it,
//! serving other requests meanwhile.

use std::convert::Infallible;

use bytes::{Buf, Bytes};
use http::Response;
use inferencecache_proto::v1alpha1 as pb;
use tonic::body::Body;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::server::{ClientStreamingService, Grpc, UnaryService};
use tonic::{Status, Streaming};
use tonic_prost::ProstEncoder;

use super::body::RequestBody;
use super::service::{self, Updates};
use super::status::receive_status;
use crate::limits::{MAX_MESSAGE_BYTES, OFFCORE_DECODE_MIN_BYTES};
use crate::producer;
use crate::runtime::decode_pool::{self, Refused};

/// The path of ReportCacheState.
pub(super) const REPORT_CACHE_STATE_PATH: &str =
    "/inferencecache.v1alpha1.InferenceCache/ReportCacheState";
/// The path of PublishEvent.
pub(super) const PUBLISH_EVENT_PATH: &str = "/inferencecache.v1alpha1.InferenceCache/PublishEvent";

/// Serves one ReportCacheState call.
pub(super) async fn report_cache_state(
    req: http::Request<RequestBody>,
) -> Result<Response<Body>, Infallible> {
    Ok(grpc().client_streaming(ReportCacheState, req).await)
}

/// Serves one PublishEvent call.
pub(super) async fn publish_event(
    req: http::Request<RequestBody>,
) -> Result<Response<Body>, Infallible> {
    Ok(grpc().unary(PublishEvent, req).await)
}

/// tonic's server side of one call, configured as the generated service is (`install_services`).
fn grpc() -> Grpc<RawCodec> {
    Grpc::new(RawCodec).apply_max_message_size_config(Some(MAX_MESSAGE_BYTES), Some(usize::MAX))
}

/// Decodes one received message: at once when small, else on the decode pool, awaited. tonic's
/// decode error is INTERNAL, and so is this one.
async fn decode<M>(raw: Bytes) -> Result<M, Status>
where
    M: prost::Message + Default + Send + 'static,
{
    let malformed = |e: prost::DecodeError| Status::internal(e.to_string());
    if raw.len() <= OFFCORE_DECODE_MIN_BYTES {
        return M::decode(raw).map_err(malformed);
    }
    let decoded = decode_pool::decode::<M>(raw).map_err(|why| match why {
        // Transient, so UNAVAILABLE (as a saturated log writer): producers read
        // RESOURCE_EXHAUSTED as a refusal of the content.
        Refused::Full => {
            crate::metrics::record_limit_hit("offcore_decodes");
            Status::unavailable(
                "decode pool saturated: too many large messages are being decoded; retry with back-off",
            )
        }
        Refused::Unavailable => Status::unavailable("decode pool unavailable"),
    })?;
    crate::metrics::record_offcore_decode();
    decoded
        .await
        .map_err(|_| Status::unavailable("decode pool shutting down"))?
        .map_err(malformed)
}

/// A ReportCacheState stream whose messages arrive as bytes.
struct RawUpdates(Streaming<Bytes>);

impl Updates for RawUpdates {
    async fn next(&mut self) -> Result<Option<pb::CacheStateUpdate>, Status> {
        match self.0.message().await.map_err(receive_status)? {
            Some(raw) => decode(raw).await.map(Some),
            None => Ok(None),
        }
    }
}

type AckFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<tonic::Response<pb::Ack>, Status>> + Send>,
>;

struct ReportCacheState;

impl ClientStreamingService<Bytes> for ReportCacheState {
    type Response = pb::Ack;
    type Future = AckFuture;

    fn call(&mut self, request: tonic::Request<Streaming<Bytes>>) -> Self::Future {
        Box::pin(async move {
            let caller = producer::caller(&request).await?;
            let mut updates = RawUpdates(request.into_inner());
            service::report_cache_state(&caller, &mut updates).await
        })
    }
}

struct PublishEvent;

impl UnaryService<Bytes> for PublishEvent {
    type Response = pb::Ack;
    type Future = AckFuture;

    fn call(&mut self, request: tonic::Request<Bytes>) -> Self::Future {
        Box::pin(async move {
            // A refused producer is answered before its event is decoded (§4.3).
            let caller = producer::caller(&request).await?;
            let event = decode::<pb::CacheEvent>(request.into_inner()).await?;
            service::publish_event(&caller, event).await
        })
    }
}

/// Acks encoded by prost, requests handed over as their bytes.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = pb::Ack;
    type Decode = Bytes;
    type Encoder = ProstEncoder<pb::Ack>;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawDecoder
    }
}

/// A message's bytes, as tonic buffered them (no copy: tonic's buffer is split off).
#[derive(Debug, Clone, Copy, Default)]
struct RawDecoder;

impl Decoder for RawDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining())))
    }
}
