//! The configuration: [`crate::settings`] reads each variable into its typed place, and
//! `TryFrom<Raw>` here checks the settings against each other (sink, cursor store and
//! lease must fit; URLs and names must be usable). Every problem is reported by name in
//! one error, and no value that may carry a credential is ever echoed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use consumer::{ChainBreaks, CollectionFilter, Options};
use lease::LeaseConfig;
use nats_op::NatsConfig;
use relay_client::{ClientConfig, RelayUrl};
use sinks::JetStreamConfig;

use crate::settings::{ChainMode, InputKind, LogFormat, Raw, SinkName};
pub use crate::settings::{LeaseKind, StoreKind};

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
    /// The CA file `rediss://` is verified against (`None`: the system's roots).
    pub redis_ca_file: Option<PathBuf>,
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
    /// What `POST /repos/resync` demands; `None`: state-changing endpoints are off.
    pub admin_token: Option<crate::http::AdminToken>,
    /// Relay connection settings.
    pub client: ClientConfig,
    /// The work loop's tuning (lanes, queue depth, commit interval, drain budget, filter).
    pub options: Options,
    /// Instance id; random when unset.
    pub instance_id: Option<String>,
    /// `json` (default) or `text` logs.
    pub log_json: bool,
    /// Take over even when the deployment's settings record differs.
    pub allow_settings_change: bool,
    /// The Postgres sink keeps `firekeeper_records` (`FIREKEEPER_POSTGRES_RECORDS`).
    pub postgres_records: bool,
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

/// The lease backend: as chosen, else derived from the URLs set (Redis first).
fn lease_backend(r: &Raw, errors: &mut Vec<String>) -> LeaseKind {
    let (redis, nats) = (r.redis_url.is_some(), r.nats_url.is_some());
    let kind = r.lease_backend.unwrap_or(if redis {
        LeaseKind::Redis
    } else if nats {
        LeaseKind::Nats
    } else {
        LeaseKind::Local
    });
    if kind == LeaseKind::Redis && !redis {
        errors.push("FIREKEEPER_LEASE_BACKEND=redis needs REDIS_URL".into());
    }
    if kind == LeaseKind::Nats && !nats {
        errors.push("FIREKEEPER_LEASE_BACKEND=nats needs NATS_URL".into());
    }
    kind
}

/// The cursor store: as chosen, else the lease backend's; fenced by a lease it can see.
fn store(r: &Raw, lease: LeaseKind, errors: &mut Vec<String>) -> StoreKind {
    // The postgres sink keeps the cursor in its own transaction: no other store is allowed
    // with it, so it is the default there.
    let store = r.store.unwrap_or(match lease {
        _ if r.sink == crate::settings::SinkName::Postgres => StoreKind::Postgres,
        LeaseKind::Redis => StoreKind::Redis,
        LeaseKind::Nats => StoreKind::Nats,
        LeaseKind::Local => StoreKind::File,
    });
    let (redis, nats) = (r.redis_url.is_some(), r.nats_url.is_some());
    if store == StoreKind::Redis && !redis {
        errors.push("FIREKEEPER_CURSOR_STORE=redis needs REDIS_URL".into());
    }
    if store == StoreKind::Redis && redis && lease != LeaseKind::Redis {
        errors.push(
            "FIREKEEPER_CURSOR_STORE=redis is fenced by the Redis lease: set FIREKEEPER_LEASE_BACKEND=redis".into(),
        );
    }
    if store == StoreKind::Nats && !nats {
        errors.push("FIREKEEPER_CURSOR_STORE=nats needs NATS_URL".into());
    }
    if store == StoreKind::File && lease != LeaseKind::Local {
        errors.push(
            "FIREKEEPER_CURSOR_STORE=file is fenced by the local lease file only; use redis, nats or postgres with a shared lease"
                .into(),
        );
    }
    store
}

