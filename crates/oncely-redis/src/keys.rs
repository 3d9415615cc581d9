//! Where things live in the keyspace: the key of a record, the key of a
//! horizon watermark, and the `SCAN` pattern that finds records (and never
//! a watermark).

use oncely::{EffectKey, Tenant};

/// The hash tag is this many hex digits of BLAKE3: 64 bits, so two keys
/// sharing a tag is as likely as any other slot collision and harmless.
const TAG_HEX: usize = 16;

/// What follows a horizon key's tag. A record key has `:` there, so neither
/// this ledger's `SCAN` patterns nor those of a ledger with another prefix
/// (prefixes cannot contain `{`) ever match a horizon key.
const HORIZON_INFIX: &str = "#horizon:";

/// `<prefix>{<16 hex of BLAKE3(key)>}:<tenant>/<kind>:<subject>`.
pub(crate) fn record_key(prefix: &str, key: &EffectKey) -> String {
    let tag = blake3::hash(key.as_str().as_bytes()).to_hex();
    format!("{prefix}{{{}}}:{key}", &tag[..TAG_HEX])
}

/// `<prefix>{<16 hex of BLAKE3(tenant/kind)>}#horizon:<tenant>/<kind>`.
pub(crate) fn horizon_key(prefix: &str, tenant: &Tenant, kind: &str) -> String {
    let scope = format!("{tenant}/{kind}");
    let tag = blake3::hash(scope.as_bytes()).to_hex();
    format!("{prefix}{{{}}}{HORIZON_INFIX}{scope}", &tag[..TAG_HEX])
}

/// The `SCAN MATCH` pattern of the record keys whose effect key starts with
/// `rest` (`*` for all of them, `<tenant>/*` for one tenant's).
pub(crate) fn record_pattern(prefix: &str, rest: &str) -> String {
    format!("{prefix}{{{}}}:{rest}", "?".repeat(TAG_HEX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keys_carry_a_tag_of_the_whole_key() {
        let t = Tenant::new("acme").unwrap();
        let k = EffectKey::new(&t, "capture", "}{x}").unwrap();
        let rkey = record_key("oncely:", &k);
        let tag = &blake3::hash(b"acme/capture:}{x}").to_hex()[..TAG_HEX];
        assert_eq!(rkey, format!("oncely:{{{tag}}}:acme/capture:}}{{x}}"));
        // Redis hashes the first {...}: our tag, whatever the subject holds.
        let open = rkey.find('{').unwrap();
        let close = open + rkey[open..].find('}').unwrap();
        assert_eq!(&rkey[open + 1..close], tag);
        let other = EffectKey::new(&t, "capture", "}{y}").unwrap();
        assert_ne!(record_key("oncely:", &other)[..close], rkey[..close]);
    }

    /// Horizon keys match no record pattern of any prefix: `#` stands where
    /// a record key has `:` after its tag, and prefixes cannot hold `{`.
    #[test]
    fn horizon_keys_are_not_records() {
        let t = Tenant::new("acme").unwrap();
        let hkey = horizon_key("oncely:", &t, "capture");
        let tag = &blake3::hash(b"acme/capture").to_hex()[..TAG_HEX];
        assert_eq!(hkey, format!("oncely:{{{tag}}}#horizon:acme/capture"));
        let record_like = |k: &str, prefix: &str| {
            k.strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix('{'))
                .is_some_and(|rest| {
                    rest.len() > TAG_HEX + 1 && rest.as_bytes()[TAG_HEX..TAG_HEX + 2] == *b"}:"
                })
        };
        assert!(record_like(
            &record_key("oncely:", &EffectKey::new(&t, "capture", "x").unwrap()),
            "oncely:"
        ));
        for prefix in ["oncely:", "", "oncely", "oncely:{"] {
            assert!(!record_like(&hkey, prefix), "{prefix:?}");
        }
    }
}
