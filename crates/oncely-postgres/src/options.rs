//! [`PgLedgerOptions`], the builder of a ledger, and the PostgreSQL URL
//! forms it opens (`postgres://…` and `postgresql://…`, parsed by sqlx once
//! per host of a host list; `?schema=`, `?table=` and
//! `?target_session_attrs=` are the ledger's own and taken off first).

use std::time::Duration;

use oncely::open::LedgerOptions;
use oncely::open::UrlParams;
use oncely::{Error, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::error::map;
use crate::hosts::Target;

/// The URL schemes a PostgreSQL ledger opens
/// ([`FromUrl::SCHEMES`](oncely::open::FromUrl::SCHEMES)).
pub(crate) const SCHEMES: &[&str] = &["postgres", "postgresql"];

/// Longest schema or table name accepted (PostgreSQL's limit is 63 bytes; the
/// index, horizon, function and migration table names add a suffix to the
/// table name).
const MAX_SCHEMA_BYTES: usize = 63;
const MAX_TABLE_BYTES: usize = 48;

/// The query parameters a URL may set on the ledger itself
/// ([`PgLedgerOptions::schema`], [`PgLedgerOptions::table`], and which
/// kind of server of a host list to connect to, which sqlx does not read).
const OWN_PARAMS: &[&str] = &["schema", "table", "target_session_attrs"];

/// The query parameters sqlx reads (sqlx-postgres 0.9,
/// `PgConnectOptions::parse_from_url`); it ignores any other with a log
/// line only, so a mistyped one is refused here instead.
const DRIVER_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
    "options[…]",
];

/// Options of [`PgLedger::connect_with`](crate::PgLedger::connect_with) and
/// [`PgLedger::from_pool_with`](crate::PgLedger::from_pool_with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgLedgerOptions {
    pub(crate) max_connections: u32,
    pub(crate) acquire_timeout: Duration,
    pub(crate) test_before_acquire: bool,
    pub(crate) schema: String,
    pub(crate) table: String,
    pub(crate) migrate: bool,
    pub(crate) read_only: bool,
    pub(crate) operation_timeout: Duration,
}

impl Default for PgLedgerOptions {
    /// 16 connections, a 5 s acquire timeout, a 10 s operation timeout, no
    /// ping before acquire, table `public.oncely_effects`, migrations on
    /// connect, read-write.
    fn default() -> Self {
        PgLedgerOptions {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            test_before_acquire: false,
            schema: "public".to_owned(),
            table: "oncely_effects".to_owned(),
            migrate: true,
            read_only: false,
            operation_timeout: Duration::from_secs(10),
        }
    }
}

impl PgLedgerOptions {
    /// Pool size (connections). Only used by
    /// [`PgLedger::connect_with`](crate::PgLedger::connect_with).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How long an operation waits for a pooled connection before failing
    /// with [`Error::Unavailable`]. It bounds opening a connection too (sqlx
    /// opens one inside the wait for it), so it is also the connect timeout.
    /// Only used by [`PgLedger::connect_with`](crate::PgLedger::connect_with).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Whether the pool pings a connection before handing it out (sqlx's
    /// default). Off by default: the ping is a full round trip before every
    /// claim, and a dead connection already surfaces as
    /// [`Error::Unavailable`] on the one operation that hits it (nothing
    /// runs). Only used by
    /// [`PgLedger::connect_with`](crate::PgLedger::connect_with).
    pub fn test_before_acquire(mut self, yes: bool) -> Self {
        self.test_before_acquire = yes;
        self
    }

    /// The schema of the ledger table (default `public`; created by
    /// [`PgLedger::migrate`](crate::PgLedger::migrate) if absent). Lowercase
    /// ASCII letters, digits and `_`, not starting with a digit, at most 63
    /// bytes.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The ledger table's name (default `oncely_effects`). Lowercase ASCII
    /// letters, digits and `_`, not starting with a digit, at most 48 bytes.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Whether [`PgLedger::connect_with`](crate::PgLedger::connect_with) runs
    /// the migrations (default true). With `false` it creates and changes
    /// nothing: it checks what exists and fails with [`Error::Config`]
    /// naming what is missing or wrong (a deployment step runs `oncely
    /// migrate` instead, with a role that may change the schema).
    pub fn migrate(mut self, yes: bool) -> Self {
        self.migrate = yes;
        self
    }

