//! The core's self-check, run by tests and simulations after every step.

use std::collections::{HashMap, HashSet};

use super::Core;
use super::labels::LabelOf;
use super::memory::NIL;
use super::permits::PERMITS;

impl Core {
    /// Asserts the consistency of every internal structure: each key found
    /// by its own name and leased, each queue and connection list linked and
    /// counted right, every waiter armed and on an open connection, every
    /// armed timer accounted for; on keys with a limit, the grants in token
    /// order within the limit and the scan finished (a head waiter that
    /// fitted would have been granted). A bug then fails here rather than
    /// in a later, unrelated answer; simulations call it after every step.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        self.check_watches();
        let mut entries = 0;
        let mut unknown = 0;
        let mut queued = 0;
        let mut inline_grants = 0;
        let mut leased_entries = 0;
        let mut permit_keys = 0;
        let mut listed_grants = 0;
        for entry in self.table.live_indices() {
            entries += 1;
            let held = self.table.get(entry);
            let key = self.table.key(entry);
            assert_eq!(
                self.table.find(key, self.table.hash(key)),
                Some(entry),
                "key {key:?} not found by name"
            );
            let permits = (held.token == PERMITS).then(|| {
                permit_keys += 1;
                self.permit_key(entry)
            });
            if let Some(permits) = permits {
                listed_grants += permits.grants.len();
                assert_eq!(
                    held.lease.is_armed(),
                    permits.unknown,
                    "key {key:?}: entry lease armed iff the unknown grant holds it"
                );
                if permits.unknown {
                    unknown += 1;
                    leased_entries += 1;
                    assert_eq!(
                        self.wheel.deadline_of(&{ held.lease }),
                        self.leases.grace_tick,
                        "key {key:?}: the unknown grant's timer is not at the horizon"
                    );
                    // Only adopted grants (spec §7.4) beside the unknown one.
                    assert!(
                        permits.grants.iter().all(|&grant| {
                            let node = self.grants.get(grant);
                            node.token < self.first_token && node.take == 0 && node.owner == 0
                        }),
                        "key {key:?}: unknown and granted by this run"
                    );
                    assert!(
                        !held.waiters.is_empty() || !permits.grants.is_empty(),
                        "key {key:?}: unknown, nobody waits or holds"
                    );
                } else {
                    assert!(!permits.grants.is_empty(), "key {key:?}: limit, no grant");
                }
                let (mut used, mut exclusive, mut last) = (0u32, 0u32, 0);
                for &grant in &permits.grants {
                    let node = self.grants.get(grant);
                    assert_eq!(
                        node.entry, entry,
                        "grant {grant} of {key:?} points elsewhere"
                    );
                    assert!(
                        node.lease.is_armed(),
                        "grant {grant} of {key:?} has no lease"
                    );
                    assert!(
                        node.token > last && node.token < self.next_token,
                        "grants of {key:?} out of token order"
                    );
                    last = node.token;
                    used += u32::from(node.take);
                    exclusive += u32::from(node.take == 0);
                }
                assert_eq!(used, u32::from(permits.used), "permits used on {key:?}");
                assert!(used <= u32::from(permits.limit), "{key:?} over its limit");
                assert_eq!(exclusive, permits.exclusive, "exclusive count of {key:?}");
                // Several exclusive grants only as an earlier run's
                // (adopted, spec §7.4, or restored from them).
                let earlier = permits.grants.iter().all(|&grant| {
                    let node = self.grants.get(grant);
                    node.token < self.first_token && node.take == 0
                });
                assert!(
                    exclusive == 0 || permits.grants.len() == 1 || earlier,
                    "{key:?}: an exclusive grant with others"
                );
                if permits.handing {
                    assert!(
                        self.handing.contains(&entry),
                        "{key:?}: handing on, but not in the queue of hand-overs"
                    );
                } else if let Some(head) = held.waiters.head() {
                    let head = self.waiters.get(head);
                    assert!(
                        !permits.fits(head.take),
                        "{key:?}: the head waiter fits but was not granted"
                    );
                }
            } else if held.token == 0 {
                assert!(held.lease.is_armed(), "key {key:?} has no lease timer");
                leased_entries += 1;
                unknown += 1;
                assert_eq!(
                    self.wheel.deadline_of(&{ held.lease }),
                    self.leases.grace_tick,
                    "key {key:?}: the unknown grant's timer is not at the horizon"
                );
                assert!(
                    !held.waiters.is_empty(),
                    "key {key:?} held by an unknown grant and waited on by nobody"
                );
            } else {
                assert!(held.lease.is_armed(), "key {key:?} has no lease timer");
                leased_entries += 1;
                inline_grants += 1;
                assert!(
                    held.token < self.next_token,
                    "key {key:?} has token {} ≥ next {}",
                    { held.token },
                    self.next_token
                );
            }
            let mut length = 0;
            for waiter in self.waiters.queue(held.waiters) {
                length += 1;
                let node = self.waiters.get(waiter);
                assert_eq!(
                    node.lock, entry,
                    "waiter {waiter} of key {key:?} points elsewhere"
                );
                assert!(
                    node.timer.is_armed(),
                    "waiter {waiter} of key {key:?} has no deadline timer"
                );
                assert!(
                    self.conns[node.conn as usize].open,
                    "waiter {waiter} on a closed connection"
                );
                match permits {
                    Some(permits) => assert!(
                        node.take <= permits.limit,
                        "waiter {waiter} of {key:?} takes more than the limit"
                    ),
                    None => assert_eq!(node.take, 0, "counted waiter on {key:?} without limit"),
                }
            }
            assert_eq!(
                length,
                self.waiters.queue_len(held.waiters),
                "queue length of key {key:?}"
            );
            queued += length as usize;
        }
        assert_eq!(entries, self.table.len(), "live entries vs table length");
        assert_eq!(unknown, self.unknown_holders, "unknown holders");
        assert_eq!(queued, self.waiters.len(), "queued waiters vs waiter count");
        assert_eq!(permit_keys, self.permit_keys.len(), "permit keys");
        assert_eq!(listed_grants, self.grants.len(), "grants of permit keys");
        assert_eq!(
            inline_grants + listed_grants,
            self.grants_held,
            "grants held"
        );
        assert!(
            self.labels.len() <= self.grants_held + queued,
            "labels of nothing"
        );
        let mut charged = 0;
        for (entry, identity) in self.quotas.charged_entries() {
            charged += 1;
            assert!(
                self.table.is_live(entry),
                "key quota of identity {identity} charged for a dead entry {entry}"
            );
        }
        assert_eq!(
            charged,
            self.quotas.keys_total(),
            "per-identity key charges vs charged entries"
        );
        assert!(self.quotas.current.is_none(), "a request's charge left set");
        assert_eq!(
            self.grant_cap, self.limits.max_grants,
            "a request's grant quota left set"
        );
        self.check_grant_charges();
        // Nothing passes the limits but what a clean stop restored (spec
        // §7.1): adoption is charged like a grant (spec §7.3 v5).
        assert!(
            self.table.len() <= self.limits.max_keys.max(self.restored.0),
            "{} keys, limit {}, {} restored",
            self.table.len(),
            self.limits.max_keys,
            self.restored.0
        );
        assert!(
            self.grants_held + self.waiters.len() <= self.limits.max_grants.max(self.restored.1),
            "{} grants and {} waiters, limit {}, {} restored",
            self.grants_held,
            self.waiters.len(),
            self.limits.max_grants,
            self.restored.1
        );
        let mut open = 0;
        let mut listed = 0;
        for (conn, state) in self.conns.iter().enumerate() {
            open += usize::from(state.open);
            let mut length = 0;
            let mut waiter = state.waiters.head;
            while waiter != NIL {
                length += 1;
                assert_eq!(
                    self.waiters.get(waiter).conn as usize,
                    conn,
                    "waiter {waiter} on the wrong connection list"
                );
                assert!(
                    length <= self.waiters.len(),
                    "connection {conn}'s waiter list loops"
                );
                waiter = self.waiters.next_of_conn(waiter);
            }
            assert_eq!(
                length as u32, state.waiters.len,
                "waiter count of connection {conn}"
            );
            assert!(
                state.open || length == 0,
                "closed connection {conn} still has waiters"
            );
            listed += length;
        }
        assert_eq!(open, self.connections, "open connections");
        assert_eq!(listed, self.waiters.len(), "waiters on connection lists");
        assert_eq!(
            self.wheel.len(),
            leased_entries + listed_grants + queued,
            "armed timers vs leases, grants and waiters"
        );
        assert_eq!(
            self.watch_wheel.len(),
            self.watches.len(),
            "armed watch timers vs watches"
        );
        assert_eq!(
            self.leases.len(),
            leased_entries + listed_grants,
            "lease timers counted by deadline vs leases and grants"
        );
    }

    /// `max-grants=` (issue 27): every charge is of a live grant or
    /// waiter, each identity's count is the number of its charges and
    /// within its quota.
    fn check_grant_charges(&self) {
        if self.quotas.no_grant_charged() {
            for (identity, count, _) in self.quotas.grant_counts() {
                assert_eq!(count, 0, "identity {identity} charged for nothing");
            }
            return;
        }
        let mut live = HashSet::new();
        for entry in self.table.live_indices() {
            let held = self.table.get(entry);
            if held.token == PERMITS {
                let grants = self.permit_key(entry).grants.iter();
                live.extend(grants.map(|&grant| LabelOf::Grant(grant).id()));
            } else if held.token != 0 {
                live.insert(LabelOf::Entry(entry).id());
            }
            let waiters = self.waiters.queue(held.waiters);
            live.extend(waiters.map(|waiter| LabelOf::Waiter(waiter).id()));
        }
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for (of, identity) in self.quotas.charged_grants() {
            assert!(
                live.contains(&of),
                "grant quota of identity {identity} charged for {of:#x}, which is gone"
            );
            *counts.entry(identity).or_default() += 1;
        }
        for (identity, count, max) in self.quotas.grant_counts() {
            assert_eq!(
                count,
                counts.get(&identity).copied().unwrap_or(0),
                "grant charges of identity {identity}"
            );
            assert!(
                count <= max,
                "identity {identity} holds {count} grants and waiters, over max-grants={max}"
            );
        }
    }

    /// Watches: indexed consistently, each on an open connection, each
    /// key's record waiting on the key's current token (a change that
    /// answered nobody would show here), within their limits.
    fn check_watches(&self) {
        self.watches.check();
        let mut by_conn = 0;
        for (conn, state) in self.conns.iter().enumerate() {
            let watches = self.watches.of_conn(conn as super::ConnId);
            if watches > 0 {
                assert!(state.open, "watches on closed connection {conn}");
            }
            assert!(
                state.waiters.len <= self.limits.max_waits_per_conn,
                "connection {conn} over --max-waits-per-conn"
            );
            assert!(
                watches <= self.limits.max_watches_per_conn as usize,
                "connection {conn} over --max-watches-per-conn"
            );
            by_conn += watches;
        }
        assert_eq!(by_conn, self.watches.len());
        assert!(self.waiters.len() <= self.limits.max_waiters);
        assert!(self.watches.len() <= self.limits.max_watches);
        let (charged, charged_watches) = self.quotas.watch_totals();
        assert_eq!(charged, charged_watches as u64, "watch charges");
        assert!(charged_watches <= self.watches.len());
        let now = self.grace_until; // the state's token does not depend on it
        for slot in self.watches.slots() {
            let record = self.watches.key(slot);
            let token = self.key_state(&record.key, now).token;
            assert_eq!(
                token, record.since,
                "watches of {:?} wait on {} but the token is {token}",
                record.key, record.since
            );
        }
    }
}
