//! The permit and label options of `kunci acquire` and `kunci run` (spec
//! §9): `--limit N [--take K] | --shared | --exclusive`, `--label TEXT`,
//! and the label `kunci run` gives its grant by default.

use std::ffi::{CStr, OsString};

use super::args;
use crate::client::{AcquireOptions, Permits};
use crate::protocol::LABEL_LEN_MAX;

/// The help lines of these options (no final newline), as a literal for
/// `concat!`.
macro_rules! options_help {
    () => {
        "  --limit N       take one permit of a semaphore of N (1..=65535): at most
                  N holders at once; the first request names the key's
                  limit, and one naming another gets exit 2
  --take K        with --limit: take K permits (1..=N) instead of one
  --shared        a shared lock: held together with other shared holders,
                  never with an exclusive one (a reader)
  --exclusive     the whole key, nobody else at the same time (the
                  default; a writer); with --limit N it names the limit
  --label TEXT    who is asking, shown with the grant (at most 128 bytes;
                  `kunci run` says `USER@HOST pid=PID PROGRAM` by default,
                  and CMD's arguments too with --label-args)"
    };
}
pub(super) use options_help;

/// The permit options as given, checked together by [`PermitFlags::options`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct PermitFlags {
    limit: Option<u16>,
    take: Option<u16>,
    shared: bool,
    exclusive: bool,
    label: Option<String>,
}

impl PermitFlags {
    /// Whether `--name` is one of these options.
    pub(super) fn is_option(name: &str) -> bool {
        matches!(name, "limit" | "take" | "shared" | "exclusive" | "label")
    }

    /// Takes option `--name` (one that [`is_option`](Self::is_option)
    /// accepted), reading its value from `parser` when it has one.
    pub(super) fn take_option(
        &mut self,
        name: &str,
        parser: &mut lexopt::Parser,
    ) -> Result<(), String> {
        match name {
            "limit" => {
                let limit: u16 = args::number("--limit", parser.value())?;
                if limit == 0 {
                    return Err("--limit: a semaphore needs at least 1 permit".into());
                }
                self.limit = Some(limit);
            }
            "take" => {
                let take: u16 = args::number("--take", parser.value())?;
                if take == 0 {
                    return Err(
                        "--take: take at least 1 permit (--exclusive takes them all)".into(),
                    );
                }
                self.take = Some(take);
            }
            "shared" => self.shared = true,
            "exclusive" => self.exclusive = true,
            _ => {
                let label = args::text(parser.value())?;
                if label.len() > LABEL_LEN_MAX {
                    return Err(format!(
                        "--label: {} bytes is longer than {LABEL_LEN_MAX}",
                        label.len()
                    ));
                }
                if label.contains('\n') {
                    return Err("--label: a label cannot contain a newline".into());
                }
                self.label = Some(label);
            }
        }
        Ok(())
    }

    /// What the options ask for, or the usage error. Without `--label`,
    /// the label is `default_label`.
    pub(super) fn options(&self, default_label: Option<String>) -> Result<AcquireOptions, String> {
        let permits = match *self {
            PermitFlags {
                shared: true,
                exclusive: true,
                ..
            } => return Err("--shared and --exclusive exclude each other".into()),
            PermitFlags {
                shared: true,
                limit,
                take,
                ..
            } if limit.is_some() || take.is_some() => {
                return Err(
                    "--shared is a lock of 65535 permits taking 1: it cannot be \
                            combined with --limit or --take"
                        .into(),
                );
            }
            PermitFlags {
                take: Some(_),
                limit: None,
                ..
            } => {
                return Err("--take needs --limit N (the key's number of permits)".into());
            }
            PermitFlags {
                exclusive: true,
                take: Some(_),
                ..
            } => {
                return Err(
                    "--exclusive takes every permit: it cannot be combined with --take".into(),
                );
            }
            PermitFlags { shared: true, .. } => Permits::shared(),
            PermitFlags {
                limit: Some(limit),
                exclusive: true,
                ..
            } => Permits::limit(limit).take(0),
            PermitFlags {
                limit: Some(limit),
                take,
                ..
            } => {
                let take = take.unwrap_or(1);
                if take > limit {
                    return Err(format!(
                        "--take {take} is more than --limit {limit}: a request cannot take \
                         more permits than the key has"
                    ));
                }
                Permits::limit(limit).take(take)
            }
            PermitFlags { .. } => Permits::exclusive(),
        };
        let label = self.label.clone().or(default_label).unwrap_or_default();
        Ok(AcquireOptions::new().permits(permits).label(label))
    }
}

