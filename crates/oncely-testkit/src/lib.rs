//! # oncely-testkit: prove your own handler safe to run twice
//!
//! Brokers deliver at least once, producers re-publish, consumers crash
//! halfway. A handler is safe when none of that changes what the world looks
//! like afterwards. [`TestKit::check`] takes your handler, one message, a way
//! to build a fresh world (your database, fakes of the services you call, a
//! ledger) and a closure that snapshots what a user could observe, and
//! compares the snapshot after each of these runs with the snapshot after a
//! single delivery:
//!
//! | scenario | what a broker did |
//! | --- | --- |
//! | [`Scenario::Once`] | delivered once (the reference state) |
//! | [`Scenario::RedeliveredAfterLostAck`] | delivered, the ack was lost, delivered again with the same message id |
//! | [`Scenario::Republished`] | the producer published the same payload again: a new message id |
//! | [`Scenario::Concurrent`] | N copies at the same instant (one shares the original's id, the others are re-publications) |
//! | [`Scenario::Aborted`] | the consumer died at the k-th await point of the handler (its future dropped there, as an aborted task or a killed process stops), then the broker redelivered; for every k in turn until the handler finishes before its k-th await |
//!
//! A failed delivery (the handler returned `Err`) is redelivered with the
//! same message id after [`TestKit::redelivery_delay`], as a broker would,
//! until it succeeds or [`TestKit::redelivery_timeout`] passes. Every
//! scenario starts from a fresh world.
//!
//! The check fails with a [`Report`] that says which scenario, which run
//! (message ids, the await point) and what differed, as a line diff of the
//! two snapshots' `{:#?}` forms.
//!
//! Keys must come from the payload: a handler that keys its effects on
//! [`Delivery::message_id`] runs twice when a message is re-published, and
//! the [`Scenario::Republished`] run says so.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use oncely_testkit::{Delivery, TestKit};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // A naturally idempotent handler: it sets a field to a fixed value.
//! let summary = TestKit::new("order-1".to_owned())
//!     .check(
//!         async || Arc::new(Mutex::new(Vec::<String>::new())),
//!         async |paid: &Arc<Mutex<Vec<String>>>, d: Delivery<String>| {
//!             tokio::task::yield_now().await;
//!             let mut paid = paid.lock().unwrap();
//!             if !paid.contains(&d.payload) {
//!                 paid.push(d.payload);
//!             }
//!             Ok::<_, String>(())
//!         },
//!         async |paid: &Arc<Mutex<Vec<String>>>| paid.lock().unwrap().clone(),
//!     )
//!     .await
//!     .unwrap_or_else(|report| panic!("{report}"));
//! assert!(summary.abort_points >= 1);
//! # }
//! ```
//!
//! The equivalence is `==` by default; [`TestKit::check_with`] takes your
//! own, for states that are legitimately different after a crash (an
//! at-most-once receipt that a crash abandons for reconciliation instead of
//! sending twice).
//!
//! ## What else every user writes, shipped
//!
//! | module | for |
//! | --- | --- |
//! | [`fakes`] | a payment provider that honours idempotency keys and counts calls ([`FakeProvider`]), a mailer that counts sends ([`FakeMailer`]) |
//! | [`drain`] | end-to-end tests: wait until the queue is drained and the consumers idle, any broker ([`Drain`]) |
//! | [`kill`] | kill a consumer mid-handler the way a crash does, its broker connection with it ([`KillSwitch`]) |
//! | [`dump`] | dump a ledger table with the database's own tool and search it for an outcome's bytes (data-protection tests) |
//!
//! A handler that ran one step and replayed another reports
//! `captured.how | sent.how` (`oncely::How::combine`).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod drain;
pub mod dump;
pub mod fakes;
pub mod kill;

pub use drain::{Drain, NotDrained, Progress};
pub use fakes::{Charge, FakeMailer, FakeProvider, MailLog, ProviderDown};
pub use kill::KillSwitch;

use std::fmt;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

/// One delivery of the message, as a broker hands it to the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery<M> {
    /// The broker's id of this message: `m-1` for the original, a new one
    /// for each re-publication. For logs only: never derive a key from it.
    pub message_id: String,
    /// 1 for the first delivery of this message id, then 2, 3… for the
    /// broker's redeliveries.
    pub attempt: u32,
    /// The decoded payload.
    pub payload: M,
}

