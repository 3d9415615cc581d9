//! The shared conformance suite on a three-master Redis Cluster
//! (ONCELY_REDIS_CLUSTER_URLS, or the one scripts/redis-cluster.sh starts).

mod common;

oncely::conformance::conformance_tests!(common::cluster);

/// One ledger per master, each seeded with that node only: the multi-node
/// suite races them for the same keys.
async fn nodes() -> Option<Vec<oncely_redis::RedisLedger>> {
    let mut nodes = Vec::new();
    for url in common::cluster_urls()? {
        let seed = format!("redis+cluster://{}", url.trim_start_matches("redis://"));
        let opts = oncely_redis::RedisLedgerOptions::default().ephemeral(true);
        match oncely_redis::RedisLedger::connect_with(&seed, opts).await {
            Ok(l) => nodes.push(l),
            Err(e) => return oncely::conformance::skip_or_fail(&format!("redis cluster at {seed}: {e}")),
        }
    }
    Some(nodes)
}

oncely::conformance::nodes_conformance_tests!(nodes);
