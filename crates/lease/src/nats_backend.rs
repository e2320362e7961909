//! The NATS JetStream KV lease store.
//!
//! Two buckets per deployment (`<prefix>` must be bucket-safe, `[A-Za-z0-9_-]`: it is
//! refused otherwise, never folded):
//! - `<prefix>-lease`, whose entries expire `ttl` after their last write (the bucket's
//!   max age, raised to the largest ttl any replica opened it with and never lowered, so
//!   a replica with a shorter ttl cannot expire a running leader's key early): key `leader` = `<instance>:<token>`. `create` wins it, `update` with the
//!   revision read renews it, `delete` with that revision releases it.
//! - `<prefix>-state`, never expiring: key `fence` = the last token issued, and
//!   `fence-seen` = the highest token a cursor commit presented (written by the NATS
//!   cursor store).
//!
//! **Fencing tokens.** KV revisions are stream sequences: they restart at 1 when a bucket
//! is lost, so they cannot be the token by themselves. A candidate instead raises `fence`
//! by compare-and-set on its revision to `max(fence, fence-seen, floor) + 1` (floor: the
//! highest token this process saw, seeded at start from the cursor store), then creates
//! `leader`, then reads `fence` again: if it moved past its token, another candidate may
//! have been elected in between, so it deletes its key and stays standby. A term thus
//! starts only with a token above every earlier term's, across bucket loss as long as the
//! state bucket, the cursor store or any replica remembers one.
//!
//! Standbys watch `leader`: a delete (a release) wakes them at once. Expiry by age leaves
//! no marker, so a crashed leader is noticed by polling, as with Redis.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use nats_op::async_nats::jetstream::kv::{self, Operation, UpdateErrorKind};
use nats_op::{Bucket, Nats, NatsError, bucket_name};
use tokio::sync::Notify;

use crate::backend::{Acquire, Backend, BackendError, Renew, Snapshot, parse_holder};

const LEADER: &str = "leader";
const FENCE: &str = "fence";
/// The settings record of the latest term: `<token>\n<record>`.
const DEPLOYMENT: &str = "deployment";
/// Written by the NATS cursor store: the highest token a commit presented.
pub const FENCE_SEEN: &str = "fence-seen";

/// The state bucket's name for a key prefix (shared with the NATS cursor store).
#[must_use]
pub fn state_bucket(prefix: &str) -> String {
    bucket_name(prefix, "state")
}

impl From<NatsError> for BackendError {
    fn from(e: NatsError) -> Self {
        match e {
            NatsError::Timeout { after, cause: None, .. } => Self::Timeout(after),
            other => Self::Unavailable(Box::new(other)),
        }
    }
}

fn protocol(what: impl Into<String>) -> BackendError {
    BackendError::Protocol(what.into())
}

fn number(v: &[u8], what: &str) -> Result<u64, BackendError> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| protocol(format!("{what} {:?} is not a non-negative integer", String::from_utf8_lossy(v))))
}

/// The NATS KV backend.
pub struct NatsBackend {
    lease: Bucket,
    state: Bucket,
    released: Arc<Notify>,
    watcher: tokio::task::JoinHandle<()>,
    /// Keeps the lease bucket's age limit at least the ttl (see [`keep_age`]).
    age_keeper: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for NatsBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBackend")
            .field("lease", &self.lease.name())
            .field("state", &self.state.name())
            .finish_non_exhaustive()
    }
}

impl Drop for NatsBackend {
    fn drop(&mut self) {
        self.watcher.abort();
        self.age_keeper.abort();
    }
}

impl NatsBackend {
    /// Buckets under `prefix`; the lease bucket's entries expire `ttl` after their last
    /// write (an existing bucket with a shorter age limit is raised to `ttl`; one with a
    /// longer limit is kept).
    #[must_use]
    pub fn new(nats: &Nats, prefix: &str, ttl: Duration) -> Self {
        let lease = Bucket::new(nats.clone(), bucket_name(prefix, "lease"), ttl);
        let state = Bucket::new(nats.clone(), state_bucket(prefix), Duration::ZERO);
        let released = Arc::new(Notify::new());
        let watcher = tokio::spawn(watch_releases(lease.clone(), released.clone()));
        let age_keeper = tokio::spawn(keep_age(lease.clone(), ttl));
        Self { lease, state, released, watcher, age_keeper }
    }

    async fn read(&self, bucket: &Bucket, key: &'static str) -> Result<Option<(Bytes, u64)>, BackendError> {
        Ok(bucket.read(key.to_owned()).await?)
    }

    async fn number_at(&self, key: &'static str) -> Result<(u64, Option<u64>), BackendError> {
        match self.read(&self.state, key).await? {
            Some((v, rev)) => Ok((number(&v, key)?, Some(rev))),
            None => Ok((0, None)),
        }
    }

    /// Sets a state key to `value` if it is still at `rev` (`None`: absent); `false`
    /// when another writer got there first.
    async fn cas_state(&self, key: &'static str, value: u64, rev: Option<u64>) -> Result<bool, BackendError> {
        Ok(self.state.cas(key.to_owned(), Bytes::from(value.to_string()), rev).await?.is_some())
    }

