//! [`NatsKvLedger`]: its constructors, [`Ledger`] and [`FromUrl`].
//!
//! Each operation is a revision-checked write of one key, decided on a read
//! of that key (a lost race reads again and decides again). The claim's
//! decision is in `claim.rs`, prune in `prune.rs`, the horizon in
//! `horizon.rs`, the round trips themselves in `kv.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, kv};
use oncely::backend::Watch;
use oncely::backend::{Attempts, check_outcome, retry};
use oncely::backend::{Capabilities, Claim, Lease, Ledger, Outcome, Record, RecordState};
use oncely::open::{FromUrl, OpenOptions};
use oncely::{ClaimOptions, EffectKey, Error, Result, Tenant};

use crate::bucket::{self, Deadline, opening_backoff};
use crate::clock::{ServerClock, later};
use crate::codec::{Stored, kv_key, length_us, tenant_token};
use crate::error::{BACKEND, gave_up, read_only, unavailable};
use crate::kv::{Current, MAX_ATTEMPTS, Write, refusal_backoff};
use crate::marker::markers_needed;
use crate::notify::Notifications;
use crate::options::{NatsKvLedgerOptions, NatsUrl};

/// How many leases' revisions a ledger remembers for one-round-trip completes.
const REVISION_CACHE: usize = 4096;

/// The revision a ledger last wrote for a lease it holds, so complete /
/// release / renew can write without reading first. A revision-checked write
/// with it succeeds only if nothing changed since, which is exactly the state
/// remembered here.
type RevisionCache = HashMap<String, (u64, Stored)>;

/// What the clones of one ledger share.
pub(crate) struct Inner {
    /// The bucket.
    pub(crate) store: kv::Store,
    /// The options in force (the bucket name is the store's).
    pub(crate) opts: NatsKvLedgerOptions,
    /// The bucket's own `max_age` (at least `opts.max_age`), `None` when
    /// unbounded: records untouched this long vanish, which bounds the horizon.
    pub(crate) bucket_max_age: Option<Duration>,
    /// The server clock's estimate.
    pub(crate) clock: ServerClock,
    revisions: Mutex<RevisionCache>,
    /// KV keys this ledger's last claim of found in progress (`claim.rs`).
    in_progress: Mutex<HashSet<String>>,
    /// Wakes waiting duplicates (`notify.rs`).
    pub(crate) notifications: Notifications,
    /// What an acknowledged write survives ([`bucket::durability`]).
    durability: &'static str,
    /// Whether writes on top of a revision first create its marker
    /// (`marker.rs`): a replicated bucket on nats-server before 2.9.21.
    pub(crate) markers: bool,
    /// The servers of the URL (`host:port`, comma-separated), as the
    /// ledger shows them; `None` on a caller's connection.
    servers: Option<String>,
}

/// An effect ledger on a NATS JetStream KV bucket. Cheap to clone (shares the
/// connection).
#[derive(Clone)]
pub struct NatsKvLedger {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for NatsKvLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsKvLedger")
            .field("bucket", &self.inner.opts.bucket)
            .field("replicas", &self.inner.opts.replicas)
            .field("read_only", &self.inner.opts.read_only)
            .finish()
    }
}

