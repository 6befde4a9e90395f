//! `O` and `V` (spec §13) byte for byte through the sans-IO endpoint on a
//! fake clock: answered at once or held as a watch, woken after the whole
//! event, never early, `X 14` over their own limits, dropped with its
//! connection, answered on a clean stop, within scopes, during a grace.

use kunci::core::access::AccessList;
use kunci::core::endpoint::{Action, Endpoint};
use kunci::core::{ConnId, Core, Limits};
use kunci::protocol::{self, Request, Response};

use crate::access::{LOCKER, READER, auth_file, authenticate};

/// The secret of an identity with `max-watches=3`.
const CAPPED: &[u8] = b"capped-secret-0123456789abcdef-01234";
use crate::util::fake::{FIRST_TOKEN, MS, S};
use crate::util::frames::{a, observe, op_u64, v, x};
use crate::util::wire::Wire;
use crate::util::{acquire, extend, ping, query, release, s_frame};

/// `V` of a free key.
fn v_free(id: u64) -> Vec<u8> {
    v(id, 0, 0, 0, 0, 0, "")
}

fn cat(frames: &[Vec<u8>]) -> Vec<u8> {
    frames.concat()
}

impl Wire {
    fn info(&mut self, id: ConnId, name: &str) -> String {
        let bytes = self.exchange(id, b"I\n");
        let text = String::from_utf8(bytes).unwrap();
        text.trim_end()
            .split(' ')
            .find_map(|pair| pair.strip_prefix(&format!("{name}=")).map(str::to_owned))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }
}

#[test]
fn o_and_v_frames_are_what_the_codec_reads_and_writes() {
    let frame = observe(7, 0x0102_0304_0506_0708, 42, "k");
    assert_eq!(frame.len(), 1 + 17 + 1 + 1);
    match protocol::decode_request(&frame) {
        protocol::Decoded::Request { request, len } => {
            assert_eq!(len, frame.len());
            assert_eq!(
                request,
                Request::Observe {
                    wait_s: 7,
                    id: 0x0102_0304_0506_0708,
                    since: 42,
                    key: "k"
                }
            );
            let mut again = Vec::new();
            protocol::encode_request(&request, &mut again);
            assert_eq!(again, frame);
        }
        other => panic!("{other:?}"),
    }
    let state = Response::KeyState {
        id: 9,
        token: 1_000,
        lease_ms: 30_000,
        held_ms: 5,
        grants: 2,
        waiters: 3,
        label: "host-a".into(),
    };
    let bytes = v(9, 1_000, 30_000, 5, 2, 3, "host-a");
    assert_eq!(bytes.len(), 1 + 30 + 6 + 1);
    let mut encoded = Vec::new();
    protocol::encode_response(&state, &mut encoded);
    assert_eq!(encoded, bytes);
    assert_eq!(
        protocol::decode_response(&bytes),
        Ok(Some((state, bytes.len())))
    );
}

#[test]
fn a_changed_or_free_key_and_wait_0_are_answered_at_once() {
    let mut wire = Wire::new();
    wire.connect(0);
    // Free key, `since` 0, wait 0: a read.
    assert_eq!(wire.exchange(0, &observe(0, 1, 0, "k")), v_free(1));
    // Free key, another `since`: at once, whatever the wait.
    assert_eq!(wire.exchange(0, &observe(30, 2, 77, "k")), v_free(2));
    wire.send(0, &s_frame(0, 30, 5, 0, 0, b"k", b"host-a"));
    assert_eq!(wire.recv(0), a(5, FIRST_TOKEN));
    wire.at(1_500 * MS);
    // Held: token, lease left (rounded up), held (rounded down), label.
    assert_eq!(
        wire.exchange(0, &observe(30, 3, 0, "k")),
        v(3, FIRST_TOKEN, 28_500, 1_500, 1, 0, "host-a")
    );
    // `since` equal but wait 0: at once too.
    assert_eq!(
        wire.exchange(0, &observe(0, 4, FIRST_TOKEN, "k")),
        v(4, FIRST_TOKEN, 28_500, 1_500, 1, 0, "host-a")
    );
    assert_eq!(wire.info(0, "watches"), "0");
}

