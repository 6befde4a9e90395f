//! `C` (spec §2.1, §13.4a): the label of the exact grant `token` of a key
//! becomes the proclaimed one, byte for byte through the sans-IO endpoint
//! on a fake clock: `C token` or `N token`, nothing else changes, and a
//! `C` on the key's current grant answers every watch of the key.

use kunci::core::access::AccessList;
use kunci::core::endpoint::Endpoint;
use kunci::core::{Core, Limits};
use kunci::protocol::{self, Decoded, ErrorCode, Request, RequestError, Response};

use crate::access::{LOCKER, READER, auth_file, authenticate};
use crate::util::fake::{FIRST_TOKEN, S};
use crate::util::frames::{a, holders, observe, op_u64, x};
use crate::util::wire::Wire;
use crate::util::{acquire, extend, ping, release, s_frame};

/// A `V` with an empty queue.
fn v(id: u64, token: u64, lease_ms: u32, held_ms: u32, grants: u16, label: &str) -> Vec<u8> {
    crate::util::frames::v(id, token, lease_ms, held_ms, grants, 0, label)
}

/// A `C` frame written out as §2.1 lays it out:
/// `C token:u64 klen:u8 key label \n`.
fn proclaim(token: u64, key: &[u8], label: &[u8]) -> Vec<u8> {
    let mut frame = vec![b'C'];
    frame.extend_from_slice(&token.to_be_bytes());
    frame.push(key.len() as u8);
    frame.extend_from_slice(key);
    frame.extend_from_slice(label);
    frame.push(b'\n');
    frame
}

#[test]
fn c_frames_are_what_the_codec_reads_and_writes() {
    let frame = proclaim(0x0102_0304_0506_0708, b"db", b"host-a:5432");
    assert_eq!(frame.len(), 1 + 9 + 2 + 11 + 1);
    let request = Request::Proclaim {
        token: 0x0102_0304_0506_0708,
        key: "db",
        label: "host-a:5432",
    };
    assert_eq!(
        protocol::decode_request(&frame),
        Decoded::Request {
            request,
            len: frame.len()
        }
    );
    let mut again = Vec::new();
    protocol::encode_request(&request, &mut again);
    assert_eq!(again, frame);
    // An empty label clears it; the header may hold 0x0A.
    let empty = proclaim(0x0A0A, b"k", b"");
    assert_eq!(
        protocol::decode_request(&empty),
        Decoded::Request {
            request: Request::Proclaim {
                token: 0x0A0A,
                key: "k",
                label: ""
            },
            len: empty.len()
        }
    );
    // Split anywhere: incomplete until the last byte.
    for cut in 0..frame.len() {
        assert_eq!(protocol::decode_request(&frame[..cut]), Decoded::Incomplete);
    }
    // `C token` answers it.
    let answer = Response::Proclaimed { token: 77 };
    let mut bytes = Vec::new();
    protocol::encode_response(&answer, &mut bytes);
    assert_eq!(bytes, op_u64(b'C', 77));
    assert_eq!(
        protocol::decode_response(&bytes),
        Ok(Some((answer, bytes.len())))
    );
    let sent = request.correlation();
    assert!(sent.is_answered_by(&Response::Proclaimed {
        token: 0x0102_0304_0506_0708
    }));
    assert!(sent.is_answered_by(&Response::NotHeld {
        token: 0x0102_0304_0506_0708
    }));
    assert!(!sent.is_answered_by(&Response::Proclaimed { token: 1 }));
    assert_eq!(request.error_id(), 0x0102_0304_0506_0708);
}

#[test]
fn c_is_bounded_like_s_and_checks_key_and_label_with_codes_3_and_4() {
    // The largest frame: a 255-byte key and a 128-byte label.
    let key = vec![b'k'; 255];
    let largest = proclaim(1, &key, &[b'l'; 128]);
    assert_eq!(largest.len(), 1 + 9 + 255 + 128 + 1);
    assert!(matches!(
        protocol::decode_request(&largest),
        Decoded::Request { len, .. } if len == largest.len()
    ));
    // No `\n` within klen + 129 bytes after the header: too long (fatal).
    let long = proclaim(2, b"k", &[b'l'; 129]);
    assert_eq!(
        protocol::decode_request(&long),
        Decoded::Fatal(RequestError {
            code: ErrorCode::FrameTooLong,
            id: 2
        })
    );
    let invalid = |frame: &[u8], code| Decoded::Invalid {
        error: RequestError { code, id: 3 },
        len: frame.len(),
    };
    let empty_key = proclaim(3, b"", b"label");
    assert_eq!(
        protocol::decode_request(&empty_key),
        invalid(&empty_key, ErrorCode::EmptyKey)
    );
    let bad_key = proclaim(3, b"k\xff", b"");
    assert_eq!(
        protocol::decode_request(&bad_key),
        invalid(&bad_key, ErrorCode::KeyNotUtf8)
    );
    let newline_key = proclaim(3, b"k\n", b"x");
    assert_eq!(
        protocol::decode_request(&newline_key),
        invalid(&newline_key, ErrorCode::KeyNotUtf8)
    );
    let bad_label = proclaim(3, b"k", b"\xc3");
    assert_eq!(
        protocol::decode_request(&bad_label),
        invalid(&bad_label, ErrorCode::KeyNotUtf8)
    );
    // On the wire: a non-fatal `X` with the token as its id, then the
    // next frame is served.
    let mut wire = Wire::new();
    wire.connect(0);
    assert_eq!(wire.exchange(0, &empty_key), x(3, 3, "key is empty"));
    assert_eq!(
        wire.exchange(0, &bad_label),
        x(4, 3, "key is not valid UTF-8")
    );
    assert_eq!(wire.exchange(0, &ping(5)), op_u64(b'P', 5));
}

