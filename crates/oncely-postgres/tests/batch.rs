//! `claim_many` and `complete_many` on PostgreSQL: one statement per batch
//! that keeps every rule of the single claim (per-key locks in a fixed
//! order, the clock read after them, the horizon, fingerprints, takeovers,
//! the leaked-transaction guard). The conformance suite checks the answers
//! on a handful of keys; these check a full batch of mixed states, lock
//! waits, the horizon, overlapping batches in any order, and a leaked
//! transaction.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely::backend::{Claim, Fingerprint, Lease, Ledger, Outcome, RecordState, TransactionalLedger};
use oncely::conformance::{fresh_tenant, prune_until_gone, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Error, Tenant};
use oncely_postgres::{PgLedger, PgLedgerOptions};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

const TABLE: &str = "oncely_pg_batch";

static MIGRATED: tokio::sync::Mutex<bool> = tokio::sync::Mutex::const_new(false);

fn url() -> Option<String> {
    service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )
}

async fn pool(url: &str, max: u32) -> Option<PgPool> {
    match PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
    {
        Ok(p) => Some(p),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}

/// A ledger on a pool of `max` connections, and an observer pool that reads
/// what is committed.
async fn setup(max: u32) -> Option<(PgLedger, PgPool)> {
    let url = url()?;
    let ledger =
        PgLedger::from_pool_with(pool(&url, max).await?, PgLedgerOptions::default().table(TABLE)).unwrap();
    let mut migrated = MIGRATED.lock().await;
    if !*migrated {
        ledger.migrate().await.unwrap();
        *migrated = true;
    }
    drop(migrated);
    Some((ledger, pool(&url, 2).await?))
}

fn key(t: &Tenant, subject: &str) -> EffectKey {
    EffectKey::new(t, "capture", subject).unwrap()
}

fn acquired(c: Claim) -> Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn committed(observer: &PgPool, key: &EffectKey) -> Option<String> {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT state FROM {TABLE} WHERE key = $1")))
        .bind(key.as_str())
        .fetch_optional(observer)
        .await
        .unwrap()
}

/// What a key was before the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Was {
    New,
    Completed,
    Live,
    Released,
    Expired,
    OtherPayload,
}

const KINDS: [Was; 6] = [
    Was::New,
    Was::Completed,
    Was::Live,
    Was::Released,
    Was::Expired,
    Was::OtherPayload,
];

