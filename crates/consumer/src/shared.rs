//! Repo sync across replicas: the leader publishes each repo to fetch as a job in the
//! deployment's shared queue ([`checkpoint::JobQueue`]); every replica's workers (the
//! leader's too) claim jobs, fetch and verify the repo, and write its snapshot to the
//! shared sink under the publishing term's token.
//!
//! ```text
//!  leader lane: the repo's turn ─ earlier events of it durable ─ publish (fenced) ─┐
//!     holds the repo's live events                                                 │
//!  any replica: claim (epoch n) ─ fetch + verify ─ begin_apply (CAS: still claim n, │
//!     still the repo's job) ─ write the parts to the sink ─ finish(result) ◀───────┘
//!  leader lane: polls the job ─ done at rev R: drops held events at or below R,
//!     hands the rest over after it; failed: hands them over, the repo stays queued
//! ```
//!
//! A worker that goes quiet (dead, frozen, cut off) loses its claim after [`CLAIM_IDLE`]
//! and its late apply is refused; its lent term ends before that, so it stops writing
//! first. A crash anywhere repeats the job: at-least-once snapshots, never a lost one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use checkpoint::{Claim, JobQueue};
use relay_client::backoff::{Backoff, BackoffConfig};
use repo_sync::check::CheckError;
use repo_sync::fetch::FetchError;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::handler::{BatchCtx, Handler, HandlerError, SnapshotParts};
use crate::metrics as m;
use crate::resync::Resyncer;

/// A claim not touched for this long is handed to another worker (its own is dead,
/// frozen or cut off).
pub const CLAIM_IDLE: Duration = Duration::from_secs(30);

/// Workers ask for jobs this often while the queue has none for them.
const POLL: Duration = Duration::from_millis(200);

/// Retries of a failed snapshot part: 100 ms doubling to 10 s.
const RETRY: BackoffConfig = BackoffConfig { initial: Duration::from_millis(100), max: Duration::from_secs(10) };

/// How a shared job ended, as its worker records it (JSON in the queue) for the leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub(crate) enum JobResult {
    /// The snapshot was written whole; `data` is its tree root (hex of the binary CID).
    Done {
        /// The commit's rev.
        rev: String,
        /// The tree root, hex.
        data: String,
        /// Records written.
        records: u64,
        /// The CAR's size.
        bytes: u64,
        /// The instance whose worker wrote it.
        by: String,
    },
    /// The PDS served a repo older than what the leader handed over.
    Stale {
        /// The rev served.
        rev: String,
    },
    /// Fetching, verifying or writing failed: the leader's retry policy goes on.
    Failed {
        /// What went wrong.
        why: String,
        /// The metric's outcome label (`failed`, `invalid`, `undelivered`, `dead`).
        label: String,
    },
    /// The PDS says the repo is not there.
    Gone,
    /// Its host asked to wait until this time (Unix ms).
    Later {
        /// Unix ms.
        at: i64,
        /// The metric's outcome label: `rate_limited` (this fetch got a 429) or `parked`
        /// (its host was still parked by an earlier one).
        #[serde(default = "rate_limited")]
        label: String,
    },
}

/// The label of a `Later` recorded without one.
fn rate_limited() -> String {
    "rate_limited".into()
}

impl JobResult {
    /// The form the queue keeps.
    pub(crate) fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads what a worker recorded; anything else is a failure that names it.
    pub(crate) fn decode(s: &str) -> Self {
        serde_json::from_str(s).unwrap_or_else(|e| Self::Failed {
            why: format!("a worker recorded a result that does not read ({e})"),
            label: "failed".into(),
        })
    }

