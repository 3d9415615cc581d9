//! The redelivery-gap chart: read [`REDELIVERY_GAP_SECONDS`] from the
//! consumer's Prometheus endpoint, draw its buckets as bars and the
//! retention as a vertical line across them.
//!
//! The endpoint is scraped with one plain HTTP/1.0 GET (what Prometheus
//! itself does, minus the negotiation): exporters answer it with the text
//! format and no chunking, and the page needs no HTTP client crate for it.

use std::fmt::Write as _;
use std::time::Duration;

use oncely::telemetry::REDELIVERY_GAP_SECONDS;
use oncely::{Error, Result};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::time::format_duration;

/// How long a scrape may take before the page says the endpoint did not
/// answer.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a scrape the page reads.
const MAX_SCRAPE_BYTES: u64 = 16 * 1024 * 1024;

/// A consumer's Prometheus endpoint, `http://HOST:PORT/PATH` (plain HTTP:
/// point it at the consumer's own listener, usually on a private network).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsUrl {
    host: String,
    port: u16,
    path: String,
}

impl MetricsUrl {
    /// Parses `http://HOST[:PORT][/PATH]` (port 80 and path `/metrics` by
    /// default). Any other scheme fails with [`Error::Config`] naming it.
    pub fn parse(url: &str) -> Result<MetricsUrl> {
        let url = url.trim();
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(Error::Config(format!(
                "--metrics-url {url:?} has no scheme (expected http://HOST:PORT/metrics)"
            )));
        };
        if !scheme.eq_ignore_ascii_case("http") {
            return Err(Error::Config(format!(
                "unknown --metrics-url scheme '{scheme}' (expected http://HOST:PORT/metrics; \
                 https is not supported: scrape the consumer's plain listener)"
            )));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/metrics"),
        };
        let bad = || Error::Config(format!("--metrics-url {url:?}: invalid host or port"));
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6.split_once(']').ok_or_else(bad)?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad())?,
                None if after.is_empty() => 80,
                None => return Err(bad()),
            };
            (h.to_owned(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), p.parse().map_err(|_| bad())?),
                None => (authority.to_owned(), 80),
            }
        };
        if host.is_empty() || host.contains('@') {
            return Err(bad());
        }
        Ok(MetricsUrl {
            host,
            port,
            path: path.to_owned(),
        })
    }

    /// GETs the endpoint and returns the body (the Prometheus text format).
    pub async fn scrape(&self) -> Result<String> {
        tokio::time::timeout(SCRAPE_TIMEOUT, self.get())
            .await
            .map_err(|_| self.unavailable(format!("no answer within {}", format_duration(SCRAPE_TIMEOUT))))?
    }

    async fn get(&self) -> Result<String> {
        let io = |e: std::io::Error| self.unavailable(e.to_string());
        let mut stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(io)?;
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let request = format!(
            "GET {} HTTP/1.0\r\nHost: {host}:{}\r\nAccept: text/plain\r\nUser-Agent: oncely-serve\r\n\r\n",
            self.path, self.port
        );
        stream.write_all(request.as_bytes()).await.map_err(io)?;
        let mut raw = Vec::new();
        stream
            .take(MAX_SCRAPE_BYTES)
            .read_to_end(&mut raw)
            .await
            .map_err(io)?;
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| self.unavailable("not an HTTP response".to_owned()))?;
        let status = head.lines().next().unwrap_or_default();
        if status.split_whitespace().nth(1) != Some("200") {
            return Err(self.unavailable(format!("answered {status:?}")));
        }
        let chunked = head.lines().any(|l| {
            let l = l.to_ascii_lowercase();
            l.starts_with("transfer-encoding:") && l.contains("chunked")
        });
        Ok(if chunked { dechunk(body) } else { body.to_owned() })
    }

    fn unavailable(&self, reason: String) -> Error {
        Error::Config(format!("could not read metrics from {self}: {reason}"))
    }
}