/// A batch of 100 keys in every state, shuffled, with some keys listed
/// twice: each key gets what a claim of its own would, the repeats what a
/// concurrent duplicate would; `complete_many` then completes every lease
/// the batch acquired (fenced each on its own), and the next batch finds
/// them completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_100_mixed_keys_is_answered_like_single_claims() {
    let Some((ledger, observer)) = setup(8).await else {
        return;
    };
    let t = fresh_tenant();
    let fp = Fingerprint::of_bytes(b"the batch's payload");
    let opts = ClaimOptions::default().fingerprint(fp);
    let short = Duration::from_millis(300);
    let mut was: HashMap<EffectKey, Was> = HashMap::new();
    let mut before: HashMap<EffectKey, Lease> = HashMap::new();
    // 100 keys, states cycling through KINDS, in a scrambled order.
    let mut keys: Vec<EffectKey> = (0..100)
        .map(|i| key(&t, &format!("k-{:03}", (i * 37) % 100)))
        .collect();
    for (i, k) in keys.iter().enumerate() {
        let kind = KINDS[i % KINDS.len()];
        was.insert(k.clone(), kind);
        let setup = match kind {
            Was::New => continue,
            Was::Expired => opts.clone().lease(short),
            Was::OtherPayload => ClaimOptions::default().fingerprint(Fingerprint::of_bytes(b"another")),
            _ => opts.clone().lease(Duration::from_secs(120)),
        };
        let lease = acquired(ledger.claim(k, &setup).await.unwrap());
        match kind {
            Was::Completed => ledger
                .complete(&lease, &Outcome::value(&format!("done {k}")).unwrap())
                .await
                .unwrap(),
            Was::Released => ledger.release(&lease).await.unwrap(),
            _ => {}
        }
        before.insert(k.clone(), lease);
    }
    tokio::time::sleep(short * 2).await;
    // Repeats of one key of each state, at the end.
    let repeats: Vec<EffectKey> = KINDS
        .iter()
        .map(|w| keys.iter().find(|k| was[*k] == *w).unwrap().clone())
        .collect();
    keys.extend(repeats.iter().cloned());

    let answers = ledger.claim_many(&keys, &opts).await.unwrap();
    assert_eq!(answers.len(), keys.len());
    let mut got: HashMap<EffectKey, Lease> = HashMap::new();
    for (n, (k, answer)) in keys.iter().zip(answers).enumerate() {
        let repeat = n >= 100;
        match (was[k], answer) {
            // The first occurrence acquired: the repeat finds it in progress.
            (Was::New | Was::Released | Was::Expired, Ok(Claim::InProgress { fence, .. })) if repeat => {
                assert_eq!(fence, got[k].fence(), "{k}");
            }
            (Was::New, Ok(Claim::Acquired(l))) => {
                assert!(!l.taken_over(), "{k}");
                assert_eq!(
                    l.expires_at().duration_since(l.acquired_at()).unwrap(),
                    opts.lease
                );
                got.insert(k.clone(), l);
            }
            (Was::Released | Was::Expired, Ok(Claim::Acquired(l))) => {
                assert!(l.taken_over(), "{k}");
                assert!(l.fence() > before[k].fence(), "{k}");
                assert_eq!(l.first_claimed_at(), before[k].first_claimed_at());
                got.insert(k.clone(), l);
            }
            (Was::Completed, Ok(Claim::Completed(r))) => {
                assert_eq!(r.outcome, Some(Outcome::value(&format!("done {k}")).unwrap()));
                assert_eq!(r.fence, before[k].fence());
            }
            (
                Was::Live,
                Ok(Claim::InProgress {
                    fence, expires_at, ..
                }),
            ) => {
                assert_eq!(fence, before[k].fence(), "{k}");
                assert_eq!(expires_at, before[k].expires_at());
            }
            (Was::OtherPayload, Err(Error::FingerprintMismatch { key })) => assert_eq!(key, k.to_string()),
            (w, other) => panic!("{k} (was {w:?}, repeat {repeat}): {other:?}"),
        }
    }
    assert_eq!(got.len(), 50);
    // Each key's lease is real: it is in progress, for everyone.
    for k in got.keys() {
        assert_eq!(committed(&observer, k).await.as_deref(), Some("in_progress"));
    }

    // Complete them all in one call, with a stale lease (the released key's
    // first holder) and a lease listed twice in the same call.
    let mut items: Vec<(Lease, Outcome)> = got
        .values()
        .map(|l| (l.clone(), Outcome::value(&format!("batch {}", l.key())).unwrap()))
        .collect();
    let released = keys.iter().find(|k| was[*k] == Was::Released).unwrap();
    items.push((before[released].clone(), Outcome::value(&"stale").unwrap()));
    items.push(items[0].clone());
    let done = ledger.complete_many(&items).await;
    assert_eq!(done.len(), items.len());
    for (n, ((lease, _), answer)) in items.iter().zip(&done).enumerate() {
        if n < got.len() {
            assert!(answer.is_ok(), "{}: {answer:?}", lease.key());
        } else {
            assert!(answer.as_ref().unwrap_err().is_lease_lost(), "{n}: {answer:?}");
        }
    }
    let again = ledger.claim_many(&keys[..100], &opts).await.unwrap();
    for (k, answer) in keys.iter().zip(again) {
        match (was[k], answer) {
            (Was::Live, Ok(Claim::InProgress { .. })) | (Was::OtherPayload, Err(_)) => {}
            (Was::Completed, Ok(Claim::Completed(_))) => {}
            (_, Ok(Claim::Completed(r))) => {
                assert_eq!(r.state, RecordState::Completed);
                assert_eq!(r.outcome, Some(Outcome::value(&format!("batch {k}")).unwrap()));
            }
            (w, other) => panic!("{k} (was {w:?}): {other:?}"),
        }
    }
}

