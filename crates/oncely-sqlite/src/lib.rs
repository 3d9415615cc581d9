//! # oncely-sqlite
//!
//! The SQLite backend of [oncely]: the embedded default effect
//! ledger. One file, no server; the ledger table can live in the same
//! database as your business tables, so a claim, your writes and the
//! completion commit in one transaction.
//!
//! ```no_run
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_sqlite::SqliteLedger;
//!
//! # async fn demo() -> oncely::Result<()> {
//! // Creates the file if it is missing, turns on WAL and runs the migrations.
//! let ledger = SqliteLedger::connect("sqlite:data/app.db").await?;
//! let effects = Effects::new(ledger);
//! let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//! let charge: String = effects
//!     .run(&key, &ClaimOptions::default(), |lease| async move {
//!         // Call the provider with lease.provider_key() as its idempotency key.
//!         Ok(format!("ch_{}", &lease.provider_key()[..8]))
//!     })
//!     .await?;
//! # let _ = charge; Ok(()) }
//! ```
//!
//! ## Claims inside your transaction
//!
//! For effects that are writes to the same database, claim on your own
//! transaction with [`TransactionalLedger`]: the
//! claim row, the business rows and the completion commit together, or none
//! of them does. Start the transaction with [`SqliteLedger::begin`]
//! (`BEGIN IMMEDIATE`): it takes SQLite's write lock up front, so a
//! concurrent duplicate waits at its own `begin` until the first commits and
//! then sees [`Claim::Completed`] (or acquires, if
//! the first rolled back). A deferred `BEGIN` that reads before it writes can
//! instead fail with a retryable busy error when another writer got there first.
//!
//! ```no_run
//! use oncely::{Claim, ClaimOptions, EffectKey, Outcome, Tenant, TransactionalLedger};
//! use oncely_sqlite::SqliteLedger;
//!
//! # async fn demo(ledger: SqliteLedger) -> oncely::Result<()> {
//! let key = EffectKey::new(&Tenant::global(), "ship", "order-123")?;
//! let mut tx = ledger.begin().await?;
//! match ledger.claim_in(&mut *tx, &key, &ClaimOptions::default()).await? {
//!     Claim::Acquired(lease) => {
//!         oncely_sqlite::sqlx::query("INSERT INTO shipments (order_id) VALUES (?1)")
//!             .bind("order-123")
//!             .execute(&mut *tx)
//!             .await
//!             .map_err(|e| oncely::Error::Backend { backend: "app", message: e.to_string(), retryable: true })?;
//!         ledger.complete_in(&mut *tx, &lease, &Outcome::from_json(&"shipped")?).await?;
//!         tx.commit().await.map_err(oncely_sqlite::map_error)?;
//!     }
//!     Claim::Completed(record) => { /* already done: replay record.outcome */ }
//!     other => { /* in progress elsewhere or abandoned: retry later */ let _ = other; }
//! }
//! # Ok(()) }
//! ```
//!
//! ## Guarantees and limits
//!
//! | property | SQLite backend |
//! | --- | --- |
//! | atomic claim | one `INSERT … ON CONFLICT(key) DO UPDATE … WHERE <takeover> RETURNING` statement under SQLite's single-writer lock (insert if absent, or take over a released record or an expired lease with `fence + 1`). A new key costs that one statement; a duplicate costs a second one that reads the record, and claims again if the record changed in between (released, expired or pruned) |
//! | caller's transaction | yes: `claim_in` / `complete_in` on `&mut SqliteConnection`, transaction from [`SqliteLedger::begin`] (`BEGIN IMMEDIATE`) |
//! | durability | WAL with `synchronous=FULL` by default: a completed record survives a process crash and a power loss once `complete` returns. `synchronous=NORMAL` ([`SqliteLedgerOptions::synchronous`]) is faster and survives process crashes, but a power loss may roll back the last commits, so an effect could run again |
//! | replication | none: one file on one machine (use the PostgreSQL backend across machines) |
//! | clock | SQLite's clock (`unixepoch('subsec')`, millisecond resolution) on the machine that opens the file |
//! | concurrency | many readers, one writer at a time; writers wait up to the busy timeout (5 s by default), then fail with a retryable `Error::Backend` |
//! | max key | [`oncely::MAX_KEY_BYTES`] (255 bytes, stored whole as TEXT) |
//! | max outcome | [`oncely::MAX_OUTCOME_BYTES`] (64 KiB, BLOB) |
//!
//! The file must be on a local disk: SQLite's locking (WAL uses shared
//! memory) does not work over network file systems.
//!
//! Errors: a database that cannot be opened (missing directory, permissions)
//! is [`Error::Unavailable`] and no effect runs;
//! `SQLITE_BUSY`/`SQLITE_LOCKED` are retryable
//! [`Error::Backend`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod queries;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Fingerprint, Lease, Ledger, Outcome, Record,
    RecordState, Result, Tenant, TransactionalLedger,
};
use oncely::backend::{duration_micros, from_micros, to_micros};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow};
use sqlx::{AssertSqlSafe, Connection, Row};

