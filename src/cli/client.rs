//! The client commands: `acquire`, `release`, `renew`, `query`, `info`,
//! `ping`, and the option parsing `run` shares with them.

use std::ffi::OsString;
use std::io::Write;
use std::time::Duration;

use super::args;
use super::exit;
use super::permits::{self, PermitFlags};
use crate::addr::{Address, DEFAULT_ADDRESS};
use crate::client::{AcquireOptions, Client, Config, Error, Ticket, WAIT_MAX};

/// The environment variable that names the servers when `--server` is not
/// given: addresses separated by commas.
pub const SERVER_ENV: &str = "KUNCI_SERVER";

// Not a `\`-continued literal: that would strip the first line's indent.
const SERVER_HELP: &str = "  --server ADDR   a server address: HOST:PORT or unix:PATH; repeat for
                  several addresses of the same service (default:
                  $KUNCI_SERVER, comma-separated, else 127.0.0.1:5862);
                  etcd://HOST:PORT[,HOST:PORT]... takes the locks on an
                  etcd cluster instead (docs/ETCD.md)
  -h, --help      show this help
";

/// Options of the client commands. Each command accepts only some of them.
pub(super) struct Options {
    pub servers: Vec<Address>,
    pub wait: Duration,
    /// `--wait inf`: wait until acquired.
    pub wait_forever: bool,
    /// `run`: the exit status when the key stayed held (`--conflict-exit-code`).
    pub conflict_exit_code: u8,
    /// `run`: no message on stderr for a timeout (`--quiet`).
    pub quiet: bool,
    pub lease: Duration,
    /// `acquire`, `run`: the permits and the label to ask with.
    pub acquire: AcquireOptions,
    pub kill_after: Duration,
    pub positionals: Vec<String>,
    /// `who`, `list`: JSON instead of text.
    pub json: bool,
    /// `run`: the command and its arguments, untouched.
    pub command: Vec<OsString>,
}

/// Which options a command takes.
#[derive(Clone, Copy)]
pub(super) struct Accepts {
    pub wait: bool,
    pub lease: bool,
    pub kill_after: bool,
    /// `--conflict-exit-code` and `--quiet`.
    pub conflict: bool,
    /// `--limit`, `--take`, `--shared`, `--exclusive`, `--label`.
    pub permits: bool,
    /// `--json` (`who`, `list`).
    pub json: bool,
    /// Positional arguments, by name (for messages).
    pub positionals: &'static [&'static str],
    /// How many of the positionals may be left out (the last ones).
    pub optional: usize,
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
        wait_forever: false,
        conflict_exit_code: exit::TIMEOUT,
        quiet: false,
        lease: Duration::from_secs(30),
        acquire: AcquireOptions::new(),
        kill_after: Duration::from_secs(5),
        positionals: Vec::new(),
        json: false,
        command: Vec::new(),
    };
    let mut permit_flags = PermitFlags::default();
    let mut parser = lexopt::Parser::from_args(arguments);
    while let Some(argument) = parser.next().map_err(|e| e.to_string())? {
        match argument {
            Long("server") => options.servers.push(args::address(parser.value())?),
            Long("wait") if accepts.wait => {
                let text = args::text(parser.value())?;
                options.wait_forever = text == "inf";
                options.wait = if options.wait_forever {
                    WAIT_MAX
                } else {
                    args::seconds("--wait", &text)?
                };
            }
            Long("lease") if accepts.lease => {
                options.lease = args::seconds("--lease", &args::text(parser.value())?)?
            }
            Long("kill-after") if accepts.kill_after => {
                options.kill_after = args::seconds("--kill-after", &args::text(parser.value())?)?
            }
            Short('E') | Long("conflict-exit-code") if accepts.conflict => {
                options.conflict_exit_code = args::number("--conflict-exit-code", parser.value())?
            }
            Short('q') | Long("quiet") if accepts.conflict => options.quiet = true,
            Long("json") if accepts.json => options.json = true,
            Long(name) if accepts.permits && PermitFlags::is_option(name) => {
                let name = name.to_owned();
                permit_flags.take_option(&name, &mut parser)?;
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
    let required = accepts.positionals.len() - accepts.optional;
    if let Some(missing) = accepts.positionals[..required].get(options.positionals.len()) {
        return Err(format!("missing {missing}"));
    }
    if accepts.command && options.command.is_empty() {
        return Err("missing the command to run (after --)".into());
    }
    if accepts.permits {
        // `kunci run` labels its grant with who runs what, unless told.
        let default_label = accepts
            .command
            .then(|| permits::run_label(&options.command));
        options.acquire = permit_flags.options(default_label)?;
    }
    if options.servers.is_empty() {
        options.servers = default_servers()?;
    }
    Ok(Parsed::Run(options))
}

/// `$KUNCI_SERVER` (comma-separated), else the default address.
pub(super) fn default_servers() -> Result<Vec<Address>, String> {
    let text = match std::env::var(SERVER_ENV) {
        Ok(text) if !text.trim().is_empty() => text,
        _ => DEFAULT_ADDRESS.to_owned(),
    };
    // An etcd address lists its members with commas itself.
    if text.trim().starts_with("etcd://") {
        return text
            .trim()
            .parse()
            .map(|address| vec![address])
            .map_err(|e: crate::addr::AddressError| format!("{SERVER_ENV}: {e}"));
    }
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
        Error::LimitMismatch { .. } => exit::USAGE,
    }
}

/// What a failed command was doing, so its message can say it exactly.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Attempt<'a> {
    pub key: Option<&'a str>,
    /// The acquire's wait (`None` for other requests).
    pub wait: Option<Duration>,
    pub token: Option<u64>,
}

