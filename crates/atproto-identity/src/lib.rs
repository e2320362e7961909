//! atproto identities, one concern: what a DID document says about a repo — its
//! `#atproto` signing key (every spelling [`atproto_crypto::PublicKey`] reads), its handle
//! (`alsoKnownAs` `at://…`) and its PDS (`#atproto_pds`). Resolution (PLC directory,
//! `did:web`), caching and single-flight are in [`resolver`].

pub mod resolver;

use atproto_crypto::{KeyError, PublicKey};
use serde_json::Value;

/// Why a DID document gives no usable identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocError {
    /// Not a JSON object. The parser's message as text: a document's errors are cached
    /// and cloned with the resolution (`ResolveError` is `Clone`).
    #[error("the DID document is not a JSON object: {0}")]
    Json(String),
    /// The document is another DID's.
    #[error("the DID document is for {found}, not {expected}")]
    IdMismatch {
        /// The DID asked for.
        expected: String,
        /// The `id` the document has.
        found: String,
    },
    /// No `#atproto` verification method.
    #[error("the DID document has no #atproto verification method")]
    NoSigningKey,
    /// The `#atproto` method is of a type atproto does not sign with.
    #[error("the #atproto verification method has unsupported type {0:?}")]
    KeyType(String),
    /// Its key does not read.
    #[error("the #atproto key: {0}")]
    Key(#[from] KeyError),
}

/// What a DID document says about a repo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The DID.
    pub did: String,
    /// The key commits must be signed with.
    pub signing_key: PublicKey,
    /// The first `at://` handle in `alsoKnownAs` (unverified: a handle is only the
    /// repo's claim until its DNS or well-known record says so).
    pub handle: Option<String>,
    /// The `#atproto_pds` service endpoint.
    pub pds: Option<String>,
}

/// True when a method or service `id` names `fragment` of `did` (`#atproto`, or the
/// absolute `did:…#atproto`).
fn names(id: &str, did: &str, fragment: &str) -> bool {
    id == fragment || id.strip_prefix(did).is_some_and(|rest| rest == fragment)
}

/// The items of the array at `key` (none when absent or not an array).
fn entries<'a>(obj: &'a serde_json::Map<String, Value>, key: &str) -> impl Iterator<Item = &'a Value> {
    obj.get(key).and_then(Value::as_array).into_iter().flatten()
}

/// Reads the document `json` served for `did`.
///
/// # Errors
/// When it is not JSON, is another DID's, or has no usable `#atproto` key.
pub fn parse_document(did: &str, json: &[u8]) -> Result<Identity, DocError> {
    let doc: Value = serde_json::from_slice(json).map_err(|e| DocError::Json(e.to_string()))?;
    let Some(obj) = doc.as_object() else { return Err(DocError::Json("not an object".into())) };
    let id = obj.get("id").and_then(Value::as_str).unwrap_or_default();
    if id != did {
        return Err(DocError::IdMismatch { expected: did.to_owned(), found: id.to_owned() });
    }
    let method = entries(obj, "verificationMethod")
        .find(|m| m.get("id").and_then(Value::as_str).is_some_and(|i| names(i, did, "#atproto")))
        .ok_or(DocError::NoSigningKey)?;
    let kind = method.get("type").and_then(Value::as_str).unwrap_or_default();
    let multibase = method.get("publicKeyMultibase").and_then(Value::as_str).unwrap_or_default();
    let signing_key =
        PublicKey::from_verification_method(kind, multibase).ok_or_else(|| DocError::KeyType(kind.to_owned()))??;
    let handle =
        entries(obj, "alsoKnownAs").filter_map(Value::as_str).find_map(|a| a.strip_prefix("at://")).map(str::to_owned);
    let pds = entries(obj, "service")
        .find(|s| s.get("id").and_then(Value::as_str).is_some_and(|i| names(i, did, "#atproto_pds")))
        .and_then(|s| s.get("serviceEndpoint").and_then(Value::as_str))
        .map(str::to_owned);
    Ok(Identity { did: did.to_owned(), signing_key, handle, pds })
}
