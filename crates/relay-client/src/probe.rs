//! Finding where to resume on a relay by event time.
//!
//! Relays number events independently, so a position on one relay means nothing on
//! another; the event *time* does. [`find_start`] searches the target relay's backfill
//! window for a cursor whose following events are not newer than a target time: each
//! probe opens `cursor=N` and reads the times of up to [`PROBE_EVENTS`] events after it.
//! `FutureCursor` bounds the search from above; a window whose oldest events are already
//! newer than the target is a gap, reported with the oldest time it does reach.
//!
//! **Event time is a PDS's clock, not an index.** One PDS running an hour slow or fast
//! puts single events far out of place. No decision rests on one reading: a probe
//! judges a cursor by the *upper quartile* of the times of the events after it (a cursor
//! is before the target only when most events after it are), so isolated events with
//! skewed clocks cannot move the answer, and every cursor the search keeps as "not newer
//! than the target" was measured so. Erring early only adds overlap (the switch dedupe
//! drops what was handed over); erring late would lose events, so ties go early.

use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use tokio::time::timeout;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::frame::{self, Frame};
use crate::{Message, RelayUrl};

/// How many events a probe reads after its cursor (their upper quartile decides).
pub const PROBE_EVENTS: usize = 9;

/// How long a probe waits for each further event after the first (a backfill arrives at
/// once; at the head, fewer events are read).
const NEXT_EVENT_WAIT: Duration = Duration::from_millis(150);

/// What the first frames after a cursor say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The events after the cursor: the first one's seq, and the upper quartile of their
    /// relay times (Unix ms; see [`high_quartile`]).
    Event {
        /// The first event's seq.
        seq: u64,
        /// The upper quartile of the relay times read, Unix milliseconds.
        time_ms: i64,
        /// The relay said `OutdatedCursor` first (the window starts after the cursor).
        outdated: bool,
    },
    /// The cursor is past the relay's head.
    Future,
    /// Nothing arrived before the timeout (the cursor is at the head).
    Empty,
}

/// Why a search found no start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The relay's window does not reach back to the target time.
    #[error("the relay's backfill window starts at {oldest_ms} ms (seq {oldest_seq}), after the needed time")]
    Gap {
        /// The oldest event the relay still serves: its time…
        oldest_ms: i64,
        /// …and its seq.
        oldest_seq: u64,
    },
    /// The relay serves no events at all.
    #[error("the relay serves no events to search")]
    NoEvents,
    /// A probe could not connect or read.
    #[error("probe at cursor {cursor}: {reason}")]
    Failed {
        /// The cursor probed.
        cursor: u64,
        /// What went wrong (never the URL: it may carry credentials).
        reason: String,
    },
}

/// A cursor found by [`find_start`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// Subscribe with this cursor: the first event after it is not newer than the target.
    pub cursor: u64,
    /// How many probes the search took.
    pub probes: u32,
    /// How long it took.
    pub elapsed: Duration,
}

