//! atproto's interop vectors (CC0, `fixtures/interop/`): the 6 signature cases (high-S
//! and DER-encoded signatures rejected, on both curves, whichever key spelling) and the
//! did:key vectors (the key derived from each private key spells the listed did:key,
//! and the did:key parses back to it).

use atproto_crypto::{Curve, PublicKey, SignatureError};
use base64::Engine as _;

fn fixture(name: &str) -> serde_json::Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/interop/crypto").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("JSON")
}

fn b64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD_NO_PAD.decode(s.trim_end_matches('=')).expect("base64")
}

#[test]
fn the_signature_vectors_verify_exactly_as_atproto_says() {
    let cases = fixture("signature-fixtures.json");
    let cases = cases.as_array().expect("cases");
    assert_eq!(cases.len(), 6);
    for c in cases {
        let comment = c["comment"].as_str().expect("comment");
        let msg = b64(c["messageBase64"].as_str().expect("message"));
        let sig = b64(c["signatureBase64"].as_str().expect("signature"));
        let from_did = PublicKey::from_did_key(c["publicKeyDid"].as_str().expect("did")).expect(comment);
        let suite = c["didDocSuite"].as_str().expect("suite");
        let from_doc = PublicKey::from_verification_method(suite, c["publicKeyMultibase"].as_str().expect("mb"))
            .expect("a known suite")
            .expect(comment);
        assert_eq!(from_did, from_doc, "{comment}: both spellings are the same key");
        let want_curve = if c["algorithm"] == "ES256K" { Curve::K256 } else { Curve::P256 };
        assert_eq!(from_did.curve(), want_curve, "{comment}");
        let got = from_did.verify(&msg, &sig);
        let valid = c["validSignature"].as_bool().expect("valid");
        assert_eq!(got.is_ok(), valid, "{comment}: {got:?}");
        let tags: Vec<&str> = c["tags"].as_array().expect("tags").iter().filter_map(|t| t.as_str()).collect();
        if tags.contains(&"high-s") {
            assert_eq!(got, Err(SignatureError::HighS), "{comment}");
        }
        if tags.contains(&"der-encoded") {
            assert!(matches!(got, Err(SignatureError::Length(n)) if n != 64), "{comment}: {got:?}");
        }
        if valid {
            let mut flipped = msg.clone();
            flipped[0] ^= 1;
            assert_eq!(from_did.verify(&flipped, &sig), Err(SignatureError::Mismatch), "{comment}: another message");
        }
    }
}

#[test]
fn did_key_vectors_round_trip_on_both_curves() {
    for c in fixture("w3c_didkey_K256.json").as_array().expect("cases") {
        let hex = c["privateKeyBytesHex"].as_str().expect("hex");
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect();
        let sk = k256::ecdsa::SigningKey::from_slice(&bytes).expect("private key");
        let pk =
            PublicKey::from_sec1(Curve::K256, sk.verifying_key().to_encoded_point(true).as_bytes()).expect("a point");
        let did = c["publicDidKey"].as_str().expect("did");
        assert_eq!(pk.to_did_key(), did);
        assert_eq!(PublicKey::from_did_key(did).expect("parses"), pk);
    }
    for c in fixture("w3c_didkey_P256.json").as_array().expect("cases") {
        let bytes = bs58::decode(c["privateKeyBytesBase58"].as_str().expect("b58")).into_vec().expect("base58");
        let sk = p256::ecdsa::SigningKey::from_slice(&bytes).expect("private key");
        let pk = PublicKey::P256(*sk.verifying_key());
        let did = c["publicDidKey"].as_str().expect("did");
        assert_eq!(pk.to_did_key(), did);
        assert_eq!(PublicKey::from_did_key(did).expect("parses"), pk);
    }
}

#[test]
fn uncompressed_legacy_keys_other_suites_and_garbage_are_handled() {
    let did = "did:key:zQ3shokFTS3brHcDQrn82RUDfCZESWL1ZdCEJwekUDPQiYBme";
    let pk = PublicKey::from_did_key(did).expect("key");
    let PublicKey::K256(k) = &pk else { panic!("secp256k1") };
    let uncompressed = k.serialize_uncompressed();
    let legacy = format!("z{}", bs58::encode(uncompressed).into_string());
    let back = PublicKey::from_verification_method("EcdsaSecp256k1VerificationKey2019", &legacy)
        .expect("known")
        .expect("the uncompressed 65-byte form reads");
    assert_eq!(back, pk);
    assert!(PublicKey::from_verification_method("Ed25519VerificationKey2020", &legacy).is_none());
    assert!(PublicKey::from_did_key("did:plc:abc").is_err());
    assert!(PublicKey::from_did_key("did:key:zzzz").is_err());
    assert!(PublicKey::from_did_key("did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK").is_err(), "ed25519");
    assert_eq!(pk.verify(b"x", &[0u8; 64]), Err(SignatureError::Malformed), "zero scalars");
}