    /// Creates `leader` = `value` and returns its revision; `None` when someone holds it.
    async fn create_leader(&self, value: &str) -> Result<Option<u64>, BackendError> {
        Ok(self.lease.cas(LEADER.to_owned(), Bytes::from(value.to_owned()), None).await?)
    }

    async fn delete_leader(&self, rev: u64) -> Result<(), BackendError> {
        Ok(self.lease.op("release", |st| async move { st.delete_expect_revision(LEADER, Some(rev)).await }).await?)
    }

    /// How long a holder's entry has left: the bucket's age limit from the entry's write
    /// time (the server's clock, so only as good as the clocks agree).
    fn expires_in(created: &kv::Entry, ttl: Duration) -> Option<Duration> {
        let written = std::time::SystemTime::UNIX_EPOCH
            + Duration::from_nanos(u64::try_from(created.created.unix_timestamp_nanos()).ok()?);
        let age = std::time::SystemTime::now().duration_since(written).unwrap_or(Duration::ZERO);
        Some(ttl.saturating_sub(age))
    }

    /// The current holder, with how long its key has left; `None` when nobody holds it.
    async fn held(&self, ttl: Duration) -> Result<Option<Acquire>, BackendError> {
        let entry = self.lease.op("read", |st| async move { st.entry(LEADER).await }).await?;
        Ok(entry.filter(|e| e.operation == Operation::Put).map(|e| Acquire::Held {
            holder: String::from_utf8_lossy(&e.value).into_owned(),
            expires_in: Some(Self::expires_in(&e, ttl).unwrap_or(ttl)),
        }))
    }

    /// After creating `leader` with `token`: `true` if no candidate raised the fence past
    /// it meanwhile; else the key is deleted again.
    async fn confirm(&self, token: u64, rev: u64) -> Result<bool, BackendError> {
        let (fence, _) = self.number_at(FENCE).await?;
        if fence == token {
            return Ok(true);
        }
        tracing::debug!(token, fence, "another candidate raised the fence while we created the lease; backing off");
        self.delete_leader(rev).await?;
        Ok(false)
    }
}

impl NatsBackend {
    /// [`Backend::acquire`], running `between` after the fence was raised and before the
    /// lease key is created: the seam where another candidate can interleave, for tests
    /// of that race (`acquire` runs nothing there).
    pub async fn acquire_with(
        &self,
        instance: &str,
        ttl: Duration,
        floor: u64,
        between: impl Future<Output = ()>,
    ) -> Result<Acquire, BackendError> {
        if let Some(held) = self.held(ttl).await? {
            return Ok(held);
        }
        let (fence, rev) = self.number_at(FENCE).await?;
        let (seen, _) = self.number_at(FENCE_SEEN).await?;
        let token = fence.max(seen).max(floor) + 1;
        if !self.cas_state(FENCE, token, rev).await? {
            return Err(BackendError::Unavailable("another replica is acquiring the lease; retrying".into()));
        }
        between.await;
        let Some(lrev) = self.create_leader(&format!("{instance}:{token}")).await? else {
            // Another candidate created the key first: report it with its expiry, as
            // above, so this standby knows how long that holder may lead even if the
            // store loses the key (issue 34's CI run: a `None` here let a standby start
            // a term beside a leader whose key NATS lost in a restart).
            return Ok(self.held(ttl).await?.unwrap_or_else(|| Acquire::Held {
                holder: "<released meanwhile>".to_owned(),
                expires_in: Some(ttl),
            }));
        };
        if self.confirm(token, lrev).await? {
            Ok(Acquire::Acquired { token })
        } else {
            Err(BackendError::Unavailable("another replica raised the fence while acquiring; retrying".into()))
        }
    }
}

#[async_trait::async_trait]
impl Backend for NatsBackend {
    async fn acquire(&self, instance: &str, ttl: Duration, floor: u64) -> Result<Acquire, BackendError> {
        self.acquire_with(instance, ttl, floor, async {}).await
    }

