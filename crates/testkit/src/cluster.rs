//! A cluster of real firekeeper processes for the chaos suite and the benchmarks: one
//! redis-server, a TCP proxy per replica in front of it (to cut or slow one replica's
//! link alone), relay-sim as primary (and optionally secondary) relay, and an oracle over
//! every replica's sink output.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use relay_sim::{RelaySim, SimConfig, capture};

use crate::http::http_get;
use crate::proc::firekeeper_bin;
use crate::{NatsServer, RedisServer, TcpProxy, WAIT, fixture_frames, free_port, tmpdir};

/// One firekeeper process slot (restartable).
pub struct Replica {
    /// Slot name (`r0`, `r1`…): prefixes its log and output files.
    pub name: String,
    /// The running process, if any.
    pub child: Option<Child>,
    /// Its `/status` and `/metrics` address.
    pub http: String,
    /// Its environment (the cluster's plus its own Redis proxy and HTTP address).
    pub env: HashMap<String, String>,
    /// Where its logs and jsonl outputs go.
    pub dir: PathBuf,
    /// How many times it was started (one log and one output file per start).
    pub starts: usize,
    /// The binary it runs.
    pub bin: PathBuf,
}

impl Replica {
    /// Every jsonl output file, one per start.
    #[must_use]
    pub fn out_files(&self) -> Vec<PathBuf> {
        (0..self.starts).map(|i| self.dir.join(format!("{}-{i}.jsonl", self.name))).collect()
    }

    /// Every log file, one per start.
    #[must_use]
    pub fn log_files(&self) -> Vec<PathBuf> {
        (0..self.starts).map(|i| self.dir.join(format!("{}-{i}.log", self.name))).collect()
    }

    /// Starts a new process in this slot, with a fresh log and output file.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} already running", self.name);
        let out = self.dir.join(format!("{}-{}.jsonl", self.name, self.starts));
        let log = self.dir.join(format!("{}-{}.log", self.name, self.starts));
        self.starts += 1;
        let child = Command::new(&self.bin)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(&self.env)
            .env("FIREKEEPER_JSONL_PATH", &out)
            .env("FIREKEEPER_INSTANCE_ID", format!("{}-{}", self.name, self.starts))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("firekeeper");
        self.child = Some(child);
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill").args([sig, &c.id().to_string()]).status();
        }
    }

    /// The running process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL and reap.
    pub fn sigkill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for exit; returns whether it exited 0.
    pub async fn sigterm(&mut self) -> bool {
        self.signal("-TERM");
        let Some(mut c) = self.child.take() else { return false };
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(s) = c.try_wait().expect("wait") {
                return s.success();
            }
            assert!(Instant::now() < deadline, "{} did not exit after SIGTERM", self.name);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGSTOP: a frozen process that still holds its sockets.
    pub fn sigstop(&self) {
        if let Some(pid) = self.pid() {
            crate::sigstop(pid);
        }
    }

    /// SIGCONT.
    pub fn sigcont(&self) {
        self.signal("-CONT");
    }

    /// Its `/status` as JSON; `None` when it does not answer.
    pub async fn status(&self) -> Option<serde_json::Value> {
        let (code, body) = http_get(&self.http, "/status").await?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    /// Its `/metrics` text; `None` when it does not answer.
    pub async fn metrics(&self) -> Option<String> {
        let (code, body) = http_get(&self.http, "/metrics").await?;
        (code == 200).then_some(body)
    }

    /// Peak resident set size in KiB.
    #[must_use]
    pub fn peak_rss_kib(&self) -> Option<u64> {
        self.proc_status_kib("VmHWM:")
    }

    /// Current resident set size in KiB.
    #[must_use]
    pub fn rss_kib(&self) -> Option<u64> {
        self.proc_status_kib("VmRSS:")
    }

    /// A `kB` field of `/proc/PID/status`.
    fn proc_status_kib(&self, field: &str) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        s.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.sigcont();
        self.sigkill();
    }
}

