//! The apalis layer (feature `apalis`) with a real apalis 1.x worker over
//! apalis-sqlite storage, and the SQLite and PostgreSQL ledgers: a job
//! pushed twice charges once and both tasks succeed with the same charge; a
//! failing attempt is retried by apalis and charges once; a job without the
//! field its key comes from is aborted, never retried, and never reaches
//! the handler.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis_core::backend::TaskSink;
use apalis_core::task::builder::TaskBuilder;
use apalis_core::worker::builder::WorkerBuilder;
use apalis_sqlite::{SqlitePool, SqliteStorage};
use oncely::backend::Ledger;
use oncely::conformance::fresh_tenant;
use oncely::{EffectKey, Effects};
use oncely_consumer::apalis::IdempotentLayer;
use payment_job::FakeProvider;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Capture {
    order_id: Option<String>,
    amount: i64,
    fail_first: bool,
}

async fn status_counts(pool: &SqlitePool) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT status, COUNT(*) FROM Jobs GROUP BY status")
        .fetch_all(pool)
        .await
        .unwrap();
    rows.into_iter().collect()
}

async fn apalis_worker_runs_each_job_once<L: Ledger + 'static>(ledger: L) {
    let dir = tempfile::tempdir().unwrap();
    let pool = SqlitePool::connect(&format!(
        "sqlite:{}?mode=rwc",
        dir.path().join("jobs.db").display()
    ))
    .await
    .unwrap();
    SqliteStorage::setup(&pool).await.unwrap();
    let mut storage: SqliteStorage<Capture> = SqliteStorage::new(&pool);
    let orders = 20;
    for copy in 0..2 {
        for i in 0..orders {
            let job = Capture {
                order_id: Some(format!("order-{i}")),
                amount: 100 + i,
                fail_first: false,
            };
            let _ = copy;
            storage.push(job).await.unwrap();
        }
    }
    let flaky = Capture {
        order_id: Some("order-flaky".into()),
        amount: 7,
        fail_first: true,
    };
    storage
        .push_task(TaskBuilder::new(flaky).max_attempts(3).build())
        .await
        .unwrap();
    let keyless = Capture {
        order_id: None,
        amount: 1,
        fail_first: false,
    };
    storage
        .push_task(TaskBuilder::new(keyless).max_attempts(3).build())
        .await
        .unwrap();

    // The handler: a provider that ignores idempotency keys, so only the
    // layer stands between a duplicate task and a second charge.
    let provider = Arc::new(FakeProvider::new(false));
    let calls: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let handler = {
        let (provider, calls) = (provider.clone(), calls.clone());
        move |job: Capture| {
            let (provider, calls) = (provider.clone(), calls.clone());
            async move {
                let order = job.order_id.clone().unwrap_or_default();
                let n = {
                    let mut c = calls.lock().unwrap();
                    let n = c.entry(order.clone()).or_default();
                    *n += 1;
                    *n
                };
                if job.fail_first && n == 1 {
                    return Err::<String, _>("503 from the provider".into());
                }
                let charge = provider.capture("ignored", &order, job.amount).await;
                Ok::<_, apalis_core::error::BoxDynError>(charge.id)
            }
        }
    };
    let tenant = fresh_tenant();
    let layer = IdempotentLayer::new(Arc::new(Effects::new(ledger)), move |job: &Capture| {
        let order = job
            .order_id
            .as_deref()
            .ok_or_else(|| oncely::Error::invalid_key("the job has no order_id"))?;
        EffectKey::new(&tenant, "capture", order)
    })
    .in_progress_delay(Duration::from_millis(100));
    let worker = WorkerBuilder::new("payments")
        .backend(storage)
        .layer(layer)
        .build(handler);

    let watch_pool = pool.clone();
    let done = async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
        loop {
            let counts = status_counts(&watch_pool).await;
            let settled: i64 = ["Done", "Killed"].iter().filter_map(|s| counts.get(*s)).sum();
            if settled == 2 * orders + 2 {
                return Ok::<(), std::io::Error>(());
            }
            if tokio::time::Instant::now() > deadline {
                let rows: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(
                    "SELECT CAST(job AS TEXT), status, attempts, CAST(last_result AS TEXT) FROM Jobs",
                )
                .fetch_all(&watch_pool)
                .await
                .unwrap();
                for r in rows {
                    eprintln!("{r:?}");
                }
                return Err(std::io::Error::other(format!("not settled: {counts:?}")));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    worker.run_until(done).await.unwrap();

    let counts = status_counts(&pool).await;
    assert_eq!(counts.get("Done"), Some(&(2 * orders + 1)), "{counts:?}");
    assert_eq!(
        counts.get("Killed"),
        Some(&1),
        "the keyless job is aborted: {counts:?}"
    );
    let captures = provider.captures();
    for i in 0..orders {
        assert_eq!(captures.get(&format!("order-{i}")), Some(&1), "{captures:?}");
    }
    assert_eq!(captures.get("order-flaky"), Some(&1), "{captures:?}");
    assert_eq!(captures.len() as i64, orders + 1, "{captures:?}");
    let calls = calls.lock().unwrap().clone();
    assert_eq!(
        calls.get("order-flaky"),
        Some(&2),
        "failed once, retried once: {calls:?}"
    );
    assert!(
        !calls.contains_key(""),
        "the keyless job never reached the handler: {calls:?}"
    );
    assert!(
        calls
            .iter()
            .filter(|(k, _)| k.starts_with("order-") && *k != "order-flaky")
            .all(|(_, n)| *n == 1)
    );
    let (result,): (String,) =
        sqlx::query_as("SELECT CAST(last_result AS TEXT) FROM Jobs WHERE status = 'Killed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        result.contains("AbortError") && result.contains("no order_id"),
        "{result}"
    );
    // Every duplicate task got the first task's charge back.
    let results: Vec<(String, String)> = sqlx::query_as(
        "SELECT CAST(job AS TEXT), CAST(last_result AS TEXT) FROM Jobs WHERE status = 'Done' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    for pair in results.chunks(2).filter(|p| p.len() == 2 && p[0].0 == p[1].0) {
        assert_eq!(pair[0].1, pair[1].1, "{pair:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apalis_with_the_sqlite_ledger() {
    let (ledger, _dir) = common::sqlite().await;
    apalis_worker_runs_each_job_once(ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apalis_with_the_postgres_ledger() {
    let Some(ledger) = common::postgres().await else {
        return;
    };
    apalis_worker_runs_each_job_once(ledger).await;
}

/// A task whose at-most-once effect a crashed worker abandoned is held
/// (retried after `abandoned_delay`), not killed: the handler does not run
/// while the effect is in doubt, and once reconciliation finds it not done
/// and releases it, apalis's next retry performs it, once.
async fn apalis_holds_an_abandoned_task_until_it_is_reconciled<L: Ledger + Clone + 'static>(ledger: L) {
    let dir = tempfile::tempdir().unwrap();
    let pool = SqlitePool::connect(&format!(
        "sqlite:{}?mode=rwc",
        dir.path().join("jobs.db").display()
    ))
    .await
    .unwrap();
    SqliteStorage::setup(&pool).await.unwrap();
    let mut storage: SqliteStorage<Capture> = SqliteStorage::new(&pool);
    let tenant = fresh_tenant();
    let key = EffectKey::new(&tenant, "notify", "order-1").unwrap();
    // A worker marked the effect and died: its lease ends, the effect is
    // abandoned.
    let amo = oncely::ClaimOptions::default()
        .at_most_once(true)
        .lease(Duration::from_millis(200));
    assert!(matches!(
        ledger.claim(&key, &amo).await.unwrap(),
        oncely::backend::Claim::Acquired(_)
    ));
    tokio::time::sleep(Duration::from_millis(600)).await;
    storage
        .push(Capture {
            order_id: Some("order-1".into()),
            amount: 1,
            fail_first: false,
        })
        .await
        .unwrap();

    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |_job: Capture| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, apalis_core::error::BoxDynError>("sent".to_owned())
            }
        }
    };
    let (t, k) = (tenant.clone(), key.clone());
    let layer = IdempotentLayer::new(Arc::new(Effects::new(ledger.clone())), move |job: &Capture| {
        EffectKey::new(&t, "notify", job.order_id.as_deref().unwrap_or_default())
    })
    .options(amo.lease(Duration::from_secs(10)))
    .abandoned_delay(Duration::from_millis(100));
    let worker = WorkerBuilder::new("notify")
        .backend(storage)
        .layer(layer)
        .build(handler);

    let (watch_pool, ledger2, calls2) = (pool.clone(), ledger.clone(), calls.clone());
    let done = async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        // Held for a while: never killed, never run.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let counts = status_counts(&watch_pool).await;
        if counts.contains_key("Killed") || calls2.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            return Err(std::io::Error::other(format!("not held: {counts:?}")));
        }
        // Reconciliation: not done.
        let record = ledger2.get(&k).await.unwrap().unwrap();
        assert_eq!(record.state, oncely::backend::RecordState::Abandoned);
        ledger2.release(&record.reconciliation_lease()).await.unwrap();
        loop {
            let counts = status_counts(&watch_pool).await;
            if counts.get("Done") == Some(&1) {
                return Ok::<(), std::io::Error>(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(std::io::Error::other(format!(
                    "never performed after the release: {counts:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    worker.run_until(done).await.unwrap();
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "performed once"
    );
    let record = ledger.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, oncely::backend::RecordState::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apalis_holds_an_abandoned_task_on_sqlite() {
    let (ledger, _dir) = common::sqlite().await;
    apalis_holds_an_abandoned_task_until_it_is_reconciled(ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apalis_holds_an_abandoned_task_on_postgres() {
    let Some(ledger) = common::postgres().await else {
        return;
    };
    apalis_holds_an_abandoned_task_until_it_is_reconciled(ledger).await;
}

/// A task whose effect another worker holds is retried after
/// `in_progress_delay` until the holder gives it back, then runs once.
/// (apalis 1.0 leaves a task answered with `RetryAfterError` `Pending` and
/// locked, which apalis-sqlite never fetches again: the layer must not
/// answer that way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apalis_retries_a_task_whose_effect_is_in_progress_elsewhere() {
    let (ledger, _dir) = common::sqlite().await;
    let dir = tempfile::tempdir().unwrap();
    let pool = SqlitePool::connect(&format!(
        "sqlite:{}?mode=rwc",
        dir.path().join("jobs.db").display()
    ))
    .await
    .unwrap();
    SqliteStorage::setup(&pool).await.unwrap();
    let mut storage: SqliteStorage<Capture> = SqliteStorage::new(&pool);
    let tenant = fresh_tenant();
    let key = EffectKey::new(&tenant, "capture", "order-1").unwrap();
    let holder = match ledger
        .claim(
            &key,
            &oncely::ClaimOptions::default().lease(Duration::from_secs(30)),
        )
        .await
        .unwrap()
    {
        oncely::backend::Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    storage
        .push(Capture {
            order_id: Some("order-1".into()),
            amount: 1,
            fail_first: false,
        })
        .await
        .unwrap();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |_job: Capture| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, apalis_core::error::BoxDynError>("charged".to_owned())
            }
        }
    };
    let t = tenant.clone();
    let layer = IdempotentLayer::new(Arc::new(Effects::new(ledger.clone())), move |job: &Capture| {
        EffectKey::new(&t, "capture", job.order_id.as_deref().unwrap_or_default())
    })
    .options(oncely::ClaimOptions::default().on_in_progress(oncely::OnInProgress::Reject))
    .in_progress_delay(Duration::from_millis(100));
    let worker = WorkerBuilder::new("capture")
        .backend(storage)
        .layer(layer)
        .build(handler);
    let (watch_pool, ledger2, calls2) = (pool.clone(), ledger.clone(), calls.clone());
    let done = async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        if calls2.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            return Err(std::io::Error::other("ran while another worker held the effect"));
        }
        ledger2.release(&holder).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let counts = status_counts(&watch_pool).await;
            if counts.get("Done") == Some(&1) {
                return Ok::<(), std::io::Error>(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(std::io::Error::other(format!(
                    "never retried after the holder let go: {counts:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    worker.run_until(done).await.unwrap();
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}
