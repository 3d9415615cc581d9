//! The workload: the delivery queue, the workers that consume it with one
//! guard or the other, and the fake payment provider they charge.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::{ClaimOptions, EffectKey, Effects, Error, Result, Tenant};
use oncely_any::AnyLedger;

use super::orders::Orders;
use super::report::RunReport;
use super::{Guard, Progress};

/// All deliveries of all orders in one queue, in arrival order.
///
/// Orders are published in a random order; each copy of an order's message
/// arrives at the order's publish slot plus a random redelivery delay of up
/// to `2 × deliveries × workers` slots. So the queue is shuffled, but an
/// order's copies arrive close together, as broker redeliveries and producer
/// retries do, and the workers really process some of them at the same time.
/// (A uniform shuffle of the whole queue would spread them so far apart that
/// they would rarely overlap.)
pub(super) fn delivery_queue(orders: u32, deliveries: u32, workers: usize, seed: u64) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut publish: Vec<u32> = (1..=orders).collect();
    rng.shuffle(&mut publish);
    let k = u64::from(deliveries);
    let window = 2 * k * workers as u64;
    let mut arrivals = Vec::with_capacity(orders as usize * deliveries as usize);
    for (slot, &order) in publish.iter().enumerate() {
        for _ in 0..deliveries {
            arrivals.push((slot as u64 * k + rng.u64(..window.max(1)), order));
        }
    }
    arrivals.sort_unstable();
    arrivals.into_iter().map(|(_, order)| order).collect()
}

/// Demo records are kept this long: enough to inspect them, short enough
/// that `oncely prune` clears them from a shared database the same day.
pub(super) const DEMO_RETENTION: Duration = Duration::from_secs(3600);

/// A delivery attempt that fails retryably is retried this many times before
/// the run gives up (a broker would keep redelivering).
pub(super) const MAX_ATTEMPTS: u32 = 50;

pub(super) async fn run_guard(
    workers: usize,
    queue: &[u32],
    ctx: Arc<Delivery>,
    progress: Arc<dyn Progress>,
) -> Result<RunReport> {
    let guard = ctx.guard;
    let shared = Arc::new(Mutex::new(queue.iter().copied().collect::<VecDeque<u32>>()));
    progress.start(guard, queue.len() as u64);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers {
        tasks.spawn(worker(shared.clone(), ctx.clone(), progress.clone()));
    }
    while let Some(joined) = tasks.join_next().await {
        // Returning early drops the JoinSet, which aborts the other workers.
        joined.map_err(|e| Error::Misuse(format!("a demo worker panicked: {e}")))??;
    }
    let seconds = started.elapsed().as_secs_f64();
    progress.finish(guard);

    let counts: Vec<u32> = ctx
        .provider
        .charges
        .iter()
        .map(|c| c.load(Ordering::SeqCst))
        .collect();
    let charges: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    Ok(RunReport {
        deliveries: queue.len() as u64,
        charges,
        duplicate_charges: counts.iter().map(|&c| u64::from(c.saturating_sub(1))).sum(),
        orders_charged_twice: counts.iter().filter(|&&c| c > 1).count() as u64,
        duplicates_suppressed: ctx.suppressed.load(Ordering::SeqCst),
        orders_paid: ctx.orders.count_paid().await?,
        retries: ctx.retries.load(Ordering::SeqCst),
        seconds,
    })
}

async fn worker(
    queue: Arc<Mutex<VecDeque<u32>>>,
    ctx: Arc<Delivery>,
    progress: Arc<dyn Progress>,
) -> Result<()> {
    loop {
        let Some(order) = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front() else {
            return Ok(());
        };
        let mut attempt = 1;
        let mut backoff = Duration::from_millis(2);
        loop {
            match ctx.deliver(order).await {
                Ok(()) => break,
                Err(e) if e.is_retryable() && attempt < MAX_ATTEMPTS => {
                    ctx.retries.fetch_add(1, Ordering::Relaxed);
                    attempt += 1;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
        progress.delivered();
    }
}

/// Everything one delivery needs, shared by the workers of a run.
pub(super) struct Delivery {
    pub(super) guard: Guard,
    pub(super) orders: Orders,
    pub(super) provider: Provider,
    pub(super) effects: Effects<AnyLedger>,
    pub(super) tenant: Tenant,
    pub(super) opts: ClaimOptions,
    pub(super) suppressed: AtomicU64,
    pub(super) retries: AtomicU64,
}

impl Delivery {
    pub(super) async fn deliver(&self, order: u32) -> Result<()> {
        match self.guard {
            Guard::Naive => {
                // The guard most code starts with: a read, then the effect,
                // then a write. Nothing stops a second delivery between them.
                if self.orders.status(order).await? == "paid" {
                    self.suppressed.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                self.provider.charge(order, None).await;
                self.orders.mark_paid(order).await
            }
            Guard::Oncely => {
                let key = EffectKey::new(&self.tenant, "capture", format!("order-{order}"))?;
                let ran = AtomicBool::new(false);
                let _charge_id: String = self
                    .effects
                    .run(&key, &self.opts, |lease| {
                        ran.store(true, Ordering::Relaxed);
                        async move { Ok(self.provider.charge(order, Some(&lease.provider_key())).await) }
                    })
                    .await?;
                if !ran.load(Ordering::Relaxed) {
                    self.suppressed.fetch_add(1, Ordering::Relaxed);
                }
                // Naturally idempotent (a fixed value): every delivery may
                // repeat it, so it needs no key.
                self.orders.mark_paid(order).await
            }
        }
    }
}

/// An in-process payment provider that counts the charges it performs per
/// order. It deliberately does not deduplicate on the idempotency key (a
/// real provider would, as a backstop after a lease takeover): the demo
/// measures whether the caller avoided the duplicate call.
pub(super) struct Provider {
    charges: Vec<AtomicU32>,
    latency: (Duration, Duration),
    rng: Mutex<fastrand::Rng>,
}

impl Provider {
    pub(super) fn new(orders: u32, latency: (Duration, Duration), seed: u64) -> Self {
        Provider {
            charges: (0..orders).map(|_| AtomicU32::new(0)).collect(),
            latency,
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
        }
    }

    pub(super) async fn charge(&self, order: u32, idempotency_key: Option<&str>) -> String {
        let (lo, hi) = self.latency;
        let spread = (hi - lo).as_micros() as u64;
        let jitter = self.rng.lock().unwrap_or_else(|p| p.into_inner()).u64(..=spread);
        // The network call: the window in which a naive guard's duplicate
        // reads `new` too.
        tokio::time::sleep(lo + Duration::from_micros(jitter)).await;
        let n = self.charges[order as usize - 1].fetch_add(1, Ordering::SeqCst) + 1;
        match idempotency_key {
            Some(k) => format!("ch_{}", &k[..k.len().min(16)]),
            None => format!("ch_order{order}_{n}"),
        }
    }
}
