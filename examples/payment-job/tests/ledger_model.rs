//! The model-based test of the ledger contract (shared with the core's
//! memory-ledger run) on SQLite and PostgreSQL.

mod common;

use oncely::conformance::model;
use proptest::prelude::*;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(24))]

    #[test]
    fn sqlite_ledger_follows_the_model(ops in model::ops(30)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            // A fresh database per case, so prune counts are exact.
            let (db, _dir) = common::sqlite().await;
            model::check(&db, &ops, true).await;
        });
    }
}

proptest! {
    #![proptest_config(config(24))]

    #[test]
    fn postgres_ledger_follows_the_model(ops in model::ops(30)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let Some(db) = common::postgres().await else { return };
            // Other tests share this database: prune counts theirs too.
            model::check(&db, &ops, false).await;
        });
    }
}
