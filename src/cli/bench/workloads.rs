//! The bench workloads: each decides what to send next from the answers
//! it gets. The fleet does the IO, the correlation and the counting.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::Plan;
use super::fleet::{Pending, Wire, Workload};
use super::stats::{Kind, Stats};
use crate::protocol::{Response, SHARED_LIMIT};

/// A small, fast, seeded generator (SplitMix64): the key sequence of a run
/// is reproducible from `--seed`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // Multiply-shift: unbiased enough for key choice, no division.
        ((u128::from(z) * u128::from(n)) >> 64) as u64
    }
}

/// What the requests of a [`Cycles`] run ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    /// Plain exclusive locks (`A`): `pairs`, `contended`.
    Exclusive,
    /// One permit of a semaphore of `limit` (`S limit 1`): `semaphore`.
    Semaphore { limit: u16 },
    /// Readers (`S 65535 1`) and `writers_percent` % writers (`S 65535 0`),
    /// writers holding for `write_hold`: `rw`. With `sharing` off every
    /// request is a writer in all but its hold time, for comparison.
    ReadWrite {
        writers_percent: u8,
        write_hold: Duration,
        sharing: bool,
    },
}

/// The roles of a `rw` request, kept in its tag.
const READER: u32 = 0;
const WRITER: u32 = 1;

/// `pairs`, `contended`, `semaphore` and `rw`: each slot acquires a random
/// key (`--wait`: 0 for `pairs`), as its [`Mix`] says, holds the grant for
/// `--hold` (0 for `pairs`: released as soon as the `A` arrives; a writer
/// of `rw` for its own hold), releases it with its token, and starts over.
/// A `T` is a miss and the slot tries another key. Counts grants,
/// completed pairs and misses, and how evenly the connections were served;
/// `rw` also counts reads and writes and their waits apart.
pub struct Cycles {
    plan: Plan,
    mix: Mix,
    rng: Rng,
    /// Grants to hand back, per role, each due in order (every hold of a
    /// role is the same length): `(due, conn, token, key)`.
    due: [VecDeque<(Instant, usize, u64, u64)>; 2],
    grants_per_conn: Vec<u64>,
    stopping: bool,
}

impl Cycles {
    pub fn new(plan: Plan, mix: Mix) -> Cycles {
        Cycles {
            rng: Rng::new(plan.seed),
            grants_per_conn: vec![0; plan.connections],
            plan,
            mix,
            due: [VecDeque::new(), VecDeque::new()],
            stopping: false,
        }
    }

    fn acquire(&mut self, conn: usize, wire: &mut Wire) {
        let key = self.rng.below(self.plan.keys);
        let (permits, role) = match self.mix {
            Mix::Exclusive => ((0, 0), READER),
            Mix::Semaphore { limit } => ((limit, 1), READER),
            Mix::ReadWrite {
                writers_percent,
                sharing,
                ..
            } => {
                let role = if self.rng.below(100) < u64::from(writers_percent) {
                    WRITER
                } else {
                    READER
                };
                let take = u16::from(role == READER && sharing);
                ((SHARED_LIMIT, take), role)
            }
        };
        let (wait_s, lease_s) = (self.plan.wait_s, self.plan.lease_s);
        wire.acquire_permits(conn, key, wait_s, lease_s, permits, role);
    }

    fn hold(&self, role: u32) -> Duration {
        match self.mix {
            Mix::ReadWrite { write_hold, .. } if role == WRITER => write_hold,
            _ => self.plan.hold,
        }
    }
}

impl Workload for Cycles {
    fn start(&mut self, wire: &mut Wire, stats: &mut Stats) {
        // Reported even when they stay 0.
        for counter in ["grants", "pairs", "misses"] {
            stats.set(counter, 0);
        }
        if matches!(self.mix, Mix::ReadWrite { .. }) {
            stats.set("reads", 0);
            stats.set("writes", 0);
        }
        for conn in 0..self.plan.connections {
            for _ in 0..self.plan.pipeline {
                self.acquire(conn, wire);
            }
        }
    }

