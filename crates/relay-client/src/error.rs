//! Typed errors for every way a relay, a frame or a URL can be wrong.

use std::time::Duration;

/// A violation of DAG-CBOR, with the byte offset where it was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CborError {
    /// The input ended inside an item.
    #[error("truncated CBOR at byte {at}")]
    Truncated {
        /// Byte offset.
        at: usize,
    },
    /// Bytes were left after the last item.
    #[error("trailing bytes after CBOR at byte {at}")]
    TrailingBytes {
        /// Byte offset.
        at: usize,
    },
    /// An integer or length used a longer head than needed.
    #[error("non-minimal CBOR integer or length at byte {at}")]
    NonMinimal {
        /// Byte offset.
        at: usize,
    },
    /// Indefinite-length items are not DAG-CBOR.
    #[error("indefinite-length CBOR item at byte {at}")]
    Indefinite {
        /// Byte offset.
        at: usize,
    },
    /// Additional-information values 28–30 are reserved.
    #[error("reserved CBOR initial byte {byte:#04x} at byte {at}")]
    Reserved {
        /// Byte offset.
        at: usize,
        /// The initial byte.
        byte: u8,
    },
    /// A different kind of item was expected here.
    #[error("expected {expected} at byte {at}")]
    Unexpected {
        /// Byte offset.
        at: usize,
        /// What the schema wants.
        expected: &'static str,
    },
    /// An integer does not fit the field.
    #[error("integer out of range at byte {at}")]
    IntegerRange {
        /// Byte offset.
        at: usize,
    },
    /// A text string is not UTF-8.
    #[error("invalid UTF-8 in text string at byte {at}")]
    InvalidUtf8 {
        /// Byte offset.
        at: usize,
    },
    /// Map keys must be text strings.
    #[error("non-text map key at byte {at}")]
    NonTextKey {
        /// Byte offset.
        at: usize,
    },
    /// Map keys must be sorted length-first then bytewise, without duplicates.
    #[error("map keys out of canonical order or duplicated at byte {at}")]
    KeyOrder {
        /// Byte offset.
        at: usize,
    },
    /// Only tag 42 (CID) exists in DAG-CBOR.
    #[error("tag {tag} at byte {at}: only tag 42 is allowed")]
    ForeignTag {
        /// Byte offset.
        at: usize,
        /// The tag found.
        tag: u64,
    },
    /// A tag-42 byte string must start with the 0x00 multibase prefix.
    #[error("CID link without 0x00 prefix at byte {at}")]
    BadLinkPrefix {
        /// Byte offset.
        at: usize,
    },
    /// A tag-42 payload is not a valid atproto CID.
    #[error("invalid CID in link at byte {at}")]
    BadLink {
        /// Byte offset.
        at: usize,
    },
    /// Floats must be finite 64-bit values and not -0.0.
    #[error("float not allowed in DAG-CBOR at byte {at}")]
    BadFloat {
        /// Byte offset.
        at: usize,
    },
    /// `undefined` and other simple values are not DAG-CBOR.
    #[error("simple value not allowed in DAG-CBOR at byte {at}")]
    BadSimple {
        /// Byte offset.
        at: usize,
    },
    /// Nesting deeper than [`crate::cbor::MAX_DEPTH`].
    #[error("CBOR nested too deeply at byte {at}")]
    TooDeep {
        /// Byte offset.
        at: usize,
    },
}

/// A CID that is not one atproto accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CidError {
    /// A varint was too long or not minimal.
    #[error("bad varint in CID")]
    Varint,
    /// Only `CIDv1` is used by atproto.
    #[error("CID version {0} is not 1")]
    Version(u64),
    /// Only dag-cbor and raw codecs are used by atproto.
    #[error("CID codec {0:#x} is not dag-cbor or raw")]
    Codec(u64),
    /// Only sha2-256 is used by atproto.
    #[error("CID hash {0:#x} is not sha2-256")]
    Hash(u64),
    /// sha2-256 digests are 32 bytes.
    #[error("CID digest length {0} is not 32")]
    DigestLength(u64),
    /// The CID ended early.
    #[error("truncated CID")]
    Truncated,
    /// Bytes follow a CID that should stand alone.
    #[error("bytes after CID")]
    TrailingBytes,
}

/// Why a frame could not be decoded. The stream goes on; the frame is counted and logged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The header or body is not valid DAG-CBOR.
    #[error("invalid DAG-CBOR in {part}: {source}")]
    Cbor {
        /// `header`, `body`, `record` or `car header`.
        part: &'static str,
        /// The violation.
        #[source]
        source: CborError,
    },
    /// A required field is absent.
    #[error("{kind} is missing field `{field}`")]
    MissingField {
        /// The message type.
        kind: &'static str,
        /// The field.
        field: &'static str,
    },
    /// The header's `op` is neither 1 nor -1.
    #[error("unknown frame op {0}")]
    UnknownOp(i64),
    /// A message frame without `t`.
    #[error("message frame without type `t`")]
    MissingType,
    /// A CID is malformed.
    #[error("invalid CID in {field}: {source}")]
    Cid {
        /// Where the CID was.
        field: &'static str,
        /// What is wrong with it.
        #[source]
        source: CidError,
    },
    /// The `blocks` CAR slice is malformed.
    #[error("invalid CAR in blocks: {0}")]
    Car(String),
    /// A block of the CAR does not hash to its CID (with block checking on).
    #[error("CAR block {0} does not hash to its CID")]
    BlockHash(String),
    /// A create or update op names a CID that is not in `blocks`.
    #[error("record block {cid} for `{path}` is missing from the CAR")]
    MissingBlock {
        /// The repo path of the op.
        path: String,
        /// The CID string.
        cid: String,
    },
    /// A field has a value outside its domain (e.g. a negative seq, an unknown action).
    #[error("bad value for {field}: {detail}")]
    BadValue {
        /// The field.
        field: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The message exceeds the maximum frame size.
    #[error("frame of {size} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Size seen (or a lower bound of it).
        size: usize,
        /// The configured limit.
        max: usize,
    },
    /// A text WebSocket message: the firehose is binary only.
    #[error("text WebSocket message ({len} bytes) where a binary frame was expected")]
    TextMessage {
        /// Length of the text.
        len: usize,
    },
}