impl std::fmt::Display for MetricsUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "http://[{}]:{}{}", self.host, self.port, self.path)
        } else {
            write!(f, "http://{}:{}{}", self.host, self.port, self.path)
        }
    }
}

/// A chunked body, joined (servers answering HTTP/1.0 should not chunk;
/// this is for those that do anyway).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// One kind's redelivery gaps, summed over every other label (instances,
/// consumers).
#[derive(Debug, Clone, PartialEq)]
pub struct GapHistogram {
    /// The `kind` label.
    pub kind: String,
    /// `(upper bound in seconds, cumulative count)`, ascending, the last
    /// bound `+Inf`.
    pub buckets: Vec<(f64, u64)>,
}

impl GapHistogram {
    /// Every gap observed.
    pub fn total(&self) -> u64 {
        self.buckets.last().map_or(0, |b| b.1)
    }

    /// `(lower, upper, count)` per bucket: the gaps above `lower` and at
    /// most `upper` seconds.
    pub fn bars(&self) -> Vec<(f64, f64, u64)> {
        let mut lower = 0.0;
        let mut below = 0;
        self.buckets
            .iter()
            .map(|&(upper, cumulative)| {
                let bar = (lower, upper, cumulative.saturating_sub(below));
                lower = upper;
                below = cumulative;
                bar
            })
            .collect()
    }
}

/// The `oncely_redelivery_gap_seconds_bucket` series of a Prometheus text
/// scrape (or of several replicas' scrapes, one after the other: the series
/// of one bucket are summed), one histogram per `kind`, sorted by kind, of
/// the duplicates that found their effect completed (`found="completed"`,
/// or no `found` label, as before it existed). Lines that are not
/// that metric's buckets are skipped; a bucket line it cannot read fails,
/// as does one whose bound is no duration (NaN, negative, too large; `+Inf`
/// is the last bucket's) or whose count is no count (NaN, negative, past
/// `u64`), with [`Error::Config`] quoting the line.
pub fn parse_gap_histograms(scrape: &str) -> Result<Vec<GapHistogram>> {
    let metric = format!("{REDELIVERY_GAP_SECONDS}_bucket");
    let mut by_kind: std::collections::BTreeMap<String, Vec<(f64, u64)>> = Default::default();
    for line in scrape.lines() {
        let Some(rest) = line.trim().strip_prefix(metric.as_str()) else {
            continue;
        };
        let bad = || Error::Config(format!("unreadable histogram line in the scrape: {line:?}"));
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => {
                let end = label_end(r).ok_or_else(bad)?;
                (parse_labels(&r[..end]).ok_or_else(bad)?, &r[end + 1..])
            }
            None if rest.starts_with(' ') => (Vec::new(), rest),
            None => continue, // another metric with this prefix
        };
        let value = value.split_whitespace().next().ok_or_else(bad)?;
        let count = bucket_count(value).ok_or_else(|| {
            Error::Config(format!(
                "unusable histogram bucket count {value:?} in the scrape: not a count (0 up to \
                 2^64 - 1): {line:?}"
            ))
        })?;
        let le = &labels.iter().find(|(k, _)| k == "le").ok_or_else(bad)?.1;
        let le = bucket_bound(le).map_err(|why| {
            Error::Config(format!(
                "unusable histogram bucket bound le={le:?} in the scrape: {why} (a bound is \
                 0 or more seconds, or +Inf): {line:?}"
            ))
        })?;
        // A retry that found its effect still in progress is no redelivery
        // gap: only duplicates of completed effects size the retention.
        if labels.iter().any(|(k, v)| k == "found" && v != "completed") {
            continue;
        }
        let kind = labels
            .iter()
            .find(|(k, _)| k == "kind")
            .map_or_else(|| "(no kind)".to_owned(), |(_, v)| v.clone());
        let buckets = by_kind.entry(kind).or_default();
        match buckets.iter_mut().find(|(b, _)| *b == le) {
            // Several instances' series of one bucket are summed.
            Some(slot) => {
                slot.1 = slot.1.checked_add(count).ok_or_else(|| {
                    Error::Config(format!(
                        "the histogram bucket counts at le={le} in the scrape add up past \
                         2^64 - 1: {line:?}"
                    ))
                })?
            }
            None => buckets.push((le, count)),
        }
    }
    Ok(by_kind
        .into_iter()
        .map(|(kind, mut buckets)| {
            buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            GapHistogram { kind, buckets }
        })
        .collect())
}