    fn reply(
        &mut self,
        conn: usize,
        sent: Pending,
        reply: &Response,
        wire: &mut Wire,
        stats: &mut Stats,
    ) {
        match (sent.kind, reply) {
            (Kind::Acquire, &Response::Acquired { token, .. }) => {
                stats.count("grants", 1);
                if stats.measuring() {
                    self.grants_per_conn[conn] += 1;
                }
                if matches!(self.mix, Mix::ReadWrite { .. }) {
                    let waited = wire.now.saturating_duration_since(sent.sent);
                    if sent.tag == WRITER {
                        stats.count("writes", 1);
                        stats.sample("write_wait", waited);
                    } else {
                        stats.count("reads", 1);
                        stats.sample("read_wait", waited);
                    }
                }
                let hold = self.hold(sent.tag);
                if hold.is_zero() || self.stopping {
                    wire.release(conn, token, sent.key, 0);
                } else {
                    let role = usize::from(sent.tag == WRITER);
                    self.due[role].push_back((wire.now + hold, conn, token, sent.key));
                }
                return;
            }
            (Kind::Acquire, Response::Timeout { .. }) => stats.count("misses", 1),
            (Kind::Release, Response::Released { .. }) => stats.count("pairs", 1),
            (Kind::Release, Response::NotHeld { .. }) => stats.error(format!(
                "key {} lost its lease before the release",
                sent.key
            )),
            _ => {}
        }
        if !self.stopping {
            self.acquire(conn, wire);
        }
    }

    fn tick(&mut self, wire: &mut Wire, _stats: &mut Stats) -> Option<Instant> {
        let mut next = None;
        for due in &mut self.due {
            while let Some(&(at, conn, token, key)) = due.front() {
                if at > wire.now {
                    next = Some(next.map_or(at, |next: Instant| next.min(at)));
                    break;
                }
                due.pop_front();
                wire.release(conn, token, key, 0);
            }
        }
        next
    }

    fn stop(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        self.stopping = true;
        for due in &mut self.due {
            for (_, conn, token, key) in due.drain(..) {
                wire.release(conn, token, key, 0);
            }
        }
    }

    fn finish(&mut self, stats: &mut Stats) {
        let min = self.grants_per_conn.iter().copied().min().unwrap_or(0);
        let max = self.grants_per_conn.iter().copied().max().unwrap_or(0);
        stats.set("grants_per_conn_min", min);
        stats.set("grants_per_conn_max", max);
    }
}

/// The keys a workload keeps: the token each key index holds, and
/// per-connection work queues that keep at most `pipeline` requests in
/// flight. Key `i` lives on connection `first + i % count`.
struct Holdings {
    tokens: Vec<u64>,
    held: u64,
    first: usize,
    count: usize,
    /// Key indices each connection still has to send the current phase for.
    todo: Vec<Vec<u64>>,
    phase: Phase,
    renew_at: Option<Instant>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Acquire,
    Renew,
    Release,
}

impl Holdings {
    fn new(keys: u64, first: usize, count: usize, connections: usize) -> Holdings {
        let mut holdings = Holdings {
            tokens: vec![0; keys as usize],
            held: 0,
            first,
            count,
            todo: vec![Vec::new(); connections],
            phase: Phase::Acquire,
            renew_at: None,
        };
        holdings.refill(|_| true);
        holdings
    }

    /// Queues the keys `which` selects on their connections, lowest first.
    fn refill(&mut self, which: impl Fn(u64) -> bool) {
        for key in (0..self.tokens.len() as u64).rev() {
            if which(self.tokens[key as usize]) {
                self.todo[self.first + (key % self.count as u64) as usize].push(key);
            }
        }
    }

