//! Pure ranking arithmetic (docs/BEHAVIOUR.md §6, §9). Kept free of index state so each formula can be
//! tested in isolation and so the evaluation order that makes float32 results bit-exact with the
//! reference is visible in one place.

/// Stored tier of an entry. Wire 0 is normalised to T1 at ingest, so `UNSPECIFIED` is never
/// stored; it only appears as an input to [`worst_tier`] and as the output mapping of colder tiers.
pub type Tier = u8;
/// `CACHE_TIER_UNSPECIFIED`.
pub const TIER_UNSPECIFIED: Tier = 0;
/// `CACHE_TIER_T1`.
pub const TIER_T1: Tier = 1;
/// Any positive wire tier above 3: kept as "colder than T3" (all such values report UNSPECIFIED,
/// and the worst of two of them is still one of them, so their exact value is never observable).
pub const TIER_RAW_COLD: Tier = 4;
/// Negative wire tier: the sentinel colder than everything (the reference's `i32::MAX`).
pub const TIER_NEGATIVE: Tier = u8::MAX;

/// Wire tier → stored tier (§4.1): 0 → T1, 1..=3 kept, other positive → raw-cold, negative →
/// sentinel.
pub fn tier_from_wire(wire: i32) -> Tier {
    match wire {
        0 => TIER_T1,
        1..=3 => wire as Tier,
        w if w > 3 => TIER_RAW_COLD,
        _ => TIER_NEGATIVE,
    }
}

/// Stored tier → wire tier (§9.7): only 1/2/3 are emitted, everything else is UNSPECIFIED (0).
pub fn tier_to_wire(tier: Tier) -> i32 {
    match tier {
        1..=3 => tier as i32,
        _ => 0,
    }
}

/// Coldest tier of a chain run (§8.3): UNSPECIFIED is absorbing, otherwise the numerically larger.
pub fn worst_tier(a: Tier, b: Tier) -> Tier {
    if a == TIER_UNSPECIFIED || b == TIER_UNSPECIFIED {
        TIER_UNSPECIFIED
    } else {
        a.max(b)
    }
}

/// `freshness(now, last_seen, ttl)` (§6), computed in f64 and cast to f32 like the reference.
/// Ages saturate instead of overflowing (the reference's durations saturate too).
pub fn freshness(now: i64, last_seen: i64, ttl: i64) -> f32 {
    if ttl <= 0 {
        return 0.0;
    }
    let age = now.saturating_sub(last_seen);
    if age <= 0 {
        return 1.0;
    }
    if age >= ttl {
        return 0.0;
    }
    (1.0 - age as f64 / ttl as f64) as f32
}

/// `distinguishing_power(matching, total)` (§9.4), in f64.
pub fn distinguishing_power(matching: i64, total: i64) -> f64 {
    if total <= 1 || matching < 0 {
        return 1.0;
    }
    if matching >= total {
        return 0.0;
    }
    1.0 - matching as f64 / total as f64
}

/// `clamp(1 − w·p, 0, 1)` in f32 (§9.3).
pub fn pressure_factor(weight: f32, pressure: f32) -> f32 {
    let f = 1.0 - weight * pressure;
    f.clamp(0.0, 1.0)
}

/// TENANT_HOT recency (§8.4 step 3): f32 division.
pub fn recency(age_ns: i64, max_age_ns: i64) -> f32 {
    if age_ns <= 0 {
        return 1.0;
    }
    if age_ns >= max_age_ns {
        return 0.0;
    }
    1.0 - age_ns as f32 / max_age_ns as f32
}

/// Ranker knobs (§9.1). In-binary defaults; tests override them.
#[derive(Clone, Debug, PartialEq)]
pub struct RankerConfig {
    /// `pressure_factor = clamp(1 − pressure_weight·pressure, 0, 1)`.
    pub pressure_weight: f32,
    /// A request is SLO-tight when `0 < ttft_ms < slo_tight_ttft_ms`.
    pub slo_tight_ttft_ms: i32,
    /// `slo_coeff` for tight requests.
    pub slo_tight_bias: f32,
    /// TENANT_HOT inclusive lower bound on the stats hit rate.
    pub tenant_hot_min_hit_rate: f32,
    /// TENANT_HOT exclusive stats age window in ns; `<= 0` disables TENANT_HOT.
    pub tenant_hot_max_age_ns: i64,
}

