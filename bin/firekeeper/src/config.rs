//! Configuration from the environment: `FIREKEEPER_*` plus the conventional `REDIS_URL`,
//! `DATABASE_URL`, `RUST_LOG` and `OTEL_*`. Every bad variable is reported by name in
//! one error, and unknown `FIREKEEPER_*` variables are refused (a typo must not fall back
//! to a default silently).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use lease::LeaseConfig;
use relay_client::client::{BadFramePolicy, FutureCursorPolicy};
use relay_client::{ClientConfig, RelayUrl};

/// Where cursors are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// Redis, fenced by the Redis lease (default with `REDIS_URL`).
    Redis,
    /// Files in the data directory, fenced by the local lease file (default without).
    File,
    /// Postgres (`DATABASE_URL`), fenced by the highest token presented.
    Postgres,
}

/// Where events go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkKind {
    /// One JSON line per event, to stdout (`-`) or a file.
    Jsonl(String),
    /// Rows in Postgres, with the cursor in the same transaction.
    Postgres,
    /// Batched POSTs of JSON lines.
    Webhook {
        /// Target URL (never logged).
        url: String,
        /// Events per POST.
        batch: usize,
        /// Per-request timeout.
        timeout: Duration,
    },
    /// Discard (benchmarks).
    Null,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Primary relay.
    pub relay: RelayUrl,
    /// Secondary relay, if any.
    pub relay_secondary: Option<RelayUrl>,
    /// `REDIS_URL`: enables the Redis lease.
    pub redis_url: Option<String>,
    /// `DATABASE_URL`.
    pub database_url: Option<String>,
    /// Cursor store.
    pub store: StoreKind,
    /// Sink.
    pub sink: SinkKind,
    /// Collection filters: exact NSIDs or `prefix.*`.
    pub collections: Vec<String>,
    /// Lock file and file cursors live here.
    pub data_dir: PathBuf,
    /// Lease timing and key prefix.
    pub lease: LeaseConfig,
    /// Prefix of legacy host-keyed cursors to migrate.
    pub legacy_cursor_prefix: Option<String>,
    /// How often the watermark is committed.
    pub commit_interval: Duration,
    /// Step-down drain budget.
    pub drain_budget: Duration,
    /// HTTP listen address; `None` = off.
    pub http_addr: Option<SocketAddr>,
    /// Processing lanes (events of one repo always share a lane).
    pub lanes: usize,
    /// Events queued per lane before the socket is pushed back on.
    pub queue_depth: usize,
    /// Relay connection settings.
    pub client: ClientConfig,
    /// Check record block hashes.
    pub verify_blocks: bool,
    /// Instance id; random when unset.
    pub instance_id: Option<String>,
    /// `json` (default) or `text` logs.
    pub log_json: bool,
}

const KNOWN: &[&str] = &[
    "relay",
    "relay_secondary",
    "cursor_store",
    "sink",
    "jsonl_path",
    "webhook_url",
    "webhook_batch",
    "webhook_timeout_ms",
    "collections",
    "data_dir",
    "key_prefix",
    "legacy_cursor_prefix",
    "lease_ttl_ms",
    "lease_renew_ms",
    "lease_op_timeout_ms",
    "lease_margin_ms",
    "lease_poll_ms",
    "commit_interval_ms",
    "drain_budget_ms",
    "http_addr",
    "lanes",
    "queue_depth",
    "connect_timeout_ms",
    "stall_timeout_ms",
    "future_cursor",
    "bad_frame",
    "max_frame_bytes",
    "failover_after",
    "probe_interval_ms",
    "verify_blocks",
    "instance_id",
    "log_format",
];

/// Every problem, one line each, naming the variable.
#[derive(Debug)]
pub struct ConfigErrors(pub Vec<String>);

