//! Verification in the lanes (`FIREKEEPER_VERIFY`): every `#commit` and `#sync` checked
//! against its repo's current key before the handler sees it, never on the socket
//! reader. A repo's events share a lane, so each lane keeps its repos' last verified
//! commit (rev and MST root) for the chain check without locks between lanes.
//!
//! An event that fails is not handed over as itself: it carries an [`Invalid`] (the
//! built-in sinks write a `#invalid` event at its seq), its repo is marked
//! desynchronised until a valid `#sync` or a commit that chains again, and under
//! [`InvalidPolicy::Fail`] the lane stops there. A DID that does not resolve holds its
//! event (and its lane, never the others) with backoff for the resolve timeout; nothing
//! is guessed.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use atproto_crypto::PublicKey;
use atproto_identity::Identity;
pub use atproto_identity::resolver::ResolverConfig;
use atproto_identity::resolver::{ResolveError, Resolver};
pub use atproto_repo::verify::Reason;
use atproto_repo::verify::{self as check, Failure, Tier, Verified};
use relay_client::Message;
use relay_client::backoff::{Backoff, BackoffConfig};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::chain::{Generations, tid};
use crate::metrics as m;

/// How much of each commit to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VerifyMode {
    /// Trust the relay.
    #[default]
    Off,
    /// The signed commit of every `#commit` and `#sync`.
    Signatures,
    /// Also every block, every op's record, the MST inversion and the repo's chain.
    Full,
}

/// What an event that fails verification does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InvalidPolicy {
    /// Hand the sink a `#invalid` event at its seq instead; the cursor passes it.
    #[default]
    Mark,
    /// Commit everything before it and stop with an error naming it.
    Fail,
}

/// Verification settings.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// How much to check.
    pub mode: VerifyMode,
    /// An MST inversion that cannot complete (a block missing, no `prevData`) is
    /// `#invalid` (`mst`) instead of counted as unproven and delivered.
    pub strict: bool,
    /// What a failure does.
    pub invalid: InvalidPolicy,
    /// Where keys come from.
    pub resolver: ResolverConfig,
    /// How long an event whose DID does not resolve is held before it is `unresolved`.
    pub resolve_timeout: Duration,
    /// Repos whose last verified commit is remembered for the chain check.
    pub repos: usize,
    /// Desynchronised repos listed at most (beyond it they are counted only).
    pub desync_max: usize,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        Self {
            mode: VerifyMode::Off,
            strict: false,
            invalid: InvalidPolicy::Mark,
            resolver: ResolverConfig::default(),
            resolve_timeout: Duration::from_mins(2),
            repos: 1_000_000,
            desync_max: 100_000,
        }
    }
}

/// Why an event was not handed over as itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// The repo.
    pub repo: String,
    /// The rev the event claims.
    pub rev: Option<String>,
    /// The commit CID the event names, when it has one.
    pub commit: Option<String>,
    /// Why, in one word.
    pub reason: Reason,
    /// What exactly.
    pub detail: String,
}

impl Invalid {
    /// Appends the `#invalid` event in JSON, shaped like the relay's events:
    /// `{"seq","type":"#invalid","repo","rev","commit","reason","detail"}`.
    pub fn write_json(&self, seq: u64, out: &mut String) {
        let v = serde_json::json!({
            "seq": seq,
            "type": "#invalid",
            "repo": self.repo,
            "rev": self.rev,
            "commit": self.commit,
            "reason": self.reason.as_str(),
            "detail": self.detail,
        });
        out.push_str(&v.to_string());
    }
}

/// A desynchronised repo, as `/repos/invalid` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Desynced {
    /// The repo.
    pub repo: String,
    /// The seq of its invalid event.
    pub seq: u64,
    /// Why it was invalid.
    pub reason: &'static str,
    /// The rev the event claimed.
    pub rev: Option<String>,
    /// When it was marked (Unix ms).
    pub since: i64,
    /// With repo sync: `desynchronized` (queued), `resyncing` (a download in flight),
    /// `gone` (the PDS says it is not there) or `failed` (every attempt failed).
    pub state: &'static str,
    /// Failed resync attempts so far.
    pub attempts: u32,
    /// When the next resync may start (Unix ms).
    pub due: i64,
    /// Marked again while its resync was in flight: queued again once it lands, unless
    /// its snapshot is at least as new as every such mark's rev.
    #[serde(skip)]
    again: Again,
}

impl Desynced {
    /// A new entry, queued and due at `now`.
    fn queued(repo: &str, seq: u64, reason: &'static str, rev: Option<&str>, now: i64) -> Self {
        Self {
            repo: repo.to_owned(),
            seq,
            reason,
            rev: rev.map(str::to_owned),
            since: now,
            state: state::QUEUED,
            attempts: 0,
            due: now,
            again: Again::No,
        }
    }
}

/// Marks of a repo while its resync was in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Again {
    /// None.
    #[default]
    No,
    /// Each named a rev; the newest (a TID value).
    Upto(u64),
    /// At least one named no rev (an invalid event without one, a reactivation).
    Always,
}

impl Again {
    fn add(self, rev: Option<&str>) -> Self {
        match (self, rev.and_then(crate::chain::tid)) {
            (Self::Always, _) | (_, None) => Self::Always,
            (Self::No, Some(r)) => Self::Upto(r),
            (Self::Upto(a), Some(r)) => Self::Upto(a.max(r)),
        }
    }

    /// True when a snapshot at `rev` does not cover the marks.
    fn needs_more(self, rev: Option<u64>) -> bool {
        match self {
            Self::No => false,
            Self::Always => true,
            Self::Upto(a) => rev.is_none_or(|r| a > r),
        }
    }
}

/// The states of a desynchronised repo (see [`Desynced::state`]).
pub(crate) mod state {
    pub(crate) const QUEUED: &str = "desynchronized";
    pub(crate) const RESYNCING: &str = "resyncing";
    pub(crate) const GONE: &str = "gone";
    pub(crate) const FAILED: &str = "failed";
    pub(crate) const ALL: [&str; 4] = [QUEUED, RESYNCING, GONE, FAILED];
}

/// Now, Unix ms.
pub(crate) fn now_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000).unwrap_or(0)
}

