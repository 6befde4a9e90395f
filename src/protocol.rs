//! The wire format: request and response frames, their incremental
//! decoders and their encoders. No IO happens here.
//!
//! Every frame is `op` (one ASCII byte), a fixed binary header whose size
//! depends on `op`, a variable part, then `\n`. The fixed header may contain
//! `0x0A`, so decoders consume it by byte count before they look for the
//! terminating newline. All integers are big-endian.
//!
//! Decoding is a single pass over the buffered bytes that never allocates
//! for a request: [`decode_request`] either borrows one whole frame from the
//! buffer, says that more bytes are needed, or reports an error — and it
//! enforces the size limits itself, so a peer can never make the reader
//! buffer more than [`REQUEST_FRAME_MAX`] bytes of one frame.

use std::borrow::Cow;
use std::fmt;

/// Longest variable part (key) a request may carry, in bytes.
pub const KEY_LEN_MAX: usize = 255;

/// Longest label an `S` request (and so a grant or waiter) may carry, in
/// bytes (spec §11).
pub const LABEL_LEN_MAX: usize = 128;

/// How many bytes after a request's fixed header may pass without a `\n`
/// before the frame is "too long" (error 2): the variable part plus its
/// terminator. `S` has its own bound, [`PERMITS_TAIL_MAX`] past its key.
pub const REQUEST_TAIL_MAX: usize = KEY_LEN_MAX + 1;

/// How many bytes after an `S` (or `C`) frame's key may pass without a
/// `\n`: the label plus its terminator. The key itself is taken by its
/// `klen`.
pub const PERMITS_TAIL_MAX: usize = LABEL_LEN_MAX + 1;

/// The fixed header of an `S` frame:
/// `wait:u8 lease:u8 owner:u64 limit:u16 take:u16 klen:u8`.
const PERMITS_HEADER_LEN: usize = 15;

/// The fixed header of a `C` frame: `token:u64 klen:u8`.
const PROCLAIM_HEADER_LEN: usize = 9;

/// The largest request frame: `S`, its 15-byte header, a 255-byte key, a
/// 128-byte label, `\n` (400 bytes; the other ops stop at 267).
pub const REQUEST_FRAME_MAX: usize = 1 + PERMITS_HEADER_LEN + KEY_LEN_MAX + PERMITS_TAIL_MAX;

/// Most keys one `L` request may ask for (spec §11).
pub const LIST_COUNT_MAX: u16 = 1000;

/// The limit of a shared lock: every reader takes one of 65535 permits.
pub const SHARED_LIMIT: u16 = u16::MAX;

/// Longest text a response (`I` or `X`) may carry before a client decoder
/// gives up on the stream.
pub const RESPONSE_TEXT_MAX: usize = 4096;

/// The largest single frame the server sends: an `I` line with every
/// counter at its maximum is under 400 bytes, a `K` with a 255-byte key
/// 275, a `G` with a 128-byte label 164; an `X` is at most 91.
pub const RESPONSE_FRAME_MAX: usize = 512;

/// Longest text the server puts in an `X` frame.
pub const ERROR_TEXT_MAX: usize = 80;

/// Longest wait a request can ask for, in seconds (`wait` is a `u8`).
pub const WAIT_S_MAX: u8 = u8::MAX;

/// The shortest secret a `U` may carry (spec §12): a server refuses a
/// shorter one without looking it up, and a client sends none.
pub const SECRET_MIN: usize = 32;

/// A request from a client to the server. Keys borrow from the read buffer.
/// Its `Debug` shows a secret's length, never the secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Request<'a> {
    /// `A wait:u8 lease:u8 owner:u64 key \n`, or
    /// `S wait:u8 lease:u8 owner:u64 limit:u16 take:u16 klen:u8 key label \n`
    /// (spec §10). `A` is `S` with limit 0, take 0 and no label, so both
    /// decode to this; the encoder writes `A` whenever it can.
    Acquire {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: &'a str,
        /// The key's number of permits; 0 names none.
        limit: u16,
        /// How many permits to take; 0 takes them all (exclusive).
        take: u16,
        /// Who is asking, 0..=128 bytes without `\n` (spec §11).
        label: &'a str,
    },
    /// `R token:u64 key \n`
    Release { token: u64, key: &'a str },
    /// `E lease:u8 token:u64 key \n`
    Extend {
        lease_s: u8,
        token: u64,
        key: &'a str,
    },
    /// `Q key \n`
    Query { key: &'a str },
    /// `P nonce:u64 \n`
    Ping { nonce: u64 },
    /// `I \n`
    Info,
    /// `H id:u64 key \n` — the grants and waiters of one key (spec §11).
    Holders { id: u64, key: &'a str },
    /// `L id:u64 cursor:u64 count:u16 prefix \n` — one page of the keys
    /// in the table (spec §11).
    List {
        id: u64,
        cursor: u64,
        count: u16,
        prefix: &'a str,
    },
    /// `U secret \n` — the first request of a session on a server with
    /// `--auth` (spec §12).
    Authenticate { secret: &'a [u8] },
    /// `O wait:u8 id:u64 since:u64 key \n` — the key's current token, at
    /// once when it is not `since`, else when it changes or `wait` ends
    /// (spec §13).
    Observe {
        wait_s: u8,
        id: u64,
        since: u64,
        key: &'a str,
    },
    /// `C token:u64 klen:u8 key label \n` — the label of the grant `token`
    /// of `key` becomes `label` (spec §13.4a).
    Proclaim {
        token: u64,
        key: &'a str,
        label: &'a str,
    },
}

/// A `Debug` for a secret that never shows it, only its length.
impl fmt::Debug for Secret<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{} bytes>", self.0.len())
    }
}

/// Wraps a secret so that debug output cannot leak it.
struct Secret<'a>(&'a [u8]);

