//! The shared repo-sync queue on NATS `JetStream`: a work-queue stream holds at most one
//! message per repo (a per-subject limit of 1 with discard-new: a second enqueue of a repo
//! already queued is a no-op), a durable pull consumer hands messages to workers (its
//! `ack_wait` is the claim's idle bound: a message not acknowledged nor progressed that
//! long goes to another worker), and a KV bucket (`<prefix>-jobs`) holds each repo's job
//! (which publish counts, its claim epoch, its state and result), changed only by
//! compare-and-set on the entry's revision. The message only says "this repo has a job";
//! the entry says which.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use nats_op::async_nats::jetstream;
use nats_op::{Bucket, Nats, bucket_name};

use crate::cursor::{CommitOutcome, StoreError};
use crate::jobs::{Claim, JobCounts, JobQueue, JobSpec, JobState};
use crate::store::Fence;

/// Attempts at a compare-and-set before reporting the queue as contended.
const CAS_TRIES: usize = 8;

/// Finished jobs' entries (their results) expire this long after their last write; the
/// leader reads a result within seconds.
const KEEP: Duration = Duration::from_hours(24 * 7);

/// A repo's job as the KV entry keeps it (tab-separated; the result last).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    id: String,
    epoch: u64,
    state: String,
    token: u64,
    holder: String,
    min_rev: String,
    reason: String,
    relay: String,
    result: String,
}

impl Entry {
    fn encode(&self) -> Bytes {
        let Self { id, epoch, state, token, holder, min_rev, reason, relay, result } = self;
        Bytes::from(format!("{id}\t{epoch}\t{state}\t{token}\t{holder}\t{min_rev}\t{reason}\t{relay}\t{result}"))
    }

    fn decode(v: &[u8]) -> Result<Self, StoreError> {
        let bad = || StoreError::Protocol(format!("a job entry is {}", crate::cursor::preview(v)));
        let text = std::str::from_utf8(v).map_err(|_| bad())?;
        let f: Vec<&str> = text.splitn(9, '\t').collect();
        let [id, epoch, state, token, holder, min_rev, reason, relay, result] = f.as_slice() else { return Err(bad()) };
        Ok(Self {
            id: (*id).to_owned(),
            epoch: epoch.parse().map_err(|_| bad())?,
            state: (*state).to_owned(),
            token: token.parse().map_err(|_| bad())?,
            holder: (*holder).to_owned(),
            min_rev: (*min_rev).to_owned(),
            reason: (*reason).to_owned(),
            relay: (*relay).to_owned(),
            result: (*result).to_owned(),
        })
    }
}

/// Repo-sync jobs in NATS `JetStream` (see the module).
#[derive(Debug)]
pub struct NatsJobs {
    nats: Nats,
    jobs: Bucket,
    /// The cursor store's bucket, whose `fence-seen` fences a publish.
    state: Bucket,
    stream: String,
    subject: String,
    /// The consumer's `ack_wait`: how long a claim lasts without a touch.
    idle: Duration,
    /// The consumer once opened (again after a failure).
    consumer: std::sync::Mutex<Option<Consumer>>,
}

/// The workers' pull consumer.
type Consumer = jetstream::consumer::Consumer<jetstream::consumer::pull::Config>;

impl NatsJobs {
    /// The queue of the deployment whose key prefix is `prefix`; a claim not touched for
    /// `idle` passes to another worker (the consumer's `ack_wait`, fixed when it is
    /// created: [`JobQueue::claim`]'s own bound is not used).
    #[must_use]
    pub fn new(nats: &Nats, prefix: &str, idle: Duration) -> Self {
        Self {
            nats: nats.clone(),
            jobs: Bucket::new(nats.clone(), bucket_name(prefix, "jobs"), KEEP),
            state: Bucket::new(nats.clone(), bucket_name(prefix, "state"), Duration::ZERO),
            stream: bucket_name(prefix, "jobq"),
            subject: format!("{prefix}.jobq"),
            idle,
            consumer: std::sync::Mutex::new(None),
        }
    }

    /// The KV key (and message subject suffix) of a repo: the DID with every character a
    /// key cannot hold written `=XX`.
    fn key(did: &str) -> String {
        crate::nats_store::NatsStore::repo_key(did).replacen("repo.", "job.", 1)
    }

