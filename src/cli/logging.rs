//! How `kunci serve` writes its log lines on stderr.
//!
//! On a terminal or into a file: `2026-12-03T13:45:00.123Z INFO  message`
//! (UTC, so lines from several hosts sort together). When stderr is the
//! systemd journal (`JOURNAL_STREAM` names stderr's device and inode), the
//! journal stamps each line itself, so a line is only its syslog priority
//! prefix and the message: `<6>message`.

use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use log::Level;

/// Starts the server's logging: `RUST_LOG`, default `info`. A `RUST_LOG`
/// that does not parse is reported (at `warn`) and the default used.
pub fn init_server() {
    let journal = stderr_is_journal();
    let (filter, problem) = log_filter("info");
    let _ = env_logger::Builder::new()
        .parse_filters(&filter)
        .format(move |out, record| {
            if journal {
                writeln!(
                    out,
                    "<{}>{}",
                    syslog_priority(record.level()),
                    record.args()
                )
            } else {
                writeln!(
                    out,
                    "{} {:<5} {}",
                    utc_timestamp(SystemTime::now()),
                    record.level(),
                    record.args()
                )
            }
        })
        .try_init();
    report_filter_problem(problem, "info");
}

/// The filter to use: `RUST_LOG` if it is valid, else `default`, with
/// what is wrong with it.
pub(super) fn log_filter(default: &str) -> (String, Option<String>) {
    match std::env::var("RUST_LOG") {
        Ok(value) if value.trim().is_empty() => (default.to_owned(), None),
        Ok(value) => match filter_problem(&value) {
            None => (value, None),
            Some(problem) => (
                default.to_owned(),
                Some(format!("RUST_LOG={value:?}: {problem}")),
            ),
        },
        Err(std::env::VarError::NotPresent) => (default.to_owned(), None),
        Err(std::env::VarError::NotUnicode(_)) => (
            default.to_owned(),
            Some("RUST_LOG is not valid UTF-8".to_owned()),
        ),
    }
}

/// Logs, once logging runs, that `RUST_LOG` was not used.
pub(super) fn report_filter_problem(problem: Option<String>, default: &str) {
    if let Some(problem) = problem {
        log::warn!("{problem}; logging at {default} instead");
    }
}

/// What is wrong with a `RUST_LOG` value, if anything: each directive is
/// a level (`off error warn info debug trace`), `MODULE=LEVEL`, or a kunci
/// module path (`kunci`, `kunci::…`). A bare word that is none of these
/// (`infoo`) is a typo that would silently log nothing.
fn filter_problem(value: &str) -> Option<String> {
    let is_level = |text: &str| text.parse::<log::LevelFilter>().is_ok();
    let directives = value
        .split_once('/')
        .map_or(value, |(directives, _)| directives);
    for directive in directives.split(',').map(str::trim) {
        if directive.is_empty() {
            continue;
        }
        match directive.split_once('=') {
            Some((module, _)) if module.trim().is_empty() => {
                return Some(format!("{directive:?} names no module before `=`"));
            }
            Some((_, level)) if !is_level(level.trim()) => {
                return Some(format!(
                    "{level:?} is not a level (off, error, warn, info, debug, trace)"
                ));
            }
            Some(_) => {}
            None if is_level(directive)
                || directive == "kunci"
                || directive.starts_with("kunci::") => {}
            None => {
                return Some(format!(
                    "{directive:?} is neither a level (off, error, warn, info, debug, trace) \
                     nor MODULE=LEVEL"
                ));
            }
        }
    }
    None
}

/// Whether stderr is the stream systemd connected to the journal: the
/// `JOURNAL_STREAM` it sets (`DEVICE:INODE`) names stderr itself, not a
/// stream some ancestor had before stderr was redirected.
fn stderr_is_journal() -> bool {
    let Ok(value) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((device, inode)) = value.split_once(':') else {
        return false;
    };
    let (Ok(device), Ok(inode)) = (device.parse::<u64>(), inode.parse::<u64>()) else {
        return false;
    };
    // fd 2 may be closed, which fstat reports as an error.
    let Ok(stat) = rustix::fs::fstat(std::io::stderr()) else {
        return false;
    };
    stat.st_dev == device && stat.st_ino == inode
}

/// The syslog priority the journal reads from a `<N>` prefix.
fn syslog_priority(level: Level) -> u8 {
    match level {
        Level::Error => 3,
        Level::Warn => 4,
        Level::Info => 6,
        Level::Debug | Level::Trace => 7,
    }
}

/// `at` as RFC 3339 in UTC with milliseconds: `2026-12-03T13:45:00.123Z`.
fn utc_timestamp(at: SystemTime) -> String {
    let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let seconds = since_epoch.as_secs();
    let (year, month, day) = civil_from_days((seconds / 86_400) as i64);
    let of_day = seconds % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        of_day / 3_600,
        of_day / 60 % 60,
        of_day % 60,
        since_epoch.subsec_millis()
    )
}

/// The proleptic Gregorian date of a day counted from 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_are_utc_rfc3339_with_milliseconds() {
        let at = |seconds: u64, millis: u64| {
            UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_millis(millis)
        };
        assert_eq!(utc_timestamp(at(0, 0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            utc_timestamp(at(1_764_769_500, 123)),
            "2025-12-03T13:45:00.123Z"
        );
        // 2024-02-29, a leap day, and the last second of 1999.
        assert_eq!(
            utc_timestamp(at(1_709_164_800, 9)),
            "2024-02-29T00:00:00.009Z"
        );
        assert_eq!(
            utc_timestamp(at(946_684_799, 999)),
            "1999-12-31T23:59:59.999Z"
        );
    }

    #[test]
    fn a_log_filter_with_a_typo_is_named() {
        for good in [
            "info",
            "debug",
            "kunci=debug,mio=warn",
            "warn,kunci::server=trace",
            "kunci",
            "",
        ] {
            assert_eq!(filter_problem(good), None, "{good}");
        }
        assert_eq!(
            filter_problem("infoo").as_deref(),
            Some(
                "\"infoo\" is neither a level (off, error, warn, info, debug, trace) nor MODULE=LEVEL"
            )
        );
        assert_eq!(
            filter_problem("kunci=verbose").as_deref(),
            Some("\"verbose\" is not a level (off, error, warn, info, debug, trace)")
        );
        assert_eq!(
            filter_problem("==").as_deref(),
            Some("\"==\" names no module before `=`")
        );
    }

    #[test]
    fn journal_priorities_follow_syslog() {
        assert_eq!(syslog_priority(Level::Error), 3);
        assert_eq!(syslog_priority(Level::Warn), 4);
        assert_eq!(syslog_priority(Level::Info), 6);
        assert_eq!(syslog_priority(Level::Debug), 7);
    }
}
