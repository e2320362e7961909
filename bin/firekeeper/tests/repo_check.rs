//! `firekeeper repos check <did>` through the binary: a repo fetched from its PDS (a
//! local one serving the reference CARs, found through a local PLC directory) and
//! verified whole; a PDS serving another repo's CAR, or on loopback without
//! `FIREKEEPER_ALLOW_PRIVATE_ADDRESSES`, makes it exit 1 naming why.

use std::collections::HashMap;

const SMALL: &str = "did:plc:zs4kp6ujxn2l7wrtp3nxeiob";
const LARGE: &str = "did:plc:d255tkvufzfkpckokc332in6";

async fn check(serve: HashMap<String, String>, did: &'static str, allow_private: bool) -> std::process::Output {
    let base = testkit::pds::start(serve).await;
    let plc = testkit::plc::Plc::start(testkit::pds::docs(&base)).await;
    let dir = testkit::tmpdir("repo-check");
    let env: HashMap<String, String> = [
        ("FIREKEEPER_RELAY", "ws://127.0.0.1:9/".to_owned()),
        ("FIREKEEPER_PLC_URL", plc.url()),
        ("FIREKEEPER_ALLOW_PRIVATE_ADDRESSES", allow_private.to_string()),
        ("FIREKEEPER_DATA_DIR", dir.to_string_lossy().into_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    tokio::task::spawn_blocking(move || testkit::proc::run_once(&env, &["repos", "check", did])).await.expect("run")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repo_is_fetched_from_its_pds_and_verified_whole() {
    let out = check(HashMap::from([(SMALL.to_owned(), SMALL.to_owned())]), SMALL, true).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with(&format!("{SMALL} verified: rev 3n3ykmb4q7a2h, commit bafyreielezqev4ai3rwtnkzh4zsmsh55o6jbdsef2x367a76b5yqqos7ay, 34 records")), "{stdout}");
    assert!(stdout.contains("  app.bsky.feed.post 17\n"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pds_serving_another_repo_fails_the_check_and_says_why() {
    let out = check(HashMap::from([(SMALL.to_owned(), LARGE.to_owned())]), SMALL, true).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not a verified repo") && stderr.contains("verifying the repo"), "{stderr}");
}

/// The PDS address comes from a DID document: loopback is refused unless allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pds_on_loopback_is_refused_unless_private_addresses_are_allowed() {
    let out = check(HashMap::from([(SMALL.to_owned(), SMALL.to_owned())]), SMALL, false).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not a public address"), "{stderr}");
}
