//! The full tier on the real signed capture: every block, every op's record and every
//! commit's MST inversion back to `prevData`; then the tamperings only the full tier can
//! see, each caught with its reason.

use std::collections::HashMap;

use atproto_crypto::PublicKey;
use atproto_data::{Frame, Message};
use atproto_repo::verify::{self, Reason, Tier};

fn frames() -> Vec<atproto_data::capture::Bytes> {
    atproto_data::capture::read(&testkit::fixture("signed/signed-b.frames")).expect("signed-b.frames")
}

fn keys() -> HashMap<String, PublicKey> {
    let text = std::fs::read_to_string(testkit::fixture("signed/signed-b.signing-keys.json")).expect("keys");
    let v: HashMap<String, String> = serde_json::from_str(&text).expect("JSON");
    v.into_iter().map(|(did, k)| (did, PublicKey::from_did_key(&k).expect("did:key"))).collect()
}

#[test]
fn every_commit_of_the_signed_capture_is_proven_by_inversion() {
    let (frames, keys) = (frames(), keys());
    let (mut proven, mut empty, mut syncs, mut multi) = (0, 0, 0, 0);
    for (i, f) in frames.iter().enumerate() {
        match atproto_data::decode(f).expect("frame") {
            Frame::Message(Message::Commit(c)) => {
                let v = verify::commit(&c, &keys[c.repo], Tier::Full).unwrap_or_else(|e| panic!("frame {i}: {e}"));
                assert_eq!(v.unproven, None, "frame {i}: every commit of this capture can be proven");
                assert_eq!(v.rev, c.rev);
                if c.ops.is_empty() {
                    empty += 1;
                } else {
                    assert!(c.prev_data.is_some(), "frame {i}");
                    proven += 1;
                    multi += usize::from(c.ops.len() > 1);
                }
            }
            Frame::Message(Message::Sync(s)) => {
                verify::sync(&s, &keys[s.did], Tier::Full).unwrap_or_else(|e| panic!("frame {i}: {e}"));
                syncs += 1;
            }
            _ => {}
        }
    }
    assert_eq!((proven, empty, syncs, multi), (914, 10, 11, 161));
}

/// The first commit with ops that satisfies `pick`, as (frame index, frame bytes).
fn find(frames: &[atproto_data::capture::Bytes], pick: impl Fn(&atproto_data::frame::Commit<'_>) -> bool) -> usize {
    frames
        .iter()
        .position(|f| matches!(atproto_data::decode(f), Ok(Frame::Message(Message::Commit(c))) if !c.ops.is_empty() && pick(&c)))
        .expect("a matching commit")
}

fn commit_of(f: &[u8]) -> atproto_data::frame::Commit<'_> {
    match atproto_data::decode(f).expect("frame") {
        Frame::Message(Message::Commit(c)) => c,
        _ => panic!("a commit"),
    }
}

/// The CAR rebuilt from its blocks after `f` edits them (a list of (CID, data)).
fn rebuilt(car: &[u8], f: impl FnOnce(&mut Vec<(Vec<u8>, Vec<u8>)>)) -> Vec<u8> {
    let c = atproto_data::car::Car::parse(car, false).expect("CAR");
    let root = c.roots[0].as_bytes().to_vec();
    let mut blocks: Vec<(Vec<u8>, Vec<u8>)> = c.blocks().map(|(k, d)| (k.as_bytes().to_vec(), d.to_vec())).collect();
    f(&mut blocks);
    let mut out = Vec::new();
    let mut h = atproto_data::cbor::Writer::new();
    h.map(2).str("roots").array(1).link(&root).str("version").int(1);
    atproto_data::car::push_varint(&mut out, h.buf.len() as u64);
    out.extend_from_slice(&h.buf);
    for (k, d) in &blocks {
        atproto_data::car::push_varint(&mut out, (k.len() + d.len()) as u64);
        out.extend_from_slice(k);
        out.extend_from_slice(d);
    }
    out
}

#[test]
fn tamperings_of_records_ops_and_trees_are_caught_by_the_full_tier() {
    let (frames, keys) = (frames(), keys());
    let at = find(&frames, |c| c.ops.iter().any(|o| o.cid.is_some()));
    let c = commit_of(&frames[at]);
    let key = &keys[c.repo];
    assert!(verify::commit(&c, key, Tier::Full).is_ok());
    let record = c.ops.iter().find_map(|o| o.cid).expect("a record").as_bytes().to_vec();

    // A record's bytes changed under its CID: the signature tier cannot see it.
    let car = rebuilt(c.blocks, |b| {
        let r = b.iter_mut().find(|(k, _)| *k == record).expect("the record block");
        let last = r.1.len() - 1;
        r.1[last] ^= 0x01;
    });
    let mut t = c.clone();
    t.blocks = &car;
    assert!(verify::commit(&t, key, Tier::Signatures).is_ok(), "the signature does not cover record bytes");
    assert_eq!(verify::commit(&t, key, Tier::Full).map_err(|e| e.reason), Err(Reason::Cid));

    // An op's CID changed to another record's.
    let other = atproto_data::car::cid_for(b"another record");
    let mut t = c.clone();
    let i = t.ops.iter().position(|o| o.cid.is_some()).expect("op");
    t.ops[i].cid = Some(atproto_data::cid::Cid::from_bytes(&other).expect("cid"));
    assert_eq!(verify::commit(&t, key, Tier::Full).map_err(|e| e.reason), Err(Reason::Cid));

    // A prevData the ops do not reproduce.
    let mut t = c.clone();
    t.prev_data = Some(atproto_data::cid::Cid::from_bytes(&other).expect("cid"));
    assert_eq!(verify::commit(&t, key, Tier::Full).map_err(|e| e.reason), Err(Reason::Mst));

    // A tree node the inversion needs removed: unproven, not invalid.
    let data = {
        let car = atproto_data::car::Car::parse(c.blocks, false).expect("CAR");
        atproto_repo::check_commit_in(&car, Some(c.commit), c.repo, key).expect("commit").data.as_bytes().to_vec()
    };
    let car = rebuilt(c.blocks, |b| b.retain(|(k, _)| *k != data));
    let mut t = c.clone();
    t.blocks = &car;
    let v = verify::commit(&t, key, Tier::Full).expect("a missing node is no contradiction");
    assert!(v.unproven.is_some(), "{v:?}");

    // A commit with ops and no prevData: unproven.
    let mut t = c.clone();
    t.prev_data = None;
    assert!(verify::commit(&t, key, Tier::Full).expect("lenient").unproven.is_some());
}

/// Deletes and updates carry `prev`; inverting them restores it. A wrong `prev` gives
/// another root.
#[test]
fn a_wrong_prev_on_a_delete_gives_another_root() {
    let (frames, keys) = (frames(), keys());
    let at = find(&frames, |c| c.ops.iter().any(|o| o.prev.is_some()));
    let c = commit_of(&frames[at]);
    let key = &keys[c.repo];
    assert_eq!(verify::commit(&c, key, Tier::Full).expect("valid").unproven, None);
    let other = atproto_data::car::cid_for(b"another record");
    let mut t = c.clone();
    let i = t.ops.iter().position(|o| o.prev.is_some()).expect("op");
    t.ops[i].prev = Some(atproto_data::cid::Cid::from_bytes(&other).expect("cid"));
    assert_eq!(verify::commit(&t, key, Tier::Full).map_err(|e| e.reason), Err(Reason::Mst));
}
