//! Capture files (what `firekeeper capture` writes and relay-sim replays): `[u32 big-endian length][message bytes]` repeated, one entry per
//! binary WebSocket message in the order the relay sent them.

use std::io::{self, Read, Write};
use std::path::Path;

pub use bytes::Bytes;

/// Why a capture file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The file could not be read.
    #[error("reading capture: {0}")]
    Io(#[from] io::Error),
    /// The file ends inside an entry.
    #[error("capture truncated at byte {at}: entry of {len} bytes runs past the end")]
    Truncated {
        /// Offset of the entry's length prefix.
        at: usize,
        /// The declared length.
        len: usize,
    },
}

/// Splits capture bytes into messages.
pub fn parse(raw: &[u8]) -> Result<Vec<Bytes>, CaptureError> {
    let raw = Bytes::copy_from_slice(raw);
    let mut out = Vec::new();
    let mut at = 0;
    while at < raw.len() {
        let len_bytes: [u8; 4] =
            raw.get(at..at + 4).and_then(|s| s.try_into().ok()).ok_or(CaptureError::Truncated { at, len: 4 })?;
        let len = u32::from_be_bytes(len_bytes) as usize;
        let end = at + 4 + len;
        if end > raw.len() {
            return Err(CaptureError::Truncated { at, len });
        }
        out.push(raw.slice(at + 4..end));
        at = end;
    }
    Ok(out)
}

/// Reads a capture file.
pub fn read(path: &Path) -> Result<Vec<Bytes>, CaptureError> {
    let mut f = std::fs::File::open(path)?;
    let mut raw = Vec::new();
    f.read_to_end(&mut raw)?;
    parse(&raw)
}

/// Appends one message to a capture stream.
pub fn write_frame(w: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    let len =
        u32::try_from(frame.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    w.write_all(&len.to_be_bytes())?;
    w.write_all(frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_truncation() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"abc").expect("write");
        write_frame(&mut buf, b"").expect("write");
        let frames = parse(&buf).expect("parse");
        assert_eq!(frames, vec![Bytes::from_static(b"abc"), Bytes::new()]);
        assert!(matches!(parse(&buf[..5]), Err(CaptureError::Truncated { at: 0, len: 3 })));
        assert!(matches!(parse(&buf[..2]), Err(CaptureError::Truncated { at: 0, .. })));
    }
}
