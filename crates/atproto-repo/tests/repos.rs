//! Whole repos from a reference PDS (`fixtures/repos/`: `getRepo` bodies of 8 small
//! accounts and one of 20,000 records, with the reference record set's digest) verified
//! by `repo::verify_repo_bytes`, and the same CARs damaged one way at a time.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use atproto_crypto::PublicKey;
use atproto_data::car::Car;
use atproto_repo::repo::{RepoError, verify_repo_bytes};
use sha2::Digest as _;

fn repos_dir() -> std::path::PathBuf {
    testkit::pds::repos_dir()
}

/// DID → (record count, sha256 of "key cid\n" lines in key order, signing key), from the
/// reference PDS's `listRecords`.
fn reference() -> BTreeMap<String, (u64, String, String)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repos_dir().join("records.digest.json")).expect("digest"))
            .expect("json");
    v.as_object()
        .expect("object")
        .iter()
        .map(|(did, r)| {
            let s = |k: &str| r[k].as_str().expect(k).to_owned();
            (did.clone(), (r["records"].as_u64().expect("records"), s("sha256"), s("signingKey")))
        })
        .collect()
}

fn car_of(did: &str) -> Vec<u8> {
    testkit::pds::car(did)
}

fn key_of(did_key: &str) -> PublicKey {
    PublicKey::from_did_key(did_key).expect("did:key")
}

/// A CAR with the same root and blocks, but `keep` decides which blocks stay.
fn rebuilt(car: &[u8], keep: impl Fn(&[u8], &[u8]) -> bool) -> Vec<u8> {
    let (root, blocks) = testkit::tamper::car_blocks(car);
    let kept: Vec<(Vec<u8>, Vec<u8>)> = blocks.into_iter().filter(|(c, d)| keep(c, d)).collect();
    testkit::tamper::car_build(&root, &kept)
}

