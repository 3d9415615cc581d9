//! The operator's statements (`oncely::admin::Admin`): forget, and the
//! listings built per query ([`records`], [`stats`]) with their rows.

use oncely::admin::{Erasure, Filter, RecordQuery};
use oncely::backend::{FilterSql, filter_where, from_micros, scope_where};
use oncely::{EffectKey, Result, Tenant};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;

use super::decode::{get, micros, micros_opt, unsigned};
use super::{Bound, Queries, cols, micros as interval_micros};
use crate::error::corrupt;

impl Queries {
    /// `Admin::forget` of `key` at `fence`, guarded: a row when it wrote.
    pub(crate) fn bind_forget(&self, key: &EffectKey, fence: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.forget.clone()))
            .bind(key.as_str())
            .bind(fence)
            .bind(true)
    }
}

impl Queries {
    /// `Admin::erase`, step 1: the subject's records, locked.
    pub(crate) fn bind_erase_lock(&self, tenant: &Tenant, subject: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.erase_lock.clone()))
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// `Admin::erase`, step 2: the erasable ones emptied.
    pub(crate) fn bind_erase(&self, tenant: &Tenant, subject: &str) -> Bound {
        sqlx::query(AssertSqlSafe(self.erase.clone()))
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// `Admin::replace_outcome`: a row when it wrote.
    pub(crate) fn bind_replace_outcome(
        &self,
        key: &EffectKey,
        fence: i64,
        expected: &[u8],
        outcome: &[u8],
    ) -> Bound {
        sqlx::query(AssertSqlSafe(self.replace_outcome.clone()))
            .bind(key.as_str().to_owned())
            .bind(fence)
            .bind(expected.to_vec())
            .bind(outcome.to_vec())
    }
}

/// The locked rows of `Admin::erase` as an [`Erasure`]: each key erased or
/// pending by its stored state (`oncely::backend::erasable`), at the clock
/// the lock read; `None` when there are no rows (nothing to erase).
pub(crate) fn erasure(rows: &[PgRow]) -> Result<Option<Erasure>> {
    let mut at = None;
    let mut erasure = Erasure::new(std::time::SystemTime::UNIX_EPOCH);
    for row in rows {
        let now = micros(row, "now")?;
        at = Some(at.map_or(now, |a: i64| a.max(now)));
        let k: String = get(row, "key")?;
        let k = EffectKey::parse(&k).map_err(|e| corrupt(format!("stored key {k:?}: {e}")))?;
        let state: String = get(row, "state")?;
        let state = oncely::backend::RecordState::parse(&state).map_err(|e| corrupt(format!("{k}: {e}")))?;
        erasure.add(k, state);
    }
    Ok(at.map(|at| {
        erasure.at = from_micros(at);
        erasure.sorted()
    }))
}

/// The database's clock alone (`now`): an erasure that found nothing.
pub(crate) const CLOCK_NOW: &str = "SELECT clock_timestamp() AS now";

/// The `now` of a [`CLOCK_NOW`] row.
pub(crate) fn clock_now(row: &PgRow) -> Result<std::time::SystemTime> {
    micros(row, "now").map(from_micros)
}

/// An operator listing built by [`records`] or [`stats`] (its text and
/// arguments), bound.
pub(crate) fn bind_listing(text: &str, args: &[Arg]) -> Bound {
    args.iter()
        .fold(sqlx::query(AssertSqlSafe(text.to_owned())), |query, a| match a {
            Arg::Text(s) => query.bind(s.clone()),
            Arg::Int(i) => query.bind(*i),
        })
}

// The operator's statements (`oncely::admin::Admin`): built per query from
// the filters it has. Reads carry no leaked-transaction guard (inside a
// stray transaction they still read correctly, like `abandoned`).

/// A value bound to an admin statement, `$1` first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
}

/// The statement's one clock reading, `c.now`: `clock_timestamp()` is
/// volatile and would be read again per row; a materialized CTE reads it
/// once, so every record of an answer is judged at the same instant.
const CLOCK: &str = "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now)";

/// What a record is, as an operator sees it, on the statement's clock
/// `c.now` ([`filter_where`]).
fn filter_sql(filter: Filter) -> String {
    filter_where(
        filter,
        &FilterSql {
            at_most_once: "e.at_most_once",
            not_at_most_once: "NOT e.at_most_once",
            ended: "e.lease_expires_at <= c.now",
            running: "e.lease_expires_at > c.now",
            truth: "true",
        },
    )
}

/// The statement's placeholders, numbered as values are added.
struct Binds(Vec<Arg>);

impl Binds {
    fn push(&mut self, a: Arg) -> String {
        self.0.push(a);
        format!("${}", self.0.len())
    }
}

