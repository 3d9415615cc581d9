//! Metric names (part of the public API). Architecture invariant: no other
//! module of this crate names a metric.

/// Counter `{consumer,result}`: settled deliveries by what happened
/// (`ran`, `replayed`, `abandoned`, `in_progress`, `retry`, `dead_letter`,
/// `shutdown`).
pub const DELIVERIES_TOTAL: &str = "oncely_consumer_deliveries_total";
/// Counter `{consumer,reason}`: dead-lettered deliveries by reason
/// (`oversized`, `undecodable`, `missing_field`, `poison`, `terminal`,
/// `max_deliveries`, `abandoned`, `rejected`).
pub const DEAD_LETTERS_TOTAL: &str = "oncely_consumer_dead_letters_total";
/// Counter `{consumer,action}`: acks, nacks and dead-letters the broker
/// refused (a dropped connection): the broker redelivers those.
pub const SETTLE_ERRORS_TOTAL: &str = "oncely_consumer_settle_errors_total";
/// Histogram `{consumer}`: handler time in seconds.
pub const HANDLER_SECONDS: &str = "oncely_consumer_handler_seconds";

pub(crate) fn delivery(consumer: &str, result: &'static str) {
    metrics::counter!(DELIVERIES_TOTAL, "consumer" => consumer.to_owned(), "result" => result).increment(1);
}

pub(crate) fn dead_letter(consumer: &str, reason: &'static str) {
    metrics::counter!(DEAD_LETTERS_TOTAL, "consumer" => consumer.to_owned(), "reason" => reason).increment(1);
}

pub(crate) fn settle_error(consumer: &str, action: &'static str) {
    metrics::counter!(SETTLE_ERRORS_TOTAL, "consumer" => consumer.to_owned(), "action" => action)
        .increment(1);
}

pub(crate) fn handler_seconds(consumer: &str, seconds: f64) {
    metrics::histogram!(HANDLER_SECONDS, "consumer" => consumer.to_owned()).record(seconds);
}
