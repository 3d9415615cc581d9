//! Outcome codecs: stored outcomes encrypted at rest.
//!
//! The ledger is dumped during incidents, backed up, replicated and read by
//! operators; an outcome (a charge id, an amount, an address) should not be
//! readable there by everyone who can read the table. An [`OutcomeCodec`]
//! turns each outcome into what is stored ([`OutcomeCodec::seal`]) and back
//! ([`OutcomeCodec::open`]); [`Sealed`] wraps any [`Ledger`] so that every
//! completion is sealed before it is written and every outcome read back
//! (a duplicate's [`Claim::Completed`], [`Ledger::get`]) is opened before
//! the caller sees it:
//!
//! ```
//! use std::sync::Arc;
//! use oncely::{ClaimOptions, EffectKey, Effects, MemoryLedger, Tenant};
//! use oncely::codec::{Keyring, SecretKey, Sealed};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> oncely::Result<()> {
//! // In production the key comes from a secret store, never from the code.
//! let keys = Keyring::new("k1", SecretKey::from_hex(&"42".repeat(32))?)?;
//! let effects = Effects::new(Arc::new(Sealed::new(MemoryLedger::new(), keys)));
//! let key = EffectKey::new(&Tenant::global(), "capture", "order-123")?;
//! let charge: String = effects
//!     .run(&key, &ClaimOptions::default(), |_| async { Ok("ch_1".to_owned()) })
//!     .await?;
//! assert_eq!(charge, "ch_1"); // stored encrypted, replayed in clear
//! # Ok(()) }
//! ```
//!
//! ## What is sealed, and what is not
//!
//! Only the outcome. The effect key (tenant, kind, subject), the request
//! fingerprint, the state, the fence and every timestamp stay in clear: the
//! claim needs them to decide, in one statement, before anything is opened.
//! So do not put secrets in subjects; a subject that names a person is
//! removed with [`Admin::erase`], not with a
//! codec. Outbox messages ([`outbox`](crate::outbox)) are payloads for a
//! broker, not outcomes, and are not sealed either.
//!
//! ## The envelope
//!
//! [`Keyring`] seals with XChaCha20-Poly1305 (RustCrypto's
//! `chacha20poly1305`, an AEAD: a wrong key, a changed byte or a value moved
//! to another row fails to open, it never decrypts to garbage). A sealed
//! outcome is, byte for byte:
//!
//! | bytes | what |
//! | --- | --- |
//! | 17 | [`MAGIC`], `\0oncely-sealed-v1`, or [`MAGIC_DEFLATE`], `\0oncely-sealed-d1`, when the outcome was compressed before it was sealed: no JSON text starts with a NUL byte, so a sealed value is never taken for a plain outcome, nor the reverse |
//! | 1 | the key id's length, 1 to [`MAX_KEY_ID`] |
//! | n | the key id, ASCII letters, digits, `-`, `_`, `.` ([`check_key_id`]) |
//! | 24 | a random nonce (from the operating system, per seal) |
//! | rest | the ciphertext and its 16-byte tag |
//!
//! The additional authenticated data is the header (magic, key id length,
//! key id) followed by the displayed effect key (`tenant/kind:subject`), so a
//! sealed value copied onto another key's row does not open there.
//! [`Envelope::parse`] reads the header without any key: tools (the
//! `oncely` command, `oncely serve`) show a sealed outcome as
//! `encrypted (key k1, 812 bytes)` and never as bytes.
//!
//! Sealing adds [`OutcomeCodec::overhead`] bytes (58 plus the key id), and
//! the sealed value must fit the ledger's outcome limit
//! ([`MAX_OUTCOME_BYTES`]): [`Sealed`] reports the smaller limit left for
//! the plain outcome in its [`Capabilities`], and an outcome over it fails
//! with [`Error::OutcomeTooLarge`] before anything is written.
//!
//! ## Compression (opt-in)
//!
//! [`Keyring::compress`] deflates an outcome of 256 bytes or more before
//! sealing it, and keeps the deflated form only when it is smaller: stored
//! HTTP responses and other repetitive JSON shrink several times (a 16 KiB
//! list of order lines to about 2.4 KiB), an id or a status is sealed as it
//! is. The envelope says which in its magic ([`MAGIC_DEFLATE`]), inside
//! the authenticated header, so no outcome's own bytes can pass for a
//! compressed one; every [`Keyring`] opens both, whether or not it
//! compresses, and inflates at most [`MAX_OUTCOME_BYTES`] (a forged
//! envelope cannot make a reader allocate more). The limit on a plain
//! outcome does not change with it: the caller's limit never depends on
//! how well a value compresses.
//!
//! It is off by default because compressing before encrypting lets the
//! stored length tell something about the content: if an attacker can put
//! text of their choosing into an outcome that also holds a secret, the
//! sizes of many stored records can reveal the secret a guess at a time
//! (the CRIME and BREACH attacks on TLS). Turn it on for outcomes that hold
//! no secret next to attacker-chosen text, or where storage matters more.
//!
//! ## Rotating keys
//!
//! A [`Keyring`] holds one **active** key, which seals, and any number of
//! decrypt-only keys, which only open. To rotate:
//! 1. give every process the new key as the active one and the old key as
//!    decrypt-only ([`Keyring::with_decrypt_only`], or a keys file in
//!    [`Keyring::parse`]'s format): new outcomes are sealed with the new key,
//!    old records still open;
//! 2. re-seal what is stored under the old key: [`reseal`] (the command
//!    `oncely reencrypt`) pages through the completed records and rewrites
//!    each with one conditional write
//!    ([`Admin::replace_outcome`]): a
//!    record that moved on meanwhile is left alone and counted;
//! 3. once it reports nothing left under the old key, remove the old key.
//!
//! A record sealed with a key the keyring does not hold fails with
//! [`Error::CodecKeyMissing`]; one that fails authentication (a wrong key
//! under a known id, a tampered or moved value) with [`Error::Codec`].
//! Plain outcomes stored before a codec was used are returned as they are,
//! unless [`Keyring::require_sealed`] says otherwise (after
//! `oncely reencrypt --plain` sealed them).
//!
//! ## The fingerprint is checked first
//!
//! A claim through [`Sealed`] opens nothing before the request matched: the
//! backend's claim compares request fingerprints before it answers
//! ([`answer_existing`](crate::backend::answer_existing)), so a claim with
//! another payload fails with [`Error::FingerprintMismatch`] whether or not
//! this process holds the record's key; only a matching claim gets a
//! [`Claim::Completed`] to open. An erased record (completed, no outcome,
//! [`Record::is_erased`]) passes through untouched.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::time::{Duration, SystemTime};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use crate::admin::{Admin, Cursor, Erasure, Filter, KindStats, RecordQuery};
use crate::error::{Error, Result};
use crate::key::{EffectKey, Tenant};
use crate::ledger::{Capabilities, Ledger, TransactionalLedger};
use crate::outbox::{Enqueued, Message, Outbox, OutboxStats, Pending, Ticket, TransactionalOutbox};
use crate::record::{Claim, ClaimOptions, Lease, MAX_OUTCOME_BYTES, Outcome, Record, RecordState};
use crate::watch::Watch;

