//! The one time unit backends store: microseconds since the Unix epoch,
//! with checked arithmetic. A leaf module: it imports nothing of the crate
//! but its error type.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

/// The latest instant a backend stores: 9999-12-31T23:59:59.999999Z, in
/// microseconds since the Unix epoch. Every timestamp (and every sum of a
/// timestamp and a lease or a retention) stays below 2^63 µs with room to
/// spare, and below 2^53 (exact in a Lua or JSON number) until the year 2255.
pub const MAX_MICROS: i64 = 253_402_300_799_999_999;

/// Microseconds since the Unix epoch, the unit backends store timestamps
/// in. Fails with [`Error::InvalidInput`] before 1970 or after
/// [`MAX_MICROS`], instead of wrapping into a time that means something else.
pub fn to_micros(t: SystemTime) -> Result<i64> {
    let us = t
        .duration_since(UNIX_EPOCH)
        .map_err(|e| Error::InvalidInput(format!("{t:?} is {:?} before 1970", e.duration())))?
        .as_micros();
    i64::try_from(us)
        .ok()
        .filter(|us| *us <= MAX_MICROS)
        .ok_or_else(|| Error::InvalidInput(format!("{t:?} is after the year 9999")))
}

/// The inverse of [`to_micros`]; any `i64` maps to a time (negative values
/// before 1970), so decoding a stored value never panics.
pub fn from_micros(us: i64) -> SystemTime {
    if us >= 0 {
        UNIX_EPOCH + Duration::from_micros(us.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_micros(us.unsigned_abs())
    }
}

/// A duration in whole microseconds, saturating at `i64::MAX`. Leases and
/// retentions are validated (at most ten years) before they get here.
pub fn duration_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Whether a lease that ends at `expires_at` has ended at `now` (expiry is
/// inclusive: a lease is live strictly before its end).
pub fn lease_live(expires_at: Option<SystemTime>, now: SystemTime) -> bool {
    expires_at.is_some_and(|e| e > now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros_are_checked() {
        let now = SystemTime::now();
        let back = from_micros(to_micros(now).unwrap());
        assert!(now.duration_since(back).unwrap() < Duration::from_micros(1));
        assert_eq!(from_micros(-5), UNIX_EPOCH - Duration::from_micros(5));
        assert_eq!(to_micros(UNIX_EPOCH).unwrap(), 0);
        assert_eq!(to_micros(from_micros(MAX_MICROS)).unwrap(), MAX_MICROS);
        for bad in [
            UNIX_EPOCH - Duration::from_micros(1),
            from_micros(MAX_MICROS) + Duration::from_micros(1),
            // 2^64 µs ahead used to wrap to a time near now.
            UNIX_EPOCH + Duration::from_micros(u64::MAX) + Duration::from_secs(1),
        ] {
            assert!(matches!(to_micros(bad), Err(Error::InvalidInput(_))), "{bad:?}");
        }
        assert_eq!(from_micros(i64::MIN), UNIX_EPOCH - Duration::from_micros(1 << 63));
        assert_eq!(duration_micros(Duration::MAX), i64::MAX);
    }
}
