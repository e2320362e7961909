//! DID resolution against a PLC directory and `did:web` hosts on loopback (testkit's):
//! the capture's real documents, one request for a burst, a directory that is down, slow,
//! failing or answering garbage (errors that say "try later", never a guess), definite
//! answers remembered, key rotation through `refresh` and `#identity`, each host on its
//! own (a failing or slow `did:web` host costs the directory nothing), capped background
//! requests, and addresses from the network kept off loopback unless allowed.

use std::collections::HashMap;
use std::time::Duration;

use atproto_crypto::PublicKey;
use atproto_identity::resolver::{ResolveError, Resolver, ResolverConfig};
use testkit::plc::{Mode, Plc};

fn resolver(plc: &Plc, ttl: Duration) -> Resolver {
    Resolver::new(ResolverConfig {
        plc_url: plc.url(),
        ttl,
        request_timeout: Duration::from_millis(500),
        ..ResolverConfig::default()
    })
    .expect("resolver")
}

fn keys() -> HashMap<String, String> {
    serde_json::from_str(&std::fs::read_to_string(testkit::fixture("signed/signed-b.signing-keys.json")).expect("keys"))
        .expect("JSON")
}

#[tokio::test]
async fn the_captures_dids_resolve_to_their_keys_and_a_burst_makes_one_request() {
    let plc = Plc::signed_fixture().await;
    let r = resolver(&plc, Duration::from_hours(1));
    for (did, key) in keys() {
        let id = r.resolve(&did).await.expect("resolves");
        assert_eq!(id.signing_key, PublicKey::from_did_key(&key).expect("key"), "{did}");
    }
    assert_eq!(plc.requests(), 10);
    // A new DID's burst: 200 look-ups at once, one request.
    let did = "did:plc:burstburstburstburstburs";
    plc.set_doc(did, testkit::tamper::did_doc(did, &testkit::tamper::test_key(1)));
    let before = plc.requests();
    let lookups: Vec<_> = (0..200)
        .map(|_| {
            let r = r.clone();
            tokio::spawn(async move { r.resolve(did).await })
        })
        .collect();
    for l in lookups {
        l.await.expect("task").expect("resolves");
    }
    assert_eq!(plc.requests() - before, 1, "single flight");
    // Cached: no request at all.
    r.resolve(did).await.expect("cached");
    assert_eq!(plc.requests() - before, 1);
}

#[tokio::test]
async fn a_failing_directory_gives_errors_to_retry_and_never_a_key() {
    let plc = Plc::signed_fixture().await;
    let r = resolver(&plc, Duration::from_hours(1));
    let dids: Vec<String> = keys().into_keys().collect();
    for (i, mode) in
        [Mode::Down, Mode::Error, Mode::Garbage, Mode::Slow(Duration::from_secs(2))].into_iter().enumerate()
    {
        plc.set_mode(mode);
        let err = r.resolve(&dids[i]).await.expect_err("no key from a failing directory");
        assert!(matches!(err, ResolveError::Unavailable(_)) && err.is_transient(), "{mode:?}: {err:?}");
        // Right after a failure the directory is left alone: no request is made.
        let before = plc.requests();
        assert!(r.resolve(&dids[i]).await.is_err());
        assert_eq!(plc.requests(), before, "{mode:?}: backing off");
        tokio::time::sleep(Duration::from_millis(150 << i)).await;
    }
    plc.set_mode(Mode::Up);
    testkit::eventually("the directory is asked again and answers", Duration::from_secs(30), async || {
        r.resolve(&dids[0]).await.is_ok()
    })
    .await;
    let unknown = r.resolve("did:plc:unknownunknownunknownunk").await.expect_err("unknown");
    assert_eq!(unknown, ResolveError::NotFound(404));
    assert!(!unknown.is_transient(), "a DID the directory does not know is a definite answer");
    let before = plc.requests();
    assert_eq!(r.resolve("did:plc:unknownunknownunknownunk").await, Err(ResolveError::NotFound(404)));
    assert_eq!(plc.requests(), before, "and remembered: not asked again within the negative ttl");
    assert!(matches!(r.resolve("did:key:zQ3sh").await, Err(ResolveError::Method(_))));
}

