//! [`AnyLedger`]: one ledger type whose backend is picked from a database URL
//! at run time, in the manner of sqlx's `Any` driver.
//!
//! | URL | backend | cargo feature |
//! | --- | --- | --- |
//! | `sqlite:path`, `sqlite://path` (a file; in-memory databases are refused) | `oncely-sqlite` | `sqlite` (default) |
//! | `postgres://…`, `postgresql://…` | `oncely-postgres` | `postgres` (default) |
//! | `mysql://…`, `mariadb://…` | `oncely-mysql` | `mysql` (default) |
//! | `redis://host:port[/db]` | `oncely-redis`, one server | `redis` (default) |
//! | `redis+cluster://h1:p1,h2:p2,…` | `oncely-redis`, Redis Cluster | `redis` (default) |
//! | `nats://h1:p1[,h2:p2,…][?bucket=B&replicas=R]` | `oncely-nats` | `nats` (default) |
//! | `memory:` | the core's [`MemoryLedger`] (a fresh, empty ledger per connect) | always |
//!
//! Multi-node URLs:
//!
//! - **Redis Cluster**: `redis+cluster://` followed by the seed nodes,
//!   comma-separated, each `host:port` or a full `redis://host:port` URL. The
//!   client learns the rest of the topology from any of them. Credentials on
//!   the first node (`redis+cluster://user:pw@h1:7000,h2:7000`) apply to the
//!   nodes that carry none, and a query string (`?protocol=resp3`) applies to
//!   every node. A plain `redis://` URL names one server; a comma in it is
//!   refused with a pointer to `redis+cluster://`.
//! - **NATS**: one server or a comma-separated list (`nats://n1:4222,n2:4222`
//!   or `nats://n1:4222,nats://n2:4222`). The query string, for the whole
//!   list, sets the ledger's KV bucket (`bucket`, default `oncely_effects`)
//!   and its replica count (`replicas`, 1 or 3, default 1); any other
//!   parameter is refused.
//!
//! Adding a backend means one enum variant behind its feature, one arm in
//! [`Scheme::of_url`], one in [`AnyLedger::connect`] and one line in the
//! `each!` macro; every [`Ledger`] method follows from that.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Lease, Ledger, MemoryLedger, Outcome, Record,
    Result, Tenant,
};

/// The schemes a database URL may start with, as shown in error messages.
pub const EXPECTED_SCHEMES: &str =
    "sqlite:, postgres://, mysql://, mariadb://, redis://, redis+cluster://, nats://, memory:";

/// How long a MySQL connection may take to open or to be handed out by the
/// pool. The backend's default (30 s) is meant for services riding out a
/// failover; an operator at a terminal would wait half a minute to learn
/// that the server is down.
#[cfg(feature = "mysql")]
const MYSQL_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a command may do to the ledger's storage when it opens it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Create the schema (or bucket) if it is missing and upgrade it: `migrate`
    /// and `demo`.
    Migrate,
    /// Use the schema that exists, after checking it; create and upgrade
    /// nothing: commands that write records (`prune`).
    Existing,
    /// Read only: never create, migrate or write anything, so a mistyped
    /// SQLite path is an error rather than a new empty file, and a role that
    /// may only SELECT can run the command: `get`, `abandoned`.
    ReadOnly,
}

