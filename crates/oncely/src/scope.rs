//! Where an operator listing's records lie among a ledger's keys: a
//! listing scoped to a tenant (and kind) reads a range of the key's index,
//! not the whole table.

use crate::admin::Filter;
use crate::key::Tenant;
use crate::state::RecordState;

/// The keys a listing of `tenant`, `kind` and `subject`
/// ([`RecordQuery`](crate::admin::RecordQuery)) can match, in the keys'
/// byte order (`tenant/kind:subject`). A backend still compares the
/// tenant, kind and subject columns it is given: the range only narrows
/// the read (a kind's prefix also holds kinds that extend it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRange {
    /// No tenant: any key.
    All,
    /// Tenant, kind and subject: that one key.
    Key(String),
    /// The keys from `start` (included) to `end` (excluded): the ones
    /// beginning with `tenant/` or `tenant/kind:`.
    Prefix {
        /// The prefix itself, the range's first key.
        start: String,
        /// The prefix with its last byte (an ASCII `/` or `:`) raised by one.
        end: String,
    },
}

/// The [`KeyRange`] of a listing of `tenant`, `kind` and `subject`.
pub fn key_range(tenant: Option<&Tenant>, kind: Option<&str>, subject: Option<&str>) -> KeyRange {
    match (tenant, kind, subject) {
        (Some(t), Some(k), Some(s)) => KeyRange::Key(format!("{t}/{k}:{s}")),
        (Some(t), k, _) => {
            let (start, end) = match k {
                Some(k) => (format!("{t}/{k}:"), format!("{t}/{k};")),
                None => (format!("{t}/"), format!("{t}0")),
            };
            KeyRange::Prefix { start, end }
        }
        (None, ..) => KeyRange::All,
    }
}

/// A column an operator listing's scope compares ([`scope_terms`]).
// Exhaustive by design (ARCHITECTURE.md, API boundaries): a key has these
// four parts and no other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScopeColumn {
    /// The whole displayed key (`tenant/kind:subject`), the table's primary key.
    Key,
    /// The tenant column.
    Tenant,
    /// The kind column.
    Kind,
    /// The subject column.
    Subject,
}

/// How a [`ScopeTerm`] compares its column with its value.
// Exhaustive by design: the three comparisons a key range needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScopeOp {
    /// `=`.
    Eq,
    /// `>=`: the range's first key.
    AtLeast,
    /// `<`: past the range's last key.
    Below,
}

impl ScopeOp {
    /// The SQL operator.
    pub(crate) fn sql(self) -> &'static str {
        match self {
            ScopeOp::Eq => "=",
            ScopeOp::AtLeast => ">=",
            ScopeOp::Below => "<",
        }
    }
}

/// One condition of a listing's scope: `column op value`, the value bound
/// as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScopeTerm {
    /// The column compared.
    pub(crate) column: ScopeColumn,
    /// How.
    pub(crate) op: ScopeOp,
    /// The text it is compared with.
    pub(crate) value: String,
}

/// The conditions (joined with `AND`; none: every record) that scope an
/// operator listing to `tenant`, `kind` and `subject`, for every SQL
/// backend: the whole key when all three are given; with `ranges`, a
/// tenant's (or tenant and kind's) [`KeyRange::Prefix`] on the key, for a
/// backend whose key column compares bytes in order (SQLite's `BINARY`,
/// MySQL's `utf8mb4_bin`), so the key's index serves the listing; then the
/// tenant, kind and subject columns themselves, which keep the range exact
/// (a kind's prefix also holds kinds that extend it).
pub(crate) fn scope_terms(
    tenant: Option<&Tenant>,
    kind: Option<&str>,
    subject: Option<&str>,
    ranges: bool,
) -> Vec<ScopeTerm> {
    let term = |column, op, value: &str| ScopeTerm {
        column,
        op,
        value: value.to_owned(),
    };
    let mut terms = Vec::new();
    match key_range(tenant, kind, subject) {
        KeyRange::Key(key) => terms.push(term(ScopeColumn::Key, ScopeOp::Eq, &key)),
        KeyRange::Prefix { start, end } if ranges => {
            terms.push(term(ScopeColumn::Key, ScopeOp::AtLeast, &start));
            terms.push(term(ScopeColumn::Key, ScopeOp::Below, &end));
        }
        KeyRange::Prefix { .. } | KeyRange::All => {}
    }
    if let Some(t) = tenant {
        terms.push(term(ScopeColumn::Tenant, ScopeOp::Eq, t.as_str()));
    }
    if let Some(k) = kind {
        terms.push(term(ScopeColumn::Kind, ScopeOp::Eq, k));
    }
    if let Some(s) = subject {
        terms.push(term(ScopeColumn::Subject, ScopeOp::Eq, s));
    }
    terms
}