/// The sink `FIREKEEPER_SINK` names, completed by its own settings.
fn sink(r: &Raw, errors: &mut Vec<String>) -> SinkKind {
    match r.sink {
        SinkName::Jsonl => SinkKind::Jsonl(r.jsonl_path.clone()),
        SinkName::Postgres => SinkKind::Postgres,
        SinkName::Null => SinkKind::Null,
        SinkName::Webhook => match &r.webhook_url {
            Some(u) if u.starts_with("http://") || u.starts_with("https://") => {
                SinkKind::Webhook { url: u.clone(), batch: r.webhook_batch, timeout: r.webhook_timeout }
            }
            Some(_) => {
                errors.push("FIREKEEPER_WEBHOOK_URL must be an http:// or https:// URL".into());
                SinkKind::Null
            }
            None => {
                errors.push("FIREKEEPER_SINK=webhook needs FIREKEEPER_WEBHOOK_URL".into());
                SinkKind::Null
            }
        },
        SinkName::Nats => {
            let js = &r.jetstream;
            if js.stream.is_empty() || !js.stream.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
                errors.push("FIREKEEPER_NATS_STREAM must be letters, digits, `_` or `-`".into());
            }
            let p = &js.subject_prefix;
            if p.is_empty()
                || p.split('.').any(str::is_empty)
                || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
            {
                errors.push(
                    "FIREKEEPER_NATS_SUBJECT_PREFIX must be subject tokens (letters, digits, `_`, `-`) joined by `.`"
                        .into(),
                );
            }
            if js.duplicate_window > js.max_age {
                errors.push("FIREKEEPER_NATS_DUPLICATE_WINDOW_MS must not exceed FIREKEEPER_NATS_MAX_AGE_MS".into());
            }
            if r.nats_url.is_none() {
                errors.push("FIREKEEPER_SINK=nats needs NATS_URL".into());
            }
            SinkKind::Nats(js.clone())
        }
    }
}

/// `NATS_URL` with its credentials; `None` when unset.
fn nats(r: &Raw, errors: &mut Vec<String>) -> Option<NatsConfig> {
    let url = r.nats_url.clone()?;
    match url::Url::parse(&nats_op::with_scheme(&url)) {
        Ok(u) if matches!(u.scheme(), "nats" | "tls") && u.host_str().is_some() => {}
        // Not echoed: it may carry credentials.
        _ => errors.push("NATS_URL is not a nats:// or tls:// URL with a host".into()),
    }
    if let Some(p) = &r.nats_creds
        && !p.is_file()
    {
        errors.push(format!("NATS_CREDS {} is not a readable file", p.display()));
    }
    if let Some(p) = &r.nats_ca_file {
        check_ca_file("FIREKEEPER_NATS_CA_FILE", p, errors);
    }
    let (creds_file, ca_file, token) = (r.nats_creds.clone(), r.nats_ca_file.clone(), r.nats_token.clone());
    Some(NatsConfig { url, creds_file, ca_file, token, op_timeout: r.lease.op_timeout })
}

/// A CA file setting names a readable file holding a PEM certificate.
fn check_ca_file(var: &str, p: &std::path::Path, errors: &mut Vec<String>) {
    match std::fs::read(p) {
        Ok(pem) if String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") => {}
        Ok(_) => errors.push(format!("{var} {} holds no PEM certificate", p.display())),
        Err(e) => errors.push(format!("{var} {} cannot be read: {e}", p.display())),
    }
}

