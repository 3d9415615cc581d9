//! Faults on the three-node Galera cluster (scripts/galera-cluster.sh): a
//! node killed mid-run, a node cut off from the others, a node whose clock
//! runs ahead. Each case changes the cluster, so the cases run one at a
//! time, in a test binary of their own (cargo runs test binaries one after
//! another: `galera.rs` never sees a node missing), and each gives the
//! cluster back whole, even when it fails.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use oncely::backend::{Claim, Ledger, Outcome};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey, Effects, Error, Failure, How, OnInProgress};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};
use sqlx::Row;

/// One case at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs the cluster script's `args`, panicking with its stderr on failure.
fn script(args: &[&str]) {
    if let Err(e) = common::run(args) {
        panic!("{e}");
    }
}

/// Gives node `n` back on drop, whatever happened: rejoins it to the
/// others (a node cut off stays so until told), `stop`s it first when the
/// case restarted it differently (its clock), then `start`s it.
struct Restore {
    node: &'static str,
    stop_first: bool,
}

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = std::process::Command::new("mariadb")
            .args(["--no-defaults", "-uroot", "-h127.0.0.1"])
            .arg(format!("-P331{}", self.node))
            .args(["-e", "SET GLOBAL wsrep_provider_options = 'gmcast.isolate=0'"])
            .stdin(std::process::Stdio::null())
            .output();
        if self.stop_first {
            let _ = common::run(&["stop", self.node]);
        }
        if let Err(e) = common::run(&["start", self.node]) {
            eprintln!("could not give node {} back: {e}", self.node);
        }
    }
}

fn node_opts() -> MySqlLedgerOptions {
    // A dead node's claimants should fail fast instead of waiting 30 s
    // for a connection.
    MySqlLedgerOptions::default()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(3))
}

