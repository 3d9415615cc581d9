//! [`IdempotencyLayer`]: the builder of the configuration (`config.rs`), and
//! the tower `Layer` that wraps a service in [`Idempotency`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, Response};
use oncely::backend::Ledger;
use oncely::{ClaimOptions, EffectKey, Effects, OnInProgress, Tenant};
use tower_layer::Layer;

use crate::config::{BodyFingerprint, Config, KeyRequirement};
use crate::error::Rejection;
use crate::principal::{FromExtensions, PrincipalSource};
use crate::service::{Idempotency, Shared};

/// The `Idempotency-Key` middleware as a tower [`Layer`]: wrap a service
/// (an axum `Router`, any tower 0.5 stack) with `.layer(IdempotencyLayer::new(ledger))`.
///
/// `L` is any oncely [`Ledger`] that is `Clone` (pass an `Arc<SqliteLedger>`
/// or `Arc<PgLedger>`); `P` finds the request's [`Principal`](crate::Principal)
/// (by default [`FromExtensions`]).
///
/// Defaults, each changed by the method of the same name:
///
/// | setting | default |
/// | --- | --- |
/// | [`requirement`](Self::requirement) | `POST` and `PATCH` require a key, other methods are ignored |
/// | [`kind`](Self::kind) | `http` (the effect key's kind) |
/// | [`fingerprint_headers`](Self::fingerprint_headers) | `content-type` (with method, path + query, body) |
/// | [`body_fingerprint`](Self::body_fingerprint) | [`BodyFingerprint::Exact`]: the body's exact bytes |
/// | [`replay_headers`](Self::replay_headers) | `content-type`, `content-language`, `location`, `etag` |
/// | [`max_request_bytes`](Self::max_request_bytes) | 1 MiB (413 beyond) |
/// | [`max_response_bytes`](Self::max_response_bytes) | 32 KiB (and what the ledger stores) |
/// | [`on_in_flight`](Self::on_in_flight) | `Reject` (409 at once) |
/// | [`lease`](Self::lease) | 60 s, renewed while the handler runs |
/// | [`retention`](Self::retention) | 24 hours |
/// | [`release_server_errors`](Self::release_server_errors) | `true` |
/// | [`release_panics`](Self::release_panics) | `true` |
/// | [`accept_bare_key`](Self::accept_bare_key) | `true` |
#[derive(Clone)]
pub struct IdempotencyLayer<L, P = FromExtensions> {
    ledger: L,
    config: Config<P>,
}

impl<L: Ledger + Clone + 'static> IdempotencyLayer<L, FromExtensions> {
    /// The layer over `ledger`, with the defaults above and principals read
    /// from the request extensions ([`FromExtensions`]).
    pub fn new(ledger: L) -> Self {
        IdempotencyLayer {
            ledger,
            config: Config::new(),
        }
    }
}