impl std::fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "invalid configuration ({} problem{}):", self.0.len(), if self.0.len() == 1 { "" } else { "s" })?;
        for p in &self.0 {
            writeln!(f, "  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

struct Vars {
    map: HashMap<String, String>,
    errors: Vec<String>,
}

impl Vars {
    fn get(&self, k: &str) -> Option<&str> {
        self.map.get(k).map(String::as_str).filter(|v| !v.trim().is_empty()).map(str::trim)
    }

    fn ms(&mut self, k: &str, default: Duration) -> Duration {
        match self.get(k) {
            None => default,
            Some(v) => match v.parse::<u64>() {
                Ok(n) if n > 0 => Duration::from_millis(n),
                _ => {
                    self.errors.push(format!(
                        "FIREKEEPER_{}={v:?} is not a positive number of milliseconds",
                        k.to_uppercase()
                    ));
                    default
                }
            },
        }
    }

    fn count(&mut self, k: &str, default: usize, max: usize) -> usize {
        match self.get(k) {
            None => default,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if n > 0 && n <= max => n,
                _ => {
                    self.errors
                        .push(format!("FIREKEEPER_{}={v:?} must be a whole number in 1..={max}", k.to_uppercase()));
                    default
                }
            },
        }
    }

    fn relay(&mut self, k: &str, v: &str) -> Option<RelayUrl> {
        match RelayUrl::parse(v) {
            Ok(u) => Some(u),
            Err(e) => {
                // The value is not echoed: it may carry credentials.
                self.errors.push(format!("FIREKEEPER_{}: {e}", k.to_uppercase()));
                None
            }
        }
    }
}

impl Config {
    /// Reads the process environment through the `config` crate.
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::from_source(None)
    }

    /// Reads from an explicit map of `FIREKEEPER_*`-style variables plus `REDIS_URL` and
    /// `DATABASE_URL` (for tests).
    pub fn from_source(vars: Option<HashMap<String, String>>) -> Result<Self, ConfigErrors> {
        let (fk, conventional): (HashMap<String, String>, HashMap<String, String>) = match vars {
            Some(v) => (
                v.iter().filter(|(k, _)| k.starts_with("FIREKEEPER_")).map(|(k, v)| (k.clone(), v.clone())).collect(),
                v.into_iter().filter(|(k, _)| !k.starts_with("FIREKEEPER_")).collect(),
            ),
            None => (
                std::env::vars().filter(|(k, _)| k.starts_with("FIREKEEPER_")).collect(),
                std::env::vars().filter(|(k, _)| k == "REDIS_URL" || k == "DATABASE_URL").collect(),
            ),
        };
        let built = config::Config::builder()
            .add_source(
                config::Environment::with_prefix("FIREKEEPER")
                    .prefix_separator("_")
                    .source(Some(fk.into_iter().collect())),
            )
            .build()
            .and_then(config::Config::try_deserialize::<HashMap<String, String>>)
            .map_err(|e| ConfigErrors(vec![format!("reading FIREKEEPER_* variables: {e}")]))?;
        let mut v = Vars { map: built, errors: Vec::new() };
        let mut unknown: Vec<String> = v
            .map
            .keys()
            .filter(|k| !KNOWN.contains(&k.as_str()))
            .map(|k| format!("FIREKEEPER_{}", k.to_uppercase()))
            .collect();
        unknown.sort();
        for u in unknown {
            v.errors.push(format!("{u} is not a firekeeper setting (see the README's table)"));
        }
        let cget = |k: &str| conventional.get(k).map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
        let redis_url = cget("REDIS_URL");
        let database_url = cget("DATABASE_URL");

        let relay_raw = v.get("relay").unwrap_or("wss://bsky.network").to_owned();
        let relay = v.relay("relay", &relay_raw);
        let relay_secondary = v.get("relay_secondary").map(str::to_owned).and_then(|s| v.relay("relay_secondary", &s));
        if let (Some(p), Some(s)) = (&relay, &relay_secondary)
            && p.fingerprint() == s.fingerprint()
        {
            v.errors.push("FIREKEEPER_RELAY_SECONDARY is the same relay as FIREKEEPER_RELAY".into());
        }
        if let Some(u) = &redis_url
            && redis::Client::open(u.as_str()).is_err()
        {
            v.errors.push("REDIS_URL is not a valid redis:// or rediss:// URL".into());
        }

        let store = match v.get("cursor_store") {
            None if redis_url.is_some() => StoreKind::Redis,
            None | Some("file") => StoreKind::File,
            Some("redis") => StoreKind::Redis,
            Some("postgres") => StoreKind::Postgres,
            Some(other) => {
                v.errors.push(format!("FIREKEEPER_CURSOR_STORE={other:?} must be redis, file or postgres"));
                StoreKind::File
            }
        };
        if store == StoreKind::Redis && redis_url.is_none() {
            v.errors.push("FIREKEEPER_CURSOR_STORE=redis needs REDIS_URL".into());
        }
        if store == StoreKind::File && redis_url.is_some() {
            v.errors.push("FIREKEEPER_CURSOR_STORE=file cannot be fenced by the Redis lease; use redis or postgres with REDIS_URL".into());
        }
        let sink = match v.get("sink").unwrap_or("jsonl") {
            "jsonl" => SinkKind::Jsonl(v.get("jsonl_path").unwrap_or("-").to_owned()),
            "postgres" => SinkKind::Postgres,
            "null" => SinkKind::Null,
            "webhook" => {
                let url = v.get("webhook_url").map(str::to_owned);
                let batch = v.count("webhook_batch", 100, 10_000);
                let timeout = v.ms("webhook_timeout_ms", Duration::from_secs(5));
                match url {
                    Some(u) if u.starts_with("http://") || u.starts_with("https://") => {
                        SinkKind::Webhook { url: u, batch, timeout }
                    }
                    Some(_) => {
                        v.errors.push("FIREKEEPER_WEBHOOK_URL must be an http:// or https:// URL".into());
                        SinkKind::Null
                    }
                    None => {
                        v.errors.push("FIREKEEPER_SINK=webhook needs FIREKEEPER_WEBHOOK_URL".into());
                        SinkKind::Null
                    }
                }
            }
            other => {
                v.errors.push(format!("FIREKEEPER_SINK={other:?} must be jsonl, postgres, webhook or null"));
                SinkKind::Null
            }
        };
        if (sink == SinkKind::Postgres || store == StoreKind::Postgres) && database_url.is_none() {
            v.errors.push("the postgres sink and cursor store need DATABASE_URL".into());
        }
        if sink == SinkKind::Postgres && store != StoreKind::Postgres {
            v.errors.push("FIREKEEPER_SINK=postgres keeps the cursor in the same transaction: set FIREKEEPER_CURSOR_STORE=postgres".into());
        }
        if store == StoreKind::Postgres && sink != SinkKind::Postgres && redis_url.is_none() {
            v.errors.push(
                "FIREKEEPER_CURSOR_STORE=postgres needs REDIS_URL for the lease (or use the postgres sink)".into(),
            );
        }

        let collections: Vec<String> = v
            .get("collections")
            .map(|c| c.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        for c in &collections {
            let body = c.strip_suffix(".*").unwrap_or(c);
            if body.is_empty() || !body.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '.' || ch == '-') {
                v.errors.push(format!("FIREKEEPER_COLLECTIONS entry {c:?} is not an NSID or `prefix.*`"));
            }
        }

        let d = LeaseConfig::default();
        let lease = LeaseConfig {
            ttl: v.ms("lease_ttl_ms", d.ttl),
            renew_every: v.ms("lease_renew_ms", d.renew_every),
            op_timeout: v.ms("lease_op_timeout_ms", d.op_timeout),
            margin: v.ms("lease_margin_ms", d.margin),
            poll: v.ms("lease_poll_ms", d.poll),
            key_prefix: v.get("key_prefix").unwrap_or("firekeeper").to_owned(),
        };
        if let Err(e) = lease.validate() {
            for p in e.problems {
                v.errors.push(format!("FIREKEEPER_LEASE_*: {p}"));
            }
        }
        let http_addr = match v.get("http_addr").unwrap_or("127.0.0.1:9090") {
            "off" => None,
            a => {
                if let Ok(a) = a.parse() {
                    Some(a)
                } else {
                    v.errors.push(format!("FIREKEEPER_HTTP_ADDR={a:?} is not host:port (or off)"));
                    None
                }
            }
        };
        let mut client = ClientConfig {
            connect_timeout: v.ms("connect_timeout_ms", Duration::from_secs(10)),
            stall_timeout: v.ms("stall_timeout_ms", Duration::from_mins(1)),
            ..ClientConfig::default()
        };
        client.failover_after = u32::try_from(v.count("failover_after", 3, 1000)).unwrap_or(3);
        client.probe_interval = v.ms("probe_interval_ms", Duration::from_secs(30));
        client.future_cursor = match v.get("future_cursor").unwrap_or("fail") {
            "fail" => FutureCursorPolicy::Fail,
            "live" => FutureCursorPolicy::GoLive,
            other => {
                v.errors.push(format!("FIREKEEPER_FUTURE_CURSOR={other:?} must be fail or live"));
                FutureCursorPolicy::Fail
            }
        };
        client.bad_frame = match v.get("bad_frame").unwrap_or("fail") {
            "fail" => BadFramePolicy::Fail,
            "skip" => BadFramePolicy::Skip,
            other => {
                v.errors.push(format!("FIREKEEPER_BAD_FRAME={other:?} must be fail or skip"));
                BadFramePolicy::Fail
            }
        };
        client.max_frame_bytes = v.count("max_frame_bytes", 5 << 20, 1 << 30);
        if client.max_frame_bytes < 1024 {
            v.errors.push("FIREKEEPER_MAX_FRAME_BYTES must be at least 1024".into());
        }
        let verify_blocks = match v.get("verify_blocks").unwrap_or("false") {
            "true" | "1" | "yes" => true,
            "false" | "0" | "no" => false,
            other => {
                v.errors.push(format!("FIREKEEPER_VERIFY_BLOCKS={other:?} must be true or false"));
                false
            }
        };
        let log_json = match v.get("log_format").unwrap_or("json") {
            "json" => true,
            "text" => false,
            other => {
                v.errors.push(format!("FIREKEEPER_LOG_FORMAT={other:?} must be json or text"));
                true
            }
        };
        let commit_interval = v.ms("commit_interval_ms", Duration::from_secs(1));
        let drain_budget = v.ms("drain_budget_ms", Duration::from_secs(10));
        let lanes = v.count("lanes", 4, 256);
        let queue_depth = v.count("queue_depth", 1024, 1 << 20);
        if drain_budget >= lease.ttl * 10 {
            v.errors.push(
                "FIREKEEPER_DRAIN_BUDGET_MS is over ten lease ttls: a stuck drain would hold the lease for too long"
                    .into(),
            );
        }
        let data_dir = PathBuf::from(v.get("data_dir").unwrap_or("firekeeper-data"));
        let legacy_cursor_prefix = v.get("legacy_cursor_prefix").map(str::to_owned);
        let instance_id = v.get("instance_id").map(str::to_owned);
        if let Some(id) = &instance_id
            && (id.contains(':') || id.len() > 128)
        {
            v.errors.push("FIREKEEPER_INSTANCE_ID must not contain ':' and be at most 128 bytes".into());
        }
        if !v.errors.is_empty() {
            return Err(ConfigErrors(v.errors));
        }
        Ok(Self {
            relay: relay.expect("checked"),
            relay_secondary,
            redis_url,
            database_url,
            store,
            sink,
            collections,
            data_dir,
            lease,
            legacy_cursor_prefix,
            commit_interval,
            drain_budget,
            http_addr,
            lanes,
            queue_depth,
            client,
            verify_blocks,
            instance_id,
            log_json,
        })
    }

    /// True when one of the collection filters matches (or there are none).
    #[must_use]
    pub fn wants(&self, collection: &str) -> bool {
        self.collections.is_empty()
            || self.collections.iter().any(|f| match f.strip_suffix(".*") {
                Some(prefix) => collection.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.')),
                None => f == collection,
            })
    }

    /// A one-line summary with no secrets, for the startup log and `check-config`.
    #[must_use]
    pub fn summary(&self) -> String {
        format!(
            "relay primary={} secondary={} lease={} cursor_store={:?} sink={} collections={:?} lanes={} http={}",
            self.relay.fingerprint(),
            self.relay_secondary.as_ref().map_or("none", RelayUrl::fingerprint),
            if self.redis_url.is_some() { "redis" } else { "local" },
            self.store,
            match &self.sink {
                SinkKind::Jsonl(p) => format!("jsonl:{p}"),
                SinkKind::Postgres => "postgres".into(),
                SinkKind::Webhook { batch, .. } => format!("webhook(batch {batch})"),
                SinkKind::Null => "null".into(),
            },
            self.collections,
            self.lanes,
            self.http_addr.map_or_else(|| "off".into(), |a| a.to_string()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        Config::from_source(Some(pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()))
    }

    #[test]
    fn embedded_defaults() {
        let c = cfg(&[]).expect("defaults are valid");
        assert_eq!(c.store, StoreKind::File);
        assert_eq!(c.sink, SinkKind::Jsonl("-".into()));
        assert!(c.redis_url.is_none());
        assert_eq!(c.lease.ttl, Duration::from_secs(10));
        let c = cfg(&[("REDIS_URL", "redis://127.0.0.1:6379")]).expect("redis");
        assert_eq!(c.store, StoreKind::Redis);
    }

    #[test]
    fn every_bad_variable_is_named_in_one_error() {
        let e = cfg(&[
            ("FIREKEEPER_RELAY", "https://user:hunter2@relay.example"),
            ("FIREKEEPER_LEASE_TTL_MS", "soon"),
            ("FIREKEEPER_SINK", "kafka"),
            ("FIREKEEPER_LANES", "0"),
            ("FIREKEEPER_HTTP_ADDR", "nowhere"),
            ("FIREKEEPER_RELAY_SECUNDARY", "wss://x"),
        ])
        .expect_err("invalid");
        let text = e.to_string();
        for name in [
            "FIREKEEPER_RELAY:",
            "FIREKEEPER_LEASE_TTL_MS",
            "FIREKEEPER_SINK",
            "FIREKEEPER_LANES",
            "FIREKEEPER_HTTP_ADDR",
            "FIREKEEPER_RELAY_SECUNDARY",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        assert!(!text.contains("hunter2"), "secrets never echoed:\n{text}");
        assert_eq!(e.0.len(), 6, "{text}");
    }

    #[test]
    fn cross_checks() {
        let e = cfg(&[("FIREKEEPER_SINK", "postgres")]).expect_err("needs db");
        assert!(e.to_string().contains("DATABASE_URL"));
        let e = cfg(&[("FIREKEEPER_LEASE_MARGIN_MS", "20000")]).expect_err("margin");
        assert!(e.to_string().contains("margin"));
        let e = cfg(&[("FIREKEEPER_RELAY", "wss://a.example"), ("FIREKEEPER_RELAY_SECONDARY", "wss://A.example:443/")])
            .expect_err("same");
        assert!(e.to_string().contains("same relay"));
    }

    #[test]
    fn collection_filters() {
        let c = cfg(&[("FIREKEEPER_COLLECTIONS", "app.bsky.feed.*, app.bsky.graph.follow")]).expect("ok");
        assert!(c.wants("app.bsky.feed.post"));
        assert!(c.wants("app.bsky.graph.follow"));
        assert!(!c.wants("app.bsky.graph.block"));
        assert!(!c.wants("app.bsky.feedx.post"));
        assert!(cfg(&[("FIREKEEPER_COLLECTIONS", "bad name")]).is_err());
    }
}
