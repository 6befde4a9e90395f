//! The whole server core fed arbitrary byte streams on four connections,
//! interleaved with arbitrary time steps and disconnects, exactly as the
//! event loop would feed it. Nothing a peer sends may panic it, break its
//! invariants (`Core::check_invariants` after every command, which include
//! spec §10's fit rule and that no head waiter that fits is left waiting),
//! or make tokens go backwards. Besides raw bytes, a command may append a
//! well-formed `S` (permits, spec §10), `O` (a watch, spec §13) or `C` (a
//! proclaim, spec §13.4a, of the latest token or one near it) built from a
//! few bytes, on a handful of keys, so that keys with limits, held watches
//! and label changes are reached at once. A first byte with its low bit set
//! starts the core in a crash grace (spec §7.2–7.4) of a run that bound its
//! tokens to their keys, and a command may then append an `E` or `R` of
//! that run's genuine token of a key or of a made-up one next to it (spec
//! §7.3 v5: refused, 16 tries at most, the limits charged).
#![no_main]

use kunci::core::token_binding::TokenBinding;
use kunci::core::{Core, Limits};
use kunci::protocol::{Decoded, Request, Response, decode_request, encode_request};
use libfuzzer_sys::fuzz_target;

const CONNECTIONS: usize = 4;

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_keys: 8,
        max_waiters: 8,
        max_waiters_per_key: 4,
        max_waits_per_conn: 3,
        max_grants: 12,
        max_connections: CONNECTIONS,
        max_watches: 8,
        max_watches_per_conn: 4,
    };
    let binding = TokenBinding::new(&[7; 16]);
    let first = 1 << 40;
    let mut core = Core::new(limits, first);
    let mut bytes = data.iter().copied();
    let setup = bytes.next().unwrap_or(0);
    if setup & 1 != 0 {
        core.bind_tokens(binding, first);
        core.set_adoptable_until(first - 1);
        core.set_grace_until(u64::from(setup >> 2) * 100_000 + 1);
        core.set_grace_counted(setup & 2 != 0);
    }
    let mut buffers: [Vec<u8>; CONNECTIONS] = Default::default();
    let mut open = [false; CONNECTIONS];
    let mut now: u64 = 0;
    let mut last_token: u64 = 0;
    while let Some(command) = bytes.next() {
        let conn = usize::from(command & 3);
        match command >> 6 {
            0 => {
                if !open[conn] {
                    core.connect(conn as u32);
                    open[conn] = true;
                }
                let len = bytes.next().unwrap_or(0);
                if command & 4 != 0 {
                    // A well-formed `O`, `S` or `A` (limit 0, take 0) from 4 bytes.
                    let mut field = || bytes.next().unwrap_or(0);
                    let (shape, wait_s, lease_s, owner) = (len, field(), field(), field());
                    let key = ["a", "b", "c"][usize::from(shape / 20 % 3)];
                    if command & 8 != 0 && shape & 128 != 0 {
                        // A well-formed `C`: the latest grant's token, or
                        // one next to it, with one of three labels.
                        let token = last_token.wrapping_add(u64::from(owner % 3)).wrapping_sub(1);
                        let request = Request::Proclaim {
                            token,
                            key,
                            label: ["", "x", "leader"][usize::from(wait_s % 3)],
                        };
                        encode_request(&request, &mut buffers[conn]);
                    } else if command & 8 != 0 && shape & 64 != 0 {
                        // An `E` or `R` of the crashed run's token of the
                        // key, or of one next to it (never that key's).
                        let genuine = binding.token(key.as_bytes(), u64::from(owner % 8) + 1);
                        let token = genuine ^ u64::from(wait_s & 1);
                        let request = if lease_s & 1 == 0 {
                            Request::Extend {
                                lease_s: lease_s % 4 + 1,
                                token,
                                key,
                            }
                        } else {
                            Request::Release { token, key }
                        };
                        encode_request(&request, &mut buffers[conn]);
                    } else if command & 8 != 0 {
                        // A well-formed `O` (spec §13): `since` the latest
                        // grant's token or 0, so that watches are held.
                        let since = if owner & 1 == 0 { 0 } else { last_token };
                        let request = Request::Observe {
                            wait_s: wait_s % 4,
                            id: u64::from(owner),
                            since,
                            key,
                        };
                        encode_request(&request, &mut buffers[conn]);
                    } else {
                        let limit = [0, 1, 2, 3, 65535][usize::from(shape % 5)];
                        let take = match limit {
                            0 => 0,
                            _ => u16::from(shape / 5 % 4).min(limit),
                        };
                        let request = Request::Acquire {
                            wait_s: wait_s % 4,
                            lease_s: lease_s % 4 + 1,
                            owner: u64::from(owner),
                            key,
                            limit,
                            take,
                            label: if owner & 1 == 0 { "" } else { "label" },
                        };
                        encode_request(&request, &mut buffers[conn]);
                    }
                } else {
                    buffers[conn].extend(bytes.by_ref().take(usize::from(len)));
                }
                let mut consumed = 0;
                loop {
                    match decode_request(&buffers[conn][consumed..]) {
                        Decoded::Incomplete => break,
                        Decoded::Request { request, len } => {
                            core.handle_request(conn as u32, &request, now);
                            consumed += len;
                        }
                        Decoded::Invalid { error, len } => {
                            core.handle_invalid(conn as u32, error);
                            consumed += len;
                        }
                        Decoded::Fatal(error) => {
                            core.handle_invalid(conn as u32, error);
                            core.disconnect(conn as u32, now);
                            open[conn] = false;
                            consumed = buffers[conn].len();
                            break;
                        }
                    }
                }
                buffers[conn].drain(..consumed);
            }
            1 => {
                let step = u64::from(bytes.next().unwrap_or(0));
                now += step * step * 100;
                core.handle_timeout(now);
            }
            2 => {
                core.disconnect(conn as u32, now);
                open[conn] = false;
                buffers[conn].clear();
            }
            _ => {
                if let Some(at) = core.poll_timeout() {
                    assert!(at + 1_000 >= now, "timer {at} left behind at {now}");
                    now = now.max(at);
                }
                core.handle_timeout(now);
            }
        }
        core.check_invariants();
        for (to, response) in core.drain_outbox() {
            assert!((to as usize) < CONNECTIONS);
            if let Response::Acquired { token, .. } = response {
                assert!(token > last_token, "token {token} after {last_token}");
                last_token = token;
            }
        }
    }
    core.shut_down(now);
    let answered: Vec<_> = core.drain_outbox().collect();
    assert!(answered.iter().all(|(to, _)| open[*to as usize]));
    assert_eq!(core.waiter_count(), 0);
    assert_eq!(core.watch_count(), 0);
});
