//! The processed watermark: events are handed out in seq order and finish in any order
//! (concurrently across repos); the committable cursor is the highest delivered seq at or
//! below which every delivered event is done.

use std::collections::VecDeque;

/// Tracks in-flight events. Memory is bounded by `capacity`: when that many events are
/// in flight, [`Watermark::deliver`] refuses and the caller must wait (backpressure).
#[derive(Debug, Clone)]
pub struct Watermark {
    /// In-flight and finished-but-blocked events, in delivery (= seq) order.
    window: VecDeque<(u64, bool)>,
    /// Highest seq whose prefix is all done.
    committable: Option<u64>,
    capacity: usize,
    done_in_window: usize,
    /// Positions may repeat (Jetstream stamps: the ops of one commit share one).
    ties: bool,
}

/// Why a delivery was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WatermarkError {
    /// `capacity` events are in flight.
    #[error("{0} events in flight: wait for some to finish")]
    Full(usize),
    /// Seqs must be delivered in increasing order.
    #[error("seq {seq} delivered after {last}")]
    OutOfOrder {
        /// The seq delivered.
        seq: u64,
        /// The last seq delivered before it.
        last: u64,
    },
}

impl Watermark {
    /// A tracker starting at `start` (the stored cursor) holding at most `capacity`
    /// events in flight.
    #[must_use]
    pub fn new(start: Option<u64>, capacity: usize) -> Self {
        Self {
            window: VecDeque::with_capacity(capacity.min(1 << 16)),
            committable: start,
            capacity: capacity.max(1),
            done_in_window: 0,
            ties: false,
        }
    }

    /// The same tracker for positions that repeat (Jetstream stamps): an event may be
    /// delivered at the last position again, and a position becomes committable only
    /// once every event delivered at it is done (a resume from it hands over the events
    /// at exactly that position again, so none of them can be lost).
    #[must_use]
    pub fn with_ties(mut self) -> Self {
        self.ties = true;
        self
    }

    /// True when [`Watermark::deliver`] has room for one more event. The window counts
    /// finished events still waiting behind an unfinished one, so this, not the number
    /// in flight, is what intake must wait on.
    #[must_use]
    pub fn has_room(&self) -> bool {
        self.window.len() < self.capacity
    }

    /// Registers a delivered event.
    pub fn deliver(&mut self, seq: u64) -> Result<(), WatermarkError> {
        if self.window.len() >= self.capacity {
            return Err(WatermarkError::Full(self.capacity));
        }
        let last = self.window.back().map(|e| e.0).or(self.committable);
        if let Some(last) = last.filter(|&l| seq < l || (seq == l && !self.ties)) {
            return Err(WatermarkError::OutOfOrder { seq, last });
        }
        self.window.push_back((seq, false));
        Ok(())
    }

    /// Marks a delivered event done. Returns false for a seq not in flight.
    pub fn complete(&mut self, seq: u64) -> bool {
        let i = if self.ties {
            // The first of the position's events not done yet.
            let from = self.window.partition_point(|e| e.0 < seq);
            let mut at = (from..self.window.len()).take_while(|&i| self.window[i].0 == seq);
            match at.find(|&i| !self.window[i].1) {
                Some(i) => i,
                None => return false,
            }
        } else {
            let Ok(i) = self.window.binary_search_by(|e| e.0.cmp(&seq)) else {
                return false;
            };
            i
        };
        if self.window[i].1 {
            return false;
        }
        self.window[i].1 = true;
        self.done_in_window += 1;
        while let Some(&(s, true)) = self.window.front() {
            self.window.pop_front();
            self.done_in_window -= 1;
            // With ties, a position is committable once nothing at it is left.
            if !self.ties || self.window.front().is_none_or(|f| f.0 != s) {
                self.committable = Some(s);
            }
        }
        true
    }

    /// The cursor it is safe to commit.
    #[must_use]
    pub fn committable(&self) -> Option<u64> {
        self.committable
    }

    /// Events delivered and not yet done.
    #[must_use]
    pub fn in_flight(&self) -> usize {
        self.window.len() - self.done_in_window
    }

    /// True when every delivered event is done (the drain is complete).
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.window.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_ties_a_position_is_committable_only_when_all_its_events_are_done() {
        let mut w = Watermark::new(Some(10), 16).with_ties();
        w.deliver(10).expect("the resume position again");
        w.deliver(12).expect("first");
        w.deliver(12).expect("a tie");
        w.deliver(12).expect("another");
        assert!(w.deliver(11).is_err(), "backwards");
        assert!(w.complete(10));
        assert_eq!(w.committable(), Some(10));
        assert!(w.complete(12));
        assert!(w.complete(12));
        assert_eq!(w.committable(), Some(10), "one event at 12 is not done");
        assert!(w.complete(12));
        assert!(!w.complete(12), "all three done");
        assert_eq!(w.committable(), Some(12));
        let mut plain = Watermark::new(Some(10), 16);
        assert!(plain.deliver(10).is_err(), "without ties a position is never delivered twice");
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// The model: the largest delivered seq s such that every delivered seq ≤ s is done.
    fn model(delivered: &[u64], done: &std::collections::HashSet<u64>, start: Option<u64>) -> Option<u64> {
        let mut best = start;
        for &s in delivered {
            if done.contains(&s) {
                best = Some(s);
            } else {
                break;
            }
        }
        best
    }

    #[test]
    fn matches_the_model_under_random_completion_orders() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for case in 0..2_000 {
            let start = if case % 3 == 0 { None } else { Some(rng.next() % 1000) };
            let cap = 1 + (rng.next() % 64) as usize;
            let mut w = Watermark::new(start, cap);
            let mut delivered = Vec::new();
            let mut pending: Vec<u64> = Vec::new();
            let mut done = std::collections::HashSet::new();
            let mut next = start.map_or(0, |s| s + 1);
            for _ in 0..200 {
                if rng.next().is_multiple_of(2) {
                    next += rng.next() % 4; // gaps are normal
                    let room = w.has_room();
                    match w.deliver(next) {
                        Ok(()) => {
                            assert!(room, "has_room said no, deliver said yes");
                            delivered.push(next);
                            pending.push(next);
                            next += 1;
                        }
                        Err(WatermarkError::Full(c)) => {
                            assert_eq!(c, cap);
                            assert!(!room, "has_room said yes, deliver said full");
                        }
                        Err(e) => panic!("{e}"),
                    }
                } else if !pending.is_empty() {
                    let i = (rng.next() as usize) % pending.len();
                    let s = pending.swap_remove(i);
                    assert!(w.complete(s));
                    assert!(!w.complete(s), "completing twice is refused");
                    done.insert(s);
                }
                assert_eq!(w.committable(), model(&delivered, &done, start), "case {case}");
                assert!(w.window.len() <= cap, "bounded memory");
                assert_eq!(w.in_flight(), pending.len());
            }
        }
    }

    #[test]
    fn refuses_out_of_order_and_unknown() {
        let mut w = Watermark::new(Some(10), 8);
        assert_eq!(w.deliver(10), Err(WatermarkError::OutOfOrder { seq: 10, last: 10 }));
        w.deliver(12).expect("ok");
        assert_eq!(w.deliver(11), Err(WatermarkError::OutOfOrder { seq: 11, last: 12 }));
        assert!(!w.complete(99));
        assert_eq!(w.committable(), Some(10));
        assert!(w.complete(12));
        assert_eq!(w.committable(), Some(12));
        assert!(w.is_idle());
    }
}
