//! The ledger's tables: tables someone else created are checked before use
//! (and refused when a claim could not rely on them), `migrate(false)` and
//! `read_only(true)` create nothing, a user with only `SELECT` can read, and
//! tables made by earlier releases migrate (version 1: no horizon; version
//! 2: no outbox).

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::outbox::{Enqueued, Message, Outbox, TransactionalOutbox};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::{Executor, MySqlPool};

fn url() -> Option<String> {
    service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))
}

/// A pool for the test's own DDL, or `None` to skip.
async fn admin() -> Option<MySqlPool> {
    let url = url()?;
    match sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
    {
        Ok(p) => Some(p),
        Err(e) => skip_or_fail(&format!("MySQL at {url}: {e}")),
    }
}

/// A table name no other test (or run) uses.
fn table(what: &str) -> String {
    format!("oncely_s_{what}_{}", std::process::id())
}

async fn exec(pool: &MySqlPool, sql: String) {
    pool.execute(sqlx::AssertSqlSafe(sql)).await.unwrap();
}

async fn drop_tables(pool: &MySqlPool, t: &str) {
    exec(
        pool,
        format!("DROP TABLE IF EXISTS `{t}`, `{t}_horizon`, `{t}_outbox`"),
    )
    .await;
    // The bookkeeping table may not exist yet on a fresh database.
    let _ = sqlx::query("DELETE FROM oncely_schema_migrations WHERE table_name = ?")
        .bind(t)
        .execute(pool)
        .await;
}

/// The columns of a correct ledger table, for building variants of it.
const COLUMNS: &str = "
  tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  kind VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  subject VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  state ENUM('in_progress', 'completed', 'released') NOT NULL,
  fence BIGINT UNSIGNED NOT NULL,
  fingerprint BINARY(32) NULL,
  outcome MEDIUMBLOB NULL,
  at_most_once BOOLEAN NOT NULL,
  claim_token BINARY(16) NOT NULL,
  created_us BIGINT NOT NULL,
  updated_us BIGINT NOT NULL,
  lease_expires_us BIGINT NULL,
  retention_us BIGINT NOT NULL,
  retain_until_us BIGINT NOT NULL";

/// Creates `t` with `effect_key` declared as `key_col` and the rest of the
/// table (indexes) as `rest`; and a correct horizon table.
async fn create(pool: &MySqlPool, t: &str, key_col: &str, columns: &str, rest: &str) {
    drop_tables(pool, t).await;
    exec(
        pool,
        format!("CREATE TABLE `{t}` (effect_key {key_col}, {columns}{rest}) ENGINE = InnoDB"),
    )
    .await;
    exec(
        pool,
        format!(
            "CREATE TABLE `{t}_horizon` (
               tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
               kind VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
               watermark_us BIGINT NULL,
               PRIMARY KEY (tenant, kind)) ENGINE = InnoDB"
        ),
    )
    .await;
}

const BIN_KEY: &str = "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL";

/// Every way of opening a ledger on `t` refuses it with a `Config` error
/// that names the table and contains `why`.
async fn refused_everywhere(t: &str, why: &str) {
    let url = url().unwrap();
    let base = MySqlLedgerOptions::default().max_connections(2).table(t);
    for (mode, opts) in [
        ("migrate", base.clone()),
        ("migrate(false)", base.clone().migrate(false)),
        ("read_only", base.clone().read_only(true)),
    ] {
        let e = MySqlLedger::connect_with(&url, opts).await.unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Config(_)), "{mode}: {e:?}");
        assert!(msg.contains(t) && msg.contains(why), "{mode}: {msg}");
    }
    // A ledger on the caller's pool is checked at its first operation.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let ledger = MySqlLedger::from_pool_with(pool, base).unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "x").unwrap();
    let e = ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err();
    assert!(
        matches!(e, Error::Config(_)) && e.to_string().contains(why),
        "{e:?}"
    );
    let e = ledger.get(&k).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
}

