//! The layer's behaviour on a real axum app, one async function per
//! behaviour, run against each backend by `layer_tests!` (the backend test
//! files are a few lines each).
#![allow(dead_code)]

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use oncely::backend::Ledger;
use oncely::conformance::fresh_tenant;
use oncely::{OnInProgress, Tenant};
use oncely_tower::{BodyFingerprint, IdempotencyLayer, Principal};
use tower::ServiceExt;

/// Runs every behaviour below against the ledger `$open` returns
/// (`async fn() -> Option<(L, Guard)>`, the guard kept for the test's
/// length; `None`: the server is missing and the test skips).
#[macro_export]
macro_rules! layer_tests {
    ($open:path) => {
        $crate::layer_tests!(@each $open,
            sequential_retry_replays_byte_for_byte,
            concurrent_identical_requests_run_once_reject,
            concurrent_identical_requests_run_once_wait,
            payload_mismatch_is_422,
            missing_or_invalid_key_is_400,
            no_principal_is_401,
            principals_are_isolated,
            handler_panic_releases_the_key,
            server_error_releases_the_key,
            a_failing_response_body_is_the_handlers_result,
            a_panicking_response_body_is_caught,
            an_unrecorded_response_is_still_the_answer,
            released_key_stays_bound_to_its_fingerprint,
            oversized_request_is_refused_unread,
            oversized_response_is_stored_as_the_chosen_error,
            a_client_that_hangs_up_does_not_cancel_the_handler,
            optional_routes_pass_requests_without_a_key,
            json_with_other_whitespace_is_422_byte_for_byte,
            canonical_json_fingerprint_ignores_whitespace_and_key_order,
            the_layers_422_is_told_from_the_applications,
        );
    };
    (@each $open:path, $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some((ledger, _guard)) = $open().await else { return };
            common::$name(ledger).await;
        }
    )*};
}

/// What the app's handlers did.
#[derive(Clone, Default)]
pub struct Counts {
    pub charges: Arc<AtomicUsize>,
    pub boom: Arc<AtomicUsize>,
    pub flaky: Arc<AtomicUsize>,
    /// Runs of the handlers whose response bodies fail or panic.
    pub broken: Arc<AtomicUsize>,
}

fn counts(c: &Counts) -> (usize, usize, usize) {
    (
        c.charges.load(Ordering::SeqCst),
        c.boom.load(Ordering::SeqCst),
        c.flaky.load(Ordering::SeqCst),
    )
}

async fn charge(State(c): State<Counts>, headers: HeaderMap, body: Bytes) -> Response {
    let n = c.charges.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(ms) = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    // A nonce makes every run's body different, so a replay is told from a
    // second run by its bytes alone.
    let nonce = format!("{:016x}", fastrand_u64());
    let body = format!(
        r#"{{"charge":"ch_{n}","nonce":"{nonce}","request_bytes":{}}}"#,
        body.len()
    );
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::LOCATION, format!("/charges/ch_{n}")),
            (header::HeaderName::from_static("x-first-only"), "yes".to_owned()),
        ],
        body,
    )
        .into_response()
}

fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .elapsed()
            .map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

/// Panics on its first call, answers 201 afterwards.
async fn boom(State(c): State<Counts>) -> Response {
    if c.boom.fetch_add(1, Ordering::SeqCst) == 0 {
        panic!("the handler panics (on purpose, in a test)");
    }
    (StatusCode::CREATED, "recovered").into_response()
}

/// Answers 503 on its first call, 201 afterwards.
async fn flaky(State(c): State<Counts>) -> Response {
    if c.flaky.fetch_add(1, Ordering::SeqCst) == 0 {
        return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
    }
    (StatusCode::CREATED, "done").into_response()
}

/// A response body that yields a first frame, then fails (or panics, when
/// `panics`): what a handler that did its work and then streams its answer
/// from a source that breaks returns.
struct Broken {
    sent: bool,
    panics: bool,
}

