//! A small, obviously correct reference model of the core: an ordered map
//! from key to holder and FIFO queue, with the spec's rules written out as
//! directly as possible. During a restart grace a key that is waited on is
//! held by an unknown grant (token 0) whose lease ends at the horizon; a
//! key neither in the map nor known free is held by it too; an `E` or `R`
//! with a token below the run's first token adopts or frees such a key.
//!
//! One thing the spec leaves open is what happens first when a key's lease
//! and a wait on that key run out at the same 1 ms tick, and in which order
//! grants at one tick take their tokens. The model does not guess: it takes
//! the core's choice from the core's answers and checks that the choice was
//! one of the allowed ones.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use kunci::core::{ConnId, Limits, Micros, Output};
use kunci::protocol::{ErrorCode, Request, RequestError, Response};

use super::fake::{MS, S, binding, parse_info, tick_of};

#[derive(Clone, Debug)]
pub struct Waiter {
    pub conn: ConnId,
    pub owner: u64,
    pub lease_s: u8,
    pub deadline_tick: u64,
}

#[derive(Clone, Debug)]
pub struct Key {
    pub token: u64,
    pub owner: u64,
    pub lease_tick: u64,
    pub queue: VecDeque<Waiter>,
}

#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub grants: u64,
    pub timeouts: u64,
    pub busy: u64,
    pub expired: u64,
    pub released: u64,
    pub extended: u64,
    pub not_held: u64,
    pub errors: u64,
}

pub struct Model {
    pub limits: Limits,
    pub keys: BTreeMap<String, Key>,
    pub next_token: u64,
    /// Open connections, each with the number of waits it has queued.
    pub conns: BTreeMap<ConnId, u32>,
    pub counters: Counters,
    /// The restart grace's horizon (0: none).
    pub grace_until: Micros,
    /// Keys known free during the grace though not in the map.
    pub freed: BTreeSet<String>,
    /// Tokens below this are an earlier run's.
    pub first_token: u64,
    /// How often a wait ran out at the tick its key's lease did, and the
    /// core let the wait go first.
    pub ties: u64,
    /// Watches held (spec §13) by connection: kept by the simulation,
    /// which checks the watches' answers itself; they count toward the
    /// wait limits here.
    pub watches: BTreeMap<ConnId, u32>,
    /// While the core binds its tokens to their keys (spec §7.3 v5): with
    /// [`binding`]; `next_token` then goes 2^16 per grant.
    pub bound: bool,
    /// No earlier token above it adopts (the state file's `macs_until`);
    /// an earlier run's tokens are checked with [`binding`].
    pub adoptable_until: u64,
    /// Adoption tries refused in this grace (every connection of the
    /// fake core is one adopter).
    pub refused: std::cell::Cell<u8>,
}

impl Model {
    pub fn new(limits: Limits, first_token: u64) -> Model {
        Model {
            limits,
            keys: BTreeMap::new(),
            next_token: first_token.max(1),
            conns: BTreeMap::new(),
            counters: Counters::default(),
            grace_until: 0,
            freed: BTreeSet::new(),
            first_token: first_token.max(1),
            ties: 0,
            watches: BTreeMap::new(),
            bound: false,
            adoptable_until: 0,
            refused: std::cell::Cell::new(0),
        }
    }

    /// A model of a core that binds its tokens (`Core::bind_tokens` with
    /// [`binding`] and a clock at `first_token`).
    pub fn bound(limits: Limits, first_token: u64) -> Model {
        let first = kunci::core::token_binding::step_at_or_above(first_token);
        Model {
            bound: true,
            ..Model::new(limits, first)
        }
    }

    pub fn connect(&mut self, conn: ConnId) {
        self.conns.entry(conn).or_insert(0);
    }

    /// Watches held in all.
    pub fn watch_count(&self) -> usize {
        self.watches.values().map(|&n| n as usize).sum()
    }

    /// Whether one more queued acquire of `conn` fits within
    /// `--max-waiters` and `--max-waits-per-conn` (watches count in
    /// neither, spec §13.3 v5).
    pub fn wait_fits(&self, conn: ConnId) -> bool {
        let of_conn = self.conns.get(&conn).copied().unwrap_or(0);
        self.waiters() < self.limits.max_waiters && of_conn < self.limits.max_waits_per_conn
    }

    /// Whether one more watch of `conn` fits within `--max-watches` and
    /// `--max-watches-per-conn`.
    pub fn watch_fits(&self, conn: ConnId) -> bool {
        let of_conn = self.watches.get(&conn).copied().unwrap_or(0);
        self.watch_count() < self.limits.max_watches && of_conn < self.limits.max_watches_per_conn
    }

