//! The scripted workload, scraped over HTTP on loopback the way Prometheus
//! does, and every number checked: claims by result, suppressed
//! duplicates, takeovers, fence rejections, and the redelivery-gap
//! histogram with its declared buckets.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use metrics_prometheus::{Workload, install, run_workload};
use oncely::telemetry::REDELIVERY_GAP_BUCKETS;

/// One sample line of the text exposition format.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the Prometheus text format (version 0.0.4): `#` lines are
/// comments or metadata; a sample is `name{label="value",…} value
/// [timestamp]`, label values escaped with `\\`, `\"` and `\n`.
fn parse(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(['{', ' '])
            .unwrap_or_else(|| panic!("no value: {line:?}"));
        let name = line[..name_end].to_owned();
        let mut labels = BTreeMap::new();
        let mut rest = &line[name_end..];
        if let Some(inner) = rest.strip_prefix('{') {
            let mut chars = inner.char_indices();
            let mut key = String::new();
            let end = loop {
                let (i, c) = chars
                    .next()
                    .unwrap_or_else(|| panic!("unclosed labels: {line:?}"));
                match c {
                    '}' => break i,
                    ',' | ' ' => {}
                    '=' => {
                        assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "{line:?}");
                        let mut value = String::new();
                        loop {
                            match chars
                                .next()
                                .unwrap_or_else(|| panic!("unclosed value: {line:?}"))
                                .1
                            {
                                '"' => break,
                                '\\' => match chars.next().map(|(_, c)| c) {
                                    Some('n') => value.push('\n'),
                                    Some(c) => value.push(c),
                                    None => panic!("dangling escape: {line:?}"),
                                },
                                c => value.push(c),
                            }
                        }
                        labels.insert(std::mem::take(&mut key), value);
                    }
                    c => key.push(c),
                }
            };
            rest = &inner[end + 1..];
        }
        let value = rest
            .split_whitespace()
            .next()
            .unwrap_or_else(|| panic!("no value: {line:?}"));
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|e| panic!("{v:?} in {line:?}: {e}")),
        };
        samples.push(Sample { name, labels, value });
    }
    samples
}

#[test]
fn the_parser_reads_labels_escapes_and_bare_samples() {
    let s = parse(
        "# HELP x y\n# TYPE a counter\na{k=\"v\",q=\"say \\\"hi\\\"\\n\\\\\"} 3\nb 1.5 1700000000\nc{} +Inf\n",
    );
    assert_eq!(s.len(), 3);
    assert_eq!(s[0].name, "a");
    assert_eq!(s[0].labels["k"], "v");
    assert_eq!(s[0].labels["q"], "say \"hi\"\n\\");
    assert_eq!(s[0].value, 3.0);
    assert_eq!((s[1].name.as_str(), s[1].value), ("b", 1.5));
    assert!(s[1].labels.is_empty());
    assert_eq!(s[2].value, f64::INFINITY);
}

/// The sum of the samples named `name` whose labels include `labels`, and
/// how many there were.
fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> (f64, usize) {
    let matching: Vec<&Sample> = samples
        .iter()
        .filter(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(v))
        })
        .collect();
    (matching.iter().map(|s| s.value).sum(), matching.len())
}

/// A counter's value; it must have been exported.
fn count(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> u64 {
    let (total, n) = sum(samples, name, labels);
    assert!(n > 0, "no sample {name}{labels:?} in the scrape");
    assert_eq!(total.fract(), 0.0, "{name}{labels:?} = {total}");
    total as u64
}

/// `GET /metrics` on `addr` with hyper's HTTP/1 client: the body, after
/// checking the status and content type.
async fn scrape(addr: SocketAddr) -> String {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the exporter");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP handshake");
    tokio::spawn(conn);
    let req = hyper::Request::get("/metrics")
        .header("host", addr.to_string())
        .body(Empty::<Bytes>::new())
        .unwrap();
    let res = sender.send_request(req).await.expect("GET /metrics");
    assert_eq!(res.status(), 200);
    assert_eq!(
        res.headers().get("content-type").and_then(|v| v.to_str().ok()),
        Some("text/plain")
    );
    let body = res.into_body().collect().await.expect("the body").to_bytes();
    String::from_utf8(body.to_vec()).expect("UTF-8")
}

