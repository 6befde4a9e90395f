//! The timer wheel on its own: many timers at random deadlines, random
//! cancels and re-arms, polls at random times, checked against a map of
//! what is armed.

use std::collections::BTreeMap;

use kunci::timer_wheel::{TimerLinks, TimerStore, TimerWheel};

use super::Rng;

struct Timers(Vec<TimerLinks>);

impl TimerStore for Timers {
    fn links(&mut self, id: u32) -> &mut TimerLinks {
        &mut self.0[id as usize]
    }
}

/// Many timers at random deadlines up to 300 s, random cancels and
/// re-arms, polls at random times: every timer fires exactly once, never
/// before its deadline, at the first poll that reaches it, and exactly at
/// its tick when polled at `next_tick()`.
#[test]
fn timer_wheel_stress() {
    const TIMERS: usize = 4_000;
    let seeds = if cfg!(debug_assertions) { 3 } else { 20 };
    for seed in 0..seeds {
        let mut rng = Rng::new(seed);
        let mut timers = Timers(vec![TimerLinks::UNARMED; TIMERS]);
        let mut wheel = TimerWheel::new();
        // id → deadline tick of every armed timer.
        let mut armed: BTreeMap<u32, u64> = BTreeMap::new();
        let mut now = rng.below(1 << 33);
        // Start far from 0 so that tick numbers wrap the 32-bit deadlines.
        while wheel.poll(&mut timers, now).is_some() {}
        let mut fired = 0;
        let mut polls = 0;
        let mut last_poll = now;
        for round in 0..3_000 {
            // Arm, re-arm or cancel a few timers.
            for _ in 0..rng.range(0, 6) {
                let id = rng.below(TIMERS as u64) as u32;
                if rng.chance(25) {
                    wheel.cancel(&mut timers, id);
                    armed.remove(&id);
                } else {
                    let deadline = now
                        + match rng.below(4) {
                            0 => rng.range(0, 70),
                            1 => rng.range(0, 5_000),
                            _ => rng.range(0, 300_000),
                        };
                    wheel.arm(&mut timers, id, deadline);
                    armed.insert(id, deadline);
                }
            }
            assert_eq!(wheel.len(), armed.len(), "seed {seed} round {round}");
            let earliest = armed.values().min().copied();
            let next = wheel.next_tick();
            assert_eq!(
                next.is_some(),
                earliest.is_some(),
                "seed {seed} round {round}"
            );
            if let (Some(next), Some(earliest)) = (next, earliest) {
                assert!(
                    next <= earliest.max(now),
                    "seed {seed}: next tick {next} after the deadline {earliest}"
                );
            }
            // Poll at the next tick (exact), or jump.
            let exact = rng.chance(60);
            let jump = if rng.chance(50) { 100 } else { 50_000 };
            let at = match (exact, next) {
                (true, Some(next)) => next.max(now),
                _ => now + rng.below(jump),
            };
            polls += 1;
            while let Some(id) = wheel.poll(&mut timers, at) {
                let Some(deadline) = armed.remove(&id) else {
                    panic!("seed {seed}: timer {id} fired twice or after its cancel");
                };
                assert!(
                    deadline <= at,
                    "seed {seed}: timer {id} due at {deadline} fired early at {at}"
                );
                // Everything due at the last poll fired then; only a timer
                // armed since, for that very tick, may be due at or before it.
                assert!(
                    deadline >= last_poll,
                    "seed {seed}: timer {id} due at {deadline} fired late at {at} (last poll {last_poll})"
                );
                if exact && next.is_some() {
                    assert_eq!(deadline, at, "seed {seed}: timer {id} not at its tick");
                }
                fired += 1;
            }
            assert!(
                armed.values().all(|&deadline| deadline > at),
                "seed {seed}: a due timer did not fire at {at}"
            );
            last_poll = at;
            now = at;
        }
        // Drain: everything left fires at its own tick.
        while let Some(next) = wheel.next_tick() {
            polls += 1;
            while let Some(id) = wheel.poll(&mut timers, next) {
                let deadline = armed.remove(&id).expect("fired once");
                assert_eq!(deadline, next, "seed {seed}: timer {id} not at its tick");
                fired += 1;
            }
            now = next;
            assert!(polls < 1_000_000, "livelock");
        }
        assert!(armed.is_empty() && wheel.is_empty());
        assert!(fired > 1_000, "seed {seed}: only {fired} fired");
    }
}
