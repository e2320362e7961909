//! One repo from its DID to a verified snapshot: the DID document names the PDS
//! (`#atproto_pds`) and the key, `getRepo` is fetched from the PDS within the fetch's
//! bounds, and the body is verified whole (`atproto_repo::repo`); a signature that fails
//! against the cached key is checked once more against a freshly resolved one (the
//! account may have rotated it).

use std::collections::BTreeMap;

use atproto_identity::resolver::{ResolveError, Resolver};
use atproto_repo::repo::{RepoError, Snapshot, verify_repo_bytes};

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
    verified(resolver, client, Route { hosts: &hosts, via: None }, did, limits, now_us, |pds, snap, bytes| {
        let mut collections = BTreeMap::new();
        for r in &snap.records {
            let collection = r.key.split_once('/').map_or(r.key.as_str(), |(c, _)| c);
            *collections.entry(collection.to_owned()).or_insert(0) += 1;
        }
        Checked {
            pds,
            rev: snap.commit.rev.to_owned(),
            commit: snap.commit.cid.to_string_b32(),
            data: snap.commit.data.to_string_b32(),
            collections,
            bytes,
        }
    })
    .await
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

/// Resolves, fetches (from the route's `via` when given, else the PDS) and verifies `did`'s repo,
/// then hands `f` the PDS, the verified
/// snapshot (borrowing the body) and the body's size. Verifying (and what `f` does) runs
/// on a blocking thread: a large repo takes longer than a runtime worker may be held.
pub(crate) async fn verified<T, F>(
    resolver: &Resolver,
    client: &guarded_http::Client,
    route: Route<'_>,
    did: &str,
    limits: &Limits,
    now_us: i64,
    f: F,
) -> Result<T, CheckError>
where
    F: FnOnce(String, &Snapshot<'_>, u64) -> T + Send + 'static,
    T: Send + 'static,
{
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
    let len = fetched.body.len();
    let body = std::sync::Arc::new(fetched.body);
    let attempt = |key: atproto_crypto::PublicKey, f: F| {
        let (body, did, pds) = (body.clone(), did.to_owned(), pds.clone());
        tokio::task::spawn_blocking(move || -> Result<T, (CheckError, Option<F>)> {
            let bytes = body.bytes().map_err(|e| (CheckError::Read(e), None))?;
            match verify_repo_bytes(&bytes, &did, &key, now_us) {
                Ok(snap) => Ok(f(pds, &snap, len)),
                // The account may have rotated its key: `f` comes back for a second try.
                Err(e @ RepoError::Commit(atproto_repo::CommitError::Signature(_))) => {
                    Err((CheckError::Verify(e), Some(f)))
                }
                Err(e) => Err((CheckError::Verify(e), None)),
            }
        })
    };
    let joined = |e: tokio::task::JoinError| CheckError::Read(std::io::Error::other(e));
    match attempt(id.signing_key.clone(), f).await.map_err(joined)? {
        Ok(t) => Ok(t),
        Err((_, Some(f))) => {
            let fresh = resolver.refresh(did).await.map_err(CheckError::Resolve)?;
            attempt(fresh.signing_key.clone(), f).await.map_err(joined)?.map_err(|(e, _)| e)
        }
        Err((e, None)) => Err(e),
    }
}
