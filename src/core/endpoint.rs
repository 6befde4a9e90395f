//! Every connection of a server and the core they share, with no sockets
//! and no clock: the sans-IO half of the server (quinn-proto's `Endpoint`
//! and `Connection` are the model).
//!
//! The shell gives it what the sockets did — [`accept`](Endpoint::accept),
//! [`handle_read`](Endpoint::handle_read), [`handle_eof`](Endpoint::handle_eof),
//! [`handle_written`](Endpoint::handle_written),
//! [`handle_broken`](Endpoint::handle_broken) — and the time
//! ([`handle_timeout`](Endpoint::handle_timeout)), each with `now`. It
//! pulls what to do: the bytes to write ([`next_transmit`](Endpoint::next_transmit),
//! [`transmit`](Endpoint::transmit)), socket actions ([`poll_action`](Endpoint::poll_action))
//! and when to wake up ([`poll_timeout`](Endpoint::poll_timeout)). With a
//! state directory it also says what must be durable first
//! ([`poll_persist`](Endpoint::poll_persist)): nothing is transmitted until
//! the shell has made that promise durable. Every
//! rule about reading, answering, backpressure and closing lives here or
//! in [`Connection`], where the simulation and the fuzzers reach it.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

use log::{debug, warn};

use super::access::AccessList;
use super::connection::{
    ANSWER_BYTES_PER_WORK, Connection, LINGER_US, OUTPUT_HIGH_WATER, OUTPUT_LOW_WATER,
    PARTIAL_FRAME_TIMEOUT_US, Phase, REQUEST_WORK, TURN_WORK_MAX,
};
use super::restart::{Durability, Promise};
use super::{ConnId, Core, Micros};
use crate::addr::Network;
use crate::protocol::{self, Decoded, ErrorCode, RESPONSE_FRAME_MAX, Request};
use crate::timer_wheel::{
    TimerId, TimerLinks, TimerStore, TimerWheel, tick_at_or_after, tick_reached, tick_start,
};

/// The largest connection id: ids are the connection timer wheel's ids.
pub const CONN_ID_MAX: u64 = crate::timer_wheel::TIMER_ID_MAX as u64;

/// At most this many connections refused at accept linger at once;
/// beyond it they are closed right after a best-effort `X 7`/`X 9`.
const LINGERING_REFUSED_MAX: usize = 256;
/// How long a graceful shutdown waits for peers to take their last bytes.
pub const SHUTDOWN_GRACE_US: Micros = 3_000_000;
/// Emptied output buffers up to this capacity are kept, up to
/// [`SPARE_OUTPUTS_MAX`] of them, for the next connections that answer:
/// a busy server then allocates no output buffer per wake-up, while an
/// idle connection still owns none.
const SPARE_OUTPUT_CAPACITY_MAX: usize = 16 * 1024;
const SPARE_OUTPUTS_MAX: usize = 64;
/// TLS handshake steps (reads of a connection still in its handshake) per
/// turn of the event loop, over all connections: each may cost a
/// signature (~0.5 ms with RSA-2048), so a flood of ClientHellos delays
/// established sessions' answers by a few milliseconds a turn at most
/// (spec §4, fairness). Connections beyond it wait for the next turn.
pub const HANDSHAKES_PER_TURN: u32 = 4;
pub use super::auth_log::AUTH_FAILURE_LOG_EVERY_US;

/// What the shell must do to a connection's socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Everything is sent: shut the write side, so the peer reads our last
    /// answer and then end-of-file.
    ShutWrite,
    /// Close the socket and free the id; the endpoint has forgotten it.
    Close,
    /// Read the socket again without waiting for readiness: input that
    /// backpressure held back is waiting in the kernel, and edge-triggered
    /// readiness will not report it again.
    Read,
}

/// Why evaluating a connection's input stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// Only part of a frame (or nothing) is left.
    Incomplete,
    /// Output passed the high-water mark.
    OutputFull,
    /// The connection's work for this turn is spent; whole frames wait.
    Yield,
    /// Framing is lost; the `X` is queued.
    Fatal,
}

pub struct Endpoint {
    core: Core,
    /// Indexed by the shell's id for the socket.
    conns: Vec<Option<Connection>>,
    /// How many slots of `conns` are filled.
    count: usize,
    /// Partial-frame and linger deadlines.
    timers: TimerWheel,
    allow: Vec<Network>,
    /// Connections with output to send, each once.
    transmit_queue: Vec<ConnId>,
    actions: VecDeque<(ConnId, Action)>,
    refused_lingering: usize,
    shutdown_deadline: Option<Micros>,
    /// Emptied output buffers, kept so that busy connections do not
    /// allocate one per wake-up.
    spare_outputs: Vec<Vec<u8>>,
    /// With a state directory: what the file on disk promises (spec §7).
    durability: Option<Durability>,
    /// With `--auth`: the identities a session may authenticate as.
    access: Option<AccessList>,
    /// With `--auth`, by connection id: the index of the identity the
    /// session authenticated as, or [`UNAUTHENTICATED`]. Kept here rather
    /// than in [`Connection`], which it would grow by 8 bytes on a server
    /// without `--auth` too.
    identities: Vec<u32>,
    /// With `--auth`, by identity index: its open sessions (connections
    /// that completed `U` as it), for its `max-connections` (spec §12.1).
    sessions: Vec<u32>,
    /// With `--auth`: the peers of connections not yet authenticated, for
    /// the log line of a failure.
    unauthenticated_peers: HashMap<ConnId, Option<IpAddr>>,
    /// Where TLS connections' records are decrypted, reused across reads.
    #[cfg(feature = "tls")]
    tls_plaintext: Vec<u8>,
    /// The turn of the event loop (see [`begin_turn`](Self::begin_turn)).
    turn: u32,
    /// Connections in [`Phase::Yielded`], to go on with next turn.
    yielded: Vec<ConnId>,
    /// Handshake steps taken this turn (see [`HANDSHAKES_PER_TURN`]).
    #[cfg(feature = "tls")]
    handshakes_this_turn: u32,
    /// Connections not yet closed, by TCP peer address.
    peer_connections: HashMap<IpAddr, u32>,
    /// The most connections one peer address may hold; `None`: half of
    /// `max_connections`.
    max_connections_per_peer: Option<usize>,
    /// With `--auth`: which failures to log.
    auth_failure_log: super::auth_log::AuthFailureLog,
}

