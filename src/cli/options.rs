//! The options of the client commands (`acquire`, `release`, `renew`,
//! `query`, `info`, `ping`), which `run`, `elect`, `top` and `bench`
//! share: parsing them, the servers, secret and TLS files they name with
//! the environment, the client they make, and the help about them.

use std::ffi::OsString;
use std::time::Duration;

use super::args;
use super::exit;
use super::permits::{self, PermitFlags};
use crate::addr::{Address, DEFAULT_ADDRESS, EtcdLayout};
use crate::client::{AcquireOptions, Client, Config, Error, Secret, Ticket, WAIT_MAX};

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
                  takes the locks on an etcd cluster instead (docs/ETCD.md),
                  and with ?layout=etcd at its end shares exclusive locks
                  and elections with etcdctl lock/elect and Go's
                  concurrency package
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
/// kunci servers (one service is either), or etcd members with different
/// layouts (`?layout=`).
pub(super) fn check_servers(servers: &[Address]) -> Result<(), String> {
    EtcdLayout::of(servers)?;
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

pub(super) fn is_etcd(servers: &[Address]) -> bool {
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
        // One address that refuses the connection: say so at once rather
        // than after the request's whole deadline (`--wait inf` still
        // waits: it asks again after a pause).
        end_at_refusal: servers.len() == 1,
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

/// The deadline `D` of an acquire with the options' wait that starts now
/// (spec §8 rule 2): the start, plus the wait, plus the transport deadline.
pub(super) fn call_deadline(options: &Options) -> std::time::Instant {
    std::time::Instant::now() + options.wait + crate::client::TRANSPORT_DEADLINE
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
