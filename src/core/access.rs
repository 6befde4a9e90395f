//! Who may do what (spec §12.1–12.3): the `--auth` file, the secret check
//! of `U`, and the scopes every later request of a session is held to.
//!
//! The file holds SHA-256 hashes, never secrets. A `U` hashes its secret
//! once and compares the hash with every line in constant time, so neither
//! the answer's timing nor an early exit says how much of a hash matched.
//! The endpoint applies the result per connection; the core only filters
//! `L` by the session's prefixes.

use std::fmt;

use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::protocol::Request;

/// A secret shorter than this is refused without being looked up (a
/// constant of the protocol).
pub use crate::protocol::SECRET_MIN;

/// The longest name a line may have (it is sent back in `U`).
pub const NAME_MAX: usize = 128;

/// What one line of the `--auth` file allows. A prefix of `*` in the file
/// is kept as the empty prefix, which every key starts with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scopes {
    /// `lock:PREFIX`: every op on these keys.
    lock: Vec<Box<str>>,
    /// `read:PREFIX`: `Q` and `H` on these keys.
    read: Vec<Box<str>>,
    /// `info`: `I`.
    info: bool,
}

impl Scopes {
    /// Whether `request` is within these scopes (spec §12.1). `U` is not
    /// judged here: a second `U` is refused whatever the scopes.
    pub fn permit(&self, request: &Request<'_>) -> bool {
        match *request {
            Request::Acquire { key, .. }
            | Request::Release { key, .. }
            | Request::Extend { key, .. }
            | Request::Proclaim { key, .. } => covers(&self.lock, key),
            Request::Query { key }
            | Request::Holders { key, .. }
            | Request::Observe { key, .. } => covers(&self.lock, key) || covers(&self.read, key),
            Request::Info => self.info,
            Request::Ping { .. } => true,
            Request::List { .. } => !self.lock.is_empty() || !self.read.is_empty(),
            Request::Authenticate { .. } => false,
        }
    }

    /// Whether `L` shows `key` to this session: it lies within one of its
    /// `lock:` or `read:` prefixes.
    pub fn lists(&self, key: &str) -> bool {
        covers(&self.lock, key) || covers(&self.read, key)
    }
}

fn covers(prefixes: &[Box<str>], key: &str) -> bool {
    prefixes.iter().any(|prefix| key.starts_with(&**prefix))
}

/// What one identity's sessions may hold at once (issue 27): written
/// `max-keys=N`, `max-grants=N`, `max-watches=N` and `max-connections=N`
/// after the scopes of its line. `None` is
/// no quota (only the server's limits apply). A word starting `max-` was
/// never a scope, so a file without these words parses as before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    /// Keys the identity's requests brought into the table.
    pub max_keys: Option<u32>,
    /// Grants plus queued waiters the identity's sessions asked for.
    pub max_grants: Option<u32>,
    /// Watches (held `O`) the identity's sessions hold (spec §13.3).
    pub max_watches: Option<u32>,
    /// Sessions that completed `U` as the identity (spec §12.1).
    pub max_connections: Option<u32>,
}

impl Quota {
    pub fn is_none(&self) -> bool {
        self.max_keys.is_none()
            && self.max_grants.is_none()
            && self.max_watches.is_none()
            && self.max_connections.is_none()
    }
}

/// The largest quota a line may set: what the core's tables can index.
pub const QUOTA_MAX: u32 = (1 << 30) - 1;

/// One line of the `--auth` file.
#[derive(Clone, PartialEq, Eq)]
pub struct Identity {
    pub name: Box<str>,
    hash: [u8; 32],
    pub scopes: Scopes,
    pub quota: Quota,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("name", &self.name)
            .field("scopes", &self.scopes)
            .field("quota", &self.quota)
            .finish_non_exhaustive()
    }
}

/// The parsed `--auth` file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessList {
    identities: Vec<Identity>,
}

/// A line of the `--auth` file that does not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessError {
    /// 1-based.
    pub line: usize,
    pub reason: String,
}

impl fmt::Display for AccessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

impl std::error::Error for AccessError {}

