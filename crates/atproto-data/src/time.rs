//! Relay times: the `time` field of firehose events (RFC 3339, set by the PDS).

/// An RFC 3339 relay time as Unix milliseconds; `None` when it does not parse or is out
/// of range.
#[must_use]
pub fn time_ms(t: &str) -> Option<i64> {
    let t = ::time::OffsetDateTime::parse(t, &::time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

#[cfg(test)]
mod tests {
    use super::time_ms;

    #[test]
    fn relay_times_parse_to_milliseconds_and_garbage_does_not() {
        assert_eq!(time_ms("1970-01-01T00:00:01.5Z"), Some(1500));
        assert_eq!(time_ms("2024-05-01T12:00:00+02:00"), Some(1_714_557_600_000));
        assert_eq!(time_ms("yesterday"), None);
    }
}