#[test]
fn every_reference_repo_verifies_and_holds_exactly_the_reference_records() {
    let repos: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repos_dir().join("repos.json")).expect("repos")).expect("json");
    let reference = reference();
    assert_eq!(reference.len(), 9);
    for r in repos.as_array().expect("array") {
        let did = r["did"].as_str().expect("did");
        let (count, digest, signing) = &reference[did];
        let car = car_of(did);
        let snap = verify_repo_bytes(&car, did, &key_of(signing), NOW).unwrap_or_else(|e| panic!("{did}: {e}"));
        assert_eq!(snap.commit.rev, r["rev"].as_str().expect("rev"), "{did}");
        assert_eq!(snap.commit.cid.to_string_b32(), r["commit"].as_str().expect("commit"), "{did}");
        assert_eq!(snap.commit.data.to_string_b32(), r["data"].as_str().expect("data"), "{did}");
        assert_eq!(snap.records.len() as u64, *count, "{did}");
        let mut lines = String::new();
        for rec in &snap.records {
            let cid = atproto_data::cid::Cid::from_bytes(&rec.cid).expect("cid");
            let _ = writeln!(lines, "{} {}", rec.key, cid.to_string_b32());
            assert_eq!(atproto_data::car::cid_for(rec.block), rec.cid, "{did} {}: block and CID", rec.key);
        }
        assert_eq!(&hex(&sha2::Sha256::digest(lines.as_bytes())), digest, "{did}: the reference (key, cid) set");
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

const SMALL: &str = "did:plc:zs4kp6ujxn2l7wrtp3nxeiob";

/// The verifier's clock: the day the fixtures were recorded (2026-12-06), at noon.
const NOW: i64 = 20_793 * 86_400_000_000 + 43_200_000_000;

fn small() -> (Vec<u8>, PublicKey) {
    let reference = reference();
    (car_of(SMALL), key_of(&reference[SMALL].2))
}

#[test]
fn a_record_block_changed_in_transit_is_refused() {
    let (car, key) = small();
    let snap = verify_repo_bytes(&car, SMALL, &key, NOW).expect("verifies");
    let block = snap.records[3].block;
    let at = car.windows(block.len()).position(|w| w == block).expect("block in car") + block.len() - 1;
    let mut bad = car.clone();
    bad[at] ^= 1;
    assert!(matches!(verify_repo_bytes(&bad, SMALL, &key, NOW), Err(RepoError::Car(_))));
}

#[test]
fn a_missing_record_block_is_named() {
    let (car, key) = small();
    let snap = verify_repo_bytes(&car, SMALL, &key, NOW).expect("verifies");
    let gone = snap.records[5].cid.clone();
    let name = snap.records[5].key.clone();
    let bad = rebuilt(&car, |cid, _| cid != gone.as_slice());
    match verify_repo_bytes(&bad, SMALL, &key, NOW) {
        Err(RepoError::MissingRecord(k)) => assert_eq!(k, name),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_missing_tree_node_or_a_since_diff_is_not_a_whole_repo() {
    let (car, key) = small();
    let parsed = Car::parse(&car, false).expect("car");
    let snap = verify_repo_bytes(&car, SMALL, &key, NOW).expect("verifies");
    let records: Vec<Vec<u8>> = snap.records.iter().map(|r| r.cid.clone()).collect();
    let commit = snap.commit.cid.as_bytes().to_vec();
    let root = snap.commit.data.as_bytes().to_vec();
    // A tree node below the root: neither the commit, the root node nor a record.
    let node = parsed
        .blocks()
        .map(|(c, _)| c.as_bytes().to_vec())
        .find(|c| *c != commit && *c != root && !records.contains(c))
        .expect("an inner tree node");
    let bad = rebuilt(&car, |cid, _| cid != node.as_slice());
    assert!(matches!(verify_repo_bytes(&bad, SMALL, &key, NOW), Err(RepoError::Incomplete)));
    // getRepo?since= of rsmall1: only what changed after the rev.
    let did = "did:plc:4fqcvmfbjmzuc7dzjjm6ss6q";
    let since =
        std::fs::read(repos_dir().join("cars").join(format!("{}.since-3n3ykm47pn72h.car", did.replace(':', "_"))))
            .expect("since car");
    let signing = reference()[did].2.clone();
    assert!(matches!(verify_repo_bytes(&since, did, &key_of(&signing), NOW), Err(RepoError::Incomplete)));
}

#[test]
fn another_repos_key_or_did_is_refused() {
    let (car, _) = small();
    let reference = reference();
    let other = reference.keys().find(|d| *d != SMALL).expect("another");
    let wrong_key = key_of(&reference[other].2);
    assert!(matches!(verify_repo_bytes(&car, SMALL, &wrong_key, NOW), Err(RepoError::Commit(_))));
    let right_key = key_of(&reference[SMALL].2);
    assert!(matches!(verify_repo_bytes(&car, other, &right_key, NOW), Err(RepoError::Commit(_))));
}

/// The small repo under a tree of another shape with the same records: an empty node
/// above the real root (valid node by node, every key on its layer), the commit's `data`
/// pointing at it and the commit re-signed with a test key. Only the canonical check
/// (the tree rebuilt from its leaves) tells it apart.
#[test]
fn a_tree_of_another_shape_with_the_same_records_is_not_canonical() {
    use k256::ecdsa::signature::hazmat::PrehashSigner as _;
    let (car, key) = small();
    let snap = verify_repo_bytes(&car, SMALL, &key, NOW).expect("verifies");
    let data = snap.commit.data.as_bytes().to_vec();
    let commit_cid = snap.commit.cid.as_bytes().to_vec();
    let parsed = Car::parse(&car, false).expect("car");
    let mut blocks: Vec<(Vec<u8>, Vec<u8>)> =
        parsed.blocks().map(|(c, d)| (c.as_bytes().to_vec(), d.to_vec())).collect();
    let mut w = atproto_data::cbor::Writer::new();
    w.map(2).str("e").array(0).str("l").link(&data);
    let wrapper = w.buf;
    let wrapper_cid = atproto_data::car::cid_for(&wrapper);
    blocks.push((wrapper_cid.clone(), wrapper));
    // The commit with `data` = the wrapper, re-signed.
    let at = blocks.iter().position(|(c, _)| *c == commit_cid).expect("commit");
    let mut commit = blocks[at].1.clone();
    let d = commit.windows(data.len()).position(|x| x == data.as_slice()).expect("data link");
    commit[d..d + data.len()].copy_from_slice(&wrapper_cid);
    let sig_key = b"\x63sig\x58\x40";
    let s = commit.windows(sig_key.len()).position(|x| x == sig_key).expect("sig") + sig_key.len();
    let mut unsigned = vec![commit[0] - 1];
    unsigned.extend_from_slice(&commit[1..s - sig_key.len()]);
    unsigned.extend_from_slice(&commit[s + 64..]);
    let signer = k256::ecdsa::SigningKey::from_slice(&[7u8; 32]).expect("key");
    let sig: k256::ecdsa::Signature = signer.sign_prehash(&sha2::Sha256::digest(&unsigned)).expect("sign");
    let sig = sig.normalize_s().unwrap_or(sig);
    commit[s..s + 64].copy_from_slice(&sig.to_bytes());
    let new_commit = atproto_data::car::cid_for(&commit);
    blocks[at] = (new_commit.clone(), commit);
    let bad = testkit::tamper::car_build(&new_commit, &blocks);
    let verifying = signer.verifying_key().to_encoded_point(true);
    let test_key = PublicKey::from_sec1(atproto_crypto::Curve::K256, verifying.as_bytes()).expect("key");
    assert!(
        matches!(verify_repo_bytes(&bad, SMALL, &test_key, NOW), Err(RepoError::NotCanonical)),
        "{:?}",
        verify_repo_bytes(&bad, SMALL, &test_key, NOW).err()
    );
}

/// A verifier whose clock is more than the allowance behind the repo's rev refuses it
/// (a rev in the future would make every later commit of the repo look old).
#[test]
fn a_rev_in_the_future_is_refused() {
    let (car, key) = small();
    let day_before = NOW - 86_400_000_000;
    assert!(matches!(verify_repo_bytes(&car, SMALL, &key, day_before), Err(RepoError::Rev(_))));
    assert!(verify_repo_bytes(&car, SMALL, &key, NOW).is_ok());
}
