//! Per-repo chain checks (sync 1.1): a `#commit`'s `since` names the rev of the repo's
//! previous commit, so a `since` that differs from the last rev seen for that repo means
//! the relay dropped a commit of it. Downstream then has to resync that repo.
//!
//! The memory is bounded: repos are remembered in two generations of at most half the
//! capacity each (a repo seen in the older one moves to the newer; when the newer fills,
//! the older is forgotten). A repo stays remembered at least until `capacity / 2` other
//! repos were seen after it. Each entry is 16 bytes of table (a 64-bit keyed hash of the
//! DID and the rev as its 64-bit TID value): see docs/PERFORMANCE.md for the figures.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};

use relay_client::json::write_str;

/// What to do with a broken chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChainBreaks {
    /// Count it (`firekeeper_repo_chain_breaks_total`) and log it.
    #[default]
    Count,
    /// Also hand it to the handler, on the commit that revealed it
    /// ([`crate::Event::chain_break`]); the built-in sinks write it as a `#chain-break`
    /// event before that commit.
    Emit,
}

/// A repo whose commit chain broke: the relay skipped at least one of its commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// The repo's DID.
    pub repo: String,
    /// The last rev seen for the repo.
    pub last_rev: String,
    /// The `since` of the commit that revealed the break (the rev it builds on).
    pub since: String,
    /// That commit's own rev.
    pub rev: String,
}

impl ChainBreak {
    /// Appends the break as a `#chain-break` event in JSON, shaped like the relay's events:
    /// `{"seq","type":"#chain-break","repo","lastRev","since","rev"}`, where `seq` is that
    /// of the commit that revealed it.
    pub fn write_json(&self, seq: u64, out: &mut String) {
        use std::fmt::Write as _;
        let _ = write!(out, "{{\"seq\":{seq},\"type\":\"#chain-break\",\"repo\":");
        write_str(&self.repo, out);
        out.push_str(",\"lastRev\":");
        write_str(&self.last_rev, out);
        out.push_str(",\"since\":");
        write_str(&self.since, out);
        out.push_str(",\"rev\":");
        write_str(&self.rev, out);
        out.push('}');
    }
}

/// Counts and logs a broken chain found at `seq` on `relay`.
pub(crate) fn report(b: &ChainBreak, seq: u64, relay: &str) {
    metrics::counter!(crate::metrics::CHAIN_BREAKS).increment(1);
    tracing::warn!(
        seq,
        relay,
        repo = %b.repo,
        last_rev = %b.last_rev,
        since = %b.since,
        rev = %b.rev,
        "repo chain broken: the relay skipped a commit of this repo; resync it"
    );
}

pub(crate) use atproto_data::tid::{parse as tid, to_string as tid_string};

/// Keys are already hashes: the table uses them as they are.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Values by 64-bit key hash in two generations of at most `half` entries each: a key
/// found in the older one moves to the newer; when the newer fills, the older is
/// forgotten. Shared by the chain check and the verifier's per-lane chains.
pub(crate) struct Generations<V> {
    half: usize,
    young: HashMap<u64, V, BuildHasherDefault<Identity>>,
    old: HashMap<u64, V, BuildHasherDefault<Identity>>,
}

impl<V: Copy> Generations<V> {
    /// At most `capacity` entries (at least 2).
    pub(crate) fn new(capacity: usize) -> Self {
        Self { half: (capacity / 2).max(1), young: HashMap::default(), old: HashMap::default() }
    }

    /// The value of `key`, moved to the newer generation.
    pub(crate) fn get(&mut self, key: u64) -> Option<V> {
        if let Some(v) = self.young.get(&key) {
            return Some(*v);
        }
        let v = self.old.remove(&key)?;
        self.put(key, v);
        Some(v)
    }

    /// The value of `key`, where it stands.
    pub(crate) fn peek(&self, key: u64) -> Option<V> {
        self.young.get(&key).or_else(|| self.old.get(&key)).copied()
    }

    pub(crate) fn put(&mut self, key: u64, v: V) {
        if self.young.len() >= self.half && !self.young.contains_key(&key) {
            // The older generation goes; its table (already grown) becomes the newer one.
            self.old.clear();
            std::mem::swap(&mut self.young, &mut self.old);
        }
        self.young.insert(key, v);
    }

