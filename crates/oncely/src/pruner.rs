//! [`Pruner`]: a background task that keeps a ledger pruned, in bounded
//! batches at a bounded rate, so that deleting a backlog of millions of
//! expired records never becomes a delete storm that claims wait behind.

use std::num::NonZeroU64;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::backoff::Backoff;
use crate::error::Result;
use crate::ledger::Ledger;
use crate::telemetry;

/// Prunes a ledger in the background: calls [`Ledger::prune`] with at most
/// [`PrunerOptions::batch`] records per call, no faster than
/// [`PrunerOptions::rows_per_second`], and rests for
/// [`PrunerOptions::idle`] once a call finds fewer records due than it asked
/// for (nothing left, for now).
///
/// A batch is the unit of work the backend commits at once (SQL backends
/// delete it in transactions of at most a few hundred rows each, on their
/// expiry index, and raise the horizon in the same transaction), so claims
/// running meanwhile wait on one small transaction at most; the rate limit
/// bounds the write load (WAL, replication, vacuum) the prune adds.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use oncely::MemoryLedger;
/// use oncely::pruner::{Pruner, PrunerOptions};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let ledger = Arc::new(MemoryLedger::new());
/// let handle = Pruner::new(ledger, PrunerOptions::default().batch(500).rows_per_second(5_000)).spawn();
/// // … the application runs …
/// let stats = handle.stop().await; // finishes the batch in flight, then returns
/// assert_eq!(stats.rows, 0);
/// # }
/// ```
#[derive(Debug)]
pub struct Pruner<L> {
    ledger: L,
    options: PrunerOptions,
}

/// How a [`Pruner`] paces itself. Defaults: batches of 500, at most 5,000
/// rows a second, a rest of 30 seconds when nothing is due.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrunerOptions {
    /// Most records one [`Ledger::prune`] call deletes.
    pub batch: NonZeroU64,
    /// Most records deleted per second, on average over each batch; `None`:
    /// no limit (one batch right after the other while records are due).
    pub rows_per_second: Option<NonZeroU64>,
    /// How long to rest after a call that found fewer records due than its
    /// batch, before looking again.
    pub idle: Duration,
    /// The longest rest after a failed call (the rests double from one
    /// second up to this, and start again after a success).
    pub max_error_backoff: Duration,
}

impl Default for PrunerOptions {
    fn default() -> Self {
        PrunerOptions {
            batch: NonZeroU64::new(500).expect("nonzero"),
            rows_per_second: NonZeroU64::new(5_000),
            idle: Duration::from_secs(30),
            max_error_backoff: Duration::from_secs(60),
        }
    }
}

impl PrunerOptions {
    /// Sets [`PrunerOptions::batch`](#structfield.batch) (0 is taken as 1).
    pub fn batch(mut self, n: u64) -> Self {
        self.batch = NonZeroU64::new(n).unwrap_or(NonZeroU64::MIN);
        self
    }

    /// Sets [`PrunerOptions::rows_per_second`](#structfield.rows_per_second)
    /// (0 is taken as 1).
    pub fn rows_per_second(mut self, n: u64) -> Self {
        self.rows_per_second = Some(NonZeroU64::new(n).unwrap_or(NonZeroU64::MIN));
        self
    }

    /// Removes the rate limit: batches run back to back while records are due.
    pub fn unlimited(mut self) -> Self {
        self.rows_per_second = None;
        self
    }

    /// Sets [`PrunerOptions::idle`](#structfield.idle).
    pub fn idle(mut self, rest: Duration) -> Self {
        self.idle = rest;
        self
    }

    /// Sets [`PrunerOptions::max_error_backoff`](#structfield.max_error_backoff).
    pub fn max_error_backoff(mut self, rest: Duration) -> Self {
        self.max_error_backoff = rest;
        self
    }

    /// How long a batch that deleted `rows` must take at the rate limit.
    fn budget(&self, rows: u64) -> Duration {
        match self.rows_per_second {
            Some(rate) => Duration::from_secs_f64(rows as f64 / rate.get() as f64),
            None => Duration::ZERO,
        }
    }
}

