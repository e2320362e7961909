//! Merkle search tree basics (the repo's key → record CID map): which layer a key lives
//! on and how node entries compress keys against their predecessor. MST inversion (sync
//! 1.1) builds on these.

use sha2::Digest as _;

/// The layer of `key`: leading zero bits of its SHA-256, counted two at a time (a fanout
/// of 4).
#[must_use]
pub fn key_height(key: &[u8]) -> u32 {
    let digest = sha2::Sha256::digest(key);
    let mut zeros = 0;
    for b in digest {
        if b == 0 {
            zeros += 8;
            continue;
        }
        zeros += b.leading_zeros();
        break;
    }
    zeros / 2
}

/// How many leading bytes `a` and `b` share (node entries store a key as this prefix
/// length of the previous key plus the rest).
#[must_use]
pub fn common_prefix_len(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
