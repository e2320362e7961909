//! CIDs as atproto uses them: `CIDv1`, codec dag-cbor (0x71) or raw (0x55), sha2-256.
//!
//! A CID is kept as its raw bytes (borrowed from the frame); it is turned into its
//! base32 string form only when written out.

use std::fmt;

use crate::error::CidError;

/// Multicodec code of DAG-CBOR.
pub const DAG_CBOR: u64 = 0x71;
/// Multicodec code of raw bytes (blobs).
pub const RAW: u64 = 0x55;
/// Multihash code of sha2-256.
pub const SHA2_256: u64 = 0x12;
/// Length in bytes of an atproto CID: version, codec, hash code, digest length, digest.
pub const LEN: usize = 4 + 32;

/// Reads an unsigned LEB128 varint of at most 9 bytes, rejecting non-minimal forms.
/// Returns the value and the number of bytes read.
pub fn uvarint(b: &[u8]) -> Result<(u64, usize), CidError> {
    let mut v: u64 = 0;
    for (i, &byte) in b.iter().enumerate().take(9) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            if byte == 0 && i > 0 {
                return Err(CidError::Varint);
            }
            return Ok((v, i + 1));
        }
    }
    Err(CidError::Varint)
}

/// Parses the CID at the start of `b` and returns its length in bytes.
pub fn prefix_len(b: &[u8]) -> Result<usize, CidError> {
    // Fast path: the one shape atproto uses, 0x01 0x71|0x55 0x12 0x20 + 32 bytes.
    if b.len() >= LEN && b[0] == 1 && (b[1] == 0x71 || b[1] == 0x55) && b[2] == 0x12 && b[3] == 0x20 {
        return Ok(LEN);
    }
    let mut at = 0;
    let (version, n) = uvarint(b)?;
    at += n;
    if version != 1 {
        return Err(CidError::Version(version));
    }
    let (codec, n) = uvarint(&b[at..])?;
    at += n;
    if codec != DAG_CBOR && codec != RAW {
        return Err(CidError::Codec(codec));
    }
    let (hash, n) = uvarint(&b[at..])?;
    at += n;
    if hash != SHA2_256 {
        return Err(CidError::Hash(hash));
    }
    let (len, n) = uvarint(&b[at..])?;
    at += n;
    if len != 32 {
        return Err(CidError::DigestLength(len));
    }
    if b.len() < at + 32 {
        return Err(CidError::Truncated);
    }
    Ok(at + 32)
}

/// Checks that `b` is exactly one valid atproto CID.
pub fn check(b: &[u8]) -> Result<(), CidError> {
    if prefix_len(b)? == b.len() { Ok(()) } else { Err(CidError::TrailingBytes) }
}

/// A borrowed, validated CID.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cid<'a>(&'a [u8]);

impl<'a> Cid<'a> {
    /// Validates raw CID bytes.
    pub fn from_bytes(b: &'a [u8]) -> Result<Self, CidError> {
        check(b)?;
        Ok(Self(b))
    }

    /// The raw bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &'a [u8] {
        self.0
    }

    /// Appends the multibase base32 (`b…`) string form to `out`.
    pub fn write_str(&self, out: &mut String) {
        out.push('b');
        base32_lower(self.0, out);
    }

    /// The multibase base32 string form.
    #[must_use]
    pub fn to_string_b32(&self) -> String {
        let mut s = String::with_capacity(1 + self.0.len() * 8 / 5 + 1);
        self.write_str(&mut s);
        s
    }
}

impl fmt::Display for Cid<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_string_b32())
    }
}

impl fmt::Debug for Cid<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cid({self})")
    }
}

/// RFC 4648 base32, lower case, no padding (multibase `b`): five bytes become eight
/// letters, gathered on the stack and appended at once.
pub fn base32_lower(data: &[u8], out: &mut String) {
    const ALPHA: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    out.reserve(data.len().div_ceil(5) * 8);
    let mut buf = [0u8; 64];
    for group in data.chunks(40) {
        let mut n = 0;
        let mut chunks = group.chunks_exact(5);
        for c in &mut chunks {
            let v = u64::from_be_bytes([0, 0, 0, c[0], c[1], c[2], c[3], c[4]]);
            for k in 0..8 {
                buf[n + k] = ALPHA[((v >> (35 - 5 * k)) & 31) as usize];
            }
            n += 8;
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut five = [0u8; 8];
            five[3..3 + rest.len()].copy_from_slice(rest);
            let v = u64::from_be_bytes(five);
            for k in 0..(rest.len() * 8).div_ceil(5) {
                buf[n] = ALPHA[((v >> (35 - 5 * k)) & 31) as usize];
                n += 1;
            }
        }
        // Every letter is ASCII.
        out.push_str(std::str::from_utf8(&buf[..n]).unwrap_or_default());
    }
}

