//! PostgreSQL-specific behaviour: the caller's transaction, configuration,
//! an unreachable database, concurrent migrations, and cancellation (the
//! sqlx 0.9.0 `Pool::begin` hazard and the ledger's guard against it).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::{Rng, fresh_tenant, prune_until_gone, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Effects, Error, Tenant};
use oncely_postgres::{PgConnection, PgLedger, PgLedgerOptions};
use sqlx::AssertSqlSafe;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const TABLE: &str = "oncely_pg_tests";

static SETUP: tokio::sync::Mutex<bool> = tokio::sync::Mutex::const_new(false);

fn url() -> Option<String> {
    service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )
}

async fn pool(url: &str, max: u32) -> Option<PgPool> {
    match PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
    {
        Ok(p) => Some(p),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

/// A ledger on a pool of `max` connections, plus a separate pool to check
/// what is really committed. The tables are created once per test binary.
async fn setup(max: u32) -> Option<(PgLedger, PgPool)> {
    let url = url()?;
    let p = pool(&url, max).await?;
    let ledger = PgLedger::from_pool_with(p, PgLedgerOptions::default().table(TABLE)).unwrap();
    let observer = pool(&url, 4).await?;
    let mut done = SETUP.lock().await;
    if !*done {
        ledger.migrate().await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS oncely_pg_test_orders (id text PRIMARY KEY, paid_with_fence bigint NOT NULL)",
        )
        .execute(&observer)
        .await
        .unwrap();
        *done = true;
    }
    drop(done);
    Some((ledger, observer))
}

fn key(t: &Tenant, subject: &str) -> EffectKey {
    EffectKey::new(t, "mark-paid", subject).unwrap()
}

async fn mark_paid(conn: &mut PgConnection, id: &str, fence: u64) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO oncely_pg_test_orders (id, paid_with_fence) VALUES ($1, $2)")
        .bind(id)
        .bind(fence as i64)
        .execute(conn)
        .await
        .map(|_| ())
}

async fn orders(observer: &PgPool, id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM oncely_pg_test_orders WHERE id = $1")
        .bind(id)
        .fetch_one(observer)
        .await
        .unwrap()
}

/// The state of a record as committed, read from the observer pool.
async fn committed(observer: &PgPool, key: &EffectKey) -> Option<String> {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT state FROM {TABLE} WHERE key = $1")))
        .bind(key.as_str())
        .fetch_optional(observer)
        .await
        .unwrap()
}

/// Asserts that the records `{prefix}0` .. `{prefix}{n - 1}` of tenant `t` are
/// committed as completed, read from the observer pool.
async fn all_completed(observer: &PgPool, t: &Tenant, prefix: &str, n: usize) {
    for i in 0..n {
        assert_eq!(
            committed(observer, &key(t, &format!("{prefix}{i}")))
                .await
                .as_deref(),
            Some("completed")
        );
    }
}

/// What the transactional suite's
/// `claim_in_commits_and_rolls_back_with_the_transaction` does not show: a
/// transaction dropped without `rollback` takes its claim and business write
/// with it too, and a later claim of the key is a new record whose fence is
/// above the rolled-back one's (fences follow the clock, they do not
/// restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rollback_leaves_nothing() {
    let Some((ledger, observer)) = setup(8).await else {
        return;
    };
    let k = key(&fresh_tenant(), "order-2");
    let id = k.as_str().to_owned();
    let first = {
        // A dropped transaction rolls back.
        let mut tx = ledger.begin().await.unwrap();
        let lease = match ledger
            .claim_in(&mut *tx, &k, &ClaimOptions::default())
            .await
            .unwrap()
        {
            Claim::Acquired(l) => l,
            other => panic!("{other:?}"),
        };
        mark_paid(&mut tx, &id, lease.fence()).await.unwrap();
        ledger
            .complete_in(&mut *tx, &lease, &Outcome::from_json(&1).unwrap())
            .await
            .unwrap();
        lease
    };
    assert_eq!(committed(&observer, &k).await, None);
    assert_eq!(orders(&observer, &id).await, 0);
    assert!(ledger.get(&k).await.unwrap().is_none());
    // The key is free: a later claim inserts it anew, with a fence above the
    // rolled-back one's.
    match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => {
            assert!(!l.taken_over());
            assert!(l.fence() > first.fence(), "{} after {}", l.fence(), first.fence());
        }
        other => panic!("{other:?}"),
    }
}

