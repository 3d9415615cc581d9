//! The transactional outbox's statements (`<table>_outbox`, schema version
//! 3) and what their rows say: the enqueue in the caller's transaction,
//! and the relay's claim, marks, retry, failure, prune and counts
//! (`oncely::outbox`; `outbox.rs` runs them).
//!
//! The table is PostgreSQL's (`oncely-postgres`, schema version 6) in
//! SQLite's dialect: times are INTEGER microseconds of SQLite's clock
//! ([`NOW_US`], read once per statement, after the statement holds the
//! write lock), the id is an `AUTOINCREMENT` rowid, and the partial indexes
//! are PostgreSQL's, plus one the claim's scan in id order needs here.

use std::sync::Arc;
use std::time::Duration;

use oncely::backend::{duration_micros, from_micros};
use oncely::outbox::{Enqueued, Message, OutboxStats, Pending, Ticket, decode_headers};
use oncely::{EffectKey, Result};
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row};

use super::write::fence_param;
use super::{Bound, NOW_US};
use crate::error::{BACKEND, corrupt, map};

/// The outbox's statements, built once per ledger.
#[derive(Debug)]
pub(crate) struct OutboxQueries {
    /// `<table>_outbox`, for the schema check.
    pub(crate) table: Arc<str>,
    enqueue: Arc<str>,
    claim: Arc<str>,
    mark_sent: Arc<str>,
    retry: Arc<str>,
    fail: Arc<str>,
    prune: Arc<str>,
    stats: Arc<str>,
    erase_find: Arc<str>,
    erase: Arc<str>,
}

/// The outbox table and its indexes (schema version 3), on `<t>_outbox`.
/// Frozen with that migration.
///
/// - `id`: the order messages were enqueued in; `AUTOINCREMENT`, so an id
///   is never handed out again after the newest messages were pruned (a
///   plain rowid would reuse the largest one's). SQLite has one writer, so
///   ids are handed out in commit order.
/// - `key`: the effect key that names the message, unique (BINARY, as the
///   ledger's keys): a second enqueue of it writes nothing.
/// - `state`: `pending` until the relay marks it `sent`, or `failed` once it
///   gives up; `fence`, `lease_expires_at`: the relay's claim; `due_at`: when
///   it may be claimed (a retry's back-off); `attempts`: claims so far.
/// - `_pending (ordering_key, id)` of pending messages: the claim's "oldest
///   pending message of its ordering key" test, one probe per candidate;
///   `_claim (id)` of pending messages: the claim's scan of pending messages
///   in id order (the rowid order would walk every sent message first);
///   `_sent (sent_at)` of sent messages: prune, oldest first.
pub(super) fn migration(t: &str) -> String {
    let o = format!("{t}_outbox");
    format!(
        "CREATE TABLE IF NOT EXISTS \"{o}\" (
            id               INTEGER PRIMARY KEY AUTOINCREMENT,
            key              TEXT NOT NULL UNIQUE,
            tenant           TEXT NOT NULL,
            ordering_key     TEXT NOT NULL,
            destination      TEXT NOT NULL,
            headers          TEXT NOT NULL,
            payload          BLOB NOT NULL,
            state            TEXT NOT NULL CHECK (state IN ('pending', 'sent', 'failed')),
            attempts         INTEGER NOT NULL DEFAULT 0,
            fence            INTEGER NOT NULL DEFAULT 0,
            lease_expires_at INTEGER,
            due_at           INTEGER NOT NULL,
            enqueued_at      INTEGER NOT NULL,
            sent_at          INTEGER,
            last_error       TEXT
        );
        CREATE INDEX IF NOT EXISTS \"{o}_pending\" ON \"{o}\" (ordering_key, id) WHERE state = 'pending';
        CREATE INDEX IF NOT EXISTS \"{o}_claim\" ON \"{o}\" (id) WHERE state = 'pending';
        CREATE INDEX IF NOT EXISTS \"{o}_sent\" ON \"{o}\" (sent_at) WHERE state = 'sent';"
    )
}

/// The columns a claimed message is read with ([`pending`] reads them by
/// name).
const COLUMNS: &str = "id, key, ordering_key, destination, headers, payload, attempts, fence, \
                       enqueued_at, lease_expires_at";

