//! A claim whose answer is lost after its write committed is resolved by
//! its own row, found by the claim's token on a new connection: the caller
//! gets the lease it holds (`Acquired`, at the row's fence), never
//! `Unavailable` for a claim that took the key, never `InProgress` behind a
//! phantom holder, and a concurrent duplicate never acquires too.
//!
//! The answers are lost for real, on a primary with a synchronous standby
//! (`scripts/pg-standby.sh`, its own pair on ports 5442/5443 so it does not
//! race `failover.rs`):
//!
//! - at COMMIT: the standby is no longer counted as synchronous, so the
//!   claim's commit waits for a standby that never answers (it has committed
//!   locally, its locks still held); the test terminates that backend
//!   (`pg_terminate_backend`), which PostgreSQL answers with "the
//!   transaction has already committed locally" and a closed connection;
//! - in a failover: the standby's replay is paused and sessions commit with
//!   `synchronous_commit = remote_apply`, so the claim's commit reaches the
//!   standby's disk and waits there for an apply; the primary is killed
//!   (SIGKILL) and the standby promoted, with the claim's row in it.

mod common;

use std::time::Duration;

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::{Connection, PgConnection};

const PORT: u16 = 5442;
const TABLE: &str = "oncely_lost_claim";

/// One pair for the whole binary: the tests run one at a time.
static PAIR: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn options() -> PgLedgerOptions {
    PgLedgerOptions::default()
        .table(TABLE)
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .operation_timeout(Duration::from_secs(15))
}

/// The primary's and the standby's ports in `url` (the pair's two hosts).
fn ports(url: &str) -> (u16, u16) {
    let hosts = url.split('@').nth(1).unwrap().split('/').next().unwrap();
    let mut ports = hosts
        .split(',')
        .map(|h| h.rsplit(':').next().unwrap().parse().unwrap());
    (ports.next().unwrap(), ports.next().unwrap())
}

async fn session(port: u16, database: &str) -> PgConnection {
    PgConnection::connect(&format!("postgres://postgres@127.0.0.1:{port}/{database}"))
        .await
        .unwrap()
}

async fn exec(conn: &mut PgConnection, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(conn)
        .await
        .unwrap();
}

