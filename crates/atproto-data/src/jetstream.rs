//! Jetstream events: the JSON stream most apps read, decoded into borrowed structs.
//!
//! Two wires exist:
//! - **v1** (`/subscribe`): one bare event object per frame,
//!   `{"did","time_us","kind":"commit"|"identity"|"account","commit"|"identity"|"account":{…}}`.
//! - **v2** (`/xrpc/network.bsky.jetstream.subscribeEvents`, the `xrpc.v1.json` framing):
//!   `{"$type":"message","payload":{"$type":"network.bsky.jetstream.subscribeEvents#commit",…}}`,
//!   `{"$type":"error","error":…,"message":…}`, and `#info` payloads such as
//!   `OutdatedCursor`.
//!
//! Every event carries the instance's **stamp** (v1 `time_us`; v2 `time`, an RFC 3339
//! time with microseconds): when that instance witnessed it. Stamps are the stream's
//! position: they rise with the instance's order, but the ops of one commit share one
//! stamp, and two instances stamp the same event a little differently.
//!
//! Strings are borrowed from the frame; a field that needs unescaping (no DID, rev,
//! collection, record key or CID does) is refused as malformed. Records stay as their
//! JSON text: nothing in the stream needs them parsed.

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use crate::error::DecodeError;
use crate::frame::{Action, ErrorFrame, Frame, Info, Kind, Message};

/// Cursors at or above this are times in microseconds, below it sequence numbers (the
/// rule Jetstream itself applies to `?cursor=`).
pub const TIME_CURSOR_MIN: u64 = 1_000_000_000_000_000;

/// The v1 zstd dictionary (`/subscribe?compress=true`), as Jetstream publishes it.
pub const DICT_V1: &[u8] = include_bytes!("../dict/legacy_subscribe.zdict");
/// The v2 zstd dictionary (`zstdDictionary=`[`DICT_V2_ID`]), as Jetstream publishes it.
pub const DICT_V2: &[u8] = include_bytes!("../dict/subscribe_events_20260811.zdict");
/// The v2 dictionary's id (from its header).
pub const DICT_V2_ID: u32 = 20_260_811;

/// Which Jetstream wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Version {
    /// `/subscribe`: bare event objects with `time_us`.
    #[default]
    V1,
    /// `network.bsky.jetstream.subscribeEvents`: `xrpc.v1.json` message frames.
    V2,
}

impl Version {
    /// `v1` or `v2`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        }
    }
}

/// One Jetstream event (a single record op for commits).
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// When this instance witnessed it, Unix microseconds: the stream's position.
    pub stamp: u64,
    /// The repo (DID).
    pub did: &'a str,
    /// `#commit`, `#identity`, `#account` or `#sync`.
    pub kind: Kind,
    /// The op, for commits.
    pub commit: Option<Op<'a>>,
    /// The rev of a `#sync`.
    pub rev: Option<&'a str>,
    /// The upstream event's time (RFC 3339) for identity, account and sync events: the
    /// same on every instance, so it names the event across them.
    pub upstream_time: Option<&'a str>,
    /// The event object exactly as received (v1: the frame; v2: the payload).
    pub json: &'a str,
    /// [`Event::content_key`], hashed once at decode (the client, the term's memory and
    /// the sinks all name the event by it).
    key: u64,
}

/// A commit event's op.
#[derive(Debug, Clone, Copy)]
pub struct Op<'a> {
    /// The commit's rev (every op of a commit shares it).
    pub rev: &'a str,
    /// create, update or delete.
    pub action: Action,
    /// The collection NSID.
    pub collection: &'a str,
    /// The record key.
    pub rkey: &'a str,
    /// The record's CID (absent for deletes).
    pub cid: Option<&'a str>,
}

impl Event<'_> {
    /// A hash of what names the event on every instance: a commit op by (did, rev,
    /// collection, rkey, action), the other kinds by (kind, did, upstream time, rev).
    #[must_use]
    pub fn content_key(&self) -> u64 {
        self.key
    }

    /// The event with its content key computed.
    fn keyed(mut self) -> Self {
        self.key = self.hash_content();
        self
    }

    fn hash_content(&self) -> u64 {
        let mut h = Fnv::default();
        h.put(self.kind.as_str());
        h.put(self.did);
        if let Some(c) = &self.commit {
            h.put(c.rev);
            h.put(c.collection);
            h.put(c.rkey);
            h.put(c.action.as_str());
        }
        h.put(self.upstream_time.unwrap_or_default());
        h.put(self.rev.unwrap_or_default());
        h.0
    }
}

