//! The optional state directory (`--state-dir`): what makes a restart cost
//! holders nothing, and a crash cost them nothing but a renewal.
//!
//! One file, `kunci.state`, records what the next run must know:
//!
//! - a token **high-water mark**: no token at or above it has been shown to
//!   anyone, so the next run starts there (or at the clock, if higher);
//! - a **lease horizon**: no lease this run granted runs past it, so after
//!   an unclean stop the next run treats every key as held until then;
//! - after a **clean stop**, every held grant (key, token, owner, lease time
//!   left), which the next run restores before it accepts a connection.
//!
//! While the server runs, the high-water mark and the horizon are raised
//! *before* any answer that needs them leaves the process (the event loop
//! calls [`StateDir::cover`] before every write), in steps: [`TOKEN_BLOCK`]
//! tokens, and a horizon [`HORIZON_STEP`] past the latest lease deadline. So
//! the horizon never runs more than 5 s past the latest lease deadline
//! actually armed, and a server with steady grants writes the file at most
//! once per [`HORIZON_STEP`] (two fsyncs: the file and the directory).
//!
//! # Time across a restart
//!
//! Every instant in the file is stored as a duration after the moment the
//! file was written, and the file names that moment on two clocks:
//! `CLOCK_BOOTTIME` (which wall-clock steps do not move and which keeps
//! counting through a process crash) and the wall clock, with the kernel's
//! boot id. The next run measures the time since the write on
//! `CLOCK_BOOTTIME` when the boot id is the same, and on the wall clock
//! otherwise (the boot-time clock restarted with the host). Across a reboot a
//! wall clock that stepped back can make that time too short, so no grace
//! and no restored lease ever lasts more than [`MAX_GRACE`] (the longest
//! lease + 5 s) from the restart.
//!
//! `CLOCK_BOOTTIME` is read with the raw system call: a time-faking
//! `LD_PRELOAD` (libfaketime) moves the C library's boot-time clock with the
//! wall clock, which is exactly the step this must not see.
//!
//! # File format, version 2
//!
//! The ASCII line `kunci-state 2\n`, then, big-endian:
//!
//! | field | type | meaning |
//! |---|---|---|
//! | kind | u8 | 1 = written while running, 2 = written at a clean stop |
//! | boot id length | u8 | 0 when the kernel gave none |
//! | boot id | bytes | `/proc/sys/kernel/random/boot_id` |
//! | written boot ms | u64 | `CLOCK_BOOTTIME` at the write |
//! | written wall ms | u64 | Unix time at the write |
//! | token high-water mark | u64 | no token ≥ it was issued |
//! | horizon | u32 | ms after the write; 0 = no lease outstanding |
//! | grant count | u64 | 0 unless kind = 2 |
//! | grants | … | each: token u64, owner u64, lease ms left u32, key length u8, key |
//! | checksum | u64 | FNV-1a 64 of every byte before it |
//!
//! Version 1 (one text line `kunci-state 1 token_high_water=N
//! lease_horizon_ms=WALL_MS`) is still read: its horizon is wall-clock time,
//! capped at [`MAX_GRACE`] from the restart.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use log::info;

use crate::core::{Core, Micros};

/// Tokens reserved per write of the high-water mark.
pub const TOKEN_BLOCK: u64 = 1 << 26;
/// How far past the latest lease deadline the horizon is pushed per write:
/// the most the grace after a crash can exceed the longest outstanding
/// lease, and the least time between two writes under steady grants.
pub const HORIZON_STEP: Duration = Duration::from_secs(5);
/// No grace after a restart, and no restored lease, lasts longer than the
/// longest lease plus [`HORIZON_STEP`], whatever the clocks say.
pub const MAX_GRACE: Duration = Duration::from_secs(255 + 5);
/// The format this build writes.
pub const FORMAT_VERSION: u32 = 2;

/// The file name inside the state directory.
pub const STATE_FILE: &str = "kunci.state";
const LOCK_FILE: &str = "kunci.lock";
const KIND_RUNNING: u8 = 1;
const KIND_CLEAN_STOP: u8 = 2;
const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The clocks a restart is measured on, read at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Clocks {
    /// The kernel's boot id; empty when unknown.
    pub boot_id: Vec<u8>,
    /// `CLOCK_BOOTTIME`, ms.
    pub boot_ms: u64,
    /// Unix time, ms.
    pub wall_ms: u64,
}

