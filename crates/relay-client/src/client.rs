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

use crate::backoff::Backoff;
pub use crate::config::{BadFramePolicy, ClientConfig, FutureCursorPolicy, OVERSIZE_PROBE_BYTES, RelayRole};
use crate::error::{ConnError, DecodeError, SubscribeError};
use crate::frame::{self, Frame, Message, peek_seq};
pub use crate::item::{Item, Notice, OwnedFrame, Stats, SwitchReason};
use crate::relay_url::RelayUrl;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One open connection and its liveness bookkeeping.
struct Conn {
    ws: Ws,
    since: Instant,
    last_data: Instant,
    next_ping: Instant,
    pong_due: Option<Instant>,
    healthy: bool,
    warned_backwards: bool,
}

/// The link to the active relay.
///
/// ```text
///            start() / stay()                 connected
///  Stopped ──────────────────▶ Down{retry_at} ─────────▶ Up(conn)
///     ▲                          ▲    │ connect failed      │
///     │                          │    └─────────────────────┤ closed, stalled, pong
///     │                          └──────────────────────────┘ timeout, error frame
///     └── switch asked for, bad frame / oversized / FutureCursor under `fail`
/// ```
enum Link {
    /// Waiting for the caller's [`Subscription::start`]: a switch was asked for, or
    /// the stream stopped on a frame an operator must look at.
    Stopped,
    /// No connection; the next attempt at `retry_at` (at once when `None`).
    Down { retry_at: Option<Instant> },
    /// Connected.
    Up(Box<Conn>),
}

/// Failback to the primary while on the secondary: probes on a timer and their streak.
#[derive(Default)]
struct Failback {
    /// A probe connection in flight.
    probe: Option<JoinHandle<bool>>,
    /// When the next probe starts (`None` on the primary, or while one is in flight).
    next_at: Option<Instant>,
    /// Consecutive good probes.
    streak: u32,
}

impl Failback {
    /// Stops a probe in flight.
    fn abort(&mut self) {
        if let Some(p) = self.probe.take() {
            p.abort();
        }
    }

    /// The next probe one interval from now, when on the secondary.
    fn schedule(&mut self, active: RelayRole, every: Duration) {
        self.next_at = (active == RelayRole::Secondary).then(|| Instant::now() + every);
    }