impl fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
                limit,
                take,
                label,
            } => f
                .debug_struct("Acquire")
                .field("wait_s", &wait_s)
                .field("lease_s", &lease_s)
                .field("owner", &owner)
                .field("key", &key)
                .field("limit", &limit)
                .field("take", &take)
                .field("label", &label)
                .finish(),
            Request::Release { token, key } => f
                .debug_struct("Release")
                .field("token", &token)
                .field("key", &key)
                .finish(),
            Request::Extend {
                lease_s,
                token,
                key,
            } => f
                .debug_struct("Extend")
                .field("lease_s", &lease_s)
                .field("token", &token)
                .field("key", &key)
                .finish(),
            Request::Query { key } => f.debug_struct("Query").field("key", &key).finish(),
            Request::Ping { nonce } => f.debug_struct("Ping").field("nonce", &nonce).finish(),
            Request::Info => f.write_str("Info"),
            Request::Holders { id, key } => f
                .debug_struct("Holders")
                .field("id", &id)
                .field("key", &key)
                .finish(),
            Request::List {
                id,
                cursor,
                count,
                prefix,
            } => f
                .debug_struct("List")
                .field("id", &id)
                .field("cursor", &cursor)
                .field("count", &count)
                .field("prefix", &prefix)
                .finish(),
            Request::Authenticate { secret } => f
                .debug_struct("Authenticate")
                .field("secret", &Secret(secret))
                .finish(),
            Request::Observe {
                wait_s,
                id,
                since,
                key,
            } => f
                .debug_struct("Observe")
                .field("wait_s", &wait_s)
                .field("id", &id)
                .field("since", &since)
                .field("key", &key)
                .finish(),
            Request::Proclaim { token, key, label } => f
                .debug_struct("Proclaim")
                .field("token", &token)
                .field("key", &key)
                .field("label", &label)
                .finish(),
        }
    }
}

impl Request<'_> {
    /// What ties this request to its answer.
    pub fn correlation(&self) -> Correlation {
        match *self {
            Request::Acquire { owner, .. } => Correlation::Acquire { owner },
            Request::Release { token, .. } => Correlation::Release { token },
            Request::Extend { token, .. } => Correlation::Extend { token },
            Request::Query { .. } => Correlation::Query,
            Request::Ping { nonce } => Correlation::Ping { nonce },
            Request::Info => Correlation::Info,
            Request::Holders { id, .. } => Correlation::Holders { id },
            Request::List { id, .. } => Correlation::List { id },
            Request::Authenticate { .. } => Correlation::Authenticate,
            Request::Observe { id, .. } => Correlation::Observe { id },
            Request::Proclaim { token, .. } => Correlation::Proclaim { token },
        }
    }

    /// Whether this acquire is the plain exclusive `A` (spec §10.1: limit
    /// 0, take 0, no label), which the encoder writes as an `A` frame.
    /// `false` for every other op.
    pub fn is_plain_acquire(&self) -> bool {
        matches!(
            *self,
            Request::Acquire {
                limit: 0,
                take: 0,
                label: "",
                ..
            }
        )
    }

    /// The identifier an `X` answer to this request carries: the owner of an
    /// acquire, the token of a release or extend, the nonce of a ping.
    pub fn error_id(&self) -> u64 {
        self.correlation().error_id()
    }
}

/// The part of a request its answer is recognised by (spec §2.3, §6): the
/// op and the id the answer echoes. `A`, `T` and `B` answer an acquire
/// (`A` or `S`) by `owner`; `R`, `E` and `N` a release or extend by
/// `token`; `C` and `N` a proclaim by `token`; `P` a ping by `nonce`; `Q`, `I` and `U` carry no id and answer
/// the oldest query, info or authenticate request, in order; `G` and `W`
/// answer a holders request and `K` a list request by `id`, several frames
/// per request, the last one always a `Z` with that `id`
/// ([`Response::ends_answer`]); an `X` carries the request's
/// [`error_id`](Self::error_id).
/// Every loop that correlates answers (server tests, client, bench) uses
/// this one rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Correlation {
    Acquire { owner: u64 },
    Release { token: u64 },
    Extend { token: u64 },
    Query,
    Ping { nonce: u64 },
    Info,
    Holders { id: u64 },
    List { id: u64 },
    Authenticate,
    Observe { id: u64 },
    Proclaim { token: u64 },
}

impl Correlation {
    /// The id an `X` answer to the request carries.
    pub fn error_id(self) -> u64 {
        match self {
            Correlation::Acquire { owner } => owner,
            Correlation::Release { token }
            | Correlation::Extend { token }
            | Correlation::Proclaim { token } => token,
            Correlation::Ping { nonce } => nonce,
            Correlation::Holders { id }
            | Correlation::List { id }
            | Correlation::Observe { id } => id,
            Correlation::Query | Correlation::Info | Correlation::Authenticate => 0,
        }
    }

