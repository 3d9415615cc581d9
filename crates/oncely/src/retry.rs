//! The one retry loop of every backend: an operation that failed with an
//! error worth another try runs again after a [`Backoff`] pause, until it
//! settles, its attempts are spent or its window has passed.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::backoff::Backoff;

/// How a retry loop spaces and bounds its attempts: the pauses of a
/// [`Backoff`], the first few retries run at once if asked, at most so many
/// attempts, none started past a deadline. [`retry`] runs an operation with
/// it ([`retry_with`] one that needs its caller's connection in every run).
#[derive(Debug, Clone)]
pub struct Attempts {
    backoff: Backoff,
    at_once: u32,
    most: Option<u32>,
    deadline: Option<Instant>,
    runs: u32,
}

impl Attempts {
    /// Every retry after `backoff`'s next pause; no limit on attempts or
    /// time until [`Attempts::at_most`] or [`Attempts::within`] sets one.
    pub fn new(backoff: Backoff) -> Self {
        Attempts {
            backoff,
            at_once: 0,
            most: None,
            deadline: None,
            runs: 0,
        }
    }

    /// At most `n` attempts in all (the first included).
    pub fn at_most(mut self, n: u32) -> Self {
        self.most = Some(n);
        self
    }

    /// The first `n` retries run at once, without a pause (what made them
    /// necessary, a conflict lost to a winner, is usually resolved by then);
    /// the pauses start after them.
    pub fn at_once(mut self, n: u32) -> Self {
        self.at_once = n;
        self
    }

    /// No retry starts once `window` from now has passed, and no pause
    /// reaches past it. A window too long for [`Instant`] is no deadline.
    pub fn within(mut self, window: Duration) -> Self {
        self.deadline = Instant::now().checked_add(window);
        self
    }

    /// The time left in the window (`Duration::MAX` without one).
    pub fn left(&self) -> Duration {
        self.deadline
            .map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now()))
    }

    /// After a failed attempt: the pause before the next one, or `None`
    /// when no attempt is left (the limit is reached or the window has
    /// passed). Counts the attempt; waits nothing.
    pub fn pause(&mut self) -> Option<Duration> {
        self.runs += 1;
        if self.most.is_some_and(|most| self.runs >= most) || self.left().is_zero() {
            return None;
        }
        if self.runs <= self.at_once {
            return Some(Duration::ZERO);
        }
        Some(self.backoff.next_delay().min(self.left()))
    }

    /// After a failed attempt: waits [`Attempts::pause`] and says whether
    /// another attempt may run.
    pub async fn again(&mut self) -> bool {
        match self.pause() {
            Some(pause) if !pause.is_zero() => {
                tokio::time::sleep(pause).await;
                true
            }
            Some(_) => true,
            None => false,
        }
    }
}

/// Runs `op` until it settles: its answer, or an error `retryable` refuses,
/// or the last error once `attempts` allow no other run. Between runs, the
/// pause [`Attempts`] says.
pub async fn retry<T, E, R, F, Fut>(attempts: Attempts, retryable: R, mut op: F) -> Result<T, E>
where
    R: FnMut(&E) -> bool,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let ((), answer) = retry_with((), attempts, retryable, |()| {
        let run = op();
        async move { ((), run.await) }
    })
    .await;
    answer
}

/// [`retry`] for an operation that needs something mutable of its caller's
/// in every run (a connection, what the runs have settled so far):
/// `state` is handed to each run, which gives it back with its answer, and
/// comes back with the loop's answer.
///
/// A closure that borrowed the state instead would return a future
/// borrowing from each call (a higher-ranked lifetime), which the compiler
/// cannot always prove `Send`; a state moved in and out has one lifetime,
/// the caller's.
pub async fn retry_with<S, T, E, R, F, Fut>(
    mut state: S,
    mut attempts: Attempts,
    mut retryable: R,
    mut op: F,
) -> (S, Result<T, E>)
where
    R: FnMut(&E) -> bool,
    F: FnMut(S) -> Fut,
    Fut: Future<Output = (S, Result<T, E>)>,
{
    loop {
        let (back, run) = op(state).await;
        state = back;
        match run {
            Ok(answer) => return (state, Ok(answer)),
            Err(e) if retryable(&e) && attempts.again().await => {}
            Err(e) => return (state, Err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pauses(mut attempts: Attempts) -> Vec<u64> {
        std::iter::from_fn(|| attempts.pause())
            .map(|p| p.as_millis() as u64)
            .collect()
    }

    #[test]
    fn pauses_follow_the_backoff_after_the_retries_run_at_once() {
        let backoff = Backoff::new(Duration::from_millis(4), Duration::from_millis(128));
        assert_eq!(
            pauses(Attempts::new(backoff.clone()).at_most(8).at_once(1)),
            [0, 4, 8, 16, 32, 64, 128]
        );
        assert_eq!(pauses(Attempts::new(backoff).at_most(4)), [4, 8, 16]);
    }

    #[test]
    fn no_attempt_starts_past_the_window() {
        let backoff = Backoff::new(Duration::from_millis(4), Duration::from_millis(128));
        assert_eq!(
            pauses(Attempts::new(backoff.clone()).within(Duration::ZERO)),
            Vec::<u64>::new()
        );
        let mut a = Attempts::new(backoff).within(Duration::from_secs(3600));
        assert!(a.pause().is_some());
        assert_eq!(
            Attempts::new(Backoff::new(Duration::ZERO, Duration::ZERO))
                .within(Duration::MAX)
                .left(),
            Duration::MAX
        );
    }

    #[tokio::test]
    async fn retry_stops_at_an_error_it_may_not_retry_or_when_attempts_run_out() {
        let quick = || Attempts::new(Backoff::new(Duration::ZERO, Duration::ZERO));
        let mut runs = 0;
        let r: Result<(), u32> = retry(
            quick().at_most(3),
            |_| true,
            || {
                runs += 1;
                std::future::ready(Err(runs))
            },
        )
        .await;
        assert_eq!((r, runs), (Err(3), 3));
        let mut runs = 0;
        let r: Result<(), u32> = retry(
            quick(),
            |e| *e < 2,
            || {
                runs += 1;
                std::future::ready(Err(runs))
            },
        )
        .await;
        assert_eq!(r, Err(2));
        let mut runs = 0;
        let r: Result<u32, u32> = retry(
            quick(),
            |_| true,
            || {
                runs += 1;
                std::future::ready(if runs < 5 { Err(runs) } else { Ok(runs) })
            },
        )
        .await;
        assert_eq!(r, Ok(5));
    }

    #[tokio::test]
    async fn retry_with_hands_the_state_to_every_run_and_back() {
        let quick = || Attempts::new(Backoff::new(Duration::ZERO, Duration::ZERO));
        let mut seen = Vec::new();
        let (seen, r): (_, Result<usize, usize>) = retry_with(
            &mut seen,
            quick().at_most(5),
            |_| true,
            |seen| async move {
                seen.push(seen.len());
                let runs = seen.len();
                (seen, if runs < 3 { Err(runs) } else { Ok(runs) })
            },
        )
        .await;
        assert_eq!((r, seen.as_slice()), (Ok(3), [0, 1, 2].as_slice()));
        let (runs, r): (u32, Result<(), u32>) = retry_with(
            0,
            quick().at_most(4),
            |_| true,
            |runs| async move { (runs + 1, Err(runs + 1)) },
        )
        .await;
        assert_eq!((runs, r), (4, Err(4)));
    }
}