/// Checks that hold within one part: URLs, lease timings, names, limits.
fn check_parts(r: &Raw, errors: &mut Vec<String>) {
    if let Some(u) = &r.redis_url
        && redis::Client::open(u.as_str()).is_err()
    {
        errors.push(
            "REDIS_URL is not a valid redis:// or rediss:// URL (redis[s]://[[user]:password@]host:port[/db])".into(),
        );
    }
    if let Some(p) = &r.redis_ca_file {
        check_ca_file("FIREKEEPER_REDIS_CA_FILE", p, errors);
        if !r.redis_url.as_deref().is_some_and(|u| u.trim_start().to_ascii_lowercase().starts_with("rediss://")) {
            errors.push("FIREKEEPER_REDIS_CA_FILE is set but REDIS_URL is not rediss:// (TLS)".into());
        }
    }
    if let (Some(p), Some(s)) = (&r.relay, &r.relay_secondary)
        && p.fingerprint() == s.fingerprint()
    {
        errors.push("FIREKEEPER_RELAY_SECONDARY is the same relay as FIREKEEPER_RELAY".into());
    }
    if let Err(e) = r.lease.validate() {
        errors.extend(e.problems.into_iter().map(|p| format!("FIREKEEPER_LEASE_*: {p}")));
    }
    if r.client.max_frame_bytes < 1024 {
        errors.push("FIREKEEPER_MAX_FRAME_BYTES must be at least 1024".into());
    }
    let plc = &r.options.verify.resolver.plc_url;
    if !url::Url::parse(plc).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some()) {
        // The value is not echoed: it may carry credentials.
        errors.push("FIREKEEPER_PLC_URL is not an http:// or https:// URL".into());
    }
    if r.options.drain_budget >= r.lease.ttl * 10 {
        errors.push(
            "FIREKEEPER_DRAIN_BUDGET_MS is over ten lease ttls: a stuck drain would hold the lease for too long".into(),
        );
    }
    if let Some(id) = &r.instance_id
        && (id.contains(':') || id.len() > 128)
    {
        errors.push("FIREKEEPER_INSTANCE_ID must not contain ':' and be at most 128 bytes".into());
    }
}

/// The host listings ask (`FIREKEEPER_BACKFILL_HOST`, else the primary relay): a listed
/// backfill's, and the reconcile's after an accepted gap.
fn listing_host(r: &Raw, errors: &mut Vec<String>) -> Option<String> {
    let host = match &r.backfill_host {
        Some(h) => h.clone(),
        None => r.relay.as_ref()?.http_origin().to_string(),
    };
    match url::Url::parse(&host) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => Some(host),
        _ => {
            errors.push("FIREKEEPER_BACKFILL_HOST must be an http(s):// URL".into());
            None
        }
    }
}

/// Sink, cursor store and lease must fit together.
/// Repo sync's backfill (`FIREKEEPER_BACKFILL`: the DIDs it lists or the host whose repos it
/// walks) and where it asks `getRepo` (`FIREKEEPER_SYNC_SOURCE`).
fn repo_sync(r: &Raw, options: &mut consumer::Options, errors: &mut Vec<String>) {
    use crate::settings::BackfillMode;
    let listed = !options.resync.backfill.is_empty();
    let host = listing_host(r, errors);
    options.resync.reconcile_host.clone_from(&host);
    match r.backfill.unwrap_or(if listed { BackfillMode::Dids } else { BackfillMode::Off }) {
        BackfillMode::Off => options.resync.backfill.clear(),
        BackfillMode::Dids if !listed => {
            errors.push("FIREKEEPER_BACKFILL=dids needs FIREKEEPER_BACKFILL_DIDS (DIDs, or @<file> of them)".into());
        }
        BackfillMode::Dids => {}
        BackfillMode::Collections => {
            let entries = r.options.collections.as_ref().map_or(&[][..], CollectionFilter::entries);
            if entries.is_empty() {
                errors.push(
                    "FIREKEEPER_BACKFILL=collections needs FIREKEEPER_COLLECTIONS (the NSIDs whose repos to backfill)"
                        .into(),
                );
            } else if let Some(wild) = entries.iter().find(|e| e.ends_with('*')) {
                errors.push(format!(
                    "FIREKEEPER_BACKFILL=collections lists repos by exact collection (listReposByCollection), but FIREKEEPER_COLLECTIONS holds {wild:?}: name each collection, or backfill every repo (`all`)"
                ));
            }
            options.resync.backfill_collections = entries.to_vec();
            options.resync.backfill_list = host;
        }
        BackfillMode::All => options.resync.backfill_list = host,
    }
    options.resync.source = match r.sync_source.as_deref() {
        None | Some("pds") => None,
        Some("relay") => r.relay.as_ref().map(|u| u.http_origin().to_string()),
        Some(host) => match url::Url::parse(host) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => Some(host.to_owned()),
            _ => {
                errors.push("FIREKEEPER_SYNC_SOURCE must be `pds`, `relay` or an http(s):// URL".into());
                None
            }
        },
    };
    if !options.resync.enabled && (!options.resync.backfill.is_empty() || options.resync.backfill_list.is_some()) {
        errors.push("FIREKEEPER_BACKFILL needs repo sync: FIREKEEPER_RESYNC=false turns it off".into());
    }
}