    /// A ledger that only reads (default false), for a role that may only
    /// `SELECT`: implies `migrate(false)`,
    /// [`PgLedger::connect_with`](crate::PgLedger::connect_with) opens every
    /// pooled session with `default_transaction_read_only = on`, and the
    /// ledger refuses its own writes (claims, completions, releases,
    /// renewals, prune, [`PgLedger::migrate`](crate::PgLedger::migrate)) with
    /// [`Error::Config`] before any round trip. [`oncely::backend::Ledger::get`],
    /// [`oncely::backend::Ledger::abandoned`] and [`oncely::backend::Ledger::horizon`] work. On
    /// a pool handed to
    /// [`PgLedger::from_pool_with`](crate::PgLedger::from_pool_with) the
    /// sessions are the pool's; only the ledger's own refusal applies.
    pub fn read_only(mut self, yes: bool) -> Self {
        self.read_only = yes;
        self
    }

    /// The longest one ledger operation (a claim, a completion, a read, one
    /// prune call…) may take, from the wait for a connection to the answer
    /// (default 10 s). Past it the operation fails with
    /// [`Error::Unavailable`] and its connection is closed, never returned
    /// to the pool: a server that stops answering (frozen, partitioned
    /// away) becomes a bounded, typed error instead of a call that hangs,
    /// so an [`OnInProgress::Wait`](oncely::OnInProgress::Wait) holds its
    /// `max` (each of the waiter's claims is bounded by this too). An
    /// operation whose answer was lost may still have been applied: a
    /// completion or release re-reads its record to find out (crate docs,
    /// "Replication and failover"). It does not bound `claim_in` and
    /// `complete_in`, which run on the caller's connection. Applies to
    /// [`PgLedger::from_pool_with`](crate::PgLedger::from_pool_with) too.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Checks the names and sizes; [`Error::Config`] before any round trip.
    pub fn validate(&self) -> Result<()> {
        identifier("schema", &self.schema, MAX_SCHEMA_BYTES)?;
        identifier("table", &self.table, MAX_TABLE_BYTES)?;
        if self.max_connections == 0 {
            return Err(Error::Config("max_connections must be at least 1".into()));
        }
        if self.operation_timeout.is_zero() {
            return Err(Error::Config("operation_timeout must be above zero".into()));
        }
        Ok(())
    }

    /// The default options with what a PostgreSQL URL sets (`?schema=`,
    /// `?table=`), checked with the rest of the URL as sqlx reads it:
    /// [`Error::Config`] for another scheme, a parameter neither the ledger
    /// nor sqlx reads, a bad name or host list. Nothing connects.
    pub fn from_url(url: &str) -> Result<Self> {
        PgLedgerOptions::default()
            .with_url(url)
            .map(|(options, _)| options)
    }

    /// Whether connecting runs the migrations (never for a read-only ledger).
    pub(crate) fn migrates(&self) -> bool {
        self.migrate && !self.read_only
    }

    /// These options with what `url`'s query sets (`?schema=`, `?table=`:
    /// the URL wins, as it is what a deployment configures), validated, and
    /// the connection options of the rest of the URL: one per host of its
    /// host list (`h1:5432,h2:5432`, tried as `?target_session_attrs=`
    /// says). A parameter neither the ledger nor sqlx reads is
    /// [`Error::Config`], before any round trip.
    pub(crate) fn with_url(mut self, url: &str) -> Result<(Self, Connect)> {
        check_scheme(url)?;
        let params = UrlParams::parse(url, "PostgreSQL", OWN_PARAMS, DRIVER_PARAMS)?;
        if let Some(schema) = params.get("schema") {
            self.schema = schema.to_owned();
        }
        if let Some(table) = params.get("table") {
            self.table = table.to_owned();
        }
        self.validate()?;
        let target = match params.get("target_session_attrs") {
            Some(value) => Target::parse(value, self.read_only)?,
            None => Target::default_for(self.read_only),
        };
        let hosts = oncely::open::split_hosts(params.driver_url(), "PostgreSQL")?
            .iter()
            .map(|url| self.connect_options(url))
            .collect::<Result<Vec<_>>>()?;
        Ok((self, Connect { hosts, target }))
    }

