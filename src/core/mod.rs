//! The sans-IO server: every lock-server decision, and no IO or clock.
//!
//! [`Core`] takes requests (`handle_request`), connection events
//! (`connect`/`disconnect`) and the passing of time (`handle_timeout`), each
//! with `now` as an argument, and queues the responses to send, addressed
//! by connection, in its outbox. [`Core::poll_timeout`] says when it next
//! needs `handle_timeout`. The mio shell in `server` only moves bytes; tests
//! drive the same core with a fake clock.
//!
//! Time is in microseconds since the core's epoch (the server's start).
//! Timers run on a 1 ms tick: a deadline rounds *up* to the next tick and
//! fires once the clock has reached that tick, so nothing happens early.

pub mod connection;
pub mod endpoint;
pub mod key_index;
pub mod lock_table;
#[doc(hidden)]
pub mod script;
pub mod timer_wheel;
pub mod wait_histogram;
pub mod waiters;

use std::collections::HashSet;
use std::fmt::Write as _;

use crate::protocol::{ErrorCode, Request, RequestError, Response};
use lock_table::{LockTable, NIL};
use timer_wheel::{
    MICROS_PER_TICK, TimerId, TimerLinks, TimerStore, TimerWheel, tick_at_or_after, tick_reached,
    tick_start,
};
use wait_histogram::WaitHistogram;
use waiters::{ConnWaiters, Waiters};

/// A connection as the core knows it: the shell's slab index.
pub type ConnId = u32;

/// Microseconds since the core's epoch.
pub type Micros = u64;

const MICROS_PER_S: u64 = 1_000_000;

/// Timer ids with this bit are waiters; without it, lock-table entries.
const WAITER_TIMER: TimerId = 1 << 30;

/// Capacity limits (spec §4). Every one is a bound on memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Keys in the table, held or waited on (~62 B each).
    pub max_keys: usize,
    /// Queued waiters in total (~56 B each).
    pub max_waiters: usize,
    /// Queued waiters on one key.
    pub max_waiters_per_key: u32,
    /// Queued waits one connection may have.
    pub max_waits_per_conn: u32,
    /// Open connections (enforced by the shell).
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_keys: 1 << 20,
            max_waiters: 1 << 18,
            max_waiters_per_key: 1 << 14,
            max_waits_per_conn: 1 << 12,
            max_connections: 1 << 14,
        }
    }
}

impl Limits {
    /// Checks the limits against what the internal structures can index:
    /// lock-table entries and waiters share one timer wheel (waiters'
    /// timer ids carry [`WAITER_TIMER`]), and connection ids are the
    /// connection wheel's timer ids. The error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        let ids = WAITER_TIMER as usize;
        if self.max_keys >= ids {
            return Err(format!("--max-keys {} is above {}", self.max_keys, ids - 1));
        }
        if self.max_waiters >= ids {
            return Err(format!(
                "--max-waiters {} is above {}",
                self.max_waiters,
                ids - 1
            ));
        }
        if self.max_connections as u64 > endpoint::CONN_ID_MAX / 2 {
            return Err(format!(
                "--max-connections {} is above {}",
                self.max_connections,
                endpoint::CONN_ID_MAX / 2
            ));
        }
        Ok(())
    }
}

/// The counters reported by `I` (spec §2.2), and the finer ones the
/// metrics endpoint shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub grants: u64,
    pub timeouts: u64,
    pub busy: u64,
    pub expired: u64,
    pub released: u64,
    pub extended: u64,
    pub not_held: u64,
    pub errors: u64,
    /// Connections closed at accept by the `--allow` list.
    pub refused: u64,
    /// The part of `not_held` that answered an `R`...
    pub release_not_held: u64,
    /// ...and the part that answered an `E`.
    pub extend_not_held: u64,
    /// Connections accepted and served (refused ones are not counted).
    pub connections_accepted: u64,
    /// Connections refused at accept with `X 7` because
    /// `--max-connections` were open...
    pub refused_max_connections: u64,
    /// ...or because the process had no file descriptor left.
    pub refused_fd_limit: u64,
    /// `X` frames sent, by code (index = code; 0 unused).
    pub errors_by_code: [u64; 10],
    /// How long queued acquires waited before their grant or timeout.
    pub acquire_wait: WaitHistogram,
}

