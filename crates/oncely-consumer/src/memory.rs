//! An in-process broker for tests and examples: at-least-once delivery,
//! delivery counts, delayed redelivery, a dead-letter list, and a switch that
//! drops every consumer's connection mid-handler.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::broker::{BrokerError, Delivery, Source};

/// A queue in memory. Clones share it.
///
/// Like a real broker it redelivers what was not acked: a nack (after its
/// delay), a delivery dropped unsettled, and every in-flight delivery when
/// [`MemoryBroker::kill_connections`] drops the consumers' connections (their
/// later acks then fail, as on a closed channel).
#[derive(Debug, Clone, Default)]
pub struct MemoryBroker {
    state: Arc<Mutex<State>>,
    notify: Arc<Notify>,
}

#[derive(Debug, Default)]
struct State {
    ready: VecDeque<Msg>,
    delayed: Vec<(Instant, Msg)>,
    in_flight: HashMap<u64, Msg>,
    next_tag: u64,
    next_id: u64,
    dead: Vec<DeadLetter>,
    counts: BrokerCounts,
    closed: bool,
}

#[derive(Debug, Clone)]
struct Msg {
    id: String,
    payload: Arc<[u8]>,
    deliveries: u32,
}

/// A dead-lettered message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The broker's id of the message.
    pub broker_id: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Why it was dead-lettered.
    pub reason: String,
}

/// What the broker saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BrokerCounts {
    /// Messages published.
    pub published: u64,
    /// Deliveries handed out.
    pub delivered: u64,
    /// Acks.
    pub acked: u64,
    /// Deliveries put back for another delivery (nacks, dropped
    /// deliveries, killed connections).
    pub redelivered: u64,
    /// In-flight deliveries whose connection was killed.
    pub killed: u64,
    /// Settlements refused because the delivery's connection was killed.
    pub refused: u64,
}

impl MemoryBroker {
    /// An empty queue.
    pub fn new() -> Self {
        MemoryBroker::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes a message; returns its new broker id.
    pub fn publish(&self, payload: impl Into<Vec<u8>>) -> String {
        let mut s = self.lock();
        s.next_id += 1;
        let id = format!("mem-{}", s.next_id);
        let payload: Vec<u8> = payload.into();
        s.ready.push_back(Msg {
            id: id.clone(),
            payload: payload.into(),
            deliveries: 0,
        });
        s.counts.published += 1;
        drop(s);
        self.notify.notify_waiters();
        id
    }

    /// A consumer's subscription.
    pub fn source(&self) -> MemorySource {
        MemorySource { broker: self.clone() }
    }

    /// Drops every consumer's connection: each in-flight delivery goes back
    /// to the queue unacked, and its handle's later ack, nack or dead-letter
    /// fails. Returns how many were in flight.
    pub fn kill_connections(&self) -> usize {
        let mut s = self.lock();
        let killed: Vec<Msg> = s.in_flight.drain().map(|(_, m)| m).collect();
        let n = killed.len();
        s.counts.killed += n as u64;
        s.counts.redelivered += n as u64;
        s.ready.extend(killed);
        drop(s);
        self.notify.notify_waiters();
        n
    }

    /// Makes every source's `next` return `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.notify.notify_waiters();
    }

    /// Messages not yet acked or dead-lettered (queued, delayed, in flight).
    pub fn pending(&self) -> usize {
        let s = self.lock();
        s.ready.len() + s.delayed.len() + s.in_flight.len()
    }

    /// The dead-lettered messages, oldest first.
    pub fn dead_letters(&self) -> Vec<DeadLetter> {
        self.lock().dead.clone()
    }

    /// What the broker saw.
    pub fn counts(&self) -> BrokerCounts {
        self.lock().counts
    }

    fn settle(&self, tag: u64, f: impl FnOnce(&mut State, Msg)) -> Result<(), BrokerError> {
        let mut s = self.lock();
        match s.in_flight.remove(&tag) {
            Some(m) => {
                f(&mut s, m);
                drop(s);
                self.notify.notify_waiters();
                Ok(())
            }
            None => {
                s.counts.refused += 1;
                Err(BrokerError::new("connection closed: the delivery was requeued"))
            }
        }
    }
}

/// A subscription to a [`MemoryBroker`].
#[derive(Debug)]
pub struct MemorySource {
    broker: MemoryBroker,
}

impl Source for MemorySource {
    type Delivery = MemoryDelivery;

    async fn next(&mut self) -> Result<Option<MemoryDelivery>, BrokerError> {
        loop {
            let notified = self.broker.notify.notified();
            let wait = {
                let mut s = self.broker.lock();
                if s.closed {
                    return Ok(None);
                }
                let now = Instant::now();
                let mut i = 0;
                while i < s.delayed.len() {
                    if s.delayed[i].0 <= now {
                        let (_, m) = s.delayed.swap_remove(i);
                        s.ready.push_back(m);
                    } else {
                        i += 1;
                    }
                }
                if let Some(mut m) = s.ready.pop_front() {
                    m.deliveries += 1;
                    s.next_tag += 1;
                    let tag = s.next_tag;
                    s.in_flight.insert(tag, m.clone());
                    s.counts.delivered += 1;
                    return Ok(Some(MemoryDelivery {
                        broker: self.broker.clone(),
                        tag,
                        settled: false,
                        msg: m,
                    }));
                }
                let next_due = s.delayed.iter().map(|(at, _)| *at).min();
                next_due
                    .map(|at| at.saturating_duration_since(now))
                    .unwrap_or(Duration::from_millis(50))
                    .min(Duration::from_millis(50))
            };
            // Notifications can be missed between the check and the wait;
            // the timeout bounds that.
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }
}

/// A delivery from a [`MemoryBroker`]. Dropped unsettled, it goes back to
/// the queue (a closed channel).
#[derive(Debug)]
pub struct MemoryDelivery {
    broker: MemoryBroker,
    tag: u64,
    settled: bool,
    msg: Msg,
}

impl Delivery for MemoryDelivery {
    fn payload(&self) -> &[u8] {
        &self.msg.payload
    }

    fn broker_id(&self) -> &str {
        &self.msg.id
    }

    fn delivery_count(&self) -> Option<u32> {
        Some(self.msg.deliveries)
    }

    async fn ack(mut self) -> Result<(), BrokerError> {
        self.settled = true;
        self.broker.settle(self.tag, |s, _| s.counts.acked += 1)
    }

    async fn nack(mut self, delay: Duration) -> Result<(), BrokerError> {
        self.settled = true;
        self.broker.settle(self.tag, |s, m| {
            s.counts.redelivered += 1;
            if delay.is_zero() {
                s.ready.push_back(m);
            } else {
                s.delayed.push((Instant::now() + delay, m));
            }
        })
    }

    async fn dead_letter(mut self, reason: &str) -> Result<(), BrokerError> {
        self.settled = true;
        self.broker.settle(self.tag, |s, m| {
            s.dead.push(DeadLetter {
                broker_id: m.id,
                payload: m.payload.to_vec(),
                reason: reason.to_owned(),
            })
        })
    }
}

impl Drop for MemoryDelivery {
    fn drop(&mut self) {
        if !self.settled {
            let _ = self.broker.settle(self.tag, |s, m| {
                s.counts.redelivered += 1;
                s.ready.push_back(m);
            });
        }
    }
}
