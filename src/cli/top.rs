//! `kunci top`: the server's gauges and per-second counters, one line per
//! interval, from its `I` line (like `redis-cli --stat`).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Write as _;
use std::time::{Duration, Instant};

use super::args;
use super::client::{self as common, Attempt};
use super::exit;
use crate::addr::Address;

const HELP: &str = "\
kunci top — watch a server's counters, one line per interval

Usage: kunci top [--interval S] [--count N] [--server ADDR]...

Each line shows the gauges now — keys held, keys in the table, queued
waiters, open connections (this one included) — and, per second over the
last interval, grants (A), timeouts (T), busy answers (B), lease expiries
and errors (X). The first line has no interval yet, so its rates are `-`.
A header repeats every 20 lines. Stops on Ctrl-C, after --count lines, or
when the server cannot be asked (exiting as `kunci info` would).

Options:
  --interval S    seconds between lines, decimals allowed (default 1)
  --count N       stop after N lines (default: run until interrupted)
";

/// Lines between headers: one screen.
const LINES_PER_HEADER: u64 = 20;

const GAUGES: [(&str, &str); 4] = [
    ("held", "held"),
    ("keys", "keys"),
    ("waiters", "waiters"),
    ("connections", "conns"),
];

const RATES: [(&str, &str); 5] = [
    ("grants", "grants/s"),
    ("timeouts", "timeouts/s"),
    ("busy", "busy/s"),
    ("expired", "expired/s"),
    ("errors", "errors/s"),
];

struct Options {
    servers: Vec<Address>,
    secret: Option<crate::client::Secret>,
    tls: common::TlsOptions,
    interval: Duration,
    count: Option<u64>,
}

fn parse(arguments: Vec<OsString>) -> Result<Option<Options>, String> {
    use lexopt::prelude::*;
    let mut options = Options {
        servers: Vec::new(),
        secret: None,
        tls: common::TlsOptions::default(),
        interval: Duration::from_secs(1),
        count: None,
    };
    let mut secret_file = None;
    let mut allow_plaintext_secret = false;
    let mut parser = lexopt::Parser::from_args(arguments);
    while let Some(argument) = parser.next().map_err(|e| e.to_string())? {
        match argument {
            Long("server") => options
                .servers
                .extend(common::server_option(parser.value())?),
            Long("secret-file") => secret_file = Some(parser.value().map_err(|e| e.to_string())?),
            Long("insecure-plaintext-secret") => allow_plaintext_secret = true,
            Long("interval") => {
                let interval = args::seconds("--interval", &args::text(parser.value())?)?;
                if interval < Duration::from_millis(10) {
                    return Err("--interval: at least 0.01 seconds".into());
                }
                options.interval = interval;
            }
            Long("count") => {
                let count: u64 = args::number("--count", parser.value())?;
                if count == 0 {
                    return Err("--count: must be at least 1".into());
                }
                options.count = Some(count);
            }
            Long(name) if name.starts_with("tls-") => {
                let name = name.to_owned();
                if !common::tls_option(&name, &mut parser, &mut options.tls)? {
                    return Err(format!("invalid option '--{name}'"));
                }
            }
            Short('h') | Long("help") => return Ok(None),
            other => return Err(other.unexpected().to_string()),
        }
    }
    if options.servers.is_empty() {
        options.servers = common::default_servers()?;
    }
    common::check_servers(&options.servers)?;
    options.secret = common::secret(secret_file)?;
    common::check_plaintext_secret(
        &options.servers,
        options.secret.as_ref(),
        allow_plaintext_secret,
    )?;
    common::check_tls(&options.servers, &options.tls)?;
    if options
        .servers
        .iter()
        .any(|address| matches!(address, Address::Etcd { .. }))
    {
        return Err(
            "not supported on etcd://: the counters are a kunci server's \
                    (etcd's own are in its /metrics)"
                .into(),
        );
    }
    Ok(Some(options))
}

