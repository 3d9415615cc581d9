//! An HTTP request's record, stored by `oncely-tower` under a hash of its
//! principal and `Idempotency-Key`, found by `oncely inspect` and `oncely
//! history` from what an operator knows: who sent it and the key.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use oncely::{EffectKey, Tenant};
use oncely_sqlite::SqliteLedger;
use oncely_tower::{IdempotencyLayer, Principal};
use serde_json::Value;
use tower::ServiceExt;

mod common;
use common::{oncely, runtime, stderr, stdout};

/// Sends one `POST /refunds` with `key` as alice of tenant `acme` through
/// the layer on the ledger at `url`.
fn post_refund(url: &str, key: &str) {
    runtime().block_on(async {
        let ledger = Arc::new(SqliteLedger::connect(url).await.unwrap());
        let app = Router::new()
            .route("/refunds", post(|| async { "refunded" }))
            .layer(
                IdempotencyLayer::new(ledger).principals(|_: &http::request::Parts| {
                    Some(Principal::new(Tenant::new("acme").unwrap(), "alice"))
                }),
            );
        let request = http::Request::post("/refunds")
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .body(Body::from(r#"{"order":"o-1"}"#))
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::OK);
    });
}

fn run_json(args: &[&str]) -> Value {
    let out = oncely(args);
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}",
        stderr(&out),
        stdout(&out)
    );
    serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("{args:?}: {e}: {}", stdout(&out)))
}

#[test]
fn history_and_inspect_find_an_http_request_by_principal_and_client_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("api.db").display());
    post_refund(&url, "refund-7f3a");
    let expected = EffectKey::for_client(&Tenant::new("acme").unwrap(), "alice", "http", "refund-7f3a")
        .unwrap()
        .to_string();

    // What the user tried first: the header's value is not the subject.
    let by_header = run_json(&[
        "history",
        "--tenant",
        "acme",
        "--subject",
        "refund-7f3a",
        "--json",
        "--database-url",
        &url,
    ]);
    assert_eq!(by_header["records"].as_array().unwrap().len(), 0, "{by_header}");

    let history = run_json(&[
        "history",
        "--tenant",
        "acme",
        "--principal",
        "alice",
        "--client-key",
        "refund-7f3a",
        "--json",
        "--database-url",
        &url,
    ]);
    let records = history["records"].as_array().unwrap();
    assert_eq!(records.len(), 1, "{history}");
    assert_eq!(records[0]["key"], expected.as_str(), "{history}");

    let inspect = run_json(&[
        "inspect",
        "--tenant",
        "acme",
        "--principal",
        "alice",
        "--client-key",
        "refund-7f3a",
        "--json",
        "--database-url",
        &url,
    ]);
    assert_eq!(inspect["key"], expected.as_str(), "{inspect}");
    assert_eq!(inspect["class"], "completed", "{inspect}");

    // Another principal's identical key is another request: no record.
    let out = oncely(&[
        "inspect",
        "--tenant",
        "acme",
        "--principal",
        "bob",
        "--client-key",
        "refund-7f3a",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));

    // A client key without its principal is a usage error, not a silent miss.
    let out = oncely(&[
        "history",
        "--tenant",
        "acme",
        "--client-key",
        "refund-7f3a",
        "--database-url",
        &url,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}
