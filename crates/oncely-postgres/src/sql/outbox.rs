//! The transactional outbox's statements (`<table>_outbox`, schema version
//! 6) and what their rows say: enqueue in the caller's transaction, and the
//! relay's claim, marks, retry, failure, prune and counts
//! (`oncely::outbox`).

use std::sync::Arc;
use std::time::Duration;

use oncely::admin::Erasure;
use oncely::backend::{duration_micros, from_micros};
use oncely::outbox::{Enqueued, Message, OutboxStats, Pending, Ticket, decode_headers};
use oncely::{EffectKey, Result};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use super::decode::{get, micros, micros_opt, unsigned};
use super::{Bound, guard, micros as interval, quote, us};
use crate::error::{BACKEND, corrupt};

/// The outbox's statements, built once per ledger.
#[derive(Debug)]
pub(crate) struct OutboxQueries {
    enqueue: Arc<str>,
    claim: Arc<str>,
    mark_sent: Arc<str>,
    retry: Arc<str>,
    fail: Arc<str>,
    prune: Arc<str>,
    stats: Arc<str>,
    erase_lock: Arc<str>,
    erase: Arc<str>,
    /// `schema.<table>_outbox`'s name, for the schema check.
    pub(crate) table: String,
}

/// The outbox table and its indexes (schema version 6), on `schema.table`
/// (`<ledger table>_outbox`). Frozen with that migration.
///
/// - `id`: the order messages were enqueued in (an identity column: values
///   are handed out at insert, so two transactions enqueuing at once may
///   commit in the other order; the relay's per-key order is the ids').
/// - `key`: the effect key that names the message, unique: a second enqueue
///   of it writes nothing.
/// - `state`: `pending` until the relay marks it `sent`, or `failed` once it
///   gives up; `fence`, `lease_expires_at`: the relay's claim; `due_at`: when
///   it may be claimed (a retry's back-off); `attempts`: claims so far.
/// - The partial index on `(ordering_key, id)` of pending messages serves
///   the claim's "oldest unsent of its ordering key" test; the one on
///   `sent_at` of sent messages serves prune.
pub(super) fn migration(schema: &str, table: &str) -> String {
    let o = format!("{}.{}", quote(schema), quote(&format!("{table}_outbox")));
    let idx = |suffix: &str| quote(&format!("{table}_outbox_{suffix}"));
    format!(
        "CREATE TABLE IF NOT EXISTS {o} (\
           id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
           key text NOT NULL UNIQUE CHECK (octet_length(key) <= 255), \
           tenant text NOT NULL, \
           ordering_key text NOT NULL CHECK (octet_length(ordering_key) <= 255), \
           destination text NOT NULL CHECK (octet_length(destination) <= 255), \
           headers text NOT NULL, \
           payload bytea NOT NULL, \
           state text NOT NULL CHECK (state IN ('pending', 'sent', 'failed')), \
           attempts integer NOT NULL DEFAULT 0, \
           fence bigint NOT NULL DEFAULT 0, \
           lease_expires_at timestamptz, \
           due_at timestamptz NOT NULL, \
           enqueued_at timestamptz NOT NULL, \
           sent_at timestamptz, \
           last_error text\
         ); \
         CREATE INDEX IF NOT EXISTS {pending} ON {o} (ordering_key, id) WHERE state = 'pending'; \
         CREATE INDEX IF NOT EXISTS {sent} ON {o} (sent_at) WHERE state = 'sent';",
        pending = idx("pending_idx"),
        sent = idx("sent_idx"),
    )
}

