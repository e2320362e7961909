//! Finding where to resume on a relay after a switch.
//!
//! Relays number events independently, so a position on one relay means nothing on
//! another. What carries over is the *content*: each repo's events keep their order on
//! every relay and its revs only grow, so whether an event on the target relay was
//! already handed over is decided by the repo's delivered rev, never by a clock. Event
//! times are PDS clocks — skewed one by one, in runs, and in bursts when a PDS delivers a
//! backlog — and serve only to bound the search where content cannot say.
//!
//! [`find_start`] reads the target relay's backfill window through a [`Window`] (each read
//! opens `cursor=N` and takes the events after it) and asks the caller to [`Judged`] each
//! event it reads (delivered, not delivered, or unknown to the caller's memory). A cursor
//! is *before the switch point* when no event read after it is known to be undelivered
//! and the unknown ones are, by the upper quartile of their times, not newer than
//! [`Search::unknown_before_ms`]. The search:
//!
//! 1. reads the oldest events the window serves: if they are already after the switch
//!    point, the window does not reach back ([`ProbeError::Gap`], `proven` when an event
//!    there is known to be undelivered);
//! 2. finds the last cursor before the switch point by exponential steps then bisection;
//! 3. proves it: reads the [`Search::stretch`] events just before the cursor and moves the
//!    cursor back before any that is not shown delivered, until a whole stretch is.
//!
//! What it proves: no event of the target relay within the stretch before the start is
//! undelivered by content. What it assumes: the two relays' orders differ by less than a
//! stretch around the switch point (each relay receives from the same PDSs, reordering by
//! network delays only), and events this process cannot judge (repos it never delivered)
//! are placed by their clocks. Erring early only adds overlap (dropped by content);
//! erring late would lose events, so every tie goes early.

use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use tokio::time::timeout;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::frame::{self, Frame, Kind};
use crate::{Message, RelayUrl};

/// How many events a bisection probe reads after its cursor.
pub const PROBE_EVENTS: usize = 9;

/// How long a read waits for each further event after the first (a backfill arrives at
/// once; at the head, fewer events are read).
const NEXT_EVENT_WAIT: Duration = Duration::from_millis(150);

/// One event read from a relay's window: what placing it by time and judging it by
/// content need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Its seq on that relay.
    pub seq: u64,
    /// `#commit`, `#sync`, …
    pub kind: Kind,
    /// The repo.
    pub did: Option<String>,
    /// The rev (`#commit`, `#sync`).
    pub rev: Option<String>,
    /// The event time as sent (RFC 3339).
    pub time: Option<String>,
    /// The event time, Unix ms.
    pub time_ms: Option<i64>,
}

impl Sample {
    /// The sample of a decoded message; `None` for messages without a seq (`#info`).
    #[must_use]
    pub fn of(m: &Message<'_>) -> Option<Self> {
        let (rev, seq) = match m {
            Message::Commit(c) => (Some(c.rev), c.seq),
            Message::Sync(s) => (Some(s.rev), s.seq),
            _ => (None, m.seq()?),
        };
        Some(Self {
            seq,
            kind: m.kind(),
            did: m.did().map(str::to_owned),
            rev: rev.map(str::to_owned),
            time: m.time().map(str::to_owned),
            time_ms: m.time().and_then(time_ms),
        })
    }
}

/// What a read of `cursor=N` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// The events after the cursor (at least one), in the relay's order.
    Events(Vec<Sample>),
    /// The cursor is past the relay's head (`FutureCursor`).
    Future,
    /// Nothing arrived before the timeout (the cursor is at the head).
    Empty,
}

/// A relay's backfill window, read by cursor: the seam between the search and the
/// network (a WebSocket in [`RelayWindow`], a model in tests).
pub trait Window: Send {
    /// Opens `cursor` and reads up to `max` events after it.
    fn read(&mut self, cursor: u64, max: usize) -> impl Future<Output = Result<Read, ProbeError>> + Send;
}

/// What the caller's memory says of one event read from the target relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// Handed over, and recorded so by the memory itself (not only implied by a later rev
    /// of its repo): proof that the memory was recording where this event stands.
    Recorded,
    /// Already handed over (its repo's delivered rev is at or past it).
    Delivered,
    /// Known not to be handed over (its repo's delivered rev is before it).
    Undelivered,
    /// Not in the memory (a repo it never delivered): placed by its clock.
    Unknown,
}

