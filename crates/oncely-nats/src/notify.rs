//! Waking duplicates that wait: after every write that ends or hands over a
//! lease (complete, release, the completions of a `complete_many`) the
//! ledger wakes the watches on that key in its own process at once, and
//! publishes the displayed key on a core NATS subject of the bucket,
//! [`subject`]`(bucket)` = `oncely.<bucket>.done` (a `complete_many`
//! publishes one message with all its keys, one per line). One subscription
//! per ledger relays what other processes publish to the same in-process
//! [`Notifier`].
//!
//! # Why a core NATS subject, not a KV watch
//!
//! A KV watch is a JetStream consumer on the bucket's stream. One per waiter
//! would cost a JetStream API round trip to create it and one to delete it
//! for every wait, and consumer state on the server (for a replicated bucket,
//! agreed by the stream's peers) under exactly the load where duplicates
//! pile up. One bucket-wide watch per ledger instead would deliver every
//! write, claims included, with whole values (outcomes up to 64 KiB), and
//! needs recreating after every gap. A wake-up is only a hint (the waiter
//! claims again, and a lost one costs at most
//! [`oncely::backend::NOTIFIED_FALLBACK`]), so it needs no durability: a core
//! NATS message, published only when a lease ends, carrying just the key,
//! with no server state beyond one subscription per ledger, is the cheapest
//! thing that works. The price: every ledger on the bucket receives every
//! completion of the bucket (the key, at most 255 bytes), as every listener
//! of a PostgreSQL channel does.
//!
//! While the subscription is down (the connection is reconnecting, or the
//! relay stopped), [`Notifications::watch`] hands out polling watches: a
//! notified watch that nothing can wake would wait the whole fallback.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_nats::Client;
use futures_util::StreamExt;
use oncely::EffectKey;
use oncely::backend::Backoff;
use oncely::backend::{Notifier, Watch};

/// The subject completions of `bucket` are published on:
/// `oncely.<bucket>.done`. Bucket names are letters, digits, `_` and `-`
/// (the options check it), all valid in a subject token; anything else is
/// escaped as `=XX` anyway (`=` itself included), so whatever name a store
/// carries, the subject is one valid token between `oncely.` and `.done`, and
/// two buckets never share a subject.
pub(crate) fn subject(bucket: &str) -> String {
    let mut token = String::with_capacity(bucket.len() + 8);
    for b in bucket.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            token.push(b as char);
        } else {
            token.push_str(&format!("={b:02X}"));
        }
    }
    if token.is_empty() {
        token.push('=');
    }
    format!("oncely.{token}.done")
}

/// What the relay task and the ledger share.
#[derive(Debug, Default)]
struct Relay {
    /// The relay holds a live subscription.
    subscribed: AtomicBool,
    /// Keys received on the subject.
    received: AtomicU64,
}

/// A ledger's notifications: the in-process [`Notifier`], and, when the
/// ledger has a client, the publishing side and the relay task.
#[derive(Debug)]
pub(crate) struct Notifications {
    notifier: Arc<Notifier>,
    /// `None`: in-process notifications only (a read-only ledger, which
    /// never completes anything and never waits).
    remote: Option<Remote>,
}

