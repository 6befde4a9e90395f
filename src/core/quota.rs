//! Per-identity quotas of the `--auth` file (issue 27).
//!
//! `max-keys=N` bounds the keys an identity's requests brought into the
//! table. A key is charged to the identity whose request created its entry
//! and uncharged when the entry leaves the table, whoever holds it
//! meanwhile.
//!
//! `max-grants=N` bounds the grants plus queued waiters of an identity's
//! sessions (what `--max-grants` bounds for the whole server, spec §10.8).
//! A grant or waiter made by an `A`/`S` of such an identity is charged to
//! it in a side map keyed like the labels ([`LabelOf`]); the charge moves
//! with the waiter into its grant on a hand-over (and with an inline grant
//! that becomes a permit key's) and is returned when the grant or waiter
//! ends, whatever ends it. A grant (and its key, when new) adopted from
//! an earlier run during a crash grace is charged to the identity whose
//! `E` adopted it (spec §7.3 v5). Grants restored from the state directory
//! are charged to nobody: the identity is not persisted.
//!
//! `max-watches=N` bounds the watches (held `O`, spec §13.3) of an
//! identity's sessions: a held watch is charged to it, by watch id, and
//! returned when the watch is answered or dropped.
//!
//! A server without quotas keeps all of this empty: no request pays for
//! it but the release of an inline grant (one test, shared with the
//! labels').

use std::collections::HashMap;

use super::labels::LabelOf;

/// The quotas of the identity whose request runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::core) struct Current {
    pub identity: u32,
    /// Its `max-keys`, or [`NO_QUOTA`].
    pub max_keys: u32,
    /// Its `max-watches`, or [`NO_QUOTA`].
    pub max_watches: u32,
    /// Its `max-grants`, or [`NO_QUOTA`] (checked here only by an
    /// adoption, spec §7.3 v5; an `A`/`S` lowers the grant cap instead).
    pub max_grants: u32,
}

/// A quota that is not set: above any count (quotas are at most
/// `access::QUOTA_MAX`).
pub(in crate::core) const NO_QUOTA: u32 = u32::MAX;

/// The charges of every identity that has a quota.
#[derive(Default)]
pub(in crate::core) struct Quotas {
    /// While a request of an identity with a quota runs.
    pub current: Option<Current>,
    /// Keys charged, by identity index.
    keys: Vec<u32>,
    /// The identity each charged entry is charged to.
    key_of: HashMap<u32, u32, foldhash::fast::RandomState>,
    /// Grants plus waiters charged, by identity index.
    grants: Vec<u32>,
    /// The `max-grants` of each identity charged so far, by index (for
    /// the invariants: the file is read at start only).
    grant_max: Vec<u32>,
    /// The identity each charged grant or waiter is charged to, by
    /// [`LabelOf`] id.
    grant_of: HashMap<u64, u32, foldhash::fast::RandomState>,
    /// Watches charged, by identity index.
    watches: Vec<u32>,
    /// The identity each charged watch is charged to, by watch id.
    watch_of: HashMap<u32, u32, foldhash::fast::RandomState>,
}

impl Quotas {
    /// Whether the current request may bring one more key into the table.
    #[inline]
    pub fn key_fits(&self) -> bool {
        self.current.is_none_or(|current| {
            self.keys
                .get(current.identity as usize)
                .copied()
                .unwrap_or(0)
                < current.max_keys
        })
    }

    /// Charges the new `entry` to the current request's identity, if it
    /// has a key quota.
    #[inline]
    pub fn charge_key(&mut self, entry: u32) {
        if let Some(current) = self.current.filter(|current| current.max_keys != NO_QUOTA) {
            let index = current.identity as usize;
            if self.keys.len() <= index {
                self.keys.resize(index + 1, 0);
            }
            self.keys[index] += 1;
            self.key_of.insert(entry, current.identity);
        }
    }

    /// `entry` leaves the table: its identity, if charged, gets it back.
    #[inline]
    pub fn uncharge_key(&mut self, entry: u32) {
        if self.key_of.is_empty() {
            return;
        }
        if let Some(identity) = self.key_of.remove(&entry) {
            if let Some(count) = self.keys.get_mut(identity as usize) {
                *count -= 1;
            }
        }
    }

    /// Keys charged to `identity`.
    pub fn keys_of(&self, identity: u32) -> u32 {
        self.keys.get(identity as usize).copied().unwrap_or(0)
    }

    /// The charged entries (for the invariants).
    pub fn charged_entries(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.key_of
            .iter()
            .map(|(&entry, &identity)| (entry, identity))
    }

    /// The sum of the per-identity key counters (for the invariants).
    pub fn keys_total(&self) -> u64 {
        self.keys.iter().map(|&count| u64::from(count)).sum()
    }

    /// Whether no grant or waiter is charged to anyone.
    #[inline(always)]
    pub fn no_grant_charged(&self) -> bool {
        self.grant_of.is_empty()
    }

    /// Grants plus waiters charged to `identity`.
    pub fn grants_of(&self, identity: u32) -> u32 {
        self.grants.get(identity as usize).copied().unwrap_or(0)
    }

