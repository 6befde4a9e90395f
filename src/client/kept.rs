//! [`KeptLease`]: a ticket whose lease the client's I/O thread renews.

use std::fmt;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use super::handoff::{LeaseMessage, Message, Mirror, OnLost};
use super::keep_alive::{Grant, KeepId, Loss};
use super::ticket::campaign_value;
use super::vocabulary::{Error, Key, drift_margin};
use super::{Client, Permits, Ticket};

/// A lock whose lease the client keeps alive (spec §8 rule 10), made with
/// [`Ticket::keep_alive`] or [`Ticket::keep_alive_with`].
///
/// The client's I/O thread renews the lease with its own length every
/// lease/3 — no thread per lock — and retries a renewal that ends
/// [`Error::Unavailable`] or [`Error::Indeterminate`] every 100 ms while
/// [`valid_until`](Self::valid_until) is ahead. The lock is **lost** when a
/// renewal is answered `N` ([`Loss::NotHeld`]) or when `valid_until` passes
/// without a successful renewal ([`Loss::Expired`]). A loss is reported at
/// once, exactly once: [`wait_lost`](Self::wait_lost) returns,
/// [`lost`](Self::lost) turns `Some`, and the callback given to
/// [`Ticket::keep_alive_with`] runs. Renewal stops at the loss.
///
/// After a loss the holder must stop the work the lock protects: another
/// holder may already have the key (the fencing token still protects the
/// resource from late writes). [`release`](Self::release) after a loss
/// sends nothing and returns [`Error::NotHeld`].
///
/// Dropping a kept lease stops the renewals and releases the lock in the
/// background (unless it was lost).
///
/// # Example
///
/// ```
/// use std::sync::mpsc;
/// use std::time::Duration;
/// use kunci::client::{Client, Config};
/// # let listen = vec!["127.0.0.1:0".parse()?];
/// # let server = kunci::server::Server::bind(kunci::server::Config { listen, ..Default::default() })?;
/// # let address = server.addresses()[0].to_string();
/// # let stop = server.shutdown_handle();
/// # let running = std::thread::spawn(move || server.run());
///
/// let client = Client::new([address.parse()?], Config::default())?;
/// let ticket = client.acquire("reports", Duration::from_secs(5), Duration::from_secs(3))?;
/// // The callback runs on the client's I/O thread: it only passes the news on.
/// let (lost_tx, lost_rx) = mpsc::channel();
/// let kept = ticket.keep_alive_with(move |loss| {
///     let _ = lost_tx.send(loss);
/// });
/// // Work for longer than the lease; the client renews it meanwhile.
/// match lost_rx.recv_timeout(Duration::from_secs(4)) {
///     Err(mpsc::RecvTimeoutError::Timeout) => {} // still held
///     Ok(loss) => return Err(format!("lock lost: {loss}").into()),
///     Err(error) => return Err(error.into()),
/// }
/// assert!(kept.is_valid());
/// kept.release()?;
/// # stop.shut_down();
/// # running.join().unwrap()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a KeptLease releases the lock"]
pub struct KeptLease {
    client: Client,
    key: Key,
    token: u64,
    permits: Permits,
    lease: Duration,
    id: KeepId,
    mirror: Arc<Mirror>,
    /// A campaign's lead: releasing it after a loss is a quiet resign.
    campaign: bool,
    /// Released: the drop has nothing left to do.
    done: bool,
}

impl Ticket {
    /// Hands the ticket to the client's I/O thread, which renews its lease
    /// every lease/3 until it is released or lost (see [`KeptLease`]).
    ///
    /// The first renewal is due lease/3 after the request that set the
    /// lease was sent, so it is sent at once if that has passed. A ticket
    /// whose [`valid_until`](Self::valid_until) has already passed — an
    /// acquire that waited in the queue for longer than its lease — is
    /// lost at once. After an acquire that waited, use
    /// [`keep_alive_fresh`](Self::keep_alive_fresh), which renews a late
    /// grant before it hands the lease over (spec §8 rule 10).
    pub fn keep_alive(self) -> KeptLease {
        self.keep(None)
    }

    /// As [`keep_alive`](Self::keep_alive), and runs `on_lost` once when the
    /// lock is lost. `on_lost` runs on the client's I/O thread: it must be
    /// quick and must not call the client's blocking methods (send the news
    /// through a channel, set a flag, signal a process).
    pub fn keep_alive_with(self, on_lost: impl FnOnce(Loss) + Send + 'static) -> KeptLease {
        self.keep(Some(Box::new(on_lost)))
    }

