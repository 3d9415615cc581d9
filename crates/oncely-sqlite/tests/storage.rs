//! What the ledger opens: storage that would not survive is refused unless
//! asked for (and then shared by the whole pool), durability is read from
//! the database, and read-only or non-migrating opens create and change
//! nothing.

use std::sync::Arc;
use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::fresh_tenant;
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

fn key(subject: &str) -> EffectKey {
    EffectKey::new(&fresh_tenant(), "capture", subject).unwrap()
}

fn config(e: Error, wanted: &str) {
    match &e {
        Error::Config(m) if m.contains(wanted) => {}
        _ => panic!("expected Error::Config mentioning {wanted:?}, got {e:?}"),
    }
}

/// In-memory and per-connection databases are refused before anything is
/// opened: `migrate` would succeed on one connection and the next would
/// have no table (or everything would vanish with the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_durable_urls_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let memdb = dir.path().join("memdb.db");
    for url in [
        format!("sqlite:{}?vfs=memdb", memdb.display()),
        "sqlite:/x.db?vfs=memdb".to_owned(),
        "sqlite::memory:".to_owned(),
        "sqlite://:memory:".to_owned(),
        ":memory:".to_owned(),
        "sqlite://ledger?mode=memory".to_owned(),
        "sqlite://?mode=memory&cache=private".to_owned(),
        "sqlite:".to_owned(),
        "sqlite://".to_owned(),
        String::new(),
        "file::memory:".to_owned(),
        "file:ledger?mode=memory".to_owned(),
    ] {
        let e = SqliteLedger::connect(&url).await.unwrap_err();
        config(e, "ephemeral(true)");
    }
    assert!(!memdb.exists(), "nothing was created on disk");
}

/// Why the empty path is refused: each connection gets its own temporary
/// database (shown with plain sqlx), so a table migrated on one is missing on
/// the next. With `ephemeral(true)` the ledger opens one in-memory database
/// for the whole pool instead: every connection sees the same records.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ephemeral_is_one_database_for_the_whole_pool() {
    let raw = SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(SqliteConnectOptions::new().filename(""))
        .await
        .unwrap();
    let mut a = raw.acquire().await.unwrap();
    let mut b = raw.acquire().await.unwrap();
    sqlx::query("CREATE TABLE t (x)").execute(&mut *a).await.unwrap();
    let e = sqlx::query("SELECT * FROM t").execute(&mut *b).await.unwrap_err();
    assert!(e.to_string().contains("no such table"), "{e}");
    drop((a, b));

    for url in [
        "sqlite::memory:",
        "sqlite:",
        "sqlite://",
        "sqlite:/x.db?vfs=memdb",
    ] {
        let ledger = SqliteLedger::connect_with(
            url,
            SqliteLedgerOptions::default().ephemeral(true).max_connections(8),
        )
        .await
        .unwrap();
        let caps = ledger.capabilities();
        assert!(caps.durability.starts_with("none"), "{url}: {}", caps.durability);
        // Eight connections at once, each sees the tables and the others'
        // records; racers on one key have one winner.
        let k = key("ephemeral");
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (ledger, k, barrier) = (ledger.clone(), k.clone(), barrier.clone());
                tokio::spawn(async move {
                    let mut conn = ledger.pool().acquire().await.unwrap();
                    barrier.wait().await;
                    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM oncely_effects")
                        .fetch_one(&mut *conn)
                        .await
                        .unwrap();
                    drop(conn);
                    let won = matches!(
                        ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
                        Claim::Acquired(_)
                    );
                    // The table is on every connection (the query above
                    // failed with "no such table" on a per-connection one).
                    (n >= 0, won)
                })
            })
            .collect();
        let mut winners = 0;
        for t in tasks {
            let (saw_table, won) = t.await.unwrap();
            assert!(saw_table);
            winners += usize::from(won);
        }
        assert_eq!(winners, 1, "{url}");
        assert_eq!(ledger.pool().size(), 8, "{url}: every connection was opened");
        // Transactions work as on a file: BEGIN IMMEDIATE, the busy timeout.
        let mut tx = ledger.begin().await.unwrap();
        let k2 = key("ephemeral-tx");
        let Claim::Acquired(l) = ledger
            .claim_in(&mut tx, &k2, &ClaimOptions::default())
            .await
            .unwrap()
        else {
            panic!("fresh key not acquired")
        };
        ledger
            .complete_in(&mut tx, &l, &Outcome::from_json(&2).unwrap())
            .await
            .unwrap();
        TransactionalLedger::commit(&ledger, tx).await.unwrap();
        assert_eq!(
            ledger.get(&k2).await.unwrap().map(|r| r.state),
            Some(RecordState::Completed)
        );
        // Each ephemeral ledger is a database of its own, whatever the URL.
        let reopened = SqliteLedger::connect_with(url, SqliteLedgerOptions::default().ephemeral(true))
            .await
            .unwrap();
        assert!(
            reopened.get(&k2).await.unwrap().is_none(),
            "{url}: each ephemeral ledger is its own database"
        );
    }
}