    /// Whether `response` answers the request, or is one frame of its
    /// answer (`G`, `W`, `K`: see [`Response::ends_answer`]). A fatal `X`
    /// ends the whole session rather than answering one request; callers
    /// decide on it before they correlate.
    pub fn is_answered_by(self, response: &Response) -> bool {
        match (response, self) {
            (
                Response::Acquired { owner, .. }
                | Response::Timeout { owner }
                | Response::Busy { owner },
                Correlation::Acquire { owner: sent },
            ) => *owner == sent,
            (Response::Released { token }, Correlation::Release { token: sent })
            | (Response::Extended { token }, Correlation::Extend { token: sent })
            | (Response::Proclaimed { token }, Correlation::Proclaim { token: sent })
            | (
                Response::NotHeld { token },
                Correlation::Release { token: sent }
                | Correlation::Extend { token: sent }
                | Correlation::Proclaim { token: sent },
            ) => *token == sent,
            (Response::Pong { nonce }, Correlation::Ping { nonce: sent }) => *nonce == sent,
            (Response::Query { .. }, Correlation::Query)
            | (Response::Info(_), Correlation::Info)
            | (Response::Authenticated { .. }, Correlation::Authenticate) => true,
            (
                Response::Grant { id, .. } | Response::Waiter { id, .. } | Response::End { id, .. },
                Correlation::Holders { id: sent },
            )
            | (
                Response::Key { id, .. } | Response::End { id, .. },
                Correlation::List { id: sent },
            ) => *id == sent,
            (Response::KeyState { id, .. }, Correlation::Observe { id: sent }) => *id == sent,
            (Response::Error { id, .. }, sent) => *id == sent.error_id(),
            _ => false,
        }
    }
}

/// A response from the server to a client.
#[derive(Clone, PartialEq, Eq)]
pub enum Response {
    /// `A owner:u64 token:u64 \n` — the acquire with this owner was granted.
    Acquired { owner: u64, token: u64 },
    /// `T owner:u64 \n` — the acquire ran out of wait (or `wait=0` on a held key).
    Timeout { owner: u64 },
    /// `B owner:u64 \n` — no capacity: nothing was granted or queued.
    Busy { owner: u64 },
    /// `R token:u64 \n` — the grant with this token was released.
    Released { token: u64 },
    /// `E token:u64 \n` — the grant's lease was reset.
    Extended { token: u64 },
    /// `N token:u64 \n` — that token is not the key's active grant.
    NotHeld { token: u64 },
    /// `C token:u64 \n` — the grant with this token has the proclaimed
    /// label (spec §13.4a).
    Proclaimed { token: u64 },
    /// `Q token:u64 owner:u64 lease_ms:u32 waiters:u32 \n` — token 0 = free.
    Query {
        token: u64,
        owner: u64,
        lease_ms: u32,
        waiters: u32,
    },
    /// `P nonce:u64 \n`
    Pong { nonce: u64 },
    /// `I text \n` — server counters as `name=value` pairs.
    Info(String),
    /// `X code:u8 id:u64 text \n`. The server's texts are static, so an
    /// `X` costs no allocation, except `X 10`, which names the key's limit
    /// ([`Response::limit_mismatch`]); a decoded one owns its text.
    Error {
        code: u8,
        id: u64,
        text: Cow<'static, str>,
    },
    /// `G id:u64 token:u64 owner:u64 lease_ms:u32 held_ms:u32 take:u16 label \n`
    /// — one grant of the key a holders request (`H`) asked about.
    Grant {
        id: u64,
        token: u64,
        owner: u64,
        lease_ms: u32,
        held_ms: u32,
        take: u16,
        label: String,
    },
    /// `W id:u64 owner:u64 wait_ms:u32 take:u16 label \n` — one waiter of
    /// the key a holders request (`H`) asked about.
    Waiter {
        id: u64,
        owner: u64,
        wait_ms: u32,
        take: u16,
        label: String,
    },
    /// `K id:u64 grants:u32 waiters:u32 limit:u16 key \n` — one key of a
    /// list request (`L`).
    Key {
        id: u64,
        grants: u32,
        waiters: u32,
        limit: u16,
        key: String,
    },
    /// `Z id:u64 count:u32 next:u64 \n` — the last frame of the answer to
    /// `H` or `L`: `count` frames were sent; `next` is the number left out
    /// (`H`) or the cursor to continue with, 0 at the end (`L`).
    End { id: u64, count: u32, next: u64 },
    /// `U name \n` — the session is authenticated as `name` (empty on a
    /// server without `--auth`).
    Authenticated { name: String },
    /// `V id:u64 token:u64 lease_ms:u32 held_ms:u32 grants:u16 waiters:u32
    /// label \n` — the state of the key an observe request (`O`) watches
    /// (spec §13): token 0 = free (then all numbers 0, no label).
    KeyState {
        id: u64,
        token: u64,
        lease_ms: u32,
        held_ms: u32,
        grants: u16,
        waiters: u32,
        label: String,
    },
}

