//! Configuration from the environment: `FIREKEEPER_*` plus the conventional `REDIS_URL`,
//! `DATABASE_URL`, `RUST_LOG` and `OTEL_*`, as listed in [`crate::settings::SETTINGS`].
//! Every bad variable is reported by name in one error, and unknown `FIREKEEPER_*`
//! variables are refused (a typo must not fall back to a default silently).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use consumer::verify::ResolverConfig;
use consumer::{ChainBreaks, CollectionFilter, GapPolicy, InvalidPolicy, Options, VerifyMode, VerifyOptions};
use lease::LeaseConfig;
use nats_op::NatsConfig;
use relay_client::client::{BadFramePolicy, FutureCursorPolicy};
use relay_client::{ClientConfig, RelayUrl};
use sinks::JetStreamConfig;

use crate::settings::{Kind, SETTINGS, setting};

/// Where the leader lease lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseKind {
    /// Redis (default with `REDIS_URL`).
    Redis,
    /// A NATS JetStream KV bucket (default with `NATS_URL` and no `REDIS_URL`).
    Nats,
    /// A lock file in the data directory (one machine).
    Local,
}

/// Where cursors are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// Redis, fenced by the Redis lease (default with `REDIS_URL`).
    Redis,
    /// NATS KV, fenced by token with compare-and-set (default with the NATS lease).
    Nats,
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
    /// A JetStream stream.
    Nats(JetStreamConfig),
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
    /// `NATS_URL` and its credentials.
    pub nats: Option<NatsConfig>,
    /// The lease backend.
    pub lease_backend: LeaseKind,
    /// `DATABASE_URL`.
    pub database_url: Option<String>,
    /// Cursor store.
    pub store: StoreKind,
    /// Sink.
    pub sink: SinkKind,
    /// Lock file and file cursors live here.
    pub data_dir: PathBuf,
    /// Lease timing and key prefix.
    pub lease: LeaseConfig,
    /// Prefix of legacy host-keyed cursors to migrate.
    pub legacy_cursor_prefix: Option<String>,
    /// HTTP listen address; `None` = off.
    pub http_addr: Option<SocketAddr>,
    /// Relay connection settings.
    pub client: ClientConfig,
    /// The work loop's tuning (lanes, queue depth, commit interval, drain budget, filter).
    pub options: Options,
    /// Instance id; random when unset.
    pub instance_id: Option<String>,
    /// `json` (default) or `text` logs.
    pub log_json: bool,
}

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

/// The variables read, and the problems found so far.
struct Vars {
    map: HashMap<String, String>,
    errors: Vec<String>,
}

impl Vars {
    /// The value set for `name`, else its default; `None` when neither.
    fn get(&self, name: &str) -> Option<&str> {
        let set = self.map.get(name).map(|v| v.trim()).filter(|v| !v.is_empty());
        set.or_else(|| Some(setting(name).default).filter(|d| !d.is_empty()))
    }

    /// True when the variable itself is set.
    fn is_set(&self, name: &str) -> bool {
        self.map.get(name).is_some_and(|v| !v.trim().is_empty())
    }

    fn ms(&mut self, name: &str) -> Duration {
        let default = Duration::from_millis(setting(name).default.parse().unwrap_or(1));
        match self.get(name).map(str::to_owned) {
            Some(v) => match v.parse::<u64>() {
                Ok(n) if n > 0 => Duration::from_millis(n),
                _ => {
                    self.errors.push(format!("{name}={v:?} is not a positive number of milliseconds"));
                    default
                }
            },
            None => default,
        }
    }

    fn count(&mut self, name: &str) -> usize {
        let s = setting(name);
        let Kind::Count(max) = s.kind else { unreachable!("{name} is a count") };
        let default = s.default.parse().unwrap_or(1);
        match self.get(name).map(str::to_owned) {
            Some(v) => match v.parse::<usize>() {
                Ok(n) if n > 0 && n <= max => n,
                _ => {
                    self.errors.push(format!("{name}={v:?} must be a whole number in 1..={max}"));
                    default
                }
            },
            None => default,
        }
    }

