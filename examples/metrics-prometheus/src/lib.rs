//! # metrics-prometheus: oncely's metrics on a Prometheus `/metrics` endpoint
//!
//! oncely records through the [`metrics`](https://docs.rs/metrics) facade
//! (every name is in [`oncely::telemetry`] and
//! [`oncely_consumer::telemetry`]); any `metrics` exporter publishes them.
//! With `metrics-exporter-prometheus` it is [`install`]: an HTTP listener
//! that answers `GET /metrics`, and buckets for the histograms, the
//! redelivery gap's from [`REDELIVERY_GAP_BUCKETS`] (1 s to 30 days).
//!
//! [`run_workload`] is a consumer ([`oncely_consumer`] over its in-memory
//! broker) on a SQLite ledger file, driven through a script whose every
//! number is known in advance ([`Workload::expected`]): first deliveries,
//! duplicates re-published at once and after a gap, workers that crash
//! holding a short lease (the consumer takes it over once it has expired on
//! the ledger's clock), and zombies: workers that stall past their lease,
//! are taken over, and then try to complete, which their fence refuses.
//!
//! How to read retention from the gap histogram is in this example's
//! README.md.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};
use oncely::backend::Record;
use oncely::telemetry::{CLAIM_SECONDS, REDELIVERY_GAP_BUCKETS, REDELIVERY_GAP_SECONDS};
use oncely::{ClaimOptions, EffectKey, Effects, Error, Failure, How, Tenant};
use oncely_consumer::memory::MemoryBroker;
use oncely_consumer::telemetry::HANDLER_SECONDS;
use oncely_consumer::{Consumer, ConsumerOptions, Context, Handler, HandlerError, Stats, json};
use oncely_sqlite::SqliteLedger;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// The consumer's name: the `consumer` label of `oncely_consumer_*`.
pub const CONSUMER: &str = "payments";
/// The effect kind: the `kind` label of the `oncely_*` metrics.
pub const KIND: &str = "capture";

/// Bucket bounds (seconds) for the latency histograms
/// (`oncely_claim_seconds`, `oncely_consumer_handler_seconds`): 0.5 ms to
/// 10 s. Without buckets the exporter renders a histogram as a summary,
/// whose quantiles cannot be added up across instances.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The exporter as a service configures it: an HTTP listener on `listen`
/// (any path answers; scrape `/metrics`) and buckets for oncely's
/// histograms.
pub fn prometheus_builder(listen: SocketAddr) -> Result<PrometheusBuilder, BuildError> {
    PrometheusBuilder::new()
        .with_http_listener(listen)
        .set_buckets_for_metric(
            Matcher::Full(REDELIVERY_GAP_SECONDS.to_owned()),
            REDELIVERY_GAP_BUCKETS,
        )?
        .set_buckets_for_metric(Matcher::Full(CLAIM_SECONDS.to_owned()), LATENCY_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(HANDLER_SECONDS.to_owned()), LATENCY_BUCKETS)
}

/// Binds `listen`, serves the metrics there from a task on the current
/// Tokio runtime, and installs the process-wide recorder (once per
/// process). Fails if the address cannot be bound.
pub fn install(listen: SocketAddr) -> Result<(), BuildError> {
    prometheus_builder(listen)?.install()
}

/// The message: pay for an order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PayOrder {
    /// The order; the effect key is derived from it.
    pub order_id: String,
    /// Cents.
    pub amount: i64,
}

/// A payment provider that honours idempotency keys, as real ones do: the
/// same key returns the first charge instead of charging again.
#[derive(Debug, Default)]
pub struct Provider {
    charges: Mutex<HashMap<String, String>>,
    calls: AtomicU64,
}

