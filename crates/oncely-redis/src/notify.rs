//! Change notifications: what wakes a duplicate that waits for a record in
//! progress ([`Ledger::watch`](oncely::backend::Ledger::watch)) when its holder
//! completes or releases it, instead of a timer.
//!
//! Two paths, one [`Notifier`] per ledger (clones share it):
//!
//! - in this process: after each of its own completions and releases the
//!   ledger notifies its waiters directly, with no round trip;
//! - across processes: a claim that would wait marks the record with its
//!   ledger's mark (claim.lua), and a completion or release of a marked
//!   record by another ledger `PUBLISH`es the effect key on the channel of
//!   the ledger's prefix (prelude.lua, `wake`). One subscription per ledger
//!   (one connection, [`subscriber`]) relays those messages to the notifier.
//!
//! A completion nobody waits for publishes nothing: with one subscriber, a
//! `PUBLISH` on every completion cost about 8 µs of server CPU per
//! claim + complete (a write to the subscriber's socket), a quarter more.
//!
//! While the subscription is down (never up yet, the connection lost, the
//! server refusing `SUBSCRIBE`), [`Notifications::watch`] hands out polling
//! watches, and a notified watch taken just before a loss waits for its
//! fallback ([`NOTIFIED_FALLBACK`](oncely::backend::NOTIFIED_FALLBACK)): a
//! lost message costs latency, never a wrong answer, because a waiter always
//! claims again when it wakes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::backend::Backoff;
use oncely::backend::{Notifier, Watch};
use oncely::{ClaimOptions, EffectKey, OnInProgress};
use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind,
    RedisResult, Value,
};
use tokio::sync::{mpsc, oneshot};

use crate::sentinel::SentinelConn;

/// How often the subscriber checks that its connection still answers: a
/// connection that died without a word (a network partition) is noticed
/// within this, plus the response timeout.
const PING_EVERY: Duration = Duration::from_secs(5);

/// Where the subscriber subscribes.
pub(crate) enum Source {
    /// A server, or a cluster's seed nodes, tried in turn.
    Nodes(Vec<String>),
    /// The server of a caller's client.
    Client(ConnectionInfo),
    /// The primary the Sentinels name at each attempt: after a failover the
    /// subscription is lost with the old primary (or stops answering its
    /// `PING`s), and the next attempt subscribes on the new one.
    Sentinel(SentinelConn),
}

impl Source {
    /// The node of attempt `turn`.
    async fn node(&self, turn: usize) -> RedisResult<ConnectionInfo> {
        match self {
            Source::Nodes(nodes) => nodes[turn % nodes.len()].as_str().into_connection_info(),
            Source::Client(info) => Ok(info.clone()),
            Source::Sentinel(s) => s.primary_url().await,
        }
    }
}

/// A ledger's notifications; see the module docs.
#[derive(Debug)]
pub(crate) struct Notifications {
    notifier: Arc<Notifier>,
    state: Arc<State>,
    /// This ledger's waiter mark: 16 hex digits, random per ledger.
    mark: String,
    /// `<prefix>#changes@<db>`: ledgers with another prefix or database
    /// never wake each other (pub/sub ignores databases).
    channel: String,
    /// Dropped with the last clone of the ledger: the subscriber stops.
    _stop: Option<oneshot::Sender<()>>,
}

/// What the subscriber shares with the ledger.
#[derive(Debug, Default)]
struct State {
    up: AtomicBool,
    relayed: AtomicU64,
}

impl Notifications {
    /// No subscription (a read-only ledger, or notifications turned off):
    /// polling watches, and no waiter marks.
    pub(crate) fn off(channel: String) -> Self {
        Notifications {
            notifier: Arc::new(Notifier::new()),
            state: Arc::new(State::default()),
            mark: mark(),
            channel,
            _stop: None,
        }
    }

