//! # oncely-mysql
//!
//! The MySQL 8 / MariaDB 10.5+ backend of [oncely]: an effect ledger in one
//! InnoDB table, whose claims can also join the caller's own transaction
//! (`claim_in` / `complete_in`), so a business write and its claim commit
//! together.
//!
//! ```no_run
//! use oncely::{Claim, ClaimOptions, EffectKey, Ledger, Outcome, Tenant, TransactionalLedger};
//! use oncely_mysql::MySqlLedger;
//!
//! # async fn demo() -> oncely::Result<()> {
//! let ledger = MySqlLedger::connect("mysql://root@127.0.0.1:3306/test").await?;
//! let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//!
//! // Standalone claim (ProviderKeyed / AtMostOnce steps).
//! if let Claim::Acquired(lease) = ledger.claim(&key, &ClaimOptions::default()).await? {
//!     // … call the provider with lease.provider_key() …
//!     ledger.complete(&lease, &Outcome::from_json(&"ch_1")?).await?;
//! }
//!
//! // Transactional step: the claim, the business write and the completion
//! // commit (or roll back) together.
//! let receipt = EffectKey::new(&Tenant::global(), "ledger-entry", "order-123")?;
//! let mut tx = ledger.begin().await?;
//! if let Claim::Acquired(lease) = ledger.claim_in(&mut *tx, &receipt, &ClaimOptions::default()).await? {
//!     // sqlx::query("INSERT INTO entries …").execute(&mut *tx).await?;
//!     ledger.complete_in(&mut *tx, &lease, &Outcome::from_json(&"entry-1")?).await?;
//! }
//! tx.commit().await.map_err(|e| oncely::Error::Backend {
//!     backend: "mysql", message: e.to_string(), retryable: true })?;
//! # Ok(()) }
//! ```
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | atomic claim | one `INSERT … ON DUPLICATE KEY UPDATE` on the primary key; the takeover of an expired lease or a released record (`fence + 1`) happens in the same statement |
//! | caller's transaction | yes: [`TransactionalLedger`] on `&mut sqlx::MySqlConnection`; a concurrent duplicate blocks on the row lock until the first commits |
//! | durability | what the server's InnoDB settings give (`innodb_flush_log_at_trx_commit = 1`: committed claims survive a crash) |
//! | replication | none before a claim returns (asynchronous replicas may lag; Galera / group replication as configured) |
//! | clock | the database server's `UTC_TIMESTAMP(6)`, independent of the session time zone |
//! | max key | 255 bytes (`VARCHAR(255)` utf8mb4, `utf8mb4_bin`) |
//! | max outcome | 64 KiB ([`oncely::MAX_OUTCOME_BYTES`]), lower if the server's `max_allowed_packet` is smaller; see [`MySqlLedger::max_outcome_bytes`] |
//! | round trips per claim | 1 on MariaDB 10.5+ (`RETURNING`), 2 on MySQL 8 (the statement, then a locking read of the row) |
//! | leaked-transaction guard | MariaDB (`@@in_transaction`); not on MySQL 8 |
//! | pool size | default 10; the conformance race (64 claimants) uses 70. MariaDB's default `max_connections` is 151 |
//!
//! ## Why `ON DUPLICATE KEY UPDATE` and not `INSERT IGNORE`
//!
//! `INSERT IGNORE` turns *every* ignorable error of the statement into a
//! warning, not only the duplicate key: a truncated value, a NULL into a NOT
//! NULL column, a foreign key failure, a conflict on some other unique index
//! would all be "ignored" and look exactly like "the key already exists",
//! which is how effects silently get skipped. `ON DUPLICATE KEY UPDATE` keeps
//! strict-mode errors as errors, and it lets the same statement take over an
//! expired lease or a released record (`fence + 1`) with no read-then-write
//! gap. Its update clause is a no-op unless the takeover condition holds
//! (expired non-at-most-once lease or released record, compatible
//! fingerprint), and it is also guarded by `effect_key = ?`: a conflict on any
//! other unique index (which ODKU would otherwise resolve by updating *that*
//! row) changes nothing and is reported as
//! [`oncely::Error::Corrupt`], counted by
//! `oncely_unexpected_constraint_violations_total`.
//!
//! The update clause reads the would-be-inserted values with `VALUES(col)`
//! (first-class on MariaDB; deprecated since MySQL 8.0.20 but still
//! supported, with a warning) and is written to be right both under the
//! usual left-to-right assignment order and under MariaDB's
//! `SIMULTANEOUS_ASSIGNMENT` sql_mode, which a caller's session may have
//! (the conformance suite runs in that mode too).
//!
//! ## How a claim learns what happened
//!
//! sqlx sets `CLIENT_FOUND_ROWS`, so the affected-row count of an ODKU is 1
//! both for "inserted" and for "found, unchanged": it cannot tell a fresh
//! claim from a duplicate. Each claim attempt therefore writes a unique
//! 16-byte claim token on insert and on takeover; the row read back (through
//! `RETURNING` on MariaDB, a locking `SELECT … FOR UPDATE` on MySQL, which is
//! a current read even inside a REPEATABLE READ snapshot) carries our token
//! exactly when this attempt acquired the lease, and `fence > 1` tells a
//! takeover from a fresh insert.
//!
//! MariaDB accepts `RETURNING` on `INSERT … ON DUPLICATE KEY UPDATE` and
//! returns the row as the statement left it, inserted, updated or untouched
//! (checked on 10.11; should a server answer with a syntax error, the ledger
//! switches to the two-statement path for good). MySQL 8 has no `RETURNING`.
//!
//! ## Strict mode and keys
//!
//! Connections opened by [`MySqlLedger::connect`] add `STRICT_ALL_TABLES` to
//! the session's `sql_mode`, so an over-long value is an error, never silently
//! clipped. Inputs are validated before any round trip anyway (keys ≤ 255
//! bytes fit `VARCHAR(255)` in any mode). Keys use `utf8mb4_bin`, so they
//! compare exactly: `Order-1` and `order-1`, `é` and `e` are different
//! effects (`utf8mb4_bin` is a PAD SPACE collation, which cannot matter
//! because a key never ends in whitespace).
//!
//! ## Cancel safety
//!
//! Ledger operations on the pool run to completion in a spawned task, so a
//! dropped future never leaves a statement half-sent or a connection inside a
//! transaction, and a claim that committed is either returned or left to
//! expire like any other lease. [`MySqlLedger::begin`] starts the caller's
//! transaction the same way (sqlx's `Pool::begin` can hand a connection back
//! to the pool inside an open transaction if it is dropped between `BEGIN` and
//! its return). `claim_in` / `complete_in` run on the caller's transaction,
//! which sqlx rolls back when it is dropped (after a dropped `claim_in`, roll
//! the transaction back: the claim may or may not be in it).
//!
//! A pooled connection can still arrive inside a transaction that *other*
//! code left open on a shared pool (its own `pool.begin()` dropped between
//! `BEGIN` and its return, an aborted raw `BEGIN`). An autocommit claim there
//! would only commit with that transaction, if ever. On MariaDB every ledger
//! write checks `@@in_transaction` in the same statement (no extra round
//! trip): updates and the horizon claim carry `@@in_transaction = 0` in their
//! `WHERE` and write nothing inside a stray transaction; the plain claim (an
//! `INSERT … VALUES`, cheaper than an `INSERT … SELECT` that could carry a
//! `WHERE`) returns it, and if it was 1 the ledger rolls the stray
//! transaction back, its own uncommitted write with it, before returning the
//! connection. Either way the ledger logs a warning and runs the write again
//! on a clean connection, and since these run in a spawned task, no
//! cancellation can leave such a write (and its row lock) behind. A pool
//! whose sessions run with `autocommit = 0` is refused with
//! [`oncely::Error::Config`]. MySQL 8 has no `@@in_transaction`, so there the
//! guard is off: the ledger's own operations and [`MySqlLedger::begin`] never
//! leak, but do not share its pool with code that might.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod sql;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Fingerprint, Lease, Ledger, Outcome, Record,
    RecordState, Result, Tenant, TransactionalLedger, duration_micros, from_micros, to_micros,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions, MySqlRow};