impl Provider {
    /// Charges `amount` for `order` once per `idempotency_key`; returns the
    /// charge id.
    pub fn capture(&self, idempotency_key: &str, order: &str, amount: i64) -> String {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        let n = charges.len();
        charges
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| format!("ch_{n}_{order}_{amount}"))
            .clone()
    }

    /// Distinct charges made.
    pub fn charges(&self) -> usize {
        self.charges.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Calls received (a retry with the same key is a call, not a charge).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

/// The handler a user writes: derive the key from the order, capture with
/// the lease's provider key, say whether it ran or was replayed.
pub struct Payments {
    /// The runner over the ledger.
    pub effects: Effects<SqliteLedger>,
    /// The tenant of every key.
    pub tenant: Tenant,
    /// The provider.
    pub provider: Arc<Provider>,
}

impl Handler for Payments {
    type Message = PayOrder;

    fn decode(&self, payload: &[u8]) -> Result<PayOrder, String> {
        json(payload)
    }

    async fn handle(&self, msg: PayOrder, _ctx: Context) -> Result<How, HandlerError> {
        let key = EffectKey::new(&self.tenant, KIND, &msg.order_id)?;
        let provider = &self.provider;
        let ran = self
            .effects
            .run_reported(&key, &ClaimOptions::default(), |lease| async move {
                Ok(provider.capture(&lease.provider_key(), &msg.order_id, msg.amount))
            })
            .await?;
        Ok(ran.how)
    }
}

/// The script. Orders are `order-1` … `order-{orders}`, then one order per
/// crashed worker (`crashed-…`) and per zombie (`zombie-…`).
#[derive(Debug, Clone)]
pub struct Workload {
    /// Orders published once: each runs its effect (`acquired`).
    pub orders: u64,
    /// Of those, how many are published again as soon as the first
    /// deliveries are done (suppressed duplicates, their gap normally far
    /// below [`Workload::late_gap`]).
    pub prompt_duplicates: u64,
    /// How many more are published again once their records are at least
    /// [`Workload::late_gap`] old on the ledger's clock.
    pub late_duplicates: u64,
    /// The least redelivery gap of the late duplicates.
    pub late_gap: Duration,
    /// Workers that claim an order with [`Workload::short_lease`] and die
    /// mid-handler; the consumer takes each over once it has expired.
    pub crashed_workers: u64,
    /// Workers that claim an order with [`Workload::short_lease`], call the
    /// provider, then stall (their thread blocked, so the lease is not
    /// renewed) until the consumer has taken over and completed; then they
    /// try to complete, and their fence refuses it.
    pub zombies: u64,
    /// The crashed workers' and zombies' lease.
    pub short_lease: Duration,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            orders: 12,
            prompt_duplicates: 4,
            late_duplicates: 3,
            late_gap: Duration::from_secs(2),
            crashed_workers: 3,
            zombies: 2,
            short_lease: Duration::from_secs(2),
        }
    }
}

/// What the metrics must say after [`run_workload`] (kind [`KIND`],
/// consumer [`CONSUMER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected {
    /// `oncely_claims_total{result="acquired"}`: first deliveries, plus the
    /// crashed workers' and the zombies' claims.
    pub claims_acquired: u64,
    /// `oncely_claims_total{result="completed"}`: the duplicates.
    pub claims_completed: u64,
    /// `oncely_claims_total{result="takeover"}`: the consumer's claims of
    /// the crashed workers' and the zombies' expired leases.
    pub claims_takeover: u64,
    /// `oncely_duplicates_suppressed_total`.
    pub duplicates_suppressed: u64,
    /// `oncely_lease_takeovers_total`.
    pub lease_takeovers: u64,
    /// `oncely_fence_rejections_total`: one per zombie.
    pub fence_rejections: u64,
    /// `oncely_redelivery_gap_seconds_count`: one per duplicate.
    pub redelivery_gaps: u64,
    /// Of those, at least this many are at least [`Workload::late_gap`].
    pub late_gaps: u64,
    /// `oncely_consumer_deliveries_total{result="ran"}`.
    pub deliveries_ran: u64,
    /// `oncely_consumer_deliveries_total{result="replayed"}`.
    pub deliveries_replayed: u64,
    /// Distinct charges at the provider: one per order.
    pub charges: u64,
}

