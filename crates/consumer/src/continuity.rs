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
    /// Stop leading with an error naming the relay and the missing time range.
    #[default]
    Fail,
    /// Accept: start at the oldest event the relay serves, log and count the gap.
    Live,
}

/// Relay times of delivered events, oldest first, for the time at a committed cursor.
#[derive(Debug, Default)]
pub(crate) struct Times {
    samples: VecDeque<(u64, i64)>,
    /// Time of the newest sample at or below the last cursor taken.
    at_cursor: Option<i64>,
    /// The position carried over from before this pipeline (the other relay's, or the
    /// stored one): a relay entered behind it must not move the position back in time.
    carried: Option<i64>,
}

impl Times {
    pub(crate) fn push(&mut self, seq: u64, time_ms: i64) {
        self.samples.push_back((seq, time_ms));
    }

    /// The time at `cursor`: that of the newest delivered event at or below it (so never
    /// later than the event at the cursor, up to the relay's own clock order).
    pub(crate) fn take_until(&mut self, cursor: u64) -> Option<i64> {
        while let Some(&(s, t)) = self.samples.front() {
            if s > cursor {
                break;
            }
            self.at_cursor = Some(t);
            self.samples.pop_front();
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
#[derive(Debug)]
pub(crate) struct Recent {
    window: i64,
    /// Per kind (commit, sync): repo → (newest rev delivered, time of its last event).
    revs: [HashMap<String, (String, i64)>; 2],
    once: HashSet<(usize, String, i64)>,
    /// (time, kind, did) in delivery order, for pruning.
    order: VecDeque<(i64, usize, String)>,
    newest: i64,
}

impl Recent {
    pub(crate) fn new(window_ms: i64) -> Self {
        Self {
            window: window_ms,
            revs: [HashMap::new(), HashMap::new()],
            once: HashSet::new(),
            order: VecDeque::new(),
            newest: i64::MIN,
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
        match k {
            Key::Rev { kind, did, rev } => {
                let e = self.revs[kind].entry(did.to_owned()).or_insert_with(|| (String::new(), t));
                if rev > e.0.as_str() {
                    e.0.clear();
                    e.0.push_str(rev);
                }
                e.1 = t;
                self.order.push_back((t, kind, did.to_owned()));
            }
            Key::Once { kind, did, time } => {
                self.once.insert((kind, did.to_owned(), time));
                self.order.push_back((t, kind, did.to_owned()));
            }
        }
        self.newest = self.newest.max(t);
        while let Some((t0, _, _)) = self.order.front() {
            if *t0 >= self.newest - self.window {
                break;
            }
            let (t0, kind, did) = self.order.pop_front().expect("front");
            if kind < 2 {
                if self.revs[kind].get(&did).is_some_and(|(_, last)| *last <= t0) {
                    self.revs[kind].remove(&did);
                }
            } else {
                self.once.remove(&(kind, did, t0));
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
        frames
            .iter()
            .filter_map(|f| match relay_client::decode(f).ok()? {
                relay_client::Frame::Message(m) => Some(m),
                relay_client::Frame::Error(_) => None,
            })
            .collect()
    }

    #[test]
    fn the_time_at_a_cursor_is_the_newest_delivered_at_or_below_it() {
        let mut t = Times::default();
        assert_eq!(t.take_until(5), None);
        t.push(1, 10);
        t.push(2, 20);
        t.push(5, 50);
        assert_eq!(t.take_until(3), Some(20));
        assert_eq!(t.take_until(3), Some(20), "taken once, kept");
        assert_eq!(t.at_cursor(), Some(20));
        assert_eq!(t.take_until(9), Some(50));
        let mut behind = Times::default();
        behind.carry(Some(100));
        behind.push(1, 10);
        assert_eq!(behind.take_until(1), Some(100), "a relay entered behind keeps the position");
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
        assert!(peak <= 8, "peak {peak} entries with a 1 ms window");
        assert!(r.len() > tight.len());
    }
}
