//! The index's clock: Unix time in nanoseconds, as producers stamp their entries.

/// Unix time in nanoseconds; 0 before 1970, saturating at `i64::MAX`.
pub fn unix_now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos().min(i64::MAX as u128) as i64)
        .unwrap_or(0)
}
