//! The hot path on MySQL / MariaDB: a duplicate is a plain read (no row
//! lock, no write), a waiter on a lease this ledger holds is woken by its
//! completion, and batches answer every key as its own claim would.

use std::time::{Duration, Instant, SystemTime};

use oncely::backend::{Claim, Fingerprint, Lease, Ledger, Outcome, RecordState};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Error, Tenant};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::{Executor, Row};

async fn ledger_with(opts: MySqlLedgerOptions) -> Option<MySqlLedger> {
    let url = service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))?;
    match MySqlLedger::connect_with(&url, opts).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("MySQL at {url}: {e}")),
    }
}

/// Both claim paths: the detected one (RETURNING on MariaDB) and the MySQL 8
/// two-statement one.
fn both_paths() -> [MySqlLedgerOptions; 2] {
    let base = MySqlLedgerOptions::default().max_connections(8);
    [base.clone(), base.returning(Some(false))]
}

fn key(t: &Tenant, kind: &str, subject: &str) -> EffectKey {
    EffectKey::new(t, kind, subject).unwrap()
}

fn acquired(c: Claim) -> Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn outcome(s: &str) -> Outcome {
    Outcome::from_json(&s).unwrap()
}

/// The session's write and read counters, read on the pool's only
/// connection (the one the claims run on).
async fn handler_counters(ledger: &MySqlLedger) -> (u64, u64, u64) {
    let rows = sqlx::query(
        "SHOW SESSION STATUS WHERE Variable_name IN ('Handler_write', 'Handler_update', 'Handler_read_key')",
    )
    .fetch_all(ledger.pool())
    .await
    .unwrap();
    let get = |name: &str| -> u64 {
        rows.iter()
            .find(|r| r.get::<String, _>(0) == name)
            .map(|r| r.get::<String, _>(1).parse().unwrap())
            .unwrap()
    };
    (
        get("Handler_write"),
        get("Handler_update"),
        get("Handler_read_key"),
    )
}

/// 200 duplicate claims (100 of completed effects, 100 of live leases) are
/// plain reads: the session attempted no row write and no update (the
/// `INSERT … ON DUPLICATE KEY UPDATE` the claim used to start with counts one
/// `Handler_write` per claim, and takes an exclusive lock on the row it
/// finds), and a transaction holding those rows `FOR UPDATE` does not hold
/// the duplicates up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_claims_are_reads() {
    for opts in both_paths() {
        // One connection: its session counters are the claims' own.
        let Some(ledger) = ledger_with(opts.max_connections(1)).await else {
            return;
        };
        let t = fresh_tenant();
        let o = ClaimOptions::default().lease(Duration::from_secs(120));
        let done: Vec<EffectKey> = (0..100)
            .map(|i| key(&t, "capture", &format!("done-{i}")))
            .collect();
        let live: Vec<EffectKey> = (0..100)
            .map(|i| key(&t, "capture", &format!("live-{i}")))
            .collect();
        for k in &done {
            let l = acquired(ledger.claim(k, &o).await.unwrap());
            ledger.complete(&l, &outcome("once")).await.unwrap();
        }
        for k in &live {
            acquired(ledger.claim(k, &o).await.unwrap());
        }

        let before = handler_counters(&ledger).await;
        for k in &done {
            match ledger.claim(k, &o).await.unwrap() {
                Claim::Completed(r) => assert_eq!(r.outcome, Some(outcome("once"))),
                other => panic!("{k}: {other:?}"),
            }
        }
        for k in &live {
            assert!(matches!(
                ledger.claim(k, &o).await.unwrap(),
                Claim::InProgress { .. }
            ));
        }
        let after = handler_counters(&ledger).await;
        assert_eq!(
            after.0 - before.0,
            0,
            "row writes attempted by 200 duplicate claims"
        );
        assert_eq!(after.1 - before.1, 0, "row updates by 200 duplicate claims");
        assert!(
            after.2 - before.2 >= 200,
            "the claims read their rows: {before:?} → {after:?}"
        );

        // Rows locked by another transaction: a duplicate does not wait.
        let Some(other) = ledger_with(MySqlLedgerOptions::default().max_connections(1)).await else {
            return;
        };
        ledger
            .pool()
            .execute("SET SESSION innodb_lock_wait_timeout = 1")
            .await
            .unwrap();
        let mut tx = other.begin().await.unwrap();
        let locked: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT effect_key FROM `{}` WHERE effect_key IN (?, ?) FOR UPDATE",
            other.table()
        )))
        .bind(done[0].as_str())
        .bind(live[0].as_str())
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        assert_eq!(locked.len(), 2);
        assert!(matches!(
            ledger.claim(&done[0], &o).await.unwrap(),
            Claim::Completed(_)
        ));
        assert!(matches!(
            ledger.claim(&live[0], &o).await.unwrap(),
            Claim::InProgress { .. }
        ));
        tx.rollback().await.unwrap();
        ledger
            .pool()
            .execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
            .await
            .unwrap();
    }
}

