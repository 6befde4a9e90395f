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

pub mod access;
mod adoption;
mod auth_log;
pub mod connection;
pub mod endpoint;
mod invariants;
pub mod key_index;
pub mod labels;
pub mod lock_table;
mod memory;
pub mod permits;
mod quota;
mod request;
pub mod restart;
#[doc(hidden)]
pub mod script;
#[cfg(feature = "tls")]
pub(crate) mod tls;
pub mod token_binding;
pub mod wait_histogram;
pub mod waiters;
pub mod watches;

use std::collections::{HashSet, VecDeque};

use crate::protocol::{ErrorCode, Request, RequestError, Response};
use crate::timer_wheel::{
    TimerId, TimerLinks, TimerStore, TimerWheel, tick_at_or_after, tick_reached, tick_start,
};
use labels::{LabelOf, Labels};
use lock_table::LockTable;
use memory::NIL;
use permits::{Grants, PERMITS, PermitKey};
use restart::LeaseLedger;
use token_binding::TokenBinding;
use wait_histogram::WaitHistogram;
use waiters::{ConnWaiters, Waiters};
use watches::Watches;

pub use adoption::{Adopter, EarlierGrant, HeldGrant, RestoreError};
pub use request::ANSWER_BYTES_MAX;

/// A connection as the core knows it: the shell's slab index.
pub type ConnId = u32;

/// Microseconds since the core's epoch.
pub type Micros = u64;

const MICROS_PER_S: u64 = 1_000_000;

/// Work one turn of the event loop may spend on what timers and the
/// changes of a key set off (spec §4, v5), in timers fired, watches
/// answered and waiters handed a key; the rest goes on in the next turns.
pub const TURN_WORK: u32 = 4096;

/// Timer ids with this bit are waiters; with [`GRANT_TIMER`], grants of
/// permit keys; with neither, lock-table entries.
const WAITER_TIMER: TimerId = 1 << 30;
/// Timer ids with this bit are grants of permit keys.
const GRANT_TIMER: TimerId = 1 << 31;

/// Capacity limits (spec §4). Every one is a bound on memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Keys in the table, held or waited on (~66 B each).
    pub max_keys: usize,
    /// Queued waiters in total (~56 B each).
    pub max_waiters: usize,
    /// Queued waiters on one key.
    pub max_waiters_per_key: u32,
    /// Queued waits one connection may have.
    pub max_waits_per_conn: u32,
    /// Grants plus queued waiters across all keys (spec §10.8); a server
    /// that only sees `A` never meets it at `max_keys + max_waiters`.
    pub max_grants: usize,
    /// Open connections (enforced by the shell).
    pub max_connections: usize,
    /// Held watches (`O`, spec §13.3) in total: apart from the waits, so
    /// that no number of watches turns a waiting `A`/`S` away (~56 B each,
    /// plus ~60 B and the key's bytes once per watched key).
    pub max_watches: usize,
    /// Held watches one connection may have.
    pub max_watches_per_conn: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_keys: 1 << 20,
            max_waiters: 1 << 18,
            max_waiters_per_key: 1 << 14,
            max_waits_per_conn: 1 << 12,
            max_grants: (1 << 20) + (1 << 18),
            max_connections: 1 << 14,
            max_watches: 1 << 18,
            max_watches_per_conn: 1 << 12,
        }
    }
}

