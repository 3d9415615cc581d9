//! SQLite-specific behaviour: claims inside the caller's transaction, fail
//! closed on an unopenable file, migrations, durability across reopening.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey, Effects, Error, Tenant};
use oncely_sqlite::{SqliteConnection, SqliteLedger, SqliteLedgerOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};

async fn open(dir: &tempfile::TempDir, name: &str) -> SqliteLedger {
    let url = format!("sqlite:{}", dir.path().join(name).display());
    let ledger = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().max_connections(40))
        .await
        .unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL)")
        .execute(ledger.pool())
        .await
        .unwrap();
    ledger
}

fn key(t: &Tenant, subject: &str) -> EffectKey {
    EffectKey::new(t, "ship", subject).unwrap()
}

async fn orders(pool: &SqlitePool, id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders WHERE id = ?1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn insert_order(conn: &mut SqliteConnection, id: &str) {
    sqlx::query("INSERT INTO orders (id, amount) VALUES (?1, 1250)")
        .bind(id)
        .execute(conn)
        .await
        .unwrap();
}

/// One delivery in the `Transactional` mode: claim, business write and
/// completion in one `BEGIN IMMEDIATE` transaction. Returns whether this
/// delivery performed the write; retries a busy `begin` like a consumer would.
async fn deliver(ledger: &SqliteLedger, k: &EffectKey, order: &str) -> (bool, Outcome) {
    loop {
        let mut tx = match ledger.begin().await {
            Ok(tx) => tx,
            Err(e) if e.is_retryable() => continue,
            Err(e) => panic!("{e:?}"),
        };
        // Handlers often read before they claim; under a deferred BEGIN that
        // read's snapshot would make the claim fail with SQLITE_BUSY.
        sqlx::query("SELECT count(*) FROM orders")
            .execute(&mut *tx)
            .await
            .unwrap();
        match ledger
            .claim_in(&mut tx, k, &ClaimOptions::default())
            .await
            .unwrap()
        {
            Claim::Acquired(lease) => {
                insert_order(&mut tx, order).await;
                let outcome = Outcome::from_json(&format!("shipped-{}", lease.fence())).unwrap();
                ledger.complete_in(&mut tx, &lease, &outcome).await.unwrap();
                tx.commit().await.unwrap();
                return (true, outcome);
            }
            Claim::Completed(r) => return (false, r.outcome.unwrap()),
            other => panic!("inside BEGIN IMMEDIATE a duplicate sees the committed state, got {other:?}"),
        }
    }
}

/// Dropping a transaction (a cancelled handler) rolls it back, and the
/// connection it used comes back clean: nothing of the claim or the order
/// remains, and the next delivery commits. (An explicit rollback, and the
/// commit of a claim with its completion, are in the transactional
/// conformance suite.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_transaction_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "rollback.db").await;
    let k = key(&fresh_tenant(), "order-2");
    {
        let mut tx = ledger.begin().await.unwrap();
        assert!(matches!(
            ledger
                .claim_in(&mut tx, &k, &ClaimOptions::default())
                .await
                .unwrap(),
            Claim::Acquired(_)
        ));
        insert_order(&mut tx, "order-2").await;
    }
    assert!(ledger.get(&k).await.unwrap().is_none());
    assert_eq!(orders(ledger.pool(), "order-2").await, 0);
    let (performed, outcome) = deliver(&ledger, &k, "order-2").await;
    assert!(performed);
    let r = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(
        outcome.to_value::<String>().unwrap(),
        format!("shipped-{}", r.fence),
        "the record is the committed delivery's"
    );
    assert_eq!(orders(ledger.pool(), "order-2").await, 1);
}

