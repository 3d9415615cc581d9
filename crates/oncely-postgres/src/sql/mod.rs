//! Every SQL statement of the backend, built once per ledger from the
//! validated (and quoted) schema and table names ([`Queries::new`], here).
//! The function that binds each statement and the row type that decodes
//! what it returns (every column read by the name given here, never by
//! position) sit together, one module per concern: [`claim`],
//! [`record`](mod@record) (`get`, `abandoned`), [`write`](mod@write) (the
//! fenced writes), [`prune`] (and the horizon), [`admin`] (the operator's
//! statements, whose listings are also built there); [`decode`] holds the
//! column readers they share.
//!
//! Architecture invariant: no other module contains SQL.
//!
//! The clock: every write reads `clock_timestamp()`, the server's clock at
//! the moment the expression is evaluated, never `now()` (the start of the
//! transaction: inside a caller's transaction that can be long ago, and even
//! in autocommit it is read before any wait on a lock). Only prune's
//! candidate search uses `now()`, where reading the clock early can only
//! delete later, never earlier.

use std::sync::Arc;

use sqlx::Postgres;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;

mod admin;
mod claim;
mod decode;
mod outbox;
mod prune;
mod record;
mod write;

pub(crate) use admin::{Arg, CLOCK_NOW, bind_listing, clock_now, erasure, kind_stats, records, stats};
pub(crate) use claim::{ClaimRow, claim_leaked, claimed_key, own_lease};
pub(crate) use outbox::{
    OutboxQueries, enqueued, erase_messages, pending, pruned, stats as outbox_stats, written_id,
};
pub(crate) use prune::{prune_counts, watermark};
pub(crate) use record::{RecordRow, has_record, key};
pub(crate) use write::{completed, guard_ok, watched, written};

/// A timestamp as microseconds since the Unix epoch (`extract` is exact
/// `numeric` since PostgreSQL 14), for fences, the horizon and the renewed
/// expiry.
fn us(expr: &str) -> String {
    format!("(extract(epoch from {expr}) * 1000000)::bigint")
}

/// A `bigint` parameter of microseconds as an interval.
fn micros(p: &str) -> String {
    format!("{p}::bigint * interval '1 microsecond'")
}

/// The value a claim writes as `claim_token`: its call's token (`$p`, 16
/// bytes) followed by the writing transaction's id as the row's `xmin`
/// will show it (its low 32 bits, as 8 bytes). The id ties the token to this
/// very version of the row: a process of the previous release that takes
/// the row over rewrites it without touching the token, and the row's
/// `xmin` then names that process's transaction, so the token no longer
/// matches ([`own`]). Evaluated only for rows a claim writes, which have a
/// transaction id anyway. (The row's `xmin` is the top-level transaction's
/// id in autocommit, where tokens are resolved; a `claim_in` inside a
/// savepoint writes one that never matches, and is never resolved.)
fn token_written(p: &str) -> String {
    format!("({p}::bytea || int8send(pg_current_xact_id()::text::bigint % 4294967296))")
}

/// Whether row `e` (of `cur`, which carries each row's `xmin` as
/// `row_xmin`) carries the claim call's token `$p`, written by the
/// transaction that wrote this version of the row ([`token_written`]).
fn own(e: &str, p: &str) -> String {
    format!("coalesce({e}.claim_token = ({p}::bytea || int8send({e}.row_xmin::text::bigint)), false)")
}

/// The leaked-transaction guard (see the crate docs): true when this statement
/// runs in its own implicit transaction.
///
/// A statement sent with parameters runs in the unnamed protocol portal
/// (`''`), created when its Bind message arrived; in autocommit the implicit
/// transaction starts at that same message, with the very same timestamp. A
/// transaction left open by someone else started earlier, at its `BEGIN`.
/// (The simple protocol's portal is not listed in `pg_cursors`: there the
/// check fails closed.)
///
/// `transaction_timestamp() = statement_timestamp()` is NOT a usable test: the
/// Execute message resets `statement_timestamp()`, so under the extended
/// protocol (sqlx) it is false even in autocommit.
///
/// `$n` is a boolean parameter: false inside a caller's transaction
/// (`claim_in`), where running in a transaction is the point.
fn guard(param: &str) -> String {
    format!(
        "(NOT {param}::boolean OR coalesce((SELECT c.creation_time = transaction_timestamp() \
         FROM pg_catalog.pg_cursors c WHERE c.name = ''), false))"
    )
}

/// The record columns every read returns, named as [`RecordRow`] reads
/// them, ending with the clock the record was read at (`now`). Timestamps
/// travel as binary `timestamptz` (see `decode::Micros`).
fn cols(a: &str) -> String {
    format!(
        "{a}.state AS state, {a}.fence AS fence, {a}.fingerprint AS fingerprint, {a}.outcome AS outcome, \
         {a}.at_most_once AS at_most_once, {a}.created_at AS created_at, {a}.updated_at AS updated_at, \
         {a}.lease_expires_at AS lease_expires_at, {a}.retain_until AS retain_until, clock_timestamp() AS now"
    )
}

