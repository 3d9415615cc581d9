//! The shared conformance suite on a single NATS server (replicas = 1).

use oncely::conformance::{service_url, skip_or_fail};
use oncely_nats::{NatsKvLedger, NatsKvLedgerOptions};

async fn ledger() -> Option<NatsKvLedger> {
    let url = service_url("ONCELY_NATS_URL", Some("nats://127.0.0.1:4222"))?;
    match NatsKvLedger::connect_with(&url, NatsKvLedgerOptions::default().bucket("oncely_conformance")).await
    {
        Ok(l) => Some(l),
        Err(e @ oncely::Error::Unavailable { .. }) => skip_or_fail(&format!("NATS at {url}: {e}")),
        Err(e) => panic!("NATS at {url}: {e}"),
    }
}

oncely::conformance::conformance_tests!(ledger);
