//! Every claim runs in an `oncely.claim` span carrying the effect key, tenant,
//! kind, fence and result, so "did this run twice?" is one query.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use oncely::backend::Ledger;
use oncely::{ClaimOptions, EffectKey, Effects, MemoryLedger, Tenant};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

type Spans = Arc<Mutex<Vec<(String, BTreeMap<String, String>)>>>;

/// Records span names and fields, and tracks the entered span so that
/// `Span::current()` works (one thread: the test runs on a current-thread runtime).
struct Capture {
    spans: Spans,
    meta: Mutex<Vec<&'static Metadata<'static>>>,
    stack: Mutex<Vec<Id>>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = BTreeMap::new();
        span.record(&mut Fields(&mut fields));
        let mut spans = self.spans.lock().unwrap();
        spans.push((span.metadata().name().to_owned(), fields));
        self.meta.lock().unwrap().push(span.metadata());
        Id::from_u64(spans.len() as u64)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut spans = self.spans.lock().unwrap();
        let (_, fields) = &mut spans[span.into_u64() as usize - 1];
        values.record(&mut Fields(fields));
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, span: &Id) {
        self.stack.lock().unwrap().push(span.clone());
    }
    fn exit(&self, _: &Id) {
        self.stack.lock().unwrap().pop();
    }
    fn current_span(&self) -> tracing_core::span::Current {
        match self.stack.lock().unwrap().last() {
            Some(id) => {
                let meta = self.meta.lock().unwrap()[id.into_u64() as usize - 1];
                tracing_core::span::Current::new(id.clone(), meta)
            }
            None => tracing_core::span::Current::none(),
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn claims_run_in_a_span_with_the_effect_key() {
    let spans: Spans = Arc::default();
    let _guard = tracing::subscriber::set_default(Capture {
        spans: spans.clone(),
        meta: Mutex::default(),
        stack: Mutex::default(),
    });
    let effects = Effects::new(Arc::new(MemoryLedger::new()));
    let key = EffectKey::new(&Tenant::new("acme").unwrap(), "capture", "order-9").unwrap();
    for _ in 0..2 {
        let _: u8 = effects
            .run(&key, &ClaimOptions::default(), |_| async { Ok(1) })
            .await
            .unwrap();
    }
    let fence = effects.ledger().get(&key).await.unwrap().unwrap().fence;
    let spans = spans.lock().unwrap();
    let claims: Vec<_> = spans
        .iter()
        .filter(|(n, _)| n == "oncely.claim")
        .map(|(_, f)| f)
        .collect();
    assert_eq!(claims.len(), 2, "{spans:?}");
    for f in &claims {
        assert_eq!(f["effect_key"], "acme/capture:order-9");
        assert_eq!(f["tenant"], "acme");
        assert_eq!(f["kind"], "capture");
    }
    assert_eq!(claims[0]["result"], "acquired");
    assert_eq!(claims[0]["fence"], fence.to_string());
    assert_eq!(claims[1]["result"], "completed");
}

/// Knows that every receipt went out.
struct AllSent;

impl oncely::reconcile::Reconciler for AllSent {
    async fn check(
        &self,
        _: &oncely::backend::Record,
        _: oncely::reconcile::Doubt,
    ) -> Result<oncely::reconcile::Verdict, oncely::BoxError> {
        Ok(oncely::reconcile::Verdict::Done(oncely::backend::Outcome::value(
            &(),
        )?))
    }
}

#[tokio::test(flavor = "current_thread")]
async fn reconciliation_runs_each_record_in_a_span_with_the_effect_key() {
    let spans: Spans = Arc::default();
    let _guard = tracing::subscriber::set_default(Capture {
        spans: spans.clone(),
        meta: Mutex::default(),
        stack: Mutex::default(),
    });
    let ledger = MemoryLedger::new();
    let tenant = Tenant::new("acme").unwrap();
    let (receipt, capture) = (
        EffectKey::new(&tenant, "receipt", "order-9").unwrap(),
        EffectKey::new(&tenant, "capture", "order-9").unwrap(),
    );
    let opts = ClaimOptions::default();
    ledger
        .claim(&receipt, &opts.clone().at_most_once(true))
        .await
        .unwrap();
    ledger.claim(&capture, &opts).await.unwrap();
    ledger.advance(std::time::Duration::from_secs(60));
    let report = oncely::reconcile::Reconcile::new(&ledger, &AllSent)
        .keys([receipt.clone(), capture.clone()])
        .await
        .unwrap();
    assert_eq!(report.completed, 2);
    let receipt_fence = ledger.get(&receipt).await.unwrap().unwrap().fence.to_string();
    let capture_fence = ledger.get(&capture).await.unwrap().unwrap().fence.to_string();
    let spans = spans.lock().unwrap();
    assert_eq!(
        spans.iter().filter(|(n, _)| n == "oncely.reconcile_run").count(),
        1
    );
    let settled: Vec<_> = spans
        .iter()
        .filter(|(n, _)| n == "oncely.reconcile")
        .map(|(_, f)| f)
        .collect();
    assert_eq!(settled.len(), 2, "{spans:?}");
    for f in &settled {
        assert_eq!(f["tenant"], "acme");
        assert_eq!(f["verdict"], "done");
        assert_eq!(f["result"], "completed");
    }
    let by_key = |k: &EffectKey| settled.iter().find(|f| f["effect_key"] == k.as_str()).unwrap();
    assert_eq!(by_key(&receipt)["doubt"], "abandoned");
    assert_eq!(by_key(&receipt)["fence"], receipt_fence);
    // The stuck lease was written under the takeover's fence.
    assert_eq!(by_key(&capture)["doubt"], "stuck");
    assert_eq!(by_key(&capture)["fence"], capture_fence);
}
