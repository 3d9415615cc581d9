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

/// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash tag
/// (what the first `{…}` holds, if not empty) or of the whole key, modulo
/// 16384. A batch groups its keys by it: the keys of one script call must
/// share a slot.
pub(crate) fn slot(rkey: &str) -> u16 {
    let bytes = rkey.as_bytes();
    let hashed = match bytes.iter().position(|&b| b == b'{') {
        Some(open) => match bytes[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
            _ => bytes,
        },
        None => bytes,
    };
    crc16(hashed) % 16384
}

/// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0), as Redis
/// Cluster hashes keys.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
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

    /// The slots Redis Cluster gives these keys (`CLUSTER KEYSLOT`).
    #[test]
    fn slots_are_redis_clusters() {
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        assert_eq!(slot("{foo}.bar"), 12182);
        assert_eq!(slot("x{foo}{bar}"), 12182);
        // An empty tag hashes the whole key.
        assert_eq!(slot("{}foo"), crc16(b"{}foo") % 16384);
        let k = EffectKey::new(&Tenant::new("acme").unwrap(), "capture", "}{x}").unwrap();
        let rkey = record_key("oncely:", &k);
        let tag = &blake3::hash(b"acme/capture:}{x}").to_hex()[..TAG_HEX];
        assert_eq!(slot(&rkey), crc16(tag.as_bytes()) % 16384);
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
