//! The subscription: one WebSocket at a time to the primary or secondary relay, with
//! connect timeout, ping/pong, stall detection, backoff with jitter, seq ordering and
//! failover.
//!
//! It is pull-driven: nothing is read from the socket until the caller asks for the next
//! item, so a slow consumer pushes back on the relay instead of filling memory.
//! A relay switch is never done behind the caller's back: [`Item::SwitchRelay`] asks the
//! caller to commit the current relay's cursor and then call [`Subscription::start`] with
//! the new relay's own cursor.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_tungstenite::tungstenite::{self, Message as WsMessage, protocol::WebSocketConfig};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use yoke::Yoke;

use crate::backoff::{Backoff, BackoffConfig};
use crate::error::{ConnError, DecodeError, SubscribeError};
use crate::frame::{self, Frame, Message};
use crate::relay_url::RelayUrl;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Which configured relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RelayRole {
    /// The preferred relay.
    Primary,
    /// The fallback relay.
    Secondary,
}

impl RelayRole {
    /// `primary` or `secondary`: how relays are named in logs and metrics.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Primary => "primary",
            Self::Secondary => "secondary",
        }
    }

    fn other(self) -> Self {
        match self {
            Self::Primary => Self::Secondary,
            Self::Secondary => Self::Primary,
        }
    }
}

impl fmt::Display for RelayRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to do when a relay answers `FutureCursor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FutureCursorPolicy {
    /// Stop with [`SubscribeError::FutureCursor`]: an operator must look.
    #[default]
    Fail,
    /// Reconnect without a cursor (live tail), accepting that events may be missed.
    GoLive,
}

/// What to do with a frame that carries a seq but cannot be decoded (or is over the
/// frame limit). Frames without a readable seq (garbage, text) have no place in the
/// sequence and are always counted and skipped: they cannot move the cursor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadFramePolicy {
    /// Stop with [`SubscribeError::BadFrame`] / [`SubscribeError::FrameTooLarge`]: the
    /// cursor stays before the frame until an operator decides.
    #[default]
    Fail,
    /// Count it ([`Notice::BadFrame`] with `skipped: true`) and move past it: the caller
    /// accepts that this one event is lost.
    Skip,
}

/// When skipping an oversized frame, the next connection reads with this limit (or four
/// times the configured one, if larger) only to learn the frame's seq.
pub const OVERSIZE_PROBE_BYTES: usize = 64 << 20;

/// Connection settings. The defaults suit the public Bluesky relays.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// TCP + TLS + WebSocket handshake budget.
    pub connect_timeout: Duration,
    /// How often to ping the relay.
    pub ping_interval: Duration,
    /// How long a ping may go unanswered.
    pub pong_timeout: Duration,
    /// Reconnect when no data frame arrived for this long (pongs do not count: a relay
    /// that answers pings but sends nothing is stuck).
    pub stall_timeout: Duration,
    /// Largest WebSocket message accepted (relays send up to 5 MB).
    pub max_frame_bytes: usize,
    /// Reconnect delays.
    pub backoff: BackoffConfig,
    /// A connection that has lasted this long and delivered a frame resets the backoff.
    pub healthy_after: Duration,
    /// Consecutive failed connections on one relay before switching to the other.
    pub failover_after: u32,
    /// While on the secondary, how often to probe the primary.
    pub probe_interval: Duration,
    /// Consecutive good probes before failing back to the primary.
    pub probe_successes: u32,
    /// How long a probe connection must stay open to count as good.
    pub probe_hold: Duration,
    /// What to do on `FutureCursor`.
    pub future_cursor: FutureCursorPolicy,
    /// What to do with an undecodable or oversized frame that has a seq.
    pub bad_frame: BadFramePolicy,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(20),
            pong_timeout: Duration::from_secs(15),
            stall_timeout: Duration::from_mins(1),
            max_frame_bytes: 5 << 20,
            backoff: BackoffConfig::default(),
            healthy_after: Duration::from_secs(10),
            failover_after: 3,
            probe_interval: Duration::from_secs(30),
            probe_successes: 2,
            probe_hold: Duration::from_secs(1),
            future_cursor: FutureCursorPolicy::Fail,
            bad_frame: BadFramePolicy::Fail,
        }
    }
}

/// A validated event frame that owns its bytes and keeps the message decoded from them:
/// the frame is decoded once, here, and every later step borrows that decoding.
pub struct OwnedFrame {
    /// The decoded message, borrowing from the frame's bytes (its cart).
    message: Yoke<Message<'static>, Vec<u8>>,
    /// Its sequence number.
    pub seq: u64,
    /// The relay it came from.
    pub relay: RelayRole,
}

impl OwnedFrame {
    /// Decodes `bytes` into an owned frame; `None` unless it is a message with a seq
    /// (error frames, `#info` and seq-less frames are not events).
    pub fn decode_event(bytes: Vec<u8>, relay: RelayRole) -> Result<Option<Self>, DecodeError> {
        let frame = Yoke::<Frame<'static>, Vec<u8>>::try_attach_to_cart(bytes, frame::decode)?;
        let seq = match frame.get() {
            Frame::Message(m) => m.seq(),
            Frame::Error(_) => None,
        };
        Ok(seq.and_then(|seq| Self::from_frame(frame, seq, relay)))
    }

    fn from_frame(frame: Yoke<Frame<'static>, Vec<u8>>, seq: u64, relay: RelayRole) -> Option<Self> {
        let message = frame
            .try_map_project(|f, _| match f {
                Frame::Message(m) => Ok(m),
                Frame::Error(_) => Err(()),
            })
            .ok()?;
        Some(Self { message, seq, relay })
    }

    /// The decoded message.
    #[must_use]
    pub fn message(&self) -> &Message<'_> {
        self.message.get()
    }

    /// The WebSocket message, exactly as received.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        self.message.backing_cart()
    }
}

