//! The schema the ledger relies on: a table someone else created is checked
//! (and refused when it cannot hold a ledger), a read-only role reads
//! without creating or migrating anything, and a schema made by the first
//! release (version 1) migrates cleanly.
//!
//! Every test works in a schema of its own, dropped at its start and end.

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::{fresh_tenant, prune_until_gone, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::AssertSqlSafe;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

fn url() -> Option<String> {
    service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )
}

async fn admin(url: &str) -> Option<PgPool> {
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

/// A schema name unique to this test and process, dropped if a previous run
/// left it behind.
async fn fresh_schema(admin: &PgPool, label: &str) -> String {
    let schema = format!("oncely_t_{label}_{}", std::process::id());
    drop_schema(admin, &schema).await;
    schema
}

async fn drop_schema(admin: &PgPool, schema: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {schema} CASCADE")))
        .execute(admin)
        .await
        .unwrap();
}

/// Whether a relation (`schema.name`) exists.
async fn exists(admin: &PgPool, relation: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(relation)
        .fetch_one(admin)
        .await
        .unwrap()
}

async fn schema_exists(admin: &PgPool, schema: &str) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(schema)
        .fetch_one(admin)
        .await
        .unwrap()
}

fn options(schema: &str) -> PgLedgerOptions {
    PgLedgerOptions::default().schema(schema).max_connections(2)
}

fn key(subject: &str) -> EffectKey {
    EffectKey::new(&fresh_tenant(), "capture", subject).unwrap()
}

/// The columns of a correct ledger table as schema version 1 has them
/// (the migrations add `claim_token`), without any key; `{t}` is the
/// table.
const COLUMNS: &str = "key text NOT NULL, tenant text NOT NULL, kind text NOT NULL, subject text NOT NULL, \
     state text NOT NULL, fence bigint NOT NULL, fingerprint bytea, outcome bytea, \
     at_most_once boolean NOT NULL, created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL, \
     lease_expires_at timestamptz, retain_until timestamptz NOT NULL, retention_us bigint NOT NULL";

fn table_with(schema: &str, columns: &str, extra: &str) -> String {
    format!("CREATE SCHEMA {schema}; CREATE TABLE {schema}.oncely_effects ({columns}{extra})")
}

/// Each table below was created by someone else under the ledger's name.
/// Connecting (which migrates) and connecting without migrations both
/// refuse it with a configuration error that names the table and what is
/// wrong, and the refused migration leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tables_the_ledger_cannot_rely_on_are_refused() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "bad").await;
    let cases = [
        (
            "no unique key",
            COLUMNS.to_owned(),
            "",
            "no primary key or unique index on exactly (key)",
        ),
        (
            "a unique key on more than the key",
            COLUMNS.to_owned(),
            ", UNIQUE (key, tenant)",
            "no primary key or unique index on exactly (key)",
        ),
        (
            "a deferrable primary key (ON CONFLICT cannot use it)",
            COLUMNS.to_owned(),
            ", PRIMARY KEY (key) DEFERRABLE",
            "no primary key or unique index on exactly (key)",
        ),
        (
            "a missing column",
            COLUMNS.replace(" lease_expires_at timestamptz,", ""),
            ", PRIMARY KEY (key)",
            "column lease_expires_at is missing",
        ),
        (
            "a fence too small for the clock's microseconds",
            COLUMNS.replace("fence bigint", "fence integer"),
            ", PRIMARY KEY (key)",
            "column fence is integer, expected bigint",
        ),
        (
            "a timestamp without time zone",
            COLUMNS.replace("retain_until timestamptz", "retain_until timestamp"),
            ", PRIMARY KEY (key)",
            "column retain_until is timestamp without time zone, expected timestamptz",
        ),
        (
            "a claim token column that cannot hold the token",
            format!("{COLUMNS}, claim_token text"),
            ", PRIMARY KEY (key)",
            "column claim_token is text, expected bytea",
        ),
        (
            "a required column the ledger does not write",
            format!("{COLUMNS}, owner text NOT NULL"),
            ", PRIMARY KEY (key)",
            "column owner is NOT NULL without a default",
        ),
    ];
    for (what, columns, extra, problem) in cases {
        drop_schema(&admin, &schema).await;
        sqlx::raw_sql(AssertSqlSafe(table_with(&schema, &columns, extra)))
            .execute(&admin)
            .await
            .unwrap();
        for opts in [options(&schema), options(&schema).migrate(false)] {
            let e = PgLedger::connect_with(&url, opts.clone())
                .await
                .map(|_| ())
                .unwrap_err();
            let Error::Config(message) = &e else {
                panic!("{what}: {e:?}")
            };
            assert!(
                message.contains(&format!("{schema}.oncely_effects")) && message.contains(problem),
                "{what}: {message}"
            );
        }
        // The refused migration rolled back: no migrations table, no horizon.
        assert!(
            !exists(&admin, &format!("{schema}.oncely_effects_migrations")).await,
            "{what}"
        );
        assert!(
            !exists(&admin, &format!("{schema}.oncely_effects_horizon")).await,
            "{what}"
        );
    }
    drop_schema(&admin, &schema).await;
}

