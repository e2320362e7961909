//! `com.atproto.sync.subscribeRepos` frames: a DAG-CBOR header `{t, op}` followed by a
//! DAG-CBOR body, decoded into borrowed structs without copying strings or bytes.

use crate::car::Car;
use crate::cbor::Reader;
use crate::cid::Cid;
use crate::error::{CborError, DecodeError};

/// The largest seq (and cursor) accepted: 2^53-1, the largest integer every JSON and
/// JavaScript consumer can represent exactly.
pub const MAX_SEQ: u64 = (1 << 53) - 1;

/// One decoded frame.
#[derive(Debug, yoke::Yokeable)]
pub enum Frame<'a> {
    /// `op = 1`: a message of some type.
    Message(Message<'a>),
    /// `op = -1`: the relay reports an error and will close the stream.
    Error(ErrorFrame<'a>),
}

/// An error frame body.
#[derive(Debug, Clone, Copy)]
pub struct ErrorFrame<'a> {
    /// The error name, e.g. `FutureCursor` or `ConsumerTooSlow`.
    pub error: &'a str,
    /// Human-readable detail, if any.
    pub message: Option<&'a str>,
}

/// The message types of `subscribeRepos`. `Yokeable` lets a frame's owner keep the
/// decoded message beside its bytes (see [`crate::OwnedFrame`]): decoded once.
#[derive(Debug, yoke::Yokeable)]
pub enum Message<'a> {
    /// `#commit`: a repo commit with its ops and CAR blocks.
    Commit(Commit<'a>),
    /// `#sync`: a repo's current state, without a diff.
    Sync(Sync<'a>),
    /// `#identity`: a DID document or handle changed.
    Identity(Identity<'a>),
    /// `#account`: hosting status changed.
    Account(Account<'a>),
    /// `#info`: informational message from the relay, e.g. `OutdatedCursor`.
    Info(Info<'a>),
    /// A type this version does not know: counted and skipped, for forward compatibility.
    Unknown {
        /// The header's `t`.
        t: &'a str,
        /// The body's `seq`, when it has one.
        seq: Option<u64>,
    },
}

impl Message<'_> {
    /// The sequence number; `#info` carries none.
    #[must_use]
    pub fn seq(&self) -> Option<u64> {
        match self {
            Self::Commit(c) => Some(c.seq),
            Self::Sync(s) => Some(s.seq),
            Self::Identity(i) => Some(i.seq),
            Self::Account(a) => Some(a.seq),
            Self::Info(_) => None,
            Self::Unknown { seq, .. } => *seq,
        }
    }

    /// The header's `t` (the unknown type's own name for [`Message::Unknown`]).
    #[must_use]
    pub fn type_name(&self) -> &str {
        match self {
            Self::Unknown { t, .. } => t,
            m => m.kind().as_str(),
        }
    }

    /// The message type, as a static tag for metrics, sinks and dispatch.
    #[must_use]
    pub fn kind(&self) -> Kind {
        match self {
            Self::Commit(_) => Kind::Commit,
            Self::Sync(_) => Kind::Sync,
            Self::Identity(_) => Kind::Identity,
            Self::Account(_) => Kind::Account,
            Self::Info(_) => Kind::Info,
            Self::Unknown { .. } => Kind::Unknown,
        }
    }

    /// When the relay (or PDS) emitted the event, as the RFC 3339 string it sent; `#info`
    /// and unknown types carry none.
    #[must_use]
    pub fn time(&self) -> Option<&str> {
        match self {
            Self::Commit(c) => Some(c.time),
            Self::Sync(s) => Some(s.time),
            Self::Identity(i) => Some(i.time),
            Self::Account(a) => Some(a.time),
            Self::Info(_) | Self::Unknown { .. } => None,
        }
    }

    /// The repo (DID) the event is about, which orders processing.
    #[must_use]
    pub fn did(&self) -> Option<&str> {
        match self {
            Self::Commit(c) => Some(c.repo),
            Self::Sync(s) => Some(s.did),
            Self::Identity(i) => Some(i.did),
            Self::Account(a) => Some(a.did),
            Self::Info(_) | Self::Unknown { .. } => None,
        }
    }
}

/// The type of a message, without its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `#commit`.
    Commit,
    /// `#sync`.
    Sync,
    /// `#identity`.
    Identity,
    /// `#account`.
    Account,
    /// `#info`.
    Info,
    /// A type this version does not know.
    Unknown,
}

impl Kind {
    /// The header's `t` spelling (`#unknown` for unknown types).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Commit => "#commit",
            Self::Sync => "#sync",
            Self::Identity => "#identity",
            Self::Account => "#account",
            Self::Info => "#info",
            Self::Unknown => "#unknown",
        }
    }
}

