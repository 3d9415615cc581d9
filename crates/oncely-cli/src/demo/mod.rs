//! The double-charge demo: the same concurrent redeliveries processed with a
//! naive "check the status, then charge" guard and with oncely.
//!
//! `orders` orders each get a "charge" message delivered `deliveries_per_order`
//! times. All deliveries of all orders are shuffled into one queue that
//! `workers` tokio tasks consume at once; an order's copies arrive close
//! together (see `delivery_queue`), so deliveries of one order really
//! overlap, the way broker redeliveries do. Each run has its own orders table
//! (status `new` → `paid`) in the ledger's database (SQLite, PostgreSQL,
//! MySQL), or in a scratch SQLite file when the ledger has no SQL database
//! (Redis, NATS, memory), and a fake payment provider whose call takes a few
//! milliseconds, like a network call, and counts the charges it performed
//! per order.
//!
//! - **naive**: read the order's status; if it is not `paid`, charge, then
//!   write `paid`. Two deliveries that read before either writes both charge.
//! - **oncely**: [`Effects::run`] on `capture:order-<n>` charges with the
//!   key's provider key and stores the charge id; every delivery then marks
//!   the order paid, a fixed-value write that is safe to repeat.
//!
//! [`run`] returns a [`DemoReport`]; it prints nothing (the binary does).

//!
//! The code, by file: `workload.rs` (the delivery queue, the workers, the
//! fake provider), `orders.rs` (the orders table in each SQL dialect),
//! `report.rs` (what a run reports, and its table).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use oncely::backend::Ledger;
use oncely::{ClaimOptions, Effects, Error, Result, Tenant};
use oncely_any::scratch::{clock_seed, run_id, scratch_dir, scratch_ledger, sqlite_url};
use oncely_any::{AnyLedger, AnyPool};
use serde::Serialize;

mod orders;
mod report;
mod workload;

use orders::{Orders, scratch_sqlite};
pub use report::{DemoReport, RunReport};
use workload::{DEMO_RETENTION, Delivery, Provider, delivery_queue, run_guard};

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// How many orders.
    pub orders: u32,
    /// How many times each order's charge message is delivered.
    pub deliveries_per_order: u32,
    /// How many concurrent consumers.
    pub workers: usize,
    /// Where the ledger and the orders tables live; `None` means a fresh
    /// SQLite file in a temporary directory, removed afterwards.
    pub database_url: Option<String>,
    /// Seed of the delivery order; `None` picks one from the clock (the
    /// report says which).
    pub seed: Option<u64>,
    /// The fake provider's latency per charge, drawn uniformly from this range.
    pub provider_latency: (Duration, Duration),
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            orders: 200,
            deliveries_per_order: 4,
            workers: 8,
            database_url: None,
            seed: None,
            provider_latency: (Duration::from_millis(1), Duration::from_millis(5)),
        }
    }
}

impl DemoConfig {
    /// Refuses configurations that cannot run, before anything is opened.
    pub fn validate(&self) -> Result<()> {
        if self.orders == 0 || self.deliveries_per_order == 0 || self.workers == 0 {
            return Err(Error::Config(
                "orders, deliveries and workers must each be at least 1".to_owned(),
            ));
        }
        if u64::from(self.orders) * u64::from(self.deliveries_per_order) > 10_000_000 {
            return Err(Error::Config("at most 10 000 000 deliveries per run".to_owned()));
        }
        if self.workers > 1024 {
            return Err(Error::Config("at most 1024 workers".to_owned()));
        }
        if self.provider_latency.0 > self.provider_latency.1 {
            return Err(Error::Config("provider latency range is reversed".to_owned()));
        }
        Ok(())
    }
}

/// Which guard a run used.
// Exhaustive by design (ARCHITECTURE.md, API boundaries): the demo compares these two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Guard {
    /// Read the status, charge, write the status.
    Naive,
    /// `Effects::run` on the capture key.
    Oncely,
}

impl Guard {
    /// `naive` or `oncely`.
    pub fn name(self) -> &'static str {
        match self {
            Guard::Naive => "naive",
            Guard::Oncely => "oncely",
        }
    }
}

/// Hears about the demo's progress (the binary draws a progress bar).
pub trait Progress: Send + Sync {
    /// A run starts with this many deliveries to process.
    fn start(&self, _guard: Guard, _deliveries: u64) {}
    /// One delivery was processed.
    fn delivered(&self) {}
    /// The run finished.
    fn finish(&self, _guard: Guard) {}
}

/// A [`Progress`] that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl Progress for NoProgress {}