impl OutboxQueries {
    pub(super) fn new(t: &str) -> Self {
        let o = format!("{t}_outbox");
        let s = |sql: String| -> Arc<str> { sql.into() };
        OutboxQueries {
            // Enqueue, in the caller's transaction (`SqliteLedger::begin`:
            // `BEGIN IMMEDIATE`, so it already holds the write lock). ?1 key,
            // ?2 tenant, ?3 ordering key, ?4 destination, ?5 headers, ?6
            // payload. The unique key makes a second enqueue of one effect
            // write nothing (`ON CONFLICT(key) DO NOTHING`: only that
            // conflict; a NULL or a failed CHECK is still an error), in the
            // same transaction or after another one committed it; the row
            // comes back only when it was inserted.
            enqueue: s(format!(
                "INSERT INTO \"{o}\" (key, tenant, ordering_key, destination, headers, payload, state, \
                    due_at, enqueued_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pending', {NOW_US}, {NOW_US})
                 ON CONFLICT(key) DO NOTHING
                 RETURNING id"
            )),
            // The relay's claim, run in its own `BEGIN IMMEDIATE` transaction
            // (no other writer until it commits). ?1 the most messages, ?2
            // the lease (µs).
            // - The subquery picks pending messages that are due and not
            //   held under a live lease, each the oldest pending message of
            //   its ordering key (an older one, claimed or not, holds it
            //   back until it is sent or failed), oldest first. It reads the
            //   table the `UPDATE` writes, so SQLite computes it whole before
            //   the first row is written.
            // - The update grants the lease and a fence above the row's last
            //   one and the clock's microseconds (`oncely::backend::
            //   next_fence`; `+ 1` keeps two grants in one millisecond apart),
            //   on the clock read once the write lock is held.
            // `RETURNING` comes back in no particular order: the caller
            // sorts by id.
            claim: s(format!(
                "UPDATE \"{o}\" SET fence = max(fence + 1, {NOW_US}), attempts = attempts + 1,
                    lease_expires_at = {NOW_US} + ?2
                 WHERE id IN (
                    SELECT m.id FROM \"{o}\" AS m
                    WHERE m.state = 'pending' AND m.due_at <= {NOW_US}
                      AND (m.lease_expires_at IS NULL OR m.lease_expires_at <= {NOW_US})
                      AND NOT EXISTS (SELECT 1 FROM \"{o}\" AS p
                                      WHERE p.ordering_key = m.ordering_key AND p.state = 'pending'
                                        AND p.id < m.id)
                    ORDER BY m.id LIMIT ?1)
                 RETURNING {COLUMNS}"
            )),
            // Marks messages sent, each fenced on its ticket: ?1 is a JSON
            // array of `[id, fence]` (one text parameter whatever the batch
            // size, so one prepared statement serves every batch). Only a
            // message still pending at its ticket's fence is written, and
            // `RETURNING` names exactly those (a ticket listed twice matches
            // its row once).
            mark_sent: s(format!(
                "WITH t AS (SELECT j.value ->> 0 AS id, j.value ->> 1 AS fence FROM json_each(?1) AS j)
                 UPDATE \"{o}\" SET state = 'sent', sent_at = {NOW_US}, lease_expires_at = NULL,
                    last_error = NULL
                 FROM t
                 WHERE \"{o}\".id = t.id AND \"{o}\".fence = t.fence AND \"{o}\".state = 'pending'
                 RETURNING \"{o}\".id, \"{o}\".fence"
            )),
            // A retry, fenced on (?1 id, ?2 fence) and on the message being
            // pending: due again ?3 µs from now, ?4 the error. One row
            // changed, or none.
            retry: s(format!(
                "UPDATE \"{o}\" SET lease_expires_at = NULL, due_at = {NOW_US} + ?3, last_error = ?4
                 WHERE id = ?1 AND fence = ?2 AND state = 'pending'"
            )),
            // A failure, fenced as a retry: ?3 the error.
            fail: s(format!(
                "UPDATE \"{o}\" SET state = 'failed', lease_expires_at = NULL, last_error = ?3
                 WHERE id = ?1 AND fence = ?2 AND state = 'pending'"
            )),
            // Prune: up to ?2 messages sent at least ?1 µs ago, oldest first
            // through the `_sent` index (LIMIT on a DELETE needs a
            // compile-time option; the subquery does the same).
            prune: s(format!(
                "DELETE FROM \"{o}\" WHERE id IN (
                    SELECT id FROM \"{o}\" WHERE state = 'sent' AND sent_at <= {NOW_US} - ?1
                    ORDER BY sent_at LIMIT ?2)"
            )),
            // The counts, on one clock reading.
            stats: s(format!(
                "SELECT count(*) FILTER (WHERE state = 'pending') AS pending,
                    count(*) FILTER (WHERE state = 'pending' AND lease_expires_at > {NOW_US}) AS claimed,
                    count(*) FILTER (WHERE state = 'sent') AS sent,
                    count(*) FILTER (WHERE state = 'failed') AS failed,
                    min(enqueued_at) FILTER (WHERE state = 'pending') AS oldest_pending
                 FROM \"{o}\""
            )),
            // `Admin::erase`, in its `BEGIN IMMEDIATE` transaction: the
            // subject's messages (?1 tenant, ?2 subject: the key's text after
            // its first ':', which neither a tenant nor a kind holds), then
            // the payload, headers, ordering key and last error of each one
            // the relay is done with emptied, by id (?1).
            erase_find: s(format!(
                "SELECT id, key, state FROM \"{o}\"
                 WHERE tenant = ?1 AND substr(key, instr(key, ':') + 1) = ?2"
            )),
            erase: s(format!(
                "UPDATE \"{o}\" SET payload = x'', headers = '[]', ordering_key = '', last_error = NULL
                 WHERE id = ?1"
            )),
            table: o.into(),
        }
    }

    /// Enqueues `message` as the message of `key`: a row with its `id`, or
    /// none when the key names a message already ([`enqueued`]).
    pub(crate) fn bind_enqueue(&self, key: &EffectKey, message: &Message) -> Bound {
        sqlx::query(AssertSqlSafe(self.enqueue.clone()))
            .bind(key.as_str())
            .bind(key.tenant().as_str())
            .bind(message.ordering_key_for(key))
            .bind(message.destination())
            .bind(message.encoded_headers())
            .bind(message.payload())
    }

    /// The claim of up to `limit` messages under a lease of `lease`: a
    /// [`pending`] row per message claimed, in no particular order.
    pub(crate) fn bind_claim(&self, limit: u32, lease: Duration) -> Bound {
        sqlx::query(AssertSqlSafe(self.claim.clone()))
            .bind(i64::from(limit))
            .bind(duration_micros(lease))
    }

    /// Marks the messages of `tickets` sent: a [`ticket`] row per message
    /// written.
    pub(crate) fn bind_mark_sent(&self, tickets: &[Ticket]) -> Result<Bound> {
        let pairs: Vec<[i64; 2]> = tickets
            .iter()
            .map(|t| [fence_param(t.id), fence_param(t.fence)])
            .collect();
        Ok(sqlx::query(AssertSqlSafe(self.mark_sent.clone())).bind(serde_json::to_string(&pairs)?))
    }

    /// Gives the message of `ticket` back until `delay` from now: one row
    /// changed, or none.
    pub(crate) fn bind_retry(&self, ticket: Ticket, delay: Duration, error: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.retry.clone()))
            .bind(fence_param(ticket.id))
            .bind(fence_param(ticket.fence))
            .bind(duration_micros(delay))
            .bind(error.to_owned())
    }

    /// Gives the message of `ticket` up: one row changed, or none.
    pub(crate) fn bind_fail(&self, ticket: Ticket, error: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.fail.clone()))
            .bind(fence_param(ticket.id))
            .bind(fence_param(ticket.fence))
            .bind(error.to_owned())
    }

    /// Deletes up to `limit` messages sent at least `older_than` ago: the
    /// rows changed are the messages deleted.
    pub(crate) fn bind_prune(&self, older_than: Duration, limit: u64) -> Bound {
        sqlx::query(AssertSqlSafe(self.prune.clone()))
            .bind(duration_micros(older_than))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    }

    /// The counts: one row ([`stats`]).
    pub(crate) fn bind_stats(&self) -> Bound {
        sqlx::query(AssertSqlSafe(self.stats.clone()))
    }

    /// `Admin::erase`, outbox step 1: `tenant`'s messages of `subject`.
    pub(crate) fn bind_erase_find(&self, tenant: &oncely::Tenant, subject: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.erase_find.clone()))
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// `Admin::erase`, outbox step 2: the message `id` emptied.
    pub(crate) fn bind_erase(&self, id: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.erase.clone())).bind(id)
    }
}

