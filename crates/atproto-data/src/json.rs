//! DAG-CBOR to the atproto JSON data model, written straight into a `String`: CIDs become
//! `{"$link": "b…"}`, byte strings `{"$bytes": "<base64>"}`, map order is kept.
//! Also the one-line JSON form of a whole frame that the sinks and the fixture use.

use std::fmt::Write as _;

use crate::car::Car;
use crate::cbor::{Item, MAX_DEPTH, Reader};
use crate::cid::{Cid, base64_std};
use crate::error::DecodeError;
use crate::frame::{Frame, Message, Record};

impl Record<'_> {
    /// Appends the record in the atproto JSON data model.
    pub fn write_json(&self, out: &mut String) {
        write_cbor_as_json(self.as_bytes(), out);
    }
}

/// What each byte becomes inside a JSON string: 0 kept as is, `u` as `\u00XX`, else
/// the letter after a backslash. Only control characters, `"` and `\` are escaped.
static ESCAPE: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut i = 0;
    while i < 0x20 {
        t[i] = b'u';
        i += 1;
    }
    t[b'\n' as usize] = b'n';
    t[b'\r' as usize] = b'r';
    t[b'\t' as usize] = b't';
    t[0x08] = b'b';
    t[0x0c] = b'f';
    t[b'"' as usize] = b'"';
    t[b'\\' as usize] = b'\\';
    t
};

/// True when one of the eight bytes of `w` needs escaping: a control character, `"`
/// or `\` (exact, no false positives: the classic "has zero byte" test per pattern).
#[inline]
fn word_needs_escape(w: u64) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |v: u64, n: u64| v.wrapping_sub(ONES * n) & !v & HIGH;
    (below(w, 0x20) | below(w ^ (ONES * u64::from(b'"')), 1) | below(w ^ (ONES * u64::from(b'\\')), 1)) != 0
}

/// Appends `s` as a JSON string literal, escaped the way `JSON.stringify` does. Clean
/// runs are found eight bytes at a time and copied whole.
pub fn write_str(s: &str, out: &mut String) {
    out.reserve(s.len() + 2);
    out.push('"');
    let bytes = s.as_bytes();
    let (mut start, mut i) = (0, 0);
    while i < bytes.len() {
        if let Some(w) = bytes.get(i..i + 8) {
            let w = u64::from_le_bytes(w.try_into().unwrap_or_default());
            if !word_needs_escape(w) {
                i += 8;
                continue;
            }
        }
        let b = bytes[i];
        let esc = ESCAPE[usize::from(b)];
        if esc != 0 {
            out.push_str(&s[start..i]);
            if esc == b'u' {
                let _ = write!(out, "\\u{b:04x}");
            } else {
                out.push('\\');
                out.push(char::from(esc));
            }
            start = i + 1;
        }
        i += 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

fn write_link(cid: &[u8], out: &mut String) {
    out.push_str("{\"$link\":\"");
    out.push('b');
    crate::cid::base32_lower(cid, out);
    out.push_str("\"}");
}

/// Appends a whole DAG-CBOR item as JSON. The input must already have been validated
/// (e.g. by [`crate::frame::Record::new`]); invalid input writes `null` in its place.
pub fn write_cbor_as_json(cbor: &[u8], out: &mut String) {
    let mut r = Reader::new(cbor);
    if write_item(&mut r, out, 0).is_none() {
        out.push_str("null");
    }
}

fn write_item(r: &mut Reader<'_>, out: &mut String, depth: u32) -> Option<()> {
    if depth > MAX_DEPTH {
        return None;
    }
    match r.item().ok()? {
        Item::Int(v) => {
            let _ = write!(out, "{v}");
        }
        Item::Float(f) => {
            let _ = write!(out, "{f}");
        }
        Item::Bool(b) => out.push_str(if b { "true" } else { "false" }),
        Item::Null => out.push_str("null"),
        Item::Text(s) => write_str(s, out),
        Item::Bytes(b) => {
            out.push_str("{\"$bytes\":\"");
            base64_std(b, out);
            out.push_str("\"}");
        }
        Item::Link(c) => write_link(c, out),
        Item::Array(n) => {
            out.push('[');
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                write_item(r, out, depth + 1)?;
            }
            out.push(']');
        }
        Item::Map(n) => {
            out.push('{');
            let mut prev = None;
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                let k = r.key(prev).ok()?;
                prev = Some(k);
                write_str(k, out);
                out.push(':');
                write_item(r, out, depth + 1)?;
            }
            out.push('}');
        }
    }
    Some(())
}

