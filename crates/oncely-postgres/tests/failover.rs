//! A primary with a streaming standby (`scripts/pg-standby.sh`, ports
//! 5440/5441): the primary killed (SIGKILL) or frozen (SIGSTOP) while eight
//! workers run `Effects::run` over many keys, the standby promoted at once,
//! the workers following it through the URL's host list, then every key
//! delivered again. Each test starts from a fresh pair and they run one at a
//! time (one pair per binary).
//!
//! What is counted, per key: how many times its handler ran, and the first
//! outcome a worker was given back (the completion was acknowledged). A
//! *lost completion* is a key whose record on the new primary does not hold
//! that outcome; a *second run* is a key whose handler ran again after its
//! first run's completion was acknowledged.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncely::backend::{Ledger, RecordState};
use oncely::{ClaimOptions, EffectKey, Effects, Error, How, OnInProgress, Tenant};
use oncely_postgres::{PgLedger, PgLedgerOptions};

const PORT: u16 = 5440;
const WORKERS: usize = 8;
const KEYS: usize = 3000;
/// When the fault strikes, after the workers start.
const FAULT_AT: Duration = Duration::from_secs(2);
/// The generous bound on any one call (a worker's run, the waiter's): the
/// operation timeout is 3 s, the waiter's `max` 5 s.
const CALL_DEADLINE: Duration = Duration::from_secs(60);
/// The bound on the whole first pass.
const PASS_DEADLINE: Duration = Duration::from_secs(180);

/// One pair for the whole binary: the tests run one at a time.
static PAIR: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn options() -> PgLedgerOptions {
    PgLedgerOptions::default()
        .table("oncely_failover")
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(2))
        .operation_timeout(Duration::from_secs(3))
}

fn claim_options() -> ClaimOptions {
    // A short lease: a claim whose answer was lost in the failover is taken
    // over by the redelivery within the test.
    ClaimOptions::default()
        .lease(Duration::from_secs(4))
        .on_in_progress(OnInProgress::Wait {
            max: Duration::from_secs(10),
        })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Freeze,
}

#[derive(Debug, Default)]
struct Report {
    /// Keys whose acknowledged outcome is not what the new primary holds.
    lost: usize,
    /// Keys whose handler ran again after an acknowledged completion.
    second_runs: usize,
    /// Keys whose handler ran more than once after a completion that was
    /// not acknowledged (Error::OutcomeUnknown): what provider keys bound.
    reruns_after_unknown: usize,
    /// Calls that did not return within CALL_DEADLINE.
    stuck: usize,
    /// The first pass's errors, by kind.
    unavailable: usize,
    outcome_unknown: usize,
    other_errors: usize,
    /// The first of them, for the log.
    first_other: Option<String>,
    /// Keys that never got an answer in the first pass.
    unanswered: usize,
    /// Keys answered when the fault struck (fewer than KEYS: it struck
    /// mid-run).
    done_at_fault: usize,
    /// The waiter's answer (Freeze only), if it returned.
    waiter: Option<String>,
}

struct Shared {
    effects: Effects<PgLedger>,
    tenant: Tenant,
    runs: Vec<AtomicU32>,
    /// The first outcome a worker got back per key, how, and how many
    /// times the handler had run by then.
    acked: Mutex<Vec<Option<(String, How, u32)>>>,
    /// Whether a key's first run ended in OutcomeUnknown before any ack.
    unknown: Vec<AtomicU32>,
    queue: Mutex<VecDeque<usize>>,
    done: AtomicUsize,
}

impl Shared {
    fn key(&self, n: usize) -> EffectKey {
        EffectKey::new(&self.tenant, "failover", format!("k{n}")).unwrap()
    }

    /// One delivery of key `n`: `Ok` with the outcome and how, or the error.
    async fn deliver(&self, n: usize) -> Option<Result<(String, How), Error>> {
        let key = self.key(n);
        let opts = claim_options();
        let run = self.effects.run_reported(&key, &opts, |_lease| async move {
            let run = self.runs[n].fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(Duration::from_millis(4)).await;
            Ok(format!("k{n} run {run}"))
        });
        match tokio::time::timeout(CALL_DEADLINE, run).await {
            Ok(answer) => Some(answer.map(|r| (r.value, r.how))),
            Err(_) => None,
        }
    }
}

