//! The `kunci` command line: one binary, one subcommand per job. `main`
//! parses, runs, and maps outcomes to the documented exit codes (spec §9).

pub mod args;
mod bench;
mod client;
pub mod exit;
mod leader;
mod logging;
mod messages;
mod options;
mod permits;
mod run;
mod secret;
mod serve;
mod top;
mod who;

use std::ffi::OsString;
use std::process::ExitCode;

const USAGE: &str = "\
kunci — a small, exact, fast lock server

Usage:
  kunci serve [--listen ADDR]... [options]  run the server
  kunci acquire KEY [--wait S] [--lease S]  take a lock, print its token
        [--limit N [--take K] | --shared | --exclusive] [--label TEXT]
  kunci release KEY TOKEN                   release a lock
  kunci renew KEY TOKEN [--lease S]         extend a lock's lease
  kunci query KEY                           show a key's first holder
  kunci who KEY [--json]                    show a key's holders and waiters
  kunci list [PREFIX] [--json]              list the server's keys
  kunci info                                show the server's counters
  kunci top [--interval S]                  watch the server's counters
  kunci ping                                measure the round-trip time
  kunci run KEY [-w S|-n] [--lease S]       run a command under a lock
        [--limit N [--take K] | --shared | --exclusive] [--label TEXT]
        [options] -- CMD [ARGS]...
  kunci elect NAME VALUE [options] -- CMD   run a command while leading
  kunci leader NAME [--json] [--watch]      show (or follow) who leads
  kunci proclaim NAME TOKEN VALUE           change the leader's value
  kunci bench [WORKLOAD] [options]          load-test a server
  kunci secret NAME SCOPE...                make a secret and its --auth line
  kunci help [COMMAND]                      show this help, or a command's
  kunci --version                           print the version

`kunci help COMMAND` (or `kunci COMMAND --help`) describes its options.

Client commands talk to --server ADDR (HOST:PORT, tls://HOST:PORT or
unix:PATH; repeat it or separate with commas for several addresses of one
service), else to the addresses in $KUNCI_SERVER, else to 127.0.0.1:5862.
With etcd://HOST:PORT[,...] they take their locks on an etcd v3 cluster
instead (docs/ETCD.md). A server with --auth wants a secret: --secret-file
FILE, or $KUNCI_SECRET; it goes only over tls://, unix: or loopback unless
--insecure-plaintext-secret (or $KUNCI_ALLOW_PLAINTEXT_SECRET=1).

Exit status of client commands:
  0 done            1 timeout (the key is held by another)   2 usage error
  3 busy (no room on the server, or it is shutting down)
  4 unavailable (nothing was done)   5 indeterminate (no answer in time)
  6 not held / lock lost   7 permission denied (secret or scopes)
";

/// The commands that are not client commands ([`client::is_command`]).
const OTHER_COMMANDS: [&str; 7] = ["serve", "run", "bench", "top", "secret", "elect", "leader"];

/// Every command `kunci help COMMAND` knows.
fn is_command(name: &str) -> bool {
    OTHER_COMMANDS.contains(&name) || client::is_command(name)
}

/// The message for a command that does not exist: with the command it
/// was most likely meant to be, when one is a slip of a letter or two
/// away (`aquire`: acquire).
fn no_such_command(prefix: &str, name: &str) -> String {
    let likely = OTHER_COMMANDS
        .into_iter()
        .chain(client::command_names())
        .chain(["help"])
        .map(|command| (edit_distance(name, command), command))
        .filter(|&(distance, command)| distance <= (command.len() / 3).max(1))
        .min();
    match likely {
        Some((_, command)) => format!(
            "{prefix}: there is no command {name:?}; did you mean {command}?\n(see kunci help)"
        ),
        None => format!("{prefix}: there is no command {name:?}\n(see kunci help)"),
    }
}

/// The fewest one-character insertions, deletions, substitutions and swaps
/// of two neighbours that turn `a` into `b` (optimal string alignment).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // rows[i][j]: the distance between a[..i] and b[..j].
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let substitution = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + substitution);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = best;
        }
    }
    rows[a.len()][b.len()]
}

/// Runs `name` with `arguments`; `None` when there is no such command.
fn dispatch(name: &str, arguments: Vec<OsString>) -> Option<u8> {
    Some(match name {
        "serve" => serve::main(arguments),
        "run" => run::main(arguments),
        "elect" => leader::elect(arguments),
        "leader" => leader::leader(arguments),
        "bench" => bench::main(arguments),
        "top" => top::main(arguments),
        "secret" => secret::main(arguments),
        name if client::is_command(name) => client::main(name, arguments),
        _ => return None,
    })
}

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.is_empty() {
        eprint!("{USAGE}");
        return ExitCode::from(exit::USAGE);
    }
    let command = args.remove(0);
    let name = command.to_str().unwrap_or("");
    let code = match name {
        "-h" | "--help" | "help" => match args.first().and_then(|topic| topic.to_str()) {
            None => {
                print!("{USAGE}");
                exit::DONE
            }
            Some("help") => {
                print!("{USAGE}");
                exit::DONE
            }
            Some(topic) if is_command(topic) => {
                dispatch(topic, vec!["--help".into()]).unwrap_or(exit::USAGE)
            }
            Some(topic) => {
                eprintln!("{}", no_such_command("kunci help", topic));
                exit::USAGE
            }
        },
        "-V" | "--version" => {
            println!("kunci {}", env!("CARGO_PKG_VERSION"));
            exit::DONE
        }
        _ => match dispatch(name, args) {
            Some(code) => code,
            None => {
                let name = command.to_string_lossy();
                eprintln!("{}", no_such_command("kunci", &name));
                exit::USAGE
            }
        },
    };
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slip_of_a_letter_names_the_command_meant() {
        assert_eq!(
            no_such_command("kunci", "aquire"),
            "kunci: there is no command \"aquire\"; did you mean acquire?\n(see kunci help)"
        );
        for (typed, meant) in [
            ("relase", "release"),
            ("rnu", "run"),
            ("lsit", "list"),
            ("leaders", "leader"),
            ("pign", "ping"),
            ("serv", "serve"),
            ("secrets", "secret"),
            ("hlep", "help"),
        ] {
            assert!(
                no_such_command("kunci", typed).contains(&format!("; did you mean {meant}?\n")),
                "{typed}: {}",
                no_such_command("kunci", typed)
            );
        }
        // Nothing close: no guess.
        assert_eq!(
            no_such_command("kunci help", "frobnicate"),
            "kunci help: there is no command \"frobnicate\"\n(see kunci help)"
        );
        assert_eq!(
            no_such_command("kunci", "x"),
            "kunci: there is no command \"x\"\n(see kunci help)"
        );
    }

    #[test]
    fn edit_distance_counts_a_swap_as_one() {
        assert_eq!(edit_distance("aquire", "acquire"), 1);
        assert_eq!(edit_distance("lsit", "list"), 1);
        assert_eq!(edit_distance("", "run"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }
}
