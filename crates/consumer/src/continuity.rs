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
        self.at_cursor
    }

    /// The time at the last cursor taken.
    pub(crate) fn at_cursor(&self) -> Option<i64> {
        self.at_cursor
    }
}

/// The key an event is deduplicated by.
enum Key<'a> {
    /// `#commit` / `#sync`: newer revs only.
    Rev { did: &'a str, rev: &'a str },
    /// `#identity` / `#account`: the same `(did, time)` once.
    Once { did: &'a str, time: i64 },
}

fn key<'a>(m: &'a Message<'a>) -> Option<(Key<'a>, i64)> {
    let t = time_ms(m.time()?)?;
    let k = match m {
        Message::Commit(c) => Key::Rev { did: c.repo, rev: c.rev },
        Message::Sync(s) => Key::Rev { did: s.did, rev: s.rev },
        Message::Identity(i) => Key::Once { did: i.did, time: t },
        Message::Account(a) => Key::Once { did: a.did, time: t },
        Message::Info(_) | Message::Unknown { .. } => return None,
    };
    Some((k, t))
}

/// What was delivered within the last `window` of event time.
#[derive(Debug)]
pub(crate) struct Recent {
    window: i64,
    revs: HashMap<String, (String, i64)>,
    once: HashSet<(String, i64)>,
    order: VecDeque<(i64, String)>,
    newest: i64,
}

impl Recent {
    pub(crate) fn new(window_ms: i64) -> Self {
        Self {
            window: window_ms,
            revs: HashMap::new(),
            once: HashSet::new(),
            order: VecDeque::new(),
            newest: i64::MIN,
        }
    }

    /// True when `m` was already delivered (a `#commit`/`#sync` whose rev is not newer
    /// than the newest delivered for its repo; an identity/account seen with its time).
    pub(crate) fn seen(&self, m: &Message<'_>) -> bool {
        match key(m) {
            Some((Key::Rev { did, rev }, _)) => self.revs.get(did).is_some_and(|(r, _)| rev <= r.as_str()),
            Some((Key::Once { did, time }, _)) => self.once.contains(&(did.to_owned(), time)),
            None => false,
        }
    }

    /// Records a delivered event and forgets what fell out of the window.
    pub(crate) fn record(&mut self, m: &Message<'_>) {
        let Some((k, t)) = key(m) else { return };
        match k {
            Key::Rev { did, rev } => {
                let e = self.revs.entry(did.to_owned()).or_insert_with(|| (String::new(), t));
                if rev > e.0.as_str() {
                    e.0.clear();
                    e.0.push_str(rev);
                }
                e.1 = t;
                self.order.push_back((t, did.to_owned()));
            }
            Key::Once { did, time } => {
                self.once.insert((did.to_owned(), time));
                self.order.push_back((t, did.to_owned()));
            }
        }
        self.newest = self.newest.max(t);
        while let Some((t0, _)) = self.order.front() {
            if *t0 >= self.newest - self.window {
                break;
            }
            let (t0, did) = self.order.pop_front().expect("front");
            if self.revs.get(&did).is_some_and(|(_, last)| *last <= t0) {
                self.revs.remove(&did);
            }
            self.once.remove(&(did, t0));
        }
    }

    /// Repos and one-off events remembered (the memory bound).
    pub(crate) fn len(&self) -> usize {
        self.revs.len() + self.once.len()
    }
}
