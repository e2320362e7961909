//! `com.atproto.sync.subscribeRepos` frames: a DAG-CBOR header `{t, op}` followed by a
//! DAG-CBOR body, decoded into borrowed structs without copying strings or bytes.

mod decode;

pub use decode::{decode, peek_seq, seq_span};

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

impl<'a> Frame<'a> {
    /// The message, unless this is an error frame.
    #[must_use]
    pub fn message(&self) -> Option<&Message<'a>> {
        match self {
            Self::Message(m) => Some(m),
            Self::Error(_) => None,
        }
    }

    /// The message by value, unless this is an error frame.
    #[must_use]
    pub fn into_message(self) -> Option<Message<'a>> {
        match self {
            Self::Message(m) => Some(m),
            Self::Error(_) => None,
        }
    }

    /// The message's seq; `None` for error frames, `#info` and seq-less unknown types.
    #[must_use]
    pub fn seq(&self) -> Option<u64> {
        self.message().and_then(Message::seq)
    }
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
/// decoded message beside its bytes (see `relay_client::OwnedFrame`): decoded once.
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
    /// An event read from Jetstream (JSON, one record op per commit, no blocks and no
    /// signature): see [`crate::jetstream`].
    Jet(crate::jetstream::Event<'a>),
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
            Self::Jet(j) => Some(j.stamp),
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
            Self::Jet(j) => j.kind,
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
            Self::Jet(j) => j.upstream_time,
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
            Self::Jet(j) => Some(j.did),
            Self::Info(_) | Self::Unknown { .. } => None,
        }
    }
}

impl Message<'_> {
    /// A Jetstream event's stamp (Unix microseconds, the instance's clock); `None` for
    /// firehose messages.
    #[must_use]
    pub fn stamp(&self) -> Option<u64> {
        match self {
            Self::Jet(j) => Some(j.stamp),
            _ => None,
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
