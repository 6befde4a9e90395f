//! Reading etcd's JSON answers, and the base64 its gateway puts keys and
//! values in. Everything here is peer input: a missing or malformed field
//! is `None`, never a panic.
//!
//! The parser is kunci's own (RFC 8259, what etcd's gateway writes): a
//! JSON library brought in float parsing and formatting for numbers, which
//! etcd writes as integers or, for 64-bit ones, as strings (issue 28,
//! docs/BENCHMARKS.md "Binary size").

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

/// The deepest nesting accepted; etcd's answers nest about 5 levels. The
/// parser recurses, so this bounds its stack.
const DEPTH_MAX: usize = 32;

/// A parsed JSON value. A number keeps its literal (checked against the
/// grammar): only [`int`] reads one, exactly.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum JsonValue {
    Null,
    Boolean(bool),
    Number(String),
    String(String),
    Array(Vec<JsonValue>),
    /// Members in the order written; a repeated name: the last one counts.
    Object(Vec<(String, JsonValue)>),
}

impl JsonValue {
    /// A string as JSON text. kunci writes its requests' JSON itself and
    /// only needs strings quoted: any other value is an error.
    pub(crate) fn stringify(&self) -> Result<String, std::fmt::Error> {
        match self {
            JsonValue::String(text) => {
                let mut out = String::with_capacity(text.len() + 2);
                write_string(text, &mut out);
                Ok(out)
            }
            _ => Err(std::fmt::Error),
        }
    }
}