use crate::error::{BACKEND, corrupt, map, map_connect};
use crate::queries::Queries;

pub use sqlx;
pub use sqlx::Transaction;
pub use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePool, SqliteSynchronous};

/// Maps a sqlx error (from your own statements in a transaction from
/// [`SqliteLedger::begin`], or its commit) the way the ledger maps its own:
/// busy and locked are retryable, an unopenable file is `Unavailable`.
pub fn map_error(e: sqlx::Error) -> Error {
    map(e)
}

/// How [`SqliteLedger::connect_with`] opens the database.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SqliteLedgerOptions {
    /// Most connections in the pool (default 16). SQLite runs one writer at a
    /// time; more connections help concurrent readers and keep waiting
    /// writers off each other's connections.
    pub max_connections: u32,
    /// The ledger table (default `oncely_effects`).
    pub table: String,
    /// How long a writer waits for SQLite's write lock before failing with a
    /// retryable error (default 5 s).
    pub busy_timeout: Duration,
    /// How long an operation waits for a free pooled connection (default 30 s).
    pub acquire_timeout: Duration,
    /// `PRAGMA synchronous` (default `Full`; see the crate docs' table).
    pub synchronous: SqliteSynchronous,
}

impl Default for SqliteLedgerOptions {
    fn default() -> Self {
        SqliteLedgerOptions {
            max_connections: 16,
            table: queries::DEFAULT_TABLE.to_owned(),
            busy_timeout: Duration::from_secs(5),
            acquire_timeout: Duration::from_secs(30),
            synchronous: SqliteSynchronous::Full,
        }
    }
}

impl SqliteLedgerOptions {
    /// Sets the pool size.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets the ledger table name.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    /// Sets the busy timeout.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Sets the pool acquire timeout.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Sets `PRAGMA synchronous`.
    pub fn synchronous(mut self, synchronous: SqliteSynchronous) -> Self {
        self.synchronous = synchronous;
        self
    }
}

/// An effect ledger in a SQLite database file. Cheap to clone: a pool handle
/// and the table's prepared SQL text.
#[derive(Clone)]
pub struct SqliteLedger {
    pool: SqlitePool,
    q: Arc<Queries>,
    durability: &'static str,
}

impl fmt::Debug for SqliteLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteLedger")
            .field("table", &self.q.table)
            .field("pool_size", &self.pool.size())
            .finish_non_exhaustive()
    }
}

const DURABLE_FULL: &str = "local file, WAL, synchronous=FULL: survives process crashes and power loss";
const DURABLE_NORMAL: &str =
    "local file, WAL, synchronous=NORMAL: survives process crashes; a power loss may undo the last commits";