/// Reports a failed outcome of `attempt` on stderr — its name (which the
/// exit code also tells), what happened and what to do — and returns its
/// exit code.
pub(super) fn report(command: &str, error: Error, servers: &[Address], attempt: &Attempt) -> u8 {
    let outcome = match error {
        Error::Timeout => "timeout",
        Error::Busy => "busy",
        Error::Unavailable(_) => "unavailable",
        Error::Indeterminate => "indeterminate",
        Error::InvalidArgument(_) => "invalid argument",
        Error::NotHeld => "not held",
        Error::LimitMismatch { .. } => "limit mismatch",
    };
    eprintln!(
        "kunci {command}: {outcome}: {}",
        message(command, &error, servers, attempt)
    );
    exit_code(&error)
}

/// The message for a failed outcome (without the `kunci COMMAND: ` prefix).
pub(super) fn message(
    command: &str,
    error: &Error,
    servers: &[Address],
    attempt: &Attempt,
) -> String {
    let key = attempt
        .key
        .map_or_else(|| "the key".to_owned(), |key| format!("key {key:?}"));
    let token = attempt
        .token
        .map_or_else(|| "the token".to_owned(), |token| format!("token {token}"));
    let is_lock_request = matches!(command, "acquire" | "run");
    match error {
        Error::Timeout => match attempt.wait {
            Some(wait) if wait.is_zero() => format!(
                "{key} is held by someone else; nothing was acquired \
                 (--wait 0 tries once; --wait S waits up to S seconds)"
            ),
            Some(wait) => format!(
                "{key} stayed held by someone else for the whole wait ({}); \
                 nothing was acquired",
                seconds_text(wait)
            ),
            None => format!("{key} is held by someone else; nothing was acquired"),
        },
        Error::Busy => "the server turned the request away: it is at a capacity limit \
             (--max-keys, --max-waiters, --max-waiters-per-key, --max-waits-per-conn) \
             or shutting down; nothing was acquired or queued. Try again later"
            .to_owned(),
        Error::Unavailable(crate::client::Unavailable::ConnectionLimit) => {
            "the server is at its connection limit (--max-connections) and refused \
             the session; nothing was executed. Try again later, or raise its limit"
                .to_owned()
        }
        Error::Unavailable(crate::client::Unavailable::NotAllowed) => {
            "the server does not allow this host (--allow) and refused the session; \
             nothing was executed. Add this host's network to its --allow list"
                .to_owned()
        }
        Error::Unavailable(crate::client::Unavailable::Unreachable) => {
            let servers: Vec<String> = servers.iter().map(ToString::to_string).collect();
            format!(
                "no server took the request (tried {}); nothing was sent, so nothing \
                 changed. Check that kunci serve runs there and lets this host in \
                 (--allow, --max-connections); RUST_LOG=debug shows each attempt",
                servers.join(", ")
            )
        }
        Error::Indeterminate if is_lock_request => format!(
            "no answer came in time, so whether {key} was granted is unknown: do not \
             assume the lock is held. A grant nobody saw ends with its lease"
        ),
        Error::Indeterminate if matches!(command, "release" | "renew") => format!(
            "no answer came in time, so whether {token} was {} is unknown; \
             `kunci query` shows the key's holder",
            if command == "release" {
                "released"
            } else {
                "renewed"
            }
        ),
        Error::Indeterminate => {
            "the server did not answer in time (the request may have reached it)".to_owned()
        }
        Error::InvalidArgument(why) => format!("{why} (see kunci {command} --help)"),
        Error::NotHeld if command == "renew" => format!(
            "{token} does not hold {key} (its lease ran out, it was released, or it \
             never held it): the lock is lost; nothing changed"
        ),
        Error::NotHeld => format!(
            "{token} does not hold {key} (its lease ran out, it was released, or it \
             never held it); nothing changed"
        ),
        Error::LimitMismatch {
            key_limit: Some(limit),
        } => format!(
            "{key} has a limit of {limit} permits, not the one this request named; \
             nothing was acquired or queued. Ask with --limit {limit} (a key keeps its \
             limit while it has grants or waiters)"
        ),
        Error::LimitMismatch { key_limit: None } => format!(
            "{key} has another limit of permits than the one this request named; \
             nothing was acquired or queued"
        ),
    }
}

