//! Workloads where one event sets off much work on the server (spec §4,
//! v5): `watches N` (one grant or release wakes N watches) and `handover N`
//! (a few releases hand shared keys to N waiters). Beside them an innocent
//! client pings on a connection and a thread of its own (`Pinger` in the
//! bench's `mod.rs`): its latency shows whether the event stalled everyone
//! else.

use std::time::Instant;

use super::fleet::{Pending, Wire};
use super::stats::{Kind, Stats};
use crate::protocol::{Response, SHARED_LIMIT};

/// Tags: what each request is for.
const BARRIER: u32 = 1;
const CHANGER: u32 = 2;
const WATCHER: u32 = 3;
const WRITER: u32 = 4;
const READER: u32 = 5;

/// Watches or waits per connection: under the server's default of 4,096
/// (`--max-watches-per-conn`, `--max-waits-per-conn`).
pub const PER_CONN: u64 = 4000;
/// Waiters per key: the server's default `--max-waiters-per-key`.
pub const WAITERS_PER_KEY: u64 = 16_384;
/// The label of the watched key's grant: the largest (spec §11.1), so that
/// every answer a grant wakes carries it.
const LABEL_LEN: usize = 128;

/// Connections a workload of `n` watches or waits spread over: `n / 4000`
/// rounded up, plus connection 0 (the one that changes the keys).
pub fn connections(n: u64) -> usize {
    1 + n.div_ceil(PER_CONN) as usize
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WatchPhase {
    /// The watches are sent, then a ping on each watcher connection: once
    /// every ping is answered, every watch before it is held.
    Arming,
    /// The grant or release is sent; its answer and every watch's are due.
    Firing,
    /// Stopped: the last grant released.
    Done,
}

/// `watches N`: connections 1..=W hold N watches (`O`) of one key; then
/// connection 0 takes the key with a 128-byte label (or releases it), which
/// wakes every watch; once all are answered they are armed again with the
/// new token, and the key changes again. Reports `wake` (each watch's
/// answer, from the event's send) and `wake_all` (the last one).
pub struct Watches {
    watches: u64,
    watchers: usize,
    lease_s: u8,
    wait_s: u8,
    label: String,
    phase: WatchPhase,
    /// The key's current token as connection 0 last saw it (0: free).
    token: u64,
    barriers_left: usize,
    woken_left: u64,
    event_answered: bool,
    fired_at: Instant,
    windows: Vec<(Instant, Instant)>,
    stopping: bool,
}

const WATCHED_KEY: u64 = 0;

impl Watches {
    pub fn new(watches: u64, connections: usize, lease_s: u8, wait_s: u8) -> Watches {
        Watches {
            watches,
            watchers: connections - 1,
            lease_s,
            wait_s,
            label: "l".repeat(LABEL_LEN),
            phase: WatchPhase::Arming,
            token: 0,
            barriers_left: 0,
            woken_left: 0,
            event_answered: false,
            fired_at: Instant::now(),
            windows: Vec::new(),
            stopping: false,
        }
    }

    fn arm(&mut self, wire: &mut Wire) {
        self.phase = WatchPhase::Arming;
        for i in 0..self.watches {
            let conn = 1 + (i % self.watchers as u64) as usize;
            wire.observe(conn, WATCHED_KEY, self.token, self.wait_s, WATCHER);
        }
        for conn in 1..=self.watchers {
            wire.ping(conn, BARRIER);
        }
        self.barriers_left = self.watchers;
    }

    fn fire(&mut self, wire: &mut Wire) {
        self.phase = WatchPhase::Firing;
        self.fired_at = wire.now;
        self.woken_left = self.watches;
        self.event_answered = false;
        if self.token == 0 {
            let times = (0, self.lease_s);
            wire.acquire_labelled(0, WATCHED_KEY, times, &self.label, CHANGER);
        } else {
            wire.release(0, self.token, WATCHED_KEY, CHANGER);
        }
    }

    fn check_done(&mut self, wire: &mut Wire, stats: &mut Stats) {
        if !self.event_answered || self.woken_left > 0 {
            return;
        }
        stats.sample(
            "wake_all",
            wire.now.saturating_duration_since(self.fired_at),
        );
        self.windows.push((self.fired_at, wire.now));
        stats.count("events", 1);
        stats.count("wakes", self.watches);
        if !self.stopping {
            return self.arm(wire);
        }
        self.phase = WatchPhase::Done;
        if self.token != 0 {
            wire.release(0, self.token, WATCHED_KEY, CHANGER);
        }
    }
}

impl super::fleet::Workload for Watches {
    fn start(&mut self, wire: &mut Wire, stats: &mut Stats) {
        for counter in ["events", "wakes"] {
            stats.set(counter, 0);
        }
        self.arm(wire);
    }

    fn reply(
        &mut self,
        _conn: usize,
        sent: Pending,
        reply: &Response,
        wire: &mut Wire,
        stats: &mut Stats,
    ) {
        match (sent.tag, reply) {
            (BARRIER, Response::Pong { .. }) => {
                if self.phase == WatchPhase::Arming {
                    self.barriers_left -= 1;
                    if self.barriers_left == 0 {
                        self.fire(wire);
                    }
                }
            }
            (CHANGER, &Response::Acquired { token, .. }) => {
                self.token = token;
                self.event_answered = true;
                self.check_done(wire, stats);
            }
            (CHANGER, Response::Released { .. }) => {
                self.token = 0;
                self.event_answered = true;
                if self.phase == WatchPhase::Firing {
                    self.check_done(wire, stats);
                }
            }
            (WATCHER, Response::KeyState { .. }) if self.phase == WatchPhase::Firing => {
                stats.sample("wake", wire.now.saturating_duration_since(self.fired_at));
                self.woken_left -= 1;
                self.check_done(wire, stats);
            }
            (WATCHER, Response::KeyState { .. }) => {
                stats.error("a watch was answered before its key changed".into());
            }
            (_, Response::Error { .. }) => {} // counted by the fleet
            (_, other) => stats.error(format!("unexpected answer {other:?} to {sent:?}")),
        }
    }

    fn stop(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        self.stopping = true;
        // The key changes once more, so that every watch held is answered
        // (one not read yet then names an old token: answered at once).
        if self.phase == WatchPhase::Arming {
            self.fire(wire);
        }
    }

    fn progress(&self) -> String {
        format!("{:?}", self.phase).to_lowercase()
    }

    fn windows(&self, now: Instant) -> Vec<(Instant, Instant)> {
        let running = (self.phase == WatchPhase::Firing).then_some((self.fired_at, now));
        self.windows.iter().copied().chain(running).collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HandPhase {
    /// Connection 0 takes every key, exclusive (then: when the readers
    /// have given theirs back).
    Taking,
    /// The readers queue, then a ping on each reader connection.
    Queuing,
    /// Connection 0 released every key; the readers' grants are due.
    Handing,
    /// Stopped: everything released.
    Done,
}

/// `handover N`: connection 0 holds K shared keys exclusively (limit
/// 65535, take 0) and N readers (take 1) queue behind them on
/// connections 1..=W, 16,384 a key; then connection 0 releases the K keys
/// at once, pipelined, and each release hands its key to 16,384 readers.
/// Once all are granted connection 0 asks for the keys again, the readers
/// release, and the round starts over. Reports `handover` (each reader's
/// grant, from the releases' send) and `handover_all` (the last).
pub struct HandOver {
    waiters: u64,
    keys: u64,
    readers: usize,
    lease_s: u8,
    wait_s: u8,
    phase: HandPhase,
    /// Connection 0's token of each key (0: not held).
    writer_tokens: Vec<u64>,
    writer_left: u64,
    /// The readers' grants: (connection, token, key).
    reader_grants: Vec<(usize, u64, u64)>,
    barriers_left: usize,
    granted_left: u64,
    fired_at: Instant,
    windows: Vec<(Instant, Instant)>,
    stopping: bool,
}

impl HandOver {
    pub fn new(waiters: u64, keys: u64, connections: usize, lease_s: u8, wait_s: u8) -> HandOver {
        HandOver {
            waiters,
            keys,
            readers: connections - 1,
            lease_s,
            wait_s,
            phase: HandPhase::Taking,
            writer_tokens: vec![0; keys as usize],
            writer_left: 0,
            reader_grants: Vec::with_capacity(waiters as usize),
            barriers_left: 0,
            granted_left: 0,
            fired_at: Instant::now(),
            windows: Vec::new(),
            stopping: false,
        }
    }

    fn take(&mut self, wire: &mut Wire) {
        self.phase = HandPhase::Taking;
        self.writer_left = self.keys;
        for key in 0..self.keys {
            let permits = (SHARED_LIMIT, 0);
            wire.acquire_permits(0, key, self.wait_s, self.lease_s, permits, WRITER);
        }
    }

    fn queue(&mut self, wire: &mut Wire) {
        self.phase = HandPhase::Queuing;
        for i in 0..self.waiters {
            let conn = 1 + (i % self.readers as u64) as usize;
            let permits = (SHARED_LIMIT, 1);
            wire.acquire_permits(
                conn,
                i % self.keys,
                self.wait_s,
                self.lease_s,
                permits,
                READER,
            );
        }
        for conn in 1..=self.readers {
            wire.ping(conn, BARRIER);
        }
        self.barriers_left = self.readers;
    }

    fn fire(&mut self, wire: &mut Wire) {
        self.phase = HandPhase::Handing;
        self.fired_at = wire.now;
        self.granted_left = self.waiters;
        self.release_writer(wire);
    }

    fn release_writer(&mut self, wire: &mut Wire) {
        for (key, token) in self.writer_tokens.iter_mut().enumerate() {
            if *token != 0 {
                wire.release(0, *token, key as u64, WRITER);
                *token = 0;
            }
        }
    }

    fn release_readers(&mut self, wire: &mut Wire) {
        for (conn, token, key) in self.reader_grants.drain(..) {
            wire.release(conn, token, key, READER);
        }
    }
}

impl super::fleet::Workload for HandOver {
    fn start(&mut self, wire: &mut Wire, stats: &mut Stats) {
        for counter in ["events", "grants"] {
            stats.set(counter, 0);
        }
        self.take(wire);
    }

    fn reply(
        &mut self,
        conn: usize,
        sent: Pending,
        reply: &Response,
        wire: &mut Wire,
        stats: &mut Stats,
    ) {
        match (sent.tag, sent.kind, reply) {
            (BARRIER, _, Response::Pong { .. }) => {
                if self.phase == HandPhase::Queuing {
                    self.barriers_left -= 1;
                    if self.barriers_left == 0 {
                        self.fire(wire);
                    }
                }
            }
            (WRITER, Kind::Acquire, &Response::Acquired { token, .. }) => {
                self.writer_tokens[sent.key as usize] = token;
                self.writer_left -= 1;
                if self.writer_left > 0 {
                    return;
                }
                if self.stopping {
                    self.phase = HandPhase::Done;
                    self.release_writer(wire);
                } else {
                    self.queue(wire);
                }
            }
            (READER, Kind::Acquire, &Response::Acquired { token, .. }) => {
                self.reader_grants.push((conn, token, sent.key));
                if self.phase != HandPhase::Handing {
                    return stats.error("a reader was granted before the hand-over".into());
                }
                stats.sample(
                    "handover",
                    wire.now.saturating_duration_since(self.fired_at),
                );
                self.granted_left -= 1;
                if self.granted_left > 0 {
                    return;
                }
                stats.sample(
                    "handover_all",
                    wire.now.saturating_duration_since(self.fired_at),
                );
                self.windows.push((self.fired_at, wire.now));
                stats.count("events", 1);
                stats.count("grants", self.waiters);
                if self.stopping {
                    self.phase = HandPhase::Done;
                } else {
                    // Asked before the readers give the keys back, so it
                    // queues and is granted as the last reader leaves.
                    self.take(wire);
                }
                self.release_readers(wire);
            }
            (_, Kind::Release, Response::Released { .. }) => {}
            (_, _, Response::Error { .. }) => {} // counted by the fleet
            (_, _, other) => stats.error(format!("unexpected answer {other:?} to {sent:?}")),
        }
    }

    fn stop(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        self.stopping = true;
        // The queued readers are granted and released, the keys released.
        if self.phase == HandPhase::Queuing {
            self.fire(wire);
        }
    }

    fn progress(&self) -> String {
        format!("{:?}", self.phase).to_lowercase()
    }

    fn windows(&self, now: Instant) -> Vec<(Instant, Instant)> {
        let running = (self.phase == HandPhase::Handing).then_some((self.fired_at, now));
        self.windows.iter().copied().chain(running).collect()
    }
}
