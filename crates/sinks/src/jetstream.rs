//! The JetStream sink: every event published to a stream, exactly once across leader
//! failover.
//!
//! Each message carries `Nats-Msg-Id: <relay fingerprint>:<seq>:<event key>`, so a new
//! leader that hands the same events over again (everything after the last committed
//! cursor) is de-duplicated by the server within the stream's duplicate window; a batch
//! counts as written only when every publish was acknowledged, so the cursor never passes
//! an event the stream does not hold.
//!
//! **The seq alone does not name an event.** A relay that restarts its numbering (or
//! loses its data) serves new events under seqs already used; with `<fingerprint>:<seq>`
//! the server acknowledged them as duplicates and dropped them while the cursor moved on.
//! The event key (FNV-1a, 64 bits, of the repo and rev of a `#commit`/`#sync`, or the
//! DID and time of an `#identity`/`#account`, else of the frame) tells a replay of the
//! same event (same key: dropped) from another event that reuses the seq (another key:
//! stored). It needs no state, so it cannot be lost, and holds for renumberings the
//! consumer never notices (a relay that lost data and grew past the cursor again).
//!
//! Subjects, under `<prefix>.events.`:
//! - by default, per collection for commits (`app.bsky.feed.post`, taken from the first
//!   op), and per type otherwise (`commit` for a commit without ops, `identity`,
//!   `account`, `sync`, `chain-break`);
//! - with `partitions = N > 0`, `p<i>` where `i` is a hash of the repo's DID modulo N, so
//!   consumer groups can split the work with every repo's events in one partition, in order.
//!
//! The body is the event in the atproto JSON data model; headers `Firekeeper-Seq`,
//! `Firekeeper-Relay` (`primary`/`secondary`) and `Firekeeper-Token` (the term's fencing
//! token) say where it came from.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use atproto_data::Message;
use bytes::Bytes;
use consumer::{BatchCtx, Event, Handler, HandlerError, Snapshot};
use nats_op::async_nats::jetstream::context::PublishAckFuture;
use nats_op::async_nats::jetstream::{self, stream};
use nats_op::async_nats::{HeaderMap, header};
use nats_op::{Nats, NatsError};

use crate::event_key;
use atproto_data::hash::did_hash;

/// The client-side bound on unacknowledged publishes: none to speak of (the lanes bound
/// them with `max_pending`).
const UNBOUNDED_ACKS: usize = 1 << 24;

/// Where and how the sink publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JetStreamConfig {
    /// The stream's name (created if missing).
    pub stream: String,
    /// Subjects are `<prefix>.events.…`.
    pub subject_prefix: String,
    /// DID-hash partitions; 0 = subjects by collection and type.
    pub partitions: u32,
    /// How long the stream keeps messages (0 = forever).
    pub max_age: Duration,
    /// How long the server remembers message ids to drop duplicates: a new leader must
    /// republish within it (a failover takes about a lease ttl).
    pub duplicate_window: Duration,
    /// Bound on publishing one batch, acknowledgements included.
    pub publish_timeout: Duration,
    /// Publishes a lane keeps in flight (sent, not yet acknowledged) across batches.
    pub max_pending: usize,
}

impl Default for JetStreamConfig {
    fn default() -> Self {
        Self {
            stream: "FIREKEEPER".into(),
            subject_prefix: "firekeeper".into(),
            partitions: 0,
            max_age: Duration::from_hours(7 * 24),
            duplicate_window: Duration::from_mins(2),
            publish_timeout: Duration::from_secs(5),
            max_pending: 1024,
        }
    }
}

/// Publishes every event to a JetStream stream.
pub struct JetStream {
    nats: Nats,
    /// Publishes go through a context of their own whose in-flight acknowledgements are
    /// not bounded by the client: the lanes bound them (`max_pending` each). With the
    /// client's default bound (5,000) lanes writing ahead could hold every permit in
    /// acknowledgements they will only read after their next publish, which waits for a
    /// permit: every lane stalled until `publish_timeout`.
    publisher: jetstream::Context,
    cfg: JetStreamConfig,
    /// The stream's settings, to create it again if it is deleted under the sink.
    stream: stream::Config,
}

/// Why a batch did not land.
enum Failure {
    /// No stream holds the subjects.
    Missing,
    /// Anything else (retried as it is).
    Handler(HandlerError),
}

