//! The supervisor: one task per process that contends for the lease, renews it, and
//! announces every change of leadership exactly once.
//!
//! ```text
//!            acquire ok                      renew fails past deadline / key taken
//! Standby ───────────────▶ Leader(term) ──────────────────────────────▶ Lost ─┐
//!   ▲  poll + jitter,          │  step_down(): keep renewing, stop contending │
//!   │  wake on release         ▼                                              │
//!   │                     SteppingDown ── release() ──▶ Released (exit)       │
//!   │                          └───────── abandon() ──▶ left to expire (exit) │
//!   └──────────── every clone of the lost Term dropped ◀──────────────────────┘
//! ```
//!
//! The leader acts only while `now < deadline`, where the deadline is the *send* time of
//! the last successful renewal plus `ttl - margin`. A timer fires at the deadline itself,
//! whatever the backend says or does not say.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use crate::backend::{Acquire, Backend, BackendError, Renew};
use crate::clock::Clock;
use crate::config::{ConfigError, LeaseConfig};

/// One continuous leadership. Cheap to clone; the supervisor waits until every clone of
/// a lost term is dropped before contending again, so two terms of one process never
/// overlap.
#[derive(Clone)]
pub struct Term(Arc<TermInner>);

struct TermInner {
    instance: Arc<str>,
    token: u64,
    epoch: u64,
    /// Deadline as clock nanoseconds; only ever moves forward.
    deadline_ns: AtomicU64,
    cancel: CancellationToken,
    clock: Arc<dyn Clock>,
    _done: oneshot::Sender<()>,
}

impl std::fmt::Debug for Term {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Term")
            .field("token", &self.0.token)
            .field("epoch", &self.0.epoch)
            .field("active", &self.is_active())
            .finish_non_exhaustive()
    }
}

impl Term {
    /// The fencing token: every write made for this term carries it.
    #[must_use]
    pub fn token(&self) -> u64 {
        self.0.token
    }

    /// The local term counter of this process.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.0.epoch
    }

    /// This process's instance id.
    #[must_use]
    pub fn instance(&self) -> &str {
        &self.0.instance
    }

    /// The lease value of this term, `<instance>:<token>`: stores that can see the lease
    /// fence on the whole value, so a re-issued token number alone is not enough.
    #[must_use]
    pub fn holder(&self) -> String {
        format!("{}:{}", self.0.instance, self.0.token)
    }

    /// True while the term is not over and its deadline has not passed. Check it
    /// before every externally visible action.
    #[must_use]
    pub fn is_active(&self) -> bool {
        !self.0.cancel.is_cancelled() && self.remaining() > Duration::ZERO
    }

    /// Time left until the deadline.
    #[must_use]
    pub fn remaining(&self) -> Duration {
        let deadline = Duration::from_nanos(self.0.deadline_ns.load(Ordering::Acquire));
        deadline.saturating_sub(self.0.clock.now())
    }

    /// Fires when the term ends (lost, released or abandoned).
    #[must_use]
    pub fn cancellation(&self) -> CancellationToken {
        self.0.cancel.clone()
    }

    /// Waits until the term ends.
    pub async fn ended(&self) {
        self.0.cancel.cancelled().await;
    }

    /// A bound for work done under another process's term: a repo-sync job a standby
    /// claimed from the shared queue, written under the publishing term's `token`. Active
    /// for `span` on `clock`, longer with each [`Term::lend_more`]; ended by cancelling
    /// [`Term::cancellation`] (the claim was lost).
    #[must_use]
    pub fn lent(instance: &str, token: u64, clock: Arc<dyn Clock>, span: Duration) -> Self {
        let (done, _) = oneshot::channel();
        let deadline = clock.now() + span;
        Term(Arc::new(TermInner {
            instance: instance.into(),
            token,
            epoch: 0,
            deadline_ns: AtomicU64::new(u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX)),
            cancel: CancellationToken::new(),
            clock,
            _done: done,
        }))
    }

    /// Moves a lent term's deadline to `span` from now (never earlier).
    pub fn lend_more(&self, span: Duration) {
        self.extend_to(self.0.clock.now() + span);
    }

    fn extend_to(&self, deadline: Duration) {
        self.0.deadline_ns.fetch_max(u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX), Ordering::AcqRel);
    }

    fn end(&self) {
        self.0.cancel.cancel();
    }
}

