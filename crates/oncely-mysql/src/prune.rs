//! Prune: deletes completed and released records past their retention and
//! raises the horizon of each tenant and kind it deletes from, in the same
//! transaction.
//!
//! One batch is one transaction on a pooled connection:
//!
//! 1. a plain read of up to `n` prunable keys (no locks);
//! 2. lock the watermark rows of their tenants and kinds, creating missing
//!    ones, in (tenant, kind) order. First, because a claim takes its key's
//!    row and then reads the watermark with a share lock (held to the end of
//!    a caller's transaction): a prune that held record locks while waiting
//!    for a watermark would deadlock with it;
//! 3. lock the candidates that are still prunable (`FOR UPDATE`, a current
//!    read: one taken over since step 1 is skipped);
//! 4. raise each watermark to the newest `created_us` among the locked rows
//!    (never lowering it);
//! 5. delete the locked rows; commit.
//!
//! A claim for a deleted key that was waiting on one of its row locks
//! proceeds only after the commit, and reads the raised watermark (see
//! `claim.rs`).

use std::collections::BTreeMap;

use oncely::Result;
use sqlx::{Connection, MySqlConnection, Row};

use crate::MySqlLedger;
use crate::error::{join_error, map};
use crate::guard::{Retry, retry_on_lock};

/// Records per transaction: bounds how many row locks one prune holds.
const BATCH: u64 = 500;

impl MySqlLedger {
    /// Deletes up to `limit` records in batches, in a spawned task (so a
    /// dropped future never leaves a batch half done); a batch that a lock
    /// conflict rolled back runs again ([`MySqlLedger::retrying`]).
    pub(crate) async fn prune_records(&self, limit: u64) -> Result<u64> {
        let this = self.clone();
        tokio::spawn(async move {
            this.bounded(this.probe(None)).await?;
            let mut total = 0u64;
            while total < limit {
                let n = (limit - total).min(BATCH);
                // Each batch within the operation timeout.
                let (seen, deleted) = this
                    .bounded(this.retrying(move |this, conn| Box::pin(this.prune_batch(conn, n))))
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

    /// One batch; returns (candidates seen, records deleted).
    async fn prune_batch(&self, conn: &mut MySqlConnection, n: u64) -> Result<(u64, u64), Retry> {
        // BEGIN on a connection that someone else left inside a transaction
        // would commit their work: roll it back first (MariaDB).
        self.heal_if_leaked(conn).await?;
        let mut tx = conn.begin().await.map_err(retry_on_lock)?;
        let result = self.prune_in(&mut tx, n).await;
        match result {
            Ok(done) => {
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

    async fn prune_in(&self, tx: &mut MySqlConnection, n: u64) -> Result<(u64, u64), Retry> {
        let s = self.sql();
        let candidates = sqlx::query(sqlx::AssertSqlSafe(s.prune_candidates.as_str()))
            .bind(n)
            .fetch_all(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        if candidates.is_empty() {
            return Ok((0, 0));
        }
        let seen = candidates.len() as u64;
        let mut keys = Vec::with_capacity(candidates.len());
        let mut groups: BTreeMap<(String, String), Option<i64>> = BTreeMap::new();
        for r in &candidates {
            keys.push(r.try_get::<String, _>("effect_key").map_err(map)?);
            groups.insert(
                (r.try_get("tenant").map_err(map)?, r.try_get("kind").map_err(map)?),
                None,
            );
        }
        // 2. lock (and create) the watermark rows, in key order.
        self.upsert_watermarks(tx, &groups).await?;
        // 3. lock what is still prunable.
        keys.sort();
        let mut q = sqlx::query(sqlx::AssertSqlSafe(s.prune_lock(keys.len())));
        for k in &keys {
            q = q.bind(k.as_str());
        }
        let locked = q.fetch_all(&mut *tx).await.map_err(retry_on_lock)?;
        if locked.is_empty() {
            return Ok((seen, 0));
        }
        let mut doomed = Vec::with_capacity(locked.len());
        for r in &locked {
            doomed.push(r.try_get::<String, _>("effect_key").map_err(map)?);
            let created: i64 = r.try_get("created_us").map_err(map)?;
            let group = (
                r.try_get::<String, _>("tenant").map_err(map)?,
                r.try_get::<String, _>("kind").map_err(map)?,
            );
            let w = groups.entry(group).or_insert(None);
            *w = Some(w.map_or(created, |w| w.max(created)));
        }
        // 4. raise the watermarks, before the delete, in this transaction.
        groups.retain(|_, w| w.is_some());
        self.upsert_watermarks(tx, &groups).await?;
        // 5. delete.
        let mut q = sqlx::query(sqlx::AssertSqlSafe(s.prune_delete(doomed.len())));
        for k in &doomed {
            q = q.bind(k.as_str());
        }
        let done = q.execute(&mut *tx).await.map_err(retry_on_lock)?;
        Ok((seen, done.rows_affected()))
    }

    /// Creates missing watermark rows and raises existing ones to the given
    /// values (`None` only locks the row), in one statement.
    async fn upsert_watermarks(
        &self,
        tx: &mut MySqlConnection,
        groups: &BTreeMap<(String, String), Option<i64>>,
    ) -> Result<(), Retry> {
        if groups.is_empty() {
            return Ok(());
        }
        let text = self.sql().watermark_upsert(groups.len());
        let mut q = sqlx::query(sqlx::AssertSqlSafe(text));
        for ((tenant, kind), w) in groups {
            q = q.bind(tenant.as_str()).bind(kind.as_str()).bind(*w);
        }
        q.execute(&mut *tx).await.map_err(retry_on_lock)?;
        Ok(())
    }
}
