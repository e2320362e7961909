//! The lanes of one relay within one term: events of one repo share a lane, each lane
//! hands batches to the handler in seq order, and the watermark says how far every
//! delivered event is done.

use std::sync::Arc;
use std::time::Duration;

use checkpoint::Watermark;
use checkpoint::watermark::WatermarkError;
use relay_client::backoff::{Backoff, BackoffConfig};
use tokio::sync::mpsc;

use crate::continuity::Times;
use crate::handler::{BatchCtx, Event, Handler, HandlerError, Render, render};
use crate::metrics as m;

/// What a lane reports: the seqs of an accepted batch, or why it stopped.
pub(crate) type Done = Result<Vec<u64>, HandlerError>;

/// Retries of a failed batch: 100 ms doubling to 10 s, jittered.
const RETRY: BackoffConfig = BackoffConfig { initial: Duration::from_millis(100), max: Duration::from_secs(10) };

pub(crate) struct Pipeline {
    pub(crate) lanes: Vec<mpsc::Sender<Event>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub(crate) done: mpsc::UnboundedReceiver<Done>,
    pub(crate) watermark: Watermark,
    pub(crate) ctx: BatchCtx,
    pub(crate) committed: Option<u64>,
    /// Relay times of delivered events, for the time at each committed cursor.
    pub(crate) times: Times,
}

/// A pipeline's sizes and rendering.
pub(crate) struct Shape {
    pub(crate) lanes: usize,
    pub(crate) queue_depth: usize,
    pub(crate) render: Option<Arc<Render>>,
}

impl Pipeline {
    pub(crate) fn new(shape: &Shape, handler: &Arc<dyn Handler>, ctx: BatchCtx, start: Option<u64>) -> Self {
        let lanes_n = if handler.commits_cursor() { 1 } else { shape.lanes };
        let batch_max = handler.max_batch().max(1);
        let (done_tx, done) = mpsc::unbounded_channel();
        let mut lanes = Vec::with_capacity(lanes_n);
        let mut tasks = Vec::with_capacity(lanes_n);
        for _ in 0..lanes_n {
            let (tx, rx) = mpsc::channel(shape.queue_depth);
            lanes.push(tx);
            let lane = Lane { handler: handler.clone(), ctx: ctx.clone(), batch_max, render: shape.render.clone() };
            tasks.push(tokio::spawn(lane.run(rx, done_tx.clone())));
        }
        // Every lane holds at most `queue_depth` queued events plus the batch it is
        // writing; the window also keeps finished events behind an unfinished one.
        // Intake waits while the window is full, whatever fills it.
        let capacity = lanes_n * (shape.queue_depth + batch_max);
        Self {
            lanes,
            tasks,
            done,
            watermark: Watermark::new(start, capacity),
            ctx,
            committed: start,
            times: Times::default(),
        }
    }

    /// The lane of a repo (FNV-1a of the DID).
    pub(crate) fn lane_of(&self, did: Option<&str>) -> usize {
        let h = did.map_or(0u64, |d| {
            d.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
        });
        (h % self.lanes.len() as u64) as usize
    }

    pub(crate) fn on_done(&mut self, r: Done) -> Result<(), HandlerError> {
        for s in r? {
            self.watermark.complete(s);
        }
        metrics::gauge!(m::QUEUE_DEPTH).set(self.watermark.in_flight() as f64);
        Ok(())
    }

    /// An event that needs no handler (filtered out whole, or skipped under the bad-frame
    /// policy): done at once, so the cursor moves past it once everything before it is.
    pub(crate) fn pass(&mut self, seq: u64) -> Result<(), WatermarkError> {
        self.watermark.deliver(seq)?;
        self.watermark.complete(seq);
        Ok(())
    }

    /// Closes the lanes and waits until every delivered event is done.
    pub(crate) async fn drain(&mut self) -> Result<(), HandlerError> {
        self.lanes.clear();
        while !self.watermark.is_idle() {
            match self.done.recv().await {
                Some(r) => self.on_done(r)?,
                None => return Err(HandlerError::Failed("lanes ended with events in flight".into())),
            }
        }
        Ok(())
    }
}

impl Drop for Pipeline {
    /// A pipeline that is replaced or abandoned stops its lanes: nothing it still holds
    /// may be written after the term moved on.
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

struct Lane {
    handler: Arc<dyn Handler>,
    ctx: BatchCtx,
    batch_max: usize,
    render: Option<Arc<Render>>,
}

impl Lane {
    async fn run(self, mut rx: mpsc::Receiver<Event>, done: mpsc::UnboundedSender<Done>) {
        let mut batch = Vec::with_capacity(self.batch_max);
        while let Some(e) = rx.recv().await {
            batch.push(e);
            while batch.len() < self.batch_max {
                match rx.try_recv() {
                    Ok(e) => batch.push(e),
                    Err(_) => break,
                }
            }
            if let Some(r) = &self.render {
                render_batch(&mut batch, r);
            }
            match self.write(&batch).await {
                Ok(()) => {
                    let _ = done.send(Ok(batch.iter().map(Event::seq).collect()));
                }
                Err(e) => {
                    let _ = done.send(Err(e));
                    return;
                }
            }
            batch.clear();
        }
    }

    /// Hands one batch to the handler, retrying failures with backoff until the term ends.
    async fn write(&self, batch: &[Event]) -> Result<(), HandlerError> {
        let mut backoff = Backoff::new(RETRY);
        loop {
            match self.handler.handle(batch, &self.ctx).await {
                Ok(()) => return Ok(()),
                Err(HandlerError::Failed(e)) => {
                    metrics::counter!(m::SINK_ERRORS).increment(1);
                    let delay = backoff.next_delay();
                    tracing::warn!(error = %e, retry_ms = delay.as_millis() as u64, events = batch.len(), "sink write failed; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = self.ctx.cancel.cancelled() => return Err(HandlerError::Cancelled),
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Renders each event of the batch once, here in its lane (so lanes render in parallel).
fn render_batch(batch: &mut [Event], r: &Render) {
    for e in batch {
        let mut json = String::with_capacity(e.bytes().len() * 2);
        let written = render(e.message(), r, &mut json);
        if written.record_errors > 0 {
            metrics::counter!(m::RECORD_ERRORS).increment(written.record_errors as u64);
            tracing::warn!(
                seq = e.seq(),
                errors = written.record_errors,
                "records that could not be decoded were written as null"
            );
        }
        e.set_json(json);
    }
}
