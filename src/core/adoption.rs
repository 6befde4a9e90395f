//! Restarts (spec §7): grants of an earlier run restored at a clean stop,
//! the grace after an unclean one (every key counts as held by an unknown
//! grant until the lease horizon), and adoption of an earlier run's token
//! by `E`/`R` during it (§7.3). Everything the core decides about an
//! earlier run lives here; the state file itself is `server::state`'s.

use std::collections::HashSet;

use super::permits::PERMITS;
use super::timer_wheel::MICROS_PER_TICK;
use super::{ConnId, Core, Micros};
use crate::protocol::Response;

/// A grant held now (see [`Core::grants`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldGrant<'a> {
    pub key: &'a str,
    pub token: u64,
    pub owner: u64,
    /// When the lease runs out.
    pub deadline: Micros,
}

/// Why [`Core::restore_grant`] refused a grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreError {
    /// Token 0, or not below this run's first token.
    TokenNotFromEarlierRun,
    /// The key was restored already.
    DuplicateKey,
    /// The table cannot grow.
    TableFull,
}

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RestoreError::TokenNotFromEarlierRun => "token is 0 or not below this run's first",
            RestoreError::DuplicateKey => "key listed twice",
            RestoreError::TableFull => "lock table full",
        })
    }
}

/// How a key held by the unknown grant is represented.
enum Adoptable {
    /// An entry with token 0: the unknown grant, with waiters queued.
    Waited(u32),
    /// Not in the table: every key during the grace.
    Untracked,
}

impl Core {
    /// Treat every key as held by an unknown grant until `until` (spec §7).
    pub fn set_grace_until(&mut self, until: Micros) {
        self.grace_until = until;
    }

    /// Until when keys count as held by unknown grants (0 = never).
    pub fn grace_until(&self) -> Micros {
        self.grace_until
    }

    /// The latest lease deadline ever armed for a grant of this run: no
    /// lease this core granted runs past it.
    pub fn lease_deadline_max(&self) -> Micros {
        self.lease_deadline_max
    }

    /// The first token of this run; tokens below it are an earlier run's.
    pub fn first_token(&self) -> u64 {
        self.first_token
    }

    /// Restores a grant an earlier run held at a clean stop (spec §7.1):
    /// `key` held by `token` (below this run's first token) for `owner`
    /// until `deadline`. Call before any request, at time 0. Restored keys
    /// count towards the key limit for new keys, but are restored even
    /// beyond it: every grant of the earlier run comes back.
    pub fn restore_grant(
        &mut self,
        key: &str,
        token: u64,
        owner: u64,
        deadline: Micros,
    ) -> Result<(), RestoreError> {
        // Before any request: nothing granted yet (connections may be open).
        debug_assert!(self.wheel.elapsed() == 0 && self.next_token == self.first_token);
        if token == 0 || token >= self.first_token {
            return Err(RestoreError::TokenNotFromEarlierRun);
        }
        let hash = self.table.hash(key);
        if self.table.find(key, hash).is_some() {
            return Err(RestoreError::DuplicateKey);
        }
        let entry = self
            .table
            .insert(key, hash, token, owner)
            .ok_or(RestoreError::TableFull)?;
        self.arm_lease_at(entry, deadline.max(1));
        self.grants_held += 1;
        Ok(())
    }

    /// What a clean stop saves, one grant per held key; `deadline` is when
    /// its lease runs out (on the 1 ms tick).
    ///
    /// The state file cannot hold permits yet (spec §7.4 is still to do),
    /// so a key with a limit is saved as held, exclusively, by its grant
    /// whose lease runs out last: after the restart nothing new is granted
    /// on it before every lease of that run could have run out (never an
    /// overlap), but only that token can renew or release it; the others
    /// get `N`, so their holders learn that the lock is lost.
    /// [`grants_held`](Self::grants_held) minus this count is how many
    /// grants are saved that way.
    pub fn grants(&self) -> impl Iterator<Item = HeldGrant<'_>> + '_ {
        self.table.live_indices().filter_map(move |entry| {
            let held = self.table.get(entry);
            let (token, owner, lease) = if held.token == PERMITS {
                let grants = &self.permit_key(entry).grants;
                let latest = grants
                    .iter()
                    .map(|&grant| self.grants.get(grant))
                    .max_by_key(|grant| self.wheel.deadline_of(&grant.lease))?;
                (latest.token, latest.owner, latest.lease)
            } else {
                (held.token, held.owner, held.lease)
            };
            (token != 0).then(|| HeldGrant {
                key: self.table.key(entry),
                token,
                owner,
                deadline: self.wheel.deadline_of(&lease) * MICROS_PER_TICK,
            })
        })
    }