/// What turns an outcome into the bytes a ledger stores, and back.
///
/// Implementations must make [`open`](OutcomeCodec::open) of
/// [`seal`](OutcomeCodec::seal)`(key, x)` give `x` back for the same `key`,
/// and should refuse to open a value sealed for another key. [`Keyring`] is
/// the one this crate ships (XChaCha20-Poly1305); [`Sealed`] applies a codec
/// to a ledger.
pub trait OutcomeCodec: Send + Sync {
    /// The bytes to store for `plain`, the outcome of `key`.
    fn seal(&self, key: &EffectKey, plain: &Outcome) -> Result<Outcome>;

    /// The outcome stored as `stored` for `key`.
    fn open(&self, key: &EffectKey, stored: &Outcome) -> Result<Outcome>;

    /// The most bytes [`seal`](OutcomeCodec::seal) adds to an outcome, so
    /// the limit left for a plain outcome is known before sealing (0 unless
    /// the codec says otherwise).
    fn overhead(&self) -> usize {
        0
    }
}

impl<C: OutcomeCodec + ?Sized> OutcomeCodec for &C {
    fn seal(&self, key: &EffectKey, plain: &Outcome) -> Result<Outcome> {
        (**self).seal(key, plain)
    }
    fn open(&self, key: &EffectKey, stored: &Outcome) -> Result<Outcome> {
        (**self).open(key, stored)
    }
    fn overhead(&self) -> usize {
        (**self).overhead()
    }
}

impl<C: OutcomeCodec + ?Sized> OutcomeCodec for std::sync::Arc<C> {
    fn seal(&self, key: &EffectKey, plain: &Outcome) -> Result<Outcome> {
        (**self).seal(key, plain)
    }
    fn open(&self, key: &EffectKey, stored: &Outcome) -> Result<Outcome> {
        (**self).open(key, stored)
    }
    fn overhead(&self) -> usize {
        (**self).overhead()
    }
}

/// The first bytes of every sealed outcome (see the [module docs](self)).
pub const MAGIC: &[u8] = b"\0oncely-sealed-v1";

/// The first bytes of a sealed outcome that was deflated before it was
/// sealed ([`Keyring::compress`]); as long as [`MAGIC`].
pub const MAGIC_DEFLATE: &[u8] = b"\0oncely-sealed-d1";

/// The longest key id, in bytes.
pub const MAX_KEY_ID: usize = 32;

const NONCE_BYTES: usize = 24;
const TAG_BYTES: usize = 16;

/// Checks a key id: 1 to [`MAX_KEY_ID`] ASCII letters, digits, `-`, `_` or
/// `.` (it is stored in clear in every envelope and printed by tools).
pub fn check_key_id(id: &str) -> Result<()> {
    if id.is_empty() || id.len() > MAX_KEY_ID {
        return Err(Error::Config(format!(
            "outcome key id {id:?}: 1 to {MAX_KEY_ID} characters"
        )));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(Error::Config(format!(
            "outcome key id {id:?}: only ASCII letters, digits, '-', '_' and '.'"
        )));
    }
    Ok(())
}

/// A sealed outcome's parts, read without any key: what tools show instead
/// of the bytes. Its `Debug` shows the key id and the size, not the bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Envelope<'a> {
    key_id: &'a str,
    header: &'a [u8],
    nonce: &'a [u8],
    ciphertext: &'a [u8],
    len: usize,
    compressed: bool,
}

impl<'a> Envelope<'a> {
    /// Whether `stored` starts with [`MAGIC`] or [`MAGIC_DEFLATE`]: a
    /// sealed value (well formed or not), never a plain outcome.
    pub fn is_sealed(stored: &[u8]) -> bool {
        stored.starts_with(MAGIC) || stored.starts_with(MAGIC_DEFLATE)
    }

    /// The envelope in `stored`, or `None` when it is not a well-formed
    /// sealed value (a plain outcome, or a damaged one: see
    /// [`Envelope::is_sealed`]).
    pub fn parse(stored: &'a [u8]) -> Option<Self> {
        let (rest, compressed) = match stored.strip_prefix(MAGIC) {
            Some(rest) => (rest, false),
            None => (stored.strip_prefix(MAGIC_DEFLATE)?, true),
        };
        let (&id_len, rest) = rest.split_first()?;
        let id_len = usize::from(id_len);
        if rest.len() < id_len + NONCE_BYTES + TAG_BYTES {
            return None;
        }
        let (id, rest) = rest.split_at(id_len);
        let key_id = std::str::from_utf8(id).ok()?;
        check_key_id(key_id).ok()?;
        let (nonce, ciphertext) = rest.split_at(NONCE_BYTES);
        Some(Envelope {
            key_id,
            header: &stored[..MAGIC.len() + 1 + id_len],
            nonce,
            ciphertext,
            len: stored.len(),
            compressed,
        })
    }

    /// The id of the key that sealed it.
    pub fn key_id(&self) -> &'a str {
        self.key_id
    }

    /// The whole sealed value's size in bytes, as stored.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: an envelope holds at least its header, nonce and tag.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The size in bytes of what was sealed (the ciphertext less its tag):
    /// the plain outcome's, or its deflated form's when
    /// [`is_compressed`](Envelope::is_compressed).
    pub fn plain_len(&self) -> usize {
        self.ciphertext.len() - TAG_BYTES
    }

    /// Whether the outcome was deflated before it was sealed
    /// ([`Keyring::compress`]).
    pub fn is_compressed(&self) -> bool {
        self.compressed
    }
}

impl fmt::Debug for Envelope<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Envelope")
            .field("key_id", &self.key_id)
            .field("len", &self.len)
            .field("compressed", &self.compressed)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for Envelope<'_> {
    /// `encrypted (key k1, 812 bytes)`, or `encrypted (key k1, compressed,
    /// 812 bytes)`: how tools show a sealed outcome.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let compressed = if self.compressed { ", compressed" } else { "" };
        write!(
            f,
            "encrypted (key {}{compressed}, {} bytes)",
            self.key_id, self.len
        )
    }
}

