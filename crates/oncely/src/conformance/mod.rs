//! The conformance suite every backend runs, unchanged (feature `conformance`).
//!
//! Plain async functions, one behaviour each, in the manner of object_store's
//! `integration.rs`. A backend crate runs them all from `tests/conformance.rs`:
//!
//! ```text
//! async fn ledger() -> Option<MyLedger> { /* None when the server is absent */ }
//! oncely::conformance::conformance_tests!(ledger);
//! oncely::conformance::transactional_conformance_tests!(ledger); // a TransactionalLedger
//! ```
//!
//! Every function isolates itself with a fresh tenant, so the suite can run in
//! parallel against one database. Lease expiry is exercised with real, short
//! leases on the backend's own clock: no function fakes time.
//!
//! The cases, by file (all re-exported here):
//! - `ledger.rs`: the `Ledger` contract, called directly (claims, races,
//!   takeovers, fences, fingerprints, prune and the horizon, cancellation);
//! - `runner.rs`: `Effects::run` over the backend (duplicates, the in-progress
//!   policy, failures, the safety margin, renewal under [`Faulty`] faults,
//!   telemetry counted once);
//! - `coalesce.rs`: the backend's ledger wrapped in
//!   [`Coalescing`](crate::backend::Coalescing) (many claimants of one key,
//!   a gathered batch answered per slot, a caller dropped mid-batch);
//! - `flight.rs`: single-flight in [`Effects`](crate::Effects) (in-process
//!   duplicates answered from memory with an acknowledged outcome only);
//! - `codec.rs`: the backend's ledger wrapped in
//!   [`Sealed`](crate::codec::Sealed) (nothing plain in a dump, rotation,
//!   typed key errors), run by each backend's `tests/codec.rs`;
//! - `admin.rs`: the operator capability [`Admin`](crate::admin::Admin) (paging,
//!   tenant isolation, stuck and abandoned on the backend's clock, stats,
//!   forget) ([`admin_conformance_tests!`](crate::conformance::admin_conformance_tests));
//! - `outbox.rs`: the transactional outbox ([`crate::outbox`]) on a
//!   backend that has one
//!   ([`outbox_conformance_tests!`](crate::conformance::outbox_conformance_tests):
//!   each case on an outbox of its own);
//! - `transactional.rs`: claims on the caller's transaction
//!   ([`transactional_conformance_tests!`](crate::conformance::transactional_conformance_tests));
//! - `nodes.rs`: several ledgers on different nodes of one replicated
//!   deployment racing for the same keys
//!   ([`nodes_conformance_tests!`](crate::conformance::nodes_conformance_tests),
//!   [`transactional_nodes_conformance_tests!`](crate::conformance::transactional_nodes_conformance_tests));
//! - [`model`]: a model of the contract, checked against a ledger under
//!   random operation sequences (proptest);
//! - `pruner.rs`: the background [`Pruner`](crate::pruner::Pruner) on the backend
//!   (run by each backend's own test, on a table of its own, with
//!   [`pruner_prunes_due_records_in_bounded_batches`]);
//! - `faulty.rs`, `metrics.rs` and this file: the harness.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::ledger::Ledger;
use crate::record::Claim;
use crate::{ClaimOptions, EffectKey, Tenant};

// The suites' macros are exported at the crate root under hidden names
// (`#[macro_export]` can put them nowhere else) and have their one public
// path here.
#[doc(inline)]
pub use crate::__admin_conformance_tests as admin_conformance_tests;
#[doc(inline)]
pub use crate::__codec_conformance_tests as codec_conformance_tests;
#[doc(inline)]
pub use crate::__conformance_tests as conformance_tests;
#[doc(inline)]
pub use crate::__nodes_conformance_tests as nodes_conformance_tests;
#[doc(inline)]
pub use crate::__outbox_conformance_tests as outbox_conformance_tests;
#[doc(inline)]
pub use crate::__transactional_conformance_tests as transactional_conformance_tests;
#[doc(inline)]
pub use crate::__transactional_nodes_conformance_tests as transactional_nodes_conformance_tests;

mod admin;
mod coalesce;
mod codec;
mod faulty;
mod flight;
mod ledger;
mod metrics;
pub mod model;
mod nodes;
mod outbox;
mod pruner;
mod runner;
mod transactional;

pub use admin::*;
pub use coalesce::*;
pub use codec::*;
pub use faulty::{Faulty, InjectedUniqueViolation};
pub use flight::*;
pub use ledger::*;
pub use metrics::{counter, metrics_snapshotter};
pub use nodes::*;
pub use outbox::*;
pub use pruner::*;
pub use runner::*;
pub use transactional::*;

/// A lease short enough to expire inside a test.
pub const SHORT_LEASE: Duration = Duration::from_millis(300);