impl Stats {
    /// Counts one `X` frame with `code`, in the total and by code.
    pub fn count_error(&mut self, code: ErrorCode) {
        self.errors += 1;
        if let Some(count) = self.errors_by_code.get_mut(code as usize) {
            *count += 1;
        }
    }
}

/// A response and the connection it goes to.
pub type Output = (ConnId, Response);

/// A grant held now (see [`Core::grants`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldGrant<'a> {
    pub key: &'a str,
    pub token: u64,
    pub owner: u64,
    /// When the lease runs out.
    pub deadline: Micros,
}

/// Why [`Core::restore_grant`] refused a grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreError {
    /// Token 0, or not below this run's first token.
    TokenNotFromEarlierRun,
    /// The key was restored already.
    DuplicateKey,
    /// The table cannot grow.
    TableFull,
}

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RestoreError::TokenNotFromEarlierRun => "token is 0 or not below this run's first",
            RestoreError::DuplicateKey => "key listed twice",
            RestoreError::TableFull => "lock table full",
        })
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct ConnState {
    open: bool,
    waiters: ConnWaiters,
}

/// The lock server's state machine.
pub struct Core {
    limits: Limits,
    table: LockTable,
    waiters: Waiters,
    wheel: TimerWheel,
    conns: Vec<ConnState>,
    connections: usize,
    /// Entries held by an unknown grant of an earlier run.
    unknown_holders: usize,
    /// Until this instant every key counts as held by an unknown grant
    /// (after an unclean restart with a state directory); 0 = no grace.
    grace_until: Micros,
    /// Keys known free during the grace although not in the table: freed
    /// by an adopting `R`, or released or expired after a grant of this
    /// run. Emptied once the grace is over; at most `max_keys` of them.
    freed_in_grace: HashSet<Box<str>, foldhash::fast::RandomState>,
    /// The first token of this run: tokens below it were issued by an
    /// earlier run (spec §7: adoption during the grace).
    first_token: u64,
    /// The latest lease deadline armed for a grant of this run.
    lease_deadline_max: Micros,
    next_token: u64,
    stats: Stats,
    outbox: Vec<Output>,
}

/// How a key held by the unknown grant is represented.
enum Adoptable {
    /// An entry with token 0: the unknown grant, with waiters queued.
    Waited(u32),
    /// Not in the table: every key during the grace.
    Untracked,
}

/// Gives the timer wheel the links embedded in entries and waiters.
struct TimerNodes<'a> {
    table: &'a mut LockTable,
    waiters: &'a mut Waiters,
}

impl TimerStore for TimerNodes<'_> {
    fn links(&mut self, id: TimerId) -> &mut TimerLinks {
        if id & WAITER_TIMER != 0 {
            &mut self.waiters.get_mut(id & !WAITER_TIMER).timer
        } else {
            &mut self.table.get_mut(id).lease
        }
    }
}

impl Core {
    /// A core whose first grant gets `first_token` (spec §7: at least
    /// `unix_time_ms × 2^20`, or above a persisted high-water mark).
    pub fn new(limits: Limits, first_token: u64) -> Core {
        Core {
            limits,
            table: LockTable::new(),
            waiters: Waiters::new(),
            wheel: TimerWheel::new(),
            conns: Vec::new(),
            connections: 0,
            unknown_holders: 0,
            grace_until: 0,
            freed_in_grace: HashSet::default(),
            first_token: first_token.max(1),
            lease_deadline_max: 0,
            next_token: first_token.max(1),
            stats: Stats::default(),
            outbox: Vec::new(),
        }
    }

    /// Treat every key as held by an unknown grant until `until` (spec §7).
    pub fn set_grace_until(&mut self, until: Micros) {
        self.grace_until = until;
    }

    /// Until when keys count as held by unknown grants (0 = never).
    pub fn grace_until(&self) -> Micros {
        self.grace_until
    }

    /// The latest lease deadline ever armed for a grant of this run: no
    /// lease this core granted runs past it.
    pub fn lease_deadline_max(&self) -> Micros {
        self.lease_deadline_max
    }

