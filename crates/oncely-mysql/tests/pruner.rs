//! The background pruner on MariaDB / MySQL, on a table of its own (emptied
//! first, so the pruner's counts are exact).

use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pruner_prunes_due_records_in_bounded_batches() {
    let Some(url) =
        oncely::conformance::service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))
    else {
        return;
    };
    let opts = MySqlLedgerOptions::default().table("oncely_pruner_test");
    let ledger = match MySqlLedger::connect_with(&url, opts).await {
        Ok(l) => l,
        Err(e) => return oncely::conformance::skip_or_fail(&format!("MySQL at {url}: {e}")).unwrap_or(()),
    };
    // Records another run left behind (due or not) would spoil the counts.
    while oncely::backend::Ledger::prune(&ledger, u64::MAX).await.unwrap() > 0 {}
    oncely::conformance::pruner_prunes_due_records_in_bounded_batches(ledger, true).await;
}
