//! MST inversion against trees built here: random trees, random ops, and inverting the
//! ops on the tree after them always gives the tree before; the real trees of the signed
//! capture re-encode to their own CIDs.

use atproto_data::car::{Car, build, cid_for};
use atproto_data::cid::Cid;
use atproto_data::{Frame, Message};
use atproto_repo::mst::{Op, Partial, build_tree};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// An op: key, value before, value after.
type KeyOp = (String, Option<Vec<u8>>, Option<Vec<u8>>);

fn value(n: u64) -> Vec<u8> {
    cid_for(&n.to_be_bytes())
}

fn random_key(rng: &mut StdRng) -> String {
    const COLLECTIONS: [&str; 4] = ["app.bsky.feed.post", "app.bsky.feed.like", "app.bsky.graph.follow", "a"];
    let c = COLLECTIONS[rng.random_range(0..COLLECTIONS.len())];
    let rkey: String =
        (0..rng.random_range(1..14)).map(|_| char::from(b"234567abcdefghij"[rng.random_range(0..16)])).collect();
    format!("{c}/{rkey}")
}

#[test]
fn inverting_random_ops_on_random_trees_gives_back_the_old_root() {
    let seed = std::env::var("FK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(23);
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..300 {
        let size = rng.random_range(0..if round % 10 == 0 { 400 } else { 40 });
        let mut tree: std::collections::BTreeMap<String, Vec<u8>> = std::collections::BTreeMap::new();
        while tree.len() < size {
            tree.insert(random_key(&mut rng), value(rng.random()));
        }
        let pairs: Vec<(&[u8], &[u8])> = tree.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())).collect();
        let (before_root, _) = build_tree(&pairs);

        // Up to 8 ops on distinct keys: creates, updates and deletes.
        let mut after = tree.clone();
        let mut ops: Vec<KeyOp> = Vec::new();
        for _ in 0..rng.random_range(1..=8) {
            let existing: Vec<&String> = tree.keys().filter(|k| !ops.iter().any(|o| &o.0 == *k)).collect();
            match rng.random_range(0..3) {
                0 | 1 if !existing.is_empty() => {
                    let k = existing[rng.random_range(0..existing.len())].clone();
                    let before = tree[&k].clone();
                    if rng.random_bool(0.5) {
                        let v = value(rng.random());
                        after.insert(k.clone(), v.clone());
                        ops.push((k, Some(before), Some(v)));
                    } else {
                        after.remove(&k);
                        ops.push((k, Some(before), None));
                    }
                }
                _ => {
                    let k = random_key(&mut rng);
                    if tree.contains_key(&k) || ops.iter().any(|o| o.0 == k) {
                        continue;
                    }
                    let v = value(rng.random());
                    after.insert(k.clone(), v.clone());
                    ops.push((k, None, Some(v)));
                }
            }
        }
        let pairs: Vec<(&[u8], &[u8])> = after.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())).collect();
        let (after_root, blocks) = build_tree(&pairs);
        let car_bytes = build(std::slice::from_ref(&after_root), &blocks);
        let mut car = Car::parse(&car_bytes, true).expect("CAR");
        car.index();
        let mut partial = Partial::load(&car, Cid::from_bytes(&after_root).expect("cid")).expect("load");
        assert_eq!(partial.rebuild(), Ok(after_root.clone()), "seed {seed} round {round}: re-encoding");
        for (k, before, after) in &ops {
            partial
                .invert(&Op { key: k.as_bytes(), before: before.as_deref(), after: after.as_deref() })
                .unwrap_or_else(|e| panic!("seed {seed} round {round}: {k}: {e}"));
        }
        assert_eq!(partial.root(), Ok(before_root), "seed {seed} round {round}: {} keys, ops {ops:?}", tree.len());
    }
}

#[test]
fn the_signed_captures_trees_re_encode_to_their_cids() {
    let frames = atproto_data::capture::read(&testkit::fixture("signed/signed-b.frames")).expect("frames");
    let mut n = 0;
    for f in &frames {
        let Ok(Frame::Message(Message::Commit(c))) = atproto_data::decode(f) else { continue };
        let car = c.car(true).expect("CAR");
        let block = car.get(c.commit).expect("commit block");
        let data = {
            let mut rd = atproto_data::cbor::Reader::new(block);
            let entries = rd.map().expect("map");
            let mut data = None;
            for _ in 0..entries {
                if rd.str().expect("key") == "data" {
                    data = Some(rd.link().expect("link"));
                } else {
                    rd.skip().expect("skip");
                }
            }
            data.expect("data")
        };
        let partial = Partial::load(&car, Cid::from_bytes(data).expect("cid")).expect("load");
        assert_eq!(partial.rebuild(), Ok(data.to_vec()), "seq {}", c.seq);
        n += 1;
    }
    assert_eq!(n, 924);
}