impl Clocks {
    /// Reads the clocks now.
    pub fn now() -> Clocks {
        let boot_id = fs::read(BOOT_ID_PATH)
            .map(|mut id| {
                id.retain(|byte| !byte.is_ascii_whitespace());
                id.truncate(u8::MAX as usize);
                id
            })
            .unwrap_or_default();
        Clocks {
            boot_id,
            boot_ms: boot_time_ms(),
            wall_ms: wall_clock_ms(),
        }
    }

    /// Milliseconds since the moment `written` was read, measured on the
    /// boot-time clock within one boot and on the wall clock across a
    /// reboot (0 when the wall clock says the write is in the future).
    pub fn since(&self, written: &Clocks) -> u64 {
        let same_boot = !self.boot_id.is_empty() && self.boot_id == written.boot_id;
        if same_boot {
            self.boot_ms.saturating_sub(written.boot_ms)
        } else {
            self.wall_ms.saturating_sub(written.wall_ms)
        }
    }

    /// These clocks `ms` later.
    fn plus(&self, ms: u64) -> Clocks {
        Clocks {
            boot_id: self.boot_id.clone(),
            boot_ms: self.boot_ms + ms,
            wall_ms: self.wall_ms + ms,
        }
    }
}

/// `CLOCK_BOOTTIME` in ms, by the raw system call (see the module docs).
fn boot_time_ms() -> u64 {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    let result = unsafe {
        libc::syscall(
            libc::SYS_clock_gettime,
            libc::CLOCK_BOOTTIME,
            &mut time as *mut libc::timespec,
        )
    };
    if result != 0 {
        return 0;
    }
    time.tv_sec as u64 * 1_000 + time.tv_nsec as u64 / 1_000_000
}

fn micros(duration: Duration) -> Micros {
    duration.as_micros() as Micros
}

/// Milliseconds since the Unix epoch, by the wall clock.
pub fn wall_clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
}

/// One grant held at a clean stop, as written and as read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedGrant<'a> {
    pub key: &'a str,
    pub token: u64,
    pub owner: u64,
    /// Lease time left at the write, ms.
    pub left_ms: u32,
}

/// What the previous run left behind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// The format version the file was written in (0: no file).
    pub version: u32,
    /// Whether the previous run stopped cleanly (its grants are listed).
    pub clean_stop: bool,
    /// When the file was written.
    pub written: Clocks,
    pub token_high_water: u64,
    /// ms after the write until which a lease of that run may still run.
    pub horizon_ms: u64,
    /// How many grants `grant_bytes` holds.
    grant_count: u64,
    /// The grants held at a clean stop, validated, in their file encoding:
    /// a million grants are read without a million allocations.
    grant_bytes: Vec<u8>,
}

/// What the previous run means for this one, at the moment `now`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Restart {
    /// Every key without a restored grant counts as held for this long.
    pub grace: Duration,
    /// The time since the file was written, ms.
    since_ms: u64,
}

impl Restart {
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
}

impl Recorded {
    /// A record as this build writes it, without grants (see
    /// [`set_grants`](Self::set_grants)).
    pub fn new(clean_stop: bool, written: Clocks, token_high_water: u64, horizon_ms: u64) -> Self {
        Recorded {
            version: FORMAT_VERSION,
            clean_stop,
            written,
            token_high_water,
            horizon_ms,
            ..Recorded::default()
        }
    }

    /// The grace and the time since the write, at `now`: the downtime
    /// counts against every lease, never for it, and nothing lasts longer
    /// than [`MAX_GRACE`].
    pub fn restart_at(&self, now: &Clocks) -> Restart {
        let since_ms = now.since(&self.written);
        let cap = MAX_GRACE.as_millis() as u64;
        let grace = self.horizon_ms.saturating_sub(since_ms).min(cap);
        Restart {
            grace: Duration::from_millis(grace),
            since_ms,
        }
    }

    /// How many grants were listed.
    pub fn grant_count(&self) -> u64 {
        self.grant_count
    }

    /// The grants listed at a clean stop.
    pub fn grants(&self) -> impl Iterator<Item = SavedGrant<'_>> + '_ {
        let mut reader = Reader {
            bytes: &self.grant_bytes,
            at: 0,
        };
        // Validated when read: decoding cannot fail here.
        (0..self.grant_count).map_while(move |index| decode_grant(&mut reader, index).ok())
    }