/// A table without a unique key on `effect_key`: every claim would insert
/// its own row, so two claimants of one key would both acquire. Refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_without_a_unique_key_is_refused() {
    let Some(pool) = admin().await else { return };
    let t = table("nokey");
    create(&pool, &t, BIN_KEY, COLUMNS, ", KEY (effect_key)").await;
    // What the ledger would do on it: its claim is an INSERT … ON DUPLICATE
    // KEY UPDATE, which only ever finds a duplicate through a unique index.
    // Two claims of one key both insert, both with their own token: both
    // would be told they acquired the key.
    for token in [1u8, 2] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO `{t}` (effect_key, tenant, kind, subject, state, fence, at_most_once, claim_token, \
             created_us, updated_us, lease_expires_us, retention_us, retain_until_us) \
             VALUES ('g/capture:o-1', 'g', 'capture', 'o-1', 'in_progress', 1, 0, ?, 0, 0, 1, 1, 1) \
             ON DUPLICATE KEY UPDATE fence = fence + 1"
        )))
        .bind(vec![token; 16])
        .execute(&pool)
        .await
        .unwrap();
    }
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM `{t}` WHERE effect_key = 'g/capture:o-1'"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, 2, "both claims inserted: a double acquire");
    refused_everywhere(&t, "no PRIMARY KEY or UNIQUE index on exactly (effect_key)").await;
    // A prefix of the key is not the key, and neither is a wider index.
    create(&pool, &t, BIN_KEY, COLUMNS, ", UNIQUE KEY (effect_key(100))").await;
    refused_everywhere(&t, "no PRIMARY KEY or UNIQUE index").await;
    create(&pool, &t, BIN_KEY, COLUMNS, ", UNIQUE KEY (effect_key, tenant)").await;
    refused_everywhere(&t, "no PRIMARY KEY or UNIQUE index").await;
    drop_tables(&pool, &t).await;
}

/// A case-insensitive collation would make `Order-1` and `order-1` one
/// record (and `é` and `e`, with accent-insensitive ones): refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_insensitive_key_collation_is_refused() {
    let Some(pool) = admin().await else { return };
    let t = table("ci");
    for collation in ["utf8mb4_general_ci", "utf8mb4_unicode_ci"] {
        create(
            &pool,
            &t,
            &format!("VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"),
            COLUMNS,
            ", PRIMARY KEY (effect_key)",
        )
        .await;
        refused_everywhere(&t, &format!("collation {collation}")).await;
    }
    // On the tenant too: `abandoned(Acme)` would list `acme`'s steps.
    let columns = COLUMNS.replace(
        "tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
        "tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci",
    );
    create(&pool, &t, BIN_KEY, &columns, ", PRIMARY KEY (effect_key)").await;
    refused_everywhere(&t, "column tenant").await;
    drop_tables(&pool, &t).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_mistyped_column_is_refused() {
    let Some(pool) = admin().await else { return };
    let t = table("cols");
    let without_token = COLUMNS.replace("  claim_token BINARY(16) NOT NULL,\n", "");
    create(&pool, &t, BIN_KEY, &without_token, ", PRIMARY KEY (effect_key)").await;
    refused_everywhere(&t, "column claim_token is missing").await;
    // A signed fence, a BLOB too small for the outcome limit, and a NOT NULL
    // lease (released records write NULL): all reported at once.
    let mistyped = COLUMNS
        .replace("fence BIGINT UNSIGNED", "fence BIGINT")
        .replace("outcome MEDIUMBLOB", "outcome BLOB")
        .replace("lease_expires_us BIGINT NULL", "lease_expires_us BIGINT NOT NULL");
    create(&pool, &t, BIN_KEY, &mistyped, ", PRIMARY KEY (effect_key)").await;
    refused_everywhere(&t, "column fence").await;
    refused_everywhere(&t, "column outcome").await;
    refused_everywhere(&t, "column lease_expires_us").await;
    // A MyISAM table has no transactions and no row locks. (Its keys are
    // limited to 1000 bytes, too short for the key: made without one.)
    create(&pool, &t, BIN_KEY, COLUMNS, "").await;
    exec(&pool, format!("ALTER TABLE `{t}` ENGINE = MyISAM")).await;
    refused_everywhere(&t, "InnoDB").await;
    // The horizon table is checked too.
    create(&pool, &t, BIN_KEY, COLUMNS, ", PRIMARY KEY (effect_key)").await;
    exec(&pool, format!("ALTER TABLE `{t}_horizon` DROP PRIMARY KEY")).await;
    refused_everywhere(&t, &format!("{t}_horizon")).await;
    drop_tables(&pool, &t).await;
}

/// A bad table someone else made gets no DDL from a refused migration: the
/// horizon table is not created next to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_table_gets_no_ddl() {
    let Some(pool) = admin().await else { return };
    let t = table("noddl");
    create(&pool, &t, BIN_KEY, COLUMNS, "").await;
    exec(&pool, format!("DROP TABLE `{t}_horizon`")).await;
    let e = MySqlLedger::connect_with(&url().unwrap(), MySqlLedgerOptions::default().table(&t))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(!exists(&pool, &format!("{t}_horizon")).await);
    drop_tables(&pool, &t).await;
}

