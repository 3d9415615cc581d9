//! An apalis 1.x tower layer (feature `apalis`): makes a job handler
//! idempotent.
//!
//! [`IdempotentLayer`] derives an [`EffectKey`] from the job's arguments and
//! runs the inner service under [`Effects::run_reported`]: the first task
//! with that key runs the handler and stores its response; every later task
//! with the same key (a job pushed twice, a retry after the response was
//! stored, a task picked up again after a worker died) gets the stored
//! response back without running the handler. Errors map to apalis's retry
//! rules:
//!
//! | what happened | apalis sees |
//! | --- | --- |
//! | the handler failed | its error: apalis retries (the claim was released) |
//! | the effect is in progress on another worker, or the lease was lost | a failed attempt after `in_progress_delay`, which apalis retries |
//! | an at-most-once effect abandoned by a crashed worker | a failed attempt after `abandoned_delay`: held, retried until it is reconciled, then performed (not done) or replayed (done) |
//! | a key that cannot be derived, a stored terminal failure, any other oncely error | [`AbortError`]: never retried |
//!
//! A task answered by the layer without reaching the handler (a replay, an
//! abort, an in-progress retry) never reaches apalis's own lifecycle
//! service either, which sits inside user layers: the layer sets its status
//! itself (`Done`, `Killed`, `Failed`), but apalis does not count an
//! attempt for it, so a held task is retried for as long as it is held.
//!
//! The delay before such a retry is spent in the layer (the task keeps its
//! worker slot meanwhile), and the task then fails to be fetched again:
//! apalis 1.0 turns a `RetryAfterError` into the `Pending` status, and
//! apalis-sqlite 1.0 never fetches a `Pending` task that a worker has
//! locked, so a task answered that way would never run again.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use oncely::{ClaimOptions, EffectKey, Effects, MemoryLedger, Tenant};
//! # use oncely_consumer::apalis::IdempotentLayer;
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Capture { order_id: String, amount: i64 }
//!
//! let effects = Arc::new(Effects::new(Arc::new(MemoryLedger::new())));
//! let layer = IdempotentLayer::new(effects, |job: &Capture| {
//!     EffectKey::new(&Tenant::global(), "capture", &job.order_id)
//! });
//! // WorkerBuilder::new("payments").backend(storage).layer(layer).build(capture)
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use apalis_core::error::{AbortError, BoxDynError};
use apalis_core::task::Task;
use apalis_core::task::status::Status;
use futures_util::future::BoxFuture;
use oncely::backend::Ledger;
use oncely::{ClaimOptions, EffectKey, Effects, Error, Failure, OnInProgress};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower_layer::Layer;
use tower_service::Service;

pub use apalis_core;

/// The layer: wraps a job handler so that each effect key runs once.
pub struct IdempotentLayer<L, K> {
    effects: Arc<Effects<L>>,
    key: Arc<K>,
    opts: ClaimOptions,
    in_progress_delay: Duration,
    abandoned_delay: Duration,
}

impl<L, K> Clone for IdempotentLayer<L, K> {
    fn clone(&self) -> Self {
        IdempotentLayer {
            effects: self.effects.clone(),
            key: self.key.clone(),
            opts: self.opts.clone(),
            in_progress_delay: self.in_progress_delay,
            abandoned_delay: self.abandoned_delay,
        }
    }
}

impl<L, K> fmt::Debug for IdempotentLayer<L, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentLayer")
            .field("opts", &self.opts)
            .field("in_progress_delay", &self.in_progress_delay)
            .field("abandoned_delay", &self.abandoned_delay)
            .finish_non_exhaustive()
    }
}

impl<L, K> IdempotentLayer<L, K> {
    /// A layer over `effects` keying each job with `key(&args)`. The claim
    /// waits up to 1 s for a holder elsewhere (then the task is retried
    /// after `in_progress_delay`, 1 s).
    pub fn new(effects: Arc<Effects<L>>, key: K) -> Self {
        IdempotentLayer {
            effects,
            key: Arc::new(key),
            opts: ClaimOptions::default().on_in_progress(OnInProgress::Wait {
                max: Duration::from_secs(1),
            }),
            in_progress_delay: Duration::from_secs(1),
            abandoned_delay: Duration::from_secs(60),
        }
    }

    /// The claim options (lease, retention, in-progress wait, failure
    /// caching).
    pub fn options(mut self, opts: ClaimOptions) -> Self {
        self.opts = opts;
        self
    }

