//! # oncely-redis
//!
//! The Redis and Redis Cluster backend of [oncely]: an effect ledger
//! in which every operation (claim, complete, release, renew, get) is one Lua
//! script, so the check and the write are one atomic step on the server and
//! one round trip from the worker. Lease expiry, retention and fences are
//! decided by the server's clock (`redis.call('TIME')`, read inside the
//! script that writes), never by a worker's.
//!
//! ```no_run
//! use std::sync::Arc;
//! use oncely::{ClaimOptions, EffectKey, Effects, Tenant};
//! use oncely_redis::RedisLedger;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> oncely::Result<()> {
//! let ledger = RedisLedger::connect("redis://127.0.0.1:6379").await?;
//! // Or: RedisLedger::connect_cluster(&["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]).await?;
//! let effects = Effects::new(Arc::new(ledger));
//! let key = EffectKey::new(&Tenant::new("acme")?, "capture", "order-123")?;
//! let charge: String = effects
//!     .run(&key, &ClaimOptions::default(), |lease| async move {
//!         // Call the provider with lease.provider_key() as its idempotency key.
//!         Ok(format!("ch_{}", &lease.provider_key()[..8]))
//!     })
//!     .await?;
//! # let _ = charge; Ok(()) }
//! ```
//!
//! ## Guarantees and limits
//!
//! | | |
//! | --- | --- |
//! | atomic claim | one Lua script per operation (create, take over an expired lease, or answer with the record); `EVALSHA`, loaded on `NOSCRIPT` |
//! | caller's transaction | no: Redis cannot join a SQL transaction |
//! | durability | as the server is configured (see below); none at all with `--save "" --appendonly no` |
//! | replication | asynchronous: a claim returns before any replica has it ([`Capabilities::replicated`](oncely::Capabilities) is `false`) |
//! | clock | the Redis server's `TIME`, read inside each script, so at the moment its write takes effect (per master in a cluster; each record lives on one master) |
//! | fences | the server's clock in µs at the grant, or the previous fence + 1 if higher ([`next_fence`](oncely::backend::next_fence)): never repeated for a key, prunes included, as long as a master's clock never steps back by more than the shortest retention in use (or a failover promotes a replica whose clock is that far behind) |
//! | expiry | none: records carry no TTL, and only [`prune`](oncely::Ledger::prune) deletes them, so **prune must be scheduled** (see Records) |
//! | horizon | a watermark per tenant and kind that prune raises before it deletes; one server: read atomically with the claim; a cluster: read after the claim's insert, one more round trip for a claim with `sent_at` that inserts, and checked again before anyone takes over a record whose claim may not have finished that check (see Horizon) |
//! | max key | [`oncely::MAX_KEY_BYTES`] bytes of effect key, plus the prefix and a 19-byte hash tag |
//! | max outcome | [`oncely::MAX_OUTCOME_BYTES`] bytes, stored in the record's hash |
//! | cluster | yes: each operation on a record touches exactly one key, so one slot |
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
//! No record carries a TTL. [`prune`](oncely::Ledger::prune) is the one path
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
//! [`abandoned`](oncely::Ledger::abandoned) also walks every master with
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
//! - `appendonly no` and no snapshots (how this project's test server runs):
//!   nothing survives a restart. A restart forgets every claim, every
//!   outcome and every horizon, and redeliveries then run their effects again.
//! - `appendonly yes` with `appendfsync everysec`: a crash of the machine can
//!   lose about the last second of acknowledged claims and completions.
//!   `appendfsync always` fsyncs each write before the reply; then a single
//!   node loses nothing it acknowledged, at a large cost in latency.
//! - Replication is asynchronous. `WAIT numreplicas timeout` after a write
//!   tells you how many replicas have it, but it is not consensus: a failover
//!   can still promote a replica that missed the write, and Redis never
//!   rolls back a write that `WAIT` failed to replicate. This crate does not
//!   issue `WAIT`.
//! - A failover can lose what the old master acknowledged but had not yet
//!   replicated: a claim (and the next delivery acquires the key again), a
//!   completion (and the next delivery finds the lease, later takes it over
//!   and runs the effect again) or a raise of the horizon. Either way a
//!   duplicate effect is possible.
//!   Provider-keyed steps stay safe because the provider deduplicates by
//!   [`Lease::provider_key`](oncely::Lease::provider_key); at-most-once steps
//!   may be sent twice. Where that is not acceptable, use a consensus
//!   replicated backend (oncely-nats with R=3) or PostgreSQL.
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
//! ## Errors and cancellation
//!
//! A refused or dropped connection is [`Error::Unavailable`] (fail closed:
//! [`Effects::run`](oncely::Effects::run) does not run the handler); a timeout
//! or a cluster in transition (`TRYAGAIN`, `CLUSTERDOWN`, `LOADING`) is
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
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod conn;
mod error;
mod reply;

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime};

use oncely::backend::{
    answer_existing, check_outcome, duration_micros, from_micros, is_beyond_horizon, to_micros,
};
use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Lease, Ledger, Outcome, Record, RecordState, Result,
    Tenant,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::{Cmd, ErrorKind, Script, ServerErrorKind, Value};

use crate::conn::{Conn, Node};
use crate::error::{corrupt, map_err, unexpected};
use crate::reply::{array, int, policy_of, record, scan_page, tag, text, uint};

