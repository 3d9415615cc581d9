//! # oncely-postgres: the guide
//!
//! What [the crate docs](crate) leave out of their first screen: the
//! guarantees and limits, and how it works.
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
//! use oncely::backend::{Claim, Outcome, TransactionalLedger};
//! use oncely::{ClaimOptions, EffectKey, Tenant};
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
//! use oncely::backend::Ledger;
//! use oncely::Tenant;
//! use oncely_postgres::{PgLedger, PgLedgerOptions};
//!
//! # async fn demo() -> oncely::Result<()> {
//! let ledger = PgLedger::connect_with("postgres://auditor@db/app", PgLedgerOptions::default().read_only(true))
//!     .await?;
//! let stuck = ledger.abandoned(&Tenant::global(), 100).await?;
//! # let _ = stuck; Ok(()) }
//! ```
//!
//! ## Opening from a URL
//!
//! [`PgLedger`] implements [`FromUrl`] for `postgres://` and
//! `postgresql://` URLs, so a tool can open whichever backend a URL names.
//! The URL names the whole ledger, table included:
//!
//! | URL part | what it sets |
//! | --- | --- |
//! | `postgres://` or `postgresql://` `user:password@host:port/database` | the server and database (sqlx's form; a Unix socket as `?host=/run/postgresql`) |
//! | `user@db1:5432,db2:5432/database` | a host list (which sqlx alone refuses): the first host that answers as `?target_session_attrs=` wants, checked again on every new connection (see [Replication and failover](#replication-and-failover)) |
//! | `?target_session_attrs=read-write` | which server of the list will do: `read-write` (the default of a ledger that writes), `primary`, `any` (no check); for a [read-only](PgLedgerOptions::read_only) ledger (default `any`) also `read-only`, `standby`, `prefer-standby` |
//! | `?schema=billing` | [`PgLedgerOptions::schema`] (default `public`) |
//! | `?table=effects` | [`PgLedgerOptions::table`] (default `oncely_effects`) |
//! | `?sslmode=`, `?application_name=`, `?options=` … | sqlx's own parameters, handed to it |
//! | any other parameter (`?tabel=x`) | refused: [`Error::Config`] naming it and the accepted ones, before anything connects |
//!
//! `postgres://app@db/app?schema=billing&table=effects` is the ledger an
//! application opened with `.schema("billing").table("effects")`, and what
//! `oncely stats` must be given to read it. [`PgLedger::connect_with`]
//! reads the same parameters, over its options'. A ledger's
//! [`Display`](std::fmt::Display) says what it reads (`postgres
//! db:5432/app, table billing.effects`), never the password.
//!
//! [`Access::Migrate`] is
//! [`PgLedger::connect`]; [`Access::Existing`] is
//! [`PgLedgerOptions::migrate`]`(false)`; [`Access::ReadOnly`] is
//! [`PgLedgerOptions::read_only`]`(true)`. A
//! [`connect_timeout`](field@oncely::open::OpenOptions::connect_timeout) is the pool's
//! [`acquire_timeout`](PgLedgerOptions::acquire_timeout), which in sqlx
//! bounds opening a connection too. Any other scheme, and a malformed URL,
//! is [`Error::Config`] before anything connects, with a message that does
//! not quote the URL.
//!
//! ```no_run
//! use oncely::open::{Access, FromUrl, OpenOptions};
//! use oncely_postgres::PgLedger;
//! use std::time::Duration;
//!
//! # async fn demo() -> oncely::Result<()> {
//! let open = OpenOptions::new(Access::ReadOnly).connect_timeout(Duration::from_secs(5));
//! let ledger = PgLedger::from_url("postgresql://auditor@db/app", open).await?;
//! # let _ = ledger; Ok(()) }
//! ```
//!
//! A pool the application already has is used with
//! [`PgLedger::from_pool`] or [`PgLedger::from_pool_with`] (a
//! `sqlx::PgPool`; the crate re-exports only [`PgConnection`], the type a
//! caller's transaction derefs to).
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | atomic claim | one statement, one round trip: a per-key advisory lock, then `INSERT … ON CONFLICT (key) DO NOTHING`, a fenced takeover `UPDATE` only of a released or expired record, and a read of the existing row. A duplicate of a completed or live effect is a read: no row lock, no transaction id, no WAL |
//! | caller's transaction | yes: [`TransactionalLedger`] on `&mut PgConnection` (`&mut *tx`); the claim holds its key's transaction-scoped advisory lock until the transaction ends |
//! | durability | a PostgreSQL commit (WAL, as `synchronous_commit` is configured). With [`ClaimOptions::relaxed_claim`] the claim's own transaction commits with `synchronous_commit = off` (set in the claim statement), so it is acknowledged before its WAL flush and before a synchronous standby has it: a crash or failover can forget it, and the next delivery runs the effect again, with the same provider key. The completion always waits; a claim in the caller's transaction (`claim_in`) is left as that transaction is set; refused for at-most-once steps. 1 WAL flush per job instead of 2 (`tests/relaxed.rs`) |
//! | replication | a primary with streaming standbys, through a host list: with a synchronous standby (`synchronous_standby_names`, `synchronous_commit = on` or `remote_apply`) a failover loses no acknowledged claim or completion; with asynchronous replication it can (see [Replication and failover](#replication-and-failover)). Tested with one standby, the primary killed and frozen. Not tested: CockroachDB, YugabyteDB (not runnable here; CockroachDB's advisory locks are no-ops, and it has no `LISTEN`) |
//! | clock | the database's `clock_timestamp()` at the moment each write takes effect: after the claim's wait on its key's lock, and inside a caller's transaction too (never `now()`, the transaction's start). It decides lease expiry, takeover and retention; the worker's clock never does |
//! | fences | the clock's microseconds when the lease is written, or the previous fence + 1 if that is higher ([`next_fence`](oncely::backend::next_fence)): a key never gets a fence it had before, prunes included, as long as the server's clock never steps back by more than the shortest retention in use |
//! | horizon | a watermark per tenant and kind (table `<table>_horizon`): prune raises it to the newest `created_at` it deletes, in the same transaction. A claim with [`ClaimOptions::sent_at`] at or before it fails with [`Error::BeyondHorizon`] when the key is absent (an old message may still take over a released or expired record it finds). A claim without `sent_at` cannot tell a replay of a pruned effect from new work. Records pruned by schema version 1 (before the watermark existed) left none |
//! | schema check | on connect and at the end of [`PgLedger::migrate`]: the columns and their types, a primary key or unique index on exactly `key`, deterministic collations on the text columns (a case-insensitive collation would let `Acme` and `acme` share a record); otherwise [`Error::Config`] naming the table and the problem |
//! | max key | [`oncely::backend::MAX_KEY_BYTES`] (255 bytes), stored whole as the primary key |
//! | max outcome | [`oncely::backend::MAX_OUTCOME_BYTES`] (64 KiB), `bytea` |
//! | operator view | [`oncely::admin::Admin`]: `records` and `stats` read at one `clock_timestamp()` (a materialized CTE), in byte order of the key (`COLLATE "C"`); a tenant's listing reads its rows by the `tenant` column (no index on it but the partial one of abandoned steps; the key's primary key serves a full key), then sorts; `forget` is one guarded, fenced `UPDATE` (completed at that fence → released, outcome removed, row kept); `prunable` counts with the prune index |
//! | locks | one advisory lock per claim, held for the statement (autocommit) or until the caller's transaction ends (`claim_in`): a transaction claiming thousands of keys can exhaust the server's lock table (`max_locks_per_transaction` × connections). Prune deletes in batches of at most 500 rows per transaction and skips keys whose lock is held (see [Pruning](#pruning-tens-of-millions-of-rows)) |
//! | failure | cannot connect, pool exhausted, or no answer within [`PgLedgerOptions::operation_timeout`] (10 s): [`Error::Unavailable`] (fail closed, nothing runs); a claim, completion or release whose answer was lost is resolved from its row first (a claim's by its token); serialization failure or deadlock: retryable [`Error::Backend`]; a unique violation in a step's own write: [`Error::ConstraintViolation`] (through [`Ledger::unique_violation`]); a read-only session or a missing privilege: [`Error::Config`] |
//!
//! ## Waiting duplicates
//!
//! A duplicate run with [`oncely::OnInProgress::Wait`] that finds the effect
//! in progress is woken when it completes or is released, not on a timer.
//! The ledger wakes its own process's waiters directly after each write that
//! ends a lease commits; other processes hear of it by `LISTEN`/`NOTIFY`: one
//! listener connection per ledger (started by the first claim that waits,
//! not one per waiter; [`PgLedger::listener_status`]), and the keys of this
//! ledger's completions and releases announced after they commit, coalesced
//! into one `SELECT pg_notify(…) FROM unnest(…)` whose commit does not wait
//! for a WAL flush (`synchronous_commit` off for that transaction only).
//! Only a record a waiter marked is announced (`complete_in` notifies in
//! the caller's transaction whatever the mark): a waiter's watch, once its
//! listener listens, sets the record's `watched` column (one `UPDATE` of a
//! record in progress, not yet marked, whose commit does not wait for a
//! flush either), and the claim runs once more before the waiter sleeps.
//! The completion's `UPDATE` returns the mark of the version it wrote: a
//! mark committed before it is seen, and one after it finds the record no
//! longer in progress, writes nothing, and its waiter's next claim reads
//! the outcome. So a completion nobody waits for in another process costs
//! no announcement (on the sequential bench, 2 write transactions per job
//! instead of 3), and [`ListenerStatus::unwatched`] counts them.
//! Completions do not notify inside their own transaction because PostgreSQL
//! commits notifying transactions one at a time, WAL flush included: on this
//! project's 2-core machine, 8 clients inserting committed 4,200 times a
//! second, and 530 to 880 times with a notify in each. Only
//! [`complete_in`](oncely::backend::TransactionalLedger::complete_in) notifies in its
//! statement, so the notification leaves when the caller's transaction
//! commits, and never if it rolls back. A wake-up is a hint: the waiter
//! claims again and answers from the record. A lost notification (the
//! listener reconnecting, a process that died between its commit and its
//! announcement) costs latency, at most
//! [`oncely::backend::NOTIFIED_FALLBACK`] and never beyond the lease, never a
//! wrong answer; while the listener is down, waiters poll.
//!
//! ## Replication and failover
//!
//! Point the ledger at every server of a primary/standby set,
//! `postgres://app@db1:5432,db2:5432/app?target_session_attrs=read-write`.
//! [`PgLedger::connect_with`] probes them all and connects to the one that
//! accepts writes; a ledger that writes given only standbys fails there
//! with [`Error::Config`] ("no host is a server that accepts writes:
//! db2:5432: a standby (in recovery)"), and with [`Error::Unavailable`]
//! when no host answers. Every new connection of the pool runs the same
//! check (`pg_is_in_recovery()`, `transaction_read_only`). When an
//! operation finds the server gone (a connection error, or no answer within
//! [`PgLedgerOptions::operation_timeout`]) or a new connection lands on a
//! standby, the ledger closes its older pooled connections instead of
//! handing them out, and one background search probes every host until one
//! accepts writes (for up to 2 minutes; the next failure starts another):
//! the pool and the `LISTEN` connection then follow the promoted standby.
//! The operations that failed meanwhile failed closed, with
//! [`Error::Unavailable`]; the next delivery runs on the new primary.
//! Promoting a standby is the operator's (or a failover manager's) job:
//! the ledger only follows, and an old primary that comes back writable
//! must be fenced off, or the ledger may follow it back.
//!
//! **A server that stops answering** (frozen, partitioned away) costs each
//! operation at most [`PgLedgerOptions::operation_timeout`] (one more for a
//! claim, completion or release whose answer it lost: the resolution's
//! window, below): it fails with
//! [`Error::Unavailable`] and its connection is closed, never returned to
//! the pool; a waiting duplicate ([`oncely::OnInProgress::Wait`]) returns
//! within its `max` plus one operation timeout (two when the answer of
//! its last claim is lost and resolved, below). Measured with the primary
//! frozen (SIGSTOP) under 8 workers: before the timeout existed, every
//! worker and a waiting duplicate were still blocked a minute later; with
//! it, every call returned (most with [`Error::Unavailable`], the waiter
//! included), and every key was then completed on the promoted standby.
//!
//! **A lost answer.** A completion or release whose connection died during
//! its statement or its commit (or that timed out) reads its record again on
//! a new connection: completed (or released) at its lease's fence means it
//! was applied; still in progress at that fence means nothing was, and the
//! fenced write runs once more; anything else is [`Error::LeaseLost`]. Only
//! when the record cannot be read either does it fail, and the runner then
//! answers [`Error::OutcomeUnknown`].
//!
//! A *claim* whose answer was lost is resolved from its own row too, never
//! by claiming blind. Every claim call draws a token (16 random bytes from
//! the operating system) and its statement writes it, followed by its
//! transaction's id, into the row it inserts or takes over (column
//! `claim_token`, schema version 3); the row carries the call's token while
//! it is the version that transaction wrote. When the
//! connection dies after the statement was sent (during the statement or
//! its commit), or no answer comes within the operation timeout, the ledger
//! runs the same claim statement again with the same token on a new
//! connection, retried while the server is unavailable (the ledger is
//! finding the promoted standby) for one more operation timeout:
//!
//! - a row carrying the token was written by this call, so the first
//!   statement committed: the answer is [`Claim::Acquired`] with the lease at
//!   the row's fence and expiry (not [`Claim::InProgress`] behind a holder
//!   nobody knows, which would delay the effect by a whole lease);
//! - any other row is answered as by any claim ([`Claim::InProgress`] under
//!   another holder's lease, [`Claim::Completed`] with its outcome…), or
//!   taken over if it is released or expired;
//! - no row: the first statement wrote nothing, and the key is claimed (if
//!   that statement is still on its way, it waits on the key's lock and its
//!   row is seen, carrying the token, by the next run).
//!
//! The read and the decision are one statement under the key's lock, so a
//! concurrent duplicate never acquires beside it. A key of
//! [`claim_many`](oncely::backend::Ledger::claim_many) is resolved the same way, by
//! the batch's token. Only when no run answers within the window does the
//! claim fail with the original [`Error::Unavailable`] (so a claim whose
//! answer is lost costs at most two operation timeouts); a row it wrote
//! then holds its key until its lease ends, as any lost lease does.
//! Measured (`tests/lost_claim.rs`, a claim's commit waiting on the
//! synchronous standby when its backend is terminated, and a claim in flight
//! when the primary is killed and the standby promoted): before the token,
//! [`Error::Unavailable`] and then [`Claim::InProgress`] for a lease nobody
//! held; with it, [`Claim::Acquired`] at the row's fence, and the duplicate
//! in flight beside it [`Claim::InProgress`].
//!
//! [`claim_in`](oncely::backend::TransactionalLedger::claim_in) needs no resolution:
//! its row commits with the caller's transaction, and the caller's `COMMIT`
//! is theirs. If its answer is lost, read the record
//! ([`Ledger::get`](oncely::backend::Ledger::get)) on a new connection: in progress
//! (or completed, after [`complete_in`](oncely::backend::TransactionalLedger::complete_in))
//! at the lease's fence means the transaction committed, with the business
//! writes in it, and the lease is still yours; anything else means it rolled
//! back, the claim with it, and the delivery can simply run again. (Fences
//! never repeat for a key, so the fence identifies the transaction's
//! claim.)
//!
//! **Synchronous replication** (`synchronous_standby_names = '*'` or a
//! named standby, `synchronous_commit = on` or `remote_apply`): a commit is
//! acknowledged only once the standby has it, so promoting that standby
//! loses no acknowledged claim or completion, and no effect whose
//! completion was acknowledged runs again. Measured (`tests/failover.rs`: 8
//! workers running [`Effects::run`](oncely::Effects::run) over 3,000 keys,
//! the primary killed or frozen about 2 s in, the standby promoted at once,
//! every key delivered again to it): 0 acknowledged completions lost and 0
//! second runs, in each of 8 runs with the primary killed and 7 with it
//! frozen (and no call blocked past its bound). Each commit waits for the standby's flush: see
//! `docs/benchmarks.md` for what that costs.
//!
//! **Asynchronous replication** (no synchronous standby): the primary
//! acknowledges a commit before the standby has it, so a failover loses
//! whatever had not reached the standby: completions (the redelivery finds
//! the effect in progress under a lease nobody holds, waits it out, and runs
//! the handler again) and claims (the redelivery claims afresh and runs it
//! again). Which effects may run again: those whose claim or completion
//! committed in the last moments before the crash (the replication lag,
//! usually milliseconds). What bounds the damage: a re-run gets a higher
//! fence, so a business write fenced `WHERE fence < $n` by the lost run is
//! not overwritten by a stale one, and a provider-keyed step calls its
//! provider again with the same [`provider_key`](oncely::EffectKey::provider_key),
//! which the provider deduplicates; an at-most-once step's lost mark lets
//! it be sent twice. Measured before this crate followed a host list (the
//! redelivery pointed at the promoted standby by hand): 0 to 4 acknowledged
//! completions lost per run, each run again by the redelivery; with
//! `synchronous_commit = on` or `remote_apply`, 0 in 11 runs. The same
//! workload in `tests/failover.rs` prints its counts for an asynchronous
//! standby and does not assert them: 0 lost in each of 12 runs here (a
//! debug build running 300 to 700 jobs a second against a standby on
//! loopback, so little is ever in flight to it); a faster workload, or a
//! standby farther away, loses more.
//!
//! **Notifications are not replicated**: the listener's connection dies
//! with the primary, and every waiting duplicate is woken at once to look at
//! its record (and again when the listener listens anew, on the new
//! primary); a wake-up is a hint, never an answer.
//!
//! **Not tested here**: CockroachDB and YugabyteDB (not runnable on this
//! project's machines). The ledger relies on transaction-scoped advisory
//! locks (no-ops on CockroachDB) and `LISTEN`/`NOTIFY` (unsupported on
//! CockroachDB), so it makes no claim for them. The multi-node conformance
//! suite does not apply to a primary with standbys (one writable node); the
//! single-node suite runs through a host list whose first host is a
//! standby (`tests/conformance_hosts.rs`).
//!
//! ## Batches
//!
//! [`Ledger::claim_many`](oncely::backend::Ledger::claim_many) is one statement per
//! 500 distinct keys with every rule of the single claim (key locks in lock-id
//! order, the clock read after the locks, horizon, fingerprints, takeovers,
//! the guard); [`Ledger::complete_many`](oncely::backend::Ledger::complete_many) is one
//! statement with each lease fenced on its own. A key listed twice acquires
//! once and finds itself in progress the second time.
//!
//! ## Pruning tens of millions of rows
//!
//! [`Ledger::prune`](oncely::backend::Ledger::prune) never deletes in one big
//! statement. Each batch is one autocommit statement of at most 500 rows
//! that finds its rows on the partial index `<table>_prune_idx`
//! (`retain_until`, only completed and released rows: in-progress rows,
//! the hot part of the table, are not in it) with `ORDER BY retain_until
//! LIMIT n FOR UPDATE SKIP LOCKED`, skips keys a claim holds (their
//! advisory lock), deletes, and raises the tenant and kind's horizon in
//! the same statement, so in the same transaction. A claim therefore never
//! waits on more than one batch's row and key locks, and only when it
//! claims one of the very keys being deleted. Batches start where the
//! previous one stopped on that index (the ledger keeps a cursor, reset
//! once it reaches the end of what is due), so a backlog is not read again
//! from its oldest, already-deleted index entries by every batch.
//!
//! Run it continuously with [`oncely::pruner::Pruner`] rather than as a nightly
//! `oncely prune` of everything: `Pruner::new(ledger.clone(),
//! PrunerOptions::default()).spawn()` deletes at most
//! [`rows_per_second`](oncely::pruner::PrunerOptions::rows_per_second) (5,000 by
//! default) in [`batch`](oncely::pruner::PrunerOptions::batch)es (500), and rests
//! when nothing is due. What to tune:
//!
//! - **the rate**: every deleted row writes WAL (and a full page image the
//!   first time a page is touched after a checkpoint) that replicas must
//!   replay; set the rate a little above the rate records become due (your
//!   completions per second) so a backlog drains, and low enough that
//!   replication lag and checkpoint I/O stay where you want them;
//!   `benches/prune.rs` measures claim latency while a million rows go;
//! - **autovacuum**: a deleted row is dead until vacuum reclaims it, and its
//!   entries stay in the table's indexes until then. The default trigger
//!   (`autovacuum_vacuum_scale_factor` = 0.2, a fifth of the table dead)
//!   lets a 50-million-row ledger carry 10 million dead rows; give the
//!   ledger table its own settings, e.g. `ALTER TABLE oncely_effects SET
//!   (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_limit =
//!   2000)`, so vacuum keeps pace with the prune. Freed space is reused by
//!   new claims; the table does not need to shrink. Long-running
//!   transactions anywhere on the server hold vacuum back (and make each
//!   dead index entry a heap visit): keep them short;
//! - **the batch**: larger batches cost fewer round trips but hold more row
//!   and advisory locks per transaction (the lock table is shared:
//!   `max_locks_per_transaction` × connections); the ledger caps a
//!   transaction at 500 rows whatever the batch.
//!
//! **Why not time partitions** (one partition per day, dropped instead of
//! deleted)? Because the claim is one atomic `INSERT … ON CONFLICT (key)`
//! decided by a unique index on `key` alone, and PostgreSQL cannot have one
//! on a partitioned table whose partition key is anything but `key`: a
//! unique or primary key constraint on a partitioned table must include
//! every partition key column, because each partition's index enforces
//! uniqueness only within that partition (PostgreSQL docs, "Table
//! Partitioning", limitations). Partitioned by `created_at` or
//! `retain_until`, the unique key would have to be `(key, created_at)`; a
//! key claimed again later (a redelivery after the first record moved to
//! an older partition, or simply with a later `created_at`) would not
//! conflict with its earlier record, so two claims of one effect would both
//! insert and both acquire: the effect would run twice. (PostgreSQL 15
//! refuses `PRIMARY KEY (key)` on a table partitioned by `created_at`, and
//! with `(key, created_at)` the same key inserts once per timestamp.) A
//! completion also rewrites `retain_until`, which would move the row
//! between partitions. Partitioning by a hash of `key` keeps the unique
//! key, but expired rows are then spread over every partition and there is
//! nothing to drop. Batched deletes on the expiry index keep the one
//! atomic claim.
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
//!    again (at most 8 runs per operation, the third and later after a
//!    short pause). Fenced writes carry the check in their `WHERE`; only when one
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
//! (the watermark per tenant and kind), the `<table>_beyond` and
//! `<table>_current` functions (the claim's horizon check and its read of a
//! record committed while it waited, which need a snapshot taken after the
//! key's lock) and a
//! `<table>_migrations` table. [`PgLedger::migrate`] applies the embedded
//! migrations under a transaction-scoped advisory lock, so concurrent
//! processes can run it at once, and checks the result before it commits.
//! A table created by someone else is checked before anything is added to
//! it.
//!
//! Schema version 3 adds one nullable column, `claim_token` (`bytea`, the
//! claim token of "Replication and failover"): PostgreSQL records it in the
//! catalog without rewriting or scanning the table, under a brief `ACCESS
//! EXCLUSIVE` lock that waits for the transactions using the table (a
//! long `claim_in` transaction delays it, and claims queue behind it
//! meanwhile). Rows written before it have no token (nothing resolves
//! their claims' lost answers, which are long settled). A process of the
//! previous release keeps working on a migrated table: it never writes the
//! column, and a row it takes over keeps the token, which then no longer
//! matches the row (a token ends with the id of the transaction that wrote
//! it, and that version of the row is gone), so a claim of this release
//! resolving a lost answer never takes that lease for its own. A ledger opened without migrations
//! ([`PgLedgerOptions::migrate`]`(false)`) on a table of version 2 is
//! refused with [`Error::Config`] saying that `claim_token` is missing and
//! to run `oncely migrate`.
//!
//! Schema version 4 adds another nullable column, `watched` (`boolean`, the
//! waiter's mark of "Waiting duplicates"), the same way. A process of the
//! previous release keeps working beside it: it never marks a record and
//! announces every completion, so its waiters are announced to only by
//! its own kind, and are woken by their fallback (at most
//! [`oncely::backend::NOTIFIED_FALLBACK`]) when this release completes the
//! effect. The mark rewrites the row, so it ties a claim token that matched
//! the version before to the version it writes: the holder has not changed.
//!
//! Schema version 5 adds the function `<table>_current(text[])`, the
//! claim's read of a record committed after its statement's snapshot (while
//! it waited on the key's lock); it changes no table. A process of the previous release never calls it, so the two
//! work side by side; this release refuses a table of version 4 opened
//! without migrations, naming the function and `oncely migrate`.
//!
//! [`Access::Existing`]: oncely::open::Access::Existing
//! [`Access::Migrate`]: oncely::open::Access::Migrate
//! [`Access::ReadOnly`]: oncely::open::Access::ReadOnly
//! [`Claim::Completed`]: oncely::backend::Claim::Completed
//! [`Claim::InProgress`]: oncely::backend::Claim::InProgress
//! [`Claim::Acquired`]: oncely::backend::Claim::Acquired
//! [`ClaimOptions::sent_at`]: oncely::ClaimOptions::sent_at
//! [`ClaimOptions::relaxed_claim`]: field@oncely::ClaimOptions::relaxed_claim
//! [`Error::Backend`]: oncely::Error::Backend
//! [`Error::BeyondHorizon`]: oncely::Error::BeyondHorizon
//! [`Error::Config`]: oncely::Error::Config
//! [`Error::LeaseLost`]: oncely::Error::LeaseLost
//! [`Error::OutcomeUnknown`]: oncely::Error::OutcomeUnknown
//! [`Error::ConstraintViolation`]: oncely::Error::ConstraintViolation
//! [`Error::Unavailable`]: oncely::Error::Unavailable
//! [`FromUrl`]: oncely::open::FromUrl
//! [`Ledger::abandoned`]: oncely::backend::Ledger::abandoned
//! [`Ledger::get`]: oncely::backend::Ledger::get
//! [`Ledger::horizon`]: oncely::backend::Ledger::horizon
//! [`Ledger::unique_violation`]: oncely::backend::Ledger::unique_violation
//! [`TransactionalLedger`]: oncely::backend::TransactionalLedger

// The guide links to the crate's items by name, as the crate docs did.
#[allow(unused_imports)]
use crate::*;
