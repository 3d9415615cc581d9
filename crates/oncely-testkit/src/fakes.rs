//! Fakes of the services every payment handler calls, for your tests: a
//! payment provider that honours idempotency keys ([`FakeProvider`]) and a
//! mailer that does not ([`FakeMailer`]), both counting what they did, so a
//! test asserts "captured once, one receipt" after any number of
//! deliveries.
//!
//! ```
//! use oncely_testkit::fakes::{FakeMailer, FakeProvider};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let provider = FakeProvider::new(true);
//! let first = provider.capture("key-1", "order-1", 1250).await;
//! let again = provider.capture("key-1", "order-1", 1250).await; // a retry, same key
//! assert_eq!(first, again);
//! assert_eq!(provider.captures()["order-1"], 1); // money moved once
//! assert_eq!(provider.calls(), 2);               // the provider was asked twice
//!
//! let mailer = FakeMailer::default();
//! mailer.send_receipt("order-1").await;
//! assert_eq!(mailer.sends()["order-1"], 1);
//! # }
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// A charge as the provider reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// The provider's charge id.
    pub id: String,
    /// The captured amount, in cents.
    pub amount: i64,
}

/// An in-process payment provider that counts captures per order and, when
/// `honour_keys` is on, answers a repeated idempotency key with the first
/// charge instead of capturing again (as real payment APIs do).
#[derive(Debug)]
pub struct FakeProvider {
    honour_keys: AtomicBool,
    outage: AtomicBool,
    seq: AtomicU64,
    calls: AtomicU64,
    state: Mutex<ProviderState>,
}

#[derive(Debug, Default)]
struct ProviderState {
    by_key: HashMap<String, Charge>,
    captures: BTreeMap<String, u32>,
}

impl FakeProvider {
    /// A provider that honours idempotency keys or ignores them.
    pub fn new(honour_keys: bool) -> Self {
        FakeProvider {
            honour_keys: AtomicBool::new(honour_keys),
            outage: AtomicBool::new(false),
            seq: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            state: Mutex::new(ProviderState::default()),
        }
    }

    /// Captures `amount` for `order`. A network call: it yields.
    pub async fn capture(&self, idempotency_key: &str, order: &str, amount: i64) -> Charge {
        tokio::task::yield_now().await;
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut s = self.state.lock().unwrap();
        if self.honour_keys.load(Ordering::SeqCst)
            && let Some(first) = s.by_key.get(idempotency_key)
        {
            return first.clone();
        }
        let charge = Charge {
            id: format!("ch_{}", self.seq.fetch_add(1, Ordering::SeqCst) + 1),
            amount,
        };
        s.by_key.insert(idempotency_key.to_owned(), charge.clone());
        *s.captures.entry(order.to_owned()).or_default() += 1;
        charge
    }

    /// How many capture calls the provider answered, a repeated key's
    /// included: above the sum of [`captures`](Self::captures), it counts
    /// retries the provider deduplicated.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// How many times money was actually captured for each order.
    pub fn captures(&self) -> BTreeMap<String, u32> {
        self.state.lock().unwrap().captures.clone()
    }

    /// The charge made under `idempotency_key`, if any: the provider's
    /// lookup that reconciliation asks (payment APIs list charges by their
    /// idempotency key). Fails while [`FakeProvider::set_outage`] is on.
    pub async fn charge_by_key(&self, idempotency_key: &str) -> Result<Option<Charge>, ProviderDown> {
        tokio::task::yield_now().await;
        if self.outage.load(Ordering::SeqCst) {
            return Err(ProviderDown);
        }
        Ok(self.state.lock().unwrap().by_key.get(idempotency_key).cloned())
    }

    /// Makes lookups fail (the provider's API is down) or work again.
    pub fn set_outage(&self, down: bool) {
        self.outage.store(down, Ordering::SeqCst);
    }
}

/// The provider's API did not answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProviderDown;

impl std::fmt::Display for ProviderDown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the provider's API is unavailable")
    }
}

impl std::error::Error for ProviderDown {}

/// An in-process mailer that sends every time it is asked (no
/// deduplication) and counts sends per order.
#[derive(Debug, Default)]
pub struct FakeMailer {
    sends: Mutex<BTreeMap<String, u32>>,
    lost: Mutex<std::collections::BTreeSet<String>>,
}

/// What the mailer's message log says about one order's receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MailLog {
    /// The receipt went out this many times.
    Sent(u32),
    /// The log covers the order and shows no receipt.
    NotSent,
    /// The log no longer covers the order (past its retention, or lost):
    /// nobody can tell.
    Gone,
}

impl FakeMailer {
    /// Sends the receipt of `order`. A network call: it yields.
    pub async fn send_receipt(&self, order: &str) {
        tokio::task::yield_now().await;
        *self.sends.lock().unwrap().entry(order.to_owned()).or_default() += 1;
    }

    /// How many receipts went out for each order.
    pub fn sends(&self) -> BTreeMap<String, u32> {
        self.sends.lock().unwrap().clone()
    }

    /// Looks the order's receipt up in the message log (what reconciliation
    /// asks a mail provider).
    pub async fn log(&self, order: &str) -> MailLog {
        tokio::task::yield_now().await;
        if self.lost.lock().unwrap().contains(order) {
            return MailLog::Gone;
        }
        match self.sends.lock().unwrap().get(order) {
            Some(&n) if n > 0 => MailLog::Sent(n),
            _ => MailLog::NotSent,
        }
    }

    /// Drops the order from the message log (it aged out): a lookup answers
    /// [`MailLog::Gone`].
    pub fn lose_log(&self, order: &str) {
        self.lost.lock().unwrap().insert(order.to_owned());
    }
}
