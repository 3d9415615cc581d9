//! Metric and span names (part of the public API) and the helpers that
//! record them (crate-private: the claim pipeline records, backends do not).
//! Architecture invariant: no other module names a metric.

use std::time::{Duration, SystemTime};

use crate::key::EffectKey;

/// Counter `{backend,kind,result}`: every claim, by result label.
pub const CLAIMS_TOTAL: &str = "oncely_claims_total";
/// Counter `{kind}`: duplicates answered from a stored outcome.
pub const DUPLICATES_SUPPRESSED_TOTAL: &str = "oncely_duplicates_suppressed_total";
/// Counter `{kind}`: expired leases or released records taken over.
pub const LEASE_TAKEOVERS_TOTAL: &str = "oncely_lease_takeovers_total";
/// Counter `{kind}`: writes refused for a stale fence.
pub const FENCE_REJECTIONS_TOTAL: &str = "oncely_fence_rejections_total";
/// Counter: unique violations that were not the effect key (a bug, not a duplicate).
pub const UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL: &str = "oncely_unexpected_constraint_violations_total";
/// Histogram `{backend}`: claim latency in seconds.
pub const CLAIM_SECONDS: &str = "oncely_claim_seconds";
/// Histogram `{kind}`: age of the first claim when a duplicate arrives.
pub const REDELIVERY_GAP_SECONDS: &str = "oncely_redelivery_gap_seconds";
/// The span every claim runs in.
pub const CLAIM_SPAN: &str = "oncely.claim";
/// Counter `{backend}`: records deleted by a [`Pruner`](crate::Pruner).
pub const PRUNED_ROWS_TOTAL: &str = "oncely_pruned_rows_total";
/// Counter `{backend,result}`: [`Ledger::prune`](crate::Ledger::prune) calls
/// of a [`Pruner`](crate::Pruner), by result (`ok`, `error`).
pub const PRUNE_BATCHES_TOTAL: &str = "oncely_prune_batches_total";
/// Histogram `{backend}`: seconds per successful prune batch of a
/// [`Pruner`](crate::Pruner).
pub const PRUNE_BATCH_SECONDS: &str = "oncely_prune_batch_seconds";
/// The span a [`Pruner`](crate::Pruner)'s task runs in (`backend`, `batch`,
/// `rows_per_second`).
pub const PRUNER_SPAN: &str = "oncely.pruner";
/// The span each prune batch of a [`Pruner`](crate::Pruner) runs in
/// (`limit`, then `deleted` once known).
pub const PRUNE_BATCH_SPAN: &str = "oncely.prune_batch";

/// The span every claim runs in, with the fields of `docs/design.md` ("Observability") (`fence`
/// and `result` are recorded once known).
pub(crate) fn claim_span(key: &EffectKey) -> tracing::Span {
    tracing::info_span!(
        CLAIM_SPAN,
        effect_key = %key,
        tenant = %key.tenant(),
        kind = key.kind(),
        fence = tracing::field::Empty,
        result = tracing::field::Empty,
    )
}

/// Records one claim's result and latency.
pub(crate) fn claim_recorded(backend: &'static str, key: &EffectKey, result: &'static str, took: Duration) {
    metrics::counter!(CLAIMS_TOTAL, "backend" => backend, "kind" => key.kind().to_owned(), "result" => result)
        .increment(1);
    metrics::histogram!(CLAIM_SECONDS, "backend" => backend).record(took.as_secs_f64());
    if result == "takeover" {
        metrics::counter!(LEASE_TAKEOVERS_TOTAL, "kind" => key.kind().to_owned()).increment(1);
    }
}

/// Records a duplicate that found the effect done or in flight, with the gap
/// since the first claim measured on the backend's clock.
pub(crate) fn duplicate_seen(
    key: &EffectKey,
    suppressed: bool,
    first_claimed_at: SystemTime,
    read_at: SystemTime,
) {
    if suppressed {
        metrics::counter!(DUPLICATES_SUPPRESSED_TOTAL, "kind" => key.kind().to_owned()).increment(1);
    }
    let gap = read_at.duration_since(first_claimed_at).unwrap_or_default();
    metrics::histogram!(REDELIVERY_GAP_SECONDS, "kind" => key.kind().to_owned()).record(gap.as_secs_f64());
}

/// Records a write refused for a stale fence.
pub(crate) fn fence_rejected(key: &EffectKey) {
    metrics::counter!(FENCE_REJECTIONS_TOTAL, "kind" => key.kind().to_owned()).increment(1);
    tracing::warn!(effect_key = %key, "fenced write refused: the lease was taken over");
}

/// Records a grant the runner gave back because too little of its lease was
/// left when it arrived (a claim that waited on a lock, a slow round trip).
pub(crate) fn stale_grant(key: &EffectKey, left: Duration) {
    tracing::warn!(effect_key = %key, left_ms = left.as_millis() as u64,
        "lease arrived with less than the safety margin left; released and claiming again");
}

/// Records a unique violation on something other than the effect key.
pub(crate) fn unexpected_constraint_violation(backend: &'static str, detail: &str) {
    metrics::counter!(UNEXPECTED_CONSTRAINT_VIOLATIONS_TOTAL).increment(1);
    tracing::error!(
        backend,
        detail,
        "unexpected unique-constraint violation (not the effect key)"
    );
}

/// The span a pruner's task runs in.
pub(crate) fn pruner_span(backend: &'static str, batch: u64, rows_per_second: Option<u64>) -> tracing::Span {
    tracing::info_span!(PRUNER_SPAN, backend, batch, rows_per_second)
}

/// The span one prune batch runs in.
pub(crate) fn prune_batch_span(limit: u64) -> tracing::Span {
    tracing::debug_span!(PRUNE_BATCH_SPAN, limit, deleted = tracing::field::Empty)
}

/// Records a prune batch that deleted `rows` in `took`.
pub(crate) fn prune_batch_done(span: &tracing::Span, backend: &'static str, rows: u64, took: Duration) {
    span.record("deleted", rows);
    metrics::counter!(PRUNED_ROWS_TOTAL, "backend" => backend).increment(rows);
    metrics::counter!(PRUNE_BATCHES_TOTAL, "backend" => backend, "result" => "ok").increment(1);
    metrics::histogram!(PRUNE_BATCH_SECONDS, "backend" => backend).record(took.as_secs_f64());
}

/// Records a prune batch that failed; the pruner tries again after `pause`.
pub(crate) fn prune_batch_failed(
    span: &tracing::Span,
    backend: &'static str,
    error: &crate::Error,
    pause: Duration,
) {
    metrics::counter!(PRUNE_BATCHES_TOTAL, "backend" => backend, "result" => "error").increment(1);
    tracing::warn!(parent: span, backend, %error, retry_in_ms = pause.as_millis() as u64,
        "prune batch failed; trying again later");
}
