//! What the layer stores: encrypted when its ledger is wrapped in
//! [`Sealed`], and without what the redaction hooks remove. On the memory
//! ledger, read back past the codec to see the stored bytes.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use oncely::admin::{Admin, RecordQuery};
use oncely::codec::{Envelope, Keyring, Sealed, SecretKey};
use oncely::{MemoryLedger, Tenant};
use oncely_tower::{IdempotencyLayer, Principal};
use tower::{ServiceBuilder, ServiceExt};

const BODY: &str = r#"{"id":"ch_1","card":{"number":"4242424242424242","brand":"visa"},"token":"tok_once"}"#;

/// What the handler answers.
type Answer = std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>;

/// The handler: counts its runs, answers `BODY` with a cookie and a secret header.
fn handler(runs: Arc<AtomicUsize>) -> impl Fn(Request<Full<Bytes>>) -> Answer + Clone {
    move |_req| {
        runs.fetch_add(1, Ordering::SeqCst);
        let response = Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::SET_COOKIE, "session=s3cr3t")
            .header("x-one-time", "otp-778899")
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
            .unwrap();
        std::future::ready(Ok(response))
    }
}

async fn twice<L>(layer: IdempotencyLayer<L>, runs: &Arc<AtomicUsize>) -> Vec<Response<Bytes>>
where
    L: oncely::backend::Ledger + Clone + 'static,
{
    let service = ServiceBuilder::new()
        .layer(layer.principals(|_: &http::request::Parts| Some(Principal::new(Tenant::global(), "svc"))))
        .service_fn(handler(runs.clone()));
    let mut answers = Vec::new();
    for _ in 0..2 {
        let request = Request::post("/charges")
            .header("idempotency-key", "\"charge-1\"")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let response = service.clone().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        answers.push(Response::from_parts(
            parts,
            body.collect().await.unwrap().to_bytes(),
        ));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    answers
}

/// Every outcome the memory ledger stores, as stored.
async fn stored(ledger: &MemoryLedger) -> Vec<Vec<u8>> {
    let records = ledger.records(&RecordQuery::default()).await.unwrap();
    records
        .into_iter()
        .filter_map(|r| r.outcome)
        .map(|o| o.into_bytes())
        .collect()
}

fn holds(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[tokio::test]
async fn through_a_sealed_ledger_the_stored_response_is_encrypted() {
    let inner = Arc::new(MemoryLedger::new());
    let keys = Keyring::new("k1", SecretKey::from_bytes([5; 32])).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let answers = twice(
        IdempotencyLayer::new(Arc::new(Sealed::new(inner.clone(), keys))),
        &runs,
    )
    .await;
    assert_eq!(answers[1].body(), &Bytes::from_static(BODY.as_bytes()));
    assert!(answers[1].headers().contains_key("idempotent-replayed"));
    let stored = stored(&inner).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(Envelope::parse(&stored[0]).unwrap().key_id(), "k1");
    // The body is stored base64-encoded when plain: neither form is there.
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(BODY);
    assert!(!holds(&stored[0], "4242424242424242") && !holds(&stored[0], &b64[..40]));
}

#[tokio::test]
async fn redaction_hooks_drop_fields_and_headers_from_what_is_stored() {
    let inner = Arc::new(MemoryLedger::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(inner.clone())
        .replay_headers([header::CONTENT_TYPE, HeaderName::from_static("x-one-time")])
        .redact_json(["/token", "/card/number", "/absent/member"])
        .redact(|response| {
            response.headers_mut().remove("x-one-time");
        });
    let answers = twice(layer, &runs).await;

    // The first caller gets the handler's response untouched.
    let first = &answers[0];
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.body(), &Bytes::from_static(BODY.as_bytes()));
    assert_eq!(first.headers()["x-one-time"], "otp-778899");
    assert_eq!(first.headers()[header::SET_COOKIE], "session=s3cr3t");

    // A retry gets what was stored: without the removed members and headers.
    let replay = &answers[1];
    let body: serde_json::Value = serde_json::from_slice(replay.body()).unwrap();
    assert_eq!(body, serde_json::json!({"id": "ch_1", "card": {"brand": "visa"}}));
    assert!(!replay.headers().contains_key("x-one-time"));
    assert!(
        !replay.headers().contains_key(header::SET_COOKIE),
        "set-cookie is never stored unless listed"
    );
    assert_eq!(replay.headers()[header::CONTENT_TYPE], "application/json");

    let stored = stored(&inner).await;
    let stored = String::from_utf8(stored[0].clone()).unwrap();
    let value: serde_json::Value = serde_json::from_str(&stored).unwrap();
    use base64::Engine as _;
    let body = base64::engine::general_purpose::STANDARD
        .decode(value["ok"]["body"].as_str().unwrap())
        .unwrap();
    for secret in ["4242424242424242", "tok_once", "otp-778899", "s3cr3t"] {
        assert!(
            !holds(stored.as_bytes(), secret) && !holds(&body, secret),
            "{secret} is stored"
        );
    }
}
