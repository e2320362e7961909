//! NATS connections for firekeeper's lease, cursor store and sink: one place that knows
//! the credentials (never logged), bounds every operation by a hard timeout, and names
//! the server only by its redacted address.
//!
//! The client reconnects on its own; an operation that times out forces a reconnect, so
//! a half-open connection (a peer that vanished without a reset) is replaced at the next
//! call instead of after the client's ping timeout.

use std::fmt::Display;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use async_nats;
use async_nats::jetstream::{self, kv};

/// Why a NATS operation failed. Like the Redis errors, all but `Config` mean "outcome
/// unknown": the caller retries or keeps leading until its deadline.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NatsError {
    /// The operation did not finish in time; the connection is being replaced.
    #[error("NATS {addr}: {what} timed out after {after:?}{}", .cause.as_ref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Timeout {
        /// The operation.
        what: &'static str,
        /// The server, as `host:port`.
        addr: String,
        /// The bound.
        after: Duration,
        /// Why the connection is not up, when the client said so (the server refused the
        /// credentials, a TLS handshake failed): the likely reason nothing answered.
        cause: Option<String>,
    },
    /// The server could not be reached or refused the operation.
    #[error("NATS {addr}: {what} failed: {detail}")]
    Unavailable {
        /// The operation.
        what: &'static str,
        /// The server, as `host:port`.
        addr: String,
        /// Why (never holds credentials).
        detail: String,
    },
    /// The settings cannot work (a bad URL, an unreadable credentials file).
    #[error("NATS settings: {0}")]
    Config(String),
}

/// How to reach NATS.
#[derive(Clone)]
pub struct NatsConfig {
    /// `nats://host:port` (credentials in the URL are accepted and never logged).
    pub url: String,
    /// A `.creds` file (a JWT and an `NKey` seed), if the server wants one.
    pub creds_file: Option<PathBuf>,
    /// PEM CA certificates a TLS server (`tls://`, or one that requires TLS) is verified
    /// against instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// A token, if the server wants one.
    pub token: Option<String>,
    /// Bound on every operation (and on connecting).
    pub op_timeout: Duration,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &redact(&self.url))
            .field("creds_file", &self.creds_file)
            .field("ca_file", &self.ca_file)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("op_timeout", &self.op_timeout)
            .finish()
    }
}

/// A NATS URL with its scheme: `host:port` alone means `nats://host:port`.
#[must_use]
pub fn with_scheme(url: &str) -> String {
    if url.contains("://") { url.to_owned() } else { format!("nats://{url}") }
}

/// `host:port` of a NATS URL: what logs and errors may show (no user, password or
/// token).
#[must_use]
pub fn redact(url: &str) -> String {
    match url::Url::parse(&with_scheme(url)) {
        Ok(u) => format!("{}:{}", u.host_str().unwrap_or("?"), u.port().unwrap_or(4222)),
        Err(_) => "<unparseable NATS URL>".to_owned(),
    }
}

