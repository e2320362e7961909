//! One repo from its DID to a verified snapshot: the DID document names the PDS
//! (`#atproto_pds`) and the key, `getRepo` is fetched from the PDS within the fetch's
//! bounds, and the body is verified whole (`atproto_repo::repo`); a signature that fails
//! against the cached key is checked once more against a freshly resolved one (the
//! account may have rotated it).

use std::collections::BTreeMap;

use std::sync::Arc;

use atproto_crypto::PublicKey;
use atproto_data::cid::Cid;
use atproto_identity::resolver::{ResolveError, Resolver};
use atproto_repo::repo::{Blocks as _, RepoError, check_rev, walk_tree};
use atproto_repo::{CommitError, check_commit_block};

use crate::blocks::Indexed;
use crate::fetch::{FetchError, Limits, fetch, get_repo_url};

/// What a verified repo holds, in brief.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The PDS it was fetched from.
    pub pds: String,
    /// The commit's rev.
    pub rev: String,
    /// The commit's CID.
    pub commit: String,
    /// The tree's root CID.
    pub data: String,
    /// Records per collection.
    pub collections: BTreeMap<String, u64>,
    /// The CAR's size.
    pub bytes: u64,
}

impl Checked {
    /// Every record.
    #[must_use]
    pub fn records(&self) -> u64 {
        self.collections.values().sum()
    }
}