/// True when `store` keeps a shared repo-sync queue every replica can work.
#[must_use]
pub fn has_job_queue(store: StoreKind) -> bool {
    matches!(store, StoreKind::Redis | StoreKind::Nats | StoreKind::Postgres)
}

/// `FIREKEEPER_SYNC_WORKERS=0` (this replica takes no jobs) needs a queue shared with
/// replicas that do: a Redis store and a sink every replica reaches.
fn shared_sync(store: StoreKind, sink: &SinkKind, options: &consumer::Options, errors: &mut Vec<String>) {
    let r = &options.resync;
    let shared = r.share && has_job_queue(store) && !matches!(sink, SinkKind::Jsonl(_));
    if r.claim_idle < std::time::Duration::from_secs(1) {
        errors.push(
            "FIREKEEPER_SYNC_CLAIM_MS must be at least 1000 (workers touch their claims every sixth of it)".into(),
        );
    }
    if r.enabled && r.workers == 0 && !shared {
        errors.push(
            "FIREKEEPER_SYNC_WORKERS=0 means this replica takes no repo-sync jobs, which needs a queue shared with replicas that do: \
             FIREKEEPER_CURSOR_STORE=redis, nats or postgres, a sink every replica reaches (not jsonl) and FIREKEEPER_SYNC_SHARED=true"
                .into(),
        );
    }
}

fn check_pairing(r: &Raw, store: StoreKind, sink: &SinkKind, lease: LeaseKind, errors: &mut Vec<String>) {
    let database = r.database_url.is_some();
    if (*sink == SinkKind::Postgres || store == StoreKind::Postgres) && !database {
        errors.push("the postgres sink and cursor store need DATABASE_URL".into());
    }
    if *sink == SinkKind::Postgres && store != StoreKind::Postgres {
        errors.push(
            "FIREKEEPER_SINK=postgres keeps the cursor in the same transaction: set FIREKEEPER_CURSOR_STORE=postgres"
                .into(),
        );
    }
    if store == StoreKind::Postgres && *sink != SinkKind::Postgres && lease == LeaseKind::Local {
        errors.push(
            "FIREKEEPER_CURSOR_STORE=postgres needs a shared lease (REDIS_URL or NATS_URL), or the postgres sink"
                .into(),
        );
    }
    if (lease == LeaseKind::Nats || store == StoreKind::Nats)
        && let Some(problem) = nats_op::prefix_problem(&r.lease.key_prefix)
    {
        errors.push(format!("FIREKEEPER_KEY_PREFIX: {problem}"));
    }
}

/// The Jetstream instances Bluesky runs (the default with Jetstream input).
const JETSTREAM_DEFAULT: &str = "wss://jetstream2.us-east.bsky.network";

