//! The `pairs` and `contended` workloads through the [`Client`] instead of
//! the connection fleet, for services the fleet cannot speak to (an etcd
//! cluster, `etcd://`): one thread per "connection", each a closed loop of
//! acquire → hold → release with one request in flight. The counters and
//! latency series are those of the fleet's `Cycles`, so the reports
//! compare; the pipeline is always 1 (each call blocks its thread).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::stats::{Kind, Stats};
use super::{Plan, Run};
use crate::client::{Client, Config, Error};

/// Runs `run` (pairs or contended) through a client; `Err` if the client
/// cannot start.
pub(super) fn execute(run: &Run, stop: &Arc<AtomicBool>) -> Result<Stats, String> {
    let config = Config {
        #[cfg(feature = "tls")]
        tls: super::super::client::tls_files(&run.tls),
        ..Config::default()
    };
    let client = Client::new([run.server.clone()], config)
        .map_err(|e| format!("cannot start the client: {e}"))?;
    let start = Instant::now();
    let stats = Arc::new(Mutex::new(Stats::new(start)));
    for counter in ["grants", "pairs", "misses"] {
        stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set(counter, 0);
    }
    let measure_from = start + run.warmup;
    let until = run.duration.map(|d| measure_from + d);
    let done = Arc::new(AtomicBool::new(false));
    let loops: Vec<_> = (0..run.plan.connections)
        .map(|index| {
            let (client, stats, done) = (client.clone(), stats.clone(), done.clone());
            let (plan, prefix) = (run.plan.clone(), run.key_prefix.clone());
            std::thread::spawn(move || cycle(index, &client, &plan, &prefix, &stats, &done))
        })
        .collect();
    loop {
        let now = Instant::now();
        {
            let mut stats = stats.lock().unwrap_or_else(PoisonError::into_inner);
            if !stats.measuring() && now >= measure_from {
                stats.begin(now);
            }
        }
        if stop.load(Ordering::Relaxed) || until.is_some_and(|u| now >= u) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    stats
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .end(Instant::now());
    done.store(true, Ordering::Relaxed);
    let grants: Vec<u64> = loops.into_iter().map(|l| l.join().unwrap_or(0)).collect();
    let mut stats = Arc::try_unwrap(stats)
        .map_err(|_| "a bench loop is still running".to_owned())?
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    stats.set(
        "grants_per_conn_min",
        grants.iter().copied().min().unwrap_or(0),
    );
    stats.set(
        "grants_per_conn_max",
        grants.iter().copied().max().unwrap_or(0),
    );
    Ok(stats)
}

/// One loop until `done`; returns its grants inside the measured window.
fn cycle(
    index: usize,
    client: &Client,
    plan: &Plan,
    prefix: &str,
    stats: &Mutex<Stats>,
    done: &AtomicBool,
) -> u64 {
    let lock = || stats.lock().unwrap_or_else(PoisonError::into_inner);
    let wait = Duration::from_secs(plan.wait_s.into());
    let lease = Duration::from_secs(plan.lease_s.into());
    // A small xorshift per loop, seeded by a splitmix64 step of the run's
    // seed and the loop's index, so that no two loops share a sequence.
    let mut state = {
        let mut z = plan
            .seed
            .wrapping_add((index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) | 1
    };
    let mut grants = 0;
    while !done.load(Ordering::Relaxed) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let key = format!("{prefix}{:012}", state % plan.keys);
        let sent = Instant::now();
        let outcome = client.acquire(&key, wait, lease);
        let latency = sent.elapsed();
        let ticket = match outcome {
            Ok(ticket) => ticket,
            Err(error) => {
                let mut stats = lock();
                match error {
                    Error::Timeout => {
                        stats.reply(b'T', Some(Kind::Acquire), latency);
                        stats.count("misses", 1);
                    }
                    Error::Busy => stats.reply(b'B', Some(Kind::Acquire), latency),
                    error => stats.error(format!("acquire {key}: {error}")),
                }
                continue;
            }
        };
        {
            let mut stats = lock();
            stats.reply(b'A', Some(Kind::Acquire), latency);
            stats.count("grants", 1);
            if stats.measuring() {
                grants += 1;
            }
        }
        if !plan.hold.is_zero() {
            std::thread::sleep(plan.hold);
        }
        let sent = Instant::now();
        let released = ticket.release();
        let latency = sent.elapsed();
        let mut stats = lock();
        match released {
            Ok(()) => {
                stats.reply(b'R', Some(Kind::Release), latency);
                stats.count("pairs", 1);
            }
            Err(Error::NotHeld) => {
                stats.reply(b'N', Some(Kind::Release), latency);
                stats.error(format!("key {key} lost its lease before the release"));
            }
            Err(error) => stats.error(format!("release {key}: {error}")),
        }
    }
    grants
}
