//! [`PgLedger`]: its constructors, and each ledger operation as one
//! statement (`sql`) run through the leaked-transaction guard (`guard`).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use oncely::admin::{Admin, Erasure, KindStats, RecordQuery};
use oncely::backend::{
    Attempts, Backoff, LostWrite, answer_existing, check_outcome, duration_micros, fail_each, from_micros,
    retry, to_micros,
};
use oncely::backend::{
    Capabilities, Claim, Lease, Ledger, MAX_OUTCOME_BYTES, Outcome, Record, TransactionalLedger, Watch,
};
use oncely::backend::{check_subject, forget_refusal};
use oncely::open::{FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error, Result, Tenant};
use sqlx::{PgConnection, PgPool, Postgres};

use crate::conn::Conn;
use crate::error::{self, BACKEND, map};
use crate::guard::{self, Failed, Run};
use crate::hosts::Hosts;
use crate::notify::{Changes, ListenerStatus};
use crate::options::{PgLedgerOptions, SCHEMES};
use crate::sql::{self, ClaimRow, Queries, RecordRow};
use crate::token::Attempt;

/// Most records one prune transaction deletes. Each deleted key's advisory
/// lock is held until its transaction ends, and the server's lock table is
/// shared by every session (`max_locks_per_transaction` × connections, 6400
/// by default), so a prune of a million records runs as many small batches.
const PRUNE_BATCH: u64 = 500;

/// The attempts of a claim (or a batch's keys) whose answer was lost: again
/// while the server is unavailable (a failover under way), within `window`,
/// pausing 50 ms at first and at most a second.
pub(crate) fn resolving(window: Duration) -> Attempts {
    Attempts::new(Backoff::new(Duration::from_millis(50), Duration::from_secs(1))).within(window)
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) q: Queries,
    pub(crate) schema: String,
    pub(crate) table: String,
    read_only: bool,
    pub(crate) changes: Changes,
    /// The URL's hosts, when the ledger made its pool
    /// ([`PgLedger::connect_with`]); `None` on a pool it was given.
    hosts: Option<Arc<Hosts>>,
    /// [`PgLedgerOptions::operation_timeout`].
    pub(crate) operation_timeout: Duration,
    /// Where the next prune batch starts looking: the newest `retain_until`
    /// (µs) of the previous batch's candidates, `None` to start from the
    /// oldest. Only a hint for the search (see `sql.rs`, prune); reset
    /// whenever a batch reaches the end of what is due, so rows it skipped
    /// (locked by a claim, or due with an earlier `retain_until` than the
    /// cursor because their retention was shorter) are found on the next
    /// pass.
    prune_from: std::sync::Mutex<Option<i64>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The pool's hooks hold the hosts, which hold the pool.
        if let Some(hosts) = &self.hosts {
            hosts.detach();
        }
    }
}

tokio::task_local! {
    /// The deadline of the ledger operation running on this task
    /// ([`PgLedger::bounded`]), read by [`PgLedger::acquire`].
    static DEADLINE: Instant;
}

/// An effect ledger in a PostgreSQL table. Cloning is cheap (a pool handle
/// and an `Arc`).
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    pub(crate) inner: Arc<Inner>,
}

impl PgLedger {
    /// Connects with default [`PgLedgerOptions`], runs the migrations and
    /// checks the table.
    ///
    /// Fails with [`Error::Unavailable`] when the database cannot be reached
    /// and [`Error::Config`] on a malformed URL (or one that is not
    /// `postgres://` or `postgresql://`) or a table the ledger cannot use.
    pub async fn connect(url: &str) -> Result<PgLedger> {
        PgLedger::connect_with(url, PgLedgerOptions::default()).await
    }