    /// One of the setting's choices (its default when unset or wrong).
    fn choice(&mut self, name: &str) -> &'static str {
        let s = setting(name);
        let Kind::Choice(choices) = s.kind else { unreachable!("{name} is a choice") };
        match self.get(name).map(str::to_owned) {
            Some(v) => choices.iter().find(|c| **c == v).copied().unwrap_or_else(|| {
                self.errors.push(format!("{name}={v:?} must be {}", or_list(choices)));
                s.default
            }),
            None => s.default,
        }
    }

    fn text(&self, name: &str) -> Option<String> {
        self.get(name).map(str::to_owned)
    }

    fn relay(&mut self, name: &str) -> Option<RelayUrl> {
        let v = self.get(name)?.to_owned();
        match RelayUrl::parse(&v) {
            Ok(u) => Some(u),
            Err(e) => {
                // The value is not echoed: it may carry credentials.
                self.errors.push(format!("{name}: {e}"));
                None
            }
        }
    }
}

/// The parts of [`Config`], each read and checked on its own.
impl Vars {
    /// Every `FIREKEEPER_*` variable that is not a setting is an error: a typo must not
    /// fall back to a default.
    fn refuse_unknown(&mut self) {
        let mut unknown: Vec<String> = self
            .map
            .keys()
            .filter(|k| k.starts_with("FIREKEEPER_") && !SETTINGS.iter().any(|s| s.name == k.as_str()))
            .map(|u| format!("{u} is not a firekeeper setting (see the README's table)"))
            .collect();
        unknown.sort();
        self.errors.extend(unknown);
    }

    fn lease_backend(&mut self, redis: bool, nats: bool) -> LeaseKind {
        let kind = if self.is_set("FIREKEEPER_LEASE_BACKEND") {
            match self.choice("FIREKEEPER_LEASE_BACKEND") {
                "redis" => LeaseKind::Redis,
                "nats" => LeaseKind::Nats,
                _ => LeaseKind::Local,
            }
        } else if redis {
            LeaseKind::Redis
        } else if nats {
            LeaseKind::Nats
        } else {
            LeaseKind::Local
        };
        if kind == LeaseKind::Redis && !redis {
            self.errors.push("FIREKEEPER_LEASE_BACKEND=redis needs REDIS_URL".into());
        }
        if kind == LeaseKind::Nats && !nats {
            self.errors.push("FIREKEEPER_LEASE_BACKEND=nats needs NATS_URL".into());
        }
        kind
    }

    fn store(&mut self, lease: LeaseKind, redis: bool, nats: bool) -> StoreKind {
        let store = if self.is_set("FIREKEEPER_CURSOR_STORE") {
            match self.choice("FIREKEEPER_CURSOR_STORE") {
                "redis" => StoreKind::Redis,
                "nats" => StoreKind::Nats,
                "postgres" => StoreKind::Postgres,
                _ => StoreKind::File,
            }
        } else {
            match lease {
                LeaseKind::Redis => StoreKind::Redis,
                LeaseKind::Nats => StoreKind::Nats,
                LeaseKind::Local => StoreKind::File,
            }
        };
        if store == StoreKind::Redis && !redis {
            self.errors.push("FIREKEEPER_CURSOR_STORE=redis needs REDIS_URL".into());
        }
        if store == StoreKind::Redis && redis && lease != LeaseKind::Redis {
            self.errors.push(
                "FIREKEEPER_CURSOR_STORE=redis is fenced by the Redis lease: set FIREKEEPER_LEASE_BACKEND=redis".into(),
            );
        }
        if store == StoreKind::Nats && !nats {
            self.errors.push("FIREKEEPER_CURSOR_STORE=nats needs NATS_URL".into());
        }
        if store == StoreKind::File && lease != LeaseKind::Local {
            self.errors.push(
                "FIREKEEPER_CURSOR_STORE=file is fenced by the local lease file only; use redis, nats or postgres with a shared lease"
                    .into(),
            );
        }
        store
    }