impl Workload {
    /// The numbers this script produces.
    pub fn expected(&self) -> Expected {
        let duplicates = self.prompt_duplicates + self.late_duplicates;
        let taken_over = self.crashed_workers + self.zombies;
        Expected {
            claims_acquired: self.orders + taken_over,
            claims_completed: duplicates,
            claims_takeover: taken_over,
            duplicates_suppressed: duplicates,
            lease_takeovers: taken_over,
            fence_rejections: self.zombies,
            redelivery_gaps: duplicates,
            late_gaps: self.late_duplicates,
            deliveries_ran: self.orders + taken_over,
            deliveries_replayed: duplicates,
            charges: self.orders + taken_over,
        }
    }
}

/// What [`run_workload`] saw besides the metrics.
#[derive(Debug, Clone)]
pub struct Report {
    /// The consumer's counts.
    pub stats: Stats,
    /// Distinct charges at the provider.
    pub charges: usize,
    /// Provider calls (a zombie's call and its successor's share a charge).
    pub provider_calls: u64,
    /// Zombies whose completion was refused with [`Error::LeaseLost`].
    pub zombies_refused: u64,
    /// The ledger file.
    pub ledger: PathBuf,
}

/// Runs `w` on a SQLite ledger in `dir` (`ledger.db`, created), through a
/// consumer over an in-memory broker, and returns once every delivery is
/// settled and the consumer has stopped: by then every metric of the script
/// is recorded.
pub async fn run_workload(dir: &Path, w: &Workload) -> anyhow::Result<Report> {
    ensure!(
        w.prompt_duplicates + w.late_duplicates <= w.orders,
        "more duplicates than orders"
    );
    let path = dir.join("ledger.db");
    let url = format!("sqlite:{}", path.display());
    let ledger = SqliteLedger::connect(&url).await?;
    let tenant = Tenant::new("acme")?;
    let provider = Arc::new(Provider::default());
    let broker = MemoryBroker::new();
    let consumer = Arc::new(
        Consumer::new(
            CONSUMER,
            Payments {
                effects: Effects::new(ledger.clone()),
                tenant: tenant.clone(),
                provider: provider.clone(),
            },
        )
        .options(ConsumerOptions::default().concurrency(4)),
    );
    let (stop, stopped) = oneshot::channel::<()>();
    let running = {
        let (consumer, source) = (consumer.clone(), broker.source());
        tokio::spawn(async move {
            consumer
                .run(source, async {
                    let _ = stopped.await;
                })
                .await
        })
    };
    let order = |name: String, i: u64| PayOrder {
        order_id: name,
        amount: 1_000 + i as i64,
    };
    let orders: Vec<PayOrder> = (1..=w.orders).map(|i| order(format!("order-{i}"), i)).collect();
    let key = |o: &PayOrder| EffectKey::new(&tenant, KIND, &o.order_id);

    // First deliveries, then duplicates re-published at once.
    publish(&broker, &orders).await?;
    let prompt = &orders[..w.prompt_duplicates as usize];
    publish(&broker, prompt).await?;

    // Workers that claim with a short lease: crashed ones, and zombies on
    // threads of their own (another process, as far as the ledger knows).
    let short = ClaimOptions::default().lease(w.short_lease);
    let crashed: Vec<PayOrder> = (1..=w.crashed_workers)
        .map(|i| order(format!("crashed-{i}"), i))
        .collect();
    for o in &crashed {
        crash_while_holding(&ledger, &key(o)?, &short).await?;
    }
    let zombie_orders: Vec<PayOrder> = (1..=w.zombies).map(|i| order(format!("zombie-{i}"), i)).collect();
    let mut zombies = Vec::new();
    for o in &zombie_orders {
        zombies.push(Zombie::start(&url, key(o)?, o.clone(), short.clone(), provider.clone()).await?);
    }

    // Wait, on the ledger's clock, for the short leases to end and for the
    // late duplicates' records to be old enough; then deliver them all.
    for o in crashed.iter().chain(&zombie_orders) {
        wait_for(&ledger, &key(o)?, "its lease to expire", |r| {
            r.lease_expires_at.is_some_and(|end| r.read_at >= end)
        })
        .await?;
    }
    let late = &orders[w.prompt_duplicates as usize..][..w.late_duplicates as usize];
    for o in late {
        wait_for(&ledger, &key(o)?, "the late gap", |r| {
            r.read_at.duration_since(r.created_at).unwrap_or_default() >= w.late_gap
        })
        .await?;
    }
    let mut last: Vec<PayOrder> = late.to_vec();
    last.extend(crashed.iter().cloned());
    last.extend(zombie_orders.iter().cloned());
    publish(&broker, &last).await?;

    // The zombies wake up after their successors completed.
    let mut zombies_refused = 0;
    for z in zombies {
        match z.resume().await? {
            Err(Error::LeaseLost { .. }) => zombies_refused += 1,
            other => bail!("a zombie's completion was not refused by its fence: {other:?}"),
        }
    }

    let _ = stop.send(());
    let stats = running.await??;
    Ok(Report {
        stats,
        charges: provider.charges(),
        provider_calls: provider.calls(),
        zombies_refused,
        ledger: path,
    })
}

