//! Reading the server's replies (this backend's row decoding): the scripts'
//! tags and numbers, a grant, a live lease, records (fields read by name),
//! `SCAN` pages and `CONFIG GET`.

use std::collections::HashMap;

use oncely::backend::{Grant, effective_state, from_micros};
use oncely::{Claim, EffectKey, Error, Fingerprint, Lease, Outcome, Record, RecordState, Result};
use redis::Value;

use crate::error::{BACKEND, unexpected};

pub(crate) fn array(v: Value) -> Result<Vec<Value>> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(unexpected(&format!("{other:?}"))),
    }
}

pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Okay => Some("OK".into()),
        _ => None,
    }
}

/// A script's `{'corrupt', message}` reply about `rkey`.
pub(crate) fn corrupt(rkey: &str, parts: &[Value]) -> Error {
    let what = parts.get(1).and_then(text).unwrap_or_default();
    Error::Corrupt {
        backend: BACKEND,
        message: format!("{rkey}: {what}"),
    }
}

/// The first element of a script's reply: what kind of answer it is.
pub(crate) fn tag(parts: &[Value]) -> Result<&str> {
    match parts.first() {
        Some(Value::BulkString(b)) => std::str::from_utf8(b).map_err(|_| unexpected("non-UTF-8 tag")),
        Some(Value::SimpleString(s)) => Ok(s),
        other => Err(unexpected(&format!("{other:?}"))),
    }
}

pub(crate) fn int(v: Option<&Value>) -> Result<i64> {
    match v {
        Some(Value::Int(i)) => Ok(*i),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| unexpected("non-numeric field")),
        other => Err(unexpected(&format!("{other:?}"))),
    }
}

pub(crate) fn uint(v: Option<&Value>) -> Result<u64> {
    u64::try_from(int(v)?).map_err(|_| unexpected("negative fence"))
}

/// The lease of claim.lua's `{'acquired', fence, lease end, creation time,
/// now, taken over}` reply.
pub(crate) fn grant(key: &EffectKey, at_most_once: bool, parts: &[Value]) -> Result<Lease> {
    Ok(Grant {
        key: key.clone(),
        fence: uint(parts.get(1))?,
        expires_at: from_micros(int(parts.get(2))?),
        first_claimed_at: from_micros(int(parts.get(3))?),
        acquired_at: from_micros(int(parts.get(4))?),
        taken_over: int(parts.get(5))? == 1,
        at_most_once,
    }
    .into_lease())
}

/// claim.lua's `{'in_progress', fence, lease end, creation time, now}`.
pub(crate) fn in_progress(parts: &[Value]) -> Result<Claim> {
    Ok(Claim::InProgress {
        fence: uint(parts.get(1))?,
        expires_at: from_micros(int(parts.get(2))?),
        first_claimed_at: from_micros(int(parts.get(3))?),
        read_at: from_micros(int(parts.get(4))?),
    })
}

/// The value of `CONFIG GET <one parameter>`, RESP2 or RESP3.
pub(crate) fn policy_of(v: &Value) -> Option<String> {
    match v {
        Value::Array(a) => a.get(1).and_then(text),
        Value::Map(m) => m.first().and_then(|(_, v)| text(v)),
        _ => None,
    }
}

