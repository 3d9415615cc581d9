//! Waking waiting duplicates: after each write that ends a lease (complete,
//! release, complete_many) commits, the ledger wakes its own process's
//! watches directly (no round trip) and hands the key to its [`Announcer`],
//! a task that `pg_notify`s the ledger's channel with the keys handed to it
//! meanwhile, in one statement whose commit does not wait for a WAL flush. One listener connection
//! per ledger `LISTEN`s on that channel and relays each key to the
//! in-process [`Notifier`]. (`complete_in` notifies inside the caller's
//! transaction instead; see `sql.rs` for why the others do not.)
//!
//! Why a separate transaction: PostgreSQL serializes the commits of
//! transactions that notify (a database-wide lock held from the commit's
//! start to its end, through the WAL flush), so a completion that notified in
//! its own statement could not share a flush with concurrent ones. A
//! transaction that only notifies still writes a commit record, but with
//! `synchronous_commit` off for it alone its commit does not wait for the
//! flush: it holds that lock for microseconds. An announcement lost with its process
//! (a crash between the commit and the announcement) costs the waiters their
//! fallback, never a wrong answer.
//!
//! The listener is a task started by the first [`Changes::watch`] (a ledger
//! whose claims never wait never opens the connection). It holds one
//! connection of its own (not one of the ledger's pool: a pool of one would
//! otherwise starve), reconnects with a backoff when the connection is lost,
//! and [`Changes::watch`] hands out notified watches only while it is
//! listening; otherwise polling ones. When the connection is lost, every
//! waiter is woken at once to look at its record (a notification may have
//! been lost with the connection: a failover loses every one in flight),
//! and again when it listens anew; the runner claims again when a watch
//! wakes, whatever woke it. Each (re)connection takes the ledger pool's
//! connect options of that moment, so it follows the pool to a promoted
//! standby, and a listener whose ledger moved to another host (a frozen
//! primary's connection may never report its loss) reconnects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::EffectKey;
use oncely::backend::Backoff;
use oncely::backend::Lease;
use oncely::backend::{Notifier, Watch};
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio::sync::watch as state;
use tokio::sync::watch::Receiver;
use tokio::task::JoinHandle;

use crate::conn::Conn;
use crate::error::BACKEND;

/// How long the first watch of a ledger waits for the listener's first
/// connection before it settles for polling: the listener starts lazily, and
/// the waiter it starts for is about to wait anyway. Bounded so that a server
/// refusing connections costs a waiter this much once, not every time.
const FIRST_CONNECT: Duration = Duration::from_secs(2);

/// The pauses between reconnection attempts: the first at once after a lost
/// connection would spin on a server that refuses connections; the cap keeps
/// a long outage from delaying recovery by much.
const RECONNECT_FIRST: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The `application_name` of the listener's connection, so an operator can
/// tell it in `pg_stat_activity`.
const APPLICATION_NAME: &str = "oncely listener";

/// Keys waiting to be announced at most: beyond it (the server unreachable
/// for a long time, say) new ones are dropped, and their waiters elsewhere
/// wake by their fallback. Bounds the memory, not the correctness.
const ANNOUNCE_BACKLOG: usize = 10_000;

/// Keys per announcing statement.
const ANNOUNCE_CHUNK: usize = 1_000;

/// How long one announcing statement may take: a server that stops
/// answering must not stall every later announcement (the connection is
/// closed, see `conn::Conn`).
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(10);

/// One notification per key. Two copies of one payload in a transaction are
/// sent once by PostgreSQL. A transaction that notifies is given a
/// transaction id at its commit and writes a commit record; `set_config(…,
/// true)` turns `synchronous_commit` off for this transaction only, so its
/// commit does not wait for that record's WAL flush (the WAL writer flushes
/// it soon after; the notification is delivered at commit either way). On
/// this project's machine, five announcements in a row cost five WAL syncs
/// without it and none waited on with it (`pg_stat_wal.wal_sync`).
const ANNOUNCE: &str = "SELECT pg_notify($1, k) \
     FROM (SELECT set_config('synchronous_commit', 'off', true)) AS c, unnest($2::text[]) AS k";

/// The keys whose leases this ledger ended, not yet announced to other
/// processes, and the wake-up of the task that announces them.
#[derive(Debug, Default)]
struct Announcer {
    pending: Mutex<Vec<String>>,
    wake: Notify,
    /// Announcements sent (one per key) and dropped.
    sent: AtomicU64,
    dropped: AtomicU64,
    /// Ends of leases not announced: no waiter had marked the record.
    unmarked: AtomicU64,
}