/// Publishes `orders` and waits until the consumer has settled every
/// delivery.
async fn publish(broker: &MemoryBroker, orders: &[PayOrder]) -> anyhow::Result<()> {
    for o in orders {
        broker.publish(serde_json::to_vec(o)?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while broker.pending() > 0 {
        ensure!(Instant::now() < deadline, "deliveries still pending after 60 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Polls `key`'s record until `done` holds for it (its `read_at` is the
/// ledger's clock).
async fn wait_for(
    ledger: &SqliteLedger,
    key: &EffectKey,
    what: &str,
    done: impl Fn(&Record) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let record = oncely::backend::Ledger::get(ledger, key)
            .await?
            .with_context(|| format!("{key}: no record"))?;
        if done(&record) {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "{key}: waited 60 s for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A worker that claims `key` and dies mid-handler: its run is dropped once
/// the handler has started, so the claim stays until its lease expires.
async fn crash_while_holding(
    ledger: &SqliteLedger,
    key: &EffectKey,
    opts: &ClaimOptions,
) -> anyhow::Result<()> {
    let effects = Effects::new(ledger.clone());
    let (started, handler_started) = oneshot::channel();
    let run = effects.run::<String, _, _>(key, opts, |_lease| async move {
        let _ = started.send(());
        std::future::pending::<Result<String, Failure>>().await
    });
    tokio::select! {
        result = run => bail!("{key}: the crashing worker's run ended: {result:?}"),
        _ = handler_started => Ok(()),
    }
}

/// A worker on a thread of its own that holds a lease, calls the provider,
/// and then stalls: its thread is blocked, so its lease is not renewed.
struct Zombie {
    resume: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<oncely::Result<String>>,
}

impl Zombie {
    /// Starts the worker; returns once it holds the lease and has called
    /// the provider.
    async fn start(
        url: &str,
        key: EffectKey,
        order: PayOrder,
        opts: ClaimOptions,
        provider: Arc<Provider>,
    ) -> anyhow::Result<Zombie> {
        let (holding, held) = oneshot::channel();
        let (resume, stalled) = std::sync::mpsc::channel::<()>();
        let url = url.to_owned();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::Handler(e.into()))?;
            rt.block_on(async move {
                let effects = Effects::new(SqliteLedger::connect(&url).await?);
                effects
                    .run(&key, &opts, |lease| async move {
                        let charge = provider.capture(&lease.provider_key(), &order.order_id, order.amount);
                        let _ = holding.send(());
                        // The stall: a blocked thread (a long GC pause, a
                        // stopped process) renews nothing.
                        let _ = stalled.recv();
                        Ok(charge)
                    })
                    .await
            })
        });
        if held.await.is_err() {
            let ended = thread.join().map_err(|_| anyhow::anyhow!("a zombie panicked"))?;
            bail!("a zombie never held its lease: {ended:?}");
        }
        Ok(Zombie { resume, thread })
    }

    /// Wakes the worker up; returns how its run ended.
    async fn resume(self) -> anyhow::Result<oncely::Result<String>> {
        let _ = self.resume.send(());
        tokio::task::spawn_blocking(move || self.thread.join())
            .await?
            .map_err(|_| anyhow::anyhow!("a zombie panicked"))
    }
}