    /// Replaces the listed grants (a clean stop's, for tests and tools).
    pub fn set_grants<'a>(&mut self, grants: impl IntoIterator<Item = SavedGrant<'a>>) {
        self.grant_bytes.clear();
        self.grant_count = 0;
        for grant in grants {
            encode_grant(&mut self.grant_bytes, &grant);
            self.grant_count += 1;
        }
    }
}

fn encode_grant(out: &mut Vec<u8>, grant: &SavedGrant<'_>) {
    out.extend_from_slice(&grant.token.to_be_bytes());
    out.extend_from_slice(&grant.owner.to_be_bytes());
    out.extend_from_slice(&grant.left_ms.to_be_bytes());
    out.push(grant.key.len() as u8);
    out.extend_from_slice(grant.key.as_bytes());
}

/// Reads grant number `index`, checking everything but its token's range.
fn decode_grant<'a>(reader: &mut Reader<'a>, index: u64) -> Result<SavedGrant<'a>, String> {
    let token = reader.u64("grant token")?;
    let owner = reader.u64("grant owner")?;
    let left_ms = reader.u32("grant lease")?;
    let key_len = reader.u8("grant key length")?;
    let key = reader.take(key_len.into(), "grant key")?;
    let key = std::str::from_utf8(key).map_err(|_| format!("grant {index}: key not UTF-8"))?;
    if key.is_empty() || key.contains('\n') {
        return Err(format!("grant {index}: invalid key {key:?}"));
    }
    Ok(SavedGrant {
        key,
        token,
        owner,
        left_ms,
    })
}

/// An open, locked state directory.
pub struct StateDir {
    dir: PathBuf,
    /// Held for its `flock`: one server per directory.
    _lock: File,
    recorded: Recorded,
    /// The clocks at the instant the event loop calls 0 (see
    /// [`anchor`](Self::anchor)).
    anchor: Clocks,
    /// What the file on disk promises while this run runs, in the event
    /// loop's µs: tokens below `covered_token` and leases up to
    /// `covered_horizon`. `None` until the first write of this run.
    covered: Option<(u64, u64)>,
    /// Writes of the file by this run (each: two fsyncs).
    pub writes: u64,
}

/// A state-directory problem, phrased for the operator: "state dir PATH:
/// what is wrong". Carried inside an `io::Error` so that callers can tell
/// it from a listening problem.
#[derive(Debug)]
pub struct StateDirError(String);

impl std::fmt::Display for StateDirError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StateDirError {}

/// Whether `error` is a state-directory problem.
pub fn is_state_dir_error(error: &io::Error) -> bool {
    error
        .get_ref()
        .is_some_and(|inner| inner.is::<StateDirError>())
}

fn state_error(dir: &Path, what: impl std::fmt::Display) -> io::Error {
    io::Error::other(StateDirError(format!(
        "state dir {}: {what}",
        dir.display()
    )))
}

