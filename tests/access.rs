//! Secrets and scopes (spec §12.1–12.3) in the sans-IO endpoint, byte for
//! byte: which request a session may make, what a failed `U` closes, and
//! that nothing behind it runs.

use kunci::core::access::{AccessList, hash_hex};
use kunci::core::endpoint::{Action, Endpoint};
use kunci::core::{ConnId, Core, Limits};
use kunci::protocol::{self, ErrorCode, Request, Response};

use crate::util::fake::FIRST_TOKEN;
use crate::util::{acquire, query, release};

pub const LOCKER: &[u8] = b"locker-secret-0123456789abcdef-0123";
pub const READER: &[u8] = b"reader-secret-0123456789abcdef-0123";
pub const INFO: &[u8] = b"info-secret-0123456789abcdef-012345";
pub const EVERYTHING: &[u8] = b"everything-secret-0123456789abcdef-";

/// An `--auth` file: `locker` may lock `app/`, `reader` read `app/`,
/// `watcher` only `I`, `root` everything.
pub fn auth_file() -> String {
    format!(
        "# who may do what\n\
         \n\
         locker {} lock:app/\n  \
         # reader: read only\n\
         reader {} read:app/\n\
         watcher {} info\n\
         root {} lock:* info\n",
        hash_hex(LOCKER),
        hash_hex(READER).to_uppercase(),
        hash_hex(INFO),
        hash_hex(EVERYTHING),
    )
}

pub fn encode(request: &Request<'_>) -> Vec<u8> {
    let mut bytes = Vec::new();
    protocol::encode_request(request, &mut bytes);
    bytes
}

pub fn authenticate(secret: &[u8]) -> Vec<u8> {
    encode(&Request::Authenticate { secret })
}

fn frame(response: &Response) -> Vec<u8> {
    let mut out = Vec::new();
    protocol::encode_response(response, &mut out);
    out
}

fn frames(responses: &[Response]) -> Vec<u8> {
    responses.iter().flat_map(frame).collect()
}

fn authenticated(name: &str) -> Response {
    Response::Authenticated {
        name: name.to_owned(),
    }
}

fn granted(owner: u64, token: u64) -> Vec<u8> {
    frame(&Response::Acquired { owner, token })
}

fn busy(owner: u64) -> Vec<u8> {
    frame(&Response::Busy { owner })
}

fn released(token: u64) -> Vec<u8> {
    frame(&Response::Released { token })
}

/// An endpoint that requires `U` against the `--auth` file `text`.
fn endpoint_with_auth(text: &str) -> Endpoint {
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), FIRST_TOKEN), Vec::new());
    endpoint.require_authentication(AccessList::parse(text).unwrap());
    endpoint
}

struct Wire {
    endpoint: Endpoint,
}

impl Wire {
    fn new() -> Wire {
        Wire {
            endpoint: endpoint_with_auth(&auth_file()),
        }
    }

    fn connect(&mut self, id: ConnId) {
        self.endpoint.accept(id, None, 0);
    }

    /// Connects `id` and authenticates it with `secret`.
    fn session(&mut self, id: ConnId, secret: &[u8], name: &str) {
        self.connect(id);
        assert_eq!(
            self.exchange(id, &authenticate(secret)),
            frame(&authenticated(name))
        );
    }

    /// Sends `bytes` on `id` and returns everything it answers at once.
    fn exchange(&mut self, id: ConnId, bytes: &[u8]) -> Vec<u8> {
        exchange_at(&mut self.endpoint, id, bytes, 0)
    }

    fn actions(&mut self) -> Vec<(ConnId, Action)> {
        std::iter::from_fn(|| self.endpoint.poll_action()).collect()
    }
}

fn not_authenticated() -> Vec<u8> {
    frame(&ErrorCode::NotAuthenticated.response(0))
}

fn not_permitted(id: u64) -> Vec<u8> {
    frame(&ErrorCode::NotPermitted.response(id))
}

