//! The hand-written baseline for `memory:`: a map behind a mutex, holding
//! each key's outcome; a batch takes the lock once.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Mutex;

use oncely::Result;

use super::Answer;

/// The baseline's map.
#[derive(Default)]
pub(crate) struct MemoryBaseline {
    map: Mutex<HashMap<String, String>>,
}

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

    pub(super) async fn remove(&self, _keys: &[String]) -> Result<()> {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clear();
        Ok(())
    }
}
