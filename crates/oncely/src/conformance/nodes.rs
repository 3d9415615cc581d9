//! The multi-node cases: several ledgers of one backend, each connected to
//! a *different* node of one replicated deployment (a Galera cluster, a
//! Redis Cluster reached through different seeds, a NATS cluster), racing
//! for the same keys. What a single server serialises for free, a cluster
//! must still serialise: a write can conflict on another node and fail only
//! at commit, and a read can lag behind a write made elsewhere. Every case
//! takes at least two ledgers; ledger `i` is "node `i`".
//!
//! Run by a backend's cluster tests with
//! [`nodes_conformance_tests!`](crate::conformance::nodes_conformance_tests) (and
//! [`transactional_nodes_conformance_tests!`](crate::conformance::transactional_nodes_conformance_tests)
//! where claims join the caller's transaction).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{SHORT_LEASE, SHORT_LEASE_WAIT, acquired, fresh_tenant, key, opts, prune_until_gone};
use crate::ledger::{Ledger, TransactionalLedger};
use crate::record::{Claim, Outcome, RecordState};
use crate::{ClaimOptions, Effects, Error, OnInProgress};

/// Claimants per node in each race.
pub const PER_NODE: usize = 4;

fn at_least_two<L>(nodes: &[L]) {
    assert!(
        nodes.len() >= 2,
        "a multi-node case needs ledgers on two nodes at least"
    );
}

/// Races `PER_NODE` claimants on every node for `k` and returns every
/// answer with the node it came from.
async fn race<L: Ledger + Clone + 'static>(
    nodes: &[L],
    k: &crate::EffectKey,
    opts: &ClaimOptions,
) -> Vec<(usize, Claim)> {
    let barrier = Arc::new(tokio::sync::Barrier::new(nodes.len() * PER_NODE));
    let mut tasks = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        for _ in 0..PER_NODE {
            let (node, k, opts, barrier) = (node.clone(), k.clone(), opts.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                (i, node.claim(&k, &opts).await)
            }));
        }
    }
    let mut answers = Vec::new();
    for t in tasks {
        let (i, answer) = t.await.unwrap();
        let answer =
            answer.unwrap_or_else(|e| panic!("node {i}: a claim failed instead of answering: {e:?}"));
        answers.push((i, answer));
    }
    answers
}

/// Claimants on every node race for fresh keys: on each key exactly one
/// acquires, and every other one sees it in progress at the winner's fence.
pub async fn nodes_concurrent_claims_one_winner<L: Ledger + Clone + 'static>(nodes: Vec<L>) {
    at_least_two(&nodes);
    let t = fresh_tenant();
    let mut doubles = Vec::new();
    for round in 0..40 {
        let k = key(&t, "capture", &format!("race-{round}"));
        let answers = race(&nodes, &k, &opts()).await;
        let won: Vec<(usize, u64)> = answers
            .iter()
            .filter_map(|(i, c)| match c {
                Claim::Acquired(l) => Some((*i, l.fence)),
                _ => None,
            })
            .collect();
        if won.len() != 1 {
            doubles.push((round, won));
            continue;
        }
        for (i, c) in &answers {
            match c {
                Claim::Acquired(_) => {}
                Claim::InProgress { fence, .. } => {
                    assert_eq!(*fence, won[0].1, "node {i} saw another holder than the winner")
                }
                other => panic!("node {i}: unexpected {other:?}"),
            }
        }
        let r = nodes[0].get(&k).await.unwrap().expect("the winner's record");
        assert_eq!((r.state, r.fence), (RecordState::InProgress, won[0].1));
    }
    assert!(
        doubles.is_empty(),
        "keys with other than one holder (round, [(node, fence)]): {doubles:?}"
    );
}

