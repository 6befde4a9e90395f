//! Prometheus metrics for `kunci serve --metrics ADDR`.
//!
//! - [`render`]: the text exposition (format 0.0.4) — a pure function of a
//!   [`Snapshot`] of the core's gauges and counters and the process's
//!   [`ProcessStats`].
//! - [`process`]: the standard `process_*` figures, read from `/proc` at
//!   scrape time (nothing is sampled between scrapes).
//! - [`http`]: one bounded HTTP exchange, sans IO: bytes in, response
//!   bytes out, a deadline. The server's event loop moves the bytes.
//!
//! Nothing here runs unless someone scrapes: the core keeps its counters
//! anyway (for `I`), and the histogram costs a few adds per queued wait.

pub mod http;
pub mod process;

use std::fmt::Write as _;

use crate::core::wait_histogram::BUCKET_BOUNDS_TEXT;
use crate::core::{Core, Limits, Stats};
pub use process::{ProcessSample, ProcessStats};

/// The `Content-Type` of the text exposition format 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What one scrape shows of the server: gauges read now, counters since
/// start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub held: usize,
    /// Live grants of every kind: a shared or counted key has several.
    pub grants_held: usize,
    pub keys: usize,
    pub waiters: usize,
    /// Observe requests held now (spec §13).
    pub watches: usize,
    pub connections: usize,
    pub stats: Stats,
    pub limits: Limits,
}

impl Snapshot {
    /// The core's figures at this moment.
    pub fn of(core: &Core) -> Snapshot {
        Snapshot {
            held: core.held(),
            grants_held: core.grants_held(),
            keys: core.keys(),
            waiters: core.waiter_count(),
            watches: core.watch_count(),
            connections: core.connections(),
            stats: *core.stats(),
            limits: *core.limits(),
        }
    }
}

/// The meaning of each `X` code, for the errors metric's help text.
const ERROR_CODES: &str = "1 unknown op, 2 frame too long, 3 empty key, 4 key not UTF-8, \
5 lease 0, 6 unexpected payload, 7 connection limit, 8 shutting down, 9 peer not allowed, \
10 limit mismatch, 11 invalid count, 12 not authenticated, 13 not permitted, 14 too many watches";

/// Writes the exposition of `snapshot` and, when it could be read,
/// `process` into `out`.
pub fn render(snapshot: &Snapshot, process: Option<&ProcessStats>, out: &mut String) {
    let s = &snapshot.stats;
    let mut w = Writer(out);
    w.single(
        "kunci_locks_held",
        "gauge",
        "Keys held by a grant now.",
        snapshot.held as u64,
    );
    w.single(
        "kunci_grants_held",
        "gauge",
        "Grants live now, of every kind (a shared or counted key may have several).",
        snapshot.grants_held as u64,
    );
    w.single(
        "kunci_keys",
        "gauge",
        "Keys in the lock table now, held or waited on.",
        snapshot.keys as u64,
    );
    w.single(
        "kunci_waiters",
        "gauge",
        "Acquires queued now.",
        snapshot.waiters as u64,
    );
    w.single(
        "kunci_watches",
        "gauge",
        "Observe requests (O) held now until their key's token changes.",
        snapshot.watches as u64,
    );
    w.single(
        "kunci_connections",
        "gauge",
        "Client connections open now.",
        snapshot.connections as u64,
    );
    let limits = &snapshot.limits;
    w.labelled(
        "kunci_limit",
        "gauge",
        "The configured capacity limits: keys (--max-keys), waiters (--max-waiters), \
         waiters_per_key, waits_per_conn, grants (--max-grants), connections (--max-connections).",
        "limit",
        &[
            ("keys", limits.max_keys as u64),
            ("waiters", limits.max_waiters as u64),
            ("waiters_per_key", u64::from(limits.max_waiters_per_key)),
            ("waits_per_conn", u64::from(limits.max_waits_per_conn)),
            ("grants", limits.max_grants as u64),
            ("connections", limits.max_connections as u64),
        ],
    );
    w.labelled(
        "kunci_acquires_total",
        "counter",
        "Acquires answered, by result: acquired (A), timeout (T), busy (B).",
        "result",
        &[
            ("acquired", s.grants),
            ("timeout", s.timeouts),
            ("busy", s.busy),
        ],
    );
    w.labelled(
        "kunci_releases_total",
        "counter",
        "Releases answered, by result: released (R), not_held (N).",
        "result",
        &[("released", s.released), ("not_held", s.release_not_held)],
    );
    w.labelled(
        "kunci_renewals_total",
        "counter",
        "Lease renewals answered, by result: extended (E), not_held (N).",
        "result",
        &[("extended", s.extended), ("not_held", s.extend_not_held)],
    );
    w.labelled(
        "kunci_proclaims_total",
        "counter",
        "Label changes (C, spec 13.4a) answered, by result: proclaimed (C), not_held (N).",
        "result",
        &[
            ("proclaimed", s.proclaimed),
            ("not_held", s.proclaim_not_held),
        ],
    );
    w.labelled(
        "kunci_listings_total",
        "counter",
        "Listing requests answered (spec 11): holders (H), keys (L, one page each).",
        "request",
        &[("holders", s.holders), ("keys", s.lists)],
    );
    w.single(
        "kunci_lease_expiries_total",
        "counter",
        "Leases that ran out, so that the server took the key back.",
        s.expired,
    );
    w.single(
        "kunci_connections_accepted_total",
        "counter",
        "Client connections accepted and served.",
        s.connections_accepted,
    );
    w.labelled(
        "kunci_connections_refused_total",
        "counter",
        "Client connections closed at accept, by reason: allow (not in --allow), \
         max_connections (--max-connections open), fd_limit (no file descriptor left).",
        "reason",
        &[
            ("allow", s.refused),
            ("max_connections", s.refused_max_connections),
            ("fd_limit", s.refused_fd_limit),
        ],
    );
    w.single(
        "kunci_auth_failures_total",
        "counter",
        "Connections closed because they did not authenticate (X 12: no U first, \
         or a secret that is too short or unknown).",
        s.auth_failures,
    );
    w.single(
        "kunci_state_errors_total",
        "counter",
        "Writes of the state file that failed (disk full, I/O error, read-only): \
         meanwhile what needs a promise the file does not hold gets B.",
        s.state_errors,
    );
    const CODES: [&str; 14] = [
        "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14",
    ];
    let mut by_code = [("", 0); CODES.len()];
    for (index, code) in CODES.iter().enumerate() {
        by_code[index] = (code, s.errors_by_code.get(index + 1).copied().unwrap_or(0));
    }
    w.labelled(
        "kunci_errors_total",
        "counter",
        &format!("Error frames (X) sent, by code: {ERROR_CODES}."),
        "code",
        &by_code,
    );
    w.histogram(
        "kunci_acquire_wait_seconds",
        "Time queued acquires waited, from joining the key's queue to their grant or \
         timeout (1 ms resolution); acquires answered at once are not observed.",
        s,
    );
    w.header(
        "kunci_build_info",
        "gauge",
        "The running kunci's version; always 1.",
    );
    let _ = writeln!(
        w.0,
        "kunci_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    if let Some(process) = process {
        render_process(process, &mut w);
    }
}

