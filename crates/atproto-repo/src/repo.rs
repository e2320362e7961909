//! A whole repo as `com.atproto.sync.getRepo` serves it (a CAR v1 whose root is the
//! signed commit), verified in full before anything of it is believed: every block
//! hashes to its CID, the commit is the repo's and signed by its key, the tree under the
//! commit's `data` is complete, its keys are valid, strictly ordered and on their
//! layers, it is canonical (rebuilt from its leaves it gives the same root), and every
//! record it names is in the CAR. What passes is a snapshot the repo-sync path may fold
//! into a downstream copy; what fails says which of these it broke.

use atproto_crypto::PublicKey;
use atproto_data::car::Car;
use atproto_data::cid::Cid;

use std::borrow::Cow;

use crate::mst::MstError;
use crate::{Commit, CommitError, check_commit_in};

/// Why a fetched repo is not a verified snapshot of the repo asked for.
#[derive(Debug, thiserror::Error)]
pub enum RepoError {
    /// The bytes are not a CAR, or a block does not hash to its CID.
    #[error("the repo's CAR does not parse or a block does not match its CID: {0}")]
    Car(#[source] atproto_data::DecodeError),
    /// The commit is missing, not the repo's, not signed by its key, or malformed.
    #[error("the repo's commit: {0}")]
    Commit(#[source] CommitError),
    /// A tree node is not a valid MST node (or not on its layer).
    #[error("the repo's tree: {0}")]
    Tree(#[source] MstError),
    /// The CAR lacks part of the tree: a diff (`getRepo?since=`) or a truncated body.
    #[error("the CAR lacks part of the repo's tree (a diff or a truncated body): not a whole repo")]
    Incomplete,
    /// A key that is not `collection/rkey`, or not after the key before it.
    #[error("the repo's tree holds a key that is not valid or not in order: {0:?}")]
    Key(String),
    /// The tree is not the one its leaves make (another shape with the same keys).
    #[error("the repo's tree is not canonical: rebuilt from its records it has another root")]
    NotCanonical,
    /// A record the tree names is not in the CAR.
    #[error("the record {0} is not in the CAR")]
    MissingRecord(String),
    /// The blocks could not be read (a repo spilled to disk).
    #[error("reading the repo's blocks: {0}")]
    Read(#[source] std::io::Error),
    /// The commit's rev is not a TID, or names a time more than [`REV_SKEW_US`] ahead
    /// of the verifier's clock (a forged rev would make every later commit look old).
    #[error("the commit's rev {0:?} is not a TID or lies in the future")]
    Rev(String),
}

/// How far a rev's time may lie ahead of the verifier's clock (PDS clocks drift): 5 min.
pub const REV_SKEW_US: i64 = 300_000_000;

/// One record of a verified repo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'a> {
    /// `collection/rkey` (tree keys are prefix-compressed: rebuilt, so owned).
    pub key: String,
    /// The record's CID (binary).
    pub cid: Vec<u8>,
    /// The record's DAG-CBOR block, checked against `cid`.
    pub block: &'a [u8],
}

/// A verified repo: its commit and every record, in key order.
#[derive(Debug, Clone)]
pub struct Snapshot<'a> {
    /// The signed commit (its CID, rev and tree root).
    pub commit: Commit<'a>,
    /// Every record, in key order.
    pub records: Vec<Record<'a>>,
}

/// Parses `bytes` (the body of `getRepo`), checking every block against its CID, and
/// verifies it as the whole repo of `did` signed with `key` ([`verify_repo`]).
///
/// # Errors
/// The first check the repo fails, as a [`RepoError`].
pub fn verify_repo_bytes<'a>(
    bytes: &'a [u8],
    did: &str,
    key: &PublicKey,
    now_us: i64,
) -> Result<Snapshot<'a>, RepoError> {
    let mut car = Car::parse(bytes, true).map_err(RepoError::Car)?;
    // Every node and record is looked up: sorted once, each look-up is a binary search
    // (a scan per look-up made the 20,000-record repo take 2 s).
    car.index();
    verify_repo(&car, did, key, now_us)
}

/// Verifies `car` (the body of `getRepo`, its blocks checked against their CIDs by
/// `Car::parse(.., true)`, and indexed by `Car::index` for the look-ups) as the whole repo
/// of `did` signed with `key`; `now_us` is the verifier's clock (microseconds since the
/// epoch), which the commit's rev may not pass by more than [`REV_SKEW_US`].
///
/// # Errors
/// The first check the repo fails, as a [`RepoError`].
pub fn verify_repo<'a>(car: &Car<'a>, did: &str, key: &PublicKey, now_us: i64) -> Result<Snapshot<'a>, RepoError> {
    let commit = check_commit_in(car, None, did, key).map_err(RepoError::Commit)?;
    check_rev(commit.rev, now_us)?;
    let mut records = Vec::new();
    walk_tree(car, commit.data.as_bytes(), |k, v| {
        let cid = Cid::from_bytes(v).map_err(|_| RepoError::Key(k.to_owned()))?;
        let block = car.get(cid).ok_or_else(|| RepoError::MissingRecord(k.to_owned()))?;
        records.push(Record { key: k.to_owned(), cid: v.to_vec(), block });
        Ok(())
    })?;
    Ok(Snapshot { commit, records })
}

