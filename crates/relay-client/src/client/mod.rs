//! The subscription: one WebSocket at a time to the primary or secondary relay, with
//! connect timeout, ping/pong, stall detection, backoff with jitter, seq ordering and
//! failover.
//!
//! It is pull-driven: a task per connection reads the socket at most a few batches ahead
//! of the caller (see `reader`), so a slow consumer pushes back on the relay instead of
//! filling memory, while the socket read runs beside the caller's decoding.
//! A relay switch is never done behind the caller's back: [`Item::SwitchRelay`] asks the
//! caller to commit the current relay's cursor and then call [`Subscription::start`] with
//! the new relay's own cursor.

mod failback;
mod frames;
mod reader;

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use futures_util::SinkExt;
use futures_util::stream::{SplitSink, StreamExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_tungstenite::tungstenite::{self, Message as WsMessage, protocol::WebSocketConfig};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use self::failback::Failback;
use self::reader::Read;
use crate::backoff::Backoff;
pub use crate::config::{BadFramePolicy, ClientConfig, FutureCursorPolicy, OVERSIZE_PROBE_BYTES, RelayRole};
use crate::error::{ConnError, SubscribeError};
pub use crate::item::{Item, Notice, OwnedFrame, Stats, SwitchReason};
use crate::relay_url::RelayUrl;

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One open connection and its liveness bookkeeping.
struct Conn {
    /// Where pings and the close go; the reader task owns the other half.
    sink: SplitSink<Ws, WsMessage>,
    /// Batches from the reader task.
    rx: mpsc::Receiver<Vec<Read>>,
    /// The rest of the last batch received.
    ready: std::vec::IntoIter<Read>,
    reader: tokio::task::JoinHandle<()>,
    since: Instant,
    last_data: Instant,
    next_ping: Instant,
    pong_due: Option<Instant>,
    healthy: bool,
    warned_backwards: bool,
}

impl Conn {
    fn new(ws: Ws, now: Instant, ping_interval: Duration) -> Self {
        let (sink, stream) = ws.split();
        let (tx, rx) = mpsc::channel(reader::QUEUED);
        Self {
            sink,
            rx,
            ready: Vec::new().into_iter(),
            reader: tokio::spawn(reader::run(stream, tx)),
            since: now,
            last_data: now,
            next_ping: now + ping_interval,
            pong_due: None,
            healthy: false,
            warned_backwards: false,
        }
    }
}

impl Drop for Conn {
    /// A connection given up stops its reader (which may be waiting on the socket).
    fn drop(&mut self) {
        self.reader.abort();
    }
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
    /// Jetstream's state, when that is the input.
    jet: Option<Jet>,
}

/// What a Jetstream subscription keeps besides the cursor (its stamp).
#[derive(Debug)]
struct Jet {
    opts: crate::jetstream::Options,
    /// zstd frames' decompressor, made on the first compressed frame.
    z: Option<crate::jetstream::Decompressor>,
    /// The content keys of the events delivered at the cursor's stamp: a reconnect from
    /// that stamp drops these and delivers the rest of the stamp's events.
    boundary: Vec<u64>,
    /// A v1 connection opened from this time cursor: its first event is checked for the
    /// silent clamp.
    clamp_from: Option<u64>,
    /// The first event and the cursor asked for, held while the clamp check asks for
    /// the oldest stamp.
    held: Option<(OwnedFrame, u64)>,
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
        let cfg_input = cfg.input.clone();
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
            jet: match &cfg_input {
                crate::config::Input::Firehose => None,
                crate::config::Input::Jetstream(opts) => {
                    Some(Jet { opts: opts.clone(), z: None, boundary: Vec::new(), clamp_from: None, held: None })
                }
            },
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
        if let Some(j) = &mut self.jet {
            j.boundary.clear();
            j.held = None;
        }
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
            let _ = timeout(Duration::from_secs(1), c.sink.close()).await;
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
            if self.jet.as_ref().is_some_and(|j| j.held.is_some()) {
                // Boxed: rare, and its connection would otherwise weigh on every `next`.
                Box::pin(self.check_clamp()).await?;
                continue;
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
        let url = self.open_url(relay, self.cursor);
        let cfg = ws_config(self.read_limit());
        let span = tracing::info_span!("relay_connect", relay = relay.as_str(), cursor = self.cursor);
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
                self.link = Link::Up(Box::new(Conn::new(ws, Instant::now(), self.cfg.ping_interval)));
                if let Some(j) = &mut self.jet {
                    let time_cursor = self.cursor.filter(|&c| c >= crate::jetstream::TIME_CURSOR_MIN);
                    j.clamp_from = time_cursor.filter(|_| j.opts.version == crate::jetstream::Version::V1);
                }
                tracing::info!(relay = relay.as_str(), cursor = self.cursor, "connected to relay");
                self.queue.push_back(Item::Notice(Notice::Connected { relay, cursor: self.cursor }));
            }
            Ok(Err(e)) => {
                if self.retired_dictionary(&e) {
                    return;
                }
                self.fail(ConnError::Connect(describe(&e)));
            }
            Err(_) => self.fail(ConnError::ConnectTimeout(self.cfg.connect_timeout)),
        }
    }

    /// A v2 instance refused the shipped zstd dictionary (`UnknownZstdDictionary`: it
    /// retired it): the subscription goes on uncompressed, at once, and says so. True when
    /// that was the refusal.
    fn retired_dictionary(&mut self, e: &tungstenite::Error) -> bool {
        let tungstenite::Error::Http(resp) = e else { return false };
        let Some(j) = self.jet.as_mut().filter(|j| j.opts.compress && j.opts.version == crate::jetstream::Version::V2)
        else {
            return false;
        };
        let body = resp.body().as_deref().map(String::from_utf8_lossy).unwrap_or_default();
        if resp.status().as_u16() != 400 || !body.contains("UnknownZstdDictionary") {
            return false;
        }
        j.opts.compress = false;
        tracing::warn!(
            relay = self.active.as_str(),
            dictionary = crate::jetstream::DICT_V2_ID,
            "the Jetstream instance no longer knows the zstd dictionary firekeeper ships: reading it uncompressed \
             (set FIREKEEPER_JETSTREAM_COMPRESS=false to say so, or upgrade for the new dictionary)"
        );
        self.link = Link::Down { retry_at: None };
        true
    }

    /// The URL to open on `relay` from `cursor`: the firehose's or the Jetstream
    /// instance's, with its filters. Never logged (it may carry credentials).
    pub(crate) fn open_url(&self, relay: RelayRole, cursor: Option<u64>) -> url::Url {
        let base = self.url(relay).unwrap_or(&self.primary);
        match &self.jet {
            Some(j) => j.opts.url(base, cursor),
            None => base.subscribe_url(cursor),
        }
    }

    /// The first event of a v1 connection opened from a time cursor came well after it:
    /// either nothing happened in between, or the instance no longer holds the cursor
    /// and silently started at its oldest event. Its oldest event tells: the same event
    /// means the clamp (a gap), an older one a quiet stretch.
    async fn check_clamp(&mut self) -> Result<(), SubscribeError> {
        let Some(j) = self.jet.as_mut() else { return Ok(()) };
        let Some((held, cursor)) = j.held.take() else { return Ok(()) };
        let relay = self.active;
        let base = self.url(relay).unwrap_or(&self.primary).clone();
        let opts = self.jet.as_ref().map(|j| j.opts.clone()).unwrap_or_default();
        let oldest = crate::jetstream::oldest_stamp(&base, &opts, self.cfg.connect_timeout).await;
        if let Some(o) = oldest
            && o >= held.seq
        {
            tracing::error!(
                relay = relay.as_str(),
                cursor,
                oldest = o,
                "the Jetstream instance no longer serves the cursor: it started at its oldest event"
            );
            if self.cfg.refuse_gaps {
                self.link = Link::Stopped;
                return Err(SubscribeError::Gap { relay, cursor, oldest: Some(o) });
            }
            self.queue.push_back(Item::Notice(Notice::OutdatedCursor {
                relay,
                message: Some(format!("v1 started at its oldest event ({o}) instead of cursor {cursor}")),
            }));
        }
        self.queue.push_back(Item::Frame(held));
        Ok(())
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
        let why = match reason {
            SwitchReason::Failover => "failover",
            SwitchReason::Failback => "failback",
        };
        tracing::warn!(from = from.as_str(), to = to.as_str(), reason = why, "switching relay");
        self.queue.push_back(Item::SwitchRelay { from, to, reason });
    }

    /// Reads until one item is ready, a connection ends, or nothing happens.
    async fn read(&mut self, wait_started: Instant) -> Result<Option<Item>, SubscribeError> {
        let cfg = &self.cfg;
        let Link::Up(conn) = &mut self.link else {
            return Ok(None);
        };
        // Fast path: the rest of a batch needs no timers (arming four sleeps per frame
        // costs more than decoding it); pings and probes are looked at between batches.
        if let Some(r) = conn.ready.next() {
            return self.on_message(r);
        }
        let probe_at = self.failback.due();
        if self.failback.probe.is_none() {
            let now = Instant::now();
            if now < conn.next_ping
                && probe_at.is_none_or(|p| now < p)
                && let Ok(batch) = conn.rx.try_recv()
            {
                return self.on_batch(batch);
            }
        }
        let stall_at = conn.last_data.max(wait_started) + cfg.stall_timeout;
        let pong_at = conn.pong_due;
        let next_ping = conn.next_ping;
        let far = Instant::now() + Duration::from_hours(24);
        tokio::select! {
            biased;
            batch = conn.rx.recv() => if let Some(batch) = batch {
                self.on_batch(batch)
            } else {
                // The reader ends only after handing over the end or an error: gone
                // without, it panicked.
                self.fail(ConnError::Io("socket reader ended".to_owned()));
                Ok(None)
            },
            () = sleep_until(stall_at) => {
                self.fail(ConnError::Stalled(self.cfg.stall_timeout));
                Ok(None)
            }
            () = sleep_until(pong_at.unwrap_or(far)), if pong_at.is_some() => {
                self.fail(ConnError::PongTimeout(self.cfg.pong_timeout));
                Ok(None)
            }
            () = sleep_until(next_ping) => {
                let sent = timeout(self.cfg.pong_timeout, conn.sink.send(WsMessage::Ping(Bytes::new()))).await;
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

    /// A batch from the reader: one with data proves the connection alive; its first
    /// message now, the rest on the next calls.
    fn on_batch(&mut self, batch: Vec<Read>) -> Result<Option<Item>, SubscribeError> {
        let Link::Up(conn) = &mut self.link else { return Ok(None) };
        let data = batch.iter().any(|r| matches!(r, Read::Binary(_) | Read::Text(_)));
        let mut batch = batch.into_iter();
        let first = batch.next();
        conn.ready = batch;
        if data {
            self.saw_data();
        }
        first.map_or(Ok(None), |r| self.on_message(r))
    }
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
