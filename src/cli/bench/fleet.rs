//! The load generator's connections: one single-threaded mio loop over many
//! sockets, every request queued through [`Wire`] and correlated back to
//! the request that caused it.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};

use super::stats::{Kind, Stats};
use crate::addr::Address;
use crate::client::Secret;
use crate::protocol::{Correlation, Request, Response, decode_response, encode_request};
use crate::stream::Stream;

/// A request that has been queued and not yet answered.
#[derive(Clone, Copy, Debug)]
pub struct Pending {
    pub kind: Kind,
    /// What the answer carries: the owner of an acquire, the token of a
    /// release or extend, the nonce of a ping.
    pub id: u64,
    /// The key's index in the workload's key space.
    pub key: u64,
    /// The workload's own bookkeeping (a slot, a role).
    pub tag: u32,
    pub sent: Instant,
}

impl Pending {
    /// What ties it to its answer (the rule is [`Correlation`]'s).
    fn correlation(&self) -> Correlation {
        match self.kind {
            Kind::Acquire => Correlation::Acquire { owner: self.id },
            Kind::Release => Correlation::Release { token: self.id },
            Kind::Extend => Correlation::Extend { token: self.id },
            Kind::Ping => Correlation::Ping { nonce: self.id },
            Kind::Observe => Correlation::Observe { id: self.id },
        }
    }
}

/// Key names: a fixed prefix and a 12-digit index, so that with a 5-byte
/// prefix every key is 17 bytes.
struct KeyNames {
    buf: String,
    prefix_len: usize,
}

impl KeyNames {
    fn name(&mut self, index: u64) -> &str {
        self.buf.truncate(self.prefix_len);
        let mut digits = [b'0'; 12];
        let mut rest = index;
        for d in digits.iter_mut().rev() {
            *d = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        // Only ASCII digits were written.
        self.buf.extend(digits.iter().map(|&d| d as char));
        &self.buf
    }
}

/// Where workloads queue requests. Bytes go out at the end of the turn,
/// so every request one wake-up produces leaves in one write per socket.
pub struct Wire {
    /// The instant the current batch of work is stamped with.
    pub now: Instant,
    out: Vec<Vec<u8>>,
    dirty: Vec<usize>,
    is_dirty: Vec<bool>,
    in_flight: Vec<VecDeque<Pending>>,
    in_flight_total: usize,
    next_id: u64,
    keys: KeyNames,
}

impl Wire {
    /// Records a request just encoded into `out[conn]`.
    fn queued(&mut self, conn: usize, kind: Kind, id: u64, key: u64, tag: u32) {
        if !self.is_dirty[conn] {
            self.is_dirty[conn] = true;
            self.dirty.push(conn);
        }
        self.in_flight[conn].push_back(Pending {
            kind,
            id,
            key,
            tag,
            sent: self.now,
        });
        self.in_flight_total += 1;
    }

    /// Queues `A wait lease owner key` with a fresh owner.
    pub fn acquire(&mut self, conn: usize, key: u64, wait_s: u8, lease_s: u8, tag: u32) {
        self.acquire_permits(conn, key, wait_s, lease_s, (0, 0), tag);
    }

    /// Queues an acquire of `take` of the key's `limit` permits (spec §10;
    /// `(0, 0)` is a plain `A`) with a fresh owner.
    pub fn acquire_permits(
        &mut self,
        conn: usize,
        key: u64,
        wait_s: u8,
        lease_s: u8,
        (limit, take): (u16, u16),
        tag: u32,
    ) {
        self.acquire_with(conn, key, (wait_s, lease_s), (limit, take), "", tag);
    }

    /// Queues an exclusive `S` with a label (spec §11.1) and a fresh
    /// owner.
    pub fn acquire_labelled(
        &mut self,
        conn: usize,
        key: u64,
        (wait_s, lease_s): (u8, u8),
        label: &str,
        tag: u32,
    ) {
        self.acquire_with(conn, key, (wait_s, lease_s), (0, 0), label, tag);
    }

