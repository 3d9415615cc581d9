//! The shared conformance suite on the in-memory ledger.

use std::sync::Arc;

use oncely::MemoryLedger;

async fn ledger() -> Option<Arc<MemoryLedger>> {
    Some(Arc::new(MemoryLedger::new()))
}

oncely::conformance::conformance_tests!(ledger);
oncely::conformance::admin_conformance_tests!(ledger);

/// The multi-node suite where every "node" is the same ledger: what a
/// single store serialises, the cases must accept.
async fn nodes() -> Option<Vec<Arc<MemoryLedger>>> {
    let ledger = Arc::new(MemoryLedger::new());
    Some(vec![ledger.clone(), ledger.clone(), ledger])
}

oncely::conformance::nodes_conformance_tests!(nodes);