/// The WHERE condition that scopes an operator listing to `tenant`, `kind`
/// and `subject`, for every SQL backend: the whole key when all three are
/// given; with `ranges`, a tenant's (or tenant and kind's)
/// [`KeyRange::Prefix`] on the key, for a backend whose key column
/// compares bytes in order (SQLite's `BINARY`, MySQL's `utf8mb4_bin`), so
/// the key's index serves the listing; then the tenant, kind and subject
/// columns themselves, which keep the range exact (a kind's prefix also
/// holds kinds that extend it). Each condition is `column op placeholder`,
/// joined with `AND`, or `everything` (the dialect's true) when there is
/// none. `columns` names the key, tenant,
/// kind and subject columns as the statement spells them; `bind` takes
/// each term's value and returns its placeholder (`?`, `$3`).
pub fn scope_where(
    tenant: Option<&Tenant>,
    kind: Option<&str>,
    subject: Option<&str>,
    ranges: bool,
    columns: [&str; 4],
    everything: &str,
    mut bind: impl FnMut(String) -> String,
) -> String {
    let w: Vec<String> = scope_terms(tenant, kind, subject, ranges)
        .into_iter()
        .map(|t| {
            let column = match t.column {
                ScopeColumn::Key => columns[0],
                ScopeColumn::Tenant => columns[1],
                ScopeColumn::Kind => columns[2],
                ScopeColumn::Subject => columns[3],
            };
            let op = t.op.sql();
            format!("{column} {op} {}", bind(t.value))
        })
        .collect();
    if w.is_empty() {
        everything.to_owned()
    } else {
        w.join(" AND ")
    }
}

/// How a SQL dialect spells what [`filter_where`] compares: the record
/// `e`'s at-most-once flag (and its negation), its lease ended and not
/// ended on the statement's clock `c`, and its true.
#[derive(Debug, Clone, Copy)]
pub struct FilterSql<'a> {
    /// `e.at_most_once` (or `e.at_most_once = 1`).
    pub at_most_once: &'a str,
    /// `NOT e.at_most_once` (or `e.at_most_once = 0`).
    pub not_at_most_once: &'a str,
    /// The lease has ended: `e.lease_expires_at <= c.now`.
    pub ended: &'a str,
    /// The lease has not ended: `e.lease_expires_at > c.now`.
    pub running: &'a str,
    /// The dialect's true.
    pub truth: &'a str,
}

