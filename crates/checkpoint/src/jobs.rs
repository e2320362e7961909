//! The shared repo-sync work queue: the leader publishes one job per repo to fetch, any
//! replica claims it, and the claim's epoch fences what the worker may apply.
//!
//! ```text
//!  leader: publish(did, id) ── replaces any older job of the repo (its claims lose)
//!                │
//!  worker: claim ─▶ epoch 1 ── touch … (progress) ── begin_apply (CAS: still this claim,
//!                │                                   still this job) ── write ── finish
//!                │ idle past the claim's bound (the worker died, froze)
//!                ▼
//!  worker': claim ─▶ epoch 2: epoch 1's begin_apply and finish are refused
//!  leader: state(did, id) ─▶ Done(result) once finished
//! ```
//!
//! The queue never interprets a job's reason or result: they are the consumer's strings.

use std::time::Duration;

use async_trait::async_trait;

use crate::cursor::{CommitOutcome, StoreError};
use crate::store::Fence;

/// A job as the leader publishes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSpec<'a> {
    /// The repo's DID.
    pub did: &'a str,
    /// Unique per publish (the term's token and a counter): a claim of an older job of the
    /// repo cannot apply once this one is published.
    pub id: &'a str,
    /// Why it is fetched (the consumer's word).
    pub reason: &'a str,
    /// The newest rev of the repo the leader handed over (a snapshot older is stale).
    pub min_rev: Option<&'a str>,
    /// The fingerprint of the relay the leader reads: sinks key snapshot events by it.
    pub relay: &'a str,
}

/// A job a worker claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The repo's DID.
    pub did: String,
    /// The job's id.
    pub id: String,
    /// Why it is fetched.
    pub reason: String,
    /// The newest rev the leader handed over, if any.
    pub min_rev: Option<String>,
    /// The fingerprint of the relay the leader reads.
    pub relay: String,
    /// The publishing term's lease value and fencing token: the worker writes under them.
    pub holder: String,
    /// See `holder`.
    pub token: u64,
    /// How many times the job was claimed, this claim included: only the newest claim may
    /// apply or finish it.
    pub epoch: u64,
    /// The engine's handle of the delivery (a stream entry id, a message's reply subject).
    pub handle: String,
}

/// Where a published job stands, as the leader polls it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    /// Queued or being worked.
    Pending,
    /// Finished with this result (the consumer's encoding).
    Done(String),
    /// The queue no longer knows this job: replaced by a newer one, expired, or the store
    /// lost its data. The leader queues the repo again.
    Unknown,
}

/// Jobs in the shared queue, for `/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobCounts {
    /// Published and not claimed.
    pub queued: u64,
    /// Claimed and not finished.
    pub claimed: u64,
}

/// A work queue of repo-sync jobs shared by every replica (Redis Streams, NATS `JetStream`).
#[async_trait]
pub trait JobQueue: Send + Sync + 'static {
    /// `redis`, `nats`: for logs.
    fn name(&self) -> &'static str;

    /// Publishes `job`, replacing any older job of the repo; fenced like a cursor commit
    /// (`Fenced` unless `fence` is the current term).
    async fn publish(&self, job: JobSpec<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError>;

    /// Up to `n` jobs for `worker`: jobs of workers that went quiet for `idle` first, then
    /// new ones; each with its epoch raised. Jobs replaced by a newer publish are dropped.
    async fn claim(&self, worker: &str, n: usize, idle: Duration) -> Result<Vec<Claim>, StoreError>;

    /// Keeps `c` alive (a long download); `false` once it is no longer the job's claim.
    async fn touch(&self, c: &Claim) -> Result<bool, StoreError>;

    /// The compare-and-set before a snapshot at `rev` is written: `true` (and the job is
    /// marked applying) only while `c` is the job's newest claim and the job the repo's
    /// newest. A late worker, or one whose job was replaced, gets `false` and writes nothing.
    async fn begin_apply(&self, c: &Claim, rev: &str) -> Result<bool, StoreError>;

    /// Records `result` and takes the job off the queue, if `c` is still its claim.
    async fn finish(&self, c: &Claim, result: &str) -> Result<bool, StoreError>;

    /// Where the job `id` of `did` stands.
    async fn state(&self, did: &str, id: &str) -> Result<JobState, StoreError>;

    /// How many jobs wait and are claimed.
    async fn counts(&self) -> Result<JobCounts, StoreError>;
}

/// A claim that has been delivered more often than this is not worked again: the worker
/// finishes it as failed (the leader's retry policy decides what comes next).
pub const MAX_DELIVER: u64 = 5;
