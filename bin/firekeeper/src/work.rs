//! The leader's work loop for one term: read the cursor, subscribe, hand events to the
//! sink through per-repo lanes, commit the watermark fenced, and drain on step-down.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Result, anyhow};
use checkpoint::{CommitOutcome, ReadOutcome, StoreError, Watermark};
use lease::{LeaseHandle, StepDownError, Term};
use relay_client::client::{BadFramePolicy, SwitchReason};
use relay_client::json::{FrameOptions, write_frame_with};
use relay_client::{Frame, Item, Message, Notice, RelayRole, SubscribeError, Subscription};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::{Config, SinkKind};
use crate::sink::{BatchCtx, Event, Sink, SinkError};
use crate::stores::Store;

/// What `/status` shows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StatusSnapshot {
    /// `standby`, `leader`, `stepping-down`, `expired` (the term's deadline passed and the
    /// loss is not yet announced: nothing is done meanwhile) or `stopped`.
    pub role: &'static str,
    /// This process.
    pub instance: String,
    /// The fencing token while leading.
    pub token: Option<u64>,
    /// `primary` or `secondary` while leading.
    pub relay: Option<&'static str>,
    /// Its fingerprint.
    pub fingerprint: Option<String>,
    /// A relay connection is up.
    pub connected: bool,
    /// Last seq delivered to the sink.
    pub last_seq: Option<u64>,
    /// Last cursor committed.
    pub committed: Option<u64>,
    /// Age of the newest delivered event (relay time to now).
    pub lag_seconds: Option<f64>,
    /// Events delivered but not yet done.
    pub in_flight: usize,
}

/// State shared with the HTTP server.
#[derive(Debug, Default)]
pub struct Shared {
    /// The status page.
    pub status: std::sync::Mutex<StatusSnapshot>,
    /// `/readyz`.
    pub ready: AtomicBool,
    /// The current term while leading, so `/status` never says `leader` past the term's
    /// deadline (a process that just woke from a freeze has stopped acting before its
    /// supervisor announced the loss).
    pub term: std::sync::Mutex<Option<Term>>,
    /// Events handed to the sink by this process (the summary line's rate).
    pub events: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// The status as of now: `leader` or `stepping-down` only while the term is active,
    /// else `expired`.
    #[must_use]
    pub fn snapshot(&self) -> StatusSnapshot {
        let mut s = self.status.lock().map(|s| s.clone()).unwrap_or_default();
        let active = self.term.lock().ok().and_then(|t| t.as_ref().map(Term::is_active)).unwrap_or(false);
        if matches!(s.role, "leader" | "stepping-down") && !active {
            s.role = "expired";
        }
        s
    }

    fn set_term(&self, t: Option<Term>) {
        if let Ok(mut g) = self.term.lock() {
            *g = t;
        }
    }

    /// Updates the status under its lock.
    pub fn update(&self, f: impl FnOnce(&mut StatusSnapshot)) {
        if let Ok(mut s) = self.status.lock() {
            f(&mut s);
        }
    }
}

/// How a term ended.
#[derive(Debug)]
pub enum TermEnd {
    /// Lost (expired, taken, fenced): contend again.
    Lost,
    /// Shutdown requested; the step-down result.
    Shutdown(Result<(), StepDownError>),
    /// A condition an operator must fix (`FutureCursor`, ambiguous legacy cursor).
    Fatal(anyhow::Error),
}

/// Everything a term needs.
pub struct Ctx<'a> {
    /// Configuration.
    pub cfg: &'a Config,
    /// Cursor store.
    pub store: &'a Store,
    /// Sink.
    pub sink: Arc<Sink>,
    /// Lease control (for step-down).
    pub lease: &'a LeaseHandle,
    /// First SIGTERM/SIGINT.
    pub shutdown: &'a CancellationToken,
    /// Status.
    pub shared: &'a Shared,
    /// The last cursor committed per relay fingerprint, by this process or (through the
    /// commits channel) by any replica: if the store lost a cursor, resuming from here
    /// loses nothing.
    pub remembered: &'a std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

