//! `kunci serve`: parse the flags, bind, log one start-up line, run.

use std::ffi::OsString;

use log::{error, info, warn};

use super::args;
use super::exit;
use crate::core::Limits;
use crate::core::access::AccessList;
use crate::server::state_location::{self, StateLocation};
use crate::server::{Config, Server};

fn help() -> String {
    let defaults = Config::default();
    let limits = defaults.limits;
    format!(
        "\
kunci serve — run the lock server

Usage: kunci serve [--listen ADDR]... [options]

Options:
  --listen ADDR               where to listen: HOST:PORT, tls://HOST:PORT or
                              unix:PATH; repeat for several (default {listen}:
                              loopback only). Port 0 picks a free port; the
                              start-up log line names it.
  --tls-cert FILE             certificate chain (PEM) of the tls:// listeners
  --tls-key FILE              its private key (PEM)
  --tls-client-ca FILE        require on the tls:// listeners a client
                              certificate signed by this CA (PEM)
  --max-keys N                keys in the table, held or waited on
                              (default {max_keys}; ~62 B each)
  --max-waiters N             queued waiters in total (default {max_waiters};
                              ~56 B each)
  --max-waiters-per-key N     queued waiters on one key (default {per_key})
  --max-waits-per-conn N      queued waits one connection may have
                              (default {per_conn})
  --max-watches N             held watches (O, followed keys) in total, apart
                              from the waiters; one more gets `X 14` (default
                              {max_watches}; ~56 B each, plus the key's bytes
                              and ~60 B once per watched key)
  --max-watches-per-conn N    held watches one connection may have (default
                              {watches_per_conn})
  --max-grants N              grants plus queued waiters across all keys
                              (semaphores and shared locks hold several
                              grants per key); one more gets `B` (default
                              --max-keys + --max-waiters; ~48 B per extra
                              shared holder)
  --max-connections N         open connections; one more gets `X 7` and is
                              closed (default {max_connections})
  --max-connections-per-peer N
                              open connections from one TCP peer address
                              (each IP on its own, 127.0.0.2 too; unix
                              socket peers are not limited); one more gets
                              `X 7` (default: half of --max-connections)
  --metrics ADDR              serve Prometheus metrics at http://ADDR/metrics
                              (HOST:PORT, or unix:PATH for HTTP over a unix
                              socket; default: none). No --allow applies:
                              bind it to loopback, a management network or a
                              unix socket.
  --allow CIDR                accept TCP peers only from this network
                              (e.g. 10.0.0.0/8, ::1/128); repeat for several.
                              Others are closed at once and counted as
                              `refused`. Default: anyone who can connect.
  --auth FILE                 require every session to authenticate first
                              (U with a secret) and hold it to the scopes of
                              its line: NAME SHA256HEX SCOPE... per line,
                              scopes lock:PREFIX, read:PREFIX, info (PREFIX
                              * = every key). `kunci secret` makes a line.
                              Read at start only (default: no
                              authentication)
  --state-dir DIR             keep restart state in DIR (created 0700): a
                              clean stop saves every held grant and the next
                              start restores it; after a crash every key
                              counts as held for at most the longest
                              outstanding lease + 5 s unless its holder
                              renews it; tokens stay monotonic even if the
                              clock steps back. Default: $STATE_DIRECTORY
                              (systemd), else $XDG_STATE_HOME/kunci/ADDR or
                              ~/.local/state/kunci/ADDR, ADDR named after the
                              first --listen address
  --no-state-dir              keep nothing on disk: a crash then frees every
                              key at once (two holders for up to one lease)
                              and tokens rely on the wall clock
  --unix-mode MODE            permissions of unix: socket files, octal
                              (default {unix_mode:o})
  -h, --help                  show this help

Logging: RUST_LOG (default info) — one start-up line, then only problems.
SIGTERM / SIGINT / SIGHUP: waiters get `B`, connections `X 8`, held grants are
saved in the state directory, then exit 0.
",
        listen = defaults.listen[0],
        max_keys = limits.max_keys,
        max_waiters = limits.max_waiters,
        per_key = limits.max_waiters_per_key,
        per_conn = limits.max_waits_per_conn,
        max_watches = limits.max_watches,
        watches_per_conn = limits.max_watches_per_conn,
        max_connections = limits.max_connections,
        unix_mode = defaults.unix_mode,
    )
}