/// Runs both guards over the same shuffled deliveries and reports.
///
/// Every run gets a fresh run id: new orders tables (dropped afterwards) and
/// a new tenant for its effect keys (kept, with one hour of retention, for
/// inspection), so demos on a shared server never collide.
pub async fn run(config: &DemoConfig, progress: Arc<dyn Progress>) -> Result<DemoReport> {
    config.validate()?;
    let run_id = run_id();
    // The temporary directory lives until the end of this function and is
    // removed on drop, after the pools are closed.
    let (url, scratch) = match &config.database_url {
        Some(url) => (url.clone(), None),
        None => {
            let dir = scratch_dir("oncely-demo-")?;
            let url = sqlite_url(&dir.path().join("oncely-demo.db"));
            (url, Some(dir))
        }
    };
    let ledger = match &scratch {
        Some(_) => scratch_ledger(&url).await?,
        None => AnyLedger::connect(&url).await?,
    };
    let (pool, _orders_scratch) = match ledger.pool() {
        Some(pool) => (pool, None),
        // Redis, NATS and memory ledgers have no SQL database: keep the
        // orders in a scratch SQLite file so the naive guard still reads a
        // real table.
        None => {
            let dir = scratch_dir("oncely-demo-")?;
            let pool = scratch_sqlite(&dir.path().join("orders.db"), config.workers).await?;
            (AnyPool::Sqlite(pool), Some(dir))
        }
    };
    let result = run_both(config, &run_id, &ledger, &pool, progress).await;
    pool.close().await;
    ledger.close().await;
    result
}

async fn run_both(
    config: &DemoConfig,
    run_id: &str,
    ledger: &AnyLedger,
    pool: &AnyPool,
    progress: Arc<dyn Progress>,
) -> Result<DemoReport> {
    let seed = config.seed.unwrap_or_else(clock_seed);
    let queue = delivery_queue(config.orders, config.deliveries_per_order, config.workers, seed);
    let tenant = Tenant::new(format!("demo-{run_id}"))?;

    let mut reports = Vec::new();
    for guard in [Guard::Naive, Guard::Oncely] {
        let orders = Orders::create(
            pool,
            &format!("oncely_demo_{run_id}_{}", guard.name()),
            config.orders,
        )
        .await?;
        let ctx = Arc::new(Delivery {
            guard,
            orders: orders.clone(),
            provider: Provider::new(
                config.orders,
                config.provider_latency,
                seed ^ 0x9e37_79b9_7f4a_7c15,
            ),
            effects: Effects::new(ledger.clone()),
            tenant: tenant.clone(),
            opts: ClaimOptions::default().retention(DEMO_RETENTION),
            suppressed: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        });
        let report = run_guard(config.workers, &queue, ctx, progress.clone()).await;
        // Drop the table whatever happened; a failure to drop must not hide
        // the run's own error.
        let dropped = orders.drop_table().await;
        reports.push(report?);
        dropped?;
    }
    let oncely = reports.pop().expect("two runs");
    let naive = reports.pop().expect("two runs");
    Ok(DemoReport {
        orders: u64::from(config.orders),
        deliveries: queue.len() as u64,
        deliveries_per_order: u64::from(config.deliveries_per_order),
        workers: config.workers as u64,
        backend: ledger.backend(),
        tenant: tenant.as_str().to_owned(),
        seed,
        naive,
        oncely,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_holds_every_delivery_with_copies_close_together() {
        let q = delivery_queue(100, 4, 8, 42);
        assert_eq!(q, delivery_queue(100, 4, 8, 42), "same seed, same queue");
        assert_eq!(q.len(), 400);
        let mut counts = vec![0; 101];
        for &o in &q {
            counts[o as usize] += 1;
        }
        assert!(
            counts[1..].iter().all(|&c| c == 4),
            "each order delivered 4 times"
        );
        // Copies of one order arrive within the redelivery window
        // (2 × 4 × 8 = 64 slots) plus the ties around it.
        for order in 1..=100u32 {
            let pos: Vec<usize> = q
                .iter()
                .enumerate()
                .filter(|(_, o)| **o == order)
                .map(|(i, _)| i)
                .collect();
            assert!(pos[3] - pos[0] < 64 + 8, "order {order} spread over {pos:?}");
        }
    }

    #[test]
    fn bad_configs_are_refused() {
        for bad in [
            DemoConfig {
                orders: 0,
                ..DemoConfig::default()
            },
            DemoConfig {
                deliveries_per_order: 0,
                ..DemoConfig::default()
            },
            DemoConfig {
                workers: 0,
                ..DemoConfig::default()
            },
        ] {
            assert!(matches!(bad.validate(), Err(Error::Config(_))), "{bad:?}");
        }
        DemoConfig::default().validate().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn memory_ledger_demo_charges_each_order_once() {
        let config = DemoConfig {
            orders: 50,
            database_url: Some("memory:".to_owned()),
            seed: Some(1),
            ..DemoConfig::default()
        };
        let report = run(&config, Arc::new(NoProgress)).await.unwrap();
        assert_eq!(report.backend, "memory");
        assert_eq!(report.deliveries, 200);
        assert_eq!(report.oncely.charges, 50, "{report:?}");
        assert_eq!(report.oncely.duplicate_charges, 0, "{report:?}");
        assert_eq!(report.oncely.duplicates_suppressed, 150, "{report:?}");
        assert_eq!(report.oncely.orders_paid, 50);
        assert_eq!(report.naive.orders_paid, 50);
        assert!(
            report.oncely_problems().is_empty(),
            "{:?}",
            report.oncely_problems()
        );
        // Every delivery either charged or was suppressed.
        assert_eq!(
            report.naive.charges + report.naive.duplicates_suppressed,
            200,
            "{report:?}"
        );
    }
}