    fn all_sent(&self) -> bool {
        self.todo.iter().all(Vec::is_empty)
    }

    fn complete(&self) -> bool {
        self.phase == Phase::Acquire && self.all_sent() && self.held == self.tokens.len() as u64
    }

    /// Sends the current phase's next requests on `conn`.
    fn feed(&mut self, conn: usize, plan: &Plan, wire: &mut Wire) {
        while wire.in_flight(conn) < plan.pipeline {
            let Some(key) = self.todo[conn].pop() else {
                break;
            };
            let token = self.tokens[key as usize];
            match self.phase {
                Phase::Acquire => wire.acquire(conn, key, 0, plan.lease_s, 0),
                Phase::Renew => wire.extend(conn, token, key, plan.lease_s, 0),
                Phase::Release => wire.release(conn, token, key, 0),
            }
        }
    }

    fn feed_all(&mut self, plan: &Plan, wire: &mut Wire) {
        for conn in self.first..self.first + self.count {
            self.feed(conn, plan, wire);
        }
    }

    /// Books the answer to one of this holding's requests and sends the
    /// connection's next one.
    fn reply(
        &mut self,
        conn: usize,
        sent: Pending,
        reply: &Response,
        plan: &Plan,
        wire: &mut Wire,
        stats: &mut Stats,
    ) {
        let slot = &mut self.tokens[sent.key as usize];
        match (sent.kind, reply) {
            (Kind::Acquire, &Response::Acquired { token, .. }) => {
                *slot = token;
                self.held += 1;
            }
            (Kind::Acquire, Response::Timeout { .. }) => {
                stats.error(format!("key {} is held by someone else", sent.key))
            }
            (Kind::Release, Response::Released { .. }) => {
                *slot = 0;
                self.held -= 1;
            }
            (Kind::Extend | Kind::Release, Response::NotHeld { .. }) => {
                *slot = 0;
                self.held -= 1;
                stats.error(format!("key {} lost its lease", sent.key));
            }
            _ => {}
        }
        self.feed(conn, plan, wire);
    }

    /// Starts a renewal round every `lease / 3` once the previous phase
    /// has been sent; returns when the next one is due.
    fn tick(&mut self, plan: &Plan, wire: &mut Wire) -> Option<Instant> {
        if self.phase == Phase::Release || !self.all_sent() {
            return None;
        }
        let every = Duration::from_secs(u64::from(plan.lease_s)) / 3;
        let renew_at = *self.renew_at.get_or_insert(wire.now + every);
        if wire.now < renew_at {
            return Some(renew_at);
        }
        self.phase = Phase::Renew;
        self.renew_at = Some(wire.now + every);
        self.refill(|token| token != 0);
        self.feed_all(plan, wire);
        self.renew_at
    }

    fn release_all(&mut self, plan: &Plan, wire: &mut Wire) {
        self.phase = Phase::Release;
        self.todo.iter_mut().for_each(Vec::clear);
        self.refill(|token| token != 0);
        self.feed_all(plan, wire);
    }
}

/// `hold N`: acquire N distinct keys with a long lease, renew them every
/// lease/3, keep them until the run ends, then release them all. For
/// memory and timer measurements under a full table.
pub struct Hold {
    plan: Plan,
    keys: Holdings,
}

impl Hold {
    pub fn new(plan: Plan) -> Hold {
        Hold {
            keys: Holdings::new(plan.keys, 0, plan.connections, plan.connections),
            plan,
        }
    }
}

impl Workload for Hold {
    fn start(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        self.keys.feed_all(&self.plan, wire);
    }

    fn reply(
        &mut self,
        conn: usize,
        sent: Pending,
        reply: &Response,
        wire: &mut Wire,
        stats: &mut Stats,
    ) {
        self.keys.reply(conn, sent, reply, &self.plan, wire, stats);
    }

