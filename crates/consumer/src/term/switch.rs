//! Relay switches: settle and commit the relay it leaves, find where to resume on the
//! target (its stored cursor inside the overlap, else by time), or refuse a switch that
//! would lose events and stay.

use std::time::{Duration, Instant};

use relay_client::RelayRole;
use relay_client::client::SwitchReason;
use relay_client::probe::{ProbeError, RelayWindow, Sample, find_start};

use super::start::resume_point;
use super::{Leader, Phase, Rewind, Stop, guarded};
use crate::continuity::{self, GapPolicy, Overlap, Start};
use crate::metrics as m;

/// How often a standing refusal is logged again.
const REFUSAL_LOG_EVERY: Duration = Duration::from_mins(1);

/// Why a relay switch was refused: switching would lose events, and the relay the
/// leader had may come back. The leader stays, retries it, and is not ready meanwhile.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The target's window does not reach back to the committed position.
    Gap {
        /// The relay switched to.
        to: RelayRole,
        /// The relay time needed (RFC 3339).
        needed: String,
        /// The oldest time it serves (RFC 3339).
        oldest: String,
        /// The oldest seq it serves.
        oldest_seq: u64,
    },
    /// Finding where to resume on the target failed (it may be down too).
    Probe {
        /// The relay switched to.
        to: RelayRole,
        /// What went wrong.
        source: ProbeError,
    },
    /// No event time and no stored cursor on the target: no position to carry over.
    Unplaced {
        /// The relay switched to.
        to: RelayRole,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Gap { to, needed, oldest, oldest_seq } => write!(
                f,
                "the {to} relay serves events only from {oldest} (seq {oldest_seq}), but events from {needed} on are \
                 needed: switching would lose those in between (to accept such a gap set FIREKEEPER_GAP=live, or \
                 choose the start with `firekeeper cursor set --relay {to} <seq>`)"
            ),
            Self::Probe { to, source } => write!(f, "finding where to resume on the {to} relay: {source}"),
            Self::Unplaced { to } => write!(
                f,
                "no event time is known yet and the {to} relay has no stored cursor, so nothing places the position \
                 there (its live tail would skip the backlog): set one with `firekeeper cursor set --relay {to} <seq>`, \
                 or FIREKEEPER_GAP=live to start at its oldest event"
            ),
        }
    }
}

/// A standing refusal.
#[derive(Debug)]
pub(super) struct Refused {
    /// When the target was last probed.
    probed: Instant,
    /// When the refusal was last logged.
    logged: Instant,
}

/// Unix ms as RFC 3339 (for messages).
fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| format!("{ms} ms"))
}

impl Leader<'_, '_> {
    /// The client asks to switch from `from` to `to`: settle and commit `from`, then
    /// resume on `to` where the committed position is, or refuse and stay.
    pub(super) async fn on_switch(&mut self, from: RelayRole, to: RelayRole, reason: SwitchReason) -> Result<(), Stop> {
        // While a refused switch stands, the target is probed again at most once per
        // probe interval; in between, the relay it had is retried.
        let every = self.cx.settings.client.probe_interval;
        if let Phase::Refused { refused, .. } = &self.phase
            && refused.probed.elapsed() < every
        {
            self.sub.stay();
            return Ok(());
        }
        let kind = if reason == SwitchReason::Failback { "failback" } else { "failover" };
        metrics::counter!(m::RELAY_SWITCHES, "to" => to.as_str(), "kind" => kind).increment(1);
        self.settle().await?;
        tracing::info!(
            from = from.as_str(),
            to = to.as_str(),
            committed = self.p.committed(),
            "relay switch: committed the current relay first"
        );
        let at = self.p.time_at_cursor();
        match self.switch_start(to, at).await {
            Ok(Ok(cursor)) => {
                self.clear_refusal();
                self.restart_on(to, cursor);
                self.begin(to, cursor);
                self.overlap = self.memory.is_some().then(|| Overlap::after(at, self.cx.overlap_ms()));
                Ok(())
            }
            Ok(Err(why)) => {
                // The settled pipeline's lanes are closed: a fresh one on the same relay,
                // from the committed position.
                let start = self.p.committed().or(self.sub.cursor());
                self.restart_on(from, start);
                self.refuse(from, &why, reason);
                Ok(())
            }
            Err(s) => Err(s),
        }
    }

    /// A fresh pipeline on `role` from `start` after the current one settled, carrying
    /// the position by time over (relay switches, a relay going live, a refused switch).
    pub(super) fn restart_on(&mut self, role: RelayRole, start: Option<u64>) {
        let at = self.p.time_at_cursor();
        self.p = self.pipeline(role, start);
        self.p.carry_time(at);
    }

