//! The built-in [`Handler`]s. Each write is one batch, in seq order for its lane; a batch
//! is done (and may count towards the cursor) only when its write returned `Ok`. Every
//! handler checks the term's deadline right before its externally visible action (after
//! any wait for a lock, before a request or a `COMMIT`), so a process that froze or
//! waited past its deadline writes nothing.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use atproto_data::Message;
use checkpoint::{CommitOutcome, PostgresStore};
use consumer::{BatchCtx, Event, Handler, HandlerError, Snapshot};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

pub mod jetstream;
pub use jetstream::{JetStream, JetStreamConfig};

/// The schema of the Postgres sink's events table.
pub const EVENTS_MIGRATION: &str = include_str!("../../../migrations/0002_events.sql");

/// The schema of the Postgres sink's chain-break table.
pub const CHAIN_BREAKS_MIGRATION: &str = include_str!("../../../migrations/0003_chain_breaks.sql");

/// Why a sink could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The JSON lines file could not be opened.
    #[error("opening {path}: {source}")]
    File {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Postgres could not be reached or refused the schema.
    #[error("{what}: {source}")]
    Store {
        /// The step that failed.
        what: &'static str,
        /// Why.
        #[source]
        source: checkpoint::StoreError,
    },
    /// The HTTP client could not be built.
    #[error("webhook client: {0}")]
    Http(#[from] reqwest::Error),
}

/// What names an event whatever its seq: a `#commit`/`#sync` by repo and rev, an
/// `#identity`/`#account` by DID and time, a Jetstream event by its content (one op of a
/// commit by repo, rev, collection, record key and action), anything else by its frame. Stable across
/// versions and processes (a replay by another leader must get the same key).
#[must_use]
pub fn event_key(e: &Event) -> u64 {
    use atproto_data::hash::{FNV_OFFSET, fnv1a};
    let (a, b) = match e.message() {
        Message::Commit(c) => (c.repo, c.rev),
        Message::Sync(s) => (s.did, s.rev),
        Message::Identity(i) => (i.did, i.time),
        Message::Account(a) => (a.did, a.time),
        // A Jetstream event by what it is (one op of a commit, or the upstream event).
        Message::Jet(j) => return j.content_key(),
        _ => return fnv1a(FNV_OFFSET, e.bytes()),
    };
    fnv1a(fnv1a(fnv1a(FNV_OFFSET, a.as_bytes()), &[0]), b.as_bytes())
}

/// The JSON line of an event: `{"seq","relay","token","event"}`, preceded, when the
/// event carries a chain break, by a line of the same seq whose event is the
/// `#chain-break` (so downstream learns to resync the repo before its next commit).
pub fn line(e: &Event, ctx: &BatchCtx, out: &mut String) {
    use std::fmt::Write as _;
    let head = |out: &mut String| {
        let _ = write!(out, "{{\"seq\":{},\"relay\":\"{}\",\"token\":{},\"event\":", e.seq(), ctx.relay, ctx.token);
    };
    if let Some(b) = e.chain_break() {
        head(out);
        b.write_json(e.seq(), out);
        out.push_str("}\n");
    }
    head(out);
    match e.json() {
        Some(j) => out.push_str(j),
        None => {
            e.render_json(out);
        }
    }
    out.push_str("}\n");
}

/// The JSON lines of a snapshot's events `range` (0 is the `#resync`): shaped like
/// [`line`], with `"seq":null` (a snapshot has no place in the relay's numbering).
#[must_use]
pub fn snapshot_lines(s: &Snapshot, range: std::ops::Range<usize>, ctx: &BatchCtx) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(range.len() * 256);
    for i in range {
        let _ = write!(out, "{{\"seq\":null,\"relay\":\"{}\",\"token\":{},\"event\":", ctx.relay, ctx.token);
        s.write_event_json(i, &mut out);
        out.push_str("}\n");
    }
    out
}

fn lines(batch: &[Event], ctx: &BatchCtx) -> String {
    let mut buf = String::with_capacity(batch.iter().map(|e| e.json().map_or(0, str::len) + 64).sum());
    for e in batch {
        line(e, ctx, &mut buf);
    }
    buf
}