impl DecodeError {
    /// A short stable label for metrics (`reason` label).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Cbor { .. } => "cbor",
            Self::MissingField { .. } => "missing_field",
            Self::UnknownOp(_) => "unknown_op",
            Self::MissingType => "missing_type",
            Self::Cid { .. } => "cid",
            Self::Car(_) | Self::BlockHash(_) => "car",
            Self::MissingBlock { .. } => "missing_block",
            Self::BadValue { .. } => "bad_value",
            Self::TooLarge { .. } => "too_large",
            Self::TextMessage { .. } => "text_message",
        }
    }
}

/// A relay URL that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not a URL at all. The input is not echoed: it may hold credentials.
    #[error("relay URL does not parse: {0}")]
    Parse(url::ParseError),
    /// Only `ws` and `wss` are subscribed to.
    #[error("relay URL scheme `{0}` is not ws or wss")]
    Scheme(String),
    /// A URL without a host.
    #[error("relay URL has no host")]
    NoHost,
    /// A query or fragment would be clobbered by the cursor parameter.
    #[error("relay URL must not carry a query or fragment")]
    QueryOrFragment,
}

/// Why a subscription stopped for good (as opposed to reconnecting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    /// The relay says our cursor is ahead of its sequence: it probably lost data or is a
    /// different relay. Going live silently would skip events, so the caller decides.
    #[error("{relay} relay rejected cursor {cursor:?} as FutureCursor: {message}")]
    FutureCursor {
        /// Which relay.
        relay: crate::RelayRole,
        /// The cursor sent.
        cursor: Option<u64>,
        /// The relay's message.
        message: String,
    },
    /// A frame carrying seq `seq` could not be decoded and the policy is
    /// [`BadFramePolicy::Fail`](crate::client::BadFramePolicy): the cursor must not move
    /// past an event nobody processed, so the subscription stops at the frame before it.
    #[error(
        "{relay} relay sent seq {seq} that cannot be decoded ({error}); under the `fail` bad-frame policy the \
         cursor stays before it (the `skip` policy steps over such frames; or move the cursor past seq {seq})"
    )]
    BadFrame {
        /// Which relay.
        relay: crate::RelayRole,
        /// The seq of the undecodable frame.
        seq: u64,
        /// What was wrong with it.
        error: DecodeError,
    },
    /// The frame after `after` is larger than the frame limit. Under the fail policy, or
    /// when even the raised limit could not read its seq, the subscription stops there.
    #[error(
        "{relay} relay sent a frame after seq {after:?} larger than the {max}-byte frame limit; the cursor stays \
         before it (raise the limit, or use the `skip` bad-frame policy)"
    )]
    FrameTooLarge {
        /// Which relay.
        relay: crate::RelayRole,
        /// The last seq delivered before it.
        after: Option<u64>,
        /// The limit it exceeded.
        max: usize,
    },
    /// The subscription was closed by the caller.
    #[error("subscription closed")]
    Closed,
}

/// Why one connection ended; the client reconnects after each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnError {
    /// TCP/TLS/WebSocket handshake did not finish in time.
    #[error("connect timed out after {0:?}")]
    ConnectTimeout(Duration),
    /// The handshake failed.
    #[error("connect failed: {0}")]
    Connect(String),
    /// No data frame arrived for the stall timeout.
    #[error("no frame for {0:?}")]
    Stalled(Duration),
    /// A ping went unanswered.
    #[error("no pong within {0:?}")]
    PongTimeout(Duration),
    /// The relay closed the connection.
    #[error("relay closed the connection")]
    ClosedByRelay,
    /// A read or write failed.
    #[error("websocket error: {0}")]
    Io(String),
    /// A message exceeded the maximum frame size; the socket is unusable after that.
    #[error("message over the {0}-byte frame limit")]
    TooLarge(usize),
    /// The relay sent an error frame that means "reconnect" (e.g. `ConsumerTooSlow`).
    #[error("relay error frame {error}: {message}")]
    ErrorFrame {
        /// The error name.
        error: String,
        /// The message.
        message: String,
    },
}

impl ConnError {
    /// A short stable label for metrics (`reason` label).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ConnectTimeout(_) => "connect_timeout",
            Self::Connect(_) => "connect_failed",
            Self::Stalled(_) => "stalled",
            Self::PongTimeout(_) => "pong_timeout",
            Self::ClosedByRelay => "closed_by_relay",
            Self::Io(_) => "io",
            Self::TooLarge(_) => "too_large",
            Self::ErrorFrame { error, .. } if error == "ConsumerTooSlow" => "consumer_too_slow",
            Self::ErrorFrame { .. } => "error_frame",
        }
    }
}
