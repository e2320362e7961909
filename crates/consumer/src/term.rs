//! The leader's work for one term: read the cursor, subscribe, hand events to the lanes,
//! commit the watermark fenced, switch relays, and drain on step-down.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use checkpoint::{CommitOutcome, CursorStore, Fence, ReadOutcome, RelayKey, StoreError};
use lease::{LeaseHandle, StepDownError, Term};
use relay_client::backoff::{Backoff, BackoffConfig};
use relay_client::client::SwitchReason;
use relay_client::probe::{ProbeError, find_start, time_ms};
use relay_client::{Item, Message, Notice, OwnedFrame, RelayRole, RelayUrl, SubscribeError, Subscription};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::Settings;
use crate::chain::{ChainBreaks, Chains};
use crate::continuity::{GapPolicy, Recent};
use crate::error::Fatal;
use crate::handler::{BatchCtx, Event, Handler};
use crate::metrics as m;
use crate::pipeline::{LaneStop, Pipeline, Shape};
use crate::status::{Role, StatusHandle};

/// Committed cursors per relay fingerprint, as seen by this process (its own commits and,
/// through the store's feed, every replica's).
pub(crate) type Remembered = Mutex<HashMap<String, u64>>;

/// How a term ended.
#[derive(Debug)]
pub(crate) enum TermEnd {
    /// Lost (expired, taken, fenced): contend again.
    Lost,
    /// Shutdown requested; the step-down result.
    Shutdown(Result<(), StepDownError>),
    /// A condition an operator must fix.
    Fatal(Fatal),
}

/// Everything a term needs.
pub(crate) struct Ctx<'a> {
    pub(crate) settings: &'a Settings,
    pub(crate) shape: Shape,
    pub(crate) store: &'a dyn CursorStore,
    pub(crate) handler: Arc<dyn Handler>,
    pub(crate) lease: &'a LeaseHandle,
    pub(crate) shutdown: &'a CancellationToken,
    pub(crate) status: &'a StatusHandle,
    pub(crate) remembered: &'a Remembered,
}

impl Ctx<'_> {
    fn url(&self, role: RelayRole) -> &RelayUrl {
        match role {
            RelayRole::Primary => &self.settings.primary,
            RelayRole::Secondary => self.settings.secondary.as_ref().unwrap_or(&self.settings.primary),
        }
    }

    fn batch_ctx(&self, term: &Term, role: RelayRole) -> BatchCtx {
        BatchCtx {
            token: term.token(),
            relay: role,
            fingerprint: self.url(role).fingerprint().to_owned(),
            cancel: term.cancellation(),
            term: term.clone(),
        }
    }

    fn remember(&self, fp: &str, cursor: u64, replace: bool) {
        if let Ok(mut m) = self.remembered.lock() {
            let e = m.entry(fp.to_owned()).or_insert(cursor);
            *e = if replace { cursor } else { (*e).max(cursor) };
        }
    }
}

/// Why a wait inside a term ended early.
enum Interrupted {
    /// The term ended (lost, fenced, expired).
    TermEnded,
    /// Shutdown requested: step down.
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

/// Store retries: 200 ms doubling to 5 s, jittered.
const STORE_RETRY: BackoffConfig = BackoffConfig { initial: Duration::from_millis(200), max: Duration::from_secs(5) };

/// Retries `f` while the store is unavailable, logging what it waits for and the next
/// delay; ends early when the term ends or shutdown is requested.
///
/// `f` is a plain closure returning a future (not an `AsyncFnMut`): the future of an
/// async closure cannot be proven `Send`, and `Consumer::run` must be spawnable.
async fn while_active<T, F: Future<Output = Result<T, StoreError>>>(
    cx: &Ctx<'_>,
    term: &Term,
    what: &str,
    mut f: impl FnMut() -> F,
) -> Result<Result<T, StoreError>, Interrupted> {
    let mut backoff = Backoff::new(STORE_RETRY);
    loop {
        if !term.is_active() {
            return Err(Interrupted::TermEnded);
        }
        match guarded(cx, term, f()).await? {
            Err(StoreError::Unavailable(e)) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, what, retry_ms = delay.as_millis() as u64, "cursor store unavailable; not subscribing until it answers");
                guarded(cx, term, tokio::time::sleep(delay)).await?;
            }
            other => return Ok(other),
        }
    }
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

