//! Relay continuity: what a leader remembers so that switching relays (whose seqs mean
//! nothing to each other) loses nothing and hands nothing over twice.
//!
//! - [`Times`]: the relay time of delivered events, so each commit carries the time at
//!   its cursor (the position every relay understands).
//! - [`Memory`]: what this term handed over, per repo (the newest rev of its commits and
//!   of its `#sync`s, and the `(did, time)` of identity and account events), bounded by
//!   the number of repos. It is the chain check's state and the switch's proof: the
//!   start on the target relay is shown by content, and while a switch's overlap lasts
//!   the events it holds are dropped. **Only verified data moves it**: with verification
//!   on, an event is recorded in its lane once it verified (one handed over as
//!   `#invalid` is not delivered for the dedupe); with it off, at intake, as the event is
//!   handed over as itself.

use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use relay_client::probe::{Found, Judged, ProbeError, Sample, Search};
use relay_client::{Kind, Message};

use crate::chain::{ChainBreak, Chains, Generations};

/// What to do when the target relay's window does not reach back far enough.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GapPolicy {
    /// Refuse the switch: stay leader on the relay it had and retry it (not ready
    /// meanwhile, the missing range in the status); nothing is skipped, nothing exits.
    #[default]
    Fail,
    /// Accept: start at the oldest event the relay serves, log and count the gap.
    Live,
}

/// How many of the latest times at or below a cursor its time is the lower quartile of.
const TIME_SAMPLES: usize = 64;

/// Relay times of delivered events, oldest first, for the time at a committed cursor.
///
/// A relay time is a PDS's clock: one event an hour fast at the cursor must not become
/// the position (a switch would then start an hour late and lose everything between).
/// The time at a cursor is the lower quartile of the last [`TIME_SAMPLES`] times at or
/// below it (fast clocks cannot raise it; slow ones only move it earlier: more overlap),
/// and the caller clamps each time to its own clock plus a skew allowance on the way in.
#[derive(Debug, Default)]
pub(crate) struct Times {
    samples: VecDeque<(u64, i64)>,
    /// The latest times at or below the last cursor taken (at most `TIME_SAMPLES`).
    last: VecDeque<i64>,
    /// The lower quartile of `last`.
    at_cursor: Option<i64>,
    /// The position carried over from before this pipeline (the other relay's, or the
    /// stored one): a relay entered behind it must not move the position back in time.
    carried: Option<i64>,
}

impl Times {
    pub(crate) fn push(&mut self, seq: u64, time_ms: i64) {
        self.samples.push_back((seq, time_ms));
    }

    /// The time at `cursor`: the lower quartile of the latest delivered events' times at
    /// or below it (isolated fast clocks cannot raise it).
    pub(crate) fn take_until(&mut self, cursor: u64) -> Option<i64> {
        let mut moved = false;
        while let Some(&(s, t)) = self.samples.front() {
            if s > cursor {
                break;
            }
            if self.last.len() == TIME_SAMPLES {
                self.last.pop_front();
            }
            self.last.push_back(t);
            self.samples.pop_front();
            moved = true;
        }
        if moved {
            let mut v: Vec<i64> = self.last.iter().copied().collect();
            self.at_cursor = relay_client::probe::low_quartile(&mut v);
        }
        self.at_cursor()
    }

    /// The time at the last cursor taken, never before the carried position.
    pub(crate) fn at_cursor(&self) -> Option<i64> {
        match (self.at_cursor, self.carried) {
            (Some(a), Some(c)) => Some(a.max(c)),
            (a, c) => a.or(c),
        }
    }

    /// Starts from a position known from before (see `carried`).
    pub(crate) fn carry(&mut self, t: Option<i64>) {
        self.carried = t;
    }
}

