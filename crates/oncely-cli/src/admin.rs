//! The operator commands built on [`oncely::admin`] and on plain
//! [`Ledger`] reads: `inspect`, `history`, `stats`, `stuck`, `resolve` and
//! `forget` (`get`, `abandoned`, `prune` and `migrate` are in [`ops`](crate::ops)).
//! Each validates its input before connecting and returns data; the binary
//! prints it.
//!
//! Reads open the ledger read-only ([`Access::ReadOnly`]): they create,
//! migrate and write nothing. `resolve` and `forget` open it as it exists
//! ([`Access::Existing`]) and are **recorded**: after the change, each
//! writes an audit record into the ledger itself, a completed effect of the
//! reserved kind [`AUDIT_KIND`] in the same tenant, whose outcome says what
//! was done (`{"ok": {"action", "key", "fence", "new_fence", "at", "by"}}`),
//! and emits a `tracing` event (target `oncely::audit`) for the embedding
//! application's subscriber. `history` lists them next to the records they
//! touched. Audit records are kept [`AUDIT_RETENTION`], then pruned like any
//! other.
//!
//! Listing, stats, forget and the prune dry run need [`Admin`], which the
//! SQL backends (and `memory:`) offer; on Redis and NATS they fail with a
//! usage error naming the backend. `inspect`, `resolve` and tenant-scoped
//! `abandoned` work on every backend.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncely::admin::{Admin, Cursor, DUPLICATES_NOT_STORED, Filter, KindStats, MAX_PAGE, RecordQuery};
use oncely::backend::{Claim, Ledger, Outcome, Record, RecordState};
use oncely::backend::{lease_live, to_micros};
use oncely::open::Access;
use oncely::{ClaimOptions, EffectKey, Error, Result, Tenant};
use serde::Serialize;

use crate::any::AnyLedger;
use crate::ops::{Read, RecordView, rfc3339};

/// The kind of the audit records that `resolve` and `forget` write, in the
/// tenant of the key they changed.
pub const AUDIT_KIND: &str = "oncely-audit";

/// How long an audit record is kept (400 days).
pub const AUDIT_RETENTION: Duration = Duration::from_secs(400 * 86_400);

/// Which tenants a command reads: one, or all (asked for explicitly with
/// `--all-tenants`). Neither is a usage error ([`Error::Misuse`]).
pub fn scope(tenant: Option<&str>, all_tenants: bool) -> Result<Option<Tenant>> {
    match (tenant, all_tenants) {
        (Some(t), false) => Ok(Some(Tenant::parse(t)?)),
        (None, true) => Ok(None),
        (Some(_), true) => Err(Error::Misuse(
            "give either --tenant or --all-tenants, not both".into(),
        )),
        (None, false) => Err(Error::Misuse(
            "this command reads one tenant (--tenant T) or, explicitly, every tenant (--all-tenants)".into(),
        )),
    }
}

/// What an operator sees a record as, on the backend's clock when it was
/// read: `live`, `stuck` (lease ended, not at-most-once: the next claim takes
/// it over), `abandoned` (at-most-once, lease ended: reconcile it),
/// `completed` or `released`.
pub fn class_of(r: &Record) -> &'static str {
    match r.state {
        RecordState::Completed => "completed",
        RecordState::Released => "released",
        RecordState::Abandoned => "abandoned",
        _ if lease_live(r.lease_expires_at, r.read_at) => "live",
        _ if r.at_most_once => "abandoned",
        _ => "stuck",
    }
}

/// What the stored fence says about how often the key was claimed. Nothing
/// counts claims; the fence is derived: a first claim's fence is its clock
/// in microseconds, equal to `created_at`, and every later grant (a
/// takeover of an ended lease, a claim after a release or a forget) writes
/// `max(fence + 1, clock)`, above it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Claims {
    /// `Some(false)`: granted once (fence = `created_at` in µs);
    /// `Some(true)`: granted at least twice; `None`: the fence is not derived
    /// from this clock (a record from a schema before clock fences).
    pub claimed_again: Option<bool>,
    /// `1`, `2 or more` (the exact count is not stored) or `unknown`.
    pub grants: &'static str,
    /// When the latest grant was written, read from the fence (µs), when
    /// it was granted again.
    pub latest_grant_at: Option<String>,
}

