//! The client commands: `acquire`, `release`, `renew`, `query`, `info`,
//! `ping`, and the option parsing `run` shares with them.

use std::ffi::OsString;
use std::io::Write;
use std::time::Duration;

use super::args;
use super::exit;
use super::permits::{self, PermitFlags};
use crate::addr::{Address, DEFAULT_ADDRESS};
use crate::client::{AcquireOptions, Client, Config, Denied, Error, Secret, Ticket, WAIT_MAX};

/// The environment variable that names the servers when `--server` is not
/// given: addresses separated by commas.
pub const SERVER_ENV: &str = "KUNCI_SERVER";
/// The environment variable that names the CA file when `--tls-ca` is not
/// given.
#[cfg_attr(not(feature = "tls"), allow(dead_code))]
pub const TLS_CA_ENV: &str = "KUNCI_TLS_CA";

/// `--tls-ca`, `--tls-cert`, `--tls-key`.
#[cfg(feature = "tls")]
pub(super) type TlsOptions = crate::tls::ClientFiles;
#[cfg(not(feature = "tls"))]
#[derive(Clone, Default)]
pub(super) struct TlsOptions {
    _none: (),
}

/// Takes the value of `--NAME` if it is a TLS option; `false` if it is
/// not one.
pub(super) fn tls_option(
    name: &str,
    parser: &mut lexopt::Parser,
    tls: &mut TlsOptions,
) -> Result<bool, String> {
    #[cfg(feature = "tls")]
    {
        let slot = match name {
            "tls-ca" => &mut tls.ca,
            "tls-cert" => &mut tls.cert,
            "tls-key" => &mut tls.key,
            _ => return Ok(false),
        };
        *slot = Some(args::path(parser.value())?);
        Ok(true)
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = (parser, tls);
        if name.starts_with("tls-") {
            return Err(format!(
                "--{name}: this kunci was built without TLS (cargo feature `tls`)"
            ));
        }
        Ok(false)
    }
}

/// The environment variable that holds the secret itself, when
/// `--secret-file` is not given.
pub const SECRET_ENV: &str = "KUNCI_SECRET";

/// Refuses TLS options that cannot work, before anything is connected: a
/// certificate without its key (or the reverse), and, when an address is
/// `tls://`, files that do not load or a key that does not match its
/// certificate. Usage errors, as every other wrong option.
pub(super) fn check_tls(servers: &[Address], tls: &TlsOptions) -> Result<(), String> {
    #[cfg(feature = "tls")]
    {
        if tls.cert.is_some() != tls.key.is_some() {
            return Err("--tls-cert and --tls-key go together".to_owned());
        }
        if servers
            .iter()
            .any(|address| matches!(address, Address::Tls(_) | Address::Etcd { tls: true, .. }))
        {
            crate::tls::client_config(&tls_files(tls)).map_err(|e| format!("TLS: {e}"))?;
        }
    }
    #[cfg(not(feature = "tls"))]
    let _ = (servers, tls);
    Ok(())
}

/// The environment variable that, set to `1`, allows what
/// `--insecure-plaintext-secret` allows.
pub const ALLOW_PLAINTEXT_SECRET_ENV: &str = "KUNCI_ALLOW_PLAINTEXT_SECRET";

/// Refuses a secret that would go in clear beyond this host (spec §12.5)
/// unless `--insecure-plaintext-secret` (`flag`) or
/// `KUNCI_ALLOW_PLAINTEXT_SECRET=1` allows it: a usage error, before
/// anything is connected.
pub(super) fn check_plaintext_secret(
    servers: &[Address],
    secret: Option<&Secret>,
    flag: bool,
) -> Result<(), String> {
    let allowed = flag || std::env::var_os(ALLOW_PLAINTEXT_SECRET_ENV).is_some_and(|v| v == "1");
    if secret.is_none() || allowed {
        return Ok(());
    }
    match servers
        .iter()
        .find(|address| !address.keeps_secrets_private())
    {
        Some(address) => Err(format!(
            "the secret would go in clear to {address}, beyond this host: nothing was \
             sent. Use tls://{address} (the server needs --listen tls://...), a unix \
             socket or a loopback address; or, on a network you trust, allow it with \
             --insecure-plaintext-secret or {ALLOW_PLAINTEXT_SECRET_ENV}=1"
        )),
        None => Ok(()),
    }
}

