//! One client connection as the event loop sees it: its socket, the bytes
//! it has not finished sending us, the bytes we have not finished sending
//! it, and where it is in its life.
//!
//! An idle connection owns no buffers: `input` holds bytes only while a
//! frame is incomplete (or held back by backpressure) and `output` only
//! while the socket would not take everything; both are freed when they
//! empty, so ten thousand idle connections cost well under 256 B each.

use std::io::{self, Write};

use super::listener::Stream;
use crate::core::timer_wheel::TimerLinks;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Reading requests and answering them.
    Open,
    /// No more requests are read: the last answers are flushed, the write
    /// side is shut, and input is discarded until the peer closes or the
    /// linger deadline passes. The core no longer knows the connection.
    Closing,
}

pub struct Connection {
    pub stream: Stream,
    /// Unparsed input: an incomplete frame, or frames not yet evaluated
    /// because output is over the high-water mark.
    pub input: Vec<u8>,
    /// Output the socket has not accepted yet.
    pub output: Vec<u8>,
    /// The incomplete-frame deadline while open; the linger deadline while
    /// closing.
    pub timer: TimerLinks,
    pub phase: Phase,
    /// Reading is suspended until `output` drains.
    pub paused: bool,
    /// In the event loop's list of connections with output to flush.
    pub dirty: bool,
    /// In the event loop's list of connections to service without waiting
    /// for an event.
    pub ready: bool,
    /// The write side has been shut (closing only).
    pub write_shut: bool,
    /// Refused at the connection limit: never known to the core.
    pub refused: bool,
    /// The peer has closed its side (closing only).
    pub peer_closed: bool,
}

/// The result of writing as much of a buffer as the socket takes.
pub enum Flushed {
    /// Everything was written.
    All,
    /// The socket is full; the first `n` bytes were written.
    Partial(usize),
    /// The connection is broken.
    Broken,
}

impl Connection {
    pub fn new(stream: Stream) -> Connection {
        Connection {
            stream,
            input: Vec::new(),
            output: Vec::new(),
            timer: TimerLinks::UNARMED,
            phase: Phase::Open,
            paused: false,
            dirty: false,
            ready: false,
            write_shut: false,
            refused: false,
            peer_closed: false,
        }
    }

    /// Writes `bytes` until done or the socket would block.
    pub fn write_some(&mut self, bytes: &[u8]) -> Flushed {
        let mut written = 0;
        while written < bytes.len() {
            match self.stream.write(&bytes[written..]) {
                Ok(0) => return Flushed::Broken,
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Flushed::Partial(written);
                }
                Err(_) => return Flushed::Broken,
            }
        }
        Flushed::All
    }

    /// Writes pending output; frees the buffer once it is empty. Returns
    /// `false` if the connection is broken.
    pub fn flush_output(&mut self) -> bool {
        if self.output.is_empty() {
            return true;
        }
        let output = std::mem::take(&mut self.output);
        match self.write_some(&output) {
            Flushed::All => true,
            Flushed::Partial(n) => {
                self.output = output;
                self.output.drain(..n);
                true
            }
            Flushed::Broken => false,
        }
    }
}
