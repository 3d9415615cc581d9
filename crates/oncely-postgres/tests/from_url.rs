//! `PgLedger::from_url` (`oncely::open::FromUrl`): each `Access`, the
//! connect timeout, the table the URL names (`?schema=&table=`), and URLs
//! refused before anything connects.
//!
//! `from_url` opens the default table, `public.oncely_effects`; the test
//! works in a database of its own (created and dropped here) so that the
//! table is its alone and "creates nothing" can be checked.

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_postgres::PgLedger;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

fn url() -> Option<String> {
    service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )
}

async fn pool(url: &str) -> Option<PgPool> {
    match PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
    {
        Ok(p) => Some(p),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

/// `url` naming the database `db` instead of its own, with `scheme`.
fn with_database(url: &str, scheme: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let (_, rest) = base.split_once("://").expect("a URL");
    let authority = rest.split('/').next().unwrap_or(rest);
    format!("{scheme}://{authority}/{db}{query}")
}

async fn drop_database(admin: &PgPool, db: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(admin)
    .await
    .unwrap();
}

/// Whether a relation (`schema.name`) exists.
async fn exists(pool: &PgPool, relation: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(relation)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn key(subject: &str) -> EffectKey {
    EffectKey::new(&fresh_tenant(), "capture", subject).unwrap()
}

/// `Existing` and `ReadOnly` refuse a database without the ledger and create
/// nothing in it; `Migrate` creates it (through a `postgresql://` URL);
/// then `Existing` opens it and writes, and `ReadOnly` reads, refuses to
/// write (its sessions read-only on the server too) and waits for a
/// connection no longer than its connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn from_url_honours_each_access() {
    let Some(url) = url() else { return };
    let Some(admin) = pool(&url).await else { return };
    let db = format!("oncely_from_url_{}", std::process::id());
    drop_database(&admin, &db).await;
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&admin)
        .await
        .unwrap();
    let db_url = with_database(&url, "postgres", &db);
    let observer = pool(&db_url).await.unwrap();
    assert_eq!(PgLedger::SCHEMES, ["postgres", "postgresql"]);

    for access in [Access::Existing, Access::ReadOnly] {
        let e = PgLedger::from_url(&db_url, OpenOptions::new(access))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains("table public.oncely_effects does not exist")),
            "{access:?}: {e:?}"
        );
        for relation in [
            "public.oncely_effects",
            "public.oncely_effects_horizon",
            "public.oncely_effects_migrations",
        ] {
            assert!(
                !exists(&observer, relation).await,
                "{access:?} created {relation}"
            );
        }
    }

    let migrated = PgLedger::from_url(
        &with_database(&url, "postgresql", &db),
        OpenOptions::new(Access::Migrate),
    )
    .await
    .unwrap();
    assert!(exists(&observer, "public.oncely_effects").await);
    assert!(exists(&observer, "public.oncely_effects_horizon").await);
    let done = key("done");
    let outcome = Outcome::from_json(&"captured").unwrap();
    match migrated.claim(&done, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => migrated.complete(&l, &outcome).await.unwrap(),
        other => panic!("{other:?}"),
    }

    let existing = PgLedger::from_url(&db_url, OpenOptions::new(Access::Existing))
        .await
        .unwrap();
    assert!(matches!(
        existing
            .claim(&key("other"), &ClaimOptions::default())
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));

    let timeout = Duration::from_millis(1500);
    let read_only = PgLedger::from_url(
        &db_url,
        OpenOptions::new(Access::ReadOnly).connect_timeout(timeout),
    )
    .await
    .unwrap();
    assert_eq!(read_only.pool().options().get_acquire_timeout(), timeout);
    let r = read_only.get(&done).await.unwrap().unwrap();
    assert_eq!((r.state, r.outcome), (RecordState::Completed, Some(outcome)));
    let fresh = key("fresh");
    let e = read_only
        .claim(&fresh, &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(read_only.get(&fresh).await.unwrap().is_none());
    let server: String = sqlx::query_scalar("SHOW default_transaction_read_only")
        .fetch_one(read_only.pool())
        .await
        .unwrap();
    assert_eq!(server, "on");
    // The defaults, where no connect timeout is given.
    assert_eq!(
        existing.pool().options().get_acquire_timeout(),
        Duration::from_secs(5)
    );

    for ledger in [migrated, existing, read_only] {
        ledger.pool().close().await;
    }
    observer.close().await;
    drop_database(&admin, &db).await;
}