/// How tools describe a stored outcome without any key: `Some("encrypted
/// (key k1, 812 bytes)")` for a sealed one, `Some("encrypted (damaged
/// envelope, 40 bytes)")` for a value with [`MAGIC`] (or
/// [`MAGIC_DEFLATE`]) that does not parse,
/// `None` for a plain outcome (show it as usual).
pub fn describe_sealed(stored: &[u8]) -> Option<String> {
    match Envelope::parse(stored) {
        Some(e) => Some(e.to_string()),
        None if Envelope::is_sealed(stored) => {
            Some(format!("encrypted (damaged envelope, {} bytes)", stored.len()))
        }
        None => None,
    }
}

/// 32 bytes of key material for [`Keyring`]. Its `Debug` never prints them,
/// and they are wiped when it is dropped (so is the keyring's cipher state).
#[derive(Clone, PartialEq, Eq)]
pub struct SecretKey([u8; 32]);

impl SecretKey {
    /// A key from 32 raw bytes (from a secret store or a KMS).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        SecretKey(bytes)
    }

    /// A key from 64 hexadecimal characters (either case; surrounding
    /// whitespace ignored). The error never repeats the input.
    pub fn from_hex(hex: &str) -> Result<Self> {
        let hex = hex.trim().as_bytes();
        if hex.len() != 64 {
            return Err(Error::Config(format!(
                "outcome key: 64 hexadecimal characters expected, got {}",
                hex.len()
            )));
        }
        let mut out = [0u8; 32];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let (Some(hi), Some(lo)) = (nibble(pair[0]), nibble(pair[1])) else {
                return Err(Error::Config("outcome key: not hexadecimal".into()));
            };
            out[i] = hi << 4 | lo;
        }
        Ok(SecretKey(out))
    }

    /// A new random key from the operating system.
    pub fn generate() -> Result<Self> {
        let mut out = [0u8; 32];
        getrandom::fill(&mut out).map_err(|e| Error::Config(format!("outcome key: no randomness: {e}")))?;
        Ok(SecretKey(out))
    }

    /// The key as 64 lowercase hexadecimal characters (to write a keys file).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl Drop for SecretKey {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

/// The outcome codec this crate ships: XChaCha20-Poly1305 with one active
/// key, which seals, and any number of decrypt-only keys (rotation; see the
/// [module docs](self)). Its `Debug` lists key ids, never key bytes.
#[derive(Clone)]
pub struct Keyring {
    active: String,
    keys: BTreeMap<String, XChaCha20Poly1305>,
    require_sealed: bool,
    compress: bool,
}

impl Keyring {
    /// A keyring whose active key is `id`.
    pub fn new(id: &str, key: SecretKey) -> Result<Self> {
        check_key_id(id)?;
        let mut keys = BTreeMap::new();
        keys.insert(id.to_owned(), cipher(&key));
        Ok(Keyring {
            active: id.to_owned(),
            keys,
            require_sealed: false,
            compress: false,
        })
    }

    /// Adds a decrypt-only key: outcomes sealed under `id` open, nothing new
    /// is sealed with it. Refuses an id the keyring already holds.
    pub fn with_decrypt_only(mut self, id: &str, key: SecretKey) -> Result<Self> {
        check_key_id(id)?;
        if self.keys.contains_key(id) {
            return Err(Error::Config(format!("outcome key id {id:?} given twice")));
        }
        self.keys.insert(id.to_owned(), cipher(&key));
        Ok(self)
    }

    /// Refuses to open a plain (unsealed) outcome, with [`Error::Codec`],
    /// instead of returning it as it is: for a ledger whose every outcome is
    /// sealed (after `oncely reencrypt --plain`), so a plain value written
    /// into the table by someone else is not replayed. What is written
    /// without the codec (`oncely resolve --completed`, a process not given
    /// the keyring) is plain until `oncely reencrypt --plain` seals it.
    pub fn require_sealed(mut self, yes: bool) -> Self {
        self.require_sealed = yes;
        self
    }

    /// Deflates each outcome of 256 bytes or more before sealing it,
    /// keeping the deflated form only when it is smaller (off by default; see the
    /// [module docs](self#compression-opt-in) for when not to). Opening
    /// does not depend on it: every keyring opens compressed and plain
    /// envelopes alike.
    ///
    /// ```
    /// use oncely::backend::Outcome;
    /// use oncely::codec::{Envelope, Keyring, OutcomeCodec, SecretKey};
    /// use oncely::{EffectKey, Tenant};
    ///
    /// # fn main() -> oncely::Result<()> {
    /// let keys = Keyring::new("k1", SecretKey::generate()?)?.compress(true);
    /// let key = EffectKey::new(&Tenant::global(), "render", "invoice-7")?;
    /// let page = Outcome::from_json(&"<tr><td>line</td></tr>".repeat(200))?;
    /// let stored = keys.seal(&key, &page)?;
    /// assert!(Envelope::parse(stored.as_bytes()).unwrap().is_compressed());
    /// assert!(stored.len() < page.len() / 10);
    /// assert_eq!(keys.open(&key, &stored)?, page);
    /// # Ok(()) }
    /// ```
    pub fn compress(mut self, yes: bool) -> Self {
        self.compress = yes;
        self
    }

    /// The active key's id.
    pub fn active(&self) -> &str {
        &self.active
    }