/// `ephemeral(true)` with a file path, or with `read_only(true)`, asks for
/// two contradictory things: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_contradictions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("file.db");
    let e = SqliteLedger::connect_with(
        &format!("sqlite:{}", path.display()),
        SqliteLedgerOptions::default().ephemeral(true),
    )
    .await
    .unwrap_err();
    config(e, "on a disk");
    assert!(!path.exists());
    let e = SqliteLedger::connect_with(
        "sqlite::memory:",
        SqliteLedgerOptions::default().ephemeral(true).read_only(true),
    )
    .await
    .unwrap_err();
    config(e, "read-only");
}

#[cfg(any(target_os = "linux", target_os = "android"))]
/// A directory on a memory file system (`/dev/shm` on Linux), if this
/// machine has one: the mount table says it is a tmpfs.
fn memory_fs_dir() -> Option<tempfile::TempDir> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let tmpfs = mounts.lines().any(|l| {
        let mut fields = l.split(' ').skip(1);
        fields.next() == Some("/dev/shm") && fields.next() == Some("tmpfs")
    });
    if !tmpfs {
        eprintln!("skipped: /dev/shm is not a tmpfs here");
        return None;
    }
    Some(tempfile::tempdir_in("/dev/shm").unwrap())
}

/// A file on a memory file system looks like any file to SQLite (WAL,
/// `synchronous=FULL`) but is gone at reboot: refused before anything is
/// created unless `ephemeral(true)` accepts it, and then reported as what
/// it is. A read-only open (it writes nothing) and a caller's pool are
/// accepted and reported.
#[cfg(any(target_os = "linux", target_os = "android"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_file_systems_are_refused_unless_ephemeral() {
    let Some(dir) = memory_fs_dir() else { return };
    let path = dir.path().join("ledger.db");
    let url = format!("sqlite:{}", path.display());
    for options in [
        SqliteLedgerOptions::default(),
        SqliteLedgerOptions::default().migrate(false),
    ] {
        let e = SqliteLedger::connect_with(&url, options).await.unwrap_err();
        config(e, "memory file system (tmpfs)");
    }
    let e = SqliteLedger::connect(&path.display().to_string())
        .await
        .unwrap_err();
    config(e, "ephemeral(true)");
    assert!(!path.exists(), "a refused open created the file");
    // A `file:` URI is SQLite's to resolve: refused once SQLite says
    // which file it opened.
    let uri = dir.path().join("uri.db");
    let e = SqliteLedger::connect(&format!("file:{}", uri.display()))
        .await
        .unwrap_err();
    config(e, "memory file system (tmpfs)");

    let ledger = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().ephemeral(true))
        .await
        .unwrap();
    let durability = ledger.capabilities().durability;
    assert!(
        durability.contains("memory file system") && durability.contains("reboot"),
        "{durability}"
    );
    let k = key("order-tmpfs");
    let Claim::Acquired(l) = ledger.claim(&k, &ClaimOptions::default()).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    ledger
        .complete(&l, &Outcome::from_json(&"done").unwrap())
        .await
        .unwrap();
    // A file, not a private in-memory database: another ledger on it sees
    // the record.
    assert!(path.exists());
    let other = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().ephemeral(true))
        .await
        .unwrap();
    assert_eq!(
        other.get(&k).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed)
    );
    // Reading needs no opt-in; the report says where the file is.
    let reader = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().read_only(true))
        .await
        .unwrap();
    let durability = reader.capabilities().durability;
    assert!(
        durability.contains("memory file system") && durability.contains("read-only"),
        "{durability}"
    );
    assert!(reader.get(&k).await.unwrap().is_some());
    // A caller's pool is not refused, and reported once checked.
    let pool = SqlitePoolOptions::new()
        .connect_with(SqliteConnectOptions::new().filename(&path))
        .await
        .unwrap();
    let mine = SqliteLedger::from_pool(pool);
    mine.verify().await.unwrap();
    let durability = mine.capabilities().durability;
    assert!(durability.contains("memory file system"), "{durability}");
}