/// A bucket's upper bound in seconds: `+Inf` (the last bucket), or a
/// number a [`Duration`] holds, so that drawing it cannot fail.
fn bucket_bound(le: &str) -> std::result::Result<f64, &'static str> {
    let secs: f64 = le.parse().map_err(|_| "not a number")?;
    if secs == f64::INFINITY {
        return Ok(secs);
    }
    match Duration::try_from_secs_f64(secs) {
        Ok(_) => Ok(secs),
        Err(_) if secs.is_nan() => Err("not a number"),
        Err(_) if secs < 0.0 => Err("negative"),
        Err(_) => Err("too large for a duration"),
    }
}

/// A bucket's count: Prometheus writes it as a float; the fraction, which
/// only a scaled count has, is dropped.
fn bucket_count(value: &str) -> Option<u64> {
    let n: f64 = value.parse().ok()?;
    // 2^64 is exact as an f64; `as` then cannot saturate.
    (0.0..18_446_744_073_709_551_616.0)
        .contains(&n)
        .then_some(n as u64)
}

/// Where the `}` closing a label set is (label values may hold an escaped
/// `"` or a `}`).
fn label_end(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

fn parse_labels(s: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let (name, after) = rest.split_once('=')?;
        let after = after.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        out.push((name.trim().to_owned(), value));
        rest = after[end + 1..].trim_start().trim_start_matches(',').trim_start();
    }
    Some(out)
}

/// What the chart says in words about one kind's gaps and the retention.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Verdict {
    pub kind: String,
    pub total: u64,
    /// Gaps in buckets whose upper bound is at most the retention.
    pub within: u64,
    /// Gaps in buckets that lie entirely above the retention.
    pub beyond: u64,
    /// Gaps in the bucket the retention falls inside: above or below it.
    pub straddling: u64,
    /// The upper bound of the highest non-empty bucket, as a duration.
    pub longest: Option<String>,
    pub svg: String,
}

pub(crate) fn verdict(h: &GapHistogram, retention: Duration) -> Verdict {
    let r = retention.as_secs_f64();
    let (mut within, mut beyond, mut straddling) = (0, 0, 0);
    let mut longest = None;
    for (lower, upper, n) in h.bars() {
        if n == 0 {
            continue;
        }
        longest = Some(bound_label(upper));
        // Saturating: bars of a histogram whose buckets are not cumulative
        // (a scrape's sum over series that lack some buckets) can add up
        // past its total.
        if upper <= r {
            within = n.saturating_add(within);
        } else if lower >= r {
            beyond = n.saturating_add(beyond);
        } else {
            straddling = n.saturating_add(straddling);
        }
    }
    Verdict {
        kind: h.kind.clone(),
        total: h.total(),
        within,
        beyond,
        straddling,
        longest,
        svg: chart(h, retention),
    }
}

/// A bound as a duration. The parser lets through only bounds a duration
/// holds (and +Inf); a histogram built otherwise is labelled, not a panic.
fn bound_label(upper: f64) -> String {
    match Duration::try_from_secs_f64(upper) {
        Ok(d) => format_duration(d),
        Err(_) if upper == f64::INFINITY => "∞".to_owned(),
        Err(_) => format!("{upper}s"),
    }
}

