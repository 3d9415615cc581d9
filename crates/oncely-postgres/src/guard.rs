//! The leaked-transaction guard (crate docs, "Cancel safety"), as the one
//! retry helper every ledger operation runs its statement through.
//!
//! A statement that finds itself inside a transaction nobody owns writes
//! nothing (its SQL checks, `sql::guard`); [`Retry`] rolls that transaction
//! back and the statement runs again. The same loop re-runs a claim that
//! met a row its snapshot could not see. Each re-run follows an event that
//! cannot repeat forever (a commit that already happened, a rollback just
//! done), so a few attempts suffice.

use std::sync::Arc;
use std::time::Duration;

use oncely::backend::{Attempts, Backoff};
use oncely::{Error, Result};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection};

use crate::error::{BACKEND, is_failed_transaction, map};
use crate::sql;

/// How many times one operation runs its statement before it fails with a
/// retryable [`Error::Backend`].
const ATTEMPTS: u32 = 8;

/// The pauses between re-runs, from the third run on. The first re-run
/// follows at once, as it always did: what made it necessary (a stray
/// transaction rolled back, a commit the snapshot missed) is already
/// resolved, so it settles in the common case. A statement that still does
/// not settle is meeting new concurrent events; pausing lets them finish
/// instead of spending every attempt within a millisecond (at most 63 ms over
/// all attempts).
const FIRST_PAUSE: Duration = Duration::from_millis(1);
const MAX_PAUSE: Duration = Duration::from_millis(32);

/// What one run of a statement found.
pub(crate) enum Run<T> {
    /// Settled: the operation's answer.
    Done(T),
    /// The guard tripped: the statement ran inside a transaction nobody owns
    /// and wrote nothing. [`Retry::settle`] rolls it back; it runs again.
    Leaked,
    /// Nothing settled, but the next run will (a row committed after the
    /// statement's snapshot, a lease that ended meanwhile).
    Again,
}

/// Why one run of a statement failed: the driver's error (which
/// [`Retry::settle`] inspects for a failed stray transaction) or the
/// ledger's own answer.
pub(crate) enum Failed {
    Sql(sqlx::Error),
    Ledger(Error),
}

impl From<sqlx::Error> for Failed {
    fn from(e: sqlx::Error) -> Self {
        Failed::Sql(e)
    }
}

impl From<Error> for Failed {
    fn from(e: Error) -> Self {
        Failed::Ledger(e)
    }
}

/// The retry loop of one ledger operation, run as
///
/// ```text
/// let mut retry = Retry::new(guarded, || format!("{key}: the claim"));
/// loop {
///     let run = async { /* the statement on conn */ }.await;
///     if let Some(answer) = retry.settle(conn, run).await? {
///         return Ok(answer);
///     }
/// }
/// ```
///
/// (a struct rather than the kit's `retry` taking the statement as a
/// closure: a closure borrowing the connection per run makes the
/// operation's future impossible to prove `Send`). The attempts and pauses
/// are the kit's [`Attempts`], as in every backend's retry loop.
///
/// With `guarded` off (inside the caller's transaction, where running in a
/// transaction is the point) a failed transaction is the caller's error, not
/// healed. `what` names the operation in the error after [`ATTEMPTS`] runs
/// (`"{key}: the claim"`).
pub(crate) struct Retry<W> {
    guarded: bool,
    what: W,
    attempts: Attempts,
}

impl<W: Fn() -> String> Retry<W> {
    pub(crate) fn new(guarded: bool, what: W) -> Self {
        Retry {
            guarded,
            what,
            attempts: Attempts::new(Backoff::new(FIRST_PAUSE, MAX_PAUSE))
                .at_most(ATTEMPTS)
                .at_once(1),
        }
    }

    /// Takes what one run of the statement found: `Some(answer)` when it
    /// settled, `None` when the statement must run again (the stray
    /// transaction is rolled back, the pause waited, first), or the
    /// operation's error (a retryable [`Error::Backend`] once [`ATTEMPTS`]
    /// runs did not settle).
    pub(crate) async fn settle<T>(
        &mut self,
        conn: &mut PgConnection,
        run: Result<Run<T>, Failed>,
    ) -> Result<Option<T>> {
        match run {
            Ok(Run::Done(answer)) => return Ok(Some(answer)),
            Ok(Run::Leaked) => heal(conn).await?,
            Ok(Run::Again) => {}
            Err(Failed::Sql(e)) if self.guarded && is_failed_transaction(&e) => heal(conn).await?,
            Err(Failed::Sql(e)) => return Err(map(e)),
            Err(Failed::Ledger(e)) => return Err(e),
        }
        if !self.attempts.again().await {
            return Err(Error::Backend {
                backend: BACKEND,
                message: format!("{} did not settle after {ATTEMPTS} attempts", (self.what)()),
                retryable: true,
            });
        }
        Ok(None)
    }
}

/// A row whose column `ok` is the guard: [`Run::Done`] with the row if it
/// passed, else [`Run::Leaked`].
pub(crate) fn checked(row: PgRow) -> Result<Run<PgRow>, Failed> {
    Ok(if sql::guard_ok(&row)? {
        Run::Done(row)
    } else {
        Run::Leaked
    })
}

/// Whether `conn` runs statements in their own implicit transactions,
/// asked (with the `probe` statement) only after a fenced write changed
/// nothing: a stale fence or a tripped guard.
pub(crate) async fn autocommit(conn: &mut PgConnection, probe: &Arc<str>) -> Result<bool> {
    match sqlx::query(AssertSqlSafe(probe.clone()))
        .bind(true)
        .fetch_one(&mut *conn)
        .await
    {
        Ok(row) => sql::guard_ok(&row),
        Err(e) if is_failed_transaction(&e) => Ok(false),
        Err(e) => Err(map(e)),
    }
}

/// Ends a transaction that someone else left open on this pooled connection,
/// so the ledger's next statement runs (and commits) on its own.
async fn heal(conn: &mut PgConnection) -> Result<()> {
    tracing::warn!(
        backend = BACKEND,
        "a pooled connection was inside a transaction nobody owns (a cancelled Pool::begin, \
         transact-rs/sqlx#4393); rolling it back before the ledger writes"
    );
    sqlx::raw_sql(sql::ROLLBACK).execute(conn).await.map_err(map)?;
    Ok(())
}
