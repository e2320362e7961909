//! Every setting, declared once as code: its variable, its parser (which writes the typed
//! value into [`Raw`]), its default (read from the libraries' `Default`s through
//! [`Raw::default`]) and its help. The unknown-variable check, `check-config`'s summary
//! and the README's table all come from [`SETTINGS`] (a test fails when the README's
//! table and this list disagree). Choice settings take their words from one list per
//! type ([`Choice::WORDS`]), so a value cannot be parsed without being listed, or listed
//! without being parsed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use consumer::{ChainBreaks, CollectionFilter, GapPolicy, InvalidPolicy, Options, Start, VerifyMode};
use lease::LeaseConfig;
use relay_client::jetstream::Version as JetVersion;
use relay_client::{BadFramePolicy, ClientConfig, FutureCursorPolicy, RelayUrl};
use sinks::JetStreamConfig;

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

/// Which sink `FIREKEEPER_SINK` names (its own settings complete it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkName {
    /// JSON lines.
    Jsonl,
    /// Postgres rows.
    Postgres,
    /// Batched POSTs.
    Webhook,
    /// A JetStream stream.
    Nats,
    /// Discard.
    Null,
}

/// What the chain check does with a break (`off` turns the check off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainMode {
    /// Count and log.
    Count,
    /// Also hand the sink a `#chain-break` event.
    Emit,
    /// No chain check.
    Off,
}

/// Which repos repo sync backfills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackfillMode {
    /// None.
    Off,
    /// `FIREKEEPER_BACKFILL_DIDS`.
    Dids,
    /// The repos holding records of `FIREKEEPER_COLLECTIONS` (`listReposByCollection`).
    Collections,
    /// Every repo the host lists.
    All,
}

/// What the leader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    /// A relay's `com.atproto.sync.subscribeRepos` (CBOR, signed).
    Firehose,
    /// A Jetstream instance (JSON, server-side filters, no signatures).
    Jetstream,
}

/// The log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable text.
    Text,
}

/// A type a choice setting parses into: its words, each with its value, in one list.
pub trait Choice: Copy + PartialEq + 'static {
    /// Every accepted word and the value it means (the first word of a value is the one
    /// shown as its default).
    const WORDS: &'static [(&'static str, Self)];
}

macro_rules! words {
    ($t:ty: $($w:literal => $v:expr),+ $(,)?) => {
        impl Choice for $t {
            const WORDS: &'static [(&'static str, Self)] = &[$(($w, $v)),+];
        }
    };
}

words!(LeaseKind: "redis" => LeaseKind::Redis, "nats" => LeaseKind::Nats, "local" => LeaseKind::Local);
words!(StoreKind: "redis" => StoreKind::Redis, "nats" => StoreKind::Nats, "file" => StoreKind::File, "postgres" => StoreKind::Postgres);
words!(SinkName: "jsonl" => SinkName::Jsonl, "postgres" => SinkName::Postgres, "webhook" => SinkName::Webhook, "nats" => SinkName::Nats, "null" => SinkName::Null);
words!(FutureCursorPolicy: "fail" => FutureCursorPolicy::Fail, "live" => FutureCursorPolicy::GoLive);
words!(GapPolicy: "fail" => GapPolicy::Fail, "live" => GapPolicy::Live);
words!(Start: "refuse" => Start::Refuse, "live" => Start::Live, "oldest" => Start::Oldest);
words!(ChainMode: "count" => ChainMode::Count, "emit" => ChainMode::Emit, "off" => ChainMode::Off);
words!(VerifyMode: "off" => VerifyMode::Off, "signatures" => VerifyMode::Signatures, "full" => VerifyMode::Full);
words!(bool: "true" => true, "false" => false, "1" => true, "0" => false, "yes" => true, "no" => false);
words!(InvalidPolicy: "mark" => InvalidPolicy::Mark, "fail" => InvalidPolicy::Fail);
words!(BadFramePolicy: "fail" => BadFramePolicy::Fail, "skip" => BadFramePolicy::Skip);
words!(LogFormat: "json" => LogFormat::Json, "text" => LogFormat::Text);
words!(InputKind: "firehose" => InputKind::Firehose, "jetstream" => InputKind::Jetstream);
words!(JetVersion: "v1" => JetVersion::V1, "v2" => JetVersion::V2);
words!(BackfillMode: "off" => BackfillMode::Off, "dids" => BackfillMode::Dids, "collections" => BackfillMode::Collections, "all" => BackfillMode::All);

/// The words of `T`, for the README and error messages.
fn words<T: Choice>() -> Vec<&'static str> {
    T::WORDS.iter().map(|(w, _)| *w).collect()
}

/// The word shown for `v`.
fn word<T: Choice>(v: T) -> String {
    T::WORDS.iter().find(|(_, x)| *x == v).map_or_else(String::new, |(w, _)| (*w).to_owned())
}

/// Parses one of `T`'s words.
fn choose<T: Choice>(v: &str) -> Result<T, String> {
    T::WORDS.iter().find(|(w, _)| *w == v).map(|(_, x)| *x).ok_or_else(|| format!("must be {}", or_list(&words::<T>())))
}

/// `a, b or c`.
fn or_list(choices: &[&str]) -> String {
    match choices {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// A positive number of milliseconds.
fn millis(v: &str) -> Result<Duration, String> {
    match v.parse::<u64>() {
        Ok(n) if n > 0 => Ok(Duration::from_millis(n)),
        _ => Err("is not a positive number of milliseconds".into()),
    }
}

/// A whole number in `1..=max`, converted to the field's type.
fn count<T: TryFrom<usize>>(v: &str, max: usize) -> Result<T, String> {
    let bad = || format!("must be a whole number in 1..={max}");
    match v.parse::<usize>() {
        Ok(n) if n > 0 && n <= max => T::try_from(n).map_err(|_| bad()),
        _ => Err(bad()),
    }
}

/// A count that may be 0.
fn count_or_zero(v: &str, max: usize) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n <= max => Ok(n),
        _ => Err(format!("must be a whole number in 0..={max}")),
    }
}

