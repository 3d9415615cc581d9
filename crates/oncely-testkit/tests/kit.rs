//! The kit against handlers with known bugs (each must be caught, in the
//! scenario that exposes it) and against correct ones (each must pass).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncely::{ClaimOptions, EffectKey, Effects, MemoryLedger, OnInProgress, Tenant};
use oncely_testkit::{Delivery, Problem, Report, Scenario, TestKit};

/// A shop: a payment provider that captures every time it is asked (unless
/// it honours idempotency keys) and the orders marked done.
#[derive(Debug, Default)]
struct Shop {
    honour_keys: bool,
    state: Mutex<ShopState>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct ShopState {
    captures: BTreeMap<String, u32>,
    by_key: BTreeMap<String, String>,
    done: BTreeMap<String, bool>,
}

impl Shop {
    async fn capture(&self, idempotency_key: &str, order: &str) -> String {
        tokio::task::yield_now().await; // the network call
        // A repeated key is answered with the first charge at once; a new
        // one captures, and its answer takes a moment to come back.
        let (charge, new) = self.capture_now(idempotency_key, order);
        if new {
            tokio::task::yield_now().await;
        }
        charge
    }

    fn capture_now(&self, idempotency_key: &str, order: &str) -> (String, bool) {
        let mut s = self.state.lock().unwrap();
        if self.honour_keys
            && let Some(first) = s.by_key.get(idempotency_key)
        {
            return (first.clone(), false);
        }
        *s.captures.entry(order.to_owned()).or_default() += 1;
        let charge = format!("ch_{}", s.captures.values().sum::<u32>());
        s.by_key.insert(idempotency_key.to_owned(), charge.clone());
        (charge, true)
    }

    fn snapshot(&self) -> BTreeMap<String, u32> {
        self.state.lock().unwrap().captures.clone()
    }
}

fn kit() -> TestKit<String> {
    TestKit::new("order-1".to_owned()).redelivery_delay(Duration::from_millis(5))
}

fn expect_caught(result: Result<oncely_testkit::Summary, Report>) -> Report {
    match result {
        Ok(summary) => panic!("the kit passed a broken handler: {summary:?}"),
        Err(report) => {
            eprintln!("{report}");
            report
        }
    }
}

/// Reads "done?", calls the provider, then marks done: two concurrent
/// copies both read "not done" and both capture. The kit must catch it in
/// the concurrent scenario, and the sequential ones must pass (so the report
/// points at the real cause).
#[tokio::test]
async fn catches_a_check_then_act_handler() {
    let report = expect_caught(
        kit()
            .check(
                async || Shop::default(),
                async |shop: &Shop, d: Delivery<String>| {
                    let done = shop.state.lock().unwrap().done.contains_key(&d.payload);
                    if !done {
                        shop.capture("none", &d.payload).await;
                        shop.state.lock().unwrap().done.insert(d.payload, true);
                    }
                    Ok::<_, String>(())
                },
                async |shop: &Shop| shop.snapshot(),
            )
            .await,
    );
    assert_eq!(report.scenario, Scenario::Concurrent { copies: 8 });
    let Problem::Differs { single, got } = &report.problem else {
        panic!("{report:?}")
    };
    assert!(single.contains("\"order-1\": 1"), "{single}");
    assert!(got.contains("\"order-1\": 8"), "{got}");
    let text = report.to_string();
    assert!(text.contains("8 copies delivered at the same instant"), "{text}");
    assert!(
        text.contains("-     \"order-1\": 1,") && text.contains("+     \"order-1\": 8,"),
        "{text}"
    );
}

/// An oncely handler whose effect key is the broker's message id: a lost
/// ack (same id) is safe, a re-publication (new id) captures again. The
/// kit must catch it in the re-publication scenario.
#[tokio::test]
async fn catches_a_handler_keyed_on_the_message_id() {
    let report = expect_caught(
        kit()
            .check(
                async || World::new(true),
                async |w: &World, d: Delivery<String>| {
                    let key = EffectKey::new(&Tenant::global(), "capture", &d.message_id)?;
                    w.effects
                        .run(&key, &w.opts, |lease| async move {
                            Ok(w.shop.capture(&lease.provider_key(), &d.payload).await)
                        })
                        .await
                        .map(|_: String| ())
                },
                async |w: &World| w.shop.snapshot(),
            )
            .await,
    );
    assert_eq!(report.scenario, Scenario::Republished);
    assert!(
        report.run.contains("m-1") && report.run.contains("m-2"),
        "{}",
        report.run
    );
    assert!(report.to_string().contains("\"order-1\": 2"), "{report}");
}

struct World {
    effects: Effects<Arc<MemoryLedger>>,
    shop: Shop,
    opts: ClaimOptions,
}

impl World {
    fn new(honour_keys: bool) -> Self {
        World {
            effects: Effects::new(Arc::new(MemoryLedger::new())),
            shop: Shop {
                honour_keys,
                ..Shop::default()
            },
            opts: ClaimOptions::default()
                .lease(Duration::from_millis(150))
                .on_in_progress(OnInProgress::Wait {
                    max: Duration::from_secs(2),
                }),
        }
    }
}

async fn keyed_on_the_order(w: &World, d: Delivery<String>) -> oncely::Result<()> {
    let key = EffectKey::new(&Tenant::global(), "capture", &d.payload)?;
    w.effects
        .run(&key, &w.opts, |lease| async move {
            Ok(w.shop.capture(&lease.provider_key(), &d.payload).await)
        })
        .await
        .map(|_: String| ())
}

/// The same handler keyed on the order, against a provider that honours
/// keys: every scenario passes, including an abort at every await point.
#[tokio::test]
async fn passes_a_handler_keyed_on_the_payload() {
    let summary = kit()
        .check(
            async || World::new(true),
            keyed_on_the_order,
            async |w: &World| w.shop.snapshot(),
        )
        .await
        .unwrap_or_else(|report| panic!("{report}"));
    assert!(summary.all_points_covered, "{summary:?}");
    assert!(summary.abort_points >= 1, "{summary:?}");
    assert!(summary.scenarios.contains(&Scenario::Aborted { point: 1 }));
}

/// Keyed on the order but against a provider that ignores idempotency keys:
/// an abort after the provider call and before the completion re-runs the
/// capture when the lease expires (the documented provider-keyed window).
/// Only the abort scenario can see it.
#[tokio::test]
async fn catches_the_provider_keyed_window_when_the_provider_ignores_keys() {
    let report = expect_caught(
        kit()
            .check(
                async || World::new(false),
                keyed_on_the_order,
                async |w: &World| w.shop.snapshot(),
            )
            .await,
    );
    assert!(matches!(report.scenario, Scenario::Aborted { .. }), "{report}");
    assert!(report.run.contains("aborted at await point"), "{}", report.run);
}

/// A handler that never succeeds is reported as never acked, not as a
/// pass or a hang.
#[tokio::test]
async fn a_handler_that_always_fails_is_reported_as_never_acked() {
    let report = expect_caught(
        kit()
            .redelivery_timeout(Duration::from_millis(50))
            .check(
                async || (),
                async |_: &(), _: Delivery<String>| Err::<(), _>("payload missing amount"),
                async |_: &()| (),
            )
            .await,
    );
    assert_eq!(report.scenario, Scenario::Once);
    assert!(
        matches!(&report.problem, Problem::NeverAcked { last_error, .. } if last_error.contains("payload missing amount")),
        "{report:?}"
    );
}