/// A key column under a case-insensitive (nondeterministic) ICU collation:
/// the ledger would let `Order-Acme` and `order-acme`, two effects, share one
/// record (the second gets the first's outcome and never runs). Shown on a
/// ledger that skips the check, then refused by the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_case_insensitive_key_is_refused() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "ci").await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA {schema}; \
         CREATE COLLATION {schema}.ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false); \
         CREATE TABLE {schema}.oncely_effects ({}, claim_token bytea, watched boolean, PRIMARY KEY (key)); \
         CREATE FUNCTION {schema}.oncely_effects_current(p_keys text[]) \
           RETURNS TABLE (key text, state text, fence bigint, fingerprint bytea, outcome bytea, \
             at_most_once boolean, created_at timestamptz, updated_at timestamptz, \
             lease_expires_at timestamptz, retain_until timestamptz, claim_token bytea, row_xmin xid) \
           LANGUAGE sql VOLATILE AS $f$ SELECT e.key, e.state, e.fence, e.fingerprint, e.outcome, \
             e.at_most_once, e.created_at, e.updated_at, e.lease_expires_at, e.retain_until, \
             e.claim_token, e.xmin FROM {schema}.oncely_effects e WHERE e.key = ANY(p_keys) $f$",
        COLUMNS.replace(
            "key text NOT NULL",
            &format!("key text COLLATE {schema}.ci NOT NULL")
        )
    )))
    .execute(&admin)
    .await
    .unwrap();

    // What accepting it would do (from_pool_with runs no check; the claim's
    // read of the records, which the migrations would add, is written by
    // hand).
    let unchecked = PgLedger::from_pool_with(admin.clone(), options(&schema)).unwrap();
    let t = fresh_tenant();
    let upper = EffectKey::new(&t, "capture", "Order-Acme").unwrap();
    let lower = EffectKey::new(&t, "capture", "order-acme").unwrap();
    assert_ne!(upper, lower);
    let lease = match unchecked.claim(&upper, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    unchecked
        .complete(&lease, &Outcome::from_json(&"charged Acme").unwrap())
        .await
        .unwrap();
    // The other key reads the first one's record, and its claim is never
    // granted: the unique index holds one row for both. (The claim's read
    // of the records compares keys under the column's collation, its
    // answer under the statement's, so it finds the row but not its key,
    // and gives up after its attempts.)
    match unchecked.get(&lower).await.unwrap() {
        Some(r) => assert_eq!(
            r.outcome.unwrap().to_value::<String>().unwrap(),
            "charged Acme",
            "another effect's outcome"
        ),
        None => panic!("expected the shared record"),
    }
    match unchecked.claim(&lower, &ClaimOptions::default()).await {
        Ok(Claim::Acquired(_)) => panic!("two records under one unique index"),
        Ok(Claim::Completed(r)) => {
            assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "charged Acme")
        }
        Ok(other) => panic!("{other:?}"),
        Err(e) => assert!(e.to_string().contains("did not settle"), "{e}"),
    }

    for opts in [options(&schema), options(&schema).migrate(false)] {
        let e = PgLedger::connect_with(&url, opts).await.map(|_| ()).unwrap_err();
        let Error::Config(message) = &e else {
            panic!("{e:?}")
        };
        assert!(
            message.contains(&format!("{schema}.oncely_effects"))
                && message.contains("column key uses the nondeterministic collation")
                && message.contains("uses a nondeterministic collation"),
            "{message}"
        );
    }
    drop_schema(&admin, &schema).await;
}