/// A batch that waits on one of its keys' locks (a transaction holds the
/// key) gets, once the transaction rolls back, leases measured from after
/// the wait (on the database's clock), not from when its statement began.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_waited_on_a_lock_gets_live_leases() {
    let Some((ledger, observer)) = setup(4).await else {
        return;
    };
    let t = fresh_tenant();
    let held = key(&t, "held");
    let free = key(&t, "free");
    let lease = Duration::from_millis(1500);
    let mut tx = ledger.begin().await.unwrap();
    acquired(
        ledger
            .claim_in(&mut *tx, &held, &ClaimOptions::default().lease(lease))
            .await
            .unwrap(),
    );
    let batch = {
        let (ledger, keys) = (ledger.clone(), vec![free.clone(), held.clone()]);
        tokio::spawn(async move {
            ledger
                .claim_many(&keys, &ClaimOptions::default().lease(lease))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!batch.is_finished(), "the batch did not wait for the held key");
    // Longer than the lease: a lease measured from the statement's start
    // would be over by the time the batch gets it.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    let released_at: SystemTime = db_clock(&observer).await;
    ledger.rollback(tx).await.unwrap();
    let answers = batch.await.unwrap().unwrap();
    for answer in answers {
        let l = acquired(answer.unwrap());
        assert!(
            l.acquired_at() >= released_at,
            "{}: acquired before the wait ended",
            l.key()
        );
        assert_eq!(l.expires_at().duration_since(l.acquired_at()).unwrap(), lease);
    }
    // So a claim right after finds both in progress, not over.
    for k in [&held, &free] {
        assert!(matches!(
            ledger.claim(k, &ClaimOptions::default()).await.unwrap(),
            Claim::InProgress { .. }
        ));
    }
}

/// The database's clock now.
async fn db_clock(observer: &PgPool) -> SystemTime {
    let us: i64 = sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint")
        .fetch_one(observer)
        .await
        .unwrap();
    SystemTime::UNIX_EPOCH + Duration::from_micros(us as u64)
}

/// An old batch (its `sent_at` at or before the horizon of its tenant and
/// kind) takes over the released record it finds, and inserts no absent key
/// (`BeyondHorizon` in that key's slot only); a key of another kind, whose
/// horizon is not raised, is new work.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_old_batch_takes_over_but_never_inserts() {
    let Some((ledger, observer)) = setup(4).await else {
        return;
    };
    let t = fresh_tenant();
    let old = SystemTime::now() - Duration::from_secs(3600);
    let day = ClaimOptions::default().retention(Duration::from_secs(86_400));
    let released = key(&t, "released");
    let first = acquired(ledger.claim(&released, &day).await.unwrap());
    ledger.release(&first).await.unwrap();
    let brief = ClaimOptions::default()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(200));
    let pruned = key(&t, "pruned");
    let p = acquired(ledger.claim(&pruned, &brief).await.unwrap());
    ledger.complete(&p, &Outcome::value(&1).unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    prune_until_gone(&ledger, &pruned).await;
    assert!(ledger.horizon(&t, "capture").await.unwrap().unwrap() > old);

    let absent = key(&t, "absent");
    let elsewhere = EffectKey::new(&t, "refund", "absent").unwrap();
    let keys = [
        released.clone(),
        pruned.clone(),
        absent.clone(),
        elsewhere.clone(),
    ];
    let answers = ledger.claim_many(&keys, &day.sent_at(old)).await.unwrap();
    let mut answers = answers.into_iter();
    let l = acquired(answers.next().unwrap().unwrap());
    assert!(l.taken_over() && l.fence() > first.fence());
    for k in [&pruned, &absent] {
        let e = answers.next().unwrap().unwrap_err();
        assert!(
            matches!(&e, Error::BeyondHorizon { key } if *key == k.to_string()),
            "{e:?}"
        );
        assert_eq!(committed(&observer, k).await, None, "{k} inserted");
    }
    assert!(!acquired(answers.next().unwrap().unwrap()).taken_over());
}

