//! The layer in a plain tower stack (no axum): `ServiceBuilder`, a
//! `service_fn`, and `Full<Bytes>` bodies both ways, on the memory ledger.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use oncely::{MemoryLedger, Tenant};
use oncely_tower::{IdempotencyLayer, Principal};
use tower::{ServiceBuilder, ServiceExt};

#[tokio::test]
async fn a_plain_tower_stack_with_full_bodies() {
    let runs = Arc::new(AtomicUsize::new(0));
    let service = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(Arc::new(MemoryLedger::new()))
                .principals(|_: &http::request::Parts| Some(Principal::new(Tenant::global(), "svc"))),
        )
        .service_fn({
            let runs = runs.clone();
            move |req: Request<Full<Bytes>>| {
                let runs = runs.clone();
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst);
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let answer = format!("run {n} of {} bytes", body.len());
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(answer))))
                }
            }
        });
    let mut answers = Vec::new();
    for _ in 0..2 {
        let request = Request::post("/jobs")
            .header("idempotency-key", "\"job-1\"")
            .body(Full::new(Bytes::from_static(b"payload")))
            .unwrap();
        let response = service.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let replayed = response.headers().contains_key("idempotent-replayed");
        answers.push((replayed, response.into_body().collect().await.unwrap().to_bytes()));
    }
    assert_eq!(answers[0], (false, Bytes::from_static(b"run 0 of 7 bytes")));
    assert_eq!(answers[1], (true, Bytes::from_static(b"run 0 of 7 bytes")));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
