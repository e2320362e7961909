//! The cost of checking a signed commit (CAR parse, commit block hash, strict DAG-CBOR
//! read, did/version, low-S ECDSA over the unsigned bytes) on the real signed capture,
//! one core, keys already parsed: the signatures tier of `FIREKEEPER_VERIFY`, which the
//! issue asks to run at ≥ 15,000 commits/s with the full tier; and the full tier (every
//! block's CID, every op's record, the MST inversion).

#![allow(missing_docs)] // criterion_group! generates an undocumented fn

use std::collections::HashMap;

use atproto_crypto::PublicKey;
use atproto_data::{Frame, Message};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn bench(c: &mut Criterion) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/signed");
    let frames = atproto_data::capture::read(&dir.join("signed-b.frames")).expect("frames");
    let keys: HashMap<String, String> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("signed-b.signing-keys.json")).expect("keys"))
            .expect("JSON");
    let keys: HashMap<String, PublicKey> =
        keys.into_iter().map(|(d, k)| (d, PublicKey::from_did_key(&k).expect("key"))).collect();
    let commits: Vec<_> =
        frames.iter().filter(|f| matches!(atproto_data::decode(f), Ok(Frame::Message(Message::Commit(_))))).collect();
    let mut g = c.benchmark_group("signed-b");
    g.throughput(Throughput::Elements(commits.len() as u64));
    g.bench_function("decode + check_commit (signatures tier), per capture", |b| {
        b.iter(|| {
            for f in &commits {
                let Ok(Frame::Message(Message::Commit(m))) = atproto_data::decode(f) else { continue };
                atproto_repo::check_commit(m.blocks, Some(m.commit), m.repo, &keys[m.repo]).expect("valid");
            }
        });
    });
    g.bench_function("decode + verify::commit (full tier), per capture", |b| {
        b.iter(|| {
            for f in &commits {
                let Ok(Frame::Message(Message::Commit(m))) = atproto_data::decode(f) else { continue };
                let v =
                    atproto_repo::verify::commit(&m, &keys[m.repo], atproto_repo::verify::Tier::Full).expect("valid");
                assert!(v.unproven.is_none());
            }
        });
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
