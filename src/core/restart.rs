//! Restart policy (spec §7), sans-IO: what a run must have made durable
//! before an answer leaves the process, what a clean stop persists, and
//! what the next run makes of it — the grace, and which grants come back
//! with how much lease left. Every function takes `now` (or durations the
//! shell measured) as an argument; the file format, the clocks and the
//! writes are `server::state`'s, and the shell obeys what this decides.
//!
//! What the core itself does with an earlier run's grants and grace
//! (adoption by `E`/`R`, keys known free) is in `adoption`.

use std::time::Duration;

use super::{Core, EarlierGrant, Micros, RestoreError};

/// Grants reserved per write of the high-water mark: this many tokens, or
/// with tokens bound to their keys (spec §7.3 v5) this many counter steps
/// of 2^16 tokens each.
pub const TOKEN_BLOCK: u64 = 1 << 26;
/// How far past the latest lease deadline the horizon is pushed per write:
/// the most the grace after a crash can exceed the longest outstanding
/// lease, and the least time between two writes under steady grants.
pub const HORIZON_STEP: Duration = Duration::from_secs(5);
/// No grace after a restart, and no restored lease, lasts longer than the
/// longest lease plus [`HORIZON_STEP`], whatever the clocks say.
pub const MAX_GRACE: Duration = Duration::from_secs(255 + 5);
/// How often, at most, the leases still running are looked at after some
/// ended, to bring the horizon down.
pub const LOWER_CHECK: Duration = Duration::from_secs(1);
/// The least time between two writes that bring the horizon down: under
/// any load they add at most one write (and the raise after it) per 5 s.
pub const LOWER_EVERY: Duration = Duration::from_secs(5);
/// The least gain worth a write that brings the horizon down.
pub const LOWER_GAIN_MIN: Duration = Duration::from_secs(1);
/// While the state file cannot be written (spec §7.6), how long after a
/// failed write the next one is tried.
pub const RETRY_EVERY: Duration = Duration::from_secs(1);
/// While it cannot, how often at most the failure is logged.
pub const LOG_FAILURE_EVERY: Duration = Duration::from_secs(60);

const MS: Micros = 1_000;

/// A state file's high-water mark this close to `u64::MAX` is refused at
/// start (spec §7.6): the run would have next to no tokens left.
pub const HIGH_WATER_ROOM_MIN: u64 = 1 << 32;
/// Nor one more than this above `unix_time_ms × 2^20`: 2^52 tokens is
/// more than a century of grants at a million a second ahead of the
/// clock, so such a mark is damage or forgery, not an earlier run.
pub const HIGH_WATER_AHEAD_MAX: u64 = 1 << 52;

/// Why a persisted token high-water mark cannot be an earlier run's, with
/// the wall clock at `wall_ms` (spec §7.6); `None` when it can.
pub fn implausible_high_water(high_water: u64, wall_ms: u64) -> Option<String> {
    if high_water > u64::MAX - HIGH_WATER_ROOM_MIN {
        return Some(format!(
            "implausible token high-water mark {high_water}: within 2^32 of the largest token"
        ));
    }
    let clock = wall_ms.saturating_mul(1 << 20);
    (high_water.saturating_sub(clock) > HIGH_WATER_AHEAD_MAX).then(|| {
        format!(
            "implausible token high-water mark {high_water}: more than 2^52 above the \
             clock's first token {clock} (unix time ms × 2^20)"
        )
    })
}

fn micros(duration: Duration) -> Micros {
    duration.as_micros() as Micros
}

/// What the state file must promise while the run goes on, in the core's
/// µs: no token at or above `token_high_water` has been shown to anyone,
/// and no lease of this run (nor the grace it inherited) runs past
/// `horizon` (0 = nothing outstanding); `counted_grants`: a lease up to
/// the horizon may be a counted grant (spec §7.4), recorded before the
/// first answer that shows one; `macs_until`: the last token, of this run
/// or an earlier one, that may be bound to its key (spec §7.3 v5; 0 =
/// none): no token above it is adopted after a crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Promise {
    pub token_high_water: u64,
    pub horizon: Micros,
    pub counted_grants: bool,
    pub macs_until: u64,
}

