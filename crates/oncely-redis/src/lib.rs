//! # oncely-redis
//!
//! The Redis and Redis Cluster backend of [oncely]: an effect ledger
//! in which every operation (claim, complete, release, renew, get) is one Lua
//! script, so the check and the write are one atomic step on the server and
//! one round trip from the worker. Lease expiry and retention are decided by
//! the server's clock (`redis.call('TIME')`), never by a worker's.
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
//! | clock | the Redis server's `TIME` (per master in a cluster; each key lives on one master) |
//! | max key | [`oncely::MAX_KEY_BYTES`] bytes of effect key, plus the prefix and a 19-byte hash tag |
//! | max outcome | [`oncely::MAX_OUTCOME_BYTES`] bytes, stored in the record's hash |
//! | cluster | yes: each operation touches exactly one key, so one slot |
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
//! set), because every field written costs server time on every claim.
//! `src/lua/prelude.lua` lists them; format 1 records are read as well.
//!
//! A completed or released record carries a TTL of its retention plus
//! [`RedisLedgerOptions::expiry_grace`] (1 minute by default), so Redis
//! deletes it by itself; [`prune`](oncely::Ledger::prune) deletes the ones
//! already past their retention a little earlier, by walking the keyspace of
//! every master with `SCAN` (one script call per candidate: an operator job,
//! not a hot path). A lease in progress has no TTL, and neither has an
//! abandoned at-most-once step: both stay until they are resolved, as the
//! contract requires (a vanished lease would let its fence be reused; a
//! vanished abandoned step would be run again).
//!
//! [`abandoned`](oncely::Ledger::abandoned) also walks every master with
//! `SCAN MATCH` on the tenant's prefix and reads each match, so its cost grows
//! with the size of the keyspace, not with the number of abandoned steps. Run
//! it from reconciliation jobs, not per request. A resharding in progress
//! while it runs may hide a record from one listing.
//!
//! ## Durability: what the server configuration gives
//!
//! - `appendonly no` and no snapshots (how this project's test server runs):
//!   nothing survives a restart. A restart forgets every claim and every
//!   outcome, and redeliveries then run their effects again.
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
//!   replicated: a claim (and the next delivery acquires the key again) or a
//!   completion (and the next delivery finds the lease, later takes it over
//!   and runs the effect again). Either way a duplicate effect is possible.
//!   Provider-keyed steps stay safe because the provider deduplicates by
//!   [`Lease::provider_key`](oncely::Lease::provider_key); at-most-once steps
//!   may be sent twice. Where that is not acceptable, use a consensus
//!   replicated backend (oncely-nats with R=3) or PostgreSQL.
//! - Eviction: the server must run `maxmemory-policy noeviction`. Under
//!   `allkeys-*` Redis may evict a live lease or an abandoned step; under
//!   `volatile-*` it may evict completed records (they carry a TTL) before
//!   their retention ends, and a redelivery would run the effect again.
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
//! string, a foreign hash) is [`Error::Corrupt`] and is never overwritten.
//!
//! Each operation is one script, and Redis runs a script entirely or not at
//! all, so a dropped future never leaves a half-applied change. A claim whose
//! future was dropped may still have been applied on the server: the key is
//! then in progress until the lease expires and is taken over afterwards (or
//! reported abandoned, for an at-most-once step), as the contract allows.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod conn;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Fingerprint, Lease, Ledger, Outcome, Record,
    RecordState, Result, Tenant, duration_micros, from_micros, to_micros,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::{Cmd, ErrorKind, RedisError, Script, ServerErrorKind, Value};

use crate::conn::{Conn, Node};

const BACKEND: &str = "redis";
const DEFAULT_PREFIX: &str = "oncely:";
/// The hash tag is this many hex digits of BLAKE3: 64 bits, so two keys
/// sharing a tag is as likely as any other slot collision and harmless.
const TAG_HEX: usize = 16;
const SCAN_COUNT: usize = 500;

macro_rules! lua {
    ($file:literal) => {
        LazyLock::new(|| Script::new(concat!(include_str!("lua/prelude.lua"), include_str!($file))))
    };
}

static CLAIM: LazyLock<Script> = lua!("lua/claim.lua");
static FENCED: LazyLock<Script> = lua!("lua/fenced.lua");
static GET: LazyLock<Script> = lua!("lua/get.lua");
static PRUNE: LazyLock<Script> = lua!("lua/prune.lua");

