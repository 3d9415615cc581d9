//! The routes and what each page shows. Every page is rendered on the
//! server from a template in `templates/` (auto-escaped as HTML); failures
//! are pages too, with the status they deserve.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use minijinja::{Environment, Value};
use oncely::admin::{Admin, Cursor, Filter, KindStats, RecordQuery};
use oncely::backend::{Ledger, Record};
use oncely::{EffectKey, Error, Tenant};
use oncely_any::AnyLedger;
use serde::{Deserialize, Serialize};

use super::text::{key_path, query_value};
use super::{Scope, ServeConfig, gaps};
use crate::commands::resolve::{self as resolve_command, Resolution};
use crate::commands::stats::DUPLICATES_NOT_STORED;
use crate::time::format_duration;
use crate::time::rfc3339;
use crate::view::class_of;

/// Records per page of `/stuck` and `/abandoned`.
pub(crate) const PAGE: u32 = 50;

/// What every request shares.
pub(crate) struct App {
    pub(crate) ledger: AnyLedger,
    pub(crate) config: ServeConfig,
    templates: Environment<'static>,
    /// Every resolve form carries it, and a POST without it is refused:
    /// another web page cannot know it, so it cannot post the form.
    token: String,
}

impl App {
    pub(crate) fn new(ledger: AnyLedger, config: ServeConfig) -> oncely::Result<App> {
        let mut templates = Environment::new();
        for (name, source) in [
            ("base.html", include_str!("templates/base.html")),
            ("error.html", include_str!("templates/error.html")),
            ("index.html", include_str!("templates/index.html")),
            ("list.html", include_str!("templates/list.html")),
            ("record.html", include_str!("templates/record.html")),
            ("gaps.html", include_str!("templates/gaps.html")),
            ("resolved.html", include_str!("templates/resolved.html")),
        ] {
            templates
                .add_template(name, source)
                .map_err(|e| Error::Config(format!("template {name}: {e}")))?;
        }
        Ok(App {
            ledger,
            config,
            templates,
            token: token(),
        })
    }

    fn render<T: Serialize>(&self, status: StatusCode, name: &str, chrome: &Chrome, page: T) -> Response {
        let ctx = minijinja::context! {
            chrome => Value::from_serialize(chrome),
            page => Value::from_serialize(&page),
        };
        match self.templates.get_template(name).and_then(|t| t.render(ctx)) {
            Ok(html) => (status, Html(html)).into_response(),
            // A template that fails to render is a bug here, not the
            // operator's: say which, in plain text.
            Err(e) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("oncely serve: template {name} failed: {e:#}"),
            )
                .into_response(),
        }
    }

    fn fail(&self, chrome: &Chrome, f: Failure) -> Response {
        #[derive(Serialize)]
        struct ErrorPage {
            code: u16,
            title: &'static str,
            message: String,
        }
        self.render(
            f.status,
            "error.html",
            chrome,
            ErrorPage {
                code: f.status.as_u16(),
                title: f.status.canonical_reason().unwrap_or("Error"),
                message: f.message,
            },
        )
    }

    /// The tenant a request may see: the one asked for with `?tenant=` if
    /// the scope allows it, else the scope's own (`None` for every tenant).
    fn tenant(&self, asked: Option<&str>) -> Result<Option<Tenant>, Failure> {
        let asked = match asked.map(str::trim).filter(|t| !t.is_empty()) {
            Some(t) => Some(Tenant::parse(t).map_err(|e| Failure::bad_request(format!("?tenant: {e}")))?),
            None => None,
        };
        match (&self.config.scope, asked) {
            (Scope::Tenant(mine), Some(other)) if *mine != other => Err(Failure::forbidden(other, mine)),
            (Scope::Tenant(mine), _) => Ok(Some(mine.clone())),
            (Scope::All, asked) => Ok(asked),
        }
    }

    fn chrome(&self, active: &'static str, tenant: Option<&Tenant>) -> Chrome {
        Chrome {
            active,
            resolves: self.config.allow_resolve,
            ledger: self.ledger.to_string(),
            scope: match &self.config.scope {
                Scope::Tenant(t) => format!("tenant {t}"),
                Scope::All => match tenant {
                    Some(t) => format!("tenant {t} (of all tenants)"),
                    None => "all tenants".to_owned(),
                },
            },
            tq: match (&self.config.scope, tenant) {
                (Scope::All, Some(t)) => format!("?tenant={}", query_value(t.as_str())),
                _ => String::new(),
            },
        }
    }
}