/// Refuses a rev that is not a TID or lies more than [`REV_SKEW_US`] after `now_us`.
///
/// # Errors
/// [`RepoError::Rev`].
pub fn check_rev(rev: &str, now_us: i64) -> Result<(), RepoError> {
    let rev_time = atproto_data::tid::parse(rev).map(atproto_data::tid::time_us);
    if rev_time.is_none_or(|t| t > now_us.saturating_add(REV_SKEW_US)) {
        return Err(RepoError::Rev(rev.to_owned()));
    }
    Ok(())
}

/// Where a repo's blocks come from: a CAR in memory, or one spilled to a file and read
/// by offset (a repo larger than memory should hold). The source has checked every block
/// against its CID.
pub trait Blocks {
    /// The data of the block named by `cid` (binary), if the source holds it.
    ///
    /// # Errors
    /// When the source cannot be read.
    fn block(&self, cid: &[u8]) -> std::io::Result<Option<Cow<'_, [u8]>>>;

    /// True when the source holds the block named by `cid` (a source may answer without
    /// reading it; [`Blocks::block`] still checks the whole CID when it is read).
    ///
    /// # Errors
    /// When the source cannot be read.
    fn has(&self, cid: &[u8]) -> std::io::Result<bool> {
        self.block(cid).map(|b| b.is_some())
    }
}

impl Blocks for Car<'_> {
    fn block(&self, cid: &[u8]) -> std::io::Result<Option<Cow<'_, [u8]>>> {
        Ok(Cid::from_bytes(cid).ok().and_then(|c| self.get(c)).map(Cow::Borrowed))
    }
}

/// The deepest tree walked (a fanout of 4 reaches every repo there is long before).
const MAX_DEPTH: u32 = 64;

/// How every tree node is named: a `CIDv1`, DAG-CBOR, SHA-256 (what the tree's encoder
/// produces, so another codec with the same digest is another tree).
const NODE_CID_PREFIX: [u8; 4] = [0x01, 0x71, 0x12, 0x20];

/// Walks the tree under `root` in key order, checking it whole as it goes, and hands
/// `leaf` each key (`collection/rkey`) and record CID; returns how many there were.
///
/// What is checked, node by node, is what makes the tree the one its keys define (so no
/// re-encoding is needed): every node is present (else [`RepoError::Incomplete`]) and a
/// valid, canonically encoded node; every key sits on its node's layer; children are one
/// layer down; no subtree is empty; the root holds a key unless the repo is empty
/// ([`RepoError::NotCanonical`]); keys are valid and strictly increasing across the
/// whole walk. Memory is the path from the root: nothing else is kept.
///
/// # Errors
/// The first thing the tree breaks, or what `leaf` returns.
pub fn walk_tree<B: Blocks + ?Sized>(
    blocks: &B,
    root: &[u8],
    leaf: impl FnMut(&str, &[u8]) -> Result<(), RepoError>,
) -> Result<u64, RepoError> {
    let mut w = Walk { blocks, last: Vec::new(), count: 0, leaf };
    w.node(root, None, 0)?;
    Ok(w.count)
}

/// What a walk hands each record to: its key and CID.
type Leaf<'l> = dyn FnMut(&str, &[u8]) -> Result<(), RepoError> + 'l;

/// Walks a tree that [`walk_tree`] verified already (the same blocks), in key order,
/// handing `leaf` each key and record CID: what the records are rendered from. Nothing is
/// checked again but that each node is there and decodes (its keys' heights, a SHA-256
/// each, are not computed).
///
/// # Errors
/// A node missing or not decoding, or what `leaf` returns.
pub fn walk_verified<B: Blocks + ?Sized>(
    blocks: &B,
    root: &[u8],
    mut leaf: impl FnMut(&str, &[u8]) -> Result<(), RepoError>,
) -> Result<(), RepoError> {
    fn go<B: Blocks + ?Sized>(blocks: &B, cid: &[u8], depth: u32, leaf: &mut Leaf<'_>) -> Result<(), RepoError> {
        if depth > MAX_DEPTH {
            return Err(tree("tree deeper than 64 layers"));
        }
        let block = blocks.block(cid).map_err(RepoError::Read)?.ok_or(RepoError::Incomplete)?;
        let node = crate::mst::decode_with(&block, false).map_err(RepoError::Tree)?;
        if let Some(l) = node.left {
            go(blocks, l, depth + 1, leaf)?;
        }
        for e in &node.entries {
            let key =
                std::str::from_utf8(&e.key).map_err(|_| RepoError::Key(String::from_utf8_lossy(&e.key).into()))?;
            leaf(key, e.value)?;
            if let Some(r) = e.right {
                go(blocks, r, depth + 1, leaf)?;
            }
        }
        Ok(())
    }
    go(blocks, root, 0, &mut leaf)
}

