//! Driver errors to `oncely::Error`: no sqlx type crosses the public API;
//! and the errors this backend raises itself.

use oncely::Error;
use oncely::backend::Lease;
use sqlx::mysql::MySqlDatabaseError;

pub(crate) const BACKEND: &str = "mysql";

/// Server error numbers this crate decides on.
const ER_DUP_KEY: u16 = 1022;
const ER_DUP_ENTRY: u16 = 1062;
const ER_DUP_UNIQUE: u16 = 1169;
const ER_DUP_ENTRY_WITH_KEY_NAME: u16 = 1586;
const ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION: u16 = 1792;
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
const ER_LOCK_DEADLOCK: u16 = 1213;
const ER_CON_COUNT_ERROR: u16 = 1040;
const ER_DBACCESS_DENIED: u16 = 1044;
const ER_ACCESS_DENIED: u16 = 1045;
const ER_BAD_DB: u16 = 1049;
const ER_SERVER_SHUTDOWN: u16 = 1053;
const ER_TOO_MANY_USER_CONNECTIONS: u16 = 1203;
const ER_QUERY_INTERRUPTED: u16 = 1317;
/// On a Galera node, "WSREP has not yet prepared node for application use":
/// the node is not in the primary component (joining, partitioned, leaving).
const ER_UNKNOWN_COM_ERROR: u16 = 1047;
/// "Got error during COMMIT": the transaction was rolled back. On Galera a
/// node that left the primary component while the write set was being
/// replicated answers it ("Not connected to Primary Component"), as it
/// answers 1047 to the next statement.
const ER_ERROR_DURING_COMMIT: u16 = 1180;

/// The server's error number, if the error came from the server.
pub(crate) fn number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => db.try_downcast_ref::<MySqlDatabaseError>().map(|m| m.number()),
        _ => None,
    }
}

/// Whether the server refused a duplicate key (SQLSTATE 23000 also covers
/// NOT NULL and foreign-key failures, which are not duplicates: the number
/// decides).
fn is_duplicate(number: u16) -> bool {
    matches!(
        number,
        ER_DUP_KEY | ER_DUP_ENTRY | ER_DUP_UNIQUE | ER_DUP_ENTRY_WITH_KEY_NAME
    )
}

/// The driver's message if `error`, or any error in its source chain, is a
/// duplicate-key error from this driver (a handler's own write hitting a
/// unique index): [`oncely::backend::Ledger::unique_violation`].
pub(crate) fn unique_violation(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(e) = e.downcast_ref::<sqlx::Error>()
            && number(e).is_some_and(is_duplicate)
        {
            return Some(e.to_string());
        }
        // sqlx::Error::Database gives its boxed inner error as its source,
        // and some wrappers (std::io::Error) report their inner error's
        // source rather than the inner error: either may be all we see.
        let db = e.downcast_ref::<MySqlDatabaseError>().or_else(|| {
            e.downcast_ref::<Box<dyn sqlx::error::DatabaseError>>()
                .and_then(|b| b.try_downcast_ref::<MySqlDatabaseError>())
        });
        if let Some(db) = db
            && is_duplicate(db.number())
        {
            return Some(db.to_string());
        }
        next = e.source();
    }
    None
}

/// Whether the statement (or, in a transaction, the transaction) was rolled
/// back by a conflict and may succeed if run again: a deadlock, a lock wait
/// timeout, or on Galera a write set that lost certification to another
/// node's (1213, SQLSTATE 40001, which the server may report after the rows
/// of a `RETURNING`, or at `COMMIT`).
pub(crate) fn is_retryable(e: &sqlx::Error) -> bool {
    matches!(number(e), Some(ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT))
        || matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("40001"))
}

/// Maps a driver error. Anything that means "the server cannot be reached or
/// will not let us in" is `Unavailable`, so callers fail closed.
pub(crate) fn map(e: sqlx::Error) -> Error {
    match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => Error::Unavailable {
            backend: BACKEND,
            message: e.to_string(),
        },
        sqlx::Error::Database(_) if is_retryable(&e) => Error::Backend {
            backend: BACKEND,
            message: e.to_string(),
            retryable: true,
        },
        sqlx::Error::Database(_) => match number(&e) {
            Some(ER_QUERY_INTERRUPTED) => Error::Backend {
                backend: BACKEND,
                message: e.to_string(),
                retryable: true,
            },
            Some(
                ER_CON_COUNT_ERROR
                | ER_TOO_MANY_USER_CONNECTIONS
                | ER_DBACCESS_DENIED
                | ER_ACCESS_DENIED
                | ER_BAD_DB
                | ER_SERVER_SHUTDOWN
                | ER_UNKNOWN_COM_ERROR
                | ER_ERROR_DURING_COMMIT,
            ) => Error::Unavailable {
                backend: BACKEND,
                message: e.to_string(),
            },
            Some(n) if is_duplicate(n) => unexpected_violation(&e.to_string()),
            Some(ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION) => Error::Config(format!(
                "a write on a read-only session (MySqlLedgerOptions::read_only): {e}"
            )),
            _ => Error::Backend {
                backend: BACKEND,
                message: e.to_string(),
                retryable: false,
            },
        },
        _ => Error::Backend {
            backend: BACKEND,
            message: e.to_string(),
            retryable: false,
        },
    }
}

/// A unique violation that is not the effect key: counted and surfaced,
/// never taken for a duplicate.
pub(crate) fn unexpected_violation(detail: &str) -> Error {
    oncely::backend::report_unexpected_violation(BACKEND, detail);
    Error::Corrupt {
        backend: BACKEND,
        message: format!("unexpected unique-constraint violation (not the effect key): {detail}"),
    }
}

pub(crate) fn corrupt(message: impl Into<String>) -> Error {
    Error::Corrupt {
        backend: BACKEND,
        message: message.into(),
    }
}

/// A pool whose sessions run with `autocommit = 0` (found at the first
/// operation, or by the leaked-transaction guard).
pub(crate) fn autocommit_off() -> Error {
    Error::Config(
        "the ledger's pool runs with autocommit = 0: its writes would never commit; \
         use a pool in autocommit mode (claim_in / complete_in join your transactions)"
            .to_owned(),
    )
}

/// The spawned task an operation runs in failed (a panic is a bug and not
/// retryable; a cancelled runtime is).
pub(crate) fn join_error(e: tokio::task::JoinError) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("ledger task failed: {e}"),
        retryable: !e.is_panic(),
    }
}

/// A fenced write matched no row: the lease is no longer this holder's.
pub(crate) fn lease_lost(lease: &Lease) -> Error {
    Error::LeaseLost {
        key: lease.key().to_string(),
        fence: lease.fence(),
    }
}