/// The frame of every page: the navigation and what the page is scoped to.
#[derive(Debug, Serialize)]
struct Chrome {
    active: &'static str,
    resolves: bool,
    /// What the page reads (the ledger's `Display`: backend, database,
    /// table), on every page, so that "no records" names its ledger.
    ledger: String,
    scope: String,
    /// `?tenant=…` for the navigation links when a tenant was picked among
    /// all tenants, else empty.
    tq: String,
}

/// A page that could not be shown, with the status it deserves.
#[derive(Debug)]
struct Failure {
    status: StatusCode,
    message: String,
}

impl Failure {
    fn bad_request(message: String) -> Self {
        Failure {
            status: StatusCode::BAD_REQUEST,
            message,
        }
    }

    fn forbidden(asked: Tenant, mine: &Tenant) -> Self {
        Failure {
            status: StatusCode::FORBIDDEN,
            message: format!(
                "This page shows tenant {mine} only (it was started with --tenant {mine}); \
                 tenant {asked} is not shown here. To look at every tenant, start \
                 oncely serve with --all-tenants."
            ),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::InvalidKey { .. } => StatusCode::BAD_REQUEST,
            Error::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Failure {
            status,
            message: e.to_string(),
        }
    }
}

pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/stuck", get(stuck))
        .route("/abandoned", get(abandoned))
        .route("/record/{*key}", get(record))
        .route("/lookup", get(lookup))
        .route("/gaps", get(gaps_page))
        .route("/resolve", post(resolve))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(app.clone(), loopback_host))
        .with_state(app)
}

/// The query string every page accepts; the lists also page with `after_t`
/// (nanoseconds since the epoch) and `after_key`.
#[derive(Debug, Default, Deserialize)]
struct Params {
    tenant: Option<String>,
    kind: Option<String>,
    after_t: Option<String>,
    after_key: Option<String>,
}

type Q = Result<Query<Params>, QueryRejection>;

fn params(q: Q) -> Result<Params, Failure> {
    q.map(|Query(p)| p)
        .map_err(|e| Failure::bad_request(format!("unreadable query string: {}", e.body_text())))
}

async fn not_found(State(app): State<Arc<App>>) -> Response {
    let chrome = app.chrome("", None);
    app.fail(
        &chrome,
        Failure {
            status: StatusCode::NOT_FOUND,
            message:
                "No such page. The pages are /, /stuck, /abandoned, /record/TENANT/KIND:SUBJECT and /gaps."
                    .to_owned(),
        },
    )
}

fn age(from: SystemTime, now: SystemTime) -> String {
    format_duration(now.duration_since(from).unwrap_or_default())
}

#[derive(Serialize)]
struct StatsRow {
    tenant: String,
    kind: String,
    live: u64,
    stuck: u64,
    abandoned: u64,
    completed: u64,
    released: u64,
    total: u64,
    oldest_stuck: Option<String>,
    oldest_abandoned: Option<String>,
    /// `?tenant=…&kind=…` for the links to the lists.
    link: String,
}

async fn index(State(app): State<Arc<App>>, q: Q) -> Response {
    let result = async {
        let p = params(q)?;
        let tenant = app.tenant(p.tenant.as_deref())?;
        let stats = app.ledger.stats(tenant.as_ref()).await?;
        Ok::<_, Failure>((tenant, stats))
    }
    .await;
    let (tenant, stats) = match result {
        Ok(x) => x,
        Err(f) => return app.fail(&app.chrome("overview", None), f),
    };
    #[derive(Serialize)]
    struct Index {
        rows: Vec<StatsRow>,
        totals: [u64; 6],
        read_at: Option<String>,
        duplicates: &'static str,
    }
    let mut totals = [0u64; 6];
    let rows = stats
        .iter()
        .map(|s: &KindStats| {
            for (t, n) in
                totals
                    .iter_mut()
                    .zip([s.live, s.stuck, s.abandoned, s.completed, s.released, s.total()])
            {
                *t += n;
            }
            StatsRow {
                tenant: s.tenant.to_string(),
                kind: s.kind.clone(),
                live: s.live,
                stuck: s.stuck,
                abandoned: s.abandoned,
                completed: s.completed,
                released: s.released,
                total: s.total(),
                oldest_stuck: s.oldest_stuck.map(|t| age(t, s.read_at)),
                oldest_abandoned: s.oldest_abandoned.map(|t| age(t, s.read_at)),
                link: format!(
                    "?tenant={}&kind={}",
                    query_value(s.tenant.as_str()),
                    query_value(&s.kind)
                ),
            }
        })
        .collect();
    let page = Index {
        rows,
        totals,
        read_at: stats.first().map(|s| rfc3339(s.read_at)),
        duplicates: DUPLICATES_NOT_STORED,
    };
    app.render(
        StatusCode::OK,
        "index.html",
        &app.chrome("overview", tenant.as_ref()),
        page,
    )
}