    /// The connection options of `url` (without the ledger's parameters)
    /// under these options.
    fn connect_options(&self, url: &str) -> Result<PgConnectOptions> {
        let mut connect = parse_url(url)?;
        if self.read_only {
            // The server refuses writes too, whatever the role may do.
            connect = connect.options([("default_transaction_read_only", "on")]);
        }
        Ok(connect)
    }

    /// The pool these options describe.
    pub(crate) fn pool_options(&self) -> PgPoolOptions {
        PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(self.test_before_acquire)
    }
}

/// How [`FromUrl::from_url`](oncely::open::FromUrl::from_url) opens
/// ([`LedgerOptions::for_open`]).
impl LedgerOptions for PgLedgerOptions {
    fn existing_only(self) -> Self {
        self.migrate(false)
    }

    fn reads_only(self) -> Self {
        self.read_only(true)
    }

    /// One setting bounds both the connect and the wait for a pooled
    /// connection (see [`PgLedgerOptions::acquire_timeout`]).
    fn open_within(self, timeout: Duration) -> Self {
        self.acquire_timeout(timeout)
    }
}

/// What a URL connects to: one set of connection options per host, and
/// which kind of server will do.
#[derive(Debug)]
pub(crate) struct Connect {
    pub(crate) hosts: Vec<PgConnectOptions>,
    pub(crate) target: Target,
}

/// A PostgreSQL URL (`postgres://` or `postgresql://`, any case) as sqlx's
/// connection options. Any other scheme is refused before anything
/// connects: sqlx alone would read `mysql://host:3306/db` as a PostgreSQL
/// server on port 3306. Messages never quote the URL (it may carry a
/// password).
fn parse_url(url: &str) -> Result<PgConnectOptions> {
    check_scheme(url)?;
    url.parse().map_err(map)
}

fn check_scheme(url: &str) -> Result<()> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    if !scheme.is_some_and(|s| SCHEMES.contains(&s.as_str())) {
        return Err(Error::Config(
            "not a PostgreSQL URL: it starts with postgres:// or postgresql://".into(),
        ));
    }
    Ok(())
}

