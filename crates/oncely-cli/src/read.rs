//! What every operator command shares: opening the ledger a URL names
//! (with [`Admin`] when the command lists or counts), and the answer
//! ([`Read`]), which always says which ledger it came from.

use std::future::Future;

use oncely::admin::{Admin, Cursor, Filter, MAX_PAGE, RecordQuery};
use oncely::backend::Record;
use oncely::{EffectKey, Error, Result, Tenant};
use oncely_any::{Access, AnyLedger, Scheme};
use serde::{Serialize, Serializer};

use crate::time::parse_rfc3339;

/// What a command read, and the ledger it read it from, so that every
/// answer (a "no record" above all) says which ledger it is about: a URL
/// that names another table than the application's reads another ledger.
#[derive(Debug, Clone, PartialEq)]
pub struct Read<T> {
    /// The ledger, as [`AnyLedger`]'s `Display` says it (backend, server
    /// and database, table): `postgres db:5432/app, table
    /// billing.effects`. Never a credential.
    pub ledger: String,
    /// What was read.
    pub value: T,
}

impl<T> Read<T> {
    /// `f` of the value, from the same ledger.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Read<U> {
        Read {
            ledger: self.ledger,
            value: f(self.value),
        }
    }
}

/// As JSON: the value with a `ledger` field added, to the object or to each
/// object of an array (the formats the commands have always printed stay
/// as they were); any other value (`null`) as it is.
impl<T: Serialize> Serialize for Read<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut value = serde_json::to_value(&self.value).map_err(serde::ser::Error::custom)?;
        let ledger = serde_json::Value::String(self.ledger.clone());
        match &mut value {
            serde_json::Value::Object(map) => {
                map.insert("ledger".to_owned(), ledger);
            }
            serde_json::Value::Array(items) => {
                for item in items {
                    if let serde_json::Value::Object(map) = item {
                        map.insert("ledger".to_owned(), ledger.clone());
                    }
                }
            }
            _ => {}
        }
        value.serialize(serializer)
    }
}

/// Opens the ledger, runs `f` on it, closes it, and says which ledger it
/// was.
pub(crate) async fn with_ledger<T, F, Fut>(database_url: &str, access: Access, f: F) -> Result<Read<T>>
where
    F: FnOnce(AnyLedger) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let ledger = AnyLedger::open(database_url, access).await?;
    let result = f(ledger.clone()).await;
    ledger.close().await;
    Ok(Read {
        ledger: ledger.to_string(),
        value: result?,
    })
}

/// Opens a ledger and refuses, before any read, a backend without [`Admin`].
pub(crate) async fn open_admin(database_url: &str, access: Access) -> Result<AnyLedger> {
    check_admin(database_url)?;
    AnyLedger::open(database_url, access).await
}

/// [`with_ledger`] on a ledger with [`Admin`], refusing one without before
/// anything connects.
pub(crate) async fn with_admin<T, F, Fut>(database_url: &str, access: Access, f: F) -> Result<Read<T>>
where
    F: FnOnce(AnyLedger) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    check_admin(database_url)?;
    with_ledger(database_url, access, f).await
}

fn check_admin(database_url: &str) -> Result<()> {
    let scheme = Scheme::of_url(database_url)?;
    if scheme.has_admin() {
        return Ok(());
    }
    Err(Error::Config(format!(
        "this command is not available on the {} backend: it keeps no index to list or \
         count records by tenant and kind (only SQLite, PostgreSQL and MySQL ledgers offer it)",
        scheme.name()
    )))
}

/// What `stuck` and `abandoned` list: the records of one state class.
#[derive(Debug, Clone)]
pub struct Listing {
    /// One tenant, or every tenant (`None`).
    pub tenant: Option<Tenant>,
    /// Only this kind.
    pub kind: Option<String>,
    /// Only records first claimed at or after this RFC 3339 time or date.
    pub since: Option<String>,
    /// At most this many (bounded by [`MAX_PAGE`]).
    pub limit: u32,
}

/// Lists records of a class, oldest first (read-only).
pub async fn list_records(database_url: &str, filter: Filter, l: &Listing) -> Result<Read<Vec<Record>>> {
    if let Some(k) = &l.kind {
        // Validates the kind as a key would, before connecting.
        EffectKey::new(&Tenant::global(), k, "x")?;
    }
    let mut query = match &l.tenant {
        Some(t) => RecordQuery::tenant(t),
        None => RecordQuery::all_tenants(),
    }
    .filter(filter)
    .limit(l.limit.clamp(1, MAX_PAGE));
    if let Some(k) = &l.kind {
        query = query.kind(k.clone());
    }
    if let Some(since) = &l.since {
        query = query.since(parse_rfc3339(since)?);
    }
    with_admin(database_url, Access::ReadOnly, |l| async move {
        l.records(&query).await
    })
    .await
}

/// Every record `query` lists, page after page (a cursor past each full
/// page), oldest first.
pub(crate) async fn all_pages(ledger: &AnyLedger, query: RecordQuery) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    let mut after: Option<Cursor> = None;
    loop {
        let page = ledger
            .records(&query.clone().after(after).limit(MAX_PAGE))
            .await?;
        let full = page.len() == MAX_PAGE as usize;
        after = page.last().map(Cursor::after);
        out.extend(page);
        if !full {
            return Ok(out);
        }
    }
}