const DURABLE_OFF: &str =
    "local file, synchronous=OFF: an OS crash or power loss may lose or corrupt records";
const DURABLE_POOL: &str = "local file; as durable as the pool's journal_mode and synchronous settings";

/// Parses `sqlite:path`, `sqlite://path` (with optional `?…` parameters) or
/// a bare path. In-memory databases are refused: every pooled connection
/// would get its own empty database.
fn connect_options(url: &str) -> Result<SqliteConnectOptions> {
    let lower = url.to_ascii_lowercase();
    if lower.contains(":memory:") || lower.contains("mode=memory") {
        return Err(Error::Config(format!(
            "{url}: in-memory SQLite gives every pooled connection its own database; use a file \
             (a temporary one in tests), or oncely::MemoryLedger"
        )));
    }
    let opts = if lower.starts_with("sqlite:") {
        SqliteConnectOptions::from_str(url).map_err(|e| Error::Config(format!("{url}: {e}")))?
    } else {
        SqliteConnectOptions::new().filename(url)
    };
    Ok(opts)
}

impl SqliteLedger {
    /// Opens (creating if missing) the database at `url` with the default
    /// [`SqliteLedgerOptions`], and runs the migrations.
    ///
    /// Accepts `sqlite:path`, `sqlite://path` and a bare file path. A file
    /// that cannot be opened (missing directory, permissions) fails with
    /// [`Error::Unavailable`].
    pub async fn connect(url: &str) -> Result<SqliteLedger> {
        Self::connect_with(url, SqliteLedgerOptions::default()).await
    }

    /// [`SqliteLedger::connect`] with options.
    pub async fn connect_with(url: &str, options: SqliteLedgerOptions) -> Result<SqliteLedger> {
        let q = Arc::new(Queries::new(&options.table)?);
        if options.max_connections == 0 {
            return Err(Error::Config("max_connections must be at least 1".to_owned()));
        }
        let connect = connect_options(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(options.synchronous)
            .busy_timeout(options.busy_timeout)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            // No release hook is needed to keep a connection inside an open
            // transaction out of the pool: a dropped `Transaction` (or a
            // dropped `begin`) queues its ROLLBACK on the connection's worker
            // thread, and the pool pings that worker before it hands the
            // connection out again, so the rollback has run by then. The
            // `aborted_transactions_commit_all_or_nothing` test checks it.
            .connect_with(connect)
            .await
            .map_err(map_connect)?;
        let durability = match options.synchronous {
            SqliteSynchronous::Full | SqliteSynchronous::Extra => DURABLE_FULL,
            SqliteSynchronous::Normal => DURABLE_NORMAL,
            SqliteSynchronous::Off => DURABLE_OFF,
        };
        let ledger = SqliteLedger { pool, q, durability };
        ledger.migrate().await?;
        Ok(ledger)
    }

    /// A ledger over an existing pool, with the default table. Call
    /// [`SqliteLedger::migrate`] once before use if the table may not exist.
    ///
    /// The pool's connect options are yours: WAL and a busy timeout are
    /// strongly recommended (see [`SqliteLedger::connect`]).
    pub fn from_pool(pool: SqlitePool) -> SqliteLedger {
        SqliteLedger {
            pool,
            q: Arc::new(Queries::new(queries::DEFAULT_TABLE).expect("the default table name is valid")),
            durability: DURABLE_POOL,
        }
    }

    /// The same pool with another ledger table. Fails with
    /// [`Error::Config`] on a name that is not a plain identifier.
    pub fn with_table(self, table: &str) -> Result<SqliteLedger> {
        Ok(SqliteLedger {
            pool: self.pool,
            q: Arc::new(Queries::new(table)?),
            durability: self.durability,
        })
    }

    /// Creates or upgrades the ledger table. Running it again is a no-op: the
    /// schema version is kept per table in `oncely_schema`, and each step is
    /// applied in one `BEGIN IMMEDIATE` transaction, so concurrent migrators
    /// take turns.
    pub async fn migrate(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(map_connect)?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        sqlx::query(AssertSqlSafe(self.q.create_version_table.clone()))
            .execute(&mut *tx)
            .await
            .map_err(map)?;
        let current: i64 = sqlx::query_scalar(AssertSqlSafe(self.q.read_version.clone()))
            .bind(&*self.q.table)
            .fetch_optional(&mut *tx)
            .await
            .map_err(map)?
            .unwrap_or(0);
        if current > queries::SCHEMA_VERSION {
            return Err(corrupt(format!(
                "table {} has schema version {current}; this oncely-sqlite knows up to {}",
                self.q.table,
                queries::SCHEMA_VERSION
            )));
        }
        for step in self
            .q
            .migrations
            .iter()
            .skip(usize::try_from(current).unwrap_or(0))
        {
            sqlx::raw_sql(AssertSqlSafe(step.clone()))
                .execute(&mut *tx)
                .await
                .map_err(map)?;
        }
        if current != queries::SCHEMA_VERSION {
            sqlx::query(AssertSqlSafe(self.q.write_version.clone()))
                .bind(&*self.q.table)
                .bind(queries::SCHEMA_VERSION)
                .execute(&mut *tx)
                .await
                .map_err(map)?;
        }
        tx.commit().await.map_err(map)
    }

    /// The pool underneath, for your own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The ledger table's name.
    pub fn table(&self) -> &str {
        &self.q.table
    }

    /// Starts a write transaction with `BEGIN IMMEDIATE` on a pooled
    /// connection, for [`TransactionalLedger::claim_in`] and your own writes.
    ///
    /// It takes SQLite's write lock at once (waiting up to the busy timeout),
    /// so a duplicate claim on another connection waits for this one to
    /// commit or roll back instead of failing. Dropping the transaction rolls
    /// it back.
    pub async fn begin(&self) -> Result<Transaction<'static, Sqlite>> {
        self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(map)
    }