use sqlx::{Executor, MySql, MySqlConnection, MySqlPool, Row, Transaction};

use crate::error::{BACKEND, corrupt, map, unexpected_violation};
use crate::sql::Statements;

/// The default table name.
pub const DEFAULT_TABLE: &str = "oncely_effects";

/// How many times a ledger operation on the pool retries a deadlock or lock
/// wait timeout (each is one autocommit statement, so a retry is safe).
const LOCK_RETRIES: u32 = 8;

/// Options for [`MySqlLedger::connect_with`].
#[derive(Debug, Clone)]
pub struct MySqlLedgerOptions {
    max_connections: u32,
    acquire_timeout: Duration,
    table: String,
    max_outcome_bytes: usize,
    returning: Option<bool>,
}

impl Default for MySqlLedgerOptions {
    fn default() -> Self {
        MySqlLedgerOptions {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(30),
            table: DEFAULT_TABLE.to_owned(),
            max_outcome_bytes: oncely::MAX_OUTCOME_BYTES,
            returning: None,
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

    /// The ledger table (default [`DEFAULT_TABLE`]). Must be an identifier:
    /// an ASCII letter or `_`, then letters, digits or `_`, at most 48 bytes.
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
}

fn check_table(name: &str) -> Result<()> {
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

/// The MySQL / MariaDB effect ledger. Cheap to clone (an `Arc`).
#[derive(Clone)]
pub struct MySqlLedger {
    inner: Arc<Inner>,
}

struct Inner {
    pool: MySqlPool,
    table: String,
    /// Index 0: for servers without `@@in_transaction`; 1: guarded.
    sql: [Statements; 2],
    guarded: AtomicBool,
    /// Current outcome limit: the configured one, lowered once the server's
    /// `max_allowed_packet` is known.
    max_outcome: AtomicUsize,
    returning: AtomicBool,
    returning_pref: Option<bool>,
    probed: tokio::sync::OnceCell<()>,
}

impl std::fmt::Debug for MySqlLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlLedger")
            .field("table", &self.inner.table)
            .field("returning", &self.inner.returning.load(Ordering::Relaxed))
            .field("max_outcome_bytes", &self.max_outcome_bytes())
            .finish()
    }
}

/// A row as stored, plus the server's clock at the read.
#[derive(Debug)]
struct Stored {
    key: String,
    state: String,
    fence: u64,
    fingerprint: Option<Vec<u8>>,
    outcome: Option<Vec<u8>>,
    at_most_once: bool,
    token: Vec<u8>,
    created_us: i64,
    updated_us: i64,
    lease_expires_us: Option<i64>,
    retain_until_us: i64,
    now_us: i64,
}

fn stored(row: &MySqlRow) -> Result<Stored> {
    let g = |e: sqlx::Error| corrupt(format!("unreadable ledger row: {e}"));
    Ok(Stored {
        key: row.try_get("effect_key").map_err(g)?,
        state: row.try_get("state").map_err(g)?,
        fence: row.try_get("fence").map_err(g)?,
        fingerprint: row.try_get("fingerprint").map_err(g)?,
        outcome: row.try_get("outcome").map_err(g)?,
        at_most_once: row.try_get("at_most_once").map_err(g)?,
        token: row.try_get("claim_token").map_err(g)?,
        created_us: row.try_get("created_us").map_err(g)?,
        updated_us: row.try_get("updated_us").map_err(g)?,
        lease_expires_us: row.try_get("lease_expires_us").map_err(g)?,
        retain_until_us: row.try_get("retain_until_us").map_err(g)?,
        now_us: row.try_get("now_us").map_err(g)?,
    })
}

impl Stored {
    fn expired(&self) -> bool {
        self.lease_expires_us.is_none_or(|e| e <= self.now_us)
    }

