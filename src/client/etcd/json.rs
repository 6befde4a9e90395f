//! Reading etcd's JSON answers, and the base64 its gateway puts keys and
//! values in. Everything here is peer input: a missing or malformed field
//! is `None`, never a panic.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
pub(crate) use tinyjson::JsonValue;

/// The deepest nesting accepted; etcd's answers nest about 5 levels. The
/// JSON parser recurses, so depth is checked before parsing.
const DEPTH_MAX: usize = 32;

/// Parses an answer body (one JSON object, surrounding whitespace allowed).
pub(crate) fn parse(body: &[u8]) -> Option<JsonValue> {
    let text = std::str::from_utf8(body).ok()?.trim();
    if nesting(text) > DEPTH_MAX {
        return None;
    }
    text.parse().ok()
}

/// The deepest bracket nesting outside strings.
fn nesting(text: &str) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for byte in text.bytes() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// The member `name` of an object.
pub(crate) fn field<'a>(value: &'a JsonValue, name: &str) -> Option<&'a JsonValue> {
    value.get::<HashMap<String, JsonValue>>()?.get(name)
}

/// An integer field. etcd writes 64-bit integers as strings and leaves out
/// fields that are zero, so a missing field is 0; a malformed one is `None`.
pub(crate) fn int(value: &JsonValue, name: &str) -> Option<i64> {
    match field(value, name) {
        None | Some(JsonValue::Null) => Some(0),
        Some(JsonValue::String(text)) => text.parse().ok(),
        Some(JsonValue::Number(number)) if number.fract() == 0.0 && number.abs() < 9.0e15 => {
            Some(*number as i64)
        }
        Some(_) => None,
    }
}

/// An unsigned 64-bit field (member ids), as [`int`].
pub(crate) fn uint(value: &JsonValue, name: &str) -> Option<u64> {
    match field(value, name) {
        None | Some(JsonValue::Null) => Some(0),
        Some(JsonValue::String(text)) => text.parse().ok(),
        Some(_) => int(value, name).and_then(|n| u64::try_from(n).ok()),
    }
}

/// A boolean field; missing is `false` (etcd leaves out false fields).
pub(crate) fn boolean(value: &JsonValue, name: &str) -> bool {
    matches!(field(value, name), Some(JsonValue::Boolean(true)))
}

/// An array field; missing is empty.
pub(crate) fn array<'a>(value: &'a JsonValue, name: &str) -> &'a [JsonValue] {
    match field(value, name) {
        Some(JsonValue::Array(items)) => items,
        _ => &[],
    }
}

/// A base64 field, decoded; missing is empty.
pub(crate) fn bytes(value: &JsonValue, name: &str) -> Option<Vec<u8>> {
    match field(value, name) {
        None => Some(Vec::new()),
        Some(JsonValue::String(text)) => STANDARD.decode(text).ok(),
        Some(_) => None,
    }
}

/// A text field; missing is empty.
pub(crate) fn text<'a>(value: &'a JsonValue, name: &str) -> &'a str {
    match field(value, name) {
        Some(JsonValue::String(text)) => text,
        _ => "",
    }
}

pub(crate) fn base64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_etcd_fields_and_refuses_what_is_malformed() {
        let answer = br#"{"header":{"revision":"12"},"succeeded":true,"kvs":[{"key":"cC9rLzE="}]}
"#;
        let value = parse(answer).unwrap();
        let header = field(&value, "header").unwrap();
        assert_eq!(int(header, "revision"), Some(12));
        assert_eq!(int(header, "raft_term"), Some(0), "missing is zero");
        assert!(boolean(&value, "succeeded"));
        let kvs = array(&value, "kvs");
        assert_eq!(bytes(&kvs[0], "key").unwrap(), b"p/k/1");
        assert_eq!(int(&value, "kvs"), None);
        assert!(parse(b"{\"a\":").is_none());
        assert!(parse(&[b'['; 10_000]).is_none(), "too deep for the parser");
        assert!(parse(b"\xff").is_none());
        assert_eq!(base64(b"p/k/1"), "cC9rLzE=");
    }
}
