//! [`MySqlLedgerOptions`]: pool, table and schema settings, and this
//! backend's URLs (`mysql://`, `mariadb://`; `?table=` is the ledger's own
//! and taken off before sqlx parses the rest).

use std::time::Duration;

use oncely::open::LedgerOptions;
use oncely::open::UrlParams;
use oncely::{Error, Result};
use sqlx::mysql::MySqlConnectOptions;

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
    pub(crate) operation_timeout: Duration,
}

impl Default for MySqlLedgerOptions {
    fn default() -> Self {
        MySqlLedgerOptions {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(30),
            table: DEFAULT_TABLE.to_owned(),
            max_outcome_bytes: oncely::backend::MAX_OUTCOME_BYTES,
            returning: None,
            migrate: true,
            read_only: false,
            operation_timeout: Duration::from_secs(10),
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
    /// `<table>_horizon`, its outbox `<table>_outbox`. Must be an identifier: an ASCII letter or `_`, then
    /// letters, digits or `_`, at most 48 bytes.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// A lower outcome limit than [`oncely::backend::MAX_OUTCOME_BYTES`] (never higher).
    pub fn max_outcome_bytes(mut self, n: usize) -> Self {
        self.max_outcome_bytes = n.min(oncely::backend::MAX_OUTCOME_BYTES);
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
    /// with `SELECT` on the ledger's three tables can then `get`, list
    /// `abandoned` steps and read the `horizon` (operator tools, the CLI's
    /// read commands).
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// The longest one ledger operation on the pool (a claim, a
    /// completion, a read, one prune batch, `begin`…) may take, from the
    /// wait for a connection to the answer (default 10 s). Past it the
    /// operation fails with [`Error::Unavailable`] and its connection is
    /// closed, never returned to the pool: a server that stops answering
    /// (frozen, partitioned away) becomes a bounded, typed error instead of
    /// a call that hangs, and with a host list the ledger looks for another
    /// host (crate docs, "Host lists and failover"). A completion or
    /// release whose answer was lost this way re-reads its record to learn
    /// whether it was applied. It does not bound `claim_in`, `complete_in`
    /// and `migrate`, which run on the caller's connection or may wait on
    /// the migration lock. Applies to
    /// [`MySqlLedger::from_pool_with`](crate::MySqlLedger::from_pool_with)
    /// too. A zero timeout is [`Error::Config`].
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// The default options with what a MySQL URL sets (`?table=`),
    /// checked with the rest of the URL as sqlx reads it: [`Error::Config`]
    /// for another scheme, a parameter neither the ledger nor sqlx reads, a
    /// bad table name or host list. Nothing connects.
    pub fn from_url(url: &str) -> Result<Self> {
        check_scheme(url.trim())?;
        MySqlLedgerOptions::default()
            .with_url(url.trim())
            .map(|(options, _)| options)
    }

    /// Checks what can be checked before any round trip.
    pub(crate) fn validate(&self) -> Result<()> {
        check_table(&self.table)?;
        if self.operation_timeout.is_zero() {
            return Err(Error::Config("operation_timeout must be above zero".into()));
        }
        Ok(())
    }

    /// Whether connecting may create or upgrade tables.
    pub(crate) fn migrates(&self) -> bool {
        self.migrate && !self.read_only
    }
}

/// How [`FromUrl::from_url`](oncely::open::FromUrl::from_url) opens
/// ([`LedgerOptions::for_open`]): [`Access`](oncely::open::Access)
/// as [`MySqlLedgerOptions::migrate`] / [`MySqlLedgerOptions::read_only`].
impl LedgerOptions for MySqlLedgerOptions {
    fn existing_only(self) -> Self {
        self.migrate(false)
    }

    fn reads_only(self) -> Self {
        self.read_only(true)
    }

    /// The pool's acquire timeout, which is also how long connecting may
    /// take: sqlx bounds the pool's first connection by it.
    fn open_within(self, timeout: Duration) -> Self {
        self.acquire_timeout(timeout)
    }
}

/// The URL schemes this backend opens (`FromUrl::SCHEMES`): MariaDB speaks
/// MySQL's protocol, and `mariadb://` lets a URL say which server it names.
pub(crate) const SCHEMES: &[&str] = &["mysql", "mariadb"];

/// The query parameters a URL may set on the ledger itself
/// ([`MySqlLedgerOptions::table`]). There is no `schema`: in MySQL a schema
/// is a database, the URL's path, which the ledger's tables live in.
const OWN_PARAMS: &[&str] = &["table"];

/// The query parameters sqlx reads (sqlx-mysql 0.9,
/// `MySqlConnectOptions::parse_from_url`); it silently ignores any other, so
/// a mistyped one is refused here instead.
const DRIVER_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslca",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "charset",
    "collation",
    "statement-cache-capacity",
    "socket",
    "timezone",
    "time-zone",
];

impl MySqlLedgerOptions {
    /// These options with what `url`'s query sets (`?table=`: the URL wins,
    /// as it is what a deployment configures), checked, and the connection
    /// options of each host of the rest of the URL (one, or a
    /// comma-separated list: `mysql://u@h1:3306,h2:3306/db`, which sqlx
    /// alone refuses). A parameter neither the ledger nor sqlx reads, an
    /// empty or bad host in the list, is [`Error::Config`], before any
    /// round trip.
    pub(crate) fn with_url(mut self, url: &str) -> Result<(Self, Vec<MySqlConnectOptions>)> {
        let params = UrlParams::parse(url, "MySQL", OWN_PARAMS, DRIVER_PARAMS)?;
        if let Some(table) = params.get("table") {
            self.table = table.to_owned();
        }
        self.validate()?;
        let urls = oncely::open::split_hosts(params.driver_url(), "MySQL")?;
        let many = urls.len() > 1;
        let hosts = urls
            .iter()
            .enumerate()
            .map(|(n, url)| match connect_options(url) {
                Err(Error::Config(m)) if many => {
                    Err(Error::Config(format!("host {} of the URL's list: {m}", n + 1)))
                }
                other => other,
            })
            .collect::<Result<Vec<_>>>()?;
        if many && hosts.iter().any(|h| h.get_socket().is_some()) {
            return Err(Error::Config(
                "a MySQL URL with a host list cannot also name a socket (?socket=): it would be \
                 every host's"
                    .into(),
            ));
        }
        Ok((self, hosts))
    }
}

/// Parses a MySQL URL (`mysql://user:password@host:port/database?ssl-mode=…`,
/// sqlx's forms) before anything connects. The message never quotes the URL:
/// it may carry a password.
pub(crate) fn connect_options(url: &str) -> Result<MySqlConnectOptions> {
    url.parse()
        .map_err(|e: sqlx::Error| Error::Config(format!("bad MySQL URL: {e}")))
}

/// Refuses a URL whose scheme is not one of [`SCHEMES`] (sqlx would read any
/// scheme as MySQL's), quoting the scheme only.
pub(crate) fn check_scheme(url: &str) -> Result<()> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    match scheme {
        Some(s) if SCHEMES.contains(&s.as_str()) => Ok(()),
        Some(s)
            if s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b)) =>
        {
            Err(Error::Config(format!(
                "a MySQL ledger's URL starts with mysql:// or mariadb://, not {s}://"
            )))
        }
        _ => Err(Error::Config(
            "a MySQL ledger's URL starts with mysql:// or mariadb://".to_owned(),
        )),
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
    use oncely::open::{Access, OpenOptions};

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
    fn urls_are_checked_before_connecting() {
        for ok in [
            "mysql://root@127.0.0.1:3306/test",
            "MariaDB://h/db",
            "mysql://u:p@h/db?ssl-mode=disabled",
        ] {
            check_scheme(ok).unwrap();
            connect_options(ok).unwrap();
        }
        for bad in [
            "postgres://h/db",
            "mysql:/h/db",
            "h:3306/db",
            "",
            "mysql+x:y//h/db",
        ] {
            assert!(matches!(check_scheme(bad), Err(Error::Config(_))), "{bad:?}");
        }
        for bad in [
            "mysql://root:s3cret@h:99999/db",
            "mysql://root:s3cret@h:port/db",
            "mysql://root:s3cret@[::1/db",
            "mysql://root:s3cret@h/db?ssl-mode=sometimes",
        ] {
            let e = connect_options(bad).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad:?}: {e:?}");
            assert!(!e.to_string().contains("s3cret"), "{e}");
        }
    }

    #[test]
    fn the_url_names_the_table_and_nothing_unknown() {
        let (o, connect) = MySqlLedgerOptions::default()
            .table("from_code")
            .with_url("mysql://root:s3cret@h:3307/billing?ssl-mode=disabled&table=effects")
            .unwrap();
        assert_eq!(o.table, "effects");
        assert_eq!(connect.len(), 1);
        assert_eq!((connect[0].get_host(), connect[0].get_port()), ("h", 3307));
        assert_eq!(connect[0].get_database(), Some("billing"));
        let (o, _) = MySqlLedgerOptions::default()
            .table("from_code")
            .with_url("mariadb://root@h/billing")
            .unwrap();
        assert_eq!(o.table, "from_code");
        for (bad, says) in [
            (
                "mysql://root:s3cret@h/db?tabel=x",
                "unknown MySQL URL parameter 'tabel' (expected table, or one its driver reads: sslmode",
            ),
            // A MySQL schema is the database: the URL's path.
            (
                "mysql://root:s3cret@h/db?schema=billing",
                "unknown MySQL URL parameter 'schema'",
            ),
            (
                "mysql://root:s3cret@h/db?table=a-b",
                "table name \"a-b\" must be an identifier",
            ),
            ("mysql://root:s3cret@h/db?table=a&table=b", "table is given twice"),
        ] {
            match MySqlLedgerOptions::default().with_url(bad) {
                Err(Error::Config(m)) => {
                    assert!(m.contains(says), "{bad}: {m}");
                    assert!(!m.contains("s3cret"), "{bad}: {m}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    /// What the ledger parsed before host lists: sqlx alone refuses one.
    #[test]
    fn sqlx_alone_refuses_a_host_list() {
        let e = "mysql://root@127.0.0.1:3311,127.0.0.1:3312,127.0.0.1:3313/test"
            .parse::<MySqlConnectOptions>()
            .unwrap_err();
        assert!(e.to_string().contains("port"), "{e}");
    }

    #[test]
    fn a_host_list_is_one_set_of_options_per_host() {
        let (o, hosts) = MySqlLedgerOptions::default()
            .with_url("mysql://root:s3cret@127.0.0.1:3311,127.0.0.1:3312,[::1]:3313/test?table=t")
            .unwrap();
        assert_eq!(o.table, "t");
        let names: Vec<String> = hosts.iter().map(crate::hosts::host_name).collect();
        assert_eq!(names, ["127.0.0.1:3311", "127.0.0.1:3312", "[::1]:3313"]);
        assert!(hosts.iter().all(|h| h.get_database() == Some("test")));
        for (bad, says) in [
            ("mysql://root:s3cret@h1:3311,,h2:3312/test", "empty entry"),
            (
                "mysql://root:s3cret@h1:3311,h2:99999/test",
                "host 2 of the URL's list: bad MySQL URL",
            ),
            (
                "mysql://root:s3cret@h1:3311,h2:port/test",
                "host 2 of the URL's list",
            ),
            (
                "mysql://root:s3cret@h1,h2/test?socket=/tmp/s",
                "cannot also name a socket",
            ),
            (
                "mysql://root:s3cret@h1,h2/test?tabel=x",
                "unknown MySQL URL parameter 'tabel'",
            ),
        ] {
            match MySqlLedgerOptions::default().with_url(bad) {
                Err(Error::Config(m)) => {
                    assert!(m.contains(says), "{bad}: {m}");
                    assert!(!m.contains("s3cret"), "{bad}: {m}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert!(matches!(
            MySqlLedgerOptions::default()
                .operation_timeout(Duration::ZERO)
                .with_url("mysql://h/db"),
            Err(Error::Config(m)) if m.contains("operation_timeout")
        ));
    }

    #[test]
    fn open_options_map_to_ledger_options() {
        let o = MySqlLedgerOptions::for_open(OpenOptions::new(Access::Migrate));
        assert!(o.migrates() && !o.read_only);
        assert_eq!(o.acquire_timeout, MySqlLedgerOptions::default().acquire_timeout);
        let o = MySqlLedgerOptions::for_open(OpenOptions::new(Access::Existing));
        assert!(!o.migrates() && !o.read_only);
        let o = MySqlLedgerOptions::for_open(
            OpenOptions::new(Access::ReadOnly).connect_timeout(Duration::from_secs(5)),
        );
        assert!(!o.migrates() && o.read_only);
        assert_eq!(o.acquire_timeout, Duration::from_secs(5));
    }

    #[test]
    fn options_from_a_url_are_the_defaults_with_its_table() {
        let o = MySqlLedgerOptions::from_url("mysql://u:s3cret@h1:3306,h2:3306/app?table=effects").unwrap();
        assert_eq!(o.table, "effects");
        assert_eq!(o.acquire_timeout, MySqlLedgerOptions::default().acquire_timeout);
        for bad in ["postgres://u:s3cret@h/app", "mysql://u:s3cret@h/app?tabel=x"] {
            match MySqlLedgerOptions::from_url(bad) {
                Err(Error::Config(m)) => assert!(!m.contains("s3cret"), "{bad}: {m}"),
                other => panic!("{bad}: {other:?}"),
            }
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