    fn sink(&mut self) -> SinkKind {
        match self.choice("FIREKEEPER_SINK") {
            "postgres" => SinkKind::Postgres,
            "null" => SinkKind::Null,
            "webhook" => {
                let url = self.text("FIREKEEPER_WEBHOOK_URL");
                let batch = self.count("FIREKEEPER_WEBHOOK_BATCH");
                let timeout = self.ms("FIREKEEPER_WEBHOOK_TIMEOUT_MS");
                match url {
                    Some(u) if u.starts_with("http://") || u.starts_with("https://") => {
                        SinkKind::Webhook { url: u, batch, timeout }
                    }
                    Some(_) => {
                        self.errors.push("FIREKEEPER_WEBHOOK_URL must be an http:// or https:// URL".into());
                        SinkKind::Null
                    }
                    None => {
                        self.errors.push("FIREKEEPER_SINK=webhook needs FIREKEEPER_WEBHOOK_URL".into());
                        SinkKind::Null
                    }
                }
            }
            "nats" => SinkKind::Nats(JetStreamConfig {
                stream: self.text("FIREKEEPER_NATS_STREAM").unwrap_or_default(),
                subject_prefix: self.text("FIREKEEPER_NATS_SUBJECT_PREFIX").unwrap_or_default(),
                partitions: if self.is_set("FIREKEEPER_NATS_PARTITIONS") {
                    u32::try_from(self.count("FIREKEEPER_NATS_PARTITIONS")).unwrap_or(1)
                } else {
                    0
                },
                max_age: self.ms("FIREKEEPER_NATS_MAX_AGE_MS"),
                duplicate_window: self.ms("FIREKEEPER_NATS_DUPLICATE_WINDOW_MS"),
                ..JetStreamConfig::default()
            }),
            _ => SinkKind::Jsonl(self.text("FIREKEEPER_JSONL_PATH").unwrap_or_else(|| "-".into())),
        }
    }

    /// `NATS_URL` with its credentials; `None` when unset.
    fn nats(&mut self, op_timeout: Duration) -> Option<NatsConfig> {
        let url = self.text("NATS_URL")?;
        match url::Url::parse(&nats_op::with_scheme(&url)) {
            Ok(u) if matches!(u.scheme(), "nats" | "tls") && u.host_str().is_some() => {}
            // Not echoed: it may carry credentials.
            _ => self.errors.push("NATS_URL is not a nats:// or tls:// URL with a host".into()),
        }
        let creds_file = self.text("NATS_CREDS").map(PathBuf::from);
        if let Some(p) = &creds_file
            && !p.is_file()
        {
            self.errors.push(format!("NATS_CREDS {} is not a readable file", p.display()));
        }
        Some(NatsConfig { url, creds_file, token: self.text("NATS_TOKEN"), op_timeout })
    }

