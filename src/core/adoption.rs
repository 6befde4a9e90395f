//! Restarts (spec §7): grants of an earlier run restored at a clean stop,
//! the grace after an unclean one (every key counts as held by an unknown
//! grant until the lease horizon), and adoption of an earlier run's token
//! by `E`/`R` during it (§7.3). Everything the core decides about an
//! earlier run lives here; the state file itself is `server::state`'s.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use super::labels::{self, LabelOf};
use super::permits::PERMITS;
use super::token_binding::{self, MAC_AHEAD_MAX, TokenBinding};
use super::waiters;
use super::{ConnId, Core, Micros, TimerNodes};
use crate::protocol::Response;
use crate::timer_wheel::{MICROS_PER_TICK, tick_at_or_after};

/// Refused adoption tries one adopter may make in one grace (spec §7.3
/// v5); after them its tries are refused without being checked.
pub const REFUSED_TRIES_MAX: u8 = 16;

/// Whose tries at adoption count together (spec §7.3 v5): the identity a
/// session authenticated as; without `--auth` the peer's address; every
/// Unix-socket peer (and a connection the core was told nothing of) is
/// one adopter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Adopter {
    #[default]
    Local,
    Peer(IpAddr),
    Identity(u32),
}

/// What adoption is checked against, and the tries it refused.
#[derive(Default)]
pub(super) struct Adoption {
    /// The secret an earlier run bound its tokens with (the state
    /// directory's): `None` adopts nothing.
    verify_with: Option<TokenBinding>,
    /// No earlier token above it is adopted: the last token the previous
    /// runs may have bound (0: none).
    until: u64,
    /// This run's tokens below it may be bound: `u64::MAX` while it binds
    /// them, the first token it stopped at, 0 when it never did.
    bound_below: u64,
    /// Refused tries per adopter during the grace; emptied after it. At
    /// most `--max-connections` adopters; those beyond share `overflow`.
    refused: HashMap<Adopter, u8, foldhash::fast::RandomState>,
    overflow: u8,
}

/// A grant held now (see [`Core::grants`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldGrant<'a> {
    pub key: &'a str,
    pub token: u64,
    pub owner: u64,
    /// When the lease runs out.
    pub deadline: Micros,
    /// Permits it holds; 0 = all (exclusive).
    pub take: u16,
    /// Its key's limit; 0 = none.
    pub limit: u16,
    /// Its label (spec §11.1), often empty.
    pub label: &'a str,
    /// When it was granted, on this core's clock, to the ms (spec §7.5:
    /// `held_ms` counts from the original grant). It wraps: a grant
    /// restored from an earlier run was granted before instant 0, so the
    /// time held at `now` is `now.wrapping_sub(granted_at)`.
    pub granted_at: Micros,
}

/// A grant of an earlier run to restore (see [`Core::restore_grant`]): the
/// same fields as a grant held now, its deadline on this run's clock.
pub type EarlierGrant<'a> = HeldGrant<'a>;

