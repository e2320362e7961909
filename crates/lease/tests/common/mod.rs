//! What the lease's store tests share (Redis and NATS run the same scenarios): a
//! supervised node, its events and the test timings.

#![allow(dead_code)] // each test binary uses its part

use std::sync::Arc;
use std::time::{Duration, Instant};

use lease::{Backend, BootClock, LeaseConfig, LeaseEvent, LeaseHandle, Term};
use testkit::WAIT;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::timeout;

/// ttl 2 s: renew every 400 ms, op timeout 250 ms, margin 500 ms, poll 200 ms.
pub fn cfg(prefix: &str) -> LeaseConfig {
    LeaseConfig {
        poll: Duration::from_millis(200),
        key_prefix: prefix.to_owned(),
        ..LeaseConfig::from_ttl(Duration::from_secs(2))
    }
}

/// One supervised contender and the backend it uses.
pub struct Node<B: ?Sized = dyn Backend> {
    pub handle: LeaseHandle,
    pub events: UnboundedReceiver<LeaseEvent>,
    pub backend: Arc<B>,
}

/// Starts a supervisor named `name` on `backend`.
pub fn spawn<B: Backend + 'static>(backend: Arc<B>, c: LeaseConfig, name: &str) -> Node<B> {
    let (handle, events) = lease::spawn_as(backend.clone(), c, Arc::new(BootClock), name).expect("config");
    Node { handle, events, backend }
}

/// Starts a supervisor named `name` on a backend of either store.
pub fn spawn_dyn(backend: Arc<dyn Backend>, c: LeaseConfig, name: &str) -> Node {
    let (handle, events) = lease::spawn_as(backend.clone(), c, Arc::new(BootClock), name).expect("config");
    Node { handle, events, backend }
}

/// The node's next event, within [`WAIT`].
pub async fn next_event<B: ?Sized>(n: &mut Node<B>) -> LeaseEvent {
    timeout(WAIT, n.events.recv()).await.expect("an event before the deadline").expect("supervisor alive")
}

/// The node's next event, which must be an election.
pub async fn elected<B: ?Sized>(n: &mut Node<B>) -> Term {
    match next_event(n).await {
        LeaseEvent::Elected(t) => t,
        other => panic!("expected Elected, got {other:?}"),
    }
}

/// No event is waiting.
pub fn no_event<B: ?Sized>(n: &mut Node<B>) {
    if let Ok(e) = n.events.try_recv() {
        panic!("unexpected event {e:?}");
    }
}

/// After the store answered a leader whose late renewal set the key again (at `back`):
/// one of `a` and `b` is elected within 3 s, not a whole ttl later.
pub async fn someone_elected_at_once<B: ?Sized>(a: &mut Node<B>, b: &mut Node<B>, back: Instant) {
    let winner = tokio::select! {
        e = next_event(b) => ("b", e),
        e = next_event(a) => ("a", e),
    };
    let took = back.elapsed();
    assert!(matches!(winner.1, LeaseEvent::Elected(_)), "{winner:?}");
    eprintln!("{} was elected {took:?} after the store answered the old leader again", winner.0);
    assert!(took < Duration::from_secs(3), "{took:?}: the late renewal kept the key for another ttl");
}

/// The settings record beside the lease: absent at first, written, read back, replaced
/// by a later term's and never by an earlier one's (a stale leader cannot overwrite its
/// successor's settings). Run on every backend.
pub async fn the_settings_record_keeps_the_latest_terms(b: &dyn Backend) {
    assert_eq!(b.deployment().await.expect("read"), None);
    assert!(b.set_deployment(3, "collections=*\nverify=off\n").await.expect("write"));
    assert_eq!(b.deployment().await.expect("read"), Some((3, "collections=*\nverify=off\n".to_owned())));
    assert!(b.set_deployment(5, "collections=app.bsky.feed.like\n").await.expect("later"));
    assert!(!b.set_deployment(4, "collections=*\n").await.expect("earlier"), "an earlier term's is refused");
    assert_eq!(b.deployment().await.expect("read"), Some((5, "collections=app.bsky.feed.like\n".to_owned())));
    assert!(b.set_deployment(5, "collections=app.bsky.feed.post\n").await.expect("same term"));
}

/// Which store a shared scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Redis,
    Nats,
}