impl http_body::Body for Broken {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if !self.sent {
            self.sent = true;
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"{\"charge\":")))));
        }
        if self.panics {
            panic!("the response body panics (on purpose, in a test)");
        }
        Poll::Ready(Some(Err(std::io::Error::other(
            "the response body fails (on purpose, in a test)",
        ))))
    }
}

/// Charges, then answers 201 with a body that fails while it is read.
async fn body_fails(State(c): State<Counts>) -> Response {
    c.broken.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        Body::new(Broken {
            sent: false,
            panics: false,
        }),
    )
        .into_response()
}

/// Charges, then answers 201 with a body that panics while it is read.
async fn body_panics(State(c): State<Counts>) -> Response {
    c.broken.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        Body::new(Broken {
            sent: false,
            panics: true,
        }),
    )
        .into_response()
}

async fn big() -> Response {
    (StatusCode::OK, vec![b'x'; 100 * 1024]).into_response()
}

#[derive(serde::Deserialize)]
struct Amount {
    #[allow(dead_code)]
    amount: u64,
}

/// A handler behind axum's JSON extractor: a body of the wrong shape is
/// the application's own 422.
async fn typed(axum::Json(_): axum::Json<Amount>) -> Response {
    (StatusCode::CREATED, "typed").into_response()
}

/// The app: POST /charges, /boom, /flaky, /body-fails, /body-panics, /big,
/// GET /charges; the
/// principal is the `x-user` header in this test's own tenant.
pub fn app<L: Ledger + Clone + 'static>(
    ledger: L,
    tune: impl FnOnce(IdempotencyLayer<L>) -> IdempotencyLayer<L>,
) -> (Router, Counts) {
    let tenant: Tenant = fresh_tenant();
    let counts = Counts::default();
    let layer = tune(IdempotencyLayer::new(ledger).max_request_bytes(1024 * 1024)).principals(
        move |req: &http::request::Parts| {
            let user = req.headers.get("x-user")?.to_str().ok()?;
            Some(Principal::new(tenant.clone(), user))
        },
    );
    let router = Router::new()
        .route("/charges", post(charge).get(|| async { "list" }))
        .route("/boom", post(boom))
        .route("/flaky", post(flaky))
        .route("/body-fails", post(body_fails))
        .route("/body-panics", post(body_panics))
        .route("/big", post(big))
        .route("/typed", post(typed))
        .route("/health", get(|| async { "ok" }))
        .with_state(counts.clone())
        .layer(layer);
    (router, counts)
}

/// One answer, read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.headers.get(header::CONTENT_TYPE).unwrap(),
            "application/problem+json",
            "{self:?}"
        );
        let p: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(p["status"], self.status.as_u16());
        p
    }
}

pub struct Req<'a> {
    method: Method,
    path: &'a str,
    user: Option<&'a str>,
    key: Option<&'a str>,
    extra: Vec<(&'static str, String)>,
    body: Body,
}

pub fn post_req<'a>(path: &'a str, user: &'a str, key: &'a str, body: &str) -> Req<'a> {
    Req {
        method: Method::POST,
        path,
        user: Some(user),
        key: Some(key),
        extra: vec![("content-type", "application/json".into())],
        body: Body::from(body.to_owned()),
    }
}

impl<'a> Req<'a> {
    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.extra.push((name, value.into()));
        self
    }

    pub async fn send(self, app: &Router) -> Answer {
        let mut b = Request::builder().method(self.method).uri(self.path);
        if let Some(user) = self.user {
            b = b.header("x-user", user);
        }
        if let Some(key) = self.key {
            b = b.header("idempotency-key", key);
        }
        for (n, v) in self.extra {
            b = b.header(n, v);
        }
        let response = app.clone().oneshot(b.body(self.body).unwrap()).await.unwrap();
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }
}

fn new_key() -> String {
    format!("\"{}\"", fastrand_u64())
}

