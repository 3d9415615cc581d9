//! The hand-written baseline for `memory:`: a map behind a mutex, holding
//! each key's outcome; a batch takes the lock once.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use oncely::Result;

use super::{Answer, Leased};

/// The baseline's map.
#[derive(Default)]
pub(crate) struct MemoryBaseline {
    map: Mutex<HashMap<String, String>>,
    /// The same-guarantees rows' keys.
    leased: Mutex<HashMap<String, Lease>>,
}

/// A same-guarantees key: its fence, its lease's end, its outcome once done.
type Lease = (u64, Instant, Option<String>);

impl MemoryBaseline {
    pub(super) fn describe(&self) -> &'static str {
        "a mutex-guarded map: insert the outcome if absent, else read it"
    }

    pub(super) fn key(&self, row: &str, job: usize) -> String {
        format!("{row}:{job}")
    }

    fn answer(map: &mut HashMap<String, String>, key: &str, outcome: &str) -> Answer {
        match map.entry(key.to_owned()) {
            Entry::Vacant(e) => {
                e.insert(outcome.to_owned());
                Answer::Won
            }
            Entry::Occupied(e) => Answer::Duplicate(e.get().clone()),
        }
    }

    pub(super) async fn claim(&self, key: &str, outcome: &str) -> Result<Answer> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        Ok(Self::answer(&mut map, key, outcome))
    }

    pub(super) async fn claim_many(&self, items: &[(String, String)]) -> Result<Vec<Answer>> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        Ok(items.iter().map(|(k, o)| Self::answer(&mut map, k, o)).collect())
    }

    pub(super) fn describe_leased(&self) -> &'static str {
        "a mutex-guarded map of in-progress entries with a lease and a fence, completed fenced; \
         a duplicate polls"
    }

    pub(super) async fn lease(&self, key: &str, len: Duration) -> Result<Leased> {
        let mut map = self.leased.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        Ok(match map.entry(key.to_owned()) {
            Entry::Vacant(e) => {
                e.insert((1, now + len, None));
                Leased::Won(1)
            }
            Entry::Occupied(mut e) => match e.get() {
                (_, _, Some(outcome)) => Leased::Done(outcome.clone()),
                (_, until, None) if *until > now => Leased::Busy,
                (fence, _, None) => {
                    let fence = fence + 1;
                    e.insert((fence, now + len, None));
                    Leased::Won(fence)
                }
            },
        })
    }

    pub(super) async fn finish(&self, key: &str, fence: u64, outcome: &str) -> Result<bool> {
        let mut map = self.leased.lock().unwrap_or_else(|p| p.into_inner());
        Ok(match map.get_mut(key) {
            Some((f, _, done @ None)) if *f == fence => {
                *done = Some(outcome.to_owned());
                true
            }
            _ => false,
        })
    }

    pub(super) async fn remove(&self, _keys: &[String]) -> Result<()> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.leased.lock().unwrap_or_else(|p| p.into_inner()).clear();
        Ok(())
    }
}