/// Seconds since the epoch of an RFC 3339 UTC timestamp (`2026-12-02T10:17:24.747Z`).
#[must_use]
pub fn rfc3339_seconds(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, m, d, hh, mm, ss) = (num(0..4)?, num(5..7)?, num(8..10)?, num(11..13)?, num(14..16)?, num(17..19)?);
    let frac = match s[19..].strip_prefix('.') {
        Some(rest) => {
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            format!("0.{digits}").parse::<f64>().ok()?
        }
        None => 0.0,
    };
    // Days from civil (Howard Hinnant).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    #[allow(clippy::cast_precision_loss)]
    Some((days * 86_400 + hh * 3600 + mm * 60 + ss) as f64 + frac)
}

fn now_seconds() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The lanes of one relay within one term.
struct Pipeline {
    lanes: Vec<mpsc::Sender<Event>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    done: mpsc::UnboundedReceiver<Result<Vec<u64>, SinkError>>,
    watermark: Watermark,
    ctx: BatchCtx,
    committed: Option<u64>,
}

impl Pipeline {
    fn new(cfg: &Config, sink: &Arc<Sink>, ctx: BatchCtx, start: Option<u64>) -> Self {
        let lanes_n = if sink.commits_cursor() { 1 } else { cfg.lanes };
        let batch_max = match &cfg.sink {
            SinkKind::Webhook { batch, .. } => *batch,
            _ => 512,
        };
        let (done_tx, done) = mpsc::unbounded_channel();
        let mut lanes = Vec::with_capacity(lanes_n);
        let mut tasks = Vec::with_capacity(lanes_n);
        for _ in 0..lanes_n {
            let (tx, rx) = mpsc::channel(cfg.queue_depth);
            lanes.push(tx);
            tasks.push(tokio::spawn(lane(rx, sink.clone(), ctx.clone(), batch_max, done_tx.clone())));
        }
        // Every lane holds at most `queue_depth` queued events plus the batch it is
        // writing; the window also keeps finished events behind an unfinished one.
        // Intake waits while the window is full, whatever fills it.
        let capacity = lanes_n * (cfg.queue_depth + batch_max);
        Self { lanes, tasks, done, watermark: Watermark::new(start, capacity), ctx, committed: start }
    }

    fn lane_of(&self, did: Option<&str>) -> usize {
        let h = did.map_or(0u64, |d| {
            d.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
        });
        (h % self.lanes.len() as u64) as usize
    }

    fn on_done(&mut self, r: Result<Vec<u64>, SinkError>) -> Result<(), SinkError> {
        for s in r? {
            self.watermark.complete(s);
        }
        metrics::gauge!("firekeeper_queue_depth").set(self.watermark.in_flight() as f64);
        Ok(())
    }

    /// An event that needs no sink write (filtered out whole, or skipped under the
    /// bad-frame policy): done at once, so the cursor moves past it once everything
    /// before it is done.
    fn pass(&mut self, seq: u64) -> Result<(), checkpoint::watermark::WatermarkError> {
        self.watermark.deliver(seq)?;
        self.watermark.complete(seq);
        Ok(())
    }

    fn abort(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }

    /// Closes the lanes and waits until every delivered event is done.
    async fn drain(&mut self) -> Result<(), SinkError> {
        self.lanes.clear();
        while !self.watermark.is_idle() {
            match self.done.recv().await {
                Some(r) => self.on_done(r)?,
                None => return Err(SinkError::Failed("lanes ended with events in flight".into())),
            }
        }
        Ok(())
    }
}

