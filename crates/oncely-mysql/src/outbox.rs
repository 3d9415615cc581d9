//! The transactional outbox on MySQL / MariaDB (`oncely::outbox`):
//! messages enqueued in the caller's transaction into `<table>_outbox`,
//! claimed, marked and pruned by relays. Every relay operation runs on the
//! pool as the ledger's own do (`guard.rs`): to completion in a spawned
//! task, within the operation timeout, run again on a deadlock, a lock wait
//! timeout or a Galera certification conflict (1213 from any statement,
//! the `COMMIT` included), and healed when a pooled connection sits in a
//! transaction someone else leaked.
//!
//! - **The claim** is a short READ COMMITTED transaction: lock the due
//!   messages, each the oldest pending one of its ordering key (`SELECT …
//!   ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`; plain `FOR UPDATE` on
//!   MariaDB 10.5, which waits for another relay's claim instead of passing
//!   over its rows), grant their leases and fences (`UPDATE … WHERE id IN
//!   (…)`), read them back, commit. MariaDB has no `UPDATE … RETURNING`.
//! - **Fenced writes** of one ticket (a retry, a failure, one message sent)
//!   are one guarded autocommit `UPDATE` on (id, fence, pending), as the
//!   ledger's completions; several messages sent are one transaction that
//!   locks those still pending at their tickets' fences, then marks them,
//!   so each ticket's answer is exact.
//! - **Prune** deletes in batches of [`PRUNE_BATCH`], as the ledger's
//!   prune does: a plain read of candidates, then a write that checks
//!   again.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use oncely::backend::duration_micros;
use oncely::outbox::{Enqueued, Message, Outbox, OutboxStats, Pending, Ticket, TransactionalOutbox};
use oncely::{EffectKey, Error, Result};
use sqlx::{Executor, MySqlConnection};

use crate::MySqlLedger;
use crate::error::{BACKEND, corrupt, join_error, map};
use crate::guard::{BoxedFuture, Retry, retry_on_lock};
use crate::row::{first, only};
use crate::sql::{self, FencedState, OutboxStatements};

/// Messages one prune statement deletes at most: bounds the row locks it
/// holds, as the ledger's prune batches do.
const PRUNE_BATCH: u64 = 500;

/// Tickets one "sent" transaction marks at most: a statement of 1,000
/// parameters, far below the 65,535 a prepared statement takes.
const MARK_CHUNK: usize = 500;

impl MySqlLedger {
    /// Runs `body` in a READ COMMITTED transaction on `conn` (see
    /// [`sql::READ_COMMITTED_NEXT`]), begun causally on a Galera node
    /// ([`sql::CAUSAL_BEGIN`]), committing what it returns; an error
    /// rolls it back. A stray transaction on the pooled connection is
    /// rolled back first (MariaDB): `BEGIN` would commit it.
    async fn outbox_transaction<T, F>(&self, conn: &mut MySqlConnection, body: F) -> Result<T, Retry>
    where
        F: for<'t> FnOnce(&'t MySqlLedger, &'t mut MySqlConnection) -> BoxedFuture<'t, Result<T, Retry>>,
    {
        self.heal_if_leaked(conn).await?;
        conn.execute(sql::READ_COMMITTED_NEXT)
            .await
            .map_err(retry_on_lock)?;
        let mut tx = self.begin_on(conn).await.map_err(retry_on_lock)?;
        match body(self, &mut tx).await {
            Ok(done) => {
                // On Galera the cluster certifies the write set here: a
                // conflict with another node's claim is 1213, run again.
                tx.commit().await.map_err(retry_on_lock)?;
                Ok(done)
            }
            Err(e) => {
                // A deadlock has rolled the transaction back already; a lock
                // wait timeout only the statement. Either way, end it.
                tx.rollback().await.map_err(retry_on_lock)?;
                Err(e)
            }
        }
    }

