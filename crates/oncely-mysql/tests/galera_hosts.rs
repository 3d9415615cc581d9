//! A ledger on the three-node Galera cluster through one URL listing every
//! node (`mysql://root@127.0.0.1:3311,127.0.0.1:3312,127.0.0.1:3313/test`,
//! scripts/galera-cluster.sh): the node it is connected to killed (SIGKILL)
//! or frozen (SIGSTOP) while eight workers run `Effects::run` over many
//! keys, the ledger moving to another node by itself; a node that is not
//! synced, or read-only, refused with a clear error. Each case changes the
//! cluster, so the cases run one at a time, in a binary of their own, and
//! each gives the cluster back whole, even when it fails.
//!
//! What is counted, per key: how many times its handler ran (and whether
//! two runs overlapped: two holders at once), and the outcome a worker was
//! given back (the completion was acknowledged). A *lost completion* is a
//! key whose record does not hold that outcome afterwards; a *second run*
//! is a key whose handler ran again after its completion was acknowledged.
//!
//! `ONCELY_GALERA_HOSTS_SINGLE=1` runs the fault cases with a URL naming
//! only the node the ledger starts on (as every ledger was before host
//! lists): they fail, the keys after the fault never finishing.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::backend::{Ledger, RecordState};
use oncely::{ClaimOptions, EffectKey, Effects, Error, How, OnInProgress, Tenant};
use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};

const WORKERS: usize = 8;
const KEYS: usize = 1500;
/// When the fault strikes, after the workers start.
const FAULT_AT: Duration = Duration::from_secs(2);
/// The generous bound on any one call (a worker's run): the operation
/// timeout is 3 s, a waiting duplicate's `max` 10 s.
const CALL_DEADLINE: Duration = Duration::from_secs(60);
/// The bound on the whole first pass.
const PASS_DEADLINE: Duration = Duration::from_secs(240);

/// One case at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn options() -> MySqlLedgerOptions {
    MySqlLedgerOptions::default()
        .table("oncely_galera_hosts")
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(2))
        .operation_timeout(Duration::from_secs(3))
}

fn claim_options() -> ClaimOptions {
    // A short lease: a claim whose answer was lost with the node is taken
    // over by the redelivery within the test.
    ClaimOptions::default()
        .lease(Duration::from_secs(4))
        .on_in_progress(OnInProgress::Wait {
            max: Duration::from_secs(10),
        })
}

/// `host:port` of each node, from the cluster's URLs.
fn authorities(urls: &[String]) -> Vec<String> {
    urls.iter()
        .map(|u| {
            let rest = u.split_once('@').map_or(u.as_str(), |(_, r)| r);
            rest.split('/').next().unwrap_or(rest).to_owned()
        })
        .collect()
}

/// The URL listing every node (or only `only`'s, 1-based).
fn host_list(only: Option<usize>) -> Option<String> {
    let urls = common::galera_urls()?;
    let hosts = authorities(&urls);
    let hosts = match only {
        Some(n) => vec![hosts[n - 1].clone()],
        None => hosts,
    };
    Some(format!("mysql://root@{}/test", hosts.join(",")))
}

/// The node (1-3) a ledger connects to now, from what it says it reads.
fn node_of(ledger: &MySqlLedger) -> usize {
    let shown = ledger.to_string();
    (1..=3)
        .find(|n| shown.contains(&format!(":331{n}/")))
        .unwrap_or_else(|| panic!("which node: {shown}"))
}

fn single() -> bool {
    std::env::var("ONCELY_GALERA_HOSTS_SINGLE").is_ok_and(|v| v == "1")
}