pub async fn sequential_retry_replays_byte_for_byte<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l);
    let key = new_key();
    let first = post_req("/charges", "alice", &key, r#"{"amount":1250}"#)
        .send(&app)
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(first.headers["x-first-only"], "yes");
    for _ in 0..2 {
        let again = post_req("/charges", "alice", &key, r#"{"amount":1250}"#)
            .send(&app)
            .await;
        assert_eq!(again.status, first.status);
        assert_eq!(again.body, first.body, "the body is replayed byte for byte");
        assert!(again.replayed(), "{again:?}");
        assert_eq!(
            again.headers[header::CONTENT_TYPE],
            first.headers[header::CONTENT_TYPE]
        );
        assert_eq!(again.headers[header::LOCATION], first.headers[header::LOCATION]);
        assert!(
            again.headers.get("x-first-only").is_none(),
            "only replay headers are stored"
        );
    }
    // The bare form of the same key is the same key.
    let bare = post_req("/charges", "alice", key.trim_matches('"'), r#"{"amount":1250}"#)
        .send(&app)
        .await;
    assert_eq!(bare.body, first.body);
    assert!(bare.replayed());
    // A GET is not part of it: it needs no key and is never replayed.
    let list = Req {
        method: Method::GET,
        path: "/charges",
        user: None,
        key: None,
        extra: vec![],
        body: Body::empty(),
    }
    .send(&app)
    .await;
    assert_eq!((list.status, &list.body[..]), (StatusCode::OK, &b"list"[..]));
    assert_eq!(counts(&c).0, 1, "the handler ran once");
}

async fn concurrent(app: &Router, key: &str) -> Vec<Answer> {
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (app, key) = (app.clone(), key.to_owned());
            tokio::spawn(async move {
                post_req("/charges", "alice", &key, r#"{"amount":7}"#)
                    .header("x-delay-ms", "300")
                    .send(&app)
                    .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    answers
}

pub async fn concurrent_identical_requests_run_once_reject<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l.on_in_flight(OnInProgress::Reject));
    let key = new_key();
    let answers = concurrent(&app, &key).await;
    assert_eq!(counts(&c).0, 1, "32 identical requests ran the handler once");
    let ran: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !a.replayed())
        .collect();
    assert_eq!(ran.len(), 1, "{answers:?}");
    for a in &answers {
        match a.status {
            StatusCode::CREATED => assert_eq!(a.body, ran[0].body),
            StatusCode::CONFLICT => {
                assert_eq!(a.problem()["type"], "tag:oncely.dev,2026:idempotency:in-flight");
                assert_eq!(a.headers[header::RETRY_AFTER], "1");
            }
            other => panic!("unexpected {other}: {a:?}"),
        }
    }
    assert!(answers.iter().any(|a| a.status == StatusCode::CONFLICT));
    let after = post_req("/charges", "alice", &key, r#"{"amount":7}"#)
        .header("x-delay-ms", "300")
        .send(&app)
        .await;
    assert_eq!(after.body, ran[0].body);
    assert!(after.replayed());
}

pub async fn concurrent_identical_requests_run_once_wait<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| {
        l.on_in_flight(OnInProgress::Wait {
            max: Duration::from_secs(60),
        })
    });
    let key = new_key();
    let answers = concurrent(&app, &key).await;
    assert_eq!(counts(&c).0, 1, "32 identical requests ran the handler once");
    let first = answers.iter().find(|a| !a.replayed()).expect("one ran it");
    for a in &answers {
        assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
        assert_eq!(a.body, first.body, "every waiter got the replay");
    }
    assert_eq!(answers.iter().filter(|a| a.replayed()).count(), 31);
}

pub async fn payload_mismatch_is_422<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l);
    let key = new_key();
    let first = post_req("/charges", "alice", &key, r#"{"amount":1}"#)
        .send(&app)
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other_body = post_req("/charges", "alice", &key, r#"{"amount":2}"#)
        .send(&app)
        .await;
    assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        other_body.problem()["type"],
        "tag:oncely.dev,2026:idempotency:key-reused"
    );
    let other_path = post_req("/charges?x=1", "alice", &key, r#"{"amount":1}"#)
        .send(&app)
        .await;
    assert_eq!(other_path.status, StatusCode::UNPROCESSABLE_ENTITY);
    let mut other_type = post_req("/charges", "alice", &key, r#"{"amount":1}"#);
    other_type.extra = vec![("content-type", "text/plain".into())];
    assert_eq!(
        other_type.send(&app).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // The original request still replays.
    let same = post_req("/charges", "alice", &key, r#"{"amount":1}"#)
        .send(&app)
        .await;
    assert_eq!((same.status, &same.body), (first.status, &first.body));
    assert_eq!(counts(&c).0, 1);
}

pub async fn missing_or_invalid_key_is_400<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger.clone(), |l| l);
    let mut missing = post_req("/charges", "alice", "", "{}");
    missing.key = None;
    let missing = missing.send(&app).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.problem()["type"],
        "tag:oncely.dev,2026:idempotency:missing-key"
    );
    for bad in ["\"\"", "\"unterminated", "two words", "\"a\" trailing"] {
        let a = post_req("/charges", "alice", bad, "{}").send(&app).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(a.problem()["type"], "tag:oncely.dev,2026:idempotency:invalid-key");
    }
    let twice = post_req("/charges", "alice", "\"k1\"", "{}")
        .header("idempotency-key", "\"k2\"")
        .send(&app)
        .await;
    assert_eq!(twice.status, StatusCode::BAD_REQUEST);
    assert_eq!(counts(&c).0, 0, "nothing ran");

    // Bare tokens are accepted by default (see the sequential test); the
    // strict setting takes only sf-strings.
    let (strict, c) = self::app(ledger, |l| l.accept_bare_key(false));
    let bare = post_req("/charges", "alice", "k-1", "{}").send(&strict).await;
    assert_eq!(bare.status, StatusCode::BAD_REQUEST);
    let quoted = post_req("/charges", "alice", "\"k-1\"", "{}").send(&strict).await;
    assert_eq!(quoted.status, StatusCode::CREATED);
    assert_eq!(counts(&c).0, 1);
}

pub async fn no_principal_is_401<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l);
    let mut anonymous = post_req("/charges", "alice", "\"k\"", "{}");
    anonymous.user = None;
    let a = anonymous.send(&app).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        a.problem()["type"],
        "tag:oncely.dev,2026:idempotency:unauthenticated"
    );
    assert_eq!(counts(&c).0, 0);
}

