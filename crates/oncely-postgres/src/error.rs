//! Driver errors to `oncely::Error`. No sqlx type crosses the public API.

use oncely::Error;

pub(crate) const BACKEND: &str = "postgres";

/// The primary key's constraint name: a unique violation on it is a
/// duplicate claim (which the claim statement answers, never raises).
fn is_effect_key_constraint(name: &str) -> bool {
    name.ends_with("_pkey")
}

/// Whether the connection sits in a transaction that failed (`25P02`): every
/// statement on it fails until the transaction ends.
pub(crate) fn is_failed_transaction(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("25P02"))
}

pub(crate) fn map(e: sqlx::Error) -> Error {
    match e {
        // Cannot reach the database: fail closed, no effect runs.
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => Error::Unavailable {
            backend: BACKEND,
            message: e.to_string(),
        },
        sqlx::Error::Configuration(e) => Error::Config(e.to_string()),
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            let message = db.message().to_owned();
            match code.as_str() {
                // serialization_failure, deadlock_detected, lock_not_available,
                // query_canceled (statement_timeout): another attempt may pass.
                "40001" | "40P01" | "55P03" | "57014" => Error::Backend {
                    backend: BACKEND,
                    message,
                    retryable: true,
                },
                "23505" => {
                    let constraint = db.constraint().unwrap_or("").to_owned();
                    if is_effect_key_constraint(&constraint) {
                        // The claim statement resolves key conflicts itself;
                        // reaching here means a race it could not see, so a
                        // retry gets the real answer.
                        Error::Backend {
                            backend: BACKEND,
                            message,
                            retryable: true,
                        }
                    } else {
                        let detail = format!("{constraint}: {message}");
                        oncely::backend::report_unexpected_violation(BACKEND, &detail);
                        Error::Corrupt {
                            backend: BACKEND,
                            message: detail,
                        }
                    }
                }
                // Server shutting down or starting, too many connections,
                // connection exceptions: unavailable, fail closed.
                c if c.starts_with("08") || c.starts_with("57P") || c == "53300" => Error::Unavailable {
                    backend: BACKEND,
                    message,
                },
                // A check violation: the table is not the one this crate
                // created, or holds rows it did not write.
                "23514" => Error::Corrupt {
                    backend: BACKEND,
                    message: format!("{code}: {message}"),
                },
                // Undefined table, column or function: never migrated, or
                // another schema.
                "42P01" | "42703" | "42883" | "3F000" => Error::Config(format!(
                    "{message} (run PgLedger::migrate, or check the schema and table options)"
                )),
                // A write in a read-only session (PgLedgerOptions::read_only,
                // default_transaction_read_only): retrying cannot help.
                "25006" => Error::Config(format!(
                    "{message} (the session is read-only: PgLedgerOptions::read_only or \
                     default_transaction_read_only)"
                )),
                // The role may not do this (create the schema, write the
                // table): a deployment's configuration, not a passing fault.
                "42501" => Error::Config(format!(
                    "{message} (the role lacks a privilege; a role that may only read connects with \
                     PgLedgerOptions::read_only)"
                )),
                _ => Error::Backend {
                    backend: BACKEND,
                    message: format!("{code}: {message}"),
                    retryable: false,
                },
            }
        }
        other => Error::Backend {
            backend: BACKEND,
            message: other.to_string(),
            retryable: false,
        },
    }
}

pub(crate) fn corrupt(message: impl Into<String>) -> Error {
    Error::Corrupt {
        backend: BACKEND,
        message: message.into(),
    }
}

/// The driver's message for a unique violation (SQLSTATE 23505) anywhere in
/// `error`'s source chain: a `sqlx::Error` the handler returned with `?`,
/// wrapped or not. See `Ledger::unique_violation`.
pub(crate) fn unique_violation(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(e) = next {
        // The driver's error itself, or its source as `sqlx::Error` exposes
        // it (the boxed database error), or the concrete PostgreSQL error.
        let db = match e.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Database(db)) => Some(&**db),
            _ => e
                .downcast_ref::<Box<dyn sqlx::error::DatabaseError>>()
                .map(|db| &**db)
                .or_else(|| {
                    e.downcast_ref::<sqlx::postgres::PgDatabaseError>()
                        .map(|db| db as &dyn sqlx::error::DatabaseError)
                }),
        };
        if let Some(db) = db
            && db.code().as_deref() == Some("23505")
        {
            return Some(match db.constraint() {
                Some(constraint) => format!("{constraint}: {}", db.message()),
                None => db.message().to_owned(),
            });
        }
        next = e.source();
    }
    None
}
