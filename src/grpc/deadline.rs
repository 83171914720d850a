//! The caller's gRPC deadline. Without tonic's transport nothing applies `grpc-timeout`, and the
//! contract wants an expired deadline answered with the fail-open TIMEOUT envelope (docs/BEHAVIOUR.md
//! §10.2), never an error status, so handlers read the header themselves.

use std::time::{Duration, Instant};

/// Longest timeout value gRPC allows (8 ASCII digits).
const MAX_DIGITS: usize = 8;

/// Parses a `grpc-timeout` header value (`<digits><unit>`, units H M S m u n). `None` when absent
/// or malformed (a malformed header means "no deadline", as in grpc-go).
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > MAX_DIGITS + 1 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The absolute deadline of a request, measured from `start` (handler entry).
pub fn from_metadata(meta: &tonic::metadata::MetadataMap, start: Instant) -> Option<Instant> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    start.checked_add(parse_grpc_timeout(v)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout("4m"), Some(Duration::from_millis(4)));
        assert_eq!(parse_grpc_timeout("5u"), Some(Duration::from_micros(5)));
        assert_eq!(parse_grpc_timeout("0n"), Some(Duration::ZERO));
    }

    #[test]
    fn rejects_malformed() {
        for v in ["", "m", "10", "10x", "-1m", "123456789m", "1.5S"] {
            assert_eq!(parse_grpc_timeout(v), None, "{v}");
        }
    }
}
