//! The Postgres cursor store, for deployments whose sink writes to the same database:
//! rows and cursor then commit in one transaction ([`PostgresStore::write_in`]).
//!
//! Postgres does not see the Redis lease, so fencing here is the classic fencing-token
//! rule: the store remembers the highest token presented and refuses any lower one. A new
//! leader calls [`PostgresStore::claim`] on election, after which every commit of an
//! older term is refused — and an older term has stopped acting before the new one could
//! be elected (the lease deadline ends it `margin` before the key can expire).

use std::time::Duration;

use tokio_postgres::{Client, GenericClient, NoTls};

use crate::cursor::{self, CommitOutcome, ReadOutcome, StoreError};

/// The schema, from `migrations/` (each step idempotent, applied in order on connect).
pub const MIGRATION: &str = concat!(
    include_str!("../../../migrations/0001_cursors.sql"),
    include_str!("../../../migrations/0004_cursor_time.sql"),
    include_str!("../../../migrations/0005_repos.sql")
);

/// Cursors in Postgres.
#[derive(Debug)]
pub struct PostgresStore {
    conn: PgConn,
    op_timeout: Duration,
}

/// A Postgres connection made again when it broke (a restart, a failover, a dropped
/// link): each use takes the live client, or connects anew first (within the connect
/// timeout); nothing is retried behind the caller's back. The URL is never logged.
pub struct PgConn {
    url: String,
    connect_timeout: Duration,
    client: tokio::sync::Mutex<Option<Client>>,
    /// The schema change still to apply (before the first use of the first connection).
    migration: std::sync::Mutex<Option<String>>,
    /// How many times a broken connection was made again.
    reconnects: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for PgConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgConn").field("reconnects", &self.reconnects).finish_non_exhaustive()
    }
}

/// The live client, held for one use.
pub struct PgClient<'a>(tokio::sync::MutexGuard<'a, Option<Client>>);

impl std::ops::Deref for PgClient<'_> {
    type Target = Client;
    fn deref(&self) -> &Client {
        self.0.as_ref().expect("connected before it was handed out")
    }
}

impl std::ops::DerefMut for PgClient<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        self.0.as_mut().expect("connected before it was handed out")
    }
}

/// A key that serialises schema changes between replicas connecting at once.
const MIGRATION_LOCK: i64 = 0x6669_7265_6b65_6570; // "firekeep"

/// Applies `sql` (idempotent steps) while holding the migration lock.
pub async fn migrate(client: &Client, sql: &str) -> Result<(), tokio_postgres::Error> {
    client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]).await?;
    let out = client.batch_execute(sql).await;
    client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]).await?;
    out
}

async fn open(url: &str, timeout: Duration) -> Result<Client, StoreError> {
    let (client, conn) = within(timeout, async { tokio_postgres::connect(url, NoTls).await.map_err(pg) }).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::warn!(error = %causes::Report(&e), "postgres connection ended");
        }
    });
    Ok(client)
}

impl PgConn {
    /// Connects (`DATABASE_URL` form) and applies `migration`. A server that cannot be
    /// used now (down, refusing the credentials, the schema change failing) is not an
    /// error here: the first use connects and applies the migration then, and fails
    /// until it can, so the caller waits for Postgres as for any store (not ready, the
    /// reason named). A URL that cannot be a connection string is an error.
    pub async fn connect(url: &str, connect_timeout: Duration, migration: &str) -> Result<Self, StoreError> {
        url.parse::<tokio_postgres::Config>().map_err(|e| StoreError::InvalidUrl(Box::new(e)))?;
        let conn = Self {
            url: url.to_owned(),
            connect_timeout,
            client: tokio::sync::Mutex::new(None),
            migration: std::sync::Mutex::new(Some(migration.to_owned())),
            reconnects: std::sync::atomic::AtomicU64::new(0),
        };
        if let Err(e) = conn.client().await {
            tracing::warn!(error = %causes::Report(&e), "cannot use Postgres at start; connecting again on each use until it answers");
        }
        Ok(conn)
    }