#[test]
fn c_sets_the_label_of_the_exact_grant_and_nothing_else() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &acquire(0, 30, 1, "k"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    wire.send(1, &acquire(60, 30, 2, "k"));
    wire.at(4 * S);
    // From another connection too: the token is the capability.
    assert_eq!(
        wire.exchange(1, &proclaim(FIRST_TOKEN, b"k", b"host-a")),
        op_u64(b'C', FIRST_TOKEN)
    );
    // The lease still ends at 30 s and the grant time is the grant's.
    assert_eq!(wire.exchange(1, &observe(0, 9, 0, "k")), {
        let mut state = v(9, FIRST_TOKEN, 26_000, 4_000, 1, "host-a");
        // One waiter queued.
        state[27..31].copy_from_slice(&1u32.to_be_bytes());
        state
    });
    let mut grant = vec![b'G'];
    grant.extend_from_slice(&5u64.to_be_bytes());
    grant.extend_from_slice(&FIRST_TOKEN.to_be_bytes());
    grant.extend_from_slice(&1u64.to_be_bytes());
    grant.extend_from_slice(&26_000u32.to_be_bytes());
    grant.extend_from_slice(&4_000u32.to_be_bytes());
    grant.extend_from_slice(&0u16.to_be_bytes());
    grant.extend_from_slice(b"host-a\n");
    assert_eq!(wire.exchange(1, &holders(5, "k"))[..grant.len()], grant);
    // Another token, another key, token 0: `N`, nothing changed.
    for (token, key) in [
        (FIRST_TOKEN + 1, &b"k"[..]),
        (FIRST_TOKEN - 1, b"k"),
        (0, b"k"),
        (FIRST_TOKEN, b"other"),
    ] {
        assert_eq!(
            wire.exchange(0, &proclaim(token, key, b"thief")),
            op_u64(b'N', token)
        );
    }
    assert_eq!(
        wire.exchange(0, &observe(0, 10, 0, "k"))[31..],
        *b"host-a\n"
    );
    assert_eq!(wire.endpoint.core().keys(), 1, "a C adds no key");
    // An empty label clears it.
    assert_eq!(
        wire.exchange(0, &proclaim(FIRST_TOKEN, b"k", b"")),
        op_u64(b'C', FIRST_TOKEN)
    );
    assert_eq!(wire.exchange(0, &observe(0, 11, 0, "k"))[31..], *b"\n");
    // The lease was not touched: the key goes on at 30 s.
    wire.at(30 * S);
    assert_eq!(wire.recv(1), a(2, FIRST_TOKEN + 1));
    let info = String::from_utf8(wire.exchange(0, b"I\n")).unwrap();
    assert!(info.contains(" not_held=4 "), "{info}");
}

