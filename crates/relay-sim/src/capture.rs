//! Capture files: the format lives in [`relay_client::capture`]; this adds what only a
//! simulator needs.

use bytes::Bytes;

pub use relay_client::capture::{CaptureError, parse, read, write_frame};

/// The capture repeated `times` times, renumbered so seq keeps increasing (1, 2, 3, …
/// across copies): a longer stream for soak, chaos and throughput runs.
#[must_use]
pub fn repeat(frames: &[Bytes], times: usize) -> Vec<Bytes> {
    let mut out = Vec::with_capacity(frames.len() * times);
    let mut seq = 0u64;
    for _ in 0..times {
        for f in frames {
            if crate::frame_seq(f).is_some() {
                seq += 1;
                out.push(crate::with_seq(f, seq).unwrap_or_else(|| f.clone()));
            } else {
                out.push(f.clone());
            }
        }
    }
    out
}
