//! Tampered copies of real signed frames, built byte by byte as an attacker on the relay
//! path would: each kind of forgery the verification must catch, and commits re-signed
//! with a test key (for key rotation and wrong-key cases).

use k256::ecdsa::SigningKey;
use k256::ecdsa::signature::hazmat::PrehashSigner as _;
use relay_client::car::{Car, cid_for, push_varint};
use relay_client::cbor::{Reader, Writer};
use sha2::Digest as _;

use crate::bytes_compat::Bytes;

/// A CAR's root and blocks, (CID, data) in file order.
pub type Blocks = (Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>);

/// Splits a CAR into its root and blocks.
#[must_use]
pub fn car_blocks(car: &[u8]) -> Blocks {
    let c = Car::parse(car, false).expect("CAR");
    (c.roots[0].as_bytes().to_vec(), c.blocks().map(|(k, d)| (k.as_bytes().to_vec(), d.to_vec())).collect())
}

/// A CAR from a root and blocks (CIDs as given, not recomputed).
#[must_use]
pub fn car_build(root: &[u8], blocks: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut h = Writer::new();
    h.map(2).str("roots").array(1).link(root).str("version").int(1);
    push_varint(&mut out, h.buf.len() as u64);
    out.extend_from_slice(&h.buf);
    for (k, d) in blocks {
        push_varint(&mut out, (k.len() + d.len()) as u64);
        out.extend_from_slice(k);
        out.extend_from_slice(d);
    }
    out
}

/// The frame with body fields replaced by already encoded CBOR values (`fields`: name →
/// bytes); every other byte stays.
#[must_use]
pub fn with_fields(frame: &[u8], fields: &[(&str, Vec<u8>)]) -> Bytes {
    let mut rd = Reader::new(frame);
    rd.skip().expect("header");
    let head_end = rd.position();
    let entries = rd.map().expect("body map");
    let mut out = Writer::new();
    out.raw(&frame[..head_end]).map(entries);
    let mut prev = None;
    for _ in 0..entries {
        let key_start = rd.position();
        let key = rd.key(prev).expect("key");
        prev = Some(key);
        let start = rd.position();
        rd.skip().expect("value");
        out.raw(&frame[key_start..start]);
        match fields.iter().find(|(name, _)| *name == key) {
            Some((_, v)) => out.raw(v),
            None => out.raw(&frame[start..rd.position()]),
        };
    }
    Bytes::from(out.buf)
}

fn link(cid: &[u8]) -> Vec<u8> {
    let mut w = Writer::new();
    w.link(cid);
    w.buf
}

fn bytes(b: &[u8]) -> Vec<u8> {
    let mut w = Writer::new();
    w.bytes(b);
    w.buf
}

fn commit_of(frame: &[u8]) -> relay_client::frame::Commit<'_> {
    match relay_client::decode(frame).expect("frame") {
        relay_client::Frame::Message(relay_client::Message::Commit(c)) => c,
        _ => panic!("a #commit frame"),
    }
}

/// Where the 64 signature bytes sit in a commit block.
fn sig_at(block: &[u8]) -> usize {
    block.windows(6).position(|w| w == [0x63, b's', b'i', b'g', 0x58, 0x40]).expect("sig entry") + 6
}

/// The `#commit` frame with its commit block changed by `edit`; with `recompute` the block
/// gets its new CID everywhere (CAR root, block, the event's `commit`), else the old CID
/// stays.
#[must_use]
pub fn edit_commit_block(frame: &[u8], edit: impl FnOnce(&mut Vec<u8>), recompute: bool) -> Bytes {
    let c = commit_of(frame);
    let (root, mut blocks) = car_blocks(c.blocks);
    let at = blocks.iter().position(|(k, _)| *k == root).expect("commit block");
    edit(&mut blocks[at].1);
    let new_root = if recompute { cid_for(&blocks[at].1) } else { root };
    blocks[at].0.clone_from(&new_root);
    let car = car_build(&new_root, &blocks);
    with_fields(frame, &[("blocks", bytes(&car)), ("commit", link(&new_root))])
}

#[allow(clippy::ptr_arg)] // the shape `edit_commit_block` takes
fn flip_sig(b: &mut Vec<u8>) {
    let at = sig_at(b);
    b[at + 10] ^= 1;
}

/// A signature byte flipped, every CID recomputed: only the signature check can tell.
#[must_use]
pub fn sig_flipped(frame: &[u8]) -> Bytes {
    edit_commit_block(frame, flip_sig, true)
}

/// A signature byte flipped, the old CID kept: the block no longer hashes to it.
#[must_use]
pub fn sig_flipped_old_cid(frame: &[u8]) -> Bytes {
    edit_commit_block(frame, flip_sig, false)
}

/// The valid signature's high-S twin (s → n − s), CIDs recomputed.
#[must_use]
pub fn high_s(frame: &[u8]) -> Bytes {
    edit_commit_block(
        frame,
        |b| {
            let at = sig_at(b);
            let sig = k256::ecdsa::Signature::from_slice(&b[at..at + 64]).expect("sig");
            let (r, s) = sig.split_scalars();
            let twin = k256::ecdsa::Signature::from_scalars(r, -*s).expect("twin");
            b[at..at + 64].copy_from_slice(&twin.to_bytes());
        },
        true,
    )
}