/// One JSON line per event, to stdout or a file (appended). A batch counts only once it
/// is wholly written: to a regular file (a path, or stdout redirected to one), a write
/// that fails part-way (a full disk) is cut off again before the batch is retried, so no
/// torn line and no half batch stays behind; to a stream that cannot be cut (a pipe, a
/// terminal), a write that fails part-way stops the consumer with an error.
pub struct Jsonl(Mutex<Output>);

/// Where the lines go.
enum Output {
    /// A regular file: appended to, cut back on a failed write.
    File(Arc<std::fs::File>),
    /// A stream that cannot be cut.
    Stream(Box<dyn AsyncWrite + Unpin + Send>),
}

impl Jsonl {
    /// Lines on stdout (cut back on failure when stdout is a regular file).
    #[must_use]
    pub fn stdout() -> Self {
        use std::os::fd::AsFd as _;
        let file = std::io::stdout()
            .as_fd()
            .try_clone_to_owned()
            .ok()
            .map(std::fs::File::from)
            .filter(|f| f.metadata().is_ok_and(|m| m.is_file()));
        match file {
            Some(f) => Self(Mutex::new(Output::File(Arc::new(f)))),
            None => Self::to(Box::new(tokio::io::stdout())),
        }
    }

    /// Lines appended to `path` (a regular file is cut back on failure; anything else, a
    /// FIFO say, is a stream).
    pub async fn open(path: &str) -> Result<Self, OpenError> {
        let p = path.to_owned();
        let f = tokio::task::spawn_blocking(move || std::fs::OpenOptions::new().create(true).append(true).open(p))
            .await
            .map_err(|e| OpenError::File { path: path.to_owned(), source: std::io::Error::other(e) })?
            .map_err(|source| OpenError::File { path: path.to_owned(), source })?;
        if f.metadata().is_ok_and(|m| m.is_file()) {
            Ok(Self(Mutex::new(Output::File(Arc::new(f)))))
        } else {
            Ok(Self::to(Box::new(tokio::fs::File::from_std(f))))
        }
    }

    /// Lines to any writer (a stream: a write that fails part-way is fatal).
    #[must_use]
    pub fn to(w: Box<dyn AsyncWrite + Unpin + Send>) -> Self {
        Self(Mutex::new(Output::Stream(w)))
    }
}

/// Appends `buf` to `f` whole, or leaves `f` as it was: a write that fails part-way is cut
/// off again (the error is then retryable); one that cannot be cut off is fatal.
fn append_whole(f: &std::fs::File, buf: &[u8]) -> Result<(), HandlerError> {
    use std::io::{Seek as _, SeekFrom, Write as _};
    let mut f = f;
    let start = f.seek(SeekFrom::End(0)).map_err(|e| HandlerError::failed("jsonl write", e))?;
    let Err(e) = f.write_all(buf) else { return Ok(()) };
    match f.set_len(start).and_then(|()| f.seek(SeekFrom::Start(start)).map(|_| ())) {
        Ok(()) => Err(HandlerError::failed("jsonl write", e)),
        Err(cut) => Err(HandlerError::fatal(
            format!("jsonl write ({e}): the part written could not be cut off again, the file ends in a torn line"),
            cut,
        )),
    }
}

/// Writes `buf` to a stream: nothing written is retryable; part written is fatal (a
/// stream cannot be cut back, and a retry would leave a torn line before the batch).
async fn write_stream(w: &mut (dyn AsyncWrite + Unpin + Send), buf: &[u8]) -> Result<(), HandlerError> {
    let mut done = 0;
    while done < buf.len() {
        match w.write(&buf[done..]).await {
            Ok(0) => return Err(torn(done, buf.len(), std::io::ErrorKind::WriteZero.into())),
            Ok(n) => done += n,
            Err(e) if done == 0 => return Err(HandlerError::failed("jsonl write", e)),
            Err(e) => return Err(torn(done, buf.len(), e)),
        }
    }
    w.flush().await.map_err(|e| HandlerError::fatal("jsonl flush", e))
}

