//! The official kunci client.
//!
//! A [`Client`] talks to one lock service, reachable at one or more
//! [`Address`]es. It is cheap to clone and `Send + Sync`: many threads
//! share one client, and their requests are pipelined over a few
//! connections ("sessions") by one background I/O thread. Each call blocks
//! its own thread until its outcome is known, and never longer than its
//! deadline.
//!
//! Every call follows the same rules (spec §8): its input is checked before
//! anything is sent; it has one deadline `D`, fixed when it starts; a
//! request the socket has not taken a byte of may move to another session
//! until `D`, and then the call fails with [`Error::Unavailable`]; a request
//! that may have been sent is never sent again, and if no answer comes by
//! `D` (or its session dies first) the call fails with
//! [`Error::Indeterminate`]. For [`Client::acquire`],
//! `D = start + wait + 5 s`; for every other call, `D = start + 5 s`.
//!
//! The fencing token of a [`Ticket`] is what makes a lock safe: a resource
//! the lock protects should refuse work that carries a smaller token than
//! one it has already seen. `docs/CLIENT.md` explains every outcome and how
//! to use the token.
//!
//! A lock is exclusive unless [`Client::acquire_with`] asks for other
//! [`Permits`]: a shared lock, or some permits of a semaphore (spec §10).
//!
//! To hold a lock for longer than one lease, [`Ticket::keep_alive`] hands
//! the ticket to the client's I/O thread, which renews it every lease/3 and
//! reports a loss at once ([`KeptLease`]).
//!
//! [`Client`] has an example.

mod backend;
mod engine;
#[cfg(feature = "etcd")]
mod etcd;
mod io;
mod keep_alive;
mod kept;
mod leader;
mod listing;
mod permits;
mod ticket;
mod wait_forever;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::addr::Address;
use engine::{Key, Op, Outcome, Submission};

pub use engine::KeyState;
#[cfg(feature = "etcd")]
pub use etcd::EtcdCredentials;
pub use keep_alive::Loss;
pub use kept::KeptLease;
pub use leader::{Leader, Observe};
pub use listing::{Grant, Holders, KeyPage, KeySummary, Keys, Waiter};
pub use permits::{AcquireOptions, Permits};
pub use ticket::Ticket;

/// The transport deadline: how long past its wait a call may take (spec
/// §8.2). It is part of the contract, not a setting.
pub const TRANSPORT_DEADLINE: Duration = Duration::from_secs(5);

/// The longest wait an acquire may ask for.
pub const WAIT_MAX: Duration = Duration::from_secs(255);

/// The longest lease (a whole number of seconds, at least one).
pub const LEASE_MAX: Duration = Duration::from_secs(255);

/// How a [`Client`] runs. `Config::default()` is right for most uses.
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
    /// The secret for a server with `--auth` (spec §12): sent as `U`, the
    /// first frame of every session (default: none). One shorter than 32
    /// bytes makes every call fail [`Error::InvalidArgument`] before
    /// anything is sent.
    pub secret: Option<Secret>,
    /// Whether [`secret`](Self::secret) may go in clear to a TCP address
    /// beyond this host (default: no). A secret goes only over `tls://`,
    /// a unix socket, or to a loopback address (127.0.0.0/8, `::1`, or the
    /// name `localhost` itself: any other name counts as remote); to any
    /// other address every call fails [`Error::InvalidArgument`] before
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
    pub const MIN_LEN: usize = crate::core::access::SECRET_MIN;

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