    async fn claim_on(
        &self,
        conn: &mut SqliteConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
    ) -> Result<Claim> {
        opts.validate()?;
        let retention = duration_micros(opts.retention);
        let sent_at = opts.sent_at.map(to_micros).transpose()?;
        // A takeover-able record or a vanished row seen by the follow-up read
        // means the record changed after the claim statement ran (released,
        // expired or pruned in between); claim again. Each pass is atomic, so
        // this never writes on a stale read. Inside a `BEGIN IMMEDIATE`
        // transaction nothing else writes, and only the clock can move.
        for _ in 0..8 {
            let sql = if sent_at.is_some() {
                &self.q.claim_horizon
            } else {
                &self.q.claim
            };
            let mut claim = sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(key.as_str())
                .bind(key.tenant().as_str())
                .bind(key.kind())
                .bind(key.subject())
                .bind(opts.fingerprint.as_ref().map(|f| f.as_bytes().as_slice()))
                .bind(opts.at_most_once)
                .bind(duration_micros(opts.lease))
                .bind(retention);
            if let Some(sent_at) = sent_at {
                claim = claim.bind(sent_at);
            }
            if let Some(row) = claim.fetch_optional(&mut *conn).await.map_err(map)? {
                return lease_from_row(key, opts, &row).map(Claim::Acquired);
            }
            let row = sqlx::query(AssertSqlSafe(self.q.claim_read.clone()))
                .bind(key.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(map)?;
            let now: i64 = row.try_get(13).map_err(map)?;
            let present: Option<String> = row.try_get(0).map_err(map)?;
            if present.is_none() {
                if sent_at.is_some_and(|s| s.saturating_add(retention) < now) {
                    return Err(Error::BeyondHorizon { key: key.to_string() });
                }
                continue;
            }
            let r = decode_record(&row)?;
            if let (Some(stored), Some(given)) = (r.fingerprint, opts.fingerprint)
                && stored != given
            {
                return Err(Error::FingerprintMismatch { key: key.to_string() });
            }
            match r.state {
                RecordState::Completed => return Ok(Claim::Completed(r)),
                RecordState::Abandoned => return Ok(Claim::Abandoned(r)),
                RecordState::InProgress if r.lease_expires_at.is_some_and(|e| e > r.read_at) => {
                    return Ok(Claim::InProgress {
                        fence: r.fence,
                        expires_at: r.lease_expires_at.unwrap_or(r.read_at),
                        first_claimed_at: r.created_at,
                        read_at: r.read_at,
                    });
                }
                RecordState::InProgress | RecordState::Released => continue,
            }
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!("{key}: the record kept changing during the claim"),
            retryable: true,
        })
    }

