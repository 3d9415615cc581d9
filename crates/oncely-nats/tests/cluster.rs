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