// Not a `\`-continued literal: that would strip the first line's indent.
pub(super) const SERVER_HELP: &str =
    "  --server ADDR   a server address: HOST:PORT, tls://HOST:PORT (TLS,
                  checking the certificate against HOST) or unix:PATH;
                  repeat, or separate with commas, for several addresses
                  of the same service (default: $KUNCI_SERVER, the same
                  way, else 127.0.0.1:5862); etcd://HOST:PORT[,HOST:PORT]...
                  takes the locks on an etcd cluster instead (docs/ETCD.md)
  --secret-file FILE
                  the secret for a server with --auth (one trailing
                  newline is ignored); default: $KUNCI_SECRET, else none.
                  It is sent only over tls://, a unix socket or to a
                  loopback address (127.0.0.0/8, ::1, localhost)
  --insecure-plaintext-secret
                  send the secret in clear to other addresses too (also
                  $KUNCI_ALLOW_PLAINTEXT_SECRET=1); anyone on the path
                  can read it
  --tls-ca FILE   trust this CA (PEM) for tls:// (default: $KUNCI_TLS_CA,
                  else the system's trust store)
  --tls-cert FILE a client certificate (PEM) for tls://, with --tls-key
  --tls-key FILE  its private key (PEM)
  -h, --help      show this help
";

/// Options of the client commands. Each command accepts only some of them.
pub(super) struct Options {
    pub servers: Vec<Address>,
    /// `--secret-file`, else `$KUNCI_SECRET`.
    pub secret: Option<Secret>,
    pub tls: TlsOptions,
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
// Made once per command: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Parsed {
    Run(Options),
    Help,
}