impl StateDir {
    /// Opens (creating) `dir`, takes its lock, and reads what the previous
    /// run recorded. A file that cannot be read exactly is an error that
    /// names it and what is wrong, never a silent fresh start.
    pub fn open(dir: &Path) -> io::Result<StateDir> {
        fs::create_dir_all(dir).map_err(|e| state_error(dir, format!("cannot create: {e}")))?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(LOCK_FILE))
            .map_err(|e| state_error(dir, format!("cannot open {LOCK_FILE}: {e}")))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(state_error(
                dir,
                "another kunci server uses this state directory",
            ));
        }
        let path = dir.join(STATE_FILE);
        let recorded = match fs::read(&path) {
            Ok(bytes) => parse(&bytes, &Clocks::now())
                .map_err(|what| state_error(dir, format!("{}: {what}", path.display())))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Recorded::default(),
            Err(e) => return Err(state_error(dir, format!("{}: {e}", path.display()))),
        };
        Ok(StateDir {
            dir: dir.to_owned(),
            _lock: lock,
            recorded,
            anchor: Clocks::default(),
            covered: None,
            writes: 0,
        })
    }

    /// No token at or above this was issued by an earlier run.
    pub fn token_high_water(&self) -> u64 {
        self.recorded.token_high_water
    }

    /// What the previous run left (taken: the grants can be large).
    pub fn take_recorded(&mut self) -> Recorded {
        std::mem::take(&mut self.recorded)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Fixes the clocks at the event loop's instant 0. Read them *after*
    /// taking that instant: the mapping then places every deadline at or
    /// after its true moment, never before.
    pub fn anchor(&mut self, clocks: Clocks) {
        self.anchor = clocks;
    }

    /// Brings the previous run's state into `core`, whose clock reads 0
    /// now: restores the grants of a clean stop (less the downtime), sets
    /// the grace of an unclean one, and replaces the file with one that
    /// describes this run — so a crash from here on never restores those
    /// grants again. Call before accepting any connection.
    pub fn resume(&mut self, core: &mut Core) -> io::Result<()> {
        let started = Instant::now();
        let clocks = Clocks::now();
        self.anchor(clocks.clone());
        let recorded = self.take_recorded();
        let (version, clean_stop) = (recorded.version, recorded.clean_stop);
        let restart = recorded.restart_at(&clocks);
        let mut restored = 0;
        for grant in recorded.grants() {
            let Some(left) = restart.lease_left(grant.left_ms) else {
                continue;
            };
            restored += 1;
            let key = grant.key;
            core.restore_grant(key, grant.token, grant.owner, micros(left))
                .map_err(|e| {
                    state_error(
                        &self.dir,
                        format!(
                            "{}: grant of {key:?}: {e}",
                            self.dir.join(STATE_FILE).display()
                        ),
                    )
                })?;
        }
        if !restart.grace.is_zero() {
            // The clocks are read in whole ms after the core's instant 0:
            // one more ms keeps the grace from ending early.
            core.set_grace_until(micros(restart.grace) + 1_000);
            info!(
                "state: the previous run stopped uncleanly; its leases may last {:.1} s more: \
                 until then a key counts as held unless its holder renews or releases it",
                restart.grace.as_secs_f64()
            );
        }
        if clean_stop {
            info!(
                "state: restored {restored} grants of the previous run ({} expired while it was \
                 down) in {:.0} ms",
                recorded.grant_count() - restored,
                started.elapsed().as_secs_f64() * 1e3
            );
        } else if version == 1 {
            info!("state: read a version 1 file; writing version {FORMAT_VERSION}");
        }
        self.cover(
            core.next_token(),
            core.lease_deadline_max(),
            core.grace_until(),
            0,
        )
        .map_err(|e| state_error(&self.dir, format!("cannot write: {e}")))?;
        Ok(())
    }

    /// Records the clean stop of `core` at `now`: its held grants, its next
    /// token, and what remains of its own grace.
    pub fn save_clean_stop(&mut self, core: &Core, now: Micros) -> io::Result<()> {
        let live = |deadline: Micros| deadline > now;
        let count = core.grants().filter(|grant| live(grant.deadline)).count();
        let per_key = core.grants().count();
        if core.grants_held() > per_key {
            // The file holds one grant per key; permits (spec §7.4) are
            // still to come. See `Core::grants`.
            log::warn!(
                "clean stop: {} grants on keys with a limit not saved: each such key is \
                 saved held by its grant whose lease runs out last; the others get N \
                 on renewal",
                core.grants_held() - per_key
            );
        }
        let max_left = MAX_GRACE.as_millis() as u64;
        let mut grants = core
            .grants()
            .filter(|grant| live(grant.deadline))
            .map(|grant| SavedGrant {
                key: grant.key,
                token: grant.token,
                owner: grant.owner,
                // Rounded down: the lease never grows across the restart.
                left_ms: ((grant.deadline - now) / 1_000).min(max_left) as u32,
            });
        let grace = core.grace_until();
        let horizon = if grace > now { grace } else { 0 };
        self.record_clean_stop(core.next_token(), horizon, now, count, &mut grants)
    }

    /// Makes sure the file covers every token below `next_token`, every
    /// lease ending by `lease_deadline` and the grace to `grace_until` (µs
    /// of the event loop; 0 = none), writing it if not. `now` is the event
    /// loop's time. Returns whether it wrote.
    pub fn cover(
        &mut self,
        next_token: u64,
        lease_deadline: u64,
        grace_until: u64,
        now: u64,
    ) -> io::Result<bool> {
        let (covered_token, covered_horizon) = self.covered.unwrap_or((0, 0));
        let wanted_token = if next_token > covered_token || self.covered.is_none() {
            next_token.saturating_add(TOKEN_BLOCK)
        } else {
            covered_token
        };
        // A lease deadline past the horizon moves it HORIZON_STEP beyond
        // that deadline; the grace inherited from an earlier run is kept as
        // it is, not stepped, so crash after crash never lengthens it.
        let wanted_horizon = if lease_deadline.max(grace_until) > covered_horizon {
            (lease_deadline + HORIZON_STEP.as_micros() as u64).max(grace_until)
        } else {
            covered_horizon
        };
        if self.covered == Some((wanted_token, wanted_horizon)) {
            return Ok(false);
        }
        let at = self.anchor.plus(now.div_ceil(1_000));
        let horizon_ms = wanted_horizon.saturating_sub(now).div_ceil(1_000);
        self.write(
            KIND_RUNNING,
            &at,
            wanted_token,
            horizon_ms,
            0,
            &mut std::iter::empty(),
        )?;
        self.covered = Some((wanted_token, wanted_horizon));
        Ok(true)
    }

    /// Records a clean stop at `now`: tokens from `next_token` on were never
    /// issued; the `count` `grants` were held; keys without a grant may
    /// still be held by an earlier run's lease until `horizon` (0 = none).
    pub fn record_clean_stop<'a>(
        &mut self,
        next_token: u64,
        horizon: u64,
        now: u64,
        count: usize,
        grants: &mut dyn Iterator<Item = SavedGrant<'a>>,
    ) -> io::Result<()> {
        let at = self.anchor.plus(now.div_ceil(1_000));
        let horizon_ms = horizon.saturating_sub(now).div_ceil(1_000);
        self.write(KIND_CLEAN_STOP, &at, next_token, horizon_ms, count, grants)
    }

    /// Replaces the file atomically and durably: write a temporary file,
    /// fsync it, rename it over the old one, fsync the directory.
    fn write<'a>(
        &mut self,
        kind: u8,
        at: &Clocks,
        token_high_water: u64,
        horizon_ms: u64,
        count: usize,
        grants: &mut dyn Iterator<Item = SavedGrant<'a>>,
    ) -> io::Result<()> {
        let temporary = self.dir.join(format!("{STATE_FILE}.tmp"));
        let file = File::create(&temporary)?;
        let mut out = ChecksumWriter::new(BufWriter::with_capacity(1 << 20, file));
        write_header(&mut out, kind, at, token_high_water, horizon_ms)?;
        out.write_all(&(count as u64).to_be_bytes())?;
        let mut written = 0;
        let mut encoded = Vec::with_capacity(64);
        for grant in grants {
            written += 1;
            encoded.clear();
            encode_grant(&mut encoded, &grant);
            out.write_all(&encoded)?;
        }
        if written != count {
            return Err(io::Error::other(format!(
                "{written} grants listed for a count of {count}"
            )));
        }
        let checksum = out.hash;
        let mut inner = out.inner;
        inner.write_all(&checksum.to_be_bytes())?;
        let file = inner.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        fs::rename(&temporary, self.dir.join(STATE_FILE))?;
        File::open(&self.dir)?.sync_all()?;
        self.writes += 1;
        Ok(())
    }
}

