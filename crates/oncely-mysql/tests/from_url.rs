//! `FromUrl`: the one way a tool opens this backend from a URL. Each
//! `Access` does what it says to the tables (on a database of its own, so
//! "nothing created" can be checked), the connect timeout becomes the pool's
//! acquire timeout, the URL's `?table=` names the table, and a malformed
//! URL or an unknown parameter is `Error::Config` before anything connects,
//! without quoting the URL.

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_mysql::MySqlLedger;
use sqlx::{Executor, MySqlPool};

fn url() -> Option<String> {
    service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))
}

/// `url` naming database `db` instead of its own (query parameters kept).
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let (scheme, rest) = base.split_once("://").expect("a URL with ://");
    let authority = rest.split('/').next().unwrap_or(rest);
    let mut out = format!("{scheme}://{authority}/{db}");
    if let Some(q) = query {
        out = format!("{out}?{q}");
    }
    out
}

async fn tables(admin: &MySqlPool, db: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = ?")
        .bind(db)
        .fetch_one(admin)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_access_does_what_it_says() {
    let Some(url) = url() else { return };
    let admin = match sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
    {
        Ok(p) => p,
        Err(e) => return skip_or_fail(&format!("MySQL at {url}: {e}")).unwrap_or(()),
    };
    let db = format!("oncely_from_url_{}", std::process::id());
    admin
        .execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS `{db}`")))
        .await
        .unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{db}`")))
        .await
        .unwrap();
    let db_url = with_database(&url, &db);

    // An empty database: Existing and ReadOnly refuse it, naming the
    // missing table, and create nothing.
    for access in [Access::Existing, Access::ReadOnly] {
        let e = MySqlLedger::from_url(&db_url, OpenOptions::new(access))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{access:?}: {e:?}");
        assert!(e.to_string().contains("does not exist"), "{access:?}: {e}");
        assert_eq!(tables(&admin, &db).await, 0, "{access:?} created a table");
    }

    // Migrate creates the tables; the connect timeout is the pool's
    // acquire timeout.
    let migrated = MySqlLedger::from_url(
        &db_url,
        OpenOptions::new(Access::Migrate).connect_timeout(Duration::from_secs(5)),
    )
    .await
    .unwrap();
    assert!(!migrated.is_read_only());
    assert_eq!(
        migrated.pool().options().get_acquire_timeout(),
        Duration::from_secs(5)
    );
    assert!(tables(&admin, &db).await >= 2, "the ledger and horizon tables");
    let k = EffectKey::new(&fresh_tenant(), "capture", "from-url").unwrap();
    let Claim::Acquired(lease) = migrated.claim(&k, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    migrated
        .complete(&lease, &Outcome::from_json(&"done").unwrap())
        .await
        .unwrap();

    // Existing opens what exists and writes; `mariadb://` names the same
    // server. Without a connect timeout the pool keeps the default.
    let existing = MySqlLedger::from_url(
        &db_url.replacen("mysql://", "mariadb://", 1),
        OpenOptions::new(Access::Existing),
    )
    .await
    .unwrap();
    assert!(!existing.is_read_only());
    assert_eq!(
        existing.pool().options().get_acquire_timeout(),
        Duration::from_secs(30)
    );
    let k2 = EffectKey::new(k.tenant(), "capture", "from-url-2").unwrap();
    assert!(matches!(
        existing.claim(&k2, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));

    // ReadOnly reads and refuses writes before any round trip; its sessions
    // are read-only too.
    let reader = MySqlLedger::from_url(&db_url, OpenOptions::new(Access::ReadOnly))
        .await
        .unwrap();
    assert!(reader.is_read_only());
    assert_eq!(
        reader.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    let e = reader.claim(&k2, &ClaimOptions::default()).await.unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    let e = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM `{db}`.`{}`",
        oncely_mysql::DEFAULT_TABLE
    )))
    .execute(reader.pool())
    .await
    .unwrap_err();
    assert!(e.to_string().contains("READ ONLY"), "{e}");

    for l in [migrated, existing, reader] {
        l.pool().close().await;
    }
    admin
        .execute(sqlx::AssertSqlSafe(format!("DROP DATABASE `{db}`")))
        .await
        .unwrap();
}

/// Malformed URLs and other backends' schemes fail with `Config` before
/// anything connects (the hosts below do not resolve), and the message
/// never quotes the password.
#[tokio::test]
async fn malformed_url_is_config() {
    assert_eq!(MySqlLedger::SCHEMES, ["mysql", "mariadb"]);
    for bad in [
        "postgres://root:s3cret@db.invalid/test",
        "redis://:s3cret@db.invalid",
        "root:s3cret@db.invalid/test",
        "mysql://root:s3cret@db.invalid:99999/test",
        "mysql://root:s3cret@db.invalid:port/test",
        "mysql://root:s3cret@[::1/test",
        "mariadb://root:s3cret@db.invalid/test?ssl-mode=sometimes",
        "",
    ] {
        for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
            let e = MySqlLedger::from_url(bad, OpenOptions::new(access))
                .await
                .unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad:?}: {e:?}");
            assert!(!e.to_string().contains("s3cret"), "{e}");
        }
    }
}