async fn stuck(State(app): State<Arc<App>>, q: Q) -> Response {
    list(&app, q, Filter::Stuck).await
}

async fn abandoned(State(app): State<Arc<App>>, q: Q) -> Response {
    list(&app, q, Filter::Abandoned).await
}

#[derive(Serialize)]
struct ListRow {
    key: String,
    /// Percent-encoded by [`key_path`]: only `A-Za-z0-9-._~/:%`, so the
    /// template writes it into the attribute as it is.
    href: String,
    kind: String,
    fence: u64,
    age: String,
    lease_ended: Option<String>,
    created_at: String,
}

async fn list(app: &App, q: Q, filter: Filter) -> Response {
    let active = if filter == Filter::Stuck {
        "stuck"
    } else {
        "abandoned"
    };
    let result = async {
        let p = params(q)?;
        let tenant = app.tenant(p.tenant.as_deref())?;
        let mut query = match &tenant {
            Some(t) => RecordQuery::tenant(t),
            None => RecordQuery::all_tenants(),
        }
        .filter(filter)
        .limit(PAGE)
        .after(cursor(&p)?);
        if let Some(kind) = p.kind.as_deref().filter(|k| !k.is_empty()) {
            query = query.kind(kind);
        }
        let records = app.ledger.records(&query).await?;
        Ok::<_, Failure>((p, tenant, records))
    }
    .await;
    let (p, tenant, records) = match result {
        Ok(x) => x,
        Err(f) => return app.fail(&app.chrome(active, None), f),
    };
    #[derive(Serialize)]
    struct List {
        what: &'static str,
        kind: Option<String>,
        rows: Vec<ListRow>,
        next: Option<String>,
        first: bool,
    }
    let next = (records.len() == PAGE as usize)
        .then(|| records.last())
        .flatten()
        .map(|last| {
            let mut q = format!(
                "?after_t={}&after_key={}",
                nanos(last.created_at),
                query_value(last.key.as_str())
            );
            if let Some(t) = p.tenant.as_deref().filter(|t| !t.is_empty()) {
                q.push_str(&format!("&tenant={}", query_value(t)));
            }
            if let Some(k) = p.kind.as_deref().filter(|k| !k.is_empty()) {
                q.push_str(&format!("&kind={}", query_value(k)));
            }
            q
        });
    let rows = records
        .iter()
        .map(|r| ListRow {
            key: r.key.to_string(),
            href: format!("/record/{}", key_path(r.key.as_str())),
            kind: r.key.kind().to_owned(),
            fence: r.fence,
            age: age(r.created_at, r.read_at),
            lease_ended: r.lease_expires_at.map(|t| age(t, r.read_at)),
            created_at: rfc3339(r.created_at),
        })
        .collect();
    let page = List {
        what: active,
        kind: p.kind.filter(|k| !k.is_empty()),
        rows,
        next,
        first: p.after_t.is_none(),
    };
    app.render(
        StatusCode::OK,
        "list.html",
        &app.chrome(active, tenant.as_ref()),
        page,
    )
}

/// The cursor's instant in nanoseconds: the memory ledger keeps
/// `created_at` finer than the SQL backends' microseconds, and a cursor
/// rounded down would list its last record again.
fn nanos(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()
}

fn cursor(p: &Params) -> Result<Option<Cursor>, Failure> {
    match (&p.after_t, &p.after_key) {
        (None, None) => Ok(None),
        (Some(t), Some(k)) => {
            let t: u64 = t.parse().map_err(|_| {
                Failure::bad_request(format!("?after_t={t:?} is not a number of nanoseconds"))
            })?;
            let key = EffectKey::parse(k).map_err(|e| Failure::bad_request(format!("?after_key: {e}")))?;
            Ok(Some(Cursor {
                created_at: UNIX_EPOCH + Duration::from_nanos(t),
                key,
            }))
        }
        _ => Err(Failure::bad_request(
            "?after_t and ?after_key go together (follow the \"next page\" link)".to_owned(),
        )),
    }
}

