//! Typed errors for every way DAG-CBOR, a CID, a CAR or a firehose frame can be wrong.

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
    /// A Jetstream frame that is not the JSON it should be.
    #[error("invalid Jetstream JSON: {detail}")]
    Json {
        /// What the parser said.
        detail: String,
    },
    /// A Jetstream event of a kind this version does not know.
    #[error("unknown Jetstream event kind {kind:?}")]
    UnknownKind {
        /// The kind (v1) or `$type` (v2).
        kind: String,
        /// Its stamp, when it had one.
        stamp: Option<u64>,
    },
    /// A compressed Jetstream frame that does not decompress with the dictionary.
    #[error("zstd frame does not decompress: {detail}")]
    Zstd {
        /// What the decompressor said.
        detail: String,
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
            Self::Json { .. } => "json",
            Self::UnknownKind { .. } => "unknown_kind",
            Self::Zstd { .. } => "zstd",
        }
    }
}
