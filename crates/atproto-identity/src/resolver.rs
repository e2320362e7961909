//! DID resolution for verification: `did:plc` from a PLC directory (`GET <plc>/<did>`),
//! `did:web` from `https://<host>/.well-known/did.json`, behind a bounded cache.
//!
//! - **Cache**: at most `cache_size` DIDs (two generations: a DID stays at least until
//!   `cache_size / 2` others were resolved after it). An entry younger than `ttl` is
//!   served as is; an older one is still served at once (stale-while-revalidate) while one
//!   background request refreshes it.
//! - **Definite answers are remembered**: a DID the directory or its host does not know
//!   (404/410), or whose document gives no usable identity, is answered from the cache for
//!   `negative_ttl` (2 min) without asking again; an `#identity` for it forgets that.
//! - **Single flight**: concurrent look-ups of one DID share one request (a burst of 200
//!   commits by a new DID makes one); a refresh after a failed signature joins a request
//!   already in flight (one an `#identity` started) instead of answering from the cache.
//! - **Each host on its own**: the PLC directory has its permits (`concurrency`) and its
//!   health; every `did:web` host has a small cap (`web_concurrency`) and its own backoff.
//!   A failing or slow `did:web` host costs only its own DIDs, never the directory's. A
//!   wait for a permit is bounded by `request_timeout`; after a failure a host is left
//!   alone for a backoff (100 ms doubling to 10 s), and look-ups fail at once with
//!   [`ResolveError::Unavailable`] so callers hold their events and retry, never guess.
//! - **Background requests are capped** (`background`): stale entries and `#identity`
//!   refreshes beyond it wait for the next look-up.
//! - **Addresses from the network**: a `did:web` host is reached only at public addresses
//!   (loopback and private ones refused, by name or IP, redirects included) unless
//!   `allow_private`; a document is read up to `max_document` bytes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guarded_http::Guard;
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
    /// How long a definite answer (not found, no usable identity) is served.
    pub negative_ttl: Duration,
    /// Requests to the PLC directory at a time.
    pub concurrency: usize,
    /// Requests to one `did:web` host at a time.
    pub web_concurrency: usize,
    /// Background requests (stale entries, `#identity`) at a time.
    pub background: usize,
    /// One request's limit, and the longest wait for a permit.
    pub request_timeout: Duration,
    /// A refresh (after a signature failed) within this long of the last refresh of the
    /// same DID is answered from the cache: a stream of bad signatures costs the
    /// directory one request, not one each. An `#identity` lifts it.
    pub min_refresh: Duration,
    /// The largest DID document read.
    pub max_document: usize,
    /// `did:web` hosts may be loopback or private addresses (tests, private networks).
    pub allow_private: bool,
    /// `did:web` documents over plain HTTP (tests).
    pub web_http: bool,
}

impl Default for ResolverConfig {
    fn default() -> Self {
        Self {
            plc_url: "https://plc.directory".into(),
            cache_size: 100_000,
            ttl: Duration::from_hours(1),
            negative_ttl: Duration::from_mins(2),
            concurrency: 16,
            web_concurrency: 2,
            background: 32,
            request_timeout: Duration::from_secs(5),
            min_refresh: Duration::from_secs(10),
            max_document: 64 * 1024,
            allow_private: false,
            web_http: false,
        }
    }
}

/// Why a DID did not resolve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The directory or host failed (connection, timeout, 5xx, garbage), is in its
    /// backoff, or has no permit free: try again later. A message, not the HTTP client's
    /// error (which names the URL); resolutions and their failures are cached and cloned.
    #[error("the DID directory is unavailable: {0}")]
    Unavailable(String),
    /// The directory or host answered that it does not know the DID (404/410).
    #[error("the DID is not known to the directory (HTTP {0})")]
    NotFound(u16),
    /// The document was served but gives no usable identity.
    #[error(transparent)]
    Document(#[from] DocError),
    /// The host is not reachable by policy (not a public address) or served too much (a
    /// message, for the reason given at `Unavailable`).
    #[error("the DID document was not fetched: {0}")]
    Refused(String),
    /// Not a `did:plc` or `did:web`.
    #[error("unsupported DID method in {0:?}")]
    Method(String),
}

impl ResolveError {
    /// True when asking again later may succeed (the caller holds the event meanwhile);
    /// false for a definite answer, which is remembered for `negative_ttl`.
    #[must_use]
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

type Flight = Arc<OnceCell<Result<Arc<Identity>, ResolveError>>>;

/// What the cache holds for a DID.
#[derive(Clone)]
enum Entry {
    /// A resolved identity.
    Found {
        identity: Arc<Identity>,
        fetched: Instant,
        /// Fetched by a refresh (so a refresh soon after is answered from here).
        refreshed: bool,
    },
    /// A definite answer: not known, or no usable identity.
    Gone { error: ResolveError, at: Instant },
}

/// Two generations of at most `half` DIDs each.
struct Cache {
    half: usize,
    young: HashMap<String, Entry>,
    old: HashMap<String, Entry>,
}

impl Cache {
    fn get(&mut self, did: &str) -> Option<Entry> {
        if let Some(c) = self.young.get(did) {
            return Some(c.clone());
        }
        let c = self.old.remove(did)?;
        self.put(did.to_owned(), c.clone());
        Some(c)
    }

