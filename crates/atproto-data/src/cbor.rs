//! A strict, borrowing DAG-CBOR reader.
//!
//! Every rule of DAG-CBOR that `serde_ipld_dagcbor` 0.7 enforces is enforced here too
//! (minimal heads, definite lengths only, text keys sorted length-first then bytewise with
//! no duplicates, tag 42 only, no `undefined`, floats only as finite 64-bit values other
//! than -0.0), so the fast path is never laxer than the reference decoder. Nothing here
//! allocates: strings and byte strings are slices of the input.

use crate::error::CborError;

/// Deepest nesting accepted, so a hostile frame cannot overflow the stack.
pub const MAX_DEPTH: u32 = 64;

/// The CBOR major types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Major {
    /// Major type 0.
    Unsigned,
    /// Major type 1.
    Negative,
    /// Major type 2.
    Bytes,
    /// Major type 3.
    Text,
    /// Major type 4.
    Array,
    /// Major type 5.
    Map,
    /// Major type 6.
    Tag,
    /// Major type 7.
    Simple,
}

/// One decoded data item head: the major type and its argument.
#[derive(Debug, Clone, Copy)]
struct Head {
    major: Major,
    /// The argument; for floats, the raw bits; for simple values, the value.
    arg: u64,
    /// For major 7: the additional-information field (to tell floats from simple values).
    info: u8,
}

