//! Two relays of different seq spaces (the secondary serves the same events renumbered
//! and reinterleaved) and replicas over one directory, for the relay-switch tests. The
//! oracle keys events by (repo, rev) — (type, did, time) for identity and account — so
//! it finds any event lost or delivered twice across switches.
// Each test crate that includes this uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use checkpoint::CursorStore as _;
use consumer::{BatchCtx, Builder, Consumer, Event, GapPolicy, Handler, HandlerError, Options, async_trait};
use relay_client::{ClientConfig, Message, RelayRole, RelayUrl};
use relay_sim::{RelaySim, SimConfig};
use testkit::{WAIT, eventually};

/// What an event is, whatever relay numbered it.
pub type Key = (String, String, String);

/// The key of an event.
pub fn key(m: &Message<'_>) -> Option<Key> {
    Some(match m {
        Message::Commit(c) => ("commit".into(), c.repo.into(), c.rev.into()),
        Message::Sync(s) => ("sync".into(), s.did.into(), s.rev.into()),
        Message::Identity(i) => ("identity".into(), i.did.into(), i.time.into()),
        Message::Account(a) => ("account".into(), a.did.into(), a.time.into()),
        _ => return None,
    })
}

/// The keys of a capture, in its order.
pub fn keys(frames: &[bytes::Bytes]) -> Vec<Key> {
    frames.iter().filter_map(|f| key(relay_client::decode(f).ok()?.message()?)).collect()
}

/// One event handed over: its key, relay, seq, replica, and whether as `#invalid`.
pub type Got = (Key, RelayRole, u64, String, bool);

/// Records every event's key, shared by all replicas of a test.
#[derive(Default)]
pub struct Oracle {
    /// Every event handed over.
    pub got: Mutex<Vec<Got>>,
    /// Repos whose chain broke (`ChainBreaks::Emit`).
    pub breaks: Mutex<Vec<String>>,
}

#[async_trait]
impl Handler for Oracle {
    async fn handle(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut got = self.got.lock().expect("got");
        for e in batch {
            if let Some(k) = key(e.message()) {
                got.push((k, e.relay(), e.seq(), ctx.term.holder(), e.invalid().is_some()));
            }
            if let Some(b) = e.chain_break() {
                self.breaks.lock().expect("breaks").push(b.repo.clone());
            }
        }
        Ok(())
    }
}

impl Oracle {
    /// How many times each key was handed over as itself.
    pub fn counts(&self) -> BTreeMap<Key, usize> {
        let mut m = BTreeMap::new();
        for (k, .., invalid) in self.got.lock().expect("got").iter() {
            if !invalid {
                *m.entry(k.clone()).or_insert(0) += 1;
            }
        }
        m
    }

    /// Events handed over as `#invalid`.
    pub fn invalid(&self) -> Vec<Key> {
        self.got.lock().expect("got").iter().filter(|g| g.4).map(|g| g.0.clone()).collect()
    }

    /// Events taken from the secondary.
    pub fn taken_from_secondary(&self) -> usize {
        self.got.lock().expect("got").iter().filter(|(_, r, ..)| *r == RelayRole::Secondary).count()
    }

    /// Every expected key exactly once.
    pub fn assert_exactly_once(&self, want: &[Key]) {
        let counts = self.counts();
        let lost: Vec<_> = want.iter().filter(|k| !counts.contains_key(*k)).collect();
        let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).take(5).collect();
        assert!(
            lost.is_empty() && twice.is_empty(),
            "lost {} of {}: {:?}; delivered twice {twice:?}",
            lost.len(),
            want.len(),
            &lost[..lost.len().min(5)]
        );
        assert_eq!(counts.len(), want.len(), "nothing unexpected");
        assert_eq!(*self.breaks.lock().expect("breaks"), Vec::<String>::new(), "no repo chain broke");
    }
}

/// The fixture with skewed PDS clocks ([`testkit::skewed_fixture_frames`]).
pub fn frames() -> Vec<bytes::Bytes> {
    testkit::skewed_fixture_frames()
}

/// The secondary's copy of `frames`: its own seq space (from 1,000,001), reinterleaved
/// in blocks of 16.
pub fn secondary_copy(frames: &[bytes::Bytes]) -> Vec<bytes::Bytes> {
    relay_sim::reseq(frames, 1_000_000, 16, 7)
}

/// Two paced relays serving [`frames`]: the primary as captured, the secondary as
/// [`secondary_copy`].
pub async fn relays(rate: u32, secondary_window: Option<u64>) -> (RelaySim, RelaySim) {
    relays_with(rate, SimConfig { window_start: secondary_window, ..SimConfig::default() }).await
}

/// [`relays`] with the secondary's window set by `window`.
pub async fn relays_with(rate: u32, window: SimConfig) -> (RelaySim, RelaySim) {
    let frames = frames();
    let other = secondary_copy(&frames);
    relays_of(frames, other, rate, window).await
}

