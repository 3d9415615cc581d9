//! Reading the server's replies (this backend's row decoding): the scripts'
//! tags and numbers, a grant, a live lease, records (fields read by name),
//! `SCAN` pages and `CONFIG GET`.

use std::collections::HashMap;

use oncely::backend::{Claim, Fingerprint, Lease, Outcome, Record, RecordState};
use oncely::backend::{Grant, effective_state, from_micros};
use oncely::{EffectKey, Error, Result};
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

/// A script's `{'corrupt', message[, about]}` reply (`about`: `'horizon'`
/// when the horizon key is what is wrong).
const CORRUPT: &[&str] = &["message", "about"];

/// Whether a `corrupt` reply is about the horizon key rather than the record.
pub(crate) fn corrupt_horizon(parts: &[Value]) -> bool {
    Named::new(CORRUPT, parts).value("about").is_some()
}

/// A script's `{'corrupt', message}` reply about `rkey`.
pub(crate) fn corrupt(rkey: &str, parts: &[Value]) -> Error {
    let what = Named::new(CORRUPT, parts).text("message").unwrap_or_default();
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

/// A script's reply read by name: `{tag, value, …}` whose values after the
/// tag are named, in order, by `names` (the script's `return { tag, … }`
/// line, restated once per reply below). A value the reply lacks reads as
/// absent (nil), never as another field's.
pub(crate) struct Named<'a> {
    names: &'static [&'static str],
    parts: &'a [Value],
}

impl<'a> Named<'a> {
    pub(crate) fn new(names: &'static [&'static str], parts: &'a [Value]) -> Self {
        Named { names, parts }
    }

    /// The value named `name` (a name of `names`: a programming error
    /// otherwise).
    pub(crate) fn value(&self, name: &str) -> Option<&'a Value> {
        let i = self.names.iter().position(|n| *n == name);
        debug_assert!(i.is_some(), "{name} is not a field of {:?}", self.names);
        self.parts.get(i? + 1)
    }

    pub(crate) fn int(&self, name: &str) -> Result<i64> {
        int(self.value(name))
    }

    pub(crate) fn uint(&self, name: &str) -> Result<u64> {
        uint(self.value(name))
    }

    pub(crate) fn text(&self, name: &str) -> Option<String> {
        self.value(name).and_then(text)
    }
}

/// claim.lua's `{'acquired', fence, lease_end, created, now, taken_over}`.
pub(crate) struct Acquired {
    pub fence: u64,
    pub lease_end: i64,
    pub created: i64,
    pub now: i64,
    pub taken_over: bool,
}

impl Acquired {
    const NAMES: &[&str] = &["fence", "lease_end", "created", "now", "taken_over"];

    pub(crate) fn decode(parts: &[Value]) -> Result<Self> {
        let r = Named::new(Self::NAMES, parts);
        Ok(Acquired {
            fence: r.uint("fence")?,
            lease_end: r.int("lease_end")?,
            created: r.int("created")?,
            now: r.int("now")?,
            taken_over: r.int("taken_over")? == 1,
        })
    }
}

/// claim.lua's `{'in_progress', fence, lease_end, created, now}`.
pub(crate) struct InProgress {
    pub fence: u64,
    pub lease_end: i64,
    pub created: i64,
    pub now: i64,
}

impl InProgress {
    const NAMES: &[&str] = &["fence", "lease_end", "created", "now"];

    pub(crate) fn decode(parts: &[Value]) -> Result<Self> {
        let r = Named::new(Self::NAMES, parts);
        Ok(InProgress {
            fence: r.uint("fence")?,
            lease_end: r.int("lease_end")?,
            created: r.int("created")?,
            now: r.int("now")?,
        })
    }
}

/// claim.lua's `{'unchecked', fence, created, hz}`: an expired record whose
/// creating claim may not have finished its horizon check (`hz`: that
/// claim's `sent_at`).
pub(crate) struct Unchecked {
    pub fence: u64,
    pub created: i64,
    pub hz: String,
}

impl Unchecked {
    const NAMES: &[&str] = &["fence", "created", "hz"];

    pub(crate) fn decode(parts: &[Value]) -> Result<Self> {
        let r = Named::new(Self::NAMES, parts);
        Ok(Unchecked {
            fence: r.uint("fence")?,
            created: r.int("created")?,
            hz: r.text("hz").unwrap_or_default(),
        })
    }
}

/// fenced.lua's `{'ok', now, until}`: `until` is the new lease end of a
/// renewal, the retention end of a completion or release.
pub(crate) struct Written {
    pub until: i64,
}

impl Written {
    const NAMES: &[&str] = &["now", "until"];

    pub(crate) fn decode(parts: &[Value]) -> Result<Self> {
        Ok(Written {
            until: Named::new(Self::NAMES, parts).int("until")?,
        })
    }
}