/// Why a call did not succeed. Each variant says what the caller may
/// conclude from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// The server answered `T`: the key stayed held for the whole wait (or,
    /// with a zero wait, was held at the one attempt). Definitive: nothing
    /// was acquired and nothing is queued. Trying again is safe.
    Timeout,
    /// The server answered `B`: it had no capacity for the request, or is
    /// shutting down. Definitive: nothing was acquired or queued. Trying
    /// again later is safe.
    Busy,
    /// No server executed the request by the deadline: no byte of it
    /// reached any connection, or the only sessions that had it were
    /// refused at accept (`X 7`, `X 9`). Definitive: nothing changed. The
    /// reason tells which.
    Unavailable(Unavailable),
    /// The request may have reached the server, but its answer was not
    /// seen in time (no answer by the deadline, the connection died, or a
    /// grant arrived too late to hand over). The key may be held by this
    /// call's grant until its lease runs out. For an acquire: do **not**
    /// enter the critical section; a grant nobody saw is reclaimed by the
    /// server at the end of its lease (and a grant that arrived late is
    /// released by the client). For a release or renew: the lease may or
    /// may not have changed.
    Indeterminate,
    /// The input was rejected before anything was sent (or, if the server
    /// disagreed with the client's checks, by the server). Nothing changed.
    /// The text names the problem.
    InvalidArgument(&'static str),
    /// The server answered `N`: the token is not the key's active grant
    /// (its lease ran out, it was released, or it never existed). Nothing
    /// changed. A holder that gets this has lost the lock.
    NotHeld,
    /// The server answered `X 10`: the acquire named a limit other than
    /// the one the key has now (set by the first request that named one,
    /// and kept while the key has grants or waiters). Definitive: nothing
    /// was acquired or queued. `key_limit` is the key's limit, as the
    /// server's message names it.
    LimitMismatch { key_limit: Option<u16> },
    /// The server refused the request (spec §12). Definitive: nothing was
    /// executed; trying again with the same secret gives the same answer.
    PermissionDenied(Denied),
}

/// Why a request was [`Error::PermissionDenied`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denied {
    /// The server has `--auth` and did not take this client's secret (none
    /// configured, or one it does not know): `X 12` as the first answer of
    /// a session, which executed none of its requests.
    NotAuthenticated,
    /// The secret's scopes do not cover this key or operation (`X 13`).
    NotPermitted,
    /// Over TLS, the server refused this client's certificate, or its
    /// absence; the text names the problem.
    Certificate(&'static str),
}

/// Why a request was [`Error::Unavailable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// No server could be reached (connects failed or timed out, or
    /// sessions died before a byte of the request was written).
    Unreachable,
    /// The server refused the session at its connection limit (`X 7`).
    ConnectionLimit,
    /// The server refused the session: this client's address is not in
    /// its `--allow` list (`X 9`).
    NotAllowed,
    /// This client does not trust the server: its TLS certificate failed
    /// verification, for the reason given (or the handshake failed).
    Untrusted(&'static str),
    /// The peer at the address is no kunci server, or speaks TLS where
    /// plain TCP was addressed (or the reverse): its first bytes were no
    /// answer this client can read. The text says which. Nothing was
    /// executed, and waiting does not change it.
    WrongProtocol(&'static str),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Timeout => f.write_str("timeout: the key stayed held for the whole wait"),
            Error::Busy => f.write_str("busy: the server has no capacity for the request"),
            Error::Unavailable(Unavailable::Unreachable) => {
                f.write_str("unavailable: no server could be reached; nothing was sent")
            }
            Error::Unavailable(Unavailable::ConnectionLimit) => f.write_str(
                "unavailable: the server is at its connection limit; nothing was executed",
            ),
            Error::Unavailable(Unavailable::NotAllowed) => f.write_str(
                "unavailable: the server does not allow this client's address; nothing was executed",
            ),
            Error::Unavailable(Unavailable::Untrusted(why)) => {
                write!(f, "unavailable: TLS: {why}; nothing was sent")
            }
            Error::Unavailable(Unavailable::WrongProtocol(why)) => {
                write!(f, "unavailable: {why}; nothing was executed")
            }
            Error::Indeterminate => f.write_str(
                "indeterminate: the request may have reached the server but no answer \
                 came in time; do not assume the lock is held",
            ),
            Error::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            Error::NotHeld => f.write_str("not held: that token is not the key's active grant"),
            Error::LimitMismatch {
                key_limit: Some(limit),
            } => write!(
                f,
                "limit mismatch: the key has a limit of {limit} permits; nothing was acquired"
            ),
            Error::LimitMismatch { key_limit: None } => f.write_str(
                "limit mismatch: the key has another limit of permits; nothing was acquired",
            ),
            Error::PermissionDenied(Denied::NotAuthenticated) => f.write_str(
                "permission denied: the server wants a secret it knows (--secret-file or \
                 KUNCI_SECRET); nothing was executed",
            ),
            Error::PermissionDenied(Denied::NotPermitted) => f.write_str(
                "permission denied: this secret's scopes do not cover that key or request; \
                 nothing changed",
            ),
            Error::PermissionDenied(Denied::Certificate(why)) => {
                write!(f, "permission denied: {why}")
            }
        }
    }
}

