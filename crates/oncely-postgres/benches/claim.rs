//! Claim + complete of a fresh key: `PgLedger` against hand-written sqlx
//! doing the same two round trips on an identical table of the same server.
//!
//! - `oncely`: `Ledger::claim` + `Ledger::complete`.
//! - `baseline`: `INSERT … ON CONFLICT (key) DO NOTHING RETURNING fence`,
//!   then the fenced `UPDATE … WHERE key = $1 AND fence = $2 AND state = 'in_progress'`.
//! - `baseline_plus_guard`: the baseline with the leaked-transaction guard
//!   (the `pg_cursors` lookup) added to both statements: the guard's cost alone.
//!
//! Needs PostgreSQL at `ONCELY_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`).
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use oncely::{Claim, ClaimOptions, EffectKey, Ledger, Outcome, Tenant};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const BASELINE_TABLE: &str = "oncely_bench_baseline";

static SEQ: AtomicU64 = AtomicU64::new(0);

fn next_subject() -> String {
    format!("k-{}", SEQ.fetch_add(1, Ordering::Relaxed))
}

struct Setup {
    ledger: PgLedger,
    pool: PgPool,
    tenant: Tenant,
}

const CLAIM: &str = "INSERT INTO oncely_bench_baseline (key, tenant, kind, subject, state, fence, \
     fingerprint, outcome, at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us) \
     VALUES ($1, $2, $3, $4, 'in_progress', 1, NULL, NULL, false, now(), now(), \
     now() + $5::bigint * interval '1 microsecond', now() + $6::bigint * interval '1 microsecond', $6) \
     ON CONFLICT (key) DO NOTHING RETURNING fence";

const COMPLETE: &str = "UPDATE oncely_bench_baseline SET state = 'completed', outcome = $3, \
     lease_expires_at = NULL, updated_at = now(), \
     retain_until = now() + retention_us * interval '1 microsecond' \
     WHERE key = $1 AND fence = $2 AND state = 'in_progress'";

const GUARD: &str = "coalesce((SELECT c.creation_time = transaction_timestamp() \
     FROM pg_catalog.pg_cursors c WHERE c.name = ''), false)";

async fn setup() -> Setup {
    let url = std::env::var("ONCELY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    // One pool for both sides: same size, same settings, same server.
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .test_before_acquire(false)
        .connect(&url)
        .await
        .expect("PostgreSQL for the bench");
    let ledger =
        PgLedger::from_pool_with(pool.clone(), PgLedgerOptions::default().table("oncely_bench")).unwrap();
    ledger.migrate().await.unwrap();
    // The baseline's table is created by the same migration, so the two
    // tables are identical (columns, constraints, indexes).
    let twin =
        PgLedger::from_pool_with(pool.clone(), PgLedgerOptions::default().table(BASELINE_TABLE)).unwrap();
    twin.migrate().await.unwrap();
    sqlx::raw_sql("TRUNCATE oncely_bench, oncely_bench_baseline")
        .execute(&pool)
        .await
        .unwrap();
    Setup {
        ledger,
        pool,
        tenant: Tenant::new(format!("bench{}", std::process::id())).unwrap(),
    }
}

async fn oncely_once(ledger: &PgLedger, tenant: &Tenant, opts: &ClaimOptions, outcome: &Outcome) {
    let key = EffectKey::new(tenant, "capture", next_subject()).unwrap();
    match ledger.claim(&key, opts).await.unwrap() {
        Claim::Acquired(lease) => ledger.complete(&lease, outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

async fn baseline_once(pool: &PgPool, tenant: &Tenant, opts: &ClaimOptions, outcome: &Outcome, sql: &Sql) {
    let key = EffectKey::new(tenant, "capture", next_subject()).unwrap();
    let fence: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.claim.clone()))
        .bind(key.as_str())
        .bind(tenant.as_str())
        .bind(key.kind())
        .bind(key.subject())
        .bind(oncely::backend::duration_micros(opts.lease))
        .bind(oncely::backend::duration_micros(opts.retention))
        .fetch_optional(pool)
        .await
        .unwrap();
    let fence = fence.expect("fresh key acquired");
    let done = sqlx::query(sqlx::AssertSqlSafe(sql.complete.clone()))
        .bind(key.as_str())
        .bind(fence)
        .bind(outcome.as_bytes())
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), 1);
}

#[derive(Clone)]
struct Sql {
    claim: Arc<str>,
    complete: Arc<str>,
}

impl Sql {
    fn plain() -> Self {
        Sql {
            claim: CLAIM.into(),
            complete: COMPLETE.into(),
        }
    }

    fn guarded() -> Self {
        Sql {
            claim: CLAIM
                .replace(
                    "VALUES ($1, $2, $3, $4, 'in_progress', 1, NULL, NULL, false, now(), now(), \
     now() + $5::bigint * interval '1 microsecond', now() + $6::bigint * interval '1 microsecond', $6)",
                    "SELECT $1, $2, $3, $4, 'in_progress', 1, NULL, NULL, false, now(), now(), \
     now() + $5::bigint * interval '1 microsecond', now() + $6::bigint * interval '1 microsecond', $6 \
     WHERE GUARD",
                )
                .replace("GUARD", GUARD)
                .into(),
            complete: format!("{COMPLETE} AND {GUARD}").into(),
        }
    }
}

#[derive(Clone, Copy)]
enum Side {
    Oncely,
    Baseline,
    BaselineGuarded,
}

async fn run(setup: Arc<Setup>, side: Side, tasks: u64, iters: u64) -> Duration {
    let opts = ClaimOptions::default();
    let outcome = Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap();
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let n = iters / tasks + u64::from(t < iters % tasks);
        let (setup, opts, outcome) = (setup.clone(), opts.clone(), outcome.clone());
        handles.push(tokio::spawn(async move {
            let sql = match side {
                Side::BaselineGuarded => Sql::guarded(),
                _ => Sql::plain(),
            };
            for _ in 0..n {
                match side {
                    Side::Oncely => oncely_once(&setup.ledger, &setup.tenant, &opts, &outcome).await,
                    Side::Baseline | Side::BaselineGuarded => {
                        baseline_once(&setup.pool, &setup.tenant, &opts, &outcome, &sql).await
                    }
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let setup = Arc::new(rt.block_on(setup()));
    for (group_name, tasks) in [
        ("postgres/claim_complete_1_task", 1u64),
        ("postgres/claim_complete_8_tasks", 8),
    ] {
        let mut group = c.benchmark_group(group_name);
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1));
        for (name, side) in [
            ("oncely", Side::Oncely),
            ("baseline", Side::Baseline),
            ("baseline_plus_guard", Side::BaselineGuarded),
        ] {
            let setup = setup.clone();
            group.bench_function(name, |b| {
                b.to_async(&rt)
                    .iter_custom(|iters| run(setup.clone(), side, tasks, iters))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
