//! Reading a statement's result: the row types sit next to their
//! statements in `sql/`; what is left here is how a result is read.

/// The first row of a result read to its end (`fetch_all`): this crate
/// never stops reading at a first row (`fetch_optional`, `fetch_one`). A
/// statement's error can follow its rows: a Galera node reports a write set
/// that lost certification (1213) after the rows of `INSERT … RETURNING`,
/// so a claim that stopped at the first row would take a rolled-back insert
/// for a grant, and leave the error on the pooled connection, where the
/// next statement would be the one to fail.
pub(crate) fn first<T>(rows: Vec<T>) -> Option<T> {
    rows.into_iter().next()
}

/// [`first`], for a statement that always returns a row.
pub(crate) fn only<T>(rows: Vec<T>) -> std::result::Result<T, sqlx::Error> {
    first(rows).ok_or(sqlx::Error::RowNotFound)
}