impl OutboxQueries {
    pub(super) fn new(schema: &str, table: &str) -> Self {
        let name = format!("{table}_outbox");
        let o = format!("{}.{}", quote(schema), quote(&name));
        let columns = "o.id, o.key, o.ordering_key, o.destination, o.headers, o.payload, o.attempts, \
                       o.fence, o.enqueued_at, o.lease_expires_at";
        // Enqueue, in the caller's transaction (no guard: being inside a
        // transaction is the point). $1 key, $2 tenant, $3 ordering key, $4
        // destination, $5 headers, $6 payload. The unique key makes a second
        // enqueue of one effect write nothing (`ON CONFLICT DO NOTHING`): in
        // the same transaction, or after another one committed it; if
        // another transaction holds it uncommitted, this one waits for it
        // and then writes nothing, or its row if that one rolled back.
        let enqueue = format!(
            "INSERT INTO {o} (key, tenant, ordering_key, destination, headers, payload, state, due_at, enqueued_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 'pending', clock_timestamp(), clock_timestamp()) \
             ON CONFLICT (key) DO NOTHING RETURNING id"
        );
        // The relay's claim: $1 the most messages, $2 the lease (µs), $3
        // the guard flag.
        // - `c`: pending messages that are due and not held under a live
        //   lease, each the oldest pending message of its ordering key (an
        //   older one, claimed or not, holds it back until it is sent or
        //   failed), oldest first; locked, skipping rows another relay's
        //   claim is locking right now (it holds them once it commits).
        //   FOR UPDATE re-checks the conditions on the row's latest version
        //   after any wait.
        // - `u` grants the lease, on the clock read as it writes, and a
        //   fence above the row's last one and the clock's microseconds
        //   (`oncely::backend::next_fence`), so a fence never repeats.
        // One row per claimed message, or one row of NULLs with the guard.
        let claim = format!(
            "WITH g AS (SELECT {guard} AS ok OFFSET 0), \
             c AS (SELECT o.id FROM {o} o \
               WHERE (SELECT g.ok FROM g) AND o.state = 'pending' AND o.due_at <= clock_timestamp() \
                 AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= clock_timestamp()) \
                 AND NOT EXISTS (SELECT 1 FROM {o} p WHERE p.ordering_key = o.ordering_key \
                                   AND p.state = 'pending' AND p.id < o.id) \
               ORDER BY o.id LIMIT $1 FOR UPDATE OF o SKIP LOCKED), \
             u AS (UPDATE {o} o SET fence = greatest(o.fence + 1, {now_us}), attempts = o.attempts + 1, \
                     lease_expires_at = clock_timestamp() + {lease} \
                   FROM c WHERE o.id = c.id \
                   RETURNING {columns}) \
             SELECT g.ok, u.* FROM g LEFT JOIN u ON true ORDER BY u.id",
            guard = guard("$3"),
            now_us = us("clock_timestamp()"),
            lease = interval("$2"),
        );
        // Fenced writes on claimed messages: $1 ids, $2 fences (arrays, one
        // element per ticket) or one id and fence, then the operation's own
        // values, the guard flag last. Each writes only a message still
        // pending at the ticket's fence, and returns the ids it wrote; the
        // guard comes back in every row (one row of NULLs when none wrote).
        let fenced = |set: &str, one: bool, guard_param: &str| {
            let target = if one {
                "o.id = $1 AND o.fence = $2".to_owned()
            } else {
                "(o.id, o.fence) IN (SELECT * FROM unnest($1::bigint[], $2::bigint[]))".to_owned()
            };
            format!(
                "WITH g AS (SELECT {guard} AS ok OFFSET 0), \
                 w AS (UPDATE {o} o SET {set} \
                   WHERE {target} AND o.state = 'pending' AND (SELECT g.ok FROM g) RETURNING o.id) \
                 SELECT g.ok, w.id FROM g LEFT JOIN w ON true",
                guard = guard(guard_param),
            )
        };
        let mark_sent = fenced(
            "state = 'sent', sent_at = clock_timestamp(), lease_expires_at = NULL, last_error = NULL",
            false,
            "$3",
        );
        let retry = fenced(
            &format!(
                "lease_expires_at = NULL, due_at = clock_timestamp() + {}, last_error = $4",
                interval("$3")
            ),
            true,
            "$5",
        );
        let fail = fenced(
            "state = 'failed', lease_expires_at = NULL, last_error = $3",
            true,
            "$4",
        );
        // Prune: up to $2 messages sent at least $1 µs ago, oldest first (the
        // sent index), skipping rows locked now.
        let prune = format!(
            "WITH g AS (SELECT {guard} AS ok OFFSET 0), \
             c AS (SELECT o.id FROM {o} o WHERE (SELECT g.ok FROM g) AND o.state = 'sent' \
                     AND o.sent_at <= clock_timestamp() - {older} \
                   ORDER BY o.sent_at LIMIT $2 FOR UPDATE SKIP LOCKED), \
             d AS (DELETE FROM {o} o USING c WHERE o.id = c.id RETURNING 1) \
             SELECT g.ok, (SELECT count(*) FROM d) AS deleted FROM g",
            guard = guard("$3"),
            older = interval("$1"),
        );
        let stats = format!(
            "SELECT g.ok, \
               count(*) FILTER (WHERE o.state = 'pending') AS pending, \
               count(*) FILTER (WHERE o.state = 'pending' AND o.lease_expires_at > clock_timestamp()) AS claimed, \
               count(*) FILTER (WHERE o.state = 'sent') AS sent, \
               count(*) FILTER (WHERE o.state = 'failed') AS failed, \
               min(o.enqueued_at) FILTER (WHERE o.state = 'pending') AS oldest_pending \
             FROM (SELECT {guard} AS ok OFFSET 0) g LEFT JOIN {o} o ON g.ok GROUP BY g.ok",
            guard = guard("true"),
        );
        // `Admin::erase`, in its transaction: the subject's messages, locked
        // (`$1` tenant, `$2` subject: the key's text after its first ':',
        // which neither a tenant nor a kind holds), then the payload,
        // headers, ordering key and last error of those the relay is done
        // with emptied, by id (`$1`): exactly the rows the lock read sorted.
        let erase_lock = format!(
            "SELECT o.id, o.key, o.state FROM {o} o \
             WHERE o.tenant = $1 AND substr(o.key, strpos(o.key, ':') + 1) = $2 FOR UPDATE"
        );
        let erase = format!(
            "UPDATE {o} SET payload = ''::bytea, headers = '[]', ordering_key = '', last_error = NULL \
             WHERE id = ANY($1)"
        );
        OutboxQueries {
            erase_lock: erase_lock.into(),
            erase: erase.into(),
            enqueue: enqueue.into(),
            claim: claim.into(),
            mark_sent: mark_sent.into(),
            retry: retry.into(),
            fail: fail.into(),
            prune: prune.into(),
            stats: stats.into(),
            table: name,
        }
    }