/// What an op does to a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A new record.
    Create,
    /// A changed record.
    Update,
    /// A removed record.
    Delete,
}

impl Action {
    /// The lexicon spelling.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Update => "update",
            Self::Delete => "delete",
        }
    }
}

/// One record operation of a commit.
#[derive(Debug, Clone, Copy)]
pub struct RepoOp<'a> {
    /// create, update or delete.
    pub action: Action,
    /// `collection/rkey`.
    pub path: &'a str,
    /// The new record's CID; `None` for deletes.
    pub cid: Option<Cid<'a>>,
    /// The previous record's CID, for updates and deletes (newer relays).
    pub prev: Option<Cid<'a>>,
}

impl<'a> RepoOp<'a> {
    /// The collection NSID part of the path.
    #[must_use]
    pub fn collection(&self) -> &'a str {
        self.path.split_once('/').map_or(self.path, |(c, _)| c)
    }

    /// The record key part of the path.
    #[must_use]
    pub fn rkey(&self) -> &'a str {
        self.path.split_once('/').map_or("", |(_, k)| k)
    }

    /// Finds and validates this op's record in the commit's CAR; `None` for deletes.
    pub fn record(&self, car: &Car<'a>) -> Result<Option<Record<'a>>, DecodeError> {
        let Some(cid) = self.cid else { return Ok(None) };
        if self.action == Action::Delete {
            return Ok(None);
        }
        let data = car
            .get(cid)
            .ok_or_else(|| DecodeError::MissingBlock { path: self.path.to_owned(), cid: cid.to_string() })?;
        Record::new(data).map(Some)
    }
}

/// A record's DAG-CBOR bytes, checked to be one valid DAG-CBOR map.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a>(&'a [u8]);

impl<'a> Record<'a> {
    /// Validates `data` as a single strict DAG-CBOR map.
    pub fn new(data: &'a [u8]) -> Result<Self, DecodeError> {
        let cb = |source| DecodeError::Cbor { part: "record", source };
        let mut r = Reader::new(data);
        if data.first().is_none_or(|b| b >> 5 != 5) {
            return Err(cb(CborError::Unexpected { at: 0, expected: "record map" }));
        }
        r.skip().map_err(cb)?;
        r.end().map_err(cb)?;
        Ok(Self(data))
    }

    /// The raw DAG-CBOR.
    #[must_use]
    pub fn as_bytes(&self) -> &'a [u8] {
        self.0
    }

    /// The record's `$type`, if it has one.
    #[must_use]
    pub fn type_name(&self) -> Option<&'a str> {
        let mut r = Reader::new(self.0);
        let n = r.map().ok()?;
        let mut prev = None;
        for _ in 0..n {
            let k = r.key(prev).ok()?;
            if k == "$type" {
                return r.str().ok();
            }
            // Keys are sorted length-first: past length 5, `$type` cannot follow.
            if k.len() > 5 {
                return None;
            }
            prev = Some(k);
            r.skip().ok()?;
        }
        None
    }

    /// Appends the record in the atproto JSON data model.
    pub fn write_json(&self, out: &mut String) {
        crate::json::write_cbor_as_json(self.0, out);
    }
}