/// Many concurrent deliveries, each in its own transaction on its own
/// connection: exactly one business write, and every duplicate replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_transactional_deliveries_write_once() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "race.db").await;
    let t = fresh_tenant();
    for round in 0..3 {
        let order = format!("order-race-{round}");
        let k = key(&t, &order);
        let barrier = Arc::new(tokio::sync::Barrier::new(24));
        let mut tasks = Vec::new();
        for _ in 0..24 {
            let (ledger, k, order, barrier) = (ledger.clone(), k.clone(), order.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                deliver(&ledger, &k, &order).await
            }));
        }
        let mut performed = 0;
        let mut outcomes = std::collections::HashSet::new();
        for task in tasks {
            let (did, outcome) = task.await.unwrap();
            performed += usize::from(did);
            outcomes.insert(outcome.into_bytes());
        }
        assert_eq!(performed, 1, "exactly one delivery writes");
        assert_eq!(outcomes.len(), 1, "every delivery sees the one outcome");
        assert_eq!(orders(ledger.pool(), &order).await, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unopenable_database_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir").join("ledger.db");
    let e = SqliteLedger::connect(&format!("sqlite:{}", missing.display()))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unavailable {
                backend: "sqlite",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_retryable());

    // A lazily opened pool reaches the file only on the first claim: the
    // claim fails closed and the effect never runs.
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(SqliteConnectOptions::new().filename(&missing));
    let effects = Effects::new(SqliteLedger::from_pool(pool));
    let ran = AtomicUsize::new(0);
    let e = effects
        .run(&key(&fresh_tenant(), "order-3"), &ClaimOptions::default(), |_| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok(1u32) }
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0, "no effect runs without the ledger");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_forms_open_the_same_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("forms.db");
    let k = key(&fresh_tenant(), "order-6");
    let first = SqliteLedger::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let Claim::Acquired(l) = first.claim(&k, &ClaimOptions::default()).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    first
        .complete(&l, &Outcome::from_json(&6).unwrap())
        .await
        .unwrap();
    assert!(first.capabilities().durability.contains("synchronous=FULL"));
    for url in [
        path.display().to_string(),
        format!("sqlite:{}?mode=rwc", path.display()),
    ] {
        let other = SqliteLedger::connect(&url).await.unwrap();
        assert_eq!(
            other.get(&k).await.unwrap().map(|r| r.state),
            Some(RecordState::Completed),
            "{url}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_and_table_names_are_config_errors() {
    for url in ["sqlite::memory:", "sqlite://file?mode=memory"] {
        assert!(
            matches!(SqliteLedger::connect(url).await, Err(Error::Config(_))),
            "{url}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("t.db").display());
    let e = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().table("x; DROP TABLE y"))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(!dir.path().join("t.db").exists(), "a bad option opens nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_twice_are_a_no_op() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "migrate.db").await;
    let k = key(&fresh_tenant(), "order-4");
    let lease = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger.migrate().await.unwrap();
    ledger.migrate().await.unwrap();
    // Reconnecting migrates again; nothing changes.
    let again = open(&dir, "migrate.db").await;
    let version: i64 =
        sqlx::query_scalar("SELECT version FROM oncely_schema WHERE table_name = 'oncely_effects'")
            .fetch_one(again.pool())
            .await
            .unwrap();
    assert_eq!(version, 3);
    let r = again.get(&k).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::InProgress, lease.fence()));
    again
        .complete(&lease, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    // A second table in the same file has its own version row.
    let other = SqliteLedger::from_pool(again.pool().clone())
        .with_table("other_effects")
        .unwrap();
    other.migrate().await.unwrap();
    other.migrate().await.unwrap();
    assert!(other.get(&k).await.unwrap().is_none(), "tables are independent");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM oncely_schema")
        .fetch_one(again.pool())
        .await
        .unwrap();
    assert_eq!(n, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_record_survives_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let k = key(&fresh_tenant(), "order-5");
    let outcome = Outcome::from_json(&serde_json::json!({"charge": "ch_1"})).unwrap();
    let fence = {
        let ledger = open(&dir, "durable.db").await;
        let lease = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
            Claim::Acquired(l) => l,
            other => panic!("{other:?}"),
        };
        ledger.complete(&lease, &outcome).await.unwrap();
        ledger.pool().close().await;
        lease.fence()
    };
    let reopened = open(&dir, "durable.db").await;
    match reopened.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Completed(r) => {
            assert_eq!(r.outcome.unwrap(), outcome);
            assert_eq!(r.fence, fence);
        }
        other => panic!("expected the completed record after reopening, got {other:?}"),
    }
}

/// Transactional deliveries aborted at random points: a claim row exists
/// exactly when its order row does (they commit together or not at all), and
/// the pool's connections come back clean, so later autocommit claims persist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aborted_transactions_commit_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("abort.db").display());
    // A small pool, so aborted transactions' connections are reused at once.
    let ledger = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().max_connections(4))
        .await
        .unwrap();
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL)")
        .execute(ledger.pool())
        .await
        .unwrap();
    let t = fresh_tenant();
    let mut rng = oncely::conformance::Rng::from_env("aborted_transactions_commit_all_or_nothing");
    let mut tasks = Vec::new();
    for i in 0..120 {
        let (ledger, k) = (ledger.clone(), key(&t, &format!("order-abort-{i}")));
        let task = tokio::spawn(async move {
            let Ok(mut tx) = ledger.begin().await else { return };
            if let Ok(Claim::Acquired(lease)) = ledger.claim_in(&mut tx, &k, &ClaimOptions::default()).await {
                insert_order(&mut tx, k.subject()).await;
                ledger
                    .complete_in(&mut tx, &lease, &Outcome::from_json(&i).unwrap())
                    .await
                    .unwrap();
                let _ = tx.commit().await;
            }
        });
        let abort_after = Duration::from_micros(rng.below(100_000));
        let handle = task.abort_handle();
        tokio::spawn(async move {
            tokio::time::sleep(abort_after).await;
            handle.abort();
        });
        tasks.push(task);
    }
    for task in tasks {
        let _ = task.await;
    }
    let mut committed = 0;
    for i in 0..120 {
        let k = key(&t, &format!("order-abort-{i}"));
        let record = ledger.get(&k).await.unwrap();
        let order = orders(ledger.pool(), k.subject()).await;
        match record {
            Some(r) => {
                assert_eq!(r.state, RecordState::Completed, "{r:?}");
                assert_eq!(order, 1, "{k}: claim committed without its order");
                committed += 1;
            }
            None => assert_eq!(order, 0, "{k}: order committed without its claim"),
        }
    }
    eprintln!("{committed} of 120 transactions committed before their abort");
    for i in 0..50 {
        let k = key(&t, &format!("after-{i}"));
        let Claim::Acquired(l) = ledger.claim(&k, &ClaimOptions::default()).await.unwrap() else {
            panic!("fresh key not acquired")
        };
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
    }
    for i in 0..50 {
        let r = ledger.get(&key(&t, &format!("after-{i}"))).await.unwrap();
        assert_eq!(
            r.map(|r| r.state),
            Some(RecordState::Completed),
            "after-{i} was lost"
        );
    }
}

