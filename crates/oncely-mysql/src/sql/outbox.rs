//! The transactional outbox's statements (`<table>_outbox`, schema version
//! 3) and their rows: the enqueue in the caller's transaction, and the
//! relay's claim (a short transaction: lock, grant, read back), fenced
//! marks, retry, failure, prune (a read, then a delete) and counts (`oncely::outbox`; the steps
//! are run by `outbox.rs`).
//!
//! The table is PostgreSQL's (`oncely-postgres`, schema version 6) in this
//! backend's dialect: times are BIGINT microseconds on the server's clock
//! (`_us`, [`NOW_US`]), the effect key is `effect_key` (`key` is reserved),
//! strings that are compared are `utf8mb4_bin`, and MySQL has no partial
//! indexes, so the indexes lead with `state`.

use oncely::backend::from_micros;
use oncely::outbox::{Enqueued, Message, OutboxStats, Pending, Ticket, decode_headers};
use oncely::{EffectKey, Result};
use sqlx::Row;
use sqlx::mysql::MySqlRow;

use super::{Bound, NOW_US, STMT_US, placeholders, query};
use crate::error::{BACKEND, corrupt};

/// The name of a ledger table's outbox table.
pub(crate) fn outbox_table(t: &str) -> String {
    format!("{t}_outbox")
}

/// The longest error a retry or a failure records, in bytes: `last_error`
/// is a `TEXT` (64 KiB), and in strict mode a longer value is an error,
/// which would fail the relay's write instead of recording why. A broker's
/// message is cut at a character boundary below this.
const MAX_ERROR_BYTES: usize = 16 * 1024;

/// Run before the relay's transactions (the claim, marking several
/// sent): they lock only the rows they read, for as short as possible. At
/// READ COMMITTED a locking read takes no gap locks, so an enqueue in some
/// business transaction never waits behind a claim, and a row the claim
/// read but did not take (held back, or not due) is unlocked at once. It
/// applies to the next transaction on the session only.
pub(crate) const READ_COMMITTED_NEXT: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// The outbox table and its indexes (schema version 3), `<t>_outbox`.
/// Frozen with that migration.
///
/// - `id`: the order messages were enqueued in. `AUTO_INCREMENT` values are
///   handed out at insert, so two transactions enqueuing at once may commit
///   in the other order; the relay's per-key order is the ids'. InnoDB
///   keeps the counter across restarts (MySQL 8, MariaDB 10.2.4+), so an id
///   is never handed out twice, prunes included.
/// - `effect_key`: the effect key that names the message, unique: a second
///   enqueue of it writes nothing. Binary collation, as the ledger's keys.
/// - `state`: `pending` until the relay marks it `sent`, or `failed` once it
///   gives up; `fence`, `lease_expires_us`: the relay's claim; `due_us`: when
///   it may be claimed (a retry's back-off); `attempts`: claims so far.
/// - `headers`: JSON, up to 32 headers of 4 KiB values (escaped, well under
///   1 MiB: `MEDIUMTEXT`); `payload`: up to 1 MiB (`MEDIUMBLOB`).
/// - `claim_idx (state, id)`: the claim's scan of pending messages in id
///   order (PostgreSQL's partial index, led by the state instead);
///   `pending_idx (ordering_key, state, id)`: its "no older pending message
///   of the same ordering key" test, one probe per candidate;
///   `sent_idx (state, sent_us)`: prune, oldest sent first.
pub(crate) fn migration(t: &str) -> String {
    let o = outbox_table(t);
    format!(
        "CREATE TABLE IF NOT EXISTS `{o}` (
  id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
  effect_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  tenant VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  ordering_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  destination VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  headers MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
  payload MEDIUMBLOB NOT NULL,
  state ENUM('pending', 'sent', 'failed') NOT NULL,
  attempts INT UNSIGNED NOT NULL DEFAULT 0,
  fence BIGINT UNSIGNED NOT NULL DEFAULT 0,
  lease_expires_us BIGINT NULL,
  due_us BIGINT NOT NULL,
  enqueued_us BIGINT NOT NULL,
  sent_us BIGINT NULL,
  last_error TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
  PRIMARY KEY (id),
  UNIQUE KEY effect_key (effect_key),
  KEY claim_idx (state, id),
  KEY pending_idx (ordering_key, state, id),
  KEY sent_idx (state, sent_us)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
    )
}

