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

/// [`repeat`], with each copy's dates moved one day later than the previous copy's (every
/// `YYYY-MM-DDT` of the copy's date, event times and record timestamps alike), so relay
/// time keeps increasing across copies as on a real relay — what time-based relay
/// switching relies on. A copy's events repeat the first copy's (repo, rev) pairs, but a
/// day apart: they are never taken for one another within a switch overlap.
#[must_use]
pub fn repeat_in_time(frames: &[Bytes], times: usize) -> Vec<Bytes> {
    let date = frames.iter().find_map(|f| match relay_client::decode(f).ok()? {
        relay_client::Frame::Message(m) => m.time().and_then(|t| t.get(..11)).map(str::to_owned),
        relay_client::Frame::Error(_) => None,
    });
    let Some(date) = date else { return repeat(frames, times) };
    let format = time::macros::format_description!("[year]-[month]-[day]T");
    let Ok(first) = time::Date::parse(&date, &format) else { return repeat(frames, times) };
    let mut out = Vec::with_capacity(frames.len() * times);
    for k in 0..times {
        let day = first
            .checked_add(time::Duration::days(i64::try_from(k).unwrap_or(i64::MAX)))
            .and_then(|d| d.format(&format).ok());
        let day = day.unwrap_or_else(|| date.clone());
        for f in frames {
            out.push(Bytes::from(replace_all(f, date.as_bytes(), day.as_bytes())));
        }
    }
    repeat(&out, 1)
}

/// `hay` with every `from` replaced by `to` (same length).
fn replace_all(hay: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    debug_assert_eq!(from.len(), to.len());
    let mut out = hay.to_vec();
    let mut i = 0;
    while i + from.len() <= out.len() {
        if &out[i..i + from.len()] == from {
            out[i..i + from.len()].copy_from_slice(to);
            i += from.len();
        } else {
            i += 1;
        }
    }
    out
}