/// Durability before visibility: which [`Promise`] must be on disk before
/// anything the core has decided so far may leave the process. A write
/// raises the promise in steps — [`TOKEN_BLOCK`] tokens, a horizon
/// [`HORIZON_STEP`] past the latest lease deadline — so the horizon never
/// runs more than 5 s past the latest lease armed, and steady grants cost
/// one write per [`HORIZON_STEP`].
///
/// The horizon also comes down as long leases end ([`plan`](Self::plan)):
/// within [`LOWER_CHECK`] of a lease ending, when that gains more than
/// [`LOWER_GAIN_MIN`], and at most once per [`LOWER_EVERY`], the next
/// promise puts it [`HORIZON_STEP`] past the latest lease still running
/// (never below it, nor below an inherited grace), so that the grace after
/// a crash follows the leases outstanding at the crash, not a long lease
/// released before it.
#[derive(Clone, Debug, Default)]
pub struct Durability {
    /// What the file on disk promises; `None` until this run's first
    /// write (which replaces the earlier run's file whatever it said).
    persisted: Option<Promise>,
    /// [`plan`](Self::plan) decided to bring the horizon down with the
    /// next promise.
    lowering: bool,
    /// When `plan` last brought the horizon down.
    lowered_at: Option<Micros>,
    /// `plan` does nothing before then.
    next_plan: Micros,
    /// The last write failed (spec §7.6, disk trouble).
    failing: Option<Failing>,
}

/// Disk trouble: the writes fail since `since`.
#[derive(Clone, Copy, Debug)]
struct Failing {
    /// Writes that failed since the last that succeeded.
    failures: u64,
    /// The next write is tried then, not before.
    retry_at: Micros,
    /// When the failure was last logged.
    logged_at: Micros,
}

impl Durability {
    pub fn new() -> Durability {
        Durability::default()
    }

    /// The promise to make durable before transmitting anything `core`
    /// has queued, or `None` when the one on disk covers it.
    ///
    /// Asked before every write: the usual answer, that the file covers
    /// it all, is found inline without building the promise (what a
    /// state directory cost per request at P=1, issue 38).
    #[inline(always)]
    pub fn needed(&self, core: &Core) -> Option<Promise> {
        if let Some(on_disk) = &self.persisted
            && self.covers(
                on_disk,
                core.next_token(),
                core.lease_deadline_max(),
                core.grace_until(),
                core.counted_grants(),
            )
            && core.macs_until(on_disk.token_high_water) == on_disk.macs_until
        {
            return None;
        }
        self.needed_by(core)
    }

    /// [`needed`](Self::needed) when the file may not cover it.
    #[inline(never)]
    fn needed_by(&self, core: &Core) -> Option<Promise> {
        let mut wanted = self.wanted(
            core.next_token(),
            TOKEN_BLOCK.saturating_mul(core.token_step()),
            core.lease_deadline_max(),
            core.grace_until(),
            core.counted_grants(),
        );
        wanted.macs_until = core.macs_until(wanted.token_high_water);
        (self.persisted != Some(wanted)).then_some(wanted)
    }

    /// [`needed`](Self::needed) from the figures it depends on, for a core
    /// whose tokens go +1 per grant: tokens below `next_token` may be
    /// shown, leases run to `lease_deadline`, keys count as held by an
    /// earlier run until `grace_until` (µs; 0 = none), and any of those
    /// leases may be a counted grant when `counted_grants`. Once recorded,
    /// the flag stays for the run.
    #[inline(always)]
    pub fn needed_for(
        &self,
        next_token: u64,
        lease_deadline: Micros,
        grace_until: Micros,
        counted_grants: bool,
    ) -> Option<Promise> {
        if let Some(on_disk) = &self.persisted
            && self.covers(
                on_disk,
                next_token,
                lease_deadline,
                grace_until,
                counted_grants,
            )
        {
            return None;
        }
        self.needed_in_full(next_token, lease_deadline, grace_until, counted_grants)
    }

    /// The file on disk promises all these figures need, and no lowering
    /// of the horizon is planned: then the promise wanted is the one on
    /// disk (its `macs_until` aside, which [`needed`](Self::needed) checks).
    #[inline(always)]
    fn covers(
        &self,
        on_disk: &Promise,
        next_token: u64,
        lease_deadline: Micros,
        grace_until: Micros,
        counted_grants: bool,
    ) -> bool {
        !self.lowering
            && next_token <= on_disk.token_high_water
            && lease_deadline.max(grace_until) <= on_disk.horizon
            && (on_disk.counted_grants || !counted_grants)
    }

