//! Waiting for a record to change: what a duplicate holds while the effect is
//! in progress elsewhere, so that it is woken when the holder completes or
//! releases instead of polling on a timer.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

use crate::backoff::Backoff;
use crate::key::EffectKey;

/// How long a watch that has notifications waits at most before the runner
/// looks again anyway: a notification lost (a listener reconnecting, a
/// message dropped) costs at most this much latency, never a wrong answer.
pub const NOTIFIED_FALLBACK: Duration = Duration::from_secs(1);

/// A subscription to changes of one key's record, taken by
/// [`Ledger::watch`](crate::ledger::Ledger::watch) after a claim found the effect in
/// progress. [`Watch::changed`] resolves when the record may have changed.
///
/// Two kinds: a *notified* watch (the backend wakes it when the holder
/// completes, releases or loses the lease), and a *polling* watch for
/// backends without change notifications, which wakes on a backoff (5 ms,
/// doubling up to 250 ms). Either way the caller claims again when it wakes:
/// a wake-up is a hint, never an answer.
#[derive(Debug)]
pub struct Watch {
    kind: Kind,
    /// The notifier's count of live watches, decremented on drop.
    live: Option<Arc<AtomicUsize>>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(live) = &self.live {
            live.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[derive(Debug)]
enum Kind {
    Polling(Backoff),
    Notified(Arc<Notify>, Pin<Box<OwnedNotified>>),
}

/// A notification future for `notify`, armed now: a `notify_waiters` from
/// here on wakes it, even before it is first polled.
fn armed(notify: &Arc<Notify>) -> Pin<Box<OwnedNotified>> {
    let mut notified = Box::pin(notify.clone().notified_owned());
    notified.as_mut().enable();
    notified
}

impl Watch {
    /// A watch without notifications: it wakes on a backoff.
    pub fn polling() -> Self {
        Watch {
            kind: Kind::Polling(Backoff::new(Duration::from_millis(5), Duration::from_millis(250))),
            live: None,
        }
    }

    /// Whether the backend wakes this watch on a change (else it polls).
    pub fn is_notified(&self) -> bool {
        matches!(self.kind, Kind::Notified(..))
    }

    /// Resolves when the record may have changed, or at `until` at the
    /// latest: a notified watch on its notification (or after
    /// [`NOTIFIED_FALLBACK`]), a polling one after its next backoff step.
    /// The watch stays armed: a notification that arrives after this returns
    /// wakes the next call.
    pub async fn changed(&mut self, until: Instant) {
        let left = until.saturating_duration_since(Instant::now());
        match &mut self.kind {
            Kind::Polling(backoff) => backoff.wait(left).await,
            Kind::Notified(notify, notified) => {
                let woken = tokio::select! {
                    () = notified.as_mut() => true,
                    () = tokio::time::sleep(left.min(NOTIFIED_FALLBACK)) => false,
                };
                if woken {
                    // A finished future is not polled again: arm a new one
                    // before the caller looks at the record.
                    *notified = armed(notify);
                }
            }
        }
    }
}

/// In-process wake-ups per key, for a backend's [`Ledger::watch`]: a watch
/// taken with [`Notifier::watch`] is woken by any [`Notifier::notify`] of its
/// key that happens after the watch was taken (none is lost between the two).
///
/// A backend notifies after its own writes that end or hand over a lease
/// (complete, release), and, where the database can tell other processes
/// (PostgreSQL `NOTIFY`, Redis `PUBLISH`, a NATS subject), from a listener
/// that relays what the other processes wrote.
///
/// [`Ledger::watch`]: crate::ledger::Ledger::watch
#[derive(Debug, Default)]
pub struct Notifier {
    keys: Mutex<HashMap<String, Weak<Notify>>>,
    /// Watches taken and not yet dropped: `notify` skips the map when none
    /// is (the common case: nobody waits on a key that completes).
    live: Arc<AtomicUsize>,
}

impl Notifier {
    /// A notifier with no watchers.
    pub fn new() -> Self {
        Self::default()
    }

    /// A notified watch on `key`, armed now.
    pub fn watch(&self, key: &EffectKey) -> Watch {
        self.watch_str(key.as_str())
    }

    /// [`Notifier::watch`] by the displayed key.
    pub fn watch_str(&self, key: &str) -> Watch {
        let notify = {
            let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            if keys.len() > 1024 && keys.len().is_power_of_two() {
                keys.retain(|_, w| w.strong_count() > 0);
            }
            match keys.get(key).and_then(Weak::upgrade) {
                Some(n) => n,
                None => {
                    let n = Arc::new(Notify::new());
                    keys.insert(key.to_owned(), Arc::downgrade(&n));
                    n
                }
            }
        };
        let notified = armed(&notify);
        self.live.fetch_add(1, Ordering::AcqRel);
        Watch {
            kind: Kind::Notified(notify, notified),
            live: Some(self.live.clone()),
        }
    }

    /// Wakes every watch on `key` (the displayed effect key).
    pub fn notify(&self, key: &str) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let notify = {
            let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            keys.get(key).and_then(Weak::upgrade)
        };
        if let Some(n) = notify {
            n.notify_waiters();
        }
    }

    /// Wakes every watch, whatever its key: for a backend whose source of
    /// notifications was lost (its listener's connection dropped), so that
    /// every waiter looks at its record now rather than at its fallback
    /// (a notification may have been missed meanwhile).
    pub fn notify_all(&self) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let live: Vec<Arc<Notify>> = {
            let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            keys.values().filter_map(Weak::upgrade).collect()
        };
        for n in live {
            n.notify_waiters();
        }
    }

