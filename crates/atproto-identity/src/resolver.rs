//! DID resolution for verification: `did:plc` from a PLC directory (`GET <plc>/<did>`),
//! `did:web` from `https://<host>/.well-known/did.json`, behind a bounded cache.
//!
//! - **Cache**: at most `cache_size` DIDs (two generations: a DID stays at least until
//!   `cache_size / 2` others were resolved after it). An entry younger than `ttl` is
//!   served as is; an older one is still served at once (stale-while-revalidate) while one
//!   background request refreshes it.
//! - **Single flight**: concurrent look-ups of one DID share one request (a burst of 200
//!   commits by a new DID makes one).
//! - **Towards the directory**: at most `concurrency` requests at a time, each bounded by
//!   `request_timeout`; after a failure the directory is left alone for a backoff
//!   (100 ms doubling to 10 s) and look-ups fail at once with [`ResolveError::Unavailable`]
//!   so that callers hold their events and retry, never guess.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OnceCell, Semaphore};

use crate::{DocError, Identity, parse_document};

/// How to resolve and how long to keep what was resolved.
#[derive(Debug, Clone)]
pub struct ResolverConfig {
    /// The PLC directory's base URL (no trailing slash needed).
    pub plc_url: String,
    /// DIDs kept.
    pub cache_size: usize,
    /// How long a resolved document is served without asking again.
    pub ttl: Duration,
    /// Requests to the directory at a time.
    pub concurrency: usize,
    /// One request's limit.
    pub request_timeout: Duration,
    /// A refresh (after a signature failed) within this long of the last refresh of the
    /// same DID is answered from the cache: a stream of bad signatures costs the
    /// directory one request, not one each.
    pub min_refresh: Duration,
    /// Where `did:web` documents are fetched from: `None` is `https://<host>` (tests point
    /// it at a loopback server).
    pub web_base: Option<String>,
}

impl Default for ResolverConfig {
    fn default() -> Self {
        Self {
            plc_url: "https://plc.directory".into(),
            cache_size: 100_000,
            ttl: Duration::from_hours(1),
            concurrency: 16,
            request_timeout: Duration::from_secs(5),
            min_refresh: Duration::from_secs(10),
            web_base: None,
        }
    }
}

/// Why a DID did not resolve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The directory failed (connection, timeout, 5xx, garbage) or is in its backoff:
    /// try again later.
    #[error("the DID directory is unavailable: {0}")]
    Unavailable(String),
    /// The directory answered that it does not know the DID (404/410).
    #[error("the DID is not known to the directory (HTTP {0})")]
    NotFound(u16),
    /// The document was served but gives no usable identity.
    #[error(transparent)]
    Document(#[from] DocError),
    /// Not a `did:plc` or `did:web`.
    #[error("unsupported DID method in {0:?}")]
    Method(String),
}

impl ResolveError {
    /// True when asking again later may succeed (the caller holds the event meanwhile).
    #[must_use]
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::NotFound(_))
    }
}

type Flight = Arc<OnceCell<Result<Arc<Identity>, ResolveError>>>;

struct Cached {
    identity: Arc<Identity>,
    fetched: Instant,
    /// Fetched by a refresh.
    refreshed: bool,
}

/// Two generations of at most `half` DIDs each.
struct Cache {
    half: usize,
    young: HashMap<String, Cached>,
    old: HashMap<String, Cached>,
}

impl Cache {
    fn get(&mut self, did: &str) -> Option<(Arc<Identity>, Instant, bool)> {
        if let Some(c) = self.young.get(did) {
            return Some((c.identity.clone(), c.fetched, c.refreshed));
        }
        let c = self.old.remove(did)?;
        let out = (c.identity.clone(), c.fetched, c.refreshed);
        self.put(did.to_owned(), c);
        Some(out)
    }

    fn put(&mut self, did: String, c: Cached) {
        if self.young.len() >= self.half && !self.young.contains_key(&did) {
            self.old.clear();
            std::mem::swap(&mut self.young, &mut self.old);
        }
        self.young.insert(did, c);
    }

    fn contains(&self, did: &str) -> bool {
        self.young.contains_key(did) || self.old.contains_key(did)
    }

    fn remove(&mut self, did: &str) {
        self.young.remove(did);
        self.old.remove(did);
    }
}

/// Backoff towards a failing directory.
struct Health {
    until: Option<Instant>,
    delay: Duration,
}