    /// The live client, connecting again first if the last one broke (and applying the
    /// migration the first time one connects).
    pub async fn client(&self) -> Result<PgClient<'_>, StoreError> {
        let mut g = self.client.lock().await;
        if g.as_ref().is_none_or(Client::is_closed) {
            let had = g.take().is_some();
            let c = open(&self.url, self.connect_timeout).await?;
            let pending = self.migration.lock().ok().and_then(|m| m.clone());
            if let Some(sql) = pending {
                within(self.connect_timeout.max(Duration::from_secs(30)), async {
                    migrate(&c, &sql).await.map_err(pg)
                })
                .await?;
                if let Ok(mut m) = self.migration.lock() {
                    *m = None;
                }
            }
            if had {
                let n = self.reconnects.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                tracing::info!(reconnects = n, "postgres connection made again");
            }
            *g = Some(c);
        }
        Ok(PgClient(g))
    }

    /// How many times a broken connection was made again.
    #[must_use]
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(std::sync::atomic::Ordering::Relaxed)
    }
}

pub(crate) fn pg(e: tokio_postgres::Error) -> StoreError {
    // Neither the error's Display nor its cause includes the connection string; the
    // cause says what the server or the socket said ("password authentication failed").
    StoreError::Unavailable(Box::new(e))
}

pub(crate) fn as_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

pub(crate) fn as_u64(v: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Protocol(format!("{what} {v} is negative")))
}

pub(crate) async fn within<T>(
    d: Duration,
    f: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(d, f)
        .await
        .unwrap_or_else(|_| Err(StoreError::Unavailable(format!("timed out after {d:?}").into())))
}

impl PostgresStore {
    /// Connects (`DATABASE_URL` form) and applies the migration.
    pub async fn connect(url: &str, op_timeout: Duration) -> Result<Self, StoreError> {
        let conn = PgConn::connect(url, op_timeout.max(Duration::from_secs(5)), MIGRATION).await?;
        Ok(Self { conn, op_timeout })
    }

    /// The highest token presented so far (0 when none): the lease seeds its counter with
    /// it at startup, so a lease store that lost its counter cannot issue tokens this
    /// table would refuse.
    async fn fence_token(&self) -> Result<u64, StoreError> {
        within(self.op_timeout, async {
            let c = self.conn.client().await?;
            let row = c.query_opt("SELECT token FROM firekeeper_fence WHERE id", &[]).await.map_err(pg)?;
            row.map_or(Ok(0), |r| as_u64(r.get(0), "fence token"))
        })
        .await
    }

    /// Raises the fence to `token` on election; `Fenced` if a newer term already claimed.
    async fn claim(&self, token: u64) -> Result<CommitOutcome, StoreError> {
        within(self.op_timeout, async {
            let mut c = self.conn.client().await?;
            let tx = c.transaction().await.map_err(pg)?;
            let out = raise_fence(&tx, token).await?;
            tx.commit().await.map_err(pg)?;
            Ok(out.map_or(CommitOutcome::Saved, |current| CommitOutcome::Fenced { current: Some(current) }))
        })
        .await
    }

