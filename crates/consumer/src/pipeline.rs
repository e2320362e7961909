//! The lanes of one relay within one term: events of one repo share a lane, each lane
//! hands batches to the handler in seq order, and the watermark says how far every
//! delivered event is done.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use checkpoint::Watermark;
use checkpoint::watermark::WatermarkError;
use relay_client::BadFramePolicy;
use relay_client::backoff::{Backoff, BackoffConfig};
use relay_client::json::Written;
use tokio::sync::mpsc;

use crate::chain::ChainBreaks;
use crate::continuity::{Key, Memory, Times};
use crate::handler::{BatchCtx, Event, Handler, HandlerError, Pending, Render, Snapshot, SnapshotParts, render};
use crate::metrics as m;
use crate::shared::JobResult;
use crate::status::StatusHandle;
use crate::verify::{Desync, Invalid, InvalidPolicy, Verdict, Verifier};

/// What a lane reports: the seqs of an accepted batch, or why it stopped.
pub(crate) type Done = Result<Vec<u64>, LaneStop>;

/// Why a lane stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LaneStop {
    /// The handler refused (fenced, or the term ended).
    #[error(transparent)]
    Handler(HandlerError),
    /// An event failed verification under [`InvalidPolicy::Fail`]: everything before it
    /// in the lane was handed over.
    #[error("seq {} failed verification", .0.0)]
    Invalid(Box<(u64, Invalid)>),
}

/// What a lane answers once a snapshot lands: `Ok(None)` when the lane wrote it,
/// `Ok(Some(result))` with a shared job's result; `Err` says why it was not written.
pub(crate) type SnapshotDone = tokio::sync::oneshot::Sender<Result<Option<JobResult>, String>>;

/// What a snapshot's turn in a lane does.
pub(crate) enum SnapshotWork {
    /// Writes this verified snapshot beside the lane.
    Local(SnapshotParts),
    /// Publishes this job to the shared queue and waits for whichever replica claims it
    /// to write the snapshot.
    Remote(RemoteJob),
}

impl SnapshotWork {
    /// The repo's DID.
    pub(crate) fn did(&self) -> &str {
        match self {
            Self::Local(s) => s.did(),
            Self::Remote(r) => &r.did,
        }
    }
}

/// A repo-sync job for the shared queue, published at its turn in the repo's lane.
pub(crate) struct RemoteJob {
    pub(crate) queue: Arc<dyn checkpoint::JobQueue>,
    pub(crate) did: String,
    /// Unique per publish: the term's token and a counter.
    pub(crate) id: String,
    pub(crate) reason: &'static str,
    /// The newest rev (a TID value) of the repo handed over before the turn.
    pub(crate) min_rev: Option<u64>,
}

/// A snapshot handed to a lane: its turn comes once the lane has taken `after` events.
pub(crate) struct Staged {
    after: u64,
    work: SnapshotWork,
    done: SnapshotDone,
}

/// Snapshots (and shared jobs) a lane has beside it at a time; a further turn waits.
const BESIDE_MAX: usize = 64;

/// Repos whose shared job landed that a lane remembers, to drop the late events their
/// snapshot covers; past this the lane forgets them all.
const LANE_COVERED_MAX: usize = 16_384;

/// Events of the repo whose snapshot is being written that a lane holds back (in order,
/// delivered after the snapshot); past this, the lane takes nothing more until it lands.
const HOLD_MAX: usize = 4_096;

/// Events the window holds beyond the lanes' own, with repo sync: what the other repos
/// finish while a snapshot is written beside a lane (16 bytes each in the window).
const BESIDE_WINDOW: usize = 1 << 16;

/// A snapshot written beside its lane: the lane goes on with other repos' events and
/// holds back its repo's until the snapshot lands. The write is a task of its own, so it
/// goes on whatever the lane waits for (a store write that waits on the snapshot's
/// transaction, say); it is aborted with the lane.
struct Beside {
    held: VecDeque<Event>,
    /// The snapshot's write (or the shared job's wait).
    write: tokio::task::JoinHandle<Landing>,
}

/// How a snapshot beside a lane ended.
#[derive(Debug, Clone, Copy)]
struct Landing {
    /// `false` when the lane must stop (reported on `done`).
    go_on: bool,
    /// A shared job's snapshot landed at this rev (a TID value): the repo's events at or
    /// below it are covered (the local path's intake drops them itself).
    covers: Option<u64>,
}

impl Landing {
    const STOP: Self = Self { go_on: false, covers: None };

    fn written(go_on: bool) -> Self {
        Self { go_on, covers: None }
    }
}

impl Drop for Beside {
    fn drop(&mut self) {
        self.write.abort();
    }
}

/// The snapshots beside a lane, by repo (its events are looked up here one by one).
type Besides = std::collections::HashMap<String, Beside>;

