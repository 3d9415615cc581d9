//! The shared conformance suite, run against MariaDB / MySQL twice: with the
//! server's own claim path (RETURNING on MariaDB 10.5+) and with the MySQL 8
//! path (ODKU, then a locking read) forced, so both are proven on one server.

use oncely_mysql::{MySqlLedger, MySqlLedgerOptions};

async fn ledger_with(returning: Option<bool>) -> Option<MySqlLedger> {
    let url = oncely::conformance::service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))?;
    // The race runs 64 claimants at once; each holds a connection only for
    // one statement, but 70 lets them all be in flight together.
    let opts = MySqlLedgerOptions::default()
        .max_connections(70)
        .returning(returning);
    match MySqlLedger::connect_with(&url, opts).await {
        Ok(l) => Some(l),
        Err(e) => oncely::conformance::skip_or_fail(&format!("MySQL at {url}: {e}")),
    }
}

mod detected {
    use super::*;

    async fn ledger() -> Option<MySqlLedger> {
        ledger_with(None).await
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);
    oncely::conformance::admin_conformance_tests!(ledger);

    /// Three ledgers with pools of their own on the one server, as three
    /// processes would have (a waiter in one sees a completion in another by
    /// its poll).
    async fn processes() -> Option<Vec<MySqlLedger>> {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            nodes.push(ledger().await?);
        }
        Some(nodes)
    }

    oncely::conformance::nodes_conformance_tests!(processes);
    oncely::conformance::transactional_nodes_conformance_tests!(processes);
}

mod two_statement {
    use super::*;

    async fn ledger() -> Option<MySqlLedger> {
        ledger_with(Some(false)).await
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);
}

/// MariaDB's `SIMULTANEOUS_ASSIGNMENT` makes every assignment of an
/// `ON DUPLICATE KEY UPDATE` see the old row instead of the ones assigned
/// before it. A caller's pool may run in that mode (`from_pool`, `claim_in`):
/// the claim statement must be right under both semantics.
mod simultaneous_assignment {
    use super::*;

    async fn ledger() -> Option<MySqlLedger> {
        let url =
            oncely::conformance::service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))?;
        let pool = match sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(70)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    use sqlx::Executor;
                    conn.execute(
                        "SET SESSION sql_mode = CONCAT(@@SESSION.sql_mode, ',STRICT_ALL_TABLES,SIMULTANEOUS_ASSIGNMENT')",
                    )
                    .await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await
        {
            Ok(p) => p,
            // MySQL has no such mode: nothing to test there.
            Err(sqlx::Error::Database(e)) if e.message().contains("SIMULTANEOUS_ASSIGNMENT") => return None,
            Err(e) => return oncely::conformance::skip_or_fail(&format!("MySQL at {url}: {e}")),
        };
        let ledger = MySqlLedger::from_pool(pool);
        ledger.migrate().await.unwrap();
        Some(ledger)
    }

    oncely::conformance::conformance_tests!(ledger);
    oncely::conformance::transactional_conformance_tests!(ledger);
}

/// A ledger on a table of its own per outbox case (`oncely_ob_<case>`,
/// emptied first): a relay's claim takes any due message of its outbox.
async fn outbox(case: &'static str) -> Option<MySqlLedger> {
    let url = oncely::conformance::service_url("ONCELY_MYSQL_URL", Some("mysql://root@127.0.0.1:3306/test"))?;
    let table: String = format!("oncely_ob_{case}").chars().take(40).collect();
    let opts = MySqlLedgerOptions::default().max_connections(70).table(&table);
    let ledger = match MySqlLedger::connect_with(&url, opts).await {
        Ok(l) => l,
        Err(e) => return oncely::conformance::skip_or_fail(&format!("MySQL at {url}: {e}")),
    };
    sqlx::query(sqlx::AssertSqlSafe(format!("DELETE FROM `{table}_outbox`")))
        .execute(ledger.pool())
        .await
        .expect("the outbox emptied");
    Some(ledger)
}

oncely::conformance::outbox_conformance_tests!(outbox);