    /// The one fenced cursor write, inside the caller's transaction (the sink's, with its
    /// rows; or [`crate::CursorStore::write`]'s own). An advance keeps the larger cursor
    /// and, when saved, records the relay as the one the leader is on; a rewind sets the
    /// cursor even if lower. The relay time is written with the cursor (NULL: unknown). On
    /// `Fenced` the caller must roll back: its rows belong to a superseded term.
    pub async fn write_in(
        tx: &impl GenericClient,
        w: crate::Write<'_>,
        fence: crate::Fence<'_>,
    ) -> Result<CommitOutcome, StoreError> {
        let crate::Write { fingerprint, cursor, time_ms, kind } = w;
        cursor::check(cursor)?;
        let token = fence.token;
        if let Some(current) = raise_fence(tx, token).await? {
            return Ok(CommitOutcome::Fenced { current: Some(current) });
        }
        let sql = match kind {
            crate::WriteKind::Advance => {
                "INSERT INTO firekeeper_cursors (relay, cursor, token, time_ms) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (relay) DO UPDATE SET cursor = EXCLUDED.cursor, token = EXCLUDED.token,
                     time_ms = EXCLUDED.time_ms, updated_at = now()
                 WHERE firekeeper_cursors.cursor < EXCLUDED.cursor"
            }
            crate::WriteKind::Rewind => {
                "INSERT INTO firekeeper_cursors (relay, cursor, token, time_ms) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (relay) DO UPDATE SET cursor = EXCLUDED.cursor, token = EXCLUDED.token,
                     time_ms = EXCLUDED.time_ms, updated_at = now()"
            }
        };
        let n = tx.execute(sql, &[&fingerprint, &as_i64(cursor), &as_i64(token), &time_ms]).await.map_err(pg)?;
        if n == 0 {
            let stored: i64 = tx
                .query_one("SELECT cursor FROM firekeeper_cursors WHERE relay = $1", &[&fingerprint])
                .await
                .map_err(pg)?
                .get(0);
            return Ok(CommitOutcome::NotNewer { stored: as_u64(stored, "cursor")? });
        }
        if kind == crate::WriteKind::Advance {
            tx.execute(
                "INSERT INTO firekeeper_active_relay (id, relay, token) VALUES (true, $1, $2)
                 ON CONFLICT (id) DO UPDATE SET relay = EXCLUDED.relay, token = EXCLUDED.token, updated_at = now()",
                &[&fingerprint, &as_i64(token)],
            )
            .await
            .map_err(pg)?;
        }
        Ok(CommitOutcome::Saved)
    }

    /// The fence alone, inside the caller's transaction (a write that moves no cursor, a
    /// repo snapshot): `Fenced` when a newer term wrote (the caller must roll back), else
    /// `Saved` with the fence row locked until the transaction ends.
    pub async fn fence_in(tx: &impl GenericClient, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        Ok(match raise_fence(tx, fence.token).await? {
            Some(current) => CommitOutcome::Fenced { current: Some(current) },
            None => CommitOutcome::Saved,
        })
    }
}

/// Locks the fence row; raises it to `token`, or returns the higher current token.
pub(crate) async fn raise_fence(tx: &impl GenericClient, token: u64) -> Result<Option<u64>, StoreError> {
    tx.execute("INSERT INTO firekeeper_fence (id, token) VALUES (true, 0) ON CONFLICT (id) DO NOTHING", &[])
        .await
        .map_err(pg)?;
    let current: i64 =
        tx.query_one("SELECT token FROM firekeeper_fence WHERE id FOR UPDATE", &[]).await.map_err(pg)?.get(0);
    let current = as_u64(current, "fence token")?;
    if token < current {
        return Ok(Some(current));
    }
    if token > current {
        tx.execute("UPDATE firekeeper_fence SET token = $1 WHERE id", &[&as_i64(token)]).await.map_err(pg)?;
    }
    Ok(None)
}

