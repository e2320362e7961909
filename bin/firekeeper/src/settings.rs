//! Every setting, defined once: its variable, default, parser and help. The
//! unknown-variable check, `check-config`'s summary and the README's table all come from
//! [`SETTINGS`] (a test fails when the README's table and this list disagree).

/// How a setting's value is parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A `ws://` or `wss://` relay URL (shown by fingerprint only).
    Url,
    /// Free text.
    Text,
    /// A value that may carry credentials: never shown.
    Secret,
    /// A positive number of milliseconds.
    Millis,
    /// A whole number in `1..=max`.
    Count(usize),
    /// One of these words.
    Choice(&'static [&'static str]),
    /// A conventional variable read by a library (`REDIS_URL`, `RUST_LOG`, `OTEL_*`).
    External,
}

/// One setting.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// The environment variable.
    pub name: &'static str,
    /// The value used when it is unset (empty: none, or derived from other settings).
    pub default: &'static str,
    /// How the README shows the default when it is not a literal value.
    pub shown: Option<&'static str>,
    /// Its parser.
    pub kind: Kind,
    /// What it does.
    pub help: &'static str,
}

impl Setting {
    /// The README's default cell.
    #[must_use]
    pub fn default_cell(&self) -> String {
        self.shown.map_or_else(|| format!("`{}`", self.default), str::to_owned)
    }
}

/// Looks a setting up by variable name.
///
/// # Panics
/// On a name that is not in [`SETTINGS`] (a programming error caught by every test run).
#[must_use]
pub fn setting(name: &str) -> &'static Setting {
    SETTINGS.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("{name} is not in SETTINGS"))
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

/// One line per setting for `check-config`: its value as set (relay URLs by
/// fingerprint, secrets hidden) or its default.
#[must_use]
pub fn effective(vars: &std::collections::HashMap<String, String>) -> Vec<String> {
    SETTINGS
        .iter()
        .map(|s| {
            let set = vars.get(s.name).map(|v| v.trim()).filter(|v| !v.is_empty());
            let shown = match (set, s.kind) {
                (None, _) => format!("{} (default)", s.default_cell()),
                (Some(_), Kind::Secret) => "(set, hidden)".to_owned(),
                (Some(v), Kind::Url) => relay_client::RelayUrl::parse(v)
                    .map_or_else(|_| "(invalid)".to_owned(), |u| format!("fingerprint {}", u.fingerprint())),
                (Some(v), Kind::External) if s.name.ends_with("_URL") => url::Url::parse(v).map_or_else(
                    |_| "(set)".to_owned(),
                    |u| format!("{}://{}", u.scheme(), u.host_str().unwrap_or("")),
                ),
                (Some(v), _) => format!("`{v}`"),
            };
            format!("{} = {shown}", s.name)
        })
        .collect()
}

