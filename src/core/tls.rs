//! The TLS record layer of one server connection, sans-IO: rustls's
//! `ServerConnection` is fed the bytes the shell read and gives the
//! records to write. The endpoint keeps its plaintext rules above it:
//! answers stay in the connection's `output` until the records that carry
//! them are written, so backpressure and the output bound count them as
//! before; only one batch of records exists at a time.

use std::io::{Read, Write};
use std::sync::Arc;

use rustls::{ServerConfig, ServerConnection};

/// The most plaintext encrypted into one batch of records.
const RECORD_BATCH: usize = 64 * 1024;

pub(crate) struct TlsLayer {
    session: ServerConnection,
    /// Records to write; emptied (and freed) once written.
    records: Vec<u8>,
    /// How many bytes at the start of the connection's output `records`
    /// carries: they leave `output` once the records are written.
    carried: usize,
    close_notify_sent: bool,
    /// The session failed: only its alert is left to send.
    failed: bool,
    /// Handshake records read while the loop's turn had no handshake work
    /// left: fed to the session on the next turn.
    pub(super) held_records: Vec<u8>,
}

impl TlsLayer {
    pub(crate) fn new(config: &Arc<ServerConfig>) -> Result<TlsLayer, rustls::Error> {
        Ok(TlsLayer {
            session: ServerConnection::new(config.clone())?,
            records: Vec::new(),
            carried: 0,
            close_notify_sent: false,
            failed: false,
            held_records: Vec::new(),
        })
    }

    pub(crate) fn is_handshaking(&self) -> bool {
        self.session.is_handshaking()
    }

    /// Feeds `ciphertext` to the session and appends what it decrypts to
    /// `plaintext`; `true` once the peer sent `close_notify` (no more
    /// plaintext will come). On an error the session has queued its alert.
    pub(crate) fn read(
        &mut self,
        mut ciphertext: &[u8],
        plaintext: &mut Vec<u8>,
    ) -> Result<bool, rustls::Error> {
        let mut peer_closed = false;
        while !ciphertext.is_empty() && !peer_closed {
            match self.session.read_tls(&mut ciphertext) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    self.failed = true;
                    return Err(rustls::Error::General(e.to_string()));
                }
            }
            let state = match self.session.process_new_packets() {
                Ok(state) => state,
                Err(e) => {
                    self.failed = true;
                    return Err(e);
                }
            };
            let available = state.plaintext_bytes_to_read();
            peer_closed = state.peer_has_closed();
            if available > 0 {
                let start = plaintext.len();
                plaintext.resize(start + available, 0);
                if self
                    .session
                    .reader()
                    .read_exact(&mut plaintext[start..])
                    .is_err()
                {
                    plaintext.truncate(start);
                }
            }
        }
        Ok(peer_closed)
    }

    /// Whether records are waiting or the session has some to make.
    pub(crate) fn has_records(&self) -> bool {
        !self.records.is_empty() || self.session.wants_write()
    }

    /// The records to write now: what the session queued (handshake,
    /// alerts, `close_notify`) and, once the handshake is done and no
    /// batch is in flight, the start of `output` encrypted. The buffer
    /// comes from `spare` when there is something to write.
    pub(crate) fn records(&mut self, output: &[u8], spare: &mut Vec<Vec<u8>>) -> &[u8] {
        if self.records.is_empty() {
            if self.records.capacity() == 0 && (!output.is_empty() || self.session.wants_write()) {
                self.records = spare.pop().unwrap_or_default();
            }
            if !self.failed && self.carried == 0 && !output.is_empty() && !self.is_handshaking() {
                let batch = &output[..output.len().min(RECORD_BATCH)];
                self.carried = self.session.writer().write(batch).unwrap_or(0);
            }
            while self.session.wants_write() {
                if self.session.write_tls(&mut self.records).is_err() {
                    break;
                }
            }
        }
        &self.records
    }

    /// The socket took `written` bytes of [`records`](Self::records).
    /// Returns how many bytes of output the records carried once all of
    /// them are written, and the emptied buffer for reuse.
    pub(crate) fn written(&mut self, written: usize) -> Option<(usize, Vec<u8>)> {
        if written < self.records.len() {
            self.records.drain(..written);
            return None;
        }
        let mut buffer = std::mem::take(&mut self.records);
        buffer.clear();
        Some((std::mem::take(&mut self.carried), buffer))
    }

    /// Queues `close_notify` once; `false` if it was queued before or the
    /// session failed (then nothing more is sent).
    pub(crate) fn close_notify(&mut self) -> bool {
        if self.close_notify_sent || self.failed {
            return false;
        }
        self.close_notify_sent = true;
        self.session.send_close_notify();
        true
    }

    /// Whether output can still be sent: the handshake is done and the
    /// session has not failed.
    pub(crate) fn can_send(&self) -> bool {
        !self.failed && !self.is_handshaking()
    }
}