/// Settings of a cluster.
#[allow(clippy::struct_excessive_bools)] // independent switches of one test cluster
pub struct Spec {
    /// How many replicas.
    pub replicas: usize,
    /// Copies of the fixture in the relay's log.
    pub copies: usize,
    /// Relay pace in frames/s; `None` = all published at once.
    pub rate: Option<u32>,
    /// Whether a second relay-sim serves as secondary.
    pub secondary: bool,
    /// Lease ttl; renew, op timeout and margin derive from it.
    pub ttl_ms: u64,
    /// `FIREKEEPER_SINK` of every replica.
    pub sink: &'static str,
    /// More environment for every replica.
    pub extra_env: Vec<(&'static str, String)>,
    /// The binary to run; [`firekeeper_bin`] when `None` (a bench may compare versions).
    pub bin: Option<PathBuf>,
    /// The secondary serves the events in its own seq space ([`relay_sim::reseq`]): judge
    /// with [`Cluster::check_keys`], which keys events by (repo, rev), not by seq.
    pub secondary_seq_space: bool,
    /// Lease and cursors on NATS (JetStream KV) instead of Redis: the proxies stand in
    /// front of [`Cluster::nats`].
    pub nats: bool,
    /// Replay the signed capture (`fixtures/signed/`) instead of the unsigned one.
    pub signed: bool,
    /// Each copy with repos of its own ([`capture::repeat_as_new_repos`]), so per-repo
    /// state grows over a long run as it does on a real relay.
    pub new_repos: bool,
}

impl Default for Spec {
    fn default() -> Self {
        Self {
            replicas: 3,
            copies: 1,
            rate: Some(600),
            secondary: false,
            ttl_ms: 2000,
            sink: "jsonl",
            extra_env: Vec::new(),
            bin: None,
            secondary_seq_space: false,
            nats: false,
            signed: false,
            new_repos: false,
        }
    }
}

/// The seam a fault scenario drives the lease and cursor store's server through, so
/// one scenario runs on Redis and on NATS alike.
pub trait StoreServer {
    /// Which server (`redis`, `nats`), for messages.
    fn kind(&self) -> &'static str;
    /// SIGSTOP: sockets kept, nothing answered.
    fn pause(&self);
    /// SIGCONT.
    fn resume(&self);
    /// Killed (down until [`StoreServer::restart`]).
    fn kill(&mut self);
    /// Killed and started again on the same port (Redis comes back empty; NATS keeps
    /// its store).
    fn restart(&mut self);
    /// Killed and started again on the same port with no data at all (a Redis without
    /// persistence, a NATS whose volume was lost).
    fn lose_data(&mut self);
}

/// Both servers answer the seam with their own methods of the same names.
macro_rules! store_server {
    ($t:ty, $kind:literal, $lose:ident) => {
        impl StoreServer for $t {
            fn kind(&self) -> &'static str {
                $kind
            }
            fn pause(&self) {
                Self::pause(self);
            }
            fn resume(&self) {
                Self::resume(self);
            }
            fn kill(&mut self) {
                Self::kill(self);
            }
            fn restart(&mut self) {
                Self::restart(self);
            }
            fn lose_data(&mut self) {
                Self::$lose(self);
            }
        }
    };
}
store_server!(crate::RedisServer, "redis", restart);
store_server!(crate::NatsServer, "nats", wipe);

/// The primary relay's frames for a spec.
fn relay_frames(spec: &Spec) -> Vec<crate::bytes_compat::Bytes> {
    if spec.secondary {
        capture::repeat_in_time(&fixture_frames(), spec.copies)
    } else if spec.new_repos {
        capture::repeat_as_new_repos(&fixture_frames(), spec.copies)
    } else {
        capture::repeat(&if spec.signed { crate::signed_frames() } else { fixture_frames() }, spec.copies)
    }
}

