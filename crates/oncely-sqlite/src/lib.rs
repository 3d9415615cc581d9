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
//! ## Opening the database
//!
//! [`SqliteLedger::connect`] creates the file if it is missing, turns on
//! WAL, migrates and verifies the tables: for the application that owns the
//! ledger. Operator tools that only read open it with
//! [`SqliteLedger::connect_read_only`] (SQLite's `mode=ro`: no file is
//! created, nothing is migrated, a mistyped path is an error naming it).
//! Deployments that migrate separately (`oncely migrate`) connect with
//! [`SqliteLedgerOptions::migrate`]`(false)`, which checks the tables and
//! changes nothing. Tests that want no file at all ask for it:
//!
//! ```no_run
//! use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions};
//!
//! # async fn demo() -> oncely::Result<()> {
//! let reader = SqliteLedger::connect_read_only("sqlite:data/app.db").await?;
//! let app = SqliteLedger::connect_with(
//!     "sqlite:data/app.db",
//!     SqliteLedgerOptions::default().migrate(false),
//! )
//! .await?;
//! // One in-memory database for the whole pool, gone with the ledger;
//! // `sqlite::memory:` alone is refused.
//! let scratch = SqliteLedger::connect_with(
//!     "sqlite::memory:",
//!     SqliteLedgerOptions::default().ephemeral(true),
//! )
//! .await?;
//! # let _ = (reader, app, scratch); Ok(()) }
//! ```
//!
//! ## Guarantees and limits
//!
//! | property | SQLite backend |
//! | --- | --- |
//! | atomic claim | one `INSERT … ON CONFLICT(key) DO UPDATE … WHERE <takeover> RETURNING` statement under SQLite's single-writer lock (insert if absent, or take over a released record or an expired lease). A new key costs that one statement; a duplicate costs a second one that reads the record, and claims again if the record changed in between (released, expired or pruned) |
//! | caller's transaction | yes: `claim_in` / `complete_in` on `&mut SqliteConnection`, transaction from [`SqliteLedger::begin`] (`BEGIN IMMEDIATE`) |
//! | clock | SQLite's clock (`unixepoch('subsec')`, millisecond resolution) on the machine that opens the file, read once per statement *after* the statement holds the write lock: a claim that waited for another transaction is judged, and its lease measured, from the moment it writes. `acquired_at` is that moment |
//! | fences | the clock in microseconds on a first claim, `max(previous + 1, clock)` on a takeover ([`oncely::backend::next_fence`]): a key's fences only grow, across prune too, as long as the host's clock does not step back by more than the shortest retention in use. Not 1, 2, 3… |
//! | horizon | prune raises a watermark per tenant and kind (table `<table>_horizon`) to the newest `created_at` it deletes, in the same transaction as the delete. A claim with [`ClaimOptions::sent_at`](oncely::ClaimOptions::sent_at) at or before it, for an absent key, fails with [`Error::BeyondHorizon`]; a claim without `sent_at` cannot be told from new work |
//! | durability | WAL with `synchronous=FULL` by default: a completed record survives a process crash and a power loss once `complete` returns. `synchronous=NORMAL` ([`SqliteLedgerOptions::synchronous`]) is faster and survives process crashes, but a power loss may roll back the last commits, so an effect could run again. [`Capabilities::durability`](oncely::Capabilities::durability) reports the journal mode and `synchronous` setting the database actually runs with |
//! | storage that does not survive | refused with [`Error::Config`]: `sqlite::memory:`, `mode=memory`, `vfs=memdb`, and an empty path (`sqlite:`, `sqlite://`: a private temporary database per connection). [`SqliteLedgerOptions::ephemeral`] accepts them, as one in-memory database shared by the whole pool, reported as not durable |
//! | schema | verified on connect and after [`SqliteLedger::migrate`]: the columns with their type affinities, a PRIMARY KEY or UNIQUE index on exactly `key`, BINARY collation on it; a table that fails is refused with [`Error::Config`] naming it and the problem |
//! | read-only | [`SqliteLedgerOptions::read_only`] opens the file with `mode=ro`: never creates it (a missing file is [`Error::Config`] naming the path), never migrates, verifies the schema, refuses writes |
//! | replication | none: one file on one machine (use the PostgreSQL backend across machines) |
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
//! [`Error::Backend`]. A unique violation raised by a handler's own write
//! (a business table's UNIQUE constraint in a [`Job::step_in`](oncely::Job::step_in)
//! closure) is never taken for a duplicate: the runner reports the
//! non-retryable [`Error::ConstraintViolation`] and counts it in
//! `oncely_unexpected_constraint_violations_total`. Let the closure return
//! the sqlx error (`?`), or [`map_error`]'s mapping of it; both are
//! recognised.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod error;
mod options;
mod queries;
mod schema;

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use oncely::backend::{
    answer_existing, check_outcome, duration_micros, effective_state, from_micros, is_beyond_horizon,
    to_micros,
};
use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Fingerprint, Lease, Ledger, Outcome, Record,
    RecordState, Result, Tenant, TransactionalLedger,
};
use sqlx::sqlite::{SqliteJournalMode, SqlitePoolOptions, SqliteRow};
use sqlx::{AssertSqlSafe, Connection, Row};

