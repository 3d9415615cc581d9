//! The leaked-transaction guard (crate docs, "Cancel safety"), as the one
//! retry helper every ledger operation runs its statement through.
//!
//! A statement that finds itself inside a transaction nobody owns writes
//! nothing (its SQL checks, `sql::guard`); [`retry`] rolls that transaction
//! back and the statement runs again. The same loop re-runs a claim that
//! met a row its snapshot could not see. Each re-run follows an event that
//! cannot repeat forever (a commit that already happened, a rollback just
//! done), so a few attempts suffice.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use oncely::backend::{Attempts, Backoff, retry_with};
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
    /// and wrote nothing. [`retry`] rolls it back; it runs again.
    Leaked,
    /// Nothing settled, but the next run will (a row committed after the
    /// statement's snapshot, a lease that ended meanwhile).
    Again,
}

/// Why one run of a statement failed: the driver's error (which [`retry`]
/// inspects for a failed stray transaction) or the
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

/// Runs one ledger operation's statement on `conn` through the kit's one
/// retry loop ([`retry_with`]), as
///
/// ```text
/// guard::retry(conn, guarded, || format!("{key}: the claim"), |conn| async move {
///     let run = async { /* the statement on conn */ }.await;
///     (conn, run)
/// })
/// .await
/// ```
///
/// Each run takes the connection and gives it back with what it found
/// ([`Run`], or why it [`Failed`]): a tripped guard or a failed stray
/// transaction is rolled back, and the statement runs again after the
/// kit's [`Attempts`] pause; after [`ATTEMPTS`] runs that did not settle,
/// a retryable [`Error::Backend`]. (The connection is moved in and out
/// rather than borrowed by the closure: a closure borrowing it per run
/// would make the operation's future impossible to prove `Send`.)
///
/// With `guarded` off (inside the caller's transaction, where running in a
/// transaction is the point) a failed transaction is the caller's error, not
/// healed. `what` names the operation in the error after [`ATTEMPTS`] runs
/// (`"{key}: the claim"`).
pub(crate) async fn retry<'c, T, F, Fut>(
    conn: &'c mut PgConnection,
    guarded: bool,
    what: impl Fn() -> String,
    mut run: F,
) -> Result<T>
where
    F: FnMut(&'c mut PgConnection) -> Fut,
    Fut: Future<Output = (&'c mut PgConnection, Result<Run<T>, Failed>)>,
{
    let ((), answer) = retry_on(conn, guarded, what, (), |conn, ()| {
        let run = run(conn);
        async move {
            let (conn, found) = run.await;
            (conn, (), found)
        }
    })
    .await;
    answer
}

/// [`retry`] for a statement whose runs also carry `state` of the
/// caller's (what a batch has settled so far): each run takes it with the
/// connection and gives both back; the state comes back with the answer.
pub(crate) async fn retry_on<'c, S, T, F, Fut>(
    conn: &'c mut PgConnection,
    guarded: bool,
    what: impl Fn() -> String,
    state: S,
    mut run: F,
) -> (S, Result<T>)
where
    F: FnMut(&'c mut PgConnection, S) -> Fut,
    Fut: Future<Output = (&'c mut PgConnection, S, Result<Run<T>, Failed>)>,
{
    let attempts = Attempts::new(Backoff::new(FIRST_PAUSE, MAX_PAUSE))
        .at_most(ATTEMPTS)
        .at_once(1);
    let again = |e: &Unsettled| matches!(e, Unsettled::Again);
    let ((_, state), answer) = retry_with((conn, state), attempts, again, |(conn, state)| {
        let run = run(conn, state);
        async move {
            let (conn, state, found) = run.await;
            let answer = settle(conn, guarded, found).await;
            ((conn, state), answer)
        }
    })
    .await;
    let answer = answer.map_err(|e| match e {
        Unsettled::Again => Error::Backend {
            backend: BACKEND,
            message: format!("{} did not settle after {ATTEMPTS} attempts", what()),
            retryable: true,
        },
        Unsettled::Failed(e) => e,
    });
    (state, answer)
}

/// Why a run did not settle: the statement must run again (after the
/// stray transaction was rolled back), or the operation failed.
enum Unsettled {
    Again,
    Failed(Error),
}

/// What one run found, as the retry loop takes it: the answer, another
/// run (the stray transaction rolled back first), or the operation's error.
async fn settle<T>(
    conn: &mut PgConnection,
    guarded: bool,
    run: Result<Run<T>, Failed>,
) -> Result<T, Unsettled> {
    match run {
        Ok(Run::Done(answer)) => return Ok(answer),
        Ok(Run::Leaked) => heal(conn).await.map_err(Unsettled::Failed)?,
        Ok(Run::Again) => {}
        Err(Failed::Sql(e)) if guarded && is_failed_transaction(&e) => {
            heal(conn).await.map_err(Unsettled::Failed)?
        }
        Err(Failed::Sql(e)) => return Err(Unsettled::Failed(map(e))),
        Err(Failed::Ledger(e)) => return Err(Unsettled::Failed(e)),
    }
    Err(Unsettled::Again)
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
