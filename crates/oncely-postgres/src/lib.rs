//! # oncely-postgres
//!
//! The PostgreSQL backend of [oncely]: an effect ledger in one table,
//! claimed with one statement per claim, that can also join the caller's own
//! transaction so that the claim, the business writes and the completion
//! commit together.
//!
//! ## Quick start
//!
//! ```no_run
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_postgres::PgLedger;
//!
//! # async fn demo() -> oncely::Result<()> {
//! // Connects, runs the embedded migrations (idempotent) and checks the table.
//! let ledger = PgLedger::connect("postgres://app@db/app").await?;
//! let effects = Effects::new(ledger);
//! let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//! let charge: String = effects
//!     .run(&key, &ClaimOptions::default(), |lease| async move {
//!         // call the payment provider with lease.provider_key() as its idempotency key
//!         Ok(format!("ch_{}", &lease.provider_key()[..8]))
//!     })
//!     .await?;
//! # let _ = charge; Ok(()) }
//! ```
//!
//! ## Exactly once for local writes: `claim_in`
//!
//! When the effect is a write to the same database, claim inside your own
//! transaction. A concurrent duplicate waits until the first transaction
//! ends, then sees [`Claim::Completed`] (or acquires, if the first rolled
//! back). Open the transaction with [`PgLedger::begin`], which is
//! cancel-safe where `Pool::begin` is not (see below).
//!
//! ```no_run
//! use oncely::{Claim, ClaimOptions, EffectKey, Outcome, Tenant, TransactionalLedger};
//! use oncely_postgres::PgLedger;
//!
//! # async fn demo(ledger: PgLedger) -> Result<(), Box<dyn std::error::Error>> {
//! let key = EffectKey::new(&Tenant::global(), "mark-paid", "order-123")?;
//! let mut tx = ledger.begin().await?;
//! match ledger.claim_in(&mut *tx, &key, &ClaimOptions::default()).await? {
//!     Claim::Acquired(lease) => {
//!         // The business write, in the same transaction as the claim.
//!         sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
//!             .bind("order-123")
//!             .execute(&mut *tx)
//!             .await?;
//!         ledger.complete_in(&mut *tx, &lease, &Outcome::from_json(&"paid")?).await?;
//!         // One commit: claim, business write and outcome, or none of them.
//!         tx.commit().await?;
//!     }
//!     Claim::Completed(record) => { /* done before: reply with record.outcome */ }
//!     other => { /* in progress elsewhere or abandoned: let the broker redeliver */ let _ = other; }
//! }
//! # Ok(()) }
//! ```
//!
//! ## Read-only access
//!
//! Operators and dashboards read the ledger with a role that may only
//! `SELECT` (and use the schema): [`PgLedgerOptions::read_only`] opens every
//! pooled session with `default_transaction_read_only`, creates and migrates
//! nothing, refuses the ledger's writes before any round trip, and still
//! checks the table. [`Ledger::get`], [`Ledger::abandoned`] and
//! [`Ledger::horizon`] work. [`PgLedgerOptions::migrate`]`(false)` is the
//! same for a writing role whose schema is migrated by a deployment step
//! (`oncely migrate`).
//!
//! ```no_run
//! use oncely::{Ledger, Tenant};
//! use oncely_postgres::{PgLedger, PgLedgerOptions};
//!
//! # async fn demo() -> oncely::Result<()> {
//! let ledger = PgLedger::connect_with("postgres://auditor@db/app", PgLedgerOptions::default().read_only(true))
//!     .await?;
//! let stuck = ledger.abandoned(&Tenant::global(), 100).await?;
//! # let _ = stuck; Ok(()) }
//! ```
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | atomic claim | one statement: a per-key advisory lock, then `INSERT … ON CONFLICT (key) DO UPDATE … WHERE <takeover>` plus a read of the existing row, one round trip |
//! | caller's transaction | yes: [`TransactionalLedger`] on `&mut PgConnection` (`&mut *tx`); the claim holds its key's transaction-scoped advisory lock until the transaction ends |
//! | durability | a PostgreSQL commit (WAL, as `synchronous_commit` is configured) |
//! | replication | not assumed (`replicated: false`); synchronous standbys are the server's business |
//! | clock | the database's `clock_timestamp()` at the moment each write takes effect: after the claim's wait on its key's lock, and inside a caller's transaction too (never `now()`, the transaction's start). It decides lease expiry, takeover and retention; the worker's clock never does |
//! | fences | the clock's microseconds when the lease is written, or the previous fence + 1 if that is higher ([`next_fence`](oncely::backend::next_fence)): a key never gets a fence it had before, prunes included, as long as the server's clock never steps back by more than the shortest retention in use |
//! | horizon | a watermark per tenant and kind (table `<table>_horizon`): prune raises it to the newest `created_at` it deletes, in the same transaction. A claim with [`ClaimOptions::sent_at`] at or before it fails with [`Error::BeyondHorizon`] when the key is absent (an old message may still take over a released or expired record it finds). A claim without `sent_at` cannot tell a replay of a pruned effect from new work. Records pruned by schema version 1 (before the watermark existed) left none |
//! | schema check | on connect and at the end of [`PgLedger::migrate`]: the columns and their types, a primary key or unique index on exactly `key`, deterministic collations on the text columns (a case-insensitive collation would let `Acme` and `acme` share a record); otherwise [`Error::Config`] naming the table and the problem |
//! | max key | [`oncely::MAX_KEY_BYTES`] (255 bytes), stored whole as the primary key |
//! | max outcome | [`oncely::MAX_OUTCOME_BYTES`] (64 KiB), `bytea` |
//! | locks | one advisory lock per claim, held for the statement (autocommit) or until the caller's transaction ends (`claim_in`): a transaction claiming thousands of keys can exhaust the server's lock table (`max_locks_per_transaction` × connections). Prune deletes in batches of at most 500 rows per transaction and skips keys whose lock is held |
//! | failure | cannot connect or pool exhausted: [`Error::Unavailable`] (fail closed, nothing runs); serialization failure or deadlock: retryable [`Error::Backend`]; a unique violation in a step's own write: [`Error::ConstraintViolation`] (through [`Ledger::unique_violation`]); a read-only session or a missing privilege: [`Error::Config`] |
//!
//! ## Cancel safety
//!
//! Every ledger operation is one autocommit statement on a pooled
//! connection (prune: one per batch). A dropped future either never sent it
//! or sent it whole: the
//! server runs it to its own commit or not at all, and sqlx finishes the
//! exchange (flushes, drains the reply) before the connection is reused. So
//! a dropped `claim` at worst leaves a committed in-progress claim that
//! nobody holds, exactly like a crashed worker: it is taken over when its
//! lease ends (an at-most-once claim is reported abandoned instead, as the
//! contract requires). Running the statements in spawned tasks would add
//! nothing, so they run on the caller's task. Two hazards remain, and both
//! are guarded:
//!
//! 1. **`Pool::begin` in sqlx 0.9.0 is not cancel-safe on PostgreSQL**
//!    (upstream transact-rs/sqlx#4393, fixed after 0.9.0): a future dropped
//!    after `BEGIN` was queued but before the `Transaction` exists returns
//!    the connection to the pool *inside an open transaction* that nothing
//!    will end. [`PgLedger::begin`] runs `pool.begin()` in a spawned task, so
//!    the caller's cancellation cannot interrupt it; if the caller is gone,
//!    the finished `Transaction` is dropped in that task and rolled back
//!    properly. Use it (not `pool.begin()`) for `claim_in`.
//! 2. **A connection someone else leaked** (their own `pool.begin()` on a
//!    shared pool, an aborted `raw_sql("BEGIN; …")`): an autocommit claim on
//!    it would silently join that transaction and vanish when the
//!    connection is closed: a lost claim, then a duplicate effect (and its
//!    key's advisory lock would stay held by the stray transaction). Every
//!    ledger statement checks, inside itself (no extra round trip), that it
//!    runs in its own implicit transaction: the unnamed protocol portal it
//!    executes in was created by the very message that started the
//!    transaction (`pg_cursors.creation_time = transaction_timestamp()`,
//!    exact equality, both taken from the same protocol message). If not, it
//!    writes nothing and takes no lock; the ledger rolls the stray
//!    transaction back (with a warning in the log) and runs the statement
//!    again. Fenced writes carry the check in their `WHERE`; only when one
//!    changes nothing does a second statement tell a stale fence from a
//!    tripped guard.
//!
//! Why not the obvious test, `transaction_timestamp() = statement_timestamp()`?
//! The protocol's Execute message resets the statement timestamp after Bind
//! started the transaction, so under sqlx (extended protocol) that test is
//! false on every autocommit statement (measured: 0 of 200). Why not a pool
//! hook? sqlx does not expose the connection's transaction status, so an
//! `after_release`/`before_acquire` hook would need a round trip of its own
//! per checkout, and it would not cover a pool handed to
//! [`PgLedger::from_pool`]. The in-statement check costs a lookup in the
//! session's handful of portals, within measurement noise: on the
//! development machine (PostgreSQL 15 on loopback, `synchronous_commit =
//! off` to take fsync out of the picture, 3000 claims each, medians) a claim
//! took 198 µs with the check and 192 µs without it, a completion 175 µs and
//! 168 µs; the `claim` bench also carries a `baseline_plus_guard` function
//! (the hand-written statements plus the check). The check relies on the extended
//! protocol, which sqlx always uses for statements with parameters (all of
//! the ledger's); over the simple protocol it would trip every time and the
//! operation would fail after a few attempts rather than write unguarded.
//!
//! `claim_in`/`complete_in` skip the check: they run inside the caller's
//! transaction on purpose, and a dropped `Transaction` rolls back.
//!
//! ## Schema
//!
//! One table (default `public.oncely_effects`, both configurable through
//! [`PgLedgerOptions`]) keyed by the displayed effect key, with partial indexes
//! for pruning and for listing abandoned steps; a `<table>_horizon` table
//! (the watermark per tenant and kind), a `<table>_beyond` function (the
//! claim's horizon check, which needs a snapshot of its own) and a
//! `<table>_migrations` table. [`PgLedger::migrate`] applies the embedded
//! migrations under a transaction-scoped advisory lock, so concurrent
//! processes can run it at once, and checks the result before it commits.
//! A table created by someone else is checked before anything is added to
//! it.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod error;
mod schema;
mod sql;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely::backend::{
    answer_existing, check_outcome, duration_micros, effective_state, from_micros, to_micros,
};
use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Fingerprint, Lease, Ledger, MAX_OUTCOME_BYTES,
    Outcome, Record, RecordState, Result, Tenant, TransactionalLedger,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Postgres, Row};

