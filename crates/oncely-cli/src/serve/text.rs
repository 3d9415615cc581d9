//! Text of the page's links: keys and query values percent-encoded.

/// Percent-encodes a displayed key for a `/record/` path: everything but
/// the unreserved characters and the key's own `/` and `:`.
pub(crate) fn key_path(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/:".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encodes a query parameter's value.
pub(crate) fn query_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_encoded_for_paths() {
        assert_eq!(key_path("acme/capture:order-1"), "acme/capture:order-1");
        assert_eq!(key_path("acme/mail:a b?c"), "acme/mail:a%20b%3Fc");
        assert_eq!(query_value("a/b c"), "a%2Fb%20c");
    }
}