/// The outbox's statements for one ledger table, in one of the ledger's
/// statement sets (guarded or not, causal or not: see
/// [`Statements::new`](super::Statements::new)).
#[derive(Debug)]
pub(crate) struct OutboxStatements {
    enqueue: String,
    claim_skip: String,
    claim_wait: String,
    grant_prefix: String,
    granted_prefix: String,
    lock_prefix: String,
    sent_prefix: String,
    mark_sent: String,
    retry: String,
    fail: String,
    fenced_state: String,
    prunable: String,
    prune_prefix: String,
    stats: String,
    erase_lock: String,
    erase_prefix: String,
}

/// The columns a claimed message is read with ([`pending`] reads them by
/// name).
const COLUMNS: &str = "id, effect_key, ordering_key, destination, headers, payload, attempts, fence, \
                       enqueued_us, lease_expires_us";

impl OutboxStatements {
    /// `guard`: the leaked-transaction guard of the set (`(? OR
    /// @@in_transaction = 0)`, or `(? OR TRUE)`); `read`: what its reads
    /// start with ([`CAUSAL`](super::CAUSAL) on a MariaDB Galera node).
    pub(super) fn new(t: &str, guard: &str, read: &str) -> Self {
        let o = outbox_table(t);
        // Enqueue, in the caller's transaction: no guard (being inside a
        // transaction is the point), no retry (a conflict rolls back what
        // only the caller can redo). `INSERT IGNORE` would turn every
        // ignorable error (a value too long, a NULL) into "already there";
        // `ON DUPLICATE KEY UPDATE` keeps them errors. Its update changes
        // nothing (`id + 0`): it only sets `LAST_INSERT_ID(0)`, so the
        // statement's OK packet reports the new row's id for an insert and 0
        // for a key that names a message already, whether committed or
        // written earlier in this transaction (the affected-row count cannot
        // tell: with CLIENT_FOUND_ROWS it is 1 both times). MariaDB 10.11
        // reports 0 for an untouched duplicate without it too; MySQL's
        // manual has an ODKU that touches a row report that row's
        // `AUTO_INCREMENT` value, and an explicit `LAST_INSERT_ID(expr)`
        // wins over it on both servers. A key held
        // uncommitted by another transaction makes this one wait on its row
        // lock, then write nothing, or its own row if that one rolled back.
        // The only other unique index is the `AUTO_INCREMENT` primary key,
        // whose new values never meet a stored row.
        let enqueue = format!(
            "INSERT INTO `{o}` (effect_key, tenant, ordering_key, destination, headers, payload, state, \
               attempts, fence, due_us, enqueued_us) \
             VALUES (?, ?, ?, ?, ?, ?, 'pending', 0, 0, {NOW_US}, {NOW_US}) \
             ON DUPLICATE KEY UPDATE id = id + LAST_INSERT_ID(0)"
        );
        // The claim, step 1 (in a READ COMMITTED transaction, `outbox.rs`):
        // up to `?` pending messages that are due and not held under a live
        // lease, oldest first (`claim_idx`), each the oldest pending message
        // of its ordering key. An older one, claimed or not, holds it back
        // until it is sent or failed.
        // - The row's own conditions are judged by the locking read on the
        //   row's latest committed version, on the clock when it is read
        //   ([`NOW_US`], after any wait): a message another claim has just
        //   leased is no longer due for this one.
        // - The `NOT EXISTS` subquery is a plain, consistent read (a locking
        //   clause on the outer query does not lock a subquery's rows: MySQL
        //   8 documents it, and MariaDB 10.11 was checked: a message locked
        //   by a claim in flight still holds back its successor). A message
        //   only ever leaves `pending`, so an old snapshot can only hold
        //   back more, never less; what it cannot see is a message whose
        //   transaction commits after it, and those have no order with the
        //   ones it sees (`oncely::outbox`).
        // - `SKIP LOCKED` (MySQL 8, MariaDB 10.6+) passes over rows another
        //   relay's claim holds right now (it leases them when it commits);
        //   MariaDB 10.5 has none and waits for that claim instead, then
        //   judges the row again as it left it (`claim_wait`): the same
        //   answer, one claim after the other.
        let claim = |lock: &str| {
            format!(
                "{read}SELECT o.id FROM `{o}` AS o \
                 WHERE o.state = 'pending' AND o.due_us <= {NOW_US} \
                   AND (o.lease_expires_us IS NULL OR o.lease_expires_us <= {NOW_US}) \
                   AND NOT EXISTS (SELECT 1 FROM `{o}` AS p WHERE p.ordering_key = o.ordering_key \
                                     AND p.state = 'pending' AND p.id < o.id) \
                 ORDER BY o.id LIMIT ? {lock}"
            )
        };
        // The claim, step 2, on the rows step 1 locked: the lease, on the
        // clock as the write takes effect, and a fence above the row's last
        // one and the clock's microseconds (`oncely::backend::next_fence`),
        // so a fence never repeats. `state = 'pending'` restates what the
        // lock already holds. Parameters: lease µs, then the ids.
        let grant_prefix = format!(
            "UPDATE `{o}` SET fence = GREATEST(fence + 1, {NOW_US}), attempts = attempts + 1, \
             lease_expires_us = {NOW_US} + ? WHERE state = 'pending' AND id IN "
        );
        // The claim, step 3: the granted rows, read back in the claim's own
        // transaction (which sees its writes). Parameters: the ids.
        let granted_prefix = format!("SELECT {COLUMNS} FROM `{o}` WHERE id IN ");
        // Marking several messages sent is a transaction too: lock the ones
        // still pending at their tickets' fences (a causal read on Galera,
        // so a claim committed through another node is seen), then mark
        // exactly those; the lock is what tells which tickets were written.
        // Parameters: (id, fence) per ticket.
        let lock_prefix = format!("{read}SELECT id, fence FROM `{o}` WHERE state = 'pending' AND ");
        let sent_set =
            format!("state = 'sent', sent_us = {NOW_US}, lease_expires_us = NULL, last_error = NULL");
        // Then the write restates the fence of every ticket: it changes
        // exactly the rows the lock found (which no one else can change
        // before this transaction ends).
        let sent_prefix = format!("UPDATE `{o}` SET {sent_set} WHERE state = 'pending' AND ");
        // The fenced writes of one ticket, autocommit on the pool as the
        // ledger's own fenced writes: only a message still pending at the
        // ticket's fence is written, and the guard keeps the write out of a
        // transaction someone else leaked onto the connection. With
        // CLIENT_FOUND_ROWS the affected-row count is the rows matched: 1 is
        // "written". Parameters: the operation's values, id, fence, guard.
        let fenced = |set: &str| {
            format!("UPDATE `{o}` SET {set} WHERE id = ? AND fence = ? AND state = 'pending' AND {guard}")
        };
        let mark_sent = fenced(&sent_set);
        let retry = fenced(&format!(
            "lease_expires_us = NULL, due_us = {NOW_US} + ?, last_error = ?"
        ));
        let fail = fenced("state = 'failed', lease_expires_us = NULL, last_error = ?");
        // After a fenced write matched nothing on a Galera node: is the
        // message pending at that fence after all (a causal read: the
        // node first applies what the cluster committed, such as the claim
        // through another node)? Parameter: id.
        let fenced_state = format!("{read}SELECT state, fence FROM `{o}` WHERE id = ?");
        // Prune, step 1: up to `?` messages sent at least `?` µs ago, oldest
        // first, by a plain read of `sent_idx` (no lock). The cutoff is the
        // statement's start ([`STMT_US`], a constant), which a read that
        // waits on nothing reads as the clock: [`NOW_US`] calls `SYSDATE()`
        // per row, which the optimizer cannot bound an index range with.
        // (MariaDB 10.11 plans a `DELETE … ORDER BY sent_us LIMIT n` as a
        // sort of every sent message, hence two statements.) Parameters:
        // older-than µs, limit.
        let prunable = format!(
            "SELECT id FROM `{o}` WHERE state = 'sent' AND sent_us <= {STMT_US} - ? \
             ORDER BY sent_us LIMIT ?"
        );
        // Prune, step 2: deletes those, restating what made them prunable
        // (a concurrent prune may have deleted some: they count for it),
        // guarded as the fenced writes. Parameters: older-than µs, guard,
        // the ids.
        let prune_prefix = format!(
            "DELETE FROM `{o}` WHERE state = 'sent' AND sent_us <= {STMT_US} - ? AND {guard} AND id IN "
        );
        // The counts, in one read (causal on Galera). `COUNT` of a `CASE`
        // counts the rows it does not make NULL, and is a BIGINT even on an
        // empty table.
        let stats = format!(
            "{read}SELECT \
               COUNT(CASE WHEN state = 'pending' THEN 1 END) AS pending, \
               COUNT(CASE WHEN state = 'pending' AND lease_expires_us > {NOW_US} THEN 1 END) AS claimed, \
               COUNT(CASE WHEN state = 'sent' THEN 1 END) AS sent, \
               COUNT(CASE WHEN state = 'failed' THEN 1 END) AS failed, \
               CAST(MIN(CASE WHEN state = 'pending' THEN enqueued_us END) AS SIGNED) AS oldest_pending \
             FROM `{o}`"
        );
        // `Admin::erase`, in its transaction: the subject's messages, locked
        // (tenant, subject: the key's text after its first ':', which
        // neither a tenant nor a kind holds), then the payload, headers,
        // ordering key and last error of those the relay is done with
        // emptied, by id: exactly the rows the lock read sorted.
        let erase_lock = format!(
            "SELECT id, effect_key, CAST(state AS CHAR) AS state FROM `{o}` \
             WHERE tenant = ? AND SUBSTRING(effect_key, LOCATE(':', effect_key) + 1) = ? FOR UPDATE"
        );
        let erase_prefix = format!(
            "UPDATE `{o}` SET payload = '', headers = '[]', ordering_key = '', last_error = NULL WHERE id IN "
        );
        let (claim_skip, claim_wait) = (claim("FOR UPDATE SKIP LOCKED"), claim("FOR UPDATE"));
        OutboxStatements {
            erase_lock,
            erase_prefix,
            enqueue,
            claim_skip,
            claim_wait,
            grant_prefix,
            granted_prefix,
            lock_prefix,
            sent_prefix,
            mark_sent,
            retry,
            fail,
            fenced_state,
            prunable,
            prune_prefix,
            stats,
        }
    }

