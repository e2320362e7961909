//! A cursor store that takes its time (a far Redis, an fsync, Postgres under load) must
//! not stall the socket: the intake reads on while the tick's write is in flight, and
//! the writes still land one at a time, in order.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use checkpoint::{CommitOutcome, CursorStore, Fence, FileStore, ReadOutcome, StoreError, Write, WriteKind};
use consumer::{BatchCtx, Event, Handler, HandlerError, Options, async_trait};
use tokio::sync::Notify;

mod local;

/// A file store whose advances wait, while `hold` is set, until released; it records
/// the cursors it was asked to advance to and how many writes were in it at once.
struct Held {
    inner: FileStore,
    hold: AtomicBool,
    waiting: AtomicUsize,
    release: Notify,
    inside: AtomicUsize,
    most_inside: AtomicUsize,
    advances: Mutex<Vec<u64>>,
}

#[async_trait]
impl CursorStore for Held {
    fn name(&self) -> &'static str {
        "held"
    }

    async fn read(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError> {
        self.inner.read(fingerprint).await
    }

    async fn write(&self, w: Write<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError> {
        let n = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_inside.fetch_max(n, Ordering::SeqCst);
        if w.kind == WriteKind::Advance {
            self.advances.lock().expect("lock").push(w.cursor);
            if self.hold.load(Ordering::SeqCst) {
                let released = self.release.notified();
                self.waiting.fetch_add(1, Ordering::SeqCst);
                released.await;
            }
        }
        let out = self.inner.write(w, fence).await;
        self.inside.fetch_sub(1, Ordering::SeqCst);
        out
    }

    async fn read_time(&self, fingerprint: &str) -> Result<Option<i64>, StoreError> {
        self.inner.read_time(fingerprint).await
    }

    async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        self.inner.active_relay().await
    }

    async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError> {
        self.inner.force(fingerprint, cursor).await
    }
}

impl Held {
    fn release(&self) {
        self.hold.store(false, Ordering::SeqCst);
        self.release.notify_waiters();
    }

    /// Never two writes in the store at once; advances never going back; `cursor`
    /// stored under `fingerprint`.
    async fn assert_stored(&self, fingerprint: &str, cursor: u64) {
        assert_eq!(self.most_inside.load(Ordering::SeqCst), 1, "two cursor writes were in the store at once");
        let advances = self.advances.lock().expect("lock").clone();
        assert!(advances.windows(2).all(|w| w[0] <= w[1]), "advances out of order: {advances:?}");
        assert_eq!(self.inner.read(fingerprint).await.expect("read"), ReadOutcome::Found(cursor));
    }
}

/// Counts the events handed over.
#[derive(Default)]
struct Count(AtomicUsize);

#[async_trait]
impl Handler for Count {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        self.0.fetch_add(batch.len(), Ordering::SeqCst);
        Ok(())
    }
}

/// A consumer over relay-sim serving `frames` from seq 0, its store's advances held
/// from the start when `hold`.
struct Setup {
    store: Arc<Held>,
    handler: Arc<Count>,
    local: local::Local,
}

impl Setup {
    async fn start(frames: Vec<bytes::Bytes>, name: &str, hold: bool) -> Self {
        let handler = Arc::new(Count::default());
        // A small window: without reading on during the commit, intake would stop at it.
        let options = Options {
            lanes: 2,
            queue_depth: 64,
            commit_interval: std::time::Duration::from_millis(20),
            ..Options::default()
        };
        let mut wrapped = None;
        let local = local::Local::start_with_store(frames, handler.clone(), options, name, |inner| {
            let store = Arc::new(Held {
                inner,
                hold: AtomicBool::new(hold),
                waiting: AtomicUsize::new(0),
                release: Notify::new(),
                inside: AtomicUsize::new(0),
                most_inside: AtomicUsize::new(0),
                advances: Mutex::new(Vec::new()),
            });
            wrapped = Some(store.clone());
            store
        })
        .await;
        let store = wrapped.expect("the store");
        if hold {
            testkit::eventually("a commit held in the store", testkit::WAIT, async || {
                store.waiting.load(Ordering::SeqCst) >= 1
            })
            .await;
        }
        Self { store, handler, local }
    }
}

/// The first commit's write hangs in the store; the whole stream — far more than the
/// lanes and the window hold — still reaches the handler meanwhile. Once released, the
/// ticks commit again up to the last seq, never two writes at once, in increasing order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_waiting_on_the_store_does_not_stall_the_intake() {
    let frames = relay_sim::capture::repeat(&testkit::fixture_frames(), 10);
    let total = frames.len();
    let last = relay_sim::frame_seq(frames.last().expect("frames")).expect("seq");
    let s = Setup::start(frames, "slow-store", true).await;
    let held_at = s.handler.0.load(Ordering::SeqCst);
    testkit::eventually("every event handed over while the commit is held", testkit::WAIT, async || {
        s.handler.0.load(Ordering::SeqCst) >= total
    })
    .await;
    assert!(held_at < total, "the stream was over before the commit was held ({held_at} of {total}): proves nothing");
    assert_eq!(s.store.waiting.load(Ordering::SeqCst), 1, "one write at a time while the first is held");
    s.store.release();
    testkit::eventually("the last seq committed", testkit::WAIT, async || {
        s.local.status.snapshot().committed == Some(last)
    })
    .await;
    let fp = s.local.fingerprint.clone();
    s.local.stop().await;
    s.store.assert_stored(&fp, last).await;
}

/// An undecodable event stops the leader, which first commits what came before it: that
/// final commit waits for the tick's write still in the store instead of racing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_before_a_fatal_stop_waits_for_the_one_in_flight() {
    let mut frames = relay_sim::capture::repeat(&testkit::fixture_frames(), 10);
    let bad_at = frames.len() * 3 / 4;
    let before = relay_sim::frame_seq(&frames[bad_at - 1]).expect("seq");
    // Its header's `op` set to 7: undecodable, its seq still readable.
    let mut bad = frames[bad_at].to_vec();
    let at = bad.windows(3).position(|w| w == [0x62, b'o', b'p']).expect("op key");
    bad[at + 3] = 0x07;
    frames[bad_at] = bytes::Bytes::from(bad);
    let mut s = Setup::start(frames, "slow-store-fatal", true).await;
    testkit::eventually("everything before the bad frame handed over", testkit::WAIT, async || {
        s.handler.0.load(Ordering::SeqCst) >= bad_at
    })
    .await;
    // Every chance for a second write to start while the first is held.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    s.store.release();
    let out = tokio::time::timeout(testkit::WAIT, &mut s.local.run).await.expect("run returned").expect("join");
    assert!(out.is_err(), "the leader stops at the undecodable event");
    s.store.assert_stored(&s.local.fingerprint, before).await;
}

/// The store loses the committed cursor (a failover to a lagging replica, a restore from
/// a backup) after the stream went quiet: the leader writes it again without waiting for
/// another event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_the_store_lost_is_written_again_while_the_stream_is_quiet() {
    let frames = testkit::fixture_frames();
    let last = relay_sim::frame_seq(frames.last().expect("frames")).expect("seq");
    let s = Setup::start(frames, "slow-store-lost", false).await;
    testkit::eventually("the last seq committed", testkit::WAIT, async || {
        s.local.status.snapshot().committed == Some(last)
    })
    .await;
    s.store.inner.force(&s.local.fingerprint, 100).await.expect("lose it");
    testkit::eventually("the cursor written again", testkit::WAIT, async || {
        s.store.inner.read(&s.local.fingerprint).await.ok() == Some(ReadOutcome::Found(last))
    })
    .await;
    s.local.stop().await;
}