/// A connection with its op timeout.
#[derive(Clone)]
pub struct Nats {
    client: async_nats::Client,
    js: jetstream::Context,
    op_timeout: Duration,
    addr: String,
    /// The client's last connection trouble (cleared when it connects).
    trouble: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl std::fmt::Debug for Nats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nats").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Nats {
    /// Connects in the background: this returns at once, and operations fail with
    /// `Timeout`/`Unavailable` until the server is reachable (so a replica can start while
    /// NATS is down, as with Redis). Connection changes are logged with the address only.
    pub async fn connect(cfg: &NatsConfig) -> Result<Self, NatsError> {
        let addr = redact(&cfg.url);
        let mut opts = async_nats::ConnectOptions::new()
            .connection_timeout(cfg.op_timeout.max(Duration::from_millis(500)))
            .request_timeout(Some(cfg.op_timeout))
            .ping_interval(Duration::from_secs(2))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .reconnect_delay_callback(|n| Duration::from_millis((50 * (1u64 << n.min(5))).min(1000)));
        if let Some(t) = &cfg.token {
            opts = opts.token(t.clone());
        }
        if let Some(ca) = &cfg.ca_file {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some(path) = &cfg.creds_file {
            opts = opts
                .credentials_file(path)
                .await
                .map_err(|e| NatsError::Config(format!("NATS_CREDS {}: {e}", path.display())))?;
        }
        let logged = addr.clone();
        let trouble: std::sync::Arc<std::sync::Mutex<Option<String>>> = std::sync::Arc::default();
        let noted = trouble.clone();
        opts = opts.event_callback(move |ev| {
            let addr = logged.clone();
            let noted = noted.clone();
            async move {
                let note = |t: Option<String>| {
                    if let Ok(mut n) = noted.lock() {
                        *n = t;
                    }
                };
                match ev {
                    async_nats::Event::Connected => {
                        note(None);
                        tracing::info!(nats = %addr, "NATS connected");
                    }
                    async_nats::Event::Disconnected => tracing::warn!(nats = %addr, "NATS disconnected"),
                    async_nats::Event::ServerError(e) => {
                        note(Some(format!("the server said: {e}")));
                        tracing::debug!(nats = %addr, error = %e, "NATS server error");
                    }
                    async_nats::Event::ClientError(e) => {
                        note(Some(format!("connecting: {e}")));
                        tracing::debug!(nats = %addr, error = %e, "NATS client error");
                    }
                    other => tracing::debug!(nats = %addr, event = %other, "NATS event"),
                }
            }
        });
        let url = with_scheme(&cfg.url);
        let client = opts.connect(url.as_str()).await.map_err(|e| NatsError::Unavailable {
            what: "connect",
            addr: addr.clone(),
            detail: e.kind().to_string(),
        })?;
        let js = jetstream::new(client.clone());
        Ok(Self { client, js, op_timeout: cfg.op_timeout, addr, trouble })
    }

    /// The redacted address.
    #[must_use]
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The JetStream context.
    #[must_use]
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The core client.
    #[must_use]
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The op timeout.
    #[must_use]
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// Runs `f` within the op timeout. A timeout forces a reconnect (the connection may
    /// be half-open); an error becomes `Unavailable` naming `what`.
    pub async fn bounded<T, E: Display>(
        &self,
        what: &'static str,
        f: impl Future<Output = Result<T, E>>,
    ) -> Result<T, NatsError> {
        self.bounded_for(what, self.op_timeout, f).await
    }

    /// An error's text, with the client's connection trouble when there is one (a request
    /// that failed because the client is not connected says only "timed out").
    fn detail(&self, e: &dyn Display) -> String {
        match self.trouble.lock().ok().and_then(|t| t.clone()) {
            Some(t) => format!("{e} ({t})"),
            None => e.to_string(),
        }
    }

    /// The error of an operation that outlived `after`; the connection may be half-open,
    /// so it is replaced in the background.
    fn timed_out(&self, what: &'static str, after: Duration) -> NatsError {
        let c = self.client.clone();
        tokio::spawn(async move {
            let _ = c.force_reconnect().await;
        });
        let cause = self.trouble.lock().ok().and_then(|t| t.clone());
        NatsError::Timeout { what, addr: self.addr.clone(), after, cause }
    }

    /// [`Nats::bounded`] with its own bound.
    pub async fn bounded_for<T, E: Display>(
        &self,
        what: &'static str,
        after: Duration,
        f: impl Future<Output = Result<T, E>>,
    ) -> Result<T, NatsError> {
        match tokio::time::timeout(after, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(NatsError::Unavailable { what, addr: self.addr.clone(), detail: self.detail(&e) }),
            Err(_) => Err(self.timed_out(what, after)),
        }
    }
}

/// A KV bucket created on first use (and again after it was lost), with fixed settings.
#[derive(Clone)]
pub struct Bucket {
    nats: Nats,
    config: kv::Config,
    /// The bucket's handle once opened. A plain mutex, never held across an await: a
    /// caller's future parked while holding an async lock here (a commit its term loop
    /// stopped polling) left every other caller waiting for ever.
    store: Arc<std::sync::Mutex<Option<kv::Store>>>,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket").field("bucket", &self.config.bucket).finish_non_exhaustive()
    }
}

