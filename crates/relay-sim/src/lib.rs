//! A scriptable local relay for tests, benchmarks and demos.
//!
//! It serves `com.atproto.sync.subscribeRepos` over WebSocket on loopback, replaying a
//! capture (`[u32 big-endian length][message]` repeated) with relay cursor semantics:
//! no cursor → live tail from the current head; `cursor=N` → every frame with seq > N,
//! then live; a cursor past the head → a `FutureCursor` error frame and close; a cursor
//! older than the backfill window → `#info OutdatedCursor`, then the window.
//!
//! Faults are injected through [`SimHandle`]: close every connection, stall, send a
//! garbage, text, oversized or error frame, renumber the sequence, or go down entirely.
//!
//! # Layout
//! - [`capture`]: reading and writing capture files.
//! - [`RelaySim`] / [`SimHandle`]: the server and its remote control.

pub mod capture;
pub mod jetstream;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use relay_client::cbor::Writer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, watch};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};

/// A fault delivered to every open connection.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Drop the TCP connection without a close frame.
    Close,
    /// Send these bytes as a binary message.
    Raw(Bytes),
    /// Send a text message.
    Text(String),
    /// Send an error frame (`op = -1`) and close.
    Error {
        /// The error name, e.g. `ConsumerTooSlow`.
        error: String,
        /// The message.
        message: String,
    },
}

/// Server settings.
#[derive(Debug, Clone, Default)]
pub struct SimConfig {
    /// How many frames are published (visible) at start; `None` = all of them.
    pub initial_head: Option<usize>,
    /// Publish the remaining frames at this many per second; `None` = never on its own.
    pub rate: Option<u32>,
    /// Oldest seq still in the backfill window; older cursors get `OutdatedCursor`.
    pub window_start: Option<u64>,
    /// The backfill window holds only the latest this many published events (a relay
    /// that keeps hours, not everything); older cursors get `OutdatedCursor`.
    pub window_len: Option<usize>,
    /// As a Jetstream instance: the v2 zstd dictionary it knows (another id is refused
    /// before the upgrade with HTTP 400 `UnknownZstdDictionary`); `None`: the shipped one.
    pub v2_dictionary: Option<u32>,
}

struct Log {
    /// (seq, frame) in publication order.
    frames: Vec<(u64, Bytes)>,
}

struct Shared {
    log: Mutex<Log>,
    cfg: SimConfig,
    head: watch::Sender<usize>,
    stalled: watch::Sender<bool>,
    down: AtomicBool,
    faults: broadcast::Sender<Fault>,
    connects: AtomicU64,
    open: AtomicU64,
    cursors: Mutex<Vec<Option<u64>>>,
    /// The oldest seq kept after [`SimHandle::trim`] (0: none trimmed).
    trimmed: AtomicU64,
    /// As a Jetstream instance: its events, one per log entry (same index).
    jet: Option<Vec<jetstream::Row>>,
}

/// A running simulated relay.
pub struct RelaySim {
    addr: SocketAddr,
    handle: SimHandle,
    task: tokio::task::JoinHandle<()>,
}

/// Remote control of a [`RelaySim`]; cheap to clone.
#[derive(Clone)]
pub struct SimHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SimHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHandle").field("head", &*self.shared.head.borrow()).finish_non_exhaustive()
    }
}

/// The seq of a frame, if it has one.
#[must_use]
pub fn frame_seq(bytes: &[u8]) -> Option<u64> {
    relay_client::frame::decode(bytes).ok().and_then(|f| match f {
        relay_client::Frame::Message(m) => m.seq(),
        relay_client::Frame::Error(_) => None,
    })
}

/// The seq a frame's body carries even when the frame as a whole does not decode (a
/// corrupt event still has its place in the log).
#[must_use]
pub fn peek_seq(bytes: &[u8]) -> Option<u64> {
    frame_seq(bytes).or_else(|| {
        let span = relay_client::frame::seq_span(bytes)?;
        relay_client::cbor::Reader::new(&bytes[span]).u64().ok()
    })
}