    fn tick(&mut self, wire: &mut Wire, _stats: &mut Stats) -> Option<Instant> {
        self.keys.tick(&self.plan, wire)
    }

    fn stop(&mut self, wire: &mut Wire, stats: &mut Stats) {
        stats.set("held", self.keys.held);
        self.keys.release_all(&self.plan, wire);
    }

    fn progress(&self) -> String {
        format!("held {}/{}", self.keys.held, self.plan.keys)
    }
}

/// `waiters N`: connection 0 holds `--keys` keys; once it does, the other
/// connections queue N waits (`--wait`, default 255 s) spread over those
/// keys. For memory measurement of the waiter queues.
pub struct Waiters {
    plan: Plan,
    waits: u64,
    holder: Holdings,
    queued: u64,
    sent: bool,
    stopping: bool,
}

const WAITER: u32 = 1;

impl Waiters {
    pub fn new(plan: Plan, waits: u64) -> Waiters {
        Waiters {
            holder: Holdings::new(plan.keys, 0, 1, plan.connections),
            plan,
            waits,
            queued: 0,
            sent: false,
            stopping: false,
        }
    }

    fn wait(&mut self, index: u64, wire: &mut Wire) {
        let conn = 1 + (index % (self.plan.connections as u64 - 1)) as usize;
        wire.acquire(
            conn,
            index % self.plan.keys,
            self.plan.wait_s,
            self.plan.lease_s,
            WAITER,
        );
        self.queued += 1;
    }
}

impl Workload for Waiters {
    fn start(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        self.holder.feed_all(&self.plan, wire);
    }

    fn reply(
        &mut self,
        conn: usize,
        sent: Pending,
        reply: &Response,
        wire: &mut Wire,
        stats: &mut Stats,
    ) {
        if sent.tag != WAITER {
            self.holder
                .reply(conn, sent, reply, &self.plan, wire, stats);
            if !self.sent && self.holder.complete() {
                self.sent = true;
                for index in 0..self.waits {
                    self.wait(index, wire);
                }
            }
            return;
        }
        match (sent.kind, reply) {
            (Kind::Acquire, &Response::Acquired { token, .. }) => {
                self.queued -= 1;
                if !self.stopping {
                    stats.error(format!(
                        "a waiter was granted key {} while it was held",
                        sent.key
                    ));
                }
                wire.release(conn, token, sent.key, WAITER);
            }
            (Kind::Acquire, Response::Timeout { .. }) => {
                self.queued -= 1;
                stats.count("timeouts", 1);
                if !self.stopping {
                    self.wait(sent.key, wire);
                }
            }
            (Kind::Acquire, _) => self.queued -= 1,
            _ => {}
        }
    }

    fn tick(&mut self, wire: &mut Wire, _stats: &mut Stats) -> Option<Instant> {
        self.holder.tick(&self.plan, wire)
    }

    fn stop(&mut self, wire: &mut Wire, stats: &mut Stats) {
        // Releasing the held keys hands each to its waiters in turn, and
        // each waiter releases at once: the queues drain by themselves.
        self.stopping = true;
        stats.set("queued", self.queued);
        self.holder.release_all(&self.plan, wire);
    }

    fn progress(&self) -> String {
        format!(
            "held {}/{}  queued {}/{}",
            self.holder.held, self.plan.keys, self.queued, self.waits
        )
    }
}

/// `idle N`: N connections that each answer one ping and then stay quiet.
/// For memory per idle connection and the server's idle wake-ups.
pub struct Idle {
    connections: usize,
    ready: u64,
}

impl Idle {
    pub fn new(plan: &Plan) -> Idle {
        Idle {
            connections: plan.connections,
            ready: 0,
        }
    }
}

impl Workload for Idle {
    fn start(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        for conn in 0..self.connections {
            wire.ping(conn, 0);
        }
    }