/// 32 transactions claim one key at once. The first to insert holds the
/// unique index; the others block on it, and once it commits they see
/// `Completed`: one business write, nobody sees "in progress". (The
/// transactional suite's `duplicate_waits_for_the_transaction_and_sees_its_outcome`
/// has one autocommit duplicate; here every duplicate claims inside a
/// transaction of its own, all at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claim_in_writes_once() {
    let Some((ledger, observer)) = setup(40).await else {
        return;
    };
    let k = key(&fresh_tenant(), "order-3");
    let id = k.as_str().to_owned();
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (ledger, k, id, barrier) = (ledger.clone(), k.clone(), id.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let mut tx = ledger.begin().await.unwrap();
            barrier.wait().await;
            let claim = ledger
                .claim_in(&mut *tx, &k, &ClaimOptions::default())
                .await
                .unwrap();
            if let Claim::Acquired(lease) = &claim {
                mark_paid(&mut tx, &id, lease.fence()).await.unwrap();
                // Hold the transaction open so that the others pile up on
                // the unique index.
                tokio::time::sleep(Duration::from_millis(100)).await;
                ledger
                    .complete_in(&mut *tx, lease, &Outcome::from_json(&"paid").unwrap())
                    .await
                    .unwrap();
            }
            tx.commit().await.unwrap();
            claim
        }));
    }
    let (mut acquired, mut completed) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Claim::Acquired(l) => {
                assert!(!l.taken_over(), "{l:?}");
                acquired += 1;
            }
            Claim::Completed(r) => {
                assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "paid");
                completed += 1;
            }
            other => panic!("a duplicate must wait for the first commit, got {other:?}"),
        }
    }
    assert_eq!((acquired, completed), (1, 31));
    assert_eq!(orders(&observer, &id).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schema_and_table_are_configurable() {
    let Some(url) = url() else { return };
    // A bad identifier is refused before any round trip: even against a
    // closed port the answer is a configuration error, not "unavailable".
    for bad in [
        "",
        "Effects",
        "1st",
        "a-b",
        "x\"; DROP TABLE t; --",
        &"t".repeat(64),
    ] {
        let e = PgLedger::connect_with(
            "postgres://postgres@127.0.0.1:1/test",
            PgLedgerOptions::default().table(bad),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{bad:?}: {e:?}");
        let e = PgLedgerOptions::default().schema(bad).validate().unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{bad:?}: {e:?}");
    }
    let Some(p) = pool(&url, 4).await else { return };
    assert!(matches!(
        PgLedger::from_pool_with(p.clone(), PgLedgerOptions::default().schema("no such")),
        Err(Error::Config(_))
    ));

    let opts = PgLedgerOptions::default()
        .schema("oncely_test_custom")
        .table("custom_effects")
        .max_connections(4);
    let ledger = PgLedger::connect_with(&url, opts).await.unwrap();
    assert_eq!(ledger.table(), ("oncely_test_custom", "custom_effects"));
    let k = key(&fresh_tenant(), "custom");
    assert!(matches!(
        ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM oncely_test_custom.custom_effects WHERE key = $1")
        .bind(k.as_str())
        .fetch_one(&p)
        .await
        .unwrap();
    assert_eq!(n, 1);
    let elsewhere: i64 = sqlx::query_scalar("SELECT count(*) FROM public.oncely_effects WHERE key = $1")
        .bind(k.as_str())
        .fetch_one(&p)
        .await
        .unwrap_or(0);
    assert_eq!(elsewhere, 0);
    // A table that was never migrated is a configuration error, not a crash.
    let unmigrated = PgLedger::from_pool_with(
        p,
        PgLedgerOptions::default()
            .schema("oncely_test_custom")
            .table("never_made"),
    )
    .unwrap();
    let e = unmigrated.claim(&k, &ClaimOptions::default()).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_down_fails_closed() {
    let closed = "postgres://postgres@127.0.0.1:1/test";
    let opts = PgLedgerOptions::default().acquire_timeout(Duration::from_secs(2));
    let e = PgLedger::connect_with(closed, opts).await.unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    assert!(e.is_retryable());
    let e = PgLedger::connect("postgres://postgres@127.0.0.1:notaport/test")
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");

    // A ledger whose database goes away: no effect runs.
    let lazy = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(closed)
        .unwrap();
    let effects = Effects::new(PgLedger::from_pool(lazy));
    let ran = AtomicUsize::new(0);
    let e = effects
        .run(&key(&fresh_tenant(), "down"), &ClaimOptions::default(), |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok(1) }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the effect ran without a claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_are_safe() {
    let Some(url) = url() else { return };
    let Some(admin) = pool(&url, 2).await else { return };
    let schema = format!(
        "oncely_mig_{}_{}",
        std::process::id(),
        fresh_tenant().as_str().len()
    );
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
    let opts = PgLedgerOptions::default()
        .schema(schema.clone())
        .max_connections(2);
    // Four processes' worth of pools, migrating a schema that does not exist yet.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (url, opts) = (url.clone(), opts.clone());
        tasks.push(tokio::spawn(async move {
            let ledger = PgLedger::connect_with(&url, opts).await.unwrap();
            ledger.migrate().await.unwrap();
            ledger
        }));
    }
    let mut ledgers = Vec::new();
    for t in tasks {
        ledgers.push(t.await.unwrap());
    }
    let versions: Vec<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {schema}.oncely_effects_migrations"
    )))
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4, 5, 6]);
    let k = key(&fresh_tenant(), "migrated");
    assert!(matches!(
        ledgers[3].claim(&k, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));
    for l in ledgers {
        l.pool().close().await;
    }
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

/// Whether the one connection of a pool of one sits inside a transaction
/// (read-only probe: it does not end the transaction).
async fn leaked(pool: &PgPool) -> bool {
    !sqlx::query_scalar::<_, bool>(
        "SELECT coalesce((SELECT creation_time = transaction_timestamp() FROM pg_cursors WHERE name = ''), false)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Aborts a task doing `pool.begin()` after a random delay, and waits for
/// the pool to get its connection back.
async fn abort_a_begin(pool: &PgPool, rng: &mut Rng) {
    let p = pool.clone();
    let task = tokio::spawn(async move {
        let _tx = p.begin().await;
        std::future::pending::<()>().await;
    });
    // The window that leaks is while BEGIN is on the wire; how long the task
    // takes to get there depends on the load, so the delay's range varies.
    let range = [100, 400, 1_600][rng.below(3) as usize];
    tokio::time::sleep(Duration::from_micros(rng.below(range))).await;
    task.abort();
    let _ = task.await;
    // The connection's return to the pool is itself a spawned task.
    for _ in 0..2_000 {
        if pool.num_idle() == pool.size() as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The control experiment: the upstream hazard is real in this build. On a
/// pool of one, a cancelled `pool.begin()` leaves the connection inside a
/// transaction, and a plain autocommit insert on the pool is then invisible
/// to everyone else (lost when the connection closes).
///
/// If this test fails after a sqlx upgrade, the upstream fix
/// (transact-rs/sqlx#4394) has arrived; the guard stays as defence in depth.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_pool_begin_loses_plain_autocommit_writes() {
    let Some((_ledger, observer)) = setup(2).await else {
        return;
    };
    let Some(url) = url() else { return };
    let Some(one) = pool(&url, 1).await else { return };
    let mut rng = Rng::from_env("cancelled_pool_begin_loses_plain_autocommit_writes");
    let t = fresh_tenant();
    let mut lost = None;
    // A leak needs the abort to land inside `begin`; under load that can take
    // many tries.
    for i in 0..4_000 {
        abort_a_begin(&one, &mut rng).await;
        let id = format!("{t}/plain-{i}");
        let mut conn = one.acquire().await.unwrap();
        mark_paid(&mut conn, &id, 1).await.unwrap();
        drop(conn);
        if orders(&observer, &id).await == 0 {
            lost = Some(id);
            break;
        }
    }
    let lost = lost.expect("no cancelled begin leaked a transaction in 4000 tries");
    // The leaked transaction ends when the connection closes: the write that
    // "succeeded" is gone for good.
    one.close().await;
    assert_eq!(orders(&observer, &lost).await, 0);
}

/// The same hazard, through the ledger: every claim and completion made
/// after a leaked transaction is committed and visible from another pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ledger_writes_survive_leaked_transactions() {
    let Some((_ledger, observer)) = setup(2).await else {
        return;
    };
    let Some(url) = url() else { return };
    let Some(one) = pool(&url, 1).await else { return };
    let ledger = PgLedger::from_pool_with(one.clone(), PgLedgerOptions::default().table(TABLE)).unwrap();
    let mut rng = Rng::from_env("ledger_writes_survive_leaked_transactions");
    let t = fresh_tenant();
    let mut leaks = 0;
    // At least 150 rounds, and on until a cancelled begin has leaked a
    // transaction (how often one does depends on the machine's load).
    let mut rounds = 0;
    while rounds < 150 || (leaks == 0 && rounds < 3_000) {
        let i = rounds;
        rounds += 1;
        abort_a_begin(&one, &mut rng).await;
        if leaked(&one).await {
            leaks += 1;
        }
        let k = key(&t, &format!("after-leak-{i}"));
        let lease = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
            Claim::Acquired(l) => l,
            other => panic!("{other:?}"),
        };
        // Visible to everyone as soon as the claim returns: a duplicate
        // elsewhere would see it in progress.
        assert_eq!(
            committed(&observer, &k).await.as_deref(),
            Some("in_progress"),
            "claim {i} not committed"
        );
        if i % 3 == 0 {
            abort_a_begin(&one, &mut rng).await;
        }
        ledger
            .complete(&lease, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
        assert_eq!(
            committed(&observer, &k).await.as_deref(),
            Some("completed"),
            "completion {i} lost"
        );
        if i % 5 == 0 {
            abort_a_begin(&one, &mut rng).await;
            assert_eq!(
                ledger.get(&k).await.unwrap().unwrap().state,
                RecordState::Completed
            );
        }
    }
    assert!(leaks > 0, "no leaked transaction in {rounds} rounds");
    eprintln!("{leaks} leaked transactions healed in {rounds} rounds");
    one.close().await;
    all_completed(&observer, &t, "after-leak-", rounds).await;
}

/// Tasks aborted at random await points of claim, complete, `begin` and
/// claim_in, mixed with cancelled `pool.begin()` calls on the same small
/// pool: no confirmed result is lost, a claim_in commits or rolls back with
/// its business write, and every later autocommit claim is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aborted_operations_never_lose_or_split_writes() {
    let Some((_ledger, observer)) = setup(2).await else {
        return;
    };
    let Some(url) = url() else { return };
    let Some(small) = pool(&url, 2).await else { return };
    let ledger = PgLedger::from_pool_with(small.clone(), PgLedgerOptions::default().table(TABLE)).unwrap();
    let mut rng = Rng::from_env("aborted_operations_never_lose_or_split_writes");
    let t = fresh_tenant();
    let confirmed = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..300u32 {
        let (ledger, confirmed) = (ledger.clone(), confirmed.clone());
        let k = key(&t, &format!("x-{i}"));
        let task = match i % 3 {
            0 => tokio::spawn(async move {
                if let Claim::Acquired(l) = ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
                    ledger
                        .complete(&l, &Outcome::from_json(&i).unwrap())
                        .await
                        .unwrap();
                    confirmed.lock().unwrap().push(k);
                }
            }),
            1 => tokio::spawn(async move {
                let mut tx = ledger.begin().await.unwrap();
                if let Claim::Acquired(l) = ledger
                    .claim_in(&mut *tx, &k, &ClaimOptions::default())
                    .await
                    .unwrap()
                {
                    mark_paid(&mut tx, k.as_str(), l.fence()).await.unwrap();
                    ledger
                        .complete_in(&mut *tx, &l, &Outcome::from_json(&i).unwrap())
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                    confirmed.lock().unwrap().push(k);
                }
            }),
            _ => {
                let p = small.clone();
                tokio::spawn(async move {
                    let _tx = p.begin().await;
                })
            }
        };
        if i % 2 == 0 {
            let handle = task.abort_handle();
            let after = Duration::from_micros(rng.below(20_000));
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                handle.abort();
            });
        }
        tasks.push(task);
        if i % 16 == 0 {
            tokio::time::sleep(Duration::from_micros(rng.below(1000))).await;
        }
    }
    for task in tasks {
        let _ = task.await;
    }
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(!confirmed.is_empty(), "no operation completed before its abort");
    for k in &confirmed {
        assert_eq!(
            committed(&observer, k).await.as_deref(),
            Some("completed"),
            "{k} lost"
        );
    }
    for i in (1..300u32).step_by(3) {
        let k = key(&t, &format!("x-{i}"));
        let record = committed(&observer, &k).await;
        let paid = orders(&observer, k.as_str()).await;
        assert!(
            matches!((record.as_deref(), paid), (None, 0) | (Some("completed"), 1)),
            "{k}: record {record:?} with {paid} business rows"
        );
    }
    // Whatever the aborts left behind, autocommit claims and completions on
    // this pool commit, also right after another cancelled `pool.begin()`.
    for i in 0..120 {
        abort_a_begin(&small, &mut rng).await;
        let k = key(&t, &format!("after-{i}"));
        let l = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
            Claim::Acquired(l) => l,
            other => panic!("{other:?}"),
        };
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
        assert_eq!(
            committed(&observer, &k).await.as_deref(),
            Some("completed"),
            "after-{i} lost"
        );
    }
    small.close().await;
    all_completed(&observer, &t, "after-", 120).await;
}