/// A correct table created beforehand (with `varchar` keys and a column of
/// the application's own) is accepted: migrated, checked and used.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_correct_existing_table_is_accepted() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "good").await;
    sqlx::raw_sql(AssertSqlSafe(table_with(
        &schema,
        &COLUMNS.replace("key text", "key varchar(300)"),
        ", note text, PRIMARY KEY (key)",
    )))
    .execute(&admin)
    .await
    .unwrap();
    // Not migrated yet: the claim token's column (schema version 3) and
    // the horizon are missing, and migrate(false) says so.
    let e = PgLedger::connect_with(&url, options(&schema).migrate(false))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config(m) if m.contains(&format!("{schema}.oncely_effects"))
            && m.contains("column claim_token is missing (schema version 3 adds it")
            && m.contains("oncely migrate")),
        "{e:?}"
    );
    let ledger = PgLedger::connect_with(&url, options(&schema)).await.unwrap();
    let k = key("existing-table");
    let l = match ledger.claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    ledger.verify().await.unwrap();
    PgLedger::connect_with(&url, options(&schema).migrate(false))
        .await
        .unwrap()
        .pool()
        .close()
        .await;
    ledger.pool().close().await;
    drop_schema(&admin, &schema).await;
}

/// Without migrations (`migrate(false)`, or `read_only`), connecting creates
/// nothing: a missing schema stays missing, and the error says what to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connect_without_migrations_creates_nothing() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "none").await;
    for opts in [
        options(&schema).migrate(false),
        options(&schema).read_only(true),
        options(&schema).read_only(true).migrate(true),
    ] {
        let e = PgLedger::connect_with(&url, opts.clone())
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(&e, Error::Config(m) if m.contains(&format!("table {schema}.oncely_effects does not exist"))
                && m.contains("oncely migrate")),
            "{opts:?}: {e:?}"
        );
        assert!(
            !schema_exists(&admin, &schema).await,
            "{opts:?} created the schema"
        );
    }
    // Migrated once, a connect without migrations records nothing more.
    PgLedger::connect_with(&url, options(&schema))
        .await
        .unwrap()
        .pool()
        .close()
        .await;
    let migrations = format!("SELECT count(*) FROM {schema}.oncely_effects_migrations");
    let before: i64 = sqlx::query_scalar(AssertSqlSafe(migrations.clone()))
        .fetch_one(&admin)
        .await
        .unwrap();
    let ledger = PgLedger::connect_with(&url, options(&schema).migrate(false))
        .await
        .unwrap();
    let after: i64 = sqlx::query_scalar(AssertSqlSafe(migrations))
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!((before, after), (6, 6));
    // It is an ordinary ledger otherwise.
    assert!(matches!(
        ledger
            .claim(&key("no-migrate"), &ClaimOptions::default())
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
    ledger.pool().close().await;
    drop_schema(&admin, &schema).await;
}

/// `url` with its user replaced by `user` (and no password).
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{host}")
}

/// A role that may only SELECT (and use the schema) cannot connect with the
/// default options (they migrate), and connects read-only: `get`,
/// `abandoned` and `horizon` work, its sessions are read-only on the server,
/// and the ledger refuses to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_select_only_role_reads_read_only() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "ro").await;
    let role = format!("oncely_reader_{}", std::process::id());
    let drop_role = format!(
        "DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN \
           EXECUTE 'DROP OWNED BY {role}'; EXECUTE 'DROP ROLE {role}'; END IF; END $$"
    );
    sqlx::raw_sql(AssertSqlSafe(drop_role.clone()))
        .execute(&admin)
        .await
        .unwrap();

    // The owner migrates and writes: a completed record, an abandoned
    // at-most-once step, and a pruned record (a horizon).
    let owner = PgLedger::connect_with(&url, options(&schema)).await.unwrap();
    let t = fresh_tenant();
    let done = EffectKey::new(&t, "capture", "done").unwrap();
    let l = match owner.claim(&done, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    owner
        .complete(&l, &Outcome::from_json(&"ok").unwrap())
        .await
        .unwrap();
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(200));
    let stuck = EffectKey::new(&t, "receipt", "stuck").unwrap();
    assert!(matches!(
        owner
            .claim(&stuck, &brief.clone().at_most_once(true))
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
    let gone = EffectKey::new(&t, "capture", "gone").unwrap();
    let l = match owner.claim(&gone, &brief).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    owner
        .complete(&l, &Outcome::from_json(&"old").unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    prune_until_gone(&owner, &gone).await;
    let horizon = owner.horizon(&t, "capture").await.unwrap().expect("a horizon");

    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {schema} TO {role}; \
         GRANT SELECT ON {schema}.oncely_effects, {schema}.oncely_effects_horizon TO {role}"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let reader_url = as_user(&url, &role);

    // The default options migrate, which this role may not do.
    let e = PgLedger::connect_with(&reader_url, options(&schema))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config(m) if m.contains("permission denied")),
        "{e:?}"
    );

    let reader = PgLedger::connect_with(&reader_url, options(&schema).read_only(true))
        .await
        .unwrap();
    let r = reader.get(&done).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "ok");
    let abandoned = reader.abandoned(&t, 10).await.unwrap();
    assert_eq!(abandoned.len(), 1);
    assert_eq!(abandoned[0].key, stuck);
    assert_eq!(reader.horizon(&t, "capture").await.unwrap(), Some(horizon));
    assert_eq!(reader.horizon(&t, "receipt").await.unwrap(), None);
    reader.verify().await.unwrap();

    // Its sessions are read-only on the server: even what the role may do
    // (a temporary table) is refused.
    let read_only: String = sqlx::query_scalar("SHOW default_transaction_read_only")
        .fetch_one(reader.pool())
        .await
        .unwrap();
    assert_eq!(read_only, "on");
    let e = sqlx::raw_sql("CREATE TEMP TABLE scratch (a int)")
        .execute(reader.pool())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("read-only transaction"), "{e}");
    // And the ledger refuses its writes before any round trip.
    let fresh = EffectKey::new(&t, "capture", "new").unwrap();
    for e in [
        reader
            .claim(&fresh, &ClaimOptions::default())
            .await
            .map(|_| ())
            .unwrap_err(),
        reader.prune(10).await.map(|_| ()).unwrap_err(),
        reader.migrate().await.unwrap_err(),
    ] {
        assert!(matches!(&e, Error::Config(m) if m.contains("read-only")), "{e:?}");
    }
    assert!(owner.get(&fresh).await.unwrap().is_none());

    reader.pool().close().await;
    owner.pool().close().await;
    drop_schema(&admin, &schema).await;
    sqlx::raw_sql(AssertSqlSafe(drop_role))
        .execute(&admin)
        .await
        .unwrap();
}