/// A `#commit` body.
#[derive(Debug, Clone)]
pub struct Commit<'a> {
    /// Sequence number.
    pub seq: u64,
    /// The repo DID.
    pub repo: &'a str,
    /// The commit object's CID.
    pub commit: Cid<'a>,
    /// The commit's revision TID.
    pub rev: &'a str,
    /// The previous revision, if any.
    pub since: Option<&'a str>,
    /// `CARv1` slice with the commit, MST diff and record blocks.
    pub blocks: &'a [u8],
    /// Record operations.
    pub ops: Vec<RepoOp<'a>>,
    /// The previous MST root, on newer relays.
    pub prev_data: Option<Cid<'a>>,
    /// Deprecated: the commit was too big to include all blocks.
    pub too_big: bool,
    /// Deprecated: the commit is a rebase.
    pub rebase: bool,
    /// When the relay saw the commit.
    pub time: &'a str,
}

impl<'a> Commit<'a> {
    /// Parses the `blocks` CAR slice and indexes it for record look-ups.
    pub fn car(&self, verify: bool) -> Result<Car<'a>, DecodeError> {
        let mut car = Car::parse(self.blocks, verify)?;
        if self.ops.len() > 2 {
            car.index();
        }
        Ok(car)
    }
}

/// A `#sync` body.
#[derive(Debug, Clone, Copy)]
pub struct Sync<'a> {
    /// Sequence number.
    pub seq: u64,
    /// The repo DID.
    pub did: &'a str,
    /// CAR slice with the commit block.
    pub blocks: &'a [u8],
    /// The commit revision.
    pub rev: &'a str,
    /// Timestamp.
    pub time: &'a str,
}

/// An `#identity` body.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    /// Sequence number.
    pub seq: u64,
    /// The DID.
    pub did: &'a str,
    /// Timestamp.
    pub time: &'a str,
    /// The current handle, if the relay includes it.
    pub handle: Option<&'a str>,
}

/// An `#account` body.
#[derive(Debug, Clone, Copy)]
pub struct Account<'a> {
    /// Sequence number.
    pub seq: u64,
    /// The DID.
    pub did: &'a str,
    /// Timestamp.
    pub time: &'a str,
    /// Whether the account is active.
    pub active: bool,
    /// Why it is not active (`deactivated`, `takendown`, `suspended`, `deleted`, …).
    pub status: Option<&'a str>,
}

/// An `#info` body.
#[derive(Debug, Clone, Copy)]
pub struct Info<'a> {
    /// e.g. `OutdatedCursor`.
    pub name: &'a str,
    /// Human-readable detail.
    pub message: Option<&'a str>,
}

/// Decodes one frame (header and body), fully validating it, without records.
pub fn decode(bytes: &[u8]) -> Result<Frame<'_>, DecodeError> {
    let mut r = Reader::new(bytes);
    let (op, t) = header(&mut r)?;
    let cb = |source| DecodeError::Cbor { part: "body", source };
    let frame = match op {
        1 => {
            let t = t.ok_or(DecodeError::MissingType)?;
            Frame::Message(match t {
                "#commit" => Message::Commit(commit(&mut r)?),
                "#sync" => Message::Sync(sync(&mut r)?),
                "#identity" => Message::Identity(identity(&mut r)?),
                "#account" => Message::Account(account(&mut r)?),
                "#info" => Message::Info(info(&mut r)?),
                _ => Message::Unknown { t, seq: unknown_seq(&mut r)? },
            })
        }
        -1 => Frame::Error(error_body(&mut r)?),
        other => return Err(DecodeError::UnknownOp(other)),
    };
    r.end().map_err(cb)?;
    Ok(frame)
}

fn header<'a>(r: &mut Reader<'a>) -> Result<(i64, Option<&'a str>), DecodeError> {
    let cb = |source| DecodeError::Cbor { part: "header", source };
    let n = r.map().map_err(cb)?;
    let (mut op, mut t, mut prev) = (None, None, None);
    for _ in 0..n {
        let k = r.key(prev).map_err(cb)?;
        prev = Some(k);
        match k {
            "t" => t = Some(r.str().map_err(cb)?),
            "op" => op = Some(r.i64().map_err(cb)?),
            _ => r.skip().map_err(cb)?,
        }
    }
    let op = op.ok_or(DecodeError::MissingField { kind: "header", field: "op" })?;
    Ok((op, t))
}

