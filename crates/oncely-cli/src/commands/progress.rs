//! The progress bars of `demo` and `bench` on stderr.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oncely_bench as bench;

use crate::demo;

/// The demo's and the bench's progress bar on stderr, one per run (the
/// demo's) or per row (the bench's); drawn only on a terminal.
pub(crate) struct Bar {
    enabled: bool,
    bar: Mutex<Option<ProgressBar>>,
}

impl Bar {
    /// A bar drawn on stderr when it is a terminal and the output is not
    /// JSON.
    pub(crate) fn new(json: bool) -> Arc<Bar> {
        Arc::new(Bar {
            enabled: !json && std::io::stderr().is_terminal(),
            bar: Mutex::new(None),
        })
    }
}

impl demo::Progress for Bar {
    fn start(&self, guard: demo::Guard, deliveries: u64) {
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(deliveries), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{prefix:>7} [{bar:40}] {pos}/{len} deliveries {elapsed}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(guard.name());
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn delivered(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bar.inc(1);
        }
    }

    fn finish(&self, _guard: demo::Guard) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}

/// The bench's progress bar: one per row, drawn only on a terminal.
impl bench::Progress for Bar {
    fn start(&self, row: &str, deliveries: u64) {
        if !self.enabled {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(deliveries), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{prefix:>38} [{bar:30}] {pos}/{len} {elapsed}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(row.to_owned());
        *self.bar.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
    }

    fn delivered(&self, n: u64) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            bar.inc(n);
        }
    }

    fn finish(&self) {
        if let Some(bar) = self.bar.lock().unwrap_or_else(|p| p.into_inner()).take() {
            bar.finish_and_clear();
        }
    }
}
