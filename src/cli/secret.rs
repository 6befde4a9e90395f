//! `kunci secret NAME SCOPE…`: a new random secret and the `--auth` file
//! line that lets it in (spec §12.1).

use std::ffi::OsString;
use std::io::Read;

use super::exit;
use crate::core::access::{self, hash_hex};

const HELP: &str = "\
kunci secret — make a secret and its --auth file line

Usage: kunci secret NAME SCOPE...

Prints a new random secret (256 bits from the operating system, as 64 hex
digits) on the first line, and the line for `kunci serve --auth FILE` on the
second. The file line holds only the secret's SHA-256: keep the first line
where the client reads it (--secret-file FILE or KUNCI_SECRET), put the
second in the server's file.

Scopes (at least one):
  lock:PREFIX   take, release, renew, query and list keys starting with
                PREFIX (lock:* = every key)
  read:PREFIX   query and list keys starting with PREFIX (read:* = every key)
  info          the server's counters (kunci info, kunci top)
Every authenticated client may ping.

Quotas (optional, after the scopes; each at most once):
  max-keys=N    keys this identity's requests may bring into the table
  max-grants=N  grants plus queued waiters its sessions may hold at once
  max-watches=N watches (held O: followed keys) its sessions may hold at once
  max-connections=N
                sessions authenticated as it at once; one more is refused

Example: kunci secret ci lock:ci/ read:* info
";

/// The secret's length in random bytes.
const SECRET_BYTES: usize = 32;

pub fn main(arguments: Vec<OsString>) -> u8 {
    let mut words = Vec::new();
    for argument in arguments {
        match argument.to_str() {
            Some("-h" | "--help") => {
                print!("{HELP}");
                return exit::DONE;
            }
            Some(word) => words.push(word.to_owned()),
            None => return usage(&format!("not UTF-8: {argument:?}")),
        }
    }
    let Some((name, scopes)) = words.split_first() else {
        return usage("missing NAME and SCOPE");
    };
    if let Err(reason) = access::validate_name(name) {
        return usage(&reason);
    }
    let scope_words: Vec<&str> = scopes.iter().map(String::as_str).collect();
    let (quota_words, bare_scopes): (Vec<&str>, Vec<&str>) = scope_words
        .iter()
        .partition(|word| word.starts_with("max-"));
    if let Err(reason) =
        access::parse_scopes(&bare_scopes).and_then(|_| access::parse_quota(&quota_words))
    {
        return usage(&reason);
    }
    // The server reads the file line by its own parser, which splits at
    // white space: a scope with a blank in it (one shell word here) would
    // print a line that stops the server from starting. Check the line
    // that will be printed, with a stand-in hash, by that very parser.
    if let Some(scope) = scope_words
        .iter()
        .find(|scope| scope.chars().any(|c| c.is_whitespace() || c.is_control()))
    {
        return usage(&format!(
            "scope {scope:?} has a blank or a control character: the server reads a \
             line as words split at blanks, so it would not read this scope"
        ));
    }
    let sample = format!("{name} {} {}", hash_hex(b""), scope_words.join(" "));
    match access::AccessList::parse(&sample) {
        Ok(list) if list.len() == 1 => {}
        Ok(_) => {
            return usage(&format!(
                "the server would read a line that starts with {name:?} as a comment"
            ));
        }
        Err(reason) => {
            let reason = reason.to_string();
            let reason = reason.strip_prefix("line 1: ").unwrap_or(&reason);
            return usage(&format!("the server would not read this line: {reason}"));
        }
    }
    let mut random = [0u8; SECRET_BYTES];
    if let Err(e) = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut random))
    {
        eprintln!("kunci secret: cannot read /dev/urandom: {e}");
        return 1;
    }
    let secret: String = random.iter().map(|byte| format!("{byte:02x}")).collect();
    println!("{secret}");
    println!(
        "{name} {} {}",
        hash_hex(secret.as_bytes()),
        scope_words.join(" ")
    );
    exit::DONE
}

fn usage(message: &str) -> u8 {
    eprintln!("kunci secret: {message}\n(see kunci secret --help)");
    exit::USAGE
}