fn write_header(
    out: &mut impl Write,
    kind: u8,
    at: &Clocks,
    token_high_water: u64,
    horizon_ms: u64,
) -> io::Result<()> {
    writeln!(out, "kunci-state {FORMAT_VERSION}")?;
    out.write_all(&[kind, at.boot_id.len() as u8])?;
    out.write_all(&at.boot_id)?;
    out.write_all(&at.boot_ms.to_be_bytes())?;
    out.write_all(&at.wall_ms.to_be_bytes())?;
    out.write_all(&token_high_water.to_be_bytes())?;
    let horizon = u32::try_from(horizon_ms).unwrap_or(u32::MAX);
    out.write_all(&horizon.to_be_bytes())
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Hashes what passes through it.
struct ChecksumWriter<W> {
    inner: W,
    hash: u64,
}

impl<W: Write> ChecksumWriter<W> {
    fn new(inner: W) -> Self {
        ChecksumWriter {
            inner,
            hash: FNV_OFFSET,
        }
    }
}

impl<W: Write> Write for ChecksumWriter<W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let written = self.inner.write(bytes)?;
        self.hash = fnv1a(self.hash, &bytes[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Reads fields off the file, naming what is missing when it ends early.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!(
                "truncated: ends at byte {} inside the {what}",
                self.bytes.len()
            ));
        };
        let field = &self.bytes[self.at..end];
        self.at = end;
        Ok(field)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let mut field = [0; 4];
        field.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_be_bytes(field))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let mut field = [0; 8];
        field.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_be_bytes(field))
    }
}