    /// Enqueues `message` as the message of `key`: no rows; the OK packet's
    /// `last_insert_id` is the new message's id, 0 when the key names one
    /// already ([`enqueued`]).
    pub(crate) fn bind_enqueue(&self, key: &EffectKey, message: &Message) -> Bound {
        query(&self.enqueue)
            .bind(key.as_str())
            .bind(key.tenant().as_str())
            .bind(message.ordering_key_for(key))
            .bind(message.destination())
            .bind(message.encoded_headers())
            .bind(message.payload())
    }

    /// The claim, step 1: up to `limit` `id` rows, locked; `skip_locked`:
    /// passing over rows locked now (else waiting for them, MariaDB 10.5).
    pub(crate) fn bind_claim(&self, limit: u32, skip_locked: bool) -> Bound {
        let text = if skip_locked {
            &self.claim_skip
        } else {
            &self.claim_wait
        };
        query(text).bind(limit)
    }

    /// The claim, step 2, for `n` ids.
    pub(crate) fn grant(&self, n: usize) -> String {
        format!("{}{}", self.grant_prefix, placeholders(n, "?"))
    }

    /// The claim, step 2: a lease of `lease_us` for each of `ids`. No rows.
    pub(crate) fn bind_grant(&self, lease_us: i64, ids: &[u64]) -> Bound {
        ids.iter()
            .fold(query(&self.grant(ids.len())).bind(lease_us), |q, id| q.bind(*id))
    }