pub(crate) const BACKEND: &str = "redis";
const DEFAULT_PREFIX: &str = "oncely:";
/// The hash tag is this many hex digits of BLAKE3: 64 bits, so two keys
/// sharing a tag is as likely as any other slot collision and harmless.
const TAG_HEX: usize = 16;
const SCAN_COUNT: usize = 500;
/// What follows a horizon key's tag. A record key has `:` there, so neither
/// this ledger's `SCAN` patterns nor those of a ledger with another prefix
/// (prefixes cannot contain `{`) ever match a horizon key.
const HORIZON_INFIX: &str = "#horizon:";
/// How often a cluster claim tries to take back an insert that turned out to
/// be beyond the horizon, on retryable errors, before it gives up and logs.
const UNDO_ATTEMPTS: u32 = 4;
/// How many times one claim runs the claim script. It runs again only after
/// it found an unchecked record ([`RedisLedger::recheck`]) and removed it or
/// cleared its mark, which a second run no longer finds; more runs than two
/// take claimants racing on such a record, and this bound keeps a claim
/// from looping on one that keeps changing.
const CLAIM_ATTEMPTS: u32 = 4;

macro_rules! lua {
    ($file:literal) => {
        LazyLock::new(|| Script::new(concat!(include_str!("lua/prelude.lua"), include_str!($file))))
    };
}

static CLAIM: LazyLock<Script> = lua!("lua/claim.lua");
static FENCED: LazyLock<Script> = lua!("lua/fenced.lua");
static GET: LazyLock<Script> = lua!("lua/get.lua");
static PRUNE: LazyLock<Script> = lua!("lua/prune.lua");
static HORIZON: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/horizon.lua")));

/// Options of a [`RedisLedger`]. `RedisLedgerOptions::default()` gives the
/// prefix `oncely:`, a 2 s connection timeout, a 5 s response timeout and a
/// required `noeviction` policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisLedgerOptions {
    prefix: String,
    connection_timeout: Duration,
    response_timeout: Duration,
    require_noeviction: bool,
}

impl Default for RedisLedgerOptions {
    fn default() -> Self {
        RedisLedgerOptions {
            prefix: DEFAULT_PREFIX.to_owned(),
            connection_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(5),
            require_noeviction: true,
        }
    }
}

impl RedisLedgerOptions {
    /// Sets the key prefix (default `oncely:`): at most 64 printable ASCII
    /// characters, none of `{ } * ? [ ] \` (they would change the hash tag or
    /// the `SCAN` patterns). Checked when connecting.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the timeout of establishing a connection.
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// Sets how long one operation waits for the server's answer; a timeout
    /// is a retryable [`Error::Backend`] (the operation may still have been
    /// applied, exactly like a dropped future).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Whether connecting fails on a `maxmemory-policy` other than
    /// `noeviction` (default `true`). Turn it off only for a server whose
    /// memory can never fill up.
    pub fn require_noeviction(mut self, yes: bool) -> Self {
        self.require_noeviction = yes;
        self
    }

    fn check(&self) -> Result<()> {
        let ok = self.prefix.len() <= 64
            && self.prefix.bytes().all(|b| {
                b.is_ascii_graphic() && !matches!(b, b'{' | b'}' | b'*' | b'?' | b'[' | b']' | b'\\')
            });
        if !ok {
            return Err(Error::Config(format!(
                "redis key prefix {:?} must be at most 64 printable ASCII characters without {{ }} * ? [ ] \\",
                self.prefix
            )));
        }
        Ok(())
    }
}

/// An effect ledger on Redis or Redis Cluster. Cheap to clone: clones share
/// one multiplexed connection (single node) or one cluster connection.
#[derive(Clone)]
pub struct RedisLedger {
    conn: Conn,
    opts: Arc<RedisLedgerOptions>,
}

impl std::fmt::Debug for RedisLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match self.conn {
            Conn::Single(_) => "single",
            Conn::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisLedger")
            .field("mode", &mode)
            .field("opts", &self.opts)
            .finish()
    }
}

impl RedisLedger {
    /// Connects to one Redis server (`redis://host:port[/db]`,
    /// `rediss://` needs TLS features this crate does not enable).
    pub async fn connect(url: &str) -> Result<RedisLedger> {
        Self::connect_with(url, RedisLedgerOptions::default()).await
    }

