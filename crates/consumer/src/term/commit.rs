//! Commits: the fenced watermark commit (tick, settle, final), the fenced rewind that
//! places a stream, and the lag figures refreshed at each tick.

use checkpoint::{CommitOutcome, Fence, StoreError, Write};
use tracing::Instrument;

use super::{Ctx, Leader, Rewind, Stop, TermEnd, guarded, while_active};
use crate::error::Fatal;
use crate::metrics as m;
use crate::pipeline::Pipeline;

/// What a commit attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Commit {
    /// Nothing new to commit.
    Idle,
    /// The store holds this cursor now (or the handler committed it with its writes).
    Committed(u64),
    /// The store did not take it this time (unavailable, or no lease key to fence
    /// against): the next attempt retries.
    Retry,
    /// A newer term owns the cursor, or this term is no longer active: the term is over.
    Fenced,
}

/// Seconds from an RFC 3339 timestamp to now.
fn age_seconds(t: &str) -> Option<f64> {
    let t = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()?;
    Some((time::OffsetDateTime::now_utc() - t).as_seconds_f64())
}

/// Ticks without a write after which the committed cursor is written again.
const REASSERT_TICKS: u32 = 10;

/// A cursor write under way: the tick starts it and the intake reads on meanwhile (a
/// store round trip or an fsync must not stall the socket); it lands in the work loop,
/// or is awaited before anything else writes the cursor.
pub(super) struct Flight<'s> {
    cursor: u64,
    write: futures_util::future::BoxFuture<'s, Result<CommitOutcome, StoreError>>,
}

impl Flight<'_> {
    /// Waits for the write and takes in how it ended.
    pub(super) async fn land(self, cx: &Ctx<'_>, p: &mut Pipeline) -> Commit {
        let out = self.write.await;
        finish(cx, p, self.cursor, out)
    }
}

/// The write in flight, once it finishes; never resolves when there is none.
pub(super) async fn landed(f: &mut Option<Flight<'_>>) -> Result<CommitOutcome, StoreError> {
    match f {
        Some(f) => f.write.as_mut().await,
        None => std::future::pending().await,
    }
}

/// What starting a commit led to.
enum Begun<'s> {
    /// Decided without the store.
    Done(Commit),
    /// The store must take it.
    Write(Flight<'s>),
}

/// Starts committing the watermark if it moved (or, with `again`, also when it did not:
/// the write then restores a cursor the store lost, and is `NotNewer` otherwise).
fn begin<'s>(cx: &Ctx<'s>, term: &lease::Term, p: &mut Pipeline, final_: bool, again: bool) -> Begun<'s> {
    // Act only while the term is active, whatever the store would answer: a process that
    // was frozen past its deadline must not commit before its supervisor notices.
    if !term.is_active() {
        return Begun::Done(Commit::Fenced);
    }
    let Some(c) = p.committable() else { return Begun::Done(Commit::Idle) };
    if !again && p.committed().is_some_and(|done| done >= c) {
        return Begun::Done(Commit::Idle);
    }
    if cx.handler.commits_cursor() {
        // The handler committed it in the same transaction as its writes (with the time
        // of its batch's last event); the time is still needed here for relay switches.
        p.take_time_until(c);
        p.set_committed(c);
        cx.status.update(|s| s.committed = Some(c));
        return Begun::Done(Commit::Committed(c));
    }
    let relay = p.ctx().relay.as_str();
    let span = tracing::info_span!("commit", cursor = c, token = p.ctx().token, relay, final_);
    let (holder, token) = (term.holder(), term.token());
    let fingerprint = p.ctx().fingerprint.clone();
    let time = p.take_time_until(c);
    let store = cx.store;
    let write = async move {
        let fence = Fence { holder: &holder, token };
        store.write(Write::advance(&fingerprint, c, time), fence).await
    };
    Begun::Write(Flight { cursor: c, write: Box::pin(write.instrument(span)) })
}

