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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use oncely::{ClaimOptions, EffectKey, Effects, Error, Ledger, Result, Tenant};
use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, SqlitePool};

use crate::any::{AnyLedger, AnyPool};

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

/// The result of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// Deliveries processed (orders × deliveries per order).
    pub deliveries: u64,
    /// Charges the provider performed.
    pub charges: u64,
    /// Charges beyond the first, summed over orders.
    pub duplicate_charges: u64,
    /// Orders charged more than once.
    pub orders_charged_twice: u64,
    /// Deliveries that charged nothing because the guard recognised a duplicate.
    pub duplicates_suppressed: u64,
    /// Orders whose status is `paid` at the end.
    pub orders_paid: u64,
    /// Delivery attempts that failed retryably (busy database, an in-flight
    /// duplicate) and were retried, as a broker would redeliver them.
    pub retries: u64,
    /// Wall-clock time of the run.
    pub seconds: f64,
}

/// The demo's result: both runs over the same deliveries.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoReport {
    /// How many orders.
    pub orders: u64,
    /// Deliveries per run (orders × deliveries per order).
    pub deliveries: u64,
    /// How many times each order's message was delivered.
    pub deliveries_per_order: u64,
    /// Concurrent consumers.
    pub workers: u64,
    /// The ledger's backend (`sqlite`, `postgres`, `mysql`, `redis`, `nats`,
    /// `memory`).
    pub backend: &'static str,
    /// The tenant of this run's effect keys (`demo-<run id>`); inspect them
    /// with `oncely get <tenant>/capture:order-1`.
    pub tenant: String,
    /// The seed of the delivery order.
    pub seed: u64,
    /// The naive guard's run.
    pub naive: RunReport,
    /// oncely's run.
    pub oncely: RunReport,
}

