//! oncely-mysql on a three-node MariaDB Galera cluster (ONCELY_GALERA_URLS,
//! or the one scripts/galera-cluster.sh starts): the shared suite against
//! one node (the operator's suite too: erasure, forget, listings), and the
//! multi-node suite with one ledger per node racing for the same keys, on
//! both claim paths, with an erasure on one node racing claims on the
//! others; both suites again through a URL listing every node; the
//! outbox's suite on one node, and its claims and marks through several.

mod common;

use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};

fn opts() -> MySqlLedgerOptions {
    // The single-node races run 64 claimants at once.
    MySqlLedgerOptions::default().max_connections(70)
}

mod one_node {
    use super::*;

    async fn ledger() -> Option<MySqlLedger> {
        common::ledger_on(common::galera_urls()?.first()?, opts()).await
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);
    oncely::conformance::admin_conformance_tests!(ledger);
}

mod detected {
    use super::*;

    async fn nodes() -> Option<Vec<MySqlLedger>> {
        common::nodes_with(opts()).await
    }

    oncely::conformance::nodes_conformance_tests!(nodes);
    oncely::conformance::transactional_nodes_conformance_tests!(nodes);

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn erase_across_nodes_lists_every_record_once() {
        if let Some(nodes) = nodes().await {
            oncely::conformance::erase_across_nodes_lists_every_record_once(nodes).await;
        }
    }
}

/// Through one URL listing every node (`tests/galera_hosts.rs` has its
/// faults): the single-endpoint suite on one such ledger, and the
/// multi-endpoint suite on three (each lands on whichever node answers its
/// probe first, so they may share a node).
mod host_list {
    use super::*;

    async fn ledger() -> Option<MySqlLedger> {
        common::ledger_on(&common::host_list_url(2)?, opts()).await
    }

    async fn nodes() -> Option<Vec<MySqlLedger>> {
        let mut nodes = Vec::new();
        for first in 0..3 {
            nodes.push(common::ledger_on(&common::host_list_url(first)?, opts()).await?);
        }
        Some(nodes)
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);

    mod nodes {
        use super::*;
        oncely::conformance::nodes_conformance_tests!(nodes);
    }
}

/// The MySQL 8 path (the claim statement, then a locking read) on Galera.
mod two_statement {
    use super::*;

    async fn nodes() -> Option<Vec<MySqlLedger>> {
        common::nodes_with(opts().returning(Some(false))).await
    }

    oncely::conformance::nodes_conformance_tests!(nodes);
    oncely::conformance::transactional_nodes_conformance_tests!(nodes);
}

/// What only a Galera cluster shows: a node applies the other nodes' write
/// sets a few milliseconds after they commit, so each case writes through
/// one node and at once reads, claims or writes through another.
mod lag {
    use super::*;
    use oncely::backend::{Claim, Ledger, Outcome, RecordState};
    use oncely::conformance::fresh_tenant;
    use oncely::{ClaimOptions, EffectKey};

    const ROUNDS: usize = 150;

    fn lease(c: Claim) -> oncely::backend::Lease {
        match c {
            Claim::Acquired(l) => l,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_ledger_knows_it_is_on_galera() {
        let Some(nodes) = common::nodes_with(opts()).await else {
            return;
        };
        for node in &nodes {
            let caps = node.capabilities();
            assert!(caps.replicated, "{caps:?}");
            assert!(caps.durability.contains("Galera"), "{caps:?}");
        }
    }

    /// A lease granted through node A is completed (renewed, released)
    /// through node B at once, as a worker whose connection moved would:
    /// never refused for a grant node B had not applied yet.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_lease_granted_on_one_node_is_settled_on_another() {
        let Some(nodes) = common::nodes_with(opts()).await else {
            return;
        };
        let t = fresh_tenant();
        let mut refused = Vec::new();
        for round in 0..ROUNDS {
            let (a, b) = (&nodes[round % 3], &nodes[(round + 1) % 3]);
            let k = EffectKey::new(&t, "capture", format!("moved-{round}")).unwrap();
            let l = lease(a.claim(&k, &ClaimOptions::default()).await.unwrap());
            let result = match round % 3 {
                0 => b.complete(&l, &Outcome::from_json(&round).unwrap()).await,
                1 => b.renew(&l, std::time::Duration::from_secs(30)).await.map(|_| ()),
                _ => b.release(&l).await,
            };
            if let Err(e) = result {
                refused.push((round, e.to_string()));
            }
        }
        assert!(
            refused.is_empty(),
            "live leases refused on another node: {refused:?}"
        );
    }

    /// `complete_many` through node B of leases granted through node A.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_batch_granted_on_one_node_is_completed_on_another() {
        let Some(nodes) = common::nodes_with(opts()).await else {
            return;
        };
        let t = fresh_tenant();
        let mut refused = 0;
        for round in 0..ROUNDS / 10 {
            let keys: Vec<EffectKey> = (0..10)
                .map(|i| EffectKey::new(&t, "capture", format!("batch-{round}-{i}")).unwrap())
                .collect();
            let claims = nodes[0]
                .claim_many(&keys, &ClaimOptions::default())
                .await
                .unwrap();
            let items: Vec<(oncely::backend::Lease, Outcome)> = claims
                .into_iter()
                .map(|c| (lease(c.unwrap()), Outcome::from_json(&round).unwrap()))
                .collect();
            let done = nodes[1].complete_many(&items).await;
            refused += done.iter().filter(|r| r.is_err()).count();
        }
        assert_eq!(refused, 0, "live leases refused by complete_many on another node");
    }

