//! Times and durations as the commands print and read them: RFC 3339 in UTC
//! with microseconds (`2026-11-29T22:05:07.123456Z`), on the proleptic
//! Gregorian calendar (Howard Hinnant's civil-date algorithms, both
//! directions), and durations as operators write them (`500ms`, `90s`,
//! `1h30m`, `7d`). Small enough to keep here rather than depend on a
//! calendar crate.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::backend::to_micros;
use oncely::{Error, Result};

/// `2026-11-29T22:05:07.123456Z`. Times before 1970 print as the epoch
/// (no backend stores any).
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Howard Hinnant's days-to-civil algorithm (proleptic Gregorian calendar).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Parses an RFC 3339 instant (`2026-11-30T08:00:00Z`,
/// `2026-11-30T09:00:00.5+01:00`) or a date (`2026-11-30`, midnight UTC).
/// Anything else is [`Error::InvalidInput`].
pub fn parse_rfc3339(s: &str) -> Result<SystemTime> {
    let bad = || Error::InvalidInput(format!("not an RFC 3339 time (2026-11-30T08:00:00Z): {s:?}"));
    let s = s.trim();
    let num = |t: &str| -> Result<i64> {
        if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        t.parse().map_err(|_| bad())
    };
    let (date, rest) = match s.find(['T', 't', ' ']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let mut d = date.split('-');
    let (y, m, day) = match (d.next(), d.next(), d.next(), d.next()) {
        (Some(y), Some(m), Some(dd), None) if y.len() == 4 && m.len() == 2 && dd.len() == 2 => {
            (num(y)?, num(m)?, num(dd)?)
        }
        _ => return Err(bad()),
    };
    if !(1..=12).contains(&m) || !(1..=days_in_month(y, m)).contains(&day) {
        return Err(bad());
    }
    let mut secs = days_from_civil(y, m, day) * 86_400;
    let mut micros = 0i64;
    if let Some(rest) = rest {
        let (time, offset) = if let Some(t) = rest.strip_suffix(['Z', 'z']) {
            (t, 0)
        } else if let Some(i) = rest.rfind(['+', '-']) {
            let (t, o) = rest.split_at(i);
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let (oh, om) = o[1..].split_once(':').ok_or_else(bad)?;
            let (oh, om) = (num(oh)?, num(om)?);
            if oh > 23 || om > 59 || oh.to_string().len() > 2 {
                return Err(bad());
            }
            (t, sign * (oh * 3600 + om * 60))
        } else {
            return Err(bad());
        };
        let (hms, frac) = match time.split_once('.') {
            Some((a, f)) => (a, Some(f)),
            None => (time, None),
        };
        let mut t = hms.split(':');
        let (h, mi, se) = match (t.next(), t.next(), t.next(), t.next()) {
            (Some(h), Some(mi), Some(se), None) if h.len() == 2 && mi.len() == 2 && se.len() == 2 => {
                (num(h)?, num(mi)?, num(se)?)
            }
            _ => return Err(bad()),
        };
        if h > 23 || mi > 59 || se > 60 {
            return Err(bad());
        }
        if let Some(f) = frac {
            num(f)?;
            let digits: String = f.chars().chain(std::iter::repeat('0')).take(6).collect();
            micros = num(&digits)?;
        }
        secs += h * 3600 + mi * 60 + se - offset;
    }
    if secs < 0 {
        return Err(bad());
    }
    let t =
        UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs()) + Duration::from_micros(micros.unsigned_abs());
    to_micros(t).map_err(|_| bad())?;
    Ok(t)
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Howard Hinnant's days-from-civil (proleptic Gregorian), the inverse of
/// [`civil_from_days`].
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The units of a written duration, largest first, in milliseconds.
const UNITS: &[(&str, u64)] = &[
    ("w", 604_800_000),
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

/// Parses a duration as every command takes one: whole numbers, each with
/// a unit (`w`, `d`, `h`, `m`, `s`, `ms`), written one after another
/// (`500ms`, `30s`, `1h30m`, `7d`, `2w`), or a bare number of seconds.
/// Fails with [`Error::InvalidInput`] quoting the input: a sign, a
/// fraction, a space, an unknown unit or a sum past `u64` milliseconds.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let bad = || {
        Error::InvalidInput(format!(
            "invalid duration {s:?}: not a duration (e.g. 500ms, 30s, 5m, 1h30m, 2h, 7d, 2w; \
             units w, d, h, m, s, ms, a bare number is seconds)"
        ))
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = t.parse::<u64>() {
        return secs.checked_mul(1_000).map(Duration::from_millis).ok_or_else(bad);
    }
    let mut total: u64 = 0;
    let mut rest = t;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let (_, ms) = UNITS.iter().find(|(u, _)| *u == unit).ok_or_else(bad)?;
        total = n
            .checked_mul(*ms)
            .and_then(|x| total.checked_add(x))
            .ok_or_else(bad)?;
    }
    Ok(Duration::from_millis(total))
}

