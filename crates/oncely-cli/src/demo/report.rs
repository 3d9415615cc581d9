//! What the demo reports: one [`RunReport`] per guard, and the
//! [`DemoReport`] over both, rendered as a table by [`DemoReport::table`].

use comfy_table::presets::NOTHING;
use comfy_table::{CellAlignment, Table};
use serde::Serialize;

/// The result of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// Deliveries processed (orders × deliveries per order).
    pub deliveries: u64,
    /// Charges the provider performed.
    pub charges: u64,
    /// Charges beyond the first, summed over orders.
    pub duplicate_charges: u64,
    /// Orders charged more than once.
    pub orders_charged_twice: u64,
    /// Deliveries that charged nothing because the guard recognised a duplicate.
    pub duplicates_suppressed: u64,
    /// Orders whose status is `paid` at the end.
    pub orders_paid: u64,
    /// Delivery attempts that failed retryably (busy database, an in-flight
    /// duplicate) and were retried, as a broker would redeliver them.
    pub retries: u64,
    /// Wall-clock time of the run.
    pub seconds: f64,
}

/// The demo's result: both runs over the same deliveries.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DemoReport {
    /// How many orders.
    pub orders: u64,
    /// Deliveries per run (orders × deliveries per order).
    pub deliveries: u64,
    /// How many times each order's message was delivered.
    pub deliveries_per_order: u64,
    /// Concurrent consumers.
    pub workers: u64,
    /// The ledger's backend (`sqlite`, `postgres`, `mysql`, `redis`, `nats`,
    /// `memory`).
    pub backend: &'static str,
    /// The tenant of this run's effect keys (`demo-<run id>`); inspect them
    /// with `oncely get <tenant>/capture:order-1`.
    pub tenant: String,
    /// The seed of the delivery order.
    pub seed: u64,
    /// The naive guard's run.
    pub naive: RunReport,
    /// oncely's run.
    pub oncely: RunReport,
}

impl DemoReport {
    /// What went wrong with oncely's run, if anything: a duplicate charge,
    /// an order not charged, an order not paid. Empty when oncely did its job.
    pub fn oncely_problems(&self) -> Vec<String> {
        let r = &self.oncely;
        let mut problems = Vec::new();
        if r.duplicate_charges > 0 {
            problems.push(format!(
                "oncely performed {} duplicate charge(s) on {} order(s)",
                r.duplicate_charges, r.orders_charged_twice
            ));
        }
        if r.charges != self.orders {
            problems.push(format!(
                "oncely performed {} charges for {} orders",
                r.charges, self.orders
            ));
        }
        if r.orders_paid != self.orders {
            problems.push(format!(
                "only {} of {} orders are marked paid",
                r.orders_paid, self.orders
            ));
        }
        problems
    }

    /// The two runs side by side: a borderless table whose rows start with
    /// their label (`deliveries`, `charges performed`, `duplicate charges`,
    /// `duplicates suppressed`, `time`) and whose columns are `naive` and
    /// `oncely`. The binary prints it.
    pub fn table(&self) -> Table {
        let (n, o) = (&self.naive, &self.oncely);
        let mut table = Table::new();
        table.load_preset(NOTHING).set_header(["", "naive", "oncely"]);
        for (label, naive, oncely) in [
            ("deliveries", n.deliveries, o.deliveries),
            ("charges performed", n.charges, o.charges),
            ("duplicate charges", n.duplicate_charges, o.duplicate_charges),
            (
                "duplicates suppressed",
                n.duplicates_suppressed,
                o.duplicates_suppressed,
            ),
        ] {
            table.add_row([label.to_owned(), naive.to_string(), oncely.to_string()]);
        }
        table.add_row([
            "time".to_owned(),
            format!("{:.2} s", n.seconds),
            format!("{:.2} s", o.seconds),
        ]);
        for (i, column) in table.column_iter_mut().enumerate() {
            // Three spaces between columns, none at the ends of a line.
            column.set_padding((if i == 0 { 0 } else { 3 }, 0));
            if i > 0 {
                column.set_cell_alignment(CellAlignment::Right);
            }
        }
        table
    }
}
