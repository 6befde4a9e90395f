//! Held observe requests (`O`, spec §13): one node per watch, found three
//! ways — by its key (to answer every watch of a key when its token
//! changes), by its connection (to drop them when it closes) and by its
//! timer id (its deadline, in the core's wheel). Watches live outside the
//! lock table: a watch never adds a key there or keeps one.
//!
//! Every watch of one key waits on the same token (a watch is held only
//! while `since` equals the key's current token, and all of them are
//! answered as soon as it changes), so the key's record keeps it once.
//!
//! Memory (spec §13.3: at most 64 bytes per watch plus its key's bytes once
//! per watched key): a watch is a 40-byte node plus 4 bytes in its
//! connection's list; the watches of a key are an intrusive list through
//! the nodes, so a key's record holds no list of its own. The key's bytes
//! live once, in its record: the index from keys to records is a
//! power-of-two array of buckets (4 bytes each, at most two per record),
//! each the first record of a chain through `next_same_hash`.
//!
//! A record whose key's token changed is *detached* from that index (a new
//! `O` on the key starts a new record) while its watches are answered,
//! perhaps over several turns of the event loop (spec §4, v5).

use std::hash::BuildHasher;

use crate::core::ConnId;
use crate::core::memory::NIL;
use crate::timer_wheel::TimerLinks;

/// `next_same_hash` of a record that is out of the index.
const DETACHED: u32 = NIL - 1;

/// `conn` of a vacant node in [`Nodes`].
const VACANT: ConnId = ConnId::MAX;

/// One held `O`.
#[derive(Clone, Copy, Debug)]
pub struct Watch {
    pub conn: ConnId,
    /// Where it sits in its connection's list.
    at_conn: u32,
    /// Its key's record in [`Watches::keys`].
    pub key: u32,
    /// Its neighbours in its key's list ([`NIL`] at the ends).
    key_prev: u32,
    key_next: u32,
    pub timer: TimerLinks,
    /// The request's `id`, echoed in its `V`.
    pub id: u64,
}

/// The watches of one key.
#[derive(Debug)]
pub struct KeyWatches {
    pub key: Box<str>,
    /// The token every watch of this key waits to change.
    pub since: u64,
    /// The first watch of its list, and how many there are.
    head: u32,
    count: u32,
    /// Tells this record from a later one in the same slot (a wake that
    /// goes on in a later turn names its record by slot and generation).
    pub generation: u32,
    /// The next record with the same hash, [`NIL`] at the end of the
    /// chain, [`DETACHED`] for a record out of the index.
    next_same_hash: u32,
}

/// The watch nodes: a vector whose vacant nodes (`conn` [`VACANT`]) form a
/// free list through `key_next`; 40 bytes a node, where a slab's tag would
/// make it 48.
#[derive(Debug)]
struct Nodes {
    all: Vec<Watch>,
    free: u32,
    len: usize,
}

impl Default for Nodes {
    fn default() -> Self {
        Nodes {
            all: Vec::new(),
            free: NIL,
            len: 0,
        }
    }
}

impl Nodes {
    fn insert(&mut self, node: Watch) -> u32 {
        self.len += 1;
        if self.free != NIL {
            let at = self.free;
            self.free = self.all[at as usize].key_next;
            self.all[at as usize] = node;
            at
        } else {
            self.all.push(node);
            (self.all.len() - 1) as u32
        }
    }

    fn remove(&mut self, at: u32) -> Watch {
        let slot = &mut self.all[at as usize];
        debug_assert_ne!(slot.conn, VACANT, "watch {at} removed twice");
        let node = *slot;
        slot.conn = VACANT;
        slot.key_next = self.free;
        self.free = at;
        self.len -= 1;
        node
    }
}

impl std::ops::Index<usize> for Nodes {
    type Output = Watch;
    fn index(&self, at: usize) -> &Watch {
        &self.all[at]
    }
}

impl std::ops::IndexMut<usize> for Nodes {
    fn index_mut(&mut self, at: usize) -> &mut Watch {
        &mut self.all[at]
    }
}

/// Every held watch.
#[derive(Debug, Default)]
pub struct Watches {
    nodes: Nodes,
    keys: slab::Slab<KeyWatches>,
    /// The index: a key's hash, masked, → the first record of its chain
    /// ([`NIL`] for none); empty while no record is in it.
    buckets: Vec<u32>,
    /// Records in the index.
    attached: usize,
    hasher: foldhash::fast::RandomState,
    /// The watches of each connection, by connection id.
    by_conn: Vec<Vec<u32>>,
    /// The generation of the next record.
    next_generation: u32,
}

