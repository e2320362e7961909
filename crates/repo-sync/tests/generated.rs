//! A repo built here (`testkit::repo`: 10,000 records under one signed commit, larger
//! than any part) fetched as a resync fetches it: kept in memory, and spilled to disk past
//! a small memory bound. Both give the same commit and every record once, in key order, a
//! part at a time; a collection filter that keeps nothing gives no parts; a byte changed
//! in the served file is refused.

use std::collections::HashMap;
use std::sync::Arc;

use atproto_identity::resolver::{Resolver, ResolverConfig};
use repo_sync::check::{CheckError, Route};
use repo_sync::fetch::Limits;
use repo_sync::snapshot::{PART_RECORDS, fetch_snapshot};

const DID: &str = "did:plc:generatedrepo10k000000000";
const N: u64 = 10_000;

fn client() -> guarded_http::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let guard = guarded_http::Guard { allow_private: true, max_redirects: 3 };
    guarded_http::Client::new(guard, reqwest::Client::builder()).expect("client")
}

/// A PDS serving the built repo from `path` and a PLC naming it; the resolver.
async fn world(path: &std::path::Path) -> (testkit::plc::Plc, Resolver, testkit::repo::Built) {
    let base = testkit::pds::start_files(HashMap::from([(DID.to_owned(), path.to_owned())])).await;
    let built = testkit::repo::write(path, DID, N, &base);
    let plc = testkit::plc::Plc::start(HashMap::from([(DID.to_owned(), built.doc.clone())])).await;
    let r = Resolver::new(ResolverConfig { plc_url: plc.url(), ..ResolverConfig::default() }).expect("resolver");
    (plc, r, built)
}

fn now_us() -> i64 {
    i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_micros())
        .expect("µs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generated_repo_arrives_whole_in_parts_from_memory_and_from_disk() {
    let dir = testkit::tmpdir("generated");
    let (_plc, r, built) = world(&dir.join("repo.car")).await;
    let hosts = repo_sync::hosts::Hosts::default();
    let route = Route { hosts: &hosts, via: None };
    for memory_bytes in [64 << 20, 64 << 10] {
        let limits = Limits { spill_dir: dir.clone(), memory_bytes, ..Limits::default() };
        let (snap, mut parts) =
            fetch_snapshot(&r, &client(), route, DID, &limits, now_us(), None).await.expect("snapshot");
        assert_eq!((snap.rev.as_str(), snap.records, snap.bytes), (built.rev.as_str(), N, built.bytes));
        let mut sizes = Vec::new();
        let mut next = 0u64;
        while let Some(part) = parts.next().await {
            let part = part.expect("part");
            sizes.push(part.len());
            for rec in part {
                assert_eq!(
                    (rec.collection.as_str(), rec.rkey.as_str()),
                    ("app.bsky.feed.like", testkit::repo::rkey(next).as_str())
                );
                assert!(rec.json.starts_with(r#"{"$type":"app.bsky.feed.like""#), "{}", rec.json);
                next += 1;
            }
        }
        assert_eq!(next, N, "every record once, in key order ({memory_bytes} bytes in memory)");
        assert!(sizes.len() > 1 && sizes.iter().all(|&s| s <= PART_RECORDS), "{sizes:?}");
    }
    testkit::assert_no_spill_left(&dir);
    // A filter that keeps no collection: the commit, no records.
    let nothing: repo_sync::snapshot::Wants = Some(Arc::new(|_: &str| false));
    let limits = Limits { spill_dir: dir.clone(), ..Limits::default() };
    let (snap, parts) = fetch_snapshot(&r, &client(), route, DID, &limits, now_us(), nothing).await.expect("snapshot");
    assert_eq!(snap.records, 0);
    assert!(parts.collect().await.expect("parts").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_changed_in_a_generated_repo_is_refused() {
    let dir = testkit::tmpdir("generated-bad");
    let path = dir.join("repo.car");
    let (_plc, r, built) = world(&path).await;
    let mut bytes = std::fs::read(&path).expect("car");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x20;
    std::fs::write(&path, &bytes).expect("write");
    let hosts = repo_sync::hosts::Hosts::default();
    let limits = Limits { spill_dir: dir.clone(), memory_bytes: 64 << 10, ..Limits::default() };
    match fetch_snapshot(&r, &client(), Route { hosts: &hosts, via: None }, DID, &limits, now_us(), None).await {
        Err(CheckError::Verify(e)) => assert!(e.to_string().contains("match its CID"), "{e}"),
        other => panic!("{:?}", other.map(|(s, _)| s)),
    }
    assert_eq!(built.records, N);
}

/// A repo kept in memory starts rendering once its commit is verified, beside the tree's
/// walk: a record missing from it still ends the fetch with the walk's verdict, and no
/// part of it is handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repo_in_memory_missing_a_record_is_refused_though_its_rendering_began() {
    let dir = testkit::tmpdir("generated-missing");
    let path = dir.join("repo.car");
    let (_plc, r, _built) = world(&path).await;
    let (root, blocks) = testkit::tamper::car_blocks(&std::fs::read(&path).expect("car"));
    let gone = atproto_data::car::cid_for(&testkit::repo::record(DID, N - 1));
    let kept: Vec<(Vec<u8>, Vec<u8>)> = blocks.into_iter().filter(|(c, _)| *c != gone).collect();
    std::fs::write(&path, testkit::tamper::car_build(&root, &kept)).expect("write");
    let hosts = repo_sync::hosts::Hosts::default();
    let limits = Limits { spill_dir: dir.clone(), ..Limits::default() };
    match fetch_snapshot(&r, &client(), Route { hosts: &hosts, via: None }, DID, &limits, now_us(), None).await {
        Err(CheckError::Verify(atproto_repo::repo::RepoError::MissingRecord(k))) => {
            assert_eq!(k, format!("app.bsky.feed.like/{}", testkit::repo::rkey(N - 1)));
        }
        other => panic!("{:?}", other.map(|(s, _)| s)),
    }
}