/// A malformed URL, or one of another scheme, is a configuration error for
/// every access, before anything connects (port 1 is closed: a connection
/// attempt would be `Unavailable`), and the message does not quote the
/// password.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn from_url_refuses_a_malformed_url() {
    for bad in [
        "postgres://app:s3cret@127.0.0.1:notaport/test",
        "postgres://app:s3cret@127.0.0.1:1/test?sslmode=sometimes",
        "mysql://app:s3cret@127.0.0.1:1/test",
        "app:s3cret@127.0.0.1:1/test",
        "",
    ] {
        for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
            match PgLedger::from_url(bad, OpenOptions::new(access)).await {
                Err(Error::Config(m)) => assert!(!m.contains("s3cret"), "{bad} {access:?}: {m}"),
                Err(e) => panic!("{bad} {access:?}: {e:?}"),
                Ok(_) => panic!("{bad} {access:?} opened"),
            }
        }
    }
}

/// `url` with `query` appended (after its own query, if any).
fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// The URL names the table: a ledger the application opened with
/// `PgLedgerOptions::schema(..).table(..)` is the one `?schema=&table=`
/// opens, for every access, and the default URL opens another (the default
/// table, without the record). `connect_with` reads them too, over its
/// options'. The ledger says what it reads, without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_url_names_the_schema_and_the_table() {
    let Some(url) = url() else { return };
    let Some(admin) = pool(&url).await else { return };
    let schema = format!("oncely_url_{}", std::process::id());
    let drop_schema = format!("DROP SCHEMA IF EXISTS {schema} CASCADE");
    sqlx::raw_sql(AssertSqlSafe(drop_schema.clone()))
        .execute(&admin)
        .await
        .unwrap();
    let app = PgLedger::connect_with(
        &url,
        oncely_postgres::PgLedgerOptions::default()
            .schema(schema.clone())
            .table("effects"),
    )
    .await
    .unwrap();
    let done = key("in-billing");
    match app.claim(&done, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => app
            .complete(&l, &Outcome::from_json(&"ch_1").unwrap())
            .await
            .unwrap(),
        other => panic!("{other:?}"),
    }

    let named = with_query(&url, &format!("schema={schema}&table=effects"));
    for access in [Access::ReadOnly, Access::Existing, Access::Migrate] {
        let l = PgLedger::from_url(&named, OpenOptions::new(access))
            .await
            .unwrap();
        assert_eq!(l.table(), (schema.as_str(), "effects"), "{access:?}");
        let r = l.get(&done).await.unwrap();
        assert_eq!(r.map(|r| r.state), Some(RecordState::Completed), "{access:?}");
        let shown = l.to_string();
        assert!(shown.starts_with("postgres "), "{shown}");
        assert!(shown.ends_with(&format!(", table {schema}.effects")), "{shown}");
        l.pool().close().await;
    }
    // The URL wins over the options of connect_with.
    let l = PgLedger::connect_with(
        &named,
        oncely_postgres::PgLedgerOptions::default()
            .table("from_code")
            .read_only(true),
    )
    .await
    .unwrap();
    assert_eq!(l.table(), (schema.as_str(), "effects"));
    l.pool().close().await;

    let default = PgLedger::from_url(&url, OpenOptions::new(Access::Migrate))
        .await
        .unwrap();
    assert_eq!(default.table(), ("public", "oncely_effects"));
    assert!(default.get(&done).await.unwrap().is_none());
    assert!(
        default.to_string().ends_with(", table public.oncely_effects"),
        "{default}"
    );
    default.pool().close().await;

    app.pool().close().await;
    sqlx::raw_sql(AssertSqlSafe(drop_schema))
        .execute(&admin)
        .await
        .unwrap();
}

/// A query parameter neither the ledger nor sqlx reads (sqlx alone would
/// log it and open the default table), a duplicate one, and a table or
/// schema that is not a plain identifier are configuration errors naming
/// the parameter, before anything connects (port 1 is closed), without the
/// password.
#[tokio::test]
async fn unknown_or_bad_url_parameters_are_refused_before_connecting() {
    let base = "postgres://app:s3cret@127.0.0.1:1/test";
    for (query, says) in [
        (
            "tabel=effects",
            "unknown PostgreSQL URL parameter 'tabel' (expected schema, table, target_session_attrs, or one its driver reads: sslmode,",
        ),
        ("schema=billing&tabel=effects", "parameter 'tabel'"),
        ("sslmod=disable", "unknown PostgreSQL URL parameter 'sslmod'"),
        ("table=a&table=b", "PostgreSQL URL parameter table is given twice"),
        (
            "table=Effects",
            "table name \"Effects\" is not a plain identifier",
        ),
        (
            "schema=bill-ing",
            "schema name \"bill-ing\" is not a plain identifier",
        ),
        ("table=a;drop", "table name \"a;drop\" is not a plain identifier"),
    ] {
        let url = format!("{base}?{query}");
        for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
            match PgLedger::from_url(&url, OpenOptions::new(access)).await {
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
    let e = PgLedger::from_url(
        &format!("{base}?sslmode=disable&application_name=oncely&table=effects"),
        OpenOptions::new(Access::ReadOnly).connect_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
}