pub async fn principals_are_isolated<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l.on_in_flight(OnInProgress::Reject));
    let key = new_key();
    // Alice's request is in flight: Bob's identical key is not blocked by it.
    let alice = {
        let (app, key) = (app.clone(), key.clone());
        tokio::spawn(async move {
            post_req("/charges", "alice", &key, r#"{"amount":1}"#)
                .header("x-delay-ms", "500")
                .send(&app)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let bob = post_req("/charges", "bob", &key, r#"{"amount":1}"#)
        .header("x-delay-ms", "500")
        .send(&app)
        .await;
    let alice = alice.await.unwrap();
    assert_eq!(alice.status, StatusCode::CREATED);
    assert_eq!(
        bob.status,
        StatusCode::CREATED,
        "Bob is not blocked by Alice's key: {bob:?}"
    );
    assert!(!bob.replayed());
    assert_ne!(bob.body, alice.body);
    // After both completed, Carol cannot replay Alice's response with
    // Alice's key (she runs her own), nor is she refused for another body.
    let carol = post_req("/charges", "carol", &key, r#"{"amount":9}"#)
        .send(&app)
        .await;
    assert_eq!(carol.status, StatusCode::CREATED);
    assert!(!carol.replayed());
    assert_ne!(carol.body, alice.body);
    // Each principal replays only its own.
    let alice_again = post_req("/charges", "alice", &key, r#"{"amount":1}"#)
        .header("x-delay-ms", "500")
        .send(&app)
        .await;
    assert_eq!(alice_again.body, alice.body);
    let bob_again = post_req("/charges", "bob", &key, r#"{"amount":1}"#)
        .header("x-delay-ms", "500")
        .send(&app)
        .await;
    assert_eq!(bob_again.body, bob.body);
    assert_eq!(counts(&c).0, 3);
}

pub async fn handler_panic_releases_the_key<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger.clone(), |l| l);
    let key = new_key();
    let first = post_req("/boom", "alice", &key, "{}").send(&app).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        first.problem()["type"],
        "tag:oncely.dev,2026:idempotency:handler-panicked"
    );
    let retry = post_req("/boom", "alice", &key, "{}").send(&app).await;
    assert_eq!(
        (retry.status, &retry.body[..]),
        (StatusCode::CREATED, &b"recovered"[..])
    );
    assert!(!retry.replayed(), "the retry ran the handler");
    let replay = post_req("/boom", "alice", &key, "{}").send(&app).await;
    assert!(replay.replayed());
    assert_eq!(counts(&c).1, 2);

    // With the policy off, the panic's 500 is what the key stores.
    let (app, c) = self::app(ledger, |l| l.release_panics(false));
    let first = post_req("/boom", "alice", &key, "{}").send(&app).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retry = post_req("/boom", "alice", &key, "{}").send(&app).await;
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert!(retry.replayed());
    assert_eq!(counts(&c).1, 1, "the handler did not run again");
}

pub async fn server_error_releases_the_key<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger.clone(), |l| l);
    let key = new_key();
    let first = post_req("/flaky", "alice", &key, "{}").send(&app).await;
    assert_eq!(
        (first.status, &first.body[..]),
        (StatusCode::SERVICE_UNAVAILABLE, &b"try again"[..])
    );
    let retry = post_req("/flaky", "alice", &key, "{}").send(&app).await;
    assert_eq!(
        (retry.status, &retry.body[..]),
        (StatusCode::CREATED, &b"done"[..])
    );
    assert!(!retry.replayed());
    assert_eq!(counts(&c).2, 2);

    // With the policy off, the 5xx is what the key stores.
    let (app, c) = self::app(ledger, |l| l.release_server_errors(false));
    let key = new_key();
    let first = post_req("/flaky", "alice", &key, "{}").send(&app).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry = post_req("/flaky", "alice", &key, "{}").send(&app).await;
    assert_eq!(
        (retry.status, &retry.body[..]),
        (StatusCode::SERVICE_UNAVAILABLE, &b"try again"[..])
    );
    assert!(retry.replayed());
    assert_eq!(counts(&c).2, 1);
}

pub async fn a_failing_response_body_is_the_handlers_result<L: Ledger + Clone + 'static>(ledger: L) {
    // The handler ran (it charged); its body failing is its result, stored
    // like the 5xx it stands for when 5xx responses are kept.
    let (app, c) = app(ledger.clone(), |l| l.release_server_errors(false));
    let key = new_key();
    let first = post_req("/body-fails", "alice", &key, "{}").send(&app).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
    assert_eq!(
        first.problem()["type"],
        "tag:oncely.dev,2026:idempotency:response-body-failed"
    );
    assert!(!first.replayed());
    for _ in 0..2 {
        let retry = post_req("/body-fails", "alice", &key, "{}").send(&app).await;
        assert_eq!(
            (retry.status, &retry.body),
            (first.status, &first.body),
            "{retry:?}"
        );
        assert!(retry.replayed(), "{retry:?}");
    }
    assert_eq!(c.broken.load(Ordering::SeqCst), 1, "3 requests, 1 charge");

    // Released like a 5xx (the default): each retry runs the handler again.
    let (app, c) = self::app(ledger, |l| l.release_server_errors(true));
    let key = new_key();
    for run in 1..=2 {
        let a = post_req("/body-fails", "alice", &key, "{}").send(&app).await;
        assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{a:?}");
        assert!(!a.replayed(), "{a:?}");
        assert_eq!(c.broken.load(Ordering::SeqCst), run);
    }
}

pub async fn an_unrecorded_response_is_still_the_answer<L: Ledger + Clone + 'static>(ledger: L) {
    // The handler ran (it charged) and the ledger failed to record its
    // response: the client gets the handler's answer, not a 503 that would
    // have it retry and, once the lease ends, charge again.
    let faulty = oncely::conformance::Faulty::new(ledger).fail_completions(1);
    let (app, c) = app(faulty, |l| l);
    let key = new_key();
    let first = post_req("/charges", "alice", &key, "{}").send(&app).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(
        String::from_utf8_lossy(&first.body).contains(r#""charge":"ch_1""#),
        "{first:?}"
    );
    assert!(!first.replayed());
    assert_eq!(counts(&c).0, 1);
    // The lease is still held: a retry meanwhile is told it is in flight.
    let retry = post_req("/charges", "alice", &key, "{}").send(&app).await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(counts(&c).0, 1);
}

pub async fn a_panicking_response_body_is_caught<L: Ledger + Clone + 'static>(ledger: L) {
    // A panic while the layer reads the body is the handler's panic: caught,
    // and with panics kept, stored for the key (no 409 until the lease ends).
    let (app, c) = app(ledger.clone(), |l| {
        l.release_panics(false).on_in_flight(OnInProgress::Reject)
    });
    let key = new_key();
    let first = post_req("/body-panics", "alice", &key, "{}").send(&app).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR, "{first:?}");
    assert_eq!(
        first.problem()["type"],
        "tag:oncely.dev,2026:idempotency:handler-panicked"
    );
    assert!(!first.replayed());
    let retry = post_req("/body-panics", "alice", &key, "{}").send(&app).await;
    assert_eq!(
        (retry.status, &retry.body),
        (first.status, &first.body),
        "{retry:?}"
    );
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(
        c.broken.load(Ordering::SeqCst),
        1,
        "the handler did not run again"
    );

    // Released (the default): the key is given back at once, and the retry
    // runs the handler again.
    let (app, c) = self::app(ledger, |l| {
        l.release_panics(true).on_in_flight(OnInProgress::Reject)
    });
    let key = new_key();
    for run in 1..=2 {
        let a = post_req("/body-panics", "alice", &key, "{}").send(&app).await;
        assert_eq!(a.status, StatusCode::INTERNAL_SERVER_ERROR, "{a:?}");
        assert_eq!(
            a.problem()["type"],
            "tag:oncely.dev,2026:idempotency:handler-panicked"
        );
        assert!(!a.replayed(), "{a:?}");
        assert_eq!(c.broken.load(Ordering::SeqCst), run);
    }
}

