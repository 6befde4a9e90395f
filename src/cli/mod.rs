//! The `kunci` command line: one binary, one subcommand per job. `main`
//! parses, runs, and maps outcomes to the documented exit codes (spec §9).

pub mod args;
mod bench;
mod client;
mod run;
mod serve;

use std::ffi::OsString;
use std::process::ExitCode;

/// Exit codes of client commands (spec §9).
pub mod exit {
    pub const DONE: u8 = 0;
    pub const TIMEOUT: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const BUSY: u8 = 3;
    pub const UNAVAILABLE: u8 = 4;
    pub const INDETERMINATE: u8 = 5;
    pub const NOT_HELD: u8 = 6;
}

const USAGE: &str = "\
kunci — a small, exact, fast lock server

Usage:
  kunci serve [--listen ADDR]... [limits]   run the server
  kunci acquire KEY [--wait S] [--lease S]  take a lock, print its token
  kunci release KEY TOKEN                   release a lock
  kunci renew KEY TOKEN [--lease S]         extend a lock's lease
  kunci query KEY                           show who holds a key
  kunci info                                show the server's counters
  kunci ping                                measure the round-trip time
  kunci run KEY [options] -- CMD [ARGS]...  run a command under a lock
  kunci bench [options]                     load-test a server

`kunci COMMAND --help` describes each command's options.
";

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    if args.is_empty() {
        eprint!("{USAGE}");
        return ExitCode::from(exit::USAGE);
    }
    let command = args.remove(0);
    let code = match command.to_str().unwrap_or("") {
        "serve" => serve::main(args),
        "run" => run::main(args),
        "bench" => bench::main(args),
        name if client::is_command(name) => client::main(name, args),
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            exit::DONE
        }
        "-V" | "--version" => {
            println!("kunci {}", env!("CARGO_PKG_VERSION"));
            exit::DONE
        }
        other => {
            eprintln!("kunci: unknown command {other:?}\n\n{USAGE}");
            exit::USAGE
        }
    };
    ExitCode::from(code)
}
