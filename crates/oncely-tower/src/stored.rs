//! What a key stores (the response, never the request body), the request
//! fingerprint, and bounded reading of bodies.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use oncely::BoxError;
use oncely::backend::Fingerprint;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{BodyFingerprint, RedactFn};
use crate::header::IDEMPOTENT_REPLAYED;

/// The stored response: status, the headers chosen for replay, and the body
/// (base64, so any bytes survive the JSON the ledgers store outcomes as).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StoredResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl StoredResponse {
    /// Keeps `status`, the `replay` headers found in `headers` (those whose
    /// values are visible ASCII) and `body`.
    pub(crate) fn new(
        status: StatusCode,
        headers: &http::HeaderMap,
        replay: &[HeaderName],
        body: &[u8],
    ) -> Self {
        let mut kept = Vec::new();
        for name in replay {
            for value in headers.get_all(name) {
                if let Ok(v) = value.to_str() {
                    kept.push((name.as_str().to_owned(), v.to_owned()));
                }
            }
        }
        StoredResponse {
            status: status.as_u16(),
            headers: kept,
            body: STANDARD.encode(body),
        }
    }

    /// What is stored of a handler's response: its status, the `replay`
    /// headers and the body, then each `redact` hook over them in order
    /// (the response the first caller gets is not changed).
    pub(crate) fn redacted(
        status: StatusCode,
        headers: &http::HeaderMap,
        replay: &[HeaderName],
        body: &Bytes,
        redact: &[RedactFn],
    ) -> Self {
        if redact.is_empty() {
            return StoredResponse::new(status, headers, replay, body);
        }
        let mut kept = Response::new(body.clone());
        *kept.status_mut() = status;
        for name in replay {
            for value in headers.get_all(name) {
                kept.headers_mut().append(name.clone(), value.clone());
            }
        }
        for hook in redact {
            hook(&mut kept);
        }
        let names: Vec<HeaderName> = kept.headers().keys().cloned().collect();
        StoredResponse::new(kept.status(), kept.headers(), &names, kept.body())
    }

    /// The stored bytes' size when encoded as an outcome, roughly (for the
    /// check against the ledger's limit before the handler's work is lost to
    /// a refused completion).
    pub(crate) fn encoded_len(&self) -> usize {
        // {"ok":{"status":…,"headers":[…],"body":"…"}} plus JSON escaping
        // of header values, which are visible ASCII (at most `\"`, `\\`).
        64 + self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + 2 * v.len() + 8)
                .sum::<usize>()
    }

    /// The response a retry gets: the stored status, headers and body, with
    /// `Idempotent-Replayed: true`.
    pub(crate) fn replay(&self) -> Response<Bytes> {
        let body = STANDARD.decode(&self.body).unwrap_or_default();
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() =
            StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        for (name, value) in &self.headers {
            if let (Ok(n), Ok(v)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) {
                response.headers_mut().append(n, v);
            }
        }
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED.clone(), HeaderValue::from_static("true"));
        response
    }
}

/// The request fingerprint: BLAKE3 over the method, the path and query, the
/// chosen headers (name and every value, in the order given) and the body
/// (its bytes, or its canonical JSON), each part length-prefixed so that no
/// two requests frame alike.
pub(crate) fn fingerprint(
    parts: &Parts,
    headers: &[HeaderName],
    how: BodyFingerprint,
    body: &[u8],
) -> Fingerprint {
    let mut h = blake3::Hasher::new_derive_key("oncely-tower 2026 request fingerprint");
    let mut part = |bytes: &[u8]| {
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    part(parts.method.as_str().as_bytes());
    part(
        parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |pq| pq.as_str())
            .as_bytes(),
    );
    for name in headers {
        part(name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        part(&(values.iter().count() as u64).to_le_bytes());
        for v in values {
            part(v.as_bytes());
        }
    }
    match how {
        BodyFingerprint::CanonicalJson => match serde_json::from_slice::<Value>(body) {
            Ok(value) => {
                let mut canonical = Vec::with_capacity(body.len());
                write_canonical(&value, &mut canonical);
                part(&canonical)
            }
            Err(_) => part(body),
        },
        BodyFingerprint::Exact => part(body),
    }
    Fingerprint::from_bytes(h.finalize().as_bytes()).expect("a BLAKE3 hash is 32 bytes")
}

/// Removes the members that `pointers` (JSON Pointers, RFC 6901:
/// `/card/number`) name from a JSON body; a body that is not JSON, or has
/// none of them, is left as it is. A changed body loses any
/// `Content-Length` header.
pub(crate) fn remove_json_members(response: &mut Response<Bytes>, pointers: &[String]) {
    let Ok(mut value) = serde_json::from_slice::<Value>(response.body()) else {
        return;
    };
    let mut changed = false;
    for pointer in pointers {
        let Some((parent, last)) = pointer.rsplit_once('/') else {
            continue;
        };
        let name = last.replace("~1", "/").replace("~0", "~");
        if let Some(Value::Object(map)) = value.pointer_mut(parent) {
            changed |= map.remove(&name).is_some();
        }
    }
    if changed && let Ok(bytes) = serde_json::to_vec(&value) {
        *response.body_mut() = Bytes::from(bytes);
        response.headers_mut().remove(http::header::CONTENT_LENGTH);
    }
}

/// How reading a body up to a limit ended, other than with its bytes.
pub(crate) enum ReadError {
    /// It is longer than the limit; reading stopped at the first frame past it.
    TooLarge,
    /// The body itself failed.
    Failed(BoxError),
}

/// Reads `body` whole if it is at most `limit` bytes, and stops at the first
/// frame that goes past the limit otherwise: never buffers more than
/// `limit` plus one frame.
pub(crate) async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(ReadError::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(ReadError::TooLarge),
        Err(e) => Err(ReadError::Failed(e)),
    }
}

/// `value` as JSON with every object's keys sorted and no whitespace, so
/// that two spellings of one value write the same bytes (whatever order
/// `serde_json`'s map keeps).
fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(Value::String(k.clone()).to_string().as_bytes());
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(body: &'static str) -> Response<Bytes> {
        let mut r = Response::new(Bytes::from_static(body.as_bytes()));
        r.headers_mut()
            .insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        r
    }

    #[test]
    fn json_members_are_removed_by_pointer_and_anything_else_is_left() {
        let mut r = response(r#"{"a/b":1,"n":{"x~y":2,"keep":3},"list":[{"t":1}]}"#);
        let pointers = ["/a~1b", "/n/x~0y", "/list/0/t", "/missing", "no-slash"].map(String::from);
        remove_json_members(&mut r, &pointers);
        let v: Value = serde_json::from_slice(r.body()).unwrap();
        // Members of objects only: an array element's member is removed too
        // (its parent is an object), an array element never is.
        assert_eq!(v, serde_json::json!({"n": {"keep": 3}, "list": [{}]}));
        assert!(!r.headers().contains_key(http::header::CONTENT_LENGTH));

        let mut untouched = response("not json, token=abc");
        remove_json_members(&mut untouched, &["/token".to_owned()]);
        assert_eq!(untouched.body(), &Bytes::from_static(b"not json, token=abc"));
        assert!(untouched.headers().contains_key(http::header::CONTENT_LENGTH));

        let mut nothing_named = response(r#"{"id":1}"#);
        remove_json_members(&mut nothing_named, &["/token".to_owned()]);
        assert_eq!(nothing_named.body(), &Bytes::from_static(br#"{"id":1}"#));
    }
}