/// `PgLedger::begin` dropped at random moments never leaves a transaction
/// open on the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ledger_begin_is_cancel_safe() {
    let Some((_ledger, observer)) = setup(2).await else {
        return;
    };
    let Some(url) = url() else { return };
    let Some(one) = pool(&url, 1).await else { return };
    let ledger = PgLedger::from_pool_with(one.clone(), PgLedgerOptions::default().table(TABLE)).unwrap();
    let mut rng = Rng::from_env("ledger_begin_is_cancel_safe");
    let t = fresh_tenant();
    for i in 0..200 {
        let l = ledger.clone();
        let task = tokio::spawn(async move {
            let _tx = l.begin().await;
            std::future::pending::<()>().await;
        });
        // The window that leaks is while BEGIN is on the wire; how long the task
        // takes to get there depends on the load, so the delay's range varies.
        let range = [100, 400, 1_600][rng.below(3) as usize];
        tokio::time::sleep(Duration::from_micros(rng.below(range))).await;
        task.abort();
        let _ = task.await;
        // A plain autocommit write on the pool (no ledger guard involved).
        let id = format!("{t}/begin-{i}");
        let mut conn = one.acquire().await.unwrap();
        mark_paid(&mut conn, &id, 1).await.unwrap();
        drop(conn);
        assert_eq!(
            orders(&observer, &id).await,
            1,
            "write {i} ran inside a leaked transaction"
        );
    }
}