/// `/lookup?tenant=T&principal=P&client_key=K[&kind=http]`: an HTTP
/// request's key, as an operator knows it, to its record.
#[derive(Debug, Default, Deserialize)]
struct Lookup {
    tenant: Option<String>,
    kind: Option<String>,
    principal: Option<String>,
    client_key: Option<String>,
}

/// Sends the browser to the record `oncely-tower` stored for a principal's
/// `Idempotency-Key` (the subject [`EffectKey::client_subject`] computes).
async fn lookup(State(app): State<Arc<App>>, q: Result<Query<Lookup>, QueryRejection>) -> Response {
    let result = (|| {
        let Query(l) =
            q.map_err(|e| Failure::bad_request(format!("unreadable query string: {}", e.body_text())))?;
        let (Some(principal), Some(client_key)) = (l.principal, l.client_key) else {
            return Err(Failure::bad_request(
                "a lookup needs principal and client_key (the Idempotency-Key's value)".to_owned(),
            ));
        };
        let tenant = match l.tenant.as_deref().filter(|t| !t.is_empty()) {
            Some(t) => Tenant::parse(t)?,
            None => Tenant::global(),
        };
        let kind = l
            .kind
            .filter(|k| !k.is_empty())
            .unwrap_or_else(|| "http".to_owned());
        let key = EffectKey::new(&tenant, kind, EffectKey::client_subject(&principal, &client_key)?)?;
        Ok::<_, Failure>(key)
    })();
    match result {
        Ok(key) => (
            StatusCode::SEE_OTHER,
            [(header::LOCATION, format!("/record/{}", key_path(key.as_str())))],
        )
            .into_response(),
        Err(f) => app.fail(&app.chrome("", None), f),
    }
}

async fn record(State(app): State<Arc<App>>, Path(raw): Path<String>) -> Response {
    let result = async {
        let key = EffectKey::parse(&raw).map_err(|e| {
            Failure::bad_request(format!(
                "{raw:?} is not an effect key: {e}. A key reads TENANT/KIND:SUBJECT, \
                 e.g. /record/acme/capture:order-123."
            ))
        })?;
        let tenant = app.tenant(Some(key.tenant().as_str()))?;
        let record = app.ledger.get(&key).await?;
        Ok::<_, Failure>((key, tenant, record))
    }
    .await;
    let (key, tenant, record) = match result {
        Ok(x) => x,
        Err(f) => return app.fail(&app.chrome("", None), f),
    };
    let chrome = app.chrome("", tenant.as_ref());
    let Some(r) = record else {
        return app.fail(
            &chrome,
            Failure {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "No record for {key} in {}: it was never claimed there, or it was pruned after \
                     its retention.",
                    chrome.ledger
                ),
            },
        );
    };
    let mut page = RecordPage::of(&r);
    if app.config.allow_resolve && matches!(page.state, "stuck" | "abandoned") {
        page.token = Some(app.token.clone());
    }
    app.render(StatusCode::OK, "record.html", &chrome, page)
}

#[derive(Serialize)]
struct RecordPage {
    key: String,
    tenant: String,
    kind: String,
    subject: String,
    state: &'static str,
    /// What the state means for an operator, one line.
    meaning: &'static str,
    fence: u64,
    at_most_once: bool,
    created_at: String,
    age: String,
    updated_at: String,
    lease_expires_at: Option<String>,
    lease: Option<String>,
    retain_until: String,
    /// `812 bytes`, or `encrypted (key k1, 812 bytes)`: never the bytes.
    outcome: Option<String>,
    fingerprint: Option<String>,
    provider_key: String,
    read_at: String,
    /// The resolve forms' token, when the page offers them (stuck and
    /// abandoned records, with `--allow-resolve`).
    token: Option<String>,
}

