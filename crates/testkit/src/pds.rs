//! A PDS on loopback for repo-sync tests: `com.atproto.sync.getRepo` answered from the
//! reference CARs in `fixtures/repos/cars/`, and the reference DID documents with their
//! PDS pointed at it (for [`crate::plc::Plc`]).

use std::collections::HashMap;
use std::sync::Arc;

use tokio::io::AsyncWriteExt;

/// The repo-sync fixtures folder.
#[must_use]
pub fn repos_dir() -> std::path::PathBuf {
    crate::fixture("repos")
}

/// The reference CAR of `did` (as `getRepo` served it).
///
/// # Panics
/// When the fixture is missing.
#[must_use]
pub fn car(did: &str) -> Vec<u8> {
    std::fs::read(repos_dir().join("cars").join(format!("{}.car", did.replace(':', "_")))).expect("fixture CAR")
}

/// Starts a PDS answering `getRepo?did=D` with the CAR of `serve[D]` (a DID serves its
/// own repo when mapped to itself; another's to test a PDS that answers wrongly) and 404
/// for any other DID; returns its base URL.
///
/// # Panics
/// When it cannot listen.
pub async fn start<S: std::hash::BuildHasher + Send + Sync + 'static>(serve: HashMap<String, String, S>) -> String {
    start_slow(serve, HashMap::new()).await
}

/// [`start`], with the answer for each DID in `slow` held back that long (a download in
/// flight while a test kills or freezes the process waiting for it).
///
/// # Panics
/// When it cannot listen.
pub async fn start_slow<S, T>(
    serve: HashMap<String, String, S>,
    slow: HashMap<String, std::time::Duration, T>,
) -> String
where
    S: std::hash::BuildHasher + Send + Sync + 'static,
    T: std::hash::BuildHasher + Send + Sync + 'static,
{
    start_faulty(serve, slow, HashMap::new()).await
}

/// What the PDS answers for a DID instead of its repo.
#[derive(Debug, Clone)]
pub enum Fault {
    /// `400 RepoNotFound` (the PDS's own answer for a repo it does not host).
    NotFound,
    /// `400 RepoTakendown`.
    Takendown,
    /// `429` with `Retry-After` (seconds) and `RateLimit-Remaining: 0`, the first `times`
    /// requests; then the repo.
    RateLimited {
        /// Requests answered 429.
        times: u32,
        /// `Retry-After`, seconds.
        retry_after_s: u64,
    },
    /// The first `times` answers announce the whole CAR, send half of it and close (a
    /// PDS that died half-way); then the repo.
    DiesHalfway {
        /// Answers cut short.
        times: u32,
    },
    /// Under the key [`EVERY`], for the whole host: the first `getRepo` opens a window of
    /// `secs` during which every `getRepo` of any repo is answered 429 with `Retry-After`
    /// (the seconds left); `answered` counts those 429s.
    HostWindow {
        /// The window.
        secs: u64,
        /// When it opened.
        opened: Option<std::time::Instant>,
        /// 429s answered so far.
        answered: Arc<std::sync::atomic::AtomicU32>,
    },
}

/// The fault key that stands for every repo of the host.
pub const EVERY: &str = "*";

