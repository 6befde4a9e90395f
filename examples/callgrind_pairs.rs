//! The `A` path's cost in instructions, for callgrind: 50 connections
//! on one in-process [`Endpoint`], each fed pipelined bursts of 16
//! acquire/release pairs (32 frames, as `kunci bench pairs` C=50 P=32
//! sends them) on its own keys, with no sockets and no clock. Each round
//! is one turn of the event loop (`begin_turn`, as the server calls it per
//! wake-up), so no connection spends its share of work (spec §4). The same
//! source builds against commits before the share (`0df4208`) without the
//! `begin_turn` line (docs/BENCHMARKS.md, "The `A` path in instructions").
//!
//!     cargo run --release --no-default-features --example callgrind_pairs -- ROUNDS
use kunci::core::endpoint::Endpoint;
use kunci::core::{Core, Limits};

const CONNS: u32 = 50;
const PAIRS_PER_BURST: usize = 16;

fn main() {
    let rounds: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(2000);
    let core = Core::new(Limits::default(), 1);
    let mut ep = Endpoint::new(core, Vec::new());
    let mut now = 1_000_000u64;
    for id in 0..CONNS {
        ep.accept(id, None, now);
    }
    let mut token = 1u64;
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
                buf.extend_from_slice(&token.to_be_bytes());
                buf.extend_from_slice(key.as_bytes());
                buf.push(b'\n');
                token += 1;
                requests += 2;
            }
            ep.handle_read(id, &buf, now);
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
