//! Server addresses: `HOST:PORT` for TCP, `unix:PATH` for a Unix socket.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// The default address a server listens on and a client connects to:
/// loopback only, so that exposing the server is an explicit choice.
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:5862";

/// Where a server listens or a client connects.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Address {
    /// `HOST:PORT`; the host may be a name, resolved when used.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
}

/// An address that is neither `HOST:PORT` nor `unix:PATH`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressError(pub String);

impl fmt::Display for AddressError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid address {:?}: expected HOST:PORT or unix:PATH",
            self.0
        )
    }
}

impl std::error::Error for AddressError {}

impl FromStr for Address {
    type Err = AddressError;

    fn from_str(text: &str) -> Result<Address, AddressError> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(AddressError(text.to_owned()));
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        let Some((host, port)) = text.rsplit_once(':') else {
            return Err(AddressError(text.to_owned()));
        };
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(AddressError(text.to_owned()));
        }
        Ok(Address::Tcp(text.to_owned()))
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Tcp(host_port) => f.write_str(host_port),
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_and_unix() {
        assert_eq!(
            "127.0.0.1:5862".parse(),
            Ok(Address::Tcp("127.0.0.1:5862".into()))
        );
        assert_eq!("[::1]:0".parse(), Ok(Address::Tcp("[::1]:0".into())));
        assert_eq!(
            "unix:/tmp/k.sock".parse(),
            Ok(Address::Unix("/tmp/k.sock".into()))
        );
        for bad in ["", "unix:", "localhost", ":5862", "host:port", "host:70000"] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
    }
}