/// An RFC 3339 relay time as Unix milliseconds.
#[must_use]
pub fn time_ms(t: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

/// The lower quartile of `times`: an "at least this late" reading that isolated fast
/// clocks cannot raise (up to three quarters of the readings may be ahead) and a few slow
/// ones only lower (the safe side, for a position to resume from).
#[must_use]
pub fn low_quartile(times: &mut [i64]) -> Option<i64> {
    if times.is_empty() {
        return None;
    }
    times.sort_unstable();
    Some(times[(times.len() - 1) / 4])
}

/// The upper quartile of `times`: at or below a target only when most readings are, so
/// a few slow clocks cannot make a cursor look earlier than it is.
#[must_use]
pub fn high_quartile(times: &mut [i64]) -> Option<i64> {
    if times.is_empty() {
        return None;
    }
    times.sort_unstable();
    let n = times.len() - 1;
    Some(times[n - n / 4])
}

/// Opens `cursor` on `url` and reads the events after it: up to [`PROBE_EVENTS`], the
/// first within `wait` (else `Empty`: the cursor is at the head), each further one within
/// a short gap. `FutureCursor` gives `Future`.
pub async fn first_after(url: &RelayUrl, cursor: u64, wait: Duration) -> Result<Probe, ProbeError> {
    let failed = |reason: String| ProbeError::Failed { cursor, reason };
    let target = url.subscribe_url(Some(cursor));
    let (mut ws, _) = timeout(wait, tokio_tungstenite::connect_async(target.as_str()))
        .await
        .map_err(|_| failed("connect timed out".into()))?
        .map_err(|e| failed(format!("connect: {}", crate::client::describe(&e))))?;
    let mut deadline = Instant::now() + wait;
    let mut outdated = false;
    let mut first: Option<u64> = None;
    let mut times: Vec<i64> = Vec::with_capacity(PROBE_EVENTS);
    let out = loop {
        let msg = match tokio::time::timeout_at(deadline.into(), ws.next()).await {
            Err(_) => break Ok(()),
            // What was read still counts when the relay closes or fails after it.
            Ok(None | Some(Ok(WsMessage::Close(_)) | Err(_))) if first.is_some() => break Ok(()),
            Ok(None | Some(Ok(WsMessage::Close(_)))) => break Err(failed("closed before any event".into())),
            Ok(Some(Err(e))) => break Err(failed(crate::client::describe(&e))),
            Ok(Some(Ok(m))) => m,
        };
        let WsMessage::Binary(b) = msg else { continue };
        let decoded = frame::decode(&b);
        if first.is_some() && !matches!(decoded, Ok(Frame::Message(_))) {
            // An error frame or an undecodable one after some events: judge by those.
            break Ok(());
        }
        match decoded {
            Ok(Frame::Error(e)) if e.error == "FutureCursor" => {
                let _ = timeout(Duration::from_millis(200), ws.close(None)).await;
                return Ok(Probe::Future);
            }
            Ok(Frame::Error(e)) => break Err(failed(format!("error frame {}", e.error))),
            Ok(Frame::Message(Message::Info(i))) => outdated |= i.name == "OutdatedCursor",
            Ok(Frame::Message(m)) => {
                if let (Some(seq), Some(t)) = (m.seq(), m.time().and_then(time_ms)) {
                    first.get_or_insert(seq);
                    times.push(t);
                    if times.len() >= PROBE_EVENTS {
                        break Ok(());
                    }
                    deadline = Instant::now() + NEXT_EVENT_WAIT.min(wait);
                }
            }
            Err(e) => break Err(failed(format!("undecodable frame: {e}"))),
        }
    };
    let _ = timeout(Duration::from_millis(200), ws.close(None)).await;
    out?;
    Ok(match (first, high_quartile(&mut times)) {
        (Some(seq), Some(time_ms)) => Probe::Event { seq, time_ms, outdated },
        _ => Probe::Empty,
    })
}

/// A cursor on `url` whose following events are (by upper quartile) at or before `target_ms`,
/// searched in at most `max_probes` probes of `wait` each: the newest such cursor the
/// probes found (when they run out, an earlier one: more overlap, never a gap).
pub async fn find_start(url: &RelayUrl, target_ms: i64, max_probes: u32, wait: Duration) -> Result<Found, ProbeError> {
    let t0 = Instant::now();
    let mut probes = 1;
    // The oldest events the window serves (the upper quartile of their times).
    let (oldest_seq, oldest_ms) = match first_after(url, 0, wait).await? {
        Probe::Event { seq, time_ms, .. } => (seq, time_ms),
        Probe::Future | Probe::Empty => return Err(ProbeError::NoEvents),
    };
    if oldest_ms > target_ms {
        return Err(ProbeError::Gap { oldest_ms, oldest_seq });
    }
    // lo: a cursor whose next event is not newer than the target; hi: one whose next
    // event is newer, or past the head.
    let mut lo = oldest_seq - 1;
    let mut hi: Option<u64> = None;
    let mut step: u64 = 1024;
    while probes < max_probes.max(2) {
        let c = match hi {
            Some(h) if h - lo <= 1 => break,
            Some(h) => lo + (h - lo) / 2,
            None => lo.saturating_add(step),
        };
        probes += 1;
        match first_after(url, c, wait).await? {
            Probe::Event { seq, time_ms, .. } if time_ms <= target_ms => {
                lo = seq - 1;
                if hi.is_none() {
                    step = step.saturating_mul(2);
                }
            }
            Probe::Event { .. } | Probe::Future | Probe::Empty => hi = Some(c),
        }
    }
    Ok(Found { cursor: lo, probes, elapsed: t0.elapsed() })
}
