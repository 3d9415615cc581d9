//! [`SqliteLedger`]: opening it, and each ledger operation as one
//! statement (or one `BEGIN IMMEDIATE` transaction) on the pool or on the
//! caller's connection.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use oncely::admin::{Admin, Erasure, KindStats, RecordQuery};
use oncely::backend::{Capabilities, Claim, Lease, Ledger, Outcome, Record, TransactionalLedger};
use oncely::backend::{Notifier, Watch};
use oncely::backend::{
    answer_existing, check_outcome, duration_micros, fail_each, from_micros, is_beyond_horizon, to_micros,
};
use oncely::backend::{check_subject, forget_refusal};
use oncely::open::{FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error, Result, Tenant};
use sqlx::sqlite::{Sqlite, SqliteConnection, SqlitePool, SqlitePoolOptions};
use sqlx::{Connection, Transaction};

use crate::batch;
use crate::durability::{DURABLE_UNCHECKED, Probe};
use crate::error::{BACKEND, map, map_connect};
use crate::notify;
use crate::options::{self, Opening, SqliteLedgerOptions};
use crate::schema;
use crate::sql::{self, Found, Queries};

/// An effect ledger in a SQLite database file. Cheap to clone: a pool handle,
/// the table's prepared SQL text and the wake-ups of waiting duplicates.
#[derive(Clone)]
pub struct SqliteLedger {
    pool: SqlitePool,
    q: Arc<Queries>,
    /// Wakes this process's waiters on a key when this process completes or
    /// releases it; shared by every ledger of the process on the same file
    /// and table (see `notify.rs`).
    notifier: Arc<Notifier>,
    /// The database file SQLite reports, once known: what `with_table`
    /// looks the other table's notifier up by.
    file: Option<Arc<str>>,
    /// [`SqliteLedgerOptions::multi_process`]: waiters poll.
    poll_waiters: bool,
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
    /// empty path, a file on a memory file system such as `/dev/shm`) with
    /// [`Error::Config`].
    pub async fn connect(url: &str) -> Result<SqliteLedger> {
        Self::connect_with(url, SqliteLedgerOptions::default()).await
    }

