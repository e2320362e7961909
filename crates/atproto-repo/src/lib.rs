//! atproto repo commits, one concern: the signed commit a `#commit` or `#sync` event
//! carries, checked without trusting the relay.
//!
//! [`check_commit`] takes the event's CAR slice, the commit CID the event names (for a
//! `#commit`), the repo DID and the repo's `#atproto` key, and requires: the CAR's single
//! root is the commit; the commit block is present and hashes to that CID; the commit
//! (DAG-CBOR, strict) names the repo as its `did` and `version` 3; its `sig` (64-byte
//! compact ECDSA, low-S) verifies over the DAG-CBOR encoding of the commit without `sig`.
//!
//! The unsigned bytes are not re-encoded: the commit block is canonical DAG-CBOR (keys
//! in length-then-bytewise order, checked while reading), so the commit without `sig` is
//! the same bytes with the `sig` entry cut out and the map's length one less.

pub mod mst;
pub mod repo;
pub mod verify;

use atproto_crypto::{PublicKey, SignatureError};
use atproto_data::car::Car;
use atproto_data::cbor::Reader;
use atproto_data::cid::Cid;

/// Why a commit is not what its event claims.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    /// The CAR slice does not parse.
    #[error("the event's CAR does not parse: {0}")]
    Car(#[source] atproto_data::DecodeError),
    /// The CAR's roots are not exactly the commit.
    #[error("the CAR's root is not the commit the event names")]
    Root,
    /// No block for the commit.
    #[error("the CAR holds no commit block")]
    MissingCommit,
    /// The commit block does not hash to its CID.
    #[error("the commit block does not hash to its CID")]
    Cid,
    /// The commit block is not a commit object in strict DAG-CBOR.
    #[error("the commit block is not a valid commit: {0}")]
    Malformed(String),
    /// The commit is another repo's.
    #[error("the commit's did {found} is not the event's repo")]
    DidMismatch {
        /// The DID the commit names.
        found: String,
    },
    /// Not a version 3 commit.
    #[error("commit version {0}, expected 3")]
    Version(u64),
    /// The signature is not valid for the repo's key.
    #[error("commit signature: {0}")]
    Signature(#[from] SignatureError),
}

/// What a checked commit says (borrowed from the event's bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit<'a> {
    /// The commit's CID.
    pub cid: Cid<'a>,
    /// The repo DID.
    pub did: &'a str,
    /// The revision (a TID).
    pub rev: &'a str,
    /// The MST root.
    pub data: Cid<'a>,
    /// The previous commit, if the commit names one.
    pub prev: Option<Cid<'a>>,
}

/// The commit's fields and the byte range of its `sig` entry in `block`.
struct Parsed<'a> {
    did: &'a str,
    rev: &'a str,
    data: Cid<'a>,
    prev: Option<Cid<'a>>,
    version: u64,
    sig: &'a [u8],
    sig_entry: std::ops::Range<usize>,
    entries: u64,
}

fn bad(what: impl std::fmt::Display) -> CommitError {
    CommitError::Malformed(what.to_string())
}

fn cid(b: &[u8]) -> Result<Cid<'_>, CommitError> {
    Cid::from_bytes(b).map_err(bad)
}

