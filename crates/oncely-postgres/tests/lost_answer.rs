//! A completion or release whose connection dies during its statement (the
//! server terminates the backend while the write waits on a row lock) is
//! resolved by reading the record again on a new connection, never reported
//! as unavailable when it can be settled, and never settled by claiming.
//!
//! A claim whose connection dies during its statement (terminated while it
//! waits on its key's lock, held by another claim inside a transaction) is
//! resolved the same way, by the claim's token: its statement wrote nothing,
//! so it claims the key if it is free, and answers the other claim's lease
//! if that one committed. (`lost_claim.rs` loses a claim's answer after its
//! write committed.)

use std::time::Duration;

use oncely::backend::{Claim, Lease, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::{Connection, PgConnection};

const TABLE: &str = "oncely_lost_answer";

async fn setup() -> Option<(String, PgLedger)> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    match PgLedger::connect_with(&url, PgLedgerOptions::default().table(TABLE).max_connections(4)).await {
        Ok(l) => Some((url, l)),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

async fn acquire(ledger: &PgLedger, key: &EffectKey) -> Lease {
    match ledger.claim(key, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Runs `write` while another session holds `key`'s row lock, terminates
/// the backend of the write once it waits on that lock, then lets the lock
/// go; the write's answer.
async fn killed_mid_write<F: std::future::Future<Output = oncely::Result<()>> + Send + 'static>(
    url: &str,
    key: &EffectKey,
    write: F,
) -> oncely::Result<()> {
    let mut blocker = PgConnection::connect(url).await.unwrap();
    let mut tx = blocker.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {TABLE} WHERE key = $1 FOR UPDATE"
    )))
    .bind(key.as_str())
    .execute(&mut *tx)
    .await
    .unwrap();
    let write = tokio::spawn(write);
    let mut killer = PgConnection::connect(url).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        // The one backend waiting on a lock with a statement on this table
        // and this key's fence parameter is the write.
        let killed: Option<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND query LIKE $1 \
             AND pg_blocking_pids(pid) @> ARRAY[$2::int] LIMIT 1",
        )
        .bind(format!("%{TABLE}%"))
        .bind(
            sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .unwrap(),
        )
        .fetch_optional(&mut killer)
        .await
        .unwrap();
        if killed == Some(true) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the write never waited on the lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.rollback().await.unwrap();
    write.await.unwrap()
}

#[tokio::test]
async fn a_completion_whose_connection_died_is_resolved_from_its_record() {
    let Some((url, ledger)) = setup().await else {
        return;
    };
    let key = EffectKey::new(&fresh_tenant(), "lost", "complete").unwrap();
    let lease = acquire(&ledger, &key).await;
    let outcome = Outcome::from_json(&"charged").unwrap();
    let answer = {
        let (ledger, lease, outcome) = (ledger.clone(), lease.clone(), outcome.clone());
        killed_mid_write(&url, &key, async move { ledger.complete(&lease, &outcome).await }).await
    };
    // The terminated statement wrote nothing; the ledger saw its own lease
    // still in progress on a new connection and completed it.
    answer.expect("resolved, not unavailable");
    let record = ledger.get(&key).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.fence),
        (RecordState::Completed, lease.fence())
    );
    assert_eq!(record.outcome, Some(outcome));
    // Nothing claimed blind: the same fence, no takeover.
    assert!(matches!(
        ledger.claim(&key, &ClaimOptions::default()).await.unwrap(),
        Claim::Completed(_)
    ));
}

#[tokio::test]
async fn a_release_whose_connection_died_is_resolved_from_its_record() {
    let Some((url, ledger)) = setup().await else {
        return;
    };
    let key = EffectKey::new(&fresh_tenant(), "lost", "release").unwrap();
    let lease = acquire(&ledger, &key).await;
    let answer = {
        let (ledger, lease) = (ledger.clone(), lease.clone());
        killed_mid_write(&url, &key, async move { ledger.release(&lease).await }).await
    };
    answer.expect("resolved, not unavailable");
    let record = ledger.get(&key).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.fence),
        (RecordState::Released, lease.fence())
    );
}

/// Claims `key` while another claim holds the key inside a transaction
/// (`claim_in`), terminates the claim's backend once it waits on the key's
/// lock, then commits the other claim's transaction (`commit`) or rolls it
/// back; the claim's answer, and the other claim's lease.
async fn claim_killed_behind(
    ledger: &PgLedger,
    url: &str,
    key: &EffectKey,
    commit: bool,
) -> (oncely::Result<Claim>, Lease) {
    let mut tx = ledger.begin().await.unwrap();
    let other = match ledger
        .claim_in(&mut *tx, key, &ClaimOptions::default())
        .await
        .unwrap()
    {
        Claim::Acquired(l) => l,
        c => panic!("{c:?}"),
    };
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let claim = {
        let (ledger, key) = (ledger.clone(), key.clone());
        tokio::spawn(async move { ledger.claim(&key, &ClaimOptions::default()).await })
    };
    let mut killer = PgConnection::connect(url).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let killed: Option<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE $1 AND pg_blocking_pids(pid) @> ARRAY[$2::int] LIMIT 1",
        )
        .bind(format!("%{TABLE}%"))
        .bind(holder)
        .fetch_optional(&mut killer)
        .await
        .unwrap();
        if killed == Some(true) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim never waited on the key's lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
    (claim.await.unwrap(), other)
}

