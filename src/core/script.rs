//! Drives an [`Endpoint`] with a script decoded from arbitrary bytes, the
//! way the shell would: accepts, reads of any length, end-of-file, resets,
//! partial writes, time steps, a shutdown. The `endpoint_streams` fuzz
//! target and a seeded test share it, so the fuzzer's logic also runs on a
//! stable toolchain.
//!
//! Checked after every command: the endpoint's and core's invariants; that
//! everything written to a peer decodes as response frames (however the
//! writes were split); that tokens strictly increase on each connection;
//! that nothing is queued for a connection once it stopped being live;
//! that a `V` shows only a token that was granted (the core's invariants
//! check that every held watch waits on its key's current token);
//! that the shell is never told to act on a socket it does not have.
//!
//! When the first byte is odd the server runs with `--auth` (spec §12):
//! sessions may send `U` with a secret that locks key `a` only, one that
//! reads every key and sees `I`, a wrong one or a short one. Then also:
//! nothing is granted to a session that has not authenticated, and
//! nothing follows an `X 12`.

use super::access::{AccessList, hash_hex};
use super::connection::READ_CHUNK;
use super::endpoint::{Action, Endpoint};
use super::{ConnId, Core, Limits, Micros};
use crate::addr::Network;
use crate::protocol::{self, Response};

const CONNECTIONS: usize = 4;

#[derive(Default)]
struct Socket {
    open: bool,
    /// Written by the server, not yet decoded.
    received: Vec<u8>,
    /// Bytes the endpoint may still send since the connection stopped
    /// being live; `None` while live.
    allowance: Option<usize>,
    /// The last token granted on this connection. Grants go out in token
    /// order on each connection; across connections the order in which
    /// peers read them says nothing.
    last_token: u64,
    /// An `U` was answered with a name.
    authenticated: bool,
    /// An `X 12` came: nothing may follow it.
    denied: bool,
}

/// The secrets a session may send with `--auth`: one for each line of
/// [`access_list`], an unknown one and a short one.
const SECRETS: [&[u8]; 4] = [
    b"locks-key-a-only-0123456789abcdef",
    b"reads-every-key-0123456789abcdef",
    b"not-in-the-file-0123456789abcdef",
    b"short",
];

fn access_list() -> AccessList {
    let text = format!(
        "locker {} lock:a max-keys=2 max-grants=3\nreader {} read:* info\n",
        hash_hex(SECRETS[0]),
        hash_hex(SECRETS[1])
    );
    AccessList::parse(&text).expect("a valid file")
}