pub async fn released_key_stays_bound_to_its_fingerprint<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l);
    let key = new_key();
    let first = post_req("/boom", "alice", &key, r#"{"a":1}"#).send(&app).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    // The key was released, but it still names the first request: another
    // body under it is refused, and nothing runs.
    let other = post_req("/boom", "alice", &key, r#"{"a":2}"#).send(&app).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
    assert_eq!(counts(&c).1, 1);
    let same = post_req("/boom", "alice", &key, r#"{"a":1}"#).send(&app).await;
    assert_eq!(same.status, StatusCode::CREATED);
    assert_eq!(counts(&c).1, 2);
}

/// A request body that yields `chunk`-byte frames until `total` bytes and
/// counts what was pulled from it.
struct Counted {
    left: usize,
    chunk: usize,
    pulled: Arc<AtomicUsize>,
    exact: bool,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.chunk.min(self.left);
        self.left -= n;
        self.pulled.fetch_add(n, Ordering::SeqCst);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'a'; n])))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.exact {
            http_body::SizeHint::with_exact(self.left as u64)
        } else {
            http_body::SizeHint::default()
        }
    }
}

pub async fn oversized_request_is_refused_unread<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l.max_request_bytes(1024 * 1024));
    for exact in [false, true] {
        let pulled = Arc::new(AtomicUsize::new(0));
        let body = Counted {
            left: 1024 * 1024 * 1024,
            chunk: 64 * 1024,
            pulled: pulled.clone(),
            exact,
        };
        let mut req = post_req("/charges", "alice", "\"big\"", "");
        req.body = Body::new(body);
        let a = req.send(&app).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            a.problem()["type"],
            "tag:oncely.dev,2026:idempotency:request-too-large"
        );
        let pulled = pulled.load(Ordering::SeqCst);
        if exact {
            assert_eq!(
                pulled, 0,
                "a known length over the limit is refused before reading"
            );
        } else {
            assert!(
                pulled <= 1024 * 1024 + 64 * 1024,
                "read {pulled} bytes of a 1 GiB body"
            );
        }
    }
    assert_eq!(counts(&c).0, 0);
}

