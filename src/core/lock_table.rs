//! The lock table: key → entry, sized for millions of keys.
//!
//! Entries live in one dense `Vec` and are found through a chained hash
//! index whose links are inside the entries, so a held lock with a key of
//! up to [`INLINE_KEY_MAX`] bytes costs one 56-byte entry plus 4 bytes of
//! bucket array and no allocation of its own. Indices of live entries are
//! stable until [`LockTable::remove`]; the timer wheel and the waiter queues
//! refer to entries by index.

use std::hash::BuildHasher;

use slab::Slab;

use super::timer_wheel::TimerLinks;

/// Marks the end of a chain, an empty bucket, or "no waiters".
pub const NIL: u32 = u32::MAX;

/// Keys up to this many bytes are stored inside the entry.
pub const INLINE_KEY_MAX: usize = 19;

/// The table refuses to grow past this many entries (indices must stay
/// below the timer wheel's reserved ids and the waiter tag bit).
pub const ENTRIES_MAX: usize = 1 << 30;

const BUCKETS_MIN: usize = 64;

/// One key of the table: always held, by a grant of this run (`token` ≠ 0)
/// or — after an unclean restart — by an unknown grant of an earlier run
/// (`token` = 0) until the lease horizon.
#[derive(Clone, Debug)]
pub struct LockEntry {
    /// The active grant's fencing token; 0 while held by an unknown grant.
    pub token: u64,
    /// The owner of the request that was granted (0 for an unknown grant).
    pub owner: u64,
    /// The lease-expiry timer.
    pub lease: TimerLinks,
    /// The head of the FIFO waiter queue, or [`NIL`].
    pub waiters: u32,
    /// The next entry in this entry's bucket chain, or on the free list.
    chain_next: u32,
    key: StoredKey,
}

/// A key stored inline (`len ≤ INLINE_KEY_MAX`) or as an index into the
/// table's long-key slab. `len` 0 marks a free entry.
#[derive(Clone, Copy, Debug)]
struct StoredKey {
    len: u8,
    bytes: [u8; INLINE_KEY_MAX],
}

impl StoredKey {
    const FREE: StoredKey = StoredKey {
        len: 0,
        bytes: [0; INLINE_KEY_MAX],
    };

    fn long_index(&self) -> usize {
        let mut index = [0u8; 4];
        index.copy_from_slice(&self.bytes[..4]);
        u32::from_le_bytes(index) as usize
    }
}

/// The table of keys.
pub struct LockTable {
    entries: Vec<LockEntry>,
    free_head: u32,
    buckets: Vec<u32>,
    len: usize,
    long_keys: Slab<Box<[u8]>>,
    hasher: foldhash::fast::RandomState,
}

impl Default for LockTable {
    fn default() -> Self {
        Self::new()
    }
}

impl LockTable {
    pub fn new() -> LockTable {
        LockTable {
            entries: Vec::new(),
            free_head: NIL,
            buckets: vec![NIL; BUCKETS_MIN],
            len: 0,
            long_keys: Slab::new(),
            hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// How many keys the table holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The hash [`find`](Self::find) and [`insert`](Self::insert) take;
    /// computed once per request.
    pub fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key.as_bytes())
    }

    /// The index of `key`'s entry, if the key is in the table.
    pub fn find(&self, key: &str, hash: u64) -> Option<u32> {
        let mut index = *self.buckets.get(self.bucket_of(hash))?;
        while index != NIL {
            let entry = self.entries.get(index as usize)?;
            if self.key_bytes(&entry.key) == key.as_bytes() {
                return Some(index);
            }
            index = entry.chain_next;
        }
        None
    }

    /// Adds `key` (which must not be in the table) with the given holder
    /// and returns its index, or `None` when the table is at
    /// [`ENTRIES_MAX`].
    pub fn insert(&mut self, key: &str, hash: u64, token: u64, owner: u64) -> Option<u32> {
        debug_assert!(self.find(key, hash).is_none());
        debug_assert!(!key.is_empty() && key.len() <= u8::MAX as usize);
        if self.len >= ENTRIES_MAX {
            return None;
        }
        if self.len >= self.buckets.len() {
            self.grow_buckets();
        }
        let stored = self.store_key(key);
        let bucket = self.bucket_of(hash);
        let entry = LockEntry {
            token,
            owner,
            lease: TimerLinks::UNARMED,
            waiters: NIL,
            chain_next: self.buckets[bucket],
            key: stored,
        };
        let index = if self.free_head != NIL {
            let index = self.free_head;
            self.free_head = self.entries[index as usize].chain_next;
            self.entries[index as usize] = entry;
            index
        } else {
            self.entries.push(entry);
            (self.entries.len() - 1) as u32
        };
        self.buckets[bucket] = index;
        self.len += 1;
        Some(index)
    }