/// What `#[derive(Debug)]` prints (without its `{:#?}` layout), written
/// with `Display` for the numbers: the derived impl and the numbers'
/// `Debug` cost the binary 2 KB more (issue 28).
impl fmt::Debug for Response {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Response::Acquired { owner, token } => {
                write!(f, "Acquired {{ owner: {owner}, token: {token} }}")
            }
            Response::Timeout { owner } => write!(f, "Timeout {{ owner: {owner} }}"),
            Response::Busy { owner } => write!(f, "Busy {{ owner: {owner} }}"),
            Response::Released { token } => write!(f, "Released {{ token: {token} }}"),
            Response::Extended { token } => write!(f, "Extended {{ token: {token} }}"),
            Response::NotHeld { token } => write!(f, "NotHeld {{ token: {token} }}"),
            Response::Proclaimed { token } => write!(f, "Proclaimed {{ token: {token} }}"),
            Response::Query {
                token,
                owner,
                lease_ms,
                waiters,
            } => write!(
                f,
                "Query {{ token: {token}, owner: {owner}, lease_ms: {lease_ms}, waiters: {waiters} }}"
            ),
            Response::Pong { nonce } => write!(f, "Pong {{ nonce: {nonce} }}"),
            Response::Info(text) => write!(f, "Info({text:?})"),
            Response::Error { code, id, text } => {
                write!(f, "Error {{ code: {code}, id: {id}, text: {:?} }}", &**text)
            }
            Response::Grant {
                id,
                token,
                owner,
                lease_ms,
                held_ms,
                take,
                label,
            } => write!(
                f,
                "Grant {{ id: {id}, token: {token}, owner: {owner}, lease_ms: {lease_ms}, \
                 held_ms: {held_ms}, take: {take}, label: {label:?} }}"
            ),
            Response::Waiter {
                id,
                owner,
                wait_ms,
                take,
                label,
            } => write!(
                f,
                "Waiter {{ id: {id}, owner: {owner}, wait_ms: {wait_ms}, take: {take}, \
                 label: {label:?} }}"
            ),
            Response::Key {
                id,
                grants,
                waiters,
                limit,
                key,
            } => write!(
                f,
                "Key {{ id: {id}, grants: {grants}, waiters: {waiters}, limit: {limit}, \
                 key: {key:?} }}"
            ),
            Response::End { id, count, next } => {
                write!(f, "End {{ id: {id}, count: {count}, next: {next} }}")
            }
            Response::Authenticated { name } => write!(f, "Authenticated {{ name: {name:?} }}"),
            Response::KeyState {
                id,
                token,
                lease_ms,
                held_ms,
                grants,
                waiters,
                label,
            } => write!(
                f,
                "KeyState {{ id: {id}, token: {token}, lease_ms: {lease_ms}, held_ms: {held_ms}, \
                 grants: {grants}, waiters: {waiters}, label: {label:?} }}"
            ),
        }
    }
}

impl Response {
    /// Whether this frame is the last of its request's answer: everything
    /// but `G`, `W` and `K`, which a `Z` follows.
    pub fn ends_answer(&self) -> bool {
        !matches!(
            self,
            Response::Grant { .. } | Response::Waiter { .. } | Response::Key { .. }
        )
    }

    /// The `X 10` answer to an `S` whose limit is not the key's: its text
    /// names the key's limit, exactly `limit mismatch: key limit N`.
    pub fn limit_mismatch(owner: u64, key_limit: u16) -> Response {
        Response::Error {
            code: ErrorCode::LimitMismatch as u8,
            id: owner,
            text: Cow::Owned(format!("{LIMIT_MISMATCH_PREFIX}{key_limit}")),
        }
    }
}

/// What the text of every `X 10` starts with; the key's limit follows.
const LIMIT_MISMATCH_PREFIX: &str = "limit mismatch: key limit ";

/// The key's limit named by the text of an `X 10`, if the text is the
/// one the spec prescribes (`limit mismatch: key limit N`).
pub fn parse_limit_mismatch(text: &str) -> Option<u16> {
    let digits = text.strip_prefix(LIMIT_MISMATCH_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The error codes of `X` frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorCode {
    /// The op byte is not one of `A R E Q P I S H L U O C`: framing is lost.
    UnknownOp = 1,
    /// No `\n` within 256 bytes after the fixed header (`S`, `C`: within
    /// `klen` + 129).
    FrameTooLong = 2,
    /// The key is empty.
    EmptyKey = 3,
    /// The key (or an `S` or `C` label, or an `L` prefix) is not valid
    /// UTF-8, or an `S` or `C` key contains `\n`.
    KeyNotUtf8 = 4,
    /// A lease of 0 seconds in `A` or `E`.
    ZeroLease = 5,
    /// A variable part where the op allows none (`P`, `I`).
    UnexpectedPayload = 6,
    /// The server is at its connection limit.
    ConnectionLimit = 7,
    /// The server is shutting down.
    ShuttingDown = 8,
    /// The peer's address is not in the server's `--allow` list.
    NotAllowed = 9,
    /// An `S` names a limit other than the key's (spec §10.2). Its text
    /// names the key's limit: build it with [`Response::limit_mismatch`].
    LimitMismatch = 10,
    /// An `S` take/limit or an `L` count out of range.
    InvalidCount = 11,
    /// A request before a successful `U`, or a `U` with an unknown secret
    /// (spec §12).
    NotAuthenticated = 12,
    /// The session's scopes do not cover this key or op (spec §12).
    NotPermitted = 13,
    /// An `O` that would be held over `--max-waits-per-conn` or
    /// `--max-waiters` (spec §13.3).
    TooManyWatches = 14,
}

impl ErrorCode {
    /// Whether the server closes the connection after sending this error.
    pub fn is_fatal(self) -> bool {
        matches!(
            self,
            ErrorCode::UnknownOp
                | ErrorCode::FrameTooLong
                | ErrorCode::ConnectionLimit
                | ErrorCode::ShuttingDown
                | ErrorCode::NotAllowed
                | ErrorCode::NotAuthenticated
        )
    }

    /// The short explanation the server sends with the code. For
    /// [`LimitMismatch`](Self::LimitMismatch) the server sends
    /// [`Response::limit_mismatch`] instead, which names the limit.
    pub fn text(self) -> &'static str {
        match self {
            ErrorCode::UnknownOp => "unknown op byte",
            ErrorCode::FrameTooLong => "frame too long: no newline where the frame must end",
            ErrorCode::EmptyKey => "key is empty",
            ErrorCode::KeyNotUtf8 => "key is not valid UTF-8",
            ErrorCode::ZeroLease => "lease must be 1..=255 seconds",
            ErrorCode::UnexpectedPayload => "this op takes no payload",
            ErrorCode::ConnectionLimit => "connection limit reached",
            ErrorCode::ShuttingDown => "server shutting down",
            ErrorCode::NotAllowed => "peer not allowed",
            ErrorCode::LimitMismatch => "limit mismatch: not the key's limit",
            ErrorCode::InvalidCount => "invalid count",
            ErrorCode::NotAuthenticated => "not authenticated",
            ErrorCode::NotPermitted => "not permitted",
            ErrorCode::TooManyWatches => "too many watches",
        }
    }

    /// The code for a wire value, if it is one of ours.
    pub fn from_u8(code: u8) -> Option<ErrorCode> {
        Some(match code {
            1 => ErrorCode::UnknownOp,
            2 => ErrorCode::FrameTooLong,
            3 => ErrorCode::EmptyKey,
            4 => ErrorCode::KeyNotUtf8,
            5 => ErrorCode::ZeroLease,
            6 => ErrorCode::UnexpectedPayload,
            7 => ErrorCode::ConnectionLimit,
            8 => ErrorCode::ShuttingDown,
            9 => ErrorCode::NotAllowed,
            10 => ErrorCode::LimitMismatch,
            11 => ErrorCode::InvalidCount,
            12 => ErrorCode::NotAuthenticated,
            13 => ErrorCode::NotPermitted,
            14 => ErrorCode::TooManyWatches,
            _ => return None,
        })
    }

    /// The `X` frame for this error, with its standard text.
    pub fn response(self, id: u64) -> Response {
        Response::Error {
            code: self as u8,
            id,
            text: Cow::Borrowed(self.text()),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "error {} ({})", *self as u8, self.text())
    }
}

/// A request the decoder refused, with the id its `X` answer carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestError {
    pub code: ErrorCode,
    pub id: u64,
}