    /// The pull consumer every worker shares, creating the stream and consumer when needed.
    async fn consumer(&self) -> Result<Consumer, StoreError> {
        if let Some(c) = self.consumer.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
            return Ok(c.clone());
        }
        let idle = self.idle;
        let js = self.nats.jetstream().clone();
        let (stream, subject) = (self.stream.clone(), self.subject.clone());
        self.nats
            .bounded(
                "the job stream",
                Box::pin(async move {
                    let s = js
                        .get_or_create_stream(jetstream::stream::Config {
                            name: stream,
                            subjects: vec![format!("{subject}.>")],
                            retention: jetstream::stream::RetentionPolicy::WorkQueue,
                            storage: jetstream::stream::StorageType::File,
                            max_messages_per_subject: 1,
                            discard: jetstream::stream::DiscardPolicy::New,
                            discard_new_per_subject: true,
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| e.to_string())?;
                    s.get_or_create_consumer(
                        "workers",
                        jetstream::consumer::pull::Config {
                            durable_name: Some("workers".into()),
                            ack_policy: jetstream::consumer::AckPolicy::Explicit,
                            ack_wait: idle,
                            max_ack_pending: 10_000,
                            ..Default::default()
                        },
                    )
                    .await
                    .map_err(|e| e.to_string())
                }),
            )
            .await
            .map_err(StoreError::from)
            .inspect(|c| *self.consumer.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(c.clone()))
    }