impl Claims {
    /// Derives it from the record's fence and `created_at`.
    pub fn of(r: &Record) -> Self {
        let created = to_micros(r.created_at).ok().and_then(|c| u64::try_from(c).ok());
        match created {
            Some(c) if r.fence == c => Claims {
                claimed_again: Some(false),
                grants: "1",
                latest_grant_at: None,
            },
            Some(c) if r.fence > c => Claims {
                claimed_again: Some(true),
                grants: "2 or more",
                latest_grant_at: i64::try_from(r.fence)
                    .ok()
                    .map(|us| rfc3339(oncely::backend::from_micros(us))),
            },
            _ => Claims {
                claimed_again: None,
                grants: "unknown",
                latest_grant_at: None,
            },
        }
    }
}

/// One record as `inspect` and `history` show it: the stored record, what
/// an operator sees it as, and what is derived from it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inspection {
    /// The record as stored.
    #[serde(flatten)]
    pub record: RecordView,
    /// `live`, `stuck`, `abandoned`, `completed` or `released` ([`class_of`]).
    pub class: &'static str,
    /// Seconds of lease left (negative: ended that long ago), in-progress
    /// records only.
    pub lease_left_seconds: Option<f64>,
    /// Size of the stored outcome in bytes.
    pub outcome_bytes: Option<usize>,
    /// Whether the first claim gave a request fingerprint.
    pub fingerprint_present: bool,
    /// What the fence says about how often the key was claimed (derived).
    pub claims: Claims,
    /// The backend's clock when the record was read.
    pub read_at: String,
}

impl From<&Record> for Inspection {
    fn from(r: &Record) -> Self {
        let lease_left_seconds = r.lease_expires_at.map(|e| match e.duration_since(r.read_at) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        });
        Inspection {
            record: RecordView::from(r),
            class: class_of(r),
            lease_left_seconds,
            outcome_bytes: r.outcome.as_ref().map(Outcome::len),
            fingerprint_present: r.fingerprint.is_some(),
            claims: Claims::of(r),
            read_at: rfc3339(r.read_at),
        }
    }
}

/// Reads one record for `inspect` (read-only, every backend). `None`: no
/// record (in the ledger [`Read::ledger`] names).
pub async fn inspect(database_url: &str, key: &str) -> Result<Read<Option<Inspection>>> {
    let key = EffectKey::parse(key)?;
    let ledger = AnyLedger::open(database_url, Access::ReadOnly).await?;
    let found = ledger.get(&key).await;
    ledger.close().await;
    Ok(Read {
        ledger: ledger.to_string(),
        value: found?.as_ref().map(Inspection::from),
    })
}

/// An audit record as `history` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditView {
    /// The audit record's key.
    pub audit_key: String,
    /// What the audit outcome says (`action`, `key`, `fence`, …).
    pub entry: serde_json::Value,
}

/// What `history` found for a subject: every record, the operator actions
/// recorded on them, and a one-line verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct History {
    /// The records, oldest first.
    pub records: Vec<Inspection>,
    /// The `resolve` and `forget` actions recorded on these records.
    pub audits: Vec<AuditView>,
    /// Whether the ledger's records show any effect granted more than once.
    pub claimed_more_than_once: bool,
    /// "Did this run twice?", answered in one line from what is stored.
    pub verdict: String,
}

/// What `history` reads: a tenant, and optionally a kind, a subject and
/// an earliest `created_at`.
#[derive(Debug, Clone, Default)]
pub struct HistoryQuery {
    /// The tenant (required).
    pub tenant: String,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only this subject.
    pub subject: Option<String>,
    /// Only records created at or after this RFC 3339 instant.
    pub since: Option<String>,
}

