//! What the client's two backends share: the kunci I/O thread (`io.rs`)
//! and the etcd backend (`etcd/mod.rs`) take the same [`Message`]s, answer
//! calls through the same [`Slot`]s, and keep leases with the same
//! [`KeptLeases`] bookkeeping; each backend only says how it sends a
//! renewal or a release.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::keep_alive::{Grant, KeepAlives, KeepId, Loss, Step};
use super::permits::Label;
use super::vocabulary::{Key, Outcome, Submission};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where one blocking call waits for its outcome. Each thread reuses its
/// own slot; `seq` tells a late delivery for an earlier call apart.
pub(crate) struct Slot {
    state: Mutex<(u64, Option<Outcome>)>,
    ready: Condvar,
}

thread_local! {
    static SLOT: RefCell<Option<Arc<Slot>>> = const { RefCell::new(None) };
}

impl Slot {
    /// The calling thread's slot.
    pub(crate) fn for_this_thread() -> Arc<Slot> {
        let fresh = || {
            Arc::new(Slot {
                state: Mutex::new((0, None)),
                ready: Condvar::new(),
            })
        };
        SLOT.try_with(|slot| slot.borrow_mut().get_or_insert_with(fresh).clone())
            .unwrap_or_else(|_| fresh())
    }

    /// Readies the slot for a new call and returns its number.
    pub(crate) fn next_call(&self) -> u64 {
        let mut state = lock(&self.state);
        state.0 = state.0.wrapping_add(1);
        state.1 = None;
        state.0
    }

