//! Every metric the consumer emits, defined once (name, kind, help, first labels).

pub use lease::metrics::{Metric, MetricKind, register};

/// Events handed to the handler, by type.
pub const EVENTS: &str = "firekeeper_events_total";
/// Cursor commits, by outcome.
pub const COMMITS: &str = "firekeeper_commits_total";
/// Relay connections that ended, by relay and reason.
pub const RECONNECTS: &str = "firekeeper_reconnects_total";
/// Relay switches, by target and kind.
pub const RELAY_SWITCHES: &str = "firekeeper_relay_switches_total";
/// Error frames from the relay, by error name.
pub const ERROR_FRAMES: &str = "firekeeper_error_frames_total";
/// Undecodable frames, by reason and action.
pub const BAD_FRAMES: &str = "firekeeper_bad_frames_total";
/// Gaps accepted in the stream, by reason.
pub const GAPS: &str = "firekeeper_gaps_total";
/// Times the relay's seq went backwards.
pub const SEQ_BACKWARDS: &str = "firekeeper_seq_backwards_total";
/// `OutdatedCursor` notices.
pub const OUTDATED_CURSOR: &str = "firekeeper_outdated_cursor_total";
/// Records rendered as null because they could not be decoded.
pub const RECORD_ERRORS: &str = "firekeeper_record_errors_total";
/// Failed handler writes (retried).
pub const SINK_ERRORS: &str = "firekeeper_sink_errors_total";
/// Events the sink refused for their content (handed over as `#invalid` or stopped).
pub const UNSTORABLE: &str = "firekeeper_sink_unstorable_total";
/// 1 while this replica leads.
pub const LEADER: &str = "firekeeper_leader";
/// Age of the newest delivered event.
pub const LAG_SECONDS: &str = "firekeeper_lag_seconds";
/// Delivered minus committed seq: what a crash now would deliver again.
pub const UNCOMMITTED_SEQ: &str = "firekeeper_uncommitted_seq";
/// The leader's committed cursor (seq) on the relay it consumes.
pub const COMMITTED_SEQ: &str = "firekeeper_committed_seq";
/// 1 while the leader's relay connection is up.
pub const RELAY_CONNECTED: &str = "firekeeper_relay_connected";
/// 1, labelled with the running version.
pub const BUILD_INFO: &str = "firekeeper_build_info";
/// 1 while this replica's settings differ from those the deployment's latest leader
/// wrote beside the lease (it does not take over unless a change is allowed).
pub const SETTINGS_DIFFER: &str = "firekeeper_settings_differ";
/// Events delivered and not yet done.
pub const QUEUE_DEPTH: &str = "firekeeper_queue_depth";
/// 1 while the leader consumes from the secondary relay.
pub const ON_SECONDARY: &str = "firekeeper_relay_on_secondary";
/// Events dropped after a relay switch because they were already handed over.
pub const SWITCH_DUPLICATES: &str = "firekeeper_switch_duplicates_dropped_total";
/// Probes made to find the start on a relay switched to.
pub const SWITCH_PROBES: &str = "firekeeper_switch_probes_total";
/// Relay switches refused (the target does not serve back to the committed position,
/// or could not be probed): the leader stays on the relay it had.
pub const SWITCH_REFUSED: &str = "firekeeper_switch_refused_total";
/// 1 while a refused switch holds the leader on a relay that does not answer.
pub const SWITCH_REFUSED_NOW: &str = "firekeeper_switch_refused";
/// Switches whose target served less than the whole overlap, but back past the position.
pub const SWITCH_OVERLAP_SHORT: &str = "firekeeper_switch_overlap_short_total";
/// Commits whose `since` was not the last rev seen for their repo (a commit was skipped).
pub const CHAIN_BREAKS: &str = "firekeeper_repo_chain_breaks_total";
/// Repos the chain check remembers.
pub const CHAIN_REPOS: &str = "firekeeper_repo_chain_repos";