/// The records of a subject (or a tenant's kind), every page of them, with
/// the audit records of the ones listed and a verdict. Read-only.
pub async fn history(database_url: &str, q: &HistoryQuery) -> Result<Read<History>> {
    let tenant = Tenant::parse(&q.tenant)?;
    if let Some(k) = &q.kind {
        // Validates the kind (and the subject) as a key would.
        EffectKey::new(&tenant, k, q.subject.as_deref().unwrap_or("x"))?;
    }
    let mut query = RecordQuery::tenant(&tenant);
    if let Some(k) = &q.kind {
        query = query.kind(k.clone());
    }
    if let Some(s) = &q.subject {
        query = query.subject(s.clone());
    }
    if let Some(since) = &q.since {
        query = query.since(parse_rfc3339(since)?);
    }
    let ledger = open_admin(database_url, Access::ReadOnly).await?;
    let result = async {
        let records = all_pages(&ledger, query).await?;
        let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
        let audits = all_pages(&ledger, RecordQuery::tenant(&tenant).kind(AUDIT_KIND))
            .await?
            .into_iter()
            .filter_map(|r| {
                let entry = audit_entry(&r)?;
                let touched = entry.get("key").and_then(|k| k.as_str())?;
                keys.contains(&touched).then(|| AuditView {
                    audit_key: r.key.to_string(),
                    entry,
                })
            })
            .collect::<Vec<_>>();
        Ok::<_, Error>((records.iter().map(Inspection::from).collect::<Vec<_>>(), audits))
    }
    .await;
    ledger.close().await;
    let (records, audits) = result?;
    let (claimed_more_than_once, verdict) = verdict(&records, &audits);
    Ok(Read {
        ledger: ledger.to_string(),
        value: History {
            records,
            audits,
            claimed_more_than_once,
            verdict,
        },
    })
}

fn audit_entry(r: &Record) -> Option<serde_json::Value> {
    match r.stored::<serde_json::Value>().ok()?? {
        oncely::backend::StoredOutcome::Value(v) => Some(v),
        _ => None,
    }
}

/// The one-line answer to "did this run twice?" from what is stored.
fn verdict(records: &[Inspection], audits: &[AuditView]) -> (bool, String) {
    if records.is_empty() {
        return (
            false,
            "no record: never claimed through oncely, or pruned after its retention".to_owned(),
        );
    }
    let again: Vec<&str> = records
        .iter()
        .filter(|r| r.claims.claimed_again == Some(true))
        .map(|r| r.record.key.as_str())
        .collect();
    let unknown = records
        .iter()
        .filter(|r| r.claims.claimed_again.is_none())
        .count();
    let abandoned = records.iter().filter(|r| r.class == "abandoned").count();
    let n = records.len();
    let mut line = if again.is_empty() {
        if n == 1 {
            "no: the effect was granted once (fence = first claim's clock)".to_owned()
        } else {
            format!("no: each of the {n} effects was granted once (fence = first claim's clock)")
        }
    } else {
        format!(
            "possibly: {} of {n} effect{} granted more than once (a takeover after a lease ended, \
             a claim after a release or a forget), so the work may have started twice: {}",
            again.len(),
            plural(n),
            again.join(", ")
        )
    };
    if unknown > 0 {
        line.push_str(&format!(
            "; {unknown} with a fence not derived from the clock (cannot tell)"
        ));
    }
    if !audits.is_empty() {
        line.push_str(&format!(
            "; {} operator action{} recorded",
            audits.len(),
            plural(audits.len())
        ));
    }
    if abandoned > 0 {
        line.push_str(&format!(
            "; {abandoned} abandoned at-most-once step{} (outcome unknown: reconcile)",
            plural(abandoned)
        ));
    }
    line.push_str("; duplicates answered from a stored outcome are reads, not stored (see the oncely_duplicates_suppressed_total metric)");
    (!again.is_empty(), line)
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

async fn all_pages(ledger: &AnyLedger, query: RecordQuery) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    let mut after: Option<Cursor> = None;
    loop {
        let page = ledger
            .records(&query.clone().after(after).limit(MAX_PAGE))
            .await?;
        let full = page.len() == MAX_PAGE as usize;
        after = page.last().map(Cursor::after);
        out.extend(page);
        if !full {
            return Ok(out);
        }
    }
}

/// Opens a ledger and refuses, before any read, a backend without [`Admin`].
pub(crate) async fn open_admin(database_url: &str, access: Access) -> Result<AnyLedger> {
    let scheme = crate::any::Scheme::of_url(database_url)?;
    if !scheme.has_admin() {
        return Err(Error::Config(format!(
            "this command is not available on the {} backend: it keeps no index to list or \
             count records by tenant and kind (only SQLite, PostgreSQL and MySQL ledgers offer it)",
            scheme.name()
        )));
    }
    AnyLedger::open(database_url, access).await
}

