//! The delays of every retry loop. A leaf module.

use std::time::Duration;

/// Exponential backoff for retry loops (backends re-running a statement,
/// runners waiting for a holder): `first`, then doubling up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `first` and never exceeds `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            next: first.min(max),
            max,
        }
    }

    /// The delay to wait now; the next one is twice as long (up to `max`).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        delay
    }

    /// Waits [`Backoff::next_delay`], but never past `limit` from now.
    pub async fn wait(&mut self, limit: Duration) {
        tokio::time::sleep(self.next_delay().min(limit)).await;
    }
}