    /// [`SqliteLedger::connect`] with options. For commands that only read
    /// (`get`, `abandoned`, `horizon`), [`SqliteLedgerOptions::read_only`]:
    /// creates nothing, migrates nothing, verifies the schema; a path with no
    /// database is [`Error::Config`] naming it.
    ///
    /// A `sqlite:` URL's `?table=` sets the table, over `options`' (so one
    /// URL names the whole ledger, for the application and the `oncely`
    /// command alike); any query parameter neither it nor sqlx's is
    /// [`Error::Config`].
    pub async fn connect_with(url: &str, options: SqliteLedgerOptions) -> Result<SqliteLedger> {
        let Opening {
            connect,
            read_only,
            migrate,
            memory,
            table,
        } = options::open(url, &options)?;
        let q = Arc::new(Queries::new(&table)?);
        let keep_alive = if memory {
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
        if memory {
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
        let mut conn = pool.acquire().await.map_err(map_connect)?;
        // What the URL promised is checked against what SQLite opened.
        let probe = Probe::read(&mut conn).await?;
        let durability = probe.opened(url, options.ephemeral, read_only)?;
        let ledger = SqliteLedger {
            notifier: notify::shared(Some(&probe.file), &q.table),
            file: Some(probe.file.into()),
            pool,
            q,
            durability: Arc::new(OnceLock::new()),
            read_only,
            poll_waiters: options.multi_process,
            _keep_alive: keep_alive,
        };
        let _ = ledger.durability.set(durability);
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
            q: Arc::new(Queries::new(sql::DEFAULT_TABLE).expect("the default table name is valid")),
            // The file is unknown until a statement asks: wake-ups are
            // shared by this ledger's clones only.
            notifier: Arc::new(Notifier::new()),
            file: None,
            poll_waiters: false,
            durability: Arc::new(OnceLock::new()),
            read_only: false,
            _keep_alive: None,
        }
    }

    /// [`SqliteLedger::from_pool`] with the options that apply to a pool
    /// already made: the table, [`SqliteLedgerOptions::read_only`] and
    /// [`SqliteLedgerOptions::multi_process`] (the pool's size, timeouts,
    /// `synchronous` and file are the pool's; migrating is
    /// [`SqliteLedger::migrate`]'s). Fails with [`Error::Config`] on a table
    /// name that is not a plain identifier.
    pub fn from_pool_with(pool: SqlitePool, options: SqliteLedgerOptions) -> Result<SqliteLedger> {
        SqliteLedger {
            read_only: options.read_only,
            poll_waiters: options.multi_process,
            ..SqliteLedger::from_pool(pool)
        }
        .with_table(&options.table)
    }

    /// The same pool with another ledger table. Fails with
    /// [`Error::Config`] on a name that is not a plain identifier. The new
    /// table is not checked here: call [`SqliteLedger::migrate`] (or
    /// [`SqliteLedger::verify`]) before use.
    pub fn with_table(self, table: &str) -> Result<SqliteLedger> {
        let q = Arc::new(Queries::new(table)?);
        Ok(SqliteLedger {
            // Another table holds other records: its waiters are another set.
            notifier: notify::shared(self.file.as_deref(), &q.table),
            q,
            ..self
        })
    }

    /// Creates or upgrades the ledger table, its horizon table and its
    /// outbox table (`<table>_outbox`, schema version 3), then verifies
    /// them. Running it again is a no-op: the schema version is kept
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

    /// Checks, changing nothing, that the ledger's tables (its outbox's
    /// included) exist at this crate's schema version with the columns (and
    /// type affinities), a PRIMARY KEY or UNIQUE index on exactly the effect
    /// key, and BINARY (case-sensitive) comparison of keys. Runs on every connect; for a
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

    /// The ledger's statements (the outbox's among them: `outbox.rs`).
    pub(crate) fn queries(&self) -> &Queries {
        &self.q
    }

    /// Refuses a write on a read-only ledger before it reaches SQLite (whose
    /// `SQLITE_READONLY` would read as a retryable outage).
    pub(crate) fn writable(&self, what: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::Config(format!(
                "{what}: the ledger on table {} was opened read-only",
                self.q.table
            )));
        }
        Ok(())
    }

    /// The claim, on a pooled connection (autocommit) or on the caller's,
    /// inside its transaction.
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
            let claim = self.q.bind_claim(key, opts, sent_at);
            if let Some(row) = claim.fetch_optional(&mut *conn).await.map_err(map)? {
                return sql::lease(key, opts, &row).map(Claim::Acquired);
            }
            let row = self
                .q
                .bind_claim_read(key)
                .fetch_one(&mut *conn)
                .await
                .map_err(map)?;
            match sql::found(&row)? {
                Found::Absent { watermark } => {
                    // The statement compared microseconds; so does this, or a
                    // sent_at with sub-microsecond digits would loop.
                    if is_beyond_horizon(sent_at.map(from_micros), watermark.map(from_micros)) {
                        return Err(Error::BeyondHorizon { key: key.to_string() });
                    }
                }
                Found::Record(record) => {
                    if let Some(answer) = answer_existing(key, opts, record)? {
                        return Ok(answer);
                    }
                }
            }
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!("{key}: the record kept changing during the claim"),
            retryable: true,
        })
    }

    /// The completion, on a pooled connection or on the caller's.
    async fn complete_on(&self, conn: &mut SqliteConnection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, oncely::backend::MAX_OUTCOME_BYTES)?;
        self.writable("complete")?;
        let done = self
            .q
            .bind_complete(lease.key(), sql::fence_param(lease.fence()), outcome)
            .execute(&mut *conn)
            .await
            .map_err(map)?;
        fenced(lease, done.rows_affected())?;
        // On a caller's connection the completion is not committed yet: a
        // waiter woken now claims again and waits for the write lock the
        // caller's `BEGIN IMMEDIATE` transaction holds, so it sees the
        // completion the moment the caller commits (or the lease again, if
        // the caller rolls back, and waits on).
        self.notifier.notify(lease.key().as_str());
        Ok(())
    }

    /// Claims a batch in one `BEGIN IMMEDIATE` transaction (see `batch.rs`).
    /// `Err` when the transaction failed: nothing of the batch was written.
    async fn claim_batch(
        &self,
        keys: &[EffectKey],
        opts: &ClaimOptions,
        sent_at: Option<i64>,
    ) -> Result<Vec<Result<Claim>>> {
        let mut conn = self.pool.acquire().await.map_err(map)?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        let answers = batch::claim_many(&mut tx, &self.q, keys, opts, sent_at).await?;
        tx.commit().await.map_err(map)?;
        Ok(answers)
    }

    /// Completes a batch in one `BEGIN IMMEDIATE` transaction (see
    /// `batch.rs`); `answers` holds what is known before any round trip.
    async fn complete_batch(
        &self,
        items: &[(Lease, Outcome)],
        answers: Vec<Option<Result<()>>>,
    ) -> Result<Vec<Result<()>>> {
        let mut conn = self.pool.acquire().await.map_err(map)?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        let answers = batch::complete_many(&mut tx, &self.q, items, answers).await?;
        tx.commit().await.map_err(map)?;
        Ok(answers)
    }
}