/// Whose adoption tries a connection from `peer` makes, until it
/// authenticates (spec §7.3 v5): its address, or every Unix peer as one.
fn adopter_of(peer: Option<IpAddr>) -> super::Adopter {
    peer.map_or(super::Adopter::Local, |ip| {
        super::Adopter::Peer(ip.to_canonical())
    })
}

/// A session that has not sent a good `U` (yet).
const UNAUTHENTICATED: u32 = u32::MAX;

/// Gives the connection timer wheel the links inside connections.
struct ConnTimers<'a>(&'a mut [Option<Connection>]);

impl TimerStore for ConnTimers<'_> {
    fn links(&mut self, id: TimerId) -> &mut TimerLinks {
        &mut self.0[id as usize]
            .as_mut()
            .expect("a timer armed for a connection that is gone")
            .timer
    }
}

impl Endpoint {
    /// An endpoint around `core`. TCP peers outside `allow` (when it is not
    /// empty) are refused at accept with `X 9`.
    pub fn new(core: Core, allow: Vec<Network>) -> Endpoint {
        Endpoint {
            core,
            conns: Vec::new(),
            count: 0,
            timers: TimerWheel::new(),
            allow,
            transmit_queue: Vec::new(),
            actions: VecDeque::new(),
            refused_lingering: 0,
            shutdown_deadline: None,
            spare_outputs: Vec::new(),
            durability: None,
            access: None,
            identities: Vec::new(),
            sessions: Vec::new(),
            unauthenticated_peers: HashMap::new(),
            #[cfg(feature = "tls")]
            tls_plaintext: Vec::new(),
            turn: 0,
            yielded: Vec::new(),
            #[cfg(feature = "tls")]
            handshakes_this_turn: 0,
            peer_connections: HashMap::new(),
            max_connections_per_peer: None,
            auth_failure_log: Default::default(),
        }
    }

    /// Limits the connections one TCP peer address may hold (spec §4);
    /// by default half of `max_connections`, so that a second host can
    /// always connect. Unix peers are not limited: only this host reaches
    /// them, and the socket file's permissions say who.
    pub fn limit_connections_per_peer(&mut self, max: usize) {
        self.max_connections_per_peer = Some(max);
    }

    /// The most connections one TCP peer address may hold.
    pub fn max_connections_per_peer(&self) -> usize {
        self.max_connections_per_peer
            .unwrap_or(self.core.limits().max_connections / 2)
            .max(1)
    }

    /// Starts a turn of the event loop (spec §4, fairness): every
    /// connection gets a fresh share of work, and those that spent theirs
    /// last turn go on with what they had read (then, when done, the shell
    /// reads them again: [`Action::Read`]). The shell calls it once per
    /// wake-up, before it reads.
    pub fn begin_turn(&mut self, now: Micros) {
        self.turn = self.turn.wrapping_add(1);
        self.core.begin_turn();
        #[cfg(feature = "tls")]
        {
            self.handshakes_this_turn = 0;
        }
        if !self.yielded.is_empty() {
            self.resume_yielded(now);
        }
    }

    /// Lets the connections that yielded in the last turn go on, first in
    /// this one. Out of line: most turns have none.
    #[inline(never)]
    fn resume_yielded(&mut self, now: Micros) {
        for id in std::mem::take(&mut self.yielded) {
            let Some(conn) = self.conn_mut(id) else {
                continue;
            };
            if conn.phase != Phase::Yielded {
                continue;
            }
            #[cfg(feature = "tls")]
            if let Some(records) = conn
                .tls
                .as_mut()
                .map(|tls| std::mem::take(&mut tls.held_records))
                .filter(|records| !records.is_empty())
            {
                conn.phase = Phase::Open;
                self.handle_records(id, &records, now);
                if self.connection(id).map(Connection::phase) == Some(Phase::Open) {
                    self.actions.push_back((id, Action::Read));
                }
                continue;
            }
            self.resume(id, now);
        }
    }

    /// Whether connections wait for the next turn: the shell must not
    /// sleep before it.
    pub fn has_yielded(&self) -> bool {
        !self.yielded.is_empty()
    }

    /// Whether `id` must keep a deadline that runs from its accept: a TLS
    /// handshake's, or (with `--auth`) the `U`'s (spec §12.2).
    fn keeps_accept_deadline(&self, id: ConnId) -> bool {
        self.connection(id).is_some_and(Connection::is_handshaking)
            || (self.access.is_some() && !self.is_authenticated(id))
    }