impl NatsKvLedger {
    /// Connects to the servers a `nats://` URL names
    /// (`nats://h1:p1[,h2:p2…][?bucket=B&replicas=R]`, see the crate docs),
    /// opens the bucket and creates it if absent: [`NatsKvLedger::connect_with`]
    /// with the default options.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, NatsKvLedgerOptions::default()).await
    }

    /// Connects to the servers a `nats://` URL names, opens the bucket and
    /// creates it if absent (unless `options` say
    /// [`migrate(false)`](NatsKvLedgerOptions::migrate) or
    /// [`read_only`](NatsKvLedgerOptions::read_only)). The URL's `bucket` and
    /// `replicas` parameters override `options`' (the URL is what a
    /// deployment configures; the options are the code's defaults).
    ///
    /// A malformed URL or bad options fail with [`Error::Config`] before
    /// anything connects; a server that cannot be reached with
    /// [`Error::Unavailable`]. A bucket that exists with settings this ledger
    /// cannot rely on fails with [`Error::Config`] and is left unchanged.
    pub async fn connect_with(url: &str, options: NatsKvLedgerOptions) -> Result<Self> {
        let target = NatsUrl::parse(url)?;
        let opts = target.apply(options);
        opts.validate()?;
        let addrs = target.addrs()?;
        let servers = addrs
            .iter()
            .map(|a| format!("{}:{}", a.host(), a.port()))
            .collect::<Vec<_>>()
            .join(",");
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(opts.connect_timeout)
            .request_timeout(Some(opts.request_timeout))
            .name("oncely")
            // The ledger wakes its own waiters in process (`notify.rs`): its
            // own completion notifications echoed back would only be traffic.
            .no_echo()
            .connect(addrs)
            .await
            .map_err(unavailable)?;
        Self::on_client(client, opts, Some(servers)).await
    }

    /// [`NatsKvLedger::from_client_with`] with the default options.
    pub async fn from_client(client: async_nats::Client) -> Result<Self> {
        Self::from_client_with(client, NatsKvLedgerOptions::default()).await
    }

    /// A ledger on a connection the caller made: opens `options`' bucket
    /// (creating it if absent, unless [`migrate(false)`](NatsKvLedgerOptions::migrate)
    /// or [`read_only`](NatsKvLedgerOptions::read_only)) and checks it as
    /// [`NatsKvLedger::connect_with`] does. The connect timeout is the
    /// client's; the request timeout bounds the ledger's JetStream calls.
    /// The client should not echo its own messages
    /// (`ConnectOptions::no_echo`): the ledger wakes its own waiters, and
    /// its own notifications echoed back are only traffic.
    pub async fn from_client_with(client: async_nats::Client, options: NatsKvLedgerOptions) -> Result<Self> {
        options.validate()?;
        Self::on_client(client, options, None).await
    }

    /// Opens (or creates) the bucket on `client`, then the ledger.
    async fn on_client(
        client: async_nats::Client,
        opts: NatsKvLedgerOptions,
        servers: Option<String>,
    ) -> Result<Self> {
        let js = jetstream::ContextBuilder::new()
            .timeout(opts.request_timeout)
            .build(client.clone());
        // One deadline for opening the bucket and the first clock probe.
        let deadline = Deadline::after(opts.open_timeout);
        let store = bucket::open(&js, &opts, deadline).await?;
        Self::with_store(client, store, opts, deadline, servers).await
    }

    /// Uses a bucket the caller opened. Its settings are checked as by
    /// [`NatsKvLedger::connect_with`] against `opts` (the bucket name is
    /// taken from the store).
    ///
    /// `client` carries the completion notifications that wake duplicates
    /// waiting in other processes (crate docs, "Waiting"): the connection the
    /// store was opened on, or any other to the same NATS account. (A
    /// [`kv::Store`] does not give its connection out, hence the argument.)
    pub async fn from_store(
        client: async_nats::Client,
        store: kv::Store,
        opts: NatsKvLedgerOptions,
    ) -> Result<Self> {
        let opts = NatsKvLedgerOptions {
            bucket: store.name.clone(),
            ..opts
        };
        opts.validate()?;
        bucket::check(&store.stream.cached_info().config, &opts)?;
        let deadline = Deadline::after(opts.open_timeout);
        Self::with_store(client, store, opts, deadline, None).await
    }

    async fn with_store(
        client: async_nats::Client,
        store: kv::Store,
        opts: NatsKvLedgerOptions,
        deadline: Deadline,
        servers: Option<String>,
    ) -> Result<Self> {
        let bucket_max_age = Some(store.stream.cached_info().config.max_age).filter(|a| !a.is_zero());
        let version = client.server_info().version;
        let durability = bucket::durability(opts.replicas, &version);
        let markers = markers_needed(opts.replicas, &version);
        // A read-only ledger never ends a lease and never waits for one (its
        // claims are refused): it needs no subscription.
        let notifications = if opts.read_only {
            Notifications::local()
        } else {
            Notifications::subscribe(client, &store.name).await
        };
        let ledger = NatsKvLedger {
            inner: Arc::new(Inner {
                store,
                opts,
                bucket_max_age,
                clock: ServerClock::default(),
                revisions: Mutex::new(HashMap::new()),
                in_progress: Mutex::new(HashSet::new()),
                notifications,
                durability,
                markers,
                servers,
            }),
        };
        // A replicated bucket just created answers only once its stream has
        // elected a leader; the first clock probe doubles as that wait.
        let opening = Attempts::new(opening_backoff()).within(deadline.remaining());
        let ready = retry(
            opening,
            |_| true,
            || async {
                let now = ledger.now().await;
                now.inspect_err(|e| tracing::debug!(error = %e, "bucket not ready yet"))
            },
        )
        .await;
        ready.map(|_| ledger)
    }

    /// The underlying bucket.
    pub fn store(&self) -> &kv::Store {
        &self.inner.store
    }

    /// The options in force.
    pub fn options(&self) -> &NatsKvLedgerOptions {
        &self.inner.opts
    }

    /// Whether completions written by other processes wake this ledger's
    /// waiting duplicates right now: its subscription to the bucket's
    /// notification subject is live and the connection is up. While it is
    /// not (reconnecting, a read-only ledger), waiters poll (crate docs,
    /// "Waiting"). For health checks and metrics.
    pub fn is_listening(&self) -> bool {
        self.inner.notifications.listening()
    }

    /// How many completions and releases (keys) this ledger's notification
    /// subscription has received from other connections (a ledger opened with
    /// [`NatsKvLedger::connect_with`] does not receive its own; one opened
    /// with [`NatsKvLedger::from_store`] on a connection that echoes does).
    /// For metrics and tests.
    pub fn notifications_received(&self) -> u64 {
        self.inner.notifications.received()
    }

    /// Remembers the revision this ledger just wrote for a lease it holds.
    pub(crate) fn remember(&self, kv_key: &str, revision: u64, value: Stored) {
        let mut c = self.inner.revisions.lock().unwrap_or_else(|p| p.into_inner());
        if c.len() >= REVISION_CACHE {
            // Leases that were never completed (crashed handlers, dropped
            // futures) would otherwise pile up; forgetting only costs a read.
            c.clear();
        }
        c.insert(kv_key.to_owned(), (revision, value));
    }

    /// Notes whether this ledger's claim of `kv_key` just found it in
    /// progress, so that the next claim of it (a waiting duplicate looking
    /// again) reads before it tries to create.
    pub(crate) fn saw_in_progress(&self, kv_key: &str, in_progress: bool) {
        let mut s = self.inner.in_progress.lock().unwrap_or_else(|p| p.into_inner());
        if !in_progress {
            s.remove(kv_key);
            return;
        }
        if s.len() >= REVISION_CACHE {
            // Waiters that gave up never look again; forgetting costs a
            // refused create.
            s.clear();
        }
        s.insert(kv_key.to_owned());
    }

    /// Whether the last claim of `kv_key` here found it in progress.
    pub(crate) fn was_in_progress(&self, kv_key: &str) -> bool {
        let s = self.inner.in_progress.lock().unwrap_or_else(|p| p.into_inner());
        s.contains(kv_key)
    }

    /// The remembered revision and value of the lease at `fence`, if any
    /// (taken: a write with it either succeeds and is remembered again, or
    /// shows it stale).
    fn recall(&self, kv_key: &str, fence: u64) -> Option<(u64, Stored)> {
        let mut c = self.inner.revisions.lock().unwrap_or_else(|p| p.into_inner());
        match c.get(kv_key) {
            Some((_, v)) if v.fence == fence => c.remove(kv_key),
            _ => None,
        }
    }

    /// Completes `lease` (outcome checked, ledger writable); the caller
    /// wakes the key's waiters.
    pub(crate) async fn complete_quietly(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        self.fenced(lease, |v| {
            v.set_state(RecordState::Completed);
            v.set_outcome(Some(outcome));
        })
        .await?;
        Ok(())
    }

    /// Refuses a write on a read-only ledger, before any round trip.
    pub(crate) fn writable(&self, what: &str) -> Result<()> {
        if self.inner.opts.read_only {
            return Err(read_only(what, &self.inner.opts.bucket));
        }
        Ok(())
    }

    fn check_retention(&self, retention: Duration) -> Result<()> {
        // A completed record must outlive its retention; the bucket would
        // drop it at max_age, so a longer retention is a promise we cannot
        // keep: refused up front, before any round trip.
        if retention > self.inner.opts.max_age {
            return Err(Error::InvalidInput(format!(
                "retention {retention:?} exceeds the bucket's max_age {:?}",
                self.inner.opts.max_age
            )));
        }
        Ok(())
    }

    /// A write made with a lease: succeeds only while the record is in
    /// progress at the lease's fence. Returns the new value's revision.
    ///
    /// Every such write also clears the record's `hz` mark: a lease holder
    /// writes only after its claim returned, so that claim's horizon check
    /// passed. (A refused write is counted as a fence rejection by the
    /// runner, not here: telemetry is recorded in one place.)
    async fn fenced(&self, lease: &Lease, change: impl Fn(&mut Stored)) -> Result<(u64, Stored)> {
        let kk = kv_key(lease.key());
        if let Some((rev, mut value)) = self.recall(&kk, lease.fence()) {
            let base = value.clone();
            change(&mut value);
            value.hz = None;
            if let Write::Done(new_rev) = self.write(&kk, &value, rev, Some(&base)).await? {
                return Ok((new_rev, value));
            }
        }
        let lost = || Error::LeaseLost {
            key: lease.key().to_string(),
            fence: lease.fence(),
        };
        // As in a claim: a refusal followed by a read of the same revision
        // means the write that won is still on its way; pause.
        let (mut lost_on, mut backoff) = (None, refusal_backoff());
        for _ in 0..MAX_ATTEMPTS {
            let Some(Current {
                revision,
                value: Some(mut value),
                ..
            }) = self.read(&kk).await?
            else {
                return Err(lost());
            };
            if lost_on == Some(revision) {
                tokio::time::sleep(backoff.next_delay()).await;
            }
            value.effect_key(Some(lease.key()))?;
            if value.fence != lease.fence() || value.state()? != RecordState::InProgress {
                return Err(lost());
            }
            let base = value.clone();
            change(&mut value);
            value.hz = None;
            match self.write(&kk, &value, revision, Some(&base)).await? {
                Write::Done(new_rev) => return Ok((new_rev, value)),
                Write::Conflict => lost_on = Some(revision),
            }
        }
        Err(gave_up("fenced write", lease.key(), "lost races"))
    }
}