    /// [`needed_for`](Self::needed_for) when the file may not cover it.
    #[inline(never)]
    fn needed_in_full(
        &self,
        next_token: u64,
        lease_deadline: Micros,
        grace_until: Micros,
        counted_grants: bool,
    ) -> Option<Promise> {
        let wanted = self.wanted(
            next_token,
            TOKEN_BLOCK,
            lease_deadline,
            grace_until,
            counted_grants,
        );
        (self.persisted != Some(wanted)).then_some(wanted)
    }

    /// The promise that covers these figures, `block` tokens reserved at a
    /// time (its `macs_until` that of the file).
    fn wanted(
        &self,
        next_token: u64,
        block: u64,
        lease_deadline: Micros,
        grace_until: Micros,
        counted_grants: bool,
    ) -> Promise {
        // Before the first write the file promises nothing of this run.
        let persisted = self.persisted.unwrap_or(Promise {
            token_high_water: 0,
            horizon: 0,
            counted_grants: false,
            macs_until: 0,
        });
        let token_high_water =
            if next_token > persisted.token_high_water || self.persisted.is_none() {
                next_token.saturating_add(block)
            } else {
                persisted.token_high_water
            };
        let covered = lease_deadline.max(grace_until);
        let horizon = if covered > persisted.horizon {
            raised_horizon(lease_deadline, grace_until)
        } else if self.lowering {
            // Computed now, from what is armed now: never below a lease.
            let lowered = if covered == 0 {
                0
            } else {
                raised_horizon(lease_deadline, grace_until)
            };
            lowered.min(persisted.horizon)
        } else {
            persisted.horizon
        };
        Promise {
            token_high_water,
            horizon,
            counted_grants: counted_grants || persisted.counted_grants,
            macs_until: persisted.macs_until,
        }
    }

    /// The shell made `promise` durable.
    pub fn persisted(&mut self, promise: Promise) {
        self.persisted = Some(promise);
        self.lowering = false;
    }

    /// After `core.handle_timeout(now)`: if leases ended since the last
    /// look (at most once per [`LOWER_CHECK`]), forgets them
    /// ([`Core::settle_lease_deadline_max`]) and decides whether the next
    /// promise brings the horizon down (see the type's docs); the shell
    /// then makes [`needed`](Self::needed) durable as before any answer.
    pub fn plan(&mut self, core: &mut Core, now: Micros) {
        if !core.leases_ended() || now < self.next_plan {
            return;
        }
        let Some(persisted) = self.persisted else {
            return;
        };
        if let Some(lowered_at) = self.lowered_at {
            let allowed = lowered_at + micros(LOWER_EVERY);
            if now < allowed {
                self.next_plan = allowed;
                return;
            }
        }
        self.next_plan = now + micros(LOWER_CHECK);
        core.settle_lease_deadline_max();
        let covered = core.lease_deadline_max().max(core.grace_until());
        let wanted = if covered == 0 {
            0
        } else {
            raised_horizon(core.lease_deadline_max(), core.grace_until())
        };
        if persisted.horizon > wanted.max(now) + micros(LOWER_GAIN_MIN) {
            self.lowering = true;
            self.lowered_at = Some(now);
        }
    }

    /// When [`plan`](Self::plan) next has work, if it has any.
    pub fn poll_timeout(&self, core: &Core) -> Option<Micros> {
        (core.leases_ended() && self.persisted.is_some()).then_some(self.next_plan)
    }

    /// When `plan` last decided to bring the horizon down.
    pub fn lowered_at(&self) -> Option<Micros> {
        self.lowered_at
    }

    /// What the file on disk promises, if this run wrote it yet.
    pub fn on_disk(&self) -> Option<Promise> {
        self.persisted
    }

    /// Writing `wanted` failed at `now` (spec §7.6): until a write
    /// succeeds the run promises nothing beyond what is on disk (the core
    /// answers `B` to what would need more: [`Core::set_ceiling`]), the
    /// next write is tried [`RETRY_EVERY`] later, and the failure is
    /// logged at most once per [`LOG_FAILURE_EVERY`]. Returns whether to
    /// log it now.
    pub fn failed(&mut self, now: Micros) -> bool {
        let retry_at = now + micros(RETRY_EVERY);
        match self.failing.as_mut() {
            None => {
                self.failing = Some(Failing {
                    failures: 1,
                    retry_at,
                    logged_at: now,
                });
                true
            }
            Some(failing) => {
                failing.failures += 1;
                failing.retry_at = retry_at;
                let log = now >= failing.logged_at + micros(LOG_FAILURE_EVERY);
                if log {
                    failing.logged_at = now;
                }
                log
            }
        }
    }