/// A ledger created by the first release (schema version 1, fences 1, 2…)
/// migrates to version 2 and goes on: its records answer as before, a
/// released record is taken over with a fence above its old one, and prune
/// now records a horizon.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_1_ledger_migrates() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "v1").await;
    let t = format!("{schema}.oncely_effects");
    // Exactly what version 1 ran.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {schema}; \
         CREATE TABLE IF NOT EXISTS {t}_migrations (\
           version integer PRIMARY KEY, description text NOT NULL, \
           applied_at timestamptz NOT NULL DEFAULT now()); \
         CREATE TABLE IF NOT EXISTS {t} (\
           key text PRIMARY KEY CHECK (octet_length(key) <= 255), \
           tenant text NOT NULL, \
           kind text NOT NULL, \
           subject text NOT NULL, \
           state text NOT NULL CHECK (state IN ('in_progress', 'completed', 'released')), \
           fence bigint NOT NULL CHECK (fence >= 1), \
           fingerprint bytea CHECK (octet_length(fingerprint) = 32), \
           outcome bytea CHECK (octet_length(outcome) <= 65536), \
           at_most_once boolean NOT NULL, \
           created_at timestamptz NOT NULL, \
           updated_at timestamptz NOT NULL, \
           lease_expires_at timestamptz, \
           retain_until timestamptz NOT NULL, \
           retention_us bigint NOT NULL CHECK (retention_us > 0)); \
         CREATE INDEX IF NOT EXISTS oncely_effects_prune_idx ON {t} (retain_until) \
           WHERE state IN ('completed', 'released'); \
         CREATE INDEX IF NOT EXISTS oncely_effects_abandoned_idx ON {t} (tenant, created_at) \
           WHERE state = 'in_progress' AND at_most_once; \
         INSERT INTO {t}_migrations (version, description) VALUES (1, 'effects table and indexes');"
    )))
    .execute(&admin)
    .await
    .unwrap();
    // Records as version 1 wrote them (fences from 1; times on the server's
    // clock).
    let tenant = fresh_tenant();
    let k = |s: &str| EffectKey::new(&tenant, "capture", s).unwrap();
    let (released, completed, expired, running) = (k("released"), k("completed"), k("expired"), k("running"));
    let row = |k: &EffectKey, state: &str, fence: i64, outcome: &str, lease: &str, retain: &str| {
        format!(
            "('{}', '{}', 'capture', '{}', '{state}', {fence}, {outcome}, false, now() - interval '1 hour', \
             now(), {lease}, now() + interval '{retain}', 86400000000)",
            k.as_str(),
            tenant.as_str(),
            k.subject()
        )
    };
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {t} (key, tenant, kind, subject, state, fence, outcome, at_most_once, created_at, \
           updated_at, lease_expires_at, retain_until, retention_us) VALUES {}, {}, {}, {}",
        row(&released, "released", 3, "NULL", "NULL", "1 day"),
        row(
            &completed,
            "completed",
            2,
            "convert_to('\"v1 outcome\"', 'UTF8')",
            "NULL",
            "1 day"
        ),
        row(
            &expired,
            "completed",
            1,
            "convert_to('1', 'UTF8')",
            "NULL",
            "-1 minute"
        ),
        row(
            &running,
            "in_progress",
            1,
            "NULL",
            "now() + interval '1 hour'",
            "1 day"
        ),
    )))
    .execute(&admin)
    .await
    .unwrap();

    let ledger = PgLedger::connect_with(&url, options(&schema)).await.unwrap();
    let versions: Vec<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {t}_migrations ORDER BY version"
    )))
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(versions, vec![1, 2, 3, 4, 5, 6]);
    match ledger.claim(&released, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => {
            assert!(l.taken_over());
            assert!(l.fence() > 3, "fence {} after 3", l.fence());
        }
        other => panic!("{other:?}"),
    }
    match ledger.claim(&completed, &ClaimOptions::default()).await.unwrap() {
        Claim::Completed(r) => {
            assert_eq!(r.fence, 2);
            assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "v1 outcome");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        ledger.claim(&running, &ClaimOptions::default()).await.unwrap(),
        Claim::InProgress { fence: 1, .. }
    ));
    // Prune records what it deleted; version 1 kept no horizon.
    assert_eq!(ledger.horizon(&tenant, "capture").await.unwrap(), None);
    let created = ledger.get(&expired).await.unwrap().unwrap().created_at;
    prune_until_gone(&ledger, &expired).await;
    assert_eq!(ledger.horizon(&tenant, "capture").await.unwrap(), Some(created));
    let e = ledger
        .claim(&expired, &ClaimOptions::default().sent_at(created))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    ledger.pool().close().await;
    drop_schema(&admin, &schema).await;
}

