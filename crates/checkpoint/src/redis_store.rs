//! The Redis cursor store. A commit is one Lua script that checks the lease still holds
//! the committer's token, never moves the cursor backwards, and records the highest
//! token seen (so a Redis that lost its fence counter cannot reissue old tokens).

use std::time::Duration;

use redis::{Script, Value};
use redis_op::{Conn, OpError};

use crate::cursor::{self, CommitOutcome, ReadOutcome, StoreError};

/// Key names. The lease key and the fence-seen key come from the lease configuration,
/// so both crates agree without depending on each other.
#[derive(Debug, Clone)]
pub struct RedisKeys {
    /// The lease key (`<instance>:<token>`).
    pub lease: String,
    /// Highest token any commit presented.
    pub fence_seen: String,
    /// Cursor keys are `<cursor_prefix><fingerprint>`; use the lease's hash tag, e.g.
    /// `{firekeeper}:cursor:`, so scripts touching both work on Redis Cluster.
    pub cursor_prefix: String,
    /// Legacy cursors were `<legacy_prefix>:<host>`; `None` disables migration.
    pub legacy_prefix: Option<String>,
    /// Every saved commit is published here as `<fingerprint> <cursor> <token>`, so
    /// standbys shadow the committed cursor and a store that loses its data (restart
    /// without persistence, FLUSHALL) costs no events.
    pub commits_channel: String,
    /// Relay time (Unix ms) of the event at each cursor: `<time_prefix><fingerprint>`.
    pub time_prefix: String,
    /// The fingerprint of the relay the last committing leader was on.
    pub active: String,
    /// Repos that need repair: a hash of DID → the consumer's state.
    pub repos: String,
}

impl RedisKeys {
    /// Keys under `{<prefix>}:` (the same hash tag as the lease).
    #[must_use]
    pub fn new(prefix: &str, legacy_prefix: Option<&str>) -> Self {
        Self {
            lease: format!("{{{prefix}}}:lease"),
            fence_seen: format!("{{{prefix}}}:fence-seen"),
            cursor_prefix: format!("{{{prefix}}}:cursor:"),
            legacy_prefix: legacy_prefix.map(str::to_owned),
            commits_channel: format!("{{{prefix}}}:commits"),
            time_prefix: format!("{{{prefix}}}:cursor-time:"),
            active: format!("{{{prefix}}}:active-relay"),
            repos: format!("{{{prefix}}}:repos"),
        }
    }

    /// The cursor key of a relay fingerprint.
    #[must_use]
    pub fn cursor(&self, fingerprint: &str) -> String {
        format!("{}{fingerprint}", self.cursor_prefix)
    }
}

/// `body` after the shared Lua helpers, with `MAX_SEQ` spelled out (16 digits, so the
/// string comparison in `valid` is numeric).
fn script(body: &str) -> String {
    const _: () = assert!(crate::MAX_SEQ >= 1_000_000_000_000_000 && crate::MAX_SEQ < 10_000_000_000_000_000);
    format!("{}{body}", HELPERS.replace("MAX_SEQ", &crate::MAX_SEQ.to_string()))
}

const HELPERS: &str = r"
local function valid(v)
  if not v or string.len(v) == 0 or string.len(v) > 16 then return false end
  if not string.match(v, '^[0-9]+$') then return false end
  if v ~= '0' and string.sub(v, 1, 1) == '0' then return false end
  if string.len(v) < 16 then return true end
  return v <= 'MAX_SEQ'
end
local function gt(a, b)
  if string.len(a) ~= string.len(b) then return string.len(a) > string.len(b) end
  return a > b
end
";

// KEYS: lease, cursor, fence-seen, cursor time, active relay. ARGV: token, cursor,
// commits channel, fingerprint, holder (the whole lease value), reset ('1': a fenced
// rewind, allowed to go lower), the relay time at the cursor ('' = unknown).
// The whole holder value must match, not only its token: a token number re-issued after
// total data loss must not let a stale holder commit.
const COMMIT: &str = r"
local h = redis.call('GET', KEYS[1])
local t = h and string.match(h, ':([0-9]+)$')
if h ~= ARGV[5] then return {3, t or ''} end
local cur = redis.call('GET', KEYS[2])
if ARGV[6] ~= '1' and valid(cur) and not gt(ARGV[2], cur) then return {2, cur} end
redis.call('SET', KEYS[2], ARGV[2])
if ARGV[7] ~= '' then redis.call('SET', KEYS[4], ARGV[7]) else redis.call('DEL', KEYS[4]) end
redis.call('SET', KEYS[5], ARGV[4])
local seen = redis.call('GET', KEYS[3])
if not valid(seen) or gt(ARGV[1], seen) then redis.call('SET', KEYS[3], ARGV[1]) end
local msg = ARGV[4] .. ' ' .. ARGV[2] .. ' ' .. ARGV[1]
if ARGV[6] == '1' then msg = msg .. ' reset' end
redis.call('PUBLISH', ARGV[3], msg)
return {1, ''}
";

