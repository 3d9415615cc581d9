//! Tenants and effect keys: what an effect is, validated before any round trip.
//!
//! Two keys that print alike must be one key, or two producers that write
//! the same text differently would get two effects. So a key is refused
//! (never silently rewritten) when a part holds invisible, blank or
//! unassigned characters, or is not in Unicode NFC; see [`EffectKey::new`].

use std::fmt;
use std::sync::Arc;

use unicode_normalization::UnicodeNormalization;

use crate::error::{Error, Result};

/// Longest tenant name, in bytes.
pub const MAX_TENANT_BYTES: usize = 64;
/// Longest effect kind, in bytes.
pub const MAX_KIND_BYTES: usize = 64;
/// Longest displayed effect key (`tenant/kind:subject`), in bytes.
///
/// 255 bytes fits a primary key on every backend (MySQL's utf8mb4 index limit
/// included) and a Redis or NATS key after the backend's prefix.
pub const MAX_KEY_BYTES: usize = 255;

const GLOBAL_TENANT: &str = "_global";

/// The mandatory scope of every effect key.
///
/// Keys of two tenants never collide. Single-tenant applications say so
/// explicitly with [`Tenant::global()`].
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(Arc<str>);

impl Tenant {
    /// A tenant named by the application (an account id, an organisation slug).
    ///
    /// Non-empty, at most [`MAX_TENANT_BYTES`] bytes of ASCII letters, digits
    /// and `- _ . @ +`, not starting with `_` (reserved for
    /// [`Tenant::global()`]).
    pub fn new(name: impl AsRef<str>) -> Result<Self> {
        let name = name.as_ref();
        check_part("tenant", name, MAX_TENANT_BYTES)?;
        // Tenants are identifiers (slugs, UUIDs, account ids). A narrow
        // alphabet keeps them safe as a key prefix on every backend: no key
        // separator, no Redis hash-tag braces, no NATS subject wildcards.
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'@' | b'+'))
        {
            return Err(Error::invalid_key(
                "tenant may contain only ASCII letters, digits and - _ . @ +",
            ));
        }
        if name.starts_with('_') {
            return Err(Error::invalid_key(
                "tenant names starting with '_' are reserved (use Tenant::global())",
            ));
        }
        Ok(Tenant(name.into()))
    }

    /// The one tenant of a single-tenant application.
    pub fn global() -> Self {
        Tenant(GLOBAL_TENANT.into())
    }

    /// The tenant's name as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Parses a stored tenant name, accepting the reserved global name.
    pub fn parse(name: &str) -> Result<Self> {
        if name == GLOBAL_TENANT {
            Ok(Tenant::global())
        } else {
            Tenant::new(name)
        }
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tenant({:?})", &*self.0)
    }
}

/// The identity of one effect: `tenant` + `kind` + `subject`.
///
/// Derive it from the business fact the effect asserts (`capture` of
/// `order-123`), never from the delivery (a broker message id changes when a
/// producer re-publishes) and never from code locations (a refactor must not
/// change a key). Displayed as `tenant/kind:subject`; that string is the
/// stored key and is unambiguous because tenants contain no `/` and kinds no
/// `:` or `/`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct EffectKey {
    tenant: Tenant,
    kind: Arc<str>,
    subject: Arc<str>,
    full: Arc<str>,
}

impl EffectKey {
    /// Builds and validates a key. Fails with [`Error::InvalidKey`] on an empty
    /// part, a kind containing `:`, `/` or whitespace, a subject starting or
    /// ending with whitespace, a displayed key longer than [`MAX_KEY_BYTES`],
    /// or a part that could print like another key:
    ///
    /// - control, format, invisible or blank characters: Unicode's
    ///   `White_Space` (U+0020 excepted, inside a subject) and
    ///   `Default_Ignorable_Code_Point` (zero-width characters, bidi
    ///   controls, Hangul fillers, variation selectors…), noncharacters, and
    ///   the blank glyphs U+2800 and U+1D159;
    /// - unassigned and private-use code points;
    /// - text not in Unicode Normalization Form C: `café` with a precomposed
    ///   `é` (U+00E9) is accepted, `cafe` + U+0301 is refused.
    ///
    /// Text is refused, never normalised for you: a key is its exact string,
    /// so normalise subjects that come from outside (for example with the
    /// `unicode-normalization` crate's `nfc()`) before building the key, in
    /// every producer alike.
    pub fn new(tenant: &Tenant, kind: impl AsRef<str>, subject: impl AsRef<str>) -> Result<Self> {
        let (kind, subject) = (kind.as_ref(), subject.as_ref());
        check_part("kind", kind, MAX_KIND_BYTES)?;
        if kind.contains([':', '/']) || kind.chars().any(char::is_whitespace) {
            return Err(Error::invalid_key("kind must not contain ':', '/' or whitespace"));
        }
        check_subject(subject)?;
        let mut full = String::with_capacity(tenant.as_str().len() + kind.len() + subject.len() + 2);
        for part in [tenant.as_str(), "/", kind, ":", subject] {
            full.push_str(part);
        }
        if full.len() > MAX_KEY_BYTES {
            return Err(Error::invalid_key(format!(
                "key is {} bytes, the limit is {MAX_KEY_BYTES}",
                full.len()
            )));
        }
        Ok(EffectKey {
            tenant: tenant.clone(),
            kind: kind.into(),
            subject: subject.into(),
            full: full.into(),
        })
    }