impl RequestError {
    /// The `X` frame that answers this error.
    pub fn response(self) -> Response {
        self.code.response(self.id)
    }
}

/// What [`decode_request`] found at the start of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// The buffer holds only part of a frame; read more and call again.
    Incomplete,
    /// A valid request whose frame takes the first `len` bytes.
    Request { request: Request<'a>, len: usize },
    /// A well-framed but invalid request taking `len` bytes: answer with
    /// `X`, skip the frame and go on.
    Invalid { error: RequestError, len: usize },
    /// Framing is lost: answer with `X` and close the connection.
    Fatal(RequestError),
}

/// The fixed-header size of a request op, or `None` for an unknown op.
#[inline]
pub fn request_header_len(op: u8) -> Option<usize> {
    match op {
        b'A' => Some(10),
        b'R' => Some(8),
        b'E' => Some(9),
        b'Q' | b'I' | b'U' => Some(0),
        b'P' | b'H' => Some(8),
        b'S' => Some(PERMITS_HEADER_LEN),
        b'L' => Some(18),
        b'O' => Some(17),
        b'C' => Some(PROCLAIM_HEADER_LEN),
        _ => None,
    }
}

/// Decodes the request frame at the start of `buf`.
///
/// Never reads past the first frame and never needs more than
/// [`REQUEST_FRAME_MAX`] bytes to decide: a caller that keeps what this
/// returns `Incomplete` for holds at most one frame's worth of bytes.
pub fn decode_request(buf: &[u8]) -> Decoded<'_> {
    // `A` and `R` (the hot pair) get copies of the decoder with their op
    // a constant, so that none of the other ops' framing (`S` finding its
    // key by `klen`) or checks is on their path.
    match buf.first() {
        None => Decoded::Incomplete,
        Some(b'A') => decode_op(buf, b'A'),
        Some(b'R') => decode_op(buf, b'R'),
        Some(&op) => decode_op(buf, op),
    }
}

/// [`decode_request`] for a frame whose first byte is `op`.
#[inline(always)]
fn decode_op(buf: &[u8], op: u8) -> Decoded<'_> {
    let Some(header_len) = request_header_len(op) else {
        return Decoded::Fatal(RequestError {
            code: ErrorCode::UnknownOp,
            id: 0,
        });
    };
    let tail_start = 1 + header_len;
    let Some(header) = buf.get(1..tail_start) else {
        return Decoded::Incomplete;
    };
    let id = header_id(op, header);
    // `S` and `C` take their key by the count in their header (its last
    // byte), and only then look for the `\n` after the label; every other
    // op looks right away.
    let (search_start, tail_max) = if op == b'S' || op == b'C' {
        (
            tail_start + usize::from(header[header_len - 1]),
            PERMITS_TAIL_MAX,
        )
    } else {
        (tail_start, REQUEST_TAIL_MAX)
    };
    if buf.len() < search_start {
        return Decoded::Incomplete;
    }
    let tail = &buf[search_start..buf.len().min(search_start + tail_max)];
    let Some(newline_at) = tail.iter().position(|&b| b == b'\n') else {
        return if tail.len() == tail_max {
            Decoded::Fatal(RequestError {
                code: ErrorCode::FrameTooLong,
                id,
            })
        } else {
            Decoded::Incomplete
        };
    };
    let len = search_start + newline_at + 1;
    let payload = &buf[tail_start..len - 1];
    match validate_request(op, header, payload) {
        Ok(request) => Decoded::Request { request, len },
        Err(code) => Decoded::Invalid {
            error: RequestError { code, id },
            len,
        },
    }
}

#[inline(always)]
fn header_id(op: u8, header: &[u8]) -> u64 {
    match op {
        b'A' | b'S' => be_u64(header, 2),
        b'R' | b'P' | b'H' | b'L' | b'C' => be_u64(header, 0),
        b'O' => be_u64(header, 1),
        b'E' => be_u64(header, 1),
        _ => 0,
    }
}

