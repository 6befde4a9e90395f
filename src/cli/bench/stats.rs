//! What a bench run counts: replies by kind, latency series, workload
//! counters, and every error — and how the result is printed.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::decimal::seconds;

/// The request kinds the bench sends; each has its own latency series.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Acquire,
    Release,
    Extend,
    Ping,
    Observe,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::Acquire,
        Kind::Release,
        Kind::Extend,
        Kind::Ping,
        Kind::Observe,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Acquire => "acquire",
            Kind::Release => "release",
            Kind::Extend => "extend",
            Kind::Ping => "ping",
            Kind::Observe => "observe",
        }
    }
}

/// Reply ops in the order they are reported.
const REPLY_OPS: [u8; 11] = *b"ATBRENQPIVX";

/// At most this many error descriptions are kept for the report; the rest
/// are only counted.
const ERROR_SAMPLES: usize = 10;

pub struct Stats {
    /// Counts and latencies are taken only inside the measured window (after
    /// the warm-up, before the stop); errors are counted always.
    measuring: bool,
    window_start: Instant,
    window_end: Option<Instant>,
    /// Every reply since the start, for the progress display.
    pub replies_seen: u64,
    replies: [u64; REPLY_OPS.len()],
    latency: [Histogram<u64>; Kind::ALL.len()],
    series: Vec<(&'static str, Histogram<u64>)>,
    counters: Vec<(&'static str, u64)>,
    errors: u64,
    error_samples: Vec<String>,
}

/// The longest latency tracked exactly; longer ones are recorded as this.
const LATENCY_MAX_US: u64 = 3_600_000_000;

fn histogram() -> Histogram<u64> {
    // Three significant digits up to an hour: exact enough for p99.9.
    // (A growing histogram would clamp in `saturating_record`.)
    Histogram::new_with_bounds(1, LATENCY_MAX_US, 3)
        .unwrap_or_else(|_| unreachable!("1 µs..1 h at 3 digits is a valid range"))
}

impl Stats {
    pub fn new(now: Instant) -> Stats {
        Stats {
            measuring: false,
            window_start: now,
            window_end: None,
            replies_seen: 0,
            replies: [0; REPLY_OPS.len()],
            latency: Kind::ALL.map(|_| histogram()),
            series: Vec::new(),
            counters: Vec::new(),
            errors: 0,
            error_samples: Vec::new(),
        }
    }

    /// Starts the measured window: everything counted so far was warm-up.
    pub fn begin(&mut self, now: Instant) {
        self.measuring = true;
        self.window_start = now;
        self.replies = [0; REPLY_OPS.len()];
        self.latency.iter_mut().for_each(Histogram::reset);
        self.series.iter_mut().for_each(|(_, h)| h.reset());
        self.counters.iter_mut().for_each(|(_, c)| *c = 0);
    }

    /// Ends the measured window; later replies (the drain) are not counted.
    pub fn end(&mut self, now: Instant) {
        if self.window_end.is_none() {
            if !self.measuring {
                self.begin(now);
            }
            self.measuring = false;
            self.window_end = Some(now);
        }
    }

    pub fn measuring(&self) -> bool {
        self.measuring
    }

    pub fn reply(&mut self, op: u8, kind: Option<Kind>, latency: Duration) {
        self.replies_seen += 1;
        if !self.measuring {
            return;
        }
        if let Some(slot) = REPLY_OPS.iter().position(|&o| o == op) {
            self.replies[slot] += 1;
        }
        if let Some(kind) = kind {
            self.latency[kind as usize].saturating_record(micros(latency));
        }
    }

    /// Adds to a workload counter (inside the measured window only).
    pub fn count(&mut self, name: &'static str, n: u64) {
        if self.measuring {
            match self.counters.iter_mut().find(|(k, _)| *k == name) {
                Some((_, c)) => *c += n,
                None => self.counters.push((name, n)),
            }
        }
    }

    /// Sets a workload counter to a value computed at the end.
    pub fn set(&mut self, name: &'static str, value: u64) {
        match self.counters.iter_mut().find(|(k, _)| *k == name) {
            Some((_, c)) => *c = value,
            None => self.counters.push((name, value)),
        }
    }

    /// Records a sample of a workload series, in microseconds.
    pub fn sample(&mut self, name: &'static str, value: Duration) {
        if !self.measuring {
            return;
        }
        let value = micros(value);
        match self.series.iter_mut().find(|(k, _)| *k == name) {
            Some((_, h)) => h.saturating_record(value),
            None => {
                let mut h = histogram();
                h.saturating_record(value);
                self.series.push((name, h));
            }
        }
    }

    /// Counts an error (an `X`, an unexpected reply, a lost connection, a
    /// broken promise of the protocol). Errors are never dropped.
    pub fn error(&mut self, description: String) {
        self.errors += 1;
        if self.error_samples.len() < ERROR_SAMPLES {
            self.error_samples.push(description);
        }
    }

    pub fn errors(&self) -> u64 {
        self.errors
    }

    fn window(&self) -> Duration {
        self.window_end
            .unwrap_or_else(Instant::now)
            .saturating_duration_since(self.window_start)
    }

    fn requests(&self) -> u64 {
        self.replies.iter().sum()
    }

    /// `n` per second of the window, as a ratio; 0 for an empty window.
    fn per_second(&self, n: u64) -> (u128, u128) {
        match self.window() {
            window if window.is_zero() => (0, 1),
            window => crate::decimal::per_second(n, window),
        }
    }

    fn latency_series(&self) -> impl Iterator<Item = (&'static str, &Histogram<u64>)> {
        Kind::ALL
            .iter()
            .map(|&k| (k.name(), &self.latency[k as usize]))
            .filter(|(_, h)| !h.is_empty())
    }

    /// The report a person reads.
    pub fn human(&self, title: &str) -> String {
        let mut out = String::new();
        let requests = self.requests();
        let _ = writeln!(out, "{title}");
        let _ = writeln!(out, "  measured    {} s", seconds(self.window(), 3));
        let _ = writeln!(
            out,
            "  requests    {requests:>12}  {}/s",
            rate(self.per_second(requests))
        );
        for &(name, value) in &self.counters {
            if is_rate(name) {
                let _ = writeln!(
                    out,
                    "  {name:<11} {value:>12}  {}/s",
                    rate(self.per_second(value))
                );
            } else {
                let _ = writeln!(out, "  {name:<11} {value:>12}");
            }
        }
        let _ = write!(out, "  replies    ");
        for (op, n) in REPLY_OPS.iter().zip(self.replies) {
            let _ = write!(out, " {}={n}", *op as char);
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "  {:<22}{:>10}{:>9}{:>9}{:>9}{:>9}",
            "latency (µs)", "count", "p50", "p99", "p99.9", "max"
        );
        let series = self
            .latency_series()
            .chain(self.series.iter().map(|(k, h)| (*k, h)));
        for (name, h) in series {
            let _ = writeln!(
                out,
                "    {name:<20}{:>10}{:>9}{:>9}{:>9}{:>9}",
                h.len(),
                h.value_at_quantile(0.5),
                h.value_at_quantile(0.99),
                h.value_at_quantile(0.999),
                h.max()
            );
        }
        if self.errors == 0 {
            let _ = writeln!(out, "  errors      0");
        } else {
            let _ = writeln!(out, "  errors      {} — first ones:", self.errors);
            for e in &self.error_samples {
                let _ = writeln!(out, "    {e}");
            }
        }
        out
    }

    /// The same report as one JSON object, for scripts.
    pub fn json(&self, header: &[(&str, String)]) -> String {
        let mut out = String::from("{");
        for (name, value) in header {
            let _ = write!(out, "\"{name}\":{value},");
        }
        let requests = self.requests();
        let _ = write!(
            out,
            "\"measured_s\":{},\"requests\":{requests},\"requests_per_s\":{},",
            seconds(self.window(), 6),
            ratio(self.per_second(requests), 1)
        );
        out.push_str("\"replies\":{");
        for (i, (op, n)) in REPLY_OPS.iter().zip(self.replies).enumerate() {
            let comma = if i == 0 { "" } else { "," };
            let _ = write!(out, "{comma}\"{}\":{n}", *op as char);
        }
        out.push_str("},\"counters\":{");
        for (i, (name, value)) in self.counters.iter().enumerate() {
            let comma = if i == 0 { "" } else { "," };
            let _ = write!(out, "{comma}\"{name}\":{value}");
            if is_rate(name) {
                let _ = write!(
                    out,
                    ",\"{name}_per_s\":{}",
                    ratio(self.per_second(*value), 1)
                );
            }
        }
        out.push_str("},\"latency_us\":{");
        let series = self
            .latency_series()
            .chain(self.series.iter().map(|(k, h)| (*k, h)));
        for (i, (name, h)) in series.enumerate() {
            let comma = if i == 0 { "" } else { "," };
            let _ = write!(
                out,
                "{comma}\"{name}\":{{\"count\":{},\"p50\":{},\"p99\":{},\"p999\":{},\"max\":{}}}",
                h.len(),
                h.value_at_quantile(0.5),
                h.value_at_quantile(0.99),
                h.value_at_quantile(0.999),
                h.max()
            );
        }
        let _ = write!(out, "}},\"errors\":{},\"error_samples\":[", self.errors);
        for (i, e) in self.error_samples.iter().enumerate() {
            let comma = if i == 0 { "" } else { "," };
            let _ = write!(out, "{comma}{}", json_string(e));
        }
        out.push_str("]}");
        out
    }
}

/// Counters that are events over time get a rate next to them; the rest
/// (gauges, per-connection extremes) are plain numbers.
fn is_rate(name: &str) -> bool {
    !name.contains("per_conn") && !matches!(name, "held" | "queued" | "ready")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn ratio((numerator, denominator): (u128, u128), decimals: u32) -> String {
    crate::decimal::fixed(numerator, denominator, decimals)
}

fn rate((numerator, denominator): (u128, u128)) -> String {
    if numerator >= denominator.saturating_mul(1_000_000) {
        format!(
            "{} M",
            ratio((numerator, denominator.saturating_mul(1_000_000)), 3)
        )
    } else if numerator >= denominator.saturating_mul(1_000) {
        format!(
            "{} k",
            ratio((numerator, denominator.saturating_mul(1_000)), 2)
        )
    } else {
        format!("{} ", ratio((numerator, denominator), 1))
    }
}

/// A JSON string literal.
pub fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_escape_quotes_backslashes_and_controls() {
        assert_eq!(json_string("a\"b\\c\nd"), "\"a\\\"b\\\\c\\u000ad\"");
    }

    #[test]
    fn only_the_measured_window_counts_but_errors_always_do() {
        let start = Instant::now();
        let mut stats = Stats::new(start);
        stats.reply(b'A', Some(Kind::Acquire), Duration::from_micros(5));
        stats.count("pairs", 1);
        stats.error("before".into());
        stats.begin(start);
        stats.reply(b'R', Some(Kind::Release), Duration::from_micros(7));
        stats.sample("wait", Duration::from_millis(200));
        stats.count("pairs", 2);
        stats.end(start + Duration::from_secs(1));
        stats.reply(b'A', Some(Kind::Acquire), Duration::from_micros(9));
        stats.error("after".into());
        assert_eq!(stats.requests(), 1);
        assert_eq!(stats.replies_seen, 3);
        assert_eq!(stats.counters, vec![("pairs", 2)]);
        assert_eq!(stats.errors(), 2);
        assert!(stats.latency[Kind::Acquire as usize].is_empty());
        let json = stats.json(&[("workload", json_string("pairs"))]);
        assert!(json.starts_with("{\"workload\":\"pairs\",\"measured_s\":1.000000,"));
        assert!(json.contains("\"requests\":1,\"requests_per_s\":1.0,"));
        assert!(json.contains("\"counters\":{\"pairs\":2,\"pairs_per_s\":2.0}"));
        assert!(json.contains("\"release\":{\"count\":1,\"p50\":7,"));
        assert!(
            json.contains("\"wait\":{\"count\":1,\"p50\":200063,"),
            "{json}"
        );
        assert!(json.ends_with("\"errors\":2,\"error_samples\":[\"before\",\"after\"]}"));
    }
}
