//! The transactional outbox on PostgreSQL (`oncely::outbox`): messages
//! enqueued in the caller's transaction into `<table>_outbox`, claimed,
//! marked and pruned by relays. Every relay statement runs through the
//! leaked-transaction guard like the ledger's.

use std::time::Duration;

use oncely::outbox::{Enqueued, Message, Outbox, OutboxStats, Pending, Ticket, TransactionalOutbox};
use oncely::{EffectKey, Result};
use sqlx::PgConnection;
use sqlx::postgres::PgRow;

use crate::error::map;
use crate::guard::{self, Run};
use crate::ledger::PgLedger;
use crate::sql::{self, Bound};

impl PgLedger {
    /// Runs one relay statement (guarded, on a pooled connection, bounded
    /// by the operation timeout) and returns its rows once the guard held.
    async fn outbox_rows(&self, what: &'static str, query: impl Fn() -> Bound) -> Result<Vec<PgRow>> {
        self.writable()?;
        self.bounded(async {
            let mut conn = self.acquire().await?;
            guard::retry(
                &mut conn,
                true,
                || format!("the outbox's {what}"),
                |conn| {
                    let query = query();
                    async move {
                        let run = async {
                            let rows = query.fetch_all(&mut *conn).await?;
                            Ok(match rows.first() {
                                Some(first) if !sql::guard_ok(first)? => Run::Leaked,
                                _ => Run::Done(rows),
                            })
                        }
                        .await;
                        (conn, run)
                    }
                },
            )
            .await
        })
        .await
    }
}

impl Outbox for PgLedger {
    async fn claim_messages(&self, limit: u32, lease: Duration) -> Result<Vec<Pending>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let q = &self.inner.q.outbox;
        let rows = self.outbox_rows("claim", || q.bind_claim(limit, lease)).await?;
        let mut claimed = Vec::with_capacity(rows.len());
        for row in &rows {
            if let Some(p) = sql::pending(row)? {
                claimed.push(p);
            }
        }
        Ok(claimed)
    }

    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<Vec<bool>> {
        if tickets.is_empty() {
            return Ok(Vec::new());
        }
        let q = &self.inner.q.outbox;
        let rows = self.outbox_rows("mark", || q.bind_mark_sent(tickets)).await?;
        let mut written = std::collections::HashSet::new();
        for row in &rows {
            if let Some(id) = sql::written_id(row)? {
                written.insert(id);
            }
        }
        Ok(tickets.iter().map(|t| written.contains(&t.id)).collect())
    }

    async fn retry_later(&self, ticket: Ticket, delay: Duration, error: &str) -> Result<bool> {
        let q = &self.inner.q.outbox;
        let rows = self
            .outbox_rows("retry", || q.bind_retry(ticket, delay, error))
            .await?;
        one_written(&rows)
    }

    async fn mark_failed(&self, ticket: Ticket, error: &str) -> Result<bool> {
        let q = &self.inner.q.outbox;
        let rows = self.outbox_rows("failure", || q.bind_fail(ticket, error)).await?;
        one_written(&rows)
    }

    async fn prune_sent(&self, older_than: Duration, limit: u32) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let q = &self.inner.q.outbox;
        let rows = self
            .outbox_rows("prune", || q.bind_prune(older_than, limit))
            .await?;
        rows.first().map_or(Ok(0), sql::pruned)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats> {
        let q = &self.inner.q.outbox;
        let rows = self
            .bounded(async {
                let mut conn = self.acquire().await?;
                guard::retry(
                    &mut conn,
                    true,
                    || "the outbox's counts".to_owned(),
                    |conn| async move {
                        let run = async {
                            let row = q.bind_stats().fetch_one(&mut *conn).await?;
                            guard::checked(row)
                        }
                        .await;
                        (conn, run)
                    },
                )
                .await
            })
            .await?;
        sql::outbox_stats(&rows)
    }
}

/// Whether a fenced write on one ticket wrote.
fn one_written(rows: &[PgRow]) -> Result<bool> {
    for row in rows {
        if sql::written_id(row)?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

impl TransactionalOutbox for PgLedger {
    async fn enqueue_in(
        &self,
        conn: &mut PgConnection,
        key: &EffectKey,
        message: &Message,
    ) -> Result<Enqueued> {
        self.writable()?;
        let row = self
            .inner
            .q
            .outbox
            .bind_enqueue(key, message)
            .fetch_optional(&mut *conn)
            .await
            .map_err(map)?;
        sql::enqueued(row.as_ref())
    }
}