async fn lane(
    mut rx: mpsc::Receiver<Event>,
    sink: Arc<Sink>,
    ctx: BatchCtx,
    batch_max: usize,
    done: mpsc::UnboundedSender<Result<Vec<u64>, SinkError>>,
) {
    let mut batch = Vec::with_capacity(batch_max);
    while let Some(e) = rx.recv().await {
        batch.push(e);
        while batch.len() < batch_max {
            match rx.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        match sink.write(&batch, &ctx).await {
            Ok(()) => {
                let _ = done.send(Ok(batch.iter().map(|e| e.seq).collect()));
            }
            Err(e) => {
                let _ = done.send(Err(e));
                return;
            }
        }
        batch.clear();
    }
}

/// Why a wait inside a term ended early.
enum Interrupted {
    /// The term ended (lost, fenced, expired).
    TermEnded,
    /// SIGTERM/SIGINT: step down.
    Shutdown,
}

/// Runs `f` until it finishes, the term ends, or shutdown is requested: no await in the
/// work loop may outlive either.
async fn guarded<T>(cx: &Ctx<'_>, term: &Term, f: impl Future<Output = T>) -> Result<T, Interrupted> {
    tokio::select! {
        biased;
        () = term.ended() => Err(Interrupted::TermEnded),
        () = cx.shutdown.cancelled() => Err(Interrupted::Shutdown),
        v = f => Ok(v),
    }
}

/// Retries `f` while the store is unavailable, logging what it waits for and the next
/// delay; ends early when the term ends or shutdown is requested.
async fn while_active<T>(
    cx: &Ctx<'_>,
    term: &Term,
    what: &str,
    mut f: impl AsyncFnMut() -> Result<T, StoreError>,
) -> Result<Result<T, StoreError>, Interrupted> {
    let mut delay = Duration::from_millis(200);
    loop {
        if !term.is_active() {
            return Err(Interrupted::TermEnded);
        }
        match guarded(cx, term, f()).await? {
            Err(StoreError::Unavailable(e)) => {
                tracing::warn!(error = %e, what, retry_ms = delay.as_millis() as u64, "cursor store unavailable; not subscribing until it answers");
                guarded(cx, term, tokio::time::sleep(delay)).await?;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            other => return Ok(other),
        }
    }
}

/// How reading a relay's cursor at term start can end without a value to use.
enum CursorProblem {
    /// Interrupted by the term or shutdown.
    Interrupted(Interrupted),
    /// A condition an operator must fix.
    Fatal(anyhow::Error),
}

/// Where a relay's stream resumes. `at_term_start` applies the rule that a missing cursor
/// is only a fresh start when no earlier term existed.
async fn read_cursor(
    cx: &Ctx<'_>,
    term: &Term,
    role: RelayRole,
    fp: &str,
    at_term_start: bool,
) -> Result<Option<u64>, CursorProblem> {
    let r = while_active(cx, term, "read cursor", || cx.store.read(fp)).await.map_err(CursorProblem::Interrupted)?;
    let r = r.map_err(|e| CursorProblem::Fatal(anyhow!("reading the {role} cursor: {e}")))?;
    let remembered = cx.remembered.lock().ok().and_then(|m| m.get(fp).copied());
    match (r, remembered) {
        (ReadOutcome::Found(c), _) => {
            tracing::info!(relay = role.as_str(), cursor = c, "resuming from stored cursor");
            Ok(Some(c))
        }
        // A lower stored value may be an operator's rewind and is honoured; a missing one
        // after this process committed means the store lost data.
        (ReadOutcome::Missing | ReadOutcome::Corrupt(_), Some(mine)) => {
            tracing::error!(
                relay = role.as_str(),
                committed_here = mine,
                "the store lost this relay's cursor; resuming from the last commit this process saw"
            );
            Ok(Some(mine))
        }
        // Token 1 is the first term this lease store ever issued: a fresh deployment.
        // A later token means some term ran before and (very likely) committed: the
        // store lost the cursor, and starting from the live tail would skip everything
        // in between without anyone deciding so.
        (ReadOutcome::Missing | ReadOutcome::Corrupt(_), None) if at_term_start && term.token() > 1 => {
            Err(CursorProblem::Fatal(anyhow!(
                "no stored cursor for the {role} relay ({fp}), but earlier terms existed (this term's token is {}): \
                 the cursor store lost it. Refusing to start from the live tail. Set the cursor to resume after \
                 with `firekeeper cursor set <seq>` (the live head to accept the gap), then restart",
                term.token()
            )))
        }
        (ReadOutcome::Missing | ReadOutcome::Corrupt(_), None) => {
            tracing::warn!(
                relay = role.as_str(),
                token = term.token(),
                "no stored cursor for this relay: starting from the live tail"
            );
            Ok(None)
        }
    }
}

/// Commits the watermark if it moved. `Err` means fenced: the term is over.
async fn commit(cx: &Ctx<'_>, term: &Term, p: &mut Pipeline, final_: bool) -> Result<(), ()> {
    // Act only while the term is active, whatever the store would answer: a process that
    // was frozen past its deadline must not commit before its supervisor notices.
    if !term.is_active() {
        return Err(());
    }
    let Some(c) = p.watermark.committable() else { return Ok(()) };
    if p.committed.is_some_and(|done| done >= c) {
        return Ok(());
    }
    if cx.sink.commits_cursor() {
        // The sink committed it in the same transaction as the rows.
        p.committed = Some(c);
        cx.shared.update(|s| s.committed = Some(c));
        return Ok(());
    }
    let span = tracing::info_span!("commit", cursor = c, token = p.ctx.token, relay = p.ctx.relay, final_);
    let out = cx.store.commit(&p.ctx.fingerprint, c, term).instrument(span).await;
    let label = match &out {
        Ok(CommitOutcome::Saved) => "saved",
        Ok(CommitOutcome::NotNewer { .. }) => "not_newer",
        Ok(CommitOutcome::Fenced { .. }) => "fenced",
        Err(_) => "error",
    };
    metrics::counter!("firekeeper_commits_total", "outcome" => label).increment(1);
    match out {
        Ok(CommitOutcome::Saved | CommitOutcome::NotNewer { .. }) => {
            p.committed = Some(c);
            if let Ok(mut m) = cx.remembered.lock() {
                let e = m.entry(p.ctx.fingerprint.clone()).or_insert(c);
                *e = (*e).max(c);
            }
            cx.shared.update(|s| s.committed = Some(c));
            Ok(())
        }
        Ok(CommitOutcome::Fenced { current: None }) => {
            // No lease key at all (e.g. Redis lost its data): not proof of a newer term.
            // The lease either retakes the key or loses at its deadline; retry until then.
            tracing::warn!(token = p.ctx.token, cursor = c, "commit refused: no lease key in the store; retrying");
            Ok(())
        }
        Ok(CommitOutcome::Fenced { current }) => {
            tracing::error!(
                token = p.ctx.token,
                ?current,
                cursor = c,
                "commit fenced: a newer term owns the cursor; stopping"
            );
            Err(())
        }
        Err(e) => {
            tracing::warn!(error = %e, cursor = c, "commit failed; will retry");
            Ok(())
        }
    }
}

fn ctx_for(cfg: &Config, term: &Term, role: RelayRole) -> BatchCtx {
    let url = match role {
        RelayRole::Primary => &cfg.relay,
        RelayRole::Secondary => cfg.relay_secondary.as_ref().unwrap_or(&cfg.relay),
    };
    BatchCtx {
        token: term.token(),
        relay: role.as_str(),
        fingerprint: url.fingerprint().to_owned(),
        cancel: term.cancellation(),
        term: term.clone(),
    }
}

/// Builds the sink event of a frame and its lag (relay time to now, when the frame has a
/// time); `Ok(None)` when the collection filter drops it whole; `Err` when it cannot be
/// rendered (the bad-frame policy decides).
fn to_event(cfg: &Config, bytes: &[u8], seq: u64) -> Result<Option<(Event, Option<f64>)>, relay_client::DecodeError> {
    let frame = relay_client::decode(bytes)?;
    let Frame::Message(m) = &frame else { return Ok(None) };
    let keep = |op: &relay_client::frame::RepoOp<'_>| cfg.wants(op.collection());
    let opts = FrameOptions {
        verify_blocks: cfg.verify_blocks,
        keep_op: (!cfg.collections.is_empty()).then_some(&keep as &dyn Fn(&relay_client::frame::RepoOp<'_>) -> bool),
        lossy_records: true,
    };
    let mut body = String::with_capacity(bytes.len() * 2);
    let written = write_frame_with(&frame, &opts, &mut body)?;
    if written.record_errors > 0 {
        metrics::counter!("firekeeper_record_errors_total").increment(written.record_errors as u64);
        tracing::warn!(seq, errors = written.record_errors, "records that could not be decoded were written as null");
    }
    let is_commit = matches!(m, Message::Commit(_));
    if is_commit && written.ops == 0 && written.filtered > 0 {
        return Ok(None);
    }
    let time = match m {
        Message::Commit(c) => Some(c.time),
        Message::Sync(s) => Some(s.time),
        Message::Identity(i) => Some(i.time),
        Message::Account(a) => Some(a.time),
        _ => None,
    };
    let lag = time.and_then(rfc3339_seconds).map(|t| now_seconds() - t);
    if let Some(lag) = lag {
        metrics::gauge!("firekeeper_lag_seconds").set(lag);
    }
    let kind = match m {
        Message::Commit(_) => "#commit",
        Message::Sync(_) => "#sync",
        Message::Identity(_) => "#identity",
        Message::Account(_) => "#account",
        _ => "#other",
    };
    metrics::counter!("firekeeper_events_total", "type" => kind).increment(1);
    Ok(Some((Event { seq, kind, did: m.did().map(str::to_owned), body }, lag)))
}

fn on_notice(cx: &Ctx<'_>, n: &Notice) {
    match n {
        Notice::Connected { relay, .. } => {
            cx.shared.update(|s| s.connected = true);
            tracing::info!(relay = relay.as_str(), "relay connected");
        }
        Notice::Disconnected { relay, error, .. } => {
            cx.shared.update(|s| s.connected = false);
            metrics::counter!("firekeeper_reconnects_total", "relay" => relay.as_str(), "reason" => error.reason())
                .increment(1);
            if let relay_client::ConnError::ErrorFrame { error, .. } = error {
                metrics::counter!("firekeeper_error_frames_total", "error" => error.clone()).increment(1);
            }
        }
        Notice::BadFrame { error, seq, .. } => {
            let policy = if seq.is_some() { "skipped" } else { "unplaced" };
            metrics::counter!("firekeeper_bad_frames_total", "reason" => error.reason(), "action" => policy)
                .increment(1);
        }
        Notice::SeqBackwards { .. } => metrics::counter!("firekeeper_seq_backwards_total").increment(1),
        Notice::OutdatedCursor { .. } => metrics::counter!("firekeeper_outdated_cursor_total").increment(1),
        Notice::Info { .. } | Notice::WentLive { .. } => {}
    }
}

/// Runs one term until it is lost, shut down, or hits a fatal condition.
pub async fn run_term(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let span = tracing::info_span!("term", token = term.token(), epoch = term.epoch());
    cx.shared.set_term(Some(term.clone()));
    let end = run_term_inner(cx, term).instrument(span).await;
    // The supervisor waits for every clone of a lost term to drop before contending.
    cx.shared.set_term(None);
    end
}

/// What the intake of one item decided.
enum Step {
    /// Go on reading.
    Next,
    /// Shutdown requested: step down.
    Shutdown,
    /// The term is over.
    End(TermEnd),
}

impl From<Interrupted> for Step {
    fn from(i: Interrupted) -> Self {
        match i {
            Interrupted::TermEnded => Self::End(TermEnd::Lost),
            Interrupted::Shutdown => Self::Shutdown,
        }
    }
}

/// One term's moving parts.
struct Leader<'a, 'c> {
    cx: &'a Ctx<'c>,
    term: Term,
    role: RelayRole,
    sub: Subscription,
    p: Pipeline,
    /// Set when the stream starts with no known position: the first seq rewinds the
    /// stored cursor, fenced, to just before it.
    rewind: Option<Rewind>,
    /// Age of the newest delivered event; `/status` shows it at each commit tick.
    lag: Option<f64>,
}

/// Why the first seq of a stream sets the stored cursor.
#[derive(Debug, Clone, Copy)]
enum Rewind {
    /// Started from the live tail with no stored cursor: recording where this deployment
    /// started lets a successor resume there instead of at a later live tail.
    FreshStart,
    /// The relay went live after rejecting this cursor as `FutureCursor`: an accepted gap.
    WentLive(Option<u64>),
}

/// Where `role`'s stream resumes, as a term step.
async fn resume_point(cx: &Ctx<'_>, term: &Term, role: RelayRole, at_term_start: bool) -> Result<Option<u64>, Step> {
    let fp = ctx_for(cx.cfg, term, role).fingerprint;
    read_cursor(cx, term, role, &fp, at_term_start).await.map_err(|e| match e {
        CursorProblem::Interrupted(i) => i.into(),
        CursorProblem::Fatal(e) => Step::End(TermEnd::Fatal(e)),
    })
}

impl Leader<'_, '_> {
    /// Switches to `role` from its stored cursor with a fresh pipeline.
    async fn switch_to(&mut self, role: RelayRole) -> Result<(), Step> {
        let cursor = resume_point(self.cx, &self.term, role, false).await?;
        self.p.abort();
        self.p = Pipeline::new(self.cx.cfg, &self.cx.sink, ctx_for(self.cx.cfg, &self.term, role), cursor);
        self.begin(role, cursor);
        Ok(())
    }

    /// Subscribes to `role` from `cursor` on the current pipeline.
    fn begin(&mut self, role: RelayRole, cursor: Option<u64>) {
        let fp = self.p.ctx.fingerprint.clone();
        self.role = role;
        self.rewind = cursor.is_none().then_some(Rewind::FreshStart);
        self.sub.start(role, cursor);
        metrics::gauge!("firekeeper_relay_on_secondary").set(if role == RelayRole::Secondary { 1.0 } else { 0.0 });
        self.cx.shared.update(|s| {
            s.relay = Some(role.as_str());
            s.fingerprint = Some(fp);
            s.committed = cursor;
        });
    }

    /// Drains what was delivered and commits it (final). `Err` when the term ended or
    /// shutdown came first (the step-down path drains again, within its budget).
    async fn settle(&mut self) -> Result<(), Step> {
        match guarded(self.cx, &self.term, self.p.drain()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(Step::End(TermEnd::Lost)),
            Err(i) => return Err(i.into()),
        }
        if commit(self.cx, &self.term, &mut self.p, true).await.is_err() {
            return Err(Step::End(TermEnd::Lost));
        }
        Ok(())
    }

    /// Settles what was delivered, then ends the term with an operator-facing error.
    async fn fatal(&mut self, e: anyhow::Error) -> Step {
        tracing::error!(error = %e, "stopping: this needs an operator");
        match self.settle().await {
            Ok(()) | Err(Step::End(_) | Step::Next) => Step::End(TermEnd::Fatal(e)),
            Err(Step::Shutdown) => Step::Shutdown,
        }
    }

    /// A fenced rewind (or first commit) of the stored cursor to `cursor`, retried while
    /// the store is unavailable.
    async fn reset_cursor(&mut self, cursor: u64) -> Result<(), Step> {
        let (cx, term) = (self.cx, &self.term);
        let fp = self.p.ctx.fingerprint.clone();
        let out = while_active(cx, term, "reset cursor", || cx.store.reset(&fp, cursor, term)).await?;
        match out {
            Ok(CommitOutcome::Saved | CommitOutcome::NotNewer { .. }) => {
                if let Ok(mut m) = cx.remembered.lock() {
                    m.insert(fp, cursor);
                }
                self.p.committed = Some(cursor);
                cx.shared.update(|s| s.committed = Some(cursor));
                Ok(())
            }
            Ok(CommitOutcome::Fenced { .. }) => Err(Step::End(TermEnd::Lost)),
            Err(e) => Err(Step::End(TermEnd::Fatal(anyhow!("resetting the cursor to {cursor}: {e}")))),
        }
    }

    /// Handles the first frame after going live or starting fresh.
    async fn on_first_seq(&mut self, why: Rewind, seq: u64) -> Result<(), Step> {
        if let Rewind::WentLive(rejected) = why {
            metrics::counter!("firekeeper_gaps_total", "reason" => "future_cursor").increment(1);
            tracing::error!(
                relay = self.role.as_str(),
                rejected_cursor = ?rejected,
                live_from = seq,
                "accepted gap (FIREKEEPER_FUTURE_CURSOR=live): events after the rejected cursor that the relay no \
                 longer numbers that way are skipped; the stored cursor is rewound to just before the first live seq"
            );
        }
        self.reset_cursor(seq.saturating_sub(1)).await
    }

    /// Hands one frame to the pipeline: waits for room in its lane (and the window, which
    /// the caller checked), never skips a refused delivery.
    async fn on_frame(&mut self, f: relay_client::OwnedFrame) -> Step {
        if let Some(why) = self.rewind.take()
            && let Err(s) = self.on_first_seq(why, f.seq).await
        {
            return s;
        }
        let ev = match to_event(self.cx.cfg, &f.bytes, f.seq) {
            Ok(Some((ev, lag))) => {
                self.cx.shared.events.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.lag = lag.or(self.lag);
                ev
            }
            Ok(None) => return self.pass(f.seq),
            Err(error) => match self.cx.cfg.client.bad_frame {
                BadFramePolicy::Skip => {
                    metrics::counter!("firekeeper_bad_frames_total", "reason" => error.reason(), "action" => "skipped")
                        .increment(1);
                    tracing::error!(seq = f.seq, %error, "event cannot be rendered; skipped (FIREKEEPER_BAD_FRAME=skip)");
                    return self.pass(f.seq);
                }
                BadFramePolicy::Fail => {
                    let e = anyhow!(
                        "seq {} from the {} relay cannot be rendered ({error}); the cursor stays before it. Set \
                         FIREKEEPER_BAD_FRAME=skip to skip such events, or `firekeeper cursor set {}` to step over it",
                        f.seq,
                        self.role,
                        f.seq
                    );
                    return self.fatal(e).await;
                }
            },
        };
        let lane = self.p.lane_of(ev.did.as_deref());
        // Fast path: a lane with room needs no wait (and no waiters registered on the
        // term and shutdown tokens per event); a full one is waited on, guarded.
        let permit = match self.p.lanes[lane].try_reserve() {
            Ok(permit) => permit,
            Err(mpsc::error::TrySendError::Closed(())) => return Step::End(TermEnd::Lost),
            Err(mpsc::error::TrySendError::Full(())) => {
                match guarded(self.cx, &self.term, self.p.lanes[lane].reserve()).await {
                    Ok(Ok(permit)) => permit,
                    Ok(Err(_)) => return Step::End(TermEnd::Lost),
                    Err(i) => return i.into(),
                }
            }
        };
        if let Err(e) = self.p.watermark.deliver(ev.seq) {
            // Intake only reads while the window has room, and the client delivers in
            // increasing seq order: this is a bug, and skipping would lose the event.
            return Step::End(TermEnd::Fatal(anyhow!("internal: the watermark refused seq {}: {e}", ev.seq)));
        }
        permit.send(ev);
        Step::Next
    }

    fn pass(&mut self, seq: u64) -> Step {
        match self.p.pass(seq) {
            Ok(()) => Step::Next,
            Err(e) => Step::End(TermEnd::Fatal(anyhow!("internal: the watermark refused seq {seq}: {e}"))),
        }
    }

    async fn on_item(&mut self, item: Result<Item, SubscribeError>) -> Step {
        match item {
            Ok(Item::Frame(f)) => self.on_frame(f).await,
            Ok(Item::Notice(n)) => {
                on_notice(self.cx, &n);
                if let Notice::WentLive { rejected, .. } = n {
                    // Live seqs may be lower than anything delivered so far: finish and
                    // commit the old numbering, then start a fresh window.
                    if let Err(s) = self.settle().await {
                        return s;
                    }
                    let ctx = ctx_for(self.cx.cfg, &self.term, self.role);
                    self.p.abort();
                    self.p = Pipeline::new(self.cx.cfg, &self.cx.sink, ctx, None);
                    self.rewind = Some(Rewind::WentLive(rejected));
                }
                Step::Next
            }
            Ok(Item::SwitchRelay { from, to, reason }) => {
                let kind = if reason == SwitchReason::Failback { "failback" } else { "failover" };
                metrics::counter!("firekeeper_relay_switches_total", "to" => to.as_str(), "kind" => kind).increment(1);
                if let Err(s) = self.settle().await {
                    return s;
                }
                tracing::info!(from = from.as_str(), to = to.as_str(), committed = ?self.p.committed, "relay switch: committed the current relay first");
                match self.switch_to(to).await {
                    Ok(()) => Step::Next,
                    Err(s) => s,
                }
            }
            Err(e @ SubscribeError::FutureCursor { .. }) => self.fatal(anyhow!("{e}; set FIREKEEPER_FUTURE_CURSOR=live to accept the gap, or fix the cursor with `firekeeper cursor set`")).await,
            Err(e @ (SubscribeError::BadFrame { .. } | SubscribeError::FrameTooLarge { .. })) => self.fatal(anyhow!(e)).await,
            Err(SubscribeError::Closed) => self.fatal(anyhow!("relay subscription closed unexpectedly")).await,
        }
    }
}

async fn run_term_inner(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let cfg = cx.cfg;
    let token = term.token();
    cx.shared.update(|s| {
        s.role = "leader";
        s.token = Some(token);
    });
    metrics::gauge!("firekeeper_leader").set(1.0);
    match while_active(cx, &term, "on election", || cx.store.on_elected(cfg, token)).await {
        Err(Interrupted::TermEnded) => return TermEnd::Lost,
        Err(Interrupted::Shutdown) => return TermEnd::Shutdown(cx.lease.release().await),
        Ok(Err(e @ StoreError::LegacyAmbiguous { .. })) => return TermEnd::Fatal(anyhow!(e)),
        Ok(Err(e)) => return TermEnd::Fatal(anyhow!("cursor store refused the new term: {e}")),
        Ok(Ok(())) => {}
    }
    let role = RelayRole::Primary;
    let cursor = match resume_point(cx, &term, role, true).await {
        Ok(c) => c,
        Err(Step::Shutdown) => return TermEnd::Shutdown(cx.lease.release().await),
        Err(Step::End(end)) => return end,
        Err(Step::Next) => unreachable!("resume_point never asks to go on"),
    };
    let sub = Subscription::new(cfg.client.clone(), cfg.relay.clone(), cfg.relay_secondary.clone());
    let p = Pipeline::new(cfg, &cx.sink, ctx_for(cfg, &term, role), cursor);
    let mut l = Leader { cx, term, role, sub, p, rewind: None, lag: None };
    l.begin(role, cursor);
    let mut tick = tokio::time::interval(cfg.commit_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let cancel = l.term.cancellation();
    loop {
        let has_room = l.p.watermark.has_room();
        let step = tokio::select! {
            biased;
            () = cancel.cancelled() => Step::End(TermEnd::Lost),
            () = cx.shutdown.cancelled() => Step::Shutdown,
            Some(r) = l.p.done.recv() => {
                if l.p.on_done(r).is_err() { Step::End(TermEnd::Lost) } else { Step::Next }
            }
            _ = tick.tick() => {
                if commit(cx, &l.term, &mut l.p, false).await.is_err() {
                    Step::End(TermEnd::Lost)
                } else {
                    let (delivered, in_flight) = (l.sub.cursor(), l.p.watermark.in_flight());
                    let lag = delivered.zip(l.p.committed).map_or(0, |(d, c)| d.saturating_sub(c));
                    metrics::gauge!("firekeeper_lag_seq").set(lag as f64);
                    cx.shared.update(|s| { s.last_seq = delivered; s.in_flight = in_flight; s.lag_seconds = l.lag; });
                    Step::Next
                }
            }
            item = l.sub.next(), if has_room => l.on_item(item).await,
        };
        match step {
            Step::Next => {}
            Step::Shutdown => break,
            Step::End(end) => {
                if matches!(end, TermEnd::Lost) {
                    tracing::warn!(token, "term ended: intake stopped");
                }
                l.p.abort();
                return end;
            }
        }
    }
    // Voluntary step-down: keep renewing while the lanes drain, commit, then release.
    cx.shared.update(|s| s.role = "stepping-down");
    tracing::info!(token, in_flight = l.p.watermark.in_flight(), "draining before release");
    l.sub.close().await;
    let Leader { term, mut p, .. } = l;
    let drain = async {
        p.drain().await.map_err(|e| e.to_string())?;
        // A store that is briefly away does not make the step-down unclean: retry the
        // final commit while the term lasts (the drain budget bounds it too).
        loop {
            commit(cx, &term, &mut p, true).await.map_err(|()| "final commit fenced or the term ended".to_owned())?;
            if p.committed == p.watermark.committable() {
                return Ok::<(), String>(());
            }
            tracing::warn!(cursor = ?p.watermark.committable(), retry_ms = 100, "final commit did not land yet; retrying while the term lasts");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let r = cx.lease.step_down_with(drain, cfg.drain_budget).await;
    p.abort();
    TermEnd::Shutdown(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_relay_timestamps() {
        assert_eq!(rfc3339_seconds("1970-01-01T00:00:00Z"), Some(0.0));
        let t = rfc3339_seconds("2026-12-02T10:17:24.747Z").expect("ts");
        assert!((t - 1_796_206_644.747).abs() < 1e-3, "{t}");
        assert_eq!(rfc3339_seconds("yesterday"), None);
    }
}