pub async fn oversized_response_is_stored_as_the_chosen_error<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, _) = app(ledger, |l| {
        l.max_response_bytes(16 * 1024).rejection_response(|r| {
            let mut p = r.problem();
            if r.code() == "response-too-large" {
                *p.status_mut() = StatusCode::INSUFFICIENT_STORAGE;
            }
            p
        })
    });
    let key = new_key();
    let first = post_req("/big", "alice", &key, "{}").send(&app).await;
    assert_eq!(
        first.status,
        StatusCode::INSUFFICIENT_STORAGE,
        "the application's choice"
    );
    assert!(!first.replayed());
    let again = post_req("/big", "alice", &key, "{}").send(&app).await;
    assert_eq!(again.status, StatusCode::INSUFFICIENT_STORAGE);
    assert_eq!(again.body, first.body);
    assert!(
        again.replayed(),
        "the handler ran once; its stand-in answer is what the key keeps"
    );
}

pub async fn a_client_that_hangs_up_does_not_cancel_the_handler<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| {
        l.on_in_flight(OnInProgress::Wait {
            max: Duration::from_secs(30),
        })
    });
    let key = new_key();
    let slow = post_req("/charges", "alice", &key, "{}")
        .header("x-delay-ms", "400")
        .send(&app);
    // The client gives up while the handler runs: its future is dropped as
    // soon as the handler has started (not after a fixed time: on a loaded
    // machine the claim alone can take longer than any short timeout).
    let mut slow = Box::pin(slow);
    let started = async {
        while counts(&c).0 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    tokio::select! {
        r = &mut slow => panic!("the 400 ms handler answered before the client hung up: {r:?}"),
        _ = tokio::time::timeout(Duration::from_secs(20), started) => {}
    }
    drop(slow);
    assert_eq!(counts(&c).0, 1, "the handler started");
    // The retry waits for the first run, which went on to completion, and
    // gets its response instead of running again.
    let retry = post_req("/charges", "alice", &key, "{}")
        .header("x-delay-ms", "400")
        .send(&app)
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(counts(&c).0, 1);
}

