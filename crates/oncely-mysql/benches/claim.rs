//! `MySqlLedger` against hand-written sqlx statements doing the same work on
//! an equivalent table (the same DDL, made by the same migrations under
//! another name) on the same pool, in one run:
//!
//! - `mysql/claim_complete_*`: claim of a fresh key + complete (1 and 8
//!   tasks), against an insert that returns the fence (`INSERT … ON
//!   DUPLICATE KEY UPDATE … RETURNING` on MariaDB; the insert and a read of
//!   the row on MySQL 8), then a fenced update. The baseline reads the clock
//!   the simple way (`UTC_TIMESTAMP(6)`, the statement's start); the
//!   ledger's clock read after any lock wait, and its read of the key before
//!   a write (a duplicate is a read: see the crate docs), are part of what
//!   the ratio measures.
//! - `mysql/deliveries_sequential`: each job delivered twice, one delivery
//!   after the other, through [`Effects::run`]: a fresh claim, the effect,
//!   the completion, then a duplicate that gets the stored outcome.
//! - `mysql/storm_*`: the duplicate storm. Each job is delivered twice at
//!   the same instant, both deliveries through [`Effects::run`] with the
//!   `Wait` policy (the duplicate waits for the first and returns its
//!   outcome; woken in-process by the completion) or `Reject` (the duplicate
//!   fails with `InProgress` if the first still runs). 1 job at a time (2
//!   workers) and 4 at a time (8 workers).
//!
//!   The baseline of these two is the hand-written minimum: `INSERT IGNORE
//!   … RETURNING fence` (MariaDB; on MySQL 8 the affected-row count), the
//!   effect and a fenced `UPDATE` when it inserted, and one `SELECT` of the
//!   row when it did not. Its duplicate never waits for the outcome, so it
//!   is a lower bound for any design that does.
//!
//!   Throughput is in deliveries. Every run checks that each job's effect
//!   ran exactly once (a bench that ran an effect twice panics).
//! - `mysql/batch_100`: 100 fresh keys claimed with one `claim_many` and
//!   completed with one `complete_many`, against the same 100 claimed and
//!   completed one by one, and against hand-written batched statements (one
//!   multi-row `INSERT … RETURNING`, one `UPDATE … CASE`). Throughput is in
//!   keys.
//!
//! At the end the bench prints, per case, what the server did per delivery
//! (or key): statements by kind, rows it tried to write (`Handler_write`),
//! redo log writes, row lock waits, from the server's global status. Other
//! clients of the server count too, but unlike the times these numbers do
//! not depend on how busy the machine is.
//!
//! `cargo bench -p oncely-mysql --bench claim` (server: `ONCELY_MYSQL_URL`,
//! default `mysql://root@127.0.0.1:3306/test`). The lead computes ratio =
//! baseline time / oncely time.
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use oncely::backend::{Claim, Lease, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Effects, Error, OnInProgress, Tenant};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::{Executor, MySqlPool, Row};

const NOW_US: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";
const BASELINE: &str = "oncely_bench_baseline";
const BATCH: usize = 100;
const LEASE_US: i64 = 30_000_000;
const RETENTION_US: i64 = 7 * 86_400_000_000;

/// The values of a fresh baseline row, after its key, tenant, kind, subject.
fn baseline_values() -> String {
    format!("'in_progress', {NOW_US}, 0, ?, {NOW_US}, {NOW_US}, {NOW_US} + ?, ?, {NOW_US} + ?")
}

const BASELINE_COLS: &str = "INSERT INTO oncely_bench_baseline (effect_key, tenant, kind, subject, state, fence, \
     at_most_once, claim_token, created_us, updated_us, lease_expires_us, retention_us, retain_until_us)";

fn baseline_claim(returning: bool) -> String {
    format!(
        "{BASELINE_COLS} VALUES (?, ?, ?, ?, {}) ON DUPLICATE KEY UPDATE fence = fence{}",
        baseline_values(),
        if returning { " RETURNING fence" } else { "" }
    )
}

