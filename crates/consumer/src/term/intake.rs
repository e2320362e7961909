//! Intake: each item the subscription yields becomes a lane's event, a passed seq, a
//! notice counted, a relay switch, or the end of the term.

use relay_client::probe::time_ms;
use relay_client::{Item, Message, Notice, OwnedFrame, SubscribeError};

use super::{Ctx, Leader, Phase, Stop, guarded};
use crate::chain::{ChainBreak, ChainBreaks};
use crate::continuity::Key;
use crate::error::Fatal;
use crate::handler::Event;
use crate::metrics as m;
use crate::pipeline::Sent;

/// Inactive accounts remembered per term (for the reactivation trigger); past this many
/// the set starts over.
const INACTIVE_MAX: usize = 100_000;

/// This process's clock, Unix ms.
fn now_ms() -> i64 {
    i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX / 4)
}

/// Counts what the client reports besides frames.
fn on_notice(cx: &Ctx<'_>, n: &Notice) {
    match n {
        Notice::Connected { relay, .. } => {
            cx.status.update(|s| s.connected = true);
            metrics::gauge!(m::RELAY_CONNECTED).set(1.0);
            tracing::info!(relay = relay.as_str(), "relay connected");
        }
        Notice::Disconnected { relay, error, .. } => {
            cx.status.update(|s| s.connected = false);
            metrics::gauge!(m::RELAY_CONNECTED).set(0.0);
            metrics::counter!(m::RECONNECTS, "relay" => relay.as_str(), "reason" => error.reason()).increment(1);
            if let relay_client::ConnError::ErrorFrame { error, .. } = error {
                metrics::counter!(m::ERROR_FRAMES, "error" => error.clone()).increment(1);
            }
        }
        Notice::BadFrame { error, seq, .. } => {
            let policy = if seq.is_some() { "skipped" } else { "unplaced" };
            metrics::counter!(m::BAD_FRAMES, "reason" => error.reason(), "action" => policy).increment(1);
        }
        Notice::SeqBackwards { .. } => metrics::counter!(m::SEQ_BACKWARDS).increment(1),
        Notice::OutdatedCursor { .. } => metrics::counter!(m::OUTDATED_CURSOR).increment(1),
        Notice::Info { .. } | Notice::WentLive { .. } => {}
    }
}

impl Leader<'_, '_> {
    /// A gap was accepted (`why`): the repos this term handed over are reconciled against
    /// the host's listing (none handed over yet: nothing to compare, nothing asked).
    pub(super) fn gap_accepted(&self, why: &'static str) {
        if self.memory.as_ref().is_some_and(|m| m.repos() > 0) {
            self.cx.status.desync().gap_accepted(why);
        }
    }

    /// One item from the subscription.
    pub(super) async fn on_item(&mut self, item: Result<relay_client::Item, SubscribeError>) -> Result<(), Stop> {
        match item {
            Ok(Item::Frame(f)) => self.on_frame(f).await,
            Ok(Item::Notice(n)) => {
                on_notice(self.cx, &n);
                match n {
                    Notice::WentLive { rejected, .. } => self.went_live(rejected).await,
                    Notice::OutdatedCursor { .. } => {
                        self.gap_accepted("outdated_cursor");
                        Ok(())
                    }
                    _ => Ok(()),
                }
            }
            Ok(Item::SwitchRelay { from, to, reason }) => self.on_switch(from, to, reason).await,
            Err(e @ SubscribeError::FutureCursor { .. }) => Err(self.fatal(Fatal::FutureCursor(e)).await),
            Err(e @ SubscribeError::Gap { .. }) => Err(self.fatal(Fatal::Gap(e)).await),
            Err(
                e @ (SubscribeError::BadFrame { .. }
                | SubscribeError::FrameTooLarge { .. }
                | SubscribeError::BadJetstreamFrame { .. }),
            ) => Err(self.fatal(Fatal::BadFrame(e)).await),
            Err(SubscribeError::Closed) => Err(self.fatal(Fatal::Closed).await),
        }
    }

    /// Hands one frame to the pipeline: waits for room in its lane (and the window, which
    /// the caller checked), never skips a refused delivery.
    async fn on_frame(&mut self, f: OwnedFrame) -> Result<(), Stop> {
        let seq = f.seq;
        self.clear_refusal();
        if let Phase::Placing(why) = self.phase {
            self.phase = Phase::Streaming;
            self.place(why, seq).await?;
        }
        let m = f.message();
        let lane = self.p.lane_of(m.did());
        if self.is_handed_over(seq, lane, m) {
            metrics::counter!(m::SWITCH_DUPLICATES).increment(1);
            return self.pass(seq);
        }
        if !self.covered.is_empty() && self.is_covered(m) {
            metrics::counter!(m::RESYNC_COVERED).increment(1);
            return self.pass(seq);
        }
        self.repair_triggers(seq, lane, m);
        let emit = self.chain_check(seq, lane, m);
        // A filtered-out commit that reveals a break still goes out, to carry the break.
        // Under verification it goes to its lane hidden: the repo's chain needs every
        // commit, and an invalid one is handed over as `#invalid` whatever the filter.
        let hidden = emit.is_none() && self.cx.settings.options.collections.as_ref().is_some_and(|c| c.drops(m));
        if hidden && self.cx.shape.verifier.is_none() {
            return self.pass(seq);
        }
        if !hidden {
            self.events.count(m.kind());
        }
        if let Some(t) = m.time() {
            self.last_time.clear();
            self.last_time.push_str(t);
        }
        let mut e = Event::new(f);
        e.hidden = hidden;
        if let Some(b) = emit {
            e.set_chain_break(b);
        }
        // Intake only reads while the window has room, and the client delivers in
        // increasing seq order: an error here is a bug, and skipping would lose the event.
        let full = self.p.deliver(seq, lane, e).map_err(|error| Fatal::Watermark { seq, error })?;
        self.cx.status.add_events(1);
        if full {
            return self.send(lane).await;
        }
        Ok(())
    }

