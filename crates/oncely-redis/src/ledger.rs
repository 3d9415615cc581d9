//! [`RedisLedger`]: its constructors, [`Ledger`] (each operation one script
//! call on the record's key; a batch, one call per slot) and [`FromUrl`].

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use oncely::backend::Watch;
use oncely::backend::{Capabilities, Claim, Lease, Ledger, Outcome, Record, RecordState};
use oncely::backend::{answer_existing, check_outcome, duration_micros, from_micros, to_micros};
use oncely::open::{FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error, Result, Tenant};
use redis::aio::ConnectionLike;
use redis::{Cmd, Script, Value};

use crate::conn::Conn;
use crate::durability;
use crate::error::{BACKEND, map_err, task_failed, unexpected};
use crate::keys::{horizon_key, record_key, record_pattern, slot};
use crate::lua::{self, CLAIM, ClaimItem, FENCED, FencedItem, GET};
use crate::notify::{Notifications, Source};
use crate::options::{RedisLedgerOptions, RedisUrl, Target, check_scheme};
use crate::reply::{
    FIELDS, Unchecked, Written, array, corrupt, corrupt_horizon, grant, in_progress, plain_record, record,
    tag,
};

/// How many times one claim runs the claim script. It runs again only after
/// it found an unchecked record ([`RedisLedger::recheck`]) and removed it or
/// cleared its mark, which a second run no longer finds; more runs than two
/// take claimants racing on such a record, and this bound keeps a claim
/// from looping on one that keeps changing.
const CLAIM_ATTEMPTS: u32 = 4;

/// An effect ledger on Redis or Redis Cluster. Cheap to clone: clones share
/// one multiplexed connection (single node) or one cluster connection, and
/// one change-notification subscription (see the crate docs, Waiting).
#[derive(Clone)]
pub struct RedisLedger {
    pub(crate) conn: Conn,
    pub(crate) opts: Arc<RedisLedgerOptions>,
    pub(crate) notes: Arc<Notifications>,
    /// What the masters' persistence settings keep, read on connect.
    durability: &'static str,
    /// The servers, as [`Target::servers`] shows them.
    servers: Arc<str>,
    /// The master name a Sentinel ledger asks for (else empty).
    master: Arc<str>,
}

/// What `WAIT` said after a write ([`RedisLedgerOptions::wait_replicas`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Acks {
    /// The ledger does not wait for replicas.
    NotAsked,
    /// How many replicas acknowledged the write within the timeout.
    Got(u64),
}

/// What one record's claim script reply means to the worker.
pub(crate) enum Answer {
    /// The claim's answer.
    Done(Result<Claim>),
    /// A cluster claim with `sent_at` inserted this lease: the horizon check
    /// follows ([`RedisLedger::settle_horizon`]).
    Settle(Lease),
    /// An expired record whose claim may never have finished its horizon
    /// check: [`RedisLedger::recheck`], then claim again.
    Unchecked { fence: u64, created: i64, hz: String },
}

