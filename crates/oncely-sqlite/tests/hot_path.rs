//! The hot path of a SQLite ledger: waiting duplicates woken by the
//! completion, batches in one transaction, and duplicates that write
//! nothing.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime};

use oncely::backend::Watch;
use oncely::backend::{Claim, Fingerprint, Lease, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey, Effects, Error, OnInProgress, Tenant};
use oncely_sqlite::{SqliteConnection, SqliteLedger, SqliteLedgerOptions, SqliteSynchronous};
use sqlx::Connection;

async fn open(dir: &tempfile::TempDir, options: SqliteLedgerOptions) -> (SqliteLedger, String) {
    let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let ledger = SqliteLedger::connect_with(&url, options.synchronous(SqliteSynchronous::Normal))
        .await
        .unwrap();
    (ledger, url)
}

fn key(t: &Tenant, kind: &str, subject: &str) -> EffectKey {
    EffectKey::new(t, kind, subject).unwrap()
}

fn acquired(claim: Claim) -> Lease {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Whether `watch` has been notified: its `changed` resolves at the first
/// poll (it would otherwise wait for its fallback, a second away). No clock
/// is read: a notification marks the watch, and this looks at the mark.
fn notified(watch: &mut Watch) -> bool {
    let changed = std::pin::pin!(watch.changed(Instant::now() + Duration::from_secs(60)));
    matches!(
        changed.poll(&mut Context::from_waker(Waker::noop())),
        Poll::Ready(())
    )
}

/// A duplicate that waits (`Wait` policy) while another delivery holds the
/// lease is answered by the holder's completion: it gets the holder's
/// outcome and its handler never runs; after a release it acquires and
/// runs. A watch taken next to the waiter's is notified by the write itself
/// (seen failing before the ledger had a notifier: `watch` was the default
/// polling one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_is_woken_by_the_completion() {
    let dir = tempfile::tempdir().unwrap();
    let (ledger, _) = open(&dir, SqliteLedgerOptions::default()).await;
    for release in [false, true] {
        let k = key(&fresh_tenant(), "capture", "waited-on");
        let holder = acquired(
            ledger
                .claim(&k, &ClaimOptions::default().lease(Duration::from_secs(60)))
                .await
                .unwrap(),
        );
        let mut watch = ledger.watch(&k).await;
        assert!(
            watch.is_notified(),
            "in-process waiters are notified, not polling"
        );
        assert!(!notified(&mut watch), "nothing happened yet");
        let ran = Arc::new(AtomicU64::new(0));
        let waiter = {
            let (ledger, k, ran) = (ledger.clone(), k.clone(), ran.clone());
            tokio::spawn(async move {
                let opts = ClaimOptions::default().on_in_progress(OnInProgress::Wait {
                    max: Duration::from_secs(30),
                });
                Effects::new(ledger)
                    .run(&k, &opts, |_| async move {
                        ran.fetch_add(1, Ordering::SeqCst);
                        Ok("waiter ran".to_owned())
                    })
                    .await
            })
        };
        // Let the waiter find the lease and start waiting (a generous
        // pause; nothing below depends on how long it took).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "the waiter did not wait");
        assert!(!notified(&mut watch), "a claim notifies nobody");
        if release {
            ledger.release(&holder).await.unwrap();
        } else {
            ledger
                .complete(&holder, &Outcome::value(&"holder ran").unwrap())
                .await
                .unwrap();
        }
        assert!(notified(&mut watch), "the write woke the key's watchers");
        let answer = waiter.await.unwrap().unwrap();
        if release {
            assert_eq!(answer, "waiter ran");
            assert_eq!(ran.load(Ordering::SeqCst), 1);
        } else {
            assert_eq!(answer, "holder ran");
            assert_eq!(ran.load(Ordering::SeqCst), 0, "the waiter's handler never ran");
        }
    }
}