/// FNV-1a, 64 bits, with a separator between parts.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn put(&mut self, s: &str) {
        for b in s.bytes().chain(std::iter::once(0xff)) {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn json_err(e: &serde_json::Error) -> DecodeError {
    DecodeError::Json { detail: e.to_string() }
}

fn action(op: &str) -> Result<Action, DecodeError> {
    match op {
        "create" => Ok(Action::Create),
        "update" => Ok(Action::Update),
        "delete" => Ok(Action::Delete),
        other => Err(DecodeError::BadValue { field: "operation", detail: format!("unknown operation {other:?}") }),
    }
}

#[derive(Deserialize)]
struct V1Commit<'a> {
    #[serde(borrow)]
    rev: &'a str,
    #[serde(borrow)]
    operation: &'a str,
    #[serde(borrow)]
    collection: &'a str,
    #[serde(borrow)]
    rkey: &'a str,
    #[serde(borrow, default)]
    cid: Option<&'a str>,
    #[serde(default)]
    #[allow(dead_code, reason = "validated as JSON, kept as text in the event")]
    record: Option<IgnoredAny>,
}

/// The upstream event wrapped by identity, account and sync events.
#[derive(Deserialize)]
struct Upstream<'a> {
    #[serde(borrow, default)]
    time: Option<&'a str>,
    #[serde(borrow, default)]
    rev: Option<&'a str>,
}

#[derive(Deserialize)]
struct V1<'a> {
    #[serde(borrow)]
    did: &'a str,
    time_us: u64,
    #[serde(borrow)]
    kind: &'a str,
    #[serde(borrow, default)]
    commit: Option<V1Commit<'a>>,
    #[serde(borrow, default)]
    identity: Option<Upstream<'a>>,
    #[serde(borrow, default)]
    account: Option<Upstream<'a>>,
}

/// Decodes one v1 frame (the decompressed text).
pub fn decode_v1(text: &[u8]) -> Result<Frame<'_>, DecodeError> {
    let s = std::str::from_utf8(text).map_err(|_| DecodeError::Json { detail: "not UTF-8".to_owned() })?;
    let v: V1<'_> = serde_json::from_str(s).map_err(|e| json_err(&e))?;
    let kind = match v.kind {
        "commit" => Kind::Commit,
        "identity" => Kind::Identity,
        "account" => Kind::Account,
        other => return Err(DecodeError::UnknownKind { kind: other.to_owned(), stamp: Some(v.time_us) }),
    };
    let commit = match (kind, v.commit) {
        (Kind::Commit, Some(c)) => {
            Some(Op { rev: c.rev, action: action(c.operation)?, collection: c.collection, rkey: c.rkey, cid: c.cid })
        }
        (Kind::Commit, None) => return Err(DecodeError::MissingField { kind: "commit", field: "commit" }),
        _ => None,
    };
    let upstream = match kind {
        Kind::Identity => v.identity.ok_or(DecodeError::MissingField { kind: "identity", field: "identity" })?.time,
        Kind::Account => v.account.ok_or(DecodeError::MissingField { kind: "account", field: "account" })?.time,
        _ => None,
    };
    Ok(Frame::Message(Message::Jet(
        Event { stamp: v.time_us, did: v.did, kind, commit, rev: None, upstream_time: upstream, json: s, key: 0 }
            .keyed(),
    )))
}

#[derive(Deserialize)]
struct V2Frame<'a> {
    #[serde(rename = "$type", borrow)]
    ty: &'a str,
    #[serde(borrow, default)]
    payload: Option<&'a RawValue>,
    #[serde(borrow, default)]
    error: Option<&'a str>,
    #[serde(borrow, default)]
    message: Option<&'a str>,
}