impl From<Fatal> for Step {
    fn from(f: Fatal) -> Self {
        Self::End(TermEnd::Fatal(f))
    }
}

/// Where `role`'s stream resumes. `at_term_start` applies the rule that a missing cursor
/// is only a fresh start when no earlier term existed.
async fn resume_point(cx: &Ctx<'_>, term: &Term, role: RelayRole, at_term_start: bool) -> Result<Option<u64>, Step> {
    let fp = cx.url(role).fingerprint();
    let r = while_active(cx, term, "read cursor", || cx.store.read(fp)).await?;
    let r = r.map_err(|source| Fatal::ReadCursor { role, source })?;
    let remembered = cx.remembered.lock().ok().and_then(|m| m.get(fp).copied());
    match (r, remembered) {
        (ReadOutcome::Found(c), _) => {
            tracing::info!(relay = role.as_str(), cursor = c, "resuming from stored cursor");
            Ok(Some(c))
        }
        // A lower stored value may be an operator's rewind and is honoured; a missing one
        // after this process saw a commit means the store lost data.
        (ReadOutcome::Missing | ReadOutcome::Corrupt(_), Some(mine)) => {
            tracing::error!(
                relay = role.as_str(),
                committed_here = mine,
                "the store lost this relay's cursor; resuming from the last commit this process saw"
            );
            Ok(Some(mine))
        }
        // Token 1 is the first term this lease store ever issued: a fresh deployment. A
        // later token means some term ran before and (very likely) committed: the store
        // lost the cursor, and the live tail would skip everything in between.
        (ReadOutcome::Missing | ReadOutcome::Corrupt(_), None) if at_term_start && term.token() > 1 => {
            Err(Fatal::CursorLost { role, fingerprint: fp.to_owned(), token: term.token() }.into())
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
    if cx.handler.commits_cursor() {
        // The handler committed it in the same transaction as its writes (with the time
        // of its batch's last event); the time is still needed here for relay switches.
        p.times.take_until(c);
        p.committed = Some(c);
        cx.status.update(|s| s.committed = Some(c));
        return Ok(());
    }
    let relay = p.ctx.relay.as_str();
    let span = tracing::info_span!("commit", cursor = c, token = p.ctx.token, relay, final_);
    let holder = term.holder();
    let fence = Fence { holder: &holder, token: term.token() };
    let time = p.times.take_until(c);
    let out = cx.store.commit_at(&p.ctx.fingerprint, c, time, fence).instrument(span).await;
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

fn on_notice(cx: &Ctx<'_>, n: &Notice) {
    match n {
        Notice::Connected { relay, .. } => {
            cx.status.update(|s| s.connected = true);
            tracing::info!(relay = relay.as_str(), "relay connected");
        }
        Notice::Disconnected { relay, error, .. } => {
            cx.status.update(|s| s.connected = false);
            metrics::counter!(m::RECONNECTS, "relay" => relay.as_str(), "reason" => error.reason()).increment(1);
            if let relay_client::ConnError::ErrorFrame { error, .. } = error {
                metrics::counter!(m::ERROR_FRAMES, "error" => error.clone()).increment(1);
            }
        }
        Notice::BadFrame { error, seq, .. } => {
            let policy = if seq.is_some() { "skipped" } else { "unplaced" };
            metrics::counter!(m::BAD_FRAMES, "reason" => error.reason(), "action" => policy).increment(1);
        }
        Notice::SeqBackwards { .. } => metrics::counter!(m::SEQ_BACKWARDS).increment(1),
        Notice::OutdatedCursor { .. } => metrics::counter!(m::OUTDATED_CURSOR).increment(1),
        Notice::Info { .. } | Notice::WentLive { .. } => {}
    }
}

/// The switch overlap in ms.
fn overlap_ms(s: &Settings) -> i64 {
    i64::try_from(s.options.switch_overlap.as_millis()).unwrap_or(i64::MAX / 4)
}

/// The clock-skew allowance in ms.
fn skew_ms(s: &Settings) -> i64 {
    i64::try_from(s.options.switch_skew.as_millis()).unwrap_or(i64::MAX / 4)
}

/// This process's clock, Unix ms.
fn now_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX / 4)
}

/// True when the repo's chain proves `m` was handed over: a `#commit` whose rev is not
/// newer than the last one seen for its repo.
fn handed_over(chains: &Chains, m: &Message<'_>) -> bool {
    matches!(m, Message::Commit(c) if chains.covers(c.repo, c.rev))
}

/// How often a standing refusal is logged again.
const REFUSAL_LOG_EVERY: Duration = Duration::from_mins(1);

/// Why a relay switch was refused: switching would lose events, and the relay the
/// leader had may come back. The leader stays, retries it, and is not ready meanwhile.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The target's window does not reach back to the committed position.
    Gap {
        /// The relay switched to.
        to: RelayRole,
        /// The relay time needed (RFC 3339).
        needed: String,
        /// The oldest time it serves (RFC 3339).
        oldest: String,
        /// The oldest seq it serves.
        oldest_seq: u64,
    },
    /// Finding where to resume on the target failed (it may be down too).
    Probe {
        /// The relay switched to.
        to: RelayRole,
        /// What went wrong.
        source: ProbeError,
    },
    /// No event time and no stored cursor on the target: no position to carry over.
    Unplaced {
        /// The relay switched to.
        to: RelayRole,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Gap { to, needed, oldest, oldest_seq } => write!(
                f,
                "the {to} relay serves events only from {oldest} (seq {oldest_seq}), but events from {needed} on are \
                 needed: switching would lose those in between (to accept such a gap set FIREKEEPER_GAP=live, or \
                 choose the start with `firekeeper cursor set --relay {to} <seq>`)"
            ),
            Self::Probe { to, source } => write!(f, "finding where to resume on the {to} relay: {source}"),
            Self::Unplaced { to } => write!(
                f,
                "no event time is known yet and the {to} relay has no stored cursor, so nothing places the position \
                 there (its live tail would skip the backlog): set one with `firekeeper cursor set --relay {to} <seq>`, \
                 or FIREKEEPER_GAP=live to start at its oldest event"
            ),
        }
    }
}