/// Parses a state file of any version this build knows. `now` stands in
/// for the write time of a version-1 file, which did not record it.
pub fn parse(bytes: &[u8], now: &Clocks) -> Result<Recorded, String> {
    const PREFIX: &[u8] = b"kunci-state ";
    if bytes.is_empty() {
        return Err("empty file (truncated?)".into());
    }
    if PREFIX.starts_with(bytes) {
        return Err(format!("truncated: {} bytes", bytes.len()));
    }
    if !bytes.starts_with(PREFIX) {
        return Err("not a kunci state file (it does not start with \"kunci-state \")".into());
    }
    let rest = &bytes[PREFIX.len()..];
    let end = rest
        .iter()
        .position(|&byte| byte == b' ' || byte == b'\n')
        .ok_or("truncated: the version is not terminated")?;
    let version = std::str::from_utf8(&rest[..end])
        .ok()
        .and_then(|text| text.parse::<u32>().ok())
        .ok_or("unreadable format version")?;
    match version {
        1 => parse_v1(bytes, now),
        2 => parse_v2(bytes),
        _ => Err(format!(
            "format version {version} was written by a newer kunci; this build reads \
             versions 1 to {FORMAT_VERSION} (run the newer build, or remove the file \
             after making sure no lease of the old run can still be running)"
        )),
    }
}

fn parse_v1(bytes: &[u8], now: &Clocks) -> Result<Recorded, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "version 1: not text")?;
    if !text.ends_with('\n') {
        return Err("version 1: truncated (no end of line)".into());
    }
    let mut recorded = Recorded {
        version: 1,
        // Version 1 kept no boot id: its wall-clock horizon is measured
        // against the wall clock now, capped like any grace.
        written: Clocks {
            boot_id: Vec::new(),
            ..now.clone()
        },
        ..Recorded::default()
    };
    let mut seen = 0;
    for field in text.split_whitespace().skip(2) {
        let (name, value) = field
            .split_once('=')
            .ok_or_else(|| format!("version 1: unreadable field {field:?}"))?;
        let value: u64 = value
            .parse()
            .map_err(|_| format!("version 1: unreadable number in {field:?}"))?;
        match name {
            "token_high_water" => recorded.token_high_water = value,
            "lease_horizon_ms" => recorded.horizon_ms = value.saturating_sub(now.wall_ms),
            _ => continue,
        }
        seen += 1;
    }
    if seen != 2 {
        return Err("version 1: token_high_water or lease_horizon_ms missing".into());
    }
    Ok(recorded)
}

