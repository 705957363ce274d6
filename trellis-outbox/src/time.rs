//! Timestamps in Trellis' wire format.

use chrono::{DateTime, SecondsFormat, Utc};

/// The current time, truncated to whole milliseconds (the precision Trellis stores).
pub(crate) fn now_millis() -> DateTime<Utc> {
    let now = Utc::now();
    DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now)
}

/// Formats a time like JavaScript's `Date.prototype.toISOString()`:
/// `YYYY-MM-DDTHH:mm:ss.sssZ`, UTC, exactly three fractional digits.
///
/// This is the format Trellis stores in SQLite and in the `Trellis-Event-Time` header.
///
/// # Examples
///
/// ```
/// use chrono::{TimeZone, Utc};
///
/// let t = Utc.with_ymd_and_hms(2026, 5, 25, 0, 0, 0).unwrap();
/// assert_eq!(trellis_outbox::format_timestamp(t), "2026-05-25T00:00:00.000Z");
/// ```
pub fn format_timestamp(time: DateTime<Utc>) -> String {
    time.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parses a timestamp written by [`format_timestamp`] (or any RFC 3339 time).
pub(crate) fn parse_timestamp(text: &str) -> Result<DateTime<Utc>, chrono::ParseError> {
    DateTime::parse_from_rfc3339(text).map(|t| t.with_timezone(&Utc))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn formats_like_to_iso_string() {
        let t = Utc.timestamp_millis_opt(1_779_667_200_123).unwrap();
        assert_eq!(format_timestamp(t), "2026-05-25T00:00:00.123Z");
        assert_eq!(parse_timestamp("2026-05-25T00:00:00.123Z").unwrap(), t);
        let now = now_millis();
        assert_eq!(now.timestamp_subsec_nanos() % 1_000_000, 0);
    }
}