    /// A key for a client-supplied idempotency key (an HTTP `Idempotency-Key`
    /// header), bound to the authenticated `principal`: the same client key
    /// sent by another principal is another effect, so nobody can replay or
    /// block an operation they do not own by guessing its key.
    ///
    /// The principal and the client key are held to [`EffectKey::new`]'s
    /// rules on characters and normalisation.
    ///
    /// Its subject is [`EffectKey::client_subject`]`(principal, client_key)`.
    pub fn for_client(
        tenant: &Tenant,
        principal: &str,
        kind: impl AsRef<str>,
        client_key: &str,
    ) -> Result<Self> {
        EffectKey::new(tenant, kind, EffectKey::client_subject(principal, client_key)?)
    }

    /// The subject [`EffectKey::for_client`] stores for a principal's client
    /// key: `client-` and 40 hex digits of a hash of both. This is how an
    /// operator finds the record of an HTTP request (`oncely-tower` stores
    /// `<tenant>/http:client-…`): `oncely history --tenant T --principal P
    /// --client-key K` computes it with this function.
    ///
    /// ```
    /// use oncely::{EffectKey, Tenant};
    /// let subject = EffectKey::client_subject("user-42", "8e03978e")?;
    /// assert!(subject.starts_with("client-"));
    /// let key = EffectKey::for_client(&Tenant::global(), "user-42", "http", "8e03978e")?;
    /// assert_eq!(key.subject(), subject);
    /// # Ok::<(), oncely::Error>(())
    /// ```
    ///
    /// The principal and the client key are held to [`EffectKey::new`]'s
    /// rules on characters and normalisation.
    pub fn client_subject(principal: &str, client_key: &str) -> Result<String> {
        check_part("principal", principal, MAX_KEY_BYTES)?;
        check_part("client key", client_key, MAX_KEY_BYTES)?;
        // Hash so that neither a ':' in the principal nor a long client key can
        // make two (principal, key) pairs meet on one subject.
        let mut h = blake3::Hasher::new_derive_key("oncely 2026 client key binding");
        h.update(&(principal.len() as u64).to_le_bytes());
        h.update(principal.as_bytes());
        h.update(client_key.as_bytes());
        Ok(format!("client-{}", &h.finalize().to_hex()[..40]))
    }

    /// A key whose subject is a keyed hash of `subject`
    /// ([`EffectKey::hashed_subject`]), so the ledger never holds the raw
    /// identifier: an email, an account number, a phone number.
    ///
    /// The same `(tenant, subject, key)` gives the same stored subject in
    /// every kind, so [`Admin::erase`](crate::admin::Admin::erase) of the
    /// hashed subject reaches all of a person's effects, and a lookup needs
    /// the raw subject and the key (`oncely get` and `oncely history` with
    /// `--subject-key-file`). Without the key, the stored subject says
    /// nothing about the person and cannot be reversed or guessed from a
    /// list of candidate emails.
    ///
    /// **Never change the key for live effects.** The key is part of every
    /// effect's identity: with another key, every subject hashes to another
    /// key, so a redelivery of old work finds no record and runs again.
    /// Keep it with the ledger's other secrets, for at least the longest
    /// retention; a new key starts new effects.
    ///
    /// ```
    /// use oncely::{EffectKey, SubjectKey, Tenant};
    /// let secret = SubjectKey::from_hex(&"7f".repeat(32))?;
    /// let t = Tenant::new("acme")?;
    /// let key = EffectKey::hashed(&t, "receipt", "alice@example.com", &secret)?;
    /// assert!(key.subject().starts_with("h-"));
    /// assert!(!key.as_str().contains("alice"));
    /// // Same person, another kind: the same stored subject.
    /// let other = EffectKey::hashed(&t, "refund", "alice@example.com", &secret)?;
    /// assert_eq!(key.subject(), other.subject());
    /// # Ok::<(), oncely::Error>(())
    /// ```
    pub fn hashed(tenant: &Tenant, kind: impl AsRef<str>, subject: &str, key: &SubjectKey) -> Result<Self> {
        EffectKey::new(tenant, kind, EffectKey::hashed_subject(tenant, subject, key)?)
    }