/// The stats of `stats`, as printed: counts per tenant and kind, and the
/// note that duplicates are not among them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatsReport {
    /// One entry per tenant and kind.
    pub kinds: Vec<KindStatsView>,
    /// [`DUPLICATES_NOT_STORED`].
    pub note: &'static str,
}

/// One tenant and kind's counts, timestamps in RFC 3339.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindStatsView {
    /// The tenant.
    pub tenant: String,
    /// The kind.
    pub kind: String,
    /// In progress, lease live.
    pub live: u64,
    /// In progress, lease ended, not at-most-once.
    pub stuck: u64,
    /// At-most-once, lease ended.
    pub abandoned: u64,
    /// Completed.
    pub completed: u64,
    /// Released (forgotten ones included).
    pub released: u64,
    /// Every record counted.
    pub total: u64,
    /// Oldest `created_at` of the live ones.
    pub oldest_live: Option<String>,
    /// Oldest `created_at` of the stuck ones.
    pub oldest_stuck: Option<String>,
    /// Oldest `created_at` of the abandoned ones.
    pub oldest_abandoned: Option<String>,
    /// The backend's clock when counted.
    pub read_at: String,
}

impl From<&KindStats> for KindStatsView {
    fn from(s: &KindStats) -> Self {
        KindStatsView {
            tenant: s.tenant.to_string(),
            kind: s.kind.clone(),
            live: s.live,
            stuck: s.stuck,
            abandoned: s.abandoned,
            completed: s.completed,
            released: s.released,
            total: s.total(),
            oldest_live: s.oldest_live.map(rfc3339),
            oldest_stuck: s.oldest_stuck.map(rfc3339),
            oldest_abandoned: s.oldest_abandoned.map(rfc3339),
            read_at: rfc3339(s.read_at),
        }
    }
}

/// Counts records per tenant and kind (`None`: every tenant). Read-only.
pub async fn stats(database_url: &str, tenant: Option<&Tenant>) -> Result<Read<StatsReport>> {
    let ledger = open_admin(database_url, Access::ReadOnly).await?;
    let result = ledger.stats(tenant).await;
    ledger.close().await;
    Ok(Read {
        ledger: ledger.to_string(),
        value: StatsReport {
            kinds: result?.iter().map(KindStatsView::from).collect(),
            note: DUPLICATES_NOT_STORED,
        },
    })
}

/// What `stuck` and `abandoned` list: the records of one state class.
#[derive(Debug, Clone)]
pub struct Listing {
    /// One tenant, or every tenant (`None`).
    pub tenant: Option<Tenant>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only records first claimed at or after this RFC 3339 time or date.
    pub since: Option<String>,
    /// At most this many (bounded by [`MAX_PAGE`]).
    pub limit: u32,
}

/// Lists records of a class, oldest first (read-only), as `inspect` shows
/// them.
pub async fn list(database_url: &str, filter: Filter, l: &Listing) -> Result<Read<Vec<Inspection>>> {
    Ok(list_records(database_url, filter, l)
        .await?
        .map(|records| records.iter().map(Inspection::from).collect()))
}

/// Lists records of a class, oldest first (read-only).
pub async fn list_records(database_url: &str, filter: Filter, l: &Listing) -> Result<Read<Vec<Record>>> {
    if let Some(k) = &l.kind {
        // Validates the kind as a key would, before connecting.
        EffectKey::new(&Tenant::global(), k, "x")?;
    }
    let mut query = match &l.tenant {
        Some(t) => RecordQuery::tenant(t),
        None => RecordQuery::all_tenants(),
    }
    .filter(filter)
    .limit(l.limit.clamp(1, MAX_PAGE));
    if let Some(k) = &l.kind {
        query = query.kind(k.clone());
    }
    if let Some(since) = &l.since {
        query = query.since(parse_rfc3339(since)?);
    }
    let ledger = open_admin(database_url, Access::ReadOnly).await?;
    let result = ledger.records(&query).await;
    ledger.close().await;
    Ok(Read {
        ledger: ledger.to_string(),
        value: result?,
    })
}