/// Walks a body map, handing each key to `f`, which must consume the value; checks order.
fn fields<'a>(
    r: &mut Reader<'a>,
    mut f: impl FnMut(&'a str, &mut Reader<'a>) -> Result<bool, DecodeError>,
) -> Result<(), DecodeError> {
    let cb = |source| DecodeError::Cbor { part: "body", source };
    let n = r.map().map_err(cb)?;
    let mut prev = None;
    for _ in 0..n {
        let k = r.key(prev).map_err(cb)?;
        prev = Some(k);
        if !f(k, r)? {
            r.skip().map_err(cb)?;
        }
    }
    Ok(())
}

fn cbody(source: CborError) -> DecodeError {
    DecodeError::Cbor { part: "body", source }
}

fn seq_value(r: &mut Reader<'_>) -> Result<u64, DecodeError> {
    let v = r.i64().map_err(cbody)?;
    u64::try_from(v)
        .ok()
        .filter(|&s| s <= MAX_SEQ)
        .ok_or_else(|| DecodeError::BadValue { field: "seq", detail: format!("{v} is outside 0..=2^53-1") })
}

fn link<'a>(r: &mut Reader<'a>, field: &'static str) -> Result<Cid<'a>, DecodeError> {
    let raw = r.link().map_err(cbody)?;
    Cid::from_bytes(raw).map_err(|source| DecodeError::Cid { field, source })
}

fn opt_link<'a>(r: &mut Reader<'a>, field: &'static str) -> Result<Option<Cid<'a>>, DecodeError> {
    if r.null() { Ok(None) } else { link(r, field).map(Some) }
}

fn opt_str<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeError> {
    if r.null() { Ok(None) } else { r.str().map(Some).map_err(cbody) }
}

fn need<T>(v: Option<T>, kind: &'static str, field: &'static str) -> Result<T, DecodeError> {
    v.ok_or(DecodeError::MissingField { kind, field })
}

fn commit<'a>(r: &mut Reader<'a>) -> Result<Commit<'a>, DecodeError> {
    const K: &str = "#commit";
    let (mut seq, mut repo, mut cid, mut rev, mut since, mut blocks, mut ops, mut time) =
        (None, None, None, None, None, None, None, None);
    let (mut prev_data, mut too_big, mut rebase) = (None, false, false);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "repo" => repo = Some(r.str().map_err(cbody)?),
            "commit" => cid = Some(link(r, "commit")?),
            "rev" => rev = Some(r.str().map_err(cbody)?),
            "since" => since = opt_str(r)?,
            "blocks" => blocks = Some(r.bytes().map_err(cbody)?),
            "ops" => ops = Some(repo_ops(r)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            "prevData" => prev_data = opt_link(r, "prevData")?,
            "tooBig" => too_big = r.bool().map_err(cbody)?,
            "rebase" => rebase = r.bool().map_err(cbody)?,
            "blobs" => {
                let n = r.array().map_err(cbody)?;
                for _ in 0..n {
                    link(r, "blobs")?;
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Commit {
        seq: need(seq, K, "seq")?,
        repo: need(repo, K, "repo")?,
        commit: need(cid, K, "commit")?,
        rev: need(rev, K, "rev")?,
        since,
        blocks: need(blocks, K, "blocks")?,
        ops: need(ops, K, "ops")?,
        prev_data,
        too_big,
        rebase,
        time: need(time, K, "time")?,
    })
}

fn repo_ops<'a>(r: &mut Reader<'a>) -> Result<Vec<RepoOp<'a>>, DecodeError> {
    const K: &str = "repoOp";
    let n = r.array().map_err(cbody)?;
    // Relays cap ops at 200; never pre-allocate from an untrusted length.
    let mut ops = Vec::with_capacity(n.min(256) as usize);
    for _ in 0..n {
        let (mut action, mut path, mut cid, mut prev, mut has_cid) = (None, None, None, None, false);
        fields(r, |k, r| {
            match k {
                "action" => {
                    action = Some(match r.str().map_err(cbody)? {
                        "create" => Action::Create,
                        "update" => Action::Update,
                        "delete" => Action::Delete,
                        other => {
                            return Err(DecodeError::BadValue {
                                field: "action",
                                detail: format!("unknown action {other:?}"),
                            });
                        }
                    });
                }
                "path" => path = Some(r.str().map_err(cbody)?),
                "cid" => {
                    has_cid = true;
                    cid = opt_link(r, "op cid")?;
                }
                "prev" => prev = opt_link(r, "op prev")?,
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        let action = need(action, K, "action")?;
        if !has_cid {
            return Err(DecodeError::MissingField { kind: K, field: "cid" });
        }
        if action != Action::Delete && cid.is_none() {
            return Err(DecodeError::BadValue {
                field: "cid",
                detail: format!("{} op without a CID", action.as_str()),
            });
        }
        ops.push(RepoOp { action, path: need(path, K, "path")?, cid, prev });
    }
    Ok(ops)
}

fn sync<'a>(r: &mut Reader<'a>) -> Result<Sync<'a>, DecodeError> {
    const K: &str = "#sync";
    let (mut seq, mut did, mut blocks, mut rev, mut time) = (None, None, None, None, None);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "did" => did = Some(r.str().map_err(cbody)?),
            "blocks" => blocks = Some(r.bytes().map_err(cbody)?),
            "rev" => rev = Some(r.str().map_err(cbody)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Sync {
        seq: need(seq, K, "seq")?,
        did: need(did, K, "did")?,
        blocks: need(blocks, K, "blocks")?,
        rev: need(rev, K, "rev")?,
        time: need(time, K, "time")?,
    })
}