    /// Every key id held, in order, the active one included.
    pub fn key_ids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Parses a keys file (or an environment variable): entries
    /// `id=<64 hex>`, separated by newlines, commas or spaces; `#` starts a
    /// comment to the end of the line. The entry marked with a leading `*`
    /// (`*k2=…`) is the active key; when none is marked, the first is. The
    /// others are decrypt-only. Errors name the entry, never its key.
    ///
    /// ```
    /// # fn main() -> oncely::Result<()> {
    /// let text = format!("# rotated 2026-12\n*k2={}\nk1={}\n", "22".repeat(32), "11".repeat(32));
    /// let keys = oncely::codec::Keyring::parse(&text)?;
    /// assert_eq!(keys.active(), "k2");
    /// # Ok(()) }
    /// ```
    pub fn parse(text: &str) -> Result<Self> {
        let mut entries = Vec::new();
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("");
            for entry in line.split([',', ' ', '\t']).filter(|e| !e.is_empty()) {
                let (marked, entry) = match entry.strip_prefix('*') {
                    Some(rest) => (true, rest),
                    None => (false, entry),
                };
                let Some((id, hex)) = entry.split_once('=') else {
                    return Err(Error::Config(format!(
                        "outcome keys: entry {} is not id=<64 hex>",
                        entries.len() + 1
                    )));
                };
                // Errors name the entry by number, never by what it holds: a
                // line written the wrong way round has the key where the id is.
                let n = entries.len() + 1;
                if check_key_id(id).is_err() {
                    return Err(Error::Config(format!(
                        "outcome keys: entry {n}: the key id must be 1 to {MAX_KEY_ID} ASCII letters, \
                         digits, '-', '_' or '.'"
                    )));
                }
                let key = SecretKey::from_hex(hex).map_err(|e| {
                    Error::Config(format!("outcome keys: entry {n} ({id}): {}", config_message(e)))
                })?;
                entries.push((marked, id.to_owned(), key));
            }
        }
        let marked = entries.iter().filter(|(m, ..)| *m).count();
        if marked > 1 {
            return Err(Error::Config(
                "outcome keys: more than one entry is marked active (*)".into(),
            ));
        }
        let active = entries.iter().position(|(m, ..)| *m).unwrap_or(0);
        if entries.is_empty() {
            return Err(Error::Config("outcome keys: no key given".into()));
        }
        let (_, id, key) = entries.remove(active);
        let mut ring = Keyring::new(&id, key)?;
        for (_, id, key) in entries {
            ring = ring.with_decrypt_only(&id, key)?;
        }
        Ok(ring)
    }

    /// Whether `stored` needs [`reseal`]: sealed under another key than the
    /// active one, or (when `plain` is set) a plain outcome.
    pub fn needs_reseal(&self, stored: &[u8], plain: bool) -> bool {
        match Envelope::parse(stored) {
            Some(e) => e.key_id() != self.active,
            None => plain && !Envelope::is_sealed(stored),
        }
    }
}

fn config_message(e: Error) -> String {
    match e {
        Error::Config(m) => m,
        other => other.to_string(),
    }
}

fn cipher(key: &SecretKey) -> XChaCha20Poly1305 {
    XChaCha20Poly1305::new(&key.0.into())
}

fn aad(header: &[u8], key: &EffectKey) -> Vec<u8> {
    let mut aad = Vec::with_capacity(header.len() + key.as_str().len());
    aad.extend_from_slice(header);
    aad.extend_from_slice(key.as_str().as_bytes());
    aad
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("active", &self.active)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("require_sealed", &self.require_sealed)
            .field("compress", &self.compress)
            .finish()
    }
}

impl OutcomeCodec for Keyring {
    fn seal(&self, key: &EffectKey, plain: &Outcome) -> Result<Outcome> {
        let limit = MAX_OUTCOME_BYTES - self.overhead();
        if plain.len() > limit {
            // The plain outcome against what is left of the limit once
            // sealed: the numbers the caller can act on.
            return Err(Error::OutcomeTooLarge {
                size: plain.len(),
                max: limit,
            });
        }
        // Deflated only when that is smaller, so the overhead (and the
        // limit above) holds whatever the content.
        let deflated = (self.compress && plain.len() >= MIN_DEFLATE_BYTES)
            .then(|| miniz_oxide::deflate::compress_to_vec(plain.as_bytes(), DEFLATE_LEVEL))
            .filter(|d| d.len() < plain.len());
        let (magic, msg) = match &deflated {
            Some(d) => (MAGIC_DEFLATE, d.as_slice()),
            None => (MAGIC, plain.as_bytes()),
        };
        self.seal_bytes(key, magic, msg)
    }

    fn open(&self, key: &EffectKey, stored: &Outcome) -> Result<Outcome> {
        let bytes = stored.as_bytes();
        let Some(envelope) = Envelope::parse(bytes) else {
            if Envelope::is_sealed(bytes) {
                return Err(Error::Codec {
                    key: key.to_string(),
                    message: format!("damaged envelope ({} bytes)", bytes.len()),
                });
            }
            if self.require_sealed {
                return Err(Error::Codec {
                    key: key.to_string(),
                    message: "the stored outcome is not sealed, and this codec requires it".into(),
                });
            }
            return Ok(stored.clone());
        };
        let Some(cipher) = self.keys.get(envelope.key_id()) else {
            return Err(Error::CodecKeyMissing {
                key: key.to_string(),
                key_id: envelope.key_id().to_owned(),
            });
        };
        let nonce: [u8; NONCE_BYTES] = envelope.nonce.try_into().expect("parse split 24 bytes");
        let plain = cipher
            .decrypt(
                &XNonce::from(nonce),
                Payload {
                    msg: envelope.ciphertext,
                    aad: &aad(envelope.header, key),
                },
            )
            .map_err(|_| Error::Codec {
                key: key.to_string(),
                message: format!(
                    "the outcome sealed under key id {:?} does not open: a wrong key under that id, or a \
                     changed or moved value",
                    envelope.key_id()
                ),
            })?;
        if !envelope.is_compressed() {
            return Outcome::from_bytes(plain);
        }
        // Authenticated, so written by a holder of the key; inflated with a
        // limit all the same, so no stored value makes a reader allocate
        // more than an outcome may hold.
        let inflated = miniz_oxide::inflate::decompress_to_vec_with_limit(&plain, MAX_OUTCOME_BYTES)
            .map_err(|e| Error::Codec {
                key: key.to_string(),
                message: format!("the compressed outcome does not inflate: {e}"),
            })?;
        Outcome::from_bytes(inflated)
    }

    fn overhead(&self) -> usize {
        MAGIC.len() + 1 + self.active.len() + NONCE_BYTES + TAG_BYTES
    }
}

/// The fastest level: on 16 KiB of order lines it stores 15 % of the plain
/// size at 64 µs per seal, where miniz's default (6) stores 11.5 % at
/// 147 µs (`cargo bench -p oncely --bench cpu -- codec`).
const DEFLATE_LEVEL: u8 = 1;

/// Shorter outcomes are sealed as they are without trying: deflate's setup
/// alone costs five times the sealing of a 70-byte charge (`cargo bench -p
/// oncely --bench cpu -- codec`), to save a few bytes at best.
const MIN_DEFLATE_BYTES: usize = 256;