    async fn complete_on(&self, conn: &mut SqliteConnection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        if outcome.len() > oncely::MAX_OUTCOME_BYTES {
            return Err(Error::OutcomeTooLarge {
                size: outcome.len(),
                max: oncely::MAX_OUTCOME_BYTES,
            });
        }
        let done = sqlx::query(AssertSqlSafe(self.q.complete.clone()))
            .bind(lease.key.as_str())
            .bind(fence_param(lease.fence))
            .bind(outcome.as_bytes())
            .execute(&mut *conn)
            .await
            .map_err(map)?;
        fenced(lease, done.rows_affected())
    }
}

fn fence_param(fence: u64) -> i64 {
    // A fence past i64::MAX matches no stored row (they start at 1 and grow
    // by one), so it is reported as lost like any other stale fence.
    i64::try_from(fence).unwrap_or(-1)
}

fn fenced(lease: &Lease, rows: u64) -> Result<()> {
    if rows == 1 {
        Ok(())
    } else {
        Err(Error::LeaseLost {
            key: lease.key.to_string(),
            fence: lease.fence,
        })
    }
}

fn fence_from(v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| corrupt(format!("negative fence {v}")))
}

fn lease_from_row(key: &EffectKey, opts: &ClaimOptions, row: &SqliteRow) -> Result<Lease> {
    let fence = fence_from(row.try_get(0).map_err(map)?)?;
    let created: i64 = row.try_get(1).map_err(map)?;
    let updated: i64 = row.try_get(2).map_err(map)?;
    let expires: i64 = row.try_get(3).map_err(map)?;
    Ok(Lease {
        key: key.clone(),
        fence,
        expires_at: from_micros(expires),
        first_claimed_at: from_micros(created),
        acquired_at: from_micros(updated),
        taken_over: fence > 1,
        at_most_once: opts.at_most_once,
    })
}

/// Decodes the columns of `queries::RECORD_COLUMNS` plus `now`. An expired
/// at-most-once lease is reported as [`RecordState::Abandoned`].
fn decode_record(row: &SqliteRow) -> Result<Record> {
    let stored: String = row.try_get(0).map_err(map)?;
    let tenant: String = row.try_get(1).map_err(map)?;
    let kind: String = row.try_get(2).map_err(map)?;
    let subject: String = row.try_get(3).map_err(map)?;
    let key = Tenant::parse(&tenant)
        .and_then(|t| EffectKey::new(&t, &kind, &subject))
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    if key.as_str() != stored {
        return Err(corrupt(format!("row {stored:?} has parts of {key}")));
    }
    let state: String = row.try_get(4).map_err(map)?;
    let mut state = RecordState::parse(&state).map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let fingerprint = row
        .try_get::<Option<Vec<u8>>, _>(6)
        .map_err(map)?
        .map(|b| Fingerprint::from_bytes(&b))
        .transpose()
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let outcome = row
        .try_get::<Option<Vec<u8>>, _>(7)
        .map_err(map)?
        .map(Outcome::from_bytes)
        .transpose()
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let at_most_once: bool = row.try_get(8).map_err(map)?;
    let ts = |i: usize| -> Result<SystemTime> { Ok(from_micros(row.try_get(i).map_err(map)?)) };
    let lease_expires_at = row.try_get::<Option<i64>, _>(11).map_err(map)?.map(from_micros);
    let read_at = ts(13)?;
    if state == RecordState::InProgress && at_most_once && lease_expires_at.is_some_and(|e| e <= read_at) {
        state = RecordState::Abandoned;
    }
    Ok(Record {
        key,
        state,
        fence: fence_from(row.try_get(5).map_err(map)?)?,
        fingerprint,
        outcome,
        at_most_once,
        created_at: ts(9)?,
        updated_at: ts(10)?,
        lease_expires_at,
        retain_until: ts(12)?,
        read_at,
    })
}