    fn check_stream_names(&mut self, sink: &SinkKind) {
        let SinkKind::Nats(js) = sink else { return };
        if js.stream.is_empty() || !js.stream.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            self.errors.push("FIREKEEPER_NATS_STREAM must be letters, digits, `_` or `-`".into());
        }
        let p = &js.subject_prefix;
        if p.is_empty()
            || p.split('.').any(str::is_empty)
            || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        {
            self.errors.push(
                "FIREKEEPER_NATS_SUBJECT_PREFIX must be subject tokens (letters, digits, `_`, `-`) joined by `.`"
                    .into(),
            );
        }
        if js.duplicate_window > js.max_age {
            self.errors.push("FIREKEEPER_NATS_DUPLICATE_WINDOW_MS must not exceed FIREKEEPER_NATS_MAX_AGE_MS".into());
        }
    }

    /// Sink, cursor store and lease must fit together.
    fn check_pairing(&mut self, store: StoreKind, sink: &SinkKind, lease: LeaseKind, database: bool, nats: bool) {
        if matches!(sink, SinkKind::Nats(_)) && !nats {
            self.errors.push("FIREKEEPER_SINK=nats needs NATS_URL".into());
        }
        if (*sink == SinkKind::Postgres || store == StoreKind::Postgres) && !database {
            self.errors.push("the postgres sink and cursor store need DATABASE_URL".into());
        }
        if *sink == SinkKind::Postgres && store != StoreKind::Postgres {
            self.errors.push(
                "FIREKEEPER_SINK=postgres keeps the cursor in the same transaction: set FIREKEEPER_CURSOR_STORE=postgres"
                    .into(),
            );
        }
        if store == StoreKind::Postgres && *sink != SinkKind::Postgres && lease == LeaseKind::Local {
            self.errors.push(
                "FIREKEEPER_CURSOR_STORE=postgres needs a shared lease (REDIS_URL or NATS_URL), or the postgres sink"
                    .into(),
            );
        }
    }

    fn lease(&mut self) -> LeaseConfig {
        let lease = LeaseConfig {
            ttl: self.ms("FIREKEEPER_LEASE_TTL_MS"),
            renew_every: self.ms("FIREKEEPER_LEASE_RENEW_MS"),
            op_timeout: self.ms("FIREKEEPER_LEASE_OP_TIMEOUT_MS"),
            margin: self.ms("FIREKEEPER_LEASE_MARGIN_MS"),
            poll: self.ms("FIREKEEPER_LEASE_POLL_MS"),
            key_prefix: self.text("FIREKEEPER_KEY_PREFIX").unwrap_or_default(),
        };
        if let Err(e) = lease.validate() {
            for p in e.problems {
                self.errors.push(format!("FIREKEEPER_LEASE_*: {p}"));
            }
        }
        lease
    }

    fn http_addr(&mut self) -> Option<SocketAddr> {
        match self.text("FIREKEEPER_HTTP_ADDR").as_deref() {
            None | Some("off") => None,
            Some(a) => {
                let parsed = a.parse().ok();
                if parsed.is_none() {
                    self.errors.push(format!("FIREKEEPER_HTTP_ADDR={a:?} is not host:port (or off)"));
                }
                parsed
            }
        }
    }

    fn client(&mut self) -> ClientConfig {
        let client = ClientConfig {
            connect_timeout: self.ms("FIREKEEPER_CONNECT_TIMEOUT_MS"),
            stall_timeout: self.ms("FIREKEEPER_STALL_TIMEOUT_MS"),
            failover_after: u32::try_from(self.count("FIREKEEPER_FAILOVER_AFTER")).unwrap_or(3),
            probe_interval: self.ms("FIREKEEPER_PROBE_INTERVAL_MS"),
            future_cursor: match self.choice("FIREKEEPER_FUTURE_CURSOR") {
                "live" => FutureCursorPolicy::GoLive,
                _ => FutureCursorPolicy::Fail,
            },
            bad_frame: match self.choice("FIREKEEPER_BAD_FRAME") {
                "skip" => BadFramePolicy::Skip,
                _ => BadFramePolicy::Fail,
            },
            max_frame_bytes: self.count("FIREKEEPER_MAX_FRAME_BYTES"),
            ..ClientConfig::default()
        };
        if client.max_frame_bytes < 1024 {
            self.errors.push("FIREKEEPER_MAX_FRAME_BYTES must be at least 1024".into());
        }
        client
    }

    fn verify(&mut self) -> VerifyOptions {
        let plc_url = self.text("FIREKEEPER_PLC_URL").unwrap_or_default();
        if !url::Url::parse(&plc_url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some()) {
            // The value is not echoed: it may carry credentials.
            self.errors.push("FIREKEEPER_PLC_URL is not an http:// or https:// URL".into());
        }
        let d = VerifyOptions::default();
        VerifyOptions {
            mode: match self.choice("FIREKEEPER_VERIFY") {
                "signatures" => VerifyMode::Signatures,
                "full" => VerifyMode::Full,
                _ => VerifyMode::Off,
            },
            strict: matches!(self.choice("FIREKEEPER_VERIFY_STRICT"), "true" | "1" | "yes"),
            invalid: match self.choice("FIREKEEPER_INVALID") {
                "fail" => InvalidPolicy::Fail,
                _ => InvalidPolicy::Mark,
            },
            resolver: ResolverConfig {
                plc_url,
                cache_size: self.count("FIREKEEPER_DID_CACHE_SIZE"),
                ttl: self.ms("FIREKEEPER_DID_CACHE_TTL_MS"),
                concurrency: self.count("FIREKEEPER_RESOLVE_CONCURRENCY"),
                ..d.resolver
            },
            resolve_timeout: self.ms("FIREKEEPER_RESOLVE_TIMEOUT_MS"),
            repos: self.count("FIREKEEPER_CHAIN_REPOS"),
            ..d
        }
    }

    fn options(&mut self, ttl: Duration) -> Options {
        let entries: Vec<String> = self
            .text("FIREKEEPER_COLLECTIONS")
            .map(|c| c.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        let collections = CollectionFilter::new(entries).unwrap_or_else(|bad| {
            self.errors.push(format!("FIREKEEPER_COLLECTIONS entry {bad:?} is not an NSID or `prefix.*`"));
            None
        });
        let options = Options {
            lanes: self.count("FIREKEEPER_LANES"),
            queue_depth: self.count("FIREKEEPER_QUEUE_DEPTH"),
            commit_interval: self.ms("FIREKEEPER_COMMIT_INTERVAL_MS"),
            drain_budget: self.ms("FIREKEEPER_DRAIN_BUDGET_MS"),
            collections,
            verify_blocks: matches!(self.choice("FIREKEEPER_VERIFY_BLOCKS"), "true" | "1" | "yes"),
            switch_overlap: self.ms("FIREKEEPER_SWITCH_OVERLAP_MS"),
            switch_max_probes: u32::try_from(self.count("FIREKEEPER_SWITCH_MAX_PROBES")).unwrap_or(40),
            switch_skew: self.ms("FIREKEEPER_SWITCH_SKEW_MS"),
            gap: match self.choice("FIREKEEPER_GAP") {
                "live" => GapPolicy::Live,
                _ => GapPolicy::Fail,
            },
            chain_repos: self.count("FIREKEEPER_CHAIN_REPOS"),
            chain_breaks: ChainBreaks::Count,
            verify: self.verify(),
        };
        let options = match self.choice("FIREKEEPER_CHAIN_BREAKS") {
            "emit" => Options { chain_breaks: ChainBreaks::Emit, ..options },
            "off" => Options { chain_repos: 0, ..options },
            _ => options,
        };
        if options.drain_budget >= ttl * 10 {
            self.errors.push(
                "FIREKEEPER_DRAIN_BUDGET_MS is over ten lease ttls: a stuck drain would hold the lease for too long"
                    .into(),
            );
        }
        options
    }
}