impl fmt::Debug for OwnedFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedFrame")
            .field("seq", &self.seq)
            .field("relay", &self.relay)
            .field("kind", &self.message().kind())
            .field("len", &self.bytes().len())
            .finish_non_exhaustive()
    }
}

/// Something the caller should know about; none of these needs an answer.
#[derive(Debug, Clone)]
pub enum Notice {
    /// A connection is up.
    Connected {
        /// Which relay.
        relay: RelayRole,
        /// The cursor it was opened with.
        cursor: Option<u64>,
    },
    /// A connection ended; the next one is tried after `retry_in`.
    Disconnected {
        /// Which relay.
        relay: RelayRole,
        /// Why.
        error: ConnError,
        /// Delay before the next attempt.
        retry_in: Duration,
    },
    /// A frame could not be decoded and was skipped. With `seq: None` it had no place in
    /// the sequence (garbage, text) and the cursor is unaffected; with a seq it was
    /// skipped under [`BadFramePolicy::Skip`] and the cursor moves past it (under
    /// [`BadFramePolicy::Fail`] the subscription stops instead and no notice is sent).
    BadFrame {
        /// Which relay.
        relay: RelayRole,
        /// Its seq, if the body got that far.
        seq: Option<u64>,
        /// What was wrong.
        error: DecodeError,
    },
    /// seq went backwards within a connection (relay reset or misbehaving). Frames at or
    /// below the last delivered seq are dropped.
    SeqBackwards {
        /// Which relay.
        relay: RelayRole,
        /// The last delivered seq.
        last: u64,
        /// The seq received.
        got: u64,
    },
    /// `#info OutdatedCursor`: the cursor is older than the relay's backfill window, so
    /// events between the cursor and the relay's oldest were missed.
    OutdatedCursor {
        /// Which relay.
        relay: RelayRole,
        /// The relay's message.
        message: Option<String>,
    },
    /// Some other `#info`.
    Info {
        /// Which relay.
        relay: RelayRole,
        /// Its name.
        name: String,
        /// Its message.
        message: Option<String>,
    },
    /// The relay went live after `FutureCursor` under [`FutureCursorPolicy::GoLive`].
    WentLive {
        /// Which relay.
        relay: RelayRole,
        /// The cursor that was rejected.
        rejected: Option<u64>,
    },
}

/// Why the subscription asks to switch relays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwitchReason {
    /// The current relay failed `failover_after` times in a row.
    Failover,
    /// The primary passed its health probes again.
    Failback,
}