/// A unique violation on anything but the effect key is not a duplicate: it
/// is reported as corruption (and counted), and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn foreign_unique_violation_is_corrupt() {
    let Some(url) = url() else { return };
    let opts = PgLedgerOptions::default()
        .schema("oncely_test_custom")
        .table("constrained")
        .max_connections(2);
    let ledger = match PgLedger::connect_with(&url, opts).await {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("PostgreSQL at {url}: {e}")).unwrap_or(()),
    };
    // Someone added a constraint the ledger knows nothing about.
    sqlx::raw_sql(
        "CREATE UNIQUE INDEX IF NOT EXISTS constrained_subject_key ON oncely_test_custom.constrained (subject)",
    )
    .execute(ledger.pool())
    .await
    .unwrap();
    let subject = format!("s-{}", fresh_tenant().as_str());
    let first = EffectKey::new(&fresh_tenant(), "capture", &subject).unwrap();
    let second = EffectKey::new(&fresh_tenant(), "capture", &subject).unwrap();
    assert!(matches!(
        ledger.claim(&first, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));
    let e = ledger.claim(&second, &ClaimOptions::default()).await.unwrap_err();
    assert!(
        matches!(&e, Error::Corrupt { message, .. } if message.contains("constrained_subject_key")),
        "{e:?}"
    );
    assert!(ledger.get(&second).await.unwrap().is_none());
    // The effect key itself is still answered, never raised.
    assert!(matches!(
        ledger.claim(&first, &ClaimOptions::default()).await.unwrap(),
        Claim::InProgress { .. }
    ));
}