/// Prune never deletes a key while a claim holds the key's lock, even between
/// the claim's horizon check and its insert (where the claim holds no row
/// lock yet). The check is slowed down on purpose here (the function is
/// replaced by one that sleeps after checking) to hold that window open: a
/// prune that deleted the key in it would let an hour-old message insert the
/// key again, after its record was pruned, and run the effect twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prune_never_deletes_a_key_a_claim_is_deciding() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "window").await;
    let ledger = PgLedger::connect_with(&url, options(&schema).max_connections(4))
        .await
        .unwrap();
    let body: String = sqlx::query_scalar("SELECT pg_get_functiondef(to_regproc($1))")
        .bind(format!("{schema}.oncely_effects_beyond"))
        .fetch_one(&admin)
        .await
        .unwrap();
    let check = body
        .split_once("$function$")
        .and_then(|(_, rest)| rest.split_once("$function$"))
        .map(|(check, _)| check.trim().to_owned())
        .expect("the function's body");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE OR REPLACE FUNCTION {schema}.oncely_effects_beyond(p_tenant text, p_kind text, p_key text, \
           p_sent_us bigint) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $f$ \
         DECLARE r boolean; \
         BEGIN r := ({check}); PERFORM pg_sleep(0.6); RETURN r; END $f$"
    )))
    .execute(&admin)
    .await
    .unwrap();

    let k = key("deciding");
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(200));
    let l = match ledger.claim(&k, &brief).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    ledger
        .complete(&l, &Outcome::from_json(&"first").unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    // An hour-old replay: its claim finds the key present (not beyond the
    // horizon) and sleeps before its insert, holding the key's lock.
    let replay = {
        let (ledger, k) = (ledger.clone(), k.clone());
        let sent_at = std::time::SystemTime::now() - Duration::from_secs(3600);
        tokio::spawn(async move { ledger.claim(&k, &ClaimOptions::default().sent_at(sent_at)).await })
    };
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(!replay.is_finished());
    assert_eq!(
        ledger.prune(u64::MAX).await.unwrap(),
        0,
        "pruned a key a claim was deciding on"
    );
    match replay.await.unwrap().unwrap() {
        Claim::Completed(r) => assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "first"),
        other => panic!("the replay ran the effect again: {other:?}"),
    }
    // Once nobody holds the key, prune takes it and the replay is refused.
    prune_until_gone(&ledger, &k).await;
    let e = ledger
        .claim(
            &k,
            &ClaimOptions::default().sent_at(std::time::SystemTime::now() - Duration::from_secs(3600)),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BeyondHorizon { .. }), "{e:?}");
    ledger.pool().close().await;
    drop_schema(&admin, &schema).await;
}