use crate::error::{BACKEND, corrupt, map, map_connect, map_uncounted};
use crate::options::{DURABLE_EPHEMERAL, DURABLE_UNCHECKED, Probe, Storage};
use crate::queries::Queries;

pub use crate::options::SqliteLedgerOptions;
pub use sqlx;
pub use sqlx::Transaction;
pub use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePool, SqliteSynchronous};

/// Maps a sqlx error (from your own statements in a transaction from
/// [`SqliteLedger::begin`], or its commit) the way the ledger maps its own:
/// busy and locked are retryable, an unopenable file is `Unavailable`, a
/// unique violation is [`Error::Corrupt`] (returned from a
/// [`Job::step_in`](oncely::Job::step_in) closure, the runner still
/// recognises it as one; see [`Ledger::unique_violation`]).
pub fn map_error(e: sqlx::Error) -> Error {
    map_uncounted(e)
}

/// An effect ledger in a SQLite database file. Cheap to clone: a pool handle
/// and the table's prepared SQL text.
#[derive(Clone)]
pub struct SqliteLedger {
    pool: SqlitePool,
    q: Arc<Queries>,
    /// What the database was found to be (see [`Probe`]); unset for a
    /// caller's pool until `migrate` or `verify` reads it.
    durability: Arc<OnceLock<&'static str>>,
    read_only: bool,
    /// An ephemeral database lives as long as one connection to it: this one,
    /// outside the pool (which may close idle connections), dropped with the
    /// last clone of the ledger. Never used otherwise.
    _keep_alive: Option<Arc<Mutex<SqliteConnection>>>,
}

impl fmt::Debug for SqliteLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteLedger")
            .field("table", &self.q.table)
            .field("pool_size", &self.pool.size())
            .field("read_only", &self.read_only)
            .finish_non_exhaustive()
    }
}

impl SqliteLedger {
    /// Opens (creating if missing) the database at `url` with the default
    /// [`SqliteLedgerOptions`], runs the migrations and verifies the tables.
    ///
    /// Accepts `sqlite:path`, `sqlite://path` and a bare file path. A file
    /// that cannot be opened (missing directory, permissions) fails with
    /// [`Error::Unavailable`]; storage that would not survive (in memory, an
    /// empty path) with [`Error::Config`].
    pub async fn connect(url: &str) -> Result<SqliteLedger> {
        Self::connect_with(url, SqliteLedgerOptions::default()).await
    }

    /// Opens the file read-only, for commands that only read (`get`,
    /// `abandoned`, `horizon`): creates nothing, migrates nothing, verifies
    /// the schema. Same as [`SqliteLedger::connect_with`] with
    /// [`SqliteLedgerOptions::read_only`]. A path with no database is
    /// [`Error::Config`] naming it.
    pub async fn connect_read_only(url: &str) -> Result<SqliteLedger> {
        Self::connect_with(url, SqliteLedgerOptions::default().read_only(true)).await
    }