/// Why a term was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LossReason {
    /// No renewal succeeded before the deadline (store down, slow, paused, or we were).
    Expired,
    /// Another instance holds the key.
    TakenBy(String),
    /// The key vanished and the fence counter moved past our token.
    Fenced(Option<u64>),
    /// The caller gave the term up ([`LeaseHandle::resign`]), e.g. because a fenced
    /// store refused its token. The key is left to expire.
    Resigned,
}

impl std::fmt::Display for LossReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Expired => f.write_str("no renewal landed before the deadline"),
            Self::TakenBy(holder) => write!(f, "{holder} holds the key"),
            Self::Fenced(Some(fence)) => write!(f, "the key vanished and the fence moved to {fence}"),
            Self::Fenced(None) => f.write_str("the key vanished and the fence moved"),
            Self::Resigned => f.write_str("given up by the consumer"),
        }
    }
}

impl LossReason {
    /// Short label for metrics and logs.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::TakenBy(_) => "taken",
            Self::Fenced(_) => "fenced",
            Self::Resigned => "resigned",
        }
    }
}

/// A change of leadership, announced once each.
#[derive(Debug)]
pub enum LeaseEvent {
    /// This process leads; act only while the term is active.
    Elected(Term),
    /// The term ended without our consent: stop intake at once, commit nothing more.
    Lost {
        /// The term's token.
        token: u64,
        /// Why.
        reason: LossReason,
    },
    /// The term ended by voluntary release after a drain.
    Released {
        /// The term's token.
        token: u64,
    },
}

/// The supervisor's current role, for status pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Contending.
    Standby,
    /// Leading.
    Leader {
        /// Fencing token.
        token: u64,
    },
    /// Leading, renewing, while the caller drains.
    SteppingDown {
        /// Fencing token.
        token: u64,
    },
    /// Exited.
    Stopped,
}

/// Why a voluntary step-down did not end in a clean release.
#[derive(Debug, thiserror::Error)]
pub enum StepDownError {
    /// The drain reported an error; the lease was left to expire.
    #[error("drain failed ({}); lease left to expire", causes::Report(.0.as_ref()))]
    DrainFailed(#[source] crate::backend::Cause),
    /// The drain outlived its budget; the lease was left to expire.
    #[error("drain exceeded its {0:?} budget; lease left to expire")]
    DrainTimeout(Duration),
    /// The term was lost during the drain.
    #[error("leadership was lost during the drain")]
    Lost,
    /// The release call failed; the lease will expire on its own.
    #[error("release failed: {0}; the lease will expire on its own")]
    ReleaseFailed(#[source] BackendError),
    /// The supervisor task is gone.
    #[error("lease supervisor is not running")]
    Gone,
}

enum Command {
    StepDown(oneshot::Sender<()>),
    Release(oneshot::Sender<Result<(), StepDownError>>),
    Abandon(oneshot::Sender<()>),
    Shutdown(oneshot::Sender<()>),
    Resign(oneshot::Sender<()>),
}

/// Control of a running supervisor.
#[derive(Debug)]
pub struct LeaseHandle {
    cmd: mpsc::UnboundedSender<Command>,
    status: watch::Receiver<Status>,
    instance: Arc<str>,
    seen: Arc<AtomicU64>,
    trouble: Arc<std::sync::Mutex<Option<String>>>,
    held_back: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// What a process remembers from before it started (kept on its own disk), so that a
/// lease store that lost its data cannot hand out a token again or elect a replica that
/// knows nothing ahead of one that does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prior {
    /// The highest token this process (or an earlier run of it) has seen: every token it
    /// acquires is above it.
    pub floor: u64,
    /// It remembers nothing (no local record, no cursor in the store): when the lease
    /// store is empty too (no holder, no fence), it watches for one ttl before its first
    /// acquire, so that a replica that remembers the last term (a higher floor, a shadowed
    /// cursor) takes it first.
    pub cold: bool,
    /// Start held back: watch the lease (and remember the tokens seen) without acquiring
    /// it until [`LeaseHandle::hold_back`] lets go (the caller's settings differ from the
    /// deployment's).
    pub held_back: bool,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::StepDown(_) => "StepDown",
            Self::Release(_) => "Release",
            Self::Abandon(_) => "Abandon",
            Self::Shutdown(_) => "Shutdown",
            Self::Resign(_) => "Resign",
        })
    }
}