    fn put(&mut self, did: String, c: Entry) {
        if self.young.len() >= self.half && !self.young.contains_key(&did) {
            self.old.clear();
            std::mem::swap(&mut self.young, &mut self.old);
        }
        self.young.insert(did, c);
    }

    fn entry(&mut self, did: &str) -> Option<&mut Entry> {
        match self.young.get_mut(did) {
            Some(e) => Some(e),
            None => self.old.get_mut(did),
        }
    }

    fn remove(&mut self, did: &str) {
        self.young.remove(did);
        self.old.remove(did);
    }
}

/// One host's permits and health.
struct Host {
    permits: Semaphore,
    health: Mutex<Health>,
}

/// Backoff towards a failing host.
struct Health {
    until: Option<Instant>,
    delay: Duration,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// `did:web` hosts tracked at most; beyond it idle ones are forgotten.
const WEB_HOSTS_MAX: usize = 4096;

impl Host {
    fn new(permits: usize) -> Self {
        Self { permits: Semaphore::new(permits.max(1)), health: Mutex::new(Health { until: None, delay: BACKOFF_MIN }) }
    }

    fn backing_off(&self) -> bool {
        self.health.lock().expect("health").until.is_some_and(|u| Instant::now() < u)
    }

    fn record(&self, failed: bool) {
        let mut h = self.health.lock().expect("health");
        if failed {
            h.until = Some(Instant::now() + h.delay);
            h.delay = (h.delay * 2).min(BACKOFF_MAX);
        } else {
            *h = Health { until: None, delay: BACKOFF_MIN };
        }
    }
}

/// Where a DID's document is served.
enum Target {
    Plc(String),
    Web { url: String, host: String },
}

/// A shared DID resolver (cheap to clone).
#[derive(Clone)]
pub struct Resolver {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ResolverConfig,
    plc_http: reqwest::Client,
    web_http: guarded_http::Client,
    cache: Mutex<Cache>,
    flights: Mutex<HashMap<String, Flight>>,
    plc: Host,
    web: Mutex<HashMap<String, Arc<Host>>>,
    background: Arc<Semaphore>,
    requests: AtomicU64,
}

impl Resolver {
    /// A resolver with its own HTTP clients.
    ///
    /// # Errors
    /// When an HTTP client cannot be built (no TLS provider installed).
    pub fn new(cfg: ResolverConfig) -> Result<Self, ResolveError> {
        // The process-wide TLS provider (a no-op when the binary installed it first).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let base = || {
            reqwest::Client::builder()
                .timeout(cfg.request_timeout)
                .user_agent(concat!("firekeeper/", env!("CARGO_PKG_VERSION")))
        };
        let built = |e: reqwest::Error| ResolveError::Unavailable(format!("HTTP client: {e}"));
        // The directory is the operator's choice; a did:web host is the network's.
        let plc_http = base().build().map_err(built)?;
        let guard = Guard { allow_private: cfg.allow_private, ..Guard::default() };
        let web_http = guarded_http::Client::new(guard, base()).map_err(built)?;
        let half = (cfg.cache_size / 2).max(1);
        Ok(Self {
            inner: Arc::new(Inner {
                plc: Host::new(cfg.concurrency),
                background: Arc::new(Semaphore::new(cfg.background.max(1))),
                cfg,
                plc_http,
                web_http,
                cache: Mutex::new(Cache { half, young: HashMap::new(), old: HashMap::new() }),
                flights: Mutex::new(HashMap::new()),
                web: Mutex::new(HashMap::new()),
                requests: AtomicU64::new(0),
            }),
        })
    }

    /// The identity of `did`: from the cache when it has one (a stale one is served and
    /// refreshed in the background; a definite "no" is repeated), else from the network.
    ///
    /// # Errors
    /// When the DID cannot be resolved now, or a definite answer says it cannot.
    pub async fn resolve(&self, did: &str) -> Result<Arc<Identity>, ResolveError> {
        let cached = self.inner.cache.lock().expect("cache").get(did);
        match cached {
            Some(Entry::Found { identity, fetched, .. }) if fetched.elapsed() < self.inner.cfg.ttl => Ok(identity),
            Some(Entry::Found { identity, .. }) => {
                self.in_background(did, false);
                Ok(identity)
            }
            Some(Entry::Gone { error, at }) if at.elapsed() < self.inner.cfg.negative_ttl => Err(error),
            _ => self.fetch(did, false).await,
        }
    }

