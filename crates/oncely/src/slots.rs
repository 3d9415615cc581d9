//! One failure answering every slot of a batch: a batch call (`claim_many`,
//! `complete_many`) whose round trip failed as a whole gives each of its
//! keys the same error.

use crate::error::{Error, Result};

/// A copy of `error`, for another slot of a batch that one failure answers
/// ([`Error`] is not `Clone`: [`Error::Handler`] carries a handler's boxed
/// error). Every variant is copied as it is, an [`Error::OutcomeUnknown`]'s
/// source too; a handler's error keeps its message (not its source chain).
pub fn copy_error(error: &Error) -> Error {
    match error {
        Error::InvalidKey { reason } => Error::InvalidKey {
            reason: reason.clone(),
        },
        Error::OutcomeTooLarge { size, max } => Error::OutcomeTooLarge {
            size: *size,
            max: *max,
        },
        Error::FingerprintMismatch { key } => Error::FingerprintMismatch { key: key.clone() },
        Error::LeaseLost { key, fence } => Error::LeaseLost {
            key: key.clone(),
            fence: *fence,
        },
        Error::InProgress { key, fence } => Error::InProgress {
            key: key.clone(),
            fence: *fence,
        },
        Error::BeyondHorizon { key } => Error::BeyondHorizon { key: key.clone() },
        Error::Abandoned { key } => Error::Abandoned { key: key.clone() },
        Error::Terminal { key, message } => Error::Terminal {
            key: key.clone(),
            message: message.clone(),
        },
        Error::Handler(e) => Error::Handler(e.to_string().into()),
        Error::ConstraintViolation { key, message } => Error::ConstraintViolation {
            key: key.clone(),
            message: message.clone(),
        },
        Error::NotFound { key } => Error::NotFound { key: key.clone() },
        Error::NotCompleted { key, state } => Error::NotCompleted {
            key: key.clone(),
            state: *state,
        },
        Error::InvalidInput(m) => Error::InvalidInput(m.clone()),
        Error::Serialization(m) => Error::Serialization(m.clone()),
        Error::Misuse(m) => Error::Misuse(m.clone()),
        Error::Config(m) => Error::Config(m.clone()),
        Error::OutcomeUnknown { key, fence, source } => Error::OutcomeUnknown {
            key: key.clone(),
            fence: *fence,
            source: Box::new(copy_error(source)),
        },
        Error::Unavailable { backend, message } => Error::Unavailable {
            backend,
            message: message.clone(),
        },
        Error::Corrupt { backend, message } => Error::Corrupt {
            backend,
            message: message.clone(),
        },
        Error::Backend {
            backend,
            message,
            retryable,
        } => Error::Backend {
            backend,
            message: message.clone(),
            retryable: *retryable,
        },
    }
}

/// `error` as the answer of each of `slots` slots of a batch: copies
/// ([`copy_error`]) first, the error itself in the last slot.
pub fn fail_each<T>(error: Error, slots: usize) -> Vec<Result<T>> {
    let mut answers: Vec<Result<T>> = (1..slots).map(|_| Err(copy_error(&error))).collect();
    if slots > 0 {
        answers.push(Err(error));
    }
    answers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_gets_the_same_error() {
        let answers: Vec<Result<()>> = fail_each(
            Error::Backend {
                backend: "test",
                message: "down".into(),
                retryable: true,
            },
            3,
        );
        assert_eq!(answers.len(), 3);
        for a in &answers {
            assert!(matches!(a, Err(Error::Backend { message, retryable: true, .. }) if message == "down"));
        }
        assert!(fail_each::<()>(Error::Config("x".into()), 0).is_empty());
    }

    #[test]
    fn a_copy_keeps_the_variant_and_its_source() {
        let e = Error::OutcomeUnknown {
            key: "k".into(),
            fence: 7,
            source: Box::new(Error::LeaseLost {
                key: "k".into(),
                fence: 7,
            }),
        };
        let copy = copy_error(&e);
        assert_eq!(copy.to_string(), e.to_string());
        assert!(matches!(copy, Error::OutcomeUnknown { fence: 7, source, .. } if source.is_lease_lost()));
        let handler = copy_error(&Error::Handler("boom".into()));
        assert!(matches!(handler, Error::Handler(_)));
        assert!(handler.is_retryable());
    }
}