    /// Connects a pool built from `options`, runs the migrations (unless
    /// [`PgLedgerOptions::migrate`] is off or the ledger is
    /// [read-only](PgLedgerOptions::read_only)) and checks the schema
    /// ([`PgLedger::verify`]). The options and the URL are validated before
    /// any round trip.
    ///
    /// The URL's `?schema=` and `?table=` set the schema and table, over
    /// `options`' (so one URL names the whole ledger, for the application
    /// and the `oncely` command alike); any query parameter neither they
    /// nor sqlx read is [`Error::Config`].
    ///
    /// A URL may list several hosts (`postgres://app@db1:5432,db2:5432/app`,
    /// which sqlx alone refuses): the ledger connects to the first that
    /// answers as `?target_session_attrs=` says (`read-write`, the default
    /// of a ledger that writes: a server that accepts writes; `primary`;
    /// `any`; and, for a [read-only](PgLedgerOptions::read_only) ledger,
    /// whose default is `any`, also `read-only`, `standby`,
    /// `prefer-standby`). Every new connection is checked the same way, and
    /// when the server goes away the ledger looks for the one that now
    /// accepts writes, so its pool and its listener follow a promotion (see
    /// the crate docs, "Replication and failover"). A ledger that writes,
    /// pointed only at standbys, fails here with [`Error::Config`] saying
    /// so; when no host answers, with [`Error::Unavailable`].
    pub async fn connect_with(url: &str, options: PgLedgerOptions) -> Result<PgLedger> {
        let (options, connect) = options.with_url(url)?;
        let hosts = Hosts::new(connect.hosts, connect.target, options.acquire_timeout);
        let first = hosts.locate().await?;
        let pool = hosts
            .hook(options.pool_options())
            .connect_lazy_with(hosts.options(first).clone());
        hosts.attach(&pool, first);
        let migrate = options.migrates();
        let ledger = PgLedger::build(pool, options, Some(hosts))?;
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
        PgLedger::from_pool_with(pool, PgLedgerOptions::default()).expect("the default options are valid")
    }

    /// A ledger on an existing pool with the schema, table and read-only
    /// setting of `options` (its pool settings are not used). Runs no
    /// migrations and no check.
    pub fn from_pool_with(pool: PgPool, options: PgLedgerOptions) -> Result<PgLedger> {
        PgLedger::build(pool, options, None)
    }