/// RFC 4648 base64, standard alphabet, no padding (the atproto `$bytes` form).
pub fn base64_std(data: &[u8], out: &mut String) {
    const ALPHA: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut chunks = data.chunks_exact(3);
    for c in &mut chunks {
        let n = (u32::from(c[0]) << 16) | (u32::from(c[1]) << 8) | u32::from(c[2]);
        for shift in [18, 12, 6, 0] {
            out.push(ALPHA[((n >> shift) & 63) as usize] as char);
        }
    }
    match *chunks.remainder() {
        [a] => {
            let n = u32::from(a) << 16;
            out.push(ALPHA[((n >> 18) & 63) as usize] as char);
            out.push(ALPHA[((n >> 12) & 63) as usize] as char);
        }
        [a, b] => {
            let n = (u32::from(a) << 16) | (u32::from(b) << 8);
            out.push(ALPHA[((n >> 18) & 63) as usize] as char);
            out.push(ALPHA[((n >> 12) & 63) as usize] as char);
            out.push(ALPHA[((n >> 6) & 63) as usize] as char);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_and_base64_vectors() {
        // RFC 4648 test vectors.
        for (i, want) in ["", "my", "mzxq", "mzxw6", "mzxw6yq", "mzxw6ytb", "mzxw6ytboi"].iter().enumerate() {
            let mut s = String::new();
            base32_lower(&b"foobar"[..i], &mut s);
            assert_eq!(&s, want);
        }
        for (i, want) in ["", "Zg", "Zm8", "Zm9v", "Zm9vYg", "Zm9vYmE", "Zm9vYmFy"].iter().enumerate() {
            let mut s = String::new();
            base64_std(&b"foobar"[..i], &mut s);
            assert_eq!(&s, want);
        }
    }

    /// The bit-at-a-time form of base32, to check the five-byte groups against.
    fn base32_bitwise(data: &[u8]) -> String {
        const ALPHA: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
        let (mut acc, mut bits, mut s) = (0u64, 0u32, String::new());
        for &b in data {
            acc = (acc << 8) | u64::from(b);
            bits += 8;
            while bits >= 5 {
                bits -= 5;
                s.push(char::from(ALPHA[((acc >> bits) & 31) as usize]));
            }
        }
        if bits > 0 {
            s.push(char::from(ALPHA[((acc << (5 - bits)) & 31) as usize]));
        }
        s
    }

    #[test]
    fn base32_groups_match_the_bitwise_form_at_every_length() {
        let data: Vec<u8> = (0..200u32).map(|i| (i.wrapping_mul(151) ^ (i >> 3)) as u8).collect();
        for len in 0..data.len() {
            let mut s = String::from("x");
            base32_lower(&data[..len], &mut s);
            assert_eq!(s[1..], base32_bitwise(&data[..len]), "length {len}");
        }
    }

    #[test]
    fn rejects_other_cids() {
        let mut good = vec![1, 0x71, 0x12, 0x20];
        good.extend([7u8; 32]);
        assert!(check(&good).is_ok());
        let mut v0 = good.clone();
        v0[0] = 0;
        assert_eq!(check(&v0), Err(CidError::Version(0)));
        let mut pb = good.clone();
        pb[1] = 0x70;
        assert_eq!(check(&pb), Err(CidError::Codec(0x70)));
        let mut blake = good.clone();
        blake[2] = 0x13;
        assert_eq!(check(&blake), Err(CidError::Hash(0x13)));
        assert_eq!(check(&good[..20]), Err(CidError::Truncated));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(check(&long), Err(CidError::TrailingBytes));
        assert_eq!(uvarint(&[0x80, 0x00]), Err(CidError::Varint));
        assert_eq!(uvarint(&[0xff; 10]), Err(CidError::Varint));
        assert_eq!(uvarint(&[0xac, 0x02]), Ok((300, 2)));
    }
}
