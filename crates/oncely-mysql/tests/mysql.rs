//! MySQL-specific behaviour: the caller's transaction (`claim_in` /
//! `complete_in`), exact key comparison, unexpected constraint violations,
//! the outcome limit, strict mode, lock errors, cancellation, migrations and
//! an unreachable server.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::{Rng, fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Error, Tenant};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::{Executor, MySqlConnection, Row};

fn url() -> Option<String> {
    service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))
}

async fn ledger_with(opts: MySqlLedgerOptions) -> Option<MySqlLedger> {
    let url = url()?;
    match MySqlLedger::connect_with(&url, opts).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("MySQL at {url}: {e}")),
    }
}

async fn ledger() -> Option<MySqlLedger> {
    ledger_with(MySqlLedgerOptions::default().max_connections(40)).await
}

/// Both claim paths: the detected one (RETURNING on MariaDB) and the MySQL 8
/// two-statement one.
fn both_paths() -> [MySqlLedgerOptions; 2] {
    let base = MySqlLedgerOptions::default().max_connections(40);
    [base.clone(), base.returning(Some(false))]
}

fn key(t: &Tenant, kind: &str, subject: &str) -> EffectKey {
    EffectKey::new(t, kind, subject).unwrap()
}

fn acquired(c: Claim) -> oncely::backend::Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// The business table the transactional tests write to.
async fn business_table(ledger: &MySqlLedger) {
    ledger
        .pool()
        .execute(
            "CREATE TABLE IF NOT EXISTS oncely_mysql_test_entries (
               id BIGINT AUTO_INCREMENT PRIMARY KEY,
               tenant VARCHAR(64) NOT NULL,
               subject VARCHAR(255) NOT NULL,
               KEY (tenant)
             ) ENGINE = InnoDB",
        )
        .await
        .unwrap();
}

async fn entries(ledger: &MySqlLedger, t: &Tenant) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM oncely_mysql_test_entries WHERE tenant = ?")
        .bind(t.as_str())
        .fetch_one(ledger.pool())
        .await
        .unwrap()
}

async fn write_entry(conn: &mut MySqlConnection, t: &Tenant, subject: &str) {
    sqlx::query("INSERT INTO oncely_mysql_test_entries (tenant, subject) VALUES (?, ?)")
        .bind(t.as_str())
        .bind(subject)
        .execute(conn)
        .await
        .unwrap();
}

/// A transaction dropped without commit or rollback (a handler that
/// panicked, a cancelled task) takes its claim and business write with it;
/// the key is then free, and its next grant is fresh with a higher fence.
/// (An explicit commit or rollback is the transactional conformance suite's
/// `claim_in_commits_and_rolls_back_with_the_transaction`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropped_transaction_leaves_nothing() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        business_table(&ledger).await;
        let t = fresh_tenant();
        let k = key(&t, "ledger-entry", "order-2");
        let dropped = {
            let mut tx = ledger.begin().await.unwrap();
            let lease = acquired(
                ledger
                    .claim_in(&mut tx, &k, &ClaimOptions::default())
                    .await
                    .unwrap(),
            );
            write_entry(&mut tx, &t, "order-2").await;
            lease
        };
        assert_eq!(entries(&ledger, &t).await, 0);
        // Nothing of the dropped claim remains: a fresh claim, whose fence
        // (the clock) is still above its.
        let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
        assert!(l.fence() > dropped.fence());
        assert!(!l.taken_over());
    }
}

