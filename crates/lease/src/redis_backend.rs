//! The Redis lease store: acquire, renew (with retake), release and fence seeding, each
//! one Lua script, with keys under one hash tag so they work on Redis Cluster.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::{Script, Value};
use redis_op::{Conn, OpError};
use tokio::sync::Notify;

use crate::backend::{Acquire, Backend, BackendError, Renew, Snapshot};

/// Key names for one deployment.
#[derive(Debug, Clone)]
pub struct Keys {
    /// The lease key: `<instance>:<token>` with a ttl.
    pub lease: String,
    /// The fence counter: the last token issued.
    pub fence: String,
    /// The highest token a checkpoint commit has seen (written by the checkpoint store).
    pub fence_seen: String,
    /// The channel release messages go to.
    pub channel: String,
    /// The settings record of the latest term: `<token>\n<record>`.
    pub deployment: String,
}

impl Keys {
    /// Keys `{<prefix>}:lease`, `{<prefix>}:fence`, `{<prefix>}:fence-seen`, channel
    /// `{<prefix>}:released`.
    #[must_use]
    pub fn new(prefix: &str) -> Self {
        let tag = format!("{{{prefix}}}");
        Self {
            lease: format!("{tag}:lease"),
            fence: format!("{tag}:fence"),
            fence_seen: format!("{tag}:fence-seen"),
            channel: format!("{tag}:released"),
            deployment: format!("{tag}:deployment"),
        }
    }
}

// KEYS: lease, fence, fence-seen. ARGV: instance, ttl ms, floor.
// The new token is above the counter, above every token a checkpoint has seen, and above
// the highest token the caller has ever seen, so a Redis that lost its data (restart,
// FLUSHALL) can never reissue an old token while any replica remembers one.
const ACQUIRE: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder then return {0, holder .. ' ' .. redis.call('PTTL', KEYS[1])} end
local fence = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local seen = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
local token = math.max(fence, seen, tonumber(ARGV[3]) or 0) + 1
local t = string.format('%d', token)
redis.call('SET', KEYS[2], t)
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. t, 'PX', ARGV[2])
return {1, t}
";

// KEYS: lease, fence. ARGV: '<instance>:<token>', ttl ms, token.
// A vanished key is retaken when no term began since: the counter is at or below our
// token (equal: the key expired or was deleted; below: this store lost writes, e.g. a
// lagging replica was promoted), or gone (Redis lost its data; acquire always sets it).
// The counter is raised to our token, so this store never issues it again.
const RENEW: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, ''}
end
if not v then
  local f = redis.call('GET', KEYS[2])
  local fn = tonumber(f or '')
  if not f or (fn and fn <= tonumber(ARGV[3])) then
    redis.call('SET', KEYS[2], ARGV[3])
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return {2, ''}
  end
  return {3, f or ''}
end
return {4, v}
";

// KEYS: lease. ARGV: '<instance>:', channel.
const RELEASE: &str = r"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], v)
  return 1
end
return 0
";

// KEYS: deployment. ARGV: token, record. A later term's record stays.
const DEPLOYMENT: &str = r"
local v = redis.call('GET', KEYS[1])
if v then
  local t = tonumber(string.match(v, '^(%d+)\n'))
  if t and t > tonumber(ARGV[1]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1] .. '\n' .. ARGV[2])
return 1
";

// KEYS: fence, fence-seen. ARGV: min.
const SEED: &str = r"
local f = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local m = tonumber(ARGV[1])
local seen = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local v = math.max(f, m, seen)
local s = string.format('%d', v)
redis.call('SET', KEYS[1], s)
return s
";

/// The Redis backend: every call one script through a [`redis_op::Conn`] (hard per-op
/// timeout, no offline queue, no retries, reset after failure).
pub struct RedisBackend {
    conn: Conn,
    keys: Keys,
    scripts: Scripts,
    released: Arc<Notify>,
    listener: tokio::task::JoinHandle<()>,
}

struct Scripts {
    acquire: Script,
    renew: Script,
    release: Script,
    seed: Script,
    deployment: Script,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend").field("keys", &self.keys).finish_non_exhaustive()
    }
}

impl Drop for RedisBackend {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl From<OpError> for BackendError {
    fn from(e: OpError) -> Self {
        match e {
            OpError::Timeout(d) => Self::Timeout(d),
            e @ OpError::Unavailable(_) => Self::Unavailable(Box::new(e)),
        }
    }
}

fn protocol(what: impl Into<String>) -> BackendError {
    BackendError::Protocol(what.into())
}

fn pair(v: &Value) -> Result<(i64, String), BackendError> {
    redis_op::pair(v).map_err(BackendError::Protocol)
}

fn parse_u64(s: &str, what: &str) -> Result<u64, BackendError> {
    s.parse().map_err(|_| protocol(format!("{what} {s:?} is not a non-negative integer")))
}

impl RedisBackend {
    /// Connects lazily to `url` (credentials stay inside the client, never logged).
    pub fn new(url: &str, prefix: &str, op_timeout: Duration) -> Result<Self, BackendError> {
        let conn = Conn::open(url, op_timeout)?;
        let keys = Keys::new(prefix);
        let released = Arc::new(Notify::new());
        let listener = tokio::spawn(listen(conn.client().clone(), keys.channel.clone(), released.clone(), op_timeout));
        Ok(Self {
            conn,
            keys,
            scripts: Scripts {
                acquire: Script::new(ACQUIRE),
                renew: Script::new(RENEW),
                release: Script::new(RELEASE),
                seed: Script::new(SEED),
                deployment: Script::new(DEPLOYMENT),
            },
            released,
            listener,
        })
    }

