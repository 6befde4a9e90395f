//! A seeded simulation of the engine against fake servers on a fake clock:
//! random calls, connects that succeed, fail or hang, sockets that take
//! part of a batch, answers split anywhere and acquires answered out of
//! order, refusals at accept (`X 7`), resets, and time jumps. After every
//! step the engine's [`invariants`](Engine::invariants) hold, and as the
//! calls end, the §8 rules as a caller and a server see them: every call
//! ends exactly once and never after its deadline's tick; a request the
//! server executed is never `Unavailable`, and one certainly not sent is
//! `Unavailable` only at its deadline; no request is executed twice; an
//! outcome that reports an answer is the answer the server gave.
//! `KUNCI_ENGINE_SEED=S` re-runs one seed.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::{Action, Engine, Key, Op, Outcome, Submission};
use crate::client::permits::{Label, Permits};
use crate::client::vocabulary::TRANSPORT_DEADLINE;
use crate::protocol::{self, Decoded, ErrorCode, Request, Response};

const MS: Duration = Duration::from_millis(1);

/// splitmix64, as the integration tests' simulations use.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (((z ^ (z >> 31)) as u128 * n as u128) >> 64) as u64
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What ties a request to its answer, for the calls that carry an id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Tag {
    Acquire(u64),
    Release(u64),
    Ping(u64),
    Observe(u64),
    Holders(u64),
}

fn tag_of(request: &Request<'_>) -> Option<Tag> {
    match *request {
        Request::Acquire { owner, .. } => Some(Tag::Acquire(owner)),
        Request::Release { token, .. } => Some(Tag::Release(token)),
        Request::Ping { nonce } => Some(Tag::Ping(nonce)),
        Request::Observe { id, .. } => Some(Tag::Observe(id)),
        Request::Holders { id, .. } => Some(Tag::Holders(id)),
        _ => None,
    }
}

/// One server-side connection.
#[derive(Default)]
struct Peer {
    /// The engine has it up.
    up: bool,
    /// Refuses at accept: its first frame is `X 7` and it executes nothing.
    refusing: bool,
    /// Bytes the socket took, not yet a whole frame.
    inbox: Vec<u8>,
    /// Executed, not yet answered: acquires by owner (answered in any
    /// order), the others with their answer (in order).
    unanswered: VecDeque<(Option<u64>, Response)>,
    /// Answers not yet read by the engine.
    outbox: Vec<u8>,
}

struct Call {
    tag: Option<Tag>,
    deadline: Instant,
    ended: bool,
}