/// `url` with `query` appended (after its own query, if any).
fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// The URL names the table: a ledger the application opened with
/// `MySqlLedgerOptions::table(..)` is the one `?table=` opens, for every
/// access, in the URL's database (MySQL's schema), and the default URL
/// opens another (the default table, without the record). `connect_with`
/// reads it too, over its options'. The ledger says what it reads, without
/// the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_names_the_table() {
    let Some(url) = url() else { return };
    let table = format!("oncely_url_{}", std::process::id());
    let app = match MySqlLedger::connect_with(&url, oncely_mysql::MySqlLedgerOptions::default().table(&table))
        .await
    {
        Ok(l) => l,
        Err(e) => return skip_or_fail(&format!("MySQL at {url}: {e}")).unwrap_or(()),
    };
    let done = EffectKey::new(&fresh_tenant(), "capture", "in-table").unwrap();
    let Claim::Acquired(lease) = app.claim(&done, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    app.complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();

    let named = with_query(&url, &format!("table={table}"));
    for access in [Access::ReadOnly, Access::Existing, Access::Migrate] {
        let l = MySqlLedger::from_url(&named, OpenOptions::new(access))
            .await
            .unwrap();
        let r = l.get(&done).await.unwrap();
        assert_eq!(r.map(|r| r.state), Some(RecordState::Completed), "{access:?}");
        let shown = l.to_string();
        assert!(shown.starts_with("mysql "), "{shown}");
        assert!(shown.ends_with(&format!(", table {table}")), "{shown}");
        l.pool().close().await;
    }
    // The URL wins over the options of connect_with.
    let l = MySqlLedger::connect_with(
        &named,
        oncely_mysql::MySqlLedgerOptions::default()
            .table("from_code")
            .read_only(true),
    )
    .await
    .unwrap();
    assert_eq!(
        l.get(&done).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed)
    );
    l.pool().close().await;

    let default = MySqlLedger::from_url(&url, OpenOptions::new(Access::Migrate))
        .await
        .unwrap();
    assert!(default.get(&done).await.unwrap().is_none());
    let shown = default.to_string();
    assert!(
        shown.ends_with(&format!(", table {}", oncely_mysql::DEFAULT_TABLE)),
        "{shown}"
    );
    assert!(!shown.contains('@'), "{shown}");
    default.pool().close().await;

    for t in [
        format!("{table}_horizon"),
        format!("{table}_outbox"),
        table.clone(),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{t}`")))
            .execute(app.pool())
            .await
            .unwrap();
    }
    app.pool().close().await;
}

/// A query parameter neither the ledger nor sqlx reads (sqlx alone would
/// ignore it and open the default table; `?schema=` included: the schema is
/// the URL's database), a duplicate one, and a table that is not an
/// identifier are configuration errors naming the parameter, before
/// anything connects (port 1 is closed), without the password.
#[tokio::test]
async fn unknown_or_bad_url_parameters_are_refused_before_connecting() {
    let base = "mysql://root:s3cret@127.0.0.1:1/test";
    for (query, says) in [
        (
            "tabel=effects",
            "unknown MySQL URL parameter 'tabel' (expected table, or one its driver reads: sslmode,",
        ),
        ("schema=billing", "unknown MySQL URL parameter 'schema'"),
        ("ssl-mod=disabled", "unknown MySQL URL parameter 'ssl-mod'"),
        ("table=a&table=b", "MySQL URL parameter table is given twice"),
        ("table=a-b", "table name \"a-b\" must be an identifier"),
        ("table=", "table name \"\" must be an identifier"),
    ] {
        let url = format!("{base}?{query}");
        for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
            match MySqlLedger::from_url(&url, OpenOptions::new(access)).await {
                Err(Error::Config(m)) => {
                    assert!(m.contains(says), "{query} {access:?}: {m}");
                    assert!(!m.contains("s3cret"), "{query} {access:?}: {m}");
                }
                Err(e) => panic!("{query} {access:?}: {e:?}"),
                Ok(_) => panic!("{query} {access:?} opened"),
            }
        }
    }
    // sqlx's own parameters still reach it (and port 1 is then tried).
    let e = MySqlLedger::from_url(
        &format!("{base}?ssl-mode=disabled&table=effects"),
        OpenOptions::new(Access::ReadOnly).connect_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
}