/// `capabilities().durability` reports the journal mode and `synchronous`
/// setting the database runs with, not what was hoped for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durability_is_what_the_database_runs_with() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("durable.db").display());
    for (sync, wanted) in [
        (SqliteSynchronous::Full, "WAL, synchronous=FULL"),
        (SqliteSynchronous::Extra, "WAL, synchronous=EXTRA"),
        (SqliteSynchronous::Normal, "WAL, synchronous=NORMAL"),
        (SqliteSynchronous::Off, "synchronous=OFF"),
    ] {
        let ledger = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().synchronous(sync))
            .await
            .unwrap();
        let durability = ledger.capabilities().durability;
        assert!(durability.contains(wanted), "{sync:?}: {durability}");
        ledger.pool().close().await;
    }
    // A caller's pool in rollback-journal mode: unchecked until migrate or
    // verify reads it, then reported as it is.
    let pool = SqlitePoolOptions::new()
        .connect_with(
            SqliteConnectOptions::new()
                .filename(dir.path().join("rollback.db"))
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Delete)
                .synchronous(sqlx::sqlite::SqliteSynchronous::Normal),
        )
        .await
        .unwrap();
    let ledger = SqliteLedger::from_pool(pool);
    assert!(ledger.capabilities().durability.starts_with("unchecked"));
    ledger.migrate().await.unwrap();
    let durability = ledger.capabilities().durability;
    assert!(
        durability.contains("rollback journal, synchronous=NORMAL"),
        "{durability}"
    );
    // A caller's in-memory pool is allowed (their explicit choice) and
    // reported as not durable.
    let ledger = SqliteLedger::from_pool(
        SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap(),
    );
    ledger.migrate().await.unwrap();
    assert!(ledger.capabilities().durability.starts_with("none"));
}

async fn file_with_a_record(dir: &tempfile::TempDir) -> (String, EffectKey) {
    let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let ledger = SqliteLedger::connect(&url).await.unwrap();
    let k = key("order-ro");
    let Claim::Acquired(l) = ledger.claim(&k, &ClaimOptions::default()).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    ledger
        .complete(&l, &Outcome::from_json(&"done").unwrap())
        .await
        .unwrap();
    ledger.pool().close().await;
    (url, k)
}

/// A read-only open of a mistyped path is an error naming the path, and
/// creates nothing (it used to create an empty database and answer `null`).
/// So is `migrate(false)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_never_creates_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo.db");
    for (url, options) in [
        (
            format!("sqlite:{}", missing.display()),
            SqliteLedgerOptions::default().read_only(true),
        ),
        (
            format!("sqlite://{}", missing.display()),
            SqliteLedgerOptions::default().migrate(false),
        ),
        (
            missing.display().to_string(),
            SqliteLedgerOptions::default().read_only(true),
        ),
        (
            format!("sqlite:{}?mode=ro", missing.display()),
            SqliteLedgerOptions::default(),
        ),
    ] {
        let e = SqliteLedger::connect_with(&url, options).await.unwrap_err();
        config(e, &missing.display().to_string());
        assert!(!missing.exists(), "{url} created a file");
    }
    let e = SqliteLedger::from_url(
        &format!("sqlite:{}", missing.display()),
        OpenOptions::new(Access::ReadOnly),
    )
    .await
    .unwrap_err();
    config(e, "no SQLite database at");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Read-only: reads work, every write is refused with `Error::Config`