    /// [`SqliteLedger::connect`] with options.
    pub async fn connect_with(url: &str, options: SqliteLedgerOptions) -> Result<SqliteLedger> {
        let q = Arc::new(Queries::new(&options.table)?);
        if options.max_connections == 0 {
            return Err(Error::Config("max_connections must be at least 1".to_owned()));
        }
        let target = options::parse(url)?;
        let read_only = options.read_only || target.read_only;
        let migrate = options.migrate && !read_only;
        let connect = match (&target.storage, options.ephemeral) {
            (Storage::File(path), false) => {
                // Only a migrating ledger creates the file: a mistyped path
                // in a read command must not become an empty new database.
                // (A `file:` URI filename is SQLite's to resolve; opening it
                // without create fails the same way, as Unavailable.)
                let uri = path.to_string_lossy().starts_with("file:");
                if !migrate && !uri && !path.exists() {
                    let why = if read_only { "read-only" } else { "migrate(false)" };
                    return Err(Error::Config(format!(
                        "no SQLite database at {} ({why} creates none): check the path, or run \
                         `oncely migrate` to create it",
                        path.display()
                    )));
                }
                let mut connect = target.connect.create_if_missing(migrate).read_only(read_only);
                if !read_only {
                    connect = connect.journal_mode(SqliteJournalMode::Wal);
                }
                connect
            }
            (Storage::File(path), true) => {
                return Err(Error::Config(format!(
                    "{url}: ephemeral(true) asks for an in-memory database, but this names the file {}; \
                     drop ephemeral(true) to keep records in it, or use sqlite::memory:",
                    path.display()
                )));
            }
            (storage, false) => return Err(options::not_durable(url, storage)),
            (_, true) if read_only => {
                return Err(Error::Config(format!(
                    "{url}: an ephemeral database starts empty; opening it read-only leaves nothing to read"
                )));
            }
            (_, true) => options::ephemeral_options(),
        }
        .synchronous(options.synchronous)
        .busy_timeout(options.busy_timeout)
        .foreign_keys(true);
        let keep_alive = if options.ephemeral {
            let conn = SqliteConnection::connect_with(&connect)
                .await
                .map_err(map_connect)?;
            Some(Arc::new(Mutex::new(conn)))
        } else {
            None
        };
        let mut pool = SqlitePoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout);
        if options.ephemeral {
            // Nothing to gain from recycling connections to memory.
            pool = pool.idle_timeout(None).max_lifetime(None);
        }
        // No release hook is needed to keep a connection inside an open
        // transaction out of the pool: a dropped `Transaction` (or a dropped
        // `begin`) queues its ROLLBACK on the connection's worker thread, and
        // the pool pings that worker before it hands the connection out
        // again, so the rollback has run by then. The
        // `aborted_transactions_commit_all_or_nothing` test checks it.
        let pool = pool.connect_with(connect).await.map_err(map_connect)?;
        let ledger = SqliteLedger {
            pool,
            q,
            durability: Arc::new(OnceLock::new()),
            read_only,
            _keep_alive: keep_alive,
        };
        let mut conn = ledger.pool.acquire().await.map_err(map_connect)?;
        // What the URL promised is checked against what SQLite opened: a
        // URI filename or a VFS the parser did not recognise must not pass
        // for a durable file.
        let probe = Probe::read(&mut conn).await?;
        if options.ephemeral {
            let _ = ledger.durability.set(DURABLE_EPHEMERAL);
        } else if !probe.is_file() {
            return Err(Error::Config(format!(
                "{url}: SQLite opened {} with journal_mode={}: not a durable file. Use a file path, or \
                 SqliteLedgerOptions::ephemeral(true) for a non-durable in-memory ledger",
                if probe.file.is_empty() {
                    "no file"
                } else {
                    &probe.file
                },
                probe.journal_mode
            )));
        } else {
            let _ = ledger.durability.set(probe.durability(read_only));
        }
        if migrate {
            schema::migrate(&mut conn, &ledger.q).await?;
        } else {
            schema::verify(&mut conn, &ledger.q).await?;
        }
        Ok(ledger)
    }

    /// A ledger over an existing pool, with the default table. Call
    /// [`SqliteLedger::migrate`] once before use if the table may not exist,
    /// or [`SqliteLedger::verify`] if it must.
    ///
    /// The pool's connect options are yours: WAL and a busy timeout are
    /// strongly recommended (see [`SqliteLedger::connect`]). Nothing is
    /// refused here (an in-memory pool is your explicit choice), but
    /// [`Capabilities::durability`] says what `migrate` or `verify` found
    /// (until then: unchecked).
    pub fn from_pool(pool: SqlitePool) -> SqliteLedger {
        SqliteLedger {
            pool,
            q: Arc::new(Queries::new(queries::DEFAULT_TABLE).expect("the default table name is valid")),
            durability: Arc::new(OnceLock::new()),
            read_only: false,
            _keep_alive: None,
        }
    }

    /// The same pool with another ledger table. Fails with
    /// [`Error::Config`] on a name that is not a plain identifier. The new
    /// table is not checked here: call [`SqliteLedger::migrate`] (or
    /// [`SqliteLedger::verify`]) before use.
    pub fn with_table(self, table: &str) -> Result<SqliteLedger> {
        Ok(SqliteLedger {
            q: Arc::new(Queries::new(table)?),
            ..self
        })
    }

    /// Creates or upgrades the ledger table and its horizon table, then
    /// verifies them. Running it again is a no-op: the schema version is kept
    /// per table in `oncely_schema`, and the steps are applied in one
    /// `BEGIN IMMEDIATE` transaction, so concurrent migrators take turns. A
    /// table that already exists is checked first and refused with
    /// [`Error::Config`] if the claim could not rely on it (see
    /// [`SqliteLedger::verify`]); then nothing is changed.
    pub async fn migrate(&self) -> Result<()> {
        self.writable("migrate")?;
        let mut conn = self.pool.acquire().await.map_err(map_connect)?;
        self.probe(&mut conn).await?;
        schema::migrate(&mut conn, &self.q).await
    }

    /// Checks, changing nothing, that the ledger's tables exist at this
    /// crate's schema version with the columns (and type affinities), a
    /// PRIMARY KEY or UNIQUE index on exactly the effect key, and BINARY
    /// (case-sensitive) comparison of keys. Runs on every connect; for a
    /// ledger from [`SqliteLedger::from_pool`] call it (or `migrate`)
    /// yourself. Fails with [`Error::Config`] naming the table and what is
    /// wrong.
    pub async fn verify(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(map_connect)?;
        self.probe(&mut conn).await?;
        schema::verify(&mut conn, &self.q).await
    }

    async fn probe(&self, conn: &mut SqliteConnection) -> Result<()> {
        if self.durability.get().is_none() {
            let probe = Probe::read(conn).await?;
            let _ = self.durability.set(probe.durability(self.read_only));
        }
        Ok(())
    }

    /// The pool underneath, for your own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The ledger table's name.
    pub fn table(&self) -> &str {
        &self.q.table
    }

    /// Whether the ledger was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Starts a write transaction with `BEGIN IMMEDIATE` on a pooled
    /// connection, for [`TransactionalLedger::claim_in`] and your own writes.
    ///
    /// It takes SQLite's write lock at once (waiting up to the busy timeout),
    /// so a duplicate claim on another connection waits for this one to
    /// commit or roll back instead of failing. Dropping the transaction rolls
    /// it back. (Also [`TransactionalLedger::begin`].)
    pub async fn begin(&self) -> Result<Transaction<'static, Sqlite>> {
        self.writable("begin")?;
        self.pool.begin_with("BEGIN IMMEDIATE").await.map_err(map)
    }

    /// Refuses a write on a read-only ledger before it reaches SQLite (whose
    /// `SQLITE_READONLY` would read as a retryable outage).
    fn writable(&self, what: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::Config(format!(
                "{what}: the ledger on table {} was opened read-only",
                self.q.table
            )));
        }
        Ok(())
    }

    async fn claim_on(
        &self,
        conn: &mut SqliteConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
    ) -> Result<Claim> {
        opts.validate()?;
        self.writable("claim")?;
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
                .bind(duration_micros(opts.retention));
            if let Some(sent_at) = sent_at {
                claim = claim.bind(sent_at);
            }
            if let Some(row) = claim.fetch_optional(&mut *conn).await.map_err(map)? {
                return lease_from_row(key, opts, &row).map(Claim::Acquired);
            }
            let row = sqlx::query(AssertSqlSafe(self.q.claim_read.clone()))
                .bind(key.as_str())
                .bind(key.tenant().as_str())
                .bind(key.kind())
                .fetch_one(&mut *conn)
                .await
                .map_err(map)?;
            let present: Option<String> = row.try_get("key").map_err(map)?;
            if present.is_none() {
                // The statement compared microseconds; so does this, or a
                // sent_at with sub-microsecond digits would loop.
                let watermark: Option<i64> = row.try_get("watermark").map_err(map)?;
                if is_beyond_horizon(sent_at.map(from_micros), watermark.map(from_micros)) {
                    return Err(Error::BeyondHorizon { key: key.to_string() });
                }
                continue;
            }
            if let Some(answer) = answer_existing(key, opts, decode_record(&row)?)? {
                return Ok(answer);
            }
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!("{key}: the record kept changing during the claim"),
            retryable: true,
        })
    }

    async fn complete_on(&self, conn: &mut SqliteConnection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, oncely::MAX_OUTCOME_BYTES)?;
        self.writable("complete")?;
        let done = sqlx::query(AssertSqlSafe(self.q.complete.clone()))
            .bind(lease.key().as_str())
            .bind(fence_param(lease.fence()))
            .bind(outcome.as_bytes())
            .execute(&mut *conn)
            .await
            .map_err(map)?;
        fenced(lease, done.rows_affected())
    }
}