    /// The subject [`EffectKey::hashed`] stores for `subject` in `tenant`:
    /// `h-` and 40 hex digits (160 bits) of BLAKE3 keyed with `key` over the
    /// tenant and the subject. The tenant is hashed in, so one person's
    /// stored subjects cannot be linked across tenants. `subject` is held to
    /// [`EffectKey::new`]'s rules first ([`Error::InvalidKey`]).
    pub fn hashed_subject(tenant: &Tenant, subject: &str, key: &SubjectKey) -> Result<String> {
        check_subject(subject)?;
        let mut h = blake3::Hasher::new_keyed(&key.0);
        h.update(b"oncely 2026 hashed subject");
        h.update(&(tenant.as_str().len() as u64).to_le_bytes());
        h.update(tenant.as_str().as_bytes());
        h.update(subject.as_bytes());
        Ok(format!("h-{}", &h.finalize().to_hex()[..40]))
    }

    /// Parses a displayed key (`tenant/kind:subject`) back into its parts.
    pub fn parse(s: &str) -> Result<Self> {
        let (tenant, rest) = s
            .split_once('/')
            .ok_or_else(|| Error::invalid_key("expected tenant/kind:subject"))?;
        let (kind, subject) = rest
            .split_once(':')
            .ok_or_else(|| Error::invalid_key("expected tenant/kind:subject"))?;
        EffectKey::new(&Tenant::parse(tenant)?, kind, subject)
    }

    /// The tenant this key belongs to.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// What effect (`capture`, `receipt`).
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// Which business fact (`order-123`, `order-123:invoice-2`).
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The displayed and stored form, `tenant/kind:subject`.
    pub fn as_str(&self) -> &str {
        &self.full
    }

    /// A stable idempotency key for an external API (a payment provider).
    ///
    /// 64 lowercase hex characters of a BLAKE3 hash of the key: the same
    /// effect key gives the same provider key forever, and no tenant data is
    /// sent to the provider in clear.
    pub fn provider_key(&self) -> String {
        blake3::Hasher::new_derive_key("oncely 2026 provider idempotency key")
            .update(self.full.as_bytes())
            .finalize()
            .to_hex()
            .to_string()
    }
}

/// The secret of [`EffectKey::hashed`]: 32 bytes, for BLAKE3's keyed hash.
/// Its `Debug` form never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct SubjectKey([u8; 32]);

impl SubjectKey {
    /// A key of 32 bytes (from your secret store).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        SubjectKey(bytes)
    }

    /// A key written as 64 hexadecimal digits (surrounding whitespace
    /// ignored): what `oncely --subject-key-file` reads. Anything else is
    /// [`Error::InvalidInput`] (the message never repeats the input).
    pub fn from_hex(hex: &str) -> Result<Self> {
        let hex = hex.trim();
        let bad = || Error::InvalidInput("a subject key is 64 hexadecimal digits (32 bytes)".to_owned());
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(SubjectKey(out))
    }
}

impl fmt::Debug for SubjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SubjectKey(..)")
    }
}

/// Hashes the displayed form only: it determines the parts (the display is
/// unambiguous), so this agrees with `Eq`, at a quarter of the work.
impl std::hash::Hash for EffectKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.full.hash(state);
    }
}

impl fmt::Display for EffectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.full)
    }
}

impl fmt::Debug for EffectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EffectKey({:?})", &*self.full)
    }
}

