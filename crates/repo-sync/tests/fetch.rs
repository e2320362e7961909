//! `getRepo` against hosts that behave and hosts that do not: a local HTTP server serving
//! the reference PDS's CARs, and the same server slow, huge, rate-limiting, 404,
//! answering a repo's status, dying half-way, redirecting; and a loopback address refused
//! when private addresses are not allowed.

use std::sync::Arc;
use std::time::Duration;

use repo_sync::fetch::{Body, FetchError, Gone, Limits, fetch, get_repo_url};
use tokio::io::AsyncWriteExt;

const SMALL: &str = "did:plc:zs4kp6ujxn2l7wrtp3nxeiob";

fn car(did: &str) -> Vec<u8> {
    testkit::pds::car(did)
}

/// What the test host answers.
#[derive(Clone)]
enum Answer {
    /// 200 with this body.
    Car(Vec<u8>),
    /// A status, extra header lines, a body.
    Status(u16, &'static str, &'static str),
    /// 200, `Content-Length` announced, then `chunk` bytes every `every` (`total` in all).
    Drip { total: usize, chunk: usize, every: Duration },
    /// 200 announcing `len` bytes, sending half of them, then closing.
    Truncated(Vec<u8>),
    /// A redirect to this path.
    Redirect(&'static str),
    /// 200 with no length announced: this many bytes, then the connection closes.
    Unannounced(usize),
}

/// A host on a loopback port answering every request by `answer(path)`.
async fn host(answer: impl Fn(&str) -> Answer + Send + Sync + 'static) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut pending = Vec::new();
                while let Some((line, _)) = testkit::http::read_request_with_line(&mut s, &mut pending).await {
                    let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
                    if !respond(&mut s, answer(&path)).await {
                        return;
                    }
                }
            });
        }
    });
    base
}

/// Writes one answer; false when the connection must close.
async fn respond(s: &mut tokio::net::TcpStream, a: Answer) -> bool {
    match a {
        Answer::Car(body) => {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/vnd.ipld.car\r\ncontent-length: {}\r\nratelimit-remaining: 41\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).await.is_ok() && s.write_all(&body).await.is_ok()
        }
        Answer::Status(code, headers, body) => {
            let head = format!("HTTP/1.1 {code} X\r\ncontent-length: {}\r\n{headers}\r\n", body.len());
            s.write_all(head.as_bytes()).await.is_ok() && s.write_all(body.as_bytes()).await.is_ok()
        }
        Answer::Drip { total, chunk, every } => {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {total}\r\n\r\n");
            if s.write_all(head.as_bytes()).await.is_err() {
                return false;
            }
            let mut sent = 0;
            while sent < total {
                tokio::time::sleep(every).await;
                let n = chunk.min(total - sent);
                if s.write_all(&vec![0u8; n]).await.is_err() {
                    return false;
                }
                sent += n;
            }
            true
        }
        Answer::Truncated(body) => {
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
            let _ = s.write_all(head.as_bytes()).await;
            let _ = s.write_all(&body[..body.len() / 2]).await;
            false
        }
        Answer::Unannounced(total) => {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n").await;
            let _ = s.write_all(&vec![0u8; total]).await;
            false
        }
        Answer::Redirect(to) => {
            let head = format!("HTTP/1.1 302 Found\r\nlocation: {to}\r\ncontent-length: 0\r\n\r\n");
            s.write_all(head.as_bytes()).await.is_ok()
        }
    }
}

fn client(allow_private: bool) -> guarded_http::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let guard = guarded_http::Guard { allow_private, max_redirects: 3 };
    guarded_http::Client::new(guard, reqwest::Client::builder()).expect("client")
}

fn limits(dir: &str) -> Limits {
    Limits { spill_dir: testkit::tmpdir(dir), ..Limits::default() }
}

async fn get(base: &str, l: &Limits) -> Result<repo_sync::fetch::Fetched, FetchError> {
    fetch(&client(true), &get_repo_url(base, SMALL).expect("url"), l).await
}

#[tokio::test]
async fn a_repo_is_fetched_whole_with_the_hosts_rate_limit() {
    let want = car(SMALL);
    let w = want.clone();
    let base = host(move |path| {
        assert!(path.starts_with("/xrpc/com.atproto.sync.getRepo?did=did%3Aplc%3A"), "{path}");
        Answer::Car(w.clone())
    })
    .await;
    let got = get(&base, &limits("fetch-ok")).await.expect("fetched");
    assert!(matches!(got.body, Body::Memory(_)));
    assert_eq!(got.body.bytes().expect("bytes").as_ref(), want.as_slice());
    assert_eq!(got.rate.remaining, Some(41));
}

