//! The §8 rules, one by one, on the sans-IO engine with a fake clock.

use std::time::{Duration, Instant};

use super::engine::{Action, Engine, wire_wait_s};
use super::permits::Label;
use super::vocabulary::{Key, Op, Outcome, Submission};
use super::*;
use crate::protocol::{self, Decoded, Request, Response};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

/// An engine on a fake clock; replies are numbered calls.
struct Harness {
    engine: Checked,
    start: Instant,
    now: Instant,
    /// Completions a test collected on the way.
    completions_seen: Vec<(u32, Outcome)>,
}

/// The engine, checking its invariants after every call that can change
/// it (the same calls, so the tests read as if they drove it directly).
struct Checked(Engine<u32>);

impl Checked {
    fn checked<T>(&mut self, call: impl FnOnce(&mut Engine<u32>) -> T) -> T {
        let result = call(&mut self.0);
        self.0.check_invariants();
        result
    }

    fn submit(&mut self, submission: Submission<u32>, now: Instant) {
        self.checked(|engine| engine.submit(submission, now))
    }

    fn release_in_background(&mut self, key: Key, token: u64, now: Instant) {
        self.checked(|engine| engine.release_in_background(key, token, now))
    }

    fn authenticate_with(&mut self, secret: Secret) {
        self.checked(|engine| engine.authenticate_with(secret))
    }

    fn poll_action(&mut self) -> Option<Action> {
        self.checked(Engine::poll_action)
    }

    fn poll_completion(&mut self) -> Option<(u32, Outcome)> {
        self.checked(Engine::poll_completion)
    }

    fn poll_timeout(&self) -> Option<Instant> {
        self.0.poll_timeout()
    }

    fn is_idle(&self) -> bool {
        self.0.is_idle()
    }

    fn handle_timeout(&mut self, now: Instant) {
        self.checked(|engine| engine.handle_timeout(now))
    }

    fn expire(&mut self, now: Instant) {
        self.checked(|engine| engine.expire(now))
    }

    fn connected(&mut self, s: usize, now: Instant) {
        self.checked(|engine| engine.connected(s, now))
    }

    fn connect_failed(&mut self, s: usize, now: Instant) {
        self.checked(|engine| engine.connect_failed(s, now))
    }

    fn connect_refused(&mut self, s: usize, now: Instant) {
        self.checked(|engine| engine.connect_refused(s, now))
    }

    fn end_at_refusal(&mut self) {
        self.checked(Engine::end_at_refusal)
    }

    fn session_closed(&mut self, s: usize, now: Instant) {
        self.checked(|engine| engine.session_closed(s, now))
    }

    /// Checked once the batch is encoded, before its bytes are handed out
    /// (asking again returns the same bytes and changes nothing).
    fn poll_transmit(&mut self, s: usize, now: Instant) -> Option<&[u8]> {
        self.checked(|engine| engine.poll_transmit(s, now).is_some())
            .then(|| self.0.poll_transmit(s, now))
            .flatten()
    }

    fn transmitted(&mut self, s: usize, written: usize) {
        self.checked(|engine| engine.transmitted(s, written))
    }

    fn handle_input(&mut self, s: usize, data: &[u8], now: Instant) {
        self.checked(|engine| engine.handle_input(s, data, now))
    }
}

/// A request frame as the server would decode it.
#[derive(Debug, PartialEq, Eq)]
enum Frame {
    A {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: String,
    },
    S {
        wait_s: u8,
        lease_s: u8,
        owner: u64,
        key: String,
        limit: u16,
        take: u16,
        label: String,
    },
    R {
        token: u64,
        key: String,
    },
    E {
        lease_s: u8,
        token: u64,
        key: String,
    },
    Q {
        key: String,
    },
    P {
        nonce: u64,
    },
    I,
    H {
        id: u64,
        key: String,
    },
    L {
        id: u64,
        cursor: u64,
        count: u16,
        prefix: String,
    },
    U {
        secret: Vec<u8>,
    },
    O {
        wait_s: u8,
        id: u64,
        since: u64,
        key: String,
    },
    C {
        token: u64,
        key: String,
        label: String,
    },
}

fn frames(mut bytes: &[u8]) -> Vec<Frame> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let Decoded::Request { request, len } = protocol::decode_request(bytes) else {
            panic!("bad frame in {bytes:?}");
        };
        out.push(match request {
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
                ..
            } if bytes[0] == b'A' => Frame::A {
                wait_s,
                lease_s,
                owner,
                key: key.into(),
            },
            Request::Acquire {
                wait_s,
                lease_s,
                owner,
                key,
                limit,
                take,
                label,
            } => Frame::S {
                wait_s,
                lease_s,
                owner,
                key: key.into(),
                limit,
                take,
                label: label.into(),
            },
            Request::Release { token, key } => Frame::R {
                token,
                key: key.into(),
            },
            Request::Extend {
                lease_s,
                token,
                key,
            } => Frame::E {
                lease_s,
                token,
                key: key.into(),
            },
            Request::Query { key } => Frame::Q { key: key.into() },
            Request::Ping { nonce } => Frame::P { nonce },
            Request::Info => Frame::I,
            Request::Holders { id, key } => Frame::H {
                id,
                key: key.into(),
            },
            Request::List {
                id,
                cursor,
                count,
                prefix,
            } => Frame::L {
                id,
                cursor,
                count,
                prefix: prefix.into(),
            },
            Request::Authenticate { secret } => Frame::U {
                secret: secret.to_vec(),
            },
            Request::Observe {
                wait_s,
                id,
                since,
                key,
            } => Frame::O {
                wait_s,
                id,
                since,
                key: key.into(),
            },
            Request::Proclaim { token, key, label } => Frame::C {
                token,
                key: key.into(),
                label: label.into(),
            },
        });
        bytes = &bytes[len..];
    }
    out
}

fn answer(response: Response) -> Vec<u8> {
    let mut out = Vec::new();
    protocol::encode_response(&response, &mut out);
    out
}

impl Harness {
    /// `servers` addresses with one session each.
    fn new(servers: usize) -> Harness {
        Harness::with_sessions(servers, 1)
    }

    fn with_sessions(servers: usize, per_server: usize) -> Harness {
        let start = Instant::now();
        Harness {
            engine: Checked(Engine::new(servers, per_server, S, start)),
            start,
            now: start,
            completions_seen: Vec::new(),
        }
    }

    fn at(&mut self, offset: Duration) -> Instant {
        self.now = self.start + offset;
        self.now
    }

