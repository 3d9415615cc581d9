//! The server's clock, as seen from one worker.
//!
//! JetStream stamps every revision with the stream leader's clock, and every
//! read returns that stamp, but no reply carries the server's *current* time.
//! Lease expiry needs "now" on the server's clock, so each ledger keeps a
//! lower bound of it:
//!
//! - A probe writes to [`CLOCK_KEY`] and reads the
//!   revision back. Its stamp `ts` was taken by the server before the read's
//!   reply arrived at local monotonic instant `m1`, so at any later local
//!   instant `m`, `server_now >= ts + (m - m1)`.
//! - Every revision the ledger reads is also a lower bound of the server's
//!   clock at the moment the reply arrived, and only ever raises the estimate.
//! - The worker's wall clock is never used; its monotonic clock only measures
//!   time elapsed since a sample, minus a 0.1 % allowance for rate
//!   differences between the two clocks (NTP slews at most 0.05 %).
//!
//! The estimate is therefore never ahead of the server; it lags by at most
//! the probe's round trip plus 0.1 % of the sample's age (the probe is
//! refreshed every [`REFRESH`]). Expiry judged on it is late by at most that,
//! never early: a lease is taken over only after it has really run out on the
//! server's clock. In a cluster the stamps come from whichever node leads the
//! stream, so the cluster's clocks must be synchronised (NTP) as for any
//! JetStream deployment; a leader change to a node whose clock is behind by
//! `d` delays expiry by `d`, one ahead by `d` can expire leases up to `d`
//! early.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use oncely::Result;
use oncely::backend::{from_micros, to_micros};

use crate::NatsKvLedger;
use crate::codec::CLOCK_KEY;
use crate::error::{backend_err, clock_out_of_range};

/// How old a probe sample may get before the next operation refreshes it.
pub(crate) const REFRESH: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy)]
struct Sample {
    server: SystemTime,
    local: Instant,
    probed: Instant,
}

/// A lower bound of the server's clock.
#[derive(Debug, Default)]
pub(crate) struct ServerClock {
    sample: Mutex<Option<Sample>>,
    /// Single flight: concurrent operations wait for one probe.
    probing: tokio::sync::Mutex<()>,
}

impl ServerClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Sample>> {
        self.sample.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current lower bound, if a probe has been taken and is fresh.
    pub(crate) fn fresh_now(&self) -> Option<SystemTime> {
        let s = (*self.lock())?;
        if s.probed.elapsed() > REFRESH {
            return None;
        }
        Some(Self::project(s))
    }

    /// The sample advanced by the local time elapsed since it was taken,
    /// minus the rate allowance. Checked: a stamp near the end of
    /// `SystemTime`'s range (a server clock gone wrong) stays where it is
    /// instead of panicking; a bound that does not move is still a bound.
    fn project(s: Sample) -> SystemTime {
        let elapsed = s.local.elapsed();
        s.server.checked_add(elapsed - elapsed / 1000).unwrap_or(s.server)
    }

    /// Records a probe: `server` was stamped before local instant `at`.
    pub(crate) fn probed(&self, server: SystemTime, at: Instant) {
        let mut g = self.lock();
        let probe_now = server.checked_add(at.elapsed()).unwrap_or(server);
        let keep_old = g.is_some_and(|old| Self::project(old) > probe_now);
        match (*g, keep_old) {
            (Some(old), true) => *g = Some(Sample { probed: at, ..old }),
            _ => {
                *g = Some(Sample {
                    server,
                    local: at,
                    probed: at,
                })
            }
        }
    }

    /// Raises the estimate to a server stamp just read (stamped before now).
    pub(crate) fn observe(&self, server: SystemTime) {
        let mut g = self.lock();
        if let Some(s) = g.as_mut()
            && server > Self::project(*s)
        {
            s.server = server;
            s.local = Instant::now();
        }
    }
}

impl NatsKvLedger {
    /// A lower bound of the server's current time (see the crate docs), in
    /// whole microseconds (the unit records store, so a lease's
    /// `first_claimed_at` equals the stored one exactly) and within what
    /// records can hold (1970..9999; a server clock outside is an error).
    pub(crate) async fn now(&self) -> Result<SystemTime> {
        let t = self.now_exact().await?;
        server_us(t).map(from_micros)
    }

    /// The estimate, probing first when the last probe is older than
    /// [`REFRESH`] (one probe at a time; concurrent callers wait for it).
    async fn now_exact(&self) -> Result<SystemTime> {
        if let Some(now) = self.inner.clock.fresh_now() {
            return Ok(now);
        }
        let _single = self.inner.clock.probing.lock().await;
        if let Some(now) = self.inner.clock.fresh_now() {
            return Ok(now);
        }
        self.inner
            .store
            .put(CLOCK_KEY, bytes::Bytes::new())
            .await
            .map_err(|e| backend_err("clock probe", e))?;
        let msg = self
            .inner
            .store
            .stream
            .get_last_raw_message_by_subject(&self.subject(CLOCK_KEY))
            .await
            .map_err(|e| backend_err("clock probe", e))?;
        self.inner
            .clock
            .probed(SystemTime::from(msg.time), Instant::now());
        self.inner
            .clock
            .fresh_now()
            .ok_or_else(|| backend_err("clock probe", "no sample"))
    }
}

/// `t` in µs, for a time that came from the server's clock.
pub(crate) fn server_us(t: SystemTime) -> Result<i64> {
    to_micros(t).map_err(|_| clock_out_of_range(t))
}

/// `at + d` for a server time and a validated length (a lease, at most a
/// day): checked, so a broken server clock is an error, never a panic.
pub(crate) fn later(at: SystemTime, d: Duration) -> Result<SystemTime> {
    at.checked_add(d).ok_or_else(|| clock_out_of_range(at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_only_moves_forward() {
        let c = ServerClock::default();
        assert!(c.fresh_now().is_none());
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        c.probed(t0, Instant::now());
        let a = c.fresh_now().unwrap();
        assert!(a >= t0);
        // An older stamp does not move it back.
        c.observe(t0 - Duration::from_secs(10));
        c.probed(t0 - Duration::from_secs(10), Instant::now());
        assert!(c.fresh_now().unwrap() >= a);
        // A newer one moves it forward.
        c.observe(t0 + Duration::from_secs(10));
        assert!(c.fresh_now().unwrap() >= t0 + Duration::from_secs(10));
    }

    /// The latest time `SystemTime` can hold here (its seconds are an `i64`).
    fn end_of_time() -> SystemTime {
        let mut t = SystemTime::UNIX_EPOCH;
        let mut step = Duration::from_secs(1 << 62);
        while step >= Duration::from_nanos(1) {
            if let Some(next) = t.checked_add(step) {
                t = next;
            } else {
                step /= 2;
            }
        }
        t
    }

    /// A server stamp at the very end of time (a broken server clock) must
    /// not panic the worker with "overflow when adding duration to instant".
    #[test]
    fn stamps_at_the_end_of_time_do_not_panic() {
        let end = end_of_time();
        let c = ServerClock::default();
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(1))
            .unwrap_or_else(Instant::now);
        c.probed(end, long_ago);
        assert_eq!(c.fresh_now().unwrap(), end);
        c.probed(end, Instant::now());
        c.observe(end);
        assert_eq!(c.fresh_now().unwrap(), end);
    }
}