/// Waits (bounded) until `node` answers `SHOW STATUS` with `want` for `var`.
async fn wait_status(ledger: &MySqlLedger, var: &str, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // A text-protocol SHOW: a non-primary node refuses most else.
        let got: Option<String> = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SHOW STATUS LIKE '{var}'")))
            .fetch_all(ledger.pool())
            .await
            .ok()
            .and_then(|rows| rows.first().and_then(|r| r.try_get::<String, _>(1).ok()));
        if got.as_deref() == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{var} is {got:?}, not {want}, after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Claimants on all three nodes run `Effects::run` over the same keys
/// while node 2 is killed with SIGKILL mid-run: no handler runs twice (nor
/// two at once) for a key, every completion acknowledged anywhere is there
/// afterwards on the survivors (and on node 2 once it has rejoined), and
/// the claimants on nodes 1 and 3 finish without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn a_node_killed_mid_run_loses_nothing() {
    const KEYS: usize = 300;
    const PER_NODE: usize = 4;
    const KILLED: usize = 1;
    let _serial = SERIAL.lock().await;
    let Some(nodes) = common::nodes_with(node_opts()).await else {
        return;
    };
    let started = Instant::now();
    let _restore = Restore {
        node: "2",
        stop_first: false,
    };
    let t = fresh_tenant();
    let keys: Arc<Vec<EffectKey>> = Arc::new(
        (0..KEYS)
            .map(|j| EffectKey::new(&t, "capture", format!("loss-{j}")).unwrap())
            .collect(),
    );
    let running: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..KEYS).map(|_| AtomicUsize::new(0)).collect());
    let overlaps = Arc::new(AtomicUsize::new(0));
    let progress = Arc::new(AtomicUsize::new(0));
    // A lease far longer than the run: no takeover is due, so a second
    // run of a key could only be a second holder.
    let claim = ClaimOptions::default()
        .lease(Duration::from_secs(120))
        .on_in_progress(OnInProgress::Reject);

    let mut claimants = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        for c in 0..PER_NODE {
            let effects = Effects::new(node.clone());
            let (keys, running, runs, overlaps, progress, claim) = (
                keys.clone(),
                running.clone(),
                runs.clone(),
                overlaps.clone(),
                progress.clone(),
                claim.clone(),
            );
            claimants.push(tokio::spawn(async move {
                let (mut acked, mut errors) = (Vec::new(), Vec::new());
                // Each claimant starts elsewhere in the keys and goes round
                // them all: every key is raced for from every node.
                for step in 0..KEYS {
                    let j = (step + (i * PER_NODE + c) * 7) % KEYS;
                    let (running, runs, overlaps) = (running.clone(), runs.clone(), overlaps.clone());
                    let result = effects
                        .run_reported(&keys[j], &claim, move |_lease| async move {
                            if running[j].fetch_add(1, Ordering::SeqCst) > 0 {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            runs[j].fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            running[j].fetch_sub(1, Ordering::SeqCst);
                            Ok::<_, Failure>(format!("ran {j}"))
                        })
                        .await;
                    progress.fetch_add(1, Ordering::SeqCst);
                    match result {
                        Ok(ran) if ran.how == How::Ran => acked.push(j),
                        Ok(_) | Err(Error::InProgress { .. }) => {}
                        // Its node is gone: a worker would back off (each
                        // further call waits out the pool's acquire timeout).
                        Err(e @ Error::Unavailable { .. }) => {
                            errors.push((j, e.to_string()));
                            break;
                        }
                        Err(e) => errors.push((j, e.to_string())),
                    }
                }
                (i, acked, errors)
            }));
        }
    }
    // Kill node 2 a quarter of the way through.
    let total = nodes.len() * PER_NODE * KEYS;
    while progress.load(Ordering::SeqCst) < total / 4 {
        assert!(
            !claimants.iter().all(|c| c.is_finished()),
            "the claimants finished before node 2 was killed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::task::spawn_blocking(|| script(&["kill", "2"]))
        .await
        .unwrap();
    let killed_at = progress.load(Ordering::SeqCst);

    let mut acked: Vec<(usize, usize)> = Vec::new();
    let mut survivor_errors = Vec::new();
    let mut killed_errors = 0;
    for c in claimants {
        let (i, a, errors) = c.await.unwrap();
        acked.extend(a.into_iter().map(|j| (i, j)));
        if i == KILLED {
            killed_errors += errors.len();
        } else {
            survivor_errors.extend(errors.into_iter().map(|(j, e)| (i, j, e)));
        }
    }
    eprintln!(
        "node 2 killed after {killed_at} of {total} runs; {} completions acknowledged ({} by node 2); \
         node 2's claimants stopped on {killed_errors} errors",
        acked.len(),
        acked.iter().filter(|(i, _)| *i == KILLED).count()
    );

    let twice: Vec<(usize, usize)> = runs
        .iter()
        .enumerate()
        .map(|(j, n)| (j, n.load(Ordering::SeqCst)))
        .filter(|(_, n)| *n > 1)
        .collect();
    eprintln!(
        "{} keys ran more than once, {} handler runs overlapped another on its key",
        twice.len(),
        overlaps.load(Ordering::SeqCst)
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two holders of one key at once"
    );
    assert!(
        twice.is_empty(),
        "keys whose handler ran more than once (key, runs): {twice:?}"
    );
    assert!(
        survivor_errors.is_empty(),
        "claimants on the surviving nodes failed: {survivor_errors:?}"
    );
    assert!(
        killed_errors > 0,
        "node 2 was killed before its claimants finished"
    );
    assert!(
        acked.iter().filter(|(i, _)| *i != KILLED).count() > KEYS / 2,
        "the survivors completed most keys"
    );

    let check = |ledger: MySqlLedger, acked: Vec<(usize, usize)>, keys: Arc<Vec<EffectKey>>| async move {
        let mut lost = Vec::new();
        for (i, j) in acked {
            let r = ledger.get(&keys[j]).await.unwrap();
            let outcome = Outcome::value(&format!("ran {j}")).unwrap();
            if !r.is_some_and(|r| r.outcome.as_ref() == Some(&outcome)) {
                lost.push((i, j));
            }
        }
        lost
    };
    for survivor in [0, 2] {
        let lost = check(nodes[survivor].clone(), acked.clone(), keys.clone()).await;
        assert!(
            lost.is_empty(),
            "acknowledged completions missing on node {} (node, key): {lost:?}",
            survivor + 1
        );
    }
    tokio::task::spawn_blocking(|| script(&["start", "2"]))
        .await
        .unwrap();
    // A new ledger: the old pool's connections died with the node (each
    // would fail once, `Unavailable`, before the pool replaced it).
    let urls = common::galera_urls().unwrap();
    let rejoined = common::ledger_on(&urls[KILLED], node_opts()).await.unwrap();
    let lost = check(rejoined, acked, keys).await;
    assert!(
        lost.is_empty(),
        "acknowledged completions missing on node 2 after it rejoined: {lost:?}"
    );
    eprintln!("node-loss case took {:?}", started.elapsed());
}

/// A node cut off from the others (non-primary) answers every operation
/// with `Error::Unavailable` (MariaDB's 1047, "WSREP has not yet prepared
/// node for application use"), the others carry on, and it serves again
/// once it has rejoined.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_cut_off_is_unavailable_and_the_others_carry_on() {
    let _serial = SERIAL.lock().await;
    let Some(nodes) = common::nodes_with(node_opts()).await else {
        return;
    };
    let started = Instant::now();
    let _restore = Restore {
        node: "3",
        stop_first: false,
    };
    let isolate = |on: u8| {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET GLOBAL wsrep_provider_options = 'gmcast.isolate={on}'"
        )))
    };
    let t = fresh_tenant();
    let (k, other) = (
        EffectKey::new(&t, "capture", "cut-off").unwrap(),
        EffectKey::new(&t, "capture", "claimed-while-cut-off").unwrap(),
    );
    let lease = match nodes[0].claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    isolate(1).execute(nodes[2].pool()).await.unwrap();
    wait_status(&nodes[2], "wsrep_cluster_status", "non-Primary").await;
    // A write: refused at once (1047).
    let e = nodes[2]
        .complete(&lease, &Outcome::from_json(&3).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "complete: {e:?}");
    // A causal read: refused once it gives up waiting for the cluster.
    let e = nodes[2]
        .claim(&other, &ClaimOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "claim: {e:?}");
    let e = nodes[2].get(&k).await.unwrap_err();
    assert!(matches!(e, Error::Unavailable { .. }), "get: {e:?}");
    // The others carry on.
    nodes[1]
        .complete(&lease, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    assert!(matches!(
        nodes[1].claim(&other, &ClaimOptions::default()).await.unwrap(),
        Claim::Acquired(_)
    ));
    // Through the command line: the ledger's pool refuses new connections
    // to a node that is not synced (its old ones were dropped when the
    // ledger found the node unavailable).
    let out = std::process::Command::new("mariadb")
        .args(["--no-defaults", "-uroot", "-h127.0.0.1", "-P3313"])
        .args(["-e", "SET GLOBAL wsrep_provider_options = 'gmcast.isolate=0'"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    tokio::task::spawn_blocking(|| script(&["start", "3"]))
        .await
        .unwrap();
    match nodes[2].claim(&k, &ClaimOptions::default()).await.unwrap() {
        Claim::Completed(r) => assert_eq!(r.outcome, Some(Outcome::from_json(&1).unwrap())),
        other => panic!("node 3 after it rejoined: {other:?}"),
    }
    eprintln!("cut-off case took {:?}", started.elapsed());
}

/// Node 3's clock runs 8 s ahead of the others (libfaketime). Expiry is
/// judged on the clock of the node that runs the claim, so node 3 takes a
/// lease granted through node 1 over 8 s early; fences stay above every
/// fence the key had, whichever clock wrote them, so the early holder's
/// writes still lose to the new one. This is the bound the crate docs
/// state: node clocks must agree to well within the runner's safety margin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_whose_clock_runs_ahead_takes_over_early_and_fences_hold() {
    const SKEW_S: i64 = 8;
    let _serial = SERIAL.lock().await;
    let Some(urls) = common::galera_urls() else {
        return;
    };
    let _restore = Restore {
        node: "3",
        stop_first: true,
    };
    tokio::task::spawn_blocking(|| {
        script(&["stop", "3"]);
        let out = std::process::Command::new("bash")
            .arg(common::script())
            .args(["start", "3"])
            .env("ONCELY_GALERA_FAKETIME", format!("+{SKEW_S}"))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "node 3 under faketime: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    })
    .await
    .unwrap();
    let (Some(one), Some(three)) = (
        common::ledger_on(&urls[0], node_opts()).await,
        common::ledger_on(&urls[2], node_opts()).await,
    ) else {
        return;
    };
    let clock = |l: MySqlLedger| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
        )
        .fetch_all(l.pool())
        .await
        .unwrap()[0]
    };
    let ahead_us = clock(three.clone()).await - clock(one.clone()).await;
    assert!(
        (SKEW_S - 1) * 1_000_000 < ahead_us && ahead_us < (SKEW_S + 1) * 1_000_000,
        "node 3 should run {SKEW_S} s ahead, runs {ahead_us} µs ahead"
    );

    let t = fresh_tenant();
    let k = EffectKey::new(&t, "capture", "skewed").unwrap();
    let ten = ClaimOptions::default().lease(Duration::from_secs(10));
    let first = match one.claim(&k, &ten).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    // Node 3 reads the lease with about 2 s left, node 1 with about 10.
    assert!(matches!(
        three.claim(&k, &ten).await.unwrap(),
        Claim::InProgress { .. }
    ));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        matches!(one.claim(&k, &ten).await.unwrap(), Claim::InProgress { .. }),
        "node 1: 6 s of the lease left"
    );
    let early = match three.claim(&k, &ten).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("node 3 should take the lease over 8 s early: {other:?}"),
    };
    assert!(
        early.taken_over() && early.fence() > first.fence(),
        "{early:?} after {first:?}"
    );
    // The fence decides, not the clocks: the first holder is refused
    // everywhere, the early one is not.
    for node in [&one, &three] {
        let e = node
            .complete(&first, &Outcome::from_json(&"first").unwrap())
            .await
            .unwrap_err();
        assert!(e.is_lease_lost(), "{e:?}");
    }
    // Released through node 1, whose clock is 8 s behind the fence node 3
    // wrote: the next grant's fence is still above it.
    one.release(&early).await.unwrap();
    let again = match one.claim(&k, &ten).await.unwrap() {
        Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };
    assert!(again.fence() > early.fence(), "{again:?} after {early:?}");
    three
        .complete(&again, &Outcome::from_json(&"again").unwrap())
        .await
        .unwrap();
}