struct Sim {
    rng: Rng,
    engine: Engine<u32>,
    now: Instant,
    peers: Vec<Peer>,
    /// Connects the engine asked for and nobody decided yet.
    connecting: Vec<usize>,
    calls: Vec<Call>,
    /// Everything the servers executed, with the answer each gave (once
    /// given).
    executed: HashMap<Tag, Option<Response>>,
    next_id: u64,
    next_token: u64,
    step: usize,
    /// How many calls ended each way, to show the seeds reach them all.
    outcomes: HashMap<&'static str, u64>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = Rng(seed ^ 0xc1_1e47);
        let servers = 1 + rng.below(3) as usize;
        let per_server = 1 + rng.below(2) as usize;
        let now = Instant::now();
        let engine = Engine::new(servers, per_server, Duration::from_secs(1), now);
        Sim {
            rng,
            engine,
            now,
            peers: (0..servers * per_server).map(|_| Peer::default()).collect(),
            connecting: Vec::new(),
            calls: Vec::new(),
            executed: HashMap::new(),
            next_id: 1,
            next_token: 1,
            step: 0,
            outcomes: HashMap::new(),
        }
    }

    fn run(&mut self, steps: usize) -> Result<(), String> {
        for step in 0..steps {
            self.step = step;
            match self.rng.below(100) {
                0..=24 => self.submit(),
                25..=34 => self.decide_connect(),
                35..=54 => self.write(),
                55..=69 => self.answer(),
                70..=84 => self.deliver(false),
                85..=87 => self.reset(),
                _ => {
                    let ms = match self.rng.chance(80) {
                        true => self.rng.below(50),
                        false => self.rng.below(1_500),
                    };
                    let by = Duration::from_millis(ms);
                    self.advance(by)?;
                }
            }
            self.after_step()?;
        }
        // Nothing more is answered: every call ends by its deadline.
        for _ in 0..10_000 {
            if self.engine.is_idle() {
                break;
            }
            self.connecting.clear();
            self.advance(Duration::from_secs(1))?;
            self.after_step()?;
        }
        if let Some(index) = self.calls.iter().position(|call| !call.ended) {
            return Err(format!("call {index} never ended"));
        }
        Ok(())
    }

    fn submit(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let mut deadline = self.now + Duration::from_millis(self.rng.below(3_000));
        let op = match self.rng.below(5) {
            0 | 1 => {
                let wait = Duration::from_millis(self.rng.below(2_000));
                let wait_until = (!wait.is_zero()).then(|| self.now + wait);
                deadline = self.now + wait + TRANSPORT_DEADLINE;
                Op::Acquire {
                    owner: id,
                    lease_s: 5,
                    wait_until,
                    permits: Permits::exclusive(),
                    label: Label::new("").unwrap(),
                    campaign: false,
                }
            }
            // Tokens the servers never grant, so each release is unique.
            2 => Op::Release {
                token: 1 << 40 | id,
            },
            3 => Op::Ping { nonce: id },
            _ => Op::Observe {
                id,
                since: 0,
                wait_s: 0,
                seen: None,
            },
        };
        let tag = match op {
            Op::Acquire { owner, .. } => Some(Tag::Acquire(owner)),
            Op::Release { token } => Some(Tag::Release(token)),
            Op::Ping { nonce } => Some(Tag::Ping(nonce)),
            Op::Observe { id, .. } => Some(Tag::Observe(id)),
            _ => None,
        };
        let call = self.calls.len() as u32;
        self.calls.push(Call {
            tag,
            deadline,
            ended: false,
        });
        let submission = Submission {
            op,
            key: Key::new("k").unwrap(),
            deadline,
            reply: Some(call),
        };
        self.engine.submit(submission, self.now);
    }

    /// A connect the engine asked for succeeds (now and then at a server
    /// that refuses it at accept), fails, or stays pending.
    fn decide_connect(&mut self) {
        if self.connecting.is_empty() {
            return;
        }
        let index = self.rng.below(self.connecting.len() as u64) as usize;
        let s = self.connecting.swap_remove(index);
        match self.rng.below(10) {
            0..=5 => {
                self.peers[s] = Peer {
                    up: true,
                    ..Peer::default()
                };
                self.engine.connected(s, self.now);
            }
            6 => {
                let mut refusal = Vec::new();
                protocol::encode_response(&ErrorCode::ConnectionLimit.response(0), &mut refusal);
                self.peers[s] = Peer {
                    up: true,
                    refusing: true,
                    outbox: refusal,
                    ..Peer::default()
                };
                self.engine.connected(s, self.now);
            }
            7 | 8 => self.engine.connect_failed(s, self.now),
            _ => self.connecting.push(s),
        }
    }

    /// One write on a random session: the socket takes all, some or none.
    fn write(&mut self) {
        let s = self.rng.below(self.peers.len() as u64) as usize;
        let Some(bytes) = self.engine.poll_transmit(s, self.now) else {
            return;
        };
        let taken = match self.rng.below(4) {
            0 => 0,
            1 => self.rng.below(bytes.len() as u64 + 1) as usize,
            _ => bytes.len(),
        };
        let peer = &mut self.peers[s];
        peer.inbox.extend_from_slice(&bytes[..taken]);
        self.engine.transmitted(s, taken);
        if peer.refusing {
            peer.inbox.clear();
            return;
        }
        let mut used = 0;
        while let Decoded::Request { request, len } = protocol::decode_request(&peer.inbox[used..])
        {
            used += len;
            let tag = tag_of(&request);
            if let Some(tag) = tag {
                // Never sent twice: each call's tag is executed once.
                assert!(
                    self.executed.insert(tag, None).is_none(),
                    "{tag:?} executed twice"
                );
            }
            let answer = match request {
                Request::Acquire { owner, .. } => (Some(owner), Response::Timeout { owner }),
                Request::Release { token, .. } => (None, Response::Released { token }),
                Request::Ping { nonce } => (None, Response::Pong { nonce }),
                Request::Observe { id, .. } => (
                    None,
                    Response::KeyState {
                        id,
                        token: 0,
                        lease_ms: 0,
                        held_ms: 0,
                        grants: 0,
                        waiters: 0,
                        label: String::new(),
                    },
                ),
                Request::Holders { id, .. } => (
                    None,
                    Response::End {
                        id,
                        count: 0,
                        next: 0,
                    },
                ),
                other => panic!("the engine sent {other:?}"),
            };
            peer.unanswered.push_back(answer);
        }
        peer.inbox.drain(..used);
    }

    /// A server answers one request: the oldest, or any acquire (granted,
    /// timed out or busy).
    fn answer(&mut self) {
        let busy: Vec<usize> = (0..self.peers.len())
            .filter(|&s| !self.peers[s].unanswered.is_empty())
            .collect();
        if busy.is_empty() {
            return;
        }
        let s = busy[self.rng.below(busy.len() as u64) as usize];
        let peer = &mut self.peers[s];
        let acquires: Vec<usize> = (0..peer.unanswered.len())
            .filter(|&i| peer.unanswered[i].0.is_some())
            .collect();
        let index = match acquires.len() {
            0 => 0,
            n if self.rng.chance(50) => acquires[self.rng.below(n as u64) as usize],
            _ => 0,
        };
        let Some((owner, mut response)) = peer.unanswered.remove(index) else {
            return;
        };
        if let Some(owner) = owner {
            response = match self.rng.below(3) {
                0 => {
                    self.next_token += 1;
                    Response::Acquired {
                        owner,
                        token: self.next_token,
                    }
                }
                1 => Response::Timeout { owner },
                _ => Response::Busy { owner },
            };
        }
        protocol::encode_response(&response, &mut peer.outbox);
        let tag = match response {
            Response::Acquired { owner, .. }
            | Response::Timeout { owner }
            | Response::Busy { owner } => Some(Tag::Acquire(owner)),
            Response::Released { token } => Some(Tag::Release(token)),
            Response::Pong { nonce } => Some(Tag::Ping(nonce)),
            Response::KeyState { id, .. } => Some(Tag::Observe(id)),
            Response::End { id, .. } => Some(Tag::Holders(id)),
            _ => None,
        };
        if let Some(tag) = tag {
            self.executed.insert(tag, Some(response));
        }
    }

    /// The engine reads what one server sent: all of it, or a prefix.
    fn deliver(&mut self, all: bool) {
        let sending: Vec<usize> = (0..self.peers.len())
            .filter(|&s| !self.peers[s].outbox.is_empty())
            .collect();
        if !sending.is_empty() {
            let s = sending[self.rng.below(sending.len() as u64) as usize];
            self.deliver_on(s, all);
        }
    }

    fn deliver_on(&mut self, s: usize, all: bool) {
        let peer = &mut self.peers[s];
        if !peer.up || peer.outbox.is_empty() {
            return;
        }
        let len = match all {
            true => peer.outbox.len(),
            false => 1 + self.rng.below(peer.outbox.len() as u64) as usize,
        };
        let bytes: Vec<u8> = peer.outbox.drain(..len).collect();
        self.engine.handle_input(s, &bytes, self.now);
    }

    /// A server's connection resets.
    fn reset(&mut self) {
        let s = self.rng.below(self.peers.len() as u64) as usize;
        if self.peers[s].up {
            self.peers[s] = Peer::default();
            self.engine.session_closed(s, self.now);
        }
    }

    /// Time passes by `by`, the timers firing at every instant the engine
    /// asks for on the way.
    fn advance(&mut self, by: Duration) -> Result<(), String> {
        let until = self.now + by;
        while let Some(at) = self.engine.poll_timeout().filter(|&at| at <= until) {
            self.now = self.now.max(at);
            self.engine.handle_timeout(self.now);
            self.after_step()?;
            self.engine.expire(self.now);
            self.after_step()?;
        }
        self.now = until;
        Ok(())
    }

    /// Performs the engine's actions, checks its invariants and every call
    /// that ended.
    fn after_step(&mut self) -> Result<(), String> {
        while let Some(action) = self.engine.poll_action() {
            match action {
                Action::Connect(s) => self.connecting.push(s),
                Action::Close(s) => {
                    self.peers[s] = Peer::default();
                    self.connecting.retain(|&c| c != s);
                }
                Action::Drain(s) => self.deliver_on(s, true),
            }
        }
        self.engine.invariants()?;
        while let Some((call, outcome)) = self.engine.poll_completion() {
            self.ended(call as usize, &outcome)?;
        }
        Ok(())
    }

    fn ended(&mut self, index: usize, outcome: &Outcome) -> Result<(), String> {
        let now = self.now;
        let call = &mut self.calls[index];
        if std::mem::replace(&mut call.ended, true) {
            return Err(format!("call {index} ended twice, now {outcome:?}"));
        }
        // Deadlines round up to the next 1 ms tick, never down.
        if now > call.deadline + MS {
            return Err(format!(
                "call {index} ended {:?} after its deadline: {outcome:?}",
                now - call.deadline
            ));
        }
        let kind = match outcome {
            Outcome::Acquired { .. } => "acquired",
            Outcome::Timeout => "timeout",
            Outcome::Busy => "busy",
            Outcome::Unavailable(_) => "unavailable",
            Outcome::Indeterminate => "indeterminate",
            Outcome::Released => "released",
            Outcome::Pong { .. } => "pong",
            Outcome::Observed(_) => "observed",
            _ => "other",
        };
        *self.outcomes.entry(kind).or_default() += 1;
        let Some(tag) = call.tag else {
            return Ok(());
        };
        let executed = self.executed.get(&tag);
        let answered = executed.and_then(Option::as_ref);
        let agrees = match outcome {
            Outcome::Unavailable(_) => executed.is_none() && now >= call.deadline,
            Outcome::Indeterminate => true,
            Outcome::Acquired { token, .. } => {
                matches!(answered, Some(Response::Acquired { token: t, .. }) if t == token)
            }
            Outcome::Timeout => matches!(answered, Some(Response::Timeout { .. })),
            Outcome::Busy => matches!(answered, Some(Response::Busy { .. })),
            Outcome::Released => matches!(answered, Some(Response::Released { .. })),
            Outcome::Pong { .. } => matches!(answered, Some(Response::Pong { .. })),
            Outcome::Observed(_) => matches!(answered, Some(Response::KeyState { .. })),
            _ => false,
        };
        if !agrees {
            return Err(format!(
                "call {index} ({tag:?}) ended {outcome:?}; the server executed it: {executed:?}"
            ));
        }
        Ok(())
    }
}