/// The SVG: one bar per bucket (equal widths: the bounds are roughly
/// logarithmic), the count above each non-empty bar, and the retention as
/// a red vertical line placed inside its bucket on a log scale.
pub(crate) fn chart(h: &GapHistogram, retention: Duration) -> String {
    const W: f64 = 1100.0;
    const H: f64 = 330.0;
    const LEFT: f64 = 50.0;
    const RIGHT: f64 = 20.0;
    const TOP: f64 = 40.0;
    const BOTTOM: f64 = 50.0;
    let bars = h.bars();
    let n = bars.len().max(1) as f64;
    let plot_w = W - LEFT - RIGHT;
    let plot_h = H - TOP - BOTTOM;
    let slot = plot_w / n;
    let max = bars.iter().map(|b| b.2).max().unwrap_or(0).max(1) as f64;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="redelivery gaps of kind {kind}, retention {ret}" font-family="system-ui, sans-serif" font-size="12">"##,
        kind = esc(&h.kind),
        ret = format_duration(retention),
    );
    let base = TOP + plot_h;
    let _ = write!(
        svg,
        r##"<line x1="{LEFT}" y1="{base}" x2="{x2}" y2="{base}" stroke="#555"/><text x="14" y="{ty}" fill="#555" transform="rotate(-90 14 {ty})" text-anchor="middle">duplicates</text>"##,
        x2 = W - RIGHT,
        ty = TOP + plot_h / 2.0,
    );
    for (i, (_, upper, count)) in bars.iter().enumerate() {
        let x = LEFT + i as f64 * slot;
        let bh = if *count == 0 {
            0.0
        } else {
            (*count as f64 / max * (plot_h - 20.0)).max(2.0)
        };
        let _ = write!(
            svg,
            r##"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{bh:.1}" fill="#4a7bb7"><title>{label}: {count}</title></rect>"##,
            x = x + slot * 0.12,
            y = base - bh,
            w = slot * 0.76,
            label = esc(&format!("≤ {}", bound_label(*upper))),
        );
        if *count > 0 {
            let _ = write!(
                svg,
                r##"<text x="{cx:.1}" y="{y:.1}" text-anchor="middle" fill="#222">{count}</text>"##,
                cx = x + slot / 2.0,
                y = base - bh - 4.0,
            );
        }
        let _ = write!(
            svg,
            r##"<text x="{cx:.1}" y="{y:.1}" text-anchor="middle" fill="#444">{label}</text>"##,
            cx = x + slot / 2.0,
            y = base + 16.0,
            label = esc(&bound_label(*upper)),
        );
    }
    let _ = write!(
        svg,
        r##"<text x="{cx}" y="{y}" text-anchor="middle" fill="#444">gap between the first claim and a duplicate (bucket upper bound)</text>"##,
        cx = LEFT + plot_w / 2.0,
        y = base + 38.0,
    );
    let rx = LEFT + retention_position(&bars, retention.as_secs_f64()) * slot;
    let _ = write!(
        svg,
        r##"<line x1="{rx:.1}" y1="{y1}" x2="{rx:.1}" y2="{base}" stroke="#c0392b" stroke-width="2" stroke-dasharray="6 3"/><text x="{tx:.1}" y="{ty}" text-anchor="{anchor}" fill="#c0392b" font-weight="bold">retention {ret}</text>"##,
        y1 = TOP - 4.0,
        tx = if rx > W - 160.0 { rx - 6.0 } else { rx + 6.0 },
        anchor = if rx > W - 160.0 { "end" } else { "start" },
        ty = TOP + 10.0,
        ret = format_duration(retention),
    );
    svg.push_str("</svg>");
    svg
}

/// Where the retention lies, in bar widths from the left: inside its
/// bucket, interpolated on a log scale between the bucket's bounds.
fn retention_position(bars: &[(f64, f64, u64)], r: f64) -> f64 {
    for (i, &(lower, upper, _)) in bars.iter().enumerate() {
        if r <= upper {
            if upper.is_infinite() {
                return i as f64 + 0.05;
            }
            // A bound of 0 has no log: the line goes at its bar's left.
            if upper <= 0.0 {
                return i as f64;
            }
            let lower = if lower > 0.0 { lower } else { upper / 2.0 };
            let f = ((r.max(lower)).ln() - lower.ln()) / (upper.ln() - lower.ln());
            return i as f64 + f.clamp(0.0, 1.0);
        }
    }
    bars.len() as f64
}