/// Why a repo could not be checked.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The DID did not resolve.
    #[error("resolving the DID: {0}")]
    Resolve(#[source] ResolveError),
    /// The DID document names no PDS.
    #[error("the DID document names no #atproto_pds service")]
    NoPds,
    /// The fetch gave no repo.
    #[error("fetching the repo: {0}")]
    Fetch(#[source] FetchError),
    /// The spilled body could not be read back.
    #[error("reading the fetched repo: {0}")]
    Read(#[source] std::io::Error),
    /// The repo is not a verified whole repo of the DID.
    #[error("verifying the repo: {0}")]
    Verify(#[source] RepoError),
}

/// Resolves `did`, fetches its repo from its PDS and verifies it whole; `now_us` is the
/// clock a rev may not lie ahead of.
///
/// # Errors
/// The [`CheckError`] of the first step that failed.
pub async fn check_repo(
    resolver: &Resolver,
    client: &guarded_http::Client,
    did: &str,
    limits: &Limits,
    now_us: i64,
) -> Result<Checked, CheckError> {
    let hosts = crate::hosts::Hosts::default();
    let route = Route { hosts: &hosts, via: None };
    let (pds, head, ix) = committed(resolver, client, route, did, limits, now_us).await?;
    let head = walked(&ix, head).await?;
    Ok(Checked {
        pds,
        rev: head.rev,
        commit: head.commit,
        data: head.data,
        collections: head.collections,
        bytes: ix.len(),
    })
}

/// Which way a repo is fetched: the hosts parked by their rate limits, and the host asked
/// instead of the PDS (a relay that redirects to it), if any.
#[derive(Debug, Clone, Copy)]
pub struct Route<'a> {
    /// Hosts parked by their rate limits.
    pub hosts: &'a crate::hosts::Hosts,
    /// Ask this host instead of the repo's PDS.
    pub via: Option<&'a str>,
}

/// What verifying a whole repo found: its signed commit, and how many records each
/// collection holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The commit's rev.
    pub rev: String,
    /// The commit's CID.
    pub commit: String,
    /// The tree's root CID.
    pub data: String,
    /// The tree's root CID, binary (what a commit's `prevData` names).
    pub data_cid: Vec<u8>,
    /// Records per collection.
    pub collections: BTreeMap<String, u64>,
}

/// Verifies the indexed CAR `ix` as the whole repo of `did` signed with `key` (see
/// [`atproto_repo::repo`]): the commit ([`verify_commit`]), then one walk of the tree,
/// which also finds every record ([`verify_records`]).
///
/// # Errors
/// The first check the repo fails.
pub fn verify_indexed(ix: &Indexed, did: &str, key: &PublicKey, now_us: i64) -> Result<Head, RepoError> {
    let mut head = verify_commit(ix, did, key, now_us)?;
    head.collections = verify_records(ix, &head.data_cid)?;
    Ok(head)
}

/// Verifies the CAR's root as the signed commit of `did` (signed with `key`, its rev a TID
/// not past `now_us` by more than the allowance): its [`Head`], no collections yet.
///
/// # Errors
/// The first check the commit fails.
pub fn verify_commit(ix: &Indexed, did: &str, key: &PublicKey, now_us: i64) -> Result<Head, RepoError> {
    let [root] = ix.roots() else { return Err(RepoError::Commit(CommitError::Root)) };
    let root_cid = Cid::from_bytes(root).map_err(|_| RepoError::Commit(CommitError::Root))?;
    let block = ix.block(root).map_err(RepoError::Read)?.ok_or(RepoError::Commit(CommitError::MissingCommit))?;
    let c = check_commit_block(root_cid, &block, did, key).map_err(RepoError::Commit)?;
    check_rev(c.rev, now_us)?;
    Ok(Head {
        rev: c.rev.to_owned(),
        commit: c.cid.to_string_b32(),
        data: c.data.to_string_b32(),
        data_cid: c.data.as_bytes().to_vec(),
        collections: BTreeMap::new(),
    })
}

/// Walks the tree under `data` whole ([`walk_tree`]), every record present: how many
/// records each collection holds.
///
/// # Errors
/// The first check the tree fails.
pub fn verify_records(ix: &Indexed, data: &[u8]) -> Result<BTreeMap<String, u64>, RepoError> {
    let mut collections: BTreeMap<String, u64> = BTreeMap::new();
    walk_tree(ix, data, |k, v| {
        if Cid::from_bytes(v).is_err() {
            return Err(RepoError::Key(k.to_owned()));
        }
        if !ix.has(v).map_err(RepoError::Read)? {
            return Err(RepoError::MissingRecord(k.to_owned()));
        }
        let collection = k.split_once('/').map_or(k, |(c, _)| c);
        // Keys come in order: a collection's records are together.
        match collections.last_key_value() {
            Some((last, _)) if last == collection => {}
            _ => {
                collections.insert(collection.to_owned(), 0);
            }
        }
        if let Some(n) = collections.get_mut(collection) {
            *n += 1;
        }
        Ok(())
    })?;
    Ok(collections)
}

/// [`verify_records`] on a blocking thread: `head` with its collections.
pub(crate) async fn walked(ix: &Arc<Indexed>, mut head: Head) -> Result<Head, CheckError> {
    let (ix, data) = (ix.clone(), head.data_cid.clone());
    head.collections = tokio::task::spawn_blocking(move || verify_records(&ix, &data))
        .await
        .map_err(|e| CheckError::Read(std::io::Error::other(e)))?
        .map_err(CheckError::Verify)?;
    Ok(head)
}

/// Resolves, fetches (from the route's `via` when given, else the PDS), indexes and
/// verifies the commit of `did`'s repo: the PDS, the commit, and the indexed body, whose
/// tree the caller walks next ([`walked`]). Indexing and verifying run on a blocking
/// thread: a large repo takes longer than a runtime worker may be held.
pub(crate) async fn committed(
    resolver: &Resolver,
    client: &guarded_http::Client,
    route: Route<'_>,
    did: &str,
    limits: &Limits,
    now_us: i64,
) -> Result<(String, Head, Arc<Indexed>), CheckError> {
    let id = resolver.resolve(did).await.map_err(CheckError::Resolve)?;
    let pds = id.pds.clone().ok_or(CheckError::NoPds)?;
    // Through a relay (which redirects to the PDS, each hop guarded) or the PDS itself;
    // the key comes from the DID document either way.
    let (hosts, via) = (route.hosts, route.via);
    let url = get_repo_url(via.unwrap_or(&pds), did).map_err(CheckError::Fetch)?;
    let host = crate::hosts::key(&url);
    if let Some(left) = hosts.parked(&host) {
        return Err(CheckError::Fetch(FetchError::Parked(left)));
    }
    let fetched = match fetch(client, &url, limits).await {
        Ok(f) => f,
        Err(FetchError::RateLimited(rl)) => {
            hosts.park(&host, rl.wait.unwrap_or(crate::hosts::DEFAULT_PARK));
            return Err(CheckError::Fetch(FetchError::RateLimited(rl)));
        }
        Err(e) => return Err(CheckError::Fetch(e)),
    };
    if fetched.rate.remaining == Some(0) {
        hosts.park(&host, fetched.rate.wait.unwrap_or(crate::hosts::DEFAULT_PARK));
    }
    let joined = |e: tokio::task::JoinError| CheckError::Read(std::io::Error::other(e));
    let body = fetched.body;
    let ix =
        tokio::task::spawn_blocking(move || Indexed::open(body)).await.map_err(joined)?.map_err(CheckError::Verify)?;
    let ix = Arc::new(ix);
    let attempt = |key: PublicKey| {
        let (ix, did) = (ix.clone(), did.to_owned());
        tokio::task::spawn_blocking(move || verify_commit(&ix, &did, &key, now_us))
    };
    let head = match attempt(id.signing_key.clone()).await.map_err(joined)? {
        Ok(h) => h,
        // The account may have rotated its key: once more with a freshly resolved one.
        Err(RepoError::Commit(CommitError::Signature(_))) => {
            let fresh = resolver.refresh(did).await.map_err(CheckError::Resolve)?;
            attempt(fresh.signing_key.clone()).await.map_err(joined)?.map_err(CheckError::Verify)?
        }
        Err(e) => return Err(CheckError::Verify(e)),
    };
    Ok((pds, head, ix))
}
