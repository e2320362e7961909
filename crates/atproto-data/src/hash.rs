//! FNV-1a (64 bits): the stable hash that places a repo. It must never change across
//! versions or processes: a repo's lane, its JetStream partition and an event's key are
//! derived from it, and a replay by another leader must land in the same place.

/// The FNV-1a 64-bit offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a over `bytes`, continued from `h` (start from [`FNV_OFFSET`]).
#[must_use]
pub fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

/// FNV-1a of a DID: where its repo goes (a lane, a partition).
#[must_use]
pub fn did_hash(did: &str) -> u64 {
    fnv1a(FNV_OFFSET, did.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published FNV-1a test vectors: the hash must not drift.
    #[test]
    fn matches_the_reference_vectors() {
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(did_hash("foobar"), 0x8594_4171_f739_67e8);
    }
}
