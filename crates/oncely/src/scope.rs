//! Where an operator listing's records lie among a ledger's keys: a
//! listing scoped to a tenant (and kind) reads a range of the key's index,
//! not the whole table.

use crate::key::Tenant;

/// The keys a listing of `tenant`, `kind` and `subject`
/// ([`RecordQuery`](crate::admin::RecordQuery)) can match, in the keys'
/// byte order (`tenant/kind:subject`). A backend still compares the
/// tenant, kind and subject columns it is given: the range only narrows
/// the read (a kind's prefix also holds kinds that extend it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRange {
    /// No tenant: any key.
    All,
    /// Tenant, kind and subject: that one key.
    Key(String),
    /// The keys from `start` (included) to `end` (excluded): the ones
    /// beginning with `tenant/` or `tenant/kind:`.
    Prefix {
        /// The prefix itself, the range's first key.
        start: String,
        /// The prefix with its last byte (an ASCII `/` or `:`) raised by one.
        end: String,
    },
}

/// The [`KeyRange`] of a listing of `tenant`, `kind` and `subject`.
pub fn key_range(tenant: Option<&Tenant>, kind: Option<&str>, subject: Option<&str>) -> KeyRange {
    match (tenant, kind, subject) {
        (Some(t), Some(k), Some(s)) => KeyRange::Key(format!("{t}/{k}:{s}")),
        (Some(t), k, _) => {
            let (start, end) = match k {
                Some(k) => (format!("{t}/{k}:"), format!("{t}/{k};")),
                None => (format!("{t}/"), format!("{t}0")),
            };
            KeyRange::Prefix { start, end }
        }
        (None, ..) => KeyRange::All,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_or_kind_is_a_prefix_range_and_all_three_are_one_key() {
        let t = Tenant::new("acme").unwrap();
        assert_eq!(key_range(None, Some("capture"), None), KeyRange::All);
        assert_eq!(
            key_range(Some(&t), None, Some("order-1")),
            KeyRange::Prefix {
                start: "acme/".into(),
                end: "acme0".into()
            }
        );
        assert_eq!(
            key_range(Some(&t), Some("capture"), None),
            KeyRange::Prefix {
                start: "acme/capture:".into(),
                end: "acme/capture;".into()
            }
        );
        assert_eq!(
            key_range(Some(&t), Some("capture"), Some("order-1")),
            KeyRange::Key("acme/capture:order-1".into())
        );
        // The next byte after the separator bounds the prefix.
        assert_eq!(b'/' + 1, b'0');
        assert_eq!(b':' + 1, b';');
    }
}