    /// The claim, step 3, for `n` ids.
    pub(crate) fn granted(&self, n: usize) -> String {
        format!("{}{} ORDER BY id", self.granted_prefix, placeholders(n, "?"))
    }

    /// The claim, step 3: a [`pending`] row per granted id, in id order.
    pub(crate) fn bind_granted(&self, ids: &[u64]) -> Bound {
        ids.iter()
            .fold(query(&self.granted(ids.len())), |q, id| q.bind(*id))
    }

    /// `(id, fence)` of `n` tickets, OR'ed: one point of the primary key each.
    fn tickets(n: usize) -> String {
        format!("({})", vec!["(id = ? AND fence = ?)"; n.max(1)].join(" OR "))
    }

    /// Marking several sent, step 1, for `n` tickets.
    pub(crate) fn lock_tickets(&self, n: usize) -> String {
        format!("{}{} FOR UPDATE", self.lock_prefix, Self::tickets(n))
    }

    /// Marking several sent, step 1: an `id`, `fence` row per ticket whose
    /// message is pending at its fence, locked.
    pub(crate) fn bind_lock_tickets(&self, tickets: &[Ticket]) -> Bound {
        tickets
            .iter()
            .fold(query(&self.lock_tickets(tickets.len())), |q, t| {
                q.bind(t.id).bind(t.fence)
            })
    }