    /// A managed lock from a fresh grant (spec §8 rule 10): as
    /// [`keep_alive_with`](Self::keep_alive_with), but a ticket that has
    /// less than two thirds of its lease left on
    /// [`valid_until`](Self::valid_until) — a grant that arrived after a
    /// wait, whose lease counts from when the request was sent — is renewed
    /// once first, so that the lease is never handed over already lost.
    ///
    /// If that renewal is answered `N` the lock is lost before anything was
    /// done under it: [`Error::NotHeld`], and nothing is kept. If it reaches
    /// no verdict (`Unavailable`, `Indeterminate`) while `valid_until` is
    /// still ahead, the lease is kept and its renewals go on retrying; once
    /// `valid_until` has passed, that error is returned and nothing is kept
    /// (the server reclaims the grant at the end of its lease).
    pub fn keep_alive_fresh_with(
        mut self,
        on_lost: impl FnOnce(Loss) + Send + 'static,
    ) -> Result<KeptLease, Error> {
        self.renew_if_late()?;
        Ok(self.keep(Some(Box::new(on_lost))))
    }

    /// As [`keep_alive_fresh_with`](Self::keep_alive_fresh_with), without a
    /// callback.
    pub fn keep_alive_fresh(mut self) -> Result<KeptLease, Error> {
        self.renew_if_late()?;
        Ok(self.keep(None))
    }

    /// Rule 10's first renewal; on an error the ticket is disarmed (there
    /// is nothing to release: the grant is gone or unknowable).
    fn renew_if_late(&mut self) -> Result<(), Error> {
        let lease = self.lease();
        let left = self.valid_until().saturating_duration_since(Instant::now());
        if left >= lease - lease / 3 {
            return Ok(());
        }
        match self.renew(lease) {
            Ok(()) => Ok(()),
            // The keep-alive retries while the lease is known to run.
            Err(Error::Unavailable(_) | Error::Indeterminate) if self.is_valid() => Ok(()),
            Err(error) => {
                self.disarm();
                Err(error)
            }
        }
    }

    fn keep(self, on_lost: Option<OnLost>) -> KeptLease {
        let client = self.client().clone();
        let (key, token, permits, lease, valid_until, label) = (
            self.raw_key(),
            self.token(),
            self.permits(),
            self.lease(),
            self.valid_until(),
            self.raw_label(),
        );
        // The renewals take over: the ticket's drop must not release.
        let _ = self.into_token();
        let id = client.fresh_keep_id();
        let mirror = Arc::new(Mirror::new(valid_until, on_lost));
        // The instant the lease was set: `valid_until` is that plus the
        // lease minus the drift margin (spec §8.9).
        let set_at = valid_until
            .checked_sub(lease.saturating_sub(drift_margin(lease)))
            .unwrap_or(valid_until);
        let grant = Grant {
            key,
            token,
            lease,
            set_at,
            valid_until,
            label,
        };
        let sent = client.send(Message::Lease(LeaseMessage::Keep {
            id,
            grant,
            mirror: mirror.clone(),
        }));
        if !sent {
            // The I/O thread has stopped (only after a poll failure):
            // nothing can renew the lease.
            mirror.lose(Loss::Expired);
        }
        KeptLease {
            client,
            key,
            token,
            permits,
            lease,
            id,
            mirror,
            campaign: false,
            done: false,
        }
    }
}

impl KeptLease {
    /// The key this lease holds.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// The fencing token (see [`Ticket::token`]).
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The permits this grant holds (see [`Ticket::permits`]).
    pub fn permits(&self) -> Permits {
        self.permits
    }

    /// The lease every renewal asks for.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The conservative expiry after the latest successful renewal (see
    /// [`Ticket::valid_until`]). It does not move after a loss.
    pub fn valid_until(&self) -> Instant {
        self.mirror.lock().valid_until
    }

    /// Whether the lock is not lost and `valid_until` is still ahead.
    pub fn is_valid(&self) -> bool {
        let state = self.mirror.lock();
        state.lost.is_none() && Instant::now() < state.valid_until
    }

    /// The loss, if the lock was lost. Never blocks.
    pub fn lost(&self) -> Option<Loss> {
        self.mirror.lock().lost
    }