#[test]
fn a_session_must_authenticate_first() {
    let short = &LOCKER[..31];
    let unknown = b"0123456789abcdef0123456789abcdef";
    let cases: [(&str, Vec<u8>); 6] = [
        ("no U first", query("app/a")),
        ("a ping first", encode(&Request::Ping { nonce: 5 })),
        ("an invalid request first", b"Q\n".to_vec()),
        ("a short secret", authenticate(short)),
        ("an unknown secret", authenticate(unknown)),
        ("an empty secret", authenticate(b"")),
    ];
    let mut wire = Wire::new();
    for (index, (case, bytes)) in cases.iter().enumerate() {
        let id = index as ConnId;
        wire.connect(id);
        assert_eq!(wire.exchange(id, bytes), not_authenticated(), "{case}");
        // Fatal: flushed, write side shut, nothing more read.
        assert_eq!(wire.actions(), [(id, Action::ShutWrite)], "{case}");
        assert_eq!(wire.exchange(id, &authenticate(LOCKER)), b"", "{case}");
    }
    let stats = wire.endpoint.core().stats();
    assert_eq!(stats.auth_failures, cases.len() as u64);
    assert_eq!(stats.errors_by_code[12], cases.len() as u64);
    let info = wire.endpoint.core().info_text(0);
    assert!(
        info.ends_with(" auth_failures=6 watches=0 state_errors=0"),
        "{info}"
    );
}

#[test]
fn framing_errors_stay_framing_errors_before_authentication() {
    let mut wire = Wire::new();
    wire.connect(0);
    assert_eq!(
        wire.exchange(0, b"?\n"),
        frame(&ErrorCode::UnknownOp.response(0))
    );
    assert_eq!(wire.endpoint.core().stats().auth_failures, 0);
}

#[test]
fn requests_behind_a_failed_authentication_never_run() {
    let mut wire = Wire::new();
    wire.connect(0);
    let mut burst = authenticate(b"0123456789abcdef0123456789abcdeX");
    burst.extend(acquire(0, 30, 1, "app/a"));
    burst.extend(authenticate(LOCKER));
    burst.extend(acquire(0, 30, 2, "app/a"));
    assert_eq!(wire.exchange(0, &burst), not_authenticated());
    wire.session(1, LOCKER, "locker");
    assert_eq!(
        wire.exchange(1, &query("app/a")),
        frame(&Response::Query {
            token: 0,
            owner: 0,
            lease_ms: 0,
            waiters: 0
        })
    );
    assert_eq!(wire.endpoint.core().stats().grants, 0);
}

#[test]
fn a_second_authentication_is_refused_and_changes_nothing() {
    let mut wire = Wire::new();
    wire.session(0, READER, "reader");
    assert_eq!(wire.exchange(0, &authenticate(LOCKER)), not_permitted(0));
    assert_eq!(wire.exchange(0, &authenticate(b"x")), not_permitted(0));
    // Still the reader: no lock.
    assert_eq!(
        wire.exchange(0, &acquire(0, 30, 7, "app/a")),
        not_permitted(7)
    );
    assert!(wire.actions().is_empty());
    assert_eq!(wire.endpoint.core().stats().auth_failures, 0);
}