    fn record(&self, key: Option<&EffectKey>) -> Result<Record> {
        let key = match key {
            Some(k) if k.as_str() == self.key => k.clone(),
            _ => EffectKey::parse(&self.key)
                .map_err(|e| corrupt(format!("stored key {:?} does not parse: {e}", self.key)))?,
        };
        let mut state = RecordState::parse(&self.state).map_err(|e| corrupt(e.to_string()))?;
        if state == RecordState::InProgress && self.at_most_once && self.expired() {
            state = RecordState::Abandoned;
        }
        let fingerprint = match &self.fingerprint {
            Some(b) => Some(Fingerprint::from_bytes(b).map_err(|e| corrupt(e.to_string()))?),
            None => None,
        };
        let outcome = match &self.outcome {
            Some(b) => Some(Outcome::from_bytes(b.clone()).map_err(|e| corrupt(e.to_string()))?),
            None => None,
        };
        Ok(Record {
            key,
            state,
            fence: self.fence,
            fingerprint,
            outcome,
            at_most_once: self.at_most_once,
            created_at: from_micros(self.created_us),
            updated_at: from_micros(self.updated_us),
            lease_expires_at: self.lease_expires_us.map(from_micros),
            retain_until: from_micros(self.retain_until_us),
            read_at: from_micros(self.now_us),
        })
    }
}

static TOKEN_SEQ: AtomicU64 = AtomicU64::new(0);
static TOKEN_SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// A claim token unique to this attempt: a per-process random seed (from the
/// OS-seeded `RandomState`) and a per-process counter.
fn claim_token() -> [u8; 16] {
    let seed = *TOKEN_SEED.get_or_init(|| {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(to_micros(SystemTime::now()) as u128);
        h.finish()
    });
    let mut t = [0u8; 16];
    t[..8].copy_from_slice(&seed.to_le_bytes());
    t[8..].copy_from_slice(&TOKEN_SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    t
}

fn autocommit_off() -> Error {
    Error::Config(
        "the ledger's pool runs with autocommit = 0: its writes would never commit; \
         use a pool in autocommit mode (claim_in / complete_in join your transactions)"
            .to_owned(),
    )
}

fn join_error(e: tokio::task::JoinError) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("ledger task failed: {e}"),
        retryable: !e.is_panic(),
    }
}

fn lease_lost(lease: &Lease) -> Error {
    Error::LeaseLost {
        key: lease.key.to_string(),
        fence: lease.fence,
    }
}