    pub fn disconnect(&mut self, conn: ConnId) {
        self.watches.remove(&conn);
        if self.conns.remove(&conn).is_some() {
            for key in self.keys.values_mut() {
                key.queue.retain(|waiter| waiter.conn != conn);
            }
            self.drop_unknown_holders();
        }
    }

    /// A key held by an unknown grant that nobody waits on any more means
    /// the same as a key not in the table.
    fn drop_unknown_holders(&mut self) {
        self.keys
            .retain(|_, key| key.token != 0 || !key.queue.is_empty());
    }

    /// A grant restored at a clean restart.
    pub fn restore(&mut self, key: &str, token: u64, owner: u64, lease_tick: u64) {
        let restored = Key {
            token,
            owner,
            lease_tick,
            queue: VecDeque::new(),
        };
        assert!(self.keys.insert(key.to_owned(), restored).is_none());
    }

    /// Graceful shutdown: every waiter gets `B`, every connection `X 8`
    /// (in no particular order between connections).
    pub fn shut_down(&mut self) -> Vec<Output> {
        let mut out = Vec::new();
        for held in self.keys.values_mut() {
            for waiter in held.queue.drain(..) {
                self.counters.busy += 1;
                *self.conns.get_mut(&waiter.conn).unwrap() -= 1;
                out.push((
                    waiter.conn,
                    Response::Busy {
                        owner: waiter.owner,
                    },
                ));
            }
        }
        self.drop_unknown_holders();
        self.watches.clear();
        for &conn in self.conns.keys() {
            self.counters.errors += 1;
            out.push((conn, ErrorCode::ShuttingDown.response(0)));
        }
        out
    }

    /// Whether `key` counts as held by the unknown grant of an earlier run.
    fn unknown_holder(&self, key: &str, now: Micros) -> bool {
        match self.keys.get(key) {
            Some(held) => held.token == 0,
            None => now < self.grace_until && !self.freed.contains(key),
        }
    }

    /// Whether `token` adopts `key` (spec §7.3): the earlier run bound it
    /// to `key` with [`binding`], at most 16 tries refused per grace.
    fn adopts(&self, key: &str, token: u64, now: Micros) -> bool {
        if token == 0 || token >= self.first_token || !self.unknown_holder(key, now) {
            return false;
        }
        if self.refused.get() >= 16 {
            return false;
        }
        let passes = token <= self.adoptable_until && binding().verify(key.as_bytes(), token);
        if !passes {
            self.refused.set(self.refused.get() + 1);
        }
        passes
    }

    fn note_freed(&mut self, key: &str, now: Micros) {
        if now < self.grace_until && self.freed.len() < self.limits.max_keys {
            self.freed.insert(key.to_owned());
        }
    }

    pub fn waiters(&self) -> usize {
        self.keys.values().map(|key| key.queue.len()).sum()
    }

    pub fn holder_token(&self, key: &str) -> Option<u64> {
        self.keys.get(key).map(|key| key.token)
    }

    /// The earliest tick at which something is due.
    pub fn earliest_tick(&self) -> Option<u64> {
        self.keys
            .values()
            .flat_map(|key| {
                std::iter::once(key.lease_tick)
                    .chain(key.queue.iter().map(|waiter| waiter.deadline_tick))
            })
            .min()
    }

    pub fn invalid(&mut self, conn: ConnId, error: RequestError) -> Vec<Output> {
        self.counters.errors += 1;
        vec![(conn, error.response())]
    }

