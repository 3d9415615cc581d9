//! `SqliteLedger` against hand-written sqlx statements doing the same work on
//! an equivalent table in the same file, on the same pool, in one run:
//!
//! - `sqlite/claim_complete_*`: claim of a fresh key + complete, against an
//!   insert-if-absent returning the fence, then a fenced update (1 and 8
//!   tasks).
//! - `sqlite/storm_*`: the duplicate storm. Each job is delivered twice at
//!   the same instant, both deliveries through [`Effects::run`] with the
//!   `Wait` policy (the duplicate waits for the first and returns its
//!   outcome) or `Reject` (the duplicate fails with `InProgress` if the first
//!   still runs), against the hand-written minimum: `INSERT … ON CONFLICT DO
//!   NOTHING RETURNING` writing the outcome at once, and on a duplicate a
//!   `SELECT` of the stored outcome (no lease, no waiting). 1 and 8 workers;
//!   throughput in deliveries. Every run checks that each job's effect ran
//!   exactly once.
//! - `sqlite/batch_100`: 100 fresh keys claimed with one `claim_many` and
//!   completed with one `complete_many`, against one hand-written batched
//!   insert and one batched update (the same JSON-array statements without
//!   the ledger's rules). Throughput in keys; compare with
//!   `claim_complete_1_task`.
//!
//! `synchronous=NORMAL` for both sides: an fsync per commit costs both the
//! same, and its noise (a shared disk) would drown the library's own cost,
//! which is what this compares. Ratio = baseline time / oncely time.
//!
//! `cargo bench -p oncely-sqlite --bench claim`
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use oncely::backend::{Claim, Ledger, Outcome};
use oncely::{ClaimOptions, EffectKey, Effects, Error, OnInProgress, Tenant};
use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};

const BATCH: usize = 100;

const BASELINE_TABLE: &str = "CREATE TABLE IF NOT EXISTS baseline_effects (
    key TEXT PRIMARY KEY NOT NULL, tenant TEXT NOT NULL, kind TEXT NOT NULL, subject TEXT NOT NULL,
    state TEXT NOT NULL, fence INTEGER NOT NULL, fingerprint BLOB, outcome BLOB,
    at_most_once INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
    lease_expires_at INTEGER, retain_until INTEGER NOT NULL, retention_us INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS baseline_effects_prune ON baseline_effects (state, retain_until);
CREATE INDEX IF NOT EXISTS baseline_effects_abandoned
    ON baseline_effects (tenant, at_most_once, state, lease_expires_at);";

const NOW: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";

fn baseline_claim() -> String {
    format!(
        "INSERT INTO baseline_effects (key, tenant, kind, subject, state, fence, fingerprint,
            at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us)
         VALUES (?1, ?2, ?3, ?4, 'in_progress', 1, NULL, 0, {NOW}, {NOW}, {NOW} + ?5, {NOW} + ?6, ?6)
         ON CONFLICT DO NOTHING RETURNING fence"
    )
}

fn baseline_complete() -> String {
    format!(
        "UPDATE baseline_effects SET state = 'completed', outcome = ?3, lease_expires_at = NULL,
            updated_at = {NOW}, retain_until = {NOW} + retention_us
         WHERE key = ?1 AND fence = ?2 AND state = 'in_progress'"
    )
}

/// The storm's hand-written delivery: the effect's outcome is written with
/// the insert, so a duplicate only reads.
fn baseline_deliver() -> String {
    format!(
        "INSERT INTO baseline_effects (key, tenant, kind, subject, state, fence, outcome,
            at_most_once, created_at, updated_at, retain_until, retention_us)
         VALUES (?1, ?2, ?3, ?4, 'completed', 1, ?5, 0, {NOW}, {NOW}, {NOW} + ?6, ?6)
         ON CONFLICT DO NOTHING RETURNING fence"
    )
}

const BASELINE_READ: &str = "SELECT outcome FROM baseline_effects WHERE key = ?1";

/// A batch by hand: the keys as a JSON array of `[key, tenant, kind,
/// subject]`, inserted in one statement.
fn baseline_claim_batch() -> String {
    format!(
        "INSERT INTO baseline_effects (key, tenant, kind, subject, state, fence, fingerprint,
            at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us)
         SELECT j.value ->> 0, j.value ->> 1, j.value ->> 2, j.value ->> 3, 'in_progress', 1, NULL, 0,
            {NOW}, {NOW}, {NOW} + ?2, {NOW} + ?3, ?3
         FROM json_each(?1) AS j WHERE true
         ON CONFLICT DO NOTHING RETURNING key, fence"
    )
}

