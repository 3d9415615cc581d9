//! oncely-mysql on a three-node MariaDB Galera cluster (ONCELY_GALERA_URLS,
//! or the one scripts/galera-cluster.sh starts): the shared suite against
//! one node, and the multi-node suite with one ledger per node racing for
//! the same keys, on both claim paths.

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

    oncely::conformance_tests!(ledger);
    oncely::transactional_conformance_tests!(ledger);
}

mod detected {
    use super::*;

    async fn nodes() -> Option<Vec<MySqlLedger>> {
        common::nodes_with(opts()).await
    }

    oncely::nodes_conformance_tests!(nodes);
    oncely::transactional_nodes_conformance_tests!(nodes);
}

/// The MySQL 8 path (the claim statement, then a locking read) on Galera.
mod two_statement {
    use super::*;

    async fn nodes() -> Option<Vec<MySqlLedger>> {
        common::nodes_with(opts().returning(Some(false))).await
    }

    oncely::nodes_conformance_tests!(nodes);
    oncely::transactional_nodes_conformance_tests!(nodes);
}