/// An exhausted pool fails closed: `Unavailable`, and the effect does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_timeout_is_unavailable() {
    let Some((_ledger, _observer)) = setup(2).await else {
        return;
    };
    let Some(url) = url() else { return };
    let one = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect(&url)
        .await
        .unwrap();
    let ledger = PgLedger::from_pool_with(one.clone(), PgLedgerOptions::default().table(TABLE)).unwrap();
    let held = one.acquire().await.unwrap();
    let ran = AtomicUsize::new(0);
    let e = Effects::new(ledger.clone())
        .run(&key(&fresh_tenant(), "busy"), &ClaimOptions::default(), |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    drop(held);
}

/// In a REPEATABLE READ transaction a claim that meets a record committed
/// after its snapshot cannot be answered consistently: PostgreSQL raises a
/// serialization failure, reported as a retryable backend error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serialization_failure_is_retryable() {
    let Some((ledger, _observer)) = setup(4).await else {
        return;
    };
    let k = key(&fresh_tenant(), "rr");
    let mut tx = ledger.begin().await.unwrap();
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    // Take the snapshot now.
    sqlx::query("SELECT $1::int")
        .bind(1)
        .execute(&mut *tx)
        .await
        .unwrap();
    let l = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    let e = ledger
        .claim_in(&mut *tx, &k, &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Backend { retryable: true, .. }), "{e:?}");
    assert!(e.is_retryable());
}