/// True for a subject token made of what NSIDs allow (so a record path can never
/// smuggle a wildcard, a space or an empty token into a subject).
fn subject_safe(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|t| !t.is_empty())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
}

/// FNV-1a, continued from `h`.
/// Creates the stream with `config` unless it exists.
async fn create_stream(nats: &Nats, config: &stream::Config) -> Result<stream::Stream, NatsError> {
    let js = nats.jetstream().clone();
    nats.bounded_for("create stream", Duration::from_secs(10), js.get_or_create_stream(config.clone())).await
}

/// After a publish found no stream (deleted under the sink, or a server that lost its
/// store): creates it again, so the retried batch lands. What the old stream held is gone
/// with it; nothing after the committed cursor is lost (the batch is retried and the
/// cursor never passed it).
async fn recreate(nats: &Nats, config: &stream::Config) {
    match create_stream(nats, config).await {
        Ok(_) => {
            tracing::error!(stream = %config.name, "the stream was missing: created it again; what it held before is gone");
        }
        Err(e) => {
            tracing::warn!(stream = %config.name, error = %e, "the stream is missing and could not be created");
        }
    }
}

/// A publish's failure: the stream is missing, the event is larger than the server takes
/// (`max_payload`, 1 MiB by default: refused for its content, so the lane isolates it
/// instead of retrying for ever), or anything else (retried as it is).
fn publish_failure(what: &str, err: jetstream::context::PublishError) -> Failure {
    use jetstream::context::PublishErrorKind;
    if err.kind() == PublishErrorKind::StreamNotFound {
        Failure::Missing
    } else if err.kind() == PublishErrorKind::MaxPayloadExceeded {
        Failure::Handler(HandlerError::refused(
            format!("jetstream {what} (raise the server's max_payload to store events this large)"),
            err,
        ))
    } else {
        Failure::Handler(HandlerError::failed(format!("jetstream {what}"), err))
    }
}

/// What a failure means to the lane; a missing stream is created again first.
async fn settle(nats: &Nats, config: &stream::Config, f: Failure) -> HandlerError {
    match f {
        Failure::Handler(e) => e,
        Failure::Missing => {
            recreate(nats, config).await;
            HandlerError::failed("jetstream", format!("stream {} was missing; created again, retrying", config.name))
        }
    }
}

/// The `Nats-Msg-Id` of an event: `<fingerprint>:<seq>:<event key>` (the key as 16 hex
/// digits). The form must never change: a new leader's replay is dropped as a duplicate
/// only if it names each event exactly as the old leader did.
#[must_use]
pub fn message_id(fingerprint: &str, e: &Event) -> String {
    let mut id = String::with_capacity(fingerprint.len() + 40);
    id.push_str(fingerprint);
    let _ = write!(id, ":{}:{:016x}", e.seq(), event_key(e));
    id
}

/// A rendering shared with the event, as a publish's body without a copy.
struct SharedJson(Arc<str>);

impl AsRef<[u8]> for SharedJson {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl JetStream {
    /// Creates the stream if it is missing (subjects `<prefix>.events.>`, file storage,
    /// limits retention) and returns the sink.
    pub async fn open(nats: &Nats, cfg: JetStreamConfig) -> Result<Self, NatsError> {
        let window = if cfg.max_age.is_zero() { cfg.duplicate_window } else { cfg.duplicate_window.min(cfg.max_age) };
        let config = stream::Config {
            name: cfg.stream.clone(),
            subjects: vec![format!("{}.events.>", cfg.subject_prefix)],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            max_age: cfg.max_age,
            duplicate_window: window,
            ..stream::Config::default()
        };
        let s = create_stream(nats, &config).await?;
        let info = s.cached_info();
        if info.config.duplicate_window < window {
            tracing::warn!(
                stream = %cfg.stream,
                configured = ?info.config.duplicate_window,
                "the existing stream's duplicate window is shorter than FIREKEEPER_NATS_DUPLICATE_WINDOW_MS: events republished after a slower failover may be stored twice"
            );
        }
        let publisher = jetstream::context::ContextBuilder::new()
            .max_ack_inflight(UNBOUNDED_ACKS)
            .ack_timeout(cfg.publish_timeout)
            .build(nats.client().clone());
        Ok(Self { nats: nats.clone(), publisher, cfg, stream: config })
    }