/// Prune works in batches (each holds the advisory locks of the keys it
/// deletes until it commits) yet honours its limit exactly, and raises each
/// tenant and kind's horizon to the newest record it deleted there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prune_batches_and_honours_its_limit() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "batches").await;
    let ledger = PgLedger::connect_with(&url, options(&schema)).await.unwrap();
    let (a, b) = (fresh_tenant(), fresh_tenant());
    // 1203 completed records past retention, over two tenants and two kinds,
    // created a second apart; and one still kept.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {schema}.oncely_effects (key, tenant, kind, subject, state, fence, outcome, at_most_once, \
           created_at, updated_at, lease_expires_at, retain_until, retention_us) \
         SELECT t || '/' || k || ':s' || i, t, k, 's' || i, 'completed', 1, convert_to('1', 'UTF8'), false, \
           timestamptz '2020-01-01 00:00:00+00' + i * interval '1 second', now(), NULL, now() - interval '1 minute', 1000000 \
         FROM generate_series(1, 1203) AS i, \
           LATERAL (SELECT CASE WHEN i % 3 = 0 THEN '{b}' ELSE '{a}' END AS t, \
                           CASE WHEN i % 2 = 0 THEN 'capture' ELSE 'receipt' END AS k) AS x; \
         INSERT INTO {schema}.oncely_effects (key, tenant, kind, subject, state, fence, outcome, at_most_once, \
           created_at, updated_at, lease_expires_at, retain_until, retention_us) \
         VALUES ('{a}/capture:kept', '{a}', 'capture', 'kept', 'completed', 1, NULL, false, now(), now(), NULL, \
           now() + interval '1 day', 86400000000);"
    )))
    .execute(&admin)
    .await
    .unwrap();
    assert_eq!(ledger.prune(1001).await.unwrap(), 1001);
    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 202);
    assert_eq!(ledger.prune(u64::MAX).await.unwrap(), 0);
    let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {schema}.oncely_effects"
    )))
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(left, 1);
    // The newest deleted of each: i = 1202 (a, capture), 1201 (a, receipt),
    // 1200 (b, capture), 1203 (b, receipt).
    let at = |i: u64| std::time::UNIX_EPOCH + Duration::from_secs(1_577_836_800 + i);
    assert_eq!(ledger.horizon(&a, "capture").await.unwrap(), Some(at(1202)));
    assert_eq!(ledger.horizon(&a, "receipt").await.unwrap(), Some(at(1201)));
    assert_eq!(ledger.horizon(&b, "capture").await.unwrap(), Some(at(1200)));
    assert_eq!(ledger.horizon(&b, "receipt").await.unwrap(), Some(at(1203)));
    assert_eq!(ledger.horizon(&b, "refund").await.unwrap(), None);
    ledger.pool().close().await;
    drop_schema(&admin, &schema).await;
}

/// A ledger of schema version 4 (no `<table>_current` function, no outbox
/// yet) is refused when opened without migrations, naming what is missing
/// and `oncely migrate`; opened with migrations it gets the current
/// version and claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_version_4_ledger_is_refused_until_migrated() {
    let Some(url) = url() else { return };
    let Some(admin) = admin(&url).await else { return };
    let schema = fresh_schema(&admin, "v4").await;
    PgLedger::connect_with(&url, options(&schema))
        .await
        .unwrap()
        .pool()
        .close()
        .await;
    // Back to version 4: what that release left.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP FUNCTION {schema}.oncely_effects_current(text[]); DROP TABLE {schema}.oncely_effects_outbox; \
         DELETE FROM {schema}.oncely_effects_migrations WHERE version >= 5"
    )))
    .execute(&admin)
    .await
    .unwrap();

    let e = PgLedger::connect_with(&url, options(&schema).migrate(false))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::Config(m) if m.contains(&format!("table {schema}.oncely_effects_outbox does not exist"))
            && m.contains("oncely migrate") && m.contains("schema version 6")),
        "{e:?}"
    );
    let ledger = PgLedger::connect_with(&url, options(&schema)).await.unwrap();
    let k = key("after-v4");
    assert!(matches!(
        ledger.claim(&k, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));
    drop_schema(&admin, &schema).await;
}
