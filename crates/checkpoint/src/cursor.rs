//! The stored cursor form and the outcomes of reads and commits.

/// The largest cursor stored (the relay client's largest seq, 2^53-1): exact in every
/// JSON/JavaScript consumer and in Lua's doubles.
pub use atproto_data::MAX_SEQ;

/// The token of a lease holder value `<instance>:<token>`; a malformed value is a caller
/// bug, reported as a protocol error rather than a guess.
pub fn holder_token(holder: &str) -> Result<u64, StoreError> {
    holder
        .rsplit_once(':')
        .and_then(|(_, t)| t.parse().ok())
        .ok_or_else(|| StoreError::Protocol(format!("lease holder {holder:?} is not <instance>:<token>")))
}

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// A valid cursor.
    Found(u64),
    /// Nothing stored for this relay.
    Missing,
    /// Something that is not a cursor: never taken for missing (a leader refuses to start
    /// on it and names the key). Holds a short, escaped preview of the value (never more
    /// than 32 characters).
    Corrupt(String),
}

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitOutcome {
    /// The cursor was stored.
    Saved,
    /// A cursor at or beyond this one was already stored; nothing changed.
    NotNewer {
        /// The stored value.
        stored: u64,
    },
    /// The committer's token is not the lease's: it is no longer (or never was) the
    /// leader. Never retry under the same term.
    Fenced {
        /// The token the store currently honours, if known.
        current: Option<u64>,
    },
}

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached, timed out, or refused. Fail closed: never start a
    /// subscription on an unknown cursor.
    #[error("cursor store unavailable: {}", causes::Report(.0.as_ref()))]
    Unavailable(#[source] causes::Cause),
    /// The store answered something no script returns.
    #[error("cursor store answered nonsense: {0}")]
    Protocol(String),
    /// A cursor out of range was passed in.
    #[error("cursor {0} is above 2^53-1")]
    OutOfRange(u64),
    /// `DATABASE_URL` cannot be a Postgres connection string.
    #[error("DATABASE_URL is not a Postgres connection string: {}", causes::Report(.0.as_ref()))]
    InvalidUrl(#[source] causes::Cause),
    /// A legacy host-keyed cursor exists for a relay URL with a path, where the host key
    /// cannot tell which path it belonged to.
    #[error(
        "a legacy cursor key exists for host {host}, but this relay URL has a path, so it is ambiguous; \
         set this relay's cursor explicitly and delete the legacy key"
    )]
    LegacyAmbiguous {
        /// The host (with port) the legacy key is named after.
        host: String,
    },
}

/// Parses a stored cursor: a decimal non-negative integer ≤ 2^53-1, no sign, no leading
/// zeros; surrounding whitespace (an editor's newline) is not part of it.
#[must_use]
pub fn parse(raw: &[u8]) -> Option<u64> {
    let raw = raw.trim_ascii();
    let ok =
        !raw.is_empty() && raw.len() <= 16 && raw.iter().all(u8::is_ascii_digit) && (raw == b"0" || raw[0] != b'0');
    if !ok {
        return None;
    }
    std::str::from_utf8(raw).ok()?.parse::<u64>().ok().filter(|&v| v <= MAX_SEQ)
}

/// Classifies a raw stored value.
#[must_use]
pub fn classify(raw: Option<&[u8]>) -> ReadOutcome {
    match raw {
        None => ReadOutcome::Missing,
        Some(b) => parse(b).map_or_else(|| ReadOutcome::Corrupt(preview(b)), ReadOutcome::Found),
    }
}

/// A short escaped preview of a bad value, safe for a log line.
#[must_use]
pub fn preview(b: &[u8]) -> String {
    let s: String = b.iter().take(24).flat_map(|&c| std::ascii::escape_default(c)).map(char::from).collect();
    if b.len() > 24 { format!("{s}… ({} bytes)", b.len()) } else { s }
}

/// Fails for cursors above [`MAX_SEQ`].
pub fn check(cursor: u64) -> Result<(), StoreError> {
    if cursor > MAX_SEQ { Err(StoreError::OutOfRange(cursor)) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_canonical_decimals_in_range_are_cursors() {
        assert_eq!(parse(b"0"), Some(0));
        assert_eq!(parse(b"9007199254740991"), Some(MAX_SEQ));
        assert_eq!(parse(b"120\n"), Some(120), "an editor's newline is not corruption");
        assert_eq!(parse(b" \t7\r\n"), Some(7));
        for bad in [
            &b""[..],
            b" ",
            b"-1",
            b"01",
            b"1 2",
            b"1e3",
            b"9007199254740992",
            b"99999999999999999999",
            b"0x10",
            b"\xff",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(classify(Some(b"12")), ReadOutcome::Found(12));
        assert_eq!(classify(None), ReadOutcome::Missing);
        assert!(matches!(classify(Some(&[b'x'; 100])), ReadOutcome::Corrupt(p) if p.contains("100 bytes")));
    }
}