/// Who wakes whom: every ledger of this process on the same file and table
/// (a clone, or another `connect`), through `complete`, `release`,
/// `complete_many` and `complete_in`; not a ledger on another table, not
/// another key; and with `multi_process(true)` waiters poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_wake_this_process_s_watchers_of_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let (ledger, url) = open(&dir, SqliteLedgerOptions::default()).await;
    let other = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default())
        .await
        .unwrap();
    let elsewhere = ledger.clone().with_table("other_effects").unwrap();
    elsewhere.migrate().await.unwrap();
    let t = fresh_tenant();
    let o = Outcome::value(&1u32).unwrap();

    // complete through another ledger on the same file.
    let k = key(&t, "capture", "a");
    let lease = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    let (mut here, mut neighbour) = (ledger.watch(&k).await, elsewhere.watch(&k).await);
    let mut unrelated = ledger.watch(&key(&t, "capture", "b")).await;
    other.complete(&lease, &o).await.unwrap();
    assert!(notified(&mut here));
    assert!(!notified(&mut neighbour), "another table, another set of records");
    assert!(!notified(&mut unrelated), "another key");

    // complete_many, for each key it completed (and not for a stale lease).
    let (a, b) = (key(&t, "capture", "many-a"), key(&t, "capture", "many-b"));
    let la = acquired(ledger.claim(&a, &ClaimOptions::default()).await.unwrap());
    let lb = acquired(ledger.claim(&b, &ClaimOptions::default()).await.unwrap());
    ledger.release(&lb).await.unwrap();
    let (mut wa, mut wb) = (ledger.watch(&a).await, ledger.watch(&b).await);
    let answers = ledger.complete_many(&[(la, o.clone()), (lb, o.clone())]).await;
    assert!(answers[0].is_ok() && answers[1].as_ref().unwrap_err().is_lease_lost());
    assert!(notified(&mut wa));
    assert!(!notified(&mut wb), "a completion that failed changed nothing");

    // complete_in, on the caller's transaction.
    let k = key(&t, "capture", "in-tx");
    let lease = acquired(ledger.claim(&k, &ClaimOptions::default()).await.unwrap());
    let mut w = ledger.watch(&k).await;
    let mut tx = ledger.begin().await.unwrap();
    ledger.complete_in(&mut tx, &lease, &o).await.unwrap();
    ledger.commit(tx).await.unwrap();
    assert!(notified(&mut w));

    let polling = SqliteLedger::connect_with(&url, SqliteLedgerOptions::default().multi_process(true))
        .await
        .unwrap();
    assert!(!polling.watch(&k).await.is_notified());
}

/// Claims the key `k` in the state `state` names, for the mixed batch.
async fn prepare(ledger: &SqliteLedger, k: &EffectKey, state: usize, fp: Fingerprint) -> Option<Lease> {
    let opts = ClaimOptions::default().fingerprint(fp);
    let done = |s: &str| Outcome::value(&s.to_owned()).unwrap();
    match state {
        1 | 9 => {
            let l = acquired(ledger.claim(k, &opts).await.unwrap());
            ledger.complete(&l, &done(k.subject())).await.unwrap();
            None
        }
        2 => Some(acquired(
            ledger
                .claim(k, &opts.lease(Duration::from_secs(60)))
                .await
                .unwrap(),
        )),
        3 => {
            let l = acquired(ledger.claim(k, &opts).await.unwrap());
            ledger.release(&l).await.unwrap();
            Some(l)
        }
        4 => Some(acquired(
            ledger
                .claim(k, &opts.lease(Duration::from_millis(200)))
                .await
                .unwrap(),
        )),
        5 => Some(acquired(
            ledger
                .claim(k, &opts.lease(Duration::from_millis(200)).at_most_once(true))
                .await
                .unwrap(),
        )),
        6 => {
            let other = ClaimOptions::default().fingerprint(Fingerprint::of_bytes(b"another payload"));
            Some(acquired(ledger.claim(k, &other).await.unwrap()))
        }
        _ => None,
    }
}

