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
//! This module is the file format and the file IO only. What to promise
//! and when, what a clean stop keeps, and what the next run makes of it
//! (the grace, the leases left) is policy, in [`crate::core::restart`]:
//! the endpoint yields a [`Promise`] that must be durable before anything
//! else is transmitted, and the shell writes it here
//! ([`StateDir::write_running`]: two fsyncs, the file and the directory).
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
//! `CLOCK_BOOTTIME` is read past the C library (rustix's vDSO call): a time-faking
//! `LD_PRELOAD` (libfaketime) moves the C library's boot-time clock with the
//! wall clock, which is exactly the step this must not see.
//!
//! # The adoption secret
//!
//! `adoption.key` (0600) holds the 16 random bytes this server binds its
//! tokens to their keys with (spec §7.3 v5, [`crate::core::token_binding`]):
//! written and fsynced once, when the directory has none, before the
//! first token is shown; never rewritten and never logged. Back it up with
//! the directory: without it the next crash grace adopts nothing.
//!
//! # File format, version 5
//!
//! The ASCII line `kunci-state 5\n`, then, big-endian:
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
//! | flags | u8 | bit 0: a lease up to the horizon may be a counted grant (`take` ≥ 1, spec §7.4); other bits 0 |
//! | macs until | u64 | the last token that may carry its key's MAC (spec §7.3 v5); 0 = none |
//! | grant count | u64 | 0 unless kind = 2 |
//! | grants | … | each: token u64, owner u64, lease ms left u32, ms held u32, take u16, key's limit u16, key length u8, key, label length u8, label |
//! | checksum | u64 | FNV-1a 64 of every byte before it |
//!
//! Version 4 is the same without `macs until`: after it a crash grace
//! adopts nothing (every try is `N`); it is still read.
//!
//! Version 3 is the same as 4 without the ms held (spec §7.5): its grants come
//! back held since the restart; it is still read.
//!
//! Version 2 is the same as 3 without the flags byte and with grants of token,
//! owner, lease ms left, key length and key only (every grant exclusive,
//! no limit, no label); it is still read.
//!
//! Version 1 (one text line `kunci-state 1 token_high_water=N
//! lease_horizon_ms=WALL_MS`) is still read: its horizon is wall-clock time,
//! capped at [`MAX_GRACE`] from the restart.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use log::info;

pub use crate::core::restart::{
    CleanStop, HORIZON_STEP, MAX_GRACE, Promise, Restart, SavedGrant, TOKEN_BLOCK,
};
use crate::core::token_binding::{SECRET_BYTES, TokenBinding};
use crate::core::{Core, Micros};
/// The format this build writes.
pub const FORMAT_VERSION: u32 = 5;

/// The file name inside the state directory.
pub const STATE_FILE: &str = "kunci.state";
const LOCK_FILE: &str = "kunci.lock";
/// The secret tokens are bound to their keys with (see the module docs).
pub const SECRET_FILE: &str = "adoption.key";
const KIND_RUNNING: u8 = 1;
const KIND_CLEAN_STOP: u8 = 2;
/// Flags bit: a lease up to the horizon may be a counted grant.
const FLAG_COUNTED_GRANTS: u8 = 1;
/// The longest label a grant carries (spec §11.1).
const LABEL_MAX: usize = 128;
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

/// `CLOCK_BOOTTIME` in ms, read past the C library (see the module docs):
/// rustix calls the kernel's vDSO (or makes the system call) itself, so a
/// `clock_gettime` interposed by `LD_PRELOAD` never sees this read.
fn boot_time_ms() -> u64 {
    // The fallible form: a kernel without the clock gives 0, not a panic.
    let Ok(time) = rustix::time::clock_gettime_dynamic(rustix::time::DynamicClockId::Boottime)
    else {
        return 0;
    };
    time.tv_sec as u64 * 1_000 + time.tv_nsec as u64 / 1_000_000
}