/// Options of a [`RedisLedger`]. `RedisLedgerOptions::default()` gives the
/// prefix `oncely:`, a 1 minute expiry grace, a 2 s connection timeout, a 5 s
/// response timeout and a required `noeviction` policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisLedgerOptions {
    prefix: String,
    expiry_grace: Duration,
    connection_timeout: Duration,
    response_timeout: Duration,
    require_noeviction: bool,
}

impl Default for RedisLedgerOptions {
    fn default() -> Self {
        RedisLedgerOptions {
            prefix: DEFAULT_PREFIX.to_owned(),
            expiry_grace: Duration::from_secs(60),
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

    /// Sets how long past its retention a completed or released record is
    /// left for [`prune`](oncely::Ledger::prune) before Redis expires it by
    /// itself. Zero leaves all deletion to Redis (prune then finds nothing).
    pub fn expiry_grace(mut self, grace: Duration) -> Self {
        self.expiry_grace = grace;
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
        if self.expiry_grace > Duration::from_secs(365 * 86_400) {
            return Err(Error::Config("expiry grace must be at most a year".into()));
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

    async fn fenced(&self, lease: &Lease, op: &str, arg: &[u8]) -> Result<Vec<Value>> {
        let rkey = self.redis_key(&lease.key);
        let mut cmd = evalsha(&FENCED, &rkey);
        cmd.arg(lease.key.as_str())
            .arg(lease.fence)
            .arg(op)
            .arg(arg)
            .arg(duration_micros(self.opts.expiry_grace));
        let reply = self.run(&FENCED, &cmd).await?;
        let parts = array(reply)?;
        match tag(&parts)? {
            "ok" => Ok(parts),
            "lost" => Err(Error::LeaseLost {
                key: lease.key.to_string(),
                fence: lease.fence,
            }),
            "corrupt" => Err(corrupt(&rkey, &parts)),
            other => Err(unexpected(other)),
        }
    }
}

impl Ledger for RedisLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            caller_transaction: false,
            durability: "as the Redis server is configured: AOF with appendfsync always/everysec, or none",
            replicated: false,
            clock: "Redis server TIME",
            max_key_bytes: oncely::MAX_KEY_BYTES,
            max_outcome_bytes: oncely::MAX_OUTCOME_BYTES,
        }
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        let rkey = self.redis_key(key);
        let mut cmd = evalsha(&CLAIM, &rkey);
        cmd.arg(key.as_str())
            .arg(duration_micros(opts.lease))
            .arg(duration_micros(opts.retention));
        match opts.fingerprint {
            Some(f) => cmd.arg(f.to_hex().as_str()),
            None => cmd.arg(""),
        };
        cmd.arg(if opts.at_most_once { "1" } else { "0" });
        match opts.sent_at {
            Some(t) => cmd.arg(to_micros(t)),
            None => cmd.arg(""),
        };
        let reply = self.run(&CLAIM, &cmd).await?;
        let parts = array(reply)?;
        match tag(&parts)? {
            "acquired" => Ok(Claim::Acquired(Lease {
                key: key.clone(),
                fence: uint(parts.get(1))?,
                expires_at: from_micros(int(parts.get(2))?),
                first_claimed_at: from_micros(int(parts.get(3))?),
                acquired_at: from_micros(int(parts.get(4))?),
                taken_over: int(parts.get(5))? == 1,
                at_most_once: opts.at_most_once,
            })),
            "in_progress" => Ok(Claim::InProgress {
                fence: uint(parts.get(1))?,
                expires_at: from_micros(int(parts.get(2))?),
                first_claimed_at: from_micros(int(parts.get(3))?),
                read_at: from_micros(int(parts.get(4))?),
            }),
            "record" => {
                let r = record(&rkey, Some(key), &parts)?;
                match r.state {
                    RecordState::Completed => Ok(Claim::Completed(r)),
                    RecordState::Abandoned => Ok(Claim::Abandoned(r)),
                    s => Err(unexpected(s.as_str())),
                }
            }
            "horizon" => Err(Error::BeyondHorizon { key: key.to_string() }),
            "mismatch" => Err(Error::FingerprintMismatch { key: key.to_string() }),
            "corrupt" => Err(corrupt(&rkey, &parts)),
            other => Err(unexpected(other)),
        }
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        if outcome.len() > oncely::MAX_OUTCOME_BYTES {
            return Err(Error::OutcomeTooLarge {
                size: outcome.len(),
                max: oncely::MAX_OUTCOME_BYTES,
            });
        }
        self.fenced(lease, "complete", outcome.as_bytes()).await.map(drop)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(lease, "release", b"").await.map(drop)
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        if extend_by < Duration::from_millis(1) || extend_by > Duration::from_secs(86_400) {
            return Err(Error::Misuse(format!(
                "a lease is extended by 1 ms to 1 day, got {extend_by:?}"
            )));
        }
        let by = duration_micros(extend_by).to_string();
        let parts = self.fenced(lease, "renew", by.as_bytes()).await?;
        Ok(Lease {
            expires_at: from_micros(int(parts.get(2))?),
            ..lease.clone()
        })
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let rkey = self.redis_key(key);
        let mut cmd = evalsha(&GET, &rkey);
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
        let pattern = self.pattern("*");
        let mut conn = self.conn.clone();
        for node in conn.masters().await.map_err(map_err)? {
            let mut cursor = "0".to_owned();
            loop {
                let (next, keys) = self.page(&mut conn, &node, &cursor, &pattern).await?;
                for rkey in keys {
                    if pruned >= limit {
                        return Ok(pruned);
                    }
                    let n: u64 = PRUNE
                        .key(&rkey)
                        .arg("")
                        .invoke_async(&mut conn)
                        .await
                        .map_err(map_err)?;
                    pruned += n;
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
}

/// `EVALSHA <script> 1 <rkey>`, for the caller to add the script's `ARGV`.
/// The hot operations build their call as one [`Cmd`] (one buffer) rather
/// than through [`Script::key`], which first copies every argument into a
/// buffer of its own and then all of them again into a `Cmd`.
fn evalsha(script: &Script, rkey: &str) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(1).arg(rkey);
    cmd
}

fn record_key(prefix: &str, key: &EffectKey) -> String {
    let tag = blake3::hash(key.as_str().as_bytes()).to_hex();
    format!("{prefix}{{{}}}:{key}", &tag[..TAG_HEX])
}

/// Maps a driver error to the core's: no driver type crosses the API.
fn map_err(e: RedisError) -> Error {
    let message = e.to_string();
    if e.is_connection_refusal()
        || e.is_connection_dropped()
        || matches!(e.kind(), ErrorKind::ClusterConnectionNotFound)
    {
        return Error::Unavailable {
            backend: BACKEND,
            message,
        };
    }
    if e.is_timeout() {
        return Error::Backend {
            backend: BACKEND,
            message,
            retryable: true,
        };
    }
    let retryable = match e.kind() {
        ErrorKind::Io => true,
        ErrorKind::Server(
            ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::BusyLoading
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => true,
        _ => e.code() == Some("BUSY"),
    };
    Error::Backend {
        backend: BACKEND,
        message,
        retryable,
    }
}

fn unexpected(what: &str) -> Error {
    Error::Backend {
        backend: BACKEND,
        message: format!("unexpected script reply {what:?}"),
        retryable: false,
    }
}

fn corrupt(rkey: &str, parts: &[Value]) -> Error {
    let what = parts.get(1).and_then(text).unwrap_or_default();
    Error::Corrupt {
        backend: BACKEND,
        message: format!("{rkey}: {what}"),
    }
}

fn array(v: Value) -> Result<Vec<Value>> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(unexpected(&format!("{other:?}"))),
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Okay => Some("OK".into()),
        _ => None,
    }
}

fn tag(parts: &[Value]) -> Result<&str> {
    match parts.first() {
        Some(Value::BulkString(b)) => std::str::from_utf8(b).map_err(|_| unexpected("non-UTF-8 tag")),
        Some(Value::SimpleString(s)) => Ok(s),
        other => Err(unexpected(&format!("{other:?}"))),
    }
}

fn int(v: Option<&Value>) -> Result<i64> {
    match v {
        Some(Value::Int(i)) => Ok(*i),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("non-numeric field")),
        other => Err(unexpected(&format!("{other:?}"))),
    }
}

fn uint(v: Option<&Value>) -> Result<u64> {
    u64::try_from(int(v)?).map_err(|_| unexpected("negative fence"))
}

fn policy_of(v: &Value) -> Option<String> {
    match v {
        Value::Array(a) => a.get(1).and_then(text),
        Value::Map(m) => m.first().and_then(|(_, v)| text(v)),
        _ => None,
    }
}

fn scan_page(v: Value) -> Result<(String, Vec<String>)> {
    let mut parts = array(v)?.into_iter();
    let cursor = parts.next().as_ref().and_then(text);
    let keys = match parts.next() {
        Some(Value::Array(keys)) => keys.iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    cursor
        .map(|c| (c, keys))
        .ok_or_else(|| unexpected("SCAN reply without cursor"))
}

/// Builds a record from a script's `{'record', now, HGETALL}` reply. A field
/// that does not parse means the hash is not oncely's: [`Error::Corrupt`].
fn record(rkey: &str, expected: Option<&EffectKey>, parts: &[Value]) -> Result<Record> {
    let bad = |what: &str| Error::Corrupt {
        backend: BACKEND,
        message: format!("{rkey}: {what}"),
    };
    let now = from_micros(int(parts.get(1))?);
    let Some(Value::Array(flat)) = parts.get(2) else {
        return Err(bad("record reply without fields"));
    };
    let mut fields = std::collections::HashMap::new();
    for pair in flat.chunks(2) {
        if let [Value::BulkString(k), Value::BulkString(v)] = pair {
            fields.insert(String::from_utf8_lossy(k).into_owned(), v.as_slice());
        }
    }
    let field = |name: &str| fields.get(name).copied();
    let text_field = |name: &str| field(name).and_then(|b| std::str::from_utf8(b).ok());
    let num = |name: &str| text_field(name).and_then(|s| s.parse::<i64>().ok());
    let stored_key = text_field("k").ok_or_else(|| bad("record without its key"))?;
    let key = EffectKey::parse(stored_key).map_err(|e| bad(&format!("stored key {stored_key:?}: {e}")))?;
    if expected.is_some_and(|k| *k != key) {
        return Err(bad(&format!("holds the record of {key}")));
    }
    let state = RecordState::parse(text_field("s").unwrap_or_default()).map_err(|e| bad(&e.to_string()))?;
    let fingerprint = match text_field("fp").unwrap_or_default() {
        "" => None,
        hex => Some(Fingerprint::from_hex(hex).map_err(|e| bad(&e.to_string()))?),
    };
    let outcome = match field("o") {
        Some(bytes) => Some(Outcome::from_bytes(bytes.to_vec()).map_err(|e| bad(&e.to_string()))?),
        None => None,
    };
    let fence = num("f")
        .and_then(|f| u64::try_from(f).ok())
        .ok_or_else(|| bad("record without a fence"))?;
    let at_most_once = text_field("amo") == Some("1");
    // Format 2 leaves a stale 'le' behind on completion (one field less to
    // write per operation): it means something only while in progress.
    let lease_expires_at = if state == RecordState::InProgress {
        num("le").map(from_micros)
    } else {
        None
    };
    let mut state = state;
    if state == RecordState::InProgress && at_most_once && lease_expires_at.is_none_or(|e| e <= now) {
        state = RecordState::Abandoned;
    }
    // Format 2 writes 'u' and 'ru' only once they differ from what the
    // first claim implies (see lua/prelude.lua).
    let created = num("c").ok_or_else(|| bad("record without a creation time"))?;
    let retain_until = match num("ru") {
        Some(ru) => ru,
        None => created.saturating_add(num("r").ok_or_else(|| bad("record without its retention"))?),
    };
    Ok(Record {
        key,
        state,
        fence,
        fingerprint,
        outcome,
        at_most_once,
        created_at: from_micros(created),
        updated_at: from_micros(num("u").unwrap_or(created)),
        lease_expires_at,
        retain_until: from_micros(retain_until),
        read_at: now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn driver_errors_map_to_core_errors() {
        let refused: RedisError = std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert!(matches!(map_err(refused), Error::Unavailable { .. }));
        let timeout: RedisError = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        assert!(matches!(map_err(timeout), Error::Backend { retryable: true, .. }));
        let parse: RedisError = (ErrorKind::Parse, "garbage").into();
        assert!(matches!(map_err(parse), Error::Backend { retryable: false, .. }));
    }
}
