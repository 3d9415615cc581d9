//! # oncely-any
//!
//! [`AnyLedger`]: one ledger type whose backend is picked from a database URL
//! at run time, in the manner of sqlx's `Any` driver. The `oncely` command
//! (`oncely-cli`) and the bench (`oncely-bench`) open every ledger through
//! it; [`scratch`] holds what they set up for a run of their own (a
//! temporary SQLite ledger, a run id).
//!
//! | URL | backend | cargo feature |
//! | --- | --- | --- |
//! | `sqlite:path[?table=T]`, `sqlite://path` (a file; in-memory databases are refused) | `oncely-sqlite` | `sqlite` (default) |
//! | `postgres://…[?schema=S&table=T]`, `postgresql://…` | `oncely-postgres` | `postgres` (default) |
//! | `mysql://…/db[?table=T]`, `mariadb://…` | `oncely-mysql` | `mysql` (default) |
//! | `redis://host:port[/db][?prefix=P&ephemeral=true]` | `oncely-redis`, one server (`ephemeral=true` accepts one that persists nothing) | `redis` (default) |
//! | `redis+cluster://h1:p1,h2:p2,…[?prefix=P&ephemeral=true]` | `oncely-redis`, Redis Cluster | `redis` (default) |
//! | `redis+sentinel://s1:p1,s2:p2,…/master[/db][?prefix=P&wait_replicas=N&wait_timeout_ms=T]` | `oncely-redis`, the primary Sentinel names (followed across failovers; `wait_replicas` acknowledges a write only once N replicas have it) | `redis` (default) |
//! | `nats://h1:p1[,h2:p2,…][?bucket=B&replicas=R]` | `oncely-nats` | `nats` (default) |
//! | `memory:` | the core's [`MemoryLedger`] (a fresh, empty ledger per connect) | always |
//!
//! Each backend crate parses its own URLs
//! ([`FromUrl`]); see its docs for the multi-node
//! forms (`redis+cluster://`, `redis+sentinel://`, a NATS server list with
//! `?bucket=&replicas=`).
//! The URL names the whole ledger: its table (schema, key prefix, bucket)
//! is a query parameter, and any parameter neither the backend nor its
//! driver reads is [`Error::Config`] before anything connects
//! ([`oncely::open::UrlParams`]). An [`AnyLedger`]'s `Display` says
//! which ledger it is (`postgres db:5432/app, table billing.effects`),
//! never a credential; the commands print it with what they read.
//!
//! Adding a backend is its own crate, one line in
//! [`with_backends!`](crate::with_backends) and its cargo feature (here, and
//! forwarded by the crates that pick backends, `oncely-cli` and
//! `oncely-bench`): the [`Scheme`] and [`AnyLedger`] variants, the dispatch
//! from a URL and every [`Ledger`] method follow from it. Only what callers
//! keep in the ledger's SQL database ([`AnyLedger::pool`]: the demo's orders
//! table, the bench's baseline table) is written per SQL backend.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely::admin::{Admin, Erasure, KindStats, RecordQuery};
use oncely::backend::{Capabilities, Claim, Lease, Ledger, Outcome, Record, Watch};
use oncely::open::{FromUrl, OpenOptions};
use oncely::outbox::{Outbox, OutboxStats, Pending, Ticket};
use oncely::{ClaimOptions, EffectKey, Error, MemoryLedger, Result, Tenant};

pub use oncely::open::Access;

pub mod scratch;

/// How long an operator command waits for a connection. The backends'
/// defaults (up to 30 s) are meant for services riding out a failover; an
/// operator at a terminal would wait half a minute to learn that the server
/// is down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The backends this crate knows, one line each: the variant, the name
/// [`Ledger::backend`] reports, the cargo feature, the URL schemes, how the
/// schemes are shown in messages, whether the ledger offers [`Admin`]
/// (`admin` or `no_admin`), whether it has a transactional outbox
/// ([`Outbox`]: `outbox` or `no_outbox`), the SQL pool it runs on (`pool(type)`, for the
/// demo's orders table, or `no_pool`), and the ledger type (which opens
/// them through [`FromUrl`]). The memory ledger of the core is always there
/// and follows the list.
#[macro_export]
#[doc(hidden)]
macro_rules! with_backends {
    ($then:ident) => {
        $then! {
            Sqlite("sqlite", "sqlite", ["sqlite"], "sqlite:", admin, outbox, pool(sqlx::SqlitePool)) => oncely_sqlite::SqliteLedger,
            Postgres("postgres", "postgres", ["postgres", "postgresql"], "postgres://", admin, outbox, pool(sqlx::PgPool)) => oncely_postgres::PgLedger,
            MySql("mysql", "mysql", ["mysql", "mariadb"], "mysql://, mariadb://", admin, outbox, pool(sqlx::MySqlPool)) => oncely_mysql::MySqlLedger,
            Redis("redis", "redis", ["redis", "redis+cluster", "redis+sentinel"], "redis://, redis+cluster://, redis+sentinel://", no_admin, no_outbox, no_pool) => oncely_redis::RedisLedger,
            Nats("nats", "nats", ["nats"], "nats://", no_admin, no_outbox, no_pool) => oncely_nats::NatsKvLedger,
        }
    };
}

