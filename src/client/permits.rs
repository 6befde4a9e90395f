//! What an acquire asks for besides its key: how many of the key's permits
//! (spec §10) and a label saying who asks (§11).

use std::fmt;

use crate::protocol::{LABEL_LEN_MAX, SHARED_LIMIT};

/// How much of a key one grant holds (spec §10).
///
/// Every key has a number of permits, its **limit**, and every grant takes
/// some of them. The kinds a lock needs:
///
/// - [`Permits::exclusive()`] (the default): every permit; nobody else
///   holds the key at the same time. This is a plain lock, and the writer
///   of a reader/writer lock.
/// - [`Permits::shared()`]: one of 65535 permits; any number of shared
///   holders at once, none while an exclusive grant holds the key. The
///   reader of a reader/writer lock.
/// - [`Permits::limit(n)`](Permits::limit): one permit of a semaphore of
///   `n`, so at most `n` holders at once; [`take(k)`](Permits::take) takes
///   `k` of them.
///
/// The first request that names a limit sets the key's limit for as long
/// as the key has grants or waiters; a request naming another limit ends
/// [`Error::LimitMismatch`](super::Error::LimitMismatch). Every request
/// waits in one FIFO queue, whatever its kind: a writer queued behind
/// readers is served before the readers that came after it.
///
/// The constructors cannot fail; an acquire checks the combination before
/// it sends anything ([`Error::InvalidArgument`](super::Error::InvalidArgument)
/// for a `take` without a limit, or above it).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Permits {
    /// The wire's `limit`: 0 names none.
    limit: u16,
    /// The wire's `take`: 0 takes every permit.
    take: u16,
}

impl Permits {
    /// Every permit of the key: an exclusive lock (the default).
    pub const fn exclusive() -> Permits {
        Permits { limit: 0, take: 0 }
    }

    /// One permit of 65535: a shared lock, held together with other shared
    /// holders but never with an exclusive one.
    pub const fn shared() -> Permits {
        Permits {
            limit: SHARED_LIMIT,
            take: 1,
        }
    }

    /// One permit of a semaphore of `limit` permits (1..=65535).
    pub const fn limit(limit: u16) -> Permits {
        Permits { limit, take: 1 }
    }

    /// Takes `count` permits instead of one: 1..=the limit, or 0 for all
    /// of them (exclusive, on a key that has a limit).
    pub const fn take(self, count: u16) -> Permits {
        Permits {
            take: count,
            ..self
        }
    }

    /// The key's limit this names, if any.
    pub const fn key_limit(self) -> Option<u16> {
        if self.limit == 0 {
            None
        } else {
            Some(self.limit)
        }
    }

    /// How many permits this takes; `None` for all of them.
    pub const fn take_count(self) -> Option<u16> {
        if self.take == 0 {
            None
        } else {
            Some(self.take)
        }
    }

    /// Whether this takes every permit of the key.
    pub const fn is_exclusive(self) -> bool {
        self.take == 0
    }

    /// The wire's `limit` and `take`.
    pub(crate) const fn wire(self) -> (u16, u16) {
        (self.limit, self.take)
    }

    /// Whether the server would accept this (spec §10.1: `take ≥ 1` needs
    /// `1 ≤ take ≤ limit`), or why not.
    pub(crate) fn check(self) -> Result<(), &'static str> {
        match (self.limit, self.take) {
            (_, 0) => Ok(()),
            (0, _) => Err("a count of permits to take needs a limit"),
            (limit, take) if take > limit => Err("cannot take more permits than the limit"),
            _ => Ok(()),
        }
    }
}

impl fmt::Debug for Permits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `exclusive`, `shared`, `1 of 3`, `exclusive of 5`.
impl fmt::Display for Permits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.limit, self.take) {
            (0, 0) => f.write_str("exclusive"),
            (limit, 0) => write!(f, "exclusive of {limit}"),
            (SHARED_LIMIT, 1) => f.write_str("shared"),
            (limit, take) => write!(f, "{take} of {limit}"),
        }
    }
}

/// How [`Client::acquire_with`](super::Client::acquire_with) asks for a
/// key: which [`Permits`] (exclusive by default) and a label.
///
/// ```
/// use kunci::client::{AcquireOptions, Permits};
/// let options = AcquireOptions::new()
///     .permits(Permits::limit(3))
///     .label("nightly backup on db1");
/// # assert_eq!(options.get_permits(), Permits::limit(3));
/// ```
///
/// A [`Permits`] converts into options without a label.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AcquireOptions {
    permits: Permits,
    label: String,
    /// A campaign's acquire (spec §13.6): on etcd its entry stores its
    /// grant time, which is what a leader's `held_for` reads there.
    campaign: bool,
}

