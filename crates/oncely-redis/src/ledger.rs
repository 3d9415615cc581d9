//! [`RedisLedger`]: its constructors, [`Ledger`] (each operation one script
//! call on the record's key) and [`FromUrl`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely::backend::{
    Access, FromUrl, OpenOptions, answer_existing, check_outcome, duration_micros, from_micros, to_micros,
};
use oncely::{
    Capabilities, Claim, ClaimOptions, EffectKey, Error, Lease, Ledger, Outcome, Record, RecordState, Result,
    Tenant,
};
use redis::Value;

use crate::conn::Conn;
use crate::error::{BACKEND, corrupt, map_err, task_failed, unexpected};
use crate::keys::{horizon_key, record_key, record_pattern};
use crate::lua::{self, CLAIM, FENCED, GET};
use crate::options::{RedisLedgerOptions, check_scheme, parse_url};
use crate::reply::{array, grant, in_progress, int, record, tag, text, uint};

/// How many times one claim runs the claim script. It runs again only after
/// it found an unchecked record ([`RedisLedger::recheck`]) and removed it or
/// cleared its mark, which a second run no longer finds; more runs than two
/// take claimants racing on such a record, and this bound keeps a claim
/// from looping on one that keeps changing.
const CLAIM_ATTEMPTS: u32 = 4;

/// An effect ledger on Redis or Redis Cluster. Cheap to clone: clones share
/// one multiplexed connection (single node) or one cluster connection.
#[derive(Clone)]
pub struct RedisLedger {
    pub(crate) conn: Conn,
    pub(crate) opts: Arc<RedisLedgerOptions>,
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
    /// Connects with default options to what `url` names:
    ///
    /// - `redis://host:port[/db]`: one server (other single-server URLs of
    ///   the redis client, such as `unix:///path`, are taken as they are;
    ///   `rediss://` needs TLS features this crate does not enable);
    /// - `redis+cluster://h1:p1,h2:p2[?…]`: a Redis Cluster, through any of
    ///   the listed nodes (each `host:port` or `redis://host:port`); the
    ///   client learns the rest of the topology and follows `MOVED` and `ASK`
    ///   redirections. Credentials on the first node apply to the nodes that
    ///   carry none; a query string applies to every node.
    ///
    /// A malformed URL is [`Error::Config`] before anything connects (a
    /// comma in a `redis://` host points to `redis+cluster://`), and no
    /// message quotes the URL. Connecting reads `maxmemory-policy` on every
    /// master (see the crate docs' Durability). There is nothing to create
    /// or migrate on Redis.
    pub async fn connect(url: &str) -> Result<RedisLedger> {
        Self::connect_with(url, RedisLedgerOptions::default()).await
    }