/// What `resolve` writes.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// Complete the effect with this value, stored as the runners store a
    /// handler's value (`{"ok": value}`), so duplicates replay it.
    Completed(serde_json::Value),
    /// Release the key: the next delivery runs the effect again.
    Released,
}

/// What must happen after a doubtful record (`was`: `stuck` or
/// `abandoned`) was released, for its step to be performed: a release only
/// lets the next delivery run it, and says nothing of whether one is left.
pub fn after_release(was: &str) -> Option<&'static str> {
    match was {
        "abandoned" => Some(
            "the step is performed by the next delivery of its message. An oncely consumer holds \
             that delivery while the step is abandoned (redelivered every abandoned_delay) and \
             dead-letters it with the reason `abandoned` and this key after its last allowed \
             delivery: if it is in the dead-letter destination, replay it. If no delivery of it \
             is left anywhere, the step is never performed.",
        ),
        "stuck" => Some(
            "the step runs again on the next delivery of its message, with the same provider key. \
             If no delivery of it is left (dead-lettered, or its consumer gone), replay the message.",
        ),
        _ => None,
    }
}

/// What `resolve` or `forget` did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActionReport {
    /// `resolve-completed`, `resolve-released` or `forget`.
    pub action: &'static str,
    /// The key changed.
    pub key: String,
    /// What it was: `stuck`, `abandoned` or `completed`.
    pub was: &'static str,
    /// The fence it had.
    pub fence: u64,
    /// The fence of the write (a stuck lease is taken over first, at a
    /// higher fence).
    pub new_fence: u64,
    /// The state it is in now.
    pub now: &'static str,
    /// The audit record written.
    pub audit_key: String,
    /// The backend's clock at the change.
    pub at: String,
    /// What must happen next for the step to be performed (a released
    /// stuck lease or abandoned step: [`after_release`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<&'static str>,
}

/// Resolves a stuck lease or an abandoned at-most-once step.
///
/// A stuck lease (in progress, ended, not at-most-once) is taken over
/// atomically by a claim (which grants `fence + 1` only if it is still
/// ended: a holder that came back or another resolver wins instead), then
/// completed or released with that lease. An abandoned step is completed or
/// released with [`Record::reconciliation_lease`], a write fenced at the
/// fence read. A live lease, a completed or released record, or a fence
/// other than `expected_fence` is refused, changing nothing. Recorded (see
/// the module docs). `None`: the key has no record in the ledger
/// [`Read::ledger`] names; nothing was written.
pub async fn resolve(
    database_url: &str,
    key: &str,
    resolution: &Resolution,
    expected_fence: Option<u64>,
) -> Result<Read<Option<ActionReport>>> {
    let key = EffectKey::parse(key)?;
    let outcome = match resolution {
        Resolution::Completed(v) => Some(Outcome::value(v)?),
        Resolution::Released => None,
    };
    let ledger = AnyLedger::open(database_url, Access::Existing).await?;
    let result = resolve_on(&ledger, &key, outcome.as_ref(), expected_fence).await;
    ledger.close().await;
    Ok(Read {
        ledger: ledger.to_string(),
        value: result?,
    })
}