#[test]
fn a_c_that_changes_the_current_label_answers_every_watch_of_the_key() {
    let mut wire = Wire::new();
    for id in 0..3 {
        wire.connect(id);
    }
    wire.send(0, &s_frame(0, 30, 1, 0, 0, b"k", b"old"));
    assert_eq!(wire.recv(0), a(1, FIRST_TOKEN));
    wire.at(2 * S);
    assert_eq!(wire.exchange(1, &observe(60, 7, FIRST_TOKEN, "k")), b"");
    assert_eq!(wire.exchange(2, &observe(60, 8, FIRST_TOKEN, "k")), b"");
    // The same label again changes nothing: nobody is answered.
    assert_eq!(
        wire.exchange(0, &proclaim(FIRST_TOKEN, b"k", b"old")),
        op_u64(b'C', FIRST_TOKEN)
    );
    assert_eq!(wire.recv(1), b"");
    // An `E` or a `C` of another key wakes nothing either.
    wire.send(0, &extend(30, FIRST_TOKEN, "k"));
    assert_eq!(wire.recv(0), op_u64(b'E', FIRST_TOKEN));
    assert_eq!(wire.recv(1), b"");
    wire.at(3 * S);
    assert_eq!(
        wire.exchange(0, &proclaim(FIRST_TOKEN, b"k", b"new")),
        op_u64(b'C', FIRST_TOKEN)
    );
    // Same token, new label, lease from the `E` at 2 s, held 3 s.
    let woken = v(7, FIRST_TOKEN, 29_000, 3_000, 1, "new");
    assert_eq!(wire.recv(1), woken);
    let mut other = woken.clone();
    other[1..9].copy_from_slice(&8u64.to_be_bytes());
    assert_eq!(wire.recv(2), other);
    assert_eq!(wire.endpoint.core().watch_count(), 0);
    // Asking again with the same `since` is held as before.
    assert_eq!(wire.exchange(1, &observe(60, 9, FIRST_TOKEN, "k")), b"");
    assert_eq!(wire.endpoint.core().watch_count(), 1);
    wire.send(0, &release(FIRST_TOKEN, "k"));
    assert_eq!(wire.recv(0), op_u64(b'R', FIRST_TOKEN));
    assert_eq!(wire.recv(1), v(9, 0, 0, 0, 0, ""));
}

#[test]
fn on_a_permit_key_only_the_current_grant_s_label_wakes_watches() {
    let mut wire = Wire::new();
    wire.connect(0);
    wire.connect(1);
    wire.send(0, &s_frame(0, 30, 1, 3, 1, b"p", b"one"));
    wire.send(0, &s_frame(0, 30, 2, 3, 1, b"p", b"two"));
    assert_eq!(
        wire.recv(0),
        [a(1, FIRST_TOKEN), a(2, FIRST_TOKEN + 1)].concat()
    );
    assert_eq!(wire.exchange(1, &observe(60, 7, FIRST_TOKEN, "p")), b"");
    assert_eq!(
        wire.exchange(0, &proclaim(FIRST_TOKEN + 1, b"p", b"second")),
        op_u64(b'C', FIRST_TOKEN + 1)
    );
    assert_eq!(wire.recv(1), b"", "not the current grant");
    let mut grants = wire.exchange(0, &holders(3, "p"));
    grants.truncate(grants.len() - 22);
    assert!(grants.ends_with(b"second\n"), "{grants:?}");
    assert_eq!(
        wire.exchange(0, &proclaim(FIRST_TOKEN, b"p", b"first")),
        op_u64(b'C', FIRST_TOKEN)
    );
    assert_eq!(wire.recv(1), v(7, FIRST_TOKEN, 30_000, 0, 2, "first"));
}

#[test]
fn c_needs_lock_on_the_key() {
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), FIRST_TOKEN), Vec::new());
    endpoint.require_authentication(AccessList::parse(&auth_file()).unwrap());
    let mut wire = Wire { endpoint, now: 0 };
    for (id, secret) in [(0, READER), (1, LOCKER)] {
        wire.connect(id);
        let answer = wire.exchange(id, &authenticate(secret));
        assert_eq!(answer[0], b'U');
    }
    wire.send(1, &acquire(0, 30, 1, "app/x"));
    assert_eq!(wire.recv(1), a(1, FIRST_TOKEN));
    assert_eq!(
        wire.exchange(0, &proclaim(FIRST_TOKEN, b"app/x", b"r")),
        x(13, FIRST_TOKEN, "not permitted")
    );
    assert_eq!(
        wire.exchange(1, &proclaim(FIRST_TOKEN, b"other", b"r")),
        x(13, FIRST_TOKEN, "not permitted")
    );
    assert_eq!(
        wire.exchange(1, &proclaim(FIRST_TOKEN, b"app/x", b"mine")),
        op_u64(b'C', FIRST_TOKEN)
    );
}

#[test]
fn during_a_crash_grace_c_of_an_earlier_token_adopts_nothing() {
    let mut wire = Wire::new();
    wire.endpoint.core_mut().set_grace_until(10 * S);
    wire.connect(0);
    assert_eq!(
        wire.exchange(0, &proclaim(FIRST_TOKEN - 5, b"k", b"mine")),
        op_u64(b'N', FIRST_TOKEN - 5)
    );
    assert_eq!(
        wire.exchange(0, &observe(0, 1, 0, "k")),
        v(1, 0, 10_000, 0, 1, "")
    );
    assert_eq!(wire.endpoint.core().keys(), 0);
}
