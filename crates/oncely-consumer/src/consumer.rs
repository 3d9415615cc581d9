//! The loop: take deliveries with bounded concurrency, run the handler, map
//! what happened to a broker action, and shut down without losing an ack.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use oncely::{Error, How};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use crate::broker::{BrokerError, Delivery, Source};
use crate::handler::{Context, Handler, HandlerError};
use crate::telemetry;

/// Settings of a [`Consumer`]; the defaults suit most queues.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// Deliveries handled at once (default 8).
    pub concurrency: usize,
    /// Larger payloads are dead-lettered as `oversized` before decoding
    /// (default 256 KiB).
    pub max_payload_bytes: usize,
    /// How long to wait before redelivering a message whose effect is in
    /// progress elsewhere (default 1 s): the consumer slot is freed at once
    /// instead of blocking for the other holder's whole lease.
    pub in_progress_delay: Duration,
    /// How long to wait before redelivering a message one of whose
    /// at-most-once steps is abandoned (default 60 s). Such a delivery is
    /// held, not acked: the step is performed by the first delivery after a
    /// reconciliation (or `oncely resolve --released`) found it not done,
    /// and replayed once it was resolved as done. A message still held on
    /// its [`ConsumerOptions::max_deliveries`]-th delivery is dead-lettered
    /// with the reason `abandoned` and its effect key, to be replayed once
    /// the step is resolved.
    pub abandoned_delay: Duration,
    /// The first retry's delay; each further delivery doubles it (default
    /// 200 ms).
    pub backoff_base: Duration,
    /// The longest retry delay (default 60 s).
    pub backoff_max: Duration,
    /// A message that fails retryably, or is still held for an abandoned
    /// step, on its `max_deliveries`-th delivery is dead-lettered instead of
    /// redelivered (default 20; brokers that give no delivery count never
    /// reach it).
    pub max_deliveries: u32,
    /// How often to tell the broker the message is still in progress while
    /// the handler runs ([`Delivery::extend`]; default 10 s).
    pub extend_every: Duration,
    /// On shutdown, how long in-flight handlers may run on (default 30 s);
    /// past it they are dropped and their deliveries redelivered at once.
    pub shutdown_grace: Duration,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        ConsumerOptions {
            concurrency: 8,
            max_payload_bytes: 256 * 1024,
            in_progress_delay: Duration::from_secs(1),
            abandoned_delay: Duration::from_secs(60),
            backoff_base: Duration::from_millis(200),
            backoff_max: Duration::from_secs(60),
            max_deliveries: 20,
            extend_every: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

impl ConsumerOptions {
    /// Sets [`ConsumerOptions::concurrency`] (at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Sets [`ConsumerOptions::max_payload_bytes`].
    pub fn max_payload_bytes(mut self, n: usize) -> Self {
        self.max_payload_bytes = n;
        self
    }

    /// Sets [`ConsumerOptions::in_progress_delay`].
    pub fn in_progress_delay(mut self, d: Duration) -> Self {
        self.in_progress_delay = d;
        self
    }

    /// Sets [`ConsumerOptions::abandoned_delay`].
    pub fn abandoned_delay(mut self, d: Duration) -> Self {
        self.abandoned_delay = d;
        self
    }

    /// Sets [`ConsumerOptions::backoff_base`] and
    /// [`ConsumerOptions::backoff_max`].
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max.max(base);
        self
    }

    /// Sets [`ConsumerOptions::max_deliveries`] (at least 1).
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.max_deliveries = n.max(1);
        self
    }

    /// Sets [`ConsumerOptions::extend_every`].
    pub fn extend_every(mut self, d: Duration) -> Self {
        self.extend_every = d.max(Duration::from_millis(1));
        self
    }

    /// Sets [`ConsumerOptions::shutdown_grace`].
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }

    /// The delay before the next delivery of a message that failed
    /// retryably on its `delivery`-th delivery: base × 2^(delivery−1),
    /// capped.
    pub fn backoff_for(&self, delivery: u32) -> Duration {
        let exp = delivery.saturating_sub(1).min(20);
        self.backoff_base.saturating_mul(1 << exp).min(self.backoff_max)
    }
}