impl Default for RankerConfig {
    fn default() -> Self {
        RankerConfig {
            pressure_weight: 1.0,
            slo_tight_ttft_ms: 200,
            slo_tight_bias: 1.0,
            tenant_hot_min_hit_rate: 0.1,
            tenant_hot_max_age_ns: 5 * 60 * 1_000_000_000,
        }
    }
}

impl RankerConfig {
    /// `slo_coeff` (§9.1): the bias when the request is tight, else 0.
    pub fn slo_coeff(&self, ttft_ms: i32) -> f32 {
        if self.slo_tight_ttft_ms <= 0 || self.slo_tight_bias <= 0.0 {
            return 0.0;
        }
        if ttft_ms <= 0 || ttft_ms >= self.slo_tight_ttft_ms {
            return 0.0;
        }
        self.slo_tight_bias
    }

    /// Prefix-path score before distinguishing power (§9.2): `f32(tokens)·f·pf·(1 + f·coeff)`,
    /// evaluated left to right.
    pub fn prefix_score(&self, tokens: i64, fresh: f32, pressure: f32, slo_coeff: f32) -> f32 {
        let pf = pressure_factor(self.pressure_weight, pressure);
        let sb = 1.0 + fresh * slo_coeff;
        tokens as f32 * fresh * pf * sb
    }

    /// TENANT_HOT score (§8.4 step 4): `hit_rate·recency·pf·(1 + recency·coeff)`.
    pub fn hot_score(&self, hit_rate: f32, rec: f32, pressure: f32, slo_coeff: f32) -> f32 {
        let pf = pressure_factor(self.pressure_weight, pressure);
        let sb = 1.0 + rec * slo_coeff;
        hit_rate * rec * pf * sb
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c032_worst_tier() {
        assert_eq!(worst_tier(1, 2), 2);
        assert_eq!(worst_tier(3, 2), 3);
        assert_eq!(worst_tier(1, 1), 1);
        for t in [0, 1, 2, 3, TIER_RAW_COLD, TIER_NEGATIVE] {
            assert_eq!(worst_tier(TIER_UNSPECIFIED, t), TIER_UNSPECIFIED);
            assert_eq!(worst_tier(t, TIER_UNSPECIFIED), TIER_UNSPECIFIED);
        }
    }

    #[test]
    fn c034_distinguishing_power() {
        for m in [0, 1, 5] {
            assert_eq!(distinguishing_power(m, 0), 1.0);
            assert_eq!(distinguishing_power(m, 1), 1.0);
        }
        assert_eq!(distinguishing_power(3, 3), 0.0);
        assert_eq!(distinguishing_power(1, 3), 1.0 - 1.0 / 3.0);
        assert_eq!(distinguishing_power(2, 3), 1.0 - 2.0 / 3.0);
        assert_eq!(distinguishing_power(5, 3), 0.0);
        assert_eq!(distinguishing_power(-1, 3), 1.0);
        assert_eq!(distinguishing_power(-1, 1), 1.0);
    }

    #[test]
    fn tiers_round_trip() {
        assert_eq!(tier_to_wire(tier_from_wire(0)), 1);
        assert_eq!(tier_to_wire(tier_from_wire(2)), 2);
        assert_eq!(tier_to_wire(tier_from_wire(99)), 0);
        assert_eq!(tier_to_wire(tier_from_wire(-1)), 0);
        assert_eq!(
            worst_tier(tier_from_wire(3), tier_from_wire(99)),
            TIER_RAW_COLD
        );
        assert_eq!(
            worst_tier(tier_from_wire(99), tier_from_wire(-5)),
            TIER_NEGATIVE
        );
    }

    #[test]
    fn freshness_edges() {
        assert_eq!(freshness(10, 0, 0), 0.0);
        assert_eq!(freshness(10, 20, 100), 1.0);
        assert_eq!(freshness(100, 0, 100), 0.0);
        assert_eq!(freshness(50, 0, 100), 0.5);
        assert_eq!(freshness(i64::MAX, i64::MIN, 100), 0.0);
    }
}