    /// Whether writes are failing (the last one did).
    pub fn failing(&self) -> bool {
        self.failing.is_some()
    }

    /// Whether a write may be tried at `now`: always, unless one failed
    /// less than [`RETRY_EVERY`] ago.
    pub fn write_due(&self, now: Micros) -> bool {
        self.failing.is_none_or(|failing| now >= failing.retry_at)
    }

    /// When the next write is tried, while writes fail.
    pub fn retry_at(&self) -> Option<Micros> {
        self.failing.map(|failing| failing.retry_at)
    }

    /// Whether `wanted` promises more than the file does: more tokens, a
    /// later horizon, or counted grants. (A promise that only brings the
    /// horizon down promises less: nothing shown depends on it.)
    pub fn raises(&self, wanted: Promise) -> bool {
        let Some(on_disk) = self.persisted else {
            return true;
        };
        wanted.token_high_water > on_disk.token_high_water
            || wanted.horizon > on_disk.horizon
            || (wanted.counted_grants && !on_disk.counted_grants)
    }

    /// A write succeeded after writes failed: how many had failed (the
    /// trouble is over); `None` when none had.
    pub fn recovered(&mut self) -> Option<u64> {
        self.failing.take().map(|failing| failing.failures)
    }
}

/// A lease deadline moves the horizon [`HORIZON_STEP`] beyond it; a grace
/// inherited from an earlier run is kept as it is, not stepped, so crash
/// after crash never lengthens it.
fn raised_horizon(lease_deadline: Micros, grace_until: Micros) -> Micros {
    (lease_deadline + micros(HORIZON_STEP)).max(grace_until)
}

/// The width of a [`LeaseLedger`] bucket.
pub const LEDGER_BUCKET: Duration = Duration::from_millis(100);
const BUCKET_TICKS: u64 = 100;
/// Buckets in the ledger's ring: 409.6 s, more than any lease, restored
/// grant or grace (at most [`MAX_GRACE`]) lies ahead of the wheel.
const LEDGER_BUCKETS: u64 = 4096;
/// How far behind the wheel, in buckets, the ledger looks for a deadline
/// (a timer armed for a tick already reached fires at the next poll): 100
/// s, which leaves 309.5 s ahead.
const LEDGER_BEHIND: u64 = 1_000;

/// The armed lease timers of a core, counted by the 100 ms bucket their
/// deadline tick falls in, so that the latest deadline of a lease still
/// running is found without a walk over the table: the wheel reports
/// every arm and every disarm with its deadline (`TimerStore`), so the
/// counts are exact. O(1) per arm and disarm; [`latest`](Self::latest)
/// looks at up to 4,096 counters, so it is called rarely.
pub(crate) struct LeaseLedger {
    /// Arrays, not slices: a bucket index (`% LEDGER_BUCKETS`) needs no
    /// bounds check on the `A`/`R` path.
    counts: Box<[u32; LEDGER_BUCKETS as usize]>,
    /// One bit per bucket: its count is not 0.
    occupied: Box<[u64; LEDGER_BUCKETS as usize / 64]>,
    armed: usize,
    /// A timer left since the last settle.
    pub(crate) ended: bool,
    /// The tick every unknown grant's timer is armed for (the grace's end).
    pub(crate) grace_tick: u64,
}

impl LeaseLedger {
    pub(crate) fn new() -> LeaseLedger {
        LeaseLedger {
            counts: Box::new([0; LEDGER_BUCKETS as usize]),
            occupied: Box::new([0; LEDGER_BUCKETS as usize / 64]),
            armed: 0,
            ended: false,
            grace_tick: 0,
        }
    }

    #[inline(always)]
    fn bucket(tick: u64) -> usize {
        ((tick / BUCKET_TICKS) % LEDGER_BUCKETS) as usize
    }

    #[inline(always)]
    pub(crate) fn add(&mut self, tick: u64) {
        let bucket = Self::bucket(tick);
        self.counts[bucket] += 1;
        self.occupied[bucket / 64] |= 1 << (bucket % 64);
        self.armed += 1;
    }

    #[inline(always)]
    pub(crate) fn remove(&mut self, tick: u64) {
        let bucket = Self::bucket(tick);
        let count = &mut self.counts[bucket];
        debug_assert!(*count > 0, "a lease timer disarmed that was never armed");
        *count = count.saturating_sub(1);
        if *count == 0 {
            self.occupied[bucket / 64] &= !(1 << (bucket % 64));
        }
        self.armed = self.armed.saturating_sub(1);
        self.ended = true;
    }