#[test]
fn the_engine_against_fake_servers_keeps_its_invariants_and_the_rules() {
    let seeds: Vec<u64> = match std::env::var("KUNCI_ENGINE_SEED") {
        Ok(seed) => vec![seed.parse().expect("KUNCI_ENGINE_SEED is a number")],
        Err(_) => (0..if cfg!(debug_assertions) { 50 } else { 300 }).collect(),
    };
    let mut outcomes: HashMap<&'static str, u64> = HashMap::new();
    for seed in seeds.iter().copied() {
        let mut sim = Sim::new(seed);
        if let Err(problem) = sim.run(400) {
            panic!(
                "engine simulation seed {seed}, step {}: {problem}\n\
                 re-run with KUNCI_ENGINE_SEED={seed}",
                sim.step
            );
        }
        for (kind, count) in sim.outcomes {
            *outcomes.entry(kind).or_default() += count;
        }
    }
    eprintln!("engine simulation: {} seeds: {outcomes:?}", seeds.len());
    if seeds.len() > 1 {
        let kinds = [
            "acquired",
            "timeout",
            "busy",
            "unavailable",
            "indeterminate",
            "released",
            "pong",
            "observed",
        ];
        assert!(
            kinds.iter().all(|kind| outcomes.get(kind) > Some(&100)),
            "{outcomes:?}"
        );
    }
}
