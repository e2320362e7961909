//! A handler that writes ahead ([`Handler::submit`], [`Handler::write_ahead`]): the lane
//! keeps submitting while earlier writes are not yet durable, but the cursor passes an
//! event only once its own write is, whatever order writes finish in, and a write that
//! fails after submission is submitted again, the same events.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use consumer::{BatchCtx, Event, Handler, HandlerError, Options, Pending, async_trait};
use tokio::sync::oneshot;

mod local;

const AHEAD: usize = 64;
const BATCH: usize = 16;

/// One submission: its seqs, and how the test finishes its write (`true`: durable).
type Submission = (Vec<u64>, Option<oneshot::Sender<bool>>);

/// Holds every write until the test finishes it, or finishes them at once when `open`.
#[derive(Default)]
struct Ahead {
    submissions: Mutex<Vec<Submission>>,
    open: AtomicBool,
}

impl Ahead {
    fn submitted_events(&self) -> usize {
        self.submissions.lock().unwrap().iter().map(|(s, _)| s.len()).sum()
    }

    fn seqs(&self, i: usize) -> Vec<u64> {
        self.submissions.lock().unwrap()[i].0.clone()
    }

    fn finish(&self, i: usize, durable: bool) {
        let tx = self.submissions.lock().unwrap()[i].1.take().expect("held");
        tx.send(durable).expect("the lane waits for it");
    }
}

#[async_trait]
impl Handler for Ahead {
    async fn handle(&self, _batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        unreachable!("the lane submits")
    }

    async fn submit(&self, batch: &[Event], _ctx: &BatchCtx) -> Result<Pending, HandlerError> {
        let seqs = batch.iter().map(Event::seq).collect();
        if self.open.load(Ordering::SeqCst) {
            self.submissions.lock().unwrap().push((seqs, None));
            return Ok(Box::pin(std::future::ready(Ok(()))));
        }
        let (tx, rx) = oneshot::channel();
        self.submissions.lock().unwrap().push((seqs, Some(tx)));
        Ok(Box::pin(async move {
            match rx.await {
                Ok(true) => Ok(()),
                _ => Err(HandlerError::failed("test", "not acknowledged")),
            }
        }))
    }

    fn write_ahead(&self) -> usize {
        AHEAD
    }

    fn max_batch(&self) -> usize {
        BATCH
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cursor_passes_only_durable_writes_and_a_failed_one_is_submitted_again() {
    let frames = testkit::fixture_frames();
    let last = frames.iter().filter_map(|f| relay_sim::frame_seq(f)).max().expect("seqs");
    let h = Arc::new(Ahead::default());
    let options = Options { lanes: 1, commit_interval: Duration::from_millis(20), ..Options::default() };
    let c = local::Local::start(frames, h.clone(), options, "write-ahead").await;
    let committed = || c.status.snapshot().committed.unwrap_or(0);

    // Nothing durable, yet the lane writes ahead: up to AHEAD events, then it waits.
    testkit::eventually("the lane writes ahead", testkit::WAIT, async || h.submitted_events() >= AHEAD).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = h.submitted_events();
    assert!(held < AHEAD + BATCH, "{held} events submitted with none durable: the lane must stop near {AHEAD}");
    assert_eq!(committed(), 0, "the cursor moved past writes not yet durable");

    // The second write finishes before the first: the cursor still waits for the first.
    h.finish(1, true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(committed(), 0, "the cursor passed the first write, which is not durable");

    // The first write fails after submission: the same events are submitted again.
    let first = h.seqs(0);
    let before = h.submissions.lock().unwrap().len();
    h.finish(0, false);
    testkit::eventually("the failed write submitted again", testkit::WAIT, async || {
        h.submissions.lock().unwrap()[before..].iter().any(|(s, _)| *s == first)
    })
    .await;
    assert_eq!(committed(), 0, "the cursor passed a failed write");

    // Everything becomes durable: the cursor reaches the end.
    h.open.store(true, Ordering::SeqCst);
    testkit::eventually("the cursor at the last event", testkit::WAIT, async || {
        for (_, tx) in h.submissions.lock().unwrap().iter_mut() {
            if let Some(tx) = tx.take() {
                let _ = tx.send(true);
            }
        }
        committed() == last
    })
    .await;
    c.stop().await;
}