    /// The answers to `request` from `conn` at `now`, in order.
    pub fn request(&mut self, conn: ConnId, request: &Request<'_>, now: Micros) -> Vec<Output> {
        match *request {
            // The core serves permits (§10) and holders/listing (§11) in
            // a later change; until then it answers as below.
            Request::Acquire {
                owner, limit, take, ..
            } if limit != 0 || take != 0 => {
                self.counters.busy += 1;
                vec![(conn, Response::Busy { owner })]
            }
            Request::Holders { id, .. } | Request::List { id, .. } => {
                self.counters.errors += 1;
                vec![(conn, ErrorCode::NotPermitted.response(id))]
            }
            Request::Observe { .. } | Request::Proclaim { .. } => {
                unimplemented!("the model keeps no watches or labels yet")
            }
            Request::Authenticate { .. } => vec![(
                conn,
                Response::Authenticated {
                    name: String::new(),
                },
            )],
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
                ..
            } => {
                let wait_fits = self.wait_fits(conn);
                if let Some(held) = self.keys.get_mut(key) {
                    if wait_s == 0 {
                        self.counters.timeouts += 1;
                        return vec![(conn, Response::Timeout { owner })];
                    }
                    let fits =
                        wait_fits && held.queue.len() < self.limits.max_waiters_per_key as usize;
                    if !fits {
                        self.counters.busy += 1;
                        return vec![(conn, Response::Busy { owner })];
                    }
                    held.queue.push_back(Waiter {
                        conn,
                        owner,
                        lease_s,
                        deadline_tick: tick_of(now + u64::from(wait_s) * S),
                    });
                    *self.conns.get_mut(&conn).unwrap() += 1;
                    return vec![];
                }
                if now < self.grace_until && !self.freed.contains(key) {
                    // Held by an unknown grant until the horizon.
                    if wait_s == 0 {
                        self.counters.timeouts += 1;
                        return vec![(conn, Response::Timeout { owner })];
                    }
                    let fits = wait_fits
                        && self.limits.max_waiters_per_key > 0
                        && self.keys.len() < self.limits.max_keys;
                    if !fits {
                        self.counters.busy += 1;
                        return vec![(conn, Response::Busy { owner })];
                    }
                    let queue = VecDeque::from([Waiter {
                        conn,
                        owner,
                        lease_s,
                        deadline_tick: tick_of(now + u64::from(wait_s) * S),
                    }]);
                    self.keys.insert(
                        key.to_owned(),
                        Key {
                            token: 0,
                            owner: 0,
                            lease_tick: tick_of(self.grace_until),
                            queue,
                        },
                    );
                    *self.conns.get_mut(&conn).unwrap() += 1;
                    return vec![];
                }
                if self.keys.len() >= self.limits.max_keys {
                    self.counters.busy += 1;
                    return vec![(conn, Response::Busy { owner })];
                }
                let token = self.take_token(key);
                self.keys.insert(
                    key.to_owned(),
                    Key {
                        token,
                        owner,
                        lease_tick: tick_of(now + u64::from(lease_s) * S),
                        queue: VecDeque::new(),
                    },
                );
                vec![(conn, Response::Acquired { owner, token })]
            }
            Request::Release { token, key } if self.adopts(key, token, now) => {
                self.counters.released += 1;
                let mut out = vec![(conn, Response::Released { token })];
                if self.keys.contains_key(key) {
                    out.extend(self.hand_over(key, now));
                } else {
                    self.note_freed(key, now);
                }
                out
            }
            Request::Extend {
                lease_s,
                token,
                key,
            } if self.adopts(key, token, now) => {
                let lease_tick = tick_of(now + u64::from(lease_s) * S);
                // Charged like a grant (spec §7.3 v5): `B` with the token
                // when the limits leave no room.
                let grants = self.keys.values().filter(|held| held.token != 0).count();
                let waiters: usize = self.keys.values().map(|held| held.queue.len()).sum();
                let grant_room = grants + waiters < self.limits.max_grants;
                let key_room = self.keys.len() < self.limits.max_keys;
                match self.keys.get_mut(key) {
                    Some(held) if grant_room => {
                        held.token = token;
                        held.owner = 0;
                        held.lease_tick = lease_tick;
                    }
                    None if grant_room && key_room => {
                        self.restore(key, token, 0, lease_tick);
                    }
                    _ => {
                        self.counters.busy += 1;
                        return vec![(conn, Response::Busy { owner: token })];
                    }
                }
                self.counters.extended += 1;
                vec![(conn, Response::Extended { token })]
            }
            Request::Release { token, key } => {
                if self.holder_token(key) != Some(token) || token == 0 {
                    self.counters.not_held += 1;
                    return vec![(conn, Response::NotHeld { token })];
                }
                self.counters.released += 1;
                let mut out = vec![(conn, Response::Released { token })];
                out.extend(self.hand_over(key, now));
                out
            }
            Request::Extend {
                lease_s,
                token,
                key,
            } => {
                if self.holder_token(key) != Some(token) || token == 0 {
                    self.counters.not_held += 1;
                    return vec![(conn, Response::NotHeld { token })];
                }
                self.counters.extended += 1;
                self.keys.get_mut(key).unwrap().lease_tick = tick_of(now + u64::from(lease_s) * S);
                vec![(conn, Response::Extended { token })]
            }
            Request::Query { key } => {
                let to_horizon = self.grace_until.saturating_sub(now).div_ceil(MS) as u32;
                let response = match self.keys.get(key) {
                    Some(held) => Response::Query {
                        token: held.token,
                        owner: held.owner,
                        lease_ms: if held.token == 0 {
                            to_horizon
                        } else {
                            lease_ms_left(held.lease_tick, now)
                        },
                        waiters: held.queue.len() as u32,
                    },
                    None if self.unknown_holder(key, now) => Response::Query {
                        token: 0,
                        owner: 0,
                        lease_ms: to_horizon,
                        waiters: 0,
                    },
                    None => Response::Query {
                        token: 0,
                        owner: 0,
                        lease_ms: 0,
                        waiters: 0,
                    },
                };
                vec![(conn, response)]
            }
            Request::Ping { nonce } => vec![(conn, Response::Pong { nonce })],
            Request::Info => vec![(conn, Response::Info(self.info_text(now)))],
        }
    }

    fn take_token(&mut self, key: &str) -> u64 {
        let token = self.token_at(key, 0);
        self.next_token += self.step();
        self.counters.grants += 1;
        token
    }

    fn step(&self) -> u64 {
        if self.bound {
            kunci::core::token_binding::STEP
        } else {
            1
        }
    }

    /// The token of the `i`th grant from now on `key`.
    fn token_at(&self, key: &str, i: u64) -> u64 {
        let next = self.next_token + i * self.step();
        if self.bound {
            binding().token(key.as_bytes(), next >> kunci::core::token_binding::MAC_BITS)
        } else {
            next
        }
    }

    /// The holder of `key` is gone at `now`: the head waiter gets it, or
    /// the key goes.
    fn hand_over(&mut self, key: &str, now: Micros) -> Option<Output> {
        let Some(waiter) = self.keys.get_mut(key).unwrap().queue.pop_front() else {
            self.keys.remove(key);
            self.note_freed(key, now);
            return None;
        };
        *self.conns.get_mut(&waiter.conn).unwrap() -= 1;
        let token = self.take_token(key);
        let held = self.keys.get_mut(key).unwrap();
        held.token = token;
        held.owner = waiter.owner;
        held.lease_tick = tick_of(now + u64::from(waiter.lease_s) * S);
        Some((
            waiter.conn,
            Response::Acquired {
                owner: waiter.owner,
                token,
            },
        ))
    }

    /// The spec's `I` names with the values the model expects.
    pub fn info_text(&self, now: Micros) -> String {
        let c = &self.counters;
        format!(
            "uptime_s={} connections={} keys={} held={} waiters={} grants={} timeouts={} \
             busy={} expired={} released={} extended={} not_held={} errors={} next_token={} \
             watches={}",
            now / S,
            self.conns.len(),
            self.keys.len(),
            self.keys.values().filter(|key| key.token != 0).count(),
            self.waiters(),
            c.grants,
            c.timeouts,
            c.busy,
            c.expired,
            c.released,
            c.extended,
            c.not_held,
            c.errors,
            self.next_token,
            self.watch_count(),
        )
    }

    /// Fires what is due at `now` — everything whose tick is at or before
    /// `now`'s, tick by tick — and returns the expected answers (in no
    /// particular order). `core_out` is what the core answered to the same
    /// call: the model takes from it only the choices the spec leaves open
    /// (see the module docs), and checks them.
    pub fn timeout(&mut self, now: Micros, core_out: &[Output]) -> Result<Vec<Output>, String> {
        let now_tick = now / MS;
        let granted: HashMap<u64, u64> = core_out
            .iter()
            .filter_map(|(_, response)| match *response {
                Response::Acquired { owner, token } => Some((owner, token)),
                _ => None,
            })
            .collect();
        let mut expected = Vec::new();
        // (tick, token) of every hand-over grant.
        let mut grants = Vec::new();
        while let Some(tick) = self.earliest_tick().filter(|&tick| tick <= now_tick) {
            let expiring: Vec<String> = self
                .keys
                .iter()
                .filter(|(_, key)| key.lease_tick == tick)
                .map(|(name, _)| name.clone())
                .collect();
            let Model {
                keys,
                conns,
                counters,
                ties,
                freed,
                grace_until,
                limits,
                ..
            } = self;
            for name in expiring {
                let held = keys.get_mut(&name).unwrap();
                if held.token != 0 {
                    counters.expired += 1;
                }
                // Waits that run out at this same tick may go first; any
                // other waiter ahead of the one granted is a FIFO violation.
                let first_granted = held
                    .queue
                    .iter()
                    .position(|waiter| granted.contains_key(&waiter.owner))
                    .unwrap_or(held.queue.len());
                for _ in 0..first_granted {
                    let waiter = held.queue.pop_front().unwrap();
                    if waiter.deadline_tick != tick {
                        return Err(format!(
                            "lease of {name:?} ran out at tick {tick}, but its head waiter \
                             {} (deadline tick {}) was not granted",
                            waiter.owner, waiter.deadline_tick
                        ));
                    }
                    *ties += 1;
                    counters.timeouts += 1;
                    *conns.get_mut(&waiter.conn).unwrap() -= 1;
                    expected.push((
                        waiter.conn,
                        Response::Timeout {
                            owner: waiter.owner,
                        },
                    ));
                }
                match held.queue.pop_front() {
                    Some(waiter) => {
                        let token = granted[&waiter.owner];
                        counters.grants += 1;
                        *conns.get_mut(&waiter.conn).unwrap() -= 1;
                        held.token = token;
                        held.owner = waiter.owner;
                        held.lease_tick = tick_of(now + u64::from(waiter.lease_s) * S);
                        grants.push((tick, token, name.clone()));
                        expected.push((
                            waiter.conn,
                            Response::Acquired {
                                owner: waiter.owner,
                                token,
                            },
                        ));
                    }
                    None => {
                        keys.remove(&name);
                        if now < *grace_until && freed.len() < limits.max_keys {
                            freed.insert(name);
                        }
                    }
                }
            }
            for held in keys.values_mut() {
                held.queue.retain(|waiter| {
                    if waiter.deadline_tick != tick {
                        return true;
                    }
                    counters.timeouts += 1;
                    *conns.get_mut(&waiter.conn).unwrap() -= 1;
                    expected.push((
                        waiter.conn,
                        Response::Timeout {
                            owner: waiter.owner,
                        },
                    ));
                    false
                });
            }
            keys.retain(|_, key| key.token != 0 || !key.queue.is_empty());
        }
        // Hand-over tokens continue the sequence, earlier ticks first.
        grants.sort_by_key(|&(_, token, _)| token);
        for (i, (tick, token, name)) in grants.iter().enumerate() {
            let (tick, token) = (*tick, *token);
            if token != self.token_at(name, i as u64) {
                return Err(format!(
                    "hand-over tokens {grants:?} do not continue from {}",
                    self.next_token
                ));
            }
            if i > 0 && grants[i - 1].0 > tick {
                return Err(format!("hand-over tokens {grants:?} not in tick order"));
            }
        }
        self.next_token += grants.len() as u64 * self.step();
        Ok(expected)
    }
}