/// Sorts the rows of the outbox step of `Admin::erase` into `erasure`
/// ([`oncely::admin::Erasure::add_message`]); returns the ids to empty.
pub(crate) fn erase_messages(
    erasure: &mut oncely::admin::Erasure,
    rows: &[SqliteRow],
    subject: &str,
) -> Result<Vec<i64>> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable outbox erase row: {e}"));
    let read = |row: &SqliteRow| {
        Ok((
            row.try_get("id").map_err(g)?,
            row.try_get("key").map_err(g)?,
            row.try_get("state").map_err(g)?,
        ))
    };
    erasure.add_messages(rows.iter().map(read), subject)
}

/// A stored id, fence or count as the API's unsigned number.
fn unsigned(what: &str, n: i64) -> Result<u64> {
    u64::try_from(n).map_err(|_| corrupt(format!("outbox {what} {n}")))
}

/// What an enqueue did: its row's id, or nothing.
pub(crate) fn enqueued(row: Option<&SqliteRow>) -> Result<Enqueued> {
    match row {
        Some(row) => Ok(Enqueued::New(unsigned("id", row.try_get("id").map_err(map)?)?)),
        None => Ok(Enqueued::Already),
    }
}

/// A claimed message, from a row of the claim.
pub(crate) fn pending(row: &SqliteRow) -> Result<Pending> {
    let key: String = row.try_get("key").map_err(map)?;
    let key = EffectKey::parse(&key).map_err(|e| corrupt(format!("outbox key {key:?}: {e}")))?;
    let headers: String = row.try_get("headers").map_err(map)?;
    let lease: Option<i64> = row.try_get("lease_expires_at").map_err(map)?;
    Ok(Pending {
        id: unsigned("id", row.try_get("id").map_err(map)?)?,
        key,
        ordering_key: row.try_get("ordering_key").map_err(map)?,
        destination: row.try_get("destination").map_err(map)?,
        headers: decode_headers(BACKEND, &headers)?,
        payload: row.try_get("payload").map_err(map)?,
        attempts: u32::try_from(row.try_get::<i64, _>("attempts").map_err(map)?).unwrap_or(u32::MAX),
        fence: unsigned("fence", row.try_get("fence").map_err(map)?)?,
        enqueued_at: from_micros(row.try_get("enqueued_at").map_err(map)?),
        lease_expires_at: from_micros(lease.ok_or_else(|| corrupt("a claimed message without a lease"))?),
    })
}

