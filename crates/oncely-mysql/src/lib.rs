//! # oncely-mysql
//!
//! The MySQL 8 / MariaDB 10.5+ backend of [oncely]: an effect ledger in one
//! InnoDB table (plus a small horizon table), whose claims can also join the
//! caller's own transaction (`claim_in` / `complete_in`), so a business write
//! and its claim commit together.
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
//! ledger.commit(tx).await?;
//! # Ok(()) }
//! ```
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | URL | `mysql://user:password@host:port/database` or `mariadb://…`, with sqlx's parameters (`ssl-mode`, …): [`MySqlLedger::connect`], or [`FromUrl`](oncely::backend::FromUrl) with an [`Access`](oncely::backend::Access) and a connect timeout (the pool's acquire timeout) |
//! | atomic claim | one `INSERT … ON DUPLICATE KEY UPDATE` on the primary key; the takeover of an expired lease or a released record happens in the same statement |
//! | caller's transaction | yes: [`TransactionalLedger`](oncely::TransactionalLedger) on `&mut` [`MySqlConnection`]; a concurrent duplicate blocks on the row lock until the first commits. When several wait on one that rolls back, InnoDB may make one of them a deadlock victim (each held a share lock on the duplicate): a retryable [`oncely::Error::Backend`]; redo the transaction |
//! | durability | what the server's InnoDB settings give (`innodb_flush_log_at_trx_commit = 1`: committed claims survive a crash) |
//! | replication | none before a claim returns (asynchronous replicas may lag; Galera / group replication as configured). Statements read `SYSDATE()`: use row-based or mixed binary logging, not `binlog_format = STATEMENT` |
//! | clock | the database server's, read when each write takes effect (after any lock wait): `UTC_TIMESTAMP(6)` plus the time elapsed since, measured with `SYSDATE(6)`, independent of the session time zone (see below). A server started with `--sysdate-is-now` is refused |
//! | fences | the server clock's µs at the grant, or the previous fence + 1, whichever is higher ([`oncely::backend::next_fence`]): never repeated for a key, prunes included (one caveat below) |
//! | horizon | a watermark per tenant and kind in `<table>_horizon`, raised by `prune` in the transaction that deletes; a claim with `sent_at` at or before it fails with `BeyondHorizon` when its key is absent. A claim without `sent_at` cannot be told from new work |
//! | schema | checked on connect (every mode) and after `migrate`: columns and types, a primary key or unique index on exactly `effect_key`, binary collations on `effect_key`, `tenant`, `kind`, InnoDB; anything else is [`oncely::Error::Config`] naming the table and the problem |
//! | read-only | [`MySqlLedgerOptions::read_only`]: no migration, read-only sessions; `get`, `abandoned` and `horizon` work for a user with `SELECT` on the two tables |
//! | max key | 255 bytes (`VARCHAR(255)` utf8mb4, `utf8mb4_bin`) |
//! | max outcome | 64 KiB ([`oncely::MAX_OUTCOME_BYTES`]), lower if the server's `max_allowed_packet` is smaller; see [`MySqlLedger::max_outcome_bytes`] |
//! | round trips per claim | 1 on MariaDB 10.5+ (`RETURNING`), 2 on MySQL 8 (the statement, then a locking read of the row). Rare paths cost more: 2 more for a fresh grant whose statement waited on a lock (its refresh), up to 3 more for a claim refused by the horizon |
//! | leaked-transaction guard | MariaDB (`@@in_transaction`); not on MySQL 8 |
//! | pool size | default 10; the conformance race (64 claimants) uses 70. MariaDB's default `max_connections` is 151 |
//!
//! ## The clock, and a claim that waited
//!
//! MySQL's `NOW()` and `UTC_TIMESTAMP()` are the time the statement
//! *started*. A claim that waits on a lock (another transaction holds the
//! key) and judged expiry with them would take over a lease on a stale clock,
//! or be granted one that ended while it waited. So every expiry, takeover,
//! renewal and completion time is read when it is evaluated: the statement's
//! UTC start plus the elapsed time from `SYSDATE(6)`, which is in the session
//! time zone; the elapsed time is taken as the smaller of two measures so
//! that a daylight-saving change in the session's zone during a statement can
//! only make the clock read early, never late. The ledger does not change
//! the session time zone (its pool and transactions are also yours).
//!
//! One case no expression can fix: an `INSERT` computes a fresh row's values
//! before it waits on the key's lock (a transaction that inserted the same
//! key and later rolls back). The claim returns the clock read after its
//! write with the row, and a fresh grant whose statement waited (over a
//! second, or so long that less than half its lease was left)
//! is rewritten with a new expiry and fence from that clock before it is
//! returned; if the key was taken over meanwhile, the claim runs again. A
//! lease's `acquired_at` is always the clock after the write. A fresh grant
//! whose statement waited less than that keeps the statement's start as its
//! fence: that is below an earlier fence of the key only if the key was
//! claimed, completed *and pruned* during the wait, which takes a retention
//! under a second (and even then no stale holder can match the new fence).
//!
//! ## Why `ON DUPLICATE KEY UPDATE` and not `INSERT IGNORE`
//!
//! `INSERT IGNORE` turns *every* ignorable error of the statement into a
//! warning, not only the duplicate key: a truncated value, a NULL into a NOT
//! NULL column, a foreign key failure, a conflict on some other unique index
//! would all be "ignored" and look exactly like "the key already exists",
//! which is how effects silently get skipped. `ON DUPLICATE KEY UPDATE` keeps
//! strict-mode errors as errors, and it lets the same statement take over an
//! expired lease or a released record with no read-then-write gap. Its
//! update clause is a no-op unless the takeover condition holds (expired
//! non-at-most-once lease or released record, compatible fingerprint), and
//! it is also guarded by `effect_key = ?`: a conflict on any other unique
//! index (which ODKU would otherwise resolve by updating *that* row) changes
//! nothing and is reported as [`oncely::Error::Corrupt`], counted by
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
//! exactly when this attempt acquired the lease. A fresh insert writes the
//! statement's start as both its fence and its creation time, and every
//! takeover raises the fence above that, which tells the two apart.
//!
//! MariaDB accepts `RETURNING` on `INSERT … ON DUPLICATE KEY UPDATE` and
//! returns the row as the statement left it, inserted, updated or untouched
//! (checked on 10.11; should a server answer with a syntax error, the ledger
//! switches to the two-statement path for good). MySQL 8 has no `RETURNING`.
//!
//! ## The horizon
//!
//! `prune` deletes in batches; each batch is one transaction that locks the
//! watermark rows of the tenants and kinds it will delete from, raises each
//! to the newest `created_at` it deletes there, and deletes. A claim with
//! `sent_at` checks the watermark with a locking read before inserting (a
//! refused replay writes nothing), and again right after its write (in the
//! same statement on MariaDB, in the locking read-back on MySQL 8): if a
//! prune deleted the key while the insert waited on it, the claim deletes
//! its own fresh row and fails with `BeyondHorizon`. Neither read can be
//! fooled by a snapshot taken before a wait, at any isolation level.
//! ([`Ledger::horizon`](oncely::Ledger::horizon) reads the watermark.) One window remains: on the
//! pool that fresh row has committed before it is deleted, so if the process
//! dies in between, it stays as an in-progress lease that the next claim
//! takes over once it expires (in `claim_in` the caller's rollback removes
//! it).
//!
//! ## Schema, migrations, read-only
//!
//! [`MySqlLedger::connect`] creates and upgrades the tables (versions are
//! recorded in `oncely_schema_migrations`; version 2 adds the horizon table
//! to a table of the previous release). `CREATE TABLE IF NOT EXISTS` would
//! accept any table of that name, so the tables are checked against what the
//! ledger needs on connect, before a migration touches a table it did not
//! create, and after it. With [`MySqlLedgerOptions::migrate`]`(false)` or
//! [`MySqlLedgerOptions::read_only`]`(true)` nothing is created: a missing or
//! wrong table is [`oncely::Error::Config`].
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
#![deny(missing_docs)]

// Where things are: one concern per module.
mod claim; // the claim: its statement's forms, what its row means, the refresh after a lock wait, the horizon
mod error; // driver errors to oncely::Error, unique violations
mod guard; // running on the pool: one retry loop, the leaked-transaction guard
mod ledger; // MySqlLedger: constructors, Ledger, TransactionalLedger, FromUrl
mod options; // MySqlLedgerOptions, this backend's URLs
mod prune; // prune's batches: lock the watermarks, raise them, delete
mod row; // a stored row (read by column name) to Record
mod schema; // migrations and the check of the tables
mod server; // what the server supports, asked once
mod sql; // every statement

pub use crate::ledger::MySqlLedger;
pub use crate::options::{DEFAULT_TABLE, MySqlLedgerOptions};
/// The connection a caller's transaction runs on (`claim_in` /
/// `complete_in` take `&mut MySqlConnection`; pass `&mut *tx`).
pub use sqlx::MySqlConnection;