    /// What a failed fetch means for the queue.
    pub(crate) fn of_fetch(e: &CheckError) -> Self {
        let later = |wait: Duration, label: &str| Self::Later {
            at: crate::verify::now_ms().saturating_add(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX / 4)),
            label: label.into(),
        };
        match e {
            CheckError::Fetch(FetchError::Gone(_)) => Self::Gone,
            CheckError::Fetch(FetchError::RateLimited(rl)) => {
                later(rl.wait.unwrap_or(repo_sync::hosts::DEFAULT_PARK), "rate_limited")
            }
            CheckError::Fetch(FetchError::Parked(left)) => later(*left, "parked"),
            CheckError::Verify(_) => Self::Failed { why: e.to_string(), label: "invalid".into() },
            _ => Self::Failed { why: e.to_string(), label: "failed".into() },
        }
    }
}

impl JobResult {
    /// What the result means for the leader's queue, and its metric's outcome label.
    pub(crate) fn outcome(&self) -> (crate::verify::Outcome, &str) {
        use crate::verify::Outcome;
        match self {
            Self::Done { rev, .. } => (Outcome::Done(crate::chain::tid(rev)), "done"),
            Self::Stale { .. } => (Outcome::Later(crate::verify::now_ms()), "stale"),
            Self::Failed { label, .. } => (Outcome::Failed, label),
            Self::Gone => (Outcome::Gone, "gone"),
            Self::Later { at, label } => (Outcome::Later(*at), label),
        }
    }
}

/// This replica's work for the shared queue: its jobs in flight and done, for `/status`;
/// on the leader also the queue as a whole.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// This replica's workers (0: it takes no jobs); `None` while repo sync is not shared.
    pub workers: std::sync::OnceLock<usize>,
    /// The queue's jobs waiting and claimed, as the leader last read them (`None`: not
    /// known here).
    pub queue: std::sync::Mutex<Option<checkpoint::JobCounts>>,
    /// On the leader: the jobs that landed in its terms, by the instance that wrote them,
    /// and their records.
    pub by_replica: std::sync::Mutex<std::collections::BTreeMap<String, Landed>>,
    /// Jobs being worked now.
    pub in_flight: AtomicUsize,
    /// Snapshots written whole.
    pub done: AtomicU64,
    /// Records in them.
    pub records: AtomicU64,
    /// Claims refused at apply (taken over or replaced meanwhile).
    pub late: AtomicU64,
}

/// Jobs one replica wrote that landed, as the leader counted them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Landed {
    /// Snapshots.
    pub done: u64,
    /// Their records.
    pub records: u64,
}

/// Repo sync across replicas as `/status` shows it on each replica.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SyncJobs {
    /// This replica's workers.
    pub workers: usize,
    /// Jobs this replica is working now.
    pub in_flight: usize,
    /// Snapshots this replica wrote whole.
    pub done: u64,
    /// Records in them.
    pub records: u64,
    /// Its claims refused at apply (taken over or replaced meanwhile).
    pub late: u64,
    /// On the leader: jobs in the shared queue waiting to be claimed.
    pub queued: Option<u64>,
    /// On the leader: jobs claimed by some replica and not finished.
    pub claimed: Option<u64>,
    /// On the leader: the jobs that landed in its terms, by the replica (instance) that
    /// wrote them (`firekeeper repos progress` turns them into rates).
    pub by_replica: std::collections::BTreeMap<String, Landed>,
}

impl WorkerStats {
    /// What `/status` shows; `None` while repo sync is not shared.
    #[must_use]
    pub fn view(&self) -> Option<SyncJobs> {
        let queue = self.queue.lock().ok().and_then(|q| *q);
        Some(SyncJobs {
            workers: *self.workers.get()?,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            done: self.done.load(Ordering::Relaxed),
            records: self.records.load(Ordering::Relaxed),
            late: self.late.load(Ordering::Relaxed),
            queued: queue.map(|q| q.queued),
            claimed: queue.map(|q| q.claimed),
            by_replica: self.by_replica.lock().map(|m| m.clone()).unwrap_or_default(),
        })
    }