fn torn(done: usize, of: usize, e: std::io::Error) -> HandlerError {
    HandlerError::fatal(
        format!("jsonl write, failed after {done} of {of} bytes of a batch (a stream that cannot be cut back)"),
        e,
    )
}

impl Jsonl {
    /// Writes `buf` whole (or not at all, where the output can be cut back).
    async fn write(&self, buf: String, ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut out = self.0.lock().await;
        // Waiting for the lock may have outlasted the term (another lane was writing, or
        // the process was frozen).
        ctx.ensure_active()?;
        match &mut *out {
            Output::File(f) => {
                let f = f.clone();
                tokio::task::spawn_blocking(move || append_whole(&f, buf.as_bytes()))
                    .await
                    .map_err(|e| HandlerError::failed("jsonl write", e))?
            }
            Output::Stream(w) => write_stream(w.as_mut(), buf.as_bytes()).await,
        }
    }
}

#[async_trait]
impl Handler for Jsonl {
    async fn handle(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), HandlerError> {
        self.write(lines(batch, ctx), ctx).await
    }

    fn wants_json(&self) -> bool {
        true
    }

    fn takes_snapshots(&self) -> bool {
        true
    }

    /// A part of a snapshot in one write (a part is whole lines, at most
    /// `PART_RECORDS` records).
    async fn snapshot(&self, s: &Snapshot, ctx: &BatchCtx) -> Result<(), HandlerError> {
        self.write(snapshot_lines(s, 0..s.events(), ctx), ctx).await
    }
}

/// Batched POSTs of JSON lines, with the token in `x-firekeeper-token`.
pub struct Webhook {
    client: reqwest::Client,
    url: String,
    batch: usize,
}

impl Webhook {
    /// POSTs of at most `batch` events to `url` (never logged), each bounded by `timeout`.
    /// Redirects are not followed: a 301/302/303 would turn the POST into a body-less GET
    /// whose 2xx proves nothing.
    pub fn new(url: &str, batch: usize, timeout: Duration) -> Result<Self, OpenError> {
        let client = reqwest::Client::builder().timeout(timeout).redirect(reqwest::redirect::Policy::none()).build()?;
        Ok(Self { client, url: url.to_owned(), batch: batch.max(1) })
    }
}

/// A redirect target for a log line: scheme, host and path only (no credentials, no
/// query string, which may carry tokens).
fn redact_location(l: &str) -> String {
    match url::Url::parse(l) {
        Ok(u) => format!("{}://{}{}", u.scheme(), u.host_str().unwrap_or(""), u.path()),
        Err(_) => l.split(['?', '#']).next().unwrap_or("").rsplit('@').next().unwrap_or("").to_owned(),
    }
}

/// A webhook answer that refuses a batch for what it holds (400 Bad Request, 413 Payload
/// Too Large, 422 Unprocessable Content): the batch is then written in halves to find the
/// events it refuses. Every other 4xx is about the request and is retried.
#[must_use]
pub fn refuses_content(status: u16) -> bool {
    matches!(status, 400 | 413 | 422)
}

#[async_trait]
impl Handler for Webhook {
    async fn handle(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), HandlerError> {
        self.post(lines(batch, ctx), ctx).await
    }

    fn wants_json(&self) -> bool {
        true
    }