    async fn renew(&self, instance: &str, token: u64, _ttl: Duration) -> Result<Renew, BackendError> {
        let value = format!("{instance}:{token}");
        if let Some((v, rev)) = self.read(&self.lease, LEADER).await? {
            if v.as_ref() != value.as_bytes() {
                return Ok(Renew::TakenBy { holder: String::from_utf8_lossy(&v).into_owned() });
            }
            let body = Bytes::from(value.clone());
            let renewed = self
                .lease
                .op("renew", |st| async move {
                    match st.update(LEADER, body, rev).await {
                        Ok(_) => Ok(true),
                        Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(false),
                        Err(e) => Err(e.to_string()),
                    }
                })
                .await?;
            if renewed {
                return Ok(Renew::Renewed);
            }
            // Changed between our read and write: say what it is now.
            return match self.read(&self.lease, LEADER).await? {
                Some((v, _)) if v.as_ref() != value.as_bytes() => {
                    Ok(Renew::TakenBy { holder: String::from_utf8_lossy(&v).into_owned() })
                }
                _ => Err(BackendError::Unavailable("the lease changed while renewing; retrying".into())),
            };
        }
        // Vanished: retake it if no term began since (the fence is at or below our token,
        // or gone with the state bucket).
        let (fence, rev) = self.number_at(FENCE).await?;
        if fence > token {
            return Ok(Renew::Fenced { fence: Some(fence) });
        }
        if (fence < token || rev.is_none()) && !self.cas_state(FENCE, token, rev).await? {
            return Err(BackendError::Unavailable("the fence moved while retaking; retrying".into()));
        }
        match self.create_leader(&value).await? {
            Some(lrev) if self.confirm(token, lrev).await? => Ok(Renew::Retaken),
            Some(_) => Ok(Renew::Fenced { fence: Some(self.number_at(FENCE).await?.0) }),
            None => match self.read(&self.lease, LEADER).await? {
                Some((v, _)) => Ok(Renew::TakenBy { holder: String::from_utf8_lossy(&v).into_owned() }),
                None => Err(BackendError::Unavailable("the lease changed while retaking; retrying".into())),
            },
        }
    }

    async fn release(&self, instance: &str) -> Result<bool, BackendError> {
        let Some((v, rev)) = self.read(&self.lease, LEADER).await? else { return Ok(false) };
        let ours = parse_holder(&String::from_utf8_lossy(&v)).is_some_and(|(i, _)| i == instance);
        if !ours {
            return Ok(false);
        }
        self.delete_leader(rev).await?;
        Ok(true)
    }

    async fn seed_fence(&self, min: u64) -> Result<u64, BackendError> {
        for _ in 0..5 {
            let (fence, rev) = self.number_at(FENCE).await?;
            let (seen, _) = self.number_at(FENCE_SEEN).await?;
            let v = fence.max(seen).max(min);
            if v == fence && rev.is_some() {
                return Ok(v);
            }
            if self.cas_state(FENCE, v, rev).await? {
                return Ok(v);
            }
        }
        Err(BackendError::Unavailable("the fence kept moving while seeding it".into()))
    }

    async fn snapshot(&self) -> Result<Snapshot, BackendError> {
        let entry = self.lease.op("read", |st| async move { st.entry(LEADER).await }).await?;
        let entry = entry.filter(|e| e.operation == Operation::Put);
        let holder = entry.as_ref().map(|e| String::from_utf8_lossy(&e.value).into_owned());
        let ttl = self.lease.op("status", |st| async move { st.status().await }).await.ok().map(|s| s.max_age());
        let left = match (entry, ttl) {
            (Some(e), Some(t)) => Self::expires_in(&e, t),
            _ => None,
        };
        Ok(Snapshot {
            holder,
            fence: self.number_at(FENCE).await?.0,
            fence_seen: self.number_at(FENCE_SEEN).await?.0,
            ttl: left,
        })
    }

    fn release_signal(&self) -> Option<Arc<Notify>> {
        Some(self.released.clone())
    }

    async fn deployment(&self) -> Result<Option<(u64, String)>, BackendError> {
        let Some((v, _)) = self.read(&self.state, DEPLOYMENT).await? else { return Ok(None) };
        let text = String::from_utf8_lossy(&v);
        crate::backend::split_deployment(&text).map(Some).ok_or_else(|| {
            protocol(format!(
                "{DEPLOYMENT} holds {:?}, not <token>\\n<settings>",
                text.chars().take(60).collect::<String>()
            ))
        })
    }

    async fn set_deployment(&self, token: u64, record: &str) -> Result<bool, BackendError> {
        let value = Bytes::from(format!("{token}\n{record}"));
        for _ in 0..5 {
            let current = self.read(&self.state, DEPLOYMENT).await?;
            let rev = match &current {
                Some((v, rev)) => {
                    let later =
                        crate::backend::split_deployment(&String::from_utf8_lossy(v)).is_some_and(|(t, _)| t > token);
                    if later {
                        return Ok(false);
                    }
                    Some(*rev)
                }
                None => None,
            };
            if self.state.cas(DEPLOYMENT.to_owned(), value.clone(), rev).await?.is_some() {
                return Ok(true);
            }
        }
        Err(BackendError::Unavailable("the settings record kept changing while writing it".into()))
    }
}

/// Checks the lease bucket's age limit every third of the ttl and raises it back when
/// something lowered it below the ttl (an older replica, an operator): off the renewal
/// path, so a slow link does not slow renewals.
async fn keep_age(lease: Bucket, ttl: Duration) {
    let every = (ttl / 3).max(Duration::from_millis(100));
    loop {
        tokio::time::sleep(every).await;
        if let Err(e) = lease.ensure_age().await {
            tracing::debug!(error = %e, "checking the lease bucket's age limit");
        }
    }
}

/// Watches `leader` and wakes standbys when it is deleted (a release).
async fn watch_releases(lease: Bucket, released: Arc<Notify>) {
    lease
        .follow(LEADER, |e| {
            if matches!(e.operation, Operation::Delete | Operation::Purge) {
                released.notify_waiters();
            }
        })
        .await;
}
