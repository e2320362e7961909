//! A fetched repo's blocks, read once front to back (every block hashed against its CID)
//! and indexed by place, so that the tree walks that follow look blocks up without
//! holding them: a body kept in memory is sliced, a body spilled to disk is read by
//! offset. Memory is the index (24 bytes a block), not the repo: a repo of a million
//! records walks in tens of megabytes.

use std::borrow::Cow;
use std::io::Read;
use std::os::unix::fs::FileExt as _;

use atproto_data::DecodeError;
use atproto_data::car::tail;
use atproto_repo::repo::{Blocks, RepoError};
use sha2::Digest as _;

use crate::fetch::Body;

/// The largest block taken (records are at most 1 MiB by the PDS's own limit; tree
/// nodes are small): a larger length is refused before anything is allocated for it.
pub const MAX_BLOCK: u64 = 4 << 20;

/// The largest CAR header taken.
const MAX_HEADER: u64 = 64 << 10;

/// One block's place, in 16 bytes (a million-record repo has 1.3 million blocks): the
/// last 8 bytes of its CID (a SHA-256 digest, so uniform), and where its section (CID,
/// then data) starts (40 bits: 1 TiB) with the section's length (24 bits: past
/// [`MAX_BLOCK`]).
#[derive(Debug, Clone, Copy)]
struct Place {
    tail: u64,
    at_len: u64,
}

impl Place {
    fn new(tail: u64, at: u64, len: u64) -> Self {
        Self { tail, at_len: (at << 24) | (len & 0xff_ffff) }
    }

    fn at(self) -> u64 {
        self.at_len >> 24
    }

    fn len(self) -> usize {
        (self.at_len & 0xff_ffff) as usize
    }
}

/// Where a body may start, at most (the 40 bits of [`Place`]).
const MAX_AT: u64 = 1 << 40;

/// Where the bytes are.
#[derive(Debug)]
enum Store {
    Memory(Vec<u8>),
    /// The spilled body's file, and the body, kept so the file is removed when this is
    /// dropped.
    File {
        file: std::fs::File,
        _body: Body,
    },
}

/// A repo's CAR with every block checked against its CID, and an index of their places.
#[derive(Debug)]
pub struct Indexed {
    store: Store,
    roots: Vec<Vec<u8>>,
    index: Vec<Place>,
    len: u64,
}

fn car(what: impl Into<String>) -> RepoError {
    RepoError::Car(DecodeError::Car(what.into()))
}

/// A varint, or `None` at a clean end of input.
fn varint(r: &mut impl Read, at: &mut u64) -> Result<Option<u64>, RepoError> {
    let mut v: u64 = 0;
    for i in 0..9 {
        let mut b = [0u8; 1];
        match r.read(&mut b).map_err(RepoError::Read)? {
            0 if i == 0 => return Ok(None),
            0 => return Err(car("the CAR ends inside a length")),
            _ => {}
        }
        *at += 1;
        v |= u64::from(b[0] & 0x7f) << (7 * i);
        if b[0] & 0x80 == 0 {
            return Ok(Some(v));
        }
    }
    Err(car("a length varint longer than 9 bytes"))
}

impl Indexed {
    /// Reads `body` (a `getRepo` CAR) front to back: checks every block's CID, notes its
    /// place. A block larger than [`MAX_BLOCK`] or a CAR cut short is refused.
    ///
    /// # Errors
    /// [`RepoError::Car`] for what is not a CAR of valid blocks, [`RepoError::Read`] when
    /// the spilled file cannot be read.
    pub fn open(mut body: Body) -> Result<Self, RepoError> {
        let len = body.len();
        match &mut body {
            Body::Memory(bytes) => {
                let bytes = std::mem::take(bytes);
                let (roots, index) = scan_slice(&bytes)?;
                Ok(Self { store: Store::Memory(bytes), roots, index, len })
            }
            Body::File { path, .. } => {
                let file = std::fs::File::open(&*path).map_err(RepoError::Read)?;
                let (roots, index) = scan(&mut std::io::BufReader::with_capacity(1 << 20, &file))?;
                Ok(Self { store: Store::File { file, _body: body }, roots, index, len })
            }
        }
    }

    /// True when the body is kept in memory (at most the fetch's memory bound).
    #[must_use]
    pub fn in_memory(&self) -> bool {
        matches!(self.store, Store::Memory(_))
    }

    /// The roots the CAR's header names.
    #[must_use]
    pub fn roots(&self) -> &[Vec<u8>] {
        &self.roots
    }

    /// How many blocks.
    #[must_use]
    pub fn blocks(&self) -> usize {
        self.index.len()
    }