    /// The key names in use.
    #[must_use]
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    async fn with_conn<T, F, Fut>(&self, f: F) -> Result<T, BackendError>
    where
        F: FnOnce(redis::aio::MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        Ok(self.conn.run(f).await?)
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis().max(1) as u64
}

#[async_trait::async_trait]
impl Backend for RedisBackend {
    async fn acquire(&self, instance: &str, ttl: Duration, floor: u64) -> Result<Acquire, BackendError> {
        let k = &self.keys;
        let v: Value = self
            .with_conn(|mut c| async move {
                self.scripts
                    .acquire
                    .key(&k.lease)
                    .key(&k.fence)
                    .key(&k.fence_seen)
                    .arg(instance)
                    .arg(ms(ttl))
                    .arg(floor)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match pair(&v)? {
            (1, t) => Ok(Acquire::Acquired { token: parse_u64(&t, "token")? }),
            (0, held) => {
                // `<holder> <pttl ms>`; the holder never contains a space (instance ids
                // are validated), and a pttl below zero means no expiry is known.
                let (holder, pttl) = held.rsplit_once(' ').unwrap_or((held.as_str(), "-1"));
                let expires_in = pttl.parse::<u64>().ok().map(Duration::from_millis);
                Ok(Acquire::Held { holder: holder.to_owned(), expires_in })
            }
            other => Err(protocol(format!("acquire answered {other:?}"))),
        }
    }

    async fn renew(&self, instance: &str, token: u64, ttl: Duration) -> Result<Renew, BackendError> {
        let k = &self.keys;
        let value = format!("{instance}:{token}");
        let v: Value = self
            .with_conn(|mut c| async move {
                self.scripts
                    .renew
                    .key(&k.lease)
                    .key(&k.fence)
                    .arg(&value)
                    .arg(ms(ttl))
                    .arg(token)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        match pair(&v)? {
            (1, _) => Ok(Renew::Renewed),
            (2, _) => Ok(Renew::Retaken),
            (3, f) => Ok(Renew::Fenced { fence: f.parse().ok() }),
            (4, holder) => Ok(Renew::TakenBy { holder }),
            other => Err(protocol(format!("renew answered {other:?}"))),
        }
    }

    async fn release(&self, instance: &str) -> Result<bool, BackendError> {
        let k = &self.keys;
        let prefix = format!("{instance}:");
        let v: i64 = self
            .with_conn(|mut c| async move {
                self.scripts.release.key(&k.lease).arg(&prefix).arg(&k.channel).invoke_async(&mut c).await
            })
            .await?;
        Ok(v == 1)
    }

    async fn seed_fence(&self, min: u64) -> Result<u64, BackendError> {
        let k = &self.keys;
        let v: String = self
            .with_conn(|mut c| async move {
                self.scripts.seed.key(&k.fence).key(&k.fence_seen).arg(min).invoke_async(&mut c).await
            })
            .await?;
        parse_u64(&v, "fence")
    }

    async fn snapshot(&self) -> Result<Snapshot, BackendError> {
        let k = &self.keys;
        let (holder, fence, seen, pttl): (Option<String>, Option<String>, Option<String>, i64) = self
            .with_conn(|mut c| async move {
                redis::pipe().get(&k.lease).get(&k.fence).get(&k.fence_seen).pttl(&k.lease).query_async(&mut c).await
            })
            .await?;
        Ok(Snapshot {
            holder,
            fence: fence.as_deref().map_or(Ok(0), |f| parse_u64(f, "fence"))?,
            fence_seen: seen.as_deref().map_or(Ok(0), |f| parse_u64(f, "fence-seen"))?,
            ttl: u64::try_from(pttl).ok().map(Duration::from_millis),
        })
    }

    fn release_signal(&self) -> Option<Arc<Notify>> {
        Some(self.released.clone())
    }

    async fn deployment(&self) -> Result<Option<(u64, String)>, BackendError> {
        let key = &self.keys.deployment;
        let v: Option<String> =
            self.with_conn(|mut c| async move { redis::cmd("GET").arg(key).query_async(&mut c).await }).await?;
        v.map(|v| {
            crate::backend::split_deployment(&v)
                .ok_or_else(|| protocol(format!("{key} holds {:?}, not <token>\\n<settings>", truncate(&v))))
        })
        .transpose()
    }

    async fn set_deployment(&self, token: u64, record: &str) -> Result<bool, BackendError> {
        let key = &self.keys.deployment;
        let v: i64 = self
            .with_conn(|mut c| async move {
                self.scripts.deployment.key(key).arg(token).arg(record).invoke_async(&mut c).await
            })
            .await?;
        Ok(v == 1)
    }
}

/// At most 60 characters of `s`, for error messages about what a key holds.
fn truncate(s: &str) -> String {
    s.chars().take(60).collect()
}

/// Keeps a subscription to the release channel, reconnecting after errors.
async fn listen(client: redis::Client, channel: String, released: Arc<Notify>, op_timeout: Duration) {
    loop {
        if let Ok(Ok(mut ps)) =
            tokio::time::timeout(op_timeout.max(Duration::from_secs(1)), client.get_async_pubsub()).await
            && ps.subscribe(&channel).await.is_ok()
        {
            let mut msgs = ps.on_message();
            while msgs.next().await.is_some() {
                released.notify_waiters();
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
