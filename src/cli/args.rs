//! Option values shared by the subcommands.

use std::ffi::OsString;
use std::time::Duration;

use crate::addr::Address;

/// Reads the value of an option as UTF-8 text.
pub fn text(value: Result<OsString, lexopt::Error>) -> Result<String, String> {
    value
        .map_err(|e| e.to_string())?
        .into_string()
        .map_err(|v| format!("not valid UTF-8: {v:?}"))
}

/// An unsigned integer type an option takes, with its range for messages.
pub trait Integer: TryFrom<u64> {
    const MAX: u64;
}

macro_rules! integer {
    ($($t:ty),*) => {$(
        impl Integer for $t {
            const MAX: u64 = <$t>::MAX as u64;
        }
    )*};
}
integer!(u8, u16, u32, u64, usize);

/// Parses a number of the type the option takes, naming the option on
/// error, and the range when the number is out of it.
pub fn number<T: Integer>(
    option: &str,
    value: Result<OsString, lexopt::Error>,
) -> Result<T, String> {
    let number = number_up_to(option, value, T::MAX)?;
    T::try_from(number).map_err(|_| format!("{option}: {number} is out of range 0..={}", T::MAX))
}

/// [`number`]'s work, once for every type: a `u64` up to `max`.
fn number_up_to(
    option: &str,
    value: Result<OsString, lexopt::Error>,
    max: u64,
) -> Result<u64, String> {
    let text = text(value)?;
    match text.parse::<u64>() {
        Ok(number) if number <= max => Ok(number),
        _ if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => {
            Err(format!("{option}: {text} is out of range 0..={max}"))
        }
        _ => Err(format!(
            "{option}: invalid value {text:?} (a whole number 0..={max})"
        )),
    }
}

/// Parses an address option.
/// A file name.
pub fn path(value: Result<OsString, lexopt::Error>) -> Result<std::path::PathBuf, String> {
    value.map(Into::into).map_err(|e| e.to_string())
}

/// Parses a `--listen` address (no `etcd://`).
pub fn listen_address(value: Result<OsString, lexopt::Error>) -> Result<Address, String> {
    crate::addr::parse_listen(&text(value)?).map_err(|e| e.to_string())
}

pub fn address(value: Result<OsString, lexopt::Error>) -> Result<Address, String> {
    text(value)?
        .parse()
        .map_err(|e: crate::addr::AddressError| e.to_string())
}

/// Parses seconds with an optional decimal fraction (`--wait 2.5`),
/// exactly, without floating point: at most nanosecond precision. A time
/// with a unit (`5m`, `30s`) is refused with the same time in seconds as
/// the example to write (spec §9 gives seconds; one form, no guessing).
pub fn seconds(option: &str, text: &str) -> Result<Duration, String> {
    if let Some(duration) = plain_seconds(text) {
        return Ok(duration);
    }
    Err(match with_unit(text) {
        Some(duration) => format!(
            "{option}: {text:?} has a unit; it takes seconds: {option} {}",
            crate::decimal::seconds_shortest(duration)
        ),
        None => format!(
            "{option}: invalid number of seconds {text:?} (write seconds, with decimals if \
             needed: {option} 30, {option} 2.5)"
        ),
    })
}

/// `text` as seconds with an optional decimal fraction, if it is one.
fn plain_seconds(text: &str) -> Option<Duration> {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() && fraction.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
        || fraction.len() > 9
    {
        return None;
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}").parse().ok()?
    };
    Some(Duration::new(whole, nanos))
}

/// `text` as a number with a unit (`500ms`, `30s`, `5m`, `5min`, `2h`),
/// if it is one: only to say it in seconds.
fn with_unit(text: &str) -> Option<Duration> {
    let number_end = text.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = text.split_at(number_end);
    let number = plain_seconds(number)?;
    match unit {
        "ms" => Some(number / 1000),
        "s" | "sec" => Some(number),
        "m" | "min" => number.checked_mul(60),
        "h" => number.checked_mul(3600),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_accept_decimals_exactly() {
        assert_eq!(seconds("--wait", "0"), Ok(Duration::ZERO));
        assert_eq!(seconds("--wait", "2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(seconds("--wait", ".25"), Ok(Duration::from_millis(250)));
        assert_eq!(seconds("--wait", "255"), Ok(Duration::from_secs(255)));
        assert_eq!(seconds("--wait", "1.000000001"), Ok(Duration::new(1, 1)));
        for bad in ["", ".", "-1", "1e3", "abc", "1.2.3", "1.0000000001"] {
            assert!(seconds("--wait", bad).is_err(), "{bad}");
        }
    }

    /// `--wait 5m`, `--lease 30s`: refused, with the seconds to write.
    #[test]
    fn a_time_with_a_unit_is_refused_with_its_seconds() {
        assert_eq!(
            seconds("--wait", "5m"),
            Err("--wait: \"5m\" has a unit; it takes seconds: --wait 300".to_owned())
        );
        assert_eq!(
            seconds("--lease", "30s"),
            Err("--lease: \"30s\" has a unit; it takes seconds: --lease 30".to_owned())
        );
        for (text, example) in [
            ("1.5m", "90"),
            ("2h", "7200"),
            ("250ms", "0.25"),
            ("10min", "600"),
        ] {
            assert_eq!(
                seconds("--wait", text),
                Err(format!(
                    "--wait: {text:?} has a unit; it takes seconds: --wait {example}"
                ))
            );
        }
        assert_eq!(
            seconds("--kill-after", "soon"),
            Err(
                "--kill-after: invalid number of seconds \"soon\" (write seconds, with \
                 decimals if needed: --kill-after 30, --kill-after 2.5)"
                    .to_owned()
            )
        );
        assert!(
            seconds("--wait", "5x")
                .unwrap_err()
                .starts_with("--wait: invalid")
        );
    }
}
