//! Claim + complete of a fresh key: `SqliteLedger` against hand-written sqlx
//! statements doing the same round trips (an insert-if-absent returning the
//! fence, then a fenced update) on an equivalent table in the same file, on
//! the same pool. The lead computes ratio = baseline time / oncely time.
//!
//! `cargo bench -p oncely-sqlite --bench claim`

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use oncely::{Claim, ClaimOptions, EffectKey, Ledger, Outcome, Tenant};
use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};
use sqlx::SqlitePool;

const BASELINE_TABLE: &str = "CREATE TABLE IF NOT EXISTS baseline_effects (
    key TEXT PRIMARY KEY NOT NULL, tenant TEXT NOT NULL, kind TEXT NOT NULL, subject TEXT NOT NULL,
    state TEXT NOT NULL, fence INTEGER NOT NULL, fingerprint BLOB, outcome BLOB,
    at_most_once INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
    lease_expires_at INTEGER, retain_until INTEGER NOT NULL, retention_us INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS baseline_effects_prune ON baseline_effects (state, retain_until);
CREATE INDEX IF NOT EXISTS baseline_effects_abandoned
    ON baseline_effects (tenant, at_most_once, state, lease_expires_at);";

const BASELINE_CLAIM: &str = "INSERT INTO baseline_effects (key, tenant, kind, subject, state, fence,
        fingerprint, at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us)
    VALUES (?1, ?2, ?3, ?4, 'in_progress', 1, NULL, 0,
        CAST(unixepoch('subsec') * 1000000 AS INTEGER), CAST(unixepoch('subsec') * 1000000 AS INTEGER),
        CAST(unixepoch('subsec') * 1000000 AS INTEGER) + ?5, CAST(unixepoch('subsec') * 1000000 AS INTEGER) + ?6, ?6)
    ON CONFLICT DO NOTHING RETURNING fence";

const BASELINE_COMPLETE: &str = "UPDATE baseline_effects SET state = 'completed', outcome = ?3,
        lease_expires_at = NULL, updated_at = CAST(unixepoch('subsec') * 1000000 AS INTEGER),
        retain_until = CAST(unixepoch('subsec') * 1000000 AS INTEGER) + retention_us
    WHERE key = ?1 AND fence = ?2 AND state = 'in_progress'";

static SEQ: AtomicU64 = AtomicU64::new(0);

fn fresh_key(t: &Tenant) -> EffectKey {
    EffectKey::new(
        t,
        "capture",
        format!("order-{}", SEQ.fetch_add(1, Ordering::Relaxed)),
    )
    .unwrap()
}

async fn oncely_op(ledger: &SqliteLedger, t: &Tenant, opts: &ClaimOptions, outcome: &Outcome) {
    let k = fresh_key(t);
    match ledger.claim(&k, opts).await.unwrap() {
        Claim::Acquired(lease) => ledger.complete(&lease, outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

async fn baseline_op(pool: &SqlitePool, t: &Tenant, outcome: &Outcome) {
    let k = fresh_key(t);
    let fence: i64 = sqlx::query_scalar(BASELINE_CLAIM)
        .bind(k.as_str())
        .bind(k.tenant().as_str())
        .bind(k.kind())
        .bind(k.subject())
        .bind(30_000_000i64)
        .bind(7 * 86_400_000_000i64)
        .fetch_one(pool)
        .await
        .unwrap();
    let done = sqlx::query(BASELINE_COMPLETE)
        .bind(k.as_str())
        .bind(fence)
        .bind(outcome.as_bytes())
        .execute(pool)
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
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("bench.db").display());
    let ledger = rt.block_on(async {
        let ledger = SqliteLedger::connect_with(
            &url,
            SqliteLedgerOptions::default()
                // NORMAL, not the default FULL: an fsync per commit costs both
                // sides the same and its noise (a shared disk) would drown the
                // library's own cost, which is what this compares.
                .synchronous(SqliteSynchronous::Normal)
                .max_connections(16),
        )
        .await
        .unwrap();
        sqlx::raw_sql(BASELINE_TABLE)
            .execute(ledger.pool())
            .await
            .unwrap();
        ledger
    });
    let tenant = Tenant::new("bench").unwrap();
    let outcome = Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap();
    let opts = ClaimOptions::default();

    for tasks in [1u64, 8] {
        let mut group = c.benchmark_group(format!(
            "sqlite/claim_complete_{tasks}_task{}",
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
                let (pool, tenant, outcome) = (ledger.pool().clone(), tenant.clone(), outcome.clone());
                oncely::conformance::spread(iters, tasks, move || {
                    let (pool, tenant, outcome) = (pool.clone(), tenant.clone(), outcome.clone());
                    async move { baseline_op(&pool, &tenant, &outcome).await }
                })
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