/// `match` over an [`AnyLedger`], binding the inner ledger of every variant.
macro_rules! any_match {
    ($any:expr, $l:ident => $body:expr; $($variant:ident $feature:literal),+) => {
        match $any {
            $(
                #[cfg(feature = $feature)]
                AnyLedger::$variant($l) => $body,
            )+
            AnyLedger::Memory($l) => $body,
        }
    };
}

/// `$yes` for a backend whose table line says `admin`, else `$no`.
macro_rules! if_admin {
    (admin, $yes:expr, $no:expr) => {
        $yes
    };
    (no_admin, $yes:expr, $no:expr) => {
        $no
    };
}

/// `$yes` for a backend whose table line says `outbox`, else `$no`.
macro_rules! if_outbox {
    (outbox, $yes:expr, $no:expr) => {
        $yes
    };
    (no_outbox, $yes:expr, $no:expr) => {
        $no
    };
}

/// `$yes` for a backend whose table line names a pool, else `$no`.
macro_rules! if_pool {
    (pool($p:ty), $yes:expr, $no:expr) => {
        $yes
    };
    (no_pool, $yes:expr, $no:expr) => {
        $no
    };
}

/// [`AnyPool`] with a variant per backend whose table line names a pool
/// (the lines are taken one at a time, keeping those with a pool).
macro_rules! define_pool {
    (@keep [$($variant:ident $name:literal $feature:literal $p:ty,)*]) => {
        /// The SQL pool underneath an [`AnyLedger`], for callers that keep
        /// their own tables in the same database (the demo's orders table).
        #[derive(Debug, Clone)]
        #[non_exhaustive]
        pub enum AnyPool {
            $(
                #[doc = concat!("A `", stringify!($p), "`.")]
                #[cfg(feature = $feature)]
                $variant($p),
            )*
        }

        impl AnyPool {
            /// The backend's name, as [`Ledger::backend`] reports it.
            pub fn backend(&self) -> &'static str {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyPool::$variant(_) => $name,
                    )*
                }
            }

            /// Closes the pool, waiting for checked-out connections to come back.
            pub async fn close(&self) {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyPool::$variant(p) => p.close().await,
                    )*
                }
            }
        }
    };
    (@keep [$($kept:tt)*] $variant:ident $name:literal $feature:literal pool($p:ty), $($rest:tt)*) => {
        define_pool!(@keep [$($kept)* $variant $name $feature $p,] $($rest)*);
    };
    (@keep [$($kept:tt)*] $variant:ident $name:literal $feature:literal no_pool, $($rest:tt)*) => {
        define_pool!(@keep [$($kept)*] $($rest)*);
    };
}

