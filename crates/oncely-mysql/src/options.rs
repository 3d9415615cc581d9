//! [`MySqlLedgerOptions`]: pool, table and schema settings.

use std::time::Duration;

use oncely::{Error, Result};

/// The default table name.
pub const DEFAULT_TABLE: &str = "oncely_effects";

/// Options for [`MySqlLedger::connect_with`](crate::MySqlLedger::connect_with)
/// and [`MySqlLedger::from_pool_with`](crate::MySqlLedger::from_pool_with).
#[derive(Debug, Clone)]
pub struct MySqlLedgerOptions {
    pub(crate) max_connections: u32,
    pub(crate) acquire_timeout: Duration,
    pub(crate) table: String,
    pub(crate) max_outcome_bytes: usize,
    pub(crate) returning: Option<bool>,
    pub(crate) migrate: bool,
    pub(crate) read_only: bool,
}

impl Default for MySqlLedgerOptions {
    fn default() -> Self {
        MySqlLedgerOptions {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(30),
            table: DEFAULT_TABLE.to_owned(),
            max_outcome_bytes: oncely::MAX_OUTCOME_BYTES,
            returning: None,
            migrate: true,
            read_only: false,
        }
    }
}

impl MySqlLedgerOptions {
    /// Pool size (default 10).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long an operation waits for a pooled connection (default 30 s).
    pub fn acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// The ledger table (default [`DEFAULT_TABLE`]); its horizon table is
    /// `<table>_horizon`. Must be an identifier: an ASCII letter or `_`, then
    /// letters, digits or `_`, at most 48 bytes.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// A lower outcome limit than [`oncely::MAX_OUTCOME_BYTES`] (never higher).
    pub fn max_outcome_bytes(mut self, n: usize) -> Self {
        self.max_outcome_bytes = n.min(oncely::MAX_OUTCOME_BYTES);
        self
    }

    /// Whether claims use `INSERT … RETURNING` (one round trip). `None`
    /// (default) detects it: MariaDB 10.5 and later. `Some(false)` forces
    /// the MySQL 8 path (statement + locking read) on any server.
    pub fn returning(mut self, use_returning: Option<bool>) -> Self {
        self.returning = use_returning;
        self
    }

    /// Whether [`connect_with`](crate::MySqlLedger::connect_with) creates
    /// and upgrades the tables (default `true`). With `false` it creates
    /// nothing: it checks the tables that exist and fails with
    /// [`Error::Config`] naming what is missing or wrong (run
    /// [`MySqlLedger::migrate`](crate::MySqlLedger::migrate) or `oncely
    /// migrate` with a user that may). For deployments whose application
    /// user has no DDL rights.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Opens the ledger for reading only (default `false`): implies
    /// `migrate(false)`; the pool's sessions run `SET SESSION TRANSACTION
    /// READ ONLY`, and the ledger refuses every write (claims, completions,
    /// prune, `begin`) with [`Error::Config`] before any round trip. A user
    /// with `SELECT` on the ledger's two tables can then `get`, list
    /// `abandoned` steps and read the `horizon` (operator tools, the CLI's
    /// read commands).
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Whether connecting may create or upgrade tables.
    pub(crate) fn migrates(&self) -> bool {
        self.migrate && !self.read_only
    }
}

/// Refuses a table name that is not a plain identifier, before any round
/// trip (it is spliced into every statement).
pub(crate) fn check_table(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "table name {name:?} must be an identifier: ASCII letters, digits and '_', \
             not starting with a digit, at most 48 bytes"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_identifiers() {
        assert!(check_table("oncely_effects").is_ok());
        assert!(check_table("_t1").is_ok());
        for bad in [
            "",
            "1t",
            "a-b",
            "a b",
            "t`; DROP TABLE x; --",
            &"t".repeat(49),
            "é",
        ] {
            assert!(matches!(check_table(bad), Err(Error::Config(_))), "{bad:?}");
        }
    }

    #[test]
    fn read_only_implies_no_migration() {
        assert!(MySqlLedgerOptions::default().migrates());
        assert!(!MySqlLedgerOptions::default().migrate(false).migrates());
        assert!(!MySqlLedgerOptions::default().read_only(true).migrates());
        assert!(
            !MySqlLedgerOptions::default()
                .read_only(true)
                .migrate(true)
                .migrates()
        );
    }
}