/// An expired lease, raced for by claimants on every node: exactly one
/// takes it over, at a fence above the old one, and it holds the highest
/// fence: its completion is accepted, and every other claimant saw it.
pub async fn nodes_expired_lease_has_one_new_holder<L: Ledger + Clone + 'static>(nodes: Vec<L>) {
    at_least_two(&nodes);
    let t = fresh_tenant();
    let short = opts().lease(SHORT_LEASE);
    let mut doubles = Vec::new();
    for round in 0..8 {
        let k = key(&t, "capture", &format!("takeover-{round}"));
        let first = acquired(nodes[round % nodes.len()].claim(&k, &short).await.unwrap());
        tokio::time::sleep(SHORT_LEASE_WAIT).await;
        let answers = race(&nodes, &k, &opts()).await;
        let won: Vec<(usize, crate::record::Lease)> = answers
            .iter()
            .filter_map(|(i, c)| match c {
                Claim::Acquired(l) => Some((*i, l.clone())),
                _ => None,
            })
            .collect();
        if won.len() != 1 {
            doubles.push((round, won.iter().map(|(i, l)| (*i, l.fence)).collect::<Vec<_>>()));
            continue;
        }
        let (node, lease) = &won[0];
        assert!(
            lease.taken_over && lease.fence > first.fence,
            "{lease:?} after {first:?}"
        );
        for (i, c) in &answers {
            if let Claim::InProgress { fence, .. } = c {
                assert_eq!(*fence, lease.fence, "node {i} saw another holder than the winner");
            }
        }
        // The real winner's fenced writes are the ones accepted.
        let other = &nodes[(node + 1) % nodes.len()];
        other
            .complete(lease, &Outcome::from_json(&"captured").unwrap())
            .await
            .unwrap_or_else(|e| panic!("the winner's completion was refused: {e:?}"));
        assert!(
            nodes[*node]
                .complete(&first, &Outcome::from_json(&"zombie").unwrap())
                .await
                .unwrap_err()
                .is_lease_lost()
        );
    }
    assert!(
        doubles.is_empty(),
        "takeovers with other than one holder (round, [(node, fence)]): {doubles:?}"
    );
}

/// A duplicate claimed on node B right after node A's completion was
/// acknowledged sees the outcome (or, from a lagging read, the effect in
/// progress), never a grant to run it again.
pub async fn nodes_duplicate_after_completion_is_never_granted<L: Ledger + Clone + 'static>(nodes: Vec<L>) {
    at_least_two(&nodes);
    let t = fresh_tenant();
    let mut granted = Vec::new();
    for round in 0..100 {
        let (a, b) = (&nodes[round % nodes.len()], &nodes[(round + 1) % nodes.len()]);
        let k = key(&t, "capture", &format!("dup-{round}"));
        let lease = acquired(a.claim(&k, &opts()).await.unwrap());
        let outcome = Outcome::from_json(&round).unwrap();
        a.complete(&lease, &outcome).await.unwrap();
        match b.claim(&k, &opts()).await.unwrap() {
            Claim::Completed(r) => assert_eq!(r.outcome.as_ref(), Some(&outcome)),
            Claim::InProgress { fence, .. } => assert_eq!(fence, lease.fence),
            Claim::Acquired(l) => granted.push((round, l.fence)),
            other => panic!("{other:?}"),
        }
    }
    assert!(
        granted.is_empty(),
        "completed effects granted again on another node: {granted:?}"
    );
}