/// An old message (at or before the horizon of its tenant and kind) still
/// takes over a released record it finds; it never inserts one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn old_message_takes_over_but_never_inserts() {
    let Some((ledger, observer)) = setup(4).await else {
        return;
    };
    let t = fresh_tenant();
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    let day = ClaimOptions::default().retention(Duration::from_secs(86_400));
    // A released record of this tenant and kind, kept for a day...
    let k = key(&t, "old");
    let l = match ledger.claim(&k, &day).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger.release(&l).await.unwrap();
    // ...and one pruned, which sets the horizon after `old`.
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(200));
    let pruned = key(&t, "pruned");
    let p = match ledger.claim(&pruned, &brief).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&p, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    prune_until_gone(&ledger, &pruned).await;
    let horizon = ledger.horizon(&t, k.kind()).await.unwrap().unwrap();
    assert!(horizon > old);
    match ledger.claim(&k, &day.clone().sent_at(old)).await.unwrap() {
        Claim::Acquired(l2) => {
            assert!(l2.fence() > l.fence());
            assert!(l2.taken_over());
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        ledger.claim(&k, &day.clone().sent_at(old)).await.unwrap(),
        Claim::InProgress { .. }
    ));
    let absent = key(&t, "old-absent");
    let e = ledger
        .claim(&absent, &day.clone().sent_at(old))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert_eq!(committed(&observer, &absent).await, None);
    // A message produced after the horizon is new work.
    assert!(matches!(
        ledger
            .claim(&absent, &day.sent_at(std::time::SystemTime::now()))
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
}

/// A completed record past its retention whose key a transaction holds
/// (its `claim_in` got `Completed` and the transaction goes on, holding the
/// key's lock and the row) is not pruned under it, and prune does not wait
/// for that transaction; once it ends, the record is pruned. (The window
/// where a claim holds the key's lock but no row lock yet is
/// `prune_never_deletes_a_key_a_claim_is_deciding`, in `schema.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prune_skips_keys_a_claim_holds() {
    let Some((ledger, _observer)) = setup(4).await else {
        return;
    };
    let k = key(&fresh_tenant(), "held");
    // Not prunable yet when the transaction takes the key (other tests prune
    // this table at any time), past its retention while it holds it.
    let keep = Duration::from_secs(2);
    let opts = ClaimOptions::default().lease(keep).retention(keep);
    let l = match ledger.claim(&k, &opts).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    let prunable = tokio::time::Instant::now() + keep + Duration::from_millis(200);
    let mut tx = ledger.begin().await.unwrap();
    assert!(matches!(
        ledger.claim_in(&mut *tx, &k, &opts).await.unwrap(),
        Claim::Completed(_)
    ));
    tokio::time::sleep_until(prunable).await;
    for _ in 0..3 {
        ledger.prune(u64::MAX).await.unwrap();
        assert!(
            ledger.get(&k).await.unwrap().is_some(),
            "pruned while a transaction holds its key"
        );
    }
    ledger.rollback(tx).await.unwrap();
    prune_until_gone(&ledger, &k).await;
}

