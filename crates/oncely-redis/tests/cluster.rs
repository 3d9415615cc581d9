//! The shared conformance suite on a three-master Redis Cluster
//! (ONCELY_REDIS_CLUSTER_URLS, or the one scripts/redis-cluster.sh starts).

mod common;

oncely::conformance_tests!(common::cluster);
