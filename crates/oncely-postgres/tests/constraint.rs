//! A unique violation in a transactional step's own write is a bug, not a
//! duplicate: the step fails with the non-retryable
//! `Error::ConstraintViolation`, counted once in
//! `oncely_unexpected_constraint_violations_total`.
//!
//! Its own test binary: the counter is process-wide and unlabelled, so no
//! other test may move it while this one counts.

use std::time::Duration;

use oncely::backend::Ledger;
use oncely::conformance::{counter, fresh_tenant, metrics_snapshotter, service_url, skip_or_fail};
use oncely::telemetry::UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL;
use oncely::{ClaimOptions, Effects, Error, Failure, StepMode};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::postgres::PgPoolOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn step_in_unique_violation_is_a_constraint_violation() {
    metrics_snapshotter();
    let Some(url) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    let pool = match PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&url)
        .await
    {
        Ok(p) => p,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")).unwrap_or(()),
    };
    let ledger = PgLedger::from_pool_with(
        pool.clone(),
        PgLedgerOptions::default().table("oncely_pg_constraint"),
    )
    .unwrap();
    ledger.migrate().await.unwrap();
    // A business table with a unique constraint of its own.
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS oncely_pg_test_invoices (number text PRIMARY KEY, order_id text NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let t = fresh_tenant();
    let number = format!("inv-{t}");
    sqlx::query("INSERT INTO oncely_pg_test_invoices (number, order_id) VALUES ($1, 'order-1')")
        .bind(&number)
        .execute(&pool)
        .await
        .unwrap();

    let before = counter(UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL, &[]);
    let effects = Effects::new(ledger.clone());
    let job = effects.job(&t, "billing", "order-2");
    let mut tx = ledger.begin().await.unwrap();
    let n = number.clone();
    let e = job
        .step_in("invoice", &mut *tx, move |conn, _ctx| {
            Box::pin(async move {
                // A bug: the invoice number of another order. `?` makes the
                // driver's error a retryable failure, as it would anywhere.
                sqlx::query("INSERT INTO oncely_pg_test_invoices (number, order_id) VALUES ($1, 'order-2')")
                    .bind(n)
                    .execute(conn)
                    .await?;
                Ok::<_, Failure>(1u32)
            })
        })
        .await
        .unwrap_err();
    drop(tx);
    match &e {
        Error::ConstraintViolation { key, message } => {
            assert!(key.ends_with("/invoice:order-2"), "{key}");
            assert!(message.contains("oncely_pg_test_invoices_pkey"), "{message}");
        }
        other => panic!("expected ConstraintViolation, got {other:?}"),
    }
    assert!(!e.is_retryable(), "a redelivery would hit the same row: {e:?}");
    assert_eq!(
        counter(UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL, &[]) - before,
        1,
        "counted once"
    );
    // Not a duplicate: nothing of the step was stored, and the invoice
    // belongs to the first order still.
    let key = job.step_key("invoice", None).unwrap();
    assert!(ledger.get(&key).await.unwrap().is_none());
    let owner: String = sqlx::query_scalar("SELECT order_id FROM oncely_pg_test_invoices WHERE number = $1")
        .bind(&number)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(owner, "order-1");

    // The ledger recognises the driver's error however it is wrapped, and
    // nothing else.
    let raw = sqlx::query("INSERT INTO oncely_pg_test_invoices (number, order_id) VALUES ($1, 'x')")
        .bind(&number)
        .execute(&pool)
        .await
        .unwrap_err();
    let wrapped = std::io::Error::other(raw);
    assert!(ledger.unique_violation(&wrapped).is_some());
    let other = sqlx::query("SELECT 1/0").execute(&pool).await.unwrap_err();
    assert!(ledger.unique_violation(&other).is_none());
    assert!(ledger.unique_violation(&std::io::Error::other("23505")).is_none());

    // In an at-most-once step the same bug comes after the effect may have
    // happened (the receipt went out, then logging it hit another order's
    // row): the step is kept, not released, so the redelivery finds it
    // abandoned instead of sending the receipt again.
    let short = Duration::from_millis(300);
    let sent = std::sync::atomic::AtomicUsize::new(0);
    let receipt = || {
        let (pool, n) = (pool.clone(), number.clone());
        let job = effects
            .job(&t, "receipts", "order-2")
            .options(ClaimOptions::default().lease(short));
        let sent = &sent;
        async move {
            job.step("receipt", StepMode::AtMostOnce, |_ctx| async move {
                sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                sqlx::query("INSERT INTO oncely_pg_test_invoices (number, order_id) VALUES ($1, 'order-2')")
                    .bind(n)
                    .execute(&pool)
                    .await?;
                Ok::<_, Failure>(())
            })
            .await
        }
    };
    let e = receipt().await.unwrap_err();
    assert!(matches!(e, Error::ConstraintViolation { .. }), "{e:?}");
    tokio::time::sleep(short * 3).await;
    let e = receipt().await.unwrap_err();
    assert!(matches!(e, Error::Abandoned { .. }), "{e:?}");
    assert_eq!(
        sent.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the receipt was sent twice"
    );
}
