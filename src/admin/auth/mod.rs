//! Authentication of the controller-facing listener (docs/BEHAVIOUR.md §13.2).
//!
//! Two sources of trust, usable together:
//!
//! * **TokenReview** (`--allowed-controller-sa`): the bearer token is reviewed by the Kubernetes
//!   API server for the endpoint's audience and must belong to exactly that service account.
//!   Successful reviews are cached per endpoint ([`cache`]).
//! * **Static token file** (`--controller-token-file`, for deployments without Kubernetes): the
//!   bearer token must equal the file's content (trimmed). The file is re-read when its mtime
//!   changes, so it can be rotated in place.
//!
//! A request is accepted when the static token matches, or when the cache or a TokenReview
//! vouches for it. Each request reaching [`Authenticator::check`] increments exactly one
//! `*_auth_total{result}` counter.

pub mod cache;
pub mod producer;
pub mod static_token;
pub mod tokenreview;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;

use super::http::text;
use crate::limits::{
    AUTH_NEGATIVE_CACHE_CAPACITY, AUTH_NEGATIVE_CACHE_TTL, MAX_CONCURRENT_TOKEN_REVIEWS,
};
use crate::metrics::{AuthEndpoint, AuthResult, record_auth};
use cache::{ReviewCache, token_key};
use static_token::StaticToken;
use tokenreview::TokenReviewer;

/// Shared configuration of the three endpoint authenticators.
#[derive(Debug)]
pub struct AuthConfig {
    /// The exact service-account username allowed (TokenReview mode); empty when not used.
    pub expected_sa: String,
    /// The TokenReview client, when `--allowed-controller-sa` is set.
    pub reviewer: Option<TokenReviewer>,
    /// The static bearer token, when `--controller-token-file` is set.
    pub static_token: Option<StaticToken>,
}

/// Why a reviewed token was turned away (remembered in the negative cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Denied {
    /// Not authenticated, or not for this endpoint's audience: 401.
    Unauth,
    /// Authenticated as another identity: 403.
    Forbidden,
}