    /// Whether `token` may adopt `key` (spec §7.3): it is an earlier run's
    /// token and the key is held by the unknown grant — an entry with token
    /// 0 (waited on), or, during the grace, a key not in the table and not
    /// known free.
    fn adoptable(&self, key: &str, token: u64, now: Micros) -> Option<Adoptable> {
        if token == 0 || token >= self.first_token {
            return None;
        }
        match self.table.find(key, self.table.hash(key)) {
            Some(entry) => (self.table.get(entry).token == 0).then_some(Adoptable::Waited(entry)),
            None => (now < self.grace_until && !self.freed_in_grace.contains(key))
                .then_some(Adoptable::Untracked),
        }
    }

    /// Remembers that `key`, not in the table, is free although the grace
    /// runs. Without room it stays held by the unknown grant until the
    /// horizon: later than it could be, never too early.
    fn note_freed(&mut self, key: &str) {
        if self.freed_in_grace.len() < self.limits.max_keys {
            self.freed_in_grace.insert(key.into());
        }
    }

    /// `R` of a token that is not this run's active grant of `key`: an
    /// earlier run's token on a key held by the unknown grant frees it
    /// (spec §7.3). Returns the entry to hand on, or `None` once it has
    /// answered (`R` for a key not in the table, else `N`).
    pub(super) fn release_earlier_token(
        &mut self,
        conn: ConnId,
        key: &str,
        token: u64,
        now: Micros,
    ) -> Option<u32> {
        match self.adoptable(key, token, now) {
            Some(Adoptable::Waited(entry)) => {
                self.unknown_holders -= 1;
                Some(entry)
            }
            Some(Adoptable::Untracked) => {
                self.stats.released += 1;
                self.outbox.push((conn, Response::Released { token }));
                self.note_freed(key);
                None
            }
            None => {
                self.stats.release_not_held += 1;
                self.not_held(conn, token);
                None
            }
        }
    }

    /// `E` of a token that is not this run's active grant of `key`: an
    /// earlier run's token on a key held by the unknown grant adopts it
    /// (spec §7.3): it becomes the key's holder, owner 0. Returns the entry
    /// whose lease to arm, or `None` once it has answered `N`.
    pub(super) fn adopt_earlier_token(
        &mut self,
        conn: ConnId,
        key: &str,
        token: u64,
        now: Micros,
    ) -> Option<u32> {
        let entry = match self.adoptable(key, token, now) {
            Some(Adoptable::Waited(entry)) => {
                self.unknown_holders -= 1;
                let held = self.table.get_mut(entry);
                held.token = token;
                held.owner = 0;
                self.grants_held += 1;
                Some(entry)
            }
            Some(Adoptable::Untracked) => {
                // An earlier run's holders must not lose their keys to
                // this run's waiters filling the table, so adoption may
                // take it to twice the key limit: that run held at most
                // that many, and the bound on memory stays. No room:
                // nothing changed, and the key stays held by the unknown
                // grant until the horizon.
                let hash = self.table.hash(key);
                let entry = (self.table.len() < self.limits.max_keys.saturating_mul(2))
                    .then(|| self.table.insert(key, hash, token, 0))
                    .flatten();
                self.grants_held += usize::from(entry.is_some());
                entry
            }
            None => None,
        };
        if entry.is_none() {
            self.stats.extend_not_held += 1;
            self.not_held(conn, token);
        }
        entry
    }

    /// Whether `key`, not in the table, counts as held by the unknown
    /// grant: during the grace, unless it is known free.
    pub(super) fn held_by_unknown_grant(&self, key: &str, now: Micros) -> bool {
        now < self.grace_until && !self.freed_in_grace.contains(key)
    }

    /// Drops the keys remembered free once the grace is over.
    pub(super) fn forget_freed_after_grace(&mut self, now: Micros) {
        if now >= self.grace_until && !self.freed_in_grace.is_empty() {
            self.freed_in_grace = HashSet::default();
        }
    }

    /// `entry`'s key is about to leave the table free: while the grace
    /// runs, remember that it is free (not in the table would mean held).
    pub(super) fn note_freed_in_grace(&mut self, entry: u32, now: Micros) {
        if now < self.grace_until {
            let key: Box<str> = self.table.key(entry).into();
            self.note_freed(&key);
        }
    }
}