/// A unique violation on anything but the effect key is an error (and a
/// counted bug), never mistaken for a duplicate, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_unique_violation_is_not_a_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "unique.db").await.with_table("uv_effects").unwrap();
    ledger.migrate().await.unwrap();
    // Someone added a constraint the ledger does not know about.
    sqlx::query("CREATE UNIQUE INDEX uv_one_per_subject ON uv_effects (subject)")
        .execute(ledger.pool())
        .await
        .unwrap();
    let t = fresh_tenant();
    let first = EffectKey::new(&t, "capture", "order-7").unwrap();
    let other = EffectKey::new(&t, "receipt", "order-7").unwrap();
    let Claim::Acquired(lease) = ledger.claim(&first, &ClaimOptions::default()).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    let e = ledger.claim(&other, &ClaimOptions::default()).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Corrupt {
                backend: "sqlite",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(ledger.get(&other).await.unwrap().is_none());
    let r = ledger.get(&first).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::InProgress, lease.fence()));
}

/// A writer that cannot get SQLite's write lock within the busy timeout gets
/// a retryable error and writes nothing; once the lock is free it succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_database_is_retryable() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("busy.db").display());
    let ledger = SqliteLedger::connect_with(
        &url,
        SqliteLedgerOptions::default().busy_timeout(Duration::from_millis(50)),
    )
    .await
    .unwrap();
    let k = key(&fresh_tenant(), "order-8");
    let holder = ledger.begin().await.unwrap();
    let e = ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err();
    assert!(
        matches!(e, Error::Backend { retryable: true, .. }) && e.is_retryable(),
        "{e:?}"
    );
    assert!(
        ledger.get(&k).await.unwrap().is_none(),
        "readers are not blocked, and nothing was written"
    );
    holder.rollback().await.unwrap();
    assert!(matches!(
        ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));
}