impl Keyring {
    /// Seals `msg` under the active key behind `magic` (the header, with
    /// the effect key, is the additional authenticated data).
    fn seal_bytes(&self, key: &EffectKey, magic: &[u8], msg: &[u8]) -> Result<Outcome> {
        let cipher = &self.keys[&self.active];
        let mut nonce = [0u8; NONCE_BYTES];
        getrandom::fill(&mut nonce).map_err(|e| Error::Codec {
            key: key.to_string(),
            message: format!("no randomness for a nonce: {e}"),
        })?;
        let mut out = Vec::with_capacity(msg.len() + self.overhead());
        out.extend_from_slice(magic);
        out.push(self.active.len() as u8); // check_key_id: at most 32
        out.extend_from_slice(self.active.as_bytes());
        let aad = aad(&out, key);
        let sealed = cipher
            .encrypt(&XNonce::from(nonce), Payload { msg, aad: &aad })
            .map_err(|_| Error::Codec {
                key: key.to_string(),
                message: "encryption failed".into(),
            })?;
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Outcome::from_bytes(out)
    }
}

/// A [`Ledger`] whose outcomes are stored through an [`OutcomeCodec`]:
/// [`complete`](Ledger::complete) (and `complete_many`, `complete_in`)
/// seals the outcome before the inner ledger writes it; every outcome the
/// inner ledger hands back in a [`Claim::Completed`] (and from
/// [`get`](Ledger::get), `claim_many`, `claim_in`,
/// [`abandoned`](Ledger::abandoned)) is opened before the caller sees it.
/// Everything else goes straight to the inner ledger.
///
/// It is a [`TransactionalLedger`], an [`Admin`] and an [`Outbox`] when the
/// inner one is (outbox messages are not sealed: they are payloads for a
/// broker, not outcomes). [`Admin`] calls are the operator's view and work
/// on what is **stored**: [`Admin::records`] lists outcomes sealed, as the
/// table holds them (a page is listed even where this process lacks a key;
/// open one with [`Sealed::open_record`]), and
/// [`Admin::replace_outcome`] compares and writes stored bytes, as
/// [`reseal`] needs.
///
/// Wrap it in [`Effects`](crate::Effects) like any ledger (the runner's
/// coalescing wraps it in turn, so a batch is sealed as a batch).
#[derive(Debug, Clone)]
pub struct Sealed<L, C> {
    inner: L,
    codec: C,
}

impl<L, C> Sealed<L, C> {
    /// `inner`, storing its outcomes through `codec`.
    pub fn new(inner: L, codec: C) -> Self {
        Sealed { inner, codec }
    }

    /// The inner ledger (it reads and writes stored, sealed outcomes).
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// The codec.
    pub fn codec(&self) -> &C {
        &self.codec
    }
}

impl<L: Ledger, C: OutcomeCodec> Sealed<L, C> {
    /// `record` with its outcome opened (an erased or outcome-less record as
    /// it is).
    pub fn open_record(&self, record: Record) -> Result<Record> {
        open_record(&self.codec, record)
    }

    fn open_claim(&self, claim: Claim) -> Result<Claim> {
        Ok(match claim {
            Claim::Completed(record) => Claim::Completed(self.open_record(record)?),
            Claim::Abandoned(record) => Claim::Abandoned(self.open_record(record)?),
            other => other,
        })
    }
}

fn open_record<C: OutcomeCodec + ?Sized>(codec: &C, mut record: Record) -> Result<Record> {
    if let Some(stored) = &record.outcome {
        record.outcome = Some(codec.open(&record.key, stored)?);
    }
    Ok(record)
}

impl<L: Ledger, C: OutcomeCodec> Ledger for Sealed<L, C> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn capabilities(&self) -> Capabilities {
        let inner = self.inner.capabilities();
        let max = inner.max_outcome_bytes.saturating_sub(self.codec.overhead());
        inner.max_outcome_bytes(max)
    }

    async fn claim(&self, key: &EffectKey, opts: &ClaimOptions) -> Result<Claim> {
        let claim = self.inner.claim(key, opts).await?;
        self.open_claim(claim)
    }

    async fn complete(&self, lease: &Lease, outcome: &Outcome) -> Result<()> {
        let sealed = self.codec.seal(lease.key(), outcome)?;
        self.inner.complete(lease, &sealed).await
    }

    fn release(&self, lease: &Lease) -> impl Future<Output = Result<()>> + Send {
        self.inner.release(lease)
    }

    fn renew(&self, lease: &Lease, extend_by: Duration) -> impl Future<Output = Result<Lease>> + Send {
        self.inner.renew(lease, extend_by)
    }

    async fn get(&self, key: &EffectKey) -> Result<Option<Record>> {
        self.inner
            .get(key)
            .await?
            .map(|r| self.open_record(r))
            .transpose()
    }

    fn prune(&self, limit: u64) -> impl Future<Output = Result<u64>> + Send {
        self.inner.prune(limit)
    }

    async fn abandoned(&self, tenant: &Tenant, limit: u64) -> Result<Vec<Record>> {
        // Abandoned steps hold no outcome; opened all the same, so nothing
        // sealed ever leaves this ledger.
        let records = self.inner.abandoned(tenant, limit).await?;
        records.into_iter().map(|r| self.open_record(r)).collect()
    }

    fn horizon(
        &self,
        tenant: &Tenant,
        kind: &str,
    ) -> impl Future<Output = Result<Option<SystemTime>>> + Send {
        self.inner.horizon(tenant, kind)
    }

    fn watch(&self, key: &EffectKey) -> impl Future<Output = Watch> + Send {
        self.inner.watch(key)
    }

    async fn claim_many(&self, keys: &[EffectKey], opts: &ClaimOptions) -> Result<Vec<Result<Claim>>> {
        let answers = self.inner.claim_many(keys, opts).await?;
        Ok(answers
            .into_iter()
            .map(|answer| answer.and_then(|claim| self.open_claim(claim)))
            .collect())
    }

    async fn complete_many(&self, items: &[(Lease, Outcome)]) -> Vec<Result<()>> {
        // A slot whose outcome cannot be sealed answers its own error; the
        // others go to the inner ledger as one batch, in their order.
        let mut answers: Vec<Option<Result<()>>> = Vec::with_capacity(items.len());
        let mut sealed = Vec::with_capacity(items.len());
        for (lease, outcome) in items {
            match self.codec.seal(lease.key(), outcome) {
                Ok(s) => {
                    sealed.push((lease.clone(), s));
                    answers.push(None);
                }
                Err(e) => answers.push(Some(Err(e))),
            }
        }
        let mut written = self.inner.complete_many(&sealed).await.into_iter();
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    written.next().unwrap_or_else(|| {
                        Err(Error::Corrupt {
                            backend: self.inner.backend(),
                            message: "complete_many answered fewer slots than it was given".into(),
                        })
                    })
                })
            })
            .collect()
    }

    fn unique_violation(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        self.inner.unique_violation(error)
    }
}

