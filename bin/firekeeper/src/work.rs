//! The leader's work loop for one term: read the cursor, subscribe, hand events to the
//! sink through per-repo lanes, commit the watermark fenced, and drain on step-down.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Result, anyhow};
use checkpoint::{CommitOutcome, ReadOutcome, StoreError, Watermark};
use lease::{LeaseHandle, StepDownError, Term};
use relay_client::client::SwitchReason;
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
    /// `standby`, `leader`, `stepping-down` or `stopped`.
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
}

impl Shared {
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

/// Retries `f` while the term is active; `None` when the term ended first.
async fn while_active<T>(
    term: &Term,
    what: &str,
    mut f: impl AsyncFnMut() -> Result<T, StoreError>,
) -> Option<Result<T, StoreError>> {
    let mut delay = Duration::from_millis(200);
    loop {
        if !term.is_active() {
            return None;
        }
        match f().await {
            Err(StoreError::Unavailable(e)) => {
                tracing::warn!(error = %e, what, "cursor store unavailable; not subscribing until it answers");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = term.ended() => return None,
                }
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            other => return Some(other),
        }
    }
}

async fn read_cursor(cx: &Ctx<'_>, term: &Term, role: RelayRole, fp: &str) -> Option<Result<Option<u64>, StoreError>> {
    let r = while_active(term, "read cursor", || cx.store.read(fp)).await?;
    let remembered = cx.remembered.lock().ok().and_then(|m| m.get(fp).copied());
    Some(r.map(|o| match (o, remembered) {
        (ReadOutcome::Found(c), _) => {
            tracing::info!(relay = role.as_str(), cursor = c, "resuming from stored cursor");
            Some(c)
        }
        // A lower stored value may be an operator's rewind and is honoured; a missing one
        // after this process committed means the store lost data.
        (ReadOutcome::Missing | ReadOutcome::Corrupt(_), Some(mine)) => {
            tracing::error!(
                relay = role.as_str(),
                committed_here = mine,
                "the store lost this relay's cursor; resuming from the last commit this process saw"
            );
            Some(mine)
        }
        (ReadOutcome::Missing | ReadOutcome::Corrupt(_), None) => {
            tracing::warn!(relay = role.as_str(), "no stored cursor for this relay: starting from the live tail");
            None
        }
    }))
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
    let out = cx.store.commit(&p.ctx.fingerprint, c, p.ctx.token).instrument(span).await;
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

/// Builds the sink event of a frame; `None` when the collection filter drops it whole.
fn to_event(cfg: &Config, bytes: &[u8], seq: u64) -> Option<Event> {
    let frame = relay_client::decode(bytes).ok()?;
    let Frame::Message(m) = &frame else { return None };
    let keep = |op: &relay_client::frame::RepoOp<'_>| cfg.wants(op.collection());
    let opts = FrameOptions {
        verify_blocks: cfg.verify_blocks,
        keep_op: (!cfg.collections.is_empty()).then_some(&keep as &dyn Fn(&relay_client::frame::RepoOp<'_>) -> bool),
        lossy_records: true,
    };
    let mut body = String::with_capacity(bytes.len() * 2);
    let written = write_frame_with(&frame, &opts, &mut body).ok()?;
    if written.record_errors > 0 {
        metrics::counter!("firekeeper_record_errors_total").increment(written.record_errors as u64);
        tracing::warn!(seq, errors = written.record_errors, "records that could not be decoded were written as null");
    }
    let is_commit = matches!(m, Message::Commit(_));
    if is_commit && written.ops == 0 && written.filtered > 0 {
        return None;
    }
    let time = match m {
        Message::Commit(c) => Some(c.time),
        Message::Sync(s) => Some(s.time),
        Message::Identity(i) => Some(i.time),
        Message::Account(a) => Some(a.time),
        _ => None,
    };
    if let Some(lag) = time.and_then(rfc3339_seconds).map(|t| now_seconds() - t) {
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
    Some(Event { seq, kind, did: m.did().map(str::to_owned), body })
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
        Notice::BadFrame { error, .. } => {
            metrics::counter!("firekeeper_bad_frames_total", "reason" => error.reason()).increment(1);
        }
        Notice::SeqBackwards { .. } => metrics::counter!("firekeeper_seq_backwards_total").increment(1),
        Notice::OutdatedCursor { .. } => metrics::counter!("firekeeper_outdated_cursor_total").increment(1),
        Notice::Info { .. } | Notice::WentLive { .. } => {}
    }
}

/// Runs one term until it is lost, shut down, or hits a fatal condition.
pub async fn run_term(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let span = tracing::info_span!("term", token = term.token(), epoch = term.epoch());
    run_term_inner(cx, term).instrument(span).await
}

async fn run_term_inner(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let cfg = cx.cfg;
    let token = term.token();
    cx.shared.update(|s| {
        s.role = "leader";
        s.token = Some(token);
    });
    metrics::gauge!("firekeeper_leader").set(1.0);
    match while_active(&term, "on election", || cx.store.on_elected(cfg, token)).await {
        None => return TermEnd::Lost,
        Some(Err(e @ StoreError::LegacyAmbiguous { .. })) => return TermEnd::Fatal(anyhow!(e)),
        Some(Err(e)) => return TermEnd::Fatal(anyhow!("cursor store refused the new term: {e}")),
        Some(Ok(())) => {}
    }
    let mut role = RelayRole::Primary;
    let fp = cfg.relay.fingerprint().to_owned();
    let cursor = match read_cursor(cx, &term, role, &fp).await {
        None => return TermEnd::Lost,
        Some(Err(e)) => return TermEnd::Fatal(anyhow!("reading the cursor: {e}")),
        Some(Ok(c)) => c,
    };
    let mut sub = Subscription::new(cfg.client.clone(), cfg.relay.clone(), cfg.relay_secondary.clone());
    sub.start(role, cursor);
    let mut p = Pipeline::new(cfg, &cx.sink, ctx_for(cfg, &term, role), cursor);
    cx.shared.update(|s| {
        s.relay = Some(role.as_str());
        s.fingerprint = Some(fp.clone());
        s.committed = cursor;
    });
    let mut tick = tokio::time::interval(cfg.commit_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let cancel = term.cancellation();
    loop {
        let has_room = p.watermark.in_flight() < p.lanes.len() * cfg.queue_depth;
        tokio::select! {
            biased;
            () = cancel.cancelled() => {
                p.abort();
                tracing::warn!(token, "term ended: intake stopped");
                return TermEnd::Lost;
            }
            () = cx.shutdown.cancelled() => break,
            Some(r) = p.done.recv() => {
                if p.on_done(r).is_err() {
                    p.abort();
                    return TermEnd::Lost;
                }
            }
            _ = tick.tick() => {
                if commit(cx, &term, &mut p, false).await.is_err() {
                    p.abort();
                    return TermEnd::Lost;
                }
                let (delivered, in_flight) = (sub.cursor(), p.watermark.in_flight());
                let lag = delivered.zip(p.committed).map_or(0, |(d, c)| d.saturating_sub(c));
                metrics::gauge!("firekeeper_lag_seq").set(lag as f64);
                cx.shared.update(|s| { s.last_seq = delivered; s.in_flight = in_flight; });
            }
            item = sub.next(), if has_room => match item {
                Ok(Item::Frame(f)) => {
                    let Some(ev) = to_event(cfg, &f.bytes, f.seq) else {
                        // Filtered out whole: done at once so the cursor moves past it.
                        if p.watermark.deliver(f.seq).is_ok() { p.watermark.complete(f.seq); }
                        continue;
                    };
                    if let Err(e) = p.watermark.deliver(ev.seq) {
                        tracing::error!(error = %e, "watermark refused a delivery");
                        continue;
                    }
                    let lane = p.lane_of(ev.did.as_deref());
                    tokio::select! {
                        r = p.lanes[lane].send(ev) => if r.is_err() { p.abort(); return TermEnd::Lost; },
                        () = cancel.cancelled() => { p.abort(); return TermEnd::Lost; }
                    }
                }
                Ok(Item::Notice(n)) => on_notice(cx, &n),
                Ok(Item::SwitchRelay { from, to, reason }) => {
                    let kind = if reason == SwitchReason::Failback { "failback" } else { "failover" };
                    metrics::counter!("firekeeper_relay_switches_total", "to" => to.as_str(), "kind" => kind).increment(1);
                    let drained = tokio::select! {
                        r = p.drain() => r.is_ok(),
                        () = cancel.cancelled() => false,
                    };
                    if !drained || commit(cx, &term, &mut p, true).await.is_err() {
                        p.abort();
                        return TermEnd::Lost;
                    }
                    tracing::info!(from = from.as_str(), to = to.as_str(), committed = ?p.committed, "relay switch: committed the current relay first");
                    role = to;
                    let fp = ctx_for(cfg, &term, role).fingerprint;
                    let cursor = match read_cursor(cx, &term, role, &fp).await {
                        None => return TermEnd::Lost,
                        Some(Err(e)) => return TermEnd::Fatal(anyhow!("reading the {role} cursor: {e}")),
                        Some(Ok(c)) => c,
                    };
                    p = Pipeline::new(cfg, &cx.sink, ctx_for(cfg, &term, role), cursor);
                    sub.start(role, cursor);
                    cx.shared.update(|s| { s.relay = Some(role.as_str()); s.fingerprint = Some(fp); s.committed = cursor; });
                }
                Err(e @ SubscribeError::FutureCursor { .. }) => {
                    p.abort();
                    return TermEnd::Fatal(anyhow!("{e}; set FIREKEEPER_FUTURE_CURSOR=live to accept the gap, or fix the cursor with `firekeeper cursor set`"));
                }
                Err(SubscribeError::Closed) => {
                    p.abort();
                    return TermEnd::Fatal(anyhow!("relay subscription closed unexpectedly"));
                }
            },
        }
    }
    // Voluntary step-down: keep renewing while the lanes drain, commit, then release.
    cx.shared.update(|s| s.role = "stepping-down");
    tracing::info!(token, in_flight = p.watermark.in_flight(), "draining before release");
    sub.close().await;
    let drain = async {
        p.drain().await.map_err(|e| e.to_string())?;
        commit(cx, &term, &mut p, true).await.map_err(|()| "final commit fenced".to_owned())?;
        if p.committed != p.watermark.committable() {
            return Err("final commit did not land".to_owned());
        }
        Ok::<(), String>(())
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