    /// Queues `S` (spec §10) with a fresh owner.
    fn acquire_with(
        &mut self,
        conn: usize,
        key: u64,
        (wait_s, lease_s): (u8, u8),
        (limit, take): (u16, u16),
        label: &str,
        tag: u32,
    ) {
        self.next_id += 1;
        let owner = self.next_id;
        let request = Request::Acquire {
            wait_s,
            lease_s,
            owner,
            key: self.keys.name(key),
            limit,
            take,
            label,
        };
        encode_request(&request, &mut self.out[conn]);
        self.queued(conn, Kind::Acquire, owner, key, tag);
    }

    /// Queues `O wait id since key` (spec §13.1) with a fresh id.
    pub fn observe(&mut self, conn: usize, key: u64, since: u64, wait_s: u8, tag: u32) {
        self.next_id += 1;
        let id = self.next_id;
        let request = Request::Observe {
            wait_s,
            id,
            since,
            key: self.keys.name(key),
        };
        encode_request(&request, &mut self.out[conn]);
        self.queued(conn, Kind::Observe, id, key, tag);
    }

    /// Queues `R token key`.
    pub fn release(&mut self, conn: usize, token: u64, key: u64, tag: u32) {
        let request = Request::Release {
            token,
            key: self.keys.name(key),
        };
        encode_request(&request, &mut self.out[conn]);
        self.queued(conn, Kind::Release, token, key, tag);
    }

    /// Queues `E lease token key`.
    pub fn extend(&mut self, conn: usize, token: u64, key: u64, lease_s: u8, tag: u32) {
        let request = Request::Extend {
            lease_s,
            token,
            key: self.keys.name(key),
        };
        encode_request(&request, &mut self.out[conn]);
        self.queued(conn, Kind::Extend, token, key, tag);
    }

    /// Queues `P nonce` with a fresh nonce.
    pub fn ping(&mut self, conn: usize, tag: u32) {
        self.next_id += 1;
        let nonce = self.next_id;
        encode_request(&Request::Ping { nonce }, &mut self.out[conn]);
        self.queued(conn, Kind::Ping, nonce, 0, tag);
    }

    pub fn in_flight(&self, conn: usize) -> usize {
        self.in_flight[conn].len()
    }

    pub fn in_flight_total(&self) -> usize {
        self.in_flight_total
    }

    /// The pending request a reply answers: the oldest one of the right
    /// kind and id. Immediate answers come in request order, so the front
    /// matches almost always; deferred ones (grants after a wait) are found
    /// by a scan of the connection's requests in flight.
    fn take(&mut self, conn: usize, reply: &Response) -> Option<Pending> {
        let queue = &mut self.in_flight[conn];
        let matches = |p: &Pending| p.correlation().is_answered_by(reply);
        let position = queue.iter().position(matches)?;
        let pending = queue.remove(position)?;
        self.in_flight_total -= 1;
        Some(pending)
    }
}

/// What a workload does with the traffic.
pub trait Workload {
    /// Queues the first requests.
    fn start(&mut self, wire: &mut Wire, stats: &mut Stats);
    /// Handles the answer to `sent`. `X` answers come here too, after they
    /// have been counted as errors.
    fn reply(
        &mut self,
        conn: usize,
        sent: Pending,
        reply: &Response,
        wire: &mut Wire,
        stats: &mut Stats,
    );
    /// Runs what is due at `wire.now`; returns when it next wants a call.
    fn tick(&mut self, _wire: &mut Wire, _stats: &mut Stats) -> Option<Instant> {
        None
    }
    /// Stops issuing new work and queues the clean-up (releases).
    fn stop(&mut self, wire: &mut Wire, stats: &mut Stats);
    /// Extra text for the progress line.
    fn progress(&self) -> String {
        String::new()
    }
    /// Final figures, added to the stats before the report.
    fn finish(&mut self, _stats: &mut Stats) {}
    /// The spans from each event's send to its last answer (one still
    /// running ends at `now`), for telling other clients' latency during
    /// them apart.
    fn windows(&self, _now: Instant) -> Vec<(Instant, Instant)> {
        Vec::new()
    }
}

/// The TLS configuration of `tls://` connections (`None` for others).
#[cfg(feature = "tls")]
type Tls = Option<std::sync::Arc<rustls::ClientConfig>>;
#[cfg(not(feature = "tls"))]
type Tls = Option<std::convert::Infallible>;

#[cfg(feature = "tls")]
fn tls_config(address: &Address, options: &super::super::client::TlsOptions) -> io::Result<Tls> {
    if !matches!(address, Address::Tls(_)) {
        return Ok(None);
    }
    crate::tls::client_config(&super::super::client::tls_files(options))
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("TLS: {e}")))
}