/// The answer of a write fenced by `WHERE key AND fence AND in_progress`: no
/// row changed means the lease is no longer this one's (taken over after it
/// expired, or already completed or released).
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

/// Most records one prune transaction deletes: a batch holds SQLite's single
/// write lock while it runs, so claims wait for one batch at most.
const PRUNE_BATCH: u64 = 500;

impl SqliteLedger {
    /// One prune batch: deletes up to `batch` prunable records and raises
    /// the horizon over them, in one transaction; returns how many it
    /// deleted.
    async fn prune_batch(&self, conn: &mut SqliteConnection, batch: u64) -> Result<u64> {
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        // The clock, read once the write lock is held.
        let cutoff: i64 = self.q.bind_now().fetch_one(&mut *tx).await.map_err(map)?;
        let gone: Vec<(String, String, i64)> = self
            .q
            .bind_prune(i64::try_from(batch).unwrap_or(i64::MAX), cutoff)
            .fetch_all(&mut *tx)
            .await
            .map_err(map)?;
        let mut newest: std::collections::BTreeMap<(&str, &str), i64> = std::collections::BTreeMap::new();
        for (tenant, kind, created_at) in &gone {
            let w = newest.entry((tenant, kind)).or_insert(*created_at);
            *w = (*w).max(*created_at);
        }
        for ((tenant, kind), watermark) in newest {
            self.q
                .bind_prune_horizon(tenant, kind, watermark)
                .execute(&mut *tx)
                .await
                .map_err(map)?;
        }
        tx.commit().await.map_err(map)?;
        Ok(gone.len() as u64)
    }
}