fn write_string(text: &str, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let code = u32::from(c) as usize;
                out.push_str("\\u00");
                out.push(char::from(HEX[code >> 4]));
                out.push(char::from(HEX[code & 15]));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Parses an answer body (one JSON value, surrounding whitespace allowed).
pub(crate) fn parse(body: &[u8]) -> Option<JsonValue> {
    let text = std::str::from_utf8(body).ok()?;
    let mut parser = Parser {
        text: text.as_bytes(),
        at: 0,
    };
    let value = parser.value(0)?;
    parser.skip_blank();
    (parser.at == parser.text.len()).then_some(value)
}

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn skip_blank(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.text.get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte after blanks, consumed.
    fn next(&mut self) -> Option<u8> {
        self.skip_blank();
        let byte = *self.text.get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    fn literal(&mut self, rest: &[u8], value: JsonValue) -> Option<JsonValue> {
        let end = self.at.checked_add(rest.len())?;
        (self.text.get(self.at..end)? == rest).then(|| {
            self.at = end;
            value
        })
    }

    fn value(&mut self, depth: usize) -> Option<JsonValue> {
        match self.next()? {
            b'n' => self.literal(b"ull", JsonValue::Null),
            b't' => self.literal(b"rue", JsonValue::Boolean(true)),
            b'f' => self.literal(b"alse", JsonValue::Boolean(false)),
            b'"' => self.string().map(JsonValue::String),
            b'[' if depth < DEPTH_MAX => {
                let mut items = Vec::new();
                self.skip_blank();
                if self.text.get(self.at) == Some(&b']') {
                    self.at += 1;
                    return Some(JsonValue::Array(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    match self.next()? {
                        b',' => {}
                        b']' => return Some(JsonValue::Array(items)),
                        _ => return None,
                    }
                }
            }
            b'{' if depth < DEPTH_MAX => {
                let mut members = Vec::new();
                if self.next()? == b'}' {
                    return Some(JsonValue::Object(members));
                }
                self.at -= 1;
                loop {
                    if self.next()? != b'"' {
                        return None;
                    }
                    let name = self.string()?;
                    if self.next()? != b':' {
                        return None;
                    }
                    members.push((name, self.value(depth + 1)?));
                    match self.next()? {
                        b',' => {}
                        b'}' => return Some(JsonValue::Object(members)),
                        _ => return None,
                    }
                }
            }
            b'-' | b'0'..=b'9' => {
                let start = self.at - 1;
                self.at = start + number_length(&self.text[start..])?;
                // The literal is ASCII digits and signs: valid UTF-8.
                let literal = std::str::from_utf8(&self.text[start..self.at]).ok()?;
                Some(JsonValue::Number(literal.to_owned()))
            }
            _ => None,
        }
    }

    /// A string's contents after its opening quote, unescaped.
    fn string(&mut self) -> Option<String> {
        let mut out = Vec::new();
        loop {
            let byte = *self.text.get(self.at)?;
            self.at += 1;
            match byte {
                b'"' => return String::from_utf8(out).ok(),
                b'\\' => {
                    let escape = *self.text.get(self.at)?;
                    self.at += 1;
                    let c = match escape {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.escaped_char()?,
                        _ => return None,
                    };
                    let mut utf8 = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes());
                }
                0..=0x1f => return None,
                _ => out.push(byte),
            }
        }
    }

    /// The character of a `\u` escape (after the `u`), a surrogate pair
    /// read whole.
    fn escaped_char(&mut self) -> Option<char> {
        let high = self.hex4()?;
        if !(0xd800..0xdc00).contains(&high) {
            return char::from_u32(high);
        }
        if self.text.get(self.at..self.at + 2)? != b"\\u" {
            return None;
        }
        self.at += 2;
        let low = self.hex4()?;
        if !(0xdc00..0xe000).contains(&low) {
            return None;
        }
        char::from_u32(0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00))
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.text.get(self.at..self.at + 4)?;
        self.at += 4;
        digits.iter().try_fold(0u32, |code, &digit| {
            Some(code << 4 | char::from(digit).to_digit(16)?)
        })
    }
}

/// The length of the number literal `text` starts with (RFC 8259:
/// `-? int frac? exp?`), or `None` if it is malformed.
fn number_length(text: &[u8]) -> Option<usize> {
    let digits = |from: usize| {
        text[from..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let mut at = usize::from(text.first() == Some(&b'-'));
    match text.get(at)? {
        b'0' => at += 1,
        b'1'..=b'9' => at += digits(at),
        _ => return None,
    }
    if text.get(at) == Some(&b'.') {
        let fraction = digits(at + 1);
        if fraction == 0 {
            return None;
        }
        at += 1 + fraction;
    }
    if let Some(b'e' | b'E') = text.get(at) {
        at += 1;
        if let Some(b'+' | b'-') = text.get(at) {
            at += 1;
        }
        let exponent = digits(at);
        if exponent == 0 {
            return None;
        }
        at += exponent;
    }
    Some(at)
}

/// The integer a number literal is, if it is one (`12`, `12.0`, `1.2e1`)
/// of magnitude below 9·10^15, the integers a JSON reader that holds
/// numbers as doubles (as etcd's peers do) reads exactly.
fn integer(literal: &str) -> Option<i64> {
    let (negative, unsigned) = match literal.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, literal),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].parse::<i64>().ok()?),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{whole}{fraction}");
    let digits = digits.trim_start_matches('0');
    // The value is `digits` × 10^shift.
    let shift = exponent.checked_sub(i64::try_from(fraction.len()).ok()?)?;
    let significant = digits.trim_end_matches('0');
    let zeros = i64::try_from(digits.len() - significant.len()).ok()?;
    let power = shift.checked_add(zeros)?;
    if significant.is_empty() {
        return Some(0);
    }
    if power < 0 || power.checked_add(i64::try_from(significant.len()).ok()?)? > 16 {
        return None;
    }
    let mut value: i64 = significant.parse().ok()?;
    for _ in 0..power {
        value = value.checked_mul(10)?;
    }
    if value >= 9_000_000_000_000_000 {
        return None;
    }
    Some(if negative { -value } else { value })
}

/// The member `name` of an object.
pub(crate) fn field<'a>(value: &'a JsonValue, name: &str) -> Option<&'a JsonValue> {
    match value {
        JsonValue::Object(members) => members
            .iter()
            .rev()
            .find_map(|(member, value)| (member == name).then_some(value)),
        _ => None,
    }
}

