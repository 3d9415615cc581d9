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
use sqlx::MySqlConnection;

use crate::MySqlLedger;
use crate::error::{join_error, map};
use crate::guard::{Retry, retry_on_lock};
use crate::sql::{Candidate, Doomed};

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
        let mut tx = self.begin_on(conn).await.map_err(retry_on_lock)?;
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
        let candidates = s
            .bind_prune_candidates(n)
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
            let Candidate { key, tenant, kind } = Candidate::read(r).map_err(map)?;
            keys.push(key);
            groups.insert((tenant, kind), None);
        }
        // 2. lock (and create) the watermark rows, in key order.
        self.upsert_watermarks(tx, &groups).await?;
        // 3. lock what is still prunable.
        keys.sort();
        let locked = s
            .bind_prune_lock(&keys)
            .fetch_all(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        if locked.is_empty() {
            return Ok((seen, 0));
        }
        let mut doomed = Vec::with_capacity(locked.len());
        for r in &locked {
            let Doomed {
                key,
                tenant,
                kind,
                created_us,
            } = Doomed::read(r).map_err(map)?;
            doomed.push(key);
            let w = groups.entry((tenant, kind)).or_insert(None);
            *w = Some(w.map_or(created_us, |w| w.max(created_us)));
        }
        // 4. raise the watermarks, before the delete, in this transaction.
        groups.retain(|_, w| w.is_some());
        self.upsert_watermarks(tx, &groups).await?;
        // 5. delete.
        let done = s
            .bind_prune_delete(&doomed)
            .execute(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
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
        self.sql()
            .bind_watermark_upsert(groups)
            .execute(&mut *tx)
            .await
            .map_err(retry_on_lock)?;
        Ok(())
    }
}