impl MySqlLedger {
    /// Connects with default options ([`MySqlLedgerOptions::default`]) and
    /// runs the migrations. A server that cannot be reached is
    /// [`Error::Unavailable`].
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, MySqlLedgerOptions::default()).await
    }

    /// Connects with `options` and runs the migrations.
    pub async fn connect_with(url: &str, options: MySqlLedgerOptions) -> Result<Self> {
        check_table(&options.table)?;
        let connect: MySqlConnectOptions = url
            .parse()
            .map_err(|e: sqlx::Error| Error::Config(format!("bad MySQL URL: {e}")))?;
        let pool = MySqlPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            // sqlx pings on release already; a second ping on acquire would
            // add a round trip to every claim.
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // Strict mode: an over-long or invalid value is an error,
                    // never a silent clip or a default.
                    conn.execute("SET SESSION sql_mode = CONCAT(@@SESSION.sql_mode, ',STRICT_ALL_TABLES')")
                        .await?;
                    Ok(())
                })
            })
            .connect_with(connect)
            .await
            .map_err(|e| Error::Unavailable {
                backend: BACKEND,
                message: e.to_string(),
            })?;
        let ledger = Self::build(pool, options);
        ledger.migrate().await?;
        Ok(ledger)
    }

    /// Wraps an existing pool (default table, no migration: call
    /// [`MySqlLedger::migrate`]). The pool's `sql_mode` is the caller's: add
    /// `STRICT_ALL_TABLES` in its `after_connect` for strict mode.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self::build(pool, MySqlLedgerOptions::default())
    }

    /// Wraps an existing pool with options (table name, outcome limit,
    /// `RETURNING`); pool options are ignored. Does not migrate.
    pub fn from_pool_with(pool: MySqlPool, options: MySqlLedgerOptions) -> Result<Self> {
        check_table(&options.table)?;
        Ok(Self::build(pool, options))
    }

    fn build(pool: MySqlPool, options: MySqlLedgerOptions) -> Self {
        MySqlLedger {
            inner: Arc::new(Inner {
                sql: [
                    Statements::new(&options.table, false),
                    Statements::new(&options.table, true),
                ],
                guarded: AtomicBool::new(false),
                table: options.table,
                pool,
                max_outcome: AtomicUsize::new(options.max_outcome_bytes),
                returning: AtomicBool::new(options.returning.unwrap_or(false)),
                returning_pref: options.returning,
                probed: tokio::sync::OnceCell::new(),
            }),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// The ledger table's name.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// The largest outcome this ledger stores: [`oncely::MAX_OUTCOME_BYTES`]
    /// (or the configured lower limit), lowered to fit the server's
    /// `max_allowed_packet` once the server has been asked (at `connect`, or
    /// the first operation of a ledger made with `from_pool`).
    pub fn max_outcome_bytes(&self) -> usize {
        self.inner.max_outcome.load(Ordering::Relaxed)
    }

    /// Starts a transaction on a pooled connection, for `claim_in` /
    /// `complete_in` and the caller's own writes. `BEGIN` runs to completion
    /// in a spawned task, so dropping this future never returns a connection
    /// to the pool inside an open transaction.
    pub async fn begin(&self) -> Result<Transaction<'static, MySql>> {
        let pool = self.inner.pool.clone();
        tokio::spawn(async move { pool.begin().await })
            .await
            .map_err(join_error)?
            .map_err(map)
    }

    /// Creates or upgrades the ledger table. Idempotent, and safe to run from
    /// many processes at once (serialised by `GET_LOCK`).
    pub async fn migrate(&self) -> Result<()> {
        let this = self.clone();
        tokio::spawn(async move { this.migrate_inner().await })
            .await
            .map_err(join_error)?
    }

    async fn migrate_inner(&self) -> Result<()> {
        let mut conn = self.inner.pool.acquire().await.map_err(map)?;
        let lock = format!("oncely.migrate.{}", self.inner.table);
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .fetch_one(&mut *conn)
            .await
            .map_err(map)?;
        if got != Some(1) {
            return Err(Error::Backend {
                backend: BACKEND,
                message: format!("could not take the migration lock {lock:?} within 60 s"),
                retryable: true,
            });
        }
        let result = self.apply_migrations(&mut conn).await;
        // A session lock outlives the statement: release it before the
        // connection goes back to the pool, whatever happened.
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        if released.is_err() {
            conn.close_on_drop();
        }
        // Give the connection back first: the probe needs one, and the pool
        // may have only one.
        drop(conn);
        result?;
        self.probe(None).await
    }

    async fn apply_migrations(&self, conn: &mut MySqlConnection) -> Result<()> {
        conn.execute(sql::MIGRATIONS_TABLE).await.map_err(map)?;
        let applied: Vec<u32> =
            sqlx::query_scalar("SELECT version FROM oncely_schema_migrations WHERE table_name = ?")
                .bind(&self.inner.table)
                .fetch_all(&mut *conn)
                .await
                .map_err(map)?;
        for (version, statements) in sql::migrations(&self.inner.table) {
            if applied.contains(&version) {
                continue;
            }
            for s in statements {
                conn.execute(sqlx::AssertSqlSafe(s)).await.map_err(map)?;
            }
            sqlx::query(
                "INSERT INTO oncely_schema_migrations (table_name, version, applied_at) \
                 VALUES (?, ?, UTC_TIMESTAMP(6)) ON DUPLICATE KEY UPDATE version = version",
            )
            .bind(&self.inner.table)
            .bind(version)
            .execute(&mut *conn)
            .await
            .map_err(map)?;
        }
        Ok(())
    }

    /// Asks the server once for what it supports: `RETURNING` (MariaDB
    /// 10.5+) and `max_allowed_packet` (which bounds the outcome size).
    /// `conn`: ask on the caller's connection (`claim_in`), so a pool whose
    /// connections are all inside the caller's transactions cannot stall it.
    async fn probe(&self, conn: Option<&mut MySqlConnection>) -> Result<()> {
        if self.inner.probed.initialized() {
            return Ok(());
        }
        self.inner
            .probed
            .get_or_try_init(|| async move {
                let in_caller_tx = conn.is_some();
                let mut conn = conn;
                let q = sqlx::query("SELECT VERSION() AS v, @@max_allowed_packet AS p");
                let row = match conn.as_deref_mut() {
                    Some(conn) => q.fetch_one(conn).await,
                    None => q.fetch_one(&self.inner.pool).await,
                }
                .map_err(map)?;
                let version: String = row.try_get("v").map_err(map)?;
                let packet: u64 = row.try_get("p").map_err(map)?;
                let returning = self
                    .inner
                    .returning_pref
                    .unwrap_or_else(|| mariadb_returning(&version));
                self.inner.returning.store(returning, Ordering::Relaxed);
                // The outcome travels in one packet with the key, the fence and
                // the statement's framing; keep 4 KiB for those.
                let fits = usize::try_from(packet.saturating_sub(4096)).unwrap_or(usize::MAX);
                self.inner.max_outcome.fetch_min(fits, Ordering::Relaxed);
                // MariaDB tells whether a statement runs inside an open
                // transaction; MySQL 8 has no such variable (error 1193).
                let q = sqlx::query_scalar::<_, u64>("SELECT @@in_transaction");
                let guarded = match conn {
                    Some(conn) => q.fetch_one(conn).await,
                    None => q.fetch_one(&self.inner.pool).await,
                };
                // A pool whose sessions run with autocommit = 0 would leave
                // every ledger write uncommitted (claim_in asks on the
                // caller's connection, which may legitimately be so).
                if !in_caller_tx {
                    let autocommit: i64 = sqlx::query_scalar("SELECT @@autocommit")
                        .fetch_one(&self.inner.pool)
                        .await
                        .map_err(map)?;
                    if autocommit == 0 {
                        return Err(autocommit_off());
                    }
                }
                match guarded {
                    Ok(_) => self.inner.guarded.store(true, Ordering::Relaxed),
                    Err(e) if error::number(&e) == Some(1193) => {}
                    Err(e) => return Err(map(e)),
                }
                Ok::<_, Error>(())
            })
            .await
            .map(|_| ())
    }

    /// Runs `f` on a pooled connection in a spawned task (so it finishes
    /// even if the caller's future is dropped), retrying lock conflicts.
    async fn on_pool<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: for<'c> Fn(&'c MySqlLedger, &'c mut MySqlConnection) -> boxed::BoxedFuture<'c, Result<T, Retry>>
            + Send
            + Sync
            + 'static,
    {
        let this = self.clone();
        tokio::spawn(async move {
            this.probe(None).await?;
            let mut last = None;
            for attempt in 0..LOCK_RETRIES {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(2 << attempt.min(6))).await;
                }
                let mut conn = this.inner.pool.acquire().await.map_err(map)?;
                match f(&this, &mut conn).await {
                    Ok(v) => return Ok(v),
                    Err(Retry::Lock(e)) => last = Some(Retry::Lock(e)),
                    Err(Retry::Moved(why)) => last = Some(Retry::Moved(why)),
                    Err(Retry::Leaked) => last = Some(Retry::Leaked),
                    Err(Retry::Fail(e)) => return Err(e),
                }
            }
            Err(match last {
                Some(Retry::Lock(e)) => map(e),
                // The statement keeps missing the key's row: only a conflict
                // on another unique index does that.
                Some(Retry::Moved(why)) => unexpected_violation(&why),
                Some(Retry::Fail(e)) => e,
                Some(Retry::Leaked) | None => corrupt("retries exhausted"),
            })
        })
        .await
        .map_err(join_error)?
    }
}