/// Parses a client command's arguments.
pub(super) fn parse(arguments: Vec<OsString>, accepts: Accepts) -> Result<Parsed, String> {
    use lexopt::prelude::*;
    let mut options = Options {
        servers: Vec::new(),
        secret: None,
        tls: TlsOptions::default(),
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
    let mut secret_file = None;
    let mut label_args = false;
    let mut allow_plaintext_secret = false;
    let mut parser = lexopt::Parser::from_args(arguments);
    loop {
        // `--` ends the options; with a command, what follows it is the
        // command, untouched, and every positional must have come before.
        if accepts.command
            && let Some(mut raw) = parser.try_raw_args()
            && raw.next_if(|argument| argument == "--").is_some()
        {
            options.command = raw.collect();
            if let Some(missing) = accepts.positionals.get(options.positionals.len()) {
                return Err(format!("missing {missing}: it comes before `--`"));
            }
            break;
        }
        let Some(argument) = parser.next().map_err(|e| e.to_string())? else {
            break;
        };
        match argument {
            Long("server") => options.servers.extend(server_option(parser.value())?),
            Long("secret-file") => secret_file = Some(parser.value().map_err(|e| e.to_string())?),
            Long("insecure-plaintext-secret") => allow_plaintext_secret = true,
            // `-w S` and `-n` as flock(1) spells them.
            Short('n') if accepts.wait => {
                options.wait_forever = false;
                options.wait = Duration::ZERO;
            }
            Short('w') | Long("wait") if accepts.wait => {
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
            Long(name) if name.starts_with("tls-") => {
                let name = name.to_owned();
                if !tls_option(&name, &mut parser, &mut options.tls)? {
                    return Err(format!("invalid option '--{name}'"));
                }
            }
            Long("label-args") if accepts.command => label_args = true,
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
            .then(|| permits::run_label(&options.command, label_args));
        options.acquire = permit_flags.options(default_label)?;
    }
    if options.servers.is_empty() {
        options.servers = default_servers()?;
    }
    check_servers(&options.servers)?;
    options.secret = secret(secret_file)?;
    check_plaintext_secret(
        &options.servers,
        options.secret.as_ref(),
        allow_plaintext_secret,
    )?;
    check_tls(&options.servers, &options.tls)?;
    Ok(Parsed::Run(options))
}

/// Refuses a list of addresses no client can serve: `etcd://` mixed with
/// kunci servers (one service is either).
pub(super) fn check_servers(servers: &[Address]) -> Result<(), String> {
    let etcd = servers
        .iter()
        .filter(|address| matches!(address, Address::Etcd { .. }))
        .count();
    if etcd != 0 && etcd != servers.len() {
        return Err("etcd:// cannot be mixed with kunci server addresses: \
                    name one service, either kunci servers or one etcd cluster"
            .into());
    }
    Ok(())
}

/// The secret in `--secret-file` (without one trailing newline), else
/// `$KUNCI_SECRET`, else none. One no server could take is a usage error.
pub(super) fn secret(file: Option<OsString>) -> Result<Option<Secret>, String> {
    let secret = match file {
        Some(path) => Secret::from_file(&path).map_err(|e| {
            format!(
                "--secret-file {}: {e}",
                std::path::Path::new(&path).display()
            )
        })?,
        None => match std::env::var_os(SECRET_ENV) {
            Some(value) if !value.is_empty() => {
                Secret::new(std::os::unix::ffi::OsStringExt::into_vec(value))
            }
            _ => return Ok(None),
        },
    };
    if let Some(problem) = secret.problem() {
        return Err(format!("invalid argument: {problem}"));
    }
    Ok(Some(secret))
}

fn is_etcd(servers: &[Address]) -> bool {
    servers
        .iter()
        .any(|address| matches!(address, Address::Etcd { .. }))
}

/// The etcd user and password from `$KUNCI_ETCD_USER` and
/// `$KUNCI_ETCD_PASSWORD` (docs/ETCD.md), if the user is set.
#[cfg(feature = "etcd")]
fn etcd_credentials() -> Result<Option<crate::client::EtcdCredentials>, String> {
    let Some(user) = std::env::var("KUNCI_ETCD_USER")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        return Ok(None);
    };
    let password = std::env::var("KUNCI_ETCD_PASSWORD")
        .map_err(|_| "KUNCI_ETCD_USER is set but KUNCI_ETCD_PASSWORD is not".to_owned())?;
    Ok(Some(crate::client::EtcdCredentials { user, password }))
}

/// `$KUNCI_SERVER` (comma-separated), else the default address.
pub(super) fn default_servers() -> Result<Vec<Address>, String> {
    let text = match std::env::var(SERVER_ENV) {
        Ok(text) if !text.trim().is_empty() => text,
        _ => DEFAULT_ADDRESS.to_owned(),
    };
    server_list(&text).map_err(|e| format!("{SERVER_ENV}: {e}"))
}

/// Addresses separated by commas, as in `--server` and `$KUNCI_SERVER`
/// alike; an `etcd://` address lists its members with commas itself.
pub(super) fn server_list(text: &str) -> Result<Vec<Address>, crate::addr::AddressError> {
    let text = text.trim();
    if text.starts_with("etcd://") || text.starts_with("etcds://") {
        return text.parse().map(|address| vec![address]);
    }
    text.split(',')
        .map(|address| address.trim().parse())
        .collect()
}

/// The value of `--server`: one address, or several separated by commas.
pub(super) fn server_option(
    value: Result<OsString, lexopt::Error>,
) -> Result<Vec<Address>, String> {
    server_list(&args::text(value)?).map_err(|e| e.to_string())
}

/// A client for one-shot commands: one session per address is enough.
pub(super) fn client(
    servers: Vec<Address>,
    secret: Option<Secret>,
    tls: &TlsOptions,
) -> Result<Client, String> {
    #[cfg_attr(not(feature = "tls"), allow(unused_mut))]
    let mut config = Config {
        sessions_per_server: 1,
        secret,
        // Every command's parsing has run `check_plaintext_secret`: a
        // secret in clear beyond this host was refused there unless the
        // user opted in.
        allow_plaintext_secret: true,
        #[cfg(feature = "etcd")]
        etcd_credentials: etcd_credentials()?,
        ..Config::default()
    };
    #[cfg(feature = "tls")]
    {
        config.tls = tls_files(tls);
    }
    #[cfg(not(feature = "tls"))]
    let _ = tls;
    Client::new(servers, config).map_err(|e| format!("cannot start the client: {e}"))
}

/// The TLS files to use: the options, with `$KUNCI_TLS_CA` when
/// `--tls-ca` is not given.
#[cfg(feature = "tls")]
pub(super) fn tls_files(tls: &TlsOptions) -> crate::tls::ClientFiles {
    let mut files = tls.clone();
    if files.ca.is_none() {
        files.ca = std::env::var_os(TLS_CA_ENV)
            .filter(|ca| !ca.is_empty())
            .map(Into::into);
    }
    files
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
        Error::PermissionDenied(_) => exit::PERMISSION_DENIED,
    }
}

/// What a failed command was doing, so its message can say it exactly.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Attempt<'a> {
    pub key: Option<&'a str>,
    /// The acquire's wait (`None` for other requests).
    pub wait: Option<Duration>,
    pub token: Option<u64>,
    /// The acquire named a limit of permits (a semaphore or a shared
    /// lock): a timeout need not mean that anyone holds the whole key.
    pub permits: bool,
    /// Why the latest connection attempt failed, to explain an
    /// `Unavailable` (`Client::last_connect_failure`).
    pub connect_failure: Option<&'a str>,
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
        Error::PermissionDenied(_) => "permission denied",
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
    // Under a limit the key may have free permits and still time out: the
    // queue is FIFO, and a request waits behind every earlier one.
    let held = if attempt.permits {
        "had no room for this request (its permits were taken, or earlier requests \
         that queue before it were not yet served)"
    } else {
        "is held by someone else"
    };
    let stayed_held = if attempt.permits {
        "had no room for this request (its permits were taken, or earlier requests \
         queued before it) for the whole wait"
    } else {
        "stayed held by someone else for the whole wait"
    };
    match error {
        Error::Timeout => match attempt.wait {
            Some(wait) if wait.is_zero() => format!(
                "{key} {held}; nothing was acquired \
                 (--wait 0 tries once; --wait S waits up to S seconds)"
            ),
            Some(wait) if wait.subsec_nanos() != 0 => format!(
                "{key} {stayed_held} ({}, sent as {} s: \
                 the server counts whole seconds); nothing was acquired",
                seconds_text(wait),
                wait.as_secs() + 1
            ),
            Some(wait) => format!(
                "{key} {stayed_held} ({}); \
                 nothing was acquired",
                seconds_text(wait)
            ),
            None => format!("{key} {held}; nothing was acquired"),
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
        Error::Unavailable(crate::client::Unavailable::Untrusted(why)) => format!(
            "TLS: {why}; nothing was sent. Give the CA that signed the server's \
             certificate with --tls-ca (or KUNCI_TLS_CA), and use the host name the \
             certificate names"
        ),
        Error::PermissionDenied(Denied::Certificate(why)) => {
            format!("{why}; nothing was executed")
        }
        Error::Unavailable(crate::client::Unavailable::WrongProtocol(why)) => {
            let servers: Vec<String> = servers.iter().map(ToString::to_string).collect();
            format!(
                "{} answered: {why}; nothing was executed",
                servers.join(", ")
            )
        }
        Error::Unavailable(crate::client::Unavailable::Unreachable)
            if servers
                .iter()
                .any(|address| matches!(address, Address::Etcd { .. })) =>
        {
            let servers: Vec<String> = servers.iter().map(ToString::to_string).collect();
            format!(
                "no etcd member took the request (tried {}); nothing changed. Check that \
                 etcd runs there and serves clients on that port (its --listen-client-urls, \
                 usually :2379); RUST_LOG=debug shows each attempt",
                servers.join(", ")
            )
        }
        Error::Unavailable(crate::client::Unavailable::Unreachable) => {
            let servers: Vec<String> = servers.iter().map(ToString::to_string).collect();
            let last = attempt
                .connect_failure
                .map_or_else(String::new, |why| format!(" (the last attempt: {why})"));
            format!(
                "no server took the request (tried {}){last}; nothing was sent, so nothing \
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
        Error::PermissionDenied(Denied::NotAuthenticated) if is_etcd(servers) => {
            "etcd has authentication on and did not take this client's user: set \
             KUNCI_ETCD_USER and KUNCI_ETCD_PASSWORD (docs/ETCD.md); nothing was executed"
                .to_owned()
        }
        Error::PermissionDenied(Denied::NotPermitted) if is_etcd(servers) => format!(
            "the etcd user's roles do not allow {} on {key}; nothing changed",
            if command.is_empty() { "that" } else { command }
        ),
        Error::PermissionDenied(Denied::NotAuthenticated) => format!(
            "the server wants a secret its --auth file knows, and this client gave none \
             or another; nothing was executed. Give it with --secret-file FILE or \
             ${SECRET_ENV}"
        ),
        Error::PermissionDenied(Denied::NotPermitted) => format!(
            "this secret's scopes do not allow {} on {key}; nothing changed. The \
             server's --auth file names them (lock:PREFIX, read:PREFIX, info)",
            if command.is_empty() { "that" } else { command }
        ),
    }
}

/// After a `Timeout`: if the key is held only by the crash grace of a
/// restarted server (spec §7.2: `Q` shows token 0 and a lease), a sentence
/// that says so; else nothing.
///
/// The `Q` is only there to explain the timeout, so it is bounded by the
/// acquire's own deadline `D` (spec §8 rule 12): when it cannot finish by
/// then, the note is left out.
pub(super) fn grace_note(client: &Client, key: &str, deadline: std::time::Instant) -> String {
    if std::time::Instant::now() >= deadline {
        return String::new();
    }
    match client.query_by(key, deadline) {
        Ok(status) if status.token == 0 && status.lease_ms > 0 => format!(
            ". The server restarted after a crash: it counts {key:?} as held by an unknown \
             grant of its previous run for {} more, unless that holder renews or releases it",
            seconds_text(Duration::from_millis(u64::from(status.lease_ms)))
        ),
        _ => String::new(),
    }
}

/// The deadline `D` of an acquire with the options' wait that starts now
/// (spec §8 rule 2): the start, plus the wait, plus the transport deadline.
pub(super) fn call_deadline(options: &Options) -> std::time::Instant {
    std::time::Instant::now() + options.wait + crate::client::TRANSPORT_DEADLINE
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
    let (filter, problem) = super::logging::log_filter("warn");
    let _ = env_logger::Builder::new()
        .parse_filters(&filter)
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
    super::logging::report_filter_problem(problem, "warn");
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
(docs/ETCD.md).

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
            let etcd = is_etcd(&options.servers);
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
                    .filter(|name| **name == "KEY")
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

/// A command's help with the shared `--server` lines (no final newline).
pub(super) fn with_plain_server_help(help: &str) -> String {
    format!("{help}{}", SERVER_HELP.trim_end())
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

/// Acquires `key` with the options' wait and lease. `--wait inf` waits as
/// long as it takes, through restarts and outages
/// ([`Client::acquire_forever`]).
pub(super) fn acquire(client: &Client, key: &str, options: &Options) -> Result<Ticket, Error> {
    if options.wait_forever {
        client.acquire_forever(key, options.lease, options.acquire.clone())
    } else {
        client.acquire_with(key, options.wait, options.lease, options.acquire.clone())
    }
}