// KEYS: lease, repos, fence-seen. ARGV: holder (the whole lease value), token, did,
// '1' to set (else clear), value. Fenced like a commit.
const REPO: &str = r"
local h = redis.call('GET', KEYS[1])
local t = h and string.match(h, ':([0-9]+)$')
if h ~= ARGV[1] then return {3, t or ''} end
if ARGV[4] == '1' then redis.call('HSET', KEYS[2], ARGV[3], ARGV[5]) else redis.call('HDEL', KEYS[2], ARGV[3]) end
local seen = redis.call('GET', KEYS[3])
if not valid(seen) or gt(ARGV[2], seen) then redis.call('SET', KEYS[3], ARGV[2]) end
return {1, ''}
";

// KEYS: legacy, cursor. Atomic max of the legacy value into the new key.
// Returns {0, ''} when there is no valid legacy value, else {1, legacy value}.
const MIGRATE: &str = r"
local old = redis.call('GET', KEYS[1])
if not valid(old) then return {0, old or ''} end
local new = redis.call('GET', KEYS[2])
if not valid(new) or gt(old, new) then redis.call('SET', KEYS[2], old) end
return {1, old}
";

// KEYS: legacy. ARGV: the value seen. Deletes only if unchanged since.
const DELETE_IF: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

/// Cursors in Redis.
#[derive(Debug)]
pub struct RedisStore {
    conn: Conn,
    /// For the commits channel's own connection; never logged.
    url: String,
    keys: RedisKeys,
    commit: Script,
    migrate: Script,
    delete_if: Script,
    repo: Script,
}

#[allow(clippy::needless_pass_by_value)] // the shape `map_err` wants
fn err(e: OpError) -> StoreError {
    StoreError::Unavailable(Box::new(e))
}

impl RedisStore {
    /// A store on `url` with a hard per-call timeout.
    pub fn new(url: &str, keys: RedisKeys, op_timeout: Duration) -> Result<Self, StoreError> {
        Ok(Self {
            conn: Conn::open(url, op_timeout).map_err(err)?,
            url: url.to_owned(),
            keys,
            commit: Script::new(&script(COMMIT)),
            migrate: Script::new(&script(MIGRATE)),
            delete_if: Script::new(DELETE_IF),
            repo: Script::new(&script(REPO)),
        })
    }

    /// The key names.
    #[must_use]
    pub fn keys(&self) -> &RedisKeys {
        &self.keys
    }

    /// Reads a relay's cursor. Unavailable is an error: never subscribe on a guess.
    pub async fn read(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError> {
        let key = self.keys.cursor(fingerprint);
        let raw: Option<Vec<u8>> = self
            .conn
            .run(|mut c| async move { redis::cmd("GET").arg(&key).query_async(&mut c).await })
            .await
            .map_err(err)?;
        let out = cursor::classify(raw.as_deref());
        if let ReadOutcome::Corrupt(p) = &out {
            tracing::error!(relay = fingerprint, value = %p, "stored cursor is corrupt");
        }
        Ok(out)
    }

    /// The relay time kept with a cursor.
    pub async fn read_time(&self, fingerprint: &str) -> Result<Option<i64>, StoreError> {
        self.get_int(format!("{}{fingerprint}", self.keys.time_prefix)).await
    }

    /// The relay the last committing leader was on.
    pub async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        let key = self.keys.active.clone();
        self.conn.run(|mut c| async move { redis::cmd("GET").arg(&key).query_async(&mut c).await }).await.map_err(err)
    }

    async fn get_int(&self, key: String) -> Result<Option<i64>, StoreError> {
        let raw: Option<String> = self
            .conn
            .run(|mut c| async move { redis::cmd("GET").arg(&key).query_async(&mut c).await })
            .await
            .map_err(err)?;
        Ok(raw.and_then(|r| r.parse().ok()))
    }