    /// Enqueues `message` as the message of `key`: a row with its `id`, or
    /// none when the key names a message already.
    pub(crate) fn bind_enqueue(&self, key: &EffectKey, message: &Message) -> Bound {
        sqlx::query(AssertSqlSafe(self.enqueue.clone()))
            .bind(key.as_str())
            .bind(key.tenant().as_str())
            .bind(message.ordering_key_for(key))
            .bind(message.destination())
            .bind(message.encoded_headers())
            .bind(message.payload())
    }

    pub(crate) fn bind_claim(&self, limit: u32, lease: Duration) -> Bound {
        sqlx::query(AssertSqlSafe(self.claim.clone()))
            .bind(i64::from(limit))
            .bind(duration_micros(lease))
            .bind(true)
    }

    pub(crate) fn bind_mark_sent(&self, tickets: &[Ticket]) -> Bound {
        let (ids, fences) = ticket_columns(tickets);
        sqlx::query(AssertSqlSafe(self.mark_sent.clone()))
            .bind(ids)
            .bind(fences)
            .bind(true)
    }

    pub(crate) fn bind_retry(&self, ticket: Ticket, delay: Duration, error: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.retry.clone()))
            .bind(signed(ticket.id))
            .bind(signed(ticket.fence))
            .bind(duration_micros(delay))
            .bind(error.to_owned())
            .bind(true)
    }

    pub(crate) fn bind_fail(&self, ticket: Ticket, error: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.fail.clone()))
            .bind(signed(ticket.id))
            .bind(signed(ticket.fence))
            .bind(error.to_owned())
            .bind(true)
    }

    pub(crate) fn bind_prune(&self, older_than: Duration, limit: u32) -> Bound {
        sqlx::query(AssertSqlSafe(self.prune.clone()))
            .bind(duration_micros(older_than))
            .bind(i64::from(limit))
            .bind(true)
    }

    pub(crate) fn bind_stats(&self) -> Bound {
        sqlx::query(AssertSqlSafe(self.stats.clone()))
    }

    /// `Admin::erase`, outbox step 1: `tenant`'s messages of `subject`, locked.
    pub(crate) fn bind_erase_lock(&self, tenant: &oncely::Tenant, subject: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.erase_lock.clone()))
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// `Admin::erase`, outbox step 2: the messages `ids` emptied.
    pub(crate) fn bind_erase(&self, ids: Vec<i64>) -> Bound {
        sqlx::query(AssertSqlSafe(self.erase.clone())).bind(ids)
    }
}