    /// Removes the entry at `index`. The caller has already disarmed its
    /// timer and emptied its queue.
    pub fn remove(&mut self, index: u32) {
        let Some(entry) = self.entries.get(index as usize) else {
            return;
        };
        debug_assert!(!entry.lease.is_armed() && entry.waiters == NIL);
        let stored = entry.key;
        if stored.len == 0 {
            return;
        }
        let hash = self.hasher.hash_one(self.key_bytes(&stored));
        let bucket = self.bucket_of(hash);
        let next = entry.chain_next;
        if self.buckets[bucket] == index {
            self.buckets[bucket] = next;
        } else {
            let mut at = self.buckets[bucket];
            while at != NIL {
                let entry = &mut self.entries[at as usize];
                if entry.chain_next == index {
                    entry.chain_next = next;
                    break;
                }
                at = entry.chain_next;
            }
        }
        if stored.len as usize > INLINE_KEY_MAX {
            self.long_keys.try_remove(stored.long_index());
        }
        let entry = &mut self.entries[index as usize];
        entry.key = StoredKey::FREE;
        entry.chain_next = self.free_head;
        self.free_head = index;
        self.len -= 1;
        if self.len == 0 {
            self.release_memory();
        }
    }

    /// The indices of the live entries, for consistency checks.
    #[doc(hidden)]
    pub fn live_indices(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.entries.len() as u32).filter(|&index| self.entries[index as usize].key.len != 0)
    }

    pub fn get(&self, index: u32) -> &LockEntry {
        &self.entries[index as usize]
    }

    pub fn get_mut(&mut self, index: u32) -> &mut LockEntry {
        &mut self.entries[index as usize]
    }

    /// The key of a live entry.
    pub fn key(&self, index: u32) -> &str {
        let bytes = self.key_bytes(&self.entries[index as usize].key);
        std::str::from_utf8(bytes).expect("keys are stored from validated `&str`s")
    }

    fn bucket_of(&self, hash: u64) -> usize {
        (hash as usize) & (self.buckets.len() - 1)
    }

    fn key_bytes<'a>(&'a self, stored: &'a StoredKey) -> &'a [u8] {
        let len = stored.len as usize;
        if len <= INLINE_KEY_MAX {
            &stored.bytes[..len]
        } else {
            &self.long_keys[stored.long_index()][..]
        }
    }

    fn store_key(&mut self, key: &str) -> StoredKey {
        let mut stored = StoredKey {
            len: key.len() as u8,
            bytes: [0; INLINE_KEY_MAX],
        };
        if key.len() <= INLINE_KEY_MAX {
            stored.bytes[..key.len()].copy_from_slice(key.as_bytes());
        } else {
            let index = self.long_keys.insert(key.as_bytes().into()) as u32;
            stored.bytes[..4].copy_from_slice(&index.to_le_bytes());
        }
        stored
    }

    /// Doubles the bucket array and rebuilds the chains, keeping the load
    /// factor at most 1.
    fn grow_buckets(&mut self) {
        let mut buckets = vec![NIL; self.buckets.len() * 2];
        let mask = buckets.len() - 1;
        for index in 0..self.entries.len() {
            let stored = self.entries[index].key;
            if stored.len == 0 {
                continue;
            }
            let bucket = (self.hasher.hash_one(self.key_bytes(&stored)) as usize) & mask;
            self.entries[index].chain_next = buckets[bucket];
            buckets[bucket] = index as u32;
        }
        self.buckets = buckets;
    }

    /// Called when the table becomes empty: drop the storage a burst of
    /// keys left behind, so an idle server returns to its idle footprint.
    fn release_memory(&mut self) {
        self.entries.clear();
        self.free_head = NIL;
        if self.entries.capacity() > 4096 {
            self.entries = Vec::new();
        }
        if self.buckets.len() > BUCKETS_MIN {
            self.buckets = vec![NIL; BUCKETS_MIN];
        }
        if self.long_keys.capacity() > 64 {
            self.long_keys = Slab::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_stays_small() {
        assert_eq!(std::mem::size_of::<LockEntry>(), 56);
    }

    #[test]
    fn insert_find_remove_many_with_short_and_long_keys() {
        let mut table = LockTable::new();
        let keys: Vec<String> = (0..5000)
            .map(|i| {
                if i % 3 == 0 {
                    format!("long-key-{i:0>40}")
                } else {
                    format!("k{i}")
                }
            })
            .collect();
        let mut indices = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let hash = table.hash(key);
            indices.push(table.insert(key, hash, i as u64 + 1, 7).unwrap());
        }
        assert_eq!(table.len(), keys.len());
        for (i, key) in keys.iter().enumerate() {
            let index = table.find(key, table.hash(key)).unwrap();
            assert_eq!(index, indices[i]);
            assert_eq!(table.get(index).token, i as u64 + 1);
            assert_eq!(table.key(index), key);
        }
        for (i, key) in keys.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
            table.remove(indices[i]);
            assert!(table.find(key, table.hash(key)).is_none());
        }
        for (i, key) in keys.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
            assert_eq!(table.find(key, table.hash(key)), Some(indices[i]));
        }
        assert!(table.find("absent", table.hash("absent")).is_none());
        for (i, _) in keys.iter().enumerate().filter(|(i, _)| i % 2 == 1) {
            table.remove(indices[i]);
        }
        assert!(table.is_empty());
        assert_eq!(table.buckets.len(), BUCKETS_MIN);
    }
}
