//! Repos built here, of any size: `n` like records under one signed commit, written as
//! `getRepo` serves a repo (a CAR whose root is the commit), with the DID document that
//! names its key and PDS. For a repo larger than any fixture (the million-record repo of
//! `make bench`) and for generated tests of repo sync.

use std::io::Write as _;
use std::path::Path;

use atproto_data::car::{cid_for, push_varint};
use atproto_data::cbor::Writer;
use k256::ecdsa::SigningKey;
use k256::ecdsa::signature::hazmat::PrehashSigner as _;
use sha2::Digest as _;

/// A repo written by [`write`].
#[derive(Debug, Clone)]
pub struct Built {
    /// Its DID.
    pub did: String,
    /// Its DID document (JSON), its PDS at the `pds` given to [`write`].
    pub doc: String,
    /// The commit's rev.
    pub rev: String,
    /// How many records.
    pub records: u64,
    /// The CAR's size.
    pub bytes: u64,
}

/// The signing key of every built repo.
fn key() -> SigningKey {
    SigningKey::from_slice(&[9u8; 32]).expect("key")
}

/// Record `i`'s key: `app.bsky.feed.like/<a TID>`, in order of `i`.
#[must_use]
pub fn rkey(i: u64) -> String {
    // 2026-12-06T00:00:00Z in µs, one record a microsecond.
    atproto_data::tid::to_string(((1_796_515_200_000_000 + i) << 10) | 7)
}

/// Record `i`'s DAG-CBOR block (a like, ~190 bytes).
#[must_use]
pub fn record(did: &str, i: u64) -> Vec<u8> {
    let subject = cid_for(&i.to_be_bytes());
    let mut cid = String::new();
    atproto_data::cid::Cid::from_bytes(&subject).expect("cid").write_str(&mut cid);
    let mut w = Writer::new();
    w.map(3).str("$type").str("app.bsky.feed.like");
    w.str("subject").map(2).str("cid").str(&cid).str("uri").str(&format!("at://{did}/app.bsky.feed.post/{}", rkey(i)));
    w.str("createdAt").str("2026-12-06T12:00:00.000Z");
    w.buf
}

/// Writes a repo of `n` records of `did` to `path` as `getRepo` serves it; its DID
/// document names `pds`. Memory: the tree's nodes and a CID per record (about 150 MB for a
/// million records); records are made again when written.
///
/// # Panics
/// When the file cannot be written.
#[must_use]
pub fn write(path: &Path, did: &str, n: u64, pds: &str) -> Built {
    let keys: Vec<String> = (0..n).map(|i| format!("app.bsky.feed.like/{}", rkey(i))).collect();
    let cids: Vec<Vec<u8>> = (0..n).map(|i| cid_for(&record(did, i))).collect();
    let pairs: Vec<(&[u8], &[u8])> = keys.iter().zip(&cids).map(|(k, c)| (k.as_bytes(), c.as_slice())).collect();
    let (data, nodes) = atproto_repo::mst::build_tree(&pairs);
    drop(pairs);
    drop(keys);
    let rev = rkey(n + 1_000_000);
    // The commit, keys in DAG-CBOR order: did, rev, sig, data, prev, version.
    let unsigned = |w: &mut Writer, sig: Option<&[u8]>| {
        w.map(if sig.is_some() { 6 } else { 5 }).str("did").str(did).str("rev").str(&rev);
        if let Some(s) = sig {
            w.str("sig").bytes(s);
        }
        w.str("data").link(&data).str("prev").null().str("version").int(3);
    };
    let mut w = Writer::new();
    unsigned(&mut w, None);
    let sig: k256::ecdsa::Signature = key().sign_prehash(&sha2::Sha256::digest(&w.buf)).expect("sign");
    let sig = sig.normalize_s().unwrap_or(sig);
    let mut w = Writer::new();
    unsigned(&mut w, Some(&sig.to_bytes()));
    let commit = w.buf;
    let commit_cid = cid_for(&commit);

    let mut out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path).expect("create"));
    let mut h = Writer::new();
    h.map(2).str("roots").array(1).link(&commit_cid).str("version").int(1);
    let put = |out: &mut std::io::BufWriter<std::fs::File>, cid: &[u8], data: &[u8]| {
        let mut head = Vec::new();
        push_varint(&mut head, (cid.len() + data.len()) as u64);
        out.write_all(&head).and_then(|()| out.write_all(cid)).and_then(|()| out.write_all(data)).expect("write");
    };
    let mut head = Vec::new();
    push_varint(&mut head, h.buf.len() as u64);
    out.write_all(&head).and_then(|()| out.write_all(&h.buf)).expect("write");
    put(&mut out, &commit_cid, &commit);
    for node in &nodes {
        put(&mut out, &cid_for(node), node);
    }
    for (i, cid) in cids.iter().enumerate() {
        put(&mut out, cid, &record(did, i as u64));
    }
    out.flush().expect("flush");
    let bytes = std::fs::metadata(path).map_or(0, |m| m.len());
    Built { did: did.to_owned(), doc: doc(did, pds), rev, records: n, bytes }
}

/// The DID document of a built repo: its key (`#atproto`) and its PDS (`#atproto_pds`).
fn doc(did: &str, pds: &str) -> String {
    let point = key().verifying_key().to_encoded_point(false);
    let multibase = format!("z{}", bs58::encode(point.as_bytes()).into_string());
    serde_json::json!({
        "@context": ["https://www.w3.org/ns/did/v1"],
        "id": did,
        "alsoKnownAs": [],
        "verificationMethod": [{
            "id": "#atproto",
            "type": "EcdsaSecp256k1VerificationKey2019",
            "controller": did,
            "publicKeyMultibase": multibase,
        }],
        "service": [{ "id": "#atproto_pds", "type": "AtprotoPersonalDataServer", "serviceEndpoint": pds }],
    })
    .to_string()
}
