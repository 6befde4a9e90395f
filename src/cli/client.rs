//! The client commands: `acquire`, `release`, `renew`, `proclaim`,
//! `query`, `who`, `list`, `info`, `ping`, as a table of what each
//! accepts, prints and runs, and their dispatch. Their options are in `options.rs` and what they print when
//! a call fails in `messages.rs`; both are handed on from here to `run`,
//! `elect`, `top` and `bench`.

use std::ffi::OsString;
use std::io::Write;

use super::exit;
use super::permits;
use crate::client::{Client, Error};

use super::messages::usage_error;
use super::options::{Options, is_etcd};
use crate::addr::EtcdLayout;

// What `run`, `elect`, `top` and `bench` take from the client commands.
pub(super) use super::messages::{Attempt, grace_note, init_logging, message, report};
#[cfg(feature = "tls")]
pub(super) use super::options::tls_files;
pub(super) use super::options::{
    Accepts, Parsed, SECRET_ENV, SERVER_HELP, TlsOptions, acquire, call_deadline,
    check_plaintext_secret, check_servers, check_tls, client, default_servers, parse, secret,
    server_option, tls_option, with_plain_server_help, with_server_help,
};

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
  --wait S        how long to wait for the key, in seconds, at most 255
                  (default 0: one immediate attempt); decimals are sent
                  rounded up to whole seconds, so 0.5 may wait 1 s; `inf`
                  waits until acquired, queueing again for 255 s each time
                  a wait runs out (the place in the queue is not kept),
                  and through a server restart or outage
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
        name: "proclaim",
        accepts: Accepts {
            positionals: &["NAME", "TOKEN", "VALUE"],
            ..NONE
        },
        help: "\
kunci proclaim — change a leader's value, keeping its term

Usage: kunci proclaim NAME TOKEN VALUE [--server ADDR]...

Sets the value (the label) of the grant TOKEN of the election (or key)
NAME to VALUE (1..=128 bytes, no newline) and changes nothing else: not
the term, not the lease, not the time in office (spec §13.4a, etcd's
Proclaim). Observers (`kunci leader --watch`) see the new value with the
same term. Exits 0 when set, 6 when TOKEN does not hold NAME (the lead is
lost), 2 for a VALUE that is empty, too long or has a newline.

Options:
",
        run: |client, options, out| {
            let token = token(&options.positionals[1])?;
            let value = &options.positionals[2];
            if value.is_empty() {
                return Err(Error::InvalidArgument("VALUE is empty"));
            }
            client.proclaim(&options.positionals[0], token, value)?;
            say(out, "proclaimed")
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

Prints `free`, or `held token=… owner=… lease_ms=… waiters=… grants=…`
(the first grant's token and owner; grants counts them all). After the
server restarted from a crash, a key counts as held until every lease of
its previous run may have run out: then it prints `held by an unknown
grant of the server's previous run (crash grace) lease_ms=… waiters=…`.

Options:
",
        run: |client, options, out| {
            let status = client.query(&options.positionals[0])?;
            if status.is_free() {
                say(out, "free")
            } else if status.token == 0 {
                // Spec §7.2: no grant of this run; the crash grace.
                say(
                    out,
                    format_args!(
                        "held by an unknown grant of the server's previous run (crash grace) \
                         lease_ms={} waiters={}",
                        status.lease_ms, status.waiters
                    ),
                )
            } else {
                // `Q` names the first grant only; a semaphore or a shared
                // lock may have more.
                let grants = client.holders(&options.positionals[0])?.grants.len();
                say(
                    out,
                    format_args!(
                        "held token={} owner={} lease_ms={} waiters={} grants={grants}",
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
is `free`. Times are in seconds. On etcd:// the time held and the wait
left are `unknown` (null in JSON), and the lease left is in whole seconds
(docs/ETCD.md); with ?layout=etcd it shows etcd's own holders too
(`etcdctl lock`, Go's Mutex): owner 0, their value as the label.

Options:
  --json          one JSON object: {\"key\", \"limit\", \"left_out\", \"grants\":
                  [{\"token\", \"owner\", \"lease_ms\", \"held_ms\", \"take\",
                  \"label\"}], \"waiters\": [{\"owner\", \"wait_ms\", \"take\",
                  \"label\"}]}; token and owner are 64-bit, so they are
                  strings (\"42\"), which every JSON reader keeps exact;
                  take 0 is every permit, limit 0 is none; left_out counts
                  the grants and waiters the server did not list (it lists
                  at most 1000 of each)
",
        run: |client, options, out| {
            let etcd_layout = EtcdLayout::of(&options.servers) == Ok(EtcdLayout::Etcd);
            let etcd = (is_etcd(&options.servers), etcd_layout);
            super::who::who(client, &options.positionals[0], options.json, etcd, out)
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
entry of the cluster, 1000 at a time (docs/ETCD.md); with ?layout=etcd
there is no listing (exit 2): those locks may be anywhere in etcd's keys.

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
                format_args!("{} ms", crate::decimal::millis(round_trip, 3)),
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
/// The names of the client commands.
pub(super) fn command_names() -> impl Iterator<Item = &'static str> {
    COMMANDS.iter().map(|command| command.name)
}

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
    let client = match client(
        options.servers.clone(),
        options.secret.clone(),
        &options.tls,
    ) {
        Ok(client) => client,
        Err(message) => {
            eprintln!("kunci {name}: {message}");
            return exit::UNAVAILABLE;
        }
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let deadline = call_deadline(&options);
    let done = (command.run)(&client, &options, &mut out);
    let _ = out.flush();
    match done {
        Ok(()) => exit::DONE,
        Err(Error::Timeout) if name == "acquire" => {
            let key = &options.positionals[0];
            let attempt = Attempt {
                key: Some(key),
                wait: Some(options.wait),
                token: None,
                permits: options.acquire.get_permits().key_limit().is_some(),
                connect_failure: None,
            };
            let why = message(name, &Error::Timeout, &options.servers, &attempt);
            let note = grace_note(&client, key, deadline);
            eprintln!("kunci {name}: timeout: {why}{note}");
            exit::TIMEOUT
        }
        Err(error) => {
            let connect_failure = client.last_connect_failure();
            let attempt = Attempt {
                key: command
                    .accepts
                    .positionals
                    .first()
                    .filter(|name| matches!(**name, "KEY" | "NAME"))
                    .and_then(|_| options.positionals.first())
                    .map(String::as_str),
                wait: command.accepts.wait.then_some(options.wait),
                token: options
                    .positionals
                    .get(1)
                    .and_then(|text| text.parse().ok()),
                permits: false,
                connect_failure: connect_failure.as_deref(),
            };
            report(name, error, &options.servers, &attempt)
        }
    }
}