fn identity<'a>(r: &mut Reader<'a>) -> Result<Identity<'a>, DecodeError> {
    const K: &str = "#identity";
    let (mut seq, mut did, mut time, mut handle) = (None, None, None, None);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "did" => did = Some(r.str().map_err(cbody)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            "handle" => handle = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Identity { seq: need(seq, K, "seq")?, did: need(did, K, "did")?, time: need(time, K, "time")?, handle })
}

fn account<'a>(r: &mut Reader<'a>) -> Result<Account<'a>, DecodeError> {
    const K: &str = "#account";
    let (mut seq, mut did, mut time, mut active, mut status) = (None, None, None, None, None);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "did" => did = Some(r.str().map_err(cbody)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            "active" => active = Some(r.bool().map_err(cbody)?),
            "status" => status = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Account {
        seq: need(seq, K, "seq")?,
        did: need(did, K, "did")?,
        time: need(time, K, "time")?,
        active: need(active, K, "active")?,
        status,
    })
}

fn info<'a>(r: &mut Reader<'a>) -> Result<Info<'a>, DecodeError> {
    let (mut name, mut message) = (None, None);
    fields(r, |k, r| {
        match k {
            "name" => name = Some(r.str().map_err(cbody)?),
            "message" => message = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Info { name: need(name, "#info", "name")?, message })
}

fn error_body<'a>(r: &mut Reader<'a>) -> Result<ErrorFrame<'a>, DecodeError> {
    let (mut error, mut message) = (None, None);
    fields(r, |k, r| {
        match k {
            "error" => error = Some(r.str().map_err(cbody)?),
            "message" => message = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(ErrorFrame { error: need(error, "error frame", "error")?, message })
}

fn unknown_seq(r: &mut Reader<'_>) -> Result<Option<u64>, DecodeError> {
    let mut seq = None;
    if r.rest().first().is_some_and(|b| b >> 5 == 5) {
        fields(r, |k, r| {
            if k == "seq" {
                seq = Some(seq_value(r)?);
                return Ok(true);
            }
            Ok(false)
        })?;
    } else {
        r.skip().map_err(cbody)?;
    }
    Ok(seq)
}

/// Where the body's `seq` value lies in a frame, as a byte range, for tools that
/// renumber frames (`relay-sim`'s seq reset) without re-encoding the rest.
#[must_use]
pub fn seq_span(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut r = Reader::new(bytes);
    header(&mut r).ok()?;
    let n = r.map().ok()?;
    let mut prev = None;
    for _ in 0..n {
        let k = r.key(prev).ok()?;
        prev = Some(k);
        let start = r.position();
        r.skip().ok()?;
        if k == "seq" {
            return Some(start..r.position());
        }
    }
    None
}