/// A snapshot beside the lane landing: whose, and how; never resolves when there is none.
async fn beside_lands(bs: &mut Besides) -> (String, Landing) {
    if bs.is_empty() {
        return std::future::pending().await;
    }
    std::future::poll_fn(|cx| {
        for (did, b) in bs.iter_mut() {
            if let std::task::Poll::Ready(r) = std::pin::Pin::new(&mut b.write).poll(cx) {
                return std::task::Poll::Ready((did.clone(), r.unwrap_or(Landing::STOP)));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// A snapshot beside the lane landed: a shared job's covers its repo's events at or below
/// its rev (those held are done at once, later ones are dropped as they come); the rest
/// of the held events go back to the front of the lane, in order.
fn landed(
    did: String,
    mut b: Beside,
    covers: Option<u64>,
    covered: &mut std::collections::HashMap<String, u64>,
    carry: &mut VecDeque<Event>,
    done: &mpsc::UnboundedSender<Done>,
) {
    let mut held = std::mem::take(&mut b.held);
    if let Some(rev) = covers {
        if covered.len() >= LANE_COVERED_MAX {
            covered.clear();
        }
        covered.insert(did, rev);
        let (gone, keep): (VecDeque<Event>, VecDeque<Event>) = held.into_iter().partition(|e| is_covered(covered, e));
        held = keep;
        if !gone.is_empty() {
            metrics::counter!(m::RESYNC_COVERED).increment(gone.len() as u64);
            let _ = done.send(Ok(gone.iter().map(Event::seq).collect()));
        }
    }
    for e in held.into_iter().rev() {
        carry.push_front(e);
    }
}

/// What of a batch the lane hands over now: events a landed shared job covers are done
/// at once, events of a repo with a snapshot beside the lane are held back with it.
fn set_aside(
    batch: Vec<Event>,
    covered: &std::collections::HashMap<String, u64>,
    besides: &mut Besides,
    done: &mpsc::UnboundedSender<Done>,
) -> Vec<Event> {
    if covered.is_empty() && besides.is_empty() {
        return batch;
    }
    let mut rest = Vec::with_capacity(batch.len());
    let mut gone = Vec::new();
    for e in batch {
        if !covered.is_empty() && is_covered(covered, &e) {
            gone.push(e.seq());
        } else if let Some(b) = e.did().and_then(|d| besides.get_mut(d)) {
            b.held.push_back(e);
        } else {
            rest.push(e);
        }
    }
    if !gone.is_empty() {
        metrics::counter!(m::RESYNC_COVERED).increment(gone.len() as u64);
        let _ = done.send(Ok(gone));
    }
    rest
}

/// True when `e` is a commit or `#sync` of a repo whose shared job landed at or above
/// its rev.
fn is_covered(covered: &std::collections::HashMap<String, u64>, e: &Event) -> bool {
    let (did, rev) = match e.message() {
        relay_client::Message::Commit(c) => (c.repo, c.rev),
        relay_client::Message::Sync(s) => (s.did, s.rev),
        _ => return false,
    };
    matches!((covered.get(did), crate::chain::tid(rev)), (Some(&at), Some(r)) if r <= at)
}

/// Retries of a failed batch: 100 ms doubling to 10 s, jittered.
const RETRY: BackoffConfig = BackoffConfig { initial: Duration::from_millis(100), max: Duration::from_secs(10) };

/// Events staged for a lane are sent together once this many are staged (or when the
/// socket has nothing more ready): one channel send and at most one wake-up of the lane
/// per chunk instead of per event.
pub(crate) const CHUNK: usize = 64;

/// One stream's lanes and window: what intake delivers is staged per lane, sent to the
/// lane's task, and completed when the lane reports it done; the window's watermark is
/// what may be committed. The term drives it through its methods only.
pub(crate) struct Pipeline {
    lanes: Vec<mpsc::Sender<Vec<Event>>>,
    /// Per lane, where snapshots go (written after the events sent before them).
    snapshots: Vec<mpsc::UnboundedSender<Staged>>,
    /// Per lane, the events sent to it so far.
    sent: Vec<u64>,
    /// Per lane, events delivered to the window and not yet sent to the lane.
    staged: Vec<Vec<Event>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    done: mpsc::UnboundedReceiver<Done>,
    watermark: Watermark,
    ctx: BatchCtx,
    committed: Option<u64>,
    /// Relay times of delivered events, for the time at each committed cursor.
    times: Times,
}

/// What [`Pipeline::try_send`] did with a lane's staged events.
pub(crate) enum Sent {
    /// Sent (or nothing was staged).
    Done,
    /// The lane's queue is full: still staged, for [`Pipeline::send`] to wait for room.
    Full,
    /// The lane's task ended.
    Gone,
}

/// A pipeline's sizes and rendering.
pub(crate) struct Shape {
    pub(crate) lanes: usize,
    pub(crate) queue_depth: usize,
    pub(crate) render: Option<Arc<Render>>,
    /// Checks events in the lanes before the handler sees them.
    pub(crate) verifier: Option<Arc<Verifier>>,
    /// What a chain break does (`None`: the chain check is off).
    pub(crate) chain_breaks: Option<ChainBreaks>,
    /// Where a failing sink is shown.
    pub(crate) status: StatusHandle,
    /// Where desynchronised repos are kept (the cursor store).
    pub(crate) store: Arc<dyn checkpoint::CursorStore>,
    /// The desynchronised repos, when a verifier or repo sync marks them.
    pub(crate) desync: Option<Arc<Desync>>,
    /// Fetches desynchronised repos (repo sync on).
    pub(crate) resyncer: Option<Arc<crate::resync::Resyncer>>,
    /// What an event the sink refuses for its content does (the bad-frame policy).
    pub(crate) unstorable: BadFramePolicy,
    /// Positions repeat (Jetstream input: the ops of one commit share a stamp).
    pub(crate) ties: bool,
}

impl Shape {
    /// The lanes a pipeline for `handler` runs: one for a handler that commits the
    /// cursor in its own transaction.
    pub(crate) fn lanes_for(&self, handler: &Arc<dyn Handler>) -> usize {
        if handler.commits_cursor() { 1 } else { self.lanes.max(1) }
    }
}

/// The lane of a repo among `lanes` (FNV-1a of the DID): its events' lane, and its part
/// of the term's memory.
pub(crate) fn lane_of(did: Option<&str>, lanes: usize) -> usize {
    let h = did.map_or(0u64, atproto_data::hash::did_hash);
    (h % lanes.max(1) as u64) as usize
}

impl Pipeline {
    /// Lanes for `handler` from `start`; with a verifier, each lane records what verified
    /// in `memory`.
    pub(crate) fn new(
        shape: &Shape,
        handler: &Arc<dyn Handler>,
        ctx: BatchCtx,
        start: Option<u64>,
        memory: Option<&Arc<Memory>>,
    ) -> Self {
        let lanes_n = shape.lanes_for(handler);
        let batch_max = handler.max_batch().max(1);
        let write_ahead = handler.write_ahead();
        let (done_tx, done) = mpsc::unbounded_channel();
        let mut lanes = Vec::with_capacity(lanes_n);
        let mut snapshots = Vec::with_capacity(lanes_n);
        let mut tasks = Vec::with_capacity(lanes_n);
        for index in 0..lanes_n {
            let (tx, rx) = mpsc::channel(shape.queue_depth.div_ceil(CHUNK));
            lanes.push(tx);
            let (snap_tx, snap_rx) = mpsc::unbounded_channel();
            snapshots.push(snap_tx);
            let lane = Lane {
                index,
                handler: handler.clone(),
                ctx: ctx.clone(),
                batch_max,
                render: shape.render.clone(),
                verifier: shape.verifier.clone(),
                memory: shape.verifier.as_ref().and(memory.cloned()),
                chain: memory.cloned(),
                chain_breaks: shape.chain_breaks,
                status: shape.status.clone(),
                store: shape.store.clone(),
                desync: shape.desync.clone(),
                failures: std::sync::atomic::AtomicU32::new(0),
                unstorable: shape.unstorable,
            };
            tasks.push(tokio::spawn(Arc::new(lane).run(rx, snap_rx, done_tx.clone())));
        }
        // Every lane holds at most `queue_depth` queued events, the batch it is writing
        // and what it wrote ahead; the window also keeps finished events behind an
        // unfinished one. Intake waits while the window is full, whatever fills it.
        // With repo sync, a snapshot written beside a lane lets the others go on: the
        // window then also holds what they finish behind the snapshot's held events.
        let beside = if shape.resyncer.is_some() { BESIDE_WINDOW } else { 0 };
        let capacity = lanes_n * (shape.queue_depth.div_ceil(CHUNK) * CHUNK + CHUNK + batch_max + write_ahead) + beside;
        Self {
            staged: (0..lanes.len()).map(|_| Vec::with_capacity(CHUNK)).collect(),
            sent: vec![0; lanes.len()],
            lanes,
            snapshots,
            tasks,
            done,
            watermark: if shape.ties {
                Watermark::new(start, capacity).with_ties()
            } else {
                Watermark::new(start, capacity)
            },
            ctx,
            committed: start,
            times: Times::default(),
        }
    }

    /// The batch context the lanes write under (term token, relay, fingerprint).
    pub(crate) fn ctx(&self) -> &BatchCtx {
        &self.ctx
    }

    /// The cursor last committed on this stream (its start before any commit).
    pub(crate) fn committed(&self) -> Option<u64> {
        self.committed
    }

    /// Records `c` as committed (an operator's or a rewind's value: may go lower).
    pub(crate) fn set_committed(&mut self, c: u64) {
        self.committed = Some(c);
    }

    /// Records `c` as committed unless a higher one already is.
    pub(crate) fn raise_committed(&mut self, c: u64) {
        self.committed = Some(self.committed.map_or(c, |done| done.max(c)));
    }

    /// The highest seq before which every delivered event is done.
    pub(crate) fn committable(&self) -> Option<u64> {
        self.watermark.committable()
    }

    /// Events delivered and not yet done.
    pub(crate) fn in_flight(&self) -> usize {
        self.watermark.in_flight()
    }

    /// True while the window can take another event.
    pub(crate) fn has_room(&self) -> bool {
        self.watermark.has_room()
    }

    /// Records the relay time of the event at `seq`.
    pub(crate) fn record_time(&mut self, seq: u64, t: i64) {
        self.times.push(seq, t);
    }

    /// The relay time at the committed position, as far as known.
    pub(crate) fn time_at_cursor(&self) -> Option<i64> {
        self.times.at_cursor()
    }

    /// Carries a known time at the position into a new window.
    pub(crate) fn carry_time(&mut self, t: Option<i64>) {
        self.times.carry(t);
    }

    /// The relay time at `c`, forgetting the times before it.
    pub(crate) fn take_time_until(&mut self, c: u64) -> Option<i64> {
        self.times.take_until(c)
    }

    /// Delivers `e` (at `seq`) into the window and stages it for `lane`; true when the
    /// lane's staged chunk is full and should be sent.
    pub(crate) fn deliver(&mut self, seq: u64, lane: usize, e: Event) -> Result<bool, WatermarkError> {
        self.watermark.deliver(seq)?;
        self.staged[lane].push(e);
        Ok(self.staged[lane].len() >= CHUNK)
    }

    /// True when lane `lane` has events staged.
    pub(crate) fn has_staged_in(&self, lane: usize) -> bool {
        !self.staged[lane].is_empty()
    }

    /// Sends lane `lane`'s staged events if its queue has room now, without waiting.
    pub(crate) fn try_send(&mut self, lane: usize) -> Sent {
        if self.staged[lane].is_empty() {
            return Sent::Done;
        }
        match self.lanes[lane].try_reserve() {
            Ok(permit) => {
                let chunk = std::mem::take(&mut self.staged[lane]);
                self.sent[lane] += chunk.len() as u64;
                permit.send(chunk);
                Sent::Done
            }
            Err(mpsc::error::TrySendError::Closed(())) => Sent::Gone,
            Err(mpsc::error::TrySendError::Full(())) => Sent::Full,
        }
    }

    /// The next result a lane reports.
    pub(crate) async fn next_done(&mut self) -> Option<Done> {
        self.done.recv().await
    }

    /// A result a lane has reported already, if any.
    pub(crate) fn try_done(&mut self) -> Option<Done> {
        self.done.try_recv().ok()
    }

    /// The lane of a repo (FNV-1a of the DID).
    pub(crate) fn lane_of(&self, did: Option<&str>) -> usize {
        lane_of(did, self.staged.len())
    }

    /// How many lanes this pipeline runs.
    pub(crate) fn lane_count(&self) -> usize {
        self.staged.len()
    }

    /// Takes in a lane's result: its seqs are done.
    pub(crate) fn on_done(&mut self, r: Done) -> Result<(), LaneStop> {
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

    /// True when some lane has events staged.
    pub(crate) fn has_staged(&self) -> bool {
        self.staged.iter().any(|s| !s.is_empty())
    }

    /// Sends lane `i`'s staged events, waiting for room; `false` when the lane is gone.
    pub(crate) async fn send(&mut self, i: usize) -> bool {
        let chunk = std::mem::take(&mut self.staged[i]);
        self.sent[i] += chunk.len() as u64;
        chunk.is_empty() || self.lanes[i].send(chunk).await.is_ok()
    }

    /// Hands lane `lane` a snapshot to write after every event sent to it so far (the
    /// caller sent the lane's staged events first); `false` when the lane is gone.
    pub(crate) fn push_snapshot(&mut self, lane: usize, work: SnapshotWork, done: SnapshotDone) -> bool {
        debug_assert!(self.staged[lane].is_empty(), "staged events go before the snapshot");
        let s = Staged { after: self.sent[lane], work, done };
        self.snapshots[lane].send(s).is_ok()
    }

    /// Closes the lanes and waits until every delivered event is done.
    pub(crate) async fn drain(&mut self) -> Result<(), LaneStop> {
        for i in 0..self.lanes.len() {
            if !self.send(i).await {
                return Err(LaneStop::Handler(HandlerError::failed("lanes", "ended with events staged")));
            }
        }
        self.lanes.clear();
        while !self.watermark.is_idle() {
            match self.done.recv().await {
                Some(r) => self.on_done(r)?,
                None => {
                    return Err(LaneStop::Handler(HandlerError::failed("lanes", "ended with events in flight")));
                }
            }
        }
        Ok(())
    }

    /// Closes the lanes and takes in what each finishes before it ends (a lane that
    /// stopped at an invalid event has ended already): the watermark then stands just
    /// before the first event not handed over.
    pub(crate) async fn wind_down(&mut self) {
        self.lanes.clear();
        while let Some(r) = self.done.recv().await {
            if let Ok(seqs) = r {
                for s in seqs {
                    self.watermark.complete(s);
                }
            }
        }
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
    index: usize,
    handler: Arc<dyn Handler>,
    ctx: BatchCtx,
    batch_max: usize,
    render: Option<Arc<Render>>,
    verifier: Option<Arc<Verifier>>,
    /// With a verifier: the term's memory, which takes an event only once it verified.
    memory: Option<Arc<Memory>>,
    /// The term's memory whoever records it (intake without a verifier): a shared job's
    /// snapshot continues the repo's chain.
    chain: Option<Arc<Memory>>,
    chain_breaks: Option<ChainBreaks>,
    status: StatusHandle,
    store: Arc<dyn checkpoint::CursorStore>,
    /// The desynchronised repos whose changes the lane keeps in the store (with a
    /// verifier or repo sync).
    desync: Option<Arc<Desync>>,
    /// Failed writes in a row (for [`Handler::give_up_after`]).
    failures: std::sync::atomic::AtomicU32,
    unstorable: BadFramePolicy,
}

/// A submitted batch whose write is not yet durable.
struct InFlight {
    batch: Vec<Event>,
    /// Seqs done with it (hidden events, done without the handler) besides the batch's.
    seqs: Vec<u64>,
    pending: Pending,
}

/// A lane's writes submitted and not yet durable, and how many events they hold.
#[derive(Default)]
struct Writes {
    inflight: VecDeque<InFlight>,
    held: usize,
}

/// The next chunk: at once (empty) while events are carried over, else from the queue.
async fn recv_after(carry: &mut VecDeque<Event>, rx: &mut mpsc::Receiver<Vec<Event>>) -> Option<Vec<Event>> {
    if carry.is_empty() { rx.recv().await } else { Some(Vec::new()) }
}

/// The oldest write in flight; never resolves when there is none.
async fn oldest(q: &mut VecDeque<InFlight>) -> Result<(), HandlerError> {
    match q.front_mut() {
        Some(f) => f.pending.as_mut().await,
        None => std::future::pending().await,
    }
}

impl Lane {
    /// Takes batches off the lane's queue in order and submits them; with a handler that
    /// writes ahead, up to [`Handler::write_ahead`] events are submitted and not yet
    /// durable, and each batch is reported done once its write is.
    async fn run(
        self: Arc<Self>,
        mut rx: mpsc::Receiver<Vec<Event>>,
        mut snapshots: mpsc::UnboundedReceiver<Staged>,
        done: mpsc::UnboundedSender<Done>,
    ) {
        let ahead = self.handler.write_ahead();
        let mut w = Writes::default();
        // Events received beyond the last batch's size, first in the next.
        let mut carry: VecDeque<Event> = VecDeque::new();
        // Where events are rendered before each is copied out at its own size.
        let mut scratch = String::new();
        // Events taken into batches so far, and the snapshot waiting for its turn.
        let mut taken: u64 = 0;
        let mut staged: Option<Staged> = None;
        let mut snapshots_open = true;
        // The snapshots beside the lane, and the queue having closed.
        let mut besides = Besides::new();
        let mut closed = false;
        // Repos whose shared job landed, and the rev it covers.
        let mut covered: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        loop {
            let turn = staged.as_ref().is_some_and(|s| s.after <= taken);
            let may_start =
                staged.as_ref().is_some_and(|s| besides.len() < BESIDE_MAX && !besides.contains_key(s.work.did()));
            if turn && may_start {
                let s = staged.take().expect("a staged snapshot");
                let did = s.work.did().to_owned();
                // Everything of the repo before it is durable first.
                if w.inflight.iter().any(|f| f.batch.iter().any(|e| e.did() == Some(did.as_str()))) {
                    w.held = 0;
                    if !self.drain(&mut w.inflight, &done).await {
                        return;
                    }
                }
                self.ctx.cursor_hold.set(true);
                let (me, done) = (self.clone(), done.clone());
                let write = tokio::spawn(async move { me.beside(s, &done).await });
                besides.insert(did, Beside { held: VecDeque::new(), write });
                continue;
            }
            if closed && carry.is_empty() && besides.is_empty() {
                break;
            }
            // A turn that cannot start yet waits for a snapshot to land; so does a full hold.
            let held_full = besides.values().any(|b| b.held.len() >= HOLD_MAX);
            let room =
                (w.inflight.is_empty() || w.held < ahead) && !turn && !held_full && !(closed && carry.is_empty());
            let limit = staged.as_ref().map_or(usize::MAX, |s| usize::try_from(s.after - taken).unwrap_or(usize::MAX));
            tokio::select! {
                biased;
                r = oldest(&mut w.inflight) => {
                    let f = w.inflight.pop_front().expect("a write in flight");
                    w.held -= f.batch.len();
                    if !self.finish(f, r, &done).await {
                        return;
                    }
                }
                (did, landing) = beside_lands(&mut besides) => {
                    let b = besides.remove(&did).expect("the snapshot that landed");
                    if !landing.go_on {
                        return;
                    }
                    landed(did, b, landing.covers, &mut covered, &mut carry, &done);
                    self.ctx.cursor_hold.set(!besides.is_empty());
                }
                s = snapshots.recv(), if staged.is_none() && snapshots_open => match s {
                    Some(s) => staged = Some(s),
                    None => snapshots_open = false,
                },
                chunk = recv_after(&mut carry, &mut rx), if room => {
                    let Some(chunk) = chunk else {
                        closed = true;
                        continue;
                    };
                    carry.extend(chunk);
                    let mut batch = self.next_batch(&mut carry, &mut rx, limit);
                    taken += batch.len() as u64;
                    batch = set_aside(batch, &covered, &mut besides, &done);
                    if batch.is_empty() {
                        continue;
                    }
                    let mut seqs: Vec<u64> = Vec::new();
                    let Some(stop) = self.prepare(&mut batch, &mut seqs, &mut scratch, &done).await else { return };
                    if !self.submit_batch(batch, seqs, &mut w, &mut scratch, &done).await {
                        return;
                    }
                    if let Some(s) = stop {
                        // Everything before the invalid event is handed over first (the
                        // cursor stops before it, and before any event held back).
                        if !self.drain(&mut w.inflight, &done).await {
                            return;
                        }
                        let _ = done.send(Err(LaneStop::Invalid(Box::new(s))));
                        return;
                    }
                }
            }
        }
        // The queue closed: finish what is in flight.
        self.drain(&mut w.inflight, &done).await;
    }

    /// A snapshot's turn beside the lane: written here, or a shared job published and
    /// waited for.
    async fn beside(&self, s: Staged, done: &mpsc::UnboundedSender<Done>) -> Landing {
        match s.work {
            SnapshotWork::Local(sp) => Landing::written(self.snapshot(sp, s.done, done).await),
            SnapshotWork::Remote(job) => self.remote(job, s.done, done).await,
        }
    }

    /// A shared job's turn: published (everything of the repo before it is durable),
    /// then waited for; once its snapshot landed the repo's chain continues from it. Tells
    /// whoever staged it the job's result.
    async fn remote(&self, job: RemoteJob, answer: SnapshotDone, done: &mpsc::UnboundedSender<Done>) -> Landing {
        let did = job.did.clone();
        let result = match crate::shared::publish_and_wait(&job, &self.ctx).await {
            Ok(r) => r,
            Err(e) => {
                let _ = answer.send(Err(e.to_string()));
                let _ = done.send(Err(LaneStop::Handler(e)));
                return Landing::STOP;
            }
        };
        let mut covers = None;
        if let JobResult::Done { rev, data, .. } = &result {
            covers = crate::chain::tid(rev);
            if let (Some(v), Some(at), Some(data)) = (&self.verifier, covers, crate::shared::unhex(data)) {
                v.resynced(self.index, &did, at, &data);
            }
            // Unless intake already recorded a newer commit of it (held here meanwhile).
            if let (Some(m), Some(at)) = (&self.chain, covers)
                && m.last_commit(self.index, &did).is_none_or(|last| last <= at)
            {
                m.record(self.index, Key::Sync { did: &did, rev });
            }
        }
        let _ = answer.send(Ok(Some(result)));
        Landing { go_on: true, covers }
    }

    /// Writes a snapshot whose turn came, a part at a time, retrying a failed write while
    /// the term lasts, and tells whoever staged it how it went; `false` when the lane
    /// must stop.
    async fn snapshot(&self, mut sp: SnapshotParts, answer: SnapshotDone, done: &mpsc::UnboundedSender<Done>) -> bool {
        let r = loop {
            match sp.next_part().await {
                Some(Ok(part)) => {
                    if let Err(e) = self.write_part(&part).await {
                        break Err(e);
                    }
                }
                Some(Err(e)) => break Err(e),
                None => break Ok(()),
            }
        };
        match r {
            Ok(()) => {
                self.status.sink_ok();
                let _ = answer.send(Ok(None));
                true
            }
            Err(e @ HandlerError::Refused { .. }) => {
                tracing::error!(error = %e, repo = sp.did(), "the repo's snapshot was not delivered whole; it will be fetched again later");
                let _ = answer.send(Err(e.to_string()));
                true
            }
            Err(e) => {
                let _ = answer.send(Err(e.to_string()));
                let _ = done.send(Err(LaneStop::Handler(e)));
                false
            }
        }
    }

    /// Writes one part of a snapshot, retrying a failed write while the term lasts.
    async fn write_part(&self, part: &Snapshot) -> Result<(), HandlerError> {
        let mut backoff = Backoff::new(RETRY);
        loop {
            self.ctx.ensure_active()?;
            match self.handler.snapshot(part, &self.ctx).await {
                Err(e @ HandlerError::Failed { .. }) => self.back_off(e, &mut backoff, part.events()).await?,
                r => return r,
            }
        }
    }

    /// The next batch: what is carried over, topped up from the queue without waiting,
    /// cut at the handler's batch size or at `limit` (a snapshot's turn; the rest stays
    /// carried).
    fn next_batch(&self, carry: &mut VecDeque<Event>, rx: &mut mpsc::Receiver<Vec<Event>>, limit: usize) -> Vec<Event> {
        while carry.len() < self.batch_max {
            match rx.try_recv() {
                Ok(chunk) => carry.extend(chunk),
                Err(_) => break,
            }
        }
        let n = carry.len().min(self.batch_max).min(limit);
        carry.drain(..n).collect()
    }

    /// Readies a batch for the handler: verified (the first invalid event under the
    /// `fail` policy is returned, the batch cut before it), the desync changes of its
    /// repos kept by the store, hidden events taken out (done without the handler: into
    /// `seqs`), rendered. `None` when the lane must end (the term ended during
    /// verification, or the store refused the desync changes: reported on `done`).
    async fn prepare(
        &self,
        batch: &mut Vec<Event>,
        seqs: &mut Vec<u64>,
        scratch: &mut String,
        done: &mpsc::UnboundedSender<Done>,
    ) -> Option<Option<(u64, Invalid)>> {
        let mut stop = None;
        if let Some(v) = &self.verifier {
            stop = self.verify(v, batch).await?;
        }
        if let Some(d) = &self.desync {
            // What changed of the batch's repos' desync states is kept by the store
            // before the cursor can pass the events that changed it.
            if let Err(e) = self.persist(d, batch).await {
                let _ = done.send(Err(LaneStop::Handler(e)));
                return None;
            }
        }
        batch.retain(|e| {
            if e.hidden {
                seqs.push(e.seq());
            }
            !e.hidden
        });
        if let Some(r) = &self.render {
            render_batch(batch, r, scratch);
        }
        Some(stop)
    }

    /// Submits a prepared batch (an empty one is done at once); a batch the downstream
    /// refuses for its content is isolated once what is in flight before it is durable.
    /// `false` when the lane must end (reported on `done`).
    async fn submit_batch(
        &self,
        mut batch: Vec<Event>,
        mut seqs: Vec<u64>,
        w: &mut Writes,
        scratch: &mut String,
        done: &mpsc::UnboundedSender<Done>,
    ) -> bool {
        if batch.is_empty() {
            let _ = done.send(Ok(seqs));
            return true;
        }
        match self.submit(&batch).await {
            Ok(pending) => {
                w.held += batch.len();
                w.inflight.push_back(InFlight { batch, seqs, pending });
                true
            }
            Err(HandlerError::Refused { .. }) => {
                // What was submitted before it is durable first: the halves are then
                // written alone, in order.
                w.held = 0;
                if !self.drain(&mut w.inflight, done).await {
                    return false;
                }
                let r = Box::pin(self.isolate(&mut batch, scratch, &mut seqs)).await;
                // What was written before a stop counts.
                let _ = done.send(Ok(seqs));
                if let Err(e) = r {
                    let _ = done.send(Err(LaneStop::Handler(e)));
                    return false;
                }
                true
            }
            Err(e) => {
                let _ = done.send(Err(LaneStop::Handler(e)));
                false
            }
        }
    }

    /// Finishes every write in flight, oldest first; `false` when the lane must stop.
    async fn drain(&self, inflight: &mut VecDeque<InFlight>, done: &mpsc::UnboundedSender<Done>) -> bool {
        while let Some(mut f) = inflight.pop_front() {
            let r = f.pending.as_mut().await;
            if !self.finish(f, r, done).await {
                return false;
            }
        }
        true
    }

    /// Reports a finished write: done when it is durable (a failed one is written again
    /// first); `false` when the lane must stop.
    async fn finish(&self, mut f: InFlight, r: Result<(), HandlerError>, done: &mpsc::UnboundedSender<Done>) -> bool {
        let r = match r {
            Err(e @ HandlerError::Failed { .. }) => self.rewrite(&f.batch, e).await,
            r => r,
        };
        match r {
            Ok(()) => {
                self.failures.store(0, std::sync::atomic::Ordering::Relaxed);
                self.status.sink_ok();
                self.status.add_written(f.batch.len());
                f.seqs.extend(f.batch.iter().map(Event::seq));
                let _ = done.send(Ok(f.seqs));
                true
            }
            Err(e) => {
                let _ = done.send(Err(LaneStop::Handler(e)));
                false
            }
        }
    }

    /// Submits one batch, retrying a failed submission with backoff until the term ends.
    async fn submit(&self, batch: &[Event]) -> Result<Pending, HandlerError> {
        let mut backoff = Backoff::new(RETRY);
        loop {
            match self.handler.submit(batch, &self.ctx).await {
                Ok(p) => return Ok(p),
                Err(e @ HandlerError::Failed { .. }) => self.back_off(e, &mut backoff, batch.len()).await?,
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes again a batch whose write failed after it was submitted (an unacknowledged
    /// publish), until it is durable or the term ends.
    async fn rewrite(&self, batch: &[Event], first: HandlerError) -> Result<(), HandlerError> {
        let mut backoff = Backoff::new(RETRY);
        let mut err = first;
        loop {
            self.back_off(err, &mut backoff, batch.len()).await?;
            match self.submit(batch).await?.await {
                Ok(()) => return Ok(()),
                Err(e @ HandlerError::Failed { .. }) => err = e,
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes `batch` until it is durable (a `Failed` write is written again); `Refused`
    /// and the term's end come back.
    async fn write_whole(&self, batch: &[Event]) -> Result<(), HandlerError> {
        let mut pending = self.submit(batch).await?;
        match pending.as_mut().await {
            Err(e @ HandlerError::Failed { .. }) => self.rewrite(batch, e).await,
            r => r,
        }
    }

    /// The downstream refused `batch` for its content: writes it in halves until each
    /// event it refuses is found, and hands that over as `#invalid` (`unstorable`). The
    /// seqs handed over are added to `written` as they are.
    async fn isolate(
        &self,
        batch: &mut [Event],
        scratch: &mut String,
        written: &mut Vec<u64>,
    ) -> Result<(), HandlerError> {
        if let [e] = batch {
            self.unstorable(e, scratch).await?;
            written.push(e.seq());
            return Ok(());
        }
        let mid = batch.len() / 2;
        let (left, right) = batch.split_at_mut(mid);
        for half in [left, right] {
            match self.write_whole(half).await {
                Err(HandlerError::Refused { .. }) => Box::pin(self.isolate(half, scratch, written)).await?,
                r => {
                    r?;
                    written.extend(half.iter().map(Event::seq));
                }
            }
        }
        Ok(())
    }

    /// One event the downstream refuses: under the `fail` policy the consumer stops
    /// (everything before it committed); under `skip` it is handed over as `#invalid`
    /// (`unstorable`), written again until taken if even that is refused.
    async fn unstorable(&self, e: &mut Event, scratch: &mut String) -> Result<(), HandlerError> {
        metrics::counter!(m::UNSTORABLE).increment(1);
        let seq = e.seq();
        if self.unstorable == BadFramePolicy::Fail {
            return Err(HandlerError::fatal(
                "sink",
                format!("the downstream refuses seq {seq} for its content (bad-frame policy `fail`)"),
            ));
        }
        tracing::error!(
            seq,
            "the downstream refuses this event for its content: handing it over as #invalid (unstorable)"
        );
        let (repo, rev, commit) = match e.message() {
            relay_client::Message::Commit(c) => (c.repo.to_owned(), Some(c.rev.to_owned()), Some(c.commit.to_string())),
            m => (m.did().unwrap_or_default().to_owned(), None, None),
        };
        let detail = "the sink refused the event for its content".to_owned();
        let invalid = Invalid { repo, rev, commit, reason: crate::verify::Reason::Unstorable, detail };
        // A downstream that refuses even the small placeholder refuses more than a record
        // (a receiver answering 400 to everything for a while): dropping would lose every
        // event it refuses. The event and its placeholder are offered in turn, with
        // backoff, until one of them is taken.
        let mut backoff = Backoff::new(RETRY);
        loop {
            e.set_invalid(invalid.clone());
            self.rerender(e, scratch);
            let source = match self.write_whole(std::slice::from_ref(e)).await {
                Err(HandlerError::Refused { source, .. }) => source,
                r => return r,
            };
            let refused = HandlerError::failed(
                format!(
                    "sink: the downstream refuses even the #invalid placeholder of seq {seq}: it refuses more than \
                     this record; offering the event and its placeholder again"
                ),
                source,
            );
            self.back_off(refused, &mut backoff, 1).await?;
            e.clear_invalid();
            self.rerender(e, scratch);
            match self.write_whole(std::slice::from_ref(e)).await {
                Err(HandlerError::Refused { .. }) => {}
                r => return r,
            }
        }
    }

    /// Renders the event's JSON again (after it became, or stopped being, `#invalid`).
    fn rerender(&self, e: &mut Event, scratch: &mut String) {
        if let Some(r) = &self.render {
            render_batch(std::slice::from_mut(e), r, scratch);
        }
    }

    /// Counts and logs a failed write, then waits out the backoff (`Cancelled` when the
    /// term ends first).
    async fn back_off(&self, e: HandlerError, backoff: &mut Backoff, events: usize) -> Result<(), HandlerError> {
        metrics::counter!(m::SINK_ERRORS).increment(1);
        self.status.sink_failed(&e.to_string());
        let failed = self.failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if let Some(limit) = self.handler.give_up_after()
            && failed >= limit
        {
            tracing::error!(error = %e, failed, "the sink failed this many writes in a row: giving up the term, so that a replica with its own connection may take over");
            return Err(HandlerError::failed(format!("sink: {failed} failed writes in a row; the last"), e));
        }
        let delay = backoff.next_delay();
        tracing::warn!(error = %e, retry_ms = delay.as_millis() as u64, events, "sink write failed; retrying");
        tokio::select! {
            () = tokio::time::sleep(delay) => Ok(()),
            () = self.ctx.cancel.cancelled() => Err(HandlerError::Cancelled),
        }
    }

    /// Verifies the batch in order, marking failures. Under the `fail` policy the batch
    /// is cut before the first failure, which is returned. `None` when the term ended
    /// while an event was held.
    async fn verify(&self, v: &Verifier, batch: &mut Vec<Event>) -> Option<Option<(u64, Invalid)>> {
        for i in 0..batch.len() {
            let e = &batch[i];
            let verdict = v.check(self.index, e.seq(), e.message(), &self.ctx.cancel).await?;
            if matches!(verdict, Verdict::Valid) {
                self.remember(&mut batch[i]);
                continue;
            }
            if let Verdict::Invalid(inv) = verdict {
                if v.policy() == InvalidPolicy::Fail {
                    let seq = batch[i].seq();
                    batch.truncate(i);
                    return Some(Some((seq, inv)));
                }
                let e = &mut batch[i];
                // An invalid event is handed over even when the filter would hide it.
                e.hidden = false;
                e.set_invalid(inv);
            }
        }
        Some(None)
    }
}

impl Lane {
    /// Writes the desync changes of the batch's repos to the store, fenced by the term,
    /// retried while the store does not answer (`Fenced`: a newer term owns the store).
    async fn persist(&self, desync: &Desync, batch: &[Event]) -> Result<(), HandlerError> {
        // Nothing marked or cleared anywhere (the common case): nothing to keep. A repo
        // this batch's events marked is noted before the batch gets here.
        if !desync.any_dirty() {
            return Ok(());
        }
        let mut seen = std::collections::HashSet::new();
        for did in batch.iter().filter_map(Event::did) {
            if seen.insert(did) {
                crate::verify::keep(self.store.as_ref(), desync, did, &self.ctx).await?;
            }
        }
        Ok(())
    }

    /// Records a verified event in the term's memory (only verified data moves it), and
    /// attaches the chain break it reveals when breaks are emitted.
    fn remember(&self, e: &mut Event) {
        let Some(memory) = &self.memory else { return };
        let Some(b) = memory.record(self.index, Key::of(e.message())) else { return };
        let Some(policy) = self.chain_breaks else { return };
        crate::chain::report(&b, e.seq(), self.ctx.relay.as_str());
        if let Some(d) = self.desync.as_ref().filter(|d| d.resyncs()) {
            d.mark_repo(e.seq(), &b.repo, crate::verify::Reason::Chain.as_str(), Some(&b.rev));
        }
        if policy == ChainBreaks::Emit {
            // A filtered-out commit that reveals a break still goes out, to carry it.
            e.hidden = false;
            e.set_chain_break(b);
        }
    }
}

/// Renders each event of the batch once, here in its lane (so lanes render in parallel),
/// into the lane's `scratch` buffer and then into a string of just the event's size (a
/// frame's CAR makes its size a poor guess for its JSON's).
fn render_batch(batch: &mut [Event], r: &Render, scratch: &mut String) {
    /// A scratch buffer grown past this by one huge event is not kept.
    const KEEP: usize = 1 << 20;
    for e in batch {
        scratch.clear();
        if let Some(i) = e.invalid() {
            i.write_json(e.seq(), scratch);
        } else {
            report_record_errors(e.seq(), render(e.message(), r, scratch));
        }
        e.set_json(Arc::from(scratch.as_str()));
        if scratch.capacity() > KEEP {
            *scratch = String::new();
        }
    }
}

/// Records that could not be decoded were written as `null`: counted and logged.
fn report_record_errors(seq: u64, written: Written) {
    if written.record_errors > 0 {
        metrics::counter!(m::RECORD_ERRORS).increment(written.record_errors as u64);
        tracing::warn!(seq, errors = written.record_errors, "records that could not be decoded were written as null");
    }
}
