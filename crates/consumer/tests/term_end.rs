//! What a handler may rely on when a term ends: nothing the term still held is handed to
//! it afterwards, even by a handler that never calls `BatchCtx::ensure_active`.

use checkpoint::CursorStore as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use consumer::{BatchCtx, Builder, Event, Handler, HandlerError, Options, async_trait};
use relay_client::RelayUrl;
use relay_sim::{RelaySim, SimConfig};
use tokio::sync::Notify;

mod local;

/// Blocks in its first batch until released; counts calls, and calls after `stopped`.
#[derive(Default)]
struct Gate {
    calls: AtomicUsize,
    after_stop: AtomicUsize,
    stopped: AtomicBool,
    release: Notify,
}

#[async_trait]
impl Handler for Gate {
    async fn handle(&self, _batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        if self.stopped.load(Ordering::SeqCst) {
            self.after_stop.fetch_add(1, Ordering::SeqCst);
        }
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            self.release.notified().await;
        }
        Ok(())
    }

    fn max_batch(&self) -> usize {
        16
    }
}

/// A drain that outlives its budget abandons the lanes: the batch in the handler is
/// dropped and the queued ones are never handed over, once `run` has returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_abandoned_drain_no_batch_reaches_the_handler() {
    let sim = RelaySim::start_with(testkit::fixture_frames(), SimConfig::default(), "127.0.0.1:0".parse().expect("a"))
        .await
        .expect("relay-sim");
    let relay = RelayUrl::parse(&sim.url()).expect("url");
    let dir = testkit::tmpdir("term-end");
    let lock = dir.join("lease.lock");
    let store = checkpoint::FileStore::new(&dir.join("cursors"), &lock).expect("store");
    store.force(relay.fingerprint(), 0).await.expect("seed");
    let gate = Arc::new(Gate::default());
    let options = Options { lanes: 1, queue_depth: 64, drain_budget: Duration::from_millis(300), ..Options::default() };
    let consumer = Builder::new(relay)
        .lease(Arc::new(lease::LocalBackend::new(&lock)), lease::LeaseConfig::default())
        .store(store)
        .shared_handler(gate.clone())
        .options(options)
        .build()
        .expect("build");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run(async {
        let _ = stopped.await;
    }));
    testkit::eventually("the first batch in the handler", testkit::WAIT, async || {
        gate.calls.load(Ordering::SeqCst) >= 1
    })
    .await;
    let _ = stop.send(());
    let _ = tokio::time::timeout(testkit::WAIT, run).await.expect("run returned after the drain budget");
    gate.stopped.store(true, Ordering::SeqCst);
    gate.release.notify_waiters();
    // Give a lane that survived the term every chance to go on.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(gate.calls.load(Ordering::SeqCst), 1, "only the blocked batch was ever handed over");
    assert_eq!(gate.after_stop.load(Ordering::SeqCst), 0, "no batch after run returned");
}

/// Counts events, one per batch: the lanes report a result for every event.
#[derive(Default)]
struct Slowish(AtomicUsize);

#[async_trait]
impl Handler for Slowish {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        self.0.fetch_add(batch.len(), Ordering::SeqCst);
        Ok(())
    }

    fn max_batch(&self) -> usize {
        1
    }
}

/// A busy stream (everything published, batches finishing all the time) still commits
/// on every tick: the commit must not starve behind the lanes' results, or a crash
/// replays the whole backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_keep_up_while_the_stream_is_busy() {
    let frames = relay_sim::capture::repeat(&testkit::fixture_frames(), 10);
    let total = frames.len();
    let h = Arc::new(Slowish::default());
    let options = Options { commit_interval: Duration::from_millis(20), ..Options::default() };
    let c = local::Local::start(frames, h.clone(), options, "busy").await;
    // Sample: did a commit land while most of the stream was still to come?
    let mut committed_mid_stream = false;
    testkit::eventually("the stream consumed", testkit::WAIT, async || {
        let done = h.0.load(Ordering::SeqCst);
        if done < total / 2 && c.status.snapshot().committed.is_some_and(|c| c > 0) {
            committed_mid_stream = true;
        }
        done >= total
    })
    .await;
    c.stop().await;
    assert!(committed_mid_stream, "no commit landed while the first half of the stream was being handled");
}

