//! Capacity search: the highest open-loop lookup rate whose p99 stays within a budget with an
//! acceptable error rate.
//!
//! The search itself is a pure state machine ([`Search`]): it proposes a rate, is told the step's
//! outcome, and proposes the next one. Exponential growth from `start_rate` until a step fails
//! (or `max_rate`), then bisection between the best passing and the lowest failing rate until
//! they are within `tolerance`. If even the first step fails it backs off geometrically. Every
//! search ends after at most `max_steps` steps. Keeping the logic free of I/O lets tests run it
//! against simulated latency curves.

use serde::Serialize;
use std::fmt;

use crate::error::ConfigError;

/// Search parameters.
#[derive(Clone, Debug, Serialize)]
pub struct SearchConfig {
    /// A step passes only if LookupRoute p99 ≤ this (ms).
    pub p99_budget_ms: f64,
    /// ... and failed lookups / completed lookups ≤ this.
    pub max_error_rate: f64,
    /// ... and achieved rate ≥ this share of the target (the client kept up).
    pub min_achieved_share: f64,
    /// First rate tried.
    pub start_rate: f64,
    /// Upper bound on tried rates.
    pub max_rate: f64,
    /// Lower bound: below it the search gives up with no result.
    pub min_rate: f64,
    /// Growth factor of the exponential phase (and back-off factor when the first step fails).
    pub growth: f64,
    /// Bisection stops when `(hi - lo) / hi ≤ tolerance`.
    pub tolerance: f64,
    /// Hard cap on steps.
    pub max_steps: u32,
}

impl SearchConfig {
    /// Rejects parameters that would not terminate sensibly.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let pos = |v: f64| v.is_finite() && v > 0.0;
        if !pos(self.p99_budget_ms) {
            return Err(ConfigError::NotPositive("--p99-budget-ms"));
        }
        if !(0.0..=1.0).contains(&self.max_error_rate) {
            return Err(ConfigError::OutOfRange {
                flag: "--max-error-rate",
                range: "0..=1",
            });
        }
        if !(0.0..=1.0).contains(&self.min_achieved_share) {
            return Err(ConfigError::OutOfRange {
                flag: "--min-achieved-share",
                range: "0..=1",
            });
        }
        if !(pos(self.start_rate) && pos(self.max_rate) && pos(self.min_rate)) {
            return Err(ConfigError::Rule("rates must be > 0"));
        }
        if self.min_rate > self.start_rate || self.start_rate > self.max_rate {
            return Err(ConfigError::Rule(
                "need --min-rate <= --start-rate <= --max-rate",
            ));
        }
        if !(self.growth.is_finite() && self.growth > 1.0) {
            return Err(ConfigError::Rule("--growth must be > 1"));
        }
        if !(self.tolerance > 0.0 && self.tolerance < 1.0) {
            return Err(ConfigError::OutOfRange {
                flag: "--tolerance",
                range: "(0, 1)",
            });
        }
        if self.max_steps == 0 {
            return Err(ConfigError::NotPositive("--max-steps"));
        }
        Ok(())
    }
}

/// What one step measured.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct Measurement {
    /// Achieved lookups per second.
    pub achieved_rate: f64,
    /// LookupRoute p99, ms.
    pub p99_ms: f64,
    /// Failed / completed lookups.
    pub error_rate: f64,
}

/// One step: the rate tried, what was measured, and the verdict.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Step {
    /// Target rate of the step.
    pub rate: f64,
    /// Measurement.
    #[serde(flatten)]
    pub measured: Measurement,
    /// Whether the step met every criterion.
    pub pass: bool,
    /// Why it failed (empty when it passed).
    pub reason: String,
}

/// The search's answer.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Outcome {
    /// Highest passing rate (None if no step passed).
    pub capacity_rate: Option<f64>,
    /// Lowest failing rate seen (None if none failed).
    pub first_failing_rate: Option<f64>,
    /// Every step in order.
    pub steps: Vec<Step>,
    /// Why the search stopped.
    pub stopped: String,
}