/// A duplicate waiting on node B for an effect in progress on node A is
/// answered with A's outcome once A completes (woken, or by its poll), and
/// does not run the effect.
pub async fn nodes_waiter_is_answered_when_another_node_completes<L: Ledger + Clone + 'static>(
    nodes: Vec<L>,
) {
    at_least_two(&nodes);
    let t = fresh_tenant();
    for round in 0..3 {
        let k = key(&t, "capture", &format!("wait-{round}"));
        let (a, b) = (nodes[0].clone(), nodes[1 + round % (nodes.len() - 1)].clone());
        let lease = acquired(a.claim(&k, &opts()).await.unwrap());
        let waiter = {
            let k = k.clone();
            tokio::spawn(async move {
                let wait = opts().on_in_progress(OnInProgress::Wait {
                    max: Duration::from_secs(20),
                });
                Effects::new(b)
                    .run(&k, &wait, |_| async {
                        Ok::<_, crate::Failure>("ran on the waiter".to_owned())
                    })
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        a.complete(
            &lease,
            &Outcome::value(&format!("ran on node 0 ({round})")).unwrap(),
        )
        .await
        .unwrap();
        let got: String = waiter.await.unwrap().unwrap();
        assert_eq!(got, format!("ran on node 0 ({round})"));
    }
}

/// Pruned on one node, replayed on the others: the replay of a message
/// older than what was pruned fails with `BeyondHorizon` wherever it is
/// claimed, and writes nothing.
pub async fn nodes_prune_then_replay_is_beyond_horizon<L: Ledger + Clone + 'static>(nodes: Vec<L>) {
    at_least_two(&nodes);
    let t = fresh_tenant();
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    let brief = opts()
        .lease(Duration::from_millis(100))
        .retention(Duration::from_millis(300));
    let k = key(&t, "capture", "pruned");
    let l = acquired(
        nodes[0]
            .claim(&k, &brief.clone().sent_at(hour_ago))
            .await
            .unwrap(),
    );
    nodes[0]
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    prune_until_gone(&nodes[1], &k).await;
    for (i, node) in nodes.iter().enumerate() {
        let e = node.claim(&k, &opts().sent_at(hour_ago)).await.unwrap_err();
        assert!(matches!(e, Error::BeyondHorizon { .. }), "node {i}: {e:?}");
    }
    for (i, node) in nodes.iter().enumerate() {
        assert!(
            node.get(&k).await.unwrap().is_none(),
            "node {i}: a refused claim wrote"
        );
    }
}

/// The same fresh key claimed in transactions on two nodes at once, each
/// completing and committing: exactly one transaction's claim survives
/// (the other saw it in progress, or failed, at the latest at its commit),
/// and the record is the survivor's.
pub async fn nodes_claim_in_transactions_on_two_nodes<L>(nodes: Vec<L>)
where
    L: TransactionalLedger + Clone + 'static,
{
    at_least_two(&nodes);
    let t = fresh_tenant();
    let mut doubles = Vec::new();
    for round in 0..20 {
        let k = key(&t, "mark-paid", &format!("tx-{round}"));
        let barrier = Arc::new(tokio::sync::Barrier::new(nodes.len()));
        let mut tasks = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let (node, k, barrier) = (node.clone(), k.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                let mut tx = node.begin().await.unwrap();
                barrier.wait().await;
                let lease = match node
                    .claim_in(&mut *tx, &k, &opts().on_in_progress(OnInProgress::Reject))
                    .await
                {
                    Ok(Claim::Acquired(l)) => l,
                    // Seen in progress or done, or a conflict: not a holder.
                    Ok(_) | Err(_) => return None,
                };
                let outcome = Outcome::from_json(&i).unwrap();
                node.complete_in(&mut *tx, &lease, &outcome).await.ok()?;
                node.commit(tx).await.ok()?;
                Some((i, lease.fence))
            }));
        }
        let mut committed = Vec::new();
        for task in tasks {
            if let Some(won) = task.await.unwrap() {
                committed.push(won);
            }
        }
        if committed.len() != 1 {
            doubles.push((round, committed));
            continue;
        }
        let (i, fence) = committed[0];
        let r = nodes[(i + 1) % nodes.len()].get(&k).await.unwrap();
        let r = r.expect("the committed claim's record");
        assert_eq!((r.state, r.fence), (RecordState::Completed, fence));
        assert_eq!(r.outcome, Some(Outcome::from_json(&i).unwrap()));
    }
    assert!(
        doubles.is_empty(),
        "transactions that all committed a claim, or none (round, [(node, fence)]): {doubles:?}"
    );
}

/// A lease granted through one node is completed in a transaction begun on
/// another at once, as a job's local write does when the pool's connections
/// reach different nodes: the completion commits, never "lease lost" because
/// that node had not yet applied the grant (a read inside a transaction may
/// not wait for the cluster: MariaDB skips `wsrep_sync_wait` there, so the
/// transaction must start after the node caught up).
pub async fn nodes_complete_in_on_another_node<L>(nodes: Vec<L>)
where
    L: TransactionalLedger + Clone + 'static,
{
    at_least_two(&nodes);
    let t = fresh_tenant();
    let mut refused = Vec::new();
    for round in 0..120 {
        let (a, b) = (&nodes[round % nodes.len()], &nodes[(round + 1) % nodes.len()]);
        let k = key(&t, "mark-paid", &format!("moved-{round}"));
        let lease = acquired(a.claim(&k, &opts()).await.unwrap());
        let mut tx = b.begin().await.unwrap();
        let outcome = Outcome::from_json(&round).unwrap();
        match b.complete_in(&mut *tx, &lease, &outcome).await {
            Ok(()) => b.commit(tx).await.unwrap(),
            Err(e) => {
                b.rollback(tx).await.unwrap();
                refused.push((round, e.to_string()));
                continue;
            }
        }
        let r = a.get(&k).await.unwrap().expect("the completed record");
        assert_eq!((r.state, r.fence), (RecordState::Completed, lease.fence()));
    }
    assert!(
        refused.is_empty(),
        "live leases refused by a transaction on another node: {refused:?}"
    );
}