    /// Asks again even when the cache holds `did` (a signature failed with the cached
    /// key: the repo may have rotated it), joining a request already in flight; within
    /// `min_refresh` of the last refresh, the cache answers (unless an `#identity` came).
    ///
    /// # Errors
    /// When the DID cannot be resolved now.
    pub async fn refresh(&self, did: &str) -> Result<Arc<Identity>, ResolveError> {
        let flying = self.inner.flights.lock().expect("flights").get(did).cloned();
        if let Some(f) = flying {
            return self.join(did, f, true).await;
        }
        let cached = self.inner.cache.lock().expect("cache").get(did);
        if let Some(Entry::Found { identity, fetched, refreshed: true }) = cached
            && fetched.elapsed() < self.inner.cfg.min_refresh
        {
            return Ok(identity);
        }
        self.fetch(did, true).await
    }

    /// Forgets `did` (its document must be asked for before it is used again).
    pub fn invalidate(&self, did: &str) {
        self.inner.cache.lock().expect("cache").remove(did);
    }

    /// An `#identity` event said the document of `did` may have changed: a definite
    /// "no" is forgotten, the refresh limit lifted, and a fresh request started in the
    /// background (a refresh after a failed signature joins it). Until it lands, a known
    /// identity still serves (a look-up never waits on the directory for a DID it knows).
    pub fn changed(&self, did: &str) {
        let known = {
            let mut cache = self.inner.cache.lock().expect("cache");
            match cache.entry(did) {
                Some(Entry::Found { refreshed, .. }) => {
                    *refreshed = false;
                    true
                }
                Some(Entry::Gone { .. }) => {
                    cache.remove(did);
                    false
                }
                None => false,
            }
        };
        if known {
            // A new flight: one in flight now may have been asked before the change.
            let flight = Flight::default();
            self.inner.flights.lock().expect("flights").insert(did.to_owned(), flight.clone());
            self.spawn_flight(did, flight, false);
        }
    }

    /// Requests made so far (for tests and metrics).
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    /// Refreshes `did` in the background when a background permit is free.
    fn in_background(&self, did: &str, refreshed: bool) {
        let flight = {
            let mut f = self.inner.flights.lock().expect("flights");
            if f.contains_key(did) {
                return;
            }
            f.entry(did.to_owned()).or_default().clone()
        };
        self.spawn_flight(did, flight, refreshed);
    }

    /// Drives `flight` to its answer in a task, if a background permit is free (else the
    /// flight is dropped, and the next look-up asks).
    fn spawn_flight(&self, did: &str, flight: Flight, refreshed: bool) {
        let Ok(permit) = self.inner.background.clone().try_acquire_owned() else {
            self.forget_flight(did, &flight);
            return;
        };
        let me = self.clone();
        let did = did.to_owned();
        tokio::spawn(async move {
            let _ = me.join(&did, flight, refreshed).await;
            drop(permit);
        });
    }

    /// One request per DID at a time: joins a request in flight or starts one.
    async fn fetch(&self, did: &str, refreshed: bool) -> Result<Arc<Identity>, ResolveError> {
        let flight = self.inner.flights.lock().expect("flights").entry(did.to_owned()).or_default().clone();
        self.join(did, flight, refreshed).await
    }

    async fn join(&self, did: &str, flight: Flight, refreshed: bool) -> Result<Arc<Identity>, ResolveError> {
        let out = flight.get_or_init(|| self.request(did, refreshed)).await.clone();
        self.forget_flight(did, &flight);
        out
    }

    fn forget_flight(&self, did: &str, flight: &Flight) {
        let mut f = self.inner.flights.lock().expect("flights");
        if f.get(did).is_some_and(|g| Arc::ptr_eq(g, flight)) {
            f.remove(did);
        }
    }

    /// The host state of a `did:web` host.
    fn web_host(&self, host: &str) -> Arc<Host> {
        let mut hosts = self.inner.web.lock().expect("hosts");
        if hosts.len() >= WEB_HOSTS_MAX && !hosts.contains_key(host) {
            hosts.retain(|_, h| Arc::strong_count(h) > 1 || h.backing_off());
        }
        hosts.entry(host.to_owned()).or_insert_with(|| Arc::new(Host::new(self.inner.cfg.web_concurrency))).clone()
    }