/// A run the kit compares with the single delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Scenario {
    /// One delivery (the reference state).
    Once,
    /// Delivered, the ack lost, delivered again with the same message id.
    RedeliveredAfterLostAck,
    /// Delivered, then re-published by the producer with a new message id.
    Republished,
    /// This many copies delivered at the same instant.
    Concurrent {
        /// How many copies.
        copies: usize,
    },
    /// The first delivery aborted at this await point (1-based), then
    /// redelivered.
    Aborted {
        /// The await point at which the handler's future was dropped.
        point: usize,
    },
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scenario::Once => f.write_str("a single delivery"),
            Scenario::RedeliveredAfterLostAck => {
                f.write_str("twice in sequence: redelivered with the same message id after a lost ack")
            }
            Scenario::Republished => {
                f.write_str("twice in sequence: re-published by the producer with a new message id")
            }
            Scenario::Concurrent { copies } => write!(f, "{copies} copies delivered at the same instant"),
            Scenario::Aborted { point } => {
                write!(f, "aborted at await point {point}, then redelivered")
            }
        }
    }
}

/// What went wrong in a run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// A delivery kept failing until the redelivery timeout.
    NeverAcked {
        /// The message id that was never acked.
        message_id: String,
        /// The last attempt and its error.
        last_error: String,
    },
    /// The final state is not equivalent to the single run's.
    Differs {
        /// The single run's snapshot (`{:#?}`).
        single: String,
        /// This run's snapshot (`{:#?}`).
        got: String,
    },
}

/// Why a handler is not safe to run twice: which scenario, which run, what
/// differed. Its `Display` is the readable report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The scenario that failed.
    pub scenario: Scenario,
    /// The deliveries of the run (message ids, attempts, the abort point).
    pub run: String,
    /// What went wrong.
    pub problem: Problem,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "handler is not safe to run twice")?;
        writeln!(f, "  scenario: {}", self.scenario)?;
        writeln!(f, "  run:      {}", self.run)?;
        match &self.problem {
            Problem::NeverAcked {
                message_id,
                last_error,
            } => write!(
                f,
                "  problem:  message {message_id} was never acked; last error: {last_error}"
            ),
            Problem::Differs { single, got } => {
                writeln!(
                    f,
                    "  problem:  the final state differs from a single delivery's (- single, + this run):"
                )?;
                f.write_str(&diff(single, got))
            }
        }
    }
}

impl std::error::Error for Report {}

/// What a passing check exercised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The scenarios that ran, in order (one [`Scenario::Aborted`] per await
    /// point).
    pub scenarios: Vec<Scenario>,
    /// How many await points the handler was aborted at.
    pub abort_points: usize,
    /// Whether the handler finished before an await point could be reached
    /// (false: [`TestKit::max_abort_points`] cut the abort runs short).
    pub all_points_covered: bool,
    /// Failed deliveries that were redelivered, over every scenario.
    pub redeliveries: u64,
}

/// Runs a handler through the scenarios of the [crate docs](crate).
#[derive(Debug, Clone)]
pub struct TestKit<M> {
    message: M,
    copies: usize,
    max_abort_points: usize,
    redelivery_delay: Duration,
    redelivery_timeout: Duration,
}

impl<M: Clone> TestKit<M> {
    /// A kit for one message (the decoded payload): 8 concurrent copies, up
    /// to 200 abort points, redeliveries 20 ms apart for up to 30 s.
    pub fn new(message: M) -> Self {
        TestKit {
            message,
            copies: 8,
            max_abort_points: 200,
            redelivery_delay: Duration::from_millis(20),
            redelivery_timeout: Duration::from_secs(30),
        }
    }

    /// How many copies the concurrent scenario delivers at once (at least 2).
    pub fn copies(mut self, n: usize) -> Self {
        self.copies = n.max(2);
        self
    }

    /// The most await points to abort at (the check stops there and says so
    /// in [`Summary::all_points_covered`]).
    pub fn max_abort_points(mut self, n: usize) -> Self {
        self.max_abort_points = n;
        self
    }

    /// The pause before a failed delivery is redelivered.
    pub fn redelivery_delay(mut self, d: Duration) -> Self {
        self.redelivery_delay = d;
        self
    }

    /// How long a message may keep failing before the check reports it as
    /// never acked (it must cover your lease: a redelivery after an abort
    /// waits for the aborted attempt's lease to expire).
    pub fn redelivery_timeout(mut self, d: Duration) -> Self {
        self.redelivery_timeout = d;
        self
    }

    /// Runs every scenario and compares each final state with the single
    /// delivery's by `==`.
    ///
    /// - `world` builds a fresh world (called once per run);
    /// - `handler` handles one delivery: `Ok` acks, `Err` is redelivered;
    /// - `snapshot` reads what a user could observe.
    pub async fn check<W, R, E, St>(
        &self,
        world: impl AsyncFn() -> W,
        handler: impl AsyncFn(&W, Delivery<M>) -> Result<R, E>,
        snapshot: impl AsyncFn(&W) -> St,
    ) -> Result<Summary, Report>
    where
        E: fmt::Display,
        St: PartialEq + fmt::Debug,
    {
        self.check_with(world, handler, snapshot, |single, other| single == other)
            .await
    }