/// Waits until `sql` (one boolean) is true on `conn`.
async fn until(conn: &mut PgConnection, sql: &str, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ok: Option<bool> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_optional(&mut *conn)
            .await
            .unwrap()
            .flatten();
        if ok == Some(true) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The pid of the backend waiting for the synchronous standby with a
/// statement on the test's table.
async fn waiting_commit(primary: &mut PgConnection) -> i32 {
    let q = format!(
        "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND query LIKE '%{TABLE}%' LIMIT 1"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pid: Option<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(q.clone()))
            .fetch_optional(&mut *primary)
            .await
            .unwrap();
        if let Some(pid) = pid {
            return pid;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim never waited for its commit"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until a statement on the test's table waits on a lock held by
/// backend `holder` (`what`: a duplicate, or the resolution's run, queued
/// behind the claim's key lock).
async fn queued_behind(primary: &mut PgConnection, holder: i32, what: &str) {
    until(
        primary,
        &format!(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%{TABLE}%' AND pg_blocking_pids(pid) @> ARRAY[{holder}])"
        ),
        what,
    )
    .await;
}

/// Commits on the primary wait for a standby that is not there (none is
/// named `oncely_nobody`), until [`count_the_standby`].
async fn stop_counting_the_standby(primary: &mut PgConnection) {
    exec(
        primary,
        "ALTER SYSTEM SET synchronous_standby_names = 'oncely_nobody'",
    )
    .await;
    exec(primary, "SELECT pg_reload_conf()").await;
    until(
        primary,
        "SELECT bool_and(sync_state = 'async') FROM pg_stat_replication",
        "the standby no longer synchronous",
    )
    .await;
}

async fn count_the_standby(primary: &mut PgConnection) {
    exec(primary, "ALTER SYSTEM SET synchronous_standby_names = '*'").await;
    exec(primary, "SELECT pg_reload_conf()").await;
}

fn acquired(claim: &Claim) -> &oncely::backend::Lease {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// The claim's statement commits (locally) and the connection dies while
/// its COMMIT waits; the caller gets the lease it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_whose_commit_lost_its_answer_is_acquired() {
    let _pair = PAIR.lock().await;
    let Some(url) = common::fresh_pair(PORT, "sync") else {
        return;
    };
    let (primary_port, _) = ports(&url);
    let ledger = PgLedger::connect_with(&url, options()).await.expect("connects");
    let other = PgLedger::connect_with(&url, options()).await.expect("connects");
    let key = EffectKey::new(&fresh_tenant(), "lost-claim", "commit").unwrap();
    let mut primary = session(primary_port, "test").await;

    stop_counting_the_standby(&mut primary).await;
    let claim = {
        let (ledger, key) = (ledger.clone(), key.clone());
        tokio::spawn(async move { ledger.claim(&key, &ClaimOptions::default()).await })
    };
    let pid = waiting_commit(&mut primary).await;
    // A duplicate from another process, queued behind the claim's key lock.
    let duplicate = {
        let (other, key) = (other.clone(), key.clone());
        tokio::spawn(async move { other.claim(&key, &ClaimOptions::default()).await })
    };
    queued_behind(&mut primary, pid, "the duplicate queued behind the claim").await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut primary)
        .await
        .unwrap();
    assert!(killed);
    count_the_standby(&mut primary).await;

    let claim = claim
        .await
        .unwrap()
        .expect("resolved from its row, not unavailable");
    let lease = acquired(&claim);
    let record = ledger.get(&key).await.unwrap().expect("the claim's row");
    assert_eq!(
        (record.state, record.fence, record.lease_expires_at),
        (RecordState::InProgress, lease.fence(), Some(lease.expires_at()))
    );
    assert!(!lease.taken_over());
    match duplicate.await.unwrap().expect("the duplicate's answer") {
        Claim::InProgress { fence, .. } => assert_eq!(fence, lease.fence()),
        other => panic!("the duplicate must not acquire too: {other:?}"),
    }
    // The lease is the live one: it completes, and a retry replays it.
    ledger
        .complete(lease, &Outcome::from_json(&"done").unwrap())
        .await
        .expect("the resolved lease completes");
    assert!(matches!(
        other.claim(&key, &ClaimOptions::default()).await.unwrap(),
        Claim::Completed(_)
    ));
}

/// The claim's commit waits past the operation timeout (no answer in
/// time: lost too); the resolution's run of the claim queues behind the
/// commit's key lock, and once the standby counts again and the commit
/// ends, finds the row its call wrote: `Acquired`, not `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_whose_commit_timed_out_is_acquired_when_it_commits() {
    let _pair = PAIR.lock().await;
    let Some(url) = common::fresh_pair(PORT, "sync") else {
        return;
    };
    let (primary_port, _) = ports(&url);
    let ledger = PgLedger::connect_with(&url, options().operation_timeout(Duration::from_secs(3)))
        .await
        .expect("connects");
    let key = EffectKey::new(&fresh_tenant(), "lost-claim", "timeout").unwrap();
    let mut primary = session(primary_port, "test").await;

    stop_counting_the_standby(&mut primary).await;
    let claim = {
        let (ledger, key) = (ledger.clone(), key.clone());
        tokio::spawn(async move { ledger.claim(&key, &ClaimOptions::default()).await })
    };
    let pid = waiting_commit(&mut primary).await;
    // The first run timed out; the resolution's run waits on the key.
    queued_behind(&mut primary, pid, "the resolution's run queued behind the claim").await;
    count_the_standby(&mut primary).await;

    let claim = claim
        .await
        .unwrap()
        .expect("resolved from its row, not unavailable");
    let lease = acquired(&claim);
    let record = ledger.get(&key).await.unwrap().expect("the claim's row");
    assert_eq!(
        (record.state, record.fence),
        (RecordState::InProgress, lease.fence())
    );
}

/// The same for a batch: each key's slot is resolved from its own row (two
/// inserted by the lost statement, one that already held a completed
/// effect and answers its replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_whose_commit_lost_its_answer_is_resolved_per_key() {
    let _pair = PAIR.lock().await;
    let Some(url) = common::fresh_pair(PORT, "sync") else {
        return;
    };
    let (primary_port, _) = ports(&url);
    let ledger = PgLedger::connect_with(&url, options()).await.expect("connects");
    let tenant = fresh_tenant();
    let keys: Vec<EffectKey> = ["a", "b", "done"]
        .iter()
        .map(|s| EffectKey::new(&tenant, "lost-batch", *s).unwrap())
        .collect();
    let done = acquired(&ledger.claim(&keys[2], &ClaimOptions::default()).await.unwrap()).clone();
    ledger
        .complete(&done, &Outcome::from_json(&"earlier").unwrap())
        .await
        .unwrap();
    let mut primary = session(primary_port, "test").await;

    stop_counting_the_standby(&mut primary).await;
    let batch = {
        let (ledger, keys) = (ledger.clone(), keys.clone());
        tokio::spawn(async move { ledger.claim_many(&keys, &ClaimOptions::default()).await })
    };
    let pid = waiting_commit(&mut primary).await;
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&mut primary)
        .await
        .unwrap();
    count_the_standby(&mut primary).await;

    let answers = batch.await.unwrap().expect("the batch answers");
    assert_eq!(answers.len(), 3);
    for (key, answer) in keys[..2].iter().zip(&answers) {
        let answer = answer.as_ref().expect("resolved from its row, not unavailable");
        let lease = acquired(answer);
        let record = ledger.get(key).await.unwrap().expect("the claim's row");
        assert_eq!(
            (record.state, record.fence),
            (RecordState::InProgress, lease.fence())
        );
    }
    match answers[2].as_ref().unwrap() {
        Claim::Completed(r) => assert_eq!(r.fence, done.fence()),
        other => panic!("{other:?}"),
    }
}

