//! Test support shared by the integration tests of every crate.
//!
//! - [`RedisServer`]: a real `redis-server` child process on a free loopback port, which a
//!   test can kill, pause (SIGSTOP), resume and restart on the same port.
//! - [`PgServer`]: a real `PostgreSQL` server in a temporary data directory (run as the
//!   `postgres` user when the tests run as root, since `PostgreSQL` refuses root).
//! - [`TcpProxy`]: a loopback TCP proxy that can cut the link or add latency, to separate
//!   one client from a server while others still reach it.
//! - [`proc`]: the `firekeeper` binary started from a test; [`cluster`]: several of them
//!   behind proxies, with the oracle over their output; [`http`]: a GET and a request
//!   reader for test webhook receivers.
//! - [`tmpdir`], [`eventually`], [`fixture`], [`WAIT`]: the one home of the helpers every
//!   suite needs.

pub mod cluster;
pub mod faults;
pub mod fold;
pub mod http;
pub mod pds;
pub mod plc;
pub mod proc;
pub mod repo;
pub mod soak;
pub mod tamper;

use std::net::{SocketAddr, TcpListener as StdListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A port that was free a moment ago, picked below the kernel's ephemeral range
/// (32768-60999 by default): a port the kernel hands out for `:0` or for an outgoing
/// connection's local end can be taken by any test's client before the server it was
/// picked for binds it (a replica once failed to bind its HTTP port that way, and the
/// test took another process's `/status` for its own).
#[must_use]
pub fn free_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()) ^ d.as_secs());
    let mut x = (u64::from(std::process::id()) << 32) ^ now ^ NEXT.fetch_add(0x9e37_79b9, Ordering::Relaxed) | 1;
    for _ in 0..500 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = 20_000 + u16::try_from(x % 12_000).unwrap_or(0);
        if StdListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    StdListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// A file in the repository's `fixtures/` folder (the real PDS capture and its
/// reference decoding): the repository alone is enough to run every test.
#[must_use]
pub fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

/// How long any test waits for a condition before failing: generous, because the
/// machines are small and shared; tests wait on conditions, never on fixed sleeps.
pub const WAIT: std::time::Duration = std::time::Duration::from_secs(90);

/// The frames of the fixture capture `fixtures/pds-capture.frames`.
///
/// # Panics
/// When the fixture is missing or corrupt.
#[must_use]
pub fn fixture_frames() -> Vec<bytes_compat::Bytes> {
    relay_client::capture::read(&fixture("pds-capture.frames")).expect("fixtures/pds-capture.frames")
}

/// The frames of the signed capture `fixtures/signed/signed-b.frames` (959 frames, 10
/// accounts, real keys; their DID documents are served by [`plc::Plc::signed_fixture`]).
///
/// # Panics
/// When the fixture is missing or corrupt.
#[must_use]
pub fn signed_frames() -> Vec<bytes_compat::Bytes> {
    relay_client::capture::read(&fixture("signed/signed-b.frames")).expect("fixtures/signed/signed-b.frames")
}

/// The fixture as PDSs with wrong clocks send it (every relay passes a PDS's time on):
/// every tenth event 60 s late (a lagging PDS), every tenth (offset by 5) an hour fast,
/// every fiftieth an hour slow. Switch tests use it: tidy clocks hid the defects.
#[must_use]
pub fn skewed_fixture_frames() -> Vec<bytes_compat::Bytes> {
    let f = fixture_frames();
    let f = relay_sim::skew_clocks(&f, |i, _| i % 10 == 3, -60_000);
    let f = relay_sim::skew_clocks(&f, |i, _| i % 10 == 8, 3_600_000);
    relay_sim::skew_clocks(&f, |i, _| i % 50 == 21, -3_600_000)
}

/// Re-export so callers name the frame type without depending on `bytes` themselves.
pub mod bytes_compat {
    pub use relay_client::capture::Bytes;
}

/// A fresh empty directory under the system temp dir, unique per process and call.
///
/// # Panics
/// When it cannot be created.
#[must_use]
pub fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("fk-{name}-{}-{}", std::process::id(), free_port()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("tmp");
    d
}

