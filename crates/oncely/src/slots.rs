//! The slots of a batch (`claim_many`, `complete_many`): one failure
//! answering every slot (a round trip that failed as a whole gives each of
//! its keys the same error), and what a key or lease listed again answers.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::Hash;

use crate::error::{Error, Result};
use crate::record::{Claim, Lease};

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
        Error::Erased { key } => Error::Erased { key: key.clone() },
        Error::CodecKeyMissing { key, key_id } => Error::CodecKeyMissing {
            key: key.clone(),
            key_id: key_id.clone(),
        },
        Error::Codec { key, message } => Error::Codec {
            key: key.clone(),
            message: message.clone(),
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

/// For each slot of a batch, the earlier slot that lists the same item (a
/// key; a lease's key and fence), or `None` for its first listing. A
/// backend sends first listings only and answers the others from them
/// ([`repeated_claim`], [`repeated_completion`]).
pub fn earlier_listings<T: Eq + Hash>(items: impl IntoIterator<Item = T>) -> Vec<Option<usize>> {
    let mut first = HashMap::new();
    items
        .into_iter()
        .enumerate()
        .map(|(n, item)| match first.entry(item) {
            Entry::Occupied(f) => Some(*f.get()),
            Entry::Vacant(v) => {
                v.insert(n);
                None
            }
        })
        .collect()
}

/// What a key listed again in one `claim_many` answers, from its first
/// listing's answer: what the same claim made right after it would answer
/// (`Ledger::claim_many`'s rule, one for every backend). A grant to the
/// first listing is in progress at that fence; a record found (completed,
/// in progress, abandoned) is found again; a refusal (another payload,
/// beyond the horizon, a failed round trip) is the same refusal.
pub fn repeated_claim(first: &Result<Claim>) -> Result<Claim> {
    match first {
        Ok(Claim::Acquired(lease)) => Ok(Claim::InProgress {
            fence: lease.fence(),
            expires_at: lease.expires_at(),
            first_claimed_at: lease.first_claimed_at(),
            read_at: lease.acquired_at(),
        }),
        Ok(other) => Ok(other.clone()),
        Err(e) => Err(copy_error(e)),
    }
}

/// What a lease listed again (its key and fence) in one `complete_many`
/// answers, from its first listing's answer: what completing it again
/// right after would answer. Completed once, it is lost
/// ([`Error::LeaseLost`]); failed, the same failure.
pub fn repeated_completion(first: &Result<()>, lease: &Lease) -> Result<()> {
    match first {
        Ok(()) => Err(Error::LeaseLost {
            key: lease.key().to_string(),
            fence: lease.fence(),
        }),
        Err(e) => Err(copy_error(e)),
    }
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
    fn later_listings_point_at_the_first() {
        assert_eq!(
            earlier_listings(["a", "b", "a", "c", "b", "a"]),
            [None, None, Some(0), None, Some(1), Some(0)]
        );
        assert!(earlier_listings(Vec::<&str>::new()).is_empty());
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