/// What `Q` shows for a lease that runs out at `lease_tick`: the time from
/// `now` to the earliest deadline that rounds up to that tick, rounded up.
/// It is never more than the exact time left, and at most 1 ms less.
pub fn lease_ms_left(lease_tick: u64, now: Micros) -> u32 {
    let earliest = (lease_tick * MS).saturating_sub(MS - 1);
    earliest.saturating_sub(now).div_ceil(MS) as u32
}

/// Compares answers that must come in this order. An `I` text matches when
/// every pair the model names has the same value in the core's text.
pub fn same_in_order(core: &[Output], model: &[Output]) -> Result<(), String> {
    let mismatch = || Err(format!("core answered {core:?}, the model {model:?}"));
    if core.len() != model.len() {
        return mismatch();
    }
    for (got, want) in core.iter().zip(model) {
        match (got, want) {
            ((to, Response::Info(text)), (want_to, Response::Info(want_text))) => {
                let pairs = parse_info(text);
                if to != want_to || !pairs.contains_key("version") {
                    return mismatch();
                }
                for (name, value) in parse_info(want_text) {
                    if pairs.get(&name) != Some(&value) {
                        return Err(format!("I: {name}={value} expected in {text:?}"));
                    }
                }
            }
            _ if got == want => {}
            _ => return mismatch(),
        }
    }
    Ok(())
}

