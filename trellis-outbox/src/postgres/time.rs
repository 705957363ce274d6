//! Reading a stored `timestamptz` without trusting it.

use chrono::{DateTime, NaiveDate, TimeDelta, Utc};
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgTypeInfo, PgValueFormat, PgValueRef};
use sqlx::{Decode, Postgres, Type};

use crate::error::Result;
use crate::row::Stored;

/// A stored `timestamptz`, decoded without panicking.
///
/// sqlx's `DateTime<Utc>` decoder adds the stored microseconds to its epoch unchecked, so
/// `infinity`, `-infinity` and years past 262,143 (all valid `timestamptz` values, which
/// another writer or an operator may store) panic inside it. This decoder answers an error
/// naming the value instead: the row is poison, not a crashed claim.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PgTime(pub(crate) DateTime<Utc>);

impl Type<Postgres> for PgTime {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }
}

impl<'r> Decode<'r, Postgres> for PgTime {
    fn decode(value: PgValueRef<'r>) -> std::result::Result<Self, BoxDynError> {
        match value.format() {
            // Microseconds since 2000-01-01 00:00 UTC; Postgres writes the infinities as the
            // extreme values.
            PgValueFormat::Binary => {
                let micros = <i64 as Decode<Postgres>>::decode(value)?;
                from_micros(micros).map(PgTime).map_err(Into::into)
            }
            // Text parsing fails with an error, never a panic.
            PgValueFormat::Text => <DateTime<Utc> as Decode<Postgres>>::decode(value).map(PgTime),
        }
    }
}

/// The time `micros` microseconds after Postgres' epoch, or what it is instead.
fn from_micros(micros: i64) -> std::result::Result<DateTime<Utc>, String> {
    match micros {
        i64::MAX => Err("timestamptz 'infinity' is not a time".to_owned()),
        i64::MIN => Err("timestamptz '-infinity' is not a time".to_owned()),
        _ => NaiveDate::from_ymd_opt(2000, 1, 1)
            .and_then(|day| day.and_hms_opt(0, 0, 0))
            .and_then(|epoch| epoch.checked_add_signed(TimeDelta::microseconds(micros)))
            .map(|time| time.and_utc())
            .ok_or_else(|| format!("timestamptz {micros} µs after 2000-01-01 is out of range")),
    }
}

impl Stored<DateTime<Utc>> for PgTime {
    fn into_value(self, _: &str, _: &'static str) -> Result<DateTime<Utc>> {
        Ok(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::from_micros;

    #[test]
    fn the_infinities_and_far_years_are_errors_not_panics() {
        assert!(from_micros(i64::MAX).unwrap_err().contains("'infinity'"));
        assert!(from_micros(i64::MIN).unwrap_err().contains("'-infinity'"));
        // Year 294276, the largest Postgres stores, is past chrono's range.
        assert!(
            from_micros(9_214_646_400_000_000_000)
                .unwrap_err()
                .contains("out of range")
        );
    }

    #[test]
    fn ordinary_times_convert() {
        assert_eq!(
            from_micros(0).unwrap().to_rfc3339(),
            "2000-01-01T00:00:00+00:00"
        );
        assert_eq!(
            from_micros(-1).unwrap().to_rfc3339(),
            "1999-12-31T23:59:59.999999+00:00"
        );
        assert_eq!(
            from_micros(847_584_000_123_456).unwrap().to_rfc3339(),
            "2026-11-10T00:00:00.123456+00:00"
        );
    }
}