/// The authenticator of one endpoint: its audience, its counter family, its verdict caches and
/// the reviews in flight (one per token: concurrent requests with the same token share it).
#[derive(Debug)]
pub struct Authenticator {
    endpoint: AuthEndpoint,
    audience: String,
    config: Arc<AuthConfig>,
    cache: Mutex<ReviewCache<()>>,
    denied: Mutex<ReviewCache<Denied>>,
    in_flight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// TokenReview calls in flight in the whole process (controller endpoints and producers
/// together); past it a request is answered 503 (a producer call UNAVAILABLE) at once instead of
/// queueing calls to the API server.
pub(crate) static REVIEW_PERMITS: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(MAX_CONCURRENT_TOKEN_REVIEWS);

pub use crate::sys::http_auth::bearer_token;

impl Authenticator {
    /// An authenticator for `endpoint` reviewing tokens for `audience` (empty = no audience).
    pub fn new(endpoint: AuthEndpoint, audience: &str, config: Arc<AuthConfig>) -> Self {
        Self {
            endpoint,
            audience: audience.to_string(),
            config,
            cache: Mutex::new(ReviewCache::default()),
            denied: Mutex::new(ReviewCache::new(
                AUTH_NEGATIVE_CACHE_CAPACITY,
                AUTH_NEGATIVE_CACHE_TTL,
            )),
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    fn done(&self, result: AuthResult) {
        record_auth(self.endpoint, result);
    }

    /// `Ok` when the request may be served; otherwise the response to send (401/403/503).
    pub async fn check(&self, headers: &HeaderMap) -> Result<(), Response<Full<Bytes>>> {
        let Some(token) = bearer_token(headers) else {
            return Err(self.deny(Denied::Unauth));
        };
        if let Some(st) = &self.config.static_token
            && st.matches(token)
        {
            self.done(AuthResult::Ok);
            return Ok(());
        }
        let Some(reviewer) = &self.config.reviewer else {
            return Err(self.deny(Denied::Unauth));
        };
        let key = token_key(token);
        if let Some(cached) = self.cached(&key) {
            return self.answer(cached);
        }
        // One review per token at a time: a request that waited finds the verdict cached.
        let flight = self.flight(&key);
        let _ours = flight.lock().await;
        if let Some(cached) = self.cached(&key) {
            return self.answer(cached);
        }
        let Ok(_permit) = REVIEW_PERMITS.try_acquire() else {
            tracing::debug!("auth_token_review_saturated");
            return Err(self.unavailable());
        };
        let verdict = match self.review(reviewer, token).await {
            Ok(v) => v,
            Err(()) => return Err(self.unavailable()),
        };
        let now = Instant::now();
        match verdict {
            Ok(()) => lock(&self.cache).insert(key, (), now),
            Err(d) => lock(&self.denied).insert(key, d, now),
        }
        self.answer(verdict)
    }

    /// The cached verdict of a token key, if any.
    fn cached(&self, key: &str) -> Option<Result<(), Denied>> {
        let now = Instant::now();
        if lock(&self.cache).hit(key, now) {
            return Some(Ok(()));
        }
        lock(&self.denied).get(key, now).map(Err)
    }

    /// The single-flight lock of a token key; locks nobody holds are dropped here.
    fn flight(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = lock(&self.in_flight);
        map.retain(|_, l| Arc::strong_count(l) > 1);
        map.entry(key.to_string()).or_default().clone()
    }

    /// One TokenReview: `Ok(verdict)`, or `Err` when the API server gave no usable answer.
    async fn review(
        &self,
        reviewer: &TokenReviewer,
        token: &str,
    ) -> Result<Result<(), Denied>, ()> {
        let audience = (!self.audience.is_empty()).then_some(self.audience.as_str());
        let status = reviewer.review(token, audience).await.map_err(|e| {
            tracing::debug!(error = %e, "auth_token_review_error");
        })?;
        if !status.authenticated {
            if !status.error.is_empty() {
                tracing::warn!(error = %status.error, "auth_token_review_unauthenticated");
            }
            return Ok(Err(Denied::Unauth));
        }
        // An audience-aware API server names the requested audience in `status.audiences`; a
        // review that does not is not proof the token was issued for this endpoint.
        if let Some(aud) = audience
            && !status.audiences.iter().any(|a| a == aud)
        {
            tracing::warn!(audience = %aud, "auth_token_review_audience_mismatch");
            return Ok(Err(Denied::Unauth));
        }
        if status.username != self.config.expected_sa {
            return Ok(Err(Denied::Forbidden));
        }
        Ok(Ok(()))
    }

    // The `Err` is the response to send, built once per admin request, as `check` returns it.
    #[allow(clippy::result_large_err)]
    fn answer(&self, verdict: Result<(), Denied>) -> Result<(), Response<Full<Bytes>>> {
        match verdict {
            Ok(()) => {
                self.done(AuthResult::Ok);
                Ok(())
            }
            Err(d) => Err(self.deny(d)),
        }
    }

    fn deny(&self, why: Denied) -> Response<Full<Bytes>> {
        match why {
            Denied::Unauth => {
                self.done(AuthResult::Unauth);
                text(StatusCode::UNAUTHORIZED, "unauthorized\n")
            }
            Denied::Forbidden => {
                self.done(AuthResult::Forbidden);
                text(StatusCode::FORBIDDEN, "forbidden\n")
            }
        }
    }

    fn unavailable(&self) -> Response<Full<Bytes>> {
        self.done(AuthResult::Error);
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "token review unavailable\n",
        )
    }
}

/// Locks a mutex whose data stays consistent even if a holder panicked.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The three controller-facing authenticators, or none when auth is disabled.
#[derive(Debug)]
pub struct ControllerAuth {
    /// `/snapshot` (controller audience).
    pub snapshot: Authenticator,
    /// `/policy` (policy audience).
    pub policy: Authenticator,
    /// `/probe` (controller audience).
    pub probe: Authenticator,
}

impl ControllerAuth {
    /// Builds the three authenticators sharing `config`.
    pub fn new(config: AuthConfig, controller_audience: &str, policy_audience: &str) -> Self {
        let config = Arc::new(config);
        Self {
            snapshot: Authenticator::new(
                AuthEndpoint::Snapshot,
                controller_audience,
                config.clone(),
            ),
            policy: Authenticator::new(AuthEndpoint::Policy, policy_audience, config.clone()),
            probe: Authenticator::new(AuthEndpoint::Probe, controller_audience, config),
        }
    }
}

/// The flags that choose the controller-facing auth (validated at start-up).
#[derive(Clone, Debug, Default)]
pub struct AuthFlags {
    /// `--insecure-disable-auth`.
    pub insecure_disable_auth: bool,
    /// `--allowed-controller-sa`.
    pub allowed_controller_sa: String,
    /// `--controller-audience`.
    pub controller_audience: String,
    /// `--policy-audience`.
    pub policy_audience: String,
    /// `--controller-token-file`.
    pub controller_token_file: String,
    /// How to reach the Kubernetes API for TokenReview (`--kube-*`).
    pub kube: tokenreview::KubeConfig,
}

/// Why the controller-facing auth could not be built (start-up: logged, exit 1).
#[derive(Debug)]
pub enum SetupError {
    /// The TokenReview client (in-cluster config, CA, token file).
    TokenReview(tokenreview::ClientError),
    /// The static token file.
    TokenFile(static_token::TokenFileError),
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TokenReview(e) => e.fmt(f),
            Self::TokenFile(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for SetupError {}

/// Builds the controller-facing auth and logs the outcome: `controller_auth_enabled`
/// (TokenReview and/or token file) or `controller_auth_disabled`. `Err` is logged by the caller
/// and exits 1 (the reference's "in-cluster client could not be built").
pub fn setup(flags: &AuthFlags) -> Result<Option<ControllerAuth>, SetupError> {
    if flags.insecure_disable_auth {
        tracing::warn!("controller_auth_disabled");
        return Ok(None);
    }
    let reviewer = if flags.allowed_controller_sa.is_empty() {
        None
    } else {
        Some(TokenReviewer::new(&flags.kube).map_err(SetupError::TokenReview)?)
    };
    let static_token = if flags.controller_token_file.is_empty() {
        None
    } else {
        Some(StaticToken::load(&flags.controller_token_file).map_err(SetupError::TokenFile)?)
    };
    if reviewer.is_some() {
        tracing::info!(
            expected_sa = %flags.allowed_controller_sa,
            controller_audience = %flags.controller_audience,
            policy_audience = %flags.policy_audience,
            token_file = static_token.is_some(),
            "controller_auth_enabled"
        );
    } else {
        tracing::info!(token_file = true, "controller_auth_enabled");
    }
    Ok(Some(ControllerAuth::new(
        AuthConfig {
            expected_sa: flags.allowed_controller_sa.clone(),
            reviewer,
            static_token,
        },
        &flags.controller_audience,
        &flags.policy_audience,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, v.parse().unwrap());
        h
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token(&headers("Bearer abc")), Some("abc"));
        assert_eq!(bearer_token(&headers("bEaReR   abc  ")), Some("abc"));
        assert_eq!(bearer_token(&headers("Bearer    ")), None);
        assert_eq!(bearer_token(&headers("Basic abc")), None);
        assert_eq!(bearer_token(&headers("Bearer")), None);
        assert_eq!(bearer_token(&HeaderMap::new()), None);
    }
}