/// And completed in one: `?1` a JSON array of `[key, fence]`, `?2` the
/// outcome.
fn baseline_complete_batch() -> String {
    format!(
        "WITH done AS (SELECT j.value ->> 0 AS k, j.value ->> 1 AS f FROM json_each(?1) AS j)
         UPDATE baseline_effects SET state = 'completed', outcome = ?2, lease_expires_at = NULL,
            updated_at = {NOW}, retain_until = {NOW} + retention_us
         FROM done WHERE key = done.k AND fence = done.f AND +state = 'in_progress'"
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

/// What each case shares.
#[derive(Clone)]
struct Ctx {
    ledger: SqliteLedger,
    effects: Arc<Effects<SqliteLedger>>,
    tenant: Tenant,
    outcome: Outcome,
    /// Statements by hand, made once.
    sql: Arc<[String; 5]>,
    /// Effects executed (handlers run, or hand-written inserts won).
    ran: Arc<AtomicU64>,
}

const LEASE_US: i64 = 30_000_000;
const RETENTION_US: i64 = 7 * 86_400_000_000;

async fn oncely_once(cx: &Ctx) {
    let k = fresh_key(&cx.tenant);
    match cx.ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(lease) => cx.ledger.complete(&lease, &cx.outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }
}

async fn baseline_once(cx: &Ctx) {
    let k = fresh_key(&cx.tenant);
    let pool = cx.ledger.pool();
    let fence: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(cx.sql[0].as_str()))
        .bind(k.as_str())
        .bind(k.tenant().as_str())
        .bind(k.kind())
        .bind(k.subject())
        .bind(LEASE_US)
        .bind(RETENTION_US)
        .fetch_one(pool)
        .await
        .unwrap();
    let done = sqlx::query(sqlx::AssertSqlSafe(cx.sql[1].as_str()))
        .bind(k.as_str())
        .bind(fence)
        .bind(cx.outcome.as_bytes())
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), 1);
}

/// One job, both deliveries at once, through the runner.
async fn oncely_storm(cx: &Ctx, policy: OnInProgress) {
    let k = fresh_key(&cx.tenant);
    let opts = ClaimOptions::default().on_in_progress(policy);
    let deliver = || async {
        cx.effects
            .run(&k, &opts, |_| async {
                cx.ran.fetch_add(1, Ordering::Relaxed);
                Ok(1250u32)
            })
            .await
    };
    let (a, b) = tokio::join!(deliver(), deliver());
    for answer in [a, b] {
        match answer {
            Ok(v) => assert_eq!(v, 1250),
            // Reject: the duplicate arrived while the first ran.
            Err(Error::InProgress { .. }) if matches!(policy, OnInProgress::Reject) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
}

/// One delivery by hand: insert with the outcome; on a duplicate read it.
async fn baseline_delivery(cx: &Ctx, k: &EffectKey) {
    let pool = cx.ledger.pool();
    let won: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(cx.sql[2].as_str()))
        .bind(k.as_str())
        .bind(k.tenant().as_str())
        .bind(k.kind())
        .bind(k.subject())
        .bind(cx.outcome.as_bytes())
        .bind(RETENTION_US)
        .fetch_optional(pool)
        .await
        .unwrap();
    if won.is_some() {
        cx.ran.fetch_add(1, Ordering::Relaxed);
    } else {
        let stored: Option<Vec<u8>> = sqlx::query_scalar(BASELINE_READ)
            .bind(k.as_str())
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(stored.as_deref(), Some(cx.outcome.as_bytes()));
    }
}

async fn baseline_storm(cx: &Ctx) {
    let k = fresh_key(&cx.tenant);
    tokio::join!(baseline_delivery(cx, &k), baseline_delivery(cx, &k));
}

async fn oncely_batch(cx: &Ctx) {
    let keys: Vec<EffectKey> = (0..BATCH).map(|_| fresh_key(&cx.tenant)).collect();
    let claims = cx
        .ledger
        .claim_many(&keys, &ClaimOptions::default())
        .await
        .unwrap();
    let items: Vec<_> = claims
        .into_iter()
        .map(|c| match c.unwrap() {
            Claim::Acquired(l) => (l, cx.outcome.clone()),
            other => panic!("{other:?}"),
        })
        .collect();
    for r in cx.ledger.complete_many(&items).await {
        r.unwrap();
    }
}

async fn baseline_batch(cx: &Ctx) {
    let keys: Vec<EffectKey> = (0..BATCH).map(|_| fresh_key(&cx.tenant)).collect();
    let parts: Vec<[&str; 4]> = keys
        .iter()
        .map(|k| [k.as_str(), k.tenant().as_str(), k.kind(), k.subject()])
        .collect();
    let pool = cx.ledger.pool();
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(cx.sql[3].as_str()))
        .bind(serde_json::to_string(&parts).unwrap())
        .bind(LEASE_US)
        .bind(RETENTION_US)
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), BATCH);
    let done = sqlx::query(sqlx::AssertSqlSafe(cx.sql[4].as_str()))
        .bind(serde_json::to_string(&rows).unwrap())
        .bind(cx.outcome.as_bytes())
        .execute(pool)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), BATCH as u64);
}