macro_rules! define_any {
    ($($variant:ident($name:literal, $feature:literal, [$($scheme:literal),+], $shown:literal, $admin:ident, $outbox:ident, $pool:ident $(($pool_ty:ty))?) => $ty:ty,)+) => {
        define_pool!(@keep [] $($variant $name $feature $pool $(($pool_ty))?,)+);

        /// The backend a database URL names.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Scheme {
            $(
                #[doc = concat!("`", $shown, "` (feature `", $feature, "`).")]
                $variant,
            )+
            /// `memory:`.
            Memory,
        }

        impl Scheme {
            /// Every scheme, in the order of the backend table.
            pub const ALL: &'static [Scheme] = &[$(Scheme::$variant,)+ Scheme::Memory];

            /// The backend's name (`sqlite`, `postgres`, `mysql`, `redis`,
            /// `nats`, `memory`), as [`Ledger::backend`] reports it
            /// (`mariadb://` URLs open the `mysql` backend).
            pub fn name(self) -> &'static str {
                match self {
                    $(Scheme::$variant => $name,)+
                    Scheme::Memory => "memory",
                }
            }

            /// Whether this crate was built with the backend's cargo feature.
            pub fn compiled_in(self) -> bool {
                match self {
                    $(Scheme::$variant => cfg!(feature = $feature),)+
                    Scheme::Memory => true,
                }
            }

            /// The URL schemes (before the `:`) that name this backend.
            pub fn schemes(self) -> &'static [&'static str] {
                match self {
                    $(Scheme::$variant => &[$($scheme),+],)+
                    Scheme::Memory => MemoryLedger::SCHEMES,
                }
            }

            fn shown(self) -> &'static str {
                match self {
                    $(Scheme::$variant => $shown,)+
                    Scheme::Memory => "memory:",
                }
            }
        }

        /// A ledger on whichever backend a URL names. Cheap to clone (each
        /// variant shares its pool or map).
        #[derive(Clone)]
        #[non_exhaustive]
        pub enum AnyLedger {
            $(
                #[doc = concat!("A `", $name, "` ledger.")]
                #[cfg(feature = $feature)]
                $variant($ty),
            )+
            /// The core's in-process ledger.
            Memory(Arc<MemoryLedger>),
        }

        impl AnyLedger {
            /// Opens the backend the URL's scheme names (see the module docs)
            /// with the given [`Access`], through the backend's own
            /// [`FromUrl`].
            ///
            /// The scheme is checked before anything is opened: an unknown
            /// one, or one this binary was built without, fails with
            /// [`Error::Config`]; so does a URL the backend cannot parse. An
            /// unreachable server fails with the backend's
            /// [`Error::Unavailable`]; a schema that is missing or not the
            /// ledger's (with [`Access::Existing`] or [`Access::ReadOnly`])
            /// with [`Error::Config`].
            pub async fn open(url: &str, access: Access) -> Result<AnyLedger> {
                let url = url.trim();
                let options = OpenOptions::new(access).connect_timeout(CONNECT_TIMEOUT);
                match Scheme::of_url(url)? {
                    $(
                        #[cfg(feature = $feature)]
                        Scheme::$variant => Ok(AnyLedger::$variant(<$ty as FromUrl>::from_url(url, options).await?)),
                    )+
                    Scheme::Memory => Ok(AnyLedger::Memory(
                        <Arc<MemoryLedger> as FromUrl>::from_url(url, options).await?,
                    )),
                    #[allow(unreachable_patterns)]
                    other => Err(not_built(other)),
                }
            }

            /// Which backend this is.
            pub fn scheme(&self) -> Scheme {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(_) => Scheme::$variant,
                    )+
                    AnyLedger::Memory(_) => Scheme::Memory,
                }
            }
        }

        /// What the ledger reads, as its backend says it (`postgres
        /// db:5432/app, table billing.effects`; see [`FromUrl`]): never a
        /// credential. Every command prints it with what it read, so that
        /// "no record" is never taken for an answer about another ledger.
        impl fmt::Display for AnyLedger {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                any_match!(self, l => fmt::Display::fmt(l, f); $($variant $feature),+)
            }
        }

        impl Ledger for AnyLedger {
            fn backend(&self) -> &'static str {
                any_match!(self, l => l.backend(); $($variant $feature),+)
            }

            fn capabilities(&self) -> Capabilities {
                any_match!(self, l => l.capabilities(); $($variant $feature),+)
            }

            async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
                any_match!(self, l => l.claim(key, opts).await; $($variant $feature),+)
            }

            async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
                any_match!(self, l => l.complete(lease, outcome).await; $($variant $feature),+)
            }

            async fn release(&self, lease: &Lease) -> Result<()> {
                any_match!(self, l => l.release(lease).await; $($variant $feature),+)
            }

            async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
                any_match!(self, l => l.renew(lease, extend_by).await; $($variant $feature),+)
            }

            async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
                any_match!(self, l => l.get(key).await; $($variant $feature),+)
            }

            async fn prune(&self, limit: u64) -> Result<u64> {
                any_match!(self, l => l.prune(limit).await; $($variant $feature),+)
            }

            async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
                any_match!(self, l => l.abandoned(tenant, limit).await; $($variant $feature),+)
            }

            async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
                any_match!(self, l => l.horizon(tenant, kind).await; $($variant $feature),+)
            }

            fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
                any_match!(self, l => l.unique_violation(error); $($variant $feature),+)
            }

            // The three below have defaults in the trait (a polling watch,
            // claims one after the other); forwarding them is what lets a
            // backend's notifications and one-statement batches reach callers
            // of the `Any` ledger.
            async fn watch(&self, key: &EffectKey) -> Watch {
                any_match!(self, l => l.watch(key).await; $($variant $feature),+)
            }

            async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
                any_match!(self, l => l.claim_many(keys, opts).await; $($variant $feature),+)
            }

            async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
                any_match!(self, l => l.complete_many(items).await; $($variant $feature),+)
            }
        }

        /// The relay's side of the transactional outbox ([`oncely::outbox`])
        /// on the backends whose table line says `outbox`; on the others
        /// every method fails with [`Error::Config`] naming the backend,
        /// before any round trip.
        impl Outbox for AnyLedger {
            async fn claim_messages(&self, limit: u32, lease: Duration) -> Result<Vec<Pending>> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_outbox!($outbox, l.claim_messages(limit, lease).await, { let _ = l; Err(no_outbox(self)) }),
                    )+
                    AnyLedger::Memory(_) => Err(no_outbox(self)),
                }
            }

            async fn mark_sent(&self, tickets: &[Ticket]) -> Result<Vec<bool>> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_outbox!($outbox, l.mark_sent(tickets).await, { let _ = l; Err(no_outbox(self)) }),
                    )+
                    AnyLedger::Memory(_) => Err(no_outbox(self)),
                }
            }

            async fn retry_later(&self, ticket: Ticket, delay: Duration, error: &str) -> Result<bool> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_outbox!($outbox, l.retry_later(ticket, delay, error).await, { let _ = l; Err(no_outbox(self)) }),
                    )+
                    AnyLedger::Memory(_) => Err(no_outbox(self)),
                }
            }

            async fn mark_failed(&self, ticket: Ticket, error: &str) -> Result<bool> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_outbox!($outbox, l.mark_failed(ticket, error).await, { let _ = l; Err(no_outbox(self)) }),
                    )+
                    AnyLedger::Memory(_) => Err(no_outbox(self)),
                }
            }

            async fn prune_sent(&self, older_than: Duration, limit: u32) -> Result<u64> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_outbox!($outbox, l.prune_sent(older_than, limit).await, { let _ = l; Err(no_outbox(self)) }),
                    )+
                    AnyLedger::Memory(_) => Err(no_outbox(self)),
                }
            }

            async fn outbox_stats(&self) -> Result<OutboxStats> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_outbox!($outbox, l.outbox_stats().await, { let _ = l; Err(no_outbox(self)) }),
                    )+
                    AnyLedger::Memory(_) => Err(no_outbox(self)),
                }
            }
        }

        /// The operator capability ([`oncely::admin`]) on the backends whose
        /// table line says `admin` (SQLite, PostgreSQL, MySQL) and memory.
        /// The others (Redis and NATS JetStream KV) keep no index to list or
        /// count records by tenant and kind, so every method fails there
        /// with [`Error::Config`] naming the backend, before any round trip.
        impl Admin for AnyLedger {
            async fn records(&self, query: &RecordQuery) -> Result<Vec<Record>> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_admin!($admin, l.records(query).await, { let _ = l; Err(no_admin(self, "listing records")) }),
                    )+
                    AnyLedger::Memory(l) => l.records(query).await,
                }
            }

            async fn stats(&self, tenant: Option<&Tenant>) -> Result<Vec<KindStats>> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_admin!($admin, l.stats(tenant).await, { let _ = l; Err(no_admin(self, "stats")) }),
                    )+
                    AnyLedger::Memory(l) => l.stats(tenant).await,
                }
            }

            async fn forget(&self, key: &EffectKey, fence: u64) -> Result<()> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_admin!($admin, l.forget(key, fence).await, { let _ = l; Err(no_admin(self, "forget")) }),
                    )+
                    AnyLedger::Memory(l) => l.forget(key, fence).await,
                }
            }

            async fn prunable(&self) -> Result<u64> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_admin!($admin, l.prunable().await, { let _ = l; Err(no_admin(self, "a prune dry run")) }),
                    )+
                    AnyLedger::Memory(l) => l.prunable().await,
                }
            }

            async fn erase(&self, tenant: &Tenant, subject: &str) -> Result<Erasure> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_admin!($admin, l.erase(tenant, subject).await, { let _ = l; Err(no_admin(self, "erase")) }),
                    )+
                    AnyLedger::Memory(l) => l.erase(tenant, subject).await,
                }
            }

            async fn erase_dry_run(&self, tenant: &Tenant, subject: &str) -> Result<Erasure> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_admin!($admin, l.erase_dry_run(tenant, subject).await, { let _ = l; Err(no_admin(self, "an erase dry run")) }),
                    )+
                    AnyLedger::Memory(l) => l.erase_dry_run(tenant, subject).await,
                }
            }

            async fn replace_outcome(&self, key: &EffectKey, fence: u64, expected: &Outcome, outcome: &Outcome) -> Result<bool> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_admin!($admin, l.replace_outcome(key, fence, expected, outcome).await, { let _ = l; Err(no_admin(self, "replacing an outcome")) }),
                    )+
                    AnyLedger::Memory(l) => l.replace_outcome(key, fence, expected, outcome).await,
                }
            }
        }

        impl Scheme {
            /// Whether this backend offers [`Admin`] (listing, stats, forget,
            /// prune dry run): the backends whose table line says `admin`,
            /// and memory.
            pub fn has_admin(self) -> bool {
                match self {
                    $(Scheme::$variant => if_admin!($admin, true, false),)+
                    Scheme::Memory => true,
                }
            }
        }

        impl AnyLedger {
            /// The SQL pool the ledger runs on, or `None` for backends without
            /// one (Redis, NATS, memory).
            pub fn pool(&self) -> Option<AnyPool> {
                match self {
                    $(
                        #[cfg(feature = $feature)]
                        AnyLedger::$variant(l) => if_pool!($pool $(($pool_ty))?, Some(AnyPool::$variant(l.pool().clone())), { let _ = l; None }),
                    )+
                    AnyLedger::Memory(_) => None,
                }
            }
        }

        /// Every compiled-in backend lists the schemes its crate opens.
        #[cfg(test)]
        fn backend_schemes_match_their_crates() {
            $(
                #[cfg(feature = $feature)]
                assert_eq!(Scheme::$variant.schemes(), <$ty as FromUrl>::SCHEMES, "{}", $name);
            )+
        }
    };
}