/// A batch of 100 keys in every state at once, claimed in one transaction:
/// each slot gets what a claim of its own would (new: acquired; completed:
/// its record; live: in progress; released or expired: taken over with a
/// higher fence; expired at-most-once: abandoned; another payload:
/// fingerprint mismatch; a key listed twice: in progress under the first
/// slot's lease; an absent key older than its kind's horizon: beyond the
/// horizon; an existing key of that kind: its record). The claim and the
/// completion of the batch are one commit each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_100_in_mixed_states_is_one_transaction() {
    let dir = tempfile::tempdir().unwrap();
    // One connection, so the commit hook below sees every commit.
    let (ledger, _) = open(&dir, SqliteLedgerOptions::default().max_connections(1)).await;
    let t = fresh_tenant();
    let fp = Fingerprint::of_bytes(b"the payload");

    // Kind `old` has a horizon: prune removed a record of it.
    let gone = key(&t, "old", "pruned");
    let short = ClaimOptions::default()
        .lease(Duration::from_millis(1))
        .retention(Duration::from_millis(1));
    let l = acquired(ledger.claim(&gone, &short).await.unwrap());
    ledger.complete(&l, &Outcome::value(&0).unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(ledger.prune(1000).await.unwrap(), 1);
    assert!(ledger.horizon(&t, "old").await.unwrap().is_some());

    // Slot i is in state i % 10; state 7 lists the key of slot i - 7 again.
    let mut keys: Vec<EffectKey> = Vec::new();
    let mut held = Vec::new();
    for i in 0..100 {
        let state = i % 10;
        let k = match state {
            7 => keys[i - 7].clone(),
            8 | 9 => key(&t, "old", &format!("k{i}")),
            _ => key(&t, "capture", &format!("k{i}")),
        };
        held.push(prepare(&ledger, &k, state, fp).await);
        keys.push(k);
    }
    // Past the 200 ms leases of states 4 and 5, with room to spare.
    tokio::time::sleep(Duration::from_millis(600)).await;

    let commits = Arc::new(AtomicU64::new(0));
    {
        let mut conn = ledger.pool().acquire().await.unwrap();
        let mut handle = conn.lock_handle().await.unwrap();
        let n = commits.clone();
        handle.set_commit_hook(move || {
            n.fetch_add(1, Ordering::SeqCst);
            true
        });
    }
    let opts = ClaimOptions::default()
        .fingerprint(fp)
        .lease(Duration::from_secs(60))
        .sent_at(SystemTime::UNIX_EPOCH + Duration::from_secs(1));
    let answers = ledger.claim_many(&keys, &opts).await.unwrap();
    assert_eq!(commits.load(Ordering::SeqCst), 1, "one transaction for the batch");
    assert_eq!(answers.len(), 100);

    let mut leases = Vec::new();
    for (i, answer) in answers.iter().enumerate() {
        let (k, state) = (&keys[i], i % 10);
        let earlier = held[i].as_ref().map(Lease::fence);
        match (state, answer) {
            (0, Ok(Claim::Acquired(l))) => assert!(!l.taken_over()),
            (1 | 9, Ok(Claim::Completed(r))) => {
                assert_eq!(
                    r.stored::<String>().unwrap().unwrap().into_result(k).unwrap(),
                    k.subject()
                )
            }
            (2, Ok(Claim::InProgress { fence, .. })) => assert_eq!(Some(*fence), earlier),
            (3 | 4, Ok(Claim::Acquired(l))) => {
                assert!(l.taken_over() && Some(l.fence()) > earlier, "slot {i}: {l:?}")
            }
            (5, Ok(Claim::Abandoned(r))) => assert_eq!(r.state, RecordState::Abandoned),
            (6, Err(Error::FingerprintMismatch { .. })) => {}
            (7, Ok(Claim::InProgress { fence, .. })) => match &answers[i - 7] {
                Ok(Claim::Acquired(first)) => assert_eq!(*fence, first.fence()),
                other => panic!("slot {}: {other:?}", i - 7),
            },
            (8, Err(Error::BeyondHorizon { .. })) => {}
            (state, answer) => panic!("slot {i} (state {state}, {k}): {answer:?}"),
        }
        if let Ok(Claim::Acquired(l)) = answer {
            leases.push((l.clone(), Outcome::value(&format!("batch-{i}")).unwrap()));
        }
    }
    assert_eq!(leases.len(), 30);
    // Nothing of kind `old` beyond the horizon was written.
    assert!(ledger.get(&keys[8]).await.unwrap().is_none());

    // The stale leases of the taken-over keys fail in their own slots.
    let mut items = leases.clone();
    for i in (3..100).step_by(10) {
        items.push((held[i].clone().unwrap(), Outcome::value(&"stale").unwrap()));
    }
    let before = commits.load(Ordering::SeqCst);
    let done = ledger.complete_many(&items).await;
    assert_eq!(
        commits.load(Ordering::SeqCst),
        before + 1,
        "one transaction for the batch"
    );
    assert!(done[..30].iter().all(Result::is_ok), "{done:?}");
    assert!(
        done[30..].iter().all(|d| d.as_ref().unwrap_err().is_lease_lost()),
        "{done:?}"
    );
    for (lease, outcome) in &leases {
        let r = ledger.get(lease.key()).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.outcome.as_ref()),
            (RecordState::Completed, Some(outcome))
        );
    }
}