/// Compares answers whose order is free (all fired in one `handle_timeout`).
pub fn same_as_multiset(core: &[Output], model: &[Output]) -> Result<(), String> {
    let sorted = |outputs: &[Output]| {
        let mut lines: Vec<String> = outputs.iter().map(|output| format!("{output:?}")).collect();
        lines.sort();
        lines
    };
    let (got, want) = (sorted(core), sorted(model));
    if got == want {
        Ok(())
    } else {
        Err(format!("core fired {got:?}, the model {want:?}"))
    }
}

// ---- permits (spec §10) ---------------------------------------------------------

/// A grant of the permit model.
#[derive(Clone, Debug)]
pub struct PermitGrant {
    pub token: u64,
    pub owner: u64,
    /// 0 = all (exclusive).
    pub take: u16,
    pub lease_tick: u64,
}

#[derive(Clone, Debug)]
pub struct PermitWaiter {
    pub conn: ConnId,
    pub owner: u64,
    pub take: u16,
    pub lease_s: u8,
    pub deadline_tick: u64,
    /// Arrival order across all keys (a connection's waiters leave, when
    /// it closes, newest first).
    pub seq: u64,
}

#[derive(Clone, Debug, Default)]
pub struct PermitKey {
    /// None until a request names one; gone with the key.
    pub limit: Option<u16>,
    /// In token order.
    pub grants: Vec<PermitGrant>,
    pub queue: VecDeque<PermitWaiter>,
}

impl PermitKey {
    /// Spec §10.3, written out.
    pub fn fits(&self, take: u16) -> bool {
        if take == 0 {
            return self.grants.is_empty();
        }
        let exclusive = self.grants.iter().any(|grant| grant.take == 0);
        let used: u32 = self.grants.iter().map(|grant| u32::from(grant.take)).sum();
        let limit = self.limit.map_or(0, u32::from);
        !exclusive && used + u32::from(take) <= limit
    }
}

