//! Operator actions are recorded: after `resolve` or `forget` changes a
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