/// `7d`, `36h`, `1h30m`, `90s`: the largest units first, at most two of
/// them, rounded down to whole seconds (`250ms` below one second).
pub fn format_duration(d: Duration) -> String {
    let mut secs = d.as_secs();
    if secs == 0 {
        return if d.is_zero() {
            "0s".to_owned()
        } else {
            format!("{}ms", d.as_millis())
        };
    }
    let mut parts = Vec::new();
    for (unit, size) in &UNITS[1..5] {
        let size = size / 1_000;
        if secs >= size {
            parts.push(format!("{}{unit}", secs / size));
            secs %= size;
        }
        if parts.len() == 2 || secs == 0 {
            break;
        }
    }
    parts.concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_and_print() {
        for (s, ms) in [
            ("500ms", 500),
            ("30", 30_000),
            ("30s", 30_000),
            ("90s", 90_000),
            ("5m", 300_000),
            ("2h", 7_200_000),
            ("1d", 86_400_000),
            ("7d", 604_800_000),
            ("36h", 129_600_000),
            ("1h30m", 5_400_000),
            ("2w", 1_209_600_000),
            ("1s500ms", 1_500),
        ] {
            assert_eq!(parse_duration(s).unwrap(), Duration::from_millis(ms), "{s}");
        }
        for bad in [
            "",
            "d",
            "m",
            "7x",
            "5y",
            "1.5h",
            "1.5s",
            "h7",
            "-3s",
            "-5s",
            "5 m",
            "a week",
            "99999999999999999999w",
            "99999999999999999999s",
            "18446744073709552s",
        ] {
            let e = parse_duration(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidInput(_)), "{bad:?}: {e}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{bad:?}: {e}");
        }
        assert_eq!(format_duration(Duration::from_secs(604_800)), "7d");
        assert_eq!(format_duration(Duration::from_secs(5_400)), "1h30m");
        assert_eq!(format_duration(Duration::from_secs(90_061)), "1d1h");
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_duration(Duration::ZERO), "0s");
    }

    #[test]
    fn rfc3339_formats_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        let t = UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20.123456Z");
        // A leap day.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn rfc3339_round_trips() {
        for s in [
            "1970-01-01T00:00:00.000000Z",
            "2000-02-29T00:00:00.000000Z",
            "2026-11-30T08:15:30.123456Z",
        ] {
            assert_eq!(rfc3339(parse_rfc3339(s).unwrap()), s);
        }
        assert_eq!(
            parse_rfc3339("2026-11-30T09:15:30.5+01:00").unwrap(),
            parse_rfc3339("2026-11-30T08:15:30.500Z").unwrap()
        );
        assert_eq!(
            parse_rfc3339("2026-11-30").unwrap(),
            parse_rfc3339("2026-11-30T00:00:00Z").unwrap()
        );
        for bad in [
            "",
            "yesterday",
            "2026-13-01",
            "2026-02-30",
            "2026-11-30T25:00:00Z",
            "2026-11-30T08:00:00",
            "2026-11-30T08:00Z",
            "2026-11-30T08:00:00.x1Z",
            "1969-12-31T23:59:59Z",
        ] {
            assert!(
                matches!(parse_rfc3339(bad), Err(Error::InvalidInput(_))),
                "{bad:?}"
            );
        }
    }
}