pub async fn optional_routes_pass_requests_without_a_key<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| {
        l.requirement(|parts| {
            if parts.uri.path() == "/charges" {
                oncely_tower::KeyRequirement::Optional
            } else {
                oncely_tower::KeyRequirement::Ignored
            }
        })
    });
    let mut keyless = post_req("/charges", "alice", "", "{}");
    keyless.key = None;
    let mut keyless2 = post_req("/charges", "alice", "", "{}");
    keyless2.key = None;
    let (a, b) = (keyless.send(&app).await, keyless2.send(&app).await);
    assert_eq!((a.status, b.status), (StatusCode::CREATED, StatusCode::CREATED));
    assert_ne!(a.body, b.body, "without a key every request runs");
    let key = new_key();
    let first = post_req("/charges", "alice", &key, "{}").send(&app).await;
    let again = post_req("/charges", "alice", &key, "{}").send(&app).await;
    assert_eq!(again.body, first.body);
    assert!(again.replayed());
    // An ignored route does nothing with a key, even a malformed one.
    for _ in 0..2 {
        let ignored = post_req("/flaky", "alice", "not a key", "{}").send(&app).await;
        assert!(!ignored.replayed());
        assert_ne!(ignored.status, StatusCode::BAD_REQUEST);
    }
    assert_eq!(counts(&c).0, 3);
    assert_eq!(counts(&c).2, 2);
}