/// One thing from the subscription.
#[derive(Debug)]
pub enum Item {
    /// The next event, seq strictly greater than every earlier one from this relay.
    Frame(OwnedFrame),
    /// Informational.
    Notice(Notice),
    /// Commit `from`'s cursor, then call [`Subscription::start`] with `to` and its cursor.
    SwitchRelay {
        /// The relay being left.
        from: RelayRole,
        /// The relay to go to.
        to: RelayRole,
        /// Why.
        reason: SwitchReason,
    },
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Frames delivered.
    pub frames: u64,
    /// Frames that failed to decode.
    pub bad_frames: u64,
    /// Frames with a seq equal to the last one, dropped.
    pub duplicates: u64,
    /// Frames with a seq below the last one, dropped.
    pub backwards: u64,
    /// Frames of unknown type, skipped.
    pub unknown_types: u64,
    /// Connections that ended.
    pub disconnects: u64,
    /// Relay switches requested.
    pub switches: u64,
}

struct Conn {
    ws: Ws,
    since: Instant,
    last_data: Instant,
    next_ping: Instant,
    pong_due: Option<Instant>,
    healthy: bool,
    frames: u64,
    warned_backwards: bool,
}

/// The subscription state machine. See the module docs.
pub struct Subscription {
    cfg: ClientConfig,
    primary: RelayUrl,
    secondary: Option<RelayUrl>,
    active: RelayRole,
    /// The cursor to open the next connection with: the last delivered seq, or the
    /// caller's cursor before anything was delivered.
    cursor: Option<u64>,
    conn: Option<Conn>,
    retry_at: Option<Instant>,
    backoff: Backoff,
    failures: u32,
    awaiting_start: bool,
    queue: VecDeque<Item>,
    probe: Option<JoinHandle<bool>>,
    next_probe: Option<Instant>,
    probe_ok: u32,
    stats: Stats,
    /// The next connection reads with a raised frame limit, to learn the seq of an
    /// oversized frame that [`BadFramePolicy::Skip`] must step over.
    oversize_probe: bool,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("active", &self.active)
            .field("cursor", &self.cursor)
            .field("connected", &self.conn.is_some())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn ws_config(max: usize) -> WebSocketConfig {
    WebSocketConfig::default().max_message_size(Some(max)).max_frame_size(Some(max))
}

impl Subscription {
    /// A subscription that has not connected yet; call [`Subscription::start`].
    #[must_use]
    pub fn new(cfg: ClientConfig, primary: RelayUrl, secondary: Option<RelayUrl>) -> Self {
        let backoff = Backoff::new(cfg.backoff);
        Self {
            cfg,
            primary,
            secondary,
            active: RelayRole::Primary,
            cursor: None,
            conn: None,
            retry_at: None,
            backoff,
            failures: 0,
            awaiting_start: true,
            queue: VecDeque::new(),
            probe: None,
            next_probe: None,
            probe_ok: 0,
            stats: Stats::default(),
            oversize_probe: false,
        }
    }

    /// (Re)starts on `relay` from `cursor` (events after it). Drops any open connection.
    pub fn start(&mut self, relay: RelayRole, cursor: Option<u64>) {
        let relay = if self.secondary.is_none() { RelayRole::Primary } else { relay };
        if relay != self.active {
            self.failures = 0;
            self.probe_ok = 0;
        }
        self.active = relay;
        self.cursor = cursor;
        self.conn = None;
        self.awaiting_start = false;
        self.retry_at = None;
        if let Some(p) = self.probe.take() {
            p.abort();
        }
        self.next_probe = (relay == RelayRole::Secondary).then(|| Instant::now() + self.cfg.probe_interval);
    }

    /// After a switch the caller refused: resumes on the relay it had, from where it
    /// stood, retrying it with backoff capped at the probe interval (and asking to switch again only after
    /// `failover_after` more failures, or the next failback probes).
    pub fn stay(&mut self) {
        self.failures = 0;
        self.probe_ok = 0;
        self.awaiting_start = false;
        self.conn = None;
        // Nothing flows meanwhile: retry at least once per probe interval.
        self.retry_at = Some(Instant::now() + self.backoff.next_delay().min(self.cfg.probe_interval));
        self.next_probe = (self.active == RelayRole::Secondary).then(|| Instant::now() + self.cfg.probe_interval);
    }