#[tokio::test]
async fn a_claim_whose_connection_died_claims_a_key_nobody_holds() {
    let Some((url, ledger)) = setup().await else {
        return;
    };
    let key = EffectKey::new(&fresh_tenant(), "lost", "claim-free").unwrap();
    let (answer, other) = claim_killed_behind(&ledger, &url, &key, false).await;
    // Its statement wrote nothing and the other claim rolled back: the key
    // was free, and the resolution claimed it (a fence of its own).
    let lease = match answer.expect("resolved, not unavailable") {
        Claim::Acquired(l) => l,
        c => panic!("expected Acquired, got {c:?}"),
    };
    assert_ne!(lease.fence(), other.fence());
    let record = ledger.get(&key).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.fence),
        (RecordState::InProgress, lease.fence())
    );
}

#[tokio::test]
async fn a_claim_whose_connection_died_answers_the_other_holder() {
    let Some((url, ledger)) = setup().await else {
        return;
    };
    let key = EffectKey::new(&fresh_tenant(), "lost", "claim-held").unwrap();
    let (answer, other) = claim_killed_behind(&ledger, &url, &key, true).await;
    // The other claim committed: its lease, not ours.
    match answer.expect("resolved, not unavailable") {
        Claim::InProgress { fence, .. } => assert_eq!(fence, other.fence()),
        c => panic!("expected InProgress, got {c:?}"),
    }
}

/// What a resolution relies on to tell its own row: a claim writes its
/// call's token followed by its transaction's id, which is the row's `xmin`
/// while the row is the version it wrote. A process of the previous release
/// (schema version 2's statements, which never write `claim_token`) taking
/// the row over leaves the token but rewrites the row, so the token no
/// longer matches: a claim of this release resolving a lost answer at that
/// moment sees another holder's lease, never its own.
#[tokio::test]
async fn a_claim_token_is_tied_to_the_row_version_its_claim_wrote() {
    let Some((url, ledger)) = setup().await else {
        return;
    };
    let key = EffectKey::new(&fresh_tenant(), "lost", "token-version").unwrap();
    let lease = acquire(&ledger, &key).await;
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let matches = format!(
        "SELECT octet_length(claim_token), \
           claim_token = substring(claim_token from 1 for 16) || int8send(xmin::text::bigint) \
         FROM {TABLE} WHERE key = $1"
    );
    let (len, own): (i32, bool) = sqlx::query_as(sqlx::AssertSqlSafe(matches.clone()))
        .bind(key.as_str())
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!((len, own), (24, true));
    // The previous release's takeover of an expired lease: a new fence and
    // lease, the token left as it was.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {TABLE} SET fence = fence + 1, updated_at = clock_timestamp(), \
           lease_expires_at = clock_timestamp() + interval '1 minute' WHERE key = $1"
    )))
    .bind(key.as_str())
    .execute(&mut conn)
    .await
    .unwrap();
    let (_, own): (i32, bool) = sqlx::query_as(sqlx::AssertSqlSafe(matches))
        .bind(key.as_str())
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(
        !own,
        "the token still names the row after another writer rewrote it"
    );
    // And the ledger answers the other holder's lease.
    match ledger.claim(&key, &ClaimOptions::default()).await.unwrap() {
        Claim::InProgress { fence, .. } => assert_eq!(fence, lease.fence() + 1),
        c => panic!("{c:?}"),
    }
}

/// A waiter's mark (its watch sets `watched` on the record in progress)
/// rewrites the row but not its holder: a token that matched the version
/// before is tied to the version the mark wrote, so a claim resolving a
/// lost answer still finds its own row; a token that no longer matched
/// stays untied.
#[tokio::test]
async fn a_waiters_mark_keeps_the_claim_token_tied() {
    let Some((url, ledger)) = setup().await else {
        return;
    };
    let Ok(waiter) =
        PgLedger::connect_with(&url, PgLedgerOptions::default().table(TABLE).max_connections(2)).await
    else {
        return;
    };
    let t = fresh_tenant();
    let mut conn = PgConnection::connect(&url).await.unwrap();
    let state = format!(
        "SELECT claim_token = substring(claim_token from 1 for 16) || int8send(xmin::text::bigint), \
           coalesce(watched, false), xmin::text \
         FROM {TABLE} WHERE key = $1"
    );
    let read = async |conn: &mut PgConnection, key: &EffectKey| -> (bool, bool, String) {
        sqlx::query_as(sqlx::AssertSqlSafe(state.clone()))
            .bind(key.as_str())
            .fetch_one(conn)
            .await
            .unwrap()
    };

    let key = EffectKey::new(&t, "lost", "marked").unwrap();
    acquire(&ledger, &key).await;
    let (own, watched, before) = read(&mut conn, &key).await;
    assert_eq!((own, watched), (true, false));
    assert!(
        waiter.watch(&key).await.is_notified(),
        "the waiter's listener listens"
    );
    let (own, watched, after) = read(&mut conn, &key).await;
    assert_ne!(before, after, "the mark wrote a new version of the row");
    assert_eq!((own, watched), (true, true), "still the claim's own row");

    // A row the previous release took over (the token untied) stays untied.
    let key = EffectKey::new(&t, "lost", "marked-untied").unwrap();
    acquire(&ledger, &key).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {TABLE} SET fence = fence + 1, updated_at = clock_timestamp() WHERE key = $1"
    )))
    .bind(key.as_str())
    .execute(&mut conn)
    .await
    .unwrap();
    assert!(waiter.watch(&key).await.is_notified());
    let (own, watched, _) = read(&mut conn, &key).await;
    assert_eq!((own, watched), (false, true));
}
