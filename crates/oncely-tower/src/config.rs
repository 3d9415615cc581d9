//! [`KeyRequirement`] and the configuration an [`IdempotencyLayer`](crate::IdempotencyLayer)
//! builds and each [`Idempotency`](crate::Idempotency) service reads: its own
//! module, so that the layer (which writes it) and the service (which reads
//! it) do not import each other.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, Response, header};
use oncely::OnInProgress;

use crate::error::Rejection;
use crate::principal::FromExtensions;

/// Whether a request must, may or does not take part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyRequirement {
    /// A request without an `Idempotency-Key` is refused with 400.
    Required,
    /// A request with a key is made idempotent; one without passes through.
    Optional,
    /// The layer does nothing for this request, key or not.
    Ignored,
}

/// How the request body enters the fingerprint
/// ([`IdempotencyLayer::body_fingerprint`](crate::IdempotencyLayer::body_fingerprint)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BodyFingerprint {
    /// The body's exact bytes (the default): the same JSON with other
    /// whitespace or another key order is another request, and its key a
    /// 422 `key-reused`.
    #[default]
    Exact,
    /// A body that parses as JSON is fingerprinted in a canonical form:
    /// object keys sorted, no insignificant whitespace, strings and numbers
    /// as `serde_json` writes them (so `1.0` and `1` still differ, as do
    /// `"\u00e9"` and `"é"` only in their escapes: both parse to `é`). A body
    /// that is not JSON is fingerprinted by its exact bytes.
    CanonicalJson,
}

type RequirementFn = Arc<dyn Fn(&Parts) -> KeyRequirement + Send + Sync>;
type RejectionFn = Arc<dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync>;
/// A hook over the response as it will be stored
/// ([`IdempotencyLayer::redact`](crate::IdempotencyLayer::redact)).
pub(crate) type RedactFn = Arc<dyn Fn(&mut Response<Bytes>) + Send + Sync>;

/// What the layer was configured with, shared by every service it makes.
#[derive(Clone)]
pub(crate) struct Config<P> {
    pub(crate) principals: P,
    pub(crate) kind: String,
    pub(crate) requirement: RequirementFn,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) body_fingerprint: BodyFingerprint,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) on_in_flight: OnInProgress,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) release_server_errors: bool,
    pub(crate) release_panics: bool,
    pub(crate) accept_bare_key: bool,
    pub(crate) rejection: RejectionFn,
    /// Run in order over each handler response before it is stored.
    pub(crate) redact: Vec<RedactFn>,
}

impl Config<FromExtensions> {
    /// The defaults [`IdempotencyLayer::new`](crate::IdempotencyLayer::new)
    /// documents, principals read from the request extensions.
    pub(crate) fn new() -> Self {
        Config {
            principals: FromExtensions,
            kind: crate::DEFAULT_KIND.into(),
            requirement: Arc::new(|parts: &Parts| {
                if parts.method == Method::POST || parts.method == Method::PATCH {
                    KeyRequirement::Required
                } else {
                    KeyRequirement::Ignored
                }
            }),
            fingerprint_headers: vec![header::CONTENT_TYPE],
            body_fingerprint: BodyFingerprint::Exact,
            replay_headers: vec![
                header::CONTENT_TYPE,
                header::CONTENT_LANGUAGE,
                header::LOCATION,
                header::ETAG,
            ],
            max_request_bytes: 1024 * 1024,
            max_response_bytes: 32 * 1024,
            on_in_flight: OnInProgress::Reject,
            lease: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 3600),
            release_server_errors: true,
            release_panics: true,
            accept_bare_key: true,
            rejection: Arc::new(Rejection::problem),
            redact: Vec::new(),
        }
    }
}

impl<P> Config<P> {
    /// The same configuration with another source of principals.
    pub(crate) fn with_principals<Q>(self, principals: Q) -> Config<Q> {
        Config {
            principals,
            kind: self.kind,
            requirement: self.requirement,
            fingerprint_headers: self.fingerprint_headers,
            body_fingerprint: self.body_fingerprint,
            replay_headers: self.replay_headers,
            max_request_bytes: self.max_request_bytes,
            max_response_bytes: self.max_response_bytes,
            on_in_flight: self.on_in_flight,
            lease: self.lease,
            retention: self.retention,
            release_server_errors: self.release_server_errors,
            release_panics: self.release_panics,
            accept_bare_key: self.accept_bare_key,
            rejection: self.rejection,
            redact: self.redact,
        }
    }
}
