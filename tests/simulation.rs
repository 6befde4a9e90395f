//! Deterministic simulation: many simulated clients play against the core
//! on a fake clock, driven by a seeded generator, and every step is checked
//! against the reference model and against the spec's invariants as a
//! client sees them.
//!
//! Some seeds restart the server now and then — cleanly (waiters get `B`,
//! held grants are saved and restored less the downtime) or uncleanly (the
//! next run's grace, during which the earlier run's holders adopt their
//! keys by renewing) — through the same state-file arithmetic the server
//! uses, checked against the model and against one more invariant: while
//! an earlier run's lease may still run, nobody else gets its key.
//!
//! A failure names its seed and step. `KUNCI_SIM_SEED=S` re-runs exactly
//! that seed (add `KUNCI_SIM_TRACE=1` to print every step),
//! `KUNCI_SIM_SEEDS=N` runs seeds `0..N`, `KUNCI_SIM_STEPS=N` sets the
//! steps per seed.

use std::collections::{BTreeMap, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::time::Instant;

use kunci::core::restart::{CleanStop, Durability};
use kunci::core::{ConnId, Core, Limits, Micros, Output};
use kunci::protocol::{ErrorCode, Request, RequestError, Response};
use kunci::server::state::{Clocks, Recorded};
use kunci::timer_wheel::{TimerLinks, TimerStore, TimerWheel};

use crate::util::fake::{FIRST_TOKEN, Fake, MS, S, tick_of};
use crate::util::model::{Model, same_as_multiset, same_in_order};

/// splitmix64: tiny, fast, and the same on every machine.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5eed_0fc0_ffee)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    /// A number in `low..=high`.
    fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }

    /// True with probability `percent`/100.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

/// What the clients know about one acquire they sent.
struct Attempt {
    conn: ConnId,
    key: String,
    lease_s: u8,
    answers: u32,
    /// Queued: no immediate answer. Its deadline tick, and its place in the
    /// key's arrival order.
    queued: Option<(u64, u64)>,
    /// Its connection closed before an answer.
    orphaned: bool,
}

/// A watch (`O` held, spec §13) as its client sees it.
struct Watching {
    conn: ConnId,
    key: String,
    since: u64,
    deadline_tick: u64,
}

/// A grant as its holder sees it.
struct Live {
    key: String,
    lease_tick: u64,
}

/// A grant of a run that crashed, as its holder sees it: the server does
/// not know it, but its lease may run until `deadline` (µs of the current
/// run; a lower bound of the true deadline), and until then nobody else may
/// get the key. The holder renews only before that.
struct Orphan {
    key: String,
    deadline: Micros,
}

struct Sim {
    rng: Rng,
    fake: Fake,
    model: Model,
    conns: ConnId,
    open: Vec<bool>,
    keys: Vec<String>,
    /// Waits and leases mostly short, so that deadlines meet often.
    short: bool,
    step: usize,
    trace: bool,
    next_owner: u64,
    attempts: HashMap<u64, Attempt>,
    arrivals: u64,
    live: HashMap<u64, Live>,
    /// Grants of crashed runs not yet adopted, by token.
    orphans: BTreeMap<u64, Orphan>,
    /// Whether this seed restarts the server now and then.
    restarts: bool,
    last_token: u64,
    stale_tokens: Vec<u64>,
    /// The tick of the last `handle_timeout`.
    fired_tick: u64,
    /// What the state file promises: the server's own policy, consulted
    /// after every step as the shell does before any answer leaves.
    durability: Durability,
    /// Held watches by id.
    watches: BTreeMap<u64, Watching>,
    next_watch: u64,
    counts: Counts,
}