/// The core's `Transactional` step mode on this backend: `Job::step_in` on a
/// `begin()` transaction writes the order once; a redelivered job replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_step_in_runs_once_per_job() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "job.db").await;
    let effects = Effects::new(ledger.clone());
    let tenant = fresh_tenant();
    let ran = Arc::new(AtomicUsize::new(0));
    let mut first = None;
    for _delivery in 0..3 {
        let job = effects.job(&tenant, "payment", "order-9");
        let mut tx = ledger.begin().await.unwrap();
        let ran = ran.clone();
        let id: String = job
            .step_in("record", &mut tx, move |conn, ctx| {
                Box::pin(async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    insert_order(conn, "order-9").await;
                    Ok(format!("order-9@{}", ctx.fence()))
                })
            })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        // Every delivery replays the first one's outcome (its fence).
        assert_eq!(&id, first.get_or_insert_with(|| id.clone()));
    }
    let r = effects
        .job(&tenant, "payment", "order-9")
        .step_record("record", None)
        .await
        .unwrap()
        .expect("the step's record");
    assert_eq!(first.unwrap(), format!("order-9@{}", r.fence));
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(orders(ledger.pool(), "order-9").await, 1);
}

/// A claim that waited for SQLite's write lock is stamped with the clock of
/// its write, not of its request: `acquired_at` is after the wait, the whole
/// lease is left, and the record says the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquired_at_is_the_clock_of_the_write() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "clock.db").await;
    let t = fresh_tenant();
    let lease = Duration::from_secs(1);
    let opts = ClaimOptions::default().lease(lease);
    let mut tx = ledger.begin().await.unwrap();
    let Claim::Acquired(first) = ledger.claim_in(&mut tx, &key(&t, "holder"), &opts).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    let waiter = {
        let (ledger, k, opts) = (ledger.clone(), key(&t, "waiter"), opts.clone());
        tokio::spawn(async move { ledger.claim(&k, &opts).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiter.is_finished(), "the second writer waits for the lock");
    tx.commit().await.unwrap();
    let Claim::Acquired(second) = waiter.await.unwrap().unwrap() else {
        panic!("fresh key not acquired")
    };
    let waited = second.acquired_at().duration_since(first.acquired_at()).unwrap();
    assert!(
        waited >= Duration::from_millis(1900),
        "stamped before the wait: {waited:?}"
    );
    assert_eq!(
        second.expires_at().duration_since(second.acquired_at()).unwrap(),
        lease
    );
    let r = ledger.get(&key(&t, "waiter")).await.unwrap().unwrap();
    assert_eq!(
        (r.created_at, r.updated_at),
        (second.acquired_at(), second.acquired_at())
    );
    assert_eq!(r.lease_expires_at, Some(second.expires_at()));
}

/// Fences only grow, also when grants come faster than the clock's
/// millisecond (`previous + 1`), and a takeover says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_grow_faster_than_the_clock() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "fences.db").await;
    let k = key(&fresh_tenant(), "order-fast");
    let mut last: Option<u64> = None;
    for i in 0..50 {
        let Claim::Acquired(l) = ledger.claim(&k, &ClaimOptions::default()).await.unwrap() else {
            panic!("a released key is acquired")
        };
        assert_eq!(l.taken_over(), i > 0, "{l:?}");
        if let Some(last) = last {
            assert!(l.fence() > last, "fence {} after {last}", l.fence());
        }
        last = Some(l.fence());
        ledger.release(&l).await.unwrap();
    }
}