    /// The subject of an event.
    #[must_use]
    pub fn subject(&self, e: &Event) -> String {
        let base = format!("{}.events.", self.cfg.subject_prefix);
        if self.cfg.partitions > 0 {
            let p = e.did().map_or(0, |d| did_hash(d) % u64::from(self.cfg.partitions));
            return format!("{base}p{p}");
        }
        if e.invalid().is_some() {
            return format!("{base}invalid");
        }
        let tail = match e.message() {
            Message::Commit(c) => c
                .ops
                .first()
                .map(atproto_data::frame::RepoOp::collection)
                .filter(|c| subject_safe(c))
                .unwrap_or("commit"),
            Message::Jet(j) => j.commit.map(|op| op.collection).filter(|c| subject_safe(c)).unwrap_or("commit"),
            m => m.kind().as_str().trim_start_matches('#'),
        };
        format!("{base}{tail}")
    }

    fn chain_break_subject(&self, e: &Event) -> String {
        if self.cfg.partitions > 0 {
            self.subject(e)
        } else {
            format!("{}.events.chain-break", self.cfg.subject_prefix)
        }
    }

    fn headers(id: &str, e: &Event, ctx: &BatchCtx) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::NATS_MESSAGE_ID, id);
        h.insert("Firekeeper-Seq", e.seq().to_string().as_str());
        h.insert("Firekeeper-Relay", ctx.relay.as_str());
        h.insert("Firekeeper-Token", ctx.token.to_string().as_str());
        h
    }

    /// Sends every event of the batch, in order, and returns their acknowledgements to
    /// come.
    async fn send(&self, batch: &[Event], ctx: &BatchCtx) -> Result<Vec<PublishAckFuture>, Failure> {
        let js = &self.publisher;
        let mut acks = Vec::with_capacity(batch.len());
        for e in batch {
            // Right before each publish: a publish may have waited (backpressure) past
            // the term's deadline.
            ctx.ensure_active().map_err(Failure::Handler)?;
            if let Some(b) = e.chain_break() {
                let mut body = String::new();
                b.write_json(e.seq(), &mut body);
                let id = format!("{}:chain-break", message_id(&ctx.fingerprint, e));
                let ack = js
                    .publish_with_headers(self.chain_break_subject(e), Self::headers(&id, e, ctx), body.into())
                    .await
                    .map_err(|err| publish_failure("publish", err))?;
                acks.push(ack);
            }
            let body = if let Some(j) = e.json_shared() {
                Bytes::from_owner(SharedJson(Arc::clone(j)))
            } else {
                let mut s = String::new();
                e.render_json(&mut s);
                Bytes::from(s)
            };
            let id = message_id(&ctx.fingerprint, e);
            let ack = js
                .publish_with_headers(self.subject(e), Self::headers(&id, e, ctx), body)
                .await
                .map_err(|err| publish_failure("publish", err))?;
            acks.push(ack);
        }
        Ok(acks)
    }
}

/// Waits for every acknowledgement of a batch, in order.
async fn acknowledged(acks: Vec<PublishAckFuture>) -> Result<(), Failure> {
    for a in acks {
        a.await.map_err(|err| publish_failure("acknowledgement", err))?;
    }
    Ok(())
}

#[async_trait]
impl Handler for JetStream {
    async fn handle(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), HandlerError> {
        self.submit(batch, ctx).await?.await
    }