/// Tenant, kind and subject ([`scope_where`] without ranges: the key
/// column's collation need not be byte order): the key itself (its primary
/// key) when all three are given, else the columns.
fn scope_sql(tenant: Option<&Tenant>, kind: Option<&str>, subject: Option<&str>, b: &mut Binds) -> String {
    let columns = ["e.key", "e.tenant", "e.kind", "e.subject"];
    scope_where(tenant, kind, subject, false, columns, "true", |v| {
        b.push(Arg::Text(v))
    })
}

/// A `bigint` of microseconds since the Unix epoch as a `timestamptz`,
/// exactly (no floating point on the way).
fn at(p: &str) -> String {
    format!("(timestamptz 'epoch' + {})", interval_micros(p))
}

/// `Admin::records`: oldest first (`created_at`, then the key in byte
/// order, `COLLATE "C"`, whatever the column's collation), after the
/// cursor, at most a page. A tenant's listing is served by its rows
/// (`tenant`, no index but the partial one of abandoned steps); a key's by
/// the primary key.
pub(crate) fn records(t: &str, q: &RecordQuery) -> Result<(String, Vec<Arg>), oncely::Error> {
    let mut b = Binds(Vec::new());
    let mut w = vec![scope_sql(
        q.tenant.as_ref(),
        q.kind.as_deref(),
        q.subject.as_deref(),
        &mut b,
    )];
    if let Some(since) = q.since {
        let p = b.push(Arg::Int(oncely::backend::to_micros(since)?));
        w.push(format!("e.created_at >= {}", at(&p)));
    }
    if let Some(c) = &q.after {
        let p = b.push(Arg::Int(oncely::backend::to_micros(c.created_at)?));
        let k = b.push(Arg::Text(c.key.as_str().to_owned()));
        w.push(format!(
            "(e.created_at > {at} OR (e.created_at = {at} AND e.key COLLATE \"C\" > {k}))",
            at = at(&p)
        ));
    }
    w.push(filter_sql(q.filter));
    let limit = b.push(Arg::Int(i64::from(q.page_size())));
    Ok((
        format!(
            "{CLOCK} SELECT e.key AS key, {ce} FROM c CROSS JOIN {t} e WHERE {w} \
             ORDER BY e.created_at, e.key COLLATE \"C\" LIMIT {limit}",
            ce = cols("e").replace("clock_timestamp() AS now", "c.now AS now"),
            w = w.join(" AND "),
        ),
        b.0,
    ))
}

/// `Admin::stats`: per tenant and kind (byte order), the records in each
/// class and the oldest `created_at` of the open ones, at one clock reading.
pub(crate) fn stats(t: &str, tenant: Option<&Tenant>) -> (String, Vec<Arg>) {
    let mut b = Binds(Vec::new());
    let scope = scope_sql(tenant, None, None, &mut b);
    let live = filter_sql(Filter::Live);
    let stuck = filter_sql(Filter::Stuck);
    let abandoned = filter_sql(Filter::Abandoned);
    (
        format!(
            "{CLOCK} SELECT e.tenant AS tenant, e.kind AS kind, c.now AS now, \
               count(*) FILTER (WHERE {live}) AS live, count(*) FILTER (WHERE {stuck}) AS stuck, \
               count(*) FILTER (WHERE {abandoned}) AS abandoned, \
               count(*) FILTER (WHERE e.state = 'completed') AS completed, \
               count(*) FILTER (WHERE e.state = 'released') AS released, \
               min(e.created_at) FILTER (WHERE {live}) AS oldest_live, \
               min(e.created_at) FILTER (WHERE {stuck}) AS oldest_stuck, \
               min(e.created_at) FILTER (WHERE {abandoned}) AS oldest_abandoned \
             FROM c CROSS JOIN {t} e WHERE {scope} \
             GROUP BY e.tenant, e.kind, c.now \
             ORDER BY e.tenant COLLATE \"C\", e.kind COLLATE \"C\""
        ),
        b.0,
    )
}

/// A row of `sql::stats`, by name.
pub(crate) fn kind_stats(row: &PgRow) -> Result<oncely::admin::KindStats> {
    let tenant: String = get(row, "tenant")?;
    let tenant = oncely::Tenant::parse(&tenant).map_err(|e| corrupt(format!("tenant {tenant:?}: {e}")))?;
    let kind: String = get(row, "kind")?;
    let count = |c: &str| unsigned(row, c, |n| format!("negative count {n}"));
    let at = |c: &str| micros_opt(row, c).map(|m| m.map(from_micros));
    let mut s = oncely::admin::KindStats::new(tenant, kind, from_micros(micros(row, "now")?));
    s.live = count("live")?;
    s.stuck = count("stuck")?;
    s.abandoned = count("abandoned")?;
    s.completed = count("completed")?;
    s.released = count("released")?;
    s.oldest_live = at("oldest_live")?;
    s.oldest_stuck = at("oldest_stuck")?;
    s.oldest_abandoned = at("oldest_abandoned")?;
    Ok(s)
}
