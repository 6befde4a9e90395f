//! The client's ground floor: the words both backends speak, the kunci
//! wire engine (`engine.rs`) and the etcd backend (`etcd/`). What a call
//! asks ([`Key`], [`Op`], [`Submission`]), how it ends ([`Outcome`], and
//! for the caller [`Error`] and its reasons), the answers it may carry
//! (spec §8, §11, §13), and the contract's times. It imports nothing else
//! of the client but what an acquire asks for (`permits.rs`).

use std::fmt;
use std::time::{Duration, Instant};

use super::permits::{Label, Permits};
use crate::protocol::KEY_LEN_MAX;

/// The transport deadline: how long past its wait a call may take (spec
/// §8.2). It is part of the contract, not a setting.
pub const TRANSPORT_DEADLINE: Duration = Duration::from_secs(5);

/// The longest wait an acquire may ask for.
pub const WAIT_MAX: Duration = Duration::from_secs(255);

/// The longest lease (a whole number of seconds, at least one).
pub const LEASE_MAX: Duration = Duration::from_secs(255);

/// A key, validated and stored inline so that a request allocates nothing.
#[derive(Clone, Copy)]
pub(crate) struct Key {
    len: u8,
    bytes: [u8; KEY_LEN_MAX],
}

impl Key {
    /// No key, for the requests that carry none (`P`, `I`).
    pub(crate) const EMPTY: Key = Key {
        len: 0,
        bytes: [0; KEY_LEN_MAX],
    };

    /// A key of 1..=255 bytes without `\n`, or the reason it is invalid.
    pub(crate) fn new(key: &str) -> Result<Key, &'static str> {
        let bytes = key.as_bytes();
        if bytes.is_empty() {
            return Err("key is empty");
        }
        if bytes.len() > KEY_LEN_MAX {
            return Err("key is longer than 255 bytes");
        }
        if bytes.contains(&b'\n') {
            return Err("key contains a newline");
        }
        let mut inline = [0u8; KEY_LEN_MAX];
        inline[..bytes.len()].copy_from_slice(bytes);
        Ok(Key {
            len: bytes.len() as u8,
            bytes: inline,
        })
    }

    /// A prefix of keys for `L`: like a key, but it may be empty.
    pub(crate) fn prefix(prefix: &str) -> Result<Key, &'static str> {
        if prefix.is_empty() {
            return Ok(Key::EMPTY);
        }
        Key::new(prefix).map_err(|why| match why {
            "key is longer than 255 bytes" => "prefix is longer than 255 bytes",
            _ => "prefix contains a newline",
        })
    }

    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len as usize])
            .expect("a Key is copied from a whole `&str`")
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

/// What a request asks the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// `A`, or `S` when it asks for permits or carries a label (the
    /// protocol encoder decides). `wait_until` is `Dw`, or `None` for an
    /// original `wait = 0`, which stays 0 on the wire. `campaign`: a
    /// campaign's acquire, which on etcd stores its grant time (a kunci
    /// server knows it anyway).
    Acquire {
        owner: u64,
        lease_s: u8,
        wait_until: Option<Instant>,
        permits: Permits,
        label: Label,
        campaign: bool,
    },
    Release {
        token: u64,
    },
    Extend {
        token: u64,
        lease_s: u8,
    },
    Query,
    Ping {
        nonce: u64,
    },
    Info,
    /// `H`: the grants and waiters of the key. With `clean_up_for`, it is
    /// the clean-up after an acquire by that owner ended `Indeterminate`
    /// (spec §8 rule 11): every grant of that owner is released.
    Holders {
        id: u64,
        clean_up_for: Option<u64>,
    },
    /// `L`: one page of the keys that start with the request's key (here
    /// a prefix, possibly empty).
    List {
        id: u64,
        cursor: u64,
        count: u16,
    },
    /// `O`: the key's state, at once when its token is not `since`, else
    /// when it changes or `wait_s` ends (spec §13). `seen`: what the
    /// observer last reported besides the token; on etcd a change of it
    /// is answered at once too (a kunci server answers a proclaim
    /// itself, and sends nothing of it).
    Observe {
        id: u64,
        since: u64,
        wait_s: u8,
        seen: Option<Seen>,
    },
    /// `C`: the label of the grant `token` becomes `label` (spec §13.4a).
    Proclaim {
        token: u64,
        label: Label,
    },
}

