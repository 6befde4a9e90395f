//! The sans-IO endpoint byte for byte on a fake clock: what the shell
//! hands it (bytes, end-of-file, writes) and what it hands back (bytes,
//! socket actions, deadlines). Timing that the socket tests could only
//! bound is exact here.

use kunci::core::connection::{
    LINGER_US, OUTPUT_HIGH_WATER, PARTIAL_FRAME_TIMEOUT_US, Phase, READ_CHUNK,
};
use kunci::core::endpoint::{Action, Endpoint};
use kunci::core::{ConnId, Core, Limits};
use kunci::protocol::{self, ErrorCode, Response};

use crate::util::fake::{FIRST_TOKEN, MS, S};
use crate::util::wire::Wire;
use crate::util::{acquire, extend, ping, query, release};

fn frame(response: Response) -> Vec<u8> {
    let mut out = Vec::new();
    protocol::encode_response(&response, &mut out);
    out
}

impl Wire {
    fn token_of(&mut self, id: ConnId, owner: u64) -> u64 {
        let bytes = self.recv(id);
        match protocol::decode_response(&bytes) {
            Ok(Some((Response::Acquired { owner: o, token }, len)))
                if o == owner && len == bytes.len() =>
            {
                token
            }
            other => panic!("expected a grant to {owner}, got {other:?}"),
        }
    }

    /// The key's holder token and lease left, by `Q`.
    fn query(&mut self, id: ConnId, key: &str) -> (u64, u32) {
        self.send(id, &query(key));
        match protocol::decode_response(&self.recv(id)) {
            Ok(Some((
                Response::Query {
                    token, lease_ms, ..
                },
                _,
            ))) => (token, lease_ms),
            other => panic!("expected Q, got {other:?}"),
        }
    }
}

#[test]
fn extend_resets_the_lease() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.send(0, &acquire(0, 1, 1, "renewed"));
    let token = wire.token_of(0, 1);
    wire.at(600 * MS);
    wire.send(0, &extend(2, token, "renewed"));
    assert_eq!(wire.recv(0), frame(Response::Extended { token }));
    // The new lease runs from the extend: 2 s from 600 ms.
    wire.at(1_400 * MS);
    assert_eq!(wire.query(0, "renewed"), (token, 1_200));
    wire.at(2_599 * MS);
    assert_eq!(wire.query(0, "renewed"), (token, 1));
    wire.at(2_600 * MS - 1);
    assert_eq!(wire.query(0, "renewed").0, token, "the lease ended early");
    wire.at(2_600 * MS);
    assert_eq!(
        wire.query(0, "renewed"),
        (0, 0),
        "the lease outlived the extend"
    );
    wire.send(0, &extend(2, token, "renewed"));
    assert_eq!(wire.recv(0), frame(Response::NotHeld { token }));
}

#[test]
fn wait_times_out_exactly_at_its_deadline() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &acquire(0, 30, 1, "slow"));
    wire.token_of(0, 1);
    wire.at(250 * MS);
    wire.send(1, &acquire(1, 30, 2, "slow"));
    assert_eq!(wire.recv(1), b"");
    assert!(wire.endpoint.poll_timeout() <= Some(1_250 * MS));
    wire.at(1_250 * MS - 1);
    assert_eq!(wire.recv(1), b"", "timed out early");
    wire.at(1_250 * MS);
    assert_eq!(wire.recv(1), frame(Response::Timeout { owner: 2 }));
}

#[test]
fn lease_expires_exactly_at_its_length_and_hands_over() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &acquire(0, 1, 1, "lease"));
    let first = wire.token_of(0, 1);
    wire.at(10 * MS);
    wire.send(1, &acquire(5, 30, 2, "lease"));
    wire.at(S - 1);
    assert_eq!(wire.recv(1), b"", "lease ended early");
    wire.at(S);
    let second = wire.token_of(1, 2);
    assert!(second > first);
    // The old holder learns nothing, and its token is dead.
    assert_eq!(wire.recv(0), b"");
    wire.send(0, &release(first, "lease"));
    assert_eq!(wire.recv(0), frame(Response::NotHeld { token: first }));
    assert_eq!(wire.endpoint.core().stats().expired, 1);
}