/// Takes in how a write of cursor `c` ended.
fn finish(cx: &Ctx<'_>, p: &mut Pipeline, c: u64, out: Result<CommitOutcome, StoreError>) -> Commit {
    let label = match &out {
        Ok(CommitOutcome::Saved) => "saved",
        Ok(CommitOutcome::NotNewer { .. }) => "not_newer",
        Ok(CommitOutcome::Fenced { .. }) => "fenced",
        Err(_) => "error",
    };
    metrics::counter!(m::COMMITS, "outcome" => label).increment(1);
    match out {
        Ok(CommitOutcome::Saved | CommitOutcome::NotNewer { .. }) => {
            if matches!(out, Ok(CommitOutcome::Saved)) && p.committed().is_some_and(|done| done >= c) {
                tracing::warn!(cursor = c, "the store had lost this term's committed cursor: written again");
            }
            p.raise_committed(c);
            cx.remember(&p.ctx().fingerprint, c, false);
            cx.status.update(|s| s.committed = p.committed());
            Commit::Committed(c)
        }
        Ok(CommitOutcome::Fenced { current: None }) => {
            // No lease key at all (e.g. Redis lost its data): not proof of a newer term.
            // The lease either retakes the key or loses at its deadline; retry until then.
            tracing::warn!(token = p.ctx().token, cursor = c, "commit refused: no lease key in the store; retrying");
            Commit::Retry
        }
        Ok(CommitOutcome::Fenced { current }) => {
            tracing::error!(
                token = p.ctx().token,
                ?current,
                cursor = c,
                "commit fenced: a newer term owns the cursor; stopping"
            );
            Commit::Fenced
        }
        Err(e) => {
            tracing::warn!(error = %e, cursor = c, "commit failed; will retry");
            Commit::Retry
        }
    }
}

/// Commits the watermark if it moved, waiting for the store.
pub(super) async fn commit(cx: &Ctx<'_>, term: &lease::Term, p: &mut Pipeline, final_: bool) -> Commit {
    match begin(cx, term, p, final_, false) {
        Begun::Done(c) => c,
        Begun::Write(f) => f.land(cx, p).await,
    }
}

impl Leader<'_, '_> {
    /// Bounds what a crash can replay: when nothing was committed for
    /// `uncommitted_max` while there was something to commit (the cursor store does not
    /// take commits), intake waits until a commit lands.
    fn bound_uncommitted(&mut self) {
        let committed = self.p.committed();
        if committed != self.committed_since.0 {
            self.committed_since = (committed, std::time::Instant::now());
        }
        let pending = self.p.committable().is_some_and(|c| committed.is_none_or(|d| c > d));
        let stalled = pending && self.committed_since.1.elapsed() >= self.cx.settings.options.uncommitted_max;
        if stalled != self.commit_stalled {
            self.commit_stalled = stalled;
            self.cx.status.set_commit_stalled(stalled);
            if stalled {
                tracing::error!(
                    committed = ?committed,
                    for_ms = self.committed_since.1.elapsed().as_millis() as u64,
                    "the cursor store takes no commits: intake waits, so a crash now repeats no more than was handed over before"
                );
            } else {
                tracing::info!(committed, "commits land again: intake goes on");
            }
        }
    }

    /// A fenced rewind (or first commit) of the stored cursor to `cursor`, retried while
    /// the store is unavailable.
    async fn reset_cursor(&mut self, cursor: u64) -> Result<(), Stop> {
        // A rewind replaces the cursor: no earlier write may land after it.
        self.land().await?;
        let (cx, term) = (self.cx, &self.term);
        let fp = self.p.ctx().fingerprint.clone();
        let holder = term.holder();
        let fence = Fence { holder: &holder, token: term.token() };
        let out = while_active(cx, term, "reset cursor", || cx.store.write(Write::rewind(&fp, cursor), fence)).await?;
        match out {
            Ok(CommitOutcome::Saved | CommitOutcome::NotNewer { .. }) => {
                cx.remember(&fp, cursor, true);
                self.p.set_committed(cursor);
                cx.status.update(|s| s.committed = Some(cursor));
                Ok(())
            }
            Ok(CommitOutcome::Fenced { .. }) => Err(Stop::End(TermEnd::Lost)),
            Err(source) => Err(Fatal::Reset { cursor, source }.into()),
        }
    }