#[derive(Deserialize)]
struct V2Payload<'a> {
    #[serde(rename = "$type", borrow)]
    ty: &'a str,
    #[serde(borrow, default)]
    did: Option<&'a str>,
    #[serde(borrow, default)]
    time: Option<&'a str>,
    #[serde(borrow, default)]
    rev: Option<&'a str>,
    #[serde(borrow, default)]
    operation: Option<&'a str>,
    #[serde(borrow, default)]
    collection: Option<&'a str>,
    #[serde(borrow, default)]
    rkey: Option<&'a str>,
    #[serde(borrow, default)]
    cid: Option<&'a str>,
    #[serde(default)]
    #[allow(dead_code, reason = "validated as JSON, kept as text in the event")]
    record: Option<IgnoredAny>,
    #[serde(borrow, default)]
    identity: Option<Upstream<'a>>,
    #[serde(borrow, default)]
    account: Option<Upstream<'a>>,
    #[serde(borrow, default)]
    sync: Option<Upstream<'a>>,
    #[serde(borrow, default)]
    name: Option<&'a str>,
    #[serde(borrow, default)]
    message: Option<&'a str>,
}

/// The `$type` prefix of v2 messages.
const V2_NSID: &str = "network.bsky.jetstream.subscribeEvents#";

/// Decodes one v2 frame (the decompressed text).
pub fn decode_v2(text: &[u8]) -> Result<Frame<'_>, DecodeError> {
    let s = std::str::from_utf8(text).map_err(|_| DecodeError::Json { detail: "not UTF-8".to_owned() })?;
    let f: V2Frame<'_> = serde_json::from_str(s).map_err(|e| json_err(&e))?;
    match f.ty {
        "error" => {
            let error = f.error.ok_or(DecodeError::MissingField { kind: "error frame", field: "error" })?;
            return Ok(Frame::Error(ErrorFrame { error, message: f.message }));
        }
        "message" => {}
        other => return Err(DecodeError::UnknownKind { kind: other.to_owned(), stamp: None }),
    }
    let raw = f.payload.ok_or(DecodeError::MissingField { kind: "message frame", field: "payload" })?;
    let json = raw.get();
    let p: V2Payload<'_> = serde_json::from_str(json).map_err(|e| json_err(&e))?;
    let frag = p.ty.strip_prefix(V2_NSID).unwrap_or(p.ty);
    if frag == "info" {
        let name = p.name.ok_or(DecodeError::MissingField { kind: "#info", field: "name" })?;
        return Ok(Frame::Message(Message::Info(Info { name, message: p.message })));
    }
    let stamp = p.time.and_then(stamp_of);
    let kind = match frag {
        "commit" => Kind::Commit,
        "identity" => Kind::Identity,
        "account" => Kind::Account,
        "sync" => Kind::Sync,
        _ => return Err(DecodeError::UnknownKind { kind: p.ty.to_owned(), stamp }),
    };
    let field = |name| DecodeError::MissingField { kind: kind.as_str(), field: name };
    let did = p.did.ok_or_else(|| field("did"))?;
    let time = p.time.ok_or_else(|| field("time"))?;
    let stamp =
        stamp.ok_or_else(|| DecodeError::BadValue { field: "time", detail: format!("not a time: {time:?}") })?;
    let (commit, upstream) = match kind {
        Kind::Commit => {
            let op = Op {
                rev: p.rev.ok_or_else(|| field("rev"))?,
                action: action(p.operation.ok_or_else(|| field("operation"))?)?,
                collection: p.collection.ok_or_else(|| field("collection"))?,
                rkey: p.rkey.ok_or_else(|| field("rkey"))?,
                cid: p.cid,
            };
            (Some(op), None)
        }
        Kind::Identity => (None, Some(p.identity.ok_or_else(|| field("identity"))?)),
        Kind::Account => (None, Some(p.account.ok_or_else(|| field("account"))?)),
        _ => (None, Some(p.sync.ok_or_else(|| field("sync"))?)),
    };
    Ok(Frame::Message(Message::Jet(
        Event {
            stamp,
            did,
            kind,
            commit,
            rev: upstream.as_ref().and_then(|u| u.rev),
            upstream_time: upstream.and_then(|u| u.time),
            json,
            key: 0,
        }
        .keyed(),
    )))
}