/// Sorts the locked rows of the outbox step of `Admin::erase` into
/// `erasure` ([`Erasure::add_message`]); returns the ids to empty.
pub(crate) fn erase_messages(erasure: &mut Erasure, rows: &[PgRow], subject: &str) -> Result<Vec<i64>> {
    let read = |row: &PgRow| Ok((get(row, "id")?, get(row, "key")?, get(row, "state")?));
    erasure.add_messages(rows.iter().map(read), subject)
}

/// Ids and fences are `u64` in the API and `bigint` in the table; a value
/// above `i64::MAX` names no row (none is ever stored), so it is sent as -1.
fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(-1)
}

fn ticket_columns(tickets: &[Ticket]) -> (Vec<i64>, Vec<i64>) {
    tickets.iter().map(|t| (signed(t.id), signed(t.fence))).unzip()
}

/// What an enqueue did: its row's id, or nothing.
pub(crate) fn enqueued(row: Option<&PgRow>) -> Result<Enqueued> {
    match row {
        Some(row) => Ok(Enqueued::New(unsigned(row, "id", |n| format!("outbox id {n}"))?)),
        None => Ok(Enqueued::Already),
    }
}

/// A claimed message; `None` for the claim's row of NULLs (nothing claimed).
pub(crate) fn pending(row: &PgRow) -> Result<Option<Pending>> {
    let Some(id) = get::<Option<i64>>(row, "id")? else {
        return Ok(None);
    };
    let key: String = get(row, "key")?;
    let key = EffectKey::parse(&key).map_err(|e| corrupt(format!("outbox key {key:?}: {e}")))?;
    let headers: String = get(row, "headers")?;
    let attempts: i32 = get(row, "attempts")?;
    Ok(Some(Pending {
        id: u64::try_from(id).map_err(|_| corrupt(format!("outbox id {id}")))?,
        key,
        ordering_key: get(row, "ordering_key")?,
        destination: get(row, "destination")?,
        headers: decode_headers(BACKEND, &headers)?,
        payload: get(row, "payload")?,
        attempts: u32::try_from(attempts).unwrap_or(0),
        fence: unsigned(row, "fence", |f| format!("outbox fence {f}"))?,
        enqueued_at: from_micros(micros(row, "enqueued_at")?),
        lease_expires_at: from_micros(
            micros_opt(row, "lease_expires_at")?
                .ok_or_else(|| corrupt("a claimed message without a lease"))?,
        ),
    }))
}

/// The id a fenced write wrote, if any.
pub(crate) fn written_id(row: &PgRow) -> Result<Option<u64>> {
    Ok(get::<Option<i64>>(row, "id")?.and_then(|id| u64::try_from(id).ok()))
}

/// How many messages a prune deleted.
pub(crate) fn pruned(row: &PgRow) -> Result<u64> {
    Ok(u64::try_from(get::<i64>(row, "deleted")?).unwrap_or(0))
}

/// The counts of an outbox.
pub(crate) fn stats(row: &PgRow) -> Result<OutboxStats> {
    let count = |c| get::<i64>(row, c).map(|n| u64::try_from(n).unwrap_or(0));
    Ok(OutboxStats {
        pending: count("pending")?,
        claimed: count("claimed")?,
        sent: count("sent")?,
        failed: count("failed")?,
        oldest_pending: micros_opt(row, "oldest_pending")?.map(from_micros),
    })
}