    /// The one fenced cursor write ([`crate::CursorStore::write`]), as lease holder
    /// `holder` (`<instance>:<token>`, the whole lease value, compared in the script): an
    /// advance never moves the cursor backwards; a rewind may (a relay whose sequence
    /// restarted, an accepted `FutureCursor` gap).
    async fn put(&self, w: crate::Write<'_>, holder: &str) -> Result<CommitOutcome, StoreError> {
        let crate::Write { fingerprint, cursor, time_ms, kind } = w;
        let reset = kind == crate::WriteKind::Rewind;
        cursor::check(cursor)?;
        let token = cursor::holder_token(holder)?;
        let k = &self.keys;
        let key = k.cursor(fingerprint);
        let time_key = format!("{}{fingerprint}", k.time_prefix);
        let time = time_ms.map(|t| t.to_string()).unwrap_or_default();
        let v: Value = self
            .conn
            .run(|mut c| async move {
                self.commit
                    .key(&k.lease)
                    .key(&key)
                    .key(&k.fence_seen)
                    .key(&time_key)
                    .key(&k.active)
                    .arg(token)
                    .arg(cursor)
                    .arg(&k.commits_channel)
                    .arg(fingerprint)
                    .arg(holder)
                    .arg(if reset { "1" } else { "0" })
                    .arg(&time)
                    .invoke_async(&mut c)
                    .await
            })
            .await
            .map_err(err)?;
        match redis_op::pair(&v).map_err(StoreError::Protocol)? {
            (1, _) => Ok(CommitOutcome::Saved),
            (2, stored) => Ok(CommitOutcome::NotNewer {
                stored: cursor::parse(stored.as_bytes())
                    .ok_or_else(|| StoreError::Protocol(format!("stored {stored:?}")))?,
            }),
            (3, holder) => Ok(CommitOutcome::Fenced { current: holder.parse().ok() }),
            other => Err(StoreError::Protocol(format!("commit answered {other:?}"))),
        }
    }

    /// Operator override (`firekeeper cursor set`): writes the cursor unconditionally.
    async fn force_cursor(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        cursor::check(cursor)?;
        let key = self.keys.cursor(fingerprint);
        let time_key = format!("{}{fingerprint}", self.keys.time_prefix);
        self.conn
            .run(|mut c| async move {
                // The operator's cursor has no known time: drop the older cursor's.
                redis::pipe().atomic().set(&key, cursor).del(&time_key).query_async::<()>(&mut c).await
            })
            .await
            .map_err(err)
    }

    /// Migrates a legacy `<legacy_prefix>:<host>` cursor into the fingerprint key.
    ///
    /// Only for root relay URLs (`is_root`): on a URL with a path the host key is
    /// ambiguous and an existing one is an error telling the operator to preseed. The
    /// new key never moves backwards; the old key is deleted only after a re-read shows
    /// the new key at or beyond it, and only if nobody changed it meanwhile.
    /// Returns the migrated legacy value, if any.
    pub async fn migrate_legacy(
        &self,
        fingerprint: &str,
        host: &str,
        is_root: bool,
    ) -> Result<Option<u64>, StoreError> {
        let Some(prefix) = &self.keys.legacy_prefix else {
            return Ok(None);
        };
        let legacy = &format!("{prefix}:{host}");
        let new = &self.keys.cursor(fingerprint);
        if !is_root {
            let exists: bool = self
                .conn
                .run(|mut c| async move { redis::cmd("EXISTS").arg(legacy).query_async(&mut c).await })
                .await
                .map_err(err)?;
            return if exists { Err(StoreError::LegacyAmbiguous { host: host.to_owned() }) } else { Ok(None) };
        }
        let v: Value = self
            .conn
            .run(|mut c| async move { self.migrate.key(legacy).key(new).invoke_async(&mut c).await })
            .await
            .map_err(err)?;
        let (code, old) = redis_op::pair(&v).map_err(StoreError::Protocol)?;
        if code == 0 {
            if !old.is_empty() {
                tracing::error!(host, value = %cursor::preview(old.as_bytes()), "legacy cursor is corrupt; not migrated");
            }
            return Ok(None);
        }
        let old = &old;
        let old_v = cursor::parse(old.as_bytes()).ok_or_else(|| StoreError::Protocol(format!("legacy {old:?}")))?;
        match self.read(fingerprint).await? {
            ReadOutcome::Found(n) if n >= old_v => {}
            other => {
                return Err(StoreError::Protocol(format!("after migrating {old_v}, the new key reads {other:?}")));
            }
        }
        let _: i64 = self
            .conn
            .run(|mut c| async move { self.delete_if.key(legacy).arg(old).invoke_async(&mut c).await })
            .await
            .map_err(err)?;
        tracing::info!(relay = fingerprint, cursor = old_v, "migrated legacy host-keyed cursor");
        Ok(Some(old_v))
    }
}