/// The key an event is remembered by.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Key<'a> {
    /// `#commit`: newer revs only; `since` for the chain check.
    Commit { did: &'a str, rev: &'a str, since: Option<&'a str> },
    /// `#sync` (kept apart: it carries the rev of the commit it follows, and is an event
    /// of its own).
    Sync { did: &'a str, rev: &'a str },
    /// `#identity` / `#account`: the same `(did, time)` once per kind.
    Once { kind: Kind, did: &'a str, time: &'a str },
    /// A Jetstream event named by its content: one op of a commit (its ops share the
    /// commit's rev, so the rev alone cannot tell a delivered op from the next).
    Content { did: &'a str, key: u64 },
    /// Nothing to remember (`#info`, unknown types).
    Other,
}

impl<'a> Key<'a> {
    /// The key of a decoded message.
    pub(crate) fn of(m: &'a Message<'a>) -> Self {
        match m {
            Message::Commit(c) => Self::Commit { did: c.repo, rev: c.rev, since: c.since },
            Message::Sync(s) => Self::Sync { did: s.did, rev: s.rev },
            Message::Identity(i) => Self::Once { kind: Kind::Identity, did: i.did, time: i.time },
            Message::Account(a) => Self::Once { kind: Kind::Account, did: a.did, time: a.time },
            Message::Jet(j) => match (j.kind, j.rev, j.upstream_time) {
                (Kind::Sync, Some(rev), _) => Self::Sync { did: j.did, rev },
                (kind @ (Kind::Identity | Kind::Account), _, Some(time)) => Self::Once { kind, did: j.did, time },
                _ => Self::Content { did: j.did, key: j.content_key() },
            },
            Message::Info(_) | Message::Unknown { .. } => Self::Other,
        }
    }

    /// The key of an event a probe read.
    pub(crate) fn of_sample(s: &'a Sample) -> Self {
        match (s.kind, s.did.as_deref(), s.rev.as_deref(), s.time.as_deref()) {
            (Kind::Commit, Some(did), Some(rev), _) => Self::Commit { did, rev, since: None },
            (Kind::Sync, Some(did), Some(rev), _) => Self::Sync { did, rev },
            (kind @ (Kind::Identity | Kind::Account), Some(did), _, Some(time)) => Self::Once { kind, did, time },
            _ => Self::Other,
        }
    }
}

/// One lane's part of the memory (a repo's events share a lane).
struct Shard {
    commits: Chains,
    /// Each repo's first commit rev recorded: what is at or after it was recorded here.
    firsts: Generations<u64>,
    syncs: Generations<u64>,
    once: Generations<()>,
}

/// What this term handed over, per repo: see the module doc. Sharded by lane, so lanes
/// that record after verifying never wait on each other.
pub(crate) struct Memory {
    shards: Vec<Mutex<Shard>>,
    keys: RandomState,
    /// Events this memory does not hold and whose time is before this (Unix ms) were
    /// handed over before it started (by an earlier term). `i64::MIN`: it holds
    /// everything handed over on this stream; `i64::MAX`: not known yet.
    covers_from: AtomicI64,
}

/// The memory's covering before anything placed it.
pub(crate) const COVERS_UNKNOWN: i64 = i64::MAX;

impl Memory {
    /// A memory of at most `repos` repos over `lanes` shards.
    pub(crate) fn new(repos: usize, lanes: usize) -> Self {
        let lanes = lanes.max(1);
        let per = (repos / lanes).max(2);
        Self {
            shards: (0..lanes)
                .map(|_| {
                    Mutex::new(Shard {
                        commits: Chains::new(per),
                        firsts: Generations::new(per),
                        syncs: Generations::new(per),
                        once: Generations::new(per),
                    })
                })
                .collect(),
            keys: RandomState::new(),
            covers_from: AtomicI64::new(COVERS_UNKNOWN),
        }
    }

    fn shard(&self, lane: usize) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[lane % self.shards.len()].lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where an event remembered once (identity, account, a Jetstream op) is kept.
    fn once_of(&self, k: Key<'_>) -> Option<u64> {
        match k {
            Key::Once { kind, did, time } => Some(self.keys.hash_one((kind.as_str(), did, time))),
            Key::Content { did, key } => Some(self.keys.hash_one((did, key))),
            _ => None,
        }
    }

    /// Records an event handed over (as itself) in lane `lane`; a commit whose `since`
    /// is not its repo's last rev returns the break.
    pub(crate) fn record(&self, lane: usize, k: Key<'_>) -> Option<ChainBreak> {
        match k {
            Key::Commit { did, rev, since } => {
                let mut s = self.shard(lane);
                if let Some(r) = crate::chain::tid(rev) {
                    let key = self.keys.hash_one(did);
                    if s.firsts.peek(key).is_none() {
                        s.firsts.put(key, r);
                    }
                }
                s.commits.commit(did, rev, since)
            }
            Key::Sync { did, rev } => {
                let key = self.keys.hash_one(did);
                let mut s = self.shard(lane);
                s.commits.sync(did, rev);
                match crate::chain::tid(rev) {
                    Some(r) if s.syncs.peek(key).is_none_or(|l| r > l) => s.syncs.put(key, r),
                    Some(_) => {}
                    None => s.syncs.remove(key),
                }
                None
            }
            Key::Once { .. } | Key::Content { .. } => {
                if let Some(key) = self.once_of(k) {
                    self.shard(lane).once.put(key, ());
                }
                None
            }
            Key::Other => None,
        }
    }

    /// What the memory says of an event.
    pub(crate) fn judge(&self, lane: usize, k: Key<'_>) -> Judged {
        match k {
            Key::Commit { did, rev, .. } => {
                let s = self.shard(lane);
                match s.commits.last(did) {
                    Some(last) => match crate::chain::tid(rev) {
                        Some(r) if r <= last && s.firsts.peek(self.keys.hash_one(did)).is_some_and(|f| r >= f) => {
                            Judged::Recorded
                        }
                        Some(r) if r <= last => Judged::Delivered,
                        Some(_) => Judged::Undelivered,
                        None => Judged::Unknown,
                    },
                    None => Judged::Unknown,
                }
            }
            Key::Sync { did, rev } => {
                let key = self.keys.hash_one(did);
                match (self.shard(lane).syncs.peek(key), crate::chain::tid(rev)) {
                    (Some(last), Some(r)) if r <= last => Judged::Delivered,
                    (Some(_), Some(_)) => Judged::Undelivered,
                    _ => Judged::Unknown,
                }
            }
            Key::Once { .. } | Key::Content { .. } => match self.once_of(k) {
                Some(key) if self.shard(lane).once.peek(key).is_some() => Judged::Recorded,
                _ => Judged::Unknown,
            },
            Key::Other => Judged::Delivered,
        }
    }

    /// The last rev (a TID value) handed over of `did`'s commits, as far as remembered.
    pub(crate) fn last_commit(&self, lane: usize, did: &str) -> Option<u64> {
        self.shard(lane).commits.last(did)
    }

    /// Repos remembered (the chain check's gauge).
    pub(crate) fn repos(&self) -> usize {
        (0..self.shards.len()).map(|i| self.shard(i).commits.len()).sum()
    }

    /// See `covers_from`.
    pub(crate) fn covers_from(&self) -> i64 {
        self.covers_from.load(Ordering::Relaxed)
    }

    /// Sets where the memory starts (once: later calls keep the first answer).
    pub(crate) fn place(&self, from_ms: i64) {
        let _ = self.covers_from.compare_exchange(COVERS_UNKNOWN, from_ms, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// How many events in a row must be shown delivered just before a switch's start, and
/// new before its overlap ends: more than the relays' orders differ by around a switch
/// point (each relay receives from the same PDSs; reordering is by network delay).
pub(crate) const SWITCH_STRETCH: usize = 64;

/// A switch's overlap: the events of the relay switched to that were handed over before
/// the switch are dropped, as the memory proves them (never by a clock: a PDS lagging
/// behind sends new events with old times), until the position (the robust time at the
/// committed cursor, not any one event's clock) has passed `until` *and* the last
/// [`SWITCH_STRETCH`] events in a row were new: clocks and content must both say it is
/// over.
#[derive(Debug)]
pub(crate) struct Overlap {
    until: i64,
    fresh: usize,
}

impl Overlap {
    /// An overlap after a switch at position `at` (none known: `None`) lasting `overlap_ms`.
    pub(crate) fn after(at: Option<i64>, overlap_ms: i64) -> Self {
        Self { until: at.unwrap_or(i64::MIN).saturating_add(overlap_ms), fresh: 0 }
    }

    /// True when `k` was handed over already (drop it).
    pub(crate) fn drops(&mut self, memory: &Memory, lane: usize, k: Key<'_>) -> bool {
        if matches!(memory.judge(lane, k), Judged::Delivered | Judged::Recorded) {
            self.fresh = 0;
            return true;
        }
        self.fresh += 1;
        false
    }

    /// True once the overlap is over at `position`.
    pub(crate) fn over(&self, position: Option<i64>) -> bool {
        position.is_some_and(|t| t > self.until) && self.fresh >= SWITCH_STRETCH
    }
}

/// The start search after a switch at position `at_ms`: events the memory holds are
/// judged by content; others (a repo this term never handed over) by their clocks, as
/// handed over when not newer than the overlap's start or the memory's, whichever is
/// earlier.
pub(crate) fn search(memory: Option<&Memory>, at_ms: i64, overlap_ms: i64, max_probes: u32) -> Search {
    let covers_from = memory.map_or(COVERS_UNKNOWN, Memory::covers_from);
    Search { unknown_before_ms: at_ms.saturating_sub(overlap_ms).min(covers_from), max_probes, stretch: SWITCH_STRETCH }
}

/// What the content judge of a switch says of one event read from the target relay: an
/// event a memory that holds everything handed over on this stream does not know was
/// not handed over.
pub(crate) fn judge(memory: Option<&Memory>, lanes: usize, x: &Sample) -> Judged {
    let Some(m) = memory else { return Judged::Unknown };
    match m.judge(crate::pipeline::lane_of(x.did.as_deref(), lanes), Key::of_sample(x)) {
        Judged::Unknown if m.covers_from() == i64::MIN => Judged::Undelivered,
        j => j,
    }
}

/// Where a switch starts, from what the search found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Start {
    /// At the cursor the search proved.
    Found(u64),
    /// At the oldest event the target serves: its window holds less than the overlap, but
    /// starts among events shown delivered (with nothing there known undelivered) and,
    /// by its clocks, reaches back past the position less the skew allowance.
    Short { cursor: u64, overlap_ms: i64 },
    /// At the oldest event, accepting a gap (gap policy `live`).
    Gap { cursor: u64, oldest_ms: i64 },
    /// Not at all: the window does not reach back (gap policy `fail`).
    Refused { oldest_ms: i64, oldest_seq: u64 },
    /// Not at all: the search failed.
    Failed(ProbeError),
}

/// Decides a switch's start from the search's answer, at position `at_ms`.
pub(crate) fn decide(found: Result<Found, ProbeError>, at_ms: i64, skew_ms: i64, gap: GapPolicy) -> Start {
    match found {
        Ok(f) => Start::Found(f.cursor),
        Err(ProbeError::Gap { oldest_ms, oldest_seq, proven: false, shown: true }) if oldest_ms < at_ms - skew_ms => {
            Start::Short { cursor: oldest_seq - 1, overlap_ms: at_ms - oldest_ms }
        }
        Err(ProbeError::Gap { oldest_ms, oldest_seq, .. }) => match gap {
            GapPolicy::Fail => Start::Refused { oldest_ms, oldest_seq },
            GapPolicy::Live => Start::Gap { cursor: oldest_seq - 1, oldest_ms },
        },
        Err(e) => Start::Failed(e),
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(frames: &[relay_client::capture::Bytes]) -> Vec<Message<'_>> {
        frames.iter().filter_map(|f| relay_client::decode(f).ok()?.into_message()).collect()
    }

    #[test]
    fn the_time_at_a_cursor_is_the_low_quartile_of_the_latest_at_or_below_it() {
        let mut t = Times::default();
        assert_eq!(t.take_until(5), None);
        t.push(1, 10);
        t.push(2, 20);
        t.push(5, 50);
        assert_eq!(t.take_until(3), Some(10), "the lower quartile of 10 and 20");
        assert_eq!(t.take_until(3), Some(10), "taken once, kept");
        assert_eq!(t.at_cursor(), Some(10));
        for (seq, time) in (6..=12).zip((60..=120).step_by(10)) {
            t.push(seq, time);
        }
        assert_eq!(t.take_until(12), Some(50), "the 3rd of 10 20 50 60 … 120");
        let mut behind = Times::default();
        behind.carry(Some(100));
        behind.push(1, 10);
        assert_eq!(behind.take_until(1), Some(100), "a relay entered behind keeps the position");
    }

    /// A PDS an hour fast at the cursor does not become the position (a slow one only
    /// moves it earlier).
    #[test]
    fn one_skewed_clock_at_the_cursor_does_not_move_the_time() {
        let hour = 3_600_000;
        for skew in [hour, -hour] {
            let mut t = Times::default();
            for seq in 1..=20_u64 {
                t.push(seq, 1_000 * i64::try_from(seq).expect("small"));
            }
            // A fast PDS posting a burst: most of the latest 9 events, all an hour ahead.
            for seq in 21..=27_u64 {
                t.push(seq, 1_000 * i64::try_from(seq).expect("small") + skew);
            }
            let at = t.take_until(27).expect("a time");
            // Fast clocks do not move it later; slow ones may move it earlier (more overlap).
            assert!(at <= 20_000, "skew {skew}: {at}");
            if skew > 0 {
                assert!(at >= 1_000, "{at}");
            }
        }
    }

    #[test]
    fn the_memory_judges_what_was_recorded_and_keeps_kinds_apart() {
        let frames = testkit::fixture_frames();
        let all = messages(&frames);
        let m = Memory::new(1000, 4);
        let lane = |x: &Message<'_>| crate::pipeline::lane_of(x.did(), 4);
        for x in &all {
            let before = m.judge(lane(x), Key::of(x));
            assert!(!matches!(before, Judged::Delivered | Judged::Recorded), "a first delivery is new: {x:?}");
            m.record(lane(x), Key::of(x));
            let after = m.judge(lane(x), Key::of(x));
            assert!(matches!(after, Judged::Delivered | Judged::Recorded), "and once recorded, it is not: {x:?}");
        }
        // Older revs of a repo count as delivered; a newer one is known not to be.
        let Some(Message::Commit(c)) = all.iter().rev().find(|x| matches!(x, Message::Commit(_))) else {
            panic!("a commit")
        };
        let older = all
            .iter()
            .find(|x| matches!(x, Message::Commit(o) if o.repo == c.repo && o.rev < c.rev))
            .expect("an older commit of the same repo");
        assert_eq!(m.judge(lane(older), Key::of(older)), Judged::Recorded);
        // A commit of a known repo older than anything recorded was handed over (its repo's
        // later commits were), but not recorded here.
        let early = Memory::new(1000, 1);
        early.record(0, Key::Commit { did: "did:plc:a", rev: "3jzfcijpj2z2c", since: None });
        let before = Key::Commit { did: "did:plc:a", rev: "3jzfcijpj2z2b", since: None };
        assert_eq!(early.judge(0, before), Judged::Delivered);
        let newer = Key::Commit { did: c.repo, rev: "7zzzzzzzzzzzz", since: None };
        assert_eq!(m.judge(crate::pipeline::lane_of(Some(c.repo), 4), newer), Judged::Undelivered);
        let stranger = Key::Commit { did: "did:plc:nobody", rev: "3jzfcijpj2z2a", since: None };
        assert_eq!(m.judge(0, stranger), Judged::Unknown);
        // A #sync is an event of its own: a commit of the same rev does not cover it.
        let fresh = Memory::new(1000, 1);
        fresh.record(0, Key::Commit { did: "did:plc:a", rev: "3jzfcijpj2z2c", since: None });
        let sync = Key::Sync { did: "did:plc:a", rev: "3jzfcijpj2z2c" };
        assert_eq!(fresh.judge(0, sync), Judged::Unknown);
        fresh.record(0, sync);
        assert_eq!(fresh.judge(0, sync), Judged::Delivered);
        assert_eq!(fresh.judge(0, Key::Sync { did: "did:plc:a", rev: "3jzfcijpj2z2d" }), Judged::Undelivered);
        // For a switch: an event a memory that holds the whole stream does not know was
        // not handed over; one that began later cannot say (clocks then decide).
        let sample = |did: &str| Sample {
            seq: 9,
            kind: Kind::Commit,
            did: Some(did.to_owned()),
            rev: Some("3jzfcijpj2z2a".into()),
            time: None,
            time_ms: None,
        };
        let whole = Memory::new(1000, 1);
        whole.place(i64::MIN);
        assert_eq!(judge(Some(&whole), 1, &sample("did:plc:nobody")), Judged::Undelivered);
        assert_eq!(judge(Some(&fresh), 1, &sample("did:plc:nobody")), Judged::Unknown);
        // Where it starts is set once.
        assert_eq!(fresh.covers_from(), COVERS_UNKNOWN);
        fresh.place(5);
        fresh.place(9);
        assert_eq!(fresh.covers_from(), 5);
    }
}
