//! atproto signing keys, one concern: read the `#atproto` key a DID document names and
//! check a signature the way atproto requires.
//!
//! Keys come in three spellings, all parsed here:
//! - `did:key:z…` and `Multikey` `publicKeyMultibase` (`z` + base58btc of a multicodec
//!   prefix and the compressed SEC1 point: `0xe7` secp256k1, `zQ3sh…`; `0x1200` P-256,
//!   `zDn…`);
//! - the legacy `EcdsaSecp256k1VerificationKey2019` / `EcdsaSecp256r1VerificationKey2019`
//!   suites, whose `publicKeyMultibase` is the raw SEC1 key (compressed, or the
//!   uncompressed 65-byte form some directories still serve).
//!
//! A signature is valid only as atproto defines it: 64 bytes of compact `r‖s` (DER is
//! refused), **low-S** on both curves (the `RustCrypto` `p256` verifier accepts a high-S
//! signature, so the check is made here for both), over the SHA-256 of the message.

use p256::ecdsa::signature::Verifier as _;

/// The multicodec varint of a secp256k1 public key (`0xe7`).
const SECP256K1_PUB: [u8; 2] = [0xe7, 0x01];
/// The multicodec varint of a P-256 public key (`0x1200`).
const P256_PUB: [u8; 2] = [0x80, 0x24];

/// The two curves atproto signs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Curve {
    /// secp256k1 (`ES256K`).
    K256,
    /// NIST P-256 (`ES256`).
    P256,
}

/// Why a key could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not `did:key:z…`.
    #[error("not a did:key (did:key:z…)")]
    NotDidKey,
    /// Not `z` + base58btc.
    #[error("not a base58btc multibase string (z…)")]
    Multibase,
    /// A multicodec prefix other than secp256k1 or P-256.
    #[error("unsupported key type (multicodec prefix {0:02x?})")]
    Codec(Vec<u8>),
    /// The bytes are not a point on the curve.
    #[error("not a valid {curve:?} public key ({len} bytes)")]
    Point {
        /// The curve tried.
        curve: Curve,
        /// How many key bytes there were.
        len: usize,
    },
}

/// Why a signature is not valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// Not 64 bytes of compact `r‖s` (a DER signature is one of these).
    #[error("a signature is 64 bytes of compact r||s, not {0} (DER is not accepted)")]
    Length(usize),
    /// `r` or `s` out of range.
    #[error("signature scalars out of range")]
    Malformed,
    /// `s` in the upper half of the order: malleable, refused by atproto.
    #[error("high-S signature (atproto requires low-S)")]
    HighS,
    /// Does not verify against the key.
    #[error("signature does not verify against the key")]
    Mismatch,
}

/// The verification-only libsecp256k1 context, made once.
static SECP: std::sync::LazyLock<secp256k1::Secp256k1<secp256k1::VerifyOnly>> =
    std::sync::LazyLock::new(secp256k1::Secp256k1::verification_only);

/// A public key atproto can sign commits with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublicKey {
    /// secp256k1 (verified with libsecp256k1: 3x the `RustCrypto` `k256` speed here, see
    /// docs/PERFORMANCE.md).
    K256(secp256k1::PublicKey),
    /// P-256.
    P256(p256::ecdsa::VerifyingKey),
}

fn base58btc(multibase: &str) -> Result<Vec<u8>, KeyError> {
    let body = multibase.strip_prefix('z').ok_or(KeyError::Multibase)?;
    bs58::decode(body).into_vec().map_err(|_| KeyError::Multibase)
}

use sha2::Digest as _;

impl PublicKey {
    /// A SEC1 point (compressed 33 bytes or uncompressed 65) on `curve`.
    ///
    /// # Errors
    /// When the bytes are not a point on the curve.
    pub fn from_sec1(curve: Curve, bytes: &[u8]) -> Result<Self, KeyError> {
        let bad = KeyError::Point { curve, len: bytes.len() };
        match curve {
            Curve::K256 => secp256k1::PublicKey::from_slice(bytes).map(Self::K256).map_err(|_| bad),
            Curve::P256 => p256::ecdsa::VerifyingKey::from_sec1_bytes(bytes).map(Self::P256).map_err(|_| bad),
        }
    }

