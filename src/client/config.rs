//! How a [`Client`](super::Client) runs: its [`Config`], and the
//! [`Secret`] it may present to a server with `--auth`.

use std::fmt;
use std::time::Duration;

#[cfg(feature = "etcd")]
use super::etcd::EtcdCredentials;
use crate::addr::Address;

/// How a [`Client`](super::Client) runs. `Config::default()` is right for
/// most uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Connections kept open to each address (default 2). Requests are
    /// spread over them, and a request that could not be sent on one
    /// moves to another.
    pub sessions_per_server: usize,
    /// How long a connection attempt may take before it counts as failed
    /// (default 1 s). A failed attempt is retried, after a short backoff,
    /// while requests wait for a session.
    pub connect_timeout: Duration,
    /// With one address: whether a connection it refuses (nothing listens
    /// on the TCP port; a unix socket that is missing, or that this user
    /// may not open) ends every request that waits for a session
    /// [`Unavailable`](super::Error::Unavailable) at once, instead of
    /// trying again until the request's deadline (default: no; the
    /// command line sets it, so that a mistyped address is said at once).
    /// Nothing was sent (spec §8 rule 4). With several addresses it has
    /// no effect: another one may take the request.
    pub end_at_refusal: bool,
    /// The secret for a server with `--auth` (spec §12): sent as `U`, the
    /// first frame of every session (default: none). One shorter than 32
    /// bytes makes every call fail [`Error::InvalidArgument`](super::Error::InvalidArgument) before
    /// anything is sent.
    pub secret: Option<Secret>,
    /// Whether [`secret`](Self::secret) may go in clear to a TCP address
    /// beyond this host (default: no). A secret goes only over `tls://`,
    /// a unix socket, or to a loopback address (127.0.0.0/8, `::1`, or the
    /// name `localhost` itself: any other name counts as remote); to any
    /// other address every call fails [`Error::InvalidArgument`](super::Error::InvalidArgument) before
    /// anything is connected or sent (spec §12.5). Set it (or use
    /// [`Config::allow_plaintext_secret`]) only on a network you trust.
    pub allow_plaintext_secret: bool,
    /// With `etcd://` addresses: the etcd user and password, when etcd has
    /// authentication on (docs/ETCD.md). Ignored for kunci servers.
    #[cfg(feature = "etcd")]
    pub etcd_credentials: Option<EtcdCredentials>,
    /// For `tls://` addresses: the CA to trust (default: the system's
    /// store) and an optional client certificate.
    #[cfg(feature = "tls")]
    pub tls: crate::tls::ClientFiles,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            sessions_per_server: 2,
            connect_timeout: Duration::from_secs(1),
            end_at_refusal: false,
            secret: None,
            allow_plaintext_secret: false,
            #[cfg(feature = "etcd")]
            etcd_credentials: None,
            #[cfg(feature = "tls")]
            tls: Default::default(),
        }
    }
}

impl Config {
    /// The same configuration, with
    /// [`allow_plaintext_secret`](Config::allow_plaintext_secret) set: the
    /// explicit opt-in to send the secret in clear beyond this host.
    pub fn allow_plaintext_secret(self, allow: bool) -> Config {
        Config {
            allow_plaintext_secret: allow,
            ..self
        }
    }

    /// Why no call can run with this configuration for `servers`: a secret
    /// that would go in clear beyond this host without the opt-in.
    pub(crate) fn plaintext_secret_problem(&self, servers: &[Address]) -> Option<&'static str> {
        let in_clear = servers
            .iter()
            .any(|address| !address.keeps_secrets_private());
        (self.secret.is_some() && in_clear && !self.allow_plaintext_secret)
            .then_some(PLAINTEXT_SECRET_REFUSED)
    }
}

/// Why a call with a secret to a plaintext address beyond this host fails.
pub const PLAINTEXT_SECRET_REFUSED: &str = "the secret would go in clear to an address beyond \
     this host: use tls://, a unix socket or a loopback address, or opt in with \
     Config::allow_plaintext_secret (kunci: --insecure-plaintext-secret or \
     KUNCI_ALLOW_PLAINTEXT_SECRET=1)";

/// A secret that lets a client in to a server with `--auth` (see
/// `kunci secret`). Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// The shortest secret a server takes.
    pub const MIN_LEN: usize = crate::protocol::SECRET_MIN;

    pub fn new(secret: impl Into<Vec<u8>>) -> Secret {
        Secret(secret.into())
    }

    /// The secret in `path`, without one trailing newline (`\n` or
    /// `\r\n`), so that a file written by `echo` or an editor works.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> std::io::Result<Secret> {
        let mut bytes = std::fs::read(path)?;
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        Ok(Secret(bytes))
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Whether a server could take it: at least [`MIN_LEN`](Self::MIN_LEN)
    /// bytes without a newline (it is one frame's payload).
    pub(crate) fn problem(&self) -> Option<&'static str> {
        if self.0.len() < Self::MIN_LEN {
            Some("secret is shorter than 32 bytes")
        } else if self.0.contains(&b'\n') {
            Some("secret contains a newline")
        } else if self.0.len() > usize::from(u8::MAX) {
            Some("secret is longer than 255 bytes")
        } else {
            None
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}