#[test]
fn a_watch_is_answered_after_the_whole_hand_over_with_the_new_token() {
    let mut wire = Wire::new();
    for id in 0..3 {
        wire.connect(id);
    }
    wire.send(0, &acquire(0, 30, 1, "k"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    wire.send(1, &s_frame(60, 30, 2, 0, 0, b"k", b"host-b"));
    // The watch is held: nothing yet.
    assert_eq!(wire.exchange(2, &observe(60, 9, FIRST_TOKEN, "k")), b"");
    assert_eq!(wire.info(2, "watches"), "1");
    // It is not a waiter: not in `Q`'s waiters, not a key.
    assert_eq!(wire.exchange(2, &query("k"))[21..25], 1u32.to_be_bytes());
    assert_eq!(wire.info(2, "waiters"), "1");
    wire.at(2 * S);
    wire.send(0, &release(FIRST_TOKEN, "k"));
    assert_eq!(wire.recv(0), op_u64(b'R', FIRST_TOKEN));
    assert_eq!(wire.recv(1), a(2, FIRST_TOKEN + 1));
    // Never 0 in between: the new grant, its label, held 0.
    assert_eq!(
        wire.recv(2),
        v(9, FIRST_TOKEN + 1, 30_000, 0, 1, 0, "host-b")
    );
    assert_eq!(wire.info(2, "watches"), "0");
    // The lease runs out at 32 s: a watch sees the key free then.
    assert_eq!(
        wire.exchange(2, &observe(255, 10, FIRST_TOKEN + 1, "k")),
        b""
    );
    wire.at(32 * S - 1);
    assert_eq!(wire.recv(2), b"");
    wire.at(32 * S);
    assert_eq!(wire.recv(2), v_free(10));
    assert_eq!(wire.endpoint.core().keys(), 0);
}

#[test]
fn an_expiry_that_hands_on_wakes_with_the_next_grant() {
    let mut wire = Wire::new();
    for id in 0..3 {
        wire.connect(id);
    }
    wire.send(0, &acquire(0, 2, 1, "k"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    wire.send(1, &acquire(60, 30, 2, "k"));
    assert_eq!(wire.exchange(2, &observe(60, 3, FIRST_TOKEN, "k")), b"");
    wire.at(2 * S);
    assert_eq!(wire.recv(1), a(2, FIRST_TOKEN + 1));
    assert_eq!(wire.recv(2), v(3, FIRST_TOKEN + 1, 30_000, 0, 1, 0, ""));
}

#[test]
fn a_watch_never_delays_a_grant_and_wakes_on_the_first_one() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    // Watching a free key (since 0) adds no key to the table.
    assert_eq!(wire.exchange(1, &observe(10, 4, 0, "free")), b"");
    assert_eq!(wire.endpoint.core().keys(), 0);
    assert_eq!(wire.info(0, "keys"), "0");
    wire.send(0, &acquire(0, 5, 1, "free"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    assert_eq!(wire.recv(1), v(4, FIRST_TOKEN, 5_000, 0, 1, 0, ""));
}

#[test]
fn extend_and_requests_on_other_keys_do_not_wake_a_watch() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &acquire(0, 5, 1, "k"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    assert_eq!(wire.exchange(1, &observe(10, 4, FIRST_TOKEN, "k")), b"");
    wire.send(0, &extend(9, FIRST_TOKEN, "k"));
    wire.send(0, &acquire(0, 5, 2, "other"));
    wire.send(0, &release(FIRST_TOKEN + 1, "other"));
    wire.send(0, &acquire(0, 5, 3, "k"));
    assert_eq!(
        wire.recv(0),
        cat(&[
            op_u64(b'E', FIRST_TOKEN),
            a(2, FIRST_TOKEN + 1),
            op_u64(b'R', FIRST_TOKEN + 1),
            op_u64(b'T', 3),
        ])
    );
    assert_eq!(wire.recv(1), b"");
    assert_eq!(wire.info(1, "watches"), "1");
}

#[test]
fn wait_ends_exactly_at_its_deadline_with_the_unchanged_state() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.send(0, &acquire(0, 30, 1, "k"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    wire.at(250 * MS);
    assert_eq!(wire.exchange(0, &observe(2, 6, FIRST_TOKEN, "k")), b"");
    wire.at(2_250 * MS - 1);
    assert_eq!(wire.recv(0), b"", "answered early");
    wire.at(2_250 * MS);
    assert_eq!(wire.recv(0), v(6, FIRST_TOKEN, 27_750, 2_250, 1, 0, ""));
    assert_eq!(wire.info(0, "watches"), "0");
}

#[test]
fn watches_have_their_own_limits_and_never_turn_a_wait_away() {
    let limits = Limits {
        max_waits_per_conn: 2,
        max_waiters: 3,
        max_watches_per_conn: 2,
        max_watches: 3,
        ..Limits::default()
    };
    let mut wire = Wire::with(limits);
    for id in 0..3 {
        wire.connect(id);
    }
    wire.send(0, &acquire(0, 30, 1, "k"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    // Connection 1: two watches fill its --max-watches-per-conn...
    assert_eq!(wire.exchange(1, &observe(60, 3, FIRST_TOKEN, "k")), b"");
    assert_eq!(wire.exchange(1, &observe(60, 4, FIRST_TOKEN, "k")), b"");
    assert_eq!(
        wire.exchange(1, &observe(60, 5, FIRST_TOKEN, "k")),
        x(14, 5, "too many watches")
    );
    // ...and leave its two waits free (spec §13.3, v5).
    assert_eq!(wire.exchange(1, &acquire(60, 30, 6, "k")), b"");
    assert_eq!(wire.exchange(1, &acquire(60, 30, 7, "k")), b"");
    assert_eq!(wire.exchange(1, &acquire(60, 30, 8, "k")), op_u64(b'B', 8));
    // An `O` answered at once is never refused.
    assert_eq!(
        wire.exchange(1, &observe(60, 9, 1, "k")),
        v(9, FIRST_TOKEN, 30_000, 0, 1, 2, "")
    );
    // Connection 2: --max-watches 3 has room for one more watch, and
    // --max-waiters 3 for one more wait, each apart from the other.
    assert_eq!(wire.exchange(2, &observe(60, 10, FIRST_TOKEN, "k")), b"");
    assert_eq!(
        wire.exchange(2, &observe(60, 11, FIRST_TOKEN, "k")),
        x(14, 11, "too many watches")
    );
    assert_eq!(wire.exchange(2, &acquire(60, 30, 12, "k")), b"");
    assert_eq!(
        wire.exchange(2, &acquire(60, 30, 13, "k")),
        op_u64(b'B', 13)
    );
    assert_eq!(wire.info(2, "watches"), "3");
    assert_eq!(wire.info(2, "waiters"), "3");
    // X 14 is not fatal: the connection goes on.
    assert_eq!(wire.exchange(2, &ping(1)), op_u64(b'P', 1));
}

#[test]
fn a_thousand_watches_leave_a_waiting_acquire_its_timeout() {
    let limits = Limits {
        max_waiters: 1000,
        ..Limits::default()
    };
    let mut wire = Wire::with(limits);
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &acquire(0, 30, 1, "held"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    for id in 0..1000 {
        let frame = observe(60, id, 0, &format!("absent/{id}"));
        assert_eq!(wire.exchange(1, &frame), b"");
    }
    assert_eq!(wire.endpoint.core().watch_count(), 1000);
    assert_eq!(wire.exchange(0, &acquire(1, 30, 2, "held")), b"");
    wire.at(S - 1);
    assert_eq!(wire.recv(0), b"");
    wire.at(S);
    assert_eq!(wire.recv(0), op_u64(b'T', 2));
}

#[test]
fn an_identity_max_watches_caps_its_sessions_and_no_one_else() {
    let text = format!(
        "{}capped {} read:app/ max-watches=3\n",
        auth_file(),
        kunci::core::access::hash_hex(CAPPED)
    );
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), FIRST_TOKEN), Vec::new());
    endpoint.require_authentication(AccessList::parse(&text).unwrap());
    let mut wire = Wire { endpoint, now: 0 };
    for (id, secret) in [(0, CAPPED), (1, CAPPED), (2, READER), (3, LOCKER)] {
        wire.connect(id);
        let answer = wire.exchange(id, &authenticate(secret));
        assert_eq!(answer[0], b'U');
    }
    // Two sessions of `capped` share its three.
    assert_eq!(wire.exchange(0, &observe(60, 1, 0, "app/a")), b"");
    assert_eq!(wire.exchange(0, &observe(60, 2, 0, "app/b")), b"");
    assert_eq!(wire.exchange(1, &observe(60, 3, 0, "app/a")), b"");
    assert_eq!(
        wire.exchange(1, &observe(60, 4, 0, "app/c")),
        x(14, 4, "too many watches")
    );
    // Answered at once: never refused.
    assert_eq!(wire.exchange(1, &observe(0, 5, 0, "app/c")), v_free(5));
    // Others are not affected.
    for id in 6..10 {
        assert_eq!(wire.exchange(2, &observe(60, id, 0, "app/a")), b"");
    }
    // A watch answered gives its charge back.
    assert_eq!(
        wire.exchange(3, &acquire(0, 30, 10, "app/b")),
        a(10, FIRST_TOKEN)
    );
    assert_eq!(wire.recv(0), v(2, FIRST_TOKEN, 30_000, 0, 1, 0, ""));
    assert_eq!(wire.exchange(1, &observe(60, 11, 0, "app/c")), b"");
    assert_eq!(
        wire.exchange(0, &observe(60, 12, 0, "app/d")),
        x(14, 12, "too many watches")
    );
    // So does a watch dropped with its connection.
    wire.endpoint.handle_eof(1, wire.now);
    assert_eq!(wire.exchange(0, &observe(60, 13, 0, "app/d")), b"");
    assert_eq!(wire.endpoint.core().watch_count(), 6);
}

#[test]
fn a_watch_ends_with_its_connection_without_a_trace() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &acquire(0, 30, 1, "k"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    let mut bytes = observe(60, 2, FIRST_TOKEN, "k");
    bytes.extend_from_slice(&observe(60, 3, 0, "other"));
    wire.send(1, &bytes);
    assert_eq!(wire.info(0, "watches"), "2");
    wire.endpoint.handle_eof(1, wire.now);
    assert_eq!(wire.actions(), [(1, Action::Close)]);
    assert_eq!(wire.info(0, "watches"), "0");
    wire.send(0, &release(FIRST_TOKEN, "k"));
    assert_eq!(wire.recv(0), op_u64(b'R', FIRST_TOKEN));
    // The deadline that was armed fires nothing.
    wire.at(60 * S);
    assert_eq!(wire.endpoint.poll_timeout(), None);
}

#[test]
fn a_clean_stop_answers_waiters_b_then_watches_v_then_x8() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &s_frame(0, 30, 1, 0, 0, b"k", b"host-a"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    wire.at(3 * S);
    wire.send(1, &observe(60, 2, FIRST_TOKEN, "k"));
    wire.send(1, &acquire(60, 30, 3, "k"));
    wire.endpoint.shut_down(wire.now);
    // The waiter's B first, then the watch with the state at that moment
    // (the waiter gone), then X 8.
    assert_eq!(
        wire.recv(1),
        cat(&[
            op_u64(b'B', 3),
            v(2, FIRST_TOKEN, 27_000, 3_000, 1, 0, "host-a"),
            x(8, 0, "server shutting down"),
        ])
    );
    assert_eq!(wire.endpoint.core().watch_count(), 0);
}

#[test]
fn observe_needs_read_or_lock_on_the_key() {
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), FIRST_TOKEN), Vec::new());
    endpoint.require_authentication(AccessList::parse(&auth_file()).unwrap());
    let mut wire = Wire { endpoint, now: 0 };
    for (id, secret) in [(0, READER), (1, LOCKER)] {
        wire.connect(id);
        let answer = wire.exchange(id, &authenticate(secret));
        assert_eq!(answer[0], b'U');
    }
    assert_eq!(wire.exchange(0, &observe(0, 1, 0, "app/x")), v_free(1));
    assert_eq!(wire.exchange(1, &observe(0, 2, 0, "app/x")), v_free(2));
    assert_eq!(
        wire.exchange(0, &observe(0, 3, 0, "other")),
        x(13, 3, "not permitted")
    );
    assert_eq!(
        wire.exchange(1, &observe(10, 4, 0, "other")),
        x(13, 4, "not permitted")
    );
    assert_eq!(wire.endpoint.core().watch_count(), 0);
}

#[test]
fn a_malformed_observe_gets_its_error_with_its_id() {
    let mut wire = Wire::new();
    wire.connect(0);
    assert_eq!(
        wire.exchange(0, &observe(10, 5, 0, "")),
        x(3, 5, "key is empty")
    );
    let mut bad = observe(10, 6, 0, "k");
    bad.insert(bad.len() - 1, 0xff);
    assert_eq!(wire.exchange(0, &bad), x(4, 6, "key is not valid UTF-8"));
    assert_eq!(wire.exchange(0, &ping(1)), op_u64(b'P', 1));
}

#[test]
fn a_permit_key_shows_its_smallest_token_and_wakes_only_when_it_goes() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &s_frame(0, 30, 1, 3, 1, b"p", b"one"));
    wire.send(0, &s_frame(0, 30, 2, 3, 1, b"p", b"two"));
    assert_eq!(
        wire.recv(0),
        cat(&[a(1, FIRST_TOKEN), a(2, FIRST_TOKEN + 1)])
    );
    assert_eq!(wire.exchange(1, &observe(60, 7, FIRST_TOKEN, "p")), b"");
    // The newer grant going changes nothing.
    wire.send(0, &release(FIRST_TOKEN + 1, "p"));
    assert_eq!(wire.recv(0), op_u64(b'R', FIRST_TOKEN + 1));
    assert_eq!(wire.recv(1), b"");
    wire.send(0, &s_frame(0, 30, 3, 3, 1, b"p", b"three"));
    wire.send(0, &release(FIRST_TOKEN, "p"));
    assert_eq!(
        wire.recv(0),
        cat(&[a(3, FIRST_TOKEN + 2), op_u64(b'R', FIRST_TOKEN)])
    );
    assert_eq!(
        wire.recv(1),
        v(7, FIRST_TOKEN + 2, 30_000, 0, 1, 0, "three")
    );
}

#[test]
fn during_a_crash_grace_v_shows_what_q_shows_and_the_end_is_no_change() {
    let mut wire = Wire::new();
    wire.endpoint.core_mut().set_grace_until(10 * S);
    wire.connect(0);
    assert_eq!(
        wire.exchange(0, &observe(0, 1, 0, "k")),
        v(1, 0, 10_000, 0, 1, 0, "")
    );
    assert_eq!(wire.exchange(0, &observe(20, 2, 0, "k")), b"");
    wire.at(10 * S);
    assert_eq!(wire.recv(0), b"", "the end of the grace is a change");
    wire.at(20 * S);
    assert_eq!(wire.recv(0), v_free(2));
}

/// Regression: the output a connection may hold counted 18 bytes per
/// wait (a `T`), but a watch's deferred answer is a `V` of up to 160
/// bytes; a connection that watched one labelled key 4,096 times and did
/// not read broke the endpoint's output bound when the key changed.
#[test]
fn every_watch_of_a_connection_answered_at_once_stays_within_the_output_bound() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    let label = "l".repeat(128);
    wire.send(0, &s_frame(0, 30, 1, 0, 0, b"k", label.as_bytes()));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    let per_conn = Limits::default().max_watches_per_conn as u64;
    let mut bytes = Vec::new();
    for id in 0..per_conn {
        bytes.extend_from_slice(&observe(60, id, FIRST_TOKEN, "k"));
    }
    // Like the shell: read only while the endpoint wants to; a connection
    // that spent its share of a turn goes on at the next (spec §4).
    let mut chunks = bytes.chunks(4096);
    let mut turns = 0;
    while (wire.endpoint.core().watch_count() as u64) < per_conn {
        if wire.endpoint.wants_read(1) {
            if let Some(chunk) = chunks.next() {
                wire.send(1, chunk);
                continue;
            }
        }
        wire.endpoint.begin_turn(wire.now);
        wire.endpoint.check_invariants();
        turns += 1;
        assert!(turns < 100, "the watches were never all read");
    }
    assert_eq!(wire.endpoint.core().watch_count() as u64, per_conn);
    // Connection 1 reads nothing; the key goes to a labelled waiter.
    wire.connect(2);
    wire.send(2, &s_frame(60, 30, 2, 0, 0, b"k", label.as_bytes()));
    wire.send(0, &release(FIRST_TOKEN, "k"));
    assert_eq!(wire.recv(2), a(2, FIRST_TOKEN + 1));
    assert_eq!(wire.endpoint.core().watch_count(), 0);
    let answers = wire.recv(1);
    assert_eq!(answers.len() as u64, per_conn * (1 + 30 + 128 + 1));
}