impl std::fmt::Debug for RedisLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match self.conn {
            Conn::Single(_) => "single",
            Conn::Cluster(_) => "cluster",
            Conn::Sentinel(_) => "sentinel",
        };
        f.debug_struct("RedisLedger")
            .field("mode", &mode)
            .field("opts", &self.opts)
            .field("subscribed", &self.notes.is_up())
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
    ///   carry none; a query string applies to every node;
    /// - `redis+sentinel://s1:p1,s2:p2/master[/db][?…]`: the primary the
    ///   Sentinels name for `master`, followed when they promote another
    ///   (see the crate docs, Replication); credentials, database and query
    ///   are the primary's.
    ///
    /// A malformed URL is [`Error::Config`] before anything connects (a
    /// comma in a `redis://` host points to `redis+cluster://`), and no
    /// message quotes the URL. Connecting checks the server's role (a
    /// replica is [`Error::Config`] for a ledger that writes) and reads `maxmemory-policy` and the
    /// persistence settings (`appendonly`, `appendfsync`, `save`) on every
    /// master (see the crate docs' Durability): a server that persists
    /// nothing is refused with [`Error::Config`] unless the URL says
    /// `?ephemeral=true` (taken out before the client sees the URL) or
    /// [`RedisLedgerOptions::ephemeral`] accepts it, and what the weakest
    /// master keeps is reported in
    /// [`Capabilities::durability`](oncely::backend::Capabilities::durability).
    /// Connecting then subscribes to change
    /// notifications (see the crate docs' Waiting; a subscription that fails
    /// is logged and retried in the background, and does not fail `connect`).
    /// There is nothing to create or migrate on Redis.
    pub async fn connect(url: &str) -> Result<RedisLedger> {
        Self::connect_with(url, RedisLedgerOptions::default()).await
    }

    /// [`RedisLedger::connect`] with options.
    ///
    /// The URL's `?prefix=` sets the key prefix, `?ephemeral=true|false`
    /// accepts (or refuses) a server that persists nothing, and
    /// `?wait_replicas=n&wait_timeout_ms=t` sets
    /// [`RedisLedgerOptions::wait_replicas`], all over `options`' (so one
    /// URL names the whole ledger, for the application and the `oncely`
    /// command alike); any other query parameter but the client's
    /// `protocol` is [`Error::Config`].
    pub async fn connect_with(url: &str, options: RedisLedgerOptions) -> Result<RedisLedger> {
        let url = RedisUrl::parse(url)?;
        let options = url.apply(options);
        options.check()?;
        let target = url.target;
        let servers = target.servers().into();
        let master = match &target {
            Target::Sentinel(s) => s.master.as_str().into(),
            _ => "".into(),
        };
        let conn = Conn::open(target.clone(), &options).await?;
        let source = match (target, &conn) {
            (_, Conn::Sentinel(s)) => Source::Sentinel(s.clone()),
            (Target::Single(url), _) => Source::Nodes(vec![url]),
            (Target::Cluster(nodes), _) => Source::Nodes(nodes),
            (Target::Sentinel(_), _) => return Err(unexpected("a Sentinel URL without its connection")),
        };
        Self::open(conn, source, options, servers, master).await
    }

    /// [`RedisLedger::from_client_with`] with the default options.
    pub async fn from_client(client: redis::Client) -> Result<RedisLedger> {
        Self::from_client_with(client, RedisLedgerOptions::default()).await
    }

    /// A ledger on the one server a caller's [`redis::Client`] names (a
    /// cluster or a Sentinel deployment opens from its URL,
    /// [`RedisLedger::connect_with`]): its own connection to it, with
    /// `options`' timeouts, and the same checks as `connect` (role,
    /// eviction policy, persistence) before it is returned.
    pub async fn from_client_with(client: redis::Client, options: RedisLedgerOptions) -> Result<RedisLedger> {
        options.check()?;
        let info = client.get_connection_info().clone();
        let servers = info.addr().to_string().into();
        let conn = Conn::from_client(client, &options).await?;
        Self::open(conn, Source::Client(info), options, servers, "".into()).await
    }

    /// The checks every constructor runs on its connection, then the
    /// change-notification subscriber (from `source`).
    async fn open(
        mut conn: Conn,
        source: Source,
        options: RedisLedgerOptions,
        servers: Arc<str>,
        master: Arc<str>,
    ) -> Result<RedisLedger> {
        conn.check_role(options.read_only).await?;
        conn.check_eviction(options.require_noeviction).await?;
        let durability = durability::check(&mut conn, &options).await?;
        // Pub/sub ignores databases: the channel names the ledger's.
        let channel = format!("{}#changes@{}", options.prefix, conn.get_db());
        let notes = if options.read_only || !options.notifications {
            Notifications::off(channel)
        } else {
            Notifications::start(source, channel, options.connect_timeout).await
        };
        Ok(RedisLedger {
            conn,
            opts: Arc::new(options),
            notes: Arc::new(notes),
            durability,
            servers,
            master,
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

    /// How many replicas each lease write waits for, and for how long
    /// ([`RedisLedgerOptions::wait_replicas`]); `None` when it does not wait.
    pub fn wait_replicas(&self) -> Option<(u32, Duration)> {
        self.opts.wait.map(|w| (w.replicas, w.timeout))
    }

    /// The primary a `redis+sentinel://` ledger writes to now (`host:port`,
    /// as the Sentinels name it), and how many times it has moved to
    /// another since it connected (see the crate docs, Replication); `None`
    /// for a server or a cluster. For diagnostics and tests.
    pub fn primary(&self) -> Option<(String, u64)> {
        self.conn.primary()
    }

    /// Whether this ledger only reads ([`RedisLedgerOptions::read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.opts.read_only
    }

    /// Whether the ledger's change-notification subscription is up: while
    /// it is, a duplicate that waits for a record in progress is woken when
    /// the holder completes or releases it; while it is not, it polls (see
    /// the crate docs, Waiting). Always `false` for a ledger that does not
    /// subscribe ([`RedisLedgerOptions::notifications`],
    /// [`RedisLedgerOptions::read_only`]).
    pub fn is_subscribed(&self) -> bool {
        self.notes.is_up()
    }

    /// How many change notifications the subscription has relayed to this
    /// ledger's waiters since it connected: completions and releases by
    /// other ledgers (other processes) of records that this ledger's claims
    /// found in progress and would wait for. For diagnostics and tests.
    pub fn notifications_relayed(&self) -> u64 {
        self.notes.relayed()
    }

    /// Refuses a write on a read-only ledger, before any round trip.
    pub(crate) fn writable(&self, what: &str) -> Result<()> {
        if self.opts.read_only {
            return Err(read_only(what));
        }
        Ok(())
    }

    /// Runs fenced.lua: `op` on `key`'s record, only while it is in
    /// progress at `fence`; `args`: the operation's argument, and for
    /// `undo` and `checked` the record's horizon mark. Never waits for
    /// replicas ([`RedisLedger::fenced_acked`] does).
    pub(crate) async fn fenced(
        &self,
        key: &EffectKey,
        fence: u64,
        op: &str,
        args: &[&[u8]],
    ) -> Result<Vec<Value>> {
        self.fenced_with(key, fence, op, args, false)
            .await
            .map(|(parts, _)| parts)
    }

    /// [`RedisLedger::fenced`] for a lease holder's write (complete,
    /// release, renew): followed by `WAIT` when the ledger waits for
    /// replicas, whose answer [`RedisLedger::replicated`] reads.
    async fn fenced_acked(
        &self,
        key: &EffectKey,
        fence: u64,
        op: &str,
        args: &[&[u8]],
    ) -> Result<(Vec<Value>, Acks)> {
        self.fenced_with(key, fence, op, args, true).await
    }

    async fn fenced_with(
        &self,
        key: &EffectKey,
        fence: u64,
        op: &str,
        args: &[&[u8]],
        acked: bool,
    ) -> Result<(Vec<Value>, Acks)> {
        let rkey = self.redis_key(key);
        let item = FencedItem {
            rkey: &rkey,
            key,
            fence,
            arg: args.first().copied().unwrap_or_default(),
        };
        let cmd = lua::fenced(
            op,
            &[item],
            self.notes.mark(),
            self.notes.channel(),
            args.get(1).copied(),
        );
        let (replies, acks) = if acked {
            self.write(&FENCED, &cmd, &rkey).await?
        } else {
            (call(&self.conn, &FENCED, &cmd).await?, Acks::NotAsked)
        };
        Ok((fenced_answer(key, fence, &rkey, one(replies)?)?, acks))
    }

    /// Runs claim.lua on `items`, one reply each, and `WAIT` after it when
    /// the ledger waits for replicas.
    pub(crate) async fn claim_script(
        &self,
        items: &[ClaimItem<'_>],
        horizons: &[&str],
        opts: &ClaimOptions,
        sent_at: Option<i64>,
    ) -> Result<(Vec<Vec<Value>>, Acks)> {
        let cmd = lua::claim(
            items,
            horizons,
            opts,
            sent_at,
            self.notes.waiter(opts),
            self.opts.wait.is_some(),
        );
        let rkey = items.first().map_or("", |i| i.rkey);
        self.write(&CLAIM, &cmd, rkey).await
    }

    /// Sends a call of `script` on records of `rkey`'s slot; when the
    /// ledger waits for replicas, `WAIT` after it on the same connection,
    /// in the same round trip.
    async fn write(&self, script: &'static Script, cmd: &Cmd, rkey: &str) -> Result<(Vec<Vec<Value>>, Acks)> {
        match self.opts.wait {
            None => Ok((call(&self.conn, script, cmd).await?, Acks::NotAsked)),
            Some(wait) => {
                let (reply, got) = lua::run_and_wait(&self.conn, script, cmd, wait, slot(rkey)).await?;
                Ok((replies(reply)?, Acks::Got(got)))
            }
        }
    }

    /// How many replicas a write fell short by: `None` when it did not
    /// (or the ledger does not wait), else what `WAIT` counted.
    fn short(&self, acks: Acks) -> Option<u64> {
        match (acks, self.opts.wait) {
            (Acks::Got(got), Some(wait)) if got < u64::from(wait.replicas) => Some(got),
            _ => None,
        }
    }

    /// What `WAIT` counted, for messages: `1 of 2 replicas within 200ms`.
    fn counted(&self, got: u64) -> String {
        match self.opts.wait {
            Some(w) => format!("{got} of {} replicas within {:?}", w.replicas, w.timeout),
            None => format!("{got} replicas"),
        }
    }

    /// A lease holder's write (`what`: completion, release, renewal) that
    /// the primary applied: an error unless enough replicas acknowledged
    /// it, since a failover may lose it. Retryable: the write may be sent
    /// again (it is fenced), and a completion's caller learns that the
    /// outcome is unknown.
    pub(crate) fn replicated(&self, acks: Acks, what: &str, key: &EffectKey) -> Result<()> {
        match self.short(acks) {
            None => Ok(()),
            Some(got) => Err(Error::Backend {
                backend: BACKEND,
                message: format!(
                    "{key}: {what} applied on the primary but acknowledged by {}: a failover may lose it",
                    self.counted(got)
                ),
                retryable: true,
            }),
        }
    }

    /// A claim's answer once `WAIT` has counted the replicas that have it.
    /// Short of the count, a lease is not granted: it is given back
    /// (released, without waiting, so the next delivery can claim at once;
    /// if that fails too its lease simply ends), and a completed or
    /// abandoned record found is not answered with, since a failover could
    /// still lose it. Both fail with [`Error::Unavailable`]: no handler
    /// runs, and a retry may succeed. A record in progress and errors are
    /// answered as they are: neither lets the caller act.
    pub(crate) async fn acked_claim(&self, answer: Result<Claim>, acks: Acks) -> Result<Claim> {
        let Some(got) = self.short(acks) else {
            return answer;
        };
        match answer {
            Ok(Claim::Acquired(lease)) => {
                let given_back = self.fenced(lease.key(), lease.fence(), "release", &[b""]).await;
                let then = match given_back {
                    Ok(_) => {
                        self.notes.notify(lease.key());
                        "it was released"
                    }
                    Err(_) => "its lease ends unused",
                };
                Err(Error::Unavailable {
                    backend: BACKEND,
                    message: format!(
                        "{}: claim not granted: acknowledged by {}, so a failover may lose it; {then}",
                        lease.key(),
                        self.counted(got)
                    ),
                })
            }
            Ok(Claim::Completed(r) | Claim::Abandoned(r)) => Err(Error::Unavailable {
                backend: BACKEND,
                message: format!(
                    "{}: its record is on the primary but acknowledged by {}: not answered from, since a \
                     failover may lose it",
                    r.key,
                    self.counted(got)
                ),
            }),
            other => other,
        }
    }

    /// What one record's reply of claim.lua answers. `hkey`: the horizon key
    /// of a claim with `sent_at`; `in_script`: whether the script read it.
    pub(crate) fn answer(
        &self,
        key: &EffectKey,
        rkey: &str,
        opts: &ClaimOptions,
        hkey: Option<&str>,
        in_script: bool,
        parts: &[Value],
    ) -> Answer {
        let answer = || -> Result<Answer> {
            Ok(match tag(parts)? {
                "acquired" => {
                    let lease = grant(key, opts.at_most_once, parts)?;
                    // A takeover found the record: the horizon is not its
                    // question (the contract checks absent keys only).
                    if hkey.is_some() && !in_script && !lease.taken_over() {
                        Answer::Settle(lease)
                    } else {
                        Answer::Done(Ok(Claim::Acquired(lease)))
                    }
                }
                "unchecked" => {
                    let Unchecked { fence, created, hz } = Unchecked::decode(parts)?;
                    Answer::Unchecked { fence, created, hz }
                }
                "in_progress" => Answer::Done(in_progress(parts)),
                "record" => {
                    // The script decided; the kit's rule says what the record answers.
                    let r = record(rkey, Some(key), parts)?;
                    Answer::Done(match answer_existing(key, opts, r)? {
                        Some(c @ (Claim::Completed(_) | Claim::Abandoned(_))) => Ok(c),
                        other => Err(unexpected(&format!("{other:?}"))),
                    })
                }
                "horizon" => Answer::Done(Err(Error::BeyondHorizon { key: key.to_string() })),
                "mismatch" => Answer::Done(Err(Error::FingerprintMismatch { key: key.to_string() })),
                // The reply says when the horizon key is what is wrong.
                "corrupt" => Answer::Done(match hkey {
                    Some(hkey) if corrupt_horizon(parts) => Err(corrupt(hkey, parts)),
                    _ => Err(corrupt(rkey, parts)),
                }),
                other => Answer::Done(Err(unexpected(other))),
            })
        };
        answer().unwrap_or_else(|e| Answer::Done(Err(e)))
    }

    /// A claim that is probably a duplicate of a completed effect
    /// ([`ClaimOptions::redelivered`]) answered by a plain read: `TIME` and
    /// `HMGET` of the record in one pipeline, on the record's master, where
    /// the claim script would cost the server several times as much
    /// (docs/benchmarks.md, "Why Redis costs more per call"). Only what the
    /// script would answer without writing is answered here, by the kit's
    /// rule (`answer_existing`): a completed effect, an abandoned step, a
    /// fingerprint mismatch. `None` (the claim script decides) for anything
    /// else: no record, a live lease (the script marks it for its waiter),
    /// one to take over, a hash that is not a well-formed record (the
    /// script names what is wrong). Never with `wait_replicas`: the claim
    /// answers a duplicate only once the replicas have the record, which
    /// only the script's write on this connection can make `WAIT` count.
    async fn plain_answer(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Option<Claim>> {
        if !opts.redelivered || self.opts.wait.is_some() {
            return Ok(None);
        }
        let rkey = self.redis_key(key);
        let mut pipe = redis::Pipeline::with_capacity(2);
        pipe.cmd("TIME")
            .cmd("HMGET")
            .arg(&rkey)
            .arg(&FIELDS[..])
            .ignore_errors();
        let replies = self
            .conn
            .clone()
            .pipeline_on(pipe, 2, slot(&rkey))
            .await
            .map_err(map_err)?;
        let Some(record) = plain_record(&rkey, key, replies) else {
            return Ok(None);
        };
        Ok(match answer_existing(key, opts, record) {
            Ok(Some(c @ (Claim::Completed(_) | Claim::Abandoned(_)))) => Some(c),
            Err(e @ Error::FingerprintMismatch { .. }) => return Err(e),
            _ => None,
        })
    }

    /// One claim: the script, and on a cluster the horizon check after an
    /// insert ([`RedisLedger::settle_horizon`]). An expired record that the
    /// script will not take over before its creating claim's check is
    /// repeated ([`RedisLedger::recheck`]) is checked here, and the script
    /// sent again.
    pub(crate) async fn claim_once(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
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
        let horizons: Vec<&str> = in_script.into_iter().collect();
        for _ in 0..CLAIM_ATTEMPTS {
            let item = ClaimItem {
                rkey: &rkey,
                key,
                horizon: in_script.map(|_| 0),
                floor,
            };
            let (replies, acks) = self.claim_script(&[item], &horizons, opts, sent_at).await?;
            let parts = one(replies)?;
            match self.answer(key, &rkey, opts, hkey.as_deref(), in_script.is_some(), &parts) {
                Answer::Done(answer) => return self.acked_claim(answer, acks).await,
                Answer::Settle(lease) => {
                    let (Some(hkey), Some(us)) = (&hkey, sent_at) else {
                        return Err(unexpected("a horizon check without a sent_at"));
                    };
                    let answer = self.settle_horizon(lease, hkey, us).await.map(Claim::Acquired);
                    return self.acked_claim(answer, acks).await;
                }
                Answer::Unchecked { fence, created, hz } => {
                    self.recheck(key, fence, created, &hz).await?;
                    // Needed only if the record is gone when the script runs
                    // again, harmless otherwise (a takeover's fence is above
                    // the record's anyway).
                    floor = floor.max(Some(fence));
                }
            }
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
        // With WAIT, a claim returns once that many replicas have it: the
        // field's meaning, though WAIT is not consensus (crate docs).
        Capabilities::new(self.durability, "Redis server TIME")
            .coalescing(true)
            .replicated(self.opts.wait.is_some())
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.writable("claim")?;
        if let Some(answer) = self.plain_answer(key, opts).await? {
            return Ok(answer);
        }
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
        check_outcome(outcome, oncely::backend::MAX_OUTCOME_BYTES)?;
        let (_, acks) = self
            .fenced_acked(lease.key(), lease.fence(), "complete", &[outcome.as_bytes()])
            .await?;
        // This process's waiters, at once; the script published for the
        // others' if any waits. (Short of replicas, a waiter that claims
        // again is not answered from the record either.)
        self.notes.notify(lease.key());
        self.replicated(acks, "completion", lease.key())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.writable("release")?;
        let (_, acks) = self
            .fenced_acked(lease.key(), lease.fence(), "release", &[b""])
            .await?;
        self.notes.notify(lease.key());
        self.replicated(acks, "release", lease.key())
    }

    async fn watch(&self, key: &EffectKey) -> Watch {
        self.notes.watch(key)
    }

    /// One script call per slot ([`RedisLedger::claim_many`]).
    async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        RedisLedger::claim_many(self, keys, opts).await
    }

    /// One script call per slot ([`RedisLedger::complete_many`]).
    async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        RedisLedger::complete_many(self, items).await
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        self.writable("renew")?;
        oncely::backend::check_extension(extend_by)?;
        let by = duration_micros(extend_by).to_string();
        let (parts, acks) = self
            .fenced_acked(lease.key(), lease.fence(), "renew", &[by.as_bytes()])
            .await?;
        // A renewal a failover can lose would let the next claimant take the
        // lease over while its holder counts on the extension.
        self.replicated(acks, "renewal", lease.key())?;
        Ok(lease.renewed_until(from_micros(Written::decode(&parts)?.until)))
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

/// What a read-only ledger answers a write.
pub(crate) fn read_only(what: &str) -> Error {
    Error::Config(format!(
        "{what}: the Redis ledger was opened read-only (RedisLedgerOptions::read_only): it does not write"
    ))
}

/// Sends a call of a script that handles several records, one reply each.
pub(crate) async fn call(conn: &Conn, script: &Script, cmd: &Cmd) -> Result<Vec<Vec<Value>>> {
    replies(lua::run(conn, script, cmd).await?)
}

/// The replies of a call of a script that handles several records.
pub(crate) fn replies(reply: Value) -> Result<Vec<Vec<Value>>> {
    array(reply)?.into_iter().map(array).collect()
}

/// The one reply of a call on one record.
fn one(replies: Vec<Vec<Value>>) -> Result<Vec<Value>> {
    let mut replies = replies.into_iter();
    match (replies.next(), replies.next()) {
        (Some(parts), None) => Ok(parts),
        _ => Err(unexpected("a reply for another number of records")),
    }
}

/// What one record's reply of fenced.lua answers.
pub(crate) fn fenced_answer(
    key: &EffectKey,
    fence: u64,
    rkey: &str,
    parts: Vec<Value>,
) -> Result<Vec<Value>> {
    match tag(&parts)? {
        "ok" => Ok(parts),
        "lost" => Err(Error::LeaseLost {
            key: key.to_string(),
            fence,
        }),
        "corrupt" => Err(corrupt(rkey, &parts)),
        other => Err(unexpected(other)),
    }
}

/// What the ledger reads, for an operator: `redis HOST:PORT/DB, prefix P`,
/// `redis cluster HOST:PORT,…, prefix P`, or `redis sentinel HOST:PORT,…
/// master NAME/DB, prefix P`; never a credential.
impl std::fmt::Display for RedisLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.conn {
            Conn::Single(_) => write!(f, "redis {}/{}", self.servers, self.conn.get_db())?,
            Conn::Cluster(_) => write!(f, "redis cluster {}", self.servers)?,
            Conn::Sentinel(_) => write!(
                f,
                "redis sentinel {} master {}/{}",
                self.servers,
                self.master,
                self.conn.get_db()
            )?,
        }
        write!(f, ", prefix {}", self.opts.prefix)
    }
}

impl FromUrl for RedisLedger {
    const SCHEMES: &'static [&'static str] = crate::options::SCHEMES;

    /// Opens `redis://host:port[/db]` (one server),
    /// `redis+cluster://h1:p1,h2:p2[?…]` (a cluster) or
    /// `redis+sentinel://s1:p1,s2:p2/master[/db]` (the primary Sentinel
    /// names) as [`RedisLedger::connect`] does; any other scheme is
    /// [`Error::Config`].
    ///
    /// Redis has nothing to create or migrate, so every [`Access`](oncely::open::Access) opens the
    /// same way (the same connection, the same eviction-policy and
    /// persistence checks; a URL's `?ephemeral=true` accepts a server that
    /// persists nothing, which [`Access::ReadOnly`](oncely::open::Access::ReadOnly) accepts anyway).
    /// [`Access::Migrate`](oncely::open::Access::Migrate) and [`Access::Existing`](oncely::open::Access::Existing) give a ledger that writes;
    /// [`Access::ReadOnly`](oncely::open::Access::ReadOnly) gives one whose writes (`claim`, `complete`,
    /// `release`, `renew`, `prune`) fail with [`Error::Config`] before any
    /// round trip ([`RedisLedgerOptions::read_only`]), as the SQL backends'
    /// read-only ledgers do. [`OpenOptions::connect_timeout`] sets
    /// [`RedisLedgerOptions::connect_timeout`]. The key prefix is the
    /// URL's `?prefix=` (default `oncely:`).
    async fn from_url(url: &str, options: OpenOptions) -> Result<Self> {
        // Stricter than `connect`, which also hands `unix://` and the like
        // to the client: a caller that picks the backend by scheme (the
        // oncely command) sends this ledger only the schemes it declares.
        check_scheme(url)?;
        Self::connect_with(url, oncely::open::LedgerOptions::for_open(options)).await
    }
}