/// Every setting firekeeper reads.
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "FIREKEEPER_RELAY",
        default: "wss://bsky.network",
        shown: None,
        kind: Kind::Url,
        help: "primary relay (`ws://` or `wss://`; the path `/xrpc/com.atproto.sync.subscribeRepos` is added)",
    },
    Setting {
        name: "FIREKEEPER_RELAY_SECONDARY",
        default: "",
        shown: Some("none"),
        kind: Kind::Url,
        help: "secondary relay; used after repeated primary failures, with failback probing",
    },
    Setting {
        name: "REDIS_URL",
        default: "",
        shown: Some("none"),
        kind: Kind::External,
        help: "enables the Redis lease and (by default) the Redis cursor store",
    },
    Setting {
        name: "DATABASE_URL",
        default: "",
        shown: Some("none"),
        kind: Kind::External,
        help: "Postgres for the `postgres` sink and cursor store",
    },
    Setting {
        name: "NATS_URL",
        default: "",
        shown: Some("none"),
        kind: Kind::External,
        help: "NATS with JetStream (`nats://host:port`) for the `nats` lease, cursor store and sink; shown by host and port only",
    },
    Setting {
        name: "NATS_CREDS",
        default: "",
        shown: Some("none"),
        kind: Kind::Text,
        help: "path of a NATS `.creds` file (JWT and seed), if the server wants one",
    },
    Setting {
        name: "NATS_TOKEN",
        default: "",
        shown: Some("none"),
        kind: Kind::Secret,
        help: "NATS auth token, if the server wants one (never logged)",
    },
    Setting {
        name: "FIREKEEPER_LEASE_BACKEND",
        default: "",
        shown: Some("`redis` with `REDIS_URL`, else `nats` with `NATS_URL`, else `local`"),
        kind: Kind::Choice(&["redis", "nats", "local"]),
        help: "where the leader lease lives: `redis`, `nats` (a JetStream KV bucket whose entries expire after the ttl) or `local` (a lock file: one machine)",
    },
    Setting {
        name: "FIREKEEPER_CURSOR_STORE",
        default: "",
        shown: Some("the lease backend's (`redis`, `nats`), else `file`"),
        kind: Kind::Choice(&["redis", "nats", "file", "postgres"]),
        help: "`redis`, `nats`, `file` or `postgres`",
    },
    Setting {
        name: "FIREKEEPER_SINK",
        default: "jsonl",
        shown: None,
        kind: Kind::Choice(&["jsonl", "postgres", "webhook", "nats", "null"]),
        help: "`jsonl`, `postgres`, `webhook`, `nats` (a JetStream stream) or `null`",
    },
    Setting {
        name: "FIREKEEPER_NATS_STREAM",
        default: "FIREKEEPER",
        shown: None,
        kind: Kind::Text,
        help: "the `nats` sink's stream, created if missing (file storage, limits retention)",
    },
    Setting {
        name: "FIREKEEPER_NATS_SUBJECT_PREFIX",
        default: "firekeeper",
        shown: None,
        kind: Kind::Text,
        help: "the `nats` sink publishes to `<prefix>.events.<collection or type>` (or `<prefix>.events.p<N>` with partitions)",
    },
    Setting {
        name: "FIREKEEPER_NATS_PARTITIONS",
        default: "",
        shown: Some("none"),
        kind: Kind::Count(1024),
        help: "publish to `<prefix>.events.p<N>`, N = FNV-1a of the repo's DID modulo this, so consumer groups split the work with each repo in one partition, in order",
    },
    Setting {
        name: "FIREKEEPER_NATS_MAX_AGE_MS",
        default: "604800000",
        shown: None,
        kind: Kind::Millis,
        help: "how long the stream keeps events (set on creation)",
    },
    Setting {
        name: "FIREKEEPER_NATS_DUPLICATE_WINDOW_MS",
        default: "120000",
        shown: None,
        kind: Kind::Millis,
        help: "how long the server remembers `Nats-Msg-Id` (`<relay fingerprint>:<seq>:<event key>`) to drop events a new leader publishes again: keep it well above the lease ttl",
    },
    Setting {
        name: "FIREKEEPER_JSONL_PATH",
        default: "-",
        shown: Some("`-` (stdout)"),
        kind: Kind::Text,
        help: "file the `jsonl` sink appends to",
    },
    Setting {
        name: "FIREKEEPER_WEBHOOK_URL",
        default: "",
        shown: Some("none"),
        kind: Kind::Secret,
        help: "`http(s)://` target of the `webhook` sink (never logged)",
    },
    Setting {
        name: "FIREKEEPER_WEBHOOK_BATCH",
        default: "100",
        shown: None,
        kind: Kind::Count(10_000),
        help: "events per POST (`application/x-ndjson`)",
    },
    Setting {
        name: "FIREKEEPER_WEBHOOK_TIMEOUT_MS",
        default: "5000",
        shown: None,
        kind: Kind::Millis,
        help: "per-request timeout; failures retry with backoff, the cursor moves only after 2xx",
    },
    Setting {
        name: "FIREKEEPER_COLLECTIONS",
        default: "",
        shown: Some("all"),
        kind: Kind::Text,
        help: "comma-separated NSIDs or `prefix.*` (e.g. `app.bsky.feed.*`); filters commit ops",
    },
    Setting {
        name: "FIREKEEPER_DATA_DIR",
        default: "firekeeper-data",
        shown: None,
        kind: Kind::Text,
        help: "local lease file and file cursors",
    },
    Setting {
        name: "FIREKEEPER_KEY_PREFIX",
        default: "firekeeper",
        shown: None,
        kind: Kind::Text,
        help: "Redis keys are `{prefix}:lease`, `{prefix}:fence`, `{prefix}:cursor:<fingerprint>` (one hash tag); NATS buckets `<prefix>-lease` and `<prefix>-state` (with NATS the prefix must be letters, digits, `_` or `-`: other characters are refused, never folded)",
    },
    Setting {
        name: "FIREKEEPER_LEGACY_CURSOR_PREFIX",
        default: "",
        shown: Some("none"),
        kind: Kind::Text,
        help: "migrate legacy `<prefix>:<host>` cursors (root relay URLs only)",
    },
    Setting {
        name: "FIREKEEPER_LEASE_TTL_MS",
        default: "10000",
        shown: None,
        kind: Kind::Millis,
        help: "lease key ttl",
    },
    Setting {
        name: "FIREKEEPER_LEASE_RENEW_MS",
        default: "2000",
        shown: None,
        kind: Kind::Millis,
        help: "renewal interval",
    },
    Setting {
        name: "FIREKEEPER_LEASE_OP_TIMEOUT_MS",
        default: "1000",
        shown: None,
        kind: Kind::Millis,
        help: "hard timeout of every Redis call",
    },
    Setting {
        name: "FIREKEEPER_LEASE_MARGIN_MS",
        default: "2500",
        shown: None,
        kind: Kind::Millis,
        help: "the leader stops acting this long before the key could expire",
    },
    Setting {
        name: "FIREKEEPER_LEASE_POLL_MS",
        default: "1000",
        shown: None,
        kind: Kind::Millis,
        help: "standby poll (±20 % jitter); standbys also wake on release",
    },
    Setting {
        name: "FIREKEEPER_COMMIT_INTERVAL_MS",
        default: "1000",
        shown: None,
        kind: Kind::Millis,
        help: "how often the processed watermark is committed",
    },
    Setting {
        name: "FIREKEEPER_DRAIN_BUDGET_MS",
        default: "10000",
        shown: None,
        kind: Kind::Millis,
        help: "step-down drain budget",
    },
    Setting {
        name: "FIREKEEPER_HTTP_ADDR",
        default: "127.0.0.1:9090",
        shown: None,
        kind: Kind::Text,
        help: "`/healthz`, `/readyz`, `/metrics`, `/status`; `off` disables",
    },
    Setting {
        name: "FIREKEEPER_LANES",
        default: "4",
        shown: None,
        kind: Kind::Count(256),
        help: "processing lanes; one repo's events always share a lane (order per repo)",
    },
    Setting {
        name: "FIREKEEPER_QUEUE_DEPTH",
        default: "1024",
        shown: None,
        kind: Kind::Count(1 << 20),
        help: "events queued per lane before the socket is pushed back on",
    },
    Setting {
        name: "FIREKEEPER_CONNECT_TIMEOUT_MS",
        default: "10000",
        shown: None,
        kind: Kind::Millis,
        help: "relay handshake budget",
    },
    Setting {
        name: "FIREKEEPER_STALL_TIMEOUT_MS",
        default: "60000",
        shown: None,
        kind: Kind::Millis,
        help: "reconnect when no data frame arrives for this long",
    },
    Setting {
        name: "FIREKEEPER_FAILOVER_AFTER",
        default: "3",
        shown: None,
        kind: Kind::Count(1000),
        help: "consecutive failed connections before switching relays",
    },
    Setting {
        name: "FIREKEEPER_PROBE_INTERVAL_MS",
        default: "30000",
        shown: None,
        kind: Kind::Millis,
        help: "while on the secondary, how often the primary is probed for failback",
    },
    Setting {
        name: "FIREKEEPER_FUTURE_CURSOR",
        default: "fail",
        shown: None,
        kind: Kind::Choice(&["fail", "live"]),
        help: "on `FutureCursor`: `fail` (stop, an operator looks) or `live` (accept the gap: the stored cursor is rewound, fenced, to just before the first live seq; logged with the range and counted in `firekeeper_gaps_total`)",
    },
    Setting {
        name: "FIREKEEPER_SWITCH_OVERLAP_MS",
        default: "30000",
        shown: None,
        kind: Kind::Millis,
        help: "on a relay switch, resume this far (relay time) before the committed position and drop what was already handed over: `#commit`/`#sync` whose rev is not newer than the repo's last delivered, `#identity`/`#account` with the same (did, time); counted in `firekeeper_switch_duplicates_dropped_total`",
    },
    Setting {
        name: "FIREKEEPER_SWITCH_MAX_PROBES",
        default: "40",
        shown: None,
        kind: Kind::Count(1000),
        help: "at most this many `cursor=` probes (each bounded by the connect timeout) to find the start on the relay switched to; counted in `firekeeper_switch_probes_total`",
    },
    Setting {
        name: "FIREKEEPER_GAP",
        default: "fail",
        shown: None,
        kind: Kind::Choice(&["fail", "live"]),
        help: "when the relay switched to does not serve events back to where the other stopped: `fail` (refuse the switch: stay leader, keep retrying the relay that has the events, re-probe the other every `FIREKEEPER_PROBE_INTERVAL_MS`, not ready on `/readyz`, the missing range in `/status` as `refused_switch`, counted in `firekeeper_switch_refused_total`; nothing exits) or `live` (start at its oldest event; logged, counted in `firekeeper_gaps_total{reason=\"switch\"}`, shown as `last_gap` in `/status`)",
    },
    Setting {
        name: "FIREKEEPER_SWITCH_SKEW_MS",
        default: "5000",
        shown: None,
        kind: Kind::Millis,
        help: "how far PDS clocks are trusted on a switch: event times ahead of this process's clock by more are clamped, and a relay whose oldest events are older than the committed position less this has no gap (a shorter overlap, counted in `firekeeper_switch_overlap_short_total`)",
    },
    Setting {
        name: "FIREKEEPER_CHAIN_BREAKS",
        default: "count",
        shown: None,
        kind: Kind::Choice(&["count", "emit", "off"]),
        help: "per-repo chain check (sync 1.1): a `#commit` whose `since` is not the last rev seen for its repo means the relay skipped a commit of it; `count` (log it, `firekeeper_repo_chain_breaks_total`), `emit` (also hand the sink a `#chain-break` event naming the repo and the revs, just before that commit, so downstream can resync the repo) or `off`",
    },
    Setting {
        name: "FIREKEEPER_CHAIN_REPOS",
        default: "1000000",
        shown: None,
        kind: Kind::Count(100_000_000),
        help: "how many recently seen repos the chain check remembers (about 36 bytes each: 34 MiB resident for the default, measured by `make bench`)",
    },
    Setting {
        name: "FIREKEEPER_VERIFY",
        default: "off",
        shown: None,
        kind: Kind::Choice(&["off", "signatures", "full"]),
        help: "verify every `#commit` and `#sync` against its repo's key before the sink sees it: `signatures` (the signed commit: CAR root, commit CID, repo, version, low-S ECDSA), `full` (also every block's CID, every op's record, the MST inversion back to `prevData` and the repo's chain; recommended unless you trust the relay) or `off`",
    },
    Setting {
        name: "FIREKEEPER_VERIFY_STRICT",
        default: "false",
        shown: None,
        kind: Kind::Choice(&["true", "false", "1", "0", "yes", "no"]),
        help: "with `FIREKEEPER_VERIFY=full`: a commit whose MST inversion cannot complete (a block missing, no `prevData`) is `#invalid` (`mst`) instead of counted in `firekeeper_verify_unproven_total` and delivered",
    },
    Setting {
        name: "FIREKEEPER_INVALID",
        default: "mark",
        shown: None,
        kind: Kind::Choice(&["mark", "fail"]),
        help: "what an event that fails verification does: `mark` (the sink gets a `#invalid` event at its seq instead, the cursor passes it, the repo is listed as desynchronised) or `fail` (commit everything before it and stop with an error naming it)",
    },
    Setting {
        name: "FIREKEEPER_PLC_URL",
        default: "https://plc.directory",
        shown: None,
        kind: Kind::Secret,
        help: "the PLC directory `did:plc` documents are resolved from (`GET <url>/<did>`; `did:web` documents come from `https://<host>/.well-known/did.json`)",
    },
    Setting {
        name: "FIREKEEPER_DID_CACHE_SIZE",
        default: "100000",
        shown: None,
        kind: Kind::Count(100_000_000),
        help: "DIDs whose resolved key is kept in memory",
    },
    Setting {
        name: "FIREKEEPER_DID_CACHE_TTL_MS",
        default: "3600000",
        shown: None,
        kind: Kind::Millis,
        help: "how long a resolved DID document is used before it is asked for again (in the background: the old one serves meanwhile); a `#identity` event or a failed signature asks at once",
    },
    Setting {
        name: "FIREKEEPER_RESOLVE_TIMEOUT_MS",
        default: "120000",
        shown: None,
        kind: Kind::Millis,
        help: "how long an event whose DID does not resolve (directory down or failing, DID unknown) is held, retried with backoff, before it is `#invalid` with reason `unresolved`; meanwhile the cursor stays before it and its lane waits",
    },
    Setting {
        name: "FIREKEEPER_RESOLVE_CONCURRENCY",
        default: "16",
        shown: None,
        kind: Kind::Count(1024),
        help: "requests to the DID directory at a time",
    },
    Setting {
        name: "FIREKEEPER_BAD_FRAME",
        default: "fail",
        shown: None,
        kind: Kind::Choice(&["fail", "skip"]),
        help: "a frame that has a seq but cannot be decoded or rendered, or is over the frame limit: `fail` (commit what came before it, stop leading with an error naming the seq) or `skip` (count it in `firekeeper_bad_frames_total{action=\"skipped\"}` and move the cursor past it)",
    },
    Setting {
        name: "FIREKEEPER_MAX_FRAME_BYTES",
        default: "5242880",
        shown: None,
        kind: Kind::Count(1 << 30),
        help: "largest WebSocket message accepted; with `skip`, one reconnect reads an oversized frame with a raised limit (64 MiB or 4×) only to learn its seq",
    },
    Setting {
        name: "FIREKEEPER_VERIFY_BLOCKS",
        default: "false",
        shown: None,
        kind: Kind::Choice(&["true", "false", "1", "0", "yes", "no"]),
        help: "check every CAR block's sha256 against its CID",
    },
    Setting {
        name: "FIREKEEPER_INSTANCE_ID",
        default: "",
        shown: Some("random"),
        kind: Kind::Text,
        help: "this replica's id in the lease value",
    },
    Setting {
        name: "FIREKEEPER_LOG_FORMAT",
        default: "json",
        shown: None,
        kind: Kind::Choice(&["json", "text"]),
        help: "`json` or `text` (to stderr)",
    },
    Setting { name: "RUST_LOG", default: "info", shown: None, kind: Kind::External, help: "log filter" },
    Setting {
        name: "OTEL_EXPORTER_OTLP_ENDPOINT",
        default: "",
        shown: Some("none"),
        kind: Kind::External,
        help: "enables OTLP/HTTP (protobuf) traces: spans per term, relay connection and commit",
    },
    Setting {
        name: "OTEL_SERVICE_NAME",
        default: "firekeeper",
        shown: None,
        kind: Kind::External,
        help: "service name on traces",
    },
];

#[cfg(test)]
mod tests {
    use super::*;

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
        let lines = effective(&vars).join("\n");
        assert!(!lines.contains("hunter2"), "{lines}");
        assert!(lines.contains("FIREKEEPER_LANES = `8`"), "{lines}");
        assert!(lines.contains("FIREKEEPER_QUEUE_DEPTH = `1024` (default)"), "{lines}");
    }

    #[test]
    fn names_are_unique() {
        let mut names: Vec<_> = SETTINGS.iter().map(|s| s.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SETTINGS.len());
    }
}