    /// [`TestKit::check`] with your own equivalence:
    /// `equivalent(single, other)` says whether `other` is an acceptable
    /// final state when a single delivery leaves `single`.
    pub async fn check_with<W, R, E, St>(
        &self,
        world: impl AsyncFn() -> W,
        handler: impl AsyncFn(&W, Delivery<M>) -> Result<R, E>,
        snapshot: impl AsyncFn(&W) -> St,
        equivalent: impl Fn(&St, &St) -> bool,
    ) -> Result<Summary, Report>
    where
        E: fmt::Display,
        St: fmt::Debug,
    {
        let mut summary = Summary {
            scenarios: Vec::new(),
            abort_points: 0,
            all_points_covered: false,
            redeliveries: 0,
        };
        let compare = |scenario: Scenario, run: String, got: &St, single: &St, summary: &mut Summary| {
            summary.scenarios.push(scenario);
            if equivalent(single, got) {
                Ok(())
            } else {
                Err(Report {
                    scenario,
                    run,
                    problem: Problem::Differs {
                        single: format!("{single:#?}"),
                        got: format!("{got:#?}"),
                    },
                })
            }
        };

        // The reference: one delivery.
        let w = world().await;
        self.until_acked(&w, &handler, "m-1", 1, Scenario::Once, &mut summary)
            .await?;
        let single = snapshot(&w).await;
        summary.scenarios.push(Scenario::Once);
        drop(w);

        // Twice in sequence, the same id (a lost ack).
        let scenario = Scenario::RedeliveredAfterLostAck;
        let w = world().await;
        let a = self
            .until_acked(&w, &handler, "m-1", 1, scenario, &mut summary)
            .await?;
        let b = self
            .until_acked(&w, &handler, "m-1", a + 1, scenario, &mut summary)
            .await?;
        let got = snapshot(&w).await;
        let run = format!("{}, then {}", attempts("m-1", a), attempts_from("m-1", a + 1, b));
        compare(scenario, run, &got, &single, &mut summary)?;
        drop(w);

        // Twice in sequence, re-published.
        let scenario = Scenario::Republished;
        let w = world().await;
        let a = self
            .until_acked(&w, &handler, "m-1", 1, scenario, &mut summary)
            .await?;
        let b = self
            .until_acked(&w, &handler, "m-2", 1, scenario, &mut summary)
            .await?;
        let got = snapshot(&w).await;
        let run = format!("{}, then {}", attempts("m-1", a), attempts("m-2", b));
        compare(scenario, run, &got, &single, &mut summary)?;
        drop(w);

        // N copies at the same instant. Copy 0 and 1 share the original id
        // (a redelivery racing the first delivery); the rest are
        // re-publications.
        let scenario = Scenario::Concurrent { copies: self.copies };
        let w = world().await;
        let ids: Vec<String> = (0..self.copies).map(|i| format!("m-{}", i.max(1))).collect();
        let mut per_copy = Vec::new();
        for id in &ids {
            per_copy.push(self.until_acked_counted(&w, &handler, id, 1, scenario));
        }
        let mut runs = Vec::new();
        for (id, result) in ids.iter().zip(join_all(per_copy).await) {
            let (n, redelivered) = result?;
            summary.redeliveries += redelivered;
            runs.push(attempts(id, n));
        }
        let got = snapshot(&w).await;
        compare(scenario, runs.join(", "), &got, &single, &mut summary)?;
        drop(w);

        // Aborted at each await point in turn, then redelivered.
        for point in 1..=self.max_abort_points {
            let scenario = Scenario::Aborted { point };
            let w = world().await;
            let first = Delivery {
                message_id: "m-1".to_owned(),
                attempt: 1,
                payload: self.message.clone(),
            };
            let next = match abort_at(handler(&w, first), point).await {
                // It finished before reaching this await point: every point
                // has been covered.
                Some(Ok(_)) => {
                    summary.all_points_covered = true;
                    break;
                }
                Some(Err(_)) => {
                    summary.redeliveries += 1;
                    2
                }
                None => 2,
            };
            let n = self
                .until_acked(&w, &handler, "m-1", next, scenario, &mut summary)
                .await?;
            let got = snapshot(&w).await;
            let run = format!(
                "m-1 attempt 1 aborted at await point {point}, then {}",
                attempts_from("m-1", 2, n)
            );
            compare(scenario, run, &got, &single, &mut summary)?;
            summary.abort_points = point;
        }
        Ok(summary)
    }

    async fn until_acked<W, R, E>(
        &self,
        w: &W,
        handler: &impl AsyncFn(&W, Delivery<M>) -> Result<R, E>,
        id: &str,
        first_attempt: u32,
        scenario: Scenario,
        summary: &mut Summary,
    ) -> Result<u32, Report>
    where
        E: fmt::Display,
    {
        let (n, redelivered) = self
            .until_acked_counted(w, handler, id, first_attempt, scenario)
            .await?;
        summary.redeliveries += redelivered;
        Ok(n)
    }

