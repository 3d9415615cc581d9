//! A stored response erased on a data-protection request: a retry with the
//! same key gets `410 Gone` (problem type `erased`), never the erased
//! response and never a second run of the handler. On SQLite.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use oncely::EffectKey;
use oncely::admin::{Admin, RecordQuery};
use oncely_sqlite::SqliteLedger;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erased_response_is_gone_and_never_rerun() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("tower.db").display());
    let ledger = Arc::new(SqliteLedger::connect(&url).await.unwrap());
    let (app, counts) = common::app(ledger.clone(), |l| l);
    let first = common::post_req("/charges", "alice", "\"erase-me\"", r#"{"amount":1250}"#)
        .send(&app)
        .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(counts.charges.load(Ordering::SeqCst), 1);

    // The operator finds the request's record from who sent it and its key,
    // and erases it.
    let subject = EffectKey::client_subject("alice", "erase-me").unwrap();
    let found = ledger
        .records(&RecordQuery::all_tenants().subject(subject.clone()))
        .await
        .unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    let erasure = ledger.erase(found[0].key.tenant(), &subject).await.unwrap();
    assert_eq!(erasure.erased, vec![found[0].key.clone()]);

    let retry = common::post_req("/charges", "alice", "\"erase-me\"", r#"{"amount":1250}"#)
        .send(&app)
        .await;
    assert_eq!(retry.status, 410, "{retry:?}");
    assert_eq!(retry.problem()["type"], "tag:oncely.dev,2026:idempotency:erased");
    assert!(
        !retry.body.windows(4).any(|w| w == b"1250"),
        "nothing of the erased response comes back"
    );
    // Even with another body: the stored fingerprint went with the outcome.
    let other = common::post_req("/charges", "alice", "\"erase-me\"", r#"{"amount":9}"#)
        .send(&app)
        .await;
    assert_eq!(other.status, 410, "{other:?}");
    assert_eq!(
        counts.charges.load(Ordering::SeqCst),
        1,
        "the handler never ran again"
    );
}