/// A walk in progress: the last key seen and how many.
struct Walk<'b, B: ?Sized, F> {
    blocks: &'b B,
    last: Vec<u8>,
    count: u64,
    leaf: F,
}

fn tree(what: &str) -> RepoError {
    RepoError::Tree(MstError::Invalid(what.to_owned()))
}

impl<B: Blocks + ?Sized, F: FnMut(&str, &[u8]) -> Result<(), RepoError>> Walk<'_, B, F> {
    /// Walks the node named `cid`, which must be on `layer` (`None`: the root, on the
    /// layer of its keys).
    fn node(&mut self, cid: &[u8], layer: Option<u32>, depth: u32) -> Result<(), RepoError> {
        if depth > MAX_DEPTH {
            return Err(tree("tree deeper than 64 layers"));
        }
        if cid.len() != 36 || !cid.starts_with(&NODE_CID_PREFIX) {
            return Err(tree("a tree link that is not a DAG-CBOR SHA-256 CID"));
        }
        let block = self.blocks.block(cid).map_err(RepoError::Read)?.ok_or(RepoError::Incomplete)?;
        let node = crate::mst::decode(&block).map_err(RepoError::Tree)?;
        let layer = match (node.entries.first(), layer) {
            (Some(e), None) => e.height,
            (Some(e), Some(l)) if e.height == l => l,
            (Some(_), Some(_)) => return Err(tree("a node's keys are not on its layer")),
            // The empty repo; a root with a subtree and no key is a layer too many.
            (None, None) => return if node.left.is_none() { Ok(()) } else { Err(RepoError::NotCanonical) },
            (None, Some(_)) if node.left.is_none() => return Err(tree("an empty node inside the tree")),
            (None, Some(l)) => l,
        };
        let below = || layer.checked_sub(1).ok_or_else(|| tree("a layer-0 node has children"));
        if let Some(l) = node.left {
            self.node(l, Some(below()?), depth + 1)?;
        }
        for e in &node.entries {
            if e.height != layer {
                return Err(tree("a node's keys are not all on one layer"));
            }
            let key = next_key(&e.key, (self.count > 0).then_some(self.last.as_slice()))?;
            (self.leaf)(key, e.value)?;
            self.last.clone_from(&e.key);
            self.count += 1;
            if let Some(r) = e.right {
                self.node(r, Some(below()?), depth + 1)?;
            }
        }
        Ok(())
    }
}

/// `k` as the next key of a tree whose previous key was `last`: valid, and after it.
fn next_key<'k>(k: &'k [u8], last: Option<&[u8]>) -> Result<&'k str, RepoError> {
    std::str::from_utf8(k)
        .ok()
        .filter(|key| valid_key(key) && last.is_none_or(|l| l < k))
        .ok_or_else(|| RepoError::Key(String::from_utf8_lossy(k).into_owned()))
}

/// A record key: `<collection NSID>/<record key>`, both non-empty, printable ASCII
/// without spaces, at most 512 bytes in all (the repo spec's limits, loosely).
fn valid_key(key: &str) -> bool {
    let Some((collection, rkey)) = key.split_once('/') else { return false };
    let part = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
    key.len() <= 512 && part(collection) && part(rkey) && collection.contains('.')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_must_be_collection_slash_rkey_and_strictly_increasing() {
        let post = b"app.bsky.feed.post/3n3ykm47pn72h".as_slice();
        assert_eq!(next_key(post, None).expect("first"), "app.bsky.feed.post/3n3ykm47pn72h");
        assert!(next_key(b"app.bsky.feed.post/3n3ykm47pn73h", Some(post)).is_ok(), "after");
        for (k, last) in [
            (post, Some(post)),                                           // the same key twice
            (b"app.bsky.feed.like/3n3ykm47pn72h".as_slice(), Some(post)), // before the last
            (b"app.bsky.feed.post".as_slice(), None),                     // no rkey
            (b"/3n3ykm47pn72h".as_slice(), None),                         // no collection
            (b"post/3n3ykm47pn72h".as_slice(), None),                     // not an NSID
            (b"app.bsky.feed.post/a b".as_slice(), None),                 // a space
            (b"app.bsky.feed.post/x/y".as_slice(), None),                 // a second slash
            (b"app.bsky.feed.post/\xff".as_slice(), None),                // not UTF-8
        ] {
            assert!(
                matches!(next_key(k, last), Err(RepoError::Key(_))),
                "{:?} after {:?}",
                String::from_utf8_lossy(k),
                last.map(String::from_utf8_lossy)
            );
        }
    }
}