impl<L: TransactionalLedger, C: OutcomeCodec> TransactionalLedger for Sealed<L, C> {
    type Connection = L::Connection;
    type Transaction = L::Transaction;

    fn begin(&self) -> impl Future<Output = Result<Self::Transaction>> + Send {
        self.inner.begin()
    }

    fn commit(&self, tx: Self::Transaction) -> impl Future<Output = Result<()>> + Send {
        self.inner.commit(tx)
    }

    fn rollback(&self, tx: Self::Transaction) -> impl Future<Output = Result<()>> + Send {
        self.inner.rollback(tx)
    }

    async fn claim_in(
        &self,
        conn: &mut Self::Connection,
        key: &EffectKey,
        opts: &ClaimOptions,
    ) -> Result<Claim> {
        let claim = self.inner.claim_in(conn, key, opts).await?;
        self.open_claim(claim)
    }

    async fn complete_in(&self, conn: &mut Self::Connection, lease: &Lease, outcome: &Outcome) -> Result<()> {
        let sealed = self.codec.seal(lease.key(), outcome)?;
        self.inner.complete_in(conn, lease, &sealed).await
    }
}

impl<L: Admin, C: OutcomeCodec> Admin for Sealed<L, C> {
    fn records(&self, query: &RecordQuery) -> impl Future<Output = Result<Vec<Record>>> + Send {
        self.inner.records(query)
    }

    fn stats(&self, tenant: Option<&Tenant>) -> impl Future<Output = Result<Vec<KindStats>>> + Send {
        self.inner.stats(tenant)
    }

    fn forget(&self, key: &EffectKey, fence: u64) -> impl Future<Output = Result<()>> + Send {
        self.inner.forget(key, fence)
    }

    fn prunable(&self) -> impl Future<Output = Result<u64>> + Send {
        self.inner.prunable()
    }