    fn reply(
        &mut self,
        _conn: usize,
        _sent: Pending,
        reply: &Response,
        _wire: &mut Wire,
        _stats: &mut Stats,
    ) {
        if let Response::Pong { .. } = reply {
            self.ready += 1;
        }
    }

    fn stop(&mut self, _wire: &mut Wire, stats: &mut Stats) {
        stats.set("ready", self.ready);
    }

    fn progress(&self) -> String {
        format!("ready {}/{}", self.ready, self.connections)
    }
}

/// `timers`: measures how late the server's timers fire.
///
/// - Timeout probes: connection 0 holds one key; each of `C` prober
///   connections waits on it with `wait=1` and measures when its `T`
///   arrives. The server's deadline is 1 s after it read the request, which
///   is after the prober sent it: `arrival − sent − 1 s` is an upper bound
///   of the lateness, and a negative value would be an early timeout.
/// - Expiry probes: in each of `C` connection pairs, the first takes a
///   fresh key with a 1 s lease, the second then waits on it; the wait
///   ends with a grant when the lease runs out. `grant arrival − first's
///   send − 1 s` bounds the expiry lateness from above; negative would be
///   an early expiry.
pub struct Timers {
    probes: usize,
    blocker_token: u64,
    blocker_renew_at: Option<Instant>,
    launches: Vec<(Instant, Probe)>,
    expiry_sent: Vec<Instant>,
    next_key: u64,
    stopping: bool,
}

#[derive(Clone, Copy)]
enum Probe {
    Timeout(usize),
    Expiry(usize),
}

const BLOCKED_KEY: u64 = 0;
const PROBE_WAIT_S: u8 = 1;
const EXPIRY_LEASE_S: u8 = 1;
/// Long enough that an expiry probe's wait never runs out first.
const EXPIRY_WAIT_S: u8 = 3;
const BLOCKER_LEASE_S: u8 = 255;

impl Timers {
    /// Connections needed for `probes` probes of each kind.
    pub fn connections(probes: usize) -> usize {
        1 + 3 * probes
    }

    pub fn new(probes: usize) -> Timers {
        Timers {
            probes,
            blocker_token: 0,
            blocker_renew_at: None,
            launches: Vec::new(),
            expiry_sent: vec![Instant::now(); probes],
            next_key: BLOCKED_KEY,
            stopping: false,
        }
    }

    fn prober(&self, probe: usize) -> usize {
        1 + probe
    }

    fn expiry_holder(&self, probe: usize) -> usize {
        1 + self.probes + 2 * probe
    }

    fn launch(&mut self, probe: Probe, wire: &mut Wire) {
        match probe {
            Probe::Timeout(p) => {
                let conn = self.prober(p);
                wire.acquire(conn, BLOCKED_KEY, PROBE_WAIT_S, 1, p as u32);
            }
            Probe::Expiry(p) => {
                self.next_key += 1;
                let conn = self.expiry_holder(p);
                wire.acquire(conn, self.next_key, 0, EXPIRY_LEASE_S, p as u32);
            }
        }
    }

    /// Records how late a timer fired given its earliest possible instant.
    fn late(&self, name: &'static str, earliest: Instant, now: Instant, stats: &mut Stats) {
        match now.checked_duration_since(earliest) {
            Some(late) => stats.sample(name, late),
            None => stats.error(format!(
                "{name}: fired {} ms early",
                crate::decimal::millis(earliest - now, 3)
            )),
        }
    }
}

impl Workload for Timers {
    fn start(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        wire.acquire(0, BLOCKED_KEY, 0, BLOCKER_LEASE_S, 0);
    }