/// What a record is, as an operator sees it ([`Filter`]), as a WHERE
/// condition: the one rule every SQL backend's listings and counts use.
/// Abandoned and stuck leases are stored in progress, and the statement's
/// clock tells them from live ones: abandoned is an at-most-once lease
/// that ended, stuck any other lease that ended.
pub fn filter_where(filter: Filter, sql: &FilterSql<'_>) -> String {
    let FilterSql {
        at_most_once,
        not_at_most_once,
        ended,
        running,
        truth,
    } = *sql;
    match filter {
        Filter::State(RecordState::InProgress) => {
            format!("e.state = 'in_progress' AND NOT ({at_most_once} AND {ended})")
        }
        Filter::State(RecordState::Completed) => "e.state = 'completed'".to_owned(),
        Filter::State(RecordState::Released) => "e.state = 'released'".to_owned(),
        Filter::State(RecordState::Abandoned) | Filter::Abandoned => {
            format!("e.state = 'in_progress' AND {at_most_once} AND {ended}")
        }
        Filter::Live => format!("e.state = 'in_progress' AND {running}"),
        Filter::Stuck => format!("e.state = 'in_progress' AND {not_at_most_once} AND {ended}"),
        Filter::Any => truth.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_or_kind_is_a_prefix_range_and_all_three_are_one_key() {
        let t = Tenant::new("acme").unwrap();
        assert_eq!(key_range(None, Some("capture"), None), KeyRange::All);
        assert_eq!(
            key_range(Some(&t), None, Some("order-1")),
            KeyRange::Prefix {
                start: "acme/".into(),
                end: "acme0".into()
            }
        );
        assert_eq!(
            key_range(Some(&t), Some("capture"), None),
            KeyRange::Prefix {
                start: "acme/capture:".into(),
                end: "acme/capture;".into()
            }
        );
        assert_eq!(
            key_range(Some(&t), Some("capture"), Some("order-1")),
            KeyRange::Key("acme/capture:order-1".into())
        );
        // The next byte after the separator bounds the prefix.
        assert_eq!(b'/' + 1, b'0');
        assert_eq!(b':' + 1, b';');
    }

    #[test]
    fn scope_terms_compare_the_key_then_each_column_given() {
        let t = Tenant::new("acme").unwrap();
        let shown = |terms: Vec<ScopeTerm>| -> Vec<String> {
            terms
                .into_iter()
                .map(|t| format!("{:?} {} {}", t.column, t.op.sql(), t.value))
                .collect()
        };
        assert!(scope_terms(None, None, None, true).is_empty());
        assert_eq!(
            shown(scope_terms(None, Some("capture"), None, true)),
            ["Kind = capture"]
        );
        assert_eq!(
            shown(scope_terms(Some(&t), Some("capture"), None, true)),
            [
                "Key >= acme/capture:",
                "Key < acme/capture;",
                "Tenant = acme",
                "Kind = capture"
            ]
        );
        assert_eq!(
            shown(scope_terms(Some(&t), Some("capture"), None, false)),
            ["Tenant = acme", "Kind = capture"]
        );
        assert_eq!(
            shown(scope_terms(Some(&t), Some("capture"), Some("o-1"), false)),
            [
                "Key = acme/capture:o-1",
                "Tenant = acme",
                "Kind = capture",
                "Subject = o-1"
            ]
        );
        let mut values = Vec::new();
        let mut bind = |v: String| {
            values.push(v);
            format!("${}", values.len())
        };
        let columns = ["e.key", "e.tenant", "e.kind", "e.subject"];
        assert_eq!(
            scope_where(Some(&t), None, None, true, columns, "true", &mut bind),
            "e.key >= $1 AND e.key < $2 AND e.tenant = $3"
        );
        assert_eq!(
            scope_where(None, None, None, true, columns, "true", &mut bind),
            "true"
        );
        assert_eq!(values, ["acme/", "acme0", "acme"]);
    }

    #[test]
    fn filters_are_the_one_rule_in_each_dialect() {
        let pg = FilterSql {
            at_most_once: "e.at_most_once",
            not_at_most_once: "NOT e.at_most_once",
            ended: "e.lease_expires_at <= c.now",
            running: "e.lease_expires_at > c.now",
            truth: "true",
        };
        for (filter, sql) in [
            (
                Filter::State(RecordState::InProgress),
                "e.state = 'in_progress' AND NOT (e.at_most_once AND e.lease_expires_at <= c.now)",
            ),
            (Filter::State(RecordState::Completed), "e.state = 'completed'"),
            (Filter::State(RecordState::Released), "e.state = 'released'"),
            (
                Filter::Abandoned,
                "e.state = 'in_progress' AND e.at_most_once AND e.lease_expires_at <= c.now",
            ),
            (
                Filter::Live,
                "e.state = 'in_progress' AND e.lease_expires_at > c.now",
            ),
            (
                Filter::Stuck,
                "e.state = 'in_progress' AND NOT e.at_most_once AND e.lease_expires_at <= c.now",
            ),
            (Filter::Any, "true"),
        ] {
            assert_eq!(filter_where(filter, &pg), sql, "{filter:?}");
        }
        assert_eq!(
            filter_where(Filter::State(RecordState::Abandoned), &pg),
            filter_where(Filter::Abandoned, &pg)
        );
    }
}
