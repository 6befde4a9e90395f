//! The `A` path's cost in instructions, for callgrind: 50 connections
//! on one in-process [`Endpoint`], each fed pipelined bursts of 16
//! acquire/release pairs (32 frames, as `kunci bench pairs` C=50 P=32
//! sends them) on its own keys, with no sockets and no clock. Each round
//! is one turn of the event loop (`begin_turn`, as the server calls it per
//! wake-up), so no connection spends its share of work (spec §4). The same
//! source builds against commits before the share (`0df4208`) without the
//! `begin_turn` line (docs/BENCHMARKS.md, "The `A` path in instructions").
//!
//! With `state` as a second argument the endpoint runs as with a state
//! directory (every promise made durable at once, as if the disk took no
//! time) and its tokens are bound to their keys (spec §7.3 v5: one
//! SipHash-1-3 per grant); with `state-unbound`, the same without the
//! binding (the state directory before it).
//!
//!     cargo run --release --no-default-features --example callgrind_pairs -- ROUNDS [state|state-unbound]
use kunci::core::endpoint::Endpoint;
use kunci::core::token_binding::{MAC_BITS, TokenBinding};
use kunci::core::{Core, Limits};

const CONNS: u32 = 50;
const PAIRS_PER_BURST: usize = 16;

fn main() {
    let rounds: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(2000);
    let mode = std::env::args().nth(2).unwrap_or_default();
    let state = mode.starts_with("state");
    let binding = TokenBinding::new(&[7; 16]);
    let mut core = Core::new(Limits::default(), 1 << 16);
    if mode == "state" {
        core.bind_tokens(binding, 1 << 16);
    }
    let bound = core.binds_tokens();
    let mut ep = Endpoint::new(core, Vec::new());
    if state {
        ep.require_durability();
    }
    let mut now = 1_000_000u64;
    for id in 0..CONNS {
        ep.accept(id, None, now);
    }
    let mut counter = 1u64;
    let mut buf = Vec::new();
    let mut requests = 0u64;
    for round in 0..rounds {
        now += 10;
        ep.begin_turn(now);
        for id in 0..CONNS {
            buf.clear();
            for i in 0..PAIRS_PER_BURST {
                let key = format!("bench/{id}/{}", (round as usize * PAIRS_PER_BURST + i) % 64);
                buf.extend_from_slice(&[b'A', 0, 30]);
                buf.extend_from_slice(&(u64::from(id) + 1).to_be_bytes());
                buf.extend_from_slice(key.as_bytes());
                buf.push(b'\n');
                buf.push(b'R');
                let token = if bound {
                    binding.token(key.as_bytes(), counter)
                } else {
                    (1 << MAC_BITS) + counter - 1
                };
                buf.extend_from_slice(&token.to_be_bytes());
                buf.extend_from_slice(key.as_bytes());
                buf.push(b'\n');
                counter += 1;
                requests += 2;
            }
            ep.handle_read(id, &buf, now);
        }
        if let Some(promise) = ep.poll_persist() {
            ep.handle_persisted(promise);
        }
        while let Some(id) = ep.next_transmit() {
            let n = ep.transmit(id).map_or(0, <[u8]>::len);
            // Check the answers once in a while: grants and releases.
            if round == 0 && id == 0 {
                let out = ep.transmit(id).unwrap();
                assert_eq!(out[0], b'A', "{out:?}");
            }
            ep.handle_written(id, n, now);
        }
    }
    let s = ep.core().stats();
    assert_eq!(s.grants + s.released, requests, "every request answered");
    eprintln!("requests {requests} stats {:?}", s);
}
