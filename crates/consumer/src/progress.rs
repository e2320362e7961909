//! Repo sync progress a person can watch: what the queue holds, what was done, the rates
//! of the last minute and an ETA (`/status`, the summary line).

use std::sync::Mutex;

use serde::Serialize;

/// Seconds the rates are measured over.
const WINDOW: u64 = 60;

/// Work done in one second.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    sec: u64,
    repos: u64,
    records: u64,
    bytes: u64,
}

#[derive(Debug)]
struct Ring {
    buckets: [Bucket; WINDOW as usize],
    /// Totals since the process started.
    total: Bucket,
    /// The second the current run of work began (after a minute or more without any).
    since: u64,
    /// The second of the last work done.
    last: u64,
}

impl Default for Ring {
    fn default() -> Self {
        Self { buckets: [Bucket::default(); WINDOW as usize], total: Bucket::default(), since: 0, last: 0 }
    }
}

/// Resyncs done, per second over the last minute: O(1) per repo, no allocation.
#[derive(Debug, Default)]
pub(crate) struct Meter(Mutex<Ring>);

/// Rates over the last minute (or since the work began, when that is sooner).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Rates {
    /// Repos resynchronised per second.
    pub repos_per_second: f64,
    /// Records delivered in snapshots per second.
    pub records_per_second: f64,
    /// Bytes of repos fetched per second.
    pub bytes_per_second: f64,
}

impl Meter {
    /// Counts one repo resynchronised at `now_s` (Unix seconds) with its records and bytes.
    pub(crate) fn add(&self, now_s: u64, records: u64, bytes: u64) {
        let Ok(mut r) = self.0.lock() else { return };
        if r.total.repos == 0 || now_s >= r.last + WINDOW {
            r.since = now_s;
        }
        r.last = r.last.max(now_s);
        let b = &mut r.buckets[(now_s % WINDOW) as usize];
        if b.sec != now_s {
            *b = Bucket { sec: now_s, ..Bucket::default() };
        }
        b.repos += 1;
        b.records += records;
        b.bytes += bytes;
        r.total.repos += 1;
        r.total.records += records;
        r.total.bytes += bytes;
    }

    /// The totals since the process started: repos, records, bytes.
    pub(crate) fn totals(&self) -> (u64, u64, u64) {
        self.0.lock().map_or((0, 0, 0), |r| (r.total.repos, r.total.records, r.total.bytes))
    }

    /// The rates at `now_s`: what the buckets of the last minute hold, over the seconds
    /// since the work began when that is less than a minute.
    pub(crate) fn rates(&self, now_s: u64) -> Rates {
        let Ok(r) = self.0.lock() else { return Rates::default() };
        let from = now_s.saturating_sub(WINDOW - 1);
        let mut sum = Bucket::default();
        for b in r.buckets.iter().filter(|b| b.sec >= from && b.sec <= now_s && b.repos > 0) {
            sum.repos += b.repos;
            sum.records += b.records;
            sum.bytes += b.bytes;
        }
        if sum.repos == 0 {
            return Rates::default();
        }
        let secs = (now_s.saturating_sub(r.since.max(from)) + 1) as f64;
        Rates {
            repos_per_second: sum.repos as f64 / secs,
            records_per_second: sum.records as f64 / secs,
            bytes_per_second: sum.bytes as f64 / secs,
        }
    }
}

/// Where a backfill stands.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Backfill {
    /// Repos of the DID list queued so far.
    pub listed_queued: usize,
    /// Repos in the DID list.
    pub listed: usize,
    /// The host's listing: `listing` (pages still to come), `done`, or `off`.
    pub listing: &'static str,
}

/// Repo sync as a person watches it (`/status`'s `repo_sync`, the summary line).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Progress {
    /// Repos queued (desynchronised, waiting for their turn or their retry).
    pub queued: usize,
    /// Downloads in flight.
    pub in_flight: usize,
    /// Repos resynchronised since this process started.
    pub done: u64,
    /// Repos whose resync failed every attempt (until an operator queues them again).
    pub failed: usize,
    /// Repos their PDS says are gone (until an event of them).
    pub gone: usize,
    /// Records delivered in snapshots since this process started.
    pub records: u64,
    /// Bytes of repos fetched since this process started.
    pub bytes: u64,
    /// The rates of the last minute.
    #[serde(flatten)]
    pub rates: Rates,
    /// The backfill, when one is set.
    pub backfill: Option<Backfill>,
    /// Seconds until the queue (and the rest of the DID list) is worked at the last
    /// minute's rate; `None` with no rate yet or nothing left.
    pub eta_seconds: Option<u64>,
    /// The ETA leaves out the pages of the host's listing still to come.
    pub eta_is_a_lower_bound: bool,
}