/// What a session with each identity may do, op by op, inside and outside
/// its prefix.
#[test]
fn every_op_is_held_to_the_scopes() {
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Needs {
        Lock,
        Read,
        Info,
        List,
        Nothing,
    }
    let label = "";
    /// A frame for a key, and the id its `X` carries.
    type Build = Box<dyn Fn(&str) -> (Vec<u8>, u64)>;
    /// Whether an identity may make a request that needs this, on a key
    /// inside its prefix or not.
    type Permitted = fn(Needs, bool) -> bool;
    let ops: Vec<(&str, Needs, Build)> = vec![
        (
            "A",
            Needs::Lock,
            Box::new(|key| (acquire(0, 30, 11, key), 11)),
        ),
        (
            "S",
            Needs::Lock,
            Box::new(move |key| {
                let request = Request::Acquire {
                    wait_s: 0,
                    lease_s: 30,
                    owner: 12,
                    key,
                    limit: 5,
                    take: 1,
                    label,
                };
                (encode(&request), 12)
            }),
        ),
        ("R", Needs::Lock, Box::new(|key| (release(13, key), 13))),
        (
            "E",
            Needs::Lock,
            Box::new(|key| {
                let request = Request::Extend {
                    lease_s: 9,
                    token: 14,
                    key,
                };
                (encode(&request), 14)
            }),
        ),
        ("Q", Needs::Read, Box::new(|key| (query(key), 0))),
        (
            "H",
            Needs::Read,
            Box::new(|key| (encode(&Request::Holders { id: 15, key }), 15)),
        ),
        (
            "L",
            Needs::List,
            Box::new(|key| {
                let request = Request::List {
                    id: 16,
                    cursor: 0,
                    count: 10,
                    prefix: key,
                };
                (encode(&request), 16)
            }),
        ),
        ("I", Needs::Info, Box::new(|_| (b"I\n".to_vec(), 0))),
        (
            "P",
            Needs::Nothing,
            Box::new(|_| (encode(&Request::Ping { nonce: 17 }), 17)),
        ),
    ];
    let identities: [(&[u8], &str, Permitted); 4] = [
        (LOCKER, "locker", |needs, inside| match needs {
            Needs::Lock | Needs::Read => inside,
            Needs::List | Needs::Nothing => true,
            Needs::Info => false,
        }),
        (READER, "reader", |needs, inside| match needs {
            Needs::Read => inside,
            Needs::List | Needs::Nothing => true,
            Needs::Lock | Needs::Info => false,
        }),
        (INFO, "watcher", |needs, _| {
            matches!(needs, Needs::Info | Needs::Nothing)
        }),
        (EVERYTHING, "root", |_, _| true),
    ];
    let keys = [
        ("app/x", true),
        ("app/", true),
        ("app", false),
        ("ap", false),
        ("apps/x", false),
        ("x/app/", false),
        ("*", false),
    ];
    let mut wire = Wire::new();
    let mut id = 0;
    for (secret, name, permitted) in identities {
        for (op, needs, build) in &ops {
            for (key, inside) in keys {
                wire.session(id, secret, name);
                let (bytes, error_id) = build(key);
                let answer = wire.exchange(id, &bytes);
                let refused = answer == not_permitted(error_id);
                assert_eq!(
                    refused,
                    !permitted(*needs, inside),
                    "{name} {op} {key:?}: {answer:?}"
                );
                if !refused {
                    assert!(
                        !answer.is_empty() && answer[0] != b'X',
                        "{name} {op} {key:?}"
                    );
                }
                id += 1;
            }
        }
    }
}

#[test]
fn a_refused_request_changes_nothing() {
    let mut wire = Wire::new();
    wire.session(0, LOCKER, "locker");
    wire.session(1, READER, "reader");
    let granted = wire.exchange(0, &acquire(0, 30, 1, "app/a"));
    let Ok(Some((Response::Acquired { token, .. }, _))) = protocol::decode_response(&granted)
    else {
        panic!("{granted:?}");
    };
    let before = *wire.endpoint.core().stats();
    assert_eq!(
        wire.exchange(1, &release(token, "app/a")),
        not_permitted(token)
    );
    assert_eq!(
        wire.exchange(1, &acquire(1, 30, 2, "app/a")),
        not_permitted(2)
    );
    let after = *wire.endpoint.core().stats();
    assert_eq!(after.errors, before.errors + 2);
    assert_eq!(
        (after.released, after.grants),
        (before.released, before.grants)
    );
    let Ok(Some((
        Response::Query {
            token: holder,
            waiters,
            ..
        },
        _,
    ))) = protocol::decode_response(&wire.exchange(1, &query("app/a")))
    else {
        panic!()
    };
    assert_eq!((holder, waiters), (token, 0));
}