/// The reference model of keys with permits (and plain `A`, which is `S`
/// with limit 0 and take 0), without restarts: every key, its limit, its
/// grants in token order and its FIFO queue, with spec §10's rules as
/// plainly as they can be written. Where the spec leaves the order of
/// events at one tick open, [`PermitModel::timeout`] tries every order
/// and keeps the one that gives exactly the core's answers, so the fit
/// rule, FIFO and the tokens of every grant are still checked exactly.
#[derive(Clone, Debug)]
pub struct PermitModel {
    pub limits: Limits,
    pub keys: BTreeMap<String, PermitKey>,
    pub next_token: u64,
    pub conns: BTreeMap<ConnId, u32>,
    pub counters: Counters,
    seq: u64,
}

impl PermitModel {
    pub fn new(limits: Limits, first_token: u64) -> PermitModel {
        PermitModel {
            limits,
            keys: BTreeMap::new(),
            next_token: first_token,
            conns: BTreeMap::new(),
            counters: Counters::default(),
            seq: 0,
        }
    }

    pub fn connect(&mut self, conn: ConnId) {
        self.conns.entry(conn).or_insert(0);
    }

    pub fn grants_held(&self) -> usize {
        self.keys.values().map(|key| key.grants.len()).sum()
    }

    pub fn waiters(&self) -> usize {
        self.keys.values().map(|key| key.queue.len()).sum()
    }

    /// Every live grant: (key, token).
    pub fn live(&self) -> Vec<(String, u64)> {
        self.keys
            .iter()
            .flat_map(|(name, key)| key.grants.iter().map(|grant| (name.clone(), grant.token)))
            .collect()
    }

    pub fn earliest_tick(&self) -> Option<u64> {
        self.keys
            .values()
            .flat_map(|key| {
                key.grants
                    .iter()
                    .map(|grant| grant.lease_tick)
                    .chain(key.queue.iter().map(|waiter| waiter.deadline_tick))
            })
            .min()
    }

    fn grant(
        &mut self,
        name: &str,
        conn: ConnId,
        owner: u64,
        take: u16,
        lease_s: u8,
        now: Micros,
    ) -> Output {
        let token = self.next_token;
        self.next_token += 1;
        self.counters.grants += 1;
        self.keys
            .get_mut(name)
            .expect("granted on a key in the map")
            .grants
            .push(PermitGrant {
                token,
                owner,
                take,
                lease_tick: tick_of(now + u64::from(lease_s) * S),
            });
        (conn, Response::Acquired { owner, token })
    }

    /// Spec §10.4: the head is granted while it fits; a head that does not
    /// fit stops the scan. A key left with nothing leaves the map.
    fn scan(&mut self, name: &str, now: Micros) -> Vec<Output> {
        let mut out = Vec::new();
        loop {
            let key = &self.keys[name];
            let Some(head) = key.queue.front() else {
                if key.grants.is_empty() {
                    self.keys.remove(name);
                }
                return out;
            };
            if !key.fits(head.take) {
                return out;
            }
            let head = self.keys.get_mut(name).unwrap().queue.pop_front().unwrap();
            *self.conns.get_mut(&head.conn).unwrap() -= 1;
            out.push(self.grant(name, head.conn, head.owner, head.take, head.lease_s, now));
        }
    }

    pub fn invalid(&mut self, conn: ConnId, error: RequestError) -> Vec<Output> {
        self.counters.errors += 1;
        vec![(conn, error.response())]
    }

