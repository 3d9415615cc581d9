//! The shared conformance suite on one Redis server.

use oncely::conformance::{service_url, skip_or_fail};
use oncely_redis::{RedisLedger, RedisLedgerOptions};

/// The test server persists nothing (`--save "" --appendonly no`): the
/// ledger accepts it because it is told to.
async fn ledger() -> Option<RedisLedger> {
    let url = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379"))?;
    match RedisLedger::connect_with(&url, RedisLedgerOptions::default().ephemeral(true)).await {
        Ok(l) => Some(l),
        Err(e) => skip_or_fail(&format!("redis at {url}: {e}")),
    }
}

oncely::conformance::conformance_tests!(ledger);
