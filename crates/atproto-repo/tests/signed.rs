//! The real signed capture (`fixtures/signed/signed-b.*`: 959 frames of a reference PDS,
//! 10 accounts, real keys): every `#commit` and `#sync` commit checks out against its
//! repo's key, as the reference verifier found (935 of 935 signatures valid), commits
//! without ops included. Then tampered copies built here from those frames, each caught
//! with the right reason.

use std::collections::HashMap;

use atproto_crypto::{PublicKey, SignatureError};
use atproto_data::{Frame, Message};
use atproto_repo::{CommitError, check_commit};

fn frames() -> Vec<atproto_data::capture::Bytes> {
    atproto_data::capture::read(&testkit::fixture("signed/signed-b.frames")).expect("signed-b.frames")
}

fn keys() -> HashMap<String, PublicKey> {
    let text = std::fs::read_to_string(testkit::fixture("signed/signed-b.signing-keys.json")).expect("keys");
    let v: HashMap<String, String> = serde_json::from_str(&text).expect("JSON");
    v.into_iter().map(|(did, k)| (did, PublicKey::from_did_key(&k).expect("did:key"))).collect()
}

/// The reference verdict per frame index: `direct.sig` (absent for non-commit events).
fn reference() -> Vec<Option<String>> {
    let text = std::fs::read_to_string(testkit::fixture("signed/signed-b.verify.jsonl")).expect("verdicts");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("JSON line");
            v["direct"]["sig"].as_str().map(str::to_owned)
        })
        .collect()
}

#[test]
fn every_commit_and_sync_of_the_signed_capture_checks_out_as_the_reference_found() {
    let (frames, keys, verdicts) = (frames(), keys(), reference());
    assert_eq!(frames.len(), 959);
    let (mut commits, mut syncs, mut empty) = (0, 0, 0);
    for (i, f) in frames.iter().enumerate() {
        let Ok(Frame::Message(m)) = atproto_data::decode(f) else { panic!("frame {i} decodes") };
        let out = match &m {
            Message::Commit(c) => {
                commits += 1;
                empty += usize::from(c.ops.is_empty());
                check_commit(c.blocks, Some(c.commit), c.repo, &keys[c.repo]).map(|k| (k.rev == c.rev, k.did))
            }
            Message::Sync(s) => {
                syncs += 1;
                check_commit(s.blocks, None, s.did, &keys[s.did]).map(|k| (k.rev == s.rev, k.did))
            }
            _ => continue,
        };
        let (rev_matches, _) = out.unwrap_or_else(|e| panic!("frame {i}: {e}"));
        assert!(rev_matches, "frame {i}: the commit's rev is the event's");
        assert_eq!(verdicts[i].as_deref(), Some("valid"), "frame {i}: the reference agrees");
    }
    assert_eq!((commits, syncs, empty), (924, 11, 10), "every commit (and the empty first ones) and every sync");
}

/// The first `#commit` with ops: (its frame, the CAR, the commit CID, the repo).
fn a_commit(frames: &[atproto_data::capture::Bytes]) -> (Vec<u8>, Vec<u8>, String) {
    for f in frames {
        if let Ok(Frame::Message(Message::Commit(c))) = atproto_data::decode(f)
            && !c.ops.is_empty()
        {
            return (c.blocks.to_vec(), c.commit.as_bytes().to_vec(), c.repo.to_owned());
        }
    }
    panic!("a commit with ops")
}

/// A block: (CID, data).
type Block = (Vec<u8>, Vec<u8>);

/// The CAR's blocks and its root.
fn blocks_of(car: &[u8]) -> (Vec<u8>, Vec<Block>) {
    let c = atproto_data::car::Car::parse(car, false).expect("CAR");
    let root = c.roots[0].as_bytes().to_vec();
    (root, c.blocks().map(|(k, d)| (k.as_bytes().to_vec(), d.to_vec())).collect())
}

/// Where the 64 signature bytes sit in a commit block (`"sig"`, then a 64-byte string).
fn sig_at(block: &[u8]) -> usize {
    block.windows(6).position(|w| w == [0x63, b's', b'i', b'g', 0x58, 0x40]).expect("sig entry") + 6
}