impl LeaseHandle {
    /// This process's instance id.
    #[must_use]
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The current role.
    #[must_use]
    pub fn status(&self) -> Status {
        *self.status.borrow()
    }

    /// A receiver of role changes.
    #[must_use]
    pub fn watch_status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.cmd.send(make(tx)).ok()?;
        rx.await.ok()
    }

    /// Stops contending; a leader keeps renewing until [`LeaseHandle::release`] or
    /// [`LeaseHandle::abandon`]. A standby simply exits.
    pub async fn step_down(&self) {
        let _ = self.ask(Command::StepDown).await;
    }

    /// Releases the lease (after the caller drained) so a standby takes over at once.
    pub async fn release(&self) -> Result<(), StepDownError> {
        self.ask(Command::Release).await.unwrap_or(Err(StepDownError::Gone))
    }

    /// Stops renewing without releasing: the lease expires on its own. For a drain that
    /// failed, when releasing might let a successor start before our writes settled.
    pub async fn abandon(&self) {
        let _ = self.ask(Command::Abandon).await;
    }

    /// Step-down in one call: stop contending, run `drain` within `budget` while the
    /// lease is kept renewed, then release; a drain that fails or runs over abandons.
    pub async fn step_down_with<E: Into<crate::backend::Cause>>(
        &self,
        drain: impl std::future::Future<Output = Result<(), E>>,
        budget: Duration,
    ) -> Result<(), StepDownError> {
        self.step_down().await;
        match timeout(budget, drain).await {
            Ok(Ok(())) => self.release().await,
            Ok(Err(e)) => {
                self.abandon().await;
                Err(StepDownError::DrainFailed(e.into()))
            }
            Err(_) => {
                self.abandon().await;
                Err(StepDownError::DrainTimeout(budget))
            }
        }
    }

    /// Stops at once: a standby exits (releasing anything an in-flight acquire just
    /// took); a leader releases without draining.
    pub async fn shutdown(&self) {
        let _ = self.ask(Command::Shutdown).await;
    }

    /// Ends the current term without releasing (the key expires on its own) and goes back
    /// to standby. For a leader whose work found it can no longer act (a store refused its
    /// token); without this the lease would be renewed for a term nobody works in.
    /// No effect when not leading.
    pub async fn resign(&self) {
        let _ = self.ask(Command::Resign).await;
    }

    /// The highest token this process has held or seen another holder with (its floor).
    #[must_use]
    pub fn seen_token(&self) -> u64 {
        self.seen.load(Ordering::Relaxed)
    }

    /// Why a standby cannot use the lease store now (down, refusing the credentials,
    /// answering nonsense): `None` while its last call succeeded. A replica that cannot
    /// reach the store could not take over, so it is not ready.
    #[must_use]
    pub fn store_trouble(&self) -> Arc<std::sync::Mutex<Option<String>>> {
        self.trouble.clone()
    }

    /// While `true`, a standby watches the lease without acquiring it (a replica whose
    /// settings differ from the deployment's must not take over); a leader is unaffected.
    pub fn hold_back(&self, held: bool) {
        self.held_back.store(held, Ordering::Relaxed);
    }

    /// Waits for the supervisor task to exit.
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

/// Starts a supervisor for a random instance id.
pub fn spawn(
    backend: Arc<dyn Backend>,
    cfg: LeaseConfig,
    clock: Arc<dyn Clock>,
) -> Result<(LeaseHandle, mpsc::UnboundedReceiver<LeaseEvent>), ConfigError> {
    spawn_as(backend, cfg, clock, &uuid::Uuid::new_v4().simple().to_string())
}

