//! The §8 rules, one by one, on the sans-IO engine with a fake clock.

use std::time::{Duration, Instant};

use super::engine::{Action, Engine, Key, Op, Outcome, Submission, wire_wait_s};
use super::*;
use crate::protocol::{self, Decoded, Request, Response};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

/// An engine on a fake clock; replies are numbered calls.
struct Harness {
    engine: Engine<u32>,
    start: Instant,
    now: Instant,
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
            } => Frame::A {
                wait_s,
                lease_s,
                owner,
                key: key.into(),
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
            other => panic!("the client sent {other:?}, which it never sends"),
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
    fn new(sessions: usize) -> Harness {
        let start = Instant::now();
        Harness {
            engine: Engine::new(sessions, S, start),
            start,
            now: start,
        }
    }

    fn at(&mut self, offset: Duration) -> Instant {
        self.now = self.start + offset;
        self.now
    }

    fn acquire(&mut self, call: u32, owner: u64, wait: Duration) {
        let wait_until = self.now + wait;
        self.engine.submit(
            Submission {
                op: Op::Acquire {
                    owner,
                    lease_s: 7,
                    wait_until: (!wait.is_zero()).then_some(wait_until),
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
    assert_eq!(h.write(1), []);
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
    assert_eq!(h.actions(), [Action::Close(0), Action::Close(1)]);
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
    for bad in [
        b"Y".to_vec(),
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
        b"T12345678x".to_vec(),
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
        // The request that was never written moves on.
        h.engine.connected(0, h.now);
        assert_eq!(h.write(0), [a(1, 2)]);
    }
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

/// Spec §6, §8 rule 4: `X 7` or `X 9` as a session's first frame means the
/// server executed nothing on it — the requests move to another session,
/// and at `D` they are `Unavailable` naming the reason, never
/// `Indeterminate`.
#[test]
fn a_refusal_at_accept_is_unavailable_with_its_reason_never_indeterminate() {
    for (code, why) in [
        (7, Unavailable::ConnectionLimit),
        (9, Unavailable::NotAllowed),
    ] {
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
