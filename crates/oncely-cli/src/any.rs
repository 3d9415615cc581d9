//! [`AnyLedger`]: one ledger type whose backend is picked from a database URL
//! at run time, in the manner of sqlx's `Any` driver.
//!
//! | URL | backend | cargo feature |
//! | --- | --- | --- |
//! | `sqlite:path`, `sqlite://path`, `sqlite::memory:` | `oncely-sqlite` | `sqlite` (default) |
//! | `postgres://…`, `postgresql://…` | `oncely-postgres` | `postgres` (default) |
//! | `memory:` | the core's [`MemoryLedger`] (a fresh, empty ledger per connect) | always |
//!
//! Adding a backend (mysql, redis, nats) means one enum variant behind its
//! feature, one arm in [`Scheme::of_url`], one in [`AnyLedger::connect`] and
//! one line in the `each!` macro; every [`Ledger`] method follows from that.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Lease, Ledger, MemoryLedger, Outcome, Record,
    Result, Tenant,
};

/// The schemes a database URL may start with, as shown in error messages.
pub const EXPECTED_SCHEMES: &str = "sqlite:, postgres://, memory:";

/// The backend a database URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// `sqlite:` and `sqlite://`.
    Sqlite,
    /// `postgres://` and `postgresql://`.
    Postgres,
    /// `memory:`.
    Memory,
}

impl Scheme {
    /// Reads the scheme of a database URL without connecting.
    ///
    /// Fails with [`Error::Config`] for a URL without a scheme, an unknown
    /// scheme, or a backend this binary was built without. The message quotes
    /// the scheme only, never the rest of the URL (it may hold a password).
    pub fn of_url(url: &str) -> Result<Scheme> {
        let url = url.trim();
        let scheme = match url.split_once(':') {
            Some((s, _))
                if !s.is_empty()
                    && s.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b)) =>
            {
                s.to_ascii_lowercase()
            }
            _ => {
                return Err(Error::Config(format!(
                    "database URL has no scheme (expected {EXPECTED_SCHEMES})"
                )));
            }
        };
        let found = match scheme.as_str() {
            "sqlite" => Scheme::Sqlite,
            "postgres" | "postgresql" => Scheme::Postgres,
            "memory" => Scheme::Memory,
            other => {
                return Err(Error::Config(format!(
                    "unknown database URL scheme '{other}' (expected {EXPECTED_SCHEMES})"
                )));
            }
        };
        if !found.compiled_in() {
            return Err(Error::Config(format!(
                "this oncely binary was built without the '{}' feature, so it cannot open {scheme}: URLs",
                found.name()
            )));
        }
        Ok(found)
    }

    /// The backend's name (`sqlite`, `postgres`, `memory`), as
    /// [`Ledger::backend`] reports it.
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Sqlite => "sqlite",
            Scheme::Postgres => "postgres",
            Scheme::Memory => "memory",
        }
    }

    /// Whether this binary was built with the backend's cargo feature.
    pub fn compiled_in(self) -> bool {
        match self {
            Scheme::Sqlite => cfg!(feature = "sqlite"),
            Scheme::Postgres => cfg!(feature = "postgres"),
            Scheme::Memory => true,
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A ledger on whichever backend a URL names. Cheap to clone (each variant
/// shares its pool or map).
#[derive(Clone)]
#[non_exhaustive]
pub enum AnyLedger {
    /// An `oncely-sqlite` ledger.
    #[cfg(feature = "sqlite")]
    Sqlite(oncely_sqlite::SqliteLedger),
    /// An `oncely-postgres` ledger.
    #[cfg(feature = "postgres")]
    Postgres(oncely_postgres::PgLedger),
    /// The core's in-process ledger.
    Memory(Arc<MemoryLedger>),
}

/// The SQL pool underneath an [`AnyLedger`], for callers that keep their own
/// tables in the same database (the demo's orders table).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyPool {
    /// A SQLite pool.
    Sqlite(sqlx::SqlitePool),
    /// A PostgreSQL pool.
    Postgres(sqlx::PgPool),
}

/// Calls `$body` with `$l` bound to the inner ledger of every variant.
macro_rules! each {
    ($any:expr, $l:ident => $body:expr) => {
        match $any {
            #[cfg(feature = "sqlite")]
            AnyLedger::Sqlite($l) => $body,
            #[cfg(feature = "postgres")]
            AnyLedger::Postgres($l) => $body,
            AnyLedger::Memory($l) => $body,
        }
    };
}

impl AnyLedger {
    /// Connects to the backend the URL's scheme names (see the module docs).
    ///
    /// The scheme is checked before anything is opened: an unknown one fails
    /// with [`Error::Config`]. An unreachable server fails with the backend's
    /// [`Error::Unavailable`].
    pub async fn connect(url: &str) -> Result<AnyLedger> {
        let url = url.trim();
        match Scheme::of_url(url)? {
            #[cfg(feature = "sqlite")]
            Scheme::Sqlite => Ok(AnyLedger::Sqlite(
                oncely_sqlite::SqliteLedger::connect(url).await?,
            )),
            #[cfg(feature = "postgres")]
            Scheme::Postgres => Ok(AnyLedger::Postgres(
                oncely_postgres::PgLedger::connect(url).await?,
            )),
            Scheme::Memory => Ok(AnyLedger::Memory(Arc::new(MemoryLedger::new()))),
            #[allow(unreachable_patterns)]
            other => Err(Error::Config(format!(
                "this oncely binary was built without the '{other}' feature"
            ))),
        }
    }

    /// Which backend this is.
    pub fn scheme(&self) -> Scheme {
        match self {
            #[cfg(feature = "sqlite")]
            AnyLedger::Sqlite(_) => Scheme::Sqlite,
            #[cfg(feature = "postgres")]
            AnyLedger::Postgres(_) => Scheme::Postgres,
            AnyLedger::Memory(_) => Scheme::Memory,
        }
    }

    /// The SQL pool the ledger runs on, or `None` for backends without one
    /// (memory).
    pub fn pool(&self) -> Option<AnyPool> {
        match self {
            #[cfg(feature = "sqlite")]
            AnyLedger::Sqlite(l) => Some(AnyPool::Sqlite(l.pool().clone())),
            #[cfg(feature = "postgres")]
            AnyLedger::Postgres(l) => Some(AnyPool::Postgres(l.pool().clone())),
            AnyLedger::Memory(_) => None,
        }
    }

    /// Closes the backend's connections (a no-op for memory). Waits for
    /// checked-out connections to come back.
    pub async fn close(&self) {
        if let Some(pool) = self.pool() {
            match pool {
                AnyPool::Sqlite(p) => p.close().await,
                AnyPool::Postgres(p) => p.close().await,
            }
        }
    }
}

impl fmt::Debug for AnyLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The inner ledgers' Debug may show connection options; the backend
        // name is all an operator needs here.
        f.debug_tuple("AnyLedger").field(&self.scheme().name()).finish()
    }
}

