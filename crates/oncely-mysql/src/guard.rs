//! Running an operation on the pool: to completion (in a spawned task, so a
//! dropped future never leaves a statement half-sent or a connection inside
//! a transaction), retried on a conflict (at once the first time, then with
//! one backoff), and healed when a pooled connection sits inside a
//! transaction someone else left open (the leaked-transaction guard,
//! MariaDB only: see the crate docs, "Cancel safety").

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use oncely::backend::{Attempts, Backoff, retry};
use oncely::backend::{Lease, RecordState};
use oncely::{Error, Result};
use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql, MySqlConnection, Row};

use crate::error::{
    self, BACKEND, autocommit_off, corrupt, join_error, lease_lost, map, unexpected_violation,
};
use crate::row::{first, only};
use crate::sql::stored;
use crate::{MySqlLedger, sql};

/// How many times a ledger operation on the pool runs before a deadlock or
/// lock wait timeout is returned (each attempt is one autocommit statement,
/// or a prune batch that rolled back whole, so running it again is safe).
const ATTEMPTS: u32 = 8;

/// The pause after the second failed attempt; it doubles each time, up to
/// [`MAX_PAUSE`]. The first failed attempt is run again at once: the usual
/// conflict is another claim of the key that won (a deadlock, or on Galera
/// a certification failure), and the next attempt's first read answers
/// from the winner's row. Lock conflicts between claims of one key clear
/// within milliseconds; eight attempts span about a quarter of a second.
const FIRST_PAUSE: Duration = Duration::from_millis(4);

/// The longest pause between two attempts.
const MAX_PAUSE: Duration = Duration::from_millis(128);

/// Why an attempt on the pool did not finish.
pub(crate) enum Retry {
    /// Deadlock or lock wait timeout: run it again.
    Lock(sqlx::Error),
    /// The row moved under a multi-statement claim (or a refreshed grant was
    /// taken over): run the claim again, and report this if it keeps
    /// happening.
    Moved(String),
    /// The pooled connection was inside a transaction someone else left
    /// open; it has been rolled back and nothing was written: run it again.
    Leaked,
    /// A fenced write missed on a Galera node that had not yet applied the
    /// lease's grant (committed on another node): a causal read found the
    /// lease live, and the node has applied the grant by now: run it again.
    /// The error is the answer if this keeps happening.
    Behind(Error),
    /// Final.
    Fail(Error),
}

impl From<Error> for Retry {
    fn from(e: Error) -> Self {
        Retry::Fail(e)
    }
}

/// A driver error as a [`Retry`]: lock conflicts are retried, the rest are
/// final.
pub(crate) fn retry_on_lock(e: sqlx::Error) -> Retry {
    if error::is_retryable(&e) {
        Retry::Lock(e)
    } else {
        Retry::Fail(map(e))
    }
}

/// A Galera node outside the primary component.
fn cut_off(e: sqlx::Error) -> Error {
    Error::Unavailable {
        backend: BACKEND,
        message: format!("the Galera node is not in the primary component (wsrep_ready is not ON): {e}"),
    }
}

/// The attempts of the retry loop: [`ATTEMPTS`] of them, nothing before
/// the first two, then [`Backoff`]'s pauses.
fn attempts() -> Attempts {
    Attempts::new(Backoff::new(FIRST_PAUSE, MAX_PAUSE))
        .at_most(ATTEMPTS)
        .at_once(1)
}

/// A boxed, sendable future.
pub(crate) type BoxedFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

tokio::task_local! {
    /// The deadline of the ledger operation running on this task
    /// ([`MySqlLedger::bounded`]), read by [`MySqlLedger::acquire`].
    static DEADLINE: Instant;
}

/// A pooled connection of one bounded operation: dropped after the
/// operation's deadline (the operation timed out, perhaps mid-statement on
/// a frozen server), it is closed, never returned to the pool, whose
/// release would ping a server that may never answer.
pub(crate) struct Conn {
    conn: PoolConnection<MySql>,
    deadline: Option<Instant>,
}

impl std::ops::Deref for Conn {
    type Target = MySqlConnection;
    fn deref(&self) -> &MySqlConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        &mut self.conn
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.conn.close_on_drop();
        }
    }
}