/// A cursor over a DAG-CBOR byte slice.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A scalar or container start as seen by a generic walker (the JSON transcoder).
#[derive(Debug, Clone, Copy)]
pub enum Item<'a> {
    /// An integer (DAG-CBOR integers fit in i128 across both majors).
    Int(i128),
    /// A byte string.
    Bytes(&'a [u8]),
    /// A text string.
    Text(&'a str),
    /// An array of this many items follows.
    Array(u64),
    /// A map of this many entries follows.
    Map(u64),
    /// A CID link (tag 42), the raw CID bytes without the 0x00 multibase prefix.
    Link(&'a [u8]),
    /// `true` or `false`.
    Bool(bool),
    /// `null`.
    Null,
    /// A finite 64-bit float.
    Float(f64),
}

impl<'a> Reader<'a> {
    /// Starts reading at the beginning of `buf`.
    #[must_use]
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// The byte offset of the next item.
    #[must_use]
    pub fn position(&self) -> usize {
        self.pos
    }

    /// True when every byte has been consumed.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.pos == self.buf.len()
    }

    /// The bytes not yet consumed.
    #[must_use]
    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }

    /// Fails unless the whole input was consumed.
    pub fn end(&self) -> Result<(), CborError> {
        if self.is_empty() { Ok(()) } else { Err(CborError::TrailingBytes { at: self.pos }) }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], CborError> {
        let end =
            self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(CborError::Truncated { at: self.pos })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, CborError> {
        let b = *self.buf.get(self.pos).ok_or(CborError::Truncated { at: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    fn head(&mut self) -> Result<Head, CborError> {
        let at = self.pos;
        let ib = self.byte()?;
        let major = match ib >> 5 {
            0 => Major::Unsigned,
            1 => Major::Negative,
            2 => Major::Bytes,
            3 => Major::Text,
            4 => Major::Array,
            5 => Major::Map,
            6 => Major::Tag,
            _ => Major::Simple,
        };
        let info = ib & 0x1f;
        let arg = match info {
            0..=23 => u64::from(info),
            24 => u64::from(self.byte()?),
            25 => u64::from(u16::from_be_bytes(self.take(2)?.try_into().unwrap_or_default())),
            26 => u64::from(u32::from_be_bytes(self.take(4)?.try_into().unwrap_or_default())),
            27 => u64::from_be_bytes(self.take(8)?.try_into().unwrap_or_default()),
            31 => return Err(CborError::Indefinite { at }),
            _ => return Err(CborError::Reserved { at, byte: ib }),
        };
        if major == Major::Simple {
            return Ok(Head { major, arg, info });
        }
        let minimal = match info {
            24 => arg >= 24,
            25 => arg > 0xff,
            26 => arg > 0xffff,
            27 => arg > 0xffff_ffff,
            _ => true,
        };
        if !minimal {
            return Err(CborError::NonMinimal { at });
        }
        Ok(Head { major, arg, info })
    }

    fn len(&self, arg: u64) -> Result<usize, CborError> {
        usize::try_from(arg).map_err(|_| CborError::Truncated { at: self.pos })
    }

    fn expect(&mut self, want: Major, what: &'static str) -> Result<Head, CborError> {
        let at = self.pos;
        let h = self.head()?;
        if h.major == want { Ok(h) } else { Err(CborError::Unexpected { at, expected: what }) }
    }

    /// Reads an unsigned integer.
    pub fn u64(&mut self) -> Result<u64, CborError> {
        Ok(self.expect(Major::Unsigned, "unsigned integer")?.arg)
    }

    /// Reads a signed integer that fits in i64.
    pub fn i64(&mut self) -> Result<i64, CborError> {
        let at = self.pos;
        let h = self.head()?;
        let v = match h.major {
            Major::Unsigned => i64::try_from(h.arg).ok(),
            Major::Negative => i64::try_from(h.arg).ok().map(|v| -1 - v),
            _ => {
                return Err(CborError::Unexpected { at, expected: "integer" });
            }
        };
        v.ok_or(CborError::IntegerRange { at })
    }

    /// Reads a text string, borrowed.
    pub fn str(&mut self) -> Result<&'a str, CborError> {
        let h = self.expect(Major::Text, "text string")?;
        self.text_body(h.arg)
    }

    fn text_body(&mut self, arg: u64) -> Result<&'a str, CborError> {
        let at = self.pos;
        let n = self.len(arg)?;
        let raw = self.take(n)?;
        std::str::from_utf8(raw).map_err(|_| CborError::InvalidUtf8 { at })
    }

    /// Reads a byte string, borrowed.
    pub fn bytes(&mut self) -> Result<&'a [u8], CborError> {
        let h = self.expect(Major::Bytes, "byte string")?;
        let n = self.len(h.arg)?;
        self.take(n)
    }

    /// Reads `true` or `false`.
    pub fn bool(&mut self) -> Result<bool, CborError> {
        let at = self.pos;
        match self.head()? {
            Head { major: Major::Simple, info: 20, .. } => Ok(false),
            Head { major: Major::Simple, info: 21, .. } => Ok(true),
            _ => Err(CborError::Unexpected { at, expected: "boolean" }),
        }
    }

    /// Consumes a `null` if one is next and says whether it did.
    pub fn null(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xf6) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Reads a map head and returns its entry count.
    pub fn map(&mut self) -> Result<u64, CborError> {
        Ok(self.expect(Major::Map, "map")?.arg)
    }

    /// Reads an array head and returns its length.
    pub fn array(&mut self) -> Result<u64, CborError> {
        Ok(self.expect(Major::Array, "array")?.arg)
    }

    /// Reads a CID link (tag 42 over a byte string with the 0x00 prefix) and returns
    /// the CID bytes after the prefix. The CID itself is checked by [`crate::cid`].
    pub fn link(&mut self) -> Result<&'a [u8], CborError> {
        let at = self.pos;
        let h = self.expect(Major::Tag, "CID link (tag 42)")?;
        self.link_body(at, h.arg)
    }

    fn link_body(&mut self, at: usize, tag: u64) -> Result<&'a [u8], CborError> {
        if tag != 42 {
            return Err(CborError::ForeignTag { at, tag });
        }
        let b = self.bytes()?;
        match b.split_first() {
            Some((0, cid)) => Ok(cid),
            _ => Err(CborError::BadLinkPrefix { at }),
        }
    }

    /// Reads the next map key and checks it sorts strictly after `prev` in DAG-CBOR
    /// order (shorter first, then bytewise), which also rules out duplicates.
    pub fn key(&mut self, prev: Option<&str>) -> Result<&'a str, CborError> {
        let at = self.pos;
        let h = self.head()?;
        if h.major != Major::Text {
            return Err(CborError::NonTextKey { at });
        }
        let k = self.text_body(h.arg)?;
        if let Some(p) = prev {
            let ordered = (p.len(), p.as_bytes()) < (k.len(), k.as_bytes());
            if !ordered {
                return Err(CborError::KeyOrder { at });
            }
        }
        Ok(k)
    }

    /// Reads the next item head (a scalar whole, or a container's length).
    pub fn item(&mut self) -> Result<Item<'a>, CborError> {
        let at = self.pos;
        let h = self.head()?;
        Ok(match h.major {
            Major::Unsigned => Item::Int(i128::from(h.arg)),
            Major::Negative => Item::Int(-1 - i128::from(h.arg)),
            Major::Bytes => {
                let n = self.len(h.arg)?;
                Item::Bytes(self.take(n)?)
            }
            Major::Text => Item::Text(self.text_body(h.arg)?),
            Major::Array => Item::Array(h.arg),
            Major::Map => Item::Map(h.arg),
            Major::Tag => Item::Link(self.link_body(at, h.arg)?),
            Major::Simple => match h.info {
                20 => Item::Bool(false),
                21 => Item::Bool(true),
                22 => Item::Null,
                27 => {
                    let f = f64::from_bits(h.arg);
                    if !f.is_finite() || (f == 0.0 && f.is_sign_negative()) {
                        return Err(CborError::BadFloat { at });
                    }
                    Item::Float(f)
                }
                25 | 26 => return Err(CborError::BadFloat { at }),
                _ => return Err(CborError::BadSimple { at }),
            },
        })
    }

    /// Skips one whole data item, validating it fully (links are checked as CIDs too).
    pub fn skip(&mut self) -> Result<(), CborError> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: u32) -> Result<(), CborError> {
        if depth > MAX_DEPTH {
            return Err(CborError::TooDeep { at: self.pos });
        }
        let at = self.pos;
        match self.item()? {
            Item::Array(n) => {
                for _ in 0..n {
                    self.skip_depth(depth + 1)?;
                }
            }
            Item::Map(n) => {
                let mut prev = None;
                for _ in 0..n {
                    prev = Some(self.key(prev)?);
                    self.skip_depth(depth + 1)?;
                }
            }
            Item::Link(cid) => {
                crate::cid::check(cid).map_err(|_| CborError::BadLink { at })?;
            }
            _ => {}
        }
        Ok(())
    }
}

