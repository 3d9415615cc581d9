//! The one error type of the core API.

use std::borrow::Cow;

/// A boxed error from a handler or a driver.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in oncely.
///
/// A unique-constraint conflict on a claim is never an error: it is the answer
/// ([`Claim::Completed`](crate::record::Claim::Completed) or
/// [`Claim::InProgress`](crate::record::Claim::InProgress)). No driver error type
/// appears here; backends map theirs to [`Error::Backend`] or
/// [`Error::Unavailable`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key (or tenant) failed validation; nothing was sent to the database.
    #[error("invalid effect key: {reason}")]
    InvalidKey {
        /// What is wrong with it.
        reason: Cow<'static, str>,
    },
    /// An outcome larger than the limit; nothing was stored.
    #[error("outcome is {size} bytes, the limit is {max}")]
    OutcomeTooLarge {
        /// The outcome's size in bytes.
        size: usize,
        /// The limit that applies (the core's or the backend's).
        max: usize,
    },
    /// The key exists with another request fingerprint: the same key was
    /// reused for a different payload. The record was not changed.
    #[error("{key}: the key was first claimed with a different request payload")]
    FingerprintMismatch {
        /// The displayed effect key.
        key: String,
    },
    /// The lease's fence is stale: another claimant took the key over (or the
    /// record is no longer in progress). Nothing was written.
    #[error("{key}: lease with fence {fence} is no longer held")]
    LeaseLost {
        /// The displayed effect key.
        key: String,
        /// The fence the caller held.
        fence: u64,
    },
    /// Another claimant holds a live lease on the key, and the policy said not
    /// to wait (or the wait ran out).
    #[error("{key}: in progress elsewhere (fence {fence})")]
    InProgress {
        /// The displayed effect key.
        key: String,
        /// The fence of the current holder.
        fence: u64,
    },
    /// The message is older than the ledger's horizon: its record may have been
    /// pruned, so the ledger cannot tell a duplicate from new work and refuses
    /// to run it.
    #[error("{key}: message is older than the ledger can vouch for (retention horizon)")]
    BeyondHorizon {
        /// The displayed effect key.
        key: String,
    },
    /// An at-most-once step was attempted and never completed: it is not run
    /// again automatically and waits for reconciliation.
    #[error("{key}: at-most-once step was attempted and not completed; reconcile it")]
    Abandoned {
        /// The displayed effect key.
        key: String,
    },
    /// The handler failed terminally; the failure is the stored outcome and
    /// every duplicate gets it back.
    #[error("{key}: failed terminally: {message}")]
    Terminal {
        /// The displayed effect key.
        key: String,
        /// The handler's message, as stored.
        message: String,
    },
    /// The handler failed with a retryable error; the claim was released so
    /// the next delivery runs it again.
    #[error("handler failed (retryable): {0}")]
    Handler(#[source] BoxError),
    /// The handler's own write hit a unique constraint that is not the effect
    /// key: a bug in the guard or the data, never a duplicate (the claim
    /// answers duplicates itself). Not retryable: redelivering would hit it
    /// again. Counted in `oncely_unexpected_constraint_violations_total`.
    #[error("{key}: unexpected unique-constraint violation in the handler: {message}")]
    ConstraintViolation {
        /// The displayed effect key.
        key: String,
        /// The driver's message.
        message: String,
    },
    /// An operator command named a key that has no record
    /// ([`Admin::forget`](crate::admin::Admin::forget)). Nothing was written.
    #[error("{key}: no record")]
    NotFound {
        /// The displayed effect key.
        key: String,
    },
    /// An operator command needs a completed record and found another state
    /// ([`Admin::forget`](crate::admin::Admin::forget)). Nothing was written.
    #[error("{key}: the record is {}, not completed", state.as_str())]
    NotCompleted {
        /// The displayed effect key.
        key: String,
        /// The state found.
        state: crate::state::RecordState,
    },
    /// The effect completed, and an operator erased its stored outcome and
    /// request fingerprint on a data-protection request
    /// ([`Admin::erase`](crate::admin::Admin::erase)). The record is kept so
    /// that the effect is never run again: a duplicate gets this error, never
    /// a re-run and never the erased value. Not retryable; a consumer acks it.
    #[error("{key}: the effect completed and its stored outcome was erased; it is not run again")]
    Erased {
        /// The displayed effect key.
        key: String,
    },
    /// A stored outcome is sealed with a key the
    /// [`OutcomeCodec`](crate::codec::OutcomeCodec)
    /// does not hold (rotated out, or never given to this process). Nothing
    /// was decrypted and nothing was written; give the codec that key (as a
    /// decrypt-only key) to read it.
    #[error("{key}: the stored outcome is sealed with key id {key_id:?}, which this codec does not hold")]
    CodecKeyMissing {
        /// The displayed effect key.
        key: String,
        /// The key id written in the stored envelope.
        key_id: String,
    },
    /// A stored outcome could not be opened or sealed by the
    /// [`OutcomeCodec`](crate::codec::OutcomeCodec): it fails authentication
    /// (a wrong key under a known id, a tampered or moved value), or is not an
    /// envelope this codec reads.
    #[error("{key}: outcome codec: {message}")]
    Codec {
        /// The displayed effect key.
        key: String,
        /// What failed.
        message: String,
    },
    /// A value that cannot be used (a claim option out of range, a timestamp
    /// outside what the ledger stores); nothing was sent to the database.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A value could not be serialized or deserialized.
    #[error("serialization: {0}")]
    Serialization(String),
    /// A step was used in a way that contradicts its earlier use (another mode
    /// for the same kind in one job, an options conflict).
    #[error("misuse: {0}")]
    Misuse(String),
    /// A configuration or URL that cannot be used.
    #[error("configuration: {0}")]
    Config(String),
    /// The handler ran, so its effect may have happened, but its completion
    /// could not be recorded: the backend failed or could not be reached
    /// while completing, or a connection died during the completion's
    /// commit. Unlike [`Error::Unavailable`], this is not "nothing ran".
    /// Retryable: the next delivery replays the outcome if the completion
    /// landed after all, or, once the lease ends, takes the effect over at a
    /// higher fence and runs it again. That repeat is why effects carry a
    /// provider key ([`EffectKey::provider_key`](crate::EffectKey::provider_key))
    /// and fenced writes: they make it harmless. An at-most-once step is
    /// abandoned instead, and reconciled.
    #[error("{key}: the effect ran (fence {fence}) but its completion was not recorded: {source}")]
    OutcomeUnknown {
        /// The displayed effect key.
        key: String,
        /// The fence the handler ran under.
        fence: u64,
        /// Why the completion failed.
        #[source]
        source: Box<Error>,
    },
    /// The backend cannot be reached. No effect ran (fail closed): where a
    /// handler had run, the runners answer [`Error::OutcomeUnknown`].
    #[error("{backend} unavailable: {message}")]
    Unavailable {
        /// Which backend.
        backend: &'static str,
        /// The driver's message.
        message: String,
    },
    /// The backend found something it did not write: a foreign value at an
    /// oncely key, an unexpected constraint violation, an incompatible bucket.
    /// Nothing was overwritten.
    #[error("{backend}: {message}")]
    Corrupt {
        /// Which backend.
        backend: &'static str,
        /// What was found.
        message: String,
    },
    /// Any other backend failure.
    #[error("{backend}: {message}")]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// The driver's message.
        message: String,
        /// Whether another attempt may succeed (deadlock, serialization
        /// failure, timeout).
        retryable: bool,
    },
}

impl Error {
    /// An [`Error::InvalidKey`].
    pub fn invalid_key(reason: impl Into<Cow<'static, str>>) -> Self {
        Error::InvalidKey {
            reason: reason.into(),
        }
    }

    /// Whether the same operation may succeed if the delivery is retried later.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::InProgress { .. }
            | Error::Unavailable { .. }
            | Error::Handler(_)
            | Error::OutcomeUnknown { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// Whether this is [`Error::LeaseLost`].
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Error::LeaseLost { .. })
    }

    /// Whether this is [`Error::OutcomeUnknown`]: the handler ran, and its
    /// completion may or may not have been recorded.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, Error::OutcomeUnknown { .. })
    }

    /// Whether this is [`Error::InProgress`].
    pub fn is_in_progress(&self) -> bool {
        matches!(self, Error::InProgress { .. })
    }

    /// Whether the input was refused before any round trip.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidKey { .. }
                | Error::InvalidInput(_)
                | Error::OutcomeTooLarge { .. }
                | Error::Misuse(_)
        )
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::Serialization(e.to_string())
    }
}