#[cfg(not(feature = "tls"))]
fn tls_config(address: &Address, _: &super::super::client::TlsOptions) -> io::Result<Tls> {
    match address {
        Address::Tls(_) => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "tls:// needs kunci built with the `tls` feature",
        )),
        _ => Ok(None),
    }
}

#[cfg(feature = "tls")]
fn tcp_connect(host_port: &str) -> io::Result<mio::net::TcpStream> {
    let target = host_port.to_socket_addrs()?.next().ok_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address")
    })?;
    let stream = std::net::TcpStream::connect(target)?;
    stream.set_nodelay(true)?;
    stream.set_nonblocking(true)?;
    Ok(mio::net::TcpStream::from_std(stream))
}

/// Connects, blocking, then hands the socket to mio non-blocking. A TLS
/// session's handshake runs with the first requests.
fn connect(address: &Address, tls: &Tls, secret: Option<&Secret>) -> io::Result<Stream> {
    match address {
        Address::Tcp(host_port) => {
            let target = host_port.to_socket_addrs()?.next().ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address")
            })?;
            let mut stream = std::net::TcpStream::connect(target)?;
            stream.set_nodelay(true)?;
            if let Some(secret) = secret {
                stream.set_read_timeout(Some(AUTHENTICATION_TIMEOUT))?;
                authenticate(&mut stream, secret)?;
            }
            stream.set_nonblocking(true)?;
            Ok(Stream::Tcp(mio::net::TcpStream::from_std(stream)))
        }
        #[cfg(feature = "tls")]
        Address::Tls(host_port) => {
            let name = crate::tls::server_name(host_port)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let config = tls.clone().ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "no TLS configuration")
            })?;
            if secret.is_some() {
                // The fleet's TLS handshake runs with its first requests,
                // so there is no blocking moment to wait for `U`'s answer.
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "a secret over tls:// is not supported by kunci bench",
                ));
            }
            Stream::tls(tcp_connect(host_port)?, config, name)
        }
        #[cfg(not(feature = "tls"))]
        Address::Tls(_) => match *tls {
            Some(never) => match never {},
            None => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "tls:// needs kunci built with the `tls` feature",
            )),
        },
        Address::Unix(path) => {
            let mut stream = std::os::unix::net::UnixStream::connect(path)?;
            if let Some(secret) = secret {
                stream.set_read_timeout(Some(AUTHENTICATION_TIMEOUT))?;
                authenticate(&mut stream, secret)?;
            }
            stream.set_nonblocking(true)?;
            Ok(Stream::Unix(mio::net::UnixStream::from_std(stream)))
        }
        Address::Etcd { .. } => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the connection fleet speaks kunci's protocol, not etcd's",
        )),
    }
}

/// How long a connection waits for the answer to its `U`.
const AUTHENTICATION_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `U secret` on a fresh blocking connection and waits for its
/// answer, before the connection joins the fleet (spec §12.2).
fn authenticate(stream: &mut (impl Read + Write), secret: &Secret) -> io::Result<()> {
    let mut frame = Vec::new();
    let request = Request::Authenticate {
        secret: secret.as_bytes(),
    };
    encode_request(&request, &mut frame);
    stream.write_all(&frame)?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 256];
    loop {
        match decode_response(&answer) {
            Ok(Some((Response::Authenticated { .. }, _))) => return Ok(()),
            Ok(Some((other, _))) => {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("the server did not take the secret: {other:?}"),
                ));
            }
            Ok(None) => {}
            Err(error) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    error.to_string(),
                ));
            }
        }
        let n = stream.read(&mut buffer)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection before answering U",
            ));
        }
        answer.extend_from_slice(&buffer[..n]);
    }
}

