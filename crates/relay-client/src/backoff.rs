//! Exponential backoff with jitter, reset after a healthy period.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Backoff settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// First delay.
    pub initial: Duration,
    /// Largest delay.
    pub max: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self { initial: Duration::from_millis(250), max: Duration::from_secs(30) }
    }
}

/// Produces delays `d/2 + rand(0..=d/2)` where `d` doubles from `initial` up to `max`, so
/// replicas that lost the same relay do not reconnect in lockstep, yet never wait less
/// than half the nominal delay.
#[derive(Debug, Clone)]
pub struct Backoff {
    cfg: BackoffConfig,
    attempt: u32,
    rng: SmallRng,
}

impl Backoff {
    /// A backoff with its own randomly seeded jitter.
    #[must_use]
    pub fn new(cfg: BackoffConfig) -> Self {
        Self { cfg, attempt: 0, rng: SmallRng::from_rng(&mut rand::rng()) }
    }

    /// A deterministic backoff, for tests.
    #[must_use]
    pub fn with_seed(cfg: BackoffConfig, seed: u64) -> Self {
        Self { cfg, attempt: 0, rng: SmallRng::seed_from_u64(seed) }
    }

    /// The nominal (un-jittered) delay of the next attempt.
    #[must_use]
    pub fn nominal(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.cfg.initial.saturating_mul(factor).min(self.cfg.max)
    }

    /// The next delay; each call doubles the nominal delay up to the maximum.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.nominal();
        self.attempt = self.attempt.saturating_add(1);
        let half = d / 2;
        let span = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        half + Duration::from_nanos(self.rng.random_range(0..=span))
    }

    /// Failed attempts since the last reset.
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Back to the initial delay (after a healthy connection).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_caps_jitters_and_resets() {
        let cfg = BackoffConfig { initial: Duration::from_millis(100), max: Duration::from_secs(1) };
        let mut b = Backoff::with_seed(cfg, 7);
        let nominal = [100, 200, 400, 800, 1000, 1000];
        for n in nominal {
            let d = b.next_delay();
            let n = Duration::from_millis(n);
            assert!(d >= n / 2 && d <= n, "{d:?} not in [{:?}, {n:?}]", n / 2);
        }
        b.reset();
        assert_eq!(b.nominal(), Duration::from_millis(100));
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20 {
            b.reset();
            seen.insert(b.next_delay());
        }
        assert!(seen.len() > 10, "jitter should vary delays: {seen:?}");
    }
}
