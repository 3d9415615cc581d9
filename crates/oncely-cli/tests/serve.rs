//! `oncely serve` as a person sees it: ledgers seeded with completed, stuck
//! and abandoned records through the ledger API, the real binary serving
//! them, every view loaded in headless Chromium, and what the page shows
//! asserted on the rendered DOM.
//!
//! The gap chart reads a real Prometheus endpoint: the `metrics-prometheus`
//! example's scripted workload runs in this process with its exporter
//! installed, and `serve` scrapes it.
//!
//! Needs `/usr/bin/chromium` (or `ONCELY_CHROMIUM`); without it the tests
//! say so and return, unless `ONCELY_REQUIRE_SERVICES=1`. Screenshots go to
//! a temporary directory, or to `ONCELY_SCREENSHOTS` when set (that is how
//! `docs/screenshots/` is made).

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use oncely::backend::{Claim, Fingerprint, Ledger, Outcome};
use oncely::conformance::{fresh_tenant, service_url, skip_or_fail};
use oncely::{ClaimOptions, EffectKey, Tenant};
use oncely_cli::AnyLedger;

fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("ONCELY_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    if path.exists() {
        Some(path)
    } else {
        skip_or_fail(&format!(
            "Chromium is not installed at {} (apt-get install chromium)",
            path.display()
        ))
    }
}

/// What was seeded: the tenant and the keys, by what they should show.
struct Seeded {
    tenant: Tenant,
    completed: Vec<EffectKey>,
    stuck: EffectKey,
    abandoned: EffectKey,
    /// The fences the ledger granted: the first completed's and the stuck's.
    completed_fence: u64,
    stuck_fence: u64,
}

/// Three completed captures (one with a fingerprint), one stuck capture
/// (a lease that ended, not at-most-once), one abandoned email
/// (at-most-once, lease ended). Waits for the leases to end on the
/// ledger's clock, reading it through `get().read_at`.
async fn seed(url: &str, tenant: Tenant) -> Seeded {
    let ledger = AnyLedger::connect(url).await.unwrap();
    let key = |kind: &str, subject: &str| EffectKey::new(&tenant, kind, subject).unwrap();
    let mut completed = Vec::new();
    let mut completed_fence = 0;
    for i in 1..=3 {
        let k = key("capture", &format!("order-{i}"));
        let mut opts = ClaimOptions::default();
        if i == 1 {
            opts = opts.fingerprint(Fingerprint::of_json(&serde_json::json!({"amount": 1200})).unwrap());
        }
        let Claim::Acquired(lease) = ledger.claim(&k, &opts).await.unwrap() else {
            panic!("{k} is fresh")
        };
        if i == 1 {
            completed_fence = lease.fence();
        }
        let mut outcome = Outcome::from_json(&serde_json::json!({"charge": format!("ch_{i}")})).unwrap();
        if i == 3 {
            // Stored encrypted (oncely::codec): the page says so, never the bytes.
            use oncely::codec::{Keyring, OutcomeCodec, SecretKey};
            let keys = Keyring::new("k1", SecretKey::from_bytes([1; 32])).unwrap();
            outcome = keys.seal(&k, &outcome).unwrap();
        }
        ledger.complete(&lease, &outcome).await.unwrap();
        completed.push(k);
    }
    let short = Duration::from_secs(1);
    let stuck = key("capture", "order-stuck");
    let Claim::Acquired(stuck_lease) = ledger
        .claim(&stuck, &ClaimOptions::default().lease(short))
        .await
        .unwrap()
    else {
        panic!("fresh")
    };
    let abandoned = key("email", "receipt-9");
    let Claim::Acquired(abandoned_lease) = ledger
        .claim(
            &abandoned,
            &ClaimOptions::default().lease(short).at_most_once(true),
        )
        .await
        .unwrap()
    else {
        panic!("fresh")
    };
    // Both leases end on the ledger's clock; poll it, not the test's.
    let ends = stuck_lease.expires_at().max(abandoned_lease.expires_at());
    loop {
        let r = ledger.get(&stuck).await.unwrap().unwrap();
        if r.read_at >= ends {
            break;
        }
        let left = ends.duration_since(r.read_at).unwrap_or_default();
        tokio::time::sleep(left.min(Duration::from_millis(200)) + Duration::from_millis(10)).await;
    }
    ledger.close().await;
    Seeded {
        tenant,
        completed,
        stuck,
        abandoned,
        completed_fence,
        stuck_fence: stuck_lease.fence(),
    }
}

