//! Sinks: where processed events go. Each write is one batch, in seq order for its lane;
//! a batch is done (and may count towards the cursor) only when its write returned Ok.

use std::time::Duration;

use anyhow::{Context, Result};
use checkpoint::{CommitOutcome, PostgresStore};
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, SinkKind};

/// One event ready for a sink.
#[derive(Debug, Clone)]
pub struct Event {
    /// The relay's seq.
    pub seq: u64,
    /// `#commit`, `#identity`, …
    pub kind: &'static str,
    /// The repo, if any.
    pub did: Option<String>,
    /// The event in the atproto JSON data model.
    pub body: String,
}

/// Context of a batch.
#[derive(Debug, Clone)]
pub struct BatchCtx {
    /// The term's fencing token.
    pub token: u64,
    /// `primary` or `secondary`.
    pub relay: &'static str,
    /// The relay fingerprint.
    pub fingerprint: String,
    /// Fires when the term ends: stop retrying.
    pub cancel: CancellationToken,
    /// The term itself: nothing is written once its deadline has passed.
    pub term: lease::Term,
}

impl BatchCtx {
    /// `Err(Cancelled)` once the term's deadline has passed: called right before each
    /// externally visible write, after any wait that may have outlasted the term.
    fn ensure_active(&self) -> Result<(), SinkError> {
        if self.term.is_active() { Ok(()) } else { Err(SinkError::Cancelled) }
    }
}

/// Why a batch was not written.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The store refused our token: the term is over.
    #[error("sink refused the fencing token: a newer term is writing")]
    Fenced,
    /// The term ended while retrying.
    #[error("term ended before the batch was written")]
    Cancelled,
    /// Anything else; retried with backoff.
    #[error("{0}")]
    Failed(String),
}

/// The configured sink.
pub enum Sink {
    /// JSON lines.
    Jsonl(Mutex<BufWriter<Box<dyn AsyncWrite + Unpin + Send>>>),
    /// Postgres rows, cursor in the same transaction.
    Postgres(Mutex<tokio_postgres::Client>),
    /// Batched POST.
    Webhook {
        /// HTTP client with the request timeout.
        client: reqwest::Client,
        /// Target (never logged).
        url: String,
    },
    /// Discards.
    Null,
}

/// A redirect target for a log line: scheme, host and path only (no credentials, no
/// query string, which may carry tokens).
fn redact_location(l: &str) -> String {
    match url::Url::parse(l) {
        Ok(u) => format!("{}://{}{}", u.scheme(), u.host_str().unwrap_or(""), u.path()),
        Err(_) => l.split(['?', '#']).next().unwrap_or("").rsplit('@').next().unwrap_or("").to_owned(),
    }
}

/// The JSON line of an event: `{"seq","relay","token","event"}`.
pub fn line(e: &Event, ctx: &BatchCtx, out: &mut String) {
    use std::fmt::Write as _;
    let _ = write!(out, "{{\"seq\":{},\"relay\":\"{}\",\"token\":{},\"event\":", e.seq, ctx.relay, ctx.token);
    out.push_str(&e.body);
    out.push_str("}\n");
}

