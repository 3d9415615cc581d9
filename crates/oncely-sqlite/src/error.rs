//! Maps sqlx errors onto `oncely::Error`, and recognises unique violations
//! (the driver's, or this crate's mapping of one) for the runner.

use oncely::Error;
use sqlx::error::ErrorKind;

pub(crate) const BACKEND: &str = "sqlite";

// Primary SQLite result codes (the low byte of an extended code).
const SQLITE_PERM: i64 = 3;
const SQLITE_BUSY: i64 = 5;
const SQLITE_LOCKED: i64 = 6;
const SQLITE_READONLY: i64 = 8;
const SQLITE_IOERR: i64 = 10;
const SQLITE_CORRUPT: i64 = 11;
const SQLITE_FULL: i64 = 13;
const SQLITE_CANTOPEN: i64 = 14;
const SQLITE_AUTH: i64 = 23;
const SQLITE_NOTADB: i64 = 26;

// Extended result codes of a unique or primary-key constraint failure.
const SQLITE_CONSTRAINT_PRIMARYKEY: i64 = 1555;
const SQLITE_CONSTRAINT_UNIQUE: i64 = 2067;

/// How [`map`] starts the message of a unique violation, so that
/// [`unique_violation`] recognises one that a handler passed on as an
/// `oncely::Error` (from `map_error`) instead of the driver's error.
const UNIQUE_PREFIX: &str = "unexpected unique-constraint violation: ";

/// The message of a unique or primary-key violation, if `db` is one.
fn unique_message(db: &dyn sqlx::error::DatabaseError) -> Option<String> {
    let code = db.code().and_then(|c| c.parse::<i64>().ok());
    let unique = matches!(
        code,
        Some(SQLITE_CONSTRAINT_UNIQUE | SQLITE_CONSTRAINT_PRIMARYKEY)
    ) || db.kind() == ErrorKind::UniqueViolation;
    unique.then(|| db.message().to_owned())
}

/// Whether `error`, or any error in its source chain, is a SQLite unique or
/// primary-key violation: the driver's error (a handler's `?` on a sqlx
/// call), or this crate's mapping of one. Returns the driver's message.
pub(crate) fn unique_violation(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>()
            && let Some(message) = unique_message(db.as_ref())
        {
            return Some(message);
        }
        if let Some(Error::Corrupt {
            backend: BACKEND,
            message,
        }) = e.downcast_ref::<Error>()
            && let Some(message) = message.strip_prefix(UNIQUE_PREFIX)
        {
            return Some(message.to_owned());
        }
        next = e.source();
    }
    None
}

/// Maps a driver error of the ledger's own statements. A unique violation
/// here is never the effect key (the claim statement answers that conflict
/// itself), so it is reported (and counted) as a bug and never mistaken for
/// a duplicate.
pub(crate) fn map(e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e
        && let Some(message) = unique_message(db.as_ref())
    {
        oncely::backend::report_unexpected_violation(BACKEND, &message);
    }
    map_error(e)
}

/// Maps a sqlx error (from your own statements in a transaction from
/// [`SqliteLedger::begin`](crate::SqliteLedger::begin), or its commit) the
/// way the ledger maps its own: busy and locked are retryable, an unopenable
/// file is `Unavailable`, a unique violation is [`Error::Corrupt`] (returned
/// from a [`Job::step_in`](oncely::Job::step_in) closure, the runner still
/// recognises it as one; see
/// [`Ledger::unique_violation`](oncely::backend::Ledger::unique_violation)).
///
/// Unlike the ledger's own mapping it counts nothing: the runner counts a
/// unique violation if the handler returns it.
pub fn map_error(e: sqlx::Error) -> Error {
    match e {
        sqlx::Error::Database(db) => {
            let message = db.message().to_owned();
            if unique_message(db.as_ref()).is_some() {
                return Error::Corrupt {
                    backend: BACKEND,
                    message: format!("{UNIQUE_PREFIX}{message}"),
                };
            }
            let code = db.code().and_then(|c| c.parse::<i64>().ok()).unwrap_or(0);
            match code & 0xff {
                SQLITE_BUSY | SQLITE_LOCKED => Error::Backend {
                    backend: BACKEND,
                    message: format!("database is busy: {message}"),
                    retryable: true,
                },
                SQLITE_CANTOPEN | SQLITE_PERM | SQLITE_AUTH | SQLITE_READONLY => Error::Unavailable {
                    backend: BACKEND,
                    message,
                },
                SQLITE_CORRUPT | SQLITE_NOTADB => Error::Corrupt {
                    backend: BACKEND,
                    message,
                },
                SQLITE_IOERR | SQLITE_FULL => Error::Backend {
                    backend: BACKEND,
                    message,
                    retryable: true,
                },
                _ => Error::Backend {
                    backend: BACKEND,
                    message,
                    retryable: false,
                },
            }
        }
        sqlx::Error::Io(io) => Error::Unavailable {
            backend: BACKEND,
            message: io.to_string(),
        },
        e @ (sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed) => Error::Unavailable {
            backend: BACKEND,
            message: e.to_string(),
        },
        e @ sqlx::Error::PoolTimedOut => Error::Backend {
            backend: BACKEND,
            message: e.to_string(),
            retryable: true,
        },
        e @ (sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_)
        | sqlx::Error::ColumnIndexOutOfBounds { .. }) => Error::Corrupt {
            backend: BACKEND,
            message: e.to_string(),
        },
        e @ sqlx::Error::Configuration(_) => Error::Config(e.to_string()),
        e => Error::Backend {
            backend: BACKEND,
            message: e.to_string(),
            retryable: false,
        },
    }
}

/// Maps an error met while opening the database: nothing could be reached, so
/// every failure to get a first connection is `Unavailable` (fail closed).
pub(crate) fn map_connect(e: sqlx::Error) -> Error {
    match map(e) {
        Error::Backend { message, .. } => Error::Unavailable {
            backend: BACKEND,
            message,
        },
        other => other,
    }
}

/// [`Error::Corrupt`] from this backend: a row or a table the ledger cannot
/// trust.
pub(crate) fn corrupt(message: impl Into<String>) -> Error {
    Error::Corrupt {
        backend: BACKEND,
        message: message.into(),
    }
}
