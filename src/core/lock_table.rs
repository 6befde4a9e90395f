//! The lock table: key → entry, sized for millions of keys.
//!
//! Entries live in one dense `Vec`; an open-addressing index of entry
//! indices with tag bytes ([`KeyIndex`], one cache line per bucket) finds
//! them. A lookup costs one index line plus the entry, and a held lock
//! with a key of up to [`INLINE_KEY_MAX`] bytes costs one 52-byte entry
//! plus 6.7–13.3 bytes of index and no allocation of its own.
//! Indices of live entries are stable until [`LockTable::remove`]; the
//! timer wheel and the waiter queues refer to entries by index.

use std::hash::BuildHasher as _;

use slab::Slab;

use super::key_index::KeyIndex;
use super::memory::{NIL, advise_huge_pages};
use super::waiters::Queue;
use crate::timer_wheel::TimerLinks;

/// Keys up to this many bytes are stored inside the entry.
pub const INLINE_KEY_MAX: usize = 19;

/// The table refuses to grow past this many entries (indices must stay
/// below the timer wheel's reserved ids and the waiter tag bit).
pub const ENTRIES_MAX: usize = 1 << 30;

/// The key hash (docs/DESIGN.md, "The key hash", has the threat model and
/// the measurements). Peers choose keys and never see a hash value, so the
/// index starts with foldhash under a per-process random seed — fast, but
/// only "minimally DoS-resistant" — and switches for good to SipHash-1-3
/// under a fresh random 128-bit key (std's `RandomState`, a keyed PRF) at
/// the first insert after any lookup or insert walked
/// [`LONG_WALK`](super::key_index::LONG_WALK) buckets, which random keys
/// practically never do and keys chosen to collide must.
enum KeyHasher {
    Fast(foldhash::fast::RandomState),
    Keyed(std::collections::hash_map::RandomState),
}

impl KeyHasher {
    fn new() -> KeyHasher {
        // `--features sip-hash` starts keyed: only to measure the cost.
        if cfg!(feature = "sip-hash") {
            KeyHasher::Keyed(Default::default())
        } else {
            KeyHasher::Fast(Default::default())
        }
    }

    #[inline]
    fn hash(&self, bytes: &[u8]) -> u64 {
        match self {
            KeyHasher::Fast(state) => state.hash_one(bytes),
            KeyHasher::Keyed(state) => state.hash_one(bytes),
        }
    }
}

/// Below this many keys (~2 MB of table, a core's L2) lookups mostly hit
/// the cache and [`LockTable::prefetch`] does nothing.
const PREFETCH_MIN_KEYS: usize = 1 << 15;