/// With `FIREKEEPER_INPUT=jetstream`: the client reads Jetstream with the server-side
/// filters; verification is refused (nothing in Jetstream is signed), repo sync's
/// backfill too (its snapshots are firehose-shaped).
fn jetstream_input(
    r: &Raw,
    options: &mut consumer::Options,
    client: &mut relay_client::ClientConfig,
    relay: &mut Option<relay_client::RelayUrl>,
    errors: &mut Vec<String>,
) {
    if r.input != InputKind::Jetstream {
        if !r.jet.dids.is_empty() {
            errors.push(
                "FIREKEEPER_JETSTREAM_DIDS needs FIREKEEPER_INPUT=jetstream (the firehose has no DID filter)".into(),
            );
        }
        return;
    }
    if r.verify_set && options.verify.mode != consumer::VerifyMode::Off {
        errors.push(
            "FIREKEEPER_VERIFY must be `off` with FIREKEEPER_INPUT=jetstream: Jetstream carries no signatures, \
             commit blocks or MST proofs (it re-encodes records as JSON), so nothing in it can be verified; read \
             the firehose (FIREKEEPER_INPUT=firehose) to verify"
                .into(),
        );
    }
    options.verify.mode = consumer::VerifyMode::Off;
    if !matches!(r.backfill, None | Some(crate::settings::BackfillMode::Off)) || !options.resync.backfill.is_empty() {
        errors.push("FIREKEEPER_BACKFILL is not available with FIREKEEPER_INPUT=jetstream".into());
    }
    let collections: Vec<String> = options.collections.as_ref().map(|c| c.entries().to_vec()).unwrap_or_default();
    if collections.len() > relay_client::jetstream::MAX_COLLECTIONS {
        errors.push(format!(
            "FIREKEEPER_COLLECTIONS lists {} collections; Jetstream takes at most {}",
            collections.len(),
            relay_client::jetstream::MAX_COLLECTIONS
        ));
    }
    if r.jet.dids.len() > relay_client::jetstream::MAX_DIDS {
        errors.push(format!(
            "FIREKEEPER_JETSTREAM_DIDS lists {} DIDs; Jetstream takes at most {}",
            r.jet.dids.len(),
            relay_client::jetstream::MAX_DIDS
        ));
    }
    // The firehose's default relay is no Jetstream instance: the input's own default.
    if *relay == Raw::default().relay {
        *relay = relay_client::RelayUrl::parse(JETSTREAM_DEFAULT).ok();
    }
    client.input = relay_client::Input::Jetstream(relay_client::jetstream::Options { collections, ..r.jet.clone() });
    client.refuse_gaps = options.gap == consumer::GapPolicy::Fail;
}

impl TryFrom<Raw> for Config {
    type Error = Vec<String>;

    /// Every rule that relates settings to each other, in one place.
    fn try_from(r: Raw) -> Result<Self, Vec<String>> {
        let mut errors = Vec::new();
        check_parts(&r, &mut errors);
        let nats = nats(&r, &mut errors);
        let lease_backend = lease_backend(&r, &mut errors);
        let store = store(&r, lease_backend, &mut errors);
        let sink = sink(&r, &mut errors);
        check_pairing(&r, store, &sink, lease_backend, &mut errors);
        let mut options = r.options.clone();
        repo_sync(&r, &mut options, &mut errors);
        shared_sync(store, &sink, &options, &mut errors);
        // Large repos fetched for resync spill to the data directory.
        options.resync.limits.spill_dir.clone_from(&r.data_dir);
        // The verifier's per-repo chains are as many as the chain check's.
        options.verify.repos = options.chain_repos;
        match r.chain {
            ChainMode::Count => options.chain_breaks = ChainBreaks::Count,
            ChainMode::Emit => options.chain_breaks = ChainBreaks::Emit,
            ChainMode::Off => options.chain_repos = 0,
        }
        let mut client = r.client.clone();
        let mut relay = r.relay.clone();
        jetstream_input(&r, &mut options, &mut client, &mut relay, &mut errors);
        let Some(relay) = relay.filter(|_| errors.is_empty()) else { return Err(errors) };
        Ok(Self {
            relay,
            relay_secondary: r.relay_secondary,
            redis_url: r.redis_url,
            redis_ca_file: r.redis_ca_file,
            nats,
            lease_backend,
            database_url: r.database_url,
            store,
            sink,
            data_dir: r.data_dir,
            lease: r.lease,
            legacy_cursor_prefix: r.legacy_cursor_prefix,
            http_addr: r.http_addr,
            admin_token: r.admin_token.filter(|t| !t.is_empty()).map(crate::http::AdminToken),
            client,
            options,
            instance_id: r.instance_id,
            log_json: r.log == LogFormat::Json,
            allow_settings_change: r.allow_settings_change,
            postgres_records: r.postgres_records,
        })
    }
}

