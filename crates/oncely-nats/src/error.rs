//! How NATS failures become [`oncely::Error`]s.
//!
//! - a connection that cannot be made: [`Error::Unavailable`];
//! - a JetStream request that fails or times out (no quorum, a leader being
//!   elected): [`Error::Backend`], retryable;
//! - a server without JetStream, a bucket the ledger cannot rely on, a write
//!   on a read-only ledger: [`Error::Config`], at once;
//! - a value that no oncely ledger wrote: [`Error::Corrupt`];
//! - a server clock outside 1970..9999: [`Error::Backend`], not retryable.
//!
//! NATS has no unique constraints, so [`oncely::backend::Ledger::unique_violation`]
//! keeps its default (`None`).

use std::time::SystemTime;

use oncely::Error;

/// The backend's name in errors, telemetry and [`oncely::backend::Ledger::backend`].
pub(crate) const BACKEND: &str = "nats";

/// A failed JetStream request: retryable, since a cluster losing and
/// regaining a quorum answers again after an election.
pub(crate) fn backend_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("{what}: {e}"),
        retryable: true,
    }
}

/// How often one operation re-reads and retries after losing a race on the
/// same key before it gives up with a retryable error ([`gave_up`]).
pub(crate) const MAX_ATTEMPTS: usize = 64;

/// An operation that lost [`MAX_ATTEMPTS`] races in a row on one key:
/// retryable (the contention passes), but not worth spinning on forever.
pub(crate) fn gave_up(what: &str, subject: impl std::fmt::Display, lost: &str) -> Error {
    backend_err(what, format!("{subject}: gave up after {MAX_ATTEMPTS} {lost}"))
}

/// A connection that could not be made.
pub(crate) fn unavailable(e: impl std::fmt::Display) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        message: e.to_string(),
    }
}

/// A value in the bucket that no oncely ledger wrote (or a later version
/// wrote): reported, never overwritten.
pub(crate) fn corrupt(message: String) -> Error {
    Error::Corrupt {
        backend: BACKEND,
        message,
    }
}

/// A time read from the server that records cannot hold: the server's clock
/// is wrong (before 1970 or after 9999), not the caller's input.
pub(crate) fn clock_out_of_range(t: SystemTime) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("the NATS server's clock reads {t:?}, outside 1970..9999"),
        retryable: false,
    }
}

/// A write asked of a ledger opened read-only
/// ([`NatsKvLedgerOptions::read_only`](crate::NatsKvLedgerOptions::read_only)), refused
/// before any round trip.
pub(crate) fn read_only(what: &str, bucket: &str) -> Error {
    Error::Config(format!(
        "{what}: the NATS ledger on bucket {bucket} was opened read-only \
         (NatsKvLedgerOptions::read_only): it does not write"
    ))
}

/// Whether a request failed because nothing listens on its subject (a
/// server without JetStream, for a JetStream API request).
pub(crate) fn no_responders(e: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::jetstream::context::{RequestError, RequestErrorKind};
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<RequestError>())
        .is_some_and(|r| r.kind() == RequestErrorKind::NoResponders)
}
