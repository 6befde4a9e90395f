//! The standard `process_*` figures of the running server, read from
//! `/proc` (Linux only; elsewhere none), at most once a second however
//! often the metrics are scraped ([`ProcessSample`]).

use std::fs;

use crate::core::Micros;

/// What the Prometheus client libraries call the process collector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessStats {
    /// User + system CPU time, in microseconds.
    pub cpu_micros: u64,
    pub open_fds: u64,
    /// The soft `RLIMIT_NOFILE`.
    pub max_fds: u64,
    pub virtual_memory_bytes: u64,
    pub resident_memory_bytes: u64,
    /// When the process started, in hundredths of a second since the
    /// epoch (the kernel counts start time in clock ticks of 1/100 s).
    pub start_time_centis: u64,
}

impl ProcessStats {
    /// Reads this process's figures, or `None` where `/proc` cannot be
    /// read or parsed.
    pub fn read() -> Option<ProcessStats> {
        let stat = fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time_s = boot_time_s(&fs::read_to_string("/proc/stat").ok()?)?;
        let ticks_per_s = Some(rustix::param::clock_ticks_per_second()).filter(|&t| t > 0)?;
        let page_size = rustix::param::page_size() as u64;
        let fields = parse_stat(&stat)?;
        let open_fds = open_fds();
        Some(ProcessStats {
            cpu_micros: (fields.utime + fields.stime).saturating_mul(1_000_000) / ticks_per_s,
            open_fds,
            max_fds: max_fds(),
            virtual_memory_bytes: fields.vsize,
            resident_memory_bytes: fields.rss_pages.saturating_mul(page_size),
            start_time_centis: boot_time_s.saturating_mul(100)
                + fields.start_ticks.saturating_mul(100) / ticks_per_s,
        })
    }
}

/// The fields of `/proc/self/stat` used here.
#[derive(Debug, PartialEq, Eq)]
struct StatFields {
    utime: u64,
    stime: u64,
    start_ticks: u64,
    vsize: u64,
    rss_pages: u64,
}

/// Parses `/proc/[pid]/stat`. The command name (field 2) is in
/// parentheses and may itself contain spaces and parentheses, so fields
/// are counted from the last `)`.
fn parse_stat(text: &str) -> Option<StatFields> {
    let after_name = &text[text.rfind(')')? + 1..];
    // Field 3 (state) is the first after the name; field N is at N - 3.
    let fields: Vec<&str> = after_name.split_ascii_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(StatFields {
        utime: field(14)?,
        stime: field(15)?,
        start_ticks: field(22)?,
        vsize: field(23)?,
        rss_pages: field(24)?,
    })
}

/// The boot time (`btime`) from `/proc/stat`, in seconds since the epoch.
fn boot_time_s(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// The process's open file descriptors. Since Linux 6.2 the size of
/// `/proc/self/fd` is their count, from the descriptor table's bitmap,
/// without a directory entry made per descriptor; listing the directory
/// costs the loop O(connections) (10 ms at 15,000), so it is only the
/// fallback of older kernels, which report size 0.
fn open_fds() -> u64 {
    match fs::metadata("/proc/self/fd") {
        Ok(meta) if meta.len() > 0 => meta.len(),
        _ => fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count() as u64),
    }
}

/// How long a [`ProcessSample`] is served before it is read again.
pub const SAMPLE_INTERVAL_US: Micros = 1_000_000;

/// The process figures as last read: scrapes within
/// [`SAMPLE_INTERVAL_US`] of a reading share it, so that scraping in a
/// loop costs the event loop one reading a second (spec §4, v5).
#[derive(Debug, Default)]
pub struct ProcessSample {
    /// When it was read, and what; `None` before the first reading.
    last: Option<(Micros, Option<ProcessStats>)>,
    readings: u64,
}

impl ProcessSample {
    /// The figures at `now`: the last reading if it is less than a
    /// second old, else a new one.
    pub fn get(&mut self, now: Micros) -> Option<&ProcessStats> {
        let fresh = self
            .last
            .as_ref()
            .is_some_and(|&(at, _)| now.saturating_sub(at) < SAMPLE_INTERVAL_US);
        if !fresh {
            self.readings += 1;
            self.last = Some((now, ProcessStats::read()));
        }
        self.last.as_ref().and_then(|(_, stats)| stats.as_ref())
    }

    /// How many times `/proc` was read.
    pub fn readings(&self) -> u64 {
        self.readings
    }
}

fn max_fds() -> u64 {
    // `None` is RLIM_INFINITY.
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        let line = "4242 (kun ci) (x) S 1 4242 4242 0 -1 4194560 300 0 0 0 \
                    25 7 0 0 20 0 1 0 98765 12345678 890 18446744073709551615 \
                    1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(StatFields {
                utime: 25,
                stime: 7,
                start_ticks: 98765,
                vsize: 12345678,
                rss_pages: 890,
            })
        );
        assert_eq!(parse_stat("4242 (kunci) S 1 2"), None);
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    #[test]
    fn boot_time_is_the_btime_line() {
        let text = "cpu  1 2 3\nintr 5\nbtime 1764800000\nprocesses 9\n";
        assert_eq!(boot_time_s(text), Some(1_764_800_000));
        assert_eq!(boot_time_s("cpu 1\n"), None);
    }

    #[test]
    fn the_fd_count_is_the_size_of_the_fd_directory() {
        let Ok(listed) = fs::read_dir("/proc/self/fd").map(|dir| dir.count() as u64) else {
            return; // not Linux
        };
        // The listing holds the directory itself open: one more entry,
        // give or take a descriptor another test thread opened meanwhile.
        let counted = open_fds();
        assert!(
            counted + 8 >= listed && counted <= listed + 8,
            "{counted} vs {listed}"
        );
    }

    #[test]
    fn a_sample_is_read_again_only_after_a_second() {
        let mut sample = ProcessSample::default();
        let first = sample.get(5).copied();
        assert_eq!(sample.readings(), 1);
        assert_eq!(sample.get(5 + SAMPLE_INTERVAL_US - 1).copied(), first);
        assert_eq!(sample.readings(), 1);
        sample.get(5 + SAMPLE_INTERVAL_US);
        assert_eq!(sample.readings(), 2);
    }

    #[test]
    fn this_process_reads_sensibly() {
        let Some(stats) = ProcessStats::read() else {
            return; // not Linux
        };
        assert!(stats.open_fds >= 3, "{stats:?}");
        assert!(stats.max_fds >= stats.open_fds, "{stats:?}");
        assert!(stats.resident_memory_bytes > 0, "{stats:?}");
        assert!(stats.virtual_memory_bytes >= stats.resident_memory_bytes);
        let now_centis = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64 / 10);
        assert!(stats.start_time_centis <= now_centis + 100, "{stats:?}");
        assert!(
            stats.start_time_centis + 3_600 * 100 > now_centis,
            "{stats:?}"
        );
    }
}