    fn max_batch(&self) -> usize {
        self.batch
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn takes_snapshots(&self) -> bool {
        true
    }

    /// A part of a snapshot in POSTs of at most the batch size (`#resync` first in the
    /// first part); a failed POST is retried from the part's start, and a snapshot given
    /// up part-way is fetched again later and starts over from its `#resync` (which makes
    /// the receiver start the repo over).
    async fn snapshot(&self, s: &Snapshot, ctx: &BatchCtx) -> Result<(), HandlerError> {
        let n = s.events();
        let mut at = 0;
        while at < n {
            let end = (at + self.batch).min(n);
            self.post(snapshot_lines(s, at..end, ctx), ctx).await?;
            at = end;
        }
        Ok(())
    }
}

impl Webhook {
    /// One POST of JSON lines.
    async fn post(&self, body: String, ctx: &BatchCtx) -> Result<(), HandlerError> {
        ctx.ensure_active()?;
        let resp = self
            .client
            .post(&self.url)
            .header("content-type", "application/x-ndjson")
            .header("x-firekeeper-token", ctx.token)
            .body(body)
            .send()
            .await
            .map_err(|e| HandlerError::failed("webhook", e.without_url()))?;
        let status = resp.status();
        if status.is_success() {
            Ok(())
        } else if status.is_redirection() {
            Err(HandlerError::failed(
                "webhook",
                format!(
                    "answered HTTP {} (redirect to {:?}); redirects are not followed: point \
                 FIREKEEPER_WEBHOOK_URL at the final address",
                    status.as_u16(),
                    resp.headers().get("location").and_then(|l| l.to_str().ok()).map(redact_location)
                ),
            ))
        } else if refuses_content(status.as_u16()) {
            // The receiver refuses this batch for what it holds: it would every time.
            Err(HandlerError::refused("webhook", format!("answered HTTP {}", status.as_u16())))
        } else if status.is_client_error() {
            // 401, 403, 404, 405, 409, 415 …: the request, not its content (credentials, the
            // address, a receiver being deployed). Every batch would get it: retried, never
            // taken for a bad record, or a misconfigured receiver would turn the whole
            // stream into `#invalid` placeholders.
            Err(HandlerError::failed(
                "webhook",
                format!(
                    "answered HTTP {}: the receiver refuses the request itself, not a record (check \
                     FIREKEEPER_WEBHOOK_URL and what the receiver expects)",
                    status.as_u16()
                ),
            ))
        } else {
            Err(HandlerError::failed("webhook", format!("answered HTTP {}", status.as_u16())))
        }
    }
}

/// Rows in `firekeeper_events`, with the cursor (and the relay time at it, and the relay
/// the leader is on) committed in the same transaction and fenced by the token.
///
/// A row is named by its relay, seq and event key, so a replay of the same event is not
/// stored twice while a new event under an old seq (a relay that renumbered) is. The
/// connection is made again after it broke (a restart, a failover); after
/// [`PG_GIVE_UP`] failed writes in a row the term is given up, so that a replica with a
/// working connection may take over. A record Postgres cannot keep as jsonb (a NUL
/// character) is kept as its JSON text in `body_text`.
pub struct Postgres {
    conn: checkpoint::postgres_store::PgConn,
    /// Keep `firekeeper_records` equal to every repo's verified state.
    records: bool,
}

/// Failed writes in a row after which the Postgres sink gives up the term: with the
/// lane's backoff (100 ms doubling to 10 s), about 25 s of failing.
pub const PG_GIVE_UP: u32 = 8;

/// The schema the Postgres sink needs, its cursor's included.
fn pg_schema() -> String {
    [
        checkpoint::postgres_store::MIGRATION,
        EVENTS_MIGRATION,
        CHAIN_BREAKS_MIGRATION,
        EVENT_KEYS_MIGRATION,
        RECORDS_MIGRATION,
    ]
    .concat()
}

/// Snapshot rows (seq NULL) and the records mirror.
pub const RECORDS_MIGRATION: &str = include_str!("../../../migrations/0007_records.sql");

/// Rows named by event, bodies Postgres cannot keep as jsonb kept as text.
pub const EVENT_KEYS_MIGRATION: &str = include_str!("../../../migrations/0006_event_keys.sql");

impl Postgres {
    /// Connects and applies the cursor and events schemas.
    pub async fn connect(url: &str) -> Result<Self, OpenError> {
        let conn = checkpoint::postgres_store::PgConn::connect(url, Duration::from_secs(10), &pg_schema())
            .await
            .map_err(|e| OpenError::Store { what: "connecting to DATABASE_URL", source: e })?;
        Ok(Self { conn, records: false })
    }

    /// Keeps `firekeeper_records` equal to every repo's verified state
    /// (`FIREKEEPER_POSTGRES_RECORDS`).
    #[must_use]
    pub fn with_records(mut self, records: bool) -> Self {
        self.records = records;
        self
    }

