//! The operator's statements (`oncely::admin::Admin`): forget, and the
//! listings built per query ([`records`], [`stats`]) with their rows.

use oncely::admin::{Filter, RecordQuery};
use oncely::backend::{FilterSql, filter_where, from_micros, scope_where};
use oncely::{EffectKey, Result, Tenant};
use sqlx::mysql::MySqlRow;
use sqlx::{AssertSqlSafe, Row};

use super::{Bound, COLUMNS, NOW_US, Statements, query};
use crate::error::corrupt;

// The operator's statements (`oncely::admin::Admin`): built per query,
// because which filters apply decides which index serves it.

/// A value bound to an admin statement, in the order of its `?`s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
}

/// One clock reading for the whole statement, `c.now_us`: [`NOW_US`] reads
/// `SYSDATE(6)`, evaluated per call; a derived table with `LIMIT` is
/// materialized (never merged into the outer query), so it is read once.
fn clock() -> String {
    format!("(SELECT {NOW_US} AS now_us LIMIT 1) AS c")
}

/// What a record is, as an operator sees it, at `c.now_us`
/// ([`filter_where`]).
fn filter_sql(filter: Filter) -> String {
    filter_where(
        filter,
        &FilterSql {
            at_most_once: "e.at_most_once = 1",
            not_at_most_once: "e.at_most_once = 0",
            ended: "e.lease_expires_us <= c.now_us",
            running: "e.lease_expires_us > c.now_us",
            truth: "TRUE",
        },
    )
}

/// Tenant, kind and subject ([`scope_where`]): a range of the primary key
/// (`utf8mb4_bin` compares code points, which is byte order), or the key
/// itself when all three are given; the columns are compared too, which
/// keeps the range exact.
fn scope_sql(
    tenant: Option<&Tenant>,
    kind: Option<&str>,
    subject: Option<&str>,
    args: &mut Vec<Arg>,
) -> String {
    let columns = ["e.effect_key", "e.tenant", "e.kind", "e.subject"];
    scope_where(tenant, kind, subject, true, columns, "TRUE", |v| {
        args.push(Arg::Text(v));
        "?".to_owned()
    })
}

/// `Admin::records`: oldest first (`created_us`, then the key), after the
/// cursor, at most a page, each with the statement's clock (`now_us`).
pub(crate) fn records(t: &str, q: &RecordQuery) -> Result<(String, Vec<Arg>), oncely::Error> {
    let mut args = Vec::new();
    let mut w = vec![scope_sql(
        q.tenant.as_ref(),
        q.kind.as_deref(),
        q.subject.as_deref(),
        &mut args,
    )];
    if let Some(since) = q.since {
        w.push("e.created_us >= ?".to_owned());
        args.push(Arg::Int(oncely::backend::to_micros(since)?));
    }
    if let Some(c) = &q.after {
        let at = oncely::backend::to_micros(c.created_at)?;
        w.push("(e.created_us > ? OR (e.created_us = ? AND e.effect_key > ?))".to_owned());
        args.extend([Arg::Int(at), Arg::Int(at), Arg::Text(c.key.as_str().to_owned())]);
    }
    w.push(filter_sql(q.filter));
    args.push(Arg::Int(i64::from(q.page_size())));
    let cols: Vec<String> = COLUMNS.split(',').map(|c| format!("e.{}", c.trim())).collect();
    Ok((
        format!(
            "SELECT {}, c.now_us AS now_us FROM {} JOIN `{t}` AS e ON {} \
             ORDER BY e.created_us, e.effect_key LIMIT ?",
            cols.join(", "),
            clock(),
            w.join(" AND ")
        ),
        args,
    ))
}

/// `Admin::stats`: per tenant and kind, the records in each class and the
/// oldest `created_us` of the open ones, at one clock reading. (`COUNT`,
/// not `SUM`: `SUM` of a condition is a DECIMAL.)
pub(crate) fn stats(t: &str, tenant: Option<&Tenant>) -> (String, Vec<Arg>) {
    let mut args = Vec::new();
    let scope = scope_sql(tenant, None, None, &mut args);
    let live = filter_sql(Filter::Live);
    let stuck = filter_sql(Filter::Stuck);
    let abandoned = filter_sql(Filter::Abandoned);
    (
        format!(
            "SELECT e.tenant AS tenant, e.kind AS kind, MIN(c.now_us) AS now_us, \
               COUNT(CASE WHEN {live} THEN 1 END) AS live, COUNT(CASE WHEN {stuck} THEN 1 END) AS stuck, \
               COUNT(CASE WHEN {abandoned} THEN 1 END) AS abandoned, \
               COUNT(CASE WHEN e.state = 'completed' THEN 1 END) AS completed, \
               COUNT(CASE WHEN e.state = 'released' THEN 1 END) AS released, \
               MIN(CASE WHEN {live} THEN e.created_us END) AS oldest_live, \
               MIN(CASE WHEN {stuck} THEN e.created_us END) AS oldest_stuck, \
               MIN(CASE WHEN {abandoned} THEN e.created_us END) AS oldest_abandoned \
             FROM {clock} JOIN `{t}` AS e ON {scope} \
             GROUP BY e.tenant, e.kind ORDER BY e.tenant, e.kind",
            clock = clock(),
        ),
        args,
    )
}

