//! [`Idempotency`]: the service that claims a request's key, runs the inner
//! service once, stores its response and replays it.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use oncely::backend::{Fingerprint, Ledger};
use oncely::{BoxError, ClaimOptions, EffectKey, Effects, Error, Failure};
use tower_service::Service;

use crate::config::{Config, KeyRequirement};
use crate::error::Rejection;
use crate::future::ResponseFuture;
use crate::header;
use crate::principal::PrincipalSource;
use crate::stored::{self, ReadError, StoredResponse};

pub(crate) struct Shared<L, P> {
    pub(crate) effects: Effects<L>,
    pub(crate) opts: ClaimOptions,
    pub(crate) outcome_limit: usize,
    pub(crate) config: Config<P>,
}

impl<L, P> Shared<L, P> {
    fn reject<B: From<Bytes>>(&self, rejection: &Rejection) -> Response<B> {
        let mut response = (self.config.rejection)(rejection);
        // Whatever body the application chose, the client can tell this
        // answer from the application's own (a 422 from a JSON extractor).
        response.headers_mut().insert(
            header::IDEMPOTENCY_REJECTION.clone(),
            http::HeaderValue::from_static(rejection.code()),
        );
        response.map(B::from)
    }
}

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around
/// `S`. See the [crate docs](crate) for what it does with each request.
///
/// Request and response bodies are the inner service's own types (an axum
/// `Body`, `Full<Bytes>`…); both must be buildable from [`Bytes`], since a
/// request body read for its fingerprint and a stored response are handed
/// on as bytes.
pub struct Idempotency<S, L, P> {
    inner: S,
    shared: Arc<Shared<L, P>>,
}

impl<S, L, P> Idempotency<S, L, P> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<L, P>>) -> Self {
        Idempotency { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Clone, L, P> Clone for Idempotency<S, L, P> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: std::fmt::Debug, L, P> std::fmt::Debug for Idempotency<S, L, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, L, P, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S, L, P>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    L: Ledger + 'static,
    P: PrincipalSource,
    ReqB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        // The service that was polled ready is the one that runs the request
        // (it moves into the future); a clone stays for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(Box::pin(handle(self.shared.clone(), inner, request)))
    }
}

async fn handle<S, L, P, ReqB, ResB>(
    shared: Arc<Shared<L, P>>,
    mut inner: S,
    request: Request<ReqB>,
) -> Result<Response<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    L: Ledger + 'static,
    P: PrincipalSource,
    ReqB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let config = &shared.config;
    let (parts, body) = request.into_parts();
    let requirement = (config.requirement)(&parts);
    if requirement == KeyRequirement::Ignored {
        return inner.call(Request::from_parts(parts, body)).await;
    }
    let client_key = match header::client_key(&parts.headers, config.accept_bare_key) {
        Ok(Some(key)) => key,
        Ok(None) if requirement == KeyRequirement::Optional => {
            return inner.call(Request::from_parts(parts, body)).await;
        }
        Ok(None) => return Ok(shared.reject(&Rejection::MissingKey)),
        Err(reason) => return Ok(shared.reject(&Rejection::InvalidKey { reason })),
    };
    let Some(principal) = config.principals.principal(&parts) else {
        return Ok(shared.reject(&Rejection::Unauthenticated));
    };
    let key = match EffectKey::for_client(principal.tenant(), principal.id(), &config.kind, &client_key) {
        Ok(key) => key,
        Err(e) => {
            return Ok(shared.reject(&Rejection::InvalidKey {
                reason: e.to_string(),
            }));
        }
    };
    let limit = config.max_request_bytes;
    let body = match stored::read_limited(body, limit).await {
        Ok(body) => body,
        Err(ReadError::TooLarge) => return Ok(shared.reject(&Rejection::RequestTooLarge { limit })),
        Err(ReadError::Failed(_)) => return Ok(shared.reject(&Rejection::RequestBodyFailed)),
    };
    let fingerprint = stored::fingerprint(
        &parts,
        &config.fingerprint_headers,
        config.body_fingerprint,
        &body,
    );
    let request = Request::from_parts(parts, ReqB::from(body));
    // The handler runs in a task of its own: a client that hangs up does not
    // cancel it halfway, so its response is stored and the client's retry
    // gets it back instead of finding the key held until the lease ends.
    match tokio::spawn(once(shared.clone(), inner, key, fingerprint, request)).await {
        Ok(answer) => answer,
        Err(e) => {
            tracing::error!(error = %e, "idempotency task failed");
            Ok(shared.reject(&Rejection::HandlerPanicked))
        }
    }
}

/// What the run of the handler left for the caller besides the stored
/// response.
struct Side<B, E> {
    /// The response to give this caller (it ran the handler).
    first: Option<Response<Bytes>>,
    /// A 5xx response given back with the key released.
    released: Option<Response<B>>,
    /// The inner service's own error (the key was released).
    error: Option<E>,
    /// Why the key was released, when it was not a 5xx or an error.
    rejection: Option<Rejection>,
}

type SideCell<B, E> = Arc<Mutex<Side<B, E>>>;