#[test]
fn own_fields_are_checked_before_scopes() {
    let mut wire = Wire::new();
    wire.session(0, INFO, "watcher");
    // Empty key: X 3, not X 13.
    assert_eq!(
        wire.exchange(0, b"Q\n"),
        frame(&ErrorCode::EmptyKey.response(0))
    );
    let zero_count = encode(&Request::List {
        id: 4,
        cursor: 0,
        count: 0,
        prefix: "",
    });
    assert_eq!(
        wire.exchange(0, &zero_count),
        frame(&ErrorCode::InvalidCount.response(4))
    );
    let lease_zero = acquire(0, 0, 9, "elsewhere");
    assert_eq!(
        wire.exchange(0, &lease_zero),
        frame(&ErrorCode::ZeroLease.response(9))
    );
}

#[test]
fn listing_shows_only_keys_within_the_scopes() {
    let mut wire = Wire::new();
    wire.session(0, EVERYTHING, "root");
    for (owner, key) in ["app/a", "apps", "other", "app/b", "ap"].iter().enumerate() {
        wire.exchange(0, &acquire(0, 30, owner as u64, key));
    }
    let list = |prefix| {
        encode(&Request::List {
            id: 3,
            cursor: 0,
            count: 100,
            prefix,
        })
    };
    let keys = |bytes: Vec<u8>| {
        let mut at = 0;
        let mut keys = Vec::new();
        while let Ok(Some((response, len))) = protocol::decode_response(&bytes[at..]) {
            at += len;
            match response {
                Response::Key { key, .. } => keys.push(key),
                Response::End { count, .. } => assert_eq!(count as usize, keys.len()),
                other => panic!("{other:?}"),
            }
        }
        keys.sort();
        keys
    };
    assert_eq!(keys(wire.exchange(0, &list(""))).len(), 5);
    wire.session(1, READER, "reader");
    assert_eq!(keys(wire.exchange(1, &list(""))), ["app/a", "app/b"]);
    assert_eq!(keys(wire.exchange(1, &list("app/b"))), ["app/b"]);
    assert!(keys(wire.exchange(1, &list("other"))).is_empty());
    wire.session(2, INFO, "watcher");
    assert_eq!(wire.exchange(2, &list("")), not_permitted(3));
}

#[test]
fn a_server_without_auth_answers_u_with_an_empty_name() {
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), FIRST_TOKEN), Vec::new());
    endpoint.accept(0, None, 0);
    endpoint.handle_read(0, &authenticate(b"anything"), 0);
    endpoint.handle_read(0, &authenticate(b""), 0);
    assert_eq!(
        endpoint.transmit(0).unwrap(),
        frames(&[authenticated(""), authenticated("")])
    );
}

#[test]
fn the_secret_never_shows_in_debug_output() {
    let request = Request::Authenticate { secret: LOCKER };
    let text = format!("{request:?}");
    assert!(!text.contains("locker-secret"), "{text}");
    let list = AccessList::parse(&auth_file()).unwrap();
    let text = format!("{list:?}");
    assert!(!text.contains(&hash_hex(LOCKER)), "{text}");
}

/// Sends `bytes` on `id` at `now` and returns everything it answers.
fn exchange_at(endpoint: &mut Endpoint, id: ConnId, bytes: &[u8], now: u64) -> Vec<u8> {
    endpoint.handle_read(id, bytes, now);
    endpoint.check_invariants();
    written_at(endpoint, id, now)
}

/// Everything `id` has to send, written out at `now`.
fn written_at(endpoint: &mut Endpoint, id: ConnId, now: u64) -> Vec<u8> {
    let mut all = Vec::new();
    while let Some(bytes) = endpoint.transmit(id) {
        all.extend_from_slice(bytes);
        let n = bytes.len();
        endpoint.handle_written(id, n, now);
    }
    all
}