#[derive(Debug)]
struct Remote {
    client: Client,
    subject: async_nats::Subject,
    relay: Arc<Relay>,
    /// Stops the relay (and drops its subscription) with the ledger.
    task: tokio::task::AbortHandle,
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Notifications {
    /// In-process notifications only.
    pub(crate) fn local() -> Self {
        Notifications {
            notifier: Arc::new(Notifier::new()),
            remote: None,
        }
    }

    /// Subscribes to `bucket`'s subject on `client` and starts the relay.
    /// The subscription is flushed to the server before this returns, so a
    /// ledger listens from the moment it is opened. A subscription that
    /// fails leaves the ledger polling until the relay's retry succeeds.
    pub(crate) async fn subscribe(client: Client, bucket: &str) -> Self {
        let notifier = Arc::new(Notifier::new());
        let subject = async_nats::Subject::from(subject(bucket));
        let relay = Arc::new(Relay::default());
        let first = match client.subscribe(subject.clone()).await {
            Ok(sub) => {
                if let Err(e) = client.flush().await {
                    tracing::debug!(error = %e, "flushing the notification subscription");
                }
                relay.subscribed.store(true, Ordering::SeqCst);
                Some(sub)
            }
            Err(e) => {
                tracing::warn!(%subject, error = %e, "cannot subscribe to completion notifications; waiters poll");
                None
            }
        };
        let task = tokio::spawn(run_relay(
            client.clone(),
            subject.clone(),
            first,
            notifier.clone(),
            relay.clone(),
        ))
        .abort_handle();
        Notifications {
            notifier,
            remote: Some(Remote {
                client,
                subject,
                relay,
                task,
            }),
        }
    }

    /// A watch on `key`: notified while the relay listens, polling otherwise
    /// (and on a ledger without a client, whose only notifications would be
    /// its own).
    pub(crate) fn watch(&self, key: &EffectKey) -> Watch {
        if self.listening() {
            self.notifier.watch(key)
        } else {
            Watch::polling()
        }
    }

    /// Whether notifications from other processes reach this ledger now:
    /// the relay is subscribed and the connection is up.
    pub(crate) fn listening(&self) -> bool {
        self.remote.as_ref().is_some_and(|r| {
            !r.task.is_finished()
                && r.relay.subscribed.load(Ordering::SeqCst)
                && r.client.connection_state() == async_nats::connection::State::Connected
        })
    }

    /// Keys received on the subject so far.
    pub(crate) fn received(&self) -> u64 {
        self.remote
            .as_ref()
            .map_or(0, |r| r.relay.received.load(Ordering::Relaxed))
    }

    /// Tells waiters that `key`'s lease ended (completed or released): at
    /// once in this process, and on the subject for the others.
    pub(crate) async fn finished(&self, key: &EffectKey) {
        self.finished_many(std::iter::once(key)).await;
    }

    /// [`Notifications::finished`] for several keys (a `complete_many`): one
    /// message carries them all, one per line (keys never contain control
    /// characters), split only to stay far below the server's payload
    /// limit. A publish is queued on the connection, no round trip; a
    /// failure only costs the waiters latency, so it is logged, not
    /// returned.
    pub(crate) async fn finished_many<'a>(&self, keys: impl IntoIterator<Item = &'a EffectKey>) {
        let mut payload = Vec::new();
        for key in keys {
            self.notifier.notify(key.as_str());
            if self.remote.is_none() {
                continue;
            }
            if !payload.is_empty() && payload.len() + key.as_str().len() >= MAX_PAYLOAD {
                self.publish(std::mem::take(&mut payload)).await;
            }
            if !payload.is_empty() {
                payload.push(b'\n');
            }
            payload.extend_from_slice(key.as_str().as_bytes());
        }
        if !payload.is_empty() {
            self.publish(payload).await;
        }
    }

    async fn publish(&self, payload: Vec<u8>) {
        if let Some(r) = &self.remote
            && let Err(e) = r.client.publish(r.subject.clone(), payload.into()).await
        {
            tracing::debug!(subject = %r.subject, error = %e, "completion notification not published");
        }
    }
}

/// The most bytes of keys one notification carries: far below any server's
/// `max_payload` (1 MiB by default, rarely lowered below 64 KiB).
const MAX_PAYLOAD: usize = 32 * 1024;

/// Relays every key published on `subject` to `notifier`; subscribes again
/// (with a backoff) if the subscription ends. async-nats renews a
/// subscription itself across reconnections; it ends only when the client
/// is closed or the server drops it.
async fn run_relay(
    client: Client,
    subject: async_nats::Subject,
    mut sub: Option<async_nats::Subscriber>,
    notifier: Arc<Notifier>,
    relay: Arc<Relay>,
) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        if let Some(mut s) = sub.take() {
            relay.subscribed.store(true, Ordering::SeqCst);
            backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
            while let Some(msg) = s.next().await {
                // Keys, one per line; anything but a displayed key wakes
                // nobody.
                for key in msg.payload.split(|b| *b == b'\n') {
                    relay.received.fetch_add(1, Ordering::Relaxed);
                    if let Ok(key) = std::str::from_utf8(key) {
                        notifier.notify(key);
                    }
                }
            }
            relay.subscribed.store(false, Ordering::SeqCst);
            tracing::debug!(%subject, "notification subscription ended; subscribing again");
        }
        tokio::time::sleep(backoff.next_delay()).await;
        match client.subscribe(subject.clone()).await {
            Ok(s) => sub = Some(s),
            Err(e) => tracing::debug!(%subject, error = %e, "subscribing to completion notifications"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the bucket is called, its subject is `oncely.<one valid
    /// token>.done`, distinct per bucket.
    #[test]
    fn subjects_are_valid_whatever_the_bucket() {
        assert_eq!(subject("oncely_effects"), "oncely.oncely_effects.done");
        assert_eq!(subject("a-B_9"), "oncely.a-B_9.done");
        let weird = ["a.b", "a b", "a*", ">", "x=2E", "é", "", "a\tb", "a.b.>"];
        let mut seen = std::collections::HashSet::new();
        for b in weird.iter().copied().chain(["oncely_effects"]) {
            let s = subject(b);
            let token = s
                .strip_prefix("oncely.")
                .and_then(|s| s.strip_suffix(".done"))
                .unwrap();
            assert!(!token.is_empty(), "{b:?}");
            assert!(
                token
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'='),
                "{b:?} gives {s:?}"
            );
            assert!(seen.insert(s), "{b:?} shares a subject");
        }
    }
}
