//! HTTP dates, as far as a `Retry-After: Wed, 21 Oct 2015 07:28:00 GMT` needs them: RFC 9110's
//! IMF-fixdate and the RFC 2822 forms Python's `email.utils.parsedate_tz` reads for the official
//! OpenAI client (weekday optional, seconds optional, `GMT`/`UT`/`UTC`/`Z` or a numeric zone; no
//! zone is read as UTC). Not the obsolete RFC 850 and asctime forms, nor named US zones.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];

/// The instant `text` names; `None` when it is not a date of the forms above.
pub(crate) fn parse(text: &str) -> Option<SystemTime> {
    let text = text.trim();
    // The weekday says nothing the date does not.
    let text = text.split_once(',').map_or(text, |(_, rest)| rest);
    let mut fields = text.split_whitespace();
    let day: u32 = fields.next()?.parse().ok()?;
    let month_name = fields.next()?.to_ascii_lowercase();
    let month = MONTHS
        .iter()
        .position(|name| month_name.get(..3) == Some(*name))? as u32
        + 1;
    let year: i64 = fields.next()?.parse().ok()?;
    let mut clock = fields.next()?.split(':');
    let hour: i64 = clock.next()?.parse().ok()?;
    let minute: i64 = clock.next()?.parse().ok()?;
    let second: i64 = clock.next().map_or(Some(0), |s| s.parse().ok())?;
    let offset_s = match fields.next() {
        None => 0,
        Some(zone) => zone_offset_s(zone)?,
    };
    if fields.next().is_some()
        || clock.next().is_some()
        || !(1..=31).contains(&day)
        || !(1000..=9999).contains(&year)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let seconds =
        days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second - offset_s;
    let magnitude = Duration::from_secs(seconds.unsigned_abs());
    if seconds >= 0 {
        UNIX_EPOCH.checked_add(magnitude)
    } else {
        UNIX_EPOCH.checked_sub(magnitude)
    }
}

/// Seconds east of UTC: `+0200` is 7,200.
fn zone_offset_s(zone: &str) -> Option<i64> {
    if ["gmt", "ut", "utc", "z"].contains(&zone.to_ascii_lowercase().as_str()) {
        return Some(0);
    }
    let (sign, digits) = match zone.as_bytes().first()? {
        b'+' => (1, &zone[1..]),
        b'-' => (-1, &zone[1..]),
        _ => return None,
    };
    if digits.len() != 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (hours, minutes): (i64, i64) = (digits[..2].parse().ok()?, digits[2..].parse().ok()?);
    Some(sign * (hours * 3600 + minutes * 60))
}

/// Days from 1970-01-01 to the proleptic Gregorian date (Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = i64::from((month + 9) % 12);
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch_s(text: &str) -> Option<i64> {
        let time = parse(text)?;
        Some(match time.duration_since(UNIX_EPOCH) {
            Ok(after) => after.as_secs() as i64,
            Err(before) => -(before.duration().as_secs() as i64),
        })
    }

    #[test]
    fn reads_what_python_email_utils_reads() {
        // email.utils.mktime_tz(email.utils.parsedate_tz(text)) for each.
        assert_eq!(epoch_s("Sun, 06 Nov 1994 08:49:37 GMT"), Some(784_111_777));
        assert_eq!(
            epoch_s("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(1_445_412_480)
        );
        assert_eq!(
            epoch_s("Wed, 21 Oct 2015 09:28:00 +0200"),
            Some(1_445_412_480)
        );
        assert_eq!(epoch_s("29 Feb 2024 23:59:59 -0130"), Some(1_709_256_599));
        assert_eq!(epoch_s("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(epoch_s("Wed, 31 Dec 1969 23:59:00 UTC"), Some(-60));
        assert_eq!(
            epoch_s("  wed, 21 oct 2015 07:28 gmt "),
            Some(1_445_412_480)
        );
    }

    #[test]
    fn refuses_what_is_not_a_date() {
        for text in [
            "",
            "120",
            "1.5",
            "soon",
            "Wed, 21 Foo 2015 07:28:00 GMT",
            "Wed, 32 Oct 2015 07:28:00 GMT",
            "Wed, 21 Oct 2015 24:28:00 GMT",
            "Wed, 21 Oct 2015 07:28:00 EST",
            "Wed, 21 Oct 2015 07:28:00 GMT extra",
            "Wed, 21 Oct 2015 07:28:00:01 GMT",
            "Wed, 21 Oct 15 07:28:00 GMT",
        ] {
            assert_eq!(parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn civil_days_match_a_day_by_day_count() {
        let mut days = 0;
        for year in 1970..2100 {
            for month in 1..=12u32 {
                let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
                let length = match month {
                    2 if leap => 29,
                    2 => 28,
                    4 | 6 | 9 | 11 => 30,
                    _ => 31,
                };
                for day in 1..=length {
                    assert_eq!(
                        days_from_civil(year, month, day),
                        days,
                        "{year}-{month}-{day}"
                    );
                    days += 1;
                }
            }
        }
    }
}
