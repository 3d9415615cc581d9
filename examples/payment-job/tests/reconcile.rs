//! Reconciliation of a crashed run against the provider and the mailer, on
//! SQLite and PostgreSQL: abandoned receipts (sent, not sent, log gone) and
//! stuck captures (charged, not charged) end completed with the provider's
//! outcome, released and then re-run once, or still listed; a dry run
//! changes nothing; a record that moves on between the listing and the
//! write is left as the other writer left it.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncely::backend::{Claim, Lease, Outcome, Record, RecordState, StoredOutcome};
use oncely::reconcile::{Doubt, Reconcile, Reconciler, Resolution, Verdict};
use oncely::{BoxError, ClaimOptions, EffectKey};
use payment_job::{Boundary, Charge, Db, Delivered, OrderMsg, PaymentReconciler, Pipeline, reconcile};

/// Long enough past the pipeline's 250 ms lease for the database's clock
/// to call every crashed lease ended.
const PAST_LEASE: Duration = Duration::from_millis(700);

fn msg<D>(p: &Pipeline<D>, name: &str, amount: i64) -> OrderMsg {
    OrderMsg {
        order_id: format!("{}{name}", common::prefix(&p.tenant)),
        amount,
    }
}

async fn crash_at<D: Db>(p: &Pipeline<D>, m: &OrderMsg, b: Option<Boundary>) {
    p.db.insert_order(&m.order_id, m.amount).await.unwrap();
    let got = p.deliver(m, b).await.unwrap();
    let want = match b {
        Some(b) => Delivered::Crashed(b),
        None => Delivered::Acked {
            receipt_abandoned: false,
        },
    };
    assert_eq!(got, want, "{}", m.order_id);
}

async fn record<D: Db>(p: &Pipeline<D>, kind: &str, m: &OrderMsg) -> Record {
    p.db.get(&p.step_key(kind, &m.order_id)).await.unwrap().unwrap()
}

async fn listed<D: Db>(p: &Pipeline<D>) -> Vec<EffectKey> {
    p.db.abandoned(&p.tenant, 1000)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.key)
        .collect()
}