async fn exists(pool: &MySqlPool, t: &str) -> bool {
    let n: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(t)
    .fetch_one(pool)
    .await
    .unwrap();
    n > 0
}

async fn versions(pool: &MySqlPool, t: &str) -> Vec<u32> {
    sqlx::query_scalar("SELECT version FROM oncely_schema_migrations WHERE table_name = ? ORDER BY version")
        .bind(t)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A correct table made by hand (a UNIQUE index instead of the primary key,
/// a wider key column, an extra column of the application's, a binary
/// `VARBINARY` tenant) is accepted and works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_pre_existing_table_is_accepted() {
    let Some(pool) = admin().await else { return };
    let t = table("ok");
    let columns = COLUMNS.replace(
        "tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
        "tenant VARBINARY(64)",
    ) + ",\n  note VARCHAR(20) NULL,\n  id BIGINT AUTO_INCREMENT PRIMARY KEY";
    create(
        &pool,
        &t,
        "VARCHAR(300) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
        &columns,
        ", UNIQUE KEY uk (effect_key)",
    )
    .await;
    exec(&pool, format!("DROP TABLE `{t}_horizon`")).await;
    let url = url().unwrap();
    // Without migrating, the missing horizon table is what is wrong.
    let e = MySqlLedger::connect_with(&url, MySqlLedgerOptions::default().table(&t).migrate(false))
        .await
        .unwrap_err();
    assert!(e.to_string().contains(&format!("{t}_horizon")), "{e}");
    let ledger = MySqlLedger::connect_with(&url, MySqlLedgerOptions::default().table(&t))
        .await
        .unwrap();
    assert_eq!(versions(&pool, &t).await, vec![1, 2, 3]);
    let k = EffectKey::new(&fresh_tenant(), "capture", "hand-made").unwrap();
    let l = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
        Claim::InProgress { .. }
    ));
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    assert_eq!(
        ledger.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    drop_tables(&pool, &t).await;
}

/// `migrate(false)` and `read_only(true)` on a database without the tables
/// fail with a `Config` error naming the table, and create nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_migration_creates_nothing() {
    let Some(pool) = admin().await else { return };
    let t = table("none");
    drop_tables(&pool, &t).await;
    let url = url().unwrap();
    for opts in [
        MySqlLedgerOptions::default().table(&t).migrate(false),
        MySqlLedgerOptions::default().table(&t).read_only(true),
        MySqlLedgerOptions::default()
            .table(&t)
            .read_only(true)
            .migrate(true),
    ] {
        let e = MySqlLedger::connect_with(&url, opts).await.unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e:?}");
        assert!(e.to_string().contains(&format!("`{t}` does not exist")), "{e}");
        assert!(!exists(&pool, &t).await && !exists(&pool, &format!("{t}_horizon")).await);
        assert!(versions(&pool, &t).await.is_empty());
    }
    // A read-only ledger refuses to migrate when asked explicitly too.
    let ledger = MySqlLedger::from_pool_with(
        pool.clone(),
        MySqlLedgerOptions::default().table(&t).read_only(true),
    )
    .unwrap();
    assert!(matches!(ledger.migrate().await, Err(Error::Config(_))));
    assert!(!exists(&pool, &t).await);
}