    /// Waits for the outcome of the current call until `give_up`; `None`
    /// if none came by then (a late delivery then misses this call).
    pub(crate) fn wait(&self, give_up: Instant) -> Option<Outcome> {
        let mut state = lock(&self.state);
        loop {
            if let Some(outcome) = state.1.take() {
                return Some(outcome);
            }
            let now = Instant::now();
            if now >= give_up {
                state.0 = state.0.wrapping_add(1);
                return None;
            }
            state = self
                .ready
                .wait_timeout(state, give_up - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Hands call `seq`'s outcome to its waiting thread.
    pub(crate) fn deliver(&self, seq: u64, outcome: Outcome) {
        let mut state = lock(&self.state);
        if state.0 == seq {
            state.1 = Some(outcome);
            drop(state);
            self.ready.notify_one();
        } else if let Outcome::Acquired { token, .. } = outcome {
            log::warn!("grant {token} arrived for a call that gave up; its lease will reclaim it");
        }
    }
}

/// Where an outcome goes: a waiting call (its thread's slot and its
/// number), the renewal of a kept lease, or the read of a
/// [`KeepTask::CheckLabel`] (then grant `token` of `key` is proclaimed
/// `label` again if the read shows it without it).
pub(crate) enum Reply {
    Call {
        slot: Arc<Slot>,
        seq: u64,
    },
    KeepAlive(KeepId),
    /// Boxed: rare, and every request carries a `Reply`.
    CheckLabel(Box<(Key, u64, Label)>),
}

/// What callers hand a backend: a request goes straight to it, and only
/// what concerns a kept lease to its [`KeptLeases`].
pub(crate) enum Message {
    Request(Submission<Reply>),
    Lease(LeaseMessage),
}

/// What callers tell a backend's [`KeptLeases`]. (A `Keep` is as large
/// as a request, and each is moved once through the backend's queue.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum LeaseMessage {
    /// Start keeping a lease (see `keep_alive.rs`); `mirror` is where the
    /// holder sees its state.
    Keep {
        id: KeepId,
        grant: Grant,
        mirror: Arc<Mirror>,
    },
    /// Stop keeping a lease: it is being released.
    Forget(KeepId),
    /// The holder proclaimed a new label: restore that one after an
    /// adoption.
    Relabel { id: KeepId, label: Label },
}

/// A callback run once, on the backend's thread, when the lock is lost.
pub(crate) type OnLost = Box<dyn FnOnce(Loss) + Send>;

/// What the holder of a kept lease sees, written by the backend.
pub(crate) struct Mirror {
    state: Mutex<MirrorState>,
    pub(crate) changed: Condvar,
}

pub(crate) struct MirrorState {
    pub(crate) valid_until: Instant,
    pub(crate) lost: Option<Loss>,
    /// The holder released (or dropped) the lease: a later loss is not
    /// reported.
    pub(crate) released: bool,
    on_lost: Option<OnLost>,
}

impl Mirror {
    pub(crate) fn new(valid_until: Instant, on_lost: Option<OnLost>) -> Mirror {
        Mirror {
            state: Mutex::new(MirrorState {
                valid_until,
                lost: None,
                released: false,
                on_lost,
            }),
            changed: Condvar::new(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, MirrorState> {
        lock(&self.state)
    }

    fn renewed(&self, valid_until: Instant) {
        let mut state = self.lock();
        if state.lost.is_none() {
            state.valid_until = state.valid_until.max(valid_until);
        }
    }

    /// Reports the loss once: wakes the waiters, then runs the callback.
    pub(crate) fn lose(&self, loss: Loss) {
        let on_lost = {
            let mut state = self.lock();
            if state.released || state.lost.is_some() {
                return;
            }
            state.lost = Some(loss);
            state.on_lost.take()
        };
        self.changed.notify_all();
        if let Some(on_lost) = on_lost {
            on_lost(loss);
        }
    }
}

/// What a backend must do for its kept leases, its own way.
pub(crate) enum KeepTask {
    /// Renew this grant with this lease (deadline as for any renew: now +
    /// 5 s) and hand the outcome to [`KeptLeases::handle_outcome`].
    Renew {
        id: KeepId,
        key: Key,
        token: u64,
        lease_s: u8,
    },
    /// Release a grant nobody holds any more, in the background.
    Release { key: Key, token: u64 },
    /// Read `key` (`O`, wait 0) and proclaim `label` for grant `token` if
    /// it is the key's current grant with another label ([`Reply::CheckLabel`]).
    CheckLabel { key: Key, token: u64, label: Label },
}

/// The kept leases of one backend: the [`KeepAlives`] rules, and the
/// mirrors where the holders see what those rules decide.
#[derive(Default)]
pub(crate) struct KeptLeases {
    keep: KeepAlives,
    mirrors: HashMap<KeepId, Arc<Mirror>>,
}

impl KeptLeases {
    /// Takes a message: keeps or forgets a lease.
    pub(crate) fn receive(&mut self, message: LeaseMessage, now: Instant) {
        match message {
            LeaseMessage::Keep { id, grant, mirror } => {
                self.mirrors.insert(id, mirror);
                self.keep.insert(id, grant, now);
            }
            LeaseMessage::Forget(id) => {
                self.keep.remove(id);
                self.mirrors.remove(&id);
            }
            LeaseMessage::Relabel { id, label } => self.keep.relabel(id, label),
        }
    }

    /// The client's count of ended connections (a renewal that succeeds
    /// after it changed may be an adoption: `keep_alive.rs`).
    pub(crate) fn set_connections(&mut self, count: u64) {
        self.keep.set_connections(count);
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.keep.poll_timeout()
    }

    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        self.keep.handle_timeout(now);
    }

    /// The outcome of a [`KeepTask::Renew`].
    pub(crate) fn handle_outcome(&mut self, id: KeepId, outcome: Outcome, now: Instant) {
        self.keep.handle_outcome(id, outcome, now);
    }

    /// The next task for the backend; renewals and losses decided on the
    /// way are shown to their holders here.
    pub(crate) fn poll_task(&mut self) -> Option<KeepTask> {
        while let Some(step) = self.keep.poll_step() {
            match step {
                Step::Renew {
                    id,
                    key,
                    token,
                    lease_s,
                } => {
                    return Some(KeepTask::Renew {
                        id,
                        key,
                        token,
                        lease_s,
                    });
                }
                Step::Release { key, token } => return Some(KeepTask::Release { key, token }),
                Step::CheckLabel { key, token, label } => {
                    return Some(KeepTask::CheckLabel { key, token, label });
                }
                Step::Renewed { id, valid_until } => {
                    if let Some(mirror) = self.mirrors.get(&id) {
                        mirror.renewed(valid_until);
                    }
                }
                Step::Lost { id, loss } => {
                    if let Some(mirror) = self.mirrors.remove(&id) {
                        mirror.lose(loss);
                    }
                }
            }
        }
        None
    }

    /// The backend stops: no lease is renewed any more, so each is lost.
    pub(crate) fn lose_all(&mut self) {
        for (_, mirror) in self.mirrors.drain() {
            mirror.lose(Loss::Expired);
        }
    }
}