    /// Marking several sent, step 2, for `n` tickets.
    pub(crate) fn sent(&self, n: usize) -> String {
        format!("{}{}", self.sent_prefix, Self::tickets(n))
    }

    /// Marking several sent, step 2: the messages of `tickets` still
    /// pending at their fences (the ones step 1 locked) sent. No rows.
    pub(crate) fn bind_sent(&self, tickets: &[Ticket]) -> Bound {
        tickets.iter().fold(query(&self.sent(tickets.len())), |q, t| {
            q.bind(t.id).bind(t.fence)
        })
    }

    /// Marks one message sent, fenced on `ticket`: no rows, 1 row matched
    /// when written.
    pub(crate) fn bind_mark_sent(&self, ticket: Ticket) -> Bound {
        query(&self.mark_sent)
            .bind(ticket.id)
            .bind(ticket.fence)
            .bind(false)
    }

    /// Gives a message back until `delay` from now, recording `error`,
    /// fenced on `ticket`: as [`OutboxStatements::bind_mark_sent`].
    pub(crate) fn bind_retry(&self, ticket: Ticket, delay_us: i64, error: &str) -> Bound {
        query(&self.retry)
            .bind(delay_us)
            .bind(clip(error))
            .bind(ticket.id)
            .bind(ticket.fence)
            .bind(false)
    }

    /// Gives a message up, recording `error`, fenced on `ticket`: as
    /// [`OutboxStatements::bind_mark_sent`].
    pub(crate) fn bind_fail(&self, ticket: Ticket, error: &str) -> Bound {
        query(&self.fail)
            .bind(clip(error))
            .bind(ticket.id)
            .bind(ticket.fence)
            .bind(false)
    }