/// Whether a `VERSION()` string is MariaDB 10.5 or later.
fn mariadb_returning(version: &str) -> bool {
    if !version.to_ascii_lowercase().contains("mariadb") {
        return false;
    }
    // Old replication-compatible servers prefix the real version with 5.5.5-.
    let version = version.strip_prefix("5.5.5-").unwrap_or(version);
    let mut parts = version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty());
    let major: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    (major, minor) >= (10, 5)
}

/// Why an attempt on the pool did not finish.
enum Retry {
    /// Deadlock or lock wait timeout: run it again.
    Lock(sqlx::Error),
    /// The row moved under a multi-statement claim: run it again, and report
    /// this if it keeps happening.
    Moved(String),
    /// The pooled connection was inside a transaction someone else left
    /// open; it has been rolled back and nothing was written: run it again.
    Leaked,
    /// Final.
    Fail(Error),
}

impl From<Error> for Retry {
    fn from(e: Error) -> Self {
        Retry::Fail(e)
    }
}

fn retry_on_lock(e: sqlx::Error) -> Retry {
    if error::is_retryable(&e) {
        Retry::Lock(e)
    } else {
        Retry::Fail(map(e))
    }
}

mod boxed {
    /// A boxed, sendable future.
    pub(crate) type BoxedFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
}