pub use sqlx::PgConnection;
pub use sqlx::PgPool;

use crate::error::{BACKEND, corrupt, is_failed_transaction, map};
use crate::sql::Queries;

/// How many times one operation re-runs its statement after a stray
/// transaction was rolled back or a concurrent commit was not yet visible to
/// its snapshot. Each re-run follows an event that cannot repeat forever
/// (a commit that already happened, a rollback just done).
const ATTEMPTS: usize = 8;

/// Longest schema or table name accepted (PostgreSQL's limit is 63 bytes; the
/// index, horizon, function and migration table names add a suffix to the
/// table name).
const MAX_SCHEMA_BYTES: usize = 63;
const MAX_TABLE_BYTES: usize = 48;

/// Most records one prune transaction deletes. Each deleted key's advisory
/// lock is held until its transaction ends, and the server's lock table is
/// shared by every session (`max_locks_per_transaction` × connections, 6400
/// by default), so a prune of a million records runs as many small batches.
const PRUNE_BATCH: u64 = 500;

/// Options of [`PgLedger::connect_with`] and [`PgLedger::with_options`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgLedgerOptions {
    max_connections: u32,
    acquire_timeout: Duration,
    test_before_acquire: bool,
    schema: String,
    table: String,
    migrate: bool,
    read_only: bool,
}

