//! Deterministic simulations: seeded generators drive the sans-IO pieces
//! on a fake clock, and every step is checked against a reference model or
//! the spec's rules as a client sees them. One file each:
//!
//! - `core`: many clients against the core (and, for some seeds,
//!   restarts through the state file's arithmetic), against the model;
//! - `timer_wheel`: the wheel on its own, random arms, cancels and polls;
//! - `wire`: peers that speak bytes to the endpoint (split reads,
//!   half-closes, resets, stalls, floods, a graceful shutdown);
//! - `permits`: keys with permits (spec §10) against the permit model.
//!
//! This file holds what they share: the generator (and a connection picked
//! with it), the environment knobs and the loop over seeds that names a
//! failing seed and how to re-run it.
//! A failure names its seed and step. `KUNCI_SIM_SEED=S` re-runs exactly
//! that seed (add `KUNCI_SIM_TRACE=1` to print every step where the
//! simulation traces), `KUNCI_SIM_SEEDS=N` runs seeds `0..N`,
//! `KUNCI_SIM_STEPS=N` sets the steps per seed (the permit simulation
//! reads `KUNCI_PERMIT_SEED`/`KUNCI_PERMIT_SEEDS`).

use std::fmt::Debug;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::time::Instant;

use kunci::core::ConnId;

mod core;
mod permits;
mod timer_wheel;
mod wire;

/// splitmix64: tiny, fast, and the same on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5eed_0fc0_ffee)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    /// A number in `low..=high`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.below(high - low + 1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// A connection whose flag in `open` (one per connection) is `wanted`,
/// picked with `rng`; `None`, and nothing drawn, when there is none.
pub fn pick_conn(rng: &mut Rng, open: &[bool], wanted: bool) -> Option<ConnId> {
    let matching: Vec<ConnId> = (0..open.len() as ConnId)
        .filter(|&c| open[c as usize] == wanted)
        .collect();
    (!matching.is_empty()).then(|| *rng.pick(&matching))
}

pub fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

/// What a simulation's seeds exercised, summed over seeds.
pub trait Tally: Default + Debug {
    fn add(&mut self, other: &Self);
}

/// One simulation as [`run_seeds`] drives it.
pub trait Simulation {
    type Counts: Tally;
    /// Names the simulation in its failures and its summary.
    const NAME: &'static str;

    fn new(seed: u64) -> Self;
    /// Runs `steps` steps; `Err` says which check failed.
    fn run(&mut self, steps: usize) -> Result<(), String>;
    /// Where the run is, for a failure: "step N" and maybe the time.
    fn position(&self) -> String;
    /// What the run exercised.
    fn counts(&self) -> Self::Counts;
    /// How to re-run exactly `seed`.
    fn rerun(seed: u64) -> String;
}

/// Runs one seed; a failure (or a panic) names the seed, where the run
/// was and how to re-run it.
pub fn run_seed<S: Simulation>(seed: u64, steps: usize) -> S::Counts {
    let mut sim = S::new(seed);
    let result = catch_unwind(AssertUnwindSafe(|| sim.run(steps)));
    let rerun = S::rerun(seed);
    match result {
        Ok(Ok(())) => sim.counts(),
        Ok(Err(message)) => panic!(
            "{} seed {seed} failed at {}: {message}\n{rerun}",
            S::NAME,
            sim.position()
        ),
        Err(panic) => {
            eprintln!(
                "{} seed {seed} panicked at {}\n{rerun}",
                S::NAME,
                sim.position()
            );
            resume_unwind(panic)
        }
    }
}

/// Runs the seeds the environment names — `seed_var` alone, or
/// `0..seeds_var` (`default_seeds` when unset) — for `KUNCI_SIM_STEPS`
/// steps each (1,000 when unset), prints what they exercised and returns
/// it with the number of seeds run.
pub fn run_seeds<S: Simulation>(
    seed_var: &str,
    seeds_var: &str,
    default_seeds: u64,
) -> (S::Counts, usize) {
    let steps = env_u64("KUNCI_SIM_STEPS").unwrap_or(1_000) as usize;
    let seeds: Vec<u64> = match env_u64(seed_var) {
        Some(seed) => vec![seed],
        None => (0..env_u64(seeds_var).unwrap_or(default_seeds)).collect(),
    };
    let started = Instant::now();
    let mut counts = S::Counts::default();
    for &seed in &seeds {
        counts.add(&run_seed::<S>(seed, steps));
    }
    eprintln!(
        "{}: {} seeds × {steps} steps in {:.2?}: {counts:?}",
        S::NAME,
        seeds.len(),
        started.elapsed()
    );
    (counts, seeds.len())
}
