//! DID resolution against a PLC directory on loopback (testkit's): the capture's real
//! documents, one request for a burst, a directory that is down, slow, failing or
//! answering garbage (errors that say "try later", never a guess), key rotation through
//! `refresh`, and `#identity` invalidation.

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
    assert!(unknown.is_transient(), "a DID the directory does not know yet is retried");
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