impl AccessList {
    /// Parses the text of an `--auth` file: `NAME SHA256HEX SCOPE…` per
    /// line, `#` comment lines and blank lines.
    pub fn parse(text: &str) -> Result<AccessList, AccessError> {
        let mut identities: Vec<Identity> = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let error = |reason: String| AccessError {
                line: index + 1,
                reason,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_ascii_whitespace();
            let name = words.next().unwrap_or_default();
            validate_name(name).map_err(error)?;
            let hash = words
                .next()
                .ok_or_else(|| error("missing SHA256HEX after the name".into()))
                .and_then(|hex| parse_hash(hex).map_err(error))?;
            let (quota_words, scope_words): (Vec<&str>, Vec<&str>) =
                words.partition(|word| word.starts_with("max-"));
            let scopes = parse_scopes(&scope_words).map_err(error)?;
            let quota = parse_quota(&quota_words).map_err(error)?;
            if identities.iter().any(|known| *known.name == *name) {
                return Err(error(format!("name {name:?} appears twice")));
            }
            if identities.iter().any(|known| known.hash == hash) {
                return Err(error("the same hash appears twice".into()));
            }
            identities.push(Identity {
                name: name.into(),
                hash,
                scopes,
                quota,
            });
        }
        Ok(AccessList { identities })
    }

    pub fn len(&self) -> usize {
        self.identities.len()
    }

    pub fn is_empty(&self) -> bool {
        self.identities.is_empty()
    }

    /// The identity with this index (as returned by
    /// [`authenticate`](Self::authenticate)).
    pub fn identity(&self, index: u32) -> Option<&Identity> {
        self.identities.get(index as usize)
    }

    /// Whether any line sets a quota.
    pub fn has_quotas(&self) -> bool {
        self.identities
            .iter()
            .any(|identity| !identity.quota.is_none())
    }

    /// The index of the line whose hash is the secret's, if any. A secret
    /// under [`SECRET_MIN`] bytes matches nothing. Every line is compared,
    /// each in constant time, whatever matches.
    pub fn authenticate(&self, secret: &[u8]) -> Option<u32> {
        if secret.len() < SECRET_MIN {
            return None;
        }
        let digest = sha256(secret);
        let mut found = u32::MAX;
        for (index, identity) in self.identities.iter().enumerate() {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            found.conditional_assign(&index, identity.hash.ct_eq(&digest));
        }
        (found != u32::MAX).then_some(found)
    }
}

/// The SHA-256 of `secret`: ring's when TLS brings ring into the binary,
/// else sha2's, so the binary carries one implementation.
fn sha256(secret: &[u8]) -> [u8; 32] {
    #[cfg(feature = "tls")]
    {
        let digest = ring::digest::digest(&ring::digest::SHA256, secret);
        let mut bytes = [0; 32];
        bytes.copy_from_slice(digest.as_ref());
        bytes
    }
    #[cfg(not(feature = "tls"))]
    {
        use sha2::Digest;
        sha2::Sha256::digest(secret).into()
    }
}

/// The SHA-256 of `secret` as lowercase hex: the `--auth` file's form.
pub fn hash_hex(secret: &[u8]) -> String {
    sha256(secret)
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// Checks a line's name: 1..=128 printable ASCII characters, no blanks.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_MAX {
        return Err(format!("name must be 1..={NAME_MAX} characters"));
    }
    if let Some(first) = name.chars().find(|c| !c.is_ascii_graphic()) {
        let what = match first {
            ' ' => "a space".to_owned(),
            c if c.is_whitespace() => format!("a blank ({c:?})"),
            c if c.is_control() => format!("a control character ({c:?})"),
            c => format!("{c:?}, which is not ASCII"),
        };
        // The same name with its blanks as dashes, when that is one.
        let dashed: String = name
            .chars()
            .map(|c| if c.is_whitespace() { '-' } else { c })
            .collect();
        let example = if dashed.bytes().all(|byte| byte.is_ascii_graphic()) {
            format!(" (such as {dashed:?})")
        } else {
            String::new()
        };
        return Err(format!(
            "name {name:?} has {what}: a name is one word of printable ASCII, without \
             blanks{example}"
        ));
    }
    Ok(())
}

fn parse_hash(hex: &str) -> Result<[u8; 32], String> {
    let bad = || format!("{hex:?} is not a SHA-256 in hex (64 hex digits)");
    if hex.len() != 64 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut hash = [0; 32];
    for (byte, pair) in hash.iter_mut().zip(hex.as_bytes().chunks(2)) {
        let pair = std::str::from_utf8(pair).map_err(|_| bad())?;
        *byte = u8::from_str_radix(pair, 16).map_err(|_| bad())?;
    }
    Ok(hash)
}