/// One saved commit as published on the commits channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published<'a> {
    /// The relay fingerprint.
    pub fingerprint: &'a str,
    /// The cursor saved.
    pub cursor: u64,
    /// A fenced rewind ([`RedisStore::reset`]): replace, do not take the maximum.
    pub reset: bool,
}

/// Follows the commits channel and calls `seen` for every saved commit of any replica,
/// reconnecting after errors, until the task is dropped.
pub async fn follow_commits(url: String, channel: String, mut seen: impl FnMut(Published<'_>) + Send) {
    use futures_util::StreamExt;
    let Ok(client) = redis_op::client(&url) else { return };
    loop {
        if let Ok(Ok(mut ps)) = tokio::time::timeout(Duration::from_secs(5), client.get_async_pubsub()).await
            && ps.subscribe(&channel).await.is_ok()
        {
            let mut msgs = ps.on_message();
            while let Some(m) = msgs.next().await {
                let Ok(text) = m.get_payload::<String>() else { continue };
                let mut it = text.split(' ');
                if let (Some(fp), Some(c)) = (it.next(), it.next().and_then(|c| cursor::parse(c.as_bytes()))) {
                    let reset = it.nth(1) == Some("reset");
                    seen(Published { fingerprint: fp, cursor: c, reset });
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[async_trait::async_trait]
impl crate::CursorStore for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn cursor_key(&self, fingerprint: &str) -> String {
        format!("the Redis key {}", self.keys.cursor(fingerprint))
    }

    async fn read(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError> {
        Self::read(self, fingerprint).await
    }

    async fn write(&self, w: crate::Write<'_>, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        self.put(w, fence.holder).await
    }

    async fn read_time(&self, fingerprint: &str) -> Result<Option<i64>, StoreError> {
        Self::read_time(self, fingerprint).await
    }

    async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        Self::active_relay(self).await
    }

    async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        self.force_cursor(fingerprint, cursor).await
    }

    async fn on_elected(&self, _fence: crate::Fence<'_>, relays: &[crate::RelayKey<'_>]) -> Result<(), StoreError> {
        for r in relays {
            self.migrate_legacy(r.fingerprint, r.host_port, r.is_root).await?;
        }
        Ok(())
    }

    fn keeps_repos(&self) -> bool {
        true
    }

    async fn write_repo(&self, w: crate::RepoWrite<'_>, fence: crate::Fence<'_>) -> Result<CommitOutcome, StoreError> {
        let k = &self.keys;
        let v: Value = self
            .conn
            .run(|mut c| async move {
                self.repo
                    .key(&k.lease)
                    .key(&k.repos)
                    .key(&k.fence_seen)
                    .arg(fence.holder)
                    .arg(fence.token)
                    .arg(w.did)
                    .arg(if w.value.is_some() { "1" } else { "0" })
                    .arg(w.value.unwrap_or(""))
                    .invoke_async(&mut c)
                    .await
            })
            .await
            .map_err(err)?;
        match redis_op::pair(&v).map_err(StoreError::Protocol)? {
            (1, _) => Ok(CommitOutcome::Saved),
            (3, holder) => Ok(CommitOutcome::Fenced { current: holder.parse().ok() }),
            other => Err(StoreError::Protocol(format!("repo write answered {other:?}"))),
        }
    }

    async fn repos(&self) -> Result<Vec<(String, String)>, StoreError> {
        let mut out = Vec::new();
        let mut cursor = 0u64;
        loop {
            let key = self.keys.repos.clone();
            let (next, page): (u64, Vec<(String, String)>) = self
                .conn
                .run(|mut c| async move {
                    redis::cmd("HSCAN").arg(&key).arg(cursor).arg("COUNT").arg(1000).query_async(&mut c).await
                })
                .await
                .map_err(err)?;
            out.extend(page);
            if next == 0 {
                return Ok(out);
            }
            cursor = next;
        }
    }

    async fn follow_commits(&self, mut seen: crate::OnCommit) {
        follow_commits(self.url.clone(), self.keys.commits_channel.clone(), move |p| {
            seen(p.fingerprint, p.cursor, p.reset);
        })
        .await;
    }
}