    fn erase(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send {
        self.inner.erase(tenant, subject)
    }

    fn erase_dry_run(&self, tenant: &Tenant, subject: &str) -> impl Future<Output = Result<Erasure>> + Send {
        self.inner.erase_dry_run(tenant, subject)
    }

    fn replace_outcome(
        &self,
        key: &EffectKey,
        fence: u64,
        expected: &Outcome,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<bool>> + Send {
        self.inner.replace_outcome(key, fence, expected, outcome)
    }
}

/// Forwarded: outbox messages are payloads for a broker, not outcomes, and
/// are stored as the inner ledger stores them (not sealed).
impl<L: Outbox, C: OutcomeCodec> Outbox for Sealed<L, C> {
    fn claim_messages(
        &self,
        limit: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Pending>>> + Send {
        self.inner.claim_messages(limit, lease)
    }
    fn mark_sent(&self, tickets: &[Ticket]) -> impl Future<Output = Result<Vec<bool>>> + Send {
        self.inner.mark_sent(tickets)
    }
    fn retry_later(
        &self,
        ticket: Ticket,
        delay: Duration,
        error: &str,
    ) -> impl Future<Output = Result<bool>> + Send {
        self.inner.retry_later(ticket, delay, error)
    }
    fn mark_failed(&self, ticket: Ticket, error: &str) -> impl Future<Output = Result<bool>> + Send {
        self.inner.mark_failed(ticket, error)
    }
    fn prune_sent(&self, older_than: Duration, limit: u32) -> impl Future<Output = Result<u64>> + Send {
        self.inner.prune_sent(older_than, limit)
    }
    fn outbox_stats(&self) -> impl Future<Output = Result<OutboxStats>> + Send {
        self.inner.outbox_stats()
    }
}

/// Forwarded, as [`Outbox`] is: the message is not sealed.
impl<L: TransactionalOutbox, C: OutcomeCodec> TransactionalOutbox for Sealed<L, C> {
    fn enqueue_in(
        &self,
        conn: &mut Self::Connection,
        key: &EffectKey,
        message: &Message,
    ) -> impl Future<Output = Result<Enqueued>> + Send {
        self.inner.enqueue_in(conn, key, message)
    }
}

/// Which stored outcomes [`reseal`] rewrites.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ResealOptions {
    /// One tenant, or `None` for every tenant.
    pub tenant: Option<Tenant>,
    /// Seal plain outcomes too (written before the codec was used).
    pub plain: bool,
    /// Count what would be rewritten, writing nothing.
    pub dry_run: bool,
    /// Kinds left out altogether (not counted): records that tools must
    /// read without a key, such as the `oncely` command's audit records.
    pub skip_kinds: Vec<String>,
}

impl ResealOptions {
    /// Only this tenant's records.
    pub fn tenant(mut self, tenant: Tenant) -> Self {
        self.tenant = Some(tenant);
        self
    }

    /// Seal plain outcomes too.
    pub fn plain(mut self, yes: bool) -> Self {
        self.plain = yes;
        self
    }

    /// Write nothing, count only.
    pub fn dry_run(mut self, yes: bool) -> Self {
        self.dry_run = yes;
        self
    }

    /// Leaves the records of `kind` out (they stay as they are, uncounted).
    pub fn skip_kind(mut self, kind: &str) -> Self {
        self.skip_kinds.push(kind.to_owned());
        self
    }
}

/// What [`reseal`] did.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ResealReport {
    /// Completed records with an outcome that were looked at.
    pub scanned: u64,
    /// Rewritten under the active key (in a dry run: would be).
    pub resealed: u64,
    /// Already sealed under the active key.
    pub current: u64,
    /// Plain outcomes left plain ([`ResealOptions::plain`] not set).
    pub plain: u64,
    /// Changed by someone else between the read and the write (completed
    /// again at a new fence, forgotten, erased, pruned): left as they are.
    pub moved_on: u64,
    /// Records that could not be opened (a key the keyring lacks, a value
    /// that fails authentication), with the error: left as they are.
    pub failed: Vec<(EffectKey, Error)>,
}

/// Rewrites the stored outcomes of completed records under `keyring`'s
/// active key: those sealed under another key (opened with the keyring's
/// decrypt-only keys), and plain ones when [`ResealOptions::plain`] says so.
///
/// Pages through [`Admin::records`] (completed records, oldest first) and
/// rewrites each with one conditional
/// [`Admin::replace_outcome`] at the fence and stored bytes it read: a
/// record that changed meanwhile is not overwritten, only counted in
/// [`ResealReport::moved_on`]. A record that does not open is listed in
/// [`ResealReport::failed`] and the rest go on. Running it again is harmless:
/// what is under the active key is left alone.
///
/// `ledger` is the inner ledger or a [`Sealed`] one (its [`Admin`] works on
/// stored bytes either way).
pub async fn reseal<A: Admin>(
    ledger: &A,
    keyring: &Keyring,
    options: &ResealOptions,
) -> Result<ResealReport> {
    let mut report = ResealReport::default();
    let mut query = RecordQuery {
        tenant: options.tenant.clone(),
        filter: Filter::State(RecordState::Completed),
        ..RecordQuery::default()
    };
    loop {
        let page = ledger.records(&query).await?;
        let Some(last) = page.last() else { break };
        query.after = Some(Cursor::after(last));
        for record in page {
            let Some(stored) = &record.outcome else {
                continue; // erased
            };
            if options.skip_kinds.iter().any(|k| k == record.key.kind()) {
                continue;
            }
            report.scanned += 1;
            let bytes = stored.as_bytes();
            if !keyring.needs_reseal(bytes, options.plain) {
                match Envelope::parse(bytes) {
                    Some(_) => report.current += 1,
                    None if Envelope::is_sealed(bytes) => report.failed.push((
                        record.key.clone(),
                        Error::Codec {
                            key: record.key.to_string(),
                            message: format!("damaged envelope ({} bytes)", bytes.len()),
                        },
                    )),
                    None => report.plain += 1,
                }
                continue;
            }
            let resealed = keyring
                .open(&record.key, stored)
                .and_then(|plain| keyring.seal(&record.key, &plain));
            let resealed = match resealed {
                Ok(r) => r,
                Err(e) => {
                    report.failed.push((record.key.clone(), e));
                    continue;
                }
            };
            // One conditional write at the fence and bytes read: `false` is
            // a record that moved on meanwhile, left as it is.
            let written = options.dry_run
                || ledger
                    .replace_outcome(&record.key, record.fence, stored, &resealed)
                    .await?;
            if written {
                report.resealed += 1;
            } else {
                report.moved_on += 1;
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Tenant;

    fn key(subject: &str) -> EffectKey {
        EffectKey::new(&Tenant::global(), "capture", subject).unwrap()
    }

    fn k(byte: u8) -> SecretKey {
        SecretKey::from_bytes([byte; 32])
    }

    #[test]
    fn seal_then_open_gives_the_outcome_back_and_hides_it() {
        let ring = Keyring::new("k1", k(1)).unwrap();
        let plain = Outcome::from_json(&serde_json::json!({"ok": "ch_secret_4242"})).unwrap();
        let sealed = ring.seal(&key("o-1"), &plain).unwrap();
        assert!(Envelope::is_sealed(sealed.as_bytes()));
        assert!(!sealed.as_bytes().windows(6).any(|w| w == b"secret"));
        assert_eq!(sealed.len(), plain.len() + ring.overhead());
        let e = Envelope::parse(sealed.as_bytes()).unwrap();
        assert_eq!(
            (e.key_id(), e.len(), e.plain_len()),
            ("k1", sealed.len(), plain.len())
        );
        assert_eq!(
            e.to_string(),
            format!("encrypted (key k1, {} bytes)", sealed.len())
        );
        assert_eq!(ring.open(&key("o-1"), &sealed).unwrap(), plain);
        // A fresh nonce per seal: the same outcome never stores the same bytes.
        assert_ne!(ring.seal(&key("o-1"), &plain).unwrap(), sealed);
    }

    #[test]
    fn a_sealed_value_moved_to_another_key_does_not_open() {
        let ring = Keyring::new("k1", k(1)).unwrap();
        let sealed = ring.seal(&key("o-1"), &Outcome::from_json(&1).unwrap()).unwrap();
        let err = ring.open(&key("o-2"), &sealed).unwrap_err();
        assert!(
            matches!(err, Error::Codec { ref key, .. } if key == "_global/capture:o-2"),
            "{err:?}"
        );
    }

    #[test]
    fn a_wrong_key_under_a_known_id_is_a_codec_error_and_a_missing_id_is_named() {
        let sealed = Keyring::new("k1", k(1))
            .unwrap()
            .seal(&key("o-1"), &Outcome::from_json(&1).unwrap())
            .unwrap();
        let wrong = Keyring::new("k1", k(9)).unwrap();
        assert!(matches!(
            wrong.open(&key("o-1"), &sealed),
            Err(Error::Codec { .. })
        ));
        let other = Keyring::new("k2", k(1)).unwrap();
        match other.open(&key("o-1"), &sealed) {
            Err(Error::CodecKeyMissing { key, key_id }) => {
                assert_eq!((key.as_str(), key_id.as_str()), ("_global/capture:o-1", "k1"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tampered_byte_or_header_does_not_open() {
        let ring = Keyring::new("k1", k(1)).unwrap();
        let sealed = ring
            .seal(&key("o-1"), &Outcome::from_json(&"x").unwrap())
            .unwrap();
        let mut bytes = sealed.clone().into_bytes();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(matches!(
            ring.open(&key("o-1"), &Outcome::from_bytes(bytes).unwrap()),
            Err(Error::Codec { .. })
        ));
        let truncated = Outcome::from_bytes(&sealed.as_bytes()[..MAGIC.len() + 4]).unwrap();
        assert!(matches!(
            ring.open(&key("o-1"), &truncated),
            Err(Error::Codec { .. })
        ));
        assert!(describe_sealed(truncated.as_bytes()).unwrap().contains("damaged"));
    }

    #[test]
    fn rotation_keeps_old_outcomes_readable_and_seals_with_the_new_key() {
        let old = Keyring::new("k1", k(1)).unwrap();
        let plain = Outcome::from_json(&"old").unwrap();
        let sealed_old = old.seal(&key("o-1"), &plain).unwrap();
        let rotated = Keyring::new("k2", k(2))
            .unwrap()
            .with_decrypt_only("k1", k(1))
            .unwrap();
        assert_eq!(rotated.open(&key("o-1"), &sealed_old).unwrap(), plain);
        let sealed_new = rotated.seal(&key("o-1"), &plain).unwrap();
        assert_eq!(Envelope::parse(sealed_new.as_bytes()).unwrap().key_id(), "k2");
        assert!(rotated.needs_reseal(sealed_old.as_bytes(), false));
        assert!(!rotated.needs_reseal(sealed_new.as_bytes(), false));
    }

    #[test]
    fn plain_outcomes_pass_unless_sealing_is_required() {
        let ring = Keyring::new("k1", k(1)).unwrap();
        let plain = Outcome::from_json(&"before").unwrap();
        assert_eq!(ring.open(&key("o-1"), &plain).unwrap(), plain);
        assert!(describe_sealed(plain.as_bytes()).is_none());
        assert!(ring.needs_reseal(plain.as_bytes(), true));
        assert!(!ring.needs_reseal(plain.as_bytes(), false));
        let strict = ring.require_sealed(true);
        assert!(matches!(
            strict.open(&key("o-1"), &plain),
            Err(Error::Codec { .. })
        ));
    }

    #[test]
    fn sealing_respects_the_outcome_limit_with_honest_numbers() {
        let ring = Keyring::new("k1", k(1)).unwrap();
        let limit = MAX_OUTCOME_BYTES - ring.overhead();
        let fits = Outcome::from_bytes(vec![b'a'; limit]).unwrap();
        assert_eq!(ring.seal(&key("o-1"), &fits).unwrap().len(), MAX_OUTCOME_BYTES);
        let over = Outcome::from_bytes(vec![b'a'; limit + 1]).unwrap();
        match ring.seal(&key("o-1"), &over) {
            Err(Error::OutcomeTooLarge { size, max }) => assert_eq!((size, max), (limit + 1, limit)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn compression_shrinks_repetitive_outcomes_and_every_keyring_opens_them() {
        let ring = Keyring::new("k1", k(1)).unwrap().compress(true);
        let rows: Vec<_> = (0..300)
            .map(|i| serde_json::json!({"line": i, "sku": "SKU-1"}))
            .collect();
        let plain = Outcome::from_json(&rows).unwrap();
        let sealed = ring.seal(&key("o-1"), &plain).unwrap();
        let e = Envelope::parse(sealed.as_bytes()).unwrap();
        assert!(e.is_compressed());
        assert!(
            sealed.len() < plain.len() / 4,
            "{} of {}",
            sealed.len(),
            plain.len()
        );
        assert!(
            e.to_string().starts_with("encrypted (key k1, compressed, "),
            "{e}"
        );
        assert_eq!(ring.open(&key("o-1"), &sealed).unwrap(), plain);
        // Opening never depends on the setting.
        let reader = Keyring::new("k1", k(1)).unwrap();
        assert_eq!(reader.open(&key("o-1"), &sealed).unwrap(), plain);
        // The magic is authenticated: told it is not compressed, it does not open.
        let mut flipped = sealed.clone().into_bytes();
        flipped[..MAGIC.len()].copy_from_slice(MAGIC);
        assert!(matches!(
            ring.open(&key("o-1"), &Outcome::from_bytes(flipped).unwrap()),
            Err(Error::Codec { .. })
        ));
    }

    #[test]
    fn what_does_not_shrink_is_sealed_as_it_is_within_the_same_limit() {
        let ring = Keyring::new("k1", k(1)).unwrap().compress(true);
        let mut noise = vec![0u8; 600];
        getrandom::fill(&mut noise).unwrap();
        let plain = Outcome::from_json(&"ch_3PqzK2Lk9x8v7w6u").unwrap();
        for outcome in [plain, Outcome::from_bytes(noise).unwrap()] {
            let sealed = ring.seal(&key("o-1"), &outcome).unwrap();
            assert!(!Envelope::parse(sealed.as_bytes()).unwrap().is_compressed());
            assert_eq!(sealed.len(), outcome.len() + ring.overhead());
            assert_eq!(ring.open(&key("o-1"), &sealed).unwrap(), outcome);
        }
        let limit = MAX_OUTCOME_BYTES - ring.overhead();
        let over = Outcome::from_bytes(vec![b'a'; limit + 1]).unwrap();
        assert!(matches!(
            ring.seal(&key("o-1"), &over),
            Err(Error::OutcomeTooLarge { .. })
        ));
    }

    #[test]
    fn a_compressed_value_inflating_past_the_outcome_limit_is_refused() {
        let ring = Keyring::new("k1", k(1)).unwrap();
        let bomb = miniz_oxide::deflate::compress_to_vec(&vec![b'a'; MAX_OUTCOME_BYTES + 1], 6);
        let sealed = ring.seal_bytes(&key("o-1"), MAGIC_DEFLATE, &bomb).unwrap();
        match ring.open(&key("o-1"), &sealed) {
            Err(Error::Codec { message, .. }) => assert!(message.contains("inflate"), "{message}"),
            other => panic!("{other:?}"),
        }
        let garbage = ring
            .seal_bytes(&key("o-1"), MAGIC_DEFLATE, b"not deflate")
            .unwrap();
        assert!(matches!(
            ring.open(&key("o-1"), &garbage),
            Err(Error::Codec { .. })
        ));
    }

    #[test]
    fn debug_never_prints_key_bytes_and_keys_parse_from_text() {
        let key = SecretKey::from_hex(&"ab".repeat(32)).unwrap();
        assert_eq!(key, SecretKey::from_bytes([0xab; 32]));
        assert_eq!(format!("{key:?}"), "SecretKey(..)");
        let text = format!(
            "# keys\nk1={}\n*k2={} , k3={}",
            "ab".repeat(32),
            "CD".repeat(32),
            "01".repeat(32)
        );
        let ring = Keyring::parse(&text).unwrap();
        assert_eq!(ring.active(), "k2");
        assert_eq!(ring.key_ids().collect::<Vec<_>>(), ["k1", "k2", "k3"]);
        let shown = format!("{ring:?}");
        assert!(shown.contains("k2") && !shown.to_lowercase().contains("abab") && !shown.contains("cdcd"));
        assert_eq!(
            Keyring::parse(&format!("a={}", "11".repeat(32)))
                .unwrap()
                .active(),
            "a"
        );
        for bad in [
            String::new(),
            "k1".to_owned(),
            format!("k1={}", "1".repeat(63)),
            format!("k1={}zz", "1".repeat(62)),
            format!("*a={0} *b={0}", "11".repeat(32)),
            format!("a={0} a={0}", "11".repeat(32)),
            format!("bad/id={}", "11".repeat(32)),
            format!("{}=k1", "11".repeat(32)),
        ] {
            let err = Keyring::parse(&bad).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{bad}: {err:?}");
            assert!(!err.to_string().contains("1111"), "{err}");
        }
        assert_eq!(SecretKey::from_hex(&key.to_hex()).unwrap(), key);
    }
}
