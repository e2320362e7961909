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

use crate::mst::{MstError, Partial};
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
/// `Car::parse(.., true)`, and indexed by `Car::index` for the look-ups) as the whole repo of `did` signed with `key`; `now_us` is the
/// verifier's clock (microseconds since the epoch), which the commit's rev may not pass
/// by more than [`REV_SKEW_US`].
///
/// # Errors
/// The first check the repo fails, as a [`RepoError`].
pub fn verify_repo<'a>(car: &Car<'a>, did: &str, key: &PublicKey, now_us: i64) -> Result<Snapshot<'a>, RepoError> {
    let commit = check_commit_in(car, None, did, key).map_err(RepoError::Commit)?;
    let rev_time = atproto_data::tid::parse(commit.rev).map(atproto_data::tid::time_us);
    if rev_time.is_none_or(|t| t > now_us.saturating_add(REV_SKEW_US)) {
        return Err(RepoError::Rev(commit.rev.to_owned()));
    }
    let tree = Partial::load(car, commit.data).map_err(RepoError::Tree)?;
    let leaves = tree.leaves().ok_or(RepoError::Incomplete)?;
    let mut records = Vec::with_capacity(leaves.len());
    let mut last: Option<&[u8]> = None;
    for (k, v) in &leaves {
        let key = next_key(k, last)?;
        last = Some(k);
        let cid = Cid::from_bytes(v).map_err(|_| RepoError::Key(key.to_owned()))?;
        let block = car.get(cid).ok_or_else(|| RepoError::MissingRecord(key.to_owned()))?;
        records.push(Record { key: key.to_owned(), cid: v.to_vec(), block });
    }
    if tree.rebuild().map_err(RepoError::Tree)? != commit.data.as_bytes() {
        return Err(RepoError::NotCanonical);
    }
    Ok(Snapshot { commit, records })
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
