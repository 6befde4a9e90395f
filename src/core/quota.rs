//! Per-identity quotas of the `--auth` file (issue 27): `max-keys=N` bounds
//! the keys an identity's requests brought into the table. A key is
//! charged to the identity whose request created its entry and uncharged
//! when the entry leaves the table, whoever holds it meanwhile. A server
//! without quotas keeps this empty and pays one branch per request.

use std::collections::HashMap;

/// The charges of every identity that has a key quota.
#[derive(Default)]
pub(in crate::core) struct Quotas {
    /// While a request of an identity with a key quota runs: its index and
    /// its `max-keys`.
    pub current: Option<(u32, u32)>,
    /// Keys charged, by identity index.
    keys: Vec<u32>,
    /// The identity each charged entry is charged to.
    key_of: HashMap<u32, u32, foldhash::fast::RandomState>,
}

impl Quotas {
    /// Whether the current request may bring one more key into the table.
    #[inline]
    pub fn key_fits(&self) -> bool {
        self.current.is_none_or(|(identity, max)| {
            self.keys.get(identity as usize).copied().unwrap_or(0) < max
        })
    }

    /// Charges the new `entry` to the current request's identity, if it
    /// has a key quota.
    #[inline]
    pub fn charge_key(&mut self, entry: u32) {
        if let Some((identity, _)) = self.current {
            let index = identity as usize;
            if self.keys.len() <= index {
                self.keys.resize(index + 1, 0);
            }
            self.keys[index] += 1;
            self.key_of.insert(entry, identity);
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

    /// The sum of the per-identity counters (for the invariants).
    pub fn keys_total(&self) -> u64 {
        self.keys.iter().map(|&count| u64::from(count)).sum()
    }
}