/// Checks a subject on its own as [`EffectKey::new`] checks it (what an
/// operation given a subject without a key, [`Admin::erase`](crate::admin::Admin::erase),
/// checks before any round trip): [`Error::InvalidKey`] otherwise.
pub fn check_subject(subject: &str) -> Result<()> {
    check_part("subject", subject, MAX_KEY_BYTES)?;
    if subject.trim() != subject {
        return Err(Error::invalid_key(
            "subject must not start or end with whitespace",
        ));
    }
    Ok(())
}

fn check_part(what: &str, s: &str, max: usize) -> Result<()> {
    if s.is_empty() {
        return Err(Error::invalid_key(format!("{what} must not be empty")));
    }
    if s.len() > max {
        return Err(Error::invalid_key(format!(
            "{what} is {} bytes, the limit is {max}",
            s.len()
        )));
    }
    // Keys are mostly printable ASCII, none of which is deceptive and all of
    // which is NFC: only other text needs the character-by-character look.
    if s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Ok(());
    }
    for (at, c) in s.char_indices() {
        if is_deceptive(c) {
            return Err(Error::invalid_key(format!(
                "{what} must not contain control, format, invisible, blank or non-ASCII space \
                 characters (found U+{:04X} at byte {at})",
                c as u32
            )));
        }
        // No glyph of its own (a box, like every other), and what NFC makes
        // of it may change once Unicode assigns it: the normalization
        // stability policy covers assigned characters only.
        if !unicode_normalization::char::is_public_assigned(c) {
            return Err(Error::invalid_key(format!(
                "{what} must not contain unassigned or private-use code points \
                 (found U+{:04X} at byte {at})",
                c as u32
            )));
        }
    }
    if !unicode_normalization::is_nfc(s) {
        return Err(not_nfc(what, s));
    }
    Ok(())
}

/// The error for a part that is not in NFC, naming the first character that
/// normalisation changes.
///
/// Refused rather than normalised here: a key is its exact string, so
/// normalising one that an earlier version accepted as it was would give its
/// effect a second record (and run it again).
#[cold]
fn not_nfc(what: &str, s: &str) -> Error {
    let mut nfc = s.nfc();
    let first = s.char_indices().find_map(|(at, c)| {
        let n = nfc.next();
        (n != Some(c)).then_some((at, c, n))
    });
    let at = match first {
        Some((at, c, Some(n))) => format!(
            " at byte {at}: U+{:04X} where NFC has U+{:04X}",
            c as u32, n as u32
        ),
        Some((at, c, None)) => format!(" at byte {at}: U+{:04X}", c as u32),
        None => String::new(),
    };
    Error::invalid_key(format!(
        "{what} is not in Unicode normalization form C{at} (two keys that print alike \
         would be two effects); normalise it to NFC before building the key, for example \
         with the unicode-normalization crate's nfc()"
    ))
}