/// The commit re-signed with `key`, CIDs recomputed.
#[must_use]
pub fn resigned(frame: &[u8], key: &SigningKey) -> Bytes {
    edit_commit_block(
        frame,
        |b| {
            let at = sig_at(b);
            // The unsigned commit: the map one entry shorter, without `sig`.
            let mut unsigned = vec![b[0] - 1];
            unsigned.extend_from_slice(&b[1..at - 6]);
            unsigned.extend_from_slice(&b[at + 64..]);
            let digest = sha2::Sha256::digest(&unsigned);
            let sig: k256::ecdsa::Signature = key.sign_prehash(&digest).expect("sign");
            let sig = sig.normalize_s().unwrap_or(sig);
            b[at..at + 64].copy_from_slice(&sig.to_bytes());
        },
        true,
    )
}

/// A record's bytes changed under its CID.
#[must_use]
pub fn record_changed(frame: &[u8]) -> Bytes {
    let c = commit_of(frame);
    let record = c.ops.iter().find_map(|o| o.cid).expect("an op with a record").as_bytes().to_vec();
    let (root, mut blocks) = car_blocks(c.blocks);
    let b = blocks.iter_mut().find(|(k, _)| *k == record).expect("the record block");
    let last = b.1.len() - 1;
    b.1[last] ^= 1;
    with_fields(frame, &[("blocks", bytes(&car_build(&root, &blocks)))])
}

/// The first create's or update's record CID replaced by another record's.
#[must_use]
pub fn op_cid_changed(frame: &[u8]) -> Bytes {
    let c = commit_of(frame);
    let other = cid_for(b"a record that is not in this commit");
    let target = c.ops.iter().position(|o| o.cid.is_some()).expect("an op with a record");
    let mut w = Writer::new();
    w.array(c.ops.len() as u64);
    for (i, op) in c.ops.iter().enumerate() {
        let action = match op.action {
            relay_client::frame::Action::Create => "create",
            relay_client::frame::Action::Update => "update",
            relay_client::frame::Action::Delete => "delete",
        };
        let cid = if i == target { Some(other.as_slice()) } else { op.cid.map(|c| c.as_bytes()) };
        w.map(if op.prev.is_some() { 4 } else { 3 }).str("cid");
        match cid {
            Some(c) => w.link(c),
            None => w.null(),
        };
        w.str("path").str(op.path);
        if let Some(p) = op.prev {
            w.str("prev").link(p.as_bytes());
        }
        w.str("action").str(action);
    }
    with_fields(frame, &[("ops", w.buf)])
}

/// The tree's root node removed from the CAR: the inversion cannot complete.
#[must_use]
pub fn tree_node_removed(frame: &[u8]) -> Bytes {
    let c = commit_of(frame);
    let (root, blocks) = car_blocks(c.blocks);
    let commit = &blocks.iter().find(|(k, _)| *k == root).expect("commit").1;
    let mut r = Reader::new(commit);
    let n = r.map().expect("commit map");
    let mut data = None;
    for _ in 0..n {
        if r.str().expect("key") == "data" {
            data = Some(r.link().expect("data").to_vec());
        } else {
            r.skip().expect("skip");
        }
    }
    let data = data.expect("data");
    let kept: Vec<_> = blocks.into_iter().filter(|(k, _)| *k != data).collect();
    with_fields(frame, &[("blocks", bytes(&car_build(&root, &kept)))])
}

/// A `prevData` the ops do not reproduce.
#[must_use]
pub fn prev_data_wrong(frame: &[u8]) -> Bytes {
    with_fields(frame, &[("prevData", link(&cid_for(b"another tree")))])
}

/// The commit names another repo (`other`, a DID of the same length) as its `did`, CIDs
/// recomputed; the event still names its own repo.
#[must_use]
pub fn commit_did_changed(frame: &[u8], other: &str) -> Bytes {
    let repo = commit_of(frame).repo.to_owned();
    assert_eq!(repo.len(), other.len(), "a DID of the same length");
    edit_commit_block(
        frame,
        |b| {
            let at = b.windows(repo.len()).position(|w| w == repo.as_bytes()).expect("the commit's did");
            b[at..at + repo.len()].copy_from_slice(other.as_bytes());
        },
        true,
    )
}

/// The event names another repo than the commit it carries.
#[must_use]
pub fn repo_changed(frame: &[u8], other: &str) -> Bytes {
    let mut w = Writer::new();
    w.str(other);
    with_fields(frame, &[("repo", w.buf)])
}

/// A DID document for `did` whose `#atproto` key is `key` (as `Multikey`).
#[must_use]
pub fn did_doc(did: &str, key: &SigningKey) -> String {
    let point = key.verifying_key().to_encoded_point(true);
    let mut mk = vec![0xe7, 0x01];
    mk.extend_from_slice(point.as_bytes());
    serde_json::json!({
        "@context": ["https://www.w3.org/ns/did/v1"],
        "id": did,
        "alsoKnownAs": [],
        "verificationMethod": [{
            "id": format!("{did}#atproto"),
            "type": "Multikey",
            "controller": did,
            "publicKeyMultibase": format!("z{}", bs58::encode(mk).into_string()),
        }],
        "service": [],
    })
    .to_string()
}

/// A fixed test signing key (`n` picks one of many).
#[must_use]
pub fn test_key(n: u8) -> SigningKey {
    let mut secret = [7u8; 32];
    secret[31] = n.max(1);
    SigningKey::from_slice(&secret).expect("key")
}