impl Watches {
    /// How many watches are held.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.nodes.len
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.nodes.len == 0
    }

    /// How many watches `conn` holds.
    pub fn of_conn(&self, conn: ConnId) -> usize {
        self.by_conn.get(conn as usize).map_or(0, Vec::len)
    }

    /// The watches `conn` holds (ids).
    pub fn conn_list(&self, conn: ConnId) -> &[u32] {
        self.by_conn.get(conn as usize).map_or(&[], Vec::as_slice)
    }

    fn bucket(&self, key: &str) -> usize {
        self.hasher.hash_one(key) as usize & (self.buckets.len().wrapping_sub(1))
    }

    /// The record of `key`'s watches still waiting on its token, if any.
    pub fn find(&self, key: &str) -> Option<u32> {
        if self.buckets.is_empty() {
            return None;
        }
        let mut slot = self.buckets[self.bucket(key)];
        while slot != NIL {
            let record = &self.keys[slot as usize];
            if *record.key == *key {
                return Some(slot);
            }
            slot = record.next_same_hash;
        }
        None
    }

    pub fn key(&self, slot: u32) -> &KeyWatches {
        &self.keys[slot as usize]
    }

    /// The records in the index (every watched key's, detached ones aside).
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.keys
            .iter()
            .filter(|(_, record)| record.next_same_hash != DETACHED)
            .map(|(slot, _)| slot as u32)
    }

    /// Whether `slot` names a record in the index (a wake may have
    /// detached or removed it).
    pub fn key_is_live(&self, slot: u32) -> bool {
        self.keys
            .get(slot as usize)
            .is_some_and(|record| record.next_same_hash != DETACHED)
    }

    /// Whether `slot` still names a record, in the index or detached.
    pub fn key_exists(&self, slot: u32) -> bool {
        self.keys.contains(slot as usize)
    }

    /// The first watch of the record `slot` of `generation`, if that
    /// record is still there and has any left.
    pub fn first_of(&self, slot: u32, generation: u32) -> Option<u32> {
        self.keys
            .get(slot as usize)
            .filter(|record| record.generation == generation)
            .map(|record| record.head)
            .filter(|&head| head != NIL)
    }

    /// How many watches the record `slot` holds.
    pub fn count_of(&self, slot: u32) -> usize {
        self.keys
            .get(slot as usize)
            .map_or(0, |record| record.count as usize)
    }

    pub fn get(&self, watch: u32) -> &Watch {
        &self.nodes[watch as usize]
    }

    pub fn get_mut(&mut self, watch: u32) -> &mut Watch {
        &mut self.nodes[watch as usize]
    }

    /// Holds a watch of `conn` with `id` on `key`, whose current token is
    /// `since`, and returns its id (unarmed: the caller arms its timer).
    pub fn insert(&mut self, conn: ConnId, id: u64, key: &str, since: u64) -> u32 {
        let slot = match self.find(key) {
            Some(slot) => slot,
            None => self.insert_record(key, since),
        };
        let conn_index = conn as usize;
        if self.by_conn.len() <= conn_index {
            self.by_conn.resize_with(conn_index + 1, Vec::new);
        }
        let record = &self.keys[slot as usize];
        let at_conn = self.by_conn[conn_index].len() as u32;
        let next = record.head;
        let watch = self.nodes.insert(Watch {
            conn,
            at_conn,
            key: slot,
            key_prev: NIL,
            key_next: next,
            timer: TimerLinks::UNARMED,
            id,
        });
        if next != NIL {
            self.nodes[next as usize].key_prev = watch;
        }
        let record = &mut self.keys[slot as usize];
        record.head = watch;
        record.count += 1;
        self.by_conn[conn_index].push(watch);
        watch
    }

    fn insert_record(&mut self, key: &str, since: u64) -> u32 {
        if self.attached >= self.buckets.len() {
            self.rehash((self.buckets.len() * 2).max(16));
        }
        self.attached += 1;
        let bucket = self.bucket(key);
        let next = self.buckets[bucket];
        let generation = self.next_generation;
        self.next_generation = generation.wrapping_add(1);
        let slot = self.keys.insert(KeyWatches {
            key: key.into(),
            since,
            head: NIL,
            count: 0,
            generation,
            next_same_hash: next,
        }) as u32;
        self.buckets[bucket] = slot;
        slot
    }

    /// Rebuilds the index with `size` buckets.
    fn rehash(&mut self, size: usize) {
        self.buckets = vec![NIL; size];
        let mask = size - 1;
        for (slot, record) in &mut self.keys {
            if record.next_same_hash == DETACHED {
                continue;
            }
            let bucket = self.hasher.hash_one(&*record.key) as usize & mask;
            record.next_same_hash = self.buckets[bucket];
            self.buckets[bucket] = slot as u32;
        }
    }

    /// Takes the record `slot` out of the index: a new `O` on its key
    /// starts a new record, while its watches are answered.
    pub fn detach(&mut self, slot: u32) {
        let record = &self.keys[slot as usize];
        if record.next_same_hash == DETACHED {
            return;
        }
        let (bucket, next) = (self.bucket(&record.key), record.next_same_hash);
        let first = self.buckets[bucket];
        if first == slot {
            self.buckets[bucket] = next;
        } else {
            let mut at = first;
            while at != NIL {
                let following = self.keys[at as usize].next_same_hash;
                if following == slot {
                    self.keys[at as usize].next_same_hash = next;
                    break;
                }
                at = following;
            }
        }
        self.keys[slot as usize].next_same_hash = DETACHED;
        self.attached -= 1;
        if self.attached == 0 && self.buckets.len() > 64 {
            self.buckets = Vec::new();
        }
    }

    /// Removes a watch (its timer already cancelled) and returns it; its
    /// key's record goes with its last watch.
    pub fn remove(&mut self, watch: u32) -> Watch {
        let node = self.nodes.remove(watch);
        if node.key_prev != NIL {
            self.nodes[node.key_prev as usize].key_next = node.key_next;
        } else {
            self.keys[node.key as usize].head = node.key_next;
        }
        if node.key_next != NIL {
            self.nodes[node.key_next as usize].key_prev = node.key_prev;
        }
        let record = &mut self.keys[node.key as usize];
        record.count -= 1;
        if record.count == 0 {
            self.detach(node.key);
            self.keys.remove(node.key as usize);
        }
        let list = &mut self.by_conn[node.conn as usize];
        list.swap_remove(node.at_conn as usize);
        if let Some(&moved) = list.get(node.at_conn as usize) {
            self.nodes[moved as usize].at_conn = node.at_conn;
        }
        if list.is_empty() && list.capacity() > 16 {
            *list = Vec::new();
        }
        if self.nodes.len == 0 && self.nodes.all.capacity() > 1024 {
            // The vectors keep their largest size otherwise: return what a
            // burst of watches took once they are all gone.
            self.nodes = Nodes::default();
            self.keys = slab::Slab::new();
        }
        node
    }

    /// Checks the indexes against each other (for the core's invariants).
    pub fn check(&self) {
        let mut by_keys = 0;
        for (slot, record) in &self.keys {
            assert!(record.count > 0, "empty watch record");
            if record.next_same_hash != DETACHED {
                assert_eq!(self.find(&record.key), Some(slot as u32));
            }
            let mut at = record.head;
            let mut prev = NIL;
            let mut count = 0;
            while at != NIL {
                let node = &self.nodes[at as usize];
                assert_eq!(node.key as usize, slot);
                assert_eq!(node.key_prev, prev);
                assert!(node.timer.is_armed(), "watch {at} not armed");
                prev = at;
                at = node.key_next;
                count += 1;
            }
            assert_eq!(count, record.count, "watch list of {:?}", record.key);
            by_keys += count as usize;
        }
        let mut chained = 0;
        for &first in &self.buckets {
            let mut at = first;
            while at != NIL {
                chained += 1;
                at = self.keys[at as usize].next_same_hash;
            }
        }
        assert_eq!(chained, self.slots().count());
        assert_eq!(chained, self.attached);
        assert_eq!(by_keys, self.nodes.len);
        let mut by_conns = 0;
        for (conn, list) in self.by_conn.iter().enumerate() {
            for (at, &watch) in list.iter().enumerate() {
                let node = &self.nodes[watch as usize];
                assert_eq!(node.conn as usize, conn);
                assert_eq!(node.at_conn as usize, at);
            }
            by_conns += list.len();
        }
        assert_eq!(by_conns, self.nodes.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_node_is_at_most_40_bytes() {
        assert!(size_of::<Watch>() <= 40, "{}", size_of::<Watch>());
        assert!(size_of::<KeyWatches>() <= 40, "{}", size_of::<KeyWatches>());
    }

    /// Two keys in the same bucket of a 16-bucket index.
    fn colliding_keys(watches: &Watches) -> (String, String) {
        let bucket = |key: &str| watches.hasher.hash_one(key) as usize & 15;
        let first = "k0".to_owned();
        let second = (1..)
            .map(|i| format!("k{i}"))
            .find(|key| bucket(key) == bucket(&first))
            .unwrap_or_default();
        (first, second)
    }

    #[test]
    fn records_sharing_a_hash_chain_and_detach() {
        let mut watches = Watches::default();
        let (a, b) = colliding_keys(&watches);
        let first_a = watches.insert(1, 10, &a, 5);
        let first_b = watches.insert(2, 11, &b, 6);
        let second_a = watches.insert(2, 12, &a, 5);
        let slot_a = watches.find(&a).unwrap();
        let slot_b = watches.find(&b).unwrap();
        assert_ne!(slot_a, slot_b);
        assert_eq!(watches.buckets.len(), 16);
        assert_eq!(watches.attached, 2);
        assert_eq!(watches.count_of(slot_a), 2);
        watches.detach(slot_a);
        assert_eq!(watches.find(&a), None);
        assert_eq!(watches.find(&b), Some(slot_b));
        assert!(watches.key_exists(slot_a) && !watches.key_is_live(slot_a));
        // A new watch of `a` starts a new record beside the detached one.
        let third_a = watches.insert(3, 13, &a, 7);
        let new_a = watches.find(&a).unwrap();
        assert_ne!(new_a, slot_a);
        let generation = watches.key(new_a).generation;
        assert_eq!(watches.first_of(new_a, generation), Some(third_a));
        assert_eq!(watches.first_of(new_a, generation.wrapping_add(1)), None);
        for watch in [first_a, second_a, first_b, third_a] {
            watches.remove(watch);
            // Timers are not armed here: check only the counts.
        }
        assert!(watches.is_empty());
        assert_eq!(watches.attached, 0);
        assert!(!watches.key_exists(slot_a));
    }
}
