//! Hosts a rate limit parked. A PDS that answered 429 (or said it has no requests left in
//! its window) is asked nothing until its wait is over, whichever repo is due: the other
//! repos it hosts wait with it, and repos of other hosts go on. Without it, a backfill
//! of a large PDS's repos would be answered 429 once per repo, each request counting
//! against the same per-IP budget.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a host is parked when it said only that it is out of requests.
pub const DEFAULT_PARK: Duration = Duration::from_mins(1);

/// Hosts parked by their rate limits, until when (shared by every fetch of a process).
#[derive(Debug, Default)]
pub struct Hosts {
    parked: Mutex<HashMap<String, Instant>>,
}

impl Hosts {
    /// Parks `host` for `wait` (a later park wins; an earlier one never shortens it).
    pub fn park(&self, host: &str, wait: Duration) {
        let until = Instant::now() + wait;
        if let Ok(mut p) = self.parked.lock() {
            let e = p.entry(host.to_owned()).or_insert(until);
            *e = (*e).max(until);
            // Forget hosts whose wait is over, so the map does not grow with the network.
            if p.len() > 4096 {
                let now = Instant::now();
                p.retain(|_, t| *t > now);
            }
        }
    }

    /// How many hosts are parked now (a gauge's value).
    #[must_use]
    pub fn parked_now(&self) -> usize {
        let now = Instant::now();
        self.parked.lock().map_or(0, |p| p.values().filter(|t| **t > now).count())
    }

    /// How long `host` stays parked, if it is.
    #[must_use]
    pub fn parked(&self, host: &str) -> Option<Duration> {
        let until = *self.parked.lock().ok()?.get(host)?;
        until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())
    }
}

/// The key a URL's host is parked under: `host:port`.
#[must_use]
pub fn key(url: &url::Url) -> String {
    format!("{}:{}", url.host_str().unwrap_or(""), url.port_or_known_default().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_host_waits_and_a_shorter_park_does_not_shorten_it() {
        let h = Hosts::default();
        assert_eq!(h.parked("pds:443"), None);
        h.park("pds:443", Duration::from_mins(10));
        h.park("pds:443", Duration::from_secs(1));
        assert!(h.parked("pds:443").is_some_and(|d| d > Duration::from_mins(9)));
        assert_eq!(h.parked("other:443"), None, "other hosts go on");
        assert_eq!(h.parked_now(), 1);
        h.park("soon:443", Duration::ZERO);
        assert_eq!(h.parked("soon:443"), None);
        let u = url::Url::parse("https://pds.example/xrpc/x").expect("url");
        assert_eq!(key(&u), "pds.example:443");
    }
}