    fn build(pool: PgPool, options: PgLedgerOptions, hosts: Option<Arc<Hosts>>) -> Result<PgLedger> {
        options.validate()?;
        let q = Queries::new(&options.schema, &options.table);
        let changes = Changes::new(pool.clone(), q.channel.clone(), hosts.as_ref().map(|h| h.moved()));
        Ok(PgLedger {
            pool,
            inner: Arc::new(Inner {
                q,
                schema: options.schema,
                table: options.table,
                read_only: options.read_only,
                changes,
                hosts,
                operation_timeout: options.operation_timeout,
                prune_from: std::sync::Mutex::new(None),
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

    /// The state of the ledger's change listener: the one connection per
    /// ledger that `LISTEN`s for completions and releases committed by other
    /// processes, so that their waiting duplicates are woken at once (see the
    /// crate docs, "Waiting duplicates"). It starts with the first claim
    /// that waits.
    pub fn listener_status(&self) -> ListenerStatus {
        self.inner.changes.status()
    }

    /// Begins a transaction on the pool, cancel-safely.
    ///
    /// `pool.begin()` runs in a spawned task, so dropping this future (a
    /// timeout, `select!`, an aborted task) cannot leave a pooled connection
    /// inside a transaction nothing will end (sqlx 0.9.0, transact-rs/sqlx#4393).
    /// Dropping the returned transaction rolls it back, as usual. Must be
    /// called inside a Tokio runtime.
    ///
    /// Bounded by [`PgLedgerOptions::operation_timeout`]: past it, this
    /// fails with [`Error::Unavailable`] (the task runs on, and a
    /// transaction it still begins is rolled back there).
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, Postgres>> {
        let pool = self.pool.clone();
        let begun = tokio::spawn(async move { pool.begin().await });
        self.bounded(async move {
            match begun.await {
                Ok(tx) => tx.map_err(map),
                Err(e) => Err(Error::Backend {
                    backend: BACKEND,
                    message: format!("the task beginning a transaction failed: {e}"),
                    retryable: true,
                }),
            }
        })
        .await
    }

    /// Runs one ledger operation within
    /// [`PgLedgerOptions::operation_timeout`]: past it, [`Error::Unavailable`]
    /// (and the connection it held is closed, see [`Conn`]). An
    /// unavailable server, either way, makes the ledger look for the
    /// server to use (`hosts`).
    pub(crate) async fn bounded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        self.bounded_for(self.inner.operation_timeout, op).await
    }

    /// [`PgLedger::bounded`] within `timeout` instead (what is left of a
    /// resolution's window).
    pub(crate) async fn bounded_for<T>(
        &self,
        timeout: Duration,
        op: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let answer = match tokio::time::timeout(timeout, DEADLINE.scope(Instant::now() + timeout, op)).await {
            Ok(answer) => answer,
            Err(_) => Err(Error::Unavailable {
                backend: BACKEND,
                message: format!("no answer within {timeout:?} (PgLedgerOptions::operation_timeout)"),
            }),
        };
        if matches!(answer, Err(Error::Unavailable { .. }))
            && let Some(hosts) = &self.inner.hosts
        {
            hosts.suspect();
        }
        answer
    }

    /// Refuses a write on a read-only ledger, before any round trip.
    pub(crate) fn writable(&self) -> Result<()> {
        if self.inner.read_only {
            return Err(Error::Config(format!(
                "the ledger on {}.{} was opened read-only (PgLedgerOptions::read_only): it does not write",
                self.inner.schema, self.inner.table
            )));
        }
        Ok(())
    }

    pub(crate) async fn acquire(&self) -> Result<Conn> {
        let deadline = DEADLINE.try_with(|d| *d).ok();
        match self.pool.acquire().await {
            Ok(conn) => Ok(Conn::new(conn, deadline)),
            Err(e) => {
                let refused = matches!(e, sqlx::Error::PoolTimedOut)
                    .then(|| self.inner.hosts.as_ref().and_then(|h| h.refusal()))
                    .flatten();
                Err(match (map(e), refused) {
                    (Error::Unavailable { backend, message }, Some(why)) => Error::Unavailable {
                        backend,
                        message: format!("{message} ({why})"),
                    },
                    (e, _) => e,
                })
            }
        }
    }

    /// A fenced write (a completion or a release) whose answer was lost
    /// (`lost`: the connection died, or no answer in time), resolved from
    /// the record by the shared rule ([`oncely::backend::resolve_lost_write`]),
    /// read on a new connection and tried again while the server is
    /// unavailable (a failover under way: the ledger is looking for the
    /// promoted standby) for one more [`PgLedgerOptions::operation_timeout`].
    async fn resolve(&self, lease: &Lease, write: Write<'_>, lost: Error) -> Result<()> {
        let resolved = match write {
            Write::Complete(_) => LostWrite::Complete,
            Write::Release => LostWrite::Release,
            Write::Renew(_) => return Err(lost),
        };
        oncely::backend::resolve_lost_write(
            BACKEND,
            lease,
            resolved,
            lost,
            self.inner.operation_timeout,
            || self.bounded(self.read(lease.key())),
            || async {
                self.bounded(async {
                    let mut conn = self.acquire().await?;
                    self.fenced_on(&mut conn, lease, write, true).await
                })
                .await
                .map(|_| ())
            },
        )
        .await
    }

    /// A claim whose answer was lost (`lost`): its statement was sent, and
    /// the connection died before the answer came (during the statement or
    /// its commit), or no answer came within the operation timeout. The
    /// statement may have committed. The claim statement runs again, with
    /// the same token, on a new connection: a row carrying the token was
    /// written by this call (the first run committed) and is answered as
    /// the caller's lease, at the row's fence and expiry, never as a
    /// phantom holder's `InProgress`; any other row is answered, or taken
    /// over, as by any claim; a missing row is inserted, as by any claim
    /// (the first run wrote nothing; or its write is still to come, and
    /// then this run waits on the key's lock and finds it on its next
    /// snapshot). Nothing is claimed blind: the one statement reads the row
    /// and decides under the key's lock.
    ///
    /// Tried again while the server is unavailable (a failover under way:
    /// the ledger is looking for the promoted standby) within one more
    /// [`PgLedgerOptions::operation_timeout`], each attempt bounded by what
    /// is left of it; when no attempt answers by then, `lost` is the answer.
    async fn resolve_claim(
        &self,
        key: &EffectKey,
        opts: &ClaimOptions,
        attempt: &Attempt,
        lost: Error,
    ) -> Result<Claim> {
        let give_up = Instant::now() + self.inner.operation_timeout;
        let again = retry(
            resolving(self.inner.operation_timeout),
            |e| matches!(e, Error::Unavailable { .. }),
            || {
                let left = give_up.saturating_duration_since(Instant::now());
                self.bounded_for(left, async {
                    let mut conn = self.acquire().await?;
                    self.claim_on(&mut conn, key, opts, true, &attempt.again()).await
                })
            },
        )
        .await;
        match again {
            Ok(claim) => {
                tracing::info!(
                    backend = BACKEND,
                    key = %key,
                    acquired = matches!(claim, Claim::Acquired(_)),
                    "a claim whose answer was lost was resolved from its row"
                );
                Ok(claim)
            }
            Err(Error::Unavailable { .. }) => Err(lost),
            Err(e) => Err(e),
        }
    }

    /// The claim statement on `conn` (options already validated); `guarded`
    /// is off inside a caller's transaction. A row it inserts or takes over
    /// carries the attempt's token, and an existing row that carries it is
    /// this call's own lease (see [`PgLedger::resolve_claim`]); the attempt
    /// records when the statement is sent.
    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        key: &EffectKey,
        opts: &ClaimOptions,
        guarded: bool,
        attempt: &Attempt,
    ) -> Result<Claim> {
        let sent_at = opts.sent_at.map(to_micros).transpose()?;
        guard::retry(
            conn,
            guarded,
            || format!("{key}: the claim"),
            |conn| async move {
                let run = async {
                    let query =
                        self.inner
                            .q
                            .bind_claim(key, opts, guarded, attempt.token().as_bytes(), sent_at);
                    attempt.sending();
                    let row = query.fetch_one(&mut *conn).await?;
                    Ok(match ClaimRow::decode(key, &row)? {
                        ClaimRow::Leaked => Run::Leaked,
                        ClaimRow::Beyond => return Err(Error::BeyondHorizon { key: key.to_string() }.into()),
                        ClaimRow::Missing => Run::Again,
                        ClaimRow::Acquired(lease) => Run::Done(Claim::Acquired(lease)),
                        // Written by an earlier run of this call whose answer was
                        // lost: the lease is the caller's.
                        ClaimRow::Existing(record, own) => {
                            match own.then(|| sql::own_lease(&record, opts.lease)) {
                                Some(Some(lease)) => Run::Done(Claim::Acquired(lease)),
                                // `None`: the record could be taken over now (its
                                // lease ended after the statement's ON CONFLICT looked
                                // at it); run the statement again to do so.
                                _ => match answer_existing(key, opts, record)? {
                                    Some(claim) => Run::Done(claim),
                                    None => Run::Again,
                                },
                            }
                        }
                    })
                }
                .await;
                (conn, run)
            },
        )
        .await
    }

    /// A fenced write (complete, release, renew) on `conn`; returns the
    /// statement's value column (the new expiry for renew) and whether a
    /// waiter marked the record (then its end is announced).
    async fn fenced_on(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        write: Write<'_>,
        guarded: bool,
    ) -> Result<(i64, bool)> {
        self.writable()?;
        let lost = || Error::LeaseLost {
            key: lease.key().to_string(),
            fence: lease.fence(),
        };
        let Ok(fence) = i64::try_from(lease.fence()) else {
            return Err(lost());
        };
        let q = &self.inner.q;
        guard::retry(
            conn,
            guarded,
            || format!("{}: the write", lease.key()),
            |conn| async move {
                let run = async {
                    let query = match write {
                        // Unguarded: inside the caller's transaction, which
                        // notifies when it commits (see sql.rs).
                        Write::Complete(outcome) => q.bind_complete(lease.key(), fence, outcome, guarded),
                        Write::Release => q.bind_release(lease.key(), fence, guarded),
                        Write::Renew(us) => q.bind_renew(lease.key(), fence, us, guarded),
                    };
                    match query.fetch_optional(&mut *conn).await? {
                        Some(row) => Ok(Run::Done((sql::written(&row)?, sql::watched(&row)?))),
                        None if guarded && !guard::autocommit(conn, &q.probe).await? => Ok(Run::Leaked),
                        None => Err(Failed::from(lost())),
                    }
                }
                .await;
                (conn, run)
            },
        )
        .await
    }

    /// A waiter's mark on `key`'s record (`sql.rs`, `watch_mark`), behind
    /// the leaked-transaction guard like every ledger statement.
    async fn mark_watched(&self, key: &EffectKey) -> Result<()> {
        let mut conn = self.acquire().await?;
        let q = &self.inner.q;
        guard::retry(
            &mut conn,
            true,
            || format!("{key}: the waiter's mark"),
            |conn| async move {
                let run = async {
                    match q.bind_watch_mark(key).fetch_optional(&mut *conn).await? {
                        Some(_) => Ok(Run::Done(())),
                        // Nothing to mark (no longer in progress, or marked
                        // already), unless the guard tripped.
                        None if !guard::autocommit(conn, &q.probe).await? => Ok(Run::Leaked),
                        None => Ok(Run::Done(())),
                    }
                }
                .await;
                (conn, run)
            },
        )
        .await
    }

    /// One prune batch of at most `batch` records, searching from
    /// `retain_until` `from` (µs) on: how many were candidates (past
    /// retention, not locked), how many were deleted, and the newest
    /// candidate's `retain_until`.
    async fn prune_batch(
        &self,
        conn: &mut PgConnection,
        batch: u64,
        from: Option<i64>,
    ) -> Result<(u64, u64, Option<i64>)> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let row = guard::retry(
            conn,
            true,
            || "prune".to_owned(),
            |conn| async move {
                let run = async {
                    let row = self.inner.q.bind_prune(batch, from).fetch_one(&mut *conn).await?;
                    guard::checked(row)
                }
                .await;
                (conn, run)
            },
        )
        .await?;
        sql::prune_counts(&row)
    }
}

/// The fenced writes.
#[derive(Clone, Copy)]
enum Write<'a> {
    Complete(&'a Outcome),
    Release,
    Renew(i64),
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
        .coalescing(true)
        .caller_transaction(true)
    }

    /// A claim whose answer is lost (the connection died during the
    /// statement or its commit, or no answer within the operation timeout)
    /// is resolved from its own row, found by the claim's token on a new
    /// connection (see the crate docs, "Replication and failover").
    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.writable()?;
        let attempt = Attempt::new()?;
        let claimed = self
            .bounded(async {
                let mut conn = self.acquire().await?;
                self.claim_on(&mut conn, key, opts, true, &attempt).await
            })
            .await;
        let claimed = match claimed {
            Err(lost @ Error::Unavailable { .. }) if attempt.sent() => {
                self.resolve_claim(key, opts, &attempt, lost).await
            }
            claimed => claimed,
        };
        if let Ok(Claim::Acquired(lease)) = &claimed {
            self.inner.changes.holding(lease);
        }
        claimed
    }

