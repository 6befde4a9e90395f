//! The simulation of keys with permits (spec §10): `S` of every kind mixed
//! with plain `A` on a few keys, releases and renewals of any grant, wrong
//! tokens, mismatched limits, closes, timeouts and expiries, against the
//! permit model ([`PermitModel`](crate::util::model::PermitModel)), which
//! writes out the fit rule, strict FIFO and the order of tokens; every
//! answer must be the model's exactly, and the core checks its own
//! invariants after every step. `KUNCI_PERMIT_SEEDS=N`,
//! `KUNCI_PERMIT_SEED=S` (with `KUNCI_SIM_TRACE=1`) and `KUNCI_SIM_STEPS`
//! as for the other simulation.

use kunci::core::{ConnId, Limits, Micros};
use kunci::protocol::{ErrorCode, Request, RequestError, Response};

use super::{Rng, Simulation, Tally, pick_conn, run_seeds};
use crate::util::fake::{FIRST_TOKEN, Fake, MS, S};
use crate::util::model::{PermitModel, lease_ms_left, same_as_multiset, same_in_order};

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
    pub key_states: u64,
    /// Reads of a key with several grants.
    pub key_states_shared: u64,
}

impl Tally for Counts {
    fn add(&mut self, other: &Counts) {
        self.granted_at_once += other.granted_at_once;
        self.counted_grants += other.counted_grants;
        self.several_granted_at_once += other.several_granted_at_once;
        self.handed_over += other.handed_over;
        self.mismatches += other.mismatches;
        self.timeouts += other.timeouts;
        self.busy += other.busy;
        self.expired += other.expired;
        self.key_states += other.key_states;
        self.key_states_shared += other.key_states_shared;
    }
}

struct PermitSim {
    rng: Rng,
    fake: Fake,
    model: PermitModel,
    open: Vec<bool>,
    keys: Vec<(String, u16)>,
    next_owner: u64,
    step: usize,
    trace: bool,
    counts: Counts,
}

impl Simulation for PermitSim {
    type Counts = Counts;
    const NAME: &'static str = "permit simulation";

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
            open: vec![true; conns as usize],
            keys,
            next_owner: 0,
            step: 0,
            trace: std::env::var_os("KUNCI_SIM_TRACE").is_some(),
            counts: Counts::default(),
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

    fn position(&self) -> String {
        format!("step {} (time {} µs)", self.step, self.fake.now)
    }

    fn counts(&self) -> Counts {
        self.counts
    }

    fn rerun(seed: u64) -> String {
        format!(
            "re-run with KUNCI_PERMIT_SEED={seed} KUNCI_SIM_TRACE=1 cargo test --release permits"
        )
    }
}

impl PermitSim {
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

    fn one_step(&mut self) -> Result<(), String> {
        let Some(conn) = pick_conn(&mut self.rng, &self.open, true) else {
            return self.reconnect();
        };
        match self.rng.below(100) {
            0..=39 => self.acquire(conn),
            40..=54 => match self.live() {
                Some((key, token)) => self.request(conn, &Request::Release { token, key: &key }),
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
            81..=84 => self.read_key_state(conn),
            _ => self.advance(),
        }
    }

    /// One `O` with `wait` 0 (a read, spec §13.1–13.2): on a key with
    /// permits the current token is the smallest of its grants, `grants`
    /// counts them all. (The time held and the label are the core
    /// simulation's to check: the permit model keeps neither.)
    fn read_key_state(&mut self, conn: ConnId) -> Result<(), String> {
        let key = self.rng.pick(&self.keys).0.clone();
        let id = self.rng.next();
        let since = if self.rng.chance(50) {
            0
        } else {
            self.model.next_token
        };
        let request = Request::Observe {
            wait_s: 0,
            id,
            since,
            key: &key,
        };
        let now = self.fake.now;
        let out = self.fake.request(conn, &request);
        self.log(|| format!("{request:?} from {conn} → {out:?}"));
        let (token, lease_ms, grants, waiters) = match self.model.keys.get(&key) {
            Some(state) => state.grants.first().map_or((0, 0, 0, 0), |first| {
                (
                    first.token,
                    lease_ms_left(first.lease_tick, now),
                    state.grants.len() as u16,
                    state.queue.len() as u32,
                )
            }),
            None => (0, 0, 0, 0),
        };
        match out.as_slice() {
            [
                (
                    to,
                    Response::KeyState {
                        id: got,
                        token: got_token,
                        lease_ms: got_lease,
                        grants: got_grants,
                        waiters: got_waiters,
                        ..
                    },
                ),
            ] if *to == conn
                && *got == id
                && (*got_token, *got_lease, *got_grants, *got_waiters)
                    == (token, lease_ms, grants, waiters) =>
            {
                self.counts.key_states += 1;
                self.counts.key_states_shared += u64::from(grants >= 2);
                Ok(())
            }
            _ => Err(format!(
                "O on {key:?}: {out:?}, expected token {token} lease_ms {lease_ms} grants {grants} waiters {waiters}"
            )),
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
        let Some(conn) = pick_conn(&mut self.rng, &self.open, false) else {
            return self.advance();
        };
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

#[test]
fn simulation_of_semaphores_and_shared_locks_against_the_permit_model() {
    let default_seeds = if cfg!(debug_assertions) { 200 } else { 2_000 };
    let (counts, seeds) =
        run_seeds::<PermitSim>("KUNCI_PERMIT_SEED", "KUNCI_PERMIT_SEEDS", default_seeds);
    if seeds >= 100 {
        let reached = [
            counts.granted_at_once,
            counts.counted_grants,
            counts.several_granted_at_once,
            counts.handed_over,
            counts.mismatches,
            counts.timeouts,
            counts.busy,
            counts.expired,
            counts.key_states,
            counts.key_states_shared,
        ];
        assert!(reached.iter().all(|&n| n > 100), "{counts:?}");
    }
}