/// prune.lua's `{'due', key, created}`: a record prune may delete, the
/// effect key it stores and its creation time.
pub(crate) struct Due {
    pub key: String,
    pub created: i64,
}

impl Due {
    const NAMES: &[&str] = &["key", "created"];

    pub(crate) fn decode(parts: &[Value]) -> Result<Self> {
        let r = Named::new(Self::NAMES, parts);
        Ok(Due {
            key: r.text("key").unwrap_or_default(),
            created: r.int("created")?,
        })
    }
}

/// The lease of claim.lua's `acquired` reply ([`Acquired`]).
pub(crate) fn grant(key: &EffectKey, at_most_once: bool, parts: &[Value]) -> Result<Lease> {
    let a = Acquired::decode(parts)?;
    Ok(Grant {
        key: key.clone(),
        fence: a.fence,
        expires_at: from_micros(a.lease_end),
        first_claimed_at: from_micros(a.created),
        acquired_at: from_micros(a.now),
        taken_over: a.taken_over,
        at_most_once,
    }
    .into_lease())
}

/// claim.lua's `in_progress` reply ([`InProgress`]) as the claim's answer.
pub(crate) fn in_progress(parts: &[Value]) -> Result<Claim> {
    let p = InProgress::decode(parts)?;
    Ok(Claim::InProgress {
        fence: p.fence,
        expires_at: from_micros(p.lease_end),
        first_claimed_at: from_micros(p.created),
        read_at: from_micros(p.now),
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

/// The record a plain read found (`RedisLedger::plain_answer`): the replies
/// of `TIME` and of `HMGET` of [`FIELDS`], in that order. `None` when there
/// is no record, or anything the claim script would refuse or report as
/// corrupt (its own `load` checks, restated: a record format, the key it
/// belongs to, a known state, a fence below 2^53): the script then says
/// what is wrong.
pub(crate) fn plain_record(rkey: &str, key: &EffectKey, replies: Vec<Value>) -> Option<Record> {
    // A server error in either place (a key of another type) comes back as
    // a value: not a record.
    let [Value::Array(time), fields] = <[Value; 2]>::try_from(replies).ok()? else {
        return None;
    };
    let Value::Array(values) = &fields else {
        return None;
    };
    let part = |v: Option<&Value>| text(v?)?.parse::<i64>().ok();
    let now = part(time.first())?
        .checked_mul(1_000_000)?
        .checked_add(part(time.get(1))?)?;
    let format = values.first().and_then(text);
    if !matches!(format.as_deref(), Some("1" | "2")) {
        return None;
    }
    let record = record(rkey, Some(key), &[Value::Nil, Value::Int(now), fields]).ok()?;
    (record.fence < 1 << 53).then_some(record)
}

/// Builds a record from a script's `{'record', now, fields}` reply, the
/// fields in the order of [`FIELDS`]. A field that does not parse means the
/// hash is not oncely's: [`Error::Corrupt`].
pub(crate) fn record(rkey: &str, expected: Option<&EffectKey>, parts: &[Value]) -> Result<Record> {
    let bad = |what: &str| Error::Corrupt {
        backend: BACKEND,
        message: format!("{rkey}: {what}"),
    };
    let reply = Named::new(&["now", "fields"], parts);
    let now = from_micros(reply.int("now")?);
    let Some(Value::Array(values)) = reply.value("fields") else {
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

    /// Each reply struct reads the values of its script's `return { tag, … }`
    /// line by name; a reply short of a value fails rather than reading
    /// another.
    #[test]
    fn replies_are_read_by_name() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let acquired = [
            bulk("acquired"),
            Value::Int(7),
            Value::Int(30),
            Value::Int(10),
            Value::Int(20),
            Value::Int(1),
        ];
        let a = Acquired::decode(&acquired).unwrap();
        assert_eq!(
            (a.fence, a.lease_end, a.created, a.now, a.taken_over),
            (7, 30, 10, 20, true)
        );
        let unchecked = [bulk("unchecked"), bulk("3"), Value::Int(5), bulk("4")];
        let u = Unchecked::decode(&unchecked).unwrap();
        assert_eq!((u.fence, u.created, u.hz.as_str()), (3, 5, "4"));
        let due = [bulk("due"), bulk("acme/capture:1"), Value::Int(9)];
        let d = Due::decode(&due).unwrap();
        assert_eq!((d.key.as_str(), d.created), ("acme/capture:1", 9));
        assert_eq!(
            Written::decode(&[bulk("ok"), Value::Int(1), Value::Int(2)])
                .unwrap()
                .until,
            2
        );
        assert!(InProgress::decode(&[bulk("in_progress"), Value::Int(1), Value::Int(2)]).is_err());
        assert!(corrupt_horizon(&[bulk("corrupt"), bulk("bad"), bulk("horizon")]));
        assert!(!corrupt_horizon(&[bulk("corrupt"), bulk("bad")]));
    }

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
