//! A cluster of real firekeeper processes for the chaos suite and the benchmarks: one
//! redis-server, a TCP proxy per replica in front of it (to cut or slow one replica's
//! link alone), relay-sim as primary (and optionally secondary) relay, and an oracle over
//! every replica's sink output.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use relay_sim::{RelaySim, SimConfig, capture};
use testkit::{RedisServer, TcpProxy, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const WAIT: Duration = Duration::from_secs(90);

pub fn fixture() -> Vec<bytes::Bytes> {
    capture::read(&testkit::fixture("pds-capture.frames")).expect("fixture")
}

/// A relay-sim replaying the fixture: all published at once (`None`) or paced.
pub async fn sim(rate: Option<u32>) -> RelaySim {
    let cfg = SimConfig { rate, initial_head: rate.map(|_| 0), ..SimConfig::default() };
    RelaySim::start_with(fixture(), cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim")
}

/// The environment of a single firekeeper with fast lease timings.
pub fn base_env(relay: &str, dir: &Path) -> HashMap<String, String> {
    [
        ("FIREKEEPER_RELAY", relay.to_owned()),
        ("FIREKEEPER_DATA_DIR", dir.join("data").to_string_lossy().into_owned()),
        ("FIREKEEPER_HTTP_ADDR", "off".to_owned()),
        ("FIREKEEPER_LEASE_TTL_MS", "2000".to_owned()),
        ("FIREKEEPER_LEASE_RENEW_MS", "400".to_owned()),
        ("FIREKEEPER_LEASE_OP_TIMEOUT_MS", "250".to_owned()),
        ("FIREKEEPER_LEASE_MARGIN_MS", "500".to_owned()),
        ("FIREKEEPER_LEASE_POLL_MS", "200".to_owned()),
        ("FIREKEEPER_COMMIT_INTERVAL_MS", "100".to_owned()),
        ("RUST_LOG", "info".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Starts the binary with `env` only, stderr to `log`.
pub fn firekeeper(env: &HashMap<String, String>, args: &[&str], log: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_firekeeper"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("firekeeper binary")
}

/// Runs a subcommand to completion.
pub fn run_once(env: &HashMap<String, String>, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_firekeeper"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(env)
        .output()
        .expect("firekeeper binary")
}

/// Waits for `f`, failing after [`WAIT`].
pub async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGTERM, then [`wait_exit`].
pub fn sigterm_and_wait(c: Child) -> std::process::ExitStatus {
    assert!(Command::new("kill").args(["-TERM", &c.id().to_string()]).status().expect("kill").success());
    wait_exit(c)
}

/// Waits for the process to exit, failing after [`WAIT`].
pub fn wait_exit(mut c: Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(s) = c.try_wait().expect("wait") {
            return s;
        }
        assert!(Instant::now() < deadline, "firekeeper did not exit in time");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fk-{name}-{}-{}", std::process::id(), free_port()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("tmp");
    d
}

pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s =
        tokio::time::timeout(Duration::from_millis(500), tokio::net::TcpStream::connect(addr)).await.ok()?.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes()).await.ok()?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_millis(500), s.read_to_string(&mut buf)).await.ok()?.ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, buf.split_once("\r\n\r\n")?.1.to_owned()))
}

/// Reads one HTTP request from `s` and returns its body; bytes of a following request
/// stay in `pending`. `None` when the peer closed. For the test webhook receivers.
pub async fn read_request(s: &mut tokio::net::TcpStream, pending: &mut Vec<u8>) -> Option<Vec<u8>> {
    read_request_with_line(s, pending).await.map(|(_, body)| body)
}

/// [`read_request`], also returning the request line (`POST /hook HTTP/1.1`).
pub async fn read_request_with_line(s: &mut tokio::net::TcpStream, pending: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        if let Some(i) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&pending[..i]).into_owned();
            let len: usize = head
                .to_lowercase()
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").map(str::to_owned))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if pending.len() >= i + 4 + len {
                let line = head.lines().next().unwrap_or_default().to_owned();
                let body = pending[i + 4..i + 4 + len].to_vec();
                pending.drain(..i + 4 + len);
                return Some((line, body));
            }
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(k) => pending.extend_from_slice(&chunk[..k]),
        }
    }
}

/// One firekeeper process slot (restartable).
pub struct Replica {
    pub name: String,
    pub child: Option<Child>,
    pub http: String,
    pub env: HashMap<String, String>,
    pub dir: PathBuf,
    pub starts: usize,
}

impl Replica {
    pub fn out_files(&self) -> Vec<PathBuf> {
        (0..self.starts).map(|i| self.dir.join(format!("{}-{i}.jsonl", self.name))).collect()
    }

    pub fn log_files(&self) -> Vec<PathBuf> {
        (0..self.starts).map(|i| self.dir.join(format!("{}-{i}.log", self.name))).collect()
    }

    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} already running", self.name);
        let out = self.dir.join(format!("{}-{}.jsonl", self.name, self.starts));
        let log = self.dir.join(format!("{}-{}.log", self.name, self.starts));
        self.starts += 1;
        let child = Command::new(env!("CARGO_BIN_EXE_firekeeper"))
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

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

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

    pub fn sigstop(&self) {
        self.signal("-STOP");
    }

    pub fn sigcont(&self) {
        self.signal("-CONT");
    }

    pub async fn status(&self) -> Option<serde_json::Value> {
        let (code, body) = http_get(&self.http, "/status").await?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    /// Peak resident set size in KiB.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        s.lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.sigcont();
        self.sigkill();
    }
}

