//! The per-endpoint caches of TokenReview verdicts (docs/BEHAVIOUR.md §13.2): keyed by the hex
//! SHA-256 of the token (the raw token is never kept), each entry valid for the cache's TTL, at
//! most the cache's capacity entries. Inserting into a full cache first drops expired entries,
//! then the entry that expires soonest — the reference's eviction rule for successful reviews
//! ([`AUTH_CACHE_TTL`], [`AUTH_CACHE_CAPACITY`]); denied tokens are remembered the same way, for
//! a shorter time, so a repeated bad token costs one review, not one per request.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::limits::{AUTH_CACHE_CAPACITY, AUTH_CACHE_TTL};

/// Hex SHA-256 of `token`: the cache key.
pub fn token_key(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let mut out = String::with_capacity(64);
    for b in digest.iter() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// Verdicts of one endpoint: key → (expiry, verdict).
#[derive(Debug)]
pub struct ReviewCache<V> {
    entries: HashMap<String, (Instant, V)>,
    capacity: usize,
    ttl: Duration,
}

impl<V: Clone> Default for ReviewCache<V> {
    /// The cache of successful reviews (the reference's 32 entries for 30 s).
    fn default() -> Self {
        Self::new(AUTH_CACHE_CAPACITY, AUTH_CACHE_TTL)
    }
}

impl<V: Clone> ReviewCache<V> {
    /// An empty cache of at most `capacity` entries, each valid for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        assert!(capacity > 0);
        Self {
            entries: HashMap::new(),
            capacity,
            ttl,
        }
    }

    /// The unexpired verdict of `key` at `now`.
    pub fn get(&self, key: &str, now: Instant) -> Option<V> {
        self.entries
            .get(key)
            .and_then(|(exp, v)| (now < *exp).then(|| v.clone()))
    }

    /// Whether `key` holds an unexpired entry at `now`.
    pub fn hit(&self, key: &str, now: Instant) -> bool {
        self.get(key, now).is_some()
    }

    /// Remembers `verdict` for `key` until `now + ttl`, evicting per the module rule when full.
    pub fn insert(&mut self, key: String, verdict: V, now: Instant) {
        if !self.entries.contains_key(&key) && self.entries.len() >= self.capacity {
            self.entries.retain(|_, (exp, _)| now < *exp);
            if self.entries.len() >= self.capacity
                && let Some(victim) = self
                    .entries
                    .iter()
                    .min_by_key(|(_, (exp, _))| *exp)
                    .map(|(k, _)| k.clone())
            {
                self.entries.remove(&victim);
            }
        }
        self.entries.insert(key, (now + self.ttl, verdict));
    }

    /// Number of entries (expired ones included until an insert drops them).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_is_hex_sha256() {
        assert_eq!(
            token_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn expiry_and_capacity() {
        let t0 = Instant::now();
        let mut c = ReviewCache::<()>::default();
        c.insert("a".into(), (), t0);
        assert!(c.hit("a", t0 + Duration::from_secs(29)));
        assert!(!c.hit("a", t0 + AUTH_CACHE_TTL));
        // Fill: "a" expires soonest and is the victim once everything is still valid.
        for i in 1..AUTH_CACHE_CAPACITY {
            c.insert(format!("k{i}"), (), t0 + Duration::from_millis(i as u64));
        }
        assert_eq!(c.len(), AUTH_CACHE_CAPACITY);
        c.insert("new".into(), (), t0 + Duration::from_secs(1));
        assert_eq!(c.len(), AUTH_CACHE_CAPACITY);
        assert!(!c.hit("a", t0 + Duration::from_secs(1)));
        assert!(c.hit("k1", t0 + Duration::from_secs(1)));
        assert!(c.hit("new", t0 + Duration::from_secs(1)));
        // Expired entries are dropped first, all of them.
        let later = t0 + Duration::from_secs(100);
        c.insert("late".into(), (), later);
        assert_eq!(c.len(), 1);
    }
}