/// A claim in flight when the primary is killed, its commit on the
/// synchronous standby's disk, is resolved from the promoted standby's row;
/// a duplicate in flight with it gets `InProgress` there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_in_flight_in_a_failover_is_resolved_from_the_promoted_standby() {
    let _pair = PAIR.lock().await;
    let Some(url) = common::fresh_pair(PORT, "sync") else {
        return;
    };
    let (primary_port, standby_port) = ports(&url);
    let mut primary = session(primary_port, "postgres").await;
    // New sessions of `test` commit once the standby has applied.
    exec(
        &mut primary,
        "ALTER DATABASE test SET synchronous_commit = remote_apply",
    )
    .await;
    let ledger = PgLedger::connect_with(&url, options()).await.expect("connects");
    let other = PgLedger::connect_with(&url, options()).await.expect("connects");
    let key = EffectKey::new(&fresh_tenant(), "lost-claim", "failover").unwrap();
    let mut standby = session(standby_port, "postgres").await;
    exec(&mut standby, "SELECT pg_wal_replay_pause()").await;
    until(
        &mut standby,
        "SELECT pg_get_wal_replay_pause_state() = 'paused'",
        "replay paused",
    )
    .await;

    let claim = {
        let (ledger, key) = (ledger.clone(), key.clone());
        tokio::spawn(async move { ledger.claim(&key, &ClaimOptions::default()).await })
    };
    let pid = waiting_commit(&mut primary).await;
    // The commit is on the standby's disk (received and flushed), waiting
    // for the apply that is paused.
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
        .fetch_one(&mut primary)
        .await
        .unwrap();
    until(
        &mut standby,
        &format!("SELECT pg_last_wal_receive_lsn() >= '{lsn}'::pg_lsn"),
        "the standby has the commit",
    )
    .await;
    let duplicate = {
        let (other, key) = (other.clone(), key.clone());
        tokio::spawn(async move { other.claim(&key, &ClaimOptions::default()).await })
    };
    queued_behind(&mut primary, pid, "the duplicate queued behind the claim").await;
    drop(primary);
    drop(standby);
    tokio::task::spawn_blocking(|| {
        common::run(PORT, &["kill-primary"]).unwrap();
        common::run(PORT, &["promote"]).unwrap();
    })
    .await
    .unwrap();

    let claim = claim
        .await
        .unwrap()
        .expect("resolved from the promoted standby's row");
    let lease = acquired(&claim);
    let record = ledger.get(&key).await.unwrap().expect("the claim's row");
    assert_eq!(
        (record.state, record.fence),
        (RecordState::InProgress, lease.fence())
    );
    match duplicate.await.unwrap().expect("the duplicate's answer") {
        Claim::InProgress { fence, .. } => assert_eq!(fence, lease.fence()),
        other => panic!("the duplicate must not acquire too: {other:?}"),
    }
    ledger
        .complete(lease, &Outcome::from_json(&"done").unwrap())
        .await
        .expect("the resolved lease completes on the new primary");
    let record = ledger.get(&key).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.fence),
        (RecordState::Completed, lease.fence())
    );
}