/// Settings of a cluster.
pub struct Spec {
    pub replicas: usize,
    /// Copies of the fixture in the relay's log.
    pub copies: usize,
    /// Relay pace in frames/s; `None` = all published at once.
    pub rate: Option<u32>,
    pub secondary: bool,
    pub ttl_ms: u64,
    pub sink: &'static str,
    pub extra_env: Vec<(&'static str, String)>,
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
        }
    }
}

pub struct Cluster {
    pub redis: RedisServer,
    pub relay: RelaySim,
    pub relay2: Option<RelaySim>,
    pub proxies: Vec<TcpProxy>,
    pub replicas: Vec<Replica>,
    pub dir: PathBuf,
    pub total: u64,
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

impl Cluster {
    pub async fn start(name: &str, spec: Spec) -> Self {
        let dir = tmpdir(name);
        let redis = RedisServer::start();
        let frames = capture::repeat(&fixture(), spec.copies);
        let total = frames.iter().filter(|f| relay_sim::frame_seq(f).is_some()).count() as u64;
        let sim_cfg = SimConfig { rate: spec.rate, initial_head: spec.rate.map(|_| 0), ..SimConfig::default() };
        let relay = RelaySim::start_with(frames.clone(), sim_cfg.clone(), "127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("sim");
        let relay2 = if spec.secondary {
            Some(RelaySim::start_with(frames, sim_cfg, "127.0.0.1:0".parse().expect("addr")).await.expect("sim2"))
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
        // Start from the beginning of the stream.
        let mut c = redis.admin();
        let fp = relay_client::RelayUrl::parse(&relay.url()).expect("url").fingerprint().to_owned();
        let _: () = redis::cmd("SET").arg(format!("{{firekeeper}}:cursor:{fp}")).arg(0).query(&mut c).expect("preseed");
        if let Some(r2) = &relay2 {
            let fp2 = relay_client::RelayUrl::parse(&r2.url()).expect("url").fingerprint().to_owned();
            let _: () =
                redis::cmd("SET").arg(format!("{{firekeeper}}:cursor:{fp2}")).arg(0).query(&mut c).expect("preseed");
        }
        let mut proxies = Vec::new();
        let mut replicas = Vec::new();
        for i in 0..spec.replicas {
            let proxy = TcpProxy::start(redis.addr()).await;
            let mut env = base.clone();
            env.insert("REDIS_URL".into(), proxy.redis_url());
            let http = format!("127.0.0.1:{}", free_port());
            env.insert("FIREKEEPER_HTTP_ADDR".into(), http.clone());
            proxies.push(proxy);
            replicas.push(Replica { name: format!("r{i}"), child: None, http, env, dir: dir.clone(), starts: 0 });
        }
        let history = Arc::new(Mutex::new(Vec::new()));
        let watch_url = Arc::new(Mutex::new(redis.url()));
        let (h, wu, key) = (history.clone(), watch_url.clone(), format!("{{firekeeper}}:cursor:{fp}"));
        let watcher = tokio::spawn(async move {
            loop {
                let url = wu.lock().expect("url").clone();
                let Ok(client) = redis::Client::open(url) else { return };
                if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                    loop {
                        let v: Result<Option<u64>, _> = redis::cmd("GET").arg(&key).query_async(&mut c).await;
                        match v {
                            Ok(Some(v)) => h.lock().expect("history").push(v),
                            Ok(None) => {}
                            Err(_) => break,
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let overlaps = Arc::new(Mutex::new(Vec::new()));
        let roles = watch_roles(replicas.iter().map(|r| r.http.clone()).collect(), overlaps.clone());
        Self {
            redis,
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

    pub async fn wait_complete(&self) {
        let deadline = Instant::now() + WAIT;
        loop {
            let seen = self.seen();
            if seen.len() as u64 == self.total {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {} of {} seqs arrived; first missing {:?}; logs in {}",
                seen.len(),
                self.total,
                (1..=self.total).find(|s| !seen.contains_key(s)),
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The oracle. Returns the number of duplicated seqs (allowed only after crashes).
    pub fn check(&self) -> usize {
        self.check_with(0)
    }

    /// The oracle, allowing the stored cursor to move back `rewinds` times (a failover
    /// to a Redis replica that lagged: replays, never a gap).
    pub fn check_with(&self, rewinds: usize) -> usize {
        let overlaps = self.overlaps.lock().expect("overlaps").clone();
        assert!(overlaps.is_empty(), "two replicas led at once (replica, token): {overlaps:?}");
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
        // A seq written under several tokens is a replay after a crash, never a stale
        // leader racing a new one: the later token's copy exists.
        let history = self.cursor_history.lock().expect("history").clone();
        let back: Vec<_> = history.windows(2).filter(|w| w[0] > w[1]).collect();
        assert!(back.len() <= rewinds, "cursor regressed: {back:?}");
        assert_eq!(history.last().copied(), Some(self.total), "final cursor committed");
        seen.values().filter(|v| v.len() > 1).count()
    }

    /// The highest token any committed cursor carried: read fence-seen.
    pub fn fence_seen(&self) -> u64 {
        let mut c = self.redis.admin();
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

/// `2026-12-02T14:27:51.530159Z` → seconds of the day (enough for differences).
pub fn parse_ts(s: &str) -> Option<f64> {
    let t = s.split('T').nth(1)?.trim_end_matches('Z');
    let mut it = t.split(':');
    let h: f64 = it.next()?.parse().ok()?;
    let m: f64 = it.next()?.parse().ok()?;
    let sec: f64 = it.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + sec)
}

pub fn path_display(p: &Path) -> String {
    p.display().to_string()
}