/// A `SCAN` reply: the next cursor and the page's keys.
pub(crate) fn scan_page(v: Value) -> Result<(String, Vec<String>)> {
    let mut parts = array(v)?.into_iter();
    let cursor = parts.next().as_ref().and_then(text);
    let keys = match parts.next() {
        Some(Value::Array(keys)) => keys.iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    cursor
        .map(|c| (c, keys))
        .ok_or_else(|| unexpected("SCAN reply without cursor"))
}

/// Every field a record may have, in the order the scripts read them
/// (prelude.lua, `load`): a script's record reply is that `HMGET` as it is,
/// one value or nil per field, decoded here by these names. A unit test
/// holds prelude.lua to this list.
pub(crate) const FIELDS: [&str; 14] = [
    "v", "k", "s", "f", "c", "r", "hz", "w", "amo", "le", "fp", "o", "u", "ru",
];

/// Builds a record from a script's `{'record', now, fields}` reply, the
/// fields in the order of [`FIELDS`]. A field that does not parse means the
/// hash is not oncely's: [`Error::Corrupt`].
pub(crate) fn record(rkey: &str, expected: Option<&EffectKey>, parts: &[Value]) -> Result<Record> {
    let bad = |what: &str| Error::Corrupt {
        backend: BACKEND,
        message: format!("{rkey}: {what}"),
    };
    let now = from_micros(int(parts.get(1))?);
    let Some(Value::Array(values)) = parts.get(2) else {
        return Err(bad("record reply without fields"));
    };
    if values.len() != FIELDS.len() {
        return Err(bad("record reply with another number of fields"));
    }
    let mut fields = HashMap::with_capacity(FIELDS.len());
    for (name, value) in FIELDS.iter().zip(values) {
        if let Value::BulkString(v) = value {
            fields.insert(*name, v.as_slice());
        }
    }
    let field = |name: &str| fields.get(name).copied();
    let text_field = |name: &str| field(name).and_then(|b| std::str::from_utf8(b).ok());
    let num = |name: &str| text_field(name).and_then(|s| s.parse::<i64>().ok());
    let stored_key = text_field("k").ok_or_else(|| bad("record without its key"))?;
    let key = EffectKey::parse(stored_key).map_err(|e| bad(&format!("stored key {stored_key:?}: {e}")))?;
    if expected.is_some_and(|k| *k != key) {
        return Err(bad(&format!("holds the record of {key}")));
    }
    let state = RecordState::parse(text_field("s").unwrap_or_default()).map_err(|e| bad(&e.to_string()))?;
    let fingerprint = match text_field("fp").unwrap_or_default() {
        "" => None,
        hex => Some(Fingerprint::from_hex(hex).map_err(|e| bad(&e.to_string()))?),
    };
    let outcome = match field("o") {
        Some(bytes) => Some(Outcome::from_bytes(bytes.to_vec()).map_err(|e| bad(&e.to_string()))?),
        None => None,
    };
    let fence = num("f")
        .and_then(|f| u64::try_from(f).ok())
        .ok_or_else(|| bad("record without a fence"))?;
    let at_most_once = text_field("amo") == Some("1");
    // Format 2 leaves a stale 'le' behind on completion (one field less to
    // write per operation): it means something only while in progress.
    let lease_expires_at = if state == RecordState::InProgress {
        num("le").map(from_micros)
    } else {
        None
    };
    // Format 2 writes 'u' and 'ru' only once they differ from what the
    // first claim implies (see lua/prelude.lua).
    let created = num("c").ok_or_else(|| bad("record without a creation time"))?;
    let retain_until = match num("ru") {
        Some(ru) => ru,
        None => created.saturating_add(num("r").ok_or_else(|| bad("record without its retention"))?),
    };
    Ok(Record {
        key,
        state: effective_state(state, at_most_once, lease_expires_at, now),
        fence,
        fingerprint,
        outcome,
        at_most_once,
        created_at: from_micros(created),
        updated_at: from_micros(num("u").unwrap_or(created)),
        lease_expires_at,
        retain_until: from_micros(retain_until),
        read_at: now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scripts read a record's fields in the order [`FIELDS`] names
    /// them, all of them where a record is returned, a prefix elsewhere.
    #[test]
    fn scripts_read_the_fields_in_this_order() {
        let prelude = include_str!("lua/prelude.lua");
        let lists: Vec<Vec<&str>> = prelude
            .lines()
            .filter_map(|l| l.split("redis.pcall('HMGET', key, ").nth(1))
            .map(|l| {
                l.trim_end_matches(')')
                    .split(", ")
                    .map(|f| f.trim_matches('\''))
                    .collect()
            })
            .collect();
        assert_eq!(lists.len(), 2, "{lists:?}");
        assert_eq!(lists[0], FIELDS, "the full read");
        assert_eq!(lists[1], FIELDS[..lists[1].len()], "the short read");
    }
}
