//! The metrics named in `docs/design.md` ("Observability") are emitted with the documented labels.

use std::sync::Arc;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use oncely::backend::{Claim, Ledger};
use oncely::telemetry::*;
use oncely::{ClaimOptions, EffectKey, Effects, Error, MemoryLedger, Tenant};

fn counter(snap: &[(CompositeKey, DebugValue)], name: &str, labels: &[(&str, &str)]) -> u64 {
    snap.iter()
        .filter(|(k, _)| k.kind() == MetricKind::Counter && k.key().name() == name)
        .filter(|(k, _)| {
            labels
                .iter()
                .all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
        })
        .map(|(_, v)| match v {
            DebugValue::Counter(c) => *c,
            _ => 0,
        })
        .sum()
}

fn histogram_samples(snap: &[(CompositeKey, DebugValue)], name: &str) -> usize {
    snap.iter()
        .filter(|(k, _)| k.key().name() == name)
        .map(|(_, v)| match v {
            DebugValue::Histogram(h) => h.len(),
            _ => 0,
        })
        .sum()
}

fn histogram_samples_with(snap: &[(CompositeKey, DebugValue)], name: &str, labels: &[(&str, &str)]) -> usize {
    snap.iter()
        .filter(|(k, _)| k.key().name() == name)
        .filter(|(k, _)| {
            labels
                .iter()
                .all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
        })
        .map(|(_, v)| match v {
            DebugValue::Histogram(h) => h.len(),
            _ => 0,
        })
        .sum()
}

fn snapshot(s: &Snapshotter) -> Vec<(CompositeKey, DebugValue)> {
    s.snapshot()
        .into_vec()
        .into_iter()
        .map(|(k, _, _, v)| (k, v))
        .collect()
}

#[test]
fn effects_emit_the_documented_metrics() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let ledger = Arc::new(MemoryLedger::new());
            let effects = Effects::new(ledger.clone());
            let key = EffectKey::new(&Tenant::global(), "capture", "order-1").unwrap();
            let opts = ClaimOptions::default();
            for _ in 0..3 {
                let v: u32 = effects.run(&key, &opts, |_| async { Ok(7) }).await.unwrap();
                assert_eq!(v, 7);
            }

            // A takeover, then the zombie's completion is refused by its fence.
            let slow = EffectKey::new(&Tenant::global(), "receipt", "order-1").unwrap();
            let l2 = ledger.clone();
            let slow2 = slow.clone();
            let err = effects
                .run::<u32, _, _>(&slow, &opts, |_| async move {
                    l2.advance(Duration::from_secs(31));
                    assert!(matches!(
                        l2.claim(&slow2, &ClaimOptions::default()).await.unwrap(),
                        Claim::Acquired(_)
                    ));
                    Ok(1)
                })
                .await
                .unwrap_err();
            assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
            // A retry while the taker-over still holds the receipt: in progress.
            let reject = ClaimOptions::default().on_in_progress(oncely::OnInProgress::Reject);
            let err = effects
                .run::<u32, _, _>(&slow, &reject, |_| async { Ok(3) })
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InProgress { .. }), "{err:?}");
            ledger.advance(Duration::from_secs(31));
            let v: u32 = effects.run(&slow, &opts, |_| async { Ok(2) }).await.unwrap();
            assert_eq!(v, 2);
        });
    });
    let snap = snapshot(&snapshotter);
    let capture = [("kind", "capture")];
    assert_eq!(
        counter(
            &snap,
            CLAIMS_TOTAL,
            &[("backend", "memory"), ("kind", "capture"), ("result", "acquired")]
        ),
        1
    );
    assert_eq!(
        counter(
            &snap,
            CLAIMS_TOTAL,
            &[("kind", "capture"), ("result", "completed")]
        ),
        2
    );
    assert_eq!(counter(&snap, DUPLICATES_SUPPRESSED_TOTAL, &capture), 2);
    assert_eq!(counter(&snap, FENCE_REJECTIONS_TOTAL, &[("kind", "receipt")]), 1);
    assert_eq!(counter(&snap, LEASE_TAKEOVERS_TOTAL, &[("kind", "receipt")]), 1);
    assert_eq!(
        counter(
            &snap,
            CLAIMS_TOTAL,
            &[("kind", "receipt"), ("result", "takeover")]
        ),
        1
    );
    assert_eq!(histogram_samples(&snap, CLAIM_SECONDS), 6);
    assert_eq!(histogram_samples(&snap, REDELIVERY_GAP_SECONDS), 3);
    // The two duplicates of the completed capture are redelivery gaps; the
    // retry that found the receipt still in progress is counted apart.
    assert_eq!(
        histogram_samples_with(
            &snap,
            REDELIVERY_GAP_SECONDS,
            &[("kind", "capture"), ("found", "completed")]
        ),
        2
    );
    assert_eq!(
        histogram_samples_with(
            &snap,
            REDELIVERY_GAP_SECONDS,
            &[("kind", "receipt"), ("found", "in_progress")]
        ),
        1
    );
}