/// What the runs exercised, to show that the seeds reach the cases that
/// matter.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    steps: u64,
    wakeups: u64,
    granted_at_once: u64,
    handed_over_on_release: u64,
    handed_over_on_expiry: u64,
    timed_out_waiting: u64,
    timed_out_at_once: u64,
    busy: u64,
    not_held: u64,
    leases_run_out: u64,
    waits_first_at_a_tie: u64,
    idle_spells: u64,
    clean_restarts: u64,
    unclean_restarts: u64,
    restored: u64,
    adopted: u64,
    /// Times the state file's horizon was brought down as leases ended.
    horizon_lowered: u64,
    observed_at_once: u64,
    watches_woken: u64,
    watches_at_deadline: u64,
    watches_refused: u64,
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.steps += other.steps;
        self.wakeups += other.wakeups;
        self.granted_at_once += other.granted_at_once;
        self.handed_over_on_release += other.handed_over_on_release;
        self.handed_over_on_expiry += other.handed_over_on_expiry;
        self.timed_out_waiting += other.timed_out_waiting;
        self.timed_out_at_once += other.timed_out_at_once;
        self.busy += other.busy;
        self.not_held += other.not_held;
        self.leases_run_out += other.leases_run_out;
        self.waits_first_at_a_tie += other.waits_first_at_a_tie;
        self.idle_spells += other.idle_spells;
        self.clean_restarts += other.clean_restarts;
        self.unclean_restarts += other.unclean_restarts;
        self.restored += other.restored;
        self.adopted += other.adopted;
        self.horizon_lowered += other.horizon_lowered;
        self.observed_at_once += other.observed_at_once;
        self.watches_woken += other.watches_woken;
        self.watches_at_deadline += other.watches_at_deadline;
        self.watches_refused += other.watches_refused;
    }
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Rng::new(seed);
        let limits = if rng.chance(35) {
            Limits {
                max_keys: rng.range(1, 4) as usize,
                max_waiters: rng.range(0, 6) as usize,
                max_waiters_per_key: rng.range(0, 4) as u32,
                max_waits_per_conn: rng.range(0, 3) as u32,
                ..Limits::default()
            }
        } else {
            Limits::default()
        };
        // A few seeds spread over many keys and connections, so that the
        // table's buckets grow and shrink.
        let crowd = rng.chance(5);
        let conns = if crowd {
            rng.range(8, 40)
        } else {
            rng.range(1, 8)
        } as ConnId;
        let key_count = if crowd {
            rng.range(60, 300)
        } else {
            rng.range(1, 6)
        };
        let keys = (0..key_count)
            .map(|i| {
                if rng.chance(20) {
                    format!("a-long-key-beyond-the-inline-bytes/{i}")
                } else {
                    format!("k{i}")
                }
            })
            .collect();
        let mut model = Model::new(limits, FIRST_TOKEN);
        for conn in 0..conns {
            model.connect(conn);
        }
        let mut fake = Fake::new(limits, conns);
        // Some seeds start as after an unclean restart.
        if rng.chance(15) {
            let horizon = rng.range(1, 40 * S);
            fake.core.set_grace_until(horizon);
            model.grace_until = horizon;
        }
        // The server writes its first promise before it accepts anything.
        let mut durability = Durability::new();
        if let Some(promise) = durability.needed(&fake.core) {
            durability.persisted(promise);
        }
        let short = rng.chance(60);
        let restarts = rng.chance(30);
        Sim {
            rng,
            fake,
            model,
            conns,
            open: vec![true; conns as usize],
            keys,
            short,
            step: 0,
            trace: std::env::var_os("KUNCI_SIM_TRACE").is_some(),
            next_owner: 0,
            attempts: HashMap::new(),
            arrivals: 0,
            live: HashMap::new(),
            orphans: BTreeMap::new(),
            restarts,
            last_token: 0,
            stale_tokens: Vec::new(),
            fired_tick: 0,
            durability,
            watches: BTreeMap::new(),
            next_watch: 0,
            counts: Counts::default(),
        }
    }

    fn wait_s(&mut self) -> u8 {
        match self.rng.below(20) {
            0..=4 => 0,
            5..=14 if self.short => self.rng.range(1, 3) as u8,
            5..=14 => self.rng.range(1, 10) as u8,
            15..=18 => self.rng.range(1, 60) as u8,
            _ => *self.rng.pick(&[64, 128, 200, 255]),
        }
    }

    fn lease_s(&mut self) -> u8 {
        match self.rng.below(20) {
            0..=13 if self.short => self.rng.range(1, 3) as u8,
            0..=13 => self.rng.range(1, 10) as u8,
            14..=18 => self.rng.range(1, 60) as u8,
            _ => *self.rng.pick(&[64, 255]),
        }
    }

    fn open_conn(&mut self) -> Option<ConnId> {
        let open: Vec<ConnId> = (0..self.conns).filter(|&c| self.open[c as usize]).collect();
        (!open.is_empty()).then(|| *self.rng.pick(&open))
    }

    fn key(&mut self) -> String {
        self.rng.pick(&self.keys).clone()
    }

    /// The holder's token of a random key, if it has one.
    fn held_key(&mut self) -> Option<(String, u64)> {
        let held: Vec<(String, u64)> = self
            .model
            .keys
            .iter()
            .map(|(key, held)| (key.clone(), held.token))
            .collect();
        (!held.is_empty()).then(|| self.rng.pick(&held).clone())
    }

    fn wrong_token(&mut self, key: &str) -> u64 {
        let holder = self.model.holder_token(key);
        let token = match self.rng.below(4) {
            0 if !self.stale_tokens.is_empty() => *self.rng.pick(&self.stale_tokens),
            1 => 0,
            2 => self.model.next_token,
            _ => self.rng.next(),
        };
        let token = if Some(token) == holder {
            token.wrapping_add(1)
        } else {
            token
        };
        // An earlier run's token adopts a key held by the unknown grant: a
        // stale one would be a client breaking the rules (core tests cover
        // it); only holders still within their lease renew (`renew_orphan`).
        if token != 0 && token < self.model.first_token {
            self.model.next_token
        } else {
            token
        }
    }

    fn log(&self, what: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("[{} @{}] {}", self.step, self.fake.now, what());
        }
    }

    /// One random step.
    fn step(&mut self) -> Result<(), String> {
        self.counts.steps += 1;
        let now = self.fake.now;
        let gone: Vec<u64> = self
            .orphans
            .iter()
            .filter(|(_, orphan)| orphan.deadline <= now)
            .map(|(&token, _)| token)
            .collect();
        for token in gone {
            self.orphans.remove(&token);
            self.stale_tokens.push(token);
        }
        if self.restarts && self.rng.below(150) == 0 {
            let clean = self.rng.chance(50);
            return self.restart(clean);
        }
        if !self.orphans.is_empty() && self.rng.chance(10) {
            return self.renew_orphan();
        }
        let roll = self.rng.below(100);
        let Some(conn) = self.open_conn() else {
            return self.reconnect();
        };
        match roll {
            0..=29 => {
                let (key, wait_s, lease_s) = (self.key(), self.wait_s(), self.lease_s());
                self.next_owner += 1;
                let owner = self.next_owner;
                self.attempts.insert(
                    owner,
                    Attempt {
                        conn,
                        key: key.clone(),
                        lease_s,
                        answers: 0,
                        queued: None,
                        orphaned: false,
                    },
                );
                let request = Request::Acquire {
                    wait_s,
                    lease_s,
                    owner,
                    key: &key,
                    limit: 0,
                    take: 0,
                    label: "",
                };
                let out = self.request(conn, &request)?;
                if out.is_empty() {
                    self.arrivals += 1;
                    let deadline = tick_of(self.fake.now + u64::from(wait_s) * S);
                    self.attempts.get_mut(&owner).unwrap().queued = Some((deadline, self.arrivals));
                }
                Ok(())
            }
            30..=41 => match self.held_key() {
                Some((key, token)) => self
                    .request(conn, &Request::Release { token, key: &key })
                    .map(drop),
                None => self.advance(),
            },
            42..=46 => {
                let key = self.key();
                let token = self.wrong_token(&key);
                self.request(conn, &Request::Release { token, key: &key })
                    .map(drop)
            }
            47..=52 => match self.held_key() {
                Some((key, token)) => {
                    let lease_s = self.lease_s();
                    let request = Request::Extend {
                        lease_s,
                        token,
                        key: &key,
                    };
                    self.request(conn, &request).map(drop)
                }
                None => self.advance(),
            },
            53..=55 => {
                let key = self.key();
                let token = self.wrong_token(&key);
                let lease_s = self.lease_s();
                let request = Request::Extend {
                    lease_s,
                    token,
                    key: &key,
                };
                self.request(conn, &request).map(drop)
            }
            56..=60 => {
                let key = self.key();
                self.request(conn, &Request::Query { key: &key }).map(drop)
            }
            61 => {
                let nonce = self.rng.next();
                self.request(conn, &Request::Ping { nonce }).map(drop)
            }
            62 => self.request(conn, &Request::Info).map(drop),
            63 => {
                let error = RequestError {
                    code: ErrorCode::from_u8(self.rng.range(3, 6) as u8).unwrap(),
                    id: self.rng.next(),
                };
                self.log(|| format!("invalid {error:?} from {conn}"));
                self.fake.core.handle_invalid(conn, error);
                let out = self.fake.drain();
                same_in_order(&out, &self.model.invalid(conn, error))?;
                self.check()
            }
            64..=66 => {
                self.log(|| format!("disconnect {conn}"));
                self.fake.core.disconnect(conn, self.fake.now);
                self.model.disconnect(conn);
                self.watches.retain(|_, watch| watch.conn != conn);
                self.open[conn as usize] = false;
                for attempt in self.attempts.values_mut() {
                    if attempt.conn == conn && attempt.answers == 0 {
                        attempt.orphaned = true;
                    }
                }
                let out = self.fake.drain();
                if !out.is_empty() {
                    return Err(format!("closing a connection answered {out:?}"));
                }
                self.check()
            }
            67..=69 => self.reconnect(),
            70..=74 => self.observe_key(conn),
            _ => self.advance(),
        }
    }

    /// The key's current token as a client would read it (spec §13.1):
    /// its holder's, 0 when free or held by an earlier run's grant.
    fn current_token(&self, key: &str) -> u64 {
        self.model.keys.get(key).map_or(0, |held| held.token)
    }

    /// One `O`: mostly on the current token, so that it is held.
    fn observe_key(&mut self, conn: ConnId) -> Result<(), String> {
        let key = self.key();
        let current = self.current_token(&key);
        let since = match self.rng.below(10) {
            0 => 0,
            1 => self.rng.next(),
            _ => current,
        };
        let wait_s = self.wait_s();
        self.next_watch += 1;
        let id = self.next_watch;
        let request = Request::Observe {
            wait_s,
            id,
            since,
            key: &key,
        };
        let out = self.fake.request(conn, &request);
        self.log(|| format!("{request:?} from {conn} → {out:?}"));
        if since != current || wait_s == 0 {
            match out.as_slice() {
                [(to, Response::KeyState { id: got, token, .. })]
                    if *to == conn && *got == id && *token == current => {}
                _ => return Err(format!("O at once: {out:?}, token {current} expected")),
            }
            self.counts.observed_at_once += 1;
        } else if self.model.wait_fits(conn) {
            if !out.is_empty() {
                return Err(format!("a watch on {key:?} since {since} answered {out:?}"));
            }
            self.watches.insert(
                id,
                Watching {
                    conn,
                    key,
                    since,
                    deadline_tick: tick_of(self.fake.now + u64::from(wait_s) * S),
                },
            );
            *self.model.watches.entry(conn).or_insert(0) += 1;
        } else {
            if out != [(conn, ErrorCode::TooManyWatches.response(id))] {
                return Err(format!("O over the wait limits: {out:?}, X 14 expected"));
            }
            self.model.counters.errors += 1;
            self.counts.watches_refused += 1;
        }
        self.check()
    }

    /// Takes the watches' answers (`V`) out of `out` and checks each: on
    /// its own connection, at most once, with a new token only after a
    /// change (the key's token now, or one granted in this same call),
    /// with the unchanged one only at its deadline or a clean stop.
    fn watch_answers(&mut self, out: Vec<Output>, stop: bool) -> Result<Vec<Output>, String> {
        let now_tick = self.fake.now / MS;
        let granted: Vec<u64> = out
            .iter()
            .filter_map(|(_, response)| match *response {
                Response::Acquired { token, .. } => Some(token),
                _ => None,
            })
            .collect();
        let mut rest = Vec::with_capacity(out.len());
        for (conn, response) in out {
            let Response::KeyState { id, token, .. } = response else {
                rest.push((conn, response));
                continue;
            };
            let Some(watch) = self.watches.remove(&id) else {
                return Err(format!("V for watch {id}, which is not held"));
            };
            if watch.conn != conn {
                return Err(format!("V for watch {id} on connection {conn}"));
            }
            *self.model.watches.get_mut(&conn).unwrap() -= 1;
            let current = self.current_token(&watch.key);
            if token != watch.since {
                if token != current && !granted.contains(&token) {
                    return Err(format!(
                        "watch {id} of {:?} woken with token {token}, the key's is {current}",
                        watch.key
                    ));
                }
                self.counts.watches_woken += 1;
            } else if stop {
            } else if watch.deadline_tick > now_tick {
                return Err(format!(
                    "watch {id} of {:?} answered unchanged at tick {now_tick}, before its \
                     deadline tick {}",
                    watch.key, watch.deadline_tick
                ));
            } else {
                self.counts.watches_at_deadline += 1;
            }
        }
        Ok(rest)
    }

    fn reconnect(&mut self) -> Result<(), String> {
        let closed: Vec<ConnId> = (0..self.conns)
            .filter(|&c| !self.open[c as usize])
            .collect();
        if closed.is_empty() {
            return self.advance();
        }
        let conn = *self.rng.pick(&closed);
        self.log(|| format!("connect {conn}"));
        self.fake.core.connect(conn);
        self.model.connect(conn);
        self.open[conn as usize] = true;
        self.check()
    }

    /// Moves the clock, landing exactly on deadlines often.
    fn advance(&mut self) -> Result<(), String> {
        let now = self.fake.now;
        if self.model.earliest_tick().is_none() && self.watches.is_empty() && self.rng.chance(20) {
            // Idle for up to 60 days: with nothing armed, the shell sleeps
            // and the next request comes before any handle_timeout.
            let idle = self.rng.range(1, 60 * 86_400) * S + self.rng.below(S);
            self.log(|| format!("idle for {idle} µs"));
            self.fake.set_now(now + idle);
            self.counts.idle_spells += 1;
            return Ok(());
        }
        let earliest = self
            .model
            .earliest_tick()
            .into_iter()
            .chain(self.watches.values().map(|watch| watch.deadline_tick))
            .min()
            .map(|tick| tick * MS);
        let wakeup = self.fake.core.poll_timeout();
        let target = match self.rng.below(100) {
            0..=29 => wakeup.unwrap_or(now + 1),
            30..=49 => earliest.unwrap_or(now + S),
            50..=59 => earliest.map_or(now + 1, |at| at - 1),
            60..=84 => now + self.rng.below(3 * MS),
            85..=96 => now + self.rng.range(1, 10) * S + self.rng.below(S),
            _ => now + self.rng.range(10, 300) * S + self.rng.below(S),
        }
        .max(now);
        if self.rng.chance(25) {
            // One late call that covers everything since the last one.
            self.fire(target, false)
        } else {
            self.run_to(target)
        }
    }

    /// Fires tick by tick, at each wake-up the core asks for, as the shell
    /// does; then at `target`.
    fn run_to(&mut self, target: Micros) -> Result<(), String> {
        let mut wakeups = 0;
        // The core's wake-ups, and the state file's: the horizon comes down
        // as leases end.
        let next = |sim: &Sim| {
            let core = &sim.fake.core;
            [core.poll_timeout(), sim.durability.poll_timeout(core)]
                .into_iter()
                .flatten()
                .min()
        };
        while let Some(at) = next(self).filter(|&at| at <= target) {
            wakeups += 1;
            if wakeups > 100_000 {
                return Err("livelock: wake-ups without end".to_owned());
            }
            self.counts.wakeups += 1;
            self.fire(at.max(self.fake.now), true)?;
        }
        self.fire(target, true)
    }

    fn request(&mut self, conn: ConnId, request: &Request<'_>) -> Result<Vec<Output>, String> {
        let now = self.fake.now;
        let out = self.fake.request(conn, request);
        self.log(|| format!("{request:?} from {conn} → {out:?}"));
        let want = self.model.request(conn, request, now);
        let out = self.watch_answers(out, false)?;
        same_in_order(&out, &want)?;
        self.observe(&out, None)?;
        self.check()?;
        Ok(out)
    }

    /// `handle_timeout(now)`; `exact` when every wake-up before it was
    /// served, so everything due must fire at its own tick.
    fn fire(&mut self, now: Micros, exact: bool) -> Result<(), String> {
        let before = self.fired_tick;
        let out = self.fake.run_until(now);
        if !out.is_empty() {
            self.log(|| format!("fire → {out:?}"));
        }
        let kept: Vec<Output> = out
            .iter()
            .filter(|(_, response)| !matches!(response, Response::KeyState { .. }))
            .cloned()
            .collect();
        let want = self.model.timeout(now, &kept)?;
        let out = self.watch_answers(out, false)?;
        same_as_multiset(&out, &want)?;
        self.observe(&out, Some((before, exact)))?;
        self.fired_tick = now / MS;
        self.check()
    }

    /// The spec's invariants, checked on the answers as clients see them,
    /// independently of the model. `fired` is set for `handle_timeout`
    /// answers: the tick of the previous call, and whether wake-ups were
    /// served exactly.
    fn observe(&mut self, out: &[Output], fired: Option<(u64, bool)>) -> Result<(), String> {
        let now = self.fake.now;
        let now_tick = now / MS;
        for (conn, _) in out {
            if !self.open[*conn as usize] {
                return Err(format!("an answer to closed connection {conn}: {out:?}"));
            }
        }
        // A wait or a lease that fired: not before its tick, not after the
        // call that first reached it, at its own tick when driven exactly.
        let on_time = |deadline: u64, what: &str| -> Result<(), String> {
            let Some((before, exact)) = fired else {
                return Ok(());
            };
            if deadline > now_tick {
                return Err(format!("{what}: due at tick {deadline}, fired at {now}"));
            }
            if deadline <= before || (exact && deadline != now_tick) {
                return Err(format!(
                    "{what}: due at tick {deadline}, fired late at {now} (last call at tick {before})"
                ));
            }
            Ok(())
        };
        // Leases that ran out in this call.
        if fired.is_some() {
            let mut ended = Vec::new();
            for (token, live) in &self.live {
                if self.model.holder_token(&live.key) != Some(*token) {
                    on_time(live.lease_tick, &format!("lease of token {token}"))?;
                    ended.push(*token);
                }
            }
            self.counts.leases_run_out += ended.len() as u64;
            for token in ended {
                self.live.remove(&token);
                self.stale_tokens.push(token);
            }
        }
        // Timeouts first: a waiter at the same tick may go before a grant.
        for (conn, response) in out {
            let owner = match *response {
                Response::Timeout { owner } | Response::Busy { owner } => owner,
                _ => continue,
            };
            let attempt = self.answer(owner, *conn)?;
            match (response, attempt.queued) {
                (Response::Timeout { .. }, Some((deadline, _))) => {
                    on_time(deadline, &format!("wait of owner {owner}"))?;
                    self.counts.timed_out_waiting += 1;
                }
                (Response::Timeout { .. }, None) => self.counts.timed_out_at_once += 1,
                _ => self.counts.busy += 1,
            }
        }
        for (conn, response) in out {
            match *response {
                Response::Acquired { owner, token } => {
                    if token <= self.last_token || token == 0 {
                        return Err(format!("token {token} after {}", self.last_token));
                    }
                    self.last_token = token;
                    let (key, lease_s, arrival) = {
                        let attempt = self.answer(owner, *conn)?;
                        (
                            attempt.key.clone(),
                            attempt.lease_s,
                            attempt.queued.map(|q| q.1),
                        )
                    };
                    // At most one holder: every earlier grant of the key was
                    // released or ran out (and was noticed above).
                    if let Some((other, _)) = self.live.iter().find(|(_, live)| live.key == key) {
                        return Err(format!("{key:?} granted as {token} while {other} holds it"));
                    }
                    if let Some((other, orphan)) = self
                        .orphans
                        .iter()
                        .find(|(_, o)| o.key == key && o.deadline > now)
                    {
                        return Err(format!(
                            "{key:?} granted as {token} while the lease of {other} of an \
                             earlier run may last until {}",
                            orphan.deadline
                        ));
                    }
                    // FIFO: nobody who queued on the key earlier still waits.
                    if let Some(arrival) = arrival {
                        let ahead = self.attempts.iter().find(|(_, a)| {
                            a.key == key
                                && a.answers == 0
                                && !a.orphaned
                                && a.queued.is_some_and(|q| q.1 < arrival)
                        });
                        if let Some((ahead, _)) = ahead {
                            return Err(format!(
                                "{key:?} handed to owner {owner} before owner {ahead}"
                            ));
                        }
                    }
                    let lease_tick = tick_of(now + u64::from(lease_s) * S);
                    self.live.insert(token, Live { key, lease_tick });
                    match (arrival, fired) {
                        (None, _) => self.counts.granted_at_once += 1,
                        (Some(_), None) => self.counts.handed_over_on_release += 1,
                        (Some(_), Some(_)) => self.counts.handed_over_on_expiry += 1,
                    }
                }
                Response::Released { token } => {
                    if self.live.remove(&token).is_none() && self.orphans.remove(&token).is_none() {
                        return Err(format!("released token {token}, which is not held"));
                    }
                    self.stale_tokens.push(token);
                }
                Response::Extended { token } => {
                    if let Some(orphan) = self.orphans.remove(&token) {
                        self.counts.adopted += 1;
                        let lease_tick = 0;
                        self.live.insert(
                            token,
                            Live {
                                key: orphan.key,
                                lease_tick,
                            },
                        );
                    }
                    let Some(live) = self.live.get_mut(&token) else {
                        return Err(format!("extended token {token}, which is not held"));
                    };
                    live.lease_tick = self.model.keys[&live.key].lease_tick;
                }
                Response::NotHeld { token } => {
                    self.counts.not_held += 1;
                    if self.live.contains_key(&token) || self.orphans.contains_key(&token) {
                        return Err(format!("token {token} is held but got N"));
                    }
                }
                _ => {}
            }
        }
        if self.stale_tokens.len() > 64 {
            self.stale_tokens.drain(..32);
        }
        Ok(())
    }

    /// A holder of a crashed run's grant, still within its lease, renews
    /// or releases as usual: the server must accept it (spec §7.3).
    fn renew_orphan(&mut self) -> Result<(), String> {
        let tokens: Vec<u64> = self.orphans.keys().copied().collect();
        let token = *self.rng.pick(&tokens);
        let key = self.orphans[&token].key.clone();
        let conn = self.open_conn().unwrap_or(0);
        if !self.open[conn as usize] {
            return self.reconnect();
        }
        let out = if self.rng.chance(70) {
            let lease_s = self.lease_s();
            let request = Request::Extend {
                lease_s,
                token,
                key: &key,
            };
            self.request(conn, &request)?
        } else {
            self.request(conn, &Request::Release { token, key: &key })?
        };
        match out.first() {
            Some((_, Response::Extended { .. } | Response::Released { .. })) => Ok(()),
            _ => Err(format!(
                "the renewal of {key:?} by {token} of an earlier run, within its lease, got {out:?}"
            )),
        }
    }

    /// Stops the server — cleanly or not — and starts the next run after
    /// a random downtime, as the server and its state file do.
    fn restart(&mut self, clean: bool) -> Result<(), String> {
        let now = self.fake.now;
        let downtime_ms = match self.rng.below(4) {
            0 => 0,
            1 => self.rng.below(2_000),
            2 => self.rng.range(1, 60) * 1_000,
            _ => self.rng.range(60, 400) * 1_000,
        };
        self.log(|| format!("restart (clean: {clean}) down for {downtime_ms} ms"));
        let core = &self.fake.core;
        let written = Clocks {
            boot_id: b"sim".to_vec(),
            boot_ms: 1_000_000 + now.div_ceil(MS),
            wall_ms: 50_000_000 + now.div_ceil(MS),
        };
        let ms_after = |at: Micros| at.saturating_sub(now).div_ceil(MS);
        let mut recorded = Recorded::new(clean, written.clone(), core.next_token(), 0);
        if clean {
            core.check_invariants();
            self.fake.core.shut_down(self.fake.now);
            let out = self.fake.drain();
            let out = self.watch_answers(out, true)?;
            if !self.watches.is_empty() {
                return Err(format!("a clean stop left {} watches", self.watches.len()));
            }
            let want = self.model.shut_down();
            same_as_multiset(&out, &want)?;
            self.observe(&out, None)?;
            // What the server's clean stop persists.
            let stop = CleanStop::of(&self.fake.core, now);
            recorded.set_grants(stop.grants());
            recorded.horizon_ms = ms_after(stop.horizon);
            recorded.counted_grants = stop.counted_grants;
            self.counts.clean_restarts += 1;
        } else {
            // The horizon on disk: what the last promise made durable.
            let Some(promise) = self.durability.on_disk() else {
                return Err("a run crashed before its first promise was durable".to_owned());
            };
            // At or past every lease armed (since the last settle), and at
            // most 5 s past the latest of them — or 1 s more, the least a
            // lowering gains, once the leases that ended were forgotten.
            let latest = core.lease_deadline_max().max(core.grace_until());
            if promise.horizon < latest || promise.horizon > (latest + 5 * S).max(now) + S {
                return Err(format!(
                    "the horizon on disk {} is not within 5 s (+ 1 s) after the latest lease \
                     {latest} at {now}",
                    promise.horizon
                ));
            }
            // Never below a lease its holder sees running.
            if let Some((token, live)) = self.live.iter().find(|(_, live)| {
                live.lease_tick * MS > now && tick_of(promise.horizon) < live.lease_tick
            }) {
                return Err(format!(
                    "the horizon on disk {} is below the lease of {token} (tick {})",
                    promise.horizon, live.lease_tick
                ));
            }
            // Brought down as leases ended: once the core has been looked
            // at since the last one ended, and no lowering is waiting its
            // turn, at most 5 s (and a 100 ms bucket, and the 1 s a
            // lowering must gain) past the latest lease running now.
            let lowered_at = self.durability.lowered_at();
            if !core.leases_ended() && lowered_at.is_none_or(|at| now >= at + 5 * S) {
                let running = self
                    .live
                    .values()
                    .map(|live| live.lease_tick * MS)
                    .max()
                    .unwrap_or(0);
                let bound = (running + 5 * S + 100 * MS)
                    .max(core.grace_until())
                    .max(now)
                    + S;
                if promise.horizon > bound {
                    return Err(format!(
                        "the horizon on disk {} is more than 6.1 s past the latest lease running \
                         ({running}) at {now}",
                        promise.horizon
                    ));
                }
            }
            if promise.token_high_water < core.next_token() {
                return Err(format!(
                    "tokens up to {} shown, {} on disk",
                    core.next_token(),
                    promise.token_high_water
                ));
            }
            recorded.horizon_ms = ms_after(promise.horizon);
            recorded.counted_grants = promise.counted_grants;
            self.counts.unclean_restarts += 1;
        }
        // The wall clock stepped back an hour meanwhile: the boot-time
        // clock measures the downtime.
        let restarted = Clocks {
            boot_id: b"sim".to_vec(),
            boot_ms: written.boot_ms + downtime_ms,
            wall_ms: written.wall_ms - 3_600_000,
        };
        let restart = recorded.restart_at(&restarted);
        let first_token = self.fake.core.next_token() + self.rng.below(1_000);
        let shift = now + downtime_ms * MS;
        let limits = *self.fake.core.limits();
        let mut core = Core::new(limits, first_token);
        let mut model = Model::new(limits, first_token);
        // The server's own resume policy, and the same grants and grace
        // for the model.
        restart
            .resume(&mut core, recorded.grants())
            .map_err(|e| format!("restore: {e}"))?;
        for (grant, deadline) in restart.restorable(recorded.grants()) {
            model.restore(grant.key, grant.token, grant.owner, tick_of(deadline));
            self.counts.restored += 1;
        }
        if let Some(grace) = restart.grace_until() {
            model.grace_until = grace;
        }
        for conn in 0..self.conns {
            core.connect(conn);
            model.connect(conn);
            self.open[conn as usize] = true;
        }
        self.fake = Fake { core, now: 0 };
        self.model = model;
        self.watches.clear();
        self.durability = Durability::new();
        if let Some(promise) = self.durability.needed(&self.fake.core) {
            self.durability.persisted(promise);
        }
        self.fired_tick = 0;
        for attempt in self.attempts.values_mut() {
            if attempt.answers == 0 {
                attempt.orphaned = true;
            }
        }
        // Holders of the stopped run: restored, orphaned by the crash, or
        // their lease ran out while the server was down.
        for orphan in self.orphans.values_mut() {
            orphan.deadline = orphan.deadline.saturating_sub(shift);
        }
        for (token, live) in std::mem::take(&mut self.live) {
            if let Some(held) = self.model.keys.get(&live.key).filter(|k| k.token == token) {
                let lease_tick = held.lease_tick;
                self.live.insert(token, Live { lease_tick, ..live });
                continue;
            }
            // The earliest the lease can end: just after the tick before
            // the one it fires at.
            let deadline = ((live.lease_tick.max(1) - 1) * MS + 1).saturating_sub(shift);
            if !clean && deadline > 0 {
                self.orphans.insert(
                    token,
                    Orphan {
                        key: live.key,
                        deadline,
                    },
                );
            } else {
                self.stale_tokens.push(token);
            }
        }
        self.check()
    }

    /// Counts an A, T or B for `owner`: exactly one, on its own connection.
    fn answer(&mut self, owner: u64, conn: ConnId) -> Result<&Attempt, String> {
        let Some(attempt) = self.attempts.get_mut(&owner) else {
            return Err(format!("an answer for owner {owner}, who never asked"));
        };
        attempt.answers += 1;
        if attempt.answers > 1 || attempt.orphaned || attempt.conn != conn {
            return Err(format!(
                "owner {owner} answered {} times, on connection {conn} (asked on {}, closed: {})",
                attempt.answers, attempt.conn, attempt.orphaned
            ));
        }
        Ok(attempt)
    }

    fn check(&mut self) -> Result<(), String> {
        self.fake.core.check_invariants();
        // As the endpoint does after every wake-up and read.
        let lowered = self.durability.lowered_at();
        self.durability.plan(&mut self.fake.core, self.fake.now);
        if self.durability.lowered_at() != lowered {
            self.counts.horizon_lowered += 1;
        }
        if let Some(promise) = self.durability.needed(&self.fake.core) {
            self.durability.persisted(promise);
        }
        let core = &self.fake.core;
        let model = &self.model;
        let gauges = (
            core.keys(),
            core.waiter_count(),
            core.next_token(),
            core.connections(),
        );
        let expected = (
            model.keys.len(),
            model.waiters(),
            model.next_token,
            model.conns.len(),
        );
        if gauges != expected {
            return Err(format!(
                "(keys, waiters, next token, connections) = {gauges:?}, the model has {expected:?}"
            ));
        }
        // Every watch waits on its key's current token: a change that woke
        // nobody shows here.
        for (id, watch) in &self.watches {
            let current = model.keys.get(&watch.key).map_or(0, |held| held.token);
            if current != watch.since {
                return Err(format!(
                    "watch {id} of {:?} still waits on {} though the token is {current}",
                    watch.key, watch.since
                ));
            }
        }
        if core.watch_count() != self.watches.len() {
            return Err(format!(
                "{} watches held, the clients hold {}",
                core.watch_count(),
                self.watches.len()
            ));
        }
        let earliest = model
            .earliest_tick()
            .into_iter()
            .chain(self.watches.values().map(|watch| watch.deadline_tick))
            .min();
        match (core.poll_timeout(), earliest) {
            (None, None) => {}
            (Some(at), Some(tick)) if at <= tick * MS => {}
            (got, want) => {
                return Err(format!(
                    "poll_timeout {got:?}, earliest deadline tick {want:?}"
                ));
            }
        }
        Ok(())
    }

    fn run(&mut self, steps: usize) -> Result<(), String> {
        for step in 0..steps {
            self.step = step;
            self.step()?;
        }
        // Let every wait and lease run out; then every acquire was answered
        // exactly once or lost with its connection.
        self.step = steps;
        let end = self.fake.now + 600 * S;
        self.run_to(end)?;
        if self.fake.core.keys() != 0 || self.fake.core.poll_timeout().is_some() {
            return Err("keys or timers left after every lease ran out".to_owned());
        }
        for (owner, attempt) in &self.attempts {
            if attempt.answers != 1 && !attempt.orphaned {
                return Err(format!("owner {owner} answered {} times", attempt.answers));
            }
        }
        Ok(())
    }
}