/// Prune raises the horizon of exactly the tenants and kinds it deleted
/// from, to the newest `created_at` it deleted, and never lowers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_raises_the_horizon_of_what_it_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "horizon.db").await;
    let t = fresh_tenant();
    let complete = |k: EffectKey, retention: Duration| {
        let ledger = ledger.clone();
        async move {
            let opts = ClaimOptions::default().lease(retention).retention(retention);
            let Claim::Acquired(l) = ledger.claim(&k, &opts).await.unwrap() else {
                panic!("fresh key not acquired")
            };
            ledger
                .complete(&l, &Outcome::from_json(&1).unwrap())
                .await
                .unwrap();
            ledger.get(&k).await.unwrap().unwrap().created_at
        }
    };
    // An old record kept a while, a newer one kept briefly.
    let old = EffectKey::new(&t, "capture", "old").unwrap();
    let old_created = complete(old.clone(), Duration::from_millis(1500)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let new = EffectKey::new(&t, "capture", "new").unwrap();
    let new_created = complete(new.clone(), Duration::from_millis(100)).await;
    let other = EffectKey::new(&t, "receipt", "kept").unwrap();
    complete(other.clone(), Duration::from_secs(3600)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 1);
    assert!(ledger.get(&new).await.unwrap().is_none());
    assert_eq!(ledger.horizon(&t, "capture").await.unwrap(), Some(new_created));
    assert_eq!(
        ledger.horizon(&t, "receipt").await.unwrap(),
        None,
        "nothing pruned there"
    );
    // The older record goes later; the horizon stays at the newest.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 1);
    assert!(ledger.get(&old).await.unwrap().is_none());
    assert!(old_created < new_created);
    assert_eq!(ledger.horizon(&t, "capture").await.unwrap(), Some(new_created));
    // A replay of the old record is beyond the horizon; a message produced
    // after it is new work.
    let e = ledger
        .claim(&old, &ClaimOptions::default().sent_at(old_created))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    assert!(ledger.get(&old).await.unwrap().is_none());
    assert!(matches!(
        ledger
            .claim(
                &old,
                &ClaimOptions::default().sent_at(new_created + Duration::from_millis(1))
            )
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
}

/// A prune with a limit raises the horizon only for the records it deleted:
/// the horizon statement and the delete pick the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_prune_raises_only_what_it_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = open(&dir, "limit.db").await;
    let tenants: Vec<_> = (0..6).map(|_| fresh_tenant()).collect();
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(50))
        .retention(Duration::from_millis(50));
    for t in &tenants {
        let k = EffectKey::new(t, "capture", "x").unwrap();
        let Claim::Acquired(l) = ledger.claim(&k, &brief).await.unwrap() else {
            panic!("fresh key not acquired")
        };
        ledger
            .complete(&l, &Outcome::from_json(&1).unwrap())
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for round in 1..=tenants.len() {
        assert_eq!(ledger.prune(1).await.unwrap(), 1);
        let mut raised = 0;
        for t in &tenants {
            let k = EffectKey::new(t, "capture", "x").unwrap();
            let gone = ledger.get(&k).await.unwrap().is_none();
            let horizon = ledger.horizon(t, "capture").await.unwrap();
            assert_eq!(
                gone,
                horizon.is_some(),
                "{t}: deleted {gone}, horizon {horizon:?}"
            );
            raised += usize::from(gone);
        }
        assert_eq!(raised, round);
    }
    assert_eq!(ledger.prune(1).await.unwrap(), 0);
}