/// What a [`Pruner`] has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrunerStats {
    /// Records deleted.
    pub rows: u64,
    /// [`Ledger::prune`] calls that succeeded.
    pub batches: u64,
    /// [`Ledger::prune`] calls that failed (each was logged and retried).
    pub errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    rows: AtomicU64,
    batches: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> PrunerStats {
        PrunerStats {
            rows: self.rows.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

/// A running [`Pruner`]. [`PrunerHandle::stop`] stops it gracefully;
/// dropping the handle stops it too (after the batch in flight), without
/// waiting for it.
#[derive(Debug)]
#[must_use = "dropping the handle stops the pruner"]
pub struct PrunerHandle {
    stop: watch::Sender<bool>,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
}

impl PrunerHandle {
    /// What the pruner has done so far.
    pub fn stats(&self) -> PrunerStats {
        self.counters.snapshot()
    }

    /// Whether the pruner's task has ended (stopped, or panicked).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the pruner: a rest is cut short, a batch in flight finishes
    /// (so its records are deleted and the horizon raised, or neither).
    /// Returns once the task has ended, with what it did in all.
    pub async fn stop(self) -> PrunerStats {
        let _ = self.stop.send(true);
        if let Err(e) = self.task.await
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
        self.counters.snapshot()
    }
}

impl<L: Ledger + 'static> Pruner<L> {
    /// A pruner of `ledger` (an `Arc` of the ledger, or a cheap clone of it).
    pub fn new(ledger: L, options: PrunerOptions) -> Self {
        Pruner { ledger, options }
    }

    /// Starts pruning on a tokio task (so it needs a tokio runtime).
    pub fn spawn(self) -> PrunerHandle {
        let (stop, stopped) = watch::channel(false);
        let counters = Arc::new(Counters::default());
        let span = telemetry::pruner_span(
            self.ledger.backend(),
            self.options.batch.get(),
            self.options.rows_per_second.map(NonZeroU64::get),
        );
        let task = tokio::spawn(self.run(stopped, counters.clone()).instrument(span));
        PrunerHandle { stop, counters, task }
    }

    /// Prunes in the foreground until nothing is due or `max_rows` records
    /// are gone, at the options' batch size and rate (`idle` and the error
    /// backoff do not apply: a failed batch ends the call with its error,
    /// after the batches before it were committed). Calls `on_batch` with the
    /// rows of each batch, for a progress bar. Returns what it did. This is
    /// what `oncely prune` runs; a service keeps a [`Pruner::spawn`]ed one.
    pub async fn drain(&self, max_rows: u64, mut on_batch: impl FnMut(u64)) -> Result<PrunerStats> {
        let backend = self.ledger.backend();
        let mut stats = PrunerStats::default();
        while stats.rows < max_rows {
            let batch = self.options.batch.get().min(max_rows - stats.rows);
            let started = Instant::now();
            let span = telemetry::prune_batch_span(batch);
            let rows = match self.ledger.prune(batch).instrument(span.clone()).await {
                Ok(rows) => rows,
                Err(e) => {
                    telemetry::prune_batch_failed(&span, backend, &e, Duration::ZERO);
                    return Err(e);
                }
            };
            let took = started.elapsed();
            telemetry::prune_batch_done(&span, backend, rows, took);
            stats.rows += rows;
            stats.batches += 1;
            on_batch(rows);
            if rows < batch {
                break;
            }
            tokio::time::sleep(self.options.budget(rows).saturating_sub(took)).await;
        }
        Ok(stats)
    }

    async fn run(self, mut stopped: watch::Receiver<bool>, counters: Arc<Counters>) {
        let Pruner { ledger, options } = self;
        let backend = ledger.backend();
        let batch = options.batch.get();
        let mut failures = Backoff::new(Duration::from_secs(1), options.max_error_backoff);
        loop {
            if rest(&mut stopped, Duration::ZERO).await {
                break;
            }
            let started = Instant::now();
            let span = telemetry::prune_batch_span(batch);
            let result = ledger.prune(batch).instrument(span.clone()).await;
            let took = started.elapsed();
            let pause = match result {
                Ok(rows) => {
                    counters.rows.fetch_add(rows, Ordering::Relaxed);
                    counters.batches.fetch_add(1, Ordering::Relaxed);
                    telemetry::prune_batch_done(&span, backend, rows, took);
                    failures = Backoff::new(Duration::from_secs(1), options.max_error_backoff);
                    if rows < batch {
                        options.idle
                    } else {
                        options.budget(rows).saturating_sub(took)
                    }
                }
                Err(e) => {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    let pause = failures.next_delay();
                    telemetry::prune_batch_failed(&span, backend, &e, pause);
                    pause
                }
            };
            if rest(&mut stopped, pause).await {
                break;
            }
        }
        tracing::debug!("pruner stopped");
    }
}

/// Rests for `d`, cut short by a stop or by the handle being dropped (the
/// channel closing); returns whether to stop.
async fn rest(stopped: &mut watch::Receiver<bool>, d: Duration) -> bool {
    // `has_changed` fails once the handle is gone.
    if *stopped.borrow() || stopped.has_changed().is_err() {
        return true;
    }
    if d.is_zero() {
        return false;
    }
    tokio::select! {
        () = tokio::time::sleep(d) => *stopped.borrow(),
        changed = stopped.changed() => changed.is_err() || *stopped.borrow(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options() {
        let o = PrunerOptions::default().batch(0).rows_per_second(0);
        assert_eq!(o.batch.get(), 1);
        assert_eq!(o.rows_per_second.map(NonZeroU64::get), Some(1));
        let o = PrunerOptions::default().rows_per_second(1_000);
        assert_eq!(o.budget(500), Duration::from_millis(500));
        assert_eq!(o.clone().unlimited().budget(500), Duration::ZERO);
    }
}