fn identifier(what: &str, s: &str, max: usize) -> Result<()> {
    let ok = !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "{what} name {s:?} is not a plain identifier (lowercase ASCII letters, digits and _, \
             not starting with a digit, at most {max} bytes)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use oncely::open::{Access, OpenOptions};

    use super::*;

    #[test]
    fn only_postgres_urls_parse() {
        for ok in [
            "postgres://app@db/app",
            "postgresql://app:pw@db:5433/app?sslmode=disable",
            "POSTGRES://app@db/app",
        ] {
            assert!(parse_url(ok).is_ok(), "{ok}");
        }
        for bad in [
            "mysql://app:s3cret@db:3306/app",
            "postgres-ish://app:s3cret@db/app",
            "app:s3cret@db/app",
            "",
            "postgres://app:s3cret@db:notaport/app",
        ] {
            match parse_url(bad) {
                Err(Error::Config(m)) => assert!(!m.contains("s3cret"), "{bad}: {m}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_url_names_the_schema_and_table_and_nothing_unknown() {
        let (o, connect) = PgLedgerOptions::default()
            .table("from_code")
            .with_url("postgres://app:s3cret@db:5433/app?sslmode=disable&schema=billing&table=effects")
            .unwrap();
        assert_eq!((o.schema.as_str(), o.table.as_str()), ("billing", "effects"));
        assert_eq!(connect.hosts.len(), 1);
        let connect = &connect.hosts[0];
        assert_eq!((connect.get_host(), connect.get_port()), ("db", 5433));
        assert_eq!(connect.get_database(), Some("app"));
        // What the URL does not name stays as the code set it.
        let (o, _) = PgLedgerOptions::default()
            .table("from_code")
            .with_url("postgres://app@db/app")
            .unwrap();
        assert_eq!((o.schema.as_str(), o.table.as_str()), ("public", "from_code"));
        for (bad, says) in [
            (
                "postgres://app:s3cret@db/app?tabel=x",
                "unknown PostgreSQL URL parameter 'tabel' (expected schema, table, target_session_attrs, or one its driver reads: sslmode",
            ),
            (
                "postgres://app:s3cret@db/app?table=Effects",
                "table name \"Effects\" is not a plain identifier",
            ),
            (
                "postgres://app:s3cret@db/app?schema=a-b",
                "schema name \"a-b\" is not a plain identifier",
            ),
            (
                "postgres://app:s3cret@db/app?table=",
                "table name \"\" is not a plain identifier",
            ),
            (
                "postgres://app:s3cret@db/app?table=a&table=b",
                "table is given twice",
            ),
            ("mysql://app:s3cret@db/app?table=x", "not a PostgreSQL URL"),
            (
                "postgres://app:s3cret@h1,h2/app?target_session_attrs=standby",
                "target_session_attrs=standby is for a ledger that only reads",
            ),
            (
                "postgres://app:s3cret@h1,h2/app?target_session_attrs=readwrite",
                "is not one of any, read-write",
            ),
            ("postgres://app:s3cret@h1,,h2/app", "host list has an empty entry"),
        ] {
            match PgLedgerOptions::default().with_url(bad) {
                Err(Error::Config(m)) => {
                    assert!(m.contains(says), "{bad}: {m}");
                    assert!(!m.contains("s3cret"), "{bad}: {m}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        // sqlx's own parameters pass, the bracketed options included.
        PgLedgerOptions::default()
            .with_url("postgres://app@db/app?options[search_path]=x&application_name=a&table=t")
            .unwrap();
    }

    #[test]
    fn a_host_list_is_one_set_of_options_per_host() {
        // sqlx alone refuses it ("invalid port number").
        assert!(parse_url("postgres://u@h1:5440,h2:5441/test").is_err());
        let (o, connect) = PgLedgerOptions::default()
            .with_url("postgres://u@h1:5440,h2:5441/test?target_session_attrs=read-write&table=t")
            .unwrap();
        assert_eq!(o.table, "t");
        assert_eq!(connect.target, Target::ReadWrite);
        let hosts: Vec<_> = connect
            .hosts
            .iter()
            .map(|c| {
                (
                    c.get_host().to_owned(),
                    c.get_port(),
                    c.get_database().map(str::to_owned),
                )
            })
            .collect();
        assert_eq!(
            hosts,
            [
                ("h1".to_owned(), 5440, Some("test".to_owned())),
                ("h2".to_owned(), 5441, Some("test".to_owned()))
            ]
        );
        // Without the parameter a ledger that writes wants a writable server,
        // one that only reads takes any; `primary` and `any` are accepted.
        let (_, c) = PgLedgerOptions::default()
            .with_url("postgres://u@h1/test")
            .unwrap();
        assert_eq!(c.target, Target::ReadWrite);
        let (_, c) = PgLedgerOptions::default()
            .read_only(true)
            .with_url("postgres://u@h1,h2/test?target_session_attrs=prefer-standby")
            .unwrap();
        assert_eq!(c.target, Target::PreferStandby);
        for (value, target) in [("primary", Target::Primary), ("any", Target::Any)] {
            let (_, c) = PgLedgerOptions::default()
                .with_url(&format!("postgres://u@h1,h2/test?target_session_attrs={value}"))
                .unwrap();
            assert_eq!(c.target, target);
        }
    }

    #[test]
    fn options_from_a_url_are_the_defaults_with_its_names() {
        let o = PgLedgerOptions::from_url("postgres://u:s3cret@db/app?schema=billing&table=effects").unwrap();
        assert_eq!(o, PgLedgerOptions::default().schema("billing").table("effects"));
        for bad in ["mysql://u:s3cret@db/app", "postgres://u:s3cret@db/app?tabel=x"] {
            match PgLedgerOptions::from_url(bad) {
                Err(Error::Config(m)) => assert!(!m.contains("s3cret"), "{bad}: {m}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn open_options_map_to_ledger_options() {
        let o = PgLedgerOptions::for_open(OpenOptions::new(Access::Migrate));
        assert_eq!(o, PgLedgerOptions::default());
        let o = PgLedgerOptions::for_open(OpenOptions::new(Access::Existing));
        assert!(!o.migrates() && !o.read_only);
        let o = PgLedgerOptions::for_open(
            OpenOptions::new(Access::ReadOnly).connect_timeout(Duration::from_millis(1500)),
        );
        assert!(!o.migrates() && o.read_only);
        assert_eq!(o.acquire_timeout, Duration::from_millis(1500));
    }
}