impl<L: Ledger + Clone + 'static, P: PrincipalSource> IdempotencyLayer<L, P> {
    /// Where principals come from: an implementation of [`PrincipalSource`]
    /// or a closure `Fn(&http::request::Parts) -> Option<Principal>`.
    pub fn principals<Q: PrincipalSource>(self, principals: Q) -> IdempotencyLayer<L, Q> {
        IdempotencyLayer {
            ledger: self.ledger,
            config: self.config.with_principals(principals),
        }
    }

    /// Which requests take part, decided from the method, path, headers.
    pub fn requirement(mut self, f: impl Fn(&Parts) -> KeyRequirement + Send + Sync + 'static) -> Self {
        self.config.requirement = Arc::new(f);
        self
    }

    /// The methods that require a key; every other method is ignored.
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods: Vec<Method> = methods.into_iter().collect();
        self.requirement(move |parts| {
            if methods.contains(&parts.method) {
                KeyRequirement::Required
            } else {
                KeyRequirement::Ignored
            }
        })
    }

    /// The kind of the effect keys (`EffectKey::for_client(tenant, principal,
    /// kind, client_key)`). Two layers with different kinds keep separate
    /// keys; give each API its own if their clients may reuse keys. An
    /// operator then names it to find a request's record
    /// (`oncely inspect --tenant T --kind K --principal P --client-key KEY`).
    ///
    /// # Panics
    /// If `kind` is not a valid effect-key kind (empty, `:`, `/`, whitespace).
    pub fn kind(mut self, kind: impl Into<String>) -> Self {
        let kind = kind.into();
        if let Err(e) = EffectKey::new(&Tenant::global(), &kind, "x") {
            panic!("IdempotencyLayer::kind: {e}");
        }
        self.config.kind = kind;
        self
    }

    /// The request headers that are part of the fingerprint, besides the
    /// method, the path and query, and the body.
    pub fn fingerprint_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// How the body enters the fingerprint: its exact bytes
    /// ([`BodyFingerprint::Exact`], the default), or, for a JSON body, its
    /// canonical form ([`BodyFingerprint::CanonicalJson`]: a client that
    /// re-serialises the same JSON with other whitespace or key order on a
    /// retry sends the same request). Changing it changes the fingerprint
    /// of keys already stored: a retry across the change may get a 422.
    pub fn body_fingerprint(mut self, how: BodyFingerprint) -> Self {
        self.config.body_fingerprint = how;
        self
    }

    /// The response headers stored and replayed (with the status and body).
    /// Others (`set-cookie`, `date`) reach the first caller only.
    pub fn replay_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.replay_headers = headers.into_iter().collect();
        self
    }

    /// The largest request body accepted with a key (it is read to be
    /// fingerprinted, never stored): a larger one is refused with 413
    /// before reading past the limit (at once when its `Content-Length`
    /// says so).
    pub fn max_request_bytes(mut self, n: usize) -> Self {
        self.config.max_request_bytes = n;
        self
    }

    /// The largest response body stored. A larger response is not sent: the
    /// caller (and every retry with the key) gets
    /// [`Rejection::ResponseTooLarge`]'s response instead, because the
    /// handler did run and must not run again. The ledger's own outcome
    /// limit applies too (base64 makes a body a third bigger).
    pub fn max_response_bytes(mut self, n: usize) -> Self {
        self.config.max_response_bytes = n;
        self
    }

    /// What a request does when the first one with its key is still running:
    /// [`OnInProgress::Reject`] answers 409 at once;
    /// [`OnInProgress::Wait`] waits up to `max` for the first to finish
    /// (then answers with its replay, or runs if the first released the key)
    /// and answers 409 when the wait runs out.
    pub fn on_in_flight(mut self, policy: OnInProgress) -> Self {
        self.config.on_in_flight = policy;
        self
    }

    /// How long a request holds its key before another may take it over
    /// (renewed every third of it while the handler runs, so only a crashed
    /// server lets it run out).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// How long a completed key is kept and replayed (what the draft calls
    /// the key's expiry, to be published to clients). After it, and after
    /// the ledger's `prune`, the same key runs again as a new request.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention;
        self
    }

    /// Whether a 5xx response gives the key back (`true`: it reaches the
    /// caller and is not stored, so a retry with the key runs again) or is
    /// stored and replayed like any other.
    ///
    /// A response body that fails while the layer reads it counts as a 5xx:
    /// the handler ran, so with `false` the key stores
    /// [`Rejection::ResponseBodyFailed`]'s answer (by default a 502 problem)
    /// and a retry gets it back instead of running the handler again.
    pub fn release_server_errors(mut self, yes: bool) -> Self {
        self.config.release_server_errors = yes;
        self
    }

    /// Whether a handler panic gives the key back (`true`) or stores
    /// [`Rejection::HandlerPanicked`]'s response for the key. A panic of its
    /// response body while the layer reads it is the handler's panic: caught
    /// the same way, and released or stored by the same switch.
    pub fn release_panics(mut self, yes: bool) -> Self {
        self.config.release_panics = yes;
        self
    }

    /// Whether an unquoted key (`Idempotency-Key: 8e03…`) is accepted as the
    /// same key as its quoted form; `false` accepts only sf-strings, as the
    /// draft specifies.
    pub fn accept_bare_key(mut self, yes: bool) -> Self {
        self.config.accept_bare_key = yes;
        self
    }

    /// A hook that removes what must not be stored from a handler's
    /// response before it is stored: it gets the response as it would be
    /// stored (the status, the [replay headers](Self::replay_headers) found,
    /// the body) and may drop headers or rewrite the body. The first caller
    /// gets the handler's response untouched; retries get the stored,
    /// redacted one, so drop only what a retry can do without (a card
    /// number, a one-time token). Hooks run in the order added; the layer's
    /// own answers (its problem responses) are not passed to them.
    ///
    /// Headers not listed in [`replay_headers`](Self::replay_headers) are
    /// never stored (`set-cookie`, `authorization` and every other header
    /// outside the default list): this hook is for what is listed, and for
    /// the body. For JSON members, [`redact_json`](Self::redact_json).
    /// To encrypt what is stored instead, give the layer a ledger wrapped in
    /// [`oncely::codec::Sealed`] (see the crate docs).
    pub fn redact(mut self, f: impl Fn(&mut Response<Bytes>) + Send + Sync + 'static) -> Self {
        self.config.redact.push(Arc::new(f));
        self
    }

    /// A [`redact`](Self::redact) hook removing the members that `pointers`
    /// name (JSON Pointers, RFC 6901: `/token`, `/card/number`) from a JSON
    /// response body before it is stored. A body that is not JSON is stored
    /// as it is; a changed body loses any `Content-Length` header.
    pub fn redact_json(self, pointers: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        self.redact(move |response| crate::stored::remove_json_members(response, &pointers))
    }

    /// The response for each [`Rejection`] (default:
    /// [`Rejection::problem`], `application/problem+json`).
    pub fn rejection_response(
        mut self,
        f: impl Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.config.rejection = Arc::new(f);
        self
    }

    fn claim_options(&self) -> ClaimOptions {
        let opts = ClaimOptions::for_http()
            .lease(self.config.lease)
            .retention(self.config.retention)
            .on_in_progress(self.config.on_in_flight)
            .cache_failures(true);
        if let Err(e) = opts.validate() {
            panic!("IdempotencyLayer: {e}");
        }
        opts
    }
}

impl<S, L: Ledger + Clone + 'static, P: PrincipalSource> Layer<S> for IdempotencyLayer<L, P> {
    type Service = Idempotency<S, L, P>;

    /// # Panics
    /// If the lease and retention are out of the ledger's range (a lease of
    /// 1 ms to a day, retention of at least the lease and at most ten years).
    fn layer(&self, inner: S) -> Self::Service {
        let outcome_limit = self.ledger.capabilities().max_outcome_bytes;
        Idempotency::new(
            inner,
            Arc::new(Shared {
                effects: Effects::new(self.ledger.clone()),
                opts: self.claim_options(),
                outcome_limit,
                config: self.config.clone(),
            }),
        )
    }
}

impl<L, P: std::fmt::Debug> std::fmt::Debug for IdempotencyLayer<L, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("principals", &self.config.principals)
            .field("kind", &self.config.kind)
            .field("max_request_bytes", &self.config.max_request_bytes)
            .field("max_response_bytes", &self.config.max_response_bytes)
            .field("on_in_flight", &self.config.on_in_flight)
            .field("retention", &self.config.retention)
            .field("redact_hooks", &self.config.redact.len())
            .finish_non_exhaustive()
    }
}