#[async_trait::async_trait]
impl crate::CursorStore for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn cursor_key(&self, fingerprint: &str) -> String {
        format!("the row of firekeeper_cursors where relay = '{fingerprint}'")
    }

    fn keeps_repos(&self) -> bool {
        true
    }

    async fn write_repo(&self, w: crate::RepoWrite<'_>, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        within(self.op_timeout, async {
            let mut c = self.conn.client().await?;
            let tx = c.transaction().await.map_err(pg)?;
            if let Some(current) = raise_fence(&tx, fence.token).await? {
                return Ok(CommitOutcome::Fenced { current: Some(current) });
            }
            match w.value {
                Some(v) => tx
                    .execute(
                        "INSERT INTO firekeeper_repos (did, state, token) VALUES ($1, $2, $3)
                         ON CONFLICT (did) DO UPDATE SET state = EXCLUDED.state, token = EXCLUDED.token, updated_at = now()",
                        &[&w.did, &v, &as_i64(fence.token)],
                    )
                    .await
                    .map_err(pg)?,
                None => tx.execute("DELETE FROM firekeeper_repos WHERE did = $1", &[&w.did]).await.map_err(pg)?,
            };
            tx.commit().await.map_err(pg)?;
            Ok(CommitOutcome::Saved)
        })
        .await
    }

    async fn repos(&self) -> Result<Vec<(String, String)>, StoreError> {
        within(self.op_timeout.max(Duration::from_secs(30)), async {
            let c = self.conn.client().await?;
            let rows = c.query("SELECT did, state FROM firekeeper_repos ORDER BY did", &[]).await.map_err(pg)?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
        .await
    }

    async fn read(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError> {
        within(self.op_timeout, async {
            let c = self.conn.client().await?;
            let row = c
                .query_opt("SELECT cursor FROM firekeeper_cursors WHERE relay = $1", &[&fingerprint])
                .await
                .map_err(pg)?;
            match row {
                None => Ok(ReadOutcome::Missing),
                Some(r) => {
                    let v: i64 = r.get(0);
                    Ok(u64::try_from(v)
                        .ok()
                        .filter(|&v| v <= cursor::MAX_SEQ)
                        .map_or_else(|| ReadOutcome::Corrupt(v.to_string()), ReadOutcome::Found))
                }
            }
        })
        .await
    }

    async fn write(&self, w: crate::Write<'_>, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        within(self.op_timeout, async {
            let mut c = self.conn.client().await?;
            let tx = c.transaction().await.map_err(pg)?;
            let out = Self::write_in(&tx, w, fence).await?;
            tx.commit().await.map_err(pg)?;
            Ok(out)
        })
        .await
    }

    async fn read_time(&self, fingerprint: &str) -> Result<Option<i64>, StoreError> {
        within(self.op_timeout, async {
            let c = self.conn.client().await?;
            let row = c
                .query_opt("SELECT time_ms FROM firekeeper_cursors WHERE relay = $1", &[&fingerprint])
                .await
                .map_err(pg)?;
            Ok(row.and_then(|r| r.get::<_, Option<i64>>(0)))
        })
        .await
    }

    async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        within(self.op_timeout, async {
            let c = self.conn.client().await?;
            let row = c.query_opt("SELECT relay FROM firekeeper_active_relay WHERE id", &[]).await.map_err(pg)?;
            Ok(row.map(|r| r.get(0)))
        })
        .await
    }

    async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        cursor::check(cursor)?;
        within(self.op_timeout, async {
            let c = self.conn.client().await?;
            c.execute(
                "INSERT INTO firekeeper_cursors (relay, cursor, token) VALUES ($1, $2, 0)
                 ON CONFLICT (relay) DO UPDATE SET cursor = EXCLUDED.cursor, time_ms = NULL, updated_at = now()",
                &[&fingerprint, &as_i64(cursor)],
            )
            .await
            .map_err(pg)?;
            Ok(())
        })
        .await
    }

    async fn on_elected(&self, fence: crate::Fence<'_>, _relays: &[crate::RelayKey<'_>]) -> Result<(), StoreError> {
        match self.claim(fence.token).await? {
            CommitOutcome::Fenced { current } => {
                Err(StoreError::Protocol(format!("a newer term ({current:?}) already claimed the cursor table")))
            }
            _ => Ok(()),
        }
    }

    async fn fence_floor(&self) -> Result<Option<u64>, StoreError> {
        self.fence_token().await.map(Some)
    }
}