impl Default for PgLedgerOptions {
    /// 16 connections, a 5 s acquire timeout, no ping before acquire, table
    /// `public.oncely_effects`, migrations on connect, read-write.
    fn default() -> Self {
        PgLedgerOptions {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            test_before_acquire: false,
            schema: "public".to_owned(),
            table: "oncely_effects".to_owned(),
            migrate: true,
            read_only: false,
        }
    }
}

impl PgLedgerOptions {
    /// Pool size (connections). Only used by [`PgLedger::connect_with`].
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How long an operation waits for a pooled connection before failing
    /// with [`Error::Unavailable`]. Only used by [`PgLedger::connect_with`].
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Whether the pool pings a connection before handing it out (sqlx's
    /// default). Off by default: the ping is a full round trip before every
    /// claim, and a dead connection already surfaces as
    /// [`Error::Unavailable`] on the one operation that hits it (nothing
    /// runs). Only used by [`PgLedger::connect_with`].
    pub fn test_before_acquire(mut self, yes: bool) -> Self {
        self.test_before_acquire = yes;
        self
    }

    /// The schema of the ledger table (default `public`; created by
    /// [`PgLedger::migrate`] if absent). Lowercase ASCII letters, digits and
    /// `_`, not starting with a digit, at most 63 bytes.
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

    /// Whether [`PgLedger::connect_with`] runs the migrations (default
    /// true). With `false` it creates and changes nothing: it checks what
    /// exists and fails with [`Error::Config`] naming what is missing or
    /// wrong (a deployment step runs `oncely migrate` instead, with a role
    /// that may change the schema).
    pub fn migrate(mut self, yes: bool) -> Self {
        self.migrate = yes;
        self
    }

    /// A ledger that only reads (default false), for a role that may only
    /// `SELECT`: implies `migrate(false)`, [`PgLedger::connect_with`] opens
    /// every pooled session with `default_transaction_read_only = on`, and
    /// the ledger refuses its own writes (claims, completions, releases,
    /// renewals, prune, [`PgLedger::migrate`]) with [`Error::Config`] before
    /// any round trip. [`Ledger::get`], [`Ledger::abandoned`] and
    /// [`Ledger::horizon`] work. On a pool handed to
    /// [`PgLedger::with_options`] the sessions are the pool's; only the
    /// ledger's own refusal applies.
    pub fn read_only(mut self, yes: bool) -> Self {
        self.read_only = yes;
        self
    }

    /// Checks the names and sizes; [`Error::Config`] before any round trip.
    pub fn validate(&self) -> Result<()> {
        identifier("schema", &self.schema, MAX_SCHEMA_BYTES)?;
        identifier("table", &self.table, MAX_TABLE_BYTES)?;
        if self.max_connections == 0 {
            return Err(Error::Config("max_connections must be at least 1".into()));
        }
        Ok(())
    }
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

#[derive(Debug)]
struct Inner {
    q: Queries,
    schema: String,
    table: String,
    read_only: bool,
}

/// An effect ledger in a PostgreSQL table. Cloning is cheap (a pool handle
/// and an `Arc`).
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    inner: Arc<Inner>,
}

impl PgLedger {
    /// Connects with default [`PgLedgerOptions`], runs the migrations and
    /// checks the table.
    ///
    /// Fails with [`Error::Unavailable`] when the database cannot be reached
    /// and [`Error::Config`] on a malformed URL or a table the ledger cannot
    /// use.
    pub async fn connect(url: &str) -> Result<PgLedger> {
        PgLedger::connect_with(url, PgLedgerOptions::default()).await
    }