impl std::error::Error for Error {}

/// What `Q` tells about a key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyStatus {
    /// The active grant's token; 0 when no grant is known.
    pub token: u64,
    /// The owner id of the request that was granted.
    pub owner: u64,
    /// Time left on the lease, rounded up, in milliseconds.
    pub lease_ms: u32,
    /// Requests queued on the key.
    pub waiters: u32,
}

impl KeyStatus {
    /// Whether the key is free: no grant, no lease horizon, no waiters.
    pub fn is_free(&self) -> bool {
        *self == KeyStatus::default()
    }
}

/// A handle to the lock service (see the [module docs](self)).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use kunci::client::{Client, Config, Error};
/// # // A server on a free loopback port, so that the example runs.
/// # let listen = vec!["127.0.0.1:0".parse()?];
/// # let server = kunci::server::Server::bind(kunci::server::Config { listen, ..Default::default() })?;
/// # let address = server.addresses()[0].to_string();
/// # let stop = server.shutdown_handle();
/// # let running = std::thread::spawn(move || server.run());
///
/// let client = Client::new([address.parse()?], Config::default())?;
/// let wait = Duration::from_secs(2);
/// let lease = Duration::from_secs(30);
/// match client.acquire("invoices", wait, lease) {
///     Ok(ticket) => {
///         // Pass ticket.token() to the resource so that it can fence out
///         // older holders, then do the work.
///         println!("holding {} with token {}", ticket.key(), ticket.token());
///         ticket.release()?;
///     }
///     Err(Error::Timeout) => println!("someone else holds it"),
///     // Indeterminate included: never work without a ticket.
///     Err(error) => return Err(error.into()),
/// }
/// assert!(client.query("invoices")?.is_free());
/// # stop.shut_down();
/// # running.join().unwrap()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Backend,
    owner_base: u64,
    next_owner: AtomicU64,
    next_nonce: AtomicU64,
    next_keep: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The I/O thread finishes the background releases it has (each
        // bounded by its own deadline), then exits.
        self.shared.close();
    }
}

/// Where requests go: kunci servers through the I/O thread, or an etcd
/// cluster (`etcd://`, docs/ETCD.md). Both give the same outcomes.
enum Backend {
    Kunci(Arc<io::Shared>),
    #[cfg(feature = "etcd")]
    Etcd(Arc<etcd::Shared>),
}

/// The TLS configuration of `etcds://` members.
#[cfg(all(feature = "etcd", feature = "tls"))]
fn etcd_tls(tls: bool, config: &Config) -> std::io::Result<etcd::http::Tls> {
    if !tls {
        return Ok(None);
    }
    crate::tls::client_config(&config.tls)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("TLS: {e}")))
}

#[cfg(all(feature = "etcd", not(feature = "tls")))]
fn etcd_tls(tls: bool, _: &Config) -> std::io::Result<etcd::http::Tls> {
    if tls {
        return Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "etcds:// needs kunci built with the `tls` feature",
        ));
    }
    Ok(None)
}