    /// Delivers until the handler acks; returns the acked attempt and how
    /// many failed attempts were redelivered.
    async fn until_acked_counted<W, R, E>(
        &self,
        w: &W,
        handler: &impl AsyncFn(&W, Delivery<M>) -> Result<R, E>,
        id: &str,
        first_attempt: u32,
        scenario: Scenario,
    ) -> Result<(u32, u64), Report>
    where
        E: fmt::Display,
    {
        let started = Instant::now();
        let mut attempt = first_attempt;
        let mut redelivered = 0;
        loop {
            let d = Delivery {
                message_id: id.to_owned(),
                attempt,
                payload: self.message.clone(),
            };
            match handler(w, d).await {
                Ok(_) => return Ok((attempt, redelivered)),
                Err(e) if started.elapsed() >= self.redelivery_timeout => {
                    return Err(Report {
                        scenario,
                        run: attempts_from(id, first_attempt, attempt),
                        problem: Problem::NeverAcked {
                            message_id: id.to_owned(),
                            last_error: format!("attempt {attempt}: {e}"),
                        },
                    });
                }
                Err(_) => {
                    redelivered += 1;
                    attempt += 1;
                    tokio::time::sleep(self.redelivery_delay).await;
                }
            }
        }
    }
}

fn attempts(id: &str, last: u32) -> String {
    attempts_from(id, 1, last)
}

fn attempts_from(id: &str, first: u32, last: u32) -> String {
    if first == last {
        format!("{id} attempt {first} acked")
    } else {
        format!("{id} attempts {first}..={last}, the last acked")
    }
}

/// Polls `fut` until it completes or has returned `Pending` `point` times;
/// in the second case it is dropped right there (`None`), as an aborted task
/// is dropped at the await point where it is suspended.
async fn abort_at<F: Future>(fut: F, point: usize) -> Option<F::Output> {
    let mut fut = pin!(fut);
    let mut pending = 0;
    poll_fn(|cx| match fut.as_mut().poll(cx) {
        Poll::Ready(out) => Poll::Ready(Some(out)),
        Poll::Pending => {
            pending += 1;
            if pending >= point {
                Poll::Ready(None)
            } else {
                Poll::Pending
            }
        }
    })
    .await
}

/// A line diff (longest common subsequence) of two renderings, changed
/// lines with two lines of context.
fn diff(a: &str, b: &str) -> String {
    let a: Vec<&str> = a.lines().collect();
    let b: Vec<&str> = b.lines().collect();
    if a.len() * b.len() > 4_000_000 {
        return format!("    - {}\n    + {}\n", a.join("\n    - "), b.join("\n    + "));
    }
    // lcs[i][j]: the longest common subsequence of a[i..] and b[j..].
    let mut lcs = vec![vec![0u32; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let mut lines: Vec<(char, &str)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            lines.push((' ', a[i]));
            i += 1;
            j += 1;
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            lines.push(('-', a[i]));
            i += 1;
        } else {
            lines.push(('+', b[j]));
            j += 1;
        }
    }
    let near_change = |k: usize| {
        let lo = k.saturating_sub(2);
        let hi = (k + 3).min(lines.len());
        lines[lo..hi].iter().any(|(c, _)| *c != ' ')
    };
    let mut out = String::new();
    let mut elided = false;
    for (k, (c, line)) in lines.iter().enumerate() {
        if near_change(k) {
            out.push_str(&format!("    {c} {line}\n"));
            elided = false;
        } else if !elided {
            out.push_str("      …\n");
            elided = true;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_marks_changed_lines_only() {
        let a = "A {\n    x: 1,\n    y: 2,\n    z: 3,\n    w: 4,\n    v: 5,\n    u: 6,\n}";
        let b = "A {\n    x: 1,\n    y: 2,\n    z: 3,\n    w: 4,\n    v: 5,\n    u: 7,\n}";
        let d = diff(a, b);
        assert!(d.contains("    -     u: 6,\n    +     u: 7,\n"), "{d}");
        assert!(d.starts_with("      …\n"), "{d}");
        assert!(!d.contains("x: 1"), "{d}");
    }

    #[tokio::test]
    async fn abort_at_drops_the_future_at_the_chosen_await() {
        let reached = std::sync::atomic::AtomicUsize::new(0);
        let fut = async {
            for _ in 0..3 {
                reached.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
            7
        };
        assert_eq!(abort_at(fut, 2).await, None);
        assert_eq!(reached.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(abort_at(async { 7 }, 1).await, Some(7));
    }
}
