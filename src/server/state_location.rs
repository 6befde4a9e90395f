//! Where `kunci serve` keeps its state directory when no `--state-dir` is
//! given (spec §7, "state by default"): `$STATE_DIRECTORY` (systemd), else
//! `$XDG_STATE_HOME/kunci/`, else `~/.local/state/kunci/` — the last two
//! with one subdirectory per first listen address, so that two servers on
//! one host never share a directory. (systemd gives each unit its own
//! `$STATE_DIRECTORY`; an instance of another unit gets another one.)
//!
//! Pure functions of the environment's values and the bound address, so
//! that the rule is tested without touching the process environment.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::addr::Address;

/// Where the state directory is, before the listeners are bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateLocation {
    /// This directory, exactly (`--state-dir`, or `$STATE_DIRECTORY`).
    Exactly(PathBuf),
    /// The subdirectory of this one named after the first address
    /// actually bound ([`subdirectory_name`]).
    PerAddress(PathBuf),
}

impl StateLocation {
    /// The state directory of a server whose first bound address is
    /// `first` (with the port actually bound when 0 was asked).
    pub fn resolve(&self, first: &Address) -> PathBuf {
        match self {
            StateLocation::Exactly(dir) => dir.clone(),
            StateLocation::PerAddress(base) => base.join(subdirectory_name(first)),
        }
    }
}

/// The default location from the environment's values (`None` for an
/// unset or empty variable): `$STATE_DIRECTORY`'s first path (systemd
/// lists several separated by `:` when the unit names several), else
/// `$XDG_STATE_HOME/kunci`, else `$HOME/.local/state/kunci`. `None` when
/// none of them is set. Relative paths are ignored, as the XDG rules ask.
pub fn default_location(
    state_directory: Option<OsString>,
    xdg_state_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<StateLocation> {
    use std::os::unix::ffi::OsStrExt;
    let absolute =
        |value: Option<OsString>| value.map(PathBuf::from).filter(|path| path.is_absolute());
    let systemd = state_directory.and_then(|value| {
        let first = value
            .as_bytes()
            .split(|&byte| byte == b':')
            .next()?
            .to_vec();
        Some(OsString::from(std::ffi::OsStr::from_bytes(&first)))
    });
    if let Some(dir) = absolute(systemd) {
        return Some(StateLocation::Exactly(dir));
    }
    if let Some(dir) = absolute(xdg_state_home) {
        return Some(StateLocation::PerAddress(dir.join("kunci")));
    }
    absolute(home).map(|home| StateLocation::PerAddress(home.join(".local/state/kunci")))
}

/// [`default_location`] from this process's environment.
pub fn default_location_from_env() -> Option<StateLocation> {
    let var = |name| std::env::var_os(name).filter(|value| !value.is_empty());
    default_location(var("STATE_DIRECTORY"), var("XDG_STATE_HOME"), var("HOME"))
}

/// A directory name for a listen address: its text with every byte but
/// ASCII letters, digits, `.` and `-` turned into `_`, so that it names
/// one directory (no `/`, never `.` or `..`) and two addresses that differ
/// give two names: `127.0.0.1_5862`, `tls_0.0.0.0_5863`,
/// `unix_run_kunci_kunci.sock`, `___1__5862` (for `[::1]:5862`). A name
/// past 200 bytes keeps its first 150 and a hash of the whole.
pub fn subdirectory_name(address: &Address) -> String {
    let text = match address {
        Address::Tcp(host_port) => host_port.clone(),
        Address::Tls(host_port) => format!("tls_{host_port}"),
        Address::Unix(path) => format!("unix_{}", path_text(path)),
        other => other.to_string(),
    };
    let mut name: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.chars().all(|c| c == '.') {
        name = format!("_{name}");
    }
    if name.len() > 200 {
        let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        name.truncate(150);
        name.push_str(&format!("_{hash:016x}"));
    }
    name
}

fn path_text(path: &Path) -> String {
    path.to_string_lossy().trim_start_matches('/').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(text: &str) -> Option<OsString> {
        Some(text.into())
    }

    #[test]
    fn systemd_first_then_xdg_then_home() {
        assert_eq!(
            default_location(os("/var/lib/kunci:/var/lib/other"), os("/x"), os("/h")),
            Some(StateLocation::Exactly("/var/lib/kunci".into()))
        );
        assert_eq!(
            default_location(None, os("/x/state"), os("/h")),
            Some(StateLocation::PerAddress("/x/state/kunci".into()))
        );
        assert_eq!(
            default_location(None, os("relative"), os("/home/u")),
            Some(StateLocation::PerAddress(
                "/home/u/.local/state/kunci".into()
            ))
        );
        assert_eq!(default_location(os("rel"), None, None), None);
    }

    #[test]
    fn each_address_names_its_own_directory() {
        let names: Vec<String> = [
            "127.0.0.1:5862",
            "127.0.0.1:5863",
            "[::1]:5862",
            "tls://0.0.0.0:5863",
            "unix:/run/kunci/kunci.sock",
            "unix:..",
        ]
        .iter()
        .map(|text| subdirectory_name(&text.parse().unwrap()))
        .collect();
        assert_eq!(
            names,
            [
                "127.0.0.1_5862",
                "127.0.0.1_5863",
                "___1__5862",
                "tls_0.0.0.0_5863",
                "unix_run_kunci_kunci.sock",
                "unix_..",
            ]
        );
        let long = format!("unix:/{}", "a/".repeat(200));
        let name = subdirectory_name(&long.parse().unwrap());
        assert_eq!(name.len(), 150 + 17);
        let location = StateLocation::PerAddress("/s".into());
        assert_eq!(
            location.resolve(&"localhost:7".parse().unwrap()),
            PathBuf::from("/s/localhost_7")
        );
    }
}