    fn acquire(&mut self, call: u32, owner: u64, wait: Duration) {
        self.acquire_permits(call, owner, wait, Permits::exclusive(), "");
    }

    fn acquire_permits(
        &mut self,
        call: u32,
        owner: u64,
        wait: Duration,
        permits: Permits,
        label: &str,
    ) {
        let wait_until = self.now + wait;
        self.engine.submit(
            Submission {
                op: Op::Acquire {
                    owner,
                    lease_s: 7,
                    wait_until: (!wait.is_zero()).then_some(wait_until),
                    permits,
                    label: Label::new(label).unwrap(),
                    campaign: false,
                },
                key: Key::new("k").unwrap(),
                deadline: wait_until + TRANSPORT_DEADLINE,
                reply: Some(call),
            },
            self.now,
        );
    }

    fn other(&mut self, call: u32, op: Op) {
        self.engine.submit(
            Submission {
                op,
                key: Key::new("k").unwrap(),
                deadline: self.now + TRANSPORT_DEADLINE,
                reply: Some(call),
            },
            self.now,
        );
    }

    fn actions(&mut self) -> Vec<Action> {
        std::iter::from_fn(|| self.engine.poll_action()).collect()
    }

    fn completions(&mut self) -> Vec<(u32, Outcome)> {
        std::iter::from_fn(|| self.engine.poll_completion()).collect()
    }

    /// Writes everything session `s` has, the socket taking it all.
    fn write(&mut self, s: usize) -> Vec<Frame> {
        let mut all = Vec::new();
        while let Some(bytes) = self.engine.poll_transmit(s, self.now) {
            all.extend_from_slice(bytes);
            let n = bytes.len();
            self.engine.transmitted(s, n);
        }
        frames(&all)
    }

    /// Runs the timers at `now` the way the I/O thread does, draining
    /// nothing in between.
    fn timeout(&mut self) -> Vec<Action> {
        self.engine.handle_timeout(self.now);
        let mut actions = self.actions();
        self.engine.expire(self.now);
        actions.extend(self.actions());
        actions
    }

    fn input(&mut self, s: usize, response: Response) {
        self.engine.handle_input(s, &answer(response), self.now);
    }
}

fn a(wait_s: u8, owner: u64) -> Frame {
    Frame::A {
        wait_s,
        lease_s: 7,
        owner,
        key: "k".into(),
    }
}