fn field_str(out: &mut String, name: &str, v: &str) {
    out.push_str(",\"");
    out.push_str(name);
    out.push_str("\":");
    write_str(v, out);
}

fn field_opt_str(out: &mut String, name: &str, v: Option<&str>) {
    if let Some(v) = v {
        field_str(out, name, v);
    } else {
        out.push_str(",\"");
        out.push_str(name);
        out.push_str("\":null");
    }
}

fn opt_cid(out: &mut String, c: Option<Cid<'_>>) {
    match c {
        Some(c) => {
            out.push('"');
            c.write_str(out);
            out.push('"');
        }
        None => out.push_str("null"),
    }
}

/// How [`write_frame_with`] treats ops and records.
#[derive(Default)]
pub struct FrameOptions<'f> {
    /// Check every CAR block's sha2-256 against its CID.
    pub verify_blocks: bool,
    /// Keep only ops this accepts (collection filters); `None` keeps all.
    pub keep_op: Option<&'f dyn Fn(&crate::frame::RepoOp<'_>) -> bool>,
    /// Write `"record":null,"recordError":"<reason>"` for a bad record instead of failing
    /// the frame (one bad record must not hold back the stream).
    pub lossy_records: bool,
}

/// What [`write_frame_with`] wrote.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Ops written.
    pub ops: usize,
    /// Ops dropped by the filter.
    pub filtered: usize,
    /// Records replaced by null because they could not be decoded.
    pub record_errors: usize,
}

/// Appends the one-line JSON form of a frame, records included (the shape of the
/// fixture's `pds-capture.expected.jsonl`). Fails only on record problems (a missing
/// block, an invalid record or CAR); then nothing meaningful was written.
pub fn write_frame(frame: &Frame<'_>, verify_blocks: bool, out: &mut String) -> Result<(), DecodeError> {
    write_frame_with(frame, &FrameOptions { verify_blocks, ..FrameOptions::default() }, out).map(|_| ())
}

/// [`write_frame`] with filtering and lossy record handling.
pub fn write_frame_with(frame: &Frame<'_>, opts: &FrameOptions<'_>, out: &mut String) -> Result<Written, DecodeError> {
    match frame {
        Frame::Error(e) => {
            out.push_str("{\"op\":-1");
            field_str(out, "error", e.error);
            field_opt_str(out, "message", e.message);
            out.push('}');
            Ok(Written::default())
        }
        Frame::Message(m) => write_message_with(m, opts, out),
    }
}