    /// The relay in use.
    #[must_use]
    pub fn active(&self) -> RelayRole {
        self.active
    }

    /// The last delivered seq (or the start cursor).
    #[must_use]
    pub fn cursor(&self) -> Option<u64> {
        self.cursor
    }

    /// Counters since creation.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The URL of a role.
    #[must_use]
    pub fn url(&self, role: RelayRole) -> Option<&RelayUrl> {
        match role {
            RelayRole::Primary => Some(&self.primary),
            RelayRole::Secondary => self.secondary.as_ref(),
        }
    }

    /// Closes the connection politely.
    pub async fn close(&mut self) {
        if let Some(mut c) = self.conn.take() {
            let _ = timeout(Duration::from_secs(1), c.ws.close(None)).await;
        }
        if let Some(p) = self.probe.take() {
            p.abort();
        }
    }

    /// The next item. Errors end the subscription (until [`Subscription::start`] is
    /// called again); everything else is retried inside.
    pub async fn next(&mut self) -> Result<Item, SubscribeError> {
        let wait_started = Instant::now();
        loop {
            if let Some(item) = self.queue.pop_front() {
                return Ok(item);
            }
            if self.awaiting_start {
                return Err(SubscribeError::Closed);
            }
            if self.conn.is_none() {
                self.connect().await;
                continue;
            }
            if let Some(item) = self.read(wait_started).await? {
                return Ok(item);
            }
        }
    }

    async fn connect(&mut self) {
        if let Some(at) = self.retry_at.take() {
            sleep_until(at).await;
        }
        let relay = self.active;
        let url = self.url(relay).unwrap_or(&self.primary).subscribe_url(self.cursor);
        let cfg = ws_config(self.read_limit());
        let span = tracing::info_span!("relay_connect", relay = relay.as_str(), cursor = ?self.cursor);
        let attempt = tracing::Instrument::instrument(
            timeout(
                self.cfg.connect_timeout,
                tokio_tungstenite::connect_async_with_config(url.as_str(), Some(cfg), true),
            ),
            span,
        )
        .await;
        match attempt {
            Ok(Ok((ws, _resp))) => {
                let now = Instant::now();
                self.conn = Some(Conn {
                    ws,
                    since: now,
                    last_data: now,
                    next_ping: now + self.cfg.ping_interval,
                    pong_due: None,
                    healthy: false,
                    frames: 0,
                    warned_backwards: false,
                });
                tracing::info!(relay = relay.as_str(), cursor = ?self.cursor, "connected to relay");
                self.queue.push_back(Item::Notice(Notice::Connected { relay, cursor: self.cursor }));
            }
            Ok(Err(e)) => self.fail(ConnError::Connect(describe(&e))),
            Err(_) => self.fail(ConnError::ConnectTimeout(self.cfg.connect_timeout)),
        }
    }

    /// The socket's frame limit: the configured one, or the raised one while stepping
    /// over an oversized frame.
    fn read_limit(&self) -> usize {
        if self.oversize_probe {
            self.cfg.max_frame_bytes.saturating_mul(4).max(OVERSIZE_PROBE_BYTES)
        } else {
            self.cfg.max_frame_bytes
        }
    }

    /// Ends the current connection and schedules the next attempt or a switch.
    fn fail(&mut self, error: ConnError) {
        let relay = self.active;
        let was_healthy = self.conn.take().is_some_and(|c| c.healthy);
        self.stats.disconnects += 1;
        self.failures = if was_healthy { 1 } else { self.failures + 1 };
        let can_switch = self.secondary.is_some() && self.failures >= self.cfg.failover_after;
        let retry_in = if can_switch { Duration::ZERO } else { self.backoff.next_delay() };
        tracing::warn!(relay = relay.as_str(), reason = error.reason(), %error, retry_in_ms = retry_in.as_millis() as u64, "relay connection ended");
        self.queue.push_back(Item::Notice(Notice::Disconnected { relay, error, retry_in }));
        if can_switch {
            self.request_switch(relay.other(), SwitchReason::Failover);
        } else {
            self.retry_at = Some(Instant::now() + retry_in);
        }
    }

