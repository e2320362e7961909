//! A firehose event's commit checked end to end: the signature tier ([`check_commit`])
//! and the full tier (every block against its CID, every op's record present, and the
//! ops inverted on the commit's partial tree back to `prevData`, as sync 1.1 defines).

use atproto_crypto::PublicKey;
use atproto_data::car::Car;
use atproto_data::frame::{Action, Commit as CommitEvent, Sync as SyncEvent};

use crate::mst::{MstError, Op, Partial};
use crate::{CommitError, check_commit_in};

/// How much of a commit to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// The signed commit: CAR root, commit CID, repo, version, signature.
    Signatures,
    /// Also every block's CID, every op's record and the MST inversion.
    Full,
}

/// Why an event is not what it claims, as the `#invalid` event names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The signature does not verify against the repo's key (or is high-S or not 64 bytes).
    Signature,
    /// A block does not hash to its CID, or a CID the event names is not in the CAR.
    Cid,
    /// The ops do not turn the tree into `prevData` (or, strict, cannot be shown to).
    Mst,
    /// The commit is another repo's.
    DidMismatch,
    /// The commit does not continue the repo's last verified commit.
    Chain,
    /// The repo's DID document could not be had, or names no usable key.
    Unresolved,
    /// The event or its commit does not parse.
    Malformed,
    /// Not a verification failure: the sink refused the event for its content (under the
    /// skip policy it is handed over as `#invalid` instead, so the stream goes on).
    Unstorable,
}

impl Reason {
    /// Every reason, for metrics and documentation.
    pub const ALL: [Reason; 8] = [
        Reason::Signature,
        Reason::Cid,
        Reason::Mst,
        Reason::DidMismatch,
        Reason::Chain,
        Reason::Unresolved,
        Reason::Malformed,
        Reason::Unstorable,
    ];

    /// The reason's name in `#invalid` events and metric labels.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Signature => "signature",
            Reason::Cid => "cid",
            Reason::Mst => "mst",
            Reason::DidMismatch => "did-mismatch",
            Reason::Chain => "chain",
            Reason::Unresolved => "unresolved",
            Reason::Malformed => "malformed",
            Reason::Unstorable => "unstorable",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed check: the reason and a short detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {detail}")]
pub struct Failure {
    /// What kind of failure.
    pub reason: Reason,
    /// What exactly (one short line).
    pub detail: String,
}

impl Failure {
    /// A failure for `reason` with `detail`.
    #[must_use]
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Self { reason, detail: detail.into() }
    }
}

impl From<CommitError> for Failure {
    fn from(e: CommitError) -> Self {
        let reason = match &e {
            CommitError::Root | CommitError::MissingCommit | CommitError::Cid => Reason::Cid,
            CommitError::Car(_) | CommitError::Malformed(_) | CommitError::Version(_) => Reason::Malformed,
            CommitError::DidMismatch { .. } => Reason::DidMismatch,
            CommitError::Signature(_) => Reason::Signature,
        };
        Self::new(reason, e.to_string())
    }
}

/// What a verified commit says, for the chain check and the repo's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The commit's rev.
    pub rev: String,
    /// The commit's MST root (`data`), as CID bytes.
    pub data: Vec<u8>,
    /// The full tier could not prove the ops against `prevData` (a block it needed was
    /// missing, or the commit has ops and no `prevData`): why, else `None`.
    pub unproven: Option<&'static str>,
}