/// What the environment sets, typed, before the settings are checked against each other
/// ([`crate::config::Config`]'s `TryFrom`). Its `Default` is the libraries' defaults.
#[derive(Debug, Clone)]
pub struct Raw {
    pub relay: Option<RelayUrl>,
    pub relay_secondary: Option<RelayUrl>,
    pub redis_url: Option<String>,
    pub redis_ca_file: Option<PathBuf>,
    pub database_url: Option<String>,
    pub nats_url: Option<String>,
    pub nats_creds: Option<PathBuf>,
    pub nats_ca_file: Option<PathBuf>,
    pub nats_token: Option<String>,
    pub admin_token: Option<String>,
    /// `None`: `dids` when DIDs are listed, else `off`.
    pub backfill: Option<BackfillMode>,
    pub backfill_host: Option<String>,
    pub sync_source: Option<String>,
    /// `None`: derived from the URLs set.
    pub lease_backend: Option<LeaseKind>,
    /// `None`: the lease backend's store.
    pub store: Option<StoreKind>,
    pub sink: SinkName,
    pub jetstream: JetStreamConfig,
    pub jsonl_path: String,
    pub webhook_url: Option<String>,
    pub webhook_batch: usize,
    pub webhook_timeout: Duration,
    pub data_dir: PathBuf,
    pub lease: LeaseConfig,
    pub legacy_cursor_prefix: Option<String>,
    /// `None`: off.
    pub http_addr: Option<SocketAddr>,
    pub client: ClientConfig,
    pub options: Options,
    pub chain: ChainMode,
    pub instance_id: Option<String>,
    pub log: LogFormat,
    pub allow_settings_change: bool,
    pub postgres_records: bool,
    pub input: InputKind,
    /// Jetstream's wire, DIDs and compression (the collections come from the filter).
    pub jet: relay_client::jetstream::Options,
    /// `FIREKEEPER_VERIFY` was set (Jetstream input refuses it unless `off`).
    pub verify_set: bool,
}

impl Default for Raw {
    fn default() -> Self {
        let mut options = Options::default();
        // The binary verifies by default (the library leaves it to the embedder): with repo
        // sync, a commit that does not verify is repaired from its PDS instead of delivered.
        options.verify.mode = VerifyMode::Full;
        Self {
            relay: RelayUrl::parse("wss://bsky.network").ok(),
            relay_secondary: None,
            redis_url: None,
            redis_ca_file: None,
            database_url: None,
            nats_url: None,
            nats_creds: None,
            nats_ca_file: None,
            nats_token: None,
            admin_token: None,
            backfill: None,
            backfill_host: None,
            sync_source: None,
            lease_backend: None,
            store: None,
            sink: SinkName::Jsonl,
            jetstream: JetStreamConfig::default(),
            jsonl_path: "-".into(),
            webhook_url: None,
            webhook_batch: 100,
            webhook_timeout: Duration::from_secs(5),
            data_dir: PathBuf::from("firekeeper-data"),
            lease: LeaseConfig::default(),
            legacy_cursor_prefix: None,
            http_addr: "127.0.0.1:9090".parse().ok(),
            client: ClientConfig::default(),
            chain: match options.chain_breaks {
                ChainBreaks::Count => ChainMode::Count,
                ChainBreaks::Emit => ChainMode::Emit,
            },
            options,
            instance_id: None,
            log: LogFormat::Json,
            allow_settings_change: false,
            postgres_records: false,
            input: InputKind::Firehose,
            jet: relay_client::jetstream::Options { compress: true, ..Default::default() },
            verify_set: false,
        }
    }
}

/// How a setting's value is shown and parsed.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// A `ws://` or `wss://` relay URL (shown without credentials, with its fingerprint).
    Url,
    /// An `http(s)://` endpoint that is not a secret (shown without credentials; the
    /// value is never echoed in errors).
    Endpoint,
    /// Free text.
    Text,
    /// A value that may carry credentials: never shown.
    Secret,
    /// A positive number of milliseconds.
    Millis,
    /// A whole number in `1..=max`.
    Count,
    /// One of a type's words ([`Choice::WORDS`]).
    Choice,
    /// A conventional variable (`REDIS_URL`, `RUST_LOG`, `OTEL_*`): URLs shown without
    /// credentials.
    External,
}

/// One setting.
#[derive(Clone, Copy)]
pub struct Setting {
    /// The environment variable.
    pub name: &'static str,
    /// How the value is shown and parsed.
    pub kind: Kind,
    /// Writes a set value into [`Raw`]; the error says what is wrong (never the value).
    pub apply: fn(&mut Raw, &str) -> Result<(), String>,
    /// The default value, from [`Raw::default`] (the libraries' defaults).
    pub default: fn(&Raw) -> String,
    /// How the README shows the default when it is not one literal value.
    pub shown: Option<&'static str>,
    /// What it does.
    pub help: &'static str,
}

impl Setting {
    /// The README's default cell.
    #[must_use]
    pub fn default_cell(&self) -> String {
        self.shown.map_or_else(|| format!("`{}`", (self.default)(&Raw::default())), str::to_owned)
    }
}

/// A duration's milliseconds, as set.
fn ms(d: Duration) -> String {
    d.as_millis().to_string()
}

macro_rules! setting {
    ($name:literal, $kind:expr, |$r:ident, $v:ident| $apply:expr, |$d:ident| $default:expr, $help:literal $(,)?) => {
        Setting {
            name: $name,
            kind: $kind,
            apply: |$r, $v| {
                $apply;
                Ok(())
            },
            default: |$d| $default,
            shown: None,
            help: $help,
        }
    };
    ($name:literal, $kind:expr, |$r:ident, $v:ident| $apply:expr, shown $shown:literal, $help:literal $(,)?) => {
        Setting {
            name: $name,
            kind: $kind,
            apply: |$r, $v| {
                $apply;
                Ok(())
            },
            default: |_| String::new(),
            shown: Some($shown),
            help: $help,
        }
    };
}

macro_rules! millis {
    ($name:literal, $($f:ident).+, $help:literal) => {
        setting!($name, Kind::Millis, |r, v| r.$($f).+ = millis(v)?, |d| ms(d.$($f).+), $help)
    };
}

macro_rules! count {
    ($name:literal, $max:expr, $($f:ident).+, $help:literal) => {
        setting!($name, Kind::Count, |r, v| r.$($f).+ = count(v, $max)?, |d| d.$($f).+.to_string(), $help)
    };
}

macro_rules! choice {
    ($name:literal, $t:ty, $($f:ident).+, $help:literal) => {
        setting!($name, Kind::Choice, |r, v| r.$($f).+ = choose::<$t>(v)?, |d| word(d.$($f).+), $help)
    };
}

