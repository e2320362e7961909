//! Listing a host's repos (`com.atproto.sync.listRepos`, a relay or a PDS), or those that
//! hold records of a collection (`com.atproto.sync.listReposByCollection`, a relay's
//! collection index), a page at a time, for backfills.

use std::time::Duration;

use crate::fetch::FetchError;

/// How long a page may take.
const PAGE_TIMEOUT: Duration = Duration::from_mins(1);

/// The largest page body read.
const PAGE_MAX: usize = 16 << 20;

/// A repo a listing names as active.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Its DID.
    pub did: String,
    /// Its current rev, when the host says (`listRepos` does; `listReposByCollection`
    /// does not): what a reconcile compares with the last rev handed over.
    pub rev: Option<String>,
}

/// One page of `com.atproto.sync.listRepos`.
#[derive(Debug)]
pub struct ListPage {
    /// The active repos.
    pub active: Vec<Listed>,
    /// Repos listed inactive (skipped).
    pub inactive: usize,
    /// The next page's cursor.
    pub cursor: Option<String>,
    /// The page listed no repo (the end, whatever the cursor says).
    pub empty: bool,
}

/// Repos asked for per listing page (the most `listRepos` serves).
pub const LIST_LIMIT: usize = 1000;

/// Asks `host` for the page of its repos after `cursor`.
///
/// # Errors
/// The host is not a URL or refused by the guard, did not answer in a minute, answered
/// another status, or not a `listRepos` page.
pub async fn list_repos(
    client: &guarded_http::Client,
    host: &str,
    cursor: Option<&str>,
) -> Result<ListPage, FetchError> {
    page(client, host, "/xrpc/com.atproto.sync.listRepos", None, cursor).await
}

/// Asks `host` for the page, after `cursor`, of the repos that hold records of
/// `collection` (an NSID).
///
/// # Errors
/// As [`list_repos`].
pub async fn list_repos_by_collection(
    client: &guarded_http::Client,
    host: &str,
    collection: &str,
    cursor: Option<&str>,
) -> Result<ListPage, FetchError> {
    page(client, host, "/xrpc/com.atproto.sync.listReposByCollection", Some(collection), cursor).await
}

/// One page of a listing at `path` (repos without an `active` field count as active).
async fn page(
    client: &guarded_http::Client,
    host: &str,
    path: &str,
    collection: Option<&str>,
    cursor: Option<&str>,
) -> Result<ListPage, FetchError> {
    let mut url = url::Url::parse(host).map_err(FetchError::Endpoint)?;
    url.set_path(path);
    url.query_pairs_mut().clear().append_pair("limit", &LIST_LIMIT.to_string());
    if let Some(c) = collection {
        url.query_pairs_mut().append_pair("collection", c);
    }
    if let Some(c) = cursor {
        url.query_pairs_mut().append_pair("cursor", c);
    }
    let req = client.get(url.as_str()).map_err(|e| FetchError::Refused(e.to_string()))?;
    let resp = tokio::time::timeout(PAGE_TIMEOUT, req.send())
        .await
        .map_err(|_| FetchError::Timeout(PAGE_TIMEOUT))?
        .map_err(|e| crate::fetch::transport(&e))?;
    if !resp.status().is_success() {
        return Err(FetchError::Failed(format!("HTTP {}", resp.status().as_u16())));
    }
    let body = guarded_http::read_bounded(resp, PAGE_MAX).await.map_err(|e| FetchError::Failed(e.to_string()))?;
    let not_a_page = |why: String| FetchError::Failed(format!("not a listing page: {why}"));
    let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| not_a_page(e.to_string()))?;
    let repos = v["repos"].as_array().ok_or_else(|| not_a_page("no repos".into()))?;
    let (mut active, mut inactive) = (Vec::with_capacity(repos.len()), 0);
    for r in repos {
        match r["did"].as_str() {
            Some(did) if r["active"] != false && did.starts_with("did:") => {
                active.push(Listed { did: did.to_owned(), rev: r["rev"].as_str().map(str::to_owned) });
            }
            _ => inactive += 1,
        }
    }
    let cursor = v["cursor"].as_str().filter(|c| !c.is_empty()).map(str::to_owned);
    Ok(ListPage { empty: repos.is_empty(), active, inactive, cursor })
}
