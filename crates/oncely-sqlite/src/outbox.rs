//! The transactional outbox on SQLite (`oncely::outbox`): messages enqueued
//! in the caller's `BEGIN IMMEDIATE` transaction into `<table>_outbox`,
//! claimed, marked and pruned by relays. SQLite has one writer: the claim
//! is one `UPDATE … RETURNING` in a `BEGIN IMMEDIATE` transaction of its
//! own (the write lock first, then the clock and the rows), each mark or
//! retry one autocommit statement, each prune batch one statement.

use std::collections::HashSet;
use std::time::Duration;

use oncely::outbox::{Enqueued, Message, Outbox, OutboxStats, Pending, Ticket, TransactionalOutbox};
use oncely::{EffectKey, Result};
use sqlx::Connection;
use sqlx::sqlite::SqliteConnection;

use crate::error::map;
use crate::ledger::SqliteLedger;
use crate::sql;

/// Messages one prune statement deletes at most: it holds SQLite's single
/// write lock while it runs, so claims wait for one batch at most, as for
/// the ledger's prune.
const PRUNE_BATCH: u64 = 500;

impl Outbox for SqliteLedger {
    /// One `BEGIN IMMEDIATE` transaction: the claim statement, then the
    /// commit. A dropped future rolls it back: nothing is claimed.
    async fn claim_messages(&self, limit: u32, lease: Duration) -> Result<Vec<Pending>> {
        self.writable("claim_messages")?;
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut conn = self.pool().acquire().await.map_err(map)?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        let rows = self
            .queries()
            .outbox
            .bind_claim(limit, lease)
            .fetch_all(&mut *tx)
            .await
            .map_err(map)?;
        let mut claimed = rows.iter().map(sql::pending).collect::<Result<Vec<_>>>()?;
        tx.commit().await.map_err(map)?;
        claimed.sort_by_key(|m| m.id);
        Ok(claimed)
    }

    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<Vec<bool>> {
        self.writable("mark_sent")?;
        if tickets.is_empty() {
            return Ok(Vec::new());
        }
        let rows = self
            .queries()
            .outbox
            .bind_mark_sent(tickets)?
            .fetch_all(self.pool())
            .await
            .map_err(map)?;
        let written = rows.iter().map(sql::ticket).collect::<Result<HashSet<_>>>()?;
        Ok(tickets.iter().map(|t| written.contains(t)).collect())
    }

    async fn retry_later(&self, ticket: Ticket, delay: Duration, error: &str) -> Result<bool> {
        self.writable("retry_later")?;
        let done = self
            .queries()
            .outbox
            .bind_retry(ticket, delay, error)
            .execute(self.pool())
            .await
            .map_err(map)?;
        Ok(done.rows_affected() == 1)
    }

    async fn mark_failed(&self, ticket: Ticket, error: &str) -> Result<bool> {
        self.writable("mark_failed")?;
        let done = self
            .queries()
            .outbox
            .bind_fail(ticket, error)
            .execute(self.pool())
            .await
            .map_err(map)?;
        Ok(done.rows_affected() == 1)
    }

    /// In batches of at most 500 messages, one statement each; between
    /// batches the write lock is free.
    async fn prune_sent(&self, older_than: Duration, limit: u32) -> Result<u64> {
        self.writable("prune_sent")?;
        let mut conn = self.pool().acquire().await.map_err(map)?;
        let limit = u64::from(limit);
        let mut deleted = 0;
        while deleted < limit {
            let batch = (limit - deleted).min(PRUNE_BATCH);
            let done = self
                .queries()
                .outbox
                .bind_prune(older_than, batch)
                .execute(&mut *conn)
                .await
                .map_err(map)?;
            deleted += done.rows_affected();
            if done.rows_affected() < batch {
                break;
            }
        }
        Ok(deleted)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats> {
        let row = self
            .queries()
            .outbox
            .bind_stats()
            .fetch_one(self.pool())
            .await
            .map_err(map)?;
        sql::outbox_stats(&row)
    }
}

impl TransactionalOutbox for SqliteLedger {
    /// One `INSERT … ON CONFLICT(key) DO NOTHING RETURNING id` on the
    /// caller's connection, inside its transaction (start it with
    /// [`SqliteLedger::begin`]: `BEGIN IMMEDIATE`).
    async fn enqueue_in(
        &self,
        conn: &mut SqliteConnection,
        key: &EffectKey,
        message: &Message,
    ) -> Result<Enqueued> {
        self.writable("enqueue_in")?;
        let row = self
            .queries()
            .outbox
            .bind_enqueue(key, message)
            .fetch_optional(&mut *conn)
            .await
            .map_err(map)?;
        sql::enqueued(row.as_ref())
    }
}
