//! Durations as operators write and read them: `7d`, `36h`, `1h30m`, `90s`.

use std::time::Duration;

use oncely::{Error, Result};

const UNITS: &[(&str, u64)] = &[("w", 604_800), ("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];

/// Parses `7d`, `36h`, `1h30m`, `90s`, `2w` (units w, d, h, m, s, each
/// after a whole number; a bare number is seconds). Fails with
/// [`Error::Config`] naming the input.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let bad = || {
        Error::Config(format!(
            "invalid duration {s:?} (expected e.g. 7d, 36h, 1h30m, 90s; units w, d, h, m, s)"
        ))
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = t.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
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
        let (_, secs) = UNITS.iter().find(|(u, _)| *u == unit).ok_or_else(bad)?;
        total = n
            .checked_mul(*secs)
            .and_then(|x| total.checked_add(x))
            .ok_or_else(bad)?;
    }
    Ok(Duration::from_secs(total))
}

/// `7d`, `36h`, `1h30m`, `90s`: the largest units first, at most two of
/// them, rounded down to whole seconds (`0s` below one second).
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
    for (unit, size) in &UNITS[1..] {
        if secs >= *size {
            parts.push(format!("{}{unit}", secs / size));
            secs %= size;
        }
        if parts.len() == 2 || secs == 0 {
            break;
        }
    }
    parts.concat()
}

/// Percent-encodes a displayed key for a `/record/` path: everything but
/// the unreserved characters and the key's own `/` and `:`.
pub(crate) fn key_path(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/:".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encodes a query parameter's value.
pub(crate) fn query_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        for (s, secs) in [
            ("7d", 604_800),
            ("36h", 129_600),
            ("1h30m", 5_400),
            ("90s", 90),
            ("90", 90),
            ("2w", 1_209_600),
        ] {
            assert_eq!(parse_duration(s).unwrap(), Duration::from_secs(secs), "{s}");
        }
        assert_eq!(format_duration(Duration::from_secs(604_800)), "7d");
        assert_eq!(format_duration(Duration::from_secs(5_400)), "1h30m");
        assert_eq!(format_duration(Duration::from_secs(90_061)), "1d1h");
        assert_eq!(format_duration(Duration::from_millis(250)), "250ms");
        for bad in ["", "d", "7x", "1.5h", "h7", "-3s", "99999999999999999999w"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_are_encoded_for_paths() {
        assert_eq!(key_path("acme/capture:order-1"), "acme/capture:order-1");
        assert_eq!(key_path("acme/mail:a b?c"), "acme/mail:a%20b%3Fc");
        assert_eq!(query_value("a/b c"), "a%2Fb%20c");
    }
}