impl Backend {
    fn start(servers: Vec<Address>, config: &Config) -> std::io::Result<Backend> {
        let etcd: Vec<&Address> = servers
            .iter()
            .filter(|address| matches!(address, Address::Etcd { .. }))
            .collect();
        if etcd.is_empty() {
            let tls = io::tls_config(&servers, config)?;
            return io::start(servers, config, tls).map(Backend::Kunci);
        }
        if etcd.len() != servers.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "etcd:// addresses cannot be mixed with kunci servers",
            ));
        }
        #[cfg(feature = "etcd")]
        {
            let tls = servers
                .iter()
                .any(|address| matches!(address, Address::Etcd { tls: true, .. }));
            let endpoints = servers
                .into_iter()
                .flat_map(|address| match address {
                    Address::Etcd { endpoints, .. } => endpoints,
                    _ => Vec::new(),
                })
                .collect();
            let tls = etcd_tls(tls, config)?;
            etcd::Shared::start(
                endpoints,
                config.connect_timeout,
                config.etcd_credentials.clone(),
                tls,
            )
            .map(Backend::Etcd)
        }
        #[cfg(not(feature = "etcd"))]
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "this kunci was built without etcd support (cargo feature `etcd`)",
        ))
    }

    fn call(&self, submission: Submission<backend::Reply>) -> Outcome {
        match self {
            Backend::Kunci(shared) => shared.call(submission),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.call(submission),
        }
    }

    fn submit(&self, submission: Submission<backend::Reply>) -> bool {
        match self {
            Backend::Kunci(shared) => shared.submit(submission),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.submit(submission),
        }
    }

    fn send(&self, message: backend::Message) -> bool {
        match self {
            Backend::Kunci(shared) => shared.send(message),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.send(message),
        }
    }

    fn shutdown_notices(&self) -> u64 {
        match self {
            Backend::Kunci(shared) => shared.shutdown_notices(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => 0,
        }
    }

    fn last_connect_failure(&self) -> Option<String> {
        match self {
            Backend::Kunci(shared) => shared.last_connect_failure(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => None,
        }
    }

    fn close(&self) {
        match self {
            Backend::Kunci(shared) => shared.close(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(shared) => shared.close(),
        }
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    /// A client for the service at `servers` (several addresses of the same
    /// service). Nothing is connected until the first call needs it.
    ///
    /// Fails if `servers` is empty or the I/O thread cannot be started.
    pub fn new(
        servers: impl IntoIterator<Item = Address>,
        config: Config,
    ) -> std::io::Result<Client> {
        let servers: Vec<Address> = servers.into_iter().collect();
        if servers.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a client needs at least one server address",
            ));
        }
        let shared = Backend::start(servers, &config)?;
        Ok(Client {
            inner: Arc::new(Inner {
                shared,
                owner_base: random_u64(),
                next_owner: AtomicU64::new(0),
                next_nonce: AtomicU64::new(random_u64()),
                next_keep: AtomicU64::new(0),
            }),
        })
    }

    /// Takes the lock on `key`, waiting up to `wait` for it, with a lease
    /// of `lease` (whole seconds, 1..=255).
    ///
    /// `wait` may have a fraction and is at most 255 s; a zero wait makes
    /// one immediate attempt. The call returns by `start + wait + 5 s`.
    /// On success the [`Ticket`] holds the fencing token; dropping it
    /// releases the lock in the background.
    pub fn acquire(&self, key: &str, wait: Duration, lease: Duration) -> Result<Ticket, Error> {
        self.acquire_with(key, wait, lease, AcquireOptions::new())
    }

    /// As [`acquire`](Self::acquire), asking for the [`Permits`] and with
    /// the label that `options` give (a [`Permits`] alone will do).
    ///
    /// Everything is checked before anything is sent
    /// ([`Error::InvalidArgument`]): a `take` needs a limit and may not
    /// pass it, and a label is at most 128 bytes without a newline. A
    /// limit other than the key's ends [`Error::LimitMismatch`]. The ticket
    /// holds its own grant, with its own token and lease, whatever other
    /// grants share the key.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use kunci::client::{AcquireOptions, Client, Config, Permits};
    /// # let client = Client::new(["127.0.0.1:5862".parse()?], Config::default())?;
    /// // At most three backups at once.
    /// let wait = Duration::from_secs(60);
    /// let lease = Duration::from_secs(30);
    /// let options = AcquireOptions::new()
    ///     .permits(Permits::limit(3))
    ///     .label("backup of db1");
    /// let ticket = client.acquire_with("backups", wait, lease, options)?;
    /// // Many readers or one writer.
    /// let reader = client.acquire_with("catalog", wait, lease, Permits::shared())?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire_with(
        &self,
        key: &str,
        wait: Duration,
        lease: Duration,
        options: impl Into<AcquireOptions>,
    ) -> Result<Ticket, Error> {
        self.acquire_as(self.fresh_owner(), key, wait, lease, options.into())
    }

    /// [`acquire_with`](Self::acquire_with) with a given owner id (from
    /// [`fresh_owner`](Self::fresh_owner)), so that the caller can find
    /// the call's grant after an `Indeterminate` (spec §8 rule 11).
    pub(crate) fn acquire_as(
        &self,
        owner: u64,
        key: &str,
        wait: Duration,
        lease: Duration,
        options: AcquireOptions,
    ) -> Result<Ticket, Error> {
        let key = Key::new(key).map_err(Error::InvalidArgument)?;
        if wait > WAIT_MAX {
            return Err(Error::InvalidArgument("wait is longer than 255 s"));
        }
        let lease_s = lease_seconds(lease)?;
        let permits = options.get_permits();
        permits.check().map_err(Error::InvalidArgument)?;
        let label = permits::Label::new(options.get_label()).map_err(Error::InvalidArgument)?;
        let start = Instant::now();
        let wait_until = start + wait;
        let deadline = wait_until + TRANSPORT_DEADLINE;
        let op = Op::Acquire {
            owner,
            lease_s,
            wait_until: (!wait.is_zero()).then_some(wait_until),
            permits,
            label,
        };
        match self.call(op, key, deadline) {
            Outcome::Acquired { token, sent_at } => {
                // The hand-over gate (rule 7): only a grant handed over
                // before `D` reaches the caller.
                if Instant::now() >= deadline {
                    self.release_in_background(key, token);
                    return Err(Error::Indeterminate);
                }
                Ok(Ticket::new(
                    self.clone(),
                    key,
                    token,
                    permits,
                    lease,
                    sent_at,
                ))
            }
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// Takes the lock on `key` as [`acquire`](Self::acquire) does and keeps
    /// its lease alive ([`Ticket::keep_alive_fresh`]): a grant that arrived
    /// with less than two thirds of its lease left is renewed once before it
    /// is returned, and if that renewal finds it gone the call fails with
    /// [`Error::NotHeld`] (the lock was lost before it was handed over).
    pub fn acquire_kept(
        &self,
        key: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<KeptLease, Error> {
        self.acquire(key, wait, lease)?.keep_alive_fresh()
    }

    /// Releases the grant `token` of `key`.
    ///
    /// `Ok` when the server released it; [`Error::NotHeld`] when that token
    /// was not the active grant.
    pub fn release(&self, key: &str, token: u64) -> Result<(), Error> {
        let key = Key::new(key).map_err(Error::InvalidArgument)?;
        match self.call_now(Op::Release { token }, key) {
            Outcome::Released => Ok(()),
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// Resets the lease of grant `token` of `key` to `lease` from now.
    ///
    /// Returns the new conservative expiry (see [`Ticket::valid_until`]).
    pub fn renew(&self, key: &str, token: u64, lease: Duration) -> Result<Instant, Error> {
        let key = Key::new(key).map_err(Error::InvalidArgument)?;
        let lease_s = lease_seconds(lease)?;
        match self.call_now(Op::Extend { token, lease_s }, key) {
            Outcome::Extended { sent_at } => Ok(valid_until(sent_at, lease)),
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// Who holds `key`, for how long, and how many wait for it.
    pub fn query(&self, key: &str) -> Result<KeyStatus, Error> {
        self.query_by(key, Instant::now() + TRANSPORT_DEADLINE)
    }

    /// [`query`](Self::query) that ends by `deadline` (and by `start + 5
    /// s`): a follow-up bounded by the deadline of the call it explains
    /// (spec §8 rule 12).
    pub(crate) fn query_by(&self, key: &str, deadline: Instant) -> Result<KeyStatus, Error> {
        let key = Key::new(key).map_err(Error::InvalidArgument)?;
        let deadline = deadline.min(Instant::now() + TRANSPORT_DEADLINE);
        match self.call(Op::Query, key, deadline) {
            Outcome::Query(status) => Ok(status),
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// Every grant of `key` (token, owner, permits, lease left, time held,
    /// label) and every waiter in queue order, as the server sees them now
    /// (spec §11.2). A key that is not in the table has neither.
    ///
    /// Like [`query`](Self::query) it ends by `start + 5 s`, and fails
    /// with [`Error::Unavailable`] or [`Error::Indeterminate`] as every
    /// call does; then nothing changed on the server either way.
    pub fn holders(&self, key: &str) -> Result<Holders, Error> {
        let key = Key::new(key).map_err(Error::InvalidArgument)?;
        let op = Op::Holders {
            id: self.fresh_owner(),
            clean_up_for: None,
        };
        match self.call_now(op, key) {
            Outcome::Holders(holders) => Ok(holders),
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// One page of the keys in the server's table that start with
    /// `prefix` (empty: every key): at most `count` (1..=1000) of them,
    /// and the cursor to continue with. Start with cursor 0 and go on with
    /// [`KeyPage::next`] until it is 0; [`keys`](Self::keys) does that.
    /// A page may hold fewer keys than `count`, even none, before the end:
    /// the server bounds the work of each request (spec §11.3).
    pub fn list_keys(&self, prefix: &str, cursor: u64, count: u16) -> Result<KeyPage, Error> {
        let prefix = Key::prefix(prefix).map_err(Error::InvalidArgument)?;
        if count == 0 || count > crate::protocol::LIST_COUNT_MAX {
            return Err(Error::InvalidArgument("count must be 1..=1000"));
        }
        let op = Op::List {
            id: self.fresh_owner(),
            cursor,
            count,
        };
        match self.call_now(op, prefix) {
            Outcome::Keys(page) => Ok(page),
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// Every key in the server's table that starts with `prefix`, with its
    /// numbers of grants and waiters and its limit: an iterator that asks
    /// for one page of 1,000 keys at a time, following the cursor to the
    /// end (see [`Keys`]). An invalid prefix is the iterator's only item,
    /// an [`Error::InvalidArgument`].
    ///
    /// ```no_run
    /// # use kunci::client::{Client, Config};
    /// # let client = Client::new(["127.0.0.1:5862".parse()?], Config::default())?;
    /// for key in client.keys("jobs/") {
    ///     let key = key?;
    ///     println!("{} held by {} grants, {} waiting", key.key, key.grants, key.waiters);
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn keys(&self, prefix: &str) -> Keys {
        Keys::new(self.clone(), prefix.to_owned())
    }

    /// The server's counters: one line of `name=value` pairs.
    pub fn info(&self) -> Result<String, Error> {
        match self.call_now(Op::Info, Key::EMPTY) {
            Outcome::Info(text) => Ok(text),
            outcome => Err(outcome_error(outcome)),
        }
    }

    /// The round-trip time of one `P`, from just before it was written to
    /// when its answer was read.
    pub fn ping(&self) -> Result<Duration, Error> {
        let nonce = self.inner.next_nonce.fetch_add(1, Ordering::Relaxed);
        match self.call_now(Op::Ping { nonce }, Key::EMPTY) {
            Outcome::Pong { round_trip } => Ok(round_trip),
            outcome => Err(outcome_error(outcome)),
        }
    }

    fn call_now(&self, op: Op, key: Key) -> Outcome {
        self.call(op, key, Instant::now() + TRANSPORT_DEADLINE)
    }

    fn call(&self, op: Op, key: Key, deadline: Instant) -> Outcome {
        self.inner.shared.call(Submission {
            op,
            key,
            deadline,
            reply: None,
        })
    }

    /// Sends a release nobody waits for (a compensating release, or a
    /// dropped ticket's). Never blocks.
    fn release_in_background(&self, key: Key, token: u64) {
        self.inner.shared.submit(Submission {
            op: Op::Release { token },
            key,
            deadline: Instant::now() + TRANSPORT_DEADLINE,
            reply: None,
        });
    }

    /// Hands a message to the I/O thread; `false` if it has stopped.
    fn send(&self, message: backend::Message) -> bool {
        self.inner.shared.send(message)
    }

    /// An id for a kept lease, unique within this client.
    fn fresh_keep_id(&self) -> keep_alive::KeepId {
        self.inner.next_keep.fetch_add(1, Ordering::Relaxed)
    }

    /// How many times a server of this client said it is shutting down
    /// (`X 8`); always 0 on etcd. (Waiting forever asks.)
    pub(crate) fn shutdown_notices(&self) -> u64 {
        self.inner.shared.shutdown_notices()
    }

    /// Why this client's latest connection attempt to a kunci server
    /// failed (refused, a name that does not resolve, a timeout, TLS), with
    /// the address; `None` if none has failed. It explains an
    /// [`Unavailable::Unreachable`] after the fact.
    pub fn last_connect_failure(&self) -> Option<String> {
        self.inner.shared.last_connect_failure()
    }

    /// An owner id no other call of this client uses: a random base plus a
    /// counter, skipping 0.
    pub(crate) fn fresh_owner(&self) -> u64 {
        loop {
            let n = self.inner.next_owner.fetch_add(1, Ordering::Relaxed);
            let owner = self.inner.owner_base.wrapping_add(n);
            if owner != 0 {
                return owner;
            }
        }
    }
}

/// The lease as whole seconds in 1..=255, or why not.
fn lease_seconds(lease: Duration) -> Result<u8, Error> {
    if lease.subsec_nanos() != 0 {
        return Err(Error::InvalidArgument(
            "lease must be a whole number of seconds",
        ));
    }
    match lease.as_secs() {
        1..=255 => Ok(lease.as_secs() as u8),
        _ => Err(Error::InvalidArgument("lease must be 1..=255 seconds")),
    }
}

/// The margin taken off a lease to allow for the server's clock running
/// faster than ours: 10 ms plus 0.2 % of the lease (2000 ppm, twice the
/// worst slew NTP applies to two clocks that drift apart).
pub fn drift_margin(lease: Duration) -> Duration {
    Duration::from_millis(10) + lease / 500
}

/// The conservative expiry of a lease whose request was handed to the
/// socket just after `sent_at` (spec §8.9).
fn valid_until(sent_at: Instant, lease: Duration) -> Instant {
    sent_at + lease.saturating_sub(drift_margin(lease))
}

fn outcome_error(outcome: Outcome) -> Error {
    match outcome {
        Outcome::Timeout => Error::Timeout,
        Outcome::Busy => Error::Busy,
        Outcome::Unavailable(why) => Error::Unavailable(why),
        Outcome::NotHeld => Error::NotHeld,
        Outcome::Invalid(why) => Error::InvalidArgument(why),
        Outcome::LimitMismatch { key_limit } => Error::LimitMismatch { key_limit },
        Outcome::PermissionDenied(why) => Error::PermissionDenied(why),
        // Every other outcome answers a different request: the engine
        // correlates by op, so it cannot come here; treat it as unknown.
        _ => Error::Indeterminate,
    }
}

/// A random u64 from the standard library's per-process hash keys, mixed
/// with the time and the process id.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    hasher.finish()
}

#[cfg(test)]
mod tests;