/// Two relays paced at `rate` serving `primary` and `secondary`, the secondary's window
/// set by `window`.
pub async fn relays_of(
    primary: Vec<bytes::Bytes>,
    secondary: Vec<bytes::Bytes>,
    rate: u32,
    window: SimConfig,
) -> (RelaySim, RelaySim) {
    let paced = SimConfig { initial_head: Some(0), rate: Some(rate), ..SimConfig::default() };
    let addr = "127.0.0.1:0".parse().expect("addr");
    let p = RelaySim::start_with(primary, paced.clone(), addr).await.expect("primary");
    let cfg = SimConfig { window_start: window.window_start, window_len: window.window_len, ..paced };
    let s = RelaySim::start_with(secondary, cfg, addr).await.expect("secondary");
    (p, s)
}

/// Client settings that switch quickly.
pub fn client() -> ClientConfig {
    ClientConfig {
        connect_timeout: Duration::from_secs(1),
        backoff: relay_client::backoff::BackoffConfig {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(100),
        },
        healthy_after: Duration::from_millis(100),
        failover_after: 1,
        probe_interval: Duration::from_millis(150),
        probe_successes: 2,
        probe_hold: Duration::from_millis(100),
        ..ClientConfig::default()
    }
}

/// One replica over the shared directory (lock-file lease, file cursors).
pub async fn replica(
    dir: &std::path::Path,
    primary: &RelaySim,
    secondary: &RelaySim,
    oracle: &Arc<Oracle>,
    gap: GapPolicy,
    name: &str,
) -> Consumer {
    replica_with(dir, primary, secondary, oracle.clone(), gap, name).await
}

/// [`replica`] with any handler.
pub async fn replica_with(
    dir: &std::path::Path,
    primary: &RelaySim,
    secondary: &RelaySim,
    handler: Arc<dyn Handler>,
    gap: GapPolicy,
    name: &str,
) -> Consumer {
    replica_full(dir, primary, secondary, handler, gap, name, |_| {}).await
}

/// A replica with any handler, its test options changed by `f`.
pub async fn replica_full(
    dir: &std::path::Path,
    primary: &RelaySim,
    secondary: &RelaySim,
    handler: Arc<dyn Handler>,
    gap: GapPolicy,
    name: &str,
    f: impl FnOnce(&mut Options),
) -> Consumer {
    let lock = dir.join("lease.lock");
    let store = checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store");
    let p = RelayUrl::parse(&primary.url()).expect("url");
    if matches!(store.read(p.fingerprint()).await, Ok(checkpoint::ReadOutcome::Missing)) {
        store.force(p.fingerprint(), 0).await.expect("seed");
    }
    let mut options = Options {
        commit_interval: Duration::from_millis(50),
        switch_overlap: Duration::from_secs(5),
        gap,
        chain_breaks: consumer::ChainBreaks::Emit,
        ..Options::default()
    };
    f(&mut options);
    let lease = lease::LeaseConfig {
        ttl: Duration::from_millis(1500),
        renew_every: Duration::from_millis(300),
        op_timeout: Duration::from_millis(200),
        margin: Duration::from_millis(300),
        poll: Duration::from_millis(100),
        ..lease::LeaseConfig::default()
    };
    Builder::new(p)
        .secondary(RelayUrl::parse(&secondary.url()).expect("url"))
        .client(client())
        .lease(Arc::new(lease::LocalBackend::new(&lock)), lease)
        .store(store)
        .shared_handler(handler)
        .options(options)
        .instance_id(name)
        .build()
        .expect("build")
}

/// A replica with the test options changed by `f` (gap policy `fail`).
pub async fn replica_opts(
    dir: &std::path::Path,
    primary: &RelaySim,
    secondary: &RelaySim,
    handler: Arc<dyn Handler>,
    name: &str,
    f: impl FnOnce(&mut Options),
) -> Consumer {
    replica_full(dir, primary, secondary, handler, GapPolicy::Fail, name, f).await
}

/// A running consumer: its status, its stop switch and its task.
pub type Running =
    (consumer::StatusHandle, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Result<(), consumer::Error>>);

/// Runs `c` until told to stop.
pub fn spawn(c: Consumer) -> Running {
    // The consumer's log goes to stderr, which nextest shows only for a failing test:
    // a switch that stalls under load shows where it stood.
    let _ = tracing_subscriber::fmt().with_env_filter("info").with_writer(std::io::stderr).try_init();
    let status = c.status();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(c.run(async {
        let _ = stopped.await;
    }));
    (status, stop, run)
}

/// Waits until `status` leads, connected to `role`.
pub async fn on(status: &consumer::StatusHandle, role: RelayRole, what: &str) {
    eventually(what, WAIT, async || {
        let s = status.snapshot();
        s.relay == Some(role) && s.connected && s.role == consumer::Role::Leader
    })
    .await;
}

/// The first relay `status` leads on: leading comes first, the relay once the term has
/// read where to resume.
pub async fn relay_once_leading(status: &consumer::StatusHandle) -> RelayRole {
    eventually("leading on a relay", WAIT, async || {
        let s = status.snapshot();
        s.role == consumer::Role::Leader && s.relay.is_some()
    })
    .await;
    status.snapshot().relay.expect("a relay")
}

/// Waits until `n` distinct events were handed over.
pub async fn delivered_at_least(oracle: &Oracle, n: usize) {
    eventually(&format!("{n} events delivered"), WAIT, async || oracle.counts().len() >= n).await;
}