#[tokio::test]
async fn rotation_stale_entries_and_invalidation() {
    let plc = Plc::start(HashMap::new()).await;
    let did = "did:plc:rotaterotaterotaterotate";
    let (old, new) = (testkit::tamper::test_key(1), testkit::tamper::test_key(2));
    let pk = |k: &k256::ecdsa::SigningKey| {
        PublicKey::from_sec1(atproto_crypto::Curve::K256, k.verifying_key().to_encoded_point(true).as_bytes())
            .expect("pk")
    };
    plc.set_doc(did, testkit::tamper::did_doc(did, &old));
    let r = resolver(&plc, Duration::from_hours(1));
    assert_eq!(r.resolve(did).await.expect("old").signing_key, pk(&old));
    plc.set_doc(did, testkit::tamper::did_doc(did, &new));
    assert_eq!(r.resolve(did).await.expect("cached").signing_key, pk(&old), "the cache serves the old key");
    assert_eq!(r.refresh(did).await.expect("refreshed").signing_key, pk(&new), "refresh asks again");
    assert_eq!(r.resolve(did).await.expect("cached").signing_key, pk(&new));
    // Bad signatures right after a refresh do not ask again.
    let before = plc.requests();
    for _ in 0..5 {
        r.refresh(did).await.expect("from the cache");
    }
    assert_eq!(plc.requests(), before, "one refresh per DID within min_refresh");
    plc.set_doc(did, testkit::tamper::did_doc(did, &old));
    r.invalidate(did);
    assert_eq!(r.resolve(did).await.expect("again").signing_key, pk(&old), "invalidated");

    // A zero TTL: the stale entry is served at once and refreshed behind it.
    let r = resolver(&plc, Duration::ZERO);
    r.resolve(did).await.expect("first");
    plc.set_doc(did, testkit::tamper::did_doc(did, &new));
    plc.set_mode(Mode::Slow(Duration::from_secs(5)));
    let t = std::time::Instant::now();
    assert_eq!(r.resolve(did).await.expect("stale").signing_key, pk(&old));
    assert!(t.elapsed() < Duration::from_secs(2), "stale-while-revalidate does not wait");
    plc.set_mode(Mode::Up);
    testkit::eventually("the background refresh lands", Duration::from_secs(30), async || {
        r.resolve(did).await.is_ok_and(|id| id.signing_key == pk(&new))
    })
    .await;
}

/// A `did:web` host on loopback: a testkit directory serving `/.well-known/did.json`.
async fn web_host(key: u8) -> (Plc, String) {
    let host = Plc::start(HashMap::new()).await;
    let did = format!("did:web:{}", host.url().trim_start_matches("http://").replace(':', "%3A"));
    host.set_doc(".well-known/did.json", testkit::tamper::did_doc(&did, &testkit::tamper::test_key(key)));
    (host, did)
}

fn open_resolver(plc: &Plc, f: impl FnOnce(&mut ResolverConfig)) -> Resolver {
    let mut cfg = ResolverConfig {
        plc_url: plc.url(),
        request_timeout: Duration::from_secs(15),
        allow_private: true,
        web_http: true,
        ..ResolverConfig::default()
    };
    f(&mut cfg);
    Resolver::new(cfg).expect("resolver")
}

/// A `did:web` host answering 500 backs off that host only: an uncached `did:plc` still
/// reaches the directory (the review: 0 requests, "backing off after a failure").
#[tokio::test]
async fn a_failing_did_web_host_does_not_back_off_the_directory() {
    let plc = Plc::signed_fixture().await;
    let (host, web) = web_host(3).await;
    let r = open_resolver(&plc, |_| {});
    host.set_mode(Mode::Error);
    let err = r.resolve(&web).await.expect_err("500");
    assert!(err.is_transient(), "{err:?}");
    let asked = host.requests();
    assert!(r.resolve(&web).await.is_err());
    assert_eq!(host.requests(), asked, "the failing host is left alone for its backoff");
    let did = keys().into_keys().next().expect("a did");
    r.resolve(&did).await.expect("the directory is asked and answers");
    assert_eq!(plc.requests(), 1);
}

/// Slow `did:web` hosts hold their own slots: 16 look-ups of `did:web` hosts that answer
/// after 10 s leave the directory's permits free (the review: a `did:plc` waited 2.8 s
/// behind 3 s hosts, which had taken every permit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_did_web_hosts_do_not_take_the_directorys_permits() {
    let plc = Plc::signed_fixture().await;
    let mut hosts = Vec::new();
    for _ in 0..16 {
        let (host, did) = web_host(3).await;
        host.set_mode(Mode::Slow(Duration::from_secs(10)));
        hosts.push((host, did));
    }
    let r = open_resolver(&plc, |c| c.concurrency = 16);
    let slow: Vec<_> = hosts
        .iter()
        .map(|(_, did)| {
            let (r, did) = (r.clone(), did.clone());
            tokio::spawn(async move { r.resolve(&did).await })
        })
        .collect();
    testkit::eventually("every slow host is asked", Duration::from_secs(30), async || {
        hosts.iter().all(|(h, _)| h.requests() >= 1)
    })
    .await;
    let did = keys().into_keys().next().expect("a did");
    r.resolve(&did).await.expect("the directory answers while the slow hosts hold their own slots");
    assert!(slow.iter().all(|t| !t.is_finished()), "the did:plc did not wait for the slow hosts");
    for t in slow {
        t.abort();
    }
}