    /// Forgets the consumer after a failure (the stream may have been lost with the
    /// server's data): the next call creates it again.
    fn forget<T>(&self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if r.is_err() {
            *self.consumer.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
        r
    }

    /// A repo's job entry and its revision.
    async fn entry(&self, did: &str) -> Result<Option<(Entry, u64)>, StoreError> {
        match self.jobs.read(Self::key(did)).await? {
            Some((v, rev)) => Ok(Some((Entry::decode(&v)?, rev))),
            None => Ok(None),
        }
    }

    /// Changes `c`'s job entry with `f` while `c` is its current claim (`f` says whether
    /// the change applies); `false` when it is not, or `f` refused.
    async fn step(&self, c: &Claim, f: impl Fn(&mut Entry) -> bool) -> Result<bool, StoreError> {
        for _ in 0..CAS_TRIES {
            let Some((mut e, rev)) = self.entry(&c.did).await? else { return Ok(false) };
            if e.id != c.id || e.epoch != c.epoch || e.state == "done" || !f(&mut e) {
                return Ok(false);
            }
            if self.jobs.cas(Self::key(&c.did), e.encode(), Some(rev)).await?.is_some() {
                return Ok(true);
            }
        }
        Err(StoreError::Unavailable("a job entry kept changing".into()))
    }

    /// Sends `ack` (`+ACK`, `+WPI`, `-NAK`) for a delivered message.
    async fn ack(&self, handle: &str, ack: &'static str) -> Result<(), StoreError> {
        let client = self.nats.client().clone();
        let subject = handle.to_owned();
        self.nats
            .bounded("a job acknowledgement", async move {
                client.publish(subject, Bytes::from_static(ack.as_bytes())).await.map_err(|e| e.to_string())?;
                client.flush().await.map_err(|e| e.to_string())
            })
            .await
            .map_err(StoreError::from)
    }

    /// Claims one delivered message: the repo's current job with its epoch raised, or
    /// `None` (acknowledged away) when the repo has no unfinished job.
    async fn claim_one(&self, did: &str, handle: &str, worker: &str) -> Result<Option<Claim>, StoreError> {
        for _ in 0..CAS_TRIES {
            let Some((mut e, rev)) = self.entry(did).await?.filter(|(e, _)| e.state != "done") else {
                self.ack(handle, "+ACK").await?;
                return Ok(None);
            };
            e.epoch += 1;
            e.state = "claimed".into();
            if self.jobs.cas(Self::key(did), e.encode(), Some(rev)).await?.is_some() {
                tracing::debug!(repo = did, worker, epoch = e.epoch, "job claimed");
                return Ok(Some(Claim {
                    did: did.to_owned(),
                    id: e.id,
                    reason: e.reason,
                    min_rev: Some(e.min_rev).filter(|r| !r.is_empty()),
                    relay: e.relay,
                    holder: e.holder,
                    token: e.token,
                    epoch: e.epoch,
                    handle: handle.to_owned(),
                }));
            }
        }
        Err(StoreError::Unavailable("a job entry kept changing".into()))
    }
}

#[async_trait]
impl JobQueue for NatsJobs {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn publish(&self, job: JobSpec<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError> {
        let seen = match self.state.read("fence-seen".into()).await? {
            Some((v, _)) => String::from_utf8_lossy(&v).parse::<u64>().unwrap_or(0),
            None => 0,
        };
        if seen > fence.token {
            return Ok(CommitOutcome::Fenced { current: Some(seen) });
        }
        let e = Entry {
            id: job.id.to_owned(),
            epoch: 0,
            state: "queued".into(),
            token: fence.token,
            holder: fence.holder.to_owned(),
            min_rev: job.min_rev.unwrap_or("").to_owned(),
            reason: job.reason.to_owned(),
            relay: job.relay.to_owned(),
            result: String::new(),
        };
        let key = Self::key(job.did);
        let value = e.encode();
        self.jobs.op("put a job", |st| async move { st.put(key, value).await }).await?;
        // The stream holds one message per repo: a repo queued already keeps its message,
        // which now delivers this job.
        Box::pin(self.consumer()).await?;
        let js = self.nats.jetstream().clone();
        let subject = format!("{}.{}", self.subject, Self::key(job.did));
        let id = job.id.to_owned();
        let sent = self
            .nats
            .bounded("publish a job", async move {
                let mut headers = nats_op::async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id.as_str());
                match js.publish_with_headers(subject, headers, Bytes::new()).await {
                    Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            })
            .await;
        match sent {
            Ok(()) => Ok(CommitOutcome::Saved),
            Err(e) if e.to_string().contains("maximum messages per subject") => Ok(CommitOutcome::Saved),
            Err(e) => Err(e.into()),
        }
    }

    async fn claim(&self, worker: &str, n: usize, idle: Duration) -> Result<Vec<Claim>, StoreError> {
        use futures_util::StreamExt as _;
        if n == 0 {
            return Ok(Vec::new());
        }
        let _ = idle;
        let consumer = Box::pin(self.consumer()).await?;
        let got = self
            .nats
            .bounded("fetch jobs", async move {
                let mut batch = consumer.fetch().max_messages(n).messages().await.map_err(|e| e.to_string())?;
                let mut out = Vec::new();
                while let Some(m) = batch.next().await {
                    let m = m.map_err(|e| e.to_string())?;
                    let reply = m.reply.as_ref().map(ToString::to_string).unwrap_or_default();
                    out.push((m.subject.to_string(), reply));
                }
                Ok::<_, String>(out)
            })
            .await
            .map_err(StoreError::from);
        let got = self.forget(got)?;
        let mut claims = Vec::with_capacity(got.len());
        for (subject, handle) in got {
            let key = subject.rsplit_once(".job.").map(|(_, k)| format!("repo.{k}"));
            let Some(did) = key.as_deref().and_then(crate::nats_store::NatsStore::repo_did) else {
                self.ack(&handle, "+ACK").await?;
                continue;
            };
            if let Some(c) = self.claim_one(&did, &handle, worker).await? {
                claims.push(c);
            }
        }
        Ok(claims)
    }

    async fn touch(&self, c: &Claim) -> Result<bool, StoreError> {
        let Some((e, _)) = self.entry(&c.did).await? else { return Ok(false) };
        if e.id != c.id || e.epoch != c.epoch || e.state == "done" {
            return Ok(false);
        }
        self.ack(&c.handle, "+WPI").await?;
        Ok(true)
    }

    async fn begin_apply(&self, c: &Claim, rev: &str) -> Result<bool, StoreError> {
        let _ = rev;
        let applied = self
            .step(c, |e| {
                let ok = e.state == "claimed";
                e.state = "applying".into();
                ok
            })
            .await?;
        if !applied && self.entry(&c.did).await?.is_some_and(|(e, _)| e.id != c.id && e.state != "done") {
            // The repo's job was replaced while this message was out: deliver it again now,
            // for the current job.
            self.ack(&c.handle, "-NAK").await?;
        }
        Ok(applied)
    }

    async fn finish(&self, c: &Claim, result: &str) -> Result<bool, StoreError> {
        let done = self
            .step(c, |e| {
                e.state = "done".into();
                result.clone_into(&mut e.result);
                true
            })
            .await?;
        if done {
            self.ack(&c.handle, "+ACK").await?;
        }
        Ok(done)
    }

    async fn state(&self, did: &str, id: &str) -> Result<JobState, StoreError> {
        Ok(match self.entry(did).await? {
            Some((e, _)) if e.id == id && e.state == "done" => JobState::Done(e.result),
            Some((e, _)) if e.id == id => JobState::Pending,
            _ => JobState::Unknown,
        })
    }

    async fn counts(&self) -> Result<JobCounts, StoreError> {
        let mut consumer = Box::pin(self.consumer()).await?;
        let info = self
            .nats
            .bounded(
                "the job consumer's info",
                async move { consumer.info().await.cloned().map_err(|e| e.to_string()) },
            )
            .await
            .map_err(StoreError::from);
        let info = self.forget(info)?;
        Ok(JobCounts { queued: info.num_pending, claimed: info.num_ack_pending as u64 })
    }
}