/// Insert-if-absent: a duplicate is ignored (and reported by the row count,
/// or by no row back from `RETURNING`).
fn baseline_insert_ignore(returning: bool) -> String {
    format!(
        "INSERT IGNORE INTO oncely_bench_baseline (effect_key, tenant, kind, subject, state, fence, \
         at_most_once, claim_token, created_us, updated_us, lease_expires_us, retention_us, retain_until_us) \
         VALUES (?, ?, ?, ?, {}){}",
        baseline_values(),
        if returning { " RETURNING fence" } else { "" }
    )
}

fn baseline_complete() -> String {
    format!(
        "UPDATE oncely_bench_baseline SET state = 'completed', outcome = ?, lease_expires_us = NULL, \
         updated_us = {NOW_US}, retain_until_us = {NOW_US} + retention_us \
         WHERE effect_key = ? AND fence = ? AND state = 'in_progress'"
    )
}

fn baseline_batch_claim(n: usize) -> String {
    let row = format!("(?, ?, ?, ?, {})", baseline_values());
    format!(
        "{BASELINE_COLS} VALUES {} ON DUPLICATE KEY UPDATE fence = fence RETURNING effect_key, fence",
        vec![row; n].join(", ")
    )
}

fn baseline_batch_complete(n: usize) -> String {
    format!(
        "UPDATE oncely_bench_baseline SET state = 'completed', lease_expires_us = NULL, updated_us = {NOW_US}, \
         retain_until_us = {NOW_US} + retention_us, outcome = CASE effect_key {}END \
         WHERE effect_key IN ({}) AND fence = CASE effect_key {}END AND state = 'in_progress'",
        "WHEN ? THEN ? ".repeat(n),
        vec!["?"; n].join(", "),
        "WHEN ? THEN ? ".repeat(n)
    )
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn fresh_key(t: &Tenant) -> EffectKey {
    EffectKey::new(
        t,
        "capture",
        format!("order-{}", SEQ.fetch_add(1, Ordering::Relaxed)),
    )
    .unwrap()
}

/// What every case shares.
struct Ctx {
    ledger: MySqlLedger,
    effects: Effects<MySqlLedger>,
    pool: MySqlPool,
    tenant: Tenant,
    outcome: Outcome,
    /// MariaDB: the baseline's inserts return their fence.
    returning: bool,
    claim: String,
    read: Option<String>,
    insert_ignore: String,
    complete: String,
    batch_claim: String,
    batch_complete: String,
    /// Effects run (each job's must run exactly once).
    ran: AtomicU64,
    /// Claim options: the default, and the two in-progress policies.
    opts: ClaimOptions,
    wait: ClaimOptions,
    reject: ClaimOptions,
    /// Per case: deliveries (or keys), and the server's counters over them.
    stats: Mutex<BTreeMap<String, (u64, Counters)>>,
}

/// Server status counters by name.
type Counters = BTreeMap<String, i64>;

/// The server counters the bench reports per delivery.
const COUNTERS: &[&str] = &[
    "Com_select",
    "Com_insert",
    "Com_update",
    "Handler_write",
    "Innodb_log_writes",
    "Innodb_row_lock_waits",
];

impl Ctx {
    fn key(&self) -> EffectKey {
        fresh_key(&self.tenant)
    }

    fn bind_fresh<'q>(
        &self,
        q: sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
        k: &EffectKey,
    ) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
        q.bind(k.as_str().to_owned())
            .bind(k.tenant().as_str().to_owned())
            .bind(k.kind().to_owned())
            .bind(k.subject().to_owned())
            .bind(vec![0u8; 16])
            .bind(LEASE_US)
            .bind(RETENTION_US)
            .bind(RETENTION_US)
    }

    async fn counters(&self) -> Counters {
        let rows = sqlx::query("SHOW GLOBAL STATUS")
            .fetch_all(&self.pool)
            .await
            .unwrap();
        rows.iter()
            .filter_map(|r| {
                let name: String = r.get(0);
                COUNTERS
                    .contains(&name.as_str())
                    .then(|| (name, r.get::<String, _>(1).parse().unwrap_or(0)))
            })
            .collect()
    }

    /// Runs `jobs` jobs of a case with `tasks` at a time, checks that each
    /// job's effect ran once (`per_job` effects), and records the server's
    /// counters over `jobs * units` deliveries (or keys).
    async fn measured<F, Fut>(
        self: &Arc<Self>,
        case: &str,
        jobs: u64,
        tasks: u64,
        units: u64,
        per_job: u64,
        op: F,
    ) -> Duration
    where
        F: Fn(Arc<Ctx>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let before = self.counters().await;
        let ran = self.ran.load(Ordering::SeqCst);
        let this = self.clone();
        let took = oncely::conformance::spread(jobs, tasks, move || op(this.clone())).await;
        assert_eq!(
            self.ran.load(Ordering::SeqCst) - ran,
            jobs * per_job,
            "{case}: an effect ran more (or less) than once per job"
        );
        let after = self.counters().await;
        let mut stats = self.stats.lock().unwrap();
        let (n, sums) = stats.entry(case.to_owned()).or_default();
        *n += jobs * units;
        for (name, v) in after {
            *sums.entry(name.clone()).or_default() += v - before.get(&name).copied().unwrap_or(0);
        }
        took
    }
}