    /// A completion whose answer is lost (the connection died during the
    /// statement or its commit, or no answer within the operation timeout)
    /// is resolved from the record, read again on a new connection (see
    /// the crate docs, "Replication and failover").
    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, MAX_OUTCOME_BYTES)?;
        self.writable()?;
        let write = Write::Complete(outcome);
        let wrote = self
            .bounded(async {
                let mut conn = self.acquire().await?;
                self.fenced_on(&mut conn, lease, write, true).await
            })
            .await;
        let watched = match wrote {
            Ok((_, watched)) => watched,
            // Resolved from the record: whether it was marked is not known,
            // so it is announced.
            Err(lost @ Error::Unavailable { .. }) => self.resolve(lease, write, lost).await.map(|()| true)?,
            Err(e) => {
                if e.is_lease_lost() {
                    self.inner.changes.let_go(lease.key().as_str());
                }
                return Err(e);
            }
        };
        // Committed: wake this process's waiters now, and announce it to the
        // others' if one marked it (after the commit, from a transaction of
        // its own).
        self.inner.changes.finished(lease.key().as_str(), watched);
        Ok(())
    }

    /// Resolved from the record when its answer is lost, as a completion is.
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.writable()?;
        let wrote = self
            .bounded(async {
                let mut conn = self.acquire().await?;
                self.fenced_on(&mut conn, lease, Write::Release, true).await
            })
            .await;
        let watched = match wrote {
            Ok((_, watched)) => watched,
            Err(lost @ Error::Unavailable { .. }) => {
                self.resolve(lease, Write::Release, lost).await.map(|()| true)?
            }
            Err(e) => {
                if e.is_lease_lost() {
                    self.inner.changes.let_go(lease.key().as_str());
                }
                return Err(e);
            }
        };
        self.inner.changes.finished(lease.key().as_str(), watched);
        Ok(())
    }

    /// A notified watch while the ledger's listener is connected (it starts
    /// with the first call, which waits a moment for its first connection),
    /// else a polling one; always polling on a read-only ledger.
    ///
    /// A notified watch marks the key's record, if it is in progress and
    /// its lease is not this ledger's own, so that its completion or
    /// release is announced (completions nobody marked are not): the runner
    /// reads the record again after this returns, so a completion that
    /// committed before the mark is seen there. If the mark cannot be
    /// written, the watch polls.
    async fn watch(&self, key: &EffectKey) -> Watch {
        if self.inner.read_only {
            return Watch::polling();
        }
        let watch = self.inner.changes.watch(key).await;
        // A lease this ledger holds: its completion wakes this watch itself.
        if !watch.is_notified() || self.inner.changes.holds(key.as_str()) {
            return watch;
        }
        match self.bounded(self.mark_watched(key)).await {
            Ok(()) => watch,
            Err(e) => {
                tracing::debug!(key = %key, error = %e, "could not mark the record watched; polling");
                Watch::polling()
            }
        }
    }

    /// One statement per batch of up to 500 distinct keys, each key
    /// answered as one claim would be (see the crate docs, "Batches").
    /// A key whose answer is lost is resolved from its own row, as one
    /// claim's is.
    async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        opts.validate()?;
        self.writable()?;
        let attempt = Attempt::new()?;
        let claimed = self.bounded(self.claim_batches(keys, opts, &attempt)).await;
        if !attempt.sent() {
            return claimed;
        }
        let mut answers = match claimed {
            Ok(answers) => answers,
            Err(lost @ Error::Unavailable { .. }) => fail_each(lost, keys.len()),
            Err(e) => return Err(e),
        };
        self.resolve_batch(keys, opts, &attempt, &mut answers).await;
        for answer in &answers {
            if let Ok(Claim::Acquired(lease)) = answer {
                self.inner.changes.holding(lease);
            }
        }
        Ok(answers)
    }

    /// One statement for the whole batch, each lease fenced on its own.
    /// Outcomes over the limit and leases listed again are answered before
    /// the round trip (a lease listed again: as a second completion of the
    /// same lease would be, [`Error::LeaseLost`] once the first succeeded).
    async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        match self
            .bounded(async { Ok(self.complete_batches(items).await) })
            .await
        {
            Ok(answers) => answers,
            Err(e) => fail_each(e, items.len()),
        }
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        oncely::backend::check_extension(extend_by)?;
        self.writable()?;
        let (expires_us, _) = self
            .bounded(async {
                let mut conn = self.acquire().await?;
                self.fenced_on(&mut conn, lease, Write::Renew(duration_micros(extend_by)), true)
                    .await
            })
            .await?;
        let renewed = lease.renewed_until(from_micros(expires_us));
        self.inner.changes.holding(&renewed);
        Ok(renewed)
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        self.bounded(self.read(key)).await
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        self.writable()?;
        self.bounded(self.prune_up_to(limit)).await
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        self.bounded(self.abandoned_up_to(tenant, limit)).await
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        self.bounded(self.read_horizon(tenant, kind)).await
    }

    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        error::unique_violation(error)
    }
}