/// Why `prefix` cannot name buckets: NATS allows only `[A-Za-z0-9_-]` in a bucket name,
/// and folding other characters would make distinct prefixes (`prod.eu`, `prod_eu`)
/// share one deployment's lease, fences and cursors.
#[must_use]
pub fn prefix_problem(prefix: &str) -> Option<String> {
    if prefix.is_empty() {
        return Some("the key prefix is empty; NATS buckets need a name".into());
    }
    let bad: String = prefix.chars().filter(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-')).collect();
    (!bad.is_empty()).then(|| {
        format!(
            "the key prefix {prefix:?} has characters a NATS bucket name cannot hold ({bad:?}); use only letters, \
             digits, `_` and `-` (folding them would let distinct prefixes share buckets)"
        )
    })
}

/// True when an age limit `have` keeps entries at least as long as `want` (zero: for ever).
fn age_covers(have: Duration, want: Duration) -> bool {
    have.is_zero() || (!want.is_zero() && have >= want)
}

/// A bucket name from a key prefix, one-to-one: `<prefix>-<what>`. A prefix with
/// characters NATS does not allow gives a name [`Bucket`] refuses (see [`prefix_problem`]).
#[must_use]
pub fn bucket_name(prefix: &str, what: &str) -> String {
    format!("{prefix}-{what}")
}

impl Bucket {
    /// A bucket keeping one revision per key, file storage, entries expiring `max_age`
    /// after their last write (`ZERO`: never).
    #[must_use]
    pub fn new(nats: Nats, name: String, max_age: Duration) -> Self {
        let config = kv::Config {
            bucket: name,
            history: 1,
            max_age,
            storage: jetstream::stream::StorageType::File,
            ..kv::Config::default()
        };
        Self { nats, config, store: Arc::new(std::sync::Mutex::new(None)) }
    }

    /// Why this bucket's name cannot be used, if it cannot.
    fn name_problem(&self) -> Option<String> {
        let name = &self.config.bucket;
        let prefix = name.rsplit_once('-').map_or(name.as_str(), |(p, _)| p);
        prefix_problem(prefix).or_else(|| {
            name.chars()
                .any(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
                .then(|| format!("bucket name {name:?} has characters NATS does not allow"))
        })
    }

    /// The connection.
    #[must_use]
    pub fn nats(&self) -> &Nats {
        &self.nats
    }

    /// The bucket's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.config.bucket
    }

    /// The bucket handle, creating the bucket (or updating its age limit) when needed.
    ///
    /// The bucket's stream is created directly, with the KV conventions (`KV_<bucket>`,
    /// subjects `$KV.<bucket>.>`, rollups, direct get), instead of through the client's
    /// KV creation, which reads the account's info and fails on servers before 2.10
    /// (Debian's 2.9 lacks fields the client requires there).
    pub async fn store(&self) -> Result<kv::Store, NatsError> {
        if let Some(st) = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
            return Ok(st.clone());
        }
        // Opened without the lock held: two callers may both open it (idempotent).
        if let Some(problem) = self.name_problem() {
            return Err(NatsError::Config(problem));
        }
        let js = self.nats.js.clone();
        let cfg = jetstream::stream::Config {
            name: format!("KV_{}", self.config.bucket),
            subjects: vec![format!("$KV.{}.>", self.config.bucket)],
            max_messages_per_subject: self.config.history,
            max_age: self.config.max_age,
            storage: self.config.storage,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: jetstream::stream::DiscardPolicy::New,
            num_replicas: 1,
            ..jetstream::stream::Config::default()
        };
        let stream = self.nats.bounded("create bucket", js.get_or_create_stream(cfg.clone())).await?;
        let have = stream.cached_info().config.max_age;
        if have != cfg.max_age && age_covers(have, cfg.max_age) {
            // Said once per opening, not at every check.
            tracing::warn!(
                bucket = %self.config.bucket,
                bucket_max_age_ms = have.as_millis() as u64,
                configured_ms = cfg.max_age.as_millis() as u64,
                "the bucket keeps entries longer than configured (another replica's, or an earlier, ttl); it is \
                 never lowered while replicas may rely on it: a crashed leader's key lives that long. To lower \
                 it, stop every replica and delete the bucket"
            );
        }
        self.keep_age_at_least(&stream).await?;
        let st = self.nats.bounded("open bucket", js.get_key_value(self.config.bucket.clone())).await?;
        *self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(st.clone());
        Ok(st)
    }

    /// Raises the bucket's age limit to the configured one when it is lower; never lowers
    /// it. Entries of a bucket are the lease keys of every replica: a replica started with
    /// a shorter ttl (a rolling change of it) must not make the running leader's key
    /// expire before that leader's own deadline, which would let a second term start
    /// while the first still acts. A longer limit only makes a crashed leader's takeover
    /// wait longer, which [`Bucket::store`] logs.
    async fn keep_age_at_least(&self, stream: &jetstream::stream::Stream) -> Result<(), NatsError> {
        let want = self.config.max_age;
        let mut cfg = stream.cached_info().config.clone();
        let have = cfg.max_age;
        if age_covers(have, want) {
            return Ok(());
        }
        tracing::warn!(
            bucket = %self.config.bucket,
            from_ms = have.as_millis() as u64,
            to_ms = want.as_millis() as u64,
            "raising the bucket's age limit to the configured ttl"
        );
        cfg.max_age = want;
        self.nats.bounded("update bucket", self.nats.js.update_stream(cfg)).await?;
        Ok(())
    }

    /// Checks the bucket's age limit against the configured one and raises it when
    /// something lowered it (an older replica, an operator); the lease checks it every
    /// third of its ttl. Leaves the cached handle alone (a failed check is not the
    /// operations' business).
    pub async fn ensure_age(&self) -> Result<(), NatsError> {
        if let Some(problem) = self.name_problem() {
            return Err(NatsError::Config(problem));
        }
        let js = self.nats.js.clone();
        let name = format!("KV_{}", self.config.bucket);
        let stream = self.nats.bounded("bucket info", js.get_stream(name)).await?;
        self.keep_age_at_least(&stream).await
    }

    /// Forgets the handle after a failure, so the next call looks the bucket up again
    /// (it may have been deleted, or the server restarted without its data).
    pub fn invalidate(&self) {
        *self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    /// Runs `f` on the bucket within one op timeout (lookup included); any failure
    /// invalidates the handle.
    pub async fn op<T, E: Display, F: Future<Output = Result<T, E>>>(
        &self,
        what: &'static str,
        f: impl FnOnce(kv::Store) -> F,
    ) -> Result<T, NatsError> {
        let run = async {
            let st = self.store().await?;
            f(st).await.map_err(|e| NatsError::Unavailable {
                what,
                addr: self.nats.addr.clone(),
                detail: self.nats.detail(&e),
            })
        };
        // Boxed: the client's futures are large, and every caller would carry them.
        let out = if let Ok(r) = tokio::time::timeout(self.nats.op_timeout, Box::pin(run)).await {
            r
        } else {
            Err(self.nats.timed_out(what, self.nats.op_timeout))
        };
        if out.is_err() {
            self.invalidate();
        }
        out
    }
}

/// A key's live value and revision: `None` when absent, deleted or purged.
#[must_use]
pub fn live(e: Option<kv::Entry>) -> Option<(bytes::Bytes, u64)> {
    e.filter(|e| e.operation == kv::Operation::Put).map(|e| (e.value, e.revision))
}

impl Bucket {
    /// A key's live value and revision.
    pub async fn read(&self, key: String) -> Result<Option<(bytes::Bytes, u64)>, NatsError> {
        self.op("read", |st| async move { st.entry(key).await }).await.map(live)
    }

    /// Every live key that starts with `prefix`, listed within 30 s (a listing can be
    /// long: it reads the bucket's whole key set).
    pub async fn keys_with(&self, prefix: &str) -> Result<Vec<String>, NatsError> {
        use futures_util::TryStreamExt as _;
        const LIST: Duration = Duration::from_secs(30);
        let list = async {
            let st = self.store().await?;
            let unavailable =
                |detail: String| NatsError::Unavailable { what: "list keys", addr: self.nats.addr.clone(), detail };
            let keys = st.keys().await.map_err(|e| unavailable(e.to_string()))?;
            let all: Vec<String> = keys.try_collect().await.map_err(|e| unavailable(e.to_string()))?;
            Ok(all.into_iter().filter(|k| k.starts_with(prefix)).collect())
        };
        match tokio::time::timeout(LIST, Box::pin(list)).await {
            Ok(r) => r,
            Err(_) => Err(self.nats.timed_out("list keys", LIST)),
        }
    }

    /// Calls `f` with every change of `key` (or of the keys a pattern like `cursor.>`
    /// names), watching again after errors and reconnects; returns only when dropped.
    pub async fn follow(&self, key: &'static str, mut f: impl FnMut(kv::Entry) + Send) {
        use futures_util::StreamExt as _;
        loop {
            if let Ok(mut w) = self.op("watch", |st| async move { st.watch(key).await }).await {
                while let Some(Ok(e)) = w.next().await {
                    f(e);
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Compare-and-set: writes `value` if the key is still at `rev` (`None`: absent,
    /// deleted or purged) and returns the new revision; `Ok(None)` when another writer
    /// got there first.
    pub async fn cas(&self, key: String, value: bytes::Bytes, rev: Option<u64>) -> Result<Option<u64>, NatsError> {
        self.op("compare-and-set", |st| async move {
            match rev {
                Some(r) => match st.update(key, value, r).await {
                    Ok(n) => Ok(Some(n)),
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
                    Err(e) => Err(e.to_string()),
                },
                None => match st.create(key, value).await {
                    Ok(n) => Ok(Some(n)),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
                    Err(e) => Err(e.to_string()),
                },
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_shown_without_credentials() {
        assert_eq!(redact("nats://user:secret@10.0.0.1:4333"), "10.0.0.1:4333");
        assert_eq!(redact("nats://tok3n@nats.internal"), "nats.internal:4222");
        assert_eq!(redact("127.0.0.1:4222"), "127.0.0.1:4222");
        let cfg = NatsConfig {
            url: "nats://u:hunter2@h:1".into(),
            creds_file: None,
            ca_file: None,
            token: Some("t0ken".into()),
            op_timeout: Duration::from_secs(1),
        };
        let shown = format!("{cfg:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("t0ken"), "{shown}");
    }

    /// Errors name the server by address only, and the operation.
    #[tokio::test]
    async fn errors_name_the_server_and_the_operation_without_credentials() {
        let port =
            std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("port");
        let cfg = NatsConfig {
            url: format!("nats://user:hunter2@127.0.0.1:{port}"),
            creds_file: None,
            ca_file: None,
            token: None,
            op_timeout: Duration::from_millis(200),
        };
        let n = Nats::connect(&cfg).await.expect("connects in the background");
        let b = Bucket::new(n, "x-state".into(), Duration::ZERO);
        let e = b.read("k".into()).await.expect_err("nothing listens there").to_string();
        // The operation is named: the bucket's creation, or the read whose bound ran out
        // first (both are bounded by the same op timeout).
        let names_op = e.contains("bucket") || e.contains("read");
        assert!(e.contains(&format!("127.0.0.1:{port}")) && names_op && !e.contains("hunter2"), "{e}");
    }

    #[test]
    fn prefixes_map_one_to_one_or_are_refused() {
        assert_eq!(bucket_name("firekeeper", "lease"), "firekeeper-lease");
        assert_eq!(prefix_problem("prod_eu"), None);
        assert_eq!(prefix_problem("prod-eu-2"), None);
        for bad in ["prod.eu", "fk:{prod}", "a b", "é", ""] {
            assert!(prefix_problem(bad).is_some(), "{bad:?} is refused");
        }
        assert_ne!(bucket_name("prod.eu", "lease"), bucket_name("prod_eu", "lease"));
    }
}
