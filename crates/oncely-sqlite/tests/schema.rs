//! The ledger checks the tables it finds before it trusts them (on connect
//! and at the end of `migrate`), and files written by earlier releases
//! (version 1: no horizon; version 2: no outbox) migrate cleanly.

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::{fresh_tenant, prune_until_gone};
use oncely::outbox::{Enqueued, Message, Outbox, TransactionalOutbox};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

/// The ledger table as release 0.1 (schema version 1) created it.
const V1_TABLE: &str = "CREATE TABLE IF NOT EXISTS \"oncely_effects\" (
    key              TEXT PRIMARY KEY NOT NULL,
    tenant           TEXT NOT NULL,
    kind             TEXT NOT NULL,
    subject          TEXT NOT NULL,
    state            TEXT NOT NULL
                     CHECK (state IN ('in_progress', 'completed', 'released')),
    fence            INTEGER NOT NULL CHECK (fence >= 1),
    fingerprint      BLOB CHECK (fingerprint IS NULL OR length(fingerprint) = 32),
    outcome          BLOB,
    at_most_once     INTEGER NOT NULL CHECK (at_most_once IN (0, 1)),
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    lease_expires_at INTEGER,
    retain_until     INTEGER NOT NULL,
    retention_us     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS \"oncely_effects_prune\" ON \"oncely_effects\" (state, retain_until);
CREATE INDEX IF NOT EXISTS \"oncely_effects_abandoned\"
    ON \"oncely_effects\" (tenant, at_most_once, state, lease_expires_at);
CREATE TABLE IF NOT EXISTS oncely_schema (table_name TEXT PRIMARY KEY NOT NULL, version INTEGER NOT NULL);
INSERT INTO oncely_schema (table_name, version) VALUES ('oncely_effects', 1);";

/// A ledger table with `key` for the key column's definition and `rest`
/// for what follows the columns.
fn table(key: &str, rest: &str) -> String {
    format!(
        "CREATE TABLE oncely_effects (
            key {key}, tenant TEXT NOT NULL, kind TEXT NOT NULL, subject TEXT NOT NULL,
            state TEXT NOT NULL, fence INTEGER NOT NULL, fingerprint BLOB, outcome BLOB,
            at_most_once INTEGER NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
            lease_expires_at INTEGER, retain_until INTEGER NOT NULL, retention_us INTEGER NOT NULL
            {rest})"
    )
}

async fn open_pool(dir: &tempfile::TempDir, name: &str) -> (String, SqlitePool) {
    let path = dir.path().join(name);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    (format!("sqlite:{}", path.display()), pool)
}

async fn exec(pool: &SqlitePool, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap();
}

fn config_error(e: Error, wanted: &[&str]) {
    let Error::Config(message) = &e else {
        panic!("expected Error::Config, got {e:?}")
    };
    for w in wanted {
        assert!(message.contains(w), "{message:?} does not mention {w:?}");
    }
}

/// Connect (migrating or not) refuses the table with a message naming it and
/// the problem, and changes nothing in the file.
async fn refused(url: &str, pool: &SqlitePool, wanted: &[&str]) {
    let before: Vec<String> = sqlx::query_scalar("SELECT name FROM sqlite_schema ORDER BY name")
        .fetch_all(pool)
        .await
        .unwrap();
    for migrate in [true, false] {
        let e = SqliteLedger::connect_with(url, SqliteLedgerOptions::default().migrate(migrate))
            .await
            .unwrap_err();
        config_error(e, wanted);
    }
    let e = SqliteLedger::connect_with(url, SqliteLedgerOptions::default().read_only(true))
        .await
        .unwrap_err();
    config_error(e, wanted);
    let after: Vec<String> = sqlx::query_scalar("SELECT name FROM sqlite_schema ORDER BY name")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(before, after, "a refused migration rolled everything back");
}

fn key(subject: &str) -> EffectKey {
    EffectKey::new(&fresh_tenant(), "capture", subject).unwrap()
}

