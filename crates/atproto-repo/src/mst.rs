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

use atproto_data::car::{Car, cid_for};
use atproto_data::cbor::{Reader, Writer};
use atproto_data::cid::Cid;

/// Why a tree could not be inverted to the root a commit names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MstError {
    /// A block the inversion needs is not in the CAR: the proof is incomplete, nothing
    /// is known either way (sync 1.1 calls such commits unproven).
    #[error("the CAR lacks a tree node the inversion needs ({0})")]
    Incomplete(&'static str),
    /// The tree and the ops contradict each other, or a node is not a valid MST node.
    #[error("{0}")]
    Invalid(String),
}

fn invalid(what: impl std::fmt::Display) -> MstError {
    MstError::Invalid(what.to_string())
}

/// One forward op as the commit states it: the key, the value before (`None` for a
/// create) and after (`None` for a delete).
#[derive(Debug, Clone, Copy)]
pub struct Op<'a> {
    /// `collection/rkey`.
    pub key: &'a [u8],
    /// The record CID before the commit.
    pub before: Option<&'a [u8]>,
    /// The record CID after the commit.
    pub after: Option<&'a [u8]>,
}

/// A tree flattened in key order: leaves the CAR holds, and subtrees it does not.
#[derive(Debug, Clone)]
enum Item {
    Leaf {
        key: Vec<u8>,
        value: Vec<u8>,
        height: u32,
    },
    /// A node not in the CAR: its CID and, when known, its layer.
    Stub {
        cid: Vec<u8>,
        layer: Option<u32>,
    },
}

/// A partial tree loaded from a CAR: every node the CAR holds, in key order, with the
/// nodes it lacks kept as opaque stubs.
#[derive(Debug, Clone)]
pub struct Partial {
    items: Vec<Item>,
    /// The root the tree was loaded from (the answer while nothing changed).
    root: Vec<u8>,
    changed: bool,
}

impl Partial {
    /// Loads the tree under `root` from the blocks of `car` (whose blocks the caller has
    /// checked against their CIDs).
    ///
    /// # Errors
    /// `Invalid` for a node that is not a canonical MST node.
    pub fn load(car: &Car<'_>, root: Cid<'_>) -> Result<Self, MstError> {
        let mut items = Vec::new();
        flatten(car, root.as_bytes(), None, &mut items, 0)?;
        Ok(Self { items, root: root.as_bytes().to_vec(), changed: false })
    }

    /// Every leaf (key, record CID) in tree order, when the CAR held the whole tree;
    /// `None` when a subtree is missing (a `getRepo?since=` diff, a truncated CAR).
    #[must_use]
    pub fn leaves(&self) -> Option<Vec<(&[u8], &[u8])>> {
        self.items
            .iter()
            .map(|i| match i {
                Item::Leaf { key, value, .. } => Some((key.as_slice(), value.as_slice())),
                Item::Stub { .. } => None,
            })
            .collect()
    }

    /// Undoes one forward op: a create is removed, an update restored, a delete
    /// re-inserted. The op's `after` must be what the tree holds.
    ///
    /// # Errors
    /// `Incomplete` when the key's place lies in a subtree the CAR lacks; `Invalid` when
    /// the tree contradicts the op.
    pub fn invert(&mut self, op: &Op<'_>) -> Result<(), MstError> {
        let (at, found) = self.find(op.key)?;
        self.changed = true;
        match (found, op.after, op.before) {
            (true, Some(after), before) => {
                let Item::Leaf { value, .. } = &mut self.items[at] else { unreachable!("found a leaf") };
                if value.as_slice() != after {
                    return Err(invalid("an op's record CID is not the one in the tree"));
                }
                match before {
                    Some(b) => b.clone_into(value),
                    None => {
                        self.items.remove(at);
                    }
                }
                Ok(())
            }
            (false, None, Some(before)) => {
                let height = key_height(op.key);
                self.items.insert(at, Item::Leaf { key: op.key.to_vec(), value: before.to_vec(), height });
                Ok(())
            }
            (true, None, _) => Err(invalid("a deleted key is still in the tree")),
            (false, Some(_), _) => Err(invalid("a created or updated key is not in the tree")),
            (false, None, None) => Err(invalid("an op with neither a record nor a previous record")),
        }
    }

