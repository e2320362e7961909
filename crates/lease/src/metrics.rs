//! Every metric this crate emits, defined once: the name, its kind, its help text and
//! the label set it is first registered with (so dashboards see it at zero).

/// Counter, gauge or histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up.
    Counter,
    /// Set to a value.
    Gauge,
    /// A distribution.
    Histogram,
}

/// One metric definition.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// The Prometheus name.
    pub name: &'static str,
    /// Its kind.
    pub kind: MetricKind,
    /// The help text.
    pub help: &'static str,
    /// Labels it is registered with at zero (counters only).
    pub labels: &'static [(&'static str, &'static str)],
}

/// Describes every metric of `defs` and registers counters and gauges at zero, so they
/// appear on `/metrics` before their first event.
pub fn register(defs: &[Metric]) {
    for m in defs {
        match m.kind {
            MetricKind::Counter => {
                metrics::describe_counter!(m.name, m.help);
                let labels: Vec<metrics::Label> = m.labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)).collect();
                metrics::counter!(m.name, labels).increment(0);
            }
            MetricKind::Gauge => {
                metrics::describe_gauge!(m.name, m.help);
                let labels: Vec<metrics::Label> = m.labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)).collect();
                metrics::gauge!(m.name, labels).set(0.0);
            }
            MetricKind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

/// Lease role changes, by target role and reason.
pub const TRANSITIONS: &str = "firekeeper_lease_transitions_total";
/// Lease renewal round trips.
pub const RENEW_SECONDS: &str = "firekeeper_lease_renew_seconds";
/// Vanished lease keys retaken with the same token.
pub const RETAKES: &str = "firekeeper_lease_retakes_total";
/// Failed renewals.
pub const RENEW_ERRORS: &str = "firekeeper_lease_renew_errors_total";
/// Lease keys this process released after losing their term (a late renewal).
pub const STALE_RELEASES: &str = "firekeeper_lease_stale_releases_total";

/// Failed calls to the lease store while standing by, by kind.
pub const STORE_ERRORS: &str = "firekeeper_lease_store_errors_total";

/// The lease's metrics.
pub const ALL: &[Metric] = &[
    Metric {
        name: TRANSITIONS,
        kind: MetricKind::Counter,
        help: "lease role changes",
        labels: &[("to", "standby"), ("reason", "start")],
    },
    Metric {
        name: RENEW_ERRORS,
        kind: MetricKind::Counter,
        help: "failed lease renewals",
        labels: &[("reason", "timeout")],
    },
    Metric {
        name: RETAKES,
        kind: MetricKind::Counter,
        help: "vanished lease keys retaken with the same token",
        labels: &[],
    },
    Metric {
        name: STALE_RELEASES,
        kind: MetricKind::Counter,
        help: "lease keys released by the process they named after it lost their term (a renewal that landed late)",
        labels: &[],
    },
    Metric {
        name: STORE_ERRORS,
        kind: MetricKind::Counter,
        help: "failed calls to the lease store while standing by (down, credentials refused, nonsense), by kind",
        labels: &[("kind", "unavailable")],
    },
    Metric { name: RENEW_SECONDS, kind: MetricKind::Histogram, help: "lease renewal round trips", labels: &[] },
];