    /// A job `by` wrote landed with `records`.
    pub(crate) fn landed(&self, by: &str, records: u64) {
        if let Ok(mut m) = self.by_replica.lock() {
            // Bounded: replicas come and go over months; a deployment has a handful.
            if m.len() >= 256 && !m.contains_key(by) {
                m.clear();
            }
            let e = m.entry(by.to_owned()).or_default();
            e.done += 1;
            e.records += records;
        }
    }

    /// The leader read the queue's counts (`None`: its term ended: unknown here).
    pub(crate) fn set_queue(&self, c: Option<checkpoint::JobCounts>) {
        if let Ok(mut q) = self.queue.lock() {
            *q = c;
        }
        let shown = c.unwrap_or_default();
        metrics::gauge!(m::SYNC_QUEUE, "state" => "queued").set(shown.queued as f64);
        metrics::gauge!(m::SYNC_QUEUE, "state" => "claimed").set(shown.claimed as f64);
    }
}

/// The workers of one replica: claim jobs from the shared queue for the life of the
/// process, whether it leads or stands by.
pub(crate) struct Workers {
    pub(crate) queue: Arc<dyn JobQueue>,
    pub(crate) resyncer: Arc<Resyncer>,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) instance: String,
    pub(crate) n: usize,
    pub(crate) clock: Arc<dyn lease::Clock>,
    pub(crate) stats: Arc<WorkerStats>,
    /// A claim not touched for this long passes to another worker.
    pub(crate) idle: Duration,
}

impl Workers {
    /// Claims and works jobs, at most `n` at a time, until the process ends.
    pub(crate) async fn run(self: Arc<Self>) {
        let permits = Arc::new(Semaphore::new(self.n.max(1)));
        let mut tasks = JoinSet::new();
        let mut warned: Option<std::time::Instant> = None;
        tracing::info!(
            workers = self.n,
            queue = self.queue.name(),
            "repo sync: this replica works jobs of the shared queue"
        );
        loop {
            while tasks.try_join_next().is_some() {}
            let free = permits.available_permits();
            let mut got = 0;
            if free > 0 {
                match self.queue.claim(&self.instance, free, self.idle).await {
                    Ok(claims) => {
                        warned = None;
                        got = claims.len();
                        for c in claims {
                            let Ok(permit) = permits.clone().try_acquire_owned() else { break };
                            let me = self.clone();
                            tasks.spawn(async move {
                                me.work(c).await;
                                drop(permit);
                            });
                        }
                    }
                    Err(e) => {
                        if warned.is_none_or(|w| w.elapsed() >= Duration::from_mins(1)) {
                            tracing::warn!(error = %e, "repo sync: the shared queue does not answer; asking again (logged once a minute)");
                            warned = Some(std::time::Instant::now());
                        }
                    }
                }
            }
            if got == 0 || permits.available_permits() == 0 {
                tokio::select! {
                    () = tokio::time::sleep(if got == 0 { POLL } else { Duration::from_secs(1) }) => {}
                    Some(_) = tasks.join_next() => {}
                }
            }
        }
    }

