//! Dispatches each HTTP/2 request by its `/package.Service/Method` path to the service that
//! answers it, on the core that received it. Each core builds its own service handles.

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::{Request, Response};
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCacheServer;
use tonic::body::Body;
use tower_service::Service;

use crate::limits::MAX_MESSAGE_BYTES;
use crate::lookup::LookupConfig;
use crate::runtime::admin_thread::InAdminRuntime;

use super::body::RequestBody;
use super::ingest_rpc;
use super::service::CacheService;
use super::status::oversize_as_resource_exhausted;

type HealthSvc = tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>;
/// A type-erased service call (the reflection builders return opaque types).
type Caller = Box<dyn FnMut(Request<RequestBody>) -> ResponseFuture>;
/// A boxed response future of any of the services (all answer `Response<tonic::body::Body>`).
type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

/// The services a request can be dispatched to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dispatch {
    /// `inferencecache.v1alpha1.InferenceCache`.
    Cache,
    /// `grpc.health.v1.Health`.
    Health,
    /// `grpc.reflection.v1.ServerReflection`.
    ReflectionV1,
    /// `grpc.reflection.v1alpha.ServerReflection`.
    ReflectionV1Alpha,
}

impl Dispatch {
    /// The service of a request path; `None` answers UNIMPLEMENTED.
    fn of_path(path: &str) -> Option<Self> {
        const PREFIXES: [(&str, Dispatch); 4] = [
            ("/inferencecache.v1alpha1.InferenceCache/", Dispatch::Cache),
            ("/grpc.health.v1.Health/", Dispatch::Health),
            (
                "/grpc.reflection.v1.ServerReflection/",
                Dispatch::ReflectionV1,
            ),
            (
                "/grpc.reflection.v1alpha.ServerReflection/",
                Dispatch::ReflectionV1Alpha,
            ),
        ];
        PREFIXES
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix))
            .map(|(_, d)| *d)
    }
}

/// The tonic services one core serves (cheap handles).
struct Services {
    cache: InferenceCacheServer<CacheService>,
    health: HealthSvc,
    reflect_v1: Caller,
    reflect_v1alpha: Caller,
}

thread_local! {
    static SERVICES: RefCell<Option<Services>> = const { RefCell::new(None) };
}

/// Builds this core's services. `health` is shared so every core reports the same status.
pub fn install_services(cfg: Arc<LookupConfig>, health: &tonic_health::server::HealthReporter) {
    super::unary::install(cfg.clone());
    let cache = InferenceCacheServer::new(CacheService::new(cfg))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX);
    let health = tonic_health::pb::health_server::HealthServer::new(
        tonic_health::server::HealthService::from_health_reporter(health.clone()),
    );
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(inferencecache_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let mut v1 = reflection().build_v1().expect("reflection v1 descriptors");
    let mut v1alpha = reflection()
        .build_v1alpha()
        .expect("reflection v1alpha descriptors");
    // Reflection calls `tokio::spawn`, which only the admin runtime can serve.
    let reflect_v1: Caller = Box::new(move |req| Box::pin(InAdminRuntime::new(v1.call(req))));
    let reflect_v1alpha: Caller =
        Box::new(move |req| Box::pin(InAdminRuntime::new(v1alpha.call(req))));
    SERVICES.with(|s| {
        *s.borrow_mut() = Some(Services {
            cache,
            health,
            reflect_v1,
            reflect_v1alpha,
        })
    });
}

/// Dispatches one request.
pub(super) fn dispatch(req: Request<RequestBody>) -> ResponseFuture {
    let Some(target) = Dispatch::of_path(req.uri().path()) else {
        return Box::pin(std::future::ready(Ok(
            tonic::Status::unimplemented("").into_http()
        )));
    };
    SERVICES.with(|s| {
        let mut s = s.borrow_mut();
        let s = s.as_mut().expect("grpc services installed on this core");
        match target {
            Dispatch::Cache => match req.uri().path() {
                // Their messages can be MiBs: decoded off the core when large.
                ingest_rpc::REPORT_CACHE_STATE_PATH => {
                    cache_call(ingest_rpc::report_cache_state(req))
                }
                ingest_rpc::PUBLISH_EVENT_PATH => cache_call(ingest_rpc::publish_event(req)),
                _ => cache_call(s.cache.call(req)),
            },
            Dispatch::Health => health_call(s.health.call(req)),
            Dispatch::ReflectionV1 => (s.reflect_v1)(req),
            Dispatch::ReflectionV1Alpha => (s.reflect_v1alpha)(req),
        }
    })
}

/// Response headers of every health answer telling a client how the server is sharded, so a
/// shard-aware client learns N, the partition function and which core serves its connection.
pub const SHARDS_HEADER: &str = "inferencecache-shards";
/// The core serving this connection (see [`SHARDS_HEADER`]).
pub const SHARD_HEADER: &str = "inferencecache-shard";
/// The number of partitions (see [`SHARDS_HEADER`]).
pub const PARTITIONS_HEADER: &str = "inferencecache-partitions";
/// The partition function's name (see [`SHARDS_HEADER`]).
pub const PARTITION_FUNCTION_HEADER: &str = "inferencecache-partition-function";

/// A health call, answered with the sharding headers.
fn health_call<F>(call: F) -> ResponseFuture
where
    F: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    let core = crate::shard::current_core().unwrap_or(0);
    Box::pin(async move {
        let mut resp = call.await?;
        let h = resp.headers_mut();
        h.insert(
            SHARDS_HEADER,
            http::HeaderValue::from(crate::shard::cores()),
        );
        h.insert(SHARD_HEADER, http::HeaderValue::from(core));
        h.insert(
            PARTITIONS_HEADER,
            http::HeaderValue::from(crate::shard::PARTITIONS),
        );
        h.insert(
            PARTITION_FUNCTION_HEADER,
            http::HeaderValue::from_static(crate::shard::PARTITION_FUNCTION),
        );
        Ok(resp)
    })
}

/// An InferenceCache call, with tonic's oversize status rewritten as grpc-go's.
fn cache_call<F>(call: F) -> ResponseFuture
where
    F: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    Box::pin(async move {
        let mut resp = call.await?;
        oversize_as_resource_exhausted(resp.headers_mut());
        let (parts, body) = resp.into_parts();
        let body = http_body_util::BodyExt::map_frame(body, |mut frame| {
            if let Some(trailers) = frame.trailers_mut() {
                oversize_as_resource_exhausted(trailers);
            }
            frame
        });
        Ok(Response::from_parts(parts, Body::new(body)))
    })
}

#[cfg(test)]
mod tests {
    use super::Dispatch;

    #[test]
    fn paths_dispatch_by_service_prefix() {
        let cases = [
            (
                "/inferencecache.v1alpha1.InferenceCache/LookupRoute",
                Some(Dispatch::Cache),
            ),
            ("/grpc.health.v1.Health/Check", Some(Dispatch::Health)),
            (
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                Some(Dispatch::ReflectionV1),
            ),
            (
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                Some(Dispatch::ReflectionV1Alpha),
            ),
            ("/other.Service/Method", None),
            ("/inferencecache.v1alpha1.InferenceCacheX/LookupRoute", None),
        ];
        for (path, want) in cases {
            assert_eq!(Dispatch::of_path(path), want, "{path}");
        }
    }
}