impl Ledger for AnyLedger {
    fn backend(&self) -> &'static str {
        each!(self, l => l.backend())
    }

    fn capabilities(&self) -> Capabilities {
        each!(self, l => l.capabilities())
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        each!(self, l => l.claim(key, opts).await)
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        each!(self, l => l.complete(lease, outcome).await)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        each!(self, l => l.release(lease).await)
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        each!(self, l => l.renew(lease, extend_by).await)
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        each!(self, l => l.get(key).await)
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        each!(self, l => l.prune(limit).await)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        each!(self, l => l.abandoned(tenant, limit).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_message(url: &str) -> String {
        match Scheme::of_url(url) {
            Err(Error::Config(m)) => m,
            other => panic!("{url}: expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn schemes_pick_backends() {
        let cases = [
            ("memory:", Scheme::Memory),
            ("MEMORY:", Scheme::Memory),
            ("  memory:  ", Scheme::Memory),
        ];
        for (url, want) in cases {
            assert_eq!(Scheme::of_url(url).unwrap(), want, "{url}");
        }
        #[cfg(feature = "sqlite")]
        for url in ["sqlite:demo.db", "sqlite:///tmp/x.db?mode=rwc", "sqlite::memory:"] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::Sqlite, "{url}");
        }
        #[cfg(feature = "postgres")]
        for url in ["postgres://u@h/db", "postgresql://u:secret@h:5432/db"] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::Postgres, "{url}");
        }
    }

    #[test]
    fn unknown_scheme_is_a_config_error_naming_it() {
        assert_eq!(
            config_message("mongodb://localhost/x"),
            "unknown database URL scheme 'mongodb' (expected sqlite:, postgres://, memory:)"
        );
        assert_eq!(
            config_message("x:whatever"),
            "unknown database URL scheme 'x' (expected sqlite:, postgres://, memory:)"
        );
    }

    #[test]
    fn url_without_scheme_is_rejected_without_echoing_it() {
        for url in ["", "demo.db", ":memory:", "/tmp/x.db", "user name:secret@host"] {
            let m = config_message(url);
            assert!(m.contains("no scheme"), "{url}: {m}");
            assert!(!m.contains("secret"), "{url}: {m}");
        }
    }

    #[test]
    fn error_never_quotes_the_password() {
        let m = config_message("mysqlx://root:hunter2@db/x");
        assert!(m.contains("'mysqlx'"), "{m}");
        assert!(!m.contains("hunter2"), "{m}");
    }

    #[tokio::test]
    async fn memory_ledger_round_trips_through_any() {
        let ledger = AnyLedger::connect("memory:").await.unwrap();
        assert_eq!(ledger.backend(), "memory");
        assert_eq!(ledger.scheme(), Scheme::Memory);
        assert!(ledger.pool().is_none());
        let key = EffectKey::new(&Tenant::new("t").unwrap(), "capture", "order-1").unwrap();
        let lease = match ledger.claim(&key, &ClaimOptions::default()).await.unwrap() {
            Claim::Acquired(l) => l,
            other => panic!("expected Acquired, got {other:?}"),
        };
        ledger
            .complete(&lease, &Outcome::from_json(&"ok").unwrap())
            .await
            .unwrap();
        let again = ledger
            .clone()
            .claim(&key, &ClaimOptions::default())
            .await
            .unwrap();
        assert!(matches!(again, Claim::Completed(_)), "{again:?}");
    }

    #[tokio::test]
    async fn connect_refuses_an_unknown_scheme_before_connecting() {
        let err = AnyLedger::connect("mongodb://127.0.0.1:27017").await.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
        assert!(err.to_string().contains("'mongodb'"), "{err}");
    }
}
