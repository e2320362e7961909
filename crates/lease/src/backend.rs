//! The seam between the supervisor and a lease store.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

pub use causes::{Cause, Report, While};

/// Why a backend call failed. All of these are "outcome unknown": the supervisor keeps
/// leading until its deadline and tries again.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The call did not finish within the op timeout; the connection was dropped.
    #[error("lease store call timed out after {0:?}")]
    Timeout(Duration),
    /// The store could not be reached or refused the command (e.g. an ACL denial).
    #[error("lease store unavailable: {}", causes::Report(.0.as_ref()))]
    Unavailable(#[source] Cause),
    /// The store answered something no script returns.
    #[error("lease store answered nonsense: {0}")]
    Protocol(String),
}

impl BackendError {
    /// Short label for metrics and logs: `timeout`, `unavailable` or `protocol`.
    #[must_use]
    pub fn label(&self) -> &'static str {
        match self {
            Self::Timeout(_) => "timeout",
            Self::Unavailable(_) => "unavailable",
            Self::Protocol(_) => "protocol",
        }
    }
}

/// Result of an acquire attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// We hold the lease with this fencing token.
    Acquired {
        /// Strictly greater than every earlier token.
        token: u64,
    },
    /// Someone holds it.
    Held {
        /// Their `<instance>:<token>`.
        holder: String,
        /// How long their key has left: the holder cannot lead past that, so a standby
        /// does not start a term before it even if the store loses the key (a restart
        /// without persistence, a lagging replica promoted). `None`: the store cannot
        /// tell, and the standby assumes a whole ttl from now.
        expires_in: Option<Duration>,
    },
}

/// Result of a renewal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renew {
    /// The key was ours and its ttl was extended.
    Renewed,
    /// The key had vanished but the fence counter still equals our token, so nobody else
    /// was elected: the key was set again with the same token.
    Retaken,
    /// The key is gone and the fence moved on: another term began.
    Fenced {
        /// The counter's value now, if any.
        fence: Option<u64>,
    },
    /// Someone else holds the key.
    TakenBy {
        /// Their `<instance>:<token>`.
        holder: String,
    },
}

/// What the store holds, for `lease show` and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// `<instance>:<token>` of the holder, if any.
    pub holder: Option<String>,
    /// The fence counter (the last token issued).
    pub fence: u64,
    /// The highest token any checkpoint commit has seen.
    pub fence_seen: u64,
    /// Remaining ttl of the lease key.
    pub ttl: Option<Duration>,
}

/// A lease store. Every call is one atomic operation with a hard timeout. Object-safe
/// (`Arc<dyn Backend>`), like the cursor store and the handler: the calls are a few per
/// second, so the boxed future costs nothing that matters.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Takes the lease if free, issuing a fresh fencing token above the store's counter
    /// and above `floor` (the highest token this process has seen).
    async fn acquire(&self, instance: &str, ttl: Duration, floor: u64) -> Result<Acquire, BackendError>;
    /// Extends our lease, or retakes it if it vanished and nobody was elected since.
    async fn renew(&self, instance: &str, token: u64, ttl: Duration) -> Result<Renew, BackendError>;
    /// Deletes the lease if `instance` holds it (any token) and tells standbys. Returns
    /// whether it was ours.
    async fn release(&self, instance: &str) -> Result<bool, BackendError>;
    /// Raises the fence counter to at least `min` (never lowers it); returns its value.
    async fn seed_fence(&self, min: u64) -> Result<u64, BackendError>;
    /// Reads the lease state.
    async fn snapshot(&self) -> Result<Snapshot, BackendError>;
    /// Fired when some holder releases, so standbys try at once; `None` if the store
    /// has no such signal.
    fn release_signal(&self) -> Option<Arc<Notify>>;
    /// The settings record the latest leader wrote beside the lease, with its term's
    /// token: what a replica compares its own settings with before it contends.
    async fn deployment(&self) -> Result<Option<(u64, String)>, BackendError>;
    /// Writes the settings record of the term `token`, unless a later term's record is
    /// already there (a stale leader cannot overwrite its successor's). Returns whether
    /// it was written.
    async fn set_deployment(&self, token: u64, record: &str) -> Result<bool, BackendError>;
}

/// Splits a stored settings record `<token>\n<record>`.
#[must_use]
pub fn split_deployment(stored: &str) -> Option<(u64, String)> {
    let (t, rest) = stored.split_once('\n')?;
    Some((t.parse().ok()?, rest.to_owned()))
}

/// Parses `<instance>:<token>`.
#[must_use]
pub fn parse_holder(v: &str) -> Option<(&str, u64)> {
    let (i, t) = v.rsplit_once(':')?;
    Some((i, t.parse().ok()?))
}
