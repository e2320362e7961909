//! One repo from its DID to a verified snapshot, against a local PLC directory serving
//! the reference DID documents (their PDS pointed at a local host serving the reference
//! CARs): the reference record counts; a rotated key seen once more after a refresh; a
//! PDS answering another repo's CAR; a document naming no PDS.

use std::collections::HashMap;

use atproto_identity::resolver::{Resolver, ResolverConfig};
use repo_sync::check::{CheckError, check_repo};
use repo_sync::fetch::Limits;

const SMALL: &str = "did:plc:zs4kp6ujxn2l7wrtp3nxeiob";
const LARGE: &str = "did:plc:d255tkvufzfkpckokc332in6";
/// 2026-12-06 at noon, the day the fixtures were recorded.
const NOW: i64 = 20_793 * 86_400_000_000 + 43_200_000_000;

fn repos() -> std::path::PathBuf {
    testkit::pds::repos_dir()
}

async fn pds(serve: HashMap<String, String>) -> String {
    testkit::pds::start(serve).await
}

fn docs(base: &str) -> HashMap<String, String> {
    testkit::pds::docs(base)
}

fn resolver(plc: &testkit::plc::Plc) -> Resolver {
    Resolver::new(ResolverConfig {
        plc_url: plc.url(),
        min_refresh: std::time::Duration::ZERO,
        ..ResolverConfig::default()
    })
    .expect("resolver")
}

fn client() -> guarded_http::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let guard = guarded_http::Guard { allow_private: true, max_redirects: 3 };
    guarded_http::Client::new(guard, reqwest::Client::builder()).expect("client")
}

fn limits() -> Limits {
    Limits { spill_dir: testkit::tmpdir("check-spill"), memory_bytes: 1 << 20, ..Limits::default() }
}

#[tokio::test]
async fn every_reference_repo_is_resolved_fetched_and_verified() {
    let all: Vec<String> = docs("x").into_keys().collect();
    let base = pds(all.iter().map(|d| (d.clone(), d.clone())).collect()).await;
    let plc = testkit::plc::Plc::start(docs(&base)).await;
    let r = resolver(&plc);
    let repos: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repos().join("repos.json")).expect("repos")).expect("json");
    for want in repos.as_array().expect("array") {
        let did = want["did"].as_str().expect("did");
        let got = check_repo(&r, &client(), did, &limits(), NOW).await.unwrap_or_else(|e| panic!("{did}: {e}"));
        assert_eq!(got.pds, base);
        assert_eq!(got.rev, want["rev"].as_str().expect("rev"), "{did}");
        assert_eq!(got.commit, want["commit"].as_str().expect("commit"), "{did}");
        assert_eq!(got.records(), want["records"].as_u64().expect("records"), "{did}");
        for (collection, n) in want["perCollection"].as_object().expect("per collection") {
            assert_eq!(got.collections.get(collection).copied(), n.as_u64(), "{did} {collection}");
        }
    }
}

/// The directory first serves the large repo's key under the small repo's DID (a stale
/// cache after a rotation, as seen from here): the signature fails, the DID is resolved
/// again, and the repo verifies with the key the directory now serves.
#[tokio::test]
async fn a_signature_failing_on_a_stale_key_is_checked_again_after_a_refresh() {
    let base = pds(HashMap::from([(SMALL.to_owned(), SMALL.to_owned())])).await;
    let real = docs(&base);
    let mut stale = real.clone();
    let other_key = |doc: &str| {
        let v: serde_json::Value = serde_json::from_str(doc).expect("doc");
        v["verificationMethod"][0]["publicKeyMultibase"].as_str().expect("key").to_owned()
    };
    let (small_key, large_key) = (other_key(&real[SMALL]), other_key(&real[LARGE]));
    stale.insert(SMALL.to_owned(), real[SMALL].replace(&small_key, &large_key));
    let plc = testkit::plc::Plc::start(stale).await;
    let r = resolver(&plc);
    r.resolve(SMALL).await.expect("the stale document is cached");
    plc.set_doc(SMALL, real[SMALL].clone());
    let got = check_repo(&r, &client(), SMALL, &limits(), NOW).await.expect("verified after the refresh");
    assert_eq!(got.records(), 34);
}

#[tokio::test]
async fn a_pds_serving_another_repo_or_a_document_without_a_pds_is_refused() {
    let base = pds(HashMap::from([(SMALL.to_owned(), LARGE.to_owned())])).await;
    let mut d = docs(&base);
    let plc = testkit::plc::Plc::start(d.clone()).await;
    let r = resolver(&plc);
    assert!(matches!(check_repo(&r, &client(), SMALL, &limits(), NOW).await, Err(CheckError::Verify(_))));
    let v: serde_json::Value = serde_json::from_str(&d[SMALL]).expect("doc");
    let mut v = v.as_object().expect("object").clone();
    v.remove("service");
    d.insert(SMALL.to_owned(), serde_json::Value::Object(v).to_string());
    let plc = testkit::plc::Plc::start(d).await;
    let r = resolver(&plc);
    assert!(matches!(check_repo(&r, &client(), SMALL, &limits(), NOW).await, Err(CheckError::NoPds)));
}
