//! `kunci elect` and `kunci leader` (spec §13.6): leader election on a
//! lock. `elect` is `kunci run NAME --wait inf --label VALUE`; `leader`
//! prints who leads, once or (`--watch`) at every change.

use std::ffi::OsString;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::bench::stats::json_string;
use super::client::{self as common, Accepts, Attempt, Parsed};
use super::exit;
use crate::client::Leader;
use crate::protocol::LABEL_LEN_MAX;

const ELECT_HELP: &str = "\
kunci elect — run a command while this candidate leads

Usage: kunci elect NAME VALUE [--lease S] [-w|--wait S] [--kill-after S]
                   [-E N] [-q] [--server ADDR]... -- CMD [ARGS]...

Campaigns in the election NAME with VALUE (an address, a host name:
1..=128 bytes, no newline) and runs CMD once this candidate leads, with
KUNCI_KEY and KUNCI_TOKEN (the term: a fencing token for what the leader
writes) set. It is `kunci run NAME --wait inf --label VALUE -- CMD`: it
waits as long as it takes, through restarts and outages, renews the lease
while CMD runs, stops CMD if the lead is lost, and resigns when CMD ends.
A leader whose host dies loses the lead at its lease's end. With --wait S
it campaigns for at most S seconds (as `kunci run --wait S`: one wait in
the queue, at most 255 s) and exits 1 if this candidate does not lead by
then. The lead's value can change with `kunci proclaim NAME TOKEN VALUE`.

Options:
  --lease S       the lease, whole seconds 1..=255 (default 30)
  -w, --wait S    campaign for at most S seconds (default: until elected)
  -E, --conflict-exit-code N
                  the exit status when --wait ran out (default 1)
  -q, --quiet     no message when --wait ran out
  --kill-after S  how long after SIGTERM CMD's group gets SIGKILL
                  (default 5)
";

const LEADER_HELP: &str = "\
kunci leader — who leads an election

Usage: kunci leader NAME [--json] [--watch] [--server ADDR]...

Prints `VALUE term=TOKEN held_for=SECONDS` and exits 0 while someone leads
NAME, or prints `none` and exits 1. With --watch it prints the current
state first, then one line per change of leader, until SIGINT or SIGTERM
(then it exits 0); through a server's restart or an outage it keeps
asking quietly.

Options:
  --json          one JSON object per line: {\"value\": …, \"term\": \"TOKEN\"
                  (a string), \"held_for\": SECONDS or null}, or null when
                  nobody leads
  --watch         follow the election until SIGINT or SIGTERM
";

/// `kunci elect NAME VALUE [options] -- CMD`.
pub fn elect(mut arguments: Vec<OsString>) -> u8 {
    let help = arguments
        .iter()
        .take_while(|arg| *arg != "--")
        .any(|arg| arg == "-h" || arg == "--help");
    if help {
        println!("{}", common::with_plain_server_help(ELECT_HELP));
        return exit::DONE;
    }
    let usage = |message: &str| {
        eprintln!("kunci elect: {message}\n(see kunci elect --help)");
        exit::USAGE
    };
    if arguments.len() < 2 || arguments[..2].iter().any(|arg| arg == "--") {
        return usage("NAME and VALUE come first");
    }
    let value = arguments.remove(1);
    let Some(value) = value.to_str() else {
        return usage("VALUE is not valid UTF-8");
    };
    if value.is_empty() || value.len() > LABEL_LEN_MAX || value.contains('\n') {
        return usage("VALUE must be 1..=128 bytes without a newline");
    }
    for option in ["--label", "--limit", "--take", "--shared", "--exclusive"] {
        if arguments.iter().take_while(|arg| *arg != "--").any(|arg| {
            arg == option
                || arg
                    .to_str()
                    .is_some_and(|a| a.starts_with(&format!("{option}=")))
        }) {
            return usage(&format!("{option} is not an option of elect"));
        }
    }
    // Without a wait of its own it waits as long as it takes.
    let waits = arguments.iter().take_while(|arg| *arg != "--").any(|arg| {
        arg.to_str().is_some_and(|a| {
            a == "-n" || a == "--wait" || a.starts_with("--wait=") || a.starts_with("-w")
        })
    });
    let mut run = vec![arguments.remove(0)];
    if !waits {
        run.extend(["--wait", "inf"].map(OsString::from));
    }
    run.extend(["--label", value].map(OsString::from));
    run.extend(arguments);
    super::run::campaign(run)
}

/// `kunci leader NAME [--json] [--watch]`.
pub fn leader(mut arguments: Vec<OsString>) -> u8 {
    let before_end = arguments
        .iter()
        .position(|arg| arg == "--")
        .unwrap_or(arguments.len());
    let watch = arguments[..before_end].iter().any(|arg| arg == "--watch");
    arguments.retain(|arg| arg != "--watch");
    let accepts = Accepts {
        wait: false,
        lease: false,
        kill_after: false,
        conflict: false,
        permits: false,
        json: true,
        positionals: &["NAME"],
        optional: 0,
        command: false,
    };
    let options = match common::parse(arguments, accepts) {
        Ok(Parsed::Run(options)) => options,
        Ok(Parsed::Help) => {
            println!("{}", common::with_plain_server_help(LEADER_HELP));
            return exit::DONE;
        }
        Err(message) => {
            eprintln!("kunci leader: {message}\n(see kunci leader --help)");
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
            eprintln!("kunci leader: {message}");
            return exit::UNAVAILABLE;
        }
    };
    let name = options.positionals[0].clone();
    // A value with spaces, or an empty one, does not read back from the
    // text line: say so once, on stderr, and point to --json.
    let hinted = std::cell::Cell::new(false);
    let line = |leader: &Option<Leader>| {
        if options.json {
            return leader_json(leader.as_ref());
        }
        if let Some(hint) = json_hint(leader.as_ref())
            && !hinted.replace(true)
        {
            eprintln!("kunci leader: {hint}");
        }
        leader_text(leader.as_ref())
    };
    let fail = |error| {
        let attempt = Attempt {
            key: Some(&name),
            ..Attempt::default()
        };
        common::report("leader", error, &options.servers, &attempt)
    };
    if !watch {
        return match client.leader(&name) {
            Ok(leader) => {
                println!("{}", line(&leader));
                if leader.is_some() {
                    exit::DONE
                } else {
                    exit::TIMEOUT
                }
            }
            Err(error) => fail(error),
        };
    }
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(error) = signal_hook::flag::register(signal, Arc::clone(&stop)) {
            eprintln!("kunci leader: cannot handle signals: {error}");
            return exit::USAGE;
        }
    }
    // The follower blocks in its requests; the main thread watches for
    // the signals and prints what it sends.
    let (sender, changes) = crate::mailbox::channel();
    let follower = client.clone();
    let followed = name.clone();
    std::thread::spawn(move || {
        for change in follower.observe(&followed) {
            if sender.send(change).is_err() {
                return;
            }
        }
    });
    let mut stdout = std::io::stdout();
    while !stop.load(Ordering::Relaxed) {
        match changes.recv_timeout(Duration::from_millis(50)) {
            Ok(Ok(leader)) => {
                let _ = writeln!(stdout, "{}", line(&leader));
                let _ = stdout.flush();
            }
            Ok(Err(error)) => return fail(error),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return exit::DONE,
        }
    }
    exit::DONE
}