/// What the ledger reads, for an operator: `nats HOST:PORT,…, bucket B`;
/// never a credential.
impl std::fmt::Display for NatsKvLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner.servers {
            Some(servers) => write!(f, "nats {servers}")?,
            None => f.write_str("nats (the caller's connection)")?,
        }
        write!(f, ", bucket {}", self.inner.store.name)
    }
}

impl FromUrl for NatsKvLedger {
    const SCHEMES: &'static [&'static str] = &["nats"];

    /// `nats://h1:p1[,h2:p2…][?bucket=B&replicas=R]` with the default
    /// options otherwise. [`Access::Migrate`](oncely::open::Access::Migrate) creates a missing bucket;
    /// [`Access::Existing`](oncely::open::Access::Existing) never does ([`NatsKvLedgerOptions::migrate`]`(false)`);
    /// [`Access::ReadOnly`](oncely::open::Access::ReadOnly) never does either and refuses the ledger's
    /// writes ([`NatsKvLedgerOptions::read_only`]). A `connect_timeout` bounds both
    /// the connection and the wait for the bucket to answer
    /// ([`NatsKvLedgerOptions::open_timeout`]):
    /// a caller that wants a quick answer wants it for the whole open.
    async fn from_url(url: &str, options: OpenOptions) -> Result<Self> {
        Self::connect_with(url, oncely::open::LedgerOptions::for_open(options)).await
    }
}