#[cfg(feature = "tls")]
fn tls_files(config: &mut Config) -> &mut crate::tls::ServerFiles {
    config.tls.get_or_insert_with(Default::default)
}

/// The parsed flags, and the `--auth` file to read once logging is set up.
struct Parsed {
    config: Config,
    auth: Option<std::path::PathBuf>,
}

fn parse(arguments: Vec<OsString>) -> Result<Option<Parsed>, String> {
    use lexopt::prelude::*;
    let mut config = Config::default();
    let mut auth = None;
    let mut listen = Vec::new();
    let mut max_grants = None;
    let mut no_state_dir = false;
    let mut parser = lexopt::Parser::from_args(arguments);
    while let Some(argument) = parser.next().map_err(|e| e.to_string())? {
        let limits: &mut Limits = &mut config.limits;
        match argument {
            Long("listen") => listen.push(args::listen_address(parser.value())?),
            Long("metrics") => config.metrics = Some(args::address(parser.value())?),
            Long("max-keys") => limits.max_keys = positive("--max-keys", parser.value())?,
            Long("max-waiters") => {
                limits.max_waiters = args::number("--max-waiters", parser.value())?
            }
            Long("max-waiters-per-key") => {
                limits.max_waiters_per_key = args::number("--max-waiters-per-key", parser.value())?
            }
            Long("max-waits-per-conn") => {
                limits.max_waits_per_conn = args::number("--max-waits-per-conn", parser.value())?
            }
            Long("max-watches") => {
                limits.max_watches = args::number("--max-watches", parser.value())?
            }
            Long("max-watches-per-conn") => {
                limits.max_watches_per_conn =
                    args::number("--max-watches-per-conn", parser.value())?
            }
            Long("max-connections") => {
                limits.max_connections = positive("--max-connections", parser.value())?
            }
            Long("max-connections-per-peer") => {
                config.max_connections_per_peer =
                    Some(positive("--max-connections-per-peer", parser.value())?)
            }
            Long("max-grants") => max_grants = Some(args::number("--max-grants", parser.value())?),
            Long("unix-mode") => {
                let text = args::text(parser.value())?;
                config.unix_mode = u32::from_str_radix(&text, 8)
                    .ok()
                    .filter(|mode| *mode <= 0o777)
                    .ok_or_else(|| format!("--unix-mode: invalid octal mode {text:?}"))?;
            }
            Long("allow") => {
                let text = args::text(parser.value())?;
                let network = text
                    .parse()
                    .map_err(|e: crate::addr::AddressError| format!("--allow: {e}"))?;
                config.allow.push(network);
            }
            Long("auth") => auth = Some(parser.value().map_err(|e| e.to_string())?.into()),
            #[cfg(feature = "tls")]
            Long("tls-cert") => tls_files(&mut config).cert = args::path(parser.value())?,
            #[cfg(feature = "tls")]
            Long("tls-key") => tls_files(&mut config).key = args::path(parser.value())?,
            #[cfg(feature = "tls")]
            Long("tls-client-ca") => {
                tls_files(&mut config).client_ca = Some(args::path(parser.value())?)
            }
            Long("state-dir") => {
                config.state_dir = Some(parser.value().map_err(|e| e.to_string())?.into())
            }
            Long("no-state-dir") => no_state_dir = true,
            Short('h') | Long("help") => return Ok(None),
            other => return Err(other.unexpected().to_string()),
        }
    }
    if !listen.is_empty() {
        config.listen = listen;
    }
    match (no_state_dir, config.state_dir.is_some()) {
        (true, true) => return Err("--state-dir and --no-state-dir exclude each other".into()),
        (true, false) => {}
        (false, true) => {}
        (false, false) => match state_location::default_location_from_env() {
            Some(StateLocation::Exactly(dir)) => config.state_dir = Some(dir),
            Some(StateLocation::PerAddress(base)) => config.state_base = Some(base),
            None => {
                return Err(
                    "no state directory: HOME, XDG_STATE_HOME and STATE_DIRECTORY \
                     are unset; give --state-dir DIR (or --no-state-dir)"
                        .into(),
                );
            }
        },
    }
    #[cfg(feature = "tls")]
    if let Some(files) = &config.tls {
        if files.cert.as_os_str().is_empty() || files.key.as_os_str().is_empty() {
            return Err("--tls-cert and --tls-key go together".to_owned());
        }
    }
    // Spec §10.8: by default a server that only sees `A` never meets it.
    config.limits.max_grants = max_grants.unwrap_or_else(|| {
        config
            .limits
            .max_keys
            .saturating_add(config.limits.max_waiters)
    });
    config.limits.validate()?;
    Ok(Some(Parsed { config, auth }))
}

