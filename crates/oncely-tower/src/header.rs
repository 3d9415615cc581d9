//! The `Idempotency-Key` request header: an RFC 8941 structured-field string.

use http::HeaderMap;
use http::header::{GetAll, HeaderName, HeaderValue};

/// The request header that carries the client's key.
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a replayed response (`true`).
pub static IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response header on every answer the layer gives itself (a
/// [`Rejection`](crate::Rejection)), whose value is its
/// [`code`](crate::Rejection::code): `Idempotency-Rejection: key-reused`.
/// An application's own 422 (a JSON body its extractor refused) has none.
pub static IDEMPOTENCY_REJECTION: HeaderName = HeaderName::from_static("idempotency-rejection");

/// The longest key accepted, in bytes (after unquoting).
pub const MAX_CLIENT_KEY_BYTES: usize = 255;

/// The client key of a request: `Ok(None)` when the header is absent,
/// `Err(reason)` when it is present but not a usable key.
///
/// The value is an sf-string (`"8e03978e-40d5-43e8-bc93-6894a57f9324"`):
/// printable ASCII in double quotes, with `\"` and `\\` as the only escapes.
/// Parameters after it (`"k";a=1`) are ignored, as RFC 8941 has receivers do
/// with parameters they do not know. With `accept_bare`, a value without
/// quotes (`8e03978e-…`, what many clients send) is taken as the same key as
/// its quoted form, provided it is printable ASCII without whitespace, `"`,
/// `,` or `;`. The header sent twice is refused (which would be the key?).
pub(crate) fn client_key(headers: &HeaderMap, accept_bare: bool) -> Result<Option<String>, String> {
    let values: GetAll<'_, HeaderValue> = headers.get_all(&IDEMPOTENCY_KEY);
    let mut iter = values.iter();
    let Some(value) = iter.next() else { return Ok(None) };
    if iter.next().is_some() {
        return Err("Idempotency-Key must be sent once".into());
    }
    parse(value.as_bytes(), accept_bare).map(Some)
}

fn parse(raw: &[u8], accept_bare: bool) -> Result<String, String> {
    let raw = trim(raw);
    let key = match raw.first() {
        Some(b'"') => {
            let mut key = String::new();
            let mut i = 1;
            loop {
                match raw.get(i) {
                    None => return Err("Idempotency-Key: the string has no closing quote".into()),
                    Some(b'\\') => match raw.get(i + 1) {
                        Some(&c @ (b'"' | b'\\')) => {
                            key.push(c as char);
                            i += 2;
                        }
                        _ => return Err("Idempotency-Key: only \\\" and \\\\ may be escaped".into()),
                    },
                    Some(b'"') => break,
                    Some(&c) if (0x20..=0x7e).contains(&c) => {
                        key.push(c as char);
                        i += 1;
                    }
                    Some(_) => return Err("Idempotency-Key: only printable ASCII is allowed".into()),
                }
            }
            let rest = trim(&raw[i + 1..]);
            if !(rest.is_empty() || rest.first() == Some(&b';')) {
                return Err("Idempotency-Key: unexpected text after the string".into());
            }
            key
        }
        Some(_) if accept_bare => {
            if let Some(c) = raw
                .iter()
                .find(|&&c| !(0x21..=0x7e).contains(&c) || matches!(c, b'"' | b',' | b';'))
            {
                return Err(format!(
                    "Idempotency-Key: byte 0x{c:02x} is not allowed in an unquoted key; send a quoted string"
                ));
            }
            String::from_utf8_lossy(raw).into_owned()
        }
        Some(_) => {
            return Err("Idempotency-Key must be a structured-field string in double quotes (\"…\")".into());
        }
        None => return Err("Idempotency-Key is empty".into()),
    };
    if key.is_empty() {
        return Err("Idempotency-Key is empty".into());
    }
    if key.len() > MAX_CLIENT_KEY_BYTES {
        return Err(format!(
            "Idempotency-Key is {} bytes, the limit is {MAX_CLIENT_KEY_BYTES}",
            key.len()
        ));
    }
    if key.trim() != key {
        return Err("Idempotency-Key must not start or end with spaces".into());
    }
    Ok(key)
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|&c| c != b' ' && c != b'\t').unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|&c| c != b' ' && c != b'\t')
        .map_or(start, |e| e + 1);
    &b[start..end]
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn sf_strings_and_bare_tokens() {
        assert_eq!(parse(br#""8e03-40d5""#, false).unwrap(), "8e03-40d5");
        assert_eq!(parse(br#"  "a\"b\\c"  "#, false).unwrap(), r#"a"b\c"#);
        assert_eq!(parse(br#""k";x=1"#, false).unwrap(), "k");
        assert_eq!(parse(b"8e03-40d5", true).unwrap(), "8e03-40d5");
        assert!(parse(b"8e03-40d5", false).is_err());
        assert!(parse(br#""""#, true).is_err());
        assert!(parse(br#""open"#, true).is_err());
        assert!(parse(br#""a\n""#, true).is_err());
        assert!(parse(br#""a" b"#, true).is_err());
        assert!(parse(b"a b", true).is_err());
        assert!(parse(b"", true).is_err());
        assert!(parse(br#"" a""#, true).is_err());
        assert!(parse(format!("\"{}\"", "x".repeat(256)).as_bytes(), true).is_err());
        assert_eq!(
            parse(format!("\"{}\"", "x".repeat(255)).as_bytes(), true)
                .unwrap()
                .len(),
            255
        );
    }
}