// Every pool operation below is one autocommit statement (claim: one
// statement, plus a read when it did not acquire) or one transaction (each prune batch,
// claim_many, complete_many), so a dropped future either committed it whole
// or not at all, and the connection goes back to the pool with no
// transaction open (a dropped transaction's rollback runs first). Waiters
// are notified only after the write is committed (complete_in excepted, see
// complete_on); a future dropped between the commit and the notification
// costs a waiter the fallback's latency, never its answer.
impl Ledger for SqliteLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(
            self.durability.get().copied().unwrap_or(DURABLE_UNCHECKED),
            "SQLite unixepoch('subsec') on the host that opens the file, read after the write lock is taken",
        )
        .coalescing(true)
        .caller_transaction(true)
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.writable("claim")?;
        let mut conn = self.pool.acquire().await.map_err(map)?;
        self.claim_on(&mut conn, key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, oncely::backend::MAX_OUTCOME_BYTES)?;
        self.writable("complete")?;
        let mut conn = self.pool.acquire().await.map_err(map)?;
        self.complete_on(&mut conn, lease, outcome).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.writable("release")?;
        let done = self
            .q
            .bind_release(lease.key(), sql::fence_param(lease.fence()))
            .execute(&self.pool)
            .await
            .map_err(map)?;
        fenced(lease, done.rows_affected())?;
        self.notifier.notify(lease.key().as_str());
        Ok(())
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        oncely::backend::check_extension(extend_by)?;
        self.writable("renew")?;
        let row = self
            .q
            .bind_renew(
                lease.key(),
                sql::fence_param(lease.fence()),
                duration_micros(extend_by),
            )
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        let Some(row) = row else {
            return Err(Error::LeaseLost {
                key: lease.key().to_string(),
                fence: lease.fence(),
            });
        };
        Ok(lease.renewed_until(sql::renewed_until(&row)?))
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let row = self
            .q
            .bind_get(key)
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        row.as_ref().map(sql::record).transpose()
    }

    /// Deletes in batches of at most 500 records (`PRUNE_BATCH`), one
    /// `BEGIN IMMEDIATE` transaction each, and raises the horizon of every
    /// tenant and kind a batch deletes from in that batch's transaction: a
    /// claim never sees the records gone and the horizon not yet raised.
    /// Between batches the write lock is free, so claims wait on one batch
    /// at most, never on the whole prune.
    async fn prune(&self, limit: u64) -> Result<u64> {
        self.writable("prune")?;
        let mut conn = self.pool.acquire().await.map_err(map)?;
        let mut deleted = 0;
        while deleted < limit {
            let batch = (limit - deleted).min(PRUNE_BATCH);
            let n = self.prune_batch(&mut conn, batch).await?;
            deleted += n;
            if n < batch {
                break;
            }
        }
        Ok(deleted)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let rows = self
            .q
            .bind_abandoned(tenant, i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(map)?;
        rows.iter().map(sql::record).collect()
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        let watermark: Option<i64> = self
            .q
            .bind_horizon(tenant, kind)
            .fetch_optional(&self.pool)
            .await
            .map_err(map)?;
        Ok(watermark.map(from_micros))
    }

    /// A watch woken when this process completes or releases `key` (any of
    /// its ledgers on this file and table); a polling one with
    /// [`SqliteLedgerOptions::multi_process`]. Completions in other
    /// processes wake nobody here: the runner's fallback look answers those
    /// waiters (see the crate docs).
    async fn watch(&self, key: &EffectKey) -> Watch {
        if self.poll_waiters {
            Watch::polling()
        } else {
            self.notifier.watch(key)
        }
    }

    /// One `BEGIN IMMEDIATE` transaction, one commit: the batch claim
    /// statement, then one read of the keys it did not acquire (see
    /// `batch.rs`). A failure of the transaction is every slot's answer,
    /// and nothing of the batch is written.
    async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        opts.validate()?;
        let sent_at = opts.sent_at.map(to_micros).transpose()?;
        if let Err(e) = self.writable("claim") {
            return Ok(fail_each(e, keys.len()));
        }
        match keys {
            [] => Ok(Vec::new()),
            // One autocommit statement beats a transaction around it.
            [key] => Ok(vec![self.claim(key, opts).await]),
            _ => match self.claim_batch(keys, opts, sent_at).await {
                Ok(answers) => Ok(answers),
                Err(e) => Ok(fail_each(e, keys.len())),
            },
        }
    }

    /// One `BEGIN IMMEDIATE` transaction, one statement, one commit; each
    /// item fenced by its own lease. Waiters on the completed keys are woken
    /// after the commit.
    async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        if let [(lease, outcome)] = items {
            return vec![self.complete(lease, outcome).await];
        }
        let answers: Vec<Option<Result<()>>> = items
            .iter()
            .map(|(_, outcome)| {
                check_outcome(outcome, oncely::backend::MAX_OUTCOME_BYTES)
                    .and_then(|()| self.writable("complete"))
                    .err()
                    .map(Err)
            })
            .collect();
        if answers.iter().all(Option::is_some) {
            return answers.into_iter().flatten().collect();
        }
        match self.complete_batch(items, answers).await {
            Ok(answers) => {
                for ((lease, _), answer) in items.iter().zip(&answers) {
                    if answer.is_ok() {
                        self.notifier.notify(lease.key().as_str());
                    }
                }
                answers
            }
            Err(e) => fail_each(e, items.len()),
        }
    }

    /// A SQLite unique or primary-key violation (extended codes 2067, 1555)
    /// anywhere in the error's source chain.
    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        crate::error::unique_violation(error)
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

/// What the ledger reads, for an operator: `sqlite FILE, table TABLE` (the
/// file SQLite opened, once known), or an ephemeral in-memory database.
impl fmt::Display for SqliteLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            _ if self._keep_alive.is_some() => f.write_str("sqlite in memory (ephemeral)")?,
            Some(file) if !file.is_empty() => write!(f, "sqlite {file}")?,
            _ => write!(
                f,
                "sqlite {}",
                self.pool.connect_options().get_filename().display()
            )?,
        }
        write!(f, ", table {}", self.q.table)
    }
}

/// Opens a SQLite URL (`sqlite:path`, `sqlite://path`, or a bare path, as
/// [`SqliteLedger::connect`]) with [`SqliteLedger::connect_with`]:
/// [`Access::Migrate`](oncely::open::Access::Migrate) creates the file and the tables,
/// [`Access::Existing`](oncely::open::Access::Existing) is [`SqliteLedgerOptions::migrate`]`(false)` and
/// [`Access::ReadOnly`](oncely::open::Access::ReadOnly) is [`SqliteLedgerOptions::read_only`]`(true)`.
/// [`OpenOptions::connect_timeout`] bounds both waits that stand between a
/// command and its answer: the busy timeout (SQLite's write lock) and the
/// pool's acquire timeout.
///
/// Messages may name the file: a SQLite URL is a path and carries no
/// credentials.
impl FromUrl for SqliteLedger {
    const SCHEMES: &'static [&'static str] = &["sqlite"];

    async fn from_url(url: &str, open: OpenOptions) -> Result<Self> {
        SqliteLedger::connect_with(url, oncely::open::LedgerOptions::for_open(open)).await
    }
}