    /// How many times the connection was made again.
    #[must_use]
    pub fn reconnects(&self) -> u64 {
        self.conn.reconnects()
    }
}

#[async_trait]
impl Handler for Postgres {
    async fn handle(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut c = self.conn.client().await.map_err(|e| HandlerError::failed("postgres connection", e))?;
        pg_write(&mut c, batch, ctx, self.records).await
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn takes_snapshots(&self) -> bool {
        true
    }

    /// A part of a snapshot (seq NULL) and, with the records mirror, its rows: one
    /// transaction, fenced by the term (see `pg_snapshot`).
    async fn snapshot(&self, s: &Snapshot, ctx: &BatchCtx) -> Result<(), HandlerError> {
        let mut c = self.conn.client().await.map_err(|e| HandlerError::failed("postgres connection", e))?;
        pg_snapshot(&mut c, s, ctx, self.records).await
    }

    fn wants_json(&self) -> bool {
        true
    }

    fn commits_cursor(&self) -> bool {
        true
    }

    fn give_up_after(&self) -> Option<u32> {
        Some(PG_GIVE_UP)
    }
}

/// A data error of Postgres (class 22, or a program limit, class 54): the content, not
/// the connection.
fn content_error(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("54"))
}

/// The batch's rows: seqs, kinds, DIDs, event keys, and bodies as jsonb or as text.
struct Rows<'a> {
    seqs: Vec<i64>,
    kinds: Vec<&'static str>,
    dids: Vec<Option<&'a str>>,
    keys: Vec<String>,
    json: Vec<Option<&'a str>>,
    text: Vec<Option<&'a str>>,
}

impl<'a> Rows<'a> {
    /// Bodies as jsonb, but those with a NUL (which jsonb cannot hold) as text; with
    /// `all_text`, every body as text.
    fn new(batch: &'a [Event], rendered: &'a [String], all_text: bool) -> Self {
        let mut own = rendered.iter();
        let bodies: Vec<&str> =
            batch.iter().map(|e| e.json().unwrap_or_else(|| own.next().map_or("null", String::as_str))).collect();
        let as_text = |b: &str| all_text || b.contains("\\u0000");
        Self {
            seqs: batch.iter().map(|e| i64::try_from(e.seq()).unwrap_or(i64::MAX)).collect(),
            kinds: batch.iter().map(Event::type_name).collect(),
            dids: batch.iter().map(Event::did).collect(),
            keys: batch.iter().map(|e| format!("{:016x}", event_key(e))).collect(),
            json: bodies.iter().map(|b| (!as_text(b)).then_some(*b)).collect(),
            text: bodies.iter().map(|b| as_text(b).then_some(*b)).collect(),
        }
    }
}