/// The CAR with the commit block replaced by `f(block)`, and the new commit CID:
/// `recompute` gives the block its new CID everywhere (so only the signature can tell),
/// else the old CID stays.
fn tampered(car: &[u8], f: impl Fn(&mut Vec<u8>), recompute: bool) -> (Vec<u8>, Vec<u8>) {
    let (root, blocks) = blocks_of(car);
    let mut commit = blocks.iter().find(|(k, _)| *k == root).expect("commit block").1.clone();
    f(&mut commit);
    let new_root = if recompute { atproto_data::car::cid_for(&commit) } else { root.clone() };
    let mut out = Vec::new();
    let mut h = atproto_data::cbor::Writer::new();
    h.map(2).str("roots").array(1).link(&new_root).str("version").int(1);
    atproto_data::car::push_varint(&mut out, h.buf.len() as u64);
    out.extend_from_slice(&h.buf);
    for (k, d) in &blocks {
        let (k, d) = if *k == root { (&new_root, &commit) } else { (k, d) };
        atproto_data::car::push_varint(&mut out, (k.len() + d.len()) as u64);
        out.extend_from_slice(k);
        out.extend_from_slice(d);
    }
    (out, new_root)
}

#[test]
fn tampered_commits_are_caught_with_the_right_reason() {
    let (frames, keys) = (frames(), keys());
    let (car, cid, repo) = a_commit(&frames);
    let key = &keys[&repo];
    let cid_of = |b: &[u8]| atproto_data::cid::Cid::from_bytes(b).expect("cid").as_bytes().to_vec();
    let check = |car: &[u8], cid: &[u8], repo: &str, key: &PublicKey| {
        let c = atproto_data::cid::Cid::from_bytes(cid).expect("cid");
        check_commit(car, Some(c), repo, key).map(|_| ())
    };
    assert_eq!(check(&car, &cid, &repo, key), Ok(()), "the original checks out");

    // A signature byte flipped, every CID recomputed: only the signature can tell.
    let flip = |b: &mut Vec<u8>| {
        let at = sig_at(b);
        b[at + 10] ^= 0x01;
    };
    let (bad, new_cid) = tampered(&car, flip, true);
    let got = check(&bad, &cid_of(&new_cid), &repo, key);
    assert!(
        matches!(got, Err(CommitError::Signature(SignatureError::Mismatch | SignatureError::Malformed))),
        "{got:?}"
    );
    // The same flip with the old CID kept: the block no longer hashes to it.
    let (bad, _) = tampered(&car, flip, false);
    assert_eq!(check(&bad, &cid, &repo, key), Err(CommitError::Cid));
    // The event names another commit than the CAR's root.
    assert_eq!(check(&car, &cid_of(&new_cid), &repo, key), Err(CommitError::Root));
    // A high-S twin of the valid signature (s → n − s verifies in plain ECDSA).
    let high_s = |b: &mut Vec<u8>| {
        let at = sig_at(b);
        let sig = k256::ecdsa::Signature::from_slice(&b[at..at + 64]).expect("sig");
        let (r, s) = sig.split_scalars();
        let twin = k256::ecdsa::Signature::from_scalars(r, -*s).expect("high-S twin");
        b[at..at + 64].copy_from_slice(&twin.to_bytes());
    };
    let (bad, new_cid) = tampered(&car, high_s, true);
    assert_eq!(check(&bad, &cid_of(&new_cid), &repo, key), Err(CommitError::Signature(SignatureError::HighS)));
    // Checked as another repo's event, or against a key the repo's document does not hold.
    let (other, other_key) = keys.iter().find(|(d, _)| **d != repo).expect("another account");
    assert!(matches!(check(&car, &cid, other, key), Err(CommitError::DidMismatch { .. })));
    assert_eq!(check(&car, &cid, &repo, other_key), Err(CommitError::Signature(SignatureError::Mismatch)));
    // Garbage instead of a CAR.
    assert!(matches!(check(b"\x01\x02", &cid, &repo, key), Err(CommitError::Car(_))));
}