/// Escapes text for SVG (XML) content and attributes.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# TYPE oncely_redelivery_gap_seconds histogram
oncely_redelivery_gap_seconds_bucket{kind="capture",le="1"} 4
oncely_redelivery_gap_seconds_bucket{kind="capture",le="2"} 4
oncely_redelivery_gap_seconds_bucket{kind="capture",le="5"} 7
oncely_redelivery_gap_seconds_bucket{kind="capture",le="+Inf"} 7
oncely_redelivery_gap_seconds_sum{kind="capture"} 9.5
oncely_redelivery_gap_seconds_count{kind="capture"} 7
oncely_redelivery_gap_seconds_bucket{kind="mail, \"quoted\" }",le="1"} 1
oncely_redelivery_gap_seconds_bucket{kind="mail, \"quoted\" }",le="+Inf"} 2
oncely_claims_total{kind="capture",result="acquired"} 12
"#;

    #[test]
    fn buckets_are_read_per_kind() {
        let hs = parse_gap_histograms(SCRAPE).unwrap();
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0].kind, "capture");
        assert_eq!(
            hs[0].buckets,
            vec![(1.0, 4), (2.0, 4), (5.0, 7), (f64::INFINITY, 7)]
        );
        assert_eq!(hs[0].total(), 7);
        assert_eq!(
            hs[0].bars(),
            vec![
                (0.0, 1.0, 4),
                (1.0, 2.0, 0),
                (2.0, 5.0, 3),
                (5.0, f64::INFINITY, 0)
            ]
        );
        assert_eq!(hs[1].kind, "mail, \"quoted\" }");
        assert_eq!(hs[1].total(), 2);
    }

    /// Retries that found the effect in progress are no redelivery gaps;
    /// two replicas' scrapes, one after the other, are summed per bucket.
    #[test]
    fn in_progress_retries_are_left_out_and_replicas_summed() {
        let replica = |completed: u32, in_progress: u32| {
            format!(
                "oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"completed\",le=\"1\"}} {completed}\n\
                 oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"completed\",le=\"+Inf\"}} {completed}\n\
                 oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"in_progress\",le=\"1\"}} {in_progress}\n\
                 oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",found=\"in_progress\",le=\"+Inf\"}} {in_progress}\n"
            )
        };
        let one = parse_gap_histograms(&replica(61, 180)).unwrap();
        assert_eq!(one[0].total(), 61, "the 180 in-progress retries are not gaps");
        let both = parse_gap_histograms(&(replica(61, 180) + &replica(9, 3))).unwrap();
        assert_eq!(both.len(), 1);
        assert_eq!(both[0].buckets, vec![(1.0, 70), (f64::INFINITY, 70)]);
    }

    #[test]
    fn the_verdict_splits_gaps_at_the_retention() {
        let hs = parse_gap_histograms(SCRAPE).unwrap();
        let v = verdict(&hs[0], Duration::from_secs(3));
        assert_eq!((v.within, v.straddling, v.beyond), (4, 3, 0));
        assert_eq!(v.longest.as_deref(), Some("5s"));
        assert!(v.svg.contains("retention 3s"), "{}", v.svg);
        let v = verdict(&hs[0], Duration::from_secs(7 * 86_400));
        assert_eq!((v.within, v.straddling, v.beyond), (7, 0, 0));
        let v = verdict(&hs[1], Duration::from_secs(60));
        assert_eq!((v.within, v.straddling, v.beyond), (1, 1, 0));
        assert!(v.svg.contains("mail, &quot;quoted&quot; }"), "{}", v.svg);
    }

    fn bucket(le: &str, count: &str) -> String {
        format!("oncely_redelivery_gap_seconds_bucket{{kind=\"capture\",le=\"{le}\"}} {count}\n")
    }

    #[test]
    fn bounds_that_are_no_duration_are_refused() {
        for (le, says) in [
            ("NaN", "not a number"),
            ("nan", "not a number"),
            ("-Inf", "negative"),
            ("-1", "negative"),
            ("-0.001", "negative"),
            ("1e300", "too large"),
            ("1.9e19", "too large"),
        ] {
            let scrape = bucket("1", "1") + &bucket(le, "1") + &bucket("+Inf", "1");
            let err = parse_gap_histograms(&scrape).unwrap_err().to_string();
            assert!(err.contains(&format!("le={le:?}")), "{le}: {err}");
            assert!(err.contains(says), "{le}: {err}");
        }
        for (le, secs) in [
            ("+Inf", f64::INFINITY),
            ("Inf", f64::INFINITY),
            ("0", 0.0),
            ("-0", 0.0),
            ("1e6", 1e6),
        ] {
            let hs = parse_gap_histograms(&bucket(le, "3")).unwrap();
            assert_eq!(hs[0].buckets, vec![(secs, 3)], "{le}");
        }
    }

    #[test]
    fn counts_that_are_no_count_are_refused() {
        for count in ["NaN", "-1", "+Inf", "-Inf", "1e20", "x"] {
            let err = parse_gap_histograms(&bucket("1", count)).unwrap_err().to_string();
            assert!(err.contains("count"), "{count}: {err}");
        }
        assert_eq!(
            parse_gap_histograms(&bucket("1", "7e3")).unwrap()[0].buckets,
            vec![(1.0, 7000)]
        );
        // Two instances' series of one bucket add up past u64.
        let scrape = bucket("1", "1.8e19") + &bucket("1", "1.8e19");
        let err = parse_gap_histograms(&scrape).unwrap_err().to_string();
        assert!(err.contains("add up"), "{err}");
    }

    #[test]
    fn any_histogram_is_drawn_without_a_panic() {
        // Built by hand, past the parser's checks, and not cumulative.
        let odd = GapHistogram {
            kind: "odd".to_owned(),
            buckets: vec![
                (f64::NAN, 1),
                (-1.0, 2),
                (1.0, u64::MAX),
                (2.0, 0),
                (3.0, u64::MAX),
                (1e300, u64::MAX),
                (f64::INFINITY, u64::MAX),
            ],
        };
        let v = verdict(&odd, Duration::from_secs(60));
        assert_eq!(v.within, u64::MAX, "saturated");
        assert!(v.svg.contains("NaNs") && v.svg.contains("-1s"), "{}", v.svg);
        // A bound of 0 and a retention of 0: the line at the first bar.
        let zero = GapHistogram {
            kind: "zero".to_owned(),
            buckets: vec![(0.0, 1), (f64::INFINITY, 2)],
        };
        let v = verdict(&zero, Duration::ZERO);
        assert!(!v.svg.contains("NaN"), "{}", v.svg);
    }

    #[test]
    fn metrics_urls_are_plain_http() {
        let u = MetricsUrl::parse("http://127.0.0.1:9000/metrics").unwrap();
        assert_eq!(u.to_string(), "http://127.0.0.1:9000/metrics");
        assert_eq!(
            MetricsUrl::parse("http://[::1]:9000").unwrap().to_string(),
            "http://[::1]:9000/metrics"
        );
        for (url, says) in [
            ("https://x:1/metrics", "unknown --metrics-url scheme 'https'"),
            ("ftp://x/metrics", "unknown --metrics-url scheme 'ftp'"),
            ("127.0.0.1:9000", "no scheme"),
            ("http://:9000/", "invalid host or port"),
            ("http://host:port/", "invalid host or port"),
        ] {
            let err = MetricsUrl::parse(url).unwrap_err().to_string();
            assert!(err.contains(says), "{url}: {err}");
        }
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
    }
}
