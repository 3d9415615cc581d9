//! The user's side: decode a payload, derive keys from it, run the effects.

use std::fmt;
use std::future::Future;

use oncely::{BoxError, How};
use serde::de::DeserializeOwned;

/// What a handler's message came with, for logs: never for keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context {
    /// The broker's id of the message (a re-published copy has another).
    pub broker_id: String,
    /// The broker's delivery count, where it gives one.
    pub delivery_count: Option<u32>,
}

impl Context {
    /// Whether the broker delivered this message before (a delivery count
    /// above 1): then it is probably a duplicate of an effect that
    /// completed, and [`ClaimOptions::redelivered`] lets a backend answer it
    /// from a plain read where that is cheaper (Redis). A broker that gives
    /// no count says `false`.
    ///
    /// [`ClaimOptions::redelivered`]: oncely::ClaimOptions::redelivered
    pub fn redelivered(&self) -> bool {
        self.delivery_count.is_some_and(|c| c > 1)
    }
}

/// A message handler made safe to run twice with oncely.
///
/// `decode` turns the payload into a message (a failure dead-letters it as
/// undecodable); `handle` derives every effect key from the message (never
/// from [`Context::broker_id`]) and runs its effects with
/// [`Effects::run_reported`](oncely::Effects::run_reported) or a
/// [`Job`](oncely::Job), and says [`How`] the answer came about: `Ran` when
/// an effect ran in this call, `Replayed` when everything had been done
/// before (a suppressed duplicate). Both ack.
///
/// ```
/// use oncely::{ClaimOptions, EffectKey, Effects, How, MemoryLedger, Tenant};
/// use oncely_consumer::{Context, Handler, HandlerError, json};
/// use serde::Deserialize;
/// use std::sync::Arc;
///
/// #[derive(Deserialize)]
/// struct Capture { order_id: Option<String>, amount: i64 }
///
/// struct Payments { effects: Effects<Arc<MemoryLedger>>, tenant: Tenant }
///
/// impl Handler for Payments {
///     type Message = Capture;
///
///     fn decode(&self, payload: &[u8]) -> Result<Capture, String> {
///         json(payload)
///     }
///
///     async fn handle(&self, msg: Capture, ctx: Context) -> Result<How, HandlerError> {
///         let order = msg.order_id.ok_or(HandlerError::missing_field("order_id"))?;
///         let key = EffectKey::new(&self.tenant, "capture", &order)?;
///         let opts = ClaimOptions::default().redelivered(ctx.redelivered());
///         let ran = self
///             .effects
///             .run_reported(&key, &opts, |lease| async move {
///                 // provider.capture(msg.amount, idempotency_key = lease.provider_key())
///                 Ok(format!("ch_{}_{}", msg.amount, lease.fence()))
///             })
///             .await?;
///         Ok(ran.how)
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// The decoded message.
    type Message: Send + 'static;

    /// Decodes a payload; `Err(reason)` dead-letters it as undecodable.
    /// [`json`] does it for serde types.
    fn decode(&self, payload: &[u8]) -> Result<Self::Message, String>;

    /// Runs the message's effects.
    fn handle(
        &self,
        message: Self::Message,
        ctx: Context,
    ) -> impl Future<Output = Result<How, HandlerError>> + Send;
}

/// Decodes a JSON payload (the reason names the serde error).
pub fn json<M: DeserializeOwned>(payload: &[u8]) -> Result<M, String> {
    serde_json::from_slice(payload).map_err(|e| format!("not a valid message: {e}"))
}

/// How a handler failed; the loop maps each to a broker action.
#[derive(Debug)]
#[non_exhaustive]
pub enum HandlerError {
    /// An oncely error: in progress elsewhere or a lost lease → redelivered
    /// after [`ConsumerOptions::in_progress_delay`](crate::ConsumerOptions::in_progress_delay);
    /// retryable → redelivered with backoff; an abandoned at-most-once step
    /// → held, redelivered after
    /// [`ConsumerOptions::abandoned_delay`](crate::ConsumerOptions::abandoned_delay)
    /// until the step is reconciled; anything else (a stored terminal
    /// failure, an invalid key, a fingerprint mismatch) → dead-lettered.
    Oncely(oncely::Error),
    /// The message lacks a field an effect key is derived from:
    /// dead-lettered.
    MissingField(String),
    /// The message can never be handled (a business rule): dead-lettered.
    Poison(String),
    /// A passing failure outside oncely: redelivered with backoff.
    Retry(BoxError),
}

impl HandlerError {
    /// [`HandlerError::MissingField`].
    pub fn missing_field(field: impl Into<String>) -> Self {
        HandlerError::MissingField(field.into())
    }

    /// [`HandlerError::Poison`].
    pub fn poison(reason: impl Into<String>) -> Self {
        HandlerError::Poison(reason.into())
    }

    /// [`HandlerError::Retry`].
    pub fn retry(e: impl Into<BoxError>) -> Self {
        HandlerError::Retry(e.into())
    }
}

impl From<oncely::Error> for HandlerError {
    fn from(e: oncely::Error) -> Self {
        HandlerError::Oncely(e)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Oncely(e) => write!(f, "{e}"),
            HandlerError::MissingField(field) => {
                write!(f, "payload is missing {field:?}, which an effect key needs")
            }
            HandlerError::Poison(reason) => write!(f, "poison message: {reason}"),
            HandlerError::Retry(e) => write!(f, "retryable: {e}"),
        }
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HandlerError::Oncely(e) => Some(e),
            HandlerError::Retry(e) => Some(&**e),
            _ => None,
        }
    }
}