async fn resolve_on(
    ledger: &AnyLedger,
    key: &EffectKey,
    outcome: Option<&Outcome>,
    expected_fence: Option<u64>,
) -> Result<Option<ActionReport>> {
    let Some(record) = ledger.get(key).await? else {
        return Ok(None);
    };
    if let Some(f) = expected_fence
        && f != record.fence
    {
        return Err(Error::LeaseLost {
            key: key.to_string(),
            fence: f,
        });
    }
    let was = class_of(&record);
    let lease = match was {
        "live" => {
            return Err(Error::InProgress {
                key: key.to_string(),
                fence: record.fence,
            });
        }
        "stuck" => {
            // The takeover is the claim's own atomic decision: it grants only
            // if the lease is still ended and the step not at-most-once.
            let opts = ClaimOptions::default()
                .lease(Duration::from_secs(60))
                .retention(retention_of(&record));
            match ledger.claim(key, &opts).await? {
                Claim::Acquired(lease) => lease,
                Claim::InProgress { fence, .. } => {
                    return Err(Error::InProgress {
                        key: key.to_string(),
                        fence,
                    });
                }
                other => {
                    return Err(Error::Misuse(format!(
                        "{key} changed while resolving it: a claim now answers {}; nothing was written",
                        other.label()
                    )));
                }
            }
        }
        "abandoned" => record.reconciliation_lease(),
        other => {
            return Err(Error::Misuse(format!(
                "{key} is {other}: resolve is for stuck leases and abandoned steps \
                 (to let a completed effect run again, use forget)"
            )));
        }
    };
    match outcome {
        Some(o) => ledger.complete(&lease, o).await?,
        None => ledger.release(&lease).await?,
    }
    let action = if outcome.is_some() {
        "resolve-completed"
    } else {
        "resolve-released"
    };
    let now = ledger.get(key).await?;
    let at = now.as_ref().map_or(lease.acquired_at(), |r| r.updated_at);
    let audit_key = audit(ledger, key, action, record.fence, lease.fence(), at).await?;
    Ok(Some(ActionReport {
        action,
        key: key.to_string(),
        was,
        fence: record.fence,
        new_fence: lease.fence(),
        now: if outcome.is_some() {
            "completed"
        } else {
            "released"
        },
        audit_key: audit_key.to_string(),
        at: rfc3339(at),
        next: outcome.is_none().then(|| after_release(was)).flatten(),
    }))
}

/// The retention a record was claimed with, as far as it is stored
/// (`retain_until - updated_at`, set together), bounded to what a claim
/// accepts.
fn retention_of(r: &Record) -> Duration {
    r.retain_until
        .duration_since(r.updated_at)
        .unwrap_or_default()
        .clamp(Duration::from_secs(60), Duration::from_secs(10 * 365 * 86_400))
}

/// Lets a completed effect run again on purpose ([`Admin::forget`]), at the
/// fence read (or `expected_fence`, refused if the record moved). Recorded.
/// `None`: the key has no record in the ledger [`Read::ledger`] names;
/// nothing was written.
pub async fn forget(
    database_url: &str,
    key: &str,
    expected_fence: Option<u64>,
) -> Result<Read<Option<ActionReport>>> {
    let key = EffectKey::parse(key)?;
    let ledger = open_admin(database_url, Access::Existing).await?;
    let result = async {
        let Some(record) = ledger.get(&key).await? else {
            return Ok::<_, Error>(None);
        };
        let fence = expected_fence.unwrap_or(record.fence);
        ledger.forget(&key, fence).await?;
        let at = ledger.get(&key).await?.map_or(record.read_at, |r| r.updated_at);
        let audit_key = audit(&ledger, &key, "forget", fence, fence, at).await?;
        Ok(Some(ActionReport {
            action: "forget",
            key: key.to_string(),
            was: class_of(&record),
            fence,
            new_fence: fence,
            now: "released",
            audit_key: audit_key.to_string(),
            at: rfc3339(at),
            next: None,
        }))
    }
    .await;
    ledger.close().await;
    Ok(Read {
        ledger: ledger.to_string(),
        value: result?,
    })
}

/// Writes the audit record of an operator action and emits its tracing
/// event. The audit key is derived from the action, the fence and the key's
/// provider key, so the same action on the same fence is recorded once.
async fn audit(
    ledger: &AnyLedger,
    key: &EffectKey,
    action: &'static str,
    fence: u64,
    new_fence: u64,
    at: SystemTime,
) -> Result<EffectKey> {
    let audit_key = EffectKey::new(
        key.tenant(),
        AUDIT_KIND,
        format!("{action}:{fence}:{}", &key.provider_key()[..32]),
    )?;
    let entry = serde_json::json!({
        "action": action,
        "key": key.as_str(),
        "fence": fence,
        "new_fence": new_fence,
        "at": rfc3339(at),
        "by": std::env::var("USER").ok(),
    });
    let written = async {
        let opts = ClaimOptions::default()
            .lease(Duration::from_secs(60))
            .retention(AUDIT_RETENTION);
        match ledger.claim(&audit_key, &opts).await? {
            Claim::Acquired(lease) => ledger.complete(&lease, &Outcome::value(&entry)?).await,
            // Already recorded (the same action at the same fence).
            Claim::Completed(_) => Ok(()),
            other => Err(Error::Misuse(format!(
                "audit record {audit_key} answers {}",
                other.label()
            ))),
        }
    }
    .await;
    tracing::info!(
        target: "oncely::audit",
        action,
        effect_key = %key,
        fence,
        new_fence,
        audit_key = %audit_key,
        recorded = written.is_ok(),
        "operator action"
    );
    written.map_err(|e| match e {
        Error::Unavailable { backend, message } => Error::Unavailable {
            backend,
            message: format!("{action} of {key} was done, but its audit record was not written: {message}"),
        },
        other => other,
    })?;
    Ok(audit_key)
}

