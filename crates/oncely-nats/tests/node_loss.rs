//! Losing a node of the three-node cluster while claims run on all three:
//! the remaining quorum keeps serving the claimants on the other two nodes,
//! the killed node's claimants are abandoned like crashed workers, no key
//! has two holders, and no acknowledged completion is lost. Its own test binary and bucket, so the
//! stopped node never disturbs the cluster conformance run.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncely::backend::{Claim, Ledger, Outcome, RecordState};
use oncely::conformance::fresh_tenant;
use oncely::{ClaimOptions, EffectKey, Error};
use oncely_nats::{NatsKvLedger, NatsKvLedgerOptions};

const KEYS: usize = 600;
/// Three per node.
const WORKERS: usize = 9;

fn opts() -> NatsKvLedgerOptions {
    NatsKvLedgerOptions::default()
        .bucket("oncely_node_loss")
        .replicas(3)
        .request_timeout(Duration::from_secs(2))
}

/// Retries retryable errors with capped exponential backoff, as a consumer
/// would redeliver.
async fn retry<T, F, Fut>(mut op: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let started = Instant::now();
    let mut backoff = Duration::from_millis(20);
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_retryable() && started.elapsed() < Duration::from_secs(90) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Restarts the nodes it names when dropped, so a failing assertion does not
/// leave the cluster degraded for the next test binary.
struct Restart(Vec<u8>);

impl Drop for Restart {
    fn drop(&mut self) {
        for n in &self.0 {
            if let Err(e) = common::run(&["start-node", &n.to_string()]) {
                eprintln!("restarting n{n}: {e}");
            }
        }
    }
}

async fn script(args: &[&str]) {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        common::run(&args).unwrap()
    })
    .await
    .unwrap();
}

/// One lease granted during the run.
#[derive(Debug, Clone, Copy)]
struct Grant {
    fence: u64,
    taken_over: bool,
    /// The node its claimant was connected to.
    node: usize,
}