impl AcquireOptions {
    /// Exclusive, without a label: what [`Client::acquire`](super::Client::acquire) asks.
    pub fn new() -> AcquireOptions {
        AcquireOptions::default()
    }

    /// Asks for `permits` of the key.
    pub fn permits(mut self, permits: Permits) -> AcquireOptions {
        self.permits = permits;
        self
    }

    /// Free text saying who asks (0..=128 bytes of UTF-8 without a
    /// newline), stored with the waiter and the grant for `kunci who` to
    /// show. The server never interprets it.
    pub fn label(mut self, label: impl Into<String>) -> AcquireOptions {
        self.label = label.into();
        self
    }

    /// The permits asked for.
    pub fn get_permits(&self) -> Permits {
        self.permits
    }

    /// The label.
    pub fn get_label(&self) -> &str {
        &self.label
    }

    /// The same options for a campaign, whose grant time an etcd entry
    /// stores.
    pub(crate) fn for_campaign(mut self) -> AcquireOptions {
        self.campaign = true;
        self
    }

    pub(crate) fn is_campaign(&self) -> bool {
        self.campaign
    }
}

impl From<Permits> for AcquireOptions {
    fn from(permits: Permits) -> AcquireOptions {
        AcquireOptions::new().permits(permits)
    }
}

/// A label, validated and stored inline so that a request allocates
/// nothing (like its key).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Label {
    len: u8,
    bytes: [u8; LABEL_LEN_MAX],
}

impl Label {
    /// A label of 0..=128 bytes without `\n`, or the reason it is invalid.
    pub(crate) fn new(label: &str) -> Result<Label, &'static str> {
        let bytes = label.as_bytes();
        if bytes.len() > LABEL_LEN_MAX {
            return Err("label is longer than 128 bytes");
        }
        if bytes.contains(&b'\n') {
            return Err("label contains a newline");
        }
        let mut inline = [0u8; LABEL_LEN_MAX];
        inline[..bytes.len()].copy_from_slice(bytes);
        Ok(Label {
            len: bytes.len() as u8,
            bytes: inline,
        })
    }

    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)])
            .expect("a Label is copied from a whole `&str`")
    }
}

impl fmt::Debug for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_name_their_wire_values() {
        assert_eq!(Permits::default(), Permits::exclusive());
        assert_eq!(Permits::exclusive().wire(), (0, 0));
        assert_eq!(Permits::shared().wire(), (65535, 1));
        assert_eq!(Permits::limit(3).wire(), (3, 1));
        assert_eq!(Permits::limit(3).take(2).wire(), (3, 2));
        assert_eq!(Permits::limit(3).take(0).wire(), (3, 0));
        assert_eq!(Permits::limit(3).take(2).take_count(), Some(2));
        assert_eq!(Permits::limit(3).take(0).take_count(), None);
        assert_eq!(Permits::exclusive().key_limit(), None);
        assert_eq!(Permits::shared().key_limit(), Some(65535));
        assert!(Permits::limit(3).take(0).is_exclusive());
        assert!(!Permits::shared().is_exclusive());
        let shown: Vec<String> = [
            Permits::exclusive(),
            Permits::shared(),
            Permits::limit(3),
            Permits::limit(5).take(0),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(shown, ["exclusive", "shared", "1 of 3", "exclusive of 5"]);
    }

    #[test]
    fn permits_are_checked_as_the_server_checks_them() {
        for valid in [
            Permits::exclusive(),
            Permits::shared(),
            Permits::limit(1),
            Permits::limit(65535).take(65535),
            Permits::limit(7).take(0),
            Permits::shared().take(3),
        ] {
            assert_eq!(valid.check(), Ok(()), "{valid}");
        }
        assert_eq!(
            Permits::limit(0).check(),
            Err("a count of permits to take needs a limit")
        );
        assert_eq!(
            Permits::exclusive().take(1).check(),
            Err("a count of permits to take needs a limit")
        );
        assert_eq!(
            Permits::limit(3).take(4).check(),
            Err("cannot take more permits than the limit")
        );
    }

    #[test]
    fn labels_hold_128_bytes_without_a_newline() {
        let full = "é".repeat(64);
        assert_eq!(Label::new(&full).map(|l| l.as_str().len()), Ok(128));
        assert_eq!(Label::new("").map(|l| l.as_str().len()), Ok(0));
        assert_eq!(
            Label::new(&(full + "x")),
            Err("label is longer than 128 bytes")
        );
        assert_eq!(Label::new("a\nb"), Err("label contains a newline"));
    }
}