/// 32 transactions claim one key at once, each doing its business write only
/// if it acquired: exactly one business write commits, and every other
/// transaction sees the effect completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claim_in_writes_once() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        business_table(&ledger).await;
        let t = fresh_tenant();
        let k = key(&t, "ledger-entry", "order-3");
        let barrier = Arc::new(tokio::sync::Barrier::new(32));
        let (acquired_n, completed_n, retried) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let (ledger, k, t, barrier) = (ledger.clone(), k.clone(), t.clone(), barrier.clone());
            let (acquired_n, completed_n, retried) =
                (acquired_n.clone(), completed_n.clone(), retried.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                loop {
                    let mut tx = ledger.begin().await.unwrap();
                    match ledger.claim_in(&mut tx, &k, &ClaimOptions::default()).await {
                        Ok(Claim::Acquired(lease)) => {
                            write_entry(&mut tx, &t, "order-3").await;
                            ledger
                                .complete_in(&mut tx, &lease, &Outcome::from_json(&"done").unwrap())
                                .await
                                .unwrap();
                            tx.commit().await.unwrap();
                            acquired_n.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(Claim::Completed(r)) => {
                            assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "done");
                            tx.commit().await.unwrap();
                            completed_n.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(other) => panic!("a waiter must see the committed outcome, got {other:?}"),
                        // A deadlock rolled the transaction back: redo it, as
                        // an application would.
                        Err(e) if e.is_retryable() => {
                            retried.fetch_add(1, Ordering::SeqCst);
                            drop(tx);
                            continue;
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                    break;
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        eprintln!("deadlock retries: {}", retried.load(Ordering::SeqCst));
        assert_eq!(acquired_n.load(Ordering::SeqCst), 1);
        assert_eq!(completed_n.load(Ordering::SeqCst), 31);
        assert_eq!(entries(&ledger, &t).await, 1, "exactly one business write");
    }
}

/// Keys that a case- or accent-insensitive collation would fold together are
/// different effects. (A decomposed `e\u{301}` next to `é` never gets here:
/// keys are NFC, `EffectKey::new` refuses it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_compare_exactly() {
    let Some(ledger) = ledger().await else { return };
    let t = fresh_tenant();
    let subjects = [
        "Order-1", "order-1", "ORDER-1", "é", "e", "É", "q\u{301}", "q", "ß", "ss", "a", "A",
    ];
    for (i, s) in subjects.iter().enumerate() {
        let l = acquired(
            ledger
                .claim(&key(&t, "capture", s), &ClaimOptions::default())
                .await
                .unwrap(),
        );
        assert!(!l.taken_over(), "{s:?} collided with an earlier key");
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
    }
    for (i, s) in subjects.iter().enumerate() {
        let r = ledger.get(&key(&t, "capture", s)).await.unwrap().unwrap();
        assert_eq!(r.key.subject(), *s);
        assert_eq!(r.outcome.unwrap().to_value::<usize>().unwrap(), i, "{s:?}");
    }
}

/// The tests that count `oncely_unexpected_constraint_violations_total`
/// (an unlabelled counter) run one at a time, so each sees its own counts.
static VIOLATION_COUNTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn violations() -> u64 {
    oncely::conformance::counter(oncely::telemetry::UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL, &[])
}

/// A unique violation on something other than the effect key (here a
/// secondary UNIQUE index added for the test) is an error, counted, and never
/// taken for a duplicate; the other effect's row is not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unexpected_constraint_violation_is_an_error() {
    oncely::conformance::metrics_snapshotter();
    let _one_at_a_time = VIOLATION_COUNTS.lock().await;
    for (i, returning) in [None, Some(false)].into_iter().enumerate() {
        let table = format!("oncely_uq_{}_{i}", std::process::id());
        let opts = MySqlLedgerOptions::default().table(&table).returning(returning);
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        ledger
            .pool()
            .execute(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE `{table}` ADD UNIQUE KEY uq_subject (subject)"
            )))
            .await
            .unwrap();
        let t = fresh_tenant();
        let a = key(&t, "capture", "shared");
        let b = key(&t, "refund", "shared");
        let c = key(&t, "receipt", "shared");
        let la = acquired(ledger.claim(&a, &ClaimOptions::default()).await.unwrap());
        let before = ledger.get(&a).await.unwrap().unwrap();
        let before_count = violations();
        let e = ledger.claim(&b, &ClaimOptions::default()).await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
        assert!(violations() > before_count, "the violation is counted");
        assert!(ledger.get(&b).await.unwrap().is_none());
        let now_a = ledger.get(&a).await.unwrap().unwrap();
        assert_eq!(
            (now_a.state, now_a.fence, now_a.lease_expires_at, now_a.updated_at),
            (
                before.state,
                before.fence,
                before.lease_expires_at,
                before.updated_at
            ),
            "the other effect's row changed"
        );
        // A released record is what a takeover would grab: still untouched.
        ledger.release(&la).await.unwrap();
        let released = ledger.get(&a).await.unwrap().unwrap();
        let e = ledger.claim(&c, &ClaimOptions::default()).await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
        let after = ledger.get(&a).await.unwrap().unwrap();
        assert_eq!((after.state, after.fence), (RecordState::Released, la.fence()));
        assert_eq!(after.updated_at, released.updated_at);
        // In the caller's transaction too.
        let mut tx = ledger.begin().await.unwrap();
        let e = ledger
            .claim_in(&mut tx, &b, &ClaimOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e:?}");
        tx.rollback().await.unwrap();
        assert!(violations() >= before_count + 2);
        let after = ledger.get(&a).await.unwrap().unwrap();
        assert_eq!((after.state, after.fence), (RecordState::Released, la.fence()));
        drop_table(&ledger, &table).await;
    }
}