/// An integer field. etcd writes 64-bit integers as strings and leaves out
/// fields that are zero, so a missing field is 0; a malformed one is `None`.
pub(crate) fn int(value: &JsonValue, name: &str) -> Option<i64> {
    match field(value, name) {
        None | Some(JsonValue::Null) => Some(0),
        Some(JsonValue::String(text)) => text.parse().ok(),
        Some(JsonValue::Number(literal)) => integer(literal),
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

    #[test]
    fn parses_the_whole_grammar_and_nothing_else() {
        let value = parse(
            br#" {"s":"a\"b\\c\/\b\f\n\r\t\u00e9\ud83d\ude00","n":-0.5e-3,"t":true,
                 "f":false,"z":null,"a":[],"o":{},"d":1,"d":2} "#,
        )
        .unwrap();
        assert_eq!(text(&value, "s"), "a\"b\\c/\u{8}\u{c}\n\r\t\u{e9}\u{1f600}");
        assert_eq!(
            field(&value, "n"),
            Some(&JsonValue::Number("-0.5e-3".to_owned()))
        );
        assert!(boolean(&value, "t") && !boolean(&value, "f"));
        assert_eq!(field(&value, "z"), Some(&JsonValue::Null));
        assert_eq!(array(&value, "a"), &[]);
        assert_eq!(field(&value, "o"), Some(&JsonValue::Object(Vec::new())));
        assert_eq!(
            int(&value, "d"),
            Some(2),
            "a repeated name: the last counts"
        );
        for bad in [
            &b"{\"a\":1,}"[..],
            b"[1 2]",
            b"{\"a\" 1}",
            b"\"\x01\"",
            b"\"\\x\"",
            b"\"\\ud83d\"",
            b"01",
            b"1.",
            b"1e",
            b"-",
            b"tru",
            b"nulll",
            b"{} {}",
            b"",
        ] {
            assert!(parse(bad).is_none(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(
            parse(
                &[b'['; 32]
                    .iter()
                    .chain(&[b']'; 32])
                    .copied()
                    .collect::<Vec<_>>()
            )
            .is_some()
        );
        assert!(
            parse(
                &[b'['; 33]
                    .iter()
                    .chain(&[b']'; 33])
                    .copied()
                    .collect::<Vec<_>>()
            )
            .is_none()
        );
    }

    #[test]
    fn numbers_are_integers_exactly_as_doubles_read_them() {
        let value = |literal: &str| {
            let body = format!("{{\"v\":{literal}}}");
            int(&parse(body.as_bytes()).unwrap(), "v")
        };
        assert_eq!(value("5"), Some(5));
        assert_eq!(value("-12"), Some(-12));
        assert_eq!(value("0"), Some(0));
        assert_eq!(value("-0.0"), Some(0));
        assert_eq!(value("12.0"), Some(12));
        assert_eq!(value("1.2e1"), Some(12));
        assert_eq!(value("1200E-2"), Some(12));
        assert_eq!(value("8999999999999999"), Some(8_999_999_999_999_999));
        assert_eq!(value("9000000000000000"), None);
        assert_eq!(value("1e300"), None);
        assert_eq!(value("1.5"), None);
        assert_eq!(value("5e-1"), None);
        assert_eq!(value("\"42\""), Some(42));
        assert_eq!(value("true"), None);
        assert_eq!(value("1e9223372036854775807"), None, "no overflow");
    }

    proptest::proptest! {
        /// Any bytes at all (an answer cut short, a proxy's error page):
        /// a value or `None`, never a panic; and what it accepts it
        /// accepts whole, whatever follows is refused.
        #[test]
        fn any_bytes_parse_or_are_refused(
            raw in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
            jsonish in "[\\[\\]{}\":,0-9eE.+\\-tfnrul\\\\ ]{0,60}",
            pick_raw in proptest::bool::ANY,
        ) {
            let body = if pick_raw { raw } else { jsonish.into_bytes() };
            if parse(&body).is_some() {
                let mut longer = body.clone();
                longer.extend_from_slice(b" x");
                proptest::prop_assert!(parse(&longer).is_none());
            }
        }

        /// Every string kunci writes reads back as itself.
        #[test]
        fn written_strings_read_back(text in "\\PC*|[\\x00-\\x1f\"\\\\]*") {
            let written = JsonValue::String(text.clone()).stringify().unwrap();
            proptest::prop_assert_eq!(parse(written.as_bytes()), Some(JsonValue::String(text)));
        }
    }

    #[test]
    fn writes_strings_escaped() {
        let written = JsonValue::String("a\"\\\n\u{1}\u{7f}é".to_owned())
            .stringify()
            .unwrap();
        assert_eq!(written, "\"a\\\"\\\\\\n\\u0001\u{7f}é\"");
        assert!(JsonValue::Null.stringify().is_err());
    }
}