/// Times `iters` calls of `op` spread over `tasks` tasks, and checks that
/// `effects_per_call` effects ran per call (none twice, none lost).
async fn timed<F, Fut>(cx: &Ctx, iters: u64, tasks: u64, effects_per_call: u64, op: F) -> Duration
where
    F: Fn(Ctx) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let before = cx.ran.load(Ordering::SeqCst);
    let op = Arc::new(op);
    let shared = cx.clone();
    let elapsed = oncely::conformance::spread(iters, tasks, move || {
        let (op, cx) = (op.clone(), shared.clone());
        async move { op(cx).await }
    })
    .await;
    let ran = cx.ran.load(Ordering::SeqCst) - before;
    assert_eq!(ran, iters * effects_per_call, "effects executed");
    elapsed
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("bench.db").display());
    let cx = rt.block_on(async {
        let ledger = SqliteLedger::connect_with(
            &url,
            SqliteLedgerOptions::default()
                .synchronous(SqliteSynchronous::Normal)
                .max_connections(16),
        )
        .await
        .unwrap();
        sqlx::raw_sql(BASELINE_TABLE)
            .execute(ledger.pool())
            .await
            .unwrap();
        Ctx {
            effects: Arc::new(Effects::new(ledger.clone())),
            ledger,
            tenant: Tenant::new("bench").unwrap(),
            outcome: Outcome::from_json(&serde_json::json!({"charge": "ch_1", "amount": 1250})).unwrap(),
            sql: Arc::new([
                baseline_claim(),
                baseline_complete(),
                baseline_deliver(),
                baseline_claim_batch(),
                baseline_complete_batch(),
            ]),
            ran: Arc::new(AtomicU64::new(0)),
        }
    });
    let wait = OnInProgress::Wait {
        max: Duration::from_secs(30),
    };

    for tasks in [1u64, 8] {
        let mut g = c.benchmark_group(format!(
            "sqlite/claim_complete_{tasks}_task{}",
            if tasks == 1 { "" } else { "s" }
        ));
        g.sample_size(20)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(1));
        g.bench_function("oncely", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let cx = cx.clone();
                async move { timed(&cx, iters, tasks, 0, |cx| async move { oncely_once(&cx).await }).await }
            })
        });
        g.bench_function("baseline", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let cx = cx.clone();
                async move { timed(&cx, iters, tasks, 0, |cx| async move { baseline_once(&cx).await }).await }
            })
        });
        g.finish();
    }

    for workers in [1u64, 8] {
        let mut g = c.benchmark_group(format!(
            "sqlite/storm_{workers}_worker{}",
            if workers == 1 { "" } else { "s" }
        ));
        g.sample_size(10)
            .measurement_time(Duration::from_secs(5))
            .warm_up_time(Duration::from_secs(1))
            .throughput(Throughput::Elements(2));
        for (name, policy) in [("oncely_wait", wait), ("oncely_reject", OnInProgress::Reject)] {
            g.bench_function(name, |b| {
                b.to_async(&rt).iter_custom(|iters| {
                    let cx = cx.clone();
                    async move {
                        timed(&cx, iters, workers, 1, move |cx| async move {
                            oncely_storm(&cx, policy).await
                        })
                        .await
                    }
                })
            });
        }
        g.bench_function("baseline", |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let cx = cx.clone();
                async move {
                    timed(
                        &cx,
                        iters,
                        workers,
                        1,
                        |cx| async move { baseline_storm(&cx).await },
                    )
                    .await
                }
            })
        });
        g.finish();
    }

    let mut g = c.benchmark_group("sqlite/batch_100");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(5))
        .warm_up_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(BATCH as u64));
    g.bench_function("oncely", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let cx = cx.clone();
            async move { timed(&cx, iters, 1, 0, |cx| async move { oncely_batch(&cx).await }).await }
        })
    });
    g.bench_function("baseline", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let cx = cx.clone();
            async move { timed(&cx, iters, 1, 0, |cx| async move { baseline_batch(&cx).await }).await }
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