/// The `oncely serve` process; killed when dropped.
struct Serve {
    child: Child,
    base: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `oncely serve` on a port the OS picks and reads the address from
/// the line it prints.
fn serve(args: &[&str]) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_oncely"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env_remove("ONCELY_DATABASE_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("serve printed {line:?}"))
        .trim_end_matches('/')
        .to_owned();
    Serve { child, base }
}

/// The DOM Chromium renders for `url`.
fn dom(chromium: &Path, url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(chromium)
        .args(["--headless=new", "--no-sandbox", "--disable-gpu", "--dump-dom"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chromium {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A screenshot of `url`, 1200x900, as `name`.png in `dir`.
fn screenshot(chromium: &Path, url: &str, dir: &Path, name: &str) {
    let profile = tempfile::tempdir().unwrap();
    let path = dir.join(format!("{name}.png"));
    let out = Command::new(chromium)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg("--window-size=1200,900")
        .arg(format!("--screenshot={}", path.display()))
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "chromium {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&path).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "{}", path.display());
}

/// The status code of a GET (Chromium's DOM dump does not show it).
fn status(base: &str, path: &str) -> u16 {
    request(base, "GET", path, &[], "").0
}

/// One HTTP/1.0 request, `Host` set to the address unless `headers` give
/// one; the status and the body.
fn request(base: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let addr: SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    let mut head = format!("{method} {path} HTTP/1.0\r\n");
    if !headers.iter().any(|(h, _)| h.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: {addr}\r\n"));
    }
    for (h, v) in headers {
        head.push_str(&format!("{h}: {v}\r\n"));
    }
    if !body.is_empty() {
        head.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(head.as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let code = answer.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (code, text(body))
}

/// A form body, its values percent-encoded.
fn form(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| {
            let v: String = v
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            format!("{k}={v}")
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Text as the page shows it: tags dropped, whitespace collapsed, the
/// entities the templates produce decoded.
fn text(html: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' => {
                in_tag = false;
                out.push(' ');
            }
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    let out = out
        .replace("&amp;", "&")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#x2f;", "/")
        .replace("&#x27;", "'");
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn shots_dir() -> (PathBuf, Option<tempfile::TempDir>) {
    match std::env::var_os("ONCELY_SCREENSHOTS") {
        Some(dir) => {
            std::fs::create_dir_all(&dir).unwrap();
            (PathBuf::from(dir), None)
        }
        None => {
            let t = tempfile::tempdir().unwrap();
            (t.path().to_owned(), Some(t))
        }
    }
}

/// Every view, on one seeded ledger, as the person at the browser sees it.
/// `shots`: where the screenshots go (named `serve-<view>`).
async fn look_at_every_view(chromium: &Path, s: &Serve, seeded: &Seeded, shots: Option<&Path>) {
    let (chromium, base) = (chromium.to_owned(), s.base.clone());
    let load = |path: &str| {
        let (c, url) = (chromium.clone(), format!("{base}{path}"));
        tokio::task::spawn_blocking(move || text(&dom(&c, &url)))
    };
    let t = seeded.tenant.as_str();

    // Overview: the counts per kind.
    let page = load("/").await.unwrap();
    assert!(page.contains("Records per tenant and kind"), "{page}");
    assert!(page.contains(&format!("{t} capture 0 1 0 3 0 4")), "{page}");
    assert!(page.contains(&format!("{t} email 0 0 1 0 0 1")), "{page}");
    assert!(page.contains(&format!("tenant {t}")), "{page}");

    // Stuck: the stuck key, with its age.
    let page = load("/stuck").await.unwrap();
    let row = page
        .split_once(seeded.stuck.as_str())
        .unwrap_or_else(|| panic!("{} not listed: {page}", seeded.stuck))
        .1;
    // Kind, fence, age ("1s", "2s", …) and how long ago its lease ended.
    let mut cells = row.split_whitespace();
    assert_eq!(cells.next(), Some("capture"), "{row}");
    assert_eq!(
        cells.next(),
        Some(seeded.stuck_fence.to_string().as_str()),
        "{row}"
    );
    let age = cells.next().unwrap();
    assert!(
        age.ends_with('s') && age[..age.len() - 1].parse::<u64>().is_ok(),
        "age {age:?}: {row}"
    );
    assert!(row.contains(" ago"), "{row}");
    assert!(!page.contains(seeded.abandoned.as_str()), "{page}");
    assert!(!page.contains(seeded.completed[0].as_str()), "{page}");

    // Abandoned: the email, not the capture.
    let page = load("/abandoned").await.unwrap();
    assert!(page.contains(seeded.abandoned.as_str()), "{page}");
    assert!(!page.contains(seeded.stuck.as_str()), "{page}");

    // One record each: its state, fence, outcome size, fingerprint.
    let page = load(&format!("/record/{}", seeded.completed[0])).await.unwrap();
    assert!(page.contains("State completed"), "{page}");
    assert!(
        page.contains(&format!("Fence {}", seeded.completed_fence)),
        "{page}"
    );
    assert!(page.contains("bytes stored"), "{page}");
    assert!(page.contains("Fingerprint present"), "{page}");
    let page = load(&format!("/record/{}", seeded.completed[1])).await.unwrap();
    assert!(page.contains("Fingerprint none"), "{page}");
    let page = load(&format!("/record/{}", seeded.completed[2])).await.unwrap();
    assert!(page.contains("Outcome encrypted (key k1, "), "{page}");
    let page = load(&format!("/record/{}", seeded.stuck)).await.unwrap();
    assert!(page.contains("State stuck"), "{page}");
    assert!(page.contains("Outcome none stored"), "{page}");
    assert!(page.contains("ago)"), "lease ended … ago: {page}");
    let page = load(&format!("/record/{}", seeded.abandoned)).await.unwrap();
    assert!(page.contains("State abandoned"), "{page}");
    assert!(page.contains("At most once yes"), "{page}");

    // Another tenant: 403, nothing of it shown.
    let other = format!("{t}-other/capture:order-1");
    let page = load(&format!("/record/{other}")).await.unwrap();
    assert!(page.contains("403 Forbidden"), "{page}");
    assert!(page.contains(&format!("shows tenant {t} only")), "{page}");
    assert!(!page.contains("State"), "{page}");
    assert_eq!(status(&s.base, &format!("/record/{other}")), 403);
    let page = load(&format!("/stuck?tenant={t}-other")).await.unwrap();
    assert!(page.contains("403 Forbidden"), "{page}");
    assert!(!page.contains(seeded.stuck.as_str()), "{page}");
    assert_eq!(status(&s.base, &format!("/?tenant={t}-other")), 403);

    // A malformed key: 400, a page that says what a key looks like.
    let page = load("/record/not-a-key").await.unwrap();
    assert!(page.contains("400 Bad Request"), "{page}");
    assert!(page.contains("TENANT/KIND:SUBJECT"), "{page}");
    assert!(page.contains("Nothing was changed"), "{page}");
    assert_eq!(status(&s.base, "/record/not-a-key"), 400);
    assert_eq!(status(&s.base, "/stuck?after_t=soon&after_key=x"), 400);
    assert_eq!(status(&s.base, "/nope"), 404);

    if let Some(dir) = shots {
        for (name, path) in [
            ("overview", "/".to_owned()),
            ("stuck", "/stuck".to_owned()),
            ("abandoned", "/abandoned".to_owned()),
            ("record", format!("/record/{}", seeded.stuck)),
            ("forbidden", format!("/record/{other}")),
        ] {
            let (c, url, dir) = (chromium.clone(), format!("{base}{path}"), dir.to_owned());
            tokio::task::spawn_blocking(move || screenshot(&c, &url, &dir, &format!("serve-{name}")))
                .await
                .unwrap();
        }
    }
}

/// With `--allow-resolve`: the abandoned step's page offers the form; a
/// POST with a stale fence, without the page's token or from another origin
/// changes nothing; the form as the page gives it releases the step.
async fn resolve_the_abandoned_step(chromium: &Path, s: &Serve, seeded: &Seeded) {
    let (c, url) = (
        chromium.to_owned(),
        format!("{}/record/{}", s.base, seeded.abandoned),
    );
    let html = tokio::task::spawn_blocking(move || dom(&c, &url)).await.unwrap();
    assert!(
        text(&html).contains("Release: the next delivery of its message runs it again"),
        "{html}"
    );
    let field = |name: &str| {
        let at = html
            .find(&format!("name=\"{name}\" value=\""))
            .unwrap_or_else(|| panic!("{name}: {html}"));
        let rest = &html[at + name.len() + 15..];
        rest[..rest.find('"').unwrap()].to_owned()
    };
    let (token, fence) = (field("token"), field("fence"));
    let key = seeded.abandoned.to_string();
    let post = |fence: &str, token: &str, origin: Option<&str>| {
        let body = form(&[
            ("key", &key),
            ("fence", fence),
            ("token", token),
            ("action", "release"),
        ]);
        let headers: Vec<(&str, &str)> = origin.map(|o| ("Origin", o)).into_iter().collect();
        request(&s.base, "POST", "/resolve", &headers, &body)
    };
    let stale = (fence.parse::<u64>().unwrap() + 1).to_string();
    let (code, page) = post(&stale, &token, None);
    assert_eq!(code, 409, "{page}");
    assert!(page.contains("Nothing was written"), "{page}");
    let (code, page) = post(&fence, "not-the-token", None);
    assert_eq!(code, 403, "{page}");
    let (code, page) = post(&fence, &token, Some("http://evil.example"));
    assert_eq!(code, 403, "{page}");
    let (c, url) = (
        chromium.to_owned(),
        format!("{}/record/{}", s.base, seeded.abandoned),
    );
    let page = tokio::task::spawn_blocking(move || text(&dom(&c, &url)))
        .await
        .unwrap();
    assert!(page.contains("State abandoned"), "nothing changed: {page}");

    let origin = s.base.clone();
    let (code, page) = post(&fence, &token, Some(&origin));
    assert_eq!(code, 200, "{page}");
    assert!(page.contains(&format!("Resolved {key}")), "{page}");
    assert!(page.contains("Was abandoned"), "{page}");
    assert!(page.contains("Now released"), "{page}");
    // The operator is told that the release needs a delivery of the
    // message, and where a held one ends up.
    assert!(
        page.contains("Next the step is performed by the next delivery"),
        "{page}"
    );
    assert!(page.contains("dead-letter"), "{page}");
    let (c, url) = (
        chromium.to_owned(),
        format!("{}/record/{}", s.base, seeded.abandoned),
    );
    let page = tokio::task::spawn_blocking(move || text(&dom(&c, &url)))
        .await
        .unwrap();
    assert!(page.contains("State released"), "{page}");
    let (c, url) = (chromium.to_owned(), format!("{}/", s.base));
    let page = tokio::task::spawn_blocking(move || text(&dom(&c, &url)))
        .await
        .unwrap();
    let t = seeded.tenant.as_str();
    assert!(page.contains(&format!("{t} email 0 0 0 0 1 1")), "{page}");
    assert!(
        page.contains(&format!("{t} oncely-audit 0 0 0 1 0 1")),
        "the audit record: {page}"
    );
}

/// SQLite, with the gap chart drawn from the example's real workload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_view_on_sqlite_with_the_gap_chart() {
    let Some(chromium) = chromium() else { return };
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}?mode=rwc", dir.path().join("ledger.db").display());
    let seeded = seed(&url, Tenant::new("acme").unwrap()).await;

    // The consumer: its exporter on a free port, its scripted workload run
    // to the end so the gap histogram holds its known numbers.
    let metrics_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    metrics_prometheus::install(metrics_addr).unwrap();
    let workload = metrics_prometheus::Workload::default();
    let work_dir = tempfile::tempdir().unwrap();
    metrics_prometheus::run_workload(work_dir.path(), &workload)
        .await
        .unwrap();
    let gaps = workload.expected().redelivery_gaps;

    let metrics_url = format!("http://{metrics_addr}/metrics");
    let s = serve(&[
        "--database-url",
        &url,
        "--tenant",
        "acme",
        "--metrics-url",
        &metrics_url,
        "--retention",
        "7d",
        "--allow-resolve",
    ]);
    let (shots, _keep) = shots_dir();
    look_at_every_view(&chromium, &s, &seeded, Some(&shots)).await;

    let (c, gaps_url) = (chromium.clone(), format!("{}/gaps", s.base));
    let html = tokio::task::spawn_blocking(move || dom(&c, &gaps_url))
        .await
        .unwrap();
    assert!(html.contains("<svg"), "{html}");
    let page = text(&html);
    assert!(page.contains("Kind capture"), "{page}");
    assert!(
        page.contains("retention 7d"),
        "the retention line's label: {page}"
    );
    assert!(
        page.contains(&format!("{gaps} gaps observed")),
        "{gaps} gaps: {page}"
    );
    assert!(
        page.contains("All of them arrived within the retention of 7d"),
        "{page}"
    );
    let (c, gaps_url, d) = (chromium.clone(), format!("{}/gaps", s.base), shots.clone());
    tokio::task::spawn_blocking(move || screenshot(&c, &gaps_url, &d, "serve-gaps"))
        .await
        .unwrap();

    resolve_the_abandoned_step(&chromium, &s, &seeded).await;

    // A retention shorter than the late duplicates' gap (2 s or more): the
    // chart says some arrived after it.
    let short = serve(&[
        "--database-url",
        &url,
        "--tenant",
        "acme",
        "--metrics-url",
        &metrics_url,
        "--retention",
        "1s",
    ]);
    let (c, gaps_url) = (chromium.clone(), format!("{}/gaps", short.base));
    let page = tokio::task::spawn_blocking(move || text(&dom(&c, &gaps_url)))
        .await
        .unwrap();
    assert!(page.contains("retention 1s"), "{page}");
    // At least the late duplicates (a prompt one on a loaded machine may
    // be late too).
    let after: u64 = page
        .split_once(" arrived after the retention of 1s")
        .and_then(|(before, _)| before.split_whitespace().last()?.parse().ok())
        .unwrap_or_else(|| panic!("{page}"));
    assert!(after >= workload.expected().late_gaps, "{after}: {page}");
}

/// PostgreSQL, a fresh tenant among whatever else the database holds,
/// served for all tenants; no metrics endpoint, so the gap page says how to
/// give one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_view_on_postgres() {
    let Some(chromium) = chromium() else { return };
    let Some(url) = service_url(
        "ONCELY_POSTGRES_URL",
        Some("postgres://postgres@127.0.0.1:5432/test"),
    ) else {
        return;
    };
    if let Err(e) = AnyLedger::connect(&url).await {
        skip_or_fail::<()>(&format!("PostgreSQL at {url}: {e}"));
        return;
    }
    let seeded = seed(&url, fresh_tenant()).await;
    let t = seeded.tenant.to_string();
    let s = serve(&["--database-url", &url, "--tenant", &t]);
    look_at_every_view(&chromium, &s, &seeded, None).await;

    // Read-only: no form, and a POST is refused. A Host that is not a
    // loopback name (DNS rebinding) is refused too.
    let (c, u) = (chromium.clone(), format!("{}/record/{}", s.base, seeded.stuck));
    let page = tokio::task::spawn_blocking(move || text(&dom(&c, &u)))
        .await
        .unwrap();
    assert!(page.contains("read-only"), "{page}");
    assert!(!page.contains("Release:"), "{page}");
    let body = form(&[
        ("key", seeded.stuck.as_str()),
        ("fence", "1"),
        ("token", "x"),
        ("action", "release"),
    ]);
    let (code, page) = request(&s.base, "POST", "/resolve", &[], &body);
    assert_eq!(code, 403, "{page}");
    assert!(page.contains("--allow-resolve"), "{page}");
    let (code, page) = request(&s.base, "GET", "/", &[("Host", "evil.example")], "");
    assert_eq!(code, 403, "{page}");
    assert!(page.contains("not a loopback name"), "{page}");

    let (c, gaps_url) = (chromium.clone(), format!("{}/gaps", s.base));
    let page = tokio::task::spawn_blocking(move || text(&dom(&c, &gaps_url)))
        .await
        .unwrap();
    assert!(page.contains("No metrics endpoint given"), "{page}");
    assert!(page.contains("--metrics-url http://HOST:PORT/metrics"), "{page}");

    // Across tenants: this tenant is one of them, picked with ?tenant=.
    let all = serve(&["--database-url", &url, "--all-tenants"]);
    let (c, u) = (chromium.clone(), format!("{}/stuck?tenant={t}", all.base));
    let page = tokio::task::spawn_blocking(move || text(&dom(&c, &u)))
        .await
        .unwrap();
    assert!(page.contains(seeded.stuck.as_str()), "{page}");
    assert!(page.contains(&format!("tenant {t} (of all tenants)")), "{page}");
}

/// A fake exporter on a free port: `GET /PATH` answers `scrapes[PATH]`.
fn fake_exporter(scrapes: Vec<(&'static str, String)>) -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut head = String::new();
            let mut r = BufReader::new(&s);
            while r.read_line(&mut head).is_ok_and(|n| n > 0) && !head.ends_with("\r\n\r\n") {}
            let path = head.split_whitespace().nth(1).unwrap_or_default().to_owned();
            let body = scrapes
                .iter()
                .find(|(p, _)| *p == path)
                .map_or("", |(_, b)| b.as_str());
            let _ = write!(s, "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n{body}");
        }
    });
    addr
}

/// A scrape whose bucket bounds are no duration (NaN, negative, past what
/// a duration holds) gets the gap page with the reason, not a dropped
/// connection; a sane one next to it is drawn.
#[test]
fn the_gap_page_refuses_bounds_that_are_no_duration() {
    let scrape = |le: &str| {
        format!(
            "# TYPE oncely_redelivery_gap_seconds histogram\n\
             oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",le=\"1\"}} 2\n\
             oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",le=\"{le}\"}} 3\n\
             oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",le=\"+Inf\"}} 3\n"
        )
    };
    let exporter = fake_exporter(vec![
        ("/nan", scrape("NaN")),
        ("/negative", scrape("-1")),
        ("/huge", scrape("1e300")),
        ("/sane", scrape("60")),
    ]);
    for (path, says) in [
        ("/nan", r#"le="NaN" in the scrape: not a number"#),
        ("/negative", r#"le="-1" in the scrape: negative"#),
        ("/huge", r#"le="1e300" in the scrape: too large"#),
    ] {
        let metrics = format!("http://{exporter}{path}");
        let s = serve(&[
            "--database-url",
            "memory:",
            "--all-tenants",
            "--metrics-url",
            &metrics,
        ]);
        let (code, page) = request(&s.base, "GET", "/gaps", &[], "");
        assert_eq!(code, 502, "{path}: {page}");
        assert!(page.contains(says), "{path}: wanted {says:?} in {page}");
    }
    let metrics = format!("http://{exporter}/sane");
    let s = serve(&[
        "--database-url",
        "memory:",
        "--all-tenants",
        "--metrics-url",
        &metrics,
    ]);
    let (code, page) = request(&s.base, "GET", "/gaps", &[], "");
    assert_eq!(code, 200, "{page}");
    assert!(
        page.contains("3 gaps observed; the longest is at most 1m"),
        "{page}"
    );
}

/// Several `--metrics-url`s (one per replica) are summed; retries that
/// found their effect in progress are not redelivery gaps.
#[test]
fn the_gap_page_sums_every_replicas_scrape() {
    let replica = |completed: u32, in_progress: u32| {
        format!(
            "# TYPE oncely_redelivery_gap_seconds histogram\n\
             oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"completed\",le=\"1\"}} {completed}\n\
             oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"completed\",le=\"+Inf\"}} {completed}\n\
             oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"in_progress\",le=\"1\"}} {in_progress}\n\
             oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"in_progress\",le=\"+Inf\"}} {in_progress}\n"
        )
    };
    let exporter = fake_exporter(vec![("/a", replica(61, 180)), ("/b", replica(9, 61))]);
    let (a, b) = (format!("http://{exporter}/a"), format!("http://{exporter}/b"));
    let s = serve(&[
        "--database-url",
        "memory:",
        "--all-tenants",
        "--metrics-url",
        &a,
        "--metrics-url",
        &b,
    ]);
    let (code, page) = request(&s.base, "GET", "/gaps", &[], "");
    assert_eq!(code, 200, "{page}");
    assert!(page.contains("70 gaps observed"), "{page}");
    assert!(page.contains(&format!("Scraped from {a}, {b}")), "{page}");
}

/// `/lookup` sends an HTTP request's principal and key to its record.
#[test]
fn the_lookup_form_finds_an_http_requests_record() {
    let s = serve(&["--database-url", "memory:", "--all-tenants"]);
    let (code, page) = request(
        &s.base,
        "GET",
        "/lookup?tenant=acme&principal=alice&client_key=refund-7f3a",
        &[],
        "",
    );
    assert_eq!(code, 303, "{page}");
    let addr: SocketAddr = s.base.trim_start_matches("http://").parse().unwrap();
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET /lookup?tenant=acme&principal=alice&client_key=refund-7f3a HTTP/1.0\r\nHost: {addr}\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let key = EffectKey::for_client(&Tenant::new("acme").unwrap(), "alice", "http", "refund-7f3a").unwrap();
    assert!(
        answer
            .to_ascii_lowercase()
            .contains(&format!("location: /record/{}", key.as_str()).to_ascii_lowercase()),
        "{answer}"
    );
    let (code, page) = request(&s.base, "GET", "/lookup?principal=alice", &[], "");
    assert_eq!(code, 400, "{page}");
}

/// What `serve` refuses before it listens: a non-loopback address, an
/// unknown database or metrics URL scheme, a backend without listings.
#[test]
fn serve_refuses_what_it_cannot_do_safely() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_oncely"))
            .arg("serve")
            .args(args)
            .env_remove("ONCELY_DATABASE_URL")
            .output()
            .unwrap()
    };
    for (args, says) in [
        (
            &[
                "--database-url",
                "memory:",
                "--all-tenants",
                "--listen",
                "0.0.0.0:0",
            ][..],
            "refusing to listen on 0.0.0.0:0: not a loopback address",
        ),
        (
            &["--database-url", "mongodb://localhost/x", "--all-tenants"][..],
            "unknown database URL scheme 'mongodb'",
        ),
        (
            &[
                "--database-url",
                "memory:",
                "--all-tenants",
                "--metrics-url",
                "ftp://x/metrics",
            ][..],
            "unknown --metrics-url scheme 'ftp'",
        ),
        (
            &["--database-url", "redis://127.0.0.1:1", "--all-tenants"][..],
            "cannot do",
        ),
        (
            &[
                "--database-url",
                "memory:",
                "--all-tenants",
                "--retention",
                "a week",
            ][..],
            "invalid duration",
        ),
        (
            &["--database-url", "memory:", "--tenant", "bad/tenant"][..],
            "tenant",
        ),
    ] {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // Neither --tenant nor --all-tenants: clap's usage error.
    let out = run(&["--database-url", "memory:"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--all-tenants"));
}