    /// The claim's steps, in its transaction: lock, grant, read back.
    async fn claim_steps(
        &self,
        tx: &mut MySqlConnection,
        limit: u32,
        lease_us: i64,
    ) -> Result<Vec<Pending>, Retry> {
        let o = &self.sql().outbox;
        let skip_locked = self.inner.skip_locked.load(Ordering::Relaxed);
        let rows = o
            .bind_claim(limit, skip_locked)
            .fetch_all(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        let ids = rows.iter().map(sql::outbox_id).collect::<Result<Vec<u64>>>()?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let granted = o
            .bind_grant(lease_us, &ids)
            .execute(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        // CLIENT_FOUND_ROWS: the rows matched, which the lock holds pending.
        if granted.rows_affected() != ids.len() as u64 {
            return Err(corrupt(format!(
                "the outbox claim locked {} messages and granted {}",
                ids.len(),
                granted.rows_affected()
            ))
            .into());
        }
        let rows = o
            .bind_granted(&ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        Ok(rows.iter().map(sql::pending).collect::<Result<Vec<_>>>()?)
    }

    /// Marking several messages sent, in its transaction: the tickets whose
    /// message it marked.
    async fn mark_steps(&self, tx: &mut MySqlConnection, tickets: &[Ticket]) -> Result<Vec<Ticket>, Retry> {
        let o = &self.sql().outbox;
        let rows = o
            .bind_lock_tickets(tickets)
            .fetch_all(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        let locked = rows.iter().map(sql::locked).collect::<Result<Vec<_>>>()?;
        if locked.is_empty() {
            return Ok(locked);
        }
        let done = o
            .bind_sent(tickets)
            .execute(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        if done.rows_affected() != locked.len() as u64 {
            return Err(corrupt(format!(
                "the outbox mark locked {} messages and marked {}",
                locked.len(),
                done.rows_affected()
            ))
            .into());
        }
        Ok(locked)
    }

    /// One fenced write of `ticket` (`statement`, from the current
    /// statement set), autocommit on the pool: whether it wrote.
    async fn fenced_write(
        &self,
        what: &'static str,
        ticket: Ticket,
        statement: impl Fn(&OutboxStatements) -> sql::Bound + Send + Sync + 'static,
    ) -> Result<bool> {
        self.writable(what)?;
        self.on_pool(move |this, conn| {
            let q = statement(&this.sql().outbox);
            Box::pin(async move {
                let done = q.execute(&mut *conn).await.map_err(retry_on_lock)?;
                // CLIENT_FOUND_ROWS: 1 row matched is the write.
                if done.rows_affected() > 0 {
                    return Ok(true);
                }
                this.outbox_miss(conn, ticket).await
            })
        })
        .await
    }

    /// A fenced write of `ticket` matched no row: `false` (the claim was
    /// taken over, or the message is no longer pending), unless the pooled
    /// connection sat in a leaked transaction (healed: run it again), or a
    /// Galera node had not yet applied the claim, committed through another
    /// node (a causal read finds the message pending at the ticket's fence:
    /// run it again), as the ledger's fenced writes do
    /// (`MySqlLedger::fence_miss`).
    async fn outbox_miss(&self, conn: &mut MySqlConnection, ticket: Ticket) -> Result<bool, Retry> {
        if self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        if self.inner.causal.load(Ordering::Relaxed) {
            let row = self
                .sql()
                .outbox
                .bind_fenced_state(ticket.id)
                .fetch_all(&mut *conn)
                .await
                .map(first)
                .map_err(retry_on_lock)?;
            if let Some(row) = row
                && FencedState::read(&row)?.held_by(ticket)
            {
                return Err(Retry::Behind(Error::Backend {
                    backend: BACKEND,
                    message: format!(
                        "outbox message {} is pending at fence {} on a causal read, \
                         yet its fenced write matched nothing",
                        ticket.id, ticket.fence
                    ),
                    retryable: true,
                }));
            }
        }
        Ok(false)
    }

    /// One prune batch of at most `n` messages: how many it deleted (of
    /// how many it found).
    async fn prune_sent_batch(
        &self,
        conn: &mut MySqlConnection,
        older_us: i64,
        n: u64,
    ) -> Result<(u64, u64), Retry> {
        let o = &self.sql().outbox;
        let rows = o
            .bind_prunable(older_us, n)
            .fetch_all(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        let ids = rows.iter().map(sql::outbox_id).collect::<Result<Vec<u64>>>()?;
        if ids.is_empty() {
            return Ok((0, 0));
        }
        let done = o
            .bind_prune(older_us, &ids)
            .execute(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        if done.rows_affected() == 0 && self.heal_if_leaked(conn).await? {
            return Err(Retry::Leaked);
        }
        Ok((ids.len() as u64, done.rows_affected()))
    }
}

impl Outbox for MySqlLedger {
    async fn claim_messages(&self, limit: u32, lease: Duration) -> Result<Vec<Pending>> {
        self.writable("claim_messages")?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        let lease_us = duration_micros(lease);
        self.on_pool(move |this, conn| {
            Box::pin(this.outbox_transaction(conn, move |this, tx| {
                Box::pin(this.claim_steps(tx, limit, lease_us))
            }))
        })
        .await
    }

    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<Vec<bool>> {
        self.writable("mark_sent")?;
        if let [ticket] = tickets {
            let ticket = *ticket;
            let wrote = self
                .fenced_write("mark_sent", ticket, move |o| o.bind_mark_sent(ticket))
                .await?;
            return Ok(vec![wrote]);
        }
        let mut written = HashSet::with_capacity(tickets.len());
        for chunk in tickets.chunks(MARK_CHUNK) {
            let chunk = chunk.to_vec();
            let marked = self
                .on_pool(move |this, conn| {
                    let chunk = chunk.clone();
                    Box::pin(this.outbox_transaction(conn, move |this, tx| {
                        Box::pin(async move { this.mark_steps(tx, &chunk).await })
                    }))
                })
                .await?;
            written.extend(marked);
        }
        Ok(tickets.iter().map(|t| written.contains(t)).collect())
    }

    async fn retry_later(&self, ticket: Ticket, delay: Duration, error: &str) -> Result<bool> {
        let (delay_us, error) = (duration_micros(delay), error.to_owned());
        self.fenced_write("retry_later", ticket, move |o| {
            o.bind_retry(ticket, delay_us, &error)
        })
        .await
    }

    async fn mark_failed(&self, ticket: Ticket, error: &str) -> Result<bool> {
        let error = error.to_owned();
        self.fenced_write("mark_failed", ticket, move |o| o.bind_fail(ticket, &error))
            .await
    }

    /// In batches of at most 500 messages, each a plain read of the oldest
    /// sent messages and one `DELETE` of them that checks again, run on the
    /// pool like every write (to completion in a spawned task, within the
    /// operation timeout, again after a conflict).
    async fn prune_sent(&self, older_than: Duration, limit: u32) -> Result<u64> {
        self.writable("prune_sent")?;
        let older_us = duration_micros(older_than);
        let this = self.clone();
        tokio::spawn(async move {
            this.bounded(this.probe(None)).await?;
            let limit = u64::from(limit);
            let mut total = 0u64;
            while total < limit {
                let n = (limit - total).min(PRUNE_BATCH);
                let (seen, deleted) = this
                    .bounded(
                        this.retrying(move |this, conn| Box::pin(this.prune_sent_batch(conn, older_us, n))),
                    )
                    .await?;
                total += deleted;
                if seen < n {
                    break;
                }
            }
            Ok(total)
        })
        .await
        .map_err(join_error)?
    }

    async fn outbox_stats(&self) -> Result<OutboxStats> {
        let row = self
            .read_on_pool(|this, conn| {
                Box::pin(async move {
                    this.sql()
                        .outbox
                        .bind_stats()
                        .fetch_all(&mut *conn)
                        .await
                        .and_then(only)
                })
            })
            .await?;
        sql::outbox_stats(&row)
    }
}

impl TransactionalOutbox for MySqlLedger {
    /// One `INSERT … ON DUPLICATE KEY UPDATE` on the caller's connection,
    /// in its transaction (nothing is retried there: a conflict rolled back
    /// what only the caller can redo). The statement sets the session's
    /// `LAST_INSERT_ID()`, as any insert into an `AUTO_INCREMENT` table
    /// does: to the new message's id, or to 0 when the key names a message
    /// already.
    async fn enqueue_in(
        &self,
        conn: &mut MySqlConnection,
        key: &EffectKey,
        message: &Message,
    ) -> Result<Enqueued> {
        self.writable("enqueue_in")?;
        self.probe(Some(&mut *conn)).await?;
        let done = self
            .sql()
            .outbox
            .bind_enqueue(key, message)
            .execute(&mut *conn)
            .await
            .map_err(map)?;
        Ok(sql::enqueued(done.last_insert_id()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MySqlLedgerOptions;

    /// A ledger whose claims take MariaDB 10.5's path (plain `FOR UPDATE`,
    /// waiting for another relay's claim instead of passing over its rows),
    /// forced on whatever server the tests run against; on a table of its
    /// own per case (`oncely_obw_<case>`, emptied first).
    async fn waiting(case: &'static str) -> Option<MySqlLedger> {
        let url =
            oncely::conformance::service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))?;
        let table: String = format!("oncely_obw_{case}").chars().take(40).collect();
        let opts = MySqlLedgerOptions::default().max_connections(70).table(&table);
        let ledger = match MySqlLedger::connect_with(&url, opts).await {
            Ok(l) => l,
            Err(e) => return oncely::conformance::skip_or_fail(&format!("MySQL at {url}: {e}")),
        };
        // After the connect's probe, which detected `SKIP LOCKED`.
        ledger.inner.skip_locked.store(false, Ordering::Relaxed);
        sqlx::query(sqlx::AssertSqlSafe(sql::empty_outbox(&table)))
            .execute(ledger.pool())
            .await
            .expect("the outbox emptied");
        Some(ledger)
    }

    oncely::conformance::outbox_conformance_tests!(waiting);
}
