//! A fetched repo indexed in place (`blocks::Indexed`): in memory or spilled to a file,
//! every reference repo verifies to the same commit and records as the in-memory
//! verifier finds; a CAR damaged on disk, cut short, or announcing a block larger than
//! the bound is refused with the reason, before anything is allocated for it.

use atproto_repo::repo::{RepoError, verify_repo_bytes};
use repo_sync::blocks::{Indexed, MAX_BLOCK};
use repo_sync::check::verify_indexed;
use repo_sync::fetch::Body;

/// The verifier's clock: the day the fixtures were recorded (2026-12-06), at noon.
const NOW: i64 = 20_793 * 86_400_000_000 + 43_200_000_000;

fn spilled(bytes: &[u8], name: &str) -> Body {
    let dir = testkit::tmpdir("blocks");
    let path = dir.join(format!(".getrepo.{name}.car"));
    std::fs::write(&path, bytes).expect("write");
    Body::File { path, len: bytes.len() as u64 }
}

fn key(did: &str) -> atproto_crypto::PublicKey {
    let digest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(testkit::pds::repos_dir().join("records.digest.json")).expect("digest"),
    )
    .expect("json");
    atproto_crypto::PublicKey::from_did_key(digest[did]["signingKey"].as_str().expect("key")).expect("key")
}

#[test]
fn every_reference_repo_verifies_the_same_in_memory_and_spilled() {
    for (did, (count, _)) in testkit::fold::reference() {
        let car = testkit::pds::car(&did);
        let want = verify_repo_bytes(&car, &did, &key(&did), NOW).expect("verifies");
        for body in [Body::Memory(car.clone()), spilled(&car, &did.replace(':', "_"))] {
            let kind = if matches!(body, Body::Memory(_)) { "memory" } else { "file" };
            let ix = Indexed::open(body).expect("indexed");
            assert_eq!(ix.len(), car.len() as u64);
            let head = verify_indexed(&ix, &did, &key(&did), NOW).unwrap_or_else(|e| panic!("{did} {kind}: {e}"));
            assert_eq!(head.rev, want.commit.rev, "{did} {kind}");
            assert_eq!(head.data_cid, want.commit.data.as_bytes(), "{did} {kind}");
            assert_eq!(head.collections.values().sum::<u64>(), count, "{did} {kind}");
        }
    }
}

#[test]
fn a_spill_file_damaged_on_disk_is_refused_and_removed_with_the_index() {
    let did = "did:plc:zs4kp6ujxn2l7wrtp3nxeiob";
    let mut car = testkit::pds::car(did);
    let last = car.len() - 1;
    car[last] ^= 1;
    let body = spilled(&car, "damaged");
    let Body::File { path, .. } = &body else { unreachable!("a file") };
    let path = path.clone();
    assert!(matches!(Indexed::open(body), Err(RepoError::Car(atproto_data::DecodeError::BlockHash(_)))));
    assert!(!path.exists(), "the spill file goes with the failed index");
}

#[test]
fn a_car_cut_short_or_announcing_a_giant_block_is_refused() {
    let did = "did:plc:zs4kp6ujxn2l7wrtp3nxeiob";
    let car = testkit::pds::car(did);
    for body in [Body::Memory(car[..car.len() - 10].to_vec()), spilled(&car[..car.len() - 10], "cut")] {
        match Indexed::open(body) {
            Err(RepoError::Car(e)) => assert!(e.to_string().contains("runs past the end"), "{e}"),
            other => panic!("{other:?}"),
        }
    }
    // The header, then a block announcing MAX_BLOCK + 1 bytes (a varint), and nothing.
    let (hlen, n) = atproto_data::cid::uvarint(&car).expect("header length");
    let mut giant = car[..n + usize::try_from(hlen).expect("len")].to_vec();
    atproto_data::car::push_varint(&mut giant, MAX_BLOCK + 1);
    match Indexed::open(Body::Memory(giant)) {
        Err(RepoError::Car(e)) => assert!(e.to_string().contains("more than"), "{e}"),
        other => panic!("{other:?}"),
    }
}