/// Runs a statement on node `n` through the command line (its socket-free
/// TCP port), whatever the ledgers' pools would accept.
fn mariadb(n: usize, statement: &str) {
    let out = std::process::Command::new("mariadb")
        .args(["--no-defaults", "-uroot", "-h127.0.0.1"])
        .arg(format!("-P331{n}"))
        .args(["-e", statement])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("runs mariadb");
    assert!(
        out.status.success(),
        "node {n}: {statement}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Gives node `n` back on drop: thawed if frozen, started if killed,
/// waited for until every node is synced, writable and not desynced.
struct Restore(usize);

impl Drop for Restore {
    fn drop(&mut self) {
        let n = self.0.to_string();
        let _ = common::run(&["thaw", &n]);
        if let Err(e) = common::run(&["start", &n]) {
            eprintln!("could not give node {n} back: {e}");
        }
        let _ = std::process::Command::new("mariadb")
            .args(["--no-defaults", "-uroot", "-h127.0.0.1"])
            .arg(format!("-P331{n}"))
            .args(["-e", "SET GLOBAL wsrep_desync = OFF; SET GLOBAL read_only = OFF"])
            .stdin(std::process::Stdio::null())
            .output();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Freeze,
}

#[derive(Debug, Default)]
struct Report {
    /// Keys whose acknowledged outcome is not what the ledger holds.
    lost: usize,
    /// Keys whose handler ran again after an acknowledged completion.
    second_runs: usize,
    /// Handler runs that overlapped another run of their key.
    overlaps: usize,
    /// Calls that did not return within CALL_DEADLINE.
    stuck: usize,
    /// The first pass's errors, by kind.
    unavailable: usize,
    outcome_unknown: usize,
    /// The first OutcomeUnknown's message, for the log.
    first_unknown: Option<String>,
    other_errors: usize,
    first_other: Option<String>,
    /// Keys that never got an answer in the first pass.
    unanswered: usize,
    /// Keys answered when the fault struck (fewer than KEYS: it struck
    /// mid-run).
    done_at_fault: usize,
    /// Times the survivors lost their quorum (none in the primary
    /// component for 10 s: a starved machine split them) and the fixture
    /// bootstrapped one again (`galera-cluster.sh recover`). An outage the
    /// ledger must ride out like any other, not a defect of the ledger.
    quorum_recovered: usize,
    /// The node the ledger was on, and the one it is on afterwards.
    from: usize,
    to: usize,
}

struct Shared {
    effects: Effects<MySqlLedger>,
    tenant: Tenant,
    runs: Vec<AtomicU32>,
    running: Vec<AtomicU32>,
    overlaps: AtomicUsize,
    /// The outcome a worker got back per key, and how many times the
    /// handler had run by then.
    acked: Mutex<Vec<Option<(String, u32)>>>,
    queue: Mutex<VecDeque<usize>>,
    done: AtomicUsize,
}

impl Shared {
    fn key(&self, n: usize) -> EffectKey {
        EffectKey::new(&self.tenant, "galera-hosts", format!("k{n}")).unwrap()
    }

    /// One delivery of key `n`: `Ok` with the outcome and how, or the
    /// error; `None` if it did not return within CALL_DEADLINE.
    async fn deliver(&self, n: usize) -> Option<Result<(String, How), Error>> {
        let key = self.key(n);
        let opts = claim_options();
        let run = self.effects.run_reported(&key, &opts, |_lease| async move {
            if self.running[n].fetch_add(1, Ordering::SeqCst) > 0 {
                self.overlaps.fetch_add(1, Ordering::SeqCst);
            }
            let run = self.runs[n].fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(Duration::from_millis(4)).await;
            self.running[n].fetch_sub(1, Ordering::SeqCst);
            Ok(format!("k{n} run {run}"))
        });
        match tokio::time::timeout(CALL_DEADLINE, run).await {
            Ok(answer) => Some(answer.map(|r| (r.value, r.how))),
            Err(_) => None,
        }
    }
}

async fn worker(shared: Arc<Shared>, report: Arc<Mutex<Report>>) {
    let deadline = tokio::time::Instant::now() + PASS_DEADLINE;
    while tokio::time::Instant::now() < deadline {
        let next = shared.queue.lock().unwrap().pop_front();
        let Some(n) = next else {
            if shared.done.load(Ordering::SeqCst) == KEYS {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        match shared.deliver(n).await {
            Some(Ok((outcome, _how))) => {
                let runs = shared.runs[n].load(Ordering::SeqCst);
                let mut acked = shared.acked.lock().unwrap();
                if acked[n].is_none() {
                    acked[n] = Some((outcome, runs));
                    shared.done.fetch_add(1, Ordering::SeqCst);
                }
            }
            answer => {
                {
                    let mut r = report.lock().unwrap();
                    match answer {
                        None => r.stuck += 1,
                        Some(Err(Error::Unavailable { .. })) => r.unavailable += 1,
                        Some(Err(e @ Error::OutcomeUnknown { .. })) => {
                            r.outcome_unknown += 1;
                            r.first_unknown.get_or_insert_with(|| e.to_string());
                        }
                        Some(Err(e)) => {
                            r.other_errors += 1;
                            r.first_other.get_or_insert_with(|| e.to_string());
                        }
                        Some(Ok(_)) => unreachable!(),
                    }
                }
                // Redelivered later, as a broker would.
                shared.queue.lock().unwrap().push_back(n);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Until every key is answered (or the pass's deadline), gives the
/// cluster its primary component back if the survivors of the fault lost
/// it (`galera-cluster.sh recover`, which acts only after 10 s without one):
/// the times it did.
async fn watch_quorum(shared: Arc<Shared>) -> usize {
    let deadline = tokio::time::Instant::now() + PASS_DEADLINE;
    let mut recovered = 0;
    while shared.done.load(Ordering::SeqCst) < KEYS && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let out = tokio::task::spawn_blocking(|| common::run(&["recover"]))
            .await
            .unwrap();
        match out {
            Ok(out) if out.contains("re-bootstrapped") => {
                eprintln!("the survivors lost their quorum: {}", out.trim());
                recovered += 1;
            }
            Ok(_) => {}
            Err(e) => eprintln!("{e}"),
        }
    }
    recovered
}

/// The workload through the host list, with `fault` on the ledger's node
/// at FAULT_AT.
async fn fault_mid_run(fault: Fault) -> Option<Report> {
    let url = host_list(None)?;
    let mut ledger = MySqlLedger::connect_with(&url, options())
        .await
        .expect("connects through the host list");
    let from = node_of(&ledger);
    if single() {
        ledger = MySqlLedger::connect_with(&host_list(Some(from))?, options())
            .await
            .expect("connects");
    }
    let _restore = Restore(from);
    let shared = Arc::new(Shared {
        effects: Effects::new(ledger.clone()),
        tenant: oncely::conformance::fresh_tenant(),
        runs: (0..KEYS).map(|_| AtomicU32::new(0)).collect(),
        running: (0..KEYS).map(|_| AtomicU32::new(0)).collect(),
        overlaps: AtomicUsize::new(0),
        acked: Mutex::new(vec![None; KEYS]),
        queue: Mutex::new((0..KEYS).collect()),
        done: AtomicUsize::new(0),
    });
    let report = Arc::new(Mutex::new(Report {
        from,
        ..Report::default()
    }));
    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(worker(shared.clone(), report.clone())))
        .collect();
    tokio::time::sleep(FAULT_AT).await;
    let done_at_fault = shared.done.load(Ordering::SeqCst);
    let node = from.to_string();
    tokio::task::spawn_blocking(move || {
        let verb = match fault {
            Fault::Kill => "kill",
            Fault::Freeze => "freeze",
        };
        common::run(&[verb, &node]).unwrap_or_else(|e| panic!("{e}"));
    })
    .await
    .unwrap();
    let quorum = tokio::spawn(watch_quorum(shared.clone()));
    for w in workers {
        w.await.unwrap();
    }
    let quorum_recovered = quorum.await.unwrap();
    let mut report = Arc::try_unwrap(report).unwrap().into_inner().unwrap();
    report.quorum_recovered = quorum_recovered;
    report.unanswered = KEYS - shared.done.load(Ordering::SeqCst);
    report.done_at_fault = done_at_fault;
    report.overlaps = shared.overlaps.load(Ordering::SeqCst);
    report.to = node_of(&ledger);
    eprintln!("first pass took {:?}", started.elapsed());

    // Every key delivered again: each is answered with its acknowledged
    // outcome, never run again.
    let redelivered: Vec<_> = (0..WORKERS)
        .map(|w| {
            let shared = shared.clone();
            tokio::spawn(async move {
                let mut stuck = 0;
                for n in (w..KEYS).step_by(WORKERS) {
                    if shared.acked.lock().unwrap()[n].is_none() {
                        continue;
                    }
                    for _ in 0..5 {
                        match shared.deliver(n).await {
                            Some(Ok(_)) => break,
                            Some(Err(_)) => tokio::time::sleep(Duration::from_millis(200)).await,
                            None => stuck += 1,
                        }
                    }
                }
                stuck
            })
        })
        .collect();
    for r in redelivered {
        report.stuck += r.await.unwrap();
    }
    let acked = shared.acked.lock().unwrap().clone();
    for (n, ack) in acked.iter().enumerate() {
        let Some((outcome, runs_at_ack)) = ack else {
            continue;
        };
        let record = match ledger.get(&shared.key(n)).await {
            Ok(Some(record)) => record,
            other => panic!("k{n}: {other:?} ({report:?})"),
        };
        let stored: Option<String> = record
            .stored()
            .unwrap()
            .map(|s| s.into_result(&record.key).unwrap());
        if record.state != RecordState::Completed || stored.as_ref() != Some(outcome) {
            report.lost += 1;
        }
        if shared.runs[n].load(Ordering::SeqCst) > *runs_at_ack {
            report.second_runs += 1;
        }
    }
    println!("host list, node {from} {fault:?}: {report:?}");
    Some(report)
}

fn assert_carried_on(r: &Report) {
    assert!(r.done_at_fault < KEYS, "the fault struck mid-run: {r:?}");
    assert_eq!(r.stuck, 0, "every call returned before its deadline: {r:?}");
    assert_eq!(r.overlaps, 0, "never two holders of one key at once: {r:?}");
    assert_eq!(r.unanswered, 0, "every key finished: {r:?}");
    assert_eq!(r.lost, 0, "no acknowledged completion lost: {r:?}");
    assert_eq!(
        r.second_runs, 0,
        "no handler ran again after its acknowledged completion: {r:?}"
    );
    assert_ne!(r.to, r.from, "the ledger moved to another node by itself: {r:?}");
}

/// The node the ledger is connected to is killed mid-run: the ledger moves
/// to another node by itself and every key finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_ledger_follows_when_its_node_is_killed() {
    let _serial = SERIAL.lock().await;
    let Some(r) = fault_mid_run(Fault::Kill).await else {
        return;
    };
    assert_carried_on(&r);
}

/// The node the ledger is connected to stops answering (SIGSTOP): each
/// call is bounded by the operation timeout, and the ledger moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_ledger_follows_when_its_node_is_frozen() {
    let _serial = SERIAL.lock().await;
    let Some(r) = fault_mid_run(Fault::Freeze).await else {
        return;
    };
    assert_carried_on(&r);
}

/// A node that is not synced (desynced, as a donor is) is refused when it
/// is the only host, saying why, and skipped in a host list; so is a
/// read-only server, for a ledger that writes (and a reading ledger may
/// use it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_will_not_do_is_refused_and_skipped() {
    let _serial = SERIAL.lock().await;
    let Some(urls) = common::galera_urls() else {
        return;
    };
    let hosts = authorities(&urls);
    let one = |n: usize| format!("mysql://root@{}/test", hosts[n - 1]);
    let first_two = format!("mysql://root@{},{}/test", hosts[0], hosts[1]);
    let _restore = Restore(1);

    // Desynced: what a donor reports.
    mariadb(1, "SET GLOBAL wsrep_desync = ON");
    let desynced = MySqlLedger::connect_with(&one(1), options()).await;
    let skipped = MySqlLedger::connect_with(&first_two, options()).await;
    mariadb(1, "SET GLOBAL wsrep_desync = OFF");
    match desynced {
        Err(Error::Unavailable { message, .. }) => assert!(
            message.contains("wsrep_local_state_comment=Donor/Desynced")
                && message.contains("it must be ON, Primary, Synced"),
            "{message}"
        ),
        other => panic!("a desynced node: {other:?}"),
    }
    assert_eq!(node_of(&skipped.expect("skips the desynced node")), 2);

    // Read-only.
    mariadb(1, "SET GLOBAL read_only = ON");
    let read_only = MySqlLedger::connect_with(&one(1), options()).await;
    let skipped = MySqlLedger::connect_with(&first_two, options()).await;
    let reading = MySqlLedger::connect_with(&one(1), options().read_only(true)).await;
    mariadb(1, "SET GLOBAL read_only = OFF");
    match read_only {
        Err(Error::Config(m)) => assert!(
            m.contains("a read-only server (@@read_only is ON") && m.contains("this ledger writes"),
            "{m}"
        ),
        other => panic!("a read-only server: {other:?}"),
    }
    assert_eq!(node_of(&skipped.expect("skips the read-only node")), 2);
    assert_eq!(node_of(&reading.expect("a reading ledger may read there")), 1);
}

/// Bad host lists are refused with a typed error before any connection.
#[tokio::test]
async fn bad_host_lists_are_refused_before_connecting() {
    for (bad, says) in [
        (
            "mysql://root:s3cret@127.0.0.1:3311,,127.0.0.1:3313/test",
            "empty entry",
        ),
        (
            "mysql://root:s3cret@127.0.0.1:3311,127.0.0.1:99999/test",
            "host 2 of the URL's list",
        ),
        (
            "mysql://root:s3cret@127.0.0.1:3311,127.0.0.1:x/test",
            "host 2 of the URL's list",
        ),
        (
            "mysql://root:s3cret@127.0.0.1:3311,127.0.0.1:3312/test?tabel=t",
            "unknown MySQL URL parameter",
        ),
        (
            "mysql://root:s3cret@h1,h2/test?socket=/tmp/s.sock",
            "cannot also name a socket",
        ),
    ] {
        match MySqlLedger::connect_with(bad, options()).await {
            Err(Error::Config(m)) => {
                assert!(m.contains(says), "{bad}: {m}");
                assert!(!m.contains("s3cret"), "{bad}: {m}");
            }
            other => panic!("{bad}: {other:?}"),
        }
        // Through FromUrl too (what `oncely` opens).
        let opened = <MySqlLedger as oncely::open::FromUrl>::from_url(
            bad,
            oncely::open::OpenOptions::new(oncely::open::Access::Migrate),
        )
        .await;
        assert!(matches!(opened, Err(Error::Config(_))), "{bad}: {opened:?}");
    }
}
