//! `oncely chaos` on every replicated topology the repository's scripts
//! start, each with the fault that topology must survive: the payment
//! pipeline across the endpoints, one node or the primary killed mid-run,
//! and the verdict the topology promises: no duplicate effect, no
//! acknowledged completion lost, every order finished. The printed table is
//! the README's "Replicated topologies" figures.
//!
//! The clusters are the ones the backend tests use (`scripts/*.sh`), started
//! here when they are down; each test gives its cluster back whole.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{oncely, stderr, stdout};

/// Orders per run: enough that the fault lands mid-run.
const ORDERS: u64 = 1000;

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts")
        .join(name)
}

/// Runs a repository script; its stdout's last line. Fails the test (or
/// skips it, without `ONCELY_REQUIRE_SERVICES=1`) when the script does.
fn run_script(name: &str, args: &[&str]) -> Option<String> {
    let out = Command::new("bash")
        .arg(script(name))
        .args(args)
        .output()
        .expect("bash runs");
    if !out.status.success() {
        return oncely::conformance::skip_or_fail(&format!(
            "{name} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .lines()
            .last()
            .unwrap_or("")
            .to_owned(),
    )
}

/// Runs `oncely chaos` with `args` and returns its JSON report, after
/// printing its table for the record (a second, table-printing run would
/// cost another fault).
fn chaos(topology: &str, endpoints: &[String], faults: &[String]) -> serde_json::Value {
    let mut args: Vec<String> = vec![
        "chaos".into(),
        "--topology".into(),
        topology.into(),
        "--orders".into(),
        ORDERS.to_string(),
        "--workers".into(),
        "8".into(),
        "--lease".into(),
        "2s".into(),
        "--deadline".into(),
        "90s".into(),
        "--json".into(),
    ];
    for e in endpoints {
        args.push("--endpoint".into());
        args.push(e.clone());
    }
    for f in faults {
        args.push("--fault".into());
        args.push(f.clone());
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = oncely(&refs);
    let report: serde_json::Value = serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&out), stderr(&out)));
    eprintln!(
        "chaos {topology}: faults {}; deliveries {}; charges {} ({} provider calls); receipts {}; duplicates {}; \
         acknowledged {} lost {}; abandoned {}; unfinished {}; retried {}; {:.1} s",
        report["faults"],
        report["deliveries"],
        report["charges"],
        report["provider_calls"],
        report["receipts"],
        report["duplicates"],
        report["acknowledged"],
        report["lost"],
        report["abandoned"].as_array().map_or(0, Vec::len),
        report["unfinished"],
        report["retried"],
        report["seconds"].as_f64().unwrap_or(0.0)
    );
    assert!(out.status.success(), "{report:#}\n{}", stderr(&out));
    report
}

/// What every topology here promises, whatever the fault; `transactional`:
/// the backend shares a transaction with a business write, so every order's
/// `mark-paid` row committed once with its step.
fn assert_kept(report: &serde_json::Value, transactional: bool) {
    assert_eq!(report["duplicates"], 0, "{report:#}");
    assert_eq!(report["lost"], 0, "{report:#}");
    assert_eq!(report["unread"], 0, "{report:#}");
    assert_eq!(report["unfinished"], 0, "{report:#}");
    // Every order charged once. A receipt whose worker's node died between
    // the send and the completion is abandoned, sent once; one that died
    // before the send, abandoned and not sent: never twice.
    assert_eq!(report["charges"], ORDERS, "{report:#}");
    if transactional {
        assert_eq!(report["marked"], ORDERS, "{report:#}");
    } else {
        assert!(report["marked"].is_null(), "{report:#}");
    }
    let receipts = report["receipts"].as_u64().unwrap();
    let abandoned = report["abandoned"].as_array().unwrap().len() as u64;
    assert!(receipts <= ORDERS && receipts + abandoned >= ORDERS, "{report:#}");
    for f in report["faults"].as_array().unwrap() {
        assert_eq!(f["exit"], 0, "a fault did not run: {report:#}");
    }
}

#[test]
fn chaos_on_galera_with_a_node_killed() {
    let Some(urls) = run_script("galera-cluster.sh", &["up"]) else {
        return;
    };
    let mut endpoints: Vec<String> = urls.split(',').map(str::to_owned).collect();
    // And one endpoint on the host list of all three nodes: its ledger
    // moves to another node when its own is the one killed.
    let hosts: Vec<&str> = endpoints
        .iter()
        .filter_map(|u| u.split_once('@').and_then(|(_, r)| r.split('/').next()))
        .collect();
    endpoints.push(format!("mysql://root@{}/test", hosts.join(",")));
    let galera = script("galera-cluster.sh").display().to_string();
    let report = chaos(
        "galera-3",
        &endpoints,
        &[
            format!("1s=bash {galera} kill 2"),
            format!("5s=bash {galera} start 2"),
        ],
    );
    assert_kept(&report, true);
}

#[test]
fn chaos_on_postgres_with_a_synchronous_standby_and_the_primary_killed() {
    let Some(_) = run_script("pg-standby.sh", &["reset", "sync"]) else {
        return;
    };
    let Some(url) = run_script("pg-standby.sh", &["url"]) else {
        return;
    };
    let pg = script("pg-standby.sh").display().to_string();
    let report = chaos(
        "postgres-sync-standby",
        &[url],
        &[format!("1s=bash {pg} kill-primary && bash {pg} promote")],
    );
    assert_kept(&report, true);
    run_script("pg-standby.sh", &["down"]);
}

#[test]
fn chaos_on_redis_sentinel_with_wait_replicas_and_the_primary_killed() {
    let Some(_) = run_script("redis-sentinel.sh", &["up"]) else {
        return;
    };
    let sentinel = script("redis-sentinel.sh").display().to_string();
    let url = "redis+sentinel://127.0.0.1:26390,127.0.0.1:26391,127.0.0.1:26392/mymaster?wait_replicas=1"
        .to_owned();
    // With one replica, nothing is granted after the failover until the
    // old primary rejoins as the new one's replica.
    let report = chaos(
        "redis-sentinel-wait-1",
        &[url],
        &[
            "1s=kill -9 $(cat /tmp/oncely-redis-sentinel/6390.pid)".to_owned(),
            format!("8s=bash {sentinel} rejoin 6390"),
        ],
    );
    assert_kept(&report, false);
    run_script("redis-sentinel.sh", &["down"]);
}

#[test]
fn chaos_on_a_three_node_nats_cluster_with_a_node_killed() {
    let Some(urls) = run_script("nats-cluster.sh", &["up"]) else {
        return;
    };
    let endpoints: Vec<String> = urls
        .split(',')
        .map(|u| format!("{u}?bucket=oncely_chaos_r3&replicas=3"))
        .collect();
    let nats = script("nats-cluster.sh").display().to_string();
    let report = chaos(
        "nats-r3",
        &endpoints,
        &[
            format!("1s=bash {nats} stop-node 2"),
            format!("5s=bash {nats} start-node 2"),
        ],
    );
    assert_kept(&report, false);
}