fn parse(block: &[u8]) -> Result<Parsed<'_>, CommitError> {
    let mut rd = Reader::new(block);
    let entries = rd.map().map_err(bad)?;
    let (mut did, mut rev, mut data, mut prev, mut version, mut sig) = (None, None, None, None, None, None);
    let mut sig_entry = 0..0;
    let mut last: Option<&str> = None;
    for _ in 0..entries {
        let at = rd.position();
        let k = rd.key(last).map_err(bad)?;
        last = Some(k);
        match k {
            "did" => did = Some(rd.str().map_err(bad)?),
            "rev" => rev = Some(rd.str().map_err(bad)?),
            "sig" => {
                sig = Some(rd.bytes().map_err(bad)?);
                sig_entry = at..rd.position();
            }
            "data" => data = Some(cid(rd.link().map_err(bad)?)?),
            "prev" => prev = if rd.null() { None } else { Some(cid(rd.link().map_err(bad)?)?) },
            "version" => version = Some(rd.u64().map_err(bad)?),
            _ => rd.skip().map_err(bad)?,
        }
    }
    rd.end().map_err(bad)?;
    Ok(Parsed {
        did: did.ok_or_else(|| bad("no did"))?,
        rev: rev.ok_or_else(|| bad("no rev"))?,
        data: data.ok_or_else(|| bad("no data"))?,
        prev,
        version: version.ok_or_else(|| bad("no version"))?,
        sig: sig.ok_or_else(|| bad("no sig"))?,
        sig_entry,
        entries,
    })
}

/// The DAG-CBOR bytes of the commit without its `sig` entry (what was signed).
fn unsigned(block: &[u8], p: &Parsed<'_>) -> Result<Vec<u8>, CommitError> {
    // A commit has a handful of entries: its map head is one byte (0xa0 | n).
    if p.entries > 23 || block.first() != Some(&(0xa0 | u8::try_from(p.entries).unwrap_or(0))) {
        return Err(bad("unexpected map head"));
    }
    let mut out = Vec::with_capacity(block.len());
    out.push(0xa0 | u8::try_from(p.entries - 1).unwrap_or(0));
    out.extend_from_slice(&block[1..p.sig_entry.start]);
    out.extend_from_slice(&block[p.sig_entry.end..]);
    Ok(out)
}

/// Checks the signed commit in an event's CAR slice `blocks` (see the crate docs).
/// `expected` is the commit CID a `#commit` names (`None` for a `#sync`, whose CAR root
/// names it).
///
/// # Errors
/// The first thing that is not as the event claims.
pub fn check_commit<'a>(
    blocks: &'a [u8],
    expected: Option<Cid<'_>>,
    repo: &str,
    key: &PublicKey,
) -> Result<Commit<'a>, CommitError> {
    let car = Car::parse(blocks, false).map_err(CommitError::Car)?;
    check_commit_in(&car, expected, repo, key)
}

/// [`check_commit`] on an already parsed CAR.
///
/// # Errors
/// The first thing that is not as the event claims.
pub fn check_commit_in<'a>(
    car: &Car<'a>,
    expected: Option<Cid<'_>>,
    repo: &str,
    key: &PublicKey,
) -> Result<Commit<'a>, CommitError> {
    let [root] = car.roots.as_slice() else { return Err(CommitError::Root) };
    if expected.is_some_and(|e| e.as_bytes() != root.as_bytes()) {
        return Err(CommitError::Root);
    }
    let block = car.get(*root).ok_or(CommitError::MissingCommit)?;
    check_commit_block(*root, block, repo, key)
}

/// Checks `block` as the signed commit `root` of `repo` (wherever the block came from:
/// a CAR in memory, or a repo spilled to disk): it hashes to `root`, names the repo,
/// is version 3 and is signed by `key`.
///
/// # Errors
/// The first thing that is not as claimed.
pub fn check_commit_block<'a>(
    root: Cid<'a>,
    block: &'a [u8],
    repo: &str,
    key: &PublicKey,
) -> Result<Commit<'a>, CommitError> {
    if atproto_data::car::cid_for(block) != root.as_bytes() {
        return Err(CommitError::Cid);
    }
    let p = parse(block)?;
    if p.did != repo {
        return Err(CommitError::DidMismatch { found: p.did.to_owned() });
    }
    if p.version != 3 {
        return Err(CommitError::Version(p.version));
    }
    key.verify(&unsigned(block, &p)?, p.sig)?;
    Ok(Commit { cid: root, did: p.did, rev: p.rev, data: p.data, prev: p.prev })
}