    /// Where `key` is (`true`) or would go (`false`) among the items.
    fn find(&self, key: &[u8]) -> Result<(usize, bool), MstError> {
        let mut stub_since_leaf = false;
        for (i, item) in self.items.iter().enumerate() {
            match item {
                Item::Stub { .. } => stub_since_leaf = true,
                Item::Leaf { key: k, .. } => match k.as_slice().cmp(key) {
                    std::cmp::Ordering::Less => stub_since_leaf = false,
                    std::cmp::Ordering::Equal => return Ok((i, true)),
                    std::cmp::Ordering::Greater if stub_since_leaf => return Err(MstError::Incomplete("key")),
                    std::cmp::Ordering::Greater => return Ok((i, false)),
                },
            }
        }
        if stub_since_leaf {
            return Err(MstError::Incomplete("key"));
        }
        Ok((self.items.len(), false))
    }

    /// The root recomputed from the loaded nodes even when nothing changed (re-encoding
    /// every node: tests check the encoder against real trees with it).
    ///
    /// # Errors
    /// As [`Partial::root`].
    pub fn rebuild(&self) -> Result<Vec<u8>, MstError> {
        let mut again = self.clone();
        again.changed = true;
        again.root()
    }

    /// The root CID of the tree as it now stands.
    ///
    /// # Errors
    /// `Incomplete` when the new shape needs a node the CAR lacks (two subtrees to merge,
    /// or a stub whose depth is unknown).
    pub fn root(&self) -> Result<Vec<u8>, MstError> {
        if !self.changed {
            return Ok(self.root.clone());
        }
        let top = self.items.iter().filter_map(|i| match i {
            Item::Leaf { height, .. } => Some(*height),
            Item::Stub { .. } => None,
        });
        let Some(layer) = top.max() else {
            return match self.items.as_slice() {
                [] => Ok(cid_for(&encode(&[], None))),
                _ => Err(MstError::Incomplete("a subtree would become the root")),
            };
        };
        build(&self.items, layer, &mut Vec::new())
    }
}

/// Appends the items under `cid` (a node of `layer`, when known) to `out`; returns the
/// node's layer, when known.
fn flatten(
    car: &Car<'_>,
    cid: &[u8],
    layer: Option<u32>,
    out: &mut Vec<Item>,
    depth: u32,
) -> Result<Option<u32>, MstError> {
    let Some(block) = Cid::from_bytes(cid).ok().and_then(|c| car.get(c)) else {
        out.push(Item::Stub { cid: cid.to_vec(), layer });
        return Ok(layer);
    };
    if depth > 64 {
        return Err(invalid("tree deeper than 64 layers"));
    }
    let node = decode(block)?;
    let own = node.entries.first().map(|e| e.height);
    if let (Some(a), Some(b)) = (own, layer)
        && a != b
    {
        return Err(invalid("a node's keys are not on its layer"));
    }
    let layer = own.or(layer);
    let below = |l: Option<u32>| -> Result<Option<u32>, MstError> {
        match l {
            Some(0) => Err(invalid("a layer-0 node has children")),
            l => Ok(l.map(|l| l - 1)),
        }
    };
    if let Some(l) = node.left {
        let child = flatten(car, l, below(layer)?, out, depth + 1)?;
        if layer.is_none() {
            // A node without entries takes its layer from its child.
            return Ok(child.map(|c| c + 1));
        }
    } else if node.entries.is_empty() && depth > 0 {
        return Err(invalid("an empty node inside the tree"));
    }
    for e in node.entries {
        if e.height != layer.unwrap_or(e.height) {
            return Err(invalid("a node's keys are not all on one layer"));
        }
        let right = e.right;
        out.push(Item::Leaf { key: e.key, value: e.value.to_vec(), height: e.height });
        if let Some(r) = right {
            flatten(car, r, below(layer)?, out, depth + 1)?;
        }
    }
    Ok(layer)
}

