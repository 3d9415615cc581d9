//! Every SQL statement of the backend, built once per ledger from the
//! validated (and quoted) schema and table names.
//!
//! Architecture invariant: no other module contains SQL.

use std::sync::Arc;

/// A timestamp as microseconds since the Unix epoch, for arithmetic in SQL
/// (the horizon) and the renewed expiry.
fn us(expr: &str) -> String {
    format!("(extract(epoch from {expr}) * 1000000)::bigint")
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

/// The record columns every read returns, in [`crate::RecordRow`] order.
/// Timestamps travel as binary `timestamptz` (see `crate::Micros`).
fn cols(a: &str) -> String {
    format!(
        "{a}.state, {a}.fence, {a}.fingerprint, {a}.outcome, {a}.at_most_once, {a}.created_at, \
         {a}.updated_at, {a}.lease_expires_at, {a}.retain_until, now()"
    )
}

/// The same columns for a claim's own insert or takeover: only what a
/// lease needs (the state is `in_progress` by construction).
fn acquired_cols(a: &str) -> String {
    format!(
        "NULL::text, {a}.fence, NULL::bytea, NULL::bytea, {a}.at_most_once, {a}.created_at, \
         NULL::timestamptz, {a}.lease_expires_at, NULL::timestamptz, now()"
    )
}

/// Double-quotes an identifier that [`crate::PgLedgerOptions`] validated
/// (lowercase ASCII letters, digits and `_`), so it can never be anything
/// but a name.
pub(crate) fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// The statements of one ledger (one schema and table).
#[derive(Debug)]
pub(crate) struct Queries {
    pub claim: Arc<str>,
    pub claim_horizon: Arc<str>,
    pub complete: Arc<str>,
    pub release: Arc<str>,
    pub renew: Arc<str>,
    pub probe: Arc<str>,
    pub get: Arc<str>,
    pub prune: Arc<str>,
    pub abandoned: Arc<str>,
    pub schema_exists: Arc<str>,
    pub create_schema: Arc<str>,
    pub create_migrations: Arc<str>,
    pub applied_version: Arc<str>,
    pub record_migration: Arc<str>,
    pub migrations: Vec<(i32, &'static str, Arc<str>)>,
}

impl Queries {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let t = format!("{}.{}", quote(schema), quote(table));
        let migrations_table = format!("{}.{}", quote(schema), quote(&format!("{table}_migrations")));
        let micros = |p: &str| format!("{p}::bigint * interval '1 microsecond'");

        // A claim takes the record over when it was released, or when its
        // lease ran out and the step is not at-most-once; never on a
        // fingerprint mismatch. `now()` decides.
        let takeover_set = format!(
            "state = 'in_progress', fence = e.fence + 1, at_most_once = $6, outcome = NULL, \
             fingerprint = coalesce(e.fingerprint, $5), lease_expires_at = now() + {lease}, \
             updated_at = now(), retain_until = now() + {ret}, retention_us = $8",
            lease = micros("$7"),
            ret = micros("$8"),
        );
        let takeover_when = "(e.fingerprint IS NULL OR $5::bytea IS NULL OR e.fingerprint = $5::bytea) \
             AND (e.state = 'released' OR (e.state = 'in_progress' AND NOT e.at_most_once \
             AND e.lease_expires_at <= now()))";

        // One statement, one round trip. Parameters:
        // $1 key, $2 tenant, $3 kind, $4 subject, $5 fingerprint, $6 at_most_once,
        // $7 lease µs, $8 retention µs, $9 guard on, and in the horizon
        // variant $10 sent_at µs.
        //
        // - `ins` inserts fence 1, or (ON CONFLICT) takes the record over. A
        //   concurrent claimant of the same key blocks here on the unique
        //   index until the other transaction ends.
        // - `upd` (horizon variant) is the takeover alone, for a message older
        //   than the horizon: it may take an existing record over but must
        //   never insert.
        // - Otherwise the existing record is returned, or a status row:
        //   `leaked` (guard tripped: nothing was written), `beyond` (absent
        //   and older than the horizon), `missing` (the ON CONFLICT saw a row
        //   committed after this statement's snapshot; the caller re-runs).
        //
        // Claims without `sent_at` (most) get the variant without `upd`.
        let returning = "e.fence, e.at_most_once, e.created_at, e.lease_expires_at";
        let claim = |horizon: bool| {
            let (beyond, not_beyond, upd, upd_branch, no_upd, status) = if horizon {
                (
                    format!(", ($10::bigint + $8::bigint < {}) AS beyond", us("now()")),
                    " AND NOT g.beyond",
                    format!(
                        ", upd AS (\
                           UPDATE {t} AS e SET {takeover_set} \
                           WHERE (SELECT g.ok AND g.beyond FROM g) AND e.key = $1 AND {takeover_when} \
                           RETURNING {returning})"
                    ),
                    format!(" UNION ALL SELECT 'acquired', {} FROM upd u", acquired_cols("u")),
                    " AND NOT EXISTS (SELECT 1 FROM upd)",
                    "CASE WHEN NOT g.ok THEN 'leaked' WHEN e.key IS NOT NULL THEN 'existing' \
                     WHEN g.beyond THEN 'beyond' ELSE 'missing' END",
                )
            } else {
                (
                    String::new(),
                    "",
                    String::new(),
                    String::new(),
                    "",
                    "CASE WHEN NOT g.ok THEN 'leaked' WHEN e.key IS NOT NULL THEN 'existing' \
                     ELSE 'missing' END",
                )
            };
            format!(
                "WITH g AS (SELECT {guard} AS ok{beyond}), \
                 ins AS (\
                   INSERT INTO {t} AS e (key, tenant, kind, subject, state, fence, fingerprint, outcome, \
                     at_most_once, created_at, updated_at, lease_expires_at, retain_until, retention_us) \
                   SELECT $1, $2, $3, $4, 'in_progress', 1, $5::bytea, NULL, $6, now(), now(), \
                     now() + {lease}, now() + {ret}, $8 \
                   FROM g WHERE g.ok{not_beyond} \
                   ON CONFLICT (key) DO UPDATE SET {takeover_set} WHERE {takeover_when} \
                   RETURNING {returning}){upd} \
                 SELECT 'acquired'::text AS src, {ci} FROM ins i{upd_branch} \
                 UNION ALL SELECT {status}, {ce} FROM g LEFT JOIN {t} e ON e.key = $1 AND g.ok \
                   WHERE NOT EXISTS (SELECT 1 FROM ins){no_upd}",
                guard = guard("$9"),
                lease = micros("$7"),
                ret = micros("$8"),
                ci = acquired_cols("i"),
                ce = cols("e"),
            )
        };

        // Fenced writes: $1 key, $2 fence, then the operation's own values,
        // and the guard flag last. A row comes back only when the write
        // happened; when none does, `probe` tells a stale fence (LeaseLost)
        // from a tripped guard, on the failure path only.
        let fenced = |set: &str, guard_param: &str, returning: &str| {
            format!(
                "UPDATE {t} AS e SET {set} \
                 WHERE e.key = $1 AND e.fence = $2 AND e.state = 'in_progress' AND {guard} \
                 RETURNING {returning}",
                guard = guard(guard_param),
            )
        };
        let complete = fenced(
            &format!(
                "state = 'completed', outcome = $3, lease_expires_at = NULL, updated_at = now(), \
                 retain_until = now() + {}",
                micros("e.retention_us")
            ),
            "$4",
            "0::bigint",
        );
        let release = fenced(
            &format!(
                "state = 'released', outcome = NULL, lease_expires_at = NULL, updated_at = now(), \
                 retain_until = now() + {}",
                micros("e.retention_us")
            ),
            "$3",
            "0::bigint",
        );
        let renew = fenced(
            &format!("lease_expires_at = now() + {}", micros("$3")),
            "$4",
            &us("e.lease_expires_at"),
        );
        // Bound to a parameter so that it, too, runs through Bind/Execute:
        // the guard relies on the protocol portal of the extended protocol.
        let probe = format!("SELECT {}", guard("$1"));

        let get = format!(
            "SELECT g.ok, {ce} FROM (SELECT {guard} AS ok) g LEFT JOIN {t} e ON e.key = $1",
            guard = guard("true"),
            ce = cols("e"),
        );

        // Deletes in LIMITed batches (short locks); SKIP LOCKED leaves rows a
        // claim is taking over to that claim, and the outer WHERE re-checks
        // the latest version of each row.
        let prune = format!(
            "WITH g AS (SELECT {guard} AS ok), \
             d AS (DELETE FROM {t} AS e USING g \
               WHERE g.ok AND e.key IN (SELECT x.key FROM {t} x \
                 WHERE x.state IN ('completed', 'released') AND x.retain_until <= now() \
                 ORDER BY x.retain_until LIMIT $1 FOR UPDATE SKIP LOCKED) \
               AND e.state IN ('completed', 'released') AND e.retain_until <= now() \
               RETURNING 1) \
             SELECT g.ok, (SELECT count(*) FROM d) FROM g",
            guard = guard("true"),
        );

        let abandoned = format!(
            "SELECT e.key, {ce} FROM {t} e \
             WHERE e.tenant = $1 AND e.state = 'in_progress' AND e.at_most_once \
               AND e.lease_expires_at <= now() \
             ORDER BY e.created_at, e.key LIMIT $2",
            ce = cols("e"),
        );

        let idx = |suffix: &str| quote(&format!("{table}_{suffix}"));
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
            max_outcome = oncely::MAX_OUTCOME_BYTES,
            prune_idx = idx("prune_idx"),
            abandoned_idx = idx("abandoned_idx"),
        );

        Queries {
            claim: claim(false).into(),
            claim_horizon: claim(true).into(),
            complete: complete.into(),
            release: release.into(),
            renew: renew.into(),
            probe: probe.into(),
            get: get.into(),
            prune: prune.into(),
            abandoned: abandoned.into(),
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
            migrations: vec![(1, "effects table and indexes", v1.into())],
        }
    }
}

/// Serialises migrations of one schema and table across processes
/// (transaction-scoped, so a cancelled migration cannot leave it held).
pub(crate) const MIGRATION_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";

/// Ends a transaction that someone else left open on a pooled connection.
pub(crate) const ROLLBACK: &str = "ROLLBACK";