    /// Where to resume on `to` after committing the current relay at relay time `at`: its
    /// stored cursor when that is inside the overlap, else found by time on the relay.
    /// A switch that would lose events (a real gap under `GapPolicy::Fail`, a relay that
    /// cannot be probed, no position known at all) is refused instead.
    async fn switch_start(&mut self, to: RelayRole, at: Option<i64>) -> Result<Result<Option<u64>, Refusal>, Stop> {
        let (cx, opts) = (self.cx, &self.cx.settings.options);
        let stored = resume_point(cx, &self.term, to, false).await?;
        let Some(at) = at else {
            // Nothing delivered carried a time yet: there is no position to carry over.
            // The target's own stored cursor is a position on it; without one, the live
            // tail would skip everything after the committed cursor.
            if stored.is_some() {
                return Ok(Ok(stored));
            }
            if opts.gap == GapPolicy::Live {
                tracing::error!(
                    relay = to.as_str(),
                    "no event time is known yet and the relay switched to has no stored cursor: starting at its oldest \
                     event (gap policy `live`); what it no longer serves is missing"
                );
                metrics::counter!(m::GAPS, "reason" => "switch_unplaced").increment(1);
                self.gap_accepted("switch");
                return Ok(Ok(Some(0)));
            }
            return Ok(Err(Refusal::Unplaced { to }));
        };
        let fp = cx.url(to).fingerprint();
        let overlap = cx.overlap_ms();
        let target = at - overlap;
        let stored_time = match guarded(cx, &self.term, cx.store.read_time(fp)).await? {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "reading the stored time of the relay switched to; probing instead");
                None
            }
        };
        if let (Some(c), Some(t)) = (stored, stored_time)
            && (target..=at).contains(&t)
        {
            tracing::info!(relay = to.as_str(), cursor = c, "switch: the stored cursor is inside the overlap");
            return Ok(Ok(Some(c)));
        }
        if let relay_client::Input::Jetstream(js) = &cx.settings.client.input {
            return self.jetstream_start(to, js, at, target).await;
        }
        let wait = cx.settings.client.connect_timeout;
        let memory = self.memory.clone();
        let lanes = self.p.lane_count();
        let search = continuity::search(memory.as_deref(), at, overlap, opts.switch_max_probes);
        let url = cx.url(to);
        // Boxed: the probe's WebSocket state would otherwise sit in every enclosing future.
        let probe = Box::pin(async move {
            let judge = |x: &Sample| continuity::judge(memory.as_deref(), lanes, x);
            find_start(&mut RelayWindow::new(url, wait), &search, judge).await
        });
        let found = guarded(cx, &self.term, probe).await?;
        if let Ok(f) = &found {
            metrics::counter!(m::SWITCH_PROBES).increment(u64::from(f.probes));
            tracing::info!(
                relay = to.as_str(),
                cursor = f.cursor,
                probes = f.probes,
                moved_back = f.moved_back,
                probe_ms = f.elapsed.as_millis() as u64,
                overlap_ms = overlap,
                "switch: found where to resume, the events before it shown handed over"
            );
        }
        match continuity::decide(found, at, cx.skew_ms(), opts.gap) {
            Start::Found(cursor) => Ok(Ok(Some(cursor))),
            Start::Short { cursor, overlap_ms } => {
                metrics::counter!(m::SWITCH_OVERLAP_SHORT).increment(1);
                tracing::warn!(
                    relay = to.as_str(),
                    cursor,
                    overlap_ms,
                    wanted_ms = overlap,
                    "switch: the relay's window holds less than the overlap but reaches back past the position; \
                     starting at its oldest event"
                );
                Ok(Ok(Some(cursor)))
            }
            Start::Refused { oldest_ms, oldest_seq } => {
                Ok(Err(Refusal::Gap { to, needed: rfc3339(at), oldest: rfc3339(oldest_ms), oldest_seq }))
            }
            Start::Gap { cursor, oldest_ms } => {
                let (needed, oldest) = (rfc3339(at), rfc3339(oldest_ms));
                metrics::counter!(m::GAPS, "reason" => "switch").increment(1);
                let gap = format!("{} relay: events from {needed} to {oldest} are missing", to.as_str());
                tracing::error!(relay = to.as_str(), from = %needed, to = %oldest, "accepted gap (gap policy `live`) on a relay switch");
                cx.status.update(|s| s.last_gap = Some(gap));
                self.gap_accepted("switch");
                Ok(Ok(Some(cursor)))
            }
            Start::Failed(source) => Ok(Err(Refusal::Probe { to, source })),
        }
    }

    /// Where to resume on another Jetstream instance: its stamps differ from the one
    /// left by a few seconds at most, so it starts from the position less the overlap in
    /// time (no search: the instance places a time cursor itself), and the term's memory
    /// drops what was handed over already while the overlap lasts. An instance whose
    /// window does not reach back that far is a gap, refused or accepted by the policy.
    async fn jetstream_start(
        &mut self,
        to: RelayRole,
        js: &relay_client::jetstream::Options,
        at: i64,
        target_ms: i64,
    ) -> Result<Result<Option<u64>, Refusal>, Stop> {
        // `at` is the position on the instance left; the one switched to stamps the same
        // events up to `FIREKEEPER_SWITCH_SKEW_MS` apart.
        let cx = self.cx;
        let from_us = u64::try_from(target_ms.max(0)).unwrap_or(0).saturating_mul(1000);
        let wait = cx.settings.client.connect_timeout;
        // Boxed: the connection's state would otherwise sit in every enclosing future.
        let ask = Box::pin(relay_client::jetstream::serves_from(cx.url(to), js, from_us, wait));
        match guarded(cx, &self.term, ask).await? {
            Ok(None) => {
                tracing::info!(
                    relay = to.as_str(),
                    cursor = from_us,
                    "switch: resuming on the Jetstream instance by time"
                );
                Ok(Ok(Some(from_us)))
            }
            Ok(Some(oldest)) => {
                let oldest_ms = i64::try_from(oldest / 1000).unwrap_or(i64::MAX);
                // Its window holds less than the overlap but reaches back past the
                // position (by more than instances' stamps differ): no gap.
                if oldest_ms.saturating_add(cx.skew_ms()) <= at {
                    metrics::counter!(m::SWITCH_OVERLAP_SHORT).increment(1);
                    tracing::warn!(
                        relay = to.as_str(),
                        cursor = oldest,
                        "switch: the Jetstream instance's window holds less than the overlap but reaches back past the \
                         position; starting at its oldest event"
                    );
                    return Ok(Ok(Some(oldest)));
                }
                if cx.settings.options.gap != GapPolicy::Live {
                    return Ok(Err(Refusal::Gap {
                        to,
                        needed: rfc3339(at),
                        oldest: rfc3339(oldest_ms),
                        oldest_seq: oldest,
                    }));
                }
                let gap = format!(
                    "{} instance: events from {} to {} are missing",
                    to.as_str(),
                    rfc3339(at),
                    rfc3339(oldest_ms)
                );
                tracing::error!(relay = to.as_str(), oldest, "accepted gap (gap policy `live`) on a Jetstream switch");
                metrics::counter!(m::GAPS, "reason" => "switch").increment(1);
                cx.status.update(|s| s.last_gap = Some(gap));
                self.gap_accepted("switch");
                Ok(Ok(Some(oldest)))
            }
            Err(reason) => Ok(Err(Refusal::Probe { to, source: ProbeError::Failed { cursor: from_us, reason } })),
        }
    }

    /// Stays on the relay it had after a refused switch: counts the refusal (logged at
    /// most once a minute) and resumes there from the committed position. A refused
    /// failover is shown (`/status`, not ready, the gauge): nothing flows until the relay
    /// returns. A refused failback is not: the secondary still serves.
    fn refuse(&mut self, from: RelayRole, why: &Refusal, reason: SwitchReason) {
        metrics::counter!(m::SWITCH_REFUSED).increment(1);
        let now = Instant::now();
        let (last_logged, placing) = match std::mem::replace(&mut self.phase, Phase::Streaming) {
            Phase::Refused { refused, placing } => (Some(refused.logged), placing),
            Phase::Placing(why) => (None, Some(why)),
            Phase::Streaming => (None, None),
        };
        let log = last_logged.is_none_or(|at| now.duration_since(at) >= REFUSAL_LOG_EVERY);
        if reason == SwitchReason::Failback {
            if log {
                tracing::warn!(relay = from.as_str(), refused = %why, "failback refused: staying on the secondary relay");
            }
        } else {
            if log {
                tracing::error!(
                    relay = from.as_str(),
                    refused = %why,
                    "relay switch refused: staying on this relay and retrying it; not ready until events flow again"
                );
            }
            metrics::gauge!(m::SWITCH_REFUSED_NOW).set(1.0);
            self.cx.status.set_refused_switch(Some(why.to_string()));
        }
        let logged = if log { now } else { last_logged.unwrap_or(now) };
        self.phase = Phase::Refused { refused: Refused { probed: now, logged }, placing };
        self.sub.stay();
    }

    /// Events flow again (or a switch went through) after a refused switch; the
    /// placement a refusal held over is still owed.
    pub(super) fn clear_refusal(&mut self) {
        if let Phase::Refused { placing, .. } = &self.phase {
            self.phase = placing.map_or(Phase::Streaming, Phase::Placing);
            tracing::info!(relay = self.role.as_str(), "events flow again after a refused relay switch");
            metrics::gauge!(m::SWITCH_REFUSED_NOW).set(0.0);
            self.cx.status.set_refused_switch(None);
        }
    }

    /// The relay went live after rejecting the cursor (`FutureCursor` under the `live`
    /// policy): live seqs may be lower than anything delivered so far, so finish and
    /// commit the old numbering, then start a fresh window placed by the first live seq.
    pub(super) async fn went_live(&mut self, rejected: Option<u64>) -> Result<(), Stop> {
        self.settle().await?;
        self.restart_on(self.role, None);
        let why = Rewind::WentLive(rejected);
        match &mut self.phase {
            Phase::Refused { placing, .. } => *placing = Some(why),
            other => *other = Phase::Placing(why),
        }
        Ok(())
    }
}
