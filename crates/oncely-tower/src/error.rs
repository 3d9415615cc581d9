//! Why the layer answered a request itself, and the `application/problem+json`
//! body (RFC 9457) it answers with by default.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// The media type of every error body the layer writes by default.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Why the layer answered a request without (or instead of) the handler's
/// own response.
///
/// Each reason has a status ([`Rejection::status`]) and a default
/// `application/problem+json` body ([`Rejection::problem`]), whose `type` is
/// `tag:oncely.dev,2026:idempotency:<code>` ([`Rejection::code`]). An
/// application that wants other bodies gives the layer its own
/// [`IdempotencyLayer::rejection_response`](crate::IdempotencyLayer::rejection_response).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    MissingKey,
    /// 400: the `Idempotency-Key` header is not a valid key (not a
    /// structured-field string, empty, too long, sent twice).
    InvalidKey {
        /// What is wrong with it.
        reason: String,
    },
    /// 401: the request carries a key but no authenticated principal, so the
    /// key cannot be bound to anyone.
    Unauthenticated,
    /// 413: the request body is larger than the layer buffers to fingerprint
    /// it. It was refused without being read whole.
    RequestTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// 400: the request body could not be read.
    RequestBodyFailed,
    /// 422: the key was first used with a different request (method, path,
    /// fingerprinted headers or body). Nothing ran.
    KeyReused,
    /// 409: the first request with this key is still being processed.
    InFlight,
    /// The handler's response was larger than the layer stores (500 by
    /// default). The handler did run: this answer is what the key stores,
    /// and every retry gets it back instead of running the handler again.
    ResponseTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// 502: the handler ran, but its response body failed while the layer
    /// read it. This stands for the handler's 5xx: the key is released, or
    /// stores this answer with
    /// [`release_server_errors(false)`](crate::IdempotencyLayer::release_server_errors).
    ResponseBodyFailed,
    /// 500: the handler panicked, or its response body did while the layer
    /// read it. The key is released, or stores this answer with
    /// [`release_panics(false)`](crate::IdempotencyLayer::release_panics).
    HandlerPanicked,
    /// 503: the ledger could not be reached or refused the operation; the
    /// request may be retried with the same key.
    LedgerUnavailable,
    /// 410: the first request with this key ran, and its stored response
    /// was erased on a data-protection request
    /// ([`oncely::admin::Admin::erase`]): it cannot be returned, and the
    /// operation is not run again.
    Erased,
}

impl Rejection {
    /// The status the default response carries.
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::MissingKey | Rejection::InvalidKey { .. } | Rejection::RequestBodyFailed => {
                StatusCode::BAD_REQUEST
            }
            Rejection::Unauthenticated => StatusCode::UNAUTHORIZED,
            Rejection::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Rejection::InFlight => StatusCode::CONFLICT,
            Rejection::ResponseTooLarge { .. } | Rejection::HandlerPanicked => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Rejection::ResponseBodyFailed => StatusCode::BAD_GATEWAY,
            Rejection::LedgerUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Rejection::Erased => StatusCode::GONE,
        }
    }

    /// A short stable code, the last part of the problem `type`.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "missing-key",
            Rejection::InvalidKey { .. } => "invalid-key",
            Rejection::Unauthenticated => "unauthenticated",
            Rejection::RequestTooLarge { .. } => "request-too-large",
            Rejection::RequestBodyFailed => "request-body-failed",
            Rejection::KeyReused => "key-reused",
            Rejection::InFlight => "in-flight",
            Rejection::ResponseTooLarge { .. } => "response-too-large",
            Rejection::ResponseBodyFailed => "response-body-failed",
            Rejection::HandlerPanicked => "handler-panicked",
            Rejection::LedgerUnavailable => "ledger-unavailable",
            Rejection::Erased => "erased",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "Idempotency-Key is missing",
            Rejection::InvalidKey { .. } => "Idempotency-Key is not valid",
            Rejection::Unauthenticated => "An Idempotency-Key needs an authenticated caller",
            Rejection::RequestTooLarge { .. } => "Request body too large",
            Rejection::RequestBodyFailed => "Request body could not be read",
            Rejection::KeyReused => "Idempotency-Key is already used for a different request",
            Rejection::InFlight => "A request with this Idempotency-Key is being processed",
            Rejection::ResponseTooLarge { .. } => "Response too large to store",
            Rejection::ResponseBodyFailed => "Response body failed",
            Rejection::HandlerPanicked => "Internal error",
            Rejection::LedgerUnavailable => "Idempotency store unavailable",
            Rejection::Erased => "The stored response of this Idempotency-Key was erased",
        }
    }

    fn detail(&self) -> String {
        match self {
            Rejection::MissingKey => "This operation requires an Idempotency-Key header.".into(),
            Rejection::InvalidKey { reason } => reason.clone(),
            Rejection::Unauthenticated => "Authenticate to use an Idempotency-Key.".into(),
            Rejection::RequestTooLarge { limit } => format!("The request body exceeds {limit} bytes."),
            Rejection::RequestBodyFailed => "The request body ended with an error.".into(),
            Rejection::KeyReused => {
                "The key was first used with another method, path, headers or body (the body is \
                 compared byte for byte: the same JSON with other whitespace or key order differs); \
                 use a new key, or send the first request's exact bytes."
                    .into()
            }
            Rejection::InFlight => "Retry after the first request with this key has finished.".into(),
            Rejection::ResponseTooLarge { limit } => format!(
                "The operation ran, but its response exceeds {limit} bytes and was not kept; \
                 retrying with this key returns this answer."
            ),
            Rejection::ResponseBodyFailed => {
                "The operation ran, but its response body ended with an error.".into()
            }
            Rejection::HandlerPanicked => "The operation failed while it ran.".into(),
            Rejection::LedgerUnavailable => "Retry later with the same key.".into(),
            Rejection::Erased => "The operation ran once; its stored response was erased on a \
                                   data-protection request, so it cannot be returned, and the \
                                   operation is not run again."
                .into(),
        }
    }

    /// The default answer: [`Rejection::status`] and an
    /// `application/problem+json` body with `type`, `title`, `status` and
    /// `detail`; a 409 also carries `Retry-After: 1`.
    pub fn problem(&self) -> Response<Bytes> {
        let status = self.status();
        let body = serde_json::json!({
            "type": format!("tag:oncely.dev,2026:idempotency:{}", self.code()),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": self.detail(),
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if matches!(self, Rejection::InFlight) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.title(),
            self.status().as_u16(),
            self.detail()
        )
    }
}

impl std::error::Error for Rejection {}