fn fence_param(fence: u64) -> i64 {
    // Fences are clock microseconds (about 2^51 today); one past i64::MAX
    // matches no stored row, so it is reported as lost like any other stale
    // fence.
    i64::try_from(fence).unwrap_or(-1)
}

fn fenced(lease: &Lease, rows: u64) -> Result<()> {
    if rows == 1 {
        Ok(())
    } else {
        Err(Error::LeaseLost {
            key: lease.key().to_string(),
            fence: lease.fence(),
        })
    }
}

fn fence_from(v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| corrupt(format!("negative fence {v}")))
}

fn lease_from_row(key: &EffectKey, opts: &ClaimOptions, row: &SqliteRow) -> Result<Lease> {
    let fence = fence_from(row.try_get("fence").map_err(map)?)?;
    let created: i64 = row.try_get("created_at").map_err(map)?;
    let updated: i64 = row.try_get("updated_at").map_err(map)?;
    let expires: i64 = row.try_get("lease_expires_at").map_err(map)?;
    Ok(oncely::backend::Grant {
        key: key.clone(),
        fence,
        expires_at: from_micros(expires),
        first_claimed_at: from_micros(created),
        // The statement's clock, read after it took the write lock: the
        // moment the grant was written.
        acquired_at: from_micros(updated),
        taken_over: row.try_get("taken_over").map_err(map)?,
        at_most_once: opts.at_most_once,
    }
    .into_lease())
}