    /// How many keys have a live watch (for tests and metrics).
    pub fn watched(&self) -> usize {
        let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.values().filter(|w| w.strong_count() > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Tenant;

    fn key() -> EffectKey {
        EffectKey::new(&Tenant::global(), "capture", "order-1").unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_notify_after_the_watch_is_never_lost() {
        let n = Notifier::new();
        let mut w = n.watch(&key());
        assert!(w.is_notified());
        // Notified before anyone awaits: the watch still sees it.
        n.notify(key().as_str());
        let start = tokio::time::Instant::now();
        w.changed(Instant::now() + Duration::from_secs(60)).await;
        assert!(start.elapsed() < NOTIFIED_FALLBACK, "woken by the notification");
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_stays_armed_after_a_wake_up() {
        let n = Notifier::new();
        let mut w = n.watch(&key());
        n.notify(key().as_str());
        w.changed(Instant::now() + Duration::from_secs(60)).await;
        // The second notification comes between two calls.
        n.notify(key().as_str());
        let start = tokio::time::Instant::now();
        w.changed(Instant::now() + Duration::from_secs(60)).await;
        assert!(
            start.elapsed() < NOTIFIED_FALLBACK,
            "woken by the second notification"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_notification_the_fallback_bounds_the_wait() {
        let n = Notifier::new();
        let mut w = n.watch(&key());
        n.notify("_global/capture:order-2");
        let start = tokio::time::Instant::now();
        w.changed(Instant::now() + Duration::from_secs(60)).await;
        assert!(start.elapsed() >= NOTIFIED_FALLBACK);
        assert_eq!(n.watched(), 1);
        drop(w);
        assert_eq!(n.watched(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn notify_all_wakes_every_key() {
        let n = Notifier::new();
        let other = EffectKey::new(&Tenant::global(), "capture", "order-2").unwrap();
        let (mut a, mut b) = (n.watch(&key()), n.watch(&other));
        n.notify_all();
        let start = tokio::time::Instant::now();
        a.changed(Instant::now() + Duration::from_secs(60)).await;
        b.changed(Instant::now() + Duration::from_secs(60)).await;
        assert!(start.elapsed() < NOTIFIED_FALLBACK, "both woken at once");
    }

    #[tokio::test(start_paused = true)]
    async fn polling_backs_off() {
        let mut w = Watch::polling();
        assert!(!w.is_notified());
        let start = tokio::time::Instant::now();
        w.changed(Instant::now() + Duration::from_secs(60)).await;
        w.changed(Instant::now() + Duration::from_secs(60)).await;
        assert_eq!(start.elapsed(), Duration::from_millis(15));
    }
}
