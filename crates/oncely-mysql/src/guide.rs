//! # oncely-mysql: the guide
//!
//! What [the crate docs](crate) leave out of their first screen: the
//! guarantees and limits, and how it works.
//!
//! ## URL forms
//!
//! The URL names the whole ledger, table included, so that the application
//! and the `oncely` command open the same one:
//!
//! | URL part | what it sets |
//! | --- | --- |
//! | `mysql://` or `mariadb://` `user:password@host:port/database` | the server, and the database the ledger's tables live in (MySQL's schema: there is no separate `?schema=`) |
//! | `user:password@host1:port1,host2:port2,host3:port3/database` | a host list (a Galera cluster's nodes; sqlx alone refuses it): the ledger connects to one that will do and moves to another when it goes away. See "Host lists and failover". An empty entry (`h1,,h2`), a bad host or port, or `?socket=` with a list: [`oncely::Error::Config`] before anything connects |
//! | `?table=effects` | [`MySqlLedgerOptions::table`] (default [`DEFAULT_TABLE`]); its horizon table is `<table>_horizon`, its outbox `<table>_outbox` |
//! | `?ssl-mode=`, `?charset=`, `?socket=`, `?timezone=` … | sqlx's own parameters, handed to it |
//! | any other parameter (`?tabel=x`, `?schema=x`) | refused: [`oncely::Error::Config`] naming it and the accepted ones, before anything connects |
//!
//! [`MySqlLedger::connect_with`] reads `?table=` too, over its options'. A
//! ledger's [`Display`](std::fmt::Display) says what it reads (`mysql
//! db:3306/billing, table effects`), never the password.
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | URL | `mysql://user:password@host:port/database[?table=T]` or `mariadb://…`, one host or a list (`h1:3306,h2:3306,…`), with sqlx's parameters (`ssl-mode`, …): [`MySqlLedger::connect`], or [`FromUrl`](oncely::open::FromUrl) with an [`Access`](oncely::open::Access) and a connect timeout (the pool's acquire timeout). See "URL forms" |
//! | operation timeout | every operation on the pool (claims, completions, reads, each prune batch, `begin`) answers within [`MySqlLedgerOptions::operation_timeout`] (10 s by default), or fails with [`oncely::Error::Unavailable`] and closes its connection: a frozen server is a bounded, typed error. A completion or release whose answer was lost re-reads its row, within three timeouts in all. Not `claim_in` / `complete_in` (the caller's connection) nor `migrate` |
//! | new connections | each is checked before the pool hands it out: a Galera node synced in the primary component; for a ledger that writes, a server that is not read-only (`@@read_only`, `@@super_read_only`, `@@innodb_read_only`). See "Host lists and failover" |
//! | atomic claim | a plain read of the key first (a duplicate is answered by it: no lock, no write); then, for an absent, released or expired key only, one `INSERT … ON DUPLICATE KEY UPDATE` on the primary key, which decides again on its own: the insert, or the takeover of an expired lease or a released record, in the same statement |
//! | caller's transaction | yes: [`TransactionalLedger`](oncely::backend::TransactionalLedger) on `&mut` [`MySqlConnection`]; a concurrent duplicate blocks on the row lock until the first commits. When several wait on one that rolls back, InnoDB may make one of them a deadlock victim (each held a share lock on the duplicate): a retryable [`oncely::Error::Backend`]; redo the transaction |
//! | durability | what the server's InnoDB settings give (`innodb_flush_log_at_trx_commit = 1`: committed claims survive a crash); on a MariaDB Galera node, also every other node of the primary component (a write returns once the cluster certified it): see "Galera" |
//! | replication | MariaDB Galera: detected when the ledger connects (at its first operation for one made with `from_pool`; `@@wsrep_on`, [`Capabilities::replicated`](oncely::backend::Capabilities)), one ledger per node, claims through any node: see "Galera". Otherwise none before a claim returns (asynchronous replicas lag: claim on the primary only). Statements read `SYSDATE()`: use row-based or mixed binary logging, not `binlog_format = STATEMENT` |
//! | clock | the database server's, read when each write takes effect (after any lock wait): `UTC_TIMESTAMP(6)` plus the time elapsed since, measured with `SYSDATE(6)`, independent of the session time zone (see below). A server started with `--sysdate-is-now` is refused. On Galera, each write's node's clock: node clocks must differ by less than the runner's safety margin (see "Galera") |
//! | fences | the server clock's µs at the grant, or the previous fence + 1, whichever is higher ([`oncely::backend::next_fence`]): never repeated for a key, prunes included (one caveat below) |
//! | horizon | a watermark per tenant and kind in `<table>_horizon`, raised by `prune` in the transaction that deletes; a claim with `sent_at` at or before it fails with `BeyondHorizon` when its key is absent. A claim without `sent_at` cannot be told from new work |
//! | schema | checked on connect (every mode) and after `migrate`: columns and types, a primary key or unique index on exactly `effect_key`, binary collations on `effect_key`, `tenant`, `kind`, InnoDB; the same for the horizon table and the outbox table (schema version 3), which must exist; anything else is [`oncely::Error::Config`] naming the table and the problem |
//! | read-only | [`MySqlLedgerOptions::read_only`]: no migration, read-only sessions; `get`, `abandoned` and `horizon` work for a user with `SELECT` on the ledger's three tables (the schema check reads the outbox's too) |
//! | transactional outbox | [`oncely::outbox`] on `<table>_outbox`: [`enqueue_in`](oncely::outbox::TransactionalOutbox::enqueue_in) is one `INSERT … ON DUPLICATE KEY UPDATE` in the caller's transaction (a key that names a message already writes nothing, and only that conflict is taken for one: see "The outbox"). A relay's claim is a short READ COMMITTED transaction: `SELECT … ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED` of the oldest pending message of each ordering key (due, not under a live lease), the lease and fence granted by an `UPDATE`, the rows read back, commit. Marks, retries and failures are fenced on (id, fence) and on the message being pending; each runs on the pool like the ledger's writes (retried on a deadlock or a Galera certification conflict, the commit's included; guarded against a leaked transaction) |
//! | max key | 255 bytes (`VARCHAR(255)` utf8mb4, `utf8mb4_bin`) |
//! | max outcome | 64 KiB ([`oncely::backend::MAX_OUTCOME_BYTES`]), lower if the server's `max_allowed_packet` is smaller; see [`MySqlLedger::max_outcome_bytes`] |
//! | operator view | [`oncely::admin::Admin`]: `records` and `stats` read at one clock reading (a `LIMIT`ed derived table, never merged), scoped by a range of the primary key (`tenant/`, `tenant/kind:`), then sorted by `created_us`; `forget` is one guarded, fenced `UPDATE` run on the pool like every write (completed at that fence → released, outcome removed, row kept) |
//! | round trips per claim | a duplicate (completed, in progress, abandoned, another fingerprint): 1, a plain read. A new key, or a takeover: 2 on MariaDB 10.5+ (the read, then the statement with `RETURNING`), 3 on MySQL 8 (then a locking read of the row). Rare paths cost more: 2 more for a fresh grant whose statement waited on a lock (its refresh), up to 3 more for a claim refused by the horizon. `claim_in` skips the read (1 on MariaDB, 2 on MySQL 8). See "A duplicate is a read" |
//! | batches | `claim_many`: one plain read of every key, then one statement for the keys that need a write (MySQL 8: and its read-back; with `sent_at`: one more read, of the watermarks), per 500 distinct keys; `complete_many`: one `UPDATE` per 500 leases (one more read when some lease was lost). Every key answered as its own claim would be. See "Batches" |
//! | waiting duplicates | in-process: a duplicate waiting on a lease this ledger granted is woken the moment that lease is completed or released here (an [`oncely::backend::Notifier`]). Across processes (and for leases claimed with `claim_in`, whose commit the ledger does not see) waiters poll: 5 ms, doubling up to 250 ms. See "Waiting" |
//! | leaked-transaction guard | MariaDB (`@@in_transaction`); not on MySQL 8 |
//! | pool size | default 10; the conformance race (64 claimants) uses 70. MariaDB's default `max_connections` is 151 |
//!
//! ## Galera
//!
//! On a MariaDB Galera cluster, open one ledger per node (or one per
//! process, each on its node): claims of one key through different nodes
//! at the same instant still have one winner, every multi-node case of the
//! conformance suite passes (`tests/galera.rs`, on a three-node cluster of
//! `scripts/galera-cluster.sh`), and so does a node killed with `SIGKILL`
//! mid-run (`tests/galera_faults.rs`). Or open one ledger on the cluster's
//! host list, which moves to another node when its own leaves (see "Host
//! lists and failover"). The ledger finds out at the first
//! operation (`@@wsrep_on`) and says so in
//! [`Capabilities`](oncely::backend::Capabilities) (`replicated`, `durability`).
//! What the cluster changes, and what the ledger does about it:
//!
//! - **Certification decides, at commit.** Each node runs a statement on
//!   its own copy and the cluster certifies the written rows in one total
//!   order: of two nodes' claims of one key, the second to certify fails
//!   with 1213 (SQLSTATE 40001), for an autocommit `INSERT … RETURNING`
//!   *after* its row was sent. The ledger reads every result to its end (a
//!   claim that stopped at the first row would take the rolled-back insert
//!   for a grant, and leave the error on the pooled connection), takes 1213
//!   from any statement as a conflict, and claims again at once, without a
//!   pause: its first read then answers from the winner's row.
//! - **Reads are causal.** A node applies other nodes' write sets a few
//!   milliseconds after they commit. Every read of the ledger's tables
//!   (the claim's first read, `get`, the horizon, the operator's view) runs
//!   as `SET STATEMENT wsrep_sync_wait = 1 FOR …`: it first applies what the
//!   cluster committed before it began, so a duplicate right after another
//!   node's completion is answered with the outcome, and a waiter's poll
//!   sees it. Measured on three nodes on one machine: about 23 µs more per
//!   read at the median (64 µs plain, 87 µs causal: one round of the
//!   group's messages); per delivery
//!   within the noise of the same runs, and under `Reject` about half as
//!   many duplicates on another node turned away as "in progress" (the
//!   repository's docs/benchmarks.md, "Galera").
//! - **Transactions begin causally.** MariaDB skips the causal wait for
//!   every statement inside a transaction, so the ledger begins its
//!   transactions, and the caller's from [`MySqlLedger::begin`], as
//!   `SET STATEMENT wsrep_sync_wait = 1 FOR START TRANSACTION`: the node
//!   first applies what the cluster committed, and a `complete_in` in a
//!   transaction on another node than the claim's sees the lease (without
//!   it, about one completion in 60 was refused as "lease lost", and some
//!   commits failed certification; conformance case
//!   `nodes_complete_in_on_another_node`). A transaction begun on a
//!   connection of your own is not causal.
//! - **Fenced writes through another node.** A lease granted through node
//!   A may be completed, renewed or released through node B before B has
//!   applied the grant. A fenced write that matches no row costs nothing
//!   more on the usual path; on a miss the ledger asks with a causal read,
//!   and if the lease is live after all it writes again, instead of
//!   answering `LeaseLost` to the real holder. `complete_many` completes
//!   its missed leases one by one for the same reason.
//! - **No cluster-wide locks.** `GET_LOCK` (taken by migrations only) and
//!   the locking reads (`SELECT … FOR UPDATE` of the MySQL 8 read-back,
//!   `LOCK IN SHARE MODE` of the horizon check, prune's candidates) lock on
//!   one node: Galera replicates no read locks. Nothing relies on them
//!   across nodes: a claim and a prune of one key both write its row, so
//!   certification fails one of them; migrations run their idempotent steps
//!   again on a conflict (three processes migrating through three nodes at
//!   once is tested).
//! - **A node that leaves.** A node outside the primary component
//!   (partitioned, joining, shut down) answers writes with 1047 ("WSREP has
//!   not yet prepared node"), a `COMMIT` under way as it leaves with 1180
//!   ("Not connected to Primary Component": rolled back), and a causal read
//!   with 1205 once
//!   `repl.causal_read_timeout` has passed (30 s by default): all are
//!   [`oncely::Error::Unavailable`] (1205 is told from a lock wait by
//!   `wsrep_ready`). A ledger on one node's URL stays on that node (and
//!   refuses new connections to it until it is synced again): give it the
//!   cluster's host list (`mysql://app@n1:3306,n2:3306,n3:3306/app`) and
//!   it moves to another node by itself (see "Host lists and failover");
//!   or move the work on `Unavailable` (a broker's redelivery to a worker
//!   on another node), or connect through a Galera-aware proxy. A write
//!   the cluster acknowledged survives the loss of the node it went
//!   through; the survivors carry on once the cluster has evicted the dead
//!   node (`evs.suspect_timeout`, 5 s by default), and a lease its
//!   claimants held expires like any other.
//! - **The caller's transaction.** `claim_in` works on a Galera node; a
//!   duplicate claimed in a transaction on another node does not wait on
//!   the row lock as on one server: one of the two transactions fails at
//!   its `COMMIT` with 1213, a retryable [`oncely::Error::Backend`]: redo
//!   it.
//! - **Clocks.** Each node judges expiry on its own clock, when the write
//!   takes effect. If node B's clock runs `S` ahead of node A's, B takes
//!   over a lease granted through A `S` early (tested with node 3 under
//!   `faketime` 8 s ahead). The runner stops its handler at its own
//!   deadline, the lease less its safety margin (a quarter of the lease by
//!   default), measured on the worker's monotonic clock from when it sent
//!   the claim, so **leases stay exclusive while every two nodes' clocks
//!   differ by less than the safety margin** (7.5 s for the default 30 s
//!   lease; NTP keeps them within milliseconds). Fences need no bound while
//!   a record exists (a takeover's fence is above the previous one,
//!   whichever clock wrote it); a record pruned and claimed again gets the
//!   inserting node's clock as its fence, which stays above the old ones
//!   while the clocks differ by less than the retention (7 days by
//!   default).
//! - **Settings.** `binlog_format = ROW` and `innodb_autoinc_lock_mode = 2`
//!   (Galera's own requirements); leave `wsrep_sync_wait` as it is (the
//!   ledger sets it per statement) and `wsrep_retry_autocommit` at its
//!   default. The ledger's reads are causal on MariaDB only (they use
//!   `SET STATEMENT`); on a MySQL-based Galera (Percona XtraDB Cluster) it
//!   logs a warning and a duplicate may be answered from a read a few
//!   milliseconds behind.
//!
//! ## Host lists and failover
//!
//! A URL may list several hosts: `mysql://app@n1:3306,n2:3306,n3:3306/app`
//! (each `host:port`, `[v6]:port`, or a host with the default port; one
//! user, password, database and set of parameters for all). The ledger
//! probes them all at once and connects to the first that will do:
//!
//! - a **Galera node** must serve: `wsrep_ready = ON`,
//!   `wsrep_cluster_status = Primary`, `wsrep_local_state_comment =
//!   Synced`. A joiner, a donor (`Donor/Desynced`) or a node cut off from
//!   the primary component is refused, for now ([`oncely::Error::Unavailable`]
//!   when no host will do: it may serve again once synced);
//! - a ledger that **writes** refuses a **read-only** server (`@@read_only`,
//!   `@@super_read_only`, `@@innodb_read_only`: a replica), instead of
//!   failing later in a write. With every host read-only that is
//!   [`oncely::Error::Config`], saying so per host. A
//!   [read-only](MySqlLedgerOptions::read_only) ledger may read there.
//!
//! Every new connection of the pool is checked the same way (one `SHOW`
//! round trip in `after_connect`, one host's URL included). When an
//! operation finds its server gone (a connection error, 1047 "WSREP has not
//! yet prepared node", 1053 "server shutdown", no answer within
//! [`MySqlLedgerOptions::operation_timeout`]) or a new connection is
//! refused, the ledger suspects its host: connections opened before are
//! closed instead of handed out, and one background search probes every
//! host (for up to two minutes) and points the pool at the first that will
//! do; operations from then on run there. The operation that found the
//! fault still fails (`Unavailable`; the runner's caller redelivers). A
//! completion or release whose answer was lost that way (the connection
//! died while its statement committed, or timed out) is not guessed: the
//! ledger reads the key's row again on a new connection (on Galera a
//! causal read, which sees every write the cluster certified): completed
//! (released) at the lease's fence means it was applied; still in progress
//! at that fence, it runs the fenced write again; anything else is
//! `LeaseLost`. Only when the row cannot be read within two more operation
//! timeouts (on Galera the survivors' reads stall until the cluster has
//! evicted the lost node) does it fail (`Unavailable`, which the runner
//! reports as `OutcomeUnknown`): a completion or release answers within
//! three operation timeouts.
//!
//! Tested on the three-node cluster (`tests/galera_hosts.rs`): eight workers
//! run `Effects::run` over 1,500 keys through one host-list ledger, and the
//! node it is connected to is killed with `SIGKILL` (or frozen with
//! `SIGSTOP`) mid-run. The ledger moved to another node by itself; no key
//! had two holders at once, no acknowledged completion was lost, no handler
//! ran again after its completion was acknowledged, every key finished, and
//! no call took longer than its bound. With the same run on one node's URL
//! (how every ledger connected before host lists), 962 of the 1,500 keys
//! never finished. A frozen node is the costlier fault: the cluster's
//! writes stall until it is evicted (`evs.suspect_timeout`), and calls in
//! flight on it fail at the operation timeout. `tests/galera.rs` runs the
//! conformance suites through host lists too.
//!
//! The design is that of oncely-postgres' host lists (which also follow
//! `target_session_attrs` and re-point a listener); the two are separate
//! implementations for now.
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
//! ## A duplicate is a read
//!
//! InnoDB locks every existing row an `INSERT` finds: a shared lock for a
//! plain `INSERT`, `INSERT IGNORE` or an `INSERT … SELECT … WHERE NOT
//! EXISTS` (whose read is a locking read at REPEATABLE READ, and which takes
//! gap locks that make two concurrent inserts of a new key deadlock), an
//! exclusive one for `ON DUPLICATE KEY UPDATE`, even when it changes
//! nothing; and the statement gets a transaction id. Only a plain `SELECT`
//! reads a row without either. So a claim on the pool reads the key first:
//! a completed effect, a live lease, an abandoned step or a fingerprint
//! mismatch is answered from that read (by the kit's rules,
//! [`oncely::backend::answer_existing`]), and a duplicate takes no lock,
//! writes nothing, and never holds up the holder's `complete`. Only when the
//! read leaves a write to do (the key is absent, released, or its lease
//! ended) does the claim run its statement, which checks everything again
//! in the same atomic step: the read decides nothing that is written. A
//! read that is stale by the time the statement runs costs nothing either:
//! the statement answers as it finds the row.
//!
//! The price is one more round trip for a new key (the read finds nothing;
//! a prepared statement cannot both insert and report an existing row
//! without locking it). Over a job's deliveries (one new, at least one
//! duplicate) it evens out, and a duplicate's plain read is cheaper for the
//! server than the no-op `ON DUPLICATE KEY UPDATE` it replaces (one indexed
//! read, against an insert attempt that evaluates the whole update clause).
//!
//! `claim_in` does not read first: inside the caller's transaction a plain
//! read comes from its snapshot, which may be older than the record. It
//! runs the statement, and a concurrent duplicate waits on the row lock, as
//! the transactional mode means it to.
//!
//! ## Waiting
//!
//! A duplicate that finds the effect in progress (with
//! [`OnInProgress::Wait`](oncely::OnInProgress::Wait)) takes a
//! [`Watch`](oncely::backend::Watch) from [`Ledger::watch`](oncely::backend::Ledger::watch).
//! If the lease is one this ledger (or a clone of it) granted on the pool
//! and has not seen end, the watch is notified: `complete`, `release` and
//! `complete_many` wake it as they return, and the runner claims again at
//! once. MySQL offers no change notification a pool could listen to
//! cheaply, so a lease held by another process (or another ledger in this
//! process, or claimed with `claim_in`) gets a polling watch (5 ms, doubling
//! up to 250 ms, never past the lease's end). A wake-up is only a hint: the
//! runner claims again and answers as that claim does, so a lost or early
//! wake-up costs latency, never a wrong answer. (A notified watch whose
//! notification never comes, because the holder lost its lease to another
//! process, still looks again after [`oncely::backend::NOTIFIED_FALLBACK`].)
//!
//! ## Batches
//!
//! [`Ledger::claim_many`](oncely::backend::Ledger::claim_many) reads every key in one
//! statement, answers the duplicates from it, and claims all the others in
//! one `INSERT … VALUES (…), (…) … ON DUPLICATE KEY UPDATE` (the single
//! claim's statement, one row per key, each with its own claim token),
//! sorted by key so that overlapping batches lock their common keys in the
//! same order. MariaDB returns one row per `VALUES` row; MySQL 8 reads them
//! back with one locking read. Each row is then judged exactly as a single
//! claim's (token, fence, horizon after the write, refresh after a lock
//! wait). With `sent_at`, the watermarks of the absent keys are read first
//! (one plain read), so a refused replay writes nothing; the check after the
//! write still decides. A key listed twice is claimed once and the later
//! listing answered like a concurrent duplicate. Keys whose row moved under
//! the batch are claimed on their own.
//!
//! [`Ledger::complete_many`](oncely::backend::Ledger::complete_many) is one `UPDATE`,
//! each row fenced by its own lease (`fence = CASE effect_key …`). When it
//! matches every lease, that is the answer; when some lease was lost, one
//! plain read tells which rows this statement completed (it writes its own
//! token into them). A second lease of a key already in the batch is
//! completed on its own afterwards.
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
//! ([`Ledger::horizon`](oncely::backend::Ledger::horizon) reads the watermark.) One window remains: on the
//! pool that fresh row has committed before it is deleted, so if the process
//! dies in between, it stays as an in-progress lease that the next claim
//! takes over once it expires (in `claim_in` the caller's rollback removes
//! it).
//!
//! ## The outbox
//!
//! Messages live in `<table>_outbox` (schema version 3): PostgreSQL's table
//! in this dialect (times in µs on the server's clock, the effect key as
//! `effect_key`, an `AUTO_INCREMENT` id whose order is the relay's order per
//! ordering key, `utf8mb4_bin` keys), with three indexes: `(state, id)` for
//! the claim's scan in id order, `(ordering_key, state, id)` for its "no
//! older pending message of this ordering key" test, `(state, sent_us)` for
//! prune.
//!
//! - **Enqueue** ([`TransactionalOutbox::enqueue_in`](oncely::outbox::TransactionalOutbox::enqueue_in))
//!   is `INSERT … ON DUPLICATE KEY UPDATE id = id + LAST_INSERT_ID(0)`: the
//!   update changes nothing and pins the OK packet's insert id to 0, so the
//!   new row's id tells a new message from one the key already names
//!   (committed, or enqueued earlier in the same transaction). The
//!   affected-row count cannot tell (`CLIENT_FOUND_ROWS`, above), and
//!   `INSERT IGNORE` would hide every other error (above). It sets the
//!   session's `LAST_INSERT_ID()`, as any insert into an `AUTO_INCREMENT`
//!   table does.
//! - **Claim** ([`Outbox::claim_messages`](oncely::outbox::Outbox::claim_messages)):
//!   a READ COMMITTED transaction (no gap locks: an enqueue never waits
//!   behind a claim) that locks the candidates with `FOR UPDATE SKIP LOCKED`
//!   (rows another relay's claim holds are passed over; the row's own
//!   conditions are judged on its latest version, on the clock when read),
//!   grants each a lease on the server's clock and a fence above its last
//!   one and the clock's µs ([`oncely::backend::next_fence`]), reads them
//!   back and commits. The ordering-key test is a plain read (a locking
//!   clause does not reach a subquery): a message another claim holds still
//!   holds back its successors. MariaDB 10.5 has no `SKIP LOCKED`: there
//!   the claim locks with plain `FOR UPDATE` and waits for another relay's
//!   claim to commit, then judges the row again (claims take turns; the
//!   answers are the same). On Galera, two nodes' claims of one message
//!   both lock it locally, and the second to commit fails certification
//!   (1213): the claim runs again and finds the first one's lease.
//! - **Marks** are fenced on (id, fence, pending): one ticket is one
//!   guarded autocommit `UPDATE`, as the ledger's completions (a miss on a
//!   Galera node asks a causal read whether the claim, made through another
//!   node, is there yet); several are one transaction that locks the
//!   messages still pending at their tickets' fences, then marks them, so
//!   each ticket's answer is exact.
//! - **Prune** ([`Outbox::prune_sent`](oncely::outbox::Outbox::prune_sent))
//!   deletes in batches of 500: a plain read of the oldest sent messages
//!   (on the statement's clock, which can bound an index range where
//!   `SYSDATE()` cannot), then a `DELETE` of them that checks again.
//!
//! ## Schema, migrations, read-only
//!
//! [`MySqlLedger::connect`] creates and upgrades the tables (versions are
//! recorded in `oncely_schema_migrations`; version 2 adds the horizon table
//! to a table of the first release, version 3 the outbox table
//! `<table>_outbox` and its indexes; neither changes the ledger table). `CREATE TABLE IF NOT EXISTS` would
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
//! leak, but do not share its pool with code that might (a claim's first
//! read there would come from the stray transaction's snapshot, and could
//! answer an old state of a duplicate; its writes still check the row).

// The guide links to the crate's items by name, as the crate docs did.
#[allow(unused_imports)]
use crate::*;