    /// Sends lane `lane`'s staged events: at once when it has room (the fast path needs
    /// no waiters registered on the term and shutdown tokens), else waited for, guarded.
    pub(super) async fn send(&mut self, lane: usize) -> Result<(), Stop> {
        match self.p.try_send(lane) {
            Sent::Done => Ok(()),
            Sent::Gone => self.lane_gone().await,
            Sent::Full => {
                if guarded(self.cx, &self.term, self.p.send(lane)).await? {
                    Ok(())
                } else {
                    self.lane_gone().await
                }
            }
        }
    }

    /// Sends every lane's staged events, waiting where a lane is full.
    pub(super) async fn send_all(&mut self) -> Result<(), Stop> {
        for lane in 0..self.p.lane_count() {
            if self.p.has_staged_in(lane) {
                self.send(lane).await?;
            }
        }
        Ok(())
    }

    /// Records the event's time (the position by time); true when a switch's overlap
    /// lasts and the memory proves `m` was handed over already.
    fn is_handed_over(&mut self, seq: u64, lane: usize, m: &Message<'_>) -> bool {
        let dedupes = self.cx.settings.secondary.is_some();
        // A Jetstream stamp is the instance's own clock: the position, read without parsing.
        let time = if dedupes || seq.is_multiple_of(64) {
            m.stamp().map(|us| i64::try_from(us / 1000).unwrap_or(i64::MAX / 4)).or_else(|| m.time().and_then(time_ms))
        } else {
            None
        };
        // A PDS clock ahead of this one's (plus the allowance) is not believed.
        let time = time.map(|t| t.min(now_ms().saturating_add(self.cx.skew_ms())));
        if let Some(t) = time {
            self.p.record_time(seq, t);
        }
        let (Some(o), Some(memory)) = (&mut self.overlap, &self.memory) else { return false };
        o.drops(memory, lane, Key::of(m))
    }

    /// With repo sync: a `#sync` naming a rev other than the last one handed over of its
    /// repo (the repo's state moved without its commits), and an `#account` that turns
    /// active again after this term saw it inactive (nobody knows what it missed), queue
    /// the repo's resync. Kept by the store (in the lane) before the cursor passes them.
    fn repair_triggers(&mut self, seq: u64, lane: usize, m: &Message<'_>) {
        let Some(d) = self.cx.shape.desync.as_ref().filter(|d| d.resyncs()) else { return };
        match m {
            Message::Sync(s) => {
                let last = self.memory.as_ref().and_then(|mem| mem.last_commit(lane, s.did));
                if let (Some(last), Some(rev)) = (last, crate::chain::tid(s.rev))
                    && last != rev
                {
                    tracing::info!(
                        repo = s.did,
                        rev = s.rev,
                        seq,
                        "a #sync names another state than the last commit handed over: resyncing the repo"
                    );
                    d.mark_repo(seq, s.did, crate::resync::reason::SYNC, Some(s.rev));
                }
            }
            Message::Account(a) if !a.active => {
                if self.inactive.len() >= INACTIVE_MAX {
                    self.inactive.clear();
                }
                self.inactive.insert(a.did.to_owned());
            }
            Message::Account(a) if self.inactive.remove(a.did) || d.is_gone(a.did) => {
                tracing::info!(repo = a.did, seq, "the account is active again: resyncing the repo");
                d.mark_repo(seq, a.did, crate::resync::reason::REACTIVATED, None);
            }
            Message::Identity(i) if d.is_gone(i.did) => {
                d.mark_repo(seq, i.did, crate::resync::reason::IDENTITY, None);
            }
            _ => {}
        }
    }

    /// True when a snapshot handed over in this term covers `m` (a commit or `#sync` of
    /// its repo at or below the snapshot's rev).
    fn is_covered(&self, m: &Message<'_>) -> bool {
        let (did, rev) = match m {
            Message::Commit(c) => (c.repo, c.rev),
            Message::Sync(s) => (s.did, s.rev),
            _ => return false,
        };
        match (self.covered.get(did), crate::chain::tid(rev)) {
            (Some(&at), Some(r)) => r <= at,
            _ => false,
        }
    }

    /// Without verification, intake records what it hands over (every commit counts,
    /// whether the filter keeps it or not; with verification the lanes record what
    /// verified). Returns the break to carry on the event when breaks are emitted.
    fn chain_check(&mut self, seq: u64, lane: usize, m: &Message<'_>) -> Option<ChainBreak> {
        if self.cx.shape.verifier.is_some() {
            return None;
        }
        let b = self.memory.as_ref()?.record(lane, Key::of(m))?;
        let policy = self.cx.shape.chain_breaks?;
        crate::chain::report(&b, seq, self.role.as_str());
        if let Some(d) = self.cx.shape.desync.as_ref().filter(|d| d.resyncs()) {
            // Kept by the store (in the lane) before the cursor passes this commit.
            d.mark_repo(seq, &b.repo, crate::verify::Reason::Chain.as_str(), Some(&b.rev));
        }
        (policy == ChainBreaks::Emit).then_some(b)
    }

    /// Steps the window over a seq that is not handed to a lane.
    pub(super) fn pass(&mut self, seq: u64) -> Result<(), Stop> {
        match self.p.pass(seq) {
            Ok(()) => Ok(()),
            Err(error) => Err(Fatal::Watermark { seq, error }.into()),
        }
    }
}