/// Judges a measurement against the criteria.
pub fn judge(cfg: &SearchConfig, rate: f64, m: Measurement) -> Step {
    let mut why = Vec::new();
    // NaN latencies fail too (a measurement that cannot be compared is not a pass).
    let within = m
        .p99_ms
        .partial_cmp(&cfg.p99_budget_ms)
        .is_some_and(|o| o.is_le());
    if !within {
        why.push(format!(
            "p99 {:.3} ms > {:.3} ms",
            m.p99_ms, cfg.p99_budget_ms
        ));
    }
    if m.error_rate > cfg.max_error_rate {
        why.push(format!(
            "error rate {:.4} > {:.4}",
            m.error_rate, cfg.max_error_rate
        ));
    }
    if m.achieved_rate < cfg.min_achieved_share * rate {
        why.push(format!(
            "achieved {:.1} < {:.0}% of {:.1}",
            m.achieved_rate,
            cfg.min_achieved_share * 100.0,
            rate
        ));
    }
    Step {
        rate,
        measured: m,
        pass: why.is_empty(),
        reason: why.join("; "),
    }
}

/// Why the search proposes no further rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StopReason {
    /// `max_steps` steps were run.
    MaxSteps(u32),
    /// The step at `max_rate` passed: nothing higher may be tried.
    MaxRatePassed(f64),
    /// Backing off from the first failing step would go below `min_rate`.
    NothingAboveMinRate(f64),
    /// The best passing and lowest failing rates are within `tolerance` (a fraction).
    Converged(f64),
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::MaxSteps(n) => write!(f, "max steps ({n}) reached"),
            StopReason::MaxRatePassed(r) => write!(f, "max rate {r} passed"),
            StopReason::NothingAboveMinRate(r) => write!(f, "no rate >= min rate {r} passed"),
            StopReason::Converged(t) => write!(f, "converged within {:.1}%", t * 100.0),
        }
    }
}

/// The search state machine.
#[derive(Clone, Debug)]
pub struct Search {
    cfg: SearchConfig,
    steps: Vec<Step>,
    /// Highest passing rate.
    lo: Option<f64>,
    /// Lowest failing rate.
    hi: Option<f64>,
    stopped: Option<StopReason>,
}

impl Search {
    /// A fresh search.
    pub fn new(cfg: SearchConfig) -> Self {
        Search {
            cfg,
            steps: Vec::new(),
            lo: None,
            hi: None,
            stopped: None,
        }
    }

    /// The criteria.
    pub fn config(&self) -> &SearchConfig {
        &self.cfg
    }

    /// The next rate to try, or None when the search is over.
    pub fn next_rate(&mut self) -> Option<f64> {
        if self.stopped.is_some() {
            return None;
        }
        let next = self.propose();
        if let Err(why) = next {
            self.stopped = Some(why);
        }
        next.ok()
    }

    fn propose(&self) -> Result<f64, StopReason> {
        let c = &self.cfg;
        if self.steps.len() as u32 >= c.max_steps {
            return Err(StopReason::MaxSteps(c.max_steps));
        }
        match (self.lo, self.hi) {
            (None, None) => Ok(c.start_rate),
            (Some(lo), None) => {
                if lo >= c.max_rate {
                    Err(StopReason::MaxRatePassed(c.max_rate))
                } else {
                    Ok((lo * c.growth).min(c.max_rate))
                }
            }
            (None, Some(hi)) => {
                let next = hi / c.growth;
                if next < c.min_rate {
                    Err(StopReason::NothingAboveMinRate(c.min_rate))
                } else {
                    Ok(next)
                }
            }
            (Some(lo), Some(hi)) => {
                if (hi - lo) / hi <= c.tolerance {
                    Err(StopReason::Converged(c.tolerance))
                } else {
                    Ok((lo + hi) / 2.0)
                }
            }
        }
    }

    /// Feeds the measurement of the step at `rate`; returns the judged step.
    pub fn observe(&mut self, rate: f64, m: Measurement) -> Step {
        let step = judge(&self.cfg, rate, m);
        if step.pass {
            self.lo = Some(self.lo.map_or(rate, |l| l.max(rate)));
        } else {
            self.hi = Some(self.hi.map_or(rate, |h| h.min(rate)));
        }
        self.steps.push(step.clone());
        step
    }

    /// The answer so far.
    pub fn outcome(&self) -> Outcome {
        Outcome {
            capacity_rate: self.lo,
            first_failing_rate: self.hi,
            steps: self.steps.clone(),
            stopped: self
                .stopped
                .map_or_else(|| "interrupted".into(), |why| why.to_string()),
        }
    }
}

/// Runs a whole search against a synchronous measurement function (tests, simulations).
pub fn search_with(cfg: SearchConfig, mut measure: impl FnMut(f64) -> Measurement) -> Outcome {
    let mut s = Search::new(cfg);
    while let Some(rate) = s.next_rate() {
        let m = measure(rate);
        s.observe(rate, m);
    }
    s.outcome()
}