    async fn request(&self, did: &str, refreshed: bool) -> Result<Arc<Identity>, ResolveError> {
        let target = self.target(did)?;
        let web_host;
        let (host, request) = match &target {
            Target::Plc(url) => (&self.inner.plc, self.inner.plc_http.get(url)),
            Target::Web { url, host } => {
                let request = self.inner.web_http.get(url).map_err(|e| ResolveError::Refused(e.to_string()))?;
                web_host = self.web_host(host);
                (&*web_host, request)
            }
        };
        let web = matches!(target, Target::Web { .. });
        if host.backing_off() {
            return Err(ResolveError::Unavailable("backing off after a failure".into()));
        }
        let _permit = tokio::time::timeout(self.inner.cfg.request_timeout, host.permits.acquire())
            .await
            .map_err(|_| ResolveError::Unavailable("no request slot free towards this host".into()))?
            .expect("never closed");
        self.inner.requests.fetch_add(1, Ordering::Relaxed);
        let out = self.get(did, request, web).await.map(Arc::new);
        host.record(matches!(out, Err(ResolveError::Unavailable(_))));
        let entry = match &out {
            Ok(identity) => Entry::Found { identity: identity.clone(), fetched: Instant::now(), refreshed },
            Err(e) if !e.is_transient() => Entry::Gone { error: e.clone(), at: Instant::now() },
            Err(_) => return out,
        };
        self.inner.cache.lock().expect("cache").put(did.to_owned(), entry);
        out
    }

    async fn get(&self, did: &str, request: reqwest::RequestBuilder, web: bool) -> Result<Identity, ResolveError> {
        let failed = |e: &reqwest::Error| match guarded_http::refused(e) {
            Some(why) => ResolveError::Refused(why),
            None => ResolveError::Unavailable(guarded_http::kind(e).to_owned()),
        };
        let resp = request.send().await.map_err(|e| failed(&e))?;
        let status = resp.status().as_u16();
        if status == 404 || status == 410 {
            return Err(ResolveError::NotFound(status));
        }
        if !resp.status().is_success() {
            return Err(ResolveError::Unavailable(format!("HTTP {status}")));
        }
        let body = guarded_http::read_bounded(resp, self.inner.cfg.max_document).await.map_err(|e| match e {
            e @ guarded_http::GuardError::TooLarge { .. } => ResolveError::Refused(e.to_string()),
            e => ResolveError::Unavailable(e.to_string()),
        })?;
        parse_document(did, &body).map_err(|e| match e {
            // A directory answering garbage is failing, not lying about this DID; a
            // did:web host serving garbage for it is its answer.
            DocError::Json(j) if !web => ResolveError::Unavailable(format!("not a DID document: {j}")),
            e => ResolveError::Document(e),
        })
    }

    /// Where the document of `did` is served.
    fn target(&self, did: &str) -> Result<Target, ResolveError> {
        if let Some(id) = did.strip_prefix("did:plc:") {
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(ResolveError::Method(did.to_owned()));
            }
            return Ok(Target::Plc(format!("{}/{did}", self.inner.cfg.plc_url.trim_end_matches('/'))));
        }
        if let Some(host) = did.strip_prefix("did:web:") {
            // A port is percent-encoded; paths (`:` separated) are not atproto did:webs.
            let host = host.replace("%3A", ":").replace("%3a", ":").to_ascii_lowercase();
            if host.is_empty() || host.contains(['/', '@', '?', '#', '[', ']', ' ']) || host.matches(':').count() > 1 {
                return Err(ResolveError::Method(did.to_owned()));
            }
            let scheme = if self.inner.cfg.web_http { "http" } else { "https" };
            return Ok(Target::Web { url: format!("{scheme}://{host}/.well-known/did.json"), host });
        }
        Err(ResolveError::Method(did.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(r: &Resolver, did: &str) -> Result<String, ResolveError> {
        r.target(did).map(|t| match t {
            Target::Plc(u) | Target::Web { url: u, .. } => u,
        })
    }

    #[test]
    fn urls_for_plc_and_web_dids_and_refusals() {
        let r = Resolver::new(ResolverConfig { plc_url: "http://127.0.0.1:9/".into(), ..Default::default() })
            .expect("resolver");
        assert_eq!(url(&r, "did:plc:abc234").as_deref(), Ok("http://127.0.0.1:9/did:plc:abc234"));
        assert_eq!(url(&r, "did:web:example.com").as_deref(), Ok("https://example.com/.well-known/did.json"));
        assert_eq!(url(&r, "did:web:Example.COM").as_deref(), Ok("https://example.com/.well-known/did.json"));
        assert_eq!(url(&r, "did:web:localhost%3A8080").as_deref(), Ok("https://localhost:8080/.well-known/did.json"));
        for bad in ["did:key:z6Mk", "did:plc:", "did:plc:a/b", "did:web:a/b", "did:web:", "did:web:a:b:c"] {
            assert!(matches!(r.target(bad), Err(ResolveError::Method(_))), "{bad}");
        }
    }

    #[test]
    fn the_cache_keeps_recent_dids_within_its_bound() {
        let id = |d: &str| Entry::Found {
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