/// The label `kunci run` gives its grant unless `--label` says otherwise:
/// `USER@HOST pid=PID PROGRAM`, with kunci's own pid, cut to 128 bytes at
/// a character boundary. CMD's arguments only with `--label-args`: a
/// command line may carry a password, and every session with a `read:`
/// scope sees the label.
pub(super) fn run_label(command: &[OsString], with_arguments: bool) -> String {
    let user = std::env::var("USER")
        .ok()
        .filter(|user| !user.is_empty())
        .or_else(user_of_uid)
        .unwrap_or_else(|| rustix::process::getuid().as_raw().to_string());
    let host = host_name().unwrap_or_else(|| "localhost".into());
    let shown = if with_arguments {
        command
    } else {
        &command[..command.len().min(1)]
    };
    let command: Vec<String> = shown
        .iter()
        .map(|word| word.to_string_lossy().into_owned())
        .collect();
    let label = format!(
        "{user}@{host} pid={} {}",
        std::process::id(),
        command.join(" ")
    )
    .replace('\n', " ");
    truncate_to_char_boundary(&label, LABEL_LEN_MAX).to_owned()
}

/// `text` cut to at most `max` bytes at a character boundary.
fn truncate_to_char_boundary(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The name of this process's user in the password database.
fn user_of_uid() -> Option<String> {
    let mut buffer = vec![0u8; 4096];
    let uid = rustix::process::getuid().as_raw();
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: `passwd` is plain old data (integers and pointers, all-zero
    // valid) that getpwuid_r fills in; every pointer passed is valid for
    // the size given, and getpwuid_r writes the strings of `entry` into
    // `buffer`, which outlives their use here. On success `pw_name`, when
    // not null, points to a NUL-terminated string in `buffer`.
    let name = unsafe {
        let mut entry: libc::passwd = std::mem::zeroed();
        let status = libc::getpwuid_r(
            uid,
            &mut entry,
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            &mut found,
        );
        if status != 0 || found.is_null() || entry.pw_name.is_null() {
            return None;
        }
        CStr::from_ptr(entry.pw_name)
    };
    Some(name.to_string_lossy().into_owned()).filter(|name| !name.is_empty())
}

/// This host's name (uname's node name, which gethostname reads).
fn host_name() -> Option<String> {
    let uname = rustix::system::uname();
    let name = uname.nodename().to_string_lossy().into_owned();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(arguments: &[&str]) -> Result<AcquireOptions, String> {
        let mut parser = lexopt::Parser::from_args(arguments.iter().map(OsString::from));
        let mut flags = PermitFlags::default();
        while let Some(argument) = parser.next().map_err(|e| e.to_string())? {
            let lexopt::Arg::Long(name) = argument else {
                panic!("{argument:?}");
            };
            let name = name.to_owned();
            assert!(PermitFlags::is_option(&name), "{name}");
            flags.take_option(&name, &mut parser)?;
        }
        flags.options(None)
    }

    fn permits(arguments: &[&str]) -> Result<Permits, String> {
        flags(arguments).map(|options| options.get_permits())
    }

    #[test]
    fn each_kind_of_lock_has_its_options() {
        assert_eq!(permits(&[]), Ok(Permits::exclusive()));
        assert_eq!(permits(&["--exclusive"]), Ok(Permits::exclusive()));
        assert_eq!(permits(&["--shared"]), Ok(Permits::shared()));
        assert_eq!(permits(&["--limit", "3"]), Ok(Permits::limit(3)));
        assert_eq!(
            permits(&["--limit", "3", "--take", "3"]),
            Ok(Permits::limit(3).take(3))
        );
        assert_eq!(
            permits(&["--take", "2", "--limit", "3"]),
            Ok(Permits::limit(3).take(2))
        );
        assert_eq!(
            permits(&["--limit", "5", "--exclusive"]),
            Ok(Permits::limit(5).take(0))
        );
        assert_eq!(permits(&["--limit", "65535"]), Ok(Permits::limit(65535)));
    }

    #[test]
    fn contradictions_and_bad_counts_are_usage_errors() {
        for (arguments, expected) in [
            (&["--take", "2"][..], "--take needs --limit"),
            (&["--shared", "--limit", "3"], "--shared is a lock of 65535"),
            (&["--limit", "3", "--shared"], "--shared is a lock of 65535"),
            (&["--shared", "--take", "1"], "--shared is a lock of 65535"),
            (&["--shared", "--exclusive"], "--shared and --exclusive"),
            (
                &["--exclusive", "--limit", "3", "--take", "1"],
                "--exclusive takes every",
            ),
            (
                &["--limit", "3", "--take", "4"],
                "--take 4 is more than --limit 3",
            ),
            (&["--limit", "0"], "--limit: a semaphore needs at least 1"),
            (&["--limit", "3", "--take", "0"], "--take: take at least 1"),
            (
                &["--limit", "65536"],
                "--limit: 65536 is out of range 0..=65535",
            ),
            (&["--limit", "-1"], "--limit: invalid value"),
            (&["--limit", "x"], "--limit: invalid value"),
        ] {
            let error = flags(arguments).unwrap_err();
            assert!(error.starts_with(expected), "{arguments:?}: {error}");
        }
    }

    #[test]
    fn a_label_is_at_most_128_bytes_and_one_line() {
        let full = "l".repeat(128);
        assert_eq!(
            flags(&["--label", &full]).map(|o| o.get_label().len()),
            Ok(128)
        );
        let error = flags(&["--label", &"l".repeat(129)]).unwrap_err();
        assert_eq!(error, "--label: 129 bytes is longer than 128");
        assert!(flags(&["--label", "a\nb"]).is_err());
        // The given label wins over the default one.
        let given = PermitFlags {
            label: Some("mine".into()),
            ..PermitFlags::default()
        };
        assert_eq!(
            given.options(Some("default".into())).unwrap().get_label(),
            "mine"
        );
        assert_eq!(
            PermitFlags::default()
                .options(Some("default".into()))
                .unwrap()
                .get_label(),
            "default"
        );
    }

    #[test]
    fn the_run_label_names_user_host_pid_and_command_within_128_bytes() {
        let command: Vec<OsString> = vec!["sh".into(), "-c".into(), "echo hi".into()];
        let label = run_label(&command, true);
        let pid = format!(" pid={} sh -c echo hi", std::process::id());
        assert!(label.ends_with(&pid), "{label}");
        // By default, the program only: arguments may be secrets.
        let label = run_label(&command, false);
        assert!(
            label.ends_with(&format!(" pid={} sh", std::process::id())),
            "{label}"
        );
        let (user_at_host, _) = label.split_once(' ').unwrap();
        let (user, host) = user_at_host.split_once('@').unwrap();
        assert!(!user.is_empty() && !host.is_empty(), "{label}");
        // A long command is cut at a character boundary.
        let long: Vec<OsString> = vec!["€".repeat(100).into()];
        let label = run_label(&long, false);
        assert!(label.len() <= 128 && label.len() > 120, "{}", label.len());
        assert!(label.ends_with('€'));
        assert!(!run_label(&["a\nb".into()], false).contains('\n'));
    }

    #[test]
    fn truncation_keeps_whole_characters() {
        assert_eq!(truncate_to_char_boundary("abc", 128), "abc");
        assert_eq!(truncate_to_char_boundary("abcdef", 3), "abc");
        // "é" is 2 bytes: a cut inside it drops the whole character.
        assert_eq!(truncate_to_char_boundary("aé", 2), "a");
        assert_eq!(truncate_to_char_boundary("aé", 3), "aé");
        let long = "€".repeat(50);
        let cut = truncate_to_char_boundary(&long, 128);
        assert_eq!(cut.len(), 126);
        assert!(cut.chars().all(|c| c == '€'));
    }
}