/// Overlapping batches listing the same keys in different orders, all at
/// once: each key is acquired exactly once per round, and no batch fails
/// (the statement takes the keys' locks in one order, whatever order the
/// batch lists them in, so batches never deadlock).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_batches_in_any_order_never_deadlock() {
    let Some((ledger, _observer)) = setup(8).await else {
        return;
    };
    let t = fresh_tenant();
    for round in 0..10 {
        let keys: Vec<EffectKey> = (0..50).map(|i| key(&t, &format!("r{round}-{i:02}"))).collect();
        let barrier = Arc::new(tokio::sync::Barrier::new(4));
        let tasks: Vec<_> = (0..4)
            .map(|b| {
                // Forward, backward, odd-even, and rotated orders.
                let mut batch = keys.clone();
                match b {
                    1 => batch.reverse(),
                    2 => batch.sort_by_key(|k| (k.subject().len() % 2, k.subject().to_owned())),
                    3 => batch.rotate_left(17),
                    _ => {}
                }
                let (ledger, barrier) = (ledger.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let answers = ledger.claim_many(&batch, &ClaimOptions::default()).await.unwrap();
                    batch.into_iter().zip(answers).collect::<Vec<_>>()
                })
            })
            .collect();
        let mut won: HashMap<EffectKey, usize> = HashMap::new();
        for task in tasks {
            for (k, answer) in task.await.unwrap() {
                match answer {
                    Ok(Claim::Acquired(_)) => *won.entry(k).or_default() += 1,
                    Ok(Claim::InProgress { .. }) => {
                        won.entry(k).or_default();
                    }
                    other => panic!("round {round}, {k}: {other:?}"),
                }
            }
        }
        assert_eq!(won.len(), 50);
        assert!(won.values().all(|n| *n == 1), "round {round}: {won:?}");
    }
}

/// A batch on a connection someone left inside a transaction (a raw
/// `BEGIN` returned to the pool): the guard trips, the ledger rolls the
/// stray transaction back and runs the batch again, so every claim and
/// completion is committed and visible from another pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_survive_a_leaked_transaction() {
    let Some((_ledger, observer)) = setup(2).await else {
        return;
    };
    let Some(url) = url() else { return };
    let Some(one) = pool(&url, 1).await else { return };
    let ledger = PgLedger::from_pool_with(one.clone(), PgLedgerOptions::default().table(TABLE)).unwrap();
    let leak = async || {
        let mut conn = one.acquire().await.unwrap();
        sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
    };
    let t = fresh_tenant();
    let keys: Vec<EffectKey> = (0..20).map(|i| key(&t, &format!("leak-{i}"))).collect();
    leak().await;
    let leases: Vec<Lease> = ledger
        .claim_many(&keys, &ClaimOptions::default())
        .await
        .unwrap()
        .into_iter()
        .map(|a| acquired(a.unwrap()))
        .collect();
    for k in &keys {
        assert_eq!(
            committed(&observer, k).await.as_deref(),
            Some("in_progress"),
            "{k}"
        );
    }
    leak().await;
    let items: Vec<(Lease, Outcome)> = leases
        .into_iter()
        .map(|l| (l, Outcome::value(&"done").unwrap()))
        .collect();
    for answer in ledger.complete_many(&items).await {
        answer.unwrap();
    }
    for k in &keys {
        assert_eq!(committed(&observer, k).await.as_deref(), Some("completed"), "{k}");
    }
    one.close().await;
}

/// Batches are refused before any round trip like single claims: invalid
/// options, a read-only ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_batches_are_refused_before_the_round_trip() {
    let Some((ledger, _observer)) = setup(2).await else {
        return;
    };
    let t = fresh_tenant();
    let keys = [key(&t, "a"), key(&t, "b")];
    let e = ledger
        .claim_many(&keys, &ClaimOptions::default().lease(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(e.is_invalid_input(), "{e:?}");
    let leases: Vec<Lease> = ledger
        .claim_many(&keys, &ClaimOptions::default())
        .await
        .unwrap()
        .into_iter()
        .map(|a| acquired(a.unwrap()))
        .collect();
    let Some(url) = url() else { return };
    let ro = PgLedger::connect_with(&url, PgLedgerOptions::default().table(TABLE).read_only(true))
        .await
        .unwrap();
    assert!(matches!(
        ro.claim_many(&keys, &ClaimOptions::default()).await,
        Err(Error::Config(_))
    ));
    assert!(matches!(
        ro.complete_many(&[(leases[0].clone(), Outcome::value(&1).unwrap())])
            .await[0],
        Err(Error::Config(_))
    ));
}