    /// The message `id`'s state and fence, causal on Galera: a
    /// [`FencedState`] row, or none.
    pub(crate) fn bind_fenced_state(&self, id: u64) -> Bound {
        query(&self.fenced_state).bind(id)
    }

    /// Prune, step 1: an `id` row per message sent at least
    /// `older_than_us` ago, at most `limit`, oldest first.
    pub(crate) fn bind_prunable(&self, older_than_us: i64, limit: u64) -> Bound {
        query(&self.prunable).bind(older_than_us).bind(limit)
    }

    /// Prune, step 2, for `n` ids.
    pub(crate) fn prune(&self, n: usize) -> String {
        format!("{}{}", self.prune_prefix, placeholders(n, "?"))
    }

    /// Prune, step 2: deletes `ids` (found by step 1). No rows; the
    /// affected-row count is how many.
    pub(crate) fn bind_prune(&self, older_than_us: i64, ids: &[u64]) -> Bound {
        ids.iter().fold(
            query(&self.prune(ids.len())).bind(older_than_us).bind(false),
            |q, id| q.bind(*id),
        )
    }

    /// The counts: one row ([`stats`]).
    pub(crate) fn bind_stats(&self) -> Bound {
        query(&self.stats)
    }

    /// `Admin::erase`, outbox step 1: `tenant`'s messages of `subject`,
    /// locked (rows for [`erase_messages`]).
    pub(crate) fn bind_erase_lock(&self, tenant: &oncely::Tenant, subject: &str) -> Bound {
        query(&self.erase_lock)
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// `Admin::erase`, outbox step 2, for `n` ids.
    fn erase(&self, n: usize) -> String {
        format!("{}{}", self.erase_prefix, placeholders(n, "?"))
    }

    /// `Admin::erase`, outbox step 2: the messages `ids` emptied. No rows.
    pub(crate) fn bind_erase(&self, ids: &[u64]) -> Bound {
        ids.iter()
            .fold(query(&self.erase(ids.len())), |q, id| q.bind(*id))
    }
}

/// Sorts the locked rows of the outbox step of `Admin::erase` into
/// `erasure` ([`oncely::admin::Erasure::add_message`]); returns the ids to
/// empty.
pub(crate) fn erase_messages(
    erasure: &mut oncely::admin::Erasure,
    rows: &[MySqlRow],
    subject: &str,
) -> Result<Vec<u64>> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable outbox erase row: {e}"));
    let read = |row: &MySqlRow| {
        Ok((
            row.try_get("id").map_err(g)?,
            row.try_get("effect_key").map_err(g)?,
            row.try_get("state").map_err(g)?,
        ))
    };
    erasure.add_messages(rows.iter().map(read), subject)
}

/// Deletes every message of `<t>_outbox`: the tests' fresh start.
#[cfg(test)]
pub(crate) fn empty_outbox(t: &str) -> String {
    format!("DELETE FROM `{}`", outbox_table(t))
}

/// `error`, cut to at most [`MAX_ERROR_BYTES`] at a character boundary.
fn clip(error: &str) -> String {
    let mut end = error.len().min(MAX_ERROR_BYTES);
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    error[..end].to_owned()
}

/// What an enqueue did, from its OK packet's `last_insert_id`.
pub(crate) fn enqueued(last_insert_id: u64) -> Enqueued {
    match last_insert_id {
        0 => Enqueued::Already,
        id => Enqueued::New(id),
    }
}

fn unreadable(e: sqlx::Error) -> oncely::Error {
    corrupt(format!("unreadable outbox row: {e}"))
}

/// The `id` of a row of the claim's step 1, or of prune's.
pub(crate) fn id(row: &MySqlRow) -> Result<u64> {
    row.try_get("id").map_err(unreadable)
}

/// The ticket a row of the lock of tickets names (`id`, `fence`).
pub(crate) fn locked(row: &MySqlRow) -> Result<Ticket> {
    Ok(Ticket {
        id: row.try_get("id").map_err(unreadable)?,
        fence: row.try_get("fence").map_err(unreadable)?,
    })
}