/// How long to wait for [`SHORT_LEASE`] to expire on the backend's clock.
pub const SHORT_LEASE_WAIT: Duration = Duration::from_millis(800);

/// How many claimants race for one key.
pub const RACERS: usize = 64;

/// Reads a service URL from `var`. When it is absent: fails if
/// `ONCELY_REQUIRE_SERVICES=1` (CI), else says so on stderr and returns `None`.
pub fn service_url(var: &str, default: Option<&str>) -> Option<String> {
    if let Ok(url) = std::env::var(var) {
        return Some(url);
    }
    if let Some(d) = default {
        return Some(d.to_owned());
    }
    skip_or_fail(&format!("{var} is not set"))
}

/// Skips (stderr, `None`) or, under `ONCELY_REQUIRE_SERVICES=1`, panics.
pub fn skip_or_fail<T>(why: &str) -> Option<T> {
    if std::env::var("ONCELY_REQUIRE_SERVICES").as_deref() == Ok("1") {
        panic!("required service missing: {why}");
    }
    eprintln!("skipping: {why} (set ONCELY_REQUIRE_SERVICES=1 to fail instead)");
    None
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A tenant no other test uses (process id, time and a counter).
pub fn fresh_tenant() -> Tenant {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    Tenant::new(format!(
        "t{}-{:x}-{}",
        std::process::id(),
        nanos & 0xffff_ffff_ffff,
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
    .expect("generated tenant is valid")
}

pub(crate) fn key(t: &Tenant, kind: &str, subject: &str) -> EffectKey {
    EffectKey::new(t, kind, subject).expect("test key is valid")
}

pub(crate) fn acquired(c: Claim) -> crate::record::Lease {
    match c {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

pub(crate) fn opts() -> ClaimOptions {
    ClaimOptions::default()
}

/// A seeded random number generator ([`fastrand`]) whose seed is printed,
/// so a failing run can be replayed with `ONCELY_SEED`.
pub struct Rng(fastrand::Rng);

impl Rng {
    /// Seeded from `ONCELY_SEED` or the clock; prints the seed.
    pub fn from_env(label: &str) -> Self {
        let seed = std::env::var("ONCELY_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fastrand::u64(..));
        eprintln!("{label}: ONCELY_SEED={seed}");
        Rng(fastrand::Rng::with_seed(seed))
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0.u64(..)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.0.u64(..n) }
    }
}

/// Calls `prune` until `key` is gone (other tests prune the same table
/// concurrently, and a backend may prune in batches).
pub async fn prune_until_gone<L: Ledger + 'static>(ledger: &L, key: &EffectKey) {
    for _ in 0..100 {
        ledger.prune(u64::MAX).await.unwrap();
        if ledger.get(key).await.unwrap().is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key} was never pruned");
}

/// Runs `iters` calls of `op` spread over `tasks` tokio tasks and returns the
/// wall time: the shared driver of every backend's `benches/claim.rs`, so the
/// library and its hand-written baseline are timed the same way.
pub async fn spread<F, Fut>(iters: u64, tasks: u64, op: F) -> Duration
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let tasks = tasks.max(1);
    let op = Arc::new(op);
    let start = std::time::Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let op = op.clone();
            let n = iters / tasks + u64::from(i < iters % tasks);
            tokio::spawn(async move {
                for _ in 0..n {
                    op().await;
                }
            })
        })
        .collect();
    for h in handles {
        h.await.expect("benchmark task panicked");
    }
    start.elapsed()
}

/// Generates one `#[tokio::test]` per conformance function, each calling
/// `$make().await` (an `async fn() -> Option<L>`; `None` skips).
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    ($make:path) => {
        $crate::__conformance_tests!(@each $make;
            first_claim_acquires,
            sequential_duplicate_returns_outcome,
            concurrent_claims_one_winner,
            release_then_claim_acquires,
            expired_lease_is_taken_over,
            concurrent_takeovers_one_winner,
            stale_fence_is_rejected,
            renew_extends_the_lease,
            fingerprint_mismatch_changes_nothing,
            redelivered_claims_answer_as_any_claim,
            tenants_and_kinds_are_independent,
            awkward_keys_round_trip,
            invalid_input_is_rejected,
            outcome_size_limit,
            prune_keeps_what_it_must,
            beyond_horizon_is_detected,
            out_of_range_times_are_refused,
            fences_never_repeat_after_prune,
            at_most_once_is_abandoned_not_rerun,
            claim_many_answers_each_key_in_order,
            overlapping_batches_acquire_each_key_once,
            complete_many_is_fenced_per_lease,
            batch_duplicates_answer_as_sequential_calls,
            cancellation_is_safe,
            run_sequential_duplicate_runs_once,
            run_concurrent_deliveries_run_once,
            run_in_progress_is_rejected_not_skipped,
            run_failures_follow_policy,
            run_never_starts_on_an_expired_lease,
            renewal_survives_a_transient_failure,
            handler_learns_its_lease_is_lost,
            run_at_most_once_unstorable_outcome_is_not_repeated,
            run_at_most_once_constraint_violation_is_not_repeated,
            run_at_most_once_uncached_terminal_failure_is_not_repeated,
            run_completion_failure_is_outcome_unknown,
            telemetry_counts_each_claim_once,
            run_waiter_is_answered_when_the_holder_finishes,
            run_waiter_survives_a_lost_notification,
            naive_guard_double_applies,
            coalesced_claimants_one_holder,
            coalesced_runs_run_once,
            coalesced_batch_answers_each_slot,
            coalesced_dropped_caller_leaves_no_lease,
            coalesced_cancellation_is_safe,
            effects_coalesce_as_the_backend_says,
            single_flight_answers_local_duplicates_without_a_claim,
            single_flight_answers_a_jobs_duplicate_step,
            single_flight_never_answers_an_unacknowledged_outcome,
            single_flight_answers_only_the_same_request,
        );
    };
    (@each $make:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                if let Some(ledger) = $make().await {
                    $crate::conformance::$name(ledger).await;
                }
            }
        )*
    };
}