impl Limits {
    /// Checks the limits against what the internal structures can index:
    /// lock-table entries, waiters and grants share one timer wheel
    /// (waiters' timer ids carry [`WAITER_TIMER`], grants'
    /// [`GRANT_TIMER`]), and connection ids are the connection wheel's
    /// timer ids. The error names the flag.
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
        if self.max_grants >= ids {
            return Err(format!(
                "--max-grants {} is above {}",
                self.max_grants,
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
    /// `C` answered `C` (spec §13.4a)...
    pub proclaimed: u64,
    /// ...and answered `N` (also counted in `not_held`).
    pub proclaim_not_held: u64,
    /// Connections accepted and served (refused ones are not counted).
    pub connections_accepted: u64,
    /// Connections refused at accept with `X 7` because
    /// `--max-connections` were open...
    pub refused_max_connections: u64,
    /// ...or because the process had no file descriptor left.
    pub refused_fd_limit: u64,
    /// `X` frames sent, by code (index = code; 0 unused).
    pub errors_by_code: [u64; 15],
    /// How long queued acquires waited before their grant or timeout.
    pub acquire_wait: WaitHistogram,
    /// `H` requests answered (spec §11.2).
    pub holders: u64,
    /// `L` requests answered (spec §11.3).
    pub lists: u64,
    /// Connections closed with `X 12` (spec §12.2).
    pub auth_failures: u64,
    /// Writes of the state file that failed (spec §7.6).
    pub state_errors: u64,
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

#[derive(Clone, Copy, Debug, Default)]
struct ConnState {
    open: bool,
    waiters: ConnWaiters,
    /// Whose tries at adoption this connection's count as (spec §7.3).
    adopter: Adopter,
}

/// The lock server's state machine.
pub struct Core {
    limits: Limits,
    table: LockTable,
    waiters: Waiters,
    wheel: TimerWheel,
    /// The watches' deadlines (spec §13): a wheel of their own, so that
    /// the leases' and waiters' wheel, on the `A` path, tells only three
    /// kinds of node apart.
    watch_wheel: TimerWheel,
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
    /// Whether the grace's unknown grants may include counted grants
    /// (spec §7.4): then no adoption frees a key before the horizon.
    grace_counted: bool,
    /// Whether this run made or restored a counted grant (spec §7.4).
    counted_grants_made: bool,
    /// The first token of this run: tokens below it were issued by an
    /// earlier run (spec §7: adoption during the grace).
    first_token: u64,
    /// No lease of this run runs past it: the latest lease deadline armed
    /// for a grant of this run, or, after
    /// [`settle_lease_deadline_max`](Self::settle_lease_deadline_max),
    /// since the leases then still running.
    lease_deadline_max: Micros,
    /// Every armed lease timer (grants, restored and adopted grants, the
    /// unknown grant's horizon), counted by deadline.
    leases: LeaseLedger,
    /// The permit state of keys with a limit (spec §10), by the index an
    /// entry with token [`PERMITS`] keeps in its `owner`.
    permit_keys: slab::Slab<PermitKey>,
    /// The grants of permit keys.
    grants: Grants,
    /// Live grants of this run or adopted, of every kind: inline ones and
    /// `grants` (spec §10.9 `grants_held`).
    grants_held: usize,
    /// The keys and grants restored at start (spec §7.1: even beyond the
    /// limits), for the invariants.
    restored: (usize, usize),
    /// The labels of grants and waiters that have one.
    labels: Labels,
    /// Held observe requests (spec §13).
    watches: Watches,
    /// Records of watches whose key's token changed, to be answered with
    /// that state, oldest first (spec §4: over several turns if need be).
    waking: VecDeque<Waking>,
    /// Permit keys whose head waiter fits but waits for a later turn
    /// (spec §4, v5: a hand-over to many waiters goes on over turns), by
    /// entry, oldest first; see [`PermitKey::handing`](permits::PermitKey).
    handing: VecDeque<u32>,
    /// What is left of this turn's [`TURN_WORK`].
    turn_work: u32,
    /// Per-identity quotas' charges (empty without quotas).
    quotas: quota::Quotas,
    /// What [`can_grant`](Self::can_grant) compares grants plus waiters
    /// with: `--max-grants`, lowered while an `A`/`S` of an identity with
    /// `max-grants=` runs to what its quota leaves room for, so the check
    /// costs the plain path nothing.
    grant_cap: usize,
    next_token: u64,
    /// While this run binds its tokens to their keys (spec §7.3 v5, a
    /// state directory): the secret they are bound with. `None`: tokens
    /// go +1 per grant.
    issue_with: Option<TokenBinding>,
    /// Grants stop (`B`) once `next_token` reaches it: no token may be
    /// `u64::MAX` ([`PERMITS`]).
    token_end: u64,
    /// Adoption (spec §7.3 v5): what an earlier run's tokens are checked
    /// with, the refusals counted, what the state file must record.
    adoption: adoption::Adoption,
    /// While the state file cannot be written (spec §7.6): what it
    /// promises, which no token or lease may pass (see
    /// [`set_ceiling`](Self::set_ceiling)).
    ceiling: Option<restart::Promise>,
    stats: Stats,
    outbox: Vec<Output>,
    /// Work done so far, in units of one table slot examined or one grant
    /// or waiter walked (by `L` and `H`): the endpoint charges it to the
    /// connection whose request did it (spec §4, fairness).
    work: u64,
}

/// A detached record of watches (see [`Watches::detach`]) and the state
/// its watches are answered with.
struct Waking {
    slot: u32,
    generation: u32,
    state: request::KeyState,
}

/// Gives the timer wheel the links embedded in entries, waiters and
/// grants.
struct TimerNodes<'a> {
    table: &'a mut LockTable,
    waiters: &'a mut Waiters,
    grants: &'a mut Grants,
    /// Counts the lease timers (every timer but the waiters').
    leases: &'a mut LeaseLedger,
}

impl TimerStore for TimerNodes<'_> {
    // Inlined into the wheel's `arm` and `cancel` (callgrind_pairs: out of
    // line it cost 45 instructions per request).
    #[inline(always)]
    fn links(&mut self, id: TimerId) -> &mut TimerLinks {
        if id & (WAITER_TIMER | GRANT_TIMER) == 0 {
            &mut self.table.get_mut(id).lease
        } else if id & WAITER_TIMER != 0 {
            &mut self.waiters.get_mut(id & !WAITER_TIMER).timer
        } else {
            &mut self.grants.get_mut(id & !GRANT_TIMER).lease
        }
    }

    #[inline(always)]
    fn armed(&mut self, id: TimerId, deadline: u64) {
        if id & WAITER_TIMER == 0 {
            self.leases.add(deadline);
        }
    }

    #[inline(always)]
    fn disarmed(&mut self, id: TimerId, deadline: u64) {
        if id & WAITER_TIMER == 0 {
            self.leases.remove(deadline);
        }
    }
}

/// Gives the watches' wheel the links embedded in watches.
struct WatchTimers<'a>(&'a mut Watches);

impl TimerStore for WatchTimers<'_> {
    #[inline(always)]
    fn links(&mut self, id: TimerId) -> &mut TimerLinks {
        &mut self.0.get_mut(id).timer
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
            watch_wheel: TimerWheel::new(),
            conns: Vec::new(),
            connections: 0,
            unknown_holders: 0,
            grace_until: 0,
            freed_in_grace: HashSet::default(),
            grace_counted: false,
            counted_grants_made: false,
            first_token: first_token.max(1),
            lease_deadline_max: 0,
            leases: LeaseLedger::new(),
            permit_keys: slab::Slab::new(),
            grants: Grants::default(),
            grants_held: 0,
            restored: (0, 0),
            labels: Labels::default(),
            watches: Watches::default(),
            waking: VecDeque::new(),
            handing: VecDeque::new(),
            turn_work: TURN_WORK,
            quotas: quota::Quotas::default(),
            grant_cap: limits.max_grants,
            next_token: first_token.max(1),
            issue_with: None,
            token_end: u64::MAX,
            adoption: adoption::Adoption::default(),
            ceiling: None,
            stats: Stats::default(),
            outbox: Vec::new(),
            work: 0,
        }
    }

    /// Keys held by a grant of this run (a key with a limit counts once,
    /// however many grants it has).
    pub fn held(&self) -> usize {
        self.table.len() - self.unknown_holders
    }

    /// Live grants of every kind (spec §10.9).
    pub fn grants_held(&self) -> usize {
        self.grants_held
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Work done since the core was made, in slots examined and grants
    /// or waiters walked: the difference across a request is its cost.
    pub fn work(&self) -> u64 {
        self.work
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

    /// Held watches (spec §13).
    pub fn watch_count(&self) -> usize {
        self.watches.len()
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
        if !self.waking.is_empty() || !self.handing.is_empty() {
            // Watches to answer or keys to hand on from an earlier turn:
            // at once.
            return Some(0);
        }
        let next = self.wheel.next_tick();
        if self.watch_wheel.is_empty() {
            return next.map(tick_start);
        }
        next.into_iter()
            .chain(self.watch_wheel.next_tick())
            .min()
            .map(tick_start)
    }

    /// Starts a turn of the event loop: a fresh share of [`TURN_WORK`] for
    /// what requests and timers set off (spec §4, v5).
    pub fn begin_turn(&mut self) {
        self.turn_work = TURN_WORK;
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
                adopter: Adopter::default(),
            };
            self.connections += 1;
            self.stats.connections_accepted += 1;
        }
    }

    /// A connection closed at `now`: its waiters leave their queues
    /// unanswered (which may let waiters behind them on a key with a limit
    /// be granted, spec §10.4). Its grants stay (spec §1).
    pub fn disconnect(&mut self, conn: ConnId, now: Micros) {
        let Some(state) = self.conns.get(conn as usize) else {
            return;
        };
        if !state.open {
            return;
        }
        // Every waiter of the connection leaves first (newest first, the
        // list's order), so that none of them is granted by a queue that
        // moves; then each key they left lets its queue move.
        let mut left = Vec::new();
        let mut waiter = state.waiters.head;
        while waiter != NIL {
            let next = self.waiters.next_of_conn(waiter);
            left.push(self.unlink_waiter(waiter).0);
            waiter = next;
        }
        self.conns[conn as usize].open = false;
        self.connections -= 1;
        self.drop_watches_of(conn);
        for entry in left {
            // A key may be left twice, and gone after the first.
            if self.table.is_live(entry) {
                let watched = self.watched_entry(entry);
                self.waiter_left(entry, Some(now));
                if let Some(slot) = watched {
                    self.wake_watch_slot(slot, now);
                }
            }
        }
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
            self.wheel.catch_up_idle(tick_reached(now));
        }
        match *request {
            // `A` is `S` with limit 0, take 0 and no label (spec §10.1).
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
                limit,
                take,
                label,
            } => {
                let ask = request::Ask {
                    key,
                    wait_s,
                    lease_s,
                    owner,
                    limit,
                    take,
                    label,
                };
                self.acquire(conn, &ask, now)
            }
            Request::Holders { id, key } => self.holders(conn, id, key, now),
            Request::List {
                id,
                cursor,
                count,
                prefix,
            } => self.list(conn, id, cursor, count, prefix, None, now),
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
            Request::Observe {
                wait_s,
                id,
                since,
                key,
            } => self.observe(conn, wait_s, id, since, key, now),
            Request::Query { key } => self.query(conn, key, now),
            Request::Proclaim { token, key, label } => self.proclaim(conn, key, token, label, now),
            Request::Ping { nonce } => self.outbox.push((conn, Response::Pong { nonce })),
            Request::Info => {
                let text = self.info_text(now);
                self.outbox.push((conn, Response::Info(text)));
            }
        }
        // The request's key may have a new token: its watches are
        // answered after the whole request (spec §13.1). One branch while
        // nobody watches anything.
        if !self.watches.is_empty() {
            self.wake_after(request, now);
        }
    }

    /// After `request`: answers the watches of its key if an `A`, `S`,
    /// `R` or `E` changed the key's token.
    #[cold]
    #[inline(never)]
    fn wake_after(&mut self, request: &Request<'_>, now: Micros) {
        if let Request::Acquire { key, .. }
        | Request::Release { key, .. }
        | Request::Extend { key, .. } = *request
        {
            self.wake_watches(key, now);
        }
    }

    /// Evaluates a request of a session with these scopes, which the caller
    /// has checked it against: only `L` differs, listing no key outside
    /// them (spec §12.3).
    pub fn handle_request_within(
        &mut self,
        conn: ConnId,
        request: &Request<'_>,
        scopes: &access::Scopes,
        now: Micros,
    ) {
        match *request {
            Request::List {
                id,
                cursor,
                count,
                prefix,
            } => self.list(conn, id, cursor, count, prefix, Some(scopes), now),
            _ => self.handle_request(conn, request, now),
        }
    }

    /// Evaluates a request of the session of `identity` (its index in the
    /// `--auth` file), within its scopes and charged to its quota.
    pub fn handle_request_as(
        &mut self,
        conn: ConnId,
        request: &Request<'_>,
        index: u32,
        identity: &access::Identity,
        now: Micros,
    ) {
        if identity.quota.is_none() {
            return self.handle_request_within(conn, request, &identity.scopes, now);
        }
        self.handle_request_charged(conn, request, index, identity, now);
    }

    /// [`handle_request_as`](Self::handle_request_as) for an identity with
    /// a quota. `max-keys` is checked and charged where a key is inserted.
    /// `max-grants` is checked by lowering the cap that `--max-grants` is
    /// checked against for this request only (nothing else can change the
    /// grants and waiters before an `A`/`S` checks it), and what the `A`/`S`
    /// made, a grant or a waiter, is charged once it has run.
    #[inline(never)]
    fn handle_request_charged(
        &mut self,
        conn: ConnId,
        request: &Request<'_>,
        index: u32,
        identity: &access::Identity,
        now: Micros,
    ) {
        let quota = identity.quota;
        self.quotas.current = Some(quota::Current {
            identity: index,
            max_keys: quota.max_keys.unwrap_or(quota::NO_QUOTA),
            max_watches: quota.max_watches.unwrap_or(quota::NO_QUOTA),
            max_grants: quota.max_grants.unwrap_or(quota::NO_QUOTA),
        });
        let max_grants = match *request {
            Request::Acquire { key, .. } => quota.max_grants.map(|max| (key, max)),
            _ => None,
        };
        let before = (self.next_token, self.waiters.len());
        if let Some((_, max)) = max_grants {
            let room = max.saturating_sub(self.quotas.grants_of(index)) as usize;
            let total = self.grants_held + self.waiters.len();
            self.grant_cap = self.limits.max_grants.min(total + room);
        }
        self.handle_request_within(conn, request, &identity.scopes, now);
        self.quotas.current = None;
        let Some((key, max)) = max_grants else {
            return;
        };
        self.grant_cap = self.limits.max_grants;
        // An `A`/`S` makes at most one grant (the token `before.0`) or one
        // waiter (at the head of its connection's list); a hand-over it
        // causes on another key makes none.
        let made = if self.next_token != before.0 {
            match self.find_grant(key, self.token_at(key, before.0)) {
                Some(Held::Inline(entry)) => Some(LabelOf::Entry(entry)),
                Some(Held::Listed { grant, .. }) => Some(LabelOf::Grant(grant)),
                None => None,
            }
        } else if self.waiters.len() > before.1 {
            Some(LabelOf::Waiter(self.conns[conn as usize].waiters.head))
        } else {
            None
        };
        debug_assert!(
            made.is_some() || (self.next_token == before.0 && self.waiters.len() <= before.1),
            "an A/S made something that is not charged"
        );
        if let Some(of) = made {
            self.quotas.charge_grant(of, index, max);
        }
    }

    /// Keys in the table charged to identity `index`'s `max-keys`.
    pub fn keys_charged(&self, index: u32) -> u32 {
        self.quotas.keys_of(index)
    }

    /// Grants plus queued waiters charged to identity `index`'s
    /// `max-grants`.
    pub fn grants_charged(&self, index: u32) -> u32 {
        self.quotas.grants_of(index)
    }

    /// Takes `entry` out of the table, uncharging its identity's quota.
    #[inline(always)]
    fn remove_key(&mut self, entry: u32) {
        self.quotas.uncharge_key(entry);
        self.table.remove(entry);
    }

    /// Answers a successful `U` (spec §12.2).
    pub fn send_authenticated(&mut self, conn: ConnId, name: &str) {
        self.outbox.push((
            conn,
            Response::Authenticated {
                name: name.to_owned(),
            },
        ));
    }

    /// Fires every timer due at `now`: lease expiries hand keys on, wait
    /// deadlines answer `T`.
    pub fn handle_timeout(&mut self, now: Micros) {
        self.turn_work = TURN_WORK;
        if !self.waking.is_empty() {
            self.answer_waking();
        }
        self.forget_freed_after_grace(now);
        let now_tick = tick_reached(now);
        if self.watch_wheel.is_empty() {
            self.fire_timers(now_tick, now);
        } else {
            self.fire_timers_and_watches(now_tick, now);
        }
        // After the timers due: a hand-over going on over many turns must
        // not hold back other keys' leases and deadlines (spec §4, v5).
        if !self.handing.is_empty() {
            self.continue_hand_overs(now);
        }
    }

    /// Fires the timers of both wheels due by `now_tick` in the order of
    /// their deadline ticks; on one tick, the leases' and waiters' first,
    /// so that a watch ending then answers with the key's state after
    /// them.
    #[cold]
    #[inline(never)]
    fn fire_timers_and_watches(&mut self, now_tick: u64, now: Micros) {
        loop {
            let tick = self
                .wheel
                .next_tick()
                .into_iter()
                .chain(self.watch_wheel.next_tick())
                .min()
                .map_or(now_tick, |tick| tick.min(now_tick));
            self.fire_timers(tick, now);
            while self.turn_work > 0
                && let Some(watch) = self
                    .watch_wheel
                    .poll(&mut WatchTimers(&mut self.watches), tick)
            {
                self.turn_work -= 1;
                self.watch_deadline(watch, now);
            }
            if tick == now_tick || self.turn_work == 0 {
                return;
            }
        }
    }

    /// Fires the leases' and waiters' timers due by `until` (a tick).
    fn fire_timers(&mut self, until: u64, now: Micros) {
        // Past this turn's work the rest stays due: the wheel's next tick
        // is then in the past and the shell comes back at once.
        while self.turn_work > 0 {
            self.turn_work -= 1;
            let mut nodes = TimerNodes {
                table: &mut self.table,
                waiters: &mut self.waiters,
                grants: &mut self.grants,
                leases: &mut self.leases,
            };
            let Some(id) = self.wheel.poll(&mut nodes, until) else {
                // Nothing fired: the unit is left for the hand-overs.
                self.turn_work += 1;
                break;
            };
            // The key this timer is about, if it is watched: its watches
            // are answered after the whole event (spec §13.1).
            let watched = if self.watches.is_empty() {
                None
            } else if id & GRANT_TIMER != 0 {
                self.watched_entry(self.grants.get(id & !GRANT_TIMER).entry)
            } else if id & WAITER_TIMER != 0 {
                self.watched_entry(self.waiters.get(id & !WAITER_TIMER).lock)
            } else {
                self.watched_entry(id)
            };
            if id & GRANT_TIMER != 0 {
                let grant = id & !GRANT_TIMER;
                let entry = self.grants.get(grant).entry;
                self.end_grant(entry, grant);
                self.stats.expired += 1;
                self.scan_permits(entry, now);
            } else if id & WAITER_TIMER != 0 {
                let waiter = id & !WAITER_TIMER;
                let (conn, owner) = {
                    let node = self.waiters.get(waiter);
                    (node.conn, node.owner)
                };
                self.observe_wait(waiter, now);
                let (entry, _) = self.unlink_waiter(waiter);
                self.stats.timeouts += 1;
                self.outbox.push((conn, Response::Timeout { owner }));
                self.waiter_left(entry, Some(now));
            } else if self.table.get(id).token == PERMITS {
                self.unknown_permits_ended(id, now);
            } else {
                if self.table.get(id).token != 0 {
                    self.stats.expired += 1;
                } else {
                    self.unknown_holders -= 1;
                }
                self.hand_over(id, now);
            }
            if let Some(slot) = watched {
                self.wake_watch_slot(slot, now);
            }
        }
    }

    /// Graceful shutdown (spec §4, §13.3) at `now`: every queued waiter
    /// gets `B`, then every watch its key's state, then every open
    /// connection `X 8`. The shell flushes and closes.
    pub fn shut_down(&mut self, now: Micros) {
        for conn in 0..self.conns.len() {
            if !self.conns[conn].open {
                continue;
            }
            let mut waiter = self.conns[conn].waiters.head;
            while waiter != NIL {
                let next = self.waiters.next_of_conn(waiter);
                let owner = self.waiters.get(waiter).owner;
                let (entry, _) = self.unlink_waiter(waiter);
                // Nobody is granted now: every waiter gets `B`.
                self.waiter_left(entry, None);
                self.stats.busy += 1;
                self.outbox.push((conn as ConnId, Response::Busy { owner }));
                waiter = next;
            }
        }
        if !self.watches.is_empty() {
            for conn in 0..self.conns.len() {
                self.answer_watches_of(conn as ConnId, now);
            }
        }
        // Every watch is answered: what was left to wake names nothing.
        self.waking.clear();
        self.forget_hand_overs();
        for conn in 0..self.conns.len() {
            if self.conns[conn].open {
                self.send_error(conn as ConnId, ErrorCode::ShuttingDown, 0);
            }
        }
    }

    /// The grant of `key` whose token is `token`, if it is live. Token 0
    /// (an unknown holder) never matches.
    #[inline]
    fn find_grant(&self, key: &str, token: u64) -> Option<Held> {
        let entry = self.table.find(key, self.table.hash(key))?;
        let held = self.table.get(entry);
        if held.token == PERMITS {
            return self.find_listed_grant(entry, token);
        }
        (token != 0 && held.token == token).then_some(Held::Inline(entry))
    }

    /// The grant of permit key `entry` whose token is `token` (kept out of
    /// [`find_grant`](Self::find_grant), which the `A` path inlines).
    #[inline(never)]
    fn find_listed_grant(&self, entry: u32, token: u64) -> Option<Held> {
        let permits = self.permit_key(entry);
        let position = permits.position(&self.grants, token)?;
        let grant = permits.grants[position];
        Some(Held::Listed { entry, grant })
    }

    /// The key's holder is gone (its grant ended, or the unknown grant's):
    /// grant the head waiter, or drop the key (remembered as free while the
    /// grace runs). Only for keys without a limit; see
    /// [`scan_permits`](Self::scan_permits) for the others.
    #[inline(always)]
    fn hand_over(&mut self, entry: u32, now: Micros) {
        if self.table.get(entry).token != 0 {
            self.grants_held -= 1;
            // One test for both side maps (`&`, not `&&`).
            if !(self.labels.is_empty() & self.quotas.no_grant_charged()) {
                self.inline_grant_ended(entry);
            }
        }
        loop {
            let Some(head) = self.table.get(entry).waiters.head() else {
                self.note_freed_in_grace(entry, now);
                self.remove_key(entry);
                return;
            };
            let (conn, owner, lease_s) = {
                let waiter = self.waiters.get(head);
                (waiter.conn, waiter.owner, waiter.lease_s)
            };
            self.observe_wait(head, now);
            let charged = self.quotas.uncharge_grant(LabelOf::Waiter(head));
            let (_, label) = self.unlink_waiter(head);
            if !self.may_issue(lease_s, false, now) {
                self.busy(conn, owner);
                continue;
            }
            self.grant(entry, conn, owner, lease_s, label, now);
            // The waiter's charge follows it into its grant.
            return self.quotas.recharge(LabelOf::Entry(entry), charged);
        }
    }

    /// The inline grant of `entry` ended: its label and its quota charge
    /// go.
    #[cold]
    #[inline(never)]
    fn inline_grant_ended(&mut self, entry: u32) {
        self.labels.take(LabelOf::Entry(entry));
        self.quotas.uncharge_grant(LabelOf::Entry(entry));
    }

    /// Grants `entry` (a key without a limit) to `owner` on `conn`.
    fn grant(
        &mut self,
        entry: u32,
        conn: ConnId,
        owner: u64,
        lease_s: u8,
        label: Option<Box<str>>,
        now: Micros,
    ) {
        let token = self.take_token(entry);
        let held = self.table.get_mut(entry);
        held.token = token;
        held.owner = owner;
        self.set_grant_time(entry, now);
        self.arm_lease_at(entry, now + u64::from(lease_s) * MICROS_PER_S);
        self.labels.put(LabelOf::Entry(entry), label);
        self.grants_held += 1;
        self.stats.grants += 1;
        self.outbox
            .push((conn, Response::Acquired { owner, token }));
    }

    /// While the state file cannot be written (spec §7.6), `Some` of the
    /// promise it holds: a grant whose token or lease deadline it does not
    /// cover, or a counted grant it does not allow, gets `B`, and so does
    /// an `E` whose lease would end past its horizon (`B` with the token);
    /// everything else is served. `None` once a write succeeds.
    pub fn set_ceiling(&mut self, ceiling: Option<restart::Promise>) {
        self.ceiling = ceiling;
    }

    /// Whether a grant of `lease_s` (a counted one when `counted`) may be
    /// made at `now`: a token is left, and the state file holds the
    /// promise it needs (see [`set_ceiling`](Self::set_ceiling)).
    #[inline(always)]
    fn may_issue(&self, lease_s: u8, counted: bool, now: Micros) -> bool {
        self.next_token < self.token_end
            && self.ceiling.is_none_or(|ceiling| {
                // The largest token the next grant can get.
                let last = self.next_token | (self.token_step() - 1);
                Self::within(&ceiling, last, lease_s, counted, now)
            })
    }

    /// The token of the next grant, on `entry`'s key: the next one, or
    /// with a state directory the next counter step and its key's MAC
    /// (spec §7.3 v5). Call only when [`may_issue`](Self::may_issue).
    #[inline(always)]
    fn take_token(&mut self, entry: u32) -> u64 {
        let next = self.next_token;
        match &self.issue_with {
            None => {
                self.next_token = next + 1;
                next
            }
            Some(binding) => {
                self.next_token = next + token_binding::STEP;
                let key = self.table.key_bytes(entry);
                next | u64::from(binding.mac16(key, next >> token_binding::MAC_BITS))
            }
        }
    }

    /// The token a grant on `key` got when the next token was `next`.
    fn token_at(&self, key: &str, next: u64) -> u64 {
        match &self.issue_with {
            None => next,
            Some(binding) => binding.token(key.as_bytes(), next >> token_binding::MAC_BITS),
        }
    }

    /// How far apart the tokens of two grants start: 1, or 2^16 while
    /// tokens are bound to their keys.
    pub fn token_step(&self) -> u64 {
        if self.issue_with.is_some() {
            token_binding::STEP
        } else {
            1
        }
    }

    #[cold]
    #[inline(never)]
    fn within(
        ceiling: &restart::Promise,
        last_token: u64,
        lease_s: u8,
        counted: bool,
        now: Micros,
    ) -> bool {
        last_token < ceiling.token_high_water
            && now + u64::from(lease_s) * MICROS_PER_S <= ceiling.horizon
            && (!counted || ceiling.counted_grants)
    }

    /// Records that `entry`'s inline grant was made (or adopted) at `now`,
    /// for `H`.
    fn set_grant_time(&mut self, entry: u32, now: Micros) {
        let queue = &mut self.table.get_mut(entry).waiters;
        self.waiters
            .set_grant_time(queue, waiters::grant_time_ms(now));
    }

    /// The timer wheel and the nodes it links, borrowed together.
    fn timers(&mut self) -> (&mut TimerWheel, TimerNodes<'_>) {
        (
            &mut self.wheel,
            TimerNodes {
                table: &mut self.table,
                waiters: &mut self.waiters,
                grants: &mut self.grants,
                leases: &mut self.leases,
            },
        )
    }

    fn arm_lease_at(&mut self, entry: u32, deadline: Micros) {
        if self.table.get(entry).token != 0 {
            self.lease_deadline_max = self.lease_deadline_max.max(deadline);
        }
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
            grants: &mut self.grants,
            leases: &mut self.leases,
        };
        self.wheel
            .arm(&mut nodes, entry, tick_at_or_after(deadline));
    }

    fn cancel_lease(&mut self, entry: u32) {
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
            grants: &mut self.grants,
            leases: &mut self.leases,
        };
        self.wheel.cancel(&mut nodes, entry);
    }

    /// A waiter left `entry`'s queue without a grant (its deadline, its
    /// connection closed, a shutdown). On a key with a limit the waiters
    /// behind it may fit now (spec §10.4), unless `now` is `None` (a
    /// shutdown, which grants nothing). A key held only by an unknown grant
    /// and waited on by nobody is dropped: it means the same as a key that
    /// is not in the table.
    fn waiter_left(&mut self, entry: u32, now: Option<Micros>) {
        let held = self.table.get(entry);
        if held.token == PERMITS {
            match now {
                Some(now) => self.scan_permits(entry, now),
                None => self.drop_if_idle(entry, 0),
            }
        } else if held.token == 0 && held.waiters.is_empty() {
            self.cancel_lease(entry);
            self.unknown_holders -= 1;
            self.remove_key(entry);
        }
    }

    /// Takes a waiter out of its queue and its connection's list and
    /// returns the entry it queued on and its label.
    fn unlink_waiter(&mut self, waiter: u32) -> (u32, Option<Box<str>>) {
        let mut nodes = TimerNodes {
            table: &mut self.table,
            waiters: &mut self.waiters,
            grants: &mut self.grants,
            leases: &mut self.leases,
        };
        self.wheel.cancel(&mut nodes, waiter | WAITER_TIMER);
        let (conn, entry) = {
            let node = self.waiters.get(waiter);
            (node.conn, node.lock)
        };
        let queue = &mut self.table.get_mut(entry).waiters;
        let conn_list = &mut self.conns[conn as usize].waiters;
        self.waiters.remove(waiter, queue, conn_list);
        self.quotas.uncharge_grant(LabelOf::Waiter(waiter));
        (entry, self.labels.take(LabelOf::Waiter(waiter)))
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
}

/// A live grant, as [`Core::find_grant`] finds it.
enum Held {
    /// The one grant of a key without a limit, inline in its entry.
    Inline(u32),
    /// A grant of a permit key.
    Listed { entry: u32, grant: u32 },
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