macro_rules! text {
    ($name:literal, $kind:expr, $($f:ident).+, $shown:literal, $help:literal) => {
        setting!($name, $kind, |r, v| r.$($f).+ = Some(v.into()), shown $shown, $help)
    };
}

/// A variable a library reads itself (listed, so it is documented and shown).
macro_rules! external {
    ($name:literal, |$d:ident| $default:expr, $help:literal) => {
        Setting {
            name: $name,
            kind: Kind::External,
            apply: |_, _| Ok(()),
            default: |$d| $default,
            shown: None,
            help: $help,
        }
    };
    ($name:literal, shown $shown:literal, $help:literal) => {
        Setting {
            name: $name,
            kind: Kind::External,
            apply: |_, _| Ok(()),
            default: |_| String::new(),
            shown: Some($shown),
            help: $help,
        }
    };
}

/// Parses a relay URL without echoing it (it may carry credentials).
fn relay(v: &str) -> Result<Option<RelayUrl>, String> {
    RelayUrl::parse(v).map(Some).map_err(|e| e.to_string())
}

/// Every setting firekeeper reads, one per line: variable, where it goes, default, help.
#[rustfmt::skip]
pub const SETTINGS: &[Setting] = &[
    choice!("FIREKEEPER_INPUT", InputKind, input, "what the leader reads: `firehose` (a relay's `com.atproto.sync.subscribeRepos`: CBOR, signed, verified) or `jetstream` (a Jetstream instance: JSON, one event per record op, filtered by the server with `FIREKEEPER_COLLECTIONS` and `FIREKEEPER_JETSTREAM_DIDS`, zstd; no signatures, so `FIREKEEPER_VERIFY` must be `off`). `FIREKEEPER_RELAY` and `FIREKEEPER_RELAY_SECONDARY` then name Jetstream instances; the cursor is the instance's `time_us` stamp, and a switch between instances resumes `FIREKEEPER_SWITCH_OVERLAP_MS` earlier in time and drops what was handed over already"),
    choice!("FIREKEEPER_JETSTREAM_VERSION", JetVersion, jet.version, "with Jetstream input: `v1` (`/subscribe`, every public instance) or `v2` (`/xrpc/network.bsky.jetstream.subscribeEvents`: also `#sync` events, error frames)"),
    setting!("FIREKEEPER_JETSTREAM_DIDS", Kind::Text, |r, v| r.jet.dids = backfill_dids(v)?, shown "all", "with Jetstream input: the repos the server sends events of (at most 10,000): DIDs separated by commas or whitespace, or `@<path>` of a file of them"),
    choice!("FIREKEEPER_JETSTREAM_COMPRESS", bool, jet.compress, "with Jetstream input: ask for zstd frames compressed with Jetstream's published dictionary (shipped with firekeeper): fewer bytes on the wire (the ratio on the fixture is in docs/PERFORMANCE.md)"),
    setting!("FIREKEEPER_RELAY", Kind::Url, |r, v| r.relay = relay(v)?, shown "`wss://bsky.network`; with Jetstream input `wss://jetstream2.us-east.bsky.network`", "primary relay (`ws://` or `wss://`; the path `/xrpc/com.atproto.sync.subscribeRepos` is added; a query string or fragment is refused: the cursor is the only parameter). Its fingerprint (scheme, lower-case host, port, path) keys its cursor: `localhost` and `127.0.0.1` are different relays"),
    setting!("FIREKEEPER_RELAY_SECONDARY", Kind::Url, |r, v| r.relay_secondary = relay(v)?, shown "none", "secondary relay; used after repeated primary failures, with failback probing"),
    text!("REDIS_URL", Kind::External, redis_url, "none", "enables the Redis lease and (by default) the Redis cursor store; `rediss://` connects over TLS, verified against the system's roots or `FIREKEEPER_REDIS_CA_FILE`"),
    text!("FIREKEEPER_REDIS_CA_FILE", Kind::Text, redis_ca_file, "the system's roots", "PEM file of the CA certificates a `rediss://` Redis is verified against instead of the system's roots (a private CA, a managed service's own CA)"),
    text!("DATABASE_URL", Kind::External, database_url, "none", "Postgres for the `postgres` sink and cursor store"),
    text!("NATS_URL", Kind::External, nats_url, "none", "NATS with JetStream (`nats://host:port`) for the `nats` lease, cursor store and sink; shown by host and port only"),
    text!("NATS_CREDS", Kind::Text, nats_creds, "none", "path of a NATS `.creds` file (JWT and seed), if the server wants one"),
    text!("FIREKEEPER_NATS_CA_FILE", Kind::Text, nats_ca_file, "the system's roots", "PEM file of the CA certificates a TLS NATS server (`tls://`, or one that requires TLS) is verified against instead of the system's roots"),
    text!("NATS_TOKEN", Kind::Secret, nats_token, "none", "NATS auth token, if the server wants one (never logged)"),
    setting!("FIREKEEPER_LEASE_BACKEND", Kind::Choice, |r, v| r.lease_backend = Some(choose(v)?), shown "`redis` with `REDIS_URL`, else `nats` with `NATS_URL`, else `local`", "where the leader lease lives: `redis`, `nats` (a JetStream KV bucket whose entries expire after the ttl) or `local` (a lock file: one machine)"),
    setting!("FIREKEEPER_CURSOR_STORE", Kind::Choice, |r, v| r.store = Some(choose(v)?), shown "`postgres` with the postgres sink, else the lease backend's (`redis`, `nats`), else `file`", "`redis`, `nats`, `file` or `postgres`"),
    choice!("FIREKEEPER_SINK", SinkName, sink, "`jsonl`, `postgres`, `webhook`, `nats` (a JetStream stream) or `null`"),
    setting!("FIREKEEPER_NATS_STREAM", Kind::Text, |r, v| r.jetstream.stream = v.into(), |d| d.jetstream.stream.clone(), "the `nats` sink's stream, created if missing (file storage, limits retention)"),
    setting!("FIREKEEPER_NATS_SUBJECT_PREFIX", Kind::Text, |r, v| r.jetstream.subject_prefix = v.into(), |d| d.jetstream.subject_prefix.clone(), "the `nats` sink publishes to `<prefix>.events.<collection or type>` (or `<prefix>.events.p<N>` with partitions)"),
    setting!("FIREKEEPER_NATS_PARTITIONS", Kind::Count, |r, v| r.jetstream.partitions = count(v, 1024)?, shown "none", "publish to `<prefix>.events.p<N>`, N = FNV-1a of the repo's DID modulo this, so consumer groups split the work with each repo in one partition, in order"),
    millis!("FIREKEEPER_NATS_MAX_AGE_MS", jetstream.max_age, "how long the stream keeps events (set on creation)"),
    count!("FIREKEEPER_NATS_MAX_PENDING", 1 << 20, jetstream.max_pending, "publishes each lane keeps in flight (sent, not yet acknowledged) across batches; the cursor passes an event only once its publish is acknowledged, and an unacknowledged batch is published again with the same `Nats-Msg-Id`s"),
    millis!("FIREKEEPER_NATS_DUPLICATE_WINDOW_MS", jetstream.duplicate_window, "how long the server remembers `Nats-Msg-Id` (`<relay fingerprint>:<seq>:<event key>`) to drop events a new leader publishes again: keep it well above the lease ttl"),
    setting!("FIREKEEPER_JSONL_PATH", Kind::Text, |r, v| r.jsonl_path = v.into(), shown "`-` (stdout)", "file the `jsonl` sink appends to"),
    text!("FIREKEEPER_WEBHOOK_URL", Kind::Secret, webhook_url, "none", "`http(s)://` target of the `webhook` sink (never logged)"),
    choice!("FIREKEEPER_POSTGRES_RECORDS", bool, postgres_records, "with the postgres sink: keep the table `firekeeper_records` (did, collection, rkey, cid, rev, record) equal to every repo's verified state: live creates and updates upsert, deletes delete, a repo sync snapshot replaces the repo's rows, each in the transaction of the cursor write it goes with"),
    count!("FIREKEEPER_WEBHOOK_BATCH", 10_000, webhook_batch, "events per POST (`application/x-ndjson`)"),
    millis!("FIREKEEPER_WEBHOOK_TIMEOUT_MS", webhook_timeout, "per-request timeout; failures retry with backoff, the cursor moves only after 2xx"),
    setting!("FIREKEEPER_COLLECTIONS", Kind::Text, |r, v| r.options.collections = collections(v)?, shown "all", "comma-separated NSIDs or `prefix.*` (e.g. `app.bsky.feed.*`); filters commit ops"),
    setting!("FIREKEEPER_DATA_DIR", Kind::Text, |r, v| r.data_dir = v.into(), |d| d.data_dir.display().to_string(), "local lease file, file cursors, and this replica's shadow file (`shadow-<key prefix>.json`: the highest lease token and the cursors it saw, so a store that lost its data neither reissues a token nor loses the position; keep it on a disk that survives restarts)"),
    setting!("FIREKEEPER_KEY_PREFIX", Kind::Text, |r, v| r.lease.key_prefix = v.into(), |d| d.lease.key_prefix.clone(), "Redis keys are `{prefix}:lease`, `{prefix}:fence`, `{prefix}:cursor:<fingerprint>` (one hash tag); NATS buckets `<prefix>-lease` and `<prefix>-state` (with NATS the prefix must be letters, digits, `_` or `-`: other characters are refused, never folded)"),
    text!("FIREKEEPER_LEGACY_CURSOR_PREFIX", Kind::Text, legacy_cursor_prefix, "none", "migrate legacy `<prefix>:<host>` cursors (root relay URLs only)"),
    millis!("FIREKEEPER_LEASE_TTL_MS", lease.ttl, "lease key ttl"),
    millis!("FIREKEEPER_LEASE_RENEW_MS", lease.renew_every, "renewal interval"),
    millis!("FIREKEEPER_LEASE_OP_TIMEOUT_MS", lease.op_timeout, "hard timeout of every Redis call"),
    millis!("FIREKEEPER_LEASE_MARGIN_MS", lease.margin, "the leader stops acting this long before the key could expire"),
    millis!("FIREKEEPER_LEASE_POLL_MS", lease.poll, "standby poll (±20 % jitter); standbys also wake on release"),
    choice!("FIREKEEPER_ALLOW_SETTINGS_CHANGE", bool, allow_settings_change, "take over even when this replica's settings differ from those the deployment's latest leader wrote beside the lease (relays, collections, verification, sink and its target, key prefix): set it on the replicas of a deliberate, rolling change, and remove it once the change is out. Without it such a replica stands by without taking over, not ready, with the differences in `/status` (`settings_differ`), the log and `firekeeper_settings_differ`"),
    choice!("FIREKEEPER_START", Start, options.start, "where a term starts when the cursor store holds no cursor for its relay and this replica remembers none (nothing in its shadow file): a deployment's very first start, or a store that lost its data, which look alike (a store that lost its data may hand out token 1 again, so the token cannot tell them apart). `refuse` (stop and say so: set the cursor with `firekeeper cursor set`), `live` (the relay's live tail: everything published before is skipped) or `oldest` (the oldest event the relay still has). Meant for the first start: remove it afterwards, or a store that loses its data later skips (`live`) or replays (`oldest`) without a word"),
    millis!("FIREKEEPER_COMMIT_INTERVAL_MS", options.commit_interval, "how often the processed watermark is committed (one write in flight; intake reads on meanwhile); a quiet stream writes its cursor again every 10 intervals, so a store that lost it gets it back"),
    millis!("FIREKEEPER_DRAIN_BUDGET_MS", options.drain_budget, "step-down drain budget"),
    millis!("FIREKEEPER_UNCOMMITTED_MAX_MS", options.uncommitted_max, "when the cursor store takes no commit for this long while there is something to commit, intake waits until one lands (not ready meanwhile, `commit_stalled` in `/status`): what a crash can repeat stays bounded by what was handed over in this long"),
    text!("FIREKEEPER_ADMIN_TOKEN", Kind::Secret, admin_token, "none", "bearer token the state-changing endpoint `POST /repos/resync` (`firekeeper repos resync`) demands; unset: it is off and the HTTP endpoints are all read-only (never logged)"),
    setting!("FIREKEEPER_HTTP_ADDR", Kind::Text, |r, v| r.http_addr = http_addr(v)?, |d| d.http_addr.map_or_else(|| "off".into(), |a| a.to_string()), "`/healthz`, `/readyz`, `/metrics`, `/status`; `off` disables"),
    count!("FIREKEEPER_LANES", 256, options.lanes, "processing lanes; one repo's events always share a lane (order per repo)"),
    count!("FIREKEEPER_QUEUE_DEPTH", 1 << 20, options.queue_depth, "events queued per lane before the socket is pushed back on"),
    millis!("FIREKEEPER_CONNECT_TIMEOUT_MS", client.connect_timeout, "relay handshake budget"),
    millis!("FIREKEEPER_STALL_TIMEOUT_MS", client.stall_timeout, "reconnect when no data frame arrives for this long"),
    count!("FIREKEEPER_FAILOVER_AFTER", 1000, client.failover_after, "consecutive failed connections before switching relays"),
    millis!("FIREKEEPER_PROBE_INTERVAL_MS", client.probe_interval, "while on the secondary, how often the primary is probed for failback"),
    choice!("FIREKEEPER_FUTURE_CURSOR", FutureCursorPolicy, client.future_cursor, "on `FutureCursor`: `fail` (stop, an operator looks) or `live` (accept the gap: the stored cursor is rewound, fenced, to just before the first live seq; logged with the range and counted in `firekeeper_gaps_total`)"),
    millis!("FIREKEEPER_SWITCH_OVERLAP_MS", options.switch_overlap, "on a relay switch, resume this far (relay time) before the committed position and drop what was already handed over: `#commit`/`#sync` whose rev is not newer than the repo's last delivered, `#identity`/`#account` with the same (did, time); counted in `firekeeper_switch_duplicates_dropped_total`"),
    count!("FIREKEEPER_SWITCH_MAX_PROBES", 1000, options.switch_max_probes, "at most this many `cursor=` probes (each bounded by the connect timeout) to find the start on the relay switched to; counted in `firekeeper_switch_probes_total`"),
    choice!("FIREKEEPER_GAP", GapPolicy, options.gap, "when the relay switched to does not serve events back to where the other stopped: `fail` (refuse the switch: stay leader, keep retrying the relay that has the events, re-probe the other every `FIREKEEPER_PROBE_INTERVAL_MS`, not ready on `/readyz`, the missing range in `/status` as `refused_switch`, counted in `firekeeper_switch_refused_total`; nothing exits) or `live` (start at its oldest event; logged, counted in `firekeeper_gaps_total{reason=\"switch\"}`, shown as `last_gap` in `/status`)"),
    millis!("FIREKEEPER_SWITCH_SKEW_MS", options.switch_skew, "how far PDS clocks are trusted on a switch: event times ahead of this process's clock by more are clamped, and a relay whose oldest events are older than the committed position less this has no gap (a shorter overlap, counted in `firekeeper_switch_overlap_short_total`)"),
    choice!("FIREKEEPER_CHAIN_BREAKS", ChainMode, chain, "per-repo chain check (sync 1.1): a `#commit` whose `since` is not the last rev seen for its repo means the relay skipped a commit of it; `count` (log it, `firekeeper_repo_chain_breaks_total`), `emit` (also hand the sink a `#chain-break` event naming the repo and the revs, just before that commit, so downstream can resync the repo) or `off`"),
    count!("FIREKEEPER_CHAIN_REPOS", 100_000_000, options.chain_repos, "how many recently seen repos the chain check remembers (about 36 bytes each: 34 MiB resident for the default, measured by `make bench`)"),
    setting!("FIREKEEPER_VERIFY", Kind::Choice, |r, v| { r.options.verify.mode = choose(v)?; r.verify_set = true; }, |d| word(d.options.verify.mode), "verify every `#commit` and `#sync` against its repo's key before the sink sees it: `signatures` (the signed commit: CAR root, commit CID, repo, version, low-S ECDSA), `full` (also every block's CID, every op's record, the MST inversion back to `prevData` and the repo's chain; recommended unless you trust the relay) or `off`"),
    choice!("FIREKEEPER_VERIFY_STRICT", bool, options.verify.strict, "with `FIREKEEPER_VERIFY=full`: a commit whose MST inversion cannot complete (a block missing, no `prevData`) is `#invalid` (`mst`) instead of counted in `firekeeper_verify_unproven_total` and delivered"),
    choice!("FIREKEEPER_INVALID", InvalidPolicy, options.verify.invalid, "what an event that fails verification does: `mark` (the sink gets a `#invalid` event at its seq instead, the cursor passes it, the repo is listed as desynchronised) or `fail` (commit everything before it and stop with an error naming it)"),
    setting!("FIREKEEPER_PLC_URL", Kind::Endpoint, |r, v| r.options.verify.resolver.plc_url = v.into(), |d| d.options.verify.resolver.plc_url.clone(), "the PLC directory `did:plc` documents are resolved from (`GET <url>/<did>`; `did:web` documents come from `https://<host>/.well-known/did.json`)"),
    count!("FIREKEEPER_DID_CACHE_SIZE", 100_000_000, options.verify.resolver.cache_size, "DIDs whose resolved key is kept in memory"),
    millis!("FIREKEEPER_DID_CACHE_TTL_MS", options.verify.resolver.ttl, "how long a resolved DID document is used before it is asked for again (in the background: the old one serves meanwhile); a `#identity` event or a failed signature asks at once"),
    millis!("FIREKEEPER_RESOLVE_TIMEOUT_MS", options.verify.resolve_timeout, "how long a DID that does not resolve for now (directory or `did:web` host down, failing, slow) holds its first event, retried with backoff, before it is `#invalid` with reason `unresolved`; later events of the DID wait only what is left, then are `unresolved` at once for 30 s, after which one look-up asks again; meanwhile the cursor stays before the held event and its lane waits. A definite answer (not found, a document that gives no key) is `unresolved` at once and remembered for 2 minutes"),
    count!("FIREKEEPER_RESOLVE_CONCURRENCY", 1024, options.verify.resolver.concurrency, "requests to the PLC directory at a time (each `did:web` host has its own 2, and a failing host its own backoff)"),
    choice!("FIREKEEPER_ALLOW_PRIVATE_ADDRESSES", bool, options.verify.resolver.allow_private, "addresses taken from the network (`did:web` hosts, PDS endpoints from DID documents, their redirects) may be loopback or private; by default they are refused, by IP or by name, so a DID cannot point this process at its own machine or network (set `true` for tests and private deployments)"),
    choice!("FIREKEEPER_RESYNC", bool, options.resync.enabled, "repo sync: a repo whose chain broke (or, with `FIREKEEPER_VERIFY`, whose commit was invalid) is queued, fetched whole from its PDS (`com.atproto.sync.getRepo`, the DID document's `#atproto_pds`), verified whole whatever `FIREKEEPER_VERIFY` says, and handed to the sink as a `#resync` event and one `#record` per record (fold semantics: forget the repo, then create each record); the queue is kept in the cursor store, fenced; `false` only counts and lists such repos"),
    setting!("FIREKEEPER_BACKFILL", Kind::Choice, |r, v| r.backfill = Some(choose(v)?), shown "`dids` when `FIREKEEPER_BACKFILL_DIDS` lists any, else `off`", "repo sync's backfill: `off`, `dids` (those of `FIREKEEPER_BACKFILL_DIDS`), `collections` (the repos `FIREKEEPER_BACKFILL_HOST` lists with `com.atproto.sync.listReposByCollection` for each collection of `FIREKEEPER_COLLECTIONS`, which must name exact NSIDs, one collection after another) or `all` (every active repo `FIREKEEPER_BACKFILL_HOST` lists with `com.atproto.sync.listRepos`); a page at a time while the queue is short, after the repairs of broken repos; the listing's cursor is kept in the cursor store, so a new leader goes on where the last stopped; each repo arrives as a `#resync` (reason `backfill`) and its `#record`s (the collection filter applied), beside the live stream"),
    text!("FIREKEEPER_BACKFILL_HOST", Kind::Endpoint, backfill_host, "the primary relay (`wss://` as `https://`)", "the host whose `listRepos` `FIREKEEPER_BACKFILL=all` walks (a relay, or a PDS for its own repos), or whose `listReposByCollection` `FIREKEEPER_BACKFILL=collections` walks (a relay); after an accepted gap, the repos this leader handed over are reconciled against its `listRepos` revs"),
    setting!("FIREKEEPER_BACKFILL_DIDS", Kind::Text, |r, v| r.options.resync.backfill = backfill_dids(v)?, |d| d.options.resync.backfill.len().to_string() + " DIDs", "repos to backfill with repo sync: DIDs separated by commas or whitespace, or `@<path>` of a file of them; each is fetched from its PDS once and handed to the sink as a `#resync` and its `#record`s (reason `backfill`), after the repairs of broken repos; the list's position is kept in the cursor store, so a new leader goes on where the last stopped (keep the list the same across replicas and restarts)"),
    text!("FIREKEEPER_SYNC_SOURCE", Kind::Endpoint, sync_source, "`pds`", "where repo sync asks `getRepo`: `pds` (the repo's PDS, from its DID document), `relay` (the primary relay, which answers with a redirect to the PDS; at most 3 redirects are followed, each address guarded) or an `http(s)://` host; the signing key always comes from the DID document"),
    setting!("FIREKEEPER_SYNC_WORKERS", Kind::Count, |r, v| r.options.resync.workers = count_or_zero(v, 1024)?, |d| d.options.resync.workers.to_string(), "repos fetched for repo sync at a time: by the leader, or with a shared queue (`FIREKEEPER_SYNC_SHARED`) by this replica's workers, whether it leads or stands by; `0`: this replica takes no jobs (only with a shared queue)"),
    setting!("FIREKEEPER_SYNC_BIND", Kind::Text, |r, v| r.options.resync.bind = Some(v.parse().map_err(|_| "must be an IP address of this machine".to_owned())?), |d| d.options.resync.bind.map_or_else(|| "the system's choice".to_owned(), |a| a.to_string()), "the local address repo sync fetches repos from (`getRepo`, DID documents go their own way): give each replica its own egress address, so that each has its own per-address budget at the PDSs (a PDS limits `getRepo` per IP)"),
    millis!("FIREKEEPER_SYNC_CLAIM_MS", options.resync.claim_idle, "with a shared repo-sync queue: a job claim not touched for this long passes to another replica's worker (the one that had it died, froze or was cut off); a worker touches its claims every sixth of it and stops writing after two thirds of it without a touch the queue took, so a late worker has stopped before the job moves on"),
    choice!("FIREKEEPER_SYNC_SHARED", bool, options.resync.share, "repo sync across replicas: with the Redis, NATS or Postgres cursor store and a sink every replica reaches (Postgres, webhook, NATS, null; not jsonl), the leader publishes each repo to fetch to a shared queue (a Redis stream with a consumer group; a NATS `JetStream` work-queue stream with a KV bucket; a Postgres table claimed with `FOR UPDATE SKIP LOCKED`) and every replica's workers claim jobs, fetch and verify the repo, and write its snapshot to the sink under the leader's fencing token; a claim not touched for `FIREKEEPER_SYNC_CLAIM_MS` passes to another worker, and a late worker's apply is refused; the leader holds the repo's live events until the job has landed; `false`: the leader fetches every repo itself"),
    count!("FIREKEEPER_SYNC_MEMORY_BYTES", 1 << 31, options.resync.limits.memory_bytes, "a fetched repo's CAR is kept in memory up to this size; a larger one is written to a temporary file in `FIREKEEPER_DATA_DIR` (removed after) and read back by offset, so memory does not grow with the repo: a repo's records reach the sink 4,096 at a time, and a million-record repo needs tens of MiB (the index of its blocks)"),
    millis!("FIREKEEPER_RESYNC_RETRY_MS", options.resync.retry_first, "the first retry of a failed resync waits this long, doubling (with jitter) to an hour; a rate-limited host's `Retry-After`/`RateLimit-Reset` is waited out instead; a repo the PDS says is gone waits for an event of it"),
    count!("FIREKEEPER_RESYNC_ATTEMPTS", 1000, options.resync.attempts, "failed resyncs of a repo before it is listed as `failed` (until an event of it or an operator queues it again)"),
    choice!("FIREKEEPER_BAD_FRAME", BadFramePolicy, client.bad_frame, "a frame that has a seq but cannot be decoded or rendered, or is over the frame limit: `fail` (commit what came before it, stop leading with an error naming the seq) or `skip` (count it in `firekeeper_bad_frames_total{action=\"skipped\"}` and move the cursor past it)"),
    count!("FIREKEEPER_MAX_FRAME_BYTES", 1 << 30, client.max_frame_bytes, "largest WebSocket message accepted; with `skip`, one reconnect reads an oversized frame with a raised limit (64 MiB or 4×) only to learn its seq"),
    choice!("FIREKEEPER_VERIFY_BLOCKS", bool, options.verify_blocks, "check every CAR block's sha256 against its CID"),
    text!("FIREKEEPER_INSTANCE_ID", Kind::Text, instance_id, "random", "this replica's id in the lease value"),
    choice!("FIREKEEPER_LOG_FORMAT", LogFormat, log, "`json` or `text` (to stderr)"),
    external!("RUST_LOG", |_d| "firekeeper at `info`, libraries at `warn`".into(), "log filter (refused when invalid); commands other than `run` log only warnings unless it is set"),
    external!("OTEL_EXPORTER_OTLP_ENDPOINT", shown "none", "enables OTLP/HTTP (protobuf) traces: spans per term, relay connection and commit"),
    external!("OTEL_SERVICE_NAME", |_d| "firekeeper".into(), "service name on traces"),
];