    /// Blocks until the lock is lost, and says why. A lock that is released
    /// from another handle is never reported lost, so only call this while
    /// the lease is kept.
    pub fn wait_lost(&self) -> Loss {
        let mut state = self.mirror.lock();
        loop {
            if let Some(loss) = state.lost {
                return loss;
            }
            state = self
                .mirror
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// As [`wait_lost`](Self::wait_lost), for at most `limit`: `None` if the
    /// lock was still not lost then.
    pub fn wait_lost_timeout(&self, limit: Duration) -> Option<Loss> {
        let give_up = Instant::now().checked_add(limit);
        let mut state = self.mirror.lock();
        loop {
            if let Some(loss) = state.lost {
                return Some(loss);
            }
            let now = Instant::now();
            let left = match give_up {
                Some(give_up) if now >= give_up => return None,
                Some(give_up) => give_up - now,
                None => Duration::from_secs(3600),
            };
            state = self
                .mirror
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Stops the renewals and releases the lock (`R` for exactly this
    /// token), waiting for the answer. After a loss it sends nothing and
    /// returns [`Error::NotHeld`]; [`Error::NotHeld`] also when the server
    /// no longer had this grant. A campaign's lead
    /// ([`Client::campaign`]) resigns quietly instead: see
    /// [`resign`](Self::resign).
    pub fn release(self) -> Result<(), Error> {
        if self.campaign {
            return self.resign();
        }
        self.release_loudly()
    }

    /// Resigns: stops the renewals and releases the lock as
    /// [`release`](Self::release) does, but a lock (or lead) that is
    /// already lost — known here, or found gone by the server's `N` — is
    /// `Ok`, as etcd's `Resign` and Curator's `close()`: the holder wanted
    /// it gone, and it is.
    pub fn resign(self) -> Result<(), Error> {
        match self.release_loudly() {
            Err(Error::NotHeld) => Ok(()),
            done => done,
        }
    }

    fn release_loudly(mut self) -> Result<(), Error> {
        self.done = true;
        if self.stop().is_some() {
            return Err(Error::NotHeld);
        }
        self.client.release(self.key.as_str(), self.token)
    }

    /// Marks a campaign's lead: its [`release`](Self::release) resigns
    /// quietly.
    pub(super) fn for_campaign(mut self) -> KeptLease {
        self.campaign = true;
        self
    }

    /// Changes the grant's label to `value` (1..=128 bytes, no newline),
    /// keeping its token, lease and grant time (spec §13.4a, `C`): a
    /// leader changes its value and keeps its term; observers see the
    /// new value with the same term; and it is this value that is
    /// proclaimed again if a restarted server adopts the grant.
    ///
    /// After a loss it sends nothing and returns [`Error::NotHeld`]. If
    /// the server answers `N` the lock is lost: it is reported as a loss
    /// ([`Loss::NotHeld`]; the callback runs on this thread then), the
    /// renewals stop, and [`Error::NotHeld`] is returned. On etcd it is a
    /// put of the grant's own entry (guarded by its create revision, on
    /// its own lease).
    pub fn proclaim(&self, value: &str) -> Result<(), Error> {
        let label = campaign_value(value)?;
        if self.mirror.lock().lost.is_some() {
            return Err(Error::NotHeld);
        }
        match self.client.proclaim(self.key.as_str(), self.token, value) {
            Ok(()) => {
                self.client
                    .send(Message::Lease(LeaseMessage::Relabel { id: self.id, label }));
                Ok(())
            }
            Err(Error::NotHeld) => {
                self.mirror.lose(Loss::NotHeld);
                self.client
                    .send(Message::Lease(LeaseMessage::Forget(self.id)));
                Err(Error::NotHeld)
            }
            Err(error) => Err(error),
        }
    }

    /// Marks the lease released and tells the I/O thread to stop renewing
    /// it; the loss, if it came first.
    fn stop(&self) -> Option<Loss> {
        let lost = {
            let mut state = self.mirror.lock();
            state.released = true;
            state.lost
        };
        self.client
            .send(Message::Lease(LeaseMessage::Forget(self.id)));
        lost
    }
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        if !self.done && self.stop().is_none() {
            self.client.release_in_background(self.key, self.token);
        }
    }
}

impl fmt::Debug for KeptLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.mirror.lock();
        f.debug_struct("KeptLease")
            .field("key", &self.key())
            .field("token", &self.token)
            .field("lease", &self.lease)
            .field("valid_until", &state.valid_until)
            .field("lost", &state.lost)
            .finish()
    }
}