#[test]
fn a_frame_left_incomplete_closes_the_connection_after_exactly_10_s() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.at(5 * MS);
    wire.send(0, b"A\x05\x05\x00");
    // More bytes of the same frame do not push the deadline back.
    wire.at(4 * S);
    wire.send(0, b"\x00\x00");
    wire.at(5 * MS + PARTIAL_FRAME_TIMEOUT_US - 1);
    assert_eq!(wire.actions(), []);
    wire.at(5 * MS + PARTIAL_FRAME_TIMEOUT_US);
    assert_eq!(wire.actions(), [(0, Action::Close)]);
    assert!(wire.endpoint.connection(0).is_none());
    // A frame completed in time restarts nothing: no deadline is left.
    wire.connect(1);
    wire.send(1, b"P\x00\x00\x00");
    wire.send(1, b"\x00\x00\x00\x00\x07\n");
    assert_eq!(wire.recv(1), frame(Response::Pong { nonce: 7 }));
    assert_eq!(wire.endpoint.poll_timeout(), None);
}

/// Issue 10, on the endpoint: a request and the end-of-file together.
#[test]
fn a_waiter_and_its_end_of_file_in_one_read_leave_no_waiter() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &acquire(0, 30, 1, "k"));
    let token = wire.token_of(0, 1);
    let mut bytes = acquire(60, 30, 2, "k");
    bytes.extend_from_slice(&ping(3));
    wire.send(1, &bytes);
    wire.endpoint.handle_eof(1, wire.now);
    assert_eq!(wire.endpoint.core().waiter_count(), 0);
    // The answer sent before the end-of-file still goes out, then the close.
    assert_eq!(wire.recv(1), frame(Response::Pong { nonce: 3 }));
    assert_eq!(wire.actions(), [(1, Action::Close)]);
    wire.send(0, &release(token, "k"));
    assert_eq!(wire.recv(0), frame(Response::Released { token }));
    assert_eq!(
        wire.endpoint.core().keys(),
        0,
        "the key went to a closed peer"
    );
}

#[test]
fn a_fatal_error_is_flushed_then_the_write_side_shut_then_closed_after_the_linger() {
    let mut wire = Wire::new();
    wire.connect(0);
    let mut bytes = ping(1);
    bytes.extend_from_slice(b"Zjunk");
    wire.send(0, &bytes);
    // Nothing is read after the fatal error.
    wire.send(0, &ping(2));
    let mut expected = frame(Response::Pong { nonce: 1 });
    expected.extend_from_slice(&frame(ErrorCode::UnknownOp.response(0)));
    assert_eq!(wire.recv(0), expected);
    assert_eq!(wire.actions(), [(0, Action::ShutWrite)]);
    assert_eq!(
        wire.endpoint.connection(0).map(|c| c.phase()),
        Some(Phase::Lingering)
    );
    wire.at(LINGER_US - 1);
    assert_eq!(wire.actions(), []);
    wire.at(LINGER_US);
    assert_eq!(wire.actions(), [(0, Action::Close)]);
}

#[test]
fn a_reader_that_stalls_stops_evaluation_at_the_high_water_mark_and_resumes() {
    let mut wire = Wire::new();
    wire.connect(0);
    // 20 000 pings: 200 000 bytes of answers. The shell reads at most a
    // chunk at a time, and only while the endpoint wants it.
    let flood: Vec<u8> = (0..20_000u64).flat_map(ping).collect();
    let mut read = 0;
    let mut turns = 0;
    while wire.endpoint.connection(0).unwrap().phase() != Phase::Backpressured {
        if wire.endpoint.wants_read(0) {
            let end = flood.len().min(read + READ_CHUNK);
            wire.send(0, &flood[read..end]);
            read = end;
        } else {
            // The connection spent its share of the turn (spec §4).
            wire.endpoint.begin_turn(wire.now);
            turns += 1;
            assert!(turns < 100, "never backpressured");
        }
    }
    let conn = wire.endpoint.connection(0).unwrap();
    assert_eq!(conn.phase(), Phase::Backpressured);
    let queued = conn.output_len();
    assert!((OUTPUT_HIGH_WATER..OUTPUT_HIGH_WATER + 10).contains(&queued));
    // Pings and pongs are both 10 bytes: what was read and not answered
    // waits as input.
    assert_eq!(conn.input_len(), read - queued);
    let mut answers = Vec::new();
    while answers.len() < 200_000 {
        wire.endpoint.begin_turn(wire.now);
        // Like the shell: an `Action::Read` is followed only while the
        // endpoint wants to read.
        wire.actions();
        if wire.endpoint.wants_read(0) {
            let end = flood.len().min(read + READ_CHUNK);
            if read < end {
                wire.send(0, &flood[read..end]);
                read = end;
            }
        }
        let bytes = wire.recv(0);
        assert!(!bytes.is_empty(), "stuck after {} bytes", answers.len());
        answers.extend_from_slice(&bytes);
    }
    let expected: Vec<u8> = (0..20_000u64)
        .flat_map(|nonce| frame(Response::Pong { nonce }))
        .collect();
    assert_eq!(answers, expected);
    assert!(wire.endpoint.wants_read(0));
}