/// A claim with `sent_at` reads the horizon after its wait on the key's lock,
/// not from its statement's snapshot (taken before the wait): a prune that
/// committed while it waited, raising the horizon past the message, makes
/// it `BeyondHorizon` once the key turns out absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn horizon_is_read_after_the_lock_wait() {
    let Some((ledger, observer)) = setup(6).await else {
        return;
    };
    let t = fresh_tenant();
    let sent_at = std::time::SystemTime::now() - Duration::from_secs(3600);
    // A record of the same tenant and kind that nobody (other tests prune
    // this table too) can prune before the claim below waits.
    let keep = Duration::from_secs(3);
    let older = key(&t, "older");
    let l = match ledger
        .claim(&older, &ClaimOptions::default().lease(keep).retention(keep))
        .await
        .unwrap()
    {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    let prunable = tokio::time::Instant::now() + keep + Duration::from_millis(100);

    // A transaction holds the key (claimed, not committed)...
    let k = key(&t, "late");
    let mut tx = ledger.begin().await.unwrap();
    assert!(matches!(
        ledger
            .claim_in(&mut *tx, &k, &ClaimOptions::default())
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
    // ...while an hour-old message's claim waits for it.
    let waiting = {
        let (ledger, k) = (ledger.clone(), k.clone());
        tokio::spawn(async move { ledger.claim(&k, &ClaimOptions::default().sent_at(sent_at)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the claim did not wait for the key");
    assert_eq!(ledger.horizon(&t, "mark-paid").await.unwrap(), None);
    // Meanwhile prune raises the horizon past the message; then the key's
    // holder rolls back, leaving it absent.
    tokio::time::sleep_until(prunable).await;
    prune_until_gone(&ledger, &older).await;
    assert!(ledger.horizon(&t, "mark-paid").await.unwrap().unwrap() > sent_at);
    ledger.rollback(tx).await.unwrap();
    let e = waiting.await.unwrap().unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert_eq!(committed(&observer, &k).await, None);
}
