//! Reconciliation on the memory ledger: every verdict on abandoned steps and
//! stuck leases, dry runs, paging past records left alone, records that move
//! on between the listing and the write, limits and errors. The SQL backends
//! run the same runner against a provider in `examples/payment-job`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use oncely::backend::{Claim, Ledger, Outcome, Record, RecordState, StoredOutcome};
use oncely::reconcile::{
    Abandoned, Chain, Doubt, Keys, Page, Reconcile, Reconciler, Resolution, Source, Verdict,
};
use oncely::{BoxError, ClaimOptions, EffectKey, MemoryLedger, Tenant};

fn acme() -> Tenant {
    Tenant::new("acme").unwrap()
}

fn key(kind: &str, subject: &str) -> EffectKey {
    EffectKey::new(&acme(), kind, subject).unwrap()
}

/// Claims `key` and never completes it; after `advance` the lease has ended.
async fn crash(ledger: &MemoryLedger, key: &EffectKey, at_most_once: bool) -> u64 {
    let opts = ClaimOptions::default()
        .lease(Duration::from_secs(10))
        .at_most_once(at_most_once);
    match ledger.claim(key, &opts).await.unwrap() {
        Claim::Acquired(lease) => lease.fence(),
        other => panic!("{other:?}"),
    }
}

fn frozen(r: Option<Record>) -> Option<Record> {
    r.map(|mut r| {
        r.read_at = UNIX_EPOCH;
        r
    })
}

async fn snapshot(ledger: &MemoryLedger, keys: &[EffectKey]) -> Vec<Option<Record>> {
    let mut out = Vec::new();
    for k in keys {
        out.push(frozen(ledger.get(k).await.unwrap()));
    }
    out
}

/// Answers from a table by subject (missing: unknown), counting questions,
/// optionally running a hook first (to move a record on mid-run).
#[derive(Default)]
struct Table {
    answers: HashMap<String, Answer>,
    asked: AtomicUsize,
    hook: Mutex<Option<Hook>>,
}

/// Runs once, before the first answer.
type Hook = Box<dyn FnOnce(&Record) + Send>;

#[derive(Clone)]
enum Answer {
    Done(&'static str),
    NotDone,
    Fail,
}

impl Table {
    fn with(answers: &[(&str, Answer)]) -> Self {
        Table {
            answers: answers.iter().map(|(s, a)| (s.to_string(), a.clone())).collect(),
            ..Table::default()
        }
    }
}

impl Reconciler for Table {
    async fn check(&self, record: &Record, _doubt: Doubt) -> Result<Verdict, BoxError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if let Some(hook) = self.hook.lock().unwrap().take() {
            hook(record);
        }
        Ok(match self.answers.get(record.key.subject()) {
            Some(Answer::Done(v)) => Verdict::Done(Outcome::value(v)?),
            Some(Answer::NotDone) => Verdict::NotDone,
            Some(Answer::Fail) => return Err("provider timed out".into()),
            None => Verdict::Unknown,
        })
    }
}