/// A running cluster: dropped, it stops the watchers; each `Replica` kills its process.
pub struct Cluster {
    /// The Redis every replica's lease and cursor live on (none with `Spec::nats`: a
    /// cluster starts only the store it uses); see [`Cluster::redis`].
    redis: Option<RedisServer>,
    /// The NATS server of a `Spec::nats` cluster.
    pub nats: Option<NatsServer>,
    /// The primary relay.
    pub relay: RelaySim,
    /// The secondary relay, with `Spec::secondary`.
    pub relay2: Option<RelaySim>,
    /// One fault proxy per replica, in front of `redis` (or `nats`).
    pub proxies: Vec<TcpProxy>,
    /// The replica slots.
    pub replicas: Vec<Replica>,
    /// The directory of every log and output.
    pub dir: PathBuf,
    /// How many events (with a seq) the relay serves.
    pub total: u64,
    /// Every value of the primary's stored cursor seen, in order.
    pub cursor_history: Arc<Mutex<Vec<u64>>>,
    /// Where the cursor watcher reads (a Redis failover moves it).
    pub watch_url: Arc<Mutex<String>>,
    /// Moments two replicas both said `leader` (with different tokens).
    pub overlaps: Arc<Mutex<Vec<String>>>,
    watcher: tokio::task::JoinHandle<()>,
    roles: tokio::task::JoinHandle<()>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.watcher.abort();
        self.roles.abort();
    }
}