/// Past the memory bound the body goes to a file (removed with the body), byte for byte.
#[tokio::test]
async fn a_body_past_the_memory_bound_is_spilled_to_disk_and_removed_after() {
    let want = car("did:plc:d255tkvufzfkpckokc332in6"); // 5 MB, 20,000 records
    let w = want.clone();
    let base = host(move |_| Answer::Car(w.clone())).await;
    let l = Limits { memory_bytes: 64 << 10, ..limits("fetch-spill") };
    let got = get(&base, &l).await.expect("fetched");
    let Body::File { path, len } = &got.body else { panic!("kept in memory") };
    let path = path.clone();
    assert_eq!(*len, want.len() as u64);
    assert!(path.starts_with(&l.spill_dir));
    assert_eq!(got.body.bytes().expect("bytes").as_ref(), want.as_slice());
    drop(got);
    assert!(!path.exists(), "the spill file is removed with the body");
}

#[tokio::test]
async fn a_repos_status_and_a_404_say_it_is_gone() {
    for (answer, want) in [
        (Answer::Status(404, "", ""), Gone::NotFound),
        (
            Answer::Status(400, "content-type: application/json\r\n", r#"{"error":"RepoNotFound","message":"x"}"#),
            Gone::NotFound,
        ),
        (Answer::Status(400, "", r#"{"error":"RepoTakendown","message":"Repo has been takendown"}"#), Gone::Takendown),
        (Answer::Status(400, "", r#"{"error":"RepoSuspended"}"#), Gone::Suspended),
        (Answer::Status(400, "", r#"{"error":"RepoDeactivated"}"#), Gone::Deactivated),
    ] {
        let base = host(move |_| answer.clone()).await;
        match get(&base, &limits("fetch-gone")).await {
            Err(FetchError::Gone(g)) => assert_eq!(g, want),
            other => panic!("{want:?}: {other:?}"),
        }
    }
    let base = host(|_| Answer::Status(400, "", r#"{"error":"InvalidRequest"}"#)).await;
    assert!(
        matches!(get(&base, &limits("fetch-gone")).await, Err(FetchError::Failed(_))),
        "a 400 that names no status"
    );
}

#[tokio::test]
async fn a_rate_limited_host_says_how_long_to_wait() {
    let base = host(|_| Answer::Status(429, "retry-after: 7\r\nratelimit-remaining: 0\r\n", "")).await;
    match get(&base, &limits("fetch-429")).await {
        Err(FetchError::RateLimited(r)) => {
            assert_eq!(r.wait, Some(Duration::from_secs(7)));
            assert_eq!(r.remaining, Some(0));
        }
        other => panic!("{other:?}"),
    }
    let base = host(|_| Answer::Status(429, "ratelimit-reset: 12\r\n", "")).await;
    match get(&base, &limits("fetch-429")).await {
        Err(FetchError::RateLimited(r)) => assert_eq!(r.wait, Some(Duration::from_secs(12))),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_repo_larger_than_the_cap_is_refused_announced_or_not() {
    let big = car(SMALL);
    let b = big.clone();
    let base = host(move |_| Answer::Car(b.clone())).await;
    let l = Limits { max_bytes: 4096, ..limits("fetch-big") };
    assert!(matches!(get(&base, &l).await, Err(FetchError::TooLarge { limit: 4096 })), "announced");
    // Not announced (read until the host closes): only the count tells.
    let base = host(|_| Answer::Unannounced(20_000)).await;
    let l = Limits { max_bytes: 5000, ..limits("fetch-big") };
    assert!(matches!(get(&base, &l).await, Err(FetchError::TooLarge { .. })), "as the bytes come");
}

#[tokio::test]
async fn a_transfer_below_the_speed_floor_is_cut() {
    let base = host(|_| Answer::Drip { total: 10_000, chunk: 10, every: Duration::from_millis(100) }).await;
    let l = Limits { slow_window: Duration::from_millis(500), slow_bytes: 1000, ..limits("fetch-slow") };
    assert!(matches!(get(&base, &l).await, Err(FetchError::TooSlow { .. })));
    // A host that stops sending after the headers: cut at the window's end, not the attempt's.
    let base = host(|_| Answer::Drip { total: 1000, chunk: 1000, every: Duration::from_secs(3) }).await;
    assert!(matches!(get(&base, &l).await, Err(FetchError::TooSlow { .. })), "cut before the host sends again");
    // Fast enough: every window gets its bytes.
    let base = host(|_| Answer::Drip { total: 10_000, chunk: 1000, every: Duration::from_millis(50) }).await;
    let got = get(&base, &l).await.expect("fast enough");
    assert_eq!(got.body.len(), 10_000);
}

#[tokio::test]
async fn an_attempt_is_bounded_in_time() {
    let base = host(|_| Answer::Drip { total: 10_000, chunk: 1000, every: Duration::from_millis(200) }).await;
    let l = Limits { attempt: Duration::from_millis(500), ..limits("fetch-time") };
    assert!(matches!(get(&base, &l).await, Err(FetchError::Timeout(_))));
}

#[tokio::test]
async fn a_host_that_dies_half_way_is_a_failure_not_a_short_repo() {
    let body = car(SMALL);
    let base = host(move |_| Answer::Truncated(body.clone())).await;
    assert!(matches!(get(&base, &limits("fetch-cut")).await, Err(FetchError::Failed(_))));
}

#[tokio::test]
async fn redirects_are_followed_a_few_times() {
    let want = car(SMALL);
    let w = want.clone();
    let base = host(move |path| {
        if path.starts_with("/xrpc/") {
            Answer::Redirect("/hop1")
        } else if path == "/hop1" {
            Answer::Redirect("/pds/repo.car")
        } else {
            Answer::Car(w.clone())
        }
    })
    .await;
    let got = get(&base, &limits("fetch-redirect")).await.expect("followed");
    assert_eq!(got.body.bytes().expect("bytes").as_ref(), want.as_slice());
    let base = host(|path| Answer::Redirect(if path == "/a" { "/b" } else { "/a" })).await;
    assert!(matches!(get(&base, &limits("fetch-redirect")).await, Err(FetchError::Failed(_) | FetchError::Refused(_))));
}

#[tokio::test]
async fn a_loopback_host_is_refused_unless_private_addresses_are_allowed() {
    let base = host(|_| Answer::Car(car(SMALL))).await;
    let url = get_repo_url(&base, SMALL).expect("url");
    assert!(matches!(fetch(&client(false), &url, &limits("fetch-private")).await, Err(FetchError::Refused(_))));
}

/// What was fetched verifies as the repo (the fetch hands over bytes, the verifier judges).
#[tokio::test]
async fn a_fetched_repo_verifies() {
    let want = car(SMALL);
    let base = host(move |_| Answer::Car(want.clone())).await;
    let got = get(&base, &limits("fetch-verify")).await.expect("fetched");
    let digest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(testkit::fixture("repos").join("records.digest.json")).expect("digest"),
    )
    .expect("json");
    let key = atproto_crypto::PublicKey::from_did_key(digest[SMALL]["signingKey"].as_str().expect("key")).expect("key");
    let now = 20_793 * 86_400_000_000 + 43_200_000_000;
    let bytes = got.body.bytes().expect("bytes");
    let snap = atproto_repo::repo::verify_repo_bytes(&bytes, SMALL, &key, now).expect("verifies");
    assert_eq!(snap.records.len(), 34);
}

/// A `listRepos` page as a relay answers it: two active repos (one with its rev), one
/// inactive, one name that is not a DID.
const PAGE: &str = r#"{"cursor":"c2","repos":[{"did":"did:plc:a","head":"bafyh","rev":"3abc","active":true},{"did":"did:plc:b","active":false,"status":"takendown"},{"did":"nope"},{"did":"did:plc:c"}]}"#;

/// A listing page: revs read, inactive repos and names that are not DIDs skipped, an empty
/// page is the end whatever its cursor says. A host answering 500, a body that is not
/// JSON, JSON without `repos`, or a page past 16 MiB is an error that says so (the backfill
/// asks again later), never a page taken for the end of the listing.
#[tokio::test]
async fn a_listing_page_is_read_or_refused_by_name() {
    use repo_sync::list::{Listed, list_repos};
    let base = host(|path| match path.split("cursor=").nth(1).unwrap_or("") {
        "garbage" => Answer::Status(200, "", "<html>busy</html>"),
        "norepos" => Answer::Status(200, "", r#"{"cursor":"x"}"#),
        "fail" => Answer::Status(500, "", "oops"),
        "empty" => Answer::Status(200, "", r#"{"repos":[],"cursor":"more"}"#),
        "huge" => Answer::Unannounced(17 << 20),
        _ => Answer::Status(200, "", PAGE),
    })
    .await;
    let c = client(true);
    let page = list_repos(&c, &base, None).await.expect("a page");
    let listed = |did: &str, rev: Option<&str>| Listed { did: did.into(), rev: rev.map(str::to_owned) };
    assert_eq!(page.active, vec![listed("did:plc:a", Some("3abc")), listed("did:plc:c", None)]);
    assert_eq!((page.inactive, page.cursor.as_deref(), page.empty), (2, Some("c2"), false));
    let empty = list_repos(&c, &base, Some("empty")).await.expect("an empty page");
    assert!(empty.empty && empty.active.is_empty(), "{empty:?}");
    for (cursor, says) in
        [("fail", "HTTP 500"), ("garbage", "not a listing page"), ("norepos", "no repos"), ("huge", "")]
    {
        match list_repos(&c, &base, Some(cursor)).await {
            Err(e) => assert!(e.to_string().contains(says), "{cursor}: {e}"),
            Ok(p) => panic!("{cursor}: taken for a page: {p:?}"),
        }
    }
}