fn side<B, E, T>(cell: &SideCell<B, E>, f: impl FnOnce(&mut Side<B, E>) -> T) -> T {
    f(&mut cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

async fn once<S, L, P, ReqB, ResB>(
    shared: Arc<Shared<L, P>>,
    inner: S,
    key: EffectKey,
    fingerprint: Fingerprint,
    request: Request<ReqB>,
) -> Result<Response<ResB>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    L: Ledger + 'static,
    P: PrincipalSource,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let cell: SideCell<ResB, S::Error> = Arc::new(Mutex::new(Side {
        first: None,
        released: None,
        error: None,
        rejection: None,
    }));
    let opts = shared.opts.clone().fingerprint(fingerprint);
    let run = {
        let (shared, cell) = (shared.clone(), cell.clone());
        move |_held| run_handler(shared, inner, request, cell)
    };
    let result = shared.effects.run(&key, &opts, run).await;
    let mut side = cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match result {
        Ok(stored) => Ok(match side.first.take() {
            Some(first) => first.map(ResB::from),
            None => stored.replay().map(ResB::from),
        }),
        Err(Error::FingerprintMismatch { .. }) => Ok(shared.reject(&Rejection::KeyReused)),
        Err(Error::InProgress { .. }) => Ok(shared.reject(&Rejection::InFlight)),
        Err(Error::Erased { .. }) => Ok(shared.reject(&Rejection::Erased)),
        // The handler ran and answered; only its record is missing. The
        // caller gets the answer (a 503 would make it retry, and a retry
        // after the lease ends runs the handler again).
        Err(e @ Error::OutcomeUnknown { .. }) if side.first.is_some() => {
            tracing::warn!(effect_key = %key, error = %e,
                "the handler's response was not stored; a retry after the lease ends runs it again");
            Ok(side
                .first
                .take()
                .map(|first| first.map(ResB::from))
                .expect("checked"))
        }
        Err(e) => {
            if let Some(response) = side.released.take() {
                return Ok(response);
            }
            if let Some(error) = side.error.take() {
                return Err(error);
            }
            if let Some(rejection) = side.rejection.take() {
                return Ok(shared.reject(&rejection));
            }
            tracing::warn!(effect_key = %key, error = %e, "idempotency ledger failed");
            Ok(shared.reject(&Rejection::LedgerUnavailable))
        }
    }
}

/// Runs the handler for the caller that acquired the key and decides what
/// the key stores: `Ok` is stored and replayed, `Err` releases the key.
async fn run_handler<S, L, P, ReqB, ResB>(
    shared: Arc<Shared<L, P>>,
    mut inner: S,
    request: Request<ReqB>,
    cell: SideCell<ResB, S::Error>,
) -> Result<StoredResponse, Failure>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    let config = &shared.config;
    let called = match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request))) {
        Ok(future) => CatchUnwind(Box::pin(future)).await,
        Err(panic) => Err(panic),
    };
    let response = match called {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            side(&cell, |s| s.error = Some(error));
            return Err(Failure::retryable("the inner service failed"));
        }
        Err(_panic) => return failed(&shared, &cell, Rejection::HandlerPanicked),
    };
    if response.status().is_server_error() && config.release_server_errors {
        side(&cell, |s| s.released = Some(response));
        return Err(Failure::retryable("server error (5xx) response"));
    }
    let (parts, body) = response.into_parts();
    let limit = config.max_response_bytes;
    let too_large = Rejection::ResponseTooLarge { limit };
    // The handler has run: whatever reading its body does (fail, panic) is
    // its result, decided like its own 5xx or panic, never a reason to run
    // it again under the same key.
    match CatchUnwind(Box::pin(stored::read_limited(body, limit))).await {
        Ok(Ok(bytes)) => {
            let stored = StoredResponse::redacted(
                parts.status,
                &parts.headers,
                &config.replay_headers,
                &bytes,
                &config.redact,
            );
            if stored.encoded_len() > shared.outcome_limit {
                return failed(&shared, &cell, too_large);
            }
            side(&cell, |s| s.first = Some(Response::from_parts(parts, bytes)));
            Ok(stored)
        }
        Ok(Err(ReadError::TooLarge)) => failed(&shared, &cell, too_large),
        Ok(Err(ReadError::Failed(e))) => {
            tracing::warn!(error = %e, "the handler's response body failed");
            failed(&shared, &cell, Rejection::ResponseBodyFailed)
        }
        Err(_panic) => failed(&shared, &cell, Rejection::HandlerPanicked),
    }
}

/// The handler ran but its answer cannot be kept as it is: the key is
/// released with `rejection`'s answer where the layer's release switch for
/// it says so, and stores that answer otherwise.
fn failed<L, P, B, E>(
    shared: &Shared<L, P>,
    cell: &SideCell<B, E>,
    rejection: Rejection,
) -> Result<StoredResponse, Failure> {
    let config = &shared.config;
    let release = match rejection {
        Rejection::HandlerPanicked => config.release_panics,
        // A body that fails stands for the 5xx it would have been.
        Rejection::ResponseBodyFailed => config.release_server_errors,
        // A response too large to store: the handler's work is kept, always.
        _ => false,
    };
    if !release {
        return Ok(own(shared, cell, &rejection));
    }
    side(cell, |s| s.rejection = Some(rejection.clone()));
    Err(Failure::retryable(rejection))
}

/// Stores the layer's own answer for the key (every header of it) and gives
/// it to this caller.
fn own<L, P, B, E>(shared: &Shared<L, P>, cell: &SideCell<B, E>, rejection: &Rejection) -> StoredResponse {
    let response = (shared.config.rejection)(rejection);
    let names: Vec<_> = response.headers().keys().cloned().collect();
    let stored = StoredResponse::new(response.status(), response.headers(), &names, response.body());
    side(cell, |s| s.first = Some(response));
    stored
}

/// A future whose panics become an `Err` (the handler's, or its response
/// body's while the layer reads it, so that its key is released or stores
/// the panic's answer instead of being held until the lease ends).
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
