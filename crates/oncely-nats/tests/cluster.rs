//! The shared conformance suite on a three-node JetStream cluster with a
//! replicated bucket (replicas = 3).

mod common;

use oncely_nats::{NatsKvLedger, NatsKvOptions};

async fn ledger() -> Option<NatsKvLedger> {
    let urls = common::cluster_urls()?;
    let opts = NatsKvOptions::default()
        .bucket("oncely_conformance_r3")
        .replicas(3);
    match NatsKvLedger::connect_with(&urls, opts).await {
        Ok(l) => Some(l),
        Err(e) => panic!("NATS cluster at {urls}: {e}"),
    }
}

oncely::conformance_tests!(ledger);

/// One ledger per node, each connected to that node only: the multi-node
/// suite races them for the same keys of the replicated bucket.
async fn nodes() -> Option<Vec<NatsKvLedger>> {
    let urls = common::cluster_urls()?;
    let mut nodes = Vec::new();
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let opts = NatsKvOptions::default()
            .bucket("oncely_conformance_r3")
            .replicas(3);
        match NatsKvLedger::connect_with(url, opts).await {
            Ok(l) => nodes.push(l),
            Err(e) => panic!("NATS node at {url}: {e}"),
        }
    }
    Some(nodes)
}

oncely::nodes_conformance_tests!(nodes);

/// An R=3 bucket reports what a quorum's acknowledgement gives: one node's
/// crash loses nothing acknowledged, two nodes' OS crashes within the sync
/// period can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_bucket_reports_quorum_durability() {
    let Some(ledger) = ledger().await else { return };
    let caps = oncely::Ledger::capabilities(&ledger);
    assert!(caps.replicated);
    let d = caps.durability;
    assert!(d.starts_with("JetStream file storage, R=3"), "{d}");
    assert!(d.contains("quorum (2 of 3)"), "{d}");
    assert!(d.contains("one node loses nothing acknowledged"), "{d}");
    assert!(d.contains("two nodes"), "{d}");
}