/// What an observer last reported of a leader besides its term: a hash of
/// its value and whether its time in office was known (on etcd a
/// campaign stamps it into its entry just after its grant).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seen {
    pub label_hash: u64,
    pub held_known: bool,
}

impl Seen {
    /// What a key's state shows an observer.
    pub(crate) fn of(state: &KeyState) -> Seen {
        use std::hash::{Hash, Hasher};
        // Fixed keys: both sides of one process hash alike.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        state.label.hash(&mut hasher);
        Seen {
            label_hash: hasher.finish(),
            held_known: state.held_ms.is_some(),
        }
    }
}

/// One request as the caller hands it over: what to ask, about which key,
/// by when (`D`), and where the outcome goes (`None`: nobody waits, as for
/// a compensating or best-effort release).
pub(crate) struct Submission<R> {
    pub op: Op,
    pub key: Key,
    pub deadline: Instant,
    pub reply: Option<R>,
}

/// A key's state as one `O` answers it (spec §13.2).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyState {
    /// The key's current token: the smallest among its grants, 0 when it
    /// has none (or during a crash grace).
    pub token: u64,
    /// That grant's lease left, rounded up (during a grace: to its end).
    pub lease_ms: u32,
    /// How long that grant has been held, rounded down; `None` when
    /// unknown (on etcd, a grant whose holder stored no grant time: one
    /// not taken by a campaign, docs/ETCD.md).
    pub held_ms: Option<u32>,
    /// How many grants the key has (saturating).
    pub grants: u16,
    /// How many wait for it.
    pub waiters: u32,
    /// That grant's label.
    pub label: String,
}

/// How a request ended, as the engine saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A correlated `A`, noticed before `D`. `sent_at` is the instant just
    /// before the first byte of the request was handed to the socket.
    Acquired {
        token: u64,
        sent_at: Instant,
    },
    Timeout,
    Busy,
    Unavailable(Unavailable),
    Indeterminate,
    Released,
    Extended {
        sent_at: Instant,
    },
    NotHeld,
    /// A `C`: the grant has the proclaimed label.
    Proclaimed,
    Query(KeyStatus),
    Pong {
        round_trip: Duration,
    },
    Info(String),
    Holders(Holders),
    Keys(KeyPage),
    /// A `V` (spec §13).
    Observed(KeyState),
    /// A non-fatal `X`: the server found the request invalid.
    Invalid(&'static str),
    /// `X 10`: the acquire named a limit other than the key's, which the
    /// error's text names (`None` if it did not say it as the spec wants).
    LimitMismatch {
        key_limit: Option<u16>,
    },
    /// `X 12` as a session's first answer (none of its requests ran), or
    /// `X 13` for this request (spec §12).
    PermissionDenied(Denied),
}

