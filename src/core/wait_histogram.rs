//! The distribution of how long queued acquires waited, from joining a
//! key's queue to their grant or their timeout: fixed buckets, so that
//! recording one is a few compares and adds, with nothing allocated.

/// Upper bounds of the buckets, in microseconds, ascending. From one
/// millisecond (the timer tick) to the longest wait the protocol allows
/// (255 s); a wait that runs past its deadline by the tick lands in +Inf.
pub const BUCKET_BOUNDS_MICROS: [u64; 16] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    255_000_000,
];

/// The same bounds as Prometheus writes them (`le` label values).
pub const BUCKET_BOUNDS_TEXT: [&str; 16] = [
    "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5",
    "10", "30", "60", "255",
];

/// Counts per bucket (not cumulative), the number of waits and their sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WaitHistogram {
    /// `buckets[i]` counts waits in (bound[i-1], bound[i]]; the last one
    /// counts those above every bound.
    pub buckets: [u64; BUCKET_BOUNDS_MICROS.len() + 1],
    pub count: u64,
    pub sum_micros: u64,
}

impl WaitHistogram {
    /// Records one wait of `micros` microseconds.
    pub fn observe(&mut self, micros: u64) {
        let bucket = BUCKET_BOUNDS_MICROS.partition_point(|&bound| bound < micros);
        self.buckets[bucket] += 1;
        self.count += 1;
        self.sum_micros = self.sum_micros.saturating_add(micros);
    }

    /// The cumulative counts Prometheus exposes: waits at or below each
    /// bound, then the total for `+Inf`.
    pub fn cumulative(&self) -> [u64; BUCKET_BOUNDS_MICROS.len() + 1] {
        let mut cumulative = self.buckets;
        let mut running = 0;
        for count in &mut cumulative {
            running += *count;
            *count = running;
        }
        cumulative
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_text_matches_micros() {
        let mut histogram = WaitHistogram::default();
        histogram.observe(0);
        histogram.observe(1_000);
        histogram.observe(1_001);
        histogram.observe(255_000_000);
        histogram.observe(255_000_001);
        assert_eq!(histogram.buckets[0], 2);
        assert_eq!(histogram.buckets[1], 1);
        assert_eq!(histogram.buckets[15], 1);
        assert_eq!(histogram.buckets[16], 1);
        assert_eq!(histogram.count, 5);
        assert_eq!(histogram.sum_micros, 510_002_002);
        let cumulative = histogram.cumulative();
        assert_eq!(cumulative[0], 2);
        assert_eq!(cumulative[14], 3);
        assert_eq!(cumulative[16], 5);
        for (micros, text) in BUCKET_BOUNDS_MICROS.iter().zip(BUCKET_BOUNDS_TEXT) {
            let seconds: f64 = text.parse().expect("a number");
            assert_eq!((seconds * 1e6).round() as u64, *micros, "{text}");
        }
    }
}