/// A user with only `SELECT` on the two tables opens the ledger read-only
/// and reads records, abandoned steps and the horizon; the ledger refuses
/// its writes before any round trip, and its sessions are read-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_only_user_reads() {
    let Some(pool) = admin().await else { return };
    let t = table("ro");
    drop_tables(&pool, &t).await;
    let url = url().unwrap();
    let writer = MySqlLedger::connect_with(&url, MySqlLedgerOptions::default().table(&t))
        .await
        .unwrap();
    let tenant = fresh_tenant();
    let done = EffectKey::new(&tenant, "capture", "done").unwrap();
    let lost = EffectKey::new(&tenant, "receipt", "lost").unwrap();
    let pruned = EffectKey::new(&tenant, "capture", "pruned").unwrap();
    let short = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(200));
    for (k, o) in [
        (&done, ClaimOptions::default()),
        (&lost, short.clone().at_most_once(true)),
        (&pruned, short.clone()),
    ] {
        let Claim::Acquired(l) = writer.claim(k, &o).await.unwrap() else {
            panic!("fresh key")
        };
        if k != &lost {
            writer
                .complete(&l, &Outcome::from_json(&1).unwrap())
                .await
                .unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    oncely::conformance::prune_until_gone(&writer, &pruned).await;
    let user = format!("oncely_ro_{}", std::process::id());
    exec(&pool, format!("DROP USER IF EXISTS '{user}'@'%'")).await;
    exec(&pool, format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'ro-pw'")).await;
    for tbl in [t.clone(), format!("{t}_horizon"), format!("{t}_outbox")] {
        exec(&pool, format!("GRANT SELECT ON `{tbl}` TO '{user}'@'%'")).await;
    }
    let ro_url = url.replacen("root@", &format!("{user}:ro-pw@"), 1);
    assert_ne!(ro_url, url, "the test URL names root");
    let reader = MySqlLedger::connect_with(
        &ro_url,
        MySqlLedgerOptions::default()
            .table(&t)
            .read_only(true)
            .max_connections(2),
    )
    .await
    .unwrap();
    assert!(reader.is_read_only());
    assert_eq!(
        reader.get(&done).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    let abandoned = reader.abandoned(&tenant, 10).await.unwrap();
    assert_eq!(abandoned.len(), 1);
    assert_eq!(abandoned[0].key, lost);
    assert!(reader.horizon(&tenant, "capture").await.unwrap().is_some());
    assert!(reader.horizon(&tenant, "receipt").await.unwrap().is_none());
    for e in [
        reader.claim(&done, &ClaimOptions::default()).await.unwrap_err(),
        reader.prune(10).await.unwrap_err(),
        reader.begin().await.unwrap_err(),
    ] {
        assert!(matches!(e, Error::Config(_)), "{e:?}");
    }
    // Without read_only, the same user may connect with migrate(false)
    // (nothing to create) and read; the server refuses its writes.
    let plain = MySqlLedger::connect_with(
        &ro_url,
        MySqlLedgerOptions::default()
            .table(&t)
            .migrate(false)
            .max_connections(2),
    )
    .await
    .unwrap();
    assert!(plain.get(&done).await.unwrap().is_some());
    let e = plain
        .claim(
            &EffectKey::new(&tenant, "capture", "new").unwrap(),
            &ClaimOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(!e.is_retryable(), "{e:?}");
    exec(&pool, format!("DROP USER '{user}'@'%'")).await;
    // Read-only sessions: root's read-only ledger cannot write through its
    // pool either.
    let root_ro = MySqlLedger::connect_with(&url, MySqlLedgerOptions::default().table(&t).read_only(true))
        .await
        .unwrap();
    let e = sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM `{t}`")))
        .execute(root_ro.pool())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("READ ONLY"), "{e}");
    assert!(writer.get(&done).await.unwrap().is_some());
    drop_tables(&pool, &t).await;
}

/// The previous release's table (schema version 1: no horizon table, fences
/// counted from 1) migrates to version 2 in place, and its records keep
/// working: fences only grow, completed records replay, live leases hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_release_table_migrates() {
    let Some(pool) = admin().await else { return };
    let t = table("v1");
    drop_tables(&pool, &t).await;
    // Version 1 as the previous release created it, and its bookkeeping.
    exec(
        &pool,
        format!(
            "CREATE TABLE `{t}` (effect_key {BIN_KEY}, {COLUMNS},
          PRIMARY KEY (effect_key),
          KEY prune_idx (state, retain_until_us),
          KEY abandoned_idx (tenant, at_most_once, state, created_us)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        ),
    )
    .await;
    exec(
        &pool,
        "CREATE TABLE IF NOT EXISTS oncely_schema_migrations (
          table_name VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
          version INT UNSIGNED NOT NULL,
          applied_at DATETIME(6) NOT NULL,
          PRIMARY KEY (table_name, version)
        ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4"
            .to_owned(),
    )
    .await;
    sqlx::query("INSERT INTO oncely_schema_migrations VALUES (?, 1, UTC_TIMESTAMP(6))")
        .bind(&t)
        .execute(&pool)
        .await
        .unwrap();
    // Rows as version 1 wrote them: small fences, times on the server clock.
    let tenant = fresh_tenant();
    let key = |s: &str| EffectKey::new(&tenant, "capture", s).unwrap();
    let now = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";
    for (subject, state, fence, outcome, lease) in [
        ("completed", "completed", 1, Some("\"v1\""), None),
        ("released", "released", 3, None, None),
        ("live", "in_progress", 2, None, Some(600_000_000i64)),
    ] {
        let k = key(subject);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO `{t}` (effect_key, tenant, kind, subject, state, fence, fingerprint, outcome, \
             at_most_once, claim_token, created_us, updated_us, lease_expires_us, retention_us, retain_until_us) \
             VALUES (?, ?, 'capture', ?, ?, ?, NULL, ?, 0, ?, {now} - 5000000, {now} - 5000000, {now} + ?, \
             86400000000, {now} + 86400000000)"
        )))
        .bind(k.as_str())
        .bind(tenant.as_str())
        .bind(subject)
        .bind(state)
        .bind(fence)
        .bind(outcome.map(|o| o.as_bytes().to_vec()))
        .bind(vec![7u8; 16])
        .bind(lease)
        .execute(&pool)
        .await
        .unwrap();
    }
    let ledger = MySqlLedger::connect_with(&url().unwrap(), MySqlLedgerOptions::default().table(&t))
        .await
        .unwrap();
    assert_eq!(versions(&pool, &t).await, vec![1, 2, 3]);
    assert!(exists(&pool, &format!("{t}_horizon")).await);
    match ledger
        .claim(&key("completed"), &ClaimOptions::default())
        .await
        .unwrap()
    {
        Claim::Completed(r) => assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "v1"),
        other => panic!("{other:?}"),
    }
    match ledger
        .claim(&key("live"), &ClaimOptions::default())
        .await
        .unwrap()
    {
        Claim::InProgress { fence, .. } => assert_eq!(fence, 2),
        other => panic!("{other:?}"),
    }
    let l = match ledger
        .claim(&key("released"), &ClaimOptions::default())
        .await
        .unwrap()
    {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    assert!(l.taken_over() && l.fence() > 3, "{l:?}");
    ledger
        .complete(&l, &Outcome::from_json(&"v2").unwrap())
        .await
        .unwrap();
    // The old holder of fence 3 cannot touch it.
    let stale = oncely::backend::Grant {
        fence: 3,
        ..oncely::backend::Grant::from(&l)
    }
    .into_lease();
    assert!(ledger.release(&stale).await.unwrap_err().is_lease_lost());
    // Migrating again changes nothing.
    ledger.migrate().await.unwrap();
    assert_eq!(versions(&pool, &t).await, vec![1, 2, 3]);
    drop_tables(&pool, &t).await;
}