async fn crashed_run_is_reconciled<D: Db + oncely::admin::Admin>(p: Arc<Pipeline<D>>) {
    let sent = msg(&p, "sent", 100);
    let unsent = msg(&p, "unsent", 200);
    let gone = msg(&p, "gone", 300);
    let charged = msg(&p, "charged", 400);
    let uncharged = msg(&p, "uncharged", 500);
    let clean = msg(&p, "clean", 600);
    crash_at(&p, &sent, Some(Boundary::AfterSend)).await;
    crash_at(&p, &unsent, Some(Boundary::AfterReceiptClaim)).await;
    crash_at(&p, &gone, Some(Boundary::AfterSend)).await;
    p.mailer.lose_log(&gone.order_id);
    crash_at(&p, &charged, Some(Boundary::AfterCaptureCall)).await;
    crash_at(&p, &uncharged, Some(Boundary::AfterCaptureClaim)).await;
    crash_at(&p, &clean, None).await;
    tokio::time::sleep(PAST_LEASE).await;

    let all = [&sent, &unsent, &gone, &charged, &uncharged, &clean].map(|m| m.clone());
    let charged_fence = record(&p, "capture", &charged).await.fence;
    assert_eq!(
        Doubt::of(&record(&p, "capture", &charged).await),
        Some(Doubt::Stuck)
    );
    let mut got = listed(&p).await;
    got.sort();
    let mut want: Vec<EffectKey> = [&sent, &unsent, &gone]
        .iter()
        .map(|m| p.step_key("receipt", &m.order_id))
        .collect();
    want.sort();
    assert_eq!(got, want);

    // A dry run: the same answers, nothing written.
    let before = p.snapshot(&all).await.unwrap();
    let report = reconcile(&p, true).await.unwrap();
    assert!(report.dry_run);
    assert_eq!(
        (report.examined, report.completed, report.released, report.unknown),
        (5, 2, 2, 1),
        "{report:#?}"
    );
    assert_eq!(
        p.snapshot(&all).await.unwrap(),
        before,
        "a dry run changed something"
    );

    // The real run: the stuck captures first, then the abandoned receipts.
    let report = reconcile(&p, false).await.unwrap();
    assert_eq!(
        (
            report.examined,
            report.completed,
            report.released,
            report.unknown,
            report.moved,
            report.skipped,
            report.errors
        ),
        (5, 2, 2, 1, 0, 0, 0),
        "{report:#?}"
    );
    let doubts: Vec<Option<Doubt>> = report.entries.iter().map(|e| e.doubt).collect();
    assert_eq!(doubts[..2], [Some(Doubt::Stuck); 2]);
    assert_eq!(doubts[2..], [Some(Doubt::Abandoned); 3]);
    let of = |kind: &str, m: &OrderMsg| {
        report
            .entry(&p.step_key(kind, &m.order_id))
            .unwrap()
            .resolution
            .clone()
    };
    assert_eq!(of("receipt", &sent), Resolution::Completed);
    assert_eq!(of("receipt", &unsent), Resolution::Released);
    assert_eq!(of("receipt", &gone), Resolution::Unknown);
    assert_eq!(of("capture", &charged), Resolution::Completed);
    assert_eq!(of("capture", &uncharged), Resolution::Released);

    // The receipt that went out: completed with the step's own value.
    let r = record(&p, "receipt", &sent).await;
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(r.stored::<()>().unwrap(), Some(StoredOutcome::Value(())));
    // The one that did not: released.
    assert_eq!(record(&p, "receipt", &unsent).await.state, RecordState::Released);
    // The one nobody can vouch for: untouched, still listed.
    assert_eq!(listed(&p).await, vec![p.step_key("receipt", &gone.order_id)]);

    // The charged capture: completed with the provider's charge, under a
    // takeover fence.
    let c = record(&p, "capture", &charged).await;
    let charge = p
        .provider
        .charge_by_key(&c.key.provider_key())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.state, RecordState::Completed);
    assert_eq!(
        c.stored::<Charge>().unwrap(),
        Some(StoredOutcome::Value(charge.clone()))
    );
    assert!(c.fence > charged_fence);
    // The uncharged one: released, nothing captured yet.
    assert_eq!(
        record(&p, "capture", &uncharged).await.state,
        RecordState::Released
    );
    assert_eq!(p.provider.captures().get(&uncharged.order_id), None);

    // Redelivering everything finishes the run: every released step runs
    // once, every completed one is replayed, and the unknown receipt stays
    // abandoned (never re-sent).
    for m in &all {
        let got = p.deliver(m, None).await.unwrap();
        let abandoned = m == &gone;
        assert_eq!(
            got,
            Delivered::Acked {
                receipt_abandoned: abandoned
            },
            "{}",
            m.order_id
        );
    }
    let snap = p.snapshot(&all).await.unwrap();
    for m in &all {
        assert_eq!(
            snap.captures.get(&m.order_id),
            Some(&1),
            "{}: captured once",
            m.order_id
        );
        assert_eq!(
            snap.sends.get(&m.order_id),
            Some(&1),
            "{}: one receipt",
            m.order_id
        );
    }
    for o in &snap.orders {
        assert_eq!((o.status.as_str(), o.paid_writes), ("paid", 1), "{o:?}");
    }
    let paid = &snap.orders[3];
    assert_eq!(
        paid.charge_id.as_deref(),
        Some(charge.id.as_str()),
        "paid with the reconciled charge"
    );
    assert_eq!(listed(&p).await, vec![p.step_key("receipt", &gone.order_id)]);

    // Another pass: the unknown receipt is asked about again, nothing else.
    let report = reconcile(&p, false).await.unwrap();
    assert_eq!((report.examined, report.unknown), (1, 1), "{report:#?}");
    // Given by key, settled records are skipped.
    let keys: Vec<EffectKey> = [&charged, &uncharged, &clean]
        .iter()
        .map(|m| p.step_key("capture", &m.order_id))
        .collect();
    let report = Reconcile::new(&p.db, &PaymentReconciler::of(&p))
        .keys(keys)
        .await
        .unwrap();
    assert_eq!((report.examined, report.skipped), (3, 3), "{report:#?}");
}

/// A reconciler whose question races with another writer: before answering
/// it lets the record move on (an operator completes the abandoned step; the
/// stalled holder of a stuck lease completes after all), then answers
/// "not done", which must not be applied.
struct Racing<D> {
    db: D,
    holder: Mutex<Option<Lease>>,
}

impl<D: Db> Reconciler for Racing<D> {
    async fn check(&self, record: &Record, doubt: Doubt) -> Result<Verdict, BoxError> {
        let lease = match doubt {
            Doubt::Abandoned => record.reconciliation_lease(),
            _ => self.holder.lock().unwrap().take().expect("one stuck record"),
        };
        self.db
            .complete(&lease, &Outcome::value(&"by the other writer")?)
            .await?;
        Ok(Verdict::NotDone)
    }
}