/// A desynchronised repo as the cursor store keeps it (`CursorStore::write_repo`).
#[derive(Debug, Serialize, serde::Deserialize)]
struct Kept {
    /// Why, in one word.
    reason: String,
    /// The seq of its invalid event.
    seq: u64,
    /// The rev the event claimed.
    rev: Option<String>,
    /// When it was marked (Unix ms).
    since: i64,
    /// Its repo-sync state (absent in entries of older versions: queued).
    #[serde(default)]
    state: Option<String>,
    /// Failed resync attempts.
    #[serde(default)]
    attempts: u32,
    /// When the next resync may start (Unix ms).
    #[serde(default)]
    due: i64,
}

/// A repo's desync state changed: what the store must now keep.
pub(crate) enum Change {
    /// Desynchronised, in the store's form.
    Kept(String),
    /// Synchronised again.
    Cleared,
}

impl Change {
    /// The value a [`checkpoint::RepoWrite`] carries.
    pub(crate) fn value(&self) -> Option<&str> {
        match self {
            Self::Kept(v) => Some(v),
            Self::Cleared => None,
        }
    }
}

/// How a resync ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The snapshot (at this rev, a TID value) landed: synchronised, unless marked
    /// meanwhile by an event newer than it.
    Done(Option<u64>),
    /// Try again at this time (Unix ms) without counting an attempt (a rate limit, a
    /// snapshot older than what was delivered, the term ended).
    Later(i64),
    /// Failed: try again after the backoff, or give up after the last attempt.
    Failed,
    /// The PDS says the repo is not there: wait for an event of it.
    Gone,
}

/// The repos marked desynchronised (shared with the status handle), and which of them
/// changed since the store last heard. With repo sync it is the resync queue: each
/// entry's state says where its resync stands.
#[derive(Debug, Default)]
pub struct Desync {
    repos: Mutex<HashMap<String, Desynced>>,
    len: AtomicUsize,
    max: AtomicUsize,
    /// Repos marked or cleared and not yet written to the store.
    dirty: Mutex<std::collections::HashSet<String>>,
    /// How many `dirty` holds: a lane's batch looks no further while it is 0 (the
    /// common case: nothing to keep).
    dirty_n: AtomicUsize,
    /// Repo sync runs: entries stay until their snapshot lands.
    resync: std::sync::atomic::AtomicBool,
    /// Wakes the resync worker when a repo is queued.
    pub(crate) queued: tokio::sync::Notify,
    /// One write to the store at a time, so the last state written is the last state.
    pub(crate) writes: tokio::sync::Mutex<()>,
    /// Retry backoff of failed resyncs: first delay and cap (ms), and the attempts.
    retry: Mutex<(i64, i64, u32)>,
    /// How much of the backfill list is queued (kept under [`BACKFILL_KEY`]).
    backfilled: AtomicUsize,
    /// Where the listing of every repo stands (kept under [`LISTING_KEY`]).
    listing: Mutex<Listing>,
    /// Repos an operator asked to resync, for the worker to keep in the store.
    requests: Mutex<Vec<String>>,
    /// Resyncs done, with their rates.
    pub(crate) meter: crate::progress::Meter,
    /// The backfill set: the DID list's length, and whether a host's listing runs.
    plan: Mutex<(usize, bool)>,
    /// The reconcile after an accepted gap, while its listing runs (see [`Reconcile`]).
    reconcile: Mutex<Option<Reconcile>>,
}

/// Where the reconcile after an accepted gap stands: the repos this term handed over are
/// compared, a page at a time, with the host's `listRepos` revs. Held in memory only: what
/// it compares with (the term's memory of revs) dies with the term too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reconcile {
    /// Bumped by each gap: a listing that a newer gap restarted does not write over it.
    pub(crate) generation: u64,
    /// Why (`outdated_cursor`, `future_cursor`, `switch`).
    pub(crate) why: &'static str,
    /// The page after this cursor is next (`None`: the first).
    pub(crate) cursor: Option<String>,
}

/// What an operator's resync request did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requested {
    /// Queued (it had no entry).
    Queued,
    /// It was queued already: now due at once.
    Sooner,
    /// It was `gone` or `failed`: queued again, its attempts reset.
    Restarted,
    /// A resync of it is in flight: it is fetched again once that lands.
    Again,
    /// The queue is full (it lists at most 100,000 repos): not queued.
    Full,
}

impl Requested {
    /// The word `/repos/resync` answers with.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Sooner => "due now",
            Self::Restarted => "queued again",
            Self::Again => "again after the one in flight",
            Self::Full => "refused: the queue is full",
        }
    }
}

/// The store entry that keeps the backfill list's position (not a repo).
pub(crate) const BACKFILL_KEY: &str = "#backfill";

/// The store entry that keeps where the listing of every repo stands (not a repo).
pub(crate) const LISTING_KEY: &str = "#backfill-list";

/// Where the backfill's listing of every repo (`listRepos`) stands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum Listing {
    /// Not begun: the first page is next.
    #[default]
    Start,
    /// The page after this cursor is next.
    After(String),
    /// Every page was queued.
    Done,
}

impl Listing {
    /// The form the store keeps.
    fn kept(&self) -> String {
        match self {
            Self::Start => String::new(),
            Self::After(c) => format!("after:{c}"),
            Self::Done => "done".into(),
        }
    }

    /// Reads the store's form; anything else starts over (queuing a repo twice is harmless).
    fn read(v: &str) -> Self {
        match v {
            "done" => Self::Done,
            v => v.strip_prefix("after:").map_or(Self::Start, |c| Self::After(c.to_owned())),
        }
    }
}

impl Desync {
    fn mark(&self, seq: u64, inv: &Invalid) {
        self.mark_repo(seq, &inv.repo, inv.reason.as_str(), inv.rev.as_deref());
    }

    /// Marks `repo` desynchronised by the event at `seq` (with repo sync: queues its
    /// resync, or queues it again after the one in flight).
    pub(crate) fn mark_repo(&self, seq: u64, repo: &str, reason: &'static str, rev: Option<&str>) {
        let Ok(mut r) = self.repos.lock() else { return };
        let now = now_ms();
        if let Some(d) = r.get_mut(repo) {
            d.seq = seq;
            d.reason = reason;
            d.rev = rev.map(str::to_owned);
            match d.state {
                state::RESYNCING => d.again = d.again.add(rev),
                state::GONE => {
                    // An event of it: it is back.
                    d.state = state::QUEUED;
                    d.attempts = 0;
                    d.due = now;
                }
                _ => {}
            }
        } else if !self.insert_queued(&mut r, Desynced::queued(repo, seq, reason, rev, now)) {
            return;
        }
        drop(r);
        self.set_dirty(repo);
        self.queued.notify_one();
    }

