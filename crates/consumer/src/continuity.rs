//! Relay continuity: what a leader remembers so that switching relays (whose seqs mean
//! nothing to each other) loses nothing and hands nothing over twice.
//!
//! - [`Times`]: the relay time of delivered events, so each commit carries the time at
//!   its cursor (the position every relay understands).
//! - [`Recent`]: per repo, the newest rev delivered (and the `(did, time)` of identity and
//!   account events) within the overlap window, bounded by event time; while a switch's
//!   overlap lasts, events it already holds are dropped.

use std::collections::{HashMap, HashSet, VecDeque};

use relay_client::Message;
use relay_client::probe::time_ms;

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

/// The key an event is deduplicated by.
enum Key<'a> {
    /// `#commit` (0) / `#sync` (1): newer revs only, each kind on its own (a `#sync`
    /// carries the rev of the commit it follows, and is an event of its own).
    Rev { kind: usize, did: &'a str, rev: &'a str },
    /// `#identity` (2) / `#account` (3): the same `(did, time)` once per kind.
    Once { kind: usize, did: &'a str, time: i64 },
}

fn key<'a>(m: &'a Message<'a>) -> Option<(Key<'a>, i64)> {
    let t = time_ms(m.time()?)?;
    let k = match m {
        Message::Commit(c) => Key::Rev { kind: 0, did: c.repo, rev: c.rev },
        Message::Sync(s) => Key::Rev { kind: 1, did: s.did, rev: s.rev },
        Message::Identity(i) => Key::Once { kind: 2, did: i.did, time: t },
        Message::Account(a) => Key::Once { kind: 3, did: a.did, time: t },
        Message::Info(_) | Message::Unknown { .. } => return None,
    };
    Some((k, t))
}

/// What was delivered within the last `window` of event time.
///
/// Pruning follows the stream's position, not single clocks: the position is the lower
/// quartile of the latest event times (one fast PDS cannot flush the set), and an event
/// is kept as if delivered no earlier than that position (a slow PDS's event stays as
/// long as any other).
#[derive(Debug)]
pub(crate) struct Recent {
    window: i64,
    /// Per kind (commit, sync): repo → (newest rev delivered, order time of its last event).
    revs: [HashMap<String, (String, i64)>; 2],
    once: HashSet<(usize, String, i64)>,
    /// (order time, kind, did, event time) in delivery order, for pruning.
    order: VecDeque<(i64, usize, String, i64)>,
    /// The latest event times, for the position.
    latest: VecDeque<i64>,
    /// The stream's position: the lower quartile of `latest`.
    newest: i64,
    recorded: u64,
}

/// How many latest times the position is taken from, and how often it is recomputed.
const POSITION_SAMPLES: usize = 64;
const POSITION_EVERY: u64 = 16;

impl Recent {
    pub(crate) fn new(window_ms: i64) -> Self {
        Self {
            window: window_ms,
            revs: [HashMap::new(), HashMap::new()],
            once: HashSet::new(),
            order: VecDeque::new(),
            latest: VecDeque::with_capacity(POSITION_SAMPLES),
            newest: i64::MIN,
            recorded: 0,
        }
    }

    /// True when `m` was already delivered (a `#commit`/`#sync` whose rev is not newer
    /// than the newest delivered for its repo; an identity/account seen with its time).
    pub(crate) fn seen(&self, m: &Message<'_>) -> bool {
        match key(m) {
            Some((Key::Rev { kind, did, rev }, _)) => self.revs[kind].get(did).is_some_and(|(r, _)| rev <= r.as_str()),
            Some((Key::Once { kind, did, time }, _)) => self.once.contains(&(kind, did.to_owned(), time)),
            None => false,
        }
    }

    /// Records a delivered event and forgets what fell out of the window.
    pub(crate) fn record(&mut self, m: &Message<'_>) {
        let Some((k, t)) = key(m) else { return };
        if self.latest.len() == POSITION_SAMPLES {
            self.latest.pop_front();
        }
        self.latest.push_back(t);
        self.recorded += 1;
        if self.newest == i64::MIN || self.recorded.is_multiple_of(POSITION_EVERY) {
            let mut v: Vec<i64> = self.latest.iter().copied().collect();
            self.newest = relay_client::probe::low_quartile(&mut v).unwrap_or(t);
        }
        let at = t.max(self.newest);
        match k {
            Key::Rev { kind, did, rev } => {
                let e = self.revs[kind].entry(did.to_owned()).or_insert_with(|| (String::new(), at));
                if rev > e.0.as_str() {
                    e.0.clear();
                    e.0.push_str(rev);
                }
                e.1 = at;
                self.order.push_back((at, kind, did.to_owned(), t));
            }
            Key::Once { kind, did, time } => {
                self.once.insert((kind, did.to_owned(), time));
                self.order.push_back((at, kind, did.to_owned(), time));
            }
        }
        while let Some((t0, ..)) = self.order.front() {
            if *t0 >= self.newest.saturating_sub(self.window) {
                break;
            }
            let (t0, kind, did, time) = self.order.pop_front().expect("front");
            if kind < 2 {
                if self.revs[kind].get(&did).is_some_and(|(_, last)| *last <= t0) {
                    self.revs[kind].remove(&did);
                }
            } else {
                self.once.remove(&(kind, did, time));
            }
        }
    }

    /// Repos and one-off events remembered (the memory bound).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.revs[0].len() + self.revs[1].len() + self.once.len()
    }
}

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

    /// One event from a PDS an hour fast does not flush what was delivered (the set is
    /// pruned by the stream's position, not by the newest single clock).
    #[test]
    fn one_fast_clock_does_not_flush_the_recent_set() {
        let frames = testkit::fixture_frames();
        let fast = relay_sim::skew_clocks(&frames[200..=200], |_, _| true, 3_600_000);
        let all = messages(&frames[..200]);
        let mut r = Recent::new(60_000);
        for m in &all {
            r.record(m);
        }
        let before = r.len();
        for m in messages(&fast) {
            r.record(&m);
        }
        assert!(r.len() + 1 >= before, "{} of {before} kept", r.len());
        assert!(all[150..].iter().all(|m| r.seen(m)), "the latest deliveries are still known");
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
    fn what_was_delivered_is_seen_again_and_memory_stays_within_the_window() {
        let frames = testkit::fixture_frames();
        let all = messages(&frames);
        let mut r = Recent::new(60_000);
        for m in &all {
            assert!(!r.seen(m), "a first delivery is never a duplicate: {m:?}");
            r.record(m);
            assert!(r.seen(m), "and once delivered, it is");
        }
        // Older revs of a repo count as delivered; nothing later than the newest does.
        let last_commit = all.iter().rev().find(|m| matches!(m, Message::Commit(_))).expect("a commit");
        let Message::Commit(c) = last_commit else { unreachable!() };
        let older = all
            .iter()
            .find(|m| matches!(m, Message::Commit(o) if o.repo == c.repo && o.rev < c.rev))
            .expect("an older commit of the same repo");
        assert!(r.seen(older));
        // A 1 ms window keeps only what shares the newest time: the state is bounded by
        // time, not by how much went through.
        let mut tight = Recent::new(1);
        let mut peak = 0;
        for m in &all {
            tight.record(m);
            peak = peak.max(tight.len());
        }
        assert!(peak <= 80, "peak {peak} entries with a 1 ms window");
        assert!(r.len() > tight.len());
    }
}