/// before it reaches SQLite, and the file is not changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_reads_and_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let (url, k) = file_with_a_record(&dir).await;
    for ledger in [
        SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().read_only(true))
            .await
            .unwrap(),
        // `mode=ro` in the URL means the same.
        SqliteLedger::connect(&format!("{url}?mode=ro")).await.unwrap(),
    ] {
        assert!(ledger.is_read_only());
        assert!(ledger.capabilities().durability.contains("read-only"));
        let r = ledger.get(&k).await.unwrap().unwrap();
        assert_eq!(r.state, RecordState::Completed);
        assert!(ledger.abandoned(k.tenant(), 10).await.unwrap().is_empty());
        assert!(ledger.horizon(k.tenant(), "capture").await.unwrap().is_none());
        let lease = oncely::backend::Grant {
            key: k.clone(),
            fence: r.fence,
            expires_at: r.read_at,
            first_claimed_at: r.created_at,
            acquired_at: r.read_at,
            taken_over: false,
            at_most_once: false,
        }
        .into_lease();
        let fresh = key("order-ro-new");
        config(
            ledger.claim(&fresh, &ClaimOptions::default()).await.unwrap_err(),
            "read-only",
        );
        config(
            ledger
                .complete(&lease, &Outcome::from_json(&1).unwrap())
                .await
                .unwrap_err(),
            "read-only",
        );
        config(ledger.release(&lease).await.unwrap_err(), "read-only");
        config(
            ledger.renew(&lease, Duration::from_secs(1)).await.unwrap_err(),
            "read-only",
        );
        config(ledger.prune(10).await.unwrap_err(), "read-only");
        config(ledger.begin().await.unwrap_err(), "read-only");
        config(ledger.migrate().await.unwrap_err(), "read-only");
        ledger.verify().await.unwrap();
        // SQLite itself refuses writes on this pool too (mode=ro).
        let e = sqlx::query("DELETE FROM oncely_effects")
            .execute(ledger.pool())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("readonly"), "{e}");
        assert!(ledger.get(&fresh).await.unwrap().is_none());
        ledger.pool().close().await;
    }
}

/// `migrate(false)` on a database without the tables: refused with a
/// message naming the table, and nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_false_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.db");
    let pool = SqlitePoolOptions::new()
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    sqlx::query("CREATE TABLE business (id INTEGER PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let url = format!("sqlite:{}", path.display());
    for options in [
        SqliteLedgerOptions::default().migrate(false),
        SqliteLedgerOptions::default().read_only(true),
    ] {
        let e = SqliteLedger::connect_with(&url, options).await.unwrap_err();
        config(e, "table oncely_effects does not exist");
    }
    let names: Vec<String> = sqlx::query_scalar("SELECT name FROM sqlite_schema")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(names, ["business"]);
    // Migrated once, migrate(false) opens it and can write.
    SqliteLedger::connect(&url).await.unwrap();
    let ledger = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().migrate(false))
        .await
        .unwrap();
    assert!(!ledger.is_read_only());
    assert!(matches!(
        ledger
            .claim(&key("order-mf"), &ClaimOptions::default())
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
}

/// `FromUrl` opens `sqlite:` URLs as the access asks: only `Migrate`
/// creates the file; `Existing` opens it to write (as `migrate(false)`);
/// `ReadOnly` reads and refuses writes; `connect_timeout` is the busy
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_url_opens_with_the_access_asked_for() {
    assert_eq!(SqliteLedger::SCHEMES, ["sqlite"]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("from-url.db");
    let url = format!("sqlite:{}", path.display());
    let open = |access| SqliteLedger::from_url(&url, OpenOptions::new(access));
    for access in [Access::Existing, Access::ReadOnly] {
        config(open(access).await.unwrap_err(), "no SQLite database at");
        assert!(!path.exists(), "{access:?} created the file");
    }
    let migrated = open(Access::Migrate).await.unwrap();
    assert!(path.exists());
    assert!(!migrated.is_read_only());
    let k = key("order-from-url");
    let Claim::Acquired(l) = migrated.claim(&k, &ClaimOptions::default()).await.unwrap() else {
        panic!("fresh key not acquired")
    };
    migrated
        .complete(&l, &Outcome::from_json(&"done").unwrap())
        .await
        .unwrap();
    let existing = open(Access::Existing).await.unwrap();
    assert!(!existing.is_read_only());
    assert!(matches!(
        existing
            .claim(&key("order-existing"), &ClaimOptions::default())
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
    let reader = open(Access::ReadOnly).await.unwrap();
    assert!(reader.is_read_only());
    assert_eq!(
        reader.get(&k).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed)
    );
    config(
        reader
            .claim(&key("order-read-only"), &ClaimOptions::default())
            .await
            .unwrap_err(),
        "read-only",
    );

    // The write lock is held for 2 s: a claim through a 50 ms connect
    // timeout gives up with a retryable error, where the default 5 s busy
    // timeout would wait and acquire.
    let quick = SqliteLedger::from_url(
        &url,
        OpenOptions::new(Access::Existing).connect_timeout(Duration::from_millis(50)),
    )
    .await
    .unwrap();
    let holder = migrated.begin().await.unwrap();
    let released = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        holder.rollback().await.unwrap();
    });
    let e = quick
        .claim(&key("order-quick"), &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Backend { retryable: true, .. }), "{e:?}");
    released.await.unwrap();
    assert!(quick.get(&key("order-quick")).await.unwrap().is_none());
}