    /// Places a stream by its first seq: the stored cursor goes to just before it.
    pub(super) async fn place(&mut self, why: Rewind, seq: u64) -> Result<(), Stop> {
        if let Rewind::WentLive(rejected) = why {
            metrics::counter!(m::GAPS, "reason" => "future_cursor").increment(1);
            tracing::error!(
                relay = self.role.as_str(),
                rejected_cursor = rejected,
                live_from = seq,
                "accepted gap (future-cursor policy `live`): events after the rejected cursor that the relay no \
                 longer numbers that way are skipped; the stored cursor is rewound to just before the first live seq"
            );
            self.gap_accepted("future_cursor");
        }
        self.reset_cursor(seq.saturating_sub(1)).await
    }

    /// A write started by the tick finished.
    pub(super) fn on_landed(&mut self, out: Result<CommitOutcome, StoreError>) -> Result<(), Stop> {
        let f = self.flight.take().expect("a write in flight");
        if finish(self.cx, &mut self.p, f.cursor, out) == Commit::Fenced {
            return Err(Stop::End(TermEnd::Lost));
        }
        Ok(())
    }

    /// Waits for the tick's write in flight, if any: before anything else writes the
    /// cursor or the pipeline is replaced, so writes land in the order they were made.
    pub(super) async fn land(&mut self) -> Result<(), Stop> {
        let Some(f) = self.flight.take() else { return Ok(()) };
        match guarded(self.cx, &self.term, f.land(self.cx, &mut self.p)).await? {
            Commit::Fenced => Err(Stop::End(TermEnd::Lost)),
            _ => Ok(()),
        }
    }

    /// The commit tick: start a commit, close the overlap window once the position passed it,
    /// then refresh the lag figures.
    pub(super) fn tick(&mut self) -> Result<(), Stop> {
        // One write at a time: a tick while one is in flight only refreshes the figures.
        if self.flight.is_none() {
            // A quiet stream writes its cursor again now and then: a store that lost it
            // (failed over to a lagging replica, restored from a backup) gets it back
            // without waiting for the next event.
            self.quiet_ticks += 1;
            let again = self.quiet_ticks >= REASSERT_TICKS;
            match begin(self.cx, &self.term, &mut self.p, false, again) {
                Begun::Done(Commit::Fenced) => return Err(Stop::End(TermEnd::Lost)),
                Begun::Done(_) => {}
                Begun::Write(f) => {
                    self.quiet_ticks = 0;
                    self.flight = Some(f);
                }
            }
        }
        self.bound_uncommitted();
        let position = self.p.time_at_cursor();
        if self.overlap.as_ref().is_some_and(|o| o.over(position)) {
            tracing::info!(relay = self.role.as_str(), "switch overlap over: no more duplicates to drop");
            self.overlap = None;
        }
        let (delivered, in_flight) = (self.sub.cursor(), self.p.in_flight());
        let lag = delivered.zip(self.p.committed()).map_or(0, |(d, c)| d.saturating_sub(c));
        metrics::gauge!(m::UNCOMMITTED_SEQ).set(lag as f64);
        if let Some(c) = self.p.committed() {
            metrics::gauge!(m::COMMITTED_SEQ).set(c as f64);
        }
        let lag_seconds = age_seconds(&self.last_time);
        if let Some(l) = lag_seconds {
            metrics::gauge!(m::LAG_SECONDS).set(l);
        }
        if let Some(memory) = &self.memory {
            // Without a stored position, the memory starts at the first one committed.
            if let Some(t) = position {
                memory.place(t);
            }
            metrics::gauge!(m::CHAIN_REPOS).set(memory.repos() as f64);
        }
        self.cx.status.update(|s| {
            s.last_seq = delivered;
            s.in_flight = in_flight;
            s.lag_seconds = lag_seconds.or(s.lag_seconds);
        });
        Ok(())
    }
}
