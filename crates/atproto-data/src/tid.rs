//! Timestamp identifiers (TIDs): the 13-character base32-sortable form of a 64-bit
//! value (a zero top bit, 53 bits of microseconds since the Unix epoch, 10 bits of clock
//! id). Repo revisions are TIDs; their order is the strings' order.

/// The base32-sortable alphabet of TIDs.
const ALPHABET: &[u8; 32] = b"234567abcdefghijklmnopqrstuvwxyz";

/// A TID's 64-bit value (its order is the string's order); `None` for anything else.
#[must_use]
pub fn parse(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 13 {
        return None;
    }
    let mut v: u64 = 0;
    for (i, &c) in b.iter().enumerate() {
        let d = match c {
            b'2'..=b'7' => c - b'2',
            b'a'..=b'z' => c - b'a' + 6,
            _ => return None,
        };
        // The first character carries the top bit, which a TID keeps at zero.
        if i == 0 && d >= 16 {
            return None;
        }
        v = (v << 5) | u64::from(d);
    }
    Some(v)
}

/// The TID string of a value [`parse`] produced.
#[must_use]
pub fn to_string(v: u64) -> String {
    (0..13).rev().map(|i| char::from(ALPHABET[((v >> (5 * i)) & 31) as usize])).collect()
}

/// The time a TID value names, in microseconds since the Unix epoch.
#[must_use]
pub fn time_us(v: u64) -> i64 {
    i64::try_from(v >> 10).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tid_names_its_time_and_round_trips() {
        let v = parse("3n3ykmb4q7a2h").expect("a rev of the reference PDS");
        assert_eq!(to_string(v), "3n3ykmb4q7a2h");
        // Recorded on 2026-12-06.
        let day = time_us(v) / 86_400_000_000;
        assert_eq!(day, 20_793, "days since the epoch (2026-12-06)");
        assert_eq!(parse("3n3ykmb4q7a2"), None);
        assert_eq!(parse("zn3ykmb4q7a2h"), None, "top bit set");
    }
}
