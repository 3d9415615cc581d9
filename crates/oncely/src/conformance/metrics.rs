//! The test binary's metrics recorder, and counters read from it.

use std::sync::OnceLock;

/// The process-wide metrics recorder of a conformance test binary
/// (`metrics-util`'s debugging recorder), installed on first use.
pub fn metrics_snapshotter() -> &'static metrics_util::debugging::Snapshotter {
    static SNAPSHOTTER: OnceLock<metrics_util::debugging::Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("a conformance test binary installs no other global metrics recorder");
        snapshotter
    })
}

/// The sum of the counters named `name` whose labels include all of
/// `labels`, since [`metrics_snapshotter`] was first called. (The debugging
/// recorder drains counters on every snapshot; the totals are kept here.)
pub fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    static TOTALS: std::sync::Mutex<Vec<(metrics_util::CompositeKey, u64)>> =
        std::sync::Mutex::new(Vec::new());
    let mut totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
    for (k, _, _, v) in metrics_snapshotter().snapshot().into_vec() {
        let metrics_util::debugging::DebugValue::Counter(c) = v else {
            continue;
        };
        match totals.iter_mut().find(|(seen, _)| *seen == k) {
            Some((_, total)) => *total += c,
            None => totals.push((k, c)),
        }
    }
    totals
        .iter()
        .filter(|(k, _)| {
            k.key().name() == name
                && labels
                    .iter()
                    .all(|(l, v)| k.key().labels().any(|x| x.key() == *l && x.value() == *v))
        })
        .map(|(_, c)| c)
        .sum()
}
