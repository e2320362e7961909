//! The tree walk that verifies a whole repo without re-encoding it (`repo::walk_tree`),
//! against the old oracle (load every node, rebuild the tree from its leaves, compare the
//! root) on generated trees: canonical ones, and the same trees bent one way at a time
//! (a root not trimmed, an empty node put in or taken out, an empty subtree, swapped
//! subtrees, a node named with another codec, a subtree cut off, a node missing). Both
//! must accept and refuse the same trees, and give the same keys when they accept.

use std::collections::{BTreeMap, HashMap};

use atproto_data::car::{Car, cid_for};
use atproto_data::cbor::{Reader, Writer};
use atproto_repo::mst::{Partial, build_tree, common_prefix_len};
use atproto_repo::repo::walk_tree;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random_key(rng: &mut StdRng) -> String {
    const COLLECTIONS: [&str; 3] = ["app.bsky.feed.post", "app.bsky.feed.like", "app.bsky.graph.follow"];
    let c = COLLECTIONS[rng.random_range(0..COLLECTIONS.len())];
    let rkey: String =
        (0..rng.random_range(1..14)).map(|_| char::from(b"234567abcdefghij"[rng.random_range(0..16)])).collect();
    format!("{c}/{rkey}")
}

/// A node entry as the test edits it: key, value, right subtree.
type Entry = (Vec<u8>, Vec<u8>, Option<Vec<u8>>);

/// A node as the test edits it: left subtree, entries.
#[derive(Clone)]
struct Node {
    left: Option<Vec<u8>>,
    entries: Vec<Entry>,
}

fn decode(b: &[u8]) -> Node {
    let mut rd = Reader::new(b);
    assert_eq!(rd.map().expect("map"), 2);
    assert_eq!(rd.key(None).expect("e"), "e");
    let n = rd.array().expect("entries");
    let mut entries = Vec::new();
    let mut prev: Vec<u8> = Vec::new();
    for _ in 0..n {
        assert_eq!(rd.map().expect("entry"), 4);
        rd.key(None).expect("k");
        let suffix = rd.bytes().expect("k");
        rd.key(Some("k")).expect("p");
        let p = usize::try_from(rd.u64().expect("p")).expect("p");
        rd.key(Some("p")).expect("t");
        let right = if rd.null() { None } else { Some(rd.link().expect("t").to_vec()) };
        rd.key(Some("t")).expect("v");
        let value = rd.link().expect("v").to_vec();
        let mut key = prev[..p].to_vec();
        key.extend_from_slice(suffix);
        prev.clone_from(&key);
        entries.push((key, value, right));
    }
    rd.key(Some("e")).expect("l");
    let left = if rd.null() { None } else { Some(rd.link().expect("l").to_vec()) };
    Node { left, entries }
}

fn encode(n: &Node) -> Vec<u8> {
    let mut w = Writer::new();
    w.map(2).str("e").array(n.entries.len() as u64);
    let mut prev: &[u8] = &[];
    for (key, value, right) in &n.entries {
        let p = common_prefix_len(prev, key);
        w.map(4).str("k").bytes(&key[p..]).str("p").int(i64::try_from(p).expect("p")).str("t");
        match right {
            Some(r) => w.link(r),
            None => w.null(),
        };
        w.str("v").link(value);
        prev = key;
    }
    w.str("l");
    match &n.left {
        Some(l) => w.link(l),
        None => w.null(),
    };
    w.buf
}

/// The tree's blocks by CID, editable.
struct Tree {
    blocks: HashMap<Vec<u8>, Vec<u8>>,
    root: Vec<u8>,
}

impl Tree {
    fn put(&mut self, n: &Node) -> Vec<u8> {
        let bytes = encode(n);
        let cid = cid_for(&bytes);
        self.blocks.insert(cid.clone(), bytes);
        cid
    }

    fn node(&self, cid: &[u8]) -> Node {
        decode(&self.blocks[cid])
    }

    /// Every (parent CID, which pointer: None = left, Some(i) = entry i's right, child).
    fn pointers(&self) -> Vec<(Vec<u8>, Option<usize>, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![self.root.clone()];
        while let Some(c) = stack.pop() {
            let Some(b) = self.blocks.get(&c) else { continue };
            let n = decode(b);
            if let Some(l) = &n.left {
                out.push((c.clone(), None, l.clone()));
                stack.push(l.clone());
            }
            for (i, (_, _, r)) in n.entries.iter().enumerate() {
                if let Some(r) = r {
                    out.push((c.clone(), Some(i), r.clone()));
                    stack.push(r.clone());
                }
            }
        }
        out
    }

    /// Points `parent`'s pointer `which` at `to`, then every ancestor at its new CID.
    fn repoint(&mut self, parent: &[u8], which: Option<usize>, to: Option<Vec<u8>>) {
        let mut n = self.node(parent);
        match which {
            None => n.left = to,
            Some(i) => n.entries[i].2 = to,
        }
        let new = self.put(&n);
        self.replace(parent, &new);
    }

    /// Replaces the node `old` by `new` wherever it is pointed at (the root included).
    fn replace(&mut self, old: &[u8], new: &[u8]) {
        if self.root == old {
            self.root = new.to_vec();
            return;
        }
        let Some((p, which, _)) = self.pointers().into_iter().find(|(_, _, c)| c == old) else { return };
        self.repoint(&p, which, Some(new.to_vec()));
    }

    fn car(&self) -> Vec<u8> {
        // Each block under the CID the test gave it (not recomputed: the raw-codec bend).
        let blocks: Vec<(Vec<u8>, Vec<u8>)> = self.blocks.iter().map(|(c, b)| (c.clone(), b.clone())).collect();
        testkit::tamper::car_build(&self.root, &blocks)
    }
}