/// Whether the listener is listening.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Listening {
    /// Not yet tried since the task (re)started.
    Starting,
    /// `LISTEN` was acknowledged on a live connection.
    Up,
    /// Not connected (lost, or the last attempt failed); reconnecting.
    Down,
}

/// What the listener task and the ledger share.
#[derive(Debug)]
struct Shared {
    notifier: Notifier,
    state: state::Sender<Listening>,
    received: AtomicU64,
    connects: AtomicU64,
}

/// The change notifications of one ledger: its [`Notifier`] and its
/// listener task (aborted when the ledger's last clone is dropped).
#[derive(Debug)]
pub(crate) struct Changes {
    shared: Arc<Shared>,
    channel: Arc<str>,
    /// The ledger's pool, whose connect options the listener's own
    /// connection copies.
    pool: PgPool,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Changes when the ledger's pool is pointed at another host.
    moved: Option<Receiver<u64>>,
    announcer: Arc<Announcer>,
    announce_task: Mutex<Option<JoinHandle<()>>>,
    /// The keys whose leases this ledger holds (claimed, not yet completed
    /// or released), each with when its lease ends on this process's clock:
    /// a waiter in this process needs no mark on their records, since the
    /// holder's completion wakes it directly ([`Changes::holds`]).
    held: Mutex<Held>,
}

/// [`Changes::held`]: the live leases, and the size at which the expired
/// ones are swept next (a lease whose holder never completed nor released
/// it, its future dropped, stays until then): twice what was left by the
/// last sweep, at least [`HELD_SWEEP`], so sweeping costs O(1) per lease.
#[derive(Debug, Default)]
struct Held {
    until: HashMap<Box<str>, Instant>,
    sweep_at: usize,
}

/// The fewest held leases at which a sweep runs.
const HELD_SWEEP: usize = 10_000;

/// The state of a ledger's change listener, from
/// [`PgLedger::listener_status`](crate::PgLedger::listener_status): for a
/// health check, or to see whether waiting duplicates are woken by
/// notifications or poll.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStatus {
    /// The `LISTEN`/`NOTIFY` channel: the table's name and a hash of the
    /// schema and table (the payload of each notification is an effect key).
    pub channel: String,
    /// Whether the listener is connected and listening now. False before the
    /// first waiting claim started it, on a read-only ledger (it never
    /// starts), and while it reconnects.
    pub listening: bool,
    /// How many notifications it has received on the channel (completions
    /// and releases committed by any process, this one included).
    pub notifications: u64,
    /// How many times it has connected and started listening (more than one
    /// means it reconnected).
    pub connects: u64,
    /// How many of this ledger's completions and releases it has announced
    /// on the channel to other processes' listeners (after each committed).
    pub announced: u64,
    /// How many it could not announce (the server unreachable, or more than
    /// 10,000 waiting to be sent): their waiters elsewhere woke by their
    /// fallback instead.
    pub unannounced: u64,
    /// How many of this ledger's completions and releases it did not need
    /// to announce: no waiter in any process had marked the record (a
    /// waiter marks it when it starts waiting on a notification).
    pub unwatched: u64,
}

impl Changes {
    pub(crate) fn new(pool: PgPool, channel: Arc<str>, moved: Option<Receiver<u64>>) -> Self {
        Changes {
            shared: Arc::new(Shared {
                notifier: Notifier::new(),
                state: state::Sender::new(Listening::Starting),
                received: AtomicU64::new(0),
                connects: AtomicU64::new(0),
            }),
            channel,
            pool,
            task: Mutex::new(None),
            moved,
            announcer: Arc::new(Announcer::default()),
            announce_task: Mutex::new(None),
            held: Mutex::new(Held::default()),
        }
    }

    /// This ledger holds `lease` now (a claim or a renewal granted it).
    pub(crate) fn holding(&self, lease: &Lease) {
        let left = lease
            .expires_at()
            .duration_since(lease.acquired_at())
            .unwrap_or_default();
        let now = Instant::now();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.until.len() >= held.sweep_at.max(HELD_SWEEP) {
            held.until.retain(|_, until| *until > now);
            held.sweep_at = held.until.len() * 2;
        }
        held.until.insert(lease.key().as_str().into(), now + left);
    }