/// Decodes a frame of `version`.
pub fn decode(version: Version, text: &[u8]) -> Result<Frame<'_>, DecodeError> {
    match version {
        Version::V1 => decode_v1(text),
        Version::V2 => decode_v2(text),
    }
}

/// An RFC 3339 time as Unix microseconds (`2024-09-09T19:46:02.329308Z`, the form v2
/// sends, parsed without allocating; other forms through the general parser).
#[must_use]
pub fn stamp_of(t: &str) -> Option<u64> {
    fast_stamp(t.as_bytes()).or_else(|| {
        let t = ::time::OffsetDateTime::parse(t, &::time::format_description::well_known::Rfc3339).ok()?;
        u64::try_from(t.unix_timestamp_nanos() / 1000).ok()
    })
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ` exactly.
fn fast_stamp(text: &[u8]) -> Option<u64> {
    let seps = [(4, b'-'), (7, b'-'), (10, b'T'), (13, b':'), (16, b':'), (19, b'.'), (26, b'Z')];
    if text.len() != 27 || seps.iter().any(|&(i, c)| text[i] != c) {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u64> {
        text[r].iter().try_fold(0u64, |acc, &c| c.is_ascii_digit().then(|| acc * 10 + u64::from(c - b'0')))
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second, micros) = (num(11..13)?, num(14..16)?, num(17..19)?, num(20..26)?);
    if hour > 23 || minute > 59 || second > 60 || year < 1970 {
        return None;
    }
    let month = ::time::Month::try_from(u8::try_from(month).ok()?).ok()?;
    let date = ::time::Date::from_calendar_date(i32::try_from(year).ok()?, month, u8::try_from(day).ok()?).ok()?;
    let days = u64::try_from(date.to_julian_day() - 2_440_588).ok()?;
    Some((((days * 24 + hour) * 60 + minute) * 60 + second) * 1_000_000 + micros)
}

/// Formats Unix microseconds as `YYYY-MM-DDTHH:MM:SS.ffffffZ` (v2's `time`).
#[must_use]
pub fn format_stamp(us: u64) -> String {
    let nanos = i128::from(us) * 1000;
    ::time::OffsetDateTime::from_unix_timestamp_nanos(nanos).map_or_else(
        |_| us.to_string(),
        |t| {
            format!(
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
                t.year(),
                u8::from(t.month()),
                t.day(),
                t.hour(),
                t.minute(),
                t.second(),
                t.microsecond()
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1_COMMIT: &str = r#"{"did":"did:plc:eygmaihciaxprqvxpfvl6flk","time_us":1725911162329308,"kind":"commit","commit":{"rev":"3l3qo2vutsw2b","operation":"create","collection":"app.bsky.feed.like","rkey":"3l3qo2vuowo2b","record":{"$type":"app.bsky.feed.like","createdAt":"2024-09-09T19:46:02.102Z","subject":{"cid":"bafyreidc6sydkkbchcyg62v77wbhzvb2mvytlmsychqgwf2xojjtirmzj4","uri":"at://did:plc:wa7b35aakoll7hugkrjtf3xf/app.bsky.feed.post/3l3pte3p2e325"}},"cid":"bafyreidwaivazkwu67xztlmuobx35hs2lnfh3kolmgfmucldvhd3sgzcqi"}}"#;

    #[test]
    fn a_v1_commit_decodes_with_its_op_and_its_text() {
        let Frame::Message(Message::Jet(e)) = decode_v1(V1_COMMIT.as_bytes()).expect("decodes") else {
            panic!("not an event")
        };
        assert_eq!(e.stamp, 1_725_911_162_329_308);
        assert_eq!(e.did, "did:plc:eygmaihciaxprqvxpfvl6flk");
        assert_eq!(e.kind, Kind::Commit);
        let op = e.commit.expect("op");
        assert_eq!((op.rev, op.collection, op.rkey), ("3l3qo2vutsw2b", "app.bsky.feed.like", "3l3qo2vuowo2b"));
        assert_eq!(op.action, Action::Create);
        assert_eq!(e.json, V1_COMMIT);
    }

    #[test]
    fn a_v2_commit_and_its_error_and_info_frames_decode() {
        let f = r#"{"$type":"message","payload":{"$type":"network.bsky.jetstream.subscribeEvents#commit","seq":12345,"did":"did:plc:a","time":"2024-09-09T19:46:02.329308Z","rev":"3l3qo2vutsw2b","operation":"delete","collection":"app.bsky.feed.like","rkey":"3l3"}}"#;
        let Frame::Message(Message::Jet(e)) = decode_v2(f.as_bytes()).expect("decodes") else { panic!("not an event") };
        assert_eq!(e.stamp, 1_725_911_162_329_308);
        assert!(e.json.starts_with(r#"{"$type":"network.bsky.jetstream.subscribeEvents#commit""#));
        assert_eq!(e.commit.expect("op").action, Action::Delete);
        let err = r#"{"$type":"error","error":"ConsumerTooSlow","message":"slow"}"#;
        assert!(matches!(decode_v2(err.as_bytes()), Ok(Frame::Error(ErrorFrame { error: "ConsumerTooSlow", .. }))));
        let info = r#"{"$type":"message","payload":{"$type":"network.bsky.jetstream.subscribeEvents#info","name":"OutdatedCursor","message":"m"}}"#;
        assert!(matches!(
            decode_v2(info.as_bytes()),
            Ok(Frame::Message(Message::Info(Info { name: "OutdatedCursor", .. })))
        ));
    }

    #[test]
    fn bad_frames_are_typed_errors() {
        assert!(matches!(decode_v1(b"{not json"), Err(DecodeError::Json { .. })));
        let unknown = r#"{"did":"did:plc:a","time_us":1725911162329308,"kind":"labels"}"#;
        assert!(matches!(
            decode_v1(unknown.as_bytes()),
            Err(DecodeError::UnknownKind { stamp: Some(1_725_911_162_329_308), .. })
        ));
        let no_op = r#"{"did":"did:plc:a","time_us":1,"kind":"commit"}"#;
        assert!(matches!(decode_v1(no_op.as_bytes()), Err(DecodeError::MissingField { .. })));
        let bad_action = r#"{"did":"d","time_us":1,"kind":"commit","commit":{"rev":"r","operation":"x","collection":"c","rkey":"k"}}"#;
        assert!(matches!(decode_v1(bad_action.as_bytes()), Err(DecodeError::BadValue { .. })));
        let escaped = r#"{"did":"did:plc:\u0061","time_us":1,"kind":"identity","identity":{}}"#;
        assert!(matches!(decode_v1(escaped.as_bytes()), Err(DecodeError::Json { .. })));
        assert!(matches!(decode_v2(br#"{"$type":"message"}"#), Err(DecodeError::MissingField { .. })));
    }

    #[test]
    fn stamps_round_trip_through_their_text() {
        for us in [0, 1, 1_725_911_162_329_308, 1_765_000_000_000_001] {
            assert_eq!(stamp_of(&format_stamp(us)), Some(us));
        }
        assert_eq!(stamp_of("2024-09-09T19:46:02.329308+00:00"), Some(1_725_911_162_329_308));
        assert_eq!(stamp_of("yesterday"), None);
    }

    #[test]
    fn the_content_key_names_an_op_not_its_commit() {
        let a = r#"{"did":"d","time_us":1,"kind":"commit","commit":{"rev":"r","operation":"create","collection":"c","rkey":"a"}}"#;
        let b = r#"{"did":"d","time_us":2,"kind":"commit","commit":{"rev":"r","operation":"create","collection":"c","rkey":"b"}}"#;
        let a2 = r#"{"did":"d","time_us":9,"kind":"commit","commit":{"rev":"r","operation":"create","collection":"c","rkey":"a"}}"#;
        let key = |s: &str| match decode_v1(s.as_bytes()) {
            Ok(Frame::Message(Message::Jet(e))) => e.content_key(),
            _ => panic!("decodes"),
        };
        assert_ne!(key(a), key(b));
        assert_eq!(key(a), key(a2), "another instance's stamp does not change what the event is");
    }
}