    pub fn request(&mut self, conn: ConnId, request: &Request<'_>, now: Micros) -> Vec<Output> {
        match *request {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key: name,
                limit,
                take,
                ..
            } => {
                let busy = |model: &mut PermitModel| {
                    model.counters.busy += 1;
                    vec![(conn, Response::Busy { owner })]
                };
                let room = self.grants_held() + self.waiters() < self.limits.max_grants;
                let Some(key) = self.keys.get(name) else {
                    if !room || self.keys.len() >= self.limits.max_keys {
                        return busy(self);
                    }
                    let key = PermitKey {
                        limit: (limit != 0).then_some(limit),
                        ..PermitKey::default()
                    };
                    self.keys.insert(name.to_owned(), key);
                    return vec![self.grant(name, conn, owner, take, lease_s, now)];
                };
                if let Some(key_limit) = key
                    .limit
                    .filter(|&key_limit| limit != 0 && limit != key_limit)
                {
                    self.counters.errors += 1;
                    return vec![(conn, Response::limit_mismatch(owner, key_limit))];
                }
                if key.queue.is_empty() && key.fits(take) {
                    if !room {
                        return busy(self);
                    }
                    return vec![self.grant(name, conn, owner, take, lease_s, now)];
                }
                if wait_s == 0 {
                    self.counters.timeouts += 1;
                    return vec![(conn, Response::Timeout { owner })];
                }
                let can_queue = self.waiters() < self.limits.max_waiters
                    && key.queue.len() < self.limits.max_waiters_per_key as usize
                    && self.conns[&conn] < self.limits.max_waits_per_conn
                    && room;
                if !can_queue {
                    return busy(self);
                }
                self.seq += 1;
                let seq = self.seq;
                let key = self.keys.get_mut(name).unwrap();
                if limit != 0 {
                    key.limit.get_or_insert(limit);
                }
                key.queue.push_back(PermitWaiter {
                    conn,
                    owner,
                    take,
                    lease_s,
                    deadline_tick: tick_of(now + u64::from(wait_s) * S),
                    seq,
                });
                *self.conns.get_mut(&conn).unwrap() += 1;
                vec![]
            }
            Request::Release { token, key: name } => {
                let Some(at) = self.find(name, token) else {
                    self.counters.not_held += 1;
                    return vec![(conn, Response::NotHeld { token })];
                };
                self.keys.get_mut(name).unwrap().grants.remove(at);
                self.counters.released += 1;
                let mut out = vec![(conn, Response::Released { token })];
                out.extend(self.scan(name, now));
                out
            }
            Request::Extend {
                lease_s,
                token,
                key: name,
            } => {
                let Some(at) = self.find(name, token) else {
                    self.counters.not_held += 1;
                    return vec![(conn, Response::NotHeld { token })];
                };
                self.keys.get_mut(name).unwrap().grants[at].lease_tick =
                    tick_of(now + u64::from(lease_s) * S);
                self.counters.extended += 1;
                vec![(conn, Response::Extended { token })]
            }
            Request::Query { key: name } => {
                let response = match self
                    .keys
                    .get(name)
                    .and_then(|key| Some((key, key.grants.first()?)))
                {
                    Some((key, first)) => Response::Query {
                        token: first.token,
                        owner: first.owner,
                        lease_ms: lease_ms_left(first.lease_tick, now),
                        waiters: key.queue.len() as u32,
                    },
                    None => Response::Query {
                        token: 0,
                        owner: 0,
                        lease_ms: 0,
                        waiters: 0,
                    },
                };
                vec![(conn, response)]
            }
            Request::Ping { nonce } => vec![(conn, Response::Pong { nonce })],
            Request::Info => vec![(conn, Response::Info(self.info_text(now)))],
            ref other => panic!("the permit model does not take {other:?}"),
        }
    }

    fn find(&self, name: &str, token: u64) -> Option<usize> {
        self.keys
            .get(name)?
            .grants
            .iter()
            .position(|grant| grant.token == token)
    }

    /// A connection closed: its waiters leave, and each key they left lets
    /// its queue move, newest waiter's key first (the order of the core's
    /// list).
    pub fn disconnect(&mut self, conn: ConnId, now: Micros) -> Vec<Output> {
        if self.conns.remove(&conn).is_none() {
            return vec![];
        }
        let mut mine: Vec<(u64, String)> = self
            .keys
            .iter()
            .flat_map(|(name, key)| {
                key.queue
                    .iter()
                    .filter(|waiter| waiter.conn == conn)
                    .map(|waiter| (waiter.seq, name.clone()))
            })
            .collect();
        mine.sort_by_key(|&(seq, _)| std::cmp::Reverse(seq));
        // All of them leave before any queue moves (none of them may be
        // granted); then the keys they left, in that order, once each.
        for key in self.keys.values_mut() {
            key.queue.retain(|waiter| waiter.conn != conn);
        }
        let mut out = Vec::new();
        let mut scanned = BTreeSet::new();
        for (_, name) in mine {
            if scanned.insert(name.clone()) && self.keys.contains_key(&name) {
                out.extend(self.scan(&name, now));
            }
        }
        out
    }

    pub fn shut_down(&mut self) -> Vec<Output> {
        let mut out = Vec::new();
        for key in self.keys.values_mut() {
            for waiter in key.queue.drain(..) {
                self.counters.busy += 1;
                out.push((
                    waiter.conn,
                    Response::Busy {
                        owner: waiter.owner,
                    },
                ));
            }
        }
        for (&conn, queued) in self.conns.iter_mut() {
            *queued = 0;
            self.counters.errors += 1;
            out.push((conn, ErrorCode::ShuttingDown.response(0)));
        }
        out
    }

    pub fn info_text(&self, now: Micros) -> String {
        let c = &self.counters;
        format!(
            "uptime_s={} connections={} keys={} held={} waiters={} grants={} timeouts={} \
             busy={} expired={} released={} extended={} not_held={} errors={} \
             grants_held={} next_token={}",
            now / S,
            self.conns.len(),
            self.keys.len(),
            self.keys
                .values()
                .filter(|key| !key.grants.is_empty())
                .count(),
            self.waiters(),
            c.grants,
            c.timeouts,
            c.busy,
            c.expired,
            c.released,
            c.extended,
            c.not_held,
            c.errors,
            self.grants_held(),
            self.next_token,
        )
    }

    /// Fires everything due at `now`, tick by tick. Within one tick the
    /// spec leaves the order of expiries and wait deadlines open, and it
    /// decides who is granted and which token each grant gets: every order
    /// is tried, and the model takes the one whose answers are exactly the
    /// core's (as a multiset: `core_out`). Fails if none is.
    pub fn timeout(&mut self, now: Micros, core_out: &[Output]) -> Result<Vec<Output>, String> {
        let mut budget: BTreeMap<String, usize> = BTreeMap::new();
        for output in core_out {
            *budget.entry(format!("{output:?}")).or_default() += 1;
        }
        let mut tries = 0u32;
        match self.fire_from(now, &budget, Vec::new(), &mut tries) {
            Some((model, out)) => {
                *self = model;
                Ok(out)
            }
            None => Err(format!(
                "no order of the events due by {now} gives the core's answers {core_out:?} \
                 ({tries} orders tried)"
            )),
        }
    }

    fn fire_from(
        &self,
        now: Micros,
        budget: &BTreeMap<String, usize>,
        out: Vec<Output>,
        tries: &mut u32,
    ) -> Option<(PermitModel, Vec<Output>)> {
        let Some(tick) = self.earliest_tick().filter(|&tick| tick <= now / MS) else {
            let produced = out.len();
            let expected: usize = budget.values().sum();
            return (produced == expected).then(|| (self.clone(), out));
        };
        // The events due at this tick: (key, Some(token)) for a lease,
        // (key, None) with the waiter's owner for a wait.
        let mut events: Vec<(String, Option<u64>, u64)> = Vec::new();
        for (name, key) in &self.keys {
            for grant in key.grants.iter().filter(|grant| grant.lease_tick == tick) {
                events.push((name.clone(), Some(grant.token), 0));
            }
            for waiter in key
                .queue
                .iter()
                .filter(|waiter| waiter.deadline_tick == tick)
            {
                events.push((name.clone(), None, waiter.owner));
            }
        }
        // Every order, lexicographically, made one at a time: n! of them
        // at once would not fit in memory past n = 10.
        let mut order: Vec<usize> = (0..events.len()).collect();
        loop {
            *tries += 1;
            if *tries > 200_000 {
                return None;
            }
            let mut model = self.clone();
            let mut more = Vec::new();
            for &index in &order {
                let (name, token, owner) = &events[index];
                more.extend(model.fire_one(name, *token, *owner, now));
            }
            let mut all = out.clone();
            all.extend(more);
            if within(&all, budget) {
                if let Some(found) = model.fire_from(now, budget, all, tries) {
                    return Some(found);
                }
            }
            if !next_order(&mut order) {
                return None;
            }
        }
    }

    fn fire_one(&mut self, name: &str, token: Option<u64>, owner: u64, now: Micros) -> Vec<Output> {
        let Some(key) = self.keys.get_mut(name) else {
            return vec![];
        };
        let mut out = Vec::new();
        match token {
            Some(token) => {
                let Some(at) = key.grants.iter().position(|grant| grant.token == token) else {
                    return vec![];
                };
                key.grants.remove(at);
                self.counters.expired += 1;
            }
            None => {
                // Granted (or gone) earlier in this same tick: nothing fires.
                let Some(at) = key.queue.iter().position(|waiter| waiter.owner == owner) else {
                    return vec![];
                };
                let waiter = key.queue.remove(at).unwrap();
                *self.conns.get_mut(&waiter.conn).unwrap() -= 1;
                self.counters.timeouts += 1;
                out.push((waiter.conn, Response::Timeout { owner }));
            }
        }
        out.extend(self.scan(name, now));
        out
    }
}

/// Turns `order` into the next one in lexicographic order; false after
/// the last.
fn next_order(order: &mut [usize]) -> bool {
    let Some(pivot) = (1..order.len()).rev().find(|&i| order[i - 1] < order[i]) else {
        return false;
    };
    let Some(swap) = (pivot..order.len())
        .rev()
        .find(|&j| order[j] > order[pivot - 1])
    else {
        return false;
    };
    order.swap(pivot - 1, swap);
    order[pivot..].reverse();
    true
}

/// Whether every answer in `outputs` is one of `budget`'s (as a multiset).
fn within(outputs: &[Output], budget: &BTreeMap<String, usize>) -> bool {
    let mut used: BTreeMap<String, usize> = BTreeMap::new();
    for output in outputs {
        let line = format!("{output:?}");
        let count = used.entry(line.clone()).or_default();
        *count += 1;
        if *count > budget.get(&line).copied().unwrap_or(0) {
            return false;
        }
    }
    true
}