const TENANT: &[u8] = b"tenant-secret-0123456789abcdef-0123";

/// An endpoint whose `--auth` file gives `tenant` `lock:t/` with `quota`
/// and `root` everything, with each of `sessions` (id, secret, the name
/// `U` answers) connected and authenticated at 0.
fn quota_endpoint(quota: &str, sessions: &[(ConnId, &[u8], &str)]) -> Endpoint {
    let text = format!(
        "tenant {} lock:t/ {quota}\nroot {} lock:* info\n",
        hash_hex(TENANT),
        hash_hex(EVERYTHING)
    );
    let mut endpoint = endpoint_with_auth(&text);
    for &(id, secret, name) in sessions {
        endpoint.accept(id, None, 0);
        assert_eq!(
            exchange_at(&mut endpoint, id, &authenticate(secret), 0),
            frame(&authenticated(name))
        );
    }
    endpoint
}

#[test]
fn a_key_quota_answers_b_to_its_identity_only() {
    let sessions: [(ConnId, &[u8], &str); 2] = [(0, TENANT, "tenant"), (1, EVERYTHING, "root")];
    let mut endpoint = quota_endpoint("max-keys=2", &sessions);
    let ms = 1_000;
    let t = FIRST_TOKEN;
    let e = &mut endpoint;
    assert_eq!(
        exchange_at(e, 0, &acquire(0, 1, 1, "t/1"), 0),
        granted(1, t)
    );
    assert_eq!(
        exchange_at(e, 0, &acquire(5, 30, 2, "t/2"), 0),
        granted(2, t + 1)
    );
    // A third key is over the quota: `B` at once, nothing queued or made.
    assert_eq!(exchange_at(e, 0, &acquire(5, 30, 3, "t/3"), 0), busy(3));
    assert_eq!(e.core().keys_charged(0), 2);
    assert_eq!(
        exchange_at(e, 1, &query("t/3"), 0),
        frame(&Response::Query {
            token: 0,
            owner: 0,
            lease_ms: 0,
            waiters: 0
        })
    );
    // The other identity still takes keys, within the same prefix too.
    assert_eq!(
        exchange_at(e, 1, &acquire(0, 30, 4, "t/3"), 0),
        granted(4, t + 2)
    );
    assert_eq!(e.core().keys_charged(1), 0);
    // A key already in the table costs the quota nothing.
    assert_eq!(
        exchange_at(e, 0, &acquire(0, 30, 5, "t/3"), 0),
        frame(&Response::Timeout { owner: 5 })
    );
    // A release gives the key back; then a new one fits.
    assert_eq!(
        exchange_at(e, 0, &release(t + 1, "t/2"), 0),
        released(t + 1)
    );
    assert_eq!(e.core().keys_charged(0), 1);
    assert_eq!(
        exchange_at(e, 0, &acquire(0, 30, 6, "t/4"), 0),
        granted(6, t + 3)
    );
    assert_eq!(exchange_at(e, 0, &acquire(0, 30, 7, "t/5"), 0), busy(7));
    // Closing the session leaves its keys charged while they are leased...
    e.handle_eof(0, 0);
    e.handle_broken(0, 0);
    e.check_invariants();
    assert_eq!(e.core().keys_charged(0), 2);
    // ...and an expiry gives `t/1` back (its 1 s lease, at the next tick).
    e.handle_timeout(1_000 * ms - 1);
    assert_eq!(e.core().keys_charged(0), 2);
    e.handle_timeout(1_001 * ms);
    e.check_invariants();
    assert_eq!(e.core().keys_charged(0), 1);
    let now = 1_001 * ms;
    e.accept(2, None, now);
    assert_eq!(
        exchange_at(e, 2, &authenticate(TENANT), now),
        frame(&authenticated("tenant"))
    );
    assert_eq!(
        exchange_at(e, 2, &acquire(0, 30, 8, "t/6"), now),
        granted(8, t + 4)
    );
    assert_eq!(exchange_at(e, 2, &acquire(0, 30, 9, "t/7"), now), busy(9));
    // Another identity's key leaving the table changes nothing.
    assert_eq!(
        exchange_at(e, 1, &release(t + 2, "t/3"), now),
        released(t + 2)
    );
    assert_eq!(e.core().keys_charged(0), 2);
}