/// Appends the one-line JSON form of a message (an `op = 1` frame); see [`write_frame_with`].
pub fn write_message_with(m: &Message<'_>, opts: &FrameOptions<'_>, out: &mut String) -> Result<Written, DecodeError> {
    let mut written = Written::default();
    if let Message::Jet(j) = m {
        // Jetstream's own JSON, as received.
        out.push_str(j.json);
        return Ok(written);
    }
    out.push('{');
    if let Some(seq) = m.seq() {
        let _ = write!(out, "\"seq\":{seq},");
    }
    out.push_str("\"type\":");
    write_str(m.type_name(), out);
    out.push_str(",\"op\":1");
    match m {
        Message::Commit(c) => {
            field_str(out, "repo", c.repo);
            field_str(out, "rev", c.rev);
            field_opt_str(out, "since", c.since);
            out.push_str(",\"commit\":");
            opt_cid(out, Some(c.commit));
            field_str(out, "time", c.time);
            out.push_str(",\"ops\":[");
            let car: Option<Result<Car<'_>, DecodeError>> =
                c.ops.iter().any(|o| o.cid.is_some()).then(|| c.car(opts.verify_blocks));
            for op in &c.ops {
                if opts.keep_op.is_some_and(|keep| !keep(op)) {
                    written.filtered += 1;
                    continue;
                }
                if written.ops > 0 {
                    out.push(',');
                }
                written.ops += 1;
                out.push_str("{\"action\":\"");
                out.push_str(op.action.as_str());
                out.push('"');
                field_str(out, "path", op.path);
                out.push_str(",\"cid\":");
                opt_cid(out, op.cid);
                out.push_str(",\"prev\":");
                opt_cid(out, op.prev);
                out.push_str(",\"record\":");
                let rec = match &car {
                    None => Ok(None),
                    Some(Ok(car)) => op.record(car),
                    Some(Err(e)) => Err(e.clone()),
                };
                match rec {
                    Ok(Some(rec)) => rec.write_json(out),
                    Ok(None) => out.push_str("null"),
                    Err(e) if opts.lossy_records => {
                        written.record_errors += 1;
                        out.push_str("null,\"recordError\":\"");
                        out.push_str(e.reason());
                        out.push('"');
                    }
                    Err(e) => return Err(e),
                }
                out.push('}');
            }
            out.push(']');
        }
        Message::Sync(s) => {
            field_str(out, "did", s.did);
            field_str(out, "rev", s.rev);
            field_str(out, "time", s.time);
        }
        Message::Identity(i) => {
            field_str(out, "did", i.did);
            field_opt_str(out, "handle", i.handle);
            field_str(out, "time", i.time);
        }
        Message::Account(a) => {
            field_str(out, "did", a.did);
            out.push_str(if a.active { ",\"active\":true" } else { ",\"active\":false" });
            field_opt_str(out, "status", a.status);
            field_str(out, "time", a.time);
        }
        Message::Info(i) => {
            field_str(out, "name", i.name);
            field_opt_str(out, "message", i.message);
        }
        Message::Unknown { .. } | Message::Jet(_) => {}
    }
    out.push('}');
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cbor::Writer;

    #[test]
    fn escapes_like_json_stringify() {
        let mut s = String::new();
        write_str("a\"b\\c\n\u{1}\u{7f}é\u{2028}", &mut s);
        assert_eq!(s, "\"a\\\"b\\\\c\\n\\u0001\u{7f}é\u{2028}\"");
    }

    /// The byte-at-a-time form of the escaping, to check the word-at-a-time scan against.
    fn escape_bytewise(s: &str) -> String {
        let mut out = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c => out.push(c),
            }
        }
        out.push('"');
        out
    }

    #[test]
    fn word_scan_escapes_every_special_byte_at_every_offset() {
        let specials = (0u8..0x20).chain([b'"', b'\\', b' ', b'!', b'#', b'[', b']', 0x7f]);
        for b in specials {
            for len in 1..24 {
                for at in 0..len {
                    let mut v: Vec<char> = "abcdefghijklmnopqrstuvwxyz".chars().take(len).collect();
                    v[at] = char::from(b);
                    if at + 2 < len {
                        v[at + 2] = 'é';
                    }
                    let s: String = v.into_iter().collect();
                    let mut out = String::new();
                    write_str(&s, &mut out);
                    assert_eq!(out, escape_bytewise(&s), "byte {b:#x} at {at} of {len}");
                }
            }
        }
    }

    #[test]
    fn data_model_mapping() {
        let cid = crate::car::cid_for(b"x");
        let mut w = Writer::new();
        w.map(5).str("a").int(-3).str("b").bytes(b"hi").str("c").link(&cid).str("d").array(2).null().bool(true);
        w.str("nested").map(1).str("k").str("v");
        let mut out = String::new();
        write_cbor_as_json(&w.buf, &mut out);
        let c = Cid::from_bytes(&cid).expect("cid").to_string();
        assert_eq!(
            out,
            format!(r#"{{"a":-3,"b":{{"$bytes":"aGk"}},"c":{{"$link":"{c}"}},"d":[null,true],"nested":{{"k":"v"}}}}"#)
        );
    }
}