/// Installs the exporter on a free loopback port. The exporter binds the
/// address it is given and cannot report the port of `:0`, so this asks
/// the OS for a free one and retries if another process takes it first.
fn install_on_free_port() -> SocketAddr {
    let mut last = None;
    for _ in 0..10 {
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        match install(addr) {
            Ok(()) => return addr,
            Err(e) => last = Some(e),
        }
    }
    panic!("no free port for the exporter: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrape_shows_the_workloads_exact_numbers() {
    let addr = install_on_free_port();
    let dir = tempfile::tempdir().unwrap();
    let workload = Workload::default();
    let report = run_workload(dir.path(), &workload).await.unwrap();
    assert_eq!(report.zombies_refused, 2, "{report:?}");
    // 12 orders + 3 crashed + 2 zombies: one charge each, although the
    // zombies' successors called the provider again (same idempotency key).
    assert_eq!((report.charges, report.provider_calls), (17, 19), "{report:?}");
    assert_eq!((report.stats.ran, report.stats.replayed), (17, 7), "{report:?}");

    let text = scrape(addr).await;
    let s = parse(&text);
    let capture = [("kind", "capture")];
    let claims = |result: &str| {
        count(
            &s,
            "oncely_claims_total",
            &[("backend", "sqlite"), ("kind", "capture"), ("result", result)],
        )
    };
    // The 12 first deliveries, and the 3 crashed workers' and 2 zombies'
    // own claims.
    assert_eq!(claims("acquired"), 17, "{text}");
    // 4 prompt and 3 late duplicates.
    assert_eq!(claims("completed"), 7, "{text}");
    // The consumer took over the 3 crashed and the 2 zombie leases.
    assert_eq!(claims("takeover"), 5, "{text}");
    // Nothing else: no duplicate found a claim in progress.
    assert_eq!(count(&s, "oncely_claims_total", &[]), 29, "{text}");
    assert_eq!(
        count(&s, "oncely_duplicates_suppressed_total", &capture),
        7,
        "{text}"
    );
    assert_eq!(count(&s, "oncely_lease_takeovers_total", &capture), 5, "{text}");
    assert_eq!(count(&s, "oncely_fence_rejections_total", &capture), 2, "{text}");
    assert_eq!(
        sum(&s, "oncely_unexpected_constraint_violations_total", &[]).0,
        0.0,
        "{text}"
    );
    assert_eq!(
        count(&s, "oncely_claim_seconds_count", &[("backend", "sqlite")]),
        29,
        "{text}"
    );
    let deliveries = |result: &str| {
        count(
            &s,
            "oncely_consumer_deliveries_total",
            &[("consumer", "payments"), ("result", result)],
        )
    };
    assert_eq!((deliveries("ran"), deliveries("replayed")), (17, 7), "{text}");
    assert_eq!(count(&s, "oncely_consumer_deliveries_total", &[]), 24, "{text}");

    // The redelivery-gap histogram: one sample per duplicate, rendered as a
    // histogram with exactly the declared buckets.
    let gap = "oncely_redelivery_gap_seconds";
    assert_eq!(count(&s, &format!("{gap}_count"), &capture), 7, "{text}");
    // Every one found its effect completed: a redelivery gap, not a retry
    // that found the effect in progress (`found="in_progress"`).
    assert_eq!(
        count(
            &s,
            &format!("{gap}_count"),
            &[("kind", "capture"), ("found", "completed")]
        ),
        7,
        "{text}"
    );
    let buckets: Vec<(f64, u64)> = s
        .iter()
        .filter(|x| {
            x.name == format!("{gap}_bucket") && x.labels.get("kind").map(String::as_str) == Some("capture")
        })
        .map(|x| {
            let le = &x.labels["le"];
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            (le, x.value as u64)
        })
        .collect();
    let bounds: Vec<f64> = buckets.iter().map(|(le, _)| *le).collect();
    let mut declared = REDELIVERY_GAP_BUCKETS.to_vec();
    declared.push(f64::INFINITY);
    assert_eq!(bounds, declared, "the gap histogram's buckets\n{text}");
    let at_most = |bound: f64| buckets.iter().find(|(le, _)| *le == bound).unwrap().1;
    assert_eq!(at_most(f64::INFINITY), 7, "{text}");
    assert_eq!(at_most(2_592_000.0), 7, "every gap is under 30 days\n{text}");
    // The 3 late duplicates came at least 2 s after their first claim (on
    // the ledger's clock), so at most the 4 prompt ones are within 1 s.
    assert!(at_most(1.0) <= 4, "late duplicates counted within 1 s\n{text}");
    let (gap_sum, _) = sum(&s, &format!("{gap}_sum"), &capture);
    assert!(gap_sum >= 3.0 * 2.0, "the gaps add up to {gap_sum} s\n{text}");
    // Cumulative buckets never decrease.
    assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{text}");
}

#[test]
fn the_gap_buckets_cover_the_retentions_people_choose() {
    assert!(REDELIVERY_GAP_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    for ratio in REDELIVERY_GAP_BUCKETS.windows(2).map(|w| w[1] / w[0]) {
        assert!((1.5..=3.0).contains(&ratio), "{ratio}");
    }
    let (m, h, d) = (60.0, 3600.0, 86_400.0);
    for bound in [
        1.0,
        m,
        5.0 * m,
        15.0 * m,
        h,
        6.0 * h,
        d,
        3.0 * d,
        7.0 * d,
        14.0 * d,
        30.0 * d,
    ] {
        assert!(
            REDELIVERY_GAP_BUCKETS.contains(&bound),
            "{bound} s is not a bound"
        );
    }
}

/// The binary as a user runs it: it serves the same numbers on the address
/// it is given, and keeps serving until it is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_the_numbers_until_stopped() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    let mut tries = 0;
    let (mut child, addr, printed) = loop {
        tries += 1;
        let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let mut child = Stopped(
            Command::new(env!("CARGO_BIN_EXE_metrics-prometheus"))
                .args(["--listen", &addr.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start the example"),
        );
        let stdout = child.0.stdout.take().unwrap();
        // Everything up to the line that says it serves (or the end, if it
        // failed).
        let printed = tokio::task::spawn_blocking(move || {
            let mut printed = String::new();
            for line in BufReader::new(stdout).lines() {
                let line = line.unwrap();
                printed.push_str(&line);
                printed.push('\n');
                if line.starts_with("serving http://") {
                    break;
                }
            }
            printed
        });
        let printed = tokio::time::timeout(std::time::Duration::from_secs(120), printed)
            .await
            .expect("the example printed nothing for 120 s")
            .unwrap();
        if printed.contains("serving http://") {
            break (child, addr, printed);
        }
        let status = child.0.wait().unwrap();
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut stderr).unwrap();
        // Another process took the port between our check and its bind.
        assert!(
            tries < 10 && stderr.contains("serving metrics on"),
            "the example failed ({status}):\n{printed}{stderr}"
        );
    };
    assert!(
        printed.contains("2 zombie completions refused by their fence"),
        "{printed}"
    );
    assert!(printed.contains("17 charges from 19 provider calls"), "{printed}");

    // It is still serving after printing, for as many scrapes as come.
    for _ in 0..2 {
        let text = scrape(addr).await;
        let s = parse(&text);
        let capture = [("kind", "capture")];
        assert_eq!(count(&s, "oncely_fence_rejections_total", &capture), 2, "{text}");
        assert_eq!(count(&s, "oncely_lease_takeovers_total", &capture), 5, "{text}");
        assert_eq!(
            count(&s, "oncely_duplicates_suppressed_total", &capture),
            7,
            "{text}"
        );
        assert_eq!(
            count(&s, "oncely_redelivery_gap_seconds_count", &capture),
            7,
            "{text}"
        );
    }
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the example stopped serving"
    );
}

/// The example's process, stopped when the test ends, whether it passed or
/// not (it would serve forever otherwise).
struct Stopped(std::process::Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