/// The bodies of the [`Ledger`] operations, each run by
/// [`PgLedger::bounded`].
impl PgLedger {
    /// [`Ledger::get`], unbounded.
    async fn read(&self, key: &EffectKey) -> Result<Option<Record>> {
        let mut conn = self.acquire().await?;
        let row = guard::retry(
            &mut conn,
            true,
            || format!("{key}: the read"),
            |conn| async move {
                let run = async {
                    let row = self.inner.q.bind_get(key).fetch_one(&mut *conn).await?;
                    guard::checked(row)
                }
                .await;
                (conn, run)
            },
        )
        .await?;
        if !sql::has_record(&row)? {
            return Ok(None);
        }
        RecordRow::decode(&row)?.record(key.clone()).map(Some)
    }

    async fn prune_up_to(&self, limit: u64) -> Result<u64> {
        let mut conn = self.acquire().await?;
        let cursor = || self.inner.prune_from.lock().unwrap_or_else(|p| p.into_inner());
        let mut deleted = 0;
        while deleted < limit {
            let batch = (limit - deleted).min(PRUNE_BATCH);
            let from = *cursor();
            let (candidates, n, last) = self.prune_batch(&mut conn, batch, from).await?;
            deleted += n;
            // Fewer candidates than asked: nothing more is due from the
            // cursor on. Start from the oldest again: once more in this call
            // if it began mid-way (a row skipped earlier, locked by a claim
            // then, may be due and free now), else in the next call.
            if candidates < batch {
                *cursor() = None;
                if from.is_none() {
                    break;
                }
                continue;
            }
            *cursor() = last;
            // None deleted: every candidate's key is held by a claim; the
            // next prune gets them (the cursor has moved past them).
            if n == 0 {
                break;
            }
        }
        Ok(deleted)
    }

