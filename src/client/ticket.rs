//! [`Ticket`]: a granted lock, with its fencing token and lease.

use std::fmt;
use std::time::{Duration, Instant};

use super::permits::Label;
use super::vocabulary::{Error, Key, valid_until};
use super::{Client, Permits};

/// A lock this client holds: the key, the grant's fencing token, its lease,
/// and a conservative bound on when the server may take it back.
///
/// Dropping a ticket that was neither released nor kept with
/// [`Ticket::into_token`] sends a best-effort release in the background.
/// [`Ticket::keep_alive`] hands it to the client, which then renews the
/// lease until it is released or lost (a [`KeptLease`](super::KeptLease)).
#[must_use = "dropping a Ticket releases the lock"]
pub struct Ticket {
    client: Client,
    key: Key,
    token: u64,
    permits: Permits,
    lease: Duration,
    valid_until: Instant,
    /// The grant's label (a campaign's value), as the acquire or the
    /// latest proclaim set it: a managed lease proclaims it again after a
    /// restarted server adopted the grant without it (spec §7.5).
    label: Label,
    /// Whether dropping the ticket releases the lock.
    armed: bool,
}

impl Ticket {
    pub(super) fn new(
        client: Client,
        key: Key,
        token: u64,
        permits: Permits,
        lease: Duration,
        sent_at: Instant,
        label: Label,
    ) -> Ticket {
        Ticket {
            client,
            key,
            token,
            permits,
            lease,
            valid_until: valid_until(sent_at, lease),
            label,
            armed: true,
        }
    }

    pub(super) fn raw_label(&self) -> Label {
        self.label
    }

    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    pub(super) fn raw_key(&self) -> Key {
        self.key
    }

    /// The key this ticket holds.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// The fencing token: unique across all keys and strictly increasing in
    /// grant order. Pass it to the protected resource, which should refuse
    /// any token smaller than the largest it has seen.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The permits this grant holds, as the acquire asked for them
    /// (exclusive, shared, or some of a semaphore's).
    pub fn permits(&self) -> Permits {
        self.permits
    }

    /// The lease of the latest successful acquire or renewal.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// A moment before which the server cannot have taken the lock back:
    /// the instant just before the request that set the lease (the acquire,
    /// or the latest successful renewal) was handed to the socket, plus the
    /// lease, minus [`drift_margin`](super::drift_margin). After it, the
    /// lock may belong to someone else.
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// Whether [`valid_until`](Self::valid_until) is still ahead.
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.valid_until
    }

    /// Releases the lock (`R` for exactly this token) and waits for the
    /// answer. [`Error::NotHeld`]: the lease had already run out.
    pub fn release(mut self) -> Result<(), Error> {
        self.armed = false;
        self.client.release(self.key.as_str(), self.token)
    }

    /// The grant's label: the acquire's, or the latest
    /// [`proclaim`](Self::proclaim)ed value (empty when it has none).
    pub fn label(&self) -> &str {
        self.label.as_str()
    }

    /// Changes the grant's label to `value` (1..=128 bytes, no newline)
    /// without touching its token, lease or grant time (spec §13.4a,
    /// `C`): a campaign's leader changes its value and keeps its term,
    /// and observers see the new value with the same term. Asking again
    /// is always safe.
    ///
    /// [`Error::NotHeld`]: the server no longer has this grant (the lock
    /// is lost; [`valid_until`](Self::valid_until) becomes now). On etcd
    /// it is a put of the grant's own entry, guarded by its create
    /// revision, on its own lease.
    pub fn proclaim(&mut self, value: &str) -> Result<(), Error> {
        let label = campaign_value(value)?;
        match self.client.proclaim(self.key.as_str(), self.token, value) {
            Ok(()) => {
                self.label = label;
                Ok(())
            }
            Err(Error::NotHeld) => {
                self.valid_until = self.valid_until.min(Instant::now());
                Err(Error::NotHeld)
            }
            Err(error) => Err(error),
        }
    }

    /// Resets the lease to `lease` (whole seconds, 1..=255) from now.
    ///
    /// On success, [`valid_until`](Self::valid_until) moves to this
    /// renewal's send instant plus `lease`. On [`Error::NotHeld`] the lock
    /// is lost and `valid_until` becomes now. On [`Error::Indeterminate`]
    /// the server may or may not have reset the lease, so `valid_until`
    /// keeps the earlier of the two bounds. On any other error nothing
    /// changed.
    pub fn renew(&mut self, lease: Duration) -> Result<(), Error> {
        let started = Instant::now();
        match self.client.renew(self.key.as_str(), self.token, lease) {
            Ok(valid_until) => {
                self.lease = lease;
                self.valid_until = valid_until;
                Ok(())
            }
            Err(error) => {
                match error {
                    Error::NotHeld => self.valid_until = self.valid_until.min(Instant::now()),
                    Error::Indeterminate => {
                        self.valid_until = self.valid_until.min(valid_until(started, lease));
                    }
                    _ => {}
                }
                Err(error)
            }
        }
    }

    /// Keeps the lock held on the server and returns its token: the drop
    /// no longer releases it. The lease still runs out unless it is renewed
    /// (for example with [`Client::renew`]).
    pub fn into_token(mut self) -> u64 {
        self.armed = false;
        self.token
    }

    /// The drop no longer releases the lock.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

/// A campaign's value as a label: 1..=128 bytes without a newline (spec
/// §13.6), or why not.
pub(super) fn campaign_value(value: &str) -> Result<Label, Error> {
    if value.is_empty() {
        return Err(Error::InvalidArgument("value is empty"));
    }
    Label::new(value).map_err(Error::InvalidArgument)
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.armed {
            self.client.release_in_background(self.key, self.token);
        }
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket")
            .field("key", &self.key())
            .field("token", &self.token)
            .field("permits", &self.permits)
            .field("lease", &self.lease)
            .field("valid_until", &self.valid_until)
            .field("label", &self.label())
            .finish()
    }
}
