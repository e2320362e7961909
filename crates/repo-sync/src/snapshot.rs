//! A verified repo as the consumer delivers it: its commit first ([`RepoSnapshot`]), then
//! its records rendered in the atproto JSON data model a part at a time ([`Parts`]), so a
//! repo of millions of records never sits in memory whole: the body stays where the fetch
//! put it (memory, or a file past the memory bound), indexed, and each part is rendered
//! when the one before it has been taken.

use std::sync::Arc;

use atproto_identity::resolver::Resolver;
use atproto_repo::repo::{Blocks as _, RepoError, walk_verified};
use tokio::sync::mpsc;

use crate::blocks::Indexed;
use crate::check::{CheckError, committed, walked};
use crate::fetch::Limits;

/// One record of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRecord {
    /// The collection (NSID).
    pub collection: String,
    /// The record key.
    pub rkey: String,
    /// The record's CID (base32).
    pub cid: String,
    /// The record in the atproto JSON data model.
    pub json: String,
}

/// A repo fetched from its PDS and verified whole: what comes before its records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoSnapshot {
    /// The repo's DID.
    pub did: String,
    /// The commit's rev.
    pub rev: String,
    /// The commit's CID.
    pub commit: String,
    /// The tree's root CID.
    pub data: String,
    /// The tree's root CID, binary (what a commit's `prevData` names).
    pub data_cid: Vec<u8>,
    /// The PDS it came from.
    pub pds: String,
    /// The CAR's size.
    pub bytes: u64,
    /// How many records [`Parts`] will give (those the filter wants).
    pub records: u64,
}

/// Whether a snapshot carries a collection's records.
pub type Want = dyn Fn(&str) -> bool + Send + Sync;

/// Which collections a snapshot carries (`None`: all).
pub type Wants = Option<Arc<Want>>;

/// Records per part, at most.
pub const PART_RECORDS: usize = 4096;

/// Rendered JSON per part past which the part is cut early (large records).
const PART_BYTES: usize = 8 << 20;

/// A snapshot's records, in key order, a part at a time; rendered on a blocking thread
/// one part ahead of the reader. Dropping it stops the rendering and frees the body.
#[derive(Debug)]
pub struct Parts {
    rx: mpsc::Receiver<Result<Vec<RepoRecord>, String>>,
}

impl Parts {
    /// The next part; `None` once every record was given; `Err` when the body could not
    /// be read back (the snapshot is then incomplete: fetch it again).
    pub async fn next(&mut self) -> Option<Result<Vec<RepoRecord>, String>> {
        self.rx.recv().await
    }

    /// Every part at once (tests and tools: this holds the whole repo).
    ///
    /// # Errors
    /// As [`Parts::next`].
    pub async fn collect(mut self) -> Result<Vec<RepoRecord>, String> {
        let mut all = Vec::new();
        while let Some(p) = self.next().await {
            all.extend(p?);
        }
        Ok(all)
    }
}

/// Resolves `did`, fetches its repo from its PDS (or the route's host), verifies it whole,
/// and returns its commit and its records (those `wants` keeps) to be read a part at a
/// time.
///
/// # Errors
/// The [`CheckError`] of the first step that failed.
pub async fn fetch_snapshot(
    resolver: &Resolver,
    client: &guarded_http::Client,
    route: crate::check::Route<'_>,
    did: &str,
    limits: &Limits,
    now_us: i64,
    wants: Wants,
) -> Result<(RepoSnapshot, Parts), CheckError> {
    let (pds, head, ix) = committed(resolver, client, route, did, limits, now_us).await?;
    // A body in memory (at most the memory bound) starts rendering now, beside the tree's
    // walk: up to EARLY_PARTS parts wait for the walk's verdict (dropped, unread, if it
    // fails). A body on disk renders after, one part ahead of the reader.
    let early = ix.in_memory().then(|| spawn_parts(ix.clone(), head.data_cid.clone(), wants.clone(), EARLY_PARTS));
    let head = walked(&ix, head).await?;
    let records = head.collections.iter().filter(|(c, _)| wants.as_ref().is_none_or(|w| w(c))).map(|(_, n)| n).sum();
    let snap = RepoSnapshot {
        did: did.to_owned(),
        rev: head.rev,
        commit: head.commit,
        data: head.data,
        data_cid: head.data_cid.clone(),
        pds,
        bytes: ix.len(),
        records,
    };
    let parts = early.unwrap_or_else(|| spawn_parts(ix, head.data_cid, wants, 1));
    Ok((snap, parts))
}

