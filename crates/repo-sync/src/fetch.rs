//! `com.atproto.sync.getRepo`, fetched with every bound a hostile or broken host needs:
//! a timeout per attempt, a cut for transfers slower than a floor, a size cap, a memory
//! bound past which the body goes to a temporary file, and the answers that are not a
//! body (the repo gone, the host rate-limiting) as typed outcomes the queue can act on.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The bounds of one fetch.
#[derive(Debug, Clone)]
pub struct Limits {
    /// One attempt, headers to last byte (5 min).
    pub attempt: Duration,
    /// The largest body accepted (2 GiB).
    pub max_bytes: u64,
    /// Bodies up to this stay in memory; larger ones go to a file in `spill_dir` (16 MiB;
    /// a body announced larger goes there from its first byte).
    pub memory_bytes: usize,
    /// The transfer is cut when fewer than `slow_bytes` arrive in any `slow_window`
    /// (about 1 KB/s over 30 s).
    pub slow_window: Duration,
    /// See `slow_window`.
    pub slow_bytes: u64,
    /// Where large bodies are spilled.
    pub spill_dir: PathBuf,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            attempt: Duration::from_mins(5),
            max_bytes: 2 << 30,
            memory_bytes: 16 << 20,
            slow_window: Duration::from_secs(30),
            slow_bytes: 30 * 1024,
            spill_dir: std::env::temp_dir(),
        }
    }
}

/// A fetched body: in memory, or in a temporary file removed when this is dropped.
#[derive(Debug)]
pub enum Body {
    /// Small enough to keep.
    Memory(Vec<u8>),
    /// Spilled to disk.
    File {
        /// The temporary file.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
}

impl Body {
    /// The body's length in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        match self {
            Self::Memory(b) => b.len() as u64,
            Self::File { len, .. } => *len,
        }
    }

    /// True for an empty body.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes (read back from the file when spilled).
    ///
    /// # Errors
    /// When the spilled file cannot be read.
    pub fn bytes(&self) -> std::io::Result<std::borrow::Cow<'_, [u8]>> {
        match self {
            Self::Memory(b) => Ok(std::borrow::Cow::Borrowed(b)),
            Self::File { path, .. } => std::fs::read(path).map(std::borrow::Cow::Owned),
        }
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        if let Self::File { path, .. } = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The host's rate-limit answer: how long until another request may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    /// Requests left in the window (`RateLimit-Remaining`), when said.
    pub remaining: Option<u64>,
    /// Wait this long before asking this host again (`Retry-After`, else
    /// `RateLimit-Reset`), when said.
    pub wait: Option<Duration>,
}

/// Why a repo is not there to fetch (the PDS's own error names, and a 404).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gone {
    /// `RepoNotFound`, or a 404.
    NotFound,
    /// `RepoTakendown`.
    Takendown,
    /// `RepoSuspended`.
    Suspended,
    /// `RepoDeactivated`.
    Deactivated,
}

/// A fetched repo, with what the host said about its rate limit.
#[derive(Debug)]
pub struct Fetched {
    /// The CAR as served.
    pub body: Body,
    /// The host's rate-limit headers (park the host when `remaining` is 0).
    pub rate: RateLimit,
}

/// Why a fetch gave no repo.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The repo is not there; wait for an `#account` or `#identity` before trying again.
    #[error("the repo is gone: {0:?}")]
    Gone(Gone),
    /// HTTP 429: try this host again after the wait.
    #[error("rate-limited by the host")]
    RateLimited(RateLimit),
    /// The body is larger than the cap (announced, or as it arrived).
    #[error("the repo is larger than {limit} bytes")]
    TooLarge {
        /// The cap.
        limit: u64,
    },
    /// Fewer bytes than the floor arrived within a window.
    #[error("the transfer fell below {bytes} bytes in {window:?}")]
    TooSlow {
        /// The floor.
        bytes: u64,
        /// Its window.
        window: Duration,
    },
    /// The attempt took longer than its bound.
    #[error("the fetch took longer than {0:?}")]
    Timeout(Duration),
    /// The address is not one this process may reach (private, loopback, a refused
    /// redirect). A message, not the HTTP client's error: that one names the URL, which
    /// may carry credentials.
    #[error("refused: {0}")]
    Refused(String),
    /// Any other answer (`HTTP 503`) or transport failure (its kind: `timeout`,
    /// `connect`, … for the reason given at `Refused`); retried later.
    #[error("getRepo failed: {0}")]
    Failed(String),
    /// The host is parked by its rate limit for this long more: not asked.
    #[error("the host is parked by its rate limit for {0:?} more")]
    Parked(Duration),
    /// The service endpoint is not a URL.
    #[error("the service endpoint is not a URL: {0}")]
    Endpoint(#[source] url::ParseError),
    /// The spill file could not be written.
    #[error("spilling the repo to disk: {0}")]
    Spill(#[source] std::io::Error),
}

/// The `getRepo` URL of `did` at the service `base` (a PDS endpoint or a relay).
///
/// # Errors
/// When `base` is not a URL.
pub fn get_repo_url(base: &str, did: &str) -> Result<url::Url, FetchError> {
    let mut u = url::Url::parse(base).map_err(FetchError::Endpoint)?;
    u.set_path("/xrpc/com.atproto.sync.getRepo");
    u.query_pairs_mut().clear().append_pair("did", did);
    Ok(u)
}

/// Fetches `url` (a `getRepo` URL) within `limits`.
///
/// # Errors
/// The [`FetchError`] that ended the attempt.
pub async fn fetch(client: &guarded_http::Client, url: &url::Url, limits: &Limits) -> Result<Fetched, FetchError> {
    match tokio::time::timeout(limits.attempt, attempt(client, url, limits)).await {
        Ok(r) => r,
        Err(_) => Err(FetchError::Timeout(limits.attempt)),
    }
}

async fn attempt(client: &guarded_http::Client, url: &url::Url, limits: &Limits) -> Result<Fetched, FetchError> {
    let req = client.get(url.as_str()).map_err(|e| FetchError::Refused(e.to_string()))?;
    let resp = req.send().await.map_err(|e| transport(&e))?;
    let rate = rate_limit(resp.headers());
    let status = resp.status().as_u16();
    match status {
        200 => {}
        429 => return Err(FetchError::RateLimited(rate)),
        404 => return Err(FetchError::Gone(Gone::NotFound)),
        400 => {
            let body = guarded_http::read_bounded(resp, 4096).await.unwrap_or_default();
            return Err(xrpc_error(&body).map_or_else(|| FetchError::Failed("HTTP 400".into()), FetchError::Gone));
        }
        s => return Err(FetchError::Failed(format!("HTTP {s}"))),
    }
    if resp.content_length().is_some_and(|n| n > limits.max_bytes) {
        return Err(FetchError::TooLarge { limit: limits.max_bytes });
    }
    let body = read_body(resp, limits).await?;
    Ok(Fetched { body, rate })
}

/// A transport error, with the guard's refusal told apart.
pub(crate) fn transport(e: &reqwest::Error) -> FetchError {
    match guarded_http::refused(e) {
        Some(why) => FetchError::Refused(why),
        None => FetchError::Failed(guarded_http::kind(e).to_owned()),
    }
}

/// The repo status an XRPC error body (`{"error": "RepoTakendown", …}`) names, if any.
fn xrpc_error(body: &[u8]) -> Option<Gone> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    match v.get("error")?.as_str()? {
        "RepoNotFound" => Some(Gone::NotFound),
        "RepoTakendown" => Some(Gone::Takendown),
        "RepoSuspended" => Some(Gone::Suspended),
        "RepoDeactivated" => Some(Gone::Deactivated),
        _ => None,
    }
}

