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
pub mod static_token;
pub mod tokenreview;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;

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

/// The authenticator of one endpoint: its audience, its counter family and its review cache.
#[derive(Debug)]
pub struct Authenticator {
    endpoint: AuthEndpoint,
    audience: String,
    config: Arc<AuthConfig>,
    cache: Mutex<ReviewCache>,
}

fn plain(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "text/plain; charset=utf-8")
        .header("x-content-type-options", "nosniff")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("static response")
}

/// Extracts the bearer token: scheme case-insensitive, token trimmed and non-empty.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim();
    (!token.is_empty()).then_some(token)
}

impl Authenticator {
    /// An authenticator for `endpoint` reviewing tokens for `audience` (empty = no audience).
    pub fn new(endpoint: AuthEndpoint, audience: &str, config: Arc<AuthConfig>) -> Self {
        Self {
            endpoint,
            audience: audience.to_string(),
            config,
            cache: Mutex::new(ReviewCache::default()),
        }
    }

    fn done(&self, result: AuthResult) {
        record_auth(self.endpoint, result);
    }

    /// `Ok` when the request may be served; otherwise the response to send (401/403/503).
    pub async fn check(&self, headers: &HeaderMap) -> Result<(), Response<Full<Bytes>>> {
        let Some(token) = bearer_token(headers) else {
            self.done(AuthResult::Unauth);
            return Err(plain(StatusCode::UNAUTHORIZED, "unauthorized\n"));
        };
        if let Some(st) = &self.config.static_token
            && st.matches(token)
        {
            self.done(AuthResult::Ok);
            return Ok(());
        }
        let Some(reviewer) = &self.config.reviewer else {
            self.done(AuthResult::Unauth);
            return Err(plain(StatusCode::UNAUTHORIZED, "unauthorized\n"));
        };
        let key = token_key(token);
        if self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .hit(&key, Instant::now())
        {
            self.done(AuthResult::Ok);
            return Ok(());
        }
        let audience = (!self.audience.is_empty()).then_some(self.audience.as_str());
        let status = match reviewer.review(token, audience).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "auth_token_review_error");
                self.done(AuthResult::Error);
                return Err(plain(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "token review unavailable\n",
                ));
            }
        };
        if !status.authenticated {
            if !status.error.is_empty() {
                tracing::warn!(error = %status.error, "auth_token_review_unauthenticated");
            }
            self.done(AuthResult::Unauth);
            return Err(plain(StatusCode::UNAUTHORIZED, "unauthorized\n"));
        }
        if status.username != self.config.expected_sa {
            self.done(AuthResult::Forbidden);
            return Err(plain(StatusCode::FORBIDDEN, "forbidden\n"));
        }
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, Instant::now());
        self.done(AuthResult::Ok);
        Ok(())
    }
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
