//! Maps sqlx errors onto `oncely::Error`; no driver type leaves the crate.

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

/// Maps a driver error. A unique violation here is never the effect key (the
/// claim statement answers that conflict itself), so it is reported as a bug
/// and never mistaken for a duplicate.
pub(crate) fn map(e: sqlx::Error) -> Error {
    match e {
        sqlx::Error::Database(db) => {
            let message = db.message().to_owned();
            if db.kind() == ErrorKind::UniqueViolation {
                oncely::telemetry::unexpected_constraint_violation(BACKEND, &message);
                return Error::Corrupt {
                    backend: BACKEND,
                    message: format!("unexpected unique-constraint violation: {message}"),
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

pub(crate) fn corrupt(message: impl Into<String>) -> Error {
    Error::Corrupt {
        backend: BACKEND,
        message: message.into(),
    }
}