/// Why [`Core::restore_grant`] refused a grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreError {
    /// Token 0, or not below this run's first token.
    TokenNotFromEarlierRun,
    /// The key was restored already (a key without a limit), or with a
    /// different limit, or the token was listed already or out of order.
    DuplicateKey,
    /// The grant does not fit its key beside the ones restored before it
    /// (spec §10.3), or takes permits of a key without a limit.
    DoesNotFit,
    /// The table cannot grow.
    TableFull,
}

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RestoreError::TokenNotFromEarlierRun => "token is 0 or not below this run's first",
            RestoreError::DuplicateKey => {
                "key listed twice, with two limits, or its tokens out of order"
            }
            RestoreError::DoesNotFit => "its permits do not fit the key's limit",
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
    /// Binds this run's tokens to their keys with `binding` (spec §7.3
    /// v5: a state directory's secret), which also checks the earlier
    /// runs' tokens at adoption. Call before any request. Tokens then
    /// start at a multiple of 2^16 and go 2^16 per grant, unless the
    /// first token runs more than [`MAC_AHEAD_MAX`] above the clock's
    /// first token `clock_token` (`unix_time_ms × 2^20`): then they go
    /// +1 without a MAC, so that §7.6's implausible mark (2^52 ahead) is
    /// never reached (see [`watch_token_clock`](Self::watch_token_clock)).
    pub fn bind_tokens(&mut self, binding: TokenBinding, clock_token: u64) {
        debug_assert!(self.wheel.elapsed() == 0 && self.next_token == self.first_token);
        self.adoption.verify_with = Some(binding);
        self.issue_with = None;
        self.token_end = u64::MAX;
        self.adoption.bound_below = 0;
        let first = token_binding::step_at_or_above(self.first_token);
        if first.saturating_sub(clock_token) > MAC_AHEAD_MAX || first > u64::MAX >> 1 {
            return;
        }
        self.first_token = first;
        self.next_token = first;
        self.issue_with = Some(binding);
        self.token_end = u64::MAX - (token_binding::STEP - 1);
        self.adoption.bound_below = u64::MAX;
    }

    /// The clock's first token is `clock_token` now: once the next token
    /// runs more than [`MAC_AHEAD_MAX`] above it (more than ~16,000
    /// grants a second for a long time), this run stops binding tokens
    /// and issues them +1 apart; the state file records where (tokens
    /// from there on adopt nothing after a crash). Returns whether it
    /// stopped now.
    pub fn watch_token_clock(&mut self, clock_token: u64) -> bool {
        if self.issue_with.is_none() || self.next_token.saturating_sub(clock_token) <= MAC_AHEAD_MAX
        {
            return false;
        }
        self.issue_with = None;
        self.token_end = u64::MAX;
        self.adoption.bound_below = self.next_token;
        true
    }

    /// Whether this run binds its tokens to their keys.
    pub fn binds_tokens(&self) -> bool {
        self.issue_with.is_some()
    }

    /// No token above `until` is adopted: the last token the previous run
    /// may have bound to its key (its state file's `macs_until`; 0 adopts
    /// nothing, as after a file of format 1 to 4).
    pub fn set_adoptable_until(&mut self, until: u64) {
        self.adoption.until = until;
    }

    /// The last token that may carry a MAC, of this run or an earlier
    /// one, if the tokens below `token_high_water` were all issued: what
    /// the state file records for the next run's adoption (0: none).
    pub fn macs_until(&self, token_high_water: u64) -> u64 {
        let own = self
            .adoption
            .bound_below
            .min(token_high_water)
            .saturating_sub(1);
        let own = if own >= self.first_token { own } else { 0 };
        own.max(self.adoption.until)
    }

    /// Whose adoption tries `conn`'s count as (see [`Adopter`]).
    pub fn set_adopter(&mut self, conn: ConnId, adopter: Adopter) {
        if let Some(state) = self.conns.get_mut(conn as usize) {
            state.adopter = adopter;
        }
    }

    /// Whether `conn`'s `E`/`R` of `token`, an earlier run's on `key` held
    /// by the unknown grant, adopts it (spec §7.3 v5): at most
    /// [`REFUSED_TRIES_MAX`] refused tries per adopter per grace, then
    /// every try is refused unchecked; else the token must be one the
    /// previous run may have bound (at most its `macs_until`) and its MAC
    /// that of `key`. A refusal is counted.
    #[cold]
    #[inline(never)]
    fn adoption_passes(&mut self, conn: ConnId, key: &str, token: u64) -> bool {
        let adopter = self
            .conns
            .get(conn as usize)
            .map_or(Adopter::Local, |state| state.adopter);
        let adoption = &mut self.adoption;
        let counted = adoption.refused.get(&adopter).copied();
        let full =
            counted.is_none() && adoption.refused.len() >= self.limits.max_connections.max(1);
        let count = counted.unwrap_or(if full { adoption.overflow } else { 0 });
        if count >= REFUSED_TRIES_MAX {
            return false;
        }
        let passes = token < self.first_token
            && token <= adoption.until
            && adoption
                .verify_with
                .as_ref()
                .is_some_and(|binding| binding.verify(key.as_bytes(), token));
        if !passes {
            if full {
                adoption.overflow += 1;
            } else {
                *adoption.refused.entry(adopter).or_insert(0) += 1;
            }
        }
        passes
    }

    /// Treat every key as held by an unknown grant until `until` (spec §7).
    pub fn set_grace_until(&mut self, until: Micros) {
        self.grace_until = until;
        self.leases.grace_tick = tick_at_or_after(until);
    }

    /// The grace's unknown grants may include counted grants (spec §7.4:
    /// the earlier run recorded that it made one). Then no adoption frees
    /// a key before the horizon: an earlier run's `E` during the grace
    /// adds its token as an adopted grant beside the unknown grant, which
    /// holds the key until the horizon; after it each adopted grant holds
    /// the key as if exclusive until it is released or expires.
    pub fn set_grace_counted(&mut self, counted: bool) {
        self.grace_counted = counted;
        if counted && self.grace_until > 0 {
            self.hold_restored_adopted_keys();
        }
    }

    /// A clean stop during such a grace saved its adopted grants as grants
    /// of owner 0 and take 0; other holders of their keys may not have
    /// adopted theirs yet. So a restored key whose grants all look like
    /// that stays held by the unknown grant until the horizon, as it was
    /// (spec §7.4). A genuine grant of owner 0 is held the same way: later
    /// than it could be, never too early. Call after restoring.
    fn hold_restored_adopted_keys(&mut self) {
        let entries: Vec<u32> = self.table.live_indices().collect();
        for entry in entries {
            let held = *self.table.get(entry);
            let adopted_shape = if held.token == PERMITS {
                let permits = self.permit_key(entry);
                !permits.unknown
                    && permits.grants.iter().all(|&grant| {
                        let node = self.grants.get(grant);
                        node.owner == 0 && node.take == 0
                    })
            } else {
                held.token != 0 && held.owner == 0
            };
            if !adopted_shape {
                continue;
            }
            if held.token != PERMITS {
                self.set_limit(entry, 0, 0);
            }
            self.permit_key_mut(entry).unknown = true;
            self.unknown_holders += 1;
            let mut nodes = TimerNodes {
                table: &mut self.table,
                waiters: &mut self.waiters,
                grants: &mut self.grants,
                leases: &mut self.leases,
            };
            self.wheel
                .arm(&mut nodes, entry, tick_at_or_after(self.grace_until));
        }
    }

    /// Whether a lease this core must account for (its own grants, restored
    /// or made, or the grace's unknown grants) may be a counted grant: what
    /// the state file must record before the answers that depend on it
    /// leave (spec §7.4). Once true it stays true for the run.
    pub fn counted_grants(&self) -> bool {
        self.grace_counted || self.counted_grants_made
    }

    /// Until when keys count as held by unknown grants (0 = never).
    pub fn grace_until(&self) -> Micros {
        self.grace_until
    }

    /// No lease this core granted runs past it: the latest lease deadline
    /// armed for a grant of this run — since the last
    /// [`settle_lease_deadline_max`](Self::settle_lease_deadline_max), or
    /// of the leases still running then.
    pub fn lease_deadline_max(&self) -> Micros {
        self.lease_deadline_max
    }

    /// Whether a lease timer left the wheel (a grant released, expired or
    /// renewed; the unknown grant's horizon reached) since the last
    /// [`settle_lease_deadline_max`](Self::settle_lease_deadline_max): then
    /// the leases still running may end earlier than
    /// [`lease_deadline_max`](Self::lease_deadline_max).
    pub fn leases_ended(&self) -> bool {
        self.leases.ended
    }

    /// Forgets the leases that ended: [`lease_deadline_max`](Self::lease_deadline_max)
    /// comes down to the latest deadline of a lease still armed (rounded up
    /// to [`restart::LEDGER_BUCKET`](super::restart::LEDGER_BUCKET); the
    /// unknown grants' horizon, [`grace_until`](Self::grace_until), is not
    /// a lease of this run), or 0 when none is. Call it after `handle_timeout`, which leaves no
    /// armed timer due.
    pub fn settle_lease_deadline_max(&mut self) {
        let live = self
            .leases
            .latest(self.wheel.elapsed(), self.unknown_holders);
        self.lease_deadline_max = self.lease_deadline_max.min(live);
        self.leases.ended = false;
    }

    /// The first token of this run; tokens below it are an earlier run's.
    pub fn first_token(&self) -> u64 {
        self.first_token
    }

    /// Restores a grant an earlier run held at a clean stop (spec §7.1,
    /// §7.4): its key, token (below this run's first token), owner, lease
    /// deadline, take, its key's limit and label. Call before any request,
    /// at time 0, with the grants of a key in token order. Restored keys
    /// count towards the key limit for new keys, but are restored even
    /// beyond it: every grant of the earlier run comes back.
    pub fn restore_grant(&mut self, grant: &EarlierGrant<'_>) -> Result<(), RestoreError> {
        // Before any request: nothing granted yet (connections may be open).
        debug_assert!(self.wheel.elapsed() == 0 && self.next_token == self.first_token);
        let EarlierGrant {
            key,
            token,
            owner,
            deadline,
            take,
            limit,
            label,
            granted_at,
        } = *grant;
        let held_ms = u32::try_from(0u64.wrapping_sub(granted_at) / 1_000).unwrap_or(u32::MAX);
        if token == 0 || token >= self.first_token {
            return Err(RestoreError::TokenNotFromEarlierRun);
        }
        if take != 0 && (limit == 0 || take > limit) {
            return Err(RestoreError::DoesNotFit);
        }
        let hash = self.table.hash(key);
        let found = self.table.find(key, hash);
        if limit == 0 {
            if let Some(entry) = found {
                // Several exclusive grants of owner 0 without a limit on
                // one key: adopted grants (spec §7.4) a clean stop
                // persisted. They come back as they were, each as if
                // exclusive.
                let held = self.table.get(entry);
                let last = if held.token == PERMITS {
                    let permits = self.permit_key(entry);
                    let last = permits.grants.back().map(|&g| self.grants.get(g).token);
                    (permits.limit == 0).then_some(last).flatten()
                } else {
                    Some(held.token)
                };
                if take != 0 || owner != 0 || last.is_none_or(|last| last >= token) {
                    return Err(RestoreError::DuplicateKey);
                }
                if self.table.get(entry).token != PERMITS {
                    self.set_limit(entry, 0, 0);
                }
                self.restore_permits(entry, grant);
                self.grants_held += 1;
                self.restored = (self.table.len(), self.grants_held);
                return Ok(());
            }
            let entry = self
                .table
                .insert(key, hash, token, owner)
                .ok_or(RestoreError::TableFull)?;
            self.labels.put(LabelOf::Entry(entry), labels::owned(label));
            let queue = &mut self.table.get_mut(entry).waiters;
            self.waiters
                .set_grant_time(queue, waiters::grant_time_before_start(held_ms));
            self.arm_lease_at(entry, deadline.max(1));
            self.grants_held += 1;
            self.restored = (self.table.len(), self.grants_held);
            return Ok(());
        }
        let entry = match found {
            Some(entry) => {
                if self.table.get(entry).token != PERMITS {
                    return Err(RestoreError::DuplicateKey);
                }
                let permits = self.permit_key(entry);
                let last = permits.grants.back().map(|&g| self.grants.get(g).token);
                if permits.limit != limit || last.is_some_and(|last| last >= token) {
                    return Err(RestoreError::DuplicateKey);
                }
                // Adopted grants (spec §7.4, owner 0, take 0) beside one
                // another, on a key a request gave a limit.
                let adopted = take == 0
                    && owner == 0
                    && permits.grants.iter().all(|&grant| {
                        let node = self.grants.get(grant);
                        node.owner == 0 && node.take == 0
                    });
                if !permits.fits(take) && !adopted {
                    return Err(RestoreError::DoesNotFit);
                }
                entry
            }
            None => {
                let entry = self
                    .table
                    .insert(key, hash, PERMITS, 0)
                    .ok_or(RestoreError::TableFull)?;
                self.new_permit_key(entry, limit);
                entry
            }
        };
        self.restore_permits(entry, grant);
        self.grants_held += 1;
        if take != 0 {
            self.counted_grants_made = true;
        }
        self.restored = (self.table.len(), self.grants_held);
        Ok(())
    }

    /// Every grant held now, for the snapshot at a clean stop (spec §7.4:
    /// with its take, its key's limit and its label); `deadline` is when
    /// its lease runs out (on the 1 ms tick). A key's grants come in token
    /// order.
    pub fn grants(&self) -> impl Iterator<Item = HeldGrant<'_>> + '_ {
        static NONE: std::collections::VecDeque<u32> = std::collections::VecDeque::new();
        let now = self.wheel.elapsed() * MICROS_PER_TICK;
        self.table.live_indices().flat_map(move |entry| {
            let held = self.table.get(entry);
            let key = self.table.key(entry);
            let inline = (held.token != 0 && held.token != PERMITS).then(|| HeldGrant {
                key,
                token: held.token,
                owner: held.owner,
                deadline: self.wheel.deadline_of(&{ held.lease }) * MICROS_PER_TICK,
                take: 0,
                limit: 0,
                label: self.labels.get(LabelOf::Entry(entry)),
                granted_at: now.wrapping_sub(
                    u64::from(waiters::held_ms(self.waiters.grant_time(held.waiters), now)) * 1_000,
                ),
            });
            let permits = (held.token == PERMITS).then(|| self.permit_key(entry));
            let limit = permits.map_or(0, |permits| permits.limit);
            let grants = permits.map_or(&NONE, |permits| &permits.grants);
            inline.into_iter().chain(grants.iter().map(move |&index| {
                let grant = self.grants.get(index);
                HeldGrant {
                    key,
                    token: grant.token,
                    owner: grant.owner,
                    deadline: self.wheel.deadline_of(&{ grant.lease }) * MICROS_PER_TICK,
                    take: grant.take,
                    limit,
                    label: self.labels.get(LabelOf::Grant(index)),
                    granted_at: grant.granted_at,
                }
            }))
        })
    }

    /// Whether `token` may adopt `key` (spec §7.3): it is an earlier run's
    /// token and the key is held by the unknown grant — an entry with token
    /// 0 (waited on), or, during the grace, a key not in the table and not
    /// known free — and it passes [`adoption_passes`](Self::adoption_passes)
    /// for `conn`.
    fn adoptable(&mut self, conn: ConnId, key: &str, token: u64, now: Micros) -> Option<Adoptable> {
        if token == 0 || token >= self.first_token || self.grace_counted {
            return None;
        }
        let adoptable = match self.table.find(key, self.table.hash(key)) {
            Some(entry) => (self.table.get(entry).token == 0).then_some(Adoptable::Waited(entry)),
            None => (now < self.grace_until && !self.freed_in_grace.contains(key))
                .then_some(Adoptable::Untracked),
        }?;
        self.adoption_passes(conn, key, token).then_some(adoptable)
    }

    /// Spec §7.4: whether `key` is held by the unknown grant of a grace
    /// that may hide counted grants, for an earlier run's `token`: `None`
    /// if not; else the key's entry, if it is in the table (token 0 with
    /// waiters, or a permit key the unknown grant holds).
    fn held_by_counted_unknown(&self, key: &str, token: u64, now: Micros) -> Option<Option<u32>> {
        if token == 0 || token >= self.first_token || now >= self.grace_until {
            return None;
        }
        match self.table.find(key, self.table.hash(key)) {
            Some(entry) => {
                let held = self.table.get(entry);
                let unknown =
                    held.token == 0 || (held.token == PERMITS && self.permit_key(entry).unknown);
                unknown.then_some(Some(entry))
            }
            None => self.held_by_unknown_grant(key, now).then_some(None),
        }
    }

    /// `E` of an earlier run's `token` that is not adopted yet, during a
    /// grace that may hide counted grants (spec §7.4): on a key the
    /// unknown grant holds it becomes an adopted grant (owner 0, take 0,
    /// the lease to `deadline`), the key turned into a permit key without
    /// a limit if it was not one; the unknown grant keeps the key until
    /// the horizon. Answers `E`, or `N` when the key is not held by the
    /// unknown grant or there is no room (then nothing changed).
    fn adopt_beside_unknown_grant(
        &mut self,
        conn: ConnId,
        key: &str,
        token: u64,
        deadline: Micros,
        now: Micros,
    ) {
        let held = self
            .held_by_counted_unknown(key, token, now)
            .filter(|_| self.adoption_passes(conn, key, token));
        let entry = match held {
            Some(entry) if !self.adoption_fits(entry.is_none()) => {
                return self.adoption_busy(conn, token);
            }
            Some(Some(entry)) => entry,
            Some(None) => {
                let hash = self.table.hash(key);
                let Some(entry) = self.table.insert(key, hash, 0, 0) else {
                    return self.adoption_busy(conn, token);
                };
                self.quotas.charge_key(entry);
                self.unknown_holders += 1;
                self.arm_lease_at(entry, self.grace_until);
                entry
            }
            None => {
                self.stats.extend_not_held += 1;
                return self.not_held(conn, token);
            }
        };
        if self.table.get(entry).token != PERMITS {
            self.set_limit(entry, 0, now);
        }
        let grant = self.adopt_grant(entry, token, deadline, now);
        self.quotas.charge_adopted(LabelOf::Grant(grant));
        self.stats.extended += 1;
        self.outbox.push((conn, Response::Extended { token }));
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
        if self.grace_counted {
            // Spec §7.4: the key stays held by the unknown grant until the
            // horizon, whoever releases; an adopted token was found as a
            // grant of the key before this.
            if self.held_by_counted_unknown(key, token, now).is_some()
                && self.adoption_passes(conn, key, token)
            {
                self.stats.released += 1;
                self.outbox.push((conn, Response::Released { token }));
            } else {
                self.stats.release_not_held += 1;
                self.not_held(conn, token);
            }
            return None;
        }
        match self.adoptable(conn, key, token, now) {
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
    /// whose lease to arm, or `None` once it has answered (`N`, or after a
    /// run with counted grants, §7.4, `E` or `N`).
    pub(super) fn adopt_earlier_token(
        &mut self,
        conn: ConnId,
        key: &str,
        token: u64,
        deadline: Micros,
        now: Micros,
    ) -> Option<u32> {
        if self.grace_counted {
            self.adopt_beside_unknown_grant(conn, key, token, deadline, now);
            return None;
        }
        // An adoption is a grant (spec §7.3 v5): charged to the adopting
        // identity and the server's limits like an `A`. No room: `B`,
        // nothing changed, and the key stays held by the unknown grant
        // until the horizon (availability lost, never safety).
        let entry = match self.adoptable(conn, key, token, now) {
            Some(Adoptable::Waited(entry)) => {
                if !self.adoption_fits(false) {
                    self.adoption_busy(conn, token);
                    return None;
                }
                self.unknown_holders -= 1;
                let held = self.table.get_mut(entry);
                held.token = token;
                held.owner = 0;
                entry
            }
            Some(Adoptable::Untracked) => {
                let hash = self.table.hash(key);
                let inserted = self
                    .adoption_fits(true)
                    .then(|| self.table.insert(key, hash, token, 0))
                    .flatten();
                let Some(entry) = inserted else {
                    self.adoption_busy(conn, token);
                    return None;
                };
                self.quotas.charge_key(entry);
                entry
            }
            None => {
                self.stats.extend_not_held += 1;
                self.not_held(conn, token);
                return None;
            }
        };
        self.grants_held += 1;
        self.quotas.charge_adopted(LabelOf::Entry(entry));
        Some(entry)
    }

    /// Whether an adoption fits the server's limits and the current
    /// identity's quotas (spec §7.3 v5): one grant more, and with
    /// `new_key` one key more.
    fn adoption_fits(&self, new_key: bool) -> bool {
        self.grants_held + self.waiters.len() < self.limits.max_grants
            && self.quotas.grant_fits()
            && (!new_key || (self.table.len() < self.limits.max_keys && self.quotas.key_fits()))
    }

    /// An adoption without room: `B` with the token in place of the owner.
    #[cold]
    fn adoption_busy(&mut self, conn: ConnId, token: u64) {
        self.stats.busy += 1;
        self.outbox.push((conn, Response::Busy { owner: token }));
    }

    /// Whether `key`, not in the table, counts as held by the unknown
    /// grant: during the grace, unless it is known free.
    #[inline]
    pub(super) fn held_by_unknown_grant(&self, key: &str, now: Micros) -> bool {
        now < self.grace_until && !self.freed_in_grace.contains(key)
    }

    /// Drops the keys remembered free, and the adoption tries refused,
    /// once the grace is over.
    pub(super) fn forget_freed_after_grace(&mut self, now: Micros) {
        if now >= self.grace_until
            && !(self.freed_in_grace.is_empty() && self.adoption.refused.is_empty())
        {
            self.freed_in_grace = HashSet::default();
            self.adoption.refused = HashMap::default();
            self.adoption.overflow = 0;
        }
    }

    /// `entry`'s key is about to leave the table free: while the grace
    /// runs, remember that it is free (not in the table would mean held).
    #[inline(always)]
    pub(super) fn note_freed_in_grace(&mut self, entry: u32, now: Micros) {
        if now < self.grace_until {
            self.note_entry_freed(entry);
        }
    }

    /// [`note_freed_in_grace`](Self::note_freed_in_grace) while the grace
    /// runs, out of the release path.
    #[cold]
    #[inline(never)]
    fn note_entry_freed(&mut self, entry: u32) {
        let key: Box<str> = self.table.key(entry).into();
        self.note_freed(&key);
    }
}
