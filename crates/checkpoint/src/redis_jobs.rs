//! The shared repo-sync queue on Redis: a stream with a consumer group. Each job is a
//! stream entry naming a repo and a job id; the repo's hash (`<prefix>job:<did>`) holds
//! the job that counts (a newer publish replaces it: entries of older ones are dropped
//! when read), its claim epoch and, once finished, its result. `XAUTOCLAIM` hands the jobs
//! of a worker that went quiet to another, with a higher epoch; every step is one script,
//! so a claim, an apply and a finish see the same state.

use std::time::Duration;

use async_trait::async_trait;
use redis::{Script, Value};
use redis_op::{Conn, OpError};

use crate::cursor::{CommitOutcome, StoreError};
use crate::jobs::{Claim, JobCounts, JobQueue, JobSpec, JobState};
use crate::store::Fence;

/// How long a finished job's result is kept for the leader to read.
const RESULT_TTL_S: u64 = 86_400;

/// The consumer group every replica's workers read in.
const GROUP: &str = "workers";

// KEYS: lease, stream, job hash, fence-seen. ARGV: holder, token, did, id, reason,
// min_rev, relay. Fenced like a repo write; replaces the repo's job and queues an entry.
const PUBLISH: &str = r"
local h = redis.call('GET', KEYS[1])
local t = h and string.match(h, ':([0-9]+)$')
if h ~= ARGV[1] then return {3, t or ''} end
redis.pcall('XGROUP', 'CREATE', KEYS[2], 'workers', '0', 'MKSTREAM')
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'id', ARGV[4], 'reason', ARGV[5], 'min_rev', ARGV[6], 'holder', ARGV[1],
  'token', ARGV[2], 'epoch', 0, 'state', 'queued', 'relay', ARGV[7])
redis.call('XADD', KEYS[2], '*', 'did', ARGV[3], 'id', ARGV[4])
local seen = redis.call('GET', KEYS[4])
if not seen or tonumber(ARGV[2]) > tonumber(seen) then redis.call('SET', KEYS[4], ARGV[2]) end
return {1, ''}
";

// KEYS: stream. ARGV: worker, n, idle ms, job hash prefix. Claims up to n entries (the
// idle ones of other workers first), skipping those of replaced or finished jobs.
const CLAIM: &str = r"
redis.pcall('XGROUP', 'CREATE', KEYS[1], 'workers', '0', 'MKSTREAM')
local n = tonumber(ARGV[2])
local out = {}
local function take(entries)
  for _, e in ipairs(entries) do
    if type(e) == 'table' and e[2] then
      local eid, f, did, id = e[1], e[2], nil, nil
      for i = 1, #f, 2 do
        if f[i] == 'did' then did = f[i + 1] elseif f[i] == 'id' then id = f[i + 1] end
      end
      local jk = ARGV[4] .. (did or '')
      local cur = redis.call('HMGET', jk, 'id', 'state')
      if not did or cur[1] ~= id or cur[2] == 'done' then
        redis.call('XACK', KEYS[1], 'workers', eid)
        redis.call('XDEL', KEYS[1], eid)
      else
        local epoch = redis.call('HINCRBY', jk, 'epoch', 1)
        redis.call('HSET', jk, 'state', 'claimed', 'worker', ARGV[1])
        local j = redis.call('HMGET', jk, 'reason', 'min_rev', 'holder', 'token', 'relay')
        table.insert(out, {did, id, j[1] or '', j[2] or '', j[3] or '', j[4] or '0', tostring(epoch), eid, j[5] or ''})
      end
    end
  end