fn value(r: &Record) -> String {
    match r.stored::<String>().unwrap() {
        Some(StoredOutcome::Value(v)) => v,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn abandoned_steps_end_completed_released_or_still_listed() {
    let ledger = MemoryLedger::new();
    let (sent, lost, unsure, broken) = (
        key("receipt", "o-1"),
        key("receipt", "o-2"),
        key("receipt", "o-3"),
        key("receipt", "o-4"),
    );
    for k in [&sent, &lost, &unsure, &broken] {
        crash(&ledger, k, true).await;
    }
    ledger.advance(Duration::from_secs(60));
    let table = Table::with(&[
        ("o-1", Answer::Done("sent")),
        ("o-2", Answer::NotDone),
        ("o-4", Answer::Fail),
    ]);

    let report = Reconcile::new(&ledger, &table).abandoned(&acme()).await.unwrap();
    assert!(!report.dry_run);
    assert_eq!(
        (
            report.examined,
            report.completed,
            report.released,
            report.unknown,
            report.errors
        ),
        (4, 1, 1, 1, 1),
        "{report:#?}"
    );
    assert_eq!(report.entry(&sent).unwrap().doubt, Some(Doubt::Abandoned));

    let done = ledger.get(&sent).await.unwrap().unwrap();
    assert_eq!(done.state, RecordState::Completed);
    assert_eq!(value(&done), "sent");
    assert_eq!(
        ledger.get(&lost).await.unwrap().unwrap().state,
        RecordState::Released
    );
    // Released: the next delivery claims it (a takeover) and sends.
    let retry = ledger
        .claim(&lost, &ClaimOptions::default().at_most_once(true))
        .await
        .unwrap();
    assert!(
        matches!(retry, Claim::Acquired(ref l) if l.taken_over()),
        "{retry:?}"
    );
    // Unknown and failed: still listed, untouched.
    let listed: Vec<EffectKey> = ledger
        .abandoned(&acme(), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(listed, vec![unsure.clone(), broken.clone()]);
}

#[tokio::test]
async fn a_dry_run_asks_and_reports_but_writes_nothing() {
    let ledger = MemoryLedger::new();
    let keys = [
        key("receipt", "o-1"),
        key("receipt", "o-2"),
        key("capture", "o-3"),
    ];
    crash(&ledger, &keys[0], true).await;
    crash(&ledger, &keys[1], true).await;
    crash(&ledger, &keys[2], false).await;
    ledger.advance(Duration::from_secs(60));
    let before = snapshot(&ledger, &keys).await;
    let table = Table::with(&[
        ("o-1", Answer::Done("sent")),
        ("o-2", Answer::NotDone),
        ("o-3", Answer::Done("ch_1")),
    ]);

    let report = Reconcile::new(&ledger, &table)
        .dry_run(true)
        .keys(keys.clone())
        .await
        .unwrap();
    assert!(report.dry_run);
    assert_eq!(
        (report.examined, report.completed, report.released),
        (3, 2, 1),
        "{report:#?}"
    );
    assert_eq!(report.entry(&keys[2]).unwrap().doubt, Some(Doubt::Stuck));
    assert_eq!(table.asked.load(Ordering::SeqCst), 3);
    assert_eq!(
        snapshot(&ledger, &keys).await,
        before,
        "a dry run changed the ledger"
    );
}

#[tokio::test]
async fn stuck_leases_are_taken_over_before_any_write() {
    let ledger = MemoryLedger::new();
    let (charged, not_charged, unsure, live, done) = (
        key("capture", "o-1"),
        key("capture", "o-2"),
        key("capture", "o-3"),
        key("capture", "o-4"),
        key("capture", "o-5"),
    );
    let mut fences = HashMap::new();
    for k in [&charged, &not_charged, &unsure, &done] {
        fences.insert(k.clone(), crash(&ledger, k, false).await);
    }
    // o-5's holder was slow, not dead: it completes before the run.
    let rec = ledger.get(&done).await.unwrap().unwrap();
    ledger
        .complete(&rec.reconciliation_lease(), &Outcome::value(&"ch_mine").unwrap())
        .await
        .unwrap();
    ledger.advance(Duration::from_secs(60));
    crash(&ledger, &live, false).await; // a live lease: not in doubt
    let table = Table::with(&[
        ("o-1", Answer::Done("ch_1")),
        ("o-2", Answer::NotDone),
        ("o-4", Answer::Done("never")),
        ("o-5", Answer::Done("never")),
    ]);

    let all = [
        charged.clone(),
        not_charged.clone(),
        unsure.clone(),
        live.clone(),
        done.clone(),
    ];
    let report = Reconcile::new(&ledger, &table)
        .keys(all.iter().cloned().chain([key("capture", "absent")]))
        .await
        .unwrap();
    assert_eq!(
        (
            report.examined,
            report.completed,
            report.released,
            report.unknown,
            report.skipped
        ),
        (6, 1, 1, 1, 3),
        "{report:#?}"
    );
    assert_eq!(
        table.asked.load(Ordering::SeqCst),
        3,
        "only records in doubt are asked about"
    );

    let c = ledger.get(&charged).await.unwrap().unwrap();
    assert_eq!((c.state, value(&c).as_str()), (RecordState::Completed, "ch_1"));
    assert!(c.fence > fences[&charged], "completed under a takeover lease");
    let r = ledger.get(&not_charged).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Released);
    let u = ledger.get(&unsure).await.unwrap().unwrap();
    assert_eq!(
        (u.state, u.fence),
        (RecordState::InProgress, fences[&unsure]),
        "unknown: untouched"
    );
    assert_eq!(Doubt::of(&u), Some(Doubt::Stuck));
    let d = ledger.get(&done).await.unwrap().unwrap();
    assert_eq!(value(&d), "ch_mine");
    assert_eq!(
        ledger.get(&live).await.unwrap().unwrap().state,
        RecordState::InProgress
    );
}

#[tokio::test]
async fn a_stalled_holder_cannot_complete_after_the_takeover() {
    let ledger = MemoryLedger::new();
    let k = key("capture", "o-1");
    let opts = ClaimOptions::default().lease(Duration::from_secs(10));
    let Claim::Acquired(holder) = ledger.claim(&k, &opts).await.unwrap() else {
        panic!()
    };
    ledger.advance(Duration::from_secs(60));
    let table = Table::with(&[("o-1", Answer::NotDone)]);
    let report = Reconcile::new(&ledger, &table).keys([k.clone()]).await.unwrap();
    assert_eq!(report.released, 1, "{report:#?}");
    let e = ledger
        .complete(&holder, &Outcome::value(&"late").unwrap())
        .await
        .unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
}

#[tokio::test]
async fn a_record_that_moves_on_mid_run_is_not_overwritten() {
    // Abandoned: another operator completes it while the provider is asked.
    let ledger = Arc::new(MemoryLedger::new());
    let k = key("receipt", "o-1");
    crash(&ledger, &k, true).await;
    ledger.advance(Duration::from_secs(60));
    let table = Table::with(&[("o-1", Answer::NotDone)]);
    let l = ledger.clone();
    *table.hook.lock().unwrap() = Some(Box::new(move |r: &Record| {
        let lease = r.reconciliation_lease();
        futures_block_on(l.complete(&lease, &Outcome::value(&"by hand").unwrap())).unwrap();
    }));
    let report = Reconcile::new(&*ledger, &table).abandoned(&acme()).await.unwrap();
    assert_eq!(
        (report.examined, report.moved, report.released),
        (1, 1, 0),
        "{report:#?}"
    );
    assert_eq!(report.entry(&k).unwrap().resolution, Resolution::Moved);
    assert_eq!(value(&ledger.get(&k).await.unwrap().unwrap()), "by hand");

    // Stuck: the stalled holder completes after the listing, before the takeover.
    let k = key("capture", "o-2");
    let opts = ClaimOptions::default().lease(Duration::from_secs(10));
    let Claim::Acquired(holder) = ledger.claim(&k, &opts).await.unwrap() else {
        panic!()
    };
    ledger.advance(Duration::from_secs(60));
    let table = Table::with(&[("o-2", Answer::NotDone)]);
    let l = ledger.clone();
    *table.hook.lock().unwrap() = Some(Box::new(move |_: &Record| {
        futures_block_on(l.complete(&holder, &Outcome::value(&"ch_holder").unwrap())).unwrap();
    }));
    let report = Reconcile::new(&*ledger, &table).keys([k.clone()]).await.unwrap();
    assert_eq!((report.moved, report.released), (1, 0), "{report:#?}");
    let r = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (r.state, value(&r).as_str()),
        (RecordState::Completed, "ch_holder")
    );
}

/// The memory ledger's futures never pend; run one to completion in a
/// synchronous hook.
fn futures_block_on<F: std::future::Future>(f: F) -> F::Output {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[tokio::test]
async fn pages_go_past_records_left_alone_and_stop_at_the_limit() {
    let ledger = MemoryLedger::new();
    let keys: Vec<EffectKey> = (0..7).map(|i| key("receipt", &format!("o-{i}"))).collect();
    for k in &keys {
        crash(&ledger, k, true).await;
    }
    ledger.advance(Duration::from_secs(60));
    // Every other one is unknown: they stay at the head of the listing.
    let answers: Vec<(String, Answer)> = (0..7)
        .filter(|i| i % 2 == 1)
        .map(|i| (format!("o-{i}"), Answer::Done("sent")))
        .collect();
    let table = Table {
        answers: answers.into_iter().collect(),
        ..Table::default()
    };
    let report = Reconcile::new(&ledger, &table)
        .batch_size(2)
        .abandoned(&acme())
        .await
        .unwrap();
    assert_eq!(
        (report.examined, report.completed, report.unknown),
        (7, 3, 4),
        "{report:#?}"
    );
    let order: Vec<&EffectKey> = report.entries.iter().map(|e| &e.key).collect();
    assert_eq!(order, keys.iter().collect::<Vec<_>>(), "oldest first, each once");

    let report = Reconcile::new(&ledger, &table)
        .batch_size(3)
        .max_records(2)
        .abandoned(&acme())
        .await
        .unwrap();
    assert_eq!(report.examined, 2);
}

#[tokio::test(start_paused = true)]
async fn the_rate_limit_paces_records() {
    let ledger = MemoryLedger::new();
    for i in 0..5 {
        crash(&ledger, &key("receipt", &format!("o-{i}")), true).await;
    }
    ledger.advance(Duration::from_secs(60));
    let table = Table::default();
    let start = tokio::time::Instant::now();
    let report = Reconcile::new(&ledger, &table)
        .rate_limit(2.0)
        .abandoned(&acme())
        .await
        .unwrap();
    assert_eq!(report.unknown, 5);
    // Five records at two a second: the first at once, the last after 2 s.
    assert_eq!(start.elapsed(), Duration::from_secs(2));

    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = Reconcile::new(&ledger, &table)
            .rate_limit(bad)
            .abandoned(&acme())
            .await
            .unwrap_err();
        assert!(e.is_invalid_input(), "{e:?}");
    }
}

#[tokio::test]
async fn a_chain_runs_one_source_after_the_other() {
    let ledger = MemoryLedger::new();
    let (receipt, capture) = (key("receipt", "o-1"), key("capture", "o-1"));
    crash(&ledger, &receipt, true).await;
    crash(&ledger, &capture, false).await;
    ledger.advance(Duration::from_secs(60));
    let table = Table::with(&[("o-1", Answer::Done("yes"))]);
    let report = Reconcile::new(&ledger, &table)
        .run(Chain::new(Abandoned::new(&acme()), Keys::new([capture.clone()])))
        .await
        .unwrap();
    let order: Vec<(&EffectKey, Option<Doubt>)> = report.entries.iter().map(|e| (&e.key, e.doubt)).collect();
    assert_eq!(
        order,
        vec![(&receipt, Some(Doubt::Abandoned)), (&capture, Some(Doubt::Stuck))]
    );
    assert_eq!(report.completed, 2, "{report:#?}");
}

/// One page of the tenant's abandoned steps, then a listing that fails.
struct Flaky(Option<Abandoned>);

impl Source<MemoryLedger> for Flaky {
    async fn next_page(&mut self, ledger: &MemoryLedger, limit: usize) -> oncely::Result<Page> {
        match self.0.take() {
            Some(mut first) => first.next_page(ledger, limit).await,
            None => Err(oncely::Error::Unavailable {
                backend: "memory",
                message: "connection reset".into(),
            }),
        }
    }
}

#[tokio::test]
async fn a_failed_listing_stops_the_run_and_keeps_what_it_did() {
    let ledger = MemoryLedger::new();
    for i in 0..3 {
        crash(&ledger, &key("receipt", &format!("o-{i}")), true).await;
    }
    ledger.advance(Duration::from_secs(60));
    let table = Table::with(&[("o-0", Answer::NotDone), ("o-1", Answer::Done("sent"))]);
    let report = Reconcile::new(&ledger, &table)
        .batch_size(2)
        .rate_limit(1e300) // too fast to pace: no limit, no panic
        .run(Flaky(Some(Abandoned::new(&acme()))))
        .await
        .unwrap();
    assert_eq!(
        (report.examined, report.released, report.completed),
        (2, 1, 1),
        "{report:#?}"
    );
    assert!(
        report.aborted.as_deref().unwrap().contains("connection reset"),
        "{report:#?}"
    );
    assert_eq!(ledger.abandoned(&acme(), 10).await.unwrap().len(), 1);
}

#[tokio::test]
async fn records_within_the_grace_are_left_alone() {
    let ledger = MemoryLedger::new();
    let (recent, old) = (key("receipt", "o-1"), key("receipt", "o-2"));
    crash(&ledger, &old, true).await;
    ledger.advance(Duration::from_secs(600));
    crash(&ledger, &recent, true).await;
    ledger.advance(Duration::from_secs(60)); // recent's lease ended 50 s ago
    let table = Table::with(&[("o-1", Answer::NotDone), ("o-2", Answer::NotDone)]);
    let report = Reconcile::new(&ledger, &table)
        .grace(Duration::from_secs(300))
        .abandoned(&acme())
        .await
        .unwrap();
    assert_eq!((report.released, report.skipped), (1, 1), "{report:#?}");
    assert_eq!(report.entry(&recent).unwrap().resolution, Resolution::Skipped);
    assert_eq!(
        table.asked.load(Ordering::SeqCst),
        1,
        "a record within the grace is not asked about"
    );
    assert_eq!(ledger.abandoned(&acme(), 10).await.unwrap()[0].key, recent);
}

#[tokio::test]
async fn the_admin_listing_settles_stuck_leases_then_abandoned_steps() {
    let ledger = MemoryLedger::new();
    let stuck: Vec<EffectKey> = (0..5).map(|i| key("capture", &format!("s-{i}"))).collect();
    let abandoned: Vec<EffectKey> = (0..3).map(|i| key("receipt", &format!("a-{i}"))).collect();
    for k in &stuck {
        crash(&ledger, k, false).await;
    }
    for k in &abandoned {
        crash(&ledger, k, true).await;
    }
    crash(&ledger, &key("capture", "done"), false).await;
    let done = ledger.get(&key("capture", "done")).await.unwrap().unwrap();
    ledger
        .complete(&done.reconciliation_lease(), &Outcome::value(&"x").unwrap())
        .await
        .unwrap();
    ledger.advance(Duration::from_secs(60));
    crash(&ledger, &key("capture", "live"), false).await;
    // s-1 and s-3 and a-0 are unknown: they stay behind the cursor.
    let table = Table::with(&[
        ("s-0", Answer::Done("ch")),
        ("s-2", Answer::NotDone),
        ("s-4", Answer::Done("ch")),
        ("a-1", Answer::Done("sent")),
        ("a-2", Answer::NotDone),
    ]);
    let report = Reconcile::new(&ledger, &table)
        .batch_size(2)
        .doubtful(&acme())
        .await
        .unwrap();
    let order: Vec<&EffectKey> = report.entries.iter().map(|e| &e.key).collect();
    assert_eq!(
        order,
        stuck.iter().chain(&abandoned).collect::<Vec<_>>(),
        "{report:#?}"
    );
    assert_eq!(
        (report.completed, report.released, report.unknown, report.skipped),
        (3, 2, 3, 0),
        "{report:#?}"
    );
    assert_eq!(
        ledger.get(&stuck[1]).await.unwrap().unwrap().state,
        RecordState::InProgress
    );
    assert_eq!(
        ledger.get(&stuck[2]).await.unwrap().unwrap().state,
        RecordState::Released
    );
    // The stuck leases alone.
    let report = Reconcile::new(&ledger, &table).stuck(&acme()).await.unwrap();
    let order: Vec<&EffectKey> = report.entries.iter().map(|e| &e.key).collect();
    assert_eq!(order, vec![&stuck[1], &stuck[3]]);
}