    /// Inserts a new entry unless the list is at its bound; true when it was inserted.
    fn insert_queued(&self, r: &mut HashMap<String, Desynced>, d: Desynced) -> bool {
        let max = self.max.load(Ordering::Relaxed);
        if max != 0 && r.len() >= max {
            return false;
        }
        r.insert(d.repo.clone(), d);
        self.len.store(r.len(), Ordering::Relaxed);
        metrics::gauge!(m::DESYNC_REPOS).set(r.len() as f64);
        true
    }

    fn clear(&self, repo: &str) {
        if self.len.load(Ordering::Relaxed) == 0 || self.resync.load(Ordering::Relaxed) {
            // With repo sync an entry stays until its snapshot lands.
            return;
        }
        self.remove(repo);
    }

    fn remove(&self, repo: &str) {
        let Ok(mut r) = self.repos.lock() else { return };
        if r.remove(repo).is_some() {
            tracing::info!(repo, "repo synchronised again");
            self.set_dirty(repo);
        }
        self.len.store(r.len(), Ordering::Relaxed);
        metrics::gauge!(m::DESYNC_REPOS).set(r.len() as f64);
    }

    /// Turns repo sync on: entries are a resync queue, retried with backoff from
    /// `first` to `cap`, at most `attempts` times.
    pub(crate) fn set_resync(&self, first: Duration, cap: Duration, attempts: u32) {
        self.resync.store(true, Ordering::Relaxed);
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4);
        *self.retry.lock().expect("retry") = (ms(first), ms(cap), attempts.max(1));
    }

    /// Notes that `repo`'s state must be written to the store.
    fn set_dirty(&self, repo: &str) {
        if self.dirty.lock().expect("dirty").insert(repo.to_owned()) {
            self.dirty_n.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// True when `repo`'s state waits to be written to the store.
    fn is_dirty(&self, repo: &str) -> bool {
        self.any_dirty() && self.dirty.lock().expect("dirty").contains(repo)
    }

    /// True when some repo's state waits to be written to the store.
    pub(crate) fn any_dirty(&self) -> bool {
        self.dirty_n.load(Ordering::Relaxed) > 0
    }

    /// Queues `repo` unless it has an entry; true when it was queued.
    pub(crate) fn mark_new(&self, repo: &str, reason: &'static str) -> bool {
        if self.repos.lock().is_ok_and(|r| r.contains_key(repo)) {
            return false;
        }
        self.mark_repo(0, repo, reason, None);
        true
    }

    /// Queues `repo`'s resync because an operator asked: a new entry is due now; a queued
    /// one is brought forward; a `gone` or `failed` one starts over; one in flight is
    /// fetched again once it lands. The worker keeps it in the store (fenced).
    pub(crate) fn request(&self, repo: &str) -> Requested {
        let now = now_ms();
        let done = {
            let Ok(mut r) = self.repos.lock() else { return Requested::Full };
            if let Some(d) = r.get_mut(repo) {
                match d.state {
                    state::RESYNCING => {
                        d.again = Again::Always;
                        Requested::Again
                    }
                    state::QUEUED => {
                        d.due = d.due.min(now);
                        Requested::Sooner
                    }
                    _ => {
                        d.state = state::QUEUED;
                        d.reason = crate::resync::reason::OPERATOR;
                        d.attempts = 0;
                        d.due = now;
                        Requested::Restarted
                    }
                }
            } else if self.insert_queued(&mut r, Desynced::queued(repo, 0, crate::resync::reason::OPERATOR, None, now))
            {
                Requested::Queued
            } else {
                return Requested::Full;
            }
        };
        self.set_dirty(repo);
        if let Ok(mut q) = self.requests.lock() {
            q.push(repo.to_owned());
        }
        self.queued.notify_one();
        done
    }

    /// The repos operators asked for since the worker last kept them.
    pub(crate) fn take_requests(&self) -> Vec<String> {
        self.requests.lock().map(|mut q| std::mem::take(&mut *q)).unwrap_or_default()
    }

    /// True when `repo`'s state is what the store holds (nothing waits to be written).
    #[must_use]
    pub fn is_kept(&self, repo: &str) -> bool {
        !self.is_dirty(repo)
    }

    /// How many repos wait, queued.
    pub(crate) fn queued(&self) -> usize {
        self.repos.lock().map_or(0, |r| r.values().filter(|d| d.state == state::QUEUED).count())
    }

    /// How much of the backfill list is queued.
    pub(crate) fn backfilled(&self) -> usize {
        self.backfilled.load(Ordering::Relaxed)
    }

    /// Where the listing of every repo stands.
    pub(crate) fn listing(&self) -> Listing {
        self.listing.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Notes where the listing now stands (kept by the store like a repo's state).
    pub(crate) fn set_listing(&self, l: Listing) {
        if let Ok(mut now) = self.listing.lock() {
            *now = l;
        }
        self.set_dirty(LISTING_KEY);
    }

    /// Records how much of the backfill list is queued (written by the next keep of
    /// [`BACKFILL_KEY`]).
    pub(crate) fn set_backfilled(&self, n: usize) {
        self.backfilled.store(n, Ordering::Relaxed);
        self.set_dirty(BACKFILL_KEY);
    }

    /// True when `repo`'s PDS said it is gone.
    pub(crate) fn is_gone(&self, repo: &str) -> bool {
        !self.is_empty() && self.repos.lock().is_ok_and(|r| r.get(repo).is_some_and(|d| d.state == state::GONE))
    }

    /// True when repo sync runs (entries are a resync queue).
    pub(crate) fn resyncs(&self) -> bool {
        self.resync.load(Ordering::Relaxed)
    }

    /// Up to `n` queued repos whose resync is due at `now` (Unix ms), now `resyncing`,
    /// with why they were queued. The oldest first.
    pub(crate) fn take_due(&self, now: i64, n: usize) -> Vec<(String, &'static str)> {
        let Ok(mut r) = self.repos.lock() else { return Vec::new() };
        let mut due: Vec<&mut Desynced> = r.values_mut().filter(|d| d.state == state::QUEUED && d.due <= now).collect();
        // Repairs before backfill, then the oldest first.
        due.sort_by_key(|d| (d.reason == crate::resync::reason::BACKFILL, d.due, d.seq));
        let taken: Vec<(String, &'static str)> = due
            .into_iter()
            .take(n)
            .map(|d| {
                d.state = state::RESYNCING;
                d.again = Again::No;
                (d.repo.clone(), d.reason)
            })
            .collect();
        drop(r);
        for (repo, _) in &taken {
            self.set_dirty(repo);
        }
        taken
    }

    /// The earliest due time of a queued repo (Unix ms).
    pub(crate) fn next_due(&self) -> Option<i64> {
        let r = self.repos.lock().ok()?;
        r.values().filter(|d| d.state == state::QUEUED).map(|d| d.due).min()
    }

    /// Records how `repo`'s resync ended.
    pub(crate) fn finish(&self, repo: &str, outcome: Outcome) {
        let now = now_ms();
        let (first, cap, attempts) = *self.retry.lock().expect("retry");
        let Ok(mut r) = self.repos.lock() else { return };
        let Some(d) = r.get_mut(repo) else { return };
        let again = std::mem::take(&mut d.again);
        match outcome {
            Outcome::Done(rev) if !again.needs_more(rev) => {
                drop(r);
                self.remove(repo);
                return;
            }
            Outcome::Done(_) => {
                d.state = state::QUEUED;
                d.attempts = 0;
                d.due = now;
            }
            Outcome::Later(at) => {
                d.state = state::QUEUED;
                d.due = if again == Again::No { at } else { now };
            }
            Outcome::Failed => {
                d.attempts += 1;
                if d.attempts >= attempts {
                    d.state = state::FAILED;
                    tracing::error!(
                        repo,
                        attempts = d.attempts,
                        "resync failed every attempt: the repo stays desynchronised until an operator queues it again"
                    );
                } else {
                    d.state = state::QUEUED;
                    let exp = first.saturating_mul(1i64 << d.attempts.saturating_sub(1).min(20)).min(cap);
                    // Jitter: up to a quarter more, so a burst of failures spreads out.
                    let jitter = (RandomState::new().hash_one(repo) % 1024).cast_signed() * exp / 4096;
                    d.due = now.saturating_add(exp + jitter);
                }
            }
            Outcome::Gone => d.state = state::GONE,
        }
        self.set_dirty(repo);
        drop(r);
        self.queued.notify_one();
    }

    /// `repo`'s state in the store's form, if it changed since the store last heard.
    pub(crate) fn take_change(&self, repo: &str) -> Option<Change> {
        if !self.dirty.lock().expect("dirty").remove(repo) {
            return None;
        }
        self.dirty_n.fetch_sub(1, Ordering::Relaxed);
        if repo == BACKFILL_KEY {
            return Some(Change::Kept(self.backfilled().to_string()));
        }
        if repo == LISTING_KEY {
            return Some(Change::Kept(self.listing().kept()));
        }
        let r = self.repos.lock().expect("repos");
        Some(match r.get(repo) {
            Some(d) => {
                let kept = Kept {
                    reason: d.reason.to_owned(),
                    seq: d.seq,
                    rev: d.rev.clone(),
                    since: d.since,
                    state: Some(d.state.to_owned()),
                    attempts: d.attempts,
                    due: d.due,
                };
                Change::Kept(serde_json::to_string(&kept).unwrap_or_default())
            }
            None => Change::Cleared,
        })
    }

    /// Puts back a change the store did not take (the term ended first).
    pub(crate) fn untake(&self, repo: &str) {
        self.set_dirty(repo);
    }

    /// Replaces the list with what the store kept (a new term continues the last): a
    /// resync in flight in an older term is queued again (what it held died with it).
    pub(crate) fn load(&self, kept: &[(String, String)]) {
        let Ok(mut r) = self.repos.lock() else { return };
        r.clear();
        self.dirty.lock().expect("dirty").clear();
        self.dirty_n.store(0, Ordering::Relaxed);
        self.backfilled.store(0, Ordering::Relaxed);
        if let Ok(mut l) = self.listing.lock() {
            *l = Listing::Start;
        }
        for (repo, value) in kept {
            if repo == BACKFILL_KEY {
                self.backfilled.store(value.parse().unwrap_or(0), Ordering::Relaxed);
                continue;
            }
            if repo == LISTING_KEY {
                if let Ok(mut l) = self.listing.lock() {
                    *l = Listing::read(value);
                }
                continue;
            }
            let Ok(k) = serde_json::from_str::<Kept>(value) else {
                tracing::warn!(repo, "a kept repo state does not read; skipped");
                continue;
            };
            let reason = Reason::ALL
                .iter()
                .map(|r| r.as_str())
                .chain(crate::resync::reason::ALL)
                .find(|r| *r == k.reason)
                .unwrap_or("unknown");
            let kept_state = k.state.as_deref().unwrap_or(state::QUEUED);
            let st = match state::ALL.iter().find(|s| **s == kept_state) {
                Some(&state::RESYNCING) | None => state::QUEUED,
                Some(s) => s,
            };
            let d = Desynced {
                repo: repo.clone(),
                seq: k.seq,
                reason,
                rev: k.rev,
                since: k.since,
                state: st,
                attempts: k.attempts,
                due: k.due,
                again: Again::No,
            };
            r.insert(repo.clone(), d);
        }
        self.len.store(r.len(), Ordering::Relaxed);
        metrics::gauge!(m::DESYNC_REPOS).set(r.len() as f64);
        drop(r);
        self.queued.notify_one();
    }

    /// How many repos are desynchronised.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// True when no repo is.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many repos are in each state.
    #[must_use]
    pub fn by_state(&self) -> [(&'static str, usize); 4] {
        let mut out = state::ALL.map(|s| (s, 0));
        if let Ok(r) = self.repos.lock() {
            for d in r.values() {
                if let Some(o) = out.iter_mut().find(|(s, _)| *s == d.state) {
                    o.1 += 1;
                }
            }
        }
        out
    }

    /// A gap was accepted (`why`): with repo sync, the reconcile (re)starts from the
    /// listing's first page (the repos that moved in an earlier gap are still found).
    pub(crate) fn gap_accepted(&self, why: &'static str) {
        if !self.resyncs() {
            return;
        }
        if let Ok(mut r) = self.reconcile.lock() {
            let generation = r.as_ref().map_or(0, |r| r.generation) + 1;
            *r = Some(Reconcile { generation, why, cursor: None });
        }
        self.queued.notify_one();
    }

    /// The reconcile's next page, while one runs.
    pub(crate) fn reconcile(&self) -> Option<Reconcile> {
        self.reconcile.lock().ok()?.clone()
    }

    /// The reconcile of `generation` listed a page: `next` is the following page's cursor
    /// (`None`: it is done). A newer gap's reconcile is left as it is.
    pub(crate) fn reconciled(&self, generation: u64, next: Option<String>) {
        if let Ok(mut r) = self.reconcile.lock()
            && r.as_ref().is_some_and(|r| r.generation == generation)
        {
            match next {
                Some(c) => r.as_mut().expect("checked").cursor = Some(c),
                None => *r = None,
            }
        }
    }

    /// Notes the backfill set (for the progress): the DID list's length, and whether a
    /// host's listing is worked after it.
    pub(crate) fn plan_backfill(&self, listed: usize, listing: bool) {
        if let Ok(mut p) = self.plan.lock() {
            *p = (listed, listing);
        }
    }

    /// Where repo sync stands at `now_s` (Unix seconds), given the queue `by` state (what
    /// [`Desync::by_state`] says); `None` without repo sync.
    #[must_use]
    pub fn progress(&self, by: &[(&'static str, usize)], now_s: u64) -> Option<crate::progress::Progress> {
        use crate::progress::{Backfill, Progress};
        if !self.resyncs() {
            return None;
        }
        let n = |st: &str| by.iter().find(|(s, _)| *s == st).map_or(0, |x| x.1);
        let (done, records, bytes) = self.meter.totals();
        let (listed, listing) = self.plan.lock().map_or((0, false), |p| *p);
        let backfill = (listed > 0 || listing).then(|| Backfill {
            listed_queued: self.backfilled(),
            listed,
            listing: match (listing, self.listing()) {
                (false, _) => "off",
                (true, Listing::Done) => "done",
                (true, _) => "listing",
            },
        });
        let p = Progress {
            queued: n(state::QUEUED),
            in_flight: n(state::RESYNCING),
            done,
            failed: n(state::FAILED),
            gone: n(state::GONE),
            records,
            bytes,
            rates: self.meter.rates(now_s),
            backfill,
            ..Progress::default()
        };
        Some(p.estimate())
    }

    /// The desynchronised repos, by seq.
    #[must_use]
    pub fn list(&self) -> Vec<Desynced> {
        let mut v: Vec<Desynced> = self.repos.lock().map(|r| r.values().cloned().collect()).unwrap_or_default();
        v.sort_by_key(|d| d.seq);
        v
    }
}

/// Writes `repo`'s changed state to the store, fenced by the term, retried while the store
/// does not answer (`Fenced`: a newer term owns the store; `Cancelled`: the term ended).
pub(crate) async fn keep(
    store: &dyn checkpoint::CursorStore,
    desync: &Desync,
    did: &str,
    ctx: &crate::handler::BatchCtx,
) -> Result<(), crate::handler::HandlerError> {
    use crate::handler::HandlerError;
    if !store.keeps_repos() {
        let _ = desync.take_change(did);
        return Ok(());
    }
    if !desync.is_dirty(did) {
        return Ok(());
    }
    let _one = desync.writes.lock().await;
    let Some(change) = desync.take_change(did) else { return Ok(()) };
    let holder = ctx.term.holder();
    let fence = checkpoint::Fence { holder: &holder, token: ctx.token };
    let w = checkpoint::RepoWrite { did, value: change.value() };
    let mut backoff = Backoff::new(KEEP_RETRY);
    loop {
        ctx.ensure_active().inspect_err(|_| desync.untake(did))?;
        match store.write_repo(w, fence).await {
            Ok(checkpoint::CommitOutcome::Fenced { .. }) => {
                desync.untake(did);
                return Err(HandlerError::Fenced);
            }
            Ok(_) => return Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, repo = did, "keeping a desynchronised repo in the store failed; retrying");
                let delay = backoff.next_delay();
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = ctx.cancel.cancelled() => {
                        desync.untake(did);
                        return Err(HandlerError::Cancelled);
                    }
                }
            }
        }
    }
}

/// Retries of a repo state the store did not take: 100 ms doubling to 10 s.
const KEEP_RETRY: BackoffConfig = BackoffConfig { initial: Duration::from_millis(100), max: Duration::from_secs(10) };

/// A repo's last verified commit: its rev (as a TID value) and the SHA-256 of its MST root.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Last {
    rev: u64,
    data: [u8; 32],
}

fn digest(cid: &[u8]) -> [u8; 32] {
    let mut d = [0u8; 32];
    let n = cid.len().min(32);
    d[..n].copy_from_slice(&cid[cid.len() - n..]);
    d
}

/// What verifying one event decided.
pub(crate) enum Verdict {
    /// Hand it over as itself.
    Valid,
    /// Hand over a `#invalid` instead.
    Invalid(Invalid),
}

/// The consumer's verifier, shared by its lanes across terms.
pub(crate) struct Verifier {
    opts: VerifyOptions,
    resolver: Resolver,
    lanes: Vec<Mutex<Generations<Last>>>,
    keys: RandomState,
    desync: Arc<Desync>,
    /// Unresolvable DIDs and how long they have been held (see [`Verifier::key`]).
    holds: Mutex<HashMap<String, Hold>>,
}

const HOLD: BackoffConfig = BackoffConfig { initial: Duration::from_millis(250), max: Duration::from_secs(5) };

impl Verifier {
    /// A verifier for `lanes` lanes, or `None` with verification off.
    pub(crate) fn new(opts: &VerifyOptions, lanes: usize, desync: Arc<Desync>) -> Result<Option<Self>, ResolveError> {
        if opts.mode == VerifyMode::Off {
            return Ok(None);
        }
        desync.max.store(opts.desync_max, Ordering::Relaxed);
        let per_lane = opts.repos / lanes.max(1);
        Ok(Some(Self {
            resolver: Resolver::new(opts.resolver.clone())?,
            opts: opts.clone(),
            lanes: (0..lanes.max(1)).map(|_| Mutex::new(Generations::new(per_lane))).collect(),
            keys: RandomState::new(),
            desync,
            holds: Mutex::new(HashMap::new()),
        }))
    }

    /// A snapshot of `repo` at `rev` with tree root `data` (a CID) was handed over: the
    /// chain continues from it.
    pub(crate) fn resynced(&self, lane: usize, repo: &str, rev: u64, data: &[u8]) {
        let key = self.keys.hash_one(repo);
        let mut chains = self.lanes[lane % self.lanes.len()].lock().expect("lane chains");
        chains.put(key, Last { rev, data: digest(data) });
    }

    /// The invalid-event policy.
    pub(crate) fn policy(&self) -> InvalidPolicy {
        self.opts.invalid
    }

    /// Verifies one event of `lane`. `None` when the term ended while the event was held.
    pub(crate) async fn check(
        &self,
        lane: usize,
        seq: u64,
        m: &Message<'_>,
        cancel: &CancellationToken,
    ) -> Option<Verdict> {
        let tier = if self.opts.mode == VerifyMode::Full { Tier::Full } else { Tier::Signatures };
        let (repo, rev, commit) = match m {
            Message::Identity(i) => {
                // The document may have changed: ask for it now, in the background (the
                // repo's next commits do not wait on the directory; one whose signature
                // fails with the key held asks again and waits).
                self.resolver.changed(i.did);
                self.holds.lock().expect("holds").remove(i.did);
                return Some(Verdict::Valid);
            }
            Message::Commit(c) => (c.repo, c.rev, Some(c.commit.to_string())),
            Message::Sync(s) => (s.did, s.rev, None),
            _ => return Some(Verdict::Valid),
        };
        let outcome = match self.key(repo, false, cancel).await? {
            Ok(id) => self.signed(m, &id.signing_key, tier, repo, cancel).await?,
            Err(f) => Err(f),
        };
        let verdict = outcome.and_then(|v| self.chained(lane, m, repo, &v).map(|()| v));
        Some(match verdict {
            Ok(v) => {
                metrics::counter!(m::VERIFIED, "type" => m.kind().as_str()).increment(1);
                if let Some(why) = v.unproven {
                    metrics::counter!(m::UNPROVEN).increment(1);
                    tracing::debug!(seq, repo, why, "commit not proven by MST inversion (delivered)");
                }
                Verdict::Valid
            }
            Err(f) => {
                if f.reason != Reason::Chain {
                    // Nothing of it is trusted: the repo's next commit starts a new chain
                    // (the repo stays desynchronised until one chains onto that).
                    self.forget(lane, repo);
                }
                let inv = Invalid {
                    repo: repo.to_owned(),
                    rev: Some(rev.to_owned()),
                    commit,
                    reason: f.reason,
                    detail: f.detail,
                };
                metrics::counter!(m::INVALID, "reason" => inv.reason.as_str()).increment(1);
                tracing::warn!(seq, repo, rev, reason = inv.reason.as_str(), detail = %inv.detail, "event failed verification");
                self.desync.mark(seq, &inv);
                Verdict::Invalid(inv)
            }
        })
    }

    /// The signature (and, full, the blocks and tree) against `key`; once more against a
    /// freshly resolved key when the signature fails (the repo may have rotated it).
    async fn signed(
        &self,
        m: &Message<'_>,
        key: &PublicKey,
        tier: Tier,
        repo: &str,
        cancel: &CancellationToken,
    ) -> Option<Result<Verified, Failure>> {
        let run = |k: &PublicKey| match m {
            Message::Commit(c) => check::commit(c, k, tier),
            Message::Sync(s) => check::sync(s, k, tier),
            _ => unreachable!("only commits and syncs are checked"),
        };
        let first = run(key);
        let Err(Failure { reason: Reason::Signature, .. }) = &first else { return Some(self.strict(first)) };
        metrics::counter!(m::KEY_REFRESHES).increment(1);
        match self.key(repo, true, cancel).await? {
            Ok(fresh) if fresh.signing_key != *key => Some(self.strict(run(&fresh.signing_key))),
            Ok(_) => Some(first),
            Err(f) => Some(Err(f)),
        }
    }

    /// Under strict, an unproven commit is invalid.
    fn strict(&self, r: Result<Verified, Failure>) -> Result<Verified, Failure> {
        match r {
            Ok(v) if self.opts.strict && v.unproven.is_some() => {
                Err(Failure::new(Reason::Mst, format!("not proven: {}", v.unproven.unwrap_or_default())))
            }
            r => r,
        }
    }

    fn forget(&self, lane: usize, repo: &str) {
        let key = self.keys.hash_one(repo);
        let mut chains = self.lanes[lane % self.lanes.len()].lock().expect("lane chains");
        chains.remove(key);
    }

    /// The repo's chain (full tier): a commit after the last verified one continues it by
    /// its `prevData` (else its `since`); one at or before it is a replay (ignored, as
    /// the chain check does). A `#sync` restarts the chain.
    fn chained(&self, lane: usize, m: &Message<'_>, repo: &str, v: &Verified) -> Result<(), Failure> {
        let Some(rev) = tid(&v.rev) else { return Ok(()) };
        let now = Last { rev, data: digest(&v.data) };
        let key = self.keys.hash_one(repo);
        let mut chains = self.lanes[lane % self.lanes.len()].lock().expect("lane chains");
        let Message::Commit(c) = m else {
            chains.put(key, now);
            drop(chains);
            self.desync.clear(repo);
            return Ok(());
        };
        if self.opts.mode != VerifyMode::Full {
            drop(chains);
            self.desync.clear(repo);
            return Ok(());
        }
        let Some(last) = chains.get(key) else {
            chains.put(key, now);
            return Ok(());
        };
        if rev <= last.rev {
            // A replay of a commit at or before the last verified one (a relay switch's
            // overlap, a restart from an older cursor): authentic, and no break.
            return Ok(());
        }
        let broken = if let Some(p) = c.prev_data {
            (digest(p.as_bytes()) != last.data).then(|| "prevData is not the last verified commit's tree".to_owned())
        } else {
            c.since.filter(|s| tid(s) != Some(last.rev)).map(|s| format!("since {s} is not the last verified rev"))
        };
        // An authentic commit that does not chain still is the repo's newest state.
        chains.put(key, now);
        drop(chains);
        if let Some(detail) = broken {
            return Err(Failure::new(Reason::Chain, detail));
        }
        self.desync.clear(repo);
        Ok(())
    }

    /// The repo's identity, held with backoff while the directory cannot say; `None` when
    /// the term ended meanwhile. The hold is per DID, not per event: the first event
    /// waits up to the resolve timeout, later ones only what is left of it; once it ran
    /// out, the DID's events are `unresolved` at once for [`HOLD_AGAIN`], then one look-up
    /// (no waiting) says whether it resolves again. A definite answer (not found, no usable
    /// document) is not held at all.
    async fn key(
        &self,
        did: &str,
        refresh: bool,
        cancel: &CancellationToken,
    ) -> Option<Result<Arc<Identity>, Failure>> {
        let start = Instant::now();
        let deadline = match self.holds.lock().expect("holds").get(did) {
            Some(Hold { expired: Some(at), since }) if at.elapsed() < HOLD_AGAIN => {
                return Some(Err(unresolved(&format!("not resolvable for {:?}", since.elapsed()))));
            }
            // The hold ran out a while ago: one look-up, no waiting.
            Some(Hold { expired: Some(_), .. }) => start,
            Some(Hold { since, expired: None }) => *since + self.opts.resolve_timeout,
            None => start + self.opts.resolve_timeout,
        };
        let mut backoff = Backoff::new(HOLD);
        let mut held = false;
        let out = loop {
            let r = if refresh { self.resolver.refresh(did).await } else { self.resolver.resolve(did).await };
            match r {
                Ok(id) => {
                    self.holds.lock().expect("holds").remove(did);
                    break Ok(id);
                }
                Err(e) if !e.is_transient() => {
                    self.holds.lock().expect("holds").remove(did);
                    break Err(Failure::new(Reason::Unresolved, e.to_string()));
                }
                Err(e) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if let Some(f) = self.hold(did, start, left, &e) {
                        break Err(f);
                    }
                    if !held {
                        held = true;
                        metrics::gauge!(m::VERIFY_HELD).increment(1.0);
                        tracing::warn!(did, error = %e, "DID does not resolve now: holding its event (the cursor stays before it) and retrying");
                    }
                    tokio::select! {
                        () = tokio::time::sleep(backoff.next_delay().min(left)) => {}
                        () = cancel.cancelled() => {
                            metrics::gauge!(m::VERIFY_HELD).decrement(1.0);
                            return None;
                        }
                    }
                }
            }
        };
        if held {
            metrics::gauge!(m::VERIFY_HELD).decrement(1.0);
        }
        Some(out)
    }
}

impl Verifier {
    /// Notes that `did` is held (since `start` unless held already); with no time `left`,
    /// the hold runs out and the failure to hand over is returned.
    fn hold(&self, did: &str, start: Instant, left: Duration, e: &ResolveError) -> Option<Failure> {
        let mut holds = self.holds.lock().expect("holds");
        if left.is_zero() {
            let since = holds.get(did).map_or(start, |h| h.since);
            holds.insert(did.to_owned(), Hold { since, expired: Some(Instant::now()) });
            return Some(unresolved(&format!("{e} (held {:?})", since.elapsed())));
        }
        if holds.len() >= HOLDS_MAX {
            holds.retain(|_, h| h.expired.is_none_or(|at| at.elapsed() < HOLD_AGAIN));
        }
        holds.entry(did.to_owned()).or_insert(Hold { since: start, expired: None });
        None
    }
}

/// An `unresolved` failure.
fn unresolved(detail: &str) -> Failure {
    Failure::new(Reason::Unresolved, detail.to_owned())
}

/// A DID whose hold is under way (`expired: None`) or ran out.
struct Hold {
    /// When its first event started waiting.
    since: Instant,
    /// When the hold ran out.
    expired: Option<Instant>,
}

/// After a hold ran out, how long the DID's events are `unresolved` at once before one
/// look-up asks again.
const HOLD_AGAIN: Duration = Duration::from_secs(30);

/// DIDs tracked at most while held (beyond it, old expired holds are forgotten).
const HOLDS_MAX: usize = 100_000;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Desync, Outcome, now_ms, state};

    fn queue() -> Desync {
        let d = Desync::default();
        d.set_resync(Duration::from_mins(1), Duration::from_hours(1), 3);
        d
    }

    fn state_of(d: &Desync, repo: &str) -> Option<&'static str> {
        d.list().into_iter().find(|x| x.repo == repo).map(|x| x.state)
    }

    /// Lanes skip the store while nothing waits to be written: the count follows the set.
    #[test]
    fn the_dirty_count_follows_what_waits_to_be_written() {
        let d = queue();
        assert!(!d.any_dirty());
        d.mark_repo(1, "did:plc:a", "chain", None);
        d.mark_repo(2, "did:plc:a", "chain", None);
        d.mark_repo(3, "did:plc:b", "chain", None);
        assert!(d.any_dirty() && d.is_dirty("did:plc:a") && d.is_dirty("did:plc:b"));
        assert!(d.take_change("did:plc:a").is_some());
        assert!(d.any_dirty() && !d.is_dirty("did:plc:a"), "b still waits");
        assert!(d.take_change("did:plc:b").is_some());
        assert!(!d.any_dirty(), "nothing waits");
        d.untake("did:plc:b");
        assert!(d.any_dirty());
        d.load(&[]);
        assert!(!d.any_dirty(), "a new term starts clean");
    }

    #[test]
    fn a_marked_repo_is_due_at_once_and_taken_once() {
        let d = queue();
        d.mark_repo(7, "did:plc:a", "chain", Some("3k"));
        let now = now_ms();
        assert_eq!(d.take_due(now, 4), vec![("did:plc:a".to_owned(), "chain")]);
        assert_eq!(state_of(&d, "did:plc:a"), Some(state::RESYNCING));
        assert!(d.take_due(now, 4).is_empty(), "a resync in flight is not taken again");
        d.finish("did:plc:a", Outcome::Done(crate::chain::tid("3jzfcijpj2z2a")));
        assert!(d.is_empty(), "synchronised: no entry");
    }

    #[test]
    fn a_mark_while_in_flight_queues_the_repo_again_after_it_lands() {
        let d = queue();
        d.mark_repo(1, "did:plc:a", "chain", None);
        assert_eq!(d.take_due(now_ms(), 1).len(), 1);
        d.mark_repo(2, "did:plc:a", "signature", None);
        assert_eq!(state_of(&d, "did:plc:a"), Some(state::RESYNCING), "the one in flight goes on");
        d.finish("did:plc:a", Outcome::Done(crate::chain::tid("3jzfcijpj2z2z")));
        assert_eq!(state_of(&d, "did:plc:a"), Some(state::QUEUED), "queued again, not cleared");
        assert_eq!(d.take_due(now_ms(), 1).len(), 1, "due at once");
    }

    /// A mark while the download is in flight names a rev: a snapshot at or past it
    /// covers it (a new leader replaying the break it queued the repo for, say).
    #[test]
    fn a_mark_the_snapshot_covers_does_not_repeat_the_resync() {
        let tid = crate::chain::tid;
        let d = queue();
        d.mark_repo(1, "did:plc:a", "chain", Some("3jzfcijpj2z2c"));
        assert_eq!(d.take_due(now_ms(), 1).len(), 1);
        d.mark_repo(2, "did:plc:a", "chain", Some("3jzfcijpj2z2e"));
        d.finish("did:plc:a", Outcome::Done(tid("3jzfcijpj2z2e")));
        assert!(d.is_empty(), "covered by the snapshot");
        d.mark_repo(3, "did:plc:b", "chain", Some("3jzfcijpj2z2c"));
        assert_eq!(d.take_due(now_ms(), 1).len(), 1);
        d.mark_repo(4, "did:plc:b", "chain", Some("3jzfcijpj2z2g"));
        d.finish("did:plc:b", Outcome::Done(tid("3jzfcijpj2z2e")));
        assert_eq!(state_of(&d, "did:plc:b"), Some(state::QUEUED), "newer than the snapshot: again");
    }

    #[test]
    fn failures_back_off_and_the_last_attempt_lists_the_repo_as_failed() {
        let d = queue();
        d.mark_repo(1, "did:plc:a", "chain", None);
        let mut dues = Vec::new();
        for _ in 0..2 {
            assert_eq!(d.take_due(i64::MAX, 1).len(), 1);
            let before = now_ms();
            d.finish("did:plc:a", Outcome::Failed);
            let due = d.list()[0].due;
            assert!(due >= before + 60_000, "at least the first delay");
            dues.push(due - before);
        }
        assert!(dues[1] >= 2 * 60_000 && dues[1] <= 2 * 75_000 + 1_000, "doubled, jittered: {dues:?}");
        assert!(d.take_due(now_ms(), 1).is_empty(), "not due before its time");
        assert_eq!(d.take_due(i64::MAX, 1).len(), 1);
        d.finish("did:plc:a", Outcome::Failed);
        assert_eq!(state_of(&d, "did:plc:a"), Some(state::FAILED));
        assert!(d.take_due(i64::MAX, 1).is_empty(), "a failed repo waits for an operator or an event");
    }

    #[test]
    fn a_gone_repo_waits_for_an_event_of_it() {
        let d = queue();
        d.mark_repo(1, "did:plc:a", "chain", None);
        assert_eq!(d.take_due(now_ms(), 1).len(), 1);
        d.finish("did:plc:a", Outcome::Gone);
        assert!(d.is_gone("did:plc:a"));
        assert!(d.take_due(i64::MAX, 1).is_empty());
        d.mark_repo(9, "did:plc:a", "reactivated", None);
        assert_eq!(d.take_due(now_ms(), 1), vec![("did:plc:a".to_owned(), "reactivated")]);
    }

    /// An operator's request: a new repo is queued due now, a failed one starts over
    /// with its attempts reset, one in flight is fetched again after it lands, a queued
    /// one is brought forward; each waits to be kept by the store.
    #[test]
    fn an_operator_request_queues_restarts_or_repeats() {
        let d = queue();
        assert_eq!(d.request("did:plc:new"), super::Requested::Queued);
        assert!(!d.is_kept("did:plc:new"));
        assert_eq!(d.take_requests(), vec!["did:plc:new".to_owned()]);
        assert_eq!(d.take_due(now_ms(), 1), vec![("did:plc:new".to_owned(), crate::resync::reason::OPERATOR)]);
        assert_eq!(d.request("did:plc:new"), super::Requested::Again, "in flight");
        d.finish("did:plc:new", Outcome::Done(Some(u64::MAX)));
        assert_eq!(state_of(&d, "did:plc:new"), Some(state::QUEUED), "fetched again after the one in flight");
        assert_eq!(d.take_due(now_ms(), 1).len(), 1);
        d.finish("did:plc:new", Outcome::Done(Some(u64::MAX)));
        assert_eq!(state_of(&d, "did:plc:new"), None, "then synchronised");
        d.mark_repo(1, "did:plc:f", "chain", None);
        for _ in 0..3 {
            assert_eq!(d.take_due(i64::MAX, 1).len(), 1);
            d.finish("did:plc:f", Outcome::Failed);
        }
        assert_eq!(state_of(&d, "did:plc:f"), Some(state::FAILED));
        assert_eq!(d.request("did:plc:f"), super::Requested::Restarted);
        assert_eq!(d.take_due(now_ms(), 2).iter().filter(|t| t.0 == "did:plc:f").count(), 1, "due now");
        assert_eq!(d.list().iter().find(|x| x.repo == "did:plc:f").map(|x| x.attempts), Some(0));
        d.mark_repo(2, "did:plc:q", "chain", None);
        assert!(d.take_due(now_ms(), 4).iter().any(|t| t.0 == "did:plc:q"));
        d.finish("did:plc:q", Outcome::Later(now_ms() + 3_600_000));
        assert!(!d.take_due(now_ms(), 4).iter().any(|t| t.0 == "did:plc:q"), "waits an hour");
        assert_eq!(d.request("did:plc:q"), super::Requested::Sooner);
        assert!(d.take_due(now_ms(), 4).iter().any(|t| t.0 == "did:plc:q"), "brought forward");
    }

    /// Where the listing of every repo stands is kept like a repo's state and read back
    /// by the next term; a value it cannot read starts the listing over.
    #[test]
    fn the_listing_position_survives_a_new_term() {
        use super::{LISTING_KEY, Listing};
        for l in [Listing::Start, Listing::After("1796551060203::did:plc:a".into()), Listing::Done] {
            let d = queue();
            d.set_listing(l.clone());
            let Some(super::Change::Kept(v)) = d.take_change(LISTING_KEY) else { panic!("a change") };
            let next = queue();
            next.load(&[(LISTING_KEY.to_owned(), v)]);
            assert_eq!(next.listing(), l);
            assert!(next.list().is_empty(), "not a repo");
        }
        let next = queue();
        next.load(&[(LISTING_KEY.to_owned(), "garbage".into())]);
        assert_eq!(next.listing(), Listing::Start);
    }

    #[test]
    fn a_new_term_queues_again_what_an_older_one_had_in_flight() {
        let d = queue();
        d.mark_repo(1, "did:plc:a", "chain", Some("3k"));
        assert_eq!(d.take_due(now_ms(), 1).len(), 1);
        let Some(super::Change::Kept(v)) = d.take_change("did:plc:a") else { panic!("a change") };
        assert!(v.contains("\"state\":\"resyncing\""), "{v}");
        let next = queue();
        next.load(&[
            ("did:plc:a".to_owned(), v),
            ("did:plc:b".to_owned(), r#"{"reason":"cid","seq":3,"rev":null,"since":5}"#.to_owned()),
        ]);
        assert_eq!(state_of(&next, "did:plc:a"), Some(state::QUEUED));
        assert_eq!(state_of(&next, "did:plc:b"), Some(state::QUEUED), "an entry of an older version reads as queued");
        assert_eq!(next.take_due(now_ms(), 4).len(), 2);
    }
}