    /// Charges the grant or waiter `of` to `identity`, whose `max-grants`
    /// is `max`.
    #[cold]
    #[inline(never)]
    pub fn charge_grant(&mut self, of: LabelOf, identity: u32, max: u32) {
        let index = identity as usize;
        if self.grants.len() <= index {
            self.grants.resize(index + 1, 0);
            self.grant_max.resize(index + 1, NO_QUOTA);
        }
        self.grants[index] += 1;
        self.grant_max[index] = max;
        let old = self.grant_of.insert(of.id(), identity);
        debug_assert_eq!(old, None, "{of:?} charged twice");
    }

    /// The grant or waiter `of` ended: its identity, if charged, gets it
    /// back, and is returned (a hand-over charges the new grant to it with
    /// [`recharge`](Self::recharge)).
    #[inline]
    pub fn uncharge_grant(&mut self, of: LabelOf) -> Option<u32> {
        if self.grant_of.is_empty() {
            return None;
        }
        self.remove_grant(of)
    }

    #[inline(never)]
    fn remove_grant(&mut self, of: LabelOf) -> Option<u32> {
        let identity = self.grant_of.remove(&of.id())?;
        if let Some(count) = self.grants.get_mut(identity as usize) {
            *count -= 1;
        }
        if self.grant_of.is_empty() && self.grant_of.capacity() > 64 {
            self.grant_of = HashMap::default();
        }
        Some(identity)
    }

    /// Charges `of`, a grant just made from a waiter that was charged to
    /// `identity` (and uncharged as it left its queue), to the same
    /// identity: a hand-over neither adds nor frees a grant.
    #[inline]
    pub fn recharge(&mut self, of: LabelOf, identity: Option<u32>) {
        if let Some(identity) = identity {
            let max = self.grant_max_of(identity);
            self.charge_grant(of, identity, max);
        }
    }

    /// The `max-grants` last seen for `identity`.
    fn grant_max_of(&self, identity: u32) -> u32 {
        self.grant_max
            .get(identity as usize)
            .copied()
            .unwrap_or(NO_QUOTA)
    }

    /// The charged grants and waiters as ([`LabelOf`] id, identity) (for
    /// the invariants).
    pub fn charged_grants(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.grant_of.iter().map(|(&of, &identity)| (of, identity))
    }

    /// Each identity's grant charge and `max-grants` (for the invariants).
    pub fn grant_counts(&self) -> impl Iterator<Item = (u32, u32, u32)> + '_ {
        self.grants
            .iter()
            .zip(&self.grant_max)
            .enumerate()
            .map(|(identity, (&count, &max))| (identity as u32, count, max))
    }

    /// Whether the current request's identity may have one more grant
    /// (an adoption, spec §7.3 v5).
    pub fn grant_fits(&self) -> bool {
        self.current
            .is_none_or(|current| self.grants_of(current.identity) < current.max_grants)
    }

    /// Charges `of`, a grant just adopted, to the current request's
    /// identity, if it has a grant quota.
    pub fn charge_adopted(&mut self, of: LabelOf) {
        if let Some(current) = self
            .current
            .filter(|current| current.max_grants != NO_QUOTA)
        {
            self.charge_grant(of, current.identity, current.max_grants);
        }
    }

    /// Whether the current request may hold one more watch.
    #[inline]
    pub fn watch_fits(&self) -> bool {
        self.current
            .is_none_or(|current| self.watches_of(current.identity) < current.max_watches)
    }

    /// Charges the held `watch` to the current request's identity, if it
    /// has a watch quota.
    #[inline]
    pub fn charge_watch(&mut self, watch: u32) {
        if let Some(current) = self
            .current
            .filter(|current| current.max_watches != NO_QUOTA)
        {
            let index = current.identity as usize;
            if self.watches.len() <= index {
                self.watches.resize(index + 1, 0);
            }
            self.watches[index] += 1;
            self.watch_of.insert(watch, current.identity);
        }
    }

    /// `watch` ended (answered or dropped): its identity, if charged, gets
    /// it back.
    #[inline]
    pub fn uncharge_watch(&mut self, watch: u32) {
        if self.watch_of.is_empty() {
            return;
        }
        if let Some(identity) = self.watch_of.remove(&watch) {
            if let Some(count) = self.watches.get_mut(identity as usize) {
                *count -= 1;
            }
            if self.watch_of.is_empty() && self.watch_of.capacity() > 64 {
                self.watch_of = HashMap::default();
            }
        }
    }

    /// Watches charged to `identity`.
    pub fn watches_of(&self, identity: u32) -> u32 {
        self.watches.get(identity as usize).copied().unwrap_or(0)
    }

    /// The sum of the per-identity watch counters and the number of
    /// charged watches (for the invariants: they agree).
    pub fn watch_totals(&self) -> (u64, usize) {
        (
            self.watches.iter().map(|&count| u64::from(count)).sum(),
            self.watch_of.len(),
        )
    }
}
