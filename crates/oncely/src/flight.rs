//! In-process single-flight: a duplicate that arrives while this process
//! holds its key waits for the holder in memory, and is answered with the
//! outcome the holder's completion wrote, without a round trip.
//!
//! The rule, kept here and nowhere else: a waiter is answered from memory
//! only with an outcome whose completion the ledger has acknowledged
//! (`complete` returned `Ok`), and only when it asked what the holder asked
//! (the same fingerprint, the same at-most-once mode). Anything else (the
//! holder released, kept, lost its lease, failed to complete, or its lease
//! may have ended) sends the waiter to the ledger, as if this module did not
//! exist: a wake-up from here is never a guess.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use tokio::sync::watch;

use crate::key::EffectKey;
use crate::record::{ClaimOptions, Fingerprint, Lease, Outcome};

/// The keys this process holds through one runner, and who waits on them.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    held: Mutex<HashMap<EffectKey, Arc<Flight>>>,
}

/// One holder's flight: what it claimed with, and how it landed.
#[derive(Debug)]
struct Flight {
    fence: u64,
    fingerprint: Option<Fingerprint>,
    at_most_once: bool,
    /// When the key was first claimed, on the backend's clock.
    first_claimed_at: SystemTime,
    /// The grant, on the backend's clock and on this worker's.
    acquired_at: SystemTime,
    granted: Instant,
    /// When the holder's lease ends at the earliest, on this worker's clock:
    /// a waiter never waits past it (another process may take over then).
    deadline: Instant,
    landed: watch::Sender<Option<Landed>>,
}

#[derive(Debug, Clone)]
enum Landed {
    /// The holder's completion was acknowledged with this outcome.
    Completed(Outcome),
    /// The holder settled any other way: ask the ledger.
    Elsewhere,
}

/// What a local wait resolved to.
pub(crate) struct Answer {
    /// The outcome the holder's acknowledged completion wrote.
    pub(crate) outcome: Outcome,
    /// When the key was first claimed and, approximately, when the answer
    /// was read, on the backend's clock (for the redelivery-gap histogram).
    pub(crate) first_claimed_at: SystemTime,
    pub(crate) read_at: SystemTime,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every change under the lock is one insert or one remove.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Flights {
    /// Records that this process holds `lease` (claimed with `opts`) until
    /// the returned [`Holding`] lands or is dropped. A flight left by an
    /// earlier holder of the key in this process (its lease taken over) is
    /// replaced: its waiters still hear how it landed.
    pub(crate) fn hold(&self, lease: &Lease, opts: &ClaimOptions, deadline: Instant) -> Holding<'_> {
        let (landed, _) = watch::channel(None);
        let flight = Arc::new(Flight {
            fence: lease.fence,
            fingerprint: opts.fingerprint,
            at_most_once: opts.at_most_once,
            first_claimed_at: lease.first_claimed_at,
            acquired_at: lease.acquired_at,
            granted: Instant::now(),
            deadline,
            landed,
        });
        lock(&self.held).insert(lease.key.clone(), flight.clone());
        Holding {
            flights: self,
            key: lease.key.clone(),
            flight,
            landed: false,
        }
    }

    /// Waits for this process's holder of `key`, if there is one that
    /// claimed as `opts` does (and, given `fence`, holds that fence), until
    /// `until` or the holder's lease end at the latest. `Some` only with an
    /// acknowledged completion's outcome; `None` means: ask the ledger.
    pub(crate) async fn wait(
        &self,
        key: &EffectKey,
        opts: &ClaimOptions,
        fence: Option<u64>,
        until: Instant,
    ) -> Option<Answer> {
        let (flight, mut landed) = {
            let held = lock(&self.held);
            let flight = held.get(key)?;
            let same_request =
                flight.fingerprint == opts.fingerprint && flight.at_most_once == opts.at_most_once;
            if !same_request || fence.is_some_and(|f| f != flight.fence) {
                return None;
            }
            // Subscribed under the lock: a holder removes its flight under
            // it before telling how it landed, so no landing is missed.
            (flight.clone(), flight.landed.subscribe())
        };
        let until = until.min(flight.deadline);
        let outcome = tokio::time::timeout_at(until.into(), async {
            let landed = landed.wait_for(Option::is_some).await.ok()?;
            match landed.as_ref() {
                Some(Landed::Completed(outcome)) => Some(outcome.clone()),
                _ => None,
            }
        })
        .await
        .ok()
        .flatten()?;
        Some(Answer {
            outcome,
            first_claimed_at: flight.first_claimed_at,
            read_at: flight.acquired_at + flight.granted.elapsed(),
        })
    }
}

/// A key this process holds: tells its local waiters how it landed when
/// [`Holding::completed`] is called or when it is dropped (any other end).
#[derive(Debug)]
pub(crate) struct Holding<'a> {
    flights: &'a Flights,
    key: EffectKey,
    flight: Arc<Flight>,
    landed: bool,
}

impl Holding<'_> {
    /// The ledger acknowledged the completion with `outcome`: waiters get it.
    pub(crate) fn completed(mut self, outcome: &Outcome) {
        self.land(|| Landed::Completed(outcome.clone()));
    }

    fn land(&mut self, how: impl FnOnce() -> Landed) {
        self.landed = true;
        {
            let mut held = lock(&self.flights.held);
            if held.get(&self.key).is_some_and(|f| Arc::ptr_eq(f, &self.flight)) {
                held.remove(&self.key);
            }
        }
        // Nobody subscribes once the flight is out of the map.
        if self.flight.landed.receiver_count() > 0 {
            self.flight.landed.send_replace(Some(how()));
        }
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        if !self.landed {
            self.land(|| Landed::Elsewhere);
        }
    }
}