    /// How long apalis waits before retrying a task whose effect is in
    /// progress elsewhere.
    pub fn in_progress_delay(mut self, d: Duration) -> Self {
        self.in_progress_delay = d;
        self
    }

    /// How long apalis waits before retrying a task whose at-most-once
    /// effect is abandoned (default 60 s). The task is held, not killed,
    /// so that once reconciliation releases the effect (it did not happen)
    /// a retry performs it; one resolved as done is replayed.
    pub fn abandoned_delay(mut self, d: Duration) -> Self {
        self.abandoned_delay = d;
        self
    }
}

impl<S, L, K> Layer<S> for IdempotentLayer<L, K> {
    type Service = Idempotent<S, L, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotent {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`IdempotentLayer`] builds.
pub struct Idempotent<S, L, K> {
    inner: S,
    layer: IdempotentLayer<L, K>,
}

impl<S: Clone, L, K> Clone for Idempotent<S, L, K> {
    fn clone(&self) -> Self {
        Idempotent {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S, L, K> fmt::Debug for Idempotent<S, L, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

/// A handler failure, carried through oncely as a retryable failure and
/// handed back to apalis as it was.
#[derive(Debug)]
struct HandlerFailed(BoxDynError);

impl fmt::Display for HandlerFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for HandlerFailed {}

impl<S, L, K, Args> Service<Task<Args>> for Idempotent<S, L, K>
where
    S: Service<Task<Args>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Serialize + DeserializeOwned + Send + 'static,
    S::Error: Into<BoxDynError>,
    L: Ledger + 'static,
    K: Fn(&Args) -> Result<EffectKey, Error> + Send + Sync + 'static,
    Args: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxDynError;
    type Future = BoxFuture<'static, Result<S::Response, BoxDynError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, task: Task<Args>) -> Self::Future {
        let key = (self.layer.key)(&task.args);
        // The readied service handles this task; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        let status = task.raw_status().clone();
        Box::pin(async move {
            let called = AtomicBool::new(false);
            let result = async {
                let key = key.map_err(|e| Box::new(AbortError::new(e)) as BoxDynError)?;
                let ran = layer
                    .effects
                    .run_reported(&key, &layer.opts, |_lease| {
                        called.store(true, Ordering::Relaxed);
                        async move {
                            inner
                                .call(task)
                                .await
                                .map_err(|e| Failure::retryable(HandlerFailed(e.into())))
                        }
                    })
                    .await;
                settle(&key, ran, layer.in_progress_delay, layer.abandoned_delay)
            }
            .await;
            if let Err(held) = &result
                && let Some(held) = held.downcast_ref::<Held>()
            {
                tokio::time::sleep(held.delay).await;
            }
            if !called.load(Ordering::Relaxed) {
                // apalis records a task's status in a service inside this
                // layer; a task answered here never reaches it.
                status.store(match &result {
                    Ok(_) => Status::Done,
                    Err(e) if e.downcast_ref::<AbortError>().is_some() => Status::Killed,
                    Err(_) => Status::Failed,
                });
            }
            result
        })
    }
}

/// A task to retry after `delay` (spent in the layer, see the module docs).
#[derive(Debug, thiserror::Error)]
#[error("{error}; retried after {delay:?}")]
struct Held {
    error: Error,
    delay: Duration,
}

/// What a run's result is for apalis.
fn settle<T>(
    key: &EffectKey,
    ran: Result<oncely::Reported<T>, Error>,
    in_progress_delay: Duration,
    abandoned_delay: Duration,
) -> Result<T, BoxDynError> {
    match ran {
        Ok(ran) => {
            tracing::debug!(effect_key = %key, how = %ran.how, "apalis task settled");
            Ok(ran.value)
        }
        Err(Error::Handler(e)) => Err(match e.downcast::<HandlerFailed>() {
            Ok(failed) => failed.0,
            Err(other) => other,
        }),
        Err(e @ (Error::InProgress { .. } | Error::LeaseLost { .. })) => Err(Box::new(Held {
            error: e,
            delay: in_progress_delay,
        }) as BoxDynError),
        // Held, not killed: a killed task leaves no retry to perform an
        // effect that reconciliation finds not done.
        Err(e @ Error::Abandoned { .. }) => Err(Box::new(Held {
            error: e,
            delay: abandoned_delay,
        }) as BoxDynError),
        Err(e) if e.is_retryable() => Err(Box::new(e) as BoxDynError),
        Err(e) => Err(Box::new(AbortError::new(e)) as BoxDynError),
    }
}
