//! What the consumer hands out: typed events in batches, to a [`Handler`] that accepts a
//! batch (the cursor may then move past it) or refuses it.

use std::sync::Arc;

use async_trait::async_trait;
use lease::Term;
use relay_client::json::{FrameOptions, Written, write_message_with};
use relay_client::{Kind, Message, OwnedFrame, RelayRole};
use tokio_util::sync::CancellationToken;

use crate::chain::ChainBreak;
use crate::verify::Invalid;

/// One event: a validated frame, decoded once by the relay client, with its atproto JSON
/// rendering when the handler asked for it.
#[derive(Debug)]
pub struct Event {
    frame: OwnedFrame,
    json: Option<Arc<str>>,
    chain_break: Option<Box<ChainBreak>>,
    invalid: Option<Box<Invalid>>,
    /// Sent to its lane only to be verified (the collection filter drops it).
    pub(crate) hidden: bool,
}

impl Event {
    /// Wraps a frame (for handler tests: see [`Event::from_bytes`]).
    #[must_use]
    pub fn new(frame: OwnedFrame) -> Self {
        Self { frame, json: None, chain_break: None, invalid: None, hidden: false }
    }

    /// Decodes a frame as a relay sent it; `None` for frames that are not events (error
    /// frames, `#info`). For tests of handlers.
    pub fn from_bytes(bytes: &[u8], relay: RelayRole) -> Result<Option<Self>, relay_client::DecodeError> {
        Ok(OwnedFrame::decode_event(bytes.to_vec(), relay)?.map(Self::new))
    }

    /// The relay's sequence number.
    #[must_use]
    pub fn seq(&self) -> u64 {
        self.frame.seq
    }

    /// The relay it came from.
    #[must_use]
    pub fn relay(&self) -> RelayRole {
        self.frame.relay
    }

    /// `#commit`, `#identity`, … (the frame's type, also for an [`Event::invalid`] one).
    #[must_use]
    pub fn kind(&self) -> Kind {
        self.message().kind()
    }

    /// What the event is handed over as: `#invalid` when it failed verification, else its
    /// [`Event::kind`].
    #[must_use]
    pub fn type_name(&self) -> &'static str {
        if self.invalid.is_some() { "#invalid" } else { self.kind().as_str() }
    }

    /// With `FIREKEEPER_VERIFY` on: the event failed verification and must not be taken
    /// as itself (its [`Event::json`] and [`Event::render_json`] are the `#invalid`
    /// event). The cursor passes it under the `mark` policy.
    #[must_use]
    pub fn invalid(&self) -> Option<&Invalid> {
        self.invalid.as_deref()
    }

    /// The event marked invalid (for tests of handlers).
    #[must_use]
    pub fn with_invalid(mut self, i: Invalid) -> Self {
        self.invalid = Some(Box::new(i));
        self
    }

    pub(crate) fn set_invalid(&mut self, i: Invalid) {
        self.invalid = Some(Box::new(i));
    }

    /// Hands the event over as itself again (after [`Event::set_invalid`]).
    pub(crate) fn clear_invalid(&mut self) {
        self.invalid = None;
    }

    /// The repo the event is about; events of one repo reach the handler in seq order.
    #[must_use]
    pub fn did(&self) -> Option<&str> {
        self.message().did()
    }

    /// When the event was emitted (RFC 3339, as the relay sent it).
    #[must_use]
    pub fn time(&self) -> Option<&str> {
        self.message().time()
    }

    /// The decoded message, borrowing from the frame.
    #[must_use]
    pub fn message(&self) -> &Message<'_> {
        self.frame.message()
    }

    /// The frame exactly as the relay sent it.
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        self.frame.bytes()
    }

    /// The event in the atproto JSON data model (the collection filter applied), when the
    /// handler's [`Handler::wants_json`] is true; else `None` (use [`Event::render_json`]).
    #[must_use]
    pub fn json(&self) -> Option<&str> {
        self.json.as_deref()
    }

    /// [`Event::json`], shared: a sink that must own the body it sends (a publish) takes
    /// a reference to the rendering instead of a copy.
    #[must_use]
    pub fn json_shared(&self) -> Option<&Arc<str>> {
        self.json.as_ref()
    }

    /// Appends the event in the atproto JSON data model, all ops, records included (the
    /// `#invalid` event instead when it failed verification).
    pub fn render_json(&self, out: &mut String) -> Written {
        if let Some(i) = &self.invalid {
            i.write_json(self.seq(), out);
            return Written::default();
        }
        render(self.message(), &Render { verify_blocks: false, filter: None }, out)
    }

    /// With `FIREKEEPER_CHAIN_BREAKS=emit` ([`crate::ChainBreaks::Emit`]): the repo's
    /// commit chain broke just before this commit (the relay skipped at least one of its
    /// commits), so downstream should resync the repo.
    #[must_use]
    pub fn chain_break(&self) -> Option<&ChainBreak> {
        self.chain_break.as_deref()
    }

    /// The event with a chain break attached (for tests of handlers).
    #[must_use]
    pub fn with_chain_break(mut self, b: ChainBreak) -> Self {
        self.set_chain_break(b);
        self
    }

    pub(crate) fn set_chain_break(&mut self, b: ChainBreak) {
        self.chain_break = Some(Box::new(b));
    }

    pub(crate) fn set_json(&mut self, json: Arc<str>) {
        self.json = Some(json);
    }
}

