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
}

/// Now, Unix ms.
fn now_ms() -> i64 {
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

/// The repos marked desynchronised (shared with the status handle), and which of them
/// changed since the store last heard.
#[derive(Debug, Default)]
pub struct Desync {
    repos: Mutex<HashMap<String, Desynced>>,
    len: AtomicUsize,
    max: AtomicUsize,
    /// Repos marked or cleared and not yet written to the store.
    dirty: Mutex<std::collections::HashSet<String>>,
}

impl Desync {
    fn mark(&self, seq: u64, inv: &Invalid) {
        let Ok(mut r) = self.repos.lock() else { return };
        let max = self.max.load(Ordering::Relaxed);
        if r.len() < max || r.contains_key(&inv.repo) {
            let since = r.get(&inv.repo).map_or_else(now_ms, |d| d.since);
            let d = Desynced { repo: inv.repo.clone(), seq, reason: inv.reason.as_str(), rev: inv.rev.clone(), since };
            r.insert(inv.repo.clone(), d);
            self.dirty.lock().expect("dirty").insert(inv.repo.clone());
        }
        self.len.store(r.len(), Ordering::Relaxed);
        metrics::gauge!(m::DESYNC_REPOS).set(r.len() as f64);
    }

    fn clear(&self, repo: &str) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let Ok(mut r) = self.repos.lock() else { return };
        if r.remove(repo).is_some() {
            tracing::info!(repo, "repo verified again: no longer desynchronised");
            self.dirty.lock().expect("dirty").insert(repo.to_owned());
        }
        self.len.store(r.len(), Ordering::Relaxed);
        metrics::gauge!(m::DESYNC_REPOS).set(r.len() as f64);
    }

    /// `repo`'s state in the store's form, if it changed since the store last heard.
    pub(crate) fn take_change(&self, repo: &str) -> Option<Change> {
        if !self.dirty.lock().expect("dirty").remove(repo) {
            return None;
        }
        let r = self.repos.lock().expect("repos");
        Some(match r.get(repo) {
            Some(d) => {
                let kept = Kept { reason: d.reason.to_owned(), seq: d.seq, rev: d.rev.clone(), since: d.since };
                Change::Kept(serde_json::to_string(&kept).unwrap_or_default())
            }
            None => Change::Cleared,
        })
    }

    /// Puts back a change the store did not take (the term ended first).
    pub(crate) fn untake(&self, repo: &str) {
        self.dirty.lock().expect("dirty").insert(repo.to_owned());
    }

    /// Replaces the list with what the store kept (a new term continues the last).
    pub(crate) fn load(&self, kept: &[(String, String)]) {
        let Ok(mut r) = self.repos.lock() else { return };
        r.clear();
        self.dirty.lock().expect("dirty").clear();
        for (repo, value) in kept {
            let Ok(k) = serde_json::from_str::<Kept>(value) else {
                tracing::warn!(repo, "a kept repo state does not read; skipped");
                continue;
            };
            let reason = Reason::ALL.iter().find(|r| r.as_str() == k.reason).map_or("unknown", |r| r.as_str());
            r.insert(repo.clone(), Desynced { repo: repo.clone(), seq: k.seq, reason, rev: k.rev, since: k.since });
        }
        self.len.store(r.len(), Ordering::Relaxed);
        metrics::gauge!(m::DESYNC_REPOS).set(r.len() as f64);
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

    /// The desynchronised repos, by seq.
    #[must_use]
    pub fn list(&self) -> Vec<Desynced> {
        let mut v: Vec<Desynced> = self.repos.lock().map(|r| r.values().cloned().collect()).unwrap_or_default();
        v.sort_by_key(|d| d.seq);
        v
    }
}

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

    /// The desynchronised repos.
    pub(crate) fn desync(&self) -> &Desync {
        &self.desync
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