fn render_process(p: &ProcessStats, w: &mut Writer<'_>) {
    w.header(
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
    );
    let _ = writeln!(
        w.0,
        "process_cpu_seconds_total {}",
        Decimal(p.cpu_micros, 1_000_000)
    );
    w.single(
        "process_open_fds",
        "gauge",
        "Number of open file descriptors.",
        p.open_fds,
    );
    w.single(
        "process_max_fds",
        "gauge",
        "Maximum number of open file descriptors.",
        p.max_fds,
    );
    w.single(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        p.virtual_memory_bytes,
    );
    w.single(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        p.resident_memory_bytes,
    );
    w.header(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    );
    let _ = writeln!(
        w.0,
        "process_start_time_seconds {}",
        Decimal(p.start_time_centis, 100)
    );
}

/// Writes metric families into a string. Writing to a `String` cannot
/// fail, so the `fmt::Result`s are dropped.
struct Writer<'a>(&'a mut String);

impl Writer<'_> {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn single(&mut self, name: &str, kind: &str, help: &str, value: u64) {
        self.header(name, kind, help);
        let _ = writeln!(self.0, "{name} {value}");
    }

    fn labelled(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        label: &str,
        values: &[(&str, u64)],
    ) {
        self.header(name, kind, help);
        for (label_value, value) in values {
            let _ = writeln!(self.0, "{name}{{{label}=\"{label_value}\"}} {value}");
        }
    }

    fn histogram(&mut self, name: &str, help: &str, stats: &Stats) {
        self.header(name, "histogram", help);
        let histogram = &stats.acquire_wait;
        let cumulative = histogram.cumulative();
        let bounds = BUCKET_BOUNDS_TEXT.iter().copied().chain(["+Inf"]);
        for (bound, count) in bounds.zip(cumulative) {
            let _ = writeln!(self.0, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(
            self.0,
            "{name}_sum {}",
            Decimal(histogram.sum_micros, 1_000_000)
        );
        let _ = writeln!(self.0, "{name}_count {}", histogram.count);
    }
}

/// `value / unit` written exactly as a decimal (`unit` a power of ten),
/// without floating point: `Decimal(1_500_000, 1_000_000)` is `1.5`.
struct Decimal(u64, u64);

impl std::fmt::Display for Decimal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Decimal(value, unit) = *self;
        let whole = value / unit;
        let fraction = value % unit;
        if fraction == 0 {
            return write!(f, "{whole}");
        }
        let digits = unit.ilog10() as usize;
        let text = format!("{fraction:0digits$}");
        write!(f, "{whole}.{}", text.trim_end_matches('0'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle() -> Snapshot {
        Snapshot {
            held: 0,
            grants_held: 0,
            keys: 0,
            waiters: 0,
            watches: 0,
            connections: 0,
            stats: Stats::default(),
            limits: Limits::default(),
        }
    }

    #[test]
    fn decimals_are_exact_and_short() {
        assert_eq!(Decimal(0, 1_000_000).to_string(), "0");
        assert_eq!(Decimal(1_500_000, 1_000_000).to_string(), "1.5");
        assert_eq!(Decimal(1_000_001, 1_000_000).to_string(), "1.000001");
        assert_eq!(Decimal(170_000_000_012, 100).to_string(), "1700000000.12");
        assert_eq!(Decimal(7, 100).to_string(), "0.07");
    }

    #[test]
    fn an_idle_server_renders_every_family_with_zeros() {
        let mut text = String::new();
        render(&idle(), None, &mut text);
        for line in [
            "# HELP kunci_locks_held Keys held by a grant now.",
            "# TYPE kunci_locks_held gauge",
            "kunci_locks_held 0",
            "kunci_grants_held 0",
            "kunci_acquires_total{result=\"busy\"} 0",
            "kunci_releases_total{result=\"not_held\"} 0",
            "kunci_connections_refused_total{reason=\"fd_limit\"} 0",
            "kunci_errors_total{code=\"9\"} 0",
            "kunci_errors_total{code=\"13\"} 0",
            "kunci_errors_total{code=\"14\"} 0",
            "kunci_watches 0",
            "# TYPE kunci_auth_failures_total counter",
            "kunci_auth_failures_total 0",
            "# TYPE kunci_state_errors_total counter",
            "kunci_state_errors_total 0",
            "kunci_limit{limit=\"keys\"} 1048576",
            "kunci_limit{limit=\"connections\"} 16384",
            "kunci_acquire_wait_seconds_bucket{le=\"0.001\"} 0",
            "kunci_acquire_wait_seconds_bucket{le=\"+Inf\"} 0",
            "kunci_acquire_wait_seconds_sum 0",
            "kunci_acquire_wait_seconds_count 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
        }
        let build = format!(
            "kunci_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.lines().any(|l| l == build));
        assert!(!text.contains("process_"));
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn counters_and_process_figures_are_written_exactly() {
        let mut snapshot = Snapshot {
            held: 3,
            grants_held: 7,
            keys: 4,
            waiters: 5,
            watches: 8,
            connections: 6,
            ..idle()
        };
        let s = &mut snapshot.stats;
        s.grants = 10;
        s.release_not_held = 2;
        s.errors_by_code[7] = 1;
        s.auth_failures = 4;
        s.acquire_wait.observe(1_500);
        s.acquire_wait.observe(2_000_000);
        let process = ProcessStats {
            cpu_micros: 1_230_000,
            open_fds: 9,
            max_fds: 1024,
            virtual_memory_bytes: 10 << 20,
            resident_memory_bytes: 3 << 20,
            start_time_centis: 176_480_000_012,
        };
        let mut text = String::new();
        render(&snapshot, Some(&process), &mut text);
        for line in [
            "kunci_locks_held 3",
            "kunci_grants_held 7",
            "kunci_keys 4",
            "kunci_waiters 5",
            "kunci_watches 8",
            "kunci_connections 6",
            "kunci_acquires_total{result=\"acquired\"} 10",
            "kunci_releases_total{result=\"not_held\"} 2",
            "kunci_errors_total{code=\"7\"} 1",
            "kunci_auth_failures_total 4",
            "kunci_acquire_wait_seconds_bucket{le=\"0.001\"} 0",
            "kunci_acquire_wait_seconds_bucket{le=\"0.0025\"} 1",
            "kunci_acquire_wait_seconds_bucket{le=\"1\"} 1",
            "kunci_acquire_wait_seconds_bucket{le=\"2.5\"} 2",
            "kunci_acquire_wait_seconds_bucket{le=\"+Inf\"} 2",
            "kunci_acquire_wait_seconds_sum 2.0015",
            "kunci_acquire_wait_seconds_count 2",
            "process_cpu_seconds_total 1.23",
            "process_open_fds 9",
            "process_max_fds 1024",
            "process_virtual_memory_bytes 10485760",
            "process_resident_memory_bytes 3145728",
            "process_start_time_seconds 1764800000.12",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing:\n{text}");
        }
    }
}