#[test]
fn refusals_at_accept_send_x9_and_x7_before_reading() {
    let limits = Limits {
        max_connections: 1,
        ..Limits::default()
    };
    let mut endpoint = Endpoint::new(
        Core::new(limits, FIRST_TOKEN),
        vec!["10.0.0.0/8".parse().unwrap()],
    );
    endpoint.accept(0, Some("192.0.2.1".parse().unwrap()), 0);
    endpoint.accept(1, Some("10.0.0.1".parse().unwrap()), 0);
    endpoint.accept(2, Some("10.0.0.2".parse().unwrap()), 0);
    endpoint.accept(3, None, 0);
    let mut wire = Wire { endpoint, now: 0 };
    assert_eq!(wire.recv(0), frame(ErrorCode::NotAllowed.response(0)));
    assert_eq!(wire.recv(1), b"");
    assert_eq!(wire.recv(2), frame(ErrorCode::ConnectionLimit.response(0)));
    assert_eq!(wire.recv(3), frame(ErrorCode::ConnectionLimit.response(0)));
    // Their requests are never evaluated.
    wire.send(0, &ping(1));
    assert_eq!(wire.recv(0), b"");
    assert_eq!(wire.endpoint.core().stats().refused, 1);
    assert_eq!(wire.endpoint.core().stats().errors, 3);
}

/// Durability before visibility (spec §7.2): with a state directory no
/// answer that shows a token or a lease is transmitted until the promise
/// covering it is durable; a lease inside the promise needs no new one.
#[test]
fn with_durability_nothing_is_transmitted_until_the_promise_covering_it_is_persisted() {
    let mut wire = Wire::new();
    wire.endpoint.require_durability();
    // The first promise replaces the earlier run's file: due at once.
    let first = wire.endpoint.poll_persist().expect("the first promise");
    assert_eq!(first.token_high_water, FIRST_TOKEN + (1 << 26));
    assert_eq!(first.horizon, 0);
    wire.endpoint.handle_persisted(first);
    assert_eq!(wire.endpoint.poll_persist(), None);
    wire.connect(1);
    wire.send(1, &acquire(0, 30, 7, "k"));
    // A 30 s lease is past the promised horizon: held back until durable.
    assert_eq!(wire.endpoint.transmit(1), None);
    let promise = wire
        .endpoint
        .poll_persist()
        .expect("a promise for the lease");
    assert_eq!(promise.token_high_water, first.token_high_water);
    assert_eq!(promise.horizon, 35 * S);
    wire.endpoint.handle_persisted(promise);
    assert_eq!(
        wire.recv(1),
        frame(Response::Acquired {
            owner: 7,
            token: FIRST_TOKEN
        })
    );
    // A renewal within the promised horizon goes out at once.
    wire.at(2 * S);
    wire.send(1, &extend(30, FIRST_TOKEN, "k"));
    assert_eq!(wire.endpoint.poll_persist(), None);
    assert_eq!(
        wire.recv(1),
        frame(Response::Extended { token: FIRST_TOKEN })
    );
    // One past it needs the next promise first.
    wire.at(6 * S);
    wire.send(1, &extend(30, FIRST_TOKEN, "k"));
    assert_eq!(wire.endpoint.transmit(1), None);
    assert_eq!(
        wire.endpoint.poll_persist().map(|p| p.horizon),
        Some(41 * S)
    );
}