/// Why a search found no start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The relay's window does not reach back to the switch point.
    #[error("the relay's backfill window starts at {oldest_ms} ms (seq {oldest_seq}), after the switch point")]
    Gap {
        /// The oldest event the relay still serves: its time (upper quartile)…
        oldest_ms: i64,
        /// …and its seq.
        oldest_seq: u64,
        /// An event the window starts with is known by content to be undelivered (not
        /// only by its clock): something before the window was missed.
        proven: bool,
        /// An event the window starts with is shown delivered by content: the window
        /// reaches back into what was handed over (clocks may then say by how much).
        shown: bool,
    },
    /// The relay serves no events at all.
    #[error("the relay serves no events to search")]
    NoEvents,
    /// The probes ran out before a stretch before the start was shown delivered.
    #[error("no start proven within {probes} probes (the last candidate was cursor {cursor})")]
    Unproven {
        /// The probes spent.
        probes: u32,
        /// The last candidate.
        cursor: u64,
    },
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
    /// Subscribe with this cursor.
    pub cursor: u64,
    /// How many probes the search took.
    pub probes: u32,
    /// How far the proof moved the bisection's answer back (seqs).
    pub moved_back: u64,
    /// How long it took.
    pub elapsed: Duration,
}

/// What [`find_start`] looks for.
#[derive(Debug, Clone, Copy)]
pub struct Search {
    /// Events the memory cannot judge count as delivered when (by the upper quartile of
    /// their times) they are not newer than this (Unix ms).
    pub unknown_before_ms: i64,
    /// At most this many reads.
    pub max_probes: u32,
    /// How many events just before the start must be shown delivered (0: none, the
    /// search is by time alone).
    pub stretch: usize,
}

/// Reads at most this many events at once while proving a start.
const STRETCH_MAX: usize = 4096;

pub use atproto_data::time::time_ms;

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

/// A relay's window over WebSocket: each read is one connection.
#[derive(Debug, Clone)]
pub struct RelayWindow<'a> {
    url: &'a RelayUrl,
    wait: Duration,
}

impl<'a> RelayWindow<'a> {
    /// Reads of `url`, waiting up to `wait` to connect and for the first event.
    #[must_use]
    pub fn new(url: &'a RelayUrl, wait: Duration) -> Self {
        Self { url, wait }
    }
}

impl Window for RelayWindow<'_> {
    async fn read(&mut self, cursor: u64, max: usize) -> Result<Read, ProbeError> {
        read_relay(self.url, cursor, max, self.wait).await
    }
}