/// A claimed message, from a row of the claim's step 3.
pub(crate) fn pending(row: &MySqlRow) -> Result<Pending> {
    let key: String = row.try_get("effect_key").map_err(unreadable)?;
    let key = EffectKey::parse(&key).map_err(|e| corrupt(format!("outbox key {key:?}: {e}")))?;
    let headers: String = row.try_get("headers").map_err(unreadable)?;
    let lease: Option<i64> = row.try_get("lease_expires_us").map_err(unreadable)?;
    Ok(Pending {
        id: row.try_get("id").map_err(unreadable)?,
        key,
        ordering_key: row.try_get("ordering_key").map_err(unreadable)?,
        destination: row.try_get("destination").map_err(unreadable)?,
        headers: decode_headers(BACKEND, &headers)?,
        payload: row.try_get("payload").map_err(unreadable)?,
        attempts: row.try_get("attempts").map_err(unreadable)?,
        fence: row.try_get("fence").map_err(unreadable)?,
        enqueued_at: from_micros(row.try_get("enqueued_us").map_err(unreadable)?),
        lease_expires_at: from_micros(lease.ok_or_else(|| corrupt("a claimed message without a lease"))?),
    })
}

/// A row of [`OutboxStatements::bind_fenced_state`].
#[derive(Debug)]
pub(crate) struct FencedState {
    pub state: String,
    pub fence: u64,
}

impl FencedState {
    /// Reads a row by column name.
    pub(crate) fn read(row: &MySqlRow) -> Result<Self> {
        Ok(FencedState {
            state: row.try_get("state").map_err(unreadable)?,
            fence: row.try_get("fence").map_err(unreadable)?,
        })
    }

    /// Whether the message is pending at `ticket`'s fence.
    pub(crate) fn held_by(&self, ticket: Ticket) -> bool {
        self.state == "pending" && self.fence == ticket.fence
    }
}

/// The counts, from the row of [`OutboxStatements::bind_stats`].
pub(crate) fn stats(row: &MySqlRow) -> Result<OutboxStats> {
    let count = |c: &str| {
        row.try_get::<i64, _>(c)
            .map(|n| u64::try_from(n).unwrap_or(0))
            .map_err(unreadable)
    };
    let oldest: Option<i64> = row.try_get("oldest_pending").map_err(unreadable)?;
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
    use super::*;

    #[test]
    fn errors_are_cut_at_a_character_boundary() {
        assert_eq!(clip("broker down"), "broker down");
        let long = "é".repeat(MAX_ERROR_BYTES);
        let cut = clip(&long);
        assert!(cut.len() <= MAX_ERROR_BYTES && cut.len() >= MAX_ERROR_BYTES - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }

    #[test]
    fn each_statement_has_one_placeholder_per_value() {
        let s = OutboxStatements::new("t", "(? OR @@in_transaction = 0)", "");
        assert_eq!(s.enqueue.matches('?').count(), 6);
        assert_eq!(s.claim_skip.matches('?').count(), 1);
        assert!(s.claim_skip.ends_with("FOR UPDATE SKIP LOCKED"));
        assert!(s.claim_wait.ends_with("LIMIT ? FOR UPDATE"));
        assert_eq!(s.mark_sent.matches('?').count(), 3);
        assert_eq!(s.retry.matches('?').count(), 5);
        assert_eq!(s.fail.matches('?').count(), 4);
        assert_eq!(s.prunable.matches('?').count(), 2);
        assert_eq!(s.prune(3).matches('?').count(), 2 + 3);
        assert_eq!(s.grant(3).matches('?').count(), 1 + 3);
        assert_eq!(s.granted(3).matches('?').count(), 3);
        assert_eq!(s.lock_tickets(2).matches('?').count(), 4);
        assert_eq!(s.sent(2).matches('?').count(), 4);
    }
}