pub fn main(arguments: Vec<OsString>) -> u8 {
    let options = match parse(arguments) {
        Ok(Some(options)) => options,
        Ok(None) => {
            // The shared --server lines; `top` takes no permit options.
            print!("{HELP}{}", common::SERVER_HELP);
            return exit::DONE;
        }
        Err(message) => {
            eprintln!("kunci top: {message}\n(see kunci top --help)");
            return exit::USAGE;
        }
    };
    common::init_logging();
    let client = match common::client(
        options.servers.clone(),
        options.secret.clone(),
        &options.tls,
    ) {
        Ok(client) => client,
        Err(message) => {
            eprintln!("kunci top: {message}");
            return exit::UNAVAILABLE;
        }
    };
    let mut stdout = std::io::stdout();
    let mut previous: Option<(Instant, Counters)> = None;
    let mut lines = 0;
    let mut next_at = Instant::now();
    loop {
        let line = match client.info() {
            Ok(line) => line,
            Err(error) => {
                return common::report("top", error, &options.servers, &Attempt::default());
            }
        };
        let at = Instant::now();
        let counters = Counters::parse(&line);
        let mut text = String::new();
        if lines % LINES_PER_HEADER == 0 {
            text.push_str(&header());
        }
        text.push_str(&row(
            &counters,
            previous.as_ref().map(|(then, old)| (at - *then, old)),
        ));
        // A closed stdout (`kunci top | head`) ends the watch quietly.
        if stdout
            .write_all(text.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return exit::DONE;
        }
        lines += 1;
        if options.count.is_some_and(|count| lines >= count) {
            return exit::DONE;
        }
        previous = Some((at, counters));
        next_at += options.interval;
        let now = Instant::now();
        if next_at > now {
            std::thread::sleep(next_at - now);
        } else {
            next_at = now;
        }
    }
}

/// The numeric `name=value` pairs of an `I` line.
struct Counters(HashMap<String, u64>);

impl Counters {
    fn parse(line: &str) -> Counters {
        Counters(
            line.split_ascii_whitespace()
                .filter_map(|pair| pair.split_once('='))
                .filter_map(|(name, value)| Some((name.to_owned(), value.parse().ok()?)))
                .collect(),
        )
    }

    fn get(&self, name: &str) -> Option<u64> {
        self.0.get(name).copied()
    }
}

fn header() -> String {
    let mut text = String::new();
    for (_, title) in GAUGES.iter().chain(&RATES) {
        text.push_str(&format!("{title:>11}"));
    }
    text.push('\n');
    text
}

/// One line: the gauges of `now`, and the counters' growth per second
/// since `before` (an elapsed time and the counters then).
fn row(now: &Counters, before: Option<(Duration, &Counters)>) -> String {
    let mut text = String::new();
    for (name, _) in GAUGES {
        let value = now
            .get(name)
            .map_or_else(|| "?".to_owned(), |v| v.to_string());
        text.push_str(&format!("{value:>11}"));
    }
    for (name, _) in RATES {
        let rate = match (now.get(name), before) {
            (Some(value), Some((elapsed, old))) if !elapsed.is_zero() => {
                let grown = value.saturating_sub(old.get(name).unwrap_or(value));
                rate_text(grown, elapsed)
            }
            (Some(_), _) => "-".to_owned(),
            (None, _) => "?".to_owned(),
        };
        text.push_str(&format!("{rate:>11}"));
    }
    text.push('\n');
    text
}

/// A rate with one decimal below 10 per second, whole above.
fn rate_text(count: u64, elapsed: Duration) -> String {
    let (numerator, denominator) = crate::decimal::per_second(count, elapsed);
    // Below 9.95 per second, one decimal.
    if numerator.saturating_mul(100) < denominator.saturating_mul(995) {
        crate::decimal::fixed(numerator, denominator, 1)
    } else {
        crate::decimal::fixed(numerator, denominator, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_show_gauges_and_rates_per_second() {
        let before = Counters::parse(
            "version=0.1.0 held=1 keys=2 grants=100 timeouts=5 busy=0 expired=0 errors=0 waiters=0 connections=3",
        );
        let now = Counters::parse(
            "version=0.1.0 held=4 keys=5 grants=1100 timeouts=6 busy=0 expired=3 errors=0 waiters=7 connections=3",
        );
        assert_eq!(
            header(),
            "       held       keys    waiters      conns   grants/s timeouts/s     busy/s  expired/s   errors/s\n"
        );
        assert_eq!(
            row(&before, None),
            "          1          2          0          3          -          -          -          -          -\n"
        );
        assert_eq!(
            row(&now, Some((Duration::from_millis(500), &before))),
            "          4          5          7          3       2000        2.0        0.0        6.0        0.0\n"
        );
        let missing = Counters::parse("held=1");
        assert!(row(&missing, None).contains("?"));
    }
}