    async fn abandoned_up_to(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.acquire().await?;
        // A read: inside a stray transaction it would still read correctly,
        // so it carries no guard; only a failed stray transaction is healed.
        let rows = guard::retry(
            &mut conn,
            true,
            || "abandoned listing".to_owned(),
            |conn| async move {
                let run = self
                    .inner
                    .q
                    .bind_abandoned(tenant, limit)
                    .fetch_all(&mut *conn)
                    .await
                    .map(Run::Done)
                    .map_err(Failed::from);
                (conn, run)
            },
        )
        .await?;
        rows.iter()
            .map(|row| {
                let key = sql::key(row)?;
                RecordRow::decode(row)?.record(key)
            })
            .collect()
    }

    async fn read_horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        let mut conn = self.acquire().await?;
        let row = guard::retry(
            &mut conn,
            true,
            || "the horizon read".to_owned(),
            |conn| async move {
                let run = async {
                    let row = self
                        .inner
                        .q
                        .bind_horizon(tenant, kind)
                        .fetch_one(&mut *conn)
                        .await?;
                    guard::checked(row)
                }
                .await;
                (conn, run)
            },
        )
        .await?;
        Ok(sql::watermark(&row)?.map(from_micros))
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

    /// Not resolved when its answer is lost: the claim commits (or not)
    /// with the caller's transaction, and the caller's `COMMIT` is theirs to
    /// resolve. After a `COMMIT` whose answer was lost, read the record
    /// ([`Ledger::get`]): in progress (or completed) at the lease's fence
    /// means the transaction committed, business writes included; anything
    /// else means it rolled back (see the crate docs, "Replication and
    /// failover").
    async fn claim_in(&self, conn: &mut PgConnection, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.writable()?;
        // Its row carries a token like any claim's, but nothing resolves a
        // lost answer here: the claim commits (or not) with the caller's
        // transaction (see the crate docs, "Replication and failover").
        self.claim_on(conn, key, opts, false, &Attempt::new()?).await
    }