#[inline(always)]
fn validate_request<'a>(
    op: u8,
    header: &[u8],
    payload: &'a [u8],
) -> Result<Request<'a>, ErrorCode> {
    let header_byte = |at: usize| header[at];
    match op {
        b'A' => {
            let key = validate_key(payload)?;
            let lease_s = nonzero_lease(header_byte(1))?;
            Ok(Request::Acquire {
                wait_s: header_byte(0),
                lease_s,
                owner: be_u64(header, 2),
                key,
                limit: 0,
                take: 0,
                label: "",
            })
        }
        b'S' => {
            let (key, label) = key_and_label(payload, header_byte(14))?;
            let lease_s = nonzero_lease(header_byte(1))?;
            let limit = be_u16(header, 10);
            let take = be_u16(header, 12);
            if take >= 1 && (limit == 0 || take > limit) {
                return Err(ErrorCode::InvalidCount);
            }
            Ok(Request::Acquire {
                wait_s: header_byte(0),
                lease_s,
                owner: be_u64(header, 2),
                key,
                limit,
                take,
                label,
            })
        }
        b'H' => Ok(Request::Holders {
            id: be_u64(header, 0),
            key: validate_key(payload)?,
        }),
        b'L' => {
            let prefix = std::str::from_utf8(payload).map_err(|_| ErrorCode::KeyNotUtf8)?;
            let count = be_u16(header, 16);
            if count == 0 || count > LIST_COUNT_MAX {
                return Err(ErrorCode::InvalidCount);
            }
            Ok(Request::List {
                id: be_u64(header, 0),
                cursor: be_u64(header, 8),
                count,
                prefix,
            })
        }
        b'U' => Ok(Request::Authenticate { secret: payload }),
        b'O' => Ok(Request::Observe {
            wait_s: header_byte(0),
            id: be_u64(header, 1),
            since: be_u64(header, 9),
            key: validate_key(payload)?,
        }),
        b'R' => Ok(Request::Release {
            token: be_u64(header, 0),
            key: validate_key(payload)?,
        }),
        b'C' => {
            let (key, label) = key_and_label(payload, header_byte(8))?;
            Ok(Request::Proclaim {
                token: be_u64(header, 0),
                key,
                label,
            })
        }
        b'E' => {
            let key = validate_key(payload)?;
            let lease_s = nonzero_lease(header_byte(0))?;
            Ok(Request::Extend {
                lease_s,
                token: be_u64(header, 1),
                key,
            })
        }
        b'Q' => Ok(Request::Query {
            key: validate_key(payload)?,
        }),
        b'P' if payload.is_empty() => Ok(Request::Ping {
            nonce: be_u64(header, 0),
        }),
        b'I' if payload.is_empty() => Ok(Request::Info),
        _ => Err(ErrorCode::UnexpectedPayload),
    }
}

/// The key (`klen` bytes) and the label (the rest) of an `S` or `C`
/// payload (spec §10, §13.4a: codes 3 and 4). The frame was found by
/// `klen`, so the payload holds at least `klen` bytes.
fn key_and_label(payload: &[u8], klen: u8) -> Result<(&str, &str), ErrorCode> {
    let (key, label) = payload.split_at(usize::from(klen));
    let key = validate_key(key)?;
    if key.contains('\n') {
        return Err(ErrorCode::KeyNotUtf8);
    }
    let label = std::str::from_utf8(label).map_err(|_| ErrorCode::KeyNotUtf8)?;
    Ok((key, label))
}

#[inline(always)]
fn validate_key(payload: &[u8]) -> Result<&str, ErrorCode> {
    if payload.is_empty() {
        return Err(ErrorCode::EmptyKey);
    }
    // Keys are nearly always ASCII. `is_ascii` checks a word at a time with
    // no branch per byte; `from_utf8`'s byte loop on a short key cost ~100
    // instructions and two mispredicted branches per request
    // (docs/BENCHMARKS.md, "Binary size and the pairs regression").
    if payload.is_ascii() {
        // SAFETY: every ASCII byte sequence is valid UTF-8. (`from_utf8`
        // here would scan the key again: +89 instructions per 9-byte key,
        // 129 against 40 for the whole check, measured under callgrind.)
        return Ok(unsafe { std::str::from_utf8_unchecked(payload) });
    }
    std::str::from_utf8(payload).map_err(|_| ErrorCode::KeyNotUtf8)
}

fn nonzero_lease(lease_s: u8) -> Result<u8, ErrorCode> {
    if lease_s == 0 {
        Err(ErrorCode::ZeroLease)
    } else {
        Ok(lease_s)
    }
}

/// Reads a big-endian u64 at `at` of a fixed header. The op's header
/// length was checked before any field is read, so a short slice is a bug
/// here, not bad input: it panics rather than read a made-up 0.
fn be_u64(header: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&header[at..at + 8]);
    u64::from_be_bytes(bytes)
}

/// As [`be_u64`], for a u16.
fn be_u16(header: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([header[at], header[at + 1]])
}

/// As [`be_u64`], for a u32.
fn be_u32(header: &[u8], at: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&header[at..at + 4]);
    u32::from_be_bytes(bytes)
}

