//! The payment job crashed at every boundary, then redelivered until it
//! acks, on SQLite and PostgreSQL. For each crash point: exactly one capture,
//! the order paid by exactly one write, exactly one receipt except in the
//! at-most-once window (zero sends before the send, one after it; the step
//! abandoned and listed), and one more full redelivery changes nothing, nor
//! does a redelivery with an altered payload (refused as a fingerprint
//! mismatch).

mod common;

use std::sync::Arc;

use oncely::backend::RecordState;
use payment_job::{Boundary, Db, Delivered, OrderMsg, Pipeline};

async fn deliver_until_acked<D: Db>(p: &Pipeline<D>, msg: &OrderMsg) -> Delivered {
    for _ in 0..50 {
        match p.deliver(msg, None).await {
            Ok(d @ Delivered::Acked { .. }) => return d,
            Ok(other) => panic!("no crash was asked for: {other:?}"),
            // The crashed step's lease is still live, or a busy database:
            // the broker redelivers later.
            Err(e) if e.error.is_retryable() => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(e) => panic!("{}: {e}", msg.order_id),
        }
    }
    panic!("{}: never acked", msg.order_id)
}

async fn crash_at<D: Db>(p: Arc<Pipeline<D>>, b: Boundary) {
    let t = p.tenant.clone();
    let msg = OrderMsg {
        order_id: format!("{}{b:?}", common::prefix(&t)),
        amount: 4200,
    };
    p.db.insert_order(&msg.order_id, msg.amount).await.unwrap();
    let first = p.deliver(&msg, Some(b)).await.unwrap();
    assert_eq!(
        first,
        Delivered::Crashed(b),
        "the first delivery reaches every boundary"
    );

    let acked = deliver_until_acked(&p, &msg).await;
    assert_eq!(
        acked,
        Delivered::Acked {
            receipt_abandoned: b.in_receipt_window()
        },
        "{b:?}"
    );

    let snap = p.snapshot(std::slice::from_ref(&msg)).await.unwrap();
    let id = &msg.order_id;
    assert_eq!(snap.captures.get(id), Some(&1), "{b:?}: exactly one capture");
    let order = &snap.orders[0];
    assert_eq!(order.status, "paid", "{b:?}");
    assert_eq!(order.paid_writes, 1, "{b:?}: the order was written once");
    assert!(order.charge_id.is_some());
    let sends = snap.sends.get(id).copied().unwrap_or(0);
    let receipt = p.db.get(&p.step_key("receipt", id)).await.unwrap().unwrap();
    let listed: Vec<String> =
        p.db.abandoned(&t, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.key.to_string())
            .collect();
    match b {
        Boundary::AfterReceiptClaim => {
            assert_eq!(
                sends, 0,
                "crash after the mark, before the send: the receipt is lost"
            );
            assert_eq!(receipt.state, RecordState::Abandoned);
            assert_eq!(listed, [receipt.key.to_string()]);
        }
        Boundary::AfterSend => {
            assert_eq!(sends, 1, "crash after the send: sent once, never again");
            assert_eq!(receipt.state, RecordState::Abandoned);
            assert_eq!(listed, [receipt.key.to_string()]);
        }
        _ => {
            assert_eq!(sends, 1, "{b:?}: exactly one receipt");
            assert_eq!(receipt.state, RecordState::Completed);
            assert!(listed.is_empty(), "{b:?}: {listed:?}");
        }
    }
    for kind in ["capture", "mark-paid"] {
        let r = p.db.get(&p.step_key(kind, id)).await.unwrap().unwrap();
        assert_eq!(r.state, RecordState::Completed, "{b:?}: {kind}");
    }

    // One more full redelivery changes nothing.
    let again = p.deliver(&msg, None).await.unwrap();
    assert_eq!(again, acked);
    assert_eq!(
        p.snapshot(std::slice::from_ref(&msg)).await.unwrap(),
        snap,
        "{b:?}"
    );

    // A redelivery whose payload was altered is refused at its first step
    // and changes nothing either.
    let altered = OrderMsg {
        amount: msg.amount + 1,
        ..msg.clone()
    };
    let e = p.deliver(&altered, None).await.unwrap_err();
    assert_eq!(e.stage, "capture");
    assert!(
        matches!(e.error, oncely::Error::FingerprintMismatch { .. }),
        "{e}"
    );
    assert_eq!(
        p.snapshot(std::slice::from_ref(&msg)).await.unwrap(),
        snap,
        "{b:?}"
    );
}

async fn matrix<D: Db>(db: D) {
    // Each boundary on its own tenant and order, all at once: the leases
    // left by the crashes expire in parallel.
    let runs = Boundary::ALL.map(|b| {
        let p = common::pipeline(db.clone(), true);
        tokio::spawn(crash_at(p, b))
    });
    for r in runs {
        r.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_crash_matrix() {
    let (db, _dir) = common::sqlite().await;
    matrix(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crash_matrix() {
    let Some(db) = common::postgres().await else {
        return;
    };
    matrix(db).await;
}