#[test]
fn a_key_stays_charged_to_its_maker_across_a_hand_over() {
    let sessions: [(ConnId, &[u8], &str); 2] = [(0, TENANT, "tenant"), (1, EVERYTHING, "root")];
    let mut endpoint = quota_endpoint("max-keys=1", &sessions);
    let e = &mut endpoint;
    let t = FIRST_TOKEN;
    assert_eq!(
        exchange_at(e, 0, &acquire(0, 30, 1, "t/1"), 0),
        granted(1, t)
    );
    // Root queues; the tenant's release hands the key over to it.
    assert_eq!(exchange_at(e, 1, &acquire(5, 30, 2, "t/1"), 0), b"");
    assert_eq!(exchange_at(e, 0, &release(t, "t/1"), 0), released(t));
    assert_eq!(written_at(e, 1, 0), granted(2, t + 1));
    // The key is still in the table: still the tenant's.
    assert_eq!(e.core().keys_charged(0), 1);
    assert_eq!(exchange_at(e, 0, &acquire(0, 30, 3, "t/2"), 0), busy(3));
    assert_eq!(
        exchange_at(e, 1, &release(t + 1, "t/1"), 0),
        released(t + 1)
    );
    assert_eq!(e.core().keys_charged(0), 0);
    assert_eq!(
        exchange_at(e, 0, &acquire(0, 30, 4, "t/2"), 0),
        granted(4, t + 2)
    );
}

#[test]
fn a_grant_quota_answers_b_to_its_identitys_third_and_not_to_another() {
    let sessions: [(ConnId, &[u8], &str); 3] = [
        (0, TENANT, "tenant"),
        (1, EVERYTHING, "root"),
        (2, TENANT, "tenant"),
    ];
    let mut endpoint = quota_endpoint("max-grants=2", &sessions);
    let e = &mut endpoint;
    let t = FIRST_TOKEN;
    assert_eq!(
        exchange_at(e, 1, &acquire(0, 30, 1, "t/held"), 0),
        granted(1, t)
    );
    // One grant and one queued waiter: the tenant's two.
    assert_eq!(
        exchange_at(e, 0, &acquire(0, 30, 2, "t/1"), 0),
        granted(2, t + 1)
    );
    assert_eq!(exchange_at(e, 0, &acquire(9, 30, 3, "t/held"), 0), b"");
    // The third gets `B` at once, on any session of the identity.
    assert_eq!(exchange_at(e, 0, &acquire(9, 30, 4, "t/2"), 0), busy(4));
    assert_eq!(exchange_at(e, 2, &acquire(0, 30, 5, "t/2"), 0), busy(5));
    assert_eq!(e.core().grants_charged(0), 2);
    // Another identity is not affected, within the same prefix too.
    assert_eq!(
        exchange_at(e, 1, &acquire(0, 30, 6, "t/2"), 0),
        granted(6, t + 2)
    );
    assert_eq!(
        exchange_at(e, 1, &acquire(0, 30, 7, "t/3"), 0),
        granted(7, t + 3)
    );
    // The tenant's release makes room again.
    assert_eq!(
        exchange_at(e, 0, &release(t + 1, "t/1"), 0),
        released(t + 1)
    );
    assert_eq!(
        exchange_at(e, 2, &acquire(0, 30, 8, "t/4"), 0),
        granted(8, t + 4)
    );
    assert_eq!(exchange_at(e, 2, &acquire(0, 30, 9, "t/5"), 0), busy(9));
}