/// Runs the script in `data`. Panics on any broken rule.
pub fn run(data: &[u8]) {
    let limits = Limits {
        max_keys: 8,
        max_waiters: 8,
        max_waiters_per_key: 4,
        max_waits_per_conn: 3,
        max_grants: 16,
        max_connections: 3,
        max_watches: 6,
        max_watches_per_conn: 3,
    };
    let allow: Vec<Network> = vec!["10.0.0.0/8".parse().expect("a network")];
    let mut endpoint = Endpoint::new(Core::new(limits, 1), allow);
    let authenticates = data.first().is_some_and(|first| first & 1 == 1);
    if authenticates {
        endpoint.require_authentication(access_list());
    }
    let mut sockets: [Socket; CONNECTIONS] = Default::default();
    let mut now: Micros = 0;
    let mut bytes = data.iter().copied();
    let mut chunk = Vec::with_capacity(READ_CHUNK);
    while let Some(command) = bytes.next() {
        let index = usize::from(command & 3);
        let id = index as ConnId;
        match command >> 5 {
            0 => {
                if !sockets[index].open && !endpoint.is_shutting_down() {
                    let ip = match command >> 2 & 7 {
                        0 => None,
                        1 => Some("192.0.2.1".parse().expect("an address")),
                        _ => Some("10.0.0.1".parse().expect("an address")),
                    };
                    sockets[index] = Socket {
                        open: true,
                        ..Socket::default()
                    };
                    endpoint.accept(id, ip, now);
                }
            }
            1 | 2 => {
                let len = usize::from(bytes.next().unwrap_or(0));
                chunk.clear();
                if command & 8 != 0 {
                    let secret = SECRETS[len % SECRETS.len()];
                    let request = protocol::Request::Authenticate { secret };
                    protocol::encode_request(&request, &mut chunk);
                } else if command & 4 != 0 {
                    // One well-formed acquire (`S` with permits, spec §10, or
                    // `A`) from 4 bytes, on a handful of keys.
                    permits_request(len as u8, &mut bytes, &mut chunk);
                } else {
                    chunk.extend(bytes.by_ref().take(len));
                }
                // Repeated, a few bytes become a flood that meets
                // backpressure.
                if command >> 5 == 2 {
                    let copies = chunk.len().max(1);
                    let pattern = chunk.clone();
                    for _ in 0..(4096 / copies) {
                        chunk.extend_from_slice(&pattern);
                    }
                }
                if sockets[index].open && endpoint.wants_read(id) {
                    endpoint.handle_read(id, &chunk, now);
                }
            }
            3 => {
                if sockets[index].open && endpoint.wants_read(id) {
                    endpoint.handle_eof(id, now);
                }
            }
            4 => {
                if sockets[index].open {
                    endpoint.handle_broken(id, now);
                }
            }
            5 => {
                let most = usize::from(bytes.next().unwrap_or(0)) * 64 + 1;
                if let Some(out) = endpoint.transmit(id) {
                    let n = out.len().min(most);
                    let socket = &mut sockets[index];
                    socket.received.extend_from_slice(&out[..n]);
                    if let Some(allowance) = socket.allowance.as_mut() {
                        *allowance = allowance.saturating_sub(n);
                    }
                    endpoint.handle_written(id, n, now);
                }
            }
            6 => {
                let step = u64::from(bytes.next().unwrap_or(0));
                now += step * step * 200;
                // A wake-up: a new turn of the loop (spec §4, fairness).
                endpoint.begin_turn(now);
                endpoint.handle_timeout(now);
            }
            _ => {
                if command & 16 != 0 {
                    endpoint.shut_down(now);
                }
                if let Some(at) = endpoint.poll_timeout() {
                    now = now.max(at);
                }
                endpoint.begin_turn(now);
                endpoint.handle_timeout(now);
            }
        }
        while let Some((id, action)) = endpoint.poll_action() {
            let socket = &mut sockets[id as usize];
            assert!(socket.open, "{action:?} for a socket that is closed");
            if action == Action::Close {
                socket.open = false;
            }
        }
        endpoint.check_invariants();
        for (index, socket) in sockets.iter_mut().enumerate() {
            let mut at = 0;
            while let Some((response, len)) = protocol::decode_response(&socket.received[at..])
                .expect("the server writes only whole, valid frames")
            {
                at += len;
                assert!(!socket.denied, "{response:?} after X 12");
                match response {
                    Response::Acquired { token, .. } => {
                        let last = socket.last_token;
                        assert!(token > last, "token {token} after {last}");
                        socket.last_token = token;
                        assert!(
                            !authenticates || socket.authenticated,
                            "a grant to a session that did not authenticate"
                        );
                    }
                    Response::Authenticated { .. } => socket.authenticated = true,
                    Response::KeyState { token, .. } => assert!(
                        token < endpoint.core().next_token(),
                        "V shows token {token}, never granted"
                    ),
                    Response::Error { code: 12, .. } => socket.denied = true,
                    _ => {}
                }
            }
            socket.received.drain(..at);
            if !socket.open {
                continue;
            }
            let conn = endpoint
                .connection(index as ConnId)
                .expect("an open socket has a connection");
            match (conn.phase().is_live(), socket.allowance) {
                (true, _) => {}
                (false, None) => socket.allowance = Some(conn.output_len()),
                (false, Some(allowance)) => assert!(
                    conn.output_len() <= allowance,
                    "output queued after the connection stopped being live"
                ),
            }
        }
    }
}

/// Appends to `out` an acquire built from `shape` and 3 more bytes: `A`
/// or `S` with limits 1, 2, 3 or 65535 and any take, on keys `a`–`c`; or,
/// for `shape` 240 and up, an `O` (spec §13) on one of those keys, `since`
/// a small token (the core's first is 1), so that many are held.
fn permits_request(shape: u8, bytes: &mut impl Iterator<Item = u8>, out: &mut Vec<u8>) {
    let mut field = || bytes.next().unwrap_or(0);
    let (wait_s, lease_s, owner) = (field(), field(), field());
    if shape >= 240 {
        let request = protocol::Request::Observe {
            wait_s: wait_s % 4,
            id: u64::from(owner),
            since: u64::from(lease_s % 6),
            key: ["a", "b", "c"][usize::from(shape % 3)],
        };
        return protocol::encode_request(&request, out);
    }
    let limit = [0, 1, 2, 3, 65535][usize::from(shape % 5)];
    let take = match limit {
        0 => 0,
        _ => u16::from(shape / 5 % 4).min(limit),
    };
    let request = protocol::Request::Acquire {
        wait_s: wait_s % 4,
        lease_s: lease_s % 4 + 1,
        owner: u64::from(owner),
        key: ["a", "b", "c"][usize::from(shape / 20 % 3)],
        limit,
        take,
        label: if owner & 1 == 0 { "" } else { "label" },
    };
    protocol::encode_request(&request, out);
}