/// `VALUE term=TOKEN held_for=SECONDS`, `unknown term=0 held_for=?`
/// during a crash grace (spec §13.6), or `none`.
fn leader_text(leader: Option<&Leader>) -> String {
    match leader {
        None => "none".to_owned(),
        Some(leader) => format!(
            "{} term={} held_for={}",
            leader.value.as_deref().unwrap_or("unknown"),
            leader.term,
            held_for_text(leader.held_for)
        ),
    }
}

/// The note for a value the text line cannot carry whole (spec §13.6:
/// parsers of values with spaces use `--json`), if this one is such.
fn json_hint(leader: Option<&Leader>) -> Option<&'static str> {
    match leader?.value.as_deref()? {
        "" => Some("note: the value is empty; to read the value exactly, use --json"),
        value if value.contains(char::is_whitespace) => {
            Some("note: the value has spaces; to read the value exactly, use --json")
        }
        _ => None,
    }
}

/// `{"value": …, "term": "TOKEN", "held_for": SECONDS}`, or `null`.
fn leader_json(leader: Option<&Leader>) -> String {
    match leader {
        None => "null".to_owned(),
        Some(leader) => format!(
            "{{\"value\": {}, \"term\": \"{}\", \"held_for\": {}}}",
            leader
                .value
                .as_deref()
                .map_or_else(|| "null".to_owned(), json_string),
            leader.term,
            leader
                .held_for
                .map_or_else(|| "null".to_owned(), |held| held_for_text(Some(held)))
        ),
    }
}

/// Seconds with three decimals, or `?` when unknown.
fn held_for_text(held_for: Option<Duration>) -> String {
    match held_for {
        Some(held) => format!("{}.{:03}", held.as_secs(), held.subsec_millis()),
        None => "?".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_json_say_exactly_what_the_spec_wants() {
        let leader = Leader {
            value: Some("host \"a\"".into()),
            term: u64::MAX,
            held_for: Some(Duration::from_millis(12_345)),
        };
        assert_eq!(
            leader_text(Some(&leader)),
            "host \"a\" term=18446744073709551615 held_for=12.345"
        );
        assert_eq!(
            leader_json(Some(&leader)),
            "{\"value\": \"host \\\"a\\\"\", \"term\": \"18446744073709551615\", \"held_for\": 12.345}"
        );
        let unknown = Leader {
            held_for: None,
            ..leader
        };
        assert!(leader_text(Some(&unknown)).ends_with(" held_for=?"));
        assert!(leader_json(Some(&unknown)).ends_with("\"held_for\": null}"));
        assert_eq!(leader_text(None), "none");
        assert_eq!(leader_json(None), "null");
        // Values the text line cannot carry whole point to --json.
        assert_eq!(json_hint(None), None);
        assert_eq!(json_hint(Some(&Leader::UNKNOWN)), None);
        let with = |value: &str| Leader {
            value: Some(value.to_owned()),
            term: 1,
            held_for: None,
        };
        assert_eq!(json_hint(Some(&with("host-a:5432"))), None);
        assert_eq!(
            json_hint(Some(&with("host a"))),
            Some("note: the value has spaces; to read the value exactly, use --json")
        );
        assert_eq!(
            json_hint(Some(&with("a\tb"))),
            Some("note: the value has spaces; to read the value exactly, use --json")
        );
        assert_eq!(
            json_hint(Some(&with(""))),
            Some("note: the value is empty; to read the value exactly, use --json")
        );
        // During a crash grace (spec §13.6): someone leads, unknown who.
        assert_eq!(
            leader_text(Some(&Leader::UNKNOWN)),
            "unknown term=0 held_for=?"
        );
        assert_eq!(
            leader_json(Some(&Leader::UNKNOWN)),
            "{\"value\": null, \"term\": \"0\", \"held_for\": null}"
        );
    }
}