impl Config {
    /// The settings of this binary's that change what downstream receives, for the
    /// record replicas compare ([`consumer::Deployment`]): the input, the sink and its
    /// target (by a short fingerprint, never the URL: it may carry credentials; a jsonl
    /// path is not compared, each replica writes its own file), the key prefix.
    #[must_use]
    pub fn deployment(&self) -> consumer::Deployment {
        let fp = |s: &str| {
            use sha2::Digest as _;
            sha2::Sha256::digest(s.as_bytes()).iter().take(6).fold(String::new(), |mut o, b| {
                use std::fmt::Write as _;
                let _ = write!(o, "{b:02x}");
                o
            })
        };
        let sink = match &self.sink {
            SinkKind::Jsonl(_) => "jsonl".to_owned(),
            SinkKind::Postgres => format!("postgres:{}", fp(&postgres_target(self.database_url.as_deref()))),
            SinkKind::Webhook { url, .. } => format!("webhook:{}", fp(url)),
            SinkKind::Nats(js) => format!("nats:{}:{}", js.stream, js.subject_prefix),
            SinkKind::Null => "null".into(),
        };
        let input = match &self.client.input {
            relay_client::Input::Firehose => "firehose".to_owned(),
            relay_client::Input::Jetstream(js) => {
                format!("jetstream:{}:{}", js.version.as_str(), fp(&js.dids.join(",")))
            }
        };
        consumer::Deployment::default()
            .with("input", input)
            .with("sink", sink)
            .with("key_prefix", self.lease.key_prefix.clone())
    }

    /// The values defaults were derived to (shown by `check-config` instead of the rule).
    #[must_use]
    pub fn derived(&self) -> Vec<(&'static str, String)> {
        let lease = match self.lease_backend {
            LeaseKind::Redis => "redis",
            LeaseKind::Nats => "nats",
            LeaseKind::Local => "local",
        };
        let store = match self.store {
            StoreKind::Redis => "redis",
            StoreKind::Nats => "nats",
            StoreKind::File => "file",
            StoreKind::Postgres => "postgres",
        };
        vec![("FIREKEEPER_LEASE_BACKEND", lease.to_owned()), ("FIREKEEPER_CURSOR_STORE", store.to_owned())]
    }

    /// Valid but probably not meant: a store URL the derived backends leave unused.
    #[must_use]
    pub fn warnings(&self, vars: &std::collections::HashMap<String, String>) -> Vec<String> {
        let set = |k: &str| vars.get(k).is_some_and(|v| !v.trim().is_empty());
        let mut w = Vec::new();
        if set("NATS_URL")
            && !set("FIREKEEPER_LEASE_BACKEND")
            && self.lease_backend == LeaseKind::Redis
            && self.store != StoreKind::Nats
            && !matches!(self.sink, SinkKind::Nats(_))
        {
            w.push(
                "NATS_URL is set but unused: REDIS_URL is set too, so the lease and cursors are on Redis; set \
                 FIREKEEPER_LEASE_BACKEND=nats (or FIREKEEPER_SINK=nats) if NATS was meant"
                    .to_owned(),
            );
        }
        w
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::from_source(&std::env::vars().collect())
    }

    /// Reads from an explicit map of variables (tests).
    pub fn from_source(vars: &HashMap<String, String>) -> Result<Self, ConfigErrors> {
        let (raw, mut errors) = crate::settings::read(vars);
        if let Some(v) = vars.get("RUST_LOG").filter(|v| !v.trim().is_empty())
            && let Err(e) = tracing_subscriber::EnvFilter::try_new(v)
        {
            errors.push(format!("RUST_LOG={v:?} is not a log filter ({e}); e.g. `info` or `info,consumer=debug`"));
        }
        match Self::try_from(raw) {
            Ok(c) if errors.is_empty() => Ok(c),
            Ok(_) => Err(ConfigErrors(errors)),
            Err(more) => {
                errors.extend(more);
                Err(ConfigErrors(errors))
            }
        }
    }