impl Progress {
    /// Repos still to do: queued, in flight and the rest of the DID list.
    #[must_use]
    pub fn remaining(&self) -> usize {
        let list = self.backfill.as_ref().map_or(0, |b| b.listed - b.listed_queued.min(b.listed));
        self.queued + self.in_flight + list
    }

    /// Fills in the ETA from the rates and what remains.
    pub(crate) fn estimate(mut self) -> Self {
        let left = self.remaining();
        self.eta_is_a_lower_bound = self.backfill.as_ref().is_some_and(|b| b.listing == "listing");
        #[allow(clippy::cast_sign_loss, clippy::cast_possible_truncation)] // positive, far below 2^64
        let eta = (left > 0 && self.rates.repos_per_second > 0.0)
            .then(|| (left as f64 / self.rates.repos_per_second).ceil() as u64);
        self.eta_seconds = eta;
        self
    }

    /// Reads what `/status` shows as `repo_sync` (for `firekeeper repos progress`); `None`
    /// for anything else.
    #[must_use]
    pub fn from_json(v: &serde_json::Value) -> Option<Self> {
        let n = |k: &str| v[k].as_u64();
        let count = |k: &str| n(k).and_then(|x| usize::try_from(x).ok());
        let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
        let b = &v["backfill"];
        let backfill = b.is_object().then(|| Backfill {
            listed_queued: b["listed_queued"].as_u64().and_then(|x| usize::try_from(x).ok()).unwrap_or(0),
            listed: b["listed"].as_u64().and_then(|x| usize::try_from(x).ok()).unwrap_or(0),
            listing: match b["listing"].as_str() {
                Some("listing") => "listing",
                Some("done") => "done",
                _ => "off",
            },
        });
        Some(Self {
            queued: count("queued")?,
            in_flight: count("in_flight")?,
            done: n("done")?,
            failed: count("failed").unwrap_or(0),
            gone: count("gone").unwrap_or(0),
            records: n("records").unwrap_or(0),
            bytes: n("bytes").unwrap_or(0),
            rates: Rates {
                repos_per_second: f("repos_per_second"),
                records_per_second: f("records_per_second"),
                bytes_per_second: f("bytes_per_second"),
            },
            backfill,
            eta_seconds: n("eta_seconds"),
            eta_is_a_lower_bound: v["eta_is_a_lower_bound"].as_bool().unwrap_or(false),
        })
    }

    /// True when there is something to show: work left, or work done in the last minute.
    #[must_use]
    pub fn is_active(&self) -> bool {
        self.remaining() > 0 || self.rates.repos_per_second > 0.0 || self.eta_is_a_lower_bound
    }

    /// One line for a person: `12 queued, 4 in flight, 3,200 done (2 failed, 1 gone) ·
    /// 310 repos/s, 9.1 k records/s, 12.3 MB/s · ETA 3 min`.
    #[must_use]
    pub fn line(&self) -> String {
        use std::fmt::Write as _;
        let mut out = format!("{} queued, {} in flight, {} done", self.queued, self.in_flight, self.done);
        if self.failed + self.gone > 0 {
            let _ = write!(out, " ({} failed, {} gone)", self.failed, self.gone);
        }
        let r = &self.rates;
        let _ = write!(
            out,
            " · {} repos/s, {} records/s, {}B/s",
            si(r.repos_per_second).trim_end(),
            si(r.records_per_second).trim_end(),
            si(r.bytes_per_second)
        );
        if let Some(b) = &self.backfill {
            if b.listed > 0 {
                let _ = write!(out, " · backfill list {}/{}", b.listed_queued.min(b.listed), b.listed);
            }
            if b.listing != "off" {
                let _ = write!(out, " · host listing {}", b.listing);
            }
        }
        let bound = if self.eta_is_a_lower_bound { "≥ " } else { "" };
        match self.eta_seconds {
            Some(s) => {
                let _ = write!(out, " · ETA {bound}{}", duration(s));
            }
            None if self.remaining() > 0 => out.push_str(" · ETA -"),
            None => {}
        }
        out
    }
}