    fn request_switch(&mut self, to: RelayRole, reason: SwitchReason) {
        let from = self.active;
        self.stats.switches += 1;
        self.awaiting_start = true;
        self.conn = None;
        if let Some(p) = self.probe.take() {
            p.abort();
        }
        tracing::warn!(from = from.as_str(), to = to.as_str(), ?reason, "switching relay");
        self.queue.push_back(Item::SwitchRelay { from, to, reason });
    }

    /// Reads until one item is ready, a connection ends, or nothing happens.
    async fn read(&mut self, wait_started: Instant) -> Result<Option<Item>, SubscribeError> {
        let cfg = &self.cfg;
        let Some(conn) = self.conn.as_mut() else {
            return Ok(None);
        };
        // Fast path: a message the socket already holds needs no timers (arming four
        // sleeps per frame costs more than decoding it). Only taken while no ping and no
        // probe is due; data frames themselves prove liveness.
        if self.probe.is_none() {
            let now = Instant::now();
            if now < conn.next_ping
                && self.next_probe.is_none_or(|p| now < p)
                && let Some(msg) = futures_util::FutureExt::now_or_never(conn.ws.next())
            {
                return self.on_message(msg);
            }
        }
        let stall_at = conn.last_data.max(wait_started) + cfg.stall_timeout;
        let pong_at = conn.pong_due;
        let next_ping = conn.next_ping;
        let probe_at = if self.probe.is_none() { self.next_probe } else { None };
        let far = Instant::now() + Duration::from_hours(24);
        tokio::select! {
            biased;
            msg = conn.ws.next() => self.on_message(msg),
            () = sleep_until(stall_at) => {
                self.fail(ConnError::Stalled(self.cfg.stall_timeout));
                Ok(None)
            }
            () = sleep_until(pong_at.unwrap_or(far)), if pong_at.is_some() => {
                self.fail(ConnError::PongTimeout(self.cfg.pong_timeout));
                Ok(None)
            }
            () = sleep_until(next_ping) => {
                let sent = timeout(self.cfg.pong_timeout, conn.ws.send(WsMessage::Ping(Bytes::new()))).await;
                match sent {
                    Ok(Ok(())) => {
                        let now = Instant::now();
                        conn.next_ping = now + self.cfg.ping_interval;
                        conn.pong_due.get_or_insert(now + self.cfg.pong_timeout);
                    }
                    Ok(Err(e)) => self.fail(ConnError::Io(describe(&e))),
                    Err(_) => self.fail(ConnError::PongTimeout(self.cfg.pong_timeout)),
                }
                Ok(None)
            }
            () = sleep_until(probe_at.unwrap_or(far)), if probe_at.is_some() => {
                self.start_probe();
                Ok(None)
            }
            ok = async { self.probe.as_mut().expect("guarded").await }, if self.probe.is_some() => {
                self.probe = None;
                self.on_probe(ok.unwrap_or(false));
                Ok(None)
            }
        }
    }

    fn start_probe(&mut self) {
        self.next_probe = None;
        let url = self.primary.subscribe_url(None);
        let cfg = self.cfg.clone();
        self.probe = Some(tokio::spawn(async move { probe(url, &cfg).await }));
    }

    fn on_probe(&mut self, ok: bool) {
        self.next_probe = Some(Instant::now() + self.cfg.probe_interval);
        self.probe_ok = if ok { self.probe_ok + 1 } else { 0 };
        tracing::debug!(relay = "primary", ok, streak = self.probe_ok, "failback probe");
        if self.active == RelayRole::Secondary && self.probe_ok >= self.cfg.probe_successes {
            self.request_switch(RelayRole::Primary, SwitchReason::Failback);
        }
    }

