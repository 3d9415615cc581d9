//! Kill a consumer mid-handler the way a crash does: no graceful shutdown,
//! the in-flight handler stops at an await point and never runs another
//! line, and what the process held (its broker connection) goes with it.
//!
//! Wrap the consumer's run in [`KillSwitch::run`], put
//! [`KillSwitch::point`] where a crash should be possible in the handler,
//! register what a dead process would lose with [`KillSwitch::on_kill`]
//! (close the broker connection, so its unacked messages are redelivered
//! to the survivors), and [`arm`](KillSwitch::arm) it: the n-th point
//! reached kills. [`KillSwitch::kill`] kills at once, from anywhere.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use oncely_testkit::kill::KillSwitch;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let switch = KillSwitch::new();
//! let (before, after) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
//! switch.on_kill({
//!     let connection_closed = before.clone();
//!     move || { connection_closed.fetch_add(100, Ordering::SeqCst); }
//! });
//! switch.arm(1); // the first point reached kills
//! let consumer = {
//!     let (switch, before, after) = (switch.clone(), before.clone(), after.clone());
//!     async move {
//!         before.fetch_add(1, Ordering::SeqCst); // the provider was called…
//!         switch.point().await;                  // …and the process died here
//!         after.fetch_add(1, Ordering::SeqCst);  // never completed
//!     }
//! };
//! assert_eq!(switch.run(consumer).await, None);  // killed, not finished
//! assert_eq!(before.load(Ordering::SeqCst), 101); // ran, then the hook
//! assert_eq!(after.load(Ordering::SeqCst), 0);
//! # }
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

type Hook = Box<dyn FnOnce() + Send>;

/// A crash for a consumer under test; cheap to clone (every clone is the
/// same switch).
#[derive(Clone, Default)]
pub struct KillSwitch {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    killed: AtomicBool,
    notify: Notify,
    /// Points left before the one that kills; 0: not armed.
    armed_at: AtomicUsize,
    reached: AtomicUsize,
    hooks: Mutex<Vec<Hook>>,
}

impl std::fmt::Debug for KillSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KillSwitch")
            .field("killed", &self.is_killed())
            .field("points_reached", &self.points_reached())
            .finish()
    }
}

impl KillSwitch {
    /// A switch that is not armed and has not killed.
    pub fn new() -> Self {
        KillSwitch::default()
    }

    /// Kills at the `n`-th [`point`](Self::point) reached from now on
    /// (`n` ≥ 1), counting every handler that shares the switch.
    pub fn arm(&self, n: usize) {
        let n = n.max(1);
        self.inner
            .armed_at
            .store(self.inner.reached.load(Ordering::SeqCst) + n, Ordering::SeqCst);
    }

    /// What a dead process loses, run once when it is killed (close its
    /// broker connection, drop its pool).
    pub fn on_kill(&self, hook: impl FnOnce() + Send + 'static) {
        self.inner.hooks.lock().unwrap().push(Box::new(hook));
    }

    /// Kills now: the hooks run, every [`run`](Self::run) drops its future,
    /// every [`point`](Self::point) reached from now on never returns.
    pub fn kill(&self) {
        if self.inner.killed.swap(true, Ordering::SeqCst) {
            return;
        }
        let hooks = std::mem::take(&mut *self.inner.hooks.lock().unwrap());
        for hook in hooks {
            hook();
        }
        self.inner.notify.notify_waiters();
    }

    /// Whether it has killed.
    pub fn is_killed(&self) -> bool {
        self.inner.killed.load(Ordering::SeqCst)
    }

    /// How many [`point`](Self::point)s were reached.
    pub fn points_reached(&self) -> usize {
        self.inner.reached.load(Ordering::SeqCst)
    }

    /// A point in a handler where the process may die: returns at once,
    /// unless the switch is armed for this point (it kills) or has killed
    /// (it never returns: the handler stops here, as a dead process does).
    pub async fn point(&self) {
        let n = self.inner.reached.fetch_add(1, Ordering::SeqCst) + 1;
        if self.inner.armed_at.load(Ordering::SeqCst) == n {
            self.kill();
        }
        if self.is_killed() {
            std::future::pending::<()>().await;
        }
    }

    /// Completes once the switch has killed.
    pub async fn killed(&self) {
        loop {
            let notified = self.inner.notify.notified();
            if self.is_killed() {
                return;
            }
            notified.await;
        }
    }

    /// Runs `fut` (a consumer's run, a worker) until it finishes
    /// (`Some(output)`) or the switch kills (`None`: the future is dropped
    /// where it stood, its handlers mid-await).
    pub async fn run<F: Future>(&self, fut: F) -> Option<F::Output> {
        tokio::select! {
            biased;
            () = self.killed() => None,
            out = fut => Some(out),
        }
    }
}