async fn insert_events(
    tx: &impl tokio_postgres::GenericClient,
    rows: &Rows<'_>,
    ctx: &BatchCtx,
) -> Result<u64, tokio_postgres::Error> {
    let token = i64::try_from(ctx.token).unwrap_or(i64::MAX);
    tx.execute(
        "INSERT INTO firekeeper_events (relay, seq, token, kind, did, event_key, body, body_text)
         SELECT $1, s, $2, k, d, e, b::jsonb, t
         FROM UNNEST($3::bigint[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[]) AS x(s, k, d, e, b, t)
         ON CONFLICT (relay, seq, event_key) DO NOTHING",
        &[&ctx.fingerprint, &token, &rows.seqs, &rows.kinds, &rows.dids, &rows.keys, &rows.json, &rows.text],
    )
    .await
}

async fn pg_write(
    c: &mut tokio_postgres::Client,
    batch: &[Event],
    ctx: &BatchCtx,
    records: bool,
) -> Result<(), HandlerError> {
    let pg = |e: tokio_postgres::Error| HandlerError::failed("postgres", e);
    let Some(last) = batch.last() else { return Ok(()) };
    let mut tx = c.transaction().await.map_err(pg)?;
    let rendered: Vec<String> = batch
        .iter()
        .filter(|e| e.json().is_none())
        .map(|e| {
            let mut s = String::new();
            e.render_json(&mut s);
            s
        })
        .collect();
    // A body Postgres refuses for its content would fail the batch on every retry: the
    // batch is written again with every body as text (a savepoint keeps the transaction).
    let rows = Rows::new(batch, &rendered, false);
    let sp = tx.savepoint("rows").await.map_err(pg)?;
    match insert_events(&sp, &rows, ctx).await {
        Ok(_) => sp.commit().await.map_err(pg)?,
        Err(e) if content_error(&e) => {
            tracing::warn!(error = %e, events = batch.len(), "postgres refused a body for its content: keeping the batch's bodies as text");
            sp.rollback().await.map_err(pg)?;
            match insert_events(&tx, &Rows::new(batch, &rendered, true), ctx).await {
                Err(e) if content_error(&e) => return Err(HandlerError::refused("postgres", e)),
                r => r.map_err(pg)?,
            };
        }
        Err(e) => return Err(pg(e)),
    }
    if records {
        mirror_commits(&tx, batch, &rows).await.map_err(pg)?;
    }
    let token = i64::try_from(ctx.token).unwrap_or(i64::MAX);
    let breaks: Vec<(usize, &consumer::ChainBreak)> =
        batch.iter().enumerate().filter_map(|(i, e)| Some((i, e.chain_break()?))).collect();
    if !breaks.is_empty() {
        let col = |f: fn(&consumer::ChainBreak) -> &str| breaks.iter().map(|(_, b)| f(b)).collect::<Vec<&str>>();
        let seqs: Vec<i64> = breaks.iter().map(|(i, _)| rows.seqs[*i]).collect();
        let keys: Vec<&str> = breaks.iter().map(|(i, _)| rows.keys[*i].as_str()).collect();
        tx.execute(
            "INSERT INTO firekeeper_chain_breaks (relay, seq, token, did, last_rev, since, rev, event_key)
             SELECT $1, s, $2, d, l, p, r, e
             FROM UNNEST($3::bigint[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[]) AS t(s, d, l, p, r, e)
             ON CONFLICT (relay, seq, event_key) DO NOTHING",
            &[
                &ctx.fingerprint,
                &token,
                &seqs,
                &col(|b| &b.repo),
                &col(|b| &b.last_rev),
                &col(|b| &b.since),
                &col(|b| &b.rev),
                &keys,
            ],
        )
        .await
        .map_err(pg)?;
    }
    // The cursor carries the relay time of the event at it, as the consumer's own commits
    // do, so a relay switch or a successor resumes by time.
    let time = last.time().and_then(atproto_data::time::time_ms);
    let holder = ctx.term.holder();
    let fence = checkpoint::Fence { holder: &holder, token: ctx.token };
    // While the lane holds a repo's events back behind its snapshot, this batch does not
    // hold every event before its last seq: fenced, but the cursor stays.
    let written = if ctx.cursor_hold.is_held() {
        PostgresStore::fence_in(&tx, fence).await
    } else {
        PostgresStore::write_in(&tx, checkpoint::Write::advance(&ctx.fingerprint, last.seq(), time), fence).await
    };
    match written {
        Ok(CommitOutcome::Fenced { .. }) => {
            let _ = tx.rollback().await;
            Err(HandlerError::Fenced)
        }
        Ok(_) => match ctx.ensure_active() {
            Ok(()) => tx.commit().await.map_err(pg),
            // The transaction may have waited on a lock past the term's deadline.
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        },
        Err(e) => Err(HandlerError::failed("postgres cursor", e)),
    }
}

/// One record's row for the mirror: collection, rkey, cid, rev, body.
type RecordRow = (String, String, String, String, String);

/// Applies the batch's commits to `firekeeper_records`: the last op of each record in the
/// batch wins (a create then a delete of it leaves no row).
async fn mirror_commits(
    tx: &impl tokio_postgres::GenericClient,
    batch: &[Event],
    rows: &Rows<'_>,
) -> Result<(), tokio_postgres::Error> {
    use std::collections::HashMap;
    let mut last: HashMap<(String, String), Option<RecordRow>> = HashMap::new();
    for (i, e) in batch.iter().enumerate() {
        if e.invalid().is_some() {
            continue;
        }
        let jet = match e.message() {
            Message::Commit(_) => None,
            Message::Jet(j) => match j.commit {
                Some(op) => Some((j.did, op)),
                None => continue,
            },
            _ => continue,
        };
        let Some(body) = rows.json[i].or(rows.text[i]) else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else { continue };
        if let Some((did, op)) = jet {
            // One op of a Jetstream commit: its record is in the event (v1 under `commit`).
            let record = if v["commit"].is_object() { &v["commit"]["record"] } else { &v["record"] };
            let row = match op.action {
                atproto_data::frame::Action::Delete => None,
                _ => Some((
                    op.collection.to_owned(),
                    op.rkey.to_owned(),
                    op.cid.unwrap_or_default().to_owned(),
                    op.rev.to_owned(),
                    record.to_string(),
                )),
            };
            last.insert((did.to_owned(), format!("{}/{}", op.collection, op.rkey)), row);
            continue;
        }
        let (Some(repo), Some(rev)) = (v["repo"].as_str(), v["rev"].as_str()) else { continue };
        for op in v["ops"].as_array().into_iter().flatten() {
            let Some((collection, rkey)) = op["path"].as_str().and_then(|p| p.split_once('/')) else { continue };
            let key = (repo.to_owned(), format!("{collection}/{rkey}"));
            let row = match op["action"].as_str() {
                Some("create" | "update") => {
                    let cid = op["cid"].as_str().unwrap_or_default().to_owned();
                    Some((collection.to_owned(), rkey.to_owned(), cid, rev.to_owned(), op["record"].to_string()))
                }
                Some("delete") => None,
                _ => continue,
            };
            last.insert(key, row);
        }
    }
    if last.is_empty() {
        return Ok(());
    }
    let (mut dids, mut cols, mut rkeys, mut cids, mut revs, mut json, mut text) =
        (vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
    let (mut del_dids, mut del_cols, mut del_rkeys) = (vec![], vec![], vec![]);
    for ((did, path), row) in last {
        if let Some((c, r, cid, rev, body)) = row {
            dids.push(did);
            cols.push(c);
            rkeys.push(r);
            cids.push(cid);
            revs.push(rev);
            let as_text = body.contains("\\u0000");
            json.push((!as_text).then(|| body.clone()));
            text.push(as_text.then_some(body));
        } else {
            let (c, r) = path.split_once('/').unwrap_or((&path, ""));
            del_cols.push(c.to_owned());
            del_rkeys.push(r.to_owned());
            del_dids.push(did);
        }
    }
    upsert_records(tx, &dids, &cols, &rkeys, &cids, &revs, &json, &text).await?;
    if !del_dids.is_empty() {
        tx.execute(
            "DELETE FROM firekeeper_records r USING UNNEST($1::text[], $2::text[], $3::text[]) AS x(d, c, k)
             WHERE r.did = x.d AND r.collection = x.c AND r.rkey = x.k",
            &[&del_dids, &del_cols, &del_rkeys],
        )
        .await?;
    }
    Ok(())
}

/// Upserts records into the mirror.
#[allow(clippy::too_many_arguments)]
async fn upsert_records(
    tx: &impl tokio_postgres::GenericClient,
    dids: &[String],
    cols: &[String],
    rkeys: &[String],
    cids: &[String],
    revs: &[String],
    json: &[Option<String>],
    text: &[Option<String>],
) -> Result<u64, tokio_postgres::Error> {
    if dids.is_empty() {
        return Ok(0);
    }
    tx.execute(
        "INSERT INTO firekeeper_records (did, collection, rkey, cid, rev, record, record_text)
         SELECT d, c, k, i, r, j::jsonb, t
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) AS x(d, c, k, i, r, j, t)
         ON CONFLICT (did, collection, rkey) DO UPDATE SET cid = EXCLUDED.cid, rev = EXCLUDED.rev,
             record = EXCLUDED.record, record_text = EXCLUDED.record_text, updated_at = now()",
        &[&dids, &cols, &rkeys, &cids, &revs, &json, &text],
    )
    .await
}

/// A part of a snapshot in one fenced transaction: its events (seq NULL) and, with the
/// mirror, its records upserted (the first part deletes the repo's rows first). A repo of
/// more than one part is replaced over several transactions: until its last part lands
/// the mirror holds part of it, and the repo stays queued (a crash fetches it again).
async fn pg_snapshot(
    c: &mut tokio_postgres::Client,
    s: &Snapshot,
    ctx: &BatchCtx,
    records: bool,
) -> Result<(), HandlerError> {
    let pg = |e: tokio_postgres::Error| HandlerError::failed("postgres", e);
    let tx = c.transaction().await.map_err(pg)?;
    let holder = ctx.term.holder();
    let fence = checkpoint::Fence { holder: &holder, token: ctx.token };
    match PostgresStore::fence_in(&tx, fence).await {
        Ok(CommitOutcome::Fenced { .. }) => {
            let _ = tx.rollback().await;
            return Err(HandlerError::Fenced);
        }
        Ok(_) => {}
        Err(e) => return Err(HandlerError::failed("postgres fence", e)),
    }
    let n = s.events();
    let bodies: Vec<String> = (0..n)
        .map(|i| {
            let mut b = String::new();
            s.write_event_json(i, &mut b);
            b
        })
        .collect();
    let as_text = |b: &str| b.contains("\\u0000");
    let kinds: Vec<&str> = (0..n).map(|i| s.event_kind(i)).collect();
    let dids: Vec<&str> = vec![s.did(); n];
    let keys: Vec<String> = (0..n).map(|i| format!("resync:{}:{}", s.rev(), s.first_event() + i as u64)).collect();
    let json: Vec<Option<&str>> = bodies.iter().map(|b| (!as_text(b)).then_some(b.as_str())).collect();
    let text: Vec<Option<&str>> = bodies.iter().map(|b| as_text(b).then_some(b.as_str())).collect();
    let token = i64::try_from(ctx.token).unwrap_or(i64::MAX);
    tx.execute(
        "INSERT INTO firekeeper_events (relay, seq, token, kind, did, event_key, body, body_text)
         SELECT $1, NULL, $2, k, d, e, b::jsonb, t
         FROM UNNEST($3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) WITH ORDINALITY AS x(k, d, e, b, t, n)
         ORDER BY n",
        &[&ctx.fingerprint, &token, &kinds, &dids, &keys, &json, &text],
    )
    .await
    .map_err(pg)?;
    if records {
        if s.is_first() {
            tx.execute("DELETE FROM firekeeper_records WHERE did = $1", &[&s.did()]).await.map_err(pg)?;
        }
        let recs = s.records();
        let col = |f: fn(&consumer::resync::RepoRecord) -> &str| {
            recs.iter().map(|r| f(r).to_owned()).collect::<Vec<String>>()
        };
        let dids: Vec<String> = vec![s.did().to_owned(); recs.len()];
        let at_rev: Vec<String> = vec![s.rev().to_owned(); recs.len()];
        let json: Vec<Option<String>> = recs.iter().map(|r| (!as_text(&r.json)).then(|| r.json.clone())).collect();
        let text: Vec<Option<String>> = recs.iter().map(|r| as_text(&r.json).then(|| r.json.clone())).collect();
        upsert_records(&tx, &dids, &col(|r| &r.collection), &col(|r| &r.rkey), &col(|r| &r.cid), &at_rev, &json, &text)
            .await
            .map_err(pg)?;
    }
    ctx.ensure_active()?;
    tx.commit().await.map_err(pg)
}

/// Discards every batch (benchmarks, and trying the consumer out).
pub struct Null;

#[async_trait]
impl Handler for Null {
    async fn handle(&self, _batch: &[Event], _ctx: &BatchCtx) -> Result<(), HandlerError> {
        Ok(())
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn takes_snapshots(&self) -> bool {
        true
    }

    async fn snapshot(&self, _s: &Snapshot, _ctx: &BatchCtx) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
