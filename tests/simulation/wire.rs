//! Peers that speak bytes to the sans-IO [`Endpoint`] the way the shell
//! drives it: requests of every kind (watches, `O` of spec §13, among
//! them), reads split at random points, half-closes, resets with unread
//! output, readers that stall, refusals at accept, floods that hit
//! backpressure, frames left incomplete, a graceful shutdown. Checked
//! after every step: the endpoint's and the core's invariants (bounded
//! buffers among them), every answer correlates to exactly one request,
//! and nothing is queued for a connection once it stopped being live.
//! At the end every request on a live connection has been answered.

use std::collections::{BTreeMap, BTreeSet};

use kunci::addr::Network;
use kunci::core::connection::{Phase, READ_CHUNK};
use kunci::core::endpoint::{Action, Endpoint};
use kunci::core::{ConnId, Core, Limits, Micros};
use kunci::protocol::{self, Correlation, ErrorCode, Request, Response};

use super::{Rng, Simulation, Tally, env_u64, run_seeds};
use crate::util::fake::{FIRST_TOKEN, MS, S};
use crate::util::plain_acquire;

/// What the kernel holds for a peer before its reads (the send
/// buffer): a write beyond it would block.
const SOCKET_BUFFER_MAX: usize = 96 * 1024;

struct Peer {
    /// Bytes written by the peer that the server has not read.
    unread: Vec<u8>,
    /// The peer shut its write side after `unread`.
    fin_sent: bool,
    /// The server has read that end-of-file.
    fin_read: bool,
    /// Bytes the server wrote that the peer has not read yet.
    in_flight: Vec<u8>,
    /// How much the peer's socket buffers before writes block.
    buffer_max: usize,
    /// Read, not yet decoded.
    received: Vec<u8>,
    /// Not reading: `in_flight` fills up and the server's writes block.
    stalled: bool,
    /// The last write would have blocked: write readiness is due once
    /// the peer reads.
    write_blocked: bool,
    /// Sent and not yet answered, in order.
    pending: Vec<Correlation>,
    /// Refused at accept: its first frame must be this `X`.
    refused: Option<ErrorCode>,
    /// Bytes the endpoint may still send since the connection stopped
    /// being live (what was queued then); `None` while live.
    allowance: Option<usize>,
    frames: u64,
    /// The server closed the socket.
    closed: bool,
    /// The peer reset the connection: it reads nothing more.
    reset: bool,
    /// The peer broke framing or left a frame incomplete: it writes
    /// nothing more.
    mute: bool,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Counts {
    pub steps: u64,
    pub reads: u64,
    pub bytes_read: u64,
    pub answers: u64,
    pub half_closes: u64,
    pub resets: u64,
    pub stalls: u64,
    pub refusals: u64,
    pub backpressured: u64,
    pub partial_frame_timeouts: u64,
    pub fatal: u64,
    pub shutdowns: u64,
    /// `V` frames: watches (`O`, spec §13) answered at once or later.
    pub watch_answers: u64,
}

impl Tally for Counts {
    fn add(&mut self, other: &Counts) {
        self.steps += other.steps;
        self.reads += other.reads;
        self.bytes_read += other.bytes_read;
        self.answers += other.answers;
        self.half_closes += other.half_closes;
        self.resets += other.resets;
        self.stalls += other.stalls;
        self.refusals += other.refusals;
        self.backpressured += other.backpressured;
        self.partial_frame_timeouts += other.partial_frame_timeouts;
        self.fatal += other.fatal;
        self.shutdowns += other.shutdowns;
        self.watch_answers += other.watch_answers;
    }
}

pub struct WireSim {
    rng: Rng,
    endpoint: Endpoint,
    now: Micros,
    peers: BTreeMap<ConnId, Peer>,
    free_ids: BTreeSet<ConnId>,
    next_id: ConnId,
    /// Sockets to read again before waiting (`Action::Read`).
    ready: Vec<ConnId>,
    keys: Vec<String>,
    next_owner: u64,
    tokens: Vec<(String, u64)>,
    allow: bool,
    shut_down: bool,
    pub counts: Counts,
    pub step: usize,
}

impl Simulation for WireSim {
    type Counts = Counts;
    const NAME: &'static str = "wire simulation";