    /// [`RedisLedger::connect`] with options.
    pub async fn connect_with(url: &str, options: RedisLedgerOptions) -> Result<RedisLedger> {
        options.check()?;
        let target = parse_url(url)?;
        let mut conn = Conn::open(target, &options).await?;
        conn.check_eviction(options.require_noeviction).await?;
        Ok(RedisLedger {
            conn,
            opts: Arc::new(options),
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

    /// Whether this ledger only reads ([`RedisLedgerOptions::read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.opts.read_only
    }

    /// Refuses a write on a read-only ledger, before any round trip.
    fn writable(&self, what: &str) -> Result<()> {
        if self.opts.read_only {
            return Err(Error::Config(format!(
                "{what}: the Redis ledger was opened read-only (RedisLedgerOptions::read_only): it does not write"
            )));
        }
        Ok(())
    }

    /// Runs fenced.lua: `op` on `key`'s record, only while it is in
    /// progress at `fence`; `args` are the operation's own (ARGV from 4 on).
    pub(crate) async fn fenced(
        &self,
        key: &EffectKey,
        fence: u64,
        op: &str,
        args: &[&[u8]],
    ) -> Result<Vec<Value>> {
        let rkey = self.redis_key(key);
        let cmd = lua::fenced(&rkey, key, fence, op, args);
        let parts = array(lua::run(&self.conn, &FENCED, &cmd).await?)?;
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
            let cmd = lua::claim(&rkey, in_script, key, opts, sent_at, floor);
            let parts = array(lua::run(&self.conn, &CLAIM, &cmd).await?)?;
            return match tag(&parts)? {
                "acquired" => {
                    let lease = grant(key, opts.at_most_once, &parts)?;
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
                "in_progress" => in_progress(&parts),
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
        self.writable("claim")?;
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
                .map_err(|e| task_failed("claim", e))?;
        }
        self.claim_once(key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.writable("complete")?;
        check_outcome(outcome, oncely::MAX_OUTCOME_BYTES)?;
        self.fenced(lease.key(), lease.fence(), "complete", &[outcome.as_bytes()])
            .await
            .map(drop)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.writable("release")?;
        self.fenced(lease.key(), lease.fence(), "release", &[b""])
            .await
            .map(drop)
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        self.writable("renew")?;
        oncely::backend::check_extension(extend_by)?;
        let by = duration_micros(extend_by).to_string();
        let parts = self
            .fenced(lease.key(), lease.fence(), "renew", &[by.as_bytes()])
            .await?;
        Ok(lease.renewed_until(from_micros(int(parts.get(2))?)))
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let rkey = self.redis_key(key);
        let cmd = lua::get(&rkey, key);
        let parts = array(lua::run(&self.conn, &GET, &cmd).await?)?;
        match tag(&parts)? {
            "none" => Ok(None),
            "record" => record(&rkey, Some(key), &parts).map(Some),
            "corrupt" => Err(corrupt(&rkey, &parts)),
            other => Err(unexpected(other)),
        }
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        self.writable("prune")?;
        let mut pruned = 0u64;
        if limit == 0 {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let mut scan = conn.scan(record_pattern(&self.opts.prefix, "*")).await?;
        while let Some(keys) = scan.next_page().await? {
            pruned += self.prune_page(&mut conn, keys, limit - pruned).await?;
            if pruned >= limit {
                break;
            }
        }
        Ok(pruned)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let mut found = Vec::new();
        let pattern = record_pattern(&self.opts.prefix, &format!("{}/*", tenant.as_str()));
        let mut conn = self.conn.clone();
        let mut scan = conn.scan(pattern).await?;
        while let Some(keys) = scan.next_page().await? {
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

impl FromUrl for RedisLedger {
    const SCHEMES: &'static [&'static str] = crate::options::SCHEMES;

    /// Opens `redis://host:port[/db]` (one server) or
    /// `redis+cluster://h1:p1,h2:p2[?…]` (a cluster) as
    /// [`RedisLedger::connect`] does; any other scheme is [`Error::Config`].
    ///
    /// Redis has nothing to create or migrate, so every [`Access`] opens the
    /// same way (the same connection, the same eviction-policy check).
    /// [`Access::Migrate`] and [`Access::Existing`] give a ledger that writes;
    /// [`Access::ReadOnly`] gives one whose writes (`claim`, `complete`,
    /// `release`, `renew`, `prune`) fail with [`Error::Config`] before any
    /// round trip ([`RedisLedgerOptions::read_only`]), as the SQL backends'
    /// read-only ledgers do. [`OpenOptions::connect_timeout`] sets
    /// [`RedisLedgerOptions::connection_timeout`].
    async fn from_url(url: &str, options: OpenOptions) -> Result<Self> {
        // Stricter than `connect`, which also hands `unix://` and the like
        // to the client: a caller that picks the backend by scheme (the
        // oncely command) sends this ledger only the schemes it declares.
        check_scheme(url)?;
        let read_only = match options.access {
            Access::Migrate | Access::Existing => false,
            Access::ReadOnly => true,
        };
        let mut opts = RedisLedgerOptions::default().read_only(read_only);
        if let Some(timeout) = options.connect_timeout {
            opts = opts.connection_timeout(timeout);
        }
        Self::connect_with(url, opts).await
    }
}
