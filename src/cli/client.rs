//! The client commands: `acquire`, `release`, `renew`, `query`, `info`,
//! `ping`, and the option parsing `run` shares with them.

use std::ffi::OsString;
use std::io::Write as _;
use std::time::Duration;

use super::args;
use super::exit;
use crate::addr::{Address, DEFAULT_ADDRESS};
use crate::client::{Client, Config, Error};

/// The environment variable that names the servers when `--server` is not
/// given: addresses separated by commas.
pub const SERVER_ENV: &str = "KUNCI_SERVER";

const SERVER_HELP: &str = "\
  --server ADDR   a server address: HOST:PORT or unix:PATH; repeat for
                  several addresses of the same service (default: $KUNCI_SERVER,
                  comma-separated, else 127.0.0.1:5862)";

/// Options of the client commands. Each command accepts only some of them.
pub(super) struct Options {
    pub servers: Vec<Address>,
    pub wait: Duration,
    pub lease: Duration,
    pub kill_after: Duration,
    pub positionals: Vec<String>,
    /// `run`: the command and its arguments, untouched.
    pub command: Vec<OsString>,
}

/// Which options a command takes.
#[derive(Clone, Copy)]
pub(super) struct Accepts {
    pub wait: bool,
    pub lease: bool,
    pub kill_after: bool,
    /// Positional arguments, by name (for messages).
    pub positionals: &'static [&'static str],
    /// Everything after the positionals is a command to run.
    pub command: bool,
}

/// What parsing found: options to run with, or a request for help.
pub(super) enum Parsed {
    Run(Options),
    Help,
}