    pub(crate) fn remove(&mut self, key: u64) {
        self.young.remove(&key);
        self.old.remove(&key);
    }

    pub(crate) fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }
}

/// The last rev seen per recent repo: the chain check the work loop runs on every
/// `#commit` and `#sync` (public for benchmarks and for checking a stream read elsewhere).
pub struct Chains {
    revs: Generations<u64>,
    keys: RandomState,
}

impl Chains {
    /// Remembers at most `capacity` repos (at least 2).
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self { revs: Generations::new(capacity), keys: RandomState::new() }
    }

    /// Checks a `#commit` against its repo's last rev and records its rev. A commit not
    /// newer than the last rev (a replay) changes nothing; a `since` of `None` starts a
    /// chain; revs that are not TIDs are not checked.
    pub fn commit(&mut self, repo: &str, rev: &str, since: Option<&str>) -> Option<ChainBreak> {
        let key = self.keys.hash_one(repo);
        let Some(r) = tid(rev) else {
            self.revs.remove(key);
            return None;
        };
        let last = self.revs.get(key);
        if last.is_some_and(|l| r <= l) {
            return None;
        }
        self.revs.put(key, r);
        let (last, since) = (last?, since?);
        if tid(since) == Some(last) {
            return None;
        }
        Some(ChainBreak {
            repo: repo.to_owned(),
            last_rev: tid_string(last),
            since: since.to_owned(),
            rev: rev.to_owned(),
        })
    }

    /// A `#sync` states the repo's current rev: the chain continues from it.
    pub fn sync(&mut self, did: &str, rev: &str) {
        let key = self.keys.hash_one(did);
        match tid(rev) {
            Some(r) if self.revs.get(key).is_none_or(|l| r > l) => self.revs.put(key, r),
            Some(_) => {}
            None => {
                self.revs.remove(key);
            }
        }
    }

    /// True when `rev` of `repo` is at or below the repo's last rev here: a commit that
    /// was handed over (or superseded by a `#sync`), so a relay serving it again repeats
    /// it. False when the repo is not remembered or the rev is not a TID.
    #[must_use]
    pub fn covers(&self, repo: &str, rev: &str) -> bool {
        let Some(r) = tid(rev) else { return false };
        let key = self.keys.hash_one(repo);
        self.revs.peek(key).is_some_and(|l| r <= l)
    }

    /// The last rev remembered for `repo`, as a TID value.
    pub(crate) fn last(&self, repo: &str) -> Option<u64> {
        self.revs.peek(self.keys.hash_one(repo))
    }

    /// Repos remembered.
    #[must_use]
    pub fn len(&self) -> usize {
        self.revs.len()
    }

    /// True before the first repo was seen.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tids_round_trip_and_keep_their_order() {
        for s in ["2222222222222", "3jzfcijpj2z2a", "3lbmxyz234567", "7zzzzzzzzzzzz"] {
            assert_eq!(tid_string(tid(s).expect(s)), s);
        }
        assert!(tid("3jzfcijpj2z2a") < tid("3jzfcijpj2z2b"));
        for bad in
            ["", "3jzfcijpj2z2", "3jzfcijpj2z2aa", "3jzfcijpj2z2A", "8222222222222", "k222222222222", "3jzfcijpj2z21"]
        {
            assert_eq!(tid(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_since_that_is_not_the_last_rev_is_a_break_and_replays_are_not() {
        let mut c = Chains::new(100);
        assert_eq!(c.commit("did:plc:a", "3jzfcijpj2z2a", None), None, "a chain starts");
        assert_eq!(c.commit("did:plc:a", "3jzfcijpj2z2c", Some("3jzfcijpj2z2a")), None, "it continues");
        assert_eq!(c.commit("did:plc:a", "3jzfcijpj2z2c", Some("3jzfcijpj2z2a")), None, "a replay is no break");
        let b = c.commit("did:plc:a", "3jzfcijpj2z2g", Some("3jzfcijpj2z2e")).expect("the commit of 2e was skipped");
        assert_eq!(
            (b.last_rev.as_str(), b.since.as_str(), b.rev.as_str()),
            ("3jzfcijpj2z2c", "3jzfcijpj2z2e", "3jzfcijpj2z2g")
        );
        assert_eq!(
            c.commit("did:plc:a", "3jzfcijpj2z2h", Some("3jzfcijpj2z2g")),
            None,
            "and the chain goes on from it"
        );
        c.sync("did:plc:a", "3jzfcijpj2z3a");
        assert_eq!(c.commit("did:plc:a", "3jzfcijpj2z3c", Some("3jzfcijpj2z3a")), None, "a #sync restarts the chain");
        assert_eq!(c.commit("did:plc:b", "3jzfcijpj2z2g", Some("3jzfcijpj2z2e")), None, "an unseen repo cannot break");
        let mut json = String::new();
        b.write_json(7, &mut json);
        assert_eq!(
            json,
            r##"{"seq":7,"type":"#chain-break","repo":"did:plc:a","lastRev":"3jzfcijpj2z2c","since":"3jzfcijpj2z2e","rev":"3jzfcijpj2z2g"}"##
        );
    }

    /// The fixture is a real PDS capture: its chains are whole, and dropping one commit
    /// breaks exactly its repo's chain, at the next commit of that repo.
    #[test]
    fn the_fixture_chains_are_whole_and_a_dropped_commit_breaks_one() {
        let frames = testkit::fixture_frames();
        let commits: Vec<(String, String, Option<String>)> = frames
            .iter()
            .filter_map(|f| match relay_client::decode(f).ok()? {
                relay_client::Frame::Message(relay_client::Message::Commit(c)) => {
                    Some((c.repo.to_owned(), c.rev.to_owned(), c.since.map(str::to_owned)))
                }
                _ => None,
            })
            .collect();
        let run = |skip: Option<usize>| {
            let mut c = Chains::new(1000);
            let breaks: Vec<ChainBreak> = commits
                .iter()
                .enumerate()
                .filter(|(i, _)| Some(*i) != skip)
                .filter_map(|(_, (repo, rev, since))| c.commit(repo, rev, since.as_deref()))
                .collect();
            breaks
        };
        assert_eq!(run(None), vec![], "the capture's chains are whole");
        assert!(commits.iter().filter(|c| c.2.is_some()).count() > commits.len() / 2, "most commits carry since");
        // A commit with a successor in its repo.
        let (i, next) = (0..commits.len())
            .find_map(|i| {
                let n = commits[i + 1..].iter().position(|c| c.0 == commits[i].0)? + i + 1;
                (i > 0 && commits[..i].iter().any(|c| c.0 == commits[i].0)).then_some((i, n))
            })
            .expect("a repo with three commits");
        let broke = run(Some(i));
        assert_eq!(broke.len(), 1, "{broke:?}");
        assert_eq!(broke[0].repo, commits[i].0);
        assert_eq!(broke[0].since, commits[i].1, "the next commit builds on the dropped one");
        assert_eq!(broke[0].rev, commits[next].1);
        assert_eq!(Some(broke[0].last_rev.as_str()), commits[i].2.as_deref(), "the last rev seen is the one before");
    }

    #[test]
    fn memory_stays_within_the_capacity_and_recent_repos_are_kept() {
        let mut c = Chains::new(1000);
        for i in 0..10_000u32 {
            c.commit(&format!("did:plc:{i}"), "3jzfcijpj2z2a", None);
            assert!(c.len() <= 1000, "{} repos at {i}", c.len());
            // One repo touched all along is never forgotten.
            let rev = tid_string(tid("3jzfcijpj2z2a").expect("tid") + u64::from(i) + 1);
            let since = tid_string(tid("3jzfcijpj2z2a").expect("tid") + u64::from(i));
            assert_eq!(c.commit("did:plc:hot", &rev, (i > 0).then_some(since.as_str())), None, "at {i}");
        }
        assert!(c.len() >= 500, "at least half the capacity stays: {}", c.len());
        // A repo found in the older generation moves to the newer one: counted once.
        let mut c = Chains::new(4);
        for d in ["did:plc:a", "did:plc:b", "did:plc:c"] {
            c.commit(d, "3jzfcijpj2z2a", None);
        }
        c.commit("did:plc:a", "3jzfcijpj2z2b", Some("3jzfcijpj2z2a"));
        assert_eq!(c.len(), 3);
    }
}