/// What the loop does with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Ack: the effects are done (now or before).
    Ack(&'static str),
    /// Redeliver after a delay (`in_progress`, `abandoned`, `retry` or
    /// `shutdown`).
    Redeliver {
        /// The result label (`in_progress`, `abandoned`, `retry`,
        /// `shutdown`).
        result: &'static str,
        /// When.
        delay: Duration,
        /// Why, for the logs.
        reason: String,
    },
    /// Dead-letter with a reason; never redelivered here.
    DeadLetter {
        /// The reason class (a metric label).
        class: &'static str,
        /// The reason, for the dead-letter destination and the logs.
        reason: String,
    },
}

impl Action {
    /// What a handler's result means for a delivery seen for the
    /// `delivery`-th time (1 when the broker gives no count).
    pub fn decide(result: Result<How, HandlerError>, delivery: u32, opts: &ConsumerOptions) -> Action {
        let retry = |reason: String| {
            if delivery >= opts.max_deliveries {
                Action::DeadLetter {
                    class: "max_deliveries",
                    reason: format!("gave up after {delivery} deliveries; last failure: {reason}"),
                }
            } else {
                Action::Redeliver {
                    result: "retry",
                    delay: opts.backoff_for(delivery),
                    reason,
                }
            }
        };
        match result {
            Ok(How::Ran) => Action::Ack("ran"),
            Ok(How::Replayed) => Action::Ack("replayed"),
            Err(HandlerError::Oncely(e)) => match e {
                // Someone else holds the lease (or just took it over): let
                // them finish; come back instead of holding this slot.
                Error::InProgress { .. } | Error::LeaseLost { .. } => Action::Redeliver {
                    result: "in_progress",
                    delay: opts.in_progress_delay,
                    reason: e.to_string(),
                },
                // Held until the step is reconciled: an ack here would leave
                // no delivery to perform a step found not done. Past the
                // last delivery, parked with its key for a person to replay.
                Error::Abandoned { .. } if delivery >= opts.max_deliveries => Action::DeadLetter {
                    class: "abandoned",
                    reason: format!(
                        "{e}; held for {delivery} deliveries while it awaited reconciliation: \
                         resolve the step (oncely reconcile, oncely resolve), then replay this message"
                    ),
                },
                Error::Abandoned { .. } => Action::Redeliver {
                    result: "abandoned",
                    delay: opts.abandoned_delay,
                    reason: e.to_string(),
                },
                // The effect ran once and its outcome was erased on a
                // data-protection request: nothing is left to do or replay.
                Error::Erased { .. } => Action::Ack("erased"),
                Error::Terminal { .. } => Action::DeadLetter {
                    class: "terminal",
                    reason: e.to_string(),
                },
                e if e.is_retryable() => retry(e.to_string()),
                e => Action::DeadLetter {
                    class: "rejected",
                    reason: e.to_string(),
                },
            },
            Err(e @ HandlerError::MissingField(_)) => Action::DeadLetter {
                class: "missing_field",
                reason: e.to_string(),
            },
            Err(e @ HandlerError::Poison(_)) => Action::DeadLetter {
                class: "poison",
                reason: e.to_string(),
            },
            Err(e @ HandlerError::Retry(_)) => retry(e.to_string()),
        }
    }

    fn result(&self) -> &'static str {
        match self {
            Action::Ack(result) | Action::Redeliver { result, .. } => result,
            Action::DeadLetter { .. } => "dead_letter",
        }
    }
}

/// What a consumer did, counted since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Deliveries taken from the source.
    pub received: u64,
    /// Acked: an effect ran in this delivery.
    pub ran: u64,
    /// Acked: every effect had been done before (suppressed duplicates;
    /// an effect whose outcome was erased too, `Error::Erased`).
    pub replayed: u64,
    /// Held for a later delivery: an at-most-once step was found abandoned
    /// (awaiting reconciliation).
    pub abandoned: u64,
    /// Redelivered later: in progress elsewhere.
    pub in_progress: u64,
    /// Redelivered with backoff: a retryable failure.
    pub retried: u64,
    /// Dead-lettered.
    pub dead_lettered: u64,
    /// Redelivered because shutdown's grace ran out.
    pub shutdown: u64,
    /// Settlements the broker refused (it redelivers those).
    pub settle_errors: u64,
}