    /// [`RedisLedger::connect`] with options.
    pub async fn connect_with(url: &str, opts: RedisLedgerOptions) -> Result<RedisLedger> {
        opts.check()?;
        let client = redis::Client::open(url).map_err(|e| Error::Config(format!("redis url: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(opts.connection_timeout))
            .set_response_timeout(Some(opts.response_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(map_err)?;
        Self::ready(Conn::Single(manager), opts).await
    }

    /// Connects to a Redis Cluster through any of its nodes
    /// (`redis://host:port` each); the client learns the rest of the
    /// topology and follows `MOVED` and `ASK` redirections.
    pub async fn connect_cluster(urls: &[&str]) -> Result<RedisLedger> {
        Self::connect_cluster_with(urls, RedisLedgerOptions::default()).await
    }

    /// [`RedisLedger::connect_cluster`] with options.
    pub async fn connect_cluster_with(urls: &[&str], opts: RedisLedgerOptions) -> Result<RedisLedger> {
        opts.check()?;
        if urls.is_empty() {
            return Err(Error::Config("redis cluster: no node urls".into()));
        }
        let client = ClusterClientBuilder::new(urls.to_vec())
            .connection_timeout(opts.connection_timeout)
            .response_timeout(opts.response_timeout)
            .retries(3)
            .build()
            .map_err(|e| Error::Config(format!("redis cluster urls: {e}")))?;
        let conn = client.get_async_connection().await.map_err(map_err)?;
        Self::ready(Conn::Cluster(conn), opts).await
    }

    async fn ready(mut conn: Conn, opts: RedisLedgerOptions) -> Result<RedisLedger> {
        for node in conn.masters().await.map_err(map_err)? {
            let reply = conn
                .on(
                    &node,
                    redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy").clone(),
                )
                .await;
            match reply.as_ref().map(policy_of) {
                Ok(Some(p)) if p == "noeviction" => {}
                Ok(Some(p)) if opts.require_noeviction => {
                    return Err(Error::Config(format!(
                        "redis maxmemory-policy is {p} on {node:?}: eviction can drop live leases or \
                         completed records; set noeviction (or RedisLedgerOptions::require_noeviction(false))"
                    )));
                }
                Ok(Some(p)) => tracing::warn!(policy = %p, "redis maxmemory-policy is not noeviction"),
                Ok(None) | Err(_) => {
                    tracing::warn!("cannot read redis maxmemory-policy; make sure it is noeviction")
                }
            }
        }
        Ok(RedisLedger {
            conn,
            opts: Arc::new(opts),
        })
    }

    /// The options in force.
    pub fn options(&self) -> &RedisLedgerOptions {
        &self.opts
    }

    /// The Redis key that holds `key`'s record:
    /// `<prefix>{<16 hex of BLAKE3(key)>}:<tenant>/<kind>:<subject>`.
    pub fn redis_key(&self, key: &EffectKey) -> String {
        record_key(&self.opts.prefix, key)
    }

    /// The Redis key that holds the horizon watermark of a tenant and kind:
    /// `<prefix>{<16 hex of BLAKE3(tenant/kind)>}#horizon:<tenant>/<kind>`,
    /// a string of the microseconds since 1970 of the newest creation time
    /// among the records prune deleted there.
    pub fn horizon_key(&self, tenant: &Tenant, kind: &str) -> String {
        horizon_key(&self.opts.prefix, tenant, kind)
    }

    /// Whether this ledger talks to a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }

    fn pattern(&self, rest: &str) -> String {
        format!("{}{{{}}}:{rest}", self.opts.prefix, "?".repeat(TAG_HEX))
    }

    /// One page of `SCAN` on one master.
    async fn page(
        &self,
        conn: &mut Conn,
        node: &Node,
        cursor: &str,
        pattern: &str,
    ) -> Result<(String, Vec<String>)> {
        let reply = conn
            .on(
                node,
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT)
                    .clone(),
            )
            .await
            .map_err(map_err)?;
        scan_page(reply)
    }

    /// Sends a script call built by [`evalsha`], loading the script first
    /// when the server does not have it (a restart, `SCRIPT FLUSH`, a new
    /// cluster node).
    async fn run(&self, script: &Script, cmd: &Cmd) -> Result<Value> {
        let mut conn = self.conn.clone();
        match cmd.query_async(&mut conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                script.load_async(&mut conn).await.map_err(map_err)?;
                cmd.query_async(&mut conn).await.map_err(map_err)
            }
            reply => reply.map_err(map_err),
        }
    }

    /// Runs fenced.lua: `op` on `key`'s record, only while it is in
    /// progress at `fence`; `args` are the operation's own (ARGV from 4 on).
    async fn fenced(&self, key: &EffectKey, fence: u64, op: &str, args: &[&[u8]]) -> Result<Vec<Value>> {
        let rkey = self.redis_key(key);
        let mut cmd = evalsha(&FENCED, &rkey, None);
        cmd.arg(key.as_str()).arg(fence).arg(op);
        for arg in args {
            cmd.arg(*arg);
        }
        let reply = self.run(&FENCED, &cmd).await?;
        let parts = array(reply)?;
        match tag(&parts)? {
            "ok" => Ok(parts),
            "lost" => Err(Error::LeaseLost {
                key: key.to_string(),
                fence,
            }),
            "corrupt" => Err(corrupt(&rkey, &parts)),
            other => Err(unexpected(other)),
        }
    }

    /// Reads a horizon watermark: `None` where nothing was ever pruned.
    async fn watermark(&self, hkey: &str) -> Result<Option<SystemTime>> {
        let bad = |what: String| Error::Corrupt {
            backend: BACKEND,
            message: format!("{hkey}: {what}"),
        };
        let mut conn = self.conn.clone();
        match redis::cmd("GET").arg(hkey).query_async::<Value>(&mut conn).await {
            Ok(Value::Nil) => Ok(None),
            Ok(v) => text(&v)
                .and_then(|s| s.parse::<i64>().ok())
                .map(|us| Some(from_micros(us)))
                .ok_or_else(|| bad(format!("horizon key holds {v:?}, not a watermark"))),
            Err(e) if e.code() == Some("WRONGTYPE") => {
                Err(bad("horizon key holds another type, not a watermark".into()))
            }
            Err(e) => Err(map_err(e)),
        }
    }

    /// The cluster half of the horizon check, for a claim with `sent_at`
    /// that inserted a new record: reads the watermark of the key's tenant
    /// and kind (another slot, so not in the claim's script) and, if the
    /// message is at or before it, takes the insert back and fails with
    /// [`Error::BeyondHorizon`]. A watermark that cannot be read takes the
    /// insert back too and fails with that error (fail closed: the
    /// redelivery claims again and checks again).
    ///
    /// Why this order cannot let a pruned effect run again: prune raises the
    /// watermark to at least a record's creation time and only *then*
    /// deletes the record (each step acknowledged before the next is sent).
    /// A replay's claim either runs its script before that delete, and
    /// finds the record (completed: the stored outcome, nothing runs), or
    /// after it; then the raise was acknowledged before the delete, the
    /// delete before the insert, and the insert before this read, so this
    /// read sees the raised watermark and refuses. Reading before the insert
    /// would leave a gap: prune could raise and delete between the read and
    /// the insert.
    ///
    /// A claim that never gets here (its reply lost, or its task gone) leaves
    /// its record marked with its `sent_at`, and so does one whose take-back
    /// fails; [`RedisLedger::recheck`] checks such a record again before
    /// anyone takes it over. A claim that passes leaves the mark too: its
    /// lease holder's first write clears it, at no extra round trip.
    async fn settle_horizon(&self, lease: Lease, hkey: &str, sent_us: i64) -> Result<Lease> {
        let watermark = self.watermark(hkey).await;
        if let Ok(w) = &watermark
            && !is_beyond_horizon(Some(from_micros(sent_us)), *w)
        {
            return Ok(lease);
        }
        self.undo(&lease, sent_us).await;
        match watermark {
            Ok(_) => Err(Error::BeyondHorizon {
                key: lease.key().to_string(),
            }),
            Err(e) => Err(e),
        }
    }

    /// One claim: the script, and on a cluster the horizon check after an
    /// insert ([`RedisLedger::settle_horizon`]). An expired record that the
    /// script will not take over before its creating claim's check is
    /// repeated ([`RedisLedger::recheck`]) is checked here, and the script
    /// sent again.
    async fn claim_once(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        // validate() refuses a sent_at outside 1970..9999; the conversion is
        // checked all the same, so nothing can wrap into another time.
        let sent_at = opts.sent_at.map(to_micros).transpose()?;
        let rkey = self.redis_key(key);
        let hkey = sent_at.map(|_| self.horizon_key(key.tenant(), key.kind()));
        // One server: the script reads the watermark with its insert.
        let in_script = hkey.as_deref().filter(|_| !self.is_cluster());
        // The fence of a record this claim removed: the key's next record
        // gets a higher one, whatever the clock says.
        let mut floor: Option<u64> = None;
        for _ in 0..CLAIM_ATTEMPTS {
            let mut cmd = evalsha(&CLAIM, &rkey, in_script);
            cmd.arg(key.as_str())
                .arg(duration_micros(opts.lease))
                .arg(duration_micros(opts.retention));
            match opts.fingerprint {
                Some(f) => cmd.arg(f.to_hex().as_str()),
                None => cmd.arg(""),
            };
            cmd.arg(if opts.at_most_once { "1" } else { "0" });
            match sent_at {
                Some(us) => cmd.arg(us),
                None => cmd.arg(""),
            };
            if let Some(f) = floor {
                cmd.arg(f);
            }
            let reply = self.run(&CLAIM, &cmd).await?;
            let parts = array(reply)?;
            return match tag(&parts)? {
                "acquired" => {
                    let lease = oncely::backend::Grant {
                        key: key.clone(),
                        fence: uint(parts.get(1))?,
                        expires_at: from_micros(int(parts.get(2))?),
                        first_claimed_at: from_micros(int(parts.get(3))?),
                        acquired_at: from_micros(int(parts.get(4))?),
                        taken_over: int(parts.get(5))? == 1,
                        at_most_once: opts.at_most_once,
                    }
                    .into_lease();
                    match (&hkey, sent_at) {
                        // A takeover found the record: the horizon is not its
                        // question (the contract checks absent keys only).
                        (Some(hkey), Some(us)) if in_script.is_none() && !lease.taken_over() => {
                            self.settle_horizon(lease, hkey, us).await.map(Claim::Acquired)
                        }
                        _ => Ok(Claim::Acquired(lease)),
                    }
                }
                "unchecked" => {
                    let fence = uint(parts.get(1))?;
                    let hz = parts.get(3).and_then(text).unwrap_or_default();
                    self.recheck(key, fence, int(parts.get(2))?, &hz).await?;
                    // Needed only if the record is gone when the script runs
                    // again, harmless otherwise (a takeover's fence is above
                    // the record's anyway).
                    floor = floor.max(Some(fence));
                    continue;
                }
                "in_progress" => Ok(Claim::InProgress {
                    fence: uint(parts.get(1))?,
                    expires_at: from_micros(int(parts.get(2))?),
                    first_claimed_at: from_micros(int(parts.get(3))?),
                    read_at: from_micros(int(parts.get(4))?),
                }),
                "record" => {
                    // The script decided; the kit's rule says what the record answers.
                    let r = record(&rkey, Some(key), &parts)?;
                    match answer_existing(key, opts, r)? {
                        Some(c @ (Claim::Completed(_) | Claim::Abandoned(_))) => Ok(c),
                        other => Err(unexpected(&format!("{other:?}"))),
                    }
                }
                "horizon" => Err(Error::BeyondHorizon { key: key.to_string() }),
                "mismatch" => Err(Error::FingerprintMismatch { key: key.to_string() }),
                // The third element names the horizon key when that is what is wrong.
                "corrupt" => match (&hkey, parts.get(2)) {
                    (Some(hkey), Some(_)) => Err(corrupt(hkey, &parts)),
                    _ => Err(corrupt(&rkey, &parts)),
                },
                other => Err(unexpected(other)),
            };
        }
        Err(Error::Backend {
            backend: BACKEND,
            message: format!(
                "{key}: claim gave up after {CLAIM_ATTEMPTS} attempts; its record kept changing while its \
                 horizon was checked again"
            ),
            retryable: true,
        })
    }

    /// Repeats the horizon check of the cluster claim that inserted `key`'s
    /// record, before anyone takes that expired record over: the record
    /// still carries the claim's `sent_at` (`hz`), so nobody knows that the
    /// check passed (the claim's reply may have been lost after the insert
    /// was applied, or its take-back may have failed). `fence`, `created`
    /// and `hz` are what the claim script found.
    ///
    /// Beyond the horizon, the record should never have existed: it is
    /// deleted, and the caller claims the key as absent (with its own
    /// `sent_at`, if it has one, checked like any insert's; a replay of the
    /// same message is refused). Otherwise its mark is cleared and the
    /// caller takes it over. Both writes are fenced on exactly that record
    /// (fenced.lua: in progress, its fence, creation time and mark), so one
    /// taken over meanwhile, or renewed by a holder that was only slow, is
    /// left alone, and the caller's next attempt answers for it.
    ///
    /// Why this keeps a pruned effect from running again: this read of the
    /// watermark follows the insert (the claim script found the record), so
    /// it sees at least what the inserting claim's own check would have
    /// seen, and [`RedisLedger::settle_horizon`]'s argument applies as is.
    /// A watermark that cannot be read fails the claim closed, with the
    /// record unchanged. An at-most-once record never gets here (it is
    /// never taken over: it reads as abandoned).
    async fn recheck(&self, key: &EffectKey, fence: u64, created: i64, hz: &str) -> Result<()> {
        let sent_us: i64 = hz.parse().map_err(|_| Error::Corrupt {
            backend: BACKEND,
            message: format!("{}: horizon mark {hz:?} is not a time", self.redis_key(key)),
        })?;
        let watermark = self
            .watermark(&self.horizon_key(key.tenant(), key.kind()))
            .await?;
        let beyond = is_beyond_horizon(Some(from_micros(sent_us)), watermark);
        let op = if beyond { "undo" } else { "checked" };
        let created = created.to_string();
        match self
            .fenced(key, fence, op, &[created.as_bytes(), hz.as_bytes()])
            .await
        {
            Ok(_) => {
                if beyond {
                    tracing::warn!(
                        effect_key = %key,
                        fence,
                        "removed a record whose claim was beyond the horizon and never finished its check"
                    );
                }
                Ok(())
            }
            Err(Error::LeaseLost { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Deletes the record a claim just inserted, if it is still exactly that
    /// record (fenced by the lease, its creation time and its mark, the
    /// claim's `sent_at`), retrying transient errors a few times. Failures
    /// are logged: the caller fails its claim either way, and the record
    /// left behind keeps its mark, so whoever would take it over checks the
    /// horizon again first ([`RedisLedger::recheck`]).
    async fn undo(&self, lease: &Lease, sent_us: i64) {
        let created = match to_micros(lease.first_claimed_at()) {
            Ok(us) => us.to_string(),
            Err(e) => {
                tracing::error!(key = %lease.key(), error = %e, "cannot take back a claim beyond the horizon");
                return;
            }
        };
        let hz = sent_us.to_string();
        let mut pause = Duration::from_millis(50);
        for attempt in 1..=UNDO_ATTEMPTS {
            match self
                .fenced(
                    lease.key(),
                    lease.fence(),
                    "undo",
                    &[created.as_bytes(), hz.as_bytes()],
                )
                .await
            {
                // Lost: no longer the record this claim wrote (taken over
                // after its lease ended), so nothing of ours to take back.
                Ok(_) | Err(Error::LeaseLost { .. }) => return,
                Err(e) if e.is_retryable() && attempt < UNDO_ATTEMPTS => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                Err(e) => {
                    tracing::error!(
                        key = %lease.key(),
                        fence = lease.fence(),
                        error = %e,
                        "cannot take back a claim beyond the horizon; its record stays in progress \
                         until its lease ends, and whoever would take it over then checks the horizon again"
                    );
                    return;
                }
            }
        }
    }

    /// Prunes what is due among one `SCAN` page's keys, at most `budget`
    /// records: first raises the horizon of each tenant and kind to the
    /// newest creation time it will delete there, then deletes (see
    /// [`RedisLedger::settle_horizon`] for why in this order). A raise that
    /// fails stops prune before it deletes anything of that page.
    async fn prune_page(&self, conn: &mut Conn, keys: Vec<String>, budget: u64) -> Result<u64> {
        // One check per key, all of a page at once: they share the
        // multiplexed connection, so they travel pipelined rather than one
        // round trip after another (prune visits every record).
        let mut checks = tokio::task::JoinSet::new();
        for rkey in keys {
            let mut conn = conn.clone();
            checks.spawn(async move {
                let reply: Value = PRUNE
                    .key(&rkey)
                    .arg("")
                    .arg("check")
                    .invoke_async(&mut conn)
                    .await
                    .map_err(map_err)?;
                Ok::<_, Error>((rkey, reply))
            });
        }
        let mut due = Vec::new();
        while let Some(done) = checks.join_next().await {
            let (rkey, reply) = done.map_err(|e| Error::Backend {
                backend: BACKEND,
                message: format!("prune check did not finish: {e}"),
                retryable: true,
            })??;
            let parts = array(reply)?;
            if tag(&parts)? != "due" {
                continue;
            }
            let stored = parts.get(1).and_then(text).unwrap_or_default();
            let created = int(parts.get(2))?;
            match EffectKey::parse(&stored) {
                Ok(key) if self.redis_key(&key) == rkey => due.push((rkey, key, created)),
                _ => tracing::warn!(key = %rkey, "record stored under another key; not pruned"),
            }
        }
        due.truncate(usize::try_from(budget).unwrap_or(usize::MAX));
        let mut marks: HashMap<(Tenant, String), i64> = HashMap::new();
        for (_, key, created) in &due {
            let mark = marks
                .entry((key.tenant().clone(), key.kind().to_owned()))
                .or_insert(*created);
            *mark = (*mark).max(*created);
        }
        for ((tenant, kind), mark) in &marks {
            let hkey = self.horizon_key(tenant, kind);
            let reply: Value = HORIZON
                .key(&hkey)
                .arg(*mark)
                .invoke_async(conn)
                .await
                .map_err(map_err)?;
            let parts = array(reply)?;
            match tag(&parts)? {
                "ok" => {}
                "corrupt" => return Err(corrupt(&hkey, &parts)),
                other => return Err(unexpected(other)),
            }
        }
        let mut deleted = 0;
        for (rkey, key, _) in &due {
            let mark = marks[&(key.tenant().clone(), key.kind().to_owned())];
            let reply: Value = PRUNE
                .key(rkey)
                .arg(key.as_str())
                .arg("delete")
                .arg(mark)
                .invoke_async(conn)
                .await
                .map_err(map_err)?;
            if tag(&array(reply)?)? == "deleted" {
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}

impl Ledger for RedisLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(
            "as the Redis server is configured: AOF with appendfsync always/everysec, or none",
            "Redis server TIME",
        )
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        if self.is_cluster() && opts.sent_at.is_some() {
            // A claim that inserts on a cluster writes, then reads the
            // watermark, then may take its insert back: it runs as a task of
            // its own, so a caller that drops its future (a timeout,
            // `select!`) never leaves the insert behind. Left behind, it
            // would be taken over after its lease like any abandoned claim,
            // with no horizon check, and the pruned effect would run again.
            let (ledger, key, opts) = (self.clone(), key.clone(), opts.clone());
            return tokio::spawn(async move { ledger.claim_once(&key, &opts).await })
                .await
                .map_err(|e| Error::Backend {
                    backend: BACKEND,
                    message: format!("claim did not finish: {e}"),
                    retryable: true,
                })?;
        }
        self.claim_once(key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, oncely::MAX_OUTCOME_BYTES)?;
        self.fenced(lease.key(), lease.fence(), "complete", &[outcome.as_bytes()])
            .await
            .map(drop)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(lease.key(), lease.fence(), "release", &[b""])
            .await
            .map(drop)
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        if extend_by < Duration::from_millis(1) || extend_by > Duration::from_secs(86_400) {
            return Err(Error::Misuse(format!(
                "a lease is extended by 1 ms to 1 day, got {extend_by:?}"
            )));
        }
        let by = duration_micros(extend_by).to_string();
        let parts = self
            .fenced(lease.key(), lease.fence(), "renew", &[by.as_bytes()])
            .await?;
        Ok(lease.renewed_until(from_micros(int(parts.get(2))?)))
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let rkey = self.redis_key(key);
        let mut cmd = evalsha(&GET, &rkey, None);
        cmd.arg(key.as_str());
        let reply = self.run(&GET, &cmd).await?;
        let parts = array(reply)?;
        match tag(&parts)? {
            "none" => Ok(None),
            "record" => record(&rkey, Some(key), &parts).map(Some),
            "corrupt" => Err(corrupt(&rkey, &parts)),
            other => Err(unexpected(other)),
        }
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        let mut pruned = 0u64;
        if limit == 0 {
            return Ok(0);
        }
        let pattern = self.pattern("*");
        let mut conn = self.conn.clone();
        for node in conn.masters().await.map_err(map_err)? {
            let mut cursor = "0".to_owned();
            loop {
                let (next, keys) = self.page(&mut conn, &node, &cursor, &pattern).await?;
                pruned += self.prune_page(&mut conn, keys, limit - pruned).await?;
                if pruned >= limit {
                    return Ok(pruned);
                }
                if next == "0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(pruned)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let mut found = Vec::new();
        let pattern = self.pattern(&format!("{}/*", tenant.as_str()));
        let mut conn = self.conn.clone();
        for node in conn.masters().await.map_err(map_err)? {
            let mut cursor = "0".to_owned();
            loop {
                let (next, keys) = self.page(&mut conn, &node, &cursor, &pattern).await?;
                for rkey in keys {
                    let reply: Value = GET
                        .key(&rkey)
                        .arg("")
                        .invoke_async(&mut conn)
                        .await
                        .map_err(map_err)?;
                    let parts = array(reply)?;
                    // One unreadable key must not hide every other abandoned
                    // step from reconciliation: it is logged and skipped.
                    match tag(&parts)? {
                        "record" => match record(&rkey, None, &parts) {
                            Ok(r) if r.key.tenant() == tenant && self.redis_key(&r.key) == rkey => {
                                if r.state == RecordState::Abandoned {
                                    found.push(r);
                                }
                            }
                            Ok(_) => {
                                tracing::warn!(key = %rkey, "record stored under another key; not listed")
                            }
                            Err(e) => {
                                tracing::warn!(key = %rkey, error = %e, "unreadable record; not listed")
                            }
                        },
                        "corrupt" => {
                            tracing::warn!(key = %rkey, error = %corrupt(&rkey, &parts), "not listed")
                        }
                        _ => {}
                    }
                }
                if next == "0" {
                    break;
                }
                cursor = next;
            }
        }
        found.sort_by_key(|r| r.created_at);
        found.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(found)
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        // A kind is checked as in an effect key, before any round trip.
        EffectKey::new(tenant, kind, "horizon")?;
        self.watermark(&self.horizon_key(tenant, kind)).await
    }
}

/// `EVALSHA <script> <n> <rkey> [<horizon key>]`, for the caller to add the
/// script's `ARGV`. The hot operations build their call as one [`Cmd`] (one
/// buffer) rather than through [`Script::key`], which first copies every
/// argument into a buffer of its own and then all of them again into a `Cmd`.
fn evalsha(script: &Script, rkey: &str, horizon: Option<&str>) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash());
    match horizon {
        Some(hkey) => cmd.arg(2).arg(rkey).arg(hkey),
        None => cmd.arg(1).arg(rkey),
    };
    cmd
}

fn record_key(prefix: &str, key: &EffectKey) -> String {
    let tag = blake3::hash(key.as_str().as_bytes()).to_hex();
    format!("{prefix}{{{}}}:{key}", &tag[..TAG_HEX])
}

fn horizon_key(prefix: &str, tenant: &Tenant, kind: &str) -> String {
    let scope = format!("{tenant}/{kind}");
    let tag = blake3::hash(scope.as_bytes()).to_hex();
    format!("{prefix}{{{}}}{HORIZON_INFIX}{scope}", &tag[..TAG_HEX])
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely::backend::Grant;

    #[test]
    fn record_keys_carry_a_tag_of_the_whole_key() {
        let t = Tenant::new("acme").unwrap();
        let k = EffectKey::new(&t, "capture", "}{x}").unwrap();
        let rkey = record_key("oncely:", &k);
        let tag = &blake3::hash(b"acme/capture:}{x}").to_hex()[..TAG_HEX];
        assert_eq!(rkey, format!("oncely:{{{tag}}}:acme/capture:}}{{x}}"));
        // Redis hashes the first {...}: our tag, whatever the subject holds.
        let open = rkey.find('{').unwrap();
        let close = open + rkey[open..].find('}').unwrap();
        assert_eq!(&rkey[open + 1..close], tag);
        let other = EffectKey::new(&t, "capture", "}{y}").unwrap();
        assert_ne!(record_key("oncely:", &other)[..close], rkey[..close]);
    }

    /// Horizon keys match no record pattern of any prefix: `#` stands where
    /// a record key has `:` after its tag, and prefixes cannot hold `{`.
    #[test]
    fn horizon_keys_are_not_records() {
        let t = Tenant::new("acme").unwrap();
        let hkey = horizon_key("oncely:", &t, "capture");
        let tag = &blake3::hash(b"acme/capture").to_hex()[..TAG_HEX];
        assert_eq!(hkey, format!("oncely:{{{tag}}}#horizon:acme/capture"));
        let record_like = |k: &str, prefix: &str| {
            k.strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix('{'))
                .is_some_and(|rest| {
                    rest.len() > TAG_HEX + 1 && rest.as_bytes()[TAG_HEX..TAG_HEX + 2] == *b"}:"
                })
        };
        assert!(record_like(
            &record_key("oncely:", &EffectKey::new(&t, "capture", "x").unwrap()),
            "oncely:"
        ));
        for prefix in ["oncely:", "", "oncely", "oncely:{"] {
            assert!(!record_like(&hkey, prefix), "{prefix:?}");
        }
    }

    /// Inserts `key`'s record as a cluster claim with `sent_us` does, before
    /// its horizon check (on any server: without the watermark in the
    /// script, the record carries the mark).
    async fn insert_marked(ledger: &RedisLedger, key: &EffectKey, lease: Duration, sent_us: i64) -> Lease {
        let mut cmd = evalsha(&CLAIM, &ledger.redis_key(key), None);
        cmd.arg(key.as_str())
            .arg(duration_micros(lease))
            .arg(3_600_000_000i64)
            .arg("")
            .arg("0")
            .arg(sent_us);
        let parts = array(ledger.run(&CLAIM, &cmd).await.unwrap()).unwrap();
        assert_eq!(tag(&parts).unwrap(), "acquired");
        oncely::backend::Grant {
            key: key.clone(),
            fence: uint(parts.get(1)).unwrap(),
            expires_at: from_micros(int(parts.get(2)).unwrap()),
            first_claimed_at: from_micros(int(parts.get(3)).unwrap()),
            acquired_at: from_micros(int(parts.get(4)).unwrap()),
            taken_over: false,
            at_most_once: false,
        }
        .into_lease()
    }

    /// The take-back of a claim beyond the horizon (and the second check's
    /// removal) deletes only the record that claim wrote: not one with
    /// another fence, creation time or mark, not one its holder renewed
    /// since, not one taken over after its lease ended. Clearing the mark
    /// is fenced the same way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn undo_takes_back_only_the_record_its_claim_wrote() {
        use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
        let Some(url) = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379")) else {
            return;
        };
        let ledger = match RedisLedger::connect(&url).await {
            Ok(l) => l,
            Err(e) => return skip_or_fail(&format!("redis at {url}: {e}")).unwrap_or(()),
        };
        let t = fresh_tenant();
        let acquire = |c: Claim| match c {
            Claim::Acquired(l) => l,
            other => panic!("expected Acquired, got {other:?}"),
        };
        let sent = to_micros(SystemTime::now()).unwrap() - 1_000_000;
        let short = Duration::from_millis(200);
        let mark = |ledger: &RedisLedger, k: &EffectKey| {
            let (ledger, rkey) = (ledger.clone(), ledger.redis_key(k));
            async move {
                let mut conn = ledger.conn.clone();
                redis::cmd("HGET")
                    .arg(rkey)
                    .arg("hz")
                    .query_async::<Option<String>>(&mut conn)
                    .await
                    .unwrap()
            }
        };
        let k = EffectKey::new(&t, "capture", "undo").unwrap();
        let l = insert_marked(&ledger, &k, short, sent).await;
        assert_eq!(mark(&ledger, &k).await, Some(sent.to_string()));
        ledger
            .undo(
                &Grant {
                    fence: l.fence() + 1,
                    ..Grant::from(&l)
                }
                .into_lease(),
                sent,
            )
            .await;
        ledger
            .undo(
                &Grant {
                    first_claimed_at: l.first_claimed_at() + Duration::from_micros(1),
                    ..Grant::from(&l)
                }
                .into_lease(),
                sent,
            )
            .await;
        ledger.undo(&l, sent + 1).await;
        let created = to_micros(l.first_claimed_at()).unwrap().to_string();
        let other = (sent + 1).to_string();
        let e = ledger
            .fenced(&k, l.fence(), "checked", &[created.as_bytes(), other.as_bytes()])
            .await
            .unwrap_err();
        assert!(e.is_lease_lost(), "{e:?}");
        assert_eq!(mark(&ledger, &k).await, Some(sent.to_string()));
        assert_eq!(ledger.get(&k).await.unwrap().unwrap().fence, l.fence());
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The second check found it within the horizon: the mark is cleared,
        // and the record is then taken over like any other.
        let hz = sent.to_string();
        ledger
            .fenced(&k, l.fence(), "checked", &[created.as_bytes(), hz.as_bytes()])
            .await
            .unwrap();
        assert_eq!(mark(&ledger, &k).await, None);
        let l2 = acquire(
            ledger
                .claim(&k, &ClaimOptions::default().lease(short))
                .await
                .unwrap(),
        );
        assert!(l2.taken_over());
        ledger.undo(&l, sent).await;
        assert_eq!(ledger.get(&k).await.unwrap().unwrap().fence, l2.fence());

        // A holder that renewed wrote since its claim: its claim passed.
        let renewed = EffectKey::new(&t, "capture", "undo-renewed").unwrap();
        let l3 = insert_marked(&ledger, &renewed, short, sent).await;
        ledger.renew(&l3, short).await.unwrap();
        ledger.undo(&l3, sent).await;
        assert_eq!(ledger.get(&renewed).await.unwrap().unwrap().fence, l3.fence());

        let fresh = EffectKey::new(&t, "capture", "undo-fresh").unwrap();
        let l4 = insert_marked(&ledger, &fresh, short, sent).await;
        ledger.undo(&l4, sent).await;
        assert!(ledger.get(&fresh).await.unwrap().is_none());
    }

    #[test]
    fn prefixes_are_checked() {
        for good in ["oncely:", "", "app-1/ledger:", "a.b_c"] {
            assert!(
                RedisLedgerOptions::default().prefix(good).check().is_ok(),
                "{good:?}"
            );
        }
        for bad in [
            "a{b",
            "a}",
            "a*",
            "a?",
            "a[b]",
            "a\\b",
            "a b",
            "é",
            &"x".repeat(65),
        ] {
            let e = RedisLedgerOptions::default().prefix(bad).check().unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{bad:?}");
        }
    }
}