/// Double-quotes an identifier that [`crate::PgLedgerOptions`] validated
/// (lowercase ASCII letters, digits and `_`), so it can never be anything
/// but a name.
pub(crate) fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// The seed of the per-key advisory locks of one ledger: a stable hash
/// (64-bit FNV-1a, the same in every process and release) of its schema and
/// table, so that two ledgers in one database do not wait on each other's
/// keys. Advisory lock ids are database-wide.
fn lock_seed(schema: &str, table: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in schema.bytes().chain([b'.']).chain(table.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    i64::from_ne_bytes(h.to_ne_bytes())
}

/// The `LISTEN`/`NOTIFY` channel of one ledger: its table's name and 32 bits
/// of the hash that seeds its advisory locks (of the schema and the table),
/// so two ledgers in one database do not wake each other's waiters (a
/// collision would cost a spurious wake-up, never a wrong answer). At most
/// 48 + 9 bytes, within PostgreSQL's 63-byte limit on channel names; only
/// lowercase letters, digits and `_`, so it needs no quoting in a literal.
pub(crate) fn channel(schema: &str, table: &str) -> String {
    let h = u64::from_ne_bytes(lock_seed(schema, table).to_ne_bytes());
    format!("{table}_{:08x}", h >> 32)
}

/// The record columns a claim reads (`cur` in the claim statement), in the
/// order the `_current` function of schema version 5 returns them, which
/// adds `row_xmin` (`xmin`) after them. Frozen with that migration.
const FOUND_COLUMNS: [&str; 11] = [
    "key",
    "state",
    "fence",
    "fingerprint",
    "outcome",
    "at_most_once",
    "created_at",
    "updated_at",
    "lease_expires_at",
    "retain_until",
    "claim_token",
];

/// The current schema version: the last of [`Queries::migrations`].
pub(crate) const SCHEMA_VERSION: i32 = 6;

/// The statements of one ledger (one schema and table).
#[derive(Debug)]
pub(crate) struct Queries {
    pub claim: Arc<str>,
    pub claim_horizon: Arc<str>,
    pub claim_many: Arc<str>,
    pub claim_many_horizon: Arc<str>,
    /// The four claims above with `synchronous_commit = off` for their own
    /// transaction ([`ClaimOptions::relaxed_claim`](oncely::ClaimOptions)),
    /// in the same order.
    pub claim_relaxed: [Arc<str>; 4],
    pub complete: Arc<str>,
    pub complete_in: Arc<str>,
    pub complete_many: Arc<str>,
    pub release: Arc<str>,
    pub renew: Arc<str>,
    /// A waiter's mark (`$1` key, `$2` guard flag): see the statement.
    pub watch_mark: Arc<str>,
    pub probe: Arc<str>,
    pub get: Arc<str>,
    pub prune: Arc<str>,
    pub abandoned: Arc<str>,
    /// `Admin::forget` (`$1` key, `$2` fence, `$3` guard flag).
    pub forget: Arc<str>,
    /// `Admin::erase`, step 1 (`$1` tenant, `$2` subject): the subject's
    /// records, locked (`key`, `state`, `now`).
    pub erase_lock: Arc<str>,
    /// `Admin::erase`, step 2 (`$1` tenant, `$2` subject).
    pub erase: Arc<str>,
    /// `Admin::replace_outcome` (`$1` key, `$2` fence, `$3` expected, `$4`
    /// new): a row when it wrote.
    pub replace_outcome: Arc<str>,
    /// `Admin::prunable`: how many records prune would delete now.
    pub prunable: Arc<str>,
    pub horizon: Arc<str>,
    pub schema_exists: Arc<str>,
    pub create_schema: Arc<str>,
    pub create_migrations: Arc<str>,
    pub applied_version: Arc<str>,
    pub record_migration: Arc<str>,
    pub migrations: Vec<(i32, &'static str, Arc<str>)>,
    /// The names the schema check reports (`schema.table`).
    pub horizon_table: String,
    pub beyond_function: String,
    /// The claim's fresh-snapshot read (`<table>_current`, version 5).
    pub current_function: String,
    /// The `LISTEN`/`NOTIFY` channel of this ledger ([`channel`]).
    pub channel: Arc<str>,
    /// The transactional outbox's statements (`<table>_outbox`).
    pub outbox: OutboxQueries,
}

/// A statement with its binds, ready to run on a connection.
pub(crate) type Bound = Query<'static, Postgres, PgArguments>;

impl Queries {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = format!("{}.{}", quote(schema), quote(table));
        let migrations_table = format!("{}.{}", quote(schema), quote(&format!("{table}_migrations")));
        let horizon_name = format!("{table}_horizon");
        let h = format!("{}.{}", quote(schema), quote(&horizon_name));
        let beyond_name = format!("{table}_beyond");
        let beyond = format!("{}.{}", quote(schema), quote(&beyond_name));
        let current_name = format!("{table}_current");
        let current = format!("{}.{}", quote(schema), quote(&current_name));
        let channel = channel(schema, table);
        // The per-key lock every claim takes before it reads the clock, and
        // prune tries before it deletes.
        let key_lock =
            |f: &str, key: &str| format!("{f}(hashtextextended({key}, {}))", lock_seed(schema, table));

        // A claim takes the record over when it was released, or when its
        // lease ran out and the step is not at-most-once; never on a
        // fingerprint mismatch. The condition is evaluated by the UPDATE on
        // the row's latest version (re-checked after any row lock it waited
        // on), and the clock is read there; the fence is above the previous
        // one and the clock's microseconds (oncely::backend::next_fence), so
        // it never repeats, even after the record is pruned and inserted
        // again.
        let takeover_set = format!(
            "state = 'in_progress', fence = greatest(e.fence + 1, {now_us}), at_most_once = $6, \
             outcome = NULL, fingerprint = coalesce(e.fingerprint, $5), \
             lease_expires_at = clock_timestamp() + {lease}, updated_at = clock_timestamp(), \
             retain_until = clock_timestamp() + {ret}, retention_us = $8, claim_token = {token}",
            now_us = us("clock_timestamp()"),
            lease = micros("$7"),
            ret = micros("$8"),
            token = token_written("$10"),
        );
        let takeover_when = "(e.fingerprint IS NULL OR $5::bytea IS NULL OR e.fingerprint = $5::bytea) \
             AND (e.state = 'released' OR (e.state = 'in_progress' AND NOT e.at_most_once \
             AND e.lease_expires_at <= clock_timestamp()))";

        // One statement, one round trip, for one key or a batch. Parameters:
        // $1 key, $2 tenant, $3 kind, $4 subject (a batch: four arrays, one
        // element per distinct key), $5 fingerprint, $6 at_most_once, $7
        // lease µs, $8 retention µs, $9 guard on, $10 the claim call's token
        // (`token.rs`), and in the horizon variant $11 sent_at µs.
        //
        // - `i`: the keys claimed (the batch unnests its arrays).
        // - `g` takes the keys' transaction-scoped advisory locks (a batch:
        //   in the order of their lock ids, so two overlapping batches take
        //   their common keys in the same order and never deadlock), THEN
        //   reads the clock. PostgreSQL computes an inserted row's values
        //   before the INSERT waits on the unique index, so without the lock
        //   a claim that waited on another transaction's uncommitted claim
        //   (claim_in) would write a lease measured from before the wait,
        //   possibly already over. Every writer that creates or deletes a
        //   key's row holds this lock (claims until their transaction ends,
        //   prune while it deletes), so once `g` has it, nothing is left to
        //   wait for on the insert path. The lock sits in subquery `l`, which
        //   PostgreSQL never flattens into `g` (its target list calls a
        //   volatile function), so `g`'s expressions are evaluated on the row
        //   `l` returns, after the locks; `g0` is kept apart by `OFFSET 0` so
        //   the guard is evaluated once. In autocommit the locks end with the
        //   statement; in a caller's transaction they are held until that
        //   transaction ends, and a concurrent claim of a key waits for
        //   them, then reads a fresh clock. Every other part reads `g`
        //   first: through `(SELECT g.ok FROM g)`, a one-time filter
        //   PostgreSQL evaluates before the scan it gates.
        // - In the horizon variant `b.beyond` calls the `_beyond` function
        //   per key: VOLATILE, so its queries take a new snapshot, after the
        //   locks (the statement's own snapshot predates the wait and could
        //   miss a prune that committed meanwhile). It is true when the key
        //   is absent and the tenant and kind's watermark is at or after
        //   `sent_at` (oncely::backend::is_beyond_horizon). While this claim
        //   holds the key's lock, no claim can insert the key and no prune
        //   can delete it, so "absent" stays true until the statement ends.
        //   An old message therefore never inserts, and still takes over an
        //   existing released or expired record. (In a caller's REPEATABLE
        //   READ or SERIALIZABLE transaction the function sees that
        //   transaction's snapshot: a key committed by someone else after it
        //   reads as absent, so such a claim may fail with BeyondHorizon
        //   where READ COMMITTED would answer the record. It never inserts
        //   either way.)
        // - `cur`: the records as the statement's snapshot shows them (the
        //   columns of `FOUND_COLUMNS`, and each row's `xmin` as `row_xmin`).
        // - `ins` inserts the keys `cur` does not show, with fence = the
        //   clock's microseconds. `ON CONFLICT DO NOTHING` (not DO UPDATE):
        //   a row committed after the snapshot is left alone (`late`).
        // - `upd` takes over the records whose takeover condition holds. It
        //   runs only when `cur` found a record (a one-time filter): a fresh
        //   key's claim does not probe the index a third time. A record it
        //   does not take over is only read: no row lock, no transaction id,
        //   no WAL record. (`ON CONFLICT DO UPDATE … WHERE` would lock the
        //   existing row even when its WHERE is false, which takes a
        //   transaction id and writes a WAL record, so a duplicate of a
        //   completed effect would wait on a disk flush at commit.)
        // - `gone`, `late`: the keys that `cur` did not show and that were
        //   neither inserted nor taken over (nor beyond the horizon) were
        //   refused by the unique index: their row was committed after the
        //   statement's snapshot, which predates any wait on the lock (a
        //   duplicate that waited while the first delivery's claim inserted
        //   the key). `late` reads them through the `_current` function
        //   (schema version 5): VOLATILE, so its query takes a new snapshot
        //   when it runs, as `_beyond`'s do, and sees them; it runs only
        //   when there is such a key (a one-time filter), and after `ins`,
        //   whose rows it reads. Before it, such a claim reported the key
        //   `missing` and the caller ran the whole statement again. A row
        //   read there is not taken over by `upd` (whose scan uses the
        //   statement's snapshot): it is answered as `existing`, and the
        //   caller claims again if it could be taken over (below).
        // - Otherwise the existing record is returned (`existing`, from
        //   `cur` or `late`), or a status row: `leaked` (guard tripped:
        //   nothing was written, no lock taken), `beyond`, or `missing` (a
        //   row neither snapshot shows, written by something that does not
        //   take the key's lock; the caller runs the statement again for
        //   that key). An `existing` record that could be taken over by now
        //   (the UPDATE found it changed or could not see it, or its lease
        //   ended since) is claimed again the same way.
        // - Every row the claim inserts or takes over carries the call's
        //   token (`claim_token`: 16 random bytes and the writing
        //   transaction's id, `token_written`). An `existing` row with the
        //   same token, written by the transaction of its `xmin` (`own`;
        //   `cur` carries each row's `xmin` as `row_xmin`), was written by an
        //   earlier run of this very call whose answer was lost (the
        //   connection died during its statement or its commit, or it timed
        //   out): the caller holds that
        //   lease, and the ledger answers it as acquired
        //   (`PgLedger::resolve_claim`). Any other row is answered, or taken
        //   over, as for any claim.
        //
        // One row per key, named by `key`. An acquired row reports, as `now`,
        // the clock its lease was measured from (`lease_expires_at - lease`),
        // and whether it took a record over. The first branch of the UNION
        // names the columns: `src`, `key`, those of `cols`, then
        // `taken_over`, `own` ([`ClaimRow`] reads them by name).
        // A relaxed claim sets `synchronous_commit = off` for its own
        // (implicit) transaction in the guard's sub-query, which runs once,
        // before anything is written: PostgreSQL reads the setting when the
        // transaction commits, after the statement.
        let claim = |batch: bool, horizon: bool, relaxed: bool| {
            let guard_claim = |param: &str| {
                let ok = guard(param);
                if relaxed {
                    format!("({ok}) AND (set_config('synchronous_commit', 'off', true) IS NOT NULL)")
                } else {
                    ok
                }
            };
            let (input, lock, keys) = if batch {
                (
                    "SELECT i.key, i.tenant, i.kind, i.subject \
                     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS i(key, tenant, kind, subject)"
                        .to_owned(),
                    format!(
                        "(SELECT count(pg_advisory_xact_lock(s.id)) FROM \
                           (SELECT DISTINCT hashtextextended(i.key, {seed}) AS id FROM i ORDER BY id) s)",
                        seed = lock_seed(schema, table),
                    ),
                    "= ANY($1::text[])",
                )
            } else {
                (
                    "SELECT $1::text AS key, $2::text AS tenant, $3::text AS kind, $4::text AS subject"
                        .to_owned(),
                    key_lock("pg_advisory_xact_lock", "$1"),
                    "= $1",
                )
            };
            let (beyond_cte, not_beyond, beyond_join, beyond_status) = if horizon {
                (
                    format!(
                        "b AS (SELECT i.key, {beyond}(i.tenant, i.kind, i.key, $11::bigint) AS beyond \
                         FROM i WHERE (SELECT g.ok FROM g)), "
                    ),
                    " AND NOT EXISTS (SELECT 1 FROM b WHERE b.key = i.key AND b.beyond)",
                    " LEFT JOIN b ON b.key = i.key",
                    " WHEN b.beyond THEN 'beyond'",
                )
            } else {
                (String::new(), "", "", "")
            };
            let returning = format!(
                "e.key, e.fence, e.at_most_once, e.created_at, e.lease_expires_at, \
                 e.lease_expires_at - {lease} AS acquired_at",
                lease = micros("$7"),
            );
            format!(
                "WITH i AS ({input}), \
                 g AS (\
                   SELECT l.ok, clock_timestamp() AS now \
                   FROM (SELECT g0.ok, CASE WHEN g0.ok THEN {lock} END AS locked \
                         FROM (SELECT {guard} AS ok OFFSET 0) g0) l), \
                 {beyond_cte}\
                 cur AS (SELECT {found_cols}, e.xmin AS row_xmin FROM {t} e \
                   WHERE e.key {keys} AND (SELECT g.ok FROM g)), \
                 ins AS (\
                   INSERT INTO {t} AS e (key, tenant, kind, subject, state, fence, fingerprint, outcome, \
                     at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us, \
                     claim_token) \
                   SELECT i.key, i.tenant, i.kind, i.subject, 'in_progress', greatest({now_us}, 1), $5::bytea, \
                     NULL, $6, g.now, g.now, g.now + {lease}, g.now + {ret}, $8, {token} \
                   FROM i CROSS JOIN g \
                   WHERE g.ok AND NOT EXISTS (SELECT 1 FROM cur c WHERE c.key = i.key){not_beyond} \
                   ON CONFLICT (key) DO NOTHING \
                   RETURNING {returning}), \
                 upd AS (\
                   UPDATE {t} AS e SET {takeover_set} \
                   WHERE e.key {keys} AND (SELECT g.ok FROM g) AND EXISTS (SELECT 1 FROM cur) \
                     AND {takeover_when} \
                   RETURNING {returning}), \
                 won AS (SELECT x.*, false AS taken_over FROM ins x \
                         UNION ALL SELECT y.*, true AS taken_over FROM upd y), \
                 gone AS (SELECT i.key FROM i WHERE NOT EXISTS (SELECT 1 FROM cur c WHERE c.key = i.key) \
                   AND NOT EXISTS (SELECT 1 FROM won w WHERE w.key = i.key){not_beyond}), \
                 late AS (SELECT l.* FROM {current}(ARRAY(SELECT n.key FROM gone n)) l \
                   WHERE (SELECT g.ok FROM g) AND EXISTS (SELECT 1 FROM gone)), \
                 found AS (SELECT * FROM cur UNION ALL SELECT * FROM late) \
                 SELECT 'acquired'::text AS src, w.key AS key, NULL::text AS state, w.fence AS fence, \
                   NULL::bytea AS fingerprint, NULL::bytea AS outcome, w.at_most_once AS at_most_once, \
                   w.created_at AS created_at, w.acquired_at AS updated_at, \
                   w.lease_expires_at AS lease_expires_at, NULL::timestamptz AS retain_until, \
                   w.acquired_at AS now, w.taken_over AS taken_over, true AS own \
                 FROM won w \
                 UNION ALL SELECT CASE WHEN NOT g.ok THEN 'leaked'{beyond_status} \
                   WHEN e.key IS NOT NULL THEN 'existing' ELSE 'missing' END, i.key, {ce}, NULL::boolean, \
                   {own} \
                 FROM i CROSS JOIN g LEFT JOIN found e ON e.key = i.key{beyond_join} \
                 WHERE NOT EXISTS (SELECT 1 FROM won w WHERE w.key = i.key)",
                guard = guard_claim("$9"),
                now_us = us("g.now"),
                lease = micros("$7"),
                ret = micros("$8"),
                ce = cols("e"),
                token = token_written("$10"),
                own = own("e", "$10"),
                found_cols = FOUND_COLUMNS
                    .iter()
                    .map(|c| format!("e.{c}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        };

        // Fenced writes: $1 key, $2 fence, then the operation's own values,
        // and the guard flag last. A row comes back only when the write
        // happened, with its `value` (renew: the new expiry's µs); when none
        // does, `probe` tells a stale fence (LeaseLost) from a tripped
        // guard, on the failure path only.
        //
        // Waiters in other processes learn of a completion or release by a
        // notification on the ledger's channel. Autocommit writes do not
        // `pg_notify` in their own statement: a transaction that notifies
        // takes a database-wide lock from its commit until its end, WAL
        // flush included, so concurrent completions that notify commit one
        // at a time (pgbench, 8 clients inserting on this machine: 4,200
        // commits/s without a notify, 530-880 with one). The ledger
        // announces their keys after they commit instead, from a
        // transaction whose commit waits for no flush (`notify::Announcer`). Only
        // `complete_in`, inside the caller's transaction, notifies in its
        // statement: the notification then goes out when (and only if) the
        // caller commits. It is sent per updated row only, so a stale fence
        // notifies nobody.
        //
        // Only a record a waiter marked (`watched`, schema version 4: see
        // `watch_mark`) is announced: a completion nobody waits for in
        // another process costs no announcement. (`complete_in` notifies
        // whatever the mark: a waiter of the holder's own ledger marks
        // nothing, counting on the ledger to wake it after the completion,
        // and a completion in the caller's transaction can only wake it by
        // the notification its commit sends.) Every fenced write
        // returns the mark (`watched`), read from the version it wrote: a
        // mark committed before the write took the row's lock is seen; one
        // after it finds the row no longer in progress and writes nothing,
        // and its waiter reads the record again (the runner claims once more
        // after subscribing), so no waiter is left unannounced.
        let notify = format!("pg_notify('{channel}', e.key) IS NULL AS notified");
        let fenced = |set: &str, guard_param: &str, returning: &str, notifies: bool| {
            format!(
                "UPDATE {t} AS e SET {set} \
                 WHERE e.key = $1 AND e.fence = $2 AND e.state = 'in_progress' AND {guard} \
                 RETURNING {returning} AS value, coalesce(e.watched, false) AS watched{notify}",
                guard = guard(guard_param),
                notify = if notifies {
                    format!(", {notify}")
                } else {
                    String::new()
                },
            )
        };
        let completed = |outcome: &str| {
            format!(
                "state = 'completed', outcome = {outcome}, lease_expires_at = NULL, \
                 updated_at = clock_timestamp(), retain_until = clock_timestamp() + {}",
                micros("e.retention_us")
            )
        };
        let complete = fenced(&completed("$3"), "$4", "0::bigint", false);
        let complete_in = fenced(&completed("$3"), "$4", "0::bigint", true);
        let release = fenced(
            &format!(
                "state = 'released', outcome = NULL, lease_expires_at = NULL, updated_at = clock_timestamp(), \
                 retain_until = clock_timestamp() + {}",
                micros("e.retention_us")
            ),
            "$3",
            "0::bigint",
            false,
        );
        let renew = fenced(
            &format!("lease_expires_at = clock_timestamp() + {}", micros("$3")),
            "$4",
            &us("e.lease_expires_at"),
            false,
        );
        // Several completions in one statement: $1 keys, $2 fences, $3
        // outcomes (one element per lease, no (key, fence) twice), $4 the
        // guard flag. Each lease is fenced on its own, exactly as `complete`
        // is. One row per completed lease (`key`, `fence`), or a single row
        // with NULLs when none was; `ok` is the guard, so a stale fence and a
        // tripped guard are told apart without a second statement.
        let complete_many = format!(
            "WITH g AS (SELECT {guard} AS ok OFFSET 0), \
             u AS (UPDATE {t} AS e SET {set} \
               FROM unnest($1::text[], $2::bigint[], $3::bytea[]) AS i(key, fence, outcome) \
               WHERE e.key = i.key AND e.fence = i.fence AND e.state = 'in_progress' \
                 AND (SELECT g.ok FROM g) \
               RETURNING e.key, e.fence, coalesce(e.watched, false) AS watched) \
             SELECT g.ok AS ok, u.key AS key, u.fence AS fence, u.watched AS watched FROM g LEFT JOIN u ON true",
            guard = guard("$4"),
            set = completed("i.outcome"),
        );
        // A waiter's mark, written by `PgLedger::watch` once its listener
        // listens and before the runner reads the record again: the record's
        // next completion or release is then announced to the channel (see
        // `fenced`). Only a record in progress is marked, once (a second
        // waiter writes nothing), with its commit not waiting for a WAL
        // flush (a mark lost in a crash costs its waiter the fallback, as a
        // lost announcement does: the crash dropped its listener anyway).
        // The claim token stays tied to the row: the mark rewrites the row,
        // so a token that matched the version before (`own`) is tied again
        // to the version the mark writes; the holder of the lease is the
        // same, and a claim whose answer was lost still finds its own row.
        let watch_mark = format!(
            "WITH s AS (SELECT set_config('synchronous_commit', 'off', true) OFFSET 0) \
             UPDATE {t} AS e SET watched = true, \
               claim_token = CASE WHEN e.claim_token = (substring(e.claim_token from 1 for 16) \
                                   || int8send(e.xmin::text::bigint)) \
                 THEN substring(e.claim_token from 1 for 16) || int8send(pg_current_xact_id()::text::bigint % 4294967296) \
                 ELSE e.claim_token END \
             FROM s WHERE e.key = $1 AND e.state = 'in_progress' AND e.watched IS NOT TRUE AND {guard} \
             RETURNING true AS marked",
            guard = guard("$2"),
        );
        // Bound to a parameter so that it, too, runs through Bind/Execute:
        // the guard relies on the protocol portal of the extended protocol.
        let probe = format!("SELECT {} AS ok", guard("$1"));

        let get = format!(
            "SELECT g.ok, {ce} FROM (SELECT {guard} AS ok) g LEFT JOIN {t} e ON e.key = $1",
            guard = guard("true"),
            ce = cols("e"),
        );

        // One batch of prune ($1 rows at most), in one statement and so in
        // one transaction:
        // - `c`: candidates, oldest retention first, from `$2` on (µs, NULL:
        //   from the start): a range scan of the partial prune index
        //   (`retain_until`, completed and released rows only) that stops
        //   after $1 rows. `now()` (not the clock) so the index serves the
        //   search; it is this statement's start, so a record is only ever
        //   deleted after its retention. SKIP LOCKED leaves rows a claim is
        //   taking over to that claim. `$2` is the newest `retain_until` of
        //   the previous batch (a cursor the ledger keeps, see
        //   `PgLedger::prune`): without it each batch would walk again over
        //   the index entries of every row the earlier batches deleted,
        //   which stay in the index until vacuum and cost a heap visit each
        //   while any snapshot older than their delete is open, so a backlog
        //   of a million rows would cost quadratic work. The cursor only
        //   narrows the search; what is deleted is decided by `d`.
        // - `l`: only keys whose advisory lock is free: a claim holding a
        //   key's lock (waiting to insert it, or inside a caller's
        //   transaction) never sees the key deleted under it. The locks are
        //   transaction-scoped, so a batch holds at most $1 of them (the
        //   caller keeps batches small enough for the lock table).
        // - `d` deletes, re-checking the latest version of each row.
        // - `w` raises the horizon of each tenant and kind to the newest
        //   `created_at` deleted, in the same transaction as the delete
        //   (in a fixed order, so two prunes lock watermark rows alike).
        // Returns the guard (`ok`), how many candidates there were
        // (`candidates`), how many were deleted (`deleted`) and the newest
        // candidate's `retain_until` in µs (`last`, the next cursor).
        let prune = format!(
            "WITH g AS (SELECT {guard} AS ok), \
             c AS (SELECT x.key, x.retain_until FROM {t} x \
               WHERE (SELECT g.ok FROM g) AND x.state IN ('completed', 'released') \
                 AND x.retain_until <= now() \
                 AND x.retain_until >= coalesce('epoch'::timestamptz + {from_us}, '-infinity'::timestamptz) \
               ORDER BY x.retain_until LIMIT $1 FOR UPDATE SKIP LOCKED), \
             l AS (SELECT c.key FROM c WHERE {try_lock}), \
             d AS (DELETE FROM {t} AS e USING l \
               WHERE e.key = l.key AND e.state IN ('completed', 'released') AND e.retain_until <= now() \
               RETURNING e.tenant, e.kind, e.created_at), \
             w AS (INSERT INTO {h} AS w (tenant, kind, watermark) \
               SELECT d.tenant, d.kind, max(d.created_at) FROM d GROUP BY d.tenant, d.kind \
               ORDER BY d.tenant, d.kind \
               ON CONFLICT (tenant, kind) DO UPDATE SET watermark = greatest(w.watermark, excluded.watermark) \
               RETURNING 1) \
             SELECT g.ok, (SELECT count(*) FROM c) AS candidates, (SELECT count(*) FROM d) AS deleted, \
               (SELECT count(*) FROM w) AS raised, (SELECT {last} FROM c) AS last \
             FROM g",
            guard = guard("true"),
            from_us = micros("$2"),
            last = us("max(c.retain_until)"),
            try_lock = key_lock("pg_try_advisory_xact_lock", "c.key"),
        );

        let abandoned = format!(
            "SELECT e.key AS key, {ce} FROM {t} e \
             WHERE e.tenant = $1 AND e.state = 'in_progress' AND e.at_most_once \
               AND e.lease_expires_at <= clock_timestamp() \
             ORDER BY e.created_at, e.key LIMIT $2",
            ce = cols("e"),
        );

        // Forget: completed at exactly this fence becomes released, without
        // its outcome, kept for its retention from now; the row stays, so the
        // next claim's fence is `fence + 1` or more whatever the clock does.
        // Guarded like every write; a row comes back only if it wrote.
        let forget = format!(
            "UPDATE {t} AS e SET state = 'released', outcome = NULL, lease_expires_at = NULL, \
               updated_at = clock_timestamp(), retain_until = clock_timestamp() + {retention} \
             WHERE e.key = $1 AND e.fence = $2 AND e.state = 'completed' AND {guard} \
             RETURNING 0::bigint AS value",
            retention = micros("e.retention_us"),
            guard = guard("$3"),
        );
        // Erase, in a transaction of the ledger's own: first the subject's
        // records, locked (a row some claim or completion is writing is
        // waited for, and read as it is then), with the clock; then the
        // completed and released ones (`oncely::backend::erasable`) lose
        // their outcome and fingerprint. Key, state, fence, created_at and
        // retention stay, so a completed one answers every claim with
        // `Error::Erased` and is never taken over. The locked rows in
        // progress are reported pending, unchanged: a holder may still
        // complete them. (One statement reading its snapshot could miss a
        // released record that a claim took over meanwhile: in neither list.)
        let erase_lock = format!(
            "SELECT e.key AS key, e.state AS state, clock_timestamp() AS now FROM {t} AS e \
             WHERE e.tenant = $1 AND e.subject = $2 FOR UPDATE"
        );
        let erase = format!(
            "UPDATE {t} SET outcome = NULL, fingerprint = NULL \
             WHERE tenant = $1 AND subject = $2 AND state IN ('completed', 'released')"
        );
        let replace_outcome = format!(
            "UPDATE {t} SET outcome = $4 \
             WHERE key = $1 AND fence = $2 AND state = 'completed' AND outcome = $3 \
             RETURNING 0::bigint AS value"
        );
        // `now()` (stable), as prune's own candidate search, so the prune
        // index serves the count.
        let prunable = format!(
            "SELECT count(*) FROM {t} WHERE state IN ('completed', 'released') AND retain_until <= now()"
        );

        let horizon = format!(
            "SELECT g.ok, w.watermark FROM (SELECT {guard} AS ok) g \
             LEFT JOIN {h} w ON w.tenant = $1 AND w.kind = $2 AND g.ok",
            guard = guard("true"),
        );

        let idx = |suffix: &str| quote(&format!("{table}_{suffix}"));
        // Version 1, as the first release created it (unchanged: a database
        // migrated by it must see the same statements recorded).
        let v1 = format!(
            "CREATE TABLE IF NOT EXISTS {t} (\
               key text PRIMARY KEY CHECK (octet_length(key) <= 255), \
               tenant text NOT NULL, \
               kind text NOT NULL, \
               subject text NOT NULL, \
               state text NOT NULL CHECK (state IN ('in_progress', 'completed', 'released')), \
               fence bigint NOT NULL CHECK (fence >= 1), \
               fingerprint bytea CHECK (octet_length(fingerprint) = 32), \
               outcome bytea CHECK (octet_length(outcome) <= {max_outcome}), \
               at_most_once boolean NOT NULL, \
               created_at timestamptz NOT NULL, \
               updated_at timestamptz NOT NULL, \
               lease_expires_at timestamptz, \
               retain_until timestamptz NOT NULL, \
               retention_us bigint NOT NULL CHECK (retention_us > 0)\
             ); \
             CREATE INDEX IF NOT EXISTS {prune_idx} ON {t} (retain_until) \
               WHERE state IN ('completed', 'released'); \
             CREATE INDEX IF NOT EXISTS {abandoned_idx} ON {t} (tenant, created_at) \
               WHERE state = 'in_progress' AND at_most_once;",
            max_outcome = oncely::backend::MAX_OUTCOME_BYTES,
            prune_idx = idx("prune_idx"),
            abandoned_idx = idx("abandoned_idx"),
        );
        // Version 2: the horizon watermark per tenant and kind, and the
        // claim's fresh-snapshot horizon check. Existing records keep their
        // fences (1, 2, 3…); their next takeover jumps to the clock's
        // microseconds. Records pruned under version 1 left no watermark
        // (version 1 judged a message by its claimant's retention instead).
        //
        // `_beyond` is a VOLATILE SQL function with sub-queries, so
        // PostgreSQL neither inlines it into the claim nor reuses the
        // claim's snapshot: each call reads what is committed when it runs.
        let v2 = format!(
            "CREATE TABLE IF NOT EXISTS {h} (\
               tenant text NOT NULL, \
               kind text NOT NULL, \
               watermark timestamptz NOT NULL, \
               PRIMARY KEY (tenant, kind)\
             ); \
             CREATE OR REPLACE FUNCTION {beyond}(p_tenant text, p_kind text, p_key text, p_sent_us bigint) \
               RETURNS boolean LANGUAGE sql VOLATILE PARALLEL UNSAFE \
               AS $oncely$ \
                 SELECT EXISTS (SELECT 1 FROM {h} w WHERE w.tenant = p_tenant AND w.kind = p_kind \
                                  AND {w_us} >= p_sent_us) \
                    AND NOT EXISTS (SELECT 1 FROM {t} e WHERE e.key = p_key) \
               $oncely$;",
            w_us = us("w.watermark"),
        );
        // Version 3: the claim token (see the claim statement). A nullable
        // column without a default: PostgreSQL adds it to the catalog only,
        // without rewriting or scanning the table (a brief ACCESS EXCLUSIVE
        // lock, which waits for transactions using the table). Existing rows
        // have none; a release before this one ignores the column, and a
        // takeover by it leaves the token, which then no longer matches its
        // row (the row's `xmin` moved on: `own`).
        let v3 = format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS claim_token bytea;");
        // Version 4: the waiter's mark (`watch_mark`). Nullable without a
        // default, like version 3's column: a catalog change only. Records
        // have none (NULL reads as not watched). A release before this one
        // neither marks nor reads it: its completions announce every key,
        // and its waiters, which do not mark, are announced to only by those
        // (this release's completions of records nobody marked are not), so
        // during a rolling upgrade an old release's waiter may be woken by
        // its fallback (`oncely::backend::NOTIFIED_FALLBACK`, 1 s) instead.
        let v4 = format!("ALTER TABLE {t} ADD COLUMN IF NOT EXISTS watched boolean;");
        // Version 5: the claim's read of records committed after its
        // snapshot (`late` in the claim statement). PL/pgSQL rather than
        // SQL: a VOLATILE SQL function is planned again on every call, a
        // PL/pgSQL one keeps its plan for the session; its query still takes
        // a new snapshot on each call. Its columns are `FOUND_COLUMNS`, then
        // `row_xmin`. The text columns are cast because a table
        // found in place may declare them `varchar` (the schema check
        // accepts it), and RETURN QUERY wants the declared types exactly.
        // A release before this one never calls it.
        let v5 = format!(
            "CREATE OR REPLACE FUNCTION {current}(p_keys text[]) \
               RETURNS TABLE (key text, state text, fence bigint, fingerprint bytea, outcome bytea, \
                 at_most_once boolean, created_at timestamptz, updated_at timestamptz, \
                 lease_expires_at timestamptz, retain_until timestamptz, claim_token bytea, row_xmin xid) \
               LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE \
               AS $oncely$ BEGIN \
                 RETURN QUERY SELECT e.key::text, e.state::text, e.fence, e.fingerprint, e.outcome, \
                   e.at_most_once, e.created_at, e.updated_at, e.lease_expires_at, e.retain_until, \
                   e.claim_token, e.xmin FROM {t} e WHERE e.key = ANY(p_keys); \
               END $oncely$;"
        );

        Queries {
            claim: claim(false, false, false).into(),
            claim_horizon: claim(false, true, false).into(),
            claim_many: claim(true, false, false).into(),
            claim_many_horizon: claim(true, true, false).into(),
            claim_relaxed: [
                claim(false, false, true).into(),
                claim(false, true, true).into(),
                claim(true, false, true).into(),
                claim(true, true, true).into(),
            ],
            complete: complete.into(),
            complete_in: complete_in.into(),
            complete_many: complete_many.into(),
            release: release.into(),
            renew: renew.into(),
            watch_mark: watch_mark.into(),
            probe: probe.into(),
            get: get.into(),
            prune: prune.into(),
            abandoned: abandoned.into(),
            forget: forget.into(),
            erase_lock: erase_lock.into(),
            erase: erase.into(),
            replace_outcome: replace_outcome.into(),
            prunable: prunable.into(),
            horizon: horizon.into(),
            schema_exists: "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)".into(),
            create_schema: format!("CREATE SCHEMA IF NOT EXISTS {}", quote(schema)).into(),
            create_migrations: format!(
                "CREATE TABLE IF NOT EXISTS {migrations_table} (\
                   version integer PRIMARY KEY, description text NOT NULL, \
                   applied_at timestamptz NOT NULL DEFAULT now())"
            )
            .into(),
            applied_version: format!("SELECT coalesce(max(version), 0) FROM {migrations_table}").into(),
            record_migration: format!(
                "INSERT INTO {migrations_table} (version, description) VALUES ($1, $2)"
            )
            .into(),
            migrations: vec![
                (1, "effects table and indexes", v1.into()),
                (
                    2,
                    "horizon watermark per tenant and kind, fresh-snapshot horizon check",
                    v2.into(),
                ),
                (
                    3,
                    "claim token: a claim whose answer was lost finds its own row",
                    v3.into(),
                ),
                (
                    4,
                    "waiter's mark: only a completion somebody waits for is announced",
                    v4.into(),
                ),
                (
                    5,
                    "the claim reads the records after their locks, on a fresh snapshot",
                    v5.into(),
                ),
                (
                    6,
                    "the transactional outbox: messages committed with the business writes",
                    outbox::migration(schema, table).into(),
                ),
            ],
            horizon_table: horizon_name,
            beyond_function: beyond_name,
            current_function: current_name,
            channel: channel.into(),
            outbox: OutboxQueries::new(schema, table),
        }
    }
}

/// Serialises migrations of one schema and table across processes
/// (transaction-scoped, so a cancelled migration cannot leave it held).
pub(crate) const MIGRATION_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";

/// Ends a transaction that someone else left open on a pooled connection.
pub(crate) const ROLLBACK: &str = "ROLLBACK";

/// What kind of server a session reached (`hosts`, on every new connection
/// and every probe): in recovery (a standby), and whether its transactions
/// are read-only (a standby's are; so are those of a server with
/// `default_transaction_read_only`).
pub(crate) const SESSION: &str =
    "SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.current_setting('transaction_read_only') = 'on'";

/// The columns of a table (`$1` schema, `$2` table): the relation's kind,
/// then per column its name, its type as PostgreSQL spells it, whether its
/// collation (if any) is deterministic, its collation's name, whether it is
/// NOT NULL, whether it has a default (or is generated or an identity). No
/// row: the table does not exist. Reads only the catalog, which every role
/// may read.
pub(crate) const TABLE_COLUMNS: &str = "\
    SELECT r.relkind::text AS relkind, a.attname::text AS name, \
      format_type(a.atttypid, a.atttypmod) AS data_type, \
      coalesce(co.collisdeterministic, true) AS deterministic, \
      coalesce(co.collname::text, '') AS collation, a.attnotnull AS not_null, \
      (a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> '') AS has_default \
    FROM pg_catalog.pg_class r \
    JOIN pg_catalog.pg_namespace n ON n.oid = r.relnamespace \
    LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped \
    LEFT JOIN pg_catalog.pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0 \
    WHERE n.nspname = $1 AND r.relname = $2 AND r.relkind IN ('r', 'p', 'v', 'm', 'f') \
    ORDER BY a.attnum";

/// The unique keys of a table that ON CONFLICT can use and that hold on
/// each row at once: valid, immediate (not deferrable), without a
/// predicate or an expression. One row per such index: its name, its key
/// columns in order, and whether every key column's collation in the
/// index is deterministic.
pub(crate) const UNIQUE_KEYS: &str = "\
    SELECT ic.relname::text AS name, \
      array(SELECT a.attname::text FROM unnest(i.indkey[0:i.indnkeyatts - 1]) WITH ORDINALITY k(attnum, o) \
            JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
            ORDER BY k.o) AS columns, \
      coalesce((SELECT bool_and(coalesce(co.collisdeterministic, true)) \
                FROM unnest(i.indcollation) AS ic2(coll) \
                LEFT JOIN pg_catalog.pg_collation co ON co.oid = ic2.coll AND ic2.coll <> 0), true) \
        AS deterministic \
    FROM pg_catalog.pg_index i \
    JOIN pg_catalog.pg_class r ON r.oid = i.indrelid \
    JOIN pg_catalog.pg_namespace n ON n.oid = r.relnamespace \
    JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid \
    WHERE n.nspname = $1 AND r.relname = $2 AND i.indisunique AND i.indisvalid AND i.indimmediate \
      AND i.indpred IS NULL AND i.indexprs IS NULL";

/// Whether one of the claim's functions exists (`$1` schema, `$2` name),
/// with the argument types the claim calls it with (`$3`, an `oidvector`'s
/// text) and its return type (`$4`, a type's name).
pub(crate) const FUNCTION_EXISTS: &str = "\
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p \
      JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace \
      WHERE n.nspname = $1 AND p.proname = $2 \
        AND p.proargtypes = $3::text::pg_catalog.oidvector AND p.prorettype = $4::text::pg_catalog.regtype)";

/// The claim's functions and their signatures, as [`FUNCTION_EXISTS`]
/// binds them: `_beyond(text, text, text, bigint) boolean` and
/// `_current(text[])`, which returns a table (`record`).
pub(crate) fn claim_functions(q: &Queries) -> [(&str, &'static str, &'static str); 2] {
    [
        (&q.beyond_function, "25 25 25 20", "boolean"),
        (&q.current_function, "1009", "record"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transaction that notifies commits alone (PostgreSQL holds a
    /// database-wide lock through its commit), so the autocommit writes
    /// never notify in their own statement: the ledger announces them after
    /// they commit (`notify.rs`). Only `complete_in` does, inside the
    /// caller's transaction.
    #[test]
    fn only_complete_in_notifies_in_its_statement() {
        let q = Queries::new("public", "oncely_effects");
        for (name, sql) in [
            ("complete", &q.complete),
            ("release", &q.release),
            ("complete_many", &q.complete_many),
            ("renew", &q.renew),
            ("claim", &q.claim),
            ("claim_many", &q.claim_many),
        ] {
            assert!(
                !sql.contains("pg_notify"),
                "{name} notifies in its statement: {sql}"
            );
        }
        assert!(q.complete_in.contains("pg_notify"), "{}", q.complete_in);
    }

    /// The claim unions `cur` (the table's columns by name) with what the
    /// `_current` function returns: the same columns in the same order.
    #[test]
    fn the_current_function_returns_the_found_columns() {
        let q = Queries::new("public", "oncely_effects");
        let v5 = &q.migrations.iter().find(|m| m.0 == 5).unwrap().2;
        let declared = v5
            .split("RETURNS TABLE (")
            .nth(1)
            .unwrap()
            .split(')')
            .next()
            .unwrap();
        let names: Vec<&str> = declared
            .split(',')
            .map(|c| c.split_whitespace().next().unwrap())
            .collect();
        let mut expected = FOUND_COLUMNS.to_vec();
        expected.push("row_xmin");
        assert_eq!(names, expected);
    }

    #[test]
    fn lock_seed_is_stable_and_per_table() {
        // Every process and release must derive the same lock ids.
        assert_eq!(
            lock_seed("public", "oncely_effects"),
            lock_seed("public", "oncely_effects")
        );
        assert_ne!(lock_seed("public", "a"), lock_seed("public", "b"));
        assert_ne!(lock_seed("a", "b_c"), lock_seed("a_b", "c"));
        assert_eq!(
            lock_seed("", ""),
            i64::from_ne_bytes(0xaf63_a34c_8601_8bb1_u64.to_ne_bytes())
        );
    }
}