async fn drop_table(ledger: &MySqlLedger, table: &str) {
    ledger
        .pool()
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS `{table}`, `{table}_horizon`, `{table}_outbox`"
        )))
        .await
        .unwrap();
    sqlx::query("DELETE FROM oncely_schema_migrations WHERE table_name = ?")
        .bind(table)
        .execute(ledger.pool())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outcome_over_the_limit_is_refused() {
    let Some(default) = ledger().await else { return };
    // The server here allows far more than 64 KiB per packet.
    assert_eq!(default.max_outcome_bytes(), oncely::backend::MAX_OUTCOME_BYTES);
    assert_eq!(
        default.capabilities().max_outcome_bytes,
        oncely::backend::MAX_OUTCOME_BYTES
    );
    let Some(ledger) = ledger_with(MySqlLedgerOptions::default().max_outcome_bytes(1000)).await else {
        return;
    };
    assert_eq!(ledger.capabilities().max_outcome_bytes, 1000);
    let t = fresh_tenant();
    let k = key(&t, "capture", "big");
    let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    let over = Outcome::from_bytes(vec![b'1'; 1001]).unwrap();
    let e = ledger.complete(&l, &over).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutcomeTooLarge {
                size: 1001,
                max: 1000
            }
        ),
        "{e:?}"
    );
    let mut tx = ledger.begin().await.unwrap();
    let e = ledger.complete_in(&mut tx, &l, &over).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutcomeTooLarge {
                size: 1001,
                max: 1000
            }
        ),
        "{e:?}"
    );
    drop(tx);
    let r = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::InProgress);
    assert!(r.outcome.is_none());
    let at = Outcome::from_bytes(vec![b'1'; 1000]).unwrap();
    ledger.complete(&l, &at).await.unwrap();
    assert_eq!(ledger.get(&k).await.unwrap().unwrap().outcome.unwrap(), at);
    // Over the core's limit, Outcome itself refuses it.
    assert!(matches!(
        Outcome::from_bytes(vec![b'1'; oncely::backend::MAX_OUTCOME_BYTES + 1]),
        Err(Error::OutcomeTooLarge { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_are_strict() {
    let Some(ledger) = ledger().await else { return };
    let mode: String = sqlx::query_scalar("SELECT @@SESSION.sql_mode")
        .fetch_one(ledger.pool())
        .await
        .unwrap();
    assert!(mode.split(',').any(|m| m == "STRICT_ALL_TABLES"), "{mode}");
    // Truncation is an error, not a clip.
    let mut conn = ledger.pool().acquire().await.unwrap();
    conn.execute("CREATE TEMPORARY TABLE oncely_strict_probe (v VARCHAR(3)) ENGINE = MyISAM")
        .await
        .unwrap();
    let e = sqlx::query("INSERT INTO oncely_strict_probe VALUES ('abcd')")
        .execute(&mut *conn)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("too long"), "{e}");
    conn.execute("DROP TEMPORARY TABLE oncely_strict_probe")
        .await
        .unwrap();
}

/// Two transactions that each hold one key and want the other's: the
/// deadlock victim gets a retryable backend error, and a lock wait timeout
/// is retryable too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_errors_are_retryable() {
    let Some(ledger) = ledger().await else { return };
    let t = fresh_tenant();
    let (a, b) = (key(&t, "capture", "a"), key(&t, "capture", "b"));
    let mut t1 = ledger.begin().await.unwrap();
    let mut t2 = ledger.begin().await.unwrap();
    acquired(
        ledger
            .claim_in(&mut t1, &a, &ClaimOptions::default())
            .await
            .unwrap(),
    );
    acquired(
        ledger
            .claim_in(&mut t2, &b, &ClaimOptions::default())
            .await
            .unwrap(),
    );
    let l1 = ledger.clone();
    let (b1, a2) = (b.clone(), a.clone());
    let first = tokio::spawn(async move {
        let r = l1.claim_in(&mut t1, &b1, &ClaimOptions::default()).await;
        (r, t1)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = ledger.claim_in(&mut t2, &a2, &ClaimOptions::default()).await;
    let second_failed = second.is_err();
    if let Err(e) = &second {
        assert!(matches!(e, Error::Backend { retryable: true, .. }), "{e:?}");
    }
    drop(t2);
    let (first, t1) = first.await.unwrap();
    if let Err(e) = &first {
        assert!(matches!(e, Error::Backend { retryable: true, .. }), "{e:?}");
    }
    assert!(
        first.is_err() ^ second_failed,
        "exactly one deadlock victim: {first:?} / {second:?}"
    );
    drop(t1);

    // Lock wait timeout: a claim that waits on a row another transaction holds.
    let c = key(&t, "capture", "c");
    let mut holder = ledger.begin().await.unwrap();
    acquired(
        ledger
            .claim_in(&mut holder, &c, &ClaimOptions::default())
            .await
            .unwrap(),
    );
    let mut waiter = ledger.begin().await.unwrap();
    waiter
        .execute("SET SESSION innodb_lock_wait_timeout = 1")
        .await
        .unwrap();
    let e = ledger
        .claim_in(&mut waiter, &c, &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Backend { retryable: true, .. }), "{e:?}");
    assert!(e.is_retryable());
    waiter
        .execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
        .await
        .unwrap();
    drop(waiter);
    holder.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_server_is_unavailable() {
    // Port 1 on loopback: nothing listens there.
    let opts = MySqlLedgerOptions::default().acquire_timeout(Duration::from_secs(3));
    let e = MySqlLedger::connect_with("mysql://root@127.0.0.1:1/test", opts)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { backend: "mysql", .. }), "{e:?}");
    assert!(e.is_retryable());
    // A lazily connected pool fails closed on the first claim.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("mysql://root@127.0.0.1:1/test")
        .unwrap();
    let ledger = MySqlLedger::from_pool(pool);
    let k = key(&fresh_tenant(), "capture", "x");
    let e = ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    let e = ledger.get(&k).await.unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_table_name_is_refused_before_connecting() {
    for bad in ["", "1abc", "a-b", "x`; DROP TABLE t; --", "ünï"] {
        let e = MySqlLedger::connect_with(
            "mysql://root@127.0.0.1:1/test",
            MySqlLedgerOptions::default().table(bad),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{bad:?}: {e:?}");
    }
}

/// Eight migrators at once on a new table: all succeed, the schema is
/// created once, and a ledger on it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations() {
    let table = format!("oncely_mig_{}", std::process::id());
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let table = table.clone();
        tasks.push(tokio::spawn(async move {
            ledger_with(MySqlLedgerOptions::default().max_connections(2).table(table)).await
        }));
    }
    let mut ledgers = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Some(l) => ledgers.push(l),
            None => return,
        }
    }
    let l = &ledgers[0];
    let versions: Vec<u32> =
        sqlx::query_scalar("SELECT version FROM oncely_schema_migrations WHERE table_name = ?")
            .bind(&table)
            .fetch_all(l.pool())
            .await
            .unwrap();
    assert_eq!(versions, vec![1, 2, 3]);
    l.migrate().await.unwrap();
    let k = key(&fresh_tenant(), "capture", "m");
    acquired(l.claim(&k, &ClaimOptions::default()).await.unwrap());
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT COLLATION_NAME FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{table}' AND COLUMN_NAME = 'effect_key'"
    )))
    .fetch_one(l.pool())
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>(0), "utf8mb4_bin");
    drop_table(l, &table).await;
}

