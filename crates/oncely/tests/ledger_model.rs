//! Model-based test of the memory ledger: random operations by several
//! claimants (claim, complete, release, renew, expire, prune, list
//! abandoned), each answer compared with a model of the contract.
//! `examples/payment-job/tests/ledger_model.rs` runs the same model on SQLite
//! and PostgreSQL.

use oncely::MemoryLedger;
use oncely::conformance::model;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn memory_ledger_follows_the_model(ops in model::ops(40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        // A fresh ledger per case: prune counts are exact.
        rt.block_on(model::check(&MemoryLedger::new(), &ops, true));
    }
}