async fn moved_records_are_not_overwritten<D: Db>(p: Arc<Pipeline<D>>) {
    let m = msg(&p, "raced", 100);
    crash_at(&p, &m, Some(Boundary::AfterReceiptClaim)).await;
    // A stuck lease whose holder is alive but late.
    let stuck = p.step_key("capture", &format!("{}held", common::prefix(&p.tenant)));
    let Claim::Acquired(holder) =
        p.db.claim(&stuck, &ClaimOptions::default().lease(Duration::from_millis(250)))
            .await
            .unwrap()
    else {
        panic!("fresh key")
    };
    tokio::time::sleep(PAST_LEASE).await;

    let racing = Racing {
        db: p.db.clone(),
        holder: Mutex::new(Some(holder)),
    };
    let run = Reconcile::new(&p.db, &racing);
    let ab = run.abandoned(&p.tenant).await.unwrap();
    assert_eq!((ab.examined, ab.moved, ab.released), (1, 1, 0), "{ab:#?}");
    let keys = run.keys([stuck.clone()]).await.unwrap();
    assert_eq!((keys.examined, keys.moved, keys.released), (1, 1, 0), "{keys:#?}");
    for key in [p.step_key("receipt", &m.order_id), stuck.clone()] {
        let r = p.db.get(&key).await.unwrap().unwrap();
        assert_eq!(r.state, RecordState::Completed, "{key}");
        assert_eq!(
            r.stored::<String>().unwrap(),
            Some(StoredOutcome::Value("by the other writer".to_owned())),
            "{key}"
        );
    }
    assert!(listed(&p).await.is_empty());

    // A provider that does not answer: counted, nothing written.
    let down = msg(&p, "down", 100);
    crash_at(&p, &down, Some(Boundary::AfterCaptureCall)).await;
    tokio::time::sleep(PAST_LEASE).await;
    let key = p.step_key("capture", &down.order_id);
    let before = p.db.get(&key).await.unwrap().unwrap();
    p.provider.set_outage(true);
    let report = Reconcile::new(&p.db, &PaymentReconciler::of(&p))
        .keys([key.clone()])
        .await
        .unwrap();
    p.provider.set_outage(false);
    assert_eq!((report.examined, report.errors), (1, 1), "{report:#?}");
    let after = p.db.get(&key).await.unwrap().unwrap();
    assert_eq!((after.state, after.fence), (before.state, before.fence));
}

#[tokio::test]
async fn sqlite_crashed_run_is_reconciled() {
    let (db, _dir) = common::sqlite().await;
    crashed_run_is_reconciled(common::pipeline(db, true)).await;
}

#[tokio::test]
async fn sqlite_moved_records_are_not_overwritten() {
    let (db, _dir) = common::sqlite().await;
    moved_records_are_not_overwritten(common::pipeline(db, true)).await;
}

#[tokio::test]
async fn postgres_crashed_run_is_reconciled() {
    let Some(db) = common::postgres().await else {
        return;
    };
    crashed_run_is_reconciled(common::pipeline(db, true)).await;
}

#[tokio::test]
async fn postgres_moved_records_are_not_overwritten() {
    let Some(db) = common::postgres().await else {
        return;
    };
    moved_records_are_not_overwritten(common::pipeline(db, true)).await;
}

/// Two reconcilers (two replicas of a scheduled job) over the same crashed
/// run at once: every record is settled once and correctly, the loser of
/// each race counts it as moved, and a redelivery then finishes every
/// order with one capture and one receipt.
async fn two_reconcilers_at_once<D: Db + oncely::admin::Admin>(p: Arc<Pipeline<D>>) {
    let mut orders = Vec::new();
    for i in 0..12 {
        let m = msg(&p, &format!("o{i}"), 100 + i);
        let b = [
            Boundary::AfterSend,
            Boundary::AfterReceiptClaim,
            Boundary::AfterCaptureCall,
            Boundary::AfterCaptureClaim,
        ][i as usize % 4];
        crash_at(&p, &m, Some(b)).await;
        orders.push(m);
    }
    tokio::time::sleep(PAST_LEASE).await;
    let (a, b) = tokio::join!(reconcile(&p, false), reconcile(&p, false));
    let (a, b) = (a.unwrap(), b.unwrap());
    for r in [&a, &b] {
        assert_eq!((r.errors, r.unknown, r.skipped), (0, 0, 0), "{r:#?}");
        assert!(r.aborted.is_none(), "{r:#?}");
    }
    // Each of the 12 doubtful records was settled by at least one run.
    let settled = |r: &oncely::reconcile::Report, k: &EffectKey| {
        r.entry(k)
            .is_some_and(|e| matches!(e.resolution, Resolution::Completed | Resolution::Released))
    };
    for (i, m) in orders.iter().enumerate() {
        let kind = if i % 4 < 2 { "receipt" } else { "capture" };
        let k = p.step_key(kind, &m.order_id);
        assert!(settled(&a, &k) || settled(&b, &k), "{k} settled by neither run");
        let want = if i % 4 == 0 || i % 4 == 2 {
            RecordState::Completed
        } else {
            RecordState::Released
        };
        assert_eq!(record(&p, kind, m).await.state, want, "{k}");
    }
    assert!(listed(&p).await.is_empty());
    for m in &orders {
        assert_eq!(
            p.deliver(m, None).await.unwrap(),
            Delivered::Acked {
                receipt_abandoned: false
            }
        );
    }
    let snap = p.snapshot(&orders).await.unwrap();
    for m in &orders {
        assert_eq!(snap.captures.get(&m.order_id), Some(&1), "{}", m.order_id);
        assert_eq!(snap.sends.get(&m.order_id), Some(&1), "{}", m.order_id);
    }
}

#[tokio::test]
async fn sqlite_two_reconcilers_at_once() {
    let (db, _dir) = common::sqlite().await;
    two_reconcilers_at_once(common::pipeline(db, true)).await;
}

#[tokio::test]
async fn postgres_two_reconcilers_at_once() {
    let Some(db) = common::postgres().await else {
        return;
    };
    two_reconcilers_at_once(common::pipeline(db, true)).await;
}