    /// The first token of this run; tokens below it are an earlier run's.
    pub fn first_token(&self) -> u64 {
        self.first_token
    }

    /// Restores a grant an earlier run held at a clean stop (spec §7.1):
    /// `key` held by `token` (below this run's first token) for `owner`
    /// until `deadline`. Call before any request, at time 0. Restored keys
    /// count towards the key limit for new keys, but are restored even
    /// beyond it: every grant of the earlier run comes back.
    pub fn restore_grant(
        &mut self,
        key: &str,
        token: u64,
        owner: u64,
        deadline: Micros,
    ) -> Result<(), RestoreError> {
        debug_assert!(self.wheel.elapsed() == 0 && self.stats == Stats::default());
        if token == 0 || token >= self.first_token {
            return Err(RestoreError::TokenNotFromEarlierRun);
        }
        let hash = self.table.hash(key);
        if self.table.find(key, hash).is_some() {
            return Err(RestoreError::DuplicateKey);
        }
        let entry = self
            .table
            .insert(key, hash, token, owner)
            .ok_or(RestoreError::TableFull)?;
        self.arm_lease_at(entry, deadline.max(1));
        Ok(())
    }

    /// Every grant held now, for the snapshot at a clean stop; `deadline`
    /// is when its lease runs out (on the 1 ms tick).
    pub fn grants(&self) -> impl Iterator<Item = HeldGrant<'_>> + '_ {
        self.table.live_indices().filter_map(move |entry| {
            let held = self.table.get(entry);
            (held.token != 0).then(|| HeldGrant {
                key: self.table.key(entry),
                token: held.token,
                owner: held.owner,
                deadline: self.wheel.deadline_of(&held.lease) * MICROS_PER_TICK,
            })
        })
    }

    /// Keys held by a grant of this run.
    pub fn held(&self) -> usize {
        self.table.len() - self.unknown_holders
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn stats_mut(&mut self) -> &mut Stats {
        &mut self.stats
    }

    /// The token the next grant gets.
    pub fn next_token(&self) -> u64 {
        self.next_token
    }

    /// Keys in the table.
    pub fn keys(&self) -> usize {
        self.table.len()
    }

    /// Queued waiters.
    pub fn waiter_count(&self) -> usize {
        self.waiters.len()
    }

    /// Open connections the core knows of.
    pub fn connections(&self) -> usize {
        self.connections
    }

    /// Whether `conn` is open as far as the core knows.
    pub fn is_open(&self, conn: ConnId) -> bool {
        self.conns
            .get(conn as usize)
            .is_some_and(|state| state.open)
    }

    /// The responses produced since the last drain, in the order they must
    /// be written.
    pub fn drain_outbox(&mut self) -> std::vec::Drain<'_, Output> {
        self.outbox.drain(..)
    }

    /// When [`handle_timeout`](Self::handle_timeout) next has work, or
    /// `None` when no timer is armed.
    pub fn poll_timeout(&self) -> Option<Micros> {
        self.wheel.next_tick().map(tick_start)
    }

    /// A connection opened.
    pub fn connect(&mut self, conn: ConnId) {
        let index = conn as usize;
        if self.conns.len() <= index {
            self.conns.resize(index + 1, ConnState::default());
        }
        if !self.conns[index].open {
            self.conns[index] = ConnState {
                open: true,
                waiters: ConnWaiters::default(),
            };
            self.connections += 1;
            self.stats.connections_accepted += 1;
        }
    }

    /// A connection closed: its waiters leave their queues unanswered.
    /// Its grants stay (spec §1).
    pub fn disconnect(&mut self, conn: ConnId) {
        let Some(state) = self.conns.get(conn as usize) else {
            return;
        };
        if !state.open {
            return;
        }
        let mut waiter = state.waiters.head;
        while waiter != NIL {
            let next = self.waiters.next_of_conn(waiter);
            self.remove_waiter(waiter);
            waiter = next;
        }
        self.conns[conn as usize].open = false;
        self.connections -= 1;
    }

    /// Answers a request that the decoder rejected.
    pub fn handle_invalid(&mut self, conn: ConnId, error: RequestError) {
        self.send_error(conn, error.code, error.id);
    }