/// A `did:web` host that answers 404, or serves a document that does not parse, is a
/// definite answer: remembered for the negative ttl, not asked again per look-up; an
/// `#identity` for the DID forgets it.
#[tokio::test]
async fn definite_answers_of_a_did_web_host_are_remembered_until_an_identity() {
    let plc = Plc::start(HashMap::new()).await;
    let (host, web) = web_host(3).await;
    let r = open_resolver(&plc, |_| {});
    let doc = host.doc(".well-known/did.json").expect("doc");
    for (served, want) in [(None, "not known"), (Some("<html>hello".to_owned()), "not a JSON object")] {
        match &served {
            None => host.set_mode(Mode::Up),
            Some(body) => host.set_doc(".well-known/did.json", body.clone()),
        }
        if served.is_none() {
            host.set_doc(".well-known/did.json", String::new());
            host.remove_doc(".well-known/did.json");
        }
        r.changed(&web);
        let err = r.resolve(&web).await.expect_err("definite");
        assert!(!err.is_transient() && err.to_string().contains(want), "{err}");
        let asked = host.requests();
        for _ in 0..5 {
            assert_eq!(r.resolve(&web).await.expect_err("remembered"), err);
        }
        assert_eq!(host.requests(), asked, "not asked again");
    }
    host.set_doc(".well-known/did.json", doc);
    r.changed(&web);
    r.resolve(&web).await.expect("asked again after #identity, and resolves");
}

/// A key rotation right after a refresh: the `#identity` lifts the refresh limit and
/// starts a request; a signature failure joins it instead of answering from the cache
/// (the review: 45 of 45 commits with the new key marked invalid). Twice within 10 s.
#[tokio::test]
async fn a_rotation_after_a_refresh_is_seen_by_the_next_refresh() {
    let plc = Plc::start(HashMap::new()).await;
    let did = "did:plc:rotaterotaterotaterotate";
    plc.set_doc(did, testkit::tamper::did_doc(did, &testkit::tamper::test_key(1)));
    let r = open_resolver(&plc, |c| c.min_refresh = Duration::from_secs(10));
    r.resolve(did).await.expect("first");
    // A bad signature: refreshed (the limit now holds for 10 s).
    r.refresh(did).await.expect("refreshed");
    for n in [2u8, 3] {
        plc.set_doc(did, testkit::tamper::did_doc(did, &testkit::tamper::test_key(n)));
        plc.set_mode(Mode::Slow(Duration::from_millis(300)));
        r.changed(did);
        let id = r.refresh(did).await.expect("joins the #identity's request");
        let want = testkit::tamper::did_doc(did, &testkit::tamper::test_key(n));
        let want = atproto_identity::parse_document(did, want.as_bytes()).expect("doc").signing_key;
        assert_eq!(id.signing_key, want, "rotation {n}: the new key");
        plc.set_mode(Mode::Up);
    }
}

/// Background requests (stale entries, `#identity`) are capped: 20 stale DIDs on a slow
/// directory make at most the cap's requests at once.
#[tokio::test]
async fn background_requests_are_capped() {
    let plc = Plc::start(HashMap::new()).await;
    let dids: Vec<String> = (0..20).map(|i| format!("did:plc:stale{i:020}")).collect();
    for d in &dids {
        plc.set_doc(d, testkit::tamper::did_doc(d, &testkit::tamper::test_key(1)));
    }
    let r = open_resolver(&plc, |c| {
        c.ttl = Duration::ZERO;
        c.background = 2;
    });
    for d in &dids {
        r.resolve(d).await.expect("first");
    }
    plc.set_mode(Mode::Slow(Duration::from_secs(5)));
    let before = plc.requests();
    for d in &dids {
        r.resolve(d).await.expect("stale, served at once");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(plc.requests() - before <= 2, "{} background requests", plc.requests() - before);
}

/// Addresses taken from the network stay off loopback unless allowed, and a document is
/// read only up to its bound.
#[tokio::test]
async fn did_web_hosts_on_loopback_are_refused_unless_allowed_and_documents_are_bounded() {
    let plc = Plc::start(HashMap::new()).await;
    let (host, web) = web_host(3).await;
    let strict = open_resolver(&plc, |c| c.allow_private = false);
    let err = strict.resolve(&web).await.expect_err("loopback refused");
    assert!(matches!(err, ResolveError::Refused(_)) && err.to_string().contains("not a public address"), "{err}");
    assert_eq!(host.requests(), 0, "nothing was sent");
    let named = "did:web:localhost%3A9";
    let err = strict.resolve(named).await.expect_err("a name for loopback refused");
    assert!(err.to_string().contains("not a public address"), "{err}");
    let small = open_resolver(&plc, |c| c.max_document = 100);
    let err = small.resolve(&web).await.expect_err("too large");
    assert!(err.to_string().contains("larger than 100 bytes"), "{err}");
    open_resolver(&plc, |_| {}).resolve(&web).await.expect("allowed");
}