    fn reply(
        &mut self,
        conn: usize,
        sent: Pending,
        reply: &Response,
        wire: &mut Wire,
        stats: &mut Stats,
    ) {
        let probe = sent.tag as usize;
        let one_second = Duration::from_secs(1);
        let is_prober = (1..=self.probes).contains(&conn);
        let is_expiry_holder = conn > self.probes && (conn - self.probes) % 2 == 1;
        match (sent.kind, reply) {
            (Kind::Acquire, &Response::Acquired { token, .. }) if conn == 0 => {
                self.blocker_token = token;
                self.blocker_renew_at = Some(wire.now + Duration::from_secs(60));
                // Spread the probes over one second so they sample the
                // wheel at different phases.
                let step = one_second / (2 * self.probes as u32);
                for p in 0..self.probes {
                    let at = wire.now + step * (2 * p as u32);
                    self.launches.push((at, Probe::Timeout(p)));
                    self.launches.push((at + step, Probe::Expiry(p)));
                }
            }
            (Kind::Acquire, Response::Timeout { .. }) if conn == 0 => {
                stats.error("the timers' blocking key is held by someone else".into())
            }
            (Kind::Acquire, Response::Timeout { .. }) if is_prober => {
                self.late("timeout_late", sent.sent + one_second, wire.now, stats);
                if !self.stopping {
                    self.launch(Probe::Timeout(probe), wire);
                }
            }
            (Kind::Acquire, &Response::Acquired { token, .. }) if is_prober => {
                if !self.stopping {
                    stats.error("a timeout probe was granted the blocked key".into());
                }
                wire.release(conn, token, sent.key, sent.tag);
            }
            (Kind::Acquire, Response::Acquired { .. }) if is_expiry_holder => {
                // Let the lease run out; the partner waits for the hand-over.
                self.expiry_sent[probe] = sent.sent;
                wire.acquire(conn + 1, sent.key, EXPIRY_WAIT_S, 1, sent.tag);
            }
            (Kind::Acquire, Response::Timeout { .. }) if is_expiry_holder => {
                stats.error(format!("fresh key {} was already held", sent.key));
                if !self.stopping {
                    self.launch(Probe::Expiry(probe), wire);
                }
            }
            (Kind::Acquire, &Response::Acquired { token, .. }) => {
                self.late(
                    "expiry_late",
                    self.expiry_sent[probe] + one_second,
                    wire.now,
                    stats,
                );
                wire.release(conn, token, sent.key, sent.tag);
            }
            (Kind::Acquire, Response::Timeout { .. }) => {
                stats.error(format!(
                    "key {} was not taken back within {EXPIRY_WAIT_S} s",
                    sent.key
                ));
                if !self.stopping {
                    self.launch(Probe::Expiry(probe), wire);
                }
            }
            (Kind::Release, Response::Released { .. }) if conn > self.probes && !self.stopping => {
                self.launch(Probe::Expiry(probe), wire);
            }
            (Kind::Extend | Kind::Release, Response::NotHeld { .. }) if conn == 0 => {
                stats.error("the timers' blocking key lost its lease".into())
            }
            _ => {}
        }
    }

    fn tick(&mut self, wire: &mut Wire, _stats: &mut Stats) -> Option<Instant> {
        let now = wire.now;
        let due: Vec<Probe> = self
            .launches
            .iter()
            .filter(|(at, _)| *at <= now)
            .map(|&(_, probe)| probe)
            .collect();
        self.launches.retain(|(at, _)| *at > now);
        for probe in due {
            self.launch(probe, wire);
        }
        if self.blocker_renew_at.is_some_and(|at| at <= now) {
            wire.extend(0, self.blocker_token, BLOCKED_KEY, BLOCKER_LEASE_S, 0);
            self.blocker_renew_at = Some(now + Duration::from_secs(60));
        }
        self.launches
            .iter()
            .map(|&(at, _)| at)
            .chain(self.blocker_renew_at)
            .min()
    }

    fn stop(&mut self, wire: &mut Wire, _stats: &mut Stats) {
        self.stopping = true;
        self.launches.clear();
        self.blocker_renew_at = None;
        if self.blocker_token != 0 {
            wire.release(0, self.blocker_token, BLOCKED_KEY, 0);
        }
    }
}