    // One arm per WebSocket message kind, each applying the frame policies in order;
    // split up, the policy for one frame would be spread over several functions.
    #[allow(clippy::too_many_lines)]
    fn on_message(
        &mut self,
        msg: Option<Result<WsMessage, tungstenite::Error>>,
    ) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        let msg = match msg {
            None => {
                self.fail(ConnError::ClosedByRelay);
                return Ok(None);
            }
            Some(Err(tungstenite::Error::Capacity(_))) => {
                self.stats.bad_frames += 1;
                let max = self.cfg.max_frame_bytes;
                let after = self.cursor;
                // Reconnecting from the same cursor would meet the same frame forever.
                if self.cfg.bad_frame == BadFramePolicy::Fail || self.oversize_probe {
                    let limit = self.read_limit();
                    tracing::error!(relay = relay.as_str(), max = limit, cursor = ?after, "oversized frame: stopping before it");
                    self.conn = None;
                    self.awaiting_start = true;
                    self.oversize_probe = false;
                    return Err(SubscribeError::FrameTooLarge { relay, after, max: limit });
                }
                tracing::error!(relay = relay.as_str(), max, cursor = ?after, "oversized frame: reconnecting with a raised limit to learn its seq and skip it");
                self.oversize_probe = true;
                self.conn = None;
                self.retry_at = None;
                return Ok(None);
            }
            Some(Err(e)) => {
                self.fail(ConnError::Io(describe(&e)));
                return Ok(None);
            }
            Some(Ok(m)) => m,
        };
        let bytes = match msg {
            WsMessage::Binary(b) => b,
            WsMessage::Text(t) => {
                return self.bad_frame(None, DecodeError::TextMessage { len: t.len() });
            }
            WsMessage::Pong(_) => {
                if let Some(c) = self.conn.as_mut() {
                    c.pong_due = None;
                }
                return Ok(None);
            }
            WsMessage::Close(_) => {
                self.fail(ConnError::ClosedByRelay);
                return Ok(None);
            }
            WsMessage::Ping(_) | WsMessage::Frame(_) => return Ok(None),
        };
        let healthy_after = self.cfg.healthy_after;
        if let Some(c) = self.conn.as_mut() {
            let now = Instant::now();
            c.last_data = now;
            c.pong_due = None;
            c.frames += 1;
            if !c.healthy && now.duration_since(c.since) >= healthy_after {
                c.healthy = true;
                self.backoff.reset();
                self.failures = 0;
            }
        }
        let max = self.cfg.max_frame_bytes;
        if bytes.len() > max {
            // Only reachable while reading with the raised limit.
            self.oversize_probe = false;
            return self.bad_frame(peek_seq(&bytes), DecodeError::TooLarge { size: bytes.len(), max });
        }
        // Decoded once: the event keeps this decoding beside its bytes.
        let decoded = match Yoke::<Frame<'static>, Vec<u8>>::try_attach_to_cart(Vec::from(bytes), |b| {
            frame::decode(b).map_err(|e| (e, peek_seq(b)))
        }) {
            Ok(y) => y,
            Err((error, seq)) => return self.bad_frame(seq, error),
        };
        let (seq, kind) = match decoded.get() {
            Frame::Error(e) => return self.on_error_frame(e.error, e.message),
            Frame::Message(Message::Info(i)) => {
                let message = i.message.map(str::to_owned);
                let notice = if i.name == "OutdatedCursor" {
                    tracing::warn!(relay = relay.as_str(), cursor = ?self.cursor, message = ?message, "relay says the cursor is outdated: events were missed");
                    Notice::OutdatedCursor { relay, message }
                } else {
                    tracing::info!(relay = relay.as_str(), name = i.name, message = ?message, "relay info");
                    Notice::Info { relay, name: i.name.to_owned(), message }
                };
                return Ok(Some(Item::Notice(notice)));
            }
            Frame::Message(m @ Message::Unknown { .. }) => (m.seq(), None),
            Frame::Message(m) => (m.seq(), Some(())),
        };
        let Some(seq) = seq else {
            self.stats.unknown_types += 1;
            return Ok(None);
        };
        if let Some(last) = self.cursor.filter(|&l| seq <= l) {
            if seq == last {
                self.stats.duplicates += 1;
            } else {
                self.stats.backwards += 1;
                if let Some(c) = self.conn.as_mut().filter(|c| !c.warned_backwards) {
                    c.warned_backwards = true;
                    tracing::warn!(
                        relay = relay.as_str(),
                        last,
                        got = seq,
                        "relay seq went backwards; dropping frames until it passes the last seq"
                    );
                    return Ok(Some(Item::Notice(Notice::SeqBackwards { relay, last, got: seq })));
                }
            }
            return Ok(None);
        }
        self.cursor = Some(seq);
        if kind.is_none() {
            self.stats.unknown_types += 1;
            tracing::debug!(relay = relay.as_str(), seq, "unknown message type skipped");
            return Ok(None);
        }
        self.stats.frames += 1;
        Ok(OwnedFrame::from_frame(decoded, seq, relay).map(Item::Frame))
    }

    /// Applies the bad-frame policy. A frame at or below the last delivered seq is a
    /// replay of something already handled and is dropped quietly.
    fn bad_frame(&mut self, seq: Option<u64>, error: DecodeError) -> Result<Option<Item>, SubscribeError> {
        self.stats.bad_frames += 1;
        let relay = self.active;
        let Some(seq) = seq else {
            tracing::error!(relay = relay.as_str(), reason = error.reason(), %error, "frame without a readable seq skipped");
            return Ok(Some(Item::Notice(Notice::BadFrame { relay, seq: None, error })));
        };
        if self.cursor.is_some_and(|c| seq <= c) {
            return Ok(None);
        }
        match self.cfg.bad_frame {
            BadFramePolicy::Fail => {
                tracing::error!(relay = relay.as_str(), seq, reason = error.reason(), %error, cursor = ?self.cursor, "undecodable frame: stopping before it (FIREKEEPER_BAD_FRAME=fail)");
                self.conn = None;
                self.awaiting_start = true;
                Err(SubscribeError::BadFrame { relay, seq, error })
            }
            BadFramePolicy::Skip => {
                tracing::error!(relay = relay.as_str(), seq, reason = error.reason(), %error, "undecodable frame skipped: this event is lost (FIREKEEPER_BAD_FRAME=skip)");
                self.cursor = Some(seq);
                Ok(Some(Item::Notice(Notice::BadFrame { relay, seq: Some(seq), error })))
            }
        }
    }

    fn on_error_frame(&mut self, error: &str, message: Option<&str>) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        let message = message.unwrap_or_default().to_owned();
        if error == "FutureCursor" {
            let cursor = self.cursor;
            tracing::error!(relay = relay.as_str(), ?cursor, %message, "relay rejected the cursor as FutureCursor");
            match self.cfg.future_cursor {
                FutureCursorPolicy::Fail => {
                    self.conn = None;
                    self.awaiting_start = true;
                    return Err(SubscribeError::FutureCursor { relay, cursor, message });
                }
                FutureCursorPolicy::GoLive => {
                    self.cursor = None;
                    self.conn = None;
                    return Ok(Some(Item::Notice(Notice::WentLive { relay, rejected: cursor })));
                }
            }
        }
        self.fail(ConnError::ErrorFrame { error: error.to_owned(), message });
        Ok(None)
    }
}