    async fn complete_in(&self, conn: &mut PgConnection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, MAX_OUTCOME_BYTES)?;
        let wrote = self.fenced_on(conn, lease, Write::Complete(outcome), false).await;
        // Ended here, or not at all: from now on a waiter in this process
        // marks the record, as for any lease this ledger does not hold (the
        // notification leaves with the caller's commit, marked or not).
        self.inner.changes.let_go(lease.key().as_str());
        wrote.map(|_| ())
    }
}

/// What the ledger reads, for an operator: `postgres HOST:PORT/DATABASE,
/// table SCHEMA.TABLE` (a socket's path for `HOST:PORT`), from the pool's
/// connection options, never the password.
impl std::fmt::Display for PgLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.pool.connect_options();
        match c.get_socket() {
            Some(socket) => write!(f, "postgres {}", socket.display())?,
            None if c.get_host().contains(':') => write!(f, "postgres [{}]:{}", c.get_host(), c.get_port())?,
            None => write!(f, "postgres {}:{}", c.get_host(), c.get_port())?,
        }
        // Without a database, the server opens the one named after the user.
        let database = c.get_database().unwrap_or(c.get_username());
        write!(f, "/{database}, table {}.{}", self.inner.schema, self.inner.table)
    }
}

impl FromUrl for PgLedger {
    const SCHEMES: &'static [&'static str] = SCHEMES;

    /// [`PgLedger::connect_with`] with the default options, except:
    /// [`Access::Existing`](oncely::open::Access::Existing) is
    /// [`PgLedgerOptions::migrate`]`(false)`,
    /// [`Access::ReadOnly`](oncely::open::Access::ReadOnly) is
    /// [`PgLedgerOptions::read_only`]`(true)`, and a
    /// [`connect_timeout`](field@OpenOptions::connect_timeout) is the
    /// [`acquire_timeout`](PgLedgerOptions::acquire_timeout) (which bounds
    /// connecting too). The table is the URL's `?schema=` and `?table=`
    /// (default `public.oncely_effects`).
    async fn from_url(url: &str, options: OpenOptions) -> Result<Self> {
        PgLedger::connect_with(url, oncely::open::LedgerOptions::for_open(options)).await
    }
}

impl PgLedger {
    /// `Admin::erase` (`write`), or its dry run: the same statements, rolled
    /// back.
    async fn erase_as(&self, tenant: &Tenant, subject: &str, write: bool) -> Result<Erasure> {
        check_subject(subject)?;
        self.writable()?;
        let q = &self.inner.q;
        self.bounded(async {
            let mut tx = self.begin().await?;
            let rows = q
                .bind_erase_lock(tenant, subject)
                .fetch_all(&mut *tx)
                .await
                .map_err(map)?;
            let mut erasure = match sql::erasure(&rows)? {
                Some(erasure) => {
                    q.bind_erase(tenant, subject)
                        .execute(&mut *tx)
                        .await
                        .map_err(map)?;
                    erasure
                }
                None => {
                    // No record of the subject: the clock only.
                    let row = sql::bind_listing(sql::CLOCK_NOW, &[])
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(map)?;
                    Erasure::new(sql::clock_now(&row)?)
                }
            };
            let messages = q
                .outbox
                .bind_erase_lock(tenant, subject)
                .fetch_all(&mut *tx)
                .await
                .map_err(map)?;
            let ids = sql::erase_messages(&mut erasure, &messages, subject)?;
            if !ids.is_empty() {
                q.outbox.bind_erase(ids).execute(&mut *tx).await.map_err(map)?;
            }
            if write {
                tx.commit().await.map_err(map)?;
            } else {
                tx.rollback().await.map_err(map)?;
            }
            Ok(erasure.sorted())
        })
        .await
    }
}