    /// Queues an `X` to `conn` and counts it.
    pub fn send_error(&mut self, conn: ConnId, code: ErrorCode, id: u64) {
        self.stats.count_error(code);
        self.outbox.push((conn, code.response(id)));
    }

    /// Whether [`prefetch`](Self::prefetch) does anything: only once the
    /// table is too large to stay in cache.
    pub fn prefetch_pays(&self) -> bool {
        self.table.prefetch_pays()
    }

    /// Starts loading the lock-table line that handling `request` will
    /// read first, and changes nothing. A shell that calls it for every
    /// whole frame of one read before handling them overlaps their cache
    /// misses instead of taking them one after another (a large table).
    pub fn prefetch(&self, request: &Request<'_>) {
        if !self.prefetch_pays() {
            return;
        }
        if let Request::Acquire { key, .. }
        | Request::Release { key, .. }
        | Request::Extend { key, .. }
        | Request::Query { key } = *request
        {
            self.table.prefetch(key);
        }
    }

    /// Evaluates one valid request that arrived (its last byte was read) at
    /// `now`.
    pub fn handle_request(&mut self, conn: ConnId, request: &Request<'_>, now: Micros) {
        if self.wheel.is_empty() {
            // With nothing armed the shell need not call `handle_timeout`,
            // so an idle wheel may stand far behind `now`; deadlines are
            // kept relative to its position (modulo 2³² ticks), so bring it
            // up to date before this request arms one. Nothing can fire.
            let mut nodes = TimerNodes {
                table: &mut self.table,
                waiters: &mut self.waiters,
            };
            let fired = self.wheel.poll(&mut nodes, tick_reached(now));
            debug_assert!(fired.is_none());
        }
        match *request {
            // `S` with limit 0 and take 0 is an exclusive acquire (spec
            // §10.1); its label is not kept until holders (`H`) exist.
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
                limit: 0,
                take: 0,
                ..
            } => self.acquire(conn, key, wait_s, lease_s, owner, now),
            // Permits (§10) and listing (§11) are not served by this core
            // yet. A request that names a limit or counts permits gets `B`:
            // definitive, nothing granted, queued or changed.
            Request::Acquire { owner, .. } => self.busy(conn, owner),
            // `H` and `L` get `X 13` (not permitted), which changes nothing.
            Request::Holders { id, .. } | Request::List { id, .. } => {
                self.send_error(conn, ErrorCode::NotPermitted, id);
            }
            // Without `--auth` (this core has none), `U` is answered with
            // an empty name (spec §12.2).
            Request::Authenticate { .. } => self.outbox.push((
                conn,
                Response::Authenticated {
                    name: String::new(),
                },
            )),
            Request::Release { token, key } => self.release(conn, key, token, now),
            Request::Extend {
                lease_s,
                token,
                key,
            } => self.extend(conn, key, token, lease_s, now),
            Request::Query { key } => self.query(conn, key, now),
            Request::Ping { nonce } => self.outbox.push((conn, Response::Pong { nonce })),
            Request::Info => {
                let text = self.info_text(now);
                self.outbox.push((conn, Response::Info(text)));
            }
        }
    }

    /// Fires every timer due at `now`: lease expiries hand keys on, wait
    /// deadlines answer `T`.
    pub fn handle_timeout(&mut self, now: Micros) {
        if now >= self.grace_until && !self.freed_in_grace.is_empty() {
            self.freed_in_grace = HashSet::default();
        }
        let now_tick = tick_reached(now);
        loop {
            let mut nodes = TimerNodes {
                table: &mut self.table,
                waiters: &mut self.waiters,
            };
            let Some(id) = self.wheel.poll(&mut nodes, now_tick) else {
                break;
            };
            if id & WAITER_TIMER != 0 {
                let waiter = id & !WAITER_TIMER;
                let (conn, owner) = {
                    let node = self.waiters.get(waiter);
                    (node.conn, node.owner)
                };
                self.observe_wait(waiter, now);
                self.remove_waiter(waiter);
                self.stats.timeouts += 1;
                self.outbox.push((conn, Response::Timeout { owner }));
            } else {
                if self.table.get(id).token != 0 {
                    self.stats.expired += 1;
                } else {
                    self.unknown_holders -= 1;
                }
                self.hand_over(id, now);
            }
        }
    }

    /// Graceful shutdown (spec §4): every queued waiter gets `B`, then every
    /// open connection gets `X 8`. The shell flushes and closes.
    pub fn shut_down(&mut self) {
        for conn in 0..self.conns.len() {
            if !self.conns[conn].open {
                continue;
            }
            let mut waiter = self.conns[conn].waiters.head;
            while waiter != NIL {
                let next = self.waiters.next_of_conn(waiter);
                let owner = self.waiters.get(waiter).owner;
                self.remove_waiter(waiter);
                self.stats.busy += 1;
                self.outbox.push((conn as ConnId, Response::Busy { owner }));
                waiter = next;
            }
        }
        for conn in 0..self.conns.len() {
            if self.conns[conn].open {
                self.send_error(conn as ConnId, ErrorCode::ShuttingDown, 0);
            }
        }
    }

    fn acquire(
        &mut self,
        conn: ConnId,
        key: &str,
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        now: Micros,
    ) {
        let hash = self.table.hash(key);
        let entry = match self.table.find(key, hash) {
            Some(_) if wait_s == 0 => return self.timeout(conn, owner),
            Some(entry) => {
                if !self.can_queue(conn, self.table.get(entry).waiters) {
                    return self.busy(conn, owner);
                }
                entry
            }
            None if now >= self.grace_until || self.freed_in_grace.contains(key) => {
                if self.next_token == u64::MAX {
                    return self.busy(conn, owner);
                }
                let Some(entry) = self.insert_key(key, hash, 0, owner) else {
                    return self.busy(conn, owner);
                };
                return self.grant(entry, conn, owner, lease_s, now);
            }
            None if wait_s == 0 => return self.timeout(conn, owner),
            None => {
                // The key may still be leased by the previous run: queue
                // behind an unknown holder whose lease ends at the horizon.
                if !self.can_queue(conn, NIL) {
                    return self.busy(conn, owner);
                }
                let Some(entry) = self.insert_key(key, hash, 0, 0) else {
                    return self.busy(conn, owner);
                };
                self.unknown_holders += 1;
                self.arm_lease_at(entry, self.grace_until);
                entry
            }
        };
        let waiter = {
            let queue = &mut self.table.get_mut(entry).waiters;
            let conn_list = &mut self.conns[conn as usize].waiters;
            self.waiters
                .push_back(queue, conn_list, conn, entry, owner, lease_s)
        };
        self.waiters.get_mut(waiter).enqueued_at = enqueued_at(now);
        let deadline = now + u64::from(wait_s) * MICROS_PER_S;
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
        };
        self.wheel.arm(
            &mut nodes,
            waiter | WAITER_TIMER,
            tick_at_or_after(deadline),
        );
    }

    /// Whether one more waiter fits: in total, on the queue with head
    /// `queue_head`, and on `conn`.
    fn can_queue(&self, conn: ConnId, queue_head: u32) -> bool {
        let Some(state) = self.conns.get(conn as usize).filter(|state| state.open) else {
            return false;
        };
        self.waiters.len() < self.limits.max_waiters
            && self.waiters.queue_len(queue_head) < self.limits.max_waiters_per_key
            && state.waiters.len < self.limits.max_waits_per_conn
    }

    fn insert_key(&mut self, key: &str, hash: u64, token: u64, owner: u64) -> Option<u32> {
        if self.table.len() >= self.limits.max_keys {
            return None;
        }
        self.table.insert(key, hash, token, owner)
    }

    fn release(&mut self, conn: ConnId, key: &str, token: u64, now: Micros) {
        let entry = match self.active_grant(key, token) {
            Some(entry) => entry,
            None => match self.adoptable(key, token, now) {
                Some(Adoptable::Waited(entry)) => {
                    self.unknown_holders -= 1;
                    entry
                }
                Some(Adoptable::Untracked) => {
                    self.stats.released += 1;
                    self.outbox.push((conn, Response::Released { token }));
                    return self.note_freed(key);
                }
                None => {
                    self.stats.release_not_held += 1;
                    return self.not_held(conn, token);
                }
            },
        };
        self.cancel_lease(entry);
        self.stats.released += 1;
        self.outbox.push((conn, Response::Released { token }));
        self.hand_over(entry, now);
    }

    fn extend(&mut self, conn: ConnId, key: &str, token: u64, lease_s: u8, now: Micros) {
        let entry = match self.active_grant(key, token) {
            Some(entry) => entry,
            None => match self.adoptable(key, token, now) {
                Some(Adoptable::Waited(entry)) => {
                    self.unknown_holders -= 1;
                    let held = self.table.get_mut(entry);
                    held.token = token;
                    held.owner = 0;
                    entry
                }
                Some(Adoptable::Untracked) => {
                    // An earlier run's holders must not lose their keys to
                    // this run's waiters filling the table, so adoption may
                    // take it to twice the key limit: that run held at most
                    // that many, and the bound on memory stays.
                    let hash = self.table.hash(key);
                    let entry = (self.table.len() < self.limits.max_keys.saturating_mul(2))
                        .then(|| self.table.insert(key, hash, token, 0))
                        .flatten();
                    match entry {
                        Some(entry) => entry,
                        // No room: nothing changed, and the key stays held
                        // by the unknown grant until the horizon.
                        None => {
                            self.stats.extend_not_held += 1;
                            return self.not_held(conn, token);
                        }
                    }
                }
                None => {
                    self.stats.extend_not_held += 1;
                    return self.not_held(conn, token);
                }
            },
        };
        self.arm_lease_at(entry, now + u64::from(lease_s) * MICROS_PER_S);
        self.stats.extended += 1;
        self.outbox.push((conn, Response::Extended { token }));
    }

    /// Whether `token` may adopt `key` (spec §7.3): it is an earlier run's
    /// token and the key is held by the unknown grant — an entry with token
    /// 0 (waited on), or, during the grace, a key not in the table and not
    /// known free.
    fn adoptable(&self, key: &str, token: u64, now: Micros) -> Option<Adoptable> {
        if token == 0 || token >= self.first_token {
            return None;
        }
        match self.table.find(key, self.table.hash(key)) {
            Some(entry) => (self.table.get(entry).token == 0).then_some(Adoptable::Waited(entry)),
            None => (now < self.grace_until && !self.freed_in_grace.contains(key))
                .then_some(Adoptable::Untracked),
        }
    }

    /// Remembers that `key`, not in the table, is free although the grace
    /// runs. Without room it stays held by the unknown grant until the
    /// horizon: later than it could be, never too early.
    fn note_freed(&mut self, key: &str) {
        if self.freed_in_grace.len() < self.limits.max_keys {
            self.freed_in_grace.insert(key.into());
        }
    }

    fn query(&mut self, conn: ConnId, key: &str, now: Micros) {
        let response = match self.table.find(key, self.table.hash(key)) {
            Some(entry) => {
                let entry = self.table.get(entry);
                // The tick rounded the true deadline up by less than one
                // tick: report the earliest deadline that rounds to it, so
                // a fresh grant never shows more than its lease. An unknown
                // holder's lease ends exactly at the horizon.
                let deadline = if entry.token == 0 {
                    self.grace_until
                } else {
                    tick_start(self.wheel.deadline_of(&entry.lease))
                        .saturating_sub(MICROS_PER_TICK - 1)
                };
                Response::Query {
                    token: entry.token,
                    owner: entry.owner,
                    lease_ms: millis_left(deadline, now),
                    waiters: self.waiters.queue_len(entry.waiters),
                }
            }
            None if now < self.grace_until && !self.freed_in_grace.contains(key) => {
                Response::Query {
                    token: 0,
                    owner: 0,
                    lease_ms: millis_left(self.grace_until, now),
                    waiters: 0,
                }
            }
            None => Response::Query {
                token: 0,
                owner: 0,
                lease_ms: 0,
                waiters: 0,
            },
        };
        self.outbox.push((conn, response));
    }

    /// The entry of `key` if `token` is its active grant. Token 0 (an
    /// unknown holder) never matches.
    fn active_grant(&self, key: &str, token: u64) -> Option<u32> {
        let entry = self.table.find(key, self.table.hash(key))?;
        (token != 0 && self.table.get(entry).token == token).then_some(entry)
    }

    /// The key's holder is gone: grant the head waiter, or drop the key
    /// (remembered as free while the grace runs).
    fn hand_over(&mut self, entry: u32, now: Micros) {
        loop {
            let head = self.table.get(entry).waiters;
            if head == NIL {
                if now < self.grace_until {
                    let key: Box<str> = self.table.key(entry).into();
                    self.note_freed(&key);
                }
                self.table.remove(entry);
                return;
            }
            let (conn, owner, lease_s) = {
                let waiter = self.waiters.get(head);
                (waiter.conn, waiter.owner, waiter.lease_s)
            };
            self.observe_wait(head, now);
            self.unlink_waiter(head);
            if self.next_token == u64::MAX {
                self.busy(conn, owner);
                continue;
            }
            return self.grant(entry, conn, owner, lease_s, now);
        }
    }

    fn grant(&mut self, entry: u32, conn: ConnId, owner: u64, lease_s: u8, now: Micros) {
        let token = self.next_token;
        self.next_token += 1;
        let held = self.table.get_mut(entry);
        held.token = token;
        held.owner = owner;
        self.arm_lease_at(entry, now + u64::from(lease_s) * MICROS_PER_S);
        self.stats.grants += 1;
        self.outbox
            .push((conn, Response::Acquired { owner, token }));
    }

    fn arm_lease_at(&mut self, entry: u32, deadline: Micros) {
        if self.table.get(entry).token != 0 {
            self.lease_deadline_max = self.lease_deadline_max.max(deadline);
        }
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
        };
        self.wheel
            .arm(&mut nodes, entry, tick_at_or_after(deadline));
    }

    fn cancel_lease(&mut self, entry: u32) {
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
        };
        self.wheel.cancel(&mut nodes, entry);
    }

    /// Takes a waiter out of its queue and its connection's list, silently.
    /// A key held only by an unknown grant and waited on by nobody is
    /// dropped: it means the same as a key that is not in the table.
    fn remove_waiter(&mut self, waiter: u32) {
        let entry = self.unlink_waiter(waiter);
        let held = self.table.get(entry);
        if held.token == 0 && held.waiters == NIL {
            self.cancel_lease(entry);
            self.unknown_holders -= 1;
            self.table.remove(entry);
        }
    }

    /// Takes a waiter out of its queue and its connection's list and
    /// returns the entry it queued on.
    fn unlink_waiter(&mut self, waiter: u32) -> u32 {
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
        };
        self.wheel.cancel(&mut nodes, waiter | WAITER_TIMER);
        let (conn, entry) = {
            let node = self.waiters.get(waiter);
            (node.conn, node.lock)
        };
        let queue = &mut self.table.get_mut(entry).waiters;
        let conn_list = &mut self.conns[conn as usize].waiters;
        self.waiters.remove(waiter, queue, conn_list);
        entry
    }

    /// Records how long `waiter` has queued, as it leaves with a grant or
    /// a timeout.
    fn observe_wait(&mut self, waiter: u32, now: Micros) {
        let waited = enqueued_at(now).wrapping_sub(self.waiters.get(waiter).enqueued_at);
        self.stats.acquire_wait.observe(u64::from(waited));
    }

    fn timeout(&mut self, conn: ConnId, owner: u64) {
        self.stats.timeouts += 1;
        self.outbox.push((conn, Response::Timeout { owner }));
    }

    fn busy(&mut self, conn: ConnId, owner: u64) {
        self.stats.busy += 1;
        self.outbox.push((conn, Response::Busy { owner }));
    }

    fn not_held(&mut self, conn: ConnId, token: u64) {
        self.stats.not_held += 1;
        self.outbox.push((conn, Response::NotHeld { token }));
    }

    /// Asserts the consistency of every internal structure: each key found
    /// by its own name and leased, each queue and connection list linked and
    /// counted right, every waiter armed and on an open connection, every
    /// armed timer accounted for. A bug then fails here rather than in a
    /// later, unrelated answer; simulations call it after every step.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut entries = 0;
        let mut unknown = 0;
        let mut queued = 0;
        for entry in self.table.live_indices() {
            entries += 1;
            let held = self.table.get(entry);
            let key = self.table.key(entry);
            assert_eq!(
                self.table.find(key, self.table.hash(key)),
                Some(entry),
                "key {key:?} not found by name"
            );
            assert!(held.lease.is_armed(), "key {key:?} has no lease timer");
            if held.token == 0 {
                unknown += 1;
                assert_ne!(
                    held.waiters, NIL,
                    "key {key:?} held by an unknown grant and waited on by nobody"
                );
            } else {
                assert!(
                    held.token < self.next_token,
                    "key {key:?} has token {} ≥ next {}",
                    { held.token },
                    self.next_token
                );
            }
            let mut length = 0;
            for waiter in self.waiters.queue(held.waiters) {
                length += 1;
                let node = self.waiters.get(waiter);
                assert_eq!(
                    node.lock, entry,
                    "waiter {waiter} of key {key:?} points elsewhere"
                );
                assert!(
                    node.timer.is_armed(),
                    "waiter {waiter} of key {key:?} has no deadline timer"
                );
                assert!(
                    self.conns[node.conn as usize].open,
                    "waiter {waiter} on a closed connection"
                );
            }
            assert_eq!(
                length,
                self.waiters.queue_len(held.waiters),
                "queue length of key {key:?}"
            );
            queued += length as usize;
        }
        assert_eq!(entries, self.table.len(), "live entries vs table length");
        assert_eq!(unknown, self.unknown_holders, "unknown holders");
        assert_eq!(queued, self.waiters.len(), "queued waiters vs waiter count");
        let mut open = 0;
        let mut listed = 0;
        for (conn, state) in self.conns.iter().enumerate() {
            open += usize::from(state.open);
            let mut length = 0;
            let mut waiter = state.waiters.head;
            while waiter != NIL {
                length += 1;
                assert_eq!(
                    self.waiters.get(waiter).conn as usize,
                    conn,
                    "waiter {waiter} on the wrong connection list"
                );
                assert!(
                    length <= self.waiters.len(),
                    "connection {conn}'s waiter list loops"
                );
                waiter = self.waiters.next_of_conn(waiter);
            }
            assert_eq!(
                length as u32, state.waiters.len,
                "waiter count of connection {conn}"
            );
            assert!(
                state.open || length == 0,
                "closed connection {conn} still has waiters"
            );
            listed += length;
        }
        assert_eq!(open, self.connections, "open connections");
        assert_eq!(listed, self.waiters.len(), "waiters on connection lists");
        assert_eq!(
            self.wheel.len(),
            entries + queued,
            "armed timers vs leases and waiters"
        );
    }

    /// The `I` line: `name=value` pairs separated by single spaces.
    pub fn info_text(&self, now: Micros) -> String {
        let s = &self.stats;
        let mut text = String::with_capacity(320);
        let _ = write!(
            text,
            "version={} uptime_s={} connections={} keys={} held={} waiters={} \
             grants={} timeouts={} busy={} expired={} released={} extended={} \
             not_held={} errors={} refused={} next_token={}",
            env!("CARGO_PKG_VERSION"),
            now / MICROS_PER_S,
            self.connections,
            self.table.len(),
            self.held(),
            self.waiters.len(),
            s.grants,
            s.timeouts,
            s.busy,
            s.expired,
            s.released,
            s.extended,
            s.not_held,
            s.errors,
            s.refused,
            self.next_token,
        );
        text
    }
}

/// A waiter's enqueue instant as it is kept: microseconds modulo 2³²
/// (71 minutes), which measures any wait exactly, since none lasts longer
/// than 255 s, and fits in the waiter node's padding.
fn enqueued_at(now: Micros) -> u32 {
    now as u32
}

/// Milliseconds from `now` to `deadline`, rounded up, saturating.
fn millis_left(deadline: Micros, now: Micros) -> u32 {
    let left = deadline.saturating_sub(now).div_ceil(1_000);
    u32::try_from(left).unwrap_or(u32::MAX)
}