/// SIGTERM, SIGINT and SIGHUP shut the server down gracefully (spec §4):
/// a thread waits for them and uses the server's shutdown handle.
fn shut_down_on_signals(server: &Server) -> std::io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let handle = server.shutdown_handle();
    std::thread::Builder::new()
        .name("signals".to_owned())
        .spawn(move || {
            for _ in signals.forever() {
                // Tell systemd (when it started us) that the stop is ours.
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
                handle.shut_down();
            }
        })?;
    Ok(())
}

/// Where the metrics are, as a user reaches them.
fn metrics_location(address: &crate::addr::Address) -> String {
    match address {
        crate::addr::Address::Unix(path) => format!(
            "metrics at unix:{path} (HTTP: curl --unix-socket {path} http://localhost/metrics)",
            path = path.display()
        ),
        other => format!("metrics at http://{other}/metrics"),
    }
}

/// What to do about a state directory that stops the start.
fn state_dir_hint(error: &str) -> &'static str {
    if error.contains("another kunci server") {
        "hint: stop the other server, or give this one a --state-dir of its own"
    } else if error.contains("cannot write") {
        "hint: check the free space and the permissions of the state directory"
    } else if error.contains("cannot create") || error.contains("cannot open") {
        "hint: check that the directory's parent exists and that this user may write there"
    } else {
        "hint: the file was left as it was. Restore it from a backup, or move it aside to \
         start without it: then every key is free at once although leases of the previous \
         run may still be running, so keep clients away for 260 s (the longest lease + 5 s)"
    }
}

/// Reads and parses the `--auth` file; the error names the line.
fn read_access_list(path: &std::path::Path) -> Result<AccessList, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    AccessList::parse(&text).map_err(|e| e.to_string())
}

fn positive(option: &str, value: Result<OsString, lexopt::Error>) -> Result<usize, String> {
    let number: usize = args::number(option, value)?;
    if number == 0 {
        return Err(format!("{option}: must be at least 1"));
    }
    Ok(number)
}