/// `Admin::forget`: a fenced write ([`Statements::bind_complete`] tells
/// what its `in_caller_tx` is).
impl Statements {
    /// [`Statements::forget`] of the completed record of `key` at `fence`.
    pub(crate) fn bind_forget(&self, key: &EffectKey, fence: u64, in_caller_tx: bool) -> Bound {
        query(&self.forget)
            .bind(key.as_str())
            .bind(fence)
            .bind(in_caller_tx)
    }
}

/// `Admin::erase` and `Admin::replace_outcome`.
impl Statements {
    /// [`Statements::erase_lock`] of `tenant`'s `subject`.
    pub(crate) fn bind_erase_lock(&self, tenant: &oncely::Tenant, subject: &str) -> Bound {
        query(&self.erase_lock)
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// [`Statements::erase`] of `tenant`'s `subject`.
    pub(crate) fn bind_erase(&self, tenant: &oncely::Tenant, subject: &str) -> Bound {
        query(&self.erase)
            .bind(tenant.as_str().to_owned())
            .bind(subject.to_owned())
    }

    /// [`Statements::replace_outcome`]: one row changed, or none.
    pub(crate) fn bind_replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &[u8],
        outcome: &[u8],
    ) -> Bound {
        query(&self.replace_outcome)
            .bind(outcome.to_vec())
            .bind(key.as_str().to_owned())
            .bind(fence)
            .bind(expected.to_vec())
    }
}

/// The locked rows of [`Statements::erase_lock`] as an erasure: each key
/// erased or pending by its state (`oncely::backend::erasable`), at the
/// clock the lock read.
pub(crate) fn erasure(rows: &[MySqlRow]) -> Result<oncely::admin::Erasure> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable erase row: {e}"));
    let mut at = None;
    let mut e = oncely::admin::Erasure::new(std::time::SystemTime::UNIX_EPOCH);
    for row in rows {
        at = Some(row.try_get::<i64, _>("now_us").map_err(g)?);
        let Some(k) = row.try_get::<Option<String>, _>("effect_key").map_err(g)? else {
            continue;
        };
        let k = EffectKey::parse(&k).map_err(|err| corrupt(format!("stored key {k:?}: {err}")))?;
        let state: String = row.try_get("state").map_err(g)?;
        let state =
            oncely::backend::RecordState::parse(&state).map_err(|err| corrupt(format!("{k}: {err}")))?;
        e.add(k, state);
    }
    let at = at.ok_or_else(|| corrupt("erase read no clock row".to_owned()))?;
    e.at = oncely::backend::from_micros(at);
    Ok(e)
}

/// A row of [`stats`], by name.
pub(crate) fn kind_stats(row: &MySqlRow) -> Result<oncely::admin::KindStats> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable stats row: {e}"));
    let tenant: String = row.try_get("tenant").map_err(g)?;
    let tenant = oncely::Tenant::parse(&tenant).map_err(|e| corrupt(format!("tenant {tenant:?}: {e}")))?;
    let kind: String = row.try_get("kind").map_err(g)?;
    let now: i64 = row.try_get("now_us").map_err(g)?;
    let count = |c: &str| -> Result<u64> {
        let n: i64 = row.try_get(c).map_err(g)?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    let at = |c: &str| -> Result<Option<std::time::SystemTime>> {
        Ok(row.try_get::<Option<i64>, _>(c).map_err(g)?.map(from_micros))
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

impl Statements {
    /// An operator listing built by [`records`] (rows: [`Stored`](super::Stored) without
    /// `in_tx`) or [`stats`] (rows: [`kind_stats`]), its text and
    /// arguments, behind the ledger's read prefix ([`Statements::read`]),
    /// bound.
    pub(crate) fn bind_listing(&self, text: &str, args: &[Arg]) -> Bound {
        args.iter().fold(
            sqlx::query(AssertSqlSafe(format!("{}{text}", self.read))),
            |q, a| match a {
                Arg::Text(s) => q.bind(s.clone()),
                Arg::Int(i) => q.bind(*i),
            },
        )
    }
}
