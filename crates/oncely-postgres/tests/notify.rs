//! Waiting duplicates across processes: a waiter in one ledger instance
//! (its own pool: another process as far as the server knows) is woken by
//! the `NOTIFY` of a completion committed through another instance, and when
//! its listener's connection is killed it still gets its answer (the
//! bounded fallback) while the listener reconnects.
//!
//! Each test has its own table, so its channel carries only its own
//! notifications and its listener is the only one on that channel.

use std::time::Duration;

use oncely::backend::{Claim, Lease, Ledger, Outcome, TransactionalLedger};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Effects, OnInProgress};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPoolOptions;

fn url() -> Option<String> {
    service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )
}

/// A ledger on a pool of its own (a process of its own, for the server).
async fn instance(url: &str, table: &str) -> Option<PgLedger> {
    match PgLedger::connect_with(url, PgLedgerOptions::default().table(table).max_connections(4)).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

fn opts() -> ClaimOptions {
    ClaimOptions::default().lease(Duration::from_secs(60))
}

fn acquired(c: Claim) -> Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Polls `cond` every 20 ms until it holds; panics after 30 s (a generous
/// bound for a loaded machine, not a timing assertion).
async fn eventually(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts `ledger`'s listener (the first watch does) and waits until it
/// listens.
async fn listening(ledger: &PgLedger, key: &EffectKey) {
    drop(ledger.watch(key).await);
    eventually("the listener listens", async || {
        ledger.listener_status().listening
    })
    .await;
}

/// `Effects::run` with the `Wait` policy in a task: the waiter's answer
/// is what its handler returned, or the holder's stored outcome.
fn wait_for(ledger: &PgLedger, key: &EffectKey) -> tokio::task::JoinHandle<oncely::Result<String>> {
    let (ledger, key) = (ledger.clone(), key.clone());
    tokio::spawn(async move {
        let wait = OnInProgress::Wait {
            max: Duration::from_secs(60),
        };
        Effects::new(ledger)
            .run(&key, &opts().on_in_progress(wait), |_| async {
                Ok("waiter ran".to_owned())
            })
            .await
    })
}

/// The backends listening on `channel` (the listener's `LISTEN` is the last
/// statement its session ran).
async fn listeners(observer: &sqlx::PgPool, channel: &str) -> Vec<i32> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'oncely listener' \
         AND query LIKE 'LISTEN \"{channel}\"%' ORDER BY pid"
    )))
    .fetch_all(observer)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_in_another_process_is_woken_by_the_notification() {
    let Some(url) = url() else { return };
    let Some(holder) = instance(&url, "oncely_pg_notify_wake").await else {
        return;
    };
    let Some(waiter) = instance(&url, "oncely_pg_notify_wake").await else {
        return;
    };
    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "order-1").unwrap();
    assert!(
        !waiter.listener_status().listening,
        "it starts with the first wait"
    );
    listening(&waiter, &k).await;
    let status = waiter.listener_status();
    assert_eq!(status.connects, 1);
    assert_eq!(status.channel, holder.listener_status().channel);
    // The holder's instance never waited: it opened no listener.
    assert!(!holder.listener_status().listening);

    for (round, release) in [(0, false), (1, true)] {
        let k = EffectKey::new(&t, "capture", format!("order-{round}")).unwrap();
        let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
        assert!(
            waiter.watch(&k).await.is_notified(),
            "a notified watch while listening"
        );
        let before = waiter.listener_status().notifications;
        let task = wait_for(&waiter, &k);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!task.is_finished(), "the duplicate waits while the holder runs");
        if release {
            holder.release(&lease).await.unwrap();
        } else {
            holder
                .complete(&lease, &Outcome::value(&"holder ran").unwrap())
                .await
                .unwrap();
        }
        let want = if release { "waiter ran" } else { "holder ran" };
        assert_eq!(task.await.unwrap().unwrap(), want);
        // The holder's instance shares nothing with the waiter's: only the
        // server's notification reached it.
        assert!(
            waiter.listener_status().notifications > before,
            "the waiter's listener relayed the holder's notification"
        );
    }
    // A write that ends no lease notifies nobody: a stale release fails and
    // sends nothing. So far: the holder's completion and release, the
    // waiter's own completion after it took over the released key (marked
    // by its wait before), and the release below, of a record the waiter's
    // watch marked (notifications arrive in commit order).
    let k = EffectKey::new(&t, "capture", "stale").unwrap();
    let stale = acquired(holder.claim(&k, &opts()).await.unwrap());
    assert!(waiter.watch(&k).await.is_notified());
    holder.release(&stale).await.unwrap();
    eventually("the notifications so far arrive", async || {
        waiter.listener_status().notifications >= 4
    })
    .await;
    let before = waiter.listener_status().notifications;
    assert!(holder.release(&stale).await.unwrap_err().is_lease_lost());
    // A later notification arrives after the stale one would have.
    let marker_key = EffectKey::new(&t, "capture", "marker").unwrap();
    let marker = acquired(holder.claim(&marker_key, &opts()).await.unwrap());
    assert!(waiter.watch(&marker_key).await.is_notified());
    holder.release(&marker).await.unwrap();
    eventually("the marker arrives", async || {
        waiter.listener_status().notifications > before
    })
    .await;
    assert_eq!(waiter.listener_status().notifications, before + 1);
}

