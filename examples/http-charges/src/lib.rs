//! An HTTP API whose `POST /charges` is made safe to retry by the
//! `Idempotency-Key` layer: a client that times out and sends the request
//! again gets the first charge back instead of being charged twice.
//!
//! The caller is whoever its bearer token says (`Authorization: Bearer
//! alice`): a stand-in for real authentication, which would put the
//! principal in the request extensions. Charges live in memory; the ledger
//! (SQLite or PostgreSQL) holds the keys and the stored responses.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use oncely::Tenant;
use oncely::backend::Ledger;
use oncely_tower::{IdempotencyLayer, Principal};
use serde::{Deserialize, Serialize};

/// The body of `POST /charges`.
#[derive(Debug, Clone, Deserialize)]
pub struct NewCharge {
    /// Amount in the currency's smallest unit.
    pub amount: u64,
    /// ISO 4217 code.
    pub currency: String,
}

/// A charge, as created and returned.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Charge {
    /// `ch_<n>`.
    pub id: String,
    /// Amount in the currency's smallest unit.
    pub amount: u64,
    /// ISO 4217 code.
    pub currency: String,
    /// Who asked for it.
    pub customer: String,
}

/// The charges made so far (the non-idempotent effect the layer guards).
#[derive(Debug, Clone, Default)]
pub struct Charges {
    made: Arc<AtomicU64>,
}

impl Charges {
    /// How many charges the handler made.
    pub fn made(&self) -> u64 {
        self.made.load(Ordering::SeqCst)
    }
}

/// The caller named by `Authorization: Bearer <name>`.
pub fn bearer(parts: &http::request::Parts) -> Option<Principal> {
    let token = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let name = token.strip_prefix("Bearer ")?.trim();
    (!name.is_empty()).then(|| Principal::new(Tenant::global(), name))
}

async fn create(
    State(charges): State<Charges>,
    headers: axum::http::HeaderMap,
    Json(new): Json<NewCharge>,
) -> impl IntoResponse {
    let n = charges.made.fetch_add(1, Ordering::SeqCst) + 1;
    let customer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("anonymous")
        .to_owned();
    let charge = Charge {
        id: format!("ch_{n}"),
        amount: new.amount,
        currency: new.currency,
        customer,
    };
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/charges/{}", charge.id))],
        Json(charge),
    )
}

/// The API without the layer: `POST /charges`, `GET /health`.
pub fn api(charges: Charges) -> Router {
    Router::new()
        .route("/charges", post(create))
        .route("/health", get(|| async { "ok" }))
        .with_state(charges)
}

/// The API behind the `Idempotency-Key` layer on `ledger`: `POST` requires a
/// key, completed keys are replayed for 24 hours, a retry that arrives while
/// the first is running waits for it up to 10 s.
pub fn idempotent_api<L: Ledger + Clone + 'static>(ledger: L, charges: Charges) -> Router {
    api(charges).layer(IdempotencyLayer::new(ledger).principals(bearer).on_in_flight(
        oncely::OnInProgress::Wait {
            max: Duration::from_secs(10),
        },
    ))
}
