//! atproto's commit-proof vectors (CC0, `fixtures/interop/firehose/`): trees built from
//! the listed keys have the listed roots before and after the ops; from the listed proof
//! blocks alone, inverting the ops gives back the root before the commit; and with a
//! block taken away, inversion either cannot complete or still proves the same root
//! (never another one).

use atproto_data::car::{Car, build, cid_for};
use atproto_data::cid::Cid;
use atproto_repo::mst::{MstError, Op, Partial, build_tree};

/// Decodes a base32 (`b…`, RFC 4648 lower case, unpadded) CID string.
fn cid(s: &str) -> Vec<u8> {
    let body = s.strip_prefix('b').expect("base32 multibase");
    let (mut out, mut acc, mut bits) = (Vec::new(), 0u32, 0);
    for c in body.bytes() {
        let v = match c {
            b'a'..=b'z' => c - b'a',
            b'2'..=b'7' => c - b'2' + 26,
            _ => panic!("not base32: {s}"),
        };
        acc = (acc << 5) | u32::from(v);
        bits += 5;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

fn cases() -> Vec<serde_json::Value> {
    let text =
        std::fs::read_to_string(testkit::fixture("interop/firehose/commit-proof-fixtures.json")).expect("fixture");
    serde_json::from_str(&text).expect("JSON")
}

fn strs(v: &serde_json::Value) -> Vec<String> {
    v.as_array().expect("array").iter().map(|s| s.as_str().expect("string").to_owned()).collect()
}

/// Inverts the case's ops on the tree held by `blocks` (rooted at `root`).
fn invert(
    root: &[u8],
    blocks: &[Vec<u8>],
    adds: &[String],
    dels: &[String],
    value: &[u8],
) -> Result<Vec<u8>, MstError> {
    let car_bytes = build(&[root.to_vec()], blocks);
    let mut car = Car::parse(&car_bytes, true).expect("CAR");
    car.index();
    let mut tree = Partial::load(&car, Cid::from_bytes(root).expect("cid"))?;
    for k in adds {
        tree.invert(&Op { key: k.as_bytes(), before: None, after: Some(value) })?;
    }
    for k in dels {
        tree.invert(&Op { key: k.as_bytes(), before: Some(value), after: None })?;
    }
    tree.root()
}

#[test]
fn inverting_each_commit_proof_from_its_blocks_gives_the_root_before() {
    let cases = cases();
    assert_eq!(cases.len(), 6);
    let (mut needed, mut spare) = (0, 0);
    for c in &cases {
        let name = c["comment"].as_str().expect("comment");
        let value = cid(c["leafValue"].as_str().expect("leafValue"));
        let (keys, adds, dels) = (strs(&c["keys"]), strs(&c["adds"]), strs(&c["dels"]));
        let before_root = cid(c["rootBeforeCommit"].as_str().expect("before"));
        let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_bytes(), value.as_slice())).collect();
        assert_eq!(build_tree(&pairs).0, before_root, "{name}: the tree before");
        let after_keys: Vec<&String> = keys.iter().filter(|k| !dels.contains(k)).chain(adds.iter()).collect();
        let pairs: Vec<(&[u8], &[u8])> = after_keys.iter().map(|k| (k.as_bytes(), value.as_slice())).collect();
        let (after_root, all) = build_tree(&pairs);
        assert_eq!(after_root, cid(c["rootAfterCommit"].as_str().expect("after")), "{name}: the tree after");

        let proof: Vec<Vec<u8>> = strs(&c["blocksInProof"])
            .iter()
            .map(|s| {
                let want = cid(s);
                all.iter().find(|b| cid_for(b) == want).unwrap_or_else(|| panic!("{name}: {s} is a node")).clone()
            })
            .collect();
        assert_eq!(invert(&after_root, &all, &adds, &dels, &value), Ok(before_root.clone()), "{name}: whole tree");
        assert_eq!(invert(&after_root, &proof, &adds, &dels, &value), Ok(before_root.clone()), "{name}: the proof");
        for i in 0..proof.len() {
            let mut less = proof.clone();
            let gone = less.remove(i);
            match invert(&after_root, &less, &adds, &dels, &value) {
                Err(MstError::Incomplete(_)) => needed += 1,
                Ok(root) => {
                    assert_eq!(root, before_root, "{name}: without block {i} the same root or none");
                    spare += 1;
                }
                Err(e) => panic!("{name}: without block {i}: {e}"),
            }
            if cid_for(&gone) == after_root {
                assert!(matches!(invert(&after_root, &less, &adds, &dels, &value), Err(MstError::Incomplete(_))));
            }
        }
        // A wrong value in an op is a contradiction, not an incomplete proof.
        let other = cid_for(b"another record");
        if !adds.is_empty() {
            assert!(
                matches!(invert(&after_root, &proof, &adds, &[], &other), Err(MstError::Invalid(_))),
                "{name}: an op CID the tree does not hold"
            );
        }
    }
    eprintln!("blocks whose removal stops the inversion: {needed}; not needed by it: {spare}");
    assert!(needed >= 20, "most proof blocks are needed: {needed} of {}", needed + spare);
}