    /// This ledger no longer holds `key`'s lease (it ended it, or lost it).
    pub(crate) fn let_go(&self, key: &str) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .until
            .remove(key);
    }

    /// Whether this ledger holds a live lease on `key`: its own completion
    /// or release will wake this process's waiters, so their watch need not
    /// mark the record. A holder that lost its lease unnoticed (its future
    /// dropped) counts until the lease's end; a waiter that skipped the mark
    /// then wakes by its fallback if another process completes the effect.
    pub(crate) fn holds(&self, key: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .until
            .get(key)
            .is_some_and(|until| *until > Instant::now())
    }

    /// After the ledger's own write that ended `key`'s lease committed:
    /// wakes this process's watches on it now, and, if a waiter marked the
    /// record (`watched`), has it announced to other processes' listeners
    /// (see the module docs).
    pub(crate) fn finished(&self, key: &str, watched: bool) {
        self.let_go(key);
        self.shared.notifier.notify(key);
        if !watched {
            self.announcer.unmarked.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let announcer = &self.announcer;
        {
            let mut pending = announcer.pending.lock().unwrap_or_else(|p| p.into_inner());
            if pending.len() >= ANNOUNCE_BACKLOG {
                announcer.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            pending.push(key.to_owned());
        }
        let mut task = self.announce_task.lock().unwrap_or_else(|p| p.into_inner());
        if task.as_ref().is_none_or(JoinHandle::is_finished) {
            // Outside a Tokio runtime nobody is announced to: their waiters
            // wake by their fallback.
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return;
            };
            *task = Some(runtime.spawn(announce(
                announcer.clone(),
                self.pool.clone(),
                self.channel.clone(),
            )));
        }
        announcer.wake.notify_one();
    }

    /// A watch on `key`: notified while the listener listens (started here
    /// on first use), polling otherwise.
    pub(crate) async fn watch(&self, key: &EffectKey) -> Watch {
        let Some(mut state) = self.ensure_started() else {
            return Watch::polling();
        };
        if *state.borrow() == Listening::Starting {
            // Bounded, and a closed channel (the task gone) ends it too.
            let _ = tokio::time::timeout(FIRST_CONNECT, state.wait_for(|s| *s != Listening::Starting)).await;
        }
        if *state.borrow() == Listening::Up {
            // Armed now: a notification relayed from here on wakes it, and
            // the runner looks at the record once more before waiting.
            self.shared.notifier.watch(key)
        } else {
            Watch::polling()
        }
    }

    /// The listener's state now.
    pub(crate) fn status(&self) -> ListenerStatus {
        ListenerStatus {
            channel: self.channel.to_string(),
            listening: *self.shared.state.borrow() == Listening::Up,
            notifications: self.shared.received.load(Ordering::Relaxed),
            connects: self.shared.connects.load(Ordering::Relaxed),
            announced: self.announcer.sent.load(Ordering::Relaxed),
            unannounced: self.announcer.dropped.load(Ordering::Relaxed),
            unwatched: self.announcer.unmarked.load(Ordering::Relaxed),
        }
    }

    /// Starts the listener task unless it runs; `None` outside a Tokio
    /// runtime (the caller polls instead).
    fn ensure_started(&self) -> Option<state::Receiver<Listening>> {
        let mut task = self.task.lock().unwrap_or_else(|p| p.into_inner());
        // A task that ended (its runtime shut down while the ledger lived
        // on) is started again on the runtime of the caller.
        if task.as_ref().is_none_or(JoinHandle::is_finished) {
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            self.shared.state.send_replace(Listening::Starting);
            *task = Some(runtime.spawn(listen(
                self.shared.clone(),
                self.pool.clone(),
                self.channel.clone(),
                self.moved.clone(),
            )));
        }
        Some(self.shared.state.subscribe())
    }
}

impl Drop for Changes {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            task.abort();
        }
        if let Some(task) = self
            .announce_task
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// The announcing task: whenever keys are pending, sends them all, in as
/// few statements as [`ANNOUNCE_CHUNK`] allows; while one is in flight,
/// the next completions' keys gather for the next. Aborted with the ledger.
async fn announce(announcer: Arc<Announcer>, pool: PgPool, channel: Arc<str>) {
    loop {
        announcer.wake.notified().await;
        loop {
            let keys = std::mem::take(&mut *announcer.pending.lock().unwrap_or_else(|p| p.into_inner()));
            if keys.is_empty() {
                break;
            }
            for chunk in keys.chunks(ANNOUNCE_CHUNK) {
                let sent = tokio::time::timeout(ANNOUNCE_TIMEOUT, async {
                    let deadline = std::time::Instant::now() + ANNOUNCE_TIMEOUT;
                    let mut conn = Conn::new(pool.acquire().await?, Some(deadline));
                    sqlx::query(ANNOUNCE)
                        .bind(&*channel)
                        .bind(chunk)
                        .execute(&mut *conn)
                        .await
                })
                .await
                .unwrap_or(Err(sqlx::Error::PoolTimedOut));
                match sent {
                    Ok(_) => announcer.sent.fetch_add(chunk.len() as u64, Ordering::Relaxed),
                    Err(e) => {
                        tracing::debug!(
                            backend = BACKEND,
                            channel = &*channel,
                            error = %e,
                            keys = chunk.len(),
                            "could not announce completions; waiters elsewhere wake by their fallback"
                        );
                        announcer.dropped.fetch_add(chunk.len() as u64, Ordering::Relaxed)
                    }
                };
            }
        }
    }
}