    /// Connects a pool built from `options`, runs the migrations (unless
    /// [`PgLedgerOptions::migrate`] is off or the ledger is
    /// [read-only](PgLedgerOptions::read_only)) and checks the schema
    /// ([`PgLedger::verify`]). The options are validated before any round
    /// trip.
    pub async fn connect_with(url: &str, options: PgLedgerOptions) -> Result<PgLedger> {
        options.validate()?;
        let mut connect: PgConnectOptions = url.parse().map_err(map)?;
        if options.read_only {
            // The server refuses writes too, whatever the role may do.
            connect = connect.options([("default_transaction_read_only", "on")]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .test_before_acquire(options.test_before_acquire)
            .connect_with(connect)
            .await
            .map_err(map)?;
        let migrate = options.migrate && !options.read_only;
        let ledger = PgLedger::with_options(pool, options)?;
        let ready = if migrate {
            ledger.migrate().await
        } else {
            ledger.verify().await
        };
        if let Err(e) = ready {
            ledger.pool.close().await;
            return Err(e);
        }
        Ok(ledger)
    }

    /// A ledger on an existing pool and the default table. Runs no
    /// migrations and no check: call [`PgLedger::migrate`] (or
    /// [`PgLedger::verify`]) once at startup.
    pub fn from_pool(pool: PgPool) -> PgLedger {
        PgLedger::with_options(pool, PgLedgerOptions::default()).expect("the default options are valid")
    }

    /// A ledger on an existing pool with the schema, table and read-only
    /// setting of `options` (its pool settings are not used). Runs no
    /// migrations and no check.
    pub fn with_options(pool: PgPool, options: PgLedgerOptions) -> Result<PgLedger> {
        options.validate()?;
        Ok(PgLedger {
            pool,
            inner: Arc::new(Inner {
                q: Queries::new(&options.schema, &options.table),
                schema: options.schema,
                table: options.table,
                read_only: options.read_only,
            }),
        })
    }

    /// The pool underneath (shared with the application's own queries).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema and table this ledger uses.
    pub fn table(&self) -> (&str, &str) {
        (&self.inner.schema, &self.inner.table)
    }

    /// Begins a transaction on the pool, cancel-safely.
    ///
    /// `pool.begin()` runs in a spawned task, so dropping this future (a
    /// timeout, `select!`, an aborted task) cannot leave a pooled connection
    /// inside a transaction nothing will end (sqlx 0.9.0, transact-rs/sqlx#4393).
    /// Dropping the returned transaction rolls it back, as usual. Must be
    /// called inside a Tokio runtime.
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, Postgres>> {
        let pool = self.pool.clone();
        match tokio::spawn(async move { pool.begin().await }).await {
            Ok(tx) => tx.map_err(map),
            Err(e) => Err(Error::Backend {
                backend: BACKEND,
                message: format!("the task beginning a transaction failed: {e}"),
                retryable: true,
            }),
        }
    }

    /// Refuses a write on a read-only ledger, before any round trip.
    fn writable(&self) -> Result<()> {
        if self.inner.read_only {
            return Err(Error::Config(format!(
                "the ledger on {}.{} was opened read-only (PgLedgerOptions::read_only): it does not write",
                self.inner.schema, self.inner.table
            )));
        }
        Ok(())
    }

    /// Whether `conn` runs statements in their own implicit transactions
    /// (the guard of the crate docs), asked only after a fenced write
    /// changed nothing.
    async fn autocommit(&self, conn: &mut PgConnection) -> Result<bool> {
        match sqlx::query_scalar(AssertSqlSafe(self.inner.q.probe.clone()))
            .bind(true)
            .fetch_one(&mut *conn)
            .await
        {
            Ok(ok) => Ok(ok),
            Err(e) if is_failed_transaction(&e) => Ok(false),
            Err(e) => Err(map(e)),
        }
    }

    async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<Postgres>> {
        self.pool.acquire().await.map_err(map)
    }

    /// The claim statement on `conn`; `guard` is off inside a caller's
    /// transaction.
    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
        guard: bool,
    ) -> Result<Claim> {
        opts.validate()?;
        self.writable()?;
        let sent_at = opts.sent_at.map(to_micros).transpose()?;
        for _ in 0..ATTEMPTS {
            let sql = match sent_at {
                None => self.inner.q.claim.clone(),
                Some(_) => self.inner.q.claim_horizon.clone(),
            };
            let mut query = sqlx::query(AssertSqlSafe(sql))
                .bind(key.as_str())
                .bind(key.tenant().as_str())
                .bind(key.kind())
                .bind(key.subject())
                .bind(opts.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
                .bind(opts.at_most_once)
                .bind(duration_micros(opts.lease))
                .bind(duration_micros(opts.retention))
                .bind(guard);
            if let Some(sent_at) = sent_at {
                query = query.bind(sent_at);
            }
            let row = query.fetch_one(&mut *conn).await;
            let row = match row {
                Ok(row) => row,
                Err(e) if guard && is_failed_transaction(&e) => {
                    heal(conn).await?;
                    continue;
                }
                Err(e) => return Err(map(e)),
            };
            let src: String = row.try_get(0).map_err(map)?;
            match src.as_str() {
                "leaked" => heal(conn).await?,
                "beyond" => return Err(Error::BeyondHorizon { key: key.to_string() }),
                // A row committed after this statement's snapshot (while it
                // waited on the key's lock): the next run sees it.
                "missing" => {}
                "acquired" => return acquired(key, &row).map(Claim::Acquired),
                "existing" => {
                    let record = RecordRow::decode(&row, 1)?.record(key.clone())?;
                    // `None`: the record could be taken over now (its lease
                    // ended after the statement's ON CONFLICT looked at
                    // it); run the statement again to do so.
                    if let Some(claim) = answer_existing(key, opts, record)? {
                        return Ok(claim);
                    }
                }
                other => return Err(corrupt(format!("claim returned an unknown status {other:?}"))),
            }
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!("{key}: the claim did not settle after {ATTEMPTS} attempts"),
            retryable: true,
        })
    }

    /// A fenced write (complete, release, renew) on `conn`; returns the
    /// statement's value column (the new expiry for renew).
    async fn fenced_on(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        write: Write<'_>,
        guard: bool,
    ) -> Result<i64> {
        self.writable()?;
        let lost = || Error::LeaseLost {
            key: lease.key().to_string(),
            fence: lease.fence(),
        };
        let Ok(fence) = i64::try_from(lease.fence()) else {
            return Err(lost());
        };
        for _ in 0..ATTEMPTS {
            let q = &self.inner.q;
            let query = match write {
                Write::Complete(outcome) => sqlx::query(AssertSqlSafe(q.complete.clone()))
                    .bind(lease.key().as_str())
                    .bind(fence)
                    .bind(outcome.as_bytes())
                    .bind(guard),
                Write::Release => sqlx::query(AssertSqlSafe(q.release.clone()))
                    .bind(lease.key().as_str())
                    .bind(fence)
                    .bind(guard),
                Write::Renew(us) => sqlx::query(AssertSqlSafe(q.renew.clone()))
                    .bind(lease.key().as_str())
                    .bind(fence)
                    .bind(us)
                    .bind(guard),
            };
            let row = match query.fetch_optional(&mut *conn).await {
                Ok(row) => row,
                Err(e) if guard && is_failed_transaction(&e) => {
                    heal(conn).await?;
                    continue;
                }
                Err(e) => return Err(map(e)),
            };
            if let Some(row) = row {
                return row.try_get::<i64, _>(0).map_err(map);
            }
            if guard && !self.autocommit(conn).await? {
                heal(conn).await?;
                continue;
            }
            return Err(lost());
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!(
                "{}: the write did not settle after {ATTEMPTS} attempts",
                lease.key()
            ),
            retryable: true,
        })
    }