/// Claimants on all three nodes (each worker's ledger connected to its node
/// only) walk the same keys; the stream leader's node is killed mid-run.
/// Its claimants die with it, like crashed workers: whatever they held is
/// abandoned, and taken over once their (short) leases end. The claimants
/// on the two surviving nodes carry on and finish every key. Afterwards: no
/// key had two holders at once (every grant after a key's first is a
/// takeover of a lease held on the killed node), every acknowledged
/// completion is there with its worker's outcome and fence, and every key
/// is completed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_loss_keeps_claims_exact_and_completions_durable() {
    let _serial = SERIAL.lock().await;
    let Some(urls) = common::cluster_urls() else {
        return;
    };
    let node_urls: Vec<String> = urls.split(',').map(|u| u.trim().to_owned()).collect();
    assert_eq!(node_urls.len(), 3, "three nodes: {urls}");
    let setup = retry(|| NatsKvLedger::connect_with(&urls, opts())).await.unwrap();
    let mut stream = setup.store().stream.clone();
    let info = stream.info().await.unwrap();
    let leader = info.cluster.as_ref().and_then(|c| c.leader.clone());
    let victim: u8 = leader
        .as_deref()
        .and_then(|l| l.strip_prefix('n')?.parse().ok())
        .unwrap_or(1);
    let victim_node = usize::from(victim - 1);
    eprintln!("stream leader {leader:?}; stopping n{victim} and its claimants mid-run");

    let t = fresh_tenant();
    let keys: Arc<Vec<EffectKey>> = Arc::new(
        (0..KEYS)
            .map(|i| EffectKey::new(&t, "capture", format!("order-{i}")).unwrap())
            .collect(),
    );
    // Acknowledged completions: key, worker, the lease's fence.
    let completions = Arc::new(Mutex::new(Vec::<(usize, usize, u64)>::new()));
    let grants = Arc::new(Mutex::new(Vec::<(usize, Grant)>::new()));
    let node_down = Arc::new(AtomicBool::new(false));
    let while_down = Arc::new(AtomicUsize::new(0));
    // Set just before the kill: the killed node's workers then stop in the
    // middle of their next effect, holding its lease, and count themselves.
    let stopping = Arc::new(AtomicBool::new(false));
    let holding = Arc::new(AtomicUsize::new(0));
    let (mut survivors, mut doomed) = (Vec::new(), Vec::new());
    for w in 0..WORKERS {
        let node = w % node_urls.len();
        let on_victim = node == victim_node;
        let (url, keys, completions, grants, node_down, while_down, stopping, holding) = (
            node_urls[node].clone(),
            keys.clone(),
            completions.clone(),
            grants.clone(),
            node_down.clone(),
            while_down.clone(),
            stopping.clone(),
            holding.clone(),
        );
        let task = tokio::spawn(async move {
            let ledger = retry(|| NatsKvLedger::connect_with(&url, opts())).await.unwrap();
            // Survivors' leases last far longer than the run, however slow
            // the election after the stop (a run over 30 s, the default
            // lease, once saw a lease end while its completion was still
            // being retried). The killed node's claimants hold theirs for a
            // few seconds: what they abandon is taken over soon after.
            let lease = if on_victim {
                Duration::from_secs(3)
            } else {
                Duration::from_secs(600)
            };
            let claim_opts = ClaimOptions::default().lease(lease);
            // Every worker walks the same keys from a nearby offset, so most
            // keys are claimed by several workers at about the same time.
            for step in 0..KEYS {
                // The second half of the run happens with the node down,
                // however fast the first half went.
                while step >= KEYS / 2 && !node_down.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let i = (step + w) % KEYS;
                let k = &keys[i];
                loop {
                    let claim = retry(|| ledger.claim(k, &claim_opts)).await.unwrap();
                    match claim {
                        Claim::Acquired(lease) => {
                            grants.lock().unwrap().push((
                                i,
                                Grant {
                                    fence: lease.fence(),
                                    taken_over: lease.taken_over(),
                                    node,
                                },
                            ));
                            if on_victim && stopping.load(Ordering::SeqCst) {
                                holding.fetch_add(1, Ordering::SeqCst);
                                std::future::pending::<()>().await;
                            }
                            let outcome = Outcome::from_json(&w).unwrap();
                            match retry(|| ledger.complete(&lease, &outcome)).await {
                                Ok(()) => {
                                    completions.lock().unwrap().push((i, w, lease.fence()));
                                    if node_down.load(Ordering::SeqCst) {
                                        while_down.fetch_add(1, Ordering::SeqCst);
                                    }
                                }
                                // A completion that timed out but was applied
                                // is refused on retry: the key is done. (Or,
                                // on the killed node, a short lease taken
                                // over: the survivors finish the key.)
                                Err(e) if e.is_lease_lost() => {}
                                Err(e) => panic!("complete {k}: {e}"),
                            }
                            break;
                        }
                        Claim::Completed(_) => break,
                        Claim::InProgress { .. } => tokio::time::sleep(Duration::from_millis(10)).await,
                        other => panic!("not at-most-once, so never {other:?}"),
                    }
                }
            }
        });
        if on_victim {
            doomed.push(task);
        } else {
            survivors.push(task);
        }
    }

    // Stop the stream leader once a tenth of the keys are done.
    let started = Instant::now();
    while completions.lock().unwrap().len() < KEYS / 10 {
        assert!(started.elapsed() < Duration::from_secs(120), "no progress");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stopping.store(true, Ordering::SeqCst);
    while holding.load(Ordering::SeqCst) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no claimant on n{victim} holds a lease"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _restart = Restart(vec![victim]);
    script(&["stop-node", &victim.to_string()]).await;
    // The killed node's workers crash with it: whatever they were doing is
    // abandoned mid-way, as a process that dies.
    for task in &doomed {
        task.abort();
    }
    node_down.store(true, Ordering::SeqCst);
    let done_at_stop = completions.lock().unwrap().len();
    for w in survivors {
        w.await.unwrap();
    }
    for task in doomed {
        let _ = task.await;
    }
    let down_count = while_down.load(Ordering::SeqCst);
    eprintln!("{done_at_stop} completions before the stop, {down_count} with n{victim} down");
    assert!(done_at_stop < KEYS, "the node was stopped after the run");
    assert!(down_count > 0, "nothing completed while the node was down");

    script(&["start-node", &victim.to_string()]).await;

    let completions = completions.lock().unwrap().clone();
    // No survivor's lease expired (they last 10 min), so a key is granted
    // again only by taking over a lease held on the killed node: each grant
    // after a key's first is a takeover, at a higher fence, of a grant made
    // on that node.
    let mut by_key_grants: HashMap<usize, Vec<Grant>> = HashMap::new();
    for (i, g) in grants.lock().unwrap().iter().copied() {
        by_key_grants.entry(i).or_default().push(g);
    }
    let mut takeovers = 0;
    for (i, gs) in by_key_grants.iter_mut() {
        gs.sort_by_key(|g| g.fence);
        assert!(
            !gs[0].taken_over,
            "{}: its first grant is a takeover: {gs:?}",
            keys[*i]
        );
        for pair in gs.windows(2) {
            assert!(
                pair[1].taken_over && pair[1].fence > pair[0].fence && pair[0].node == victim_node,
                "{}: two holders (node {} down): {gs:?}",
                keys[*i],
                victim_node
            );
            takeovers += 1;
        }
    }
    let mut by_key: HashMap<usize, Vec<(usize, u64)>> = HashMap::new();
    for (i, w, fence) in completions {
        by_key.entry(i).or_default().push((w, fence));
    }
    for (i, ws) in &by_key {
        assert_eq!(ws.len(), 1, "{} completed by workers {ws:?}", keys[*i]);
    }
    eprintln!("{takeovers} leases abandoned on n{victim} taken over");
    assert!(
        takeovers >= 1,
        "the lease a claimant on n{victim} held when it died was taken over"
    );
    // Read back through the restarted node alone: every key is completed,
    // and every acknowledged completion is there with its worker's outcome
    // and its lease's fence.
    let only_victim = node_urls[victim_node].clone();
    let reader = retry(|| NatsKvLedger::connect_with(&only_victim, opts()))
        .await
        .unwrap();
    for (i, k) in keys.iter().enumerate() {
        let r = retry(|| reader.get(k)).await.unwrap().expect("every key exists");
        assert_eq!(r.state, RecordState::Completed, "{k}");
        if let Some(last) = by_key_grants.get(&i).and_then(|gs| gs.last()) {
            assert_eq!(
                r.fence, last.fence,
                "{k}: the record's fence is not its last grant's"
            );
        }
        if let Some(ws) = by_key.get(&i) {
            assert_eq!(r.fence, ws[0].1, "{k}: the acknowledged completion's fence");
            assert_eq!(r.outcome.unwrap().to_value::<usize>().unwrap(), ws[0].0, "{k}");
        }
    }
    assert!(by_key.len() > KEYS / 2, "most completions were acknowledged");
}

