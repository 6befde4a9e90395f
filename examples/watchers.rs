//! One key with N watchers (spec §13): the memory each held `O` costs in
//! the core (counted by the allocator), and how long the release that
//! changes the key's token takes to answer all of them (the core's work:
//! finding the watches, building N `V` answers), then how long encoding
//! those answers takes (the shell's work). docs/BENCHMARKS.md.
//!
//!     cargo run --release --no-default-features --example watchers -- N
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kunci::core::{Core, Limits};
use kunci::protocol::{self, Request, Response};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator and only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: a block this allocator gave out, with its layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn main() {
    let watchers: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(10_000);
    let rounds = 21;
    let mut wakes = Vec::new();
    let mut encodes = Vec::new();
    let mut per_watch = 0.0;
    for round in 0..rounds {
        let limits = Limits {
            max_waiters: watchers + 1,
            max_waits_per_conn: watchers as u32 + 1,
            ..Limits::default()
        };
        let mut core = Core::new(limits, 1);
        core.connect(0);
        core.connect(1);
        let now = 1_000_000;
        let acquire = Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: 1,
            key: "leader",
            limit: 0,
            take: 0,
            label: "host-a.example:5432",
        };
        core.handle_request(0, &acquire, now);
        let token = match core.drain_outbox().next() {
            Some((_, Response::Acquired { token, .. })) => token,
            other => panic!("{other:?}"),
        };
        let before = LIVE.load(Ordering::Relaxed);
        for id in 0..watchers as u64 {
            let observe = Request::Observe {
                wait_s: 255,
                id,
                since: token,
                key: "leader",
            };
            core.handle_request(1, &observe, now);
        }
        assert_eq!(core.watch_count(), watchers);
        per_watch = (LIVE.load(Ordering::Relaxed) - before) as f64 / watchers as f64;
        let release = Request::Release {
            token,
            key: "leader",
        };
        let started = Instant::now();
        core.handle_request(0, &release, now + 1_000);
        let woke = started.elapsed();
        let answers: Vec<_> = core.drain_outbox().collect();
        assert_eq!(answers.len(), watchers + 1);
        assert_eq!(core.watch_count(), 0);
        let started = Instant::now();
        let mut out = Vec::with_capacity(answers.len() * 32);
        for (_, answer) in &answers {
            protocol::encode_response(answer, &mut out);
        }
        let encoded = started.elapsed();
        std::hint::black_box(&out);
        if round > 0 {
            wakes.push(woke);
            encodes.push(encoded);
        }
    }
    let median = |times: &mut Vec<Duration>| {
        times.sort();
        times[times.len() / 2]
    };
    println!(
        "{watchers} watchers: {per_watch:.1} B per watch; release that wakes them all: {:?} \
         (median of {}), encoding the {watchers} V frames: {:?}",
        median(&mut wakes),
        rounds - 1,
        median(&mut encodes)
    );
}
