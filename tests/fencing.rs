//! Fenced-counter stress against the real server through the official
//! client: many threads, few keys, short leases, and holders that pause
//! for longer than their lease in the middle of a read-modify-write.
//!
//! The resource is a counter per key that is read and written in two
//! separate steps, like a file or a row. With fencing, a read or write is
//! refused when its token is lower than the highest the counter has seen;
//! then no accepted update is ever lost. The control run turns the check
//! off and must lose updates — proof that the pauses really make two
//! holders overlap.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kunci::addr::Address;
use kunci::client::{Client, Config, Error};

use crate::util::TestServer;

const THREADS: usize = 16;
const KEYS: usize = 3;
const SECTIONS_PER_THREAD: usize = 40;
/// Every thread pauses in these sections, for longer than the lease.
const PAUSED_SECTIONS: [usize; 2] = [5, 25];
const LEASE: Duration = Duration::from_secs(1);
const PAUSE: Duration = Duration::from_millis(1_400);

#[derive(Default)]
struct Counter {
    value: u64,
    highest_token: u64,
    /// Tokens of the accepted writes, in the order they were accepted.
    accepted_tokens: Vec<u64>,
    rejected: u64,
}

#[derive(Default, Debug)]
struct Outcomes {
    sections: u64,
    timeouts: u64,
    busy: u64,
    unavailable: u64,
    indeterminate: u64,
    other: u64,
}

struct Run {
    counters: Vec<Counter>,
    outcomes: Outcomes,
    attempts: u64,
    elapsed: Duration,
}

fn stress(fenced: bool) -> Run {
    let server = TestServer::start(&[]);
    let address: Address = server.addr.parse().unwrap();
    let client = Client::new([address], Config::default()).unwrap();
    let counters: Arc<Vec<Mutex<Counter>>> =
        Arc::new((0..KEYS).map(|_| Mutex::default()).collect());
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let started = Instant::now();
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let client = client.clone();
            let counters = Arc::clone(&counters);
            let outcomes = Arc::clone(&outcomes);
            std::thread::spawn(move || {
                let mut mine = Outcomes::default();
                for section in 0..SECTIONS_PER_THREAD {
                    let key_index = (thread + section) % KEYS;
                    let key = format!("fenced-{key_index}");
                    let ticket = match client.acquire(&key, Duration::from_secs(10), LEASE) {
                        Ok(ticket) => ticket,
                        Err(Error::Timeout) => {
                            mine.timeouts += 1;
                            continue;
                        }
                        Err(Error::Busy) => {
                            mine.busy += 1;
                            continue;
                        }
                        Err(Error::Unavailable(_)) => {
                            mine.unavailable += 1;
                            continue;
                        }
                        Err(Error::Indeterminate) => {
                            mine.indeterminate += 1;
                            continue;
                        }
                        Err(_) => {
                            mine.other += 1;
                            continue;
                        }
                    };
                    mine.sections += 1;
                    let token = ticket.token();
                    let counter = &counters[key_index];
                    // The read presents the token too: a counter that only
                    // checked writes would let a paused holder's write land
                    // between the next holder's read and write.
                    let read = {
                        let mut counter = counter.lock().unwrap();
                        if fenced && token < counter.highest_token {
                            counter.rejected += 1;
                            None
                        } else {
                            counter.highest_token = counter.highest_token.max(token);
                            Some(counter.value)
                        }
                    };
                    let Some(read) = read else {
                        let _ = ticket.release();
                        continue;
                    };
                    if PAUSED_SECTIONS.contains(&section) {
                        std::thread::sleep(PAUSE);
                    } else {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    {
                        let mut counter = counter.lock().unwrap();
                        if fenced && token < counter.highest_token {
                            counter.rejected += 1;
                        } else {
                            counter.highest_token = counter.highest_token.max(token);
                            counter.value = read + 1;
                            counter.accepted_tokens.push(token);
                        }
                    }
                    // The lease may be gone (the pause): NotHeld is expected.
                    let _ = ticket.release();
                }
                let mut all = outcomes.lock().unwrap();
                all.sections += mine.sections;
                all.timeouts += mine.timeouts;
                all.busy += mine.busy;
                all.unavailable += mine.unavailable;
                all.indeterminate += mine.indeterminate;
                all.other += mine.other;
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let elapsed = started.elapsed();
    let counters = Arc::try_unwrap(counters)
        .ok()
        .unwrap()
        .into_iter()
        .map(|c| c.into_inner().unwrap())
        .collect();
    let outcomes = Arc::try_unwrap(outcomes).unwrap().into_inner().unwrap();
    Run {
        counters,
        outcomes,
        attempts: (THREADS * SECTIONS_PER_THREAD) as u64,
        elapsed,
    }
}

fn accounted(run: &Run) -> u64 {
    let o = &run.outcomes;
    o.sections + o.timeouts + o.busy + o.unavailable + o.indeterminate + o.other
}

#[test]
fn fencing_tokens_keep_every_accepted_update_despite_paused_holders() {
    let run = stress(true);
    assert_eq!(accounted(&run), run.attempts, "{:?}", run.outcomes);
    assert_eq!(run.outcomes.other, 0, "{:?}", run.outcomes);
    let mut accepted = 0;
    let mut rejected = 0;
    for (key, counter) in run.counters.iter().enumerate() {
        assert_eq!(
            counter.value,
            counter.accepted_tokens.len() as u64,
            "key {key}: an accepted update was lost"
        );
        assert!(
            counter.accepted_tokens.windows(2).all(|w| w[0] < w[1]),
            "key {key}: accepted tokens not strictly increasing: {:?}",
            counter.accepted_tokens
        );
        accepted += counter.value;
        rejected += counter.rejected;
    }
    assert_eq!(accepted + rejected, run.outcomes.sections);
    // Every pause outlived its lease, and someone else took the key.
    assert!(
        rejected >= (THREADS * PAUSED_SECTIONS.len()) as u64 / 2,
        "only {rejected} stale accesses"
    );
    eprintln!(
        "fenced: {} sections in {:?}, {accepted} accepted, {rejected} stale accesses refused, {:?}",
        run.outcomes.sections, run.elapsed, run.outcomes
    );
}

#[test]
fn without_the_token_check_the_same_run_loses_updates() {
    let run = stress(false);
    assert_eq!(accounted(&run), run.attempts, "{:?}", run.outcomes);
    let accepted: u64 = run
        .counters
        .iter()
        .map(|c| c.accepted_tokens.len() as u64)
        .sum();
    let value: u64 = run.counters.iter().map(|c| c.value).sum();
    assert_eq!(accepted, run.outcomes.sections);
    assert!(
        value < accepted,
        "no update lost: the pauses did not overlap holders"
    );
    eprintln!(
        "unfenced: {accepted} writes accepted, counters show {value}: {} lost",
        accepted - value
    );
}