struct Conn {
    stream: Stream,
    /// The start of a reply that has not fully arrived.
    partial: Vec<u8>,
    open: bool,
}

/// What one event says about a connection, copied out of `Events` so the
/// connections can be borrowed mutably while handling it.
struct Readiness {
    conn: usize,
    readable: bool,
    closing: bool,
    writable: bool,
}

pub struct Fleet {
    poll: Poll,
    events: Events,
    /// Reused every turn.
    ready: Vec<Readiness>,
    conns: Vec<Conn>,
    pub wire: Wire,
    scratch: Vec<u8>,
    open: usize,
}

impl Fleet {
    /// Opens `count` connections to `address`, one after another.
    pub fn connect(
        address: &Address,
        tls: &super::super::client::TlsOptions,
        count: usize,
        key_prefix: &str,
        secret: Option<&Secret>,
    ) -> io::Result<Fleet> {
        let poll = Poll::new()?;
        let tls = tls_config(address, tls)?;
        let mut conns = Vec::with_capacity(count);
        for index in 0..count {
            let mut stream = connect(address, &tls, secret).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("connection {} of {count} to {address}: {e}", index + 1),
                )
            })?;
            poll.registry().register(
                &mut stream,
                Token(index),
                Interest::READABLE | Interest::WRITABLE,
            )?;
            conns.push(Conn {
                stream,
                partial: Vec::new(),
                open: true,
            });
        }
        let now = Instant::now();
        Ok(Fleet {
            poll,
            events: Events::with_capacity(1024),
            ready: Vec::new(),
            wire: Wire {
                now,
                out: vec![Vec::new(); count],
                dirty: Vec::new(),
                is_dirty: vec![false; count],
                in_flight: vec![VecDeque::new(); count],
                in_flight_total: 0,
                next_id: 0,
                keys: KeyNames {
                    buf: key_prefix.to_owned(),
                    prefix_len: key_prefix.len(),
                },
            },
            conns,
            scratch: vec![0; 1 << 16],
            open: count,
        })
    }

    pub fn open(&self) -> usize {
        self.open
    }

    /// One turn of the loop: send what is queued, wait up to `timeout` for
    /// the sockets, hand every reply to the workload, send what that queued.
    pub fn turn(
        &mut self,
        timeout: Duration,
        workload: &mut dyn Workload,
        stats: &mut Stats,
    ) -> io::Result<()> {
        self.flush(stats);
        match self.poll.poll(&mut self.events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(e),
        }
        let mut ready = std::mem::take(&mut self.ready);
        ready.extend(self.events.iter().map(|e| Readiness {
            conn: e.token().0,
            readable: e.is_readable() || e.is_read_closed() || e.is_error(),
            closing: e.is_read_closed() || e.is_error(),
            writable: e.is_writable(),
        }));
        for r in ready.drain(..) {
            if r.conn >= self.conns.len() || !self.conns[r.conn].open {
                continue;
            }
            if r.writable {
                // Records a TLS session could not write before.
                let _ = self.conns[r.conn].stream.flush();
            }
            if r.writable && !self.wire.out[r.conn].is_empty() && !self.wire.is_dirty[r.conn] {
                self.wire.is_dirty[r.conn] = true;
                self.wire.dirty.push(r.conn);
            }
            if r.readable {
                self.wire.now = Instant::now();
                self.read(r.conn, r.closing, workload, stats);
            }
        }
        self.ready = ready;
        self.flush(stats);
        Ok(())
    }

    /// Reads and hands on everything `conn` has; `closing` (the peer shut
    /// its side) reads on to the end-of-file.
    fn read(&mut self, conn: usize, closing: bool, workload: &mut dyn Workload, stats: &mut Stats) {
        loop {
            let n = match self.conns[conn].stream.read(&mut self.scratch) {
                Ok(0) => {
                    self.close(conn, stats, "closed by the server".into());
                    return;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.close(conn, stats, format!("read failed: {e}"));
                    return;
                }
            };
            let mut partial = std::mem::take(&mut self.conns[conn].partial);
            let outcome = if partial.is_empty() {
                let (consumed, outcome) = self.replies(conn, n, None, workload, stats);
                partial.extend_from_slice(&self.scratch[consumed..n]);
                outcome
            } else {
                partial.extend_from_slice(&self.scratch[..n]);
                let (consumed, outcome) = self.replies(conn, 0, Some(&partial), workload, stats);
                partial.drain(..consumed);
                outcome
            };
            self.conns[conn].partial = partial;
            if let Err(description) = outcome {
                self.close(conn, stats, description);
                return;
            }
            // A short read drained the socket: whatever arrives later is a
            // new edge, so the read that would only say WouldBlock is saved.
            // An end-of-file already signalled brings no new edge: read it.
            if n < self.scratch.len() && !closing {
                return;
            }
        }
    }

    /// Decodes the replies in `buffer` (or in the first `n` scratch bytes)
    /// and hands them on; returns how many bytes were consumed.
    fn replies(
        &mut self,
        conn: usize,
        n: usize,
        buffer: Option<&[u8]>,
        workload: &mut dyn Workload,
        stats: &mut Stats,
    ) -> (usize, Result<(), String>) {
        let bytes = buffer.unwrap_or(&self.scratch[..n]);
        let mut at = 0;
        while at < bytes.len() {
            let (reply, len) = match decode_response(&bytes[at..]) {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => return (at, Err(format!("undecodable reply: {e}"))),
            };
            at += len;
            let op = bytes[at - len];
            let pending = self.wire.take(conn, &reply);
            let latency = pending.map_or(Duration::ZERO, |p| {
                self.wire.now.saturating_duration_since(p.sent)
            });
            stats.reply(op, pending.map(|p| p.kind), latency);
            if let Response::Error { code, id, text } = &reply {
                stats.error(format!("connection {conn}: X {code} id={id} {text}"));
            }
            match pending {
                Some(sent) => workload.reply(conn, sent, &reply, &mut self.wire, stats),
                // An `X` for no request of ours (`X 7`, `X 8`) is already counted.
                None if matches!(reply, Response::Error { .. }) => {}
                None => stats.error(format!("connection {conn}: unexpected reply {reply:?}")),
            }
        }
        (at, Ok(()))
    }

    fn close(&mut self, conn: usize, stats: &mut Stats, why: String) {
        let c = &mut self.conns[conn];
        if !c.open {
            return;
        }
        c.open = false;
        let _ = self.poll.registry().deregister(&mut c.stream);
        self.open -= 1;
        let lost = self.wire.in_flight[conn].len();
        self.wire.in_flight_total -= lost;
        self.wire.in_flight[conn].clear();
        self.wire.out[conn] = Vec::new();
        stats.error(format!(
            "connection {conn} {why}, {lost} requests unanswered"
        ));
    }

    /// Writes every connection's queued bytes until done or the socket is
    /// full (then the writable event brings it back here).
    fn flush(&mut self, stats: &mut Stats) {
        let dirty = std::mem::take(&mut self.wire.dirty);
        for &conn in &dirty {
            self.wire.is_dirty[conn] = false;
            if !self.conns[conn].open {
                continue;
            }
            let mut written = 0;
            let out = &self.wire.out[conn];
            let result = loop {
                if written == out.len() {
                    break Ok(());
                }
                match self.conns[conn].stream.write(&out[written..]) {
                    Ok(n) => written += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => break Err(e),
                }
            };
            self.wire.out[conn].drain(..written);
            if let Err(e) = result {
                self.close(conn, stats, format!("write failed: {e}"));
            }
        }
        let mut dirty = dirty;
        dirty.clear();
        if self.wire.dirty.is_empty() {
            self.wire.dirty = dirty;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names_are_prefix_and_twelve_digits() {
        let mut keys = KeyNames {
            buf: "pair-".into(),
            prefix_len: 5,
        };
        assert_eq!(keys.name(42), "pair-000000000042");
        assert_eq!(keys.name(999_999_999_999), "pair-999999999999");
        assert_eq!(keys.name(7).len(), 17);
    }
}