/// Takes batches of 10 until seq `fatal_at` is in one: that batch ends in a fatal error
/// (a stream the sink cannot cut back after a partial write).
struct BrokenAt {
    fatal_at: u64,
    took: std::sync::Mutex<Vec<u64>>,
}

#[async_trait]
impl Handler for BrokenAt {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        if batch.iter().any(|e| e.seq() == self.fatal_at) {
            return Err(HandlerError::fatal("test sink", "half a batch written to a pipe"));
        }
        self.took.lock().expect("took").extend(batch.iter().map(Event::seq));
        Ok(())
    }

    fn max_batch(&self) -> usize {
        10
    }
}

/// A fatal sink error stops the consumer with an error naming it, everything before the
/// failed batch committed and nothing after it (a retry would tear the output; a
/// standby's retry would too, so the process stops instead of standing by).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_sink_error_commits_what_came_before_and_stops() {
    let h = Arc::new(BrokenAt { fatal_at: 500, took: std::sync::Mutex::new(Vec::new()) });
    let options = Options { lanes: 1, commit_interval: Duration::from_millis(20), ..Options::default() };
    let c = local::Local::start(testkit::fixture_frames(), h.clone(), options, "fatal-sink").await;
    let err = tokio::time::timeout(testkit::WAIT, c.run).await.expect("stops").expect("join").expect_err("an error");
    assert!(err.to_string().contains("half a batch written to a pipe"), "{err}");
    let took = h.took.lock().expect("took").clone();
    let last = *took.last().expect("batches before it");
    assert!(last < 500 && took.len() as u64 == last, "everything before the failed batch, in order: {took:?}");
    let store_cursor = c.status.snapshot().committed.expect("committed");
    assert_eq!(store_cursor, last, "committed up to just before the failed batch");
}

/// Refuses, for its content, any batch holding seq `poison` as itself (a webhook answering
/// 400, a database refusing a value): it would every time.
struct Refuses {
    poison: u64,
    took: std::sync::Mutex<Vec<(u64, Option<String>)>>,
}

#[async_trait]
impl Handler for Refuses {
    async fn handle(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        if batch.iter().any(|e| e.seq() == self.poison && e.invalid().is_none()) {
            return Err(HandlerError::refused("test sink", "HTTP 400"));
        }
        let mut took = self.took.lock().expect("took");
        took.extend(batch.iter().map(|e| (e.seq(), e.invalid().map(|i| i.reason.as_str().to_owned()))));
        Ok(())
    }
}

/// Issue 39: one record the downstream refuses stalled the whole stream, retried for ever.
/// Now the batch is written in halves until the refused event is found; under the skip
/// policy it is handed over as `#invalid` (`unstorable`) and everything else arrives; under
/// fail the consumer stops with everything before it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_sink_refuses_is_isolated_and_handed_over_as_unstorable_or_stops() {
    for policy in [relay_client::BadFramePolicy::Skip, relay_client::BadFramePolicy::Fail] {
        let h = Arc::new(Refuses { poison: 700, took: std::sync::Mutex::new(Vec::new()) });
        let options = Options { lanes: 1, commit_interval: Duration::from_millis(20), ..Options::default() };
        let c = local::Local::start_with_client(
            testkit::fixture_frames(),
            h.clone(),
            options,
            &format!("refused-{policy:?}"),
            relay_client::ClientConfig { bad_frame: policy, ..relay_client::ClientConfig::default() },
        )
        .await;
        if policy == relay_client::BadFramePolicy::Skip {
            testkit::eventually("every event", testkit::WAIT, async || c.status.snapshot().committed >= Some(1476))
                .await;
            let took = h.took.lock().expect("took").clone();
            let mut seqs: Vec<u64> = took.iter().map(|t| t.0).collect();
            seqs.sort_unstable();
            assert_eq!(seqs, (1..=1476).collect::<Vec<u64>>(), "every event once");
            let poison = took.iter().find(|t| t.0 == 700).expect("the refused event");
            assert_eq!(poison.1.as_deref(), Some("unstorable"), "handed over as #invalid");
            assert!(took.iter().filter(|t| t.1.is_some()).count() == 1, "only it");
            c.stop().await;
        } else {
            let err =
                tokio::time::timeout(testkit::WAIT, c.run).await.expect("stops").expect("join").expect_err("stops");
            assert!(err.to_string().contains("refuses seq 700"), "{err}");
            assert_eq!(c.status.snapshot().committed, Some(699), "everything before it committed");
        }
    }
}