/// One decoded node entry: its full key, record CID, right subtree and layer.
pub(crate) struct Entry<'a> {
    pub(crate) key: Vec<u8>,
    pub(crate) value: &'a [u8],
    pub(crate) right: Option<&'a [u8]>,
    pub(crate) height: u32,
}

/// One decoded node: its left subtree and entries.
pub(crate) struct Node<'a> {
    pub(crate) left: Option<&'a [u8]>,
    pub(crate) entries: Vec<Entry<'a>>,
}

/// Decodes one node block (`{e: [{k, p, t, v}], l}`), rebuilding each full key.
pub(crate) fn decode(block: &[u8]) -> Result<Node<'_>, MstError> {
    decode_with(block, true)
}

/// [`decode`], computing each key's height only with `heights` (a tree already verified
/// is walked again without them: a SHA-256 per key).
pub(crate) fn decode_with(block: &[u8], heights: bool) -> Result<Node<'_>, MstError> {
    let bad = |e: atproto_data::CborError| invalid(format!("tree node: {e}"));
    let mut rd = Reader::new(block);
    let fields = rd.map().map_err(bad)?;
    let (mut entries, mut left, mut seen) = (Vec::new(), None, 0u8);
    let mut last = None;
    for _ in 0..fields {
        let field = rd.key(last).map_err(bad)?;
        last = Some(field);
        match field {
            "e" => {
                seen |= 1;
                let count = rd.array().map_err(bad)?;
                let mut prev: Vec<u8> = Vec::new();
                for _ in 0..count {
                    let e = entry(&mut rd, &prev, heights)?;
                    prev.clone_from(&e.key);
                    entries.push(e);
                }
            }
            "l" => {
                seen |= 2;
                left = if rd.null() { None } else { Some(rd.link().map_err(bad)?) };
            }
            _ => return Err(invalid("a tree node with an unknown field")),
        }
    }
    rd.end().map_err(bad)?;
    if seen != 3 {
        return Err(invalid("a tree node without e and l"));
    }
    Ok(Node { left, entries })
}

/// An entry to encode: (key, value, right child).
type NodeEntry<'a> = (&'a [u8], &'a [u8], Option<Vec<u8>>);

/// Decodes one entry (`{k, p, t, v}`), its key rebuilt from the previous key `prev`.
fn entry<'a>(rd: &mut Reader<'a>, prev: &[u8], heights: bool) -> Result<Entry<'a>, MstError> {
    let bad = |e: atproto_data::CborError| invalid(format!("tree entry: {e}"));
    let fields = rd.map().map_err(bad)?;
    let (mut suffix, mut prefix, mut right, mut value) = (None, None, None, None);
    let mut last = None;
    for _ in 0..fields {
        let field = rd.key(last).map_err(bad)?;
        last = Some(field);
        match field {
            "k" => suffix = Some(rd.bytes().map_err(bad)?),
            "p" => prefix = Some(rd.u64().map_err(bad)?),
            "t" => right = Some(if rd.null() { None } else { Some(rd.link().map_err(bad)?) }),
            "v" => value = Some(rd.link().map_err(bad)?),
            _ => return Err(invalid("a tree entry with an unknown field")),
        }
    }
    let (Some(suffix), Some(prefix), Some(right), Some(value)) = (suffix, prefix, right, value) else {
        return Err(invalid("a tree entry without k, p, t and v"));
    };
    let prefix = usize::try_from(prefix)
        .ok()
        .filter(|&p| p <= prev.len())
        .ok_or_else(|| invalid("a key prefix longer than the previous key"))?;
    let mut key = Vec::with_capacity(prefix + suffix.len());
    key.extend_from_slice(&prev[..prefix]);
    key.extend_from_slice(suffix);
    if !prev.is_empty() && (key.as_slice() <= prev || common_prefix_len(prev, &key) != prefix) {
        return Err(invalid("tree keys out of order or not compressed canonically"));
    }
    let height = if heights { key_height(&key) } else { 0 };
    Ok(Entry { key, value, right, height })
}