/// A tiny canonical DAG-CBOR writer, used by tests, benches and `relay-sim` to build
/// frames the fixture does not contain. The caller writes map keys in canonical order.
#[derive(Debug, Default, Clone)]
pub struct Writer {
    /// The encoded bytes so far.
    pub buf: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    #[allow(clippy::decimal_bitwise_operands)] // 24..27 are the spec's additional-info values
    fn head(&mut self, major: u8, arg: u64) -> &mut Self {
        let m = major << 5;
        if arg < 24 {
            self.buf.push(m | arg as u8);
        } else if arg <= 0xff {
            self.buf.extend_from_slice(&[m | 24, arg as u8]);
        } else if arg <= 0xffff {
            self.buf.push(m | 25);
            self.buf.extend_from_slice(&(arg as u16).to_be_bytes());
        } else if arg <= 0xffff_ffff {
            self.buf.push(m | 26);
            self.buf.extend_from_slice(&(arg as u32).to_be_bytes());
        } else {
            self.buf.push(m | 27);
            self.buf.extend_from_slice(&arg.to_be_bytes());
        }
        self
    }

    /// Writes a signed integer.
    pub fn int(&mut self, v: i64) -> &mut Self {
        if v >= 0 { self.head(0, v.unsigned_abs()) } else { self.head(1, (-1 - v).unsigned_abs()) }
    }