impl Ledger for NatsKvLedger {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(self.inner.durability, "NATS server timestamps")
            .replicated(self.inner.opts.replicas > 1)
    }

    // No span and no metrics here: the core's claim pipeline records each
    // claim once (a backend that did too would count every claim twice).
    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        opts.validate()?;
        self.check_retention(opts.retention)?;
        self.writable("claim")?;
        self.claim_key(key, opts).await
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        check_outcome(outcome, oncely::backend::MAX_OUTCOME_BYTES)?;
        self.writable("complete")?;
        self.complete_quietly(lease, outcome).await?;
        self.inner.notifications.finished(lease.key()).await;
        Ok(())
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.writable("release")?;
        self.fenced(lease, |v| v.set_state(RecordState::Released)).await?;
        self.inner.notifications.finished(lease.key()).await;
        Ok(())
    }

    async fn renew(&self, lease: &Lease, extend_by: Duration) -> Result<Lease> {
        oncely::backend::check_extension(extend_by)?;
        self.writable("renew")?;
        // Read before the write, as in a claim: the reported end is no later
        // than the one the server measures from the new revision's stamp.
        let now = self.now().await?;
        let expires_at = later(now, extend_by)?;
        let us = length_us(extend_by);
        let (rev, value) = self.fenced(lease, |v| v.lease_us = us).await?;
        self.remember(&kv_key(lease.key()), rev, value);
        Ok(lease.renewed_until(expires_at))
    }

    async fn watch(&self, key: &EffectKey) -> Watch {
        self.inner.notifications.watch(key)
    }

    async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        opts.validate()?;
        self.check_retention(opts.retention)?;
        self.writable("claim")?;
        Ok(self.claim_batch(keys, opts).await)
    }

    async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        self.complete_batch(items).await
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        let Some(Current {
            at, value: Some(v), ..
        }) = self.read(&kv_key(key)).await?
        else {
            return Ok(None);
        };
        let now = self.now().await?;
        let k = v.effect_key(Some(key))?;
        v.record(k, at, now).map(Some)
    }

    async fn prune(&self, limit: u64) -> Result<u64> {
        self.writable("prune")?;
        self.prune_records(limit).await
    }

    async fn horizon(&self, tenant: &Tenant, kind: &str) -> Result<Option<SystemTime>> {
        let now = self.now().await?;
        self.horizon_at(tenant, kind, now).await
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        let (entries, _) = self
            .scan(format!("{}{}.*", self.inner.store.prefix, tenant_token(tenant)))
            .await?;
        let now = self.now().await?;
        let mut out = Vec::new();
        for (kk, cur) in entries {
            let Some(v) = cur.value else { continue };
            let Ok(key) = v.effect_key(None) else {
                continue;
            };
            if key.tenant() != tenant {
                continue;
            }
            // One unreadable record must not hide every abandoned step.
            let r = match v.record(key, cur.at, now) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(kv_key = %kk, error = %e, "skipping an unreadable record");
                    continue;
                }
            };
            if r.state == RecordState::Abandoned {
                out.push(r);
            }
        }
        out.sort_by_key(|r| r.created_at);
        out.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        Ok(out)
    }
}