impl DemoReport {
    /// What went wrong with oncely's run, if anything: a duplicate charge,
    /// an order not charged, an order not paid. Empty when oncely did its job.
    pub fn oncely_problems(&self) -> Vec<String> {
        let r = &self.oncely;
        let mut problems = Vec::new();
        if r.duplicate_charges > 0 {
            problems.push(format!(
                "oncely performed {} duplicate charge(s) on {} order(s)",
                r.duplicate_charges, r.orders_charged_twice
            ));
        }
        if r.charges != self.orders {
            problems.push(format!(
                "oncely performed {} charges for {} orders",
                r.charges, self.orders
            ));
        }
        if r.orders_paid != self.orders {
            problems.push(format!(
                "only {} of {} orders are marked paid",
                r.orders_paid, self.orders
            ));
        }
        problems
    }
}

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
    let (url, _scratch) = match &config.database_url {
        Some(url) => (url.clone(), None),
        None => {
            let dir = scratch_dir()?;
            let url = sqlite_url(&dir.path().join("oncely-demo.db"));
            (url, Some(dir))
        }
    };
    let ledger = AnyLedger::connect(&url).await?;
    let (pool, _orders_scratch) = match ledger.pool() {
        Some(pool) => (pool, None),
        // Redis, NATS and memory ledgers have no SQL database: keep the
        // orders in a scratch SQLite file so the naive guard still reads a
        // real table.
        None => {
            let dir = scratch_dir()?;
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

/// All deliveries of all orders in one queue, in arrival order.
///
/// Orders are published in a random order; each copy of an order's message
/// arrives at the order's publish slot plus a random redelivery delay of up
/// to `2 × deliveries × workers` slots. So the queue is shuffled, but an
/// order's copies arrive close together, as broker redeliveries and producer
/// retries do, and the workers really process some of them at the same time.
/// (A uniform shuffle of the whole queue would spread them so far apart that
/// they would rarely overlap.)
fn delivery_queue(orders: u32, deliveries: u32, workers: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    let mut publish: Vec<u32> = (1..=orders).collect();
    rng.shuffle(&mut publish);
    let k = u64::from(deliveries);
    let window = 2 * k * workers as u64;
    let mut arrivals = Vec::with_capacity(orders as usize * deliveries as usize);
    for (slot, &order) in publish.iter().enumerate() {
        for _ in 0..deliveries {
            arrivals.push((slot as u64 * k + rng.below(window), order));
        }
    }
    arrivals.sort_unstable();
    arrivals.into_iter().map(|(_, order)| order).collect()
}

/// Demo records are kept this long: enough to inspect them, short enough
/// that `oncely prune` clears them from a shared database the same day.
const DEMO_RETENTION: Duration = Duration::from_secs(3600);

/// A delivery attempt that fails retryably is retried this many times before
/// the run gives up (a broker would keep redelivering).
const MAX_ATTEMPTS: u32 = 50;

async fn run_guard(
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
struct Delivery {
    guard: Guard,
    orders: Orders,
    provider: Provider,
    effects: Effects<AnyLedger>,
    tenant: Tenant,
    opts: ClaimOptions,
    suppressed: AtomicU64,
    retries: AtomicU64,
}

impl Delivery {
    async fn deliver(&self, order: u32) -> Result<()> {
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
struct Provider {
    charges: Vec<AtomicU32>,
    latency: (Duration, Duration),
    rng: Mutex<Rng>,
}

impl Provider {
    fn new(orders: u32, latency: (Duration, Duration), seed: u64) -> Self {
        Provider {
            charges: (0..orders).map(|_| AtomicU32::new(0)).collect(),
            latency,
            rng: Mutex::new(Rng::new(seed)),
        }
    }

    async fn charge(&self, order: u32, idempotency_key: Option<&str>) -> String {
        let (lo, hi) = self.latency;
        let spread = (hi - lo).as_micros() as u64;
        let jitter = self
            .rng
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .below(spread + 1);
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

/// The orders table of one run: on the ledger's own database for the SQL
/// backends, in a scratch SQLite file otherwise (see [`run`]).
#[derive(Clone)]
struct Orders {
    pool: AnyPool,
    table: Arc<str>,
}

/// Runs `$body` with `$p` bound to the pool of every [`AnyPool`] variant and
/// `$backend` to the backend's name, for queries whose SQL is the same on
/// all of them.
macro_rules! on_pool {
    ($pool:expr, |$p:ident, $backend:ident| $body:expr) => {
        match $pool {
            AnyPool::Sqlite($p) => {
                let $backend = "sqlite";
                $body
            }
            AnyPool::Postgres($p) => {
                let $backend = "postgres";
                $body
            }
            #[cfg(feature = "mysql")]
            AnyPool::MySql($p) => {
                let $backend = "mysql";
                $body
            }
        }
    };
}

impl Orders {
    async fn create(pool: &AnyPool, table: &str, orders: u32) -> Result<Orders> {
        // VARCHAR rather than TEXT: MySQL cannot give a TEXT column a plain
        // string type, and the other two treat both alike.
        let create = format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL)");
        exec(pool, create).await?;
        let ids: Vec<u32> = (1..=orders).collect();
        // Literal integers only, so a multi-row insert needs no bind limit.
        for chunk in ids.chunks(500) {
            let values: Vec<String> = chunk.iter().map(|id| format!("({id}, 'new')")).collect();
            exec(
                pool,
                format!("INSERT INTO {table} (id, status) VALUES {}", values.join(", ")),
            )
            .await?;
        }
        Ok(Orders {
            pool: pool.clone(),
            table: table.into(),
        })
    }

    /// The backend's spelling of the first bind parameter.
    fn param(&self) -> &'static str {
        match &self.pool {
            AnyPool::Sqlite(_) => "?1",
            AnyPool::Postgres(_) => "$1",
            #[cfg(feature = "mysql")]
            AnyPool::MySql(_) => "?",
        }
    }

    async fn status(&self, order: u32) -> Result<String> {
        let sql = format!("SELECT status FROM {} WHERE id = {}", self.table, self.param());
        on_pool!(&self.pool, |p, backend| sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(i64::from(order))
            .fetch_one(p)
            .await
            .map_err(|e| db_error(backend, e)))
    }

    async fn mark_paid(&self, order: u32) -> Result<()> {
        let sql = format!(
            "UPDATE {} SET status = 'paid' WHERE id = {}",
            self.table,
            self.param()
        );
        on_pool!(&self.pool, |p, backend| sqlx::query(AssertSqlSafe(sql))
            .bind(i64::from(order))
            .execute(p)
            .await
            .map(drop)
            .map_err(|e| db_error(backend, e)))
    }

    async fn count_paid(&self) -> Result<u64> {
        let sql = format!("SELECT COUNT(*) FROM {} WHERE status = 'paid'", self.table);
        let n: i64 = on_pool!(&self.pool, |p, backend| sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(p)
            .await
            .map_err(|e| db_error(backend, e)))?;
        Ok(n as u64)
    }

    async fn drop_table(&self) -> Result<()> {
        exec(&self.pool, format!("DROP TABLE IF EXISTS {}", self.table)).await
    }
}

async fn exec(pool: &AnyPool, sql: String) -> Result<()> {
    on_pool!(pool, |p, backend| sqlx::query(AssertSqlSafe(sql))
        .execute(p)
        .await
        .map(drop)
        .map_err(|e| db_error(backend, e)))
}

/// Maps a driver error on the orders table; busy and locked databases,
/// pool timeouts and I/O errors are worth a retry.
fn db_error(backend: &'static str, e: sqlx::Error) -> Error {
    let retryable = match &e {
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) => true,
        sqlx::Error::Database(d) => {
            let code = d.code().unwrap_or_default();
            // SQLite BUSY (5) / LOCKED (6) and their extended codes;
            // PostgreSQL serialization failure and deadlock; MySQL's
            // deadlock (SQLSTATE 40001 too).
            matches!(code.as_ref(), "5" | "6" | "40001" | "40P01")
                || code
                    .parse::<u32>()
                    .is_ok_and(|c| backend == "sqlite" && matches!(c & 0xff, 5 | 6))
        }
        _ => false,
    };
    Error::Backend {
        backend,
        message: format!("demo orders table: {e}"),
        retryable,
    }
}

/// A SQLite pool on a scratch file (WAL, a generous busy timeout so that
/// concurrent writers wait for each other instead of failing).
async fn scratch_sqlite(path: &std::path::Path, workers: usize) -> Result<SqlitePool> {
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new()
        .max_connections(workers.clamp(1, 16) as u32)
        .connect_with(opts)
        .await
        .map_err(|e| Error::Unavailable {
            backend: "sqlite",
            message: e.to_string(),
        })
}

fn scratch_dir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("oncely-demo-")
        .tempdir()
        .map_err(|e| Error::Config(format!("cannot create a temporary directory: {e}")))
}

fn sqlite_url(path: &std::path::Path) -> String {
    format!("sqlite://{}?mode=rwc", path.display())
}

/// 12 hex digits from the clock and the process id: unique enough that two
/// demos on one database never share a table or a tenant.
fn run_id() -> String {
    let mut rng = Rng::new(clock_seed() ^ (u64::from(std::process::id()) << 32));
    format!("{:012x}", rng.next_u64() & 0xffff_ffff_ffff)
}

fn clock_seed() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

/// SplitMix64: seeded, small, and good enough to shuffle a queue.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Fisher–Yates.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_is_a_seeded_permutation() {
        let mut a: Vec<u32> = (0..1000).collect();
        let mut b = a.clone();
        Rng::new(7).shuffle(&mut a);
        Rng::new(7).shuffle(&mut b);
        assert_eq!(a, b, "same seed, same order");
        assert_ne!(a, (0..1000).collect::<Vec<_>>(), "it does shuffle");
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>(), "a permutation");
    }

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