    /// Starts the subscriber on `source` (a server, a cluster's seed
    /// nodes tried in turn, or the primary Sentinel names) and waits for its
    /// first attempt, so that a ledger returned by `connect` is subscribed
    /// unless that failed (then logged; the subscriber keeps trying in the
    /// background).
    pub(crate) async fn start(source: Source, channel: String, timeout: Duration) -> Self {
        let mut n = Notifications::off(channel);
        let (stop, stopped) = oneshot::channel();
        let (first, first_done) = oneshot::channel();
        tokio::spawn(subscriber(
            source,
            n.channel.clone(),
            n.notifier.clone(),
            n.state.clone(),
            timeout,
            stopped,
            first,
        ));
        let _ = first_done.await;
        n._stop = Some(stop);
        n
    }

    /// Whether the subscription is up.
    pub(crate) fn is_up(&self) -> bool {
        self.state.up.load(Ordering::SeqCst)
    }

    /// How many messages the subscription relayed.
    pub(crate) fn relayed(&self) -> u64 {
        self.state.relayed.load(Ordering::SeqCst)
    }

    /// A notified watch while the subscription is up, else a polling one.
    pub(crate) fn watch(&self, key: &EffectKey) -> Watch {
        if self.is_up() {
            self.notifier.watch(key)
        } else {
            Watch::polling()
        }
    }

    /// Wakes this ledger's own waiters of `key` (after its own write).
    pub(crate) fn notify(&self, key: &EffectKey) {
        self.notifier.notify(key.as_str());
    }

    /// The mark a claim leaves on a record it finds in progress: this
    /// ledger's, if the caller would wait and a notification can reach it;
    /// none otherwise (nobody to wake, so nothing to write).
    pub(crate) fn waiter(&self, opts: &ClaimOptions) -> &str {
        match opts.on_in_progress {
            OnInProgress::Wait { max } if !max.is_zero() && self._stop.is_some() => &self.mark,
            _ => "",
        }
    }

    /// This ledger's mark, which its own writes pass so that they publish
    /// only for waiters of other ledgers.
    pub(crate) fn mark(&self) -> &str {
        &self.mark
    }

    /// The channel the scripts publish on.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }
}

/// A fresh waiter mark: distinct per ledger, not a secret.
fn mark() -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    h.update(&SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    h.update(&nanos.to_le_bytes());
    h.finalize().to_hex()[..16].to_owned()
}