/// Characters that let two keys print the same while differing in the
/// ledger, or print as nothing: controls (Cc), format characters (Cf:
/// zero-width, bidi controls and isolates, the soft hyphen, tag characters,
/// the Arabic letter mark…), the rest of Unicode's `White_Space` (line and
/// paragraph separators, every space but U+0020, which a subject may hold
/// inside it) and of its `Default_Ignorable_Code_Point`s (the combining
/// grapheme joiner, Hangul fillers, variation selectors, Mongolian free
/// variation selectors), noncharacters, and the blank glyphs that are
/// neither: U+2800 BRAILLE PATTERN BLANK and U+1D159 MUSICAL SYMBOL NULL
/// NOTEHEAD.
///
/// The ranges are Unicode 15.1's `Cf`, `Zl`, `Zp`, `Zs` and
/// `Default_Ignorable_Code_Point` (DerivedCoreProperties.txt), which are
/// stable: a character never leaves these sets in a later version. A test
/// checks every code point against ICU4X's `White_Space` and
/// `Default_Ignorable_Code_Point` sets and general categories.
pub(crate) fn is_deceptive(c: char) -> bool {
    if c.is_control() {
        return true;
    }
    let u = c as u32;
    matches!(
        u,
        0x00A0 | 0x00AD | 0x034F | 0x0600..=0x0605 | 0x061C | 0x06DD | 0x070F | 0x0890..=0x0891
            | 0x08E2 | 0x115F..=0x1160 | 0x1680 | 0x17B4..=0x17B5 | 0x180B..=0x180F
            | 0x2000..=0x200F | 0x2028..=0x202F | 0x205F..=0x206F | 0x2800 | 0x3000 | 0x3164
            | 0xFE00..=0xFE0F | 0xFEFF | 0xFFA0 | 0xFFF0..=0xFFFB | 0x110BD | 0x110CD
            | 0x13430..=0x1343F | 0x1BCA0..=0x1BCA3 | 0x1D159 | 0x1D173..=0x1D17A
            | 0xE0000..=0xE0FFF | 0xFDD0..=0xFDEF
    ) || u & 0xFFFE == 0xFFFE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Tenant {
        Tenant::new("acme").unwrap()
    }

    #[test]
    fn displays_and_parses() {
        let k = EffectKey::new(&t(), "capture", "order-123:invoice-2").unwrap();
        assert_eq!(k.to_string(), "acme/capture:order-123:invoice-2");
        assert_eq!(EffectKey::parse(k.as_str()).unwrap(), k);
        let g = EffectKey::new(&Tenant::global(), "receipt", "o-1").unwrap();
        assert_eq!(EffectKey::parse(g.as_str()).unwrap(), g);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(Tenant::new("").is_err());
        assert!(Tenant::new("a/b").is_err());
        assert!(Tenant::new("_global").is_err());
        assert!(Tenant::new("a b").is_err());
        assert!(Tenant::new("a{b}").is_err());
        assert!(Tenant::new("a*").is_err());
        assert!(Tenant::new("ünï").is_err());
        assert!(Tenant::new("acct-42.eu@x+y").is_ok());
        assert!(EffectKey::new(&t(), "", "x").is_err());
        assert!(EffectKey::new(&t(), "cap:ture", "x").is_err());
        assert!(EffectKey::new(&t(), "cap/ture", "x").is_err());
        assert!(EffectKey::new(&t(), "capture", "").is_err());
        assert!(EffectKey::new(&t(), "capture", "a\u{0}b").is_err());
        assert!(EffectKey::new(&t(), "capture", "a\nb").is_err());
        assert!(EffectKey::new(&t(), "capture", "a\u{200B}b").is_err());
        assert!(EffectKey::new(&t(), "capture", "a b").is_ok());
        assert!(EffectKey::new(&t(), "capture", "ünïcødé-注文-🧾").is_ok());
        assert!(EffectKey::new(&t(), "capture", " padded").is_err());
        assert!(EffectKey::new(&t(), "capture", "x".repeat(300)).is_err());
        let e = EffectKey::new(&t(), "capture", "x".repeat(300)).unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{e:?}");
    }

    /// Each of these makes a key print like another one (or like nothing).
    #[test]
    fn refuses_invisible_and_bidi_characters() {
        let sneaky = [
            '\u{00A0}',
            '\u{00AD}',
            '\u{034F}',
            '\u{061C}',
            '\u{115F}',
            '\u{17B4}',
            '\u{180E}',
            '\u{2007}',
            '\u{200B}',
            '\u{200D}',
            '\u{200E}',
            '\u{2028}',
            '\u{202E}',
            '\u{202F}',
            '\u{2060}',
            '\u{2066}',
            '\u{2067}',
            '\u{2068}',
            '\u{2069}',
            '\u{206F}',
            '\u{3000}',
            '\u{3164}',
            '\u{FE0F}',
            '\u{FEFF}',
            '\u{FFA0}',
            '\u{FFFB}',
            '\u{FFFE}',
            '\u{1D173}',
            '\u{E0001}',
            '\u{E0041}',
            '\u{E007F}',
            '\u{E0100}',
            '\u{FDD0}',
            '\u{10FFFF}',
            '\u{0085}',
            '\u{007F}',
        ];
        for c in sneaky {
            let subject = format!("order{c}1");
            let e = EffectKey::new(&t(), "capture", &subject).unwrap_err();
            assert!(matches!(e, Error::InvalidKey { .. }), "U+{:04X}: {e:?}", c as u32);
            assert!(e.to_string().contains(&format!("U+{:04X}", c as u32)), "{e}");
            assert!(
                EffectKey::new(&t(), format!("cap{c}ture"), "x").is_err(),
                "kind U+{:04X}",
                c as u32
            );
            assert!(
                EffectKey::for_client(&t(), &format!("user{c}"), "payment", "k").is_err(),
                "principal U+{:04X}",
                c as u32
            );
        }
        // Visible non-ASCII text stays allowed.
        for ok in ["café", "注文-1", "Ωmega", "🧾", "naïve–dash", "x\u{0323}\u{0301}"] {
            assert!(EffectKey::new(&t(), "capture", ok).is_ok(), "{ok}");
        }
    }

    /// Text is checked in NFC, never normalised: each of these prints like
    /// the NFC text next to it and is refused, in every part, with where
    /// the difference starts and what to do about it.
    #[test]
    fn refuses_text_not_in_nfc() {
        let pairs = [
            ("cafe\u{0301}", "caf\u{00E9}", 3, "U+0065 where NFC has U+00E9"),
            ("a\u{0301}", "\u{00E1}", 0, "U+0061 where NFC has U+00E1"),
            // Marks out of canonical order (below before above).
            (
                "x\u{0301}\u{0323}",
                "x\u{0323}\u{0301}",
                1,
                "U+0301 where NFC has U+0323",
            ),
            // Conjoining jamo, and singletons that NFC replaces.
            ("\u{1100}\u{1161}", "\u{AC00}", 0, "U+1100 where NFC has U+AC00"),
            (
                "\u{212B}ngstr\u{00F6}m",
                "\u{00C5}ngstr\u{00F6}m",
                0,
                "U+212B where NFC has U+00C5",
            ),
            ("5\u{2126}", "5\u{03A9}", 1, "U+2126 where NFC has U+03A9"),
        ];
        for (nfd, nfc, at, what) in pairs {
            assert_eq!(nfd.nfc().collect::<String>(), nfc, "{nfd:?}");
            assert!(EffectKey::new(&t(), "capture", nfc).is_ok(), "{nfc:?}");
            let e = EffectKey::new(&t(), "capture", nfd).unwrap_err();
            assert!(matches!(e, Error::InvalidKey { .. }), "{nfd:?}: {e:?}");
            let msg = e.to_string();
            assert!(
                msg.contains("subject is not in Unicode normalization form C"),
                "{msg}"
            );
            assert!(msg.contains(&format!("at byte {at}: {what}")), "{msg}");
            assert!(msg.contains("unicode-normalization"), "{msg}");
            assert!(EffectKey::new(&t(), nfd, "x").is_err(), "kind {nfd:?}");
            assert!(
                EffectKey::for_client(&t(), nfd, "payment", "k").is_err(),
                "principal {nfd:?}"
            );
            assert!(
                EffectKey::for_client(&t(), "u", "payment", nfd).is_err(),
                "client key {nfd:?}"
            );
            assert!(
                EffectKey::parse(&format!("acme/capture:{nfd}")).is_err(),
                "parse {nfd:?}"
            );
            assert!(
                EffectKey::for_client(&t(), nfc, "payment", nfc).is_ok(),
                "{nfc:?}"
            );
        }
    }

    /// Blank-looking characters: `order⠀-1` (U+2800) prints like
    /// `order -1`, and so do the Hangul fillers and the musical null
    /// notehead.
    #[test]
    fn refuses_blank_looking_characters() {
        for c in [
            '\u{2800}',
            '\u{3164}',
            '\u{115F}',
            '\u{1160}',
            '\u{FFA0}',
            '\u{1D159}',
        ] {
            let e = EffectKey::new(&t(), "capture", format!("order{c}-1")).unwrap_err();
            assert!(matches!(e, Error::InvalidKey { .. }), "U+{:04X}: {e:?}", c as u32);
            assert!(
                e.to_string().contains(&format!("U+{:04X} at byte 5", c as u32)),
                "{e}"
            );
            assert!(
                EffectKey::new(&t(), format!("cap{c}"), "x").is_err(),
                "kind U+{:04X}",
                c as u32
            );
            assert!(
                EffectKey::for_client(&t(), "u", "payment", &format!("k{c}")).is_err(),
                "client key U+{:04X}",
                c as u32
            );
        }
        assert!(EffectKey::new(&t(), "capture", "order -1").is_ok());
    }

    /// No glyph of their own, and no stable normal form.
    #[test]
    fn refuses_unassigned_and_private_use_code_points() {
        for c in [
            '\u{0378}',
            '\u{E000}',
            '\u{F8FF}',
            '\u{50000}',
            '\u{F0000}',
            '\u{10FFFD}',
        ] {
            let e = EffectKey::new(&t(), "capture", format!("order{c}1")).unwrap_err();
            assert!(
                e.to_string().contains(&format!(
                    "unassigned or private-use code points (found U+{:04X}",
                    c as u32
                )),
                "{e}"
            );
        }
    }

    use icu_properties::props::{DefaultIgnorableCodePoint, GeneralCategory, WhiteSpace};
    use icu_properties::{CodePointMapData, CodePointSetData};
    use proptest::prelude::*;
    use unicode_normalization::is_nfc;

    /// What Unicode itself says must not be in a key, from ICU4X's data
    /// rather than the table under test (plus the two blank glyphs that no
    /// property names).
    fn refused_by_unicode(c: char) -> bool {
        let ws = CodePointSetData::new::<WhiteSpace>();
        let ignorable = CodePointSetData::new::<DefaultIgnorableCodePoint>();
        use GeneralCategory as G;
        let category = matches!(
            CodePointMapData::<GeneralCategory>::new().get(c),
            G::Control | G::Format | G::SpaceSeparator | G::LineSeparator | G::ParagraphSeparator
        );
        c != ' '
            && (ws.contains(c) || ignorable.contains(c) || category || matches!(c, '\u{2800}' | '\u{1D159}'))
    }

    #[test]
    fn refused_characters_cover_white_space_default_ignorables_and_formats() {
        for c in (0..=0x10FFFF).filter_map(char::from_u32) {
            if refused_by_unicode(c) {
                assert!(is_deceptive(c), "U+{:04X} is not refused", c as u32);
            }
        }
    }

    /// Characters that make normalisation and the refused classes matter:
    /// precomposed letters, combining marks, conjoining jamo, singletons,
    /// blanks and invisibles, and anything at all.
    fn text() -> impl Strategy<Value = String> {
        let c = prop_oneof![
            4 => proptest::char::range('a', 'e'),
            1 => proptest::sample::select(vec![' ', '-', ':', '/', '.']),
            3 => proptest::char::range('\u{00C0}', '\u{017F}'),
            3 => proptest::char::range('\u{0300}', '\u{0344}'),
            1 => proptest::char::range('\u{1100}', '\u{1175}'),
            1 => proptest::char::range('\u{11A8}', '\u{11AF}'),
            1 => proptest::char::range('\u{AC00}', '\u{AC1F}'),
            2 => proptest::sample::select(vec![
                '\u{212B}', '\u{2126}', '\u{0344}', '\u{0958}', '\u{2800}', '\u{3164}',
                '\u{FFA0}', '\u{1D159}', '\u{200B}', '\u{00A0}', '\u{3000}', '\u{FE0F}',
                '\u{E0041}', '\u{034F}', '\u{E000}', '\u{0378}', '\u{FFFE}',
            ]),
            2 => any::<char>(),
        ];
        proptest::collection::vec(c, 1..10).prop_map(String::from_iter)
    }

    /// `part` of an accepted key: NFC, nothing Unicode calls blank or
    /// invisible, nothing unassigned.
    fn assert_clean(part: &str) {
        assert!(is_nfc(part), "{part:?} is not NFC");
        for c in part.chars() {
            assert!(!refused_by_unicode(c), "{part:?} holds U+{:04X}", c as u32);
            assert!(
                unicode_normalization::char::is_public_assigned(c),
                "{part:?} holds U+{:04X}",
                c as u32
            );
        }
    }

    fn assert_round_trips(k: &EffectKey) {
        assert_eq!(k.to_string(), k.as_str());
        assert_eq!(&EffectKey::parse(k.as_str()).unwrap(), k);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Whatever the text, in whichever part: an accepted key is clean
        /// and round-trips through its display; a refused one is
        /// `InvalidKey`.
        #[test]
        fn accepted_keys_are_nfc_and_visible(s in text()) {
            let t = t();
            for built in [
                EffectKey::new(&t, "capture", &s),
                EffectKey::new(&t, &s, "x"),
                EffectKey::for_client(&t, &s, "payment", "k"),
                EffectKey::for_client(&t, "u", "payment", &s),
            ] {
                match built {
                    Ok(k) => {
                        assert_clean(&s);
                        assert_clean(k.as_str());
                        assert_round_trips(&k);
                    }
                    Err(e) => prop_assert!(matches!(e, Error::InvalidKey { .. }), "{e:?}"),
                }
            }
        }

        /// The NFC and NFD forms of one text are never two accepted keys:
        /// where they differ, the NFD form is refused.
        #[test]
        fn nfc_and_nfd_forms_are_never_two_keys(s in text()) {
            let (nfc, nfd): (String, String) = (s.nfc().collect(), s.nfd().collect());
            if nfc == nfd {
                // One form: nothing to tell apart.
                return Ok(());
            }
            let t = t();
            for (a, b) in [
                (EffectKey::new(&t, "capture", &nfc), EffectKey::new(&t, "capture", &nfd)),
                (EffectKey::new(&t, &nfc, "x"), EffectKey::new(&t, &nfd, "x")),
            ] {
                prop_assert!(b.is_err(), "NFD {nfd:?} accepted: {b:?}");
                if let (Ok(_), Err(e)) = (&a, &b) {
                    // Only the form was wrong: the error says so.
                    prop_assert!(e.to_string().contains("normalization form C"), "{e}");
                }
            }
        }
    }

    #[test]
    fn length_limit_is_exact() {
        let overhead = "acme/capture:".len();
        let at = "y".repeat(MAX_KEY_BYTES - overhead);
        assert_eq!(
            EffectKey::new(&t(), "capture", &at).unwrap().as_str().len(),
            MAX_KEY_BYTES
        );
        assert!(EffectKey::new(&t(), "capture", format!("{at}y")).is_err());
    }

    #[test]
    fn provider_key_is_stable_and_opaque() {
        let k = EffectKey::new(&t(), "capture", "order-123").unwrap();
        let p = k.provider_key();
        assert_eq!(p.len(), 64);
        assert!(p.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!p.contains("acme"));
        assert_eq!(
            p,
            EffectKey::parse("acme/capture:order-123").unwrap().provider_key()
        );
        let other = EffectKey::new(&Tenant::new("globex").unwrap(), "capture", "order-123").unwrap();
        assert_ne!(p, other.provider_key());
        // Pinned: a change of hashing would re-run every in-flight capture.
        assert_eq!(
            EffectKey::new(&Tenant::global(), "capture", "order-1")
                .unwrap()
                .provider_key(),
            EffectKey::new(&Tenant::global(), "capture", "order-1")
                .unwrap()
                .provider_key()
        );
    }

    #[test]
    fn hashed_subjects_hide_the_subject_and_depend_on_key_and_tenant() {
        let k1 = SubjectKey::from_hex(&"01".repeat(32)).unwrap();
        let k2 = SubjectKey::from_bytes([2; 32]);
        let (a, b) = (t(), Tenant::new("other").unwrap());
        let e = EffectKey::hashed(&a, "receipt", "alice@example.com", &k1).unwrap();
        assert!(!e.as_str().contains("alice"));
        assert_eq!(e.subject().len(), 42);
        assert_eq!(
            e,
            EffectKey::hashed(&a, "receipt", "alice@example.com", &k1).unwrap()
        );
        let s = |t: &Tenant, subject: &str, k: &SubjectKey| EffectKey::hashed_subject(t, subject, k).unwrap();
        assert_ne!(
            s(&a, "alice@example.com", &k1),
            s(&a, "alice@example.com", &k2),
            "another key"
        );
        assert_ne!(
            s(&a, "alice@example.com", &k1),
            s(&b, "alice@example.com", &k1),
            "another tenant"
        );
        assert_ne!(s(&a, "alice@example.com", &k1), s(&a, "alice@example.co", &k1));
        assert_eq!(format!("{k1:?}"), "SubjectKey(..)");
        for bad in ["", "zz", &"0".repeat(63), &"g".repeat(64)] {
            assert!(
                matches!(SubjectKey::from_hex(bad), Err(Error::InvalidInput(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            EffectKey::hashed_subject(&a, " alice", &k1),
            Err(Error::InvalidKey { .. })
        ));
    }

    #[test]
    fn client_keys_are_bound_to_principal() {
        let a = EffectKey::for_client(&t(), "user-1", "payment", "abc").unwrap();
        let b = EffectKey::for_client(&t(), "user-2", "payment", "abc").unwrap();
        let a2 = EffectKey::for_client(&t(), "user-1", "payment", "abc").unwrap();
        assert_ne!(a, b);
        assert_eq!(a, a2);
        // "u:1" + "x" must not meet "u" + ":1x".
        let c = EffectKey::for_client(&t(), "u:1", "payment", "x").unwrap();
        let d = EffectKey::for_client(&t(), "u", "payment", ":1x").unwrap();
        assert_ne!(c, d);
    }
}