    /// One prune batch of at most `batch` records: how many were
    /// candidates (past retention, not locked) and how many were deleted.
    async fn prune_batch(&self, conn: &mut PgConnection, batch: u64) -> Result<(u64, u64)> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        for _ in 0..ATTEMPTS {
            let row = match sqlx::query(AssertSqlSafe(self.inner.q.prune.clone()))
                .bind(batch)
                .fetch_one(&mut *conn)
                .await
            {
                Ok(row) => row,
                Err(e) if is_failed_transaction(&e) => {
                    heal(conn).await?;
                    continue;
                }
                Err(e) => return Err(map(e)),
            };
            if !row.try_get::<bool, _>(0).map_err(map)? {
                heal(conn).await?;
                continue;
            }
            let count = |i| {
                row.try_get::<i64, _>(i)
                    .map(|n| u64::try_from(n).unwrap_or(0))
                    .map_err(map)
            };
            return Ok((count(1)?, count(2)?));
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!("prune did not settle after {ATTEMPTS} attempts"),
            retryable: true,
        })
    }

    /// A read-only statement with the leaked-transaction guard in column 0:
    /// heals a stray transaction and runs it again.
    async fn guarded_read<'q>(
        &self,
        conn: &mut PgConnection,
        what: &str,
        query: impl Fn() -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<PgRow> {
        for _ in 0..ATTEMPTS {
            let row = match query().fetch_one(&mut *conn).await {
                Ok(row) => row,
                Err(e) if is_failed_transaction(&e) => {
                    heal(conn).await?;
                    continue;
                }
                Err(e) => return Err(map(e)),
            };
            if !row.try_get::<bool, _>(0).map_err(map)? {
                heal(conn).await?;
                continue;
            }
            return Ok(row);
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!("{what} did not settle after {ATTEMPTS} attempts"),
            retryable: true,
        })
    }
}