/// A shared DID resolver (cheap to clone).
#[derive(Clone)]
pub struct Resolver {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ResolverConfig,
    http: reqwest::Client,
    cache: Mutex<Cache>,
    flights: Mutex<HashMap<String, Flight>>,
    permits: Semaphore,
    health: Mutex<Health>,
    requests: std::sync::atomic::AtomicU64,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

impl Resolver {
    /// A resolver with its own HTTP client.
    ///
    /// # Errors
    /// When the HTTP client cannot be built (no TLS provider installed).
    pub fn new(cfg: ResolverConfig) -> Result<Self, ResolveError> {
        // The process-wide TLS provider (a no-op when the binary installed it first).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(cfg.request_timeout)
            .user_agent(concat!("firekeeper/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ResolveError::Unavailable(format!("HTTP client: {e}")))?;
        let half = (cfg.cache_size / 2).max(1);
        Ok(Self {
            inner: Arc::new(Inner {
                permits: Semaphore::new(cfg.concurrency.max(1)),
                cfg,
                http,
                cache: Mutex::new(Cache { half, young: HashMap::new(), old: HashMap::new() }),
                flights: Mutex::new(HashMap::new()),
                health: Mutex::new(Health { until: None, delay: BACKOFF_MIN }),
                requests: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }

    /// The identity of `did`: from the cache when it has one (a stale one is served and
    /// refreshed in the background), else from the directory.
    ///
    /// # Errors
    /// When the DID cannot be resolved now.
    pub async fn resolve(&self, did: &str) -> Result<Arc<Identity>, ResolveError> {
        let cached = self.inner.cache.lock().expect("cache").get(did);
        match cached {
            Some((id, fetched, _)) if fetched.elapsed() < self.inner.cfg.ttl => Ok(id),
            Some((id, _, _)) => {
                let me = self.clone();
                let did = did.to_owned();
                tokio::spawn(async move {
                    let _ = me.fetch(&did, false).await;
                });
                Ok(id)
            }
            None => self.fetch(did, false).await,
        }
    }

    /// Asks the directory again even when the cache holds `did` (a signature failed
    /// with the cached key: the repo may have rotated it).
    ///
    /// # Errors
    /// When the DID cannot be resolved now.
    pub async fn refresh(&self, did: &str) -> Result<Arc<Identity>, ResolveError> {
        let cached = self.inner.cache.lock().expect("cache").get(did);
        if let Some((id, fetched, true)) = cached
            && fetched.elapsed() < self.inner.cfg.min_refresh
        {
            return Ok(id);
        }
        self.fetch(did, true).await
    }

    /// Forgets `did` (its document must be asked for before it is used again).
    pub fn invalidate(&self, did: &str) {
        self.inner.cache.lock().expect("cache").remove(did);
    }

    /// An `#identity` event said the document of `did` may have changed: ask for it now,
    /// in the background. Until the answer lands the cached identity still serves (a
    /// look-up never waits on the directory for a DID it knows); a signature that fails
    /// with it asks again and waits ([`Resolver::refresh`]).
    pub fn changed(&self, did: &str) {
        if !self.inner.cache.lock().expect("cache").contains(did) {
            return;
        }
        let me = self.clone();
        let did = did.to_owned();
        tokio::spawn(async move {
            let _ = me.fetch(&did, false).await;
        });
    }

    /// Requests made to the directory so far (for tests and metrics).
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.inner.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One request per DID at a time: joins a request in flight or starts one.
    async fn fetch(&self, did: &str, refreshed: bool) -> Result<Arc<Identity>, ResolveError> {
        let flight = {
            let mut f = self.inner.flights.lock().expect("flights");
            f.entry(did.to_owned()).or_default().clone()
        };
        let out = flight.get_or_init(|| self.request(did, refreshed)).await.clone();
        let mut f = self.inner.flights.lock().expect("flights");
        if f.get(did).is_some_and(|g| Arc::ptr_eq(g, &flight)) {
            f.remove(did);
        }
        out
    }

    async fn request(&self, did: &str, refreshed: bool) -> Result<Arc<Identity>, ResolveError> {
        let url = self.url(did)?;
        if let Some(until) = self.inner.health.lock().expect("health").until
            && Instant::now() < until
        {
            return Err(ResolveError::Unavailable("backing off after a failure".into()));
        }
        let _permit = self.inner.permits.acquire().await.expect("never closed");
        self.inner.requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out = self.get(did, &url).await;
        let mut h = self.inner.health.lock().expect("health");
        match &out {
            Err(ResolveError::Unavailable(_)) => {
                h.until = Some(Instant::now() + h.delay);
                h.delay = (h.delay * 2).min(BACKOFF_MAX);
            }
            _ => *h = Health { until: None, delay: BACKOFF_MIN },
        }
        drop(h);
        let id = Arc::new(out?);
        let cached = Cached { identity: id.clone(), fetched: Instant::now(), refreshed };
        self.inner.cache.lock().expect("cache").put(did.to_owned(), cached);
        Ok(id)
    }

    async fn get(&self, did: &str, url: &str) -> Result<Identity, ResolveError> {
        let unavailable = |e: &dyn std::fmt::Display| ResolveError::Unavailable(e.to_string());
        let resp = self.inner.http.get(url).send().await.map_err(|e| unavailable(&without_url(&e)))?;
        let status = resp.status().as_u16();
        if status == 404 || status == 410 {
            return Err(ResolveError::NotFound(status));
        }
        if !resp.status().is_success() {
            return Err(ResolveError::Unavailable(format!("HTTP {status}")));
        }
        let body = resp.bytes().await.map_err(|e| unavailable(&without_url(&e)))?;
        // A directory answering garbage is failing, not lying about this DID.
        parse_document(did, &body).map_err(|e| match e {
            DocError::Json(j) => ResolveError::Unavailable(format!("not a DID document: {j}")),
            e => ResolveError::Document(e),
        })
    }

    /// Where the document of `did` is served.
    fn url(&self, did: &str) -> Result<String, ResolveError> {
        if let Some(id) = did.strip_prefix("did:plc:") {
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(ResolveError::Method(did.to_owned()));
            }
            return Ok(format!("{}/{did}", self.inner.cfg.plc_url.trim_end_matches('/')));
        }
        if let Some(host) = did.strip_prefix("did:web:") {
            // A port is percent-encoded; paths (`:` separated) are not atproto did:webs.
            let host = host.replace("%3A", ":").replace("%3a", ":");
            if host.is_empty() || host.contains(['/', '@', '?', '#']) || host.matches(':').count() > 1 {
                return Err(ResolveError::Method(did.to_owned()));
            }
            let base = self.inner.cfg.web_base.clone().unwrap_or_else(|| format!("https://{host}"));
            return Ok(format!("{base}/.well-known/did.json"));
        }
        Err(ResolveError::Method(did.to_owned()))
    }
}

/// A request error without its URL (a PLC URL may carry credentials).
fn without_url(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else if e.is_body() || e.is_decode() {
        "the body broke off"
    } else {
        "request failed"
    };
    kind.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_for_plc_and_web_dids_and_refusals() {
        let r = Resolver::new(ResolverConfig { plc_url: "http://127.0.0.1:9/".into(), ..Default::default() })
            .expect("resolver");
        assert_eq!(r.url("did:plc:abc234").as_deref(), Ok("http://127.0.0.1:9/did:plc:abc234"));
        assert_eq!(r.url("did:web:example.com").as_deref(), Ok("https://example.com/.well-known/did.json"));
        assert_eq!(r.url("did:web:localhost%3A8080").as_deref(), Ok("https://localhost:8080/.well-known/did.json"));
        for bad in ["did:key:z6Mk", "did:plc:", "did:plc:a/b", "did:web:a/b", "did:web:", "did:web:a:b:c"] {
            assert!(matches!(r.url(bad), Err(ResolveError::Method(_))), "{bad}");
        }
    }

    #[test]
    fn the_cache_keeps_recent_dids_within_its_bound() {
        let id = |d: &str| Cached {
            identity: Arc::new(Identity {
                did: d.into(),
                signing_key: atproto_crypto::PublicKey::from_did_key(
                    "did:key:zQ3shokFTS3brHcDQrn82RUDfCZESWL1ZdCEJwekUDPQiYBme",
                )
                .expect("key"),
                handle: None,
                pds: None,
            }),
            fetched: Instant::now(),
            refreshed: false,
        };
        let mut c = Cache { half: 50, young: HashMap::new(), old: HashMap::new() };
        for i in 0..1000 {
            c.put(format!("did:plc:{i}"), id("x"));
            assert!(c.get("did:plc:hot").is_some() || i == 0, "a DID looked up all along stays");
            if i == 0 {
                c.put("did:plc:hot".into(), id("hot"));
            }
            assert!(c.young.len() + c.old.len() <= 100);
        }
        c.remove("did:plc:hot");
        assert!(c.get("did:plc:hot").is_none());
    }
}