/// How many of `tenant`'s records in the marked test's table a waiter marked.
async fn marked(observer: &sqlx::PgPool, tenant: &oncely::Tenant) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM oncely_pg_notify_marked WHERE tenant = $1 AND watched")
        .bind(tenant.as_str())
        .fetch_one(observer)
        .await
        .unwrap()
}

/// A completion or release is announced to other processes only when a
/// waiter marked its record (the waiter's watch does, before it reads the
/// record again): the holder's ledger counts the ends it announced and
/// those it did not need to, and only the marked key's notification
/// reaches the waiter's listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_a_completion_somebody_waits_for_is_announced() {
    let Some(url) = url() else { return };
    let Some(holder) = instance(&url, "oncely_pg_notify_marked").await else {
        return;
    };
    let Some(waiter) = instance(&url, "oncely_pg_notify_marked").await else {
        return;
    };
    let t = fresh_tenant();
    let outcome = Outcome::value(&"done").unwrap();
    listening(&waiter, &EffectKey::new(&t, "capture", "warm-up").unwrap()).await;

    // Twenty completions and a release nobody waits for: none announced.
    for n in 0..20 {
        let k = EffectKey::new(&t, "capture", format!("alone-{n}")).unwrap();
        let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
        holder.complete(&lease, &outcome).await.unwrap();
    }
    let k = EffectKey::new(&t, "capture", "alone-released").unwrap();
    let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
    holder.release(&lease).await.unwrap();
    let s = holder.listener_status();
    assert_eq!((s.announced, s.unwatched), (0, 21), "{s:?}");

    // A key a waiter in the other instance waits on: marked, announced,
    // and the waiter gets the holder's outcome.
    let k = EffectKey::new(&t, "capture", "awaited").unwrap();
    let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
    let before = waiter.listener_status().notifications;
    let task = wait_for(&waiter, &k);
    let observer = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    eventually("the waiter marks the record", async || {
        sqlx::query_scalar::<_, Option<bool>>("SELECT watched FROM oncely_pg_notify_marked WHERE key = $1")
            .bind(k.as_str())
            .fetch_one(&observer)
            .await
            .unwrap()
            == Some(true)
    })
    .await;
    holder.complete(&lease, &outcome).await.unwrap();
    assert_eq!(task.await.unwrap().unwrap(), "done");
    eventually("the announcement is sent", async || {
        holder.listener_status().announced == 1
    })
    .await;
    assert_eq!(holder.listener_status().unwatched, 21);
    eventually("the waiter's listener relays it", async || {
        waiter.listener_status().notifications > before
    })
    .await;
    // A mark on a record no longer in progress writes nothing.
    drop(waiter.watch(&k).await);
    let rows = marked(&observer, &t).await;
    assert_eq!(rows, 1, "only the awaited key is marked");

    // A waiter of the holder's own ledger marks nothing: the holder's
    // completion wakes it in memory.
    let k = EffectKey::new(&t, "capture", "own").unwrap();
    let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
    listening(&holder, &k).await;
    assert!(holder.watch(&k).await.is_notified());
    let task = wait_for(&holder, &k);
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.complete(&lease, &outcome).await.unwrap();
    assert_eq!(task.await.unwrap().unwrap(), "done");
    let rows = marked(&observer, &t).await;
    assert_eq!(rows, 1, "the holder's own waiter marked nothing");
    assert_eq!(holder.listener_status().unwatched, 22);

    // The same, completed in the caller's transaction: its commit notifies
    // (the waiter left no mark, and the ledger cannot wake it after a
    // commit it does not see).
    let k = EffectKey::new(&t, "capture", "own-in-transaction").unwrap();
    let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
    assert!(holder.watch(&k).await.is_notified());
    let before = holder.listener_status().notifications;
    let task = wait_for(&holder, &k);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut tx = holder.begin().await.unwrap();
    holder.complete_in(&mut tx, &lease, &outcome).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(task.await.unwrap().unwrap(), "done");
    eventually("the commit's notification arrives", async || {
        holder.listener_status().notifications > before
    })
    .await;
    let marked: Option<bool> =
        sqlx::query_scalar("SELECT watched FROM oncely_pg_notify_marked WHERE key = $1")
            .bind(k.as_str())
            .fetch_one(&observer)
            .await
            .unwrap();
    assert_eq!(marked, None, "the holder's own waiter marked nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_listener_costs_latency_not_the_answer_and_reconnects() {
    let Some(url) = url() else { return };
    let Some(holder) = instance(&url, "oncely_pg_notify_kill").await else {
        return;
    };
    let Some(waiter) = instance(&url, "oncely_pg_notify_kill").await else {
        return;
    };
    let observer = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let channel = waiter.listener_status().channel;
    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "order-1").unwrap();
    listening(&waiter, &k).await;
    let first = listeners(&observer, &channel).await;
    assert_eq!(first.len(), 1, "one listener connection per ledger: {first:?}");

    // A duplicate waits on a notified watch; its listener is killed; the
    // holder completes right away, so the notification may well be lost.
    let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
    let task = wait_for(&waiter, &k);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!task.is_finished(), "the duplicate waits while the holder runs");
    let killed: Vec<bool> =
        sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM unnest($1::int[]) AS pid")
            .bind(&first)
            .fetch_all(&observer)
            .await
            .unwrap();
    assert_eq!(killed, [true]);
    holder
        .complete(&lease, &Outcome::value(&"holder ran").unwrap())
        .await
        .unwrap();
    assert_eq!(
        task.await.unwrap().unwrap(),
        "holder ran",
        "the answer, notification or not"
    );

    // The listener reconnects on a new connection and listens again.
    eventually("the listener reconnects", async || {
        let s = waiter.listener_status();
        s.listening && s.connects >= 2
    })
    .await;
    let again = listeners(&observer, &channel).await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_ne!(again, first, "a new connection");

    // And waiters are woken by notifications again.
    let k = EffectKey::new(&t, "capture", "order-2").unwrap();
    let lease = acquired(holder.claim(&k, &opts()).await.unwrap());
    assert!(waiter.watch(&k).await.is_notified());
    let before = waiter.listener_status().notifications;
    let task = wait_for(&waiter, &k);
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder
        .complete(&lease, &Outcome::value(&"holder ran again").unwrap())
        .await
        .unwrap();
    assert_eq!(task.await.unwrap().unwrap(), "holder ran again");
    assert!(waiter.listener_status().notifications > before);
}

/// A read-only ledger never waits for anything (it cannot claim): it opens
/// no listener, and its watches poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_ledger_opens_no_listener() {
    let Some(url) = url() else { return };
    let Some(_migrated) = instance(&url, "oncely_pg_notify_ro").await else {
        return;
    };
    let ro = PgLedger::connect_with(
        &url,
        PgLedgerOptions::default()
            .table("oncely_pg_notify_ro")
            .read_only(true),
    )
    .await
    .unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "order-1").unwrap();
    assert!(!ro.watch(&k).await.is_notified());
    assert_eq!(ro.listener_status().connects, 0);
}