    fn new(seed: u64) -> WireSim {
        let mut rng = Rng::new(seed ^ 0x77_1e5);
        let limits = Limits {
            max_connections: rng.range(1, 12) as usize,
            max_waits_per_conn: rng.range(1, 50) as u32,
            ..Limits::default()
        };
        let allow = rng.chance(30);
        let networks: Vec<Network> = if allow {
            vec!["10.0.0.0/8".parse().unwrap()]
        } else {
            Vec::new()
        };
        let keys = (0..rng.range(1, 5)).map(|i| format!("k{i}")).collect();
        WireSim {
            rng,
            endpoint: Endpoint::new(Core::new(limits, FIRST_TOKEN), networks),
            now: 0,
            peers: BTreeMap::new(),
            free_ids: BTreeSet::new(),
            next_id: 0,
            ready: Vec::new(),
            keys,
            next_owner: 0,
            tokens: Vec::new(),
            allow,
            shut_down: false,
            counts: Counts::default(),
            step: 0,
        }
    }

    fn run(&mut self, steps: usize) -> Result<(), String> {
        for step in 0..steps {
            self.step = step;
            self.counts.steps += 1;
            self.one_step()?;
            self.shell_turn()?;
            self.check()?;
        }
        self.finish()
    }

    fn position(&self) -> String {
        format!("step {}", self.step)
    }

    fn counts(&self) -> Counts {
        self.counts
    }

    fn rerun(seed: u64) -> String {
        format!("re-run with KUNCI_SIM_SEED={seed} cargo test --release simulation_of_the_wire")
    }
}

impl WireSim {
    fn one_step(&mut self) -> Result<(), String> {
        let ids: Vec<ConnId> = self.live_peers();
        let pick = |rng: &mut Rng| -> Option<ConnId> { (!ids.is_empty()).then(|| *rng.pick(&ids)) };
        match self.rng.below(100) {
            0..=7 => self.connect(),
            8..=37 => {
                if let Some(id) = pick(&mut self.rng) {
                    self.write_requests(id);
                }
            }
            38..=62 => {
                if let Some(id) = pick(&mut self.rng) {
                    self.deliver(id);
                }
            }
            63..=72 => {
                if let Some(id) = pick(&mut self.rng) {
                    self.peer_reads(id)?;
                }
            }
            73..=76 => {
                if let Some(id) = pick(&mut self.rng) {
                    let peer = self.peers.get_mut(&id).unwrap();
                    peer.stalled = !peer.stalled;
                    self.counts.stalls += u64::from(peer.stalled);
                    if !peer.stalled {
                        self.peer_reads(id)?;
                    }
                }
            }
            77..=79 => {
                if let Some(id) = pick(&mut self.rng) {
                    let peer = self.peers.get_mut(&id).unwrap();
                    if !peer.fin_sent {
                        peer.fin_sent = true;
                        self.counts.half_closes += 1;
                    }
                }
            }
            80..=81 => {
                if let Some(id) = pick(&mut self.rng) {
                    // The peer vanished with output unread: the next
                    // read or write fails.
                    self.counts.resets += 1;
                    let peer = self.peers.get_mut(&id).unwrap();
                    peer.pending.clear();
                    peer.in_flight.clear();
                    peer.received.clear();
                    peer.reset = true;
                    self.endpoint.handle_broken(id, self.now);
                }
            }
            82..=83 => {
                if let Some(id) = pick(&mut self.rng) {
                    self.flood(id);
                }
            }
            84 => {
                if let Some(id) = pick(&mut self.rng) {
                    // Half a frame, or garbage that breaks framing.
                    // Either way the peer sends nothing more.
                    let peer = self.peers.get_mut(&id).unwrap();
                    if peer.mute || peer.fin_sent {
                    } else if self.rng.chance(50) {
                        peer.unread.extend_from_slice(b"A\x05");
                    } else {
                        peer.unread.extend_from_slice(b"GET / HTTP/1.1\r\n");
                    }
                    peer.mute = true;
                }
            }
            85 if self.step > 100 && self.rng.chance(3) && !self.shut_down => {
                self.shut_down = true;
                self.counts.shutdowns += 1;
                self.endpoint.shut_down(self.now);
            }
            _ => self.advance(),
        }
        Ok(())
    }

