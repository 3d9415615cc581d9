//! The shared conformance suite on the in-memory ledger.

use std::sync::Arc;

use oncely::MemoryLedger;

async fn ledger() -> Option<Arc<MemoryLedger>> {
    Some(Arc::new(MemoryLedger::new()))
}

oncely::conformance_tests!(ledger);
oncely::admin_conformance_tests!(ledger);