/// The lease of an `acquired` claim row (see the claim statement in `sql`).
fn acquired(key: &EffectKey, row: &PgRow) -> Result<Lease> {
    let fence: i64 = row.try_get(2).map_err(map)?;
    let expires_us =
        micros_opt(row, 8)?.ok_or_else(|| corrupt(format!("{key}: acquired without a lease")))?;
    Ok(oncely::backend::Grant {
        key: key.clone(),
        fence: u64::try_from(fence).map_err(|_| corrupt(format!("{key}: fence {fence}")))?,
        expires_at: from_micros(expires_us),
        first_claimed_at: from_micros(micros(row, 6)?),
        // The clock the lease was measured from, read after the key's lock.
        acquired_at: from_micros(micros(row, 7)?),
        taken_over: row.try_get(11).map_err(map)?,
        at_most_once: row.try_get(5).map_err(map)?,
    }
    .into_lease())
}

#[derive(Clone, Copy)]
enum Write<'a> {
    Complete(&'a Outcome),
    Release,
    Renew(i64),
}

/// Ends a transaction that someone else left open on this pooled connection,
/// so the ledger's next statement runs (and commits) on its own.
async fn heal(conn: &mut PgConnection) -> Result<()> {
    tracing::warn!(
        backend = BACKEND,
        "a pooled connection was inside a transaction nobody owns (a cancelled Pool::begin, \
         transact-rs/sqlx#4393); rolling it back before the ledger writes"
    );
    sqlx::raw_sql(sql::ROLLBACK).execute(conn).await.map_err(map)?;
    Ok(())
}

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