/// A standing refusal.
#[derive(Debug)]
struct Refused {
    /// When the target was last probed.
    probed: std::time::Instant,
    /// When the refusal was last logged.
    logged: std::time::Instant,
}

/// Unix ms as RFC 3339 (for messages).
fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| format!("{ms} ms"))
}

/// Seconds from an RFC 3339 timestamp to now.
fn age_seconds(t: &str) -> Option<f64> {
    let t = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()?;
    Some((time::OffsetDateTime::now_utc() - t).as_seconds_f64())
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
    /// The time of the newest delivered event (lag is computed from it at each tick).
    last_time: String,
    /// What was handed over recently (kept only with a secondary relay configured).
    recent: Option<Recent>,
    /// After a switch, until the position (the robust time at the committed cursor, not
    /// any one event's clock) passes this relay time: drop what `recent` or the repo's
    /// chain proves was handed over. Never anything by its time alone (a PDS lagging
    /// behind sends new events with old times).
    dedupe: Option<i64>,
    /// A switch refused and not yet overcome (see [`Refusal`]).
    refused: Option<Refused>,
    /// Each recent repo's last rev, for the chain check (`None` when it is off).
    chains: Option<Chains>,
}

impl Leader<'_, '_> {
    fn pipeline(&self, role: RelayRole, start: Option<u64>) -> Pipeline {
        Pipeline::new(&self.cx.shape, &self.cx.handler, self.cx.batch_ctx(&self.term, role), start)
    }