/// Aborting `begin`, `claim_in` and `complete_in` at random points: nothing
/// half-committed, and every connection the pool hands out afterwards is
/// outside any transaction (later claims persist).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelled_transactions_leave_the_pool_clean() {
    let Some(ledger) = ledger_with(MySqlLedgerOptions::default().max_connections(8)).await else {
        return;
    };
    business_table(&ledger).await;
    let t = fresh_tenant();
    let mut rng = Rng::from_env("cancelled_transactions_leave_the_pool_clean");
    let committed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..120 {
        let (ledger, t, committed) = (ledger.clone(), t.clone(), committed.clone());
        let abort_after = Duration::from_micros(rng.below(20_000));
        let task = tokio::spawn(async move {
            let k = key(&t, "ledger-entry", &format!("e-{i}"));
            let mut tx = ledger.begin().await.unwrap();
            if let Claim::Acquired(l) = ledger
                .claim_in(&mut tx, &k, &ClaimOptions::default())
                .await
                .unwrap()
            {
                write_entry(&mut tx, &t, &format!("e-{i}")).await;
                ledger
                    .complete_in(&mut tx, &l, &Outcome::from_json(&i).unwrap())
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                committed.lock().unwrap().push(k);
            }
        });
        // Half of them are aborted at a random point; the others must commit.
        if i % 2 == 0 {
            let handle = task.abort_handle();
            tokio::spawn(async move {
                tokio::time::sleep(abort_after).await;
                handle.abort();
            });
        }
        tasks.push(task);
    }
    for task in tasks {
        let _ = task.await;
    }
    // Each key is absent or completed, and has a business write exactly when
    // it is completed (claim and write commit together).
    let mut completed = 0;
    for i in 0..120 {
        let k = key(&t, "ledger-entry", &format!("e-{i}"));
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM oncely_mysql_test_entries WHERE tenant = ? AND subject = ?",
        )
        .bind(t.as_str())
        .bind(format!("e-{i}"))
        .fetch_one(ledger.pool())
        .await
        .unwrap();
        match ledger.get(&k).await.unwrap() {
            Some(r) => {
                assert_eq!(r.state, RecordState::Completed);
                assert_eq!(n, 1);
                completed += 1;
            }
            None => assert_eq!(n, 0, "e-{i}: a business write without its claim"),
        }
    }
    let committed = committed.lock().unwrap().clone();
    for k in &committed {
        assert!(
            ledger.get(k).await.unwrap().is_some(),
            "a committed claim was lost"
        );
    }
    eprintln!("{completed} of 120 transactions committed");
    assert!(completed >= 60, "every transaction that was not aborted commits");
    // Autocommit claims on the pool's connections must all persist.
    for i in 0..40 {
        let k = key(&t, "after", &format!("a-{i}"));
        let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
        ledger
            .complete(&l, &Outcome::from_json(&i).unwrap())
            .await
            .unwrap();
    }
    let other = ledger_with(MySqlLedgerOptions::default().max_connections(1))
        .await
        .unwrap();
    for i in 0..40 {
        let r = other.get(&key(&t, "after", &format!("a-{i}"))).await.unwrap();
        assert_eq!(
            r.map(|r| r.state),
            Some(RecordState::Completed),
            "after-{i} was lost"
        );
    }
    // And no pooled connection is inside a transaction.
    for _ in 0..8 {
        let mut conn = ledger.pool().acquire().await.unwrap();
        // MariaDB names it; MySQL 8 has no such variable (the persisted
        // claims above are the check there).
        match sqlx::query_scalar::<_, u64>("SELECT @@in_transaction")
            .fetch_one(&mut *conn)
            .await
        {
            Ok(open) => assert_eq!(open, 0),
            Err(e) => eprintln!("no @@in_transaction on this server: {e}"),
        }
    }
}

/// Leaves the pool's only connection inside an open transaction that sqlx
/// does not know about (as a `pool.begin()` dropped between its `BEGIN` and
/// its return does).
async fn leak_a_transaction(ledger: &MySqlLedger) {
    let mut conn = ledger.pool().acquire().await.unwrap();
    conn.execute("BEGIN").await.unwrap();
}