impl MySqlLedger {
    /// The current statement set (guarded where the server allows).
    fn sql(&self) -> &Statements {
        &self.inner.sql[usize::from(self.inner.guarded.load(Ordering::Relaxed))]
    }

    /// After a guarded write found nothing to do on a pooled connection:
    /// whether that was because the connection sat inside a transaction that
    /// someone else left open (their `pool.begin()` dropped mid-way, an
    /// aborted `BEGIN`). If so, that transaction is rolled back, so the
    /// connection is clean for the retry and no lock of ours outlives it.
    /// A fenced write matched no row: the lease is lost, unless the pooled
    /// connection sat inside a transaction someone else left open (checked
    /// when `may_leak`), which is healed so the write runs again.
    async fn fence_miss(&self, conn: &mut MySqlConnection, lease: &Lease, may_leak: bool) -> Retry {
        if may_leak {
            match self.heal_if_leaked(conn).await {
                Ok(true) => return Retry::Leaked,
                Ok(false) => {}
                Err(e) => return e,
            }
        }
        lease_lost(lease).into()
    }

    async fn heal_if_leaked(&self, conn: &mut MySqlConnection) -> Result<bool, Retry> {
        if !self.inner.guarded.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let row = sqlx::query("SELECT @@in_transaction AS open, @@autocommit AS autocommit")
            .fetch_one(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        let open: u64 = row.try_get("open").map_err(map)?;
        let autocommit: i64 = row.try_get("autocommit").map_err(map)?;
        if open == 0 {
            return Ok(false);
        }
        if autocommit == 0 {
            // Every statement opens a transaction that nobody commits: the
            // guard would trip forever. Say so instead.
            conn.execute("ROLLBACK").await.map_err(retry_on_lock)?;
            return Err(autocommit_off().into());
        }
        tracing::warn!(
            backend = BACKEND,
            "a pooled connection was inside a transaction left open by other code; rolling it back"
        );
        conn.execute("ROLLBACK").await.map_err(retry_on_lock)?;
        Ok(true)
    }

    /// One claim attempt on `conn`. `in_caller_tx`: `claim_in` on the
    /// caller's transaction (no leaked-transaction guard).
    async fn claim_on(
        &self,
        conn: &mut MySqlConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
        in_caller_tx: bool,
    ) -> Result<Claim, Retry> {
        let token = claim_token();
        let returning = self.inner.returning.load(Ordering::Relaxed);
        let horizon = opts.sent_at.is_some();
        let s = self.sql();
        let text = match (returning, horizon) {
            (true, false) => &s.claim_returning,
            (true, true) => &s.claim_horizon_returning,
            (false, false) => &s.claim,
            (false, true) => &s.claim_horizon,
        };
        let fp = opts.fingerprint.map(|f| f.as_bytes().to_vec());
        let lease_us = duration_micros(opts.lease);
        let retention_us = duration_micros(opts.retention);
        let mut q = sqlx::query(sqlx::AssertSqlSafe(text.as_str()))
            .bind(key.as_str())
            .bind(key.tenant().as_str())
            .bind(key.kind())
            .bind(key.subject())
            .bind(fp)
            .bind(opts.at_most_once)
            .bind(&token[..])
            .bind(lease_us)
            .bind(retention_us)
            .bind(retention_us);
        if let Some(sent) = opts.sent_at {
            q = q
                .bind(in_caller_tx)
                .bind(to_micros(sent))
                .bind(retention_us)
                .bind(key.as_str());
        }
        let row = if returning {
            match q.fetch_optional(&mut *conn).await {
                Ok(Some(row)) => {
                    let in_tx = row.try_get::<u64, _>("in_tx").map_err(map)? != 0;
                    if !in_caller_tx && in_tx && self.heal_if_leaked(conn).await? {
                        return Err(Retry::Leaked);
                    }
                    stored(&row)?
                }
                Ok(None) if !in_caller_tx && self.heal_if_leaked(conn).await? => return Err(Retry::Leaked),
                Ok(None) if horizon => return Err(Error::BeyondHorizon { key: key.to_string() }.into()),
                Ok(None) => return Err(corrupt("claim returned no row").into()),
                Err(e) if error::number(&e) == Some(1064) && self.inner.returning_pref.is_none() => {
                    // This server parses no ODKU … RETURNING: use the
                    // two-statement path from now on.
                    self.inner.returning.store(false, Ordering::Relaxed);
                    return Err(Retry::Moved("RETURNING unsupported".into()));
                }
                Err(e) => return Err(retry_on_lock(e)),
            }
        } else {
            q.execute(&mut *conn).await.map_err(retry_on_lock)?;
            let read = sqlx::query(sqlx::AssertSqlSafe(s.read_locking.as_str()))
                .bind(key.as_str())
                .fetch_optional(&mut *conn)
                .await
                .map_err(retry_on_lock)?;
            let leaked = match &read {
                Some(row) => row.try_get::<u64, _>("in_tx").map_err(map)? != 0,
                None => true,
            };
            if !in_caller_tx && leaked && self.heal_if_leaked(conn).await? {
                return Err(Retry::Leaked);
            }
            match read {
                Some(row) => stored(&row)?,
                None if horizon => return Err(Error::BeyondHorizon { key: key.to_string() }.into()),
                // Absent right after an ODKU without a horizon check: either
                // the insert hit another unique index, or a prune removed the
                // row in between. Run it again; if it persists it is the former.
                None => return Err(Retry::Moved(format!("{key}: claim wrote no row for the key"))),
            }
        };
        match interpret(&row, key, opts, &token, returning)? {
            Some(c) => Ok(c),
            None => Err(Retry::Moved(format!(
                "{key}: the row changed between the claim and its read"
            ))),
        }
    }
}

fn interpret(
    row: &Stored,
    key: &EffectKey,
    opts: &ClaimOptions,
    token: &[u8; 16],
    returning: bool,
) -> Result<Option<Claim>> {
    if row.key != key.as_str() {
        // RETURNING gave another effect's row: the insert conflicted on a
        // unique index other than the effect key, and the guard kept ODKU
        // from touching it.
        return Err(unexpected_violation(&format!(
            "claiming {key} conflicted with the row of {}",
            row.key
        )));
    }
    if let (Some(stored), Some(given)) = (&row.fingerprint, opts.fingerprint)
        && stored.as_slice() != given.as_bytes()
    {
        return Err(Error::FingerprintMismatch { key: key.to_string() });
    }
    let state = RecordState::parse(&row.state).map_err(|e| corrupt(e.to_string()))?;
    let ours = row.token.as_slice() == token.as_slice();
    if ours && state == RecordState::InProgress {
        let expires = row
            .lease_expires_us
            .ok_or_else(|| corrupt(format!("{key}: in-progress row without a lease")))?;
        return Ok(Some(Claim::Acquired(Lease {
            key: key.clone(),
            fence: row.fence,
            expires_at: from_micros(expires),
            first_claimed_at: from_micros(row.created_us),
            acquired_at: from_micros(row.updated_us),
            taken_over: row.fence > 1,
            at_most_once: row.at_most_once,
        })));
    }
    let expired = row.expired();
    Ok(Some(match state {
        RecordState::Completed => Claim::Completed(row.record(Some(key))?),
        RecordState::InProgress if !expired => Claim::InProgress {
            fence: row.fence,
            expires_at: from_micros(row.lease_expires_us.unwrap_or(row.now_us)),
            first_claimed_at: from_micros(row.created_us),
            read_at: from_micros(row.now_us),
        },
        RecordState::InProgress if row.at_most_once => Claim::Abandoned(row.record(Some(key))?),
        // A takeover-eligible row that is not ours. With RETURNING the row is
        // what our statement saw, so the update did not apply to it: only a
        // conflict on another unique index does that.
        _ if returning => {
            return Err(unexpected_violation(&format!(
                "claiming {key}: the takeover did not apply to the key's row"
            )));
        }
        // The two-statement path read a row that moved after its statement
        // (or a statement that missed it): run the claim again.
        _ => return Ok(None),
    }))
}

impl Ledger for MySqlLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            caller_transaction: true,
            durability: "InnoDB redo log, as the server flushes it (innodb_flush_log_at_trx_commit)",
            replicated: false,
            clock: "database server clock (UTC_TIMESTAMP(6))",
            max_key_bytes: oncely::MAX_KEY_BYTES,
            max_outcome_bytes: self.max_outcome_bytes(),
        }
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        let (key, opts) = (key.clone(), opts.clone());
        self.on_pool(move |this, conn| {
            let (key, opts) = (key.clone(), opts.clone());
            Box::pin(async move { this.claim_on(conn, &key, &opts, false).await })
        })
        .await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.check_outcome(outcome)?;
        let (lease, outcome) = (lease.clone(), outcome.clone());
        self.on_pool(move |this, conn| {
            let (lease, outcome) = (lease.clone(), outcome.clone());
            Box::pin(async move { this.complete_on(conn, &lease, &outcome, false).await })
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let lease = lease.clone();
        self.on_pool(move |this, conn| {
            let lease = lease.clone();
            Box::pin(async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(this.sql().release.as_str()))
                    .bind(lease.key.as_str())
                    .bind(lease.fence)
                    .bind(false)
                    .execute(&mut *conn)
                    .await
                    .map_err(retry_on_lock)?;
                if done.rows_affected() == 0 {
                    return Err(this.fence_miss(conn, &lease, true).await);
                }
                Ok(())
            })
        })
        .await
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        if extend_by < Duration::from_millis(1) || extend_by > Duration::from_secs(86_400) {
            return Err(Error::Misuse(format!(
                "a lease must be extended by between 1 ms and 1 day, got {extend_by:?}"
            )));
        }
        let lease = lease.clone();
        self.on_pool(move |this, conn| {
            let lease = lease.clone();
            Box::pin(async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(this.sql().renew.as_str()))
                    .bind(duration_micros(extend_by))
                    .bind(lease.key.as_str())
                    .bind(lease.fence)
                    .bind(false)
                    .execute(&mut *conn)
                    .await
                    .map_err(retry_on_lock)?;
                if done.rows_affected() == 0 {
                    return Err(this.fence_miss(conn, &lease, true).await);
                }
                // LAST_INSERT_ID(expr) in the statement puts the new expiry
                // in the OK packet.
                let expires_us = i64::try_from(done.last_insert_id())
                    .ok()
                    .filter(|us| *us > 0)
                    .ok_or_else(|| corrupt("renew: the server did not report the new expiry"))?;
                Ok(Lease {
                    expires_at: from_micros(expires_us),
                    ..lease
                })
            })
        })
        .await
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let row = sqlx::query(sqlx::AssertSqlSafe(self.sql().get.as_str()))
            .bind(key.as_str())
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(map)?;
        row.map(|r| stored(&r)?.record(Some(key))).transpose()
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        // Delete in bounded batches so one prune never holds many row locks.
        const BATCH: u64 = 1000;
        let this = self.clone();
        tokio::spawn(async move {
            let mut total = 0u64;
            while total < limit {
                let n = (limit - total).min(BATCH);
                let done = sqlx::query(sqlx::AssertSqlSafe(this.sql().prune.as_str()))
                    .bind(n)
                    .execute(&this.inner.pool)
                    .await
                    .map_err(map)?;
                total += done.rows_affected();
                if done.rows_affected() < n {
                    break;
                }
            }
            Ok(total)
        })
        .await
        .map_err(join_error)?
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(self.sql().abandoned.as_str()))
            .bind(tenant.as_str())
            .bind(limit)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(map)?;
        rows.iter().map(|r| stored(r)?.record(None)).collect()
    }
}