/// Polls `fut` once: whether it is ready now (no timer involved).
async fn ready_now<F: std::future::Future>(fut: F) -> bool {
    tokio::time::timeout(Duration::ZERO, fut).await.is_ok()
}

/// A duplicate waiting on a lease this ledger granted is woken by the
/// holder's completion (or release): its watch is a notified one, ready the
/// moment `complete` returns, and the claim it then makes gets the answer. A
/// lease held by another ledger (another process) gets a polling watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_on_this_ledger_is_woken_by_the_completion() {
    let Some(ledger) = ledger_with(MySqlLedgerOptions::default()).await else {
        return;
    };
    let o = ClaimOptions::default().lease(Duration::from_secs(60));
    // Far enough that only a notification can make the watch ready.
    let far = Instant::now() + Duration::from_secs(3600);
    for release in [false, true] {
        let k = key(&fresh_tenant(), "capture", "waited-on");
        let holder = acquired(ledger.claim(&k, &o).await.unwrap());
        assert!(matches!(
            ledger.claim(&k, &o).await.unwrap(),
            Claim::InProgress { .. }
        ));
        let mut watch = ledger.watch(&k).await;
        assert!(watch.is_notified(), "the holder is this ledger's");
        assert!(
            !ready_now(watch.changed(far)).await,
            "woken before the holder finished"
        );
        if release {
            ledger.release(&holder).await.unwrap();
        } else {
            ledger.complete(&holder, &outcome("holder ran")).await.unwrap();
        }
        assert!(
            ready_now(watch.changed(far)).await,
            "not woken by the holder's end"
        );
        match ledger.claim(&k, &o).await.unwrap() {
            Claim::Completed(r) if !release => assert_eq!(r.outcome, Some(outcome("holder ran"))),
            Claim::Acquired(l) if release => assert!(l.fence() > holder.fence()),
            other => panic!("release {release}: {other:?}"),
        }
    }

    // The holder is another ledger (as another process would be): polling.
    let Some(elsewhere) = ledger_with(MySqlLedgerOptions::default()).await else {
        return;
    };
    let k = key(&fresh_tenant(), "capture", "held-elsewhere");
    let holder = acquired(elsewhere.claim(&k, &o).await.unwrap());
    assert!(!ledger.watch(&k).await.is_notified());
    elsewhere.complete(&holder, &outcome("x")).await.unwrap();
    // A lease that ended here is forgotten: its key polls again.
    let k = key(&fresh_tenant(), "capture", "ended-here");
    let l = acquired(ledger.claim(&k, &o).await.unwrap());
    assert!(ledger.watch(&k).await.is_notified());
    ledger.complete(&l, &outcome("x")).await.unwrap();
    assert!(!ledger.watch(&k).await.is_notified());
}

/// What a slot of the mixed batch should answer.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    New,
    Done,
    Live,
    Released,
    Expired,
    Abandoned,
    Mismatch,
    /// The second listing of a new key.
    Twice,
}