/// One key of the table: always held, by a grant of this run (`token` ≠ 0)
/// or — after an unclean restart — by an unknown grant of an earlier run
/// (`token` = 0) until the lease horizon.
///
/// 52 bytes, packed to 4-byte alignment (which saves 4 bytes of
/// padding). Every field is read and written by value except the
/// 4-aligned `lease` and `waiters`, which the core borrows.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
pub struct LockEntry {
    /// The active grant's fencing token; 0 while held by an unknown grant.
    pub token: u64,
    /// The owner of the request that was granted (0 for an unknown grant).
    pub owner: u64,
    /// The lease-expiry timer.
    pub lease: TimerLinks,
    /// The FIFO waiter queue, which also keeps when the active inline
    /// grant was made (for `H`; a grant restored after a restart counts
    /// from the restart, 0). On a free entry, the next free entry.
    pub waiters: Queue,
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

/// The bytes of a stored key (a free function so that the index can be
/// borrowed mutably while keys are read to rehash it).
fn key_bytes<'a>(long_keys: &'a Slab<Box<[u8]>>, stored: &'a StoredKey) -> &'a [u8] {
    let len = stored.len as usize;
    if len <= INLINE_KEY_MAX {
        &stored.bytes[..len]
    } else {
        long_keys
            .get(stored.long_index())
            .map(|key| &key[..])
            .unwrap_or_default()
    }
}

/// The table of keys.
pub struct LockTable {
    entries: Vec<LockEntry>,
    free_head: u32,
    /// Entry indices, found by key hash; holds exactly the live entries.
    index: KeyIndex,
    long_keys: Slab<Box<[u8]>>,
    hasher: KeyHasher,
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
            index: KeyIndex::new(),
            long_keys: Slab::new(),
            hasher: KeyHasher::new(),
        }
    }

    /// How many keys the table holds.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The hash [`find`](Self::find) and [`insert`](Self::insert) take;
    /// computed once per request.
    pub fn hash(&self, key: &str) -> u64 {
        self.hasher.hash(key.as_bytes())
    }

    /// The index of `key`'s entry, if the key is in the table.
    pub fn find(&self, key: &str, hash: u64) -> Option<u32> {
        let entries = &self.entries;
        let long_keys = &self.long_keys;
        self.index.find(hash, |index| {
            entries
                .get(index as usize)
                .is_some_and(|entry| key_bytes(long_keys, &entry.key) == key.as_bytes())
        })
    }

    /// Starts loading the index line a [`find`](Self::find) or
    /// [`insert`](Self::insert) of `key` reads first; changes nothing.
    /// Skipped while the table is small enough to stay in cache, where it
    /// would only cost a second hash of the key.
    pub fn prefetch(&self, key: &str) {
        if self.prefetch_pays() {
            self.index.prefetch(self.hash(key));
        }
    }

    /// Whether the table is large enough for [`prefetch`](Self::prefetch)
    /// to do anything.
    pub fn prefetch_pays(&self) -> bool {
        self.len() >= PREFETCH_MIN_KEYS
    }

    /// Adds `key` (which must not be in the table) with the given holder
    /// and returns its index, or `None` when the table is at
    /// [`ENTRIES_MAX`].
    pub fn insert(&mut self, key: &str, hash: u64, token: u64, owner: u64) -> Option<u32> {
        debug_assert!(self.find(key, hash).is_none());
        debug_assert!(!key.is_empty() && key.len() <= u8::MAX as usize);
        if self.len() >= ENTRIES_MAX {
            return None;
        }
        let stored = self.store_key(key);
        let entry = LockEntry {
            token,
            owner,
            lease: TimerLinks::UNARMED,
            waiters: Queue::empty(0),
            key: stored,
        };
        let index = match self.entries.get_mut(self.free_head as usize) {
            Some(free) => {
                let index = self.free_head;
                self.free_head = free.waiters.as_free_link();
                *free = entry;
                index
            }
            None => {
                if self.entries.len() == self.entries.capacity() {
                    self.entries.reserve(self.entries.len().max(64));
                    advise_huge_pages(self.entries.as_ptr(), self.entries.capacity());
                }
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        let (entries, long_keys, hasher) = (&self.entries, &self.long_keys, &self.hasher);
        self.index.insert(hash, index, |index| {
            hasher.hash(key_bytes(long_keys, &entries[index as usize].key))
        });
        if self.index.long_walk_seen() && matches!(self.hasher, KeyHasher::Fast(_)) {
            self.rekey();
        }
        Some(index)
    }

    /// Switches to the keyed hash and rebuilds the index with it. Entry
    /// indices do not change; hashes computed before the call are stale.
    fn rekey(&mut self) {
        log::warn!(
            "lock table: a lookup walked {}+ index buckets; \
             switching the key hash to keyed SipHash-1-3",
            super::key_index::LONG_WALK
        );
        self.hasher = KeyHasher::Keyed(Default::default());
        let mut index = KeyIndex::new();
        let (entries, long_keys, hasher) = (&self.entries, &self.long_keys, &self.hasher);
        let hash_of = |index: u32| hasher.hash(key_bytes(long_keys, &entries[index as usize].key));
        for (position, entry) in entries.iter().enumerate() {
            if entry.key.len != 0 {
                index.insert(hash_of(position as u32), position as u32, hash_of);
            }
        }
        self.index = index;
    }

    /// Removes the entry at `index`. The caller has already disarmed its
    /// timer and emptied its queue.
    pub fn remove(&mut self, index: u32) {
        let Some(entry) = self.entries.get(index as usize) else {
            return;
        };
        debug_assert!(!{ entry.lease }.is_armed() && { entry.waiters }.is_empty());
        let stored = entry.key;
        if stored.len == 0 {
            return;
        }
        let hash = self.hasher.hash(key_bytes(&self.long_keys, &stored));
        self.index.remove(hash, index);
        if stored.len as usize > INLINE_KEY_MAX {
            self.long_keys.try_remove(stored.long_index());
        }
        let entry = &mut self.entries[index as usize];
        entry.key = StoredKey::FREE;
        entry.waiters = Queue::free_link(self.free_head);
        self.free_head = index;
        if self.index.is_empty() {
            self.release_memory();
        }
    }

    /// The indices of the live entries, for consistency checks.
    #[doc(hidden)]
    pub fn live_indices(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.entries.len() as u32).filter(|&index| self.entries[index as usize].key.len != 0)
    }

    /// How many entry slots exist, live or free: entry indices are below
    /// it. A live entry keeps its index until it is removed, so a walk over
    /// `0..slots()` meets every key that stays in the table throughout
    /// (the `L` cursor, docs/DESIGN.md).
    pub fn slots(&self) -> usize {
        self.entries.len()
    }

    /// Whether `index` is a live entry (not on the free list).
    pub fn is_live(&self, index: u32) -> bool {
        self.entries
            .get(index as usize)
            .is_some_and(|entry| entry.key.len != 0)
    }

    pub fn get(&self, index: u32) -> &LockEntry {
        &self.entries[index as usize]
    }

    pub fn get_mut(&mut self, index: u32) -> &mut LockEntry {
        &mut self.entries[index as usize]
    }

    /// The key of a live entry.
    /// The key of `index` as bytes, without the UTF-8 check of
    /// [`key`](Self::key) (what a MAC of it needs, per grant).
    pub fn key_bytes(&self, index: u32) -> &[u8] {
        key_bytes(&self.long_keys, &self.entries[index as usize].key)
    }

    pub fn key(&self, index: u32) -> &str {
        let bytes = key_bytes(&self.long_keys, &self.entries[index as usize].key);
        std::str::from_utf8(bytes).expect("keys are stored from validated `&str`s")
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

    /// Called when the table becomes empty: drop the storage a burst of
    /// keys left behind, so an idle server returns to its idle footprint.
    fn release_memory(&mut self) {
        self.entries.clear();
        self.free_head = NIL;
        if self.entries.capacity() > 4096 {
            self.entries = Vec::new();
        }
        if self.index.allocated_bytes() > 4096 {
            self.index.clear_and_release();
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
        assert_eq!(std::mem::size_of::<LockEntry>(), 52);
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
            assert_eq!({ table.get(index).token }, i as u64 + 1);
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
        assert_eq!(table.index.allocated_bytes(), 0);
    }

    #[test]
    fn rekeying_keeps_every_key_and_index() {
        let mut table = LockTable::new();
        let keys: Vec<String> = (0..3000).map(|i| format!("key-{i}")).collect();
        let indices: Vec<u32> = keys
            .iter()
            .map(|key| table.insert(key, table.hash(key), 1, 2).unwrap())
            .collect();
        table.rekey();
        assert!(matches!(table.hasher, KeyHasher::Keyed(_)));
        for (key, &index) in keys.iter().zip(&indices) {
            assert_eq!(table.find(key, table.hash(key)), Some(index));
        }
        for &index in &indices[..1500] {
            table.remove(index);
        }
        for (key, &index) in keys.iter().zip(&indices).skip(1500) {
            assert_eq!(table.find(key, table.hash(key)), Some(index));
        }
        assert_eq!(table.len(), 1500);
    }
}