/// `frame` with its body's seq replaced by `seq` (all else byte for byte the same).
#[must_use]
pub fn with_seq(frame: &[u8], seq: u64) -> Option<Bytes> {
    let span = relay_client::frame::seq_span(frame)?;
    let mut w = Writer::new();
    w.raw(&frame[..span.start]).int(i64::try_from(seq).ok()?).raw(&frame[span.end..]);
    Some(Bytes::from(w.buf))
}

/// `frame` with its event time moved by `delta_ms` (a PDS whose clock runs fast or slow),
/// all else byte for byte the same; `None` when it has no time the same width can hold.
#[must_use]
pub fn with_time_shifted(frame: &[u8], delta_ms: i64) -> Option<Bytes> {
    let relay_client::Frame::Message(m) = relay_client::frame::decode(frame).ok()? else { return None };
    let t = m.time()?;
    let start = (t.as_ptr() as usize).checked_sub(frame.as_ptr() as usize)?;
    let ms = relay_client::probe::time_ms(t)? + delta_ms;
    let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()?;
    let fmt = time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
    let new = at.format(&fmt).ok()?;
    if new.len() != t.len() {
        return None;
    }
    let mut out = frame.to_vec();
    out[start..start + t.len()].copy_from_slice(new.as_bytes());
    Some(Bytes::from(out))
}