/// A batch whose transaction cannot start (another writer holds the lock
/// past the busy timeout) answers every slot with the retryable error and
/// writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_fails_every_slot_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (ledger, url) = open(
        &dir,
        SqliteLedgerOptions::default().busy_timeout(Duration::from_millis(100)),
    )
    .await;
    let t = fresh_tenant();
    let keys: Vec<EffectKey> = (0..3).map(|i| key(&t, "capture", &format!("k{i}"))).collect();
    let mut blocker = SqliteConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut blocker)
        .await
        .unwrap();
    let answers = ledger.claim_many(&keys, &ClaimOptions::default()).await.unwrap();
    assert_eq!(answers.len(), 3);
    for a in &answers {
        assert!(a.as_ref().unwrap_err().is_retryable(), "{a:?}");
    }
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    for k in &keys {
        assert!(ledger.get(k).await.unwrap().is_none());
    }
}

/// What an observer can see of writes: the WAL's size (emptied first), the
/// database's `data_version` from another connection, and the ledger's one
/// connection's `total_changes()`.
struct Writes {
    wal: std::path::PathBuf,
    observer: SqliteConnection,
}

impl Writes {
    async fn new(ledger: &SqliteLedger, url: &str, dir: &tempfile::TempDir) -> (Writes, (u64, i64, i64)) {
        let mut observer = SqliteConnection::connect(url).await.unwrap();
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut observer)
            .await
            .unwrap();
        let mut w = Writes {
            wal: dir.path().join("ledger.db-wal"),
            observer,
        };
        let seen = w.seen(ledger).await;
        assert_eq!(seen.0, 0, "the WAL starts empty");
        (w, seen)
    }

    async fn seen(&mut self, ledger: &SqliteLedger) -> (u64, i64, i64) {
        let wal = std::fs::metadata(&self.wal).map(|m| m.len()).unwrap_or(0);
        let version: i64 = sqlx::query_scalar("PRAGMA data_version")
            .fetch_one(&mut self.observer)
            .await
            .unwrap();
        let changes: i64 = sqlx::query_scalar("SELECT total_changes()")
            .fetch_one(ledger.pool())
            .await
            .unwrap();
        (wal, version, changes)
    }
}

/// A duplicate of a completed effect, or of one in progress under a live
/// lease, is a read: single claims and batches of them append no WAL frame
/// (so nothing to fsync), change no row and leave `data_version` alone.
/// The claim statement does take SQLite's write lock for its duration (any
/// INSERT does) and ends a write transaction that wrote no page. The same
/// observer sees a write that changes no value (the control), so it is able
/// to fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_claim_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (ledger, url) = open(&dir, SqliteLedgerOptions::default().max_connections(1)).await;
    let t = fresh_tenant();
    let (done, live) = (key(&t, "capture", "done"), key(&t, "capture", "live"));
    let l = acquired(ledger.claim(&done, &ClaimOptions::default()).await.unwrap());
    ledger.complete(&l, &Outcome::value(&1).unwrap()).await.unwrap();
    acquired(ledger.claim(&live, &ClaimOptions::default()).await.unwrap());

    let (mut writes, before) = Writes::new(&ledger, &url, &dir).await;
    for _ in 0..50 {
        assert!(matches!(
            ledger.claim(&done, &ClaimOptions::default()).await.unwrap(),
            Claim::Completed(_)
        ));
        assert!(matches!(
            ledger.claim(&live, &ClaimOptions::default()).await.unwrap(),
            Claim::InProgress { .. }
        ));
        let batch = ledger
            .claim_many(&[done.clone(), live.clone()], &ClaimOptions::default())
            .await
            .unwrap();
        assert!(matches!(batch[0], Ok(Claim::Completed(_))));
        assert!(matches!(batch[1], Ok(Claim::InProgress { .. })));
    }
    assert_eq!(
        writes.seen(&ledger).await,
        before,
        "(WAL bytes, data_version, changes)"
    );

    // The control: a one-row write is seen by all three. (It must change a
    // value: SQLite skips rewriting a cell whose content is unchanged, so
    // `SET fence = fence` counts a change but writes no page.)
    sqlx::query("UPDATE oncely_effects SET updated_at = updated_at + 1 WHERE key = ?1")
        .bind(done.as_str())
        .execute(ledger.pool())
        .await
        .unwrap();
    let after = writes.seen(&ledger).await;
    assert!(
        after.0 > before.0 && after.1 != before.1 && after.2 == before.2 + 1,
        "{after:?}"
    );
}
