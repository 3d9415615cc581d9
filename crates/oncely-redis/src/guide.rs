//! # oncely-redis: the guide
//!
//! What [the crate docs](crate) leave out of their first screen: the
//! guarantees and limits, and how it works.
//!
//! ## Opening
//!
//! [`RedisLedger::connect`] (default options) and
//! [`RedisLedger::connect_with`] (with [`RedisLedgerOptions`]) take a URL:
//!
//! - `redis://host:port[/db]`: one server;
//! - `redis+cluster://h1:p1,h2:p2[?…]`: a Redis Cluster, through any of the
//!   listed nodes (each `host:port` or `redis://host:port`); the client
//!   learns the rest of the topology. Credentials on the first node
//!   (`redis+cluster://user:pw@h1:7000,h2:7000`) apply to the nodes that
//!   carry none, and a query string applies to every node. A comma inside
//!   credentials is written `%2C`.
//! - `redis+sentinel://s1:p1,s2:p2/master[/db][?…]`: the primary that the
//!   listed Sentinels (port 26379 when none is given) name for `master`,
//!   followed when they promote another (see Replication). The credentials
//!   (`redis+sentinel://user:pw@s1,s2/mymaster`), the database and the
//!   query are the primary's; the Sentinels are asked without credentials,
//!   so Sentinels that require a password are not supported yet.
//!
//! Some query parameters are the ledger's own, taken out before the redis
//! client sees the URL: `ephemeral=true` (or `false`) accepts a server that
//! persists nothing, as [`RedisLedgerOptions::ephemeral`] does (see
//! Durability); `wait_replicas=n` and `wait_timeout_ms=t` set
//! [`RedisLedgerOptions::wait_replicas`] (`t` defaults to the option's
//! timeout, else 1000; `wait_replicas=0` turns it off; see Replication).
//! They win over the options. The others go to the client.
//!
//! A malformed URL, or a comma in a `redis://` host (pointing to
//! `redis+cluster://`), is [`Error::Config`] before anything connects, and
//! no message quotes the URL (it may hold a password).
//!
//! The URL names the whole ledger, key prefix included, so that the
//! application and the `oncely` command open the same one:
//!
//! | URL part | what it sets |
//! | --- | --- |
//! | `redis://user:password@host:port/db` | one server, and its database number |
//! | `redis+cluster://user:password@h1:p1,h2:p2,…` | a cluster's seed nodes |
//! | `redis+sentinel://user:password@s1:p1,s2:p2,…/master/db` | the Sentinels, the master name they monitor, the primary's credentials and database |
//! | `?wait_replicas=1&wait_timeout_ms=500` | [`RedisLedgerOptions::wait_replicas`] |
//! | `?prefix=billing:` | [`RedisLedgerOptions::prefix`] (default `oncely:`; `%XX` escapes for what a query cannot hold) |
//! | `?protocol=resp3` | the redis client's own parameter, handed to it (every node of a cluster) |
//! | any other parameter (`?prefx=x`) | refused: [`Error::Config`] naming it and the accepted ones, before anything connects |
//!
//! [`RedisLedger::connect_with`] reads `?prefix=` too, over its options'.
//! A ledger's [`Display`](std::fmt::Display) says what it reads (`redis
//! 10.0.0.5:6379/0, prefix billing:`; `redis sentinel
//! 10.0.0.1:26379,10.0.0.2:26379 master mymaster/0, prefix oncely:`),
//! never a credential.
//!
//! Connecting checks the server's role (`ROLE`, else `INFO replication`):
//! a replica refuses every write with `READONLY`, so a ledger that writes is
//! refused there with [`Error::Config`] (pointing to the primary and to
//! `redis+sentinel://`) instead of connecting and failing every claim; a
//! read-only ledger opens a replica and reads what it has.
//!
//! [`RedisLedger`] implements [`FromUrl`](oncely::open::FromUrl) with the
//! schemes `redis`, `redis+cluster` and `redis+sentinel`, the one way a tool opens any backend
//! from a URL. Redis has no tables or buckets: there is nothing to create
//! or migrate, so [`Access::Migrate`](oncely::open::Access::Migrate),
//! [`Access::Existing`](oncely::open::Access::Existing) and
//! [`Access::ReadOnly`](oncely::open::Access::ReadOnly) all open the same
//! way. A read-only ledger ([`RedisLedgerOptions::read_only`]) refuses every
//! write (claim, complete, release, renew, prune) with [`Error::Config`]
//! before any round trip, as the SQL backends' read-only ledgers do.
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | atomic claim | one Lua script per operation (create, take over an expired lease, or answer with the record); `EVALSHA`, loaded on `NOSCRIPT` |
//! | caller's transaction | no: Redis cannot join a SQL transaction |
//! | durability | as the server is configured, read on every master at connect (`appendonly`, `appendfsync`, `save`; `INFO persistence` where `CONFIG` is not allowed) and reported by the weakest in [`Capabilities::durability`](oncely::backend::Capabilities::durability): `appendfsync always` loses nothing acknowledged on a crash, `everysec` up to about 1 s, snapshots only everything since the last one. A server that persists nothing (`--save "" --appendonly no`) is refused with [`Error::Config`] unless accepted (`?ephemeral=true`, [`RedisLedgerOptions::ephemeral`]); a read-only ledger is never refused for it. A failover can lose acknowledged writes whatever the setting (see below) |
//! | replication | asynchronous: a claim returns before any replica has it ([`Capabilities::replicated`](oncely::backend::Capabilities) is `false`), unless [`RedisLedgerOptions::wait_replicas`]: then a lease write counts only once that many replicas acknowledged it (`WAIT`), and `replicated` is `true`; `WAIT` is not consensus (see Replication) |
//! | failover | `redis+sentinel://`: the ledger and its notification subscriber follow the primary Sentinel promotes; a `redis://` ledger does not (its writes fail with `READONLY`, retryable, until it is pointed elsewhere) |
//! | role | checked at connect: a writing ledger is refused on a replica |
//! | clock | the Redis server's `TIME`, read inside each script, so at the moment its write takes effect (per master in a cluster; each record lives on one master) |
//! | fences | the server's clock in µs at the grant, or the previous fence + 1 if higher ([`next_fence`](oncely::backend::next_fence)): never repeated for a key, prunes included, as long as a master's clock never steps back by more than the shortest retention in use (or a failover promotes a replica whose clock is that far behind) |
//! | expiry | none: records carry no TTL, and only [`prune`](oncely::backend::Ledger::prune) deletes them, so **prune must be scheduled** (see Records) |
//! | horizon | a watermark per tenant and kind that prune raises before it deletes; one server: read atomically with the claim; a cluster: read after the claim's insert, one more round trip for a claim with `sent_at` that inserts, and checked again before anyone takes over a record whose claim may not have finished that check (see Horizon) |
//! | max key | [`oncely::backend::MAX_KEY_BYTES`] bytes of effect key, plus the prefix and a 19-byte hash tag |
//! | max outcome | [`oncely::backend::MAX_OUTCOME_BYTES`] bytes, stored in the record's hash |
//! | cluster | yes: each operation on a record touches exactly one key, so one slot |
//! | operator view | not offered: this crate does not implement [`oncely::admin::Admin`] (listing and counting records by tenant and kind, `forget`, a prune dry run): records are hashes under hashed keys with no secondary index, so it would scan the keyspace. `oncely inspect`, `resolve` and tenant-scoped `abandoned` work; the other operator commands say they are not available here |
//!
//! ## Records
//!
//! Each record is one Redis hash at `<prefix>{<tag>}:<tenant>/<kind>:<subject>`
//! (prefix `oncely:` by default). `<tag>` is the first 16 hex digits of the
//! BLAKE3 hash of the effect key. Redis Cluster hashes only the first
//! `{…}` section of a key, so the slot of a record depends on that hash alone:
//! a subject that contains braces (`{a}[b]`, or `}` on its own) cannot end a
//! tag early or pin many records to one slot, and keys spread evenly across
//! masters whatever the subjects look like. The key stays readable in
//! `redis-cli` and `SCAN MATCH '<prefix>{*}:<tenant>/*'` finds a tenant's records.
//!
//! The hash's field `v` is the record format, now `2`: a claim writes only
//! the fields it cannot leave implied (state, fence, creation time, lease
//! expiry, retention; the fingerprint and the at-most-once mark only when
//! set; on a cluster, a claim's `sent_at` until its horizon check is known
//! to have passed, see Horizon), because every field written costs server
//! time on every claim. `src/lua/prelude.lua` lists them; format 1 records
//! are read as well.
//!
//! No record carries a TTL. [`prune`](oncely::backend::Ledger::prune) is the one path
//! that deletes records, because a deletion must raise the horizon first
//! (a record that Redis expired by itself would vanish without a trace, and
//! a late replay of its message would run the effect again). **Schedule
//! `prune`** (for example every few minutes, with a limit): without it the
//! completed and released records stay in Redis's memory for good. Prune
//! deletes completed and released records past their retention, walking
//! the keyspace of every master with `SCAN` (a few script calls per
//! candidate: an operator job, not a hot path). A lease in progress is never
//! pruned, and neither is an abandoned at-most-once step: both stay until
//! they are resolved, as the contract requires. Records written by earlier
//! versions of this crate carry a TTL; the first prune that visits one
//! removes it (one that expires before that leaves the horizon unraised).
//!
//! [`abandoned`](oncely::backend::Ledger::abandoned) also walks every master with
//! `SCAN MATCH` on the tenant's prefix and reads each match, so its cost grows
//! with the size of the keyspace, not with the number of abandoned steps. Run
//! it from reconciliation jobs, not per request. A resharding in progress
//! while it runs may hide a record from one listing.
//!
//! ## Horizon
//!
//! The horizon of a tenant and kind ([`Ledger::horizon`]) is a plain string
//! key, `<prefix>{<tag>}#horizon:<tenant>/<kind>`
//! ([`RedisLedger::horizon_key`]), holding the microseconds of the newest
//! creation time among the records prune deleted there. It has no TTL and is
//! never deleted (one small key per tenant and kind). Prune raises it (never
//! lowers it) before it deletes those records; a record that stops being due
//! between the raise and the delete (taken over) is kept, and leaves the
//! watermark a little ahead, on the safe side. A claim with
//! [`ClaimOptions::sent_at`] that finds its key absent fails with
//! [`Error::BeyondHorizon`] if `sent_at` is at or before the watermark
//! ([`is_beyond_horizon`]). On one server the claim script reads the
//! watermark in the same atomic step as its insert. In a cluster the
//! watermark lives in another slot, so a claim that inserted reads it
//! afterwards and, past the horizon, deletes its own insert again (only if
//! it is still exactly the record it wrote) before failing: one more round
//! trip for a claim with `sent_at` that inserts, two for one that turns out
//! to be beyond the horizon. Such a claim runs to completion even if the
//! caller drops its future.
//!
//! A cluster claim's check can still fail to finish: the worker stops between
//! the insert and the check, the claim's reply is lost after the server
//! applied the insert (a response timeout, a dropped connection), or the
//! delete cannot reach the server (logged as an error). Its record then stays
//! in progress until its lease ends. So that nobody takes it over unchecked,
//! the record carries the claim's `sent_at` (field `hz`) until its lease
//! holder first writes: renew, complete and release clear it in their own
//! script, at no extra round trip. Whoever would take over an expired record
//! that still carries it first checks again, with the watermark of that
//! moment (which has only risen since): if the message is beyond it, the
//! record is deleted (only if it is still exactly that record) and the key is
//! claimed as absent, so a replay with `sent_at` is refused and a claim
//! without it starts afresh, with a fence above the deleted record's;
//! otherwise the mark is cleared (fenced the same way) and the takeover goes
//! on. That costs the takeover three more round trips (the watermark, the
//! delete or clear, the claim script again). An at-most-once record in that
//! state is never taken over anyway: it reads as abandoned, for
//! reconciliation. What is left is narrow: a claim that passed its check and
//! whose holder then stopped before its first renewal or completion, while
//! prune raised the watermark above its `sent_at` (by deleting a newer record
//! of the same tenant and kind), loses its record at the takeover: replays of
//! its message are then refused instead of resuming the effect, which may
//! have run in part. On one server none of this applies: records carry no
//! mark.
//!
//! A claim without `sent_at` cannot be told from new work: if its record
//! was pruned, it acquires and runs the effect again. Pass the message's
//! production time wherever the broker gives one.
//!
//! ## Durability: what the server configuration gives
//!
//! [`RedisLedger::connect`] reads `CONFIG GET appendonly`, `appendfsync` and
//! `save` on every master, and reports what the weakest keeps in
//! [`Capabilities::durability`](oncely::backend::Capabilities::durability) (what
//! `oncely migrate` prints). Where `CONFIG` is renamed or not allowed
//! (managed services), `INFO persistence` tells whether AOF is on, not its
//! fsync policy nor the snapshots; where neither answers, the durability
//! is "unknown". Those cases, and snapshots only, are accepted with a
//! warning in the log.
//!
//! - `appendonly no` and no `save` points (how this project's test servers
//!   run): nothing survives a restart. A restart forgets every claim, every
//!   outcome and every horizon, and redeliveries then run their effects
//!   again. Such a server is refused with [`Error::Config`] unless the
//!   ledger accepts it: `?ephemeral=true` in the URL (the way for the
//!   `oncely` command: `oncely demo --database-url
//!   'redis://127.0.0.1:6379?ephemeral=true'`) or
//!   [`RedisLedgerOptions::ephemeral`]`(true)`, for tests and throwaway
//!   servers. A read-only ledger ([`RedisLedgerOptions::read_only`], the
//!   `oncely` commands that only read) opens it without: it writes nothing,
//!   and durability says what the server keeps.
//! - `save` points and `appendonly no` (RDB snapshots only): a crash or a
//!   restart loses every write since the last snapshot, minutes of claims
//!   and completions.
//! - `appendonly yes` with `appendfsync everysec` (the default once AOF is
//!   on): a crash can lose about the last second of acknowledged claims and
//!   completions (two when the disk is slow, as Redis then delays its
//!   write). `appendfsync no` writes each command to the file before the
//!   reply but leaves the flush to the OS: a crash of Redis alone loses
//!   nothing, an OS crash or a power loss what the OS had not written
//!   (typically up to 30 s). `appendfsync always` fsyncs each write before
//!   the reply; then a single node loses nothing it acknowledged, at a
//!   large cost in latency.
//! - Replication is asynchronous, and a failover (Sentinel, or a Cluster
//!   replica promoted) can lose what the old primary acknowledged but had
//!   not yet replicated, whatever its `appendfsync`: the primary's own disk
//!   is not read again. [`RedisLedgerOptions::wait_replicas`] acknowledges a
//!   lease write only once replicas have it; what that does and does not
//!   promise is in Replication below. The durability reported is the
//!   primaries' only; the replicas' settings are not read.
//! - Eviction: the server must run `maxmemory-policy noeviction`. Under
//!   `allkeys-*` Redis may evict a live lease, an abandoned step, a
//!   completed record before its retention ends (a redelivery would run the
//!   effect again) or a horizon watermark. `volatile-*` evicts only keys with
//!   a TTL, which this crate no longer sets, but records written by earlier
//!   versions carry one until prune removes it, and a policy that evicts is
//!   one setting away from evicting everything, so it is refused as well.
//!   [`RedisLedger::connect`] reads `CONFIG GET maxmemory-policy` on every
//!   master and refuses any other policy unless
//!   [`RedisLedgerOptions::require_noeviction`] is turned off; where `CONFIG`
//!   is not allowed (managed services) it logs a warning and goes on.
//!
//! ## Replication: Sentinel and `WAIT`
//!
//! **Following the primary.** A `redis+sentinel://` ledger asks the
//! Sentinels for the primary of its master name (they check it with
//! `ROLE`, and so does the ledger on its own connection), and sends every
//! request there. A request that meets what a failover looks like from a
//! client (`READONLY` from a demoted primary, `MASTERDOWN`, a connection
//! refused, dropped or timed out) makes the ledger ask the Sentinels
//! again, one discovery at a time and at most one every 200 ms per ledger;
//! when they name another primary, it connects there
//! ([`RedisLedger::primary`] says which, and how many times it moved). That
//! request is sent again on the new primary only when the old one cannot
//! have applied it (`READONLY`, `MASTERDOWN`, refused); one that timed out
//! or lost its connection may have been applied, and its caller gets the
//! error, retryable, as on a single server (a completion's becomes
//! [`Error::OutcomeUnknown`](oncely::Error::OutcomeUnknown) in
//! [`Effects::run`](oncely::Effects::run)). The change-notification
//! subscriber asks the Sentinels each time it subscribes, so once its
//! connection to the old primary is lost (or stops answering its `PING`s,
//! within 5 s), it subscribes on the new one. During the failover itself
//! (Sentinel's `down-after-milliseconds` plus the election) operations fail
//! with [`Error::Unavailable`] or a retryable [`Error::Backend`]; a frozen
//! primary costs each request its response timeout, never a hang.
//!
//! **What a failover loses without `WAIT`.** The tests make it visible on
//! purpose (`tests/failover.rs`: the replica's replication link held back,
//! then the primary killed or frozen): everything the primary acknowledged
//! while the link was held is gone after the promotion. A lost completion:
//! the next delivery finds the key absent (or its lease in progress, then
//! expired) and runs the effect again, at a higher fence. A lost claim: a
//! holder still running its handler has a duplicate granted beside it (two
//! holders at once); the old holder's completion is then refused by its
//! fence ([`Error::LeaseLost`](oncely::Error::LeaseLost)). A lost raise of
//! the horizon lets a replay of a pruned message run again. Provider-keyed
//! steps stay safe (the provider deduplicates by
//! [`Lease::provider_key`](oncely::backend::Lease::provider_key)); at-most-once steps
//! may be sent twice.
//!
//! **[`RedisLedgerOptions::wait_replicas`]`(n, timeout)`** sends
//! `WAIT n timeout` after each lease write, pipelined with it on the same
//! connection (one round trip; `WAIT` counts what the connection wrote, so
//! a reconnect in between would count nothing), and counts the write only
//! if `n` replicas acknowledged it: a claim short of them is not granted
//! (given back, [`Error::Unavailable`], no handler runs); a completion,
//! release or renewal short of them fails with a retryable
//! [`Error::Backend`] (a completion's is an unknown outcome to the runner);
//! a duplicate is answered from a completed or abandoned record only once
//! `n` replicas have it (the claim writes the record's key field to itself
//! so that its `WAIT` covers a record another connection wrote). On a
//! cluster the `WAIT` goes to the master of the record's slot. In the
//! failover tests, with `wait_replicas(1, …)` no acknowledged completion
//! was lost and no two holders overlapped: what the primary applied during
//! the held link was never acknowledged.
//!
//! **What `WAIT` still does not promise.** It is not consensus:
//!
//! - it counts replicas that *received* the write, not replicas that will
//!   be promoted: Sentinel may promote one that did not acknowledge it (with
//!   two replicas and `n = 1`, the one that acknowledged may be the one that
//!   is lost, or rank below the other), and the write is gone. Ask for as
//!   many replicas as a failover may skip over, or rank them
//!   (`replica-priority`) so that Sentinel prefers the ones that keep up;
//! - a replica that received a write has it in memory: if it restarts
//!   before it is promoted, it has what its own persistence kept;
//! - a write `WAIT` found short was still applied on the primary and is not
//!   rolled back: it may survive the failover or not. The ledger reports
//!   it as not granted or not acknowledged, which is safe either way (an
//!   ungranted claim's lease ends unused, an unacknowledged completion is
//!   resolved by the next delivery);
//! - a primary cut off from its Sentinels but not from its clients keeps
//!   accepting writes until it learns it was demoted: with `WAIT`, the
//!   ledger acknowledges none of them once its replicas follow the new
//!   primary (they no longer acknowledge it), so what is lost is bounded by
//!   what was acknowledged before they moved; without it, set
//!   `min-replicas-to-write` on the server;
//! - after a failover the new primary needs `n` replicas of its own before
//!   anything is granted: with one replica and `n = 1`, nothing is until the
//!   old primary rejoins as a replica. Run `n + 1` replicas at least;
//! - prune, the horizon's raise and reads do not wait: a failover can undo a
//!   prune (the records come back, harmless) or a raise of the horizon (a
//!   replay of a pruned message may then run again, as without `WAIT`);
//! - each `WAIT` blocks the ledger's connection on the server until the
//!   replicas answer: throughput under concurrency drops (see the
//!   benchmarks), and a replica that falls behind delays every write up to
//!   the timeout.
//!
//! Where a lost write is not acceptable at all, use a consensus-replicated
//! backend (oncely-nats with R=3) or PostgreSQL with a synchronous standby.
//!
//! ## Waiting
//!
//! A duplicate run with [`oncely::OnInProgress::Wait`] that finds the effect
//! in progress takes a watch ([`oncely::backend::Ledger::watch`]) and is woken when
//! the holder completes or releases it, instead of polling. Two paths:
//!
//! - in this process, the ledger (and its clones) wakes the key's watches
//!   itself after each of its own completions and releases, with no round
//!   trip;
//! - across processes, a claim that would wait marks the record with its
//!   ledger's random mark (field `w`, written by the same claim script, so
//!   no extra round trip), and the completion or release of a marked record
//!   by another ledger `PUBLISH`es the effect key on
//!   `<prefix>#changes@<db>` inside the same script. Each ledger holds one
//!   subscription to that channel (one more connection per ledger, shared by
//!   its clones, not one per waiter) and relays what it receives to its
//!   waiters.
//!
//! A completion nobody waits for publishes nothing: a `PUBLISH` on every
//! completion cost about 8 µs of server CPU per claim + complete with one
//! subscriber, a quarter more. A wake-up is a hint: the waiter claims again
//! and answers from the record, so a lost message (the subscription down,
//! a user whose ACL forbids the channel, a publish that failed) costs
//! latency, at most [`oncely::backend::NOTIFIED_FALLBACK`] and never beyond the
//! holder's lease, never a wrong answer. While the subscription is down,
//! watches poll (5 ms doubling to 250 ms) and it reconnects in the
//! background. [`RedisLedger::is_subscribed`] says whether it is up and
//! [`RedisLedger::notifications_relayed`] counts what it relayed;
//! [`RedisLedgerOptions::notifications`] turns it off, and a read-only
//! ledger never subscribes. A lease that simply expires is not announced:
//! its waiters look again when it ends.
//!
//! ## Batches
//!
//! [`RedisLedger::claim_many`] and [`RedisLedger::complete_many`] (the
//! [`oncely::backend::Ledger`] batch operations) run the claim or completion script
//! once per slot over all the batch's records in that slot, one after the
//! other inside the script: on one server the whole batch is one script call
//! and one round trip; on a cluster, one call per slot, pipelined per master,
//! the masters in parallel. Each record keeps every rule of the single
//! operation (the same Lua code runs for it), so a batch answers exactly
//! what single claims in the same order would; a key listed twice acquires
//! once and finds itself in progress the second time. On a cluster, keys
//! claimed with `sent_at` are checked against their horizon after their
//! inserts, as a single claim is, and that batch runs as a task of its own
//! so a dropped future never leaves an unchecked insert behind. Invalid
//! options fail the whole `claim_many` before any round trip; everything
//! else is answered per key.
//!
//! ## Errors and cancellation
//!
//! A refused or dropped connection is [`Error::Unavailable`] (fail closed:
//! [`Effects::run`](oncely::Effects::run) does not run the handler); a timeout
//! or a cluster in transition (`TRYAGAIN`, `CLUSTERDOWN`, `LOADING`) or a
//! primary demoted under a `redis://` ledger (`READONLY`) is
//! [`Error::Backend`] with `retryable: true`. `MOVED` and `ASK` are followed by
//! the cluster client. A key holding something oncely did not write (a
//! string, a foreign hash) is [`Error::Corrupt`] and is never overwritten;
//! so is a horizon key that does not hold a number.
//!
//! Each operation is one script, and Redis runs a script entirely or not at
//! all, so a dropped future never leaves a half-applied change. A claim whose
//! future was dropped may still have been applied on the server: the key is
//! then in progress until the lease expires and is taken over afterwards (or
//! reported abandoned, for an at-most-once step), as the contract allows.
//! A cluster claim with `sent_at` (insert, horizon check, take-back) runs
//! as a task of its own: a dropped future does not stop it halfway. A
//! claim that checks a marked record again (read the watermark, delete the
//! record or clear its mark, claim again) needs none: each step leaves the
//! record as it was or settled, and the next claim carries on from there.
//! Metrics and spans of claims are recorded by oncely's runners, not here.
//!
//! ## Where things are
//!
//! `ledger.rs` holds [`RedisLedger`]: its constructors and each ledger
//! operation, one script call on the record's key. `options.rs`: the options
//! and the URL forms. `lua.rs` and `lua/*.lua`: the scripts and the
//! arguments of each call. `reply.rs`: decoding the server's replies into
//! records, leases and claims (what the SQL backends call `row.rs`; fields
//! are read by name). `keys.rs`: the keys of records and watermarks and the
//! `SCAN` pattern. `horizon.rs`: prune's raise-then-delete and the cluster
//! claim's check after its insert. `notify.rs`: the change-notification
//! subscription and the relay that wakes waiters. `conn.rs`: one connection over a server,
//! a cluster or a Sentinel primary, the role check, a write and its `WAIT`,
//! and the walk over every master. `sentinel.rs`: finding the primary
//! through Sentinel and following it. `error.rs`: driver errors
//! mapped to [`oncely::Error`].
//!
//! [`Error::Backend`]: oncely::Error::Backend
//! [`Error::BeyondHorizon`]: oncely::Error::BeyondHorizon
//! [`Error::Config`]: oncely::Error::Config
//! [`Error::Corrupt`]: oncely::Error::Corrupt
//! [`Error::Unavailable`]: oncely::Error::Unavailable
//! [`ClaimOptions::sent_at`]: oncely::ClaimOptions::sent_at
//! [`Ledger::horizon`]: oncely::backend::Ledger::horizon
//! [`is_beyond_horizon`]: oncely::backend::is_beyond_horizon

// The guide links to the crate's items by name, as the crate docs did.
#[allow(unused_imports)]
use crate::*;
