//! The bench reads each server's own counters around each row
//! (`RowReport::server`): what the hand-written floor costs per job is
//! known exactly (one insert that commits, one that conflicts, one read),
//! so its row must show that, and oncely's rows what they do on top.
//!
//! The counters are the server's totals: the backends run one after
//! another in one test, so that no other test of this binary writes to
//! them meanwhile. Skipped without the servers unless
//! `ONCELY_REQUIRE_SERVICES=1`.

use std::sync::Arc;

use oncely::conformance::{service_url, skip_or_fail};
use oncely_bench::{BenchConfig, BenchReport, Mode, NoProgress, RowReport};

const JOBS: u32 = 200;

async fn bench(var: &str, default: &str, port: u16) -> Option<BenchReport> {
    let url = service_url(var, Some(default))?;
    if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        return skip_or_fail(&format!("nothing answers at {url}"));
    }
    let config = BenchConfig {
        jobs: JOBS,
        workers: 4,
        batch: 20,
        database_url: Some(url),
    };
    let report = oncely_bench::run(&config, Arc::new(NoProgress)).await.unwrap();
    assert!(report.problems().is_empty(), "{:?}", report.problems());
    Some(report)
}

fn row(report: &BenchReport, mode: Mode, batch: u64, guard: &str) -> RowReport {
    report
        .rows
        .iter()
        .find(|r| r.mode == mode && r.batch == batch && r.guard_name == guard)
        .unwrap_or_else(|| panic!("no row {mode:?} {batch} {guard}"))
        .clone()
}

/// Within 0.15 per job (30 stray operations in 200 jobs) of `want`.
fn near(got: Option<f64>, want: f64, what: &str) {
    let got = got.unwrap_or_else(|| panic!("{what}: not counted"));
    assert!(
        (got - want).abs() <= 0.15,
        "{what}: {got:.3} per job, expected {want}"
    );
}

fn cpu_is_counted(report: &BenchReport) {
    for r in &report.rows {
        assert!(r.server.cpu_us_per_job.is_some(), "{}: no CPU", r.name);
    }
    let floor = row(report, Mode::Sequential, 1, "hand-written");
    assert!(floor.server.cpu_us_per_job.unwrap() > 0.0, "{floor:?}");
    assert_eq!(floor.cpu_ratio, Some(1.0));
    let oncely = row(report, Mode::Sequential, 1, "oncely");
    assert!(oncely.cpu_ratio.is_some(), "{oncely:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_backend_reports_what_its_server_did_per_job() {
    if let Some(pg) = bench(
        "ONCELY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
        5432,
    )
    .await
    {
        cpu_is_counted(&pg);
        // The floor: the first delivery's insert writes, the duplicate's
        // conflicts and its read write nothing.
        let floor = row(&pg, Mode::Sequential, 1, "hand-written");
        near(floor.server.write_transactions_per_job, 1.0, "PostgreSQL floor");
        assert!(floor.server.wal_bytes_per_job.unwrap() > 0.0, "{floor:?}");
        // By hand with the guarantees: the in-progress row, then its
        // fenced completion.
        let leased = row(&pg, Mode::Sequential, 1, "hand-written, leased");
        near(leased.server.write_transactions_per_job, 2.0, "PostgreSQL leased");
        // oncely at least as many, the claim and the completion.
        let oncely = row(&pg, Mode::Sequential, 1, "oncely");
        let wrote = oncely.server.write_transactions_per_job.unwrap();
        assert!(
            wrote >= 1.85,
            "oncely on PostgreSQL: {wrote:.3} write transactions per job"
        );
        assert_eq!(
            oncely.server.statements_per_job, None,
            "not counted on PostgreSQL"
        );
    }
    if let Some(my) = bench("ONCELY_MYSQL_URL", "mysql://root@127.0.0.1:3306/test", 3306).await {
        cpu_is_counted(&my);
        // INSERT IGNORE that wins, INSERT IGNORE that does not, SELECT.
        let floor = row(&my, Mode::Sequential, 1, "hand-written");
        near(floor.server.statements_per_job, 3.0, "MariaDB floor statements");
        // One commit flushed (the winning insert's).
        near(floor.server.fsyncs_per_job, 1.0, "MariaDB floor fsyncs");
        let leased = row(&my, Mode::Sequential, 1, "hand-written, leased");
        near(leased.server.fsyncs_per_job, 2.0, "MariaDB leased fsyncs");
        let oncely = row(&my, Mode::Sequential, 1, "oncely");
        assert!(oncely.server.fsyncs_per_job.unwrap() >= 1.85, "{oncely:?}");
    }
    let redis = service_url("ONCELY_REDIS_URL", Some("redis://127.0.0.1:6379"));
    if let Some(url) = redis {
        let sep = if url.contains('?') { '&' } else { '?' };
        // The machine's Redis persists nothing; the ledger refuses it
        // unless told.
        let url = format!("{url}{sep}ephemeral=true");
        if let Some(r) = bench("ONCELY_BENCH_REDIS_URL", &url, 6379).await {
            let floor = row(&r, Mode::Sequential, 1, "hand-written");
            // SET NX that wins, SET NX that does not, GET; no script.
            near(floor.server.statements_per_job, 3.0, "Redis floor commands");
            near(floor.server.scripts_per_job, 0.0, "Redis floor scripts");
            assert!(floor.server.cpu_us_per_job.unwrap() > 0.0, "{floor:?}");
            // The leased completion is one script.
            let leased = row(&r, Mode::Sequential, 1, "hand-written, leased");
            near(leased.server.scripts_per_job, 1.0, "Redis leased scripts");
            let oncely = row(&r, Mode::Sequential, 1, "oncely");
            assert!(oncely.server.scripts_per_job.unwrap() >= 1.0, "{oncely:?}");
        }
    }
}
