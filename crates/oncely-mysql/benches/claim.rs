//! Claim + complete of a fresh key: `MySqlLedger` against hand-written sqlx
//! statements doing the same round trips on an equivalent table (the same
//! DDL, made by the same migrations under another name) on the same pool:
//! an insert that returns the fence (the clock's µs; `INSERT … ON DUPLICATE
//! KEY UPDATE … RETURNING` on MariaDB; the insert and a read of the row on
//! MySQL 8), then a fenced update. The baseline reads the clock the simple
//! way (`UTC_TIMESTAMP(6)`, the statement's start); the ledger's clock read
//! after any lock wait is part of what the ratio measures. The lead computes ratio = baseline time / oncely time.
//!
//! `cargo bench -p oncely-mysql --bench claim` (server: `ONCELY_MYSQL_URL`,
//! default `mysql://root@127.0.0.1:3306/test`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use oncely::{Claim, ClaimOptions, EffectKey, Ledger, Outcome, Tenant};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::{Executor, MySqlPool, Row};

const NOW_US: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

fn baseline_claim(returning: bool) -> String {
    format!(
        "INSERT INTO oncely_bench_baseline (effect_key, tenant, kind, subject, state, fence, at_most_once, \
         claim_token, created_us, updated_us, lease_expires_us, retention_us, retain_until_us) \
         VALUES (?, ?, ?, ?, 'in_progress', {NOW_US}, 0, ?, {NOW_US}, {NOW_US}, {NOW_US} + ?, ?, {NOW_US} + ?) \
         ON DUPLICATE KEY UPDATE fence = fence{}",
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

static SEQ: AtomicU64 = AtomicU64::new(0);

fn fresh_key(t: &Tenant) -> EffectKey {
    EffectKey::new(
        t,
        "capture",
        format!("order-{}", SEQ.fetch_add(1, Ordering::Relaxed)),
    )
    .unwrap()
}

async fn oncely_op(ledger: &MySqlLedger, t: &Tenant, opts: &ClaimOptions, outcome: &Outcome) {
    let k = fresh_key(t);
    match ledger.claim(&k, opts).await.unwrap() {
        Claim::Acquired(lease) => ledger.complete(&lease, outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

struct Baseline {
    pool: MySqlPool,
    claim: String,
    read: Option<String>,
    complete: String,
}

async fn baseline_op(b: &Baseline, t: &Tenant, outcome: &Outcome) {
    let k = fresh_key(t);
    let q = sqlx::query(sqlx::AssertSqlSafe(b.claim.as_str()))
        .bind(k.as_str())
        .bind(k.tenant().as_str())
        .bind(k.kind())
        .bind(k.subject())
        .bind(&[0u8; 16][..])
        .bind(30_000_000i64)
        .bind(7 * 86_400_000_000i64)
        .bind(7 * 86_400_000_000i64);
    let fence: u64 = match &b.read {
        None => q.fetch_one(&b.pool).await.unwrap().get("fence"),
        Some(read) => {
            let mut conn = b.pool.acquire().await.unwrap();
            q.execute(&mut *conn).await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(read.as_str()))
                .bind(k.as_str())
                .fetch_one(&mut *conn)
                .await
                .unwrap()
                .get("fence")
        }
    };
    let done = sqlx::query(sqlx::AssertSqlSafe(b.complete.as_str()))
        .bind(outcome.as_bytes())
        .bind(k.as_str())
        .bind(fence)
        .execute(&b.pool)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), 1);
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let url =
        std::env::var("ONCELY_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let (ledger, baseline) = rt.block_on(async {
        let opts = MySqlLedgerOptions::default().max_connections(16);
        let ledger = MySqlLedger::connect_with(&url, opts.clone().table("oncely_bench_effects"))
            .await
            .unwrap();
        // The equivalent table: the same migrations under another name.
        let twin =
            MySqlLedger::from_pool_with(ledger.pool().clone(), opts.table("oncely_bench_baseline")).unwrap();
        twin.migrate().await.unwrap();
        for t in ["oncely_bench_effects", "oncely_bench_baseline"] {
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
        let baseline = Baseline {
            pool: ledger.pool().clone(),
            claim: baseline_claim(returning),
            read: (!returning).then(|| {
                "SELECT fence FROM oncely_bench_baseline WHERE effect_key = ? FOR UPDATE".to_owned()
            }),
            complete: baseline_complete(),
        };
        (ledger, Arc::new(baseline))
    });
    let tenant = Tenant::new("bench").unwrap();
    let outcome = Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap();
    let opts = ClaimOptions::default();

    for tasks in [1u64, 8] {
        let mut group = c.benchmark_group(format!(
            "mysql/claim_complete_{tasks}_task{}",
            if tasks == 1 { "" } else { "s" }
        ));
        group
            .sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1));
        group.bench_function("oncely", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (ledger, tenant, opts, outcome) =
                    (ledger.clone(), tenant.clone(), opts.clone(), outcome.clone());
                oncely::conformance::spread(iters, tasks, move || {
                    let (ledger, tenant, opts, outcome) =
                        (ledger.clone(), tenant.clone(), opts.clone(), outcome.clone());
                    async move { oncely_op(&ledger, &tenant, &opts, &outcome).await }
                })
            })
        });
        group.bench_function("baseline", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (baseline, tenant, outcome) = (baseline.clone(), tenant.clone(), outcome.clone());
                oncely::conformance::spread(iters, tasks, move || {
                    let (baseline, tenant, outcome) = (baseline.clone(), tenant.clone(), outcome.clone());
                    async move { baseline_op(&baseline, &tenant, &outcome).await }
                })
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
