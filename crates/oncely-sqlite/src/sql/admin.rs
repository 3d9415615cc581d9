//! The operator's statements (`oncely::admin::Admin`): forget, the
//! prunable count, and the listings built per query ([`records`],
//! [`stats`]) with their rows.

use std::time::SystemTime;

use oncely::admin::{Filter, RecordQuery};
use oncely::backend::{FilterSql, filter_where, from_micros, scope_where};
use oncely::{EffectKey, Error, Result, Tenant};
use sqlx::query::QueryScalar;
use sqlx::sqlite::{SqliteArguments, SqliteRow};
use sqlx::{AssertSqlSafe, Row, Sqlite};

use super::{Bound, NOW_US, Queries, RECORD_COLUMNS};
use crate::error::{corrupt, map};

impl Queries {
    /// `Admin::forget` of `key` at `fence`: one row changed, or none.
    pub(crate) fn bind_forget(&self, key: &EffectKey, fence: i64) -> Bound {
        sqlx::query(AssertSqlSafe(self.forget.clone()))
            .bind(key.as_str())
            .bind(fence)
    }

    /// `Admin::erase` of `tenant`'s `subject`: the keys it emptied.
    pub(crate) fn bind_erase(
        &self,
        tenant: &Tenant,
        subject: &str,
    ) -> QueryScalar<'static, Sqlite, String, SqliteArguments> {
        sqlx::query_scalar(AssertSqlSafe(self.erase.clone()))
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// The keys of `tenant`'s `subject` in progress.
    pub(crate) fn bind_erase_pending(
        &self,
        tenant: &Tenant,
        subject: &str,
    ) -> QueryScalar<'static, Sqlite, String, SqliteArguments> {
        sqlx::query_scalar(AssertSqlSafe(self.erase_pending.clone()))
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// `Admin::replace_outcome`: one row changed, or none.
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

    /// `Admin::prunable`: how many records prune would delete now.
    pub(crate) fn bind_prunable_count(&self) -> QueryScalar<'static, Sqlite, i64, SqliteArguments> {
        sqlx::query_scalar(AssertSqlSafe(self.prunable_count.clone()))
    }
}

/// An operator listing built by [`records`] or [`stats`] (its text and
/// arguments), bound.
pub(crate) fn bind_listing(text: String, args: Vec<Arg>) -> Bound {
    args.into_iter()
        .fold(sqlx::query(AssertSqlSafe(text)), |query, a| match a {
            Arg::Text(s) => query.bind(s),
            Arg::Int(i) => query.bind(i),
        })
}

// The operator's statements (`oncely::admin::Admin`): built per query,
// because which filters apply decides which index serves it.

/// A value bound to an admin statement, in the order of its `?`s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
}

/// What a record is, as an operator sees it, on the statement's clock
/// `c.now` ([`filter_where`]).
fn filter_sql(filter: Filter) -> String {
    filter_where(
        filter,
        &FilterSql {
            at_most_once: "e.at_most_once = 1",
            not_at_most_once: "e.at_most_once = 0",
            ended: "e.lease_expires_at <= c.now",
            running: "e.lease_expires_at > c.now",
            truth: "1",
        },
    )
}

/// The part of the WHERE that picks a tenant (and kind, and subject)
/// ([`scope_where`]): a range of the primary key, or the key itself when
/// all three are given, so the key's index serves it. The columns are
/// compared too, which keeps the range exact.
fn scope_sql(
    tenant: Option<&Tenant>,
    kind: Option<&str>,
    subject: Option<&str>,
    args: &mut Vec<Arg>,
) -> String {
    let columns = ["e.key", "e.tenant", "e.kind", "e.subject"];
    scope_where(tenant, kind, subject, true, columns, "1", |v| {
        args.push(Arg::Text(v));
        "?".to_owned()
    })
}

/// `Admin::records`: the records `q` selects, oldest first (`created_at`,
/// then the key, BINARY: byte order), after its cursor, at most its page
/// size, each with the statement's clock (`now`).
pub(crate) fn records(t: &str, q: &RecordQuery) -> Result<(String, Vec<Arg>), Error> {
    let mut args = Vec::new();
    let mut w = vec![scope_sql(
        q.tenant.as_ref(),
        q.kind.as_deref(),
        q.subject.as_deref(),
        &mut args,
    )];
    if let Some(since) = q.since {
        w.push("e.created_at >= ?".to_owned());
        args.push(Arg::Int(oncely::backend::to_micros(since)?));
    }
    if let Some(c) = &q.after {
        let at = oncely::backend::to_micros(c.created_at)?;
        w.push("(e.created_at > ? OR (e.created_at = ? AND e.key > ?))".to_owned());
        args.extend([Arg::Int(at), Arg::Int(at), Arg::Text(c.key.as_str().to_owned())]);
    }
    w.push(filter_sql(q.filter));
    args.push(Arg::Int(i64::from(q.page_size())));
    Ok((
        format!(
            "SELECT {RECORD_COLUMNS}, c.now
             FROM (SELECT {NOW_US} AS now) AS c
             JOIN \"{t}\" AS e ON {}
             ORDER BY e.created_at, e.key
             LIMIT ?",
            w.join(" AND ")
        ),
        args,
    ))
}

/// `Admin::stats`: per tenant and kind, the records in each class and the
/// oldest `created_at` of the open ones, on one clock reading.
pub(crate) fn stats(t: &str, tenant: Option<&Tenant>) -> (String, Vec<Arg>) {
    let mut args = Vec::new();
    let scope = scope_sql(tenant, None, None, &mut args);
    let live = filter_sql(Filter::Live);
    let stuck = filter_sql(Filter::Stuck);
    let abandoned = filter_sql(Filter::Abandoned);
    (
        format!(
            "SELECT e.tenant AS tenant, e.kind AS kind, c.now AS now,
                sum({live}) AS live, sum({stuck}) AS stuck, sum({abandoned}) AS abandoned,
                sum(e.state = 'completed') AS completed, sum(e.state = 'released') AS released,
                min(CASE WHEN {live} THEN e.created_at END) AS oldest_live,
                min(CASE WHEN {stuck} THEN e.created_at END) AS oldest_stuck,
                min(CASE WHEN {abandoned} THEN e.created_at END) AS oldest_abandoned
             FROM (SELECT {NOW_US} AS now) AS c
             JOIN \"{t}\" AS e ON {scope}
             GROUP BY e.tenant, e.kind
             ORDER BY e.tenant, e.kind"
        ),
        args,
    )
}

/// A row of `sql::stats`, by name.
pub(crate) fn kind_stats(row: &SqliteRow) -> Result<oncely::admin::KindStats> {
    let tenant: String = row.try_get("tenant").map_err(map)?;
    let tenant = Tenant::parse(&tenant).map_err(|e| corrupt(format!("tenant {tenant:?}: {e}")))?;
    let kind: String = row.try_get("kind").map_err(map)?;
    let now: i64 = row.try_get("now").map_err(map)?;
    let count = |c: &str| -> Result<u64> {
        let n: Option<i64> = row.try_get(c).map_err(map)?;
        Ok(u64::try_from(n.unwrap_or(0)).unwrap_or(0))
    };
    let at = |c: &str| -> Result<Option<SystemTime>> {
        Ok(row.try_get::<Option<i64>, _>(c).map_err(map)?.map(from_micros))
    };
    let mut s = oncely::admin::KindStats::new(tenant, kind, from_micros(now));
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
