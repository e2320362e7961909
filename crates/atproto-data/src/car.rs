//! A synchronous `CARv1` slice reader: the `blocks` of a commit are already in memory, so
//! blocks are returned as borrowed `(cid, data)` pairs with every length bounds-checked.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::cbor::Reader;
use crate::cid::{self, Cid};
use crate::error::DecodeError;

fn car_err(what: impl Into<String>) -> DecodeError {
    DecodeError::Car(what.into())
}

/// A parsed `CARv1`: the header's roots and an index of its blocks.
#[derive(Debug)]
pub struct Car<'a> {
    /// The roots named by the header.
    pub roots: Vec<Cid<'a>>,
    /// Blocks in file order.
    blocks: Vec<(Cid<'a>, &'a [u8])>,
    /// True once `blocks` is sorted by CID for binary search.
    sorted: bool,
    /// For large CARs once indexed: each block's position by the last 8 bytes of its CID
    /// (a SHA-256 digest, so already uniform); [`SHARED`] where two blocks share them (a
    /// binary search then decides). A binary search over a whole repo's blocks misses the
    /// cache at every probe: this is one look-up.
    by_tail: Option<HashMap<u64, u32, BuildHasherDefault<Tail>>>,
}

/// Blocks past which [`Car::index`] also builds the hash index.
const HASHED: usize = 256;

/// A `by_tail` position shared by two blocks.
const SHARED: u32 = u32::MAX;

/// The hasher of `by_tail`: its keys are digest bytes already.
#[derive(Default)]
struct Tail(u64);

impl std::hash::Hasher for Tail {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// The last 8 bytes of a CID (of its digest): uniform, so a hash key or a position
/// guess as it is.
#[must_use]
pub fn tail(c: &[u8]) -> u64 {
    let mut t = [0u8; 8];
    let n = c.len().min(8);
    t[8 - n..].copy_from_slice(&c[c.len() - n..]);
    u64::from_le_bytes(t)
}

impl<'a> Car<'a> {
    /// Parses a `CARv1` byte slice: header then every block. With `verify`, every block's
    /// sha2-256 is checked against its CID.
    pub fn parse(b: &'a [u8], verify: bool) -> Result<Self, DecodeError> {
        let (hlen, n) = cid::uvarint(b).map_err(|_| car_err("bad header length varint"))?;
        let hend = usize::try_from(hlen)
            .ok()
            .and_then(|h| n.checked_add(h))
            .filter(|&e| e <= b.len())
            .ok_or_else(|| car_err("header length past end"))?;
        let roots = parse_header(&b[n..hend])?;
        let mut blocks = Vec::new();
        let mut at = hend;
        while at < b.len() {
            let (len, n) = cid::uvarint(&b[at..]).map_err(|_| car_err("bad block length varint"))?;
            let start = at + n;
            let end = usize::try_from(len)
                .ok()
                .and_then(|l| start.checked_add(l))
                .filter(|&e| e <= b.len())
                .ok_or_else(|| car_err(format!("block at byte {at} runs past end")))?;
            let section = &b[start..end];
            let clen = cid::prefix_len(section).map_err(|source| DecodeError::Cid { field: "CAR block", source })?;
            let (c, data) = section.split_at(clen);
            let c = Cid::from_bytes(c).map_err(|source| DecodeError::Cid { field: "CAR block", source })?;
            if verify {
                verify_block(c, data)?;
            }
            blocks.push((c, data));
            at = end;
        }
        Ok(Self { roots, blocks, sorted: false, by_tail: None })
    }

    /// Number of blocks.
    #[must_use]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True if the CAR has no blocks.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Prepares for many look-ups: below a handful of blocks a scan is faster than sorting.
    pub fn index(&mut self) {
        if !self.sorted && self.blocks.len() > 8 {
            self.blocks.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            self.sorted = true;
        }
        if self.by_tail.is_none() && self.blocks.len() > HASHED {
            let mut m = HashMap::with_capacity_and_hasher(self.blocks.len(), BuildHasherDefault::<Tail>::default());
            for (i, (c, _)) in self.blocks.iter().enumerate() {
                let at = u32::try_from(i).unwrap_or(SHARED);
                m.entry(tail(c.as_bytes())).and_modify(|v| *v = SHARED).or_insert(at);
            }
            self.by_tail = Some(m);
        }
    }

    /// The data of the block with this CID, if present.
    #[must_use]
    pub fn get(&self, c: Cid<'_>) -> Option<&'a [u8]> {
        if let Some(m) = &self.by_tail {
            match m.get(&tail(c.as_bytes())) {
                None => return None,
                Some(&SHARED) => {}
                Some(&i) => {
                    let (k, d) = self.blocks[i as usize];
                    return (k.as_bytes() == c.as_bytes()).then_some(d);
                }
            }
        }
        if self.sorted {
            self.blocks.binary_search_by(|(k, _)| k.as_bytes().cmp(c.as_bytes())).ok().map(|i| self.blocks[i].1)
        } else {
            self.blocks.iter().find(|(k, _)| k.as_bytes() == c.as_bytes()).map(|(_, d)| *d)
        }
    }

    /// Iterates over the blocks (in file order unless [`Car::index`] sorted them).
    pub fn blocks(&self) -> impl Iterator<Item = (Cid<'a>, &'a [u8])> + '_ {
        self.blocks.iter().copied()
    }
}

/// The roots a `CARv1` header (the DAG-CBOR map after the length varint) names; for
/// readers that take a CAR a block at a time (a repo spilled to disk).
///
/// # Errors
/// A header that is not a version 1 CAR header with roots.
pub fn header_roots(bytes: &[u8]) -> Result<Vec<Cid<'_>>, DecodeError> {
    parse_header(bytes)
}