    /// Sends the batch and returns at once; the [`consumer::Pending`] resolves when the
    /// server has acknowledged every publish (within `publish_timeout` of the send), so
    /// the lane keeps up to `max_pending` publishes in flight across batches. A failed or
    /// late acknowledgement fails the batch: the lane publishes it again with the same
    /// `Nats-Msg-Id`s (what the stream holds already is dropped as a duplicate), and the
    /// cursor waits.
    async fn submit(&self, batch: &[Event], ctx: &BatchCtx) -> Result<consumer::Pending, HandlerError> {
        let timeout = self.cfg.publish_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        let acks = match tokio::time::timeout_at(deadline, self.send(batch, ctx)).await {
            Ok(Ok(acks)) => acks,
            Ok(Err(f)) => return Err(settle(&self.nats, &self.stream, f).await),
            Err(_) => {
                return Err(HandlerError::failed(
                    "jetstream",
                    format!("batch of {} not sent within {timeout:?}", batch.len()),
                ));
            }
        };
        let (nats, config, n) = (self.nats.clone(), self.stream.clone(), acks.len());
        Ok(Box::pin(async move {
            match tokio::time::timeout_at(deadline, acknowledged(acks)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(f)) => Err(settle(&nats, &config, f).await),
                Err(_) => {
                    Err(HandlerError::failed("jetstream", format!("{n} publishes not acknowledged within {timeout:?}")))
                }
            }
        }))
    }

    fn write_ahead(&self) -> usize {
        self.cfg.max_pending
    }

    fn wants_json(&self) -> bool {
        true
    }

    /// Publishes stay in flight across batches (`max_pending`), so the batch size only
    /// sets how often the lane looks up from its queue.
    fn max_batch(&self) -> usize {
        1024
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn takes_snapshots(&self) -> bool {
        true
    }

    /// The snapshot's events on `<prefix>.events.resync` (or the repo's partition), in
    /// order, with ids `<fingerprint>:resync:<did>:<rev>:<n>` (a repeated snapshot of the
    /// same rev within the duplicate window is stored once); done when every publish is
    /// acknowledged.
    async fn snapshot(&self, s: &Snapshot, ctx: &BatchCtx) -> Result<(), HandlerError> {
        let subject = if self.cfg.partitions > 0 {
            format!("{}.events.p{}", self.cfg.subject_prefix, did_hash(s.did()) % u64::from(self.cfg.partitions))
        } else {
            format!("{}.events.resync", self.cfg.subject_prefix)
        };
        let timeout = self.cfg.publish_timeout;
        let mut acks = Vec::new();
        for i in 0..s.events() {
            ctx.ensure_active()?;
            let mut body = String::new();
            s.write_event_json(i, &mut body);
            let id = format!("{}:resync:{}:{}:{}", ctx.fingerprint, s.did(), s.rev(), s.first_event() + i as u64);
            let mut h = HeaderMap::new();
            h.insert(header::NATS_MESSAGE_ID, id.as_str());
            h.insert("Firekeeper-Relay", ctx.relay.as_str());
            h.insert("Firekeeper-Token", ctx.token.to_string().as_str());
            let publish = self.publisher.publish_with_headers(subject.clone(), h, body.into());
            let ack = match tokio::time::timeout(timeout, publish).await {
                Ok(Ok(ack)) => ack,
                Ok(Err(err)) => return Err(settle(&self.nats, &self.stream, publish_failure("publish", err)).await),
                Err(_) => {
                    return Err(HandlerError::failed("jetstream", format!("a publish not sent within {timeout:?}")));
                }
            };
            acks.push(ack);
            if acks.len() >= self.cfg.max_pending.max(1) {
                self.snapshot_acked(std::mem::take(&mut acks)).await?;
            }
        }
        self.snapshot_acked(acks).await
    }
}

impl JetStream {
    /// Waits for a snapshot's acknowledgements.
    async fn snapshot_acked(&self, acks: Vec<PublishAckFuture>) -> Result<(), HandlerError> {
        let timeout = self.cfg.publish_timeout;
        match tokio::time::timeout(timeout, acknowledged(acks)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(f)) => Err(settle(&self.nats, &self.stream, f).await),
            Err(_) => Err(HandlerError::failed(
                "jetstream",
                format!("snapshot publishes not acknowledged within {timeout:?}"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_keep_the_form_earlier_versions_wrote() {
        let frames = relay_sim::capture::read(&testkit::fixture("pds-capture.frames")).expect("fixture");
        let mut seen = 0;
        for f in &frames {
            let Some(e) = Event::from_bytes(f, consumer::RelayRole::Primary).expect("decodes") else { continue };
            let earlier = format!("fp1:{}:{:016x}", e.seq(), event_key(&e));
            assert_eq!(message_id("fp1", &e), earlier);
            seen += 1;
        }
        assert!(seen > 1000, "{seen} events");
    }

    #[test]
    fn only_nsid_characters_make_a_subject_token() {
        for ok in ["app.bsky.feed.post", "com.example.x-y"] {
            assert!(subject_safe(ok), "{ok}");
        }
        for bad in ["", "app..post", "app.*", "app.>", "a b", ".app", "app.", "app/x"] {
            assert!(!subject_safe(bad), "{bad}");
        }
    }
}