/// The operator's view (`oncely::admin`): listings and stats are reads at
/// one `clock_timestamp()` reading; forget is one guarded, fenced `UPDATE`.
impl Admin for PgLedger {
    async fn records(&self, query: &RecordQuery) -> Result<Vec<Record>> {
        let (text, args) = sql::records(&self.inner.q_table(), query)?;
        let rows = self.read_all(&text, &args, "the record listing").await?;
        rows.iter()
            .map(|row| {
                let key = sql::key(row)?;
                RecordRow::decode(row)?.record(key)
            })
            .collect()
    }

    async fn stats(&self, tenant: Option<&Tenant>) -> Result<Vec<KindStats>> {
        let (text, args) = sql::stats(&self.inner.q_table(), tenant);
        let rows = self.read_all(&text, &args, "the stats").await?;
        rows.iter().map(sql::kind_stats).collect()
    }

    async fn forget(&self, key: &EffectKey, fence: u64) -> Result<()> {
        self.writable()?;
        let Ok(f) = i64::try_from(fence) else {
            return Err(forget_refusal(key, fence, self.get(key).await?));
        };
        let q = &self.inner.q;
        let wrote = self
            .bounded(async {
                let mut conn = self.acquire().await?;
                guard::retry(
                    &mut conn,
                    true,
                    || format!("{key}: forget"),
                    |conn| async move {
                        let run = async {
                            let row = q.bind_forget(key, f).fetch_optional(&mut *conn).await?;
                            match row {
                                Some(_) => Ok(Run::Done(true)),
                                None if !guard::autocommit(conn, &q.probe).await? => Ok(Run::Leaked),
                                None => Ok(Run::Done(false)),
                            }
                        }
                        .await;
                        (conn, run)
                    },
                )
                .await
            })
            .await?;
        if wrote {
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
        self.writable()?;
        check_outcome(outcome, self.capabilities().max_outcome_bytes)?;
        let Ok(f) = i64::try_from(fence) else {
            return Ok(false);
        };
        let q = &self.inner.q;
        self.bounded(async {
            let mut tx = self.begin().await?;
            let row = q
                .bind_replace_outcome(key, f, expected.as_bytes(), outcome.as_bytes())
                .fetch_optional(&mut *tx)
                .await
                .map_err(map)?;
            tx.commit().await.map_err(map)?;
            Ok(row.is_some())
        })
        .await
    }

    async fn prunable(&self) -> Result<u64> {
        let rows = self
            .read_all(&self.inner.q.prunable, &[], "the prunable count")
            .await?;
        let n: i64 = rows
            .first()
            .map(|r| sqlx::Row::try_get(r, 0))
            .transpose()
            .map_err(map)?
            .unwrap_or(0);
        Ok(u64::try_from(n).unwrap_or(0))
    }
}

impl PgLedger {
    /// A read on a pooled connection, healed (rolled back and run again) if
    /// the connection was left inside a failed stray transaction.
    async fn read_all(
        &self,
        text: &str,
        args: &[sql::Arg],
        what: &str,
    ) -> Result<Vec<sqlx::postgres::PgRow>> {
        self.bounded(async {
            let mut conn = self.acquire().await?;
            guard::retry(
                &mut conn,
                true,
                || what.to_owned(),
                |conn| async move {
                    let run = sql::bind_listing(text, args)
                        .fetch_all(&mut *conn)
                        .await
                        .map(Run::Done)
                        .map_err(Failed::from);
                    (conn, run)
                },
            )
            .await
        })
        .await
    }
}

impl Inner {
    /// The ledger table, schema-qualified and quoted, for the statements
    /// built per query.
    fn q_table(&self) -> String {
        format!("{}.{}", sql::quote(&self.schema), sql::quote(&self.table))
    }
}
