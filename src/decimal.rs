//! Decimal text of exact ratios (durations, rates) with a fixed number of
//! decimals, in integer arithmetic: the same text `format!("{:.N}", f64)`
//! prints for them, without the float formatting code (~20 KB of the
//! binary; issue 28, docs/BENCHMARKS.md "Binary size").

use std::time::Duration;

/// `numerator / denominator` with `decimals` decimals, rounded to the
/// nearest (ties to even, as `{:.N}` rounds). A zero denominator counts
/// as 1.
pub(crate) fn fixed(numerator: u128, denominator: u128, decimals: u32) -> String {
    let denominator = denominator.max(1);
    let scale = 10u128.pow(decimals);
    let scaled = numerator.saturating_mul(scale);
    let mut units = scaled / denominator;
    let rest = scaled % denominator;
    // `rest < denominator`, so twice it fits: both are below 2^127 here.
    let twice = rest.saturating_mul(2);
    if twice > denominator || (twice == denominator && units % 2 == 1) {
        units += 1;
    }
    if decimals == 0 {
        return units.to_string();
    }
    format!(
        "{}.{:0width$}",
        units / scale,
        units % scale,
        width = decimals as usize
    )
}

/// A duration in seconds with `decimals` decimals: `{:.N}` of
/// `as_secs_f64()`.
pub(crate) fn seconds(duration: Duration, decimals: u32) -> String {
    fixed(duration.as_nanos(), 1_000_000_000, decimals)
}

/// A duration in milliseconds with `decimals` decimals.
pub(crate) fn millis(duration: Duration, decimals: u32) -> String {
    fixed(duration.as_nanos(), 1_000_000, decimals)
}

/// A duration in seconds as `{}` of `as_secs_f64()` prints it: no
/// trailing zeros (`2.5`, `1`, `0.001`).
pub(crate) fn seconds_shortest(duration: Duration) -> String {
    let text = seconds(duration, 9);
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// `count` events in `window` as a rate per second: the numerator and
/// denominator for [`fixed`].
#[cfg(feature = "cli")]
pub(crate) fn per_second(count: u64, window: Duration) -> (u128, u128) {
    (u128::from(count) * 1_000_000_000, window.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_what_float_formatting_prints() {
        let cases: [(u64, u64, u32); 12] = [
            (0, 1, 3),
            (1, 3, 3),
            (2, 3, 1),
            (5, 2, 0),
            (7, 2, 0),
            (1, 8, 2),
            (3, 8, 2),
            (123_456_789, 1_000, 1),
            (999_999, 1_000_000, 3),
            (9_999_999, 1_000_000, 3),
            (1 << 53, 1, 1),
            (1, 1_000_000_007, 9),
        ];
        for (numerator, denominator, decimals) in cases {
            let float = numerator as f64 / denominator as f64;
            assert_eq!(
                fixed(u128::from(numerator), u128::from(denominator), decimals),
                format!("{float:.prec$}", prec = decimals as usize),
                "{numerator}/{denominator}"
            );
        }
        for nanos in [
            0,
            1,
            999,
            1_000_000,
            1_500_000_000,
            2_000_000_000,
            123_456_789_012,
        ] {
            let duration = Duration::from_nanos(nanos);
            assert_eq!(
                seconds_shortest(duration),
                format!("{}", duration.as_secs_f64())
            );
            assert_eq!(
                seconds(duration, 3),
                format!("{:.3}", duration.as_secs_f64())
            );
            assert_eq!(
                millis(duration, 0),
                format!("{:.0}", duration.as_secs_f64() * 1e3)
            );
        }
        assert_eq!(fixed(1, 0, 1), "1.0");
        assert_eq!(
            per_second(3, Duration::from_millis(1500)),
            (3_000_000_000, 1_500_000_000)
        );
    }
}