    /// A duplicate claimed through node B right after node A's completion
    /// was acknowledged is answered with the outcome: the read that answers
    /// it sees every write acknowledged before it (not only "not granted").
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_duplicate_on_another_node_sees_the_completion() {
        let Some(nodes) = common::nodes_with(opts()).await else {
            return;
        };
        let t = fresh_tenant();
        let mut behind = Vec::new();
        for round in 0..ROUNDS {
            let (a, b) = (&nodes[round % 3], &nodes[(round + 1) % 3]);
            let k = EffectKey::new(&t, "capture", format!("dup-{round}")).unwrap();
            let l = lease(a.claim(&k, &ClaimOptions::default()).await.unwrap());
            let outcome = Outcome::from_json(&round).unwrap();
            a.complete(&l, &outcome).await.unwrap();
            match b.claim(&k, &ClaimOptions::default()).await.unwrap() {
                Claim::Completed(r) => assert_eq!(r.outcome, Some(outcome)),
                other => behind.push((round, format!("{other:?}"))),
            }
            let r = nodes[(round + 2) % 3].get(&k).await.unwrap();
            match r {
                Some(r) if r.state == RecordState::Completed => {}
                other => behind.push((round, format!("get: {other:?}"))),
            }
        }
        assert!(
            behind.is_empty(),
            "answers behind an acknowledged completion: {behind:?}"
        );
    }
}

/// The transactional outbox on Galera: no node's row locks reach another,
/// so two nodes' claims of one message both lock it and the second to
/// commit fails certification (1213), which the claim takes as "run
/// again"; and a claim made through one node may be marked through another
/// that has not applied it yet.
mod outbox {
    use std::collections::HashSet;
    use std::time::Duration;

    use oncely::backend::TransactionalLedger;
    use oncely::conformance::fresh_tenant;
    use oncely::outbox::{Enqueued, Message, Outbox, Pending, TransactionalOutbox};
    use oncely::{EffectKey, Tenant};

    use super::*;

    /// One ledger per node on `table`, whose outbox is emptied first.
    async fn nodes_on(table: &str) -> Option<Vec<MySqlLedger>> {
        let nodes = common::nodes_with(opts().table(table)).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM `{table}_outbox`")))
            .execute(nodes[0].pool())
            .await
            .unwrap();
        Some(nodes)
    }

    /// The suite on the first node, a table of its own per case.
    async fn one_node(case: &'static str) -> Option<MySqlLedger> {
        let table: String = format!("galera_ob_{case}").chars().take(40).collect();
        nodes_on(&table).await.map(|mut n| n.swap_remove(0))
    }

    oncely::conformance::outbox_conformance_tests!(one_node);

    async fn enqueue(ledger: &MySqlLedger, t: &Tenant, subject: &str) {
        let k = EffectKey::new(t, "order.paid", subject).unwrap();
        let m = Message::new("orders", subject.as_bytes().to_vec()).unwrap();
        let mut tx = ledger.begin().await.unwrap();
        assert!(matches!(
            ledger.enqueue_in(&mut tx, &k, &m).await.unwrap(),
            Enqueued::New(_)
        ));
        ledger.commit(tx).await.unwrap();
    }