    /// A `Multikey` `publicKeyMultibase` (or the part of a did:key after `did:key:`).
    ///
    /// # Errors
    /// When it is not base58btc, names another key type, or is not a point.
    pub fn from_multikey(multibase: &str) -> Result<Self, KeyError> {
        let bytes = base58btc(multibase)?;
        let (curve, key) = match bytes.split_at_checked(2) {
            Some((p, k)) if p == SECP256K1_PUB => (Curve::K256, k),
            Some((p, k)) if p == P256_PUB => (Curve::P256, k),
            _ => return Err(KeyError::Codec(bytes.iter().take(2).copied().collect())),
        };
        Self::from_sec1(curve, key)
    }

    /// A `did:key:z…`.
    ///
    /// # Errors
    /// As [`PublicKey::from_multikey`], or when it is not a did:key.
    pub fn from_did_key(did: &str) -> Result<Self, KeyError> {
        Self::from_multikey(did.strip_prefix("did:key:").ok_or(KeyError::NotDidKey)?)
    }

    /// A legacy `EcdsaSecp256k1VerificationKey2019` / `EcdsaSecp256r1VerificationKey2019`
    /// `publicKeyMultibase`: the raw SEC1 key, compressed or uncompressed.
    ///
    /// # Errors
    /// When it is not base58btc or not a point on `curve`.
    pub fn from_legacy_multibase(curve: Curve, multibase: &str) -> Result<Self, KeyError> {
        Self::from_sec1(curve, &base58btc(multibase)?)
    }

    /// A verification method as a DID document spells it: its `type` and
    /// `publicKeyMultibase`. `None` for a type that is not an atproto key suite.
    ///
    /// # Errors
    /// When the key of a known suite cannot be read.
    #[must_use]
    pub fn from_verification_method(kind: &str, multibase: &str) -> Option<Result<Self, KeyError>> {
        Some(match kind {
            "Multikey" => Self::from_multikey(multibase),
            "EcdsaSecp256k1VerificationKey2019" => Self::from_legacy_multibase(Curve::K256, multibase),
            "EcdsaSecp256r1VerificationKey2019" => Self::from_legacy_multibase(Curve::P256, multibase),
            _ => return None,
        })
    }

    /// The key's curve.
    #[must_use]
    pub fn curve(&self) -> Curve {
        match self {
            Self::K256(_) => Curve::K256,
            Self::P256(_) => Curve::P256,
        }
    }

    /// The compressed SEC1 point (33 bytes).
    #[must_use]
    pub fn to_compressed(&self) -> Vec<u8> {
        match self {
            Self::K256(k) => k.serialize().to_vec(),
            Self::P256(k) => k.to_encoded_point(true).as_bytes().to_vec(),
        }
    }

    /// The key as `did:key:z…`.
    #[must_use]
    pub fn to_did_key(&self) -> String {
        let prefix = match self.curve() {
            Curve::K256 => SECP256K1_PUB,
            Curve::P256 => P256_PUB,
        };
        let mut bytes = prefix.to_vec();
        bytes.extend_from_slice(&self.to_compressed());
        format!("did:key:z{}", bs58::encode(bytes).into_string())
    }

    /// Checks `sig` over `message` (hashed with SHA-256 here) as atproto requires:
    /// 64-byte compact `r‖s`, low-S, valid for this key.
    ///
    /// # Errors
    /// Why the signature is not valid.
    pub fn verify(&self, message: &[u8], sig: &[u8]) -> Result<(), SignatureError> {
        if sig.len() != 64 {
            return Err(SignatureError::Length(sig.len()));
        }
        match self {
            Self::K256(k) => {
                // libsecp256k1 parses zero scalars (and then fails them): name them here.
                if sig[..32].iter().all(|&b| b == 0) || sig[32..].iter().all(|&b| b == 0) {
                    return Err(SignatureError::Malformed);
                }
                let s = secp256k1::ecdsa::Signature::from_compact(sig).map_err(|_| SignatureError::Malformed)?;
                let mut low = s;
                low.normalize_s();
                if low != s {
                    return Err(SignatureError::HighS);
                }
                let digest: [u8; 32] = sha2::Sha256::digest(message).into();
                SECP.verify_ecdsa(secp256k1::Message::from_digest(digest), &s, k).map_err(|_| SignatureError::Mismatch)
            }
            Self::P256(k) => {
                let s = p256::ecdsa::Signature::from_slice(sig).map_err(|_| SignatureError::Malformed)?;
                if s.normalize_s().is_some() {
                    return Err(SignatureError::HighS);
                }
                k.verify(message, &s).map_err(|_| SignatureError::Mismatch)
            }
        }
    }
}
