//! One connection's protocol state, with no socket and no clock: the bytes
//! it has not finished sending us, the bytes we have not finished sending
//! it, where it is in its life, and its one deadline.
//!
//! [`Endpoint`](super::endpoint::Endpoint) drives it: it decodes from the
//! connection's input, hands requests to the core and routes the answers
//! into the connections' output. This type owns the rules that concern one
//! connection alone: the phase transitions, the backpressure thresholds
//! and the input carry-over.
//!
//! An idle connection owns no buffers: `input` holds bytes only while a
//! frame is incomplete (or held back by backpressure) and `output` only
//! while the socket would not take everything; an emptied buffer is freed
//! (or handed back to the endpoint's spare), so ten thousand idle
//! connections cost well under 256 B each.

use std::net::IpAddr;

use crate::protocol::REQUEST_FRAME_MAX;

use super::Micros;
use crate::timer_wheel::TimerLinks;

/// The most bytes the shell hands to one `handle_read`; with the carried
/// partial frame, also the most input one connection can hold.
pub const READ_CHUNK: usize = 64 * 1024;
/// The most input a connection holds: a chunk read just before output
/// passed the high-water mark, after a carried partial frame.
pub const INPUT_MAX: usize = READ_CHUNK + REQUEST_FRAME_MAX;
/// Stop evaluating a connection's requests once its unsent output passes
/// this...
pub const OUTPUT_HIGH_WATER: usize = 64 * 1024;
/// ...and resume once it is below this.
pub const OUTPUT_LOW_WATER: usize = 16 * 1024;
/// The work one connection gets per turn of the event loop (spec §4,
/// fairness), in the core's units (one table slot an `L` examines, one
/// grant or waiter an `H` walks) plus [`REQUEST_WORK`] per request and
/// one per [`ANSWER_BYTES_PER_WORK`] bytes of answers. A request is never
/// split: the one that passes the budget finishes, and the next waits for
/// the next turn. About a millisecond of work: 1,024 plain requests, one
/// `L` of 1,000, one `H` on a key with 16,384 grants.
pub const TURN_WORK_MAX: u32 = 16 * 1024;
/// What a request costs besides the core's work.
pub const REQUEST_WORK: u32 = 16;
/// Answer bytes that cost one unit of work.
pub const ANSWER_BYTES_PER_WORK: usize = 16;
/// A frame left incomplete this long closes the connection (spec §4).
pub const PARTIAL_FRAME_TIMEOUT_US: Micros = 10_000_000;
/// How long a closing connection may take to drain its last answers and
/// its peer's unread input before it is dropped.
pub const LINGER_US: Micros = 2_000_000;

/// Where a connection is in its life. What moves it is in `docs/DESIGN.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Reading requests and answering them. Deadline: the partial frame's,
    /// while one is incomplete; a TLS handshake's and (with `--auth`) the
    /// `U`'s run from the accept.
    Open,
    /// Unsent output passed [`OUTPUT_HIGH_WATER`]: requests already read
    /// wait in `input`, and the shell reads nothing more until output is
    /// below [`OUTPUT_LOW_WATER`]. No deadline: our output is late, not the
    /// peer's input.
    Backpressured,
    /// The connection spent its share of this turn of the event loop
    /// ([`TURN_WORK_MAX`], or the turn's TLS handshake work): what it sent
    /// waits in `input` (or, mid-handshake, as records), and the shell
    /// reads nothing more until the endpoint's next turn evaluates it
    /// (spec §4, fairness). Deadline: only the handshake's or `U`'s, which
    /// run from the accept.
    Yielded,
    /// No more requests (fatal error, end-of-file, shutdown, refusal): the
    /// core has forgotten the connection, its last answers drain and input
    /// is discarded. Deadline: the linger's.
    Flushing {
        /// The peer's end-of-file was read: once output is sent there is
        /// nothing to wait for.
        peer_closed: bool,
    },
    /// Output sent and our write side shut: input is discarded until the
    /// peer's end-of-file or the linger deadline. Closing this way, rather
    /// than at once, keeps unread input from turning our close into a
    /// reset that could destroy the last answer.
    Lingering,
}