/// Why a call did not succeed. Each variant says what the caller may
/// conclude from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// The server answered `T`: the key stayed held for the whole wait (or,
    /// with a zero wait, was held at the one attempt). Definitive: nothing
    /// was acquired and nothing is queued. Trying again is safe.
    Timeout,
    /// The server answered `B`: it had no capacity for the request, or is
    /// shutting down. Definitive: nothing was acquired or queued. Trying
    /// again later is safe.
    Busy,
    /// No server executed the request by the deadline: no byte of it
    /// reached any connection, or the only sessions that had it were
    /// refused at accept (`X 7`, `X 9`). Definitive: nothing changed. The
    /// reason tells which.
    Unavailable(Unavailable),
    /// The request may have reached the server, but its answer was not
    /// seen in time (no answer by the deadline, the connection died, or a
    /// grant arrived too late to hand over). The key may be held by this
    /// call's grant until its lease runs out. For an acquire: do **not**
    /// enter the critical section; a grant nobody saw is reclaimed by the
    /// server at the end of its lease (and a grant that arrived late is
    /// released by the client). For a release or renew: the lease may or
    /// may not have changed.
    Indeterminate,
    /// The input was rejected before anything was sent (or, if the server
    /// disagreed with the client's checks, by the server). Nothing changed.
    /// The text names the problem.
    InvalidArgument(&'static str),
    /// The server answered `N`: the token is not the key's active grant
    /// (its lease ran out, it was released, or it never existed). Nothing
    /// changed. A holder that gets this has lost the lock.
    NotHeld,
    /// The server answered `X 10`: the acquire named a limit other than
    /// the one the key has now (set by the first request that named one,
    /// and kept while the key has grants or waiters). Definitive: nothing
    /// was acquired or queued. `key_limit` is the key's limit, as the
    /// server's message names it.
    LimitMismatch { key_limit: Option<u16> },
    /// The server refused the request (spec §12). Definitive: nothing was
    /// executed; trying again with the same secret gives the same answer.
    PermissionDenied(Denied),
}

/// Why a request was [`Error::PermissionDenied`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// The server has `--auth` and did not take this client's secret (none
    /// configured, or one it does not know): `X 12` as the first answer of
    /// a session, which executed none of its requests.
    NotAuthenticated,
    /// The secret's scopes do not cover this key or operation (`X 13`).
    NotPermitted,
    /// Over TLS, the server refused this client's certificate, or its
    /// absence; the text names the problem.
    Certificate(&'static str),
}

/// Why a request was [`Error::Unavailable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// No server could be reached (connects failed or timed out, or
    /// sessions died before a byte of the request was written).
    Unreachable,
    /// The server refused the session at its connection limit (`X 7`).
    ConnectionLimit,
    /// The server refused the session: this client's address is not in
    /// its `--allow` list (`X 9`).
    NotAllowed,
    /// This client does not trust the server: its TLS certificate failed
    /// verification, for the reason given (or the handshake failed).
    Untrusted(&'static str),
    /// The peer at the address is no kunci server, or speaks TLS where
    /// plain TCP was addressed (or the reverse): its first bytes were no
    /// answer this client can read. The text says which. Nothing was
    /// executed, and waiting does not change it.
    WrongProtocol(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Timeout => f.write_str("timeout: the key stayed held for the whole wait"),
            Error::Busy => f.write_str("busy: the server has no capacity for the request"),
            Error::Unavailable(Unavailable::Unreachable) => {
                f.write_str("unavailable: no server could be reached; nothing was sent")
            }
            Error::Unavailable(Unavailable::ConnectionLimit) => f.write_str(
                "unavailable: the server is at its connection limit; nothing was executed",
            ),
            Error::Unavailable(Unavailable::NotAllowed) => f.write_str(
                "unavailable: the server does not allow this client's address; nothing was executed",
            ),
            Error::Unavailable(Unavailable::Untrusted(why)) => {
                write!(f, "unavailable: TLS: {why}; nothing was sent")
            }
            Error::Unavailable(Unavailable::WrongProtocol(why)) => {
                write!(f, "unavailable: {why}; nothing was executed")
            }
            Error::Indeterminate => f.write_str(
                "indeterminate: the request may have reached the server but no answer \
                 came in time; do not assume the lock is held",
            ),
            Error::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            Error::NotHeld => f.write_str("not held: that token is not the key's active grant"),
            Error::LimitMismatch {
                key_limit: Some(limit),
            } => write!(
                f,
                "limit mismatch: the key has a limit of {limit} permits; nothing was acquired"
            ),
            Error::LimitMismatch { key_limit: None } => f.write_str(
                "limit mismatch: the key has another limit of permits; nothing was acquired",
            ),
            Error::PermissionDenied(Denied::NotAuthenticated) => f.write_str(
                "permission denied: the server wants a secret it knows (--secret-file or \
                 KUNCI_SECRET); nothing was executed",
            ),
            Error::PermissionDenied(Denied::NotPermitted) => f.write_str(
                "permission denied: this secret's scopes do not cover that key or request; \
                 nothing changed",
            ),
            Error::PermissionDenied(Denied::Certificate(why)) => {
                write!(f, "permission denied: {why}")
            }
        }
    }
}