    /// Works one claim and records its result (unless the claim was lost meanwhile).
    async fn work(&self, c: Claim) {
        self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!(m::SYNC_JOBS_IN_FLIGHT).increment(1.0);
        let result = if c.epoch > checkpoint::jobs::MAX_DELIVER {
            tracing::error!(repo = %c.did, claims = c.epoch, "repo sync: a job claimed this many times is not worked again");
            Some(JobResult::Failed { why: format!("claimed {} times", c.epoch), label: "dead".into() })
        } else {
            // The worker writes under its claim for two thirds of the idle bound after each
            // touch (six a bound), so it has stopped before another may take the job over.
            let lent = self.idle * 2 / 3;
            let term = lease::Term::lent(&self.instance, c.token, self.clock.clone(), lent);
            let touch = tokio::spawn(keep_claim(self.queue.clone(), c.clone(), term.clone(), self.idle / 6, lent));
            let r = self.apply(&c, &term).await;
            touch.abort();
            r
        };
        if let Some(r) = result {
            let label = match &r {
                JobResult::Done { .. } => "done",
                JobResult::Stale { .. } => "stale",
                JobResult::Failed { label, .. } => label.as_str(),
                JobResult::Gone => "gone",
                JobResult::Later { .. } => "later",
            };
            metrics::counter!(m::SYNC_JOBS, "outcome" => label.to_owned()).increment(1);
            match self.queue.finish(&c, &r.encode()).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!(repo = %c.did, "repo sync: the job was taken over before it finished; its result is left to the new claim");
                }
                Err(e) => {
                    tracing::warn!(repo = %c.did, error = %e, "repo sync: the job's result was not recorded; it will be worked again");
                }
            }
        }
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!(m::SYNC_JOBS_IN_FLIGHT).decrement(1.0);
    }

    /// Fetches, verifies and writes the claimed repo; `None` when the claim was lost (the
    /// job is someone else's now: nothing to record).
    async fn apply(&self, c: &Claim, term: &lease::Term) -> Option<JobResult> {
        let (repo, parts) = match self.resyncer.fetch(&c.did).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(repo = %c.did, error = %e, "repo sync: a shared job's fetch failed");
                return Some(JobResult::of_fetch(&e));
            }
        };
        let min = c.min_rev.as_deref().and_then(|m| m.parse::<u64>().ok());
        if let (Some(min), Some(rev)) = (min, crate::chain::tid(&repo.rev))
            && rev < min
        {
            return Some(JobResult::Stale { rev: repo.rev });
        }
        if !term.is_active() {
            tracing::warn!(repo = %c.did, claim = c.epoch, "repo sync: late: the claim ran out during the download (this process was stopped, or cut off from the queue); this worker writes nothing");
            return None;
        }
        match self.queue.begin_apply(c, &repo.rev).await {
            Ok(true) => {}
            Ok(false) => {
                self.stats.late.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::SYNC_JOBS, "outcome" => "late").increment(1);
                tracing::info!(repo = %c.did, claim = c.epoch, "repo sync: late: the job was claimed again or replaced meanwhile; this worker writes nothing");
                return None;
            }
            Err(e) => {
                tracing::warn!(repo = %c.did, error = %e, "repo sync: the apply check did not answer; the job will be worked again");
                return None;
            }
        }
        let (rev, data, records, bytes) = (repo.rev.clone(), hex(&repo.data_cid), repo.records, repo.bytes);
        let ctx = BatchCtx {
            token: c.token,
            relay: relay_client::RelayRole::Primary,
            fingerprint: c.relay.clone(),
            cancel: term.cancellation(),
            term: term.clone(),
            cursor_hold: crate::handler::CursorHold::default(),
        };
        let mut sp = SnapshotParts::new(Arc::new(repo), c.reason.as_str().into(), parts);
        match write_all(&*self.handler, &mut sp, &ctx).await {
            Ok(()) => {
                self.stats.done.fetch_add(1, Ordering::Relaxed);
                self.stats.records.fetch_add(records, Ordering::Relaxed);
                tracing::info!(repo = %c.did, rev, records, bytes, reason = %c.reason, "repo resynchronised from its PDS (a shared job)");
                Some(JobResult::Done { rev, data, records, bytes, by: self.instance.clone() })
            }
            Err(HandlerError::Cancelled) => {
                tracing::warn!(repo = %c.did, "repo sync: the claim ran out while the snapshot was written; the job will be worked again");
                None
            }
            Err(e) => Some(JobResult::Failed { why: e.to_string(), label: "undelivered".into() }),
        }
    }
}

