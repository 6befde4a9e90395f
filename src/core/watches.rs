//! Held observe requests (`O`, spec §13): one node per watch, found three
//! ways — by its key (to answer every watch of a key when its token
//! changes), by its connection (to drop them when it closes) and by its
//! timer id (its deadline, in the core's wheel). Watches live outside the
//! lock table: a watch never adds a key there or keeps one.
//!
//! Every watch of one key waits on the same token (a watch is held only
//! while `since` equals the key's current token, and all of them are
//! answered as soon as it changes), so the key's record keeps it once.

use std::collections::HashMap;

use crate::core::ConnId;
use crate::timer_wheel::TimerLinks;

/// One held `O`.
#[derive(Debug)]
pub struct Watch {
    pub conn: ConnId,
    /// The request's `id`, echoed in its `V`.
    pub id: u64,
    /// Its key's record in [`Watches::keys`].
    pub key: u32,
    /// Where it sits in its key's list and in its connection's list.
    at_key: u32,
    at_conn: u32,
    pub timer: TimerLinks,
}

/// The watches of one key.
#[derive(Debug)]
pub struct KeyWatches {
    pub key: Box<str>,
    /// The token every watch of this key waits to change.
    pub since: u64,
    pub watches: Vec<u32>,
}

/// Every held watch.
#[derive(Debug, Default)]
pub struct Watches {
    nodes: slab::Slab<Watch>,
    keys: slab::Slab<KeyWatches>,
    by_key: HashMap<Box<str>, u32, foldhash::fast::RandomState>,
    /// The watches of each connection, by connection id.
    by_conn: Vec<Vec<u32>>,
}

impl Watches {
    /// How many watches are held.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// How many watches `conn` holds.
    pub fn of_conn(&self, conn: ConnId) -> usize {
        self.by_conn.get(conn as usize).map_or(0, Vec::len)
    }

    /// The watches `conn` holds (ids).
    pub fn conn_list(&self, conn: ConnId) -> &[u32] {
        self.by_conn.get(conn as usize).map_or(&[], Vec::as_slice)
    }

    /// The record of `key`'s watches, if it has any.
    pub fn find(&self, key: &str) -> Option<u32> {
        self.by_key.get(key).copied()
    }

    pub fn key(&self, slot: u32) -> &KeyWatches {
        &self.keys[slot as usize]
    }

    /// The records of every watched key.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.keys.iter().map(|(slot, _)| slot as u32)
    }

    /// Whether `slot` still names a record (a wake may have removed it).
    pub fn key_is_live(&self, slot: u32) -> bool {
        self.keys.contains(slot as usize)
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
        let slot = match self.by_key.get(key) {
            Some(&slot) => slot,
            None => {
                let slot = self.keys.insert(KeyWatches {
                    key: key.into(),
                    since,
                    watches: Vec::new(),
                }) as u32;
                self.by_key.insert(key.into(), slot);
                slot
            }
        };
        let conn_index = conn as usize;
        if self.by_conn.len() <= conn_index {
            self.by_conn.resize_with(conn_index + 1, Vec::new);
        }
        let at_key = self.keys[slot as usize].watches.len() as u32;
        let at_conn = self.by_conn[conn_index].len() as u32;
        let watch = self.nodes.insert(Watch {
            conn,
            id,
            key: slot,
            at_key,
            at_conn,
            timer: TimerLinks::UNARMED,
        }) as u32;
        self.keys[slot as usize].watches.push(watch);
        self.by_conn[conn_index].push(watch);
        watch
    }

    /// Removes a watch (its timer already cancelled) and returns it; its
    /// key's record goes with its last watch.
    pub fn remove(&mut self, watch: u32) -> Watch {
        let node = self.nodes.remove(watch as usize);
        let record = &mut self.keys[node.key as usize];
        record.watches.swap_remove(node.at_key as usize);
        if let Some(&moved) = record.watches.get(node.at_key as usize) {
            self.nodes[moved as usize].at_key = node.at_key;
        }
        if record.watches.is_empty() {
            let record = self.keys.remove(node.key as usize);
            self.by_key.remove(&record.key);
        }
        let list = &mut self.by_conn[node.conn as usize];
        list.swap_remove(node.at_conn as usize);
        if let Some(&moved) = list.get(node.at_conn as usize) {
            self.nodes[moved as usize].at_conn = node.at_conn;
        }
        if list.is_empty() && list.capacity() > 16 {
            *list = Vec::new();
        }
        node
    }

    /// Checks the three indexes against each other (for the core's
    /// invariants).
    pub fn check(&self) {
        let mut by_keys = 0;
        for (slot, record) in &self.keys {
            assert!(!record.watches.is_empty(), "empty watch record");
            assert_eq!(self.by_key.get(&record.key), Some(&(slot as u32)));
            for (at, &watch) in record.watches.iter().enumerate() {
                let node = &self.nodes[watch as usize];
                assert_eq!(node.key as usize, slot);
                assert_eq!(node.at_key as usize, at);
                assert!(node.timer.is_armed(), "watch {watch} not armed");
            }
            by_keys += record.watches.len();
        }
        assert_eq!(self.by_key.len(), self.keys.len());
        assert_eq!(by_keys, self.nodes.len());
        let mut by_conns = 0;
        for (conn, list) in self.by_conn.iter().enumerate() {
            for (at, &watch) in list.iter().enumerate() {
                let node = &self.nodes[watch as usize];
                assert_eq!(node.conn as usize, conn);
                assert_eq!(node.at_conn as usize, at);
            }
            by_conns += list.len();
        }
        assert_eq!(by_conns, self.nodes.len());
    }
}
