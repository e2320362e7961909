//! What a running consumer reports about itself: a typed role and the figures `/status`
//! and the summary line show.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lease::Term;
use relay_client::RelayRole;
use serde::Serialize;
use tokio::sync::watch;

/// Where this replica stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Not yet contending.
    #[default]
    Starting,
    /// Contending for the lease.
    Standby,
    /// Leading: consuming and committing.
    Leader,
    /// Leading while draining for a voluntary release.
    SteppingDown,
    /// The term's deadline passed and its loss is not yet announced: nothing is done.
    Expired,
    /// Exited.
    Stopped,
}

impl Role {
    /// The spelling `/status` uses.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Standby => "standby",
            Self::Leader => "leader",
            Self::SteppingDown => "stepping-down",
            Self::Expired => "expired",
            Self::Stopped => "stopped",
        }
    }
}

#[allow(clippy::ref_option, clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` passes `&Field`
fn relay_name<S: serde::Serializer>(r: &Option<RelayRole>, s: S) -> Result<S::Ok, S::Error> {
    match r {
        Some(r) => s.serialize_str(r.as_str()),
        None => s.serialize_none(),
    }
}

/// Why a replica does not take an operator's request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotNow {
    /// Only the leader works the resync queue.
    #[error("this replica is {}, not the leader: ask the leader", .0.as_str())]
    NotLeader(Role),
    /// Repo sync is off here.
    #[error("repo sync is off on this replica (FIREKEEPER_RESYNC=false)")]
    ResyncOff,
}

/// A snapshot of the consumer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    /// The role.
    pub role: Role,
    /// This process's instance id.
    pub instance: String,
    /// The fencing token while leading.
    pub token: Option<u64>,
    /// The relay being consumed while leading.
    #[serde(serialize_with = "relay_name")]
    pub relay: Option<RelayRole>,
    /// Its fingerprint.
    pub fingerprint: Option<String>,
    /// A relay connection is up.
    pub connected: bool,
    /// Last seq delivered to the handler.
    pub last_seq: Option<u64>,
    /// Last cursor committed.
    pub committed: Option<u64>,
    /// Age of the newest delivered event (relay time to now).
    pub lag_seconds: Option<f64>,
    /// Events delivered but not yet done.
    pub in_flight: usize,
    /// The last accepted gap (`FIREKEEPER_GAP=live`): relay and missing time range.
    pub last_gap: Option<String>,
    /// A relay switch refused and not yet overcome (the relay switched to does not serve
    /// back to the committed position): which relay and what is missing. Not ready
    /// while set.
    pub refused_switch: Option<String>,
    /// Repos marked desynchronised (an invalid event, a broken chain; list them with
    /// [`StatusHandle::desynchronized`]): the resync queue, every state.
    pub desynchronized: usize,
    /// The resync queue by state: `desynchronized` (queued), `resyncing`, `gone`, `failed`.
    pub resync: std::collections::BTreeMap<&'static str, usize>,
    /// Repo sync as a person watches it: the queue, what was done, rates, the backfill
    /// and an ETA (`None` without repo sync).
    pub repo_sync: Option<crate::progress::Progress>,
    /// Repo sync across replicas: this replica's jobs, and on the leader the shared queue
    /// (`None` while repo sync is not shared).
    pub sync_jobs: Option<crate::shared::SyncJobs>,
    /// The sink's writes are failing (and retried): not ready while set.
    pub sink_failing: Option<SinkFailing>,
    /// The cursor store has taken no commit for `uncommitted_max`: intake waits, not ready.
    pub commit_stalled: bool,
    /// Why the lease store cannot be used now (down, credentials refused): this replica
    /// could not take over, so it is not ready.
    pub lease_store_error: Option<String>,
    /// The settings on which this replica differs from the deployment's latest leader:
    /// it does not take over (not ready) unless a change is allowed.
    pub settings_differ: Option<Vec<crate::deployment::Difference>>,
}

/// Shared with the lease supervisor: its latest store trouble.
type Trouble = Arc<Mutex<Option<String>>>;

/// A sink whose writes keep failing.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SinkFailing {
    /// The last error.
    pub error: String,
    /// Since when (RFC 3339).
    pub since: String,
    /// Failed writes since then.
    pub failures: u64,
}

/// The shared status of one consumer: cheap to clone, read from any task.
#[derive(Debug, Clone)]
pub struct StatusHandle(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    status: watch::Sender<Status>,
    term: Mutex<Option<Term>>,
    events: AtomicU64,
    written: AtomicU64,
    ready: AtomicBool,
    refused: AtomicBool,
    sink_failing: AtomicBool,
    commit_stalled: AtomicBool,
    desync: Arc<crate::verify::Desync>,
    /// This replica's work for the shared repo-sync queue.
    workers: Arc<crate::shared::WorkerStats>,
    lease_trouble: std::sync::OnceLock<Trouble>,
    starting_why: Mutex<Option<String>>,
    held_back: AtomicBool,
    store_trouble: Mutex<Option<String>>,
}