/// Every ledger write on a pooled connection that someone else left inside a
/// transaction is guarded: it writes nothing there, the stray transaction is
/// rolled back, and the write is made for real (visible to another pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leaked_transaction_on_the_pool_is_healed() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts.max_connections(1)).await else {
            return;
        };
        let Some(other) = ledger_with(MySqlLedgerOptions::default().max_connections(1)).await else {
            return;
        };
        let t = fresh_tenant();
        let (k, k2) = (key(&t, "capture", "leak-1"), key(&t, "capture", "leak-2"));
        leak_a_transaction(&ledger).await;
        let l = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
        assert_eq!(
            other.get(&k).await.unwrap().unwrap().fence,
            l.fence(),
            "the claim committed"
        );
        leak_a_transaction(&ledger).await;
        let renewed = ledger.renew(&l, Duration::from_secs(120)).await.unwrap();
        assert_eq!(
            other.get(&k).await.unwrap().unwrap().lease_expires_at,
            Some(renewed.expires_at()),
            "the renewal committed"
        );
        leak_a_transaction(&ledger).await;
        ledger
            .complete(&renewed, &Outcome::from_json(&"ok").unwrap())
            .await
            .unwrap();
        assert_eq!(
            other.get(&k).await.unwrap().unwrap().state,
            RecordState::Completed,
            "the completion committed"
        );
        let l2 = acquired(ledger.claim(&k2, &ClaimOptions::default()).await.unwrap());
        leak_a_transaction(&ledger).await;
        ledger.release(&l2).await.unwrap();
        assert_eq!(
            other.get(&k2).await.unwrap().unwrap().state,
            RecordState::Released
        );
        // A duplicate claim on a leaked connection answers from the committed row
        // and leaves no lock behind.
        leak_a_transaction(&ledger).await;
        assert!(matches!(
            ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
            Claim::Completed(_)
        ));
        let open: u64 = sqlx::query_scalar("SELECT @@in_transaction")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
        assert_eq!(open, 0);
    }
}

/// A duplicate `claim_in` blocks on the first transaction's row; when that
/// transaction rolls back, the duplicate acquires the key as a fresh claim,
/// with a fence above the rolled-back one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn blocked_duplicate_acquires_after_rollback() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        let k = key(&fresh_tenant(), "ledger-entry", "order-4");
        let mut first = ledger.begin().await.unwrap();
        let rolled_back = acquired(
            ledger
                .claim_in(&mut first, &k, &ClaimOptions::default())
                .await
                .unwrap(),
        );
        let (l2, k2) = (ledger.clone(), k.clone());
        let second = tokio::spawn(async move {
            let mut tx = l2.begin().await.unwrap();
            let c = l2.claim_in(&mut tx, &k2, &ClaimOptions::default()).await.unwrap();
            tx.commit().await.unwrap();
            c
        });
        // Whether the second claim is already waiting or not yet sent, the
        // rollback leaves it an absent key.
        tokio::time::sleep(Duration::from_millis(100)).await;
        first.rollback().await.unwrap();
        let lease = acquired(second.await.unwrap());
        assert!(lease.fence() > rolled_back.fence());
        assert!(!lease.taken_over());
        assert_eq!(
            ledger.get(&k).await.unwrap().unwrap().state,
            RecordState::InProgress
        );
    }
}

/// A pool whose sessions run with autocommit = 0 would leave every ledger
/// write uncommitted: the ledger refuses it with a clear error instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn autocommit_off_pool_is_refused() {
    let Some(url) = url() else { return };
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION autocommit = 0").await?;
                Ok(())
            })
        })
        .connect(&url)
        .await;
    let pool = match pool {
        Ok(p) => p,
        Err(e) => return skip_or_fail(&format!("MySQL at {url}: {e}")).unwrap_or(()),
    };
    let ledger = MySqlLedger::from_pool(pool);
    let e = ledger
        .claim(&key(&fresh_tenant(), "capture", "ac"), &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
}

