//! Wake-ups for waiting duplicates: one in-process [`Notifier`] per database
//! file and ledger table, notified after this process's completions and
//! releases.
//!
//! SQLite has no channel between processes (no `NOTIFY`), so a waiter is
//! woken only by writes made in its own process. Every ledger this process
//! opens with [`connect_with`](crate::SqliteLedger::connect_with) on the same
//! file and table shares one notifier (they see the same records), so a
//! completion through one wakes a waiter on another. A waiter whose holder
//! is in another process is answered by the runner's fallback look
//! ([`oncely::backend::NOTIFIED_FALLBACK`]), or polls if the ledger was opened
//! with [`SqliteLedgerOptions::multi_process`](crate::SqliteLedgerOptions::multi_process).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use oncely::backend::Notifier;

/// The notifiers of the ledgers open in this process, by the database file
/// SQLite reports (an absolute path) and the table. Entries die with their
/// last ledger.
type Registry = Mutex<HashMap<(String, String), Weak<Notifier>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::default)
}

/// The notifier shared by this process's ledgers on `file` and `table`; a
/// fresh one when `file` is unknown (a caller's pool) or not a file.
pub(crate) fn shared(file: Option<&str>, table: &str) -> Arc<Notifier> {
    let Some(file) = file.filter(|f| !f.is_empty()) else {
        return Arc::new(Notifier::new());
    };
    let mut notifiers = registry().lock().unwrap_or_else(|p| p.into_inner());
    notifiers.retain(|_, n| n.strong_count() > 0);
    let id = (file.to_owned(), table.to_owned());
    if let Some(n) = notifiers.get(&id).and_then(Weak::upgrade) {
        return n;
    }
    let n = Arc::new(Notifier::new());
    notifiers.insert(id, Arc::downgrade(&n));
    n
}
