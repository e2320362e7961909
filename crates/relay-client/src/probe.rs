//! Finding where to resume on a relay by event time.
//!
//! Relays number events independently, so a position on one relay means nothing on
//! another; the event *time* does. [`find_start`] searches the target relay's backfill
//! window for the newest cursor whose next event is not newer than a target time: each
//! probe opens `cursor=N` and reads the first event's time. `FutureCursor` bounds the
//! search from above; a window whose oldest event is already newer than the target is a
//! gap, reported with the oldest time it does reach.

use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use tokio::time::timeout;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::frame::{self, Frame};
use crate::{Message, RelayUrl};

/// What the first frames after a cursor say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The first event after the cursor: its seq and relay time (Unix ms).
    Event {
        /// Its seq.
        seq: u64,
        /// Its relay time, Unix milliseconds.
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

/// Opens `cursor` on `url` and reads up to the first event (or `FutureCursor`, or
/// nothing within `wait`).
pub async fn first_after(url: &RelayUrl, cursor: u64, wait: Duration) -> Result<Probe, ProbeError> {
    let failed = |reason: String| ProbeError::Failed { cursor, reason };
    let target = url.subscribe_url(Some(cursor));
    let (mut ws, _) = timeout(wait, tokio_tungstenite::connect_async(target.as_str()))
        .await
        .map_err(|_| failed("connect timed out".into()))?
        .map_err(|e| failed(format!("connect: {}", crate::client::describe(&e))))?;
    let deadline = Instant::now() + wait;
    let mut outdated = false;
    let out = loop {
        let msg = match tokio::time::timeout_at(deadline.into(), ws.next()).await {
            Err(_) => break Ok(Probe::Empty),
            Ok(None | Some(Ok(WsMessage::Close(_)))) => break Err(failed("closed before any event".into())),
            Ok(Some(Err(e))) => break Err(failed(crate::client::describe(&e))),
            Ok(Some(Ok(m))) => m,
        };
        let WsMessage::Binary(b) = msg else { continue };
        match frame::decode(&b) {
            Ok(Frame::Error(e)) if e.error == "FutureCursor" => break Ok(Probe::Future),
            Ok(Frame::Error(e)) => break Err(failed(format!("error frame {}", e.error))),
            Ok(Frame::Message(Message::Info(i))) => outdated |= i.name == "OutdatedCursor",
            Ok(Frame::Message(m)) => {
                if let (Some(seq), Some(t)) = (m.seq(), m.time().and_then(time_ms)) {
                    break Ok(Probe::Event { seq, time_ms: t, outdated });
                }
            }
            Err(e) => break Err(failed(format!("undecodable frame: {e}"))),
        }
    };
    let _ = timeout(Duration::from_millis(200), ws.close(None)).await;
    out
}

/// The newest cursor on `url` whose next event is at or before `target_ms`, in at most
/// `max_probes` probes of `wait` each. With probes left over the answer is exact; when
/// they run out it is an earlier cursor (more overlap, never a gap).
pub async fn find_start(url: &RelayUrl, target_ms: i64, max_probes: u32, wait: Duration) -> Result<Found, ProbeError> {
    let t0 = Instant::now();
    let mut probes = 1;
    // The oldest event the window serves.
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
