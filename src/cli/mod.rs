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

/// Every command `kunci help COMMAND` knows.
fn is_command(name: &str) -> bool {
    matches!(
        name,
        "serve" | "run" | "bench" | "top" | "secret" | "elect" | "leader"
    ) || client::is_command(name)
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
                eprintln!("kunci help: there is no command {topic:?}\n(see kunci help)");
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
                eprintln!("kunci: there is no command {command:?}\n(see kunci help)");
                exit::USAGE
            }
        },
    };
    ExitCode::from(code)
}