/// The DAG-CBOR bytes of a node.
fn encode(entries: &[NodeEntry<'_>], left: Option<&[u8]>) -> Vec<u8> {
    let mut w = Writer::new();
    w.map(2).str("e").array(entries.len() as u64);
    let mut prev: &[u8] = &[];
    for (key, value, right) in entries {
        let p = common_prefix_len(prev, key);
        w.map(4).str("k").bytes(&key[p..]).str("p").int(i64::try_from(p).unwrap_or(i64::MAX)).str("t");
        match right {
            Some(r) => w.link(r),
            None => w.null(),
        };
        w.str("v").link(value);
        prev = key;
    }
    w.str("l");
    match left {
        Some(l) => w.link(l),
        None => w.null(),
    };
    w.buf
}

/// The CID of the node of `layer` holding `items` (whose leaves are at most that high);
/// every node encoded on the way is appended to `blocks`.
fn build(items: &[Item], layer: u32, blocks: &mut Vec<Vec<u8>>) -> Result<Vec<u8>, MstError> {
    let mut child = |seg: &[Item]| -> Result<Option<Vec<u8>>, MstError> {
        match seg {
            [] => Ok(None),
            [Item::Stub { cid, layer: Some(l) }] if layer > 0 && *l == layer - 1 => Ok(Some(cid.clone())),
            _ if layer == 0 => Err(MstError::Incomplete("subtrees to merge")),
            _ => build(seg, layer - 1, blocks).map(Some),
        }
    };
    let mut entries = Vec::new();
    let mut start = 0;
    let mut left = None;
    for (i, item) in items.iter().enumerate() {
        match item {
            Item::Leaf { height, .. } if *height > layer => return Err(invalid("a key above its node")),
            Item::Leaf { key, value, height } if *height == layer => {
                let seg = child(&items[start..i])?;
                match entries.last_mut() {
                    Some((_, _, right)) => *right = seg,
                    None => left = seg,
                }
                entries.push((key.as_slice(), value.as_slice(), None));
                start = i + 1;
            }
            Item::Stub { layer: l, .. } if l.is_none_or(|l| l >= layer) => {
                return Err(MstError::Incomplete("subtrees to merge"));
            }
            _ => {}
        }
    }
    let seg = child(&items[start..])?;
    match entries.last_mut() {
        Some((_, _, right)) => *right = seg,
        None => left = seg,
    }
    let bytes = encode(&entries, left.as_deref());
    let cid = cid_for(&bytes);
    blocks.push(bytes);
    Ok(cid)
}

/// Builds a whole tree from its keys and values (in any order): for tests, benchmarks
/// and tools. Returns the root CID and every node block.
#[must_use]
pub fn build_tree(pairs: &[(&[u8], &[u8])]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut items: Vec<Item> =
        pairs.iter().map(|(k, v)| Item::Leaf { key: k.to_vec(), value: v.to_vec(), height: key_height(k) }).collect();
    items.sort_by(|a, b| match (a, b) {
        (Item::Leaf { key: a, .. }, Item::Leaf { key: b, .. }) => a.cmp(b),
        _ => std::cmp::Ordering::Equal,
    });
    let mut blocks = Vec::new();
    let layer = items.iter().filter_map(|i| if let Item::Leaf { height, .. } = i { Some(*height) } else { None }).max();
    let root = build(&items, layer.unwrap_or(0), &mut blocks).expect("a whole tree has no stubs");
    (root, blocks)
}
