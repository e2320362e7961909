//! One secp256k1 signature check, three ways, on the interop vector's key and signature:
//! this crate (libsecp256k1 since the first run of this bench: SHA-256, low-S check,
//! verify), bare `RustCrypto` `k256`, and bare libsecp256k1 (`secp256k1`): the measurement
//! the verifier was chosen by (issue 23).

#![allow(missing_docs)] // criterion_group! generates an undocumented fn

use atproto_crypto::PublicKey;
use base64::Engine as _;
use criterion::{Criterion, criterion_group, criterion_main};
use k256::ecdsa::signature::Verifier as _;
use sha2::Digest as _;

fn bench(c: &mut Criterion) {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/interop/crypto/signature-fixtures.json");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("JSON");
    let case = cases
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["algorithm"] == "ES256K" && c["validSignature"] == true)
        .expect("a valid K-256 case");
    let b64 =
        |k: &str| base64::engine::general_purpose::STANDARD_NO_PAD.decode(case[k].as_str().expect("b64")).expect("b64");
    let (msg, sig) = (b64("messageBase64"), b64("signatureBase64"));
    let key = PublicKey::from_did_key(case["publicKeyDid"].as_str().expect("did")).expect("key");
    let vk = k256::ecdsa::VerifyingKey::from_sec1_bytes(&key.to_compressed()).expect("key");
    let rc_sig = k256::ecdsa::Signature::from_slice(&sig).expect("sig");
    let secp = secp256k1::Secp256k1::verification_only();
    let spk = secp256k1::PublicKey::from_slice(&key.to_compressed()).expect("key");
    let compact_sig = secp256k1::ecdsa::Signature::from_compact(&sig).expect("sig");
    let mut g = c.benchmark_group("secp256k1 verify");
    g.bench_function("atproto-crypto (libsecp256k1, low-S)", |b| b.iter(|| key.verify(&msg, &sig).expect("valid")));
    g.bench_function("k256 bare", |b| b.iter(|| vk.verify(&msg, &rc_sig).expect("valid")));
    g.bench_function("libsecp256k1 (secp256k1 crate)", |b| {
        b.iter(|| {
            let digest: [u8; 32] = sha2::Sha256::digest(&msg).into();
            let m = secp256k1::Message::from_digest(digest);
            secp.verify_ecdsa(m, &compact_sig, &spk).expect("valid");
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
