//! The `authorization: Bearer` header, shared by the controller endpoints and the producer
//! ingest RPCs.

use http::HeaderMap;

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