    /// Relays on every node claim at once until nothing is left: every
    /// message is held by exactly one of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_through_every_node_hold_each_message_once() {
        let Some(nodes) = nodes_on("galera_ob_race").await else {
            return;
        };
        let t = fresh_tenant();
        const N: usize = 90;
        for i in 0..N {
            enqueue(&nodes[i % 3], &t, &format!("order-{i}")).await;
        }
        let mut relays = Vec::new();
        for r in 0..6 {
            let node = nodes[r % 3].clone();
            relays.push(tokio::spawn(async move {
                let mut held = Vec::new();
                let mut idle = 0;
                while idle < 3 {
                    // A lease no slow run outlives: a message claimed here
                    // is never marked, and an expired one is claimed again.
                    match node.claim_messages(4, Duration::from_secs(3600)).await {
                        Ok(c) if c.is_empty() => idle += 1,
                        Ok(c) => {
                            idle = 0;
                            held.extend(c.iter().map(|m| m.id));
                        }
                        // A conflict that kept losing: a relay's next pass.
                        Err(e) if e.is_retryable() => {}
                        Err(e) => panic!("{e:?}"),
                    }
                }
                held
            }));
        }
        let mut seen = HashSet::new();
        for relay in relays {
            for id in relay.await.unwrap() {
                assert!(seen.insert(id), "message {id} claimed twice");
            }
        }
        assert_eq!(seen.len(), N, "every message was claimed");
    }

    /// A claim made through node A is marked sent, retried or failed
    /// through node B at once: never refused for a claim node B had not
    /// applied yet, whether one ticket or several.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_claim_on_one_node_is_marked_on_another() {
        let Some(nodes) = nodes_on("galera_ob_moved").await else {
            return;
        };
        let t = fresh_tenant();
        let mut refused = Vec::new();
        // Enough rounds that a mark reading a node behind its cluster (the
        // bug: no causal wait inside a transaction) is caught in most runs.
        for round in 0..180 {
            let (a, b) = (&nodes[round % 3], &nodes[(round + 1) % 3]);
            let n = if round % 2 == 0 { 1 } else { 3 };
            for i in 0..n {
                enqueue(a, &t, &format!("moved-{round}-{i}")).await;
            }
            let claimed = a.claim_messages(10, Duration::from_secs(60)).await.unwrap();
            assert_eq!(claimed.len(), n, "round {round}");
            let wrote = match round % 6 {
                3 => vec![
                    b.retry_later(claimed[0].ticket(), Duration::from_secs(600), "down")
                        .await
                        .unwrap(),
                ],
                4 => vec![b.mark_failed(claimed[0].ticket(), "refused").await.unwrap()],
                _ => {
                    let tickets: Vec<_> = claimed.iter().map(Pending::ticket).collect();
                    b.mark_sent(&tickets).await.unwrap()
                }
            };
            if wrote.iter().any(|w| !w) {
                refused.push((round, wrote));
            }
            // The round's leftovers (a retried message, the rest of a batch
            // of which only one was failed) must not hold later rounds' keys.
            let rest: Vec<_> = claimed.iter().skip(1).map(Pending::ticket).collect();
            if matches!(round % 6, 3 | 4) && !rest.is_empty() {
                a.mark_sent(&rest).await.unwrap();
            }
        }
        assert!(
            refused.is_empty(),
            "live claims refused on another node: {refused:?}"
        );
    }
}

/// Three processes migrating a new table at once, each through its own
/// node: `GET_LOCK` serialises migrations on one node only, so the cluster
/// relies on each step being idempotent (DDL runs in the cluster's total
/// order; the bookkeeping row is an upsert).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_through_every_node_at_once() {
    let Some(urls) = common::galera_urls() else {
        return;
    };
    let table = format!("galera_mig_{}", std::process::id());
    let mut tasks = Vec::new();
    for url in urls.clone() {
        let table = table.clone();
        tasks.push(tokio::spawn(async move {
            MySqlLedger::connect_with(&url, opts().max_connections(2).table(table)).await
        }));
    }
    let mut ledgers = Vec::new();
    for t in tasks {
        ledgers.push(t.await.unwrap().expect("connect and migrate through a node"));
    }
    use sqlx::Executor;
    for t in [
        table.clone(),
        format!("{table}_horizon"),
        format!("{table}_outbox"),
    ] {
        ledgers[0]
            .pool()
            .execute(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{t}`")))
            .await
            .unwrap();
    }
    // The other cases' ledgers migrate through every node meanwhile: this
    // cleanup may lose a certification conflict (1213) on the bookkeeping
    // table, and runs again.
    let mut attempts = 0;
    loop {
        let deleted = sqlx::query("DELETE FROM oncely_schema_migrations WHERE table_name = ?")
            .bind(&table)
            .execute(ledgers[0].pool())
            .await;
        match deleted {
            Ok(_) => break,
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("40001") && attempts < 10 => {
                attempts += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}