with_backends!(define_any);

/// The schemes a database URL may start with, as shown in error messages.
pub fn expected_schemes() -> String {
    Scheme::ALL
        .iter()
        .map(|s| s.shown())
        .collect::<Vec<_>>()
        .join(", ")
}

fn not_built(scheme: Scheme) -> Error {
    Error::Config(format!(
        "this oncely binary was built without the '{}' feature, so it cannot open {} URLs",
        scheme.name(),
        scheme.shown()
    ))
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
                    "database URL has no scheme (expected {})",
                    expected_schemes()
                )));
            }
        };
        let found = Scheme::ALL
            .iter()
            .copied()
            .find(|s| s.schemes().contains(&scheme.as_str()))
            .ok_or_else(|| {
                Error::Config(format!(
                    "unknown database URL scheme '{scheme}' (expected {})",
                    expected_schemes()
                ))
            })?;
        if !found.compiled_in() {
            return Err(not_built(found));
        }
        Ok(found)
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl AnyLedger {
    /// Opens the backend a URL names, creating or upgrading its schema:
    /// [`AnyLedger::open`] with [`Access::Migrate`].
    pub async fn connect(url: &str) -> Result<AnyLedger> {
        AnyLedger::open(url, Access::Migrate).await
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

// Only the backends whose table line says `no_admin` call it.
#[cfg_attr(not(any(feature = "redis", feature = "nats")), allow(dead_code))]
fn no_outbox(ledger: &AnyLedger) -> Error {
    Error::Config(format!(
        "the {} backend has no transactional outbox: messages are enqueued in the caller's SQL \
         transaction, so only the SQL ledgers with one offer it",
        ledger.scheme().name()
    ))
}

fn no_admin(ledger: &AnyLedger, what: &str) -> Error {
    Error::Config(format!(
        "{what} is not available on the {} backend: it keeps no index to list or count records \
         by tenant and kind (only SQLite, PostgreSQL and MySQL ledgers offer it)",
        ledger.scheme().name()
    ))
}

impl fmt::Debug for AnyLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The inner ledgers' Debug may show connection options; the backend
        // name is all an operator needs here.
        f.debug_tuple("AnyLedger").field(&self.scheme().name()).finish()
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
        #[cfg(feature = "mysql")]
        for url in ["mysql://root@127.0.0.1:3306/test", "MariaDB://u:pw@db/app"] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::MySql, "{url}");
        }
        #[cfg(feature = "redis")]
        for url in [
            "redis://127.0.0.1:6379",
            "redis://h/2",
            "redis+cluster://a:7000,b:7001",
            "redis+sentinel://a:26379,b:26379/mymaster",
        ] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::Redis, "{url}");
        }
        #[cfg(feature = "nats")]
        for url in ["nats://127.0.0.1:4222", "NATS://a:4222,b:4222?bucket=x"] {
            assert_eq!(Scheme::of_url(url).unwrap(), Scheme::Nats, "{url}");
        }
    }

    #[test]
    fn backend_schemes_are_those_of_their_crates() {
        backend_schemes_match_their_crates();
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

    /// A query parameter that neither the backend nor its driver reads is
    /// refused on every backend, naming it, before anything connects (port
    /// 1: a connection attempt would be `Unavailable`), without the
    /// password; the parameters that name the ledger are accepted.
    #[tokio::test]
    async fn unknown_url_parameters_are_refused_on_every_backend() {
        let dir = std::env::temp_dir().join(format!("oncely-any-{}", std::process::id()));
        let sqlite = format!("sqlite://{}/never.db", dir.display());
        let cases: Vec<(String, &str)> = vec![
            (format!("{sqlite}?mode=rwc&tabel=x"), "SQLite"),
            (
                "postgres://u:hunter2@127.0.0.1:1/db?schema=s&tabel=x".to_owned(),
                "PostgreSQL",
            ),
            (
                "mysql://u:hunter2@127.0.0.1:1/db?table=t&tabel=x".to_owned(),
                "MySQL",
            ),
            (
                "redis://:hunter2@127.0.0.1:1?prefix=p:&tabel=x".to_owned(),
                "Redis",
            ),
            (
                "redis+cluster://:hunter2@127.0.0.1:1,127.0.0.1:2?tabel=x".to_owned(),
                "Redis",
            ),
            ("nats://u:hunter2@127.0.0.1:1?bucket=b&tabel=x".to_owned(), "NATS"),
            ("memory:?tabel=x".to_owned(), "memory"),
        ];
        for (url, what) in cases {
            let Ok(scheme) = Scheme::of_url(&url) else {
                continue;
            };
            for access in [Access::Migrate, Access::Existing, Access::ReadOnly] {
                match AnyLedger::open(&url, access).await {
                    Err(Error::Config(m)) => {
                        assert!(
                            m.contains(&format!("unknown {what} URL parameter 'tabel' (")),
                            "{url}: {m}"
                        );
                        assert!(!m.contains("hunter2"), "{url}: {m}");
                    }
                    Err(e) => panic!("{scheme} {url} {access:?}: {e:?}"),
                    Ok(_) => panic!("{scheme} {url} {access:?} opened"),
                }
            }
        }
        assert!(!dir.exists(), "nothing was created");
    }

    #[test]
    fn unknown_scheme_is_a_config_error_naming_it() {
        let all = "sqlite:, postgres://, mysql://, mariadb://, redis://, redis+cluster://, redis+sentinel://, nats://, \
                   memory:";
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

    /// The `Any` ledger hands out the backend's own watch (the memory
    /// ledger's is notified), not the trait's polling default, and answers
    /// batches through the backend.
    #[tokio::test]
    async fn watch_and_batches_reach_the_backend() {
        let ledger = AnyLedger::connect("memory:").await.unwrap();
        let key = EffectKey::new(&Tenant::new("t").unwrap(), "capture", "order-1").unwrap();
        assert!(ledger.watch(&key).await.is_notified());
        let other = EffectKey::new(&Tenant::new("t").unwrap(), "capture", "order-2").unwrap();
        let opts = ClaimOptions::default();
        let answers = ledger
            .claim_many(&[key.clone(), other.clone(), key.clone()], &opts)
            .await
            .unwrap();
        let leases: Vec<Lease> = answers[..2]
            .iter()
            .map(|a| match a {
                Ok(Claim::Acquired(l)) => l.clone(),
                other => panic!("expected Acquired, got {other:?}"),
            })
            .collect();
        assert!(
            matches!(answers[2], Ok(Claim::InProgress { .. })),
            "{:?}",
            answers[2]
        );
        let outcome = Outcome::from_json(&"ok").unwrap();
        let items: Vec<(Lease, Outcome)> = leases.into_iter().map(|l| (l, outcome.clone())).collect();
        for done in ledger.complete_many(&items).await {
            done.unwrap();
        }
        assert!(matches!(
            ledger.claim(&other, &opts).await.unwrap(),
            Claim::Completed(_)
        ));
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
