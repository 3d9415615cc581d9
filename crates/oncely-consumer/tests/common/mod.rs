//! The payment handler the consumer tests run, and the ledgers they run it on.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use oncely::backend::{Fingerprint, Ledger};
use oncely::conformance::{service_url, skip_or_fail};
use oncely::reconcile::Reconcile;
use oncely::{ClaimOptions, EffectKey, Effects, Failure, How, Tenant};
use oncely_consumer::{Context, Handler, HandlerError, json};
use oncely_postgres::PgLedger;
use oncely_sqlite::SqliteLedger;
use payment_job::{FakeMailer, FakeProvider, PaymentReconciler};
use serde::{Deserialize, Serialize};

/// A payment message. `order_id` is optional so that a payload without it
/// decodes and is dead-lettered as missing a key field.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PayMsg {
    pub order_id: Option<String>,
    pub amount: i64,
    #[serde(default)]
    pub decline: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pad: String,
}

impl PayMsg {
    pub fn order(id: &str, amount: i64) -> Vec<u8> {
        serde_json::to_vec(&PayMsg {
            order_id: Some(id.to_owned()),
            amount,
            decline: false,
            pad: String::new(),
        })
        .unwrap()
    }
}

/// What an end-to-end run publishes, in order: every order once
/// (`<order>-first`), 30 % of them again as new messages (`<order>-again`: a
/// producer's retry, a new broker id), then four poison messages
/// (undecodable, missing the order id, oversized, declined), each with its
/// test id.
pub struct Publications {
    pub orders: Vec<String>,
    pub payloads: Vec<(String, Vec<u8>)>,
    pub republished: usize,
    pub poison: Vec<(&'static str, Vec<u8>)>,
}

pub fn publications(n: usize) -> Publications {
    let orders: Vec<String> = (0..n).map(|i| format!("order-{i}")).collect();
    let mut payloads: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, o) in orders.iter().enumerate() {
        payloads.push((format!("{o}-first"), PayMsg::order(o, 1000 + i as i64)));
    }
    let republished = n * 3 / 10;
    for (i, o) in orders
        .iter()
        .enumerate()
        .step_by(n / republished)
        .take(republished)
    {
        // The same payload, a new message: a new broker id.
        payloads.push((format!("{o}-again"), PayMsg::order(o, 1000 + i as i64)));
    }
    let poison = vec![
        ("poison-undecodable", b"{not json".to_vec()),
        ("poison-missing", br#"{"amount":5}"#.to_vec()),
        (
            "poison-oversized",
            serde_json::to_vec(&PayMsg {
                order_id: Some("order-big".into()),
                amount: 1,
                decline: false,
                pad: "x".repeat(5000),
            })
            .unwrap(),
        ),
        (
            "poison-declined",
            serde_json::to_vec(&PayMsg {
                order_id: Some("order-declined".into()),
                amount: 1,
                decline: true,
                pad: String::new(),
            })
            .unwrap(),
        ),
    ];
    payloads.extend(poison.iter().map(|(id, p)| (id.to_string(), p.clone())));
    Publications {
        orders,
        payloads,
        republished,
        poison,
    }
}

/// Capture (provider-keyed) then send the receipt (at most once), keys from
/// the order id.
pub struct Payments<L> {
    pub effects: Effects<L>,
    pub tenant: Tenant,
    pub provider: Arc<FakeProvider>,
    pub mailer: Arc<FakeMailer>,
    pub opts: ClaimOptions,
    /// How long the capture takes (connections are killed meanwhile).
    pub work: Duration,
    /// Deliveries the broker counted as redeliveries.
    pub redelivered: Arc<AtomicU64>,
}

impl<L: Ledger + Clone + 'static> Payments<L> {
    pub fn new(ledger: L, tenant: Tenant, provider: Arc<FakeProvider>, mailer: Arc<FakeMailer>) -> Self {
        Payments {
            effects: Effects::new(ledger),
            tenant,
            provider,
            mailer,
            opts: ClaimOptions::default()
                .lease(Duration::from_secs(3))
                .on_in_progress(oncely::OnInProgress::Wait {
                    max: Duration::from_millis(100),
                }),
            work: Duration::from_millis(15),
            redelivered: Arc::default(),
        }
    }
}

impl<L: Ledger + Clone + 'static> Handler for Payments<L> {
    type Message = PayMsg;

    fn decode(&self, payload: &[u8]) -> Result<PayMsg, String> {
        json(payload)
    }

    async fn handle(&self, msg: PayMsg, ctx: Context) -> Result<How, HandlerError> {
        if ctx.delivery_count.is_some_and(|n| n > 1) {
            self.redelivered.fetch_add(1, Ordering::Relaxed);
        }
        let order = msg
            .order_id
            .clone()
            .ok_or(HandlerError::missing_field("order_id"))?;
        let capture_key = EffectKey::new(&self.tenant, "capture", &order)?;
        let opts = self
            .opts
            .clone()
            .fingerprint(Fingerprint::of_json(&(&order, msg.amount))?);
        let capture = self
            .effects
            .run_reported(&capture_key, &opts, |lease| {
                let order = order.clone();
                async move {
                    if msg.decline {
                        return Err(Failure::terminal("card declined"));
                    }
                    tokio::time::sleep(self.work).await;
                    Ok(self
                        .provider
                        .capture(&lease.provider_key(), &order, msg.amount)
                        .await)
                }
            })
            .await?;
        let receipt_key = EffectKey::new(&self.tenant, "receipt", &order)?;
        let receipt = self
            .effects
            .run_reported(&receipt_key, &self.opts.clone().at_most_once(true), |_| async {
                self.mailer.send_receipt(&order).await;
                Ok(())
            })
            .await?;
        Ok(if capture.how == How::Ran || receipt.how == How::Ran {
            How::Ran
        } else {
            How::Replayed
        })
    }
}

/// Settles the tenant's abandoned receipts as an operator's reconciliation
/// job would, from the mailer's log: a sent receipt is completed, an unsent
/// one released, and the delivery the consumer holds for it then sends it.
/// Returns how many were settled.
pub async fn reconcile_abandoned<L: Ledger + 'static>(
    ledger: &L,
    tenant: &Tenant,
    provider: &Arc<FakeProvider>,
    mailer: &Arc<FakeMailer>,
) -> u64 {
    let reconciler = PaymentReconciler {
        provider: provider.clone(),
        mailer: mailer.clone(),
    };
    let report = Reconcile::new(ledger, &reconciler)
        .abandoned(tenant)
        .await
        .unwrap();
    report.completed + report.released
}

pub async fn sqlite() -> (SqliteLedger, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
    (SqliteLedger::connect(&url).await.unwrap(), dir)
}

pub async fn postgres() -> Option<PgLedger> {
    let url = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    )?;
    match PgLedger::connect(&url).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("PostgreSQL at {url}: {e}")),
    }
}