/// A repo fetched whole from its PDS and verified, delivered with fold semantics: a
/// downstream forgets what it holds of the repo on the `#resync` event, then applies each
/// `#record` as a create (deletes are implied). It reaches the handler in the repo's lane,
/// after every event of the repo handed over before it and before every one after it.
///
/// A snapshot reaches [`Handler::snapshot`] a part at a time (at most
/// [`repo_sync::snapshot::PART_RECORDS`] records each), in order, so that a repo of
/// millions of records is never held whole: the first part opens with the `#resync`
/// event ([`Snapshot::is_first`]), the last says so ([`Snapshot::is_last`]). The repo
/// counts as synchronised only once every part was taken; a failure part-way fetches the
/// repo again later, and the new snapshot starts over from its `#resync`.
#[derive(Debug)]
pub struct Snapshot {
    repo: Arc<repo_sync::snapshot::RepoSnapshot>,
    reason: Arc<str>,
    records: Vec<repo_sync::snapshot::RepoRecord>,
    /// The index (among the snapshot's records) of this part's first record.
    first: u64,
    last: bool,
}

impl Snapshot {
    /// Part of the snapshot of `repo`, fetched because of `reason` (`chain`, `signature`,
    /// …): `records` starting at record `first` of the repo; `last` for the final part.
    #[must_use]
    pub fn part(
        repo: Arc<repo_sync::snapshot::RepoSnapshot>,
        reason: Arc<str>,
        records: Vec<repo_sync::snapshot::RepoRecord>,
        first: u64,
        last: bool,
    ) -> Self {
        Self { repo, reason, records, first, last }
    }

    /// The repo's DID.
    #[must_use]
    pub fn did(&self) -> &str {
        &self.repo.did
    }

    /// The commit's rev.
    #[must_use]
    pub fn rev(&self) -> &str {
        &self.repo.rev
    }

    /// Why the repo was fetched.
    #[must_use]
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The verified repo: commit, tree root, how many records the snapshot holds in all
    /// (the collection filter applied).
    #[must_use]
    pub fn repo(&self) -> &repo_sync::snapshot::RepoSnapshot {
        &self.repo
    }

    /// This part's records, in key order.
    #[must_use]
    pub fn records(&self) -> &[repo_sync::snapshot::RepoRecord] {
        &self.records
    }

    /// True for the first part, which opens with the `#resync` event.
    #[must_use]
    pub fn is_first(&self) -> bool {
        self.first == 0
    }

    /// True for the last part.
    #[must_use]
    pub fn is_last(&self) -> bool {
        self.last
    }

    /// Where this part's first event stands among the snapshot's events (0 is the
    /// `#resync`; record `i` is event `i + 1`): for ids that stay the same when a part is
    /// written again.
    #[must_use]
    pub fn first_event(&self) -> u64 {
        if self.first == 0 { 0 } else { self.first + 1 }
    }

    /// Appends the `#resync` event:
    /// `{"type":"#resync","repo","rev","commit","data","reason","records":N}`.
    pub fn write_resync_json(&self, out: &mut String) {
        use std::fmt::Write as _;
        let r = &self.repo;
        out.push_str("{\"type\":\"#resync\",\"repo\":");
        atproto_data::json::write_str(&r.did, out);
        out.push_str(",\"rev\":");
        atproto_data::json::write_str(&r.rev, out);
        out.push_str(",\"commit\":");
        atproto_data::json::write_str(&r.commit, out);
        out.push_str(",\"data\":");
        atproto_data::json::write_str(&r.data, out);
        out.push_str(",\"reason\":");
        atproto_data::json::write_str(&self.reason, out);
        let _ = write!(out, ",\"records\":{}}}", r.records);
    }