/// Parses a client command's arguments.
pub(super) fn parse(arguments: Vec<OsString>, accepts: Accepts) -> Result<Parsed, String> {
    use lexopt::prelude::*;
    let mut options = Options {
        servers: Vec::new(),
        wait: Duration::ZERO,
        lease: Duration::from_secs(30),
        kill_after: Duration::from_secs(5),
        positionals: Vec::new(),
        command: Vec::new(),
    };
    let mut parser = lexopt::Parser::from_args(arguments);
    while let Some(argument) = parser.next().map_err(|e| e.to_string())? {
        match argument {
            Long("server") => options.servers.push(args::address(parser.value())?),
            Long("wait") if accepts.wait => {
                options.wait = args::seconds("--wait", &args::text(parser.value())?)?
            }
            Long("lease") if accepts.lease => {
                options.lease = args::seconds("--lease", &args::text(parser.value())?)?
            }
            Long("kill-after") if accepts.kill_after => {
                options.kill_after = args::seconds("--kill-after", &args::text(parser.value())?)?
            }
            Short('h') | Long("help") => return Ok(Parsed::Help),
            Value(value) if options.positionals.len() < accepts.positionals.len() => {
                let text = value
                    .into_string()
                    .map_err(|v| format!("not valid UTF-8: {v:?}"))?;
                options.positionals.push(text);
            }
            Value(value) if accepts.command => {
                options.command.push(value);
                options
                    .command
                    .extend(parser.raw_args().map_err(|e| e.to_string())?);
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    if let Some(missing) = accepts.positionals.get(options.positionals.len()) {
        return Err(format!("missing {missing}"));
    }
    if accepts.command && options.command.is_empty() {
        return Err("missing the command to run (after --)".into());
    }
    if options.servers.is_empty() {
        options.servers = default_servers()?;
    }
    Ok(Parsed::Run(options))
}

/// `$KUNCI_SERVER` (comma-separated), else the default address.
fn default_servers() -> Result<Vec<Address>, String> {
    let text = match std::env::var(SERVER_ENV) {
        Ok(text) if !text.trim().is_empty() => text,
        _ => DEFAULT_ADDRESS.to_owned(),
    };
    text.split(',')
        .map(|address| {
            address
                .trim()
                .parse()
                .map_err(|e: crate::addr::AddressError| format!("{SERVER_ENV}: {e}"))
        })
        .collect()
}

/// A client for one-shot commands: one session per address is enough.
pub(super) fn client(servers: Vec<Address>) -> Result<Client, String> {
    let config = Config {
        sessions_per_server: 1,
        ..Config::default()
    };
    Client::new(servers, config).map_err(|e| format!("cannot start the client: {e}"))
}

/// The exit code for an outcome (spec §9).
pub(super) fn exit_code(error: &Error) -> u8 {
    match error {
        Error::Timeout => exit::TIMEOUT,
        Error::InvalidArgument(_) => exit::USAGE,
        Error::Busy => exit::BUSY,
        Error::Unavailable(_) => exit::UNAVAILABLE,
        Error::Indeterminate => exit::INDETERMINATE,
        Error::NotHeld => exit::NOT_HELD,
    }
}

/// Reports a failed outcome on stderr and returns its exit code.
pub(super) fn fail(command: &str, error: Error, servers: &[Address]) -> u8 {
    match error {
        Error::Unavailable(crate::client::Unavailable::Unreachable) => {
            let servers: Vec<String> = servers.iter().map(ToString::to_string).collect();
            eprintln!(
                "kunci {command}: {error} (tried {}; RUST_LOG=debug shows why)",
                servers.join(", ")
            );
        }
        _ => eprintln!("kunci {command}: {error}"),
    }
    exit_code(&error)
}

fn usage_error(command: &str, message: &str) -> u8 {
    eprintln!("kunci {command}: {message}\n(see kunci {command} --help)");
    exit::USAGE
}

/// Starts logging for the client commands: warnings by default.
pub(super) fn init_logging() {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .try_init();
}

struct Command {
    name: &'static str,
    accepts: Accepts,
    help: &'static str,
    run: fn(&Client, &Options) -> Result<String, Error>,
}

const NONE: Accepts = Accepts {
    wait: false,
    lease: false,
    kill_after: false,
    positionals: &[],
    command: false,
};

const COMMANDS: &[Command] = &[
    Command {
        name: "acquire",
        accepts: Accepts {
            wait: true,
            lease: true,
            positionals: &["KEY"],
            ..NONE
        },
        help: "\
kunci acquire — take a lock and print its fencing token

Usage: kunci acquire KEY [--wait S] [--lease S] [--server ADDR]...

Prints the token as one decimal number and exits 0, leaving the lock held
until its lease runs out or `kunci release KEY TOKEN`.

Options:
  --wait S        how long to wait for the key, in seconds, decimals allowed,
                  at most 255 (default 0: one immediate attempt)
  --lease S       the lease, whole seconds 1..=255 (default 30)
",
        run: |client, options| {
            let ticket = client.acquire(&options.positionals[0], options.wait, options.lease)?;
            Ok(ticket.into_token().to_string())
        },
    },
    Command {
        name: "release",
        accepts: Accepts {
            positionals: &["KEY", "TOKEN"],
            ..NONE
        },
        help: "\
kunci release — release a lock by its exact token

Usage: kunci release KEY TOKEN [--server ADDR]...

Exits 0 when released, 6 when that token is not the key's active grant.

Options:
",
        run: |client, options| {
            client.release(&options.positionals[0], token(&options.positionals[1])?)?;
            Ok("released".into())
        },
    },
    Command {
        name: "renew",
        accepts: Accepts {
            lease: true,
            positionals: &["KEY", "TOKEN"],
            ..NONE
        },
        help: "\
kunci renew — reset a lock's lease, by its exact token

Usage: kunci renew KEY TOKEN [--lease S] [--server ADDR]...

Exits 0 when renewed, 6 when that token is not the key's active grant.

Options:
  --lease S       the new lease from now, whole seconds 1..=255 (default 30)
",
        run: |client, options| {
            let token = token(&options.positionals[1])?;
            client.renew(&options.positionals[0], token, options.lease)?;
            Ok("renewed".into())
        },
    },
    Command {
        name: "query",
        accepts: Accepts {
            positionals: &["KEY"],
            ..NONE
        },
        help: "\
kunci query — show who holds a key

Usage: kunci query KEY [--server ADDR]...

Prints `free`, or `held token=… owner=… lease_ms=… waiters=…`.

Options:
",
        run: |client, options| {
            let status = client.query(&options.positionals[0])?;
            Ok(if status.is_free() {
                "free".into()
            } else {
                format!(
                    "held token={} owner={} lease_ms={} waiters={}",
                    status.token, status.owner, status.lease_ms, status.waiters
                )
            })
        },
    },
    Command {
        name: "info",
        accepts: NONE,
        help: "\
kunci info — show the server's counters

Usage: kunci info [--server ADDR]...

Prints the server's `I` line: name=value pairs separated by spaces.

Options:
",
        run: |client, _| client.info(),
    },
    Command {
        name: "ping",
        accepts: NONE,
        help: "\
kunci ping — measure the round-trip time to the server

Usage: kunci ping [--server ADDR]...

Prints the time from writing a `P` to reading its answer.

Options:
",
        run: |client, _| {
            let round_trip = client.ping()?;
            Ok(format!("{:.3} ms", round_trip.as_secs_f64() * 1000.0))
        },
    },
];

/// A token argument: a decimal u64.
fn token(text: &str) -> Result<u64, Error> {
    text.parse()
        .map_err(|_| Error::InvalidArgument("TOKEN must be a decimal number"))
}

/// Whether `name` is one of the commands here.
pub(super) fn is_command(name: &str) -> bool {
    COMMANDS.iter().any(|command| command.name == name)
}

/// Runs client command `name` and returns its exit code.
pub(super) fn main(name: &str, arguments: Vec<OsString>) -> u8 {
    let Some(command) = COMMANDS.iter().find(|command| command.name == name) else {
        return usage_error(name, "unknown command");
    };
    let options = match parse(arguments, command.accepts) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Help) => {
            println!("{}{SERVER_HELP}", command.help);
            return exit::DONE;
        }
        Err(message) => return usage_error(name, &message),
    };
    init_logging();
    let client = match client(options.servers.clone()) {
        Ok(client) => client,
        Err(message) => {
            eprintln!("kunci {name}: {message}");
            return exit::UNAVAILABLE;
        }
    };
    match (command.run)(&client, &options) {
        Ok(line) => {
            // A closed stdout (`kunci acquire k | true`) is not an error.
            let _ = writeln!(std::io::stdout(), "{line}");
            exit::DONE
        }
        Err(error) => fail(name, error, &options.servers),
    }
}

/// The help of `kunci run`, with the shared `--server` lines.
pub(super) fn with_server_help(help: &str) -> String {
    format!("{help}{SERVER_HELP}")
}