    /// How many lease timers are armed.
    pub(crate) fn len(&self) -> usize {
        self.armed
    }

    /// The end (µs) of the latest bucket that holds an armed deadline —
    /// never before that deadline — or 0 when nothing is armed, leaving
    /// out the `unknown` timers of the unknown grants, all armed for
    /// [`grace_tick`](Self::grace_tick). `elapsed`
    /// is the wheel's tick: every armed deadline lies less than 100 s behind
    /// it and less than 309.5 s ahead.
    pub(crate) fn latest(&self, elapsed: u64, unknown: usize) -> Micros {
        if self.armed <= unknown {
            return 0;
        }
        let grace_bucket = self.grace_tick / BUCKET_TICKS;
        let first = (elapsed / BUCKET_TICKS).saturating_sub(LEDGER_BEHIND);
        let mut bucket = first + LEDGER_BUCKETS - 1;
        let found = loop {
            // The occupied buckets of `bucket`'s word, up to `bucket`.
            let index = bucket % LEDGER_BUCKETS;
            let bit = index % 64;
            let mut bits = self.occupied[(index / 64) as usize] & (u64::MAX >> (63 - bit));
            let mut hit = None;
            while bits != 0 {
                let top = 63 - u64::from(bits.leading_zeros());
                let candidate = bucket - (bit - top);
                let count = self.counts[(candidate % LEDGER_BUCKETS) as usize] as usize;
                if candidate != grace_bucket || count > unknown {
                    hit = Some(candidate);
                    break;
                }
                bits &= !(1 << top);
            }
            match hit {
                Some(candidate) if candidate >= first => break Some(candidate),
                Some(_) => break None,
                None if bucket < first + bit + 1 => break None,
                None => bucket -= bit + 1,
            }
        };
        found.map_or(Micros::MAX, |bucket| (bucket + 1) * BUCKET_TICKS * MS)
    }
}

/// One grant held at a clean stop, as persisted and as read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedGrant<'a> {
    pub key: &'a str,
    pub token: u64,
    pub owner: u64,
    /// Lease time left at the stop, ms.
    pub left_ms: u32,
    /// Permits it holds; 0 = all (exclusive).
    pub take: u16,
    /// Its key's limit; 0 = none.
    pub limit: u16,
    /// Its label (spec §11.1), often empty.
    pub label: &'a str,
    /// How long it had been held at the stop, ms (spec §7.5); the
    /// downtime is added when it comes back.
    pub held_ms: u32,
}

/// What a clean stop at `now` persists (spec §7.1).
pub struct CleanStop<'c> {
    core: &'c Core,
    now: Micros,
    /// Tokens from here on were never issued.
    pub next_token: u64,
    /// Keys without a grant may still be held by an earlier run's lease
    /// until then (µs of the core's clock; 0 = none): what remains of the
    /// grace this run inherited.
    pub horizon: Micros,
    /// Whether a lease up to `horizon` may be a counted grant.
    pub counted_grants: bool,
    /// How many grants [`grants`](Self::grants) lists.
    pub count: usize,
    /// The last token that may be bound to its key (see
    /// [`Promise::macs_until`]).
    pub macs_until: u64,
}

impl<'c> CleanStop<'c> {
    /// The clean stop of `core` at `now`, once no request can arrive.
    pub fn of(core: &'c Core, now: Micros) -> CleanStop<'c> {
        let grace = core.grace_until();
        let horizon = if grace > now { grace } else { 0 };
        CleanStop {
            core,
            now,
            next_token: core.next_token(),
            horizon,
            counted_grants: horizon != 0 && core.counted_grants(),
            count: core.grants().filter(|grant| grant.deadline > now).count(),
            macs_until: core.macs_until(core.next_token()),
        }
    }

    /// When the stop is (µs of the core's clock).
    pub fn now(&self) -> Micros {
        self.now
    }

    /// Every grant whose lease still runs, with the time left rounded
    /// down (the lease never grows across the restart) and capped at
    /// [`MAX_GRACE`].
    pub fn grants(&self) -> impl Iterator<Item = SavedGrant<'c>> + 'c {
        let now = self.now;
        let max_left = MAX_GRACE.as_millis() as u64;
        self.core
            .grants()
            .filter(move |grant| grant.deadline > now)
            .map(move |grant| SavedGrant {
                key: grant.key,
                token: grant.token,
                owner: grant.owner,
                left_ms: ((grant.deadline - now) / MS).min(max_left) as u32,
                take: grant.take,
                limit: grant.limit,
                label: grant.label,
                held_ms: u32::try_from(now.wrapping_sub(grant.granted_at) / MS).unwrap_or(u32::MAX),
            })
    }
}

/// What the previous run means for this one, measured when this run's
/// clock reads 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Restart {
    /// Every key without a restored grant counts as held for this long.
    pub grace: Duration,
    /// Whether those unknown grants may be counted grants (spec §7.4).
    pub counted_grants: bool,
    /// The time since the state file was written, ms.
    since_ms: u64,
    /// No earlier token above it is adopted (spec §7.3 v5; the file's
    /// `macs_until`, 0 for formats 1 to 4: nothing is).
    pub macs_until: u64,
}