/// Touches `c` `every` so long, lending `term` `lent` more after each touch the queue
/// took; ends `term` once the claim is no longer this worker's.
async fn keep_claim(queue: Arc<dyn JobQueue>, c: Claim, term: lease::Term, every: Duration, lent: Duration) {
    loop {
        tokio::time::sleep(every).await;
        match queue.touch(&c).await {
            Ok(true) => term.lend_more(lent),
            Ok(false) => {
                term.cancellation().cancel();
                return;
            }
            // Unknown: the lent time runs out unless a later touch is taken.
            Err(_) => {}
        }
    }
}

/// Writes every part of a snapshot, retrying a failed write while the claim lasts.
async fn write_all(handler: &dyn Handler, sp: &mut SnapshotParts, ctx: &BatchCtx) -> Result<(), HandlerError> {
    while let Some(part) = sp.next_part().await {
        let part = part?;
        let mut backoff = Backoff::new(RETRY);
        loop {
            ctx.ensure_active()?;
            match handler.snapshot(&part, ctx).await {
                Err(e @ HandlerError::Failed { .. }) => {
                    let delay = backoff.next_delay();
                    tracing::warn!(error = %e, repo = part.did(), retry_ms = delay.as_millis() as u64, "repo sync: a snapshot part's write failed; retrying");
                    pause(delay, ctx).await?;
                }
                r => {
                    r?;
                    break;
                }
            }
        }
    }
    Ok(())
}

/// How often the leader's lane asks whether a published job finished: from this, doubling
/// to `POLL_JOB_MAX`.
const POLL_JOB: Duration = Duration::from_millis(50);
const POLL_JOB_MAX: Duration = Duration::from_millis(250);

/// Publishes `job` fenced by the term (retried while the queue does not answer) and waits
/// for its result. `Fenced` when a newer term owns the queue, `Cancelled` when the term
/// ends first.
pub(crate) async fn publish_and_wait(
    job: &crate::pipeline::RemoteJob,
    ctx: &BatchCtx,
) -> Result<JobResult, HandlerError> {
    let holder = ctx.term.holder();
    let fence = checkpoint::Fence { holder: &holder, token: ctx.token };
    let min_rev = job.min_rev.map(|r| r.to_string());
    let spec = checkpoint::JobSpec {
        did: &job.did,
        id: &job.id,
        reason: job.reason,
        min_rev: min_rev.as_deref(),
        relay: &ctx.fingerprint,
    };
    let mut backoff = Backoff::new(RETRY);
    loop {
        ctx.ensure_active()?;
        match job.queue.publish(spec, fence).await {
            Ok(checkpoint::CommitOutcome::Fenced { .. }) => return Err(HandlerError::Fenced),
            Ok(_) => break,
            Err(e) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, repo = %job.did, "repo sync: publishing a job to the shared queue failed; retrying");
                pause(delay, ctx).await?;
            }
        }
    }
    let mut every = POLL_JOB;
    loop {
        pause(every, ctx).await?;
        every = (every * 2).min(POLL_JOB_MAX);
        match job.queue.state(&job.did, &job.id).await {
            Ok(checkpoint::JobState::Pending) => {}
            Ok(checkpoint::JobState::Done(r)) => return Ok(JobResult::decode(&r)),
            Ok(checkpoint::JobState::Unknown) => {
                return Ok(JobResult::Failed {
                    why: "the job is gone from the shared queue (replaced, expired, or the store lost it)".into(),
                    label: "failed".into(),
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, repo = %job.did, "repo sync: asking the shared queue about a job failed");
            }
        }
    }
}

/// Sleeps `d` unless the term ends first (`Cancelled`).
async fn pause(d: Duration, ctx: &BatchCtx) -> Result<(), HandlerError> {
    tokio::select! {
        () = tokio::time::sleep(d) => Ok(()),
        () = ctx.cancel.cancelled() => Err(HandlerError::Cancelled),
    }
}

/// Lower-case hex.
pub(crate) fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// The bytes of lower-case hex; `None` when it is not.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}