/// Opens a cursor-less connection to `url` and keeps it for `probe_hold`: good if the
/// handshake works and the relay neither closes nor sends an error frame meanwhile.
async fn probe(url: url::Url, cfg: &ClientConfig) -> bool {
    let conn = timeout(
        cfg.connect_timeout,
        tokio_tungstenite::connect_async_with_config(url.as_str(), Some(ws_config(cfg.max_frame_bytes)), true),
    )
    .await;
    let Ok(Ok((mut ws, _))) = conn else {
        return false;
    };
    let deadline = Instant::now() + cfg.probe_hold;
    let ok = loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => break true,
            Ok(None | Some(Err(_) | Ok(WsMessage::Close(_)))) => break false,
            Ok(Some(Ok(WsMessage::Binary(b)))) => {
                if matches!(frame::decode(&b), Ok(Frame::Error(_))) {
                    break false;
                }
            }
            Ok(Some(Ok(_))) => {}
        }
    };
    let _ = timeout(Duration::from_millis(500), ws.close(None)).await;
    ok
}

/// The seq of a frame that failed to decode, if its body got that far.
fn peek_seq(bytes: &[u8]) -> Option<u64> {
    let span = frame::seq_span(bytes)?;
    let mut r = crate::cbor::Reader::new(&bytes[span]);
    r.u64().ok()
}

/// Describes a WebSocket error without echoing URLs (which may carry credentials).
pub(crate) fn describe(e: &tungstenite::Error) -> String {
    match e {
        tungstenite::Error::Http(resp) => format!("HTTP {}", resp.status()),
        tungstenite::Error::Url(_) => "invalid URL".to_owned(),
        tungstenite::Error::Io(io) => format!("io: {}", io.kind()),
        other => other.to_string(),
    }
}
