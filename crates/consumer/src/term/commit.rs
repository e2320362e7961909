//! Commits: the fenced watermark commit (tick, settle, final), the fenced rewind that
//! places a stream, and the lag figures refreshed at each tick.

use checkpoint::{CommitOutcome, Fence, Write};
use tracing::Instrument;

use super::{Ctx, Leader, Rewind, Step, TermEnd, while_active};
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

/// Commits the watermark if it moved.
pub(super) async fn commit(cx: &Ctx<'_>, term: &lease::Term, p: &mut Pipeline, final_: bool) -> Commit {
    // Act only while the term is active, whatever the store would answer: a process that
    // was frozen past its deadline must not commit before its supervisor notices.
    if !term.is_active() {
        return Commit::Fenced;
    }
    let Some(c) = p.watermark.committable() else { return Commit::Idle };
    if p.committed.is_some_and(|done| done >= c) {
        return Commit::Idle;
    }
    if cx.handler.commits_cursor() {
        // The handler committed it in the same transaction as its writes (with the time
        // of its batch's last event); the time is still needed here for relay switches.
        p.times.take_until(c);
        p.committed = Some(c);
        cx.status.update(|s| s.committed = Some(c));
        return Commit::Committed(c);
    }
    let relay = p.ctx.relay.as_str();
    let span = tracing::info_span!("commit", cursor = c, token = p.ctx.token, relay, final_);
    let holder = term.holder();
    let fence = Fence { holder: &holder, token: term.token() };
    let time = p.times.take_until(c);
    let out = cx.store.write(Write::advance(&p.ctx.fingerprint, c, time), fence).instrument(span).await;
    let label = match &out {
        Ok(CommitOutcome::Saved) => "saved",
        Ok(CommitOutcome::NotNewer { .. }) => "not_newer",
        Ok(CommitOutcome::Fenced { .. }) => "fenced",
        Err(_) => "error",
    };
    metrics::counter!(m::COMMITS, "outcome" => label).increment(1);
    match out {
        Ok(CommitOutcome::Saved | CommitOutcome::NotNewer { .. }) => {
            p.committed = Some(c);
            cx.remember(&p.ctx.fingerprint, c, false);
            cx.status.update(|s| s.committed = Some(c));
            Commit::Committed(c)
        }
        Ok(CommitOutcome::Fenced { current: None }) => {
            // No lease key at all (e.g. Redis lost its data): not proof of a newer term.
            // The lease either retakes the key or loses at its deadline; retry until then.
            tracing::warn!(token = p.ctx.token, cursor = c, "commit refused: no lease key in the store; retrying");
            Commit::Retry
        }
        Ok(CommitOutcome::Fenced { current }) => {
            tracing::error!(
                token = p.ctx.token,
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

impl Leader<'_, '_> {
    /// A fenced rewind (or first commit) of the stored cursor to `cursor`, retried while
    /// the store is unavailable.
    async fn reset_cursor(&mut self, cursor: u64) -> Result<(), Step> {
        let (cx, term) = (self.cx, &self.term);
        let fp = self.p.ctx.fingerprint.clone();
        let holder = term.holder();
        let fence = Fence { holder: &holder, token: term.token() };
        let out = while_active(cx, term, "reset cursor", || cx.store.write(Write::rewind(&fp, cursor), fence)).await?;
        match out {
            Ok(CommitOutcome::Saved | CommitOutcome::NotNewer { .. }) => {
                cx.remember(&fp, cursor, true);
                self.p.committed = Some(cursor);
                cx.status.update(|s| s.committed = Some(cursor));
                Ok(())
            }
            Ok(CommitOutcome::Fenced { .. }) => Err(Step::End(TermEnd::Lost)),
            Err(source) => Err(Fatal::Reset { cursor, source }.into()),
        }
    }

    /// Places a stream by its first seq: the stored cursor goes to just before it.
    pub(super) async fn place(&mut self, why: Rewind, seq: u64) -> Result<(), Step> {
        if let Rewind::WentLive(rejected) = why {
            metrics::counter!(m::GAPS, "reason" => "future_cursor").increment(1);
            tracing::error!(
                relay = self.role.as_str(),
                rejected_cursor = ?rejected,
                live_from = seq,
                "accepted gap (future-cursor policy `live`): events after the rejected cursor that the relay no \
                 longer numbers that way are skipped; the stored cursor is rewound to just before the first live seq"
            );
        }
        self.reset_cursor(seq.saturating_sub(1)).await
    }

    /// The commit tick: commit, close the overlap window once the position passed it,
    /// then refresh the lag figures.
    pub(super) async fn tick(&mut self) -> Step {
        if commit(self.cx, &self.term, &mut self.p, false).await == Commit::Fenced {
            return Step::End(TermEnd::Lost);
        }
        if let Some(until) = self.overlap_until
            && self.p.times.at_cursor().is_some_and(|t| t > until)
        {
            tracing::info!(relay = self.role.as_str(), "switch overlap over: no more duplicates to drop");
            self.overlap_until = None;
        }
        let (delivered, in_flight) = (self.sub.cursor(), self.p.watermark.in_flight());
        let lag = delivered.zip(self.p.committed).map_or(0, |(d, c)| d.saturating_sub(c));
        metrics::gauge!(m::LAG_SEQ).set(lag as f64);
        let lag_seconds = age_seconds(&self.last_time);
        if let Some(l) = lag_seconds {
            metrics::gauge!(m::LAG_SECONDS).set(l);
        }
        if let Some(c) = &self.chains {
            metrics::gauge!(m::CHAIN_REPOS).set(c.len() as f64);
        }
        self.cx.status.update(|s| {
            s.last_seq = delivered;
            s.in_flight = in_flight;
            s.lag_seconds = lag_seconds.or(s.lag_seconds);
        });
        Step::Next
    }
}