fn micros(row: &PgRow, i: usize) -> Result<i64> {
    row.try_get::<Micros, _>(i).map(|m| m.0).map_err(map)
}

fn micros_opt(row: &PgRow, i: usize) -> Result<Option<i64>> {
    row.try_get::<Option<Micros>, _>(i)
        .map(|m| m.map(|m| m.0))
        .map_err(map)
}

/// The record columns of [`sql`]'s `cols`, from column `at` on.
struct RecordRow {
    state: String,
    fence: i64,
    fingerprint: Option<Vec<u8>>,
    outcome: Option<Vec<u8>>,
    at_most_once: bool,
    created_us: i64,
    updated_us: i64,
    lease_us: Option<i64>,
    retain_us: i64,
    now_us: i64,
}

impl RecordRow {
    fn decode(row: &PgRow, at: usize) -> Result<Self> {
        Ok(RecordRow {
            state: row.try_get(at).map_err(map)?,
            fence: row.try_get(at + 1).map_err(map)?,
            fingerprint: row.try_get(at + 2).map_err(map)?,
            outcome: row.try_get(at + 3).map_err(map)?,
            at_most_once: row.try_get(at + 4).map_err(map)?,
            created_us: micros(row, at + 5)?,
            updated_us: micros(row, at + 6)?,
            lease_us: micros_opt(row, at + 7)?,
            retain_us: micros(row, at + 8)?,
            now_us: micros(row, at + 9)?,
        })
    }

    /// The record as the contract reports it (an expired at-most-once lease
    /// is [`RecordState::Abandoned`]), read at the row's clock.
    fn record(self, key: EffectKey) -> Result<Record> {
        let stored = RecordState::parse(&self.state).map_err(|e| corrupt(format!("{key}: {e}")))?;
        let read_at = from_micros(self.now_us);
        let lease_expires_at = self.lease_us.map(from_micros);
        Ok(Record {
            state: effective_state(stored, self.at_most_once, lease_expires_at, read_at),
            fence: u64::try_from(self.fence).map_err(|_| corrupt(format!("{key}: fence {}", self.fence)))?,
            fingerprint: self
                .fingerprint
                .map(|f| Fingerprint::from_bytes(&f))
                .transpose()
                .map_err(|e| corrupt(format!("{key}: {e}")))?,
            outcome: self
                .outcome
                .map(Outcome::from_bytes)
                .transpose()
                .map_err(|e| corrupt(format!("{key}: {e}")))?,
            at_most_once: self.at_most_once,
            created_at: from_micros(self.created_us),
            updated_at: from_micros(self.updated_us),
            lease_expires_at,
            retain_until: from_micros(self.retain_us),
            read_at,
            key,
        })
    }
}