impl Stats {
    /// Deliveries whose handler is still running (received and not yet
    /// decided).
    pub fn in_flight(&self) -> u64 {
        self.received.saturating_sub(
            self.ran
                + self.replayed
                + self.abandoned
                + self.in_progress
                + self.retried
                + self.dead_lettered
                + self.shutdown,
        )
    }

    /// The sum of two consumers' stats.
    pub fn plus(self, o: Stats) -> Stats {
        Stats {
            received: self.received + o.received,
            ran: self.ran + o.ran,
            replayed: self.replayed + o.replayed,
            abandoned: self.abandoned + o.abandoned,
            in_progress: self.in_progress + o.in_progress,
            retried: self.retried + o.retried,
            dead_lettered: self.dead_lettered + o.dead_lettered,
            shutdown: self.shutdown + o.shutdown,
            settle_errors: self.settle_errors + o.settle_errors,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    received: AtomicU64,
    ran: AtomicU64,
    replayed: AtomicU64,
    abandoned: AtomicU64,
    in_progress: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    shutdown: AtomicU64,
    settle_errors: AtomicU64,
}

impl Counters {
    fn add(&self, result: &str) {
        let c = match result {
            "ran" => &self.ran,
            "replayed" | "erased" => &self.replayed,
            "abandoned" => &self.abandoned,
            "in_progress" => &self.in_progress,
            "retry" => &self.retried,
            "dead_letter" => &self.dead_lettered,
            _ => &self.shutdown,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Stats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            received: g(&self.received),
            ran: g(&self.ran),
            replayed: g(&self.replayed),
            abandoned: g(&self.abandoned),
            in_progress: g(&self.in_progress),
            retried: g(&self.retried),
            dead_lettered: g(&self.dead_lettered),
            shutdown: g(&self.shutdown),
            settle_errors: g(&self.settle_errors),
        }
    }
}

/// A broker-neutral consumer: runs a [`Handler`] over a [`Source`].
///
/// For each delivery, in a task of its own (at most
/// [`ConsumerOptions::concurrency`] at once):
///
/// | what happened | broker action |
/// | --- | --- |
/// | payload over [`ConsumerOptions::max_payload_bytes`] | dead-letter `oversized` |
/// | `decode` failed | dead-letter `undecodable` |
/// | `Ok(How::Ran)` / `Ok(How::Replayed)` | ack |
/// | an effect whose outcome was erased ([`Error::Erased`]: it ran once, and is never run again) | ack |
/// | an abandoned at-most-once step | held: redeliver after [`ConsumerOptions::abandoned_delay`] until the step is reconciled (then the delivery performs or replays it); dead-letter `abandoned` on the last allowed delivery |
/// | in progress elsewhere, lease lost | redeliver after [`ConsumerOptions::in_progress_delay`] |
/// | retryable failure, or an effect that ran with its completion not recorded ([`Error::OutcomeUnknown`]: the redelivery replays it or takes it over) | redeliver after backoff; dead-letter `max_deliveries` on the last allowed delivery |
/// | missing key field, poison, stored terminal failure, any other oncely error | dead-letter with the reason |
///
/// While the handler runs, oncely renews its lease and the loop calls
/// [`Delivery::extend`] every [`ConsumerOptions::extend_every`]. Every
/// dead-letter is counted in `oncely_consumer_dead_letters_total{reason}`.
#[derive(Debug)]
pub struct Consumer<H> {
    name: String,
    handler: Arc<H>,
    opts: ConsumerOptions,
    counters: Arc<Counters>,
}

impl<H: Handler> Consumer<H> {
    /// A consumer named `name` (the metrics' `consumer` label).
    pub fn new(name: impl Into<String>, handler: H) -> Self {
        Consumer {
            name: name.into(),
            handler: Arc::new(handler),
            opts: ConsumerOptions::default(),
            counters: Arc::default(),
        }
    }

    /// Sets the options.
    pub fn options(mut self, opts: ConsumerOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The consumer's name (the metrics' `consumer` label).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// What the consumer has done so far.
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    /// Takes deliveries from `source` until `shutdown` resolves, the source
    /// closes or fails. Then it stops taking deliveries, lets the in-flight
    /// ones finish for up to [`ConsumerOptions::shutdown_grace`] and settles
    /// them; handlers still running after that are dropped (oncely's
    /// operations are cancel-safe; their leases expire) and their deliveries
    /// redelivered at once. A source error is returned after that, so the
    /// caller can reconnect.
    pub async fn run<S: Source>(
        &self,
        mut source: S,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Stats, BrokerError> {
        let permits = Arc::new(Semaphore::new(self.opts.concurrency));
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut failed = None;
        loop {
            while tasks.try_join_next().is_some() {}
            let permit = tokio::select! {
                biased;
                () = &mut shutdown => break,
                p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            };
            let next = tokio::select! {
                biased;
                () = &mut shutdown => break,
                next = source.next() => next,
            };
            match next {
                Ok(Some(delivery)) => {
                    self.counters.received.fetch_add(1, Ordering::Relaxed);
                    let job = Settle {
                        name: self.name.clone(),
                        handler: self.handler.clone(),
                        opts: self.opts.clone(),
                        counters: self.counters.clone(),
                    };
                    let stop = stop_rx.clone();
                    tasks.spawn(async move {
                        job.process(delivery, stop).await;
                        drop(permit);
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(consumer = %self.name, error = %e, "source failed; settling in-flight deliveries");
                    failed = Some(e);
                    break;
                }
            }
        }
        let drained = tokio::time::timeout(self.opts.shutdown_grace, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            let _ = stop_tx.send(true);
            while tasks.join_next().await.is_some() {}
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(self.stats()),
        }
    }
}

/// What one delivery's task needs.
struct Settle<H> {
    name: String,
    handler: Arc<H>,
    opts: ConsumerOptions,
    counters: Arc<Counters>,
}

impl<H: Handler> Settle<H> {
    async fn process<D: Delivery>(&self, delivery: D, mut stop: watch::Receiver<bool>) {
        let broker_id = delivery.broker_id().to_owned();
        let count = delivery.delivery_count();
        let action = if delivery.payload().len() > self.opts.max_payload_bytes {
            Action::DeadLetter {
                class: "oversized",
                reason: format!(
                    "payload is {} bytes, the limit is {}",
                    delivery.payload().len(),
                    self.opts.max_payload_bytes
                ),
            }
        } else {
            match self.handler.decode(delivery.payload()) {
                Err(reason) => Action::DeadLetter {
                    class: "undecodable",
                    reason,
                },
                Ok(message) => {
                    let ctx = Context {
                        broker_id: broker_id.clone(),
                        delivery_count: count,
                    };
                    let started = Instant::now();
                    let work = self.handler.handle(message, ctx);
                    let extend = async {
                        loop {
                            tokio::time::sleep(self.opts.extend_every).await;
                            if let Err(e) = delivery.extend().await {
                                tracing::warn!(consumer = %self.name, broker_id, error = %e, "in-progress ack failed");
                            }
                        }
                    };
                    let result = tokio::select! {
                        r = work => Some(r),
                        () = extend => None,
                        _ = stop.wait_for(|s| *s) => None,
                    };
                    telemetry::handler_seconds(&self.name, started.elapsed().as_secs_f64());
                    match result {
                        Some(r) => Action::decide(r, count.unwrap_or(1), &self.opts),
                        None => Action::Redeliver {
                            result: "shutdown",
                            delay: Duration::ZERO,
                            reason: "shutdown grace ran out while the handler ran".to_owned(),
                        },
                    }
                }
            }
        };
        let result = action.result();
        telemetry::delivery(&self.name, result);
        self.counters.add(result);
        let (settled, what) = match action {
            Action::Ack(_) => (delivery.ack().await, "ack"),
            Action::Redeliver { delay, reason, .. } => {
                tracing::debug!(consumer = %self.name, broker_id, ?count, ?delay, reason, "redelivering");
                (delivery.nack(delay).await, "nack")
            }
            Action::DeadLetter { class, reason } => {
                tracing::warn!(consumer = %self.name, broker_id, ?count, class, reason, "dead-lettering");
                telemetry::dead_letter(&self.name, class);
                (
                    delivery.dead_letter(&format!("{class}: {reason}")).await,
                    "dead_letter",
                )
            }
        };
        if let Err(e) = settled {
            // The broker redelivers what it did not hear about; the effects
            // are in the ledger, so the redelivery is a replay.
            tracing::warn!(consumer = %self.name, broker_id, action = what, error = %e, "settlement refused");
            telemetry::settle_error(&self.name, what);
            self.counters.settle_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}
