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
        if !ctx.term.is_active() {
            return Err(SinkError::Cancelled);
        }
        match self {
            Self::Null => Ok(()),
            Self::Jsonl(w) => {
                let mut buf = String::with_capacity(batch.iter().map(|e| e.body.len() + 64).sum());
                for e in batch {
                    line(e, ctx, &mut buf);
                }
                let mut w = w.lock().await;
                // Waiting for the lock may have outlasted the term (another lane was
                // writing, or the process was frozen): check again, right before writing.
                if !ctx.term.is_active() {
                    return Err(SinkError::Cancelled);
                }
                w.write_all(buf.as_bytes()).await.map_err(|e| SinkError::Failed(format!("jsonl write: {e}")))?;
                w.flush().await.map_err(|e| SinkError::Failed(format!("jsonl flush: {e}")))
            }
            Self::Webhook { client, url } => {
                let mut body = String::new();
                for e in batch {
                    line(e, ctx, &mut body);
                }
                if !ctx.term.is_active() {
                    return Err(SinkError::Cancelled);
                }
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
        // The transaction may have waited on a lock past the term's deadline.
        Ok(_) if !ctx.term.is_active() => {
            let _ = tx.rollback().await;
            Err(SinkError::Cancelled)
        }
        Ok(_) => tx.commit().await.map_err(pg),
        Err(e) => Err(SinkError::Failed(e.to_string())),
    }
}