async fn oncely_claim_complete(ctx: &Ctx, opts: &ClaimOptions) {
    let k = ctx.key();
    match ctx.ledger.claim(&k, opts).await.unwrap() {
        Claim::Acquired(lease) => ctx.ledger.complete(&lease, &ctx.outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

async fn baseline_claim_complete(ctx: &Ctx) {
    let k = ctx.key();
    let q = ctx.bind_fresh(sqlx::query(sqlx::AssertSqlSafe(ctx.claim.as_str())), &k);
    let fence: u64 = match &ctx.read {
        None => q.fetch_one(&ctx.pool).await.unwrap().get("fence"),
        Some(read) => {
            let mut conn = ctx.pool.acquire().await.unwrap();
            q.execute(&mut *conn).await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(read.as_str()))
                .bind(k.as_str())
                .fetch_one(&mut *conn)
                .await
                .unwrap()
                .get("fence")
        }
    };
    let done = sqlx::query(sqlx::AssertSqlSafe(ctx.complete.as_str()))
        .bind(ctx.outcome.as_bytes())
        .bind(k.as_str())
        .bind(fence)
        .execute(&ctx.pool)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), 1);
}

/// One delivery through the runner. `Reject`'s duplicate that finds the
/// first still running gets `InProgress` (the broker would redeliver it).
async fn oncely_delivery(ctx: &Ctx, k: &EffectKey, opts: &ClaimOptions) {
    let r = ctx
        .effects
        .run(k, opts, |_| async {
            ctx.ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, oncely::Failure>(("ch_1".to_owned(), 1250u32))
        })
        .await;
    match r {
        Ok(v) => assert_eq!(v, ("ch_1".to_owned(), 1250)),
        Err(Error::InProgress { .. }) if opts.on_in_progress == OnInProgress::Reject => {}
        Err(e) => panic!("{e:?}"),
    }
}

/// One delivery, hand-written: insert-if-absent; the effect and a fenced
/// completion if it inserted, one read of the row if not.
async fn baseline_delivery(ctx: &Ctx, k: &EffectKey) {
    let q = ctx.bind_fresh(sqlx::query(sqlx::AssertSqlSafe(ctx.insert_ignore.as_str())), k);
    let fence: Option<u64> = if ctx.returning {
        q.fetch_optional(&ctx.pool).await.unwrap().map(|r| r.get("fence"))
    } else {
        let mut conn = ctx.pool.acquire().await.unwrap();
        if q.execute(&mut *conn).await.unwrap().rows_affected() == 1 {
            Some(
                sqlx::query_scalar("SELECT fence FROM oncely_bench_baseline WHERE effect_key = ?")
                    .bind(k.as_str())
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap(),
            )
        } else {
            None
        }
    };
    match fence {
        Some(fence) => {
            ctx.ran.fetch_add(1, Ordering::SeqCst);
            let done = sqlx::query(sqlx::AssertSqlSafe(ctx.complete.as_str()))
                .bind(ctx.outcome.as_bytes())
                .bind(k.as_str())
                .bind(fence)
                .execute(&ctx.pool)
                .await
                .unwrap();
            assert_eq!(done.rows_affected(), 1);
        }
        None => {
            let row = sqlx::query("SELECT state, outcome FROM oncely_bench_baseline WHERE effect_key = ?")
                .bind(k.as_str())
                .fetch_one(&ctx.pool)
                .await
                .unwrap();
            let _: (String, Option<Vec<u8>>) = (row.get("state"), row.get("outcome"));
        }
    }
}