/// Parts of a repo in memory rendered ahead while its tree is verified.
const EARLY_PARTS: usize = 8;

/// Renders the records under `root` on a blocking thread, up to `ahead` parts ahead of
/// the reader.
fn spawn_parts(ix: Arc<Indexed>, root: Vec<u8>, wants: Wants, ahead: usize) -> Parts {
    let (tx, rx) = mpsc::channel(ahead);
    tokio::task::spawn_blocking(move || produce(&ix, &root, wants.as_ref(), &tx));
    Parts { rx }
}

/// A record found, not yet rendered.
struct Found<'a> {
    key: String,
    cid: Vec<u8>,
    block: std::borrow::Cow<'a, [u8]>,
}

/// Walks the (verified) tree again, rendering the records `wants` keeps a part at a time.
fn produce(ix: &Indexed, root: &[u8], wants: Option<&Arc<Want>>, tx: &mpsc::Sender<Result<Vec<RepoRecord>, String>>) {
    let gone = || RepoError::Read(std::io::Error::other("the reader is gone"));
    let mut found: Vec<Found<'_>> = Vec::with_capacity(PART_RECORDS);
    let mut size = 0usize;
    let walked = walk_verified(ix, root, |k, v| {
        let collection = k.split_once('/').map_or(k, |(c, _)| c);
        if wants.is_some_and(|w| !w(collection)) {
            return Ok(());
        }
        let block = ix.block(v).map_err(RepoError::Read)?.ok_or_else(|| RepoError::MissingRecord(k.to_owned()))?;
        size += block.len() * 2;
        found.push(Found { key: k.to_owned(), cid: v.to_vec(), block });
        if found.len() >= PART_RECORDS || size >= PART_BYTES {
            size = 0;
            tx.blocking_send(Ok(render(&std::mem::take(&mut found)))).map_err(|_| gone())?;
        }
        Ok(())
    });
    let last = match walked {
        Ok(()) if found.is_empty() => return,
        Ok(()) => Ok(render(&found)),
        Err(e) => Err(e.to_string()),
    };
    let _ = tx.blocking_send(last);
}

/// Records past which rendering is split over two threads.
const PARALLEL: usize = 1024;

/// Renders found records, in order; many on two threads.
fn render(found: &[Found<'_>]) -> Vec<RepoRecord> {
    let one = |r: &Found<'_>| {
        let (collection, rkey) = r.key.split_once('/').unwrap_or((r.key.as_str(), ""));
        let cid = atproto_data::cid::Cid::from_bytes(&r.cid).map(|c| c.to_string_b32()).unwrap_or_default();
        let mut json = String::with_capacity(r.block.len() * 2);
        atproto_data::json::write_cbor_as_json(&r.block, &mut json);
        RepoRecord { collection: collection.to_owned(), rkey: rkey.to_owned(), cid, json }
    };
    if found.len() < PARALLEL {
        return found.iter().map(one).collect();
    }
    let (a, b) = found.split_at(found.len() / 2);
    std::thread::scope(|s| {
        let second = s.spawn(|| b.iter().map(one).collect::<Vec<_>>());
        let mut out: Vec<RepoRecord> = Vec::with_capacity(found.len());
        out.extend(a.iter().map(one));
        match second.join() {
            Ok(rest) => out.extend(rest),
            Err(p) => std::panic::resume_unwind(p),
        }
        out
    })
}