/// `FIREKEEPER_COLLECTIONS`: comma-separated NSIDs or `prefix.*`.
fn collections(v: &str) -> Result<Option<CollectionFilter>, String> {
    let entries: Vec<String> = v.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect();
    CollectionFilter::new(entries).map_err(|bad| format!("entry {bad:?} is not an NSID or `prefix.*`"))
}

/// `FIREKEEPER_BACKFILL_DIDS`: DIDs separated by commas or whitespace, or `@<path>`.
fn backfill_dids(v: &str) -> Result<Vec<String>, String> {
    let text = match v.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?,
        None => v.to_owned(),
    };
    let dids: Vec<String> =
        text.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()).map(str::to_owned).collect();
    if let Some(bad) = dids.iter().find(|d| !d.starts_with("did:") || d.len() > 2048) {
        return Err(format!("entry {bad:?} is not a DID"));
    }
    let mut seen = std::collections::HashSet::new();
    Ok(dids.into_iter().filter(|d| seen.insert(d.clone())).collect())
}

/// `FIREKEEPER_HTTP_ADDR`: `host:port` or `off`.
fn http_addr(v: &str) -> Result<Option<SocketAddr>, String> {
    if v == "off" {
        return Ok(None);
    }
    v.parse().map(Some).map_err(|_| "is not host:port (or off)".into())
}

