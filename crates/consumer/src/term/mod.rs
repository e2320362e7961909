//! The leader's work for one term: read the cursor, subscribe, hand events to the lanes,
//! commit the watermark fenced, switch relays, and drain on step-down.
//!
//! A term goes through these steps (each in its own file):
//!
//! ```text
//!  elected ──▶ start: on_elected, active relay, resume point ──┬─▶ Placing ─┐ first seq:
//!                                                               │           │ fenced rewind
//!                                                               └─▶ Streaming ◀┘
//!   intake: frame → lane (guarded wait for room), commit tick,      │   ▲
//!   lane results → watermark                                        │   │ first seq
//!                                                                   ▼   │
//!   switch: settle, commit, probe the target ── refused ──▶ Refused ────┘
//!           └── ok: fresh pipeline on the target ──▶ Placing / Streaming
//!                                                           (+ an overlap window)
//!   relay went live (FutureCursor=live): settle, fresh pipeline ──▶ Placing
//!
//!  any phase ── term lost / fenced ──────────────────────▶ TermEnd::Lost
//!            ── shutdown ──▶ drain: renew while lanes finish, final commit, release
//!            ── fatal (bad frame, invalid under `fail`) ──▶ settle, commit ──▶ TermEnd::Fatal
//! ```
//!
//! The overlap window after a switch is not a phase: it outlives a refused switch and a
//! relay going live, since both replay events that may have been handed over already.

mod commit;
mod drain;
mod intake;
mod resync;
mod start;
mod switch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use checkpoint::{CursorStore, StoreError};
use futures_util::FutureExt as _;
use lease::{LeaseHandle, StepDownError, Term};
use relay_client::backoff::{Backoff, BackoffConfig};
use relay_client::{RelayRole, RelayUrl, Subscription};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::builder::Settings;
use crate::continuity::{Memory, Overlap};
use crate::error::Fatal;
use crate::handler::{BatchCtx, Handler, HandlerError};
use crate::pipeline::{LaneStop, Pipeline, Shape};
use crate::status::StatusHandle;

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
            cursor_hold: crate::handler::CursorHold::default(),
        }
    }

    fn remember(&self, fp: &str, cursor: u64, replace: bool) {
        if let Ok(mut m) = self.remembered.lock() {
            let e = m.entry(fp.to_owned()).or_insert(cursor);
            *e = if replace { cursor } else { (*e).max(cursor) };
        }
    }

    /// The switch overlap in ms.
    fn overlap_ms(&self) -> i64 {
        i64::try_from(self.settings.options.switch_overlap.as_millis()).unwrap_or(i64::MAX / 4)
    }

    /// The clock-skew allowance in ms.
    fn skew_ms(&self) -> i64 {
        i64::try_from(self.settings.options.switch_skew.as_millis()).unwrap_or(i64::MAX / 4)
    }
}

/// Why a term's work stops before its end: the one control type of every step. A step
/// returns `Result<_, Stop>` (`Ok` goes on), and `?` carries a stop to the work loop,
/// which ends the term with it.
#[derive(Debug)]
enum Stop {
    /// Shutdown requested: step down.
    Shutdown,
    /// The term is over (lost, fenced, expired, or a fatal condition).
    End(TermEnd),
}

impl From<Fatal> for Stop {
    fn from(f: Fatal) -> Self {
        Self::End(TermEnd::Fatal(f))
    }
}

/// Runs `f` until it finishes, the term ends, or shutdown is requested: no await in the
/// work loop may outlive either.
async fn guarded<T>(cx: &Ctx<'_>, term: &Term, f: impl Future<Output = T>) -> Result<T, Stop> {
    tokio::select! {
        biased;
        () = term.ended() => Err(Stop::End(TermEnd::Lost)),
        () = cx.shutdown.cancelled() => Err(Stop::Shutdown),
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
) -> Result<Result<T, StoreError>, Stop> {
    let mut backoff = Backoff::new(STORE_RETRY);
    loop {
        if !term.is_active() {
            return Err(Stop::End(TermEnd::Lost));
        }
        match guarded(cx, term, f()).await? {
            Err(StoreError::Unavailable(e)) => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %causes::Report(&*e), what, retry_ms = delay.as_millis() as u64, "cursor store unavailable; not subscribing until it answers");
                guarded(cx, term, tokio::time::sleep(delay)).await?;
            }
            other => return Ok(other),
        }
    }
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

/// Where the leader stands on its relay's stream (the diagram in the module doc).
#[derive(Debug)]
enum Phase {
    /// Subscribed with no known position: the first seq rewinds the stored cursor,
    /// fenced, to just before it.
    Placing(Rewind),
    /// Reading from a known position.
    Streaming,
    /// A relay switch was refused (see [`switch::Refusal`]): staying on the relay it had
    /// and retrying it until events flow again. `placing` is a placement still owed when
    /// the refusal came before the stream's first frame.
    Refused { refused: switch::Refused, placing: Option<Rewind> },
}