/// A table without a unique key on `key`. Accepted, it could not serialise
/// claims: SQLite refuses `ON CONFLICT(key)` without a matching unique index,
/// so every claim fails (and, through any other insert, two claims of one key
/// would both insert). The ledger refuses the table up front, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_without_a_unique_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (url, pool) = open_pool(&dir, "no-key.db").await;
    exec(&pool, &table("TEXT NOT NULL", "")).await;
    // Two rows for one key fit in this table: nothing would stop a second
    // acquire.
    for _ in 0..2 {
        exec(
            &pool,
            "INSERT INTO oncely_effects VALUES ('t/capture:a', 't', 'capture', 'a', 'in_progress', 1, \
             NULL, NULL, 0, 0, 0, 0, 0, 0)",
        )
        .await;
    }
    // Accepted unchecked (a caller's pool, no verify), the claim cannot use it.
    let unchecked = SqliteLedger::from_pool(pool.clone());
    let e = unchecked
        .claim(&key("order-1"), &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(format!("{e}").contains("ON CONFLICT"), "{e:?}");
    exec(&pool, "DELETE FROM oncely_effects").await;
    refused(
        &url,
        &pool,
        &[
            "oncely_effects",
            "no PRIMARY KEY or UNIQUE index on exactly (key)",
        ],
    )
    .await;
    // A unique index on more than the key is no better.
    exec(
        &pool,
        "CREATE UNIQUE INDEX wide ON oncely_effects (key, tenant); \
         CREATE UNIQUE INDEX part ON oncely_effects (key) WHERE state = 'completed'",
    )
    .await;
    refused(&url, &pool, &["no PRIMARY KEY or UNIQUE index on exactly (key)"]).await;
    config_error(unchecked.verify().await.unwrap_err(), &["oncely_effects"]);
}

/// `COLLATE NOCASE` on the key: accepted, `Acme` and `acme` would share one
/// record (the second claim gets the first one's outcome). Refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_insensitive_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (url, pool) = open_pool(&dir, "nocase.db").await;
    exec(&pool, &table("TEXT COLLATE NOCASE PRIMARY KEY NOT NULL", "")).await;
    // What accepting it would do: two different keys, one record.
    let unchecked = SqliteLedger::from_pool(pool.clone());
    exec(
        &pool,
        "CREATE TABLE oncely_effects_horizon (tenant TEXT NOT NULL, kind TEXT NOT NULL, \
         pruned_through INTEGER NOT NULL, PRIMARY KEY (tenant, kind))",
    )
    .await;
    let t = fresh_tenant();
    let upper = EffectKey::new(&t, "capture", "Acme").unwrap();
    let lower = EffectKey::new(&t, "capture", "acme").unwrap();
    let Claim::Acquired(lease) = unchecked.claim(&upper, &ClaimOptions::default()).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    unchecked
        .complete(&lease, &Outcome::from_json(&"Acme's charge").unwrap())
        .await
        .unwrap();
    match unchecked.claim(&lower, &ClaimOptions::default()).await.unwrap() {
        Claim::Completed(r) => assert_eq!(r.key, upper, "acme was answered with Acme's record"),
        other => panic!("expected the shared record, got {other:?}"),
    }
    exec(&pool, "DELETE FROM oncely_effects").await;
    refused(&url, &pool, &["oncely_effects", "`key`", "Acme"]).await;
    config_error(unchecked.verify().await.unwrap_err(), &["NOCASE"]);
}

/// A BINARY column with a NOCASE unique index on it (claims of keys that
/// differ in case would collide), and an RTRIM column: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_collations_on_the_key_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (url, pool) = open_pool(&dir, "nocase-index.db").await;
    exec(&pool, &table("TEXT NOT NULL", "")).await;
    exec(
        &pool,
        "CREATE UNIQUE INDEX by_key ON oncely_effects (key COLLATE NOCASE)",
    )
    .await;
    refused(&url, &pool, &["unique index by_key on (key)", "NOCASE"]).await;
    let (url, pool) = open_pool(&dir, "rtrim.db").await;
    exec(&pool, &table("TEXT COLLATE RTRIM PRIMARY KEY NOT NULL", "")).await;
    refused(&url, &pool, &["column `key`", "BINARY"]).await;
}

