//! TokenReview of producer bearer tokens (`--producer-token-audience`): the controller
//! endpoints' review client, verdict caches (keyed by the token's SHA-256), single-flight per
//! token and process-wide concurrency bound ([`super::REVIEW_PERMITS`]), but the verdict is the
//! reviewed username (the producer's identity, matched against `--producer-policy`), not a
//! yes/no for one expected account.
//!
//! Reviews run on the admin thread's tokio runtime (the serving cores only await the answer), so
//! a slow or unreachable API server delays the ingest call that needs it — bounded by
//! [`TOKEN_REVIEW_TIMEOUT`](crate::limits::TOKEN_REVIEW_TIMEOUT), or answered UNAVAILABLE at once
//! when [`MAX_CONCURRENT_TOKEN_REVIEWS`](crate::limits::MAX_CONCURRENT_TOKEN_REVIEWS) are in
//! flight — and never any other request.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::cache::{ReviewCache, token_key};
use super::tokenreview::TokenReviewer;
use super::{REVIEW_PERMITS, lock};
use crate::limits::{
    AUTH_CACHE_TTL, AUTH_NEGATIVE_CACHE_CAPACITY, AUTH_NEGATIVE_CACHE_TTL,
    PRODUCER_TOKEN_CACHE_CAPACITY,
};
use crate::producer::{TokenError, TokenReview};

/// The producer token reviewer: one per process.
#[derive(Debug)]
pub struct ProducerReviews {
    audience: String,
    reviewer: TokenReviewer,
    cache: Mutex<ReviewCache<Arc<str>>>,
    denied: Mutex<ReviewCache<()>>,
    in_flight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl ProducerReviews {
    /// Reviews tokens for `audience` with `reviewer`.
    pub fn new(reviewer: TokenReviewer, audience: &str) -> Self {
        Self {
            audience: audience.to_string(),
            reviewer,
            cache: Mutex::new(ReviewCache::new(
                PRODUCER_TOKEN_CACHE_CAPACITY,
                AUTH_CACHE_TTL,
            )),
            denied: Mutex::new(ReviewCache::new(
                AUTH_NEGATIVE_CACHE_CAPACITY,
                AUTH_NEGATIVE_CACHE_TTL,
            )),
            in_flight: Mutex::new(HashMap::new()),
        }
    }

    fn cached_key(&self, key: &str) -> Option<Result<Arc<str>, TokenError>> {
        let now = Instant::now();
        if let Some(name) = lock(&self.cache).get(key, now) {
            return Some(Ok(name));
        }
        lock(&self.denied)
            .get(key, now)
            .map(|()| Err(TokenError::Rejected))
    }

    async fn review_now(&self, token: String) -> Result<Arc<str>, TokenError> {
        let key = token_key(&token);
        let flight = {
            let mut map = lock(&self.in_flight);
            map.retain(|_, l| Arc::strong_count(l) > 1);
            map.entry(key.clone()).or_default().clone()
        };
        let _ours = flight.lock().await;
        if let Some(v) = self.cached_key(&key) {
            return v;
        }
        let Ok(_permit) = REVIEW_PERMITS.try_acquire() else {
            return Err(TokenError::Unavailable(
                "too many token reviews in flight".into(),
            ));
        };
        let status = self
            .reviewer
            .review(&token, Some(&self.audience))
            .await
            .map_err(|e| TokenError::Unavailable(e.to_string()))?;
        let now = Instant::now();
        // As for the controller endpoints: the review must name the producer audience.
        let ok = status.authenticated
            && !status.username.is_empty()
            && status.audiences.contains(&self.audience);
        if !ok {
            lock(&self.denied).insert(key, (), now);
            return Err(TokenError::Rejected);
        }
        let name: Arc<str> = status.username.into();
        lock(&self.cache).insert(key, name.clone(), now);
        Ok(name)
    }
}

impl TokenReview for ProducerReviews {
    fn cached(&self, token: &str) -> Option<Result<Arc<str>, TokenError>> {
        self.cached_key(&token_key(token))
    }

    fn review(
        &'static self,
        token: String,
    ) -> Pin<Box<dyn Future<Output = Result<Arc<str>, TokenError>> + Send>> {
        Box::pin(self.review_now(token))
    }
}