#[test]
fn input_is_validated_without_clamping() {
    assert!(Key::new("").is_err());
    assert!(Key::new(&"x".repeat(256)).is_err());
    assert!(Key::new("a\nb").is_err());
    assert_eq!(
        Key::new(&"é".repeat(127)).unwrap().as_str(),
        "é".repeat(127)
    );
    assert_eq!(lease_seconds(S), Ok(1));
    assert_eq!(lease_seconds(255 * S), Ok(255));
    for bad in [Duration::ZERO, 256 * S, S + MS, S / 2] {
        assert!(
            matches!(lease_seconds(bad), Err(Error::InvalidArgument(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn wire_wait_rounds_up_and_zero_stays_zero() {
    let now = Instant::now();
    assert_eq!(wire_wait_s(None, now), 0);
    assert_eq!(wire_wait_s(Some(now + 3 * S), now), 3);
    assert_eq!(wire_wait_s(Some(now + 2 * S + MS), now), 3);
    assert_eq!(wire_wait_s(Some(now + Duration::from_nanos(1)), now), 1);
    assert_eq!(wire_wait_s(Some(now), now), 0);
    assert_eq!(wire_wait_s(Some(now), now + S), 0);
    assert_eq!(wire_wait_s(Some(now + 255 * S), now), 255);
}

#[test]
fn valid_until_subtracts_the_drift_margin() {
    let sent = Instant::now();
    assert_eq!(drift_margin(30 * S), Duration::from_millis(70));
    assert_eq!(
        valid_until(sent, 30 * S),
        sent + 30 * S - Duration::from_millis(70)
    );
    assert_eq!(valid_until(sent, S), sent + S - Duration::from_millis(12));
}

#[test]
fn connects_lazily_and_writes_the_wait_computed_at_write_time() {
    let mut h = Harness::new(2);
    assert_eq!(h.actions(), []);
    assert_eq!(h.engine.poll_timeout(), None);
    h.acquire(1, 42, 3 * S);
    assert_eq!(h.actions(), [Action::Connect(0), Action::Connect(1)]);
    // Session 1 connects 1.2 s later: 1.8 s of the wait are left → 2.
    h.at(1200 * MS);
    h.engine.connected(1, h.now);
    assert_eq!(h.write(0), []);
    assert_eq!(h.write(1), [a(2, 42)]);
    h.input(
        1,
        Response::Acquired {
            owner: 42,
            token: 9,
        },
    );
    assert_eq!(
        h.completions(),
        [(
            1,
            Outcome::Acquired {
                token: 9,
                sent_at: h.now
            }
        )]
    );
}

#[test]
fn a_request_that_would_block_is_encoded_again_at_the_next_write() {
    let mut h = Harness::new(1);
    h.acquire(1, 1, 10 * S);
    h.actions();
    h.engine.connected(0, h.now);
    let bytes = h.engine.poll_transmit(0, h.now).unwrap().to_vec();
    assert_eq!(frames(&bytes), [a(10, 1)]);
    h.engine.transmitted(0, 0);
    h.at(2500 * MS);
    assert_eq!(h.write(0), [a(8, 1)]);
}

#[test]
fn a_partly_written_batch_keeps_the_sent_part_and_reencodes_the_rest() {
    let mut h = Harness::new(1);
    h.acquire(1, 1, 10 * S);
    h.acquire(2, 2, 10 * S);
    h.actions();
    h.engine.connected(0, h.now);
    let bytes = h.engine.poll_transmit(0, h.now).unwrap().to_vec();
    assert_eq!(frames(&bytes), [a(10, 1), a(10, 2)]);
    // The socket takes 3 bytes of the first frame only.
    h.engine.transmitted(0, 3);
    h.at(4 * S + MS);
    let rest = h.engine.poll_transmit(0, h.now).unwrap().to_vec();
    assert_eq!(rest, bytes[3..bytes.len() / 2]);
    h.engine.transmitted(0, rest.len());
    // The second frame is encoded afresh: 5.999 s left → 6.
    assert_eq!(h.write(0), [a(6, 2)]);
}

#[test]
fn certainly_not_sent_moves_to_another_session_with_the_same_owner() {
    let mut h = Harness::new(2);
    h.acquire(1, 77, Duration::ZERO);
    h.actions();
    h.engine.connected(0, h.now);
    let _ = h.engine.poll_transmit(0, h.now).unwrap();
    h.engine.transmitted(0, 0);
    // Session 0 dies before the socket took a byte.
    h.engine.session_closed(0, h.now);
    assert_eq!(h.actions(), [Action::Close(0), Action::Connect(0)]);
    assert_eq!(h.completions(), []);
    h.at(300 * MS);
    h.engine.connected(1, h.now);
    assert_eq!(h.write(1), [a(0, 77)]);
    h.input(1, Response::Timeout { owner: 77 });
    assert_eq!(h.completions(), [(1, Outcome::Timeout)]);
}

#[test]
fn possibly_sent_is_never_sent_again() {
    let mut h = Harness::new(2);
    h.acquire(1, 77, Duration::ZERO);
    h.actions();
    h.engine.connected(0, h.now);
    h.engine.connected(1, h.now);
    let _ = h.engine.poll_transmit(0, h.now).unwrap();
    h.engine.transmitted(0, 1);
    h.engine.session_closed(0, h.now);
    assert_eq!(h.completions(), [(1, Outcome::Indeterminate)]);
    assert_eq!(h.write(0), []);
    // Only the clean-up's `H` (rule 11) follows, never the acquire.
    assert_eq!(
        h.write(1),
        [Frame::H {
            id: 77,
            key: "k".into()
        }]
    );
}

#[test]
fn unavailable_exactly_at_the_deadline_when_nothing_was_sent() {
    let mut h = Harness::new(1);
    h.acquire(1, 5, 2 * S);
    assert_eq!(h.actions(), [Action::Connect(0)]);
    let deadline = h.start + 7 * S;
    // Connects keep being refused; each retry is scheduled, never an outcome.
    h.engine.connect_failed(0, h.now);
    assert_eq!(
        h.actions(),
        [Action::Connect(0)],
        "the first retry is at once"
    );
    h.engine.connect_failed(0, h.now);
    let (mut retries, mut wakeups) = (0, 0);
    loop {
        let next = h.engine.poll_timeout().unwrap();
        assert!(next > h.now, "time moves forward");
        if next >= deadline {
            break;
        }
        h.now = next;
        // A wake-up may only move the timer wheel's timers down a level.
        match h.timeout()[..] {
            [] => {}
            [Action::Connect(0)] => {
                h.engine.connect_failed(0, h.now);
                retries += 1;
            }
            ref other => panic!("{other:?}"),
        }
        assert_eq!(h.completions(), []);
        wakeups += 1;
        assert!(wakeups < 100);
    }
    assert!(retries > 5, "{retries}");
    h.at(7 * S - MS);
    h.timeout();
    assert_eq!(h.completions(), []);
    h.at(7 * S);
    h.timeout();
    assert_eq!(
        h.completions(),
        [(
            1,
            Outcome::Unavailable(crate::client::Unavailable::Unreachable)
        )]
    );
    assert!(h.engine.is_idle());
}

/// `Config::end_at_refusal` (the CLI with one address): a refused
/// connect ends the requests waiting for a session at once, and only
/// those; without it, or with a second address to try, a refusal is one
/// more connect failure, retried until `D`.
#[test]
fn a_refusal_at_the_only_address_ends_the_waiting_requests_at_once() {
    let unreachable = Outcome::Unavailable(crate::client::Unavailable::Unreachable);
    let mut h = Harness::new(1);
    h.engine.end_at_refusal();
    h.acquire(1, 5, 2 * S);
    h.other(2, Op::Ping { nonce: 1 });
    assert_eq!(h.actions(), [Action::Connect(0)]);
    h.at(3 * MS);
    h.engine.connect_refused(0, h.now);
    assert_eq!(
        h.completions(),
        [(1, unreachable.clone()), (2, unreachable.clone())]
    );
    assert!(h.engine.is_idle());
    // A later request connects again (the retry is due) and is served.
    h.other(3, Op::Ping { nonce: 2 });
    assert_eq!(h.actions(), [Action::Connect(0)]);
    h.engine.connected(0, h.now);
    assert_eq!(h.write(0), [Frame::P { nonce: 2 }]);
    assert_eq!(h.completions(), []);

    // Without the setting: no outcome before `D`.
    let mut h = Harness::new(1);
    h.acquire(1, 5, 2 * S);
    h.actions();
    h.engine.connect_refused(0, h.now);
    assert_eq!(h.completions(), []);
    assert!(!h.engine.is_idle());

    // Two addresses: the other one may still take it.
    let mut h = Harness::new(2);
    h.engine.end_at_refusal();
    h.acquire(1, 5, 2 * S);
    assert_eq!(h.actions(), [Action::Connect(0), Action::Connect(1)]);
    h.engine.connect_refused(0, h.now);
    assert_eq!(h.completions(), []);
    h.engine.connected(1, h.now);
    assert_eq!(h.write(1), [a(2, 5)]);
}

#[test]
fn no_answer_by_the_deadline_closes_exactly_that_session() {
    let mut h = Harness::new(2);
    h.acquire(1, 1, Duration::ZERO);
    h.acquire(2, 2, 10 * S);
    h.actions();
    h.engine.connected(0, h.now);
    h.engine.connected(1, h.now);
    assert_eq!(h.write(0), [a(0, 1), a(10, 2)]);
    h.other(3, Op::Query);
    assert_eq!(h.write(1), [Frame::Q { key: "k".into() }]);
    h.at(5 * S - MS);
    assert_eq!(h.timeout(), []);
    h.at(5 * S);
    assert_eq!(h.engine.poll_timeout(), Some(h.now));
    h.engine.handle_timeout(h.now);
    assert_eq!(h.actions(), [Action::Drain(0), Action::Drain(1)]);
    h.engine.expire(h.now);
    // Each closed session is opened again at once: the acquires' clean-up
    // (rule 11) needs one.
    assert_eq!(
        h.actions(),
        [
            Action::Close(0),
            Action::Connect(0),
            Action::Close(1),
            Action::Connect(1)
        ]
    );
    let mut done = h.completions();
    done.sort_by_key(|(call, _)| *call);
    // The second acquire's own deadline is far, but its session died.
    assert_eq!(
        done,
        [
            (1, Outcome::Indeterminate),
            (2, Outcome::Indeterminate),
            (3, Outcome::Indeterminate)
        ]
    );
}

#[test]
fn an_answer_already_arrived_at_the_deadline_is_used() {
    let mut h = Harness::new(1);
    h.acquire(1, 1, Duration::ZERO);
    h.acquire(2, 2, Duration::ZERO);
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    h.at(5 * S);
    h.engine.handle_timeout(h.now);
    assert_eq!(h.actions(), [Action::Drain(0)]);
    // Both answers sat unread: a `T` stays a timeout, a late `A` is given back.
    h.input(0, Response::Timeout { owner: 1 });
    h.input(
        0,
        Response::Acquired {
            owner: 2,
            token: 33,
        },
    );
    h.engine.expire(h.now);
    assert_eq!(h.actions(), []);
    assert_eq!(
        h.completions(),
        [(1, Outcome::Timeout), (2, Outcome::Indeterminate)]
    );
    assert_eq!(
        h.write(0),
        [Frame::R {
            token: 33,
            key: "k".into()
        }]
    );
    h.input(0, Response::Released { token: 33 });
    assert!(h.engine.is_idle());
}

#[test]
fn busy_and_timeout_are_definitive() {
    let mut h = Harness::new(1);
    h.acquire(1, 1, Duration::ZERO);
    h.acquire(2, 2, S);
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    h.input(0, Response::Busy { owner: 2 });
    h.input(0, Response::Timeout { owner: 1 });
    assert_eq!(h.completions(), [(2, Outcome::Busy), (1, Outcome::Timeout)]);
}

#[test]
fn answers_correlate_by_token_nonce_and_order() {
    let mut h = Harness::new(1);
    h.other(1, Op::Release { token: 5 });
    h.other(
        2,
        Op::Extend {
            token: 6,
            lease_s: 9,
        },
    );
    h.other(3, Op::Release { token: 7 });
    h.other(4, Op::Query);
    h.other(5, Op::Ping { nonce: 11 });
    h.other(6, Op::Info);
    h.actions();
    h.engine.connected(0, h.now);
    assert_eq!(h.write(0).len(), 6);
    let sent = h.now;
    h.at(3 * MS);
    let mut bytes = answer(Response::Released { token: 5 });
    bytes.extend(answer(Response::Extended { token: 6 }));
    bytes.extend(answer(Response::NotHeld { token: 7 }));
    bytes.extend(answer(Response::Query {
        token: 8,
        owner: 9,
        lease_ms: 10,
        waiters: 1,
    }));
    bytes.extend(answer(Response::Pong { nonce: 11 }));
    bytes.extend(answer(Response::Info("version=1".into())));
    // Split at every possible point: frames arrive in pieces.
    for chunk in bytes.chunks(3) {
        h.engine.handle_input(0, chunk, h.now);
    }
    assert_eq!(
        h.completions(),
        [
            (1, Outcome::Released),
            (2, Outcome::Extended { sent_at: sent }),
            (3, Outcome::NotHeld),
            (
                4,
                Outcome::Query(KeyStatus {
                    token: 8,
                    owner: 9,
                    lease_ms: 10,
                    waiters: 1
                })
            ),
            (5, Outcome::Pong { round_trip: 3 * MS }),
            (6, Outcome::Info("version=1".into())),
        ]
    );
    assert!(h.engine.is_idle());
}

#[test]
fn bad_bytes_close_the_session_and_sent_requests_are_indeterminate() {
    // Answers that decode but correlate with nothing; bytes that do not
    // decode as a session's first answer are another case (below).
    for bad in [
        answer(Response::Acquired {
            owner: 999,
            token: 1,
        }),
        answer(Response::Released { token: 4 }),
        answer(Response::Error {
            code: 8,
            id: 0,
            text: "server shutting down".into(),
        }),
    ] {
        let mut h = Harness::new(1);
        h.acquire(1, 1, S);
        h.actions();
        h.engine.connected(0, h.now);
        h.write(0);
        h.acquire(2, 2, S);
        h.engine.handle_input(0, &bad, h.now);
        assert_eq!(h.completions(), [(1, Outcome::Indeterminate)], "{bad:?}");
        assert_eq!(h.actions(), [Action::Close(0), Action::Connect(0)]);
        // The request that was never written moves on, before the
        // clean-up of the indeterminate one (rule 11).
        h.engine.connected(0, h.now);
        assert_eq!(
            h.write(0),
            [
                a(1, 2),
                Frame::H {
                    id: 1,
                    key: "k".into()
                }
            ]
        );
    }
}

/// Issue 25 defect 5: a session whose first bytes are no kunci answer is
/// talking to something else (Redis, HTTP, a TLS port addressed without
/// tls://): it executed none of the requests, so they end `Unavailable`
/// with the reason at once, instead of `Indeterminate` and a reconnect
/// loop that `--wait inf` would follow forever.
#[test]
fn a_first_answer_that_is_no_kunci_frame_is_a_wrong_protocol() {
    for (bad, why) in [
        (&b"Y"[..], "not a kunci server"),
        (b"T12345678x", "not a kunci server"),
        (b"-ERR unknown command\r\n", "not a kunci server"),
        (b"\x15\x03\x03\x00\x02\x02\x32", "the server speaks TLS"),
    ] {
        let mut h = Harness::new(1);
        h.acquire(1, 1, S);
        h.actions();
        h.engine.connected(0, h.now);
        h.write(0);
        h.engine.handle_input(0, bad, h.now);
        let completions = h.completions();
        let [(1, Outcome::Unavailable(Unavailable::WrongProtocol(text)))] = completions.as_slice()
        else {
            panic!("{bad:?}: {completions:?}");
        };
        assert!(text.starts_with(why), "{bad:?}: {text}");
    }
}

#[test]
fn a_plain_lock_is_written_as_a_and_anything_else_as_s() {
    let mut h = Harness::new(1);
    h.acquire(1, 1, 2 * S);
    h.acquire_permits(2, 2, S, Permits::shared(), "");
    h.acquire_permits(3, 3, Duration::ZERO, Permits::exclusive(), "who é");
    h.acquire_permits(4, 4, S, Permits::limit(3).take(2), "");
    h.acquire_permits(5, 5, S, Permits::limit(9).take(0), "");
    h.actions();
    h.engine.connected(0, h.now);
    let s = |wait_s, owner, limit, take, label: &str| Frame::S {
        wait_s,
        lease_s: 7,
        owner,
        key: "k".into(),
        limit,
        take,
        label: label.into(),
    };
    assert_eq!(
        h.write(0),
        [
            a(2, 1),
            s(1, 2, 65535, 1, ""),
            s(0, 3, 0, 0, "who é"),
            s(1, 4, 3, 2, ""),
            s(1, 5, 9, 0, ""),
        ]
    );
}

#[test]
fn x10_ends_the_acquire_with_its_owner_as_a_limit_mismatch_naming_the_keys_limit() {
    let mut h = Harness::new(1);
    h.acquire_permits(1, 1, S, Permits::limit(3), "");
    h.acquire_permits(2, 2, S, Permits::limit(4), "");
    h.acquire_permits(3, 3, S, Permits::limit(4), "");
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    // Answered out of order, by owner; a text that does not name the limit
    // as the spec says still means a mismatch.
    h.input(0, Response::limit_mismatch(2, 3));
    h.input(
        0,
        Response::Error {
            code: 10,
            id: 3,
            text: "limit mismatch".into(),
        },
    );
    h.input(
        0,
        Response::Acquired {
            owner: 1,
            token: 77,
        },
    );
    let completions = h.completions();
    assert_eq!(
        completions[..2],
        [
            (2, Outcome::LimitMismatch { key_limit: Some(3) }),
            (3, Outcome::LimitMismatch { key_limit: None }),
        ]
    );
    assert!(matches!(
        completions[2],
        (1, Outcome::Acquired { token: 77, .. })
    ));
    assert_eq!(
        outcome_error(Outcome::LimitMismatch { key_limit: Some(3) }),
        Error::LimitMismatch { key_limit: Some(3) }
    );
    // The session stays open: a mismatch is not fatal.
    assert_eq!(h.actions(), []);
}

#[test]
fn a_non_fatal_error_is_an_invalid_argument() {
    let mut h = Harness::new(1);
    h.acquire(1, 1, S);
    h.other(2, Op::Ping { nonce: 3 });
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    h.input(
        0,
        Response::Error {
            code: 6,
            id: 3,
            text: "x".into(),
        },
    );
    h.input(
        0,
        Response::Error {
            code: 5,
            id: 1,
            text: "x".into(),
        },
    );
    assert_eq!(
        h.completions(),
        [
            (
                2,
                Outcome::Invalid(protocol::ErrorCode::UnexpectedPayload.text())
            ),
            (1, Outcome::Invalid(protocol::ErrorCode::ZeroLease.text())),
        ]
    );
}

#[test]
fn a_connect_that_takes_too_long_fails_and_is_retried_with_backoff() {
    let mut h = Harness::new(1);
    h.acquire(1, 1, Duration::ZERO);
    assert_eq!(h.actions(), [Action::Connect(0)]);
    assert_eq!(h.engine.poll_timeout(), Some(h.start + S));
    h.at(S);
    // First failure: retried at once.
    assert_eq!(h.timeout(), [Action::Close(0), Action::Connect(0)]);
    h.engine.connect_failed(0, h.now);
    assert_eq!(h.actions(), []);
    assert_eq!(h.engine.poll_timeout(), Some(h.now + 10 * MS));
    h.at(S + 10 * MS);
    assert_eq!(h.timeout(), [Action::Connect(0)]);
    h.engine.connect_failed(0, h.now);
    assert_eq!(h.engine.poll_timeout(), Some(h.now + 20 * MS));
}

/// Spec §13.4a: a proclaim writes `C token klen key label` and ends with
/// `Proclaimed` for its `C`, `NotHeld` for its `N`, matched by token.
#[test]
fn a_proclaim_is_a_c_frame_answered_c_or_n_by_its_token() {
    let mut h = Harness::new(1);
    let label = |text| Label::new(text).unwrap();
    h.other(
        1,
        Op::Proclaim {
            token: 5,
            label: label("host-a"),
        },
    );
    h.other(
        2,
        Op::Proclaim {
            token: 6,
            label: label(""),
        },
    );
    h.actions();
    h.engine.connected(0, h.now);
    assert_eq!(
        h.write(0),
        [
            Frame::C {
                token: 5,
                key: "k".into(),
                label: "host-a".into()
            },
            Frame::C {
                token: 6,
                key: "k".into(),
                label: String::new()
            },
        ]
    );
    let mut bytes = answer(Response::Proclaimed { token: 5 });
    bytes.extend(answer(Response::NotHeld { token: 6 }));
    h.engine.handle_input(0, &bytes, h.now);
    assert_eq!(
        h.completions(),
        [(1, Outcome::Proclaimed), (2, Outcome::NotHeld)]
    );
}

#[test]
fn a_background_release_needs_no_caller() {
    let mut h = Harness::new(1);
    h.engine
        .release_in_background(Key::new("k").unwrap(), 12, h.now);
    h.actions();
    h.engine.connected(0, h.now);
    assert_eq!(
        h.write(0),
        [Frame::R {
            token: 12,
            key: "k".into()
        }]
    );
    h.input(0, Response::NotHeld { token: 12 });
    assert_eq!(h.completions(), []);
    assert!(h.engine.is_idle());
}

/// Spec §6, §8 rule 4: `X 7` as a session's first frame means the server
/// executed nothing on it — the requests move to another session, and at
/// `D` they are `Unavailable` naming the reason, never `Indeterminate`.
/// A refusal at accept that is read only when the deadline's drain reads
/// the session: the request, set aside at its deadline as possibly sent,
/// is certainly not sent after all. It still ends at its deadline,
/// `Unavailable` with the refusal's reason; it used to be left with no
/// timer, ending never (found by the engine simulation).
#[test]
fn a_refusal_read_in_the_deadlines_drain_still_ends_the_call_at_its_deadline() {
    let mut h = Harness::new(1);
    h.other(1, Op::Ping { nonce: 12 });
    assert_eq!(h.actions(), [Action::Connect(0)]);
    h.engine.connected(0, h.now);
    assert_eq!(h.write(0), [Frame::P { nonce: 12 }]);
    h.at(TRANSPORT_DEADLINE);
    h.engine.handle_timeout(h.now);
    assert_eq!(h.actions(), [Action::Drain(0)]);
    h.input(
        0,
        Response::Error {
            code: 7,
            id: 0,
            text: "refused".into(),
        },
    );
    h.engine.expire(h.now);
    h.actions();
    // The I/O thread asks `poll_timeout` next, at once.
    assert_eq!(h.engine.poll_timeout(), Some(h.now));
    h.timeout();
    assert_eq!(
        h.completions(),
        [(1, Outcome::Unavailable(Unavailable::ConnectionLimit))]
    );
}

#[test]
fn a_refusal_at_accept_is_unavailable_with_its_reason_never_indeterminate() {
    let (code, why) = (7, Unavailable::ConnectionLimit);
    {
        let mut h = Harness::new(1);
        h.acquire(1, 11, Duration::ZERO);
        h.other(2, Op::Ping { nonce: 12 });
        assert_eq!(h.actions(), [Action::Connect(0)]);
        h.engine.connected(0, h.now);
        assert_eq!(h.write(0), [a(0, 11), Frame::P { nonce: 12 }]);
        h.input(
            0,
            Response::Error {
                code,
                id: 0,
                text: "refused".into(),
            },
        );
        // Certainly not sent: reconnect at once and send them again.
        assert_eq!(h.actions(), [Action::Close(0), Action::Connect(0)]);
        assert_eq!(h.completions(), [], "code {code}");
        h.at(S);
        h.engine.connected(0, h.now);
        assert_eq!(h.write(0), [a(0, 11), Frame::P { nonce: 12 }], "resent");
        h.input(
            0,
            Response::Error {
                code,
                id: 0,
                text: "refused".into(),
            },
        );
        h.at(TRANSPORT_DEADLINE - MS);
        h.timeout();
        assert_eq!(h.completions(), [], "code {code}: early");
        h.at(TRANSPORT_DEADLINE);
        h.timeout();
        assert_eq!(
            h.completions(),
            [
                (1, Outcome::Unavailable(why)),
                (2, Outcome::Unavailable(why))
            ],
            "code {code}"
        );
    }
}

/// An `X 7` after other answers is not a refusal at accept: the session's
/// possibly-sent requests stay `Indeterminate` (rule 5).
#[test]
fn an_x7_after_an_answer_is_not_a_refusal() {
    let mut h = Harness::new(1);
    h.other(1, Op::Ping { nonce: 1 });
    h.other(2, Op::Ping { nonce: 2 });
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    h.input(0, Response::Pong { nonce: 1 });
    h.input(
        0,
        Response::Error {
            code: 7,
            id: 0,
            text: "x".into(),
        },
    );
    let completions = h.completions();
    assert!(matches!(completions[0], (1, Outcome::Pong { .. })));
    assert_eq!(completions[1], (2, Outcome::Indeterminate));
}

fn not_allowed() -> Response {
    Response::Error {
        code: 9,
        id: 0,
        text: "peer not allowed".into(),
    }
}

/// Rule 4: `X 9` cannot change within one call, so once every address has
/// refused the session with it, the certainly-not-sent requests are
/// `Unavailable(NotAllowed)` at once, not at `D`. While one address has not
/// refused, they wait for it.
#[test]
fn x9_at_every_address_is_unavailable_at_once() {
    let mut h = Harness::with_sessions(2, 2);
    h.acquire(1, 11, 10 * S);
    h.other(2, Op::Ping { nonce: 12 });
    assert_eq!(h.actions(), (0..4).map(Action::Connect).collect::<Vec<_>>());
    // Both sessions of address 0 refuse: address 1 may still take them.
    for s in [0, 1] {
        h.engine.connected(s, h.now);
        h.write(s);
        h.input(s, not_allowed());
    }
    assert_eq!(h.completions(), []);
    // Address 1 refuses too: every address has said no.
    h.at(MS);
    h.engine.connected(2, h.now);
    assert_eq!(h.write(2), [a(10, 11), Frame::P { nonce: 12 }]);
    h.input(2, not_allowed());
    assert_eq!(
        h.completions(),
        [
            (1, Outcome::Unavailable(Unavailable::NotAllowed)),
            (2, Outcome::Unavailable(Unavailable::NotAllowed)),
        ]
    );
    assert!(h.engine.is_idle());
    // A refusal seen before a call began does not end that call: the
    // server's `--allow` may have changed since.
    h.other(3, Op::Ping { nonce: 13 });
    assert_eq!(h.completions(), []);
    // An address that answers is no longer counted as refusing.
    h.engine.connected(3, h.now);
    h.write(3);
    h.input(3, Response::Pong { nonce: 13 });
    assert!(matches!(h.completions()[..], [(3, Outcome::Pong { .. })]));
    h.other(4, Op::Ping { nonce: 14 });
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    h.input(0, not_allowed());
    assert_eq!(h.completions(), [], "address 1 lets us in");
}

/// With one address, its `X 9` ends the call at once.
#[test]
fn x9_at_the_only_address_is_unavailable_at_once() {
    let mut h = Harness::new(1);
    h.acquire(1, 11, Duration::ZERO);
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    h.input(0, not_allowed());
    assert_eq!(
        h.completions(),
        [(1, Outcome::Unavailable(Unavailable::NotAllowed))]
    );
}

fn grant(id: u64, token: u64, owner: u64, label: &str) -> Response {
    Response::Grant {
        id,
        token,
        owner,
        lease_ms: 6_500,
        held_ms: 500,
        take: 0,
        label: label.into(),
    }
}

fn key_frame(id: u64, key: &str) -> Response {
    Response::Key {
        id,
        grants: 1,
        waiters: 2,
        limit: 3,
        key: key.into(),
    }
}

#[test]
fn holders_and_list_gather_their_frames_by_id_until_z_while_pipelined() {
    let mut h = Harness::new(1);
    h.other(
        1,
        Op::Holders {
            id: 5,
            clean_up_for: None,
        },
    );
    h.actions();
    h.engine.connected(0, h.now);
    h.other(2, Op::Query);
    h.engine.submit(
        Submission {
            op: Op::List {
                id: 6,
                cursor: 99,
                count: 2,
            },
            key: Key::prefix("").unwrap(),
            deadline: h.now + TRANSPORT_DEADLINE,
            reply: Some(3),
        },
        h.now,
    );
    assert_eq!(
        h.write(0),
        [
            Frame::H {
                id: 5,
                key: "k".into()
            },
            Frame::Q { key: "k".into() },
            Frame::L {
                id: 6,
                cursor: 99,
                count: 2,
                prefix: String::new()
            },
        ]
    );
    let mut bytes = Vec::new();
    for response in [
        grant(5, 10, 70, "é label"),
        grant(5, 11, 71, ""),
        Response::Waiter {
            id: 5,
            owner: 72,
            wait_ms: 900,
            take: 2,
            label: "w".into(),
        },
        Response::End {
            id: 5,
            count: 3,
            next: 0,
        },
        Response::Query {
            token: 10,
            owner: 70,
            lease_ms: 6_500,
            waiters: 1,
        },
        key_frame(6, "a"),
        key_frame(6, "b"),
        Response::End {
            id: 6,
            count: 2,
            next: 1234,
        },
    ] {
        protocol::encode_response(&response, &mut bytes);
    }
    // Split at every byte: frames are gathered across reads, and each
    // answer completes with the last byte of its `Z` (or `Q`).
    let mut done = Vec::new();
    for (at, byte) in bytes.iter().enumerate() {
        h.engine.handle_input(0, std::slice::from_ref(byte), h.now);
        let completed = h.completions();
        if !completed.is_empty() {
            done.push(at);
        }
        h.completions_seen.extend(completed);
    }
    let ends = {
        let mut ends = Vec::new();
        let mut rest = &bytes[..];
        let mut at = 0;
        while let Ok(Some((response, len))) = protocol::decode_response(rest) {
            at += len;
            if matches!(response, Response::End { .. } | Response::Query { .. }) {
                ends.push(at - 1);
            }
            rest = &rest[len..];
        }
        ends
    };
    assert_eq!(done, ends);
    let holders = Holders {
        grants: vec![
            Grant {
                token: 10,
                owner: 70,
                take: 0,
                lease_left: 6_500 * MS,
                held_for: 500 * MS,
                label: "é label".into(),
            },
            Grant {
                token: 11,
                owner: 71,
                take: 0,
                lease_left: 6_500 * MS,
                held_for: 500 * MS,
                label: String::new(),
            },
        ],
        waiters: vec![Waiter {
            owner: 72,
            take: 2,
            wait_left: 900 * MS,
            label: "w".into(),
        }],
        left_out: 0,
    };
    let summary = |key: &str| KeySummary {
        key: key.into(),
        grants: 1,
        waiters: 2,
        limit: 3,
    };
    assert_eq!(
        std::mem::take(&mut h.completions_seen),
        [
            (1, Outcome::Holders(holders)),
            (
                2,
                Outcome::Query(KeyStatus {
                    token: 10,
                    owner: 70,
                    lease_ms: 6_500,
                    waiters: 1
                })
            ),
            (
                3,
                Outcome::Keys(KeyPage {
                    keys: vec![summary("a"), summary("b")],
                    next: 1234
                })
            ),
        ]
    );
    // A key not in the table: just `Z`.
    h.other(
        4,
        Op::Holders {
            id: 8,
            clean_up_for: None,
        },
    );
    h.write(0);
    h.input(
        0,
        Response::End {
            id: 8,
            count: 0,
            next: 0,
        },
    );
    assert_eq!(h.completions(), [(4, Outcome::Holders(Holders::default()))]);
}

#[test]
fn a_list_answer_out_of_order_or_past_its_bounds_closes_the_session() {
    let list = |count| Op::List {
        id: 6,
        cursor: 0,
        count,
    };
    let holders = Op::Holders {
        id: 6,
        clean_up_for: None,
    };
    let waiter = Response::Waiter {
        id: 6,
        owner: 1,
        wait_ms: 1,
        take: 0,
        label: String::new(),
    };
    let end = |count| Response::End {
        id: 6,
        count,
        next: 0,
    };
    let cases: Vec<(Op, Vec<Response>)> = vec![
        // More keys than asked for.
        (list(1), vec![key_frame(6, "a"), key_frame(6, "b")]),
        // A `Z` that counts other than what came.
        (list(2), vec![key_frame(6, "a"), end(2)]),
        (holders, vec![grant(6, 1, 1, ""), end(0)]),
        // A grant after a waiter.
        (holders, vec![waiter.clone(), grant(6, 1, 1, "")]),
        // A grant for a list, a key for holders, an id nobody asked.
        (list(2), vec![grant(6, 1, 1, "")]),
        (holders, vec![key_frame(6, "a")]),
        (holders, vec![grant(7, 1, 1, "")]),
        // More than 1000 waiters.
        (holders, vec![waiter; 1001]),
    ];
    for (op, responses) in cases {
        let mut h = Harness::new(1);
        h.other(1, op);
        h.actions();
        h.engine.connected(0, h.now);
        h.write(0);
        for response in &responses {
            h.input(0, response.clone());
        }
        assert_eq!(
            h.completions(),
            [(1, Outcome::Indeterminate)],
            "{op:?} {:?}",
            &responses[..2.min(responses.len())]
        );
        assert_eq!(h.actions(), [Action::Close(0)], "{op:?}");
    }
}

#[test]
fn an_x11_ends_a_list_as_an_invalid_argument() {
    let mut h = Harness::new(1);
    h.other(
        1,
        Op::List {
            id: 6,
            cursor: 0,
            count: 1,
        },
    );
    h.actions();
    h.engine.connected(0, h.now);
    h.write(0);
    h.input(
        0,
        Response::Error {
            code: 11,
            id: 6,
            text: "invalid count".into(),
        },
    );
    assert!(matches!(
        h.completions().as_slice(),
        [(1, Outcome::Invalid(_))]
    ));
}

#[test]
fn an_indeterminate_acquire_is_cleaned_up_by_holders_and_a_release_of_its_owners_grant() {
    let mut h = Harness::new(1);
    h.acquire(1, 42, Duration::ZERO);
    h.actions();
    h.engine.connected(0, h.now);
    assert_eq!(h.write(0), [a(0, 42)]);
    // No answer by D: the session closes, the call is indeterminate and
    // the clean-up asks who holds the key, on a new session.
    h.at(5 * S);
    assert_eq!(
        h.timeout(),
        [Action::Drain(0), Action::Close(0), Action::Connect(0)]
    );
    assert_eq!(h.completions(), [(1, Outcome::Indeterminate)]);
    h.engine.connected(0, h.now);
    assert_eq!(
        h.write(0),
        [Frame::H {
            id: 42,
            key: "k".into()
        }]
    );
    // Two grants share the key; only the failed call's own is released.
    h.input(0, grant(42, 900, 41, "someone else"));
    h.input(0, grant(42, 901, 42, ""));
    h.input(
        0,
        Response::End {
            id: 42,
            count: 2,
            next: 0,
        },
    );
    assert_eq!(
        h.write(0),
        [Frame::R {
            token: 901,
            key: "k".into()
        }]
    );
    h.input(0, Response::Released { token: 901 });
    // Nobody waits for the clean-up: no completion reaches a caller.
    assert_eq!(h.completions(), []);
    assert!(h.engine.is_idle());
    // A query or holders call that ends indeterminate cleans nothing up.
    h.other(
        2,
        Op::Holders {
            id: 3,
            clean_up_for: None,
        },
    );
    h.write(0);
    h.at(10 * S + MS);
    h.timeout();
    assert_eq!(h.completions(), [(2, Outcome::Indeterminate)]);
    h.engine.connected(0, h.now);
    assert_eq!(h.write(0), []);
}

// ---- secrets (spec §8 rule 12, §12) ------------------------------------------------

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

fn u() -> Frame {
    Frame::U {
        secret: SECRET.to_vec(),
    }
}

fn authenticated(name: &str) -> Response {
    Response::Authenticated { name: name.into() }
}

impl Harness {
    fn with_secret(servers: usize, secret: &[u8]) -> Harness {
        let mut h = Harness::new(servers);
        h.engine.authenticate_with(Secret::new(secret));
        h
    }
}

#[test]
fn every_session_starts_with_u_also_after_a_reconnect() {
    let mut h = Harness::with_secret(1, SECRET);
    h.acquire(1, 42, S);
    h.other(2, Op::Query);
    assert_eq!(h.actions(), [Action::Connect(0)]);
    h.engine.connected(0, h.now);
    // The requests are pipelined behind the `U`, not held back.
    assert_eq!(h.write(0), [u(), a(1, 42), Frame::Q { key: "k".into() }]);
    h.input(0, authenticated("ci"));
    assert_eq!(h.completions(), []);
    h.input(0, Response::Timeout { owner: 42 });
    h.input(
        0,
        Response::Query {
            token: 0,
            owner: 0,
            lease_ms: 0,
            waiters: 0,
        },
    );
    assert_eq!(
        h.completions(),
        [
            (1, Outcome::Timeout),
            (2, Outcome::Query(KeyStatus::default()))
        ]
    );
    h.engine.session_closed(0, h.now);
    h.other(3, Op::Ping { nonce: 5 });
    h.timeout();
    h.engine.connected(0, h.now);
    assert_eq!(h.write(0), [u(), Frame::P { nonce: 5 }]);
    // A second `U` answer matches nothing: the session is closed.
    h.input(0, authenticated("ci"));
    h.input(0, authenticated("ci"));
    assert!(h.actions().contains(&Action::Close(0)));
}

#[test]
fn a_u_the_socket_took_part_of_is_finished_before_anything_else() {
    let mut h = Harness::with_secret(1, SECRET);
    h.acquire(1, 7, S);
    h.engine.connected(0, h.now);
    let first = h.engine.poll_transmit(0, h.now).unwrap().to_vec();
    h.engine.transmitted(0, 3);
    // The acquire was not sent: it is encoded again, after the rest of the `U`.
    let mut all = first[..3].to_vec();
    while let Some(bytes) = h.engine.poll_transmit(0, h.now) {
        all.extend_from_slice(bytes);
        let n = bytes.len();
        h.engine.transmitted(0, n);
    }
    assert_eq!(frames(&all), [u(), a(1, 7)]);
}

#[test]
fn x12_first_ends_every_request_of_the_session_permission_denied_at_once() {
    let mut h = Harness::with_secret(1, SECRET);
    h.acquire(1, 42, 10 * S);
    h.other(2, Op::Info);
    h.engine.connected(0, h.now);
    h.write(0);
    h.other(3, Op::Ping { nonce: 9 });
    assert_eq!(h.actions(), [Action::Connect(0)]);
    h.at(30 * MS);
    h.input(0, protocol::ErrorCode::NotAuthenticated.response(0));
    let denied = Outcome::PermissionDenied(Denied::NotAuthenticated);
    assert_eq!(
        h.completions(),
        [(1, denied.clone()), (2, denied.clone()), (3, denied)]
    );
    // Nothing is left to send again, so nothing reconnects.
    assert_eq!(h.actions(), [Action::Close(0)]);
    assert!(h.engine.is_idle());
}

#[test]
fn x13_ends_only_its_own_request() {
    let mut h = Harness::with_secret(1, SECRET);
    h.acquire(1, 42, S);
    h.other(2, Op::Info);
    h.other(3, Op::Ping { nonce: 9 });
    h.engine.connected(0, h.now);
    h.write(0);
    assert_eq!(h.actions(), [Action::Connect(0)]);
    h.input(0, authenticated("reader"));
    h.input(0, protocol::ErrorCode::NotPermitted.response(42));
    h.input(0, protocol::ErrorCode::NotPermitted.response(0));
    h.input(0, Response::Pong { nonce: 9 });
    let denied = Outcome::PermissionDenied(Denied::NotPermitted);
    assert_eq!(
        h.completions(),
        [
            (1, denied.clone()),
            (2, denied),
            (
                3,
                Outcome::Pong {
                    round_trip: Duration::ZERO
                }
            )
        ]
    );
    assert_eq!(h.actions(), []);
    assert_eq!(
        outcome_error(Outcome::PermissionDenied(Denied::NotPermitted)),
        Error::PermissionDenied(Denied::NotPermitted)
    );
}

#[test]
fn a_short_secret_is_invalid_before_anything_is_sent() {
    let mut h = Harness::with_secret(1, &SECRET[..31]);
    h.acquire(1, 42, S);
    assert_eq!(
        h.completions(),
        [(1, Outcome::Invalid("secret is shorter than 32 bytes"))]
    );
    assert_eq!(h.actions(), []);
    assert!(h.engine.is_idle());
}

#[test]
fn secrets_are_read_without_one_trailing_newline_and_never_shown() {
    let dir = std::env::temp_dir().join(format!("kunci-secret-{}", std::process::id()));
    std::fs::write(&dir, b"0123456789abcdef0123456789abcdef\n\n").unwrap();
    let secret = Secret::from_file(&dir).unwrap();
    std::fs::remove_file(&dir).unwrap();
    assert_eq!(secret.as_bytes(), b"0123456789abcdef0123456789abcdef\n");
    assert_eq!(secret.problem(), Some("secret contains a newline"));
    let secret = Secret::new(SECRET);
    assert_eq!(secret.problem(), None);
    assert_eq!(format!("{secret:?}"), "Secret(32 bytes)");
}