/// Samples every replica's `/status` every 20 ms and records any sample in which two
/// say `leader` under different tokens. The lease leaves `margin` between one term's
/// deadline and the earliest moment another can start, so even a sample that spans a
/// few milliseconds never sees a legitimate handover as an overlap.
fn watch_roles(addrs: Vec<String>, overlaps: Arc<Mutex<Vec<String>>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let mut leaders = Vec::new();
            for (i, a) in addrs.iter().enumerate() {
                if let Some((200, body)) = http_get(a, "/status").await
                    && let Ok(v) = serde_json::from_str::<serde_json::Value>(&body)
                    && v["role"] == "leader"
                {
                    leaders.push((i, v["token"].as_u64().unwrap_or(0)));
                }
            }
            if leaders.len() > 1 && leaders.windows(2).any(|w| w[0].1 != w[1].1) {
                overlaps.lock().expect("overlaps").push(format!("{leaders:?}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// The key [`Cluster::keys_seen`] files an event's JSON under.
fn event_key(e: &serde_json::Value) -> String {
    let s = |k: &str| e[k].as_str().unwrap_or("").to_owned();
    match e["type"].as_str() {
        Some("#commit") => format!("#commit {} {}", s("repo"), s("rev")),
        Some("#sync") => format!("#sync {} {}", s("did"), s("rev")),
        Some(t) => format!("{t} {} {}", s("did"), s("time")),
        None => String::new(),
    }
}

/// Every event key of the fixture (one copy: more copies repeat the same keys).
fn fixture_keys() -> std::collections::BTreeSet<String> {
    use relay_client::Message;
    fixture_frames()
        .iter()
        .filter_map(|f| match relay_client::decode(f).ok()? {
            relay_client::Frame::Message(m) => Some(match m {
                Message::Commit(c) => format!("#commit {} {}", c.repo, c.rev),
                Message::Sync(x) => format!("#sync {} {}", x.did, x.rev),
                Message::Identity(x) => format!("#identity {} {}", x.did, x.time),
                Message::Account(x) => format!("#account {} {}", x.did, x.time),
                Message::Info(_) | Message::Unknown { .. } | Message::Jet(_) => return None,
            }),
            relay_client::Frame::Error(_) => None,
        })
        .collect()
}

/// Records every value of the cursor at `key` (every 10 ms) into `history`, reading
/// from whatever Redis `url` names at the time (a Redis failover moves it).
fn watch_cursor(url: Arc<Mutex<String>>, key: String, history: Arc<Mutex<Vec<u64>>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let u = url.lock().expect("url").clone();
            let Ok(client) = redis::Client::open(u) else { return };
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                loop {
                    let v: Result<Option<u64>, _> = redis::cmd("GET").arg(&key).query_async(&mut c).await;
                    match v {
                        Ok(Some(v)) => history.lock().expect("history").push(v),
                        Ok(None) => {}
                        Err(_) => break,
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// [`watch_cursor`] for the NATS cursor store: the key `key` of the `firekeeper-state`
/// bucket, whose value starts with the cursor (`-` for none).
fn watch_nats_cursor(url: String, key: String, history: Arc<Mutex<Vec<u64>>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let cfg = nats_op::NatsConfig {
            url,
            creds_file: None,
            ca_file: None,
            token: None,
            op_timeout: Duration::from_secs(1),
        };
        let Ok(n) = nats_op::Nats::connect(&cfg).await else { return };
        loop {
            if let Ok(kv) = n.jetstream().get_key_value("firekeeper-state").await {
                while let Ok(v) = kv.get(&key).await {
                    if let Some(c) =
                        v.as_deref().and_then(|b| std::str::from_utf8(b).ok()?.split(' ').next()?.parse::<u64>().ok())
                    {
                        history.lock().expect("history").push(c);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// Stores cursor 0 for the primary (and a secondary in the same seq space), so the
/// cluster starts from the beginning of the stream. A secondary in its own seq space
/// starts with no cursor, as in a deployment: where to enter it is found by time.
fn preseed(
    spec: &Spec,
    base: &HashMap<String, String>,
    dir: &std::path::Path,
    redis: Option<&RedisServer>,
    nats: Option<&NatsServer>,
    fp: &str,
    relay2: Option<&RelaySim>,
) {
    let preseed_secondary = relay2.filter(|_| !spec.secondary_seq_space).map(|_| "secondary");
    if let Some(n) = nats {
        let bin = spec.bin.clone().unwrap_or_else(firekeeper_bin);
        for relay in std::iter::once("primary").chain(preseed_secondary) {
            let out = std::process::Command::new(&bin)
                .args(["cursor", "set", "0", "--relay", relay])
                // Only what the spec sets: the test process's own variables (its knobs
                // among them) are not the binary's settings.
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .envs(base.iter())
                .env("NATS_URL", n.url())
                .env("FIREKEEPER_DATA_DIR", dir.join("preseed"))
                .output()
                .expect("firekeeper cursor set");
            assert!(out.status.success(), "preseed: {}", String::from_utf8_lossy(&out.stderr));
        }
        return;
    }
    let mut c = redis.expect("a Redis cluster").admin();
    let _: () = redis::cmd("SET").arg(format!("{{firekeeper}}:cursor:{fp}")).arg(0).query(&mut c).expect("preseed");
    if let Some(r2) = relay2.filter(|_| preseed_secondary.is_some()) {
        let fp2 = relay_client::RelayUrl::parse(&r2.url()).expect("url").fingerprint().to_owned();
        let _: () =
            redis::cmd("SET").arg(format!("{{firekeeper}}:cursor:{fp2}")).arg(0).query(&mut c).expect("preseed");
    }
}

impl Cluster {
    /// The server the replicas' lease and cursors live on: NATS in a `Spec::nats`
    /// cluster, else Redis.
    pub fn store_server(&mut self) -> &mut dyn StoreServer {
        match self.nats.as_mut() {
            Some(n) => n,
            None => self.redis.as_mut().expect("a Redis cluster"),
        }
    }

    /// Starts the store (Redis, or NATS with `Spec::nats`), the relays and the proxies
    /// (not the replicas: see `start_all`).
    pub async fn start(name: &str, spec: Spec) -> Self {
        let dir = tmpdir(name);
        let redis = (!spec.nats).then(RedisServer::start);
        // With a secondary, relay time must keep increasing across copies (switches find
        // their place by time).
        let frames = relay_frames(&spec);
        let total = frames.iter().filter(|f| relay_sim::frame_seq(f).is_some()).count() as u64;
        let sim_cfg = SimConfig { rate: spec.rate, initial_head: spec.rate.map(|_| 0), ..SimConfig::default() };
        let relay = RelaySim::start_with(frames.clone(), sim_cfg.clone(), "127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("sim");
        let relay2 = if spec.secondary {
            // In its own seq space the secondary also holds the whole stream from the start
            // (a relay ahead of the primary): entering it at its live tail would skip
            // events, so the oracle sees whether the switch found the right place.
            let (frames, cfg) = if spec.secondary_seq_space {
                (relay_sim::reseq(&frames, 1_000_000, 16, 7), SimConfig::default())
            } else {
                (frames, sim_cfg)
            };
            Some(RelaySim::start_with(frames, cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim2"))
        } else {
            None
        };
        let ttl = spec.ttl_ms;
        let mut base: HashMap<String, String> = [
            ("FIREKEEPER_RELAY", relay.url()),
            ("FIREKEEPER_SINK", spec.sink.to_owned()),
            ("FIREKEEPER_LEASE_TTL_MS", ttl.to_string()),
            ("FIREKEEPER_LEASE_RENEW_MS", (ttl / 5).to_string()),
            ("FIREKEEPER_LEASE_OP_TIMEOUT_MS", (ttl / 8).max(100).to_string()),
            ("FIREKEEPER_LEASE_MARGIN_MS", (ttl / 4).to_string()),
            ("FIREKEEPER_LEASE_POLL_MS", "200".to_owned()),
            ("FIREKEEPER_COMMIT_INTERVAL_MS", "100".to_owned()),
            ("FIREKEEPER_DRAIN_BUDGET_MS", "5000".to_owned()),
            ("FIREKEEPER_STALL_TIMEOUT_MS", "2000".to_owned()),
            // The captures' DIDs resolve nowhere; a spec that verifies sets it in its env.
            ("FIREKEEPER_VERIFY", "off".to_owned()),
            ("RUST_LOG", "info".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        if let Some(r2) = &relay2 {
            base.insert("FIREKEEPER_RELAY_SECONDARY".into(), r2.url());
        }
        for (k, v) in &spec.extra_env {
            base.insert((*k).to_owned(), v.clone());
        }
        let nats = spec.nats.then(NatsServer::start);
        let fp = relay_client::RelayUrl::parse(&relay.url()).expect("url").fingerprint().to_owned();
        preseed(&spec, &base, &dir, redis.as_ref(), nats.as_ref(), &fp, relay2.as_ref());
        let mut proxies = Vec::new();
        let mut replicas = Vec::new();
        for i in 0..spec.replicas {
            let mut env = base.clone();
            let store = nats.as_ref().map_or_else(|| redis.as_ref().expect("redis").addr(), NatsServer::addr);
            let proxy = TcpProxy::start(store).await;
            let (var, url) = if nats.is_some() {
                ("NATS_URL", format!("nats://{}", proxy.addr()))
            } else {
                ("REDIS_URL", proxy.redis_url())
            };
            env.insert(var.into(), url);
            let http = format!("127.0.0.1:{}", free_port());
            env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
            // A disk of its own, kept across restarts of the slot (its shadow file).
            env.insert("FIREKEEPER_DATA_DIR".into(), dir.join(format!("r{i}-data")).to_string_lossy().into_owned());
            proxies.push(proxy);
            replicas.push(Replica {
                name: format!("r{i}"),
                child: None,
                http,
                env,
                dir: dir.clone(),
                starts: 0,
                bin: spec.bin.clone().unwrap_or_else(firekeeper_bin),
            });
        }
        let history = Arc::new(Mutex::new(Vec::new()));
        let watch_url = Arc::new(Mutex::new(redis.as_ref().map(RedisServer::url).unwrap_or_default()));
        let watcher = if let Some(n) = &nats {
            watch_nats_cursor(n.url(), format!("cursor.{fp}"), history.clone())
        } else {
            let (h, wu, key) = (history.clone(), watch_url.clone(), format!("{{firekeeper}}:cursor:{fp}"));
            watch_cursor(wu, key, h)
        };
        let overlaps = Arc::new(Mutex::new(Vec::new()));
        let roles = watch_roles(replicas.iter().map(|r| r.http.clone()).collect(), overlaps.clone());
        Self {
            redis,
            nats,
            relay,
            relay2,
            proxies,
            replicas,
            dir,
            total,
            cursor_history: history,
            watch_url,
            overlaps,
            watcher,
            roles,
        }
    }

    /// Starts every replica.
    pub fn start_all(&mut self) {
        for r in &mut self.replicas {
            r.start();
        }
    }

    /// The replica whose /status says leader, if exactly one does.
    pub async fn leader(&self) -> Option<(usize, u64)> {
        let mut found = Vec::new();
        for (i, r) in self.replicas.iter().enumerate() {
            if r.child.is_none() {
                continue;
            }
            if let Some(s) = r.status().await
                && s["role"] == "leader"
            {
                found.push((i, s["token"].as_u64().unwrap_or(0)));
            }
        }
        (found.len() == 1).then(|| found[0])
    }

    /// Waits for a leader other than `not`.
    pub async fn wait_leader(&self, not: Option<usize>) -> (usize, u64) {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some((i, t)) = self.leader().await
                && Some(i) != not
            {
                return (i, t);
            }
            assert!(Instant::now() < deadline, "no leader elected; logs in {}", self.dir.display());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// seq → [(replica, token)] over every output file.
    #[must_use]
    pub fn seen(&self) -> BTreeMap<u64, Vec<(usize, u64)>> {
        let mut m: BTreeMap<u64, Vec<(usize, u64)>> = BTreeMap::new();
        for (i, r) in self.replicas.iter().enumerate() {
            for f in r.out_files() {
                let Ok(text) = std::fs::read_to_string(&f) else { continue };
                for line in text.lines() {
                    // A SIGKILLed writer may leave a torn last line: it was never
                    // committed, so it is skipped here and replayed by the next leader.
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
                    m.entry(v["seq"].as_u64().expect("seq"))
                        .or_default()
                        .push((i, v["token"].as_u64().expect("token")));
                }
            }
        }
        m
    }

    /// Waits until every seq appears in some output and the stored cursor reached the last.
    pub async fn wait_complete(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            let seen = self.seen();
            // The last seqs are written before the commit that covers them (at the next
            // commit tick): wait for that commit too, as the oracle checks it.
            let committed = self.cursor_history.lock().expect("history").last().copied();
            if seen.len() as u64 == self.total && committed == Some(self.total) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {} of {} seqs arrived (stored cursor {committed:?}); first missing {:?}; logs in {}",
                seen.len(),
                self.total,
                (1..=self.total).find(|s| !seen.contains_key(s)),
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the stored cursor reached the last seq (whether or not every seq was
    /// delivered: [`Cluster::check`] then names what is missing).
    pub async fn wait_cursor_end(&self) {
        let deadline = Instant::now() + WAIT;
        while self.cursor_history.lock().expect("history").last().copied() != Some(self.total) {
            assert!(
                Instant::now() < deadline,
                "the cursor never reached {}; logs in {}",
                self.total,
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// token → the replicas whose output carries it: two live terms that shared a token
    /// and both delivered show up as a token with two replicas.
    #[must_use]
    pub fn writers_by_token(&self) -> BTreeMap<u64, std::collections::BTreeSet<usize>> {
        let mut m: BTreeMap<u64, std::collections::BTreeSet<usize>> = BTreeMap::new();
        for writers in self.seen().values() {
            for (replica, token) in writers {
                m.entry(*token).or_default().insert(*replica);
            }
        }
        m
    }

    /// The oracle. Returns the number of duplicated seqs (allowed only after crashes).
    #[allow(clippy::must_use_candidate)] // it asserts; the count is for callers that want it
    pub fn check(&self) -> usize {
        self.check_with(0)
    }

    /// The oracle, allowing the stored cursor to move back `rewinds` times (a failover
    /// to a Redis replica that lagged: replays, never a gap).
    #[allow(clippy::must_use_candidate)] // it asserts; the count is for callers that want it
    pub fn check_with(&self, rewinds: usize) -> usize {
        self.check_terms_and_cursor(rewinds);
        let seen = self.seen();
        let missing: Vec<u64> = (1..=self.total).filter(|s| !seen.contains_key(s)).take(10).collect();
        assert!(missing.is_empty(), "seqs missing: {missing:?}");
        // Within one output file tokens never go down: one process, one term at a time.
        for r in &self.replicas {
            for f in r.out_files() {
                let Ok(text) = std::fs::read_to_string(&f) else { continue };
                let toks: Vec<u64> = text
                    .lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .map(|v| v["token"].as_u64().unwrap_or(0))
                    .collect();
                assert!(toks.windows(2).all(|w| w[0] <= w[1]), "tokens went down within {}", f.display());
            }
        }
        seen.values().filter(|v| v.len() > 1).count()
    }

    /// The part of the oracle that needs no output files (for sinks that are not jsonl):
    /// never two leaders at once, the stored cursor moved back at most `rewinds` times
    /// and ends at the last seq.
    pub fn check_terms_and_cursor(&self, rewinds: usize) {
        let overlaps = self.overlaps.lock().expect("overlaps").clone();
        assert!(overlaps.is_empty(), "two replicas led at once (replica, token): {overlaps:?}");
        let history = self.cursor_history.lock().expect("history").clone();
        let back: Vec<_> = history.windows(2).filter(|w| w[0] > w[1]).collect();
        assert!(back.len() <= rewinds, "cursor regressed: {back:?}");
        assert_eq!(history.last().copied(), Some(self.total), "final cursor committed");
    }

    /// Event key → how many lines carry it, over every output file. The key is
    /// `type repo rev` for commits and syncs, `type did time` for identity and account:
    /// the same on every relay, whatever its seq.
    #[must_use]
    pub fn keys_seen(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for r in &self.replicas {
            for f in r.out_files() {
                let Ok(text) = std::fs::read_to_string(&f) else { continue };
                for line in text.lines() {
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
                    *m.entry(event_key(&v["event"])).or_insert(0) += 1;
                }
            }
        }
        m
    }

    /// Waits until every event of the stream appears in some output (by key).
    pub async fn wait_keys_complete(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            let n = self.keys_seen().len() as u64;
            if n >= self.total {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {n} of {} events arrived; logs in {}",
                self.total,
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The oracle by event key (for a cluster of one fixture copy): none missing, no
    /// two leaders at once; returns how many events were delivered more than once.
    #[allow(clippy::must_use_candidate)] // it asserts; the count is for callers that want it
    pub fn check_keys(&self) -> usize {
        let overlaps = self.overlaps.lock().expect("overlaps").clone();
        assert!(overlaps.is_empty(), "two replicas led at once (replica, token): {overlaps:?}");
        let want = fixture_keys();
        let seen = self.keys_seen();
        let missing: Vec<_> = want.iter().filter(|k| !seen.contains_key(*k)).take(5).collect();
        assert!(missing.is_empty(), "events missing: {missing:?}; logs in {}", self.dir.display());
        seen.values().filter(|n| **n > 1).count()
    }

    /// The Redis of a Redis cluster.
    ///
    /// # Panics
    /// In a `Spec::nats` cluster, which starts no Redis.
    #[must_use]
    pub fn redis(&self) -> &RedisServer {
        self.redis.as_ref().expect("a Redis cluster (Spec::nats starts no Redis)")
    }

    /// The Redis of a Redis cluster, to kill or restart it.
    ///
    /// # Panics
    /// In a `Spec::nats` cluster.
    pub fn redis_mut(&mut self) -> &mut RedisServer {
        self.redis.as_mut().expect("a Redis cluster (Spec::nats starts no Redis)")
    }

    /// The highest token any committed cursor carried: read fence-seen.
    #[must_use]
    pub fn fence_seen(&self) -> u64 {
        let mut c = self.redis().admin();
        redis::cmd("GET").arg("{firekeeper}:fence-seen").query::<Option<u64>>(&mut c).expect("get").unwrap_or(0)
    }
}

/// The timestamp (seconds) of the first JSON log line whose message matches.
pub fn log_time(files: &[PathBuf], message: &str) -> Option<f64> {
    for f in files {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            if v["fields"]["message"] == message {
                return v["timestamp"].as_str().and_then(parse_ts);
            }
        }
    }
    None
}

/// An RFC 3339 log timestamp as Unix seconds (for differences between log lines).
#[must_use]
pub fn parse_ts(s: &str) -> Option<f64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    Some(t.unix_timestamp_nanos() as f64 / 1e9)
}
