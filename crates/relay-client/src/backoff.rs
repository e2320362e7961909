//! Exponential backoff with jitter, reset after a healthy period.

use std::time::Duration;

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
    rng: u64,
}

impl Backoff {
    /// A backoff seeded from the clock and the address of a stack value.
    #[must_use]
    pub fn new(cfg: BackoffConfig) -> Self {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let local = 0u8;
        Self::with_seed(cfg, t ^ (std::ptr::addr_of!(local) as u64).rotate_left(32))
    }

    /// A deterministic backoff, for tests.
    #[must_use]
    pub fn with_seed(cfg: BackoffConfig, seed: u64) -> Self {
        Self { cfg, attempt: 0, rng: seed | 1 }
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
        // xorshift64*: plenty for jitter.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let half = d / 2;
        let span = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).saturating_add(1);
        half + Duration::from_nanos(r % span)
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
