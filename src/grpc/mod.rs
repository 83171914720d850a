//! The gRPC surface: routes each HTTP/2 request by path to the InferenceCache service, the
//! standard health service or server reflection (v1 and v1alpha), on the core that received it.

pub mod deadline;
pub mod service;

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;

use http::{Request, Response};
use hyper::body::Incoming;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCacheServer;
use tonic::body::Body;
use tower_service::Service;

/// gRPC's 4 MiB default receive limit, as in the reference (grpc-go defaults).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

type HealthSvc = tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>;
/// A type-erased service call (the reflection builders return opaque types).
type Caller = Box<dyn FnMut(Request<Incoming>) -> RouteFuture>;

/// The tonic services one core serves (cheap handles; each core builds its own).
struct Services {
    cache: InferenceCacheServer<service::CacheService>,
    health: HealthSvc,
    reflect_v1: Caller,
    reflect_v1alpha: Caller,
}

thread_local! {
    static SERVICES: RefCell<Option<Services>> = const { RefCell::new(None) };
}

/// Builds this core's services. `health` is shared so every core reports the same status.
pub fn install(
    cfg: std::sync::Arc<service::ServiceConfig>,
    health: &tonic_health::server::HealthReporter,
) {
    let cache = InferenceCacheServer::new(service::CacheService::new(cfg))
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
    let reflect_v1: Caller =
        Box::new(move |req| Box::pin(crate::admin::InAdminRuntime::new(v1.call(req))));
    let reflect_v1alpha: Caller =
        Box::new(move |req| Box::pin(crate::admin::InAdminRuntime::new(v1alpha.call(req))));
    SERVICES.with(|s| {
        *s.borrow_mut() = Some(Services {
            cache,
            health,
            reflect_v1,
            reflect_v1alpha,
        })
    });
}

/// A boxed response future of any of the services (all answer `Response<tonic::body::Body>`).
pub type RouteFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

/// Dispatches one request by its `/package.Service/Method` path.
pub fn route(req: Request<Incoming>) -> RouteFuture {
    let path = req.uri().path();
    let target = if path.starts_with("/inferencecache.v1alpha1.InferenceCache/") {
        0
    } else if path.starts_with("/grpc.health.v1.Health/") {
        1
    } else if path.starts_with("/grpc.reflection.v1.ServerReflection/") {
        2
    } else if path.starts_with("/grpc.reflection.v1alpha.ServerReflection/") {
        3
    } else {
        return Box::pin(std::future::ready(Ok(
            tonic::Status::unimplemented("").into_http()
        )));
    };
    SERVICES.with(|s| {
        let mut s = s.borrow_mut();
        let s = s.as_mut().expect("grpc services installed on this core");
        match target {
            0 => {
                let call = s.cache.call(req);
                let fut: RouteFuture = Box::pin(async move {
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
                });
                fut
            }
            1 => Box::pin(s.health.call(req)),
            2 => (s.reflect_v1)(req),
            _ => (s.reflect_v1alpha)(req),
        }
    })
}

/// tonic's decoder reports a request over [`MAX_MESSAGE_BYTES`] as OUT_OF_RANGE; grpc-go (the
/// reference's defaults, BEHAVIOUR.md §1.3) answers RESOURCE_EXHAUSTED, which clients retry and
/// alert on. Rewrites that status in headers (trailers-only responses) and in trailers (how
/// tonic answers a unary request it could not decode).
fn oversize_as_resource_exhausted(headers: &mut http::HeaderMap) {
    let oversize = headers.get("grpc-status").is_some_and(|v| v == "11")
        && headers
            .get("grpc-message")
            .and_then(|m| m.to_str().ok())
            .is_some_and(|m| is_oversize_message(&m.replace("%20", " ")));
    if oversize {
        headers.insert("grpc-status", http::HeaderValue::from_static("8"));
        headers.insert(
            "grpc-message",
            http::HeaderValue::from_static("grpc: received message larger than max"),
        );
    }
}

/// Whether a (decoded) status message is tonic's "message too large" decode error.
pub fn is_oversize_message(msg: &str) -> bool {
    msg.contains("message length too large")
}

/// Adapts [`route`] to hyper's service trait.
#[derive(Clone, Copy, Debug, Default)]
pub struct Router;

impl hyper::service::Service<Request<Incoming>> for Router {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = RouteFuture;
    fn call(&self, req: Request<Incoming>) -> Self::Future {
        route(req)
    }
}