    /// Appends the `#record` event of this part's `i`th record:
    /// `{"type":"#record","repo","rev","collection","rkey","cid","record"}`.
    pub fn write_record_json(&self, i: usize, out: &mut String) {
        let r = &self.repo;
        let rec = &self.records[i];
        out.push_str("{\"type\":\"#record\",\"repo\":");
        atproto_data::json::write_str(&r.did, out);
        out.push_str(",\"rev\":");
        atproto_data::json::write_str(&r.rev, out);
        out.push_str(",\"collection\":");
        atproto_data::json::write_str(&rec.collection, out);
        out.push_str(",\"rkey\":");
        atproto_data::json::write_str(&rec.rkey, out);
        out.push_str(",\"cid\":");
        atproto_data::json::write_str(&rec.cid, out);
        out.push_str(",\"record\":");
        out.push_str(&rec.json);
        out.push('}');
    }

    /// How many events this part is: the `#resync` (first part only) and one per record.
    #[must_use]
    pub fn events(&self) -> usize {
        usize::from(self.is_first()) + self.records.len()
    }

    /// Appends this part's event `i` of [`Snapshot::events`] (in the first part, 0 is the
    /// `#resync`).
    pub fn write_event_json(&self, i: usize, out: &mut String) {
        match (self.is_first(), i) {
            (true, 0) => self.write_resync_json(out),
            (true, i) => self.write_record_json(i - 1, out),
            (false, i) => self.write_record_json(i, out),
        }
    }

    /// The kind of this part's event `i` (`#resync` or `#record`).
    #[must_use]
    pub fn event_kind(&self, i: usize) -> &'static str {
        if self.is_first() && i == 0 { "#resync" } else { "#record" }
    }
}

/// A verified snapshot as the lane takes it: the repo's commit, and its records to come a
/// part at a time.
#[derive(Debug)]
pub(crate) struct SnapshotParts {
    pub(crate) repo: Arc<repo_sync::snapshot::RepoSnapshot>,
    pub(crate) reason: Arc<str>,
    pub(crate) parts: repo_sync::snapshot::Parts,
    /// Records given so far, the part read ahead, and whether the last was given.
    at: u64,
    ahead: Option<Result<Vec<repo_sync::snapshot::RepoRecord>, String>>,
    over: bool,
}

impl SnapshotParts {
    /// The repo's DID.
    pub(crate) fn did(&self) -> &str {
        &self.repo.did
    }

    /// The commit's rev.
    pub(crate) fn rev(&self) -> &str {
        &self.repo.rev
    }

    /// A snapshot whose parts come from `parts`.
    pub(crate) fn new(
        repo: Arc<repo_sync::snapshot::RepoSnapshot>,
        reason: Arc<str>,
        parts: repo_sync::snapshot::Parts,
    ) -> Self {
        Self { repo, reason, parts, at: 0, ahead: None, over: false }
    }

    /// The next part, in order (one part read ahead, to know which is the last; a repo
    /// with no records is the `#resync` alone); `None` after the last. A body that cannot
    /// be read further is `Refused` (the repo is fetched again later).
    pub(crate) async fn next_part(&mut self) -> Option<Result<Snapshot, HandlerError>> {
        if self.over {
            return None;
        }
        let part = match self.ahead.take() {
            Some(p) => p,
            None => self.parts.next().await.unwrap_or(Ok(Vec::new())),
        };
        let records = match part {
            Ok(r) => r,
            Err(why) => {
                self.over = true;
                return Some(Err(HandlerError::refused("repo sync", why)));
            }
        };
        let after = if records.is_empty() { None } else { self.parts.next().await };
        self.over = after.is_none();
        self.ahead = after;
        let now = Snapshot::part(self.repo.clone(), self.reason.clone(), records, self.at, self.over);
        self.at += now.records().len() as u64;
        Some(Ok(now))
    }
}

/// How the lane renders events for a handler that wants JSON.
#[derive(Debug, Clone)]
pub(crate) struct Render {
    pub(crate) verify_blocks: bool,
    pub(crate) filter: Option<CollectionFilter>,
}