/// With two of three nodes gone there is no quorum: a claim fails with a
/// retryable backend error (fail closed, nothing runs), and succeeds again
/// once the nodes are back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_quorum_is_retryable_and_recovers() {
    // Tests in one binary run in parallel; stopping nodes must not overlap.
    let _serial = SERIAL.lock().await;
    let Some(urls) = common::cluster_urls() else {
        return;
    };
    let ledger = retry(|| NatsKvLedger::connect_with(&urls, opts())).await.unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "no-quorum").unwrap();
    let _restart = Restart(vec![2, 3]);
    script(&["stop-node", "2"]).await;
    script(&["stop-node", "3"]).await;
    let e = ledger.claim(&k, &ClaimOptions::default()).await.unwrap_err();
    assert!(matches!(e, Error::Backend { retryable: true, .. }), "{e:?}");
    script(&["start-node", "2"]).await;
    script(&["start-node", "3"]).await;
    let claim_opts = ClaimOptions::default();
    let claim = retry(|| ledger.claim(&k, &claim_opts)).await.unwrap();
    assert!(matches!(claim, Claim::Acquired(_)), "{claim:?}");
}

/// Brings the whole cluster back up when dropped.
struct Up;

impl Drop for Up {
    fn drop(&mut self) {
        if let Err(e) = common::run(&["up"]) {
            eprintln!("restarting the cluster: {e}");
        }
    }
}

/// Every node stops and starts again on its data (a power cut, a rolling
/// upgrade gone wrong). The bucket's stream must elect a new leader before
/// it answers, so `connect` keeps asking until it does, with no retry loop
/// of the caller's around it, and the completed record is there unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_cluster_restart_keeps_records_and_connect_waits_for_the_stream() {
    let _serial = SERIAL.lock().await;
    let Some(urls) = common::cluster_urls() else {
        return;
    };
    // Replies are awaited for half a second, shorter than an election takes:
    // the wait for the restarted stream is connect's own.
    let opts = || opts().request_timeout(Duration::from_millis(500));
    let ledger = retry(|| NatsKvLedger::connect_with(&urls, opts())).await.unwrap();
    let k = EffectKey::new(&fresh_tenant(), "capture", "restart").unwrap();
    let Claim::Acquired(lease) = ledger.claim(&k, &ClaimOptions::default()).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    let outcome = Outcome::from_json(&"captured").unwrap();
    ledger.complete(&lease, &outcome).await.unwrap();
    drop(ledger);

    let _up = Up;
    for n in ["1", "2", "3"] {
        script(&["stop-node", n]).await;
    }
    // Connect while the nodes are still finding each other.
    script(&["boot"]).await;

    let waited = Instant::now();
    let after = NatsKvLedger::connect_with(&urls, opts())
        .await
        .expect("connect waits for the restarted stream's leader");
    eprintln!("connect after the restart took {:?}", waited.elapsed());
    let r = retry(|| after.get(&k))
        .await
        .unwrap()
        .expect("the record survived");
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(
        r.outcome.as_ref().map(Outcome::as_bytes),
        Some(outcome.as_bytes())
    );
    let claim_opts = ClaimOptions::default();
    let claim = retry(|| after.claim(&k, &claim_opts)).await.unwrap();
    assert!(matches!(claim, Claim::Completed(_)), "{claim:?}");
}

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