#[test]
fn an_identity_max_connections_refuses_one_more_session_with_x7_and_no_one_else() {
    let text = format!(
        "{}capped {} read:app/ max-watches=10 max-connections=4\n",
        auth_file(),
        kunci::core::access::hash_hex(CAPPED)
    );
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), FIRST_TOKEN), Vec::new());
    endpoint.require_authentication(AccessList::parse(&text).unwrap());
    let mut wire = Wire { endpoint, now: 0 };
    let capped_u = b"Ucapped\n".to_vec();
    for id in 0..4 {
        wire.connect(id);
        assert_eq!(wire.exchange(id, &authenticate(CAPPED)), capped_u);
    }
    // Its fifth session: `X 7` (id 0), then closed.
    wire.connect(4);
    assert_eq!(
        wire.exchange(4, &authenticate(CAPPED)),
        x(7, 0, "connection limit reached")
    );
    assert_eq!(wire.actions(), [(4, Action::ShutWrite)]);
    wire.endpoint.handle_eof(4, wire.now);
    assert_eq!(wire.actions(), [(4, Action::Close)]);
    // Other identities are not affected.
    for id in 5..10 {
        wire.connect(id);
        assert_eq!(wire.exchange(id, &authenticate(READER))[0], b'U');
    }
    // Its eleventh watch: `X 14`.
    for n in 0..10 {
        let frame = observe(60, n, 0, &format!("app/{n}"));
        assert_eq!(wire.exchange((n % 4) as ConnId, &frame), b"");
    }
    assert_eq!(
        wire.exchange(3, &observe(60, 10, 0, "app/10")),
        x(14, 10, "too many watches")
    );
    assert_eq!(wire.exchange(5, &observe(60, 11, 0, "app/10")), b"");
    // A session that closes makes room for another.
    wire.endpoint.handle_eof(0, wire.now);
    assert_eq!(wire.actions(), [(0, Action::Close)]);
    wire.connect(4);
    assert_eq!(wire.exchange(4, &authenticate(CAPPED)), capped_u);
}