/// The subscriber: subscribes to `channel` on a node of `source` and relays
/// each message (an effect key) to `notifier`, reconnecting with a backoff
/// when the connection is lost, until `stop` resolves (the ledger is gone).
/// `first` is told when the first attempt has succeeded or failed.
async fn subscriber(
    source: Source,
    channel: String,
    notifier: Arc<Notifier>,
    state: Arc<State>,
    timeout: Duration,
    mut stop: oneshot::Receiver<()>,
    first: oneshot::Sender<()>,
) {
    let mut first = Some(first);
    let mut backoff = retry_backoff();
    let mut warned = false;
    for turn in 0.. {
        let attempt = tokio::select! {
            _ = &mut stop => return,
            node = source.node(turn) => match node {
                Ok(node) => tokio::select! {
                    _ = &mut stop => return,
                    r = tokio::time::timeout(timeout, subscribe(node, &channel, timeout)) => r,
                },
                Err(e) => Ok(Err(e)),
            },
        };
        match attempt {
            Ok(Ok((conn, pushes))) => {
                state.up.store(true, Ordering::SeqCst);
                if let Some(f) = first.take() {
                    let _ = f.send(());
                }
                if warned {
                    tracing::info!("redis ledger: change notifications subscribed again");
                }
                backoff = retry_backoff();
                let stopped = relay(conn, pushes, &notifier, &state, timeout, &mut stop).await;
                state.up.store(false, Ordering::SeqCst);
                if stopped {
                    return;
                }
                tracing::warn!(
                    "redis ledger: change notifications lost their connection; waiting duplicates poll \
                     until it is back"
                );
                warned = true;
            }
            Ok(Err(e)) => {
                if !warned {
                    tracing::warn!(
                        error = %e,
                        "redis ledger: cannot subscribe to change notifications; waiting duplicates poll"
                    );
                    warned = true;
                }
            }
            Err(_) => {
                if !warned {
                    tracing::warn!(
                        "redis ledger: subscribing to change notifications timed out; waiting duplicates poll"
                    );
                    warned = true;
                }
            }
        }
        if let Some(f) = first.take() {
            let _ = f.send(());
        }
        tokio::select! {
            _ = &mut stop => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

/// The pauses between two attempts to subscribe: 50 ms, doubling up to 5 s.
fn retry_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(50), Duration::from_secs(5))
}

/// A RESP3 connection to `node` subscribed to `channel`, and the receiver of
/// its pushes (messages, and a disconnection). RESP3, so that the
/// connection's pushes arrive on a plain channel and the same connection
/// still answers `PING`.
async fn subscribe(
    info: ConnectionInfo,
    channel: &str,
    timeout: Duration,
) -> redis::RedisResult<(MultiplexedConnection, mpsc::UnboundedReceiver<PushInfo>)> {
    let settings = info.redis_settings().clone().set_protocol(ProtocolVersion::RESP3);
    let client = redis::Client::open(info.set_redis_settings(settings))?;
    let (tx, rx) = mpsc::unbounded_channel();
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_push_sender(tx);
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    // Returns once the server confirmed: every PUBLISH it runs from here on
    // reaches this connection.
    conn.subscribe(channel).await?;
    Ok((conn, rx))
}

/// Relays messages until the connection is lost (`false`) or the ledger is
/// gone (`true`).
async fn relay(
    mut conn: MultiplexedConnection,
    mut pushes: mpsc::UnboundedReceiver<PushInfo>,
    notifier: &Notifier,
    state: &State,
    timeout: Duration,
    stop: &mut oneshot::Receiver<()>,
) -> bool {
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.tick().await;
    loop {
        tokio::select! {
            _ = &mut *stop => return true,
            push = pushes.recv() => match push {
                Some(PushInfo { kind: PushKind::Message, data }) => {
                    if let Some(Value::BulkString(key)) = data.get(1)
                        && let Ok(key) = std::str::from_utf8(key)
                    {
                        state.relayed.fetch_add(1, Ordering::SeqCst);
                        notifier.notify(key);
                    }
                }
                Some(PushInfo { kind: PushKind::Disconnection, .. }) | None => return false,
                // Our subscription's confirmation, or an unsubscription
                // (nobody unsubscribes this connection but the server).
                Some(PushInfo { kind: PushKind::Unsubscribe, .. }) => return false,
                Some(_) => {}
            },
            _ = ping.tick() => {
                let pong = tokio::time::timeout(
                    timeout,
                    redis::cmd("PING").query_async::<Value>(&mut conn),
                )
                .await;
                if !matches!(pong, Ok(Ok(_))) {
                    return false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_differ_per_ledger() {
        let (a, b) = (mark(), mark());
        assert_ne!(a, b);
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn only_a_caller_that_waits_leaves_a_mark() {
        let off = Notifications::off("c".into());
        assert_eq!(off.waiter(&ClaimOptions::default()), "", "nobody to wake");
        let (stop, _stopped) = oneshot::channel();
        let on = Notifications {
            _stop: Some(stop),
            ..Notifications::off("c".into())
        };
        assert_eq!(on.waiter(&ClaimOptions::default()), on.mark());
        let reject = ClaimOptions::default().on_in_progress(OnInProgress::Reject);
        assert_eq!(on.waiter(&reject), "");
        let no_wait = ClaimOptions::default().on_in_progress(OnInProgress::Wait { max: Duration::ZERO });
        assert_eq!(on.waiter(&no_wait), "");
    }
}