end
local ac = redis.call('XAUTOCLAIM', KEYS[1], 'workers', ARGV[1], ARGV[3], '0-0', 'COUNT', n)
take(ac[2])
if #out < n then
  local r = redis.call('XREADGROUP', 'GROUP', 'workers', ARGV[1], 'COUNT', n - #out, 'STREAMS', KEYS[1], '>')
  if r then take(r[1][2]) end
end
return out
";

// KEYS: stream, job hash. ARGV: worker, id, epoch, entry, step ('touch', 'apply' with
// ARGV[6] the rev, 'finish' with ARGV[6] the result). 1 when the claim is still current.
const STEP: &str = r"
local j = redis.call('HMGET', KEYS[2], 'id', 'epoch', 'state')
if j[1] ~= ARGV[2] or j[2] ~= ARGV[3] or j[3] == 'done' then return 0 end
if ARGV[5] == 'apply' then
  if j[3] ~= 'claimed' then return 0 end
  redis.call('HSET', KEYS[2], 'state', 'applying', 'rev', ARGV[6])
end
if ARGV[5] == 'finish' then
  redis.call('HSET', KEYS[2], 'state', 'done', 'result', ARGV[6])
  redis.call('EXPIRE', KEYS[2], ARGV[7])
  redis.call('XACK', KEYS[1], 'workers', ARGV[4])
  redis.call('XDEL', KEYS[1], ARGV[4])
  return 1
end
redis.call('XCLAIM', KEYS[1], 'workers', ARGV[1], 0, ARGV[4], 'JUSTID')
return 1
";

/// Repo-sync jobs in a Redis stream (see the module).
#[derive(Debug)]
pub struct RedisJobs {
    conn: Conn,
    lease: String,
    fence_seen: String,
    stream: String,
    job_prefix: String,
    publish: Script,
    claim: Script,
    step: Script,
}

#[allow(clippy::needless_pass_by_value)] // the shape `map_err` wants
fn err(e: OpError) -> StoreError {
    StoreError::Unavailable(Box::new(e))
}

impl RedisJobs {
    /// The queue of the deployment whose keys are `keys` (the same hash tag as the lease),
    /// on `url`, with a hard per-call timeout.
    pub fn new(url: &str, keys: &crate::RedisKeys, op_timeout: Duration) -> Result<Self, StoreError> {
        let tag = keys.lease.strip_suffix("lease").unwrap_or(&keys.lease);
        Ok(Self {
            conn: Conn::open(url, op_timeout).map_err(err)?,
            lease: keys.lease.clone(),
            fence_seen: keys.fence_seen.clone(),
            stream: format!("{tag}jobs"),
            job_prefix: format!("{tag}job:"),
            publish: Script::new(PUBLISH),
            claim: Script::new(CLAIM),
            step: Script::new(STEP),
        })
    }

    /// One claim step (`touch`, `apply`, `finish`) of `c`, with its argument.
    async fn step(&self, c: &Claim, step: &str, arg: &str) -> Result<bool, StoreError> {
        let job = format!("{}{}", self.job_prefix, c.did);
        let epoch = c.epoch.to_string();
        let ttl = RESULT_TTL_S.to_string();
        let n: i64 = self
            .conn
            .run(|mut conn| {
                let mut inv = self.step.key(&self.stream);
                inv.key(&job).arg(GROUP_WORKER_ARG).arg(&c.id).arg(&epoch).arg(&c.handle).arg(step).arg(arg).arg(&ttl);
                async move { inv.invoke_async(&mut conn).await }
            })
            .await
            .map_err(err)?;
        Ok(n == 1)
    }
}

/// `XCLAIM` wants a consumer name: the claim moves to this one on a touch, which only
/// resets its idle time (the job hash says whose it is).
const GROUP_WORKER_ARG: &str = "touched";

/// A bulk string of a script's answer.
fn text(v: &Value) -> Result<String, StoreError> {
    match v {
        Value::BulkString(b) => Ok(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Ok(s.clone()),
        Value::Int(i) => Ok(i.to_string()),
        other => Err(StoreError::Protocol(format!("a job field answered {other:?}"))),
    }
}

/// One claimed job from the claim script's row.
fn claim_of(row: &Value) -> Result<Claim, StoreError> {
    let Value::Array(f) = row else { return Err(StoreError::Protocol(format!("a claim answered {row:?}"))) };
    let f: Vec<String> = f.iter().map(text).collect::<Result<_, _>>()?;
    let [did, id, reason, min_rev, holder, token, epoch, handle, relay] = f.as_slice() else {
        return Err(StoreError::Protocol(format!("a claim has {} fields", f.len())));
    };
    let num = |s: &str| s.parse::<u64>().map_err(|_| StoreError::Protocol(format!("a claim's number is {s:?}")));
    Ok(Claim {
        did: did.clone(),
        id: id.clone(),
        reason: reason.clone(),
        min_rev: Some(min_rev.clone()).filter(|r| !r.is_empty()),
        relay: relay.clone(),
        holder: holder.clone(),
        token: num(token)?,
        epoch: num(epoch)?,
        handle: handle.clone(),
    })
}

#[async_trait]
impl JobQueue for RedisJobs {
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn publish(&self, job: JobSpec<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError> {
        let key = format!("{}{}", self.job_prefix, job.did);
        let v: Value = self
            .conn
            .run(|mut c| {
                let mut inv = self.publish.key(&self.lease);
                inv.key(&self.stream).key(&key).key(&self.fence_seen);
                inv.arg(fence.holder).arg(fence.token).arg(job.did).arg(job.id).arg(job.reason);
                inv.arg(job.min_rev.unwrap_or("")).arg(job.relay);
                async move { inv.invoke_async(&mut c).await }
            })
            .await
            .map_err(err)?;
        match redis_op::pair(&v).map_err(StoreError::Protocol)? {
            (1, _) => Ok(CommitOutcome::Saved),
            (3, holder) => Ok(CommitOutcome::Fenced { current: holder.parse().ok() }),
            other => Err(StoreError::Protocol(format!("a job publish answered {other:?}"))),
        }
    }

    async fn claim(&self, worker: &str, n: usize, idle: Duration) -> Result<Vec<Claim>, StoreError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let idle_ms = idle.as_millis().to_string();
        let v: Value = self
            .conn
            .run(|mut c| {
                let mut inv = self.claim.key(&self.stream);
                inv.arg(worker).arg(n).arg(&idle_ms).arg(&self.job_prefix);
                async move { inv.invoke_async(&mut c).await }
            })
            .await
            .map_err(err)?;
        match &v {
            Value::Array(rows) => rows.iter().map(claim_of).collect(),
            Value::Nil => Ok(Vec::new()),
            other => Err(StoreError::Protocol(format!("a claim answered {other:?}"))),
        }
    }

    async fn touch(&self, c: &Claim) -> Result<bool, StoreError> {
        self.step(c, "touch", "").await
    }

    async fn begin_apply(&self, c: &Claim, rev: &str) -> Result<bool, StoreError> {
        self.step(c, "apply", rev).await
    }

    async fn finish(&self, c: &Claim, result: &str) -> Result<bool, StoreError> {
        self.step(c, "finish", result).await
    }

    async fn state(&self, did: &str, id: &str) -> Result<JobState, StoreError> {
        let key = format!("{}{did}", self.job_prefix);
        let (cur, st, result): (Option<String>, Option<String>, Option<String>) = self
            .conn
            .run(|mut c| async move {
                redis::cmd("HMGET").arg(&key).arg("id").arg("state").arg("result").query_async(&mut c).await
            })
            .await
            .map_err(err)?;
        Ok(match (cur.as_deref() == Some(id), st.as_deref(), result) {
            (false, _, _) => JobState::Unknown,
            (true, Some("done"), Some(r)) => JobState::Done(r),
            (true, _, _) => JobState::Pending,
        })
    }

    async fn counts(&self) -> Result<JobCounts, StoreError> {
        let stream = self.stream.clone();
        let (len, pending): (u64, Value) = self
            .conn
            .run(|mut c| async move {
                redis::pipe().cmd("XLEN").arg(&stream).cmd("XPENDING").arg(&stream).arg(GROUP).query_async(&mut c).await
            })
            .await
            .or_else(|e| match e {
                // No stream or group yet: nothing queued.
                OpError::Unavailable(why) if why.contains("NOGROUP") => Ok((0, Value::Nil)),
                e => Err(err(e)),
            })?;
        let claimed = match &pending {
            Value::Array(v) => v.first().and_then(|c| text(c).ok()).and_then(|c| c.parse().ok()).unwrap_or(0),
            _ => 0,
        };
        Ok(JobCounts { queued: len.saturating_sub(claimed), claimed })
    }
}