/// Parses the scopes of one line: at least one of `lock:PREFIX`,
/// `read:PREFIX` (`*` as the whole prefix: every key) and `info`.
pub fn parse_scopes(words: &[&str]) -> Result<Scopes, String> {
    if words.is_empty() {
        return Err("no scope: a line needs at least one of lock:PREFIX, read:PREFIX, info".into());
    }
    let mut scopes = Scopes::default();
    for &word in words {
        if word == "info" {
            scopes.info = true;
            continue;
        }
        let (list, prefix) = if let Some(prefix) = word.strip_prefix("lock:") {
            (&mut scopes.lock, prefix)
        } else if let Some(prefix) = word.strip_prefix("read:") {
            (&mut scopes.read, prefix)
        } else {
            return Err(format!(
                "unknown scope {word:?} (lock:PREFIX, read:PREFIX or info)"
            ));
        };
        let prefix = match prefix {
            "*" => "",
            "" => {
                return Err(format!(
                    "scope {word:?} has an empty prefix (write {word}* for every key)"
                ));
            }
            _ if prefix.contains('*') => {
                return Err(format!(
                    "scope {word:?}: * may only be the whole prefix (every key)"
                ));
            }
            _ if prefix.len() > 255 => {
                return Err(format!("scope {word:?}: prefix longer than 255 bytes"));
            }
            _ => prefix,
        };
        list.push(prefix.into());
    }
    Ok(scopes)
}