impl Default for StatusHandle {
    fn default() -> Self {
        Self(Arc::new(Inner {
            status: watch::Sender::new(Status::default()),
            term: Mutex::new(None),
            events: AtomicU64::new(0),
            written: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            sink_failing: AtomicBool::new(false),
            commit_stalled: AtomicBool::new(false),
            desync: Arc::default(),
            workers: Arc::default(),
            lease_trouble: std::sync::OnceLock::new(),
            starting_why: Mutex::new(None),
            held_back: AtomicBool::new(false),
            store_trouble: Mutex::new(None),
        }))
    }
}

impl StatusHandle {
    /// The status as of now: `leader` or `stepping-down` only while the term is active,
    /// else `expired` (a process that just woke from a freeze has stopped acting before
    /// its supervisor announced the loss).
    #[must_use]
    pub fn snapshot(&self) -> Status {
        let mut s = self.0.status.borrow().clone();
        s.desynchronized = self.0.desync.len();
        let by = self.0.desync.by_state();
        s.repo_sync = self.0.desync.progress(&by, crate::verify::now_ms().unsigned_abs() / 1000);
        s.resync = by.into_iter().collect();
        s.sync_jobs = self.0.workers.view();
        s.lease_store_error = self.lease_trouble();
        let active = self.0.term.lock().ok().and_then(|t| t.as_ref().map(Term::is_active)).unwrap_or(false);
        if matches!(s.role, Role::Leader | Role::SteppingDown) && !active {
            s.role = Role::Expired;
        }
        s
    }

    /// A watch on the raw status (changes at each role change and commit tick).
    #[must_use]
    pub fn watch(&self) -> watch::Receiver<Status> {
        self.0.status.subscribe()
    }