impl Ledger for PgLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(
            "PostgreSQL commit (WAL, as synchronous_commit is configured)",
            "PostgreSQL clock_timestamp() when each write takes effect (database server clock)",
        )
        .caller_transaction(true)
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.writable()?;
        let mut conn = self.acquire().await?;
        self.claim_on(&mut conn, key, opts, true).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, MAX_OUTCOME_BYTES)?;
        self.writable()?;
        let mut conn = self.acquire().await?;
        self.fenced_on(&mut conn, lease, Write::Complete(outcome), true)
            .await
            .map(|_| ())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.writable()?;
        let mut conn = self.acquire().await?;
        self.fenced_on(&mut conn, lease, Write::Release, true)
            .await
            .map(|_| ())
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        // The same bounds as a claim's lease (ClaimOptions::validate).
        if extend_by < Duration::from_millis(1) || extend_by > Duration::from_secs(86_400) {
            return Err(Error::InvalidInput(format!(
                "a lease is extended by 1 ms to 1 day, got {extend_by:?}"
            )));
        }
        self.writable()?;
        let mut conn = self.acquire().await?;
        let expires_us = self
            .fenced_on(&mut conn, lease, Write::Renew(duration_micros(extend_by)), true)
            .await?;
        Ok(lease.renewed_until(from_micros(expires_us)))
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let mut conn = self.acquire().await?;
        let row = self
            .guarded_read(&mut conn, &format!("{key}: the read"), || {
                sqlx::query(AssertSqlSafe(self.inner.q.get.clone())).bind(key.as_str())
            })
            .await?;
        if row.try_get::<Option<String>, _>(1).map_err(map)?.is_none() {
            return Ok(None);
        }
        RecordRow::decode(&row, 1)?.record(key.clone()).map(Some)
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        self.writable()?;
        let mut conn = self.acquire().await?;
        let mut deleted = 0;
        while deleted < limit {
            let batch = (limit - deleted).min(PRUNE_BATCH);
            let (candidates, n) = self.prune_batch(&mut conn, batch).await?;
            deleted += n;
            // Fewer candidates than asked: nothing more is due. None deleted:
            // every candidate's key is held by a claim; the next prune gets it.
            if candidates < batch || n == 0 {
                break;
            }
        }
        Ok(deleted)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.acquire().await?;
        let mut rows = None;
        for _ in 0..ATTEMPTS {
            match sqlx::query(AssertSqlSafe(self.inner.q.abandoned.clone()))
                .bind(tenant.as_str())
                .bind(limit)
                .fetch_all(&mut *conn)
                .await
            {
                Ok(r) => {
                    rows = Some(r);
                    break;
                }
                Err(e) if is_failed_transaction(&e) => heal(&mut conn).await?,
                Err(e) => return Err(map(e)),
            }
        }
        let rows = rows.ok_or_else(|| Error::Backend {
            backend: BACKEND,
            message: format!("abandoned listing did not settle after {ATTEMPTS} attempts"),
            retryable: true,
        })?;
        rows.iter()
            .map(|row| {
                let k: String = row.try_get(0).map_err(map)?;
                let key = EffectKey::parse(&k).map_err(|e| corrupt(format!("stored key {k:?}: {e}")))?;
                RecordRow::decode(row, 1)?.record(key)
            })
            .collect()
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        let mut conn = self.acquire().await?;
        let row = self
            .guarded_read(&mut conn, "the horizon read", || {
                sqlx::query(AssertSqlSafe(self.inner.q.horizon.clone()))
                    .bind(tenant.as_str())
                    .bind(kind)
            })
            .await?;
        Ok(micros_opt(&row, 1)?.map(from_micros))
    }

    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        error::unique_violation(error)
    }
}

impl TransactionalLedger for PgLedger {
    type Connection = PgConnection;
    type Transaction = sqlx::Transaction<'static, Postgres>;

    /// [`PgLedger::begin`]: cancel-safe.
    async fn begin(&self) -> Result<Self::Transaction> {
        PgLedger::begin(self).await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<()> {
        tx.commit().await.map_err(map)
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<()> {
        tx.rollback().await.map_err(map)
    }

    async fn claim_in(&self, conn: &mut PgConnection, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        self.claim_on(conn, key, opts, false).await
    }

    async fn complete_in(&self, conn: &mut PgConnection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, MAX_OUTCOME_BYTES)?;
        self.fenced_on(conn, lease, Write::Complete(outcome), false)
            .await
            .map(|_| ())
    }
}