impl Phase {
    /// Whether the core knows the connection (its requests are evaluated).
    pub fn is_live(self) -> bool {
        matches!(self, Phase::Open | Phase::Backpressured | Phase::Yielded)
    }
}

pub struct Connection {
    /// Unparsed input: an incomplete frame, or frames not yet evaluated
    /// because output is over the high-water mark. Its capacity is kept
    /// while a frame is incomplete and freed when it empties.
    pub(super) input: Vec<u8>,
    /// Encoded answers the socket has not accepted yet.
    pub(super) output: Vec<u8>,
    pub(super) phase: Phase,
    /// The partial-frame deadline while open; the linger deadline while
    /// closing.
    pub(super) timer: TimerLinks,
    /// In the endpoint's list of connections with output to send.
    pub(super) transmit_queued: bool,
    /// Refused at accept (`X 7`, `X 9`): never known to the core.
    pub(super) refused: bool,
    /// Its output was waiting when a write of the state file failed: it
    /// may reveal what the file does not promise, so nothing of it is sent
    /// until a write succeeds (spec §7.6).
    pub(super) awaits_disk: bool,
    /// The turn of the event loop `work` counts for.
    pub(super) turn: u32,
    /// Work done in that turn (see [`TURN_WORK_MAX`]).
    pub(super) work: u32,
    /// The TCP peer's address, counted in the per-peer share of the
    /// connection limit while the connection is live; `None` for a Unix
    /// peer or a refused one.
    pub(super) peer: Option<IpAddr>,
    /// The TLS session of a connection accepted on a TLS listener: input
    /// and output above are its plaintext.
    #[cfg(feature = "tls")]
    pub(super) tls: Option<Box<super::tls::TlsLayer>>,
}

impl Connection {
    pub(super) fn new(phase: Phase) -> Connection {
        Connection {
            input: Vec::new(),
            output: Vec::new(),
            phase,
            timer: TimerLinks::UNARMED,
            transmit_queued: false,
            refused: false,
            awaits_disk: false,
            turn: 0,
            work: 0,
            peer: None,
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// Whether the connection is a TLS one still in its handshake.
    pub fn is_handshaking(&self) -> bool {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return tls.is_handshaking();
        }
        false
    }

    /// Whether nothing is queued for the socket: no output, and with TLS
    /// no records.
    pub(super) fn nothing_to_send(&self) -> bool {
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            return self.output.is_empty() && !tls.has_records();
        }
        self.output.is_empty()
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Bytes read but not yet evaluated.
    pub fn input_len(&self) -> usize {
        self.input.len()
    }

    /// Bytes queued for the socket.
    pub fn output_len(&self) -> usize {
        self.output.len()
    }

    /// Whether the shell should read from the socket: not while requests
    /// wait for output to drain or for the next turn.
    pub fn wants_read(&self) -> bool {
        !matches!(self.phase, Phase::Backpressured | Phase::Yielded)
    }

    /// Whether evaluation must stop for now.
    pub(super) fn output_full(&self) -> bool {
        self.output.len() >= OUTPUT_HIGH_WATER
    }

    /// Keeps `rest` (the bytes after the last whole frame of a read that
    /// came straight from the socket) for the next read.
    pub(super) fn carry(&mut self, rest: &[u8]) {
        self.input.extend_from_slice(rest);
    }

    /// Drops the first `consumed` bytes of `input` after they were
    /// evaluated. A buffer that empties is freed: the connection is idle.
    /// One that still holds a partial frame keeps its capacity for the
    /// next read.
    pub(super) fn consume(&mut self, consumed: usize) {
        if consumed >= self.input.len() {
            self.input = Vec::new();
        } else {
            self.input.drain(..consumed);
        }
    }

    /// Counts `written` bytes as sent. Returns the emptied buffer, for
    /// reuse, once everything is sent.
    pub(super) fn sent(&mut self, written: usize) -> Option<Vec<u8>> {
        assert!(written <= self.output.len(), "wrote more than was queued");
        if written == self.output.len() {
            let mut buffer = std::mem::take(&mut self.output);
            buffer.clear();
            return Some(buffer);
        }
        self.output.drain(..written);
        None
    }
}