/// The variable's value when set (trimmed; empty counts as unset).
fn value<'a>(vars: &'a HashMap<String, String>, name: &str) -> Option<&'a str> {
    vars.get(name).map(|v| v.trim()).filter(|v| !v.is_empty())
}

/// Reads every setting from `vars` into [`Raw`]: every problem is listed, each naming its
/// variable (and its value only where it cannot carry a credential); unknown
/// `FIREKEEPER_*` variables are refused, since a typo must not fall back to a default.
#[must_use]
pub fn read(vars: &HashMap<String, String>) -> (Raw, Vec<String>) {
    let mut raw = Raw::default();
    let mut errors = Vec::new();
    for s in SETTINGS {
        let Some(v) = value(vars, s.name) else { continue };
        if let Err(e) = (s.apply)(&mut raw, v) {
            errors.push(match s.kind {
                Kind::Url | Kind::Secret | Kind::External | Kind::Endpoint => format!("{}: {e}", s.name),
                _ => format!("{}={v:?} {e}", s.name),
            });
        }
    }
    let mut unknown: Vec<String> = vars
        .keys()
        .filter(|k| k.starts_with("FIREKEEPER_") && !SETTINGS.iter().any(|s| s.name == k.as_str()))
        .map(|u| match nearest(u) {
            Some(n) => format!("{u} is not a firekeeper setting: did you mean {n}?"),
            None => format!("{u} is not a firekeeper setting (see the README's table)"),
        })
        .collect();
    unknown.sort();
    errors.extend(unknown);
    (raw, errors)
}