fn parse_v2(bytes: &[u8]) -> Result<Recorded, String> {
    if bytes.len() < 8 {
        return Err("truncated: shorter than its checksum".into());
    }
    let (body, checksum) = bytes.split_at(bytes.len() - 8);
    let mut expected = [0; 8];
    expected.copy_from_slice(checksum);
    let mut reader = Reader {
        bytes: body,
        at: "kunci-state 2\n".len(),
    };
    if !body.starts_with(b"kunci-state 2\n") {
        return Err("truncated or damaged: bad first line".into());
    }
    if fnv1a(FNV_OFFSET, body) != u64::from_be_bytes(expected) {
        return Err(format!(
            "checksum mismatch: the file ({} bytes) is truncated or damaged",
            bytes.len()
        ));
    }
    let kind = reader.u8("kind")?;
    if kind != KIND_RUNNING && kind != KIND_CLEAN_STOP {
        return Err(format!("unknown kind {kind}"));
    }
    let boot_id_len = reader.u8("boot id length")?;
    let boot_id = reader.take(boot_id_len.into(), "boot id")?.to_vec();
    let written = Clocks {
        boot_id,
        boot_ms: reader.u64("boot time")?,
        wall_ms: reader.u64("wall time")?,
    };
    let token_high_water = reader.u64("token high-water mark")?;
    let horizon_ms = u64::from(reader.u32("horizon")?);
    let count = reader.u64("grant count")?;
    if kind == KIND_RUNNING && count != 0 {
        return Err(format!("{count} grants in a file written while running"));
    }
    // Each grant takes at least 22 bytes: a count beyond that is damage,
    // not a reason to reserve memory.
    let room = (body.len() - reader.at) / 22;
    if count > room as u64 {
        return Err(format!("{count} grants listed, room for at most {room}"));
    }
    // A key listed twice is caught when the grants are restored.
    let grants_start = reader.at;
    for index in 0..count {
        let grant = decode_grant(&mut reader, index)?;
        if grant.token == 0 || grant.token >= token_high_water {
            return Err(format!(
                "grant {index} ({:?}): token {} not in 1..{token_high_water}",
                grant.key, grant.token
            ));
        }
    }
    if reader.at != body.len() {
        return Err(format!(
            "{} unexpected bytes after the grants",
            body.len() - reader.at
        ));
    }
    Ok(Recorded {
        version: 2,
        clean_stop: kind == KIND_CLEAN_STOP,
        written,
        token_high_water,
        horizon_ms,
        grant_count: count,
        grant_bytes: body[grants_start..reader.at].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kunci-state-unit-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn clocks(boot_id: &str, boot_ms: u64, wall_ms: u64) -> Clocks {
        Clocks {
            boot_id: boot_id.as_bytes().to_vec(),
            boot_ms,
            wall_ms,
        }
    }

    #[test]
    fn cover_writes_in_steps_and_survives_reopen() {
        let dir = temp_dir("cover");
        {
            let mut state = StateDir::open(&dir).unwrap();
            assert_eq!(state.take_recorded(), Recorded::default());
            state.anchor(clocks("boot-a", 1_000_000, 50_000_000));
            // The first call always writes: it replaces the last run's file.
            assert!(state.cover(100, 0, 0, 0).unwrap());
            assert!(!state.cover(100, 0, 0, 10).unwrap());
            // A lease to 5 s: the horizon goes to 10 s.
            assert!(state.cover(100, 5_000_000, 0, 1_000).unwrap());
            assert!(!state.cover(100, 10_000_000, 0, 2_000).unwrap());
            assert!(state.cover(100, 10_000_001, 0, 2_000).unwrap());
            assert!(!state.cover(100 + TOKEN_BLOCK, 0, 0, 2_000).unwrap());
            assert!(state.cover(101 + TOKEN_BLOCK, 0, 0, 2_000).unwrap());
            // An inherited grace is kept exactly, not stepped.
            assert!(
                state
                    .cover(101 + TOKEN_BLOCK, 0, 20_000_000, 2_000)
                    .unwrap()
            );
            assert_eq!(state.writes, 5);
            assert!(StateDir::open(&dir).is_err(), "second server got the lock");
        }
        let mut state = StateDir::open(&dir).unwrap();
        let recorded = state.take_recorded();
        assert_eq!(recorded.version, 2);
        assert!(!recorded.clean_stop);
        assert_eq!(recorded.token_high_water, 101 + 2 * TOKEN_BLOCK);
        // Written at 2 ms (rounded up from 2,000 µs), horizon at 20 s.
        assert_eq!(recorded.written, clocks("boot-a", 1_000_002, 50_000_002));
        assert_eq!(recorded.horizon_ms, 19_998);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_clean_stop_lists_its_grants_and_the_downtime_counts_against_them() {
        let dir = temp_dir("clean");
        {
            let mut state = StateDir::open(&dir).unwrap();
            state.anchor(clocks("boot-a", 1_000_000, 50_000_000));
            let grants = [
                SavedGrant {
                    key: "short",
                    token: 7,
                    owner: 70,
                    left_ms: 1_000,
                },
                SavedGrant {
                    key: "lång/ключ",
                    token: 8,
                    owner: 80,
                    left_ms: 30_000,
                },
            ];
            state
                .record_clean_stop(9, 0, 5_000_000, 2, &mut grants.into_iter())
                .unwrap();
        }
        let mut state = StateDir::open(&dir).unwrap();
        let recorded = state.take_recorded();
        assert!(recorded.clean_stop);
        assert_eq!(recorded.token_high_water, 9);
        assert_eq!(recorded.written, clocks("boot-a", 1_005_000, 50_005_000));
        // 2.5 s later by the boot-time clock, whatever the wall clock says
        // (less one ms for the whole-ms clock readings).
        let restart = recorded.restart_at(&clocks("boot-a", 1_007_500, 1));
        assert_eq!(restart.grace, Duration::ZERO);
        let restored: Vec<(&str, u64, u64, Option<Duration>)> = recorded
            .grants()
            .map(|grant| {
                let left = restart.lease_left(grant.left_ms);
                (grant.key, grant.token, grant.owner, left)
            })
            .collect();
        assert_eq!(
            restored,
            vec![
                ("short", 7, 70, None),
                ("lång/ключ", 8, 80, Some(Duration::from_millis(27_499)))
            ]
        );
        let _ = fs::remove_dir_all(&dir);
    }

    fn recorded_with_horizon(horizon_ms: u64) -> Recorded {
        Recorded {
            version: 2,
            written: clocks("boot-a", 1_000_000, 50_000_000),
            token_high_water: 10,
            horizon_ms,
            ..Recorded::default()
        }
    }

    #[test]
    fn within_one_boot_the_grace_ignores_wall_clock_steps() {
        let recorded = recorded_with_horizon(6_000);
        for wall_step in [-3_600_000i64, 0, 3_600_000] {
            let wall = (50_001_000 + wall_step) as u64;
            let restart = recorded.restart_at(&clocks("boot-a", 1_001_000, wall));
            assert_eq!(restart.grace, Duration::from_millis(5_000), "{wall_step}");
        }
    }

    #[test]
    fn across_a_reboot_the_wall_clock_counts_but_never_past_the_longest_lease() {
        let recorded = recorded_with_horizon(6_000);
        let after_reboot = |wall| {
            recorded
                .clone()
                .restart_at(&clocks("boot-b", 5, wall))
                .grace
        };
        assert_eq!(after_reboot(50_002_000), Duration::from_millis(4_000));
        assert_eq!(after_reboot(50_010_000), Duration::ZERO);
        // A wall clock stepped back an hour: at most the longest lease + 5 s.
        assert_eq!(
            after_reboot(50_000_000 - 3_600_000),
            Duration::from_millis(6_000)
        );
        let far = recorded_with_horizon(u32::MAX.into());
        assert_eq!(far.restart_at(&clocks("boot-b", 5, 0)).grace, MAX_GRACE);
        // An unknown boot id is never the same boot.
        let unknown = Recorded {
            written: clocks("", 1_000_000, 50_000_000),
            ..recorded_with_horizon(6_000)
        };
        assert_eq!(
            unknown.restart_at(&clocks("", 1_001_000, 50_003_000)).grace,
            Duration::from_millis(3_000)
        );
    }

    #[test]
    fn version_1_is_read_with_its_wall_clock_horizon_capped() {
        let now = clocks("boot-a", 1_000, 50_000_000);
        let text = b"kunci-state 1 token_high_water=77 lease_horizon_ms=50004000\n";
        let recorded = parse(text, &now).unwrap();
        assert_eq!(recorded.version, 1);
        assert_eq!(recorded.token_high_water, 77);
        assert_eq!(
            recorded.restart_at(&now).grace,
            Duration::from_millis(4_000)
        );
        let stepped = b"kunci-state 1 token_high_water=77 lease_horizon_ms=53661000\n";
        assert_eq!(
            parse(stepped, &now).unwrap().restart_at(&now).grace,
            MAX_GRACE
        );
    }

    #[test]
    fn every_damaged_file_is_refused_with_what_is_wrong() {
        let dir = temp_dir("damaged");
        {
            let mut state = StateDir::open(&dir).unwrap();
            state.anchor(clocks("boot-a", 1_000, 2_000));
            let grant = SavedGrant {
                key: "k",
                token: 3,
                owner: 4,
                left_ms: 5,
            };
            state
                .record_clean_stop(9, 0, 0, 1, &mut std::iter::once(grant))
                .unwrap();
        }
        let good = fs::read(dir.join(STATE_FILE)).unwrap();
        let now = Clocks::now();
        assert!(parse(&good, &now).is_ok());
        for cut in 0..good.len() {
            let error = parse(&good[..cut], &now).unwrap_err();
            assert!(
                error.contains("truncated")
                    || error.contains("empty")
                    || error.contains("checksum"),
                "cut at {cut}: {error}"
            );
        }
        for flip in 0..good.len() {
            let mut damaged = good.clone();
            damaged[flip] ^= 0x40;
            assert!(parse(&damaged, &now).is_err(), "flip at {flip} accepted");
        }
        let newer = b"kunci-state 3\nwhatever";
        assert!(parse(newer, &now).unwrap_err().contains("newer kunci"));
        let junk = b"hello";
        assert!(
            parse(junk, &now)
                .unwrap_err()
                .contains("not a kunci state file")
        );
        // Through `open`: the error names the state dir and the file.
        fs::write(dir.join(STATE_FILE), &good[..good.len() - 3]).unwrap();
        let message = StateDir::open(&dir).err().unwrap().to_string();
        assert!(message.starts_with("state dir "), "{message}");
        assert!(message.contains(STATE_FILE), "{message}");
        let _ = fs::remove_dir_all(&dir);
    }
}