/// A grant of the earlier run that [`Restart::resume`] could not restore.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreFailure {
    pub key: String,
    pub error: RestoreError,
}

impl std::fmt::Display for RestoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "grant of {:?}: {}", self.key, self.error)
    }
}

impl Restart {
    /// The previous run promised leases up to `horizon_ms` after its
    /// file was written, and `since_ms` have passed since (measured by the
    /// shell on the right clock), some of them counted grants when
    /// `counted_grants`: the downtime counts against every lease, never
    /// for it, and nothing lasts longer than [`MAX_GRACE`].
    pub fn new(horizon_ms: u64, since_ms: u64, counted_grants: bool) -> Restart {
        let cap = MAX_GRACE.as_millis() as u64;
        let grace = Duration::from_millis(horizon_ms.saturating_sub(since_ms).min(cap));
        Restart {
            grace,
            counted_grants: counted_grants && !grace.is_zero(),
            since_ms,
            macs_until: 0,
        }
    }

    /// The lease a grant with `left_ms` at the write has left now, or
    /// `None` when it ran out while the server was down.
    pub fn lease_left(&self, left_ms: u32) -> Option<Duration> {
        // Both clock readings are whole ms: one ms less keeps the downtime
        // from ever counting for the lease.
        let left = u64::from(left_ms)
            .saturating_sub(self.since_ms + 1)
            .min(MAX_GRACE.as_millis() as u64);
        (left > 0).then(|| Duration::from_millis(left))
    }

    /// How long a grant held `held_ms` at the write has been held now:
    /// the downtime counts (spec §7.5: `held_ms` counts from the original
    /// grant), measured on the clock the lease left is measured on.
    pub fn held_ms(&self, held_ms: u32) -> u32 {
        u32::try_from(u64::from(held_ms) + self.since_ms).unwrap_or(u32::MAX)
    }

    /// Until when (core µs) keys count as held by the earlier run's
    /// unknown grants, if at all. The clocks are read in whole ms after
    /// the core's instant 0: one more ms keeps the grace from ending early.
    pub fn grace_until(&self) -> Option<Micros> {
        (!self.grace.is_zero()).then(|| micros(self.grace) + MS)
    }