/// Spec §7.6 on the wire: when the write of a promise fails, the answer
/// that needed it waits for the disk while other connections are served
/// within what the file holds (`B` past it); a later failed retry holds
/// nothing more back; the first write that succeeds lets the held answer
/// out and lifts the ceiling.
#[test]
fn a_failed_write_holds_back_only_the_answers_that_needed_it_until_a_write_succeeds() {
    let mut wire = Wire::new();
    wire.endpoint.require_durability();
    let first = wire.endpoint.poll_persist().unwrap();
    wire.endpoint.handle_persisted(first);
    wire.connect(1);
    wire.connect(2);
    wire.send(1, &acquire(0, 30, 7, "k"));
    let wanted = wire
        .endpoint
        .poll_persist()
        .expect("a promise for the lease");
    assert!(wire.endpoint.handle_persist_failed(wanted, 0), "logged");
    assert!(!wire.endpoint.write_due(S - 1));
    // Held back: it shows a lease the file does not promise.
    assert_eq!(wire.endpoint.transmit(1), None);
    // Another connection is served; a lease past the horizon (0: none
    // outstanding on disk) gets `B`.
    wire.send(2, &ping(5));
    assert_eq!(wire.recv(2), frame(Response::Pong { nonce: 5 }));
    wire.send(2, &acquire(0, 1, 8, "other"));
    assert_eq!(wire.recv(2), frame(Response::Busy { owner: 8 }));
    // A retry that fails while connection 2 has output holds none of it.
    wire.at(S);
    assert!(wire.endpoint.write_due(S));
    wire.send(2, &ping(6));
    let wanted = wire.endpoint.poll_persist().unwrap();
    assert!(
        !wire.endpoint.handle_persist_failed(wanted, S),
        "not logged again"
    );
    assert_eq!(wire.recv(2), frame(Response::Pong { nonce: 6 }));
    assert_eq!(wire.endpoint.core().stats().state_errors, 2);
    // The disk is back.
    wire.at(2 * S);
    let wanted = wire.endpoint.poll_persist().unwrap();
    assert_eq!(wire.endpoint.handle_persisted(wanted), Some(2));
    assert_eq!(
        wire.recv(1),
        frame(Response::Acquired {
            owner: 7,
            token: FIRST_TOKEN
        })
    );
    wire.send(2, &acquire(0, 1, 9, "other"));
    assert_eq!(
        wire.recv(2),
        frame(Response::Acquired {
            owner: 9,
            token: FIRST_TOKEN + 1
        })
    );
}

/// Spec §7.4 on the wire: the answer to the first counted grant (`take`
/// ≥ 1) is held back until a promise recording it is durable, even when
/// the token and the lease are covered already.
#[test]
fn the_first_counted_grant_is_answered_only_after_the_flag_is_durable() {
    let mut wire = Wire::new();
    wire.endpoint.require_durability();
    wire.connect(1);
    wire.send(1, &acquire(0, 30, 7, "k"));
    let exclusive = wire.endpoint.poll_persist().unwrap();
    assert!(!exclusive.counted_grants);
    wire.endpoint.handle_persisted(exclusive);
    wire.recv(1);
    let mut shared = Vec::new();
    protocol::encode_request(
        &protocol::Request::Acquire {
            wait_s: 0,
            lease_s: 5,
            owner: 8,
            key: "s",
            limit: 65_535,
            take: 1,
            label: "",
        },
        &mut shared,
    );
    wire.send(1, &shared);
    assert_eq!(wire.endpoint.transmit(1), None);
    let counted = wire
        .endpoint
        .poll_persist()
        .expect("a promise with the flag");
    assert_eq!(
        counted,
        kunci::core::restart::Promise {
            counted_grants: true,
            ..exclusive
        }
    );
    wire.endpoint.handle_persisted(counted);
    assert_eq!(
        wire.recv(1),
        frame(Response::Acquired {
            owner: 8,
            token: FIRST_TOKEN + 1
        })
    );
}