/// Opens `cursor` on `url` and reads up to `max` events after it: the first within `wait`
/// (else `Empty`: the cursor is at the head), each further one within a short gap.
/// `FutureCursor` gives `Future`.
async fn read_relay(url: &RelayUrl, cursor: u64, max: usize, wait: Duration) -> Result<Read, ProbeError> {
    let failed = |reason: String| ProbeError::Failed { cursor, reason };
    let target = url.subscribe_url(Some(cursor));
    let (mut ws, _) = timeout(wait, tokio_tungstenite::connect_async(target.as_str()))
        .await
        .map_err(|_| failed("connect timed out".into()))?
        .map_err(|e| failed(format!("connect: {}", crate::client::describe(&e))))?;
    let mut deadline = Instant::now() + wait;
    let mut samples: Vec<Sample> = Vec::with_capacity(max.min(STRETCH_MAX));
    let out = loop {
        let msg = match tokio::time::timeout_at(deadline.into(), ws.next()).await {
            Err(_) => break Ok(()),
            // What was read still counts when the relay closes or fails after it.
            Ok(None | Some(Ok(WsMessage::Close(_)) | Err(_))) if !samples.is_empty() => break Ok(()),
            Ok(None | Some(Ok(WsMessage::Close(_)))) => break Err(failed("closed before any event".into())),
            Ok(Some(Err(e))) => break Err(failed(crate::client::describe(&e))),
            Ok(Some(Ok(m))) => m,
        };
        let WsMessage::Binary(b) = msg else { continue };
        let decoded = frame::decode(&b);
        if !samples.is_empty() && !matches!(decoded, Ok(Frame::Message(_))) {
            // An error frame or an undecodable one after some events: judge by those.
            break Ok(());
        }
        match decoded {
            Ok(Frame::Error(e)) if e.error == "FutureCursor" => {
                let _ = timeout(Duration::from_millis(200), ws.close(None)).await;
                return Ok(Read::Future);
            }
            Ok(Frame::Error(e)) => break Err(failed(format!("error frame {}", e.error))),
            Ok(Frame::Message(m)) => {
                if let Some(s) = Sample::of(&m) {
                    samples.push(s);
                    if samples.len() >= max {
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
    Ok(if samples.is_empty() { Read::Empty } else { Read::Events(samples) })
}

/// Where the window starts: its oldest event's seq, the upper quartile of the oldest
/// events' times, and whether one of them is shown delivered.
struct Oldest {
    seq: u64,
    ms: i64,
    shown: bool,
}

impl Oldest {
    fn gap(&self, proven: bool) -> ProbeError {
        ProbeError::Gap { oldest_ms: self.ms, oldest_seq: self.seq, proven, shown: self.shown }
    }
}

/// The search's bookkeeping: probes spent and the limit.
struct Budget {
    used: u32,
    max: u32,
}

impl Budget {
    async fn read<W: Window>(&mut self, w: &mut W, cursor: u64, max: usize) -> Result<Read, ProbeError> {
        self.used += 1;
        w.read(cursor, max).await
    }

    fn left(&self) -> u32 {
        self.max.saturating_sub(self.used)
    }
}

/// The caller's judge, and what the reads taught: an event the caller's memory does not
/// hold but that comes after one it recorded is not delivered either (the memory holds
/// everything delivered since it began; what came before it comes before).
struct Content<F> {
    judge: F,
    /// The lowest seq read that the memory recorded.
    first_known: Option<u64>,
}

impl<F: Fn(&Sample) -> Judged> Content<F> {
    fn judge(&mut self, x: &Sample) -> Judged {
        match (self.judge)(x) {
            Judged::Recorded => {
                self.first_known = Some(self.first_known.map_or(x.seq, |f| f.min(x.seq)));
                Judged::Delivered
            }
            Judged::Unknown if self.first_known.is_some_and(|f| x.seq > f) => Judged::Undelivered,
            j => j,
        }
    }

    /// Whether a read places its cursor before the switch point — nothing known
    /// undelivered, and the unknown events not newer (upper quartile) than
    /// `unknown_before_ms` — and whether something in it is known undelivered, and
    /// something known delivered.
    fn before_point(&mut self, samples: &[Sample], s: &Search) -> (bool, bool, bool) {
        let mut unknown: Vec<i64> = Vec::new();
        let (mut bad, mut good) = (false, false);
        for x in samples {
            match self.judge(x) {
                Judged::Delivered | Judged::Recorded => good |= x.did.is_some(),
                Judged::Undelivered => bad = true,
                Judged::Unknown => unknown.push(x.time_ms.unwrap_or(i64::MAX)),
            }
        }
        (!bad && high_quartile(&mut unknown).is_none_or(|t| t <= s.unknown_before_ms), bad, good)
    }
}

/// A cursor on `w` from which no event before it is undelivered, as far as the caller's
/// `judge` and the stretch before it show (see the module doc), in at most
/// `s.max_probes` reads.
pub async fn find_start<W: Window>(
    window: &mut W,
    search: &Search,
    judge: impl Fn(&Sample) -> Judged,
) -> Result<Found, ProbeError> {
    let t0 = Instant::now();
    let mut budget = Budget { used: 0, max: search.max_probes.max(3) };
    let mut content = Content { judge, first_known: None };
    // The oldest events the window serves.
    let oldest = match budget.read(window, 0, PROBE_EVENTS).await? {
        Read::Events(e) => e,
        Read::Future | Read::Empty => return Err(ProbeError::NoEvents),
    };
    let oldest_seq = oldest[0].seq;
    let mut times: Vec<i64> = oldest.iter().filter_map(|x| x.time_ms).collect();
    let oldest_ms = high_quartile(&mut times).unwrap_or(i64::MAX);
    let (before, proven, shown) = content.before_point(&oldest, search);
    let start = Oldest { seq: oldest_seq, ms: oldest_ms, shown };
    if !before {
        return Err(start.gap(proven));
    }
    // lo: a cursor before the switch point; hi: one after it, or past the head. A few
    // reads are kept for the proof.
    let reserve = 6;
    let mut lo = oldest_seq - 1;
    let mut hi: Option<u64> = None;
    let mut step: u64 = 1024;
    while budget.left() > reserve {
        let c = match hi {
            Some(h) if h - lo <= 1 => break,
            Some(h) => lo + (h - lo) / 2,
            None => lo.saturating_add(step),
        };
        match budget.read(window, c, PROBE_EVENTS).await? {
            Read::Events(e) if content.before_point(&e, search).0 => {
                lo = e[0].seq - 1;
                if hi.is_none() {
                    step = step.saturating_mul(2);
                }
            }
            Read::Events(_) | Read::Future | Read::Empty => hi = Some(c),
        }
    }
    let found = lo;
    let lo = prove(window, &mut budget, search, &mut content, lo, &start).await?;
    Ok(Found { cursor: lo, probes: budget.used, moved_back: found - lo, elapsed: t0.elapsed() })
}

/// Moves `start` back until the `search.stretch` events just before it are shown delivered.
/// Reaching the window's start (`oldest`: its seq and time) with fewer shown, the window
/// may begin among undelivered events: a [`ProbeError::Gap`] for the caller's clocks.
async fn prove<W: Window, F: Fn(&Sample) -> Judged>(
    window: &mut W,
    budget: &mut Budget,
    search: &Search,
    content: &mut Content<F>,
    mut start: u64,
    oldest: &Oldest,
) -> Result<u64, ProbeError> {
    let oldest_seq = oldest.seq;
    let need = search.stretch;
    // The events in (from, start] were read and shown delivered: `shown` of them.
    let mut shown = 0usize;
    let mut from = start;
    let mut step = need as u64;
    loop {
        if shown >= need {
            return Ok(start);
        }
        if from < oldest_seq {
            return Err(oldest.gap(false));
        }
        if budget.left() == 0 {
            return Err(ProbeError::Unproven { probes: budget.used, cursor: start });
        }
        let cursor = from.saturating_sub(step).max(oldest_seq - 1);
        let want = usize::try_from(from - cursor).unwrap_or(STRETCH_MAX).min(STRETCH_MAX);
        let samples = match budget.read(window, cursor, want).await? {
            Read::Events(e) => e,
            // The events before `from` are gone (the window moved on meanwhile).
            Read::Future | Read::Empty => return Err(ProbeError::Unproven { probes: budget.used, cursor: start }),
        };
        let n = samples.len();
        let part: Vec<Sample> = samples.into_iter().filter(|x| x.seq <= from).collect();
        let last = part.last().map_or(cursor, |x| x.seq);
        if n < want && part.len() == n && last < from {
            // The read stopped early: what it did not reach now lies after the start
            // (it is streamed and deduplicated), and the part read is judged below.
            if last < start {
                start = last;
                shown = 0;
            }
        }
        step = step.saturating_mul(2).min(STRETCH_MAX as u64);
        // The first event known to be undelivered: the start goes before it.
        let judged: Vec<Judged> = part.iter().map(|x| content.judge(x)).collect();
        let (ok, before) = match judged.iter().position(|j| *j == Judged::Undelivered) {
            Some(0) if part[0].seq == oldest_seq => return Err(oldest.gap(true)),
            Some(bad) => {
                start = part[bad].seq - 1;
                shown = 0;
                (content.before_point(&part[..bad], search).0, bad)
            }
            None => (content.before_point(&part, search).0, part.len()),
        };
        if ok {
            shown += before;
        } else {
            // Unknown events newer than the clocks allow: the start goes before them.
            start = cursor;
            shown = 0;
        }
        from = cursor;
    }
}

/// The oldest-to-target search by time alone (no memory: every event is unknown), for
/// callers that know only a relay time: a cursor whose following events are (by upper
/// quartile) at or before `target_ms`.
pub async fn find_start_by_time(
    url: &RelayUrl,
    target_ms: i64,
    max_probes: u32,
    wait: Duration,
) -> Result<Found, ProbeError> {
    let s = Search { unknown_before_ms: target_ms, max_probes, stretch: 0 };
    find_start(&mut RelayWindow::new(url, wait), &s, |_| Judged::Unknown).await
}