/// [`start_slow`], with some DIDs answered by a [`Fault`] instead.
///
/// # Panics
/// When it cannot listen.
pub async fn start_faulty<S, T, U>(
    serve: HashMap<String, String, S>,
    slow: HashMap<String, std::time::Duration, T>,
    faults: HashMap<String, Fault, U>,
) -> String
where
    S: std::hash::BuildHasher + Send + Sync + 'static,
    T: std::hash::BuildHasher + Send + Sync + 'static,
    U: std::hash::BuildHasher + Send + Sync + 'static,
{
    let slow = Arc::new(slow);
    let faults = Arc::new(std::sync::Mutex::new(faults));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let serve = Arc::new(serve);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            // Head and body go out in two writes: without this, Nagle and the client's
            // delayed ACK hold every answer back ~40 ms.
            let _ = s.set_nodelay(true);
            let serve = serve.clone();
            let slow = slow.clone();
            let faults = faults.clone();
            tokio::spawn(async move {
                let mut pending = Vec::new();
                while let Some((line, _)) = crate::http::read_request_with_line(&mut s, &mut pending).await {
                    if let Some(body) = listing(&serve, &line) {
                        let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                            body.len()
                        );
                        if s.write_all(head.as_bytes()).await.is_err() || s.write_all(body.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let did = line.split("did=").nth(1).and_then(|d| d.split([' ', '&']).next()).unwrap_or("");
                    let fault = {
                        let mut f = faults.lock().expect("faults");
                        let did = did.replace("%3A", ":");
                        let host_wide = match f.get_mut(EVERY) {
                            Some(Fault::HostWindow { secs, opened, answered }) => {
                                let opened = *opened.get_or_insert_with(std::time::Instant::now);
                                let left = std::time::Duration::from_secs(*secs).saturating_sub(opened.elapsed());
                                (!left.is_zero()).then(|| {
                                    answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                    format!(
                                        "HTTP/1.1 429 Too Many Requests\r\nretry-after: {}\r\nratelimit-remaining: 0\r\ncontent-length: 0\r\n\r\n",
                                        left.as_secs() + 1
                                    )
                                })
                            }
                            _ => None,
                        };
                        if host_wide.is_some() {
                            host_wide
                        } else {
                            match f.get_mut(&did) {
                                Some(Fault::RateLimited { times, .. }) if *times == 0 => None,
                                Some(Fault::RateLimited { times, retry_after_s }) => {
                                    *times -= 1;
                                    Some(format!(
                                        "HTTP/1.1 429 Too Many Requests\r\nretry-after: {retry_after_s}\r\nratelimit-remaining: 0\r\ncontent-length: 0\r\n\r\n"
                                    ))
                                }
                                Some(f @ (Fault::NotFound | Fault::Takendown)) => {
                                    let name =
                                        if matches!(f, Fault::NotFound) { "RepoNotFound" } else { "RepoTakendown" };
                                    let body = format!("{{\"error\":\"{name}\",\"message\":\"no\"}}");
                                    Some(format!(
                                        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                                        body.len()
                                    ))
                                }
                                Some(Fault::HostWindow { .. } | Fault::DiesHalfway { .. }) | None => None,
                            }
                        }
                    };
                    if let Some(answer) = fault {
                        if s.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    let Some(repo) = serve.get(&did.replace("%3A", ":")) else {
                        let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
                        continue;
                    };
                    if let Some(d) = slow.get(&did.replace("%3A", ":")) {
                        tokio::time::sleep(*d).await;
                    }
                    let body = car(repo);
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                    if dies_halfway(&faults, &did.replace("%3A", ":")) {
                        let _ = s.write_all(head.as_bytes()).await;
                        let _ = s.write_all(&body[..body.len() / 2]).await;
                        return;
                    }
                    if s.write_all(head.as_bytes()).await.is_err() || s.write_all(&body).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    base
}

/// True when `did`'s answer is to be cut short now ([`Fault::DiesHalfway`]; counts it).
fn dies_halfway<U: std::hash::BuildHasher>(faults: &std::sync::Mutex<HashMap<String, Fault, U>>, did: &str) -> bool {
    match faults.lock().expect("faults").get_mut(did) {
        Some(Fault::DiesHalfway { times }) if *times > 0 => {
            *times -= 1;
            true
        }
        _ => false,
    }
}

/// Repos per `listRepos` page, whatever the client asks for (a server may serve fewer):
/// small, so that a listing of the nine reference repos takes several pages.
pub const LIST_PAGE: usize = 3;

/// The answer to a listing request (`listRepos`, `listReposByCollection`), if `line` is one.
fn listing<S: std::hash::BuildHasher>(serve: &HashMap<String, String, S>, line: &str) -> Option<String> {
    if line.contains("/xrpc/com.atproto.sync.listReposByCollection") {
        let collection = line.split("collection=").nth(1).and_then(|c| c.split([' ', '&']).next()).unwrap_or("");
        return Some(list_page(serve, line, Some(&holding(collection))));
    }
    line.contains("/xrpc/com.atproto.sync.listRepos").then(|| list_page(serve, line, None))
}

/// A `com.atproto.sync.listRepos` page of the served repos in DID order: those after the
/// request's `cursor` (the last DID of the previous page), [`LIST_PAGE`] at most, each
/// `active` with its `rev` and `head`; the last page has no cursor.
fn list_page<S: std::hash::BuildHasher>(
    serve: &HashMap<String, String, S>,
    line: &str,
    holding: Option<&std::collections::BTreeSet<String>>,
) -> String {
    let after = line.split("cursor=").nth(1).and_then(|c| c.split([' ', '&']).next()).map(|c| c.replace("%3A", ":"));
    let mut dids: Vec<&String> = serve
        .keys()
        .filter(|d| after.as_ref().is_none_or(|a| *d > a) && holding.is_none_or(|h| h.contains(*d)))
        .collect();
    dids.sort();
    let page: Vec<&String> = dids.iter().take(LIST_PAGE).copied().collect();
    let heads = heads();
    let repos: Vec<serde_json::Value> = page
        .iter()
        .map(|d| {
            let mut r = serde_json::json!({ "did": d, "active": true });
            // A repo served as a reference repo lists that repo's rev and commit.
            if let Some((rev, head)) = serve.get(*d).and_then(|s| heads.get(s)) {
                r["rev"] = rev.as_str().into();
                r["head"] = head.as_str().into();
            }
            r
        })
        .collect();
    let mut v = serde_json::json!({ "repos": repos });
    if dids.len() > LIST_PAGE {
        v["cursor"] = serde_json::Value::String(page.last().map(|d| (*d).clone()).unwrap_or_default());
    }
    v.to_string()
}

/// Each reference repo's rev and commit CID (`repos.json`): what `listRepos` says of it.
fn heads() -> &'static HashMap<String, (String, String)> {
    static HEADS: std::sync::OnceLock<HashMap<String, (String, String)>> = std::sync::OnceLock::new();
    HEADS.get_or_init(|| {
        let text = std::fs::read_to_string(repos_dir().join("repos.json")).expect("repos.json");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        let field = |r: &serde_json::Value, k: &str| r[k].as_str().expect(k).to_owned();
        v.as_array().expect("array").iter().map(|r| (field(r, "did"), (field(r, "rev"), field(r, "commit")))).collect()
    })
}

/// The reference repos holding records of `collection` (`repos.json`'s `perCollection`):
/// what `listReposByCollection` answers.
///
/// # Panics
/// When the fixture is missing.
#[must_use]
pub fn holding(collection: &str) -> std::collections::BTreeSet<String> {
    per_collection().into_iter().filter(|(_, c)| c.contains_key(collection)).map(|(d, _)| d).collect()
}

/// Each reference repo's record count per collection (`repos.json`).
///
/// # Panics
/// When the fixture is missing.
#[must_use]
pub fn per_collection() -> std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>> {
    let text = std::fs::read_to_string(repos_dir().join("repos.json")).expect("repos.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v.as_array()
        .expect("array")
        .iter()
        .map(|r| {
            let per = r["perCollection"].as_object().expect("perCollection");
            let per = per.iter().map(|(c, n)| (c.clone(), n.as_u64().expect("count"))).collect();
            (r["did"].as_str().expect("did").to_owned(), per)
        })
        .collect()
}

/// Every reference repo, served as itself (what [`start`] takes for the reference PDS).
#[must_use]
pub fn every_repo() -> HashMap<String, String> {
    crate::fold::reference().into_keys().map(|d| (d.clone(), d)).collect()
}

/// The settings that point the binary at the PLC at `plc_url` (naming the test PDS), with
/// loopback addresses allowed and repo sync on: what a test of a repair adds to its env.
#[must_use]
pub fn repair_env(plc_url: &str) -> [(&'static str, String); 3] {
    [
        ("FIREKEEPER_PLC_URL", plc_url.to_owned()),
        ("FIREKEEPER_ALLOW_PRIVATE_ADDRESSES", "true".to_owned()),
        ("FIREKEEPER_RESYNC", "true".to_owned()),
    ]
}

/// The reference DID documents (DID → JSON), their PDS at `base`.
///
/// # Panics
/// When the fixture is missing.
#[must_use]
pub fn docs(base: &str) -> HashMap<String, String> {
    let text = std::fs::read_to_string(repos_dir().join("did-docs.json")).expect("did-docs.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v.as_object()
        .expect("object")
        .iter()
        .map(|(did, doc)| (did.clone(), doc.to_string().replace("http://localhost:2583", base)))
        .collect()
}

/// A stand-in relay for `getRepo`: answers every request with `302 Found` to the same
/// path and query at `pds`, as the Bluesky relay does; counts the requests it redirected.
///
/// # Panics
/// When it cannot listen.
pub async fn redirecting(pds: &str) -> (String, Arc<std::sync::atomic::AtomicU32>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let count = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (pds, seen) = (pds.to_owned(), count.clone());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (pds, seen) = (pds.clone(), seen.clone());
            tokio::spawn(async move {
                let mut pending = Vec::new();
                while let Some((line, _)) = crate::http::read_request_with_line(&mut s, &mut pending).await {
                    let target = line.split_whitespace().nth(1).unwrap_or("/");
                    seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let answer = format!("HTTP/1.1 302 Found\r\nlocation: {pds}{target}\r\ncontent-length: 0\r\n\r\n");
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (base, count)
}

/// A PDS answering `getRepo?did=D` with the file `files[D]`, streamed from disk (a repo
/// larger than a test should hold), and 404 for any other DID; returns its base URL.
///
/// # Panics
/// When it cannot listen.
pub async fn start_files<S>(files: HashMap<String, std::path::PathBuf, S>) -> String
where
    S: std::hash::BuildHasher + Send + Sync + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let files = Arc::new(files);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.set_nodelay(true);
            let files = files.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt as _;
                let mut pending = Vec::new();
                while let Some((line, _)) = crate::http::read_request_with_line(&mut s, &mut pending).await {
                    let did = line.split("did=").nth(1).and_then(|d| d.split([' ', '&']).next()).unwrap_or("");
                    let Some(path) = files.get(&did.replace("%3A", ":")) else {
                        let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
                        continue;
                    };
                    let Ok(mut f) = tokio::fs::File::open(path).await else { return };
                    let len = f.metadata().await.map_or(0, |m| m.len());
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/vnd.ipld.car\r\ncontent-length: {len}\r\n\r\n"
                    );
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    let mut buf = vec![0u8; 256 << 10];
                    loop {
                        match f.read(&mut buf).await {
                            Ok(0) => break,
                            Ok(n) if s.write_all(&buf[..n]).await.is_ok() => {}
                            _ => return,
                        }
                    }
                }
            });
        }
    });
    base
}