fn parse_header(bytes: &[u8]) -> Result<Vec<Cid<'_>>, DecodeError> {
    let cb = |source| DecodeError::Cbor { part: "car header", source };
    let mut rd = Reader::new(bytes);
    let entries = rd.map().map_err(cb)?;
    let mut roots = None;
    let mut version = None;
    let mut prev = None;
    for _ in 0..entries {
        let key = rd.key(prev).map_err(cb)?;
        prev = Some(key);
        match key {
            "roots" => {
                let len = rd.array().map_err(cb)?;
                let mut v = Vec::with_capacity(len.min(16) as usize);
                for _ in 0..len {
                    let c = rd.link().map_err(cb)?;
                    v.push(Cid::from_bytes(c).map_err(|source| DecodeError::Cid { field: "CAR root", source })?);
                }
                roots = Some(v);
            }
            "version" => version = Some(rd.u64().map_err(cb)?),
            _ => rd.skip().map_err(cb)?,
        }
    }
    rd.end().map_err(cb)?;
    match version {
        Some(1) => {}
        Some(v) => return Err(car_err(format!("CAR version {v} is not 1"))),
        None => return Err(car_err("CAR header without version")),
    }
    roots.ok_or_else(|| car_err("CAR header without roots"))
}

fn verify_block(c: Cid<'_>, data: &[u8]) -> Result<(), DecodeError> {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(data);
    let bytes = c.as_bytes();
    if bytes[bytes.len() - 32..] == digest[..] { Ok(()) } else { Err(DecodeError::BlockHash(c.to_string())) }
}

/// Builds a `CARv1` from blocks, computing each block's CID (dag-cbor, sha2-256). For tests,
/// benches and `relay-sim`.
#[must_use]
pub fn build(roots: &[Vec<u8>], blocks: &[Vec<u8>]) -> Vec<u8> {
    let mut h = crate::cbor::Writer::new();
    h.map(2).str("roots").array(roots.len() as u64);
    for r in roots {
        h.link(r);
    }
    h.str("version").int(1);
    let mut out = Vec::new();
    push_varint(&mut out, h.buf.len() as u64);
    out.extend_from_slice(&h.buf);
    for b in blocks {
        let c = cid_for(b);
        push_varint(&mut out, (c.len() + b.len()) as u64);
        out.extend_from_slice(&c);
        out.extend_from_slice(b);
    }
    out
}

/// The dag-cbor sha2-256 `CIDv1` bytes of `data`.
#[must_use]
pub fn cid_for(data: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    let mut c = vec![1, 0x71, 0x12, 0x20];
    c.extend_from_slice(&sha2::Sha256::digest(data));
    c
}

/// Appends an unsigned LEB128 varint.
pub fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(text: &str) -> Vec<u8> {
        let mut w = crate::cbor::Writer::new();
        w.map(1).str("text").str(text);
        w.buf
    }

    #[test]
    fn roundtrip_and_lookup() {
        let blocks: Vec<_> = (0..20).map(|i| rec(&format!("r{i}"))).collect();
        let car = build(&[cid_for(&blocks[0])], &blocks);
        let mut c = Car::parse(&car, true).expect("valid car");
        assert_eq!(c.len(), 20);
        c.index();
        for b in &blocks {
            let id = cid_for(b);
            assert_eq!(c.get(Cid::from_bytes(&id).expect("cid")), Some(&b[..]));
        }
        let missing = cid_for(b"nope");
        assert_eq!(c.get(Cid::from_bytes(&missing).expect("cid")), None);
    }

    /// Past `HASHED` blocks the index is a hash of each CID's last 8 bytes: every block is
    /// found, an absent CID is not (also one that shares a present one's last 8 bytes), and
    /// two blocks sharing them are both found (by the binary search).
    #[test]
    fn a_large_index_finds_every_block_and_only_those() {
        let blocks: Vec<_> = (0..HASHED + 40).map(|i| rec(&format!("r{i}"))).collect();
        let mut cids: Vec<Vec<u8>> = blocks.iter().map(|b| cid_for(b)).collect();
        // Two CIDs that share their last 8 bytes (not real hashes: parsed without checks).
        let shared = cids[0][28..].to_vec();
        cids[1][28..].copy_from_slice(&shared);
        let mut car = build(&[cids[0].clone()], &[]);
        for (c, b) in cids.iter().zip(&blocks) {
            push_varint(&mut car, (c.len() + b.len()) as u64);
            car.extend_from_slice(c);
            car.extend_from_slice(b);
        }
        let mut c = Car::parse(&car, false).expect("valid car");
        c.index();
        assert!(c.by_tail.is_some(), "hashed");
        for (id, b) in cids.iter().zip(&blocks) {
            assert_eq!(c.get(Cid::from_bytes(id).expect("cid")), Some(&b[..]));
        }
        let mut absent = cids[2].clone();
        absent[5] ^= 1;
        assert_eq!(c.get(Cid::from_bytes(&absent).expect("cid")), None, "same last 8 bytes, another CID");
        assert_eq!(c.get(Cid::from_bytes(&cid_for(b"nope")).expect("cid")), None);
    }

    #[test]
    fn corrupt_cars_are_errors() {
        let blocks = vec![rec("a")];
        let car = build(&[cid_for(&blocks[0])], &blocks);
        for cut in 0..car.len() {
            // Every strict prefix but the header-only one is malformed.
            let r = Car::parse(&car[..cut], false);
            if r.is_ok() {
                assert!(cut >= 1 && Car::parse(&car[..cut], false).expect("ok").is_empty());
            }
        }
        let mut tampered = car.clone();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        assert!(Car::parse(&tampered, false).is_ok());
        assert!(matches!(Car::parse(&tampered, true), Err(DecodeError::BlockHash(_))));
    }
}