/// By default the body is compared byte for byte: the same JSON with other
/// whitespace and key order is another request (422), and the problem's
/// detail says so.
pub async fn json_with_other_whitespace_is_422_byte_for_byte<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, c) = app(ledger, |l| l);
    let key = new_key();
    let first = post_req("/charges", "alice", &key, r#"{"amount":1,"currency":"eur"}"#)
        .send(&app)
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let respaced = post_req(
        "/charges",
        "alice",
        &key,
        "{ \"currency\": \"eur\",\n  \"amount\": 1 }",
    )
    .send(&app)
    .await;
    assert_eq!(respaced.status, StatusCode::UNPROCESSABLE_ENTITY, "{respaced:?}");
    let detail = respaced.problem()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("byte for byte"), "{detail}");
    assert_eq!(counts(&c).0, 1);
}

/// With `BodyFingerprint::CanonicalJson`, a retry that re-serialised the
/// same JSON (other whitespace, other key order) is the same request and
/// gets the stored response; another value is still a 422.
pub async fn canonical_json_fingerprint_ignores_whitespace_and_key_order<L: Ledger + Clone + 'static>(
    ledger: L,
) {
    let (app, c) = app(ledger, |l| l.body_fingerprint(BodyFingerprint::CanonicalJson));
    let key = new_key();
    let first = post_req(
        "/charges",
        "alice",
        &key,
        r#"{"amount":1,"currency":"eur","tags":[{"b":1,"a":2}]}"#,
    )
    .send(&app)
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let respaced = post_req(
        "/charges",
        "alice",
        &key,
        "{ \"tags\": [ { \"a\": 2, \"b\": 1 } ],\n  \"currency\": \"eur\", \"amount\": 1 }",
    )
    .send(&app)
    .await;
    assert_eq!(respaced.status, StatusCode::CREATED, "{respaced:?}");
    assert!(respaced.replayed(), "{respaced:?}");
    assert_eq!(respaced.body, first.body);
    let other = post_req(
        "/charges",
        "alice",
        &key,
        r#"{"amount":2,"currency":"eur","tags":[{"b":1,"a":2}]}"#,
    )
    .send(&app)
    .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(counts(&c).0, 1);
}

/// The layer's own answers carry `Idempotency-Rejection: <code>`; the
/// application's 422 (axum's JSON extractor refusing a body) does not.
pub async fn the_layers_422_is_told_from_the_applications<L: Ledger + Clone + 'static>(ledger: L) {
    let (app, _c) = app(ledger, |l| l);
    let key = new_key();
    let apps = post_req("/typed", "alice", &key, r#"{"amount":"twelve"}"#)
        .send(&app)
        .await;
    assert_eq!(apps.status, StatusCode::UNPROCESSABLE_ENTITY, "{apps:?}");
    assert!(apps.headers.get("idempotency-rejection").is_none(), "{apps:?}");
    // The application's 422 is the key's answer; another body is the layer's.
    let layers = post_req("/typed", "alice", &key, r#"{"amount":12}"#)
        .send(&app)
        .await;
    assert_eq!(layers.status, StatusCode::UNPROCESSABLE_ENTITY, "{layers:?}");
    assert_eq!(layers.headers.get("idempotency-rejection").unwrap(), "key-reused");
    let missing = Req {
        key: None,
        ..post_req("/charges", "alice", "", "{}")
    }
    .send(&app)
    .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.headers.get("idempotency-rejection").unwrap(),
        "missing-key"
    );
}
