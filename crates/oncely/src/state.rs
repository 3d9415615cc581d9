//! Where a record is in its life. A leaf module, so that the error type can
//! name a state without importing the records.

/// Where a record is in its life (see `docs/design.md`, "Record states").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordState {
    /// A lease is (or was, if expired) held on the key.
    InProgress,
    /// The effect happened; the outcome is stored.
    Completed,
    /// The holder gave the key back; the next claim takes it over with
    /// `fence + 1`. The row is kept so that fences are never reused.
    Released,
    /// An at-most-once step whose lease expired before completion: never
    /// re-run automatically, listed for reconciliation. Backends may store it
    /// as an expired at-most-once `InProgress` row; they report it as this.
    Abandoned,
}

impl RecordState {
    /// The stored name (`in_progress`, `completed`, `released`, `abandoned`).
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::InProgress => "in_progress",
            RecordState::Completed => "completed",
            RecordState::Released => "released",
            RecordState::Abandoned => "abandoned",
        }
    }
}