/// The backend a database URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// `sqlite:` and `sqlite://`.
    Sqlite,
    /// `postgres://` and `postgresql://`.
    Postgres,
    /// `mysql://` and `mariadb://`.
    MySql,
    /// `redis://` (one server) and `redis+cluster://` (Redis Cluster).
    Redis,
    /// `nats://` (one server or a comma-separated list).
    Nats,
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
            "mysql" | "mariadb" => Scheme::MySql,
            "redis" | "redis+cluster" => Scheme::Redis,
            "nats" => Scheme::Nats,
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

    /// The backend's name (`sqlite`, `postgres`, `mysql`, `redis`, `nats`,
    /// `memory`), as [`Ledger::backend`] reports it (`mariadb://` URLs open
    /// the `mysql` backend).
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Sqlite => "sqlite",
            Scheme::Postgres => "postgres",
            Scheme::MySql => "mysql",
            Scheme::Redis => "redis",
            Scheme::Nats => "nats",
            Scheme::Memory => "memory",
        }
    }

    /// Whether this binary was built with the backend's cargo feature.
    pub fn compiled_in(self) -> bool {
        match self {
            Scheme::Sqlite => cfg!(feature = "sqlite"),
            Scheme::Postgres => cfg!(feature = "postgres"),
            Scheme::MySql => cfg!(feature = "mysql"),
            Scheme::Redis => cfg!(feature = "redis"),
            Scheme::Nats => cfg!(feature = "nats"),
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
    /// An `oncely-mysql` ledger (MySQL or MariaDB).
    #[cfg(feature = "mysql")]
    MySql(oncely_mysql::MySqlLedger),
    /// An `oncely-redis` ledger (one server or a cluster).
    #[cfg(feature = "redis")]
    Redis(oncely_redis::RedisLedger),
    /// An `oncely-nats` ledger.
    #[cfg(feature = "nats")]
    Nats(oncely_nats::NatsKvLedger),
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
    /// A MySQL / MariaDB pool.
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

impl AnyPool {
    /// Closes the pool, waiting for checked-out connections to come back.
    pub async fn close(&self) {
        match self {
            AnyPool::Sqlite(p) => p.close().await,
            AnyPool::Postgres(p) => p.close().await,
            #[cfg(feature = "mysql")]
            AnyPool::MySql(p) => p.close().await,
        }
    }
}

/// Calls `$body` with `$l` bound to the inner ledger of every variant.
macro_rules! each {
    ($any:expr, $l:ident => $body:expr) => {
        match $any {
            #[cfg(feature = "sqlite")]
            AnyLedger::Sqlite($l) => $body,
            #[cfg(feature = "postgres")]
            AnyLedger::Postgres($l) => $body,
            #[cfg(feature = "mysql")]
            AnyLedger::MySql($l) => $body,
            #[cfg(feature = "redis")]
            AnyLedger::Redis($l) => $body,
            #[cfg(feature = "nats")]
            AnyLedger::Nats($l) => $body,
            AnyLedger::Memory($l) => $body,
        }
    };
}

impl AnyLedger {
    /// Connects to the backend the URL's scheme names (see the module docs),
    /// creating or upgrading its schema: [`AnyLedger::open`] with
    /// [`Access::Migrate`].
    pub async fn connect(url: &str) -> Result<AnyLedger> {
        AnyLedger::open(url, Access::Migrate).await
    }

    /// Opens the backend the URL's scheme names (see the module docs) with
    /// the given [`Access`].
    ///
    /// The scheme (and, for Redis Cluster and NATS, the node list and the
    /// query parameters) is checked before anything is opened: an unknown
    /// one fails with [`Error::Config`]. An unreachable server fails with the
    /// backend's [`Error::Unavailable`]; a schema that is missing or not the
    /// ledger's (with [`Access::Existing`] or [`Access::ReadOnly`]) with
    /// [`Error::Config`].
    pub async fn open(url: &str, access: Access) -> Result<AnyLedger> {
        let url = url.trim();
        let migrate = access == Access::Migrate;
        let read_only = access == Access::ReadOnly;
        match Scheme::of_url(url)? {
            #[cfg(feature = "mysql")]
            Scheme::MySql => Ok(AnyLedger::MySql(
                oncely_mysql::MySqlLedger::connect_with(
                    url,
                    oncely_mysql::MySqlLedgerOptions::default()
                        .acquire_timeout(MYSQL_ACQUIRE_TIMEOUT)
                        .migrate(migrate)
                        .read_only(read_only),
                )
                .await?,
            )),
            #[cfg(feature = "redis")]
            Scheme::Redis => Ok(AnyLedger::Redis(match redis_target(url)? {
                RedisTarget::Single(url) => oncely_redis::RedisLedger::connect(&url).await?,
                RedisTarget::Cluster(nodes) => {
                    let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                    oncely_redis::RedisLedger::connect_cluster(&nodes).await?
                }
            })),
            #[cfg(feature = "nats")]
            Scheme::Nats => {
                let target = nats_target(url)?;
                let mut opts = oncely_nats::NatsKvOptions::default().migrate(migrate);
                if let Some(bucket) = target.bucket {
                    opts = opts.bucket(bucket);
                }
                if let Some(replicas) = target.replicas {
                    opts = opts.replicas(replicas);
                }
                Ok(AnyLedger::Nats(
                    oncely_nats::NatsKvLedger::connect(&target.servers, opts).await?,
                ))
            }
            #[cfg(feature = "sqlite")]
            Scheme::Sqlite => Ok(AnyLedger::Sqlite(
                oncely_sqlite::SqliteLedger::connect_with(
                    url,
                    oncely_sqlite::SqliteLedgerOptions::default()
                        .migrate(migrate)
                        .read_only(read_only),
                )
                .await?,
            )),
            #[cfg(feature = "postgres")]
            Scheme::Postgres => Ok(AnyLedger::Postgres(
                oncely_postgres::PgLedger::connect_with(
                    url,
                    oncely_postgres::PgLedgerOptions::default()
                        .migrate(migrate)
                        .read_only(read_only),
                )
                .await?,
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
            #[cfg(feature = "mysql")]
            AnyLedger::MySql(_) => Scheme::MySql,
            #[cfg(feature = "redis")]
            AnyLedger::Redis(_) => Scheme::Redis,
            #[cfg(feature = "nats")]
            AnyLedger::Nats(_) => Scheme::Nats,
            AnyLedger::Memory(_) => Scheme::Memory,
        }
    }

    /// The SQL pool the ledger runs on, or `None` for backends without one
    /// (Redis, NATS, memory).
    pub fn pool(&self) -> Option<AnyPool> {
        match self {
            #[cfg(feature = "sqlite")]
            AnyLedger::Sqlite(l) => Some(AnyPool::Sqlite(l.pool().clone())),
            #[cfg(feature = "postgres")]
            AnyLedger::Postgres(l) => Some(AnyPool::Postgres(l.pool().clone())),
            #[cfg(feature = "mysql")]
            AnyLedger::MySql(l) => Some(AnyPool::MySql(l.pool().clone())),
            _ => None,
        }
    }

    /// Closes the backend's SQL pool, waiting for checked-out connections to
    /// come back. Redis and NATS connections close when the last clone of
    /// the ledger is dropped (every write they acknowledged is already on
    /// the server); memory has nothing to close.
    pub async fn close(&self) {
        if let Some(pool) = self.pool() {
            pool.close().await;
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

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        each!(self, l => l.horizon(tenant, kind).await)
    }

    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        each!(self, l => l.unique_violation(error))
    }
}

/// The server(s) a `redis://` or `redis+cluster://` URL names.
#[cfg(feature = "redis")]
#[derive(Debug, Clone, PartialEq, Eq)]
enum RedisTarget {
    /// One server: the URL as the redis client takes it.
    Single(String),
    /// A cluster's seed nodes, each a `redis://` URL.
    Cluster(Vec<String>),
}

/// Splits a Redis URL into what [`oncely_redis::RedisLedger`] connects to.
/// Messages never quote the URL (it may hold a password).
#[cfg(feature = "redis")]
fn redis_target(url: &str) -> Result<RedisTarget> {
    const FORMS: &str = "redis://host:port[/db] or redis+cluster://host:port,host:port,…";
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(Error::Config(format!("a Redis URL is {FORMS}")));
    };
    if !scheme.eq_ignore_ascii_case("redis+cluster") {
        if rest.contains(',') {
            return Err(Error::Config(
                "a redis:// URL names one server; give a cluster's nodes as \
                 redis+cluster://host:port,host:port,…"
                    .to_owned(),
            ));
        }
        return Ok(RedisTarget::Single(format!("redis://{rest}")));
    }
    let (list, query) = match rest.split_once('?') {
        Some((list, query)) => (list, Some(query)),
        None => (rest, None),
    };
    let mut userinfo: Option<&str> = None;
    let mut nodes = Vec::new();
    for (i, item) in list.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            continue;
        }
        let item = match item.split_once("://") {
            Some((s, node)) if s.eq_ignore_ascii_case("redis") => node,
            Some(_) => {
                return Err(Error::Config(format!(
                    "redis+cluster:// node {} has a scheme other than redis://; \
                     nodes are host:port or redis://host:port",
                    i + 1
                )));
            }
            None => item,
        };
        let own = item.rsplit_once('@').map(|(u, _)| u);
        // The first node's credentials stand for the cluster's: every node
        // of one cluster takes the same ones.
        if nodes.is_empty() {
            userinfo = own;
        }
        let mut node = String::from("redis://");
        if let (None, Some(u)) = (own, userinfo) {
            node.push_str(u);
            node.push('@');
        }
        node.push_str(item);
        if let Some(q) = query {
            node.push('?');
            node.push_str(q);
        }
        nodes.push(node);
    }
    if nodes.is_empty() {
        return Err(Error::Config(format!(
            "redis+cluster:// lists no nodes (expected {FORMS})"
        )));
    }
    Ok(RedisTarget::Cluster(nodes))
}

/// What a `nats://` URL names: the server list (as `async-nats` takes it)
/// and the ledger options given as query parameters.
#[cfg(feature = "nats")]
#[derive(Debug, Clone, PartialEq, Eq)]
struct NatsTarget {
    servers: String,
    bucket: Option<String>,
    replicas: Option<usize>,
}

/// Splits a NATS URL into servers and options. Messages never quote the
/// URL (it may hold a password or a token).
#[cfg(feature = "nats")]
fn nats_target(url: &str) -> Result<NatsTarget> {
    if !url.contains("://") {
        return Err(Error::Config(
            "a NATS URL is nats://host:port[,host:port…][?bucket=NAME&replicas=1|3]".to_owned(),
        ));
    }
    let (servers, query) = match url.split_once('?') {
        Some((servers, query)) => (servers, query),
        None => (url, ""),
    };
    let mut target = NatsTarget {
        servers: servers.to_owned(),
        bucket: None,
        replicas: None,
    };
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let duplicate = match name {
            "bucket" => target.bucket.replace(value.to_owned()).is_some(),
            "replicas" => {
                let n = value
                    .parse()
                    .map_err(|_| Error::Config("NATS URL parameter replicas must be 1 or 3".to_owned()))?;
                target.replicas.replace(n).is_some()
            }
            _ => {
                // Quote the name only if it is plainly a name: the pair
                // may be a mistyped credential.
                let shown = if name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                    format!(" '{name}'")
                } else {
                    String::new()
                };
                return Err(Error::Config(format!(
                    "unknown NATS URL parameter{shown} (expected bucket, replicas)"
                )));
            }
        };
        if duplicate {
            return Err(Error::Config(format!("NATS URL parameter {name} is given twice")));
        }
    }
    Ok(target)
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
        #[cfg(feature = "mysql")]
        for url in ["mysql://root@127.0.0.1:3306/test", "MariaDB://u:pw@db/app"] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::MySql, "{url}");
        }
        #[cfg(feature = "redis")]
        for url in [
            "redis://127.0.0.1:6379",
            "redis://h/2",
            "redis+cluster://a:7000,b:7001",
        ] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::Redis, "{url}");
        }
        #[cfg(feature = "nats")]
        for url in ["nats://127.0.0.1:4222", "NATS://a:4222,b:4222?bucket=x"] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::Nats, "{url}");
        }
    }

    #[test]
    fn every_scheme_has_a_backend_name_and_a_feature() {
        let all = [
            (Scheme::Sqlite, "sqlite", cfg!(feature = "sqlite")),
            (Scheme::Postgres, "postgres", cfg!(feature = "postgres")),
            (Scheme::MySql, "mysql", cfg!(feature = "mysql")),
            (Scheme::Redis, "redis", cfg!(feature = "redis")),
            (Scheme::Nats, "nats", cfg!(feature = "nats")),
            (Scheme::Memory, "memory", true),
        ];
        for (scheme, name, built) in all {
            assert_eq!(scheme.name(), name);
            assert_eq!(scheme.to_string(), name);
            assert_eq!(scheme.compiled_in(), built, "{name}");
        }
    }

    /// With all features every URL opens its backend; in a slimmer build
    /// (`--no-default-features --features sqlite`) the left-out ones name
    /// the missing feature.
    #[test]
    fn a_backend_left_out_of_the_build_names_its_feature() {
        for (url, scheme) in [
            ("sqlite:x.db", Scheme::Sqlite),
            ("postgres://h/db", Scheme::Postgres),
            ("mariadb://h/db", Scheme::MySql),
            ("redis+cluster://a:1,b:2", Scheme::Redis),
            ("nats://n1:4222", Scheme::Nats),
        ] {
            match Scheme::of_url(url) {
                Ok(found) => {
                    assert!(scheme.compiled_in(), "{url}");
                    assert_eq!(found, scheme, "{url}");
                }
                Err(Error::Config(m)) => {
                    assert!(!scheme.compiled_in(), "{url}: {m}");
                    assert!(
                        m.contains(&format!("built without the '{}' feature", scheme.name())),
                        "{url}: {m}"
                    );
                }
                Err(e) => panic!("{url}: {e:?}"),
            }
        }
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis_urls_name_one_server_or_a_cluster() {
        let single = |url: &str| RedisTarget::Single(url.to_owned());
        let cluster = |nodes: &[&str]| RedisTarget::Cluster(nodes.iter().map(|n| n.to_string()).collect());
        let cases = [
            ("redis://127.0.0.1:6379", single("redis://127.0.0.1:6379")),
            ("REDIS://h:1/3", single("redis://h:1/3")),
            ("redis+cluster://a:7000", cluster(&["redis://a:7000"])),
            (
                "redis+cluster://a:7000, b:7001 ,redis://c:7002,",
                cluster(&["redis://a:7000", "redis://b:7001", "redis://c:7002"]),
            ),
            // The first node's credentials go to the nodes without their
            // own; a node with its own keeps them.
            (
                "redis+cluster://u:pw@a:7000,b:7001,v:x@c:7002",
                cluster(&["redis://u:pw@a:7000", "redis://u:pw@b:7001", "redis://v:x@c:7002"]),
            ),
            // The query applies to every node.
            (
                "redis+cluster://a:7000,b:7001?protocol=resp3",
                cluster(&["redis://a:7000?protocol=resp3", "redis://b:7001?protocol=resp3"]),
            ),
        ];
        for (url, want) in cases {
            assert_eq!(redis_target(url).unwrap(), want, "{url}");
        }
    }

    #[cfg(feature = "redis")]
    #[test]
    fn bad_redis_urls_are_config_errors_without_the_password() {
        for (url, says) in [
            ("redis://:hunter2@a:7000,b:7001", "redis+cluster://"),
            ("redis+cluster://", "no nodes"),
            ("redis+cluster://, ,", "no nodes"),
            ("redis+cluster://a:7000,nats://:hunter2@b:1", "node 2"),
            ("redis:hunter2", "redis://host:port"),
        ] {
            let m = match redis_target(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("hunter2"), "{url}: {m}");
        }
    }

    #[cfg(feature = "nats")]
    #[test]
    fn nats_urls_carry_servers_and_options() {
        let t = nats_target("nats://127.0.0.1:4222").unwrap();
        assert_eq!(
            t,
            NatsTarget {
                servers: "nats://127.0.0.1:4222".to_owned(),
                bucket: None,
                replicas: None
            }
        );
        let t = nats_target("nats://u:pw@n1:4222,n2:4222,nats://n3:4222?bucket=payments&replicas=3").unwrap();
        assert_eq!(
            t,
            NatsTarget {
                servers: "nats://u:pw@n1:4222,n2:4222,nats://n3:4222".to_owned(),
                bucket: Some("payments".to_owned()),
                replicas: Some(3)
            }
        );
        let t = nats_target("nats://n1?&replicas=1&").unwrap();
        assert_eq!((t.bucket, t.replicas), (None, Some(1)));
    }

    #[cfg(feature = "nats")]
    #[test]
    fn bad_nats_parameters_are_config_errors() {
        for (url, says) in [
            ("nats://n1?replicas=three", "replicas must be 1 or 3"),
            ("nats://n1?replicas=", "replicas must be 1 or 3"),
            ("nats://n1?bucket=a&bucket=b", "bucket is given twice"),
            (
                "nats://n1?max_age=9",
                "unknown NATS URL parameter 'max_age' (expected bucket, replicas)",
            ),
            ("nats://n1?token:hunter2", "unknown NATS URL parameter (expected"),
            ("nats:n1", "nats://host:port"),
        ] {
            let m = match nats_target(url) {
                Err(Error::Config(m)) => m,
                other => panic!("{url}: expected Error::Config, got {other:?}"),
            };
            assert!(m.contains(says), "{url}: {m}");
            assert!(!m.contains("hunter2"), "{url}: {m}");
        }
    }

    /// Values the URL parser accepts but the backend refuses still fail
    /// with a typed error before any connection: the NATS options are
    /// validated first.
    #[cfg(feature = "nats")]
    #[tokio::test]
    async fn nats_options_from_the_url_are_validated_before_connecting() {
        // Port 1: nothing listens, so a connection attempt would be
        // Unavailable instead.
        for url in [
            "nats://127.0.0.1:1?replicas=2",
            "nats://127.0.0.1:1?bucket=no.dots",
        ] {
            let err = AnyLedger::connect(url).await.unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{url}: {err:?}");
        }
    }

    #[test]
    fn unknown_scheme_is_a_config_error_naming_it() {
        let all = "sqlite:, postgres://, mysql://, mariadb://, redis://, redis+cluster://, nats://, memory:";
        for (url, scheme) in [
            ("mongodb://localhost/x", "mongodb"),
            ("x:whatever", "x"),
            // TLS variants are not built in; they must not pass for the
            // plain schemes.
            ("rediss://127.0.0.1:6380", "rediss"),
            ("tls://127.0.0.1:4222", "tls"),
        ] {
            assert_eq!(
                config_message(url),
                format!("unknown database URL scheme '{scheme}' (expected {all})")
            );
        }
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

    /// Port 1 on loopback: nothing listens there. Each backend fails
    /// closed with its own `Unavailable`, never a panic or a hang.
    #[tokio::test]
    async fn unreachable_servers_are_unavailable() {
        let urls: &[(&str, &str)] = &[
            #[cfg(feature = "mysql")]
            ("mysql://root@127.0.0.1:1/test", "mysql"),
            #[cfg(feature = "mysql")]
            ("mariadb://root@127.0.0.1:1/test", "mysql"),
            #[cfg(feature = "redis")]
            ("redis://127.0.0.1:1", "redis"),
            #[cfg(feature = "redis")]
            ("redis+cluster://127.0.0.1:1,127.0.0.1:2", "redis"),
            #[cfg(feature = "nats")]
            ("nats://127.0.0.1:1", "nats"),
            #[cfg(feature = "nats")]
            ("nats://127.0.0.1:1,127.0.0.1:2", "nats"),
        ];
        for &(url, backend) in urls {
            match AnyLedger::connect(url).await {
                Err(Error::Unavailable { backend: b, .. }) => assert_eq!(b, backend, "{url}"),
                other => panic!("{url}: expected Unavailable, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn connect_refuses_an_unknown_scheme_before_connecting() {
        let err = AnyLedger::connect("mongodb://127.0.0.1:27017").await.unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
        assert!(err.to_string().contains("'mongodb'"), "{err}");
    }
}
