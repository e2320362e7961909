//! Lease timing, validated as a whole so every bad value is reported at once.

use std::time::Duration;

/// Lease timing. See the crate docs for how the numbers relate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// How long the lease key lives on the server without a renewal.
    pub ttl: Duration,
    /// How often the leader renews.
    pub renew_every: Duration,
    /// Hard timeout of every backend call.
    pub op_timeout: Duration,
    /// Safety margin: the leader stops acting this long before the server could expire
    /// the key, to absorb clock-rate differences and scheduling delays.
    pub margin: Duration,
    /// How often a standby tries to acquire (it also wakes on a release message).
    pub poll: Duration,
    /// Prefix of every key; keys are `{<prefix>}:…`, one hash tag for Redis Cluster.
    pub key_prefix: String,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(10),
            renew_every: Duration::from_secs(2),
            op_timeout: Duration::from_secs(1),
            margin: Duration::from_millis(2500),
            poll: Duration::from_secs(1),
            key_prefix: "firekeeper".to_owned(),
        }
    }
}

/// Every problem found in a [`LeaseConfig`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid lease configuration: {}", .problems.join("; "))]
pub struct ConfigError {
    /// One line per problem, naming the setting.
    pub problems: Vec<String>,
}

impl LeaseConfig {
    /// Timings derived from a ttl (the chaos suites run these at ttl 2 s): renew every ttl/5,
    /// margin ttl/4 (at least 100 ms), op timeout clamp(ttl/8, 100 ms, 5 s).
    #[must_use]
    pub fn from_ttl(ttl: Duration) -> Self {
        Self {
            ttl,
            renew_every: ttl / 5,
            op_timeout: (ttl / 8).clamp(Duration::from_millis(100), Duration::from_secs(5)),
            margin: (ttl / 4).max(Duration::from_millis(100)),
            ..Self::default()
        }
    }

    /// The window after a renewal's send time during which the leader may act.
    #[must_use]
    pub fn window(&self) -> Duration {
        self.ttl.saturating_sub(self.margin)
    }

    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Vec::new();
        if self.ttl < Duration::from_millis(100) {
            p.push(format!("ttl {:?} is below 100ms", self.ttl));
        }
        if self.margin.is_zero() || self.margin >= self.ttl {
            p.push(format!("margin {:?} must be above zero and below ttl {:?}", self.margin, self.ttl));
        }
        if self.op_timeout.is_zero() {
            p.push("op timeout must be above zero".to_owned());
        }
        if self.renew_every.is_zero() {
            p.push("renew interval must be above zero".to_owned());
        } else if self.renew_every + self.op_timeout >= self.window() {
            p.push(format!(
                "renew interval {:?} + op timeout {:?} must be below ttl - margin {:?}, or one slow renewal loses the lease",
                self.renew_every,
                self.op_timeout,
                self.window()
            ));
        }
        if self.poll.is_zero() {
            p.push("poll interval must be above zero".to_owned());
        }
        let prefix_ok = !self.key_prefix.is_empty()
            && self.key_prefix.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
        if !prefix_ok {
            p.push(format!("key prefix {:?} must be non-empty [A-Za-z0-9-_.:]", self.key_prefix));
        }
        if p.is_empty() { Ok(()) } else { Err(ConfigError { problems: p }) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_all_named() {
        assert!(LeaseConfig::default().validate().is_ok());
        assert!(LeaseConfig::from_ttl(Duration::from_secs(5)).validate().is_ok());
        let bad = LeaseConfig {
            ttl: Duration::from_millis(50),
            margin: Duration::ZERO,
            op_timeout: Duration::ZERO,
            poll: Duration::ZERO,
            key_prefix: "a b".into(),
            ..LeaseConfig::default()
        };
        let e = bad.validate().expect_err("invalid");
        assert_eq!(e.problems.len(), 6, "{e}");
        let slow = LeaseConfig { renew_every: Duration::from_secs(7), ..LeaseConfig::default() };
        assert!(slow.validate().expect_err("slow").to_string().contains("renew interval"));
    }
}
