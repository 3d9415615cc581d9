//! The layer on Redis (`ONCELY_REDIS_URL`, by default the loopback server;
//! each test has its own tenant).

mod common;

use std::sync::Arc;

use oncely::conformance::{service_url, skip_or_fail};
use oncely_redis::{RedisLedger, RedisLedgerOptions};

/// The test server persists nothing (`--save "" --appendonly no`): the
/// ledger accepts it because it is told to.
async fn open() -> Option<(Arc<RedisLedger>, ())> {
    let url = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379"))?;
    match RedisLedger::connect_with(&url, RedisLedgerOptions::default().ephemeral(true)).await {
        Ok(ledger) => Some((Arc::new(ledger), ())),
        Err(e) => skip_or_fail(&format!("Redis at {url}: {e}")),
    }
}

layer_tests!(open);
