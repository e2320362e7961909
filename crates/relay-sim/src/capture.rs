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
/// switching relies on. Revs (TIDs, a clock of their own) move a day per copy too, in
/// the event and its blocks alike: a repo's revs keep increasing, as a real repo's do, so
/// no copy is taken for a replay of the one before.
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
        let days = u64::try_from(k).unwrap_or(0);
        for f in frames {
            let mut b = replace_all(f, date.as_bytes(), day.as_bytes());
            for (old, new) in revs_of(f).into_iter().filter_map(|r| Some((r.clone(), shift_tid(&r, days)?))) {
                b = replace_all(&b, old.as_bytes(), new.as_bytes());
            }
            out.push(Bytes::from(b));
        }
    }
    repeat(&out, 1)
}

/// [`repeat`], each copy with repos of its own: in copy `k` every `did:plc:` identifier
/// ends in `k` (five base32 characters, same length, so the frame stays valid CBOR), so a
/// long replay meets as many distinct repos as a real relay does and per-repo state
/// grows with it. Seqs are renumbered from 1. Block CIDs no longer match their blocks:
/// for runs without verification.
#[must_use]
pub fn repeat_as_new_repos(frames: &[Bytes], times: usize) -> Vec<Bytes> {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    const PREFIX: &[u8] = b"did:plc:";
    let mut out = Vec::with_capacity(frames.len() * times);
    let mut seq = 0u64;
    for k in 0..times {
        let mut tag = [0u8; 5];
        let mut x = k;
        for t in tag.iter_mut().rev() {
            *t = ALPHABET[x % 32];
            x /= 32;
        }
        for f in frames {
            let mut b = f.to_vec();
            let mut i = 0;
            while i + PREFIX.len() + 24 <= b.len() {
                if &b[i..i + PREFIX.len()] == PREFIX {
                    let id = i + PREFIX.len();
                    if b[id..id + 24].iter().all(|c| ALPHABET.contains(c)) {
                        b[id + 19..id + 24].copy_from_slice(&tag);
                    }
                    i = id + 24;
                } else {
                    i += 1;
                }
            }
            let b = Bytes::from(b);
            if crate::frame_seq(&b).is_some() {
                seq += 1;
                out.push(crate::with_seq(&b, seq).unwrap_or(b));
            } else {
                out.push(b);
            }
        }
    }
    out
}

/// The revs a frame names (a commit's rev and since, a sync's rev).
fn revs_of(f: &[u8]) -> Vec<String> {
    match relay_client::decode(f) {
        Ok(relay_client::Frame::Message(relay_client::Message::Commit(c))) => {
            std::iter::once(c.rev).chain(c.since).map(str::to_owned).collect()
        }
        Ok(relay_client::Frame::Message(relay_client::Message::Sync(s))) => vec![s.rev.to_owned()],
        _ => Vec::new(),
    }
}

/// The TID alphabet (base32, sortable).
const TID_ALPHABET: &[u8; 32] = b"234567abcdefghijklmnopqrstuvwxyz";

/// `tid` moved `days` later (its microseconds), same width; `None` if it is not a TID.
fn shift_tid(tid: &str, days: u64) -> Option<String> {
    if tid.len() != 13 {
        return None;
    }
    let mut v: u64 = 0;
    for c in tid.bytes() {
        let d = TID_ALPHABET.iter().position(|a| *a == c)?;
        v = v.checked_mul(32)? + d as u64;
    }
    let v = v.checked_add(days.checked_mul(86_400_000_000)?.checked_shl(10)?)?;
    let mut out = [0u8; 13];
    let mut x = v;
    for o in out.iter_mut().rev() {
        *o = TID_ALPHABET[(x % 32) as usize];
        x /= 32;
    }
    String::from_utf8(out.to_vec()).ok()
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