/// A batch of 100 keys in every state, listed in a shuffled order: each
/// slot answers as its own claim would; the grants are real (fenced above
/// the previous holder's, live); `complete_many` then completes them in one
/// call, each fenced by its own lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_many_answers_a_mixed_batch_of_100() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        let t = fresh_tenant();
        let fp = Fingerprint::of_bytes(b"the batch's payload");
        let o = ClaimOptions::default().lease(Duration::from_secs(60));
        let short = ClaimOptions::default().lease(Duration::from_millis(300));
        let mut plan: Vec<(EffectKey, Want)> = Vec::new();
        let mut previous = std::collections::HashMap::new();
        for i in 0..20 {
            plan.push((key(&t, "capture", &format!("new-{i}")), Want::New));
        }
        for i in 0..15 {
            let k = key(&t, "capture", &format!("done-{i}"));
            let l = acquired(ledger.claim(&k, &o).await.unwrap());
            ledger.complete(&l, &outcome(&format!("done-{i}"))).await.unwrap();
            plan.push((k, Want::Done));
        }
        for i in 0..15 {
            let k = key(&t, "capture", &format!("live-{i}"));
            previous.insert(k.clone(), acquired(ledger.claim(&k, &o).await.unwrap()).fence());
            plan.push((k, Want::Live));
        }
        for i in 0..15 {
            let k = key(&t, "capture", &format!("released-{i}"));
            let l = acquired(ledger.claim(&k, &o).await.unwrap());
            ledger.release(&l).await.unwrap();
            previous.insert(k.clone(), l.fence());
            plan.push((k, Want::Released));
        }
        for i in 0..15 {
            let k = key(&t, "capture", &format!("expired-{i}"));
            previous.insert(
                k.clone(),
                acquired(ledger.claim(&k, &short).await.unwrap()).fence(),
            );
            plan.push((k, Want::Expired));
        }
        for i in 0..5 {
            let k = key(&t, "send-email", &format!("abandoned-{i}"));
            acquired(ledger.claim(&k, &short.clone().at_most_once(true)).await.unwrap());
            plan.push((k, Want::Abandoned));
        }
        for i in 0..5 {
            let k = key(&t, "capture", &format!("mismatch-{i}"));
            let other = Fingerprint::of_bytes(b"another payload");
            acquired(ledger.claim(&k, &o.clone().fingerprint(other)).await.unwrap());
            plan.push((k, Want::Mismatch));
        }
        for i in 0..10 {
            plan.push((key(&t, "capture", &format!("new-{i}")), Want::Twice));
        }
        assert_eq!(plan.len(), 100);
        tokio::time::sleep(Duration::from_millis(600)).await;
        // Shuffled, but every second listing after its first.
        let mut rng = oncely::conformance::Rng::from_env("claim_many_answers_a_mixed_batch_of_100");
        let (mut firsts, twice): (Vec<_>, Vec<_>) = plan.into_iter().partition(|(_, w)| *w != Want::Twice);
        for i in (1..firsts.len()).rev() {
            firsts.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let plan: Vec<(EffectKey, Want)> = firsts.into_iter().chain(twice).collect();
        let keys: Vec<EffectKey> = plan.iter().map(|(k, _)| k.clone()).collect();

        let answers = ledger
            .claim_many(&keys, &o.clone().fingerprint(fp))
            .await
            .unwrap();
        assert_eq!(answers.len(), 100);
        let mut grants: std::collections::HashMap<EffectKey, Lease> = std::collections::HashMap::new();
        for ((k, want), answer) in plan.iter().zip(answers) {
            match (want, answer) {
                (Want::New, Ok(Claim::Acquired(l))) => {
                    assert!(!l.taken_over());
                    grants.insert(k.clone(), l);
                }
                (Want::Released | Want::Expired, Ok(Claim::Acquired(l))) => {
                    assert!(l.taken_over(), "{k}");
                    assert!(l.fence() > previous[k], "{k}");
                    grants.insert(k.clone(), l);
                }
                (Want::Done, Ok(Claim::Completed(r))) => {
                    assert_eq!(r.outcome, Some(outcome(k.subject())))
                }
                (Want::Live, Ok(Claim::InProgress { fence, .. })) => assert_eq!(fence, previous[k]),
                (Want::Abandoned, Ok(Claim::Abandoned(r))) => assert_eq!(r.state, RecordState::Abandoned),
                (Want::Mismatch, Err(Error::FingerprintMismatch { .. })) => {}
                (Want::Twice, Ok(Claim::InProgress { fence, .. })) => assert_eq!(fence, grants[k].fence()),
                (want, answer) => panic!("{k} ({want:?}): {answer:?}"),
            }
        }
        assert_eq!(grants.len(), 50);
        // The grants are live: a claim of their own finds them in progress.
        for (k, l) in grants.iter().take(5) {
            assert!(matches!(
                ledger.claim(k, &o).await.unwrap(),
                Claim::InProgress { fence, .. } if fence == l.fence()
            ));
        }

        // complete_many: every grant, one stale lease, one lease listed twice.
        let mut items: Vec<(Lease, Outcome)> = grants
            .values()
            .map(|l| (l.clone(), outcome(l.key().subject())))
            .collect();
        let stale_key = key(&t, "capture", "released-0");
        // The fence the released record's previous holder had.
        let stale = oncely::backend::Grant {
            fence: previous[&stale_key],
            ..oncely::backend::Grant::from(&grants[&stale_key])
        }
        .into_lease();
        items.insert(7, (stale, outcome("stale")));
        let again = items[0].clone();
        items.push(again);
        let done = ledger.complete_many(&items).await;
        assert_eq!(done.len(), items.len());
        assert!(done[7].as_ref().unwrap_err().is_lease_lost(), "{:?}", done[7]);
        assert!(done[items.len() - 1].as_ref().unwrap_err().is_lease_lost());
        for (i, r) in done.iter().enumerate() {
            if i != 7 && i != items.len() - 1 {
                r.as_ref().unwrap();
            }
        }
        for l in grants.values() {
            let r = ledger.get(l.key()).await.unwrap().unwrap();
            assert_eq!(r.state, RecordState::Completed, "{}", l.key());
            assert_eq!(r.outcome, Some(outcome(l.key().subject())));
        }
    }
}

