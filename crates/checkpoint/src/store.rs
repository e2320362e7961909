//! The seam between the consumer and a cursor store, as `lease::Backend` is for leases:
//! Redis, files and Postgres implement it, and an embedder may bring its own.

use async_trait::async_trait;

use crate::cursor::{CommitOutcome, ReadOutcome, StoreError};

/// Who is writing: the term's whole lease value and its fencing token. Stores that can
/// see the lease (Redis, files) fence on `holder`; a store that cannot (Postgres) fences
/// on `token` being the highest it has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence<'a> {
    /// `<instance>:<token>`, the lease value of the term.
    pub holder: &'a str,
    /// The term's fencing token.
    pub token: u64,
}

/// One fenced change to a relay's cursor, as [`CursorStore::write`] takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write<'a> {
    /// The relay fingerprint the cursor is kept under.
    pub fingerprint: &'a str,
    /// The new cursor.
    pub cursor: u64,
    /// The relay time (Unix ms) of the event at `cursor`; `None` forgets an older one.
    pub time_ms: Option<i64>,
    /// Forward only, or a rewind.
    pub kind: WriteKind,
}

/// Whether a [`Write`] may lower the cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    /// Monotonic: `NotNewer` for a cursor at or below the stored one; a saved advance
    /// records the relay as the active one.
    Advance,
    /// May set a lower cursor (an accepted gap, or where a fresh deployment started).
    Rewind,
}

impl<'a> Write<'a> {
    /// A monotonic commit of `cursor`, with the relay time of its event when known.
    #[must_use]
    pub fn advance(fingerprint: &'a str, cursor: u64, time_ms: Option<i64>) -> Self {
        Self { fingerprint, cursor, time_ms, kind: WriteKind::Advance }
    }

    /// A rewind to `cursor` (no relay time: the event there is not known).
    #[must_use]
    pub fn rewind(fingerprint: &'a str, cursor: u64) -> Self {
        Self { fingerprint, cursor, time_ms: None, kind: WriteKind::Rewind }
    }
}

/// One fenced change to the state of a repo that needs repair (a desynchronised repo):
/// the consumer's own encoding of the state, or `None` when the repo is synchronised again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepoWrite<'a> {
    /// The repo's DID.
    pub did: &'a str,
    /// Its state, or `None` to clear it.
    pub value: Option<&'a str>,
}

/// A relay as a store may need it on election (legacy host-keyed cursors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayKey<'a> {
    /// The relay fingerprint: the key cursors are stored under.
    pub fingerprint: &'a str,
    /// `host:port`, the key of legacy cursors.
    pub host_port: &'a str,
    /// The URL has no path, so a legacy host key is unambiguous.
    pub is_root: bool,
}

/// Called for each cursor any replica commits: `(fingerprint, cursor, reset)`, where a
/// reset replaces and a commit only moves forward.
pub type OnCommit = Box<dyn FnMut(&str, u64, bool) + Send>;

/// A place to keep relay cursors that only the current term can move.
#[async_trait]
pub trait CursorStore: Send + Sync + 'static {
    /// `redis`, `file`, `postgres`, …: for logs.
    fn name(&self) -> &'static str;

    /// A relay's cursor. `Unavailable` is an error, never a guess.
    async fn read(&self, fingerprint: &str) -> Result<ReadOutcome, StoreError>;

    /// Where a relay's cursor is kept, for an operator: a key, a path, a row.
    fn cursor_key(&self, fingerprint: &str) -> String {
        fingerprint.to_owned()
    }

    /// The one fenced change to a relay's cursor: an advance (monotonic, keeping the
    /// relay time and recording the relay as the one the leader is on) or a rewind.
    /// Refused with `Fenced` unless `fence` is the current term.
    async fn write(&self, w: Write<'_>, fence: Fence<'_>) -> Result<CommitOutcome, StoreError>;

    /// The relay time (Unix ms) kept with a relay's cursor by [`CursorStore::write`];
    /// `None` for a cursor stored without one (older versions, `cursor set`).
    async fn read_time(&self, _fingerprint: &str) -> Result<Option<i64>, StoreError> {
        Ok(None)
    }

    /// The fingerprint of the relay the last committing leader was on.
    async fn active_relay(&self) -> Result<Option<String>, StoreError> {
        Ok(None)
    }

    /// True when this store keeps repo states ([`CursorStore::write_repo`]), so a new
    /// leader continues what the last one knew of repos that need repair.
    fn keeps_repos(&self) -> bool {
        false
    }

    /// Sets or clears one repo's state, fenced like a cursor commit: `Fenced` unless
    /// `fence` is the current term. A store that keeps none saves nothing.
    async fn write_repo(&self, _w: RepoWrite<'_>, _fence: Fence<'_>) -> Result<CommitOutcome, StoreError> {
        Ok(CommitOutcome::Saved)
    }

    /// Every repo state kept: `(did, value)`.
    async fn repos(&self) -> Result<Vec<(String, String)>, StoreError> {
        Ok(Vec::new())
    }

    /// Operator override, unfenced (`firekeeper cursor set`).
    async fn force(&self, fingerprint: &str, cursor: u64) -> Result<(), StoreError>;

    /// Called once per term before any cursor is read: migrate legacy keys, claim the
    /// fence. An error other than `Unavailable` ends the term.
    async fn on_elected(&self, _fence: Fence<'_>, _relays: &[RelayKey<'_>]) -> Result<(), StoreError> {
        Ok(())
    }

    /// The highest token this store has seen, if it keeps one: the lease seeds its
    /// counter above it at startup, so a lease store that lost its counter cannot issue
    /// tokens this store would refuse.
    async fn fence_floor(&self) -> Result<Option<u64>, StoreError> {
        Ok(None)
    }

    /// Follows every replica's commits until dropped, where the store publishes them,
    /// so a process resumes from the last commit it saw if the store later loses it.
    /// Stores without such a feed return at once.
    async fn follow_commits(&self, _seen: OnCommit) {}
}