pub fn main(arguments: Vec<OsString>) -> u8 {
    let Parsed { mut config, auth } = match parse(arguments) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => {
            print!("{}", help());
            return exit::DONE;
        }
        Err(message) => {
            eprintln!("kunci serve: {message}\n(see kunci serve --help)");
            return exit::USAGE;
        }
    };
    super::logging::init_server();
    if let Some(path) = &auth {
        match read_access_list(path) {
            Ok(access) => config.access = Some(access),
            Err(message) => {
                error!("cannot start: --auth {}: {message}", path.display());
                return 1;
            }
        }
    }
    let identities = config.access.as_ref().map(AccessList::len);
    if let Some(dir) = &config.state_dir
        && dir.exists()
        && !dir.is_dir()
    {
        error!(
            "cannot start: state dir {}: not a directory (--state-dir names a directory, \
             created if missing)",
            dir.display()
        );
        return 1;
    }
    let allow: Vec<String> = config.allow.iter().map(ToString::to_string).collect();
    let server = match Server::bind(config) {
        Ok(server) => server,
        Err(e) if crate::server::state::is_state_dir_error(&e) => {
            error!("cannot start: {e}");
            error!("{}", state_dir_hint(&e.to_string()));
            return 1;
        }
        Err(e) if e.to_string().starts_with("TLS: ") => {
            error!("cannot start: {e}");
            return 1;
        }
        Err(e) => {
            error!("cannot listen: {e}");
            return 1;
        }
    };
    let limits = server.limits();
    let addresses: Vec<String> = server.addresses().iter().map(ToString::to_string).collect();
    // One line with everything that shapes the server; the optional parts
    // only when set, metrics last.
    let mut options = String::new();
    match server.state_dir() {
        Some(dir) => options.push_str(&format!("; state dir {}", dir.display())),
        None => options.push_str("; no state dir"),
    }
    if !allow.is_empty() {
        options.push_str(&format!("; allow {}", allow.join(" ")));
    }
    if let Some(count) = identities {
        let noun = if count == 1 { "identity" } else { "identities" };
        options.push_str(&format!("; auth: {count} {noun}"));
    }
    if let Some(address) = server.metrics_address() {
        options.push_str(&format!("; {}", metrics_location(address)));
    }
    // Before the line that says it listens: whoever waits for that line
    // (a test, a script) may signal the server at once.
    if let Err(e) = shut_down_on_signals(&server) {
        error!("cannot install signal handlers: {e}");
        return 1;
    }
    info!(
        "kunci {} listening on {}; limits: max_keys={} max_waiters={} \
         max_waiters_per_key={} max_waits_per_conn={} max_grants={} max_connections={} \
         max_watches={} max_watches_per_conn={}{options}",
        env!("CARGO_PKG_VERSION"),
        addresses.join(" "),
        limits.max_keys,
        limits.max_waiters,
        limits.max_waiters_per_key,
        limits.max_waits_per_conn,
        limits.max_grants,
        limits.max_connections,
        limits.max_watches,
        limits.max_watches_per_conn,
    );
    if server.state_dir().is_none() {
        warn!(
            "--no-state-dir: a crash frees every key at once (two holders for up to one \
             lease) and tokens rely on the wall clock never stepping back"
        );
    }
    for address in server.unguarded_addresses() {
        warn!(
            "{address} is reachable beyond this host and nothing checks who connects: \
             anyone who reaches it may take, release and list every lock. \
             Use --auth, --allow or a loopback/unix listener"
        );
    }
    for address in server.secrets_in_clear_addresses() {
        warn!(
            "{address} is plaintext TCP reachable beyond this host, and --auth is on: \
             clients' secrets cross the network in clear there, where anyone on the \
             path can read them. Listen on tls://HOST:PORT (with --tls-cert and \
             --tls-key) instead; clients refuse to send a secret in clear unless told \
             to (--insecure-plaintext-secret)"
        );
    }
    if identities == Some(0) {
        warn!(
            "the --auth file has no identities: every session will be refused (X 12). \
             Add lines with `kunci secret NAME SCOPE...`"
        );
    }
    // Under systemd (`Type=notify`) this says "listening"; elsewhere,
    // without NOTIFY_SOCKET, it does nothing.
    if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
        warn!("cannot tell systemd the server is ready: {e}");
    }
    match server.run() {
        Ok(()) => exit::DONE,
        Err(e) => {
            error!("{e}; exiting");
            1
        }
    }
}