/// Spec §4 (v5): the watches one grant wakes are answered within a turn's
/// work, the rest in the next turns, each bounded, all with the new grant.
#[test]
fn one_grant_waking_260000_watches_answers_them_over_bounded_turns() {
    const CONNS: u32 = 52;
    const PER_CONN: u64 = 5_000;
    let limits = Limits {
        max_watches: 260_000,
        max_watches_per_conn: PER_CONN as u32,
        ..Limits::default()
    };
    let mut core = Core::new(limits, FIRST_TOKEN);
    for conn in 0..=CONNS {
        core.connect(conn);
    }
    for conn in 0..CONNS {
        for id in 0..PER_CONN {
            let request = Request::Observe {
                wait_s: 60,
                id,
                since: 0,
                key: "k",
            };
            core.handle_request(conn, &request, 0);
        }
    }
    assert_eq!(core.drain_outbox().count(), 0);
    assert_eq!(core.watch_count(), 260_000);
    let label = "l".repeat(128);
    core.begin_turn();
    let acquire = Request::Acquire {
        wait_s: 0,
        lease_s: 30,
        owner: 1,
        key: "k",
        limit: 0,
        take: 0,
        label: &label,
    };
    core.handle_request(CONNS, &acquire, MS);
    let first: Vec<_> = core.drain_outbox().collect();
    assert_eq!(
        first[0],
        (
            CONNS,
            Response::Acquired {
                owner: 1,
                token: FIRST_TOKEN
            }
        )
    );
    let budget = kunci::core::TURN_WORK as usize;
    assert_eq!(first.len(), 1 + budget);
    let mut answered = 0;
    let mut check = |out: &[(ConnId, Response)]| {
        for (_, response) in out {
            match response {
                Response::KeyState {
                    token,
                    grants: 1,
                    label: got,
                    ..
                } if *token == FIRST_TOKEN && *got == label => answered += 1,
                other => panic!("{other:?}"),
            }
        }
    };
    check(&first[1..]);
    let mut turns = 1;
    while core.watch_count() > 0 {
        assert_eq!(core.poll_timeout(), Some(0), "watches left for later");
        core.begin_turn();
        core.handle_timeout(MS);
        let out: Vec<_> = core.drain_outbox().collect();
        assert!(!out.is_empty() && out.len() <= budget, "{}", out.len());
        check(&out);
        turns += 1;
    }
    core.check_invariants();
    assert_eq!(answered, 260_000);
    assert_eq!(turns, 260_000usize.div_ceil(budget));
    // Nothing is left to do before the lease's end.
    assert!(core.poll_timeout().is_some_and(|next| next > MS));
}

/// Spec §4 (v5): leases ending together end over several turns, none
/// before its deadline.
#[test]
fn leases_ending_together_end_over_bounded_turns_never_early() {
    let mut core = Core::new(Limits::default(), FIRST_TOKEN);
    core.connect(0);
    for n in 0..10_000 {
        let key = format!("k{n}");
        let acquire = Request::Acquire {
            wait_s: 0,
            lease_s: 1,
            owner: n,
            key: &key,
            limit: 0,
            take: 0,
            label: "",
        };
        core.handle_request(0, &acquire, 0);
    }
    assert_eq!(core.drain_outbox().count(), 10_000);
    core.handle_timeout(S - 1);
    assert_eq!(core.keys(), 10_000, "a lease ended early");
    let budget = kunci::core::TURN_WORK as usize;
    let mut turns = 0;
    while core.keys() > 0 {
        let before = core.keys();
        core.begin_turn();
        core.handle_timeout(S);
        assert!(before - core.keys() <= budget, "{}", before - core.keys());
        turns += 1;
        assert!(turns <= 10, "leases never ended");
    }
    assert_eq!(turns, 10_000usize.div_ceil(budget));
    assert_eq!(core.stats().expired, 10_000);
}