/// A batch with `sent_at`: an absent key the horizon covers is refused
/// without a write; existing keys answer for themselves (a released one is
/// taken over); a key of a kind that was never pruned is acquired.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claim_many_keeps_the_horizon() {
    for opts in both_paths() {
        let Some(ledger) = ledger_with(opts).await else {
            return;
        };
        let t = fresh_tenant();
        let o = ClaimOptions::default();
        let done = key(&t, "capture", "done");
        let l = acquired(ledger.claim(&done, &o).await.unwrap());
        ledger.complete(&l, &outcome("done")).await.unwrap();
        let released = key(&t, "capture", "released");
        let l = acquired(ledger.claim(&released, &o).await.unwrap());
        ledger.release(&l).await.unwrap();
        // The ledger has pruned this tenant's captures up to now.
        let now_us = i64::try_from(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_micros(),
        )
        .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO `{}_horizon` (tenant, kind, watermark_us) VALUES (?, 'capture', ?)",
            ledger.table()
        )))
        .bind(t.as_str())
        .bind(now_us)
        .execute(ledger.pool())
        .await
        .unwrap();
        let beyond = key(&t, "capture", "pruned-long-ago");
        let other_kind = key(&t, "refund", "fresh");
        let keys = [beyond.clone(), done.clone(), released.clone(), other_kind.clone()];
        let sent = SystemTime::now() - Duration::from_secs(3600);
        let answers = ledger.claim_many(&keys, &o.clone().sent_at(sent)).await.unwrap();
        assert!(
            matches!(&answers[0], Err(Error::BeyondHorizon { .. })),
            "{:?}",
            answers[0]
        );
        assert!(matches!(&answers[1], Ok(Claim::Completed(_))), "{:?}", answers[1]);
        assert!(
            matches!(&answers[2], Ok(Claim::Acquired(l)) if l.taken_over()),
            "{:?}",
            answers[2]
        );
        assert!(
            matches!(&answers[3], Ok(Claim::Acquired(l)) if !l.taken_over()),
            "{:?}",
            answers[3]
        );
        assert!(
            ledger.get(&beyond).await.unwrap().is_none(),
            "the refused key was written"
        );
    }
}