/// Milliseconds since the Unix epoch, by the wall clock.
pub fn wall_clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
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
    /// Whether a lease up to the horizon may be a counted grant (spec
    /// §7.4): then no adoption may free a key before the horizon.
    pub counted_grants: bool,
    /// The last token that may carry its key's MAC (spec §7.3 v5): no
    /// token above it is adopted; 0 (formats 1 to 4) adopts none.
    pub macs_until: u64,
    /// How many grants `grant_bytes` holds.
    grant_count: u64,
    /// The grants held at a clean stop, validated, in their file encoding:
    /// a million grants are read without a million allocations.
    grant_bytes: Vec<u8>,
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

    /// The record [`StateDir::write_running`] writes for `promise` at
    /// `now` (µs of the event loop, whose instant 0 read `anchor`).
    pub fn running(anchor: &Clocks, promise: Promise, now: Micros) -> Self {
        Recorded::written_at(
            false,
            anchor,
            now,
            promise.token_high_water,
            promise.horizon,
            promise.counted_grants,
            promise.macs_until,
        )
    }

    /// The record [`StateDir::save_clean_stop`] writes for `stop` (µs of
    /// the event loop, whose instant 0 read `anchor`), its grants listed.
    pub fn clean_stop(anchor: &Clocks, stop: &CleanStop<'_>) -> Self {
        let mut recorded = Recorded::written_at(
            true,
            anchor,
            stop.now(),
            stop.next_token,
            stop.horizon,
            stop.counted_grants,
            stop.macs_until,
        );
        recorded.set_grants(stop.grants());
        recorded
    }

    /// The arithmetic every write shares, from the core's µs to the file's
    /// ms: the write is dated `now` rounded up (never before the true
    /// moment), and the horizon is the ms from then until `horizon`
    /// (0 = none), rounded up (never short of a lease).
    #[allow(clippy::too_many_arguments)]
    fn written_at(
        clean_stop: bool,
        anchor: &Clocks,
        now: Micros,
        token_high_water: u64,
        horizon: Micros,
        counted_grants: bool,
        macs_until: u64,
    ) -> Self {
        Recorded {
            counted_grants,
            macs_until,
            ..Recorded::new(
                clean_stop,
                anchor.plus(now.div_ceil(1_000)),
                token_high_water,
                horizon.saturating_sub(now).div_ceil(1_000),
            )
        }
    }

    /// What this record means for a run whose clocks read `now`: the time
    /// since the write is measured here (on the right clock), the policy
    /// is [`Restart::new`]'s.
    pub fn restart_at(&self, now: &Clocks) -> Restart {
        let mut restart = Restart::new(
            self.horizon_ms,
            now.since(&self.written),
            self.counted_grants,
        );
        restart.macs_until = self.macs_until;
        restart
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
        let version = self.version;
        // Validated when read: decoding cannot fail here.
        (0..self.grant_count).map_while(move |index| decode_grant(&mut reader, index, version).ok())
    }

    /// Replaces the listed grants (a clean stop's, for tests and tools);
    /// the record is then in this build's version.
    pub fn set_grants<'a>(&mut self, grants: impl IntoIterator<Item = SavedGrant<'a>>) {
        self.version = FORMAT_VERSION;
        self.grant_bytes.clear();
        self.grant_count = 0;
        for grant in grants {
            encode_grant(&mut self.grant_bytes, &grant);
            self.grant_count += 1;
        }
    }
}

/// Encodes `grant` in this build's version.
fn encode_grant(out: &mut Vec<u8>, grant: &SavedGrant<'_>) {
    out.extend_from_slice(&grant.token.to_be_bytes());
    out.extend_from_slice(&grant.owner.to_be_bytes());
    out.extend_from_slice(&grant.left_ms.to_be_bytes());
    out.extend_from_slice(&grant.held_ms.to_be_bytes());
    out.extend_from_slice(&grant.take.to_be_bytes());
    out.extend_from_slice(&grant.limit.to_be_bytes());
    out.push(grant.key.len() as u8);
    out.extend_from_slice(grant.key.as_bytes());
    out.push(grant.label.len() as u8);
    out.extend_from_slice(grant.label.as_bytes());
}

/// The fewest bytes a grant takes in `version` (a one-byte key, no label).
fn grant_size_min(version: u32) -> usize {
    match version {
        4.. => 31,
        3 => 27,
        _ => 22,
    }
}

/// Reads grant number `index` in `version`, checking everything but its
/// token's range.
fn decode_grant<'a>(
    reader: &mut Reader<'a>,
    index: u64,
    version: u32,
) -> Result<SavedGrant<'a>, String> {
    let token = reader.u64("grant token")?;
    let owner = reader.u64("grant owner")?;
    let left_ms = reader.u32("grant lease")?;
    let held_ms = if version >= 4 {
        reader.u32("grant time held")?
    } else {
        0
    };
    let (take, limit) = if version >= 3 {
        (reader.u16("grant take")?, reader.u16("grant limit")?)
    } else {
        (0, 0)
    };
    let key_len = reader.u8("grant key length")?;
    let key = reader.take(key_len.into(), "grant key")?;
    let key = std::str::from_utf8(key).map_err(|_| format!("grant {index}: key not UTF-8"))?;
    if key.is_empty() || key.contains('\n') {
        return Err(format!("grant {index}: invalid key {key:?}"));
    }
    let label = if version >= 3 {
        let label_len = reader.u8("grant label length")?;
        let label = reader.take(label_len.into(), "grant label")?;
        let label =
            std::str::from_utf8(label).map_err(|_| format!("grant {index}: label not UTF-8"))?;
        if label.len() > LABEL_MAX || label.contains('\n') {
            return Err(format!("grant {index}: invalid label {label:?}"));
        }
        label
    } else {
        ""
    };
    // Spec §10.1: a counted grant takes 1..=limit of its key's permits.
    if take != 0 && (limit == 0 || take > limit) {
        return Err(format!(
            "grant {index} ({key:?}): take {take} does not fit limit {limit}"
        ));
    }
    Ok(SavedGrant {
        key,
        token,
        owner,
        left_ms,
        take,
        limit,
        label,
        held_ms,
    })
}