    /// Subscribes to `role` from `cursor` on the current pipeline.
    fn begin(&mut self, role: RelayRole, cursor: Option<u64>) {
        let fp = self.p.ctx.fingerprint.clone();
        self.role = role;
        self.rewind = cursor.is_none().then_some(Rewind::FreshStart);
        self.sub.start(role, cursor);
        metrics::gauge!(m::ON_SECONDARY).set(if role == RelayRole::Secondary { 1.0 } else { 0.0 });
        self.cx.status.update(|s| {
            s.relay = Some(role);
            s.fingerprint = Some(fp);
            s.committed = cursor;
        });
    }

    /// Where to resume on `to` after committing the current relay at relay time `at`: its
    /// stored cursor when that is inside the overlap, else found by time on the relay.
    /// A switch that would lose events (a real gap under `GapPolicy::Fail`, a relay that
    /// cannot be probed, no position known at all) is refused instead.
    async fn switch_start(&mut self, to: RelayRole, at: Option<i64>) -> Result<Result<Option<u64>, Refusal>, Step> {
        let (cx, opts) = (self.cx, &self.cx.settings.options);
        let stored = resume_point(cx, &self.term, to, false).await?;
        let Some(at) = at else {
            // Nothing delivered carried a time yet: there is no position to carry over.
            // The target's own stored cursor is a position on it; without one, the live
            // tail would skip everything after the committed cursor.
            if stored.is_some() {
                return Ok(Ok(stored));
            }
            if opts.gap == GapPolicy::Live {
                tracing::error!(
                    relay = to.as_str(),
                    "no event time is known yet and the relay switched to has no stored cursor: starting at its oldest \
                     event (FIREKEEPER_GAP=live); what it no longer serves is missing"
                );
                metrics::counter!(m::GAPS, "reason" => "switch_unplaced").increment(1);
                return Ok(Ok(Some(0)));
            }
            return Ok(Err(Refusal::Unplaced { to }));
        };
        let fp = cx.url(to).fingerprint();
        let overlap = overlap_ms(cx.settings);
        let target = at - overlap;
        let stored_time = match guarded(cx, &self.term, cx.store.read_time(fp)).await? {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "reading the stored time of the relay switched to; probing instead");
                None
            }
        };
        if let (Some(c), Some(t)) = (stored, stored_time)
            && (target..=at).contains(&t)
        {
            tracing::info!(relay = to.as_str(), cursor = c, "switch: the stored cursor is inside the overlap");
            return Ok(Ok(Some(c)));
        }
        let wait = cx.settings.client.connect_timeout;
        // Boxed: the probe's WebSocket state would otherwise sit in every enclosing future.
        let probe = Box::pin(find_start(cx.url(to), target, opts.switch_max_probes, wait));
        let found = guarded(cx, &self.term, probe).await?;
        match found {
            Ok(f) => {
                metrics::counter!(m::SWITCH_PROBES).increment(u64::from(f.probes));
                tracing::info!(
                    relay = to.as_str(),
                    cursor = f.cursor,
                    probes = f.probes,
                    probe_ms = f.elapsed.as_millis() as u64,
                    overlap_ms = overlap,
                    "switch: found where to resume by time"
                );
                Ok(Ok(Some(f.cursor)))
            }
            // The window does not hold the whole overlap, but reaches back past the
            // position (less the clocks' skew): nothing is missing, the overlap is short.
            Err(ProbeError::Gap { oldest_ms, oldest_seq }) if oldest_ms < at - skew_ms(cx.settings) => {
                metrics::counter!(m::SWITCH_OVERLAP_SHORT).increment(1);
                tracing::warn!(
                    relay = to.as_str(),
                    cursor = oldest_seq - 1,
                    overlap_ms = at - oldest_ms,
                    wanted_ms = overlap,
                    "switch: the relay's window holds less than the overlap but reaches back past the position; \
                     starting at its oldest event"
                );
                Ok(Ok(Some(oldest_seq - 1)))
            }
            Err(ProbeError::Gap { oldest_ms, oldest_seq }) => {
                let (needed, oldest) = (rfc3339(at), rfc3339(oldest_ms));
                if opts.gap == GapPolicy::Fail {
                    return Ok(Err(Refusal::Gap { to, needed, oldest, oldest_seq }));
                }
                metrics::counter!(m::GAPS, "reason" => "switch").increment(1);
                let gap = format!("{} relay: events from {needed} to {oldest} are missing", to.as_str());
                tracing::error!(relay = to.as_str(), from = %needed, to = %oldest, "accepted gap (FIREKEEPER_GAP=live) on a relay switch");
                cx.status.update(|s| s.last_gap = Some(gap));
                Ok(Ok(Some(oldest_seq - 1)))
            }
            Err(source) => Ok(Err(Refusal::Probe { to, source })),
        }
    }

    /// Stays on the relay it had after a refused switch: counts the refusal (logged at
    /// most once a minute) and resumes there from the committed position. A refused
    /// failover is shown (`/status`, not ready, the gauge): nothing flows until the relay
    /// returns. A refused failback is not: the secondary still serves.
    fn refuse(&mut self, from: RelayRole, why: &Refusal, reason: SwitchReason) {
        metrics::counter!(m::SWITCH_REFUSED).increment(1);
        let now = std::time::Instant::now();
        let log = self.refused.as_ref().is_none_or(|r| now.duration_since(r.logged) >= REFUSAL_LOG_EVERY);
        if reason == SwitchReason::Failback {
            if log {
                tracing::warn!(relay = from.as_str(), refused = %why, "failback refused: staying on the secondary relay");
            }
        } else {
            if log {
                tracing::error!(
                    relay = from.as_str(),
                    refused = %why,
                    "relay switch refused: staying on this relay and retrying it; not ready until events flow again"
                );
            }
            metrics::gauge!(m::SWITCH_REFUSED_NOW).set(1.0);
            self.cx.status.set_refused_switch(Some(why.to_string()));
        }
        let logged = if log { now } else { self.refused.as_ref().map_or(now, |r| r.logged) };
        self.refused = Some(Refused { probed: now, logged });
        self.sub.stay();
    }

    /// Events flow again after a refused switch.
    fn clear_refusal(&mut self) {
        if self.refused.take().is_some() {
            tracing::info!(relay = self.role.as_str(), "events flow again after a refused relay switch");
            metrics::gauge!(m::SWITCH_REFUSED_NOW).set(0.0);
            self.cx.status.set_refused_switch(None);
        }
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
    /// An event failed verification under the `fail` policy: take in what the other
    /// lanes finish, commit up to just before it, and stop.
    async fn stop_at_invalid(&mut self, (seq, invalid): (u64, crate::verify::Invalid)) -> Step {
        let e = Fatal::Invalid { seq, invalid: Box::new(invalid) };
        tracing::error!(error = %e, "stopping: this needs an operator");
        self.sub.close().await;
        if let Err(i) = guarded(self.cx, &self.term, self.p.wind_down()).await {
            return i.into();
        }
        if commit(self.cx, &self.term, &mut self.p, true).await.is_err() {
            return Step::End(TermEnd::Lost);
        }
        Step::End(TermEnd::Fatal(e))
    }

    async fn fatal(&mut self, e: Fatal) -> Step {
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
        let holder = term.holder();
        let fence = Fence { holder: &holder, token: term.token() };
        let out = while_active(cx, term, "reset cursor", || cx.store.reset(&fp, cursor, fence)).await?;
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

    /// Handles the first frame after going live or starting fresh.
    async fn on_first_seq(&mut self, why: Rewind, seq: u64) -> Result<(), Step> {
        if let Rewind::WentLive(rejected) = why {
            metrics::counter!(m::GAPS, "reason" => "future_cursor").increment(1);
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
    async fn on_frame(&mut self, f: OwnedFrame) -> Step {
        let seq = f.seq;
        if let Some(why) = self.rewind.take()
            && let Err(s) = self.on_first_seq(why, seq).await
        {
            return s;
        }
        if self.refused.is_some() {
            self.clear_refusal();
        }
        let m = f.message();
        let time = if self.recent.is_some() || seq.is_multiple_of(64) { m.time().and_then(time_ms) } else { None };
        // A PDS clock ahead of this one's (plus the allowance) is not believed.
        let time = time.map(|t| t.min(now_ms().saturating_add(skew_ms(self.cx.settings))));
        if let Some(t) = time {
            self.p.times.push(seq, t);
        }
        if let Some(recent) = &mut self.recent {
            if self.dedupe.is_some() && (recent.seen(m) || self.chains.as_ref().is_some_and(|c| handed_over(c, m))) {
                metrics::counter!(m::SWITCH_DUPLICATES).increment(1);
                return self.pass(seq);
            }
            recent.record(m);
        }
        // Every commit counts for the chain, whether the filter keeps it or not.
        let broke = self.chains.as_mut().and_then(|c| match m {
            Message::Commit(cm) => c.commit(cm.repo, cm.rev, cm.since),
            Message::Sync(sy) => {
                c.sync(sy.did, sy.rev);
                None
            }
            _ => None,
        });
        let emit = match broke {
            Some(b) => {
                metrics::counter!(m::CHAIN_BREAKS).increment(1);
                tracing::warn!(
                    seq,
                    relay = self.role.as_str(),
                    repo = %b.repo,
                    last_rev = %b.last_rev,
                    since = %b.since,
                    rev = %b.rev,
                    "repo chain broken: the relay skipped a commit of this repo; resync it"
                );
                (self.cx.settings.options.chain_breaks == ChainBreaks::Emit).then_some(b)
            }
            None => None,
        };
        // A filtered-out commit that reveals a break still goes out, to carry the break.
        // Under verification it goes to its lane hidden: the repo's chain needs every
        // commit, and an invalid one is handed over as `#invalid` whatever the filter.
        let hidden = emit.is_none() && self.cx.settings.options.collections.as_ref().is_some_and(|c| c.drops(m));
        if hidden && self.cx.shape.verifier.is_none() {
            return self.pass(seq);
        }
        if !hidden {
            metrics::counter!(m::EVENTS, "type" => m.kind().as_str()).increment(1);
        }
        if let Some(t) = m.time() {
            self.last_time.clear();
            self.last_time.push_str(t);
        }
        let lane = self.p.lane_of(m.did());
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
        if let Err(error) = self.p.watermark.deliver(seq) {
            // Intake only reads while the window has room, and the client delivers in
            // increasing seq order: this is a bug, and skipping would lose the event.
            return Fatal::Watermark { seq, error }.into();
        }
        self.cx.status.add_events(1);
        let mut e = Event::new(f);
        e.hidden = hidden;
        if let Some(b) = emit {
            e.set_chain_break(b);
        }
        permit.send(e);
        Step::Next
    }

    fn pass(&mut self, seq: u64) -> Step {
        match self.p.pass(seq) {
            Ok(()) => Step::Next,
            Err(error) => Fatal::Watermark { seq, error }.into(),
        }
    }

    /// The commit tick: commit, then refresh the lag figures.
    async fn tick(&mut self) -> Step {
        if commit(self.cx, &self.term, &mut self.p, false).await.is_err() {
            return Step::End(TermEnd::Lost);
        }
        if let Some(until) = self.dedupe
            && self.p.times.at_cursor().is_some_and(|t| t > until)
        {
            tracing::info!(relay = self.role.as_str(), "switch overlap over: no more duplicates to drop");
            self.dedupe = None;
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
                    let at = self.p.times.at_cursor();
                    self.p = self.pipeline(self.role, None);
                    self.p.times.carry(at);
                    self.rewind = Some(Rewind::WentLive(rejected));
                }
                Step::Next
            }
            Ok(Item::SwitchRelay { from, to, reason }) => {
                // While a refused switch stands, the target is probed again at most once
                // per probe interval; in between, the relay it had is retried.
                let every = self.cx.settings.client.probe_interval;
                if self.refused.as_ref().is_some_and(|r| r.probed.elapsed() < every) {
                    self.sub.stay();
                    return Step::Next;
                }
                let kind = if reason == SwitchReason::Failback { "failback" } else { "failover" };
                metrics::counter!(m::RELAY_SWITCHES, "to" => to.as_str(), "kind" => kind).increment(1);
                if let Err(s) = self.settle().await {
                    return s;
                }
                tracing::info!(from = from.as_str(), to = to.as_str(), committed = ?self.p.committed, "relay switch: committed the current relay first");
                let at = self.p.times.at_cursor();
                match self.switch_start(to, at).await {
                    Ok(Ok(cursor)) => {
                        self.clear_refusal();
                        self.p = self.pipeline(to, cursor);
                        self.p.times.carry(at);
                        self.begin(to, cursor);
                        let overlap = overlap_ms(self.cx.settings);
                        self.dedupe = at.map(|w| w.saturating_add(overlap));
                        Step::Next
                    }
                    Ok(Err(why)) => {
                        // The settled pipeline's lanes are closed: a fresh one on the
                        // same relay, from the committed position.
                        let start = self.p.committed.or(self.sub.cursor());
                        self.p = self.pipeline(from, start);
                        self.p.times.carry(at);
                        self.refuse(from, &why, reason);
                        Step::Next
                    }
                    Err(s) => s,
                }
            }
            Err(e @ SubscribeError::FutureCursor { .. }) => self.fatal(Fatal::FutureCursor(e)).await,
            Err(e @ (SubscribeError::BadFrame { .. } | SubscribeError::FrameTooLarge { .. })) => {
                self.fatal(Fatal::BadFrame(e)).await
            }
            Err(SubscribeError::Closed) => self.fatal(Fatal::Closed).await,
        }
    }

    /// Intake until the term ends or shutdown is requested.
    async fn run(&mut self) -> Option<TermEnd> {
        let mut tick = tokio::time::interval(self.cx.settings.options.commit_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cancel = self.term.cancellation();
        loop {
            let has_room = self.p.watermark.has_room();
            let step = tokio::select! {
                biased;
                () = cancel.cancelled() => Step::End(TermEnd::Lost),
                () = self.cx.shutdown.cancelled() => Step::Shutdown,
                // Before the done results: a busy stream always has one ready, and a
                // biased select would never reach the commit tick behind them.
                _ = tick.tick() => self.tick().await,
                Some(r) = self.p.done.recv() => match self.p.on_done(r) {
                    Ok(()) => Step::Next,
                    Err(LaneStop::Invalid(stop)) => self.stop_at_invalid(*stop).await,
                    Err(LaneStop::Handler(_)) => Step::End(TermEnd::Lost),
                },
                item = self.sub.next(), if has_room => self.on_item(item).await,
            };
            match step {
                Step::Next => {}
                Step::Shutdown => return None,
                Step::End(end) => {
                    if matches!(end, TermEnd::Lost) {
                        tracing::warn!(token = self.term.token(), "term ended: intake stopped");
                    }
                    return Some(end);
                }
            }
        }
    }

    /// Voluntary step-down: keep renewing while the lanes drain, commit, then release.
    async fn step_down(mut self) -> TermEnd {
        let cx = self.cx;
        cx.status.update(|s| s.role = Role::SteppingDown);
        tracing::info!(token = self.term.token(), in_flight = self.p.watermark.in_flight(), "draining before release");
        self.sub.close().await;
        let Leader { term, mut p, .. } = self;
        let drain = async {
            p.drain().await.map_err(|e| e.to_string())?;
            // A store that is briefly away does not make the step-down unclean: retry the
            // final commit while the term lasts (the drain budget bounds it too).
            loop {
                commit(cx, &term, &mut p, true)
                    .await
                    .map_err(|()| "final commit fenced or the term ended".to_owned())?;
                if p.committed == p.watermark.committable() {
                    return Ok::<(), String>(());
                }
                tracing::warn!(cursor = ?p.watermark.committable(), retry_ms = 100, "final commit did not land yet; retrying while the term lasts");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        TermEnd::Shutdown(cx.lease.step_down_with(drain, cx.settings.options.drain_budget).await)
    }
}

/// The stores' view of the configured relays.
fn relay_keys(s: &Settings) -> Vec<(String, String, bool)> {
    std::iter::once(&s.primary)
        .chain(s.secondary.as_ref())
        .map(|u| (u.fingerprint().to_owned(), u.host_port(), u.is_root()))
        .collect()
}

async fn run_term_inner(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let token = term.token();
    cx.status.update(|s| {
        s.role = Role::Leader;
        s.token = Some(token);
    });
    metrics::gauge!(m::LEADER).set(1.0);
    let keys = relay_keys(cx.settings);
    let keys: Vec<RelayKey<'_>> =
        keys.iter().map(|(f, h, r)| RelayKey { fingerprint: f, host_port: h, is_root: *r }).collect();
    let holder = term.holder();
    let fence = Fence { holder: &holder, token };
    match while_active(cx, &term, "on election", || cx.store.on_elected(fence, &keys)).await {
        Err(Interrupted::TermEnded) => return TermEnd::Lost,
        Err(Interrupted::Shutdown) => return TermEnd::Shutdown(cx.lease.release().await),
        Ok(Err(e @ StoreError::LegacyAmbiguous { .. })) => return TermEnd::Fatal(Fatal::LegacyAmbiguous(e)),
        Ok(Err(e)) => return TermEnd::Fatal(Fatal::Elected(e)),
        Ok(Ok(())) => {}
    }
    // Resume on the relay the last committing leader was on: its cursor is where the
    // stream stands (the other relay's is older, and numbered differently).
    let active = match guarded(cx, &term, cx.store.active_relay()).await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "reading the active relay failed; starting on the primary");
            None
        }
        Err(Interrupted::TermEnded) => return TermEnd::Lost,
        Err(Interrupted::Shutdown) => return TermEnd::Shutdown(cx.lease.release().await),
    };
    let on_secondary = cx.settings.secondary.as_ref().is_some_and(|s| active.as_deref() == Some(s.fingerprint()));
    let role = if on_secondary { RelayRole::Secondary } else { RelayRole::Primary };
    if on_secondary {
        tracing::info!("the last leader was on the secondary relay: resuming there");
    }
    let cursor = match resume_point(cx, &term, role, true).await {
        Ok(c) => c,
        Err(Step::Shutdown) => return TermEnd::Shutdown(cx.lease.release().await),
        Err(Step::End(end)) => return end,
        Err(Step::Next) => unreachable!("resume_point never asks to go on"),
    };
    let s = cx.settings;
    let sub = Subscription::new(s.client.clone(), s.primary.clone(), s.secondary.clone());
    let mut p = Pipeline::new(&cx.shape, &cx.handler, cx.batch_ctx(&term, role), cursor);
    // The position by time, as the last leader left it.
    match guarded(cx, &term, cx.store.read_time(cx.url(role).fingerprint())).await {
        Ok(Ok(t)) => p.times.carry(t),
        Ok(Err(e)) => tracing::warn!(error = %e, "reading the stored time of the cursor failed"),
        Err(Interrupted::TermEnded) => return TermEnd::Lost,
        Err(Interrupted::Shutdown) => return TermEnd::Shutdown(cx.lease.release().await),
    }
    // Twice the overlap: a relay's order is only roughly by time, so events a little older
    // than the overlap's start can still come after it.
    let recent = s.secondary.as_ref().map(|_| Recent::new(2 * overlap_ms(s)));
    let chains = (s.options.chain_repos > 0).then(|| Chains::new(s.options.chain_repos));
    let mut l = Leader {
        cx,
        term,
        role,
        sub,
        p,
        rewind: None,
        last_time: String::new(),
        recent,
        dedupe: None,
        chains,
        refused: None,
    };
    l.begin(role, cursor);
    match l.run().await {
        Some(end) => end,
        None => l.step_down().await,
    }
}

/// Runs one term until it is lost, shut down, or hits a fatal condition.
pub(crate) async fn run_term(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let span = tracing::info_span!("term", token = term.token(), epoch = term.epoch());
    cx.status.set_term(Some(term.clone()));
    // Boxed once per term: the term's state machine is large, the caller's future stays small.
    let end = Box::pin(run_term_inner(cx, term).instrument(span)).await;
    // The supervisor waits for every clone of a lost term to drop before contending.
    cx.status.set_term(None);
    end
}
