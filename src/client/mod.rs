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
mod config;
mod engine;
#[cfg(feature = "etcd")]
mod etcd;
mod handoff;
mod io;
mod jitter;
mod keep_alive;
mod kept;
mod leader;
mod permits;
mod ticket;
mod vocabulary;
mod wait_forever;

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::addr::Address;
use backend::Backend;
use vocabulary::{Key, Op, Outcome, Submission, outcome_error, valid_until};

pub use config::{Config, PLAINTEXT_SECRET_REFUSED, Secret};
#[cfg(feature = "etcd")]
pub use etcd::EtcdCredentials;
pub use keep_alive::Loss;
pub use kept::KeptLease;
pub use leader::{Leader, Observe};
pub use permits::{AcquireOptions, Permits};
pub use ticket::Ticket;
pub use vocabulary::{
    Denied, Error, Grant, Holders, KeyPage, KeyState, KeyStatus, KeySummary, LEASE_MAX,
    TRANSPORT_DEADLINE, Unavailable, WAIT_MAX, Waiter, drift_margin,
};

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
            campaign: options.is_campaign(),
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
                    label,
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

    /// Sets the label of grant `token` of `key` to `label` (spec §13.4a,
    /// `C`): a leader's value changes without losing its term, and nothing
    /// else of the grant changes. Asking again is always safe.
    ///
    /// `Ok` when the server set it; [`Error::NotHeld`] when that token is
    /// not a grant of `key`; [`Error::InvalidArgument`] for a label over
    /// 128 bytes or with a newline.
    pub fn proclaim(&self, key: &str, token: u64, label: &str) -> Result<(), Error> {
        let key = Key::new(key).map_err(Error::InvalidArgument)?;
        let label = permits::Label::new(label).map_err(Error::InvalidArgument)?;
        match self.call_now(Op::Proclaim { token, label }, key) {
            Outcome::Proclaimed => Ok(()),
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
    fn send(&self, message: handoff::Message) -> bool {
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

    /// The addresses whose host name did not resolve at their latest
    /// connection attempt, each as `address: why`. (Waiting forever says
    /// so.)
    pub(crate) fn unresolved_names(&self) -> Vec<String> {
        self.inner.shared.unresolved_names()
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

/// The keys that start with a prefix, page by page: what
/// [`Client::keys`] returns.
///
/// Each page is one `L` request (up to 1,000 keys) with its own deadline
/// of 5 s; the next page is asked for only when the current one is used
/// up. Every key that is in the table for the whole listing comes at least
/// once; a key may come twice when the table grew in between (spec §11.3).
/// After an error the iterator yields that error once and then ends.
#[derive(Debug)]
pub struct Keys {
    client: Client,
    prefix: String,
    cursor: u64,
    page: VecDeque<KeySummary>,
    /// No page is left to ask for (the last `next` was 0, or an error).
    done: bool,
}

impl Keys {
    pub(crate) fn new(client: Client, prefix: String) -> Keys {
        Keys {
            client,
            prefix,
            cursor: 0,
            page: VecDeque::new(),
            done: false,
        }
    }
}

impl Iterator for Keys {
    type Item = Result<KeySummary, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(key) = self.page.pop_front() {
                return Some(Ok(key));
            }
            if self.done {
                return None;
            }
            match self
                .client
                .list_keys(&self.prefix, self.cursor, crate::protocol::LIST_COUNT_MAX)
            {
                Ok(page) => {
                    self.cursor = page.next;
                    self.done = page.next == 0;
                    self.page.extend(page.keys);
                }
                Err(error) => {
                    self.done = true;
                    return Some(Err(error));
                }
            }
        }
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
