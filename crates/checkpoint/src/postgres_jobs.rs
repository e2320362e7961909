//! The shared repo-sync queue in Postgres, when it is the cursor store: one row per repo
//! (`firekeeper_jobs`, `migrations/0008_jobs.sql`) holding the job that counts. A publish
//! is fenced by `firekeeper_fence` like a cursor commit; workers claim rows with
//! `FOR UPDATE SKIP LOCKED` (queued ones, and those whose claim was not touched for the
//! idle bound), each claim raising the epoch; every later step names the epoch it holds.
//! Times are the database's, so replicas' clocks do not matter.

use std::time::Duration;

use async_trait::async_trait;

use crate::cursor::{CommitOutcome, StoreError};
use crate::jobs::{Claim, JobCounts, JobQueue, JobSpec, JobState};
use crate::postgres_store::{PgConn, as_i64, as_u64, pg, raise_fence, within};
use crate::store::Fence;

/// The schema the queue needs (the fence table with it).
const MIGRATION: &str =
    concat!(include_str!("../../../migrations/0001_cursors.sql"), include_str!("../../../migrations/0008_jobs.sql"));

/// Repo-sync jobs in Postgres (see the module).
#[derive(Debug)]
pub struct PostgresJobs {
    conn: PgConn,
    op_timeout: Duration,
}

impl PostgresJobs {
    /// The queue in the database at `url` (`DATABASE_URL` form), on a connection of its own.
    pub async fn connect(url: &str, op_timeout: Duration) -> Result<Self, StoreError> {
        Ok(Self { conn: PgConn::connect(url, op_timeout, MIGRATION).await?, op_timeout })
    }

    /// One step of `c` (`sql` sets what changes; `$1..$3` are did, id and epoch, `$4` the
    /// step's argument when it has one): `true` when `c` was still the job's claim and the
    /// row changed.
    async fn step(&self, c: &Claim, sql: &str, arg: Option<&str>) -> Result<bool, StoreError> {
        within(self.op_timeout, async {
            let client = self.conn.client().await?;
            let epoch = as_i64(c.epoch);
            let n = match arg {
                Some(a) => client.execute(sql, &[&c.did, &c.id, &epoch, &a]).await,
                None => client.execute(sql, &[&c.did, &c.id, &epoch]).await,
            }
            .map_err(pg)?;
            Ok(n == 1)
        })
        .await
    }
}

#[async_trait]
impl JobQueue for PostgresJobs {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn publish(&self, job: JobSpec<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError> {
        within(self.op_timeout, async {
            let mut c = self.conn.client().await?;
            let tx = c.transaction().await.map_err(pg)?;
            if let Some(current) = raise_fence(&tx, fence.token).await? {
                return Ok(CommitOutcome::Fenced { current: Some(current) });
            }
            tx.execute(
                "INSERT INTO firekeeper_jobs (did, id, epoch, state, token, holder, min_rev, reason, relay)
                 VALUES ($1, $2, 0, 'queued', $3, $4, $5, $6, $7)
                 ON CONFLICT (did) DO UPDATE SET id = EXCLUDED.id, epoch = 0, state = 'queued',
                   token = EXCLUDED.token, holder = EXCLUDED.holder, min_rev = EXCLUDED.min_rev,
                   reason = EXCLUDED.reason, relay = EXCLUDED.relay, result = NULL, worker = NULL,
                   touched_at = NULL, queued_at = now()",
                &[
                    &job.did,
                    &job.id,
                    &as_i64(fence.token),
                    &fence.holder,
                    &job.min_rev.unwrap_or(""),
                    &job.reason,
                    &job.relay,
                ],
            )
            .await
            .map_err(pg)?;
            tx.commit().await.map_err(pg)?;
            Ok(CommitOutcome::Saved)
        })
        .await
    }

    async fn claim(&self, worker: &str, n: usize, idle: Duration) -> Result<Vec<Claim>, StoreError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        within(self.op_timeout, async {
            let client = self.conn.client().await?;
            let rows = client
                .query(
                    "UPDATE firekeeper_jobs j SET epoch = j.epoch + 1, state = 'claimed', worker = $1, touched_at = now()
                     FROM (SELECT did FROM firekeeper_jobs
                           WHERE state = 'queued'
                              OR (state IN ('claimed', 'applying') AND touched_at < now() - make_interval(secs => $2))
                           ORDER BY state = 'queued', queued_at
                           LIMIT $3 FOR UPDATE SKIP LOCKED) c
                     WHERE j.did = c.did
                     RETURNING j.did, j.id, j.reason, j.min_rev, j.relay, j.holder, j.token, j.epoch",
                    &[&worker, &idle.as_secs_f64(), &i64::try_from(n).unwrap_or(i64::MAX)],
                )
                .await
                .map_err(pg)?;
            rows.iter()
                .map(|r| {
                    Ok(Claim {
                        did: r.get(0),
                        id: r.get(1),
                        reason: r.get(2),
                        min_rev: Some(r.get::<_, String>(3)).filter(|m| !m.is_empty()),
                        relay: r.get(4),
                        holder: r.get(5),
                        token: as_u64(r.get(6), "job token")?,
                        epoch: as_u64(r.get(7), "job epoch")?,
                        handle: String::new(),
                    })
                })
                .collect()
        })
        .await
    }