/// Appends the frame for `request` to `out`. An acquire with limit 0,
/// take 0 and no label is written as `A`, any other as `S`.
///
/// The caller is responsible for valid fields (a key of 1..=255 bytes and
/// a label of 0..=128 bytes, both without `\n`; take and limit as spec
/// §10.1 wants; no `\n` in a secret); this only writes bytes. (An `S` key
/// longer than 255 bytes would have its `klen` cut to the low byte.)
pub fn encode_request(request: &Request<'_>, out: &mut Vec<u8>) {
    match *request {
        Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
            limit: 0,
            take: 0,
            label: "",
        } => {
            out.extend_from_slice(&[b'A', wait_s, lease_s]);
            out.extend_from_slice(&owner.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
            limit,
            take,
            label,
        } => {
            out.extend_from_slice(&[b'S', wait_s, lease_s]);
            out.extend_from_slice(&owner.to_be_bytes());
            out.extend_from_slice(&limit.to_be_bytes());
            out.extend_from_slice(&take.to_be_bytes());
            out.push(key.len() as u8);
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(label.as_bytes());
        }
        Request::Release { token, key } => {
            out.push(b'R');
            out.extend_from_slice(&token.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        Request::Extend {
            lease_s,
            token,
            key,
        } => {
            out.extend_from_slice(&[b'E', lease_s]);
            out.extend_from_slice(&token.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        Request::Query { key } => {
            out.push(b'Q');
            out.extend_from_slice(key.as_bytes());
        }
        Request::Ping { nonce } => {
            out.push(b'P');
            out.extend_from_slice(&nonce.to_be_bytes());
        }
        Request::Info => out.push(b'I'),
        Request::Holders { id, key } => {
            out.push(b'H');
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        Request::List {
            id,
            cursor,
            count,
            prefix,
        } => {
            out.push(b'L');
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&cursor.to_be_bytes());
            out.extend_from_slice(&count.to_be_bytes());
            out.extend_from_slice(prefix.as_bytes());
        }
        Request::Authenticate { secret } => {
            out.push(b'U');
            out.extend_from_slice(secret);
        }
        Request::Observe {
            wait_s,
            id,
            since,
            key,
        } => {
            out.extend_from_slice(&[b'O', wait_s]);
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&since.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
        }
        Request::Proclaim { token, key, label } => {
            out.push(b'C');
            out.extend_from_slice(&token.to_be_bytes());
            out.push(key.len() as u8);
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(label.as_bytes());
        }
    }
    out.push(b'\n');
}

/// Appends the frame for `response` to `out`.
pub fn encode_response(response: &Response, out: &mut Vec<u8>) {
    fn op_u64(out: &mut Vec<u8>, op: u8, value: u64) {
        let mut frame = [0u8; 10];
        frame[0] = op;
        frame[1..9].copy_from_slice(&value.to_be_bytes());
        frame[9] = b'\n';
        out.extend_from_slice(&frame);
    }
    match *response {
        Response::Acquired { owner, token } => {
            let mut frame = [0u8; 18];
            frame[0] = b'A';
            frame[1..9].copy_from_slice(&owner.to_be_bytes());
            frame[9..17].copy_from_slice(&token.to_be_bytes());
            frame[17] = b'\n';
            out.extend_from_slice(&frame);
        }
        Response::Timeout { owner } => op_u64(out, b'T', owner),
        Response::Busy { owner } => op_u64(out, b'B', owner),
        Response::Released { token } => op_u64(out, b'R', token),
        Response::Extended { token } => op_u64(out, b'E', token),
        Response::NotHeld { token } => op_u64(out, b'N', token),
        Response::Proclaimed { token } => op_u64(out, b'C', token),
        Response::Pong { nonce } => op_u64(out, b'P', nonce),
        Response::Query {
            token,
            owner,
            lease_ms,
            waiters,
        } => {
            let mut frame = [0u8; 26];
            frame[0] = b'Q';
            frame[1..9].copy_from_slice(&token.to_be_bytes());
            frame[9..17].copy_from_slice(&owner.to_be_bytes());
            frame[17..21].copy_from_slice(&lease_ms.to_be_bytes());
            frame[21..25].copy_from_slice(&waiters.to_be_bytes());
            frame[25] = b'\n';
            out.extend_from_slice(&frame);
        }
        Response::Info(ref text) => {
            out.push(b'I');
            push_text(out, text);
        }
        Response::Error { code, id, ref text } => {
            out.push(b'X');
            out.push(code);
            out.extend_from_slice(&id.to_be_bytes());
            push_text(out, text);
        }
        Response::Grant {
            id,
            token,
            owner,
            lease_ms,
            held_ms,
            take,
            ref label,
        } => {
            out.push(b'G');
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&token.to_be_bytes());
            out.extend_from_slice(&owner.to_be_bytes());
            out.extend_from_slice(&lease_ms.to_be_bytes());
            out.extend_from_slice(&held_ms.to_be_bytes());
            out.extend_from_slice(&take.to_be_bytes());
            push_text(out, label);
        }
        Response::Waiter {
            id,
            owner,
            wait_ms,
            take,
            ref label,
        } => {
            out.push(b'W');
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&owner.to_be_bytes());
            out.extend_from_slice(&wait_ms.to_be_bytes());
            out.extend_from_slice(&take.to_be_bytes());
            push_text(out, label);
        }
        Response::Key {
            id,
            grants,
            waiters,
            limit,
            ref key,
        } => {
            out.push(b'K');
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&grants.to_be_bytes());
            out.extend_from_slice(&waiters.to_be_bytes());
            out.extend_from_slice(&limit.to_be_bytes());
            push_text(out, key);
        }
        Response::End { id, count, next } => {
            let mut frame = [0u8; 22];
            frame[0] = b'Z';
            frame[1..9].copy_from_slice(&id.to_be_bytes());
            frame[9..13].copy_from_slice(&count.to_be_bytes());
            frame[13..21].copy_from_slice(&next.to_be_bytes());
            frame[21] = b'\n';
            out.extend_from_slice(&frame);
        }
        Response::Authenticated { ref name } => {
            out.push(b'U');
            push_text(out, name);
        }
        Response::KeyState {
            id,
            token,
            lease_ms,
            held_ms,
            grants,
            waiters,
            ref label,
        } => {
            out.push(b'V');
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&token.to_be_bytes());
            out.extend_from_slice(&lease_ms.to_be_bytes());
            out.extend_from_slice(&held_ms.to_be_bytes());
            out.extend_from_slice(&grants.to_be_bytes());
            out.extend_from_slice(&waiters.to_be_bytes());
            push_text(out, label);
        }
    }
}