/// Checks a `#commit` at `tier` against the repo's key.
///
/// # Errors
/// The first check that fails.
pub fn commit(ev: &CommitEvent<'_>, key: &PublicKey, tier: Tier) -> Result<Verified, Failure> {
    let full = tier == Tier::Full;
    let mut car = Car::parse(ev.blocks, full).map_err(|e| match e {
        atproto_data::DecodeError::BlockHash(c) => {
            Failure::new(Reason::Cid, format!("block {c} does not hash to its CID"))
        }
        e => Failure::new(Reason::Malformed, e.to_string()),
    })?;
    if ev.ops.len() > 2 {
        car.index();
    }
    let c = check_commit_in(&car, Some(ev.commit), ev.repo, key)?;
    if c.rev != ev.rev {
        return Err(Failure::new(Reason::Malformed, "the commit's rev is not the event's"));
    }
    let data = c.data.as_bytes().to_vec();
    let mut verified = Verified { rev: c.rev.to_owned(), data, unproven: None };
    if !full {
        return Ok(verified);
    }
    for op in &ev.ops {
        match (op.action, op.cid) {
            (Action::Delete, None) => {}
            (Action::Delete, Some(_)) => {
                return Err(Failure::new(Reason::Malformed, format!("delete of {} names a record", op.path)));
            }
            (_, None) => return Err(Failure::new(Reason::Malformed, format!("op on {} names no record", op.path))),
            (_, Some(cid)) => {
                if car.get(cid).is_none() {
                    return Err(Failure::new(Reason::Cid, format!("the record of {} is not in the CAR", op.path)));
                }
            }
        }
    }
    verified.unproven = invert(ev, &car, c.data)?;
    Ok(verified)
}

/// Inverts the ops on the commit's partial tree: `Ok(Some(why))` when that cannot
/// complete, `Err` when it completes at another root than `prevData`.
fn invert(
    ev: &CommitEvent<'_>,
    car: &Car<'_>,
    data: atproto_data::cid::Cid<'_>,
) -> Result<Option<&'static str>, Failure> {
    let mst = |e: String| Failure::new(Reason::Mst, e);
    if ev.too_big {
        return Ok(Some("a tooBig commit carries no tree"));
    }
    let Some(prev_data) = ev.prev_data else {
        return Ok((!ev.ops.is_empty()).then_some("a commit with ops and no prevData"));
    };
    if ev.ops.iter().any(|op| op.action != Action::Create && op.prev.is_none()) {
        return Ok(Some("an update or delete without its prev"));
    }
    let mut tree = match Partial::load(car, data) {
        Ok(t) => t,
        Err(MstError::Incomplete(_)) => return Ok(Some("a tree node is not in the CAR")),
        Err(MstError::Invalid(e)) => return Err(mst(e)),
    };
    for op in &ev.ops {
        let op =
            Op { key: op.path.as_bytes(), before: op.prev.map(|c| c.as_bytes()), after: op.cid.map(|c| c.as_bytes()) };
        match tree.invert(&op) {
            Ok(()) => {}
            Err(MstError::Incomplete(_)) => return Ok(Some("a tree node the inversion needs is not in the CAR")),
            Err(MstError::Invalid(e)) => return Err(mst(e)),
        }
    }
    match tree.root() {
        Ok(root) if root == prev_data.as_bytes() => Ok(None),
        Ok(_) => Err(mst("inverting the ops does not give prevData".into())),
        Err(MstError::Incomplete(_)) => Ok(Some("a tree node the inversion needs is not in the CAR")),
        Err(MstError::Invalid(e)) => Err(mst(e)),
    }
}

/// Checks a `#sync` at `tier` (its CAR holds the signed commit only).
///
/// # Errors
/// The first check that fails.
pub fn sync(ev: &SyncEvent<'_>, key: &PublicKey, tier: Tier) -> Result<Verified, Failure> {
    let car = Car::parse(ev.blocks, tier == Tier::Full).map_err(|e| match e {
        atproto_data::DecodeError::BlockHash(c) => {
            Failure::new(Reason::Cid, format!("block {c} does not hash to its CID"))
        }
        e => Failure::new(Reason::Malformed, e.to_string()),
    })?;
    let c = check_commit_in(&car, None, ev.did, key)?;
    if c.rev != ev.rev {
        return Err(Failure::new(Reason::Malformed, "the commit's rev is not the event's"));
    }
    Ok(Verified { rev: c.rev.to_owned(), data: c.data.as_bytes().to_vec(), unproven: None })
}
