//! Columns to values, by name: every row type of `sql` reads its columns
//! through these, never by position.

use oncely::Result;
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row};

use crate::error::{corrupt, map};

/// A `timestamptz` decoded from PostgreSQL's binary format (microseconds
/// since 2000-01-01) into microseconds since the Unix epoch, so neither a
/// date-time crate nor a numeric conversion in SQL is needed.
struct Micros(i64);

/// 2000-01-01T00:00:00Z in microseconds since the Unix epoch.
const PG_EPOCH_US: i64 = 946_684_800_000_000;

impl sqlx::Type<Postgres> for Micros {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        // 1184 is `timestamptz`.
        sqlx::postgres::PgTypeInfo::with_oid(sqlx::postgres::types::Oid(1184))
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for Micros {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        match value.format() {
            sqlx::postgres::PgValueFormat::Binary => {
                let bytes: [u8; 8] = value.as_bytes()?.try_into()?;
                Ok(Micros(i64::from_be_bytes(bytes).saturating_add(PG_EPOCH_US)))
            }
            sqlx::postgres::PgValueFormat::Text => Err("timestamptz in text format".into()),
        }
    }
}

pub(super) fn get<'r, T>(row: &'r PgRow, column: &str) -> Result<T>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(column).map_err(map)
}

pub(super) fn micros(row: &PgRow, column: &str) -> Result<i64> {
    get::<Micros>(row, column).map(|m| m.0)
}

pub(super) fn micros_opt(row: &PgRow, column: &str) -> Result<Option<i64>> {
    get::<Option<Micros>>(row, column).map(|m| m.map(|m| m.0))
}

/// A `bigint` the ledger stores as `u64` (fences, counts).
pub(super) fn unsigned(row: &PgRow, column: &str, what: impl FnOnce(i64) -> String) -> Result<u64> {
    let n: i64 = get(row, column)?;
    u64::try_from(n).map_err(|_| corrupt(what(n)))
}