/// Events that passed verification, by type.
pub const VERIFIED: &str = "firekeeper_verified_total";
/// Events that failed verification (handed over as `#invalid`), by reason.
pub const INVALID: &str = "firekeeper_invalid_total";
/// Commits the full tier could not prove by MST inversion (delivered).
pub const UNPROVEN: &str = "firekeeper_verify_unproven_total";
/// Signature failures that made the repo's DID be resolved again.
pub const KEY_REFRESHES: &str = "firekeeper_verify_key_refreshes_total";
/// Repos marked desynchronised (an invalid event, a chain break): the resync queue.
pub const DESYNC_REPOS: &str = "firekeeper_repos_desynchronized";
/// Events held because their DID does not resolve now.
pub const VERIFY_HELD: &str = "firekeeper_verify_held";
/// Repo resyncs from the PDS, by outcome and reason.
pub const RESYNCS: &str = "firekeeper_resyncs_total";
/// Records delivered in resync snapshots.
pub const RESYNC_RECORDS: &str = "firekeeper_resync_records_total";
/// Bytes of repos fetched for resyncs.
pub const RESYNC_BYTES: &str = "firekeeper_resync_bytes_total";
/// Resync downloads in flight.
pub const RESYNC_IN_FLIGHT: &str = "firekeeper_resync_in_flight";
/// How long a resync took, from its fetch to the sink's acknowledgement of its last part.
pub const RESYNC_SECONDS: &str = "firekeeper_resync_duration_seconds";
/// PDSs whose rate limit parked them now.
pub const RESYNC_PARKED_HOSTS: &str = "firekeeper_resync_parked_hosts";
/// The leader's resync queue by state (`desynchronized`, `resyncing`, `gone`, `failed`).
pub const RESYNC_QUEUE: &str = "firekeeper_resync_queue";
/// Shared repo-sync jobs this replica's workers ended, by outcome.
pub const SYNC_JOBS: &str = "firekeeper_sync_jobs_total";
/// Shared repo-sync jobs this replica's workers have claimed and not ended.
pub const SYNC_JOBS_IN_FLIGHT: &str = "firekeeper_sync_jobs_in_flight";
/// Jobs in the shared repo-sync queue, by state (`queued`, `claimed`), as the leader sees it.
pub const SYNC_QUEUE: &str = "firekeeper_sync_queue";
/// Events dropped because a snapshot delivered before them covers them.
pub const RESYNC_COVERED: &str = "firekeeper_resync_covered_total";

const fn counter(name: &'static str, help: &'static str, labels: &'static [(&'static str, &'static str)]) -> Metric {
    Metric { name, kind: MetricKind::Counter, help, labels }
}

const fn gauge(name: &'static str, help: &'static str) -> Metric {
    Metric { name, kind: MetricKind::Gauge, help, labels: &[] }
}