    /// Stops evaluating `id` for this turn.
    fn yield_turn(&mut self, id: ConnId) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        conn.phase = Phase::Yielded;
        self.yielded.push(id);
        if !self.keeps_accept_deadline(id) {
            self.cancel(id);
        }
    }

    /// Turns authentication on (spec §12.2): from now on a connection's
    /// first request must be a `U` whose secret `access` knows, and every
    /// later one must lie within that identity's scopes. Call it before
    /// accepting.
    pub fn require_authentication(&mut self, access: AccessList) {
        self.access = Some(access);
    }

    /// Whether authentication is on.
    pub fn authenticates(&self) -> bool {
        self.access.is_some()
    }

    /// Whether TCP peers are checked against an `--allow` list.
    pub fn checks_peers(&self) -> bool {
        !self.allow.is_empty()
    }

    /// Makes every answer wait until what it reveals (tokens, leases) is
    /// durable: from now on [`transmit`](Self::transmit) gives nothing
    /// while [`poll_persist`](Self::poll_persist) has a promise to make.
    /// The first promise is due at once (it replaces the earlier run's
    /// file), so call it before accepting.
    pub fn require_durability(&mut self) {
        self.durability = Some(Durability::new());
    }

    /// The promise the shell must make durable (write and fsync) before it
    /// transmits anything else, then report with
    /// [`handle_persisted`](Self::handle_persisted); `None` when the file
    /// covers everything queued (or there is no state directory).
    pub fn poll_persist(&self) -> Option<Promise> {
        self.durability.as_ref()?.needed(&self.core)
    }

    /// The shell made `promise` durable. Returns, when writes had been
    /// failing, how many did (spec §7.6: the trouble is over; every answer
    /// held for the disk goes out).
    pub fn handle_persisted(&mut self, promise: Promise) -> Option<u64> {
        let durability = self.durability.as_mut()?;
        durability.persisted(promise);
        let failures = durability.recovered()?;
        self.core.set_ceiling(None);
        for id in 0..self.conns.len() as ConnId {
            if let Some(conn) = self.conn_mut(id)
                && std::mem::take(&mut conn.awaits_disk)
            {
                self.queue_transmit(id);
            }
        }
        Some(failures)
    }

    /// Writing `wanted` (from [`poll_persist`](Self::poll_persist)) failed
    /// at `now` (spec §7.6): the server goes on within what the file
    /// holds — the core answers `B` to what needs more — the output
    /// waiting now, which may reveal what the file does not hold, waits
    /// for a write that succeeds, and the write is tried again later
    /// ([`write_due`](Self::write_due)). Returns whether to log the
    /// failure (at most once a minute).
    pub fn handle_persist_failed(&mut self, wanted: Promise, now: Micros) -> bool {
        let Some(durability) = self.durability.as_mut() else {
            return false;
        };
        // Only what was decided before the ceiling was set can pass the
        // file: a failed retry later holds nothing back (the core has
        // promised nothing new since).
        let hold_back = !durability.failing() && durability.raises(wanted);
        let log = durability.failed(now);
        self.core.set_ceiling(durability.on_disk());
        self.core.stats_mut().state_errors += 1;
        if hold_back {
            for conn in self.conns.iter_mut().flatten() {
                if !conn.output.is_empty() {
                    conn.awaits_disk = true;
                }
            }
        }
        log
    }

    /// What the state file promises, as far as this run wrote it.
    pub fn on_disk(&self) -> Option<Promise> {
        self.durability.as_ref()?.on_disk()
    }

    /// Whether the shell may try to write the state file at `now`: always,
    /// unless a write failed less than a second ago.
    pub fn write_due(&self, now: Micros) -> bool {
        self.durability
            .as_ref()
            .is_none_or(|durability| durability.write_due(now))
    }

    pub fn core(&self) -> &Core {
        &self.core
    }

    pub fn core_mut(&mut self) -> &mut Core {
        &mut self.core
    }

    /// The connection with this id, if the endpoint knows it.
    pub fn connection(&self, id: ConnId) -> Option<&Connection> {
        self.conns.get(id as usize)?.as_ref()
    }

    /// Connections the endpoint knows, closing ones included.
    pub fn connection_count(&self) -> usize {
        self.count
    }

    /// Whether the shell should read connection `id`'s socket.
    pub fn wants_read(&self, id: ConnId) -> bool {
        self.connection(id).is_some_and(Connection::wants_read)
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutdown_deadline.is_some()
    }

    /// After [`shut_down`](Self::shut_down): whether every connection is
    /// closed or the grace period is over.
    pub fn is_shut_down(&self, now: Micros) -> bool {
        self.shutdown_deadline
            .is_some_and(|deadline| self.count == 0 || now >= deadline)
    }

    /// The most output a connection can hold: the high-water mark plus the
    /// answers to the frame that passed it (a hand-over to itself
    /// included, or an `H`/`L` answer of at most
    /// [`ANSWER_BYTES_MAX`](super::ANSWER_BYTES_MAX) and its `Z`), plus one
    /// deferred answer per wait or watch it may hold (the largest: a `V`
    /// with a 128-byte label), plus the `X 8` of a shutdown.
    pub fn output_bound(&self) -> usize {
        let per_wait = 1 + 30 + crate::protocol::LABEL_LEN_MAX + 1;
        OUTPUT_HIGH_WATER
            + (2 * RESPONSE_FRAME_MAX).max(super::ANSWER_BYTES_MAX + RESPONSE_FRAME_MAX)
            + (self.core.limits().max_waits_per_conn as usize
                + self.core.limits().max_watches_per_conn as usize)
                * per_wait
            + RESPONSE_FRAME_MAX
    }

    /// A socket was accepted and given id `id` (an index the shell reuses
    /// only after [`Action::Close`]). `peer` is the TCP peer's address,
    /// `None` for a Unix peer. A peer outside the allow list gets `X 9`, one
    /// beyond the connection limit `X 7`; both are closed after that
    /// without a byte of theirs being read (spec §6).
    pub fn accept(&mut self, id: ConnId, peer: Option<IpAddr>, now: Micros) {
        self.make_room(id);
        self.count += 1;
        if let Some(code) = self.refusal(peer) {
            return self.refuse(id, code, now);
        }
        self.conns[id as usize] = Some(Connection::new(Phase::Open));
        self.count_peer(id, peer);
        self.core.connect(id);
        self.core.set_adopter(id, adopter_of(peer));
        self.expect_authentication(id, peer, now);
    }

    /// Counts live connection `id` in its peer's share.
    fn count_peer(&mut self, id: ConnId, peer: Option<IpAddr>) {
        let Some(ip) = peer.map(|ip| ip.to_canonical()) else {
            return;
        };
        if let Some(conn) = self.conn_mut(id) {
            conn.peer = Some(ip);
            *self.peer_connections.entry(ip).or_insert(0) += 1;
        }
    }

    /// With `--auth`, a new session has not authenticated yet: it has
    /// [`PARTIAL_FRAME_TIMEOUT_US`] from its accept to do so (spec §12.2).
    fn expect_authentication(&mut self, id: ConnId, peer: Option<IpAddr>, now: Micros) {
        if self.access.is_some() {
            if !self
                .connection(id)
                .is_some_and(|conn| conn.timer.is_armed())
            {
                self.arm(id, now + PARTIAL_FRAME_TIMEOUT_US, now);
            }
            let index = id as usize;
            if self.identities.len() <= index {
                self.identities.resize(index + 1, UNAUTHENTICATED);
            }
            self.identities[index] = UNAUTHENTICATED;
            self.unauthenticated_peers.insert(id, peer);
        }
    }

    /// A socket was accepted on a TLS listener and given id `id`. The
    /// handshake must finish within [`PARTIAL_FRAME_TIMEOUT_US`] of `now`,
    /// however slowly its bytes come. A peer refused at accept (`X 7`,
    /// `X 9`) is closed at once with nothing sent: a plaintext `X` is no
    /// answer to a ClientHello, and a refused peer gets no handshake.
    #[cfg(feature = "tls")]
    pub fn accept_tls(
        &mut self,
        id: ConnId,
        peer: Option<IpAddr>,
        config: &std::sync::Arc<rustls::ServerConfig>,
        now: Micros,
    ) {
        self.make_room(id);
        if self.refusal(peer).is_some() {
            return self.actions.push_back((id, Action::Close));
        }
        let tls = match super::tls::TlsLayer::new(config) {
            Ok(tls) => tls,
            Err(e) => {
                log::warn!("connection {id}: cannot start a TLS session: {e}");
                return self.actions.push_back((id, Action::Close));
            }
        };
        let mut conn = Connection::new(Phase::Open);
        conn.tls = Some(Box::new(tls));
        self.count += 1;
        self.conns[id as usize] = Some(conn);
        self.count_peer(id, peer);
        self.core.connect(id);
        self.core.set_adopter(id, adopter_of(peer));
        self.arm(id, now + PARTIAL_FRAME_TIMEOUT_US, now);
        self.expect_authentication(id, peer, now);
    }

    fn make_room(&mut self, id: ConnId) {
        let index = id as usize;
        if self.conns.len() <= index {
            self.conns.resize_with(index + 1, || None);
        }
        assert!(self.conns[index].is_none(), "connection id {id} reused");
    }

    /// Why a peer is refused at accept, if it is; counted.
    fn refusal(&mut self, peer: Option<IpAddr>) -> Option<ErrorCode> {
        let allowed = match peer {
            Some(ip) if !self.allow.is_empty() => {
                self.allow.iter().any(|network| network.contains(ip))
            }
            _ => true,
        };
        if !allowed {
            debug!("refusing {peer:?}: not in --allow");
            self.core.stats_mut().refused += 1;
            return Some(ErrorCode::NotAllowed);
        }
        if self.core.connections() >= self.core.limits().max_connections {
            debug!("refusing {peer:?}: connection limit");
            self.core.stats_mut().refused_max_connections += 1;
            return Some(ErrorCode::ConnectionLimit);
        }
        if let Some(ip) = peer.map(|ip| ip.to_canonical()) {
            let held = self.peer_connections.get(&ip).copied().unwrap_or(0);
            if held as usize >= self.max_connections_per_peer() {
                debug!("refusing {ip}: its share of the connection limit");
                self.core.stats_mut().refused_max_connections += 1;
                return Some(ErrorCode::ConnectionLimit);
            }
        }
        None
    }

    fn refuse(&mut self, id: ConnId, code: ErrorCode, now: Micros) {
        let mut conn = Connection::new(Phase::Flushing { peer_closed: false });
        let linger = if self.refused_lingering < LINGERING_REFUSED_MAX {
            self.refused_lingering += 1;
            conn.refused = true;
            LINGER_US
        } else {
            // Too many refused peers linger already: one write attempt,
            // then the socket goes.
            1
        };
        self.conns[id as usize] = Some(conn);
        self.core.send_error(id, code, 0);
        self.route();
        self.arm(id, now + linger, now);
    }

    /// The frame for a peer accepted only to be told that the server is out
    /// of descriptors: the shell writes it once and closes. Counted as an
    /// error sent.
    pub fn refusal_without_descriptor(&mut self) -> Vec<u8> {
        let stats = self.core.stats_mut();
        stats.count_error(ErrorCode::ConnectionLimit);
        stats.refused_fd_limit += 1;
        let mut frame = Vec::with_capacity(RESPONSE_FRAME_MAX);
        protocol::encode_response(&ErrorCode::ConnectionLimit.response(0), &mut frame);
        frame
    }

    /// The socket of `id` read `bytes` at `now`. Whole frames are evaluated
    /// until output passes the high-water mark; the rest is kept.
    pub fn handle_read(&mut self, id: ConnId, bytes: &[u8], now: Micros) {
        #[cfg(feature = "tls")]
        if self.connection(id).is_some_and(|conn| conn.tls.is_some()) {
            return self.handle_records(id, bytes, now);
        }
        self.handle_plaintext(id, bytes, now);
    }

    /// TLS records read from `id`: the handshake advances, and what they
    /// decrypt to is read as from a plaintext socket.
    #[cfg(feature = "tls")]
    fn handle_records(&mut self, id: ConnId, bytes: &[u8], now: Micros) {
        let Some(conn) = self.conns.get_mut(id as usize).and_then(Option::as_mut) else {
            return;
        };
        if !conn.phase.is_live() {
            // Closing: input is discarded.
            return;
        }
        let Some(tls) = conn.tls.as_mut() else {
            return;
        };
        let was_handshaking = tls.is_handshaking();
        if was_handshaking {
            if self.handshakes_this_turn >= HANDSHAKES_PER_TURN {
                // This turn's handshake work is spent: the records wait
                // (at most one read's worth, since the shell stops reading).
                tls.held_records.extend_from_slice(bytes);
                if conn.phase == Phase::Open {
                    conn.phase = Phase::Yielded;
                    self.yielded.push(id);
                }
                return;
            }
            self.handshakes_this_turn += 1;
        }
        let mut plaintext = std::mem::take(&mut self.tls_plaintext);
        let result = tls.read(bytes, &mut plaintext);
        let handshaking = tls.is_handshaking();
        let has_records = tls.has_records();
        if has_records {
            self.queue_transmit(id);
        }
        let peer_closed = match result {
            Ok(peer_closed) => peer_closed,
            Err(e) => {
                debug!("connection {id}: TLS: {e}");
                plaintext.clear();
                self.tls_plaintext = plaintext;
                return self.begin_close(id, false, now);
            }
        };
        if was_handshaking && !handshaking && !self.keeps_accept_deadline(id) {
            // The handshake's deadline ends with it; a frame gets its own.
            self.cancel(id);
        }
        if !plaintext.is_empty() {
            self.handle_plaintext(id, &plaintext, now);
        }
        plaintext.clear();
        self.tls_plaintext = plaintext;
        if peer_closed {
            self.handle_eof(id, now);
        }
    }

    /// Plaintext read from `id`: straight from its socket, or decrypted.
    fn handle_plaintext(&mut self, id: ConnId, bytes: &[u8], now: Micros) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        match conn.phase {
            Phase::Open => {}
            // The shell should not read now; keep what it did read.
            Phase::Backpressured | Phase::Yielded => return conn.carry(bytes),
            // Closing: input is discarded.
            Phase::Flushing { .. } | Phase::Lingering => return,
        }
        let (progress, stop) = if conn.input.is_empty() {
            // The common case: decode straight from the shell's buffer and
            // keep only a trailing partial frame.
            let (consumed, stop) = self.evaluate(id, bytes, now);
            if stop != Stop::Fatal {
                self.conn_mut(id)
                    .expect("evaluation keeps the connection")
                    .carry(&bytes[consumed..]);
            }
            (consumed > 0, stop)
        } else {
            conn.carry(bytes);
            self.evaluate_input(id, now)
        };
        self.after_evaluation(id, progress, stop, now);
    }

    /// The peer of `id` closed its write side (a read returned 0). Its
    /// waiters leave their queues at once (spec §1); answers already queued
    /// are still sent, since a half-closed peer can read them.
    pub fn handle_eof(&mut self, id: ConnId, now: Micros) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        match conn.phase {
            Phase::Open | Phase::Backpressured | Phase::Yielded => {
                debug!("connection {id} closed by peer");
                self.begin_close(id, true, now);
            }
            Phase::Flushing { .. } => conn.phase = Phase::Flushing { peer_closed: true },
            Phase::Lingering => self.close(id, now),
        }
    }

    /// Reading or writing `id`'s socket failed: it is gone.
    pub fn handle_broken(&mut self, id: ConnId, now: Micros) {
        self.close(id, now);
    }

    /// The next connection with output to send. The shell writes it with
    /// [`transmit`](Self::transmit) and [`handle_written`](Self::handle_written)
    /// until the socket would block (then its write readiness brings it
    /// back) or nothing is left.
    pub fn next_transmit(&mut self) -> Option<ConnId> {
        loop {
            let id = self.transmit_queue.pop()?;
            if let Some(conn) = self.conn_mut(id) {
                conn.transmit_queued = false;
                return Some(id);
            }
        }
    }

    /// Whether any connection has output queued since the last
    /// [`next_transmit`](Self::next_transmit) returned `None`.
    pub fn has_transmit(&self) -> bool {
        !self.transmit_queue.is_empty()
    }

    /// The bytes `id` has to send now, if any: none while a promise
    /// waits to be made durable ([`poll_persist`](Self::poll_persist)).
    pub fn transmit(&mut self, id: ConnId) -> Option<&[u8]> {
        // Nothing to send is the usual answer (a write's second look): say
        // it before asking the state file.
        if !self.has_output(id) {
            return None;
        }
        // While writes fail (spec §7.6) the core promises nothing past the
        // file: only the output that waited at the failure waits on.
        let failing = self.durability.as_ref().is_some_and(Durability::failing);
        if !failing && self.poll_persist().is_some() {
            return None;
        }
        let conn = self.conns.get_mut(id as usize)?.as_mut()?;
        #[cfg(feature = "tls")]
        if let Some(tls) = conn.tls.as_mut() {
            let records = tls.records(&conn.output, &mut self.spare_outputs);
            return (!records.is_empty()).then_some(records);
        }
        (!conn.output.is_empty()).then_some(&conn.output[..])
    }

    /// Whether [`transmit`](Self::transmit) may have bytes for `id`
    /// (with TLS, records may wait with no output): when not, nothing of
    /// `id`'s can leave, and no promise needs to be durable for it.
    pub fn has_output(&self, id: ConnId) -> bool {
        let Some(conn) = self.connection(id) else {
            return false;
        };
        #[cfg(feature = "tls")]
        if conn.tls.is_some() {
            return !conn.awaits_disk;
        }
        !conn.awaits_disk && !conn.output.is_empty()
    }

    /// The socket of `id` took the first `written` bytes of
    /// [`transmit`](Self::transmit).
    pub fn handle_written(&mut self, id: ConnId, written: usize, now: Micros) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        #[cfg(feature = "tls")]
        if conn.tls.is_some() {
            return self.handle_records_written(id, written, now);
        }
        let emptied = conn.sent(written);
        let below_low_water = conn.output.len() < OUTPUT_LOW_WATER;
        if let Some(buffer) = emptied {
            if self.spare_outputs.len() < SPARE_OUTPUTS_MAX
                && buffer.capacity() <= SPARE_OUTPUT_CAPACITY_MAX
            {
                self.spare_outputs.push(buffer);
            }
            self.output_drained(id, now);
        } else if below_low_water && conn.phase == Phase::Backpressured {
            self.resume(id, now);
        }
    }

    /// The socket of TLS connection `id` took `written` bytes of its
    /// records. Output leaves the connection once the records carrying it
    /// are all written.
    #[cfg(feature = "tls")]
    fn handle_records_written(&mut self, id: ConnId, written: usize, now: Micros) {
        let Some(conn) = self.conns.get_mut(id as usize).and_then(Option::as_mut) else {
            return;
        };
        let Some(tls) = conn.tls.as_mut() else {
            return;
        };
        let Some((carried, records)) = tls.written(written) else {
            return;
        };
        if records.capacity() <= SPARE_OUTPUT_CAPACITY_MAX
            && self.spare_outputs.len() < SPARE_OUTPUTS_MAX
        {
            self.spare_outputs.push(records);
        }
        let emptied = (carried > 0).then(|| conn.sent(carried)).flatten();
        if let Some(buffer) = emptied {
            if self.spare_outputs.len() < SPARE_OUTPUTS_MAX
                && buffer.capacity() <= SPARE_OUTPUT_CAPACITY_MAX
            {
                self.spare_outputs.push(buffer);
            }
        }
        if conn.nothing_to_send() {
            self.output_drained(id, now);
        } else {
            if conn.output.len() < OUTPUT_LOW_WATER && conn.phase == Phase::Backpressured {
                self.resume(id, now);
            }
            // More output than one batch, or records the session made since.
            self.queue_transmit(id);
        }
    }

    /// The next thing the shell must do to a socket.
    pub fn poll_action(&mut self) -> Option<(ConnId, Action)> {
        self.actions.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) next has work.
    pub fn poll_timeout(&self) -> Option<Micros> {
        [
            self.core.poll_timeout(),
            self.timers.next_tick().map(tick_start),
            self.shutdown_deadline,
            self.durability
                .as_ref()
                .and_then(|durability| durability.poll_timeout(&self.core)),
            self.durability.as_ref().and_then(Durability::retry_at),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Fires what is due at `now`: the core's leases and waits, then
    /// partial-frame and linger deadlines. With a state directory it may
    /// also decide to bring the lease horizon down (`Durability::plan`):
    /// the shell then makes [`poll_persist`](Self::poll_persist) durable.
    pub fn handle_timeout(&mut self, now: Micros) {
        self.core.handle_timeout(now);
        if let Some(durability) = self.durability.as_mut() {
            durability.plan(&mut self.core, now);
        }
        self.route();
        while let Some(id) = self
            .timers
            .poll(&mut ConnTimers(&mut self.conns), tick_reached(now))
        {
            let Some(conn) = self.connection(id) else {
                continue;
            };
            if conn.phase.is_live()
                && !conn.is_handshaking()
                && !self.is_authenticated(id)
                && self.access.is_some()
            {
                // No `U` within 10 s of the accept (spec §12.2).
                debug!("connection {id}: not authenticated within 10 s");
                self.fail_authentication(id, now);
                self.route();
                self.begin_close(id, false, now);
                continue;
            }
            if conn.phase == Phase::Open {
                debug!("connection {id}: frame incomplete for 10 s");
            }
            self.close(id, now);
        }
    }

    /// Graceful shutdown (spec §4): queued waiters get `B`, every open
    /// connection `X 8`, and every connection starts closing; the shell
    /// stops accepting and returns once [`is_shut_down`](Self::is_shut_down).
    pub fn shut_down(&mut self, now: Micros) {
        if self.shutdown_deadline.is_some() {
            return;
        }
        self.shutdown_deadline = Some(now + SHUTDOWN_GRACE_US);
        self.core.shut_down(now);
        self.route();
        for id in 0..self.conns.len() as ConnId {
            if self.connection(id).is_some_and(|conn| conn.phase.is_live()) {
                self.begin_close(id, false, now);
            }
        }
    }

    /// Asserts what must hold between calls: buffers within their bounds,
    /// the core knowing exactly the live connections, each deadline armed
    /// exactly when its phase needs one. Simulations call it after every
    /// step.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut count = 0;
        let output_bound = self.output_bound();
        for (id, conn) in self.conns.iter().enumerate() {
            let id = id as ConnId;
            let Some(conn) = conn else {
                assert!(!self.core.is_open(id), "core knows closed connection {id}");
                continue;
            };
            count += 1;
            assert_eq!(
                conn.phase.is_live(),
                self.core.is_open(id),
                "connection {id} in {:?}",
                conn.phase
            );
            assert!(
                conn.input.len() <= super::connection::INPUT_MAX,
                "connection {id} holds {} bytes of input",
                conn.input.len()
            );
            assert!(
                conn.output.len() <= output_bound,
                "connection {id} holds {} bytes of output",
                conn.output.len()
            );
            match conn.phase {
                Phase::Open => {
                    assert!(
                        conn.input.len() < protocol::REQUEST_FRAME_MAX,
                        "connection {id} holds a whole frame unevaluated"
                    );
                    assert_eq!(
                        conn.timer.is_armed(),
                        !conn.input.is_empty() || self.keeps_accept_deadline(id),
                        "partial-frame, handshake or `U` deadline of connection {id}"
                    );
                }
                Phase::Yielded => {
                    assert_eq!(
                        conn.timer.is_armed(),
                        self.keeps_accept_deadline(id),
                        "handshake or `U` deadline of yielded connection {id}"
                    );
                    assert!(self.yielded.contains(&id), "yielded {id} is not listed");
                }
                Phase::Backpressured => {
                    assert!(!conn.timer.is_armed(), "backpressured {id} has a deadline");
                }
                Phase::Flushing { .. } => {
                    assert!(
                        conn.timer.is_armed(),
                        "flushing {id} has no linger deadline"
                    );
                    assert!(conn.input.is_empty(), "closing {id} kept input");
                }
                Phase::Lingering => {
                    assert!(conn.timer.is_armed(), "lingering {id} has no deadline");
                    assert!(conn.output.is_empty(), "lingering {id} has output");
                }
            }
        }
        assert_eq!(count, self.count, "connection count");
        assert_eq!(self.timers.len(), self.armed_count(), "connection timers");
        self.core.check_invariants();
    }

    fn armed_count(&self) -> usize {
        self.conns
            .iter()
            .flatten()
            .filter(|conn| conn.timer.is_armed())
            .count()
    }

    fn conn_mut(&mut self, id: ConnId) -> Option<&mut Connection> {
        self.conns.get_mut(id as usize)?.as_mut()
    }

    /// Evaluates the whole frames at the start of `buf` for `id`; returns
    /// the bytes consumed and why it stopped.
    fn evaluate(&mut self, id: ConnId, buf: &[u8], now: Micros) -> (usize, Stop) {
        let mut at = 0;
        // With a large table, the frames before `prefetched` had their
        // index lines prefetched before any of them was evaluated.
        let mut prefetched = 0;
        let turn = self.turn;
        // The output length and the core's work before the last request:
        // its cost is charged at the top of the next round, where the
        // connection is looked up anyway.
        let mut charge: Option<(usize, u64)> = None;
        loop {
            let Some(conn) = self.conns[id as usize].as_mut() else {
                return (at, Stop::OutputFull);
            };
            if conn.turn != turn {
                conn.turn = turn;
                conn.work = 0;
            }
            if let Some((output_before, work_before)) = charge.take() {
                let answered = conn.output.len().saturating_sub(output_before);
                let cost = u64::from(REQUEST_WORK)
                    + (self.core.work() - work_before)
                    + (answered / ANSWER_BYTES_PER_WORK) as u64;
                conn.work = u32::try_from(u64::from(conn.work) + cost).unwrap_or(u32::MAX);
            }
            if conn.output_full() {
                return (at, Stop::OutputFull);
            }
            // A read used up (at P=1, after its only request): what the
            // decoder would say, without asking it.
            if at == buf.len() {
                return (at, Stop::Incomplete);
            }
            let spent = conn.work >= TURN_WORK_MAX;
            let output_before = conn.output.len();
            if at >= prefetched && self.core.prefetch_pays() {
                prefetched = at + prefetch_ahead(&self.core, &buf[at..]);
            }
            let work_before = self.core.work();
            let decoded = protocol::decode_request(&buf[at..]);
            if spent && !matches!(decoded, Decoded::Incomplete) {
                return (at, Stop::Yield);
            }
            match decoded {
                Decoded::Incomplete => return (at, Stop::Incomplete),
                Decoded::Request { request, len } => {
                    at += len;
                    if self.access.is_none() {
                        self.core.handle_request(id, &request, now);
                    } else if !self.evaluate_authenticated(id, &request, now) {
                        self.route();
                        return (buf.len(), Stop::Fatal);
                    }
                }
                Decoded::Invalid { error, len } => {
                    at += len;
                    if self.access.is_some() && !self.is_authenticated(id) {
                        self.fail_authentication(id, now);
                        self.route();
                        return (buf.len(), Stop::Fatal);
                    }
                    self.core.handle_invalid(id, error);
                }
                Decoded::Fatal(error) => {
                    debug!("connection {id}: {}", error.code);
                    self.core.handle_invalid(id, error);
                    self.route();
                    return (buf.len(), Stop::Fatal);
                }
            }
            self.route();
            charge = Some((output_before, work_before));
        }
    }

    /// Whether `id` has authenticated (with `--auth`).
    fn is_authenticated(&self, id: ConnId) -> bool {
        self.identities
            .get(id as usize)
            .is_some_and(|&identity| identity != UNAUTHENTICATED)
    }

    /// Evaluates a well-framed request of `id` on a server with `--auth`
    /// (spec §12.2, §12.3). Its fields were checked by the decoder, so what
    /// is left in the order of checks (spec §6) is the session, then the
    /// scopes, then the key. Returns `false` when the connection must
    /// close: it has not authenticated, and this is not a `U` that does.
    #[inline(never)]
    fn evaluate_authenticated(&mut self, id: ConnId, request: &Request<'_>, now: Micros) -> bool {
        let Some(access) = self.access.as_ref() else {
            self.core.handle_request(id, request, now);
            return true;
        };
        let Some(session) = self.identities.get_mut(id as usize) else {
            return true;
        };
        let Some(identity) = access.identity(*session) else {
            let authenticated = match *request {
                Request::Authenticate { secret } => access.authenticate(secret),
                _ => None,
            };
            let Some(index) = authenticated else {
                self.fail_authentication(id, now);
                return false;
            };
            let max = access
                .identity(index)
                .and_then(|identity| identity.quota.max_connections);
            if self.sessions.len() <= index as usize {
                self.sessions.resize(index as usize + 1, 0);
            }
            let open = &mut self.sessions[index as usize];
            if max.is_some_and(|max| *open >= max) {
                // One session more than its `max-connections`: refused as
                // at the connection limit, and closed (spec §12.1).
                self.core.send_error(id, ErrorCode::ConnectionLimit, 0);
                return false;
            }
            *open += 1;
            *session = index;
            self.core.set_adopter(id, super::Adopter::Identity(index));
            self.unauthenticated_peers.remove(&id);
            let name = access.identity(index).map(|identity| &*identity.name);
            self.core.send_authenticated(id, name.unwrap_or_default());
            return true;
        };
        if matches!(request, Request::Authenticate { .. }) {
            // A session authenticates once; nothing changes.
            self.core.send_error(id, ErrorCode::NotPermitted, 0);
        } else if !identity.scopes.permit(request) {
            self.core
                .send_error(id, ErrorCode::NotPermitted, request.error_id());
        } else {
            self.core
                .handle_request_as(id, request, *session, identity, now);
        }
        true
    }

    /// `id` closes: its identity, if it authenticated, has one session less.
    fn end_session(&mut self, id: ConnId) {
        let Some(session) = self.identities.get_mut(id as usize) else {
            return;
        };
        let index = std::mem::replace(session, UNAUTHENTICATED);
        if let Some(open) = self.sessions.get_mut(index as usize) {
            *open -= 1;
        }
    }

    /// `id` sent something other than a good `U` first, or nothing in
    /// time: `X 12`, counted, and logged with the peer (never the secret)
    /// at most once per peer per [`AUTH_FAILURE_LOG_EVERY_US`]; the caller
    /// closes it.
    fn fail_authentication(&mut self, id: ConnId, now: Micros) {
        self.core.send_error(id, ErrorCode::NotAuthenticated, 0);
        self.core.stats_mut().auth_failures += 1;
        let peer = self.unauthenticated_peers.remove(&id).flatten();
        for line in self.auth_failure_log.record(peer, now) {
            warn!("{line}");
        }
    }

    /// Evaluates the input `id` carries (after new bytes were appended, or
    /// on resuming from backpressure).
    fn evaluate_input(&mut self, id: ConnId, now: Micros) -> (bool, Stop) {
        let Some(conn) = self.conn_mut(id) else {
            return (false, Stop::Incomplete);
        };
        let input = std::mem::take(&mut conn.input);
        let (consumed, stop) = self.evaluate(id, &input, now);
        let conn = self.conn_mut(id).expect("evaluation keeps the connection");
        conn.input = input;
        if stop == Stop::Fatal {
            conn.input = Vec::new();
        } else {
            conn.consume(consumed);
        }
        (consumed > 0, stop)
    }

    fn after_evaluation(&mut self, id: ConnId, progress: bool, stop: Stop, now: Micros) {
        match stop {
            Stop::Fatal => self.begin_close(id, false, now),
            Stop::Yield => self.yield_turn(id),
            Stop::OutputFull => {
                if let Some(conn) = self.conn_mut(id) {
                    conn.phase = Phase::Backpressured;
                }
                self.cancel(id);
            }
            Stop::Incomplete => {
                let Some(conn) = self.connection(id) else {
                    return;
                };
                if conn.input.is_empty() {
                    // The usual case has no timer to cancel: test that
                    // first, before what the accept's deadline needs.
                    if conn.timer.is_armed() && !self.keeps_accept_deadline(id) {
                        self.cancel(id);
                    }
                } else if self.keeps_accept_deadline(id) {
                    // The deadline from the accept covers the frame.
                } else if progress || !conn.timer.is_armed() {
                    // A new frame was left incomplete: its clock starts
                    // now. A frame that only grew keeps its deadline, so a
                    // byte at a time cannot hold a connection forever.
                    self.arm(id, now + PARTIAL_FRAME_TIMEOUT_US, now);
                }
            }
        }
    }

    /// Output fell below the low-water mark: evaluate what was held back,
    /// then let the shell read again.
    fn resume(&mut self, id: ConnId, now: Micros) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        conn.phase = Phase::Open;
        let (progress, stop) = self.evaluate_input(id, now);
        self.after_evaluation(id, progress, stop, now);
        if self.connection(id).map(Connection::phase) == Some(Phase::Open) {
            self.actions.push_back((id, Action::Read));
        }
    }

    /// Everything queued for `id` is sent.
    fn output_drained(&mut self, id: ConnId, now: Micros) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        match conn.phase {
            Phase::Open | Phase::Lingering | Phase::Yielded => {}
            Phase::Backpressured => self.resume(id, now),
            Phase::Flushing { peer_closed: true } => self.close(id, now),
            Phase::Flushing { peer_closed: false } => {
                #[cfg(feature = "tls")]
                if conn.tls.as_mut().is_some_and(|tls| tls.close_notify()) {
                    // Our end of the TLS session ends before the socket's.
                    return self.queue_transmit(id);
                }
                conn.phase = Phase::Lingering;
                self.actions.push_back((id, Action::ShutWrite));
            }
        }
    }

    /// Stops reading requests from `id`: the core forgets it (its waiters
    /// leave their queues), what is queued is flushed, then the write side
    /// is shut and input discarded until the peer closes or the linger
    /// deadline passes.
    fn begin_close(&mut self, id: ConnId, peer_closed: bool, now: Micros) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        if !conn.phase.is_live() {
            return;
        }
        conn.phase = Phase::Flushing { peer_closed };
        conn.input = Vec::new();
        #[cfg(feature = "tls")]
        if conn.tls.as_ref().is_some_and(|tls| !tls.can_send()) {
            // Mid-handshake or failed: no answer can reach the peer.
            conn.output = Vec::new();
        }
        let drained = conn.nothing_to_send();
        // Waiters behind this connection's on a key with a limit may be
        // granted now (spec §10.4): their answers go out like any other.
        self.core.disconnect(id, now);
        self.route();
        self.arm(id, now + LINGER_US, now);
        if drained {
            self.output_drained(id, now);
        }
    }

    /// Forgets `id` at once and tells the shell to close its socket.
    fn close(&mut self, id: ConnId, now: Micros) {
        if self.connection(id).is_none() {
            return;
        }
        self.cancel(id);
        let conn = self.conns[id as usize].take().expect("checked above");
        self.count -= 1;
        if self.access.is_some() {
            self.unauthenticated_peers.remove(&id);
            self.end_session(id);
        }
        if let Some(ip) = conn.peer {
            if let Some(held) = self.peer_connections.get_mut(&ip) {
                *held -= 1;
                if *held == 0 {
                    self.peer_connections.remove(&ip);
                }
            }
        }
        if conn.phase.is_live() {
            self.core.disconnect(id, now);
            self.route();
        }
        if conn.refused {
            self.refused_lingering -= 1;
        }
        debug!("connection {id} closed");
        self.actions.push_back((id, Action::Close));
    }

    /// Arms `id`'s one deadline.
    fn arm(&mut self, id: ConnId, deadline: Micros, now: Micros) {
        let mut timers = ConnTimers(&mut self.conns);
        if self.timers.is_empty() {
            // With nothing armed the wheel may stand far behind `now` (no
            // one had to call `handle_timeout`); bring it up to date first,
            // since it keeps deadlines relative to its position.
            let fired = self.timers.poll(&mut timers, tick_reached(now));
            debug_assert!(fired.is_none());
        }
        self.timers
            .arm(&mut timers, id as TimerId, tick_at_or_after(deadline));
    }

    fn cancel(&mut self, id: ConnId) {
        if self
            .connection(id)
            .is_some_and(|conn| conn.timer.is_armed())
        {
            self.timers
                .cancel(&mut ConnTimers(&mut self.conns), id as TimerId);
        }
    }

    /// Encodes the core's queued answers into their connections' output.
    fn route(&mut self) {
        for (id, response) in self.core.drain_outbox() {
            let Some(conn) = self.conns.get_mut(id as usize).and_then(Option::as_mut) else {
                continue;
            };
            if conn.output.capacity() == 0 {
                conn.output = self.spare_outputs.pop().unwrap_or_default();
            }
            protocol::encode_response(&response, &mut conn.output);
            if !conn.transmit_queued {
                conn.transmit_queued = true;
                self.transmit_queue.push(id);
            }
        }
    }

    /// Puts `id` in the list of connections with something to send.
    fn queue_transmit(&mut self, id: ConnId) {
        if let Some(conn) = self.conn_mut(id) {
            if !conn.transmit_queued {
                conn.transmit_queued = true;
                self.transmit_queue.push(id);
            }
        }
    }
}

/// Frames decoded and prefetched at a time: enough to overlap the misses
/// of a pipelined burst, few enough that the lines are still in cache when
/// their frames are evaluated.
const PREFETCH_FRAMES: usize = 32;

/// Decodes up to [`PREFETCH_FRAMES`] whole frames from the start of
/// `input`, asking the core to prefetch what each valid request will read,
/// and returns the bytes they take (at least 1). Changes no state: the
/// frames are decoded again when evaluated, which is cheap next to the
/// cache misses this overlaps (and done only for a large table).
fn prefetch_ahead(core: &Core, input: &[u8]) -> usize {
    let mut at = 0;
    for _ in 0..PREFETCH_FRAMES {
        match protocol::decode_request(input.get(at..).unwrap_or_default()) {
            Decoded::Request { request, len } => {
                core.prefetch(&request);
                at += len;
            }
            Decoded::Invalid { len, .. } => at += len,
            Decoded::Incomplete | Decoded::Fatal(_) => break,
        }
    }
    at.max(1)
}