/// Decodes the columns of `queries::RECORD_COLUMNS` plus `now`, by name. An
/// expired at-most-once lease is reported as [`RecordState::Abandoned`].
fn decode_record(row: &SqliteRow) -> Result<Record> {
    let stored: String = row.try_get("key").map_err(map)?;
    let tenant: String = row.try_get("tenant").map_err(map)?;
    let kind: String = row.try_get("kind").map_err(map)?;
    let subject: String = row.try_get("subject").map_err(map)?;
    let key = Tenant::parse(&tenant)
        .and_then(|t| EffectKey::new(&t, &kind, &subject))
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    if key.as_str() != stored {
        return Err(corrupt(format!("row {stored:?} has parts of {key}")));
    }
    let state: String = row.try_get("state").map_err(map)?;
    let state = RecordState::parse(&state).map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let fingerprint = row
        .try_get::<Option<Vec<u8>>, _>("fingerprint")
        .map_err(map)?
        .map(|b| Fingerprint::from_bytes(&b))
        .transpose()
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let outcome = row
        .try_get::<Option<Vec<u8>>, _>("outcome")
        .map_err(map)?
        .map(Outcome::from_bytes)
        .transpose()
        .map_err(|e| corrupt(format!("row {stored:?}: {e}")))?;
    let at_most_once: bool = row.try_get("at_most_once").map_err(map)?;
    let ts = |column: &str| -> Result<SystemTime> { Ok(from_micros(row.try_get(column).map_err(map)?)) };
    let lease_expires_at = row
        .try_get::<Option<i64>, _>("lease_expires_at")
        .map_err(map)?
        .map(from_micros);
    let read_at = ts("now")?;
    Ok(Record {
        key,
        state: effective_state(state, at_most_once, lease_expires_at, read_at),
        fence: fence_from(row.try_get("fence").map_err(map)?)?,
        fingerprint,
        outcome,
        at_most_once,
        created_at: ts("created_at")?,
        updated_at: ts("updated_at")?,
        lease_expires_at,
        retain_until: ts("retain_until")?,
        read_at,
    })
}