    /// When the next probe is due, unless one is in flight.
    fn due(&self) -> Option<Instant> {
        if self.probe.is_none() { self.next_at } else { None }
    }
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
    link: Link,
    backoff: Backoff,
    /// Consecutive failed connections on the active relay.
    failures: u32,
    queue: VecDeque<Item>,
    failback: Failback,
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
            .field("connected", &matches!(self.link, Link::Up(_)))
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
            link: Link::Stopped,
            backoff,
            failures: 0,
            queue: VecDeque::new(),
            failback: Failback::default(),
            stats: Stats::default(),
            oversize_probe: false,
        }
    }

    /// (Re)starts on `relay` from `cursor` (events after it). Drops any open connection.
    pub fn start(&mut self, relay: RelayRole, cursor: Option<u64>) {
        let relay = if self.secondary.is_none() { RelayRole::Primary } else { relay };
        if relay != self.active {
            self.failures = 0;
            self.failback.streak = 0;
        }
        self.active = relay;
        self.cursor = cursor;
        self.link = Link::Down { retry_at: None };
        self.failback.abort();
        self.failback.schedule(relay, self.cfg.probe_interval);
    }

    /// After a switch the caller refused: resumes on the relay it had, from where it
    /// stood, retrying it with backoff capped at the probe interval (and asking to switch again only after
    /// `failover_after` more failures, or the next failback probes).
    pub fn stay(&mut self) {
        self.failures = 0;
        self.failback.streak = 0;
        // Nothing flows meanwhile: retry at least once per probe interval.
        let retry_at = Instant::now() + self.backoff.next_delay().min(self.cfg.probe_interval);
        self.link = Link::Down { retry_at: Some(retry_at) };
        self.failback.schedule(self.active, self.cfg.probe_interval);
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
        if let Link::Up(mut c) = std::mem::replace(&mut self.link, Link::Down { retry_at: None }) {
            let _ = timeout(Duration::from_secs(1), c.ws.close(None)).await;
        }
        self.failback.abort();
    }

    /// The next item. Errors end the subscription (until [`Subscription::start`] is
    /// called again); everything else is retried inside.
    pub async fn next(&mut self) -> Result<Item, SubscribeError> {
        let wait_started = Instant::now();
        loop {
            if let Some(item) = self.queue.pop_front() {
                return Ok(item);
            }
            match self.link {
                Link::Stopped => return Err(SubscribeError::Closed),
                Link::Down { retry_at } => self.connect(retry_at).await,
                Link::Up(_) => {
                    if let Some(item) = self.read(wait_started).await? {
                        return Ok(item);
                    }
                }
            }
        }
    }

    async fn connect(&mut self, retry_at: Option<Instant>) {
        if let Some(at) = retry_at {
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
                self.link = Link::Up(Box::new(Conn {
                    ws,
                    since: now,
                    last_data: now,
                    next_ping: now + self.cfg.ping_interval,
                    pong_due: None,
                    healthy: false,
                    warned_backwards: false,
                }));
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
        let was_healthy =
            matches!(std::mem::replace(&mut self.link, Link::Down { retry_at: None }), Link::Up(c) if c.healthy);
        self.stats.disconnects += 1;
        self.failures = if was_healthy { 1 } else { self.failures + 1 };
        let can_switch = self.secondary.is_some() && self.failures >= self.cfg.failover_after;
        let retry_in = if can_switch { Duration::ZERO } else { self.backoff.next_delay() };
        tracing::warn!(relay = relay.as_str(), reason = error.reason(), %error, retry_in_ms = retry_in.as_millis() as u64, "relay connection ended");
        self.queue.push_back(Item::Notice(Notice::Disconnected { relay, error, retry_in }));
        if can_switch {
            self.request_switch(relay.other(), SwitchReason::Failover);
        } else {
            self.link = Link::Down { retry_at: Some(Instant::now() + retry_in) };
        }
    }

    /// Stops and asks the caller to switch relays.
    fn request_switch(&mut self, to: RelayRole, reason: SwitchReason) {
        let from = self.active;
        self.stats.switches += 1;
        self.link = Link::Stopped;
        self.failback.abort();
        tracing::warn!(from = from.as_str(), to = to.as_str(), ?reason, "switching relay");
        self.queue.push_back(Item::SwitchRelay { from, to, reason });
    }

    /// Reads until one item is ready, a connection ends, or nothing happens.
    async fn read(&mut self, wait_started: Instant) -> Result<Option<Item>, SubscribeError> {
        let cfg = &self.cfg;
        let Link::Up(conn) = &mut self.link else {
            return Ok(None);
        };
        let probe_at = self.failback.due();
        // Fast path: a message the socket already holds needs no timers (arming four
        // sleeps per frame costs more than decoding it). Only taken while no ping and no
        // probe is due; data frames themselves prove liveness.
        if self.failback.probe.is_none() {
            let now = Instant::now();
            if now < conn.next_ping
                && probe_at.is_none_or(|p| now < p)
                && let Some(msg) = futures_util::FutureExt::now_or_never(conn.ws.next())
            {
                return self.on_message(msg);
            }
        }
        let stall_at = conn.last_data.max(wait_started) + cfg.stall_timeout;
        let pong_at = conn.pong_due;
        let next_ping = conn.next_ping;
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
            ok = async { self.failback.probe.as_mut().expect("guarded").await }, if self.failback.probe.is_some() => {
                self.failback.probe = None;
                self.on_probe(ok.unwrap_or(false));
                Ok(None)
            }
        }
    }

    fn start_probe(&mut self) {
        self.failback.next_at = None;
        let url = self.primary.subscribe_url(None);
        let cfg = self.cfg.clone();
        self.failback.probe = Some(tokio::spawn(async move { probe(url, &cfg).await }));
    }

    fn on_probe(&mut self, ok: bool) {
        let f = &mut self.failback;
        f.next_at = Some(Instant::now() + self.cfg.probe_interval);
        f.streak = if ok { f.streak + 1 } else { 0 };
        tracing::debug!(relay = "primary", ok, streak = f.streak, "failback probe");
        if self.active == RelayRole::Secondary && f.streak >= self.cfg.probe_successes {
            self.request_switch(RelayRole::Primary, SwitchReason::Failback);
        }
    }

    /// One WebSocket message: the connection's end, a pong, or a binary frame to decode.
    fn on_message(
        &mut self,
        msg: Option<Result<WsMessage, tungstenite::Error>>,
    ) -> Result<Option<Item>, SubscribeError> {
        let bytes = match msg {
            Some(Ok(WsMessage::Binary(b))) => b,
            Some(Err(tungstenite::Error::Capacity(_))) => return self.oversized(),
            Some(Ok(WsMessage::Text(t))) => return self.bad_frame(None, DecodeError::TextMessage { len: t.len() }),
            Some(Ok(WsMessage::Pong(_))) => {
                if let Link::Up(c) = &mut self.link {
                    c.pong_due = None;
                }
                return Ok(None);
            }
            None | Some(Ok(WsMessage::Close(_))) => {
                self.fail(ConnError::ClosedByRelay);
                return Ok(None);
            }
            Some(Err(e)) => {
                self.fail(ConnError::Io(describe(&e)));
                return Ok(None);
            }
            Some(Ok(WsMessage::Ping(_) | WsMessage::Frame(_))) => return Ok(None),
        };
        self.saw_data();
        let max = self.cfg.max_frame_bytes;
        if bytes.len() > max {
            // Only reachable while reading with the raised limit.
            self.oversize_probe = false;
            return self.bad_frame(peek_seq(&bytes), DecodeError::TooLarge { size: bytes.len(), max });
        }
        // Decoded once: the event keeps this decoding beside its bytes.
        match Yoke::<Frame<'static>, Vec<u8>>::try_attach_to_cart(Vec::from(bytes), |b| {
            frame::decode(b).map_err(|e| (e, peek_seq(b)))
        }) {
            Ok(decoded) => self.on_frame(decoded),
            Err((error, seq)) => self.bad_frame(seq, error),
        }
    }

    /// A data frame proves the connection alive; one that has lasted `healthy_after`
    /// resets the backoff and the failure count.
    fn saw_data(&mut self) {
        let Link::Up(c) = &mut self.link else { return };
        let now = Instant::now();
        c.last_data = now;
        c.pong_due = None;
        if !c.healthy && now.duration_since(c.since) >= self.cfg.healthy_after {
            c.healthy = true;
            self.backoff.reset();
            self.failures = 0;
        }
    }

    /// A message over the socket's frame limit. Reconnecting from the same cursor would
    /// meet it forever: stop before it, or (under `skip`) read it once with a raised
    /// limit to learn its seq.
    fn oversized(&mut self) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        self.stats.bad_frames += 1;
        let after = self.cursor;
        if self.cfg.bad_frame == BadFramePolicy::Fail || self.oversize_probe {
            let limit = self.read_limit();
            tracing::error!(relay = relay.as_str(), max = limit, cursor = ?after, "oversized frame: stopping before it");
            self.link = Link::Stopped;
            self.oversize_probe = false;
            return Err(SubscribeError::FrameTooLarge { relay, after, max: limit });
        }
        let max = self.cfg.max_frame_bytes;
        tracing::error!(relay = relay.as_str(), max, cursor = ?after, "oversized frame: reconnecting with a raised limit to learn its seq and skip it");
        self.oversize_probe = true;
        self.link = Link::Down { retry_at: None };
        Ok(None)
    }

    /// A decoded frame: an error frame, an `#info`, or a message placed by its seq.
    fn on_frame(&mut self, decoded: Yoke<Frame<'static>, Vec<u8>>) -> Result<Option<Item>, SubscribeError> {
        let relay = self.active;
        let (seq, known) = match decoded.get() {
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
            Frame::Message(m) => (m.seq(), !matches!(m, Message::Unknown { .. })),
        };
        let Some(seq) = seq else {
            self.stats.unknown_types += 1;
            return Ok(None);
        };
        if let Some(last) = self.cursor.filter(|&l| seq <= l) {
            return Ok(self.not_after(last, seq));
        }
        self.cursor = Some(seq);
        if !known {
            self.stats.unknown_types += 1;
            tracing::debug!(relay = relay.as_str(), seq, "unknown message type skipped");
            return Ok(None);
        }
        self.stats.frames += 1;
        Ok(OwnedFrame::from_frame(decoded, seq, relay).map(Item::Frame))
    }

    /// A seq at or below the last delivered one: a duplicate, or the relay going
    /// backwards (reported once per connection). Either way the frame is dropped.
    fn not_after(&mut self, last: u64, seq: u64) -> Option<Item> {
        if seq == last {
            self.stats.duplicates += 1;
            return None;
        }
        self.stats.backwards += 1;
        let Link::Up(c) = &mut self.link else { return None };
        if c.warned_backwards {
            return None;
        }
        c.warned_backwards = true;
        let relay = self.active;
        tracing::warn!(
            relay = relay.as_str(),
            last,
            got = seq,
            "relay seq went backwards; dropping frames until it passes the last seq"
        );
        Some(Item::Notice(Notice::SeqBackwards { relay, last, got: seq }))
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
                tracing::error!(relay = relay.as_str(), seq, reason = error.reason(), %error, cursor = ?self.cursor, "undecodable frame: stopping before it");
                self.link = Link::Stopped;
                Err(SubscribeError::BadFrame { relay, seq, error })
            }
            BadFramePolicy::Skip => {
                tracing::error!(relay = relay.as_str(), seq, reason = error.reason(), %error, "undecodable frame skipped under the skip policy: this event is lost");
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
                    self.link = Link::Stopped;
                    return Err(SubscribeError::FutureCursor { relay, cursor, message });
                }
                FutureCursorPolicy::GoLive => {
                    self.cursor = None;
                    self.link = Link::Down { retry_at: None };
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

/// Describes a WebSocket error without echoing URLs (which may carry credentials).
pub(crate) fn describe(e: &tungstenite::Error) -> String {
    match e {
        tungstenite::Error::Http(resp) => format!("HTTP {}", resp.status()),
        tungstenite::Error::Url(_) => "invalid URL".to_owned(),
        tungstenite::Error::Io(io) => format!("io: {}", io.kind()),
        other => other.to_string(),
    }
}