/// One term's moving parts.
struct Leader<'a, 'c> {
    cx: &'a Ctx<'c>,
    term: Term,
    role: RelayRole,
    sub: Subscription,
    p: Pipeline,
    phase: Phase,
    /// After a switch: drop what the memory proves was handed over (never anything by
    /// its time alone: a PDS lagging behind sends new events with old times).
    overlap: Option<Overlap>,
    /// The time of the newest delivered event (lag is computed from it at each tick).
    last_time: String,
    /// What this term handed over, per repo: the chain check's state and the switch's
    /// proof (`None` with neither a chain check nor a secondary relay).
    memory: Option<Arc<Memory>>,
    /// The events counter by type, registered once.
    events: crate::metrics::EventCounters,
    /// The tick's cursor write, while the store has not answered.
    flight: Option<commit::Flight<'c>>,
    /// Ticks since the last cursor write.
    quiet_ticks: u32,
    /// The committed cursor at the last tick, and since when it stands there.
    committed_since: (Option<u64>, std::time::Instant),
    /// Intake waits: nothing was committed for `uncommitted_max` while there was
    /// something to commit (the store does not take commits).
    commit_stalled: bool,
    /// The term's resync worker (repo sync on).
    resync: Option<resync::ResyncRun>,
    /// Repos whose snapshot this term handed over: their older events are dropped.
    covered: resync::Covered,
    /// Accounts this term saw turn inactive (repo sync's reactivation trigger).
    inactive: std::collections::HashSet<String>,
}

impl Leader<'_, '_> {
    /// Intake until the term ends or shutdown is requested.
    async fn run(&mut self) -> Option<TermEnd> {
        let mut tick = tokio::time::interval(self.cx.settings.options.commit_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cancel = self.term.cancellation();
        let mut burst = 0usize;
        loop {
            let has_room = self.p.has_room() && !self.commit_stalled;
            if self.p.has_staged() {
                // Read on while the socket has frames ready (a bounded burst, so the tick,
                // the lanes' results and cancellation are still seen); before waiting,
                // send what is staged, so a quiet stream's events are not held back.
                let ready = if has_room && burst < BURST { self.sub.next().now_or_never() } else { None };
                let step = if let Some(item) = ready {
                    burst += 1;
                    self.on_item(item).await
                } else {
                    burst = 0;
                    self.send_all().await
                };
                match step {
                    Ok(()) => continue,
                    Err(Stop::Shutdown) => return None,
                    Err(Stop::End(end)) => return Some(self.ended(end)),
                }
            }
            let step = tokio::select! {
                biased;
                () = cancel.cancelled() => Err(Stop::End(TermEnd::Lost)),
                () = self.cx.shutdown.cancelled() => Err(Stop::Shutdown),
                // Before the done results: a busy stream always has one ready, and a
                // biased select would never reach the commit tick behind them.
                _ = tick.tick() => self.tick(),
                out = commit::landed(&mut self.flight) => self.on_landed(out),
                Some(r) = self.p.next_done() => match self.p.on_done(r) {
                    Ok(()) => Ok(()),
                    Err(why) => self.lane_stopped(why).await,
                },
                Some(r) = resync::next_ready(&mut self.resync) => self.stage_snapshot(r).await,
                item = self.sub.next(), if has_room => self.on_item(item).await,
            };
            match step {
                Ok(()) => {}
                Err(Stop::Shutdown) => return None,
                Err(Stop::End(end)) => return Some(self.ended(end)),
            }
        }
    }

    /// A lane stopped for good: an invalid event under `fail` or a sink that cannot go on
    /// stops the consumer (everything before committed); anything else ends the term.
    async fn lane_stopped(&mut self, why: LaneStop) -> Result<(), Stop> {
        match why {
            LaneStop::Invalid(stop) => {
                let (seq, invalid) = *stop;
                Err(self.stop(Fatal::Invalid { seq, invalid: Box::new(invalid) }).await)
            }
            LaneStop::Handler(e @ HandlerError::Fatal { .. }) => Err(self.stop(Fatal::Sink(e)).await),
            LaneStop::Handler(_) => Err(Stop::End(TermEnd::Lost)),
        }
    }

    /// A lane's queue closed under intake: a lane that stopped sent its reason before
    /// its queue closed, so it is on the done channel, behind the results it sent before
    /// (none there: it died, and the term ends).
    async fn lane_gone(&mut self) -> Result<(), Stop> {
        while let Some(r) = self.p.try_done() {
            if let Err(why) = self.p.on_done(r) {
                return self.lane_stopped(why).await;
            }
        }
        Err(Stop::End(TermEnd::Lost))
    }

    fn ended(&self, end: TermEnd) -> TermEnd {
        if matches!(end, TermEnd::Lost) {
            tracing::warn!(token = self.term.token(), "term ended: intake stopped");
        }
        end
    }
}

/// Frames read in a row without looking at the tick, the lanes' results or cancellation.
const BURST: usize = 256;

/// Runs one term until it is lost, shut down, or hits a fatal condition.
pub(crate) async fn run_term(cx: &Ctx<'_>, term: Term) -> TermEnd {
    let span = tracing::info_span!("term", token = term.token(), epoch = term.epoch());
    cx.status.set_term(Some(term.clone()));
    // Boxed once per term: the term's state machine is large, the caller's future stays small.
    let end = Box::pin(start::run(cx, term).instrument(span)).await;
    // The supervisor waits for every clone of a lost term to drop before contending.
    cx.status.set_term(None);
    end
}