/// A duration as the user typed it: `2.5 s`, `1 s`.
fn seconds_text(duration: Duration) -> String {
    let text = format!("{:.3}", duration.as_secs_f64());
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text} s")
}

fn usage_error(command: &str, message: &str) -> u8 {
    eprintln!("kunci {command}: {message}\n(see kunci {command} --help)");
    exit::USAGE
}

/// Starts logging for the client commands: warnings by default, each a
/// line `kunci: warning: …` like the commands' own messages.
pub(super) fn init_logging() {
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format(|out, record| {
            use std::io::Write as _;
            let level = match record.level() {
                log::Level::Error => "error",
                log::Level::Warn => "warning",
                log::Level::Info => "info",
                log::Level::Debug => "debug",
                log::Level::Trace => "trace",
            };
            writeln!(out, "kunci: {level}: {}", record.args())
        })
        .try_init();
}

struct Command {
    name: &'static str,
    accepts: Accepts,
    help: &'static str,
    /// Writes what the command prints on stdout to its third argument.
    run: fn(&Client, &Options, &mut dyn Write) -> Result<(), Error>,
}

/// Prints one line; a closed stdout (`kunci acquire k | true`) is not an
/// error.
fn say(out: &mut dyn Write, line: impl std::fmt::Display) -> Result<(), Error> {
    let _ = writeln!(out, "{line}");
    Ok(())
}

const NONE: Accepts = Accepts {
    wait: false,
    lease: false,
    kill_after: false,
    conflict: false,
    permits: false,
    json: false,
    positionals: &[],
    optional: 0,
    command: false,
};