/// Runs one seed; a failure names the seed, the step and how to re-run it.
fn run_seed(seed: u64, steps: usize) -> Counts {
    let mut sim = Sim::new(seed);
    let result = catch_unwind(AssertUnwindSafe(|| sim.run(steps)));
    let rerun = format!(
        "re-run with KUNCI_SIM_SEED={seed} KUNCI_SIM_TRACE=1 cargo test --release simulation"
    );
    match result {
        Ok(Ok(())) => Counts {
            waits_first_at_a_tie: sim.model.ties,
            ..sim.counts
        },
        Ok(Err(message)) => panic!(
            "simulation seed {seed} failed at step {} (time {} µs): {message}\n{rerun}",
            sim.step, sim.fake.now
        ),
        Err(panic) => {
            eprintln!(
                "simulation seed {seed} panicked at step {} (time {} µs)\n{rerun}",
                sim.step, sim.fake.now
            );
            resume_unwind(panic)
        }
    }
}

#[test]
fn simulation_of_many_clients_on_a_fake_clock() {
    let default_seeds = if cfg!(debug_assertions) { 300 } else { 10_000 };
    let steps = env_u64("KUNCI_SIM_STEPS").unwrap_or(1_000) as usize;
    let seeds: Vec<u64> = match env_u64("KUNCI_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (0..env_u64("KUNCI_SIM_SEEDS").unwrap_or(default_seeds)).collect(),
    };
    let started = Instant::now();
    let mut counts = Counts::default();
    for &seed in &seeds {
        counts.add(&run_seed(seed, steps));
    }
    eprintln!(
        "simulation: {} seeds × {steps} steps in {:.2?}: {counts:?}",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() > 100 {
        // The seeds must reach every kind of outcome, many times.
        let reached = [
            counts.granted_at_once,
            counts.handed_over_on_release,
            counts.handed_over_on_expiry,
            counts.timed_out_waiting,
            counts.timed_out_at_once,
            counts.busy,
            counts.not_held,
            counts.leases_run_out,
            counts.observed_at_once,
            counts.watches_woken,
            counts.watches_at_deadline,
            counts.watches_refused,
        ];
        assert!(reached.iter().all(|&n| n > 1_000), "{counts:?}");
        let restarts = [
            counts.clean_restarts,
            counts.unclean_restarts,
            counts.restored,
            counts.adopted,
            counts.horizon_lowered,
        ];
        // About 1 seed in 10 adopts a key after a crash.
        let often = seeds.len() as u64 / 10;
        assert!(restarts.iter().all(|&n| n > often), "{counts:?}");
    }
}

#[test]
fn the_simulation_is_deterministic() {
    let trace = |seed| {
        let mut sim = Sim::new(seed);
        sim.run(300).unwrap();
        (
            sim.fake.now,
            sim.next_owner,
            sim.last_token,
            sim.fake.core.info_text(sim.fake.now),
        )
    };
    assert_eq!(trace(7), trace(7));
    assert_ne!(trace(7), trace(8));
}

// ---- the timer wheel on its own ---------------------------------------------------

struct Timers(Vec<TimerLinks>);

impl TimerStore for Timers {
    fn links(&mut self, id: u32) -> &mut TimerLinks {
        &mut self.0[id as usize]
    }
}

/// Many timers at random deadlines up to 300 s, random cancels and
/// re-arms, polls at random times: every timer fires exactly once, never
/// before its deadline, at the first poll that reaches it, and exactly at
/// its tick when polled at `next_tick()`.
#[test]
fn timer_wheel_stress() {
    const TIMERS: usize = 4_000;
    let seeds = if cfg!(debug_assertions) { 3 } else { 20 };
    for seed in 0..seeds {
        let mut rng = Rng::new(seed);
        let mut timers = Timers(vec![TimerLinks::UNARMED; TIMERS]);
        let mut wheel = TimerWheel::new();
        // id → deadline tick of every armed timer.
        let mut armed: BTreeMap<u32, u64> = BTreeMap::new();
        let mut now = rng.below(1 << 33);
        // Start far from 0 so that tick numbers wrap the 32-bit deadlines.
        while wheel.poll(&mut timers, now).is_some() {}
        let mut fired = 0;
        let mut polls = 0;
        let mut last_poll = now;
        for round in 0..3_000 {
            // Arm, re-arm or cancel a few timers.
            for _ in 0..rng.range(0, 6) {
                let id = rng.below(TIMERS as u64) as u32;
                if rng.chance(25) {
                    wheel.cancel(&mut timers, id);
                    armed.remove(&id);
                } else {
                    let deadline = now
                        + match rng.below(4) {
                            0 => rng.range(0, 70),
                            1 => rng.range(0, 5_000),
                            _ => rng.range(0, 300_000),
                        };
                    wheel.arm(&mut timers, id, deadline);
                    armed.insert(id, deadline);
                }
            }
            assert_eq!(wheel.len(), armed.len(), "seed {seed} round {round}");
            let earliest = armed.values().min().copied();
            let next = wheel.next_tick();
            assert_eq!(
                next.is_some(),
                earliest.is_some(),
                "seed {seed} round {round}"
            );
            if let (Some(next), Some(earliest)) = (next, earliest) {
                assert!(
                    next <= earliest.max(now),
                    "seed {seed}: next tick {next} after the deadline {earliest}"
                );
            }
            // Poll at the next tick (exact), or jump.
            let exact = rng.chance(60);
            let jump = if rng.chance(50) { 100 } else { 50_000 };
            let at = match (exact, next) {
                (true, Some(next)) => next.max(now),
                _ => now + rng.below(jump),
            };
            polls += 1;
            while let Some(id) = wheel.poll(&mut timers, at) {
                let Some(deadline) = armed.remove(&id) else {
                    panic!("seed {seed}: timer {id} fired twice or after its cancel");
                };
                assert!(
                    deadline <= at,
                    "seed {seed}: timer {id} due at {deadline} fired early at {at}"
                );
                // Everything due at the last poll fired then; only a timer
                // armed since, for that very tick, may be due at or before it.
                assert!(
                    deadline >= last_poll,
                    "seed {seed}: timer {id} due at {deadline} fired late at {at} (last poll {last_poll})"
                );
                if exact && next.is_some() {
                    assert_eq!(deadline, at, "seed {seed}: timer {id} not at its tick");
                }
                fired += 1;
            }
            assert!(
                armed.values().all(|&deadline| deadline > at),
                "seed {seed}: a due timer did not fire at {at}"
            );
            last_poll = at;
            now = at;
        }
        // Drain: everything left fires at its own tick.
        while let Some(next) = wheel.next_tick() {
            polls += 1;
            while let Some(id) = wheel.poll(&mut timers, next) {
                let deadline = armed.remove(&id).expect("fired once");
                assert_eq!(deadline, next, "seed {seed}: timer {id} not at its tick");
                fired += 1;
            }
            now = next;
            assert!(polls < 1_000_000, "livelock");
        }
        assert!(armed.is_empty() && wheel.is_empty());
        assert!(fired > 1_000, "seed {seed}: only {fired} fired");
    }
}

// ---- the endpoint over byte streams ------------------------------------------------

/// Peers that speak bytes to the sans-IO [`Endpoint`] the way the shell
/// drives it: reads split at random points, half-closes, resets with
/// unread output, readers that stall, refusals at accept, floods that hit
/// backpressure, frames left incomplete, a graceful shutdown. Checked
/// after every step: the endpoint's and the core's invariants (bounded
/// buffers among them), every answer correlates to exactly one request,
/// and nothing is queued for a connection once it stopped being live.
/// At the end every request on a live connection has been answered.
mod wire {
    use std::collections::{BTreeSet, HashMap};

    use kunci::addr::Network;
    use kunci::core::connection::{Phase, READ_CHUNK};
    use kunci::core::endpoint::{Action, Endpoint};
    use kunci::core::{ConnId, Core, Limits, Micros};
    use kunci::protocol::{self, Correlation, ErrorCode, Request, Response};

    use super::Rng;
    use crate::util::fake::{FIRST_TOKEN, MS, S};

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
    }

    impl Counts {
        pub fn add(&mut self, other: &Counts) {
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
        }
    }

    pub struct WireSim {
        rng: Rng,
        endpoint: Endpoint,
        now: Micros,
        peers: HashMap<ConnId, Peer>,
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

    impl WireSim {
        pub fn new(seed: u64) -> WireSim {
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
                peers: HashMap::new(),
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

        pub fn run(&mut self, steps: usize) -> Result<(), String> {
            for step in 0..steps {
                self.step = step;
                self.counts.steps += 1;
                self.one_step()?;
                self.shell_turn()?;
                self.check()?;
            }
            self.finish()
        }

        fn one_step(&mut self) -> Result<(), String> {
            let ids: Vec<ConnId> = self.live_peers();
            let pick =
                |rng: &mut Rng| -> Option<ConnId> { (!ids.is_empty()).then(|| *rng.pick(&ids)) };
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
                let mut bytes = Vec::new();
                let correlation = match self.rng.below(10) {
                    0..=3 => {
                        let request = Request::Acquire {
                            wait_s: self.rng.range(0, 3) as u8,
                            lease_s: self.rng.range(1, 3) as u8,
                            owner,
                            key: &key,
                            limit: 0,
                            take: 0,
                            label: "",
                        };
                        protocol::encode_request(&request, &mut bytes);
                        request.correlation()
                    }
                    4 => {
                        let request = Request::Release { token, key: &key };
                        protocol::encode_request(&request, &mut bytes);
                        request.correlation()
                    }
                    5 => {
                        let request = Request::Extend {
                            lease_s: 2,
                            token,
                            key: &key,
                        };
                        protocol::encode_request(&request, &mut bytes);
                        request.correlation()
                    }
                    6 => {
                        let request = Request::Query { key: &key };
                        protocol::encode_request(&request, &mut bytes);
                        request.correlation()
                    }
                    7 => {
                        let request = Request::Ping { nonce: owner };
                        protocol::encode_request(&request, &mut bytes);
                        request.correlation()
                    }
                    8 => {
                        protocol::encode_request(&Request::Info, &mut bytes);
                        Correlation::Info
                    }
                    _ => {
                        // Lease 0: `X 5` carrying the owner, not fatal.
                        let request = Request::Acquire {
                            wait_s: 0,
                            lease_s: 0,
                            owner,
                            key: &key,
                            limit: 0,
                            take: 0,
                            label: "",
                        };
                        protocol::encode_request(&request, &mut bytes);
                        request.correlation()
                    }
                };
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
}

/// The key's limit as `L` shows it (0: none, or not in the table).
fn limit_of(fake: &mut Fake, key: &str) -> u16 {
    let request = Request::List {
        id: 7,
        cursor: 0,
        count: 1,
        prefix: key,
    };
    fake.request(0, &request)
        .into_iter()
        .find_map(|(_, response)| match response {
            Response::Key {
                key: listed, limit, ..
            } if listed == key => Some(limit),
            _ => None,
        })
        .unwrap_or(0)
}

/// One seed of the crash-grace scenario with limits (issue 25 defect 11):
/// a run makes exclusive grants and one counted grant and crashes; in the
/// next run's grace some holders adopt their keys by renewing, and
/// requests naming limits (and takes and waits) arrive, with time passing
/// between them. Spec §10.2 as a client sees it through `L`: a request
/// that ends at once with `T` or `B` sets no limit, one granted or queued
/// sets it if the key had none, and `X 10` comes only for a limit other
/// than the key's.
fn run_grace_limits_seed(seed: u64) -> Result<u64, String> {
    let mut rng = Rng::new(seed);
    let limits = Limits {
        max_waiters: rng.range(0, 3) as usize,
        ..Limits::default()
    };
    let keys = ["k0", "k1", "k2", "k3"];
    let mut fake = Fake::new(limits, 3);
    let mut durability = Durability::new();
    let persist = |fake: &mut Fake, durability: &mut Durability| {
        durability.plan(&mut fake.core, fake.now);
        if let Some(promise) = durability.needed(&fake.core) {
            durability.persisted(promise);
        }
    };
    persist(&mut fake, &mut durability);
    fake.set_now(rng.range(1, 10) * S);
    let mut held = Vec::new();
    for (owner, key) in keys.iter().enumerate() {
        if rng.chance(75) {
            let lease_s = rng.range(20, 120) as u8;
            held.push((*key, fake.grant(0, key, lease_s, owner as u64 + 1)));
        }
    }
    match fake.permits(0, "counted", 0, 30, 99, 3, 1, "").as_slice() {
        [(0, Response::Acquired { .. })] => {}
        other => return Err(format!("the counted grant: {other:?}")),
    }
    persist(&mut fake, &mut durability);
    let Some(promise) = durability.on_disk() else {
        return Err("nothing on disk".to_owned());
    };
    if !promise.counted_grants {
        return Err("the counted grant was not recorded".to_owned());
    }
    // kill -9, and a restart after a downtime.
    let now = fake.now;
    let written = Clocks {
        boot_id: b"sim".to_vec(),
        boot_ms: 1_000_000 + now.div_ceil(MS),
        wall_ms: 50_000_000 + now.div_ceil(MS),
    };
    let mut recorded = Recorded::new(false, written.clone(), promise.token_high_water, 0);
    recorded.horizon_ms = promise.horizon.saturating_sub(now).div_ceil(MS);
    recorded.counted_grants = promise.counted_grants;
    let restarted = Clocks {
        boot_id: b"sim".to_vec(),
        boot_ms: written.boot_ms + rng.below(3_000),
        wall_ms: written.wall_ms,
    };
    let restart = recorded.restart_at(&restarted);
    let mut core = Core::new(limits, promise.token_high_water);
    restart
        .resume(&mut core, recorded.grants())
        .map_err(|e| format!("restore: {e}"))?;
    for conn in 0..3 {
        core.connect(conn);
    }
    let mut fake = Fake { core, now: 0 };
    for &(key, token) in &held {
        if rng.chance(70) {
            let lease_s = rng.range(5, 60) as u8;
            let out = fake.extend(1, key, lease_s, token);
            if out != vec![(1, Response::Extended { token })] {
                return Err(format!("renewing {key:?} {token} in the grace: {out:?}"));
            }
        }
    }
    let mut checked = 0;
    for owner in 1_000..1_060u64 {
        let key = *rng.pick(&keys);
        let limit = rng.range(1, 9) as u16;
        let take = rng.range(0, u64::from(limit.min(3))) as u16;
        let wait_s = if rng.chance(60) {
            0
        } else {
            rng.range(1, 4) as u8
        };
        let before = limit_of(&mut fake, key);
        let conn = rng.below(3) as ConnId;
        let out = fake.permits(conn, key, wait_s, 30, owner, limit, take, "");
        let after = limit_of(&mut fake, key);
        let answer = out
            .iter()
            .find(|(to, response)| *to == conn && response_owner(response) == Some(owner))
            .map(|(_, response)| response.clone());
        let ok = match &answer {
            Some(Response::Timeout { .. } | Response::Busy { .. }) => after == before,
            Some(Response::Error { .. }) => before != 0 && before != limit && after == before,
            Some(Response::Acquired { .. }) | None => {
                after == limit && (before == 0 || before == limit)
            }
            Some(_) => false,
        };
        if !ok {
            return Err(format!(
                "at {} µs, {key:?} limit {before}: S limit {limit} take {take} wait {wait_s} \
                 answered {answer:?} left the limit {after}",
                fake.now
            ));
        }
        checked += 1;
        fake.core.check_invariants();
        if rng.chance(30) {
            let at = fake.now + rng.below(3 * S);
            fake.run_until(at);
        }
    }
    Ok(checked)
}

fn response_owner(response: &Response) -> Option<u64> {
    match *response {
        Response::Timeout { owner }
        | Response::Busy { owner }
        | Response::Acquired { owner, .. } => Some(owner),
        Response::Error { id, .. } => Some(id),
        _ => None,
    }
}

#[test]
fn simulation_of_limits_named_during_a_crash_grace_after_counted_grants() {
    let seeds = env_u64("KUNCI_SIM_SEEDS").unwrap_or(500);
    let mut checked = 0;
    for seed in 0..seeds {
        match run_grace_limits_seed(seed) {
            Ok(count) => checked += count,
            Err(message) => panic!(
                "crash-grace limits seed {seed}: {message}\n\
                 re-run with KUNCI_SIM_SEEDS={} cargo test --release grace_after_counted",
                seed + 1
            ),
        }
    }
    assert_eq!(checked, seeds * 60);
}

fn run_wire_seed(seed: u64, steps: usize) -> wire::Counts {
    let mut sim = wire::WireSim::new(seed);
    let result = catch_unwind(AssertUnwindSafe(|| sim.run(steps)));
    let rerun =
        format!("re-run with KUNCI_SIM_SEED={seed} cargo test --release simulation_of_the_wire");
    match result {
        Ok(Ok(())) => sim.counts,
        Ok(Err(message)) => panic!(
            "wire simulation seed {seed} failed at step {}: {message}\n{rerun}",
            sim.step
        ),
        Err(panic) => {
            eprintln!(
                "wire simulation seed {seed} panicked at step {}\n{rerun}",
                sim.step
            );
            resume_unwind(panic)
        }
    }
}

#[test]
fn simulation_of_the_wire_bytes_split_half_closed_stalled_and_reset() {
    let default_seeds = if cfg!(debug_assertions) { 200 } else { 1_000 };
    let steps = env_u64("KUNCI_SIM_STEPS").unwrap_or(1_000) as usize;
    let seeds: Vec<u64> = match env_u64("KUNCI_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (0..env_u64("KUNCI_SIM_SEEDS").unwrap_or(default_seeds)).collect(),
    };
    let started = Instant::now();
    let mut counts = wire::Counts::default();
    for &seed in &seeds {
        counts.add(&run_wire_seed(seed, steps));
    }
    eprintln!(
        "wire simulation: {} seeds × {steps} steps in {:.2?}: {counts:?}",
        seeds.len(),
        started.elapsed()
    );
    if seeds.len() >= 50 {
        let reached = [
            counts.half_closes,
            counts.resets,
            counts.stalls,
            counts.refusals,
            counts.backpressured,
            counts.partial_frame_timeouts,
            counts.fatal,
            counts.shutdowns,
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

/// The simulation of keys with permits (spec §10): `S` of every kind mixed
/// with plain `A` on a few keys, releases and renewals of any grant, wrong
/// tokens, mismatched limits, closes, timeouts and expiries, against the
/// permit model ([`PermitModel`](crate::util::model::PermitModel)), which
/// writes out the fit rule, strict FIFO and the order of tokens; every
/// answer must be the model's exactly, and the core checks its own
/// invariants after every step. `KUNCI_PERMIT_SEEDS=N`,
/// `KUNCI_PERMIT_SEED=S` (with `KUNCI_SIM_TRACE=1`) and `KUNCI_SIM_STEPS`
/// as for the other simulation.
mod permits {
    use std::time::Instant;

    use kunci::core::{ConnId, Limits, Micros};
    use kunci::protocol::{ErrorCode, Request, RequestError, Response};

    use super::{Rng, env_u64};
    use crate::util::fake::{FIRST_TOKEN, Fake, MS, S};
    use crate::util::model::{PermitModel, same_as_multiset, same_in_order};

    #[derive(Clone, Copy, Debug, Default)]
    pub struct Counts {
        pub granted_at_once: u64,
        pub counted_grants: u64,
        pub several_granted_at_once: u64,
        pub handed_over: u64,
        pub mismatches: u64,
        pub timeouts: u64,
        pub busy: u64,
        pub expired: u64,
    }

    struct PermitSim {
        rng: Rng,
        fake: Fake,
        model: PermitModel,
        conns: ConnId,
        open: Vec<bool>,
        keys: Vec<(String, u16)>,
        next_owner: u64,
        step: usize,
        trace: bool,
        counts: Counts,
    }

    impl PermitSim {
        fn new(seed: u64) -> PermitSim {
            let mut rng = Rng::new(seed ^ 0x9e_4a17);
            let limits = if rng.chance(30) {
                Limits {
                    max_keys: rng.range(1, 4) as usize,
                    max_waiters: rng.range(0, 8) as usize,
                    max_waiters_per_key: rng.range(0, 6) as u32,
                    max_waits_per_conn: rng.range(0, 4) as u32,
                    max_grants: rng.range(1, 12) as usize,
                    ..Limits::default()
                }
            } else {
                Limits::default()
            };
            let conns = rng.range(1, 6) as ConnId;
            // Each key has the limit its clients name (0: plain locks);
            // now and then a client names another (a mismatch).
            let keys = (0..rng.range(1, 3))
                .map(|i| {
                    let limit = *rng.pick(&[0, 1, 2, 3, 5, 65535]);
                    let name = if rng.chance(20) {
                        format!("a-long-permit-key-beyond-the-inline-bytes/{i}")
                    } else {
                        format!("p{i}")
                    };
                    (name, limit)
                })
                .collect();
            let mut model = PermitModel::new(limits, FIRST_TOKEN);
            for conn in 0..conns {
                model.connect(conn);
            }
            PermitSim {
                rng,
                fake: Fake::new(limits, conns),
                model,
                conns,
                open: vec![true; conns as usize],
                keys,
                next_owner: 0,
                step: 0,
                trace: std::env::var_os("KUNCI_SIM_TRACE").is_some(),
                counts: Counts::default(),
            }
        }

        fn log(&self, what: impl FnOnce() -> String) {
            if self.trace {
                eprintln!("[{} @{}] {}", self.step, self.fake.now, what());
            }
        }

        fn seconds(&mut self) -> u8 {
            match self.rng.below(10) {
                0..=6 => self.rng.range(1, 3) as u8,
                7..=8 => self.rng.range(1, 12) as u8,
                _ => self.rng.range(1, 255) as u8,
            }
        }

        fn run(&mut self, steps: usize) -> Result<(), String> {
            for step in 0..steps {
                self.step = step;
                self.one_step()?;
                self.fake.core.check_invariants();
            }
            Ok(())
        }

        fn one_step(&mut self) -> Result<(), String> {
            let open: Vec<ConnId> = (0..self.conns).filter(|&c| self.open[c as usize]).collect();
            let Some(&conn) = (!open.is_empty()).then(|| self.rng.pick(&open)) else {
                return self.reconnect();
            };
            match self.rng.below(100) {
                0..=39 => self.acquire(conn),
                40..=54 => match self.live() {
                    Some((key, token)) => {
                        self.request(conn, &Request::Release { token, key: &key })
                    }
                    None => self.advance(),
                },
                55..=62 => match self.live() {
                    Some((key, token)) => {
                        let lease_s = self.seconds();
                        self.request(
                            conn,
                            &Request::Extend {
                                lease_s,
                                token,
                                key: &key,
                            },
                        )
                    }
                    None => self.advance(),
                },
                63..=66 => {
                    let key = self.rng.pick(&self.keys).0.clone();
                    let token = match self.rng.below(3) {
                        0 => 0,
                        1 => self.model.next_token,
                        _ => FIRST_TOKEN + self.rng.below(self.model.next_token - FIRST_TOKEN + 1),
                    };
                    if self.model.live().contains(&(key.clone(), token)) {
                        return self.advance();
                    }
                    if self.rng.chance(50) {
                        self.request(conn, &Request::Release { token, key: &key })
                    } else {
                        self.request(
                            conn,
                            &Request::Extend {
                                lease_s: 1,
                                token,
                                key: &key,
                            },
                        )
                    }
                }
                67..=72 => {
                    let key = self.rng.pick(&self.keys).0.clone();
                    self.request(conn, &Request::Query { key: &key })
                }
                73 => self.request(conn, &Request::Info),
                74 => {
                    let error = RequestError {
                        code: ErrorCode::InvalidCount,
                        id: self.rng.next(),
                    };
                    self.fake.core.handle_invalid(conn, error);
                    let out = self.fake.drain();
                    same_in_order(&out, &self.model.invalid(conn, error))
                }
                75..=77 => {
                    self.log(|| format!("disconnect {conn}"));
                    let now = self.fake.now;
                    self.fake.core.disconnect(conn, now);
                    let out = self.fake.drain();
                    self.open[conn as usize] = false;
                    let want = self.model.disconnect(conn, now);
                    self.log(|| format!("→ {out:?}"));
                    self.note_grants(&out);
                    same_in_order(&out, &want)
                }
                78..=80 => self.reconnect(),
                _ => self.advance(),
            }
        }

        fn live(&mut self) -> Option<(String, u64)> {
            let live = self.model.live();
            (!live.is_empty()).then(|| self.rng.pick(&live).clone())
        }

        fn acquire(&mut self, conn: ConnId) -> Result<(), String> {
            let (key, key_limit) = self.rng.pick(&self.keys).clone();
            let limit = match self.rng.below(20) {
                0 => key_limit.wrapping_add(1).max(1),
                1..=3 => 0,
                _ => key_limit,
            };
            // take 0 (all) or a count within the limit named.
            let take = if limit == 0 || self.rng.chance(20) {
                0
            } else {
                self.rng.range(1, u64::from(limit.min(4))) as u16
            };
            let wait_s = if self.rng.chance(30) {
                0
            } else {
                self.seconds()
            };
            let lease_s = self.seconds();
            self.next_owner += 1;
            let owner = self.next_owner;
            let label = if self.rng.chance(30) {
                "who@where pid=1"
            } else {
                ""
            };
            let request = Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key: &key,
                limit,
                take,
                label,
            };
            self.request(conn, &request)
        }

        fn request(&mut self, conn: ConnId, request: &Request<'_>) -> Result<(), String> {
            let now = self.fake.now;
            let out = self.fake.request(conn, request);
            self.log(|| format!("{request:?} from {conn} → {out:?}"));
            let want = self.model.request(conn, request, now);
            same_in_order(&out, &want)?;
            for (_, response) in &out {
                match response {
                    Response::Acquired { owner, .. }
                        if Some(owner) == request_owner(request).as_ref() =>
                    {
                        self.counts.granted_at_once += 1;
                        if let Request::Acquire { take: 1.., .. } = request {
                            self.counts.counted_grants += 1;
                        }
                    }
                    Response::Acquired { .. } => self.counts.handed_over += 1,
                    Response::Error { code: 10, .. } => self.counts.mismatches += 1,
                    Response::Timeout { .. } => self.counts.timeouts += 1,
                    Response::Busy { .. } => self.counts.busy += 1,
                    _ => {}
                }
            }
            if out
                .iter()
                .filter(|(_, r)| matches!(r, Response::Acquired { .. }))
                .count()
                >= 2
            {
                self.counts.several_granted_at_once += 1;
            }
            Ok(())
        }

        fn note_grants(&mut self, out: &[(ConnId, Response)]) {
            let granted = out
                .iter()
                .filter(|(_, r)| matches!(r, Response::Acquired { .. }))
                .count() as u64;
            self.counts.handed_over += granted;
            if granted > 1 {
                self.counts.several_granted_at_once += 1;
            }
        }

        fn reconnect(&mut self) -> Result<(), String> {
            let closed: Vec<ConnId> = (0..self.conns)
                .filter(|&c| !self.open[c as usize])
                .collect();
            if closed.is_empty() {
                return self.advance();
            }
            let conn = *self.rng.pick(&closed);
            self.fake.core.connect(conn);
            self.model.connect(conn);
            self.open[conn as usize] = true;
            Ok(())
        }

        /// Moves the clock, often exactly onto the next deadline.
        fn advance(&mut self) -> Result<(), String> {
            let now = self.fake.now;
            let target = match self.rng.below(10) {
                0..=3 => self.fake.core.poll_timeout().unwrap_or(now + 1),
                4..=5 => self
                    .model
                    .earliest_tick()
                    .map_or(now + S, |tick| tick * MS - 1),
                6..=8 => now + self.rng.below(3 * S),
                _ => now + self.rng.range(1, 60) * S,
            }
            .max(now);
            self.fire(target)
        }

        fn fire(&mut self, now: Micros) -> Result<(), String> {
            let out = self.fake.run_until(now);
            if !out.is_empty() {
                self.log(|| format!("fire → {out:?}"));
            }
            let before = self.model.counters.expired;
            let want = self.model.timeout(now, &out)?;
            same_as_multiset(&out, &want)?;
            self.counts.expired += self.model.counters.expired - before;
            self.counts.timeouts += out
                .iter()
                .filter(|(_, r)| matches!(r, Response::Timeout { .. }))
                .count() as u64;
            self.note_grants(&out);
            Ok(())
        }
    }

    fn request_owner(request: &Request<'_>) -> Option<u64> {
        match *request {
            Request::Acquire { owner, .. } => Some(owner),
            _ => None,
        }
    }

    fn run_seed(seed: u64, steps: usize) -> Counts {
        let mut sim = PermitSim::new(seed);
        match sim.run(steps) {
            Ok(()) => sim.counts,
            Err(message) => panic!(
                "permit simulation seed {seed} failed at step {} (time {} µs): {message}\n\
                 re-run with KUNCI_PERMIT_SEED={seed} KUNCI_SIM_TRACE=1 cargo test --release permits",
                sim.step, sim.fake.now
            ),
        }
    }

    #[test]
    fn simulation_of_semaphores_and_shared_locks_against_the_permit_model() {
        let default_seeds = if cfg!(debug_assertions) { 200 } else { 2_000 };
        let steps = env_u64("KUNCI_SIM_STEPS").unwrap_or(1_000) as usize;
        let seeds: Vec<u64> = match env_u64("KUNCI_PERMIT_SEED") {
            Some(seed) => vec![seed],
            None => (0..env_u64("KUNCI_PERMIT_SEEDS").unwrap_or(default_seeds)).collect(),
        };
        let started = Instant::now();
        let mut counts = Counts::default();
        for &seed in &seeds {
            let seed_counts = run_seed(seed, steps);
            counts.granted_at_once += seed_counts.granted_at_once;
            counts.counted_grants += seed_counts.counted_grants;
            counts.several_granted_at_once += seed_counts.several_granted_at_once;
            counts.handed_over += seed_counts.handed_over;
            counts.mismatches += seed_counts.mismatches;
            counts.timeouts += seed_counts.timeouts;
            counts.busy += seed_counts.busy;
            counts.expired += seed_counts.expired;
        }
        eprintln!(
            "permit simulation: {} seeds × {steps} steps in {:.2?}: {counts:?}",
            seeds.len(),
            started.elapsed()
        );
        if seeds.len() >= 100 {
            let reached = [
                counts.granted_at_once,
                counts.counted_grants,
                counts.several_granted_at_once,
                counts.handed_over,
                counts.mismatches,
                counts.timeouts,
                counts.busy,
                counts.expired,
            ];
            assert!(reached.iter().all(|&n| n > 100), "{counts:?}");
        }
    }
}