// Every pool operation below is one autocommit statement (claim: one
// statement, plus a read when it did not acquire), so a dropped future either
// committed it whole or not at all, and the connection goes back to the pool
// with no transaction open.
impl Ledger for SqliteLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            caller_transaction: true,
            durability: self.durability,
            replicated: false,
            clock: "SQLite unixepoch('subsec') on the host that opens the file",
            max_key_bytes: oncely::MAX_KEY_BYTES,
            max_outcome_bytes: oncely::MAX_OUTCOME_BYTES,
        }
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        let mut conn = self.pool.acquire().await.map_err(map)?;
        self.claim_on(&mut conn, key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(map)?;
        self.complete_on(&mut conn, lease, outcome).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let done = sqlx::query(AssertSqlSafe(self.q.release.clone()))
            .bind(lease.key.as_str())
            .bind(fence_param(lease.fence))
            .execute(&self.pool)
            .await
            .map_err(map)?;
        fenced(lease, done.rows_affected())
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        let row = sqlx::query(AssertSqlSafe(self.q.renew.clone()))
            .bind(lease.key.as_str())
            .bind(fence_param(lease.fence))
            .bind(duration_micros(extend_by))
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        let Some(row) = row else {
            return Err(Error::LeaseLost {
                key: lease.key.to_string(),
                fence: lease.fence,
            });
        };
        Ok(Lease {
            expires_at: from_micros(row.try_get(0).map_err(map)?),
            ..lease.clone()
        })
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let row = sqlx::query(AssertSqlSafe(self.q.get.clone()))
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        row.as_ref().map(decode_record).transpose()
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        let done = sqlx::query(AssertSqlSafe(self.q.prune.clone()))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(map)?;
        Ok(done.rows_affected())
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let rows = sqlx::query(AssertSqlSafe(self.q.abandoned.clone()))
            .bind(tenant.as_str())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(map)?;
        rows.iter().map(decode_record).collect()
    }

    async fn horizon(&self, _tenant: &Tenant, _kind: &str) -> Result<Option<SystemTime>> {
        Ok(None)
    }
}

impl TransactionalLedger for SqliteLedger {
    type Connection = SqliteConnection;
    type Transaction = Transaction<'static, Sqlite>;

    async fn begin(&self) -> Result<Self::Transaction> {
        SqliteLedger::begin(self).await
    }

    async fn commit(&self, tx: Self::Transaction) -> Result<()> {
        tx.commit().await.map_err(map)
    }

    async fn rollback(&self, tx: Self::Transaction) -> Result<()> {
        tx.rollback().await.map_err(map)
    }

    /// Claims on the caller's connection, inside its transaction: the claim
    /// commits or rolls back with it. Start the transaction with
    /// [`SqliteLedger::begin`] so a concurrent duplicate waits for the commit.
    async fn claim_in(
        &self,
        conn: &mut SqliteConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
    ) -> Result<Claim> {
        self.claim_on(conn, key, opts).await
    }

    /// Completes on the caller's connection, inside its transaction.
    async fn complete_in(&self, conn: &mut SqliteConnection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.complete_on(conn, lease, outcome).await
    }
}

/// The README's Rust examples, compiled as doc tests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