/// `950 `, `9.1 k`, `12.3 M` (a unit follows: `9.1 kB`, `950 B`).
fn si(v: f64) -> String {
    match v {
        v if v >= 1e9 => format!("{:.1} G", v / 1e9),
        v if v >= 1e6 => format!("{:.1} M", v / 1e6),
        v if v >= 1e3 => format!("{:.1} k", v / 1e3),
        v if v >= 10.0 || v == 0.0 => format!("{v:.0} "),
        v => format!("{v:.1} "),
    }
}

/// `45 s`, `3 min`, `2 h 05 min`, `3 d 4 h`.
fn duration(s: u64) -> String {
    match s {
        s if s < 100 => format!("{s} s"),
        s if s < 3_600 => format!("{} min", s.div_ceil(60)),
        s if s < 86_400 => format!("{} h {:02} min", s / 3_600, (s % 3_600) / 60),
        s => format!("{} d {} h", s / 86_400, (s % 86_400) / 3_600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rate is what the last minute did, over the seconds the work has run when that
    /// is less; work older than a minute no longer counts; a pause of a minute starts
    /// the count over.
    #[test]
    fn the_rates_cover_the_last_minute_of_work() {
        let m = Meter::default();
        assert_eq!(m.rates(1_000), Rates::default());
        for s in 1_000..1_010 {
            for _ in 0..5 {
                m.add(s, 100, 1_000);
            }
        }
        let r = m.rates(1_009);
        assert!((r.repos_per_second - 5.0).abs() < 1e-9, "{r:?}");
        assert!((r.records_per_second - 500.0).abs() < 1e-9, "{r:?}");
        // Thirty quiet seconds later the ten seconds of work spread over forty.
        let r = m.rates(1_039);
        assert!((r.repos_per_second - 50.0 / 40.0).abs() < 1e-9, "{r:?}");
        // A minute after the last work, nothing.
        assert_eq!(m.rates(1_070), Rates::default());
        // Work again after the pause: measured from its start, not the old one.
        m.add(2_000, 1, 10);
        m.add(2_001, 1, 10);
        let r = m.rates(2_001);
        assert!((r.repos_per_second - 1.0).abs() < 1e-9, "{r:?}");
        assert_eq!(m.totals(), (52, 5_002, 50_020));
        // A bucket reused a minute later holds only its new second.
        m.add(2_060, 7, 7);
        let r = m.rates(2_060);
        assert!((r.repos_per_second - 2.0 / 60.0).abs() < 1e-9, "{r:?}");
    }

    /// The ETA is what remains over the rate; the listing still to come makes it a lower
    /// bound; nothing left or no rate: none.
    #[test]
    fn the_eta_is_what_remains_over_the_rate() {
        let p = Progress {
            queued: 90,
            in_flight: 10,
            rates: Rates { repos_per_second: 4.0, ..Rates::default() },
            backfill: Some(Backfill { listed_queued: 100, listed: 300, listing: "off" }),
            ..Progress::default()
        }
        .estimate();
        assert_eq!(p.remaining(), 300);
        assert_eq!(p.eta_seconds, Some(75));
        assert!(!p.eta_is_a_lower_bound);
        assert!(p.line().contains("ETA 75 s") && p.line().contains("backfill list 100/300"), "{}", p.line());
        let listing = Progress { backfill: Some(Backfill { listing: "listing", ..Backfill::default() }), ..p.clone() };
        let listing = listing.estimate();
        assert!(listing.eta_is_a_lower_bound && listing.line().contains("ETA ≥ 25 s"), "{}", listing.line());
        let idle = Progress { queued: 3, ..Progress::default() }.estimate();
        assert_eq!(idle.eta_seconds, None);
        assert!(idle.line().ends_with("ETA -"), "{}", idle.line());
        assert!(!Progress::default().estimate().is_active());
        assert_eq!(duration(7_500), "2 h 05 min");
        assert_eq!(si(9_100.0), "9.1 k");
        assert_eq!(si(950.0), "950 ");
    }
}
