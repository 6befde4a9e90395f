//! What the client commands print when a call does not succeed: the exit
//! code of each outcome (spec §9), the message that says what happened and
//! what to do, and the format of the log's warnings.

use std::time::Duration;

use super::exit;
use super::options::{SECRET_ENV, is_etcd};
use crate::addr::Address;
use crate::client::{Client, Denied, Error};
use crate::protocol::SHARED_LIMIT;

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
    // Only a request that named a key is refused "on" it.
    let on_key = attempt
        .key
        .map_or_else(String::new, |key| format!(" on key {key:?}"));
    let token = attempt
        .token
        .map_or_else(|| "the token".to_owned(), |token| format!("token {token}"));
    let is_lock_request = matches!(command, "acquire" | "run" | "elect");
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
        Error::Unavailable(crate::client::Unavailable::Unreachable)
            if let Some((path, why)) = socket_not_permitted(servers, attempt.connect_failure) =>
        {
            format!(
                "this user may not open the socket {path} ({why}); nothing was sent, so \
                 nothing changed. The socket's group and mode decide who may (ls -l {path}; \
                 kunci serve --unix-mode); the package's socket is mode 660, group kunci: \
                 sudo adduser $USER kunci, then log in again"
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
            key_limit: Some(SHARED_LIMIT),
        } => format!(
            "{key} is a shared lock (a limit of {SHARED_LIMIT} permits), and this request \
             named another limit; nothing was acquired or queued. Ask with --shared (a key \
             keeps its limit while it has grants or waiters)"
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
            "the etcd user's roles do not allow {}{on_key}; nothing changed",
            if command.is_empty() { "that" } else { command }
        ),
        Error::PermissionDenied(Denied::NotAuthenticated) => format!(
            "the server wants a secret its --auth file knows, and this client gave none \
             or another; nothing was executed. Give it with --secret-file FILE or \
             ${SECRET_ENV}"
        ),
        Error::PermissionDenied(Denied::NotPermitted) if matches!(command, "info" | "top") => {
            format!(
                "this secret's scopes do not allow reading the server's counters ({command} \
                 needs the scope info); nothing changed. The server's --auth file names them \
                 (lock:PREFIX, read:PREFIX, info)"
            )
        }
        Error::PermissionDenied(Denied::NotPermitted) => format!(
            "this secret's scopes do not allow {}{on_key}; nothing changed. The \
             server's --auth file names them (lock:PREFIX, read:PREFIX, info)",
            if command.is_empty() { "that" } else { command }
        ),
    }
}

/// The unix socket and why, when the only address is one that this user
/// may not open (`EACCES`): its group and mode are the cause, not the
/// server's `--allow` or limits.
fn socket_not_permitted<'a>(
    servers: &'a [Address],
    connect_failure: Option<&'a str>,
) -> Option<(String, &'a str)> {
    let [address @ Address::Unix(path)] = servers else {
        return None;
    };
    let why = connect_failure?
        .strip_prefix(&address.to_string())?
        .strip_prefix(": ")?;
    // How std shows EACCES: "Permission denied (os error 13)".
    why.starts_with("Permission denied")
        .then(|| (path.display().to_string(), why))
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

/// A duration as the user typed it: `2.5 s`, `1 s`.
fn seconds_text(duration: Duration) -> String {
    format!("{} s", crate::decimal::seconds_shortest(duration))
}

pub(super) fn usage_error(command: &str, message: &str) -> u8 {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Unavailable;

    fn addresses(text: &str) -> Vec<Address> {
        vec![text.parse().unwrap()]
    }

    /// A unix socket this user may not open points at the socket's group
    /// and mode (the `kunci` group), not at the server's `--allow`.
    #[test]
    fn a_socket_this_user_may_not_open_names_its_group_and_mode() {
        let servers = addresses("unix:/run/kunci/kunci.sock");
        let attempt = Attempt {
            connect_failure: Some("unix:/run/kunci/kunci.sock: Permission denied (os error 13)"),
            ..Attempt::default()
        };
        assert_eq!(
            message(
                "ping",
                &Error::Unavailable(Unavailable::Unreachable),
                &servers,
                &attempt
            ),
            "this user may not open the socket /run/kunci/kunci.sock (Permission denied (os \
             error 13)); nothing was sent, so nothing changed. The socket's group and mode \
             decide who may (ls -l /run/kunci/kunci.sock; kunci serve --unix-mode); the \
             package's socket is mode 660, group kunci: sudo adduser $USER kunci, then log \
             in again"
        );
        // Another cause at the same socket keeps the general message.
        let missing = Attempt {
            connect_failure: Some(
                "unix:/run/kunci/kunci.sock: No such file or directory (os error 2)",
            ),
            ..Attempt::default()
        };
        let text = message(
            "ping",
            &Error::Unavailable(Unavailable::Unreachable),
            &servers,
            &missing,
        );
        assert!(text.starts_with("no server took the request"), "{text}");
    }

    /// `kunci info` and `kunci top` name no key: their refusal says which
    /// scope they need instead of "on the key".
    #[test]
    fn counters_refused_by_scope_name_the_info_scope_and_no_key() {
        let servers = addresses("127.0.0.1:5862");
        let denied = Error::PermissionDenied(Denied::NotPermitted);
        for command in ["info", "top"] {
            assert_eq!(
                message(command, &denied, &servers, &Attempt::default()),
                format!(
                    "this secret's scopes do not allow reading the server's counters \
                     ({command} needs the scope info); nothing changed. The server's --auth \
                     file names them (lock:PREFIX, read:PREFIX, info)"
                )
            );
        }
        assert_eq!(
            message("list", &denied, &servers, &Attempt::default()),
            "this secret's scopes do not allow list; nothing changed. The server's --auth \
             file names them (lock:PREFIX, read:PREFIX, info)"
        );
        let on_key = Attempt {
            key: Some("app/x"),
            ..Attempt::default()
        };
        assert_eq!(
            message("acquire", &denied, &servers, &on_key),
            "this secret's scopes do not allow acquire on key \"app/x\"; nothing changed. \
             The server's --auth file names them (lock:PREFIX, read:PREFIX, info)"
        );
    }

    /// A shared lock's limit is 65535: the message says `--shared`.
    #[test]
    fn a_limit_mismatch_on_a_shared_key_says_shared() {
        let servers = addresses("127.0.0.1:5862");
        let attempt = Attempt {
            key: Some("db"),
            ..Attempt::default()
        };
        assert_eq!(
            message(
                "acquire",
                &Error::LimitMismatch {
                    key_limit: Some(65535)
                },
                &servers,
                &attempt
            ),
            "key \"db\" is a shared lock (a limit of 65535 permits), and this request named \
             another limit; nothing was acquired or queued. Ask with --shared (a key keeps \
             its limit while it has grants or waiters)"
        );
        let other = message(
            "acquire",
            &Error::LimitMismatch { key_limit: Some(3) },
            &servers,
            &attempt,
        );
        assert!(other.contains("Ask with --limit 3 "), "{other}");
    }
}
