//! Timestamps in Trellis' wire format.

use chrono::{DateTime, SecondsFormat, Utc};

/// `time + duration`, with `duration` capped at about 100 years
/// ([`MAX_SQL_DURATION`](crate::dispatch::MAX_SQL_DURATION), as the SQL repositories cap
/// what they add to the database's clock): a longer lease or delay means "practically
/// never". Uncapped, a time past the year 9999 would be written with a sign
/// (`+262143-…`), which Trellis' format cannot hold and [`parse_timestamp`] refuses: a
/// lease stored that way would read as no lease at all.
pub(crate) fn add_saturating(time: DateTime<Utc>, duration: std::time::Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(duration.min(crate::dispatch::MAX_SQL_DURATION))
        .ok()
        .and_then(|d| time.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

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
///
/// The stored format `YYYY-MM-DDTHH:mm:ss.sssZ` takes a fast path: claims decode three per
/// row.
pub(crate) fn parse_timestamp(text: &str) -> Result<DateTime<Utc>, chrono::ParseError> {
    if let Some(time) = parse_iso_millis(text.as_bytes()) {
        return Ok(time);
    }
    DateTime::parse_from_rfc3339(text).map(|t| t.with_timezone(&Utc))
}

fn parse_iso_millis(b: &[u8]) -> Option<DateTime<Utc>> {
    if b.len() != 24
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
        || b[19] != b'.'
        || b[23] != b'Z'
    {
        return None;
    }
    let num = |range: std::ops::Range<usize>| -> Option<u32> {
        b[range].iter().try_fold(0_u32, |acc, &d| {
            d.is_ascii_digit().then(|| acc * 10 + u32::from(d - b'0'))
        })
    };
    let date =
        chrono::NaiveDate::from_ymd_opt(i32::try_from(num(0..4)?).ok()?, num(5..7)?, num(8..10)?)?;
    let time = chrono::NaiveTime::from_hms_milli_opt(
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
        num(20..23)?,
    )?;
    Some(date.and_time(time).and_utc())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn an_endless_duration_adds_a_century_that_still_round_trips() {
        let now = Utc.with_ymd_and_hms(2026, 12, 4, 0, 0, 0).unwrap();
        for duration in [
            std::time::Duration::MAX,
            std::time::Duration::from_secs(u64::MAX / 2),
        ] {
            let until = add_saturating(now, duration);
            assert_eq!(until, now + crate::dispatch::MAX_SQL_DURATION);
            assert_eq!(parse_timestamp(&format_timestamp(until)).unwrap(), until);
        }
        let hour = std::time::Duration::from_secs(3600);
        assert_eq!(add_saturating(now, hour), now + hour);
    }

    #[test]
    fn formats_like_to_iso_string() {
        let t = Utc.timestamp_millis_opt(1_779_667_200_123).unwrap();
        assert_eq!(format_timestamp(t), "2026-05-25T00:00:00.123Z");
        assert_eq!(parse_timestamp("2026-05-25T00:00:00.123Z").unwrap(), t);
        // Other RFC 3339 forms still parse, through the general path.
        assert_eq!(parse_timestamp("2026-05-25T02:00:00.123+02:00").unwrap(), t);
        assert_eq!(parse_timestamp("2026-05-25T00:00:00.123000Z").unwrap(), t);
        for bad in [
            "2026-13-25T00:00:00.123Z",
            "2026-05-25T24:00:00.123Z",
            "2026-05-25T00:00:00.1a3Z",
            "x",
        ] {
            assert!(parse_timestamp(bad).is_err(), "{bad}");
        }
        let now = now_millis();
        assert_eq!(now.timestamp_subsec_nanos() % 1_000_000, 0);
    }
}