    /// The grants of a clean stop that come back, each with its lease
    /// deadline on the new run's clock.
    pub fn restorable<'a>(
        &self,
        grants: impl IntoIterator<Item = SavedGrant<'a>>,
    ) -> impl Iterator<Item = (SavedGrant<'a>, Micros)> {
        let restart = *self;
        grants.into_iter().filter_map(move |grant| {
            let left = restart.lease_left(grant.left_ms)?;
            Some((grant, micros(left)))
        })
    }

    /// Brings the previous run into `core`, whose clock reads 0 and which
    /// has seen nothing yet: restores the grants of a clean stop (less the
    /// downtime) and sets the grace. Returns how many grants came back.
    pub fn resume<'a>(
        &self,
        core: &mut Core,
        grants: impl IntoIterator<Item = SavedGrant<'a>>,
    ) -> Result<u64, RestoreFailure> {
        let mut restored = 0;
        for (grant, deadline) in self.restorable(grants) {
            let earlier = EarlierGrant {
                key: grant.key,
                token: grant.token,
                owner: grant.owner,
                deadline,
                take: grant.take,
                limit: grant.limit,
                label: grant.label,
                granted_at: 0u64.wrapping_sub(u64::from(self.held_ms(grant.held_ms)) * MS),
            };
            core.restore_grant(&earlier)
                .map_err(|error| RestoreFailure {
                    key: grant.key.to_owned(),
                    error,
                })?;
            restored += 1;
        }
        core.set_adoptable_until(self.macs_until);
        if let Some(until) = self.grace_until() {
            core.set_grace_until(until);
            core.set_grace_counted(self.counted_grants);
        }
        Ok(restored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;

    #[test]
    fn the_promise_rises_in_steps_and_only_when_needed() {
        let mut durability = Durability::new();
        // The first promise is always needed: it replaces the last run's.
        let first = durability.needed_for(100, 0, 0, false).unwrap();
        assert_eq!(first.token_high_water, 100 + TOKEN_BLOCK);
        durability.persisted(first);
        assert_eq!(durability.needed_for(100, 0, 0, false), None);
        // A lease to 5 s: the horizon goes to 10 s, and stays while the
        // leases stay within it.
        let leased = durability.needed_for(100, 5 * S, 0, false).unwrap();
        assert_eq!(leased.horizon, 10 * S);
        durability.persisted(leased);
        assert_eq!(durability.needed_for(100, 10 * S, 0, false), None);
        let later = durability.needed_for(100, 10 * S + 1, 0, false).unwrap();
        assert_eq!(later.horizon, 15 * S + 1);
        durability.persisted(later);
        // Tokens: a block at a time.
        assert_eq!(durability.needed_for(100 + TOKEN_BLOCK, 0, 0, false), None);
        let tokens = durability
            .needed_for(101 + TOKEN_BLOCK, 0, 0, false)
            .unwrap();
        assert_eq!(tokens.token_high_water, 101 + 2 * TOKEN_BLOCK);
        durability.persisted(tokens);
        // An inherited grace is kept exactly, not stepped.
        let grace = durability
            .needed_for(101 + TOKEN_BLOCK, 0, 20 * S, false)
            .unwrap();
        assert_eq!(grace.horizon, 20 * S);
        assert_eq!(durability.on_disk(), Some(tokens));
    }

    #[test]
    fn the_inline_answer_agrees_with_the_full_computation() {
        let figures = [0, 1, 99, 100, 101, 5 * S, 10 * S, 10 * S + 1, 20 * S];
        let on_disk = [
            None,
            Some(Promise {
                token_high_water: 100,
                horizon: 10 * S,
                counted_grants: false,
                macs_until: 0,
            }),
            Some(Promise {
                token_high_water: 100,
                horizon: 10 * S,
                counted_grants: true,
                macs_until: 0,
            }),
            Some(Promise {
                token_high_water: 0,
                horizon: 0,
                counted_grants: false,
                macs_until: 0,
            }),
        ];
        for persisted in on_disk {
            for lowering in [false, true] {
                let durability = Durability {
                    persisted,
                    lowering,
                    ..Durability::default()
                };
                for next_token in figures {
                    for lease in figures {
                        for grace in figures {
                            for counted in [false, true] {
                                assert_eq!(
                                    durability.needed_for(next_token, lease, grace, counted),
                                    durability.needed_in_full(next_token, lease, grace, counted),
                                    "{persisted:?} lowering {lowering} {next_token} {lease} \
                                     {grace} {counted}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_failing_write_is_retried_every_second_and_logged_once_a_minute() {
        let mut durability = Durability::new();
        let first = durability.needed_for(100, 0, 0, false).unwrap();
        durability.persisted(first);
        assert!(!durability.failing());
        assert!(durability.write_due(0));
        // A lease to 5 s needs a later horizon: that promise is a raise.
        let wanted = durability.needed_for(100, 5 * S, 0, false).unwrap();
        assert!(durability.raises(wanted));
        assert!(durability.failed(2 * S), "the first failure is logged");
        assert!(durability.failing());
        assert_eq!(durability.retry_at(), Some(3 * S));
        assert!(!durability.write_due(3 * S - 1));
        assert!(durability.write_due(3 * S));
        // Retried each second; logged again only a minute after the last log.
        for second in 3..62 {
            assert!(!durability.failed(second * S), "{second}");
        }
        assert!(durability.failed(62 * S));
        assert!(!durability.failed(63 * S));
        // The disk is back: what is on disk covers what was wanted.
        assert_eq!(durability.recovered(), Some(62));
        durability.persisted(wanted);
        assert!(!durability.failing());
        assert!(durability.write_due(63 * S));
        assert_eq!(durability.recovered(), None);
        // Bringing the horizon down promises less: not a raise.
        let lowered = Promise {
            horizon: S,
            ..wanted
        };
        assert!(!durability.raises(lowered));
        let counted = Promise {
            counted_grants: true,
            ..wanted
        };
        assert!(durability.raises(counted));
    }

    #[test]
    fn counted_grants_are_recorded_before_anything_that_shows_one_and_stay() {
        let mut durability = Durability::new();
        let first = durability.needed_for(100, 0, 0, false).unwrap();
        assert!(!first.counted_grants);
        durability.persisted(first);
        // Nothing else changed, yet the flag alone needs a write.
        let counted = durability.needed_for(100, 0, 0, true).unwrap();
        assert_eq!(
            counted,
            Promise {
                counted_grants: true,
                ..first
            }
        );
        durability.persisted(counted);
        assert_eq!(durability.needed_for(100, 0, 0, true), None);
        // Once on disk it stays for the run.
        let leased = durability.needed_for(100, 5 * S, 0, false).unwrap();
        assert!(leased.counted_grants);
    }

    #[test]
    fn the_ledger_finds_the_latest_armed_lease_across_the_ring_and_leaves_out_the_grace() {
        let mut ledger = LeaseLedger::new();
        assert_eq!(ledger.latest(0, 0), 0);
        // Ticks are ms; a bucket is 100 of them and ends after its deadline.
        ledger.add(4_000);
        ledger.add(30_050);
        assert_eq!(ledger.latest(0, 0), 30_100 * MS);
        ledger.remove(30_050);
        assert!(ledger.ended);
        assert_eq!(ledger.latest(0, 0), 4_100 * MS);
        // Far along the clock, past several turns of the 409.6 s ring.
        let far = 10_000_000;
        ledger.remove(4_000);
        ledger.add(far + 255_000);
        ledger.add(far + 1);
        assert_eq!(ledger.latest(far, 0), (far + 255_100) * MS);
        ledger.remove(far + 255_000);
        assert_eq!(ledger.latest(far, 0), (far + 100) * MS);
        // The unknown grants' timers at the grace's end are left out; a
        // lease in the same bucket is not.
        ledger.grace_tick = far + 200_000;
        ledger.add(far + 200_000);
        ledger.add(far + 200_000);
        assert_eq!(ledger.latest(far, 2), (far + 100) * MS);
        ledger.add(far + 200_050);
        assert_eq!(ledger.latest(far, 2), (far + 200_100) * MS);
        assert_eq!(ledger.len(), 4);
    }

    #[test]
    fn a_high_water_mark_near_the_end_or_far_ahead_of_the_clock_is_implausible() {
        let wall_ms = 1_800_000_000_000;
        let clock = wall_ms << 20;
        for plausible in [0, 1, clock, clock + HIGH_WATER_AHEAD_MAX] {
            assert_eq!(
                implausible_high_water(plausible, wall_ms),
                None,
                "{plausible}"
            );
        }
        for implausible in [
            clock + HIGH_WATER_AHEAD_MAX + 1,
            u64::MAX - HIGH_WATER_ROOM_MIN + 1,
            u64::MAX,
        ] {
            let why = implausible_high_water(implausible, wall_ms).unwrap();
            assert!(
                why.starts_with("implausible token high-water mark"),
                "{why}"
            );
        }
        // A clock at 0 (unset) still leaves 2^52 of room.
        assert_eq!(implausible_high_water(HIGH_WATER_AHEAD_MAX, 0), None);
        assert!(implausible_high_water(HIGH_WATER_AHEAD_MAX + 1, 0).is_some());
    }

    #[test]
    fn counted_unknown_grants_matter_only_while_the_grace_runs() {
        assert!(Restart::new(6_000, 1_000, true).counted_grants);
        assert!(!Restart::new(6_000, 6_000, true).counted_grants);
        assert!(!Restart::new(6_000, 1_000, false).counted_grants);
    }

    #[test]
    fn the_grace_is_the_horizon_less_the_downtime_and_never_past_the_cap() {
        let restart = Restart::new(6_000, 1_000, false);
        assert_eq!(restart.grace, Duration::from_millis(5_000));
        assert_eq!(restart.grace_until(), Some(5_001_000));
        assert_eq!(Restart::new(6_000, 6_000, false).grace_until(), None);
        assert_eq!(Restart::new(u64::MAX, 0, false).grace, MAX_GRACE);
        // A lease loses one ms more than the downtime, never less.
        assert_eq!(restart.lease_left(1_001), None);
        assert_eq!(restart.lease_left(1_002), Some(Duration::from_millis(1)));
        assert_eq!(
            restart.lease_left(u32::MAX),
            Some(MAX_GRACE),
            "a restored lease is capped"
        );
    }
}
