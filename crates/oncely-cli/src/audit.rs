//! Operator actions are recorded: after `resolve`, `forget`, `erase` or
//! `reencrypt` changes a
//! record, [`write`] stores an audit record in the ledger itself, a completed
//! effect of the reserved kind [`AUDIT_KIND`] in the same tenant, whose
//! outcome says what was done (`{"ok": {"action", "key", "fence",
//! "new_fence", "at", "by"}}`), and emits a `tracing` event (target
//! `oncely::audit`) for the embedding application's subscriber. `history`
//! lists them next to the records they touched. Audit records
//! are kept [`AUDIT_RETENTION`], then pruned like any other.

use std::time::{Duration, SystemTime};

use oncely::backend::{Claim, Ledger, Outcome, Record};
use oncely::{ClaimOptions, EffectKey, Error, Result};
use oncely_any::AnyLedger;
use serde::Serialize;

use crate::time::rfc3339;

/// The kind of the audit records that `resolve` and `forget` write, in the
/// tenant of the key they changed.
pub const AUDIT_KIND: &str = "oncely-audit";

/// How long an audit record is kept (400 days).
pub const AUDIT_RETENTION: Duration = Duration::from_secs(400 * 86_400);

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

/// What an audit record says was done (`action`, `key`, `fence`, …), if
/// `r` is one.
pub(crate) fn entry(r: &Record) -> Option<serde_json::Value> {
    match r.stored::<serde_json::Value>().ok()?? {
        oncely::backend::StoredOutcome::Value(v) => Some(v),
        _ => None,
    }
}

/// Writes the audit record of an operator action and emits its tracing
/// event. The audit key is derived from the action, the fence and the key's
/// provider key, so the same action on the same fence is recorded once.
pub(crate) async fn write(
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
    record(ledger, &audit_key, &entry, action, key.as_str(), fence, new_fence).await?;
    Ok(audit_key)
}

/// Writes the audit record of an erasure (`oncely erase`) and emits its
/// tracing event. It names the subject only by [`subject_hash`], never as
/// it is: the record outlives the erasure (kept [`AUDIT_RETENTION`]).
pub(crate) async fn write_erasure(
    ledger: &AnyLedger,
    tenant: &oncely::Tenant,
    subject: &str,
    erasure: &oncely::admin::Erasure,
) -> Result<EffectKey> {
    let hash = subject_hash(tenant, subject);
    let at = erasure.at;
    let at_us = oncely::backend::to_micros(at)?;
    let audit_key = EffectKey::new(tenant, AUDIT_KIND, format!("erase:{at_us}:{}", &hash[..32]))?;
    let entry = serde_json::json!({
        "action": "erase",
        "subject_hash": hash,
        "erased": erasure.erased.len(),
        "pending": erasure.pending.len(),
        "messages_erased": erasure.messages.len(),
        "messages_pending": erasure.messages_pending.len(),
        "at": rfc3339(at),
        "by": std::env::var("USER").ok(),
    });
    record(ledger, &audit_key, &entry, "erase", &hash, 0, 0).await?;
    Ok(audit_key)
}

/// Writes the audit record of a `reencrypt` run (not a dry run) and emits
/// its tracing event: one record per run, with the counts, in the tenant it
/// ran on (the global tenant for `--all-tenants`), keyed by the time and
/// the active key id.
pub(crate) async fn write_reencrypt(
    ledger: &AnyLedger,
    tenant: Option<&oncely::Tenant>,
    active_key: &str,
    report: &oncely::codec::ResealReport,
) -> Result<EffectKey> {
    let at = SystemTime::now();
    let at_us = oncely::backend::to_micros(at)?;
    let home = tenant.cloned().unwrap_or_else(oncely::Tenant::global);
    let audit_key = EffectKey::new(&home, AUDIT_KIND, format!("reencrypt:{at_us}:{active_key}"))?;
    let scope = tenant.map_or("all tenants".to_owned(), ToString::to_string);
    let entry = serde_json::json!({
        "action": "reencrypt",
        "tenant": tenant.map(|t| t.as_str()),
        "active_key": active_key,
        "scanned": report.scanned,
        "resealed": report.resealed,
        "moved_on": report.moved_on,
        "failed": report.failed.len(),
        "at": rfc3339(at),
        "by": std::env::var("USER").ok(),
    });
    record(ledger, &audit_key, &entry, "reencrypt", &scope, 0, 0).await?;
    Ok(audit_key)
}

/// How an erasure's audit record names the subject: 64 hex digits of a
/// BLAKE3 hash of the tenant and the stored subject, so that "was this
/// person's data erased?" can be answered by hashing their subject again,
/// and the record itself holds nothing of them.
pub fn subject_hash(tenant: &oncely::Tenant, subject: &str) -> String {
    let mut h = blake3::Hasher::new_derive_key("oncely 2026 erased subject");
    h.update(&(tenant.as_str().len() as u64).to_le_bytes());
    h.update(tenant.as_str().as_bytes());
    h.update(subject.as_bytes());
    h.finalize().to_hex().to_string()
}

/// Stores `entry` as the completed audit record `audit_key` (once: the same
/// key already recorded is left as it is) and emits the tracing event.
async fn record(
    ledger: &AnyLedger,
    audit_key: &EffectKey,
    entry: &serde_json::Value,
    action: &'static str,
    about: &str,
    fence: u64,
    new_fence: u64,
) -> Result<()> {
    let written = async {
        let opts = ClaimOptions::default()
            .lease(Duration::from_secs(60))
            .retention(AUDIT_RETENTION);
        match ledger.claim(audit_key, &opts).await? {
            Claim::Acquired(lease) => ledger.complete(&lease, &Outcome::value(entry)?).await,
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
        effect_key = %about,
        fence,
        new_fence,
        audit_key = %audit_key,
        recorded = written.is_ok(),
        "operator action"
    );
    written.map_err(|e| match e {
        Error::Unavailable { backend, message } => Error::Unavailable {
            backend,
            message: format!("{action} of {about} was done, but its audit record was not written: {message}"),
        },
        other => other,
    })
}