/// Renders with bad records as `null` plus a `recordError` (one bad record must not
/// hold back the stream); with lossy records the rendering cannot fail.
pub(crate) fn render(m: &Message<'_>, r: &Render, out: &mut String) -> Written {
    let keep = |op: &relay_client::frame::RepoOp<'_>| r.filter.as_ref().is_none_or(|f| f.wants(op.collection()));
    let opts = FrameOptions {
        verify_blocks: r.verify_blocks,
        keep_op: r.filter.is_some().then_some(&keep as &dyn Fn(&relay_client::frame::RepoOp<'_>) -> bool),
        lossy_records: true,
    };
    write_message_with(m, &opts, out).unwrap_or_default()
}

/// Collection filters: exact NSIDs or `prefix.*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectionFilter(Vec<String>);

impl CollectionFilter {
    /// A filter from entries; `Err` names the first entry that is not an NSID or
    /// `prefix.*`.
    pub fn new<S: Into<String>>(entries: impl IntoIterator<Item = S>) -> Result<Option<Self>, String> {
        let entries: Vec<String> = entries.into_iter().map(Into::into).collect();
        for c in &entries {
            let body = c.strip_suffix(".*").unwrap_or(c);
            if body.is_empty() || !body.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '.' || ch == '-') {
                return Err(c.clone());
            }
        }
        Ok((!entries.is_empty()).then_some(Self(entries)))
    }

    /// True when one of the entries matches.
    #[must_use]
    pub fn wants(&self, collection: &str) -> bool {
        self.0.iter().any(|f| match f.strip_suffix(".*") {
            Some(prefix) => collection.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.')),
            None => f == collection,
        })
    }

    /// True when the filter drops the whole message: a commit with ops, none wanted.
    #[must_use]
    pub fn drops(&self, m: &Message<'_>) -> bool {
        match m {
            Message::Commit(c) => !c.ops.is_empty() && !c.ops.iter().any(|op| self.wants(op.collection())),
            Message::Jet(j) => j.commit.is_some_and(|op| !self.wants(op.collection)),
            _ => false,
        }
    }

    /// The entries.
    #[must_use]
    pub fn entries(&self) -> &[String] {
        &self.0
    }
}

/// Context of a batch.
#[derive(Debug, Clone)]
pub struct BatchCtx {
    /// The term's fencing token: carry it on every external write.
    pub token: u64,
    /// The relay the batch came from.
    pub relay: RelayRole,
    /// The relay fingerprint (the cursor's key).
    pub fingerprint: String,
    /// Fires when the term ends: stop waiting.
    pub cancel: CancellationToken,
    /// The term itself: nothing may be written once its deadline has passed.
    pub term: Term,
    /// Set while the lane holds events back behind a snapshot written beside it.
    pub cursor_hold: CursorHold,
}

/// Whether a lane holds events back (a repo's, behind its snapshot being written beside the
/// lane): a handler that commits the cursor in its own transaction
/// ([`Handler::commits_cursor`]) must not move it then, since the batches it writes meanwhile
/// do not hold every event before their last seq. Shared by the clones of a [`BatchCtx`].
#[derive(Debug, Clone, Default)]
pub struct CursorHold(Arc<std::sync::atomic::AtomicBool>);

impl CursorHold {
    /// True while events are held back: write, fenced, but do not move the cursor.
    #[must_use]
    pub fn is_held(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sets or clears the hold (the consumer's lanes do; tests of a handler may).
    pub fn set(&self, on: bool) {
        self.0.store(on, std::sync::atomic::Ordering::Release);
    }
}

impl BatchCtx {
    /// `Err(Cancelled)` once the term's deadline has passed: call it right before each
    /// externally visible write, after any wait that may have outlasted the term.
    pub fn ensure_active(&self) -> Result<(), HandlerError> {
        if self.term.is_active() { Ok(()) } else { Err(HandlerError::Cancelled) }
    }
}

/// Why a batch was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// The destination refused our token: a newer term is writing. Ends the term.
    #[error("sink refused the fencing token: a newer term is writing")]
    Fenced,
    /// The term ended before the batch was written. Ends the term.
    #[error("term ended before the batch was written")]
    Cancelled,
    /// The sink cannot go on safely (a stream it cannot repair after a partial write):
    /// everything before the batch is committed and the consumer stops with this error.
    #[error("{what}: {source}")]
    Fatal {
        /// What was being done.
        what: String,
        /// Why it cannot go on.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The downstream refused the batch for its content (it would refuse it every time):
    /// the lane writes it in halves to find the events refused, and hands each over as
    /// `#invalid` (`unstorable`) under the skip policy, or stops under fail.
    #[error("{what} refused the batch: {source}")]
    Refused {
        /// Which downstream.
        what: String,
        /// What it said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Anything else: retried with backoff while the term lasts. Keeps its cause.
    #[error("{what}: {source}")]
    Failed {
        /// What was being done: `jsonl write`, `webhook`, `postgres`, …
        what: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl HandlerError {
    /// A retryable failure of `what`, keeping `source` (an error, or a message) as its cause.
    pub fn failed(what: impl Into<String>, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Failed { what: what.into(), source: source.into() }
    }

    /// `what` refused the batch for its content, keeping `source` as its cause.
    pub fn refused(what: impl Into<String>, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Refused { what: what.into(), source: source.into() }
    }

    /// A failure of `what` the sink cannot recover from, keeping `source` as its cause.
    pub fn fatal(what: impl Into<String>, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Fatal { what: what.into(), source: source.into() }
    }
}

/// A batch handed over by [`Handler::submit`] and not yet durable: resolves `Ok` once it
/// is (the cursor may then pass it), or with why not (`Failed`: the lane submits the same
/// batch again).
pub type Pending = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), HandlerError>> + Send>>;

/// Where events go. Batches of one lane arrive in seq order, one at a time; events of
/// one repo always share a lane. The cursor moves past an event only after the batch
/// holding it returned `Ok` (or, for a handler that writes ahead, after its [`Pending`]
/// resolved `Ok`).
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Takes one batch. `Failed` is retried (the same batch, with backoff) until the term
    /// ends; `Fenced` and `Cancelled` end the term.
    async fn handle(&self, batch: &[Event], ctx: &BatchCtx) -> Result<(), HandlerError>;

    /// Starts writing one batch, in order after the lane's earlier batches, and returns
    /// what resolves once it is durable; the lane meanwhile submits its next batches, up
    /// to [`Handler::write_ahead`] events not yet durable. A batch whose [`Pending`]
    /// fails is submitted again, whole, after later ones may have been written: a handler
    /// that writes ahead must make a repeated write harmless (JetStream: the same
    /// `Nats-Msg-Id`). The default writes with [`Handler::handle`] and is then done.
    async fn submit(&self, batch: &[Event], ctx: &BatchCtx) -> Result<Pending, HandlerError> {
        self.handle(batch, ctx).await?;
        Ok(Box::pin(std::future::ready(Ok(()))))
    }

    /// How many events of a lane may be submitted and not yet durable before the lane
    /// waits for the oldest. 0 (the default): each batch is finished before the next.
    fn write_ahead(&self) -> usize {
        0
    }

    /// True when the handler reads [`Event::json`]: the lane then renders each event
    /// once, with the collection filter applied. Rendering is most of the per-event cost.
    fn wants_json(&self) -> bool {
        false
    }

    /// The largest batch to hand over.
    fn max_batch(&self) -> usize {
        512
    }

    /// True when the handler commits the cursor itself, in the same transaction as its
    /// writes (the consumer then runs one lane and never commits on its own).
    fn commits_cursor(&self) -> bool {
        false
    }

    /// True when the handler takes repo snapshots ([`Handler::snapshot`]): repo sync
    /// (resync after a chain break or an invalid commit) runs only for such a handler.
    fn takes_snapshots(&self) -> bool {
        false
    }

    /// True when every replica reaches the same downstream (a database, a webhook, a
    /// stream), so a standby may write the snapshots of repo-sync jobs it claims from the
    /// shared queue; a process's own output (a file, stdout) is not shared: only the
    /// leader then fetches repos.
    fn is_shared(&self) -> bool {
        false
    }

    /// Takes a repo snapshot (fold semantics: see [`Snapshot`]), durably, before the
    /// repo's later events. `Failed` is retried with backoff; `Refused` drops this
    /// snapshot (the repo is fetched again later). The default refuses: a handler that
    /// takes snapshots says so with [`Handler::takes_snapshots`].
    async fn snapshot(&self, snapshot: &Snapshot, ctx: &BatchCtx) -> Result<(), HandlerError> {
        let _ = ctx;
        Err(HandlerError::refused("handler", format!("takes no repo snapshots (repo {})", snapshot.did())))
    }

    /// After this many failed writes in a row (`Failed`), the term is given up so that
    /// another replica (with its own connection) may take over; `None` (the default):
    /// retried while the term lasts.
    fn give_up_after(&self) -> Option<u32> {
        None
    }
}