/// An open, locked state directory.
pub struct StateDir {
    dir: PathBuf,
    /// Held for its `flock`: one server per directory.
    _lock: File,
    recorded: Recorded,
    /// What this server's tokens are bound to their keys with.
    binding: TokenBinding,
    /// The clocks at the instant the event loop calls 0 (see
    /// [`anchor`](Self::anchor)).
    anchor: Clocks,
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

/// Refuses a state directory that another user owns or that group or
/// others may write to: whoever can write it can replace the state file
/// and make this server hand out a token twice.
fn check_private(dir: &Path) -> io::Result<()> {
    let metadata = fs::metadata(dir)
        .map_err(|e| state_error(dir, format!("cannot read its metadata: {e}")))?;
    if !metadata.is_dir() {
        return Err(state_error(dir, "not a directory"));
    }
    let me = rustix::process::geteuid().as_raw();
    if metadata.uid() != me {
        return Err(state_error(
            dir,
            format!(
                "owned by uid {}, not by this server's uid {me}: refusing to use it",
                metadata.uid()
            ),
        ));
    }
    if metadata.mode() & 0o022 != 0 {
        return Err(state_error(
            dir,
            format!(
                "mode {:o} lets others write it: refusing to use it (chmod 700 it)",
                metadata.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Opens a file of the state directory as `options` say, created `0600`,
/// without following a symbolic link and without blocking on a FIFO; then
/// anything but a regular file is an error that says what it is.
fn open_private(path: &Path, options: &mut OpenOptions) -> io::Result<File> {
    let file = options
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} is a symbolic link: refusing to follow it",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })?;
    let file_type = file.metadata()?.file_type();
    if !file_type.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if file_type.is_fifo() {
            "a FIFO"
        } else if file_type.is_dir() {
            "a directory"
        } else if file_type.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is {what}, not a regular file", path.display()),
        ));
    }
    // Reads and writes block as on any file (O_NONBLOCK was only for the
    // open of a FIFO).
    rustix::fs::fcntl_setfl(&file, rustix::fs::OFlags::empty())?;
    Ok(file)
}

fn state_error(dir: &Path, what: impl std::fmt::Display) -> io::Error {
    io::Error::other(StateDirError(format!(
        "state dir {}: {what}",
        dir.display()
    )))
}

/// Reads the directory's adoption secret, or makes one (16 bytes of
/// `/dev/urandom`, written to a temporary file, fsynced, renamed, the
/// directory fsynced) when there is none; `true` when it was made now.
fn read_or_create_secret(dir: &Path) -> io::Result<([u8; SECRET_BYTES], bool)> {
    let path = dir.join(SECRET_FILE);
    let named = |e: io::Error| state_error(dir, format!("{}: {e}", path.display()));
    match open_private(&path, OpenOptions::new().read(true)) {
        Ok(mut file) => {
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes).map_err(named)?;
            let secret = <[u8; SECRET_BYTES]>::try_from(bytes.as_slice()).map_err(|_| {
                state_error(
                    dir,
                    format!(
                        "{}: {} bytes, not {SECRET_BYTES} (damaged: remove it after making \
                         sure no lease of the old run can still be running)",
                        path.display(),
                        bytes.len()
                    ),
                )
            })?;
            Ok((secret, false))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let mut secret = [0; SECRET_BYTES];
            File::open("/dev/urandom")
                .and_then(|mut random| random.read_exact(&mut secret))
                .map_err(|e| state_error(dir, format!("cannot read /dev/urandom: {e}")))?;
            let temporary = dir.join(format!("{SECRET_FILE}.tmp"));
            let mut file = open_private(
                &temporary,
                OpenOptions::new().create(true).write(true).truncate(true),
            )
            .map_err(named)?;
            file.write_all(&secret)
                .and_then(|()| file.sync_all())
                .and_then(|()| fs::rename(&temporary, &path))
                .and_then(|()| File::open(dir)?.sync_all())
                .map_err(|e| state_error(dir, format!("cannot write {}: {e}", path.display())))?;
            Ok((secret, true))
        }
        Err(e) => Err(named(e)),
    }
}

impl StateDir {
    /// Opens (creating) `dir`, takes its lock, and reads what the previous
    /// run recorded. A file that cannot be read exactly is an error that
    /// names it and what is wrong, never a silent fresh start.
    ///
    /// The directory holds every held key and label after a clean stop, so
    /// it is created `0700` and its files `0600`, whatever the umask; one
    /// owned by another user or writable by group or others is refused, as
    /// is a symbolic link or anything but a regular file where a file of
    /// ours belongs (a FIFO there is an error, not a hang).
    pub fn open(dir: &Path) -> io::Result<StateDir> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| state_error(dir, format!("cannot create: {e}")))?;
        check_private(dir)?;
        let lock = open_private(
            &dir.join(LOCK_FILE),
            OpenOptions::new().create(true).write(true),
        )
        .map_err(|e| state_error(dir, format!("{LOCK_FILE}: {e}")))?;
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
            return Err(state_error(
                dir,
                "another kunci server uses this state directory",
            ));
        }
        let path = dir.join(STATE_FILE);
        let recorded = match open_private(&path, OpenOptions::new().read(true)) {
            Ok(mut file) => {
                let mut bytes = Vec::new();
                file.read_to_end(&mut bytes)
                    .map_err(|e| state_error(dir, format!("{}: {e}", path.display())))?;
                parse(&bytes, &Clocks::now())
                    .and_then(|recorded| {
                        let high_water = recorded.token_high_water;
                        match crate::core::restart::implausible_high_water(
                            high_water,
                            wall_clock_ms(),
                        ) {
                            Some(why) => Err(why),
                            None => Ok(recorded),
                        }
                    })
                    .map_err(|what| state_error(dir, format!("{}: {what}", path.display())))?
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Recorded::default(),
            Err(e) => return Err(state_error(dir, format!("{}: {e}", path.display()))),
        };
        let mut recorded = recorded;
        let (secret, created) = read_or_create_secret(dir)?;
        if created {
            // Nothing earlier was bound with a secret made now.
            if recorded.macs_until != 0 {
                log::warn!(
                    "state dir {}: {SECRET_FILE} was missing: made a new one; the previous \
                     run's holders cannot adopt their keys after its crash (they get N; \
                     the keys stay held until its lease horizon)",
                    dir.display()
                );
            }
            recorded.macs_until = 0;
        }
        Ok(StateDir {
            dir: dir.to_owned(),
            _lock: lock,
            recorded,
            binding: TokenBinding::new(&secret),
            anchor: Clocks::default(),
            writes: 0,
        })
    }

    /// What this server binds its tokens to their keys with.
    pub fn binding(&self) -> &TokenBinding {
        &self.binding
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
    /// now, by [`Restart::resume`]'s policy: the grants of a clean stop
    /// (less the downtime) and the grace of an unclean one. The shell must
    /// then make the endpoint's first [`Promise`] durable before accepting
    /// a connection: that replaces the file with one that describes this
    /// run, so a crash from there on never restores those grants again.
    pub fn resume(&mut self, core: &mut Core) -> io::Result<()> {
        let started = Instant::now();
        let clocks = Clocks::now();
        self.anchor(clocks.clone());
        let recorded = self.take_recorded();
        let (version, clean_stop) = (recorded.version, recorded.clean_stop);
        core.bind_tokens(self.binding, clocks.wall_ms.saturating_mul(1 << 20));
        if !core.binds_tokens() {
            log::warn!(
                "state: tokens run more than 2^51 above the clock's (unix time ms × 2^20): \
                 this run issues them +1 apart, not bound to their keys; after a crash \
                 its holders cannot adopt their keys (docs/OPERATIONS.md, \"Restarts\")"
            );
        }
        let restart = recorded.restart_at(&clocks);
        let restored = restart.resume(core, recorded.grants()).map_err(|e| {
            state_error(
                &self.dir,
                format!("{}: {e}", self.dir.join(STATE_FILE).display()),
            )
        })?;
        if !restart.grace.is_zero() && restart.macs_until == 0 {
            info!(
                "state: the previous run left no adoption record (state file version \
                 {version}, or {SECRET_FILE} new): no holder can adopt its key during this \
                 grace; every key stays held until it ends"
            );
        }
        if !restart.grace.is_zero() {
            info!(
                "state: the previous run stopped uncleanly; its leases may last {} s more: \
                 until then a key counts as held unless its holder renews or releases it",
                crate::decimal::seconds(restart.grace, 1)
            );
        }
        if clean_stop {
            info!(
                "state: restored {} of the previous run ({} expired while it was down) in {} ms",
                super::counted(restored, "grant"),
                recorded.grant_count() - restored,
                crate::decimal::millis(started.elapsed(), 0)
            );
        } else if version == 1 {
            info!("state: read a version 1 file; writing version {FORMAT_VERSION}");
        }
        Ok(())
    }

    /// Makes `promise` durable: the file written while running, at `now`
    /// (µs of the event loop), promises it.
    pub fn write_running(&mut self, promise: Promise, now: Micros) -> io::Result<()> {
        let header = Recorded::running(&self.anchor, promise, now);
        self.write(&header, 0, &mut std::iter::empty())
    }

    /// Writes this run's first promise, before any connection is
    /// accepted: it replaces the earlier run's file.
    pub fn write_first(&mut self, promise: Promise) -> io::Result<()> {
        self.write_running(promise, 0)
            .map_err(|e| state_error(&self.dir, format!("cannot write: {e}")))
    }

    /// Writes the clean stop `stop` (see [`CleanStop`]) durably.
    pub fn save_clean_stop(&mut self, stop: &CleanStop<'_>) -> io::Result<()> {
        self.record_clean_stop(
            stop.next_token,
            stop.horizon,
            stop.counted_grants,
            stop.macs_until,
            stop.now(),
            stop.count,
            &mut stop.grants(),
        )
    }

    /// Records a clean stop at `now`: tokens from `next_token` on were never
    /// issued; the `count` `grants` were held; keys without a grant may
    /// still be held by an earlier run's lease until `horizon` (0 = none),
    /// which may be a counted grant when `counted_grants`; tokens up to
    /// `macs_until` may be bound to their keys.
    #[allow(clippy::too_many_arguments)]
    pub fn record_clean_stop<'a>(
        &mut self,
        next_token: u64,
        horizon: u64,
        counted_grants: bool,
        macs_until: u64,
        now: u64,
        count: usize,
        grants: &mut dyn Iterator<Item = SavedGrant<'a>>,
    ) -> io::Result<()> {
        let header = Recorded::written_at(
            true,
            &self.anchor,
            now,
            next_token,
            horizon,
            counted_grants,
            macs_until,
        );
        self.write(&header, count, grants)
    }

    /// Replaces the file atomically and durably: write a temporary file,
    /// fsync it, rename it over the old one, fsync the directory.
    /// `header` gives everything but the grants: `count` of them come
    /// from `grants`, encoded as they stream.
    fn write<'a>(
        &mut self,
        header: &Recorded,
        count: usize,
        grants: &mut dyn Iterator<Item = SavedGrant<'a>>,
    ) -> io::Result<()> {
        let temporary = self.dir.join(format!("{STATE_FILE}.tmp"));
        let file = open_private(
            &temporary,
            OpenOptions::new().create(true).write(true).truncate(true),
        )?;
        let mut out = ChecksumWriter::new(BufWriter::with_capacity(1 << 20, file));
        let kind = if header.clean_stop {
            KIND_CLEAN_STOP
        } else {
            KIND_RUNNING
        };
        write_header(
            &mut out,
            kind,
            &header.written,
            header.token_high_water,
            header.horizon_ms,
        )?;
        out.write_all(&[if header.counted_grants {
            FLAG_COUNTED_GRANTS
        } else {
            0
        }])?;
        out.write_all(&header.macs_until.to_be_bytes())?;
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

    fn u16(&mut self, what: &str) -> Result<u16, String> {
        let mut field = [0; 2];
        field.copy_from_slice(self.take(2, what)?);
        Ok(u16::from_be_bytes(field))
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
        2..=5 => parse_binary(bytes, version),
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

/// Versions 2 and 3: binary, with a checksum.
fn parse_binary(bytes: &[u8], version: u32) -> Result<Recorded, String> {
    let first_line = format!("kunci-state {version}\n");
    if bytes.len() < 8 {
        return Err("truncated: shorter than its checksum".into());
    }
    let (body, checksum) = bytes.split_at(bytes.len() - 8);
    let mut expected = [0; 8];
    expected.copy_from_slice(checksum);
    let mut reader = Reader {
        bytes: body,
        at: first_line.len(),
    };
    if !body.starts_with(first_line.as_bytes()) {
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
    let flags = if version >= 3 { reader.u8("flags")? } else { 0 };
    if flags & !FLAG_COUNTED_GRANTS != 0 {
        return Err(format!("unknown flags {flags:#04x}"));
    }
    let macs_until = if version >= 5 {
        reader.u64("macs until")?
    } else {
        0
    };
    if macs_until >= token_high_water.max(1) {
        return Err(format!(
            "macs until {macs_until} not below the token high-water mark {token_high_water}"
        ));
    }
    let count = reader.u64("grant count")?;
    if kind == KIND_RUNNING && count != 0 {
        return Err(format!("{count} grants in a file written while running"));
    }
    // A count beyond what the bytes can hold is damage, not a reason to
    // reserve memory.
    let room = (body.len() - reader.at) / grant_size_min(version);
    if count > room as u64 {
        return Err(format!("{count} grants listed, room for at most {room}"));
    }
    // A key listed twice is caught when the grants are restored.
    let grants_start = reader.at;
    for index in 0..count {
        let grant = decode_grant(&mut reader, index, version)?;
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
        version,
        clean_stop: kind == KIND_CLEAN_STOP,
        written,
        token_high_water,
        horizon_ms,
        counted_grants: flags & FLAG_COUNTED_GRANTS != 0,
        macs_until,
        grant_count: count,
        grant_bytes: body[grants_start..reader.at].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
    fn the_adoption_secret_is_made_once_private_and_never_rewritten() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("secret");
        let binding = |state: &StateDir| state.binding().token(b"db", 1);
        let first = {
            let state = StateDir::open(&dir).unwrap();
            binding(&state)
        };
        let path = dir.join(SECRET_FILE);
        let metadata = fs::metadata(&path).unwrap();
        assert_eq!(metadata.len(), 16);
        assert_eq!(metadata.permissions().mode() & 0o777, 0o600);
        let bytes = fs::read(&path).unwrap();
        let modified = metadata.modified().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let state = StateDir::open(&dir).unwrap();
        assert_eq!(binding(&state), first, "the same secret after a reopen");
        assert_eq!(fs::read(&path).unwrap(), bytes);
        assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), modified);
        assert_eq!(format!("{:?}", state.binding()), "TokenBinding(<secret>)");
        drop(state);
        // Another directory, another secret.
        let other_dir = temp_dir("secret-other");
        let other = binding(&StateDir::open(&other_dir).unwrap());
        assert_ne!(other, first);
        // A damaged secret stops the start, naming the file.
        fs::write(&path, b"short").unwrap();
        let error = StateDir::open(&dir).err().unwrap().to_string();
        assert!(error.contains("adoption.key: 5 bytes, not 16"), "{error}");
        // A secret made anew (the old one lost) adopts nothing the file
        // says the old one bound.
        fs::remove_file(&path).unwrap();
        let mut state = StateDir::open(&dir).unwrap();
        state.anchor(clocks("boot-a", 1, 1));
        let promise = Promise {
            token_high_water: 1 << 40,
            horizon: 0,
            counted_grants: false,
            macs_until: 1 << 39,
        };
        state.write_running(promise, 0).unwrap();
        drop(state);
        assert_eq!(StateDir::open(&dir).unwrap().recorded.macs_until, 1 << 39);
        fs::remove_file(&path).unwrap();
        assert_eq!(StateDir::open(&dir).unwrap().recorded.macs_until, 0);
        let _ = fs::remove_dir_all(&dir);
        let _ = fs::remove_dir_all(&other_dir);
    }

    #[test]
    fn a_running_promise_is_written_relative_to_its_write_and_survives_reopen() {
        let dir = temp_dir("running");
        {
            let mut state = StateDir::open(&dir).unwrap();
            assert_eq!(state.take_recorded(), Recorded::default());
            state.anchor(clocks("boot-a", 1_000_000, 50_000_000));
            let promise = Promise {
                token_high_water: 101 + 2 * TOKEN_BLOCK,
                horizon: 20_000_000,
                counted_grants: true,
                macs_until: 77 + TOKEN_BLOCK,
            };
            state.write_running(promise, 2_000).unwrap();
            assert_eq!(state.writes, 1);
            assert!(StateDir::open(&dir).is_err(), "second server got the lock");
        }
        let mut state = StateDir::open(&dir).unwrap();
        let recorded = state.take_recorded();
        assert_eq!(recorded.version, 5);
        assert_eq!(recorded.macs_until, 77 + TOKEN_BLOCK);
        assert!(!recorded.clean_stop);
        assert!(recorded.counted_grants);
        assert_eq!(recorded.token_high_water, 101 + 2 * TOKEN_BLOCK);
        // Written at 2 ms (rounded up from 2,000 µs), horizon at 20 s.
        assert_eq!(recorded.written, clocks("boot-a", 1_000_002, 50_000_002));
        assert_eq!(recorded.horizon_ms, 19_998);
        let _ = fs::remove_dir_all(&dir);
    }

    /// [`Recorded::running`] and [`Recorded::clean_stop`] say what the
    /// writes put in the file: read back, the file is that record.
    #[test]
    fn the_records_the_constructors_make_are_what_the_writes_put_on_disk() {
        use crate::core::{Core, Limits};
        use crate::protocol::Request;

        let dir = temp_dir("constructors");
        let anchor = clocks("boot-c", 1_000_000, 50_000_000);
        let promise = Promise {
            token_high_water: 5 + TOKEN_BLOCK,
            horizon: 7_300_001,
            counted_grants: true,
            macs_until: 4,
        };
        {
            let mut state = StateDir::open(&dir).unwrap();
            state.anchor(anchor.clone());
            state.write_running(promise, 2_500_001).unwrap();
        }
        let running = StateDir::open(&dir).unwrap().take_recorded();
        // Dated 2,501 ms, the horizon 4,800 ms after (both rounded up).
        assert_eq!(running.written, clocks("boot-c", 1_002_501, 50_002_501));
        assert_eq!(running.horizon_ms, 4_800);
        assert_eq!(running, Recorded::running(&anchor, promise, 2_500_001));

        let mut core = Core::new(Limits::default(), 5);
        core.connect(0);
        for (key, lease_s, label) in [("a", 10, ""), ("b", 30, "x")] {
            let request = Request::Acquire {
                wait_s: 0,
                lease_s,
                owner: 1,
                key,
                limit: 3,
                take: 1,
                label,
            };
            core.handle_request(0, &request, 1_000);
        }
        core.set_grace_until(9_000_500);
        let stop = CleanStop::of(&core, 4_000_250);
        {
            let mut state = StateDir::open(&dir).unwrap();
            state.anchor(anchor.clone());
            state.save_clean_stop(&stop).unwrap();
        }
        let clean = StateDir::open(&dir).unwrap().take_recorded();
        assert!(clean.clean_stop);
        assert_eq!(clean.grant_count(), 2);
        assert_eq!(clean.written, clocks("boot-c", 1_004_001, 50_004_001));
        assert_eq!(clean.horizon_ms, 5_001);
        assert_eq!(clean, Recorded::clean_stop(&anchor, &stop));
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
                    take: 0,
                    limit: 0,
                    label: "",
                    held_ms: 0,
                },
                SavedGrant {
                    key: "lång/ключ",
                    token: 8,
                    owner: 80,
                    left_ms: 30_000,
                    take: 2,
                    limit: 3,
                    label: "backup@host pid=42 ünïcode",
                    held_ms: 123_456,
                },
            ];
            state
                .record_clean_stop(9, 0, false, 0, 5_000_000, 2, &mut grants.into_iter())
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
        let restored: Vec<_> = recorded
            .grants()
            .map(|grant| {
                let left = restart.lease_left(grant.left_ms);
                let permits = (grant.take, grant.limit, grant.label);
                let held = restart.held_ms(grant.held_ms);
                (grant.key, grant.token, grant.owner, left, permits, held)
            })
            .collect();
        assert_eq!(
            restored,
            vec![
                ("short", 7, 70, None, (0, 0, ""), 2_500),
                (
                    "lång/ключ",
                    8,
                    80,
                    Some(Duration::from_millis(27_499)),
                    (2, 3, "backup@host pid=42 ünïcode"),
                    // Held 123.456 s at the stop, and the 2.5 s down.
                    125_956
                )
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
                take: 1,
                limit: 2,
                label: "l",
                held_ms: 0,
            };
            state
                .record_clean_stop(9, 7_000, true, 0, 0, 1, &mut std::iter::once(grant))
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
        let newer = b"kunci-state 6\nwhatever";
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

    /// A version 2 file as the previous build wrote it: clean stop, the
    /// grants as (token, owner, lease ms left, key).
    fn version_2_file(horizon_ms: u32, grants: &[(u64, u64, u32, &str)]) -> Vec<u8> {
        let mut body = b"kunci-state 2\n".to_vec();
        body.push(KIND_CLEAN_STOP);
        body.push(6);
        body.extend_from_slice(b"boot-a");
        body.extend_from_slice(&1_000_000u64.to_be_bytes());
        body.extend_from_slice(&50_000_000u64.to_be_bytes());
        body.extend_from_slice(&100u64.to_be_bytes());
        body.extend_from_slice(&horizon_ms.to_be_bytes());
        body.extend_from_slice(&(grants.len() as u64).to_be_bytes());
        for &(token, owner, left_ms, key) in grants {
            body.extend_from_slice(&token.to_be_bytes());
            body.extend_from_slice(&owner.to_be_bytes());
            body.extend_from_slice(&left_ms.to_be_bytes());
            body.push(key.len() as u8);
            body.extend_from_slice(key.as_bytes());
        }
        let checksum = fnv1a(FNV_OFFSET, &body);
        body.extend_from_slice(&checksum.to_be_bytes());
        body
    }

    /// A version 3 file as the previous build wrote it (clean stop; grants
    /// as token, owner, lease ms left, take, limit, key, label).
    fn version_3_file(grants: &[(u64, u64, u32, u16, u16, &str, &str)]) -> Vec<u8> {
        let mut body = b"kunci-state 3\n".to_vec();
        body.push(KIND_CLEAN_STOP);
        body.push(6);
        body.extend_from_slice(b"boot-a");
        body.extend_from_slice(&1_000_000u64.to_be_bytes());
        body.extend_from_slice(&50_000_000u64.to_be_bytes());
        body.extend_from_slice(&100u64.to_be_bytes());
        body.extend_from_slice(&0u32.to_be_bytes());
        body.push(0);
        body.extend_from_slice(&(grants.len() as u64).to_be_bytes());
        for &(token, owner, left_ms, take, limit, key, label) in grants {
            body.extend_from_slice(&token.to_be_bytes());
            body.extend_from_slice(&owner.to_be_bytes());
            body.extend_from_slice(&left_ms.to_be_bytes());
            body.extend_from_slice(&take.to_be_bytes());
            body.extend_from_slice(&limit.to_be_bytes());
            body.push(key.len() as u8);
            body.extend_from_slice(key.as_bytes());
            body.push(label.len() as u8);
            body.extend_from_slice(label.as_bytes());
        }
        let checksum = fnv1a(FNV_OFFSET, &body);
        body.extend_from_slice(&checksum.to_be_bytes());
        body
    }

    #[test]
    fn version_3_is_read_with_its_labels_and_no_time_held() {
        let bytes = version_3_file(&[
            (7, 70, 1_000, 0, 0, "a", "leader@host"),
            (8, 80, 30_000, 1, 2, "b", ""),
        ]);
        let recorded = parse(&bytes, &Clocks::now()).unwrap();
        assert_eq!(recorded.version, 3);
        assert!(recorded.clean_stop);
        let grants: Vec<_> = recorded.grants().collect();
        assert_eq!(
            grants,
            vec![
                SavedGrant {
                    key: "a",
                    token: 7,
                    owner: 70,
                    left_ms: 1_000,
                    take: 0,
                    limit: 0,
                    label: "leader@host",
                    held_ms: 0,
                },
                SavedGrant {
                    key: "b",
                    token: 8,
                    owner: 80,
                    left_ms: 30_000,
                    take: 1,
                    limit: 2,
                    label: "",
                    held_ms: 0,
                },
            ]
        );
        let cut = &bytes[..bytes.len() - 9];
        assert!(parse(cut, &Clocks::now()).is_err());
    }

    #[test]
    fn version_2_is_read_as_exclusive_grants_without_limit_or_label() {
        let bytes = version_2_file(4_000, &[(7, 70, 1_000, "a"), (8, 80, 30_000, "b")]);
        let recorded = parse(&bytes, &Clocks::now()).unwrap();
        assert_eq!(recorded.version, 2);
        assert!(recorded.clean_stop);
        assert!(!recorded.counted_grants);
        assert_eq!(recorded.token_high_water, 100);
        assert_eq!(recorded.horizon_ms, 4_000);
        let grants: Vec<_> = recorded.grants().collect();
        assert_eq!(
            grants,
            vec![
                SavedGrant {
                    key: "a",
                    token: 7,
                    owner: 70,
                    left_ms: 1_000,
                    take: 0,
                    limit: 0,
                    label: "",
                    held_ms: 0,
                },
                SavedGrant {
                    key: "b",
                    token: 8,
                    owner: 80,
                    left_ms: 30_000,
                    take: 0,
                    limit: 0,
                    label: "",
                    held_ms: 0,
                },
            ]
        );
        let cut = &bytes[..bytes.len() - 9];
        assert!(parse(cut, &Clocks::now()).is_err());
    }

    #[test]
    fn a_grant_whose_take_does_not_fit_its_limit_or_an_unknown_flag_is_refused() {
        let dir = temp_dir("take");
        for (take, limit, fits) in [(1, 0, false), (3, 2, false), (2, 2, true), (0, 5, true)] {
            {
                let mut state = StateDir::open(&dir).unwrap();
                let grant = SavedGrant {
                    key: "k",
                    token: 3,
                    owner: 4,
                    left_ms: 5,
                    take,
                    limit,
                    label: "",
                    held_ms: 0,
                };
                state
                    .record_clean_stop(9, 0, false, 0, 0, 1, &mut std::iter::once(grant))
                    .unwrap();
            }
            let bytes = fs::read(dir.join(STATE_FILE)).unwrap();
            let parsed = parse(&bytes, &Clocks::now());
            assert_eq!(
                parsed.is_ok(),
                fits,
                "take {take} limit {limit}: {parsed:?}"
            );
            // The next open would refuse it.
            fs::remove_file(dir.join(STATE_FILE)).unwrap();
        }
        // The flags byte follows the 4-byte horizon; bit 1 is unknown.
        let mut state = StateDir::open(&dir).unwrap();
        state
            .record_clean_stop(9, 0, false, 0, 0, 0, &mut std::iter::empty())
            .unwrap();
        drop(state);
        let mut bytes = fs::read(dir.join(STATE_FILE)).unwrap();
        let flags_at =
            "kunci-state 4\n".len() + 2 + bytes["kunci-state 4\n".len() + 1] as usize + 28;
        assert_eq!(bytes[flags_at], 0);
        bytes[flags_at] = 2;
        let body = bytes.len() - 8;
        let checksum = fnv1a(FNV_OFFSET, &bytes[..body]);
        bytes[body..].copy_from_slice(&checksum.to_be_bytes());
        let error = parse(&bytes, &Clocks::now()).unwrap_err();
        assert!(error.contains("unknown flags"), "{error}");
        let _ = fs::remove_dir_all(&dir);
    }
}