    /// A one-line summary with no secrets, for the startup log and `check-config`.
    #[must_use]
    pub fn summary(&self) -> String {
        format!(
            "input={} relay primary={} secondary={} lease={} cursor_store={:?} sink={} collections={:?} lanes={} http={}",
            match &self.client.input {
                relay_client::Input::Firehose => "firehose".to_owned(),
                relay_client::Input::Jetstream(js) => format!(
                    "jetstream({}, {} dids, {})",
                    js.version.as_str(),
                    js.dids.len(),
                    if js.compress { "zstd" } else { "plain" }
                ),
            },
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

/// A Postgres URL's host, port and database (what the sink writes to), without the
/// credentials.
fn postgres_target(url: Option<&str>) -> String {
    let Some(u) = url.and_then(|u| url::Url::parse(u).ok()) else { return String::new() };
    format!("{}:{}{}", u.host_str().unwrap_or(""), u.port().unwrap_or(5432), u.path())
}

#[cfg(test)]
mod tests {
    use consumer::GapPolicy;

    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        Config::from_source(&pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect())
    }

    #[test]
    fn an_invalid_log_filter_is_refused_not_replaced() {
        let e = cfg(&[("RUST_LOG", "info,consumer=loud")]).expect_err("refused");
        assert!(e.to_string().contains("RUST_LOG=\"info,consumer=loud\" is not a log filter"), "{e}");
        assert!(cfg(&[("RUST_LOG", "warn,consumer=debug")]).is_ok());
    }

    #[test]
    fn a_nats_url_left_unused_by_a_redis_url_is_warned_about() {
        let vars = |pairs: &[(&str, &str)]| -> std::collections::HashMap<String, String> {
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
        };
        let both = [("REDIS_URL", "redis://h"), ("NATS_URL", "nats://n")];
        let c = cfg(&both).expect("valid");
        assert_eq!(c.derived()[0], ("FIREKEEPER_LEASE_BACKEND", "redis".to_owned()));
        let w = c.warnings(&vars(&both));
        assert!(w.len() == 1 && w[0].starts_with("NATS_URL is set but unused"), "{w:?}");
        let chosen = [("REDIS_URL", "redis://h"), ("NATS_URL", "nats://n"), ("FIREKEEPER_LEASE_BACKEND", "redis")];
        assert!(cfg(&chosen).expect("valid").warnings(&vars(&chosen)).is_empty(), "said on purpose");
        let sink = [("REDIS_URL", "redis://h"), ("NATS_URL", "nats://n"), ("FIREKEEPER_SINK", "nats")];
        assert!(cfg(&sink).expect("valid").warnings(&vars(&sink)).is_empty(), "NATS used by the sink");
    }

    #[test]
    fn the_postgres_sink_implies_the_postgres_cursor_store() {
        let c = cfg(&[("FIREKEEPER_SINK", "postgres"), ("DATABASE_URL", "postgres://u@h/db")]).expect("valid");
        assert_eq!(c.store, StoreKind::Postgres);
        let c =
            cfg(&[("FIREKEEPER_SINK", "postgres"), ("DATABASE_URL", "postgres://u@h/db"), ("REDIS_URL", "redis://h")])
                .expect("valid");
        assert_eq!(c.store, StoreKind::Postgres);
    }

    #[test]
    fn a_tls_redis_url_is_refused_by_saying_so() {
        let c = cfg(&[("REDIS_URL", "rediss://:pw@cache.example:6380")]).expect("TLS to Redis");
        assert_eq!(c.lease_backend, LeaseKind::Redis);
        let e = cfg(&[("REDIS_URL", "redis://h:1"), ("FIREKEEPER_REDIS_CA_FILE", "/nonexistent/ca.pem")])
            .expect_err("a CA file that cannot be read, for a URL without TLS");
        let said = e.to_string();
        assert!(
            said.contains("/nonexistent/ca.pem cannot be read") && said.contains("REDIS_URL is not rediss://"),
            "{said}"
        );
        assert!(!e.to_string().contains("pw@"));
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