/// Writes text that must not contain `\n` (it would end the frame early),
/// then the terminator.
fn push_text(out: &mut Vec<u8>, text: &str) {
    out.extend(text.bytes().map(|b| if b == b'\n' { b' ' } else { b }));
    out.push(b'\n');
}

/// A response stream that can no longer be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResponseError {
    /// The op byte is not a response op.
    UnknownOp(u8),
    /// A fixed-size frame is not followed by `\n`.
    MissingNewline(u8),
    /// The text of an `I`, `X`, `G`, `W`, `K` or `U` ran past
    /// [`RESPONSE_TEXT_MAX`] bytes.
    TextTooLong(u8),
}

impl fmt::Display for ResponseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ResponseError::UnknownOp(op) => write!(f, "unknown response op byte 0x{op:02x}"),
            ResponseError::MissingNewline(op) => {
                write!(f, "response '{}' not terminated by a newline", op as char)
            }
            ResponseError::TextTooLong(op) => {
                write!(
                    f,
                    "response '{}' text longer than {RESPONSE_TEXT_MAX} bytes",
                    op as char
                )
            }
        }
    }
}

impl std::error::Error for ResponseError {}

/// The fixed-header size of a response op, or `None` for an unknown op.
pub fn response_header_len(op: u8) -> Option<usize> {
    match op {
        b'A' => Some(16),
        b'T' | b'B' | b'R' | b'E' | b'N' | b'P' | b'C' => Some(8),
        b'Q' => Some(24),
        b'I' | b'U' => Some(0),
        b'X' => Some(9),
        b'G' => Some(34),
        b'W' => Some(22),
        b'K' => Some(18),
        b'Z' => Some(20),
        b'V' => Some(30),
        _ => None,
    }
}

/// Whether a response op carries text between its fixed header and `\n`.
pub fn response_has_text(op: u8) -> bool {
    matches!(op, b'I' | b'X' | b'G' | b'W' | b'K' | b'U' | b'V')
}

/// Decodes the response frame at the start of `buf`: `Ok(None)` when more
/// bytes are needed, `Ok(Some((response, len)))` for one frame of `len`
/// bytes, `Err` when the stream cannot be decoded any further.
pub fn decode_response(buf: &[u8]) -> Result<Option<(Response, usize)>, ResponseError> {
    let Some(&op) = buf.first() else {
        return Ok(None);
    };
    let header_len = response_header_len(op).ok_or(ResponseError::UnknownOp(op))?;
    let tail_start = 1 + header_len;
    let Some(header) = buf.get(1..tail_start) else {
        return Ok(None);
    };
    let text_len = if response_has_text(op) {
        let tail = &buf[tail_start..buf.len().min(tail_start + RESPONSE_TEXT_MAX + 1)];
        match tail.iter().position(|&b| b == b'\n') {
            Some(at) => at,
            None if tail.len() > RESPONSE_TEXT_MAX => return Err(ResponseError::TextTooLong(op)),
            None => return Ok(None),
        }
    } else {
        match buf.get(tail_start) {
            None => return Ok(None),
            Some(b'\n') => 0,
            Some(_) => return Err(ResponseError::MissingNewline(op)),
        }
    };
    let text = || String::from_utf8_lossy(&buf[tail_start..tail_start + text_len]).into_owned();
    let response = match op {
        b'A' => Response::Acquired {
            owner: be_u64(header, 0),
            token: be_u64(header, 8),
        },
        b'T' => Response::Timeout {
            owner: be_u64(header, 0),
        },
        b'B' => Response::Busy {
            owner: be_u64(header, 0),
        },
        b'R' => Response::Released {
            token: be_u64(header, 0),
        },
        b'E' => Response::Extended {
            token: be_u64(header, 0),
        },
        b'N' => Response::NotHeld {
            token: be_u64(header, 0),
        },
        b'C' => Response::Proclaimed {
            token: be_u64(header, 0),
        },
        b'P' => Response::Pong {
            nonce: be_u64(header, 0),
        },
        b'Q' => Response::Query {
            token: be_u64(header, 0),
            owner: be_u64(header, 8),
            lease_ms: be_u32(header, 16),
            waiters: be_u32(header, 20),
        },
        b'I' => Response::Info(text()),
        b'G' => Response::Grant {
            id: be_u64(header, 0),
            token: be_u64(header, 8),
            owner: be_u64(header, 16),
            lease_ms: be_u32(header, 24),
            held_ms: be_u32(header, 28),
            take: be_u16(header, 32),
            label: text(),
        },
        b'W' => Response::Waiter {
            id: be_u64(header, 0),
            owner: be_u64(header, 8),
            wait_ms: be_u32(header, 16),
            take: be_u16(header, 20),
            label: text(),
        },
        b'K' => Response::Key {
            id: be_u64(header, 0),
            grants: be_u32(header, 8),
            waiters: be_u32(header, 12),
            limit: be_u16(header, 16),
            key: text(),
        },
        b'Z' => Response::End {
            id: be_u64(header, 0),
            count: be_u32(header, 8),
            next: be_u64(header, 12),
        },
        b'U' => Response::Authenticated { name: text() },
        b'V' => Response::KeyState {
            id: be_u64(header, 0),
            token: be_u64(header, 8),
            lease_ms: be_u32(header, 16),
            held_ms: be_u32(header, 20),
            grants: be_u16(header, 24),
            waiters: be_u32(header, 26),
            label: text(),
        },
        _ => Response::Error {
            code: header[0],
            id: be_u64(header, 1),
            text: Cow::Owned(text()),
        },
    };
    Ok(Some((response, tail_start + text_len + 1)))
}