/// The consumer's metrics.
pub const ALL: &[Metric] = &[
    counter(EVENTS, "events handed to the sink, by type", &[("type", "#commit")]),
    counter(COMMITS, "cursor commits, by outcome", &[("outcome", "saved")]),
    counter(RECONNECTS, "relay connections that ended", &[("relay", "primary"), ("reason", "closed_by_relay")]),
    counter(RELAY_SWITCHES, "relay switches", &[("to", "secondary"), ("kind", "failover")]),
    counter(ERROR_FRAMES, "error frames from the relay", &[("error", "ConsumerTooSlow")]),
    counter(BAD_FRAMES, "undecodable frames", &[("reason", "cbor"), ("action", "skipped")]),
    counter(GAPS, "gaps accepted in the stream", &[("reason", "future_cursor")]),
    counter(SEQ_BACKWARDS, "times the relay's seq went backwards", &[]),
    counter(OUTDATED_CURSOR, "OutdatedCursor notices (events were missed)", &[]),
    counter(RECORD_ERRORS, "records that could not be decoded (written as null)", &[]),
    counter(SINK_ERRORS, "failed sink writes (retried)", &[]),
    counter(
        UNSTORABLE,
        "events the sink refused for their content (handed over as #invalid unstorable, or the consumer stopped)",
        &[],
    ),
    counter(SWITCH_DUPLICATES, "events dropped after a relay switch as already handed over", &[]),
    counter(SWITCH_PROBES, "probes made to find where to resume on a relay switched to", &[]),
    counter(SWITCH_REFUSED, "relay switches refused: the target does not reach back to the position", &[]),
    counter(SWITCH_OVERLAP_SHORT, "relay switches whose target served less than the overlap but no gap", &[]),
    counter(CHAIN_BREAKS, "commits whose since was not the last rev seen for the repo", &[]),
    counter(VERIFIED, "events that passed verification, by type", &[("type", "#commit")]),
    counter(
        INVALID,
        "events that failed verification, by reason (handed over as #invalid)",
        &[("reason", "signature")],
    ),
    counter(UNPROVEN, "commits the MST inversion could not prove (delivered; invalid under strict)", &[]),
    counter(KEY_REFRESHES, "signature failures that resolved the repo's DID again", &[]),
    counter(RESYNCS, "repo resyncs from the PDS, by outcome and reason", &[("outcome", "done"), ("reason", "chain")]),
    counter(RESYNC_RECORDS, "records delivered in resync snapshots", &[]),
    counter(RESYNC_BYTES, "bytes of repos fetched for resyncs", &[]),
    counter(RESYNC_COVERED, "events dropped because a resync snapshot delivered before them covers them", &[]),
    counter(
        SYNC_JOBS,
        "shared repo-sync jobs this replica's workers ended, by outcome (done, late, stale, gone, later, failed, invalid, undelivered, dead)",
        &[("outcome", "done")],
    ),
    gauge(SYNC_JOBS_IN_FLIGHT, "shared repo-sync jobs this replica's workers are working"),
    Metric {
        name: SYNC_QUEUE,
        kind: MetricKind::Gauge,
        help: "jobs in the shared repo-sync queue by state (queued, claimed), as the leader sees it; 0 on a standby",
        labels: &[("state", "queued")],
    },
    gauge(LEADER, "1 while this replica leads"),
    gauge(DESYNC_REPOS, "repos marked desynchronised (an invalid event, a broken chain): the resync queue"),
    gauge(VERIFY_HELD, "events held because their DID does not resolve now"),
    gauge(RESYNC_IN_FLIGHT, "repo resync downloads in flight"),
    gauge(RESYNC_PARKED_HOSTS, "PDSs whose rate limit parked them now (their repos wait); 0 on a standby"),
    Metric {
        name: RESYNC_SECONDS,
        kind: MetricKind::Histogram,
        help: "how long a resync took, from its fetch to the sink's acknowledgement of its last part",
        labels: &[],
    },
    Metric {
        name: RESYNC_QUEUE,
        kind: MetricKind::Gauge,
        help: "the leader's resync queue by state (desynchronized, resyncing, gone, failed); 0 on a standby",
        labels: &[("state", "desynchronized")],
    },
    gauge(LAG_SECONDS, "the leader's age of the newest delivered event (relay time to now); 0 on a standby"),
    gauge(
        UNCOMMITTED_SEQ,
        "the leader's delivered minus committed seq (what a crash now would deliver again); 0 on a standby",
    ),
    gauge(COMMITTED_SEQ, "the leader's committed cursor on the relay it consumes; 0 on a standby"),
    gauge(RELAY_CONNECTED, "1 while the leader's relay connection is up"),
    gauge(QUEUE_DEPTH, "events delivered and not yet done"),
    gauge(ON_SECONDARY, "1 while the leader consumes from the secondary relay"),
    gauge(CHAIN_REPOS, "repos the chain check remembers"),
    gauge(SWITCH_REFUSED_NOW, "1 while a refused relay switch holds the leader on its relay"),
    gauge(
        SETTINGS_DIFFER,
        "1 while this replica's settings differ from those the deployment's latest leader wrote (it does not take over)",
    ),
    Metric {
        name: BUILD_INFO,
        kind: MetricKind::Gauge,
        help: "1, labelled with the running version",
        labels: &[("version", env!("CARGO_PKG_VERSION"))],
    },
];

/// Sets [`BUILD_INFO`] to 1 (after [`register`] put every gauge at zero).
pub fn announce_build() {
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// The gauges only a leader's term sets: zeroed when the term ends, so that a standby
/// (an ex-leader) does not keep showing its last lag to a `max()` alert.
pub(crate) const LEADER_GAUGES: &[&str] = &[
    LEADER,
    LAG_SECONDS,
    UNCOMMITTED_SEQ,
    COMMITTED_SEQ,
    RELAY_CONNECTED,
    QUEUE_DEPTH,
    ON_SECONDARY,
    CHAIN_REPOS,
    SWITCH_REFUSED_NOW,
    RESYNC_IN_FLIGHT,
];

/// `firekeeper_events_total`, one handle per type, registered once per term: the
/// per-event increment is then an atomic add, with no registry lookup of name and labels.
pub(crate) struct EventCounters([metrics::Counter; 6]);

impl EventCounters {
    pub(crate) fn new() -> Self {
        use relay_client::Kind;
        Self(
            [Kind::Commit, Kind::Sync, Kind::Identity, Kind::Account, Kind::Info, Kind::Unknown]
                .map(|k| metrics::counter!(EVENTS, "type" => k.as_str())),
        )
    }

    /// Counts one event of kind `k`.
    pub(crate) fn count(&self, k: relay_client::Kind) {
        self.0[k as usize].increment(1);
    }
}