    /// The CAR's size in bytes.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty CAR (never one that opened).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The section at `p` (CID then data).
    fn section(&self, p: Place) -> std::io::Result<Cow<'_, [u8]>> {
        match &self.store {
            Store::Memory(b) => {
                let at = usize::try_from(p.at()).unwrap_or(usize::MAX);
                Ok(Cow::Borrowed(&b[at..at + p.len()]))
            }
            Store::File { file: f, .. } => {
                let mut buf = vec![0u8; p.len()];
                f.read_exact_at(&mut buf, p.at())?;
                Ok(Cow::Owned(buf))
            }
        }
    }
}

impl Indexed {
    /// The first place whose tail is not below `t`: a guess from `t`'s share of the
    /// range (tails are uniform), then a search outward from it (a binary search over a
    /// whole repo's index misses the cache at every probe).
    fn first_at_or_after(&self, t: u64) -> usize {
        let ix = &self.index;
        let n = ix.len();
        if n == 0 {
            return 0;
        }
        let guess = usize::try_from((u128::from(t) * n as u128) >> 64).unwrap_or(n - 1).min(n - 1);
        let (mut lo, mut hi) = (guess, guess);
        let mut step = 1;
        if ix[guess].tail < t {
            // The answer is past the guess: widen to the right.
            loop {
                hi = lo + step;
                if hi >= n {
                    hi = n;
                    break;
                }
                if ix[hi].tail >= t {
                    break;
                }
                lo = hi;
                step *= 2;
            }
        } else {
            // The answer is at the guess or before it: widen to the left.
            loop {
                if hi < step {
                    lo = 0;
                    break;
                }
                lo = hi - step;
                if ix[lo].tail < t {
                    break;
                }
                hi = lo;
                step *= 2;
            }
        }
        lo + ix[lo..hi].partition_point(|p| p.tail < t)
    }
}

/// True for bytes that are one whole CID (the one shape atproto uses, checked inline).
fn whole_cid(cid: &[u8]) -> bool {
    (cid.len() == atproto_data::cid::LEN
        && cid[0] == 1
        && matches!(cid[1], 0x71 | 0x55)
        && cid[2] == 0x12
        && cid[3] == 0x20)
        || atproto_data::cid::Cid::from_bytes(cid).is_ok()
}

impl Blocks for Indexed {
    fn block(&self, cid: &[u8]) -> std::io::Result<Option<Cow<'_, [u8]>>> {
        // CIDs are self-delimiting: a section that starts with a whole CID is that
        // block (the scan checked every section's CID and hash).
        if !whole_cid(cid) {
            return Ok(None);
        }
        let t = tail(cid);
        let mut i = self.first_at_or_after(t);
        while let Some(&p) = self.index.get(i).filter(|p| p.tail == t) {
            match self.section(p)? {
                Cow::Borrowed(s) if s.starts_with(cid) => return Ok(Some(Cow::Borrowed(&s[cid.len()..]))),
                Cow::Owned(mut s) if s.starts_with(cid) => {
                    s.drain(..cid.len());
                    return Ok(Some(Cow::Owned(s)));
                }
                _ => i += 1,
            }
        }
        Ok(None)
    }

    /// In memory, the whole CID is compared; on disk, the place is known by its CID's last
    /// 8 bytes without a read (the records are read, and their whole CIDs compared, when
    /// they are rendered: a block that only shares those bytes fails the snapshot then).
    fn has(&self, cid: &[u8]) -> std::io::Result<bool> {
        match self.store {
            Store::Memory(_) => self.block(cid).map(|b| b.is_some()),
            Store::File { .. } => {
                let t = tail(cid);
                Ok(whole_cid(cid) && self.index.get(self.first_at_or_after(t)).is_some_and(|p| p.tail == t))
            }
        }
    }
}

/// Blocks past which a CAR in memory is hashed on two threads.
const PARALLEL: usize = 512;

