//! Fold semantics, as a downstream applies them: a `#commit`'s creates and updates set a
//! record, its deletes remove one; a `#resync` forgets the repo; a `#record` creates one.
//! The result (repo → `collection/rkey` → CID) is what tests compare with the reference
//! record sets.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use sha2::Digest as _;

/// Repo → record path → CID.
pub type Folded = BTreeMap<String, BTreeMap<String, String>>;

/// Applies one event (the `event` of a jsonl line) to `into`.
pub fn apply(into: &mut Folded, e: &serde_json::Value) {
    let repo = e["repo"].as_str().unwrap_or_default().to_owned();
    match e["type"].as_str() {
        Some("#commit") => {
            let records = into.entry(repo).or_default();
            for op in e["ops"].as_array().into_iter().flatten() {
                let path = op["path"].as_str().unwrap_or_default().to_owned();
                match op["action"].as_str() {
                    Some("create" | "update") => {
                        let cid =
                            op["cid"].as_str().or_else(|| op["cid"]["$link"].as_str()).unwrap_or_default().to_owned();
                        records.insert(path, cid);
                    }
                    Some("delete") => {
                        records.remove(&path);
                    }
                    _ => {}
                }
            }
        }
        Some("#resync") => {
            into.insert(repo, BTreeMap::new());
        }
        Some("#record") => {
            let path =
                format!("{}/{}", e["collection"].as_str().unwrap_or_default(), e["rkey"].as_str().unwrap_or_default());
            into.entry(repo).or_default().insert(path, e["cid"].as_str().unwrap_or_default().to_owned());
        }
        _ => {}
    }
}

/// Folds the jsonl sink's output.
///
/// # Panics
/// On a line that is not JSON.
#[must_use]
pub fn jsonl(text: &str) -> Folded {
    let mut f = Folded::new();
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
        apply(&mut f, &v["event"]);
    }
    f
}

/// The digest of one repo's records: sha256 of `"<path> <cid>\n"` lines in path order
/// (as `fixtures/repos/records.digest.json` has it for the reference record sets).
#[must_use]
pub fn digest(records: &BTreeMap<String, String>) -> String {
    let mut lines = String::new();
    for (path, cid) in records {
        let _ = writeln!(lines, "{path} {cid}");
    }
    let d = sha2::Sha256::digest(lines.as_bytes());
    d.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The reference: repo → (record count, digest), from `fixtures/repos/records.digest.json`.
///
/// # Panics
/// When the fixture is missing.
#[must_use]
pub fn reference() -> BTreeMap<String, (u64, String)> {
    let text = std::fs::read_to_string(crate::pds::repos_dir().join("records.digest.json")).expect("digest fixture");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v.as_object()
        .expect("object")
        .iter()
        .map(|(did, r)| {
            (did.clone(), (r["records"].as_u64().expect("records"), r["sha256"].as_str().expect("sha").to_owned()))
        })
        .collect()
}

/// Asserts that `folded` holds `did`'s reference records (their count and digest);
/// `what` names the run in a failure.
///
/// # Panics
/// When it does not, or the fixture is missing.
pub fn assert_repo(folded: &Folded, did: &str, what: &str) {
    let (count, digest) = reference().remove(did).expect("a reference repo");
    let got = folded.get(did).cloned().unwrap_or_default();
    assert_eq!((got.len() as u64, self::digest(&got)), (count, digest), "{what}: {did}: record count and digest");
}

/// Asserts that `folded` holds every reference repo's records ([`assert_repo`]).
///
/// # Panics
/// When it does not, or the fixture is missing.
pub fn assert_reference(folded: &Folded, what: &str) {
    for did in reference().keys() {
        assert_repo(folded, did, what);
    }
}