/// Knows that receipts went out and captures did not.
struct Provider;

impl oncely::reconcile::Reconciler for Provider {
    async fn check(
        &self,
        record: &oncely::backend::Record,
        _: oncely::reconcile::Doubt,
    ) -> Result<oncely::reconcile::Verdict, oncely::BoxError> {
        use oncely::reconcile::Verdict;
        Ok(match record.key.kind() {
            "receipt" => Verdict::Done(oncely::backend::Outcome::value(&())?),
            "capture" => Verdict::NotDone,
            _ => Verdict::Unknown,
        })
    }
}

#[test]
fn reconciliation_counts_every_examined_record() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let ledger = MemoryLedger::new();
            let t = Tenant::global();
            let key = |kind: &str, s: &str| EffectKey::new(&t, kind, s).unwrap();
            let opts = ClaimOptions::default();
            ledger
                .claim(&key("receipt", "o-1"), &opts.clone().at_most_once(true))
                .await
                .unwrap();
            ledger.claim(&key("capture", "o-1"), &opts).await.unwrap();
            ledger.claim(&key("refund", "o-1"), &opts).await.unwrap();
            ledger.advance(Duration::from_secs(60));
            let keys = [
                key("receipt", "o-1"),
                key("capture", "o-1"),
                key("refund", "o-1"),
                key("capture", "o-2"),
            ];
            let dry = oncely::reconcile::Reconcile::new(&ledger, &Provider).dry_run(true);
            dry.keys(keys.clone()).await.unwrap();
            let report = oncely::reconcile::Reconcile::new(&ledger, &Provider)
                .keys(keys)
                .await
                .unwrap();
            assert_eq!(
                (report.completed, report.released, report.unknown, report.skipped),
                (1, 1, 1, 1)
            );
        });
    });
    let snap = snapshot(&snapshotter);
    let n = |labels: &[(&str, &str)]| counter(&snap, RECONCILED_TOTAL, labels);
    assert_eq!(n(&[("dry_run", "true")]), 4);
    assert_eq!(n(&[("dry_run", "false")]), 4);
    assert_eq!(
        n(&[
            ("kind", "receipt"),
            ("doubt", "abandoned"),
            ("result", "completed"),
            ("dry_run", "false")
        ]),
        1
    );
    assert_eq!(
        n(&[
            ("kind", "capture"),
            ("doubt", "stuck"),
            ("result", "released"),
            ("dry_run", "false")
        ]),
        1
    );
    assert_eq!(
        n(&[("kind", "refund"), ("result", "unknown"), ("dry_run", "false")]),
        1
    );
    assert_eq!(
        n(&[("kind", "capture"), ("doubt", "none"), ("result", "skipped")]),
        2
    );
    // Only the stuck capture was taken over (an unknown is never claimed).
    assert_eq!(counter(&snap, LEASE_TAKEOVERS_TOTAL, &[("kind", "capture")]), 1);
    assert_eq!(counter(&snap, CLAIMS_TOTAL, &[("kind", "refund")]), 0);
}
