//! Wait, in an end-to-end test, until a consumer has drained its queue and
//! gone quiet, whatever the broker: [`Drain::until`] polls a probe of
//! yours and returns once it says drained and its activity count has not
//! moved for [`Drain::idle`].
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use oncely_testkit::drain::{Drain, Progress};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let handled = Arc::new(AtomicU64::new(0));
//! let worker = {
//!     let handled = handled.clone();
//!     tokio::spawn(async move {
//!         for _ in 0..10 {
//!             tokio::task::yield_now().await;
//!             handled.fetch_add(1, Ordering::SeqCst);
//!         }
//!     })
//! };
//! // Drained: all 10 published messages handled (for a real broker: the
//! // queue's depth is 0, nothing in flight, every message acked once).
//! let progress = Drain::default()
//!     .until(async || {
//!         let n = handled.load(Ordering::SeqCst);
//!         Ok::<_, std::convert::Infallible>(Progress::new(n == 10, n))
//!     })
//!     .await
//!     .unwrap();
//! assert_eq!(progress.activity, 10);
//! worker.await.unwrap();
//! # }
//! ```

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

/// What a probe of the system under test says, once per poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Whether the work is done as far as the probe can see: the queue is
    /// empty, nothing is in flight, every message was settled.
    pub drained: bool,
    /// A count that grows while anything happens (messages handled, acks,
    /// effects run): the system is idle once it stops moving.
    pub activity: u64,
}

impl Progress {
    /// A probe's answer.
    pub fn new(drained: bool, activity: u64) -> Self {
        Progress { drained, activity }
    }
}

/// How long [`Drain::until`] waits, and how it polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    idle: Duration,
    timeout: Duration,
    poll: Duration,
}

impl Default for Drain {
    /// Idle for 200 ms, polled every 20 ms, for at most 60 s.
    fn default() -> Self {
        Drain {
            idle: Duration::from_millis(200),
            timeout: Duration::from_secs(60),
            poll: Duration::from_millis(20),
        }
    }
}

/// Why [`Drain::until`] gave up.
#[derive(Debug)]
pub enum NotDrained<E> {
    /// The timeout passed first; the probe's last answer.
    TimedOut(Option<Progress>),
    /// The probe failed.
    Probe(E),
}

impl<E: fmt::Display> fmt::Display for NotDrained<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotDrained::TimedOut(Some(p)) => write!(
                f,
                "not drained and idle before the timeout (last: drained {}, activity {})",
                p.drained, p.activity
            ),
            NotDrained::TimedOut(None) => f.write_str("not drained before the timeout"),
            NotDrained::Probe(e) => write!(f, "the drain probe failed: {e}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for NotDrained<E> {}

impl Drain {
    /// How long the probe must say drained with no new activity: long
    /// enough for a redelivery that is due to arrive (a broker's
    /// redelivery delay, a consumer's `in_progress_delay`).
    pub fn idle(mut self, d: Duration) -> Self {
        self.idle = d;
        self
    }

    /// The longest wait before [`NotDrained::TimedOut`].
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// How often the probe is asked.
    pub fn poll(mut self, d: Duration) -> Self {
        self.poll = d;
        self
    }

    /// Polls `probe` until it says drained and its activity has not moved
    /// for the idle time (any movement starts the idle time again), and
    /// returns its last answer.
    pub async fn until<E>(
        &self,
        mut probe: impl AsyncFnMut() -> Result<Progress, E>,
    ) -> Result<Progress, NotDrained<E>> {
        let deadline = Instant::now() + self.timeout;
        let mut last: Option<Progress> = None;
        let mut quiet_since = Instant::now();
        loop {
            let now = Instant::now();
            let p = probe().await.map_err(NotDrained::Probe)?;
            if last.is_none_or(|l| l.activity != p.activity || !l.drained) {
                quiet_since = now;
            }
            last = Some(p);
            if p.drained && now.duration_since(quiet_since) >= self.idle {
                return Ok(p);
            }
            if now >= deadline {
                return Err(NotDrained::TimedOut(last));
            }
            tokio::time::sleep(self.poll).await;
        }
    }
}