    fn is_open(&self, id: ConnId) -> bool {
        self.peers.get(&id).is_some_and(|peer| !peer.closed)
    }

    fn live_peers(&self) -> Vec<ConnId> {
        let mut ids: Vec<ConnId> = self
            .peers
            .iter()
            .filter(|(_, peer)| !peer.closed)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    fn connect(&mut self) {
        if self.shut_down {
            return;
        }
        let id = match self.free_ids.pop_first() {
            Some(id) => id,
            None => {
                self.next_id += 1;
                self.next_id - 1
            }
        };
        let outsider = self.allow && self.rng.chance(30);
        let ip = if self.rng.chance(10) {
            None
        } else if outsider {
            Some("192.0.2.1".parse().unwrap())
        } else {
            Some("10.1.2.3".parse().unwrap())
        };
        let at_limit =
            self.endpoint.core().connections() >= self.endpoint.core().limits().max_connections;
        let refused = if outsider && ip.is_some() {
            Some(ErrorCode::NotAllowed)
        } else if at_limit {
            Some(ErrorCode::ConnectionLimit)
        } else {
            None
        };
        self.counts.refusals += u64::from(refused.is_some());
        let buffer_max = if self.rng.chance(20) {
            self.rng.range(1, 64) as usize
        } else {
            self.rng.range(1_000, SOCKET_BUFFER_MAX as u64) as usize
        };
        self.peers.insert(
            id,
            Peer {
                unread: Vec::new(),
                fin_sent: false,
                fin_read: false,
                in_flight: Vec::new(),
                buffer_max,
                received: Vec::new(),
                stalled: false,
                write_blocked: false,
                pending: Vec::new(),
                refused,
                allowance: None,
                frames: 0,
                closed: false,
                reset: false,
                mute: false,
            },
        );
        self.endpoint.accept(id, ip, self.now);
    }

    fn key(&mut self) -> String {
        self.rng.pick(&self.keys).clone()
    }

    /// One to five requests, mostly valid, some invalid (non-fatal).
    fn write_requests(&mut self, id: ConnId) {
        if self.peers[&id].fin_sent || self.peers[&id].mute {
            return;
        }
        for _ in 0..self.rng.range(1, 5) {
            let key = self.key();
            self.next_owner += 1;
            let owner = self.next_owner;
            let token = match self.tokens.len() {
                0 => 1,
                n => self.tokens[self.rng.below(n as u64) as usize].1,
            };
            let request = match self.rng.below(11) {
                0..=3 => {
                    let wait_s = self.rng.range(0, 3) as u8;
                    let lease_s = self.rng.range(1, 3) as u8;
                    plain_acquire(wait_s, lease_s, owner, &key)
                }
                4 => Request::Release { token, key: &key },
                5 => Request::Extend {
                    lease_s: 2,
                    token,
                    key: &key,
                },
                6 => Request::Query { key: &key },
                7 => Request::Ping { nonce: owner },
                8 => Request::Info,
                9 => {
                    // A watch (spec §13): answered at once when the key's
                    // token is not `since`, else held until it changes,
                    // the wait ends or the server stops.
                    let since = match self.rng.below(3) {
                        0 => 0,
                        _ => token,
                    };
                    Request::Observe {
                        wait_s: self.rng.range(0, 3) as u8,
                        id: owner,
                        since,
                        key: &key,
                    }
                }
                // Lease 0: `X 5` carrying the owner, not fatal.
                _ => plain_acquire(0, 0, owner, &key),
            };
            let mut bytes = Vec::new();
            protocol::encode_request(&request, &mut bytes);
            let correlation = request.correlation();
            let peer = self.peers.get_mut(&id).unwrap();
            peer.unread.extend_from_slice(&bytes);
            peer.pending.push(correlation);
        }
    }

    /// Many small requests at once, so that output passes the
    /// high-water mark when the peer does not read.
    fn flood(&mut self, id: ConnId) {
        let peer = self.peers.get_mut(&id).unwrap();
        if peer.fin_sent || peer.mute {
            return;
        }
        let count = self.rng.range(100, 400);
        for _ in 0..count {
            peer.unread.extend_from_slice(b"I\n");
            peer.pending.push(Correlation::Info);
        }
    }

    /// The shell reads once: a random prefix of what is waiting, or the
    /// end-of-file once everything before it was read.
    fn deliver(&mut self, id: ConnId) {
        if !self.endpoint.wants_read(id) {
            return;
        }
        let peer = self.peers.get_mut(&id).unwrap();
        if peer.unread.is_empty() {
            if peer.fin_sent && !peer.fin_read {
                peer.fin_read = true;
                self.endpoint.handle_eof(id, self.now);
            }
            return;
        }
        let most = peer.unread.len().min(READ_CHUNK);
        let n = if self.rng.chance(50) {
            most
        } else {
            self.rng.range(1, most as u64) as usize
        };
        let chunk: Vec<u8> = peer.unread.drain(..n).collect();
        self.counts.reads += 1;
        self.counts.bytes_read += n as u64;
        self.endpoint.handle_read(id, &chunk, self.now);
    }

    /// The peer reads what arrived and checks each answer.
    fn peer_reads(&mut self, id: ConnId) -> Result<(), String> {
        let peer = self.peers.get_mut(&id).unwrap();
        if peer.stalled {
            return Ok(());
        }
        let arrived = std::mem::take(&mut peer.in_flight);
        peer.received.extend_from_slice(&arrived);
        let mut at = 0;
        loop {
            match protocol::decode_response(&peer.received[at..]) {
                Ok(None) => break,
                Ok(Some((response, len))) => {
                    at += len;
                    peer.frames += 1;
                    self.counts.answers += 1;
                    if matches!(response, Response::KeyState { .. }) {
                        self.counts.watch_answers += 1;
                    }
                    Self::correlate(id, peer, &response, &mut self.tokens)?;
                }
                Err(e) => return Err(format!("connection {id}: undecodable answer: {e}")),
            }
        }
        peer.received.drain(..at);
        if peer.write_blocked {
            // Write readiness: the shell writes what is left.
            peer.write_blocked = false;
            self.flush(id);
        }
        Ok(())
    }

    fn correlate(
        id: ConnId,
        peer: &mut Peer,
        response: &Response,
        tokens: &mut Vec<(String, u64)>,
    ) -> Result<(), String> {
        if let Some(code) = peer.refused {
            let expected = code.response(0);
            if peer.frames != 1 || *response != expected {
                return Err(format!(
                    "refused connection {id}: frame {} is {response:?}, expected only {expected:?}",
                    peer.frames
                ));
            }
            peer.pending.clear();
            return Ok(());
        }
        if let Response::Error { code, .. } = *response {
            if ErrorCode::from_u8(code).is_some_and(ErrorCode::is_fatal) {
                // Framing lost, or shutdown: nothing more is answered.
                peer.pending.clear();
                return Ok(());
            }
        }
        let Some(position) = peer
            .pending
            .iter()
            .position(|sent| sent.is_answered_by(response))
        else {
            return Err(format!(
                "connection {id}: {response:?} answers nothing pending ({:?})",
                peer.pending
            ));
        };
        peer.pending.remove(position);
        if let Response::Acquired { token, .. } = *response {
            tokens.push((String::new(), token));
        }
        Ok(())
    }

    fn advance(&mut self) {
        let next = self.endpoint.poll_timeout();
        let jump = if self.rng.chance(70) {
            self.rng.range(0, 50) * MS
        } else {
            self.rng.range(0, 3) * S
        };
        let target = match next {
            Some(next) if next <= self.now + jump => next.max(self.now),
            _ => self.now + jump,
        };
        self.now = target;
        self.endpoint.handle_timeout(self.now);
    }

    /// What the shell does before it sleeps: read the sockets it was
    /// told to, write every queued output, carry out the actions.
    fn shell_turn(&mut self) -> Result<(), String> {
        // A turn of the loop: connections that spent their share of
        // the last one go on (spec §4, fairness).
        self.endpoint.begin_turn(self.now);
        for id in std::mem::take(&mut self.ready) {
            if self.peers.get(&id).is_some_and(|peer| !peer.closed) {
                self.deliver(id);
            }
        }
        while let Some(id) = self.endpoint.next_transmit() {
            self.flush(id);
        }
        while let Some((id, action)) = self.endpoint.poll_action() {
            let Some(peer) = self.peers.get_mut(&id) else {
                return Err(format!("action {action:?} for unknown connection {id}"));
            };
            match action {
                Action::ShutWrite => {}
                Action::Read => self.ready.push(id),
                Action::Close => {
                    if peer.closed {
                        return Err(format!("connection {id} closed twice"));
                    }
                    if !peer.stalled && !peer.reset {
                        // What was written still arrives before the
                        // end-of-file.
                        self.peer_reads(id)?;
                    }
                    let peer = self.peers.get_mut(&id).unwrap();
                    peer.closed = true;
                    if peer.refused.is_none() && peer.allowance.is_none() && !peer.reset {
                        // Closed while live: a deadline (partial frame).
                        self.counts.partial_frame_timeouts += 1;
                    }
                    self.free_ids.insert(id);
                }
            }
        }
        // A closed id may be reused only once its peer is gone.
        let closed: Vec<ConnId> = self
            .peers
            .iter()
            .filter(|(_, peer)| peer.closed)
            .map(|(&id, _)| id)
            .collect();
        for id in closed {
            if self.rng.chance(50) {
                self.peers.remove(&id);
            } else {
                self.free_ids.remove(&id);
            }
        }
        Ok(())
    }

    /// Writes `id`'s output while its socket buffer has room.
    fn flush(&mut self, id: ConnId) {
        loop {
            let Some(bytes) = self.endpoint.transmit(id) else {
                return;
            };
            let peer = self.peers.get_mut(&id).unwrap();
            let room = peer.buffer_max.saturating_sub(peer.in_flight.len());
            if room == 0 {
                peer.write_blocked = true;
                return;
            }
            let n = bytes
                .len()
                .min(room)
                .min(self.rng.range(1, 70_000) as usize);
            peer.in_flight.extend_from_slice(&bytes[..n]);
            if let Some(allowance) = peer.allowance.as_mut() {
                *allowance = allowance.saturating_sub(n);
            }
            self.endpoint.handle_written(id, n, self.now);
        }
    }

    fn check(&mut self) -> Result<(), String> {
        self.endpoint.check_invariants();
        for (&id, peer) in self.peers.iter_mut() {
            if peer.closed {
                continue;
            }
            let Some(conn) = self.endpoint.connection(id) else {
                return Err(format!("connection {id} gone without Action::Close"));
            };
            if conn.phase() == Phase::Backpressured {
                self.counts.backpressured += 1;
            }
            match (conn.phase().is_live(), peer.allowance) {
                (true, _) => {}
                (false, None) => {
                    peer.allowance = Some(conn.output_len());
                    if peer.refused.is_none() && !peer.fin_read {
                        self.counts.fatal += 1;
                    }
                }
                (false, Some(allowance)) => {
                    if conn.output_len() > allowance {
                        return Err(format!(
                            "connection {id}: {} bytes queued after it stopped being live, {allowance} allowed",
                            conn.output_len()
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Everyone reads and stops stalling, time runs until every wait
    /// and lease is over: each request on a live connection has its
    /// answer.
    fn finish(&mut self) -> Result<(), String> {
        for round in 0..100_000 {
            let ids = self.live_peers();
            for &id in &ids {
                if !self.is_open(id) {
                    continue;
                }
                self.peers.get_mut(&id).unwrap().stalled = false;
                while self.is_open(id)
                    && self.endpoint.wants_read(id)
                    && !self.peers[&id].unread.is_empty()
                {
                    self.deliver(id);
                    self.shell_turn()?;
                }
                if self.is_open(id) {
                    self.peer_reads(id)?;
                }
            }
            self.shell_turn()?;
            for &id in &ids {
                // A peer with a socket buffer of a few bytes takes that
                // much per read, and a flood of `I` held back by
                // backpressure may answer with megabytes: it reads
                // until the server has nothing more for it.
                let mut reads = 0;
                while self.is_open(id) && reads < 50_000_000 {
                    self.peer_reads(id)?;
                    reads += 1;
                    if self.endpoint.transmit(id).is_none() {
                        break;
                    }
                }
            }
            self.shell_turn()?;
            self.check()?;
            let quiet = ids.iter().all(|&id| {
                let Some(peer) = self.peers.get(&id).filter(|peer| !peer.closed) else {
                    return true;
                };
                peer.unread.is_empty()
                    && peer.in_flight.is_empty()
                    && self.endpoint.transmit(id).is_none()
                    && self.endpoint.wants_read(id)
            });
            let next = self.endpoint.poll_timeout();
            let over = self.endpoint.is_shut_down(self.now);
            if quiet && (over || next.is_none_or(|next| next > self.now + 600 * S)) {
                break;
            }
            if let Some(next) = next {
                // After a shutdown its deadline stays the earliest;
                // step past it.
                let floor = if over { self.now + MS } else { self.now };
                self.now = next.max(floor);
                self.endpoint.handle_timeout(self.now);
            }
            if round == 99_999 {
                let stuck: Vec<String> = ids
                    .iter()
                    .filter(|&&id| self.is_open(id))
                    .map(|&id| {
                        let peer = &self.peers[&id];
                        format!(
                            "{id}: unread {} in flight {} phase {:?} output {:?}",
                            peer.unread.len(),
                            peer.in_flight.len(),
                            self.endpoint.connection(id).map(|c| c.phase()),
                            self.endpoint.connection(id).map(|c| c.output_len())
                        )
                    })
                    .collect();
                return Err(format!("the end does not settle: {stuck:?}"));
            }
        }
        for (&id, peer) in &self.peers {
            let live = self
                .endpoint
                .connection(id)
                .is_some_and(|conn| conn.phase().is_live());
            if live && !peer.pending.is_empty() {
                return Err(format!(
                    "connection {id} is open with requests unanswered: {:?}",
                    peer.pending
                ));
            }
        }
        Ok(())
    }
}

#[test]
fn simulation_of_the_wire_bytes_split_half_closed_stalled_and_reset() {
    let default_seeds = if cfg!(debug_assertions) { 200 } else { 1_000 };
    let (counts, seeds) = run_seeds::<WireSim>("KUNCI_SIM_SEED", "KUNCI_SIM_SEEDS", default_seeds);
    if seeds >= 50 {
        let reached = [
            counts.half_closes,
            counts.resets,
            counts.stalls,
            counts.refusals,
            counts.backpressured,
            counts.partial_frame_timeouts,
            counts.fatal,
            counts.shutdowns,
            counts.watch_answers,
        ];
        assert!(reached.iter().all(|&n| n > 0), "{counts:?}");
    }
}

/// The `endpoint_streams` fuzz target's script on seeded random inputs, so
/// its checks run on every `cargo test` (fuzzing needs nightly).
#[test]
fn endpoint_scripts_from_random_bytes() {
    let runs = if cfg!(debug_assertions) {
        2_000
    } else {
        20_000
    };
    let runs = env_u64("KUNCI_SCRIPT_RUNS").unwrap_or(runs);
    let mut rng = Rng::new(0x5c_1217);
    let mut data = Vec::new();
    for _ in 0..runs {
        data.clear();
        let len = rng.range(0, 2_000);
        // Mostly command-shaped bytes, so that scripts get far.
        for _ in 0..len {
            data.push(rng.next() as u8);
        }
        kunci::core::script::run(&data);
    }
}