impl std::error::Error for Error {}

/// What `Q` tells about a key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyStatus {
    /// The active grant's token; 0 when no grant is known.
    pub token: u64,
    /// The owner id of the request that was granted.
    pub owner: u64,
    /// Time left on the lease, rounded up, in milliseconds.
    pub lease_ms: u32,
    /// Requests queued on the key.
    pub waiters: u32,
}

impl KeyStatus {
    /// Whether the key is free: no grant, no lease horizon, no waiters.
    pub fn is_free(&self) -> bool {
        *self == KeyStatus::default()
    }
}

/// Most grants, or waiters, one `H` answer lists (spec §11.2); a server
/// that sends more is broken, and its session is closed.
pub(crate) const HOLDERS_MAX: usize = 1000;

/// The grants and the queue of one key, as [`Client::holders`](super::Client::holders) found them.
///
/// A snapshot: out of date as soon as it arrives. Never use it as a lock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holders {
    /// The key's grants, in token order (the oldest grant first).
    pub grants: Vec<Grant>,
    /// The key's waiters, in queue order (the next to be served first).
    pub waiters: Vec<Waiter>,
    /// How many grants and waiters the server left out of its answer
    /// (it lists at most 1,000 of each); normally 0.
    pub left_out: u64,
}

impl Holders {
    /// Whether the key has no grant and no waiter (it is not in the table).
    pub fn is_free(&self) -> bool {
        self.grants.is_empty() && self.waiters.is_empty() && self.left_out == 0
    }
}

/// One grant of a key (a `G` frame).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The grant's fencing token. 0 is the unknown grant that holds every
    /// key until the horizon after an unclean restart (spec §7.2).
    pub token: u64,
    /// The owner id of the request that was granted (0 for a grant
    /// adopted after a restart).
    pub owner: u64,
    /// The permits it holds; 0 means all of them (exclusive).
    pub take: u16,
    /// The time left on its lease (the server rounds it up to a ms).
    pub lease_left: Duration,
    /// How long it has been held (rounded down to a ms).
    pub held_for: Duration,
    /// What its acquire said about who asks (empty when nothing).
    pub label: String,
}

/// One waiter of a key (a `W` frame).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiter {
    /// The owner id of the queued request.
    pub owner: u64,
    /// The permits it asks for; 0 means all of them (exclusive).
    pub take: u16,
    /// The time left until its wait runs out (rounded up to a ms).
    pub wait_left: Duration,
    /// What its acquire said about who asks (empty when nothing).
    pub label: String,
}

/// One key of the server's table (a `K` frame).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySummary {
    pub key: String,
    /// How many grants hold it.
    pub grants: u32,
    /// How many requests wait for it.
    pub waiters: u32,
    /// Its limit of permits; 0 when no request named one.
    pub limit: u16,
}

/// One page of [`Client::list_keys`](super::Client::list_keys): the keys, and the cursor to go on
/// with (0 when the listing is complete).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyPage {
    pub keys: Vec<KeySummary>,
    pub next: u64,
}

