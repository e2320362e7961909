//! One Redis connection with a hard timeout on every operation.
//!
//! The lease and the cursor store must never wait on Redis longer than they planned to:
//! each call gets `op_timeout` for connecting and answering together, there is no
//! offline queue and no retry, and after any timeout or error the connection is dropped
//! so the next call starts on a fresh one (a half-dead socket is never reused).

use std::future::Future;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Value};
use tokio::sync::Mutex;

/// Why an operation failed. The outcome of a timed-out write is unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// Connecting plus answering took longer than the op timeout.
    #[error("redis call timed out after {0:?}")]
    Timeout(Duration),
    /// Connection refused, reset, or the server answered an error (e.g. NOPERM).
    #[error("redis unavailable: {0}")]
    Unavailable(String),
}

/// A lazily (re)connected multiplexed connection.
pub struct Conn {
    client: redis::Client,
    /// `host:port` (never the URL: it may carry a password), for error messages.
    addr: String,
    op_timeout: Duration,
    slot: Mutex<Option<MultiplexedConnection>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("op_timeout", &self.op_timeout).finish_non_exhaustive()
    }
}

/// Describes a redis error without the URL (which may hold a password): the server's
/// error code, or what happened to the connection.
#[must_use]
pub fn describe(e: &redis::RedisError) -> String {
    if let Some(c) = e.code() {
        return format!("{c}: {}", e.detail().unwrap_or_default());
    }
    let what = if e.is_connection_refusal() {
        "connection refused"
    } else if e.is_timeout() {
        "timed out"
    } else if e.is_connection_dropped() {
        "connection dropped"
    } else if e.is_io_error() {
        "i/o error"
    } else {
        return format!("{:?}{}", e.kind(), e.detail().map(|d| format!(": {d}")).unwrap_or_default());
    };
    // An i/o error's own text says what happened (a TLS certificate refused, a reset); it
    // names no URL.
    let cause = e.detail().map(str::to_owned).or_else(|| std::error::Error::source(e).map(ToString::to_string));
    match cause {
        Some(d) => format!("{what} ({d})"),
        None => what.to_owned(),
    }
}

/// The CA certificates (PEM) `rediss://` connections trust instead of the system's roots;
/// unset: the system's roots. One per process, like the TLS crypto provider.
static TRUSTED_CA: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();

/// Makes every later `rediss://` connection of this process trust the CA certificates in
/// `pem` (and only them), for a Redis whose certificate a private CA signed. `Err` when
/// `pem` holds no certificate, or another CA was already set.
pub fn trust_ca_pem(pem: Vec<u8>) -> Result<(), String> {
    if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    if TRUSTED_CA.get().is_some_and(|c| *c != pem) {
        return Err("another CA was already set in this process".into());
    }
    let _ = TRUSTED_CA.set(pem);
    Ok(())
}

/// A client for `url`: `redis://` in the clear, `rediss://` over TLS verified against the
/// CA given to [`trust_ca_pem`] or else the system's roots. Every Redis client of the
/// process is made here, so the lease, the cursors and their subscriptions agree.
pub fn client(url: &str) -> redis::RedisResult<redis::Client> {
    match TRUSTED_CA.get() {
        Some(ca) if url.trim_start().get(..9).is_some_and(|s| s.eq_ignore_ascii_case("rediss://")) => {
            redis::Client::build_with_tls(url, redis::TlsCertificates { client_tls: None, root_cert: Some(ca.clone()) })
        }
        _ => redis::Client::open(url),
    }
}

impl Conn {
    /// A connection to `url` (see [`client`]); nothing is opened until the first call.
    pub fn open(url: &str, op_timeout: Duration) -> Result<Self, OpError> {
        let client = client(url).map_err(|e| OpError::Unavailable(describe(&e)))?;
        let addr = client.get_connection_info().addr().to_string();
        Ok(Self { client, addr, op_timeout, slot: Mutex::new(None) })
    }

    /// The underlying client (for pub/sub, which needs its own connection).
    #[must_use]
    pub fn client(&self) -> &redis::Client {
        &self.client
    }

    /// The per-operation budget.
    #[must_use]
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// Runs one operation under the op timeout; drops the connection on any failure.
    pub async fn run<T, F, Fut>(&self, f: F) -> Result<T, OpError>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let attempt = async {
            let conn = {
                let mut guard = self.slot.lock().await;
                if let Some(c) = guard.as_ref() {
                    c.clone()
                } else {
                    let cfg = AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.op_timeout))
                        .set_response_timeout(Some(self.op_timeout));
                    let c =
                        self.client.get_multiplexed_async_connection_with_config(&cfg).await.map_err(|e| {
                            OpError::Unavailable(format!("connecting to {}: {}", self.addr, describe(&e)))
                        })?;
                    *guard = Some(c.clone());
                    c
                }
            };
            f(conn).await.map_err(|e| OpError::Unavailable(format!("{}: {}", self.addr, describe(&e))))
        };
        let r = match tokio::time::timeout(self.op_timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(OpError::Timeout(self.op_timeout)),
        };
        if r.is_err() {
            *self.slot.lock().await = None;
        }
        r
    }
}