/// Parses the quota words of one line: `max-keys=N`, `max-grants=N`,
/// `max-watches=N` and `max-connections=N` (decimal, 0..=[`QUOTA_MAX`]), each at most once.
pub fn parse_quota(words: &[&str]) -> Result<Quota, String> {
    let mut quota = Quota::default();
    for &word in words {
        let (name, value) = word.split_once('=').unwrap_or((word, ""));
        let slot = match name {
            "max-keys" => &mut quota.max_keys,
            "max-grants" => &mut quota.max_grants,
            "max-watches" => &mut quota.max_watches,
            "max-connections" => &mut quota.max_connections,
            _ => {
                return Err(format!(
                    "unknown quota {word:?} (max-keys=N, max-grants=N, max-watches=N \
                     or max-connections=N)"
                ));
            }
        };
        if slot.is_some() {
            return Err(format!("quota {name} appears twice"));
        }
        let number = value
            .bytes()
            .all(|byte| byte.is_ascii_digit())
            .then(|| value.parse::<u32>().ok())
            .flatten()
            .filter(|&number| number <= QUOTA_MAX)
            .ok_or_else(|| format!("quota {word:?}: N must be a number 0..={QUOTA_MAX}"))?;
        *slot = Some(number);
    }
    Ok(quota)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn line(name: &str, secret: &[u8], scopes: &str) -> String {
        format!("{name} {} {scopes}\n", hash_hex(secret))
    }

    #[test]
    fn parses_comments_blank_lines_and_either_case() {
        let upper = hash_hex(SECRET).to_uppercase();
        let text = format!("\n  # a comment\n\t\nci {upper} lock:ci/ read:* info\n");
        let list = AccessList::parse(&text).unwrap();
        assert_eq!(list.len(), 1);
        let index = list.authenticate(SECRET).unwrap();
        let identity = list.identity(index).unwrap();
        assert_eq!(&*identity.name, "ci");
        assert!(identity.scopes.info);
    }

    /// `kunci secret 'bad name'`: the message says what is wrong with
    /// the name (a space), and a name that would do.
    #[test]
    fn a_bad_name_says_which_character_is_wrong() {
        assert_eq!(
            validate_name("bad name"),
            Err(
                "name \"bad name\" has a space: a name is one word of printable ASCII, \
                 without blanks (such as \"bad-name\")"
                    .to_owned()
            )
        );
        assert_eq!(
            validate_name("a\tb"),
            Err(
                "name \"a\\tb\" has a blank ('\\t'): a name is one word of printable \
                 ASCII, without blanks (such as \"a-b\")"
                    .to_owned()
            )
        );
        assert_eq!(
            validate_name("caf\u{e9}"),
            Err(
                "name \"caf\u{e9}\" has '\u{e9}', which is not ASCII: a name is one word of \
                 printable ASCII, without blanks"
                    .to_owned()
            )
        );
        assert_eq!(validate_name("ci-runner_1"), Ok(()));
    }

    #[test]
    fn bad_lines_name_their_number() {
        let good = line("a", SECRET, "info");
        let cases = [
            ("b\n", "missing SHA256HEX"),
            ("b 1234 info\n", "not a SHA-256"),
            (
                &line("b", b"another secret of thirty-two bytes", ""),
                "no scope",
            ),
            (
                &line("b", b"another secret of thirty-two bytes", "lock:"),
                "empty prefix",
            ),
            (
                &line("b", b"another secret of thirty-two bytes", "lock:a*"),
                "whole prefix",
            ),
            (
                &line("b", b"another secret of thirty-two bytes", "*"),
                "unknown scope",
            ),
            (
                &line("b", b"another secret of thirty-two bytes", "write:x"),
                "unknown scope",
            ),
            (
                &line("a", b"another secret of thirty-two bytes", "info"),
                "twice",
            ),
            (&line("b", SECRET, "info"), "twice"),
            (
                &line("b", b"another secret of thirty-two bytes", "max-keys=5"),
                "no scope",
            ),
            (
                &line("b", b"another secret of thirty-two bytes", "info max-key=5"),
                "unknown quota",
            ),
            (
                &line("b", b"another secret of thirty-two bytes", "info max-keys="),
                "must be a number",
            ),
            (
                &line(
                    "b",
                    b"another secret of thirty-two bytes",
                    "info max-keys=+5",
                ),
                "must be a number",
            ),
            (
                &line(
                    "b",
                    b"another secret of thirty-two bytes",
                    "info max-grants=1073741824",
                ),
                "must be a number",
            ),
            (
                &line(
                    "b",
                    b"another secret of thirty-two bytes",
                    "info max-keys=1 max-keys=2",
                ),
                "max-keys appears twice",
            ),
        ];
        for (bad, reason) in cases {
            let text = format!("# header\n{good}{bad}");
            let error = AccessList::parse(&text).unwrap_err();
            assert_eq!(error.line, 3, "{bad}");
            assert!(error.reason.contains(reason), "{bad}: {}", error.reason);
        }
    }

    #[test]
    fn quotas_follow_the_scopes_and_old_lines_have_none() {
        let other = b"another secret of thirty-two bytes";
        let text = line("old", SECRET, "lock:t/ read:* info")
            + &line("new", other, "lock:t/ max-keys=100 max-grants=0 info")
            + &line(
                "capped",
                b"a third secret of thirty-two bytes",
                "read:* max-watches=10 max-connections=4",
            );
        let list = AccessList::parse(&text).unwrap();
        assert!(list.has_quotas());
        let old = list.identity(0).unwrap();
        assert_eq!(old.quota, Quota::default());
        assert_eq!(
            old.scopes,
            parse_scopes(&["lock:t/", "read:*", "info"]).unwrap()
        );
        let new = list.identity(1).unwrap();
        assert_eq!(
            new.quota,
            Quota {
                max_keys: Some(100),
                max_grants: Some(0),
                max_watches: None,
                max_connections: None,
            }
        );
        assert_eq!(new.scopes, parse_scopes(&["lock:t/", "info"]).unwrap());
        assert_eq!(
            list.identity(2).unwrap().quota,
            Quota {
                max_watches: Some(10),
                max_connections: Some(4),
                ..Quota::default()
            }
        );
        let max = format!("info max-grants={QUOTA_MAX}");
        let list = AccessList::parse(&line("a", SECRET, &max)).unwrap();
        assert_eq!(list.identity(0).unwrap().quota.max_grants, Some(QUOTA_MAX));
        let none = AccessList::parse(&line("a", SECRET, "lock:max-keys=1")).unwrap();
        assert!(!none.has_quotas());
        assert!(none.identity(0).unwrap().scopes.lists("max-keys=1/x"));
    }

    #[test]
    fn short_and_unknown_secrets_match_nothing() {
        let list = AccessList::parse(&line("a", SECRET, "info")).unwrap();
        assert_eq!(list.authenticate(&SECRET[..31]), None);
        assert_eq!(list.authenticate(b"0123456789abcdef0123456789abcdeX"), None);
        assert_eq!(list.authenticate(SECRET), Some(0));
    }

    #[test]
    fn scopes_cover_ops_by_prefix() {
        let scopes = parse_scopes(&["lock:a/", "read:b/", "info"]).unwrap();
        let acquire = |key| Request::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: 1,
            key,
            limit: 0,
            take: 0,
            label: "",
        };
        assert!(scopes.permit(&acquire("a/x")));
        assert!(scopes.permit(&acquire("a/")));
        assert!(!scopes.permit(&acquire("a")));
        assert!(!scopes.permit(&acquire("b/x")));
        assert!(scopes.permit(&Request::Query { key: "b/x" }));
        assert!(scopes.permit(&Request::Query { key: "a/x" }));
        assert!(!scopes.permit(&Request::Query { key: "c" }));
        assert!(!scopes.permit(&Request::Release {
            token: 1,
            key: "b/x"
        }));
        assert!(scopes.permit(&Request::Info));
        assert!(scopes.lists("b/1") && scopes.lists("a/1") && !scopes.lists("c"));
        let none = parse_scopes(&["info"]).unwrap();
        assert!(!none.permit(&Request::List {
            id: 1,
            cursor: 0,
            count: 1,
            prefix: ""
        }));
        assert!(none.permit(&Request::Ping { nonce: 1 }));
        let every = parse_scopes(&["lock:*"]).unwrap();
        assert!(every.permit(&acquire("anything")));
        assert!(!every.permit(&Request::Info));
    }
}