impl Op {
    /// The request in a few words, for the background requests' debug
    /// lines (compensating releases, the clean-up of spec §8 rule 11):
    /// `Release { token: 7 }`, as `Debug` writes the two kinds that run
    /// in the background, without the `Debug` of every kind (issue 28).
    pub(crate) fn summary(&self) -> String {
        match self {
            Op::Release { token } => format!("Release {{ token: {token} }}"),
            Op::Holders {
                id,
                clean_up_for: Some(owner),
            } => format!("Holders {{ id: {id}, clean_up_for: Some({owner}) }}"),
            Op::Acquire { .. } => "Acquire".to_owned(),
            Op::Extend { .. } => "Extend".to_owned(),
            Op::Query => "Query".to_owned(),
            Op::Ping { .. } => "Ping".to_owned(),
            Op::Info => "Info".to_owned(),
            Op::Holders { .. } => "Holders".to_owned(),
            Op::List { .. } => "List".to_owned(),
            Op::Observe { .. } => "Observe".to_owned(),
            Op::Proclaim { .. } => "Proclaim".to_owned(),
        }
    }
}

impl Outcome {
    /// The outcome in a few words, for the same debug lines: the variant
    /// and its reason as `Debug` writes them, the name alone for answers
    /// that carry data (a background request's data has no reader).
    pub(crate) fn summary(&self) -> String {
        match self {
            Outcome::Unavailable(why) => format!("Unavailable({why:?})"),
            Outcome::Invalid(text) => format!("Invalid({text:?})"),
            Outcome::PermissionDenied(denied) => format!("PermissionDenied({denied:?})"),
            Outcome::LimitMismatch {
                key_limit: Some(limit),
            } => format!("LimitMismatch {{ key_limit: Some({limit}) }}"),
            Outcome::LimitMismatch { key_limit: None } => {
                "LimitMismatch { key_limit: None }".to_owned()
            }
            Outcome::Acquired { token, .. } => format!("Acquired {{ token: {token} }}"),
            Outcome::Timeout => "Timeout".to_owned(),
            Outcome::Busy => "Busy".to_owned(),
            Outcome::Indeterminate => "Indeterminate".to_owned(),
            Outcome::Released => "Released".to_owned(),
            Outcome::Extended { .. } => "Extended".to_owned(),
            Outcome::NotHeld => "NotHeld".to_owned(),
            Outcome::Proclaimed => "Proclaimed".to_owned(),
            Outcome::Query(_) => "Query".to_owned(),
            Outcome::Pong { .. } => "Pong".to_owned(),
            Outcome::Info(_) => "Info".to_owned(),
            Outcome::Holders(_) => "Holders".to_owned(),
            Outcome::Keys(_) => "Keys".to_owned(),
            Outcome::Observed(_) => "Observed".to_owned(),
        }
    }
}

/// The margin taken off a lease to allow for the server's clock running
/// faster than ours: 10 ms plus 0.2 % of the lease (2000 ppm, twice the
/// worst slew NTP applies to two clocks that drift apart).
pub fn drift_margin(lease: Duration) -> Duration {
    Duration::from_millis(10) + lease / 500
}

/// The conservative expiry of a lease whose request was handed to the
/// socket just after `sent_at` (spec §8.9).
pub(crate) fn valid_until(sent_at: Instant, lease: Duration) -> Instant {
    sent_at + lease.saturating_sub(drift_margin(lease))
}

/// What a call's caller sees of an outcome that is no success.
pub(crate) fn outcome_error(outcome: Outcome) -> Error {
    match outcome {
        Outcome::Timeout => Error::Timeout,
        Outcome::Busy => Error::Busy,
        Outcome::Unavailable(why) => Error::Unavailable(why),
        Outcome::NotHeld => Error::NotHeld,
        Outcome::Invalid(why) => Error::InvalidArgument(why),
        Outcome::LimitMismatch { key_limit } => Error::LimitMismatch { key_limit },
        Outcome::PermissionDenied(why) => Error::PermissionDenied(why),
        // Every other outcome answers a different request: the engine
        // correlates by op, so it cannot come here; treat it as unknown.
        _ => Error::Indeterminate,
    }
}