/// A missing column, or a column whose type affinity would convert the
/// values the ledger writes: refused, each named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_mistyped_columns_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (url, pool) = open_pool(&dir, "missing.db").await;
    exec(
        &pool,
        "CREATE TABLE oncely_effects (
            key TEXT PRIMARY KEY NOT NULL, tenant TEXT NOT NULL, kind TEXT NOT NULL,
            subject TEXT NOT NULL, state TEXT NOT NULL, fence INTEGER NOT NULL, fingerprint BLOB,
            outcome BLOB, at_most_once INTEGER NOT NULL, created_at INTEGER NOT NULL,
            updated_at INTEGER NOT NULL, lease_expires_at INTEGER, retain_until INTEGER NOT NULL)",
    )
    .await;
    refused(
        &url,
        &pool,
        &["oncely_effects", "no column `retention_us` (INTEGER)"],
    )
    .await;
    let (url, pool) = open_pool(&dir, "mistyped.db").await;
    exec(
        &pool,
        &table("TEXT PRIMARY KEY NOT NULL", "").replace("tenant TEXT", "tenant NUMERIC"),
    )
    .await;
    refused(
        &url,
        &pool,
        &["column `tenant` is declared \"NUMERIC\" (NUMERIC affinity); it must be TEXT"],
    )
    .await;
    let (url, pool) = open_pool(&dir, "view.db").await;
    exec(
        &pool,
        &table("TEXT PRIMARY KEY NOT NULL", "").replace("oncely_effects", "real_effects"),
    )
    .await;
    exec(&pool, "CREATE VIEW oncely_effects AS SELECT * FROM real_effects").await;
    refused(&url, &pool, &["oncely_effects is a view"]).await;
}

/// A correct table made by the application itself (another column order,
/// STRICT, WITHOUT ROWID, no `oncely_schema` row) is accepted: migrate adds
/// what is missing (the horizon table) and the ledger works on it, prune
/// included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_pre_existing_table_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let (url, pool) = open_pool(&dir, "own.db").await;
    exec(
        &pool,
        "CREATE TABLE oncely_effects (
            tenant TEXT NOT NULL, kind TEXT NOT NULL, subject TEXT NOT NULL,
            key TEXT NOT NULL PRIMARY KEY, state TEXT NOT NULL, fence INTEGER NOT NULL,
            fingerprint BLOB, outcome BLOB, at_most_once INTEGER NOT NULL,
            created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, lease_expires_at INTEGER,
            retain_until INTEGER NOT NULL, retention_us INTEGER NOT NULL, note TEXT
        ) STRICT, WITHOUT ROWID",
    )
    .await;
    // Without migrating, the horizon table is missing: refused, named.
    let e = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().migrate(false))
        .await
        .unwrap_err();
    config_error(e, &["oncely_effects_horizon does not exist", "oncely migrate"]);
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    let k = key("order-own");
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(100));
    let Claim::Acquired(l) = ledger.claim(&k, &brief).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    prune_until_gone(&ledger, &k).await;
    assert!(ledger.horizon(k.tenant(), "capture").await.unwrap().is_some());
    // Now it verifies without migrating too.
    SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().migrate(false))
        .await
        .unwrap();
    SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().read_only(true))
        .await
        .unwrap();
}

/// A table broken after it was migrated (recreated by hand with NOCASE) is
/// caught on the next connect and by `migrate`, though its version row says
/// it is current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_broken_after_migration_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.db");
    let url = format!("sqlite:{}", path.display());
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    exec(
        ledger.pool(),
        &format!(
            "DROP TABLE oncely_effects; {}",
            table("TEXT COLLATE NOCASE PRIMARY KEY NOT NULL", "")
        ),
    )
    .await;
    config_error(ledger.migrate().await.unwrap_err(), &["oncely_effects", "Acme"]);
    config_error(ledger.verify().await.unwrap_err(), &["oncely_effects", "Acme"]);
    refused(&url, ledger.pool(), &["oncely_effects", "Acme"]).await;
}

