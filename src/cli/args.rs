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
/// exactly, without floating point: at most nanosecond precision.
pub fn seconds(option: &str, text: &str) -> Result<Duration, String> {
    let bad = || format!("{option}: invalid number of seconds {text:?}");
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() && fraction.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
        || fraction.len() > 9
    {
        return Err(bad());
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<9}").parse().map_err(|_| bad())?
    };
    Ok(Duration::new(whole, nanos))
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
}
