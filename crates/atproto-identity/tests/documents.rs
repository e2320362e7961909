//! The signed capture's DID documents, as the reference PLC directory served them (the
//! legacy uncompressed secp256k1 key form): every `#atproto` key reads and is the key the
//! capture lists for that account; a document for another DID, without an `#atproto`
//! key, or with a key type atproto does not sign with, is refused with its reason.

use std::collections::HashMap;

use atproto_identity::{DocError, parse_document};

fn read(name: &str) -> HashMap<String, serde_json::Value> {
    let text = std::fs::read_to_string(testkit::fixture(&format!("signed/{name}"))).expect("fixture");
    serde_json::from_str(&text).expect("JSON")
}

#[test]
fn every_document_of_the_signed_capture_names_its_listed_key() {
    let (docs, keys) = (read("signed-b.did-docs.json"), read("signed-b.signing-keys.json"));
    assert_eq!(docs.len(), 10);
    for (did, doc) in &docs {
        let id = parse_document(did, doc.to_string().as_bytes()).unwrap_or_else(|e| panic!("{did}: {e}"));
        assert_eq!(id.signing_key.to_did_key(), keys[did].as_str().expect("did:key"), "{did}");
        assert!(id.handle.as_deref().is_some_and(|h| h.contains(".test")), "{did}: {:?}", id.handle);
        assert!(id.pds.as_deref().is_some_and(|p| p.starts_with("http")), "{did}: {:?}", id.pds);
    }
}

#[test]
fn unusable_documents_are_refused_with_their_reason() {
    let docs = read("signed-b.did-docs.json");
    let mut it = docs.iter();
    let (did, doc) = it.next().expect("a document");
    let (other, _) = it.next().expect("another");
    let bytes = doc.to_string();
    assert!(matches!(parse_document(other, bytes.as_bytes()), Err(DocError::IdMismatch { .. })));
    let mut no_key = doc.clone();
    no_key["verificationMethod"][0]["id"] = "#other".into();
    assert_eq!(parse_document(did, no_key.to_string().as_bytes()), Err(DocError::NoSigningKey));
    let mut ed = doc.clone();
    ed["verificationMethod"][0]["type"] = "Ed25519VerificationKey2020".into();
    assert!(matches!(parse_document(did, ed.to_string().as_bytes()), Err(DocError::KeyType(_))));
    let mut absolute = doc.clone();
    absolute["verificationMethod"][0]["id"] = format!("{did}#atproto").into();
    assert!(parse_document(did, absolute.to_string().as_bytes()).is_ok(), "the absolute id form reads too");
    let mut garbage = doc.clone();
    garbage["verificationMethod"][0]["publicKeyMultibase"] = "zzzz".into();
    assert!(matches!(parse_document(did, garbage.to_string().as_bytes()), Err(DocError::Key(_))));
    assert!(matches!(parse_document(did, b"[1,2]"), Err(DocError::Json(_))));
    assert!(matches!(parse_document(did, b"not json"), Err(DocError::Json(_))));
}