fn or_list(choices: &[&str]) -> String {
    match choices {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::from_source(std::env::vars().collect())
    }

    /// Reads from an explicit map of variables (tests).
    pub fn from_source(vars: HashMap<String, String>) -> Result<Self, ConfigErrors> {
        let mut v = Vars { map: vars, errors: Vec::new() };
        v.refuse_unknown();
        let redis_url = v.text("REDIS_URL");
        let database_url = v.text("DATABASE_URL");
        if let Some(u) = &redis_url
            && redis::Client::open(u.as_str()).is_err()
        {
            v.errors.push("REDIS_URL is not a valid redis:// or rediss:// URL".into());
        }
        let relay = v.relay("FIREKEEPER_RELAY");
        let relay_secondary = v.relay("FIREKEEPER_RELAY_SECONDARY");
        if let (Some(p), Some(s)) = (&relay, &relay_secondary)
            && p.fingerprint() == s.fingerprint()
        {
            v.errors.push("FIREKEEPER_RELAY_SECONDARY is the same relay as FIREKEEPER_RELAY".into());
        }
        let lease = v.lease();
        let nats = v.nats(lease.op_timeout);
        let lease_backend = v.lease_backend(redis_url.is_some(), nats.is_some());
        let store = v.store(lease_backend, redis_url.is_some(), nats.is_some());
        let sink = v.sink();
        v.check_stream_names(&sink);
        v.check_pairing(store, &sink, lease_backend, database_url.is_some(), nats.is_some());
        if (lease_backend == LeaseKind::Nats || store == StoreKind::Nats)
            && let Some(problem) = nats_op::prefix_problem(&lease.key_prefix)
        {
            v.errors.push(format!("FIREKEEPER_KEY_PREFIX: {problem}"));
        }
        let http_addr = v.http_addr();
        let client = v.client();
        let options = v.options(lease.ttl);
        let log_json = v.choice("FIREKEEPER_LOG_FORMAT") == "json";
        let data_dir = PathBuf::from(v.text("FIREKEEPER_DATA_DIR").unwrap_or_default());
        let legacy_cursor_prefix = v.text("FIREKEEPER_LEGACY_CURSOR_PREFIX");
        let instance_id = v.text("FIREKEEPER_INSTANCE_ID");
        if let Some(id) = &instance_id
            && (id.contains(':') || id.len() > 128)
        {
            v.errors.push("FIREKEEPER_INSTANCE_ID must not contain ':' and be at most 128 bytes".into());
        }
        let Some(relay) = relay.filter(|_| v.errors.is_empty()) else {
            return Err(ConfigErrors(v.errors));
        };
        Ok(Self {
            relay,
            relay_secondary,
            redis_url,
            nats,
            lease_backend,
            database_url,
            store,
            sink,
            data_dir,
            lease,
            legacy_cursor_prefix,
            http_addr,
            client,
            options,
            instance_id,
            log_json,
        })
    }

    /// A one-line summary with no secrets, for the startup log and `check-config`.
    #[must_use]
    pub fn summary(&self) -> String {
        format!(
            "relay primary={} secondary={} lease={} cursor_store={:?} sink={} collections={:?} lanes={} http={}",
            self.relay.fingerprint(),
            self.relay_secondary.as_ref().map_or("none", RelayUrl::fingerprint),
            match self.lease_backend {
                LeaseKind::Redis => "redis".to_owned(),
                LeaseKind::Nats =>
                    format!("nats({})", self.nats.as_ref().map_or("?".into(), |n| nats_op::redact(&n.url))),
                LeaseKind::Local => "local".to_owned(),
            },
            self.store,
            match &self.sink {
                SinkKind::Jsonl(p) => format!("jsonl:{p}"),
                SinkKind::Postgres => "postgres".into(),
                SinkKind::Webhook { batch, .. } => format!("webhook(batch {batch})"),
                SinkKind::Nats(js) => format!("nats(stream {}, partitions {})", js.stream, js.partitions),
                SinkKind::Null => "null".into(),
            },
            self.options.collections.as_ref().map_or(&[][..], CollectionFilter::entries),
            self.options.lanes,
            self.http_addr.map_or_else(|| "off".into(), |a| a.to_string()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        Config::from_source(pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect())
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

    /// The table's defaults are the libraries' defaults: a drift in either is caught here.
    #[test]
    fn table_defaults_match_the_library_defaults() {
        let c = cfg(&[]).expect("defaults are valid");
        let l = LeaseConfig::default();
        assert_eq!(
            (c.lease.ttl, c.lease.renew_every, c.lease.op_timeout, c.lease.margin, c.lease.poll, &c.lease.key_prefix),
            (l.ttl, l.renew_every, l.op_timeout, l.margin, l.poll, &l.key_prefix)
        );
        let o = Options::default();
        assert_eq!(
            (c.options.lanes, c.options.queue_depth, c.options.commit_interval, c.options.drain_budget),
            (o.lanes, o.queue_depth, o.commit_interval, o.drain_budget)
        );
        assert_eq!(
            (c.options.switch_overlap, c.options.switch_max_probes, c.options.gap, c.options.switch_skew),
            (o.switch_overlap, o.switch_max_probes, o.gap, o.switch_skew)
        );
        let live = cfg(&[("FIREKEEPER_GAP", "live"), ("FIREKEEPER_SWITCH_OVERLAP_MS", "5000")]).expect("valid");
        assert_eq!((live.options.gap, live.options.switch_overlap), (GapPolicy::Live, Duration::from_secs(5)));
        assert!(cfg(&[("FIREKEEPER_GAP", "skip")]).is_err(), "only fail or live");
        assert_eq!((c.options.chain_repos, c.options.chain_breaks), (o.chain_repos, o.chain_breaks));
        let emit = cfg(&[("FIREKEEPER_CHAIN_BREAKS", "emit"), ("FIREKEEPER_CHAIN_REPOS", "10")]).expect("valid");
        assert_eq!((emit.options.chain_repos, emit.options.chain_breaks), (10, ChainBreaks::Emit));
        assert_eq!(cfg(&[("FIREKEEPER_CHAIN_BREAKS", "off")]).expect("valid").options.chain_repos, 0);
        assert!(cfg(&[("FIREKEEPER_CHAIN_REPOS", "0")]).is_err(), "off is said with FIREKEEPER_CHAIN_BREAKS");
        let k = ClientConfig::default();
        assert_eq!(
            (c.client.failover_after, c.client.max_frame_bytes, c.client.future_cursor, c.client.bad_frame),
            (k.failover_after, k.max_frame_bytes, k.future_cursor, k.bad_frame)
        );
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
    fn nats_lease_store_and_sink_pair_up_and_never_show_credentials() {
        let c = cfg(&[("NATS_URL", "nats://user:hunter2@127.0.0.1:4222")]).expect("nats");
        assert_eq!((c.lease_backend, c.store), (LeaseKind::Nats, StoreKind::Nats), "NATS_URL alone: lease and cursors");
        assert!(c.summary().contains("nats(127.0.0.1:4222)") && !c.summary().contains("hunter2"), "{}", c.summary());
        let c = cfg(&[("NATS_URL", "nats://127.0.0.1:4222"), ("REDIS_URL", "redis://127.0.0.1:6379")]).expect("both");
        assert_eq!((c.lease_backend, c.store), (LeaseKind::Redis, StoreKind::Redis), "Redis first, as before");
        let c = cfg(&[
            ("NATS_URL", "127.0.0.1:4222"),
            ("FIREKEEPER_SINK", "nats"),
            ("FIREKEEPER_NATS_PARTITIONS", "8"),
            ("NATS_TOKEN", "s3cret"),
        ])
        .expect("sink");
        let SinkKind::Nats(js) = &c.sink else { panic!("{:?}", c.sink) };
        assert_eq!((js.partitions, js.stream.as_str(), js.subject_prefix.as_str()), (8, "FIREKEEPER", "firekeeper"));
        assert!(!format!("{c:?}").contains("s3cret"), "the token is never shown");
        let SinkKind::Nats(js) = cfg(&[("NATS_URL", "nats://h:1"), ("FIREKEEPER_SINK", "nats")]).expect("ok").sink
        else {
            panic!("not nats")
        };
        assert_eq!(js.partitions, 0, "subjects by collection unless partitions are asked for");
        for (pairs, says) in [
            (&[("FIREKEEPER_SINK", "nats")][..], "FIREKEEPER_SINK=nats needs NATS_URL"),
            (&[("FIREKEEPER_LEASE_BACKEND", "nats")][..], "FIREKEEPER_LEASE_BACKEND=nats needs NATS_URL"),
            (&[("FIREKEEPER_CURSOR_STORE", "nats")][..], "FIREKEEPER_CURSOR_STORE=nats needs NATS_URL"),
            (&[("NATS_URL", "http://h:1")][..], "NATS_URL is not a nats://"),
            (&[("NATS_URL", "nats://h:1"), ("FIREKEEPER_CURSOR_STORE", "file")][..], "FIREKEEPER_CURSOR_STORE=file"),
            (
                &[
                    ("NATS_URL", "nats://h:1"),
                    ("REDIS_URL", "redis://h:2"),
                    ("FIREKEEPER_LEASE_BACKEND", "nats"),
                    ("FIREKEEPER_CURSOR_STORE", "redis"),
                ][..],
                "fenced by the Redis lease",
            ),
            (&[("NATS_URL", "nats://h:1"), ("NATS_CREDS", "/nonexistent.creds")][..], "NATS_CREDS"),
            (&[("NATS_URL", "nats://h:1"), ("FIREKEEPER_KEY_PREFIX", "prod.eu")][..], "FIREKEEPER_KEY_PREFIX"),
            (
                &[("NATS_URL", "nats://h:1"), ("FIREKEEPER_SINK", "nats"), ("FIREKEEPER_NATS_STREAM", "a.b")][..],
                "FIREKEEPER_NATS_STREAM",
            ),
            (
                &[("NATS_URL", "nats://h:1"), ("FIREKEEPER_SINK", "nats"), ("FIREKEEPER_NATS_SUBJECT_PREFIX", "a..b")]
                    [..],
                "FIREKEEPER_NATS_SUBJECT_PREFIX",
            ),
            (
                &[("NATS_URL", "nats://h:1"), ("FIREKEEPER_SINK", "nats"), ("FIREKEEPER_NATS_MAX_AGE_MS", "1000")][..],
                "FIREKEEPER_NATS_DUPLICATE_WINDOW_MS",
            ),
        ] {
            let e = cfg(pairs).expect_err(says).to_string();
            assert!(e.contains(says), "{pairs:?}: {e}");
            assert!(!e.contains("hunter2"));
        }
        let c = cfg(&[
            ("NATS_URL", "nats://h:1"),
            ("FIREKEEPER_CURSOR_STORE", "postgres"),
            ("DATABASE_URL", "postgres://x@h/db"),
        ]);
        assert!(c.is_ok(), "postgres cursors with the NATS lease: {:?}", c.err());
    }

    #[test]
    fn collection_filters() {
        let c = cfg(&[("FIREKEEPER_COLLECTIONS", "app.bsky.feed.*, app.bsky.graph.follow")]).expect("ok");
        let f = c.options.collections.expect("a filter");
        assert!(f.wants("app.bsky.feed.post"));
        assert!(f.wants("app.bsky.graph.follow"));
        assert!(!f.wants("app.bsky.graph.block"));
        assert!(!f.wants("app.bsky.feedx.post"));
        assert!(cfg(&[("FIREKEEPER_COLLECTIONS", "bad name")]).is_err());
    }
}