/// A ledger of schema version 2 (no `<table>_outbox` yet) is refused when
/// opened without migrations, naming the missing table and `oncely
/// migrate`; migrating creates it (version 3), keeps the records, and the
/// outbox works. An outbox table without its unique key on `effect_key`
/// (two enqueues of one effect would both write a message) is refused too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_ledger_is_refused_until_migrated() {
    let Some(pool) = admin().await else { return };
    let t = table("v2");
    drop_tables(&pool, &t).await;
    let url = url().unwrap();
    let ledger = MySqlLedger::connect_with(&url, MySqlLedgerOptions::default().table(&t))
        .await
        .unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "kept").unwrap();
    let l = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&l, &Outcome::from_json(&"v2").unwrap())
        .await
        .unwrap();
    // Back to version 2: what that release left.
    exec(&pool, format!("DROP TABLE `{t}_outbox`")).await;
    sqlx::query("DELETE FROM oncely_schema_migrations WHERE table_name = ? AND version = 3")
        .bind(&t)
        .execute(&pool)
        .await
        .unwrap();
    for opts in [
        MySqlLedgerOptions::default().table(&t).migrate(false),
        MySqlLedgerOptions::default().table(&t).read_only(true),
    ] {
        let e = MySqlLedger::connect_with(&url, opts).await.unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains(&format!("`{t}_outbox` does not exist"))
                && m.contains("oncely migrate")),
            "{e:?}"
        );
    }
    assert!(!exists(&pool, &format!("{t}_outbox")).await);
    let ledger = MySqlLedger::connect_with(&url, MySqlLedgerOptions::default().table(&t))
        .await
        .unwrap();
    assert_eq!(versions(&pool, &t).await, vec![1, 2, 3]);
    assert!(matches!(
        ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
        Claim::Completed(_)
    ));
    let mut tx = ledger.begin().await.unwrap();
    let m = Message::new("orders", b"paid".to_vec()).unwrap();
    assert!(matches!(
        ledger.enqueue_in(&mut tx, &k, &m).await.unwrap(),
        Enqueued::New(_)
    ));
    ledger.commit(tx).await.unwrap();
    assert_eq!(
        ledger
            .claim_messages(10, Duration::from_secs(30))
            .await
            .unwrap()
            .len(),
        1
    );
    // An outbox someone made without the unique key on the effect key.
    exec(&pool, format!("ALTER TABLE `{t}_outbox` DROP INDEX effect_key")).await;
    refused_everywhere(
        &t,
        &format!("`{t}_outbox` cannot be used by the mysql ledger: it has no PRIMARY KEY or UNIQUE index on exactly (effect_key)"),
    )
    .await;
    drop_tables(&pool, &t).await;
}