async fn worker(shared: Arc<Shared>, report: Arc<Mutex<Report>>) {
    let deadline = tokio::time::Instant::now() + PASS_DEADLINE;
    while tokio::time::Instant::now() < deadline {
        let next = shared.queue.lock().unwrap().pop_front();
        let Some(n) = next else {
            if shared.done.load(Ordering::SeqCst) == KEYS {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        match shared.deliver(n).await {
            Some(Ok((outcome, how))) => {
                let runs = shared.runs[n].load(Ordering::SeqCst);
                shared.acked.lock().unwrap()[n] = Some((outcome, how, runs));
                shared.done.fetch_add(1, Ordering::SeqCst);
            }
            answer => {
                {
                    let mut r = report.lock().unwrap();
                    match answer {
                        None => r.stuck += 1,
                        Some(Err(Error::Unavailable { .. })) => r.unavailable += 1,
                        Some(Err(Error::OutcomeUnknown { .. })) => {
                            r.outcome_unknown += 1;
                            shared.unknown[n].store(1, Ordering::SeqCst);
                        }
                        Some(Err(e)) => {
                            r.other_errors += 1;
                            r.first_other.get_or_insert_with(|| e.to_string());
                        }
                        Some(Ok(_)) => unreachable!(),
                    }
                }
                // Redelivered later, as a broker would.
                shared.queue.lock().unwrap().push_back(n);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn script(args: &[&str]) {
    common::run(PORT, args).unwrap_or_else(|e| panic!("{e}"));
}

/// The workload against a fresh pair in `mode`, with `fault` at FAULT_AT and
/// the standby promoted right after.
async fn failover(mode: &str, fault: Fault) -> Option<Report> {
    let url = common::fresh_pair(PORT, mode)?;
    let ledger = PgLedger::connect_with(&url, options()).await.expect("connects");
    let shared = Arc::new(Shared {
        effects: Effects::new(ledger.clone()),
        tenant: oncely::conformance::fresh_tenant(),
        runs: (0..KEYS).map(|_| AtomicU32::new(0)).collect(),
        acked: Mutex::new(vec![None; KEYS]),
        unknown: (0..KEYS).map(|_| AtomicU32::new(0)).collect(),
        queue: Mutex::new((0..KEYS).collect()),
        done: AtomicUsize::new(0),
    });
    let report = Arc::new(Mutex::new(Report::default()));

    // A duplicate that waits on a key another holder keeps, across the
    // freeze: it must return within its max plus the operation timeout.
    let held = shared.key(KEYS + 1);
    if fault == Fault::Freeze {
        let holder = PgLedger::connect_with(&url, options()).await.expect("connects");
        let opts = ClaimOptions::default().lease(Duration::from_secs(120));
        assert!(matches!(
            holder.claim(&held, &opts).await,
            Ok(oncely::backend::Claim::Acquired(_))
        ));
    }

    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(worker(shared.clone(), report.clone())))
        .collect();
    tokio::time::sleep(FAULT_AT - Duration::from_millis(500)).await;
    let waiter = (fault == Fault::Freeze).then(|| {
        let effects = Effects::new(ledger.clone());
        let held = held.clone();
        tokio::spawn(async move {
            let opts = ClaimOptions::default().on_in_progress(OnInProgress::Wait {
                max: Duration::from_secs(5),
            });
            let run = effects.run(&held, &opts, |_| async { Ok("the waiter ran".to_owned()) });
            match tokio::time::timeout(CALL_DEADLINE, run).await {
                Ok(Ok(v)) => Some(v),
                Ok(Err(e)) => Some(format!("error: {e}")),
                Err(_) => None,
            }
        })
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let done_at_fault = shared.done.load(Ordering::SeqCst);
    tokio::task::spawn_blocking(move || {
        script(&[match fault {
            Fault::Kill => "kill-primary",
            Fault::Freeze => "freeze-primary",
        }]);
        script(&["promote"]);
    })
    .await
    .unwrap();
    for w in workers {
        w.await.unwrap();
    }
    let mut report = Arc::try_unwrap(report).unwrap().into_inner().unwrap();
    if let Some(waiter) = waiter {
        match waiter.await.unwrap() {
            Some(answer) => report.waiter = Some(answer),
            None => report.stuck += 1,
        }
    }
    report.unanswered = KEYS - shared.done.load(Ordering::SeqCst);
    report.done_at_fault = done_at_fault;
    assert!(done_at_fault < KEYS, "the fault struck mid-run: {report:?}");

    // Every key delivered again, to the new primary.
    let redelivered: Vec<_> = (0..WORKERS)
        .map(|w| {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut stuck = 0;
                for n in (w..KEYS).step_by(WORKERS) {
                    // Until it answers (a lease left by a lost claim ends).
                    for _ in 0..10 {
                        match shared.deliver(n).await {
                            Some(Ok(_)) => break,
                            Some(Err(_)) => tokio::time::sleep(Duration::from_millis(200)).await,
                            None => stuck += 1,
                        }
                    }
                }
                stuck
            })
        })
        .collect();
    for r in redelivered {
        report.stuck += r.await.unwrap();
    }

    let acked = shared.acked.lock().unwrap().clone();
    for (n, ack) in acked.iter().enumerate() {
        let Some((outcome, _, runs_at_ack)) = ack else {
            continue;
        };
        let record = ledger
            .get(&shared.key(n))
            .await
            .expect("reads")
            .expect("a record");
        let stored: Option<String> = record
            .stored()
            .unwrap()
            .map(|s| s.into_result(&record.key).unwrap());
        if record.state != RecordState::Completed || stored.as_ref() != Some(outcome) {
            report.lost += 1;
        }
        let runs = shared.runs[n].load(Ordering::SeqCst);
        if runs > *runs_at_ack {
            report.second_runs += 1;
        }
        if shared.unknown[n].load(Ordering::SeqCst) == 1 && runs > 1 {
            report.reruns_after_unknown += 1;
        }
    }
    listener_follows(&ledger, &url, &shared.tenant).await;
    if fault == Fault::Freeze {
        // Not left frozen for whoever runs next.
        let _ = common::run(PORT, &["kill-primary"]);
    }
    println!("{mode} replication, primary {fault:?}: {report:?}");
    Some(report)
}

/// After the failover, `ledger`'s listener hears a completion that another
/// process (a ledger connected afresh, so to the new primary) announces: it
/// listens on the promoted standby, not on the old primary (where, frozen,
/// it would wait forever).
async fn listener_follows(ledger: &PgLedger, url: &str, tenant: &Tenant) {
    let key = EffectKey::new(tenant, "failover", "listener").unwrap();
    drop(ledger.watch(&key).await);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !ledger.listener_status().listening {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the listener listens again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let heard = ledger.listener_status().notifications;
    let other = PgLedger::connect_with(url, options()).await.expect("connects");
    let lease = match other.claim(&key, &ClaimOptions::default()).await.unwrap() {
        oncely::backend::Claim::Acquired(lease) => lease,
        c => panic!("{c:?}"),
    };
    // A waiter marks the record (only marked completions are announced).
    assert!(ledger.watch(&key).await.is_notified());
    other
        .complete(&lease, &oncely::backend::Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    while ledger.listener_status().notifications == heard {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the listener hears the new primary: {:?}",
            ledger.listener_status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_the_primary_with_a_synchronous_standby() {
    let _pair = PAIR.lock().await;
    let Some(r) = failover("sync", Fault::Kill).await else {
        return;
    };
    assert_eq!(r.stuck, 0, "{r:?}");
    assert_eq!(
        r.unanswered, 0,
        "every key was answered on the new primary: {r:?}"
    );
    assert_eq!(r.lost, 0, "no acknowledged completion lost: {r:?}");
    assert_eq!(
        r.second_runs, 0,
        "no handler ran again after its acknowledged completion: {r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn freeze_the_primary_with_a_synchronous_standby() {
    let _pair = PAIR.lock().await;
    let Some(r) = failover("sync", Fault::Freeze).await else {
        return;
    };
    assert_eq!(r.stuck, 0, "every call returned before its deadline: {r:?}");
    assert!(r.waiter.is_some(), "{r:?}");
    assert_eq!(
        r.unanswered, 0,
        "every key was answered on the new primary: {r:?}"
    );
    assert_eq!(r.lost, 0, "no acknowledged completion lost: {r:?}");
    assert_eq!(
        r.second_runs, 0,
        "no handler ran again after its acknowledged completion: {r:?}"
    );
}

/// Asynchronous replication: measured and printed, not asserted (a
/// failover may lose what the standby had not received; see the crate
/// docs, "Replication and failover").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_the_primary_with_an_asynchronous_standby() {
    let _pair = PAIR.lock().await;
    let Some(r) = failover("async", Fault::Kill).await else {
        return;
    };
    assert_eq!(r.stuck, 0, "{r:?}");
    assert_eq!(r.unanswered, 0, "{r:?}");
    println!(
        "asynchronous standby: {} acknowledged completions lost, {} handlers ran again after an acknowledged completion",
        r.lost, r.second_runs
    );
}

/// A ledger pointed only at a standby is refused when it connects, saying
/// so; a host list with the standby first connects to the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_refused_and_skipped() {
    let _pair = PAIR.lock().await;
    let Some(url) = common::pair(PORT, "sync") else {
        return;
    };
    let standby = url.replace(&format!("127.0.0.1:{PORT},"), "");
    match PgLedger::connect_with(&standby, options()).await {
        Err(Error::Config(m)) => assert!(m.contains("a standby (in recovery)"), "{m}"),
        other => panic!("{other:?}"),
    }
    let standby_port = standby
        .split(':')
        .nth(2)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let reversed = format!(
        "postgres://postgres@127.0.0.1:{standby_port},127.0.0.1:{PORT}/test?target_session_attrs=read-write"
    );
    let ledger = PgLedger::connect_with(&reversed, options())
        .await
        .expect("finds the primary");
    let key = EffectKey::new(&oncely::conformance::fresh_tenant(), "failover", "skip").unwrap();
    let effects = Effects::new(ledger.clone());
    let v = effects
        .run(&key, &ClaimOptions::default(), |_| async { Ok(1) })
        .await
        .unwrap();
    assert_eq!(v, 1);
    assert!(ledger.to_string().contains(&format!(":{PORT}/test")), "{ledger}");
    // Nothing answers at all: unavailable, not a configuration error.
    match PgLedger::connect_with("postgres://postgres@127.0.0.1:1,127.0.0.1:2/test", options()).await {
        Err(Error::Unavailable { message, .. }) => assert!(message.contains("127.0.0.1:2"), "{message}"),
        other => panic!("{other:?}"),
    }
}

/// An erasure the primary acknowledged survives the primary's loss: with a
/// synchronous standby, the promoted standby holds the subject's completed
/// record erased (no outcome, no fingerprint; a redelivery fails with
/// `Error::Erased` and does not run) and its sent outbox message emptied,
/// and neither table holds a byte of the erased outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_survives_the_failover_with_a_synchronous_standby() {
    use oncely::admin::Admin;
    use oncely::backend::{Fingerprint, TransactionalLedger};
    use oncely::outbox::{Message, Outbox, TransactionalOutbox};

    let _pair = PAIR.lock().await;
    let Some(url) = common::fresh_pair(PORT, "sync") else {
        return;
    };
    let ledger = PgLedger::connect_with(&url, options()).await.expect("connects");
    let tenant = oncely::conformance::fresh_tenant();
    let (subject, secret) = ("person-7", "secret-outcome-of-person-7");
    let opts = ClaimOptions::default().fingerprint(Fingerprint::of_bytes(b"card 4242"));
    let capture = EffectKey::new(&tenant, "capture", subject).unwrap();
    let mail = EffectKey::new(&tenant, "mail", subject).unwrap();
    Effects::new(ledger.clone())
        .run(&capture, &opts, |_| async { Ok(secret.to_owned()) })
        .await
        .unwrap();
    let mut tx = ledger.begin().await.unwrap();
    ledger
        .enqueue_in(
            &mut tx,
            &mail,
            &Message::new("mail", secret.as_bytes().to_vec()).unwrap(),
        )
        .await
        .unwrap();
    ledger.commit(tx).await.unwrap();
    let claimed = ledger.claim_messages(10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(ledger.mark_sent(&[claimed[0].ticket()]).await.unwrap(), [true]);
    let dump =
        |table: &str| oncely_testkit::dump::postgres(&url, &format!("public.{table}")).expect("pg_dump runs");
    assert!(
        oncely_testkit::dump::contains(&dump("oncely_failover_outbox"), secret.as_bytes()),
        "control: the dump shows the message"
    );

    let erasure = ledger.erase(&tenant, subject).await.unwrap();
    assert_eq!(erasure.erased, std::slice::from_ref(&capture));
    assert_eq!(erasure.messages, std::slice::from_ref(&mail));
    tokio::task::spawn_blocking(|| {
        script(&["kill-primary"]);
        script(&["promote"]);
    })
    .await
    .unwrap();

    let promoted = PgLedger::connect_with(&url, options())
        .await
        .expect("connects to the promoted standby");
    let r = promoted.get(&capture).await.unwrap().expect("the record");
    assert!(r.is_erased(), "{r:?}");
    assert_eq!((r.outcome, r.fingerprint), (None, None));
    let runs = AtomicU32::new(0);
    let e = Effects::new(promoted.clone())
        .run(&capture, &opts, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(String::new())
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Erased { .. }), "{e:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the erased effect never runs again"
    );
    for table in ["oncely_failover", "oncely_failover_outbox"] {
        assert!(
            !oncely_testkit::dump::contains(&dump(table), secret.as_bytes()),
            "{table} on the promoted standby holds no byte of the erased outcome"
        );
    }
}