/// Polls `f` every 20 ms until it is true, failing with `what` after `timeout`.
///
/// # Panics
/// When `f` stays false for `timeout`.
pub async fn eventually(what: &str, timeout: std::time::Duration, mut f: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + timeout;
    while !f().await {
        assert!(std::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Every `firekeeper_…` metric name in `text` (a scrape, a dashboard, the README).
#[must_use]
pub fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("firekeeper_") {
        let tail = &rest[i..];
        let end =
            tail.find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
        out.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// SIGSTOP `pid` and wait until every one of its threads is stopped. `kill` returns once
/// the signal is queued: the thread chosen to take it may wait for a CPU while another
/// thread of the process (woken by a request) still runs and answers, which made a
/// "paused" server answer a test's read on a loaded machine. Linux only (`/proc`); gives
/// up waiting after 5 s (the caller's assertions then say what went on running).
///
/// # Panics
/// When the signal cannot be sent.
pub fn sigstop(pid: u32) {
    let ok = Command::new("kill").args(["-STOP", &pid.to_string()]).status().is_ok_and(|s| s.success());
    assert!(ok, "kill -STOP {pid}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && !all_threads_stopped(pid) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What a downstream holds, by event key: how often each came, and from which relays.
pub type Held<K> = std::collections::BTreeMap<K, (usize, Vec<String>)>;

/// Every event of `want` held exactly once, and nothing else.
///
/// # Panics
/// Naming the first lost and the first repeated events and how many of each.
pub fn assert_exactly_once<K: Ord + std::fmt::Debug>(got: &Held<K>, want: &[K]) {
    let lost: Vec<_> = want.iter().filter(|k| !got.contains_key(*k)).take(5).collect();
    let twice: Vec<_> = got.iter().filter(|(_, (n, _))| *n > 1).take(5).collect();
    let lost_n = want.iter().filter(|k| !got.contains_key(*k)).count();
    let twice_n = got.values().filter(|(n, _)| *n > 1).count();
    assert!(lost.is_empty() && twice.is_empty(), "lost {lost_n} {lost:?}; twice {twice_n} {twice:?}");
    assert_eq!(got.len(), want.len(), "nothing else");
}

/// Asserts that no `getRepo` body spilled to disk (`.getrepo.*`) is left in `dir`.
///
/// # Panics
/// When one is, or `dir` cannot be read.
pub fn assert_no_spill_left(dir: &std::path::Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(".getrepo."))
        .collect();
    assert!(left.is_empty(), "spill files left: {left:?}");
}

/// Resumes a process [`sigstop`] stopped.
///
/// # Panics
/// When `kill -CONT` fails.
pub fn sigcont(pid: u32) {
    let ok = Command::new("kill").args(["-CONT", &pid.to_string()]).status().is_ok_and(|s| s.success());
    assert!(ok, "kill -CONT {pid}");
}

/// Loses a replica the way a test asks: frozen (`SIGSTOP`, resumed later with
/// [`sigcont`]) or killed (`SIGKILL`, reaped).
///
/// # Panics
/// When the signal cannot be sent.
pub fn lose(child: &mut std::process::Child, freeze: bool) {
    if freeze {
        sigstop(child.id());
    } else {
        child.kill().expect("kill");
        let _ = child.wait();
    }
}

/// True when every thread of `pid` is stopped (state `T` or `t` in its `stat`), or the
/// process is gone.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return true };
    tasks.flatten().all(|t| {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // The state follows the command name's closing parenthesis.
        stat.rsplit_once(')').is_none_or(|(_, rest)| matches!(rest.trim_start().chars().next(), Some('T' | 't')))
    })
}

/// A server's child process: what every server below signals, kills and reaps alike.
#[derive(Default)]
struct ServerProc(Option<Child>);

impl ServerProc {
    /// Sends `sig` (e.g. `-STOP`) to the process, if running.
    fn signal(&self, sig: &str, what: &str) {
        if let (Some(c), "-STOP") = (&self.0, sig) {
            sigstop(c.id());
        } else if let Some(c) = &self.0 {
            let ok = Command::new("kill").args([sig, &c.id().to_string()]).status().is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} {what}");
        }
    }

    fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// True while the child runs (false once it exited, e.g. because its port was taken).
    fn running(&mut self) -> bool {
        self.0.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A throw-away certificate authority and a server certificate it signed for `localhost`
/// and `127.0.0.1` (made with the `openssl` command), for TLS tests.
pub struct TestCa {
    /// The directory holding `ca.pem`, `server.pem` and `server.key`.
    pub dir: std::path::PathBuf,
}

impl TestCa {
    /// Generates a CA and a server certificate (P-256, valid two days).
    ///
    /// # Panics
    /// When `openssl` is missing or fails (scripts/ensure-deps.sh installs it).
    #[must_use]
    pub fn new() -> Self {
        let dir = tmpdir("ca");
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("openssl on PATH (scripts/ensure-deps.sh installs it)");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        run(&[
            &["req", "-x509"][..],
            &ec,
            &["-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=firekeeper test CA"],
            &["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ]
        .concat());
        run(&[&["req"][..], &ec, &["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]].concat());
        std::fs::write(
            dir.join("ext.cnf"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
        )
        .expect("ext");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ]);
        Self { dir }
    }

    /// The CA certificate (PEM) clients verify the server against.
    #[must_use]
    pub fn ca_file(&self) -> std::path::PathBuf {
        self.dir.join("ca.pem")
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

/// A `redis-server` child process owned by one test, in a directory of its own so that it
/// never loads a `dump.rdb` another run left behind.
pub struct RedisServer {
    port: u16,
    dir: std::path::PathBuf,
    child: ServerProc,
    extra: Vec<String>,
    persistent: bool,
}

impl RedisServer {
    /// Starts a fresh server (no persistence) on a free port and waits until it answers.
    ///
    /// # Panics
    /// When it does not start, or starts holding keys (it must be empty).
    #[must_use]
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts with extra `redis-server` arguments (e.g. `--requirepass x`).
    ///
    /// # Panics
    /// As [`RedisServer::start`].
    #[must_use]
    pub fn start_with(extra: &[&str]) -> Self {
        Self::launch(extra, false)
    }

    /// Starts with a TLS port beside the plain one (kept for set-up and checks), serving
    /// `ca`'s server certificate: [`RedisServer::tls_url`] names it.
    ///
    /// # Panics
    /// As [`RedisServer::start`], or when this `redis-server` was built without TLS.
    #[must_use]
    pub fn start_tls(ca: &TestCa) -> Self {
        let port = free_port().to_string();
        let file = |f: &str| ca.dir.join(f).to_string_lossy().into_owned();
        let (cert, key, root) = (file("server.pem"), file("server.key"), file("ca.pem"));
        Self::launch(
            &[
                "--tls-port",
                &port,
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &root,
                "--tls-auth-clients",
                "no",
            ],
            false,
        )
    }

    /// `rediss://localhost:<tls port>/` of a server started with [`RedisServer::start_tls`].
    ///
    /// # Panics
    /// When it was started without TLS.
    #[must_use]
    pub fn tls_url(&self) -> String {
        let at = self.extra.iter().position(|a| a == "--tls-port").expect("started with start_tls");
        format!("rediss://localhost:{}/", self.extra[at + 1])
    }

    /// Starts with an append-only file in its own directory: [`RedisServer::restart`] and
    /// [`RedisServer::kill`] then keep every key written before (`appendfsync always`).
    ///
    /// # Panics
    /// As [`RedisServer::start`].
    #[must_use]
    pub fn start_persistent() -> Self {
        Self::launch(&[], true)
    }

    /// Starts on `port`; `None` when another process has the port (its server answers
    /// there, and this one exits).
    ///
    /// # Panics
    /// As [`RedisServer::start`].
    #[must_use]
    pub fn start_on(port: u16) -> Option<Self> {
        Self::launch_on(port, &[], false)
    }

    fn launch(extra: &[&str], persistent: bool) -> Self {
        (0..5)
            .find_map(|_| Self::launch_on(free_port(), extra, persistent))
            .expect("redis-server exited at start 5 times (ports taken?)")
    }

    fn launch_on(port: u16, extra: &[&str], persistent: bool) -> Option<Self> {
        let mut s = Self {
            port,
            dir: tmpdir("redis"),
            child: ServerProc::default(),
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            persistent,
        };
        if !s.try_spawn() {
            return None;
        }
        if !s.extra.iter().any(|e| e == "--requirepass" || e == "--replicaof") {
            let keys: u64 = redis::cmd("DBSIZE").query(&mut s.admin()).expect("DBSIZE");
            assert_eq!(keys, 0, "a fresh test redis-server must start empty (dir {})", s.dir.display());
        }
        Some(s)
    }

    /// The directory the server keeps its files in.
    #[must_use]
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Starts the child on its port again (panics when another process has the port).
    fn spawn(&mut self) {
        assert!(self.try_spawn(), "redis-server could not take port {} again (another process has it)", self.port);
    }

    /// Starts the child and waits until *it* answers on the port (its `process_id`):
    /// another test's server that took the port first also answers there, and this
    /// child then exits (false), leaving a test to pause or kill a process that serves
    /// nobody.
    fn try_spawn(&mut self) -> bool {
        let persistence: &[&str] = if self.persistent {
            &["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        } else {
            &["--save", "", "--appendonly", "no"]
        };
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(persistence)
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (scripts/ensure-deps.sh installs it)");
        self.child = ServerProc(Some(child));
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.answers() {
                return true;
            }
            if !self.child.running() {
                self.child.kill();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not start", self.port);
    }

    /// True when the server on the port is this child (`INFO server`'s `process_id`) and
    /// has loaded its data (`PING`).
    fn answers(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
            return false;
        };
        if let Some(at) = self.extra.iter().position(|e| e == "--requirepass")
            && redis::cmd("AUTH").arg(&self.extra[at + 1]).query::<String>(&mut c).is_err()
        {
            return false;
        }
        let Ok(info) = redis::cmd("INFO").arg("server").query::<String>(&mut c) else {
            return false;
        };
        // INFO answers while the dataset is still loading; PING waits for it (a server
        // restarted on its append-only file answers LOADING until then).
        info.lines().any(|l| l.trim() == format!("process_id:{}", self.child.pid()))
            && redis::cmd("PING").query::<String>(&mut c).is_ok_and(|p| p == "PONG")
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `redis://127.0.0.1:<port>/`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A blocking admin connection (for test set-up and assertions).
    #[must_use]
    pub fn admin(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .expect("client")
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("admin connection")
    }

    /// The process id (0 when not running), to signal it from another task.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing.
    pub fn pause(&self) {
        self.child.signal("-STOP", "redis-server");
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub fn resume(&self) {
        self.child.signal("-CONT", "redis-server");
    }

    /// SIGKILL and reap: every key is gone unless started with
    /// [`RedisServer::start_persistent`].
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Starts again on the same port: empty, or with its append-only file when persistent.
    pub fn restart(&mut self) {
        self.kill();
        if !self.persistent {
            let _ = std::fs::remove_dir_all(&self.dir);
            let _ = std::fs::create_dir_all(&self.dir);
        }
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `nats-server -js` child process owned by one test, with its JetStream data in its
/// own directory (kept across [`NatsServer::restart`], gone with [`NatsServer::wipe`]).
pub struct NatsServer {
    port: u16,
    dir: std::path::PathBuf,
    child: ServerProc,
    /// Extra `nats-server` arguments (`--tls …`, `--auth …`).
    extra: Vec<String>,
}

fn nats_bin() -> std::path::PathBuf {
    ["/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| "nats-server".into())
}

impl NatsServer {
    /// Starts a fresh server with JetStream on a free port and waits until it answers.
    #[must_use]
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts with extra `nats-server` arguments (e.g. `--auth <token>`).
    #[must_use]
    pub fn start_with(extra: &[&str]) -> Self {
        (0..5)
            .find_map(|_| Self::start_on(free_port(), extra))
            .expect("nats-server exited at start 5 times (ports taken?)")
    }

    /// Starts on `port` with extra arguments; `None` when another process has the port
    /// (its server answers there, and this one exits).
    #[must_use]
    pub fn start_on(port: u16, extra: &[&str]) -> Option<Self> {
        let extra = extra.iter().map(|a| (*a).to_owned()).collect();
        let mut s = Self { port, dir: tmpdir("nats"), child: ServerProc::default(), extra };
        s.try_spawn().then_some(s)
    }

    /// Starts a server that requires TLS, serving `ca`'s server certificate (clients
    /// connect to `nats://localhost:<port>` and must trust `ca`).
    #[must_use]
    pub fn start_tls(ca: &TestCa) -> Self {
        let file = |f: &str| ca.dir.join(f).to_string_lossy().into_owned();
        Self::start_with(&["--tls", "--tlscert", &file("server.pem"), "--tlskey", &file("server.key")])
    }

    /// Starts the child on its port again (panics when another process has the port).
    fn spawn(&mut self) {
        assert!(self.try_spawn(), "nats-server could not take port {} again (another process has it)", self.port);
    }

    /// Starts the child and waits until *it* answers on the port: the server is named
    /// after its own directory and the `INFO` line must carry that name, because another
    /// test's server that took the port first also answers there, and this child then
    /// exits (false), leaving a test to pause or kill a process that serves nobody.
    fn try_spawn(&mut self) -> bool {
        let child = Command::new(nats_bin())
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string(), "-n", &self.name(), "-sd"])
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server (scripts/ensure-deps.sh installs it)");
        self.child = ServerProc(Some(child));
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.answers() {
                return true;
            }
            if !self.child.running() {
                self.child.kill();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("nats-server on port {} did not start", self.port);
    }

    /// The server's name: unique per server, so its `INFO` line tells it from another.
    fn name(&self) -> String {
        self.dir.file_name().map_or_else(|| format!("fk-nats-{}", self.port), |n| n.to_string_lossy().into_owned())
    }

    /// True when this server (by name) sends its `INFO` line and JetStream is enabled.
    fn answers(&self) -> bool {
        use std::io::Read as _;
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).unwrap_or(0);
        let info = String::from_utf8_lossy(&buf[..n]);
        info.starts_with("INFO")
            && info.contains("\"jetstream\":true")
            && info.contains(&format!("\"server_name\":\"{}\"", self.name()))
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The socket address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `nats://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A connection to this server (no credentials) bounded by `op_timeout`.
    ///
    /// # Panics
    /// When the settings are refused (they cannot be: no credentials file).
    pub async fn connect(&self, op_timeout: Duration) -> nats_op::Nats {
        let cfg = nats_op::NatsConfig { url: self.url(), creds_file: None, ca_file: None, token: None, op_timeout };
        nats_op::Nats::connect(&cfg).await.expect("connect")
    }

    /// The process id (0 when not running).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing.
    pub fn pause(&self) {
        self.child.signal("-STOP", "nats-server");
    }

    /// SIGCONT after [`NatsServer::pause`].
    pub fn resume(&self) {
        self.child.signal("-CONT", "nats-server");
    }

    /// SIGKILL and reap (the JetStream data stays on disk).
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Starts again on the same port with the same data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Starts again on the same port with no data: every bucket and stream is gone.
    pub fn wipe(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::create_dir_all(&self.dir);
        self.spawn();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How a [`TcpProxy`] treats the bytes of open connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Flow {
    /// Forward both ways.
    Pass = 0,
    /// Forward nothing either way and keep every connection open, as a peer whose host
    /// vanished without a reset (half-open TCP, a partition with no RST).
    Blackhole = 1,
    /// Forward requests, drop replies: commands are applied and their answers lost.
    DropReplies = 2,
}

/// A TCP proxy on a free loopback port in front of `target`.
pub struct TcpProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    latency_ms: Arc<AtomicU64>,
    flow: Arc<AtomicU64>,
    target: Arc<std::sync::Mutex<SocketAddr>>,
    generation: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Starts proxying to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let cut = Arc::new(AtomicBool::new(false));
        let latency_ms = Arc::new(AtomicU64::new(0));
        let flow = Arc::new(AtomicU64::new(Flow::Pass as u64));
        let generation = watch::Sender::new(0u64);
        let target = Arc::new(std::sync::Mutex::new(target));
        let (c, l, g, fl, tg) = (cut.clone(), latency_ms.clone(), generation.clone(), flow.clone(), target.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if c.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let (l, fl, mut gen_rx) = (l.clone(), fl.clone(), g.subscribe());
                let target = *tg.lock().expect("target");
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let up = pump(&mut ri, &mut wo, l.clone(), fl.clone(), false);
                    let down = pump(&mut ro, &mut wi, l, fl, true);
                    tokio::select! {
                        () = async { tokio::join!(up, down); } => {}
                        _ = gen_rx.changed() => {}
                    }
                });
            }
        });
        Self { addr, cut, latency_ms, flow, target, generation, task }
    }

    /// The address clients should use.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://<proxy>/`.
    #[must_use]
    pub fn redis_url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Cuts every open connection and refuses new ones (true), or lets them through again.
    pub fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
        if cut {
            self.generation.send_modify(|g| *g += 1);
        }
    }

    /// Sends new connections to `target` and drops the open ones (a failover of the
    /// server behind a stable address).
    pub fn set_target(&self, target: SocketAddr) {
        *self.target.lock().expect("target") = target;
        self.generation.send_modify(|g| *g += 1);
    }

    /// Sets how bytes of open (and new) connections flow.
    pub fn set_flow(&self, flow: Flow) {
        self.flow.store(flow as u64, Ordering::SeqCst);
    }

    /// Delays every chunk in both directions by this much.
    pub fn set_latency(&self, d: Duration) {
        self.latency_ms.store(d.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.generation.send_modify(|g| *g += 1);
    }
}

async fn pump(
    r: &mut (impl AsyncReadExt + Unpin),
    w: &mut (impl AsyncWriteExt + Unpin),
    latency: Arc<AtomicU64>,
    flow: Arc<AtomicU64>,
    reply: bool,
) {
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let ms = latency.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let f = flow.load(Ordering::SeqCst);
        if f == Flow::Blackhole as u64 || (reply && f == Flow::DropReplies as u64) {
            continue;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A `PostgreSQL` server owned by one test (binary), in its own data directory.
pub struct PgServer {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

fn pg_bin(name: &str) -> std::path::PathBuf {
    let mut dirs: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.path().join("bin").join(name)).filter(|p| p.exists()).collect())
        .unwrap_or_default();
    dirs.sort();
    dirs.pop().unwrap_or_else(|| name.into())
}

/// uid and gid of the `postgres` user, when we are root (`PostgreSQL` refuses to run as root).
fn postgres_ids() -> Option<(u32, u32)> {
    let me = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&me.stdout).trim() != "0" {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&"postgres")).then(|| Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?))).flatten()
    })
}

fn as_postgres(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = postgres_ids() {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

impl PgServer {
    /// initdb + start on a free port; waits until it accepts connections.
    #[must_use]
    pub fn start() -> Self {
        (0..5).find_map(|_| Self::start_on(free_port())).expect("postgres exited at start 5 times (ports taken?)")
    }

    /// initdb + start on `port`; `None` when another process has the port (its server
    /// answers there, and this one exits).
    ///
    /// # Panics
    /// When initdb fails or the server does not start.
    #[must_use]
    pub fn start_on(port: u16) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("fk-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("pg dir");
        if let Some((uid, gid)) = postgres_ids() {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown pg dir");
        }
        let data = dir.join("data");
        let ok = as_postgres(&mut Command::new(pg_bin("initdb")))
            .args(["-D", &data.to_string_lossy(), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("initdb (scripts/ensure-deps.sh installs PostgreSQL)");
        assert!(ok.success(), "initdb failed");
        let mut s = Self { port, dir, child: None };
        s.try_spawn().then_some(s)
    }

    /// Starts the server on its port again (panics when another process has the port).
    fn spawn(&mut self) {
        assert!(self.try_spawn(), "postgres could not take port {} again (another process has it)", self.port);
    }

    /// Starts the server and waits until *it* is ready: its `postmaster.pid` names this
    /// child and says `ready` (another test's server that took the port first answers
    /// `pg_isready` too, and this child then exits: false).
    fn try_spawn(&mut self) -> bool {
        let data = self.dir.join("data");
        let child = as_postgres(&mut Command::new(pg_bin("postgres")))
            .args(["-D", &data.to_string_lossy(), "-p", &self.port.to_string(), "-k", &self.dir.to_string_lossy()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres");
        let pid = child.id().to_string();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let status = std::fs::read_to_string(data.join("postmaster.pid")).unwrap_or_default();
            let lines: Vec<&str> = status.lines().map(str::trim).collect();
            let ours = lines.first() == Some(&pid.as_str()) && lines.get(7) == Some(&"ready");
            let ready = ours
                && Command::new(pg_bin("pg_isready"))
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
            if ready {
                return true;
            }
            if self.child.as_mut().is_some_and(|c| !matches!(c.try_wait(), Ok(None))) {
                self.kill();
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("postgres on port {} did not start", self.port);
    }

    /// The port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once (immediate shutdown); [`PgServer::restart`] brings it back
    /// with its data.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill").args(["-QUIT", &c.id().to_string()]).status();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