    async fn touch(&self, c: &Claim) -> Result<bool, StoreError> {
        self.step(
            c,
            "UPDATE firekeeper_jobs SET touched_at = now()
             WHERE did = $1 AND id = $2 AND epoch = $3 AND state <> 'done'",
            None,
        )
        .await
    }

    async fn begin_apply(&self, c: &Claim, rev: &str) -> Result<bool, StoreError> {
        let _ = rev;
        self.step(
            c,
            "UPDATE firekeeper_jobs SET state = 'applying', touched_at = now()
             WHERE did = $1 AND id = $2 AND epoch = $3 AND state = 'claimed'",
            None,
        )
        .await
    }

    async fn finish(&self, c: &Claim, result: &str) -> Result<bool, StoreError> {
        self.step(
            c,
            "UPDATE firekeeper_jobs SET state = 'done', result = $4, touched_at = now()
             WHERE did = $1 AND id = $2 AND epoch = $3 AND state <> 'done'",
            Some(result),
        )
        .await
    }

    async fn state(&self, did: &str, id: &str) -> Result<JobState, StoreError> {
        within(self.op_timeout, async {
            let client = self.conn.client().await?;
            let row = client
                .query_opt("SELECT state, result FROM firekeeper_jobs WHERE did = $1 AND id = $2", &[&did, &id])
                .await
                .map_err(pg)?;
            Ok(match row {
                None => JobState::Unknown,
                Some(r) if r.get::<_, String>(0) == "done" => {
                    JobState::Done(r.get::<_, Option<String>>(1).unwrap_or_default())
                }
                Some(_) => JobState::Pending,
            })
        })
        .await
    }

    async fn counts(&self) -> Result<JobCounts, StoreError> {
        within(self.op_timeout, async {
            let client = self.conn.client().await?;
            // Results the leader read long ago go (the leader reads one within seconds).
            client
                .execute(
                    "DELETE FROM firekeeper_jobs WHERE state = 'done' AND touched_at < now() - interval '1 day'",
                    &[],
                )
                .await
                .map_err(pg)?;
            let r = client
                .query_one(
                    "SELECT count(*) FILTER (WHERE state = 'queued'),
                            count(*) FILTER (WHERE state IN ('claimed', 'applying'))
                     FROM firekeeper_jobs",
                    &[],
                )
                .await
                .map_err(pg)?;
            Ok(JobCounts { queued: as_u64(r.get(0), "count")?, claimed: as_u64(r.get(1), "count")? })
        })
        .await
    }
}