/// How a Redis server keeps its data across a restart, as `CONFIG GET` reports it: what
/// the lease fence and the cursor survive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Persistence {
    /// `appendonly yes`: every write is logged (fsynced per `appendfsync`).
    pub aof: bool,
    /// `appendfsync`, when the append-only file is on (`always`, `everysec`, `no`).
    pub fsync: String,
    /// The `save` rules (RDB snapshots); empty when there are none.
    pub save: String,
}

impl Persistence {
    /// What a restart of this server costs the lease and cursors; `None` with an
    /// append-only file fsynced at least every second.
    #[must_use]
    pub fn risk(&self) -> Option<&'static str> {
        match (self.aof, self.save.trim().is_empty()) {
            (true, _) if self.fsync == "no" => Some(
                "append-only file without fsync (appendfsync no): a machine crash can lose the last writes, an older fence and cursor come back",
            ),
            (true, _) => None,
            (false, false) => Some(
                "snapshots only (no append-only file): a restart brings back the last snapshot, an older fence and cursor; a stale fence can reissue a live term's token",
            ),
            (false, true) => Some(
                "no persistence at all (no append-only file, no snapshots): a restart loses the fence and every cursor",
            ),
        }
    }
}

impl Conn {
    /// The server's persistence settings; `None` when it refuses `CONFIG GET` (managed
    /// services often do).
    ///
    /// # Errors
    /// When the server cannot be reached in time.
    pub async fn persistence(&self) -> Result<Option<Persistence>, OpError> {
        let r = self
            .run(|mut c| async move {
                let v: redis::RedisResult<(Vec<String>, Vec<String>, Vec<String>)> = redis::pipe()
                    .cmd("CONFIG")
                    .arg("GET")
                    .arg("appendonly")
                    .cmd("CONFIG")
                    .arg("GET")
                    .arg("appendfsync")
                    .cmd("CONFIG")
                    .arg("GET")
                    .arg("save")
                    .query_async(&mut c)
                    .await;
                Ok(v)
            })
            .await?;
        let Ok((aof, fsync, save)) = r else { return Ok(None) };
        let value = |v: &[String]| v.get(1).cloned();
        let (Some(aof), Some(save)) = (value(&aof), value(&save)) else { return Ok(None) };
        Ok(Some(Persistence { aof: aof == "yes", fsync: value(&fsync).unwrap_or_default(), save }))
    }
}

/// Reads a script's `{code, detail}` reply.
pub fn pair(v: &Value) -> Result<(i64, String), String> {
    match v {
        Value::Array(items) if items.len() == 2 => {
            let Value::Int(code) = items[0] else {
                return Err(format!("status not an integer: {v:?}"));
            };
            let detail = match &items[1] {
                Value::BulkString(b) => String::from_utf8(b.clone()).map_err(|_| format!("detail not UTF-8: {v:?}"))?,
                Value::SimpleString(s) => s.clone(),
                Value::Int(i) => i.to_string(),
                _ => return Err(format!("detail not a string: {v:?}")),
            };
            Ok((code, detail))
        }
        other => Err(format!("expected a two-element array, got {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_fsynced_append_only_file_is_without_risk() {
        let p = |aof, fsync: &str, save: &str| Persistence { aof, fsync: fsync.into(), save: save.into() };
        assert_eq!(p(true, "everysec", "").risk(), None);
        assert_eq!(p(true, "always", "3600 1").risk(), None);
        assert!(p(true, "no", "").risk().is_some_and(|r| r.contains("appendfsync no")));
        assert!(p(false, "everysec", "3600 1 300 100").risk().is_some_and(|r| r.contains("snapshots only")));
        assert!(p(false, "everysec", "").risk().is_some_and(|r| r.contains("no persistence")));
    }

    #[test]
    fn script_replies_that_are_not_code_detail_pairs_are_errors() {
        let ok = Value::Array(vec![Value::Int(2), Value::BulkString(b"17".to_vec())]);
        assert_eq!(pair(&ok), Ok((2, "17".to_owned())));
        for bad in [
            Value::SimpleString("OK".into()),
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::BulkString(b"1".to_vec()), Value::Int(1)]),
            Value::Array(vec![Value::Int(1), Value::BulkString(vec![0xff])]),
            Value::Nil,
        ] {
            assert!(pair(&bad).is_err(), "{bad:?}");
        }
    }
}