    /// Writes a text string.
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.head(3, s.len() as u64);
        self.buf.extend_from_slice(s.as_bytes());
        self
    }

    /// Writes a byte string.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.head(2, b.len() as u64);
        self.buf.extend_from_slice(b);
        self
    }

    /// Writes a map head for `n` entries.
    pub fn map(&mut self, n: u64) -> &mut Self {
        self.head(5, n)
    }

    /// Writes an array head for `n` items.
    pub fn array(&mut self, n: u64) -> &mut Self {
        self.head(4, n)
    }

    /// Writes a boolean.
    pub fn bool(&mut self, b: bool) -> &mut Self {
        self.buf.push(if b { 0xf5 } else { 0xf4 });
        self
    }

    /// Writes `null`.
    pub fn null(&mut self) -> &mut Self {
        self.buf.push(0xf6);
        self
    }

    /// Writes a CID link from raw CID bytes.
    pub fn link(&mut self, cid: &[u8]) -> &mut Self {
        self.head(6, 42);
        self.head(2, cid.len() as u64 + 1);
        self.buf.push(0);
        self.buf.extend_from_slice(cid);
        self
    }

    /// Appends already-encoded bytes.
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_minimal_and_indefinite() {
        assert!(matches!(Reader::new(&[0x18, 0x01]).u64(), Err(CborError::NonMinimal { .. })));
        assert!(matches!(Reader::new(&[0x19, 0x00, 0xff]).u64(), Err(CborError::NonMinimal { .. })));
        assert!(matches!(Reader::new(&[0xbf]).map(), Err(CborError::Indefinite { .. })));
        assert_eq!(Reader::new(&[0x18, 0x18]).u64().ok(), Some(24));
    }

    #[test]
    fn key_order_is_length_first() {
        // {"b":1,"aa":2} is canonical; {"aa":1,"b":2} is not.
        let mut w = Writer::new();
        w.map(2).str("b").int(1).str("aa").int(2);
        assert!(Reader::new(&w.buf).skip().is_ok());
        let mut w = Writer::new();
        w.map(2).str("aa").int(1).str("b").int(2);
        assert!(matches!(Reader::new(&w.buf).skip(), Err(CborError::KeyOrder { .. })));
        let mut w = Writer::new();
        w.map(2).str("a").int(1).str("a").int(2);
        assert!(matches!(Reader::new(&w.buf).skip(), Err(CborError::KeyOrder { .. })));
    }

    #[test]
    fn floats_and_simples() {
        assert!(matches!(Reader::new(&[0xf7]).skip(), Err(CborError::BadSimple { .. })));
        assert!(matches!(Reader::new(&[0xfa, 0, 0, 0, 0]).skip(), Err(CborError::BadFloat { .. })));
        let nan = f64::NAN.to_bits().to_be_bytes();
        let mut b = vec![0xfb];
        b.extend_from_slice(&nan);
        assert!(matches!(Reader::new(&b).skip(), Err(CborError::BadFloat { .. })));
        let mut b = vec![0xfb];
        b.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        assert!(matches!(Reader::new(&b).item(), Ok(Item::Float(f)) if (f - 1.5).abs() < f64::EPSILON));
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let b = vec![0x81; 100_000];
        assert!(matches!(Reader::new(&b).skip(), Err(CborError::TooDeep { .. })));
    }

    #[test]
    fn huge_lengths_are_truncation() {
        let b = [0x5b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(Reader::new(&b).bytes(), Err(CborError::Truncated { .. })));
    }

    #[test]
    fn writer_roundtrips_integers() {
        for v in [0i64, 1, 23, 24, 255, 256, 65535, 65536, 1 << 40, -1, -24, -25, -1000, i64::MIN] {
            let mut w = Writer::new();
            w.int(v);
            let mut r = Reader::new(&w.buf);
            assert_eq!(r.i64().ok(), Some(v));
            assert!(r.end().is_ok());
        }
    }
}