/// Generates the transactional suite for a [`TransactionalLedger`](crate::ledger::TransactionalLedger): one
/// `#[tokio::test]` per function, each calling `$make().await` (an
/// `async fn() -> Option<L>`; `None` skips). Run it next to
/// [`conformance_tests!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __transactional_conformance_tests {
    ($make:path) => {
        $crate::__conformance_tests!(@each $make;
            claim_after_a_lock_wait_gets_a_live_lease,
            claim_in_late_in_a_transaction_gets_a_live_lease,
            claim_in_commits_and_rolls_back_with_the_transaction,
            duplicate_waits_for_the_transaction_and_sees_its_outcome,
        );
    };
}

/// Generates the multi-node suite: one `#[tokio::test]` per function, each
/// calling `$make().await` (an `async fn() -> Option<Vec<L>>`: one ledger
/// per node of one deployment, at least two; `None` skips).
#[doc(hidden)]
#[macro_export]
macro_rules! __nodes_conformance_tests {
    ($make:path) => {
        $crate::__conformance_tests!(@each $make;
            nodes_concurrent_claims_one_winner,
            nodes_expired_lease_has_one_new_holder,
            nodes_duplicate_after_completion_is_never_granted,
            nodes_waiter_is_answered_when_another_node_completes,
            nodes_prune_then_replay_is_beyond_horizon,
        );
    };
}

/// The multi-node cases for a [`TransactionalLedger`](crate::ledger::TransactionalLedger),
/// next to [`nodes_conformance_tests!`].
#[doc(hidden)]
#[macro_export]
macro_rules! __transactional_nodes_conformance_tests {
    ($make:path) => {
        $crate::__conformance_tests!(@each $make;
            nodes_claim_in_transactions_on_two_nodes,
            nodes_complete_in_on_another_node,
        );
    };
}

/// Generates the outcome codec's cases ([`codec`](crate::codec)) for a
/// ledger that implements [`Admin`](crate::admin::Admin): one
/// `#[tokio::test]` per function, each calling `$make().await` (an
/// `async fn() -> Option<L>`; `None` skips). A backend adds its own dump
/// case ([`codec_dump_holds_no_plain_outcome`], with its dump tool) and,
/// when it has one, the caller's transaction
/// ([`codec_seals_in_the_callers_transaction`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __codec_conformance_tests {
    ($make:path) => {
        $crate::__conformance_tests!(@each $make;
            codec_rotation_keeps_old_records_readable,
            codec_reseal_leaves_a_record_that_moved_on,
            codec_wrong_or_missing_key_is_a_typed_error,
            codec_leaves_erased_records_alone,
        );
    };
}

/// Generates the admin suite for a ledger that implements
/// [`Admin`](crate::admin::Admin): one `#[tokio::test]` per function, each calling
/// `$make().await` (an `async fn() -> Option<L>`; `None` skips). Run it next
/// to [`conformance_tests!`]; backends without the capability (Redis, NATS)
/// leave it out.
#[doc(hidden)]
#[macro_export]
macro_rules! __admin_conformance_tests {
    ($make:path) => {
        $crate::__conformance_tests!(@each $make;
            admin_pages_cover_each_record_once,
            admin_tenants_are_isolated,
            admin_classifies_on_the_backend_clock,
            admin_stats_count_per_kind,
            forget_then_claim_takes_over,
            forget_is_refused_unless_completed_at_the_fence,
            prunable_counts_without_deleting,
            erase_keeps_the_effect_done,
            erase_refuses_a_bad_subject,
            erase_lists_every_record_once_under_concurrent_claims,
            replace_outcome_is_conditional,
        );
    };
}
