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

/// How many bytes after a request's fixed header may pass without a `\n`
/// before the frame is "too long" (error 2): the variable part plus its
/// terminator.
pub const REQUEST_TAIL_MAX: usize = KEY_LEN_MAX + 1;

/// The largest request frame: `A`, its 10-byte header, a 255-byte key, `\n`.
pub const REQUEST_FRAME_MAX: usize = 1 + 10 + REQUEST_TAIL_MAX;

/// Longest text a response (`I` or `X`) may carry before a client decoder
/// gives up on the stream.
pub const RESPONSE_TEXT_MAX: usize = 4096;

/// The largest frame the server sends: an `I` line with every counter at
/// its maximum is under 400 bytes; an `X` is at most 91.
pub const RESPONSE_FRAME_MAX: usize = 512;

/// Longest text the server puts in an `X` frame.
pub const ERROR_TEXT_MAX: usize = 80;

/// Longest wait a request can ask for, in seconds (`wait` is a `u8`).
pub const WAIT_S_MAX: u8 = u8::MAX;

/// A request from a client to the server. Keys borrow from the read buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// `A wait:u8 lease:u8 owner:u64 key \n`
    Acquire {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: &'a str,
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
        }
    }

    /// The identifier an `X` answer to this request carries: the owner of an
    /// acquire, the token of a release or extend, the nonce of a ping.
    pub fn error_id(&self) -> u64 {
        self.correlation().error_id()
    }
}

/// The part of a request its answer is recognised by (spec §2.3, §6): the
/// op and the id the answer echoes. `A`, `T` and `B` answer an acquire by
/// `owner`; `R`, `E` and `N` a release or extend by `token`; `P` a ping by
/// `nonce`; `Q` and `I` carry no id and answer the oldest query or info
/// request, in order; an `X` carries the request's [`error_id`](Self::error_id).
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
}

impl Correlation {
    /// The id an `X` answer to the request carries.
    pub fn error_id(self) -> u64 {
        match self {
            Correlation::Acquire { owner } => owner,
            Correlation::Release { token } | Correlation::Extend { token } => token,
            Correlation::Ping { nonce } => nonce,
            Correlation::Query | Correlation::Info => 0,
        }
    }

    /// Whether `response` answers the request. A fatal `X` ends the whole
    /// session rather than answering one request; callers decide on it
    /// before they correlate.
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
            | (
                Response::NotHeld { token },
                Correlation::Release { token: sent } | Correlation::Extend { token: sent },
            ) => *token == sent,
            (Response::Pong { nonce }, Correlation::Ping { nonce: sent }) => *nonce == sent,
            (Response::Query { .. }, Correlation::Query)
            | (Response::Info(_), Correlation::Info) => true,
            (Response::Error { id, .. }, sent) => *id == sent.error_id(),
            _ => false,
        }
    }
}

/// A response from the server to a client.
#[derive(Clone, Debug, PartialEq, Eq)]
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
    /// `X` costs no allocation; a decoded one owns its text.
    Error {
        code: u8,
        id: u64,
        text: Cow<'static, str>,
    },
}

/// The error codes of `X` frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorCode {
    /// The op byte is not one of `A R E Q P I`: framing is lost.
    UnknownOp = 1,
    /// No `\n` within 256 bytes after the fixed header.
    FrameTooLong = 2,
    /// The key is empty.
    EmptyKey = 3,
    /// The key is not valid UTF-8.
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
        )
    }

    /// The short explanation the server sends with the code.
    pub fn text(self) -> &'static str {
        match self {
            ErrorCode::UnknownOp => "unknown op byte",
            ErrorCode::FrameTooLong => "frame too long: no newline within 256 bytes",
            ErrorCode::EmptyKey => "key is empty",
            ErrorCode::KeyNotUtf8 => "key is not valid UTF-8",
            ErrorCode::ZeroLease => "lease must be 1..=255 seconds",
            ErrorCode::UnexpectedPayload => "this op takes no payload",
            ErrorCode::ConnectionLimit => "connection limit reached",
            ErrorCode::ShuttingDown => "server shutting down",
            ErrorCode::NotAllowed => "peer not allowed",
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
pub fn request_header_len(op: u8) -> Option<usize> {
    match op {
        b'A' => Some(10),
        b'R' => Some(8),
        b'E' => Some(9),
        b'Q' | b'I' => Some(0),
        b'P' => Some(8),
        _ => None,
    }
}

/// Decodes the request frame at the start of `buf`.
///
/// Never reads past the first frame and never needs more than
/// [`REQUEST_FRAME_MAX`] bytes to decide: a caller that keeps what this
/// returns `Incomplete` for holds at most one frame's worth of bytes.
pub fn decode_request(buf: &[u8]) -> Decoded<'_> {
    let Some(&op) = buf.first() else {
        return Decoded::Incomplete;
    };
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
    let tail = &buf[tail_start..buf.len().min(tail_start + REQUEST_TAIL_MAX)];
    let Some(payload_len) = tail.iter().position(|&b| b == b'\n') else {
        return if tail.len() == REQUEST_TAIL_MAX {
            Decoded::Fatal(RequestError {
                code: ErrorCode::FrameTooLong,
                id,
            })
        } else {
            Decoded::Incomplete
        };
    };
    let payload = &tail[..payload_len];
    let len = tail_start + payload_len + 1;
    match validate_request(op, header, payload) {
        Ok(request) => Decoded::Request { request, len },
        Err(code) => Decoded::Invalid {
            error: RequestError { code, id },
            len,
        },
    }
}

fn header_id(op: u8, header: &[u8]) -> u64 {
    match op {
        b'A' => be_u64(header, 2),
        b'R' | b'P' => be_u64(header, 0),
        b'E' => be_u64(header, 1),
        _ => 0,
    }
}

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
            })
        }
        b'R' => Ok(Request::Release {
            token: be_u64(header, 0),
            key: validate_key(payload)?,
        }),
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

fn validate_key(payload: &[u8]) -> Result<&str, ErrorCode> {
    if payload.is_empty() {
        return Err(ErrorCode::EmptyKey);
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

/// As [`be_u64`], for a u32.
fn be_u32(header: &[u8], at: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&header[at..at + 4]);
    u32::from_be_bytes(bytes)
}

/// Appends the frame for `request` to `out`.
///
/// The caller is responsible for a valid key (1..=255 bytes without `\n`);
/// this only writes bytes.
pub fn encode_request(request: &Request<'_>, out: &mut Vec<u8>) {
    match *request {
        Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key,
        } => {
            out.extend_from_slice(&[b'A', wait_s, lease_s]);
            out.extend_from_slice(&owner.to_be_bytes());
            out.extend_from_slice(key.as_bytes());
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
    /// An `I` or `X` text ran past [`RESPONSE_TEXT_MAX`] bytes.
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
        b'T' | b'B' | b'R' | b'E' | b'N' | b'P' => Some(8),
        b'Q' => Some(24),
        b'I' => Some(0),
        b'X' => Some(9),
        _ => None,
    }
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
    let text_len = if op == b'I' || op == b'X' {
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
        _ => Response::Error {
            code: header[0],
            id: be_u64(header, 1),
            text: Cow::Owned(text()),
        },
    };
    Ok(Some((response, tail_start + text_len + 1)))
}
