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
/// Histogram `{kind,found}`: age of the first claim when a duplicate
/// arrives. `found="completed"`: a duplicate of a completed effect (the
/// gap retention must cover); `found="in_progress"`: a retry or a
/// concurrent copy that found the effect still running (not a redelivery
/// gap; counted apart so the two are not added up).
pub const REDELIVERY_GAP_SECONDS: &str = "oncely_redelivery_gap_seconds";
/// The span every claim runs in.
pub const CLAIM_SPAN: &str = "oncely.claim";
/// Counter `{kind,doubt,result,dry_run}`: records a reconciliation run
/// examined, by what became of them (`completed`, `released`, `unknown`,
/// `moved`, `skipped`, `error`; see [`Resolution`](crate::reconcile::Resolution)).
pub const RECONCILED_TOTAL: &str = "oncely_reconciled_total";
/// The span of one reconciliation run ([`Reconcile::run`](crate::reconcile::Reconcile::run)).
pub const RECONCILE_RUN_SPAN: &str = "oncely.reconcile_run";
/// The span each examined record is reconciled in, with `effect_key`,
/// `tenant`, `kind`, `fence`, `doubt`, `verdict` and `result`.
pub const RECONCILE_SPAN: &str = "oncely.reconcile";
/// Counter `{backend}`: records deleted by a [`Pruner`](crate::pruner::Pruner).
pub const PRUNED_ROWS_TOTAL: &str = "oncely_pruned_rows_total";
/// Counter `{backend,result}`: [`Ledger::prune`](crate::ledger::Ledger::prune) calls
/// of a [`Pruner`](crate::pruner::Pruner), by result (`ok`, `error`).
pub const PRUNE_BATCHES_TOTAL: &str = "oncely_prune_batches_total";
/// Histogram `{backend}`: seconds per successful prune batch of a
/// [`Pruner`](crate::pruner::Pruner).
pub const PRUNE_BATCH_SECONDS: &str = "oncely_prune_batch_seconds";
/// The span a [`Pruner`](crate::pruner::Pruner)'s task runs in (`backend`, `batch`,
/// `rows_per_second`).
pub const PRUNER_SPAN: &str = "oncely.pruner";
/// The span each prune batch of a [`Pruner`](crate::pruner::Pruner) runs in
/// (`limit`, then `deleted` once known).
pub const PRUNE_BATCH_SPAN: &str = "oncely.prune_batch";

/// Counter `{result}`: outbox messages a [`Relay`](crate::outbox::Relay)
/// handled, by result (`sent`; `fenced`: published, but another relay had
/// taken it over; `retried`; `failed`).
pub const OUTBOX_MESSAGES_TOTAL: &str = "oncely_outbox_messages_total";

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

/// The span of a reconciliation run.
pub(crate) fn reconcile_run_span(backend: &'static str, dry_run: bool) -> tracing::Span {
    tracing::info_span!(RECONCILE_RUN_SPAN, backend, dry_run)
}

/// The span one record is reconciled in (`fence` is the record's, then the
/// takeover lease's; `verdict` and `result` are recorded once known).
pub(crate) fn reconcile_span(key: &EffectKey, fence: u64, doubt: Option<&'static str>) -> tracing::Span {
    tracing::info_span!(
        RECONCILE_SPAN,
        effect_key = %key,
        tenant = %key.tenant(),
        kind = key.kind(),
        fence,
        doubt = doubt.unwrap_or("none"),
        verdict = tracing::field::Empty,
        result = tracing::field::Empty,
    )
}

/// Counts one examined record by what became of it.
pub(crate) fn reconciled(key: &EffectKey, doubt: Option<&'static str>, result: &'static str, dry_run: bool) {
    metrics::counter!(
        RECONCILED_TOTAL,
        "kind" => key.kind().to_owned(),
        "doubt" => doubt.unwrap_or("none"),
        "result" => result,
        "dry_run" => if dry_run { "true" } else { "false" },
    )
    .increment(1);
    tracing::info!(effect_key = %key, doubt = doubt.unwrap_or("none"), result, dry_run, "reconciled");
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
    let found = if suppressed { "completed" } else { "in_progress" };
    metrics::histogram!(REDELIVERY_GAP_SECONDS, "kind" => key.kind().to_owned(), "found" => found)
        .record(gap.as_secs_f64());
}

/// Bucket bounds (seconds) for [`REDELIVERY_GAP_SECONDS`], from 1 s to 30
/// days, about ×2–×3 apart, with a bound at each retention people choose:
/// 1m, 5m, 15m, 30m, 1h, 3h, 6h, 12h, 24h, 48h, 72h, 7d, 14d, 30d.
///
/// The `metrics` facade records raw values; buckets are the exporter's
/// choice, so pass these to it, e.g. with `metrics-exporter-prometheus`:
/// `PrometheusBuilder::new().set_buckets_for_metric(Matcher::Full(REDELIVERY_GAP_SECONDS.into()), REDELIVERY_GAP_BUCKETS)`.
///
/// Reading retention from it: the smallest bound under which (nearly) all
/// gaps fall is the longest redelivery seen; keep completed records longer
/// than that, with margin ([`ClaimOptions::retention`](crate::ClaimOptions::retention)).
/// A duplicate that arrives after its record was pruned is not counted
/// here: it fails with [`Error::BeyondHorizon`](crate::Error::BeyondHorizon)
/// when the claim gives `sent_at`, and runs again when it does not.
pub const REDELIVERY_GAP_BUCKETS: &[f64] = &[
    1.0,         // 1 s
    2.0,         // 2 s
    5.0,         // 5 s
    10.0,        // 10 s
    30.0,        // 30 s
    60.0,        // 1 min
    120.0,       // 2 min
    300.0,       // 5 min
    900.0,       // 15 min
    1_800.0,     // 30 min
    3_600.0,     // 1 h
    10_800.0,    // 3 h
    21_600.0,    // 6 h
    43_200.0,    // 12 h
    86_400.0,    // 24 h
    172_800.0,   // 48 h
    259_200.0,   // 72 h
    604_800.0,   // 7 days
    1_209_600.0, // 14 days
    2_592_000.0, // 30 days
];

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

/// What a relay pass did, counted by result.
pub(crate) fn relay_pass(pass: &crate::outbox::Pass) {
    for (result, n) in [
        ("sent", pass.sent),
        ("fenced", pass.fenced),
        ("retried", pass.retried),
        ("failed", pass.failed),
    ] {
        if n > 0 {
            metrics::counter!(OUTBOX_MESSAGES_TOTAL, "result" => result).increment(n);
        }
    }
}