/// A file created by the first release (schema version 1, fences 1, 2, …)
/// migrates to the current version in place: its records are kept and readable, a
/// takeover of an old record gets a fence above the old one, prune of an old
/// record raises the horizon, and a read-only or migrate(false) open of an
/// unmigrated file is refused with a message saying to migrate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_from_the_previous_release_migrates() {
    let dir = tempfile::tempdir().unwrap();
    let (url, pool) = open_pool(&dir, "v1.db").await;
    exec(&pool, V1_TABLE).await;
    let t = fresh_tenant();
    let done = EffectKey::new(&t, "capture", "done").unwrap();
    let released = EffectKey::new(&t, "capture", "released").unwrap();
    // As release 0.1 left them: a completed record past retention, and a
    // released one at fence 2, created an hour ago.
    let hour_ago_us = (std::time::SystemTime::now() - Duration::from_secs(3600))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    for (k, state, fence, outcome) in [
        (&done, "completed", 1, Some(br#""old""#.to_vec())),
        (&released, "released", 2, None),
    ] {
        sqlx::query(
            "INSERT INTO oncely_effects VALUES (?1, ?2, 'capture', ?3, ?4, ?5, NULL, ?6, 0, ?7, ?7, NULL, ?7, 1000)",
        )
        .bind(k.as_str())
        .bind(t.as_str())
        .bind(k.subject())
        .bind(state)
        .bind(fence)
        .bind(outcome)
        .bind(hour_ago_us)
        .execute(&pool)
        .await
        .unwrap();
    }
    for options in [
        SqliteLedgerOptions::default().read_only(true),
        SqliteLedgerOptions::default().migrate(false),
    ] {
        let e = SqliteLedger::connect_with(&url, options).await.unwrap_err();
        config_error(e, &["schema version 1", "needs version 3", "oncely migrate"]);
    }
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    let version: i64 =
        sqlx::query_scalar("SELECT version FROM oncely_schema WHERE table_name = 'oncely_effects'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(version, 3);
    let r = ledger.get(&done).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::Completed, 1));
    assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "old");
    let Claim::Acquired(l) = ledger.claim(&released, &ClaimOptions::default()).await.unwrap() else {
        panic!("a released record is taken over")
    };
    assert!(l.taken_over());
    assert!(l.fence() > 2, "fence {} after the old fence 2", l.fence());
    assert!(ledger.horizon(&t, "capture").await.unwrap().is_none());
    prune_until_gone(&ledger, &done).await;
    let h = ledger.horizon(&t, "capture").await.unwrap().unwrap();
    assert_eq!(h, r.created_at, "the pruned record's creation");
    let e = ledger
        .claim(&done, &ClaimOptions::default().sent_at(r.created_at))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    // Migrating again changes nothing.
    ledger.migrate().await.unwrap();
    SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().read_only(true))
        .await
        .unwrap();
}

/// An outbox table made by hand, with `key` for the key column's definition.
fn outbox_table(key: &str) -> String {
    format!(
        "CREATE TABLE oncely_effects_outbox (
            id INTEGER PRIMARY KEY AUTOINCREMENT, key {key}, tenant TEXT NOT NULL,
            ordering_key TEXT NOT NULL, destination TEXT NOT NULL, headers TEXT NOT NULL,
            payload BLOB NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
            fence INTEGER NOT NULL DEFAULT 0, lease_expires_at INTEGER, due_at INTEGER NOT NULL,
            enqueued_at INTEGER NOT NULL, sent_at INTEGER, last_error TEXT)"
    )
}

/// A file of schema version 2 (no `<table>_outbox` yet) is refused when
/// opened without migrations, saying to migrate; migrating adds the outbox
/// (version 3), keeps the records, and the outbox works. An outbox table
/// made by hand whose key compares case-insensitively, or without a unique
/// key, would let two effects' enqueues share one message, or one effect
/// enqueue two: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_file_is_refused_until_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let (url, pool) = open_pool(&dir, "v2.db").await;
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    let k = key("kept");
    let Claim::Acquired(l) = ledger.claim(&k, &ClaimOptions::default()).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    ledger
        .complete(&l, &Outcome::from_json(&"v2").unwrap())
        .await
        .unwrap();
    // Back to version 2: what that release left.
    exec(
        &pool,
        "DROP TABLE oncely_effects_outbox; \
         UPDATE oncely_schema SET version = 2 WHERE table_name = 'oncely_effects'",
    )
    .await;
    for options in [
        SqliteLedgerOptions::default().read_only(true),
        SqliteLedgerOptions::default().migrate(false),
    ] {
        let e = SqliteLedger::connect_with(&url, options).await.unwrap_err();
        config_error(e, &["schema version 2", "needs version 3", "oncely migrate"]);
    }
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    let version: i64 =
        sqlx::query_scalar("SELECT version FROM oncely_schema WHERE table_name = 'oncely_effects'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(version, 3);
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
    drop(ledger);
    for (key_col, wanted) in [
        ("TEXT NOT NULL UNIQUE COLLATE NOCASE", "NOCASE"),
        ("TEXT NOT NULL", "no PRIMARY KEY or UNIQUE index on exactly (key)"),
    ] {
        exec(
            &pool,
            &format!("DROP TABLE oncely_effects_outbox; {}", outbox_table(key_col)),
        )
        .await;
        refused(&url, &pool, &["oncely_effects_outbox", wanted]).await;
    }
}