const COMMANDS: &[Command] = &[
    Command {
        name: "acquire",
        accepts: Accepts {
            wait: true,
            lease: true,
            permits: true,
            positionals: &["KEY"],
            ..NONE
        },
        help: concat!(
            "\
kunci acquire — take a lock and print its fencing token

Usage: kunci acquire KEY [--wait S|inf] [--lease S]
                     [--limit N [--take K] | --shared | --exclusive]
                     [--label TEXT] [--server ADDR]...

Prints the token as one decimal number and exits 0, leaving the lock held
until its lease runs out or `kunci release KEY TOKEN`.

Options:
  --wait S        how long to wait for the key, in seconds, decimals allowed,
                  at most 255 (default 0: one immediate attempt); `inf`
                  waits until acquired, queueing again for 255 s each time
                  a wait runs out (the place in the queue is not kept)
  --lease S       the lease, whole seconds 1..=255 (default 30)
",
            permits::options_help!(),
            "
"
        ),
        run: |client, options, out| {
            let ticket = acquire(client, &options.positionals[0], options)?;
            say(out, ticket.into_token())
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
        run: |client, options, out| {
            client.release(&options.positionals[0], token(&options.positionals[1])?)?;
            say(out, "released")
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
        run: |client, options, out| {
            let token = token(&options.positionals[1])?;
            client.renew(&options.positionals[0], token, options.lease)?;
            say(out, "renewed")
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
        run: |client, options, out| {
            let status = client.query(&options.positionals[0])?;
            if status.is_free() {
                say(out, "free")
            } else {
                say(
                    out,
                    format_args!(
                        "held token={} owner={} lease_ms={} waiters={}",
                        status.token, status.owner, status.lease_ms, status.waiters
                    ),
                )
            }
        },
    },
    Command {
        name: "who",
        accepts: Accepts {
            json: true,
            positionals: &["KEY"],
            ..NONE
        },
        help: "\
kunci who — show who holds a key and who waits for it

Usage: kunci who KEY [--json] [--server ADDR]...

Prints the key's limit, then its grants (token, owner, permits taken,
lease left, time held, label) oldest first, then its waiters in queue
order (owner, permits, wait left, label). A key nobody holds or waits for
is `free`. On etcd:// the time held and the wait left are unknown and
shown as 0, and the lease left is in whole seconds (docs/ETCD.md).

Options:
  --json          one JSON object: {\"key\", \"limit\", \"grants\": [{\"token\",
                  \"owner\", \"lease_ms\", \"held_ms\", \"take\", \"label\"}],
                  \"waiters\": [{\"owner\", \"wait_ms\", \"take\", \"label\"}]};
                  take 0 is every permit, limit 0 is none
",
        run: |client, options, out| {
            super::who::who(client, &options.positionals[0], options.json, out)
        },
    },
    Command {
        name: "list",
        accepts: Accepts {
            json: true,
            positionals: &["PREFIX"],
            optional: 1,
            ..NONE
        },
        help: "\
kunci list — list the keys the server has

Usage: kunci list [PREFIX] [--json] [--server ADDR]...

Prints one line per key that starts with PREFIX (default: every key):
the key, its number of grants and of waiters, and its limit of permits.
The server hands the table out 1000 keys at a time; a key that was there
for the whole listing is printed at least once, and a key may be printed
twice when the table grew meanwhile. On etcd:// it reads every kunci
entry of the cluster, 1000 at a time (docs/ETCD.md).

Options:
  --json          one JSON object per line: {\"key\", \"grants\", \"waiters\",
                  \"limit\"} (limit 0 is none)
",
        run: |client, options, out| {
            let prefix = options.positionals.first().map_or("", String::as_str);
            super::who::list(client, prefix, options.json, out)
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
        run: |client, _, out| say(out, client.info()?),
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
        run: |client, _, out| {
            let round_trip = client.ping()?;
            say(
                out,
                format_args!("{:.3} ms", round_trip.as_secs_f64() * 1000.0),
            )
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
            print!("{}{SERVER_HELP}", command.help);
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
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let done = (command.run)(&client, &options, &mut out);
    let _ = out.flush();
    match done {
        Ok(()) => exit::DONE,
        Err(error) => {
            let attempt = Attempt {
                key: command
                    .accepts
                    .positionals
                    .first()
                    .filter(|name| **name == "KEY")
                    .and_then(|_| options.positionals.first())
                    .map(String::as_str),
                wait: command.accepts.wait.then_some(options.wait),
                token: options
                    .positionals
                    .get(1)
                    .and_then(|text| text.parse().ok()),
            };
            report(name, error, &options.servers, &attempt)
        }
    }
}

/// The help of `kunci run`, with the permit options and the shared
/// `--server` lines (no final newline: the caller prints a line).
pub(super) fn with_server_help(help: &str) -> String {
    format!(
        "{help}{}\n{}",
        permits::options_help!(),
        SERVER_HELP.trim_end()
    )
}

/// Acquires `key` with the options' wait and lease. `--wait inf` queues
/// with the longest wire wait (255 s) again each time one runs out.
pub(super) fn acquire(client: &Client, key: &str, options: &Options) -> Result<Ticket, Error> {
    if options.wait_forever {
        acquire_until_granted(client, key, options.lease, &options.acquire, WAIT_MAX)
    } else {
        client.acquire_with(key, options.wait, options.lease, options.acquire.clone())
    }
}

/// Acquires `key`, waiting `slice` at a time until it is granted or an
/// outcome other than `Timeout` ends it. Each attempt is a new request at
/// the tail of the queue: the place is not kept across attempts.
fn acquire_until_granted(
    client: &Client,
    key: &str,
    lease: Duration,
    acquire: &AcquireOptions,
    slice: Duration,
) -> Result<Ticket, Error> {
    loop {
        match client.acquire_with(key, slice, lease, acquire.clone()) {
            Err(Error::Timeout) => log::debug!("{key}: still held after {slice:?}; queueing again"),
            outcome => return outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::server::{Config as ServerConfig, Server};

    #[test]
    fn waiting_forever_queues_again_each_time_a_wait_runs_out() {
        let listen = vec!["127.0.0.1:0".parse().unwrap()];
        let server = Server::bind(ServerConfig {
            listen,
            ..Default::default()
        })
        .unwrap();
        let address = server.addresses()[0].clone();
        let stop = server.shutdown_handle();
        let running = std::thread::spawn(move || server.run());
        let client = Client::new([address], Config::default()).unwrap();
        let holder = client
            .acquire("forever", Duration::ZERO, Duration::from_secs(30))
            .unwrap();
        let started = Instant::now();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2500));
            holder.release().unwrap();
        });
        // A one-second slice stands in for 255 s: two waits run out (two
        // `T`), the third attempt is granted when the holder lets go.
        let ticket = acquire_until_granted(
            &client,
            "forever",
            Duration::from_secs(5),
            &AcquireOptions::new(),
            Duration::from_secs(1),
        )
        .unwrap();
        let waited = started.elapsed();
        releaser.join().unwrap();
        assert!(waited >= Duration::from_millis(2500), "{waited:?}");
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        let info = client.info().unwrap();
        for counter in ["timeouts=2", "grants=2", "released=1"] {
            assert!(
                info.split(' ').any(|pair| pair == counter),
                "{counter}: {info}"
            );
        }
        ticket.release().unwrap();
        // Other outcomes end the wait at once.
        assert_eq!(
            acquire_until_granted(
                &client,
                "",
                Duration::from_secs(5),
                &AcquireOptions::new(),
                Duration::from_secs(1)
            )
            .unwrap_err(),
            Error::InvalidArgument("key is empty")
        );
        stop.shut_down();
        running.join().unwrap().unwrap();
    }
}
