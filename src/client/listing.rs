//! Who holds a key and which keys exist (spec §11): the answers of `H`
//! and `L` as the client hands them over, and the iterator that follows
//! `L`'s cursor.

use std::collections::VecDeque;
use std::time::Duration;

use super::{Client, Error};

/// Most grants, or waiters, one `H` answer lists (spec §11.2); a server
/// that sends more is broken, and its session is closed.
pub(crate) const HOLDERS_MAX: usize = 1000;

/// The grants and the queue of one key, as [`Client::holders`] found them.
///
/// A snapshot: out of date as soon as it arrives. Never use it as a lock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holders {
    /// The key's grants, in token order (the oldest grant first).
    pub grants: Vec<Grant>,
    /// The key's waiters, in queue order (the next to be served first).
    pub waiters: Vec<Waiter>,
    /// How many grants and waiters the server left out of its answer
    /// (it lists at most 1,000 of each); normally 0.
    pub left_out: u64,
}

impl Holders {
    /// Whether the key has no grant and no waiter (it is not in the table).
    pub fn is_free(&self) -> bool {
        self.grants.is_empty() && self.waiters.is_empty() && self.left_out == 0
    }
}

/// One grant of a key (a `G` frame).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The grant's fencing token. 0 is the unknown grant that holds every
    /// key until the horizon after an unclean restart (spec §7.2).
    pub token: u64,
    /// The owner id of the request that was granted (0 for a grant
    /// adopted after a restart).
    pub owner: u64,
    /// The permits it holds; 0 means all of them (exclusive).
    pub take: u16,
    /// The time left on its lease (the server rounds it up to a ms).
    pub lease_left: Duration,
    /// How long it has been held (rounded down to a ms).
    pub held_for: Duration,
    /// What its acquire said about who asks (empty when nothing).
    pub label: String,
}

/// One waiter of a key (a `W` frame).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiter {
    /// The owner id of the queued request.
    pub owner: u64,
    /// The permits it asks for; 0 means all of them (exclusive).
    pub take: u16,
    /// The time left until its wait runs out (rounded up to a ms).
    pub wait_left: Duration,
    /// What its acquire said about who asks (empty when nothing).
    pub label: String,
}

/// One key of the server's table (a `K` frame).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySummary {
    pub key: String,
    /// How many grants hold it.
    pub grants: u32,
    /// How many requests wait for it.
    pub waiters: u32,
    /// Its limit of permits; 0 when no request named one.
    pub limit: u16,
}

/// One page of [`Client::list_keys`]: the keys, and the cursor to go on
/// with (0 when the listing is complete).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyPage {
    pub keys: Vec<KeySummary>,
    pub next: u64,
}

/// The keys that start with a prefix, page by page: what
/// [`Client::keys`] returns.
///
/// Each page is one `L` request (up to 1,000 keys) with its own deadline
/// of 5 s; the next page is asked for only when the current one is used
/// up. Every key that is in the table for the whole listing comes at least
/// once; a key may come twice when the table grew in between (spec §11.3).
/// After an error the iterator yields that error once and then ends.
#[derive(Debug)]
pub struct Keys {
    client: Client,
    prefix: String,
    cursor: u64,
    page: VecDeque<KeySummary>,
    /// No page is left to ask for (the last `next` was 0, or an error).
    done: bool,
}

impl Keys {
    pub(crate) fn new(client: Client, prefix: String) -> Keys {
        Keys {
            client,
            prefix,
            cursor: 0,
            page: VecDeque::new(),
            done: false,
        }
    }
}

impl Iterator for Keys {
    type Item = Result<KeySummary, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(key) = self.page.pop_front() {
                return Some(Ok(key));
            }
            if self.done {
                return None;
            }
            match self
                .client
                .list_keys(&self.prefix, self.cursor, crate::protocol::LIST_COUNT_MAX)
            {
                Ok(page) => {
                    self.cursor = page.next;
                    self.done = page.next == 0;
                    self.page.extend(page.keys);
                }
                Err(error) => {
                    self.done = true;
                    return Some(Err(error));
                }
            }
        }
    }
}