/// A real server of either store, started for one test, with what the shared scenarios
/// do to it: connect nodes (directly or through a proxy), kill, pause, restart or wipe
/// it ([`testkit::cluster::StoreServer`]), and read or set the lease key behind the
/// lease's back.
pub enum Server {
    Redis(testkit::RedisServer),
    Nats(testkit::NatsServer),
}

impl Server {
    /// Starts an empty server of `store` on a free port.
    pub fn start(store: Store) -> Self {
        match store {
            Store::Redis => Self::Redis(testkit::RedisServer::start()),
            Store::Nats => Self::Nats(testkit::NatsServer::start()),
        }
    }

    /// The server's address (to put a proxy before it).
    pub fn addr(&self) -> std::net::SocketAddr {
        match self {
            Self::Redis(s) => s.addr(),
            Self::Nats(s) => s.addr(),
        }
    }

    /// The URL a client uses.
    pub fn url(&self) -> String {
        match self {
            Self::Redis(s) => s.url(),
            Self::Nats(s) => s.url(),
        }
    }

    /// The URL that reaches the server through `proxy`.
    pub fn url_through(&self, proxy: &testkit::TcpProxy) -> String {
        match self {
            Self::Redis(_) => proxy.redis_url(),
            Self::Nats(_) => format!("nats://{}", proxy.addr()),
        }
    }

    /// Kill, pause, restart (Redis empty, NATS with its data) or lose everything.
    pub fn control(&mut self) -> &mut dyn testkit::cluster::StoreServer {
        match self {
            Self::Redis(s) => s,
            Self::Nats(s) => s,
        }
    }

    /// A backend on `url` (this server, or a proxy before it) for `c`'s prefix and ttl.
    pub async fn backend(&self, url: &str, c: &LeaseConfig) -> Arc<dyn Backend> {
        match self {
            Self::Redis(_) => Arc::new(lease::RedisBackend::new(url, &c.key_prefix, c.op_timeout).expect("backend")),
            Self::Nats(_) => {
                let cfg = nats_op::NatsConfig {
                    url: url.to_owned(),
                    creds_file: None,
                    ca_file: None,
                    token: None,
                    op_timeout: c.op_timeout,
                };
                let n = nats_op::Nats::connect(&cfg).await.expect("connect");
                Arc::new(lease::NatsBackend::new(&n, &c.key_prefix, c.ttl))
            }
        }
    }

    /// A supervised node named `name` on `url` with `c`.
    pub async fn node_with(&self, url: &str, c: LeaseConfig, name: &str) -> Node {
        let backend = self.backend(url, &c).await;
        spawn_dyn(backend, c, name)
    }

    /// A supervised node on this server with the test timings ([`cfg`]).
    pub async fn node(&self, prefix: &str, name: &str) -> Node {
        self.node_with(&self.url(), cfg(prefix), name).await
    }

    /// The lease key's value, read behind the lease's back.
    pub async fn key(&self, prefix: &str) -> Option<String> {
        match self {
            Self::Redis(s) => redis::cmd("GET").arg(format!("{{{prefix}}}:lease")).query(&mut s.admin()).expect("GET"),
            Self::Nats(s) => {
                let kv = Self::kv(s, prefix).await;
                kv.get("leader").await.expect("get").map(|v| String::from_utf8_lossy(&v).into_owned())
            }
        }
    }

    /// Sets the lease key to `value` (living `ttl` on Redis; NATS keys live the bucket's
    /// age), or deletes it (`None`), behind the lease's back.
    pub async fn set_key(&self, prefix: &str, value: Option<&str>, ttl: Duration) {
        match self {
            Self::Redis(s) => {
                let key = format!("{{{prefix}}}:lease");
                let mut c = s.admin();
                let _: () = match value {
                    Some(v) => redis::cmd("SET").arg(&key).arg(v).arg("PX").arg(ttl.as_millis() as u64).query(&mut c),
                    None => redis::cmd("DEL").arg(&key).query(&mut c),
                }
                .expect("redis admin");
            }
            Self::Nats(s) => {
                let kv = Self::kv(s, prefix).await;
                match value {
                    Some(v) => drop(kv.put("leader", v.to_owned().into()).await.expect("put")),
                    None => kv.purge("leader").await.expect("purge"),
                }
            }
        }
    }

    async fn kv(s: &testkit::NatsServer, prefix: &str) -> nats_op::async_nats::jetstream::kv::Store {
        let admin = s.connect(Duration::from_secs(5)).await;
        admin.jetstream().get_key_value(format!("{prefix}-lease")).await.expect("bucket")
    }
}
