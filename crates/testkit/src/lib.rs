//! Test support shared by the integration tests of every crate.
//!
//! - [`RedisServer`]: a real `redis-server` child process on a free loopback port, which a
//!   test can kill, pause (SIGSTOP), resume and restart on the same port.
//! - [`TcpProxy`]: a loopback TCP proxy that can cut the link or add latency, to separate
//!   one client from a server while others still reach it.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A port that was free a moment ago.
#[must_use]
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A `redis-server` child process owned by one test.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a fresh server (no persistence) on a free port and waits until it answers.
    #[must_use]
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts with extra `redis-server` arguments (e.g. `--requirepass x`).
    #[must_use]
    pub fn start_with(extra: &[&str]) -> Self {
        let mut s = Self {
            port: free_port(),
            child: None,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--dir", &std::env::temp_dir().to_string_lossy()])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (scripts/ensure-deps.sh installs it)");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() && self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not start", self.port);
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(500)) else {
            return false;
        };
        redis::cmd("PING")
            .query::<String>(&mut c)
            .is_ok_and(|p| p == "PONG")
            || self.extra.iter().any(|e| e == "--requirepass")
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

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let ok = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} redis-server");
        }
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// SIGKILL and reap: every key is gone (no persistence).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// A TCP proxy on a free loopback port in front of `target`.
pub struct TcpProxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    latency_ms: Arc<AtomicU64>,
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
        let generation = watch::Sender::new(0u64);
        let (c, l, g) = (cut.clone(), latency_ms.clone(), generation.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if c.load(Ordering::SeqCst) {
                    drop(inbound);
                    continue;
                }
                let (l, mut gen_rx) = (l.clone(), g.subscribe());
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    let up = pump(&mut ri, &mut wo, l.clone());
                    let down = pump(&mut ro, &mut wi, l);
                    tokio::select! {
                        () = async { tokio::join!(up, down); } => {}
                        _ = gen_rx.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            cut,
            latency_ms,
            generation,
            task,
        }
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

    /// Delays every chunk in both directions by this much.
    pub fn set_latency(&self, d: Duration) {
        self.latency_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
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
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