/// [`scan`] for a CAR in memory: sections sliced in place, and hashed on two threads.
fn scan_slice(b: &[u8]) -> Result<(Vec<Vec<u8>>, Vec<Place>), RepoError> {
    let varint =
        |at: usize| atproto_data::cid::uvarint(&b[at..]).map_err(|_| car(format!("a bad length varint at byte {at}")));
    let (hlen, n) = varint(0)?;
    if hlen > MAX_HEADER || n as u64 + hlen > b.len() as u64 {
        return Err(car("the CAR ends inside its header"));
    }
    let mut at = n + usize::try_from(hlen).unwrap_or(0);
    let roots = roots_of(&b[n..at])?;
    let mut index = Vec::new();
    while at < b.len() {
        let (len, n) = varint(at)?;
        at += n;
        if len > MAX_BLOCK {
            return Err(car(format!("a block of {len} bytes at byte {at} (more than {MAX_BLOCK})")));
        }
        let end = at + usize::try_from(len).unwrap_or(usize::MAX);
        if end > b.len() {
            return Err(car(format!("the block at byte {at} runs past the end")));
        }
        let cl = atproto_data::cid::prefix_len(&b[at..end])
            .map_err(|source| RepoError::Car(DecodeError::Cid { field: "CAR block", source }))?;
        index.push(Place::new(tail(&b[at..at + cl]), at as u64, len));
        at = end;
    }
    let check = |places: &[Place]| -> Result<(), RepoError> {
        for p in places {
            let at = usize::try_from(p.at()).unwrap_or(usize::MAX);
            verify_section(&b[at..at + p.len()])?;
        }
        Ok(())
    };
    if index.len() < PARALLEL {
        check(&index)?;
    } else {
        let (first, second) = index.split_at(index.len() / 2);
        std::thread::scope(|s| {
            let other = s.spawn(|| check(second));
            let mine = check(first);
            match other.join() {
                Ok(r) => mine.and(r),
                Err(p) => std::panic::resume_unwind(p),
            }
        })?;
    }
    index.sort_unstable_by_key(|p| p.tail);
    Ok((roots, index))
}

/// The roots a CAR header names.
fn roots_of(header: &[u8]) -> Result<Vec<Vec<u8>>, RepoError> {
    Ok(atproto_data::car::header_roots(header).map_err(RepoError::Car)?.iter().map(|c| c.as_bytes().to_vec()).collect())
}

/// Checks a section's data against its CID's digest.
fn verify_section(section: &[u8]) -> Result<(), RepoError> {
    let cid_err = |source| RepoError::Car(DecodeError::Cid { field: "CAR block", source });
    let cl = atproto_data::cid::prefix_len(section).map_err(cid_err)?;
    let (cid, data) = section.split_at(cl);
    if cid[cl - 32..] != sha2::Sha256::digest(data)[..] {
        let c = atproto_data::cid::Cid::from_bytes(cid).map_err(cid_err)?;
        return Err(RepoError::Car(DecodeError::BlockHash(c.to_string())));
    }
    Ok(())
}

/// Reads a CAR from `r`: the header's roots and every block's place, sorted by tail.
fn scan(r: &mut impl Read) -> Result<(Vec<Vec<u8>>, Vec<Place>), RepoError> {
    let mut at = 0u64;
    let hlen = varint(r, &mut at)?.ok_or_else(|| car("an empty body"))?;
    if hlen > MAX_HEADER {
        return Err(car(format!("a CAR header of {hlen} bytes")));
    }
    let mut buf = vec![0u8; usize::try_from(hlen).unwrap_or(0)];
    r.read_exact(&mut buf).map_err(|_| car("the CAR ends inside its header"))?;
    at += hlen;
    let roots = roots_of(&buf)?;
    let mut index = Vec::new();
    while let Some(len) = varint(r, &mut at)? {
        if len > MAX_BLOCK {
            return Err(car(format!("a block of {len} bytes at byte {at} (more than {MAX_BLOCK})")));
        }
        buf.resize(usize::try_from(len).unwrap_or(0), 0);
        r.read_exact(&mut buf).map_err(|_| car(format!("the block at byte {at} runs past the end")))?;
        verify_section(&buf)?;
        if at >= MAX_AT {
            return Err(car("a CAR larger than 1 TiB"));
        }
        let cl = atproto_data::cid::prefix_len(&buf).unwrap_or(buf.len());
        index.push(Place::new(tail(&buf[..cl]), at, len));
        at += len;
    }
    index.sort_unstable_by_key(|p| p.tail);
    index.shrink_to_fit();
    Ok((roots, index))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The guessed-then-widened search finds what a binary search finds, for uniform
    /// tails, clustered ones, repeats and both ends of the range.
    #[test]
    fn the_search_from_a_guess_agrees_with_a_binary_search() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..200u64 {
            let n = (next() % 300) as usize;
            let mut tails: Vec<u64> = (0..n)
                .map(|_| match round % 4 {
                    0 => next(),
                    1 => next() % 16,            // clustered at the bottom, repeats
                    2 => u64::MAX - next() % 16, // clustered at the top
                    _ => (next() % 8) << 61,     // a few values, many repeats
                })
                .collect();
            tails.sort_unstable();
            let ix = Indexed {
                store: Store::Memory(Vec::new()),
                roots: Vec::new(),
                index: tails.iter().map(|&t| Place::new(t, 0, 0)).collect(),
                len: 0,
            };
            let probes = tails.iter().copied().chain([0, 1, u64::MAX, u64::MAX - 1]).chain((0..20).map(|_| next()));
            for t in probes {
                assert_eq!(ix.first_at_or_after(t), tails.partition_point(|&x| x < t), "round {round}, tail {t}");
            }
        }
    }
}
