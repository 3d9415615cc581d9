//! `SqliteLedger::from_url` (`oncely::open::FromUrl`): the URL names the
//! table (`?table=`), and a query parameter neither the ledger nor SQLite
//! reads is refused by name before anything opens.

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::fresh_tenant;
use oncely::open::{Access, FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions};

/// A ledger the application opened with `SqliteLedgerOptions::table(..)`
/// is the one `?table=` opens, for every access (next to SQLite's own
/// `mode=`), and the default URL opens another (the default table, without
/// the record). `connect_with` reads it too, over its options'. The ledger
/// says what it reads.
#[tokio::test]
async fn the_url_names_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let url = format!("sqlite:{}", path.display());
    let app = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().table("billing_effects"))
        .await
        .unwrap();
    let done = EffectKey::new(&fresh_tenant(), "capture", "in-billing").unwrap();
    let Claim::Acquired(lease) = app.claim(&done, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    app.complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();

    for (named, access) in [
        (format!("{url}?table=billing_effects"), Access::ReadOnly),
        (format!("{url}?mode=ro&table=billing_effects"), Access::ReadOnly),
        (format!("{url}?table=billing_effects"), Access::Existing),
        (
            format!("sqlite://{}?table=billing_effects&mode=rwc", path.display()),
            Access::Migrate,
        ),
    ] {
        let l = SqliteLedger::from_url(&named, OpenOptions::new(access))
            .await
            .unwrap();
        let r = l.get(&done).await.unwrap();
        assert_eq!(
            r.map(|r| r.state),
            Some(RecordState::Completed),
            "{named} {access:?}"
        );
        let shown = l.to_string();
        assert!(shown.starts_with("sqlite "), "{shown}");
        assert!(shown.contains("app.db"), "{shown}");
        assert!(shown.ends_with(", table billing_effects"), "{shown}");
    }
    let l = SqliteLedger::connect_with(
        &format!("{url}?table=billing_effects"),
        SqliteLedgerOptions::default().table("from_code").read_only(true),
    )
    .await
    .unwrap();
    assert!(l.get(&done).await.unwrap().is_some());

    let default = SqliteLedger::from_url(&url, OpenOptions::new(Access::Migrate))
        .await
        .unwrap();
    assert!(default.get(&done).await.unwrap().is_none());
    assert!(
        default.to_string().ends_with(", table oncely_effects"),
        "{default}"
    );
}

/// A mistyped or unknown parameter, a duplicate one and a table name that
/// is not an identifier are configuration errors naming what is wrong,
/// for every access, and no file is created.
#[tokio::test]
async fn unknown_or_bad_url_parameters_are_refused_before_opening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("never.db");
    for (query, says) in [
        (
            "tabel=effects",
            "unknown SQLite URL parameter 'tabel' (expected table, or one its driver reads: mode, cache, immutable, vfs)",
        ),
        ("mode=rwc&prefix=x", "unknown SQLite URL parameter 'prefix'"),
        ("table=a&table=b", "SQLite URL parameter table is given twice"),
        ("table=a-b", "a-b"),
    ] {
        let url = format!("sqlite:{}?{query}", path.display());
        for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
            match SqliteLedger::from_url(&url, OpenOptions::new(access)).await {
                Err(Error::Config(m)) => assert!(m.contains(says), "{query} {access:?}: {m}"),
                Err(e) => panic!("{query} {access:?}: {e:?}"),
                Ok(_) => panic!("{query} {access:?} opened"),
            }
        }
    }
    assert!(!path.exists());
}

/// `from_pool_with` takes the table, `read_only` and `multi_process` from
/// the options over a pool made elsewhere: it reads the ledger the options
/// name, and a read-only one refuses writes.
#[tokio::test]
async fn a_pool_with_options_opens_the_table_they_name() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("app.db").display());
    let options = SqliteLedgerOptions::default().table("billing_effects");
    let app = SqliteLedger::connect_with(&url, options.clone()).await.unwrap();
    let done = EffectKey::new(&fresh_tenant(), "capture", "from-pool").unwrap();
    let Claim::Acquired(lease) = app.claim(&done, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key")
    };
    app.complete(&lease, &Outcome::from_json(&"ch_1").unwrap())
        .await
        .unwrap();

    let reader = SqliteLedger::from_pool_with(app.pool().clone(), options.read_only(true)).unwrap();
    assert_eq!(reader.table(), "billing_effects");
    assert!(reader.is_read_only());
    reader.verify().await.unwrap();
    let r = reader.get(&done).await.unwrap();
    assert_eq!(r.map(|r| r.state), Some(RecordState::Completed));
    let other = EffectKey::new(&fresh_tenant(), "capture", "refused").unwrap();
    assert!(matches!(
        reader.claim(&other, &ClaimOptions::default()).await,
        Err(Error::Config(_))
    ));
    assert!(matches!(
        SqliteLedger::from_pool_with(app.pool().clone(), SqliteLedgerOptions::default().table("a-b")),
        Err(Error::Config(_))
    ));
}