/// A pool of one connection with the ledger pool's connect options (the
/// listener's own, so it never takes one of the ledger's), pinged before
/// each (re)connection so a dead one is replaced.
fn listener_pool(pool: &PgPool) -> PgPool {
    let options = (*pool.connect_options())
        .clone()
        .application_name(APPLICATION_NAME);
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .idle_timeout(None)
        .max_lifetime(None)
        .acquire_timeout(pool.options().get_acquire_timeout())
        .test_before_acquire(true)
        .connect_lazy_with(options)
}

/// Marks the listener down when its task ends, however it ends (aborted
/// with the ledger, or dropped with its runtime).
struct DownOnDrop(Arc<Shared>);

impl Drop for DownOnDrop {
    fn drop(&mut self) {
        self.0.state.send_replace(Listening::Down);
    }
}

/// The listener task: listen, relay, reconnect, until aborted. Each
/// session connects with the ledger pool's options of the moment.
async fn listen(
    shared: Arc<Shared>,
    ledger_pool: PgPool,
    channel: Arc<str>,
    mut moved: Option<Receiver<u64>>,
) {
    let _down = DownOnDrop(shared.clone());
    let mut backoff = Backoff::new(RECONNECT_FIRST, RECONNECT_MAX);
    loop {
        let mut was_up = false;
        let pool = listener_pool(&ledger_pool);
        let ended = session(&shared, &pool, &channel, &mut was_up, moved.as_mut()).await;
        // Dropped, not closed: closing waits for its connection, which a
        // frozen server never answers.
        drop(pool);
        shared.state.send_replace(Listening::Down);
        if was_up {
            // Whatever was notified since the connection died is lost:
            // every waiter looks at its record now, not at its fallback.
            shared.notifier.notify_all();
        }
        if was_up {
            // It had been listening: reconnect at once, from the first pause.
            backoff = Backoff::new(RECONNECT_FIRST, RECONNECT_MAX);
        }
        match ended {
            Ok(()) => tracing::warn!(
                backend = BACKEND,
                channel = &*channel,
                "the listener's connection was lost; waiting claims poll until it reconnects"
            ),
            Err(e) => tracing::warn!(
                backend = BACKEND,
                channel = &*channel,
                error = %e,
                "the listener cannot listen; waiting claims poll until it reconnects"
            ),
        }
        backoff.wait(RECONNECT_MAX).await;
    }
}

/// One connection's life: connect, `LISTEN`, relay until the connection is
/// lost (`Ok`) or fails (`Err`). `was_up` is set once it listened.
async fn session(
    shared: &Shared,
    pool: &PgPool,
    channel: &str,
    was_up: &mut bool,
    moved: Option<&mut Receiver<u64>>,
) -> Result<(), sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    // The pool is the listener's own; and a lost connection is reported
    // (`None`) rather than silently replaced, so the state is never `Up`
    // while notifications cannot arrive.
    listener.ignore_pool_close_event(true);
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    *was_up = true;
    shared.connects.fetch_add(1, Ordering::Relaxed);
    shared.state.send_replace(Listening::Up);
    // Listening anew: what was notified while it was down is lost too.
    shared.notifier.notify_all();
    let mut moved = moved;
    if let Some(m) = moved.as_deref_mut() {
        m.mark_unchanged();
    }
    loop {
        let next = match moved.as_deref_mut() {
            Some(m) => tokio::select! {
                next = listener.try_recv() => next?,
                // The ledger moved to another host: listen there.
                _ = m.changed() => return Ok(()),
            },
            None => listener.try_recv().await?,
        };
        let Some(notification) = next else {
            return Ok(());
        };
        if notification.channel() == channel {
            shared.received.fetch_add(1, Ordering::Relaxed);
            shared.notifier.notify(notification.payload());
        }
    }
}