impl SqliteLedger {
    /// `Admin::erase` (`write`), or its dry run: the same statements, rolled
    /// back.
    async fn erase_as(&self, tenant: &Tenant, subject: &str, write: bool) -> Result<Erasure> {
        check_subject(subject)?;
        self.writable("erase")?;
        let mut conn = self.pool.acquire().await.map_err(map)?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        let now: i64 = self.q.bind_now().fetch_one(&mut *tx).await.map_err(map)?;
        let erased = self
            .q
            .bind_erase(tenant, subject)
            .fetch_all(&mut *tx)
            .await
            .map_err(map)?;
        let pending = self
            .q
            .bind_erase_pending(tenant, subject)
            .fetch_all(&mut *tx)
            .await
            .map_err(map)?;
        let keys = |keys: Vec<String>| -> Result<Vec<EffectKey>> {
            keys.iter()
                .map(|k| {
                    EffectKey::parse(k).map_err(|e| crate::error::corrupt(format!("stored key {k:?}: {e}")))
                })
                .collect()
        };
        let mut erasure = Erasure::new(from_micros(now));
        erasure.erased = keys(erased)?;
        erasure.pending = keys(pending)?;
        // The outbox in the same transaction: an error above or here drops
        // it, which rolls it back.
        let messages = self
            .q
            .outbox
            .bind_erase_find(tenant, subject)
            .fetch_all(&mut *tx)
            .await
            .map_err(map)?;
        for id in sql::erase_messages(&mut erasure, &messages, subject)? {
            self.q
                .outbox
                .bind_erase(id)
                .execute(&mut *tx)
                .await
                .map_err(map)?;
        }
        if write {
            tx.commit().await.map_err(map)?;
        } else {
            tx.rollback().await.map_err(map)?;
        }
        Ok(erasure.sorted())
    }
}

/// The operator's view (`oncely::admin`): listings and stats read on the
/// pool with SQLite's clock; forget is one fenced `UPDATE`.
impl Admin for SqliteLedger {
    async fn records(&self, query: &RecordQuery) -> Result<Vec<Record>> {
        let (text, args) = sql::records(&self.q.table, query)?;
        let rows = sql::bind_listing(text, args)
            .fetch_all(&self.pool)
            .await
            .map_err(map)?;
        rows.iter().map(sql::record).collect()
    }

    async fn stats(&self, tenant: Option<&Tenant>) -> Result<Vec<KindStats>> {
        let (text, args) = sql::stats(&self.q.table, tenant);
        let rows = sql::bind_listing(text, args)
            .fetch_all(&self.pool)
            .await
            .map_err(map)?;
        rows.iter().map(sql::kind_stats).collect()
    }

    async fn forget(&self, key: &EffectKey, fence: u64) -> Result<()> {
        self.writable("forget")?;
        let done = self
            .q
            .bind_forget(key, sql::fence_param(fence))
            .execute(&self.pool)
            .await
            .map_err(map)?;
        if done.rows_affected() == 1 {
            return Ok(());
        }
        // Nothing changed; the read only names the reason.
        Err(forget_refusal(key, fence, self.get(key).await?))
    }

    async fn erase(&self, tenant: &Tenant, subject: &str) -> Result<Erasure> {
        self.erase_as(tenant, subject, true).await
    }

    async fn erase_dry_run(&self, tenant: &Tenant, subject: &str) -> Result<Erasure> {
        self.erase_as(tenant, subject, false).await
    }

    async fn replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &Outcome,
        outcome: &Outcome,
    ) -> Result<bool> {
        self.writable("replace_outcome")?;
        check_outcome(outcome, self.capabilities().max_outcome_bytes)?;
        let done = self
            .q
            .bind_replace_outcome(
                key,
                sql::fence_param(fence),
                expected.as_bytes(),
                outcome.as_bytes(),
            )
            .execute(&self.pool)
            .await
            .map_err(map)?;
        Ok(done.rows_affected() == 1)
    }

    async fn prunable(&self) -> Result<u64> {
        let n: i64 = self
            .q
            .bind_prunable_count()
            .fetch_one(&self.pool)
            .await
            .map_err(map)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