    /// True once the consumer contends for the lease, no refused relay switch holds it on
    /// a relay that does not answer, and the sink's writes are not failing (`/readyz`).
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.not_ready_reason().is_none()
    }

    /// Why this replica is not ready, in words (`None` when it is): what `/readyz` says.
    #[must_use]
    pub fn not_ready_reason(&self) -> Option<String> {
        if let Some(t) = self.lease_trouble() {
            return Some(format!("cannot use the lease store: {t}"));
        }
        if let Some(t) = self.0.store_trouble.lock().ok().and_then(|t| t.clone()) {
            return Some(format!("cannot use the cursor store: {t}"));
        }
        if self.0.held_back.load(Ordering::Relaxed) {
            let s = self.0.status.borrow();
            let keys = s.settings_differ.iter().flatten().map(|d| d.key.as_str()).collect::<Vec<_>>().join(", ");
            return Some(format!(
                "settings differ from the deployment's ({keys}): this replica will not take over; set FIREKEEPER_ALLOW_SETTINGS_CHANGE=true for a deliberate change"
            ));
        }
        if !self.0.ready.load(Ordering::Relaxed) {
            let why = self.0.starting_why.lock().ok().and_then(|w| w.clone());
            return Some(why.map_or_else(|| "starting".into(), |w| format!("starting: {w}")));
        }
        let s = self.0.status.borrow();
        if self.0.refused.load(Ordering::Relaxed) {
            return Some(format!("relay switch refused: {}", s.refused_switch.as_deref().unwrap_or("")));
        }
        if self.0.sink_failing.load(Ordering::Relaxed) {
            return Some(format!("sink failing: {}", s.sink_failing.as_ref().map_or("", |f| f.error.as_str())));
        }
        if self.0.commit_stalled.load(Ordering::Relaxed) {
            return Some("the cursor store takes no commit".into());
        }
        None
    }

    /// The settings on which this replica differs from the deployment's (`None`: none);
    /// `holds_back`: it does not take over because of them, so it is not ready.
    pub(crate) fn settings_differ(&self, d: Option<Vec<crate::deployment::Difference>>, holds_back: bool) {
        self.0.held_back.store(d.is_some() && holds_back, Ordering::Relaxed);
        self.update(|s| s.settings_differ = d);
    }

    /// A standby's cursor store does not answer (`None`: it does): not ready.
    pub(crate) fn store_trouble(&self, t: Option<String>) {
        if let Ok(mut g) = self.0.store_trouble.lock() {
            *g = t;
        }
    }

    /// What keeps the start from going on (a store that does not answer), for `/readyz`.
    pub(crate) fn starting_because(&self, why: Option<String>) {
        if let Ok(mut w) = self.0.starting_why.lock() {
            *w = why;
        }
    }

    /// The lease store's trouble as the supervisor last saw it.
    fn lease_trouble(&self) -> Option<String> {
        self.0.lease_trouble.get()?.lock().ok()?.clone()
    }

    /// Follows the lease supervisor's store trouble (see [`lease::LeaseHandle::store_trouble`]).
    pub(crate) fn watch_lease(&self, trouble: Trouble) {
        // One supervisor per consumer run: the first one set stays.
        let _ = self.0.lease_trouble.set(trouble);
    }

    /// A term is over: what only a leader can be (a failing sink, stalled commits) is not
    /// shown on a standby.
    pub(crate) fn term_over(&self) {
        self.0.sink_failing.store(false, Ordering::Relaxed);
        self.0.commit_stalled.store(false, Ordering::Relaxed);
        self.update(|s| {
            s.sink_failing = None;
            s.commit_stalled = false;
        });
    }

    /// Shows (or clears) that commits do not land and intake waits.
    pub(crate) fn set_commit_stalled(&self, stalled: bool) {
        self.0.commit_stalled.store(stalled, Ordering::Relaxed);
        self.update(|s| s.commit_stalled = stalled);
    }

    /// A sink write failed (it is retried): shown in `/status`, not ready meanwhile.
    pub(crate) fn sink_failed(&self, error: &str) {
        self.0.sink_failing.store(true, Ordering::Relaxed);
        self.update(|s| {
            let f = s.sink_failing.get_or_insert_with(|| SinkFailing {
                since: time::OffsetDateTime::now_utc()
                    .format(&time::format_description::well_known::Rfc3339)
                    .unwrap_or_default(),
                ..SinkFailing::default()
            });
            error.clone_into(&mut f.error);
            f.failures += 1;
        });
    }

    /// A sink write succeeded: a failure shown is over.
    pub(crate) fn sink_ok(&self) {
        if self.0.sink_failing.swap(false, Ordering::Relaxed) {
            let mut was = None;
            self.update(|s| was = s.sink_failing.take());
            if let Some(f) = was {
                tracing::info!(since = %f.since, failures = f.failures, "sink writes succeed again");
            }
        }
    }

    /// The repos an invalid event marked desynchronised, until a valid `#sync` or a
    /// commit that chains again (`/repos/invalid`, `firekeeper repos invalid`).
    #[must_use]
    pub fn desynchronized(&self) -> Vec<crate::verify::Desynced> {
        self.0.desync.list()
    }

    /// Queues the resyncs an operator asked for (`POST /repos/resync`), each kept in the
    /// store by the resync worker, fenced by the term: only the leader, with repo sync on.
    pub fn request_resync(&self, repos: &[String]) -> Result<Vec<crate::verify::Requested>, NotNow> {
        let role = self.snapshot().role;
        if role != Role::Leader {
            return Err(NotNow::NotLeader(role));
        }
        if !self.0.desync.resyncs() {
            return Err(NotNow::ResyncOff);
        }
        Ok(repos.iter().map(|r| self.0.desync.request(r)).collect())
    }

    /// Waits until every one of `repos` has its state kept by the store, at most `within`;
    /// true when all were.
    pub async fn kept(&self, repos: &[String], within: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if repos.iter().all(|r| self.0.desync.is_kept(r)) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// This replica's work for the shared repo-sync queue.
    #[must_use]
    pub fn sync_workers(&self) -> Arc<crate::shared::WorkerStats> {
        self.0.workers.clone()
    }

    pub(crate) fn desync(&self) -> Arc<crate::verify::Desync> {
        self.0.desync.clone()
    }

    /// Events read from the relay and handed to the lanes by this process.
    #[must_use]
    pub fn events(&self) -> u64 {
        self.0.events.load(Ordering::Relaxed)
    }

    /// Events the sink took (its write succeeded) in this process.
    #[must_use]
    pub fn written(&self) -> u64 {
        self.0.written.load(Ordering::Relaxed)
    }

    pub(crate) fn add_written(&self, n: usize) {
        self.0.written.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut Status)) {
        self.0.status.send_modify(f);
    }

    pub(crate) fn set_ready(&self) {
        self.0.ready.store(true, Ordering::Relaxed);
    }

    /// Shows (or clears) a refused relay switch; not ready while one is shown.
    pub(crate) fn set_refused_switch(&self, what: Option<String>) {
        self.0.refused.store(what.is_some(), Ordering::Relaxed);
        self.update(|s| s.refused_switch = what);
    }

    pub(crate) fn add_events(&self, n: u64) {
        self.0.events.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn set_term(&self, t: Option<Term>) {
        if let Ok(mut g) = self.0.term.lock() {
            *g = t;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the leader takes an operator's resync request; a standby (or a starting
    /// replica) names its role, and a leader without repo sync says so.
    #[test]
    fn only_a_leader_with_repo_sync_takes_a_resync_request() {
        let s = StatusHandle::default();
        let dids = ["did:plc:a".to_owned()];
        assert_eq!(s.request_resync(&dids), Err(NotNow::NotLeader(Role::Starting)));
        assert!(NotNow::NotLeader(Role::Standby).to_string().contains("standby, not the leader"));
        assert!(s.desynchronized().is_empty(), "nothing queued");
    }
}