impl MySqlLedger {
    fn check_outcome(&self, outcome: &Outcome) -> Result<()> {
        let max = self.max_outcome_bytes();
        if outcome.len() > max {
            return Err(Error::OutcomeTooLarge {
                size: outcome.len(),
                max,
            });
        }
        Ok(())
    }

    async fn complete_on(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        outcome: &Outcome,
        in_caller_tx: bool,
    ) -> Result<(), Retry> {
        let done = sqlx::query(sqlx::AssertSqlSafe(self.sql().complete.as_str()))
            .bind(outcome.as_bytes())
            .bind(lease.key.as_str())
            .bind(lease.fence)
            .bind(in_caller_tx)
            .execute(&mut *conn)
            .await
            .map_err(retry_on_lock)?;
        // sqlx sets CLIENT_FOUND_ROWS: this is the number of rows matched.
        if done.rows_affected() == 0 {
            return Err(self.fence_miss(conn, lease, !in_caller_tx).await);
        }
        Ok(())
    }
}

impl TransactionalLedger for MySqlLedger {
    type Connection = MySqlConnection;

    async fn claim_in(
        &self,
        conn: &mut MySqlConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
    ) -> Result<Claim> {
        opts.validate()?;
        self.probe(Some(&mut *conn)).await?;
        // Inside the caller's transaction nothing is retried: a deadlock has
        // rolled the whole transaction back, which only the caller can redo.
        let mut moved = 0;
        loop {
            match self.claim_on(conn, key, opts, true).await {
                Ok(c) => return Ok(c),
                Err(Retry::Fail(e)) => return Err(e),
                Err(Retry::Lock(e)) => return Err(map(e)),
                Err(Retry::Leaked) => {
                    return Err(corrupt(
                        "leaked-transaction guard tripped in a caller's transaction",
                    ));
                }
                Err(Retry::Moved(why)) => {
                    // Only the two-statement path can see a row move, and in a
                    // transaction its locking read holds the row from then on.
                    moved += 1;
                    if moved >= 3 {
                        return Err(unexpected_violation(&why));
                    }
                }
            }
        }
    }

    async fn complete_in(&self, conn: &mut MySqlConnection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.check_outcome(outcome)?;
        match self.complete_on(conn, lease, outcome, true).await {
            Ok(()) => Ok(()),
            Err(Retry::Fail(e)) => Err(e),
            Err(Retry::Lock(e)) => Err(map(e)),
            Err(Retry::Leaked | Retry::Moved(_)) => Err(corrupt("complete_in: unexpected retry")),
        }
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
    fn returning_detection() {
        assert!(mariadb_returning("10.11.19-MariaDB-0+deb12u1"));
        assert!(mariadb_returning("10.5.0-MariaDB"));
        assert!(mariadb_returning("11.4.2-MariaDB-log"));
        assert!(!mariadb_returning("10.4.30-MariaDB"));
        assert!(!mariadb_returning("8.0.36"));
        assert!(
            mariadb_returning("5.5.5-10.11.6-MariaDB"),
            "the 5.5.5- prefix is not the version"
        );
    }

    #[test]
    fn tokens_are_unique() {
        let a = claim_token();
        let b = claim_token();
        assert_ne!(a, b);
        assert_eq!(a[..8], b[..8]);
    }
}
