//! # oncely-sqlite: the guide
//!
//! What [the crate docs](crate) leave out of their first screen: the
//! guarantees and limits, and how it works.
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
//! Your own statements use [sqlx](https://docs.rs/sqlx) directly, on the
//! transaction's connection (this crate re-exports only
//! [`SqliteConnection`], the type `claim_in` takes); [`map_error`] maps
//! their errors the way the ledger maps its own.
//!
//! ```no_run
//! use oncely::backend::{Claim, Outcome, TransactionalLedger};
//! use oncely::{ClaimOptions, EffectKey, Tenant};
//! use oncely_sqlite::SqliteLedger;
//!
//! # async fn demo(ledger: SqliteLedger) -> oncely::Result<()> {
//! let key = EffectKey::new(&Tenant::global(), "ship", "order-123")?;
//! let mut tx = ledger.begin().await?;
//! match ledger.claim_in(&mut *tx, &key, &ClaimOptions::default()).await? {
//!     Claim::Acquired(lease) => {
//!         sqlx::query("INSERT INTO shipments (order_id) VALUES (?1)")
//!             .bind("order-123")
//!             .execute(&mut *tx)
//!             .await
//!             .map_err(oncely_sqlite::map_error)?;
//!         ledger.complete_in(&mut *tx, &lease, &Outcome::from_json(&"shipped")?).await?;
//!         ledger.commit(tx).await?;
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
//! [`SqliteLedgerOptions::read_only`]`(true)` (SQLite's `mode=ro`: no file is
//! created, nothing is migrated, a mistyped path is an error naming it).
//! Deployments that migrate separately (`oncely migrate`) connect with
//! [`SqliteLedgerOptions::migrate`]`(false)`, which checks the tables and
//! changes nothing. Tests that want no file at all ask for it:
//!
//! ```no_run
//! use oncely_sqlite::{SqliteLedger, SqliteLedgerOptions};
//!
//! # async fn demo() -> oncely::Result<()> {
//! let reader = SqliteLedger::connect_with(
//!     "sqlite:data/app.db",
//!     SqliteLedgerOptions::default().read_only(true),
//! )
//! .await?;
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
//! A tool that picks the backend from a URL opens it through
//! [`FromUrl`](oncely::open::FromUrl) (scheme `sqlite`), with the access it
//! needs: [`Access::Migrate`](oncely::open::Access::Migrate) is `connect`,
//! `Existing` is `migrate(false)`, `ReadOnly` is `read_only(true)`.
//!
//! ### URL forms
//!
//! The URL names the whole ledger, table included, so that the application
//! and the `oncely` command open the same one:
//!
//! | URL part | what it sets |
//! | --- | --- |
//! | `sqlite:PATH`, `sqlite://PATH`, or a bare path | the database file (`sqlite::memory:` and an empty path only with [`SqliteLedgerOptions::ephemeral`]) |
//! | `?table=effects` | [`SqliteLedgerOptions::table`] (default `oncely_effects`); its horizon table is `<table>_horizon`, its outbox `<table>_outbox` |
//! | `?mode=ro\|rw\|rwc\|memory`, `?cache=`, `?immutable=`, `?vfs=` | SQLite's own parameters, handed to sqlx (`mode=ro`: read-only) |
//! | any other parameter (`?tabel=x`) | refused: [`oncely::Error::Config`] naming it and the accepted ones, before anything opens |
//!
//! [`SqliteLedger::connect_with`] reads `?table=` too, over its options'. A
//! ledger's [`Display`](std::fmt::Display) says what it reads (`sqlite
//! /srv/app/ledger.db, table effects`).
//!
//! ## Guarantees and limits
//!
//! | property | SQLite backend |
//! | --- | --- |
//! | atomic claim | one `INSERT … ON CONFLICT(key) DO UPDATE … WHERE <takeover> RETURNING` statement under SQLite's single-writer lock (insert if absent, or take over a released record or an expired lease). A new key costs that one statement; a duplicate costs a second one that reads the record, and claims again if the record changed in between (released, expired or pruned) |
//! | duplicates | a claim that finds the effect completed, or in progress under a live lease, writes nothing: no row changes, no WAL frame is appended (so there is nothing to fsync), `PRAGMA data_version` does not move. Its claim statement still takes the write lock for the moment it runs, as any `INSERT` does, so it queues behind other writers |
//! | waiting duplicates | woken when the holder completes or releases (including [`complete_many`](oncely::backend::Ledger::complete_many) and `complete_in`), if the holder is in the same process: the ledgers of a process on one file and table share an in-process notifier. SQLite cannot signal other processes, so a waiter whose holder is in another process looks again after [`NOTIFIED_FALLBACK`](oncely::backend::NOTIFIED_FALLBACK) (1 s) or at the end of the holder's lease, whichever comes first; several processes on one file should set [`SqliteLedgerOptions::multi_process`], which makes waiters poll (5 ms, doubling to 250 ms) instead. A wake-up is a hint: the waiter claims again and gets the answer from the record |
//! | batches | [`claim_many`](oncely::backend::Ledger::claim_many) and [`complete_many`](oncely::backend::Ledger::complete_many): one `BEGIN IMMEDIATE` transaction and one commit per batch (one fsync under `synchronous=FULL` instead of one per key). `claim_many` is one statement over the batch (a JSON array, so one prepared statement serves every size) applying the single claim's rules per key, plus one read of the keys it did not acquire; a key listed twice is acquired by its first slot and found in progress by the second. `complete_many` is one statement, each item fenced by its own lease. A batch that fails (busy past the timeout) fails every slot and writes nothing |
//! | caller's transaction | yes: `claim_in` / `complete_in` on `&mut SqliteConnection`, transaction from [`SqliteLedger::begin`] (`BEGIN IMMEDIATE`) |
//! | clock | SQLite's clock (`unixepoch('subsec')`, millisecond resolution) on the machine that opens the file, read once per statement *after* the statement holds the write lock: a claim that waited for another transaction is judged, and its lease measured, from the moment it writes. `acquired_at` is that moment |
//! | fences | the clock in microseconds on a first claim, `max(previous + 1, clock)` on a takeover ([`oncely::backend::next_fence`]): a key's fences only grow, across prune too, as long as the host's clock does not step back by more than the shortest retention in use. Not 1, 2, 3… |
//! | horizon | prune raises a watermark per tenant and kind (table `<table>_horizon`) to the newest `created_at` it deletes, in the same transaction as the delete. A claim with [`ClaimOptions::sent_at`](oncely::ClaimOptions::sent_at) at or before it, for an absent key, fails with [`Error::BeyondHorizon`]; a claim without `sent_at` cannot be told from new work |
//! | durability | WAL with `synchronous=FULL` by default: a completed record survives a process crash and a power loss once `complete` returns. `synchronous=NORMAL` ([`SqliteLedgerOptions::synchronous`]) is faster and survives process crashes, but a power loss may roll back the last commits, so an effect could run again. [`Capabilities::durability`](oncely::backend::Capabilities::durability) reports the journal mode and `synchronous` setting the database actually runs with, and says so when the file is on a memory file system. All of this holds for a file on a disk: on a memory file system (`tmpfs`, `ramfs`: `/dev/shm`, often `/tmp` and `/run`) every sync succeeds and a reboot, an OS crash or a power loss still loses the whole file |
//! | storage that does not survive | refused with [`Error::Config`]: `sqlite::memory:`, `mode=memory`, `vfs=memdb`, an empty path (`sqlite:`, `sqlite://`: a private temporary database per connection), and a file on a memory file system (the directory is checked with `statfs` before anything is created, and the file SQLite opened after, which catches symbolic links and `file:` URIs; Linux and Android only: elsewhere a RAM disk is not recognised). [`SqliteLedgerOptions::ephemeral`] accepts them: the in-memory forms as one in-memory database shared by the whole pool, reported as not durable; a file on a memory file system as that file, reported as lasting until the machine stops. A read-only ledger may open a file on a memory file system without it (it writes nothing) |
//! | schema | verified on connect and after [`SqliteLedger::migrate`]: the columns with their type affinities, a PRIMARY KEY or UNIQUE index on exactly `key`, BINARY collation on it, for the ledger table and for the outbox table; a table that fails is refused with [`Error::Config`] naming it and the problem. Versions are kept per table in `oncely_schema`: 1 the ledger table, 2 the horizon table, 3 the outbox table (`<table>_outbox` and its partial indexes). A file at a newer version than this crate knows is refused, so upgrade every process of a file before restarting an old one |
//! | transactional outbox | [`oncely::outbox`] on `<table>_outbox`: [`enqueue_in`](oncely::outbox::TransactionalOutbox::enqueue_in) is one `INSERT … ON CONFLICT(key) DO NOTHING RETURNING id` in the caller's `BEGIN IMMEDIATE` transaction (a key that names a message already writes nothing). A relay's claim is one `UPDATE … RETURNING` in a `BEGIN IMMEDIATE` transaction of its own: per ordering key, the oldest pending message, if it is due and not under a live lease, oldest first, leased on SQLite's clock with a fence of `max(previous + 1, clock µs)`. Marks are one statement over the batch's tickets, retries and failures one statement, each fenced on (id, fence) and on the message being pending; prune deletes in batches of 500. Ids are `AUTOINCREMENT`: never handed out again, prunes included |
//! | read-only | [`SqliteLedgerOptions::read_only`] opens the file with `mode=ro`: never creates it (a missing file is [`Error::Config`] naming the path), never migrates, verifies the schema, refuses writes |
//! | replication | none: one file on one machine (use the PostgreSQL backend across machines) |
//! | concurrency | many readers, one writer at a time; writers wait up to the busy timeout (5 s by default), then fail with a retryable `Error::Backend` |
//! | max key | [`oncely::backend::MAX_KEY_BYTES`] (255 bytes, stored whole as TEXT) |
//! | max outcome | [`oncely::backend::MAX_OUTCOME_BYTES`] (64 KiB, BLOB) |
//! | operator view | [`oncely::admin::Admin`]: `records` and `stats` read on one clock reading, scoped by a range of the key's primary index (`tenant/`, `tenant/kind:`; the key itself with a subject), then sorted by `created_at` (no index on it: a listing of a large tenant sorts its rows per page); `forget` is one fenced `UPDATE` (completed at that fence → released, outcome removed, row kept); `prunable` counts with the prune index |
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
//!
//! ## Where things are
//!
//! `options.rs`: [`SqliteLedgerOptions`] and the URL forms; `ledger.rs`:
//! [`SqliteLedger`], each operation one statement; `batch.rs`: batches of
//! claims and completions, one transaction each; `outbox.rs`: the
//! transactional outbox; `notify.rs`: wake-ups of
//! waiting duplicates; `sql/`: every statement, with why each clause is
//! there, beside the function that binds it and what decodes its rows, by
//! column name; `schema.rs`: migrations and the table check;
//! `durability.rs`: what the opened database
//! survives; `error.rs`: driver errors to [`Error`](oncely::Error).
//!
//! [`TransactionalLedger`]: oncely::backend::TransactionalLedger
//! [`Claim::Completed`]: oncely::backend::Claim::Completed
//! [`Error::BeyondHorizon`]: oncely::Error::BeyondHorizon
//! [`Error::Config`]: oncely::Error::Config
//! [`Error::Unavailable`]: oncely::Error::Unavailable
//! [`Error::Backend`]: oncely::Error::Backend
//! [`Error::ConstraintViolation`]: oncely::Error::ConstraintViolation

// The guide links to the crate's items by name, as the crate docs did.
#[allow(unused_imports)]
use crate::*;