/// `frames` with the time of every event `pick` chooses moved by `delta_ms`: PDSs whose
/// clocks run slow (negative) or fast (positive), as every relay serving them shows.
#[must_use]
pub fn skew_clocks(
    frames: &[Bytes],
    pick: impl Fn(usize, &relay_client::Message<'_>) -> bool,
    delta_ms: i64,
) -> Vec<Bytes> {
    frames
        .iter()
        .enumerate()
        .map(|(i, f)| match relay_client::frame::decode(f) {
            Ok(relay_client::Frame::Message(m)) if pick(i, &m) => {
                with_time_shifted(f, delta_ms).unwrap_or_else(|| f.clone())
            }
            _ => f.clone(),
        })
        .collect()
}

/// The repo (DID) an event is about, if it decodes.
fn frame_did(bytes: &[u8]) -> Option<String> {
    match relay_client::frame::decode(bytes).ok()? {
        relay_client::Frame::Message(m) => m.did().map(str::to_owned),
        relay_client::Frame::Error(_) => None,
    }
}

/// The same events as another relay would serve them: a second seq space. Seqs start
/// after `offset` and stay increasing; within blocks of `block` events the order across
/// repos is shuffled (by `seed`) while each repo's events keep their order, so event
/// times stay roughly increasing, as on a real relay. Frames without a seq are dropped.
#[must_use]
pub fn reseq(frames: &[Bytes], offset: u64, block: usize, seed: u64) -> Vec<Bytes> {
    let rank = |did: &Option<String>| {
        let h = did
            .as_deref()
            .unwrap_or("")
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64 ^ seed, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        h.rotate_left(17) ^ seed
    };
    let mut events: Vec<(Option<String>, &Bytes)> =
        frames.iter().filter(|f| frame_seq(f).is_some()).map(|f| (frame_did(f), f)).collect();
    for chunk in events.chunks_mut(block.max(1)) {
        // Stable: events of one repo share a rank and keep their relative order.
        chunk.sort_by_key(|(did, _)| rank(did));
    }
    events.iter().zip(offset + 1..).filter_map(|((_, f), seq)| with_seq(f, seq)).collect()
}

/// `frames` without the events `drop` picks (to make a relay that lost a repo's commit).
#[must_use]
pub fn without(frames: &[Bytes], drop: impl Fn(&relay_client::Message<'_>) -> bool) -> Vec<Bytes> {
    frames
        .iter()
        .filter(|f| match relay_client::frame::decode(f) {
            Ok(relay_client::Frame::Message(m)) => !drop(&m),
            _ => true,
        })
        .cloned()
        .collect()
}

/// An error frame `{op:-1}{error, message}`.
#[must_use]
pub fn error_frame(error: &str, message: &str) -> Bytes {
    let mut w = Writer::new();
    w.map(1).str("op").int(-1).map(2).str("error").str(error).str("message").str(message);
    Bytes::from(w.buf)
}

/// A `#sync` frame: `did` is at `rev` (with an empty CAR: firekeeper does not read it).
#[must_use]
pub fn sync_frame(seq: u64, did: &str, rev: &str, time: &str) -> Bytes {
    let mut w = Writer::new();
    w.map(2).str("t").str("#sync").str("op").int(1);
    w.map(5).str("did").str(did).str("rev").str(rev).str("seq").int(i64::try_from(seq).unwrap_or(i64::MAX));
    w.str("time").str(time).str("blocks").bytes(&[]);
    Bytes::from(w.buf)
}

/// An `#identity` frame: `did` at `time`, no handle.
#[must_use]
pub fn identity_frame(seq: u64, did: &str, time: &str) -> Bytes {
    let mut w = Writer::new();
    w.map(2).str("t").str("#identity").str("op").int(1);
    w.map(3).str("did").str(did).str("seq").int(i64::try_from(seq).unwrap_or(i64::MAX)).str("time").str(time);
    Bytes::from(w.buf)
}

/// An `#info` frame.
#[must_use]
pub fn info_frame(name: &str, message: &str) -> Bytes {
    let mut w = Writer::new();
    w.map(2).str("t").str("#info").str("op").int(1).map(2).str("name").str(name).str("message").str(message);
    Bytes::from(w.buf)
}

impl RelaySim {
    /// Starts on a free loopback port with every frame published.
    pub async fn start(frames: Vec<Bytes>) -> std::io::Result<Self> {
        Self::start_with(frames, SimConfig::default(), "127.0.0.1:0".parse().expect("addr")).await
    }

    /// Starts with explicit settings on `addr`.
    pub async fn start_with(frames: Vec<Bytes>, cfg: SimConfig, addr: SocketAddr) -> std::io::Result<Self> {
        let frames: Vec<(u64, Bytes)> = {
            let mut last = 0;
            frames
                .into_iter()
                .map(|f| {
                    last = peek_seq(&f).unwrap_or(last);
                    (last, f)
                })
                .collect()
        };
        Self::launch(frames, None, cfg, addr).await
    }

    /// Starts as a Jetstream instance serving the capture's events (v1 and v2, plain or
    /// compressed, as each connection asks), stamped by `clock`. `cfg.window_start` is
    /// then the oldest stamp served, and [`SimHandle::trim`] takes a stamp.
    pub async fn start_jetstream(
        frames: &[Bytes],
        clock: &jetstream::Clock,
        cfg: SimConfig,
        addr: SocketAddr,
    ) -> std::io::Result<Self> {
        let rows = jetstream::rows(frames, clock);
        let log = rows.iter().map(|r| (r.stamp, r.v1.clone())).collect();
        Self::launch(log, Some(rows), cfg, addr).await
    }

    async fn launch(
        frames: Vec<(u64, Bytes)>,
        jet: Option<Vec<jetstream::Row>>,
        cfg: SimConfig,
        addr: SocketAddr,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let head = cfg.initial_head.unwrap_or(frames.len()).min(frames.len());
        let shared = Arc::new(Shared {
            log: Mutex::new(Log { frames }),
            cfg: cfg.clone(),
            head: watch::Sender::new(head),
            stalled: watch::Sender::new(false),
            down: AtomicBool::new(false),
            faults: broadcast::channel(1024).0,
            connects: AtomicU64::new(0),
            open: AtomicU64::new(0),
            cursors: Mutex::new(Vec::new()),
            trimmed: AtomicU64::new(0),
            jet,
        });
        let handle = SimHandle { shared: shared.clone() };
        if let Some(rate) = cfg.rate.filter(|&r| r > 0) {
            let h = handle.clone();
            tokio::spawn(async move { h.pace(rate).await });
        }
        let task = tokio::spawn(accept_loop(listener, shared));
        Ok(Self { addr, handle, task })
    }

    /// `ws://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// The bound address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The remote control.
    #[must_use]
    pub fn handle(&self) -> SimHandle {
        self.handle.clone()
    }

    /// Runs until the task ends (for the binary).
    pub async fn wait(mut self) {
        let _ = (&mut self.task).await;
    }
}

impl Drop for RelaySim {
    fn drop(&mut self) {
        self.task.abort();
        let _ = self.handle.shared.faults.send(Fault::Close);
    }
}

impl SimHandle {
    async fn pace(&self, rate: u32) {
        let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
        loop {
            tick.tick().await;
            let total = self.shared.log.lock().expect("log").frames.len();
            let mut done = false;
            self.shared.head.send_modify(|h| {
                if *h < total {
                    *h += 1;
                } else {
                    done = true;
                }
            });
            if done {
                return;
            }
        }
    }

    /// Appends a frame and publishes it at once.
    pub fn publish(&self, frame: Bytes) {
        let mut log = self.shared.log.lock().expect("log");
        let last = log.frames.last().map_or(0, |f| f.0);
        let seq = peek_seq(&frame).unwrap_or(last);
        log.frames.push((seq, frame));
        let n = log.frames.len();
        drop(log);
        self.shared.head.send_replace(n);
    }

    /// Publishes frames up to index `n` of the log.
    pub fn publish_up_to(&self, n: usize) {
        let total = self.shared.log.lock().expect("log").frames.len();
        self.shared.head.send_replace(n.min(total));
    }

    /// The seq of the newest published frame.
    #[must_use]
    pub fn head_seq(&self) -> u64 {
        let head = *self.shared.head.borrow();
        let log = self.shared.log.lock().expect("log");
        head.checked_sub(1).map_or(0, |i| log.frames[i].0)
    }

    /// Drops every open connection.
    pub fn close_all(&self) {
        let _ = self.shared.faults.send(Fault::Close);
    }

    /// Stops (true) or resumes (false) sending data; pings are still answered.
    pub fn stall(&self, on: bool) {
        self.shared.stalled.send_replace(on);
    }

    /// Sends raw bytes as one binary message on every connection.
    pub fn send_raw(&self, bytes: Bytes) {
        let _ = self.shared.faults.send(Fault::Raw(bytes));
    }

    /// Sends a text message on every connection.
    pub fn send_text(&self, text: &str) {
        let _ = self.shared.faults.send(Fault::Text(text.to_owned()));
    }

    /// Sends an error frame and closes every connection.
    pub fn send_error(&self, error: &str, message: &str) {
        let _ = self.shared.faults.send(Fault::Error { error: error.to_owned(), message: message.to_owned() });
    }

    /// Renumbers the frames not yet published so that they continue at `base`, `base+1`,
    /// …, as a relay that restarted with a fresh sequence would: a live consumer then
    /// sees seq jump backwards.
    pub fn reset_seq(&self, base: u64) {
        let head = *self.shared.head.borrow();
        let mut log = self.shared.log.lock().expect("log");
        for (i, (seq, f)) in log.frames.iter_mut().skip(head).enumerate() {
            let s = base + i as u64;
            if let Some(b) = with_seq(f, s) {
                *f = b;
                *seq = s;
            }
        }
    }

    /// Takes the relay down (closes connections, refuses new ones) or brings it up.
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
        if down {
            self.close_all();
        }
    }

    /// Drops the events before `seq` from the backfill window, as a relay that trimmed its
    /// log (or restarted with less) would: an older cursor then gets `OutdatedCursor`.
    pub fn trim(&self, seq: u64) {
        self.shared.trimmed.fetch_max(seq, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    #[must_use]
    pub fn connects(&self) -> u64 {
        self.shared.connects.load(Ordering::SeqCst)
    }

    /// Connections open now.
    #[must_use]
    pub fn open_connections(&self) -> u64 {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// The cursor each accepted connection asked for, in order.
    #[must_use]
    pub fn cursors(&self) -> Vec<Option<u64>> {
        self.shared.cursors.lock().expect("cursors").clone()
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        if shared.down.load(Ordering::SeqCst) {
            drop(tcp);
            continue;
        }
        let _ = tcp.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            shared.open.fetch_add(1, Ordering::SeqCst);
            let _ = serve(tcp, &shared).await;
            shared.open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

fn parse_cursor(query: Option<&str>) -> Result<Option<u64>, ()> {
    let Some(q) = query else { return Ok(None) };
    for pair in q.split('&') {
        if let Some(v) = pair.strip_prefix("cursor=") {
            return v.parse().map(Some).map_err(|_| ());
        }
    }
    Ok(None)
}

/// Where a subscription starts in the log.
enum Start {
    At(usize),
    Outdated(usize),
    Future,
}

async fn serve(tcp: TcpStream, shared: &Shared) -> Result<(), tokio_tungstenite::tungstenite::Error> {
    let mut query = None;
    let mut path = String::new();
    let known = shared.cfg.v2_dictionary.unwrap_or(relay_client::jetstream::DICT_V2_ID);
    let jet = shared.jet.is_some();
    // The callback's signature is tungstenite's: its error type is the HTTP response.
    #[allow(clippy::result_large_err)]
    let ws = tokio_tungstenite::accept_hdr_async(tcp, |req: &Request, resp: Response| {
        query = req.uri().query().map(str::to_owned);
        req.uri().path().clone_into(&mut path);
        if jet && let Some(id) = jetstream::unknown_dictionary(req.uri().path(), query.as_deref(), known) {
            let body =
                format!(r#"{{"error":"UnknownZstdDictionary","message":"unknown dictionary {id}; current {known}"}}"#);
            let mut refused = tokio_tungstenite::tungstenite::handshake::server::ErrorResponse::new(Some(body));
            *refused.status_mut() = tokio_tungstenite::tungstenite::http::StatusCode::BAD_REQUEST;
            return Err(refused);
        }
        Ok(resp)
    })
    .await?;
    if let Some(rows) = &shared.jet {
        let Some(ask) = jetstream::Ask::parse(&path, query.as_deref()) else {
            let (mut tx, _) = ws.split();
            return tx.close().await;
        };
        return serve_jet(ws, shared, rows, ask).await;
    }
    serve_firehose(ws, shared, query).await
}

/// One accepted connection: its two halves and what it watches.
struct Conn {
    tx: Tx,
    rx: futures_util::stream::SplitStream<tokio_tungstenite::WebSocketStream<TcpStream>>,
    faults: broadcast::Receiver<Fault>,
    head: watch::Receiver<usize>,
    stalled: watch::Receiver<bool>,
    /// A Jetstream v2 connection: error faults are its JSON error frames.
    v2: Option<bool>,
}

impl Conn {
    /// Splits `ws` and counts it; `None` (closed) when the simulator was taken down
    /// while it was being accepted (its close went out before this subscribed to the
    /// faults and would be missed: the connection then lived on, "down").
    async fn open(
        ws: tokio_tungstenite::WebSocketStream<TcpStream>,
        shared: &Shared,
    ) -> Result<Option<Self>, tokio_tungstenite::tungstenite::Error> {
        let (mut tx, rx) = ws.split();
        let faults = shared.faults.subscribe();
        if shared.down.load(Ordering::SeqCst) {
            tx.close().await?;
            return Ok(None);
        }
        let (head, stalled) = (shared.head.subscribe(), shared.stalled.subscribe());
        shared.connects.fetch_add(1, Ordering::SeqCst);
        Ok(Some(Self { tx, rx, faults, head, stalled, v2: None }))
    }

    /// Applies a fault; true when the connection is over.
    async fn fault(&mut self, f: Fault) -> Result<bool, tokio_tungstenite::tungstenite::Error> {
        match self.v2 {
            Some(v2) => apply_jet(&mut self.tx, f, v2).await,
            None => apply(&mut self.tx, f).await,
        }
    }

    /// After a batch: lets faults and pings in; true when the connection is over.
    async fn after_batch(&mut self) -> Result<bool, tokio_tungstenite::tungstenite::Error> {
        self.tx.flush().await?;
        tokio::task::yield_now().await;
        match self.faults.try_recv() {
            Ok(f) => self.fault(f).await,
            Err(_) => Ok(false),
        }
    }

    /// Waits for a fault, a publish, a stall change or the client's end (faults first:
    /// one sent before a publish reaches the client before its events); true when the
    /// connection is over.
    async fn wait(&mut self) -> Result<bool, tokio_tungstenite::tungstenite::Error> {
        tokio::select! {
            biased;
            f = self.faults.recv() => match f {
                Ok(f) => self.fault(f).await,
                Err(broadcast::error::RecvError::Lagged(_)) => Ok(false),
                Err(broadcast::error::RecvError::Closed) => Ok(true),
            },
            r = self.head.changed() => Ok(r.is_err()),
            r = self.stalled.changed() => Ok(r.is_err()),
            m = self.rx.next() => Ok(matches!(m, None | Some(Err(_) | Ok(Message::Close(_))))),
        }
    }
}

/// A connection to the simulator as a relay.
async fn serve_firehose(
    ws: tokio_tungstenite::WebSocketStream<TcpStream>,
    shared: &Shared,
    query: Option<String>,
) -> Result<(), tokio_tungstenite::tungstenite::Error> {
    let Some(mut c) = Conn::open(ws, shared).await? else { return Ok(()) };
    let Ok(cursor) = parse_cursor(query.as_deref()) else {
        c.tx.send(Message::Binary(error_frame("InvalidRequest", "cursor must be an integer"))).await?;
        return c.tx.close().await;
    };
    shared.cursors.lock().expect("cursors").push(cursor);

    // Where to start in the log, decided without holding the lock across a send.
    let start = {
        let log = shared.log.lock().expect("log");
        let h = *c.head.borrow();
        let head_seq = h.checked_sub(1).map_or(0, |i| log.frames[i].0);
        match cursor {
            None => Start::At(h),
            Some(cur) if cur > head_seq => Start::Future,
            Some(cur) => {
                let mut window = shared.cfg.window_start.unwrap_or(0).max(shared.trimmed.load(Ordering::SeqCst));
                if let Some(n) = shared.cfg.window_len
                    && h > n
                {
                    window = window.max(log.frames[h - n].0);
                }
                let from = log.frames[..h].partition_point(|(s, _)| *s <= cur.max(window.saturating_sub(1)));
                if cur.saturating_add(1) < window { Start::Outdated(from) } else { Start::At(from) }
            }
        }
    };
    let mut next = match start {
        Start::At(i) => i,
        Start::Outdated(i) => {
            c.tx.send(Message::Binary(info_frame(
                "OutdatedCursor",
                "Requested cursor exceeded limit. Possibly missing events",
            )))
            .await?;
            i
        }
        Start::Future => {
            c.tx.send(Message::Binary(error_frame("FutureCursor", "Cursor in the future."))).await?;
            return c.tx.close().await;
        }
    };

    loop {
        // Send what is published, unless stalled.
        if !*c.stalled.borrow() {
            let batch: Vec<Bytes> = {
                let log = shared.log.lock().expect("log");
                let h = (*c.head.borrow()).min(log.frames.len());
                let end = h.min(next + 256);
                log.frames[next.min(end)..end].iter().map(|(_, f)| f.clone()).collect()
            };
            if !batch.is_empty() {
                next += batch.len();
                for f in batch {
                    c.tx.feed(Message::Binary(f)).await?;
                }
                if c.after_batch().await? {
                    return Ok(());
                }
                continue;
            }
        }
        if c.wait().await? {
            return Ok(());
        }
    }
}

/// A connection to the simulator as a Jetstream instance.
async fn serve_jet(
    ws: tokio_tungstenite::WebSocketStream<TcpStream>,
    shared: &Shared,
    rows: &[jetstream::Row],
    ask: Result<jetstream::Ask, String>,
) -> Result<(), tokio_tungstenite::tungstenite::Error> {
    let Some(mut c) = Conn::open(ws, shared).await? else { return Ok(()) };
    let mut ask = match ask {
        Ok(a) => a,
        Err(e) => {
            let frame = jetstream::error_frame("InvalidRequest", &e);
            c.tx.send(Message::Text(String::from_utf8_lossy(&frame).into_owned().into())).await?;
            return c.tx.close().await;
        }
    };
    shared.cursors.lock().expect("cursors").push(ask.cursor);
    let v2 = ask.version == Some(relay_client::jetstream::Version::V2);
    c.v2 = Some(v2);
    let (mut next, outdated) = {
        let h = (*c.head.borrow()).min(rows.len());
        let mut window = shared.cfg.window_start.unwrap_or(0).max(shared.trimmed.load(Ordering::SeqCst));
        if let Some(n) = shared.cfg.window_len
            && h > n
        {
            window = window.max(rows[h - n].stamp);
        }
        ask.start(rows, h, window)
    };
    if outdated && v2 {
        c.tx.send(Message::Text(String::from_utf8_lossy(&jetstream::info_outdated()).into_owned().into())).await?;
    }
    loop {
        if !*c.stalled.borrow() {
            let h = (*c.head.borrow()).min(rows.len());
            let end = h.min(next + 256);
            if next < end {
                for row in &rows[next..end] {
                    if !ask.wants(row) {
                        continue;
                    }
                    let (frame, binary) = ask.frame(row);
                    let msg = if binary {
                        Message::Binary(frame)
                    } else {
                        Message::Text(String::from_utf8_lossy(&frame).into_owned().into())
                    };
                    c.tx.feed(msg).await?;
                }
                next = end;
                if c.after_batch().await? {
                    return Ok(());
                }
                continue;
            }
        }
        if c.wait().await? {
            return Ok(());
        }
    }
}

/// A fault on a Jetstream connection: error frames are v2's JSON ones (v1 just closes).
async fn apply_jet(tx: &mut Tx, f: Fault, v2: bool) -> Result<bool, tokio_tungstenite::tungstenite::Error> {
    match f {
        Fault::Error { error, message } => {
            if v2 {
                let frame = jetstream::error_frame(&error, &message);
                tx.send(Message::Text(String::from_utf8_lossy(&frame).into_owned().into())).await?;
            }
            let _ = tx.close().await;
            Ok(true)
        }
        other => apply(tx, other).await,
    }
}

type Tx = futures_util::stream::SplitSink<tokio_tungstenite::WebSocketStream<TcpStream>, Message>;

/// Applies a fault; true when the connection is over.
async fn apply(tx: &mut Tx, f: Fault) -> Result<bool, tokio_tungstenite::tungstenite::Error> {
    match f {
        Fault::Close => Ok(true),
        Fault::Raw(b) => tx.send(Message::Binary(b)).await.map(|()| false),
        Fault::Text(t) => tx.send(Message::Text(t.into())).await.map(|()| false),
        Fault::Error { error, message } => {
            tx.send(Message::Binary(error_frame(&error, &message))).await?;
            let _ = tx.close().await;
            Ok(true)
        }
    }
}