/// The ticket a row of the "sent" statement wrote (`id`, `fence`).
pub(crate) fn ticket(row: &SqliteRow) -> Result<Ticket> {
    Ok(Ticket {
        id: unsigned("id", row.try_get("id").map_err(map)?)?,
        fence: unsigned("fence", row.try_get("fence").map_err(map)?)?,
    })
}

/// The counts of an outbox, from the row of [`OutboxQueries::bind_stats`].
pub(crate) fn stats(row: &SqliteRow) -> Result<OutboxStats> {
    let count = |c: &str| -> Result<u64> { unsigned(c, row.try_get(c).map_err(map)?) };
    let oldest: Option<i64> = row.try_get("oldest_pending").map_err(map)?;
    Ok(OutboxStats {
        pending: count("pending")?,
        claimed: count("claimed")?,
        sent: count("sent")?,
        failed: count("failed")?,
        oldest_pending: oldest.map(from_micros),
    })
}

#[cfg(test)]
mod tests {
    use super::super::Queries;
    use sqlx::{AssertSqlSafe, Connection, Row, SqliteConnection};

    async fn plan(conn: &mut SqliteConnection, sql: &str) -> Vec<String> {
        sqlx::query(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}")))
            .fetch_all(conn)
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<String, _>("detail"))
            .collect()
    }

    /// Each statement finds its rows through the index made for it: the
    /// claim walks pending messages in id order and probes each one's
    /// ordering key, the marks and retries look messages up by id, prune
    /// walks sent messages oldest first; none scans the table or sorts.
    #[tokio::test]
    async fn statements_use_their_indexes() {
        let q = Queries::new("ledger").unwrap();
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        for step in &q.migrations {
            sqlx::raw_sql(AssertSqlSafe(step.clone()))
                .execute(&mut conn)
                .await
                .unwrap();
        }
        let o = &q.outbox;
        for (name, sql, wanted) in [
            (
                "claim",
                &o.claim,
                vec![
                    "ledger_outbox_claim",
                    "ledger_outbox_pending (ordering_key=? AND id<?)",
                ],
            ),
            ("mark_sent", &o.mark_sent, vec!["INTEGER PRIMARY KEY (rowid=?)"]),
            ("retry", &o.retry, vec!["INTEGER PRIMARY KEY (rowid=?)"]),
            ("fail", &o.fail, vec!["INTEGER PRIMARY KEY (rowid=?)"]),
            ("prune", &o.prune, vec!["ledger_outbox_sent (sent_at<?)"]),
        ] {
            let plan = plan(&mut conn, sql).await;
            for w in wanted {
                assert!(plan.iter().any(|s| s.contains(w)), "{name}: {w} in {plan:#?}");
            }
            assert!(
                !plan.iter().any(|s| s.contains("TEMP B-TREE")
                    || s.starts_with("SCAN ledger_outbox") && !s.contains("INDEX")),
                "{name}: {plan:#?}"
            );
        }
    }
}
