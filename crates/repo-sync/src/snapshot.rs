//! A verified repo as the consumer delivers it: its commit and every record rendered once
//! in the atproto JSON data model, owned (the fetched body is gone once this exists).

use atproto_identity::resolver::Resolver;

use crate::check::{CheckError, verified};
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

/// A repo fetched from its PDS and verified whole.
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
    /// Every record, in key order.
    pub records: Vec<RepoRecord>,
}

/// Resolves `did`, fetches its repo from its PDS, verifies it whole and renders its
/// records.
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
) -> Result<RepoSnapshot, CheckError> {
    let did_owned = did.to_owned();
    verified(resolver, client, route, did, limits, now_us, move |pds, snap, bytes| RepoSnapshot {
        did: did_owned,
        rev: snap.commit.rev.to_owned(),
        commit: snap.commit.cid.to_string_b32(),
        data: snap.commit.data.to_string_b32(),
        data_cid: snap.commit.data.as_bytes().to_vec(),
        pds,
        bytes,
        records: render(&snap.records),
    })
    .await
}

/// Records past which rendering is split over two threads.
const PARALLEL: usize = 4096;

/// Renders every record, in key order; a large repo on two threads.
fn render(records: &[atproto_repo::repo::Record<'_>]) -> Vec<RepoRecord> {
    let one = |r: &atproto_repo::repo::Record<'_>| {
        let (collection, rkey) = r.key.split_once('/').unwrap_or((r.key.as_str(), ""));
        let cid = atproto_data::cid::Cid::from_bytes(&r.cid).map(|c| c.to_string_b32()).unwrap_or_default();
        let mut json = String::with_capacity(r.block.len() * 2);
        atproto_data::json::write_cbor_as_json(r.block, &mut json);
        RepoRecord { collection: collection.to_owned(), rkey: rkey.to_owned(), cid, json }
    };
    if records.len() < PARALLEL {
        return records.iter().map(one).collect();
    }
    let (a, b) = records.split_at(records.len() / 2);
    std::thread::scope(|s| {
        let second = s.spawn(|| b.iter().map(one).collect::<Vec<_>>());
        let mut out: Vec<RepoRecord> = Vec::with_capacity(records.len());
        out.extend(a.iter().map(one));
        match second.join() {
            Ok(rest) => out.extend(rest),
            Err(p) => std::panic::resume_unwind(p),
        }
        out
    })
}