// Every pool operation below is one autocommit statement (claim: one
// statement, plus a read when it did not acquire; prune: one transaction),
// so a dropped future either committed it whole or not at all, and the
// connection goes back to the pool with no transaction open.
impl Ledger for SqliteLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(
            self.durability.get().copied().unwrap_or(DURABLE_UNCHECKED),
            "SQLite unixepoch('subsec') on the host that opens the file, read after the write lock is taken",
        )
        .caller_transaction(true)
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.writable("claim")?;
        let mut conn = self.pool.acquire().await.map_err(map)?;
        self.claim_on(&mut conn, key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, oncely::MAX_OUTCOME_BYTES)?;
        self.writable("complete")?;
        let mut conn = self.pool.acquire().await.map_err(map)?;
        self.complete_on(&mut conn, lease, outcome).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.writable("release")?;
        let done = sqlx::query(AssertSqlSafe(self.q.release.clone()))
            .bind(lease.key().as_str())
            .bind(fence_param(lease.fence()))
            .execute(&self.pool)
            .await
            .map_err(map)?;
        fenced(lease, done.rows_affected())
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        self.writable("renew")?;
        let row = sqlx::query(AssertSqlSafe(self.q.renew.clone()))
            .bind(lease.key().as_str())
            .bind(fence_param(lease.fence()))
            .bind(duration_micros(extend_by))
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        let Some(row) = row else {
            return Err(Error::LeaseLost {
                key: lease.key().to_string(),
                fence: lease.fence(),
            });
        };
        Ok(lease.renewed_until(from_micros(row.try_get("lease_expires_at").map_err(map)?)))
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let row = sqlx::query(AssertSqlSafe(self.q.get.clone()))
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        row.as_ref().map(decode_record).transpose()
    }

    /// Raises the horizon of every tenant and kind it deletes from and
    /// deletes, in one `BEGIN IMMEDIATE` transaction: a claim never sees the
    /// records gone and the horizon not yet raised.
    async fn prune(&self, limit: u64) -> Result<u64> {
        self.writable("prune")?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.pool.acquire().await.map_err(map)?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        // One clock reading for both statements, so they pick the same rows.
        let cutoff: i64 = sqlx::query_scalar(AssertSqlSafe(self.q.now.clone()))
            .fetch_one(&mut *tx)
            .await
            .map_err(map)?;
        sqlx::query(AssertSqlSafe(self.q.prune_horizon.clone()))
            .bind(limit)
            .bind(cutoff)
            .execute(&mut *tx)
            .await
            .map_err(map)?;
        let done = sqlx::query(AssertSqlSafe(self.q.prune.clone()))
            .bind(limit)
            .bind(cutoff)
            .execute(&mut *tx)
            .await
            .map_err(map)?;
        tx.commit().await.map_err(map)?;
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

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        let watermark: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.q.horizon.clone()))
            .bind(tenant.as_str())
            .bind(kind)
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        Ok(watermark.map(from_micros))
    }

    /// A SQLite unique or primary-key violation (extended codes 2067, 1555)
    /// anywhere in the error's source chain.
    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        error::unique_violation(error)
    }
}

impl TransactionalLedger for SqliteLedger {
    type Connection = SqliteConnection;
    type Transaction = Transaction<'static, Sqlite>;

    /// [`SqliteLedger::begin`]: `BEGIN IMMEDIATE`.
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