impl Sink {
    /// Opens the sink for `cfg`.
    pub async fn open(cfg: &Config) -> Result<Self> {
        Ok(match &cfg.sink {
            SinkKind::Jsonl(path) if path == "-" => {
                Self::Jsonl(Mutex::new(BufWriter::new(Box::new(tokio::io::stdout()))))
            }
            SinkKind::Jsonl(path) => {
                let f = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .await
                    .with_context(|| format!("opening FIREKEEPER_JSONL_PATH {path}"))?;
                Self::Jsonl(Mutex::new(BufWriter::new(Box::new(f))))
            }
            SinkKind::Postgres => {
                let url = cfg.database_url.as_deref().context("DATABASE_URL")?;
                let (client, conn) =
                    tokio_postgres::connect(url, tokio_postgres::NoTls).await.context("connecting to DATABASE_URL")?;
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::error!(error = %e, "postgres sink connection ended");
                    }
                });
                client.batch_execute(checkpoint::postgres_store::MIGRATION).await.context("cursor schema")?;
                client
                    .batch_execute(include_str!("../../../migrations/0002_events.sql"))
                    .await
                    .context("events schema")?;
                Self::Postgres(Mutex::new(client))
            }
            SinkKind::Webhook { url, timeout, .. } => Self::Webhook {
                client: reqwest::Client::builder()
                    .timeout(*timeout)
                    .redirect(reqwest::redirect::Policy::none())
                    .build()
                    .context("webhook client")?,
                url: url.clone(),
            },
            SinkKind::Null => Self::Null,
        })
    }

    /// True for sinks that commit the cursor themselves (in their own transaction).
    #[must_use]
    pub fn commits_cursor(&self) -> bool {
        matches!(self, Self::Postgres(_))
    }

    /// Writes one batch, retrying transient failures with backoff until the term ends.
    pub async fn write(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), SinkError> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.try_write(batch, ctx).await {
                Ok(()) => return Ok(()),
                Err(SinkError::Failed(e)) => {
                    metrics::counter!("firekeeper_sink_errors_total").increment(1);
                    tracing::warn!(error = %e, retry_ms = delay.as_millis() as u64, events = batch.len(), "sink write failed; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = ctx.cancel.cancelled() => return Err(SinkError::Cancelled),
                    }
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn try_write(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), SinkError> {
        // Each sink checks the term's deadline right before its externally visible
        // action (after any wait for a lock, before a request or a COMMIT), so a process
        // that froze or waited past its deadline writes nothing.
        match self {
            Self::Null => Ok(()),
            Self::Jsonl(w) => {
                let mut buf = String::with_capacity(batch.iter().map(|e| e.body.len() + 64).sum());
                for e in batch {
                    line(e, ctx, &mut buf);
                }
                let mut w = w.lock().await;
                // Waiting for the lock may have outlasted the term (another lane was
                // writing, or the process was frozen).
                ctx.ensure_active()?;
                w.write_all(buf.as_bytes()).await.map_err(|e| SinkError::Failed(format!("jsonl write: {e}")))?;
                w.flush().await.map_err(|e| SinkError::Failed(format!("jsonl flush: {e}")))
            }
            Self::Webhook { client, url } => {
                let mut body = String::new();
                for e in batch {
                    line(e, ctx, &mut body);
                }
                ctx.ensure_active()?;
                let resp = client
                    .post(url)
                    .header("content-type", "application/x-ndjson")
                    .header("x-firekeeper-token", ctx.token)
                    .body(body)
                    .send()
                    .await
                    .map_err(|e| SinkError::Failed(format!("webhook: {}", e.without_url())))?;
                // Redirects are not followed (a 301/302/303 would turn the POST into a
                // body-less GET whose 2xx proves nothing): any non-2xx is a failure.
                let status = resp.status();
                if status.is_success() {
                    Ok(())
                } else if status.is_redirection() {
                    Err(SinkError::Failed(format!(
                        "webhook answered HTTP {} (redirect to {:?}); redirects are not followed: point \
                         FIREKEEPER_WEBHOOK_URL at the final address",
                        status.as_u16(),
                        resp.headers().get("location").and_then(|l| l.to_str().ok()).map(redact_location)
                    )))
                } else {
                    Err(SinkError::Failed(format!("webhook answered HTTP {}", status.as_u16())))
                }
            }
            Self::Postgres(client) => {
                let mut c = client.lock().await;
                pg_write(&mut c, batch, ctx).await
            }
        }
    }
}

async fn pg_write(c: &mut tokio_postgres::Client, batch: &[Event], ctx: &BatchCtx) -> Result<(), SinkError> {
    let pg = |e: tokio_postgres::Error| SinkError::Failed(format!("postgres: {e}"));
    let Some(last) = batch.last() else { return Ok(()) };
    let tx = c.transaction().await.map_err(pg)?;
    let seqs: Vec<i64> = batch.iter().map(|e| i64::try_from(e.seq).unwrap_or(i64::MAX)).collect();
    let kinds: Vec<&str> = batch.iter().map(|e| e.kind).collect();
    let dids: Vec<Option<&str>> = batch.iter().map(|e| e.did.as_deref()).collect();
    let bodies: Vec<&str> = batch.iter().map(|e| e.body.as_str()).collect();
    let token = i64::try_from(ctx.token).unwrap_or(i64::MAX);
    tx.execute(
        "INSERT INTO firekeeper_events (relay, seq, token, kind, did, body)
         SELECT $1, s, $2, k, d, b::jsonb FROM UNNEST($3::bigint[], $4::text[], $5::text[], $6::text[]) AS t(s, k, d, b)
         ON CONFLICT (relay, seq) DO NOTHING",
        &[&ctx.fingerprint, &token, &seqs, &kinds, &dids, &bodies],
    )
    .await
    .map_err(pg)?;
    match PostgresStore::commit_in(&tx, &ctx.fingerprint, last.seq, ctx.token).await {
        Ok(CommitOutcome::Fenced { .. }) => {
            let _ = tx.rollback().await;
            Err(SinkError::Fenced)
        }
        Ok(_) => match ctx.ensure_active() {
            Ok(()) => tx.commit().await.map_err(pg),
            // The transaction may have waited on a lock past the term's deadline.
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        },
        Err(e) => Err(SinkError::Failed(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use lease::{LeaseConfig, LeaseEvent, LocalBackend, OffsetClock};

    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("fk-sink-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("tmp");
        d
    }

    async fn term_with(clock: Arc<OffsetClock>, dir: &std::path::Path) -> (lease::LeaseHandle, BatchCtx) {
        let backend = Arc::new(LocalBackend::new(&dir.join("lease.lock")));
        let (h, mut ev) =
            lease::spawn_as(backend, LeaseConfig::from_ttl(Duration::from_secs(10)), clock, "t").expect("cfg");
        let Some(LeaseEvent::Elected(term)) = ev.recv().await else { panic!("not elected") };
        let ctx = BatchCtx {
            token: term.token(),
            relay: "primary",
            fingerprint: "fp".into(),
            cancel: term.cancellation(),
            term,
        };
        (h, ctx)
    }

    fn event(seq: u64) -> Event {
        Event { seq, kind: "#commit", did: None, body: "{}".into() }
    }

    async fn jsonl(path: &std::path::Path) -> Sink {
        let f = tokio::fs::File::create(path).await.expect("create");
        Sink::Jsonl(Mutex::new(BufWriter::new(Box::new(f))))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_waited_for_the_jsonl_lock_past_the_deadline_writes_nothing() {
        let dir = tmp("lock");
        let clock = Arc::new(OffsetClock::default());
        let (h, ctx) = term_with(clock.clone(), &dir).await;
        let out = dir.join("out.jsonl");
        let sink = Arc::new(jsonl(&out).await);
        // Another lane holds the file lock.
        let Sink::Jsonl(m) = &*sink else { unreachable!() };
        let guard = m.lock().await;
        let (s, c) = (sink.clone(), ctx.clone());
        let write = tokio::spawn(async move { s.try_write(&[event(1), event(2)], &c).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!write.is_finished(), "the write passed its first check and waits for the lock");
        // The deadline passes while it waits (the supervisor has not run yet).
        clock.advance(Duration::from_secs(3600));
        assert!(!ctx.term.is_active());
        drop(guard);
        let r = write.await.expect("join");
        assert!(matches!(r, Err(SinkError::Cancelled)), "{r:?}");
        assert_eq!(std::fs::read(&out).expect("read").len(), 0, "nothing written after the deadline");
        h.abandon().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_webhook_request_is_sent_after_the_deadline() {
        let dir = tmp("hook");
        let clock = Arc::new(OffsetClock::default());
        let (h, ctx) = term_with(clock.clone(), &dir).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/", listener.local_addr().expect("addr"));
        let accepted = Arc::new(AtomicU64::new(0));
        let a = accepted.clone();
        tokio::spawn(async move {
            while let Ok((_s, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
            }
        });
        let _ = rustls::crypto::ring::default_provider().install_default();
        let sink = Sink::Webhook { client: reqwest::Client::new(), url };
        clock.advance(Duration::from_secs(3600));
        assert!(matches!(sink.try_write(&[event(1)], &ctx).await, Err(SinkError::Cancelled)));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 0, "no request was sent");
        h.abandon().await;
    }

    /// The review's locked table: the batch's INSERT waits on a lock past the deadline;
    /// the store's fence alone would accept it (no newer term claimed yet).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_postgres_batch_that_waited_on_a_lock_past_the_deadline_is_rolled_back() {
        let pg = testkit::PgServer::start();
        let dir = tmp("pg");
        let clock = Arc::new(OffsetClock::default());
        let (h, ctx) = term_with(clock.clone(), &dir).await;
        let (client, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("pg");
        tokio::spawn(conn);
        client.batch_execute(checkpoint::postgres_store::MIGRATION).await.expect("schema");
        client.batch_execute(include_str!("../../../migrations/0002_events.sql")).await.expect("schema");
        let sink = Arc::new(Sink::Postgres(Mutex::new(client)));
        let (mut locker, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await.expect("pg");
        tokio::spawn(conn);
        let tx = locker.transaction().await.expect("tx");
        tx.batch_execute("LOCK TABLE firekeeper_events IN ACCESS EXCLUSIVE MODE").await.expect("lock");
        let (s, c) = (sink.clone(), ctx.clone());
        let write = tokio::spawn(async move { s.try_write(&[event(1), event(2)], &c).await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!write.is_finished(), "the INSERT waits for the lock");
        clock.advance(Duration::from_secs(3600));
        tx.rollback().await.expect("unlock");
        let r = write.await.expect("join");
        assert!(matches!(r, Err(SinkError::Cancelled)), "{r:?}");
        let Sink::Postgres(c) = &*sink else { unreachable!() };
        let c = c.lock().await;
        let n: i64 = c.query_one("SELECT count(*) FROM firekeeper_events", &[]).await.expect("count").get(0);
        let cursors: i64 = c.query_one("SELECT count(*) FROM firekeeper_cursors", &[]).await.expect("count").get(0);
        assert_eq!((n, cursors), (0, 0), "neither rows nor cursor landed");
        h.abandon().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_sink_write_starts_after_the_deadline() {
        let dir = tmp("start");
        let clock = Arc::new(OffsetClock::default());
        let (h, ctx) = term_with(clock.clone(), &dir).await;
        let out = dir.join("out.jsonl");
        let sink = jsonl(&out).await;
        sink.try_write(&[event(1)], &ctx).await.expect("written while active");
        let written = std::fs::read(&out).expect("read").len();
        assert!(written > 0);
        clock.advance(Duration::from_secs(3600));
        assert!(matches!(sink.try_write(&[event(2)], &ctx).await, Err(SinkError::Cancelled)));
        assert_eq!(std::fs::read(&out).expect("read").len(), written);
        h.abandon().await;
    }
}