/// The old verdict: every node loaded, the leaves complete and in order, the tree rebuilt
/// from them has the root. `Some(keys)` when accepted.
fn oracle(car: &Car<'_>, root: &[u8]) -> Option<Vec<String>> {
    let tree = Partial::load(car, atproto_data::cid::Cid::from_bytes(root).ok()?).ok()?;
    let leaves = tree.leaves()?;
    let keys: Vec<String> = leaves.iter().map(|(k, _)| String::from_utf8(k.to_vec()).expect("utf-8")).collect();
    if keys.windows(2).any(|w| w[0] >= w[1]) {
        return None;
    }
    (tree.rebuild().ok()? == root).then_some(keys)
}

fn walked(car: &Car<'_>, root: &[u8]) -> Option<Vec<String>> {
    let mut keys = Vec::new();
    walk_tree(car, root, |k, _| {
        keys.push(k.to_owned());
        Ok(())
    })
    .ok()
    .map(|n| {
        assert_eq!(n, keys.len() as u64, "the count is the keys handed over");
        keys
    })
}

/// Bends the tree one way, chosen by `pick`; a name for the failure message.
fn bend(t: &mut Tree, rng: &mut StdRng, pick: u32) -> &'static str {
    let ptrs = t.pointers();
    let any = |rng: &mut StdRng| ptrs.get(rng.random_range(0..ptrs.len().max(1))).cloned();
    match pick {
        0 => {
            let wrap = t.put(&Node { left: Some(t.root.clone()), entries: vec![] });
            t.root = wrap;
            "the root wrapped in an empty node"
        }
        1 => {
            let Some((p, which, child)) = any(rng) else { return "nothing (no subtree)" };
            let mid = t.put(&Node { left: Some(child), entries: vec![] });
            t.repoint(&p, which, Some(mid));
            "an empty node put in"
        }
        2 => {
            let Some((p, which, child)) = ptrs.iter().find(|(_, _, c)| {
                let n = t.node(c);
                n.entries.is_empty() && n.left.is_some()
            }) else {
                return "nothing (no empty node)";
            };
            let below = t.node(child).left;
            t.repoint(p, *which, below);
            "an empty node taken out"
        }
        3 => {
            let Some((p, which, _)) = any(rng) else { return "nothing (no subtree)" };
            let empty = t.put(&Node { left: None, entries: vec![] });
            t.repoint(&p, which, Some(empty));
            "a subtree replaced by an empty node"
        }
        4 => {
            let Some((p, which, _)) = any(rng) else { return "nothing (no subtree)" };
            t.repoint(&p, which, None);
            "a subtree cut off"
        }
        5 => {
            let Some((p, _, _)) = any(rng) else { return "nothing (no subtree)" };
            let mut n = t.node(&p);
            let mut subtrees: Vec<Option<Vec<u8>>> =
                std::iter::once(n.left.clone()).chain(n.entries.iter().map(|e| e.2.clone())).collect();
            if subtrees.iter().flatten().count() < 2 {
                return "nothing (one subtree)";
            }
            subtrees.reverse();
            n.left.clone_from(&subtrees[0]);
            for (e, s) in n.entries.iter_mut().zip(&subtrees[1..]) {
                e.2.clone_from(s);
            }
            let new = t.put(&n);
            t.replace(&p, &new);
            "subtrees swapped"
        }
        6 => {
            let Some((p, which, child)) = any(rng) else { return "nothing (no subtree)" };
            let mut raw = child.clone();
            raw[1] = 0x55;
            let bytes = t.blocks[&child].clone();
            t.blocks.insert(raw.clone(), bytes);
            t.repoint(&p, which, Some(raw));
            "a node named with the raw codec"
        }
        _ => {
            let Some((_, _, child)) = any(rng) else { return "nothing (no subtree)" };
            t.blocks.remove(&child);
            "a node missing"
        }
    }
}

#[test]
fn the_walk_accepts_and_refuses_exactly_the_trees_the_rebuild_does() {
    let seed = std::env::var("FK_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(41);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut refused: BTreeMap<&'static str, u32> = BTreeMap::new();
    for round in 0..600 {
        let size = rng.random_range(0..if round % 10 == 0 { 300 } else { 40 });
        let mut keys: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        while keys.len() < size {
            keys.insert(random_key(&mut rng), cid_for(&rng.random::<u64>().to_be_bytes()));
        }
        let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())).collect();
        let (root, blocks) = build_tree(&pairs);
        let mut t = Tree { blocks: blocks.into_iter().map(|b| (cid_for(&b), b)).collect(), root };
        let pick = rng.random_range(0..8);
        let what = if round % 4 == 0 { "nothing (as built)" } else { bend(&mut t, &mut rng, pick) };
        let bytes = t.car();
        let mut car = Car::parse(&bytes, true).expect("car");
        car.index();
        let (old, new) = (oracle(&car, &t.root), walked(&car, &t.root));
        assert_eq!(new, old, "seed {seed} round {round}: {what}: the walk and the rebuild disagree");
        if what.starts_with("nothing") {
            let want: Vec<String> = keys.keys().cloned().collect();
            assert_eq!(new.as_ref(), Some(&want), "seed {seed} round {round}: a canonical tree");
        } else if new.is_none() {
            *refused.entry(what).or_default() += 1;
        }
    }
    // Every bend that makes a tree non-canonical was met and refused.
    for what in [
        "the root wrapped in an empty node",
        "an empty node put in",
        "an empty node taken out",
        "a subtree replaced by an empty node",
        "subtrees swapped",
        "a node named with the raw codec",
        "a node missing",
    ] {
        assert!(refused.get(what).is_some_and(|n| *n > 0), "{what} never refused: {refused:?}");
    }
}