/// A unique violation raised by the handler's own write in `Job::step_in`
/// (a business table with its own unique key) is a bug, not a duplicate:
/// `Error::ConstraintViolation`, not retryable, counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn step_in_unique_violation_is_a_counted_constraint_violation() {
    oncely::conformance::metrics_snapshotter();
    let _one_at_a_time = VIOLATION_COUNTS.lock().await;
    let Some(ledger) = ledger().await else { return };
    ledger
        .pool()
        .execute(
            "CREATE TABLE IF NOT EXISTS oncely_mysql_test_invoices (
               number VARCHAR(100) NOT NULL PRIMARY KEY,
               tenant VARCHAR(64) NOT NULL
             ) ENGINE = InnoDB",
        )
        .await
        .unwrap();
    let t = fresh_tenant();
    let number = format!("{}-inv-1", t.as_str());
    sqlx::query("INSERT INTO oncely_mysql_test_invoices (number, tenant) VALUES (?, ?)")
        .bind(&number)
        .bind(t.as_str())
        .execute(ledger.pool())
        .await
        .unwrap();
    let effects = oncely::Effects::new(ledger.clone());
    let job = effects.job(&t, "billing", "order-11");
    let before = violations();
    let mut tx = ledger.begin().await.unwrap();
    let (n, tenant) = (number.clone(), t.as_str().to_owned());
    let e = job
        .step_in("invoice", &mut tx, move |conn, _ctx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO oncely_mysql_test_invoices (number, tenant) VALUES (?, ?)")
                    .bind(n)
                    .bind(tenant)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            })
        })
        .await
        .unwrap_err();
    tx.rollback().await.unwrap();
    assert!(
        matches!(&e, Error::ConstraintViolation { message, .. } if message.contains("Duplicate entry")),
        "{e:?}"
    );
    assert!(!e.is_retryable(), "a redelivery would hit it again: {e:?}");
    assert_eq!(violations(), before + 1, "counted once");
    // The unique_violation hook itself: the error, wrapped or bare.
    let dup = sqlx::query("INSERT INTO oncely_mysql_test_invoices (number, tenant) VALUES (?, ?)")
        .bind(&number)
        .bind(t.as_str())
        .execute(ledger.pool())
        .await
        .unwrap_err();
    assert!(ledger.unique_violation(&dup).is_some());
    let wrapped: oncely::BoxError = Box::new(Wrapped(dup));
    assert!(
        ledger.unique_violation(&*wrapped).is_some(),
        "found in the source chain"
    );
    // std::io::Error reports its inner error's source, not the inner error.
    let Wrapped(dup) = *wrapped.downcast::<Wrapped>().unwrap();
    let in_io: oncely::BoxError = Box::new(std::io::Error::other(dup));
    assert!(ledger.unique_violation(&*in_io).is_some());
    let not_null = sqlx::query("INSERT INTO oncely_mysql_test_invoices (number, tenant) VALUES (?, NULL)")
        .bind(format!("{}-inv-2", t.as_str()))
        .execute(ledger.pool())
        .await
        .unwrap_err();
    assert!(
        ledger.unique_violation(&not_null).is_none(),
        "SQLSTATE 23000 but not a duplicate: {not_null}"
    );
}

/// An application error wrapping a driver error (as `thiserror`'s
/// `#[source]` or `anyhow` do).
#[derive(Debug)]
struct Wrapped(sqlx::Error);

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "saving the invoice")
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// A ledger on the caller's pool whose sessions run `READ COMMITTED` (no gap
/// locks), so the claim's check after its insert is what decides.
async fn read_committed_ledger(returning: Option<bool>) -> Option<MySqlLedger> {
    let url = url()?;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(8)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    .await?;
                Ok(())
            })
        })
        .connect(&url)
        .await;
    let pool = match pool {
        Ok(p) => p,
        Err(e) => return skip_or_fail(&format!("MySQL at {url}: {e}")),
    };
    let ledger =
        MySqlLedger::from_pool_with(pool, MySqlLedgerOptions::default().returning(returning)).unwrap();
    ledger.migrate().await.unwrap();
    Some(ledger)
}

/// A completed record kept for `retention` (then waits a little longer);
/// returns its creation time in µs.
async fn completed(ledger: &MySqlLedger, k: &EffectKey, retention: Duration) -> i64 {
    settled(ledger, k, retention, false).await
}

/// A completed (or, with `release`, released) record kept for `retention`
/// (then waits a little longer); returns its creation time in µs.
async fn settled(ledger: &MySqlLedger, k: &EffectKey, retention: Duration, release: bool) -> i64 {
    let o = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(retention);
    let l = acquired(ledger.claim(k, &o).await.unwrap());
    if release {
        ledger.release(&l).await.unwrap();
    } else {
        ledger
            .complete(&l, &Outcome::from_json(&"first").unwrap())
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let created = ledger.get(k).await.unwrap().unwrap().created_at;
    i64::try_from(created.duration_since(std::time::UNIX_EPOCH).unwrap().as_micros()).unwrap()
}

/// A prune that deletes the key while a replay's insert waits on it: the
/// insert goes ahead once the prune commits, so the claim must read the
/// watermark after its write (the check before the insert saw none), undo
/// its row and refuse. At READ COMMITTED nothing else stops it: the check
/// before the insert takes no gap lock on the absent watermark row.
///
/// On the pool a claim reads the key first, without a lock: a completed
/// record there answers at once (the prune has not committed: the effect is
/// done), so the pool's insert is made to wait with a released record,
/// which the claim goes on to take over.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_waiting_on_a_prune_reads_its_watermark() {
    for returning in [None, Some(false)] {
        let Some(ledger) = read_committed_ledger(returning).await else {
            return;
        };
        for (in_tx, release) in [(false, true), (true, false), (true, true)] {
            let t = fresh_tenant();
            let k = key(&t, "capture", "pruned-while-waiting");
            // Kept for an hour, so no other test's prune takes it first.
            let created = settled(&ledger, &k, Duration::from_secs(3600), release).await;
            let sent = std::time::SystemTime::now() - Duration::from_secs(3600);
            // The prune, by hand, held open: the key's row deleted (locked),
            // then the watermark raised, then commit (what prune's batch
            // does, minus locking the watermark first, which at READ
            // COMMITTED cannot stop a claim that found no watermark row).
            let mut prune = ledger.pool().begin().await.unwrap();
            let deleted = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM `{}` WHERE effect_key = ?",
                ledger.table()
            )))
            .bind(k.as_str())
            .execute(&mut *prune)
            .await
            .unwrap();
            assert_eq!(deleted.rows_affected(), 1);
            let claim = {
                let (ledger, k) = (ledger.clone(), k.clone());
                tokio::spawn(async move {
                    let o = ClaimOptions::default().sent_at(sent);
                    if in_tx {
                        let mut tx = ledger.begin().await.unwrap();
                        let c = ledger.claim_in(&mut tx, &k, &o).await;
                        tx.commit().await.unwrap();
                        c
                    } else {
                        ledger.claim(&k, &o).await
                    }
                })
            };
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(!claim.is_finished(), "the claim waits on the prune's delete");
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO `{}_horizon` (tenant, kind, watermark_us) VALUES (?, 'capture', ?)",
                ledger.table()
            )))
            .bind(t.as_str())
            .bind(created)
            .execute(&mut *prune)
            .await
            .unwrap();
            prune.commit().await.unwrap();
            let e = claim.await.unwrap().unwrap_err();
            assert!(matches!(e, Error::BeyondHorizon { .. }), "in_tx {in_tx}: {e:?}");
            assert!(
                ledger.get(&k).await.unwrap().is_none(),
                "the refused claim left its row (in_tx {in_tx})"
            );
        }

        // The pool's claim of a completed key that a prune is deleting:
        // answered from the committed row, without waiting on the prune.
        let t = fresh_tenant();
        let k = key(&t, "capture", "completed-while-pruned");
        completed(&ledger, &k, Duration::from_secs(3600)).await;
        let mut prune = ledger.pool().begin().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DELETE FROM `{}` WHERE effect_key = ?",
            ledger.table()
        )))
        .bind(k.as_str())
        .execute(&mut *prune)
        .await
        .unwrap();
        let o = ClaimOptions::default().sent_at(std::time::SystemTime::now() - Duration::from_secs(3600));
        assert!(matches!(
            ledger.claim(&k, &o).await.unwrap(),
            Claim::Completed(r) if r.outcome == Some(Outcome::from_json(&"first").unwrap())
        ));
        prune.rollback().await.unwrap();
    }
}