impl RecordPage {
    fn of(r: &Record) -> Self {
        let now = r.read_at;
        let state = class_of(r);
        let meaning = match state {
            "completed" => "Done: duplicates are answered with the stored outcome.",
            "erased" => {
                "Done, and its outcome was erased on a data-protection request: duplicates are \
                 refused (Error::Erased), never run again."
            }
            "released" => "Given back: the next claim runs the effect again.",
            "abandoned" => {
                "An at-most-once step whose lease ended before it completed: it may or may not have \
                 happened. It is never re-run automatically; check and resolve it."
            }
            "live" => "In progress: a worker holds a live lease.",
            _ => {
                "In progress, but its lease ended: the worker died or stalled. The next claim takes it \
                 over (with fence + 1)."
            }
        };
        RecordPage {
            key: r.key.to_string(),
            tenant: r.key.tenant().to_string(),
            kind: r.key.kind().to_owned(),
            subject: r.key.subject().to_owned(),
            state,
            meaning,
            fence: r.fence,
            at_most_once: r.at_most_once,
            created_at: rfc3339(r.created_at),
            age: age(r.created_at, now),
            updated_at: rfc3339(r.updated_at),
            lease_expires_at: r.lease_expires_at.map(rfc3339),
            lease: r.lease_expires_at.map(|t| match t.duration_since(now) {
                Ok(left) => format!("ends in {}", format_duration(left)),
                Err(e) => format!("ended {} ago", format_duration(e.duration())),
            }),
            retain_until: rfc3339(r.retain_until),
            outcome: r.outcome.as_ref().map(crate::view::outcome_summary),
            fingerprint: r.fingerprint.map(|f| f.to_hex()),
            provider_key: r.key.provider_key(),
            read_at: rfc3339(now),
            token: None,
        }
    }
}

async fn gaps_page(State(app): State<Arc<App>>, q: Q) -> Response {
    let tenant = match params(q).and_then(|p| app.tenant(p.tenant.as_deref())) {
        Ok(t) => t,
        Err(f) => return app.fail(&app.chrome("gaps", None), f),
    };
    let chrome = app.chrome("gaps", tenant.as_ref());
    #[derive(Serialize)]
    struct Gaps {
        metrics_url: Option<String>,
        retention: String,
        error: Option<String>,
        kinds: Vec<gaps::Verdict>,
        metric: &'static str,
    }
    let mut page = Gaps {
        metrics_url: (!app.config.metrics_urls.is_empty()).then(|| {
            app.config
                .metrics_urls
                .iter()
                .map(|u| u.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }),
        retention: format_duration(app.config.retention),
        error: None,
        kinds: Vec::new(),
        metric: oncely::telemetry::REDELIVERY_GAP_SECONDS,
    };
    let mut status = StatusCode::OK;
    if !app.config.metrics_urls.is_empty() {
        // Every replica's scrape, one after the other: the parser sums the
        // series of one bucket.
        let mut scrapes = String::new();
        let mut scraped = Ok(());
        for url in &app.config.metrics_urls {
            match url.scrape().await {
                Ok(text) => {
                    scrapes.push_str(&text);
                    scrapes.push('\n');
                }
                Err(e) => {
                    scraped = Err(e);
                    break;
                }
            }
        }
        match scraped.and_then(|()| gaps::parse_gap_histograms(&scrapes)) {
            Ok(hs) => {
                page.kinds = hs
                    .iter()
                    .map(|h| gaps::verdict(h, app.config.retention))
                    .collect()
            }
            Err(e) => {
                status = StatusCode::BAD_GATEWAY;
                page.error = Some(e.to_string());
            }
        }
    }
    app.render(status, "gaps.html", &chrome, page)
}

/// 128 unpredictable bits, hex: std's `RandomState` draws its SipHash keys
/// from the operating system's randomness, so hashing with two of them is
/// a token no other page can guess, without a crate for it.
fn token() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let part = || {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x6f6e_6365_6c79);
        h.finish()
    };
    format!("{:016x}{:016x}", part(), part())
}

/// Refuses requests whose `Host` is not a loopback name (unless
/// `--allow-remote`): a web site whose name an attacker resolves to
/// 127.0.0.1 (DNS rebinding) must not read the page through a visitor's
/// browser.
async fn loopback_host(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if !app.config.allow_remote {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if !is_loopback_host(host) {
            return app.fail(
                &app.chrome("", None),
                Failure {
                    status: StatusCode::FORBIDDEN,
                    message: format!(
                        "Host {host:?} is not a loopback name. This page answers requests for \
                         localhost, 127.0.0.1 or [::1] only: it has no authentication. Open it \
                         as http://127.0.0.1:PORT/, or start oncely serve with --allow-remote \
                         behind a proxy that authenticates."
                    ),
                },
            );
        }
    }
    next.run(req).await
}

fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The resolve forms' fields.
#[derive(Debug, Deserialize)]
struct ResolveForm {
    key: String,
    /// The fence the page showed: the write is refused if it moved.
    fence: String,
    token: String,
    /// `release` or `complete`.
    action: String,
    /// The JSON value to complete with.
    value: Option<String>,
}

/// `POST /resolve`: [`resolve_command::resolve`], the path `oncely resolve`
/// takes, fenced at the fence the page showed.
async fn resolve(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    form: Result<Form<ResolveForm>, FormRejection>,
) -> Response {
    let chrome = app.chrome("", None);
    let result = async {
        if !app.config.allow_resolve {
            return Err(Failure {
                status: StatusCode::FORBIDDEN,
                message: "This page is read-only: start oncely serve with --allow-resolve to \
                          resolve records here (or use oncely resolve)."
                    .to_owned(),
            });
        }
        same_origin(&headers)?;
        let Form(f) =
            form.map_err(|e| Failure::bad_request(format!("unreadable form: {}", e.body_text())))?;
        if f.token != app.token {
            return Err(Failure {
                status: StatusCode::FORBIDDEN,
                message: "The form's token is not this page's (it was started again since, or \
                          the form came from elsewhere). Nothing was written; reload the record."
                    .to_owned(),
            });
        }
        let key = EffectKey::parse(&f.key).map_err(|e| Failure::bad_request(format!("{:?}: {e}", f.key)))?;
        let tenant = app.tenant(Some(key.tenant().as_str()))?;
        let fence: u64 = f
            .fence
            .parse()
            .map_err(|_| Failure::bad_request(format!("fence {:?} is not a number", f.fence)))?;
        let resolution = match (f.action.as_str(), f.value.as_deref()) {
            ("release", _) => Resolution::Released,
            ("complete", v) => Resolution::Completed(
                serde_json::from_str(v.unwrap_or("null"))
                    .map_err(|e| Failure::bad_request(format!("the value is not JSON: {e}")))?,
            ),
            (other, _) => {
                return Err(Failure::bad_request(format!(
                    "unknown action {other:?} (release or complete)"
                )));
            }
        };
        let read = resolve_command::resolve(&app.config.database_url, key.as_str(), &resolution, Some(fence))
            .await
            .map_err(|e| refused(&key, fence, e))?;
        let report = read.value.ok_or_else(|| Failure {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "No record for {key} any more in {}. Nothing was written.",
                read.ledger
            ),
        })?;
        Ok((tenant, report))
    }
    .await;
    match result {
        Ok((tenant, report)) => {
            #[derive(Serialize)]
            struct Resolved {
                report: crate::audit::ActionReport,
                href: String,
            }
            let href = format!("/record/{}", key_path(&report.key));
            app.render(
                StatusCode::OK,
                "resolved.html",
                &app.chrome("", tenant.as_ref()),
                Resolved { report, href },
            )
        }
        Err(f) => app.fail(&chrome, f),
    }
}

/// A browser says where a POST comes from (`Origin`); one from another
/// origin than this page's is refused.
fn same_origin(headers: &HeaderMap) -> Result<(), Failure> {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return Ok(());
    };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, h)| h.trim_end_matches('/'));
    if origin_host.is_some() && origin_host == host {
        Ok(())
    } else {
        Err(Failure {
            status: StatusCode::FORBIDDEN,
            message: format!("The form was posted from {origin:?}, not from this page. Nothing was written."),
        })
    }
}

/// Why a resolve wrote nothing, as an operator reads it.
fn refused(key: &EffectKey, fence: u64, e: Error) -> Failure {
    let (status, message) = match &e {
        Error::LeaseLost { .. } => (
            StatusCode::CONFLICT,
            format!(
                "{key} changed since the page showed it (its fence is no longer {fence}). \
                 Nothing was written; reload the record."
            ),
        ),
        Error::InProgress { .. } => (
            StatusCode::CONFLICT,
            format!("A worker holds a live lease on {key} now. Nothing was written."),
        ),
        Error::NotFound { .. } => (
            StatusCode::NOT_FOUND,
            format!("No record for {key} any more. Nothing was written."),
        ),
        Error::Misuse(m) => (StatusCode::CONFLICT, m.clone()),
        _ => return Failure::from(e),
    };
    Failure { status, message }
}