/// Parses an RFC 3339 instant (`2026-11-30T08:00:00Z`,
/// `2026-11-30T09:00:00.5+01:00`) or a date (`2026-11-30`, midnight UTC).
/// Anything else is [`Error::InvalidInput`].
pub fn parse_rfc3339(s: &str) -> Result<SystemTime> {
    let bad = || Error::InvalidInput(format!("not an RFC 3339 time (2026-11-30T08:00:00Z): {s:?}"));
    let s = s.trim();
    let num = |t: &str| -> Result<i64> {
        if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        t.parse().map_err(|_| bad())
    };
    let (date, rest) = match s.find(['T', 't', ' ']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let mut d = date.split('-');
    let (y, m, day) = match (d.next(), d.next(), d.next(), d.next()) {
        (Some(y), Some(m), Some(dd), None) if y.len() == 4 && m.len() == 2 && dd.len() == 2 => {
            (num(y)?, num(m)?, num(dd)?)
        }
        _ => return Err(bad()),
    };
    if !(1..=12).contains(&m) || !(1..=days_in_month(y, m)).contains(&day) {
        return Err(bad());
    }
    let mut secs = days_from_civil(y, m, day) * 86_400;
    let mut micros = 0i64;
    if let Some(rest) = rest {
        let (time, offset) = if let Some(t) = rest.strip_suffix(['Z', 'z']) {
            (t, 0)
        } else if let Some(i) = rest.rfind(['+', '-']) {
            let (t, o) = rest.split_at(i);
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let (oh, om) = o[1..].split_once(':').ok_or_else(bad)?;
            let (oh, om) = (num(oh)?, num(om)?);
            if oh > 23 || om > 59 || oh.to_string().len() > 2 {
                return Err(bad());
            }
            (t, sign * (oh * 3600 + om * 60))
        } else {
            return Err(bad());
        };
        let (hms, frac) = match time.split_once('.') {
            Some((a, f)) => (a, Some(f)),
            None => (time, None),
        };
        let mut t = hms.split(':');
        let (h, mi, se) = match (t.next(), t.next(), t.next(), t.next()) {
            (Some(h), Some(mi), Some(se), None) if h.len() == 2 && mi.len() == 2 && se.len() == 2 => {
                (num(h)?, num(mi)?, num(se)?)
            }
            _ => return Err(bad()),
        };
        if h > 23 || mi > 59 || se > 60 {
            return Err(bad());
        }
        if let Some(f) = frac {
            num(f)?;
            let digits: String = f.chars().chain(std::iter::repeat('0')).take(6).collect();
            micros = num(&digits)?;
        }
        secs += h * 3600 + mi * 60 + se - offset;
    }
    if secs < 0 {
        return Err(bad());
    }
    let t =
        UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs()) + Duration::from_micros(micros.unsigned_abs());
    to_micros(t).map_err(|_| bad())?;
    Ok(t)
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Howard Hinnant's days-from-civil (proleptic Gregorian), the inverse of
/// the one `rfc3339` uses.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips() {
        for s in [
            "1970-01-01T00:00:00.000000Z",
            "2000-02-29T00:00:00.000000Z",
            "2026-11-30T08:15:30.123456Z",
        ] {
            assert_eq!(rfc3339(parse_rfc3339(s).unwrap()), s);
        }
        assert_eq!(
            parse_rfc3339("2026-11-30T09:15:30.5+01:00").unwrap(),
            parse_rfc3339("2026-11-30T08:15:30.500Z").unwrap()
        );
        assert_eq!(
            parse_rfc3339("2026-11-30").unwrap(),
            parse_rfc3339("2026-11-30T00:00:00Z").unwrap()
        );
        for bad in [
            "",
            "yesterday",
            "2026-13-01",
            "2026-02-30",
            "2026-11-30T25:00:00Z",
            "2026-11-30T08:00:00",
            "2026-11-30T08:00Z",
            "2026-11-30T08:00:00.x1Z",
            "1969-12-31T23:59:59Z",
        ] {
            assert!(
                matches!(parse_rfc3339(bad), Err(Error::InvalidInput(_))),
                "{bad:?}"
            );
        }
    }

    fn record(fence_offset: i64, state: RecordState) -> Record {
        use oncely::backend::from_micros;
        let created_us = 1_796_000_000_000_000i64;
        let key = EffectKey::parse("acme/capture:o-1").unwrap();
        let mut r = Record {
            key,
            state,
            fence: u64::try_from(created_us + fence_offset).unwrap(),
            fingerprint: None,
            outcome: None,
            at_most_once: false,
            created_at: from_micros(created_us),
            updated_at: from_micros(created_us),
            lease_expires_at: None,
            retain_until: from_micros(created_us + 1),
            read_at: from_micros(created_us + 10),
        };
        if state == RecordState::InProgress {
            r.lease_expires_at = Some(from_micros(created_us + 5));
        }
        r
    }

    #[test]
    fn the_fence_tells_a_single_grant_from_several() {
        let once = Claims::of(&record(0, RecordState::Completed));
        assert_eq!((once.claimed_again, once.grants), (Some(false), "1"));
        assert_eq!(once.latest_grant_at, None);
        let again = Claims::of(&record(7, RecordState::Completed));
        assert_eq!((again.claimed_again, again.grants), (Some(true), "2 or more"));
        assert_eq!(
            again.latest_grant_at.as_deref(),
            Some("2026-11-30T00:53:20.000007Z")
        );
        // A fence below the clock (schema version 1's 1, 2, 3…): cannot tell.
        let mut old = record(0, RecordState::Completed);
        old.fence = 3;
        assert_eq!(Claims::of(&old).claimed_again, None);
    }

    #[test]
    fn classes_follow_the_clock_and_the_step_mode() {
        assert_eq!(class_of(&record(0, RecordState::InProgress)), "stuck");
        let mut amo = record(0, RecordState::InProgress);
        amo.at_most_once = true;
        assert_eq!(class_of(&amo), "abandoned");
        let mut live = record(0, RecordState::InProgress);
        live.lease_expires_at = Some(live.read_at + Duration::from_micros(1));
        assert_eq!(class_of(&live), "live");
        assert_eq!(class_of(&record(0, RecordState::Released)), "released");
    }

    #[test]
    fn the_verdict_says_what_the_records_show() {
        let view = |r: &Record| Inspection::from(r);
        let (twice, line) = verdict(&[], &[]);
        assert!(!twice && line.starts_with("no record"), "{line}");
        let (twice, line) = verdict(&[view(&record(0, RecordState::Completed))], &[]);
        assert!(
            !twice && line.starts_with("no: the effect was granted once"),
            "{line}"
        );
        let (twice, line) = verdict(
            &[
                view(&record(0, RecordState::Completed)),
                view(&record(3, RecordState::Completed)),
            ],
            &[],
        );
        assert!(twice && line.starts_with("possibly: 1 of 2 effects"), "{line}");
        assert!(line.contains("oncely_duplicates_suppressed_total"), "{line}");
    }

    #[test]
    fn scope_needs_a_tenant_or_all_tenants() {
        assert!(matches!(scope(None, false), Err(Error::Misuse(_))));
        assert!(matches!(scope(Some("a"), true), Err(Error::Misuse(_))));
        assert_eq!(scope(None, true).unwrap(), None);
        assert_eq!(
            scope(Some("acme"), false).unwrap(),
            Some(Tenant::new("acme").unwrap())
        );
        assert!(matches!(scope(Some("a/b"), false), Err(Error::InvalidKey { .. })));
    }
}