/// `claim_in` in a REPEATABLE READ transaction whose snapshot was taken
/// before the prune (it still shows the record and no watermark) refuses a
/// replay of the pruned key: the horizon is read with locks, never from the
/// snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn horizon_is_not_read_from_an_old_snapshot() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        let t = fresh_tenant();
        let k = key(&t, "capture", "snapshot");
        completed(&ledger, &k, Duration::from_millis(200)).await;
        let mut tx = ledger.begin().await.unwrap();
        let seen: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{}` WHERE effect_key = ?",
            ledger.table()
        )))
        .bind(k.as_str())
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert_eq!(seen, 1, "the snapshot has the record");
        oncely::conformance::prune_until_gone(&ledger, &k).await;
        assert!(ledger.horizon(&t, "capture").await.unwrap().is_some());
        let sent = std::time::SystemTime::now() - Duration::from_secs(3600);
        let e = ledger
            .claim_in(&mut tx, &k, &ClaimOptions::default().sent_at(sent))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
        tx.rollback().await.unwrap();
        // A message produced after the horizon is new work.
        let mut tx = ledger.begin().await.unwrap();
        acquired(
            ledger
                .claim_in(
                    &mut tx,
                    &k,
                    &ClaimOptions::default().sent_at(std::time::SystemTime::now()),
                )
                .await
                .unwrap(),
        );
        tx.rollback().await.unwrap();
    }
}

/// `claim_in` that waited on another transaction's claim of the key, which
/// then rolled back after the lease length: its grant is measured from after
/// the wait (refreshed), so a claimant right after it finds it live.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_in_after_a_lock_wait_gets_a_live_lease() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        let k = key(&fresh_tenant(), "capture", "waited-in-tx");
        let lease = Duration::from_secs(2);
        let o = ClaimOptions::default().lease(lease);
        let mut a = ledger.begin().await.unwrap();
        let first = acquired(ledger.claim_in(&mut a, &k, &o).await.unwrap());
        let b = {
            let (ledger, k, o) = (ledger.clone(), k.clone(), o.clone());
            tokio::spawn(async move {
                let mut tx = ledger.begin().await.unwrap();
                let l = acquired(ledger.claim_in(&mut tx, &k, &o).await.unwrap());
                tx.commit().await.unwrap();
                l
            })
        };
        tokio::time::sleep(lease * 5 / 2).await;
        assert!(!b.is_finished(), "B waits on A's row");
        a.rollback().await.unwrap();
        let b = b.await.unwrap();
        assert!(!oncely::backend::needs_refresh(&b, lease), "{b:?}");
        assert!(
            b.fence() > first.fence() && !b.taken_over(),
            "{b:?} after {first:?}"
        );
        let r = ledger.get(&k).await.unwrap().unwrap();
        assert_eq!((r.fence, r.lease_expires_at), (b.fence(), Some(b.expires_at())));
        match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
            Claim::InProgress { fence, .. } => assert_eq!(fence, b.fence()),
            other => panic!("B's lease had ended when it was granted: {other:?}"),
        }
    }
}

/// The session time zone (the caller's, on `from_pool` and `claim_in`) does
/// not move the ledger's clock: leases written from a UTC-7 session are
/// judged the same by a session in UTC+5:30, and `acquired_at` is now.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn session_time_zone_does_not_move_the_clock() {
    let Some(url) = url() else { return };
    let zoned = |tz: &'static str| {
        sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(4)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    conn.execute(sqlx::AssertSqlSafe(format!("SET time_zone = '{tz}'")))
                        .await?;
                    Ok(())
                })
            })
            .connect_lazy(&url)
            .unwrap()
    };
    let west = MySqlLedger::from_pool(zoned("-07:00"));
    let east = MySqlLedger::from_pool(zoned("+05:30"));
    west.migrate().await.unwrap();
    let t = fresh_tenant();
    let k = key(&t, "capture", "zoned");
    let before = std::time::SystemTime::now();
    let l = acquired(
        west.claim(&k, &ClaimOptions::default().lease(Duration::from_secs(60)))
            .await
            .unwrap(),
    );
    let after = std::time::SystemTime::now();
    // The server runs on this machine: its clock agrees with ours to well
    // within a minute, and a 5:30 or 7 hour shift would not.
    let slack = Duration::from_secs(60);
    assert!(
        l.acquired_at() > before - slack && l.acquired_at() < after + slack,
        "{l:?}"
    );
    match east.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::InProgress { fence, .. } => assert_eq!(fence, l.fence()),
        other => panic!("another time zone saw the lease as over: {other:?}"),
    }
    let mut tx = east.begin().await.unwrap();
    let k2 = key(&t, "capture", "zoned-tx");
    let l2 = acquired(
        east.claim_in(&mut tx, &k2, &ClaimOptions::default())
            .await
            .unwrap(),
    );
    tx.commit().await.unwrap();
    assert!(l2.acquired_at() > before - slack && l2.acquired_at() < std::time::SystemTime::now() + slack);
    assert!(matches!(
        west.claim(&k2, &ClaimOptions::default()).await.unwrap(),
        Claim::InProgress { .. }
    ));
}

/// Two claimants wait on a transaction that holds the key and then rolls
/// back after their leases' length: B on the pool, C in its own transaction.
/// Whichever inserts first writes a grant measured from before the wait and
/// must refresh it; the other may take that stale grant over first (then the
/// refresh finds the key taken and B claims again, answering as that claim
/// does), wait for the refreshed grant, or be InnoDB's deadlock victim (both
/// held a share lock on the rolled-back row and both insert: C's application
/// redoes its transaction, B's claim is retried by the ledger). Whatever the
/// interleaving, exactly one acquires, with a live lease, and the other sees
/// its fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claimants_waiting_on_a_rollback_get_one_live_lease() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        for round in 0..2 {
            let k = key(&fresh_tenant(), "capture", &format!("stale-grant-{round}"));
            let lease = Duration::from_secs(1);
            let o = ClaimOptions::default().lease(lease);
            let mut a = ledger.begin().await.unwrap();
            acquired(ledger.claim_in(&mut a, &k, &o).await.unwrap());
            let b = {
                let (ledger, k, o) = (ledger.clone(), k.clone(), o.clone());
                tokio::spawn(async move { ledger.claim(&k, &o).await.unwrap() })
            };
            let (claimed_tx, claimed_rx) = tokio::sync::oneshot::channel();
            let (commit_tx, commit_rx) = tokio::sync::oneshot::channel::<()>();
            let c = {
                let (ledger, k, o) = (ledger.clone(), k.clone(), o.clone());
                tokio::spawn(async move {
                    let mut deadlocks = 0;
                    let (tx, claim) = loop {
                        let mut tx = ledger.begin().await.unwrap();
                        match ledger.claim_in(&mut tx, &k, &o).await {
                            Ok(claim) => break (tx, claim),
                            Err(e) if e.is_retryable() => deadlocks += 1,
                            Err(e) => panic!("{e:?}"),
                        }
                    };
                    claimed_tx.send(claim.clone()).unwrap();
                    commit_rx.await.unwrap();
                    tx.commit().await.unwrap();
                    (claim, deadlocks)
                })
            };
            tokio::time::sleep(lease * 5 / 2).await;
            assert!(!b.is_finished(), "B waits on A's row");
            a.rollback().await.unwrap();
            // C answers while its transaction is open; B may be waiting on
            // C's row, so let C commit before waiting for B.
            let c_claim = claimed_rx.await.unwrap();
            commit_tx.send(()).unwrap();
            let (_, c_deadlocks) = c.await.unwrap();
            let b_claim = b.await.unwrap();
            let winner = match (&b_claim, &c_claim) {
                (Claim::Acquired(w), Claim::InProgress { fence, .. })
                | (Claim::InProgress { fence, .. }, Claim::Acquired(w)) => {
                    assert_eq!(*fence, w.fence(), "the loser saw the winner's grant");
                    w.clone()
                }
                other => panic!("exactly one of B and C acquires: {other:?}"),
            };
            eprintln!(
                "winner: {}, C's deadlock retries: {c_deadlocks}",
                if matches!(b_claim, Claim::Acquired(_)) {
                    "B (pool)"
                } else {
                    "C (transaction)"
                }
            );
            assert!(!oncely::backend::needs_refresh(&winner, lease), "{winner:?}");
            match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
                Claim::InProgress { fence, .. } => assert_eq!(fence, winner.fence()),
                other => panic!("the winner's lease had ended: {other:?}"),
            }
        }
    }
}