/// The setting whose name is within two edits (a transposition counts one) of `name`.
fn nearest(name: &str) -> Option<&'static str> {
    SETTINGS.iter().map(|s| (edits(name, s.name), s.name)).filter(|(d, _)| *d <= 2).min().map(|(_, n)| n)
}

/// Variables set in the environment that are not ours but are spelt within two edits of a
/// setting without the `FIREKEEPER_` prefix (`REDIS_ULR`, `DATABSE_URL`): the setting
/// they were meant as falls back to its default, so `check-config` and the start warn.
/// Pairs of (the variable set, the setting it looks like), sorted.
#[must_use]
pub fn lookalikes(vars: &HashMap<String, String>) -> Vec<(String, &'static str)> {
    let mut found: Vec<(String, &'static str)> = vars
        .keys()
        .filter(|k| !k.starts_with("FIREKEEPER_") && !SETTINGS.iter().any(|s| s.name == k.as_str()))
        .filter_map(|k| {
            SETTINGS
                .iter()
                .filter(|s| !s.name.starts_with("FIREKEEPER_") && s.name.len() >= 6)
                .find(|s| edits(k, s.name) <= 2 && !vars.contains_key(s.name))
                .map(|s| (k.clone(), s.name))
        })
        .collect();
    found.sort();
    found
}

/// Optimal string alignment distance between two ASCII names.
fn edits(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// The README's configuration table, one row per setting.
#[must_use]
pub fn markdown_table() -> String {
    use std::fmt::Write as _;
    let mut out = String::from("| variable | default | meaning |\n|---|---|---|\n");
    for s in SETTINGS {
        let _ = writeln!(out, "| `{}` | {} | {} |", s.name, s.default_cell(), s.help);
    }
    out
}

/// One line per setting for `check-config`: its value as set (relay URLs without
/// credentials and with their fingerprint, other URLs as scheme, host and port, secrets
/// as set or unset) or its effective default: `derived` gives the value a default was
/// derived to (the lease backend from the URLs set), the rest show their default.
#[must_use]
pub fn effective(vars: &HashMap<String, String>, derived: &[(&str, String)]) -> Vec<String> {
    SETTINGS
        .iter()
        .map(|s| {
            let shown = match (value(vars, s.name), s.kind) {
                (None, _) => match derived.iter().find(|(n, _)| *n == s.name) {
                    Some((_, v)) => format!("`{v}` (derived)"),
                    None => format!("{} (default)", s.default_cell()),
                },
                (Some(_), Kind::Secret) => "(set, hidden)".to_owned(),
                (Some(v), Kind::Url) => RelayUrl::parse(v).map_or_else(
                    |_| "(invalid)".to_owned(),
                    |u| format!("{} (fingerprint {})", u.redacted(), u.fingerprint()),
                ),
                (Some(v), Kind::External) if s.name.ends_with("_URL") => shown_url(v),
                (Some(v), Kind::Endpoint) => shown_url(v),
                (Some(v), _) => format!("`{v}`"),
            };
            format!("{} = {shown}", s.name)
        })
        .collect()
}

/// A store or collector URL as scheme, host, port (the scheme's default when none is
/// given) and path, without user, password or query; `None` when it is not a URL. What
/// `check-config` and `cursor set` show of a store.
pub fn address(raw: &str) -> Option<String> {
    let u = url::Url::parse(raw.trim()).ok()?;
    let port = u.port().or_else(|| match u.scheme() {
        "redis" | "rediss" => Some(6379),
        "nats" | "tls" => Some(4222),
        "postgres" | "postgresql" => Some(5432),
        _ => u.port_or_known_default(),
    });
    let port = port.map(|p| format!(":{p}")).unwrap_or_default();
    let path = if u.path() == "/" { "" } else { u.path() };
    Some(format!("{}://{}{port}{path}", u.scheme(), u.host_str().unwrap_or("")))
}

/// [`address`], saying whether credentials were set (never what they are).
fn shown_url(v: &str) -> String {
    let Some(shown) = address(v) else { return "(set, not a URL)".to_owned() };
    let creds = url::Url::parse(v.trim()).is_ok_and(|u| !u.username().is_empty() || u.password().is_some());
    if creds { format!("{shown} (credentials set, hidden)") } else { shown }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_values_show_urls_with_ports_and_derived_defaults() {
        let vars: HashMap<String, String> = [
            ("REDIS_URL", "redis://:hunter2@10.0.0.5:6380/2"),
            ("NATS_URL", "nats://10.0.0.6"),
            ("DATABASE_URL", "postgres://fk:s3cret@db.internal/firekeeper"),
            ("FIREKEEPER_RELAY", "wss://user:pw@relay.example:8443/"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        let lines = effective(&vars, &[("FIREKEEPER_LEASE_BACKEND", "redis".into())]);
        let find = |name: &str| lines.iter().find(|l| l.starts_with(&format!("{name} ="))).cloned().unwrap_or_default();
        assert_eq!(find("REDIS_URL"), "REDIS_URL = redis://10.0.0.5:6380/2 (credentials set, hidden)");
        assert_eq!(find("NATS_URL"), "NATS_URL = nats://10.0.0.6:4222");
        assert_eq!(
            find("DATABASE_URL"),
            "DATABASE_URL = postgres://db.internal:5432/firekeeper (credentials set, hidden)"
        );
        assert!(find("FIREKEEPER_RELAY").starts_with("FIREKEEPER_RELAY = wss://***@relay.example:8443/ (fingerprint "));
        assert_eq!(find("FIREKEEPER_LEASE_BACKEND"), "FIREKEEPER_LEASE_BACKEND = `redis` (derived)");
        let all = lines.join("\n");
        assert!(!all.contains("hunter2") && !all.contains("s3cret") && !all.contains(":pw@"), "{all}");
    }

    #[test]
    fn the_readme_table_is_the_settings_list() {
        let readme = include_str!("../../../README.md");
        let table = markdown_table();
        assert!(
            readme.contains(&table),
            "README.md's configuration table differs from SETTINGS; paste this table:\n{table}"
        );
    }

    #[test]
    fn lookalikes_of_unprefixed_settings_are_named() {
        let vars: HashMap<String, String> = [
            ("REDIS_ULR", "redis://x"),
            ("DATABSE_URL", "postgres://x"),
            ("HOME", "/root"),
            ("PATH", "/bin"),
            ("NATS_URL", "nats://x"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        assert_eq!(
            lookalikes(&vars),
            vec![("DATABSE_URL".to_owned(), "DATABASE_URL"), ("REDIS_ULR".to_owned(), "REDIS_URL")]
        );
        let (_, errors) = read(&[("FIREKEEPER_LANSE".to_owned(), "4".to_owned())].into_iter().collect());
        assert_eq!(errors, vec!["FIREKEEPER_LANSE is not a firekeeper setting: did you mean FIREKEEPER_LANES?"]);
    }

    #[test]
    fn secrets_are_never_shown() {
        let vars = [
            ("FIREKEEPER_WEBHOOK_URL", "https://u:hunter2@hook.example/x?token=hunter2"),
            ("REDIS_URL", "redis://:hunter2@127.0.0.1:6379"),
            ("FIREKEEPER_RELAY", "wss://u:hunter2@relay.example"),
            ("FIREKEEPER_LANES", "8"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let lines = effective(&vars, &[]).join("\n");
        assert!(!lines.contains("hunter2"), "{lines}");
        assert!(lines.contains("FIREKEEPER_LANES = `8`"), "{lines}");
        assert!(lines.contains("FIREKEEPER_QUEUE_DEPTH = `1024` (default)"), "{lines}");
    }

    /// Each setting parses by its type: a choice names all its words, a count its range
    /// (the bound itself accepted), and nothing that may carry a credential is echoed.
    #[test]
    fn each_setting_parses_by_its_type() {
        let read1 = |k: &str, v: &str| read(&[(k.to_owned(), v.to_owned())].into_iter().collect());
        let (_, e) = read1("FIREKEEPER_GAP", "skip");
        assert_eq!(e, ["FIREKEEPER_GAP=\"skip\" must be fail or live"]);
        let (_, e) = read1("FIREKEEPER_VERIFY", "all");
        assert_eq!(e, ["FIREKEEPER_VERIFY=\"all\" must be off, signatures or full"]);
        let (r, e) = read1("FIREKEEPER_LANES", "256");
        assert!(e.is_empty() && r.options.lanes == 256, "{e:?}");
        let (_, e) = read1("FIREKEEPER_LANES", "257");
        assert_eq!(e, ["FIREKEEPER_LANES=\"257\" must be a whole number in 1..=256"]);
        let (r, e) = read1("FIREKEEPER_VERIFY_STRICT", "yes");
        assert!(e.is_empty() && r.options.verify.strict, "{e:?}");
        let (_, e) = read1("FIREKEEPER_RELAY_SECONDARY", "https://u:hunter2@relay.example");
        assert!(e.len() == 1 && e[0].starts_with("FIREKEEPER_RELAY_SECONDARY: ") && !e[0].contains("hunter2"), "{e:?}");
        for s in SETTINGS.iter().filter(|s| matches!(s.kind, Kind::Millis)) {
            let (_, e) = read1(s.name, "0");
            assert_eq!(e.len(), 1, "{}: 0 ms is refused", s.name);
        }
    }

    #[test]
    fn names_are_unique() {
        let mut names: Vec<_> = SETTINGS.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SETTINGS.len());
    }
}