/// Starts a supervisor with an explicit instance id (tests, or a stable pod name).
pub fn spawn_as(
    backend: Arc<dyn Backend>,
    cfg: LeaseConfig,
    clock: Arc<dyn Clock>,
    instance: &str,
) -> Result<(LeaseHandle, mpsc::UnboundedReceiver<LeaseEvent>), ConfigError> {
    spawn_with(backend, cfg, clock, instance, Prior::default())
}

/// Starts a supervisor that remembers `prior` (its floor, whether it knows nothing).
pub fn spawn_with(
    backend: Arc<dyn Backend>,
    cfg: LeaseConfig,
    clock: Arc<dyn Clock>,
    instance: &str,
    prior: Prior,
) -> Result<(LeaseHandle, mpsc::UnboundedReceiver<LeaseEvent>), ConfigError> {
    cfg.validate()?;
    let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
    let (ev_tx, ev_rx) = mpsc::unbounded_channel();
    let (status_tx, status_rx) = watch::channel(Status::Standby);
    let instance: Arc<str> = Arc::from(instance);
    let seed =
        instance.bytes().fold(0x9e37_79b9_7f4a_7c15_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let wake = backend.release_signal();
    let floor = Arc::new(AtomicU64::new(prior.floor));
    let cold_until = prior.cold.then(|| clock.now() + cfg.ttl);
    let trouble: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let held_back = Arc::new(AtomicBool::new(prior.held_back));
    let sup = Supervisor {
        backend,
        cfg,
        clock,
        instance: instance.clone(),
        cmds: cmd_rx,
        events: ev_tx,
        status: status_tx,
        wake,
        epoch: 0,
        rng: seed | 1,
        stopping: false,
        seen: prior.floor,
        shared_seen: floor.clone(),
        not_before: None,
        cold_until,
        cold_warned: false,
        trouble: trouble.clone(),
        held_back: held_back.clone(),
    };
    let task = tokio::spawn(sup.run());
    Ok((LeaseHandle { cmd: cmd_tx, status: status_rx, instance, seen: floor, trouble, held_back, task }, ev_rx))
}

struct Supervisor {
    backend: Arc<dyn Backend>,
    cfg: LeaseConfig,
    clock: Arc<dyn Clock>,
    instance: Arc<str>,
    cmds: mpsc::UnboundedReceiver<Command>,
    events: mpsc::UnboundedSender<LeaseEvent>,
    status: watch::Sender<Status>,
    wake: Option<Arc<Notify>>,
    epoch: u64,
    rng: u64,
    /// A shutdown or step-down was asked for: never contend again.
    stopping: bool,
    /// The highest token this process has held or seen another holder with.
    seen: u64,
    /// `seen`, for [`LeaseHandle::seen_token`].
    shared_seen: Arc<AtomicU64>,
    /// A process that remembers nothing does not acquire from an empty store before
    /// this (clock time): see [`Prior::cold`].
    cold_until: Option<Duration>,
    /// The cold wait was logged.
    cold_warned: bool,
    /// Why the lease store cannot be used now (unreachable, credentials refused), shared
    /// with [`LeaseHandle::store_trouble`]; `None` while it answers.
    trouble: Arc<std::sync::Mutex<Option<String>>>,
    /// The latest key expiry observed on another holder (clock time): that holder may
    /// lead until then, so no term starts before it, even if the store loses the key.
    /// Cleared by a release, which the holder sends only after it stopped.
    not_before: Option<Duration>,
    /// See [`LeaseHandle::hold_back`].
    held_back: Arc<AtomicBool>,
}

enum LeadEnd {
    Lost(LossReason),
    Released,
    Abandoned,
}

fn transition(to: &'static str, reason: &'static str) {
    metrics::counter!(crate::metrics::TRANSITIONS, "to" => to, "reason" => reason).increment(1);
}

impl Supervisor {
    async fn run(mut self) {
        loop {
            let Some((term, done)) = self.contend().await else {
                break;
            };
            let token = term.token();
            match self.lead(&term).await {
                LeadEnd::Lost(reason) => {
                    term.end();
                    tracing::error!(token, reason = reason.label(), detail = %reason, "leadership lost; intake must stop now");
                    transition("standby", reason.label());
                    self.status.send_replace(Status::Standby);
                    let _ = self.events.send(LeaseEvent::Lost { token, reason });
                    drop(term);
                    self.wait_term_dropped(done, token).await;
                    if self.stopping {
                        break;
                    }
                }
                LeadEnd::Released => {
                    term.end();
                    transition("stopped", "released");
                    let _ = self.events.send(LeaseEvent::Released { token });
                    break;
                }
                LeadEnd::Abandoned => {
                    term.end();
                    transition("stopped", "abandoned");
                    tracing::warn!(token, "lease abandoned: it will expire on its own");
                    break;
                }
            }
        }
        self.status.send_replace(Status::Stopped);
        // Answer anything still queued so no caller waits forever.
        self.cmds.close();
        while let Some(c) = self.cmds.recv().await {
            match c {
                Command::Release(r) => {
                    let _ = r.send(Err(StepDownError::Lost));
                }
                Command::StepDown(r) | Command::Abandon(r) | Command::Shutdown(r) | Command::Resign(r) => {
                    let _ = r.send(());
                }
            }
        }
    }

    /// "Finish the loss before contending again": wait until the consumer dropped the term.
    async fn wait_term_dropped(&mut self, mut done: oneshot::Receiver<()>, token: u64) {
        loop {
            tokio::select! {
                _ = &mut done => return,
                () = sleep(Duration::from_secs(5)) => {
                    tracing::warn!(token, "still waiting for the lost term to be dropped before contending again");
                }
                c = self.cmds.recv() => match c {
                    Some(Command::Release(r)) => { let _ = r.send(Err(StepDownError::Lost)); }
                    Some(Command::StepDown(r) | Command::Abandon(r) | Command::Shutdown(r)) => {
                        self.stopping = true;
                        let _ = r.send(());
                    }
                    Some(Command::Resign(r)) => { let _ = r.send(()); }
                    None => self.stopping = true,
                },
            }
        }
    }

    fn jittered_poll(&mut self) -> Duration {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        // 80 %..120 % of the poll interval.
        let permille = 800 + self.rng % 401;
        self.cfg.poll * u32::try_from(permille).unwrap_or(1000) / 1000
    }

    async fn call<T>(&self, f: impl std::future::Future<Output = Result<T, BackendError>>) -> Result<T, BackendError> {
        // The backend enforces the op timeout itself; this is the supervisor's own belt.
        let belt = self.cfg.op_timeout + Duration::from_millis(50);
        timeout(belt, f).await.unwrap_or(Err(BackendError::Timeout(belt)))
    }

    /// Standby: returns a new term, or `None` on shutdown.
    async fn contend(&mut self) -> Option<(Term, oneshot::Receiver<()>)> {
        // When the store's trouble was last logged: once a minute while it lasts.
        let mut warned: Option<Duration> = None;
        loop {
            if self.stopping {
                return None;
            }
            let wake = self.wake.clone();
            let notified = wake.as_ref().map(|n| n.notified());
            tokio::pin!(notified);
            if let Some(n) = notified.as_mut().as_pin_mut() {
                n.enable();
            }
            let sent = self.clock.now();
            let r = if self.held_back.load(Ordering::Relaxed) {
                // Told not to take the lease: look only (the tokens seen still raise the
                // floor, a holder's expiry is still waited out once let go).
                self.watch_held_back().await.map(|()| None)
            } else if self.cold_until.is_some_and(|cu| sent < cu) {
                match self.watch_cold().await {
                    // The store has data: contend (or observe its holder) right away.
                    Ok(true) => continue,
                    r => r.map(|_| None),
                }
            } else if self.not_before.is_some_and(|nb| sent < nb) {
                // A holder seen earlier may still be leading although the store no longer
                // shows it: look, do not take.
                self.observe().await.map(|()| None)
            } else {
                self.call(self.backend.acquire(&self.instance, self.cfg.ttl, self.seen)).await.map(Some)
            };
            // A shutdown that arrived while the acquire was in flight wins, and whatever
            // was just acquired is released.
            while let Ok(c) = self.cmds.try_recv() {
                self.standby_command(c);
            }
            match r {
                Ok(Some(Acquire::Acquired { token })) => {
                    if self.stopping {
                        let _ = self.call(self.backend.release(&self.instance)).await;
                        tracing::info!(token, "released a lease acquired during shutdown");
                        return None;
                    }
                    return Some(self.new_term(token, sent));
                }
                Ok(Some(Acquire::Held { holder, .. })) if self.is_own(&holder) => {
                    self.store_answered(&mut warned);
                    // This process holds no term: the key is left over from one it lost
                    // (a renewal that landed after the deadline). Take it back now, or
                    // every standby waits out its ttl with nobody leading.
                    if self.release_own(&holder).await {
                        continue;
                    }
                }
                Ok(Some(Acquire::Held { holder, expires_in })) => {
                    self.store_answered(&mut warned);
                    self.on_held(&holder, expires_in);
                }
                Ok(None) => self.store_answered(&mut warned),
                Err(e) => self.store_failed(&e, &mut warned),
            }
            let mut poll = self.jittered_poll();
            if let Some(nb) = self.not_before {
                // Wake right when the observed expiry passes.
                poll = poll.min(nb.saturating_sub(self.clock.now()).max(Duration::from_millis(1)));
            }
            if let Some(cu) = self.cold_until {
                poll = poll.min(cu.saturating_sub(self.clock.now()).max(Duration::from_millis(1)));
            }
            tokio::select! {
                () = sleep(poll) => {}
                () = async { match notified.as_mut().as_pin_mut() { Some(n) => n.await, None => std::future::pending().await } } => {
                    self.not_before = None;
                }
                c = self.cmds.recv() => match c {
                    Some(c) => self.standby_command(c),
                    None => self.stopping = true,
                },
            }
        }
    }

    /// True when `holder` (`<instance>:<token>`) is this process.
    fn is_own(&self, holder: &str) -> bool {
        crate::backend::parse_holder(holder).is_some_and(|(i, _)| i == &*self.instance)
    }

    /// Releases a key this process holds without a term; true when it was released.
    async fn release_own(&mut self, holder: &str) -> bool {
        match self.call(self.backend.release(&self.instance)).await {
            Ok(released) => {
                if released {
                    metrics::counter!(crate::metrics::STALE_RELEASES).increment(1);
                    tracing::warn!(
                        holder,
                        "the lease key held this process's value from a term it lost (a renewal that landed after the deadline): released it"
                    );
                }
                self.not_before = None;
                released
            }
            Err(e) => {
                tracing::warn!(error = %crate::Report(&e), holder, "could not release a lease key left over from a lost term; retrying");
                false
            }
        }
    }

    /// A read-only look at the store by a process that remembers nothing: a store with a
    /// fence or a holder has not lost its data and the wait ends (true; a holder is
    /// observed as usual); an empty one is watched until the ttl passed.
    /// The lease store answered: its trouble, if any, is over.
    fn store_answered(&self, warned: &mut Option<Duration>) {
        let was = self.trouble.lock().ok().and_then(|mut t| t.take());
        if was.is_some() {
            tracing::info!("the lease store answers again");
        }
        *warned = None;
    }

    /// A call to the lease store failed while standing by: recorded for readiness,
    /// counted, and logged at once and then once a minute while it lasts.
    fn store_failed(&self, e: &BackendError, warned: &mut Option<Duration>) {
        let kind = e.label();
        metrics::counter!(crate::metrics::STORE_ERRORS, "kind" => kind).increment(1);
        if let Ok(mut t) = self.trouble.lock() {
            *t = Some(crate::Report(e).to_string());
        }
        let now = self.clock.now();
        if warned.is_none_or(|w| now.saturating_sub(w) >= Duration::from_mins(1)) {
            tracing::warn!(error = %crate::Report(e), kind, retry_ms = self.cfg.poll.as_millis() as u64, "cannot use the lease store: this replica could not take over (not ready); retrying every poll interval, logged once a minute while it lasts");
            *warned = Some(now);
        }
    }

    async fn watch_cold(&mut self) -> Result<bool, BackendError> {
        let snap = self.call(self.backend.snapshot()).await?;
        self.raise_seen(snap.fence.max(snap.fence_seen));
        if snap.fence > 0 || snap.fence_seen > 0 || snap.holder.is_some() {
            self.cold_until = None;
            if let Some(h) = snap.holder.filter(|h| !self.is_own(h)) {
                self.on_held(&h, snap.ttl);
            }
        } else if !std::mem::replace(&mut self.cold_warned, true) {
            tracing::warn!(
                wait_ms = self.cfg.ttl.as_millis() as u64,
                "this replica remembers no earlier term and the lease store holds none (a first start, or a store that lost its data): watching one ttl before contending, so a replica that remembers the last term takes over first"
            );
        }
        Ok(self.cold_until.is_none())
    }

    /// A read-only look at the store while held back: remembers the holder as any
    /// standby would.
    async fn watch_held_back(&mut self) -> Result<(), BackendError> {
        let snap = self.call(self.backend.snapshot()).await?;
        self.raise_seen(snap.fence.max(snap.fence_seen));
        if let Some(h) = snap.holder.filter(|h| !self.is_own(h)) {
            self.on_held(&h, snap.ttl);
        }
        Ok(())
    }

    /// A read-only look at the store while an observed holder may still lead: a holder
    /// still there extends the wait; none means waiting out the observed expiry.
    async fn observe(&mut self) -> Result<(), BackendError> {
        let snap = self.call(self.backend.snapshot()).await?;
        self.raise_seen(snap.fence);
        match snap.holder {
            Some(own) if self.is_own(&own) => {
                self.release_own(&own).await;
            }
            Some(holder) => self.on_held(&holder, snap.ttl),
            None => tracing::warn!(
                wait_ms = self.not_before.map_or(0, |nb| nb.saturating_sub(self.clock.now()).as_millis() as u64),
                "the lease key vanished before the holder last seen could have expired; waiting out its ttl"
            ),
        }
        Ok(())
    }

    /// Another holder is there: remember its token (floor) and its key's expiry, a whole
    /// ttl from now when the store cannot tell (the holder renewed at the latest now, so
    /// it cannot lead past that).
    fn on_held(&mut self, holder: &str, expires_in: Option<Duration>) {
        self.see(holder);
        let at = self.clock.now() + expires_in.unwrap_or(self.cfg.ttl);
        self.not_before = Some(self.not_before.map_or(at, |nb| nb.max(at)));
    }

    fn raise_seen(&mut self, t: u64) {
        self.seen = self.seen.max(t);
        self.shared_seen.store(self.seen, Ordering::Relaxed);
    }

    fn see(&mut self, holder: &str) {
        if let Some((_, t)) = crate::backend::parse_holder(holder) {
            self.raise_seen(t);
        }
    }

    fn standby_command(&mut self, c: Command) {
        match c {
            Command::Resign(r) => {
                let _ = r.send(());
            }
            Command::Release(r) => {
                self.stopping = true;
                let _ = r.send(Ok(()));
            }
            Command::StepDown(r) | Command::Abandon(r) | Command::Shutdown(r) => {
                self.stopping = true;
                let _ = r.send(());
            }
        }
    }

    fn new_term(&mut self, token: u64, sent: Duration) -> (Term, oneshot::Receiver<()>) {
        self.epoch += 1;
        self.raise_seen(token);
        let (done_tx, done_rx) = oneshot::channel();
        let deadline = sent + self.cfg.window();
        let term = Term(Arc::new(TermInner {
            instance: self.instance.clone(),
            token,
            epoch: self.epoch,
            deadline_ns: AtomicU64::new(u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX)),
            cancel: CancellationToken::new(),
            clock: self.clock.clone(),
            _done: done_tx,
        }));
        tracing::info!(token, epoch = self.epoch, "elected leader");
        transition("leader", "acquired");
        self.status.send_replace(Status::Leader { token });
        let _ = self.events.send(LeaseEvent::Elected(term.clone()));
        (term, done_rx)
    }

    async fn lead(&mut self, term: &Term) -> LeadEnd {
        let token = term.token();
        let mut next_renew = Instant::now() + self.cfg.renew_every;
        let mut failing = false;
        loop {
            let left = term.remaining();
            if left.is_zero() {
                return LeadEnd::Lost(LossReason::Expired);
            }
            tokio::select! {
                biased;
                () = sleep(left) => {}
                c = self.cmds.recv() => {
                    let Some(c) = c else {
                        // The handle is gone: nobody can drain; release what we hold.
                        let _ = self.call(self.backend.release(&self.instance)).await;
                        return LeadEnd::Released;
                    };
                    match c {
                        Command::StepDown(r) => {
                            self.stopping = true;
                            self.status.send_replace(Status::SteppingDown { token });
                            tracing::info!(token, "stepping down: renewing while the caller drains");
                            let _ = r.send(());
                        }
                        Command::Release(r) => {
                            self.stopping = true;
                            let res = self.release(term).await;
                            let end = if res.is_ok() { LeadEnd::Released } else { LeadEnd::Abandoned };
                            let _ = r.send(res);
                            return end;
                        }
                        Command::Abandon(r) => {
                            self.stopping = true;
                            term.end();
                            let _ = r.send(());
                            return LeadEnd::Abandoned;
                        }
                        Command::Resign(r) => {
                            term.end();
                            let _ = r.send(());
                            return LeadEnd::Lost(LossReason::Resigned);
                        }
                        Command::Shutdown(r) => {
                            self.stopping = true;
                            let res = self.release(term).await;
                            let _ = r.send(());
                            return if res.is_ok() { LeadEnd::Released } else { LeadEnd::Abandoned };
                        }
                    }
                }
                () = sleep_until(next_renew) => {
                    next_renew = Instant::now() + self.cfg.renew_every;
                    if let Some(end) = self.renew(term, &mut failing).await {
                        return end;
                    }
                }
            }
        }
    }

    /// One renewal, raced against the deadline. `Some` ends the term.
    async fn renew(&mut self, term: &Term, failing: &mut bool) -> Option<LeadEnd> {
        let token = term.token();
        let epoch = term.epoch();
        let sent = self.clock.now();
        let started = Instant::now();
        let r = tokio::select! {
            biased;
            () = sleep(term.remaining()) => return None,
            r = self.call(self.backend.renew(&self.instance, token, self.cfg.ttl)) => r,
        };
        metrics::histogram!(crate::metrics::RENEW_SECONDS).record(started.elapsed().as_secs_f64());
        // Replies are tied to the term they were sent for: a reply for an older epoch
        // (impossible here since the future dies with its term, but cheap to check) is
        // ignored rather than applied to the current term.
        if epoch != self.epoch {
            return None;
        }
        match r {
            Ok(Renew::Renewed) => {
                term.extend_to(sent + self.cfg.window());
                if std::mem::take(failing) {
                    tracing::info!(token, "lease renewals succeed again");
                }
                None
            }
            Ok(Renew::Retaken) => {
                term.extend_to(sent + self.cfg.window());
                *failing = false;
                metrics::counter!(crate::metrics::RETAKES).increment(1);
                tracing::warn!(token, "lease key had vanished with the fence unchanged; retook it with the same token");
                None
            }
            Ok(Renew::Fenced { fence }) => Some(LeadEnd::Lost(LossReason::Fenced(fence))),
            Ok(Renew::TakenBy { holder }) => {
                self.see(&holder);
                Some(LeadEnd::Lost(LossReason::TakenBy(holder)))
            }
            Err(e) => {
                let reason = e.label();
                metrics::counter!(crate::metrics::RENEW_ERRORS, "reason" => reason).increment(1);
                if !std::mem::replace(failing, true) {
                    tracing::warn!(token, error = %crate::Report(&e), remaining_ms = term.remaining().as_millis() as u64, "lease renewal failed; leading until the deadline");
                }
                None
            }
        }
    }

    async fn release(&mut self, term: &Term) -> Result<(), StepDownError> {
        let token = term.token();
        if !term.is_active() {
            return Err(StepDownError::Lost);
        }
        term.end();
        match self.call(self.backend.release(&self.instance)).await {
            Ok(true) => {
                tracing::info!(token, "lease released");
                Ok(())
            }
            Ok(false) => Err(StepDownError::Lost),
            Err(e) => Err(StepDownError::ReleaseFailed(e)),
        }
    }
}
