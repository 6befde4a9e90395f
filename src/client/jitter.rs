//! Retry pauses with jitter (spec §13.6, v5): each pause of a retry loop
//! (the 0.1 → 2 s backoff of `--wait inf`, of `observe`, of rule 11's
//! clean-up) is drawn uniformly from ±25 % of its nominal length, so that
//! the many clients of a server that restarts do not all come back in the
//! same millisecond.

use std::cell::Cell;
use std::time::Duration;

/// The jitter of a retry pause, as a fraction of it: ±25 %.
pub(crate) const JITTER: f64 = 0.25;

thread_local! {
    /// This thread's xorshift state, seeded once from the standard
    /// library's per-process hash keys (no dependency for so little).
    static STATE: Cell<u64> = Cell::new(super::random_u64() | 1);
}

/// One 64-bit draw of this thread's xorshift64* generator.
fn next_u64() -> u64 {
    STATE
        .try_with(|state| {
            let mut x = state.get();
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            state.set(x);
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        })
        // Only while the thread is being torn down: any draw will do.
        .unwrap_or_else(|_| super::random_u64())
}

/// `pause` scaled by a factor in `[1 − JITTER, 1 + JITTER]` taken from
/// `draw` (its top 53 bits, uniformly).
fn scaled(pause: Duration, draw: u64) -> Duration {
    let unit = (draw >> 11) as f64 / (1u64 << 53) as f64;
    pause.mul_f64(1.0 - JITTER + 2.0 * JITTER * unit)
}

/// `pause` ± 25 %, uniformly.
pub(crate) fn jittered(pause: Duration) -> Duration {
    scaled(pause, next_u64())
}

/// Sleeps for `pause` ± 25 %.
pub(crate) fn sleep(pause: Duration) {
    std::thread::sleep(jittered(pause));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jittered_pause_stays_within_a_quarter_of_its_length_and_spreads_over_it() {
        let pause = Duration::from_millis(100);
        let (low, high) = (Duration::from_millis(75), Duration::from_millis(125));
        assert_eq!(scaled(pause, 0), low);
        assert!(scaled(pause, u64::MAX) <= high);
        assert!(scaled(pause, u64::MAX) > Duration::from_micros(124_999));
        let draws: Vec<Duration> = (0..10_000).map(|_| jittered(pause)).collect();
        assert!(
            draws.iter().all(|d| (low..=high).contains(d)),
            "out of bounds"
        );
        // Spread: each fifth of the range is hit, and no two clients of
        // one restart pick the same pause as a rule.
        for fifth in 0..5u32 {
            let from = low + Duration::from_millis(10) * fifth;
            let to = from + Duration::from_millis(10);
            let hits = draws.iter().filter(|d| (from..to).contains(d)).count();
            assert!((1_500..2_500).contains(&hits), "fifth {fifth}: {hits}");
        }
        let mut distinct = draws.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 9_000, "{}", distinct.len());
        // The cap of 2 s stays within 1.5..=2.5 s.
        let capped = jittered(Duration::from_secs(2));
        assert!((Duration::from_millis(1500)..=Duration::from_millis(2500)).contains(&capped));
    }
}
