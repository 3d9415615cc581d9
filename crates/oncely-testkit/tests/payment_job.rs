//! The payment example's handler (capture provider-keyed, mark paid in a
//! transaction, receipt at most once) on SQLite passes the kit.
//!
//! (Its fake provider captures and answers without an await in between, so
//! no abort point falls inside the provider-keyed window: the kit's own
//! `catches_the_provider_keyed_window_when_the_provider_ignores_keys` covers
//! that window with a provider that does await its response.)

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use oncely::Tenant;
use oncely::backend::Ledger;
use oncely_sqlite::SqliteLedger;
use oncely_testkit::{Delivery, Scenario, TestKit};
use payment_job::{Db, Delivered, FakeProvider, Order, OrderMsg, Pipeline};

struct World {
    _dir: tempfile::TempDir,
    p: Pipeline<SqliteLedger>,
}

async fn world(honour_keys: bool) -> World {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("shop.db").display());
    let db = SqliteLedger::connect(&url).await.unwrap();
    db.create_orders().await.unwrap();
    db.insert_order("order-1", 1250).await.unwrap();
    let p = Pipeline::new(
        db,
        Tenant::new("shop").unwrap(),
        Arc::new(FakeProvider::new(honour_keys)),
        Duration::from_millis(150),
        Duration::from_millis(400),
    );
    World { _dir: dir, p }
}

async fn handle(w: &World, d: Delivery<OrderMsg>) -> Result<(), String> {
    match w.p.deliver(&d.payload, None).await {
        Ok(Delivered::Acked { .. }) => Ok(()),
        Ok(Delivered::Crashed(b)) => Err(format!("crashed at {b:?}")),
        Err(e) => Err(e.to_string()),
    }
}

/// What a customer and an operator can see.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    /// The order rows without their fence (a clock-based lease number that
    /// differs between any two runs).
    orders: Vec<Order>,
    captures: BTreeMap<String, u32>,
    receipt: Receipt,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Receipt {
    /// Sent once, step completed.
    Sent,
    /// A crash inside the at-most-once window: listed for reconciliation,
    /// sent zero times or once.
    Abandoned { sends: u32 },
    /// Anything else (sent twice, lost without a listing…).
    Wrong { sends: u32, listed: bool },
}

async fn seen(w: &World) -> Seen {
    let sends = w.p.mailer.sends().get("order-1").copied().unwrap_or(0);
    let listed = !w.p.db.abandoned(&w.p.tenant, 10).await.unwrap().is_empty();
    let receipt = match (sends, listed) {
        (1, false) => Receipt::Sent,
        (0 | 1, true) => Receipt::Abandoned { sends },
        (sends, listed) => Receipt::Wrong { sends, listed },
    };
    Seen {
        orders: (w.p.db.orders(&["order-1".to_owned()]).await.unwrap())
            .into_iter()
            .map(|o| Order { fence: 0, ..o })
            .collect(),
        captures: w.p.provider.captures(),
        receipt,
    }
}

/// Equal, except that a crash may leave the receipt abandoned for
/// reconciliation instead of sent: the at-most-once contract.
fn equivalent(single: &Seen, other: &Seen) -> bool {
    single.orders == other.orders
        && single.captures == other.captures
        && (single.receipt == other.receipt
            || (single.receipt == Receipt::Sent && matches!(other.receipt, Receipt::Abandoned { .. })))
}

fn msg() -> OrderMsg {
    OrderMsg {
        order_id: "order-1".to_owned(),
        amount: 1250,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payment_example_passes() {
    let summary = TestKit::new(msg())
        .copies(6)
        .check_with(async || world(true).await, handle, seen, equivalent)
        .await
        .unwrap_or_else(|report| panic!("{report}"));
    eprintln!("{summary:?}");
    assert!(summary.all_points_covered, "{summary:?}");
    assert!(summary.abort_points >= 5, "{summary:?}");
    assert!(summary.scenarios.contains(&Scenario::Concurrent { copies: 6 }));
}