/// `RateLimit-Remaining`, and the wait from `Retry-After` (seconds) or `RateLimit-Reset`
/// (seconds from now, or a Unix time, as the reference PDS sends it).
fn rate_limit(h: &reqwest::header::HeaderMap) -> RateLimit {
    let num = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let reset = num("ratelimit-reset").map(|r| if r > 1_000_000_000 { r.saturating_sub(now) } else { r });
    RateLimit { remaining: num("ratelimit-remaining"), wait: num("retry-after").or(reset).map(Duration::from_secs) }
}

/// Where a spilled body goes: unique per process and call.
fn spill_path(dir: &Path) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    dir.join(format!(".getrepo.{}.{}.car", std::process::id(), N.fetch_add(1, Ordering::Relaxed)))
}

/// A new spill file, and the body that owns it (dropped on any error, it removes it).
fn spill_file(limits: &Limits) -> Result<(std::fs::File, Body), FetchError> {
    let path = spill_path(&limits.spill_dir);
    let guard = Body::File { path: path.clone(), len: 0 };
    let f = std::fs::File::create(&path).map_err(FetchError::Spill)?;
    Ok((f, guard))
}

/// Reads the body within the size cap and the speed floor, spilling past the memory bound.
async fn read_body(mut resp: reqwest::Response, limits: &Limits) -> Result<Body, FetchError> {
    let mut mem: Vec<u8> = Vec::new();
    let mut file: Option<(std::fs::File, Body)> = None;
    if resp.content_length().is_some_and(|n| n > limits.memory_bytes as u64) {
        file = Some(spill_file(limits)?);
    }
    let mut total: u64 = 0;
    let (mut window_start, mut window_bytes) = (Instant::now(), 0u64);
    loop {
        let left = limits.slow_window.saturating_sub(window_start.elapsed());
        let chunk = match tokio::time::timeout(left, resp.chunk()).await {
            Ok(c) => c.map_err(|e| FetchError::Failed(guarded_http::kind(&e).to_owned()))?,
            // The window ended while waiting: too slow, or a new window.
            Err(_) if window_bytes < limits.slow_bytes => {
                return Err(FetchError::TooSlow { bytes: limits.slow_bytes, window: limits.slow_window });
            }
            Err(_) => {
                (window_start, window_bytes) = (Instant::now(), 0);
                continue;
            }
        };
        let Some(chunk) = chunk else { break };
        total += chunk.len() as u64;
        if total > limits.max_bytes {
            return Err(FetchError::TooLarge { limit: limits.max_bytes });
        }
        window_bytes += chunk.len() as u64;
        if window_start.elapsed() >= limits.slow_window {
            if window_bytes < limits.slow_bytes {
                return Err(FetchError::TooSlow { bytes: limits.slow_bytes, window: limits.slow_window });
            }
            (window_start, window_bytes) = (Instant::now(), 0);
        }
        match &mut file {
            Some((f, _)) => f.write_all(&chunk).map_err(FetchError::Spill)?,
            None if mem.len() + chunk.len() > limits.memory_bytes => {
                let (mut f, guard) = spill_file(limits)?;
                f.write_all(&mem).and_then(|()| f.write_all(&chunk)).map_err(FetchError::Spill)?;
                mem = Vec::new();
                file = Some((f, guard));
            }
            None => mem.extend_from_slice(&chunk),
        }
    }
    Ok(match file {
        Some((f, mut body)) => {
            f.sync_all().map_err(FetchError::Spill)?;
            if let Body::File { len, .. } = &mut body {
                *len = total;
            }
            body
        }
        None => Body::Memory(mem),
    })
}