async fn oncely_batch(ctx: &Ctx, opts: &ClaimOptions) {
    let keys: Vec<EffectKey> = (0..BATCH).map(|_| ctx.key()).collect();
    let leases: Vec<(Lease, Outcome)> = ctx
        .ledger
        .claim_many(&keys, opts)
        .await
        .unwrap()
        .into_iter()
        .map(|c| match c.unwrap() {
            Claim::Acquired(l) => (l, ctx.outcome.clone()),
            other => panic!("{other:?}"),
        })
        .collect();
    for r in ctx.ledger.complete_many(&leases).await {
        r.unwrap();
    }
    ctx.ran.fetch_add(1, Ordering::SeqCst);
}

async fn oncely_one_by_one(ctx: &Ctx, opts: &ClaimOptions) {
    for _ in 0..BATCH {
        oncely_claim_complete(ctx, opts).await;
    }
    ctx.ran.fetch_add(1, Ordering::SeqCst);
}

async fn baseline_batch(ctx: &Ctx) {
    let keys: Vec<EffectKey> = (0..BATCH).map(|_| ctx.key()).collect();
    let mut q = sqlx::query(sqlx::AssertSqlSafe(ctx.batch_claim.as_str()));
    for k in &keys {
        q = ctx.bind_fresh(q, k);
    }
    let rows = q.fetch_all(&ctx.pool).await.unwrap();
    assert_eq!(rows.len(), BATCH);
    let fences: Vec<(String, u64)> = rows
        .iter()
        .map(|r| (r.get("effect_key"), r.get("fence")))
        .collect();
    let mut u = sqlx::query(sqlx::AssertSqlSafe(ctx.batch_complete.as_str()));
    for (k, _) in &fences {
        u = u.bind(k.clone()).bind(ctx.outcome.as_bytes().to_vec());
    }
    for (k, _) in &fences {
        u = u.bind(k.clone());
    }
    for (k, f) in &fences {
        u = u.bind(k.clone()).bind(*f);
    }
    assert_eq!(u.execute(&ctx.pool).await.unwrap().rows_affected(), BATCH as u64);
    ctx.ran.fetch_add(1, Ordering::SeqCst);
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let url =
        std::env::var("ONCELY_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let ctx = rt.block_on(async {
        let opts = MySqlLedgerOptions::default().max_connections(16);
        let ledger = MySqlLedger::connect_with(&url, opts.clone().table("oncely_bench_effects"))
            .await
            .unwrap();
        // The equivalent table: the same migrations under another name.
        let twin = MySqlLedger::from_pool_with(ledger.pool().clone(), opts.table(BASELINE)).unwrap();
        twin.migrate().await.unwrap();
        for t in ["oncely_bench_effects", BASELINE] {
            ledger
                .pool()
                .execute(sqlx::AssertSqlSafe(format!("TRUNCATE TABLE {t}")))
                .await
                .unwrap();
        }
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
        let returning = version.to_ascii_lowercase().contains("mariadb");
        Arc::new(Ctx {
            effects: Effects::new(ledger.clone()),
            pool: ledger.pool().clone(),
            ledger,
            tenant: Tenant::new("bench").unwrap(),
            outcome: Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap(),
            returning,
            claim: baseline_claim(returning),
            read: (!returning)
                .then(|| format!("SELECT fence FROM {BASELINE} WHERE effect_key = ? FOR UPDATE")),
            insert_ignore: baseline_insert_ignore(returning),
            complete: baseline_complete(),
            batch_claim: baseline_batch_claim(BATCH),
            batch_complete: baseline_batch_complete(BATCH),
            ran: AtomicU64::new(0),
            opts: ClaimOptions::default(),
            wait: ClaimOptions::default().on_in_progress(OnInProgress::Wait {
                max: Duration::from_secs(30),
            }),
            reject: ClaimOptions::default().on_in_progress(OnInProgress::Reject),
            stats: Mutex::new(BTreeMap::new()),
        })
    });

    macro_rules! case {
        ($group:expr, $name:expr, $case:expr, $tasks:expr, $units:expr, $per_job:expr, |$ctx:ident| $body:expr) => {{
            let case: String = $case;
            $group.bench_function($name, |b| {
                b.to_async(&rt).iter_custom(|iters| {
                    let (ctx, case) = (ctx.clone(), case.clone());
                    async move {
                        ctx.measured(&case, iters, $tasks, $units, $per_job, move |$ctx| async move {
                            $body;
                        })
                        .await
                    }
                })
            });
        }};
    }

    for tasks in [1u64, 8] {
        let name = format!(
            "mysql/claim_complete_{tasks}_task{}",
            if tasks == 1 { "" } else { "s" }
        );
        let mut g = c.benchmark_group(&name);
        g.sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1));
        case!(g, "oncely", format!("{name}/oncely"), tasks, 1, 0, |ctx| {
            oncely_claim_complete(&ctx, &ctx.opts).await
        });
        case!(g, "baseline", format!("{name}/baseline"), tasks, 1, 0, |ctx| {
            baseline_claim_complete(&ctx).await
        });
        g.finish();
    }

    {
        let name = "mysql/deliveries_sequential";
        let mut g = c.benchmark_group(name);
        g.sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(2));
        case!(g, "oncely_wait", format!("{name}/oncely_wait"), 1, 2, 1, |ctx| {
            let k = ctx.key();
            oncely_delivery(&ctx, &k, &ctx.wait).await;
            oncely_delivery(&ctx, &k, &ctx.wait).await;
        });
        case!(g, "baseline", format!("{name}/baseline"), 1, 2, 1, |ctx| {
            let k = ctx.key();
            baseline_delivery(&ctx, &k).await;
            baseline_delivery(&ctx, &k).await;
        });
        g.finish();
    }

    for jobs_at_once in [1u64, 4] {
        let name = format!("mysql/storm_{}_workers", jobs_at_once * 2);
        let mut g = c.benchmark_group(&name);
        g.sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(2));
        for (label, reject) in [("oncely_wait", false), ("oncely_reject", true)] {
            case!(g, label, format!("{name}/{label}"), jobs_at_once, 2, 1, |ctx| {
                let k = ctx.key();
                let o = if reject { &ctx.reject } else { &ctx.wait };
                tokio::join!(oncely_delivery(&ctx, &k, o), oncely_delivery(&ctx, &k, o));
            });
        }
        case!(
            g,
            "baseline",
            format!("{name}/baseline"),
            jobs_at_once,
            2,
            1,
            |ctx| {
                let k = ctx.key();
                tokio::join!(baseline_delivery(&ctx, &k), baseline_delivery(&ctx, &k));
            }
        );
        g.finish();
    }

    {
        let name = "mysql/batch_100";
        let mut g = c.benchmark_group(name);
        g.sample_size(10)
            .measurement_time(Duration::from_secs(8))
            .warm_up_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(BATCH as u64));
        case!(g, "oncely", format!("{name}/oncely"), 1, BATCH as u64, 1, |ctx| {
            oncely_batch(&ctx, &ctx.opts).await
        });
        case!(
            g,
            "oncely_one_by_one",
            format!("{name}/oncely_one_by_one"),
            1,
            BATCH as u64,
            1,
            |ctx| { oncely_one_by_one(&ctx, &ctx.opts).await }
        );
        if ctx.returning {
            case!(
                g,
                "baseline",
                format!("{name}/baseline"),
                1,
                BATCH as u64,
                1,
                |ctx| { baseline_batch(&ctx).await }
            );
        }
        g.finish();
    }

    // Only the bench prints (this is not the library).
    let stats = ctx.stats.lock().unwrap();
    println!("\nserver work per delivery (or key), from SHOW GLOBAL STATUS:");
    println!(
        "{:<48} {}",
        "case",
        COUNTERS.iter().map(|c| format!("{c:>22}")).collect::<String>()
    );
    for (case, (n, sums)) in stats.iter() {
        let cols: String = COUNTERS
            .iter()
            .map(|c| {
                format!(
                    "{:>22.2}",
                    sums.get(*c).copied().unwrap_or(0) as f64 / (*n).max(1) as f64
                )
            })
            .collect();
        println!("{case:<48} {cols}");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