impl MySqlLedger {
    /// Runs one ledger operation within
    /// [`MySqlLedgerOptions::operation_timeout`](crate::MySqlLedgerOptions::operation_timeout):
    /// past it, [`Error::Unavailable`] (and the connection it held is
    /// closed, see [`Conn`]). An unavailable server, either way, makes the
    /// ledger suspect its host (`hosts.rs`): the pool's older connections
    /// are dropped and, with a host list, a search for another host starts.
    /// Nested calls run within the outer one's deadline.
    pub(crate) async fn bounded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        if DEADLINE.try_with(|_| ()).is_ok() {
            return op.await;
        }
        let timeout = self.inner.operation_timeout;
        let answer = match tokio::time::timeout(timeout, DEADLINE.scope(Instant::now() + timeout, op)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::Unavailable {
                backend: BACKEND,
                message: format!("no answer within {timeout:?} (MySqlLedgerOptions::operation_timeout)"),
            }),
        };
        if matches!(answer, Err(Error::Unavailable { .. })) {
            self.suspect();
        }
        answer
    }

    /// The server looked gone: see [`MySqlLedger::bounded`].
    pub(crate) fn suspect(&self) {
        if let Some(hosts) = &self.inner.hosts {
            hosts.suspect();
        }
    }

    /// A pooled connection for the operation running on this task. A pool
    /// that timed out while new connections were being refused says why.
    pub(crate) async fn acquire(&self) -> Result<Conn> {
        let deadline = DEADLINE.try_with(|d| *d).ok();
        match self.inner.pool.acquire().await {
            Ok(conn) => Ok(Conn { conn, deadline }),
            Err(e) => {
                let refused = matches!(e, sqlx::Error::PoolTimedOut)
                    .then(|| self.inner.hosts.as_ref().and_then(|h| h.refusal()))
                    .flatten();
                Err(match (map(e), refused) {
                    (Error::Unavailable { backend, message }, Some(why)) => Error::Unavailable {
                        backend,
                        message: format!("{message} ({why})"),
                    },
                    (e, _) => e,
                })
            }
        }
    }

    /// Runs `attempt` on a pooled connection in a spawned task (so it
    /// finishes even if the caller's future is dropped), after the server
    /// has been probed, with [`MySqlLedger::retrying`].
    pub(crate) async fn on_pool<T, F>(&self, attempt: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> Fn(&'c MySqlLedger, &'c mut MySqlConnection) -> BoxedFuture<'c, Result<T, Retry>>
            + Send
            + Sync
            + 'static,
    {
        let this = self.clone();
        tokio::spawn(async move {
            this.bounded(async {
                this.probe(None).await?;
                this.retrying(attempt).await
            })
            .await
        })
        .await
        .map_err(join_error)?
    }

    /// The one retry loop of the backend: runs `attempt` on a fresh pooled
    /// connection until it finishes or fails for good, at most [`ATTEMPTS`]
    /// times, pausing with [`Backoff`] between attempts (the kit's
    /// [`retry`]).
    pub(crate) async fn retrying<T, F>(&self, attempt: F) -> Result<T>
    where
        F: for<'c> Fn(&'c MySqlLedger, &'c mut MySqlConnection) -> BoxedFuture<'c, Result<T, Retry>>,
    {
        let answer = retry(
            attempts(),
            |e| !matches!(e, Retry::Fail(_)),
            || async {
                let mut conn = self.acquire().await?;
                match attempt(self, &mut conn).await {
                    Err(Retry::Lock(e)) if self.cut_off(&mut conn, &e).await => Err(Retry::Fail(cut_off(e))),
                    answer => answer,
                }
            },
        )
        .await;
        answer.map_err(|last| match last {
            Retry::Lock(e) => map(e),
            // The statement keeps missing the key's row: only a conflict
            // on another unique index does that.
            Retry::Moved(why) => unexpected_violation(&why),
            Retry::Fail(e) | Retry::Behind(e) => e,
            Retry::Leaked => corrupt("retries exhausted"),
        })
    }

    /// Whether `e`, a lock wait timeout (1205) on a Galera node, means the
    /// node has left the cluster's primary component: a causal read there
    /// waits `repl.causal_read_timeout` for a sync that cannot come, then
    /// fails with 1205, which is no lock conflict to retry on this node.
    /// (Other statements fail at once with 1047, `Unavailable`.) `SHOW
    /// STATUS` still answers on such a node.
    pub(crate) async fn cut_off(&self, conn: &mut MySqlConnection, e: &sqlx::Error) -> bool {
        if !self.inner.galera.load(Ordering::Relaxed) || error::number(e) != Some(1205) {
            return false;
        }
        let ready = sqlx::raw_sql(sql::WSREP_READY).fetch_all(&mut *conn).await;
        let ready = ready
            .ok()
            .and_then(first)
            .and_then(|r| r.try_get::<String, _>(1).ok());
        ready.as_deref() != Some("ON")
    }

    /// A read on `conn` failed: as [`map`], but a Galera node that has
    /// left the primary component is [`Error::Unavailable`]
    /// ([`MySqlLedger::cut_off`]).
    pub(crate) async fn read_failed(&self, conn: &mut MySqlConnection, e: sqlx::Error) -> Error {
        if self.cut_off(conn, &e).await {
            return cut_off(e);
        }
        map(e)
    }

    /// A read's result on `conn`, its error as [`MySqlLedger::read_failed`].
    pub(crate) async fn checked<T>(
        &self,
        conn: &mut MySqlConnection,
        r: std::result::Result<T, sqlx::Error>,
    ) -> Result<T> {
        match r {
            Ok(v) => Ok(v),
            Err(e) => Err(self.read_failed(conn, e).await),
        }
    }

    /// Runs one read on a pooled connection, bounded, after the server has
    /// been probed; its error as [`MySqlLedger::read_failed`].
    pub(crate) async fn read_on_pool<T, F>(&self, read: F) -> Result<T>
    where
        F: for<'c> FnOnce(
            &'c MySqlLedger,
            &'c mut MySqlConnection,
        ) -> BoxedFuture<'c, std::result::Result<T, sqlx::Error>>,
    {
        self.bounded(async {
            self.probe(None).await?;
            let mut conn = self.acquire().await?;
            let r = read(self, &mut conn).await;
            self.checked(&mut conn, r).await
        })
        .await
    }

    /// A fenced write matched no row: the lease is lost, unless the pooled
    /// connection sat inside a transaction someone else left open (checked
    /// when `may_leak`), which is healed so the write runs again, or (on a
    /// Galera node) the node had not yet applied the lease's grant.
    pub(crate) async fn fence_miss(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        may_leak: bool,
    ) -> Retry {
        if may_leak {
            match self.heal_if_leaked(conn).await {
                Ok(true) => return Retry::Leaked,
                Ok(false) => {}
                Err(e) => return e,
            }
        }
        if self.inner.causal.load(Ordering::Relaxed) {
            // A node applies other nodes' write sets a few milliseconds
            // after they commit, so a lease granted (or renewed) through
            // another node may not be here yet. The write's own miss costs
            // nothing on the usual path; only a miss asks, with a causal
            // read (which first applies everything committed before it):
            // is the lease live after all? Then the write runs again.
            let row = self
                .sql()
                .bind_read_back(lease.key())
                .fetch_all(&mut *conn)
                .await
                .map(first)
                .map_err(retry_on_lock);
            match row {
                Ok(Some(r)) => match stored(&r, true, false) {
                    Ok(r) if r.fence == lease.fence() && r.state == RecordState::InProgress => {
                        return Retry::Behind(lease_lost(lease));
                    }
                    Ok(_) => {}
                    Err(e) => return e.into(),
                },
                Ok(None) => {}
                Err(e) => return e,
            }
        }
        lease_lost(lease).into()
    }

    /// Whether a pooled connection sat inside a transaction that someone else
    /// left open (their `pool.begin()` dropped mid-way, an aborted `BEGIN`).
    /// If so, that transaction is rolled back, so the connection is clean for
    /// the retry and no lock of ours outlives it. Always `false` without
    /// `@@in_transaction` (MySQL 8).
    pub(crate) async fn heal_if_leaked(&self, conn: &mut MySqlConnection) -> Result<bool, Retry> {
        if !self.inner.guarded.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let row = sqlx::query(sql::LEAK_CHECK)
            .fetch_all(&mut *conn)
            .await
            .and_then(only)
            .map_err(retry_on_lock)?;
        let open: u64 = row.try_get("open").map_err(map)?;
        let autocommit: i64 = row.try_get("autocommit").map_err(map)?;
        if open == 0 {
            return Ok(false);
        }
        if autocommit == 0 {
            // Every statement opens a transaction that nobody commits: the
            // guard would trip forever. Say so instead.
            conn.execute(sql::ROLLBACK).await.map_err(retry_on_lock)?;
            return Err(autocommit_off().into());
        }
        tracing::warn!(
            backend = BACKEND,
            "a pooled connection was inside a transaction left open by other code; rolling it back"
        );
        conn.execute(sql::ROLLBACK).await.map_err(retry_on_lock)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A conflict's loser runs again at once: its next attempt reads the
    /// winner's row, with no sleep first.
    #[test]
    fn the_first_retry_does_not_wait() {
        let mut a = attempts();
        let pauses: Vec<u64> = std::iter::once(Duration::ZERO)
            .chain(std::iter::from_fn(|| a.pause()))
            .map(|p| p.as_millis() as u64)
            .collect();
        assert_eq!(pauses, [0, 0, 4, 8, 16, 32, 64, 128]);
    }

    /// The pauses the loop used before it took them from `Backoff`
    /// (`2 << attempt` ms, attempt 1.., capped at attempt 6); the loop
    /// takes them from the second retry on.
    #[test]
    fn pauses_are_unchanged() {
        let mut b = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
        let pauses: Vec<u64> = (1..ATTEMPTS).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(pauses, [4, 8, 16, 32, 64, 128, 128]);
    }
}
