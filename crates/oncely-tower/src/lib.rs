//! # oncely-tower
//!
//! HTTP `Idempotency-Key` middleware for axum 0.8 and any tower 0.5 stack,
//! following draft-ietf-httpapi-idempotency-key-header, on any oncely
//! [`Ledger`](oncely::backend::Ledger) (SQLite, PostgreSQL, Redis, …).
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use axum::{Router, routing::post};
//! use oncely::Tenant;
//! use oncely_sqlite::SqliteLedger;
//! use oncely_tower::{IdempotencyLayer, Principal};
//!
//! async fn charge(body: String) -> String {
//!     format!("{{\"charged\": {body}}}") // runs once per Idempotency-Key
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let ledger = Arc::new(SqliteLedger::connect("sqlite:charges.db").await?);
//!     let app: Router = Router::new()
//!         .route("/charges", post(charge))
//!         // The principal is whatever your authentication says it is.
//!         .layer(IdempotencyLayer::new(ledger).principals(|req: &http::request::Parts| {
//!             let user = req.headers.get("x-user")?.to_str().ok()?;
//!             Some(Principal::new(Tenant::global(), user))
//!         }));
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(listener, app).await?;
//!     Ok(())
//! }
//! ```
//!
//! ## What it does with a request
//!
//! | request | answer |
//! | --- | --- |
//! | a method/route that does not take part ([`KeyRequirement::Ignored`]; by default all but `POST` and `PATCH`) | passed through untouched |
//! | no `Idempotency-Key` where it is [required](KeyRequirement::Required) | 400 `missing-key` |
//! | a header that is not a key (see below), or sent twice | 400 `invalid-key` |
//! | a key but no principal ([`PrincipalSource`] says `None`) | 401 `unauthenticated` |
//! | a body over [`max_request_bytes`](IdempotencyLayer::max_request_bytes) | 413 `request-too-large`, without reading past the limit |
//! | the first request with its key | the handler runs once; its response goes to the caller and (status, [replay headers](IdempotencyLayer::replay_headers), body) is stored |
//! | the same key, same request, after it completed | the stored response, with `Idempotent-Replayed: true` |
//! | the same key with another method, path + query, [fingerprinted header](IdempotencyLayer::fingerprint_headers) or body (its exact bytes unless [`BodyFingerprint::CanonicalJson`]) | 422 `key-reused`; nothing runs |
//! | the same key while the first is still running | 409 `in-flight` with `Retry-After: 1`, or a wait of up to a bound ([`on_in_flight`](IdempotencyLayer::on_in_flight)) |
//! | the ledger cannot be reached | 503 `ledger-unavailable` (fail closed: the handler does not run) |
//! | the handler ran, and the ledger failed to store its response ([`oncely::Error::OutcomeUnknown`]) | the handler's response, unstored: the key stays held until its lease ends, then a retry runs the handler again (send provider keys from it) |
//!
//! Error bodies are `application/problem+json` (RFC 9457,
//! [`Rejection::problem`]); [`IdempotencyLayer::rejection_response`] replaces them.
//! Every answer the layer gives itself carries
//! [`Idempotency-Rejection: <code>`](IDEMPOTENCY_REJECTION) (`key-reused`,
//! `in-flight`, …), so a client tells the layer's 422 from one the
//! application returned (a JSON extractor's rejection, say).
//!
//! **The fingerprint is exact bytes.** The body is compared byte for byte:
//! the same JSON with other whitespace or another key order is another
//! request, and reusing its key is a 422. A client that re-serialises its
//! body on a retry should send the same bytes; where it cannot, turn on
//! [`body_fingerprint(BodyFingerprint::CanonicalJson)`](IdempotencyLayer::body_fingerprint),
//! which compares a JSON body by its parsed value.
//!
//! **The key.** The header is a structured-field string, as the draft
//! specifies: `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`
//! (printable ASCII, 1 to 255 bytes; parameters after it are ignored). A bare
//! token (`Idempotency-Key: 8e03978e-…`, what many clients send) **is
//! accepted** by default as the same key as its quoted form; turn that off
//! with [`accept_bare_key(false)`](IdempotencyLayer::accept_bare_key).
//!
//! **Principal binding.** The effect key is
//! [`EffectKey::for_client`](oncely::EffectKey::for_client)`(principal's
//! tenant, principal's id, kind, client key)`: another principal's identical
//! key is a different effect, which can neither replay nor block this one.
//! The application says who the principal is ([`PrincipalSource`]: a
//! closure, or [`FromExtensions`] for a [`Principal`] its authentication
//! middleware put in the request extensions). The principal's id is held to
//! the rules of an effect key's text (no invisible or blank characters,
//! Unicode NFC): an id that breaks them gets 400 `invalid-key`.
//!
//! ## What is stored, and for how long
//!
//! - **The response, never the request body.** The request body is read (up
//!   to [`max_request_bytes`](IdempotencyLayer::max_request_bytes)) only to
//!   be fingerprinted; a BLAKE3 hash is all the ledger keeps of it.
//! - **Only the [replay headers](IdempotencyLayer::replay_headers)** of the
//!   response (`content-type`, `content-language`, `location`, `etag` by
//!   default): `set-cookie`, `authorization` and every other header reach
//!   the first caller only.
//! - **Minus what you redact.** [`redact`](IdempotencyLayer::redact) hooks
//!   see the response as it would be stored and drop headers or rewrite the
//!   body; [`redact_json`](IdempotencyLayer::redact_json) removes JSON
//!   members by pointer (`/card/number`). The first caller gets the whole
//!   response, retries get the redacted one.
//! - **Encrypted, if you say so.** Give the layer a ledger wrapped in
//!   [`oncely::codec::Sealed`] with a [`Keyring`](oncely::codec::Keyring):
//!   the stored response is sealed (XChaCha20-Poly1305, bound to its
//!   effect key) and opened for a replay; a dump of the ledger shows
//!   `encrypted (key k1, …)` and no byte of it. The layer's response limit
//!   shrinks by the envelope's few dozen bytes on its own.
//!   `IdempotencyLayer::new(Arc::new(Sealed::new(ledger, keyring)))`.
//! - **Up to [`max_response_bytes`](IdempotencyLayer::max_response_bytes)**
//!   (32 KiB by default, and within the ledger's outcome limit). A bigger
//!   response is not read whole and not sent: the handler did run, so the
//!   caller and every retry get the application's answer for
//!   [`Rejection::ResponseTooLarge`] (by default a 500 problem), which the
//!   key stores. Endpoints with big responses should answer with a
//!   reference (`201` + `Location`) instead.
//! - **5xx responses and panics release the key** by default
//!   ([`release_server_errors`](IdempotencyLayer::release_server_errors),
//!   [`release_panics`](IdempotencyLayer::release_panics)): the caller gets
//!   the 5xx (or a 500 problem for a panic), nothing is stored, and a retry
//!   with the same key runs the handler again. With either switch off, that
//!   answer is what the key stores, and retries get it back.
//! - **Once the handler has returned, its response body is part of its
//!   result.** A body that fails while the layer reads it counts as a 5xx (a
//!   502 [`Rejection::ResponseBodyFailed`] problem, released or stored as
//!   `release_server_errors` says); a body that panics is caught as a
//!   handler panic is (a 500, released or stored as `release_panics` says).
//!   Neither kills the request's task or leaves the key held.
//! - **A released key stays bound to its first request's fingerprint.** The
//!   retry after a 5xx must be the same request; the same key with another
//!   body is still a 422. A key names one operation for its whole retention,
//!   whether or not that operation succeeded the first time; this also
//!   stops a client from turning a failed attempt into a different request
//!   under a key whose first attempt may have had side effects.
//! - **Retention (the key's expiry, as the draft asks servers to publish):**
//!   a completed key is replayed for 24 hours after its completion by
//!   default ([`retention`](IdempotencyLayer::retention)); a released key is
//!   kept as long. After that, once the ledger's `prune` has run, the same
//!   key is a new request. Publish the value you choose in your API docs.
//! - A request holds its key under a lease (60 s, renewed while the handler
//!   runs). The handler runs in a task of its own, so a client that hangs up
//!   does not cancel it midway: its response is stored for the retry. Only a
//!   server that dies mid-request leaves the key held, until the lease ends.
//!
//! A streaming request or response body is read frame by frame and never
//! buffered past its limit. The layer needs a tokio runtime.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod config;
mod error;
mod future;
mod header;
mod layer;
mod principal;
mod service;
mod stored;

pub use config::{BodyFingerprint, KeyRequirement};
pub use error::{PROBLEM_JSON, Rejection};
pub use future::ResponseFuture;
pub use header::{IDEMPOTENCY_KEY, IDEMPOTENCY_REJECTION, IDEMPOTENT_REPLAYED, MAX_CLIENT_KEY_BYTES};
pub use layer::IdempotencyLayer;
pub use principal::{FromExtensions, Principal, PrincipalSource};
pub use service::Idempotency;

/// The effect keys' kind unless [`IdempotencyLayer::kind`] says otherwise.
///
/// A request's record is `<principal's tenant>/http:<subject>`, the subject
/// being [`EffectKey::client_subject`](oncely::EffectKey::client_subject)`(principal's
/// id, client key)`: `oncely history --tenant T --principal P --client-key K`
/// (and `oncely inspect`, and `oncely serve`'s lookup) find it from what an
/// operator knows.
pub const DEFAULT_KIND: &str = "http";
